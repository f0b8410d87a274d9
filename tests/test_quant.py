"""fwht128_quant_fp8: query-side Hadamard rotation + per-row fp8 (SPEC.md §2, query side).

Both backends must give the bytes of ``kpool.numerics`` exactly; the result must also be
a faithful fp8 quantization of the float64 Hadamard transform (tolerance check), with
ue8m0 scales and the format's own FP8_MAX (240 for e4m3fnuz, never a hard-coded 448).
"""

import math

import pytest
import torch

from kpool import numerics, reference
from kpool.ops.quant import fwht128_quant_fp8, quantize_queries, quantize_queries_and_counts
from kpool.ops.select import visible_counts
from _util import assert_bytes_equal

FP8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


def _queries(shape, seed, device, spread=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*shape, 128, generator=g)
    if spread:  # rows of very different magnitudes, a few large outliers
        q = q * torch.exp2(torch.randint(-12, 12, (*shape, 1), generator=g).float())
        q.view(-1)[:: 97] *= 37.0
    return q.to(torch.bfloat16).to(device)


def _hadamard64(device):
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < 128:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h.to(device)


@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("round_scale", [True, False])
@pytest.mark.parametrize("shape", [(37,), (3, 5), (2, 2, 4), (0,)])
def test_bytes_match_numerics(backend, device, fp8_dtype, round_scale, shape):
    q = _queries(shape, seed=1 + len(shape), device=device)
    q_fp8, q_scale = fwht128_quant_fp8(q, fp8_dtype=fp8_dtype, round_scale=round_scale)
    assert q_fp8.dtype == fp8_dtype and tuple(q_fp8.shape) == (*shape, 128)
    assert q_scale.dtype == torch.float32 and tuple(q_scale.shape) == (*shape, 1)
    codes, scale = numerics.rotate_quant_rows(q.reshape(-1, 128).cpu(), fp8_dtype, round_scale)
    assert_bytes_equal(q_fp8.reshape(-1, 128).view(torch.uint8), codes.to(device), "q_fp8 codes")
    assert_bytes_equal(q_scale.reshape(-1), scale.to(device), "q_scale")


@pytest.mark.parametrize("fp8_dtype", FP8)
def test_against_float64_math(backend, device, fp8_dtype):
    """Dequantized codes approximate bf16(FWHT(q)/sqrt(128)) computed in float64."""
    q = _queries((48,), seed=7, device=device)
    q_fp8, q_scale = fwht128_quant_fp8(q, fp8_dtype=fp8_dtype)
    y = (q.double() @ _hadamard64(device)) / math.sqrt(128.0)
    deq = q_fp8.double() * q_scale.double()
    fmax = float(torch.finfo(fp8_dtype).max)
    # fp8 e4m3: relative half-ulp 2^-4 for normals; subnormal half-step 2^-10 (fn) / 2^-11
    # (fnuz) times the scale; plus the bf16 rounding of the rotated vector (2^-9 relative).
    sub = 2.0 ** (-10 if fp8_dtype == torch.float8_e4m3fn else -11)
    bound = y.abs() * (2.0 ** -4 + 2.0 ** -8) + q_scale.double() * sub
    assert bool((torch.abs(deq - y) <= bound).all())
    assert float(q_fp8.float().abs().max()) <= fmax


@pytest.mark.parametrize("fp8_dtype", FP8)
def test_ue8m0_scale_and_format_max(backend, device, fp8_dtype):
    q = _queries((64,), seed=11, device=device)
    q_fp8, q_scale = fwht128_quant_fp8(q, fp8_dtype=fp8_dtype)
    fmax = float(torch.finfo(fp8_dtype).max)
    s = q_scale.reshape(-1).cpu()
    mant, _ = torch.frexp(s)
    assert bool((mant == 0.5).all()), "ue8m0 scales must be powers of two"
    amax = numerics.rotate(q.float().cpu()).abs().amax(-1)
    ratio = amax / s
    assert bool(((ratio > fmax / 2) & (ratio <= fmax)).all()), "amax / scale must lie in (FP8_MAX/2, FP8_MAX]"
    # the largest code of each row is near the format's own max (240 for fnuz, not 448)
    top = q_fp8.float().abs().amax(-1).cpu()
    assert bool((top >= fmax / 2).all()) and bool((top <= fmax).all())


@pytest.mark.parametrize("fp8_dtype", FP8)
def test_linear_scale_and_zero_rows(backend, device, fp8_dtype):
    q = _queries((6,), seed=3, device=device)
    q[0] = 0  # amax below the 1e-4 floor
    q_fp8, q_scale = fwht128_quant_fp8(q, fp8_dtype=fp8_dtype, round_scale=False)
    fmax = float(torch.finfo(fp8_dtype).max)
    amax = numerics.rotate(q.float().cpu()).abs().amax(-1)
    want = torch.clamp_min(amax, 1e-4) * torch.tensor(1.0 / fmax, dtype=torch.float32)
    assert torch.equal(q_scale.reshape(-1).cpu(), want)
    assert bool((q_fp8[0].float() == 0).all())
    _, s_round = fwht128_quant_fp8(q[:1], fp8_dtype=fp8_dtype)
    assert float(s_round) == 2.0 ** math.ceil(math.log2(1e-4 / fmax))


def test_strided_input(backend, device):
    base = _queries((4, 2), seed=5, device=device)
    q = base[:, 1]  # row stride 256 elements
    got = fwht128_quant_fp8(q, fp8_dtype=torch.float8_e4m3fn)
    want = fwht128_quant_fp8(q.contiguous(), fp8_dtype=torch.float8_e4m3fn)
    assert_bytes_equal(got[0].view(torch.uint8), want[0].view(torch.uint8), "strided q codes")
    assert_bytes_equal(got[1], want[1], "strided q scales")
    qt = _queries((128,), seed=6, device=device).reshape(128, 128).t()  # inner stride 128: copied
    got = fwht128_quant_fp8(qt, fp8_dtype=torch.float8_e4m3fn)
    want = fwht128_quant_fp8(qt.contiguous(), fp8_dtype=torch.float8_e4m3fn)
    assert_bytes_equal(got[0].view(torch.uint8), want[0].view(torch.uint8), "transposed q codes")


def test_validation(backend, device):
    q = _queries((2,), seed=0, device=device)
    with pytest.raises(TypeError, match="q"):
        fwht128_quant_fp8(q.float())
    with pytest.raises(ValueError, match="q"):
        fwht128_quant_fp8(q[:, :64])
    with pytest.raises(TypeError, match="fp8_dtype"):
        fwht128_quant_fp8(q, fp8_dtype=torch.float16)
    with pytest.raises(TypeError, match="round_scale"):
        fwht128_quant_fp8(q, round_scale=1)
    with pytest.raises(TypeError, match="q"):
        fwht128_quant_fp8(q.float().cpu().numpy())


@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("round_scale", [True, False])
@pytest.mark.parametrize("lead,heads", [((5,), 16), ((2, 3), 32), ((1,), 64), ((0,), 32)])
def test_quantize_queries_folds_the_weights(backend, device, fp8_dtype, round_scale, lead, heads):
    """quantize_queries = fwht128_quant_fp8 + reference.fold_head_weights, bit for bit, with
    head weights of any strides (a transposed view here)."""
    q = _queries((*lead, heads), seed=7 + heads, device=device)
    g = torch.Generator().manual_seed(heads)
    w = (torch.randn(heads, *lead, generator=g) * 3.0).to(device)
    w = w.movedim(0, -1)  # [..., H], not contiguous
    q8, qs, wf = quantize_queries(q, w, fp8_dtype=fp8_dtype, round_scale=round_scale)
    want_q8, want_qs = fwht128_quant_fp8(q, fp8_dtype=fp8_dtype, round_scale=round_scale)
    assert q8.shape == want_q8.shape and qs.shape == want_qs.shape and wf.shape == w.shape
    assert_bytes_equal(q8.view(torch.uint8).cpu(), want_q8.view(torch.uint8).cpu(), "codes")
    assert_bytes_equal(qs.cpu(), want_qs.cpu(), "scales")
    assert_bytes_equal(wf.cpu(), reference.fold_head_weights(w, want_qs).cpu(), "folded weights")


@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("pool_size", [4, 16])
@pytest.mark.parametrize("lead,heads", [((3, 5), 16), ((2, 1), 32), ((0, 4), 32)])
def test_quantize_queries_and_counts_in_one_launch(backend, device, pos_dtype, pool_size, lead, heads):
    """The query side of a decode / verify step: ``quantize_queries`` and ``visible_counts`` of
    the rows' positions (padding rows negative, pool boundaries either side), bit for bit,
    whatever the heads per token (each token's counts come from its head-0 row)."""
    q = _queries((*lead, heads), seed=11 + heads, device=device)
    g = torch.Generator().manual_seed(pool_size + heads)
    w = (torch.randn(*lead, heads, generator=g) * 3.0).to(device)
    pos = torch.randint(-3, 4 * pool_size, lead, generator=g)
    pos.view(-1)[::3] = -1
    pos.view(-1)[1::4] = pool_size - 1  # a pool just completed
    pos = pos.to(pos_dtype).to(device)
    q8, qs, wf, seq, lens = quantize_queries_and_counts(q, w, pos, pool_size)
    want = quantize_queries(q, w)
    for got, exp, what in zip((q8.view(torch.uint8), qs, wf), (want[0].view(torch.uint8), *want[1:]),
                              ("codes", "scales", "folded weights")):
        assert_bytes_equal(got.cpu(), exp.cpu(), what)
    want_seq, want_lens = visible_counts(pos, pool_size)
    assert seq.dtype == lens.dtype == torch.int64 and seq.shape == lens.shape == (pos.numel(),)
    assert torch.equal(seq.cpu(), want_seq.cpu()) and torch.equal(lens.cpu(), want_lens.cpu())
    assert torch.equal(seq.cpu(), (pos.reshape(-1).cpu().long() + 1).clamp_min(0))


def test_quantize_queries_rejects(device):
    q = _queries((3, 16), seed=5, device=device)
    w = torch.randn(3, 16).to(device)
    with pytest.raises(ValueError, match="weights"):
        quantize_queries(q, w[:, :8])
    with pytest.raises(TypeError, match="weights"):
        quantize_queries(q, w.double())
    with pytest.raises(ValueError, match="q"):
        quantize_queries(q[..., :64], w)
    pos = torch.zeros(3, dtype=torch.int32).to(device)
    with pytest.raises(ValueError, match="positions"):
        quantize_queries_and_counts(q, w, pos[:2], 4)
    with pytest.raises(TypeError, match="positions"):
        quantize_queries_and_counts(q, w, pos.float(), 4)
    with pytest.raises(ValueError, match="pool_size"):
        quantize_queries_and_counts(q, w, pos, 0)
    with pytest.raises(ValueError, match=r"q must have shape \[\.\.\., H, 128\]"):
        quantize_queries_and_counts(q[..., :64], w, pos, 4)
