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
    """Reference of ``kpool_seed_tail_cache``: copy each request's last ``kpool`` tokens.

    Token ``i`` (with ``tslot[i] >= 0``) is copied to ring slot ``tslot % RING`` of block
    ``tslot // RING`` unless token ``i + kpool`` exists and has a valid tail slot in the
    same block. Slots past the tail buffer are skipped.
    """
    num_blocks, _, ring, _ = tail.shape
    n = tslot.shape[0]
    ts = tslot.to(torch.int64)
    ahead = torch.full_like(ts, -1)
    ahead[: max(n - kpool, 0)] = ts[kpool:]
    same_block = (ahead >= 0) & (torch.div(ahead, ring, rounding_mode="floor") == torch.div(ts, ring, rounding_mode="floor"))
    take = (ts >= 0) & (ts < num_blocks * ring) & ~same_block
    idx = take.nonzero().flatten()
    block, slot = ts[idx] // ring, ts[idx] % ring
    tail[block, 0, slot] = key[idx]
    tail[block, 1, slot] = gate_score[idx]


def expand_pools_and_append_tail(pool_ids, seq_lens, pool_size):
    """``[rows, n_pools]`` pool ids + token-granular ``seq_lens [rows]`` -> int32
    ``[rows, n_pools*P + P - 1]``: ``pool*P + o`` per selected pool (-1 for ids < 0), then
    the tail tokens ``[seq_len//P*P, seq_len)``, -1 padded. Negative ``seq_lens`` count as 0."""
    rows, n_pools = pool_ids.shape
    p = pool_size
    offs = torch.arange(p, device=pool_ids.device, dtype=torch.int64)
    ids = pool_ids.to(torch.int64)
    hist = torch.where(ids[:, :, None] >= 0, ids[:, :, None] * p + offs, -1).reshape(rows, n_pools * p)
    return torch.cat((hist, _tail_columns(seq_lens.to(torch.int64).clamp_min(0), p)), dim=1).to(torch.int32)


def _tail_columns(seq_lens, pool_size):
    """``[rows, P-1]`` int64 tail token ids of each row (``-1`` padded)."""
    start = torch.div(seq_lens, pool_size, rounding_mode="floor") * pool_size
    j = torch.arange(pool_size - 1, device=seq_lens.device, dtype=torch.int64)
    tok = start[:, None] + j
    return torch.where(tok < seq_lens[:, None], tok, -1)


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
    """Append the ``seq_len - pool_len*P`` tail tokens after each row's own history."""
    if pool_size == 1:
        return topk_result
    rows = topk_result.shape[0]
    start = pool_lens.to(torch.int64) * pool_size
    j = torch.arange(pool_size - 1, device=topk_result.device, dtype=torch.int64)
    tokens = start[:, None] + j
    valid = j[None, :] < (seq_lens.to(torch.int64) - start)[:, None]
    tail = _map_tokens(tokens, valid, page_table, topk_offsets)
    return torch.cat((topk_result.reshape(rows, -1), tail), dim=1)


def build_pooled_page_table(page_table, pool_size):
    """Every ``pool_size``-th column of a token page table, as a fresh row-major tensor."""
    idx = torch.arange(0, page_table.shape[-1], pool_size, device=page_table.device)
    return page_table.index_select(-1, idx).contiguous()


def compute_pooled_write_locs(page_table_64, pool_ids, pool_size):
    """Pool ids -> flat slots: ``page_table_64[(id // 64) * P] * 64 + id % 64`` (int64)."""
    ids = pool_ids.to(torch.int64)
    group = torch.div(ids, 64, rounding_mode="floor")
    page = page_table_64.index_select(0, group * pool_size).to(torch.int64)
    return page * 64 + torch.remainder(ids, 64)


def pooled_keys(kv_cache, locs, layout):
    """Stored entries at flat slots ``locs``: ``(codes [n, 128] uint8, scale [n] fp32)``."""
    return read_entries(kv_cache, locs, layout)


__all__ = [
    "compress_and_write", "decode_update", "seed_tail", "expand_pools_and_append_tail",
    "expand_pools_to_tokens", "append_tail_to_topk", "build_pooled_page_table",
    "compute_pooled_write_locs", "pooled_keys", "HEAD_DIM",
]
