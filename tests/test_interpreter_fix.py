"""The interpreter float-downcast fix (kpool._interpreter) must apply, and its self-test must bite.

On a CPU machine (interpreter) these check the patched converter; on a GPU the same
self-test checks Triton's native fp32 -> bf16 / fp8 casts against torch.
"""

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from kpool import _interpreter
from kpool._backend import interpreting

INTERPRETING = interpreting()


def test_self_test_passes(device):
    if INTERPRETING:
        assert _interpreter.fix_applied()
        assert _interpreter.ensure_exact_downcasts() is True  # idempotent
    _interpreter.self_test(device)


@triton.jit
def _cast_kernel(x_ptr, o_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(o_ptr + i, tl.load(x_ptr + i).to(tl.float8e4nv).to(tl.uint8, bitcast=True))


def test_kernel_store_127_3_as_fp8(device):
    """127.3 -> fp8 rounds up across a power of two: 128 (the interpreter's own routine gives 64)."""
    if device != "cpu" and not _interpreter._native_fp8(torch.device(device))[0]:
        pytest.skip("this GPU has no native fp32 -> e4m3fn conversion")
    x = torch.tensor([127.3, -127.3, 1e4, -1e4], device=device)
    out = torch.zeros(4, dtype=torch.uint8, device=device)
    _cast_kernel[(1,)](x, out, N=4)
    assert out.view(torch.float8_e4m3fn).float().tolist() == [128.0, -128.0, 448.0, -448.0]


@triton.jit
def _xor_kernel(x_ptr, rows_ptr, all_ptr, R: tl.constexpr, C: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :])
    tl.store(rows_ptr + tl.arange(0, R), tl.xor_sum(x, axis=1))
    tl.store(all_ptr, tl.xor_sum(tl.reshape(x, (R * C,)), axis=0))


def test_xor_sum_reduction_bits(device):
    """xor_sum (the compare-and-swap of tl.sort / tl.topk; vectorized by kpool in the interpreter)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randint(-2**62, 2**62, (4, 64), generator=g, dtype=torch.int64)
    rows = torch.zeros(4, dtype=torch.int64, device=device)
    whole = torch.zeros(1, dtype=torch.int64, device=device)
    _xor_kernel[(1,)](x.to(device), rows, whole, R=4, C=64)
    want = np.bitwise_xor.reduce(x.numpy(), axis=1)
    assert rows.cpu().numpy().tolist() == want.tolist()
    assert int(whole.cpu()) == int(np.bitwise_xor.reduce(want))


@triton.jit
def _sort_kernel(x_ptr, desc_ptr, asc_ptr, top_ptr, R: tl.constexpr, C: tl.constexpr, K: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :])
    tl.store(desc_ptr + tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :], tl.sort(x, descending=True))
    tl.store(asc_ptr + tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :], tl.sort(x))
    tl.store(top_ptr + tl.arange(0, R)[:, None] * K + tl.arange(0, K)[None, :], tl.topk(x, K))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32])
def test_sort_and_topk(device, dtype, monkeypatch):
    """tl.sort (both orders) and tl.topk of rows with repeated values, against torch.sort; in the
    interpreter also against Triton's own network (kpool routes integer sorts to numpy)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randint(-40, 40, (4, 64), generator=g).to(dtype)
    x[0] = torch.randint(-2**31, 2**31 - 1, (64,), generator=g).to(dtype)
    if dtype == torch.int64:
        x[1] = torch.randint(-2**62, 2**62, (64,), generator=g)

    def run():
        outs = [torch.zeros(4, 64, dtype=dtype, device=device) for _ in range(2)]
        top = torch.zeros(4, 16, dtype=dtype, device=device)
        _sort_kernel[(1,)](x.to(device), *outs, top, R=4, C=64, K=16)
        return [t.cpu() for t in (*outs, top)]

    got = run()
    want = torch.sort(x, descending=True).values
    assert torch.equal(got[0], want) and torch.equal(got[1], torch.sort(x).values)
    assert torch.equal(got[2], want[:, :16])
    if INTERPRETING and dtype != torch.float32:
        fast = tl.standard.sort_impl
        assert getattr(fast, "_kpool_fast", False)
        monkeypatch.setattr(tl.standard, "sort_impl", fast._kpool_original)
        assert all(torch.equal(a, b) for a, b in zip(run(), got))


@triton.jit
def _helper(x, N: tl.constexpr, FAIL: tl.constexpr):
    tl.static_assert(not FAIL, "helper failed on purpose")
    for i in tl.static_range(2):
        x = tl.where(x > i, x - 1, x)
    return x


@triton.jit
def _helper_kernel(x_ptr, o_ptr, N: tl.constexpr, FAIL: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(o_ptr + i, _helper(tl.load(x_ptr + i), N, FAIL))


# The checks below concern the interpreter's converter; they exist only where it runs.
if INTERPRETING:

    def test_language_patched_once_per_launch_and_restored():
        """kpool skips the interpreter's re-patch of triton.language at each @triton.jit helper
        call inside a launch: helpers still run on the patched language (tl.static_range, tl.where,
        tl.static_assert), and after a launch, also one that raises, triton.language holds its
        originals again."""
        from triton.runtime import interpreter

        assert getattr(interpreter._patch_lang, "_kpool_once", False)
        names = [(tl, "static_range"), (tl, "where"), (tl, "static_assert"), (tl.core.tensor, "__bool__"),
                 (tl.core.tensor, "__index__")]
        attrs = lambda: [getattr(obj, name, None) for obj, name in names]  # noqa: E731  (tensor.__bool__: none)
        before = attrs()
        x = torch.tensor([0, 1, 2, 5], dtype=torch.int32)
        out = torch.zeros_like(x)
        _helper_kernel[(2,)](x, out, N=4, FAIL=False)
        assert out.tolist() == [0, 0, 1, 3]
        assert all(a is b for a, b in zip(attrs(), before))
        with pytest.raises(Exception, match="helper failed on purpose"):
            _helper_kernel[(1,)](x, out, N=4, FAIL=True)
        assert all(a is b for a, b in zip(attrs(), before))
        _helper_kernel[(1,)](x + 1, out, N=4, FAIL=False)
        assert out.tolist() == [0, 1, 1, 4]

    def test_self_test_detects_the_original_converter(monkeypatch):
        """The self-test fails on the interpreter's own converter (so it would notice a lost fix)."""
        from triton.runtime import interpreter

        monkeypatch.setattr(interpreter, "_convert_float", interpreter._convert_float._kpool_original)
        assert not _interpreter.fix_applied()
        with pytest.raises(RuntimeError, match="not exact"):
            _interpreter.self_test("cpu")

    def test_missing_patch_point_is_reported(monkeypatch):
        from triton.runtime import interpreter

        monkeypatch.delattr(interpreter, "_convert_float")
        with pytest.raises(RuntimeError, match="_convert_float no longer exists"):
            _interpreter.ensure_exact_downcasts()

    def test_converter_matches_torch_on_all_bf16_patterns():
        """Every bf16 value (as fp32) -> fp8 e4m3fn / e4m3fnuz / e5m2, and fp32 -> bf16 round trips."""
        from triton.runtime import interpreter

        tl = interpreter.tl
        rtne = interpreter._ir.ROUNDING_MODE.RTNE
        x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
        conv = interpreter._convert_float
        for tt, dt in ((tl.float8e4nv, torch.float8_e4m3fn), (tl.float8e4b8, torch.float8_e4m3fnuz),
                       (tl.float8e5, torch.float8_e5m2)):
            got = torch.from_numpy(np.asarray(conv(x.numpy(), tl.float32, tt, rtne)).copy())
            m = torch.finfo(dt).max
            want = torch.clamp(x, -m, m).to(dt).view(torch.uint8)
            nan = torch.isnan(x)
            assert torch.equal(got[~nan], want[~nan]), tt
            assert torch.isnan(got.view(dt)[nan].float()).all()
        # bf16 and fp16 sources (every bit pattern) -> fp8, and every fp8 code back up to fp32
        b16 = torch.arange(65536, dtype=torch.int32).to(torch.int16)
        for tt_src, src in ((tl.bfloat16, torch.bfloat16), (tl.float16, torch.float16)):
            xs = b16.view(src)
            for tt, dt in ((tl.float8e4nv, torch.float8_e4m3fn), (tl.float8e4b8, torch.float8_e4m3fnuz)):
                got = torch.from_numpy(np.asarray(conv(b16.numpy().view(np.uint16), tt_src, tt, rtne)).copy())
                m = torch.finfo(dt).max
                want = torch.clamp(xs.float(), -m, m).to(dt).view(torch.uint8)
                nan = torch.isnan(xs)
                assert torch.equal(got[~nan], want[~nan]), (tt_src, tt)
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        for tt, dt in ((tl.float8e4nv, torch.float8_e4m3fn), (tl.float8e4b8, torch.float8_e4m3fnuz),
                       (tl.float8e5, torch.float8_e5m2)):
            up = torch.from_numpy(np.asarray(conv(codes.numpy(), tt, tl.float32, None)).view(np.float32).copy())
            want = codes.view(dt).float()
            assert torch.equal(torch.isnan(up), torch.isnan(want)), tt
            assert torch.equal(up[~torch.isnan(up)], want[~torch.isnan(want)]), tt
        # fp32 -> bf16 for random fp32 bit patterns (RNE, not truncation)
        g = torch.Generator().manual_seed(0)
        bits = torch.randint(-2**31, 2**31 - 1, (1 << 16,), generator=g, dtype=torch.int64).to(torch.int32)
        xf = bits.view(torch.float32)
        got = torch.from_numpy(np.asarray(conv(xf.numpy(), tl.float32, tl.bfloat16, None)).view(np.int16).copy())
        want = xf.to(torch.bfloat16).view(torch.int16)
        nan = torch.isnan(xf)
        assert torch.equal(got[~nan], want[~nan])
