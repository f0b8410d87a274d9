"""Ring seeding from a prefill batch: each request's trailing tokens go into its tail ring.

``kpool_seed_tail_cache`` is the seed-compatible entry point (token-granular tail slots;
a token is seeded when the token ``kpool`` rows ahead is in another ring block).
``seed_requests`` is the per-request form ``KPoolCache`` uses: one program per request,
so the cost follows the number of requests, not of tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import reference
from .._backend import backend_for
from .._checks import INT_DTYPES, check_head_dim, check_index_range, check_pool_size, check_tail, check_tensor
from ..layout import HEAD_DIM
from . import _jit

BLOCK_TOKENS = 64


@triton.jit
def _seed_tail_kernel(tail_ptr, tail_block_stride, tail_head, num_ring_slots,
                      key_ptr, key_stride, g_ptr, g_stride, ts_ptr, n_tokens,
                      KPOOL: tl.constexpr, RING: tl.constexpr, BT: tl.constexpr):
    # BT tokens per program; token i is seeded unless token i + KPOOL sits in the same block.
    i = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    d = tl.arange(0, 128)
    live = i < n_tokens
    ts = tl.load(ts_ptr + i, mask=live, other=-1).to(tl.int64)
    ahead = tl.load(ts_ptr + i + KPOOL, mask=live & (i + KPOOL < n_tokens), other=-1).to(tl.int64)
    valid = live & (ts >= 0) & (ts < num_ring_slots)
    ts = tl.where(valid, ts, 0)
    same_block = (ahead >= 0) & (tl.where(ahead >= 0, ahead, 0) // RING == ts // RING)
    take = valid & ~same_block
    dst = (ts // RING) * tail_block_stride + (ts % RING) * 128
    _jit.copy_rows_to_ring(tail_ptr, tail_head, dst, key_ptr, i * key_stride, g_ptr, i * g_stride, take, d)


@triton.jit
def _seed_requests_kernel(tail_ptr, tail_block_stride, tail_head, key_ptr, key_stride, g_ptr, g_stride, meta_ptr,
                          RING: tl.constexpr, KEEP: tl.constexpr):
    # One program per request r: meta[r] = (end_row, end_pos, block, n_keep); rows
    # [end_row - n_keep, end_row) hold positions [end_pos - n_keep, end_pos).
    r = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, 128)
    end_row = tl.load(meta_ptr + r * 4)
    end_pos = tl.load(meta_ptr + r * 4 + 1)
    block = tl.load(meta_ptr + r * 4 + 2)
    n_keep = tl.load(meta_ptr + r * 4 + 3)
    j = tl.arange(0, KEEP)
    take = j < tl.where(block >= 0, n_keep, 0)
    back = n_keep - j  # 1..n_keep rows before the end
    dst = block * tail_block_stride + ((end_pos - back) % RING) * 128
    _jit.copy_rows_to_ring(tail_ptr, tail_head, dst, key_ptr, (end_row - back) * key_stride,
                      g_ptr, (end_row - back) * g_stride, take, d)


def kpool_seed_tail_cache(tail_kv_cache, key, gate_score, tslot, kpool, head_dim=HEAD_DIM):
    """Seed each request's tail ring with its last ``kpool`` tokens of a prefill batch, in place.

    Parameters
    ----------
    tail_kv_cache : bf16 ``[num_blocks, 2, RING, 128]`` (padded block stride allowed).
    key, gate_score : bf16 ``[n_tokens, 128]`` (unit inner stride).
    tslot : int32/int64 ``[n_tokens]`` token-granular ring slots ``block*RING + pos % RING``;
        negative = padding. Token ``i`` is copied unless token ``i + kpool`` has a valid slot
        in the same block (so every request's trailing ``kpool`` tokens are seeded).
    kpool : P.
    """
    check_head_dim(head_dim)
    check_pool_size(kpool)
    check_tensor("key", key, dtype=torch.bfloat16, ndim=2, inner_contiguous=True)
    device = key.device
    n = key.shape[0]
    check_tensor("key", key, shape=(n, HEAD_DIM))
    check_tensor("gate_score", gate_score, dtype=torch.bfloat16, shape=(n, HEAD_DIM), device=device,
                 inner_contiguous=True)
    check_tensor("tslot", tslot, dtype=INT_DTYPES, shape=(n,), device=device)
    ring = check_tail(tail_kv_cache, kpool, device)
    check_index_range("tslot", tslot, tail_kv_cache.shape[0] * ring, "tail ring slots")
    if n == 0:
        return None
    if backend_for(device) == "torch":
        return reference.seed_tail(tail_kv_cache, key, gate_score, tslot, kpool)
    tslot = tslot.contiguous()
    _seed_tail_kernel[(triton.cdiv(n, BLOCK_TOKENS),)](
        tail_kv_cache, tail_kv_cache.stride(0), tail_kv_cache.stride(1), tail_kv_cache.shape[0] * ring,
        key, key.stride(0), gate_score, gate_score.stride(0), tslot, n,
        KPOOL=kpool, RING=ring, BT=BLOCK_TOKENS,
    )
    return None


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
        RING=ring, KEEP=triton.next_power_of_2(max(keep, 1)),
    )
