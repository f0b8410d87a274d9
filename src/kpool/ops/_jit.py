"""Shared ``@triton.jit`` helpers: the exact pooling arithmetic of SPEC.md §2.

Each helper performs the same IEEE operations in the same order as ``kpool.numerics``;
kernels that use them are launched with ``enable_fp_fusion=False``. Tiles are
``[BN, 128]`` (BN pools or rows, 128 dims); ``d`` is ``tl.arange(0, 128)``.
"""

import triton
import triton.language as tl

from .. import _backend
from ..layout import AMAX_FLOOR, HADAMARD_SCALE
from ..numerics import EXP2_POLY, EXP_ROUND, EXP_X_MIN, LOG2E

# Globals read inside @triton.jit code must be tl.constexpr: the real compiler rejects plain
# Python floats (NameError), only the interpreter accepts them.
LOG2E, EXP_X_MIN, EXP_ROUND = tl.constexpr(LOG2E), tl.constexpr(EXP_X_MIN), tl.constexpr(EXP_ROUND)
AMAX_FLOOR, HADAMARD_SCALE = tl.constexpr(AMAX_FLOOR), tl.constexpr(HADAMARD_SCALE)
FP8_SATFINITE = tl.constexpr(_backend.FP8_SATFINITE)
_C5, _C4, _C3, _C2, _C1, _C0 = (tl.constexpr(c) for c in EXP2_POLY)


@triton.jit
def exp_exact(x):
    """exp(x) for x <= 0: ``2^n * poly5(r)``, ``n = rne(x*log2(e))``, fma Horner (``numerics.exp_exact``).

    ``tn = fma(x, log2(e), EXP_ROUND)`` holds ``n`` in its low mantissa bits, so
    ``bits(tn) << 23`` is ``n << 23`` (mod 2^32) and the scaling by ``2^n`` is one integer add;
    ``r = fma(x, log2(e), EXP_ROUND - tn)`` (``-n``, exact). One instruction fewer than
    ``t = x*log2(e)`` then ``r = t - ((t + EXP_ROUND) - EXP_ROUND)``, and ``r`` is rounded once."""
    s = tl.maximum(x, EXP_X_MIN)
    tn = tl.fma(s, LOG2E, EXP_ROUND)
    r = tl.fma(s, LOG2E, EXP_ROUND - tn)
    p = tl.fma(r, _C5, _C4)
    p = tl.fma(p, r, _C3)
    p = tl.fma(p, r, _C2)
    p = tl.fma(p, r, _C1)
    p = tl.fma(p, r, _C0)
    bits = p.to(tl.int32, bitcast=True) + (tn.to(tl.int32, bitcast=True) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def bf16_to_f32(x):
    """bf16 -> fp32 (exact) as one integer shift of the bits: the native conversion of a
    register's upper bf16 takes two instructions on sm_90 (PRMT + SHF), this one."""
    return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def bf16_round(x):
    """fp32 -> nearest bf16 (ties to even) as fp32 (the native conversion); a NaN gives a NaN
    whose sign and payload are the target's: only NaN-ness reaches the fp8 codes."""
    return x.to(tl.bfloat16).to(tl.float32)


@triton.jit
def _butterfly(x, BN: tl.constexpr, STRIDE: tl.constexpr):
    # [BN, 128] -> pairs (i, i + STRIDE) inside blocks of 2*STRIDE -> (a + b, a - b)
    y = tl.reshape(x, (BN, 64 // STRIDE, 2, STRIDE))
    a, b = tl.split(tl.permute(y, (0, 1, 3, 2)))
    y = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2))
    return tl.reshape(y, (BN, 128))


@triton.jit
def rotate(x, BN: tl.constexpr):
    """``bf16(FWHT128(x) * fp32(1/sqrt(128)))`` of a ``[BN, 128]`` fp32 tile."""
    x = _butterfly(x, BN, 1)
    x = _butterfly(x, BN, 2)
    x = _butterfly(x, BN, 4)
    x = _butterfly(x, BN, 8)
    x = _butterfly(x, BN, 16)
    x = _butterfly(x, BN, 32)
    x = _butterfly(x, BN, 64)
    return bf16_round(x * HADAMARD_SCALE)


@triton.jit
def quant_scale(amax, INV_MAX: tl.constexpr, ROUND_SCALE: tl.constexpr):
    """``v = max(amax, 1e-4) * INV_MAX``; ``2^ceil(log2(v))`` from its bits, or ``v``."""
    v = tl.maximum(amax, AMAX_FLOOR) * INV_MAX
    if ROUND_SCALE:
        bits = v.to(tl.int32, bitcast=True)
        e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        v = (e << 23).to(tl.float32, bitcast=True)
    return v


@triton.jit
def fp8_encode(x, FP8_MAX: tl.constexpr, FNUZ: tl.constexpr):
    """fp32 -> fp8 e4m3 code (uint8) by integer ops: clamp to ±FP8_MAX, RNE, NaN canonical.

    ``FNUZ``: e4m3fnuz (bias 8, NaN 0x80, no -0) instead of e4m3fn (bias 7, NaN 0x7F).
    Bit-identical to ``numerics.fp8_encode`` and to the native conversions.
    """
    y = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
    u = y.to(tl.uint32, bitcast=True)
    sign = u >> 31
    a = u & 0x7FFFFFFF
    af = a.to(tl.float32, bitcast=True)
    if FNUZ:
        min_normal: tl.constexpr = 0.0078125  # 2^-7
        sub_scale: tl.constexpr = 1024.0  # 1 / 2^-10
        rebias: tl.constexpr = (127 - 8) << 3
    else:
        min_normal: tl.constexpr = 0.015625  # 2^-6
        sub_scale: tl.constexpr = 512.0  # 1 / 2^-9
        rebias: tl.constexpr = (127 - 7) << 3
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - rebias
    sub = ((af * sub_scale + 8388608.0) - 8388608.0).to(tl.uint32)
    code = tl.where(af < min_normal, sub, normal)
    if FNUZ:
        code = tl.where(code != 0, code | (sign << 7), code)
    else:
        code = code | (sign << 7)
    return _with_nan_codes(x, code, FNUZ)


@triton.jit
def _with_nan_codes(x, code, FNUZ: tl.constexpr):
    """uint8 codes of ``x`` with every NaN input set to the format's canonical NaN code,
    whatever its sign: 0x80 (fnuz), 0x7F (fn)."""
    return tl.where(x != x, 0x80 if FNUZ else 0x7F, code.to(tl.uint32)).to(tl.uint8)


@triton.jit
def fp8_encode_native(x, FP8_MAX: tl.constexpr, FNUZ: tl.constexpr, MODE: tl.constexpr):
    """``fp8_encode`` through Triton's conversion (targets that have it for the format).

    ``MODE`` (``_backend.native_fp8``): ``FP8_SATFINITE`` (CUDA, e4m3fn, ``FP8_MAX`` 448) is
    the conversion alone, which saturates and gives 0x7F for every NaN; else clamp, convert
    and set the canonical NaN code."""
    if MODE == FP8_SATFINITE:
        tl.static_assert(not FNUZ and FP8_MAX == 448.0, "FP8_SATFINITE: e4m3fn only")
        return x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    y = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
    if FNUZ:
        code = y.to(tl.float8e4b8).to(tl.uint8, bitcast=True)
    else:
        code = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return _with_nan_codes(x, code, FNUZ)


@triton.jit
def quantize(y, FP8_MAX: tl.constexpr, FNUZ: tl.constexpr, ROUND_SCALE: tl.constexpr,
             NATIVE_FP8: tl.constexpr):
    """Per-row fp8 of a bf16-exact ``[BN, 128]`` fp32 tile -> (codes uint8 [BN,128], scale [BN]).

    With power-of-two scales ``y / scale`` is computed as ``y * 2^-e``: both are the
    correctly rounded value of the same real number, so the bits equal ``div_rn``'s. A finite
    scale is at most ~2^120, so its reciprocal is normal; an infinite one (an inf in the row)
    gets the reciprocal +0 (its bits clamped at 0), which gives ``y / inf``: ±0 for a
    finite ``y``, NaN for an infinite one.
    ``NATIVE_FP8`` (a ``_backend.native_fp8`` mode): encode with the target's conversion (same
    bytes) instead of integer ops.
    """
    amax = tl.max(tl.abs(y), axis=1)
    scale = quant_scale(amax, 1.0 / FP8_MAX, ROUND_SCALE)
    if ROUND_SCALE:
        # scale = 2^k (bits (k + 127) << 23): 2^-k has bits (254 << 23) - bits; inf -> negative -> 0
        inv = tl.maximum(0x7F000000 - scale.to(tl.int32, bitcast=True), 0).to(tl.float32, bitcast=True)
        q = y * inv[:, None]
    else:
        q = tl.math.div_rn(y, scale[:, None])
    if NATIVE_FP8:
        codes = fp8_encode_native(q, FP8_MAX, FNUZ, NATIVE_FP8)
    else:
        codes = fp8_encode(q, FP8_MAX, FNUZ)
    return codes, scale


@triton.jit
def key_offset(state, d, PRESHUFFLE: tl.constexpr):
    """Byte offset of key code (state, dim) inside a page (plain or 16x16 preshuffled)."""
    if PRESHUFFLE:
        return (state // 16) * 2048 + (d // 16) * 256 + (state % 16) * 16 + d % 16
    else:
        return state * 128 + d


@triton.jit
def store_entries(kv_ptr, kv_f32_ptr, page_stride, loc, ok, codes, scale, d,
                  PAGE: tl.constexpr, PRESHUFFLE: tl.constexpr):
    """Write ``codes [BN, 128]`` / ``scale [BN]`` at flat slots ``loc [BN]`` where ``ok``.

    ``kv_ptr`` is the uint8 cache, ``kv_f32_ptr`` the same memory as fp32;
    ``page_stride`` is ``kv_cache.stride(0)`` in bytes (a multiple of 4). Slots where ``ok``
    are below the cache's slot count, at most ``_checks.MAX_SLOTS``: 32-bit unsigned slot
    arithmetic, 64-bit byte offsets.
    """
    loc = tl.where(ok, loc, 0).to(tl.uint32)
    page = loc // PAGE
    state = (loc % PAGE).to(tl.int32)
    base = page.to(tl.int64) * page_stride
    tl.store(kv_ptr + base[:, None] + key_offset(state[:, None], d[None, :], PRESHUFFLE), codes,
             mask=ok[:, None])
    tl.store(kv_f32_ptr + (base + PAGE * 128) // 4 + state, scale, mask=ok)


@triton.jit
def encode_and_store(kv_ptr, kv_f32_ptr, page_stride, x, loc, ok, d, BN: tl.constexpr, PAGE: tl.constexpr,
                     PRESHUFFLE: tl.constexpr, FP8_MAX: tl.constexpr, FNUZ: tl.constexpr,
                     ROUND_SCALE: tl.constexpr, NATIVE_FP8: tl.constexpr):
    """SPEC §2 steps 3-5 of pooled ``x [BN, 128]``: rotate, quantize, write at flat slots ``loc`` where ``ok``."""
    codes, scale = quantize(rotate(x, BN), FP8_MAX, FNUZ, ROUND_SCALE, NATIVE_FP8)
    store_entries(kv_ptr, kv_f32_ptr, page_stride, loc, ok, codes, scale, d, PAGE, PRESHUFFLE)


@triton.jit
def pool_tile(pid, n, BN: tl.constexpr):
    """Pools of program ``pid`` in a grid of ``cdiv(n, BN)`` (``n >= BN``): ``i [BN]`` it reads,
    ``own [BN]`` those it writes and ``read [BN]``, the mask of its loads.

    ``BN > 1``: ``[pid*BN, pid*BN + BN)``, except that a ragged grid's last program reads the last
    BN pools, the first of them its neighbour's (read again, not written); every pool read exists,
    so ``read`` is all true and the load masks fold away (sm_90, compress P=4: 1,135 -> 1,084
    instructions through the last EXIT; benchmarks/LOG.md, 67th session). ``BN == 1``: pool
    ``pid``, ``read = own = pid < n`` (unmasked loads made the P=16 prefill writer spill more)."""
    first = pid.to(tl.int64) * BN
    if BN == 1:
        i = first + tl.arange(0, BN)
        return i, i < n, i < n
    i = tl.minimum(first, n - BN) + tl.arange(0, BN)
    return i, i >= first, tl.full((BN,), 1, tl.int1)


@triton.jit
def load_slot(ptr, tok_off, ring_ptr, ring_row, in_ring, live, d, HAS_RING: tl.constexpr, ROW_SELECT: tl.constexpr):
    """fp32 ``[BN, 128]`` rows of one pool slot: token rows at element offsets ``tok_off``,
    or (``HAS_RING`` and ``in_ring``) ring rows at ``ring_row``; rows not ``live`` read 0.

    ``ROW_SELECT``: one load from a per-row ``tl.where`` of the two base pointers (CUDA;
    H200: decode P=16 verify steps 5-12% faster); else two masked loads (AMD: triton 3.6's
    ``TritonAMDGPUConvertToBufferOps`` fails on the pointer select)."""
    if HAS_RING:
        if ROW_SELECT:
            row = tl.where(in_ring, ring_ptr + ring_row, ptr + tok_off)
            x = bf16_to_f32(tl.load(row[:, None] + d[None, :], mask=live[:, None], other=0.0))
        else:  # selected as fp32 (gfx942, triton 3.6: a select of the bf16 loads fails to lower)
            x = tl.load(ptr + tok_off[:, None] + d[None, :], mask=(live & ~in_ring)[:, None], other=0.0)
            xr = tl.load(ring_ptr + ring_row[:, None] + d[None, :], mask=(live & in_ring)[:, None], other=0.0)
            x = tl.where(in_ring[:, None], bf16_to_f32(xr), bf16_to_f32(x))
    else:  # (ptr + tok_off)[:, None] + d, not ptr + (tok_off[:, None] + d): on the H200, P=16 prefill 45.4 -> 42.0 us
        row = ptr + tok_off
        x = bf16_to_f32(tl.load(row[:, None] + d[None, :], mask=live[:, None], other=0.0))
    return x


@triton.jit
def load_ape(ape_ptr, ape_stride, d, P: tl.constexpr):
    """The ``P`` rows of ``ape`` (fp32 ``[128]`` each), as a tuple."""
    apes = ()
    for s in tl.static_range(P):
        apes = apes + (tl.load(ape_ptr + s * ape_stride + d),)
    return apes


@triton.jit
def pool_accumulate(acc, den, logit, top, k, FIRST: tl.constexpr):
    """One slot of the second softmax pass: ``e = exp(l - max)``; ``acc = fma(e, k, acc)``;
    ``den += e``, or ``den = e`` for the ``FIRST`` slot (the bits of ``0 + e``: ``e > 0``)."""
    e = exp_exact(logit - top)
    if FIRST:
        return tl.fma(e, k, tl.zeros_like(e)), e
    return tl.fma(e, k, acc), den + e


@triton.jit
def pool_finish(acc, den):
    """``bf16(acc / den)`` (IEEE division)."""
    return bf16_round(tl.math.div_rn(acc, den))


@triton.jit
def load_pool_rows(k_ptr, g_ptr, k_off, g_off, k_step, g_step, ring_ptr, ring_off, ring_head, ring_pos0, n_ring,
                   live, d, P: tl.constexpr, RING: tl.constexpr, HAS_RING: tl.constexpr, ROW_SELECT: tl.constexpr):
    """Gate and key rows (tuples of ``P`` fp32 ``[BN, 128]``) of BN pools, for ``pool_rows``.

    Slot ``s`` of pool ``i`` is read from the ring (block at element ``ring_off[i]``, slot
    ``(ring_pos0[i] + s) % RING``, gates ``ring_head`` elements further) when
    ``HAS_RING`` and ``s < n_ring[i]``, else from the token rows ``k_off[i] + s*k_step``
    and ``g_off[i] + s*g_step``; pools not ``live`` read zeros."""
    gates = ()
    keys = ()
    for s in tl.static_range(P):
        ring_row = ring_off + ((ring_pos0 + s) % RING) * 128
        gates = gates + (load_slot(g_ptr, g_off + s * g_step, ring_ptr, ring_row + ring_head, s < n_ring, live, d,
                                   HAS_RING, ROW_SELECT),)
        keys = keys + (load_slot(k_ptr, k_off + s * k_step, ring_ptr, ring_row, s < n_ring, live, d,
                                 HAS_RING, ROW_SELECT),)
    return gates, keys


@triton.jit
def pool_rows(gates, keys, apes, BN: tl.constexpr, P: tl.constexpr):
    """Softmax(gate + ape)-pooled keys of loaded rows (``load_pool_rows``, ``load_ape``), rounded to
    bf16 (SPEC §2 steps 1-2): two passes in slot order, the max of the logits (from slot 0's, as
    ``numerics.pool_softmax``), then exp, denominator and weighted sum. Returns fp32 ``[BN, 128]``."""
    logits = ()
    for s in tl.static_range(P):
        logits = logits + (gates[s] + apes[s][None, :],)
        if s == 0:
            top = logits[0]
        else:
            top = tl.maximum(top, logits[s])
    acc = tl.zeros((BN, 128), tl.float32)
    den = acc  # placeholders: slot 0 (pool_accumulate's FIRST) sets both
    for s in tl.static_range(P):
        acc, den = pool_accumulate(acc, den, logits[s], top, keys[s], s == 0)
    return pool_finish(acc, den)


@triton.jit
def pool_vector(k_ptr, g_ptr, k_off, g_off, k_step, g_step,
                ring_ptr, ring_off, ring_head, ring_pos0, n_ring,
                ape_ptr, ape_stride, d, live,
                BN: tl.constexpr, P: tl.constexpr, RING: tl.constexpr, HAS_RING: tl.constexpr,
                ROW_SELECT: tl.constexpr, LOADS_FIRST: tl.constexpr = False):
    """``pool_rows`` of the rows ``load_pool_rows`` reads: every gate and key row loaded first,
    then ``ape``, then the pooling. ``LOADS_FIRST``: a barrier after the row loads, so that
    ptxas issues them all before the pooling starts instead of sinking some toward their use
    (the writers' rule, ``compress.LOADS_FIRST_SLOTS``). Returns fp32 ``[BN, 128]``.
    """
    gates, keys = load_pool_rows(k_ptr, g_ptr, k_off, g_off, k_step, g_step, ring_ptr, ring_off, ring_head,
                                 ring_pos0, n_ring, live, d, P, RING, HAS_RING, ROW_SELECT)
    if LOADS_FIRST:
        tl.debug_barrier()
    return pool_rows(gates, keys, load_ape(ape_ptr, ape_stride, d, P), BN, P)


@triton.jit
def store_ring_rows(dst, tail_head, k, g, mask):
    """Key rows ``k`` at ring pointers ``dst``, gate rows ``g`` ``tail_head`` elements further, where ``mask``."""
    tl.store(dst, k, mask=mask)
    tl.store(dst + tail_head, g, mask=mask)


@triton.jit
def copy_rows_to_ring(tail_ptr, tail_head, dst_row, key_ptr, k_row, g_ptr, g_row, take, d):
    """Copy bf16 key / gate rows (element offsets ``k_row``/``g_row``) to ring rows ``dst_row`` where ``take``."""
    m = take[:, None]
    k = tl.load(key_ptr + k_row[:, None] + d[None, :], mask=m)
    g = tl.load(g_ptr + g_row[:, None] + d[None, :], mask=m)
    store_ring_rows(tail_ptr + dst_row[:, None] + d[None, :], tail_head, k, g, m)


@triton.jit
def seed_ring(tail_ptr, tail_block_stride, tail_head, key_ptr, key_stride, g_ptr, g_stride,
              end_row, end_pos, block, n_keep, d, RING: tl.constexpr, KEEP: tl.constexpr):
    """Copy token rows ``[end_row - n_keep, end_row)`` (positions ``[end_pos - n_keep, end_pos)``)
    to ring slots ``pos % RING`` of ``block`` (``n_keep <= KEEP``; ``block < 0`` copies nothing)."""
    j = tl.arange(0, KEEP)
    take = j < tl.where(block >= 0, n_keep, 0)
    back = n_keep - j  # 1..n_keep rows before the end
    dst = block * tail_block_stride + ((end_pos - back) % RING) * 128
    copy_rows_to_ring(tail_ptr, tail_head, dst, key_ptr, (end_row - back) * key_stride,
                      g_ptr, (end_row - back) * g_stride, take, d)
