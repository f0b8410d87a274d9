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
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ._checks import check_tensor
from .layout import (ENTRY_BYTES, HEAD_DIM, read_entries, resolve_fp8_dtype, resolve_layout, ring_size)
from .ops.compress import compress_token_pools
from .ops.decode import kpool_decode_update_and_maybe_write_cache_batched
from .ops.tail import seed_requests


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


@dataclass
class _Request:
    block: int
    pages: list = field(default_factory=list)
    length: int = 0  # committed tokens
    step_start: int = 0  # first position of the last step
    step_len: int = 0  # tokens in the last step
    step_kind: str = ""


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
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        for name, value in (("num_pages", num_pages), ("page_size", page_size), ("pool_size", pool_size),
                            ("max_requests", max_requests)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(max_spec_tokens, int) or max_spec_tokens < 0:
            raise ValueError(f"max_spec_tokens must be a non-negative int, got {max_spec_tokens!r}")
        self.layout = resolve_layout(layout, self.device)
        if self.layout == "preshuffle" and page_size % 16:
            raise ValueError(f"layout='preshuffle' needs page_size % 16 == 0, got {page_size}")
        self.fp8_dtype = resolve_fp8_dtype(fp8_dtype, self.device)
        check_tensor("ape", ape, dtype=torch.float32, shape=(pool_size, HEAD_DIM))
        self.pool_size, self.page_size, self.max_spec_tokens = pool_size, page_size, max_spec_tokens
        self.round_scale = round_scale
        self.ring = ring_size(pool_size, max_spec_tokens)
        self.ape = ape.to(self.device).contiguous()
        self.kv_cache = torch.zeros((num_pages, page_size, ENTRY_BYTES), dtype=torch.uint8, device=self.device)
        self.tail = torch.zeros((max_requests, 2, self.ring, HEAD_DIM), dtype=torch.bfloat16, device=self.device)
        self._free_pages = list(range(num_pages - 1, -1, -1))
        self._free_blocks = list(range(max_requests - 1, -1, -1))
        self._requests: dict = {}
        self.last_step: StepMetadata | None = None

    # ------------------------------------------------------------------ queries
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

    def pool_slot(self, request_id, pool: int) -> int:
        """Flat cache slot of a request's pool ``pool`` (its page must be allocated)."""
        req = self._get(request_id)
        return req.pages[pool // self.page_size] * self.page_size + pool % self.page_size

    def page_table(self, request_ids) -> torch.Tensor:
        """int32 ``[R, max_pages]`` pages of each request (pool granularity, -1 padded)."""
        reqs = [self._get(r) for r in request_ids]
        width = max([len(r.pages) for r in reqs] + [1])
        rows = [r.pages + [-1] * (width - len(r.pages)) for r in reqs]
        return torch.tensor(rows, dtype=torch.int32, device=self.device).reshape(len(reqs), width)

    def pooled_keys(self, request_id) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored entries of the request's complete committed pools, in pool order:
        ``(codes [n_pools, 128] uint8, scales [n_pools] fp32)``."""
        n_pools = self._get(request_id).length // self.pool_size
        locs = torch.tensor([self.pool_slot(request_id, m) for m in range(n_pools)], dtype=torch.int64,
                            device=self.device)
        return read_entries(self.kv_cache, locs, self.layout)

    # ------------------------------------------------------------------ lifecycle
    def free(self, request_id) -> None:
        """Release a request's pages and ring block for reuse."""
        req = self._get(request_id)
        self._free_pages.extend(reversed(req.pages))
        self._free_blocks.append(req.block)
        del self._requests[request_id]

    def accept(self, request_ids, num_accepted) -> None:
        """Commit the first ``num_accepted[i]`` tokens of each request's last decode step; roll back the rest."""
        num_accepted = [int(n) for n in (num_accepted.tolist() if torch.is_tensor(num_accepted) else num_accepted)]
        if len(num_accepted) != len(request_ids):
            raise ValueError(f"num_accepted has {len(num_accepted)} entries for {len(request_ids)} request_ids")
        if len(set(request_ids)) != len(request_ids):
            raise ValueError("request_ids must not repeat within an accept")
        reqs = [self._get(r) for r in request_ids]
        for rid, req, n in zip(request_ids, reqs, num_accepted):
            if req.step_kind != "decode":
                raise ValueError(f"request {rid!r}: accept() follows a decode step, the last step was "
                                 f"{req.step_kind or 'none'}")
            if not 0 <= n <= req.step_len:
                raise ValueError(f"num_accepted for request {rid!r} is {n}, its last step had {req.step_len} tokens")
        for req, n in zip(reqs, num_accepted):
            req.length = req.step_start + n
            req.step_len = n

    # ------------------------------------------------------------------ steps
    def prefill(self, request_ids, keys, gates, *, cu_seqlens=None) -> StepMetadata:
        """Append one chunk of tokens to each listed request (new ids start at position 0).

        ``keys``/``gates``: a list of bf16 ``[n_i, 128]`` (one per request), or packed bf16
        ``[sum n_i, 128]`` with ``cu_seqlens`` (``[R + 1]`` offsets). Writes every pool the
        chunks complete (a chunk starting mid-pool completes it from the ring) and seeds
        each request's ring with its trailing tokens.
        """
        key, gate, bounds = self._pack(request_ids, keys, gates, cu_seqlens)
        lengths = [b - a for a, b in bounds]
        new_ids = [r for r in request_ids if r not in self._requests]
        starts = [self._requests[r].length if r in self._requests else 0 for r in request_ids]
        self._reserve(request_ids, new_ids, [s + n for s, n in zip(starts, lengths)])
        p, ring = self.pool_size, self.ring
        meta, locs, seeds, positions, slots, tslots = [], [], [], [], [], []
        for rid, (row0, row1), a in zip(request_ids, bounds, starts):
            req = self._requests[rid]
            b = a + (row1 - row0)
            for m in range(a // p, b // p):
                n_ring = max(a - m * p, 0)
                meta.append((row0 + m * p - a, req.block, m * p, n_ring))
                locs.append(self.pool_slot(rid, m))
            n_keep = min(b - a, b % p)
            seeds.append((row1, b, req.block, n_keep))
            pos = list(range(a, b))
            positions += pos
            slots += [self.pool_slot(rid, q // p) if q % p == p - 1 else -1 for q in pos]
            tslots += [req.block * ring + q % ring for q in pos]
            req.step_start, req.step_len, req.step_kind, req.length = a, b - a, "prefill", b
        dev = self.device
        meta_t = torch.tensor(meta, dtype=torch.int64, device=dev).reshape(-1, 4)
        locs_t = torch.tensor(locs, dtype=torch.int64, device=dev)
        compress_token_pools(self.kv_cache, self.tail, key, gate, self.ape, meta_t, locs_t, p, layout=self.layout,
                             fp8_dtype=self.fp8_dtype, round_scale=self.round_scale)
        seed_requests(self.tail, key, gate, torch.tensor(seeds, dtype=torch.int64, device=dev).reshape(-1, 4), p)
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        self.last_step = StepMetadata(
            "prefill", list(request_ids), torch.tensor(positions, dtype=torch.int32, device=dev),
            torch.tensor(slots, dtype=torch.int64, device=dev), torch.tensor(tslots, dtype=torch.int64, device=dev),
            self.page_table(request_ids), torch.tensor(cu, dtype=torch.int32, device=dev), meta_t, locs_t)
        return self.last_step

    def decode(self, request_ids, keys, gates) -> StepMetadata:
        """One decode / speculative-verify step: ``next_n`` tokens per request, all written speculatively.

        ``keys``/``gates``: bf16 ``[B, next_n, 128]``, or lists of ``[n_i, 128]`` (mixed lengths,
        padded here). At most ``max_spec_tokens + 1`` tokens per request; ``accept`` commits a prefix.
        """
        if torch.is_tensor(keys):
            check_tensor("keys", keys, dtype=torch.bfloat16, ndim=3, device=self.device)
            check_tensor("gates", gates, dtype=torch.bfloat16, shape=tuple(keys.shape), device=self.device)
            if keys.shape[0] != len(request_ids) or keys.shape[2] != HEAD_DIM:
                raise ValueError(f"keys must be [{len(request_ids)}, next_n, {HEAD_DIM}], got {list(keys.shape)}")
            counts = [keys.shape[1]] * len(request_ids)
            key, gate = keys, gates
        else:
            self._check_lists(request_ids, keys, gates)
            counts = [k.shape[0] for k in keys]
            width = max(counts + [1])
            key = torch.zeros((len(keys), width, HEAD_DIM), dtype=torch.bfloat16, device=self.device)
            gate = torch.zeros_like(key)
            for i, (k, g) in enumerate(zip(keys, gates)):
                key[i, : k.shape[0]] = k
                gate[i, : g.shape[0]] = g
        if len(set(request_ids)) != len(request_ids):
            raise ValueError("request_ids must not repeat within a step")
        for rid, n in zip(request_ids, counts):
            self._get(rid)
            if n > self.max_spec_tokens + 1:
                raise ValueError(f"request {rid!r} sends {n} tokens in one step; max_spec_tokens = "
                                 f"{self.max_spec_tokens} allows {self.max_spec_tokens + 1}")
        starts = [self._requests[r].length for r in request_ids]
        self._reserve(request_ids, [], [s + n for s, n in zip(starts, counts)])
        p, ring, width = self.pool_size, self.ring, key.shape[1]
        pos_rows, slot_rows, ts_rows = [], [], []
        for rid, a, n in zip(request_ids, starts, counts):
            req = self._requests[rid]
            pos = list(range(a, a + n))
            pad = [-1] * (width - n)
            pos_rows.append(pos + pad)
            slot_rows.append([self.pool_slot(rid, q // p) if q % p == p - 1 else -1 for q in pos] + pad)
            ts_rows.append([req.block * ring + q % ring for q in pos] + pad)
            req.step_start, req.step_len, req.step_kind, req.length = a, n, "decode", a + n
        dev, shape = self.device, (len(request_ids), width)
        positions = torch.tensor(pos_rows, dtype=torch.int32, device=dev).reshape(shape)
        slot_mapping = torch.tensor(slot_rows, dtype=torch.int64, device=dev).reshape(shape)
        tail_slots = torch.tensor(ts_rows, dtype=torch.int64, device=dev).reshape(shape)
        kpool_decode_update_and_maybe_write_cache_batched(
            self.kv_cache, self.tail, tail_slots, key, gate, self.ape, slot_mapping, positions, p,
            round_scale=self.round_scale, layout=self.layout, fp8_dtype=self.fp8_dtype)
        self.last_step = StepMetadata("decode", list(request_ids), positions, slot_mapping, tail_slots,
                                      self.page_table(request_ids))
        return self.last_step

    # ------------------------------------------------------------------ helpers
    def _get(self, request_id) -> _Request:
        try:
            return self._requests[request_id]
        except (KeyError, TypeError):
            raise KeyError(f"unknown or freed request id {request_id!r}") from None

    def _check_lists(self, request_ids, keys, gates) -> None:
        if not isinstance(keys, (list, tuple)) or not isinstance(gates, (list, tuple)):
            raise TypeError("keys and gates must both be tensors or both be lists of [n_i, 128] tensors")
        if not (len(keys) == len(gates) == len(request_ids)):
            raise ValueError(f"got {len(keys)} keys and {len(gates)} gates for {len(request_ids)} request_ids")
        for i, (k, g) in enumerate(zip(keys, gates)):
            check_tensor(f"keys[{i}]", k, dtype=torch.bfloat16, ndim=2, device=self.device)
            check_tensor(f"gates[{i}]", g, dtype=torch.bfloat16, shape=tuple(k.shape), device=self.device)
            if k.shape[1] != HEAD_DIM:
                raise ValueError(f"keys[{i}] must be [n, {HEAD_DIM}], got {list(k.shape)}")

    def _pack(self, request_ids, keys, gates, cu_seqlens):
        """Token-major ``[T, 128]`` keys / gates and each request's row range."""
        if len(set(request_ids)) != len(request_ids):
            raise ValueError("request_ids must not repeat within a step")
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
        cu = [int(c) for c in (cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else cu_seqlens)]
        if len(cu) != len(request_ids) + 1 or cu[0] != 0 or cu[-1] != keys.shape[0] or any(
                b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"cu_seqlens must be non-decreasing offsets [0, ..., {keys.shape[0]}] with "
                             f"{len(request_ids) + 1} entries, got {cu}")
        return keys, gates, list(zip(cu, cu[1:]))

    def _reserve(self, request_ids, new_ids, new_lengths) -> None:
        """Check capacity for the step, then allocate ring blocks and pages (all or nothing)."""
        if len(new_ids) > len(self._free_blocks):
            raise CacheCapacityError(f"too many requests: {len(new_ids)} new, {len(self._free_blocks)} ring blocks "
                                     f"free (max_requests = {self.tail.shape[0]})")
        need = {}
        for rid, length in zip(request_ids, new_lengths):
            have = len(self._requests[rid].pages) if rid in self._requests else 0
            pools = length // self.pool_size
            need[rid] = max(-(-pools // self.page_size) - have, 0)
        total = sum(need.values())
        if total > len(self._free_pages):
            raise CacheCapacityError(f"out of pages: the step needs {total}, {len(self._free_pages)} free")
        for rid in new_ids:
            self._requests[rid] = _Request(block=self._free_blocks.pop())
        for rid, n in need.items():
            self._requests[rid].pages += [self._free_pages.pop() for _ in range(n)]
