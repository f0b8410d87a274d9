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

Step plans from per-request state (ring block, tokens already written, pages):
``decode_slot_mappings`` (a decode / verify step's ``slot_mapping`` / ``tail_slot_mapping``,
on any device) and ``prefill_plan`` (a packed prefill batch's metadata and ``write_prefill``'s
tables, on the host); ``KPoolCache`` plans its steps with them.
"""

from __future__ import annotations

from typing import NamedTuple

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


def ring_size(pool_size: int, num_spec_tokens: int = 0) -> int:
    """Ring slots per request: ``P * next_pow2(ceil((P + num_spec) / P))`` (vLLM's rule).

    Always a multiple of ``P`` and at least ``P + num_spec_tokens``.
    """
    groups = -(-(pool_size + num_spec_tokens) // pool_size)
    return pool_size * (1 << (groups - 1).bit_length())


def decode_slot_mappings(positions: torch.Tensor, ring_blocks: torch.Tensor, page_table: torch.Tensor,
                         pool_size: int, page_size: int, ring: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token mappings of a decode / verify step, as ``KPoolCache.decode`` builds them.

    ``slot_mapping`` and ``tail_slot_mapping`` are the same for every layer of a step: an
    engine can compute them once (on the GPU, inside a captured graph: elementwise torch, no
    host sync) and pass them to each layer's ``kpool_decode_update_and_maybe_write_cache_batched``.
    Eager, it is ~20 small ops; ``torch.compile(..., fullgraph=True)`` traces it whole (inductor
    on the CPU made it one fused kernel).

    positions : int ``[B, next_n]`` token positions, negative = padding.
    ring_blocks : int ``[B]`` each request's ring block.
    page_table : int ``[B, max_pages]`` pool-granular pages, -1 padded: pool ``m`` of row
        ``b`` lives at flat slot ``page_table[b, m // page_size] * page_size + m % page_size``.
    pool_size, page_size, ring : P, PAGE, RING (``ring_size``).

    Returns int64 ``(slot_mapping, tail_slot_mapping)``, each ``[B, next_n]``: the flat slot
    of pool ``pos // P`` where ``(pos + 1) % P == 0``, else -1 (also -1 where that pool's page
    is -1 or beyond ``max_pages``: allocate pages first, nothing checks it here);
    ``block * RING + pos % RING``, -1 on padding.
    """
    if positions.ndim != 2 or ring_blocks.shape != positions.shape[:1] or page_table.ndim != 2 \
            or page_table.shape[0] != positions.shape[0] or page_table.shape[1] < 1:
        raise ValueError(f"decode_slot_mappings takes positions [B, next_n], ring_blocks [B] and page_table "
                         f"[B, max_pages >= 1], got {list(positions.shape)}, {list(ring_blocks.shape)}, "
                         f"{list(page_table.shape)}")
    for name, t in (("ring_blocks", ring_blocks), ("page_table", page_table)):
        if t.device != positions.device:
            raise ValueError(f"{name} is on {t.device}, positions on {positions.device}: pass them on one device")
    pos = positions.to(torch.int64)
    live = pos >= 0
    pool = pos.clamp(min=0) // pool_size
    col = pool // page_size
    page = page_table.to(torch.int64).gather(1, col.clamp(max=page_table.shape[1] - 1))
    page = torch.where(col < page_table.shape[1], page, -1)
    completes = live & (pos % pool_size == pool_size - 1) & (page >= 0)
    slot_mapping = torch.where(completes, page * page_size + pool % page_size, -1)
    tail_slot_mapping = torch.where(live, ring_blocks.to(torch.int64)[:, None] * ring + pos % ring, -1)
    return slot_mapping, tail_slot_mapping


class PrefillPlan(NamedTuple):
    """What a packed prefill batch passes to the writers (``prefill_plan``); int64 tensors.

    pools : ``[n, 2]`` (token row of slot 0, flat slot) of each pool inside its chunk:
        ``write_prefill``'s ``pools``.
    requests : ``[R, 8]`` ``write_prefill``'s ``requests``: ``(end_row, end_pos, block,
        n_keep)`` (the chunk's last ``n_keep = min(n, end_pos % P)`` tokens go to its ring;
        ``n_keep`` 0 when the chunk ends on a pool boundary), then the head pool ``(row of
        slot 0, position of slot 0, slots read from the ring, flat slot)`` when the chunk
        starts mid-pool and completes it, else ``(0, 0, 0, -1)``.
    positions, slot_mapping, tail_slot_mapping : ``[T]`` per token, as a decode step's.
    pool_meta : ``[n_all, 4]`` every pool the batch completes, head pools included: (token row
        of slot 0, ring block, position of slot 0, leading slots read from the ring).
    pool_locs : ``[n_all]`` their flat slots.
    """

    pools: torch.Tensor
    requests: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    tail_slot_mapping: torch.Tensor
    pool_meta: torch.Tensor
    pool_locs: torch.Tensor


def concat_ranges(starts: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``arange(starts[i], starts[i] + counts[i])`` for every ``i``, concatenated (int64 ``[R]`` in;
    the output size is read from ``counts``: host tensors)."""
    total = int(counts.sum())
    return (starts - torch.cumsum(counts, 0) + counts).repeat_interleave(counts, output_size=total) \
        + torch.arange(total, device=starts.device)


def prefill_plan(cu_seqlens, starts, ring_blocks, page_table, pool_size: int, page_size: int,
                 ring: int) -> PrefillPlan:
    """Plan a packed prefill batch, as ``KPoolCache.prefill`` does: request ``i``'s chunk is
    token rows ``[cu_seqlens[i], cu_seqlens[i + 1])`` at positions from ``starts[i]`` (the
    tokens it already has), its ring block ``ring_blocks[i]``, its pages row ``i`` of
    ``page_table``.

    cu_seqlens : int ``[R + 1]`` non-decreasing token offsets from 0.
    starts, ring_blocks : int ``[R]``, ``starts >= 0``.
    page_table : int ``[R, max_pages]`` pool-granular pages, -1 padded: every pool a chunk
        completes, ``(starts[i] + n_i) // P`` pools in all, must have its page.
    pool_size, page_size, ring : P, PAGE, RING (``ring_size``).

    Host work on host tensors (lists are taken too); returns a ``PrefillPlan`` on the inputs'
    device. Raises ``ValueError`` naming the argument for inconsistent inputs or a missing page.
    """
    i64 = torch.int64
    cu = torch.as_tensor(cu_seqlens, dtype=i64)
    start = torch.as_tensor(starts, dtype=i64)
    blocks = torch.as_tensor(ring_blocks, dtype=i64)
    table = torch.as_tensor(page_table).to(i64)
    r = start.numel()
    if cu.shape != (r + 1,) or blocks.shape != (r,) or table.ndim != 2 or table.shape[0] != r \
            or table.shape[1] < 1:
        raise ValueError(f"prefill_plan takes cu_seqlens [R + 1], starts [R], ring_blocks [R] and page_table "
                         f"[R, max_pages >= 1], got {list(cu.shape)}, {list(start.shape)}, {list(blocks.shape)}, "
                         f"{list(table.shape)}")
    lengths = cu[1:] - cu[:-1]
    if r and (int(cu[0]) != 0 or bool((lengths < 0).any()) or bool((start < 0).any())):
        raise ValueError("prefill_plan: cu_seqlens must be non-decreasing offsets from 0 and starts non-negative")
    p = pool_size
    row0, end = cu[:-1], start + lengths
    # pools the chunks complete: a // P .. b // P - 1 of each request
    first, n_pools = start // p, end // p - start // p
    owner = torch.arange(r, device=start.device).repeat_interleave(n_pools)
    pools = concat_ranges(first, n_pools)
    col = pools // page_size
    if pools.numel() and int(col.max()) >= table.shape[1]:
        raise ValueError(f"page_table has {table.shape[1]} pages per row; the batch completes pool "
                         f"{int(pools[col.argmax()])} (page {int(col.max())})")
    page = table[owner, col]
    if bool((page < 0).any()):
        k = int((page < 0).nonzero()[0, 0])
        raise ValueError(f"page_table row {int(owner[k])} has no page {int(col[k])} for pool {int(pools[k])}")
    locs = page * page_size + pools % page_size
    meta = torch.stack((row0[owner] + pools * p - start[owner], blocks[owner], pools * p,
                        (start[owner] - pools * p).clamp_(min=0)), dim=1)
    # a chunk starting mid-pool that completes it reads the pool's leading slots from the ring
    lead = start % p
    head = (lead != 0) & (n_pools > 0)
    first_loc = torch.full_like(start, -1)
    first_loc[head] = locs[(torch.cumsum(n_pools, 0) - n_pools)[head]]
    requests = torch.stack((cu[1:], end, blocks, torch.minimum(lengths, end % p),
                            torch.where(head, row0 - lead, 0), torch.where(head, start - lead, 0),
                            torch.where(head, lead, 0), first_loc), dim=1)
    pos = concat_ranges(start, lengths)
    slots = torch.full_like(pos, -1)
    slots[meta[:, 0] + (p - 1)] = locs  # each pool's last token (row) completes it
    tslots = (blocks * ring).repeat_interleave(lengths) + pos % ring
    inside = meta[:, 3] == 0  # head pools are written by their request's program
    return PrefillPlan(torch.stack((meta[:, 0], locs), 1)[inside], requests, pos, slots, tslots, meta, locs)


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
