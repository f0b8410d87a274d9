"""Fused decode / speculative-verify scoring + selection: ``paged_pool_topk``.

The pooled logits of ``ops/logits.py`` and the selection of ``ops/topk.py`` in one pass
over the paged cache, without a logits row in memory: one program per (``ROWS`` query rows
of one request, leaf of ``CHUNK`` pools, ``topk.plan_leaves``) scores its leaf tile by tile
(``paged_tile_logits``, ``BLOCK_POOLS`` pools per tile, the next tile's entries loaded while
one is scored, the rows' fp16 query halves built once per program). Each key tile is decoded
once for the program's rows (verify steps and prefill chunks have several rows per request;
``query_rows``), then each row keeps its ranking keys on chip and reduces them to the
leaf's ``KB`` best (``topk.store_leaf``); rows with several leaves finish in
``topk.threshold_select``. A row that sees at most ``select_k`` pools scores nothing. Same
bytes as ``select_pools(paged_pool_logits(...))`` on every backend.

Filter and refine (``filters``; the default, ``$KPOOL_SCORER=exact`` turns it off): when the
leaves keep all their keys, hold at least ``FILTER_MIN_CHUNK`` pools each and the launch's
longest row has enough of them that its bound rank is at most ``FILTER_MAX_RANK`` (at select_k
512, from 8 wholly visible leaves up, e.g. 4,096 pools; rows long enough get leaves of
``2 * KB``, ``wide_plan``), the leaves score with one fp16 MMA of the
codes' values (``logits.approx_block_logits``: the products are exact, the MMA's
accumulation is not) instead of the exact dot, and keep two keys per pool: ``a - E * kscale``
and ``a + E * kscale`` (``logits.bound_keys``), with ``E`` per row from ``FILTER_ERROR``
(``logits.logit_error_scale``). The row bound comes from the lower keys, so at least
``select_k`` pools score at or above it exactly; the survivors are the pools whose upper key
reaches it, a superset of the exact selection; ``_refine_kernel`` replaces their keys by the
exact ones (``paged_tile_logits`` on the gathered entries) and the selection runs on those.
The result is the exact selection as long as the MMA's error stays within the budget:
``FILTER_ERROR = 2^-14`` of ``||q_h||_1 * FP8_MAX`` per head, at least ``2^-14`` of
``sum_d |q_d k_d|``. An fp32 accumulation of the 128 exact products in any order, rounding
or truncating, stays within ``2^-16`` of it; the H200's fp16 MMA measured ``2^-20``, and
``python -m kpool.exactness --ops score`` (32 x 65,536 pools, H 32 and 64, both formats and
layouts) is exact there (benchmarks/LOG.md). The epilogue sums a pool's relu'd, weighted head
dots before multiplying by its scale (once per pool); a scale outside ``[2^-32, 2^32]`` (not
written by kpool) and a row whose error scale is under ``2^-80`` (fp32 underflow would exceed
it) make their pools survivors. A NaN key or query code reaches the approximate
logit through the MMA (IEEE propagation; ``test_score``'s NaN key codes check it on each GPU)
and makes the pool a survivor (``logits.bound_keys``). Shorter rows of the same launch take their
bound from all their leaves' tile-position maxima (``topk.POSITION_KEYS`` lower keys per leaf,
when those hold ``select_k``: at select_k 512, from 8 leaves); rows shorter still keep every pool
as a survivor (all rescored exactly).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .. import reference
from .._backend import backend_for, on_device_of, pdl_launch, register_cap
from .._checks import MAX_SELECT, check_int
from ..layout import cdiv, fp8_max, next_pow2
from . import _pdl, select, topk
from ._jit_fp8 import halves_table
from .logits import (MIN_FILTER_ERROR, approx_block_logits, bound_keys, check_paged_args, decode_args,
                     logit_error_scale, paged_tile, paged_tile_logits, pool_entries, pool_limit, query_halves,
                     query_values, row_query, tile_pages)

BLOCK_POOLS = 64  # pools per scoring tile: the MMA's M (one wgmma warpgroup on Hopper)
NUM_WARPS = 4
MAX_REGS = 168  # CUDA register cap: 3 programs per SM instead of 2 (H200: 32 x 128K -10%, 128 x 1M -11%) ...
UNCAPPED_PER_SM = 2  # ... but a leaf grid that takes no more waves uncapped runs uncapped (small_grid): an SM holds
#                      2 uncapped programs (4 warps of up to 255 registers; H200, 1 x 128K, 256 exact leaves: 16.8
#                      -> 16.3 us, at 168 the leaf loop spills; 2 x 128K, 512 leaves in 2 waves either way: 25.6 ->
#                      24.8 us) ...
FILTER_UNCAPPED_PER_SM = 4  # ... or 4 uncapped one-row filtering leaves of H <= 32 (at 89 registers: sm_90 SASS; H200,
#                             512 leaves in one wave either way: 4 / 8 x 128K 29.0 -> 27.8 / 37.4 -> 35.2 us,
#                             32 x 32K 51.8 -> 50.6 us; since the 47th session's epilogue they take 76 registers
#                             uncapped, 6 per SM, and the cap below no longer binds: capped or not, the same residency)
REGISTERS_PER_SM = 65536  # 32-bit registers of an SM (every CUDA target kpool supports)
PIPELINE_STAGES = 2  # tiles in flight in the exact leaf loop (tl.range's software pipelining) ...
FILTER_PIPELINE_STAGES = 3  # ... and in the filtering one (pipeline_stages; H200, 27fde99 + cap 96: 32 x 128K 117.3 ->
#                             110.6 us, 128 x 1M 2.46 -> 2.39 ms at 3; 3 for the exact leaves: 1 x 128K 19.4 -> 19.9 us)
SCORER_ENV = "KPOOL_SCORER"
# The filter's error budget: the fp16 MMA's dot of one head is taken to be within
# FILTER_ERROR * ||q_h||_1 * FP8_MAX of the exact one (the H200 measured 2^-20 of sum |q_d k_d|,
# 15th session; 2^-14 also covers the rounding of the epilogue and of the bounds).
FILTER_ERROR = 2.0**-14
FILTER_SHAKE = 0.0  # tests only: move each approximate logit by this fraction of its bound
FILTER_MAX_REGS = 80  # one-row filtering leaves of H <= 32 (max_regs): 6 programs per SM, no spills (H200, H = 32,
#                       32 x 128K / 128 x 1M: 96 87.4 us / 1.75 ms, 80 85.8 / 1.72, 72 86.8 / 1.75 at 89 registers
#                       uncapped; at 76 (47th session) the cap no longer binds, and H100, 32 x 128K: 80 86.4 us, 72 (7
#                       per SM) 88.2, 64 (8 per SM, 7 spills) 91.3) ...
FILTER_MAX_REGS_H64 = 128  # ... and of H = 64 (120 registers: 4 programs per SM; H100 graph steps at 96, 5 per SM, no
#                            spills: 32 x 32K 63.2 -> 56.3 us but 4 / 16 x 128K +3 / +5.5%, 64 x 32K +2.6%; at 80 all
#                            slower: benchmarks/LOG.md, 54th)
FILTER_MAX_REGS_ROWS2 = 96  # two-row filtering leaves of H <= 32 (verify steps, prefill chunks): 5 programs per SM
#                              instead of 4 (118 registers uncapped, 10 spill loads at 96: sm_90 SASS; H100, prefill
#                              8,192 queries x 8,192 / 32,768 pools: 3.53 -> 3.38, 10.16 -> 9.37 ms; verify not timed)
FILTER_MIN_CHUNK = 256  # filter leaves of at least this many pools (H200, exact -> filter: 1 x 128K, leaves of
#                         128: 21.3 -> 32.3 us; 2 x 128K (128): 34.5 -> 38.8; 4 x 128K (256): 50.5 -> 45.8;
#                         32 x 128K (512): 216 -> 165; 128 x 1M: 5.71 -> 4.04 ms; prefill 8192 x 32K: 52 -> 30 ms)
FILTER_MAX_RANK = topk.POSITION_KEYS  # launches filter when their longest row's bound rank is at most this (from 8
#                                       leaves at select_k 512; H200, same call: decode 32 x 32K tokens 66.6 -> 55.8 us,
#                                       prefill 8192 x 32K within its spread of 21-32 ms; HEAD: from 32 leaves)
FILTER_WIDE_HEADS = 8  # filtering leaves of 2 x KB pools (wide_plan) for rows whose full leaves of that size
#                        still hold this many times select_k heads (128 x 1M: 256 x 16 = 8 x 512; H200:
#                        1,738 -> 1,638 us)
FILTER_SMALL_RANK = 8  # exact leaves of a small grid doubled into filtering ones (wide_plan) when their row-leaves
#                        exceed one uncapped wave and the rows' bound rank is at most this (H100, 9f56dec, us, exact ->
#                        filtering: 2 x 128K 26.0 -> 23.7, 1 x 128K next_n 2 30.9 -> 23.9, 4 x 64K 25.5 -> 23.5,
#                        1 x 256K 29.6 -> 25.7; rank 16 and 32 lose: 8 x 32K 26.1 -> 26.6, 16 x 16K 27.9 -> 32.3;
#                        so do grids of one wave: 1 x 128K 15.9 -> 21.3, 2 x 64K 16.0 -> 21.2); those of more
#                        than one wave are doubled into exact leaves that fit one (H100, e5481c5, us: 8 x 32K
#                        25.9 -> 21.8, 16 x 16K 27.9 -> 25.6, 64 x 4K 29.7 -> 28.4, but 32 x 8K 28.8 -> 29.9; H = 64:
#                        30.3 -> 26.8, 34.2 -> 33.1, 37.2 -> 35.0, 35.5 -> 36.4); and a small grid's filtering
#                        leaves under KB (at most FILTER_UNCAPPED_PER_SM programs per SM) above this rank go
#                        exact (H100, 68ed3d1, us, filtering -> exact leaves of 256: 64 x 8K 56.1 -> 39.3; verify,
#                        next_n 2: 32 x 8K 57.5 -> 35.3, 8 x 32K 39.6 -> 35.6, 16 x 16K 36.3 -> 35.6; but leaves
#                        of KB = 512 keep filtering: exact, 8 x 64K x 2 41.4 -> 54.4, 16 x 32K x 2 42.3 -> 58.1)
FILTER_SMALL_RANK_ROWS1 = 32  # ... but one-row leaves (decode steps) of such a small grid keep filtering up to this
#                               rank (H200, 3804322, us, exact -> filtering leaves of 256: 16 x 32K 36.5 -> 33.9 at
#                               rank 16, 32 x 16K 39.3 -> 34.2 at rank 32; 64 heads 47.4 -> 40.4, 50.4 -> 42.7; 16 heads
#                               33.7 -> 32.3, 35.2 -> 33.3; while verify steps, 2 rows a program, lose at 16 and 32:
#                               8 x 32K x 2 35.2 -> 37.2, 16 x 16K x 2 35.1 -> 35.7; 64 x 8K at rank 64 stays exact)
EXACT_PROGRAMS_PER_SM = 4  # exact plans of several leaves that keep all their keys take plan_leaves' leaves for this
#                            many programs per SM where those are finer and hold at least EXACT_MIN_CHUNK pools ...
EXACT_MIN_CHUNK = 256
EXACT_FINE_MAX_HEADS = 32  # ... at up to this many heads (H200, 3804322, us, exact leaves of 512 -> 256: 128 x 8K
#                            66.8 -> 59.2, 256 x 4K 67.6 -> 60.5, verify 64 x 8K x 2 62.5 -> 56.7, 128 x 4K x 2
#                            63.4 -> 57.9, 32 x 8K x 3 60.2 -> 52.8, x 4 62.4 -> 56.6, 64 x 4K x 3 62.8 -> 56.7, x 4
#                            63.4 -> 57.5; 16 heads 128 x 8K 57.2 -> 51.3, 64 x 8K x 2 52.1 -> 46.9; at 64 heads the
#                            verify steps gain 6-8% but 128 x 8K loses, 87.6 -> 116.2: its 1,024 programs take 2.6
#                            waves of 3 capped ones per SM, each with twice the query set-up) ...
EXACT_WIDE_HEADS_PER_SM = 4  # ... and above it where the split grid (query-row groups x leaves) holds at most this
#                              many programs per SM (H100, 4a3df8a, us, 64 heads, 0 -> 4: verify 32 x 8K x 3
#                              114.7 -> 107.5, 64 x 8K x 2 121.0 -> 113.6, 128 x 4K x 2 124.7 -> 119.8, 64 x 4K x 3
#                              119.1 -> 111.4; select_k 1,024: 16 x 32K x 3 250.9 -> 216.6, 4 x 128K x 2 123.6 ->
#                              118.3; not 128 x 8K's 1,024 programs, which lost 33% split on the H200); 0: never
FILTER_TIGHT_KEYS = 1.5  # filtering leaves halved (wide_plan, down to FILTER_MIN_CHUNK) while the longest row's
#                         full leaves hold at most this many times select_k position keys (at 512: up to 12 leaves):
#                         the row bound is then the select_k-th of twice the maxima, each over half the pools
#                         (H200, prefill 8,192 queries x 4,096 / 5,120 / 6,144 pools, ms: 6.5 -> 4.1, 6.1 -> 3.9,
#                         4.7 -> 4.2; halving at 7,168 pools, 14 leaves, would cost 4.5 -> 4.6)
REFINE_PROGRAMS_PER_SM = 4  # refine grid target (refine_programs) ...
REFINE_SURVIVORS = 8.0  # ... and survivors per select_k it plans for: a filtering launch's rows under 8 leaves
#                        keep every pool (up to 8 x select_k) and one such row sets the kernel's time (H200, 32
#                        rows, 11 -> 17 programs per row, two processes each: mixed 4K-128K 88.9, 89.3 -> 84.7,
#                        84.6 us, 32 x 32K 55.3 -> 52.1, 32 x 128K 76.3, 76.4 -> 77.0, 77.0; 9 -> 11 programs,
#                        with the query loaded before the count, had given refine 8.5 -> 6.7 us at 32 x 128K)
MAX_ROWS = 2  # query rows of one request per program (H200, verify 32 x 128K x 4 / prefill 8192 x 32K:
#               1 row 1,092 us / 69.2 ms, 2 rows 866 / 54.9; 4 rows 1,225 / 69.0, 960 / 57.6 uncapped: spills)


@triton.jit
def _paged_topk_kernel(q_ptr, q_sb, q_sn, q_sh, w_ptr, w_sb, w_sn, w_sh, lens_ptr, lens_stride,
                       pt_ptr, pt_sb, pt_sp, kv_ptr, kv_f32_ptr, page_stride, num_pages,
                       cand_ptr, count_ptr, out_ptr, out_stride, vis_limit, next_n, select_k, n_chunks, lut_ptr,
                       seq_ptr, seq_stride, n_tail,
                       PAGE: tl.constexpr, BN: tl.constexpr, NT: tl.constexpr, KB: tl.constexpr, H: tl.constexpr,
                       ROWS: tl.constexpr, PRESHUFFLE: tl.constexpr, FINAL: tl.constexpr, FNUZ: tl.constexpr,
                       NATIVE_FP8: tl.constexpr, FILTER: tl.constexpr, FP8_MAX: tl.constexpr, ERROR: tl.constexpr,
                       SHAKE: tl.constexpr, STAGES: tl.constexpr, P: tl.constexpr, PB: tl.constexpr,
                       TAIL: tl.constexpr, TAIL_BLOCK: tl.constexpr, PDL: tl.constexpr):
    _pdl.grid_dependency_wait(PDL)  # the next kernel launches after the tile loop (below)
    # Program (group, chunk): rows b * next_n + t for t in [t0, t0 + ROWS) of one request b
    # (same page table), pools [chunk * NT * BN, (chunk + 1) * NT * BN): each key tile is
    # decoded once and scored for all ROWS rows; each row keeps its KB best ranking keys. With
    # FINAL (one leaf per row) the rows' ids, or tokens and tails (topk.expansion_args).
    groups = tl.cdiv(next_n, ROWS)
    b = (tl.program_id(0) // groups).to(tl.int64)
    t0 = (tl.program_id(0) % groups).to(tl.int64) * ROWS
    chunk = tl.program_id(1).to(tl.int64)
    rr = tl.arange(0, ROWS)
    live = t0 + rr < next_n
    rows = b * next_n + t0 + rr  # [ROWS]
    safe_rows = tl.where(live, rows, b * next_n)  # rows past next_n: the first (zeroed again; upper bounds masked)
    topk.clear_counts(count_ptr, safe_rows, chunk, FINAL)
    n_vis = tl.minimum(tl.maximum(tl.load(lens_ptr + rows * lens_stride, mask=live, other=0).to(tl.int64), 0),
                       vis_limit)  # [ROWS], topk.visible_pools of each row
    n_max = tl.max(n_vis)
    if n_max > select_k:
        # the leaf's page ids first: the loop's first entry loads wait on them, not on the query
        # set-up (sm_90 SASS: the page-table load ~300 instructions before the first cp.async,
        # was ~70; H200 32 x 128K 77.7 -> 77.2 us)
        pt_row = pt_ptr + b * pt_sb
        j0 = chunk * NT * BN  # first pool of the tile
        j = j0 + tl.arange(0, BN)
        n_leaf = tl.minimum(n_max, (chunk + 1) * NT * BN)  # the leaf's last pool any row sees + 1
        pages = tile_pages(pt_row, pt_sp, j0, n_leaf, num_pages, NT, BN, PAGE)
        c = tl.arange(0, ROWS * H)  # (row, head) columns
        q_rows = q_ptr + b * q_sb + (t0 + c // H) * q_sn + (c % H) * q_sh
        q_live = t0 + c // H < next_n
        q, q_nan = query_halves(q_rows[None, :] + tl.arange(0, 64)[:, None], q_live[None, :], lut_ptr, FNUZ,
                                NATIVE_FP8)
        w = tl.load(w_ptr + b * w_sb + (t0 + c // H) * w_sn + (c % H) * w_sh, mask=q_live, other=0.0)
        if FILTER:  # keys: each tile position's best lower bound over the leaf's tiles; the upper bounds
            #         of the exact keys go to the lists tile by tile (module docstring)
            keys = tl.full((BN, ROWS), topk.NO_KEY, tl.int64)  # INT64_MIN = not seen
            q16, q_l1 = query_values(q)
            err = logit_error_scale(w, q_l1, H, ROWS, FP8_MAX, ERROR)  # [ROWS]
            lists = topk.leaf_list(cand_ptr, safe_rows * n_chunks + chunk, NT * BN, KB, FILTER)
        else:
            keys = tl.full((NT, BN, ROWS), topk.NO_KEY, tl.int64)
            tiles = tl.arange(0, NT)
        for i in tl.range(NT, num_stages=STAGES):
            # Triton's pipeliner loads later tiles' entries (cp.async into shared memory) while
            # this one is scored (with STAGES = 2, triton 3.6 issues the next tile at the end of
            # an iteration and waits for it at the top of the next: sm_90 SASS); the key codes
            # reach the MMA operand's layout as bytes
            codes, kscale, ok = paged_tile(kv_ptr, kv_f32_ptr, page_stride, num_pages, pages, i, pt_row, pt_sp, j0,
                                           n_leaf, PAGE, BN, PRESHUFFLE)
            hi = tl.full((BN, ROWS), topk.NO_UPPER, tl.int32)  # tiles no row sees: not seen
            if (chunk * NT + i) * BN < n_max:
                seen = j[:, None] < n_vis[None, :]  # [BN, ROWS]
                if FILTER:
                    a = approx_block_logits(q16, w, codes, kscale, lut_ptr, BN, H, ROWS, FNUZ, NATIVE_FP8)
                    a = tl.where(seen, tl.where(ok[:, None], a, float("nan")), float("-inf"))
                    e = tl.abs(kscale)[:, None] * err[None, :]  # a negative scale (not ours: garbage) bounds too
                    if SHAKE != 0.0:  # test hook (FILTER_SHAKE): a within its bound, up or down by the id
                        a += tl.where(((j * 2654435761) >> 11) % 2 == 0, SHAKE, -SHAKE)[:, None] * e
                    lo, hi = bound_keys(a, e, j[:, None], seen)
                    keys = tl.maximum(keys, lo)
                else:
                    x = paged_tile_logits(q, q_nan, w, codes, kscale, ok, seen, lut_ptr, BN, H, ROWS, FNUZ,
                                          NATIVE_FP8)
                    keys = tl.where(tiles[:, None, None] == i, topk.pool_keys(x, j[:, None], seen)[None, :, :],
                                    keys)
            if FILTER:
                topk.store_upper_bounds(lists, i, hi, live, BN)
            j0 += BN
            j += BN
        # PDL: the next kernel (bound, survivors or select) launches once every leaf is past its
        # loop; let at the leaves' start, its programs could take only the SMs a one-wave leaf
        # grid left free (H100 graph steps: H = 64, 32 x 32K 63.5 -> 55.3 us; H = 32, 32 x 32K
        # -2%, 1 x 128K -1.3 to -1.7%, the other cases within 0.4%: benchmarks/LOG.md, 54th)
        _pdl.launch_dependents(PDL)
        for r in tl.static_range(ROWS):
            if t0 + r < next_n:
                row = b * next_n + t0 + r
                lst = topk.leaf_list(cand_ptr, row * n_chunks + chunk, NT * BN, KB, FILTER)
                n_row = tl.max(tl.where(rr == r, n_vis, 0))
                if FILTER:
                    mine = tl.max(tl.where(rr[None, :] == r, keys, topk.NO_KEY), axis=1)  # [BN]
                    topk.store_leaf_bounds(mine, lst, n_row, select_k, NT * BN, KB)
                else:
                    mine = tl.max(tl.where(rr[None, None, :] == r, keys, topk.NO_KEY), axis=2)  # [NT, BN]
                    topk.store_leaf(tl.reshape(mine, (NT * BN,)), lst, out_ptr + row * out_stride, n_row, select_k,
                                    NT * BN, KB, FINAL, P, PB)
    elif FINAL:
        for r in tl.static_range(ROWS):
            if t0 + r < next_n:
                topk.emit_in_order(out_ptr + (b * next_n + t0 + r) * out_stride,
                                   tl.max(tl.where(rr == r, n_vis, 0)), select_k, KB, P, PB)
    if FINAL:
        for r in tl.static_range(ROWS):
            if t0 + r < next_n:
                row = b * next_n + t0 + r
                topk.store_tail(out_ptr + row * out_stride, seq_ptr, row * seq_stride, select_k, n_tail, P, TAIL,
                                TAIL_BLOCK)


@triton.jit
def _refine_kernel(q_ptr, q_sb, q_sn, q_sh, w_ptr, w_sb, w_sn, w_sh, pt_ptr, pt_sb, pt_sp,
                   kv_ptr, kv_f32_ptr, page_stride, num_pages, surv_ptr, n_surv, count_ptr, next_n, lut_ptr,
                   PAGE: tl.constexpr, BN: tl.constexpr, H: tl.constexpr, PRESHUFFLE: tl.constexpr,
                   FNUZ: tl.constexpr, NATIVE_FP8: tl.constexpr, PDL: tl.constexpr):
    _pdl.grid_dependency_sync(PDL)
    # Program (row, g): the row's survivors surv[row, :count[row]] (upper-bound keys of visible
    # pools) in tiles of BN, every G-th tile from g: each pool's exact logit
    # (paged_tile_logits, the row's query alone) and its exact key, written in place.
    row = tl.program_id(0).to(tl.int64)
    b = row // next_n
    t = row % next_n
    cnt = tl.load(count_ptr + row)
    q, q_nan = row_query(q_ptr + b * q_sb + t * q_sn, q_sh, lut_ptr, H, FNUZ, NATIVE_FP8)  # not waiting for cnt
    w = tl.load(w_ptr + b * w_sb + t * w_sn + tl.arange(0, H) * w_sh)
    if cnt > 0:
        base = surv_ptr + row * n_surv
        for tile in range(tl.program_id(1), tl.cdiv(cnt, BN), tl.num_programs(1)):
            i = tile * BN + tl.arange(0, BN)
            live = i < cnt
            j = topk.key_ids(tl.load(base + i, mask=live, other=topk.NO_KEY))
            codes, kscale, ok = pool_entries(kv_ptr, kv_f32_ptr, page_stride, num_pages, pt_ptr + b * pt_sb, pt_sp,
                                             j, live, PAGE, PRESHUFFLE)
            x = paged_tile_logits(q, q_nan, w, codes, kscale, ok, live[:, None], lut_ptr, BN, H, 1, FNUZ, NATIVE_FP8)
            tl.store(base + i, topk.pool_keys(tl.reshape(x, (BN,)), j, live), mask=live)


def scorer() -> str:
    """``$KPOOL_SCORER``: ``filter`` (default: filter and refine where ``filters`` allows) or
    ``exact`` (every pool scored exactly; module docstring)."""
    choice = os.environ.get(SCORER_ENV, "filter").strip().lower() or "filter"
    if choice not in ("filter", "exact"):
        raise ValueError(f"{SCORER_ENV} must be 'filter' or 'exact', got {choice!r}")
    return choice


def bound_rank(n_cols: int, chunk: int, select_k: int) -> int:
    """The rank, in each wholly visible leaf of ``chunk`` pools of a row of ``n_cols`` pools, of
    the key that bounds the row's ``select_k``-th best (the host's ``topk._bound_rank``, at least
    one leaf)."""
    return cdiv(select_k, max(n_cols // chunk, 1))


def filters(chunk: int, kb: int, n_chunks: int, n_cols: int, select_k: int) -> bool:
    """Whether a leaf launch filters (``FILTER``): the scorer is ``filter``, several leaves of
    ``FILTER_MIN_CHUNK`` to ``KB`` pools (they keep all their keys), or to ``2 * KB`` for rows
    whose full leaves hold ``FILTER_WIDE_HEADS * select_k`` heads (their lists hold all their
    int32 upper codes), and rows of ``n_cols`` pools whose bound rank is at most
    ``FILTER_MAX_RANK`` (shorter rows in the same launch are bounded by their leaves' position
    keys, or keep every pool as a survivor, all rescored exactly)."""
    if FILTER_ERROR < MIN_FILTER_ERROR:
        raise ValueError(f"score.FILTER_ERROR must be at least {MIN_FILTER_ERROR} (logits.bound_keys' "
                         f"overflow guard), got {FILTER_ERROR}")
    full = max(n_cols // chunk, 1)
    fits = chunk <= kb or (chunk <= 2 * kb and full * topk.MIN_KB >= FILTER_WIDE_HEADS * select_k)
    return (scorer() == "filter" and n_chunks >= 2 and max(FILTER_MIN_CHUNK, topk.MIN_KB) <= chunk and fits
            and bound_rank(n_cols, chunk, select_k) <= FILTER_MAX_RANK)


def wide_plan(rows: int, n_cols: int, select_k: int, device, groups: int | None = None, heads: int = 32) -> tuple:
    """``(CHUNK, n_chunks, FILTER)`` of the fused scorer's leaves for ``heads`` query heads:
    ``shaped_plan``'s, whose exact leaves, when they keep all their keys and the query has at most
    ``EXACT_FINE_MAX_HEADS`` heads, are split down to ``topk.plan_leaves``' for
    ``EXACT_PROGRAMS_PER_SM`` programs per SM, to no fewer than ``EXACT_MIN_CHUNK`` pools (128 x 8K,
    256 x 4K, verify steps of 64 x 8K x 2: leaves of 512 in 1.3 waves of 3 capped programs per
    SM become leaves of 256 in 2.6, the tail wave's idle SMs fewer); with more heads, only where
    the split grid's ``groups`` x leaves stay within ``EXACT_WIDE_HEADS_PER_SM`` programs per SM."""
    groups = rows if groups is None else groups
    chunk, n_chunks, filtered = plan = shaped_plan(rows, n_cols, select_k, device, groups)
    if filtered or n_chunks == 1 or chunk > topk.key_block(select_k):
        return plan
    fine, n_fine = topk.plan_leaves(rows, n_cols, select_k, device, BLOCK_POOLS, per_sm=EXACT_PROGRAMS_PER_SM)
    if not EXACT_MIN_CHUNK <= fine < chunk:
        return plan
    if heads > EXACT_FINE_MAX_HEADS and groups * n_fine > EXACT_WIDE_HEADS_PER_SM * topk._sm_count(device):
        return plan
    return fine, n_fine, False


def shaped_plan(rows: int, n_cols: int, select_k: int, device, groups: int | None = None) -> tuple:
    """``(CHUNK, n_chunks, FILTER)`` before ``wide_plan``'s last step: ``topk.plan_leaves``', doubled
    up to ``2 * KB`` for filtering leaves when the grid still fills the GPU and the rows are long
    enough (``FILTER_WIDE_HEADS``): a filtering list holds ``2 * KB`` pools' int32 upper codes,
    and the leaf's work outside its tile loop (query set-up, heads) is spread over twice the
    tiles. Exact leaves of a small grid whose row-leaves take more than one uncapped wave
    (``UNCAPPED_PER_SM`` per SM) are doubled: into filtering leaves when their bound rank stays at
    most ``FILTER_SMALL_RANK`` (a few long rows: 2 x 128K, a verify step at 128K; the filter's
    cheaper dot then pays for its extra launches), else, from ``plan_leaves``' smallest leaf,
    into exact leaves that still keep all their keys when those fit one wave (8 x 32K, 16 x 16K
    at select_k 512: one wave of twice the tiles beats two). That doubling counts waves in leaf
    programs: ``groups`` per leaf, the launch's query-row groups (default ``rows``; a verify step
    scores ``query_rows`` rows per program, so its leaves of 128 may already fit one wave).
    Filtering leaves of rows with few of them are halved instead (``FILTER_TIGHT_KEYS``): their
    bound comes from the leaves' position keys, loose when those barely outnumber ``select_k``
    (at 8 leaves of 512 it is the least of 512 maxima). Last, a small grid (at most one wave of
    ``FILTER_UNCAPPED_PER_SM`` filtering programs per SM, in ``groups``) of leaves under ``KB``
    filters only at a bound rank of at most ``FILTER_SMALL_RANK`` (``FILTER_SMALL_RANK_ROWS1``
    for one-row programs: 16 x 32K and 32 x 16K keep filtering): above it the loose bound's
    survivors cost the refine more than its cheaper dot saves, and exact leaves of that size
    keep all their keys (64 x 8K, a verify step of 32 x 8K x 2). ``FILTER``: the launch filters
    (``filters``; never for one leaf per row)."""
    groups = rows if groups is None else groups
    chunk, n_chunks = topk.plan_leaves(rows, n_cols, select_k, device, BLOCK_POOLS)
    kb = topk.key_block(select_k)
    wide, n_wide = 2 * chunk, cdiv(n_cols, 2 * chunk)
    smallest = max(topk.MIN_CHUNK, BLOCK_POOLS)  # plan_leaves' smallest leaf
    sms = topk._sm_count(device)
    if (chunk == kb and sms and rows * n_wide >= topk.PROGRAMS_PER_SM * sms
            and filters(wide, kb, n_wide, n_cols, select_k)):
        return wide, n_wide, True
    if sms and rows * n_chunks > UNCAPPED_PER_SM * sms and not filters(chunk, kb, n_chunks, n_cols, select_k):
        if filters(wide, kb, n_wide, n_cols, select_k) and bound_rank(n_cols, wide, select_k) <= FILTER_SMALL_RANK:
            return wide, n_wide, True
        if (chunk == smallest and wide <= kb and n_wide > 1
                and groups * n_wide <= UNCAPPED_PER_SM * sms < groups * n_chunks):
            return wide, n_wide, False
    floor = max(FILTER_MIN_CHUNK, smallest)  # halving never goes below plan_leaves' smallest leaf
    while (chunk // 2 >= floor and (n_cols // chunk) * topk.POSITION_KEYS <= FILTER_TIGHT_KEYS * select_k
           and filters(chunk, kb, n_chunks, n_cols, select_k)):
        chunk //= 2
        n_chunks = cdiv(n_cols, chunk)
    filtered = n_chunks > 1 and filters(chunk, kb, n_chunks, n_cols, select_k)
    if filtered and chunk < kb and sms and groups * n_chunks <= FILTER_UNCAPPED_PER_SM * sms:
        rank = FILTER_SMALL_RANK_ROWS1 if groups == rows else FILTER_SMALL_RANK
        filtered = bound_rank(n_cols, chunk, select_k) <= rank
    return chunk, n_chunks, filtered


def refine_programs(rows: int, select_k: int, device) -> int:
    """Programs per row of ``_refine_kernel``: one per ``BLOCK_POOLS`` of the survivors a filtered
    row expects (up to ``REFINE_SURVIVORS * select_k``) and one more, fewer when the rows already
    fill the GPU (two off the GPU)."""
    sms = topk._sm_count(device)
    want = cdiv(int(REFINE_SURVIVORS * select_k), BLOCK_POOLS) + 1
    return max(1, min(want, cdiv(REFINE_PROGRAMS_PER_SM * sms, rows))) if sms else 2


def query_rows(next_n: int) -> int:
    """``ROWS``: query rows of one request scored together by a program (powers of two up to
    ``MAX_ROWS``, never more than the step has)."""
    return min(MAX_ROWS, next_pow2(next_n))


def pipeline_stages(filtered: bool = False) -> int:
    """``STAGES`` of a leaf launch: ``FILTER_PIPELINE_STAGES`` for filtering leaves, else ``PIPELINE_STAGES``."""
    return FILTER_PIPELINE_STAGES if filtered else PIPELINE_STAGES


def max_regs(filtered: bool = False, rows: int = 1, heads: int = 32, small: bool = False) -> int | None:
    """CUDA register cap of a scoring launch: none for a ``small`` grid (``small_grid``: the
    cap buys programs per SM that such a grid does not use, and costs spills),
    ``FILTER_MAX_REGS`` (``FILTER_MAX_REGS_H64`` at 64 heads) for one-row filtering leaves,
    ``FILTER_MAX_REGS_ROWS2`` for two-row ones of at most 32 heads, else ``MAX_REGS``."""
    if small:
        return None
    if filtered and rows == 1:
        return FILTER_MAX_REGS_H64 if heads > 32 else FILTER_MAX_REGS
    if filtered and rows == 2 and heads <= 32:
        return FILTER_MAX_REGS_ROWS2
    return MAX_REGS


def small_grid(programs: int, device, filtered: bool = False, rows: int = 1, heads: int = 32) -> bool:
    """Whether a leaf grid of ``programs`` runs uncapped: when it takes no more waves uncapped
    (``UNCAPPED_PER_SM`` programs per SM, ``FILTER_UNCAPPED_PER_SM`` for one-row filtering
    leaves of at most 32 heads) than at its cap (``max_regs``: the programs an SM's registers
    hold), the cap buys residency the grid does not use and costs spills or instructions.
    False off the GPU."""
    sms = topk._sm_count(device)
    if not sms:
        return False
    uncapped = FILTER_UNCAPPED_PER_SM if filtered and rows == 1 and heads <= 32 else UNCAPPED_PER_SM
    capped = REGISTERS_PER_SM // (max_regs(filtered, rows, heads) * 32 * NUM_WARPS)
    return cdiv(programs, uncapped * sms) <= cdiv(programs, capped * sms)


def launch_options(device, filtered: bool = False, rows: int = 1, heads: int = 32, programs: int | None = None) -> dict:
    """Compile options of the scoring kernels: the register cap (``max_regs``; ``programs``:
    the grid's size when a small one may run uncapped) applies to CUDA targets only."""
    small = programs is not None and small_grid(programs, device, filtered, rows, heads)
    return dict(num_warps=NUM_WARPS, enable_fp_fusion=False,
                **register_cap(device, max_regs(filtered, rows, heads, small)))


def _check_expand(expand, rows: int, select_k: int, device):
    """``expand = (seq_lens, pool_size, width)`` of ``paged_pool_topk``; returns it with ``width``
    resolved (None: ``select_k * P + P - 1``)."""
    if not (isinstance(expand, tuple) and len(expand) == 3):
        raise TypeError(f"expand must be a tuple (seq_lens, pool_size, width), got {type(expand).__name__}")
    seq_lens, pool_size, width = expand
    return seq_lens, pool_size, select.check_expansion(seq_lens, pool_size, width, rows, select_k, device)


def paged_pool_topk(q_fp8, kv_cache, weights, pool_lens, page_table, select_k, *, layout=None, fp8_dtype=None,
                    max_pools=None, expand=None):
    """Score every visible pool of each decode / verify row and select the best, fused.

    Parameters
    ----------
    q_fp8, kv_cache, weights, pool_lens, page_table, layout, fp8_dtype, max_pools : as
        ``paged_pool_logits`` (``q_fp8 [B, next_n, H, 128]``, ``weights [B, next_n, H]``
        fp32 folded, ``pool_lens [B, next_n]``, ``page_table [B, max_pages]``).
    select_k : positive int, pools to pick per row (``index_topk // P``).
    expand : optional ``(seq_lens, pool_size, width)``: return the selection expanded to tokens
        with each row's tail appended, as ``expand_pools_and_append_tail(ids, seq_lens,
        pool_size, width=width)`` (``seq_lens`` int ``[B * next_n]``, ``width`` None for
        ``select_k * P + P - 1``), written by the selection's own kernels.

    Returns
    -------
    int32 ``[B * next_n, select_k]``: ``select_pools(paged_pool_logits(...), pool_lens,
    select_k)`` (highest score first, ties to the lower id, NaN last; every visible pool in
    order when there are at most ``select_k``; -1 padding), computed without a logits row;
    with ``expand``, int32 ``[B * next_n, width]`` tokens.
    """
    fp8_dtype, layout, max_pools, _ = check_paged_args(q_fp8, kv_cache, weights, pool_lens, page_table, layout,
                                                       fp8_dtype, max_pools)
    check_int("select_k", select_k, most=MAX_SELECT)
    if expand is not None:
        expand = _check_expand(expand, q_fp8.shape[0] * q_fp8.shape[1], select_k, q_fp8.device)
    return launch_paged_pool_topk(q_fp8, kv_cache, weights, pool_lens, page_table, select_k, fp8_dtype, layout,
                                  max_pools, expand)


@on_device_of("q_fp8")
def launch_paged_pool_topk(q_fp8, kv_cache, weights, pool_lens, page_table, select_k, fp8_dtype, layout, max_pools,
                           expand):
    """``paged_pool_topk`` of arguments already validated (by it, or built by ``KPoolCache`` for
    its own rows and buffers), ``fp8_dtype`` / ``layout`` / ``max_pools`` resolved and ``expand``
    None or ``(seq_lens, pool_size, width)`` with an int ``width``: the torch reference or the
    launches, no checks (they cost every layer's selection host time)."""
    device = q_fp8.device
    batch, next_n, heads = q_fp8.shape[:3]
    rows = batch * next_n
    lens = pool_lens.reshape(rows)
    limit = pool_limit(max_pools, page_table, kv_cache)
    if backend_for(device) == "torch":
        logits = reference.paged_pool_logits(q_fp8.view(torch.uint8), kv_cache, weights, pool_lens, page_table,
                                             layout, fp8_dtype, max_pools)
        ids = reference.select_pools(logits, lens, select_k)
        if expand is None:
            return ids
        seq_lens, pool_size, width = expand
        return reference.expand_pools_and_append_tail(ids, seq_lens, pool_size, width=width)
    out = torch.empty((rows, select_k if expand is None else expand[2]), dtype=torch.int32, device=device)
    if rows == 0:
        return out
    q8 = q_fp8.view(torch.uint8)
    rows_per_prog = query_rows(next_n)
    groups = batch * cdiv(next_n, rows_per_prog)  # leaf programs per leaf

    def launch_leaves(cand, count, chunk, n_chunks, kb, final, filtered):
        _paged_topk_kernel[(groups, n_chunks)](
            q8, q8.stride(0), q8.stride(1), q8.stride(2), weights, weights.stride(0), weights.stride(1),
            weights.stride(2), lens, lens.stride(0), page_table, page_table.stride(0), page_table.stride(1),
            kv_cache, kv_cache.view(torch.float32), kv_cache.stride(0), kv_cache.shape[0],
            cand, count, out, out.stride(0), limit, next_n, select_k, n_chunks, halves_table(fp8_dtype, device),
            PAGE=kv_cache.shape[1], BN=BLOCK_POOLS, NT=chunk // BLOCK_POOLS, KB=kb, H=heads, ROWS=rows_per_prog,
            PRESHUFFLE=layout == "preshuffle", FINAL=final, **decode_args(fp8_dtype, device),
            FILTER=filtered, FP8_MAX=fp8_max(fp8_dtype), ERROR=FILTER_ERROR, SHAKE=FILTER_SHAKE,
            STAGES=pipeline_stages(filtered), **topk.expansion_args(expand, select_k, lens),
            **launch_options(device, filtered, rows_per_prog, heads, groups * n_chunks), **pdl_launch(device),
        )

    def refine(surv, count):
        _refine_kernel[(rows, refine_programs(rows, select_k, device))](
            q8, q8.stride(0), q8.stride(1), q8.stride(2), weights, weights.stride(0), weights.stride(1),
            weights.stride(2), page_table, page_table.stride(0), page_table.stride(1),
            kv_cache, kv_cache.view(torch.float32), kv_cache.stride(0), kv_cache.shape[0],
            surv, surv.shape[1], count, next_n, halves_table(fp8_dtype, device),
            PAGE=kv_cache.shape[1], BN=BLOCK_POOLS, H=heads, PRESHUFFLE=layout == "preshuffle",
            **decode_args(fp8_dtype, device), **launch_options(device), **pdl_launch(device),
        )

    topk.select_by_leaves(out, lens, limit, select_k, launch_leaves, BLOCK_POOLS, refine,
                          plan=wide_plan(rows, limit, select_k, device, groups=groups, heads=heads), expand=expand)
    return out
