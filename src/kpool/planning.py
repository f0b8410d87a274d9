"""A step's slots from per-request state: what ``KPoolCache`` plans, for engines to plan once per step.

Per request: its ring block, the tokens it already has, its pages (pool granularity, -1
padded). ``decode_slot_mappings`` gives a decode / verify step's ``slot_mapping`` /
``tail_slot_mapping`` on any device (elementwise, no host sync); ``prefill_plan`` gives a
packed prefill batch's metadata and ``write_prefill``'s tables (host work). Addresses follow
``layout``: flat slot ``page * PAGE + pool % PAGE``, ring slot ``block * RING + pos % RING``.
"""

from __future__ import annotations

from array import array
from typing import NamedTuple

import torch

from ._checks import INT_DTYPES, check_int, check_ring_depth, check_tensor, int_list


def _check_sizes(pool_size, page_size, ring) -> None:
    for name, value in (("pool_size", pool_size), ("page_size", page_size), ("ring", ring)):
        check_int(name, value)
    if ring % pool_size:
        raise ValueError(f"ring = {ring} must be a multiple of pool_size = {pool_size} (layout.ring_size)")


def _check_slot_ids(name: str, values: torch.Tensor, per: int) -> None:
    """Ids (pages, ring blocks) of host ``values`` address ``id * per + (per - 1)`` at most: that must
    fit in int64 (a larger id would wrap to a small, valid-looking slot)."""
    top = (torch.iinfo(torch.int64).max - per + 1) // per
    if values.numel() and int(values.max()) > top:
        raise ValueError(f"{name} holds {int(values.max())}: its slots (x {per}) overflow int64 (at most {top})")


def decode_slot_mappings(positions: torch.Tensor, ring_blocks: torch.Tensor, page_table: torch.Tensor,
                         pool_size: int, page_size: int, ring: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token mappings of a decode / verify step, as ``KPoolCache.decode`` builds them.

    ``slot_mapping`` and ``tail_slot_mapping`` are the same for every layer of a step: an
    engine can compute them once (on the GPU, inside a captured graph: elementwise torch, no
    host sync) and pass them to each layer's ``kpool_decode_update_and_maybe_write_cache_batched``,
    with ``metadata_ready=True`` where another kernel runs between (a model's key projection does).
    Eager, it is ~20 small ops; ``torch.compile(..., fullgraph=True)`` traces it whole (inductor
    on the CPU made it one fused kernel).

    positions : int ``[B, next_n]`` token positions, negative = padding.
    ring_blocks : int ``[B]`` each request's ring block.
    page_table : int ``[B, max_pages]`` pool-granular pages, -1 padded: pool ``m`` of row
        ``b`` lives at flat slot ``page_table[b, m // page_size] * page_size + m % page_size``.
    pool_size, page_size, ring : P, PAGE, RING (``ring_size``; at least ``P + next_n - 1``, the
        decode writer's rule: a smaller ring raises here, not at the first layer's write).

    Values are checked on the host only (no sync on a GPU): there a negative ring block of a
    live row gives negative tail slots, which the writers take for padding, and ids whose slots
    overflow int64 (``block * RING``, ``page * PAGE``) are not caught.

    Returns int64 ``(slot_mapping, tail_slot_mapping)``, each ``[B, next_n]``: the flat slot
    of pool ``pos // P`` where ``(pos + 1) % P == 0``, else -1 (also -1 where that pool's page
    is -1 or beyond ``max_pages``: allocate pages first, nothing checks it here);
    ``block * RING + pos % RING``, -1 on padding.
    """
    for name, t in (("positions", positions), ("ring_blocks", ring_blocks), ("page_table", page_table)):
        check_tensor(name, t, dtype=INT_DTYPES)
    _check_sizes(pool_size, page_size, ring)
    if positions.ndim != 2 or ring_blocks.shape != positions.shape[:1] or page_table.ndim != 2 \
            or page_table.shape[0] != positions.shape[0] or page_table.shape[1] < 1:
        raise ValueError(f"decode_slot_mappings takes positions [B, next_n], ring_blocks [B] and page_table "
                         f"[B, max_pages >= 1], got {list(positions.shape)}, {list(ring_blocks.shape)}, "
                         f"{list(page_table.shape)}")
    check_ring_depth("ring", ring, pool_size, positions.shape[1])
    for name, t in (("ring_blocks", ring_blocks), ("page_table", page_table)):
        if t.device != positions.device:
            raise ValueError(f"{name} is on {t.device}, positions on {positions.device}: pass them on one device")
    if positions.device.type == "cpu" and not torch.compiler.is_compiling():
        if bool(((positions >= 0) & (ring_blocks[:, None] < 0)).any()):
            raise ValueError("ring_blocks has a negative block for a request with live positions")
        _check_slot_ids("ring_blocks", ring_blocks, ring)
        _check_slot_ids("page_table", page_table, page_size)
    return slot_mappings(positions, ring_blocks, page_table, pool_size, page_size, ring)


def slot_mappings(positions, ring_blocks, page_table, pool_size: int, page_size: int, ring: int) -> tuple:
    """``decode_slot_mappings`` without its argument checks (``KPoolCache`` builds valid ones)."""
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

    Host work: integer tensors (any device: read back once) or lists. Returns a
    ``PrefillPlan`` on ``page_table``'s device. Raises naming the argument for non-integer or
    inconsistent inputs, a negative ring block, a missing page, or ids whose slots overflow int64.
    """
    _check_sizes(pool_size, page_size, ring)
    cu, start, blocks = (_host_ints(name, v) for name, v in (("cu_seqlens", cu_seqlens), ("starts", starts),
                                                             ("ring_blocks", ring_blocks)))
    device = page_table.device if torch.is_tensor(page_table) else torch.device("cpu")
    try:
        table = torch.as_tensor(page_table)
    except (TypeError, RuntimeError, ValueError):  # None, ragged lists, objects torch cannot read
        raise TypeError(f"page_table must be an integer tensor or array [R, max_pages], got "
                        f"{type(page_table).__name__}") from None
    if table.numel():
        check_tensor("page_table", table, dtype=INT_DTYPES)
    table = table.to("cpu", torch.int64)
    r = start.numel()
    if cu.shape != (r + 1,) or blocks.shape != (r,) or table.ndim != 2 or table.shape[0] != r \
            or table.shape[1] < 1:
        raise ValueError(f"prefill_plan takes cu_seqlens [R + 1], starts [R], ring_blocks [R] and page_table "
                         f"[R, max_pages >= 1], got {list(cu.shape)}, {list(start.shape)}, {list(blocks.shape)}, "
                         f"{list(table.shape)}")
    lengths = cu[1:] - cu[:-1]
    if r and (int(cu[0]) != 0 or bool((lengths < 0).any()) or bool((start < 0).any())):
        raise ValueError("prefill_plan: cu_seqlens must be non-decreasing offsets from 0 and starts non-negative")
    if bool((blocks < 0).any()):
        raise ValueError(f"ring_blocks must be non-negative (every request of a prefill is live), got "
                         f"{int(blocks.min())}")
    _check_slot_ids("ring_blocks", blocks, ring)
    _check_slot_ids("page_table", table, page_size)
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
    plan = PrefillPlan(torch.stack((meta[:, 0], locs), 1)[inside], requests, pos, slots, tslots, meta, locs)
    return plan if device.type == "cpu" else PrefillPlan(*(t.to(device) for t in plan))


def _host_ints(name, values) -> torch.Tensor:
    """int64 host ``[n]`` of a 1-D integer tensor (any device) or a sequence of ints."""
    if torch.is_tensor(values):
        check_tensor(name, values, dtype=INT_DTYPES, ndim=1)
        return values.to("cpu", torch.int64)
    try:
        return host_int64(int_list(name, values))
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def host_int64(values) -> torch.Tensor:
    """int64 CPU tensor ``[len(values)]`` of Python ints (unchecked), through an ``array``: a
    quarter of ``torch.tensor``'s time for a step's per-request lists (17 vs 67 us at 1,024). An int
    outside int64 raises ``ValueError``, as ``torch.tensor`` does."""
    try:
        buf = array("q", values)
    except OverflowError as e:
        raise ValueError(f"an integer outside int64: {e}") from None
    return torch.frombuffer(buf, dtype=torch.int64) if buf else torch.empty(0, dtype=torch.int64)
