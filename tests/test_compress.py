"""kpool_compress_and_write_cache: both backends against the reference, against an
independent model of SPEC §3's byte layout, and against each other.

Every cache-writing test pre-fills the WHOLE backing buffer (pages, page padding, and
bytes before the cache view) with random bytes and compares it byte for byte.
"""

import contextlib
import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kpool
from kpool import numerics, reference
from kpool.layout import fp8_max, resolve_fp8_dtype
from kpool.ops import compress

from _util import GarbageTorch, assert_bytes_equal, random_bytes_like, spy_launches

FP8 = {"e4m3fn": torch.float8_e4m3fn, "e4m3fnuz": torch.float8_e4m3fnuz}
ENTRY = 132


# --- building cases ------------------------------------------------------------------------

class Cache:
    """A kv_cache view ``[num_pages, PAGE, 132]`` inside a larger random-filled uint8 buffer.

    ``pad`` extra bytes after each page (stride(0) = PAGE*132 + pad) and ``lead_rows``
    whole rows of the buffer before the view (a non-zero storage offset).
    """

    def __init__(self, num_pages, page, device, seed, pad=0, lead_rows=0):
        self.page, self.pad, self.stride = page, pad, page * ENTRY + pad
        self.base = lead_rows * self.stride  # byte offset of the view in the buffer
        self.buf = random_bytes_like((num_pages + lead_rows, self.stride), device, seed)
        self.kv = torch.as_strided(self.buf, (num_pages, page, ENTRY), (self.stride, ENTRY, 1), self.base)
        assert self.kv.data_ptr() == self.buf.data_ptr() + self.base

    @property
    def num_slots(self):
        return self.kv.shape[0] * self.page

    def clone(self):
        c = Cache.__new__(Cache)
        c.__dict__.update(self.__dict__)
        c.buf = self.buf.clone()
        c.kv = torch.as_strided(c.buf, self.kv.shape, self.kv.stride(), self.base)
        return c


def make_pools(n, pool, device, seed, ape_scale=2.0):
    """Random bf16 keys / gate scores ``[n, P, 128]`` and a non-zero fp32 ape ``[P, 128]``."""
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(n, pool, 128, generator=g) * 3).to(torch.bfloat16)
    s = (torch.randn(n, pool, 128, generator=g) * 2).to(torch.bfloat16)
    ape = torch.randn(pool, 128, generator=g) * ape_scale
    return k.to(device), s.to(device), ape.to(device)


def make_loc(n, num_slots, device, seed, n_sentinel=0, dtype=torch.int64):
    """Distinct flat slots for ``n`` pools, the first ``n_sentinel`` (shuffled in) set to -1."""
    g = torch.Generator().manual_seed(seed)
    loc = torch.randperm(num_slots, generator=g)[:n].to(torch.int64)
    loc[torch.randperm(n, generator=g)[:n_sentinel]] = -1
    return loc.to(dtype).to(device)


@contextlib.contextmanager
def use_backend(name):
    old = os.environ.get("KPOOL_BACKEND")
    os.environ["KPOOL_BACKEND"] = name
    try:
        yield
    finally:
        if old is None:
            del os.environ["KPOOL_BACKEND"]
        else:
            os.environ["KPOOL_BACKEND"] = old


def spec_write(cache: Cache, loc, codes, scale, layout, keep=None):
    """Independent model of SPEC §3: a copy of ``cache.buf`` after writing entries at ``loc``.

    Key byte of (state s, dim d) in page p: ``base + p*stride + off(s, d)``; scale of state s
    at ``base + p*stride + PAGE*128 + 4*s`` (little-endian fp32).
    """
    out = cache.buf.clone().cpu().reshape(-1)
    codes = codes.view(torch.uint8).cpu()
    scale_bytes = scale.float().cpu().contiguous().view(torch.uint8).reshape(-1, 4)
    page_size = cache.page
    for i, slot in enumerate(loc.cpu().tolist()):
        if slot < 0 or slot >= cache.num_slots or (keep is not None and not bool(keep[i])):
            continue
        p, s = divmod(slot, page_size)
        start = cache.base + p * cache.stride
        for d in range(128):
            if layout == "plain":
                off = s * 128 + d
            else:
                off = (s // 16) * 2048 + (d // 16) * 256 + (s % 16) * 16 + d % 16
            out[start + off] = codes[i, d]
        out[start + page_size * 128 + 4 * s: start + page_size * 128 + 4 * s + 4] = scale_bytes[i]
    return out.reshape(cache.buf.shape)


def run_ref(cache, k, s, ape, loc, pool, layout, fp8, write_mask=None, round_scale=True):
    """Reference result: (buffer after the write, codes, scale)."""
    ref = cache.clone()
    codes, scale = reference.compress_and_write(ref.kv, k, s, ape, loc, write_mask, fp8, layout, round_scale,
                                                True, True)
    return ref.buf, codes, scale


# --- the main matrix -----------------------------------------------------------------------

@pytest.mark.parametrize("fp8_name", list(FP8))
@pytest.mark.parametrize("layout", ["plain", "preshuffle"])
@pytest.mark.parametrize("page", [32, 64])
@pytest.mark.parametrize("pool", [4, 16])
def test_matches_reference(backend, device, pool, page, layout, fp8_name):
    """Padded page stride, non-zero storage offset, -1 sentinels, non-zero ape; whole buffer exact."""
    fp8 = FP8[fp8_name]
    n = 11
    cache = Cache(num_pages=3, page=page, device=device, seed=pool + page, pad=20, lead_rows=1)
    before = cache.clone()
    k, s, ape = make_pools(n, pool, device, seed=7 * pool + page)
    loc = make_loc(n, cache.num_slots, device, seed=page, n_sentinel=2,
                   dtype=torch.int32 if page == 32 else torch.int64)
    want_buf, codes, scale = run_ref(cache, k, s, ape, loc, pool, layout, fp8)
    out = kpool.kpool_compress_and_write_cache(cache.kv, k, s, ape, loc, pool, layout=layout, fp8_dtype=fp8)
    assert out is None
    assert_bytes_equal(cache.buf, want_buf, f"kv_cache buffer ({backend} vs reference)")
    assert_bytes_equal(cache.buf, spec_write(before, loc, codes, scale, layout), "kv_cache buffer vs SPEC §3 model")


@pytest.mark.parametrize("n", [1, 2, 3, 5, 6, 7])
@pytest.mark.parametrize("pool", [4, 16])
def test_ragged_grids(device, pool, n, monkeypatch):
    """Programs of up to 2 pools (as on a GPU at P=4): a ragged grid's last program reads the last
    2 pools and writes only its own; fewer pools than a program takes shrink the tile. The whole
    buffer and the returned entries equal the reference's."""
    monkeypatch.setenv("KPOOL_BACKEND", "triton")
    monkeypatch.setattr(compress, "INTERPRETER_BLOCK_POOLS", 2)
    monkeypatch.setattr(compress, "BLOCK_POOLS", {4: 2, 16: 2})
    tiles = spy_launches(monkeypatch, compress, "_compress_kernel", "BN")
    cache = Cache(num_pages=2, page=32, device=device, seed=n, pad=4)
    k, s, ape = make_pools(n, pool, device, seed=3 * n)
    loc = make_loc(n, cache.num_slots, device, seed=n, n_sentinel=1)
    want_buf, codes, scale = run_ref(cache, k, s, ape, loc, pool, "plain", torch.float8_e4m3fn)
    got = kpool.kpool_compress_and_write_cache(cache.kv, k, s, ape, loc, pool, return_compressed=True,
                                               layout="plain", fp8_dtype=torch.float8_e4m3fn)
    assert tiles == [min(n, 2)]
    assert_bytes_equal(cache.buf, want_buf, f"kv_cache buffer ({n} pools, tiles of {tiles[0]})")
    assert_bytes_equal(got[0], codes, "codes")
    assert_bytes_equal(got[1], scale, "scale")


def test_block_pools_never_exceed_the_pools(monkeypatch):
    """Both sizes (the GPU's ``BLOCK_POOLS``, the interpreter's own), whatever runs the test."""
    monkeypatch.setattr(compress, "interpreting", lambda: True)
    monkeypatch.setattr(compress, "INTERPRETER_BLOCK_POOLS", 16)
    assert [compress.block_pools(4, n) for n in (1, 2, 3, 7, 8, 15, 16, 17, 1000)] == [1, 2, 2, 4, 8, 8, 16, 16, 16]
    monkeypatch.setattr(compress, "interpreting", lambda: False)
    monkeypatch.setattr(compress, "BLOCK_POOLS", {4: 2})
    assert [compress.block_pools(p, n) for p in (4, 16) for n in (1, 2, 3, 1000)] == [1, 2, 2, 2, 1, 1, 1, 1]


@pytest.mark.parametrize("layout", ["plain", "preshuffle"])
@pytest.mark.parametrize("pool", [4, 16])
def test_backends_agree(device, pool, layout):
    """torch and triton backends, same inputs: identical buffers and returned entries."""
    fp8 = torch.float8_e4m3fn
    cache_t = Cache(num_pages=2, page=32, device=device, seed=3, pad=4)
    cache_k = cache_t.clone()
    k, s, ape = make_pools(9, pool, device, seed=11)
    loc = make_loc(9, cache_t.num_slots, device, seed=5, n_sentinel=1)
    with use_backend("torch"):
        rt = kpool.kpool_compress_and_write_cache(cache_t.kv, k, s, ape, loc, pool, return_compressed=True,
                                                  layout=layout, fp8_dtype=fp8)
    with use_backend("triton"):
        rk = kpool.kpool_compress_and_write_cache(cache_k.kv, k, s, ape, loc, pool, return_compressed=True,
                                                  layout=layout, fp8_dtype=fp8)
    assert_bytes_equal(cache_k.buf, cache_t.buf, "kv_cache buffer triton vs torch")
    assert_bytes_equal(rk[0], rt[0], "codes triton vs torch")
    assert_bytes_equal(rk[1], rt[1], "scale triton vs torch")


@pytest.mark.parametrize("pool", [4, 16])
def test_nan_and_inf_inputs_same_bytes(backend, device, pool):
    """Non-finite keys and gates: every max is IEEE maxNum (NaN skipped) in the kernels and the
    reference alike: a NaN gate in one slot, a dim whose gates are all NaN, an inf gate
    (inf - inf), a NaN key, +inf and -inf keys in one dim (a partly NaN rotated row), a NaN
    gate in slot 0 (the max starts at slot 0's logit), alone and with -inf gates after it, and
    an inf key alone (an all-inf rotated row: infinite ue8m0 scale, codes of ``inf / inf``)."""
    n = 9
    cache = Cache(num_pages=2, page=32, device=device, seed=17)
    k, s, ape = make_pools(n, pool, device, seed=23)
    s[0, 1, 5] = float("nan")
    s[1, :, 7] = float("nan")
    s[2, pool - 1, 9] = float("inf")
    k[3, 0, 3] = float("nan")
    k[4, 0, 0], k[4, 1, 0] = float("inf"), float("-inf")
    s[5, 0, 0] = float("-inf")
    s[6, 0, 11] = float("nan")
    s[7, 0, 13], s[7, 1:, 13] = float("nan"), float("-inf")
    k[8, pool // 2, 40] = float("inf")
    loc = torch.arange(n, device=device) * 3
    for fp8 in FP8.values():
        want_buf, _, _ = run_ref(cache, k, s, ape, loc, pool, "plain", fp8)
        kpool.kpool_compress_and_write_cache(cache.kv, k, s, ape, loc, pool, layout="plain", fp8_dtype=fp8)
        assert_bytes_equal(cache.buf, want_buf, f"kv_cache buffer with non-finite inputs ({backend}, {fp8})")


# --- features one at a time ----------------------------------------------------------------

def test_write_mask(backend, device):
    pool, n = 4, 12
    cache = Cache(num_pages=2, page=32, device=device, seed=21)
    before = cache.clone()
    k, s, ape = make_pools(n, pool, device, seed=22)
    loc = make_loc(n, cache.num_slots, device, seed=23, n_sentinel=2)
    mask = (torch.arange(n) % 3 != 1).to(device)
    fp8 = torch.float8_e4m3fn
    want_buf, codes, scale = run_ref(cache, k, s, ape, loc, pool, "plain", fp8, write_mask=mask)
    kpool.kpool_compress_and_write_cache(cache.kv, k, s, ape, loc, pool, write_mask=mask, layout="plain",
                                         fp8_dtype=fp8)
    assert_bytes_equal(cache.buf, want_buf, "kv_cache buffer with write_mask")
    assert_bytes_equal(cache.buf, spec_write(before, loc, codes, scale, "plain", keep=mask.cpu()),
                       "kv_cache buffer with write_mask vs SPEC model")
    # the mask really masked something that would have been written
    assert not torch.equal(spec_write(before, loc, codes, scale, "plain"), cache.buf.cpu())


def test_write_mask_returns_every_pool(backend, device, monkeypatch):
    """``write_mask`` masks only the cache write: every pool's codes and scale come back (masked-out ones too)."""
    monkeypatch.setattr(compress, "torch", GarbageTorch())  # the returned outputs start as garbage
    pool, n = 4, 6
    cache = Cache(num_pages=1, page=16, device=device, seed=24)
    k, s, ape = make_pools(n, pool, device, seed=25)
    loc = make_loc(n, cache.num_slots, device, seed=26, n_sentinel=1)
    mask = torch.tensor([True, False, True, True, False, True], device=device)
    fp8 = torch.float8_e4m3fn
    want_buf, want_codes, want_scale = run_ref(cache, k, s, ape, loc, pool, "plain", fp8, write_mask=mask)
    codes, scale = kpool.kpool_compress_and_write_cache(cache.kv, k, s, ape, loc, pool, write_mask=mask,
                                                        return_compressed=True, layout="plain", fp8_dtype=fp8)
    assert_bytes_equal(codes, want_codes, "returned codes with write_mask")
    assert_bytes_equal(scale, want_scale, "returned scale with write_mask")
    assert_bytes_equal(cache.buf, want_buf, "kv_cache buffer with write_mask")


@pytest.mark.parametrize("write_cache", [False, True])
def test_return_compressed(backend, device, write_cache):
    pool, n = 16, 10
    fp8 = torch.float8_e4m3fnuz
    cache = Cache(num_pages=2, page=32, device=device, seed=31, pad=8)
    before = cache.clone()
    k, s, ape = make_pools(n, pool, device, seed=32)
    loc = make_loc(n, cache.num_slots, device, seed=33, n_sentinel=3)
    want_buf, want_codes, want_scale = run_ref(cache, k, s, ape, loc, pool, "preshuffle", fp8)
    codes, scale = kpool.kpool_compress_and_write_cache(cache.kv, k, s, ape, loc, pool, return_compressed=True,
                                                        write_cache=write_cache, layout="preshuffle", fp8_dtype=fp8)
    assert codes.dtype == fp8 and codes.shape == (n, 128) and scale.dtype == torch.float32 and scale.shape == (n,)
    assert_bytes_equal(codes, want_codes, "returned codes")
    assert_bytes_equal(scale, want_scale, "returned scale")
    assert_bytes_equal(cache.buf, want_buf if write_cache else before.buf, "kv_cache buffer")
    if not write_cache:  # the cache may be omitted entirely
        c2, s2 = kpool.kpool_compress_and_write_cache(None, k, s, ape, None, pool, return_compressed=True,
                                                      write_cache=False, layout="preshuffle", fp8_dtype=fp8)
        assert_bytes_equal(c2, want_codes, "returned codes without a cache")
        assert_bytes_equal(s2, want_scale, "returned scale without a cache")


def test_token_major_windows(backend, device):
    """slot_k / slot_score as no-copy window views of token-major [T, 128] rows."""
    pool, t = 4, 40
    g = torch.Generator().manual_seed(41)
    keys = (torch.randn(t, 128, generator=g) * 2).to(torch.bfloat16).to(device)
    wide = (torch.randn(t, 256, generator=g)).to(torch.bfloat16).to(device)  # gates: row stride 256
    gates = wide[:, :128]
    ape = torch.randn(pool, 128, generator=g).to(device)
    fp8 = torch.float8_e4m3fn
    views = {
        # aligned pools: unfold -> [n, 128, P] -> [n, P, 128]
        "unfold": (keys.unfold(0, pool, pool).transpose(1, 2), gates.unfold(0, pool, pool).transpose(1, 2)),
        # overlapping windows, one per token (pool stride = one row)
        "sliding": (keys.unfold(0, pool, 1).transpose(1, 2), gates.unfold(0, pool, 1).transpose(1, 2)),
        # unaligned pools starting at token 3
        "offset": (torch.as_strided(keys, (9, pool, 128), (pool * 128, 128, 1), keys.storage_offset() + 3 * 128),
                   torch.as_strided(wide, (9, pool, 128), (pool * 256, 256, 1), wide.storage_offset() + 3 * 256)),
    }
    for name, (sk, ss) in views.items():
        assert sk.untyped_storage().data_ptr() == keys.untyped_storage().data_ptr()
        assert ss.untyped_storage().data_ptr() == wide.untyped_storage().data_ptr()
        n = sk.shape[0]
        cache = Cache(num_pages=2, page=32, device=device, seed=42)
        loc = make_loc(n, cache.num_slots, device, seed=43)
        want_buf, want_codes, _ = run_ref(cache, sk.contiguous(), ss.contiguous(), ape, loc, pool, "plain", fp8)
        codes, _ = kpool.kpool_compress_and_write_cache(cache.kv, sk, ss, ape, loc, pool, return_compressed=True,
                                                        layout="plain", fp8_dtype=fp8)
        assert_bytes_equal(cache.buf, want_buf, f"kv_cache buffer ({name} view)")
        assert_bytes_equal(codes, want_codes, f"codes ({name} view)")


def test_empty_batch(backend, device):
    cache = Cache(num_pages=2, page=32, device=device, seed=51)
    before = cache.clone()
    k, s, ape = make_pools(0, 4, device, seed=52)
    loc = torch.zeros(0, dtype=torch.int64, device=device)
    assert kpool.kpool_compress_and_write_cache(cache.kv, k, s, ape, loc, 4) is None
    codes, scale = kpool.kpool_compress_and_write_cache(cache.kv, k, s, ape, loc, 4, return_compressed=True)
    assert codes.shape == (0, 128) and scale.shape == (0,)
    assert_bytes_equal(cache.buf, before.buf, "kv_cache buffer after an empty batch")



def test_rocm_default_layout_is_plain_for_one_entry_pages(monkeypatch):
    """ROCm's default layout is the preshuffled one, except at PAGE = 1 (no 16-state tile),
    which the seed writes plain: a drop-in call there writes plain instead of raising."""
    from kpool import layout
    monkeypatch.setattr(layout, "is_rocm", lambda: True)
    assert [layout.default_layout("cuda", page) for page in (64, 16, 1)] == ["preshuffle", "preshuffle", "plain"]
    assert layout.default_layout("cpu", 64) == "plain"


def test_default_layout_follows_the_page_size(backend, device, monkeypatch):
    """Every writer and reader resolves the default layout from the cache's PAGE (here a fake
    platform default: preshuffle except at PAGE = 1, as on ROCm)."""
    from kpool import layout
    monkeypatch.setattr(layout, "default_layout", lambda dev=None, page_size=None: (
        "plain" if page_size == 1 else "preshuffle"))
    k, s, ape = make_pools(5, 4, device, seed=71)
    for page, want in ((1, "plain"), (16, "preshuffle")):
        loc = make_loc(5, 8 * page, device, seed=72)
        got, explicit = Cache(8, page, device, seed=73), Cache(8, page, device, seed=73)
        kpool.kpool_compress_and_write_cache(got.kv, k, s, ape, loc, 4)
        kpool.kpool_compress_and_write_cache(explicit.kv, k, s, ape, loc, 4, layout=want)
        assert_bytes_equal(got.buf, explicit.buf, f"kv_cache buffer, PAGE={page}, default layout")
        cache = kpool.KPoolCache(2, page_size=page, pool_size=4, max_requests=1, ape=ape, device=device)
        assert cache.layout == want
    q = torch.zeros((1, 1, 16, 128), dtype=torch.uint8, device=device)
    w = torch.zeros((1, 1, 16), device=device)
    pt = torch.zeros((1, 2), dtype=torch.int32, device=device)
    lens = torch.full((1, 1), 2, dtype=torch.int32, device=device)
    assert kpool.paged_pool_logits(q, Cache(2, 1, device, seed=74).kv, w, lens, pt).shape == (1, 2)

@pytest.mark.parametrize("fp8_name", list(FP8))
def test_round_scale_false(backend, device, fp8_name):
    fp8, pool, n = FP8[fp8_name], 4, 9
    cache = Cache(num_pages=2, page=64, device=device, seed=61, pad=12)
    k, s, ape = make_pools(n, pool, device, seed=62)
    loc = make_loc(n, cache.num_slots, device, seed=63)
    want_buf, want_codes, want_scale = run_ref(cache, k, s, ape, loc, pool, "plain", fp8, round_scale=False)
    codes, scale = kpool.kpool_compress_and_write_cache(cache.kv, k, s, ape, loc, pool, round_scale=False,
                                                        return_compressed=True, layout="plain", fp8_dtype=fp8)
    assert_bytes_equal(cache.buf, want_buf, "kv_cache buffer (round_scale=False)")
    assert_bytes_equal(scale, want_scale, "scale (round_scale=False)")
    mant = scale.cpu().view(torch.int32) & 0x7FFFFF
    assert (mant != 0).any(), "round_scale=False scales should not all be powers of two"
    # amax / scale is FP8_MAX up to the rounding of 1/FP8_MAX: the largest code is (about) FP8_MAX
    top = codes.float().abs().amax(dim=1).cpu()
    assert torch.all(top == fp8_max(fp8))


def test_deterministic(backend, device):
    pool, n = 16, 13
    k, s, ape = make_pools(n, pool, device, seed=71)
    bufs = []
    for _ in range(2):
        cache = Cache(num_pages=2, page=32, device=device, seed=72, pad=4)
        loc = make_loc(n, cache.num_slots, device, seed=73, n_sentinel=1)
        kpool.kpool_compress_and_write_cache(cache.kv, k, s, ape, loc, pool, layout="preshuffle",
                                             fp8_dtype=torch.float8_e4m3fn)
        bufs.append(cache.buf)
    assert_bytes_equal(bufs[1], bufs[0], "second run vs first run")


def test_preshuffle_state17_offsets(backend, device):
    """One pool at state 17 of page 1: its bytes land at SPEC §3's preshuffled offsets."""
    page, pool = 32, 4
    cache = Cache(num_pages=3, page=page, device=device, seed=81, pad=16)
    before = cache.buf.clone().cpu()
    k, s, ape = make_pools(1, pool, device, seed=82)
    loc = torch.tensor([1 * page + 17], device=device)
    codes, scale = kpool.kpool_compress_and_write_cache(cache.kv, k, s, ape, loc, pool, return_compressed=True,
                                                        layout="preshuffle", fp8_dtype=torch.float8_e4m3fn)
    buf = cache.buf.cpu().reshape(-1)
    start = 1 * cache.stride
    d = torch.arange(128)
    key_off = start + 2048 + (d // 16) * 256 + 16 + d % 16  # (17//16)*2048 + (d//16)*256 + (17%16)*16 + d%16
    scale_off = start + page * 128 + 4 * 17 + torch.arange(4)
    assert_bytes_equal(buf[key_off], codes.view(torch.uint8).cpu()[0], "key bytes at the preshuffled offsets")
    assert_bytes_equal(buf[scale_off], scale.cpu().view(torch.uint8), "scale bytes at PAGE*128 + 4*17")
    untouched = torch.ones(buf.numel(), dtype=torch.bool)
    untouched[key_off] = False
    untouched[scale_off] = False
    assert_bytes_equal(buf[untouched], before.reshape(-1)[untouched], "every other byte")
    assert not torch.equal(buf, before.reshape(-1))


# --- the values follow SPEC §2 (float64 model, tolerance of the fp8/bf16 roundings) ---------------

def _model_y(k, s, ape, with_ape=True):
    """SPEC §2 steps 1-3 in float64 (no intermediate rounding): rotated pooled keys [n, 128]."""
    logits = s.double() + (ape.double()[None] if with_ape else 0.0)
    w = torch.softmax(logits, dim=1)  # over slots, per dim
    x = (w * k.double()).sum(dim=1)
    i = torch.arange(128)
    a = i[:, None] & i[None, :]
    pop = sum(((a >> b) & 1) for b in range(7))
    h = (1.0 - 2.0 * (pop % 2)).double() / math.sqrt(128.0)
    return x @ h


@pytest.mark.parametrize("fp8_name", list(FP8))
def test_values_follow_spec_math(backend, device, fp8_name):
    fp8, pool, n = FP8[fp8_name], 16, 8
    k, s, ape = make_pools(n, pool, device, seed=91, ape_scale=3.0)
    codes, scale = kpool.kpool_compress_and_write_cache(None, k, s, ape, None, pool, return_compressed=True,
                                                        write_cache=False, layout="plain", fp8_dtype=fp8)
    deq = codes.float().double().cpu() * scale.double().cpu()[:, None]
    k, s, ape = k.cpu(), s.cpu(), ape.cpu()
    y = _model_y(k, s, ape)
    amax = y.abs().amax(dim=1, keepdim=True)
    tol = 0.07 * y.abs() + 0.01 * amax  # fp8 e4m3: 3 mantissa bits; plus two bf16 roundings
    assert ((deq - y).abs() <= tol).all(), f"worst excess {((deq - y).abs() - tol).max().item():.3g}"
    s_ref = torch.exp2(torch.ceil(torch.log2(scale.double().cpu())))
    assert torch.equal(scale.double().cpu(), s_ref)  # ue8m0
    assert (deq.abs().amax(dim=1) <= fp8_max(fp8) * scale.double().cpu()).all()
    # the check is sharp enough to notice a dropped ape
    y_no_ape = _model_y(k, s, ape, with_ape=False)
    assert ((deq - y_no_ape).abs() > tol).any()


# --- validation -----------------------------------------------------------------------------

def _valid(device, pool=4, n=3, page=32):
    k, s, ape = make_pools(n, pool, device, seed=101)
    cache = Cache(num_pages=2, page=page, device=device, seed=102)
    loc = make_loc(n, cache.num_slots, device, seed=103)
    return dict(kv_cache=cache.kv, slot_k=k, slot_score=s, ape=ape, loc=loc, pool_size=pool)


def _other_device(device):
    return "meta" if torch.device(device).type == "cpu" else "cpu"


CASES = {
    "slot_k dtype": (lambda a, dev: a.update(slot_k=a["slot_k"].float()), "slot_k"),
    "slot_k shape": (lambda a, dev: a.update(slot_k=a["slot_k"][:, :, :64]), "slot_k"),
    "slot_k inner stride": (lambda a, dev: a.update(
        slot_k=torch.zeros(3, 4, 256, dtype=torch.bfloat16, device=dev)[..., ::2]), "slot_k"),
    "slot_score dtype": (lambda a, dev: a.update(slot_score=a["slot_score"].half()), "slot_score"),
    "slot_score shape": (lambda a, dev: a.update(slot_score=a["slot_score"][:2]), "slot_score"),
    "slot_score device": (lambda a, dev: a.update(slot_score=a["slot_score"].to(_other_device(dev))), "slot_score"),
    "ape dtype": (lambda a, dev: a.update(ape=a["ape"].double()), "ape"),
    "ape shape": (lambda a, dev: a.update(ape=a["ape"][:2]), "ape"),
    "ape device": (lambda a, dev: a.update(ape=a["ape"].to(_other_device(dev))), "ape"),
    "loc dtype": (lambda a, dev: a.update(loc=a["loc"].float()), "loc"),
    "loc shape": (lambda a, dev: a.update(loc=a["loc"][:2]), "loc"),
    "loc device": (lambda a, dev: a.update(loc=a["loc"].to(_other_device(dev))), "loc"),
    "loc out of range": (lambda a, dev: a["loc"].__setitem__(1, 2 * 32), "loc"),
    "loc repeats": (lambda a, dev: a["loc"].__setitem__(2, a["loc"][0]), "loc"),  # two programs, one slot
    "kv_cache dtype": (lambda a, dev: a.update(kv_cache=a["kv_cache"].view(torch.int8)), "kv_cache"),
    "kv_cache entry bytes": (lambda a, dev: a.update(kv_cache=torch.zeros(2, 32, 130, dtype=torch.uint8,
                                                                          device=dev)), "kv_cache"),
    "kv_cache device": (lambda a, dev: a.update(kv_cache=a["kv_cache"].to(_other_device(dev))), "kv_cache"),
    "kv_cache misaligned": (lambda a, dev: a.update(kv_cache=torch.zeros(2 * 32 * 132 + 2, dtype=torch.uint8,
                                                                         device=dev)[2:].view(2, 32, 132)),
                            "kv_cache"),
    "preshuffle page 24": (lambda a, dev: a.update(kv_cache=torch.zeros(2, 24, 132, dtype=torch.uint8, device=dev),
                                                   layout="preshuffle"), "layout"),
    "pool_size vs slot_k": (lambda a, dev: a.update(pool_size=16), "slot_k"),
    "pool_size zero": (lambda a, dev: a.update(pool_size=0), "pool_size"),
    "pool_size bool": (lambda a, dev: a.update(pool_size=True), "pool_size"),
    "head_dim": (lambda a, dev: a.update(head_dim=64), "head_dim"),
    "write_mask dtype": (lambda a, dev: a.update(write_mask=torch.ones(3, dtype=torch.int32, device=dev)),
                         "write_mask"),
    "write_mask shape": (lambda a, dev: a.update(write_mask=torch.ones(4, dtype=torch.bool, device=dev)),
                         "write_mask"),
    "layout": (lambda a, dev: a.update(layout="tiled"), "layout"),
    "fp8_dtype": (lambda a, dev: a.update(fp8_dtype=torch.float16), "fp8_dtype"),
    "round_scale not a bool": (lambda a, dev: a.update(round_scale="no"), "round_scale"),
    "write_cache not a bool": (lambda a, dev: a.update(write_cache="no"), "write_cache"),
    "return_compressed not a bool": (lambda a, dev: a.update(return_compressed=1), "return_compressed"),
    "head_dim float": (lambda a, dev: a.update(head_dim=128.0), "head_dim"),
    "nothing to do": (lambda a, dev: a.update(write_cache=False), "write_cache"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_validation_errors(backend, device, case):
    args = _valid(device)
    mutate, name = CASES[case]
    mutate(args, device)
    buf_before = args["kv_cache"].clone() if args["kv_cache"].device.type != "meta" else None
    with pytest.raises((ValueError, TypeError), match=rf"\b{name}\b"):
        kpool.kpool_compress_and_write_cache(**args)
    if buf_before is not None:
        assert torch.equal(args["kv_cache"], buf_before)


def test_slot_count_limit(monkeypatch):
    """The writers address slots with 32-bit arithmetic: a cache of more than 2^31 slots is
    rejected by every entry point's cache check and by ``KPoolCache`` before it allocates
    (checked on meta tensors, which the entry points otherwise reject: nothing to allocate)."""
    from kpool import _checks
    from kpool._checks import MAX_SLOTS, check_kv_cache
    monkeypatch.setattr(_checks, "DEVICE_TYPES", _checks.DEVICE_TYPES + ("meta",))
    meta = torch.device("meta")
    check_kv_cache(torch.empty((MAX_SLOTS // 64, 64, 132), dtype=torch.uint8, device=meta), "plain", meta)
    with pytest.raises(ValueError, match="kv_cache"):
        check_kv_cache(torch.empty((MAX_SLOTS // 64 + 1, 64, 132), dtype=torch.uint8, device=meta), "plain", meta)
    with pytest.raises(ValueError, match="num_pages"):
        kpool.KPoolCache(MAX_SLOTS // 32 + 1, page_size=32, max_requests=1, ape=torch.zeros(4, 128), device="cpu")


def test_repeated_loc_not_written_twice_is_accepted(backend, device):
    """A slot may repeat on rows that are not written (negative loc or write_mask False): those
    programs write nothing, so nothing races; the written rows land as the oracle's."""
    args = _valid(device)
    args["loc"][2] = args["loc"][0]
    for mask in ([True, True, False], [False, True, True]):
        write_mask = torch.tensor(mask, device=device)
        got, want = args["kv_cache"].clone(), args["kv_cache"].clone()
        kpool.kpool_compress_and_write_cache(**dict(args, kv_cache=got), write_mask=write_mask)
        reference.compress_and_write(want, args["slot_k"], args["slot_score"], args["ape"], args["loc"], write_mask,
                                     resolve_fp8_dtype(None, want.device), "plain", True, False, True)
        assert_bytes_equal(got, want, f"kv_cache, write_mask {mask}")
    with pytest.raises(ValueError, match=r"^loc: cache slots written repeat"):
        kpool.kpool_compress_and_write_cache(**args)


def test_bad_backend_env(device, monkeypatch):
    monkeypatch.setenv("KPOOL_BACKEND", "cuda-graphs")
    with pytest.raises(ValueError, match="KPOOL_BACKEND"):
        kpool.kpool_compress_and_write_cache(**_valid(device))


# --- property test --------------------------------------------------------------------------

@settings(max_examples=15, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(0, 12), pool=st.sampled_from([4, 16]), page=st.sampled_from([16, 32, 48, 64]),
       layout=st.sampled_from(["plain", "preshuffle"]), fp8_name=st.sampled_from(list(FP8)),
       pad=st.sampled_from([0, 4, 60]), lead_rows=st.integers(0, 1), num_pages=st.integers(1, 3),
       n_sentinel=st.integers(0, 3), masked=st.booleans(), loc32=st.booleans(), seed=st.integers(0, 2**16))
def test_property_random_shapes(n, pool, page, layout, fp8_name, pad, lead_rows, num_pages, n_sentinel, masked,
                                loc32, seed):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    fp8 = FP8[fp8_name]
    cache = Cache(num_pages=num_pages, page=page, device=device, seed=seed, pad=pad, lead_rows=lead_rows)
    n = min(n, cache.num_slots)
    k, s, ape = make_pools(n, pool, device, seed=seed + 1)
    loc = make_loc(n, cache.num_slots, device, seed=seed + 2, n_sentinel=min(n_sentinel, n),
                   dtype=torch.int32 if loc32 else torch.int64)
    mask = (torch.rand(n, generator=torch.Generator().manual_seed(seed)) < 0.7).to(device) if masked else None
    before = cache.clone()
    results = {}
    for name in ("torch", "triton"):
        c = before.clone()
        with use_backend(name):
            codes, scale = kpool.kpool_compress_and_write_cache(c.kv, k, s, ape, loc, pool, write_mask=mask,
                                                                return_compressed=True, layout=layout, fp8_dtype=fp8)
        results[name] = (c.buf, codes, scale)
    ref_codes, ref_scale = numerics.compress_pools(k, s, ape, fp8)
    want = spec_write(before, loc, ref_codes, ref_scale, layout, keep=None if mask is None else mask.cpu())
    for name, (buf, codes, scale) in results.items():
        assert_bytes_equal(buf, want, f"kv_cache buffer ({name}) vs SPEC model")
        assert_bytes_equal(codes, ref_codes.view(fp8), f"codes ({name})")
        assert_bytes_equal(scale, ref_scale, f"scale ({name})")
