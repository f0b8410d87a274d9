"""fp8 e4m3 code -> exact fp16 halves for the scoring kernels (the inverse of ``_jit.fp8_encode``).

Every finite e4m3 value ``x`` is split as ``x = hi + lo`` with ``hi`` a multiple of a *step*
``h`` (1 for e4m3fn, 1/2 for e4m3fnuz) and ``|lo| <= h / 2`` a multiple of the format's unit
``u`` (``2^-9`` e4m3fn, ``2^-10`` e4m3fnuz; ``h / u = 512`` in both): ``|hi / h| <= 480``,
``|lo / u| <= 256``. Both halves are exact in fp16, so the four half products of a dot are
fp16 MMAs whose fp32 accumulators hold integer multiples of ``h^2``, ``h u`` and ``u^2``
below ``2^24`` of them at every step, hence exact in any summation order
(``logits._exact_dot`` gives the bounds).

Two decoders, same halves: the target's fp8 -> fp16 conversion where it has one for the
format (``NATIVE_FP8``, chosen like the writers' encoder by ``_backend.native_fp8``), then
``hi = (x + 1.5 * 1024 * h) - 1.5 * 1024 * h`` (round to a multiple of ``h``, nearest
even: fp16's ulp is ``h`` there) and ``lo = x - hi``; else a 256-entry table built by torch
and read with one load per code, which needs no fp8 type (sm_80 has no ``float8e4nv``
conversion, CUDA none for e4m3fnuz). NaN codes (fn: ``0x7F``/``0xFF``; fnuz: ``0x80``)
decode to NaN halves plus a NaN flag. The formats have no infinities.
"""

import functools

import torch
import triton
import triton.language as tl

_ROUND_FN = tl.constexpr(1536.0)  # 1.5 * 2^10: fp16 ulp 1 in [1024, 2048): rounds to the step 1
_ROUND_FNUZ = tl.constexpr(768.0)  # 1.5 * 2^9: fp16 ulp 1/2 in [512, 1024): rounds to the step 1/2


def half_step(fnuz: bool) -> float:
    """The step ``h`` of the high half: 512 units of the format (``reference.fp8_int_table``)."""
    return 0.5 if fnuz else 1.0


@functools.lru_cache(maxsize=None)
def halves_table(fp8_dtype, device) -> torch.Tensor:
    """int32 ``[256]``: code -> fp16 bits of ``hi`` | fp16 bits of ``lo`` << 16 (both NaN for
    a NaN code), for ``fp8_halves``; cached per format and device."""
    x = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8_dtype).to(torch.float64)
    step = half_step(fp8_dtype == torch.float8_e4m3fnuz)
    hi = torch.round(x / step) * step + 0.0  # round half to even and +0, as the native decoder's (x + c) - c
    lo = x - hi
    bits = [t.to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF for t in (hi, lo)]
    return (bits[0] | (bits[1] << 16)).to(torch.int32).to(device)


@triton.jit
def _native_fp16(code, FNUZ: tl.constexpr):
    """uint8 e4m3 codes -> their values in fp16 by the target's conversion (exact; NaN codes NaN)."""
    if FNUZ:
        return code.to(tl.float8e4b8, bitcast=True).to(tl.float16)
    else:
        return code.to(tl.float8e4nv, bitcast=True).to(tl.float16)


@triton.jit
def fp8_halves(code, table_ptr, FNUZ: tl.constexpr, NATIVE_FP8: tl.constexpr):
    """uint8 e4m3 codes -> fp16 ``(hi, lo, nan)``: ``hi + lo`` = the code's value, ``hi`` a
    multiple of ``half_step``, ``|lo| <= half_step / 2``; NaN halves and flag for NaN codes.

    ``NATIVE_FP8``: the target's fp8 -> fp16 conversion (exact) and two fp16 additions per
    half; otherwise one lookup in ``halves_table`` (1 KiB, cache resident).
    """
    if NATIVE_FP8:
        x = _native_fp16(code, FNUZ)
        shift: tl.constexpr = _ROUND_FNUZ if FNUZ else _ROUND_FN
        hi = (x + shift) - shift
        return hi, x - hi, x != x
    else:
        t = tl.load(table_ptr + code.to(tl.int32))
        hi = t.to(tl.int16).to(tl.float16, bitcast=True)
        return hi, (t >> 16).to(tl.int16).to(tl.float16, bitcast=True), hi != hi


@triton.jit
def fp8_values(code, table_ptr, FNUZ: tl.constexpr, NATIVE_FP8: tl.constexpr):
    """uint8 e4m3 codes -> ``(value, nan)``: the code's value in fp16 (exact) and a NaN flag,
    by the target's conversion where it has one, else as ``hi + lo`` of ``fp8_halves``."""
    if NATIVE_FP8:
        x = _native_fp16(code, FNUZ)
        return x, x != x
    else:
        hi, lo, nan = fp8_halves(code, table_ptr, FNUZ, NATIVE_FP8)
        return hi + lo, nan
