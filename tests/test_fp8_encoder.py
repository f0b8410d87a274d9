"""fp8 encoder choice (``KPOOL_FP8_ENCODER``, issue 6): software and native give the same bytes.

The three Triton writers (compress + write, decode update, query rotate + quant) run with
``KPOOL_FP8_ENCODER=software`` (integer ops, ``_jit.fp8_encode``) and ``=native``
(Triton's conversion, ``_jit.fp8_encode_native``; in the CPU interpreter through kpool's
exact downcasts), for both fp8 formats and both scale rules, on inputs that stress the
encoder: magnitudes from 2^-40 to 2^40 between and inside rows (codes from fp8
subnormals to ±FP8_MAX, rows under the 1e-4 amax floor) and rows with a NaN key / query
(the Hadamard rotation spreads it over the whole row: scale from the 1e-4 floor, every
code NaN). Caches are pre-filled with random bytes and compared WHOLE, byte for byte, with
the torch reference (``kpool.reference`` / ``kpool.numerics``). A spy on the two encoders
checks that each run really took the path it names.

The scorers decode fp8 by the same choice (``software``: the halves table; ``native``: the
conversion): paged and ragged logits and the fused ``paged_pool_topk`` on keys and queries
holding every code of the format, NaN codes included, against the reference.

The writers' quotients ``y / scale`` never pass FP8_MAX (fp32(1/FP8_MAX) rounds up for
448 and 240, and ue8m0 scales only grow), so the encoders' saturation is tested on raw
fp32 values, for both encoders, in test_numerics.py (``test_fp8_encode_matches_torch``).
"""

from __future__ import annotations

import pytest
import torch

from _util import assert_bytes_equal, make_tail, random_bytes_like, view_tail
from kpool import _backend, numerics, reference
from kpool import kpool_compress_and_write_cache, kpool_decode_update_and_maybe_write_cache_batched
from kpool.layout import fp8_max, read_entries, ring_size, write_entries
from kpool.ops import _jit
from kpool.ops.logits import decode_args, paged_pool_logits, ragged_pool_logits
from kpool.ops.quant import fwht128_quant_fp8
from kpool.ops.score import paged_pool_topk

FP8 = {"e4m3fn": torch.float8_e4m3fn, "e4m3fnuz": torch.float8_e4m3fnuz}
LAYOUT = {"e4m3fn": "plain", "e4m3fnuz": "preshuffle"}  # each format with its platform's layout
ENCODERS = ("software", "native")
F32 = torch.float32


# --------------------------------------------------------------------------- the choice

def test_fp8_encoder_env(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv(_backend.FP8_ENCODER_ENV, raising=False)
    assert _backend.FP8_ENCODERS == ("auto", "software", "native")
    assert _backend.fp8_encoder() == "auto"
    for fp8 in FP8.values():  # auto (default): native where the target has it; the interpreter has both
        assert bool(_backend.native_fp8(cpu, fp8)) is _backend.interpreting()
    for value, want in (("", "auto"), (" Native ", "native"), ("SOFTWARE", "software"), ("auto", "auto")):
        monkeypatch.setenv(_backend.FP8_ENCODER_ENV, value)
        assert _backend.fp8_encoder() == want
    monkeypatch.setenv(_backend.FP8_ENCODER_ENV, "software")
    assert not any(_backend.native_fp8(cpu, fp8) for fp8 in FP8.values())
    monkeypatch.setenv(_backend.FP8_ENCODER_ENV, "native")
    assert all(bool(_backend.native_fp8(cpu, fp8)) is _backend.interpreting() for fp8 in FP8.values())
    monkeypatch.setenv(_backend.FP8_ENCODER_ENV, "hardware")
    with pytest.raises(ValueError, match="KPOOL_FP8_ENCODER must be one of .*'hardware'"):
        _backend.native_fp8(cpu, torch.float8_e4m3fn)


def test_native_fp8_table():
    """Which target converts which format natively (the one table: run time and AOT)."""
    fn, fnuz = torch.float8_e4m3fn, torch.float8_e4m3fnuz
    has = _backend.has_native_fp8
    assert [has("cuda", cc, fn) for cc in (80, 86, 89, 90, 100, 120)] == [False, False, True, True, True, True]
    assert not any(has("cuda", cc, fnuz) for cc in (80, 90, 100))  # CUDA has no fnuz conversion
    assert has("hip", "gfx942", fnuz) and not has("hip", "gfx942", fn)
    assert has("hip", "gfx950", fn) and not has("hip", "gfx950", fnuz)
    assert has("hip", "gfx942:sramecc+:xnack-", fnuz)  # gcnArchName carries feature suffixes
    assert not has("hip", "gfx90a", fn) and not has("hip", "gfx90a", fnuz)
    assert has("interpreter", None, fn) and has("interpreter", None, fnuz)
    with pytest.raises(ValueError, match="backend"):
        has("metal", 1, fn)
    with pytest.raises(ValueError, match="fp8_dtype"):
        has("cuda", 90, torch.float8_e5m2)


def test_native_fp8_on_this_device(monkeypatch, device):
    monkeypatch.delenv(_backend.FP8_ENCODER_ENV, raising=False)
    dev = torch.device(device)
    for fp8 in FP8.values():
        if dev.type == "cpu":
            want = _backend.FP8_CONVERSION if _backend.interpreting() else 0
        elif torch.version.hip is not None:
            has = _backend.has_native_fp8("hip", torch.cuda.get_device_properties(dev).gcnArchName, fp8)
            want = _backend.FP8_CONVERSION if has else 0
        else:
            has = fp8 == torch.float8_e4m3fn and torch.cuda.get_device_capability(dev) >= (8, 9)
            want = _backend.FP8_SATFINITE if has else 0
        assert _backend.native_fp8(dev, fp8) == want


def test_native_fp8_modes():
    """The conversion alone (``FP8_SATFINITE``) on CUDA targets with the conversion, clamp and
    NaN select elsewhere, 0 without one."""
    fn, fnuz = torch.float8_e4m3fn, torch.float8_e4m3fnuz
    mode = _backend.native_fp8_mode
    assert mode("cuda", 90, fn) == mode("cuda", 100, fn) == _backend.FP8_SATFINITE
    assert mode("cuda", 80, fn) == mode("cuda", 90, fnuz) == 0
    assert mode("hip", "gfx950", fn) == mode("hip", "gfx942", fnuz) == _backend.FP8_CONVERSION
    assert mode("interpreter", None, fn) == _backend.FP8_CONVERSION and mode("hip", "gfx90a", fn) == 0


# --------------------------------------------------------------------------- writers

@pytest.fixture
def encoder_spy(monkeypatch):
    """Counts calls of ``_jit.fp8_encode`` / ``_jit.fp8_encode_native`` (interpreter only:
    compiled kernels inline them at compile time)."""
    calls = {"software": 0, "native": 0}
    if not _backend.interpreting():
        return None
    for name, key in (("fp8_encode", "software"), ("fp8_encode_native", "native")):
        orig = getattr(_jit, name)

        def spy(*args, _orig=orig, _key=key, **kw):
            calls[_key] += 1
            return _orig(*args, **kw)

        monkeypatch.setattr(_jit, name, spy)
    return calls


def _use(monkeypatch, encoder):
    monkeypatch.setenv("KPOOL_BACKEND", "triton")
    monkeypatch.setenv(_backend.FP8_ENCODER_ENV, encoder)


def _check_spy(spy, encoder, fp8):
    if spy is None:
        return
    used = {k for k, v in spy.items() if v}
    want = encoder if encoder == "software" or _backend.native_fp8(torch.device("cpu"), fp8) else "software"
    assert used == {want}, spy
    spy.update(software=0, native=0)


def _hadamard_row(j):
    i = torch.arange(128)
    parity = torch.zeros(128, dtype=torch.int64)
    for b in range(7):
        parity ^= ((i & j) >> b) & 1
    return 1.0 - 2.0 * parity.float()


def _wide_bf16(shape, gen, amp=None):
    """bf16 ``[*shape, 128]`` rows ``A * ((h_j + h_k) / 2 + noise)``: ``h`` two fixed Hadamard
    rows (the rotation turns them into two spikes), noise 2^-[1, 16] only in the 64 dims
    where ``(h_j + h_k) / 2`` is 0, ``A = amp`` (powers of two broadcast to ``[*shape, 1]``;
    default 2^[-40, 40] per row). A pool of rows with one ``A`` keeps that form exactly, so
    rotated rows span up to 2^15 in magnitude: codes from ±FP8_MAX down to fp8 subnormals."""
    base = (_hadamard_row(37) + _hadamard_row(90)) / 2  # 0 or ±1
    noise = torch.randn(*shape, 128, generator=gen) * torch.exp2(-torch.randint(1, 17, (*shape, 1), generator=gen).float())
    amp = _amplitudes((*shape, 1), gen) if amp is None else amp
    return (torch.where(base == 0, noise, base) * amp).to(torch.bfloat16)


def _amplitudes(shape, gen, spread=40):
    return torch.exp2(torch.randint(-spread, spread + 1, shape, generator=gen).float())


def _check_range(codes, fp8, round_scale):
    """The codes reach fp8 subnormals (exponent 0) and, with linear scales (``amax`` maps
    to FP8_MAX), ``±FP8_MAX``."""
    c = codes.view(torch.uint8).cpu()
    finite = ~torch.isnan(c.view(fp8).float())
    sub = ((c & 0x78) == 0) & ((c & 0x07) != 0)
    assert bool((sub & finite).any()), "no subnormal codes: the inputs' range is too narrow"
    if not round_scale:
        assert bool((c.view(fp8).float().abs() == fp8_max(fp8)).any()), "no code at FP8_MAX"


def _nan_codes(fp8):
    """Every NaN code of the format (the encoders write only the first, the canonical one)."""
    return torch.tensor([0x80] if fp8 == torch.float8_e4m3fnuz else [0x7F, 0xFF], dtype=torch.uint8)


@pytest.mark.parametrize("encoder", ENCODERS)
@pytest.mark.parametrize("fmt", list(FP8))
def test_compress_and_write(monkeypatch, encoder_spy, device, encoder, fmt):
    fp8, layout, pool, page, n = FP8[fmt], LAYOUT[fmt], 4, 32, 40
    gen = torch.Generator().manual_seed(11 + len(fmt))
    nan_pools = (3, 17)
    k = _wide_bf16((n, pool), gen, amp=_amplitudes((n, 1, 1), gen))  # one amplitude per pool
    k[nan_pools[0], 2, 7] = float("nan")  # a NaN key: that pool's vector, then its rotated row, is NaN
    k[nan_pools[1], 0, 100] = -float("nan")
    s = (torch.randn(n, pool, 128, generator=gen) * 2).to(torch.bfloat16)
    ape = torch.randn(pool, 128, generator=gen)
    num_pages = 3
    loc = torch.randperm(num_pages * page, generator=gen)[:n]
    loc[[5, 30]] = -1
    _use(monkeypatch, encoder)
    for round_scale in (True, False):
        want = random_bytes_like((num_pages, page, 132), "cpu", seed=int(round_scale))
        buf = want.clone().to(device)
        w_codes, w_scale = reference.compress_and_write(want, k, s, ape, loc, None, fp8, layout, round_scale, True)
        codes, scale = kpool_compress_and_write_cache(buf, k.to(device), s.to(device), ape.to(device), loc.to(device),
                                                      pool, round_scale=round_scale, return_compressed=True,
                                                      layout=layout, fp8_dtype=fp8)
        _check_spy(encoder_spy, encoder, fp8)
        assert_bytes_equal(buf, want, f"cache ({encoder}, {fmt}, round_scale={round_scale})")
        assert_bytes_equal(codes.view(torch.uint8), w_codes.view(torch.uint8), f"codes ({encoder}, {fmt})")
        assert_bytes_equal(scale, w_scale, f"scales ({encoder}, {fmt})")
        _check_range(w_codes, fp8, round_scale)
        # the NaN rows (one key +NaN, one -NaN): every code the canonical NaN code, the scale the 1e-4 floor's
        for r in nan_pools:
            assert bool((codes[r].view(torch.uint8).cpu() == _nan_codes(fp8)[0]).all())
        floor = numerics.quant_scale(torch.tensor([1e-4]), fp8, round_scale)
        assert torch.equal(scale[list(nan_pools)].cpu(), floor.expand(2))


@pytest.mark.parametrize("encoder", ENCODERS)
@pytest.mark.parametrize("fmt", list(FP8))
def test_decode_update(monkeypatch, encoder_spy, device, encoder, fmt):
    fp8, layout, pool, page = FP8[fmt], LAYOUT[fmt], 4, 32
    ring, num_req, next_n = ring_size(pool, 1), 8, 3
    gen = torch.Generator().manual_seed(29 + len(fmt))
    # request b decodes positions start_b .. start_b + 2: most requests complete a pool
    start = torch.randint(0, 40, (num_req, 1), generator=gen)
    start[4], start[6] = 7, 11  # both complete a pool with their first token (positions 7 and 11)
    positions = start + torch.arange(next_n)
    positions[1, 2] = -1  # padding
    blocks = torch.randperm(num_req + 2, generator=gen)[:num_req]
    tail_slots = torch.where(positions >= 0, blocks[:, None] * ring + positions % ring, -1)
    num_pages = 2
    slots = torch.randperm(num_pages * page, generator=gen)[: num_req * next_n].view(num_req, next_n)
    slots = torch.where((positions + 1) % pool == 0, slots, -1)
    assert int((slots >= 0).sum()) >= 6
    amp = _amplitudes((num_req + 2, 1, 1, 1), gen)  # one amplitude per request (ring block)
    key = _wide_bf16((num_req, next_n), gen, amp=amp[blocks, 0])
    key[4, 0, 5] = float("nan")  # a NaN in the completing token of request 4
    gate = (torch.randn(num_req, next_n, 128, generator=gen) * 2).to(torch.bfloat16)
    ape = torch.randn(pool, 128, generator=gen)
    tail_base, tail = make_tail(num_req + 2, ring, "cpu", seed=5)
    tail[:, 0] = _wide_bf16((num_req + 2, ring), gen, amp=amp[:, 0])
    tail[:, 1] = (torch.randn(num_req + 2, ring, 128, generator=gen) * 2).to(torch.bfloat16)
    tail[blocks[6], 0, 10 % ring, 3] = float("nan")  # a NaN ring key (position 10) of request 6's pool
    nan_slots = slots[[4, 6], 0]
    _use(monkeypatch, encoder)
    for round_scale in (True, False):
        kv = random_bytes_like((num_pages, page, 132), "cpu", seed=7 + int(round_scale))
        kv_want, tail_want = kv.clone(), tail_base.clone()
        reference.decode_update(kv_want, view_tail(tail_want, num_req + 2, ring), tail_slots, key, gate, ape, slots,
                                positions, pool, fp8, layout, round_scale)
        kv_dev, tail_dev = kv.clone().to(device), tail_base.clone().to(device)
        kpool_decode_update_and_maybe_write_cache_batched(
            kv_dev, view_tail(tail_dev, num_req + 2, ring), tail_slots.to(device), key.to(device), gate.to(device),
            ape.to(device), slots.to(device), positions.to(device), pool, round_scale=round_scale, layout=layout,
            fp8_dtype=fp8)
        _check_spy(encoder_spy, encoder, fp8)
        assert_bytes_equal(kv_dev, kv_want, f"cache ({encoder}, {fmt}, round_scale={round_scale})")
        assert_bytes_equal(tail_dev, tail_want, f"tail ({encoder}, {fmt})")
        _check_range(read_entries(kv_want, slots[slots >= 0], layout)[0], fp8, round_scale)
        codes, scale = read_entries(kv_want, nan_slots, layout)  # the NaN pools: NaN codes, floor scale
        assert bool((codes == _nan_codes(fp8)[0]).all())
        assert torch.equal(scale, numerics.quant_scale(torch.tensor([1e-4]), fp8, round_scale).expand(2))


@pytest.mark.parametrize("encoder", ENCODERS)
@pytest.mark.parametrize("fmt", list(FP8))
def test_query_quant(monkeypatch, encoder_spy, device, encoder, fmt):
    fp8 = FP8[fmt]
    gen = torch.Generator().manual_seed(3 + len(fmt))
    q = _wide_bf16((45,), gen)
    q[2, 5], q[31, 77] = float("nan"), -float("nan")
    q[7] = 0  # all zero: the floor scale, zero codes
    q[8] *= 1e-30  # under the floor
    q[9, 60], q[10, 3] = float("inf"), -float("inf")  # all-inf rotated rows: infinite scale, inf / inf codes
    _use(monkeypatch, encoder)
    for round_scale in (True, False):
        got_codes, got_scale = fwht128_quant_fp8(q.to(device), fp8_dtype=fp8, round_scale=round_scale)
        _check_spy(encoder_spy, encoder, fp8)
        codes, scale = numerics.rotate_quant_rows(q, fp8, round_scale)
        assert_bytes_equal(got_codes.view(torch.uint8).reshape(-1, 128), codes, f"codes ({encoder}, {fmt})")
        assert_bytes_equal(got_scale.reshape(-1), scale, f"scales ({encoder}, {fmt})")
        _check_range(codes, fp8, round_scale)
        assert bool((codes[[2, 31]] == _nan_codes(fp8)[0]).all())  # +NaN and -NaN: the canonical code
        floor = numerics.quant_scale(torch.tensor([1e-4]), fp8, round_scale)
        assert torch.equal(scale[[2, 7, 31]], floor.expand(3))
        assert bool(torch.isinf(scale[[9, 10]]).all()) and bool((codes[[9, 10]] == _nan_codes(fp8)[0]).all())


# --------------------------------------------------------------------------- scorers (decoders)

def _every_code(shape, fp8, gen, nan):
    """uint8 codes ``[*shape, 128]``, each row 128 distinct random codes; NaN codes replaced
    by 0, or (``nan``) one NaN code at dim 7 of every row."""
    n = int(torch.tensor(shape).prod()) if shape else 1
    rows = torch.stack([torch.randperm(256, generator=gen)[:128] for _ in range(n)]).to(torch.uint8)
    rows = torch.where(torch.isin(rows, _nan_codes(fp8)), torch.zeros_like(rows), rows)
    if nan:
        rows[:, 7] = _nan_codes(fp8)[0]
    return rows.view(*shape, 128)


@pytest.mark.parametrize("encoder", ENCODERS)
@pytest.mark.parametrize("fmt", list(FP8))
def test_scorers_decode(monkeypatch, device, encoder, fmt):
    """Both decoders: every code in keys and queries (NaN codes in some pools and in one head),
    paged and ragged logits equal the reference's fp32 bits, the fused selection its ids."""
    fp8, layout = FP8[fmt], LAYOUT[fmt]
    gen = torch.Generator().manual_seed(11 + len(fmt))
    page, pages, heads = 16, 6, 16
    slots = page * pages
    kv = random_bytes_like((pages, page, 132), "cpu", 5)
    codes = _every_code((slots,), fp8, gen, nan=False)
    codes[[3, 40, 77]] = _every_code((3,), fp8, gen, nan=True)  # pools holding NaN codes
    assert torch.unique(codes).numel() == 256 - (len(_nan_codes(fp8)) - 1)  # every code (one NaN code)
    scales = torch.exp2(torch.randint(-12, -2, (slots,), generator=gen).float())
    write_entries(kv, torch.arange(slots), codes, scales, layout)
    q = _every_code((2, 1, heads), fp8, gen, nan=False)
    assert torch.unique(q).numel() == 256 - len(_nan_codes(fp8))  # every finite code
    q[1, 0, 5, 9] = _nan_codes(fp8)[0]  # one NaN code in one head of row 1: every logit NaN
    w = torch.randn(2, 1, heads, generator=gen) * 0.05
    lens = torch.tensor([[slots], [slots - 7]], dtype=torch.int32)
    pt = torch.randperm(pages, generator=gen).view(1, pages).expand(2, pages).contiguous().to(torch.int32)
    _use(monkeypatch, encoder)
    assert decode_args(fp8, torch.device(device))["NATIVE_FP8"] == _backend.native_fp8(torch.device(device), fp8)
    assert bool(_backend.native_fp8(torch.device(device), fp8)) is (encoder == "native" and _backend.has_native_fp8(
        *_backend.device_target(device), fp8))
    args = [t.to(device) for t in (q, kv, w, lens, pt)]
    got = paged_pool_logits(*args, layout=layout, fp8_dtype=fp8).cpu()
    want = reference.paged_pool_logits(q, kv, w, lens, pt, layout, fp8, slots)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    j = torch.arange(slots)
    slot_of_pool = pt[0, j // page].long() * page + j % page
    assert torch.equal(torch.isnan(want[0]), torch.isin(slot_of_pool, torch.tensor([3, 40, 77])))
    assert bool(torch.isnan(want[1, :slots - 7]).all())
    ids = paged_pool_topk(*args, 20, layout=layout, fp8_dtype=fp8).cpu()
    assert torch.equal(ids, reference.select_pools(want, lens.view(-1), 20))
    kc, ksc = codes[:50], scales[:50]
    ks, ke = torch.tensor([0, 10]), torch.tensor([50, 45])
    got = ragged_pool_logits(q[:, 0].to(device), kc.to(device), ksc.to(device), w[:, 0].to(device), ks.to(device),
                             ke.to(device), fp8_dtype=fp8).cpu()
    want = reference.ragged_pool_logits(q[:, 0], kc, ksc, w[:, 0], ks, ke, fp8)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
