"""The prefill write of a packed chunk batch in one launch: every pool the chunks complete,
and every request's ring.

Programs ``[0, n_pool_programs)`` compress the pools that lie inside their chunk (``BN`` pools
each, all slots read from the token rows); one program per request then completes the
pool the chunk started mid-way (its leading slots from the ring: the *head* pool), if the
chunk completes it, and seeds the ring with the chunk's trailing tokens, in that order
(a barrier between: the seeding may overwrite the ring slots the head pool reads). The pool
programs touch no ring, so the two kinds need no ordering. ``planning.prefill_plan`` builds the
tables (``KPoolCache.prefill`` uses it); their ranges are checked unless ``KPOOL_CHECK=0``,
under graph capture or for the cache's own tables (a host read of both tables).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import reference
from .._backend import backend_for, native_fp8, on_device_of, pdl_launch, register_cap, row_select
from .._checks import (check_bool, check_distinct, check_kv_cache, check_pool_size, check_tail, check_tensor,
                       range_checks_enabled)
from ..layout import HEAD_DIM, cdiv, fp8_max, next_pow2, resolve_fp8_dtype
from . import _jit, _pdl
from .compress import LOADS_FIRST_SLOTS, NUM_WARPS, block_pools

REQUEST_FIELDS = 8  # int64 per request row, see write_prefill
# CUDA register cap by P: at P=16 the kernel compiles to 132 registers (15 one-warp programs
# per SM; the request programs' ring path), 128 lets 16 run (H200: 64 requests / 262,144
# tokens 41.8 -> 38.1 us; an 8-byte spill in the request path)
MAX_REGS = {16: 128}
_REQUEST_FIELDS = tl.constexpr(REQUEST_FIELDS)  # the same, for the kernel


@triton.jit
def _prefill_kernel(kv_ptr, kv_f32_ptr, page_stride, num_slots, tail_ptr, tail_block_stride, tail_head,
                    key_ptr, key_stride, g_ptr, g_stride, ape_ptr, ape_stride,
                    pool_ptr, n_pools, n_pool_programs, req_ptr,
                    P: tl.constexpr, RING: tl.constexpr, PAGE: tl.constexpr, BN: tl.constexpr,
                    PRESHUFFLE: tl.constexpr, FP8_MAX: tl.constexpr, FNUZ: tl.constexpr,
                    ROUND_SCALE: tl.constexpr, NATIVE_FP8: tl.constexpr, KEEP: tl.constexpr,
                    ROW_SELECT: tl.constexpr, PDL: tl.constexpr):
    _pdl.grid_dependency_sync(PDL)
    pid = tl.program_id(0)
    d = tl.arange(0, 128)
    if pid < n_pool_programs:
        i, own, read = _jit.pool_tile(pid, n_pools, BN)
        dv = tl.max_contiguous(d, 4)  # as in _compress_kernel (H200, P=4: 47.97 -> 46.37 us)
        row = tl.load(pool_ptr + i * 2, mask=read, other=0)
        loc = tl.load(pool_ptr + i * 2 + 1, mask=read, other=-1)
        x = _jit.pool_vector(key_ptr, g_ptr, row * key_stride, row * g_stride, key_stride, g_stride,
                             tail_ptr, row, 0, row, row, ape_ptr, ape_stride, dv, read, BN, P, RING,
                             False, False, BN * P <= LOADS_FIRST_SLOTS)
        _jit.encode_and_store(kv_ptr, kv_f32_ptr, page_stride, x, loc, own & (loc >= 0) & (loc < num_slots), dv,
                              BN, PAGE, PRESHUFFLE, FP8_MAX, FNUZ, ROUND_SCALE, NATIVE_FP8)
    else:
        req = req_ptr + (pid - n_pool_programs).to(tl.int64) * _REQUEST_FIELDS
        one = tl.zeros((1,), tl.int64)  # [1] vectors: the pool helpers work on tiles of BN = 1 pools
        block = tl.load(req + 2)
        head_ring = tl.load(req + 6)
        if head_ring > 0:
            head_row = tl.load(req + 4)
            head_loc = one + tl.load(req + 7)
            x = _jit.pool_vector(key_ptr, g_ptr, one + head_row * key_stride, one + head_row * g_stride,
                                 key_stride, g_stride, tail_ptr, one + block * tail_block_stride, tail_head,
                                 one + tl.load(req + 5), one + head_ring, ape_ptr, ape_stride, d, one == 0,
                                 1, P, RING, True, ROW_SELECT)
            _jit.encode_and_store(kv_ptr, kv_f32_ptr, page_stride, x, head_loc,
                                  (one + block >= 0) & (head_loc >= 0) & (head_loc < num_slots), d,
                                  1, PAGE, PRESHUFFLE, FP8_MAX, FNUZ, ROUND_SCALE, NATIVE_FP8)
        tl.debug_barrier()  # the head pool's ring reads precede the seeding's ring writes
        _jit.seed_ring(tail_ptr, tail_block_stride, tail_head, key_ptr, key_stride, g_ptr, g_stride,
                       tl.load(req), tl.load(req + 1), block, tl.load(req + 3), d, RING, KEEP)


def _check_tables(pools, requests, tokens: int, p: int, num_slots: int, num_blocks: int) -> None:
    """Every row read is a token row or a slot of a listed ring block, every write a cache slot
    below ``num_slots`` or a ring slot of a block below ``num_blocks``, no slot written twice and no
    ring block used by two requests (host read of both tables)."""
    def bad(name, mask, what):
        if bool(mask.any()):
            k = int(mask.nonzero()[0, 0])
            raise ValueError(f"{name} row {k} {what}: {table_of[name][k].tolist()}")

    pl, rq = pools.cpu(), requests.cpu()
    table_of = {"pools": pl, "requests": rq}
    bad("pools", (pl[:, 0] < 0) | (pl[:, 0] > tokens - p), f"reads token rows outside 0..{tokens - 1} (T = {tokens})")
    bad("pools", pl[:, 1] >= num_slots, f"writes a slot outside the cache's {num_slots}")
    end_row, end_pos, block, keep = rq[:, 0], rq[:, 1], rq[:, 2], rq[:, 3]
    bad("requests", (keep < 0) | (keep > p), f"keeps n_keep outside 0..P = {p}")
    bad("requests", (keep > 0) & ((end_row < keep) | (end_row > tokens) | (end_pos < keep)),
        f"seeds rows or positions outside the batch (T = {tokens}) or before position 0")
    bad("requests", block >= num_blocks, f"names a ring block outside the tail's {num_blocks}")
    head_row, head_pos, head_ring, head_loc = rq[:, 4], rq[:, 5], rq[:, 6], rq[:, 7]
    bad("requests", (head_ring < 0) | (head_ring >= p), f"reads a head pool's ring slots outside 0..P - 1 = {p - 1}")
    head = head_ring > 0
    bad("requests", head & ((block < 0) | (head_pos < 0) | (head_row + head_ring < 0) | (head_row > tokens - p)),
        f"completes a head pool from rows outside the batch (T = {tokens}), a negative position or no ring block")
    bad("requests", head & (head_loc >= num_slots), f"writes a head pool outside the cache's {num_slots} slots")
    # programs run concurrently: two writing one slot, or one seeding a ring another reads, race
    uses_ring = ((keep > 0) | head) & (block >= 0)  # block < 0: no ring (a head pool without one raised above)
    check_distinct("requests", block[uses_ring], "ring blocks of the requests that seed or read a ring")
    check_distinct("pools / requests", torch.cat((pl[:, 1][pl[:, 1] >= 0], head_loc[head & (head_loc >= 0)])),
                   "cache slots written")


def launch_options(device, pool_size: int) -> dict:
    """Compile options of ``_prefill_kernel``: ``MAX_REGS`` applies to CUDA targets only."""
    return dict(num_warps=NUM_WARPS, enable_fp_fusion=False, **register_cap(device, MAX_REGS.get(pool_size)),
                **pdl_launch(device))


def write_prefill(kv_cache, tail, key, gate, ape, pools, requests, pool_size, *, layout=None, fp8_dtype=None,
                  round_scale=True):
    """Write a packed prefill batch's pools and seed its rings, in place (one launch).

    Parameters
    ----------
    kv_cache : uint8 ``[num_pages, PAGE, 132]``.
    tail : bf16 ``[num_blocks, 2, RING, 128]`` rings.
    key, gate : bf16 ``[T, 128]`` token-major rows (unit inner stride).
    ape : fp32 ``[P, 128]``.
    pools : int64 ``[n, 2]``: (token row of slot 0, flat cache slot, negative = skip) of each
        pool that lies inside its chunk.
    requests : int64 ``[R, 8]``, one row per request: ``(end_row, end_pos, block, n_keep)`` —
        rows ``[end_row - n_keep, end_row)`` hold positions ``[end_pos - n_keep, end_pos)`` and
        go to ring ``block`` (``n_keep <= P``; ``block < 0``: none) — then the head pool ``(row
        of slot 0, position of slot 0, slots read from the ring — 0: none, flat cache slot)``.
    pool_size : P. ``layout`` / ``fp8_dtype``: platform defaults when None.

    ``planning.prefill_plan`` builds ``pools`` and ``requests`` from per-request state. Writes
    only the slots in ``pools`` / the head pools and ring slots of the listed blocks; the
    tables are checked (one host read: ranges, and written slots and used ring blocks each
    listed once, since the programs run concurrently) unless ``KPOOL_CHECK=0`` or under graph
    capture.
    """
    check_bool("round_scale", round_scale)
    check_pool_size(pool_size)
    check_tensor("key", key, dtype=torch.bfloat16, ndim=2, inner_contiguous=True)
    device = key.device
    check_tensor("key", key, shape=(None, HEAD_DIM))
    check_tensor("gate", gate, dtype=torch.bfloat16, shape=tuple(key.shape), device=device, inner_contiguous=True)
    check_tensor("ape", ape, dtype=torch.float32, shape=(pool_size, HEAD_DIM), device=device, inner_contiguous=True)
    check_tensor("pools", pools, dtype=torch.int64, shape=(None, 2), device=device)
    check_tensor("requests", requests, dtype=torch.int64, shape=(None, REQUEST_FIELDS), device=device)
    for name, t in (("pools", pools), ("requests", requests)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")
    fp8_dtype = resolve_fp8_dtype(fp8_dtype, device)
    layout = check_kv_cache(kv_cache, layout, device)
    check_tail(tail, pool_size, device, "tail")
    if range_checks_enabled():
        _check_tables(pools, requests, key.shape[0], pool_size, kv_cache.shape[0] * kv_cache.shape[1], tail.shape[0])
    launch_prefill(kv_cache, tail, key, gate, ape, pools, requests, pool_size, layout, fp8_dtype, round_scale)


@on_device_of("key")
def launch_prefill(kv_cache, tail, key, gate, ape, pools, requests, pool_size, layout, fp8_dtype, round_scale) -> None:
    """``write_prefill`` of arguments already validated (by it, or built by ``KPoolCache`` for
    its own buffers), ``layout`` / ``fp8_dtype`` resolved: the torch reference or one launch,
    no checks."""
    n, r = pools.shape[0], requests.shape[0]
    if n + r == 0:
        return
    if backend_for(key.device) == "torch":
        reference.write_prefill(kv_cache, tail, key, gate, ape, pools, requests, pool_size, fp8_dtype, layout,
                                round_scale)
        return
    block = block_pools(pool_size, max(n, 1))
    programs = cdiv(n, block)
    _prefill_kernel[(programs + r,)](
        kv_cache, kv_cache.view(torch.float32), kv_cache.stride(0), kv_cache.shape[0] * kv_cache.shape[1],
        tail, tail.stride(0), tail.stride(1), key, key.stride(0), gate, gate.stride(0), ape, ape.stride(0),
        pools, n, programs, requests,
        P=pool_size, RING=tail.shape[2], PAGE=kv_cache.shape[1], BN=block, PRESHUFFLE=layout == "preshuffle",
        FP8_MAX=fp8_max(fp8_dtype), FNUZ=fp8_dtype == torch.float8_e4m3fnuz, ROUND_SCALE=round_scale,
        NATIVE_FP8=native_fp8(key.device, fp8_dtype), KEEP=next_pow2(pool_size), ROW_SELECT=row_select(),
        **launch_options(key.device, pool_size),
    )
