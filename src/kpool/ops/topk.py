"""Deterministic top-k over pools (SPEC.md §5): ``select_pools`` and the leaf-based selection
shared with the fused scorer.

Row ``r`` sees pools ``j < pool_lens[r]``. If more than ``select_k`` are visible, the
``select_k`` best are returned, highest score first, exact ties to the lower pool id;
otherwise every visible pool is returned in ascending id order. Remaining columns are -1.

Order used (identical on every backend, no float arithmetic): each fp32 score maps to an
int32 ``ordered`` that is monotone in the score, with ``-0.0`` equal to ``+0.0`` and every
NaN mapped to ``INT32_MIN``, below ``-inf`` (a NaN pool is picked only when nothing else
is left; ``-inf`` pools are still visible). The ranking key ``ordered * 2^32 + (2^32-1-id)``
is unique per pool (``reference.pool_order_keys``), so the selection is a pure function of
the inputs; pools a row does not see get the key ``INT64_MIN``.

Kernels:

1. leaves: one program per (row, chunk of ``CHUNK`` pools) keeps the ``KW = min(CHUNK, KB)``
   best keys of its chunk (``KB = next_pow2(select_k)``; small batches get more, smaller
   leaves). ``_chunk_topk_kernel`` reads the keys' scores from a logits row;
   ``ops/score.py``'s fused decode kernel computes them on chip and never writes a logits
   row. A row with one leaf writes its ids there (sorted). Otherwise the leaf writes a *list*
   of ``HEAD + KW`` keys: when it keeps all its keys and the row's bound rank (below) is at
   most ``HEAD``, its ``HEAD`` best sorted (``tl.topk(keys, HEAD)``, far cheaper than a sort)
   followed by all its keys unsorted; else its ``KW`` best sorted after ``HEAD`` unused slots.
   A filtering leaf (``ops/score.py``) writes ``HEAD`` lower keys (the best of its tile
   positions' maxima, ``store_leaf_bounds``), or for a row of fewer leaves all
   ``POSITION_KEYS`` maxima after them, then the upper bounds of all its pools as int32 codes
   (``store_upper_bounds``: the ids are the positions).
2. rows with several leaves, without merging the lists (``threshold_select``):
   ``_survivors_kernel`` (programs per (row, group of lists)) computes a lower bound of the
   row's ``select_k``-th best key (``_row_bound``: the ``cdiv(select_k, n_full)``-th key of
   every wholly visible leaf's list; at least ``select_k`` keys are at or above the smallest;
   for filtering leaves, ``_union_bound_kernel``'s tighter ``select_k``-th best of all those
   leaves' ``HEAD`` lower keys, or of their position keys, one program per row, radix passes
   over the heads, or position keys filling over half their tile, in registers)
   and appends the keys at or above it to a survivor buffer (offsets from an atomic counter:
   the order varies, the set does not). ``_threshold_select_kernel`` then writes the
   ``select_k`` best survivors' ids, sorted, in one of two ways. A row with at most
   ``rank_limit(rows)`` survivors (``RANK_COMPARES``: the compares grow as the square) is
   *ranked*: the row's programs count, for each survivor, the survivors above it, and the
   ones ranked below ``select_k`` write their ids at that column (no sort, no serial
   passes). A row with more survivors (a loose bound: e.g. all-tied scores) goes to one
   program's MSB radix passes of ``RADIX_BITS`` bits (``tl.histogram``) over the offsets
   from the smallest survivor, which find the ``select_k``-th best (up to
   ``SELECT_HELD_KEYS`` survivors loaded once, in registers for every pass); the keys at or
   above it (exactly ``select_k``) are compacted and sorted. Integer work only: exact and
   deterministic. H200, 1 x 128K: 41 us of bitonic merges became 4 + 20 us (5th session),
   4 + ~13 us (12th: fewer, cheaper radix passes, one program's dependent steps of
   ~0.5-1.6 us each), then 4 + 4.3 us ranked (13th). Rows whose keys all tie leave the
   bound loose: about 100 us there.

Rows with ``n <= select_k`` visible pools skip the loads and the sorting.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import reference
from ..layout import cdiv, next_pow2
from .._backend import backend_for, interpreting, on_device_of, pdl_launch
from .._checks import INT_DTYPES, MAX_SELECT, check_int, check_tensor, range_checks_enabled
from . import _pdl, select

LEAF_BASE = 512  # leaves of up to max(KB, LEAF_BASE) pools (H200: 32 x 128K 329 -> 296 us vs 1,024) ...
MIN_CHUNK = 128  # ... and at least this many (leaves of at most KB pools keep all their keys)
SELECT_WARPS = 8  # warps of the per-row threshold-select program ...
SELECT_BLOCK = 2048  # ... and keys per step of its passes (H200 sweep: 32 x 128K 19.9 -> 12.7 us vs 16 x 4096)
SELECT_HELD_KEYS = 2048  # survivors up to which its radix select loads them once, every pass on registers
#                          (tiles of 1 / 4, 1 / 2 or all of it; H200: 32 x 32K -1.2 us, prefill 8,192 x 4,096
#                          pools -3%; 4,096: the mixed batch -2 us but 32 x 128K +1 us)
RADIX_BITS = 5  # bits per radix pass of the union bound and the threshold select, at most 8 (H200, 5th session,
#                1 x 128K: 6 -> 38.3 us, 8 -> 40.5; 37th, 6 -> 5: 4 x 128K 27.8 -> 27.3 us, mixed 4K-128K 85.1 ->
#                83.8, 32 x 128K 77.1 -> 76.7, other cases within their spread; 4 no better than 6)
RANK_COMPARES = 3 << 22  # compares one threshold select may spend ranking (rank_limit; H200: 1 x 128K, 2,367
#                          survivors: ~13 -> 4.3 us ranked; 32 x 128K, ~1,000 per row: 224 radix vs 233 ranked;
#                          41st, 1 << 24 -> 3 << 22 (limit 724 -> 627 at 32 rows): 32 x 32K 46.6 -> 44.8 us, mixed
#                          4K-128K 82.8 -> 82.0, 32 x 128K (555-605 survivors, still ranked) and 1 / 4 x 128K flat)
RANK_SLICE, RANK_BLOCK = 8, 128  # survivors a ranking program ranks, and compares them with, per step (H200, 32 x
#                                 128K: 256 -> 128 -2.5 us; 13th session, 1,000 survivors: -0.8 us) ...
RANK_PROGRAMS_PER_SM = 2  # ... and its programs per SM (rank_programs): the blocks of 8 warps at 94 registers one SM
#                            holds, so that a row's programs run in one wave
RANK_WIDE_PROGRAMS = 128  # rows ranked by at least this many programs compare against blocks of 2 x RANK_BLOCK keys
#                           (rank_block; H200, programs per row: 1 x 128K 264, 15.97 -> 15.55 us; 2 x 128K 132,
#                           26.1 -> 25.5; 4 x 128K 66, +0.2; 32 x 128K 8, +1.3; blocks of 512 / 1,024 lose at both)
SURVIVOR_KEYS = 2048  # keys per program of the survivor filter
UNION_RESIDENT_KEYS = 8192  # heads, and position keys, _union_bound_kernel keeps in registers for all its passes
#                             (union_block; H200, ncu: 32 x 128K 12.4 -> 10.4 us, 128 x 1M 33.3 -> 23.6 vs streamed
#                             from memory)
PROGRAMS_PER_SM = 2  # leaf grid target when choosing the leaf size
SMALLEST_LEAVES = False  # off the GPU (Triton's CPU interpreter, whose cost is per program): the largest leaves, as
#                          a GPU's plan for a grid of many rows; True (the tests) the smallest, so that small cases
#                          run several leaves per row and the threshold selection (tests/conftest.py)
MIN_KB = 16  # tl.topk / tl.arange below 16 keys do not lower on every target
HEAD = tl.constexpr(MIN_KB)  # sorted best keys ahead of an unsorted leaf list (module docstring, 1.)
POSITION_KEYS = 64  # a filtering leaf's tile-position maxima (score.BLOCK_POOLS) kept after its HEAD: they
#                     bound rows whose rank is above HEAD (store_leaf_bounds) ...
PK = tl.constexpr(POSITION_KEYS)  # ... the same, for the kernels
COUNT_BITS = 27  # bits of each count _pick_digit packs into an int64 with its digit ...
MAX_SURVIVORS = 1 << COUNT_BITS  # ... so a row keeps fewer survivor keys than this
_COUNT_SHIFT, _DIGIT_SHIFT = tl.constexpr(COUNT_BITS), tl.constexpr(2 * COUNT_BITS)
_COUNT_MASK = tl.constexpr(MAX_SURVIVORS - 1)
NO_KEY = tl.constexpr(-9223372036854775807 - 1)  # INT64_MIN: the key of a pool the row does not see
NO_UPPER = tl.constexpr(-2147483648)  # INT32_MIN: upper_codes' pool the row does not see (upper bounds are never NaN)


@triton.jit
def ordered_score(x):
    """fp32 -> int64 in ``[-2^31, 2^31)``, monotone; -0.0 == +0.0; NaN -> -2^31 (lowest)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(x == 0, 0, bits)
    o = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
    return tl.where(x != x, -2147483648, o)


@triton.jit
def _rank_key(ordered, j):
    """The ranking key ``ordered * 2^32 + (2^32 - 1 - j)`` (int64) of an ``ordered_score``
    (int32 or int64) of pool ``j``; ``key_ids`` inverts it."""
    return ordered.to(tl.int64) * 4294967296 + (4294967295 - j.to(tl.int64))


@triton.jit
def pool_keys(x, j, vis):
    """Ranking keys ``ordered(x) * 2^32 + (2^32 - 1 - j)`` of scores ``x`` of pools ``j``
    (int64, same shape); ``INT64_MIN`` where not ``vis``."""
    return tl.where(vis, _rank_key(ordered_score(x), j), NO_KEY)


@triton.jit
def key_ids(keys):
    """Pool ids of ranking keys (``pool_keys``' low 32 bits, inverted), int64."""
    return 4294967295 - (keys & 4294967295)


@triton.jit
def visible_pools(lens_ptr, off, n_cols):
    """The row's visible pool count (``pool_lens`` at element offset ``off``) clamped to
    ``[0, n_cols]`` (int64 scalar)."""
    return tl.minimum(tl.maximum(tl.load(lens_ptr + off).to(tl.int64), 0), n_cols)


@triton.jit
def store_ids(out_row, cols, ids, mask, P: tl.constexpr, PB: tl.constexpr):
    """Pool ids ``ids`` (int64 ``[N]``, -1 = none) of selection columns ``cols [N]`` where
    ``mask``: as int32 ids at ``out_row + cols`` (``P == 1``), or expanded to their tokens
    ``id * P + o`` at columns ``col * P + o`` (``o < P``; -1 for a missing id): the history
    part of ``select.expand_pools_and_append_tail`` (``PB = next_pow2(P)``)."""
    if P == 1:
        tl.store(out_row + cols, ids.to(tl.int32), mask=mask)
    else:
        o = tl.arange(0, PB)[None, :]
        tok = tl.where(ids[:, None] >= 0, ids[:, None] * P + o, -1)
        tl.store(out_row + cols[:, None] * P + o, tok.to(tl.int32), mask=mask[:, None] & (o < P))


@triton.jit
def store_tail(out_row, seq_ptr, seq_off, select_k, n_tail, P: tl.constexpr, TAIL: tl.constexpr,
               TAIL_BLOCK: tl.constexpr):
    """With ``TAIL`` (an expanded selection): the ``n_tail`` columns after the row's
    ``select_k * P`` tokens, its tail tokens ``[seq // P * P, seq)`` then -1 padding
    (``select.store_tail``; ``seq``: the row's token count at ``seq_ptr + seq_off``, negative = 0)."""
    if TAIL:
        seq = tl.maximum(tl.load(seq_ptr + seq_off).to(tl.int64), 0)
        start = seq // P * P  # row_ok: every row writes its tail (seq >= 0 is a true tensor, not a Python bool)
        select.store_tail(out_row + select_k * P, seq_off, seq >= 0, start, seq - start, n_tail, seq_ptr, 0, 0, 1,
                          P, TAIL_BLOCK, 0)


@triton.jit
def emit_selection(out_ptr, keys, n_vis, select_k, KB: tl.constexpr, P: tl.constexpr = 1, PB: tl.constexpr = 1):
    """Write ``select_k`` pool ids of one row at ``out_ptr`` (``store_ids``: as ids, or expanded
    to tokens) from its ``KB`` best keys (sorted, descending), or ``0 .. n_vis-1`` when
    ``n_vis <= select_k``; -1 padding."""
    c = tl.arange(0, KB)
    ids = tl.where(keys == NO_KEY, -1, key_ids(keys))
    ids = tl.where(n_vis <= select_k, tl.where(c < n_vis, c, -1), ids)
    store_ids(out_ptr, c, ids, c < select_k, P, PB)


@triton.jit
def emit_in_order(out_ptr, n_vis, select_k, KB: tl.constexpr, P: tl.constexpr = 1, PB: tl.constexpr = 1):
    """``emit_selection`` of a row with no keys (``n_vis <= select_k``): ``0 .. n_vis-1``, -1 padding."""
    emit_selection(out_ptr, tl.full((KB,), NO_KEY, tl.int64), n_vis, select_k, KB, P, PB)


@triton.jit
def _bound_rank(n_vis, chunk, select_k):
    """``(full, rank)``: a row's wholly visible leaves of ``chunk`` pools and the rank in each
    of their lists of the key that bounds the row's ``select_k``-th best (``_row_bound``)."""
    full = n_vis // chunk
    return full, (select_k + tl.maximum(full, 1) - 1) // tl.maximum(full, 1)


@triton.jit
def _unsorted_list(rank, CHUNK: tl.constexpr, KW: tl.constexpr):
    """Whether a row's leaf lists (leaves of ``CHUNK`` pools keeping ``KW`` keys) are their
    ``HEAD`` best sorted followed by all ``CHUNK`` keys unsorted: leaves that keep all their
    keys (``CHUNK == KW``, at least ``HEAD``) when the bound rank is at most ``HEAD``."""
    if (CHUNK == KW) and (CHUNK >= HEAD):
        return rank <= HEAD
    else:
        return rank < 0  # never


@triton.jit
def list_slots(KW: tl.constexpr, FILTER: tl.constexpr):
    """int64 slots of a leaf list keeping ``KW`` keys (``list_size``): ``HEAD``, the ``PK``
    position keys of a filtering list (``FILTER``), then ``KW``."""
    if FILTER:
        return HEAD + PK + KW
    else:
        return HEAD + KW


@triton.jit
def leaf_list(cand_ptr, index, CHUNK: tl.constexpr, KB: tl.constexpr, FILTER: tl.constexpr = False):
    """Pointer to leaf list ``index`` (row * n_chunks + chunk) of ``cand_ptr`` (``list_size`` keys each)."""
    if CHUNK < KB:
        return cand_ptr + index * list_slots(CHUNK, FILTER)
    else:
        return cand_ptr + index * list_slots(KB, FILTER)


@triton.jit
def store_leaf(keys, cand_ptr, out_ptr, n_vis, select_k, CHUNK: tl.constexpr, KB: tl.constexpr,
               FINAL: tl.constexpr, P: tl.constexpr = 1, PB: tl.constexpr = 1):
    """A leaf's keys ``[CHUNK]``: with ``FINAL`` (the row's only leaf) its ids to ``out_ptr``
    (sorted, ``emit_selection``), else its list of ``HEAD + min(CHUNK, KB)`` keys to
    ``cand_ptr`` (module docstring, 1.)."""
    tl.static_assert(CHUNK >= HEAD, "leaves hold at least HEAD pools (MIN_CHUNK)")
    if FINAL:
        if CHUNK >= KB:
            emit_selection(out_ptr, tl.topk(keys, KB), n_vis, select_k, KB, P, PB)
        else:  # n_vis <= CHUNK <= KB / 2 < select_k: every visible pool, in order
            emit_in_order(out_ptr, n_vis, select_k, KB, P, PB)
    elif CHUNK > KB:
        tl.store(cand_ptr + HEAD + tl.arange(0, KB), tl.topk(keys, KB))
    else:  # the leaf keeps all its keys: _unsorted_list decides the order
        _, rank = _bound_rank(n_vis, CHUNK, select_k)
        if _unsorted_list(rank, CHUNK, CHUNK):
            tl.store(cand_ptr + tl.arange(0, HEAD), tl.topk(keys, HEAD))
            tl.store(cand_ptr + HEAD + tl.arange(0, CHUNK), keys)
        else:
            tl.store(cand_ptr + HEAD + tl.arange(0, CHUNK), tl.sort(keys, descending=True))


@triton.jit
def store_leaf_bounds(lower, cand_ptr, n_vis, select_k, CHUNK: tl.constexpr, KB: tl.constexpr):
    """A filtering leaf's list head (``FILTER``, a leaf that keeps all its keys): from
    ``lower [PK]``, each tile position's best lower key over the leaf's tiles (a lower key of a
    distinct pool each), the ``HEAD`` best, sorted, when the row's bound rank is at most
    ``HEAD``; else, when it is at most ``PK``, all ``PK`` of them after the ``HEAD`` slots,
    unsorted (rows of a few leaves, e.g. 8 to 31 at select_k 512); else nothing (the row then
    bounds nothing). Any lower keys of distinct pools bound the row (at least ``select_k``
    pools score at or above the ``select_k``-th best of them); these per-position maxima of
    leaves of 512 give a bound ranked ~530th among the lower keys where the leaf's 512 would
    give the 512th (random scores), for a topk over ``PK`` keys instead of ``CHUNK``. The
    list's last slots hold all its *upper* bounds unsorted, stored tile by tile
    (``store_upper_bounds``)."""
    tl.static_assert((CHUNK <= 2 * KB) and (CHUNK >= HEAD), "a filtering leaf's list holds all its bounds")
    tl.static_assert(lower.shape[0] == PK, "one position key per tile position")
    _, rank = _bound_rank(n_vis, CHUNK, select_k)
    p = tl.arange(0, PK)  # before the heads' topk, not in an else branch: no spill at 80 registers (triton 3.9)
    tl.store(cand_ptr + HEAD + p, lower, mask=p < tl.where((rank > HEAD) & (rank <= PK), PK, 0))
    if _unsorted_list(rank, CHUNK, CHUNK):
        tl.store(cand_ptr + tl.arange(0, HEAD), tl.topk(lower, HEAD))


@triton.jit
def upper_codes(x, vis):
    """A filtering leaf's upper bounds ``x`` (fp32, never NaN: ``logits.bound_keys``) as
    int32 ``ordered_score``s, ``NO_UPPER`` where not ``vis``: half the bytes of their keys,
    whose pool ids the list positions give (``_upper_keys``)."""
    return tl.where(vis, ordered_score(x), NO_UPPER).to(tl.int32)


@triton.jit
def store_upper_bounds(lists, i, upper, live, BN: tl.constexpr):
    """Tile ``i``'s ``upper_codes`` ``[BN, R]`` into the unsorted part of the leaf lists
    ``lists`` ``[R]`` (``leaf_list`` pointers of R rows, int64 slots holding two codes each;
    rows not ``live [R]`` untouched)."""
    slots = lists.to(tl.pointer_type(tl.int32)) + 2 * (HEAD + PK)
    tl.store(slots[None, :] + i * BN + tl.arange(0, BN)[:, None], upper, mask=live[None, :])


@triton.jit
def _upper_keys(lists, lst, mask, CHUNK: tl.constexpr):
    """The ranking keys ``[L, CHUNK]`` (``pool_keys``; ``NO_KEY`` where not seen or not
    ``mask [L, 1]``) of the upper bounds that ``store_upper_bounds`` wrote to the lists
    ``lists [L, 1]`` of leaves ``lst [L, 1]`` (list ``l`` holds pools ``l * CHUNK + c``)."""
    c = tl.arange(0, CHUNK)[None, :]
    code = tl.load(lists.to(tl.pointer_type(tl.int32)) + 2 * (HEAD + PK) + c, mask=mask, other=NO_UPPER)
    return tl.where(code == NO_UPPER, NO_KEY, _rank_key(code, lst.to(tl.int64) * CHUNK + c))


@triton.jit
def clear_counts(count_ptr, rows, chunk, FINAL: tl.constexpr):
    """Zero the survivor counters ``count_ptr[rows]`` (int32; ``rows`` int64, scalar or vector)
    from the programs of a row's first leaf, unless ``FINAL``: the leaf launch replaces a
    memset before ``_survivors_kernel``."""
    if not FINAL:
        if chunk == 0:
            tl.store(count_ptr + rows, tl.zeros_like(rows).to(tl.int32))


@triton.jit
def _chunk_topk_kernel(x_ptr, x_stride, lens_ptr, lens_stride, cand_ptr, count_ptr, out_ptr, out_stride, n_cols,
                       select_k, n_chunks, CHUNK: tl.constexpr, KB: tl.constexpr, FINAL: tl.constexpr,
                       PDL: tl.constexpr):
    _pdl.grid_dependency_sync(PDL)
    # Program (row, chunk): the leaf of logits x[row, chunk*CHUNK : +CHUNK] (store_leaf).
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1).to(tl.int64)
    clear_counts(count_ptr, row, chunk, FINAL)
    n_vis = visible_pools(lens_ptr, row * lens_stride, n_cols)
    if n_vis > select_k:
        j = chunk * CHUNK + tl.arange(0, CHUNK)
        vis = j < n_vis
        x = tl.load(x_ptr + row * x_stride + j, mask=vis, other=0.0)
        store_leaf(pool_keys(x, j, vis), leaf_list(cand_ptr, row * n_chunks + chunk, CHUNK, KB),
                   out_ptr + row * out_stride, n_vis, select_k, CHUNK, KB, FINAL)
    elif FINAL:
        emit_in_order(out_ptr + row * out_stride, n_vis, select_k, KB)


@triton.jit
def _compact(base, n, min_key, BLOCK: tl.constexpr):
    """Move the keys ``>= min_key`` (never ``NO_KEY``) of ``base[0:n]`` to the front, in order,
    in place. A barrier between each step's loads and stores keeps every write behind the
    reads (writes land below the count kept so far, at most the step's end)."""
    cnt = tl.zeros((), tl.int32)
    for start in range(0, n, BLOCK):
        i = start + tl.arange(0, BLOCK)
        cnt = _store_kept(base, tl.load(base + i, mask=i < n, other=NO_KEY), min_key, cnt)
    tl.debug_barrier()


@triton.jit
def _store_kept(base, key, min_key, cnt):
    """Of a tile of keys already loaded from ``base`` (unloaded lanes ``NO_KEY``): those ``>=
    min_key`` (never ``NO_KEY``) stored in order at ``base[cnt:]``, after a barrier that keeps
    the writes behind every program thread's reads; returns ``cnt`` plus their number."""
    keep = (key >= min_key) & (key != NO_KEY)
    tl.debug_barrier()
    tl.store(base + cnt + tl.cumsum(keep.to(tl.int32), 0) - 1, key, mask=keep)
    return cnt + tl.sum(keep.to(tl.int32))


@triton.jit
def _first_shift(rng, BITS: tl.constexpr):
    """``max(bit_length(rng) - BITS, 0)`` of a uint64 scalar: the shift whose digit ``rng >> s``
    uses all ``BITS`` bits (binary search; shifts past 63 read as 0)."""
    s = tl.zeros((), tl.int32)
    for b in tl.static_range(6):
        shift = s + (32 >> b) + BITS - 1
        s += tl.where((shift < 64) & ((rng >> tl.minimum(shift, 63).to(tl.uint64)) != 0), 32 >> b, 0)
    return s


@triton.jit
def _pick_digit(hist, need, d):
    """Of a bucket's digit histogram ``hist [2^BITS]``: the digit ``d`` holding the ``need``-th
    largest key, the keys at that digit and the keys at or above it (one reduction over
    ``(digit, at_or_above, at)`` packed in an int64: counts below ``MAX_SURVIVORS``, digits
    below 2^8)."""
    at_or_above = tl.cumsum(hist, 0, reverse=True)
    packed = (d.to(tl.int64) << _DIGIT_SHIFT) | (at_or_above.to(tl.int64) << _COUNT_SHIFT) | hist.to(tl.int64)
    best = tl.max(tl.where(at_or_above >= need, packed, -1))
    return ((best >> _DIGIT_SHIFT).to(tl.int32), ((best >> _COUNT_SHIFT) & _COUNT_MASK).to(tl.int32),
            (best & _COUNT_MASK).to(tl.int32))


@triton.jit
def _key_at(base, i, GROUP: tl.constexpr, GSTRIDE):
    """Pointers of keys ``i`` stored in groups of ``GROUP`` contiguous keys ``GSTRIDE`` apart
    (``GROUP = 1, GSTRIDE = 1``: contiguous)."""
    if GROUP == 1:
        return base + i * GSTRIDE
    else:
        return base + (i // GROUP) * GSTRIDE + i % GROUP


@triton.jit
def _digit_hist(u, ok, bucket, span, s, BITS: tl.constexpr):
    """Histogram ``[2^BITS]`` int32 of the digit ``(u - bucket) >> s`` of the offsets ``u``
    (uint64) in the bucket ``[bucket, bucket + span]`` where ``ok``."""
    rel = u - bucket
    return tl.histogram(((rel >> s.to(tl.uint64)) & ((1 << BITS) - 1)).to(tl.int32), 1 << BITS,
                        mask=ok & (u >= bucket) & (rel <= span))


@triton.jit
def _radix_threshold(base, cnt, lo, top, select_k, BLOCK: tl.constexpr, BITS: tl.constexpr,
                     GROUP: tl.constexpr = 1, GSTRIDE=1, keys=None):
    """The ``select_k``-th largest (int64) of the ``cnt >= select_k`` unique keys ``base[0:cnt]``
    (``_key_at``), all in ``[lo, top]``, by MSB radix passes over ``u = uint64(key - lo)``. The
    first digit is the range's top ``BITS`` bits, each later one the next ``BITS`` (the last
    one fewer). A pass histograms the current bucket's digit, keeps the digit where the count
    from the top reaches ``need`` and stops once that bucket holds exactly the keys still
    needed (at the latest on bit 0: keys are unique). With ``keys [BLOCK]`` (``cnt <= BLOCK``,
    the first ``cnt`` valid: the caller loaded them) every pass reads them from registers;
    else each pass streams them from ``base`` ``BLOCK`` at a time."""
    span = top.to(tl.uint64, bitcast=True) - lo.to(tl.uint64, bitcast=True)  # current bucket: [bucket, bucket + span]
    s = _first_shift(span, BITS)
    bucket = tl.zeros((), tl.uint64)  # lowest offset of the current bucket
    need = tl.zeros((), tl.int32) + select_k
    searching = cnt > 0
    d = tl.arange(0, 1 << BITS)
    if keys is not None:
        u_all = keys.to(tl.uint64, bitcast=True) - lo.to(tl.uint64, bitcast=True)
    while searching:
        if keys is not None:
            hist = _digit_hist(u_all, tl.arange(0, BLOCK) < cnt, bucket, span, s, BITS)
        else:
            hist = tl.zeros((1 << BITS,), tl.int32)
            for start in range(0, cnt, BLOCK):
                i = start + tl.arange(0, BLOCK)
                u = (tl.load(_key_at(base, i, GROUP, GSTRIDE), mask=i < cnt, other=0).to(tl.uint64, bitcast=True)
                     - lo.to(tl.uint64, bitcast=True))
                hist += _digit_hist(u, i < cnt, bucket, span, s, BITS)
        digit, at_or_above, n_eq = _pick_digit(hist, need, d)
        need -= at_or_above - n_eq
        bucket += digit.to(tl.uint64) << s.to(tl.uint64)
        span = (tl.full((), 1, tl.uint64) << s.to(tl.uint64)) - 1
        searching = (need != n_eq) & (s > 0)
        s = tl.maximum(s - BITS, 0)
    return (lo.to(tl.uint64, bitcast=True) + bucket).to(tl.int64, bitcast=True)


@triton.jit
def _min_max(a_lo, a_top, b_lo, b_top):
    return tl.minimum(a_lo, b_lo), tl.maximum(a_top, b_top)


@triton.jit
def _tile_range(key, ok):
    """``(lo, top)``: the smallest and largest of a tile of keys where ``ok`` (``NO_KEY`` elsewhere)."""
    return tl.reduce((tl.where(ok, key, 9223372036854775807), key), 0, _min_max)


@triton.jit
def _keys_range(base, cnt, BLOCK: tl.constexpr, GROUP: tl.constexpr = 1, GSTRIDE=1):
    """``_tile_range`` of the ``cnt`` keys at ``base`` (``_key_at``), loaded ``BLOCK`` at a time."""
    lo = tl.full((), 9223372036854775807, tl.int64)
    top = tl.full((), NO_KEY, tl.int64)
    for start in range(0, cnt, BLOCK):
        i = start + tl.arange(0, BLOCK)
        lo_i, top_i = _tile_range(tl.load(_key_at(base, i, GROUP, GSTRIDE), mask=i < cnt, other=NO_KEY), i < cnt)
        lo = tl.minimum(lo, lo_i)
        top = tl.maximum(top, top_i)
    return lo, top


@triton.jit
def _held_kth(base, cnt, select_k, TILE: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr = 1, GSTRIDE=1):
    """``(keys [TILE], kth)``: the ``cnt <= TILE`` keys at ``base`` (``_key_at``) loaded once
    (``NO_KEY`` past ``cnt``) and their ``select_k``-th largest, every radix pass on registers."""
    i = tl.arange(0, TILE)
    key = tl.load(_key_at(base, i, GROUP, GSTRIDE), mask=i < cnt, other=NO_KEY)
    lo, top = _tile_range(key, i < cnt)
    return key, _radix_threshold(base, cnt, lo, top, select_k, TILE, BITS, GROUP, GSTRIDE, key)


@triton.jit
def _row_bound_slot(n_vis, select_k, CHUNK: tl.constexpr, KW: tl.constexpr, FILTER: tl.constexpr):
    """``(full, bound, at)`` of ``_row_bound``: the row's wholly visible leaves, whether their
    lists bound the row, and the slot in each list of the key that bounds it."""
    full, rank = _bound_rank(n_vis, CHUNK, select_k)
    bound = full * KW >= select_k
    if FILTER:  # the heads were written when the rank is at most HEAD (store_leaf_bounds)
        unsorted = _unsorted_list(rank, CHUNK, CHUNK)
        bound = bound & unsorted
    else:
        unsorted = _unsorted_list(rank, CHUNK, KW)
    return full, bound, tl.where(unsorted, rank - 1, HEAD + rank - 1)  # in the sorted keys


@triton.jit
def _row_bound(base, n_vis, select_k, CHUNK: tl.constexpr, KW: tl.constexpr, LB: tl.constexpr,
               FILTER: tl.constexpr):
    """A lower bound of a row's ``select_k``-th best key from its leaf lists at ``base``
    (``store_leaf``, ``list_slots`` keys each, leaves of ``CHUNK`` pools; int64 scalar; with
    ``FILTER`` the ``KW`` slots hold the ``CHUNK <= 2 * KW`` upper codes). The
    first ``full`` lists come from wholly visible leaves and hold ``KW`` keys each; when their
    ``rank``-th keys exist (``_bound_rank``), at least ``select_k`` keys are ``>=`` the
    smallest of those. Else ``NO_KEY`` (every key). ``FILTER`` (``store_leaf_bounds``): the
    heads are lower bounds, and a row whose heads were not written bounds nothing."""
    full, bound, at = _row_bound_slot(n_vis, select_k, CHUNK, KW, FILTER)
    lst = tl.arange(0, LB)
    heads = tl.load(base + lst * list_slots(KW, FILTER) + at, mask=lst < tl.where(bound, full, 0),
                    other=9223372036854775807)
    return tl.where(bound, tl.min(heads), NO_KEY)


@triton.jit
def _survivors_kernel(cand_ptr, n_lists, lens_ptr, lens_stride, n_cols, surv_ptr, count_ptr, bound_ptr, select_k,
                      CHUNK: tl.constexpr, KW: tl.constexpr, LG: tl.constexpr, LB: tl.constexpr,
                      FILTER: tl.constexpr, PDL: tl.constexpr):
    _pdl.grid_dependency_sync(PDL)
    # Program (row, group): appends the keys >= the row bound (FILTER: _union_bound_kernel's,
    # else _row_bound) of lists [group*LG, +LG) of cand[row] (the KW keys after each list's HEAD
    # slots) to surv[row], at offsets claimed with an atomic on count[row]. The order of the
    # survivors depends on the schedule; what follows only counts and sorts them.
    row = tl.program_id(0).to(tl.int64)
    base = cand_ptr + row * n_lists * list_slots(KW, FILTER)
    lst = tl.program_id(1) * LG + tl.arange(0, LG)
    if FILTER:  # all CHUNK pools' upper codes (two per slot), loaded with the row's length and bound
        tl.static_assert((CHUNK >= KW) and (CHUNK <= 2 * KW), "a filtering leaf keeps all its bounds")
        key = tl.reshape(_upper_keys(base + lst[:, None] * list_slots(KW, FILTER), lst[:, None],
                                     (lst < n_lists)[:, None], CHUNK), (LG * CHUNK,))
        lo = tl.load(bound_ptr + row)
        surv_row = surv_ptr + row * n_lists * CHUNK
    else:  # the KW keys after each list's heads, loaded with the row's length (not after the bound)
        key = tl.reshape(tl.load(base + lst[:, None] * (HEAD + KW) + HEAD + tl.arange(0, KW)[None, :],
                                 mask=(lst < n_lists)[:, None], other=NO_KEY), (LG * KW,))
        surv_row = surv_ptr + row * n_lists * KW
    n_vis = visible_pools(lens_ptr, row * lens_stride, n_cols)
    if n_vis > select_k:
        if not FILTER:
            lo = _row_bound(base, n_vis, select_k, CHUNK, KW, LB, FILTER)
        keep = (key >= lo) & (key != NO_KEY)
        # relaxed: the offsets only need to be distinct; the next launch sees every write
        at = tl.atomic_add(count_ptr + row, tl.sum(keep.to(tl.int32)), sem="relaxed")
        tl.store(surv_row + at + tl.cumsum(keep.to(tl.int32), 0) - 1, key, mask=keep)


@triton.jit
def _union_bound_kernel(cand_ptr, n_lists, lens_ptr, lens_stride, n_cols, bound_ptr, select_k, CHUNK: tl.constexpr,
                        KW: tl.constexpr, LB: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr,
                        RESIDENT: tl.constexpr, PK_RESIDENT: tl.constexpr, PDL: tl.constexpr):
    _pdl.grid_dependency_sync(PDL)
    # Program (row): the row bound of filtering leaves (store_leaf_bounds) -> bound[row]: the
    # select_k-th best of the HEAD lower keys (distinct pools) of all its wholly visible leaves (at least
    # select_k pools score at or above it), when they hold select_k keys; else (a row of fewer
    # leaves) the select_k-th best of their PK position keys, when they hold select_k; else NO_KEY.
    # Lists of list_slots(KW, True) slots (the CHUNK <= 2 * KW upper codes after the heads).
    # RESIDENT / PK_RESIDENT: the heads / the position keys (LB * HEAD / LB * PK) loaded once,
    # every radix pass on registers (the position keys where they fill over half their tile);
    # else streamed BLOCK at a time.
    row = tl.program_id(0).to(tl.int64)
    slots = list_slots(KW, True)
    base = cand_ptr + row * n_lists * slots
    lst = tl.arange(0, LB)
    if RESIDENT:  # every list's heads (some unwritten: masked below), loaded with the row's length
        c = tl.arange(0, HEAD)[None, :]
        heads = tl.load(base + lst[:, None] * slots + c, mask=(lst < n_lists)[:, None], other=NO_KEY)
    n_vis = visible_pools(lens_ptr, row * lens_stride, n_cols)
    full, bound, at = _row_bound_slot(n_vis, select_k, CHUNK, KW, True)
    if RESIDENT:  # _row_bound's, from the loaded heads
        listed = (lst < full)[:, None]
        lo = tl.where(bound, tl.min(tl.where(listed & (c == at), heads, 9223372036854775807)), NO_KEY)
        top = tl.max(tl.where(listed & (c == 0), heads, NO_KEY))  # each list's heads are sorted
    else:
        lo = _row_bound(base, n_vis, select_k, CHUNK, KW, LB, True)
        top = tl.max(tl.load(base + lst * slots, mask=lst < tl.where(bound, full, 0), other=NO_KEY))
    cnt = (full * HEAD).to(tl.int32)
    if (n_vis > select_k) & bound & (cnt >= select_k):
        # lo (the smallest full leaf's rank-th head) is at or below the answer: a bucket floor
        if RESIDENT:
            lo = _radix_threshold(base, cnt, lo, top, select_k, BLOCK, BITS, HEAD, slots,
                                  tl.reshape(heads, (LB * HEAD,)))
        else:
            lo = _radix_threshold(base, cnt, lo, top, select_k, BLOCK, BITS, HEAD, slots)
    elif (n_vis > select_k) & (full * PK >= select_k) & ~bound:
        # the full leaves' position keys (unsorted): their smallest is a bucket floor
        cnt = (full * PK).to(tl.int32)
        # on registers for a row filling more than half the LB * PK tile (a short row streams
        # fewer keys per pass than the tile holds: the mixed batch's rows of 8-16 of 32 lists)
        resident = (2 * cnt > LB * PK) if PK_RESIDENT else False
        if resident:
            _, lo = _held_kth(base + HEAD, cnt, select_k, LB * PK, BITS, PK, slots)
        else:
            lo, top = _keys_range(base + HEAD, cnt, BLOCK, PK, slots)
            lo = _radix_threshold(base + HEAD, cnt, lo, top, select_k, BLOCK, BITS, PK, slots)
    tl.store(bound_ptr + row, lo)


@triton.jit
def _rank_write(base, cnt, out_row, select_k, SLICE: tl.constexpr, BLOCK: tl.constexpr, P: tl.constexpr,
                PB: tl.constexpr):
    """Of the ``cnt`` unique keys ``base[0:cnt]``: every key whose rank (the count of larger
    keys) is below ``select_k`` writes its pool id to column ``rank`` of ``out_row``
    (``store_ids``), i.e. the ``select_k`` best, sorted. Program ``g`` of ``G`` (axis 1) ranks keys ``[s, s + SLICE)``
    for ``s = g * SLICE, (g + G) * SLICE, ...`` against all ``cnt``, ``BLOCK`` at a time."""
    g, n_prog = tl.program_id(1), tl.num_programs(1)
    for s in range(g * SLICE, cnt, n_prog * SLICE):
        i = s + tl.arange(0, SLICE)
        mine = tl.load(base + i, mask=i < cnt, other=NO_KEY)
        above = tl.zeros((SLICE, BLOCK), tl.int32)
        j = tl.arange(0, BLOCK)
        other = tl.load(base + j, mask=j < cnt, other=NO_KEY)
        for start in range(BLOCK, cnt + BLOCK, BLOCK):
            # the next block is loaded before this one is compared
            j = start + tl.arange(0, BLOCK)
            nxt = tl.load(base + j, mask=j < cnt, other=NO_KEY)
            above += (other[None, :] > mine[:, None]).to(tl.int32)
            other = nxt
        rank = tl.sum(above, axis=1)
        store_ids(out_row, rank, key_ids(mine), (i < cnt) & (rank < select_k), P, PB)


@triton.jit
def _held_compact(base, cnt, select_k, TILE: tl.constexpr, BITS: tl.constexpr):
    """``_radix_select``'s min / max, radix passes and compaction of ``cnt <= TILE`` keys
    ``base[0:cnt]``, loaded once: the ``select_k`` best left in front."""
    key, kth = _held_kth(base, cnt, select_k, TILE, BITS)
    _store_kept(base, key, kth, 0)
    tl.debug_barrier()


@triton.jit
def _radix_select(base, cnt, out_row, n_vis, select_k, KB: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr,
                  HELD: tl.constexpr, P: tl.constexpr, PB: tl.constexpr):
    """The ``select_k`` best of the ``cnt >= select_k`` unique keys ``base[0:cnt]``, sorted, as
    pool ids in ``out_row``: min / max, radix passes to the ``select_k``-th, compaction of the
    keys at or above it (``base`` is overwritten), a sort of those. Up to ``HELD`` keys are
    loaded once and every step reads them from registers (a tile of ``HELD / 4``, ``HELD / 2``
    or ``HELD`` keys: a step's work is its tile's); more are streamed ``BLOCK`` at a time by
    each step."""
    if cnt <= HELD // 4:
        _held_compact(base, cnt, select_k, HELD // 4, BITS)
    elif cnt <= HELD // 2:
        _held_compact(base, cnt, select_k, HELD // 2, BITS)
    elif cnt <= HELD:
        _held_compact(base, cnt, select_k, HELD, BITS)
    else:
        lo, top = _keys_range(base, cnt, BLOCK)
        kth = _radix_threshold(base, cnt, lo, top, select_k, BLOCK, BITS)
        _compact(base, cnt, kth, BLOCK)  # exactly select_k keys left in front
    c = tl.arange(0, KB)
    keys = tl.load(base + c, mask=c < select_k, other=NO_KEY)
    emit_selection(out_row, tl.sort(keys, descending=True), n_vis, select_k, KB, P, PB)


@triton.jit
def _threshold_select_kernel(surv_ptr, n_surv, count_ptr, lens_ptr, lens_stride, n_cols, out_ptr, out_stride,
                             select_k, rank_limit, seq_ptr, seq_stride, n_tail, KB: tl.constexpr,
                             BLOCK: tl.constexpr, BITS: tl.constexpr, HELD: tl.constexpr, SLICE: tl.constexpr,
                             RANK_BLOCK: tl.constexpr,
                             P: tl.constexpr, PB: tl.constexpr, TAIL: tl.constexpr, TAIL_BLOCK: tl.constexpr,
                             PDL: tl.constexpr):
    _pdl.grid_dependency_sync(PDL)
    # Program (row, g): the select_k best of the row's count[row] survivors surv[row, :] (module
    # docstring, step 2): ranked by every program of the row when there are at most rank_limit,
    # else by program 0's radix passes (the survivors are overwritten). Ids, or tokens and the
    # tail (expansion_args; program 0).
    row = tl.program_id(0).to(tl.int64)
    n_vis = visible_pools(lens_ptr, row * lens_stride, n_cols)
    out_row = out_ptr + row * out_stride
    if n_vis > select_k:
        base = surv_ptr + row * n_surv
        cnt = tl.load(count_ptr + row)
        if cnt <= rank_limit:
            _rank_write(base, cnt, out_row, select_k, SLICE, RANK_BLOCK, P, PB)
        elif tl.program_id(1) == 0:
            _radix_select(base, cnt, out_row, n_vis, select_k, KB, BLOCK, BITS, HELD, P, PB)
    elif tl.program_id(1) == 0:
        emit_in_order(out_row, n_vis, select_k, KB, P, PB)
    if tl.program_id(1) == 0:
        store_tail(out_row, seq_ptr, row * seq_stride, select_k, n_tail, P, TAIL, TAIL_BLOCK)


def key_block(select_k: int) -> int:
    """``KB``: keys kept per list (the power of two at or above ``select_k``, at least ``MIN_KB``)."""
    return max(next_pow2(select_k), MIN_KB)


_SMS = {}  # CUDA device index -> SM count (_sm_count)


def _sm_count(device) -> int:
    """SMs of a GPU the kernels run on natively; 0 off the GPU (CPU, interpreter), where the
    grids do not follow a GPU's size (``plan_leaves``, ``rank_programs``). Read once per device
    (H200: ``get_device_properties`` took 10-18 us of host time, four times per scored grid)."""
    if device.type != "cuda" or interpreting():
        return 0
    index = torch.cuda.current_device() if device.index is None else device.index
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def plan_leaves(rows: int, n_cols: int, select_k: int, device, granule: int = 1, per_sm: int | None = None):
    """``(CHUNK, n_chunks)`` for the leaves of ``rows`` rows of ``n_cols`` pools (at least one
    leaf): the largest power of two from ``max(KB, LEAF_BASE)`` down to
    ``max(MIN_CHUNK, granule)`` whose grid still fills the GPU with ``per_sm`` programs per SM
    (default ``PROGRAMS_PER_SM``); off the GPU the largest, or the smallest with ``SMALLEST_LEAVES``."""
    sms = _sm_count(device)
    want = (PROGRAMS_PER_SM if per_sm is None else per_sm) * sms if sms else (1 << 62 if SMALLEST_LEAVES else 0)
    n_cols = max(n_cols, 1)
    floor = max(MIN_CHUNK, granule)
    chunk = max(key_block(select_k), LEAF_BASE, floor)
    while chunk > floor and rows * cdiv(n_cols, chunk) < want:
        chunk //= 2
    return chunk, cdiv(n_cols, chunk)


def list_size(chunk: int, kb: int, filtered: bool = False) -> int:
    """int64 keys of a leaf list (``store_leaf``; ``list_slots``): ``HEAD`` slots, the
    ``POSITION_KEYS`` of a ``filtered`` list, then ``min(chunk, KB)`` keys."""
    return MIN_KB + (POSITION_KEYS if filtered else 0) + min(chunk, kb)  # HEAD as a Python int


def expansion_args(expand, select_k: int, dummy) -> dict:
    """Keyword arguments of the kernels that write a selection (``seq_ptr``, ``seq_stride``,
    ``n_tail``, ``P``, ``PB``, ``TAIL``, ``TAIL_BLOCK``): pool ids when ``expand`` is None, else
    for ``expand = (seq_lens [rows], P, width)`` (validated by the caller) each row's
    ``select.expand_pools_and_append_tail(ids, seq_lens, P, width=width)``, written in place of
    the ids (``store_ids``, ``store_tail``). ``dummy``: any tensor, the unused ``seq_ptr``."""
    if expand is None:
        return dict(seq_ptr=dummy, seq_stride=0, n_tail=0, P=1, PB=1, TAIL=False, TAIL_BLOCK=1)
    seq_lens, pool_size, width = expand
    n_tail = width - select_k * pool_size
    return dict(seq_ptr=seq_lens, seq_stride=seq_lens.stride(0), n_tail=n_tail, P=pool_size,
                PB=next_pow2(pool_size), TAIL=True, TAIL_BLOCK=select.tail_block(n_tail))


def select_by_leaves(out, lens, n_cols, select_k, launch_leaves, granule: int = 1, refine=None,
                     plan=None, expand=None) -> None:
    """Each row's selection into ``out [rows, select_k]`` int32 (``[rows, width]`` tokens with
    ``expand``: ``expansion_args``): leaves, then (several leaves per row) ``threshold_select``.

    ``launch_leaves(cand, count, CHUNK, n_chunks, KB, FINAL, FILTER)`` launches the leaf kernel
    on the grid ``(rows, n_chunks)``; with ``FINAL`` (one leaf per row) ``cand`` and ``count``
    are ``out`` and the leaves write the ids, else ``cand [rows, n_chunks, list_size(CHUNK, KB,
    FILTER)]`` int64 receives their key lists and the leaves zero ``count [rows]`` int32
    (``clear_counts``). ``lens [rows]`` visible pools, clamped to ``n_cols``. ``plan``:
    ``(CHUNK, n_chunks, FILTER)`` instead of ``plan_leaves``' exact leaves; with ``FILTER`` (a
    launch of several leaves; ``store_leaf_bounds``) the survivors hold upper bounds, and
    ``refine(surv, count)`` replaces them by the exact keys before the selection.
    """
    rows = out.shape[0]
    kb = key_block(select_k)
    chunk, n_chunks, filtered = plan or (*plan_leaves(rows, n_cols, select_k, out.device, granule), False)
    final = n_chunks == 1
    if final:
        launch_leaves(out, out, chunk, n_chunks, kb, final, False)
        return
    cand = torch.empty((rows, n_chunks, list_size(chunk, kb, filtered)), dtype=torch.int64, device=out.device)
    count = torch.empty((rows,), dtype=torch.int32, device=out.device)
    launch_leaves(cand, count, chunk, n_chunks, kb, final, filtered)
    threshold_select(cand, count, chunk, lens, n_cols, select_k, out, refine if filtered else None, expand)


def survivor_block(chunk: int, kb: int, filtered: bool = False) -> tuple:
    """``(KW, LG)`` of ``_survivors_kernel``: slots a leaf list holds after its heads
    (``min(chunk, KB)``) and lists per program (``SURVIVOR_KEYS`` keys, at least one list; a
    filtering list holds all ``chunk`` pools' upper codes, two per slot)."""
    kw = min(chunk, kb)
    return kw, max(1, SURVIVOR_KEYS // (chunk if filtered else kw))


def union_block(n_lists: int) -> tuple:
    """``(BLOCK, RESIDENT, PK_RESIDENT)`` of ``_union_bound_kernel`` for rows of ``n_lists`` leaf
    lists: all their ``HEAD`` keys, and all their ``POSITION_KEYS``, in registers up to
    ``UNION_RESIDENT_KEYS`` each, else streamed ``SELECT_BLOCK`` at a time."""
    lists = next_pow2(n_lists)
    pk_resident = lists * POSITION_KEYS <= UNION_RESIDENT_KEYS
    if lists * MIN_KB <= UNION_RESIDENT_KEYS:
        return lists * MIN_KB, True, pk_resident
    return SELECT_BLOCK, False, pk_resident


def survivors(cand, count, chunk, lens, n_cols, select_k, filtered: bool = False):
    """``cand [rows, n_lists, list_size(chunk, KB)]`` (``store_leaf``'s int64 key lists of
    leaves of ``chunk`` pools), ``count [rows]`` int32 zeros -> ``surv [rows, n_lists * W]``
    int64 (``W``: ``KW``, or ``chunk`` for ``filtered`` lists): row ``r``'s keys at or above its
    bound are ``surv[r, :count[r]]``, in no particular order (rows with at most ``select_k``
    visible pools: none)."""
    rows, n_lists, _ = cand.shape
    kw, lg = survivor_block(chunk, key_block(select_k), filtered)
    width = n_lists * (chunk if filtered else kw)
    if width >= MAX_SURVIVORS:
        raise ValueError(f"n_cols: {n_cols} pools per row keep {width} candidate keys, the selection "
                         f"handles fewer than {MAX_SURVIVORS}")
    surv = torch.empty((rows, width), dtype=torch.int64, device=cand.device)
    bound = surv  # unused (the bound is each program's _row_bound) unless filtered
    if filtered:
        bound = torch.empty((rows,), dtype=torch.int64, device=cand.device)
        block, resident, pk_resident = union_block(n_lists)
        _union_bound_kernel[(rows,)](cand, n_lists, lens, lens.stride(0), n_cols, bound, select_k, CHUNK=chunk,
                                     KW=kw, LB=next_pow2(n_lists), BLOCK=block, BITS=RADIX_BITS,
                                     RESIDENT=resident, PK_RESIDENT=pk_resident, num_warps=SELECT_WARPS,
                                     **pdl_launch(cand.device))
    _survivors_kernel[(rows, cdiv(n_lists, lg))](
        cand, n_lists, lens, lens.stride(0), n_cols, surv, count, bound, select_k, CHUNK=chunk, KW=kw, LG=lg,
        LB=next_pow2(n_lists), FILTER=filtered, **pdl_launch(cand.device))
    return surv


def rank_limit(rows: int) -> int:
    """Survivors per row up to which ``threshold_select`` ranks by compares: ``rows * limit^2``
    compares at most ``RANK_COMPARES``."""
    return math.isqrt(RANK_COMPARES // max(rows, 1))


def rank_programs(rows: int, limit: int, device) -> int:
    """Programs per row of ``_threshold_select_kernel`` (each ranks every ``G``-th slice): enough
    to fill the GPU with ``RANK_PROGRAMS_PER_SM`` per SM without a second wave (H200, 32 x 128K:
    8 per row instead of 13 in 1.6 waves, 85.7 -> 84.5 us), at most one per ``RANK_SLICE`` of
    ``limit`` survivors (two off the GPU, so that the CPU lanes exercise the striding)."""
    slices = max(1, cdiv(limit, RANK_SLICE))
    sms = _sm_count(device)
    return min(slices, max(1, RANK_PROGRAMS_PER_SM * sms // rows) if sms else 2)


def rank_block(programs: int) -> int:
    """Keys a ranking program compares its slice with per step, for ``programs`` per row
    (``rank_programs``): ``2 * RANK_BLOCK`` from ``RANK_WIDE_PROGRAMS`` on (each program ranks a
    slice or two of the row, so its time is its chain of dependent block loads: fewer, larger
    blocks), else ``RANK_BLOCK`` (many slices each: the compares dominate)."""
    return 2 * RANK_BLOCK if programs >= RANK_WIDE_PROGRAMS else RANK_BLOCK


def threshold_select(cand, count, chunk, lens, n_cols, select_k, out, refine=None, expand=None) -> None:
    """``cand``, ``count`` as in ``survivors`` (``n_lists >= 2``) -> each row's selection in
    ``out [rows, select_k]`` int32; ``refine``, ``expand``: see ``select_by_leaves``."""
    surv = survivors(cand, count, chunk, lens, n_cols, select_k, refine is not None)
    if refine is not None:
        refine(surv, count)
    rows = out.shape[0]
    limit = rank_limit(rows)
    programs = rank_programs(rows, limit, out.device)
    _threshold_select_kernel[(rows, programs)](
        surv, surv.shape[1], count, lens, lens.stride(0), n_cols, out, out.stride(0), select_k, limit,
        KB=key_block(select_k), BLOCK=SELECT_BLOCK, BITS=RADIX_BITS, HELD=SELECT_HELD_KEYS, SLICE=RANK_SLICE,
        RANK_BLOCK=rank_block(programs),
        **expansion_args(expand, select_k, lens), num_warps=SELECT_WARPS, **pdl_launch(out.device),
    )


@on_device_of("logits")
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
    check_int("select_k", select_k, most=MAX_SELECT)
    if rows and range_checks_enabled():
        top = int(pool_lens.max())
        if top > n_cols:
            raise ValueError(f"pool_lens holds {top}, more than the N = {n_cols} logits per row")
    if backend_for(device) == "torch":
        return reference.select_pools(logits, pool_lens, select_k)
    out = torch.empty((rows, select_k), dtype=torch.int32, device=device)
    if rows == 0:
        return out

    def launch_leaves(cand, count, chunk, n_chunks, kb, final, filtered):
        _chunk_topk_kernel[(rows, n_chunks)](
            logits, logits.stride(0), pool_lens, pool_lens.stride(0), cand, count, out, out.stride(0), n_cols, select_k,
            n_chunks, CHUNK=chunk, KB=kb, FINAL=final, **pdl_launch(device),
        )

    select_by_leaves(out, pool_lens, n_cols, select_k, launch_leaves)
    return out
