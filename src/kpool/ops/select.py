"""Pool ids -> token ids: expansion, tail append, page-table / offset mapping, pooled page tables.

Seed-compatible entry points (same names and positional order as the seed):
``expand_pools_and_append_tail`` (the fused path the indexer uses), ``expand_pools_to_tokens``,
``append_tail_to_topk``, ``build_pooled_page_table``, ``compute_pooled_write_locs`` and
``history_group_budget_for_topk``. Every token-producing kernel maps token ids through the one
helper ``_map_tokens`` (identity, per-row page table with clamped gathers, or per-row offsets).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import reference
from ..layout import cdiv, next_pow2
from .._backend import backend_for, on_device_of, pdl_launch
from .._checks import (INT_DTYPES, MAX_SELECT, check_index_ranges, check_int, check_pool_size, check_tensor,
                       range_checks_enabled)
from . import _pdl

# Mapping modes of ``_map_tokens``.
MAP_NONE, MAP_PAGE_TABLE, MAP_OFFSETS = 0, 1, 2

TILE_ELEMS = 2048   # output int32 per row per program of the expansion / copy kernels
ROWS_PER_PROG = 2   # rows per program (H200 sweep: 2 rows x 2048-int tiles, 4 warps best)
EXPAND_WARPS = 4    # warps of the fused expand kernel
TAIL_MAX_BLOCK = 512
FLAT_BLOCK = 1024   # elements per program of the 1-D kernels
MAX_TOKENS = 2**31  # token ids (and mapped ids) are int32: every one written must be below this


# ----------------------------------------------------------------------------------------------
# Shared device helpers
# ----------------------------------------------------------------------------------------------

@triton.jit
def _map_tokens(tok, valid, row, map_ptr, map_s0, map_s1, map_cols, MAP: tl.constexpr):
    """Token ids -> output int32 (same shape as ``tok``), -1 where ``valid`` is False.

    ``tok``: int64 request-relative token ids of output row ``row`` (int64 scalar, always a
    real row: callers clamp it, so the unmasked per-row offset load stays in bounds).
    MAP_NONE: the id itself. MAP_PAGE_TABLE: ``page_table[row, clamp(tok, 0, map_cols - 1)]``
    (loads only where valid, never out of bounds). MAP_OFFSETS: ``tok + topk_offsets[row]``.
    """
    if MAP == 1:
        safe = tl.minimum(tl.maximum(tok, 0), map_cols - 1)
        val = tl.load(map_ptr + row * map_s0 + safe * map_s1, mask=valid, other=-1).to(tl.int64)
    elif MAP == 2:
        val = tok + tl.load(map_ptr + row * map_s0).to(tl.int64)
    else:
        val = tok
    return tl.where(valid, val, -1).to(tl.int32)


@triton.jit
def store_tail(out_row_ptr, row, row_ok, start, count, n_tail, map_ptr, map_s0, map_s1, map_cols,
                P: tl.constexpr, TAIL_BLOCK: tl.constexpr, MAP: tl.constexpr):
    """Write the ``n_tail`` columns after a row's history: tail token ``start + j`` for
    ``j < min(count, P - 1)`` (mapped), -1 elsewhere (the padding up to the output width).
    Nothing is written when ``row_ok`` is False (masks are single comparisons against
    row-gated limits: the CPU interpreter mis-types ``scalar_bool & tensor_bool``)."""
    j = tl.arange(0, TAIL_BLOCK)  # [TB]
    n_valid = tl.where(row_ok, tl.minimum(count, P - 1), 0)
    n_store = tl.where(row_ok, n_tail, 0)
    for j0 in range(0, n_tail, TAIL_BLOCK):
        jj = j0 + j
        vals = _map_tokens(start + jj, jj < n_valid, row, map_ptr, map_s0, map_s1, map_cols, MAP)
        tl.store(out_row_ptr + jj, vals, mask=jj < n_store)


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------

@triton.jit
def _expand_pools_kernel(ids_ptr, ids_s0, valid_ptr, valid_s0, seq_ptr, seq_s0, out_ptr, out_s0,
                         map_ptr, map_s0, map_s1, map_cols, rows, n_pools, n_tail,
                         P: tl.constexpr, PB: tl.constexpr, BLOCK_POOLS: tl.constexpr,
                         ROWS: tl.constexpr, TAIL_BLOCK: tl.constexpr, HAS_VALID: tl.constexpr,
                         HAS_TAIL: tl.constexpr, MAP: tl.constexpr, PDL: tl.constexpr):
    _pdl.grid_dependency_sync(PDL)
    # Grid (cdiv(rows, ROWS), cdiv(n_pools, BLOCK_POOLS)). Program (i, c) expands pools
    # [c*BP, (c+1)*BP) of rows [i*ROWS, (i+1)*ROWS) as [BP, PB] tiles: one load per pool id, one
    # contiguous store of BP*P int32 per row. Programs with c == 0 also write the n_tail columns
    # after the history (tail tokens from seq_lens, then -1 padding).
    pid_r = tl.program_id(0).to(tl.int64)
    pid_c = tl.program_id(1)
    g = pid_c * BLOCK_POOLS + tl.arange(0, BLOCK_POOLS)  # [BP] pool column
    o = tl.arange(0, PB)  # [PB] token within the pool
    o_ok = o < P
    cols = g[:, None] * P + o[None, :]  # [BP, PB] output column
    for r in tl.static_range(ROWS):
        row_ok = pid_r * ROWS + r < rows
        row = tl.minimum(pid_r * ROWS + r, rows - 1)  # loads stay in bounds; stores are masked
        ld = g < tl.where(row_ok, n_pools, 0)  # [BP]
        ids = tl.load(ids_ptr + row * ids_s0 + g, mask=ld, other=-1)  # [BP]
        if HAS_VALID:
            ok = ld & (tl.load(valid_ptr + row * valid_s0 + g, mask=ld, other=0) != 0)
        else:
            ok = ld & (ids >= 0)
        tok = ids.to(tl.int64)[:, None] * P + o[None, :]  # [BP, PB]
        vals = _map_tokens(tok, ok[:, None] & o_ok[None, :], row, map_ptr, map_s0, map_s1, map_cols, MAP)
        tl.store(out_ptr + row * out_s0 + cols, vals, mask=ld[:, None] & o_ok[None, :])
        if HAS_TAIL:
            if pid_c == 0:
                seq = tl.maximum(tl.load(seq_ptr + row * seq_s0, mask=row_ok, other=0).to(tl.int64), 0)
                start = (seq // P) * P
                store_tail(out_ptr + row * out_s0 + n_pools * P, row, row_ok, start, seq - start, n_tail,
                            map_ptr, map_s0, map_s1, map_cols, P, TAIL_BLOCK, MAP)


@triton.jit
def _append_tail_kernel(src_ptr, src_s0, seq_ptr, seq_s0, plen_ptr, plen_s0, out_ptr, out_s0,
                        map_ptr, map_s0, map_s1, map_cols, rows, n_cols, n_tail,
                        P: tl.constexpr, BLOCK_COLS: tl.constexpr, ROWS: tl.constexpr,
                        TAIL_BLOCK: tl.constexpr, MAP: tl.constexpr, PDL: tl.constexpr):
    _pdl.grid_dependency_sync(PDL)
    # Grid (cdiv(rows, ROWS), cdiv(n_cols, BLOCK_COLS)). Program (i, c) copies history columns
    # [c*BC, (c+1)*BC) of rows [i*ROWS, (i+1)*ROWS) (each row its own history); programs with
    # c == 0 also write the P-1 tail columns from pool_lens / seq_lens.
    pid_r = tl.program_id(0).to(tl.int64)
    pid_c = tl.program_id(1)
    c = pid_c * BLOCK_COLS + tl.arange(0, BLOCK_COLS)  # [BC]
    for r in tl.static_range(ROWS):
        row_ok = pid_r * ROWS + r < rows
        row = tl.minimum(pid_r * ROWS + r, rows - 1)  # loads stay in bounds; stores are masked
        c_ok = c < tl.where(row_ok, n_cols, 0)
        hist = tl.load(src_ptr + row * src_s0 + c, mask=c_ok)
        tl.store(out_ptr + row * out_s0 + c, hist, mask=c_ok)
        if pid_c == 0:
            seq = tl.maximum(tl.load(seq_ptr + row * seq_s0, mask=row_ok, other=0).to(tl.int64), 0)
            start = tl.maximum(tl.load(plen_ptr + row * plen_s0, mask=row_ok, other=0).to(tl.int64), 0) * P
            store_tail(out_ptr + row * out_s0 + n_cols, row, row_ok, start, seq - start, n_tail,
                        map_ptr, map_s0, map_s1, map_cols, P, TAIL_BLOCK, MAP)


@triton.jit
def _pooled_page_table_kernel(src_ptr, src_s0, src_s1, out_ptr, rows, out_cols,
                              P: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    _pdl.grid_dependency_sync(PDL)
    # Grid (rows, cdiv(out_cols, BLOCK)): out[r, c] = src[r, c*P] for a [BLOCK] column tile.
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    ok = c < out_cols
    vals = tl.load(src_ptr + row * src_s0 + c.to(tl.int64) * P * src_s1, mask=ok)
    tl.store(out_ptr + row * out_cols + c, vals, mask=ok)


@triton.jit
def _pooled_write_locs_kernel(pt_ptr, pt_s0, n_pages, ids_ptr, out_ptr, n,
                              P: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    _pdl.grid_dependency_sync(PDL)
    # Grid (cdiv(n, BLOCK),): loc = page_table_64[(id // 64) * P] * 64 + id % 64, -1 for a negative
    # id or a page row past the table (the gather index is masked, never out of bounds).
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    live = i < n
    ids = tl.load(ids_ptr + i, mask=live, other=-1).to(tl.int64)
    page_row = (tl.maximum(ids, 0) // 64) * P
    ok = live & (ids >= 0) & (page_row < n_pages)
    page = tl.load(pt_ptr + page_row * pt_s0, mask=ok, other=0).to(tl.int64)
    tl.store(out_ptr + i, tl.where(ok, page * 64 + (tl.maximum(ids, 0) % 64), -1), mask=live)


@triton.jit
def store_visible_counts(pos_ptr, out_ptr, n, i, live, P: tl.constexpr):
    """``out[0, i] = max(pos[i] + 1, 0)`` (tokens row ``i`` sees) and ``out[1, i]`` = that // P
    (its complete pools) where ``live``; ``out`` int64 ``[2, n]``."""
    seq = tl.maximum(tl.load(pos_ptr + i, mask=live, other=-1).to(tl.int64) + 1, 0)
    tl.store(out_ptr + i, seq, mask=live)
    tl.store(out_ptr + n + i, seq // P, mask=live)


@triton.jit
def _visible_counts_kernel(pos_ptr, out_ptr, n, P: tl.constexpr, BLOCK: tl.constexpr,
                           PDL: tl.constexpr):
    _pdl.grid_dependency_sync(PDL)
    # Grid (cdiv(n, BLOCK),): store_visible_counts of rows [pid * BLOCK, + BLOCK).
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    store_visible_counts(pos_ptr, out_ptr, n, i, i < n, P)


# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------

def _inner_contiguous(t):
    """``t`` itself when its last dim has unit stride (or at most one element), else a copy."""
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def _check_columns(name: str, cols: int) -> None:
    """The ``cols`` output columns an input's shape implies must fit int32 column ids."""
    if cols > MAX_SELECT:
        raise ValueError(f"{name} would give {cols} output columns, more than {MAX_SELECT} (int32 column ids)")


def natural_width(n_pools: int, pool_size: int) -> int:
    """Token columns of ``n_pools`` expanded pools plus the longest tail: ``n_pools * P + P - 1``."""
    return n_pools * pool_size + pool_size - 1


POOL_ID_RANGE = "pool ids whose token ids fit int32"
SEQ_LEN_RANGE = "int32 token ids"


def check_token_range(name: str, ids, pool_size: int, valid=None, topk_offsets=None, also=()) -> None:
    """The int32 token ids of pools ``ids`` (negative = none; where ``valid``, if given) plus
    their row's ``topk_offsets`` must fit int32: ``pool * P + o (+ offset) < 2^31``; with the
    ranges ``also`` in the same sync (skipped where ``range_checks_enabled`` says so)."""
    if not range_checks_enabled():
        return
    live = ids if valid is None else torch.where(valid, ids, -1)
    _check_ids_and_offsets([(name, live, MAX_TOKENS // pool_size, POOL_ID_RANGE), *also], topk_offsets,
                           lambda top: top * pool_size + pool_size - 1)


def _check_ids_and_offsets(ranges, topk_offsets, last_token) -> None:
    """``check_index_ranges`` of ``ranges`` and, in the same read-back, ``topk_offsets``' extremes:
    they must be non-negative (a negative one gives negative ids that are not the -1 padding) and
    keep the token ids up to ``last_token(the first range's maximum)`` plus them below 2^31.
    Offsets are read only where the first range has entries."""
    read = topk_offsets is not None and topk_offsets.numel() > 0 and ranges[0][1].numel() > 0
    got = check_index_ranges(ranges, extra=list(torch.aminmax(topk_offsets)) if read else [])
    if not read or got is None or got[0] is None:
        return
    low, high = got[len(ranges):]
    top = last_token(got[0])
    if low < 0:
        raise ValueError(f"topk_offsets holds {low}: offsets must be >= 0")
    if top + high >= MAX_TOKENS:
        raise ValueError(f"topk_offsets maps token ids up to {top + high}, past the int32 output (< 2^31)")


def check_expansion(seq_lens, pool_size, width, rows: int, n_pools: int, device, also=(), pool_ids=None) -> int:
    """Validate the ``seq_lens [rows]``, ``pool_size`` and ``width`` of an expansion of ``n_pools``
    pool ids per row (``expand_pools_and_append_tail``), and the range of ``seq_lens`` with the
    ranges ``also`` and of the optional ``pool_ids`` (one sync); returns ``width`` (None: the
    ``natural_width``)."""
    width = expansion_width(n_pools, pool_size, width)
    if pool_ids is not None:
        also = [*also, ("pool_ids", pool_ids, MAX_TOKENS // pool_size, POOL_ID_RANGE)]
    check_tensor("seq_lens", seq_lens, dtype=INT_DTYPES, shape=(rows,), device=device)
    check_index_ranges([("seq_lens", seq_lens, MAX_TOKENS, SEQ_LEN_RANGE), *also])
    return width


def expansion_width(n_pools: int, pool_size: int, width) -> int:
    """The output columns of an expansion of ``n_pools`` pool ids per row: ``width`` (None: the
    ``natural_width``) checked against the natural width and the int32 column ids; host values
    only (the torch.library fakes check with it too)."""
    check_pool_size(pool_size)
    natural = natural_width(n_pools, pool_size)
    _check_columns(f"{n_pools} pools per row at pool_size {pool_size}", natural)
    if width is None:
        return natural
    check_int("width", width, least=0, most=MAX_SELECT)
    if width < natural:
        raise ValueError(f"width must be >= n_pools*pool_size + pool_size - 1 = {natural}, got {width}")
    return width


def _check_mapping(rows, device, page_table, topk_offsets) -> list:
    """Validate the optional ``page_table [>= rows, W]`` / ``topk_offsets [rows] or [rows, 1]``;
    returns the page table's value range for the caller's ``check_index_ranges`` (one sync)."""
    if page_table is not None and topk_offsets is not None:
        raise ValueError("page_table and topk_offsets are mutually exclusive: pass at most one")
    if page_table is not None:
        check_tensor("page_table", page_table, dtype=INT_DTYPES, ndim=2, device=device)
        if page_table.shape[0] < rows or page_table.shape[1] < 1:
            raise ValueError(f"page_table must have shape [>= {rows}, >= 1] (one row per output row), "
                             f"got {list(page_table.shape)}")
    if topk_offsets is not None:
        check_tensor("topk_offsets", topk_offsets, dtype=INT_DTYPES, device=device)
        if tuple(topk_offsets.shape) not in ((rows,), (rows, 1)):
            raise ValueError(f"topk_offsets must have shape [{rows}] or [{rows}, 1], got {list(topk_offsets.shape)}")
    return [] if page_table is None else [("page_table", page_table, MAX_TOKENS, "int32 output ids")]


def _map_args(page_table, topk_offsets, fallback):
    """``(mode, ptr, s0, s1, cols)`` kernel arguments of the mapping (``fallback``: any tensor)."""
    if page_table is not None:
        return MAP_PAGE_TABLE, page_table, page_table.stride(0), page_table.stride(1), page_table.shape[1]
    if topk_offsets is not None:
        return MAP_OFFSETS, topk_offsets, topk_offsets.stride(0), 0, 1
    return MAP_NONE, fallback, 0, 0, 1


def tail_block(n_tail):
    """``TAIL_BLOCK`` of ``store_tail`` for ``n_tail`` columns after the history."""
    return min(next_pow2(max(n_tail, 1)), TAIL_MAX_BLOCK)


def launch_expand_pools(ids, valid, seq_lens, out, pool_size, page_table=None, topk_offsets=None):
    """Launch ``_expand_pools_kernel`` (arguments validated; ``ids`` / ``valid`` inner-contiguous).

    Writes ``out [rows, >= n_pools*P]`` int32: the expanded history, then (when ``seq_lens``
    is given) the tail and -1 padding up to ``out.shape[1]``.
    """
    rows, n_pools = ids.shape
    if rows == 0 or out.shape[1] == 0:
        return
    pb = next_pow2(pool_size)
    block_pools = min(next_pow2(max(n_pools, 1)), max(1, TILE_ELEMS // pb))
    n_tail = out.shape[1] - n_pools * pool_size
    mode, mptr, ms0, ms1, mcols = _map_args(page_table, topk_offsets, ids)
    grid = (cdiv(rows, ROWS_PER_PROG), max(1, cdiv(n_pools, block_pools)))
    _expand_pools_kernel[grid](
        ids, ids.stride(0), valid if valid is not None else ids, valid.stride(0) if valid is not None else 0,
        seq_lens if seq_lens is not None else ids, seq_lens.stride(0) if seq_lens is not None else 0,
        out, out.stride(0), mptr, ms0, ms1, mcols, rows, n_pools, n_tail,
        P=pool_size, PB=pb, BLOCK_POOLS=block_pools, ROWS=ROWS_PER_PROG, TAIL_BLOCK=tail_block(n_tail),
        HAS_VALID=valid is not None, HAS_TAIL=seq_lens is not None, MAP=mode, num_warps=EXPAND_WARPS,
        **pdl_launch(out.device),
    )


@on_device_of("pool_ids")
def expand_pools_and_append_tail(pool_ids, seq_lens, pool_size, *, width=None, page_table=None):
    """Fused expansion of selected pools to tokens plus the always-selected tail.

    Parameters
    ----------
    pool_ids : int32/int64 ``[rows, n_pools]`` selected pool ids in selection order; negative
        = empty pick (its ``P`` columns are -1).
    seq_lens : int32/int64 ``[rows]`` token-granular sequence length of each query row
        (``pos + 1``); negative (padding rows) counts as 0.
    pool_size : P.
    width : optional int in ``[n_pools*P + P - 1, 2^31 - 1]``: output width (e.g. rounded up to a
        multiple of 128); the extra columns are -1.
    page_table : optional int32/int64 ``[>= rows, W]``: every valid token ``t`` of row ``r`` is
        replaced by ``page_table[r, clamp(t, 0, W - 1)]``.

    Returns
    -------
    int32 ``[rows, width]``: columns ``[0, n_pools*P)`` hold ``pool*P + o`` per pool, the next
    ``P - 1`` the tail tokens ``[seq_len//P*P, seq_len)`` (-1 padded), the rest -1.
    """
    check_tensor("pool_ids", pool_ids, dtype=INT_DTYPES, ndim=2)
    device = pool_ids.device
    rows, n_pools = pool_ids.shape
    mapping = _check_mapping(rows, device, page_table, None)
    width = check_expansion(seq_lens, pool_size, width, rows, n_pools, device, also=mapping, pool_ids=pool_ids)
    if backend_for(device) == "torch":
        return reference.expand_pools_and_append_tail(pool_ids, seq_lens, pool_size, width=width,
                                                      page_table=page_table)
    out = torch.empty((rows, width), dtype=torch.int32, device=device)
    launch_expand_pools(_inner_contiguous(pool_ids), None, seq_lens, out, pool_size, page_table=page_table)
    return out


@on_device_of("group_ids")
def expand_pools_to_tokens(group_ids, group_valid, topk, pool_size, page_table=None, topk_offsets=None):
    """Expand selected pool ids to a ``topk``-wide token row (no tail).

    Parameters
    ----------
    group_ids : int32/int64 ``[rows, topk // P]`` pool ids.
    group_valid : bool ``[rows, topk // P]``: False -> the pool's ``P`` columns are -1.
    topk : output width in tokens (a multiple of P).
    pool_size : P.
    page_table : optional int32/int64 ``[>= rows, W]``: token ``t`` of row ``r`` ->
        ``page_table[r, clamp(t, 0, W - 1)]``.
    topk_offsets : optional int32/int64 ``[rows]`` or ``[rows, 1]``: token ``t`` of row ``r`` ->
        ``t + topk_offsets[r]``. At most one of ``page_table`` / ``topk_offsets``.

    Returns
    -------
    int32 ``[rows, topk]``: ``group*P + o`` (mapped) for valid pools, -1 for invalid ones.
    """
    n_pools = history_group_budget_for_topk(topk, pool_size)
    check_tensor("group_ids", group_ids, dtype=INT_DTYPES, ndim=2)
    device = group_ids.device
    if group_ids.shape[1] != n_pools:
        raise ValueError(f"group_ids must have topk // pool_size = {n_pools} columns, got shape "
                         f"{list(group_ids.shape)}")
    check_tensor("group_valid", group_valid, dtype=torch.bool, shape=tuple(group_ids.shape), device=device)
    rows = group_ids.shape[0]
    mapping = _check_mapping(rows, device, page_table, topk_offsets)
    check_token_range("group_ids", group_ids, pool_size, group_valid, topk_offsets, also=mapping)
    if backend_for(device) == "torch":
        return reference.expand_pools_to_tokens(group_ids, group_valid, topk, pool_size, page_table, topk_offsets)
    out = torch.empty((rows, topk), dtype=torch.int32, device=device)
    launch_expand_pools(_inner_contiguous(group_ids), _inner_contiguous(group_valid).view(torch.uint8), None, out,
                        pool_size, page_table=page_table, topk_offsets=topk_offsets)
    return out


@on_device_of("topk_result")
def append_tail_to_topk(topk_result, seq_lens, pool_lens, pool_size, page_table=None, topk_offsets=None):
    """Append each row's tail tokens after its own history.

    Parameters
    ----------
    topk_result : int32 ``[rows, n_cols]`` token ids (each row keeps its own history).
    seq_lens : int32/int64 ``[rows]`` token-granular lengths; negative counts as 0.
    pool_lens : int32/int64 ``[rows]`` complete pools per row (``seq_len // P``); negative counts as 0.
    pool_size : P. With P == 1 there is no tail and ``topk_result`` itself is returned.
    page_table, topk_offsets : optional mapping of the tail tokens, as in ``expand_pools_to_tokens``.

    Returns
    -------
    int32 ``[rows, n_cols + P - 1]``: the history, then tokens ``pool_len*P + j`` for
    ``j < seq_len - pool_len*P`` (mapped), -1 elsewhere.
    """
    check_pool_size(pool_size)
    check_tensor("topk_result", topk_result, dtype=torch.int32, ndim=2)
    device = topk_result.device
    rows, n_cols = topk_result.shape
    _check_columns(f"topk_result's {n_cols} columns plus the pool_size - 1 tail", n_cols + pool_size - 1)
    check_tensor("seq_lens", seq_lens, dtype=INT_DTYPES, shape=(rows,), device=device)
    check_tensor("pool_lens", pool_lens, dtype=INT_DTYPES, shape=(rows,), device=device)
    mapping = _check_mapping(rows, device, page_table, topk_offsets)
    _check_ids_and_offsets([("seq_lens", seq_lens, MAX_TOKENS, SEQ_LEN_RANGE), *mapping], topk_offsets,
                           lambda top: top - 1)
    if pool_size == 1:
        return topk_result
    if backend_for(device) == "torch":
        return reference.append_tail_to_topk(topk_result, seq_lens, pool_lens, pool_size, page_table, topk_offsets)
    n_tail = pool_size - 1
    out = torch.empty((rows, n_cols + n_tail), dtype=torch.int32, device=device)
    if rows == 0:
        return out
    src = _inner_contiguous(topk_result)
    block_cols = min(next_pow2(max(n_cols, 1)), TILE_ELEMS)
    mode, mptr, ms0, ms1, mcols = _map_args(page_table, topk_offsets, src)
    grid = (cdiv(rows, ROWS_PER_PROG), max(1, cdiv(n_cols, block_cols)))
    _append_tail_kernel[grid](
        src, src.stride(0), seq_lens, seq_lens.stride(0), pool_lens, pool_lens.stride(0), out, out.stride(0),
        mptr, ms0, ms1, mcols, rows, n_cols, n_tail,
        P=pool_size, BLOCK_COLS=block_cols, ROWS=ROWS_PER_PROG, TAIL_BLOCK=tail_block(n_tail), MAP=mode,
        **pdl_launch(device),
    )
    return out


@on_device_of("page_table")
def build_pooled_page_table(page_table, pool_size):
    """Pool-granular page table: every ``pool_size``-th column of a token page table.

    Parameters
    ----------
    page_table : int32/int64 ``[..., W]`` with ``W % pool_size == 0``.
    pool_size : P.

    Returns
    -------
    Fresh row-major ``[..., W // P]`` tensor of ``page_table``'s dtype: ``out[..., c] = page_table[..., c*P]``.
    """
    check_pool_size(pool_size)
    check_tensor("page_table", page_table, dtype=INT_DTYPES)
    if page_table.ndim < 1:
        raise ValueError("page_table must have at least 1 dimension, got a 0-D tensor")
    w = page_table.shape[-1]
    if w % pool_size:
        raise ValueError(f"page_table's last dim ({w}) must be a multiple of pool_size ({pool_size})")
    if backend_for(page_table.device) == "torch":
        return reference.build_pooled_page_table(page_table, pool_size)
    out = torch.empty((*page_table.shape[:-1], w // pool_size), dtype=page_table.dtype, device=page_table.device)
    if out.numel() == 0:
        return out
    src = page_table.reshape(-1, w)
    rows, out_cols = src.shape[0], w // pool_size
    block = min(next_pow2(out_cols), FLAT_BLOCK)
    _pooled_page_table_kernel[(rows, cdiv(out_cols, block))](
        src, src.stride(0), src.stride(1), out, rows, out_cols, P=pool_size, BLOCK=block,
        **pdl_launch(out.device))
    return out


@on_device_of("page_table_64")
def compute_pooled_write_locs(page_table_64, pool_ids, pool_size):
    """Map pool ids to flat cache slots through a 64-token page table (sglang-style).

    Parameters
    ----------
    page_table_64 : int32/int64 ``[num_token_pages]`` physical block of each 64-token page.
    pool_ids : int32/int64 ``[...]`` request-relative pool ids; negative = padding.
    pool_size : P (a pool's entry lives in the block of the first token page of its group).

    Returns
    -------
    int64 ``[...]`` (shape of ``pool_ids``): ``page_table_64[(id // 64) * P] * 64 + id % 64``;
    -1 for negative ids. A non-negative id whose page row is past the table, or a table entry
    of 2^57 or more (its slots would overflow int64), raises (when range checks run, see
    ``KPOOL_CHECK``); otherwise such an id gives -1.
    """
    check_pool_size(pool_size)
    check_tensor("page_table_64", page_table_64, dtype=INT_DTYPES, ndim=1)
    device = page_table_64.device
    check_tensor("pool_ids", pool_ids, dtype=INT_DTYPES, device=device)
    n_pages = page_table_64.shape[0]
    limit = cdiv(n_pages, pool_size) * 64  # ids with (id // 64) * P < n_pages
    check_index_ranges([("pool_ids", pool_ids, limit, f"pooled page table ({n_pages} token pages, P={pool_size})"),
                        ("page_table_64", page_table_64, 1 << 57, "blocks whose 64 slots fit in int64")])
    if backend_for(device) == "torch":
        return reference.compute_pooled_write_locs(page_table_64, pool_ids, pool_size)
    out = torch.empty(pool_ids.shape, dtype=torch.int64, device=device)
    n = pool_ids.numel()
    if n == 0:
        return out
    ids = pool_ids.contiguous()
    _pooled_write_locs_kernel[(cdiv(n, FLAT_BLOCK),)](
        page_table_64, page_table_64.stride(0), n_pages, ids, out, n, P=pool_size, BLOCK=FLAT_BLOCK,
        **pdl_launch(device))
    return out


@on_device_of("positions")
def visible_counts(positions, pool_size):
    """Tokens and complete pools each query row sees, in one launch.

    Parameters
    ----------
    positions : int32/int64 ``[...]`` token positions; negative = padding row.
    pool_size : P.

    Returns
    -------
    ``(seq_lens, pool_lens)``: int64 ``[positions.numel()]`` each (flattened in row-major order):
    ``max(pos + 1, 0)`` and ``seq_lens // P``.
    """
    check_pool_size(pool_size)
    check_tensor("positions", positions, dtype=INT_DTYPES)
    pos = positions.reshape(-1)
    if backend_for(positions.device) == "torch":
        return reference.visible_counts(pos, pool_size)
    n = pos.numel()
    out = torch.empty((2, n), dtype=torch.int64, device=positions.device)
    if n:
        _visible_counts_kernel[(cdiv(n, FLAT_BLOCK),)](pos.contiguous(), out, n, P=pool_size, BLOCK=FLAT_BLOCK,
                                                              **pdl_launch(positions.device))
    return out[0], out[1]


def history_group_budget_for_topk(topk, pool_size):
    """Number of pools to select so that expanding them yields ``topk`` tokens (``topk // P``)."""
    check_pool_size(pool_size)
    check_int("topk", topk, least=pool_size, most=MAX_SELECT)
    if topk % pool_size:
        raise ValueError(f"topk ({topk}) must be a multiple of pool_size ({pool_size})")
    return topk // pool_size


__all__ = [
    "expand_pools_and_append_tail", "expand_pools_to_tokens", "append_tail_to_topk", "build_pooled_page_table",
    "compute_pooled_write_locs", "history_group_budget_for_topk",
]
