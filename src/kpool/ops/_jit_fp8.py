"""fp8 e4m3 code -> exact integer limbs for the scoring kernels (the inverse of ``_jit.fp8_encode``).

Two decoders, same integers: the target's fp8 -> fp32 conversion where it has one for the
format (``NATIVE_FP8``, chosen like the writers' encoder by ``_backend.native_fp8``), else a
256-entry table built by torch and read with one load per code, which needs no fp8 type
(sm_80 has no ``float8e4nv`` conversion, CUDA none for e4m3fnuz).

Every finite e4m3 value is an integer multiple of a unit: ``2^-9`` for e4m3fn (bias 7)
and ``2^-10`` for e4m3fnuz (bias 8). With ``e`` the 4 exponent bits and ``m`` the 3
mantissa bits of a code, the integer is ``m`` (``e == 0``, subnormal) or
``(8 + m) << (e - 1)`` (normal), signed by the top bit: at most ``229376`` (448, fn) or
``245760`` (240, fnuz), i.e. 18 bits. NaN codes (fn: ``0x7F``/``0xFF``; fnuz: ``0x80``)
decode to integer 0 plus a NaN flag. The formats have no infinities.
"""

import functools

import torch
import triton
import triton.language as tl

UNIT_FN = 2.0 ** -9  # e4m3fn integer unit
UNIT_FNUZ = 2.0 ** -10  # e4m3fnuz integer unit
_UNIT2_FN, _UNIT2_FNUZ = tl.constexpr(UNIT_FN * UNIT_FN), tl.constexpr(UNIT_FNUZ * UNIT_FNUZ)
_INV_UNIT_FN, _INV_UNIT_FNUZ = tl.constexpr(1.0 / UNIT_FN), tl.constexpr(1.0 / UNIT_FNUZ)  # powers of two: exact


def fp8_unit(fnuz: bool) -> float:
    """The value of integer 1 in the integer representation of the codes."""
    return UNIT_FNUZ if fnuz else UNIT_FN


@functools.lru_cache(maxsize=None)
def limb_table(fp8_dtype, device) -> torch.Tensor:
    """int32 ``[256]``: code -> ``l0 | l1 << 8 | l2 << 16 | nan << 24``, signed int8 limbs with
    ``l0 + l1 * 2^6 + l2 * 2^12 == value / unit`` (0 for NaN codes), for ``fp8_limbs``; cached
    per format and device."""
    vals = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8_dtype).to(torch.float64)
    nan = torch.isnan(vals)
    v = torch.where(nan, 0.0, vals / fp8_unit(fp8_dtype == torch.float8_e4m3fnuz)).to(torch.int64)  # |v| < 2^18
    a, sign = v.abs(), torch.where(v < 0, -1, 1)
    limbs = [sign * (a & 63), sign * ((a >> 6) & 63), sign * (a >> 12)]
    packed = sum((limb & 0xFF) << (8 * i) for i, limb in enumerate(limbs)) | (nan.to(torch.int64) << 24)
    return packed.to(torch.int32).to(device)


@triton.jit
def fp8_limbs(code, table_ptr, FNUZ: tl.constexpr, NATIVE_FP8: tl.constexpr):
    """uint8 e4m3 codes -> int8 limbs ``(l0, l1, l2)`` with ``l0 + l1 * 2^6 + l2 * 2^12 ==
    value / unit`` (0 for NaN codes) and a NaN flag; every ``|limb| <= 63``, ``|l2| <= 60``.

    ``NATIVE_FP8``: the target's fp8 -> fp32 conversion (exact), ``v = value / unit``, limbs
    ``v & 63``, ``(v >> 6) & 63``, ``v >> 12``; on the H200 this replaced the table, whose
    gathers kept the L1 busy. Otherwise one lookup in ``limb_table`` (1 KiB, cache resident;
    sign-magnitude limbs), which needs no fp8 type (sm_80, e4m3fnuz on CUDA).
    """
    if NATIVE_FP8:
        if FNUZ:
            x = code.to(tl.float8e4b8, bitcast=True).to(tl.float32)
            inv_unit: tl.constexpr = _INV_UNIT_FNUZ
        else:
            x = code.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            inv_unit: tl.constexpr = _INV_UNIT_FN
        nan = x != x
        v = (tl.where(nan, 0.0, x) * inv_unit).to(tl.int32)
        return (v & 63).to(tl.int8), ((v >> 6) & 63).to(tl.int8), (v >> 12).to(tl.int8), nan
    else:
        t = tl.load(table_ptr + code.to(tl.int32))
        return t.to(tl.int8), (t >> 8).to(tl.int8), (t >> 16).to(tl.int8), ((t >> 24) & 1) != 0


@triton.jit
def scale_dot(dot, FNUZ: tl.constexpr):
    """A dot product of two codes' integers (fp32) times ``unit^2`` of the format: its value (exact)."""
    if FNUZ:
        unit2: tl.constexpr = _UNIT2_FNUZ
    else:
        unit2: tl.constexpr = _UNIT2_FN
    return dot * unit2
