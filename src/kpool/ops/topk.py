"""Deterministic top-k over pools (SPEC.md §5): ``select_pools`` and the shared selection tree.

Row ``r`` sees pools ``j < pool_lens[r]``. If more than ``select_k`` are visible, the
``select_k`` best are returned, highest score first, exact ties to the lower pool id;
otherwise every visible pool is returned in ascending id order. Remaining columns are -1.

Order used (identical on every backend, no float arithmetic): each fp32 score maps to an
int32 ``ordered`` that is monotone in the score, with ``-0.0`` equal to ``+0.0`` and every
NaN mapped to ``INT32_MIN``, below ``-inf`` (a NaN pool is picked only when nothing else
is left; ``-inf`` pools are still visible). The ranking key ``ordered * 2^32 + (2^32-1-id)``
is unique per pool (``reference.pool_order_keys``), so the selection is a pure function of
the inputs; pools a row does not see get the key ``INT64_MIN``.

Kernels (a tree of bitonic top-k, ``tl.topk``, over unique int64 keys):

1. leaves: one program per (row, chunk of ``CHUNK`` pools) keeps the ``KB`` best keys of
   its chunk (``KB = next_pow2(select_k)``), sorted (all of them, padded, when ``CHUNK <
   KB``: small batches get more, smaller leaves). ``_chunk_topk_kernel`` reads the keys'
   scores from a logits row; ``ops/score.py``'s fused decode kernel computes them on chip
   and never writes a logits row.
2. ``_merge_topk_kernel``: one program per (row, group of up to ``MERGE_FANIN`` lists)
   keeps the ``KB`` best of the group, until one list per row is left.
3. the last level (a leaf when a row has one chunk) writes pool ids: the list's first
   ``select_k`` keys decoded, or ``0 .. n-1`` when ``n <= select_k`` pools are visible.

Rows with ``n <= select_k`` visible pools skip the loads and the sorting.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import reference
from .._backend import backend_for, interpreting
from .._checks import INT_DTYPES, check_positive_int, check_tensor, range_checks_enabled

LEAF_BASE = 512  # leaves of up to MAX_CHUNK_FACTOR * max(KB, LEAF_BASE) pools ...
MAX_CHUNK_FACTOR = 2
MIN_CHUNK = 128  # ... and at least this many (smaller leaves keep all their keys, sorted)
MERGE_FANIN = 8  # lists merged per program (best_of_lists takes at most 8)
MERGE_WARPS = 16  # warps per merge program (H200: 1 x 128K merges 45.8 -> 40.8 us vs 4 warps)
PROGRAMS_PER_SM = 2  # leaf grid target when choosing the leaf size
MIN_KB = 16  # tl.topk / tl.arange below 16 keys do not lower on every target
NO_KEY = tl.constexpr(-9223372036854775807 - 1)  # INT64_MIN: the key of a pool the row does not see


@triton.jit
def ordered_score(x):
    """fp32 -> int64 in ``[-2^31, 2^31)``, monotone; -0.0 == +0.0; NaN -> -2^31 (lowest)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(x == 0, 0, bits)
    o = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
    return tl.where(x != x, -2147483648, o)


@triton.jit
def pool_keys(x, j, vis):
    """Ranking keys ``ordered(x) * 2^32 + (2^32 - 1 - j)`` of scores ``x`` of pools ``j``
    (int64, same shape); ``INT64_MIN`` where not ``vis``."""
    key = ordered_score(x) * 4294967296 + (4294967295 - j.to(tl.int64))
    return tl.where(vis, key, NO_KEY)


@triton.jit
def visible_pools(lens_ptr, off, n_cols):
    """The row's visible pool count (``pool_lens`` at element offset ``off``) clamped to
    ``[0, n_cols]`` (int64 scalar)."""
    return tl.minimum(tl.maximum(tl.load(lens_ptr + off).to(tl.int64), 0), n_cols)


@triton.jit
def emit_selection(out_ptr, keys, n_vis, select_k, KB: tl.constexpr):
    """Write ``select_k`` int32 pool ids of one row at ``out_ptr`` from its ``KB`` best keys
    (sorted, descending), or ``0 .. n_vis-1`` when ``n_vis <= select_k``; -1 padding."""
    c = tl.arange(0, KB)
    ids = tl.where(keys == NO_KEY, -1, 4294967295 - (keys & 4294967295))
    ids = tl.where(n_vis <= select_k, tl.where(c < n_vis, c, -1), ids)
    tl.store(out_ptr + c, ids.to(tl.int32), mask=c < select_k)


@triton.jit
def emit_in_order(out_ptr, n_vis, select_k, KB: tl.constexpr):
    """``emit_selection`` of a row with no keys (``n_vis <= select_k``): ``0 .. n_vis-1``, -1 padding."""
    emit_selection(out_ptr, tl.full((KB,), NO_KEY, tl.int64), n_vis, select_k, KB)


@triton.jit
def _merge_pairs(lists, HALF: tl.constexpr, KB: tl.constexpr):
    """``[2 * HALF, KB]`` descending lists -> ``[HALF, KB]``: the ``KB`` best of each pair.

    ``max(a, flip(b))`` holds the ``KB`` best of two descending lists as a bitonic sequence,
    which one bitonic merge sorts (``log2(KB)`` steps instead of a full sort).
    """
    a, b = tl.split(tl.permute(tl.reshape(lists, (HALF, 2, KB)), (0, 2, 1)))
    return tl.bitonic_merge(tl.maximum(a, tl.flip(b, 1)), descending=True)


@triton.jit
def best_of_lists(lists, LOG_G: tl.constexpr, KB: tl.constexpr):
    """The ``KB`` best keys of ``2^LOG_G`` (at most 8) descending lists ``[2^LOG_G, KB]`` ->
    descending ``[KB]``, by pairwise merges."""
    tl.static_assert(LOG_G <= 3)
    if LOG_G == 3:
        lists = _merge_pairs(lists, 4, KB)
    if LOG_G >= 2:
        lists = _merge_pairs(lists, 2, KB)
    if LOG_G >= 1:
        lists = _merge_pairs(lists, 1, KB)
    return tl.reshape(lists, (KB,))


@triton.jit
def store_leaf(keys, cand_ptr, out_ptr, n_vis, select_k, CHUNK: tl.constexpr, KB: tl.constexpr,
               FINAL: tl.constexpr):
    """A leaf's ``KB`` best of ``keys [CHUNK]`` (all of them, sorted, ``INT64_MIN``-padded when
    ``CHUNK < KB``): to ``cand_ptr``, or (``FINAL``, the row's only leaf) as ids to ``out_ptr``."""
    if CHUNK >= KB:
        top = tl.topk(keys, KB)
    else:
        pad = tl.arange(0, KB // CHUNK)[:, None] == 0
        top = tl.reshape(tl.where(pad, tl.sort(keys, descending=True)[None, :], NO_KEY), (KB,))
    if FINAL:
        emit_selection(out_ptr, top, n_vis, select_k, KB)
    else:
        tl.store(cand_ptr + tl.arange(0, KB), top)


@triton.jit
def _chunk_topk_kernel(x_ptr, x_stride, lens_ptr, lens_stride, cand_ptr, out_ptr, out_stride, n_cols, select_k,
                       n_chunks, CHUNK: tl.constexpr, KB: tl.constexpr, FINAL: tl.constexpr):
    # Program (row, chunk): the KB best keys of logits x[row, chunk*CHUNK : +CHUNK].
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1).to(tl.int64)
    n_vis = visible_pools(lens_ptr, row * lens_stride, n_cols)
    if n_vis > select_k:
        j = chunk * CHUNK + tl.arange(0, CHUNK)
        vis = j < n_vis
        x = tl.load(x_ptr + row * x_stride + j, mask=vis, other=0.0)
        store_leaf(pool_keys(x, j, vis), cand_ptr + (row * n_chunks + chunk) * KB, out_ptr + row * out_stride,
                   n_vis, select_k, CHUNK, KB, FINAL)
    elif FINAL:
        emit_in_order(out_ptr + row * out_stride, n_vis, select_k, KB)


@triton.jit
def _merge_topk_kernel(cand_ptr, n_in, lens_ptr, lens_stride, n_cols, next_ptr, n_out, out_ptr, out_stride,
                       select_k, LOG_G: tl.constexpr, KB: tl.constexpr, FINAL: tl.constexpr):
    # Program (row, group): the KB best keys of lists [group*G, group*G + G) of cand[row] (n_in lists).
    G: tl.constexpr = 1 << LOG_G
    row = tl.program_id(0).to(tl.int64)
    grp = tl.program_id(1).to(tl.int64)
    n_vis = visible_pools(lens_ptr, row * lens_stride, n_cols)
    lst = grp * G + tl.arange(0, G)
    if n_vis > select_k:
        c = tl.arange(0, KB)
        keys = tl.load(cand_ptr + (row * n_in + lst[:, None]) * KB + c[None, :], mask=(lst < n_in)[:, None],
                       other=NO_KEY)
        top = best_of_lists(keys, LOG_G, KB)
        if FINAL:
            emit_selection(out_ptr + row * out_stride, top, n_vis, select_k, KB)
        else:
            tl.store(next_ptr + (row * n_out + grp) * KB + c, top)
    elif FINAL:
        emit_in_order(out_ptr + row * out_stride, n_vis, select_k, KB)


def key_block(select_k: int) -> int:
    """``KB``: keys kept per list (the power of two at or above ``select_k``, at least ``MIN_KB``)."""
    return max(triton.next_power_of_2(select_k), MIN_KB)


def plan_leaves(rows: int, n_cols: int, select_k: int, device, granule: int = 1):
    """``(CHUNK, n_chunks)`` for the leaves of ``rows`` rows of ``n_cols`` pools (at least one
    leaf): the largest power of two from ``max(KB, LEAF_BASE) * MAX_CHUNK_FACTOR`` down to
    ``max(MIN_CHUNK, granule)`` whose grid still fills the GPU (the smallest off the GPU, so
    that the CPU lanes exercise the merge levels)."""
    if device.type == "cuda" and not interpreting():
        want = PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        want = 1 << 62
    n_cols = max(n_cols, 1)
    floor = max(MIN_CHUNK, granule)
    chunk = max(key_block(select_k), LEAF_BASE, floor) * MAX_CHUNK_FACTOR
    while chunk > floor and rows * triton.cdiv(n_cols, chunk) < want:
        chunk //= 2
    return chunk, triton.cdiv(n_cols, chunk)


def select_tree(out, lens, n_cols, select_k, launch_leaves, granule: int = 1) -> None:
    """Each row's selection into ``out [rows, select_k]`` int32: leaves, then merges.

    ``launch_leaves(cand, CHUNK, n_chunks, KB, FINAL)`` launches the leaf kernel on the grid
    ``(rows, n_chunks)``; with ``FINAL`` (one leaf per row) ``cand`` is ``out`` and the
    leaves write the ids, else ``cand [rows, n_chunks, KB]`` int64 receives their key lists
    for ``merge_lists``. ``lens [rows]`` visible pools, clamped to ``n_cols``.
    """
    rows = out.shape[0]
    kb = key_block(select_k)
    chunk, n_chunks = plan_leaves(rows, n_cols, select_k, out.device, granule)
    final = n_chunks == 1
    cand = out if final else torch.empty((rows, n_chunks, kb), dtype=torch.int64, device=out.device)
    launch_leaves(cand, chunk, n_chunks, kb, final)
    if not final:
        merge_lists(cand, lens, n_cols, select_k, out)


def merge_lists(cand, lens, n_cols, select_k, out) -> None:
    """Reduce ``cand [rows, n_lists, KB]`` (sorted int64 key lists, ``n_lists >= 2``) to each
    row's selection in ``out [rows, select_k]`` int32, ``MERGE_FANIN`` lists per program."""
    rows, n_in, kb = cand.shape
    while True:
        g = min(MERGE_FANIN, triton.next_power_of_2(n_in))
        n_out = triton.cdiv(n_in, g)
        final = n_out == 1
        nxt = cand if final else torch.empty((rows, n_out, kb), dtype=torch.int64, device=cand.device)
        _merge_topk_kernel[(rows, n_out)](
            cand, n_in, lens, lens.stride(0), n_cols, nxt, n_out, out, out.stride(0), select_k,
            LOG_G=g.bit_length() - 1, KB=kb, FINAL=final, num_warps=MERGE_WARPS,
        )
        if final:
            return
        cand, n_in = nxt, n_out


def select_pools(logits, pool_lens, select_k):
    """Deterministic top-``select_k`` pools of each row.

    Parameters
    ----------
    logits : fp32 ``[R, N]`` pool scores (unit inner stride; row stride free).
    pool_lens : int32/int64 ``[R]``: pools visible to each row (``<= N``; negative = 0).
    select_k : positive int, pools to pick (``index_topk // P``).

    Returns
    -------
    int32 ``[R, select_k]``: when ``pool_lens[r] > select_k``, the ids of the ``select_k``
    highest scores, highest first, ties to the lower id, NaN ranked below ``-inf``, -0.0
    equal to +0.0; otherwise ``0 .. pool_lens[r]-1`` in order. -1 padding.
    """
    check_tensor("logits", logits, dtype=torch.float32, ndim=2, inner_contiguous=True)
    device = logits.device
    rows, n_cols = logits.shape
    check_tensor("pool_lens", pool_lens, dtype=INT_DTYPES, shape=(rows,), device=device)
    check_positive_int("select_k", select_k)
    if rows and range_checks_enabled():
        top = int(pool_lens.max())
        if top > n_cols:
            raise ValueError(f"pool_lens holds {top}, more than the N = {n_cols} logits per row")
    if backend_for(device) == "torch":
        return reference.select_pools(logits, pool_lens, select_k)
    out = torch.empty((rows, select_k), dtype=torch.int32, device=device)
    if rows == 0:
        return out

    def launch_leaves(cand, chunk, n_chunks, kb, final):
        _chunk_topk_kernel[(rows, n_chunks)](
            logits, logits.stride(0), pool_lens, pool_lens.stride(0), cand, out, out.stride(0), n_cols, select_k,
            n_chunks, CHUNK=chunk, KB=kb, FINAL=final,
        )

    select_tree(out, pool_lens, n_cols, select_k, launch_leaves)
    return out
