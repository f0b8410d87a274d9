"""Complete pools -> fp8 cache entries (prefill, chunked prefill).

``kpool_compress_and_write_cache`` is the seed-compatible entry point (pools gathered as
``[n_pools, P, 128]``, any strides, token-major windows included). ``KPoolCache.prefill``
writes through ``ops.prefill``, which shares this module's tile sizes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import reference
from .._backend import backend_for, interpreting, native_fp8, on_device_of, pdl_launch
from .._checks import (INT_DTYPES, check_bool, check_head_dim, check_index_ranges, check_kv_cache,
                       check_pool_size, check_tensor)
from ..layout import HEAD_DIM, cdiv, fp8_max, resolve_fp8_dtype, resolve_layout
from . import _jit, _pdl

# Pools per one-warp program, by P: on the H200 2 pools (P=4) and 1 pool (P=16) beat 1-32
# pools on 1-8 warps (benchmarks/LOG.md); the CPU interpreter runs fewer, larger programs
# faster. The bytes do not depend on the tile size.
BLOCK_POOLS = {4: 2}
NUM_WARPS = 1
INTERPRETER_BLOCK_POOLS = 16
# The pool writers issue all their row loads before the pooling (pool_vector's LOADS_FIRST
# barrier) when a program reads at most this many pool slots (BN * P): without it ptxas sinks
# some of the prefill writer's row loads into the pooling. H100 with 39 SMs held (an H200's
# bandwidth per SM), ab.py main / this rule / main: prefill P=4 60.77 / 60.05 / 60.65 us (no SMs
# held 51.07 / 50.35 / 51.10), compress P=4 65K 58.45 / 58.04 / 58.64, P=16 unchanged; a barrier
# at P=16 too (16 slots) cost 7% there (prefill 50.64 -> 54.42): benchmarks/LOG.md, 53rd session.
LOADS_FIRST_SLOTS = tl.constexpr(8)


@triton.jit
def _compress_kernel(kv_ptr, kv_f32_ptr, page_stride, num_slots,
                     k_ptr, g_ptr, k_pool_stride, k_slot_stride, g_pool_stride, g_slot_stride,
                     ape_ptr, ape_stride, loc_ptr, mask_ptr, codes_ptr, scale_ptr, n_pools,
                     P: tl.constexpr, PAGE: tl.constexpr, BN: tl.constexpr,
                     PRESHUFFLE: tl.constexpr, FP8_MAX: tl.constexpr, FNUZ: tl.constexpr,
                     ROUND_SCALE: tl.constexpr, HAS_MASK: tl.constexpr,
                     WRITE_CACHE: tl.constexpr, RETURN_COMPRESSED: tl.constexpr, NATIVE_FP8: tl.constexpr,
                     PDL: tl.constexpr):
    _pdl.grid_dependency_sync(PDL)
    # One program per BN pools; pool i's slot s is at k_ptr + i*k_pool_stride + s*k_slot_stride.
    i, own, read = _jit.pool_tile(tl.program_id(0), n_pools, BN)
    # contiguity 4: the bf16 rows are loaded 4 dims per thread, the layout of the fp32 ape rows,
    # so those need no shuffles (H200, P=4, 262,144 pools: 174.4 -> 169.9 us; P=16 unchanged)
    d = tl.max_contiguous(tl.arange(0, 128), 4)
    if WRITE_CACHE:  # slots loaded first: their round trip overlaps the rows' instead of ending the program
        loc = tl.load(loc_ptr + i, mask=read, other=-1).to(tl.int64)
        ok = own & (loc >= 0) & (loc < num_slots)
        if HAS_MASK:
            ok = ok & (tl.load(mask_ptr + i, mask=read, other=0) != 0)
    x = _jit.pool_vector(k_ptr, g_ptr, i * k_pool_stride, i * g_pool_stride, k_slot_stride, g_slot_stride,
                         k_ptr, i, 0, i, i, ape_ptr, ape_stride, d, read, BN, P, P, False, False,
                         BN * P <= LOADS_FIRST_SLOTS)
    codes, scale = _jit.quantize(_jit.rotate(x, BN), FP8_MAX, FNUZ, ROUND_SCALE, NATIVE_FP8)
    if WRITE_CACHE:
        _jit.store_entries(kv_ptr, kv_f32_ptr, page_stride, loc, ok, codes, scale, d, PAGE, PRESHUFFLE)
    if RETURN_COMPRESSED:
        tl.store(codes_ptr + i[:, None] * 128 + d[None, :], codes, mask=own[:, None])
        tl.store(scale_ptr + i, scale, mask=own)


def block_pools(pool_size: int, n_pools: int) -> int:
    """Pools per program of the pool writers over ``n_pools >= 1`` pools: ``BLOCK_POOLS`` (the
    interpreter's own size on the CPU), halved while it exceeds ``n_pools`` (``_jit.pool_tile``:
    a program's pools all exist)."""
    block = INTERPRETER_BLOCK_POOLS if interpreting() else BLOCK_POOLS.get(pool_size, 1)
    while block > n_pools:
        block //= 2
    return block


def launch_compress(kv_cache, k, g, ape, loc, n_pools, pool_size, fp8_dtype, layout,
                    round_scale=True, write_mask=None, codes=None, scale=None):
    """Launch ``_compress_kernel`` over ``n_pools`` pools ``k``/``g [n_pools, P, 128]`` (arguments
    already validated); ``codes``/``scale``: optional compact outputs."""
    if n_pools == 0:
        return
    write = kv_cache is not None
    cache_u8 = kv_cache if write else k  # unused pointers point at k
    cache_f32 = kv_cache.view(torch.float32) if write else k
    block = block_pools(pool_size, n_pools)
    _compress_kernel[(cdiv(n_pools, block),)](
        cache_u8, cache_f32, kv_cache.stride(0) if write else 0,
        kv_cache.shape[0] * kv_cache.shape[1] if write else 0,
        k, g, k.stride(0), k.stride(1), g.stride(0), g.stride(1),
        ape, ape.stride(0), loc if loc is not None else k, write_mask if write_mask is not None else k,
        codes if codes is not None else k, scale if scale is not None else k, n_pools,
        P=pool_size, PAGE=kv_cache.shape[1] if write else 1, BN=block,
        PRESHUFFLE=layout == "preshuffle", FP8_MAX=fp8_max(fp8_dtype),
        FNUZ=fp8_dtype == torch.float8_e4m3fnuz, ROUND_SCALE=round_scale,
        HAS_MASK=write_mask is not None, WRITE_CACHE=write, RETURN_COMPRESSED=codes is not None,
        NATIVE_FP8=native_fp8(k.device, fp8_dtype),
        num_warps=NUM_WARPS, enable_fp_fusion=False, **pdl_launch(k.device),
    )


@on_device_of("slot_k")
def kpool_compress_and_write_cache(kv_cache, slot_k, slot_score, ape, loc, pool_size, head_dim=HEAD_DIM,
                                   write_mask=None, round_scale=True, return_compressed=False, write_cache=True,
                                   *, layout=None, fp8_dtype=None):
    """Compress complete pools and write each at its flat cache slot, in place.

    Parameters
    ----------
    kv_cache : uint8 ``[num_pages, PAGE, 132]`` indexer K cache (page stride may be padded).
    slot_k, slot_score : bf16 ``[n_pools, P, 128]`` raw keys / gate scores (any pool and slot
        strides, unit inner stride; a token-major window view works without a copy).
    ape : fp32 ``[P, 128]`` per-slot position bias.
    loc : int64 ``[n_pools]`` flat slot ``page*PAGE + state``; negative = skip; the written
        slots must be distinct.
    pool_size : P.
    write_mask : optional bool ``[n_pools]``: only rows with True are written.
    round_scale : power-of-two (ue8m0) scales when True.
    return_compressed : also return ``(codes [n_pools, 128] fp8_dtype, scale [n_pools] fp32)``.
    write_cache : write into ``kv_cache`` (at least one of this and ``return_compressed``).
    layout : ``"plain"`` or ``"preshuffle"`` (default: preshuffle on ROCm, else plain).
    fp8_dtype : ``torch.float8_e4m3fn`` or ``torch.float8_e4m3fnuz`` (default from the platform).
    """
    check_head_dim(head_dim)
    for name, flag in (("round_scale", round_scale), ("return_compressed", return_compressed),
                       ("write_cache", write_cache)):
        check_bool(name, flag)
    check_pool_size(pool_size)
    check_tensor("slot_k", slot_k, dtype=torch.bfloat16, ndim=3, shape=(None, pool_size, HEAD_DIM),
                 inner_contiguous=True)
    device = slot_k.device
    n = slot_k.shape[0]
    check_tensor("slot_score", slot_score, dtype=torch.bfloat16, shape=tuple(slot_k.shape), device=device,
                 inner_contiguous=True)
    check_tensor("ape", ape, dtype=torch.float32, shape=(pool_size, HEAD_DIM), device=device, inner_contiguous=True)
    if not (write_cache or return_compressed):
        raise ValueError("nothing to do: write_cache=False and return_compressed=False")
    fp8_dtype = resolve_fp8_dtype(fp8_dtype, device)
    layout = check_kv_cache(kv_cache, layout, device) if write_cache else resolve_layout(layout, device)
    if write_mask is not None:
        check_tensor("write_mask", write_mask, dtype=torch.bool, shape=(n,), device=device)
    if write_cache:
        check_tensor("loc", loc, dtype=INT_DTYPES, shape=(n,), device=device)
        check_index_ranges([("loc", loc, kv_cache.shape[0] * kv_cache.shape[1], "cache slots")],
                           distinct=[("loc", lambda: (loc, (loc >= 0) & (True if write_mask is None else write_mask)),
                                      "cache slots written")])
    if backend_for(device) == "torch":
        return reference.compress_and_write(kv_cache, slot_k, slot_score, ape, loc, write_mask, fp8_dtype, layout,
                                            round_scale, return_compressed, write_cache)
    codes = scale = None
    if return_compressed:
        codes = torch.empty((n, HEAD_DIM), dtype=torch.uint8, device=device)
        scale = torch.empty((n,), dtype=torch.float32, device=device)
    launch_compress(kv_cache if write_cache else None, slot_k, slot_score, ape,
                    loc.contiguous() if write_cache else None, n, pool_size, fp8_dtype, layout, round_scale,
                    write_mask.contiguous() if write_mask is not None else None, codes=codes, scale=scale)
    if return_compressed:
        return codes.view(fp8_dtype), scale
    return None
