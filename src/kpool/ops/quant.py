"""Query-side rotation and fp8 quantization (SPEC.md §2, last paragraph).

``fwht128_quant_fp8`` rotates each 128-dim query row exactly like a pooled key
(``bf16(FWHT128(q) * 128^-0.5)``) and quantizes it per row with the same ue8m0 scale rule
and the platform fp8 format, through the shared ``_jit.rotate`` / ``_jit.quantize``
helpers: identical bytes on every backend.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import reference
from .._backend import backend_for, interpreting, native_fp8, on_device_of, pdl_launch
from .._checks import INT_DTYPES, check_bool, check_pool_size, check_tensor
from ..layout import HEAD_DIM, cdiv, fp8_max, resolve_fp8_dtype
from . import _jit, _pdl
from .select import store_visible_counts, visible_counts

BLOCK_ROWS = 4  # query rows per program (H200, ab: 1 x 128K decode 18.5 -> 18.0 us, 32 x 128K 84.1 -> 83.8 against
#                16; 8: 18.2) ...
INTERPRETER_BLOCK_ROWS = 256  # ... and 256 in the CPU interpreter, whose cost is per program (4,096 query rows:
#                               1.8 ms -> 35 us per row). The bytes do not depend on it.


@triton.jit
def _fwht_quant_kernel(q_ptr, q_row_stride, codes_ptr, scale_ptr, n_rows,
                       w_ptr, w_s0, w_s1, heads, w_out_ptr, w_const, pos_ptr, counts_ptr,
                       BR: tl.constexpr, FP8_MAX: tl.constexpr, FNUZ: tl.constexpr, ROUND_SCALE: tl.constexpr,
                       NATIVE_FP8: tl.constexpr, FOLD: tl.constexpr, P: tl.constexpr, PDL: tl.constexpr):
    _pdl.grid_dependency_sync(PDL)
    # One program per BR rows: q [BR, 128] bf16 -> codes [BR, 128] uint8, scale [BR] fp32.
    # FOLD: row r is (token r // heads, head r % heads) and its folded head weight
    # (w[t, h] * scale) * w_const goes to w_out[r] (fp32; reference.fold_head_weights).
    # P > 0 (with FOLD): each token's head-0 row also writes its visible counts from pos[t]
    # (select.store_visible_counts into counts [2, n_rows // heads]).
    pid = tl.program_id(0).to(tl.int64)
    r = pid * BR + tl.arange(0, BR)
    d = tl.arange(0, 128)
    live = r < n_rows
    x = _jit.bf16_to_f32(tl.load(q_ptr + r[:, None] * q_row_stride + d[None, :], mask=live[:, None], other=0.0))
    codes, scale = _jit.quantize(_jit.rotate(x, BR), FP8_MAX, FNUZ, ROUND_SCALE, NATIVE_FP8)  # [BR, 128], [BR]
    tl.store(codes_ptr + r[:, None] * 128 + d[None, :], codes, mask=live[:, None])
    tl.store(scale_ptr + r, scale, mask=live)
    if FOLD:
        w = tl.load(w_ptr + (r // heads) * w_s0 + (r % heads) * w_s1, mask=live, other=0.0)
        tl.store(w_out_ptr + r, (w * scale) * w_const, mask=live)
        if P > 0:
            store_visible_counts(pos_ptr, counts_ptr, n_rows // heads, r // heads, live & (r % heads == 0), P)


def launch_fwht_quant(q2d, codes, scale, fp8_dtype, round_scale=True, weights=None, w_out=None, positions=None,
                      counts=None, pool_size=0):
    """Launch ``_fwht_quant_kernel``: ``q2d [rows, 128]`` bf16 (unit inner stride) into
    ``codes [rows, 128]`` uint8 and ``scale [rows]`` fp32 (both contiguous); with
    ``weights [rows // H, H]`` fp32, also the folded weights into ``w_out`` (``rows`` contiguous fp32);
    with ``positions [rows // H]`` (contiguous int) and ``pool_size``, also their visible counts
    into ``counts [2, rows // H]`` int64 (``select.visible_counts``)."""
    rows = q2d.shape[0]
    if rows == 0:
        return
    fold = weights is not None
    heads = weights.shape[1] if fold else 1
    block = INTERPRETER_BLOCK_ROWS if interpreting() else BLOCK_ROWS
    _fwht_quant_kernel[(cdiv(rows, block),)](
        q2d, q2d.stride(0), codes, scale, rows,
        weights if fold else scale, weights.stride(0) if fold else 0, weights.stride(1) if fold else 0, heads,
        w_out if fold else scale, reference.head_weight_scale(heads),
        scale if positions is None else positions, scale if counts is None else counts,
        BR=block, FP8_MAX=fp8_max(fp8_dtype), FNUZ=fp8_dtype == torch.float8_e4m3fnuz,
        ROUND_SCALE=round_scale, NATIVE_FP8=native_fp8(q2d.device, fp8_dtype), FOLD=fold,
        P=0 if positions is None else pool_size, enable_fp_fusion=False,
        **pdl_launch(q2d.device),
    )


def fwht128_quant_fp8(q, fp8_dtype=None, round_scale=True):
    """Rotate query rows (Hadamard-128) and quantize each row to fp8 with one fp32 scale.

    Parameters
    ----------
    q : bf16 ``[rows, 128]`` or ``[..., 128]`` (any strides; copied only if the rows cannot be
        addressed with one row stride).
    fp8_dtype : ``torch.float8_e4m3fn`` or ``torch.float8_e4m3fnuz`` (default: the
        platform's, e4m3fnuz on gfx942 only). Its largest finite value is the FP8_MAX.
    round_scale : power-of-two (ue8m0) scales when True (default), else ``amax / FP8_MAX``.

    Returns
    -------
    q_fp8 : ``fp8_dtype`` ``[..., 128]`` (the leading dims of ``q``), codes of
        ``clamp(bf16(FWHT128(q) * 128^-0.5) / scale, ±FP8_MAX)`` rounded to nearest even.
    q_scale : fp32 ``[..., 1]``: ``2^ceil(log2(max(amax, 1e-4) / FP8_MAX))`` per row.
    """
    check_tensor("q", q, dtype=torch.bfloat16)
    if q.ndim < 1 or q.shape[-1] != HEAD_DIM:
        raise ValueError(f"q must have shape [..., {HEAD_DIM}], got {list(q.shape)}")
    q_fp8, q_scale, _ = _quantize(q, fp8_dtype, round_scale)
    return q_fp8, q_scale


def quantize_queries(q, weights, *, fp8_dtype=None, round_scale=True):
    """``fwht128_quant_fp8(q)`` and the folded head weights of the same rows, in one launch.

    Parameters
    ----------
    q : bf16 ``[..., H, 128]`` unrotated queries.
    weights : fp32 ``[..., H]`` raw head weights (same leading dims; any strides).
    fp8_dtype, round_scale : as ``fwht128_quant_fp8``.

    Returns
    -------
    ``(q_fp8 [..., H, 128], q_scale [..., H, 1] fp32, w [..., H] fp32)`` with ``w`` =
    ``reference.fold_head_weights(weights, q_scale)``, bit for bit.
    """
    check_tensor("q", q, dtype=torch.bfloat16)
    if q.ndim < 2 or q.shape[-1] != HEAD_DIM:
        raise ValueError(f"q must have shape [..., H, {HEAD_DIM}], got {list(q.shape)}")
    check_tensor("weights", weights, dtype=torch.float32, shape=tuple(q.shape[:-1]), device=q.device)
    return _quantize(q, fp8_dtype, round_scale, weights)


@on_device_of("q")
def quantize_queries_and_counts(q, weights, positions, pool_size, *, fp8_dtype=None, round_scale=True):
    """``quantize_queries(q, weights)`` and ``select.visible_counts(positions, pool_size)`` in
    one launch (a decode / verify step's query side: ``cache.score_and_select``).

    ``positions``: int32/int64 ``[...]`` token positions of the leading dims of ``weights``
    (``[..., H]``; negative = padding row). Returns ``(q_fp8, q_scale, w, seq_lens, pool_lens)``,
    the last two int64 ``[positions.numel()]`` as ``visible_counts`` returns them.
    """
    check_tensor("q", q, dtype=torch.bfloat16)
    if q.ndim < 2 or q.shape[-1] != HEAD_DIM:
        raise ValueError(f"q must have shape [..., H, {HEAD_DIM}], got {list(q.shape)}")
    check_tensor("weights", weights, dtype=torch.float32, shape=tuple(q.shape[:-1]), device=q.device)
    check_tensor("positions", positions, dtype=INT_DTYPES, shape=tuple(q.shape[:-2]), device=q.device)
    check_pool_size(pool_size)
    if backend_for(q.device) == "torch" or positions.numel() == 0:
        return (*_quantize(q, fp8_dtype, round_scale, weights), *visible_counts(positions, pool_size))
    counts = torch.empty((2, positions.numel()), dtype=torch.int64, device=q.device)
    codes, scale, w = _quantize(q, fp8_dtype, round_scale, weights, positions.reshape(-1).contiguous(), counts,
                                pool_size)
    return codes, scale, w, counts[0], counts[1]


@on_device_of("q")
def _quantize(q, fp8_dtype, round_scale, weights=None, positions=None, counts=None, pool_size=0):
    """Body of ``fwht128_quant_fp8`` / ``quantize_queries`` (``q`` already checked):
    ``(q_fp8 [..., 128], q_scale [..., 1], folded weights [...] or None)``; on the Triton
    backend with ``positions``, also the visible counts into ``counts`` (``launch_fwht_quant``)."""
    check_bool("round_scale", round_scale)
    device = q.device
    fp8_dtype = resolve_fp8_dtype(fp8_dtype, device)
    lead = tuple(q.shape[:-1])
    q2d = q.reshape(-1, HEAD_DIM)
    if q2d.stride(1) != 1:
        q2d = q2d.contiguous()
    if backend_for(device) == "torch":
        codes, scale = reference.fwht128_quant_fp8(q2d, fp8_dtype, round_scale)
        w = None if weights is None else reference.fold_head_weights(weights, scale)
    else:
        rows = q2d.shape[0]
        codes = torch.empty((rows, HEAD_DIM), dtype=torch.uint8, device=device).view(fp8_dtype)
        scale = torch.empty((rows,), dtype=torch.float32, device=device)
        w = None if weights is None else torch.empty(lead, dtype=torch.float32, device=device)
        launch_fwht_quant(q2d, codes.view(torch.uint8), scale, fp8_dtype, round_scale,
                          None if weights is None else weights.reshape(-1, weights.shape[-1]), w, positions, counts,
                          pool_size)
    return codes.reshape(*lead, HEAD_DIM), scale.reshape(*lead, 1), w
