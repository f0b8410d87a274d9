"""Host-side argument validation shared by every public op. Errors name the argument."""

from __future__ import annotations

import contextlib
import contextvars
import operator
import os

import torch

from .layout import ENTRY_BYTES, HEAD_DIM, TILE, resolve_layout

INT_DTYPES = (torch.int32, torch.int64)
DEVICE_TYPES = ("cpu", "cuda")  # torch device types kpool runs on ("cuda" includes ROCm builds)


def check_tensor(name: str, t, *, dtype=None, ndim: int | None = None, shape=None, device=None,
                 inner_contiguous: bool = False) -> None:
    """Raise ``TypeError``/``ValueError`` naming ``name`` unless ``t`` matches.

    ``dtype`` may be a dtype or a tuple of allowed dtypes; ``shape`` entries of ``None``
    are free.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    check_device_type(name, t.device)
    if dtype is not None:
        allowed = dtype if isinstance(dtype, tuple) else (dtype,)
        if t.dtype not in allowed:
            want = " or ".join(str(a) for a in allowed)
            raise TypeError(f"{name} must have dtype {want}, got {t.dtype}")
    if ndim is not None and t.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if shape is not None:
        if t.ndim != len(shape) or any(w is not None and w != s for w, s in zip(shape, t.shape)):
            want = "[" + ", ".join("*" if w is None else str(w) for w in shape) + "]"
            raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")
    if device is not None and not same_device(t.device, torch.device(device)):
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    if inner_contiguous and t.ndim and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a unit inner stride, got strides {t.stride()}")


def check_device_type(name: str, device) -> None:
    """``device`` (a tensor's, or the one ``name`` asks for) must be one kpool runs on."""
    if torch.device(device).type not in DEVICE_TYPES:
        raise ValueError(f"{name} is on {device}: kpool runs on {' and '.join(DEVICE_TYPES)} (ROCm included) tensors")


def same_device(a: torch.device, b: torch.device) -> bool:
    """Equal devices, a missing index meaning the current device of that type."""
    if a.type != b.type:
        return False
    if a.type == "cuda":
        return (a.index if a.index is not None else torch.cuda.current_device()) == \
            (b.index if b.index is not None else torch.cuda.current_device())
    return True


def int_list(name: str, values) -> list[int]:
    """Host ints of ``values``: a sequence of integers or a 1-D integer tensor (read back once);
    a float, bool or NaN entry raises naming ``name`` instead of being truncated."""
    if torch.is_tensor(values):
        if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
            raise TypeError(f"{name} must hold integers, got a {values.dtype} tensor")
        if values.ndim != 1:
            raise ValueError(f"{name} must be 1-D, got shape {list(values.shape)}")
        return values.tolist()
    if type(values) in (list, tuple) and all(type(v) is int for v in values):  # the common case, one pass
        return list(values)
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{name} must be a sequence of ints or a 1-D integer tensor, got {type(values).__name__}")
    out = []
    for v in values:
        if isinstance(v, bool) or (torch.is_tensor(v) and v.dtype == torch.bool):
            raise TypeError(f"{name} must hold integers, got {v!r}")
        try:
            out.append(operator.index(v))
        except TypeError:
            raise TypeError(f"{name} must hold integers, got {v!r}") from None
    return out


def check_bool(name: str, value) -> None:
    """``value`` must be a bool (a truthy string or int is a mistake, not a flag)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


MAX_SELECT = 2**31 - 1  # columns of a selection row: its ids and token positions are int32


def check_int(name: str, value, least: int | None = 1, most: int | None = None) -> None:
    """``value`` must be an int (a bool is not one here; ``TypeError``) in ``[least, most]``
    (``ValueError``; no bound where None: the caller checks the range itself). A
    ``torch.SymInt`` (a fake's argument traced from a shape) counts as an int; its comparisons
    become the graph's guards."""
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if least is not None and value < least:
        raise ValueError(f"{name} must be a positive int, got {value}" if least == 1
                         else f"{name} must be >= {least}, got {value}")
    if most is not None and value > most:
        raise ValueError(f"{name} must be at most {most}, got {value}")


def check_pool_size(pool_size: int, name: str = "pool_size") -> None:
    check_int(name, pool_size)


MAX_SLOTS = 2**31  # cache slots (num_pages * PAGE) the writers address with 32-bit arithmetic


def check_slot_count(name: str, slots: int) -> None:
    """A cache of ``slots`` slots (num_pages * PAGE) must fit the writers' 32-bit slot arithmetic."""
    if slots > MAX_SLOTS:
        raise ValueError(f"{name} has {slots} slots; the kernels address at most {MAX_SLOTS} "
                         "(2^31, 32-bit slot arithmetic)")


def check_kv_cache(kv_cache, layout: str | None, device) -> str:
    """``kv_cache [num_pages, PAGE, 132] uint8`` with 4-byte-aligned pages and unit inner strides;
    returns ``layout`` resolved for the device and PAGE (``layout.resolve_layout``)."""
    check_tensor("kv_cache", kv_cache, dtype=torch.uint8, ndim=3, device=device)
    if kv_cache.shape[2] != ENTRY_BYTES:
        raise ValueError(f"kv_cache must have last dim {ENTRY_BYTES} (128 key bytes + 4 scale bytes), "
                         f"got shape {list(kv_cache.shape)}")
    page = kv_cache.shape[1]
    if kv_cache.stride(2) != 1 or kv_cache.stride(1) != ENTRY_BYTES:
        raise ValueError(f"kv_cache pages must be dense inside (strides [*, 132, 1]), got {kv_cache.stride()}")
    if kv_cache.shape[0] > 1 and kv_cache.stride(0) < page * ENTRY_BYTES:
        raise ValueError(f"kv_cache.stride(0) = {kv_cache.stride(0)} overlaps pages of {page * ENTRY_BYTES} bytes")
    if kv_cache.stride(0) % 4 or kv_cache.storage_offset() % 4:
        raise ValueError("kv_cache pages must start on 4-byte boundaries (fp32 scales): "
                         f"stride(0) = {kv_cache.stride(0)}, storage_offset = {kv_cache.storage_offset()}")
    check_slot_count("kv_cache", kv_cache.shape[0] * page)
    layout = resolve_layout(layout, device, page)
    check_page_layout("kv_cache's page size (shape[1])", page, layout)
    return layout


def check_page_layout(name: str, page: int, layout: str) -> None:
    """The preshuffled layout tiles pages of 16 states: ``page`` must be a multiple of 16."""
    if layout == "preshuffle" and page % TILE:
        raise ValueError(f"layout='preshuffle' needs {name} to be a multiple of {TILE}, got {page}")


def check_tail(tail, pool_size: int, device, name: str = "tail_kv_cache") -> int:
    """``tail [num_blocks, 2, RING, 128] bf16`` with dense rows; returns RING."""
    check_tensor(name, tail, dtype=torch.bfloat16, ndim=4, device=device)
    if tail.shape[1] != 2 or tail.shape[3] != HEAD_DIM:
        raise ValueError(f"{name} must have shape [num_blocks, 2, RING, {HEAD_DIM}], got {list(tail.shape)}")
    ring = tail.shape[2]
    if ring < pool_size or ring % pool_size:
        raise ValueError(f"{name} ring size (shape[2] = {ring}) must be a positive multiple of "
                         f"pool_size = {pool_size}")
    if tail.stride(3) != 1 or tail.stride(2) != HEAD_DIM:
        raise ValueError(f"{name} rows must be dense (strides [*, *, 128, 1]), got {tail.stride()}")
    # blocks and key / gate halves: each a RING x 128 tile, none may share memory with another
    outer = sorted((tail.stride(i), tail.shape[i]) for i in (0, 1) if tail.shape[i] > 1)
    span = ring * HEAD_DIM
    for stride, n in outer:
        if stride < span:
            raise ValueError(f"{name} strides {tail.stride()} make its num_blocks x 2 rings overlap (each "
                             f"RING x 128 = {ring * HEAD_DIM} elements)")
        span = stride * (n - 1) + span
    return ring


def check_ring_depth(name: str, ring: int, pool_size: int, next_n: int) -> None:
    """Steps of ``next_n`` tokens need ``RING >= P + next_n - 1``: the committed ring entries
    that a redo after rejected drafts reads must survive the step's speculative stashes."""
    if next_n - 1 > ring - pool_size:
        raise ValueError(f"{name} RING = {ring} is too small for steps of next_n = {next_n} tokens "
                         f"({next_n - 1} speculative): RING >= P + next_n - 1 = {pool_size + next_n - 1} keeps the "
                         "committed ring entries that a redo after rejected drafts needs (RING = P only without "
                         "speculation)")


def check_head_dim(head_dim: int) -> None:
    if type(head_dim) is not int or head_dim != HEAD_DIM:
        raise ValueError(f"head_dim must be {HEAD_DIM} (Hadamard-128), got {head_dim}")


_OWN_INDICES = contextvars.ContextVar("kpool_own_indices", default=False)


@contextlib.contextmanager
def own_indices():
    """Inside the block the sync-needing range checks are skipped: for index tensors the caller
    built itself from its own state (``KPoolCache``'s page tables and positions), whose checks
    would each wait for the GPU between launches."""
    token = _OWN_INDICES.set(True)
    try:
        yield
    finally:
        _OWN_INDICES.reset(token)


def range_checks_enabled() -> bool:
    """Sync-needing value checks (slot ranges) run unless ``KPOOL_CHECK=0``, a graph is captured,
    or inside ``own_indices``."""
    if os.environ.get("KPOOL_CHECK", "1") == "0" or _OWN_INDICES.get():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def check_index_range(name: str, t: torch.Tensor, upper: int, what: str) -> None:
    """Every non-negative entry of ``t`` must be ``< upper`` (negatives are padding)."""
    check_index_ranges([(name, t, upper, what)])


_NONE = torch.iinfo(torch.int64).max  # sorts after every live value


def _repeat_flag(values: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """0-dim int64 on ``values``' device: 1 when two live entries are equal (one sort, no sync)."""
    s = torch.where(live, values.to(torch.int64), _NONE).flatten().sort().values
    return ((s[1:] == s[:-1]) & (s[1:] != _NONE)).any().to(torch.int64)


def row_blocks(blocks: torch.Tensor, live: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, live)`` listing each row's distinct live ``blocks [rows, n]`` once, so a value
    that repeats across them is a block two rows use."""
    s = torch.where(live, blocks.to(torch.int64), _NONE).sort(dim=1).values
    first = torch.ones_like(s, dtype=torch.bool)
    first[:, 1:] = s[:, 1:] != s[:, :-1]
    return s, first & (s != _NONE)


def check_index_ranges(ranges, ring_slots=None, distinct=(), extra=()) -> list | None:
    """``check_index_range`` of each ``(name, t, upper, what)`` in ``ranges``; with
    ``ring_slots = (name, tail_slots, positions, ring)``, the ring-slot rule: a live token's
    ring slot must be ``block * RING + pos % RING`` (SPEC §3; a mapping built with another
    ring size addresses other requests' blocks); for each ``(name, entries, what)`` in
    ``distinct``, ``entries()`` returns ``(values, live)`` with no two live values equal
    (concurrent programs writing one entry race; called only when the checks run).
    One read-back for all, ``extra`` (0-dim int tensors, e.g. a caller's own extremes) with
    them; errors in that order. Returns each range's largest entry (None where empty), then
    ``extra``'s values; None when the checks do not run (``range_checks_enabled``)."""
    if not range_checks_enabled():
        return None
    kept = [r for r in ranges if r[1].numel()]
    live = ring_slots is not None and ring_slots[1].numel() > 0
    if not (kept or live or distinct or extra):
        return [None] * len(ranges)
    distinct = [(name, *entries(), what) for name, entries, what in distinct]
    stats = [r[1].max().to(torch.int64) for r in kept]
    if live:
        _, tail_slots, positions, ring = ring_slots
        off = (tail_slots >= 0) & (positions >= 0) & (tail_slots % ring != positions % ring)
        stats.append(off.any().to(torch.int64))
    stats += [_repeat_flag(values, mask) for _, values, mask, _ in distinct]
    stats += [e.to(torch.int64) for e in extra]
    values = torch.stack(stats).tolist()
    for (name, _, upper, what), top in zip(kept, values):
        if top >= upper:
            raise ValueError(f"{name} holds {top}, outside the {what} (valid: 0..{upper - 1}, negative = padding)")
    if live and values[len(kept)]:
        name = ring_slots[0]
        k = off.nonzero()[0].tolist()
        raise ValueError(f"{name}{k} = {int(tail_slots[tuple(k)])} for position {int(positions[tuple(k)])}: "
                         f"not block * RING + pos % RING with the tail's RING = {ring} (built for another ring "
                         "size?)")
    flags = values[len(kept) + live:len(kept) + live + len(distinct)]
    for (name, t, mask, what), flag in zip(distinct, flags):
        if flag:
            check_distinct(name, t[mask], what)
    tops = iter(values)
    return [next(tops) if r[1].numel() else None for r in ranges] + values[len(values) - len(extra):]


def check_distinct(name: str, values: torch.Tensor, what: str) -> None:
    """No value of ``values`` repeats (host read): concurrent programs writing one entry race."""
    uniq, counts = torch.unique(values, return_counts=True)
    if bool((counts > 1).any()):
        raise ValueError(f"{name}: {what} repeat: {uniq[counts > 1][:4].tolist()} (each must appear once)")
