"""The shared Triton helpers (kpool.ops._jit) against kpool.numerics and against torch.

Each helper runs in a tiny test kernel (the CPU interpreter here, natively on a GPU) over
large input sets: every bf16 bit pattern, 2^20 random fp32 bit patterns, and values at
and next to every rounding boundary. Comparisons are bit for bit.
"""

import fractions
import math

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter

from kpool import _backend, _interpreter, numerics
from kpool.layout import AMAX_FLOOR, HADAMARD_SCALE, fp8_max
from kpool.ops import _jit

from _util import assert_bytes_equal
from conftest import DEVICE  # the device fixture's device, needed at collection time

FP8 = [torch.float8_e4m3fn, torch.float8_e4m3fnuz]
F32 = torch.float32


def _block(device):
    # one big program per 64K elements in the interpreter (numpy-vectorised); small blocks on a GPU
    return 65536 if torch.device(device).type == "cpu" else 1024


def _bits_to_f32(bits: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2^32) -> fp32 with those bit patterns."""
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(F32)


def _f32_bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


# --- test kernels ---------------------------------------------------------------------------

@triton.jit
def _fp8_encode_kernel(x_ptr, o_ptr, n, FP8_MAX: tl.constexpr, FNUZ: tl.constexpr, BLOCK: tl.constexpr,
                       NATIVE: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    m = i < n
    x = tl.load(x_ptr + i, mask=m, other=0.0)
    if NATIVE:
        code = _jit.fp8_encode_native(x, FP8_MAX, FNUZ, NATIVE)
    else:
        code = _jit.fp8_encode(x, FP8_MAX, FNUZ)
    tl.store(o_ptr + i, code, mask=m)


@triton.jit
def _bf16_round_kernel(x_ptr, o_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(o_ptr + i, _jit.bf16_round(tl.load(x_ptr + i, mask=m, other=0.0)), mask=m)


@triton.jit
def _bf16_to_f32_kernel(x_ptr, o_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(o_ptr + i, _jit.bf16_to_f32(tl.load(x_ptr + i, mask=m, other=0.0)), mask=m)


@triton.jit
def _exp_kernel(x_ptr, o_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(o_ptr + i, _jit.exp_exact(tl.load(x_ptr + i, mask=m, other=0.0)), mask=m)


@triton.jit
def _fma_kernel(a_ptr, b_ptr, c_ptr, o_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    a = tl.load(a_ptr + i, mask=m, other=0.0)
    b = tl.load(b_ptr + i, mask=m, other=0.0)
    tl.store(o_ptr + i, tl.fma(a, b, tl.load(c_ptr + i, mask=m, other=0.0)), mask=m)


@triton.jit
def _quant_scale_kernel(x_ptr, o_ptr, n, FP8_MAX: tl.constexpr, ROUND_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    amax = tl.load(x_ptr + i, mask=m, other=0.0)
    tl.store(o_ptr + i, _jit.quant_scale(amax, 1.0 / FP8_MAX, ROUND_SCALE), mask=m)


@triton.jit
def _rotate_kernel(x_ptr, o_ptr, n_rows, BN: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN)  # [BN]
    d = tl.arange(0, 128)  # [128]
    m = (r < n_rows)[:, None]
    x = tl.load(x_ptr + r[:, None] * 128 + d[None, :], mask=m, other=0.0)  # [BN, 128]
    tl.store(o_ptr + r[:, None] * 128 + d[None, :], _jit.rotate(x, BN), mask=m)


@triton.jit
def _pool_finish_kernel(acc_ptr, den_ptr, o_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    i = tl.reshape(i, (BLOCK // 128, 128))  # the [BN, 128] tiles of the pool writers
    m = i < n
    acc = tl.load(acc_ptr + i, mask=m, other=0.0)
    tl.store(o_ptr + i, _jit.pool_finish(acc, tl.load(den_ptr + i, mask=m, other=1.0)), mask=m)


def _run_elementwise(kernel, x, out_dtype, **meta):
    block = _block(x.device)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    kernel[(triton.cdiv(x.numel(), block),)](x, out, x.numel(), BLOCK=block, enable_fp_fusion=False, **meta)
    return out


# --- inputs -------------------------------------------------------------------------------

def _all_bf16_as_f32() -> torch.Tensor:
    """Every bf16 bit pattern (NaNs, ±inf, ±0, subnormals included) as fp32."""
    return torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).to(F32)


def _random_f32(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return _bits_to_f32(torch.randint(0, 2**32, (n,), generator=g, dtype=torch.int64))


def _neighbours(x: torch.Tensor, k: int = 2) -> torch.Tensor:
    """``x`` and its ``k`` nearest fp32 neighbours on each side."""
    out = [x]
    up = down = x
    for _ in range(k):
        up = torch.nextafter(up, torch.full_like(up, math.inf))
        down = torch.nextafter(down, torch.full_like(down, -math.inf))
        out += [up, down]
    return torch.cat(out)


def _fp8_boundaries(fp8_dtype) -> torch.Tensor:
    """Every fp8 value, every midpoint between neighbours (ties), their fp32 neighbours,
    both signs, and values around and far beyond ±FP8_MAX."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8_dtype).to(torch.float64)
    vals = torch.unique(codes[torch.isfinite(codes) & (codes >= 0)])
    mids = (vals[1:] + vals[:-1]) / 2
    m = fp8_max(fp8_dtype)
    top = vals[-1] - vals[-2]  # step at the top binade
    edge = torch.tensor([m, m + top / 2, m + top, 2 * m, 1e30, math.inf, 3.4028234663852886e38], dtype=torch.float64)
    x = torch.cat((vals, mids, edge)).to(F32)
    x = _neighbours(x, 2)
    return torch.cat((x, -x))


# --- (a) fp8 encoding ---------------------------------------------------------------------

def _encoder_cases():
    """(fp8 format, encoder): the software encoder for both formats; the native one
    (``_jit.fp8_encode_native``) for the formats this device's target converts natively."""
    dev = torch.device(DEVICE)
    for name, dt in zip(("e4m3fn", "e4m3fnuz"), FP8):
        yield pytest.param(dt, "software", id=f"{name}-software")
        if dev.type != "cpu" or _backend.interpreting():
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv(_backend.FP8_ENCODER_ENV, "native")
                if _backend.native_fp8(dev, dt):
                    yield pytest.param(dt, "native", id=f"{name}-native")


def _native_mode(device, fp8_dtype):
    """The ``NATIVE_FP8`` mode the writers use on ``device`` (``_backend.native_fp8``)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(_backend.FP8_ENCODER_ENV, "native")
        return _backend.native_fp8(torch.device(device), fp8_dtype)


@pytest.mark.parametrize("fp8_dtype,encoder", list(_encoder_cases()))
def test_fp8_encode_matches_torch(fp8_dtype, encoder, device):
    """Both encoders: every bf16 pattern, random fp32 bits, every fp8 value and tie with
    their neighbours, values far past ±FP8_MAX and ±inf (saturation), NaN of both signs."""
    x = torch.cat((_all_bf16_as_f32(), _random_f32(1 << 20, seed=1), _fp8_boundaries(fp8_dtype),
                   torch.tensor([math.nan, -math.nan, 0.0, -0.0])))
    want = numerics.fp8_encode(x, fp8_dtype)
    got = _run_elementwise(_fp8_encode_kernel, x.to(device), torch.uint8, FP8_MAX=fp8_max(fp8_dtype),
                           FNUZ=fp8_dtype == torch.float8_e4m3fnuz,
                           NATIVE=_native_mode(device, fp8_dtype) if encoder == "native" else 0)
    assert_bytes_equal(got, want, f"fp8 {fp8_dtype} codes ({encoder}) of {x.numel()} fp32 values")
    # numerics.fp8_encode itself: saturating RNE by the definition (clamp, then torch's conversion)
    m = fp8_max(fp8_dtype)
    assert torch.equal(numerics.fp8_encode(torch.tensor([m * 4, -math.inf]), fp8_dtype).view(fp8_dtype).float(),
                       torch.tensor([m, -m]))
    # every NaN, either sign, any payload, is the format's one canonical code (torch's own
    # conversion keeps the sign: 0xFF for -NaN in e4m3fn)
    nan_code = 0x80 if fp8_dtype == torch.float8_e4m3fnuz else 0x7F
    nans = _bits_to_f32(torch.tensor([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF, 0x7FFFFFFF]))
    assert numerics.fp8_encode(nans, fp8_dtype).tolist() == [nan_code] * 5


@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz], ids=["e4m3fn", "e4m3fnuz"])
def test_native_encoder_saturates_before_converting(fp8_dtype, device, monkeypatch):
    """The native encoder clamps to ±FP8_MAX itself: a conversion without satfinite (AMD's)
    gives NaN past the range. The interpreter's conversion (kpool's, which saturates) is
    replaced here by one that does not; on a GPU the target's own conversion runs."""
    if _backend.interpreting():
        exact = interpreter._convert_float

        def non_saturating(input, input_dtype, output_dtype, rounding_mode):
            dst = _interpreter._torch_dtype(output_dtype)
            if dst in _interpreter._FP8 and input_dtype.primitive_bitwidth == 32:
                arr = np.asarray(input, dtype=np.float32)
                input = np.where(np.abs(arr) > float(torch.finfo(dst).max), np.float32(np.nan), arr)
            return exact(input, input_dtype, output_dtype, rounding_mode)

        monkeypatch.setattr(interpreter, "_convert_float", non_saturating)
    m = fp8_max(fp8_dtype)
    x = torch.tensor([m, -m, m * 1.01, -m * 1.01, m * 4, -m * 4, 1e30, -1e30, math.inf, -math.inf, 1.0, -0.5])
    got = _run_elementwise(_fp8_encode_kernel, x.to(device), torch.uint8, FP8_MAX=m,
                           FNUZ=fp8_dtype == torch.float8_e4m3fnuz, NATIVE=_native_mode(device, fp8_dtype))
    assert got.cpu().tolist() == numerics.fp8_encode(x, fp8_dtype).tolist()


# --- (b) bf16 rounding --------------------------------------------------------------------

def _bf16_boundaries() -> torch.Tensor:
    """For every bf16 pattern: its exact value, the tie above it, and the fp32 values next to the tie."""
    hi = torch.arange(65536, dtype=torch.int64) << 16
    lows = torch.tensor([0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=torch.int64)
    return _bits_to_f32((hi[:, None] | lows[None, :]).reshape(-1))


def test_bf16_round_matches_torch(device):
    x = torch.cat((_bf16_boundaries(), _random_f32(1 << 20, seed=2)))
    got = _run_elementwise(_bf16_round_kernel, x.to(device), F32).cpu()
    want = numerics.bf16_round(x)
    nan = torch.isnan(x)  # a NaN's sign and payload are the target's (only NaN-ness reaches the codes)
    assert bool(nan.any())
    assert_bytes_equal(got[~nan], want[~nan], "bf16_round: _jit vs numerics")
    ref = x.to(torch.bfloat16).to(F32)  # torch's RNE conversion
    assert_bytes_equal(want[~nan], ref[~nan], "numerics.bf16_round vs torch .to(bfloat16)")
    assert torch.isnan(want[nan]).all() and torch.isnan(got[nan]).all()
    assert not torch.isnan(got[~nan]).any()
    # the boundary set really contains ties that round both ways
    assert (_f32_bits(want) != _f32_bits(x) & -65536).any() and (want == x).any()


def test_bf16_to_f32_every_pattern(device):
    """The writers' bf16 widening (one shift of the bits) is the exact conversion for all
    65,536 bf16 patterns: subnormals, ±0, ±inf and every NaN payload keep their bits."""
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    got = _run_elementwise(_bf16_to_f32_kernel, x.to(device), F32).cpu()
    assert_bytes_equal(got, x.to(F32), "bf16_to_f32 vs torch .to(float32), every bf16 pattern")


def _pool_finish_cases():
    """(acc, den) with den in [1, P] as in the pooling softmax: random quotients over a wide
    range, quotients at and a few ulp around every kind of bf16 rounding midpoint (where a
    quotient off by an ulp rounds the other way), exact ties (den = 1, 2, 4), specials."""
    g = torch.Generator().manual_seed(12)
    n = 1 << 18
    den = 1 + 15 * torch.rand(n, generator=g)
    acc = torch.randn(n, generator=g) * torch.exp2(torch.randint(-60, 60, (n,), generator=g).to(F32))
    mid = _bits_to_f32((torch.randint(0x0080, 0x7F7F, (n,), generator=g).to(torch.int64) << 16) | 0x8000)
    mid = mid * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    near = mid
    step = torch.randint(-6, 7, (n,), generator=g)
    for _ in range(6):  # walk each midpoint up to 6 ulp away
        near = torch.where(step > 0, torch.nextafter(near, torch.full_like(near, math.inf)), near)
        near = torch.where(step < 0, torch.nextafter(near, torch.full_like(near, -math.inf)), near)
        step = step - step.sign()
    den2 = 1 + 15 * torch.rand(n, generator=g)
    ties = mid[:4096].repeat(3)
    den3 = torch.tensor([1.0, 2.0, 4.0]).repeat_interleave(4096)
    special = torch.tensor([0.0, -0.0, 1e-45, -3e-39, 1e-38, math.inf, -math.inf, math.nan, 3.4e38])
    acc = torch.cat((acc, near * den2, ties * den3, special))
    den = torch.cat((den, den2, den3, torch.tensor([1.0, 3.0, 1.5, 2.0, 3.0, 2.0, 1.0, 1.0, 1.25])))
    return acc.to(F32), den.to(F32)


def test_pool_finish_is_the_ieee_quotient_rounded_to_bf16(device):
    """``_jit.pool_finish`` gives ``bf16(acc / den)`` with the IEEE quotient, bit for bit,
    at and around the bf16 midpoints (a quotient off by one fp32 ulp fails here)."""
    acc, den = _pool_finish_cases()
    n = acc.numel()
    block = _block(device)
    got = torch.empty(n, dtype=F32, device=device)
    _pool_finish_kernel[(triton.cdiv(n, block),)](acc.to(device), den.to(device), got, n, BLOCK=block,
                                                   enable_fp_fusion=False)
    got = got.cpu()
    want = numerics.bf16_round(acc / den)
    nan = torch.isnan(want)
    assert int(nan.sum()) == 1 and torch.equal(torch.isnan(got), nan)
    assert_bytes_equal(got[~nan], want[~nan], "pool_finish vs bf16(acc / den)")
    # the midpoint cases do sit where an ulp decides: rounding a neighbour of the quotient differs
    q = acc / den
    off = numerics.bf16_round(torch.nextafter(q, torch.full_like(q, math.inf)))
    assert int((off != want).sum()) > 10000


# --- (c) exp ------------------------------------------------------------------------------

def _fma_cases():
    """fp32 (a, b, c): random finite values over a wide exponent range, plus products that are
    exact fp32 midpoints (``(1 + m*2^-23) * 1.5``, m odd) with addends far below the fp64
    ulp, where rounding the fp64 sum to fp32 (double rounding) would be wrong."""
    g = torch.Generator().manual_seed(11)
    n = 1 << 16
    def rand(scale):
        return (torch.randn(n, generator=g) * torch.exp2(torch.randint(-scale, scale + 1, (n,), generator=g).to(F32)))
    a, b, c = rand(20), rand(20), rand(40)
    m = torch.arange(1, 4096, 2, dtype=torch.float64)
    ma = ((1.0 + m * 2.0 ** -23)).to(F32)
    tiny = torch.tensor([2.0 ** -100, -2.0 ** -100, 2.0 ** -60, -2.0 ** -60, 0.0], dtype=F32)
    ma, tc = ma.repeat_interleave(len(tiny)), tiny.repeat(len(m))
    a = torch.cat((a, ma, -ma, numerics.EXP2_POLY[0] * torch.ones(n)))
    b = torch.cat((b, torch.full_like(ma, 1.5), torch.full_like(ma, 1.5), torch.rand(n, generator=g) - 0.5))
    c = torch.cat((c, tc, tc, numerics.EXP2_POLY[1] * torch.ones(n)))
    return a.to(F32), b.to(F32), c.to(F32)


def _round_f32_exact(v: "fractions.Fraction") -> float:
    """The fp32 nearest to the rational ``v`` (ties to even; normal or subnormal, no overflow)."""
    if v == 0:
        return 0.0
    e = math.floor(math.log2(abs(v)))
    while abs(v) >= fractions.Fraction(2) ** (e + 1):
        e += 1
    while abs(v) < fractions.Fraction(2) ** e:
        e -= 1
    ulp = fractions.Fraction(2) ** max(e - 23, -149)
    return float(round(v / ulp) * ulp)  # round() of a Fraction is half-to-even


def test_fma_rounds_once(device):
    a, b, c = _fma_cases()
    want = numerics.fma(a, b, c)
    # against exact rational arithmetic (a sample and every constructed midpoint case)
    idx = torch.cat((torch.arange(0, a.numel(), 97), torch.arange(1 << 16, a.numel() - (1 << 16))))
    for i in idx.tolist():
        exact = (fractions.Fraction(a[i].item()) * fractions.Fraction(b[i].item()) + fractions.Fraction(c[i].item()))
        assert want[i].item() == _round_f32_exact(exact), (a[i].item(), b[i].item(), c[i].item())
    # the constructed cases do exercise the correction: plain fp64 rounding gets some wrong
    naive = (a.double() * b.double() + c.double()).to(F32)
    assert (naive != want).sum() >= 2048
    # and the kernels' tl.fma (native on a GPU, the interpreter's fma) gives the same bits,
    # non-finite and overflowing cases included (the pooling sum meets inf and NaN keys),
    # except a NaN's sign and payload, which no platform pins (CUDA's fma returns 0x7FFFFFFF,
    # the fp64 emulation the platform's fp64 NaN): NaN results are compared as NaN
    inf, nan = float("inf"), float("nan")
    a = torch.cat((a, torch.tensor([0.5, 0.5, 1.0, 0.25, 1e-30, 3e38, 1.0, 0.0])))
    b = torch.cat((b, torch.tensor([inf, -inf, nan, 2.0, 1e-30, 10.0, 2.0, inf])))
    c = torch.cat((c, torch.tensor([1.0, inf, 1.0, -inf, 0.0, 0.0, nan, 1.0])))
    dev = [t.to(device) for t in (a, b, c)]
    want = numerics.fma(*dev).cpu()
    got = torch.empty_like(dev[0])
    n = a.numel()
    _fma_kernel[(triton.cdiv(n, _block(device)),)](*dev, got, n, BLOCK=_block(device))
    got = got.cpu()
    nan = torch.isnan(want)
    assert nan.sum() == 4 and torch.equal(torch.isnan(got), nan), "tl.fma and numerics.fma disagree on NaN"
    assert_bytes_equal(torch.where(nan, 0.0, got), torch.where(nan, 0.0, want), "tl.fma vs numerics.fma")


def test_exp_exact(device):
    g = torch.Generator().manual_seed(3)
    k = torch.arange(0, 100, dtype=torch.float64)
    # where n = rne(t) steps: t = -(k + 0.5), i.e. x = -(k + 0.5) * ln2
    steps = (-(k + 0.5) * math.log(2.0)).to(F32)
    x = torch.cat((torch.linspace(-69.0, 0.0, 1 << 18, dtype=F32), -69.0 * torch.rand(1 << 16, generator=g),
                   _neighbours(steps[steps >= -69.0], 2), _neighbours(torch.tensor([-69.0, -1.0, -0.5]), 2),
                   torch.tensor([0.0, -0.0, -1e-45, -1e-30, -1e-7])))
    x = x[(x >= -69.0) & (x <= 0.0)]
    got = _run_elementwise(_exp_kernel, x.to(device), F32).cpu()
    want = numerics.exp_exact(x)
    assert_bytes_equal(got, want, "exp_exact: _jit vs numerics")
    exact = torch.exp(x.to(torch.float64))
    rel = ((want.to(torch.float64) - exact).abs() / exact).max().item()
    assert rel <= 1.2e-6, f"exp_exact relative error {rel:.3g}"  # 9.7e-7 (3.6e-6 with t = x*log2(e) rounded first)
    assert torch.equal(want[x == 0], torch.ones_like(want[x == 0]))  # the max slot weighs exactly 1
    # below the floor (x < EXP_X_MIN): exp(EXP_X_MIN), on both sides, for finite x and -inf
    low = torch.cat((-torch.logspace(math.log10(70.0), 30, 4096, dtype=F32),
                     torch.tensor([-3.4e38, -1e4, -float("inf")]), _neighbours(torch.tensor([numerics.EXP_X_MIN]), 2)))
    low = low[low < numerics.EXP_X_MIN]
    got = _run_elementwise(_exp_kernel, low.to(device), F32).cpu()
    assert_bytes_equal(got, numerics.exp_exact(low), "exp_exact below the floor: _jit vs numerics")
    floor = numerics.exp_exact(torch.tensor([numerics.EXP_X_MIN]))
    assert torch.equal(got, floor.expand_as(got))
    assert abs(floor.item() / math.exp(numerics.EXP_X_MIN) - 1) <= 1.2e-6 and floor.item() >= 2.0**-100


@pytest.mark.parametrize("fp8_dtype", FP8, ids=["e4m3fn", "e4m3fnuz"])
@pytest.mark.parametrize("round_scale", [True, False])
def test_quant_scale(fp8_dtype, round_scale, device):
    m = fp8_max(fp8_dtype)
    k = torch.arange(-30, 40, dtype=torch.float64)
    # amax around every power of two times FP8_MAX (where the ue8m0 scale changes), around the floor
    amax = torch.cat((_neighbours((2.0 ** k * m).to(F32), 8), _neighbours((2.0 ** k).to(F32), 2),
                      _neighbours(torch.tensor([AMAX_FLOOR]), 4), torch.tensor([0.0, 1e-30, 1e-5, 3.0e38]),
                      torch.rand(4096, generator=torch.Generator().manual_seed(4)) * 1000))
    got = _run_elementwise(_quant_scale_kernel, amax.to(device), F32, FP8_MAX=m, ROUND_SCALE=round_scale).cpu()
    want = numerics.quant_scale(amax, fp8_dtype, round_scale)
    assert_bytes_equal(got, want, "quant_scale: _jit vs numerics")
    v = torch.clamp_min(amax, AMAX_FLOOR) * torch.tensor(1.0 / m, dtype=F32)  # fp32 product
    if round_scale:
        # independent: 2^ceil(log2(v)) in float64 (log2 of a power of two is exact)
        ref = torch.exp2(torch.ceil(torch.log2(v.to(torch.float64))))
        assert torch.equal(want.to(torch.float64), ref)
        # the inputs hit exact powers of two (scale == v) and values just above them (scale == 2v)
        exact_pow2 = (_f32_bits(v) & 0x7FFFFF) == 0
        assert exact_pow2.any() and ((_f32_bits(v) & 0x7FFFFF) == 1).any()
        assert torch.equal(want[exact_pow2], v[exact_pow2])
    else:
        assert torch.equal(want, v)


@pytest.mark.parametrize("fp8_dtype", FP8, ids=["e4m3fn", "e4m3fnuz"])
@pytest.mark.parametrize("round_scale", [True, False])
def test_quant_scale_nan_amax_is_the_floor(fp8_dtype, round_scale, device):
    """``max(amax, 1e-4)`` is IEEE maxNum (``torch.fmax``, ``tl.maximum``): a NaN amax (a row
    with a NaN, which the rotation spreads over the whole row) gets the 1e-4 floor's scale."""
    amax = torch.tensor([math.nan, -math.nan, AMAX_FLOOR, 0.0], dtype=F32)
    want = numerics.quant_scale(amax, fp8_dtype, round_scale)
    assert not torch.isnan(want).any() and torch.equal(want, want[2].expand(4))
    got = _run_elementwise(_quant_scale_kernel, amax.to(device), F32, FP8_MAX=fp8_max(fp8_dtype),
                           ROUND_SCALE=round_scale).cpu()
    assert_bytes_equal(got, want, "quant_scale of NaN amax: _jit vs numerics")
    # through quantize: a row with one NaN -> all-NaN rotated row, floor scale, NaN codes
    y = numerics.rotate(torch.cat((torch.full((1, 128), 3.0), torch.ones(1, 128))).index_put_(
        (torch.tensor([0]), torch.tensor([9])), torch.tensor(math.nan)))
    codes, scale = numerics.quantize(y, fp8_dtype, round_scale)
    assert torch.isnan(y[0]).all() and torch.equal(scale[0], want[2])
    assert torch.isnan(codes[0].view(fp8_dtype).float()).all() and not torch.isnan(codes[1].view(fp8_dtype).float()).any()


# --- (e) rotation -------------------------------------------------------------------------

def _hadamard128() -> torch.Tensor:
    """Sylvester H128 / sqrt(128) in float64: H[i, j] = (-1)^popcount(i & j)."""
    i = torch.arange(128)
    a = i[:, None] & i[None, :]
    pop = torch.zeros_like(a)
    for b in range(7):
        pop += (a >> b) & 1
    return (1.0 - 2.0 * (pop % 2)).to(torch.float64) / math.sqrt(128.0)


def test_rotate(device):
    g = torch.Generator().manual_seed(5)
    scales = torch.logspace(-4, 4, 9, dtype=F32)
    x = torch.cat((torch.randn(9 * 32, 128, generator=g) * scales.repeat_interleave(32)[:, None],
                   torch.randn(64, 128, generator=g).to(torch.bfloat16).to(F32),  # bf16-exact inputs, as pooled
                   torch.eye(128, dtype=F32)[:40] * 3.0,  # one-hot rows: a scaled Hadamard row
                   torch.zeros(1, 128)))
    bn = 64
    out = torch.empty_like(x, device=device)
    _rotate_kernel[(triton.cdiv(x.shape[0], bn),)](x.to(device), out, x.shape[0], BN=bn, enable_fp_fusion=False)
    want = numerics.rotate(x)
    assert_bytes_equal(out.cpu(), want, "rotate: _jit vs numerics")
    # against the float64 matrix Hadamard: error of one bf16 rounding plus fp32 butterflies
    ref = x.to(torch.float64) @ _hadamard128()
    tol = 2.0 ** -8 * ref.abs() + 1e-6 * x.to(torch.float64).abs().sum(dim=1, keepdim=True) * HADAMARD_SCALE
    err = (want.to(torch.float64) - ref).abs()
    assert (err <= tol).all(), f"rotate vs float64 Hadamard: worst excess {(err - tol).max().item():.3g}"
    # bf16-exact outputs
    assert torch.equal(want, want.to(torch.bfloat16).to(F32))
