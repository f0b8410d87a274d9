"""KPoolCache: one indexer layer's pooled K cache and tail ring, with per-request bookkeeping.

It turns requests into the tensors the ops take (``positions``, pool-granular
``slot_mapping``, token-granular ``tail_slot_mapping``, page tables, pool metadata) and
launches them. Every step is planned and validated on the host before anything is
written: a rejected call leaves the cache unchanged.

Addressing (what an engine must reproduce, see ``StepMetadata``):

* request ``r`` owns ring block ``block(r)`` and pages ``pages(r)``; its pool ``m`` (tokens
  ``mP .. mP+P-1``) lives at flat slot ``loc = pages(r)[m // PAGE] * PAGE + m % PAGE``;
* token at position ``pos`` has ``tail_slot = block(r) * RING + pos % RING``, and
  ``slot_mapping = loc(pos // P)`` if ``(pos + 1) % P == 0`` else ``-1``.

Steps are planned over the whole batch by ``planning``'s functions, which an engine with its
own scheduler calls once per step for every layer (``decode_slot_mappings``, here without its
argument checks: ``slot_mappings``; ``prefill_plan``).

Scoring: ``topk_indices`` turns the last step's queries into the token indices sparse
attention reads (pools ``j < (pos + 1) // P`` of the request, scoring scratch chunked under
``$KPOOL_LOGITS_BUDGET_MB``); ``score_and_select`` is its graph-capturable device part.
"""

from __future__ import annotations

import contextlib
import math
import os
import weakref
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from . import reference
from ._backend import backend_for
from ._checks import (MAX_SELECT, check_bool, check_device_type, check_int, check_page_layout,
                      check_slot_count, check_tensor, int_list, own_indices)
from .layout import ENTRY_BYTES, HEAD_DIM, cdiv, read_entries, resolve_fp8_dtype, resolve_layout, ring_size
from .ops.decode import launch_decode_update
from .ops.logits import check_heads
from .ops.prefill import launch_prefill
from .ops.quant import quantize_queries, quantize_queries_and_counts
from .ops.select import expand_pools_and_append_tail, visible_counts
from .ops.score import launch_paged_pool_topk, paged_pool_topk
from .planning import concat_ranges, host_int64, prefill_plan, slot_mappings

LOGITS_BUDGET_ENV = "KPOOL_LOGITS_BUDGET_MB"
DEFAULT_LOGITS_BUDGET_MB = 1024  # H200, prefill 8,192 queries x 8,192 / 32,768 pools: 256 MiB 6-9 / 28 ms
#                                  a step (host-bound: ~0.7 ms of launches per grid), 1,024 MiB 4.0 / 11.3
#                                  (benchmarks/LOG.md)


class CacheCapacityError(RuntimeError):
    """Out of pages or ring blocks; the cache is unchanged."""


@dataclass
class StepMetadata:
    """What one step passed to the kernels (all int tensors on the cache's device).

    kind : ``"prefill"`` or ``"decode"``.
    request_ids : the step's requests, in order.
    positions : int32 ``[T]`` token positions (prefill, packed) or ``[B, next_n]`` (decode, -1 = padding).
    slot_mapping : int64, same shape: pool slot on pool-completing tokens, else -1.
    tail_slot_mapping : int64, same shape: ``block * RING + pos % RING`` (-1 = padding).
    cu_seqlens : int32 ``[R + 1]`` token offsets of each request in the packed prefill batch (prefill only).
    page_table : int32 ``[R, max_pages]`` each request's pages after the step, -1 padded.
    pool_meta : int64 ``[n_pools, 4]`` pools written by a prefill (first token row, ring block, position
        of slot 0, leading slots read from the ring) and ``pool_locs`` their slots.
    """

    kind: str
    request_ids: list
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    tail_slot_mapping: torch.Tensor
    page_table: torch.Tensor
    cu_seqlens: torch.Tensor | None = None
    pool_meta: torch.Tensor | None = None
    pool_locs: torch.Tensor | None = None


@dataclass(slots=True)
class _Request:
    block: int
    pages: list = field(default_factory=list)
    length: int = 0  # committed tokens
    step_start: int = 0  # first position of the last step
    step_len: int = 0  # tokens in the last step
    step_kind: str = ""  # "prefill", "decode", or "accepted" (a decode step accept() committed)


class _IdentityGrid(NamedTuple):
    """Rows of a ``topk_indices`` plan that see at most ``select_k`` pools: every visible pool, then the tail."""
    rows: int | torch.Tensor  # first output row (contiguous), or int64 output rows on the device
    ids: torch.Tensor  # int32 [rows, select_k] visible pool ids, -1 padded
    seq_lens: torch.Tensor  # [rows] tokens each row sees (position + 1)


class _ScoredGrid(NamedTuple):
    """One ``[B, n]`` grid of a ``topk_indices`` plan's long rows (each sees more than ``select_k`` pools), scored
    by ``launch_paged_pool_topk``."""
    rows: int | torch.Tensor  # first output row (contiguous), or int64 [B * n] rows (padding: the sink row)
    take: int | torch.Tensor  # first query row (contiguous), or int64 [B * n] query rows to gather
    page_table: torch.Tensor  # [B, max_pages] the grid's requests' pages
    shape: tuple  # (B, n)
    seq_lens: torch.Tensor  # [B * n] visible tokens per row
    pool_lens: torch.Tensor  # [B * n] visible pools per row
    max_pools: int  # most visible pools of a row


class _SelectionPlan(NamedTuple):
    """What ``topk_indices`` plans once per step for a list of requests (``KPoolCache._selection_plan``)."""
    key: tuple  # (request ids, select_k, scratch budget, scratch bytes per pool)
    counts: list  # rows (tokens of the last step) per request
    grids: list  # _IdentityGrid / _ScoredGrid, in the order their rows are written


def _fixed(name: str, doc: str) -> property:
    """A read-only attribute of ``KPoolCache._config``."""
    return property(lambda self: self._config[name], doc=doc)


def _signature(t: torch.Tensor) -> tuple:
    """What the unchecked launchers rely on of a buffer: its memory, dtype, device, shape, strides."""
    return (t.data_ptr(), t.untyped_storage().nbytes(), t.dtype, t.device, tuple(t.shape), t.stride())


def _check_unchanged(buffers: dict, signatures: dict, since: str) -> None:
    """Each named buffer is the tensor it was when ``since`` (not re-bound, resized, re-typed or
    re-pointed in place): the steps write through it, and ``topk_indices`` reads it, without the
    public ops' checks."""
    for name, t in buffers.items():
        if not torch.is_tensor(t) or _signature(t) != signatures[name]:
            what = f"{t.dtype} {list(t.shape)}, strides {t.stride()}" if torch.is_tensor(t) else type(t).__name__
            raise ValueError(f"{name} ({what}) is not the buffer it was when {since} (changed in place or "
                             "replaced): the cache writes and reads these buffers without re-checking them")


class KPoolCache:
    """Pooled fp8 K cache + tail ring of one indexer layer.

    Parameters
    ----------
    num_pages : pages of ``page_size`` pool entries each (132 bytes per entry).
    page_size : pool entries per page (32 or 64 in practice; multiple of 16 for preshuffle).
    pool_size : P, tokens per pool.
    max_requests : ring blocks (live requests at once).
    max_spec_tokens : draft tokens per verify step; the ring holds
        ``P * next_pow2(ceil((P + max_spec_tokens) / P))`` tokens.
    ape : fp32 ``[P, 128]`` position bias of the pooling softmax.
    device, layout, fp8_dtype : defaults: CUDA if available, else CPU; platform defaults.
    """

    def __init__(self, num_pages, *, page_size=64, pool_size=4, max_requests, max_spec_tokens=0, ape,
                 device=None, layout=None, fp8_dtype=None, round_scale=True):
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
        check_device_type("device", device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        for name, value in (("num_pages", num_pages), ("page_size", page_size), ("pool_size", pool_size),
                            ("max_requests", max_requests)):
            check_int(name, value)
        check_int("max_spec_tokens", max_spec_tokens, least=0)
        check_slot_count("num_pages * page_size", num_pages * page_size)  # before allocating
        layout = resolve_layout(layout, device, page_size)
        check_page_layout("page_size", page_size, layout)
        check_tensor("ape", ape, dtype=torch.float32, shape=(pool_size, HEAD_DIM))
        check_bool("round_scale", round_scale)
        self._config = dict(device=device, pool_size=pool_size, page_size=page_size, max_spec_tokens=max_spec_tokens,
                            ring=ring_size(pool_size, max_spec_tokens), layout=layout,
                            fp8_dtype=resolve_fp8_dtype(fp8_dtype, device), round_scale=round_scale)
        self.ape = ape.to(self.device, copy=True).contiguous()  # the cache's own: no caller's tensor pools for it
        self.kv_cache = torch.zeros((num_pages, page_size, ENTRY_BYTES), dtype=torch.uint8, device=self.device)
        self.tail = torch.zeros((max_requests, 2, self.ring, HEAD_DIM), dtype=torch.bfloat16, device=self.device)
        self._free_pages = list(range(num_pages - 1, -1, -1))
        self._free_blocks = list(range(max_requests - 1, -1, -1))
        self._requests: dict = {}
        # each live request's pages, in the row of its ring block (-1 padded; widened as pages
        # are added): the host page table every step gathers its rows from
        self._block_pages = torch.full((max_requests, 1), -1, dtype=torch.int64)
        self.last_step: StepMetadata | None = None
        self._last_write: tuple | None = None  # (kind, device tables, tokens per request) of the last step
        self._steps = 0  # prefill / decode steps taken
        self._layers: list = []  # [weakref(kv_cache), weakref(tail), steps written, signatures] of each layer pair
        self._plan: _SelectionPlan | None = None  # the last topk_indices plan (_selection_plan)
        self._owned = {name: _signature(t) for name, t in self._buffers().items()}

    # ------------------------------------------------------------------ queries
    # fixed at construction (read-only: the steps launch their kernels with them unchecked)
    device = _fixed("device", "torch.device of the buffers (a CUDA one with its index).")
    pool_size = _fixed("pool_size", "P, tokens per pool.")
    page_size = _fixed("page_size", "pool entries per page.")
    max_spec_tokens = _fixed("max_spec_tokens", "speculative tokens a step may add (a step has at most this + 1).")
    ring = _fixed("ring", "RING, ring slots per request (``layout.ring_size``).")
    layout = _fixed("layout", '``"plain"`` or ``"preshuffle"``.')
    fp8_dtype = _fixed("fp8_dtype", "fp8 format of the codes.")
    round_scale = _fixed("round_scale", "power-of-two (ue8m0) scales.")

    @property
    def requests(self) -> list:
        """Ids of the live requests."""
        return list(self._requests)

    def length(self, request_id) -> int:
        """Committed tokens of a request."""
        return self._get(request_id).length

    def metadata(self) -> StepMetadata | None:
        """The tensors the last step passed to the kernels (see ``StepMetadata``)."""
        return self.last_step

    def ring_block(self, request_id) -> int:
        """The request's ring block ``b``: ``tail[b, 0]`` / ``tail[b, 1]`` (bf16 ``[RING, 128]``) hold
        the raw keys / gates of its tokens not yet in a complete pool, token ``pos`` at row ``pos % RING``."""
        return self._get(request_id).block

    def pool_slot(self, request_id, pool: int) -> int:
        """Flat cache slot of a request's pool ``pool`` (its page must be allocated)."""
        req = self._get(request_id)
        (pool,) = int_list("pool", [pool])
        if not 0 <= pool < len(req.pages) * self.page_size:
            raise ValueError(f"pool {pool} of request {request_id!r} is outside its allocated pages "
                             f"(pools 0..{len(req.pages) * self.page_size - 1})")
        return req.pages[pool // self.page_size] * self.page_size + pool % self.page_size

    def _table(self, reqs, blocks=None) -> torch.Tensor:
        """int64 ``[R, max(1, most pages)]`` pages of ``reqs`` (CPU, -1 padded); ``blocks``: their
        ring blocks as a host int64 tensor, when the caller has it."""
        width = max([len(r.pages) for r in reqs] + [1])
        if blocks is None:
            blocks = host_int64([r.block for r in reqs])
        return self._block_pages[:, :width].index_select(0, blocks)

    def page_table(self, request_ids) -> torch.Tensor:
        """int32 ``[R, max_pages]`` pages of each request (pool granularity, -1 padded)."""
        return self._device_table(self._get_all(request_ids))

    def _device_table(self, reqs) -> torch.Tensor:
        """``_table(reqs)`` as int32 on the cache's device."""
        return _upload(self._table(reqs).to(torch.int32), self.device)

    def pooled_keys(self, request_id) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored entries of the request's complete committed pools, in pool order:
        ``(codes [n_pools, 128] uint8, scales [n_pools] fp32)``."""
        req = self._get(request_id)
        pools = torch.arange(req.length // self.pool_size, dtype=torch.int64)
        pages = torch.tensor(req.pages, dtype=torch.int64)[pools // self.page_size]
        locs = pages * self.page_size + pools % self.page_size
        return read_entries(self.kv_cache, locs.to(self.device), self.layout)

    # ------------------------------------------------------------------ lifecycle
    def free(self, request_id) -> None:
        """Release a request's pages and ring block for reuse."""
        req = self._get(request_id)
        self._free_pages.extend(reversed(req.pages))
        self._free_blocks.append(req.block)
        self._block_pages[req.block] = -1
        del self._requests[request_id]
        self._plan = None  # a plan's requests are live: topk_indices of a freed id raises

    def accept(self, request_ids, num_accepted) -> None:
        """Commit the first ``num_accepted[i]`` tokens of each request's last decode step; roll back the rest.

        Once per step: a second ``accept`` of the same step raises (it would roll back tokens
        the first one committed)."""
        num_accepted = int_list("num_accepted", num_accepted)
        if len(num_accepted) != len(request_ids):
            raise ValueError(f"num_accepted has {len(num_accepted)} entries for {len(request_ids)} request_ids")
        _check_distinct(request_ids, "an accept")
        reqs = self._get_all(request_ids)
        for rid, req, n in zip(request_ids, reqs, num_accepted):
            if req.step_kind == "decode" and 0 <= n <= req.step_len:
                continue
            if req.step_kind == "accepted":
                raise ValueError(f"request {rid!r}: its last decode step was already accepted "
                                 f"({req.step_len} tokens committed); accept() once per step")
            if req.step_kind != "decode":
                raise ValueError(f"request {rid!r}: accept() follows a decode step, the last step was "
                                 f"{req.step_kind or 'none'}")
            raise ValueError(f"num_accepted for request {rid!r} is {n}, its last step had {req.step_len} tokens")
        for req, n in zip(reqs, num_accepted):
            req.length = req.step_start + n
            req.step_len, req.step_kind = n, "accepted"
        self._plan = None

    # ------------------------------------------------------------------ steps
    def prefill(self, request_ids, keys, gates, *, cu_seqlens=None) -> StepMetadata:
        """Append one chunk of tokens to each listed request (new ids start at position 0).

        ``keys``/``gates``: a list of bf16 ``[n_i, 128]`` (one per request), or packed bf16
        ``[sum n_i, 128]`` with ``cu_seqlens`` (``[R + 1]`` offsets). Writes every pool the
        chunks complete (a chunk starting mid-pool completes it from the ring) and seeds
        each request's ring with its trailing tokens.
        """
        _check_unchanged(self._buffers(), self._owned, "the cache allocated it")
        key, gate, bounds = self._pack(request_ids, keys, gates, cu_seqlens)
        lengths = [b - a for a, b in bounds]
        new_ids = [r for r in request_ids if r not in self._requests]
        starts = [self._requests[r].length if r in self._requests else 0 for r in request_ids]
        with self._reserved(request_ids, new_ids, [s + n for s, n in zip(starts, lengths)]):
            reqs = [self._requests[r] for r in request_ids]
            cu = [0] + [b for _, b in bounds]  # the packed rows start at 0 (_pack)
            table = self._table(reqs)
            plan = prefill_plan(cu, starts, [r.block for r in reqs], table, self.pool_size, self.page_size,
                                self.ring)
            dev = self.device
            write = ("prefill", (_upload(plan.pools, dev), _upload(plan.requests, dev)), lengths)
            self._write_step(write, self.kv_cache, self.tail, key, gate, self.ape)
        self._commit(reqs, starts, write)
        self.last_step = StepMetadata(
            "prefill", list(request_ids), _upload(plan.positions.to(torch.int32), dev), _upload(plan.slot_mapping, dev),
            _upload(plan.tail_slot_mapping, dev), _upload(table.to(torch.int32), dev),
            _upload(torch.tensor(cu, dtype=torch.int32), dev), _upload(plan.pool_meta, dev),
            _upload(plan.pool_locs, dev))
        return self.last_step

    def decode(self, request_ids, keys, gates) -> StepMetadata:
        """One decode / speculative-verify step: ``next_n`` tokens per request, all written speculatively.

        ``keys``/``gates``: bf16 ``[B, next_n, 128]``, or lists of ``[n_i, 128]`` (mixed lengths,
        padded here). At most ``max_spec_tokens + 1`` tokens per request; ``accept`` commits a prefix.
        """
        _check_unchanged(self._buffers(), self._owned, "the cache allocated it")
        key, gate, counts = self._step_rows(request_ids, keys, gates)
        _check_distinct(request_ids, "a step")
        reqs = self._get_all(request_ids)
        if max(counts, default=0) > self.max_spec_tokens + 1:
            rid, n = next((r, n) for r, n in zip(request_ids, counts) if n > self.max_spec_tokens + 1)
            raise ValueError(f"request {rid!r} sends {n} tokens in one step; max_spec_tokens = "
                             f"{self.max_spec_tokens} allows {self.max_spec_tokens + 1}")
        # only an empty batch gets here with too wide keys (the check above names a request)
        if key.shape[1] > self.max_spec_tokens + 1:
            raise ValueError(f"keys hold steps of {key.shape[1]} tokens; max_spec_tokens = {self.max_spec_tokens} "
                             f"allows {self.max_spec_tokens + 1}")
        starts = [r.length for r in reqs]
        with self._reserved(request_ids, [], [s + n for s, n in zip(starts, counts)]):
            p, width = self.pool_size, key.shape[1]
            blocks = host_int64([r.block for r in reqs])
            table = self._table(reqs, blocks)
            col = torch.arange(width, dtype=torch.int64)
            pos = host_int64(starts)[:, None] + col
            if min(counts, default=width) < width:  # -1: rows of shorter lists
                pos.masked_fill_(col >= host_int64(counts)[:, None], -1)
            slots, tslots = slot_mappings(pos, blocks, table, p, self.page_size, self.ring)
            # positions, slots, tail slots twice, one upload: the write's tables (replayed by write_layer)
            # and the ones metadata() hands out, which a caller may change
            grid = _upload(torch.stack((pos, slots, tslots) * 2), self.device)
            write = ("decode", (grid[2], grid[1], grid[0]), counts)
            self._write_step(write, self.kv_cache, self.tail, key, gate, self.ape)
        self._commit(reqs, starts, write)
        self.last_step = StepMetadata("decode", list(request_ids), grid[3].to(torch.int32), grid[4], grid[5],
                                      _upload(table.to(torch.int32), self.device))
        return self.last_step

    def layer_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed ``(kv_cache, tail)`` shaped as this cache's: another layer's, for ``write_layer``.

        Allocate them while the cache holds no request (a layer added later would miss the
        live requests' tokens); ``write_layer`` then checks that they receive every step once."""
        if self._requests:
            raise ValueError(f"layer_buffers() while {len(self._requests)} requests are live: their tokens would be "
                             "missing from the new layer; allocate every layer's buffers before the first step")
        kv_cache, tail = torch.zeros_like(self.kv_cache), torch.zeros_like(self.tail)
        # weak: buffers the caller drops are freed (and forgotten here)
        self._layers = [entry for entry in self._layers if entry[0]() is not None]
        self._layers.append([weakref.ref(kv_cache), weakref.ref(tail), self._steps,
                             {"kv_cache": _signature(kv_cache), "tail": _signature(tail)}])
        return kv_cache, tail

    def _buffers(self) -> dict:
        """The cache's own buffers its steps write through the unchecked launchers (and ape they pool with)."""
        return {"kv_cache": self.kv_cache, "tail": self.tail, "ape": self.ape}

    def _layer(self, kv_cache):
        """The ``_layers`` entry of a ``layer_buffers()`` kv_cache, or None."""
        return next((entry for entry in self._layers if entry[0]() is kv_cache), None)

    def write_layer(self, kv_cache, tail, keys, gates, ape) -> None:
        """Write the last ``prefill`` / ``decode`` step into another layer's buffers.

        Every layer of a model shares one plan per step (pages, ring blocks, slots): keep one
        ``KPoolCache`` for the bookkeeping (layer 0, its own buffers) and give each other layer
        ``kv_cache`` / ``tail`` of the same shapes, written here with that layer's ``keys`` /
        ``gates`` (the step's forms: packed ``[T, 128]`` or a list for prefill, ``[B, next_n,
        128]`` or a list for decode) and its ``ape`` fp32 ``[P, 128]``. No planning, one
        launch. An ``accept`` of the step needs nothing per layer. Select with
        ``topk_indices(..., kv_cache=kv_cache)``.

        The buffers must come from ``layer_buffers()`` and receive every step once, in order: a
        second write of a step, or a write after a step the layer missed, raises.
        """
        if self._last_write is None:
            raise ValueError("write_layer replays the last prefill / decode step; there has been none")
        layer = self._layer(kv_cache)
        if layer is None or layer[1]() is not tail:
            raise ValueError("kv_cache / tail must be a pair from this cache's layer_buffers()")
        if layer[2] != self._steps - 1:
            missed = f"missed steps {layer[2] + 1}..{self._steps - 1}"
            what = "was already written" if layer[2] == self._steps else missed
            raise ValueError(f"write_layer writes step {self._steps} (the last one); this layer {what}: write every "
                             "layer after each prefill / decode, before the next")
        _check_unchanged({"kv_cache": kv_cache, "tail": tail}, layer[3], "layer_buffers() gave it")
        check_tensor("ape", ape, dtype=torch.float32, shape=(self.pool_size, HEAD_DIM), device=self.device,
                     inner_contiguous=True)
        kind, tables, counts = self._last_write
        ids, listed, given = self.last_step.request_ids, isinstance(keys, (list, tuple)), None
        if kind == "prefill":
            if listed:
                keys, gates, bounds = self._pack(ids, keys, gates, None)
                given = [b - a for a, b in bounds]
            want = (sum(counts), HEAD_DIM)
        else:
            keys, gates, given = self._step_rows(ids, keys, gates)
            want = (len(counts), tables[2].shape[1], HEAD_DIM)
        if listed and given != counts:
            raise ValueError(f"keys / gates hold {given} tokens per request; the step wrote {counts}")
        for name, t in (("keys", keys), ("gates", gates)):
            check_tensor(name, t, dtype=torch.bfloat16, shape=want, device=self.device, inner_contiguous=True)
        self._write_step(self._last_write, kv_cache, tail, keys, gates, ape)
        layer[2] = self._steps

    def _write_step(self, write, kv_cache, tail, key, gate, ape) -> None:
        """A step's write (``write``: kind, device tables, tokens per request) into ``kv_cache`` / ``tail``."""
        kind, tables, _ = write
        # the launchers without the public ops' checks: the tables are the cache's own, the buffers
        # its own or a layer_buffers() pair, keys / gates / ape checked by the caller
        if kind == "prefill":
            pools, requests = tables
            launch_prefill(kv_cache, tail, key, gate, ape, pools, requests, self.pool_size, self.layout,
                           self.fp8_dtype, self.round_scale)
        else:
            # metadata_ready: the tables are host copies made when the step was planned (_upload)
            tail_slots, slot_mapping, positions = tables
            launch_decode_update(kv_cache, tail, tail_slots, key, gate, ape, slot_mapping, positions, self.pool_size,
                                 self.layout, self.fp8_dtype, self.round_scale, metadata_ready=True)

    # ------------------------------------------------------------------ scoring
    def topk_indices(self, request_ids, q, weights, *, index_topk=2048, width=None, kv_cache=None) -> torch.Tensor:
        """Token indices sparse attention reads, for the tokens of each listed request's last step.

        Rows are the tokens of each request's most recent step (prefill chunk, or decode /
        verify step; after ``accept`` only its accepted tokens), requests in the listed order,
        tokens in position order (``T = sum`` of those step lengths). A token at position
        ``p`` sees the request's complete pools ``j < (p + 1) // P`` (the pools its own step
        wrote included). Per row: ``fwht128_quant_fp8(q)`` and the folded head weights
        ``(weights * q_scale) * fp32(128^-0.5 * H^-0.5)`` (one launch, ``quantize_queries``),
        exact pooled logits and the
        ``select_k = index_topk // P`` best pools, fused (``paged_pool_topk``: the result of
        ``select_pools(paged_pool_logits(...))`` without a logits row in memory: highest
        first, ties to the lower pool id; every visible pool in order when there are at most
        ``select_k``), expanded to tokens plus the tail (``expand_pools_and_append_tail``).
        No index exceeds the row's position.

        Memory: the scoring scratch of a grid of rows (candidate key lists and survivors, at
        most ``SCRATCH_BYTES_PER_POOL`` = 21 bytes per row and visible pool; 72 on the torch
        backend, ``scratch_bytes_per_pool``) stays under
        ``$KPOOL_LOGITS_BUDGET_MB`` MiB (default 1024; one row at least): rows are grouped into
        grids under it. Each grid costs ~0.7 ms of host work (its launches), so a small budget
        makes long prefill chunks host-bound. Rows that see at most ``select_k`` pools are not
        scored (their selection is every visible pool).

        Parameters
        ----------
        request_ids : live request ids (no repeats).
        q : bf16 ``[T, H, 128]`` unrotated indexer queries (``wq_b`` output), H in {16, 32, 64}.
        weights : fp32 ``[T, H]`` raw head weights (``weights_proj`` output in fp32).
        index_topk : tokens to select (2048 for GLM-5.3-Flash); ``index_topk >= P``.
        width : output columns, default ``index_topk + P - 1`` (e.g. 2176 = rounded up to 128).
        kv_cache : another layer's pooled cache from ``layer_buffers()``, written by ``write_layer``
            up to the last step (default: this cache's); any other tensor raises.

        Returns
        -------
        int32 ``[T, width]``: columns ``[0, select_k * P)`` hold ``pool * P + o`` for each
        selected pool in selection order (``P`` times -1 for an empty pick), the next
        ``P - 1`` the tail tokens ``[(p + 1) // P * P, p]``; -1 padding. Request-relative
        token positions.
        """
        request_ids = list(request_ids)
        width = selection_width(index_topk, width, self.pool_size)
        select_k = index_topk // self.pool_size
        plan = self._selection_plan(request_ids, select_k)
        counts, total = plan.counts, sum(plan.counts)
        check_tensor("q", q, dtype=torch.bfloat16, ndim=3, device=self.device)
        if q.shape[0] != total or q.shape[2] != HEAD_DIM:
            raise ValueError(f"q must have shape [T={total}, H, {HEAD_DIM}] (T = the tokens of the listed requests' "
                             f"last steps: {counts}), got {list(q.shape)}")
        heads = q.shape[1]
        check_heads("q", heads)
        check_tensor("weights", weights, dtype=torch.float32, shape=(total, heads), device=self.device)
        if kv_cache is None or kv_cache is self.kv_cache:
            kv_cache = self.kv_cache
            _check_unchanged({"kv_cache": kv_cache}, self._owned, "the cache allocated it")
        else:
            layer = self._layer(kv_cache)
            if layer is None:
                raise ValueError("kv_cache must be this cache's or one from its layer_buffers()")
            if layer[2] != self._steps:
                raise ValueError(f"kv_cache has received {layer[2]} of the cache's {self._steps} steps: write_layer "
                                 "every step into it before selecting from it")
            _check_unchanged({"kv_cache": kv_cache}, layer[3], "layer_buffers() gave it")
        if total == 0:
            return torch.empty((0, width), dtype=torch.int32, device=self.device)
        q8, _, w = quantize_queries(q, weights, fp8_dtype=self.fp8_dtype, round_scale=self.round_scale)
        out = None
        with own_indices():  # the cache built every index it passes: no syncs between the grids
            for grid in plan.grids:
                rows, idx = self._select_grid(grid, q8, w, kv_cache, select_k, width)
                if len(plan.grids) == 1 and isinstance(rows, int):  # one grid of every row, in order: the result
                    return idx
                if out is None:
                    out = torch.empty((total + 1, width), dtype=torch.int32, device=self.device)  # row T: padding
                _put_rows(out, rows, idx)
        return out[:total]

    def _selection_plan(self, request_ids, select_k) -> _SelectionPlan:
        """The rows of ``topk_indices`` for the last step of ``request_ids`` (validated: live, no
        repeats) and their grids, index tensors uploaded. Kept for the next call with the same
        requests and ``select_k`` until the next step, ``accept`` or ``free``: every layer of a
        model selects from the same step's rows, so only the first layer's call plans them."""
        key = (tuple(request_ids), select_k, logits_budget_bytes(), scratch_bytes_per_pool(self.device))
        if self._plan is not None and self._plan.key == key:
            return self._plan
        _check_distinct(request_ids, "topk_indices")
        reqs = self._get_all(request_ids)
        counts = [r.step_len for r in reqs]
        p = self.pool_size
        short, items, row = [], [], 0  # short: (row0, pos0, n) runs selected by identity; items: long runs
        long_from = (select_k + 1) * p - 1  # rows at positions >= long_from see more than select_k pools
        for i, (req, n) in enumerate(zip(reqs, counts)):
            a = req.step_start
            first_long = a if a > long_from else long_from  # min(max(long_from, a), a + n), without the calls
            if first_long > a + n:
                first_long = a + n
            if first_long > a:
                short.append((row, a, first_long - a))
            if a + n > first_long:
                items.append((i, row + first_long - a, first_long, a + n - first_long, (a + n) // p))
            row += n
        grids = [self._identity_grid(short, select_k)] if short else []
        if items:
            page_table = self._device_table(reqs)
            grids += [self._scored_grid(chunk, page_table, row) for chunk in _plan_chunks(items, key[2], p, key[3])]
        self._plan = _SelectionPlan(key, counts, grids)
        return self._plan

    def _identity_grid(self, runs, select_k) -> _IdentityGrid:
        """Rows seeing at most ``select_k`` pools (``runs``: ``(first row, first position, rows)``):
        every visible pool in order, then the tail."""
        first_rows, starts, ms = (host_int64(c) for c in zip(*runs))
        seq, lens = _row_counts(concat_ranges(starts, ms), self.pool_size, self.device)
        cols = torch.arange(select_k, dtype=torch.int64, device=self.device)
        ids = torch.where(cols[None, :] < lens[:, None], cols[None, :], -1).to(torch.int32)
        if all(r1 == r0 + n0 for (r0, _, n0), (r1, _, _) in zip(runs, runs[1:])):
            return _IdentityGrid(runs[0][0], ids, seq)
        return _IdentityGrid(_upload(concat_ranges(first_rows, ms), self.device), ids, seq)

    def _scored_grid(self, chunk, page_table, total) -> _ScoredGrid:
        """One grid ``[B, n]`` of long rows (``chunk``: items of ``_plan_chunks``, padded to the
        longest; padding rows go to the sink row ``total``)."""
        reqs, first_rows, starts, ms, vis = (list(c) for c in zip(*chunk))
        dev, batch, n = self.device, len(chunk), max(ms)
        col = torch.arange(n, dtype=torch.int64)
        pad = col[None, :] >= host_int64(ms)[:, None]  # [B, n]
        seq, lens = _row_counts(host_int64(starts)[:, None].add(col).masked_fill_(pad, -1), self.pool_size, dev)
        r0 = first_rows[0]
        if all(m == n for m in ms) and first_rows == list(range(r0, r0 + batch * n, n)):  # contiguous: no gathers
            rows = take = r0
        else:
            rows = _upload(host_int64(first_rows)[:, None].add(col).masked_fill_(pad, total).reshape(-1), dev)
            take = rows.clamp(max=total - 1)
        if reqs == list(range(reqs[0], reqs[0] + batch)):
            pt = page_table[reqs[0]:reqs[0] + batch]
        else:
            pt = page_table.index_select(0, _upload(host_int64(reqs), dev))
        return _ScoredGrid(rows, take, pt, (batch, n), seq, lens, max(vis))

    def _select_grid(self, grid, q8, w, kv_cache, select_k, width) -> tuple:
        """``(rows, idx)`` of one planned grid, as ``_put_rows`` takes them, for this call's
        quantized queries ``q8`` / folded weights ``w`` and ``kv_cache``."""
        if isinstance(grid, _IdentityGrid):
            return grid.rows, expand_pools_and_append_tail(grid.ids, grid.seq_lens, self.pool_size, width=width)
        batch, n = grid.shape
        if isinstance(grid.take, int):
            q8c, wc = q8[grid.take:grid.take + batch * n], w[grid.take:grid.take + batch * n]
        else:
            q8c, wc = q8.index_select(0, grid.take), w.index_select(0, grid.take)
        # every row of the grid sees more than select_k pools (the plan's long rows): scored, by the
        # launcher without the public op's checks (the cache built the rows' tables; q8 / w come
        # from checked queries, kv_cache is checked unchanged by topk_indices)
        idx = launch_paged_pool_topk(
            q8c.reshape(batch, n, *q8.shape[1:]), kv_cache, wc.reshape(batch, n, w.shape[1]),
            grid.pool_lens.view(batch, n), grid.page_table, select_k, self.fp8_dtype, self.layout, grid.max_pools,
            (grid.seq_lens, self.pool_size, width))
        return grid.rows, idx

    # ------------------------------------------------------------------ helpers
    def _get(self, request_id) -> _Request:
        try:
            return self._requests[request_id]
        except (KeyError, TypeError):
            raise KeyError(f"unknown or freed request id {request_id!r}") from None

    def _get_all(self, request_ids) -> list:
        """``[_get(r) for r in request_ids]`` in one comprehension; an unknown id raises as ``_get``."""
        try:
            return [self._requests[r] for r in request_ids]
        except (KeyError, TypeError):
            for r in request_ids:
                self._get(r)
            raise

    def _step_rows(self, request_ids, keys, gates):
        """A decode step's ``keys`` / ``gates`` (bf16 ``[B, next_n, 128]``, or lists of ``[n_i, 128]``,
        padded here) -> ``(key, gate, tokens per request)``."""
        if torch.is_tensor(keys):
            check_tensor("keys", keys, dtype=torch.bfloat16, ndim=3, device=self.device, inner_contiguous=True)
            check_tensor("gates", gates, dtype=torch.bfloat16, shape=tuple(keys.shape), device=self.device,
                         inner_contiguous=True)
            if keys.shape[0] != len(request_ids) or keys.shape[2] != HEAD_DIM:
                raise ValueError(f"keys must be [{len(request_ids)}, next_n, {HEAD_DIM}], got {list(keys.shape)}")
            return keys, gates, [keys.shape[1]] * len(request_ids)
        self._check_lists(request_ids, keys, gates)
        counts = [k.shape[0] for k in keys]
        key, gate = (_pad_rows(list(t), counts, self.device) for t in (keys, gates))
        return key, gate, counts

    def _check_lists(self, request_ids, keys, gates) -> None:
        if not isinstance(keys, (list, tuple)) or not isinstance(gates, (list, tuple)):
            raise TypeError("keys and gates must both be tensors or both be lists of [n_i, 128] tensors")
        if not (len(keys) == len(gates) == len(request_ids)):
            raise ValueError(f"got {len(keys)} keys and {len(gates)} gates for {len(request_ids)} request_ids")
        bf16, dev = torch.bfloat16, self.device
        for i, (k, g) in enumerate(zip(keys, gates)):
            if isinstance(k, torch.Tensor) and isinstance(g, torch.Tensor) and k.dtype == g.dtype == bf16 \
                    and k.ndim == 2 and k.shape == g.shape and k.shape[1] == HEAD_DIM and k.device == g.device == dev:
                continue  # the common case, without a message built per tensor; else the checks below raise
            check_tensor(f"keys[{i}]", k, dtype=torch.bfloat16, ndim=2, device=self.device)
            check_tensor(f"gates[{i}]", g, dtype=torch.bfloat16, shape=tuple(k.shape), device=self.device)
            if k.shape[1] != HEAD_DIM:
                raise ValueError(f"keys[{i}] must be [n, {HEAD_DIM}], got {list(k.shape)}")

    def _pack(self, request_ids, keys, gates, cu_seqlens):
        """Token-major ``[T, 128]`` keys / gates and each request's row range."""
        _check_distinct(request_ids, "a step")
        if cu_seqlens is None:
            self._check_lists(request_ids, keys, gates)
            bounds, row = [], 0
            for k in keys:
                bounds.append((row, row + k.shape[0]))
                row += k.shape[0]
            empty = torch.empty((0, HEAD_DIM), dtype=torch.bfloat16, device=self.device)
            key = torch.cat(list(keys)) if keys else empty
            gate = torch.cat(list(gates)) if gates else empty
            return key.contiguous(), gate.contiguous(), bounds
        check_tensor("keys", keys, dtype=torch.bfloat16, ndim=2, device=self.device, inner_contiguous=True)
        check_tensor("gates", gates, dtype=torch.bfloat16, shape=tuple(keys.shape), device=self.device,
                     inner_contiguous=True)
        if keys.shape[1] != HEAD_DIM:
            raise ValueError(f"keys must be [T, {HEAD_DIM}], got {list(keys.shape)}")
        if keys.stride(0) != gates.stride(0):
            gates = gates.contiguous() if gates.stride(0) == HEAD_DIM else gates.clone()
            keys = keys.contiguous()
        cu = int_list("cu_seqlens", cu_seqlens)
        if len(cu) != len(request_ids) + 1 or cu[0] != 0 or cu[-1] != keys.shape[0] or any(
                b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"cu_seqlens must be non-decreasing offsets [0, ..., {keys.shape[0]}] with "
                             f"{len(request_ids) + 1} entries, got {cu}")
        return keys, gates, list(zip(cu, cu[1:]))

    def _commit(self, reqs, starts, write) -> None:
        """Record a written step ``write = (kind, device tables, tokens per request)``: each request's
        last step and new length, and the write that ``write_layer`` replays on the other layers."""
        kind, _, counts = write
        for req, a, n in zip(reqs, starts, counts):
            req.step_start, req.step_len, req.step_kind, req.length = a, n, kind, a + n
        self._last_write, self._plan = write, None
        self._steps += 1

    def _reserve(self, request_ids, new_ids, new_lengths) -> tuple[list, list]:
        """Check capacity for the step, then allocate ring blocks and pages (all or nothing).
        Returns what ``_unreserve`` takes back: ``(new_ids, [(id, pages held, pages added)])``."""
        if len(new_ids) > len(self._free_blocks):
            raise CacheCapacityError(f"too many requests: {len(new_ids)} new, {len(self._free_blocks)} ring blocks "
                                     f"free (max_requests = {self.tail.shape[0]})")
        # (id, pages held, pages to add) of the requests that grow past their pages, in one pass (a
        # decode step of 1,024 requests walks them all and adds few pages)
        get, p, page = self._requests.get, self.pool_size, self.page_size
        grow, total = [], 0
        for rid, length in zip(request_ids, new_lengths):
            req = get(rid)
            have = len(req.pages) if req is not None else 0
            if length >= (have * page + 1) * p:  # a complete pool past the held pages
                n = cdiv(length // p, page) - have
                grow.append((rid, have, n))
                total += n
        if total > len(self._free_pages):
            raise CacheCapacityError(f"out of pages: the step needs {total}, {len(self._free_pages)} free")
        for rid in new_ids:
            self._requests[rid] = _Request(block=self._free_blocks.pop())
        if not total:
            return new_ids, grow
        blocks, cols, pages = [], [], []
        for rid, h, n in grow:
            req = self._requests[rid]
            req.pages += [self._free_pages.pop() for _ in range(n)]
            blocks += [req.block] * n
            cols += range(h, h + n)
            pages += req.pages[h:]
        width = self._block_pages.shape[1]
        if max(cols) >= width:  # widen the page rows (doubling)
            wider = torch.full((self._block_pages.shape[0], max(max(cols) + 1, 2 * width)), -1, dtype=torch.int64)
            wider[:, :width] = self._block_pages
            self._block_pages = wider
        self._block_pages[host_int64(blocks), host_int64(cols)] = host_int64(pages)
        return new_ids, grow

    @contextlib.contextmanager
    def _reserved(self, request_ids, new_ids, new_lengths):
        """``_reserve`` around a step's planning and write: what it reserved goes back
        (``_unreserve``) if they raise."""
        reserved = self._reserve(request_ids, new_ids, new_lengths)
        try:
            yield
        except BaseException:
            self._unreserve(*reserved)
            raise

    def _unreserve(self, new_ids, grow) -> None:
        """Undo ``_reserve`` (a step whose write failed): its pages and ring blocks go back to the
        free lists in the order they left them, its new requests are forgotten."""
        for rid, have, _ in reversed(grow):
            req = self._requests[rid]
            self._free_pages.extend(reversed(req.pages[have:]))
            self._block_pages[req.block, have:len(req.pages)] = -1
            del req.pages[have:]
        for rid in reversed(new_ids):
            self._free_blocks.append(self._requests.pop(rid).block)


def _check_distinct(request_ids, where: str) -> None:
    """``request_ids`` hashable and none twice in ``where``."""
    try:
        distinct = len(set(request_ids))
    except TypeError as e:
        raise TypeError(f"request_ids must hold hashable ids (str, int, ...): {e}") from None
    if distinct != len(request_ids):
        raise ValueError(f"request_ids must not repeat within {where}")


# ---------------------------------------------------------------------- scoring helpers
def logits_budget_bytes() -> int:
    """``$KPOOL_LOGITS_BUDGET_MB`` (MiB, default 1024) in bytes: the cap of one scoring chunk's scratch."""
    raw = os.environ.get(LOGITS_BUDGET_ENV, "").strip()
    if not raw:
        return DEFAULT_LOGITS_BUDGET_MB << 20
    try:
        mib = float(raw)
    except ValueError:
        mib = float("nan")
    if not (math.isfinite(mib) and mib > 0):
        raise ValueError(f"{LOGITS_BUDGET_ENV} must be a positive number of MiB, got {raw!r}")
    return max(1, int(mib * (1 << 20)))


# paged_pool_topk's scratch per row and pool: the leaves' key lists (8 * (HEAD + POSITION_KEYS +
# min(chunk, KB)) bytes per filtering leaf of chunk >= MIN_CHUNK = 128 pools: at most 13 per pool)
# and at most 8 bytes of survivors (topk.threshold_select) ...
SCRATCH_BYTES_PER_POOL = 21
# ... and on the torch backend (reference.paged_pool_logits + select_pools: fp64 dot products, fp32
# head partial sums, the logits and their ranking keys; CPU peak RSS growth 55-68 bytes per row and
# pool at 512-2,048 rows x 4,096-8,192 pools)
TORCH_SCRATCH_BYTES_PER_POOL = 72


def scratch_bytes_per_pool(device) -> int:
    """Scoring scratch per row and visible pool of ``paged_pool_topk`` on ``device``'s backend."""
    return TORCH_SCRATCH_BYTES_PER_POOL if backend_for(device) == "torch" else SCRATCH_BYTES_PER_POOL


def _plan_chunks(items, budget, pool_size, per_pool=SCRATCH_BYTES_PER_POOL):
    """Group long-row runs into grids whose scoring scratch (``per_pool`` bytes per row and
    pool of ``[B * n, max_pools]``: ``scratch_bytes_per_pool``) fits ``budget`` bytes.

    ``items``: ``(request index, first row, first position, rows m, visible pools of the last
    row)`` in row order. Consecutive items share a grid (padded to the longest run) while the
    padding stays under half of the grid; a run too large alone is split into pieces.
    """
    chunks, cur = [], []
    most_rows = most_pools = rows_held = 0  # of ``cur``: longest run, most visible pools, rows
    for it in items:
        i, r0, a, m, vis = it
        if m * vis * per_pool > budget:  # alone over budget: pieces of whole rows (at least one)
            if cur:
                chunks.append(cur)
                cur, most_rows, most_pools, rows_held = [], 0, 0, 0
            step = max(1, budget // (per_pool * vis))
            for t in range(0, m, step):
                k = min(step, m - t)
                chunks.append([(i, r0 + t, a + t, k, (a + t + k) // pool_size)])
            continue
        longest = m if m > most_rows else most_rows  # max(), without the calls (one item per request)
        widest = vis if vis > most_pools else most_pools
        held = rows_held + m
        grid_rows = (len(cur) + 1) * longest
        if cur and (grid_rows * widest * per_pool > budget or grid_rows > 2 * held):
            chunks.append(cur)
            cur, longest, widest, held = [], m, vis, m
        cur.append(it)
        most_rows, most_pools, rows_held = longest, widest, held
    if cur:
        chunks.append(cur)
    return chunks


def _pad_rows(rows: list, counts: list, device) -> torch.Tensor:
    """bf16 ``[n_i, 128]`` tensors -> ``[len(rows), max(n_i, 1), 128]``, zero padded, by one
    concatenation and one scatter (not a copy per request: each is a launch on a GPU)."""
    width = max(counts + [1])
    out = torch.zeros((len(rows), width, HEAD_DIM), dtype=torch.bfloat16, device=device)
    if rows and sum(counts):
        n = host_int64(counts)
        flat = concat_ranges(torch.arange(len(rows)) * width, n)  # row b, token j -> b * width + j
        out.view(-1, HEAD_DIM).index_copy_(0, _upload(flat, device), torch.cat(rows))
    return out


def _upload(t: torch.Tensor, device) -> torch.Tensor:
    """The CPU tensor ``t`` on ``device``, without waiting for the GPU on CUDA / ROCm: PyTorch's
    blocking host-to-device copy synchronizes the stream (each such copy in ``topk_indices``
    waited for the previous row group's kernels before the next was launched); a pinned copy
    is sent asynchronously instead (``t`` may change afterwards)."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _row_counts(pos: torch.Tensor, pool_size: int, device) -> tuple:
    """Host int64 positions ``pos [...]`` (negative = padding row) -> ``(seq_lens, pool_lens)``
    ``[pos.numel()]`` on ``device`` in one upload: ``select.visible_counts`` of them, computed on
    the host (``reference.visible_counts``, where the cache built them) instead of in a launch
    of their own."""
    rows = _upload(torch.stack(reference.visible_counts(pos, pool_size)).reshape(2, -1), device)
    return rows[0], rows[1]


def _put_rows(out, rows, idx) -> None:
    """``out[rows] = idx``: ``rows`` the first of ``idx.shape[0]`` contiguous rows (int), or
    int64 row indices on ``out``'s device (padding rows point at the sink row)."""
    if isinstance(rows, int):
        out[rows:rows + idx.shape[0]] = idx
    else:
        out.index_copy_(0, rows, idx)


def selection_width(index_topk, width, pool_size: int) -> int:
    """Validate ``index_topk`` and the requested row ``width`` of ``topk_indices``; returns the
    width (default ``index_topk + P - 1``)."""
    _check_index_topk(index_topk, pool_size)
    natural = index_topk + pool_size - 1
    if width is None:
        return natural
    check_int("width", width, least=0, most=MAX_SELECT)
    if width < natural:
        raise ValueError(f"width must be >= index_topk + pool_size - 1 = {natural}, got {width}")
    return width


def _check_index_topk(index_topk, pool_size: int) -> None:
    """``index_topk`` must be a positive int multiple of P (``select_k = index_topk // P >= 1``
    whole pools, as ``history_group_budget_for_topk``)."""
    check_int("index_topk", index_topk, least=None)
    if index_topk < pool_size or index_topk % pool_size:
        raise ValueError(f"index_topk must be a positive multiple of pool_size = {pool_size}, got {index_topk!r}")
    if index_topk + pool_size - 1 > MAX_SELECT:
        raise ValueError(f"index_topk + pool_size - 1 must be at most {MAX_SELECT} (int32 token positions), "
                         f"got {index_topk} + {pool_size} - 1")


def score_and_select_quantized(q8, w, kv_cache, page_table, positions, *, pool_size, select_k, width=None,
                               max_pools=None, layout=None, fp8_dtype=None, counts=None) -> torch.Tensor:
    """Device part of ``KPoolCache.topk_indices`` for one grid of rows, as a checked function of
    tensors an engine holds (no host syncs when ``KPOOL_CHECK=0`` or under CUDA-graph capture);
    the cache's own grids go to ``launch_paged_pool_topk`` unchecked.

    Parameters
    ----------
    q8 : fp8 ``[B, n, H, 128]`` rotated, quantized queries (``fwht128_quant_fp8``).
    w : fp32 ``[B, n, H]`` folded head weights (``reference.fold_head_weights``).
    kv_cache : uint8 ``[num_pages, PAGE, 132]``.
    page_table : int ``[B, max_pages]`` each row's request pages (pool granularity).
    positions : int ``[B, n]`` token positions (negative = padding row: no pools, no tail).
    pool_size, select_k : P and ``index_topk // P``.
    width : output columns (default ``select_k * P + P - 1``).
    max_pools : host int >= every row's visible pools ``(pos + 1) // P`` (default
        ``max_pages * PAGE``); when ``<= select_k`` nothing is scored.
    counts : ``visible_counts(positions, pool_size)`` when the caller has them already (e.g.
        from ``quantize_queries_and_counts``), else computed here.

    Returns
    -------
    int32 ``[B * n, width]`` rows as ``KPoolCache.topk_indices`` (padding rows all -1).
    """
    check_int("select_k", select_k, most=MAX_SELECT)
    batch, n = positions.shape
    seq, lens = counts or visible_counts(positions, pool_size)  # [B * n] tokens / complete pools each row sees
    lens = lens.view(batch, n)
    if max_pools is None:
        max_pools = page_table.shape[1] * kv_cache.shape[1]
    if max_pools > select_k:  # the selection's kernels write the tokens and tails
        return paged_pool_topk(q8, kv_cache, w, lens, page_table, select_k, layout=layout, fp8_dtype=fp8_dtype,
                               max_pools=max_pools, expand=(seq, pool_size, width))
    cols = torch.arange(select_k, dtype=torch.int64, device=seq.device)
    ids = torch.where(cols < lens.reshape(-1, 1), cols, -1).to(torch.int32)
    return expand_pools_and_append_tail(ids, seq, pool_size, width=width)


def score_and_select(q, weights, kv_cache, page_table, positions, *, pool_size, index_topk, width=None,
                     max_pools=None, layout=None, fp8_dtype=None, round_scale=True) -> torch.Tensor:
    """Query quantization + head-weight folding (with the rows' visible counts, one launch:
    ``quantize_queries_and_counts``) + ``score_and_select_quantized`` for one grid.

    ``q`` bf16 ``[B, n, H, 128]`` (unrotated), ``weights`` fp32 ``[B, n, H]`` (raw); the other
    arguments as ``score_and_select_quantized`` (``select_k = index_topk // pool_size``,
    ``width`` default ``index_topk + P - 1``). One unchunked pass: what a decode / verify
    step of ``KPoolCache.topk_indices`` runs (used by the scoring benchmarks).
    """
    check_tensor("q", q, dtype=torch.bfloat16, ndim=4)
    if q.shape[3] != HEAD_DIM:
        raise ValueError(f"q must have shape [B, n, H, {HEAD_DIM}], got {list(q.shape)}")
    check_heads("q", q.shape[2])
    check_int("pool_size", pool_size)
    _check_index_topk(index_topk, pool_size)
    fp8_dtype = resolve_fp8_dtype(fp8_dtype, q.device)
    q8, _, w, seq, lens = quantize_queries_and_counts(q, weights, positions, pool_size, fp8_dtype=fp8_dtype,
                                                      round_scale=round_scale)
    width = index_topk + pool_size - 1 if width is None else width
    return score_and_select_quantized(q8, w, kv_cache, page_table, positions, pool_size=pool_size,
                                      select_k=index_topk // pool_size, width=width, max_pools=max_pools,
                                      layout=layout, fp8_dtype=fp8_dtype, counts=(seq, lens))
