"""The exact arithmetic of SPEC.md §2 in plain torch ("serving bytes").

Every step is an IEEE fp32 operation in a fixed order, so the Triton kernels (which
perform the same operations in the same order, with FMA contraction disabled and
``div_rn`` divisions) give identical bits on every GPU and in the CPU interpreter:

* exp is ``2^n * poly5(r)``: ``tn = fma(x, log2(e), 1.5*2^23)``, ``n = tn - 1.5*2^23`` (``rne(x*log2(e))``),
  ``r = fma(x, log2(e), 1.5*2^23 - tn)``, the polynomial in Horner form of fused multiply-adds
  (``fma``: one rounding, IEEE fusedMultiplyAdd; ``tl.fma`` in the kernels, emulated exactly here);
* the pooling sums start at slot 0's terms and accumulate ``acc = fma(e, k, acc)`` in slot order;
* bf16 rounding and fp8 encoding are integer operations on the fp32 bit pattern;
* the ue8m0 scale ``2^ceil(log2(v))`` is read off the exponent and mantissa bits.

All functions take and return fp32 tensors unless stated otherwise. No Triton here.
"""

from __future__ import annotations

import torch

from .layout import AMAX_FLOOR, HADAMARD_SCALE, HEAD_DIM, fp8_max

LOG2E = 1.4426950408889634
EXP_X_MIN = -69.0  # exp(x) for x < -69 is taken at -69 (~1e-30): n >= -100 keeps 2^n normal
EXP_ROUND = 12582912.0  # 1.5 * 2^23: fma(x, log2(e), EXP_ROUND) rounds x*log2(e) to an integer (ties to even)
# 2^r on r in [-0.5, 0.5]: the degree-5 polynomial interpolating 2^r at the 6 Chebyshev
# nodes, with its constant term set to exactly 1 so that exp(0) == 1 (the max slot's weight);
# max relative error 2.9e-7 evaluated in fp32 Horner form. Highest degree first.
EXP2_POLY = (0.0013390863364698205, 0.009676031918298474, 0.055503571142190296,
             0.24022107485309188, 0.6931471880262294, 1.0)

_F32 = torch.float32
_F64 = torch.float64


def _c(value: float, like: torch.Tensor) -> torch.Tensor:
    """An fp32 scalar tensor (so torch never widens a Python float to fp64)."""
    return torch.tensor(value, dtype=_F32, device=like.device)


def fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 ``a*b + c`` rounded once (IEEE fusedMultiplyAdd, ties to even).

    ``a*b`` is exact in fp64 and TwoSum gives the fp64 sum's exact error, so the only case
    where rounding the fp64 sum to fp32 differs from rounding the exact value (double
    rounding) is a sum landing exactly on an fp32 midpoint: there the error's sign decides.
    Overflow, underflow and infinities come out as from an fp32 fma, and NaN where it gives
    NaN; a NaN's sign and payload are the platform's fp64 arithmetic's, which may differ from
    the kernels' fp32 fma (CUDA's returns 0x7FFFFFFF).
    """
    p = a.to(_F64) * b.to(_F64)
    cd = c.to(_F64)
    s = p + cd
    bb = s - p
    err = (p - (s - bb)) + (cd - bb)
    f = s.to(_F32)
    fd = f.to(_F64)
    up = s > fd
    g = torch.nextafter(f, torch.where(up, _c(float("inf"), f), _c(float("-inf"), f)))
    on_midpoint = (s != fd) & (s == (fd + g.to(_F64)) * 0.5) & (err != 0)
    return torch.where(on_midpoint & ((err > 0) == up), g, f)


def exp_exact(x: torch.Tensor) -> torch.Tensor:
    """``exp(x)`` for ``x <= 0`` from IEEE adds and fmas (rel. error < 1e-6 on [-69, 0]).

    ``x`` is clamped at ``EXP_X_MIN`` by IEEE maxNum (a NaN argument gives ``exp(EXP_X_MIN)``),
    as Triton's ``tl.maximum`` on every target. ``tn = fma(x, log2(e), 1.5*2^23)`` rounds the
    exact ``x*log2(e)`` to the integer ``n = tn - 1.5*2^23``, and ``r = fma(x, log2(e),
    1.5*2^23 - tn)`` (``-n``, an exact difference) is the reduced argument rounded once.
    ``2^n`` is applied by adding ``n`` to the exponent bits (exact: ``p * 2^n`` stays normal)."""
    s = torch.fmax(x, _c(EXP_X_MIN, x))
    log2e = _c(LOG2E, x).expand_as(s)
    rounder = _c(EXP_ROUND, x)
    tn = fma(s, log2e, rounder.expand_as(s))
    n = tn - rounder
    r = fma(s, log2e, rounder - tn)
    p = torch.full_like(r, EXP2_POLY[0])
    for coef in EXP2_POLY[1:]:
        p = fma(p, r, _c(coef, x).expand_as(r))
    return (p.view(torch.int32) + (n.to(torch.int32) << 23)).view(_F32)


def bf16_round(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 to the nearest bf16 (ties to even), returned as fp32. A NaN gives a NaN
    (sign and payload unspecified: only NaN-ness reaches the fp8 codes, ``fp8_encode``)."""
    u = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    r = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    r = torch.where(r >= 2**31, r - 2**32, r).to(torch.int32).view(_F32)
    return torch.where(torch.isnan(x), _c(float("nan"), x), r)


def fwht128(x: torch.Tensor) -> torch.Tensor:
    """Unscaled Sylvester Walsh–Hadamard over the last dim (128): strides 1, 2, ..., 64."""
    lead = x.shape[:-1]
    stride = 1
    while stride < HEAD_DIM:
        y = x.reshape(*lead, HEAD_DIM // (2 * stride), 2, stride)
        a, b = y[..., 0, :], y[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).reshape(*lead, HEAD_DIM)
        stride *= 2
    return x


def rotate(x: torch.Tensor) -> torch.Tensor:
    """``bf16(FWHT128(x) * fp32(1/sqrt(128)))`` of fp32 ``x [..., 128]``."""
    return bf16_round(fwht128(x) * _c(HADAMARD_SCALE, x))


def quant_scale(amax: torch.Tensor, fp8_dtype: torch.dtype, round_scale: bool = True) -> torch.Tensor:
    """Per-vector scale from ``amax`` (fp32): ``2^ceil(log2(v))`` (ue8m0) or ``v``,
    with ``v = max(amax, 1e-4) * fp32(1/FP8_MAX)``; the max is IEEE maxNum (a NaN ``amax``
    gives ``1e-4``), as Triton's ``tl.maximum`` on every target."""
    v = torch.fmax(amax, _c(AMAX_FLOOR, amax)) * _c(1.0 / fp8_max(fp8_dtype), amax)
    if not round_scale:
        return v
    bits = v.contiguous().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    exponent = exponent + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exponent << 23).view(_F32)


def fp8_encode(x: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """fp32 -> fp8 codes (uint8): clamp to ``±FP8_MAX``, round to nearest even; every NaN
    gives the format's canonical NaN code whatever its sign (0x7F e4m3fn, 0x80 e4m3fnuz), so
    the codes do not depend on a platform's NaN sign propagation."""
    m = fp8_max(fp8_dtype)
    codes = torch.clamp(x, -m, m).to(fp8_dtype).view(torch.uint8)
    nan_code = torch.tensor(0x80 if fp8_dtype == torch.float8_e4m3fnuz else 0x7F, dtype=torch.uint8, device=x.device)
    return torch.where(torch.isnan(x), nan_code, codes)


def quantize(y: torch.Tensor, fp8_dtype: torch.dtype, round_scale: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row fp8 quantization of bf16-exact fp32 ``y [n, 128]``.

    Returns ``(codes [n, 128] uint8, scale [n] fp32)``.
    """
    a = torch.abs(y)
    # NaN-skipping max (as tl.max on every target); an all-NaN row gives 0, floored to 1e-4 below
    amax = torch.where(torch.isnan(a), 0.0, a).amax(dim=-1) if y.shape[0] else torch.zeros(0, dtype=_F32,
                                                                                            device=y.device)
    scale = quant_scale(amax, fp8_dtype, round_scale)
    return fp8_encode(y / scale[:, None], fp8_dtype), scale


def pool_softmax(keys: torch.Tensor, gates: torch.Tensor, ape: torch.Tensor) -> torch.Tensor:
    """Per-dim softmax(gate + ape) pooling, rounded to bf16 (SPEC §2 steps 1-2).

    ``keys``, ``gates``: ``[n, P, 128]`` bf16; ``ape``: ``[P, 128]`` fp32. Returns fp32 ``[n, 128]``.
    Slots are visited in order 0..P-1 (two passes: max, then exp / sums). The max starts at
    slot 0's logit and is IEEE maxNum (NaN logits are skipped), as ``tl.maximum`` in the
    kernels; an all-NaN dim keeps a NaN max, and ``exp_exact`` of ``NaN - max`` is the same
    ``exp(EXP_X_MIN)`` as it would be from ``-inf``. The sums start at slot 0's terms
    (``den = e_0``: the same bits as ``0 + e_0``, one add fewer in the kernels).
    """
    logits = gates.to(_F32) + ape.to(_F32)[None]
    top = logits[:, 0]
    for s in range(1, keys.shape[1]):
        top = torch.fmax(top, logits[:, s])
    for s in range(keys.shape[1]):
        e = exp_exact(logits[:, s] - top)
        k = keys[:, s].to(_F32)
        if s == 0:
            acc, den = fma(e, k, torch.zeros_like(e)), e
        else:
            acc, den = fma(e, k, acc), den + e
    return bf16_round(acc / den)


def compress_pools(keys: torch.Tensor, gates: torch.Tensor, ape: torch.Tensor, fp8_dtype: torch.dtype,
                   round_scale: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Complete pools -> cache entries. ``[n, P, 128]`` bf16 keys/gates, ``[P, 128]`` fp32 ape.

    Returns ``(codes [n, 128] uint8, scale [n] fp32)``.
    """
    return quantize(rotate(pool_softmax(keys, gates, ape)), fp8_dtype, round_scale)


def rotate_quant_rows(q: torch.Tensor, fp8_dtype: torch.dtype,
                      round_scale: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Query side: ``q [rows, 128]`` bf16 -> ``(codes [rows, 128] uint8, scale [rows] fp32)``."""
    return quantize(rotate(q.to(_F32)), fp8_dtype, round_scale)
