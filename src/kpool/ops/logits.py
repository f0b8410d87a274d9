"""Pooled fp8 logits (SPEC.md §5): ``logit[j] = sum_h w[h] * relu(q8[h].k8[j] * kscale[j])``.

Two forms: ``paged_pool_logits`` (decode / speculative verify, pools read from the paged
indexer cache through a per-request page table, per-row visible pool counts) and
``ragged_pool_logits`` (prefill, a contiguous run of gathered pools, per-query ``[ks, ke)``).
``w`` is fp32 and already folded (``weights_h * q_scale_h * 128^-0.5 * H^-0.5``); head
weights may be negative, so the relu is applied per head, before the weighting.

Exact formulation (identical fp32 bits in the torch reference, under the Triton CPU
interpreter and on every GPU; kernels are launched with ``enable_fp_fusion=False``):

1. Every e4m3 code stands for an integer ``|i| < 2^18`` times a unit ``u`` (``2^-9``
   e4m3fn, ``2^-10`` e4m3fnuz; ``reference.fp8_int_table``). The head dot product ``q8[h].k8[j]``
   is the exact integer sum of 128 products (``|sum| < 128 * 2^36 = 2^43``), converted
   ONCE to fp32 (round to nearest even) and multiplied by ``u^2`` (exact). A NaN code in
   either vector makes it NaN. The kernels get the exact sum from fp16 ``tl.dot``s: each
   value is split into two fp16 halves, ``hi`` a multiple of a step ``h = 512 u`` and
   ``|lo| <= h / 2`` (``_jit_fp8.fp8_halves``: the target's fp8 -> fp16 conversion where it
   has one, else a 256-entry table per format); the four half products are fp16 MMAs whose
   fp32 accumulators hold integer multiples of their unit below ``2^24`` of it at every
   step, i.e. exact whatever the MMA unit's summation order or internal rounding
   (``_exact_dot``: bounds, five accumulators), then summed exactly as two fp32 values (the
   accumulators split on a grid, ``_on_grid``) whose fp32 sum is the one rounding. No fp64
   arithmetic: GPUs whose fp64 units are slow pay nothing for it. The torch reference uses
   an fp64 matmul on the integers, exact in any summation order since every partial sum is
   an integer below ``2^53``.
2. In fp32: ``s = dot * kscale[j]``; ``r = 0 if s < 0 else s`` (NaN kept);
   ``t[h] = w[h] * r``; the heads are summed as a fixed pairwise tree (H a power of two):
   ``((t0 + t1) + (t2 + t3)) + ((t4 + t5) + (t6 + t7)) + ...``.
3. Pools a row does not see are ``-inf``. A visible pool whose page id is outside
   ``[0, num_pages)`` is not read and scores NaN (selection ranks NaN last).

Performance: these two write a full logits row (paged: one program per (row, ``BLOCK_POOLS``
pools); ragged: one per (query, ``RAGGED_TILES`` tiles of ``RAGGED_TILE`` pools), the query's
halves built once per program); the decode path of ``KPoolCache`` uses ``ops/score.py``'s
fused ``paged_pool_topk`` instead, built from the same ``paged_tile`` / ``paged_tile_logits``.
The exact formulation costs four fp16 MMAs per fp8 product (two operands per side), a
decode per key code and 20 fp32 additions per logit (the grid split), so scoring is bound by the
SM's instruction issue and latency, not by HBM (benchmarks/LOG.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import reference
from .._backend import backend_for, native_fp8, on_device_of, pdl_launch
from .._checks import (INT_DTYPES, check_index_ranges, check_int, check_kv_cache, check_tensor,
                       range_checks_enabled)
from ..layout import FP8_DTYPES, HEAD_DIM, cdiv, resolve_fp8_dtype
from . import _jit, _jit_fp8, _pdl, topk
from ._jit_fp8 import halves_table

BLOCK_POOLS = 32  # pools per paged-logits program
RAGGED_TILE, RAGGED_TILES = 64, 8  # ragged logits: pools per tile, tiles per program (one query)
SUPPORTED_HEADS = (16, 32, 64)
CODE_DTYPES = FP8_DTYPES + (torch.uint8,)


_GRID_FN = tl.constexpr(1.5 * 2.0**25)  # 1.5 * 2^43 u^2 (u = 2^-9): fp32 ulp 2^20 u^2 in [2^43, 2^44) u^2
_GRID_FNUZ = tl.constexpr(1.5 * 2.0**23)  # the same for u = 2^-10


@triton.jit
def _on_grid(x, SIGMA: tl.constexpr):
    """``x -> (p, x - p)``, ``p`` = ``x`` rounded to the multiples of ``ulp(SIGMA)`` (exact for
    ``|x| < SIGMA / 3``: ``SIGMA + x`` stays in ``SIGMA``'s binade)."""
    p = (x + SIGMA) - SIGMA
    return p, x - p


@triton.jit
def _exact_dot(k, q, FNUZ: tl.constexpr):
    """Exact ``K @ Q`` from fp16 halves (``_jit_fp8.fp8_halves``) -> fp32 ``[M, N]``, rounded
    once (to nearest even; an exact zero is +0).

    ``k = (a_hi, a_lo, b_hi, b_lo)``, ``[M, 64]`` each (dims 0-63 = ``a``, 64-127 = ``b``);
    ``q`` the same, ``[64, N]`` each. Four half products in fp16 MMAs with fp32 accumulators,
    every partial sum an integer multiple below ``2^24`` of its unit (exact in any order):
    ``hi.hi`` (unit ``h^2``, ``|hi / h| <= 480``: ``480^2 * 64 < 2^24``, so one accumulator
    per 64 dims), ``hi.lo`` and ``lo.hi`` (unit ``h u``, ``|lo / u| <= 256``:
    ``480 * 256 * 128 < 2^24``), ``lo.lo`` (unit ``u^2``: ``256^2 * 128 < 2^24``). Their exact
    sum ``S`` (a multiple of ``u^2`` below ``2^44`` of it) is rounded once without wider
    arithmetic: the four larger accumulators are split on the grid ``G = 2^20 u^2``
    (``_on_grid``), so that ``S = hi + lo`` with ``hi`` the sum of the grid parts (multiples of
    ``G`` below ``2^44 u^2``: exact) and ``lo`` that of the remainders (``|r| <= G / 2``) and
    ``lo.lo`` (multiples of ``u^2`` below ``2^24`` of it: exact); ``hi + lo`` in fp32 is ``S``
    rounded to nearest even.
    """
    a_hi, a_lo, b_hi, b_lo = k
    qa_hi, qa_lo, qb_hi, qb_lo = q
    SIGMA: tl.constexpr = _GRID_FNUZ if FNUZ else _GRID_FN
    p1, r1 = _on_grid(tl.dot(a_hi, qa_hi), SIGMA)
    p2, r2 = _on_grid(tl.dot(b_hi, qb_hi), SIGMA)
    p3, r3 = _on_grid(tl.dot(a_hi, qa_lo, tl.dot(b_hi, qb_lo)), SIGMA)
    p4, r4 = _on_grid(tl.dot(a_lo, qa_hi, tl.dot(b_lo, qb_hi)), SIGMA)
    ll = tl.dot(a_lo, qa_lo, tl.dot(b_lo, qb_lo))
    dot = ((p1 + p2) + (p3 + p4)) + (((r1 + r2) + (r3 + r4)) + ll)
    return tl.where(dot == 0, 0.0, dot)


@triton.jit
def mma_dim_order(x, AXIS: tl.constexpr):
    """The 64 dims of a 2-D ``x`` (along ``AXIS``) reordered for the fp16 MMA: dim ``16c + 2m + e``
    (``c < 4, m < 8, e < 2``) moves to ``8m + 2c + e``. The operand layout of an fp16 MMA
    gives a thread dims ``8m + 2c + {0, 1}`` of its rows (``c`` = lane % 4) for every ``m``,
    i.e. 16 contiguous codes of the loaded tile in this order (one 128-bit shared-memory
    load per row instead of eight 16-bit ones; sm_90 SASS). Both operands of a dot get the
    same order, so only the MMA's summation order changes (exact for ``_exact_dot``, within
    the filter's error bound for ``approx_block_logits``)."""
    if AXIS == 0:
        n: tl.constexpr = x.shape[1]
        return tl.reshape(tl.permute(tl.reshape(x, (4, 8, 2, n)), (1, 0, 2, 3)), (64, n))
    else:
        m: tl.constexpr = x.shape[0]
        return tl.reshape(tl.permute(tl.reshape(x, (m, 4, 8, 2)), (0, 2, 1, 3)), (m, 64))


@triton.jit
def fp8_split(codes_a, codes_b, lut_ptr, AXIS: tl.constexpr, FNUZ: tl.constexpr, NATIVE_FP8: tl.constexpr):
    """Codes of dims 0-63 and 64-127 (uint8, same shape, the dims along ``AXIS``) -> the
    halves ``(a_hi, a_lo, b_hi, b_lo)`` of ``_exact_dot`` in ``mma_dim_order`` and a NaN flag
    reduced over ``AXIS``."""
    a_hi, a_lo, a_nan = _jit_fp8.fp8_halves(mma_dim_order(codes_a, AXIS), lut_ptr, FNUZ, NATIVE_FP8)
    b_hi, b_lo, b_nan = _jit_fp8.fp8_halves(mma_dim_order(codes_b, AXIS), lut_ptr, FNUZ, NATIVE_FP8)
    nan = tl.max((a_nan | b_nan).to(tl.int32), axis=AXIS) > 0
    return (a_hi, a_lo, b_hi, b_lo), nan


@triton.jit
def _pair_sum(t, BN: tl.constexpr, N: tl.constexpr):
    """``[BN, N]`` -> ``[BN, N // 2]``: column ``i`` = column ``2i`` + column ``2i + 1``."""
    a, b = tl.split(tl.reshape(t, (BN, N // 2, 2)))
    return a + b


@triton.jit
def _head_tree(t, BN: tl.constexpr, H: tl.constexpr, R: tl.constexpr):
    """Pairwise sum over the heads of each row of ``t [BN, R * H]`` (H in 16, 32, 64) -> ``[BN, R]``."""
    N: tl.constexpr = BN * R
    t = tl.reshape(t, (N, H))
    if H == 64:
        t = _pair_sum(t, N, 64)
    if H >= 32:
        t = _pair_sum(t, N, 32)
    t = _pair_sum(t, N, 16)
    t = _pair_sum(t, N, 8)
    t = _pair_sum(t, N, 4)
    t = _pair_sum(t, N, 2)
    return tl.reshape(t, (BN, R))


@triton.jit
def query_halves(q_ptrs, mask, lut_ptr, FNUZ: tl.constexpr, NATIVE_FP8: tl.constexpr):
    """Query codes at ``q_ptrs [64, N]`` (dims 0-63, dim-major; dims 64-127 at ``+ 64``; N =
    heads of one or more query rows, code 0 where not ``mask``) -> the ``_exact_dot`` halves
    (``[64, N]`` each) and a NaN flag ``[N]``."""
    if mask is None:
        codes_a, codes_b = tl.load(q_ptrs), tl.load(q_ptrs + 64)
    else:
        codes_a, codes_b = tl.load(q_ptrs, mask=mask, other=0), tl.load(q_ptrs + 64, mask=mask, other=0)
    return fp8_split(codes_a, codes_b, lut_ptr, 0, FNUZ, NATIVE_FP8)


@triton.jit
def row_query(q_row_ptr, q_sh, lut_ptr, H: tl.constexpr, FNUZ: tl.constexpr, NATIVE_FP8: tl.constexpr):
    """``query_halves`` (``[64, H]`` each) and NaN flags of one query row's ``H`` heads
    (head ``h`` at ``q_row_ptr + h * q_sh``)."""
    return query_halves(q_row_ptr + tl.arange(0, H)[None, :] * q_sh + tl.arange(0, 64)[:, None], None, lut_ptr,
                        FNUZ, NATIVE_FP8)


@triton.jit
def block_logits(q, q_nan, w, codes, kscale, lut_ptr, BN: tl.constexpr, H: tl.constexpr,
                 R: tl.constexpr, FNUZ: tl.constexpr, NATIVE_FP8: tl.constexpr):
    """Pooled logits of ``BN`` pools for ``R`` query rows -> fp32 ``[BN, R]`` (module docstring).

    ``q``, ``q_nan``: ``query_halves`` of the rows side by side (``[64, R * H]`` each,
    row-major over (row, head)); ``w [R * H]`` head weights; ``codes``: the pools' uint8 key
    codes of dims 0-63 and 64-127 (``[BN, 64]`` each); ``kscale [BN]`` fp32; ``lut_ptr``,
    ``FNUZ``, ``NATIVE_FP8``: the decoder (``_jit_fp8.fp8_halves``). The pools are the MMA's
    rows (M = BN) and the rows' heads its columns, so the key tile is decoded once for all
    ``R`` rows and the query halves are the loop-invariant operand.
    """
    k, k_nan = fp8_split(codes[0], codes[1], lut_ptr, 1, FNUZ, NATIVE_FP8)  # [BN, 64] halves, [BN]
    dot = _exact_dot(k, q, FNUZ)  # [BN, R * H], one rounding
    return _weighted_heads(dot, k_nan[:, None] | q_nan[None, :], kscale, w, BN, H, R)


@triton.jit
def _weighted_heads(dot, nan, kscale, w, BN: tl.constexpr, H: tl.constexpr, R: tl.constexpr):
    """Step 2 of the module docstring on head dots ``[BN, R * H]`` (NaN where ``nan``, a mask
    or ``False``): ``* kscale``, relu, ``* w``, the pairwise head tree -> ``[BN, R]``."""
    s = tl.where(nan, float("nan"), dot) * kscale[:, None]
    r = tl.where(s < 0, 0.0, s)
    return _head_tree(r * w[None, :], BN, H, R)


L1_ROUND_UP = tl.constexpr(1.0 + 2.0**-10)  # > (1 + 2^-24)^128: fp32 summation error of 128 terms
MIN_FILTER_ERROR = 2.0**-16  # the smallest error budget bound_keys' overflow guard allows
_SPAN = tl.constexpr(1.0 / MIN_FILTER_ERROR)  # sum_h |w_h s_h| <= e / budget <= e * _SPAN
# approx_block_logits scales a pool's head sum once, after it: with kscale in [2^-32, 2^32] and a
# row's error scale at least 2^-80 (logit_error_scale), fp32 underflow of the unscaled products
# (<= 2^-144 each) and of the logit (2^-150) stays far below the pool's budget e >= 2^-112
APPROX_SCALE_MIN, APPROX_SCALE_MAX = tl.constexpr(2.0**-32), tl.constexpr(2.0**32)
MIN_ERROR_SCALE = tl.constexpr(2.0**-80)


@triton.jit
def query_values(q):
    """``query_halves``' halves ``(a_hi, a_lo, b_hi, b_lo)`` -> the codes' values ``(a, b)``
    in fp16 (``hi + lo`` is exact) and each column's l1 norm ``[N]`` fp32 (rounded up by at
    most 2^-10 of it: the 128 magnitudes are summed in fp32, then scaled)."""
    a = q[0] + q[1]
    b = q[2] + q[3]
    l1 = tl.sum(tl.abs(a.to(tl.float32)), axis=0) + tl.sum(tl.abs(b.to(tl.float32)), axis=0)
    return (a, b), l1 * L1_ROUND_UP


@triton.jit
def approx_block_logits(q16, w, codes, kscale, lut_ptr, BN: tl.constexpr, H: tl.constexpr,
                        R: tl.constexpr, FNUZ: tl.constexpr, NATIVE_FP8: tl.constexpr):
    """``block_logits`` from one fp16 MMA of the codes' values (``query_values``): every
    product is exact, only the MMA's fp32 accumulation and the epilogue round. ``[BN, R]``.
    A NaN code (key or query) makes its dots NaN through the MMA itself (IEEE propagation),
    so no NaN flags are reduced here; ``bound_keys`` turns a NaN logit into a survivor."""
    ka, _ = _jit_fp8.fp8_values(mma_dim_order(codes[0], 1), lut_ptr, FNUZ, NATIVE_FP8)
    kb, _ = _jit_fp8.fp8_values(mma_dim_order(codes[1], 1), lut_ptr, FNUZ, NATIVE_FP8)
    dot = tl.dot(ka, q16[0], tl.dot(kb, q16[1]))  # [BN, R * H]
    # relu (max.NaN keeps a NaN dot), * w, the head tree, then * kscale once per pool: k * relu(d)
    # is relu(k * d) for k > 0, the roundings differ within the budget; a scale outside
    # [APPROX_SCALE_MIN, APPROX_SCALE_MAX] (not a cache of ours) gives NaN: the pool survives
    r = tl.maximum(dot, 0.0, propagate_nan=tl.PropagateNan.ALL) * w[None, :]
    s = _head_tree(r, BN, H, R)
    sane = (kscale >= APPROX_SCALE_MIN) & (kscale <= APPROX_SCALE_MAX)
    return tl.where(sane[:, None], s * kscale[:, None], float("nan"))


@triton.jit
def logit_error_scale(w, q_l1, H: tl.constexpr, R: tl.constexpr, FP8_MAX: tl.constexpr, ERROR: tl.constexpr):
    """Per row ``[R]``: ``E`` such that ``|approx - exact| <= E * |kscale|`` for every pool of
    the row: ``ERROR * sum_h |w_h| * ||q_h||_1 * FP8_MAX`` (``ERROR``: the relative budget of
    one head's dot, ``score.FILTER_ERROR``); NaN for a row where that is under
    ``MIN_ERROR_SCALE`` (tiny weights), whose pools then all survive."""
    t = tl.reshape(tl.abs(w) * q_l1, (R, H))
    e = tl.sum(t, axis=1) * (FP8_MAX * ERROR)
    return tl.where(e >= MIN_ERROR_SCALE, e, float("nan"))  # tinier: every pool of the row survives


@triton.jit
def bound_keys(a, e, j, vis):
    """Lower ranking keys (``topk.pool_keys``) and upper bounds (``topk.upper_codes``, int32)
    of approximate logits ``a`` with error bound ``e`` (same shape; a budget of at least
    ``MIN_FILTER_ERROR``): ``a - e`` and ``a + e`` where the pool's heads are far from fp32
    overflow in both pipelines; else (NaN, infinities, magnitudes near ``FLT_MAX``) the
    lowest key (NaN) and the highest finite score (+inf), so that such a pool always
    survives the filter and never raises the bound."""
    fin = tl.abs(a) + e * _SPAN < 1e38  # False for NaN and infinities
    lo = tl.where(fin, a - e, float("nan"))
    hi = tl.where(fin, a + e, float("inf"))
    return topk.pool_keys(lo, j, vis), topk.upper_codes(hi, vis)


@triton.jit
def tile_pages(pt_row_ptr, pt_sp, j0, n_vis, num_pages, NT: tl.constexpr, BN: tl.constexpr,
               PAGE: tl.constexpr):
    """Page ids ``[NT]`` (int32; -1 for an id outside ``[0, num_pages)``) of the ``NT`` tiles
    of ``BN`` pools from pool ``j0`` (a multiple of ``BN``) in one row's page table
    ``pt_row_ptr`` (stride ``pt_sp``), for ``paged_tile``. Only ``PAGE % BN == 0`` (a tile
    lies in one page) loads them; a tile past the row's ``n_vis`` visible pools reads column
    0 (a row with visible pools has one). Loading them before a tile loop keeps the loop's
    loads independent of each other, so Triton's pipeliner can keep the next tile's entries
    in flight (and int32 ids halve the loop's picking of tile ``i``'s id)."""
    t = j0 + tl.arange(0, NT) * BN
    if PAGE % BN == 0:
        pg = tl.load(pt_row_ptr + tl.where(t < n_vis, t // PAGE, 0) * pt_sp).to(tl.int64)
        pages = tl.where((pg >= 0) & (pg < num_pages), pg, -1).to(tl.int32)
    else:
        pages = tl.zeros((NT,), tl.int32)  # unused: paged_tile looks up each pool's page
    return pages


@triton.jit
def paged_tile(kv_ptr, kv_f32_ptr, page_stride, num_pages, pages, i, pt_row_ptr, pt_sp, j0, n_vis,
               PAGE: tl.constexpr, BN: tl.constexpr, PRESHUFFLE: tl.constexpr):
    """Entries of pools ``j0 .. j0 + BN - 1`` (``j0`` a multiple of ``BN``, tile ``i`` of
    ``pages = tile_pages(...)``) of one row's page table ``pt_row_ptr`` (stride ``pt_sp``):
    ``(codes, kscale [BN] fp32, ok [BN])``, ``codes`` the uint8 key codes of dims 0-63 and
    64-127 (``[BN, 64]`` each), ``ok`` = visible (``j < n_vis``) and on a page inside
    ``[0, num_pages)``; entries not ``ok`` are not read (zeros).

    When ``PAGE % BN == 0`` the tile lies in one page: its id from ``pages`` (registers, no
    load), a scalar page base and int32 in-page offsets; otherwise a page lookup per pool."""
    j = j0 + tl.arange(0, BN)
    if PAGE % BN == 0:
        pg = tl.sum(tl.where(tl.arange(0, pages.shape[0]) == i, pages, 0)).to(tl.int64)
        on_page = pg >= 0
        ok = j < tl.where(on_page, n_vis, 0)  # a vector compare: the interpreter mis-broadcasts scalar masks
        base = tl.where(on_page, pg, 0) * page_stride  # scalar page byte offset
        state = (j0 % PAGE).to(tl.int32) + tl.arange(0, BN)
        kscale = tl.load(kv_f32_ptr + (base + PAGE * 128) // 4 + state, mask=ok, other=0.0)
        codes = _entry_codes(kv_ptr + base, state, ok, PRESHUFFLE)
    else:
        codes, kscale, ok = pool_entries(kv_ptr, kv_f32_ptr, page_stride, num_pages, pt_row_ptr, pt_sp, j,
                                         j < n_vis, PAGE, PRESHUFFLE)
    return codes, kscale, ok


@triton.jit
def pool_entries(kv_ptr, kv_f32_ptr, page_stride, num_pages, pt_row_ptr, pt_sp, j, vis,
                 PAGE: tl.constexpr, PRESHUFFLE: tl.constexpr):
    """``paged_tile``'s result for any pool ids ``j`` (int64 ``[BN]``) where ``vis``: a page
    lookup per pool; ``ok`` = ``vis`` and on a page inside ``[0, num_pages)``."""
    pg = tl.load(pt_row_ptr + (j // PAGE) * pt_sp, mask=vis, other=-1).to(tl.int64)
    ok = vis & (pg >= 0) & (pg < num_pages)
    base = tl.where(ok, pg, 0) * page_stride  # [BN] page byte offsets
    state = j % PAGE
    kscale = tl.load(kv_f32_ptr + (base + PAGE * 128) // 4 + state, mask=ok, other=0.0)
    return _entry_codes(kv_ptr + base[:, None], state, ok, PRESHUFFLE), kscale, ok


@triton.jit
def _entry_codes(rows, state, ok, PRESHUFFLE: tl.constexpr):
    """The uint8 key codes of dims 0-63 and 64-127 (``[BN, 64]`` each) of in-page states
    ``state [BN]`` at page pointers ``rows`` (scalar or ``[BN, 1]``); zeros where not ``ok``."""
    d = tl.arange(0, 64)
    return (tl.load(rows + _jit.key_offset(state[:, None], d[None, :], PRESHUFFLE), mask=ok[:, None], other=0),
            tl.load(rows + _jit.key_offset(state[:, None], 64 + d[None, :], PRESHUFFLE), mask=ok[:, None], other=0))


@triton.jit
def paged_tile_logits(q, q_nan, w, codes, kscale, ok, seen, lut_ptr, BN: tl.constexpr,
                      H: tl.constexpr, R: tl.constexpr, FNUZ: tl.constexpr, NATIVE_FP8: tl.constexpr):
    """``block_logits`` of a ``paged_tile`` for ``R`` rows -> ``[BN, R]``: ``-inf`` where not
    ``seen [BN, R]`` (pool past the row's visible count), NaN for a seen pool on a page
    outside the cache."""
    acc = block_logits(q, q_nan, w, codes, kscale, lut_ptr, BN, H, R, FNUZ, NATIVE_FP8)
    return tl.where(seen, tl.where(ok[:, None], acc, float("nan")), float("-inf"))


@triton.jit
def _paged_logits_kernel(q_ptr, q_sb, q_sn, q_sh, w_ptr, w_sb, w_sn, w_sh, lens_ptr, lens_sb, lens_sn,
                         pt_ptr, pt_sb, pt_sp, kv_ptr, kv_f32_ptr, page_stride, num_pages,
                         out_ptr, out_stride, max_pools, vis_limit, next_n, lut_ptr,
                         PAGE: tl.constexpr, BN: tl.constexpr, H: tl.constexpr, PRESHUFFLE: tl.constexpr,
                         FNUZ: tl.constexpr, NATIVE_FP8: tl.constexpr, PDL: tl.constexpr):
    _pdl.grid_dependency_sync(PDL)
    # Program (row = b * next_n + t, block): logits of pools [block*BN, block*BN + BN) of that row.
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1).to(tl.int64)
    b = row // next_n
    t = row % next_n
    j = blk * BN + tl.arange(0, BN)  # [BN] pool ids
    n_vis = topk.visible_pools(lens_ptr, b * lens_sb + t * lens_sn, vis_limit)
    out = tl.full((BN,), float("-inf"), tl.float32)
    if blk * BN < n_vis:
        q, q_nan = row_query(q_ptr + b * q_sb + t * q_sn, q_sh, lut_ptr, H, FNUZ, NATIVE_FP8)
        pt_row = pt_ptr + b * pt_sb
        pages = tile_pages(pt_row, pt_sp, blk * BN, n_vis, num_pages, 1, BN, PAGE)
        codes, kscale, ok = paged_tile(kv_ptr, kv_f32_ptr, page_stride, num_pages, pages, 0, pt_row, pt_sp,
                                       blk * BN, n_vis, PAGE, BN, PRESHUFFLE)
        w = tl.load(w_ptr + b * w_sb + t * w_sn + tl.arange(0, H) * w_sh)
        out = tl.reshape(paged_tile_logits(q, q_nan, w, codes, kscale, ok, (j < n_vis)[:, None], lut_ptr,
                                           BN, H, 1, FNUZ, NATIVE_FP8), (BN,))
    tl.store(out_ptr + row * out_stride + j, out, mask=j < max_pools)


@triton.jit
def _ragged_logits_kernel(q_ptr, q_st, q_sh, w_ptr, w_st, w_sh, k_ptr, k_sn, ksc_ptr, ksc_sn, ks_ptr, ks_st,
                          ke_ptr, ke_st, n_keys, out_ptr, out_stride, lut_ptr,
                          BN: tl.constexpr, NT: tl.constexpr, H: tl.constexpr, FNUZ: tl.constexpr,
                          NATIVE_FP8: tl.constexpr, PDL: tl.constexpr):
    _pdl.grid_dependency_sync(PDL)
    # Program (query t, span): logits of pools [span*NT*BN, (span+1)*NT*BN) for query t, NT
    # tiles of BN pools; the query's halves are built once per span that meets its window.
    t = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1).to(tl.int64) * NT * BN
    d = tl.arange(0, 64)
    lo = tl.maximum(tl.load(ks_ptr + t * ks_st).to(tl.int64), 0)
    hi = tl.minimum(tl.load(ke_ptr + t * ke_st).to(tl.int64), n_keys)
    out_row = out_ptr + t * out_stride
    if (start < hi) & (start + NT * BN > lo):
        hh = tl.arange(0, H)
        q, q_nan = query_halves(q_ptr + t * q_st + hh[None, :] * q_sh + d[:, None], None, lut_ptr, FNUZ, NATIVE_FP8)
        w = tl.load(w_ptr + t * w_st + hh * w_sh)
        for i in range(NT):
            j = start + i * BN + tl.arange(0, BN)  # [BN]
            vis = (j >= lo) & (j < hi)
            acc = tl.zeros([BN], tl.float32)
            if (start + i * BN < hi) & (start + i * BN + BN > lo):
                kscale = tl.load(ksc_ptr + j * ksc_sn, mask=vis, other=0.0)
                rows = k_ptr + j[:, None] * k_sn + d[None, :]
                codes = (tl.load(rows, mask=vis[:, None], other=0), tl.load(rows + 64, mask=vis[:, None], other=0))
                acc = tl.reshape(block_logits(q, q_nan, w, codes, kscale, lut_ptr, BN, H, 1, FNUZ,
                                              NATIVE_FP8), (BN,))
            tl.store(out_row + j, tl.where(vis, acc, float("-inf")), mask=j < n_keys)
    else:
        for i in range(NT):
            j = start + i * BN + tl.arange(0, BN)
            tl.store(out_row + j, tl.full([BN], float("-inf"), tl.float32), mask=j < n_keys)


def decode_args(fp8_dtype, device) -> dict:
    """The scoring kernels' fp8 constexprs: ``FNUZ`` (the format; the dot's scale is the square
    of its ``_jit_fp8`` integer unit) and ``NATIVE_FP8`` (decoder choice, ``_backend.native_fp8``)."""
    return dict(FNUZ=fp8_dtype == torch.float8_e4m3fnuz, NATIVE_FP8=native_fp8(device, fp8_dtype))


def code_format(named: dict, fp8_dtype, device) -> torch.dtype:
    """The fp8 format of code tensors (fp8 dtypes or raw uint8 codes); all must agree."""
    seen = {t.dtype for t in named.values() if t.dtype != torch.uint8}
    if fp8_dtype is not None:
        fp8_dtype = resolve_fp8_dtype(fp8_dtype, device)
        seen.add(fp8_dtype)
    if len(seen) > 1:
        names = ", ".join(f"{n}: {t.dtype}" for n, t in named.items())
        raise TypeError(f"fp8 formats disagree ({names}, fp8_dtype={fp8_dtype})")
    return seen.pop() if seen else resolve_fp8_dtype(None, device)


def check_heads(name, heads):
    if heads not in SUPPORTED_HEADS:
        raise ValueError(f"{name} must have H in {SUPPORTED_HEADS} heads, got {heads}")


def pool_limit(max_pools: int, page_table, kv_cache) -> int:
    """The most pools a row of the paged scoring ops may see: ``min(max_pools, max_pages * PAGE)``."""
    return min(max_pools, page_table.shape[1] * kv_cache.shape[1])


def check_paged_args(q_fp8, kv_cache, weights, pool_lens, page_table, layout, fp8_dtype, max_pools):
    """Validate the arguments of the paged scoring ops (``paged_pool_logits``).

    Returns ``(fp8_dtype, layout, max_pools, limit)`` resolved, ``limit`` being ``pool_limit``.
    """
    check_tensor("q_fp8", q_fp8, dtype=CODE_DTYPES, ndim=4, inner_contiguous=True)
    device = q_fp8.device
    batch, next_n, heads, hd = q_fp8.shape
    if hd != HEAD_DIM:
        raise ValueError(f"q_fp8 must have shape [B, next_n, H, {HEAD_DIM}], got {list(q_fp8.shape)}")
    check_heads("q_fp8", heads)
    fp8_dtype = code_format({"q_fp8": q_fp8}, fp8_dtype, device)
    layout = check_kv_cache(kv_cache, layout, device)
    check_tensor("weights", weights, dtype=torch.float32, shape=(batch, next_n, heads), device=device)
    check_tensor("pool_lens", pool_lens, dtype=INT_DTYPES, shape=(batch, next_n), device=device)
    check_tensor("page_table", page_table, dtype=INT_DTYPES, ndim=2, device=device)
    if page_table.shape[0] != batch:
        raise ValueError(f"page_table must have shape [B={batch}, max_pages], got {list(page_table.shape)}")
    num_pages, page = kv_cache.shape[:2]
    covered = page_table.shape[1] * page
    if max_pools is None:
        max_pools = covered
    check_int("max_pools", max_pools, least=0)
    limit = pool_limit(max_pools, page_table, kv_cache)
    check_index_ranges([("pool_lens", pool_lens, limit + 1,
                         f"visible-pool counts allowed by min(max_pools={max_pools}, max_pages*PAGE={covered})"),
                        ("page_table", page_table, num_pages, "cache's pages")])
    return fp8_dtype, layout, max_pools, limit


@on_device_of("q_fp8")
def paged_pool_logits(q_fp8, kv_cache, weights, pool_lens, page_table, *, layout=None, fp8_dtype=None,
                      max_pools=None):
    """Decode / speculative-verify pooled fp8 logits over the paged indexer cache.

    Parameters
    ----------
    q_fp8 : fp8 (or uint8 codes) ``[B, next_n, H, 128]``, H in {16, 32, 64}: rotated,
        quantized queries (``fwht128_quant_fp8``). Unit inner stride.
    kv_cache : uint8 ``[num_pages, PAGE, 132]`` indexer K cache (page stride may be padded).
    weights : fp32 ``[B, next_n, H]`` folded head weights ``weights_h * q_scale_h *
        128^-0.5 * H^-0.5`` (may be negative).
    pool_lens : int32/int64 ``[B, next_n]``: pools visible to each row (a verify row sees
        the pools completed up to and including its own token); negative = 0.
    page_table : int32/int64 ``[B, max_pages]``: request ``b``'s pool ``j`` is state
        ``j % PAGE`` of page ``page_table[b, j // PAGE]``; a negative page (none) reads
        nothing and its visible pools score NaN (ranked after every number by the selection).
    layout : ``"plain"`` / ``"preshuffle"`` (default from the platform).
    fp8_dtype : format of the codes (default: ``q_fp8.dtype`` if fp8, else the platform's).
    max_pools : output width (default ``max_pages * PAGE``); every ``pool_lens`` entry must
        be ``<= min(max_pools, max_pages * PAGE)``.

    Returns
    -------
    fp32 ``[B * next_n, max_pools]``: row ``b * next_n + t`` holds the logits of pools
    ``j < pool_lens[b, t]`` and ``-inf`` after them (exact formulation: module docstring).
    """
    fp8_dtype, layout, max_pools, limit = check_paged_args(q_fp8, kv_cache, weights, pool_lens, page_table, layout,
                                                           fp8_dtype, max_pools)
    device = q_fp8.device
    batch, next_n, heads = q_fp8.shape[:3]
    num_pages, page = kv_cache.shape[:2]
    if backend_for(device) == "torch":
        return reference.paged_pool_logits(q_fp8.view(torch.uint8), kv_cache, weights, pool_lens, page_table,
                                           layout, fp8_dtype, max_pools)
    rows = batch * next_n
    out = torch.empty((rows, max_pools), dtype=torch.float32, device=device)
    if rows == 0 or max_pools == 0:
        return out
    if limit == 0:
        return out.fill_(float("-inf"))
    q8 = q_fp8.view(torch.uint8)
    grid = (rows, cdiv(max_pools, BLOCK_POOLS))
    _paged_logits_kernel[grid](
        q8, q8.stride(0), q8.stride(1), q8.stride(2), weights, weights.stride(0), weights.stride(1),
        weights.stride(2), pool_lens, pool_lens.stride(0), pool_lens.stride(1),
        page_table, page_table.stride(0), page_table.stride(1), kv_cache, kv_cache.view(torch.float32),
        kv_cache.stride(0), num_pages, out, out.stride(0), max_pools, limit, next_n, halves_table(fp8_dtype, device),
        PAGE=page, BN=BLOCK_POOLS, H=heads, PRESHUFFLE=layout == "preshuffle", **decode_args(fp8_dtype, device),
        enable_fp_fusion=False, **pdl_launch(device),
    )
    return out


@on_device_of("q_fp8")
def ragged_pool_logits(q_fp8, k_codes, k_scale, weights, ks, ke, *, fp8_dtype=None):
    """Prefill pooled fp8 logits of each query against a contiguous run of pools.

    Parameters
    ----------
    q_fp8 : fp8 (or uint8 codes) ``[T, H, 128]``, H in {16, 32, 64}. Unit inner stride.
    k_codes : fp8 (or uint8 codes) ``[N, 128]`` gathered pooled keys. Unit inner stride.
    k_scale : fp32 ``[N]`` (or ``[N, 1]``) key scales.
    weights : fp32 ``[T, H]`` folded head weights (may be negative).
    ks, ke : int32/int64 ``[T]``: query ``t`` sees pools ``[ks[t], ke[t])``
        (``0 <= ks``, ``ke <= N``; ``ks >= ke`` = none).
    fp8_dtype : format of the codes (default: from the fp8 inputs, else the platform's).

    Returns
    -------
    fp32 ``[T, N]``: logits inside each row's window, ``-inf`` outside (exact formulation:
    module docstring).
    """
    check_tensor("q_fp8", q_fp8, dtype=CODE_DTYPES, ndim=3, inner_contiguous=True)
    device = q_fp8.device
    n_q, heads, hd = q_fp8.shape
    if hd != HEAD_DIM:
        raise ValueError(f"q_fp8 must have shape [T, H, {HEAD_DIM}], got {list(q_fp8.shape)}")
    check_heads("q_fp8", heads)
    check_tensor("k_codes", k_codes, dtype=CODE_DTYPES, shape=(None, HEAD_DIM), device=device, inner_contiguous=True)
    n_keys = k_codes.shape[0]
    fp8_dtype = code_format({"q_fp8": q_fp8, "k_codes": k_codes}, fp8_dtype, device)
    check_tensor("k_scale", k_scale, dtype=torch.float32, device=device)
    if tuple(k_scale.shape) not in ((n_keys,), (n_keys, 1)):
        raise ValueError(f"k_scale must have shape [{n_keys}] or [{n_keys}, 1], got {list(k_scale.shape)}")
    k_scale = k_scale.reshape(n_keys)
    check_tensor("weights", weights, dtype=torch.float32, shape=(n_q, heads), device=device)
    check_tensor("ks", ks, dtype=INT_DTYPES, shape=(n_q,), device=device)
    check_tensor("ke", ke, dtype=INT_DTYPES, shape=(n_q,), device=device)
    if n_q and range_checks_enabled():
        lo, hi = torch.stack([ks.min().to(torch.int64), ke.max().to(torch.int64)]).tolist()  # one read-back
        if lo < 0:
            raise ValueError(f"ks holds {lo}; pool windows start at 0 or later")
        if hi > n_keys:
            raise ValueError(f"ke holds {hi}, past the N = {n_keys} pools of k_codes")
    if backend_for(device) == "torch":
        return reference.ragged_pool_logits(q_fp8.view(torch.uint8), k_codes.view(torch.uint8), k_scale, weights,
                                            ks, ke, fp8_dtype)
    out = torch.empty((n_q, n_keys), dtype=torch.float32, device=device)
    if n_q == 0 or n_keys == 0:
        return out
    q8, k8 = q_fp8.view(torch.uint8), k_codes.view(torch.uint8)
    grid = (n_q, cdiv(n_keys, RAGGED_TILE * RAGGED_TILES))
    _ragged_logits_kernel[grid](
        q8, q8.stride(0), q8.stride(1), weights, weights.stride(0), weights.stride(1),
        k8, k8.stride(0), k_scale, k_scale.stride(0), ks, ks.stride(0), ke, ke.stride(0), n_keys, out, out.stride(0),
        halves_table(fp8_dtype, device), BN=RAGGED_TILE, NT=RAGGED_TILES, H=heads, **decode_args(fp8_dtype, device),
        enable_fp_fusion=False, **pdl_launch(device),
    )
    return out
