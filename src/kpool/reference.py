"""Pure-torch oracle of every op (SPEC.md), token by token where that is clearest.

Also the ``torch`` backend: the public functions call these after validating their
arguments, so these functions assume valid, already-checked inputs. They never import
Triton. Cache writers update ``kv_cache`` / ``tail`` in place and return None.
"""

from __future__ import annotations

import torch

from . import numerics
from .layout import HEAD_DIM, read_entries, write_entries

_F32 = torch.float32


def compress_and_write(kv_cache, slot_k, slot_score, ape, loc, write_mask, fp8_dtype, layout,
                       round_scale=True, return_compressed=False, write_cache=True):
    """Reference of ``kpool_compress_and_write_cache``: pools ``[n, P, 128]`` -> entries at ``loc``.

    Writes only rows with ``0 <= loc < num_slots`` (and ``write_mask`` when given).
    Returns ``(codes [n, 128] fp8_dtype, scale [n] fp32)`` when ``return_compressed``.
    """
    codes, scale = numerics.compress_pools(slot_k, slot_score, ape, fp8_dtype, round_scale)
    if write_cache:
        num_slots = kv_cache.shape[0] * kv_cache.shape[1]
        keep = (loc >= 0) & (loc < num_slots)
        if write_mask is not None:
            keep &= write_mask.to(torch.bool)
        write_entries(kv_cache, loc[keep], codes[keep], scale[keep], layout)
    if return_compressed:
        return codes.view(fp8_dtype), scale
    return None


def compress_token_pools(kv_cache, tail, key, gate, ape, meta, loc, pool_size, fp8_dtype, layout, round_scale=True):
    """Reference of ``ops.compress.compress_token_pools``: pool ``i`` takes its slot ``s`` from
    ring block ``meta[i, 1]`` at position ``meta[i, 2] + s`` when ``s < meta[i, 3]``, else from
    token row ``meta[i, 0] + s`` of ``key`` / ``gate`` ``[T, 128]``."""
    ring = tail.shape[2]
    row0, block, pos0, n_ring = (meta[:, j, None] for j in range(4))
    s = torch.arange(pool_size, device=key.device)[None, :]
    from_ring = s < n_ring
    rows = torch.where(from_ring, 0, row0 + s)
    slots = (pos0 + s) % ring
    blocks = block.expand(-1, pool_size)
    keys = torch.where(from_ring[..., None], tail[blocks, 0, slots], key[rows])
    gates = torch.where(from_ring[..., None], tail[blocks, 1, slots], gate[rows])
    compress_and_write(kv_cache, keys, gates, ape, loc, None, fp8_dtype, layout, round_scale)


def write_prefill(kv_cache, tail, key, gate, ape, pools, requests, pool_size, fp8_dtype, layout, round_scale=True):
    """Reference of ``ops.prefill.write_prefill``: the pools inside their chunk, each request's
    head pool (``requests[:, 4:8]``, when it reads the ring), then the rings are seeded."""
    n = pools.shape[0]
    zero = torch.zeros(n, dtype=torch.int64, device=pools.device)
    compress_token_pools(kv_cache, tail, key, gate, ape, torch.stack((pools[:, 0], zero, zero, zero), 1), pools[:, 1],
                         pool_size, fp8_dtype, layout, round_scale)
    head = requests[requests[:, 6] > 0]
    compress_token_pools(kv_cache, tail, key, gate, ape, head[:, [4, 2, 5, 6]], head[:, 7], pool_size, fp8_dtype,
                         layout, round_scale)
    seed_requests(tail, key, gate, requests[:, :4])


def decode_update(kv_cache, tail, tail_slot_mapping, key, slot_score, ape, slot_mapping, positions,
                  pool_size, fp8_dtype, layout, round_scale=True):
    """Reference of ``kpool_decode_update_and_maybe_write_cache_batched``.

    For each request ``b`` and each of its tokens ``t`` in order: a token at ``pos`` with
    ``pos % P == P - 1`` and valid pool slot and tail slot completes its pool from the ring
    (the ``P - 1`` previous positions) plus itself and writes it at ``slot_mapping[b, t]``;
    then every token with ``pos >= 0`` and a valid tail slot is stashed at ring slot
    ``pos % RING`` of block ``tail_slot // RING``.
    """
    num_blocks, _, ring, _ = tail.shape
    num_slots = kv_cache.shape[0] * kv_cache.shape[1]
    p = pool_size
    pos_all, loc_all, ts_all = positions.tolist(), slot_mapping.tolist(), tail_slot_mapping.tolist()
    for b in range(key.shape[0]):
        for t in range(key.shape[1]):
            pos, loc, ts = pos_all[b][t], loc_all[b][t], ts_all[b][t]
            if pos < 0 or not 0 <= ts < num_blocks * ring:
                continue
            block = ts // ring
            if pos % p == p - 1 and 0 <= loc < num_slots:
                ring_slots = [(pos - p + 1 + s) % ring for s in range(p - 1)]
                keys = torch.cat((tail[block, 0, ring_slots], key[b, t][None]))[None]
                gates = torch.cat((tail[block, 1, ring_slots], slot_score[b, t][None]))[None]
                codes, scale = numerics.compress_pools(keys, gates, ape, fp8_dtype, round_scale)
                write_entries(kv_cache, torch.tensor([loc], device=kv_cache.device), codes, scale, layout)
            tail[block, 0, pos % ring] = key[b, t]
            tail[block, 1, pos % ring] = slot_score[b, t]


def seed_tail(tail, key, gate_score, tslot, kpool):
    """Reference of ``kpool_seed_tail_cache``: the seed's rule on the batch without its padding.

    Valid tokens (``0 <= tslot < num_blocks * RING``) in order; the ``r``-th is copied to
    ring slot ``tslot % RING`` of block ``tslot // RING`` unless the ``(r + kpool)``-th is
    in the same block (so each request's last ``kpool`` tokens are seeded).
    """
    num_blocks, _, ring, _ = tail.shape
    rows = [i for i, t in enumerate(tslot.tolist()) if 0 <= t < num_blocks * ring]
    ts = [int(tslot[i]) for i in rows]
    for r, (i, t) in enumerate(zip(rows, ts)):
        if r + kpool < len(ts) and ts[r + kpool] // ring == t // ring:
            continue
        tail[t // ring, 0, t % ring] = key[i]
        tail[t // ring, 1, t % ring] = gate_score[i]


def seed_requests(tail, key, gate, meta):
    """Per-request ring seeding: ``meta [R, 4]`` int64 rows ``(end_row, end_pos, block, n_keep)``;
    rows ``[end_row - n_keep, end_row)`` go to ring slots ``pos % RING`` of ``block`` (< 0: skip)."""
    ring = tail.shape[2]
    for end_row, end_pos, block, n_keep in meta.tolist():
        if block < 0 or n_keep <= 0:
            continue
        rows = torch.arange(end_row - n_keep, end_row, device=key.device)
        slots = torch.arange(end_pos - n_keep, end_pos, device=key.device) % ring
        tail[block, 0, slots] = key[rows]
        tail[block, 1, slots] = gate[rows]


def expand_pools_and_append_tail(pool_ids, seq_lens, pool_size, *, width=None, page_table=None):
    """``[rows, n_pools]`` pool ids + token-granular ``seq_lens [rows]`` -> int32
    ``[rows, width]`` (default width ``n_pools*P + P - 1``): ``pool*P + o`` per selected pool
    (-1 for ids < 0), then the tail tokens ``[seq_len//P*P, seq_len)``, -1 padded up to
    ``width``. Negative ``seq_lens`` count as 0. With ``page_table [>= rows, W]`` every valid
    token ``t`` of row ``r`` becomes ``page_table[r, clamp(t, 0, W-1)]``."""
    rows, n_pools = pool_ids.shape
    p = pool_size
    offs = torch.arange(p, device=pool_ids.device, dtype=torch.int64)
    ids = pool_ids.to(torch.int64)
    hist = (ids[:, :, None] * p + offs).reshape(rows, n_pools * p)
    hist_ok = (ids[:, :, None] >= 0).expand(-1, -1, p).reshape(rows, n_pools * p)
    tail, tail_ok = _tail_columns(seq_lens.to(torch.int64).clamp_min(0), p)
    out = _map_tokens(torch.cat((hist, tail), dim=1), torch.cat((hist_ok, tail_ok), dim=1), page_table, None)
    if width is not None and width > out.shape[1]:
        pad = torch.full((rows, width - out.shape[1]), -1, dtype=torch.int32, device=out.device)
        out = torch.cat((out, pad), dim=1)
    return out


def _tail_columns(seq_lens, pool_size):
    """``[rows, P-1]`` int64 tail token ids of each row and their validity."""
    start = torch.div(seq_lens, pool_size, rounding_mode="floor") * pool_size
    j = torch.arange(pool_size - 1, device=seq_lens.device, dtype=torch.int64)
    tok = start[:, None] + j
    return tok, tok < seq_lens[:, None]


def _map_tokens(tokens, valid, page_table, topk_offsets):
    """Map request-relative token ids through ``page_table`` or ``topk_offsets``; -1 where invalid."""
    if page_table is not None:
        safe = tokens.clamp(0, page_table.shape[1] - 1)
        out = torch.gather(page_table.to(torch.int64), 1, safe)
    elif topk_offsets is not None:
        out = tokens + topk_offsets.reshape(-1, 1).to(torch.int64)
    else:
        out = tokens
    return torch.where(valid, out, -1).to(torch.int32)


def expand_pools_to_tokens(group_ids, group_valid, topk, pool_size, page_table=None, topk_offsets=None):
    """``[rows, topk/P]`` pool ids + validity -> ``[rows, topk]`` int32 token ids (mapped)."""
    rows = group_ids.shape[0]
    offs = torch.arange(pool_size, device=group_ids.device, dtype=torch.int64)
    tokens = (group_ids.to(torch.int64)[:, :, None] * pool_size + offs).reshape(rows, topk)
    valid = group_valid.to(torch.bool)[:, :, None].expand(-1, -1, pool_size).reshape(rows, topk)
    return _map_tokens(tokens, valid, page_table, topk_offsets)


def append_tail_to_topk(topk_result, seq_lens, pool_lens, pool_size, page_table=None, topk_offsets=None):
    """Append the ``seq_len - pool_len*P`` tail tokens (at most ``P-1``) after each row's own
    history (``topk_result`` int32 ``[rows, n_cols]``). Negative ``seq_lens`` / ``pool_lens``
    (padding rows) count as 0."""
    if pool_size == 1:
        return topk_result
    start = pool_lens.to(torch.int64).clamp_min(0) * pool_size
    j = torch.arange(pool_size - 1, device=topk_result.device, dtype=torch.int64)
    tokens = start[:, None] + j
    valid = j[None, :] < (seq_lens.to(torch.int64).clamp_min(0) - start)[:, None]
    tail = _map_tokens(tokens, valid, page_table, topk_offsets)
    return torch.cat((topk_result, tail), dim=1)


def build_pooled_page_table(page_table, pool_size):
    """Every ``pool_size``-th column of a token page table, as a fresh row-major tensor."""
    idx = torch.arange(0, page_table.shape[-1], pool_size, device=page_table.device)
    return page_table.index_select(-1, idx).contiguous()


def compute_pooled_write_locs(page_table_64, pool_ids, pool_size):
    """Pool ids -> flat slots: ``page_table_64[(id // 64) * P] * 64 + id % 64`` (int64).

    Negative ids, and ids whose page row is past the end of ``page_table_64``, give -1.
    """
    ids = pool_ids.to(torch.int64)
    row = torch.div(ids, 64, rounding_mode="floor") * pool_size
    ok = (ids >= 0) & (row < page_table_64.shape[0])
    page = page_table_64.to(torch.int64)[torch.where(ok, row, 0)] if page_table_64.shape[0] else ids
    return torch.where(ok, page * 64 + torch.remainder(ids, 64), -1)


def pooled_keys(kv_cache, locs, layout):
    """Stored entries at flat slots ``locs``: ``(codes [n, 128] uint8, scale [n] fp32)``."""
    return read_entries(kv_cache, locs, layout)


__all__ = [
    "compress_and_write", "compress_token_pools", "write_prefill", "decode_update", "seed_tail", "seed_requests",
    "expand_pools_and_append_tail",
    "expand_pools_to_tokens", "append_tail_to_topk", "build_pooled_page_table",
    "compute_pooled_write_locs", "pooled_keys", "HEAD_DIM",
]


# =============================================================================================
# Query-side quantization, pooled fp8 logits and deterministic pool selection (issue 5).
# Exact formulation (same as ops/logits.py and ops/topk.py):
#  * an e4m3 code is an integer multiple of a unit (2^-9 fn, 2^-10 fnuz, |int| < 2^18);
#    a head's dot product q8.k8 is the exact integer sum (< 2^43: exact in int64 and in
#    fp64 whatever the order), converted once to fp32 (RNE), times unit^2 (exact);
#    NaN codes make the dot NaN;
#  * then, in fp32, s = dot * kscale, r = (s < 0 ? 0 : s), t[h] = w[h] * r, and the heads
#    are summed as a pairwise tree (H a power of two): ((t0 + t1) + (t2 + t3)) + ...;
#  * selection orders pools by the key (ordered score, -id): -0.0 == +0.0, NaN lowest.
# =============================================================================================

def fwht128_quant_fp8(q, fp8_dtype, round_scale=True):
    """``q [rows, 128]`` bf16 -> ``(codes [rows, 128] fp8_dtype, scale [rows, 1] fp32)``."""
    codes, scale = numerics.rotate_quant_rows(q, fp8_dtype, round_scale)
    return codes.view(fp8_dtype), scale[:, None]


def fp8_int_table(fp8_dtype, device):
    """``(ints [256] fp64, nan [256] bool, unit)``: code -> value / unit (NaN codes -> 0)."""
    unit = 2.0 ** -10 if fp8_dtype == torch.float8_e4m3fnuz else 2.0 ** -9
    vals = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8_dtype).to(torch.float64)
    nan = torch.isnan(vals)
    ints = torch.where(nan, 0.0, vals / unit)
    return ints.to(device), nan.to(device), unit


def pool_scores(q_codes, weights, k_codes, k_scale, fp8_dtype):
    """``sum_h w[r,h] * relu(q8[r,h].k8[j] * kscale[j])`` (exact formulation above) -> fp32 ``[R, N]``.

    ``q_codes [R, H, 128]`` / ``k_codes [N, 128]`` uint8 codes, ``weights [R, H]``,
    ``k_scale [N]`` fp32.
    """
    ints, nan, unit = fp8_int_table(fp8_dtype, q_codes.device)
    rows, heads, _ = q_codes.shape
    qi, qn = ints[q_codes.long()], nan[q_codes.long()].any(-1)  # [R, H, 128] fp64, [R, H]
    ki, kn = ints[k_codes.long()], nan[k_codes.long()].any(-1)  # [N, 128] fp64, [N]
    unit2 = torch.tensor(unit * unit, dtype=_F32, device=q_codes.device)
    kscale = k_scale.to(_F32)[None, :]
    stack = []  # pairwise head tree, streamed: (level, partial sum [R, N])
    for h in range(heads):
        dot = (qi[:, h] @ ki.T).to(_F32) * unit2  # exact integer sum, one rounding
        s = torch.where(qn[:, h, None] | kn[None, :], float("nan"), dot) * kscale
        t = weights[:, h, None].to(_F32) * torch.where(s < 0, 0.0, s)
        level = 0
        while stack and stack[-1][0] == level:
            t = stack.pop()[1] + t
            level += 1
        stack.append((level, t))
    assert len(stack) == 1, "H must be a power of two"
    return stack[0][1]


def paged_pool_logits(q_codes, kv_cache, weights, pool_lens, page_table, layout, fp8_dtype, max_pools):
    """Decode / verify pooled logits over the paged cache -> fp32 ``[B * next_n, max_pools]``.

    Pool ``j`` of request ``b`` is state ``j % PAGE`` of page ``page_table[b, j // PAGE]``;
    row ``(b, t)`` sees pools ``j < pool_lens[b, t]`` (clamped to ``[0, max_pages * PAGE]``),
    -inf elsewhere; a visible pool on a page id outside ``[0, num_pages)`` scores NaN.
    """
    batch, next_n = q_codes.shape[:2]
    num_pages, page = kv_cache.shape[:2]
    max_pages = page_table.shape[1]
    dev = q_codes.device
    out = torch.full((batch * next_n, max_pools), float("-inf"), dtype=_F32, device=dev)
    if max_pages == 0 or max_pools == 0:
        return out
    j = torch.arange(max_pools, device=dev, dtype=torch.int64)
    n_vis = pool_lens.to(torch.int64).clamp(0, min(max_pools, max_pages * page))
    for b in range(batch):
        pg = page_table[b].to(torch.int64)[torch.clamp(j // page, max=max_pages - 1)]
        ok = (pg >= 0) & (pg < num_pages) & (j < max_pages * page)
        if num_pages:
            codes, scale = read_entries(kv_cache, torch.where(ok, pg, 0) * page + j % page, layout)
            scores = pool_scores(q_codes[b].view(torch.uint8), weights[b], codes, scale, fp8_dtype)
        else:
            scores = torch.zeros(next_n, max_pools, dtype=_F32, device=dev)
        scores = torch.where(ok[None, :], scores, float("nan"))
        out[b * next_n:(b + 1) * next_n] = torch.where(j[None, :] < n_vis[b][:, None], scores, float("-inf"))
    return out


def ragged_pool_logits(q_codes, k_codes, k_scale, weights, ks, ke, fp8_dtype):
    """Prefill pooled logits over contiguous pools -> fp32 ``[T, N]``, -inf outside ``[ks, ke)``."""
    n = k_codes.shape[0]
    scores = pool_scores(q_codes.view(torch.uint8), weights, k_codes.view(torch.uint8), k_scale, fp8_dtype)
    j = torch.arange(n, device=k_codes.device, dtype=torch.int64)
    vis = (j[None, :] >= ks.to(torch.int64)[:, None]) & (j[None, :] < ke.to(torch.int64)[:, None])
    return torch.where(vis, scores, float("-inf"))


def pool_order_keys(logits):
    """Unique int64 ranking keys of ``logits [R, N]`` fp32: larger key = selected first.

    ``ordered(score) * 2^32 + (2^32 - 1 - id)`` where ``ordered`` maps fp32 to int32
    monotonically, with -0.0 -> +0.0 and every NaN -> INT32_MIN (below -inf).
    """
    bits = logits.contiguous().view(torch.int32)
    bits = torch.where(logits == 0, 0, bits)
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    ordered = torch.where(torch.isnan(logits), -2**31, ordered).to(torch.int64)
    ids = torch.arange(logits.shape[1], device=logits.device, dtype=torch.int64)
    return ordered * 2**32 + (2**32 - 1 - ids)


def select_pools(logits, pool_lens, select_k):
    """Deterministic top-``select_k`` pools per row -> int32 ``[R, select_k]``.

    Row ``r`` sees pools ``j < pool_lens[r]`` (clamped to ``[0, N]``). More than
    ``select_k`` visible: highest score first, ties to the lower id, NaN last. Otherwise:
    every visible pool in ascending id order. -1 padding.
    """
    rows, n = logits.shape
    dev = logits.device
    n_vis = pool_lens.to(torch.int64).clamp(0, n)
    keys = pool_order_keys(logits)
    ids = torch.arange(n, device=dev, dtype=torch.int64)
    keys = torch.where(ids[None, :] < n_vis[:, None], keys, -2**63)
    k = min(select_k, n)
    top = torch.full((rows, select_k), -1, dtype=torch.int64, device=dev)
    if k:
        top[:, :k] = torch.topk(keys, k, dim=1).indices
    cols = torch.arange(select_k, device=dev, dtype=torch.int64)
    out = torch.where((n_vis > select_k)[:, None], top, cols[None, :])
    return torch.where(cols[None, :] < n_vis.clamp(max=select_k)[:, None], out, -1).to(torch.int32)


__all__ += ["fwht128_quant_fp8", "fp8_int_table", "pool_scores", "paged_pool_logits", "ragged_pool_logits",
            "pool_order_keys", "select_pools"]


# =============================================================================================
# Indexer oracles (issue 5, integration: KPoolCache.topk_indices / KPoolIndexer).
#  * serving_*: the serving bytes end to end, from raw token keys / gates (one request):
#    one-shot pool compression (numerics.compress_pools), query rotation + fp8
#    (rotate_quant_rows), head-weight folding (fold_head_weights), the exact pooled logits
#    (pool_scores), deterministic selection, expansion + tail. KPoolCache.topk_indices must
#    return exactly these rows, whatever steps wrote the pools.
#  * hf_*: the model's bf16 reference math (peers_kpool.md §1.3; no Hadamard, no fp8):
#    fp32 softmax over the P slots per channel, probabilities to bf16, bf16 products, an
#    fp32-accumulated sum rounded to bf16; fp32 scores relu(q.k * 128^-0.5) per head,
#    weighted by w * H^-0.5. Its selection differs from the serving one by fp8
#    quantization only; compare selections as sets (Jaccard). Ties: lower pool id.
# =============================================================================================

def fold_head_weights(weights, q_scale):
    """Folded fp32 head weights ``(weights * q_scale) * fp32(128^-0.5 * H^-0.5)``.

    ``weights [..., H]`` fp32 (raw ``weights_proj`` output), ``q_scale`` with ``weights.numel()``
    elements (``[..., H]`` or ``[..., H, 1]``). The two constants are folded into ONE fp32
    constant (exactly ``2^-6`` at H = 32); ``q_scale`` is a power of two with ue8m0 scales.
    Used by ``KPoolCache.topk_indices`` on every backend.
    """
    c = torch.tensor(head_weight_scale(weights.shape[-1]), dtype=_F32)  # 0-dim CPU scalar: no copy, graph-safe
    return (weights.to(_F32) * q_scale.reshape(weights.shape).to(_F32)) * c


def head_weight_scale(heads: int) -> float:
    """``128^-0.5 * H^-0.5`` (a Python float; fp32-rounded where it is used)."""
    return HEAD_DIM ** -0.5 * heads ** -0.5


def visible_counts(positions, pool_size):
    """Tokens and complete pools a query at each position sees: int64 ``max(pos + 1, 0)`` and
    that ``// pool_size`` (the shape of ``positions``; a negative position is a padding row)."""
    seq = (positions.to(torch.int64) + 1).clamp_min(0)
    return seq, torch.div(seq, pool_size, rounding_mode="floor")


def serving_pool_logits(q, weights, keys, gates, ape, positions, pool_size, fp8_dtype, round_scale=True):
    """Serving-bytes pooled logits of one request's queries -> ``(logits [S, N] fp32, pool_lens [S])``.

    ``q [S, H, 128]`` bf16 (unrotated), ``weights [S, H]`` fp32 (raw), ``keys`` / ``gates``
    ``[L, 128]`` bf16 of the request's tokens ``0 .. L-1`` (L >= max position + 1), ``ape
    [P, 128]`` fp32, ``positions [S]``. ``N = L // P``; row ``s`` sees pools ``j <
    (positions[s] + 1) // P``, ``-inf`` elsewhere.
    """
    p = pool_size
    n = keys.shape[0] // p
    s_rows, heads = q.shape[:2]
    codes, scale = numerics.compress_pools(keys[: n * p].reshape(n, p, HEAD_DIM),
                                           gates[: n * p].reshape(n, p, HEAD_DIM), ape, fp8_dtype, round_scale)
    qc, qs = numerics.rotate_quant_rows(q.reshape(-1, HEAD_DIM), fp8_dtype, round_scale)
    w = fold_head_weights(weights, qs.reshape(s_rows, heads))
    scores = pool_scores(qc.reshape(s_rows, heads, HEAD_DIM), w, codes, scale, fp8_dtype)
    lens = visible_counts(positions, p)[1]
    j = torch.arange(n, device=q.device, dtype=torch.int64)
    return torch.where(j[None, :] < lens[:, None], scores, float("-inf")), lens


def serving_topk_indices(q, weights, keys, gates, ape, positions, pool_size, index_topk, fp8_dtype,
                         round_scale=True, width=None):
    """Serving-bytes selection of one request's queries (arguments: ``serving_pool_logits``).

    Returns ``(indices [S, width] int32, pool_ids [S, index_topk // P] int32, logits [S, N])``
    with ``width`` default ``index_topk + P - 1``: what ``KPoolCache.topk_indices`` returns
    for these queries.
    """
    logits, lens = serving_pool_logits(q, weights, keys, gates, ape, positions, pool_size, fp8_dtype, round_scale)
    pool_ids = select_pools(logits, lens, index_topk // pool_size)
    width = index_topk + pool_size - 1 if width is None else width
    seq = positions.to(torch.int64) + 1
    return expand_pools_and_append_tail(pool_ids, seq, pool_size, width=width), pool_ids, logits


def hf_pool_keys(keys, gates, ape, round_ape=True):
    """The model's bf16 pooling (peers_kpool.md §1.3) -> pooled keys ``[n, 128]`` bf16.

    ``keys`` / ``gates`` ``[n, P, 128]`` bf16, ``ape [P, 128]`` (rounded to bf16 first when
    ``round_ape``: the model loaded in bf16). ``p = bf16(softmax_slots(f32(g) + f32(ape)))``,
    products ``bf16(p * k)``, summed over the slots in fp32 in slot order, rounded to bf16.
    """
    a = ape.to(torch.bfloat16).to(_F32) if round_ape else ape.to(_F32)
    prob = torch.softmax(gates.to(_F32) + a[None], dim=1).to(torch.bfloat16)
    prod = (prob * keys.to(torch.bfloat16)).to(_F32)  # bf16 x bf16, each product rounded to bf16
    acc = prod[:, 0]
    for s in range(1, prod.shape[1]):
        acc = acc + prod[:, s]
    return acc.to(torch.bfloat16)


def hf_pool_logits(q, weights, keys, gates, ape, positions, pool_size, round_ape=True):
    """The model's bf16 reference logits of one request's queries -> ``(logits [S, N] fp32, pool_lens [S])``.

    Arguments as ``serving_pool_logits``. ``I[s, j] = sum_h (w[s, h] * H^-0.5) *
    relu((f32(q[s, h]) . f32(pooled[j])) * 128^-0.5)`` in fp32; pools a row does not see
    are ``-inf``. ``weights`` is used as given (HF rounds ``weights_proj``'s output to bf16:
    pass ``weights.bfloat16().float()`` to mimic that too).
    """
    p = pool_size
    n = keys.shape[0] // p
    s_rows, heads = q.shape[:2]
    pooled = hf_pool_keys(keys[: n * p].reshape(n, p, HEAD_DIM), gates[: n * p].reshape(n, p, HEAD_DIM), ape,
                          round_ape).to(_F32)
    qf = q.to(_F32)
    w = weights.to(_F32) * torch.tensor(heads ** -0.5, dtype=_F32, device=q.device)
    scale = torch.tensor(HEAD_DIM ** -0.5, dtype=_F32, device=q.device)
    out = torch.zeros((s_rows, n), dtype=_F32, device=q.device)
    for h in range(heads):
        out = out + w[:, h, None] * torch.relu((qf[:, h] @ pooled.T) * scale)
    lens = visible_counts(positions, p)[1]
    j = torch.arange(n, device=q.device, dtype=torch.int64)
    return torch.where(j[None, :] < lens[:, None], out, float("-inf")), lens


def hf_topk_indices(q, weights, keys, gates, ape, positions, pool_size, index_topk, round_ape=True, width=None):
    """The model's bf16 reference selection (``hf_pool_logits``; ties to the lower pool id,
    every visible pool in order when there are at most ``index_topk // P``).

    Returns ``(indices [S, width] int32, pool_ids [S, index_topk // P] int32, logits [S, N])``.
    """
    logits, lens = hf_pool_logits(q, weights, keys, gates, ape, positions, pool_size, round_ape)
    pool_ids = select_pools(logits, lens, index_topk // pool_size)
    width = index_topk + pool_size - 1 if width is None else width
    seq = positions.to(torch.int64) + 1
    return expand_pools_and_append_tail(pool_ids, seq, pool_size, width=width), pool_ids, logits


__all__ += ["fold_head_weights", "head_weight_scale", "serving_pool_logits", "serving_topk_indices", "hf_pool_keys",
            "hf_pool_logits", "hf_topk_indices"]
