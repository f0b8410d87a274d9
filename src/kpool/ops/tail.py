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
from .._backend import backend_for, pdl_launch
from .._checks import INT_DTYPES, check_head_dim, check_index_range, check_pool_size, check_tail, check_tensor
from ..layout import HEAD_DIM
from . import _jit, _pdl

BLOCK_TOKENS = 64


@triton.jit
def _seed_tail_kernel(tail_ptr, tail_block_stride, tail_head, key_ptr, key_stride, g_ptr, g_stride,
                      ts_ptr, take_ptr, n_tokens, RING: tl.constexpr, BT: tl.constexpr,
                      PDL: tl.constexpr):
    _pdl.grid_dependency_sync(PDL)
    # BT tokens per program; token i is copied where take[i] (see seed_rows)
    i = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    d = tl.arange(0, 128)
    live = i < n_tokens
    take = live & (tl.load(take_ptr + i, mask=live, other=0) != 0)
    ts = tl.where(take, tl.load(ts_ptr + i, mask=take, other=0).to(tl.int64), 0)
    dst = (ts // RING) * tail_block_stride + (ts % RING) * 128
    _jit.copy_rows_to_ring(tail_ptr, tail_head, dst, key_ptr, i * key_stride, g_ptr, i * g_stride, take, d)


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


def seed_rows(tslot, ring, num_ring_slots, kpool):
    """bool ``[n]``: the rows to seed (device ops, no host sync, graph-capturable).

    The seed's rule on the batch with its padding removed: a valid row (``0 <= tslot <
    num_ring_slots``) is seeded unless the valid row ``kpool`` valid rows later is in the same
    block (``tslot // RING``). With each request's rows contiguous, that is its last ``kpool``
    valid tokens, wherever padding sits.
    """
    ts = tslot.to(torch.int64)
    n = ts.numel()
    valid = (ts >= 0) & (ts < num_ring_slots)
    block = torch.div(ts, ring, rounding_mode="floor")
    rank = torch.cumsum(valid, 0) - 1  # rank among the valid rows
    packed = torch.full((n + kpool + 1,), -1, dtype=torch.int64, device=ts.device)
    packed.scatter_(0, torch.where(valid, rank, n + kpool), torch.where(valid, block, -1))  # block by rank
    ahead = packed[(rank + kpool).clamp(0, n + kpool)]
    return valid & (ahead != block)


def kpool_seed_tail_cache(tail_kv_cache, key, gate_score, tslot, kpool, head_dim=HEAD_DIM):
    """Seed each request's tail ring with its last ``kpool`` tokens of a prefill batch, in place.

    Parameters
    ----------
    tail_kv_cache : bf16 ``[num_blocks, 2, RING, 128]`` (padded block stride allowed).
    key, gate_score : bf16 ``[n_tokens, 128]`` (unit inner stride).
    tslot : int32/int64 ``[n_tokens]`` token-granular ring slots ``block*RING + pos % RING``;
        negative = padding, anywhere (between requests or inside one). The seed's rule on the
        valid rows in order: a valid row is copied unless the valid row ``kpool`` valid rows
        later is in the same block, so every request's last ``kpool`` valid tokens are seeded.
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
    ring_slots = tail_kv_cache.shape[0] * ring
    take = seed_rows(tslot, ring, ring_slots, kpool)
    _seed_tail_kernel[(triton.cdiv(n, BLOCK_TOKENS),)](
        tail_kv_cache, tail_kv_cache.stride(0), tail_kv_cache.stride(1),
        key, key.stride(0), gate_score, gate_score.stride(0), tslot.contiguous(), take, n,
        RING=ring, BT=BLOCK_TOKENS, **pdl_launch(key.device),
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
        RING=ring, KEEP=triton.next_power_of_2(max(keep, 1)), **pdl_launch(key.device),
    )
