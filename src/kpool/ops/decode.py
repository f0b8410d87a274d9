"""Decode / speculative-verify step: complete pools from the ring, then stash every token.

One program per request handles its ``next_n`` tokens with the semantics of the in-order
loop (completion read, then stash): the slot ``s < P-1`` of a pool completed by token
``t`` reads the latest earlier token of the same step stashed at that ring slot, or the
ring as it was before the step. All ring reads precede all ring writes (barrier), so no
token waits on another's store, and only pool-completing tokens pay for a compression.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import reference
from .._backend import backend_for, native_fp8
from .._checks import (INT_DTYPES, check_head_dim, check_index_range, check_kv_cache, check_pool_size,
                       check_tail, check_tensor)
from ..layout import HEAD_DIM, fp8_max, resolve_fp8_dtype, resolve_layout
from . import _jit

SMALL_BATCH = 256  # requests; up to this many, a program (one request) gets 2 warps, else 1


def decode_warps(num_req: int) -> int:
    """Warps per program: 2 for batches of at most ``SMALL_BATCH`` requests, else 1 (H200 sweep
    of 1/2/4/8 warps over 24 configurations, benchmarks/NOTES.md)."""
    return 2 if num_req <= SMALL_BATCH else 1


@triton.jit
def _pick(t, j, v):
    # v[j] of a [NB] vector, as a scalar
    return tl.sum(tl.where(t == j, v, 0))


@triton.jit
def _slot_source(s, j, t, pos, blk, stash, pj, bj, one, P: tl.constexpr, RING: tl.constexpr):
    # Slot s of the pool completed by row j (position pj, block bj): its ring slot, and the step
    # row holding its token ([1] int64; -1: read the ring as it was before the step).
    want = (pj - (P - 1) + s) % RING
    if s == P - 1:
        src = one + j
    else:
        cand = (t < j) & stash & (blk == bj) & (pos % RING == want)
        src = one + tl.max(tl.where(cand, t, -1))
    return want, src


@triton.jit
def _complete_pool(kv_ptr, kv_f32_ptr, page_stride, tail_ptr, tail_head, key_ptr, key_sb, key_st,
                   g_ptr, g_sb, g_st, ape_ptr, ape_stride, b, j, t, pos, blk, stash, loc, ring_base, d,
                   P: tl.constexpr, RING: tl.constexpr, PAGE: tl.constexpr, PRESHUFFLE: tl.constexpr,
                   FP8_MAX: tl.constexpr, FNUZ: tl.constexpr, ROUND_SCALE: tl.constexpr,
                   NATIVE_FP8: tl.constexpr):
    # Compress the pool completed by step row j and write it. Slot s < P-1 (position
    # pos[j] - (P-1) + s) comes from the latest earlier row of this step stashed at that ring
    # slot of the same block, else from the ring as it was before the step; slot P-1 is row j.
    one = tl.zeros((1,), tl.int64)
    live = one == 0
    pj = _pick(t, j, pos)
    bj = _pick(t, j, blk)
    base = _pick(t, j, ring_base)
    top = tl.full((1, 128), float("-inf"), tl.float32)
    for s in tl.static_range(P):
        want, src = _slot_source(s, j, t, pos, blk, stash, pj, bj, one, P, RING)
        g = _jit.load_slot(g_ptr, one + b * g_sb + tl.maximum(src, 0) * g_st, tail_ptr,
                           one + base + want * 128 + tail_head, src < 0, live, d, True)
        top = tl.maximum(top, _jit.slot_logit(g, ape_ptr, ape_stride, s, d))
    acc = tl.zeros((1, 128), tl.float32)
    den = tl.zeros((1, 128), tl.float32)
    for s in tl.static_range(P):
        want, src = _slot_source(s, j, t, pos, blk, stash, pj, bj, one, P, RING)
        in_ring = src < 0
        g = _jit.load_slot(g_ptr, one + b * g_sb + tl.maximum(src, 0) * g_st, tail_ptr,
                           one + base + want * 128 + tail_head, in_ring, live, d, True)
        k = _jit.load_slot(key_ptr, one + b * key_sb + tl.maximum(src, 0) * key_st, tail_ptr,
                           one + base + want * 128, in_ring, live, d, True)
        acc, den = _jit.pool_accumulate(acc, den, _jit.slot_logit(g, ape_ptr, ape_stride, s, d), top, k)
    codes, scale = _jit.quantize(_jit.rotate(_jit.pool_finish(acc, den), 1), FP8_MAX, FNUZ, ROUND_SCALE,
                                 NATIVE_FP8)
    _jit.store_entries(kv_ptr, kv_f32_ptr, page_stride, one + _pick(t, j, loc), live, codes, scale, d,
                       PAGE, PRESHUFFLE)


@triton.jit
def _decode_update_kernel(kv_ptr, kv_f32_ptr, page_stride, num_slots,
                          tail_ptr, tail_block_stride, tail_head, num_ring_slots,
                          key_ptr, key_sb, key_st, g_ptr, g_sb, g_st, ape_ptr, ape_stride,
                          ts_ptr, ts_sb, ts_st, loc_ptr, loc_sb, loc_st, pos_ptr, pos_sb, pos_st,
                          next_n,
                          P: tl.constexpr, RING: tl.constexpr, PAGE: tl.constexpr, NB: tl.constexpr,
                          PRESHUFFLE: tl.constexpr, FP8_MAX: tl.constexpr, FNUZ: tl.constexpr,
                          ROUND_SCALE: tl.constexpr, NATIVE_FP8: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    t = tl.arange(0, NB)  # the request's tokens, in step order
    d = tl.arange(0, 128)
    live = t < next_n
    pos = tl.load(pos_ptr + b * pos_sb + t * pos_st, mask=live, other=-1).to(tl.int64)
    loc = tl.load(loc_ptr + b * loc_sb + t * loc_st, mask=live, other=-1).to(tl.int64)
    ts = tl.load(ts_ptr + b * ts_sb + t * ts_st, mask=live, other=-1).to(tl.int64)
    stash = live & (pos >= 0) & (ts >= 0) & (ts < num_ring_slots)
    pos = tl.where(stash, pos, 0)
    blk = tl.where(stash, ts, 0) // RING
    done = stash & (pos % P == P - 1) & (loc >= 0) & (loc < num_slots)
    ring_base = blk * tail_block_stride
    key_row = b * key_sb + t * key_st
    g_row = b * g_sb + t * g_st
    # stash plan and rows, loaded up front: the last token of the step aimed at each
    # (block, ring slot) wins
    slot = pos % RING
    later = (t[None, :] > t[:, None]) & stash[None, :] & (blk[None, :] == blk[:, None]) \
        & (slot[None, :] == slot[:, None])
    keep = stash & (tl.max(later.to(tl.int32), axis=1) == 0)
    k_rows = tl.load(key_ptr + key_row[:, None] + d[None, :], mask=keep[:, None])
    g_rows = tl.load(g_ptr + g_row[:, None] + d[None, :], mask=keep[:, None])
    # completions (at most ceil(next_n / P) per request): each reads the ring as it was
    # before the step or this step's earlier tokens, so all ring reads precede the stash
    for j in range(0, next_n):
        if _pick(t, j, done.to(tl.int32)) != 0:
            _complete_pool(kv_ptr, kv_f32_ptr, page_stride, tail_ptr, tail_head, key_ptr, key_sb, key_st,
                           g_ptr, g_sb, g_st, ape_ptr, ape_stride, b, j, t, pos, blk, stash, loc, ring_base, d,
                           P, RING, PAGE, PRESHUFFLE, FP8_MAX, FNUZ, ROUND_SCALE, NATIVE_FP8)
    tl.debug_barrier()
    dst = (ring_base + slot * 128)[:, None] + d[None, :]
    tl.store(tail_ptr + dst, k_rows, mask=keep[:, None])
    tl.store(tail_ptr + tail_head + dst, g_rows, mask=keep[:, None])

def kpool_decode_update_and_maybe_write_cache_batched(kv_cache, tail_kv_cache, tail_slot_mapping, key, slot_score,
                                                      ape, slot_mapping, positions, pool_size, head_dim=HEAD_DIM,
                                                      round_scale=True, *, layout=None, fp8_dtype=None):
    """Decode / speculative-verify update of the ring and the pooled cache, in place.

    For every request and each of its ``next_n`` tokens in order: a token at ``pos`` with
    ``pos % P == P - 1`` and valid slots compresses ring + itself into pool ``pos // P`` and
    writes it at ``slot_mapping``; then every token with ``pos >= 0`` and a valid tail slot
    is stashed at ring slot ``pos % RING`` of block ``tail_slot // RING``.

    Parameters
    ----------
    kv_cache : uint8 ``[num_pages, PAGE, 132]``.
    tail_kv_cache : bf16 ``[num_blocks, 2, RING, 128]``, ``RING % P == 0`` (padded block stride allowed).
    tail_slot_mapping : int32/int64 ``[B, next_n]`` token-granular ring slots, -1 = padding.
    key, slot_score : bf16 ``[B, next_n, 128]`` (unit inner stride).
    ape : fp32 ``[P, 128]``.
    slot_mapping : int32/int64 ``[B, next_n]`` pool slot on pool-completing tokens, else -1.
    positions : int32/int64 ``[B, next_n]`` token positions, -1 = padding.
    pool_size : P.
    layout, fp8_dtype : as in ``kpool_compress_and_write_cache``.
    """
    check_head_dim(head_dim)
    check_pool_size(pool_size)
    check_tensor("key", key, dtype=torch.bfloat16, ndim=3, inner_contiguous=True)
    device = key.device
    num_req, next_n = key.shape[0], key.shape[1]
    check_tensor("key", key, shape=(num_req, next_n, HEAD_DIM))
    check_tensor("slot_score", slot_score, dtype=torch.bfloat16, shape=tuple(key.shape), device=device,
                 inner_contiguous=True)
    check_tensor("ape", ape, dtype=torch.float32, shape=(pool_size, HEAD_DIM), device=device, inner_contiguous=True)
    for name, t in (("tail_slot_mapping", tail_slot_mapping), ("slot_mapping", slot_mapping),
                    ("positions", positions)):
        check_tensor(name, t, dtype=INT_DTYPES, shape=(num_req, next_n), device=device)
    layout = resolve_layout(layout, device)
    fp8_dtype = resolve_fp8_dtype(fp8_dtype, device)
    check_kv_cache(kv_cache, layout, device)
    ring = check_tail(tail_kv_cache, pool_size, device)
    check_index_range("slot_mapping", slot_mapping, kv_cache.shape[0] * kv_cache.shape[1], "cache slots")
    check_index_range("tail_slot_mapping", tail_slot_mapping, tail_kv_cache.shape[0] * ring, "tail ring slots")
    if num_req == 0 or next_n == 0:
        return None
    if backend_for(device) == "torch":
        return reference.decode_update(kv_cache, tail_kv_cache, tail_slot_mapping, key, slot_score, ape, slot_mapping,
                                       positions, pool_size, fp8_dtype, layout, round_scale)
    _decode_update_kernel[(num_req,)](
        kv_cache, kv_cache.view(torch.float32), kv_cache.stride(0), kv_cache.shape[0] * kv_cache.shape[1],
        tail_kv_cache, tail_kv_cache.stride(0), tail_kv_cache.stride(1), tail_kv_cache.shape[0] * ring,
        key, key.stride(0), key.stride(1), slot_score, slot_score.stride(0), slot_score.stride(1),
        ape, ape.stride(0),
        tail_slot_mapping, *tail_slot_mapping.stride(), slot_mapping, *slot_mapping.stride(),
        positions, *positions.stride(), next_n,
        P=pool_size, RING=ring, PAGE=kv_cache.shape[1], NB=triton.next_power_of_2(next_n),
        PRESHUFFLE=layout == "preshuffle", FP8_MAX=fp8_max(fp8_dtype), FNUZ=fp8_dtype == torch.float8_e4m3fnuz,
        ROUND_SCALE=round_scale, NATIVE_FP8=native_fp8(device, fp8_dtype), num_warps=decode_warps(num_req),
        enable_fp_fusion=False,
    )
    return None
