"""Decode / speculative-verify step: complete pools from the ring, then stash every token.

The semantics are SPEC.md's in-order walk: for each request, its ``next_n`` tokens in step
order; a pool-completing token compresses the ring slots of its pool (as this step's
earlier tokens left them) plus itself, then the token is stashed at its ring slot.

One program per request. A *regular* step (the stashed tokens are a prefix of the step, at
consecutive positions, in one ring block: every real decode / verify step, padding at the
end included) runs in parallel: a completion's slots come from the step's own rows or from
ring slots that no earlier token of the step has overwritten, so all completions of the
step are one ``[NC, 128]`` tile of pooled rows and ring slots, and every token that stays in
the ring is stashed at once. Any other step takes the in-order walk (``_in_order_step``),
which gives the same bytes for any input.

The ring slots a regular step stashes (positions ``pos0 .. pos0 + next_n - 1``) and those its
completions read (``pos0 - P + 1 .. pos0 - 1``) are distinct because ``RING >= P + next_n - 1``
(``check_ring_depth``), so no barrier orders them: at ``P >= STASH_FIRST_POOL`` the stash is stored
right after the completions' loads are issued, so that its writes drain while the pool is computed;
below, between the pooling and the rotation. The in-order walk stashes a token before its completion
(its slot is not one of its pool's: ``RING >= P``) in batches of up to ``WALK_STASH_FIRST_BATCH``
requests, else after it.

Under PDL (``_pdl``) every load follows the wait for the previous kernel in the stream, unless
the caller says the step's metadata (``positions``, ``tail_slot_mapping``, ``slot_mapping``) were
written before that kernel (``metadata_ready``; ``KPoolCache`` does: its tables are host copies
made at the step's start): then a program loads them *before* it waits, so that their round trip
overlaps the previous kernel's run instead of preceding the ring reads that depend on it (H100:
P=4 B=1,024 next_n 4 4.07 -> 3.75 us); rows, ring, ``ape`` and every store still follow the wait.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .. import reference
from .._backend import backend_for, native_fp8, on_device_of, pdl_launch, register_cap, row_select
from .._checks import (INT_DTYPES, check_bool, check_head_dim, check_index_ranges, check_kv_cache,
                       check_pool_size, check_ring_depth, check_tail, check_tensor, row_blocks)
from ..layout import HEAD_DIM, cdiv, fp8_max, next_pow2, resolve_fp8_dtype
from . import _jit, _pdl

SMALL_BATCH = 256  # requests; up to this many, a program (one request) gets 4 warps
# Pool sizes whose regular steps store the stash before the pooling (module doc). H100 graph steps,
# ab.py (benchmarks/LOG.md, 65th), stash after -> before, us: P=16 next_n 4 B = 1 / 256 / 1,024
# 1.22 / 3.67 / 5.42 -> 1.20 / 3.60 / 5.14, next_n 2 B = 1,024 4.56 -> 4.35; at P=4 (tried: next_n 4
# B = 1,024 3.75 -> 3.86) the short pooling leaves nothing to overlap and the early stores meet the
# step's loads instead; the one-token walk lost at B = 1,024 (P=4 2.34 -> 2.37, P=16 2.92 -> 3.02). Below, the
# stash between the pooling and the rotation, not after the completion behind a barrier (66th): P=4 B = 1 /
# 256 next_n 4 1.530 / 2.766 -> 1.490 / 2.724, next_n 2 B = 256 / 1,024 2.641 / 3.269 -> 2.615 / 3.239, but
# B = 1,024 next_n 4 3.760 -> 3.773 (without the barrier alone, stash last: 3.750).
STASH_FIRST_POOL = tl.constexpr(16)
# Batches (requests) up to which the in-order walk (one-token steps, irregular steps) stashes each
# token before its completion, not after. H200 graph steps, ab.py (LOG.md, 66th), next_n 1, after ->
# before, us: P=4 B = 1 / 2 / 4 / 8 0.904 / 0.991 / 1.084 / 1.140 -> 0.837 / 0.970 / 1.125 / 1.211;
# P=16 0.801 / 0.848 / 0.938 / 1.101 -> 0.775 / 0.821 / 0.924 / 1.105, slower at 16 and 32 (H100: B = 64 too).
WALK_STASH_FIRST_BATCH = 2


def decode_warps(num_req: int, next_n: int) -> int:
    """Warps per program (H200 sweeps, benchmarks/LOG.md): 4 up to ``SMALL_BATCH`` requests;
    above, 1 for verify steps (next_n >= 2; B=1024 next_n=4: P=4 4.50 -> 4.37 us, P=16
    6.77 -> 6.21 vs 2 / 4 warps), 2 for decode steps."""
    if num_req <= SMALL_BATCH:
        return 4
    return 1 if next_n > 1 else 2


# Register caps of one-token steps (the in-order walk), by (P, warps per program). H100 A/B of
# the uncapped walk (triton 3.6) / capped, us (benchmarks/LOG.md, 62nd): P = 16 B = 1 / 64 / 256 /
# 1,024: 1.00 / 2.37 / 3.04 / 4.44 -> 0.96 / 1.93 / 2.37 / 3.40; P = 4 B = 1,024 2.85 -> 2.79, but
# P = 4 at 4 warps (B <= 256) 1.5-3% slower capped: no cap there.
ONE_TOKEN_MAX_REGS = {(4, 2): 128, (16, 2): 128, (16, 4): 96}


def step_max_regs(next_n: int, pool_size: int, warps: int) -> int | None:
    """Register cap of a step's program: ``ONE_TOKEN_MAX_REGS`` for one-token steps, else None."""
    return ONE_TOKEN_MAX_REGS.get((pool_size, warps)) if next_n == 1 else None


def decode_options(num_req: int, next_n: int, pool_size: int, device) -> dict:
    """Compile options of a step's launch: ``decode_warps`` and ``step_max_regs`` (CUDA only)."""
    warps = decode_warps(num_req, next_n)
    return dict(num_warps=warps, **register_cap(device, step_max_regs(next_n, pool_size, warps)))


def step_tiles(next_n: int, pool_size: int) -> dict:
    """Constexpr tile sizes of a step: ``NB`` (>= next_n) tokens, ``NC`` (>= cdiv(next_n, P),
    the most pools a step of consecutive tokens completes) completions; powers of two."""
    return dict(NB=next_pow2(next_n), NC=next_pow2(cdiv(next_n, pool_size)))


@triton.jit
def _load_meta(ts_ptr, ts_off, loc_ptr, loc_off, pos_ptr, pos_off, ok):
    # Metadata of one step row (tail slot, pool slot, position); a row not ``ok`` reads as padding (-1).
    ts = tl.load(ts_ptr + ts_off, mask=ok, other=-1).to(tl.int64)
    loc = tl.load(loc_ptr + loc_off, mask=ok, other=-1).to(tl.int64)
    pos = tl.load(pos_ptr + pos_off, mask=ok, other=-1).to(tl.int64)
    return ts, loc, pos


@triton.jit
def _load_rows(key_ptr, key_row, g_ptr, g_row, ok, d):
    # Key and gate rows (bf16 [128]) of one step row; zeros where not ``ok``. The row mask is
    # built as a vector: the interpreter (triton 3.9) mis-broadcasts a scalar condition used as
    # a vector mask.
    rows = d < tl.where(ok, 128, 0)
    k = tl.load(key_ptr + key_row + d, mask=rows, other=0.0)
    g = tl.load(g_ptr + g_row + d, mask=rows, other=0.0)
    return k, g


@triton.jit
def _stash_tile(ring, tail_head, pos0, j, n_reg, k, g, d, RING: tl.constexpr):
    # A regular step's stash: rows j < n_reg of the [NB, 128] tiles at ring slots (pos0 + j) % RING.
    keep = (j < n_reg)[:, None] & (d[None, :] < 128)  # next_n <= RING - P + 1: no stash overwrites another
    _jit.store_ring_rows(ring + ((pos0 + j) % RING)[:, None] * 128 + d[None, :], tail_head, k, g, keep)


@triton.jit
def _in_order_step(kv_ptr, kv_f32_ptr, page_stride, num_slots, tail_ptr, tail_block_stride, tail_head,
                   num_ring_slots, key_ptr, key_sb, key_st, g_ptr, g_sb, g_st, ape_ptr, ape_stride,
                   ts_ptr, ts_sb, ts_st, loc_ptr, loc_sb, loc_st, pos_ptr, pos_sb, pos_st, next_n, b, d,
                   ts, loc, pos,
                   P: tl.constexpr, RING: tl.constexpr, PAGE: tl.constexpr, PRESHUFFLE: tl.constexpr,
                   FP8_MAX: tl.constexpr, FNUZ: tl.constexpr, ROUND_SCALE: tl.constexpr,
                   NATIVE_FP8: tl.constexpr, ROW_SELECT: tl.constexpr, STASH_FIRST: tl.constexpr):
    # Request b's tokens one at a time (``ts``, ``loc``, ``pos``: token 0's metadata, loaded by
    # the caller); token j + 1's metadata and rows are loaded before token j writes the ring
    # (software pipelining); a barrier after each token's ring writes. ``STASH_FIRST``: token j is
    # stashed before its completion, else after (its slot is not one its pool reads: RING >= P).
    one = tl.zeros((1,), tl.int64)  # [1] vectors: the pool helpers work on tiles of BN = 1 pools
    k, g = _load_rows(key_ptr, b * key_sb, g_ptr, b * g_sb, next_n > 0, d)
    for j in range(0, next_n):
        key_row = b * key_sb + j * key_st
        g_row = b * g_sb + j * g_st
        nj = j + 1
        ok1 = nj < next_n
        k1, g1 = _load_rows(key_ptr, key_row + key_st, g_ptr, g_row + g_st, ok1, d)
        ts1, loc1, pos1 = _load_meta(ts_ptr, b * ts_sb + nj * ts_st, loc_ptr, b * loc_sb + nj * loc_st,
                                     pos_ptr, b * pos_sb + nj * pos_st, ok1)
        stash = (pos >= 0) & (ts >= 0) & (ts < num_ring_slots)
        ring_off = (tl.where(stash, ts, 0) // RING) * tail_block_stride
        dst = tail_ptr + ring_off + (pos % RING) * 128 + d
        rows = d < tl.where(stash, 128, 0)  # as in _load_rows: a vector mask
        if STASH_FIRST:
            _jit.store_ring_rows(dst, tail_head, k, g, rows)
        if stash & (pos % P == P - 1) & (loc >= 0) & (loc < num_slots):
            # slots 0..P-2 from the ring as this step left it, slot P-1 is token j itself
            x = _jit.pool_vector(key_ptr, g_ptr, one + key_row, one + g_row, 0, 0,
                                 tail_ptr, one + ring_off, tail_head, one + pos - (P - 1), one + (P - 1),
                                 ape_ptr, ape_stride, d, one == 0, 1, P, RING, True, ROW_SELECT)
            _jit.encode_and_store(kv_ptr, kv_f32_ptr, page_stride, x, one + loc, one == 0, d, 1, PAGE, PRESHUFFLE,
                                  FP8_MAX, FNUZ, ROUND_SCALE, NATIVE_FP8)
        if not STASH_FIRST:
            _jit.store_ring_rows(dst, tail_head, k, g, rows)
        tl.debug_barrier()  # token j's ring writes precede token j + 1's ring reads
        k, g, ts, loc, pos = k1, g1, ts1, loc1, pos1


@triton.jit
def _decode_update_kernel(kv_ptr, kv_f32_ptr, page_stride, num_slots,
                          tail_ptr, tail_block_stride, tail_head, num_ring_slots,
                          key_ptr, key_sb, key_st, g_ptr, g_sb, g_st, ape_ptr, ape_stride,
                          ts_ptr, ts_sb, ts_st, loc_ptr, loc_sb, loc_st, pos_ptr, pos_sb, pos_st,
                          next_n,
                          P: tl.constexpr, RING: tl.constexpr, PAGE: tl.constexpr,
                          PRESHUFFLE: tl.constexpr, FP8_MAX: tl.constexpr, FNUZ: tl.constexpr,
                          ROUND_SCALE: tl.constexpr, NATIVE_FP8: tl.constexpr,
                          NB: tl.constexpr, NC: tl.constexpr, ROW_SELECT: tl.constexpr, PDL: tl.constexpr,
                          META_FIRST: tl.constexpr, WALK_STASH_FIRST: tl.constexpr):
    # NB >= next_n (a power of two), NC >= cdiv(next_n, P): the most completions in one step.
    # META_FIRST: the step's metadata is loaded before the PDL wait (module doc); without it the
    # loads keep the order they had before that option (H100: token 0's metadata loaded up
    # front cost P=4 B=1,024 next_n 4 4.06 -> 4.28 us there).
    if not META_FIRST:
        _pdl.grid_dependency_sync(PDL)
    b = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, 128)
    if META_FIRST:  # token 0's: the walk's first token, the regular path's pos0 and ring block
        ts0, loc0, pos0 = _load_meta(ts_ptr, b * ts_sb, loc_ptr, b * loc_sb, pos_ptr, b * pos_sb, next_n > 0)
    if NB == 1:  # one token: the walk is the step
        if META_FIRST:
            _pdl.grid_dependency_sync(PDL)
        else:
            ts0, loc0, pos0 = _load_meta(ts_ptr, b * ts_sb, loc_ptr, b * loc_sb, pos_ptr, b * pos_sb, next_n > 0)
        _in_order_step(kv_ptr, kv_f32_ptr, page_stride, num_slots, tail_ptr, tail_block_stride, tail_head,
                       num_ring_slots, key_ptr, key_sb, key_st, g_ptr, g_sb, g_st, ape_ptr, ape_stride,
                       ts_ptr, ts_sb, ts_st, loc_ptr, loc_sb, loc_st, pos_ptr, pos_sb, pos_st, next_n, b, d,
                       ts0, loc0, pos0, P, RING, PAGE, PRESHUFFLE, FP8_MAX, FNUZ, ROUND_SCALE, NATIVE_FP8, ROW_SELECT,
                       WALK_STASH_FIRST)
        return
    j = tl.arange(0, NB)
    in_step = j < next_n
    ts, loc, pos = _load_meta(ts_ptr, b * ts_sb + j * ts_st, loc_ptr, b * loc_sb + j * loc_st,
                              pos_ptr, b * pos_sb + j * pos_st, in_step)
    if META_FIRST:
        _pdl.grid_dependency_sync(PDL)
    else:
        pos0 = tl.load(pos_ptr + b * pos_sb).to(tl.int64)
        ts0 = tl.load(ts_ptr + b * ts_sb).to(tl.int64)
    block = ts0 // RING
    rows = in_step[:, None] & (d[None, :] < 128)
    k = tl.load(key_ptr + b * key_sb + j[:, None] * key_st + d[None, :], mask=rows, other=0.0)
    g = tl.load(g_ptr + b * g_sb + j[:, None] * g_st + d[None, :], mask=rows, other=0.0)
    stash = (pos >= 0) & (ts >= 0) & (ts < num_ring_slots)
    n_reg = tl.sum((stash & (pos == pos0 + j) & (ts // RING == block)).to(tl.int32), axis=0)
    # regular: the stashed tokens are exactly tokens 0 .. n_reg-1, at pos0 + j, in one block
    irregular = tl.max((stash != (j < n_reg)).to(tl.int32), axis=0)
    STASH_FIRST: tl.constexpr = P >= STASH_FIRST_POOL
    if irregular == 0:
        ring = tail_ptr + block * tail_block_stride
        # completing tokens j0, j0 + P, ...: slot s of token jc's pool is token jc - (P-1) + s,
        # or ring slot (pos0 + jc - (P-1) + s) % RING (not yet overwritten) when that is < 0
        c = tl.arange(0, NC)
        jc = (P - 1 - pos0 % P) % P + c * P
        loc_c = tl.sum(tl.where(j[None, :] == jc[:, None], loc[None, :], 0), axis=1)  # [NC]: token jc's slot
        complete = (jc < n_reg) & (loc_c >= 0) & (loc_c < num_slots)
        if tl.max(complete.to(tl.int32), axis=0) > 0:
            first = jc - (P - 1)
            gates, keys = _jit.load_pool_rows(key_ptr, g_ptr, b * key_sb + first * key_st, b * g_sb + first * g_st,
                                              key_st, g_st, ring, 0, tail_head, pos0 + first, tl.maximum(-first, 0),
                                              complete, d, P, RING, True, ROW_SELECT)
            apes = _jit.load_ape(ape_ptr, ape_stride, d, P)
            if STASH_FIRST:  # the stash's slots are not the completions' ring slots (module doc)
                _stash_tile(ring, tail_head, pos0, j, n_reg, k, g, d, RING)
            x = _jit.pool_rows(gates, keys, apes, NC, P)
            if not STASH_FIRST:  # below: between the pooling and the rotation
                _stash_tile(ring, tail_head, pos0, j, n_reg, k, g, d, RING)
            _jit.encode_and_store(kv_ptr, kv_f32_ptr, page_stride, x, loc_c, complete, d, NC, PAGE, PRESHUFFLE,
                                  FP8_MAX, FNUZ, ROUND_SCALE, NATIVE_FP8)
        else:
            _stash_tile(ring, tail_head, pos0, j, n_reg, k, g, d, RING)
    else:
        if not META_FIRST:
            ts0, loc0, pos0 = _load_meta(ts_ptr, b * ts_sb, loc_ptr, b * loc_sb, pos_ptr, b * pos_sb, next_n > 0)
        _in_order_step(kv_ptr, kv_f32_ptr, page_stride, num_slots, tail_ptr, tail_block_stride, tail_head,
                       num_ring_slots, key_ptr, key_sb, key_st, g_ptr, g_sb, g_st, ape_ptr, ape_stride,
                       ts_ptr, ts_sb, ts_st, loc_ptr, loc_sb, loc_st, pos_ptr, pos_sb, pos_st, next_n, b, d,
                       ts0, loc0, pos0, P, RING, PAGE, PRESHUFFLE, FP8_MAX, FNUZ, ROUND_SCALE, NATIVE_FP8, ROW_SELECT,
                       WALK_STASH_FIRST)


def kpool_decode_update_and_maybe_write_cache_batched(kv_cache, tail_kv_cache, tail_slot_mapping, key, slot_score,
                                                      ape, slot_mapping, positions, pool_size, head_dim=HEAD_DIM,
                                                      round_scale=True, *, layout=None, fp8_dtype=None,
                                                      metadata_ready=False):
    """Decode / speculative-verify update of the ring and the pooled cache, in place.

    For every request and each of its ``next_n`` tokens in order: a token at ``pos`` with
    ``pos % P == P - 1`` and valid slots compresses ring + itself into pool ``pos // P`` and
    writes it at ``slot_mapping``; then every token with ``pos >= 0`` and a valid tail slot
    is stashed at ring slot ``pos % RING`` of block ``tail_slot // RING``.

    Parameters
    ----------
    kv_cache : uint8 ``[num_pages, PAGE, 132]``.
    tail_kv_cache : bf16 ``[num_blocks, 2, RING, 128]``, ``RING % P == 0``, ``RING >= P + next_n - 1``
        (room for the step's speculative tokens; padded block stride allowed).
    tail_slot_mapping : int32/int64 ``[B, next_n]`` token-granular ring slots, -1 = padding;
        each request (row) its own ring block.
    key, slot_score : bf16 ``[B, next_n, 128]`` (unit inner stride).
    ape : fp32 ``[P, 128]``.
    slot_mapping : int32/int64 ``[B, next_n]`` pool slot on pool-completing tokens, else -1;
        the slots the step writes must be distinct.
    positions : int32/int64 ``[B, next_n]`` token positions, -1 = padding.
    pool_size : P.
    layout, fp8_dtype : as in ``kpool_compress_and_write_cache``.
    metadata_ready : bool. True promises that ``positions``, ``tail_slot_mapping`` and
        ``slot_mapping`` were written before the kernel launched just before this call (host
        copies or kernels at the step's start, as engines build them; not, say, a
        ``compute_pooled_write_locs`` right before): under PDL (CUDA sm_90+, ``KPOOL_PDL``) the
        kernel then loads them before it waits for that kernel (H100: 0.1-0.5 us off a step). A
        broken promise reads stale indices: wrong entries written. ``key`` / ``slot_score``
        may come from the kernel just before either way.
    """
    check_head_dim(head_dim)
    check_bool("round_scale", round_scale)
    check_bool("metadata_ready", metadata_ready)
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
    fp8_dtype = resolve_fp8_dtype(fp8_dtype, device)
    layout = check_kv_cache(kv_cache, layout, device)
    ring = check_tail(tail_kv_cache, pool_size, device)
    check_ring_depth("tail_kv_cache ring size", ring, pool_size, next_n)
    check_index_ranges([("slot_mapping", slot_mapping, kv_cache.shape[0] * kv_cache.shape[1], "cache slots"),
                        ("tail_slot_mapping", tail_slot_mapping, tail_kv_cache.shape[0] * ring, "tail ring slots")],
                       ring_slots=("tail_slot_mapping", tail_slot_mapping, positions, ring),
                       distinct=_step_writes(tail_slot_mapping, slot_mapping, positions, pool_size, ring))
    launch_decode_update(kv_cache, tail_kv_cache, tail_slot_mapping, key, slot_score, ape, slot_mapping, positions,
                         pool_size, layout, fp8_dtype, round_scale, metadata_ready)


def _step_writes(tail_slots, slot_mapping, positions, pool_size: int, ring: int) -> list:
    """``check_index_ranges``' ``distinct`` entries of a step (requests run concurrently):
    the cache slots its completing tokens write, and the ring blocks, each used by one request."""
    @functools.cache  # both entries use it; computed once, and only when the checks run
    def live():
        return (positions >= 0) & (tail_slots >= 0)

    def completions():
        return slot_mapping, live() & (positions % pool_size == pool_size - 1) & (slot_mapping >= 0)

    return [("slot_mapping", completions, "cache slots of completing tokens"),
            ("tail_slot_mapping", lambda: row_blocks(tail_slots // ring, live()), "ring blocks of the requests (rows)")]


@on_device_of("key")
def launch_decode_update(kv_cache, tail, tail_slots, key, gate, ape, slot_mapping, positions, pool_size, layout,
                         fp8_dtype, round_scale, metadata_ready) -> None:
    """The decode update of arguments already validated (by the public op above, or built by
    ``KPoolCache`` for its own buffers), ``layout`` / ``fp8_dtype`` resolved: the torch
    reference or one launch, no checks (they cost a step's host time once per layer)."""
    num_req, next_n = key.shape[0], key.shape[1]
    if num_req == 0 or next_n == 0:
        return
    device = key.device
    if backend_for(device) == "torch":
        reference.decode_update(kv_cache, tail, tail_slots, key, gate, ape, slot_mapping, positions, pool_size,
                                fp8_dtype, layout, round_scale)
        return
    ring = tail.shape[2]
    pdl = pdl_launch(device)
    _decode_update_kernel[(num_req,)](
        kv_cache, kv_cache.view(torch.float32), kv_cache.stride(0), kv_cache.shape[0] * kv_cache.shape[1],
        tail, tail.stride(0), tail.stride(1), tail.shape[0] * ring,
        key, key.stride(0), key.stride(1), gate, gate.stride(0), gate.stride(1), ape, ape.stride(0),
        tail_slots, *tail_slots.stride(), slot_mapping, *slot_mapping.stride(), positions, *positions.stride(), next_n,
        P=pool_size, RING=ring, PAGE=kv_cache.shape[1],
        PRESHUFFLE=layout == "preshuffle", FP8_MAX=fp8_max(fp8_dtype), FNUZ=fp8_dtype == torch.float8_e4m3fnuz,
        ROUND_SCALE=round_scale, NATIVE_FP8=native_fp8(device, fp8_dtype),
        **step_tiles(next_n, pool_size), ROW_SELECT=row_select(),
        **decode_options(num_req, next_n, pool_size, device), **pdl, META_FIRST=metadata_ready and pdl["PDL"],
        WALK_STASH_FIRST=num_req <= WALK_STASH_FIRST_BATCH,
        enable_fp_fusion=False,
    )
