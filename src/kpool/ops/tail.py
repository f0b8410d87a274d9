"""Ring seeding from a prefill batch: each request's trailing tokens go into its tail ring.

``kpool_seed_tail_cache`` is the seed-compatible entry point (token-granular tail slots;
a valid token is seeded unless the valid token ``kpool`` valid tokens later is in the same
ring block): one kernel; with padding near a program's rows it ranks the valid rows after
them through a scratch buffer.
``seed_requests`` is the per-request form ``KPoolCache`` uses: one program per request,
so the cost follows the number of requests, not of tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import reference
from .._backend import backend_for, on_device_of, pdl_launch
from .._checks import INT_DTYPES, check_head_dim, check_index_ranges, check_pool_size, check_tail, check_tensor
from ..layout import HEAD_DIM, cdiv, next_pow2
from . import _jit, _pdl

BLOCK_TOKENS = 64  # rows each program seeds
WINDOW = 512  # tail slots a program reads per step: its own rows, then the rows after them


@triton.jit
def _load_slots(ts_ptr, rows, n_tokens, num_ring_slots):
    """Tail slots of ``rows`` (int64; -1 past the batch) and whether each is valid."""
    ts = tl.load(ts_ptr + rows, mask=rows < n_tokens, other=-1).to(tl.int64)
    return ts, (ts >= 0) & (ts < num_ring_slots)


@triton.jit
def _same_block_ahead(ts_ptr, scratch, start, n_tokens, num_ring_slots, slot, mine,
                      KPOOL: tl.constexpr, RING: tl.constexpr, W: tl.constexpr):
    """[BT] bool: the valid row KPOOL valid rows after own row ``start + j`` (valid: ``mine``)
    exists and is in the same block, for any padding. Valid rows are ranked from 1 from
    ``start``; the blocks of ranks 1 .. n_own + KPOOL are packed by rank into ``scratch``
    (BT + KPOOL entries), reading W rows per step until that many are found or the batch
    ends (none when no own row is valid)."""
    w = tl.arange(0, W)
    n_own = tl.sum(mine.to(tl.int32), axis=0)
    need = n_own + KPOOL
    have = tl.full((), 0, tl.int32)
    while (have < need) & (start < n_tokens) & (n_own > 0):
        ts, valid = _load_slots(ts_ptr, start + w, n_tokens, num_ring_slots)
        rank = have + tl.cumsum(valid.to(tl.int32), axis=0)
        tl.store(scratch + rank - 1, ts // RING, mask=valid & (rank <= need))
        have += tl.sum(valid.to(tl.int32), axis=0)
        start += W
    tl.debug_barrier()  # the packed blocks are written before they are read
    ahead = tl.cumsum(mine.to(tl.int32), axis=0) + KPOOL  # the rank KPOOL valid rows later
    has_ahead = mine & (ahead <= tl.minimum(have, need))
    return has_ahead & (tl.load(scratch + ahead - 1, mask=has_ahead, other=-1) == slot // RING)


@triton.jit
def _seed_tail_kernel(tail_ptr, tail_block_stride, tail_head, key_ptr, key_stride, g_ptr, g_stride,
                      ts_ptr, rank_ptr, n_tokens, num_ring_slots,
                      KPOOL: tl.constexpr, RING: tl.constexpr, BT: tl.constexpr, W: tl.constexpr,
                      PDL: tl.constexpr):
    _pdl.grid_dependency_sync(PDL)
    # Program p seeds rows [p*BT, p*BT + BT): a valid row (0 <= tslot < num_ring_slots) is
    # copied unless the valid row KPOOL valid rows later is in its block. Without padding
    # in [p*BT, p*BT + BT + KPOOL) that row is row + KPOOL (two loads); else
    # _same_block_ahead ranks the valid rows through the program's scratch.
    pid = tl.program_id(0).to(tl.int64)
    i = pid * BT + tl.arange(0, BT)
    slot, mine = _load_slots(ts_ptr, i, n_tokens, num_ring_slots)
    later, later_valid = _load_slots(ts_ptr, i + KPOOL, n_tokens, num_ring_slots)
    dense = (mine | (i >= n_tokens)) & (later_valid | (i + KPOOL >= n_tokens))
    if (KPOOL <= BT) & (tl.min(dense.to(tl.int32), axis=0) == 1):
        same = later_valid & (later // RING == slot // RING)
    else:
        same = _same_block_ahead(ts_ptr, rank_ptr + pid * (BT + KPOOL), pid * BT, n_tokens, num_ring_slots,
                                 slot, mine, KPOOL, RING, W)
    take = mine & ~same
    slot = tl.where(take, slot, 0)
    dst = (slot // RING) * tail_block_stride + (slot % RING) * 128
    _jit.copy_rows_to_ring(tail_ptr, tail_head, dst, key_ptr, i * key_stride, g_ptr, i * g_stride, take,
                           tl.arange(0, 128))


@triton.jit
def _seed_requests_kernel(tail_ptr, tail_block_stride, tail_head, key_ptr, key_stride, g_ptr, g_stride, meta_ptr,
                          RING: tl.constexpr, KEEP: tl.constexpr, PDL: tl.constexpr):
    _pdl.grid_dependency_sync(PDL)
    # One program per request r: meta[r] = (end_row, end_pos, block, n_keep); rows
    # [end_row - n_keep, end_row) hold positions [end_pos - n_keep, end_pos).
    r = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, 128)
    end_row = tl.load(meta_ptr + r * 4)
    end_pos = tl.load(meta_ptr + r * 4 + 1)
    block = tl.load(meta_ptr + r * 4 + 2)
    n_keep = tl.load(meta_ptr + r * 4 + 3)
    _jit.seed_ring(tail_ptr, tail_block_stride, tail_head, key_ptr, key_stride, g_ptr, g_stride,
                   end_row, end_pos, block, n_keep, d, RING, KEEP)


@on_device_of("key")
def kpool_seed_tail_cache(tail_kv_cache, key, gate_score, tslot, kpool, head_dim=HEAD_DIM):
    """Seed each request's tail ring with its last ``kpool`` tokens of a prefill batch, in place.

    Parameters
    ----------
    tail_kv_cache : bf16 ``[num_blocks, 2, RING, 128]`` (padded block stride allowed).
    key, gate_score : bf16 ``[n_tokens, 128]`` (unit inner stride).
    tslot : int32/int64 ``[n_tokens]`` token-granular ring slots ``block*RING + pos % RING``;
        negative = padding, anywhere (between requests or inside one). The seed's rule on the
        valid rows in order: a valid row is copied unless the valid row ``kpool`` valid rows
        later is in the same block, so every request's last ``kpool`` valid tokens are seeded;
        the seeded slots must be distinct.
    kpool : P.
    """
    check_head_dim(head_dim)
    check_pool_size(kpool, "kpool")
    check_tensor("key", key, dtype=torch.bfloat16, ndim=2, inner_contiguous=True)
    device = key.device
    n = key.shape[0]
    check_tensor("key", key, shape=(n, HEAD_DIM))
    check_tensor("gate_score", gate_score, dtype=torch.bfloat16, shape=(n, HEAD_DIM), device=device,
                 inner_contiguous=True)
    check_tensor("tslot", tslot, dtype=INT_DTYPES, shape=(n,), device=device)
    ring = check_tail(tail_kv_cache, kpool, device)
    check_index_ranges([("tslot", tslot, tail_kv_cache.shape[0] * ring, "tail ring slots")],
                       distinct=[("tslot", lambda: (tslot, _seeded(tslot, kpool, ring)), "ring slots seeded")])
    if n == 0:
        return None
    if backend_for(device) == "torch":
        return reference.seed_tail(tail_kv_cache, key, gate_score, tslot, kpool)
    programs = cdiv(n, BLOCK_TOKENS)
    scratch = torch.empty(programs * (BLOCK_TOKENS + kpool), dtype=torch.int64, device=device)
    _seed_tail_kernel[(programs,)](
        tail_kv_cache, tail_kv_cache.stride(0), tail_kv_cache.stride(1),
        key, key.stride(0), gate_score, gate_score.stride(0), tslot.contiguous(), scratch, n,
        tail_kv_cache.shape[0] * ring,
        KPOOL=kpool, RING=ring, BT=BLOCK_TOKENS, W=WINDOW, **pdl_launch(device),
    )
    return None


def _seeded(tslot: torch.Tensor, kpool: int, ring: int) -> torch.Tensor:
    """bool ``[n_tokens]``: the rows ``kpool_seed_tail_cache`` copies (the seed's rule, on the
    device without a sync: valid rows packed by rank, each compared with the one ``kpool`` later)."""
    n = tslot.shape[0]
    valid = tslot >= 0
    rank = torch.cumsum(valid, 0) - 1
    block = torch.where(valid, tslot // ring, -1)
    packed = torch.full((n + kpool + 1,), -1, dtype=block.dtype, device=tslot.device)
    packed.scatter_(0, torch.where(valid, rank, n + kpool), block)  # invalid rows land on the last entry
    return valid & (packed[rank.clamp(min=0) + kpool] != block)


@on_device_of("key")
def seed_requests(tail, key, gate, meta, keep):
    """Per-request ring seeding (arguments already validated by the caller).

    ``meta``: int64 ``[R, 4]`` rows ``(end_row, end_pos, block, n_keep)`` with
    ``n_keep <= keep``; copies rows ``[end_row - n_keep, end_row)`` of ``key``/``gate``
    (``[T, 128]`` bf16) to ring slots ``pos % RING`` of ``block``. ``block < 0`` skips a row.
    """
    if meta.shape[0] == 0:
        return
    ring = tail.shape[2]
    if backend_for(key.device) == "torch":
        reference.seed_requests(tail, key, gate, meta)
        return
    _seed_requests_kernel[(meta.shape[0],)](
        tail, tail.stride(0), tail.stride(1), key, key.stride(0), gate, gate.stride(0), meta,
        RING=ring, KEEP=next_pow2(max(keep, 1)), **pdl_launch(key.device),
    )
