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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import reference
from .._backend import backend_for, pdl_launch, register_cap
from .._checks import check_positive_int
from . import _pdl, topk
from ._jit_fp8 import halves_table
from .logits import check_paged_args, decode_args, paged_tile, paged_tile_logits, query_halves

BLOCK_POOLS = 64  # pools per scoring tile: the MMA's M (one wgmma warpgroup on Hopper)
NUM_WARPS = 4
MAX_REGS = 168  # CUDA register cap: 3 programs per SM instead of 2 (H200: 32 x 128K -10%, 128 x 1M -11%)
PIPELINE_STAGES = tl.constexpr(2)  # tiles in flight in the leaf loop (tl.range's software pipelining)
MAX_ROWS = 2  # query rows of one request per program (H200, verify 32 x 128K x 4 / prefill 8192 x 32K:
#               1 row 1,092 us / 69.2 ms, 2 rows 866 / 54.9; 4 rows 1,225 / 69.0, 960 / 57.6 uncapped: spills)


@triton.jit
def _paged_topk_kernel(q_ptr, q_sb, q_sn, q_sh, w_ptr, w_sb, w_sn, w_sh, lens_ptr, lens_stride,
                       pt_ptr, pt_sb, pt_sp, kv_ptr, kv_f32_ptr, page_stride, num_pages,
                       cand_ptr, count_ptr, out_ptr, out_stride, vis_limit, next_n, select_k, n_chunks, lut_ptr,
                       PAGE: tl.constexpr, BN: tl.constexpr, NT: tl.constexpr, KB: tl.constexpr, H: tl.constexpr,
                       ROWS: tl.constexpr, PRESHUFFLE: tl.constexpr, FINAL: tl.constexpr, FNUZ: tl.constexpr,
                       NATIVE_FP8: tl.constexpr, PDL: tl.constexpr):
    _pdl.grid_dependency_sync(PDL)
    # Program (group, chunk): rows b * next_n + t for t in [t0, t0 + ROWS) of one request b
    # (same page table), pools [chunk * NT * BN, (chunk + 1) * NT * BN): each key tile is
    # decoded once and scored for all ROWS rows; each row keeps its KB best ranking keys.
    groups = tl.cdiv(next_n, ROWS)
    b = (tl.program_id(0) // groups).to(tl.int64)
    t0 = (tl.program_id(0) % groups).to(tl.int64) * ROWS
    chunk = tl.program_id(1).to(tl.int64)
    rr = tl.arange(0, ROWS)
    live = t0 + rr < next_n
    rows = b * next_n + t0 + rr  # [ROWS]
    topk.clear_counts(count_ptr, tl.where(live, rows, b * next_n), chunk, FINAL)  # rows past next_n: the first
    n_vis = tl.minimum(tl.maximum(tl.load(lens_ptr + rows * lens_stride, mask=live, other=0).to(tl.int64), 0),
                       vis_limit)  # [ROWS], topk.visible_pools of each row
    n_max = tl.max(n_vis)
    if n_max > select_k:
        c = tl.arange(0, ROWS * H)  # (row, head) columns
        q_rows = q_ptr + b * q_sb + (t0 + c // H) * q_sn + (c % H) * q_sh
        q_live = t0 + c // H < next_n
        q, q_nan = query_halves(q_rows[None, :] + tl.arange(0, 64)[:, None], q_live[None, :], lut_ptr, FNUZ,
                                NATIVE_FP8)
        w = tl.load(w_ptr + b * w_sb + (t0 + c // H) * w_sn + (c % H) * w_sh, mask=q_live, other=0.0)
        tiles = tl.arange(0, NT)
        keys = tl.full((NT, BN, ROWS), topk.NO_KEY, tl.int64)  # INT64_MIN = not seen
        pt_row = pt_ptr + b * pt_sb
        j0 = chunk * NT * BN  # first pool of the tile
        j = j0 + tl.arange(0, BN)
        n_leaf = tl.minimum(n_max, (chunk + 1) * NT * BN)  # the leaf's last pool any row sees + 1
        for i in tl.range(NT, num_stages=PIPELINE_STAGES):
            # Triton's pipeliner loads later tiles' entries (cp.async into shared memory) while
            # this one is scored; the key codes reach the MMA operand's layout as bytes
            codes, kscale, ok = paged_tile(kv_ptr, kv_f32_ptr, page_stride, num_pages, pt_row, pt_sp, j0, n_leaf,
                                           PAGE, BN, PRESHUFFLE)
            if (chunk * NT + i) * BN < n_max:
                seen = j[:, None] < n_vis[None, :]  # [BN, ROWS]
                x = paged_tile_logits(q, q_nan, w, codes, kscale, ok, seen, lut_ptr, BN, H, ROWS, FNUZ,
                                      NATIVE_FP8)
                keys = tl.where(tiles[:, None, None] == i, topk.pool_keys(x, j[:, None], seen)[None, :, :], keys)
            j0 += BN
            j += BN
        for r in tl.static_range(ROWS):
            if t0 + r < next_n:
                mine = tl.max(tl.where(rr[None, None, :] == r, keys, topk.NO_KEY), axis=2)  # [NT, BN]
                row = b * next_n + t0 + r
                topk.store_leaf(tl.reshape(mine, (NT * BN,)),
                                topk.leaf_list(cand_ptr, row * n_chunks + chunk, NT * BN, KB),
                                out_ptr + row * out_stride, tl.max(tl.where(rr == r, n_vis, 0)), select_k,
                                NT * BN, KB, FINAL)
    elif FINAL:
        for r in tl.static_range(ROWS):
            if t0 + r < next_n:
                topk.emit_in_order(out_ptr + (b * next_n + t0 + r) * out_stride,
                                   tl.max(tl.where(rr == r, n_vis, 0)), select_k, KB)


def query_rows(next_n: int) -> int:
    """``ROWS``: query rows of one request scored together by a program (powers of two up to
    ``MAX_ROWS``, never more than the step has)."""
    return min(MAX_ROWS, triton.next_power_of_2(next_n))


def launch_options(device) -> dict:
    """Compile options of ``_paged_topk_kernel``: ``MAX_REGS`` applies to CUDA targets only."""
    return dict(num_warps=NUM_WARPS, enable_fp_fusion=False, **register_cap(device, MAX_REGS))


def paged_pool_topk(q_fp8, kv_cache, weights, pool_lens, page_table, select_k, *, layout=None, fp8_dtype=None,
                    max_pools=None):
    """Score every visible pool of each decode / verify row and select the best, fused.

    Parameters
    ----------
    q_fp8, kv_cache, weights, pool_lens, page_table, layout, fp8_dtype, max_pools : as
        ``paged_pool_logits`` (``q_fp8 [B, next_n, H, 128]``, ``weights [B, next_n, H]``
        fp32 folded, ``pool_lens [B, next_n]``, ``page_table [B, max_pages]``).
    select_k : positive int, pools to pick per row (``index_topk // P``).

    Returns
    -------
    int32 ``[B * next_n, select_k]``: ``select_pools(paged_pool_logits(...), pool_lens,
    select_k)`` (highest score first, ties to the lower id, NaN last; every visible pool in
    order when there are at most ``select_k``; -1 padding), computed without a logits row.
    """
    fp8_dtype, layout, max_pools, limit = check_paged_args(q_fp8, kv_cache, weights, pool_lens, page_table, layout,
                                                           fp8_dtype, max_pools)
    check_positive_int("select_k", select_k)
    device = q_fp8.device
    batch, next_n, heads = q_fp8.shape[:3]
    rows = batch * next_n
    lens = pool_lens.reshape(rows)
    if backend_for(device) == "torch":
        logits = reference.paged_pool_logits(q_fp8.view(torch.uint8), kv_cache, weights, pool_lens, page_table,
                                             layout, fp8_dtype, max_pools)
        return reference.select_pools(logits, lens, select_k)
    out = torch.empty((rows, select_k), dtype=torch.int32, device=device)
    if rows == 0:
        return out
    q8 = q_fp8.view(torch.uint8)
    rows_per_prog = query_rows(next_n)

    def launch_leaves(cand, count, chunk, n_chunks, kb, final):
        _paged_topk_kernel[(batch * triton.cdiv(next_n, rows_per_prog), n_chunks)](
            q8, q8.stride(0), q8.stride(1), q8.stride(2), weights, weights.stride(0), weights.stride(1),
            weights.stride(2), lens, lens.stride(0), page_table, page_table.stride(0), page_table.stride(1),
            kv_cache, kv_cache.view(torch.float32), kv_cache.stride(0), kv_cache.shape[0],
            cand, count, out, out.stride(0), limit, next_n, select_k, n_chunks, halves_table(fp8_dtype, device),
            PAGE=kv_cache.shape[1], BN=BLOCK_POOLS, NT=chunk // BLOCK_POOLS, KB=kb, H=heads, ROWS=rows_per_prog,
            PRESHUFFLE=layout == "preshuffle", FINAL=final, **decode_args(fp8_dtype, device),
            **launch_options(device), **pdl_launch(device),
        )

    topk.select_by_leaves(out, lens, limit, select_k, launch_leaves, BLOCK_POOLS)
    return out
