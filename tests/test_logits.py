"""Pooled fp8 logits (SPEC.md §5): paged decode/verify and ragged prefill.

Checked three ways: against ``kpool.reference`` (bit for bit, NaN positions equal), against
an independent re-derivation of the documented exact formulation (torch's own fp8 -> fp64
decode, fp64 dots, one fp32 rounding, sequential heads: bit for bit), and against plain
float64 math within tolerance. Plus the traps: relu per head before the (possibly
negative) head weights, fnuz format (max 240, unit 2^-10), padded page strides,
preshuffled pages, invisible pools = -inf, bad pages = NaN, validation errors.
"""

import pytest
import torch
import triton
import triton.language as tl

from kpool import reference
from kpool._backend import device_target, has_native_fp8
from kpool.layout import ENTRY_BYTES, write_entries
from kpool.ops import _jit_fp8
from kpool.ops import logits as logits_mod
from kpool.ops.logits import RAGGED_TILE, RAGGED_TILES, paged_pool_logits, ragged_pool_logits
from kpool.ops.score import paged_pool_topk
from _util import GarbageTorch, ReadBacks, random_bytes_like

FP8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------

def assert_same_f32(got, want, what):
    """Bitwise-equal fp32 except that any NaN matches any NaN (payload/sign are not portable)."""
    got, want = got.detach().cpu(), want.detach().cpu()
    assert got.shape == want.shape and got.dtype == want.dtype == torch.float32, what
    gn, wn = torch.isnan(got), torch.isnan(want)
    assert torch.equal(gn, wn), f"{what}: NaN positions differ"
    same = (got.view(torch.int32) == want.view(torch.int32)) | gn
    if not bool(same.all()):
        idx = (~same).nonzero()[0].tolist()
        raise AssertionError(f"{what}: {int((~same).sum())} values differ, first at {idx}: "
                             f"{float(got[tuple(idx)])!r} != {float(want[tuple(idx)])!r}")


def rand_codes(shape, fp8_dtype, seed, scale=40.0):
    """Valid (non-NaN) fp8 codes of random normal values spread over the format's range."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * scale
    x = x * torch.exp2(torch.randint(-6, 3, shape, generator=g).float())
    m = float(torch.finfo(fp8_dtype).max)
    return torch.clamp(x, -m, m).to(fp8_dtype)


def exact_scores(q, k, kscale, w):
    """Independent exact formulation: q ``[R, H, 128]``, k ``[N, 128]`` fp8 -> fp32 ``[R, N]``.

    torch's own fp8 -> fp64 decode, fp64 dot (exact), one fp32 rounding, relu, weight,
    pairwise head tree."""
    qd, kd = q.cpu().double(), k.cpu().double()  # torch's own fp8 decode
    terms = []
    for h in range(q.shape[1]):
        dot = (qd[:, h] @ kd.T).float()  # exact fp64 sum, one rounding to fp32
        s = dot * kscale.cpu().float()[None, :]
        r = torch.where(s < 0, torch.zeros_like(s), s)
        terms.append(w.cpu().float()[:, h, None] * r)
    while len(terms) > 1:  # pairwise head tree: ((t0 + t1) + (t2 + t3)) + ...
        terms = [terms[i] + terms[i + 1] for i in range(0, len(terms), 2)]
    return terms[0]


def float64_scores(q, k, kscale, w):
    qd, kd = q.cpu().double(), k.cpu().double()
    dots = torch.einsum("rhd,nd->rhn", qd, kd) * kscale.cpu().double()[None, None, :]
    return (w.cpu().double()[:, :, None] * dots.clamp_min(0)).sum(1)


def make_cache(num_pages, page, fp8_dtype, seed, layout="plain", pad=0, device="cpu"):
    """Random-byte cache (page stride padded by ``pad`` bytes) with every slot holding a valid
    entry: returns ``(kv_cache, codes [slots, 128] fp8, scales [slots])``."""
    stride = page * ENTRY_BYTES + pad
    buf = random_bytes_like((num_pages * stride,), "cpu", seed)
    kv = torch.as_strided(buf, (num_pages, page, ENTRY_BYTES), (stride, ENTRY_BYTES, 1))
    slots = num_pages * page
    codes = rand_codes((slots, 128), fp8_dtype, seed + 1)
    g = torch.Generator().manual_seed(seed + 2)
    scales = torch.exp2(torch.randint(-12, -2, (slots,), generator=g).float())
    scales[::5] *= 1.375  # also non-power-of-two scales (round_scale=False writers)
    write_entries(kv, torch.arange(slots), codes.view(torch.uint8), scales, layout)
    if device != "cpu":  # keep the padded page stride (``.to`` would make the view contiguous)
        kv = torch.as_strided(buf.to(device), kv.shape, kv.stride())
    return kv, codes, scales


def paged_keys(codes, scales, page_table_row, page, n):
    j = torch.arange(n)
    loc = page_table_row.long().cpu()[j // page] * page + j % page
    return codes[loc], scales[loc]


def weights(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * 0.05  # about half negative


# --------------------------------------------------------------------------------------------
# fp8 decode helper
# --------------------------------------------------------------------------------------------

@triton.jit
def _halves_all_kernel(code_ptr, lut_ptr, out_ptr, FNUZ: tl.constexpr, NATIVE_FP8: tl.constexpr):
    c = tl.load(code_ptr + tl.arange(0, 256))
    hi, lo, nan = _jit_fp8.fp8_halves(c, lut_ptr, FNUZ, NATIVE_FP8)
    i = tl.arange(0, 256)
    tl.store(out_ptr + i, hi.to(tl.int16, bitcast=True).to(tl.int32))
    tl.store(out_ptr + 256 + i, lo.to(tl.int16, bitcast=True).to(tl.int32))
    tl.store(out_ptr + 512 + i, nan.to(tl.int32))


@pytest.mark.parametrize("fp8_dtype", FP8)
def test_halves_table_all_codes(fp8_dtype):
    """The kernels' code -> fp16 halves table: hi + lo = value, hi a multiple of the step h,
    |lo| <= h / 2 a multiple of the unit, within the bounds ``_exact_dot`` relies on
    (|hi / h| <= 480, |lo / unit| <= 256); NaN codes give NaN halves."""
    fnuz = fp8_dtype == torch.float8_e4m3fnuz
    t = _jit_fp8.halves_table(fp8_dtype, "cpu")
    hi = (t & 0xFFFF).to(torch.int16).view(torch.float16).double()
    lo = (t >> 16).to(torch.int16).view(torch.float16).double()
    x = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8_dtype).double()
    nan = torch.isnan(x)
    assert torch.equal(torch.isnan(hi), nan) and torch.equal(torch.isnan(lo), nan)
    hi, lo, x = hi[~nan], lo[~nan], x[~nan]
    step, unit = _jit_fp8.half_step(fnuz), reference.fp8_int_table(fp8_dtype, "cpu")[2]
    assert step / unit == 512
    assert torch.equal(hi + lo, x)
    assert torch.equal(torch.round(hi / step), hi / step) and int((hi / step).abs().max()) <= 480
    assert torch.equal(torch.round(lo / unit), lo / unit) and float((lo / step).abs().max()) == 0.5


def _decoders(device, fp8_dtype):
    """The decoders the device can run: the table everywhere, the native conversion where the
    target has it (``_backend.has_native_fp8``; the interpreter has both formats)."""
    return [False] + ([True] if has_native_fp8(*device_target(device), fp8_dtype) else [])


@pytest.mark.parametrize("fp8_dtype", FP8)
def test_fp8_halves_kernel_all_codes(device, fp8_dtype):
    """Both decoders on the device give the table's halves for every code (fp16 bits; NaN
    positions and flags)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(device)
    table = _jit_fp8.halves_table(fp8_dtype, "cpu")
    nan = torch.isnan(codes.cpu().view(fp8_dtype).float())
    for native in _decoders(device, fp8_dtype):
        out = torch.empty(768, dtype=torch.int32, device=device)
        _halves_all_kernel[(1,)](codes, _jit_fp8.halves_table(fp8_dtype, device), out,
                                 FNUZ=fp8_dtype == torch.float8_e4m3fnuz, NATIVE_FP8=native)
        out = out.cpu()
        assert torch.equal(out[512:].bool(), nan), f"native={native}"
        for half, want in ((out[:256], table & 0xFFFF), (out[256:512], (table >> 16) & 0xFFFF)):
            assert torch.equal((half & 0xFFFF)[~nan], want[~nan]), f"native={native}"


@pytest.mark.parametrize("fp8_dtype", FP8)
def test_dot_exact_at_accumulator_bounds(backend, device, fp8_dtype):
    """Dots that fill ``_exact_dot``'s fp32 accumulators to their bounds with their low bits
    set (a truncating or reordered accumulation would change them), and dots of uniformly
    random codes (every magnitude, subnormals included): all bit for bit against the exact
    fp64 formulation. Query row ``t`` weights only head ``t``, so each logit is one dot."""
    m = float(torch.finfo(fp8_dtype).max)  # 448 / 240: |hi / h| = 448 / 480
    step = _jit_fp8.half_step(fp8_dtype == torch.float8_e4m3fnuz)
    heads, n_keys = 16, 64
    g = torch.Generator().manual_seed(7)
    finite = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    finite = finite[~torch.isnan(finite.view(fp8_dtype).float())]
    q = finite[torch.randint(0, len(finite), (heads, heads, 128), generator=g)].view(fp8_dtype).float()
    k = finite[torch.randint(0, len(finite), (n_keys, 128), generator=g)].view(fp8_dtype).float()
    full = torch.full((128,), m)
    q[0, 0], k[0] = full, full  # hi.hi at its bound in both 64-dim halves
    q[1, 1], k[1] = full, full
    k[1, 0] = k[1, 64] = q[1, 1, 0] = q[1, 1, 64] = step  # ... plus h^2 twice: bit 0 of each accumulator
    q[2, 2], k[2] = full, full * 0 + 1.5 * step  # lo_k.hi_q at its bound: 448 * (h / 2) * 128, one sign
    q[2, 2, 5], k[2, 5] = step, step / 2 ** 9  # ... plus h * u (the smallest subnormal): bit 0
    q[3, 3], k[3] = full * 0 + 1.5 * step, full  # hi_k.lo_q
    q[3, 3, 9], k[3, 9] = step / 2 ** 9, step
    q[4, 4], k[4] = full * 0 + 0.5 * step, full * 0 + 0.5 * step  # lo.lo: (h / 2)^2 * 128
    q[4, 4, 9] = k[4, 9] = step / 2 ** 9
    # ties at the top of the range (fp32 ulp 2 h^2 there): 127 m^2 + h^2 rounds to even (down),
    # 127 m^2 + 3 h^2 up to even, 126 m^2 + h^2 + u^2 (in lo.lo) up: one rounding of the whole sum
    for t, extra in ((5, 1), (6, 3), (7, 1)):
        q[t, t], k[t] = full, full
        q[t, t, 127], k[t, 127] = step, step * extra
    q[7, 7, 126] = k[7, 126] = step / 2 ** 9
    q, k = q.to(fp8_dtype), k.to(fp8_dtype)
    w = torch.eye(heads)
    ks = torch.zeros(heads, dtype=torch.int32)
    ke = torch.full((heads,), n_keys, dtype=torch.int32)
    out = ragged_pool_logits(q.to(device), k.to(device), torch.ones(n_keys, device=device), w.to(device),
                             ks.to(device), ke.to(device))
    want = exact_scores(q, k, torch.ones(n_keys), w[:, :, None].expand(heads, heads, 1)[..., 0])
    assert_same_f32(out, want, "exact dots at the accumulator bounds")
    assert float(want[0, 0]) == m * m * 128 and float(want[4, 4]) > 0 and float(want[2, 2]) > 0
    top = m * m * 127  # a multiple of 4 h^2 in [2^24, 2^25) h^2, ulp 2 h^2: the constructed ties
    assert [float(want[t, t]) for t in (5, 6, 7)] == [top, top + 4 * step ** 2, top - m * m + 2 * step ** 2]
    assert int((want > 0).sum()) > heads * n_keys // 4, "random dots: too few positive (relu hides the rest)"


# --------------------------------------------------------------------------------------------
# paged decode / verify
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("heads", [16, 32, 64])
@pytest.mark.parametrize("fp8_dtype", FP8)
def test_paged_matches_exact_and_float64(backend, device, heads, fp8_dtype):
    page, num_pages, batch, next_n = 16, 7, 2, 2
    kv, codes, scales = make_cache(num_pages, page, fp8_dtype, seed=heads, device=device)
    page_table = torch.tensor([[4, 0, 6], [2, 5, 1]], dtype=torch.int32)
    pool_lens = torch.tensor([[20, 21], [0, 33]], dtype=torch.int32)  # verify rows see one more pool
    q = rand_codes((batch, next_n, heads, 128), fp8_dtype, seed=heads + 5)
    w = weights((batch, next_n, heads), seed=heads + 6)
    out = paged_pool_logits(q.to(device), kv, w.to(device), pool_lens.to(device), page_table.to(device),
                            layout="plain", fp8_dtype=fp8_dtype)
    assert out.shape == (batch * next_n, 3 * page) and out.dtype == torch.float32
    want = reference.paged_pool_logits(q.view(torch.uint8), kv.cpu(), w, pool_lens, page_table, "plain",
                                       fp8_dtype, 3 * page)
    assert_same_f32(out, want, "paged logits vs reference")
    for b in range(batch):
        k, ks = paged_keys(codes, scales, page_table[b], page, 3 * page)
        exact = exact_scores(q[b], k, ks, w[b])
        f64 = float64_scores(q[b], k, ks, w[b])
        for t in range(next_n):
            n = int(pool_lens[b, t])
            row = out[b * next_n + t].cpu()
            assert_same_f32(row[:n], exact[t, :n], f"row {b},{t} vs exact formulation")
            assert bool(torch.isneginf(row[n:]).all()), "pools past pool_lens must be -inf"
            mag = (w[b, t].double().abs()[:, None] * torch.einsum(
                "hd,nd->hn", q[b, t].double(), k.double()).abs() * ks.double()).sum(0)
            assert bool(((row[:n].double() - f64[t, :n]).abs() <= 1e-6 * mag[:n] + 1e-30).all())


@pytest.mark.parametrize("layout", ["plain", "preshuffle"])
def test_paged_layouts_and_padded_stride(backend, device, layout):
    fp8_dtype = torch.float8_e4m3fn
    page, num_pages, heads = 16, 5, 16
    kv, codes, scales = make_cache(num_pages, page, fp8_dtype, seed=31, layout=layout, pad=64, device=device)
    assert kv.stride(0) == page * ENTRY_BYTES + 64
    page_table = torch.tensor([[3, 1, 4, -1], [0, 2, 2, 7]], dtype=torch.int32)  # stale ids past the lens
    pool_lens = torch.tensor([[40], [30]], dtype=torch.int32)
    q = rand_codes((2, 1, heads, 128), fp8_dtype, seed=32)
    w = weights((2, 1, heads), seed=33)
    import os
    os.environ["KPOOL_CHECK"] = "0"  # the stale page 7 would fail the host range check
    try:
        out = paged_pool_logits(q.to(device), kv, w.to(device), pool_lens.to(device), page_table.to(device),
                                layout=layout, fp8_dtype=fp8_dtype, max_pools=40)
    finally:
        del os.environ["KPOOL_CHECK"]
    assert out.shape == (2, 40)
    for b in range(2):
        k, ks = paged_keys(codes, scales, page_table[b].clamp_min(0), page, 40)
        n = int(pool_lens[b, 0])
        assert_same_f32(out[b, :n], exact_scores(q[b], k, ks, w[b])[0, :n], f"{layout} row {b}")
        assert bool(torch.isneginf(out[b, n:].cpu()).all())


def test_paged_max_pools_past_the_table(backend, device, monkeypatch):
    """``max_pools`` wider than ``max_pages * PAGE``: the columns no page can hold are -inf too
    (every column of the output is written)."""
    fp8_dtype = torch.float8_e4m3fn
    page, num_pages, heads = 16, 4, 16
    kv, codes, scales = make_cache(num_pages, page, fp8_dtype, seed=41, device=device)
    page_table = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)  # covers 32 pools
    pool_lens = torch.tensor([[32], [20]], dtype=torch.int32)
    q = rand_codes((2, 1, heads, 128), fp8_dtype, seed=42)
    w = weights((2, 1, heads), seed=43)
    monkeypatch.setattr(logits_mod, "torch", GarbageTorch())  # the output starts as garbage: unwritten columns show
    out = paged_pool_logits(q.to(device), kv, w.to(device), pool_lens.to(device), page_table.to(device),
                            fp8_dtype=fp8_dtype, max_pools=100).cpu()
    assert out.shape == (2, 100)
    for b in range(2):
        k, ks = paged_keys(codes, scales, page_table[b], page, 32)
        n = int(pool_lens[b, 0])
        assert_same_f32(out[b, :n], exact_scores(q[b], k, ks, w[b])[0, :n], f"row {b}")
        assert bool(torch.isneginf(out[b, n:]).all()), out[b, n:]


def test_paged_bad_page_scores_nan_and_is_rejected(backend, device, monkeypatch):
    fp8_dtype = torch.float8_e4m3fn
    page, heads = 16, 16
    kv, codes, scales = make_cache(3, page, fp8_dtype, seed=41, device=device)
    page_table = torch.tensor([[1, -1, 9]], dtype=torch.int32, device=device)
    pool_lens = torch.tensor([[40]], dtype=torch.int32, device=device)
    q = rand_codes((1, 1, heads, 128), fp8_dtype, seed=42).to(device)
    w = weights((1, 1, heads), seed=43).to(device)
    with pytest.raises(ValueError, match="page_table"):
        paged_pool_logits(q, kv, w, pool_lens, page_table, layout="plain", fp8_dtype=fp8_dtype)
    monkeypatch.setenv("KPOOL_CHECK", "0")
    out = paged_pool_logits(q, kv, w, pool_lens, page_table, layout="plain", fp8_dtype=fp8_dtype).cpu()
    assert out.shape == (1, 48)
    assert not bool(torch.isnan(out[0, :16]).any())
    assert bool(torch.isnan(out[0, 16:40]).all()), "visible pools on pages -1 / 9 must score NaN"
    assert bool(torch.isneginf(out[0, 40:]).all())


@pytest.mark.parametrize("bad", [-1, 3, 2**32 + 1, -(2**32)])
def test_paged_tile_bad_int64_page_scores_nan(backend, device, monkeypatch, bad):
    """Tiles that lie in one page (PAGE % BLOCK_POOLS == 0) take their page id from the ids
    loaded before the loop: an int64 id outside [0, num_pages) must score NaN, also one whose
    low 32 bits name a valid page (2^32 + 1 -> 1, -2^32 -> 0), in the logits op and in the
    fused scorer (whose NaN pools rank last)."""
    fp8_dtype = torch.float8_e4m3fn
    page, heads = 64, 16
    kv, _, _ = make_cache(3, page, fp8_dtype, seed=44, device=device)
    page_table = torch.tensor([[2, bad, 0]], dtype=torch.int64, device=device)
    pool_lens = torch.tensor([[150]], dtype=torch.int32, device=device)
    q = rand_codes((1, 1, heads, 128), fp8_dtype, seed=45).to(device)
    w = weights((1, 1, heads), seed=46).to(device)
    monkeypatch.setenv("KPOOL_CHECK", "0")
    out = paged_pool_logits(q, kv, w, pool_lens, page_table, layout="plain", fp8_dtype=fp8_dtype).cpu()
    assert not bool(torch.isnan(out[0, :64]).any()) and not bool(torch.isnan(out[0, 128:150]).any())
    assert bool(torch.isnan(out[0, 64:128]).all()), f"pools on page id {bad} must score NaN"
    picked = paged_pool_topk(q, kv, w, pool_lens, page_table, 80, layout="plain", fp8_dtype=fp8_dtype).cpu()
    assert not bool(((picked >= 64) & (picked < 128)).any()), "NaN pools must rank below every other pool"


def test_relu_per_head_before_weighting(backend, device):
    """Head 0: positive dot, head 1: negative dot, w = (+1, -1, 0, ...).

    Right: w0 * relu(d0) + w1 * relu(d1) = d0 * ks. Relu after weighting would give
    relu(d0 - d1) = (d0 - d1) * ks; no relu gives the same; both are larger.
    """
    fp8_dtype = torch.float8_e4m3fn
    heads, page = 16, 16
    kv = torch.zeros(1, page, ENTRY_BYTES, dtype=torch.uint8)
    key = torch.zeros(page, 128)
    key[:, :4] = 1.0
    write_entries(kv, torch.arange(page), key.to(fp8_dtype).view(torch.uint8), torch.full((page,), 0.5), "plain")
    q = torch.zeros(1, 1, heads, 128)
    q[0, 0, 0, :4] = 2.0   # d0 = 8
    q[0, 0, 1, :4] = -4.0  # d1 = -16
    q[0, 0, 2:, :4] = 1.0  # positive dots on zero-weight heads
    w = torch.zeros(1, 1, heads)
    w[0, 0, 0], w[0, 0, 1] = 1.0, -1.0
    out = paged_pool_logits(q.to(fp8_dtype).to(device), kv.to(device), w.to(device),
                            torch.tensor([[3]], dtype=torch.int32, device=device),
                            torch.zeros(1, 1, dtype=torch.int32, device=device),
                            layout="plain", fp8_dtype=fp8_dtype).cpu()
    assert out[0, :3].tolist() == [4.0, 4.0, 4.0]
    # a negative head weight on a positive dot makes the logit negative
    w[0, 0, 0] = -0.25
    out = paged_pool_logits(q.to(fp8_dtype).to(device), kv.to(device), w.to(device),
                            torch.tensor([[1]], dtype=torch.int32, device=device),
                            torch.zeros(1, 1, dtype=torch.int32, device=device),
                            layout="plain", fp8_dtype=fp8_dtype).cpu()
    assert out[0, 0].item() == -1.0


def test_relu_keeps_negative_zero(backend, device):
    """Step 2 is ``r = 0 if s < 0 else s``: ``s = -0.0`` (a -0.0 or negative key scale times a
    zero or positive dot) stays -0.0, so with positive head weights the logit is -0.0 bit for bit."""
    fp8_dtype = torch.float8_e4m3fn
    heads, page = 16, 16
    kv = torch.zeros(1, page, ENTRY_BYTES, dtype=torch.uint8)
    key = torch.zeros(page, 128)
    key[:, :4] = 1.0
    key[1] = 0.0  # zero dot
    scales = torch.tensor([-0.0, -0.25, 0.5, -0.5] + [0.5] * (page - 4))
    write_entries(kv, torch.arange(page), key.to(fp8_dtype).view(torch.uint8), scales, "plain")
    q = torch.zeros(1, 1, heads, 128)
    q[0, 0, :, :4] = 2.0  # every head's dot is 8 (0 on pool 1)
    w = torch.full((1, 1, heads), 0.125)
    out = paged_pool_logits(q.to(fp8_dtype).to(device), kv.to(device), w.to(device),
                            torch.tensor([[4]], dtype=torch.int32, device=device),
                            torch.zeros(1, 1, dtype=torch.int32, device=device),
                            layout="plain", fp8_dtype=fp8_dtype).cpu()
    want = exact_scores(q.to(fp8_dtype)[0], key.to(fp8_dtype)[:4], scales[:4], w[0])[0]
    assert [str(v) for v in want.tolist()] == ["-0.0", "-0.0", "8.0", "0.0"]
    assert_same_f32(out[0, :4], want, "relu of -0.0")


def test_dot_is_exact_sum_rounded_once(backend, device):
    """448*448 + 127 * (2^-4 * 2^-4) = 200704.49609375: one rounding gives 200704.5 (ulp
    2^-6); fp32 accumulation in index order would give 200704 (each 2^-8 is lost)."""
    fp8_dtype = torch.float8_e4m3fn
    q = torch.zeros(1, 16, 128)
    q[0, 0, 0], q[0, 0, 1:] = 448.0, 2.0 ** -4
    k = q[0, :1].clone()
    w = torch.zeros(1, 16)
    w[0, 0] = 1.0
    j = torch.zeros(1, dtype=torch.int32)
    out = ragged_pool_logits(q.to(fp8_dtype).to(device), k.to(fp8_dtype).to(device), torch.ones(1, device=device),
                             w.to(device), j.to(device), (j + 1).to(device))
    assert out.item() == 200704.5
    naive = torch.zeros((), dtype=torch.float32)
    for x in (q[0, 0] * k[0]).tolist():
        naive = naive + torch.tensor(x, dtype=torch.float32)
    assert naive.item() == 200704.0  # the trap this formulation avoids


def test_fnuz_codes_use_fnuz_values(backend, device):
    """The same code bytes mean half the value in e4m3fnuz (bias 8): logits scale by 1/4."""
    page, heads = 16, 16
    kv, codes, scales = make_cache(1, page, torch.float8_e4m3fn, seed=51, device=device)
    q = rand_codes((1, 1, heads, 128), torch.float8_e4m3fn, seed=52)
    w = weights((1, 1, heads), seed=53).abs()
    args = (kv, w.to(device), torch.tensor([[16]], dtype=torch.int32, device=device),
            torch.zeros(1, 1, dtype=torch.int32, device=device))
    fn = paged_pool_logits(q.view(torch.uint8).to(device), *args, layout="plain", fp8_dtype=torch.float8_e4m3fn)
    nuz = paged_pool_logits(q.view(torch.uint8).to(device), *args, layout="plain", fp8_dtype=torch.float8_e4m3fnuz)
    # random codes hold neither format's NaN (0x7F/0xFF are never produced, 0x80 = -0.0 is)
    has_nuz_nan = bool((q.view(torch.uint8) == 0x80).any()) or bool((codes.view(torch.uint8)[:16] == 0x80).any())
    if has_nuz_nan:
        assert bool(torch.isnan(nuz).any())
    else:
        assert_same_f32(nuz, fn * 0.25, "fnuz = fn / 4")


def test_paged_validation(backend, device):
    fp8_dtype = torch.float8_e4m3fn
    kv, _, _ = make_cache(2, 16, fp8_dtype, seed=61, device=device)
    q = rand_codes((1, 2, 16, 128), fp8_dtype, seed=62).to(device)
    w = weights((1, 2, 16), seed=63).to(device)
    lens = torch.tensor([[5, 6]], dtype=torch.int32, device=device)
    pt = torch.tensor([[0, 1]], dtype=torch.int32, device=device)
    call = lambda **kw: paged_pool_logits(**{**dict(q_fp8=q, kv_cache=kv, weights=w, pool_lens=lens,  # noqa: E731
                                                    page_table=pt, layout="plain"), **kw})
    assert call().shape == (2, 32)
    with pytest.raises(ValueError, match="H in"):
        call(q_fp8=q[:, :, :8], weights=w[:, :, :8])
    with pytest.raises(TypeError, match="q_fp8"):
        call(q_fp8=q.float())
    with pytest.raises(TypeError, match="q_fp8 must be a torch.Tensor"):
        call(q_fp8=None)
    with pytest.raises(ValueError, match="q_fp8"):
        call(q_fp8=q[..., :64])
    with pytest.raises(TypeError, match="fp8 formats disagree"):
        call(fp8_dtype=torch.float8_e4m3fnuz)
    with pytest.raises(ValueError, match="weights"):
        call(weights=w[:, :1])
    with pytest.raises(TypeError, match="weights"):
        call(weights=w.double())
    with pytest.raises(ValueError, match="pool_lens"):
        call(pool_lens=lens[:, :1])
    with pytest.raises(ValueError, match="pool_lens"):
        call(max_pools=5)  # a row sees 6 pools
    with pytest.raises(ValueError, match="pool_lens"):
        call(pool_lens=lens + 30)  # more than the page table covers
    with pytest.raises(ValueError, match="page_table"):
        call(page_table=pt.expand(2, 2))
    with pytest.raises(ValueError, match="max_pools"):
        call(max_pools=-1)
    with pytest.raises(ValueError, match="kv_cache"):
        call(kv_cache=kv[:, :, :128])
    with pytest.raises(ValueError, match="layout"):
        call(layout="tiled")


# --------------------------------------------------------------------------------------------
# ragged prefill
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("heads", [16, 32, 64])
@pytest.mark.parametrize("fp8_dtype", FP8)
def test_ragged_matches_exact_and_float64(backend, device, heads, fp8_dtype):
    n_q, n_keys = 4, 45
    q = rand_codes((n_q, heads, 128), fp8_dtype, seed=heads + 70)
    k = rand_codes((n_keys, 128), fp8_dtype, seed=heads + 71)
    g = torch.Generator().manual_seed(heads + 72)
    ksc = torch.exp2(torch.randint(-10, -3, (n_keys,), generator=g).float())
    w = weights((n_q, heads), seed=heads + 73)
    ks = torch.tensor([0, 3, 10, 36], dtype=torch.int32)
    ke = torch.tensor([45, 3, 30, 44], dtype=torch.int32)  # row 1: empty window
    out = ragged_pool_logits(q.to(device), k.to(device), ksc.to(device), w.to(device), ks.to(device), ke.to(device))
    assert out.shape == (n_q, n_keys)
    want = reference.ragged_pool_logits(q.view(torch.uint8), k.view(torch.uint8), ksc, w, ks, ke, fp8_dtype)
    assert_same_f32(out, want, "ragged logits vs reference")
    exact = exact_scores(q, k, ksc, w)
    f64 = float64_scores(q, k, ksc, w)
    mag = (w.double().abs()[:, :, None] * torch.einsum("rhd,nd->rhn", q.double(), k.double()).abs()
           * ksc.double()).sum(1)
    j = torch.arange(n_keys)
    vis = (j[None] >= ks[:, None]) & (j[None] < ke[:, None])
    out = out.cpu()
    assert_same_f32(out[vis], exact[vis], "ragged vs exact formulation")
    assert bool(torch.isneginf(out[~vis]).all())
    assert bool(((out[vis].double() - f64[vis]).abs() <= 1e-6 * mag[vis] + 1e-30).all())


def test_ragged_spans_and_tiles(backend, device):
    """Windows against the kernel's spans (``RAGGED_TILES`` tiles of ``RAGGED_TILE`` pools per
    program): spans wholly outside a window, windows starting and ending inside a tile, a
    last partial span, one-pool and empty windows."""
    fp8_dtype, heads = torch.float8_e4m3fn, 16
    span = RAGGED_TILE * RAGGED_TILES
    n_keys = 2 * span + 176  # last span partial
    q = rand_codes((6, heads, 128), fp8_dtype, seed=91)
    k = rand_codes((n_keys, 128), fp8_dtype, seed=92)
    ksc = torch.exp2(torch.randint(-10, -3, (n_keys,), generator=torch.Generator().manual_seed(93)).float())
    w = weights((6, heads), seed=94)
    ks = torch.tensor([0, span + 88, n_keys - 100, 5, n_keys - 1, 300])
    ke = torch.tensor([n_keys, span + 190, n_keys - 50, 6, n_keys, 300])
    out = ragged_pool_logits(q.to(device), k.to(device), ksc.to(device), w.to(device), ks.to(device), ke.to(device))
    want = reference.ragged_pool_logits(q.view(torch.uint8), k.view(torch.uint8), ksc, w, ks, ke, fp8_dtype)
    assert_same_f32(out, want, "ragged logits vs reference")
    assert int(torch.isfinite(want).sum(1)[5]) == 0 and int(torch.isfinite(want).sum(1)[3]) == 1
    # strided windows (every other entry of a longer tensor): the same rows
    ks2, ke2 = (torch.stack([t, t.flip(0)], 1).to(device)[:, 0] for t in (ks, ke))
    assert ks2.stride(0) == 2 and ke2.stride(0) == 2
    out = ragged_pool_logits(q.to(device), k.to(device), ksc.to(device), w.to(device), ks2, ke.to(device))
    assert_same_f32(out, want, "ragged logits, strided ks")
    out = ragged_pool_logits(q.to(device), k.to(device), ksc.to(device), w.to(device), ks.to(device), ke2)
    assert_same_f32(out, want, "ragged logits, strided ke")


def test_ragged_uint8_codes_scale_column_and_nan_codes(backend, device):
    fp8_dtype = torch.float8_e4m3fnuz
    heads, n_keys = 32, 20
    q = rand_codes((3, heads, 128), fp8_dtype, seed=81)
    k = rand_codes((n_keys, 128), fp8_dtype, seed=82)
    k.view(torch.uint8)[5, 17] = 0x80  # the fnuz NaN code
    q.view(torch.uint8)[2, 3, 0] = 0x80  # one NaN code in one head of query 2
    ksc = torch.full((n_keys, 1), 2.0 ** -6)
    w = weights((3, heads), seed=83)
    ks = torch.zeros(3, dtype=torch.int64)
    ke = torch.full((3,), n_keys, dtype=torch.int64)
    out = ragged_pool_logits(q.view(torch.uint8).to(device), k.view(torch.uint8).to(device), ksc.to(device),
                             w.to(device), ks.to(device), ke.to(device), fp8_dtype=fp8_dtype).cpu()
    nan = torch.isnan(out)
    assert bool(nan[:, 5].all()) and bool(nan[2].all())
    assert int(nan.sum()) == 3 + n_keys - 1
    q.view(torch.uint8)[2, 3, 0] = 0
    k.view(torch.uint8)[5, 17] = 0
    ok = ~nan
    assert_same_f32(out[ok], exact_scores(q, k, ksc.reshape(-1), w)[ok], "non-NaN logits")


def test_ragged_validation(backend, device):
    fp8_dtype = torch.float8_e4m3fn
    q = rand_codes((2, 16, 128), fp8_dtype, seed=91).to(device)
    k = rand_codes((10, 128), fp8_dtype, seed=92).to(device)
    ksc = torch.ones(10, device=device)
    w = weights((2, 16), seed=93).to(device)
    ks = torch.zeros(2, dtype=torch.int32, device=device)
    ke = torch.full((2,), 10, dtype=torch.int32, device=device)
    call = lambda **kw: ragged_pool_logits(**{**dict(q_fp8=q, k_codes=k, k_scale=ksc, weights=w,  # noqa: E731
                                                     ks=ks, ke=ke), **kw})
    assert call().shape == (2, 10)
    with pytest.raises(ValueError, match="H in"):
        call(q_fp8=q[:, :12], weights=w[:, :12])
    with pytest.raises(TypeError, match="fp8 formats disagree"):
        call(k_codes=k.view(torch.uint8).view(torch.float8_e4m3fnuz))
    with pytest.raises(ValueError, match="k_codes"):
        call(k_codes=k[:, :64])
    with pytest.raises(ValueError, match="k_scale"):
        call(k_scale=ksc[:9])
    with pytest.raises(TypeError, match="k_scale"):
        call(k_scale=ksc.half())
    with pytest.raises(ValueError, match="weights"):
        call(weights=w[:1])
    with pytest.raises(ValueError, match="ks"):
        call(ks=ks - 1)
    with pytest.raises(ValueError, match="ke"):
        call(ke=ke + 1)
    with pytest.raises(TypeError, match="ke"):
        call(ke=ke.float())


@pytest.mark.parametrize("op", ["paged", "ragged"])
def test_value_checks_read_back_once(op, device, monkeypatch):
    """The value checks of a scoring call (pool_lens and page_table maxima; ks / ke) cost the host
    one read-back together: counted up to the scoring, which is stubbed out."""
    monkeypatch.setenv("KPOOL_BACKEND", "torch")
    fp8_dtype = torch.float8_e4m3fn
    calls = []
    monkeypatch.setattr(logits_mod.reference, f"{op}_pool_logits", lambda *a, **k: calls.append(a))
    if op == "paged":
        kv, _, _ = make_cache(2, 16, fp8_dtype, seed=61, device=device)
        args = dict(q_fp8=rand_codes((1, 2, 16, 128), fp8_dtype, seed=62).to(device), kv_cache=kv,
                    weights=weights((1, 2, 16), seed=63).to(device), layout="plain",
                    pool_lens=torch.tensor([[5, 6]], dtype=torch.int32, device=device),
                    page_table=torch.tensor([[0, 1]], dtype=torch.int32, device=device))
    else:
        args = dict(q_fp8=rand_codes((2, 16, 128), fp8_dtype, seed=91).to(device),
                    k_codes=rand_codes((10, 128), fp8_dtype, seed=92).to(device),
                    k_scale=torch.ones(10, device=device), weights=weights((2, 16), seed=93).to(device),
                    ks=torch.zeros(2, dtype=torch.int32, device=device), ke=torch.full((2,), 10, device=device))
    with ReadBacks() as mode:
        (paged_pool_logits if op == "paged" else ragged_pool_logits)(**args)
    assert mode.reads == ["tolist"] and len(calls) == 1


def test_empty_inputs(backend, device):
    """No rows, no pools, or no pages: correctly shaped results (-inf where rows see nothing)."""
    fp8 = torch.float8_e4m3fn
    kv, _, _ = make_cache(2, 64, fp8, seed=3, device=device)
    heads = 16

    def paged(batch, max_pages, max_pools=None):
        q = rand_codes((batch, 2, heads, 128), fp8, seed=4).to(device)
        w = weights((batch, 2, heads), seed=5).to(device)
        lens = torch.zeros((batch, 2), dtype=torch.int32, device=device)
        pt = torch.zeros((batch, max_pages), dtype=torch.int32, device=device)
        return paged_pool_logits(q, kv, w, lens, pt, max_pools=max_pools)

    assert paged(0, 2).shape == (0, 128)
    assert paged(3, 2, max_pools=0).shape == (6, 0)
    no_pages = paged(3, 0, max_pools=5)  # nothing is visible: every logit is -inf
    assert torch.equal(no_pages.cpu(), torch.full((6, 5), float("-inf")))
    for n_q, n_keys in ((0, 7), (5, 0)):
        q = rand_codes((n_q, heads, 128), fp8, seed=6).to(device)
        k = rand_codes((n_keys, 128), fp8, seed=7).to(device)
        zero = torch.zeros((n_q,), dtype=torch.int32, device=device)
        got = ragged_pool_logits(q, k, torch.ones(n_keys, device=device), weights((n_q, heads), seed=8).to(device),
                                 zero, zero)
        assert got.shape == (n_q, n_keys) and got.dtype == torch.float32
