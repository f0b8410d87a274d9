"""Byte layouts, fp8 formats and slot arithmetic: the one place addresses are defined.

Indexer K cache ``kv_cache [num_pages, PAGE, 132] uint8`` holds one entry ("state") per
pool. Inside page ``p`` (base byte ``p * kv_cache.stride(0)``):

* bytes ``[0, PAGE*128)``: fp8 key codes; byte of (state ``s``, dim ``d``) is
  ``s*128 + d`` (``plain``) or ``(s//16)*2048 + (d//16)*256 + (s%16)*16 + d%16``
  (``preshuffle``, ROCm, ``PAGE % 16 == 0``);
* bytes ``[PAGE*128, PAGE*132)``: fp32 scales, state ``s`` at ``PAGE*128 + 4*s``.

Flat slot ``loc = page * PAGE + s``. Tail ring ``tail [num_blocks, 2, RING, 128] bf16``:
``[b, 0]`` raw keys, ``[b, 1]`` gate scores; token ``pos`` of the request owning block
``b`` lives at ``tslot = b * RING + pos % RING``.

A step's slots from per-request state are planned in ``planning``.
"""

from __future__ import annotations

import torch

HEAD_DIM = 128
SCALE_BYTES = 4
ENTRY_BYTES = HEAD_DIM + SCALE_BYTES  # 132
LAYOUTS = ("plain", "preshuffle")
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
HADAMARD_SCALE = 0.08838834764831845  # fp32(1/sqrt(128))
AMAX_FLOOR = 1e-4
TILE = 16  # preshuffle tile edge (states and dims)


def is_rocm() -> bool:
    return torch.version.hip is not None


def _gcn_arch(device: torch.device | None) -> str:
    if not (is_rocm() and torch.cuda.is_available()):
        return ""
    return torch.cuda.get_device_properties(device or 0).gcnArchName


def default_layout(device: torch.device | str | None = None, page_size: int | None = None) -> str:
    """``preshuffle`` on ROCm GPUs, ``plain`` everywhere else, and for one-entry pages
    (``page_size == 1``: no 16-state tile; the seed writes those plain too)."""
    dev = torch.device(device) if device is not None else None
    if is_rocm() and (dev is None or dev.type == "cuda") and page_size != 1:
        return "preshuffle"
    return "plain"


def default_fp8_dtype(device: torch.device | str | None = None) -> torch.dtype:
    """``float8_e4m3fnuz`` on gfx942 (MI300), ``float8_e4m3fn`` everywhere else."""
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type != "cuda":
        return torch.float8_e4m3fn
    return torch.float8_e4m3fnuz if "gfx942" in _gcn_arch(dev) else torch.float8_e4m3fn


def fp8_max(fp8_dtype: torch.dtype) -> float:
    """Largest finite value of the format (448 for e4m3fn, 240 for e4m3fnuz)."""
    return float(torch.finfo(fp8_dtype).max)


def resolve_layout(layout: str | None, device, page_size: int | None = None) -> str:
    """``layout``, or ``default_layout(device, page_size)`` when it is None."""
    if layout is None:
        return default_layout(device, page_size)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def resolve_fp8_dtype(fp8_dtype: torch.dtype | None, device) -> torch.dtype:
    if fp8_dtype is None:
        return default_fp8_dtype(device)
    if fp8_dtype not in FP8_DTYPES:
        raise TypeError(f"fp8_dtype must be one of {FP8_DTYPES}, got {fp8_dtype}")
    return fp8_dtype


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` of host ints (``triton.cdiv`` is a ``ConstexprFunction``: ~2 µs a host call)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The least power of two ``>= n``, 1 for ``n <= 1`` (``triton.next_power_of_2``'s host value
    for ``n >= 1``; it gives 0 for 0)."""
    return 1 << max(n - 1, 0).bit_length()


def ring_size(pool_size: int, num_spec_tokens: int = 0) -> int:
    """Ring slots per request: ``P * next_pow2(ceil((P + num_spec) / P))`` (vLLM's rule).

    Always a multiple of ``P`` and at least ``P + num_spec_tokens``.
    """
    groups = cdiv(pool_size + num_spec_tokens, pool_size)
    return pool_size * next_pow2(groups)


def key_byte_offset(state: torch.Tensor, dim: torch.Tensor, layout: str) -> torch.Tensor:
    """Byte offset inside a page of key code (state, dim); broadcasting int64 tensors."""
    if layout == "plain":
        return state * HEAD_DIM + dim
    return (state // TILE) * (TILE * HEAD_DIM) + (dim // TILE) * (TILE * TILE) + (state % TILE) * TILE + dim % TILE


def entry_byte_offsets(kv_cache: torch.Tensor, loc: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat byte offsets (from ``kv_cache``'s first byte) of the entries at flat slots ``loc``.

    Returns ``(key_offsets [n, 128] int64, scale_offsets [n, 4] int64)``.
    """
    page_size = kv_cache.shape[1]
    loc = loc.to(torch.int64)
    page, state = loc // page_size, loc % page_size
    base = page * kv_cache.stride(0)
    dims = torch.arange(HEAD_DIM, device=loc.device, dtype=torch.int64)
    key = base[:, None] + key_byte_offset(state[:, None], dims[None, :], layout)
    sb = torch.arange(SCALE_BYTES, device=loc.device, dtype=torch.int64)
    scale = base[:, None] + page_size * HEAD_DIM + state[:, None] * SCALE_BYTES + sb[None, :]
    return key, scale


def flat_bytes(kv_cache: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 view over every byte the cache's pages span (real strides honoured)."""
    num_pages, page_size, _ = kv_cache.shape
    span = (num_pages - 1) * kv_cache.stride(0) + page_size * ENTRY_BYTES if num_pages else 0
    return torch.as_strided(kv_cache, (span,), (1,), kv_cache.storage_offset())


def read_entries(kv_cache: torch.Tensor, loc: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored entries at flat slots ``loc [n]``: ``(codes [n, 128] uint8, scales [n] fp32)``."""
    key_off, scale_off = entry_byte_offsets(kv_cache, loc, layout)
    flat = flat_bytes(kv_cache)
    codes = flat[key_off]
    scales = flat[scale_off].contiguous().view(torch.float32).reshape(-1)
    return codes, scales


def write_entries(kv_cache: torch.Tensor, loc: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                  layout: str) -> None:
    """Write ``codes [n, 128] uint8`` and ``scales [n] fp32`` at flat slots ``loc [n]`` in place."""
    if loc.numel() == 0:
        return
    key_off, scale_off = entry_byte_offsets(kv_cache, loc, layout)
    flat = flat_bytes(kv_cache)
    flat[key_off.reshape(-1)] = codes.reshape(-1)
    flat[scale_off.reshape(-1)] = scales.to(torch.float32).contiguous().view(torch.uint8).reshape(-1)
