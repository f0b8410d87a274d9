"""Deterministic top-k over pools (SPEC.md §5): ``select_pools``.

Row ``r`` sees pools ``j < pool_lens[r]``. If more than ``select_k`` are visible, the
``select_k`` best are returned, highest score first, exact ties to the lower pool id;
otherwise every visible pool is returned in ascending id order. Remaining columns are -1.

Order used (identical on every backend, no float arithmetic): each fp32 score maps to an
int32 ``ordered`` that is monotone in the score, with ``-0.0`` equal to ``+0.0`` and every
NaN mapped to ``INT32_MIN``, below ``-inf`` (a NaN pool is picked only when nothing else
is left; ``-inf`` pools are still visible). The ranking key ``ordered * 2^32 + (2^32-1-id)``
is unique per pool, so the selection is a pure function of the inputs.

Triton kernel (correctness first): one program per row. A 4-bit radix select (8 passes
over the row, 16-bin counts) finds the ``select_k``-th largest ordered score and how many
pools equal to it to keep; a compaction pass writes the chosen ids in id order into the
output row; a bitonic ``tl.sort`` of their ranking keys puts them in selection order.
A faster GPU version would fuse the radix passes into the logits kernel (per-block
histograms), use 8-bit digits with shared-memory histograms, and avoid re-reading rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import reference
from .._backend import backend_for
from .._checks import INT_DTYPES, check_tensor, range_checks_enabled

BLOCK_COLS = 1024


@triton.jit
def _ordered_score(x):
    """fp32 -> int64 in ``[-2^31, 2^31)``, monotone; -0.0 == +0.0; NaN -> -2^31 (lowest)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(x == 0, 0, bits)
    o = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
    return tl.where(x != x, -2147483648, o)


@triton.jit
def _select_pools_kernel(x_ptr, x_stride, lens_ptr, lens_stride, out_ptr, out_stride, n_cols, select_k,
                         BLOCK: tl.constexpr, KB: tl.constexpr):
    # One program per row: logits x [n_cols] fp32 -> out [select_k] int32 pool ids.
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_stride
    o_row = out_ptr + row * out_stride
    n_vis = tl.minimum(tl.maximum(tl.load(lens_ptr + row * lens_stride).to(tl.int64), 0), n_cols)
    c = tl.arange(0, KB)  # [KB] output columns
    if n_vis <= select_k:
        tl.store(o_row + c, tl.where(c < n_vis, c, -1).to(tl.int32), mask=c < select_k)
    else:
        # Radix select on u = ordered + 2^31 in [0, 2^32): find the select_k-th largest u
        # (prefix) and k_rem, how many pools with u == prefix are kept (the lowest ids).
        bins = tl.arange(0, 16)
        prefix = tl.zeros([], tl.int64)
        k_rem = tl.zeros([], tl.int64) + select_k
        for p in tl.static_range(8):
            shift = 28 - 4 * p  # constexpr (static_range)
            counts = tl.zeros([16], tl.int32)
            for start in range(0, n_vis, BLOCK):
                i = start + tl.arange(0, BLOCK)  # [BLOCK]
                m = i < n_vis
                u = _ordered_score(tl.load(x_row + i, mask=m, other=0.0)) + 2147483648
                m = m & ((u >> (shift + 4)) == (prefix >> (shift + 4)))
                dig = (u >> shift) & 15
                counts += tl.sum(((dig[:, None] == bins[None, :]) & m[:, None]).to(tl.int32), axis=0)
            at_least = tl.sum(counts, axis=0) - tl.cumsum(counts, 0) + counts  # [16] count of digit >= b
            b_sel = tl.max(tl.where(at_least >= k_rem, bins, -1), axis=0).to(tl.int64)
            k_rem -= tl.sum(tl.where(bins > b_sel, counts, 0), axis=0).to(tl.int64)
            prefix += b_sel << shift
        # Compaction in id order: every pool above the threshold, then the first k_rem equal to it.
        n_out = tl.zeros([], tl.int64)
        n_eq = tl.zeros([], tl.int64)
        for start in range(0, n_vis, BLOCK):
            i = start + tl.arange(0, BLOCK)
            m = i < n_vis
            u = _ordered_score(tl.load(x_row + i, mask=m, other=0.0)) + 2147483648
            eq = m & (u == prefix)
            eq_i = eq.to(tl.int64)
            take = (m & (u > prefix)) | (eq & (n_eq + tl.cumsum(eq_i, 0) - eq_i < k_rem))
            take_i = take.to(tl.int64)
            tl.store(o_row + n_out + tl.cumsum(take_i, 0) - take_i, i.to(tl.int32), mask=take)
            n_out += tl.sum(take_i, axis=0)
            n_eq += tl.sum(eq_i, axis=0)
        tl.debug_barrier()
        # Selection order: ranking key ordered * 2^32 + (2^32 - 1 - id), descending.
        live = c < select_k
        ids = tl.load(o_row + c, mask=live, other=0).to(tl.int64)
        key = _ordered_score(tl.load(x_row + ids, mask=live, other=0.0)) * 4294967296 + (4294967295 - ids)
        key = tl.sort(tl.where(live, key, -9223372036854775807 - 1), descending=True)
        tl.debug_barrier()
        tl.store(o_row + c, (4294967295 - (key & 0xFFFFFFFF)).to(tl.int32), mask=live)


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
    if not isinstance(select_k, int) or isinstance(select_k, bool) or select_k < 1:
        raise ValueError(f"select_k must be a positive int, got {select_k!r}")
    if rows and range_checks_enabled():
        top = int(pool_lens.max())
        if top > n_cols:
            raise ValueError(f"pool_lens holds {top}, more than the N = {n_cols} logits per row")
    if backend_for(device) == "torch":
        return reference.select_pools(logits, pool_lens, select_k)
    out = torch.empty((rows, select_k), dtype=torch.int32, device=device)
    if rows == 0:
        return out
    _select_pools_kernel[(rows,)](
        logits, logits.stride(0), pool_lens, pool_lens.stride(0), out, out.stride(0), n_cols, select_k,
        BLOCK=BLOCK_COLS, KB=triton.next_power_of_2(select_k),
    )
    return out
