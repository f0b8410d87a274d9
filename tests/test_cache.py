"""KPoolCache: random serving schedules, split invariance, misuse, metadata formulas, input forms.

The tests keep their OWN model of every live request (its committed keys / gates, the pages
and ring block it was given, its last step) and check the cache against it after every step:

* ``pooled_keys(r)`` equals ``numerics.compress_pools`` of r's committed complete pools, byte
  for byte, and the same bytes sit at the pool's slot when read through an independent
  implementation of SPEC §3's byte layout (``_entry_offsets`` below);
* r's ring block holds r's committed tokens of its incomplete pool;
* no byte of ``kv_cache`` / ``tail`` changed except the entries / ring slots the step's
  metadata says it wrote, and those belong to the step's requests (their pages / block);
* the step's metadata follows the formulas of ``kpool.cache``'s module docstring.

Caches start filled with random bytes (kv_cache and ring), so a pool built from a ring slot
that was never written, or from a rolled-back draft, fails. Drafts that get rejected carry
fresh random tokens, different from the ones later accepted at the same positions.

Chunk lengths: a prefill chunk of 0 tokens is allowed; it registers a new request (length 0)
or is a no-op for an existing one (the random schedules use it; decode then starts at 0).
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis.control import currently_in_test_context
from hypothesis import strategies as st

from kpool import numerics
from kpool.cache import CacheCapacityError, KPoolCache

from _util import assert_bytes_equal, random_bytes_like

D = 128
ENTRY = 132
FP8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
LAYOUTS = ("plain", "preshuffle")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Random schedules per (P, max_spec_tokens): 2 * 3 * (30 + 4) = 204 in all.
EXAMPLES = {"torch": 30, "triton": 4}
STEPS = {"torch": (4, 14), "triton": (4, 6)}  # steps per schedule (bounds)


# --- independent model of the addressing (SPEC §3), not kpool.layout ---------------------

def ring_of(pool, spec):
    """Smallest ``P * 2^k`` holding ``P + spec`` tokens."""
    ring = pool
    while ring < pool + spec:
        ring *= 2
    return ring


def _entry_offsets(locs, page, layout):
    """Byte offsets ``[n, 132]`` (128 key bytes, 4 scale bytes) of flat slots ``locs`` in a dense cache."""
    locs = torch.as_tensor(locs, dtype=torch.int64).reshape(-1, 1)
    pg, s = locs // page, locs % page
    base = pg * (page * ENTRY)
    d = torch.arange(D, dtype=torch.int64)[None, :]
    if layout == "plain":
        key = s * D + d
    else:
        key = (s // 16) * 2048 + (d // 16) * 256 + (s % 16) * 16 + d % 16
    scale = page * D + s * 4 + torch.arange(4, dtype=torch.int64)[None, :]
    return torch.cat((base + key, base + scale), dim=1)


def _pool_slot(pages, pool, page):
    return pages[pool // page] * page + pool % page


def note(label):
    """A hypothesis statistics event (``pytest --hypothesis-show-statistics``); no-op outside ``@given``."""
    if currently_in_test_context():
        event(label)


def same_bytes(a, b, what):
    """``assert_bytes_equal`` with a fast path for the (usual) equal case."""
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.dtype == b.dtype and a.shape == b.shape and torch.equal(
            a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)):
        return
    assert_bytes_equal(a, b, what)


class Tokens:
    """Reproducible random bf16 keys (LayerNorm-like scale) and gate scores."""

    def __init__(self, seed):
        self.g = torch.Generator().manual_seed(seed)

    def __call__(self, n):
        k = (torch.randn(n, D, generator=self.g) * 3).to(torch.bfloat16)
        s = (torch.randn(n, D, generator=self.g) * 2).to(torch.bfloat16)
        return k.to(DEVICE), s.to(DEVICE)


def _cat(a, b):
    return torch.cat((a, b)) if a is not None else b


class Harness:
    """A KPoolCache (random-filled) plus the test's own model of what it must hold."""

    def __init__(self, *, pool, spec, page=16, layout="plain", fp8=torch.float8_e4m3fn, num_pages=4,
                 max_requests=3, seed=0):
        self.P, self.spec, self.page, self.layout, self.fp8 = pool, spec, page, layout, fp8
        self.num_pages, self.max_requests = num_pages, max_requests
        g = torch.Generator().manual_seed(seed)
        self.ape = (torch.randn(pool, D, generator=g) * 2).to(DEVICE)
        self.cache = KPoolCache(num_pages, page_size=page, pool_size=pool, max_requests=max_requests,
                                max_spec_tokens=spec, ape=self.ape, device=DEVICE, layout=layout, fp8_dtype=fp8)
        self.ring = ring_of(pool, spec)
        c = self.cache
        assert tuple(c.kv_cache.shape) == (num_pages, page, ENTRY) and c.kv_cache.dtype == torch.uint8
        assert tuple(c.tail.shape) == (max_requests, 2, self.ring, D) and c.tail.dtype == torch.bfloat16
        assert c.kv_cache.is_contiguous() and c.tail.is_contiguous()
        c.kv_cache.copy_(random_bytes_like(c.kv_cache.shape, DEVICE, seed + 1))
        tail_bytes = c.tail.view(torch.uint8)
        tail_bytes.copy_(random_bytes_like(tail_bytes.shape, DEVICE, seed + 2))
        self.tokens = Tokens(seed + 3)
        self.keys, self.gates = {}, {}  # rid -> committed bf16 [L, 128]
        self.codes, self.scales = {}, {}  # rid -> expected entries of the committed complete pools
        self.pages = {}  # rid -> pages (observed, checked against the predicted count)
        self.block = {}  # rid -> ring block (observed at its first token)
        self.last = {}  # rid -> (kind, start, n) of its last step
        self.steps = 0

    # ------------------------------------------------------------------ model
    def length(self, r):
        return self.keys[r].shape[0] if r in self.keys else 0

    def live(self):
        return list(self.keys)

    def _pages_for(self, length):
        return -(-(length // self.P) // self.page)

    def capacity_problem(self, rids, new_lengths):
        """What a step must fail with: ``"requests"``, ``"pages"`` or None."""
        new = [r for r in rids if r not in self.keys]
        if len(new) > self.max_requests - len(self.keys):
            return "requests"
        held = sum(len(p) for p in self.pages.values())
        need = sum(max(self._pages_for(n) - len(self.pages.get(r, [])), 0) for r, n in zip(rids, new_lengths))
        return "pages" if need > self.num_pages - held else None

    def _set_stream(self, r, keys, gates):
        self.keys[r], self.gates[r] = keys, gates
        n_pools = keys.shape[0] // self.P
        have = self.codes[r].shape[0]
        if have > n_pools:
            self.codes[r], self.scales[r] = self.codes[r][:n_pools], self.scales[r][:n_pools]
        elif have < n_pools:
            k = keys[have * self.P: n_pools * self.P].reshape(-1, self.P, D).cpu()
            g = gates[have * self.P: n_pools * self.P].reshape(-1, self.P, D).cpu()
            codes, scales = numerics.compress_pools(k, g, self.ape.cpu(), self.fp8)
            self.codes[r] = torch.cat((self.codes[r], codes))
            self.scales[r] = torch.cat((self.scales[r], scales))

    def _append(self, r, k, g):
        if r not in self.keys:
            self.keys[r] = self.gates[r] = None
            self.codes[r] = torch.zeros((0, D), dtype=torch.uint8)
            self.scales[r] = torch.zeros(0, dtype=torch.float32)
            self.pages[r] = []
        self._set_stream(r, _cat(self.keys[r], k), _cat(self.gates[r], g))

    # ------------------------------------------------------------------ snapshots
    def snapshot(self):
        c = self.cache
        lengths = {r: c.length(r) for r in c.requests}
        tables = c.page_table(c.requests).clone() if c.requests else None
        return c.kv_cache.clone(), c.tail.clone(), lengths, tables, c.metadata()

    def assert_unchanged(self, snap, what):
        c = self.cache
        kv, tail, lengths, tables, meta = snap
        same_bytes(c.kv_cache, kv, f"{what}: kv_cache")
        same_bytes(c.tail, tail, f"{what}: tail ring")
        assert {r: c.length(r) for r in c.requests} == lengths, f"{what}: request lengths changed"
        if tables is not None:
            assert torch.equal(c.page_table(list(lengths)), tables), f"{what}: page tables changed"
        assert c.metadata() is meta, f"{what}: metadata() changed"

    def expect_error(self, exc, match, fn, what):
        snap = self.snapshot()
        with pytest.raises(exc, match=match):
            fn()
        self.assert_unchanged(snap, what)

    # ------------------------------------------------------------------ checks
    def _learn_pages(self, rids, lengths_after, table):
        """Pages of the step's requests after the step: old pages kept, count as predicted."""
        assert table.dtype == torch.int32 and table.shape[0] == len(rids), f"page_table {tuple(table.shape)}"
        for i, r in enumerate(rids):
            row = table[i].tolist()
            pages = [p for p in row if p >= 0]
            assert row == pages + [-1] * (len(row) - len(pages)), f"page_table row of {r!r} not -1 padded: {row}"
            old = self.pages[r]
            assert pages[: len(old)] == old, f"request {r!r}: pages {old} became {pages}"
            want = max(len(old), self._pages_for(lengths_after[i]))
            assert len(pages) == want, f"request {r!r} of length {lengths_after[i]}: {len(pages)} pages, want {want}"
            self.pages[r] = pages

    def _learn_block(self, r, tail_slot):
        if r not in self.block:
            self.block[r] = tail_slot // self.ring

    def _token_rows(self, r, start, n):
        """Expected (positions, slot_mapping, tail_slot_mapping) of a request's tokens."""
        P, page, blk = self.P, self.page, self.block.get(r, -1)
        pos = list(range(start, start + n))
        slots = [_pool_slot(self.pages[r], q // P, page) if (q + 1) % P == 0 else -1 for q in pos]
        ts = [blk * self.ring + q % self.ring for q in pos]
        return pos, slots, ts

    def _check_writes(self, before_kv, before_tail, slot_mapping, tail_slot_mapping, what):
        """Only the entries at ``slot_mapping`` and ring slots at ``tail_slot_mapping`` may change."""
        c = self.cache
        locs = slot_mapping[slot_mapping >= 0].cpu()
        mask = torch.zeros(c.kv_cache.numel(), dtype=torch.bool)
        mask[_entry_offsets(locs, self.page, self.layout).reshape(-1)] = True
        changed = (c.kv_cache.reshape(-1).cpu() != before_kv.reshape(-1).cpu())
        bad = (changed & ~mask).nonzero().flatten()
        if bad.numel():
            off = bad[:4].tolist()
            where = [(o // (self.page * ENTRY), o % (self.page * ENTRY)) for o in off]
            raise AssertionError(f"{what}: {bad.numel()} kv_cache bytes changed outside the step's slots "
                                 f"{locs.tolist()}; first (page, byte): {where}")
        ts = tail_slot_mapping[tail_slot_mapping >= 0].cpu()
        tmask = torch.zeros(c.tail.shape[0], 2, self.ring, D, dtype=torch.bool)
        tmask[ts // self.ring, :, ts % self.ring] = True
        tchanged = (c.tail.cpu().view(torch.int16) != before_tail.cpu().view(torch.int16))
        tbad = (tchanged & ~tmask).nonzero()
        if tbad.numel():
            raise AssertionError(f"{what}: ring changed outside the step's tail slots {ts.tolist()}; "
                                 f"first (block, k/g, slot, dim): {tbad[:4].tolist()}")

    def check_state(self, what):
        """Everything the model knows, against the cache."""
        c, P, page = self.cache, self.P, self.page
        live = self.live()
        assert sorted(map(repr, c.requests)) == sorted(map(repr, live)), f"{what}: live requests"
        all_pages = [p for r in live for p in self.pages[r]]
        assert len(set(all_pages)) == len(all_pages) and all(0 <= p < self.num_pages for p in all_pages), \
            f"{what}: pages shared or out of range: {self.pages}"
        blocks = [self.block[r] for r in live if r in self.block]
        assert len(set(blocks)) == len(blocks) and all(0 <= b < self.max_requests for b in blocks), \
            f"{what}: ring blocks shared or out of range: {self.block}"
        if live:
            table = c.page_table(live)
            for i, r in enumerate(live):
                assert [p for p in table[i].tolist() if p >= 0] == self.pages[r], f"{what}: page_table({r!r})"
        flat = c.kv_cache.reshape(-1).cpu()
        for r in live:
            n_tok = self.length(r)
            assert c.length(r) == n_tok, f"{what}: length({r!r}) = {c.length(r)}, want {n_tok}"
            codes, scales = c.pooled_keys(r)
            assert codes.dtype == torch.uint8 and scales.dtype == torch.float32
            same_bytes(codes, self.codes[r], f"{what}: pooled_keys({r!r}) codes")
            same_bytes(scales, self.scales[r], f"{what}: pooled_keys({r!r}) scales")
            n_pools = n_tok // P
            locs = [_pool_slot(self.pages[r], m, page) for m in range(n_pools)]
            raw = flat[_entry_offsets(locs, page, self.layout)]
            same_bytes(raw[:, :D], self.codes[r], f"{what}: key bytes of {r!r} at slots {locs}")
            same_bytes(raw[:, D:].contiguous().view(torch.float32).reshape(-1), self.scales[r],
                       f"{what}: scale bytes of {r!r} at slots {locs}")
            if n_tok % P:
                assert c.ring_block(r) == self.block[r], f"{what}: ring_block({r!r}) = {c.ring_block(r)}, " \
                                                         f"its tokens went to block {self.block[r]}"
                pos = torch.arange(n_pools * P, n_tok)
                ring = c.tail[c.ring_block(r)][:, pos % self.ring].cpu()
                same_bytes(ring[0], self.keys[r][pos].cpu(), f"{what}: ring keys of {r!r}")
                same_bytes(ring[1], self.gates[r][pos].cpu(), f"{what}: ring gates of {r!r}")

    # ------------------------------------------------------------------ steps
    def _begin_step(self, kind, rids, counts, chunks):
        """A step's label, token chunks (``counts[i]`` fresh random tokens unless given), and
        each request's length before and after it."""
        self.steps += 1
        what = f"step {self.steps} {kind} {rids} {counts}"
        chunks = chunks or [self.tokens(n) for n in counts]
        starts = [self.length(r) for r in rids]
        return what, chunks, starts, [a + n for a, n in zip(starts, counts)]

    def prefill(self, rids, lengths, form="list", row_pad=0, chunks=None):
        """One prefill step; ``form``: ``list`` or ``packed`` (``row_pad`` extra elements per row)."""
        what, chunks, starts, after = self._begin_step("prefill", rids, lengths, chunks)
        if form == "list":
            call = lambda: self.cache.prefill(rids, [k for k, _ in chunks], [g for _, g in chunks])  # noqa: E731
        else:
            keys, gates = packed(chunks, row_pad)
            cu = torch.tensor([0] + list(torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()),
                              dtype=torch.int32, device=DEVICE)
            call = lambda: self.cache.prefill(rids, keys, gates, cu_seqlens=cu)  # noqa: E731
        problem = self.capacity_problem(rids, after)
        if problem:
            note(f"prefill: out of {problem}")
            self.expect_error(CacheCapacityError, problem, call, what)
            return None
        P = self.P
        for r, a, n in zip(rids, starts, lengths):
            note("prefill: new request" if r not in self.keys else "prefill: existing request")
            if n == 0:
                note("prefill: 0 tokens")
            elif a % P and a // P == (a + n - 1) // P:
                note("prefill: chunk inside one pool, starts mid-pool")
            elif a % P:
                note("prefill: starts mid-pool and completes it")
            if self._pages_for(a + n) > max(len(self.pages.get(r, [])), 1):
                note("prefill: crosses a page")
        before_kv, before_tail = self.cache.kv_cache.clone(), self.cache.tail.clone()
        meta = call()
        assert meta is self.cache.metadata()
        for r, (k, g) in zip(rids, chunks):
            self._append(r, k, g)
            self.last[r] = ("prefill", self.length(r) - k.shape[0], k.shape[0])
        # metadata (module docstring formulas)
        assert meta.kind == "prefill" and list(meta.request_ids) == list(rids)
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        assert meta.cu_seqlens.dtype == torch.int32 and meta.cu_seqlens.tolist() == cu, what
        self._learn_pages(rids, after, meta.page_table)
        for i, r in enumerate(rids):
            if lengths[i]:
                self._learn_block(r, int(meta.tail_slot_mapping[cu[i]]))
        pos, slots, ts, pool_meta, pool_locs = [], [], [], [], []
        for i, (r, a, n) in enumerate(zip(rids, starts, lengths)):
            p_, s_, t_ = self._token_rows(r, a, n)
            pos += p_
            slots += s_
            ts += t_
            for m in range(a // self.P, (a + n) // self.P):
                pool_meta.append([cu[i] + m * self.P - a, self.block[r], m * self.P, max(a - m * self.P, 0)])
                pool_locs.append(_pool_slot(self.pages[r], m, self.page))
        assert meta.positions.dtype == torch.int32 and meta.positions.tolist() == pos, what
        assert meta.slot_mapping.dtype == torch.int64 and meta.slot_mapping.tolist() == slots, what
        assert meta.tail_slot_mapping.dtype == torch.int64 and meta.tail_slot_mapping.tolist() == ts, what
        assert meta.pool_locs.tolist() == pool_locs == [s for s in slots if s >= 0], what
        assert meta.pool_meta.reshape(-1, 4).tolist() == pool_meta, what
        self._check_writes(before_kv, before_tail, meta.slot_mapping, meta.tail_slot_mapping, what)
        self.check_state(what)
        return meta

    def decode(self, rids, counts, form="list", chunks=None):
        """One decode / verify step with ``counts[i]`` fresh random tokens (or ``chunks``) for ``rids[i]``."""
        what, chunks, starts, after = self._begin_step("decode", rids, counts, chunks)
        if form == "tensor":
            assert len(set(counts)) == 1
            keys = torch.stack([k for k, _ in chunks])
            gates = torch.stack([g for _, g in chunks])
            call = lambda: self.cache.decode(rids, keys, gates)  # noqa: E731
        else:
            call = lambda: self.cache.decode(rids, [k for k, _ in chunks], [g for _, g in chunks])  # noqa: E731
        problem = self.capacity_problem(rids, after)
        if problem:
            note(f"decode: out of {problem}")
            self.expect_error(CacheCapacityError, problem, call, what)
            return None
        for a, n in zip(starts, counts):
            note(f"decode: next_n = {n}")
            if (a + n) // self.P > a // self.P:
                note("decode: completes a pool")
            if (a + n - 1) // self.ring > a // self.ring:
                note("decode: wraps the ring")
        before_kv, before_tail = self.cache.kv_cache.clone(), self.cache.tail.clone()
        meta = call()
        assert meta is self.cache.metadata()
        for r, (k, g), a in zip(rids, chunks, starts):
            self._append(r, k, g)
            self.last[r] = ("decode", a, k.shape[0])
        assert meta.kind == "decode" and list(meta.request_ids) == list(rids)
        self._learn_pages(rids, after, meta.page_table)
        width = meta.positions.shape[1]
        assert meta.positions.shape == (len(rids), width) and width >= max(counts + [0]), what
        for i, r in enumerate(rids):
            if counts[i]:
                self._learn_block(r, int(meta.tail_slot_mapping[i, 0]))
            pos, slots, ts = self._token_rows(r, starts[i], counts[i])
            pad = [-1] * (width - counts[i])
            assert meta.positions[i].tolist() == pos + pad, f"{what}: positions[{i}]"
            assert meta.slot_mapping[i].tolist() == slots + pad, f"{what}: slot_mapping[{i}]"
            assert meta.tail_slot_mapping[i].tolist() == ts + pad, f"{what}: tail_slot_mapping[{i}]"
        self._check_writes(before_kv, before_tail, meta.slot_mapping, meta.tail_slot_mapping, what)
        self.check_state(what)
        return meta

    def accept(self, rids, accepted):
        self.steps += 1
        what = f"step {self.steps} accept {rids} {accepted}"
        snap = self.snapshot()
        self.cache.accept(rids, accepted)
        kv, tail, _, tables, meta = snap
        same_bytes(self.cache.kv_cache, kv, f"{what}: kv_cache")
        same_bytes(self.cache.tail, tail, f"{what}: tail")
        for r, n in zip(rids, accepted):
            _, start, sent = self.last[r]
            note("accept: rejects drafts" if n < sent else "accept: all")
            if n < sent and (start + sent) // self.P > (start + n) // self.P:
                note("accept: rolls back a written pool")
            self._set_stream(r, self.keys[r][: start + n], self.gates[r][: start + n])
            self.last[r] = ("accepted", start, n)
        self.check_state(what)

    def free(self, r):
        self.steps += 1
        what = f"step {self.steps} free {r!r}"
        kv, tail = self.cache.kv_cache.clone(), self.cache.tail.clone()
        self.cache.free(r)
        same_bytes(self.cache.kv_cache, kv, f"{what}: kv_cache")
        same_bytes(self.cache.tail, tail, f"{what}: tail")
        for d in (self.keys, self.gates, self.codes, self.scales, self.pages, self.block, self.last):
            d.pop(r, None)
        self.check_state(what)


def packed(chunks, row_pad=0, gate_pad=None):
    """Token-major ``[T, 128]`` keys / gates; with padding they are views with a row stride > 128."""
    gate_pad = row_pad if gate_pad is None else gate_pad
    keys = torch.cat([k for k, _ in chunks]) if chunks else torch.zeros(0, D, dtype=torch.bfloat16, device=DEVICE)
    gates = torch.cat([g for _, g in chunks]) if chunks else torch.zeros_like(keys)

    def pad(x, extra):
        if not extra:
            return x
        buf = torch.full((x.shape[0], D + extra), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        buf[:, :D] = x
        return buf[:, :D]

    return pad(keys, row_pad), pad(gates, gate_pad)


# --- 1. random interleaved schedules -----------------------------------------------------

def _chunk_len(rng, h, r, backend):
    """A prefill chunk for request ``r``: inside one pool, completing the current pool, stopping
    just short of a pool end, long, empty, or (torch) crossing a page."""
    P, have = h.P, h.length(r)
    kind = rng.choices(["short", "finish", "almost", "long", "zero", "huge"],
                       [3, 3, 2, 3, 1, 1.5 if backend == "torch" else 0])[0]
    if kind == "zero":
        return 0
    if kind == "almost":  # stops 1..spec+1 tokens before a pool end: the next decode step completes it
        return (P - have % P - rng.randint(1, min(h.spec + 1, P - 1))) % P + P * rng.randint(0, 1)
    if kind == "short":  # 1..P-1 tokens: stays in the pool or crosses into the next one
        return rng.randint(1, P - 1)
    if kind == "finish":  # completes the current (possibly partial) pool, maybe plus a whole pool
        return P - have % P + P * rng.randint(0, 1)
    if kind == "long":
        return rng.randint(1, 2 * P + 3 if backend == "torch" else P + 3)
    return rng.randint(P * h.page - P, P * h.page + P + 1)  # crosses a page


def _bad_step(rng, h):
    """A misuse mixed into the schedule: must raise and leave the cache unchanged."""
    live = h.live()
    decoded = [r for r in live if h.last.get(r, ("",))[0] == "decode"]
    prefilled = [r for r in live if h.last.get(r, ("",))[0] == "prefill"]
    accepted = [r for r in live if h.last.get(r, ("",))[0] == "accepted"]
    options = ["unknown", "repeat"] + ["too_many"] * bool(live) + ["accept_big"] * bool(decoded) + \
        ["accept_prefill"] * bool(prefilled) + ["accept_twice"] * bool(accepted)
    kind = rng.choice(options)
    note(f"misuse: {kind}")
    k, g = h.tokens(1)
    c = h.cache
    if kind == "unknown":  # a freed or never seen id, next to a valid request
        bad = rng.choice([r for r in range(6) if r not in h.keys] + ["nope"])
        rids = live[:1] + [bad]
        h.expect_error(KeyError, "unknown", lambda: c.decode(rids, [k] * len(rids), [g] * len(rids)), kind)
        h.expect_error(KeyError, "unknown", lambda: c.accept([bad], [0]), kind)
    elif kind == "repeat":
        r = rng.choice(live) if live else 0
        h.expect_error(ValueError, "repeat", lambda: c.prefill([r, r], [k, k], [g, g]), kind)
        if live:
            h.expect_error(ValueError, "repeat", lambda: c.decode([r, r], [k, k], [g, g]), kind)
    elif kind == "too_many":
        kk, gg = h.tokens(h.spec + 2)
        rids = rng.sample(live, len(live))
        h.expect_error(ValueError, "max_spec_tokens", lambda: c.decode(rids, [k] * (len(rids) - 1) + [kk],
                                                                       [g] * (len(rids) - 1) + [gg]), kind)
    elif kind == "accept_big":
        r = rng.choice(decoded)
        h.expect_error(ValueError, "num_accepted", lambda: c.accept([r], [h.last[r][2] + 1]), kind)
    elif kind == "accept_twice":  # even the same count: the step was committed
        r = rng.choice(accepted)
        h.expect_error(ValueError, "already accepted", lambda: c.accept([r], [h.last[r][2]]), kind)
    else:
        r = rng.choice(prefilled)
        h.expect_error(ValueError, "decode", lambda: c.accept([r], [0]), kind)


def run_schedule(data, backend, pool, spec):
    """Hypothesis draws the cache configuration and a schedule seed; the steps come from
    ``random.Random(seed)`` (hypothesis's own choices crowd at the ends of every range, which
    starves the interleavings). A failure names the step and its arguments."""
    pick = lambda values, label: data.draw(st.sampled_from(values), label=label)  # noqa: E731
    h = Harness(pool=pool, spec=spec, page=pick([16, 32], "page_size"), layout=pick(LAYOUTS, "layout"),
                fp8=pick(FP8, "fp8"), num_pages=pick([1, 2, 3, 4], "num_pages"),
                max_requests=pick([1, 2, 3], "max_requests"), seed=data.draw(st.integers(0, 2**20), label="seed"))
    rng = random.Random(data.draw(st.integers(0, 2**32 - 1), label="schedule seed"))
    n_steps = rng.randint(*STEPS[backend])
    max_batch = 3 if backend == "torch" else 2
    for _ in range(n_steps):
        live = h.live()
        decoded = [r for r in live if h.last.get(r, ("",))[0] == "decode"]
        weights = {"decode": 5 * bool(live), "accept": 4 * bool(decoded), "prefill": 3 * bool(live),
                   "new": 2 if len(live) < h.max_requests else 0.5, "free": bool(live), "bad": 0.5}
        op = rng.choices(list(weights), list(weights.values()))[0]
        note(f"op: {op}")
        if op in ("new", "prefill"):
            fresh = [r for r in range(5) if r not in h.keys]  # may be ids freed earlier
            new = rng.sample(fresh, rng.choice([1, 1, 2] if op == "new" else [0, 0, 0, 1]))
            old = rng.sample(live, rng.randint(op == "prefill", min(len(live), max_batch)))
            rids = rng.sample(new + old, len(new + old))[:max_batch]
            lengths = [_chunk_len(rng, h, r, backend) for r in rids]
            h.prefill(rids, lengths, rng.choice(["list", "packed"]), row_pad=rng.choice([0, 0, 8]))
        elif op == "decode":
            rids = rng.sample(live, rng.randint(1, min(len(live), max_batch)))
            if rng.random() < 0.5:  # one next_n, tensor or list form
                counts = [rng.randint(1, spec + 1)] * len(rids)
                form = rng.choice(["tensor", "list"])
            else:  # mixed lengths (0 = the request sits this step out)
                counts = [rng.choice([0] + [n for n in range(1, spec + 2) for _ in range(3)]) for _ in rids]
                form = "list"
            h.decode(rids, counts, form)
        elif op == "accept":
            rids = rng.sample(decoded, rng.randint(1, len(decoded)))
            h.accept(rids, [rng.randint(0, h.last[r][2]) for r in rids])
        elif op == "free":
            h.free(rng.choice(live))
        else:
            _bad_step(rng, h)
    return h


@pytest.mark.parametrize("spec", [0, 1, 3])
@pytest.mark.parametrize("pool", [4, 16])
def test_random_schedules(backend, pool, spec):
    """Random interleaved prefill / decode / accept / free / misuse schedules (see module doc)."""

    @settings(max_examples=EXAMPLES[backend], deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(st.data())
    def run(data):
        run_schedule(data, backend, pool, spec)

    run()


@pytest.mark.parametrize("pool", [4, 16])
def test_random_schedules_without_row_select(pool, monkeypatch):
    """The ring-fed writers (decode, prefill head pools) with ``ROW_SELECT`` off, as AMD targets
    compile them (two masked loads per ring-fed slot instead of a pointer select): the
    schedules' bytes still match the oracle."""
    from kpool.ops import decode, prefill
    monkeypatch.setenv("KPOOL_BACKEND", "triton")
    for mod in (decode, prefill):
        monkeypatch.setattr(mod, "row_select", lambda: False)

    @settings(max_examples=EXAMPLES["triton"], deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(st.data())
    def run(data):
        run_schedule(data, "triton", pool, 3)

    run()


# --- 2. one stream, any split: identical pooled bytes --------------------------------------

@pytest.mark.parametrize("pool,layout,fp8", [(4, "plain", torch.float8_e4m3fn),
                                             (16, "preshuffle", torch.float8_e4m3fnuz)])
def test_same_stream_any_split(backend, pool, layout, fp8):
    """One prefill == two chunks at every split == three chunks == token-by-token decode ==
    speculative decode with rejected drafts, all byte-identical to ``compress_pools``."""
    n_tok = 3 * pool + 2 if pool == 4 else pool + 3
    stream = Tokens(7)(n_tok)
    keys, gates = stream
    splits2 = list(range(n_tok + 1))
    splits3 = [(1, pool), (pool - 1, pool + 1), (2, n_tok - 1), (pool, pool), (pool + 1, n_tok)]
    n_req = 1 + len(splits2) + len(splits3)
    h = Harness(pool=pool, spec=0, layout=layout, fp8=fp8, num_pages=n_req + 2, max_requests=n_req, seed=11)
    sl = lambda a, b: (keys[a:b], gates[a:b])  # noqa: E731

    # all requests in the same steps (one batched step per chunk index)
    reqs = [("one", [n_tok])] + [(f"split{j}", [j, n_tok - j]) for j in splits2] + \
           [(f"split{i}_{j}", [i, j - i, n_tok - j]) for i, j in splits3]
    for step in range(3):
        rids, chunks = [], []
        for name, cuts in reqs:
            if step < len(cuts):
                a = sum(cuts[:step])
                rids.append(name)
                chunks.append(sl(a, a + cuts[step]))
        h.prefill(rids, [k.shape[0] for k, _ in chunks], chunks=chunks)
    n_full = n_tok // pool * pool

    def want(h):
        return numerics.compress_pools(keys[:n_full].reshape(-1, pool, D).cpu(),
                                       gates[:n_full].reshape(-1, pool, D).cpu(), h.ape.cpu(), fp8)

    want_codes, want_scales = want(h)
    for name, _ in reqs:
        codes, scales = h.cache.pooled_keys(name)
        same_bytes(codes, want_codes, f"{name}: codes")
        same_bytes(scales, want_scales, f"{name}: scales")
        h.free(name)

    # token by token (a 0-token prefill registers the request), next to a request fed in
    # random-sized verify steps (max_spec_tokens = 3) whose rejected drafts are random tokens
    h2 = Harness(pool=pool, spec=3, layout=layout, fp8=fp8, num_pages=4, max_requests=2, seed=12)
    h2.prefill(["tok", "spec"], [0, 1], chunks=[sl(0, 0), sl(0, 1)])
    rng = torch.Generator().manual_seed(5)
    rand = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=rng))  # noqa: E731
    for t in range(n_tok):
        rids, chunks = ["tok"], [sl(t, t + 1)]
        have = h2.length("spec")
        if have < n_tok:
            n = rand(1, 4)
            good = rand(1, min(n, n_tok - have))  # the drafts after `good` are rejected
            k, g = sl(have, have + good)
            dk, dg = h2.tokens(n - good)
            rids.append("spec")
            chunks.append((torch.cat((k, dk)), torch.cat((g, dg))))
        h2.decode(rids, [k.shape[0] for k, _ in chunks], chunks=chunks)
        if "spec" in rids and (good < n or rand(0, 1)):
            h2.accept(["spec"], [good])
    want_codes, want_scales = want(h2)
    for name in ("tok", "spec"):
        assert h2.length(name) == n_tok
        codes, scales = h2.cache.pooled_keys(name)
        same_bytes(codes, want_codes, f"{name}: codes")
        same_bytes(scales, want_scales, f"{name}: scales")


# --- 3. capacity and misuse ---------------------------------------------------------------

def test_capacity_and_misuse(backend):
    """Each misuse raises a clear error and leaves kv_cache, ring, lengths and page tables as they were."""
    P, page = 4, 16
    h = Harness(pool=P, spec=1, page=page, num_pages=3, max_requests=2, seed=21)
    c = h.cache
    h.prefill(["A", "B"], [2 * page * P + 3, 5])  # A: 32 pools (2 pages), B: 1 pool (1 page)
    h.decode(["B"], [2])  # B: 7 tokens, last step a verify of 2
    assert c.length("A") == 131 and sum(len(p) for p in h.pages.values()) == 3
    k1, g1 = h.tokens(1)
    k2, g2 = h.tokens(2)
    k3, g3 = h.tokens(3)
    err = h.expect_error

    # capacity
    err(CacheCapacityError, "pages", lambda: c.decode(["A"], [k1], [g1]), "decode needing a 4th page")
    err(CacheCapacityError, "pages", lambda: c.decode(["B", "A"], [k1, k1], [g1, g1]), "decode needing a 4th page")
    kk, gg = h.tokens(page * P)
    err(CacheCapacityError, "pages", lambda: c.prefill(["B"], [kk], [gg]), "prefill needing a 4th page")
    err(CacheCapacityError, "requests", lambda: c.prefill(["C"], [k1], [g1]), "a third request")
    err(CacheCapacityError, "requests", lambda: c.prefill(["B", "C"], [k1, k1], [g1, g1]), "a third request")
    assert "C" not in c.requests
    # unknown ids
    for fn in (lambda: c.decode(["Z"], [k1], [g1]), lambda: c.decode(["B", "Z"], [k1, k1], [g1, g1]),
               lambda: c.accept(["Z"], [0]), lambda: c.free("Z"), lambda: c.pooled_keys("Z"),
               lambda: c.length("Z")):
        err(KeyError, "unknown", fn, "unknown id")
    # too many tokens in a decode step (max_spec_tokens = 1)
    err(ValueError, "max_spec_tokens", lambda: c.decode(["B"], [k3], [g3]), "3 tokens, list")
    err(ValueError, "max_spec_tokens", lambda: c.decode(["B"], k3[None], g3[None]), "3 tokens, tensor")
    # accept
    err(ValueError, "num_accepted", lambda: c.accept(["B"], [3]), "accept more than the step")
    err(ValueError, "num_accepted", lambda: c.accept(["B"], [-1]), "accept < 0")
    err(ValueError, "num_accepted", lambda: c.accept(["B"], [1, 1]), "accept with 2 counts for 1 id")
    err(ValueError, "decode", lambda: c.accept(["A"], [0]), "accept after a prefill")
    err(ValueError, "decode", lambda: c.accept(["B", "A"], [1, 0]), "accept after a prefill (second id)")
    err(ValueError, "repeat", lambda: c.accept(["B", "B"], [2, 1]), "accept, repeated id")
    for bad in ([1.5], [2.0], [float("nan")], [True], torch.tensor([1.5]), torch.tensor([[1]])):
        err((TypeError, ValueError), "num_accepted", lambda: c.accept(["B"], bad), f"accept {bad!r}")
    # repeated ids in a step
    err(ValueError, "repeat", lambda: c.prefill(["B", "B"], [k1, k1], [g1, g1]), "prefill, repeated id")
    err(ValueError, "repeat", lambda: c.decode(["B", "B"], [k1, k1], [g1, g1]), "decode, repeated id")
    err(ValueError, "repeat", lambda: c.decode(["B", "B"], k1[None].expand(2, 1, D).contiguous(),
                                               g1[None].expand(2, 1, D).contiguous()), "decode, repeated id")
    # wrong dtype / shape / count
    f32 = k1.float()
    err(TypeError, "dtype", lambda: c.prefill(["B"], [f32], [g1]), "fp32 keys")
    err(TypeError, "dtype", lambda: c.decode(["B"], [k1], [g1.float()]), "fp32 gates")
    err(TypeError, "dtype", lambda: c.decode(["B"], f32[None], g1[None]), "fp32 keys, tensor")
    err(ValueError, "shape|128", lambda: c.prefill(["B"], [k1[:, :64]], [g1[:, :64]]), "keys [1, 64]")
    err(ValueError, "shape", lambda: c.prefill(["B"], [k2], [g1]), "gates shorter than keys")
    err(ValueError, "shape|128", lambda: c.decode(["B"], [k1[:, :64]], [g1[:, :64]]), "keys [1, 64]")
    err(ValueError, "shape|128|next_n", lambda: c.decode(["B"], k1[None, :, :64].contiguous(),
                                                         g1[None, :, :64].contiguous()), "keys [1, 1, 64]")
    err(ValueError, "next_n|shape|128|3-D", lambda: c.decode(["B", "A"], k1[None], g1[None]), "tensor B=1 for 2 ids")
    err(ValueError, "3-D|shape", lambda: c.decode(["B"], k1, g1), "2-D keys in decode")
    err(ValueError, "keys", lambda: c.prefill(["B", "A"], [k1], [g1]), "one chunk for two ids")
    err(TypeError, "list|tensor", lambda: c.prefill(["B"], k1, g1), "packed keys without cu_seqlens")
    k2t = torch.empty(1, D, 2, dtype=torch.bfloat16, device=DEVICE).transpose(1, 2)  # [1, 2, 128], inner stride 2
    k2t.copy_(k2[None])
    err(ValueError, "stride", lambda: c.decode(["B"], k2t, k2t), "decode keys with a non-unit inner stride")
    err(ValueError, "stride", lambda: c.prefill(["B"], k2t[0], k2t[0], cu_seqlens=[0, 2]),
        "packed keys with a non-unit inner stride")
    # bad cu_seqlens
    kp, gp = packed([h.tokens(3), h.tokens(2)])
    for cu in ([0, 3], [0, 3, 4], [1, 3, 5], [0, 4, 3, 5], [0, 3, 6], [0, 6, 5],
               torch.tensor([0, 2, 6], dtype=torch.int32)):
        err(ValueError, "cu_seqlens", lambda: c.prefill(["B", "A"], kp, gp, cu_seqlens=cu), f"cu_seqlens {cu}")
    err(ValueError, "keys must be", lambda: c.prefill(["B", "A"], kp[:, :64].contiguous(), gp[:, :64].contiguous(),
                                                        cu_seqlens=[0, 3, 5]), "packed keys [5, 64]")
    for cu in ([0, 3.5, 5], torch.tensor([0.0, 3.0, 5.0])):  # no truncation of fractional offsets
        err(TypeError, "cu_seqlens", lambda: c.prefill(["B", "A"], kp, gp, cu_seqlens=cu), f"cu_seqlens {cu}")
    # pool_slot: only pools of the request's allocated pages
    n_slots = len(h.pages["A"]) * page
    for bad in (-1, n_slots):
        err(ValueError, "pool", lambda: c.pool_slot("A", bad), f"pool_slot {bad}")
    err(TypeError, "pool", lambda: c.pool_slot("A", 1.0), "pool_slot 1.0")
    # freed ids
    h.free("B")
    for fn in (lambda: c.decode(["B"], [k1], [g1]), lambda: c.accept(["B"], [0]), lambda: c.free("B"),
               lambda: c.pooled_keys("B"), lambda: c.length("B")):
        err(KeyError, "unknown|freed", fn, "freed id")
    # the cache still works: B's block and page go to C; A needs a 3rd page once C is freed
    h.prefill(["C"], [2 * P + 1])
    assert h.pages["C"] == [p for p in range(3) if p not in h.pages["A"]]
    h.prefill(["A"], [1])  # 132 tokens = 33 pools: out of pages (expected by the harness)
    assert c.length("A") == 131
    h.free("C")
    h.prefill(["A"], [1])
    h.decode(["A"], [2])
    h.accept(["A"], [1])
    assert c.length("A") == 133 and len(h.pages["A"]) == 3
    # once per step: a second accept, even a retry of the same count, would uncommit tokens
    for n in (1, 0):
        err(ValueError, "already accepted", lambda: c.accept(["A"], [n]), f"second accept({n})")
    assert c.length("A") == 133


@pytest.mark.parametrize("name, value", [("pool_size", True), ("pool_size", 0), ("page_size", True),
                                         ("num_pages", 2.0), ("max_requests", 0), ("max_spec_tokens", -1),
                                         ("max_spec_tokens", True)])
def test_constructor_arguments(name, value):
    """Sizes must be ints (a bool is not one: ``TypeError``) in range (``ValueError``): the error
    names the argument."""
    kwargs = dict(num_pages=2, page_size=16, pool_size=4, max_requests=1, max_spec_tokens=0,
                  ape=torch.zeros(4, 128), device="cpu")
    kwargs[name] = value
    with pytest.raises(ValueError if type(value) is int else TypeError, match=name):
        KPoolCache(**kwargs)


def test_constructor_device_and_flags():
    """A device kpool does not run on, a non-bool ``round_scale``, or a preshuffled layout with
    pages that are not whole 16-state tiles fails at construction."""
    kwargs = dict(num_pages=2, page_size=16, pool_size=4, max_requests=1, ape=torch.zeros(4, 128))
    with pytest.raises(ValueError, match="preshuffle"):
        KPoolCache(**dict(kwargs, page_size=24), device="cpu", layout="preshuffle")
    with pytest.raises(ValueError, match="device is on meta"):
        KPoolCache(**kwargs, device="meta")
    with pytest.raises(ValueError, match="ape is on meta"):
        KPoolCache(**dict(kwargs, ape=torch.zeros(4, 128, device="meta")), device="cpu")
    with pytest.raises(TypeError, match="round_scale"):
        KPoolCache(**kwargs, device="cpu", round_scale="no")


# --- 4. metadata formulas on a hand-computed example --------------------------------------

def test_metadata_example(backend):
    """A small schedule whose metadata is written out by hand (P=4, PAGE=16, RING=8)."""
    P, page = 4, 16
    h = Harness(pool=P, spec=3, page=page, num_pages=4, max_requests=2, seed=31)
    c = h.cache
    assert c.ring == 8 and tuple(c.tail.shape) == (2, 2, 8, D)
    # first allocations: ring block 0, 1 and pages 0, 1, ... in order of the step's requests
    meta = h.prefill(["x", "y"], [6, 3])
    bx, by = h.block["x"], h.block["y"]
    assert (c.ring_block("x"), c.ring_block("y")) == (bx, by)
    px = h.pages["x"][0]
    assert meta.positions.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2]
    assert meta.slot_mapping.tolist() == [-1, -1, -1, px * page + 0, -1, -1, -1, -1, -1]
    assert meta.tail_slot_mapping.tolist() == [bx * 8 + i for i in range(6)] + [by * 8 + i for i in range(3)]
    assert meta.page_table.tolist() == [[px], [-1]]
    assert meta.cu_seqlens.tolist() == [0, 6, 9]
    meta = h.decode(["y", "x"], [3, 2])  # y: positions 3..5 (completes pool 0 at 3); x: 6, 7 (pool 1 at 7)
    py = h.pages["y"][0]
    assert meta.positions.tolist() == [[3, 4, 5], [6, 7, -1]]
    assert meta.slot_mapping.tolist() == [[py * page, -1, -1], [-1, px * page + 1, -1]]
    assert meta.tail_slot_mapping.tolist() == [[by * 8 + 3, by * 8 + 4, by * 8 + 5], [bx * 8 + 6, bx * 8 + 7, -1]]
    assert meta.page_table.tolist() == [[py], [px]]
    h.accept(["x"], [1])  # x back to 7 tokens
    meta = h.decode(["x"], [4])  # positions 7..10 wrap the ring (RING = 8)
    assert meta.positions.tolist() == [[7, 8, 9, 10]]
    assert meta.slot_mapping.tolist() == [[px * page + 1, -1, -1, -1]]
    assert meta.tail_slot_mapping.tolist() == [[bx * 8 + 7, bx * 8 + 0, bx * 8 + 1, bx * 8 + 2]]
    # x crosses a page: pool 15 (position 63) ends its first page, pool 16 (position 67) starts the second
    meta = h.prefill(["x"], [69 - 11])  # positions 11..68
    assert len(h.pages["x"]) == 2
    px2 = h.pages["x"][1]
    slots = meta.slot_mapping.tolist()
    assert slots[63 - 11] == px * page + 15 and slots[67 - 11] == px2 * page + 0
    assert [q for q, s in enumerate(slots, 11) if s >= 0] == [11 + 4 * i for i in range(15)]
    assert meta.cu_seqlens.tolist() == [0, 58] and meta.page_table.tolist() == [[px, px2]]
    assert c.pool_slot("x", 16) == px2 * page and c.pool_slot("x", 15) == px * page + 15


def test_decode_slot_mappings_formula():
    """``kpool.planning.decode_slot_mappings`` against the addressing rules, element by element:
    padding, ring wrap, pools on every page column, pages missing (-1) or past the table."""
    from kpool.planning import decode_slot_mappings
    rng = random.Random(7)
    for P, page, ring in ((4, 16, 8), (4, 64, 4), (16, 32, 32), (3, 5, 6)):
        B, n, width = 9, min(4, ring - P + 1), 3  # RING >= P + next_n - 1
        table = [[rng.choice([-1] + list(range(40))) for _ in range(width)] for _ in range(B)]
        blocks = [rng.randrange(50) for _ in range(B)]
        pos = [[rng.choice([-1, -7] + list(range(width * page * P + 2 * P))) for _ in range(n)] for _ in range(B)]
        slots, tslots = decode_slot_mappings(torch.tensor(pos, dtype=torch.int32), torch.tensor(blocks),
                                             torch.tensor(table, dtype=torch.int32), P, page, ring)
        assert slots.dtype == tslots.dtype == torch.int64
        for b in range(B):
            for j, q in enumerate(pos[b]):
                col = q // P // page if q >= 0 else 0
                pg = table[b][col] if q >= 0 and col < width else -1
                want = pg * page + q // P % page if q >= 0 and (q + 1) % P == 0 and pg >= 0 else -1
                assert int(slots[b, j]) == want, (P, page, b, j, q)
                assert int(tslots[b, j]) == (blocks[b] * ring + q % ring if q >= 0 else -1), (P, b, j, q)


def test_decode_slot_mappings_rejects_bad_input():
    """Shapes, devices, non-integer tensors, sizes, and (host tensors) a live row's negative ring block."""
    from kpool.planning import decode_slot_mappings

    def z(*shape, **kw):
        return torch.zeros(*shape, dtype=torch.int64, **kw)
    with pytest.raises(ValueError, match="ring_blocks"):
        decode_slot_mappings(z(2, 3), z(3), z(2, 1), 4, 16, 8)
    with pytest.raises(ValueError, match="max_pages >= 1"):
        decode_slot_mappings(z(2, 3), z(2), z(2, 0), 4, 16, 8)
    with pytest.raises(ValueError, match="page_table is on meta"):
        decode_slot_mappings(z(2, 3), z(2), z(2, 1, device="meta"), 4, 16, 8)
    for args, name in (((torch.zeros(2, 3), z(2), z(2, 1)), "positions"), ((z(2, 3), z(2).float(), z(2, 1)),
                                                                           "ring_blocks"),
                       ((z(2, 3), z(2), z(2, 1).double()), "page_table")):
        with pytest.raises(TypeError, match=name):
            decode_slot_mappings(*args, 4, 16, 8)
    for sizes, name in (((0, 16, 8), "pool_size"), ((4, 0, 8), "page_size"), ((4, 16, 0), "ring"),
                        ((4, 16, 6), "multiple of pool_size")):
        with pytest.raises(ValueError, match=name):
            decode_slot_mappings(z(2, 3), z(2), z(2, 1), *sizes)
    with pytest.raises(ValueError, match=r"ring RING = 4 is too small for steps of next_n = 2"):
        decode_slot_mappings(z(2, 2), z(2), z(2, 1), 4, 16, 4)  # a draft would overwrite what a redo reads
    pos = torch.tensor([[5, 6], [-1, -1]])
    with pytest.raises(ValueError, match="ring_blocks has a negative block"):
        decode_slot_mappings(pos, torch.tensor([-1, 0]), z(2, 1), 4, 16, 8)
    _, tslots = decode_slot_mappings(pos, torch.tensor([0, -1]), z(2, 1), 4, 16, 8)  # a padding row's block: unused
    assert tslots.tolist() == [[5, 6], [-1, -1]]
    # ids whose slots would overflow int64 (and wrap to a small slot of another request)
    with pytest.raises(ValueError, match="ring_blocks holds 2305843009213693952"):
        decode_slot_mappings(pos, torch.tensor([2**61, 0]), z(2, 1), 4, 16, 8)
    with pytest.raises(ValueError, match="page_table holds 1152921504606846976"):
        decode_slot_mappings(pos, torch.tensor([0, 1]), torch.tensor([[2**60], [0]]), 4, 16, 8)
    top = (2**63 - 8) // 8  # the largest block whose 8 ring slots fit
    _, tslots = decode_slot_mappings(pos, torch.tensor([top, 0]), z(2, 1), 4, 16, 8)
    assert tslots[0].tolist() == [top * 8 + 5, top * 8 + 6]


def test_prefill_plan_rejects_overflowing_ids():
    """``prefill_plan``: a ring block or page whose slots overflow int64 raises naming it (the
    slots would wrap to a small slot: another request's), and so does a ``cu_seqlens`` entry
    outside int64."""
    from kpool.planning import prefill_plan
    table = torch.tensor([[1, 4], [3, -1]])
    with pytest.raises(ValueError, match="page_table holds 1152921504606846976"):
        prefill_plan([0, 11, 17], [0, 6], [2, 0], torch.tensor([[2**60, 4], [3, -1]]), 4, 16, 8)
    with pytest.raises(ValueError, match="ring_blocks holds 2305843009213693952"):
        prefill_plan([0, 11, 17], [0, 6], [2**61, 0], table, 4, 16, 8)
    with pytest.raises(ValueError, match="cu_seqlens: an integer outside int64"):
        prefill_plan([0, 11, 2**64], [0, 6], [2, 0], table, 4, 16, 8)
    assert prefill_plan([0, 11, 17], [0, 6], [2, 0], table, 4, 16, 8).pool_locs.tolist() == [16, 17, 49, 50]


def test_unhashable_request_ids_are_named():
    """An unhashable request id (a list) raises a TypeError naming ``request_ids`` in every step."""
    ape = torch.zeros(4, D, device=DEVICE)
    c = KPoolCache(4, page_size=16, pool_size=4, max_requests=3, ape=ape, device=DEVICE)
    k, g = Tokens(61)(3)
    c.prefill(["a"], [k], [g])
    q = torch.zeros(1, 16, D, dtype=torch.bfloat16, device=DEVICE)
    w = torch.zeros(1, 16, device=DEVICE)
    for call in (lambda: c.prefill([["c"]], [k], [g]), lambda: c.decode([["a"]], [k[:1]], [g[:1]]),
                 lambda: c.accept([["a"]], [1]), lambda: c.topk_indices([["a"]], q, w, index_topk=4)):
        with pytest.raises(TypeError, match="request_ids must hold hashable ids"):
            call()
    assert list(c._requests) == ["a"] and c.length("a") == 3


def test_failed_write_gives_back_what_the_step_reserved(backend):
    """A step whose write fails (a launch error) gives back what it reserved: a prefill's new
    request is forgotten with its ring block and pages, a decode's new page is free again (the
    free lists as a cache's that never tried), and the next steps allocate and write exactly as
    that cache's."""
    P = 4
    ape = (torch.randn(P, D, generator=torch.Generator().manual_seed(7)) * 0.5).to(DEVICE)

    def cache():
        return KPoolCache(8, page_size=4, pool_size=P, max_requests=3, max_spec_tokens=1, ape=ape, device=DEVICE)
    c, twin, toks, toks1 = cache(), cache(), Tokens(60), Tokens(60)
    for cc, tt in ((c, toks), (twin, toks1)):
        k, g = tt(19)  # 4 pools: one page of 4 pools
        cc.prefill(["a"], [k], [g])

    def failing(*args):
        raise RuntimeError("launch failed")
    c._write_step = failing
    k, g = toks(70)
    with pytest.raises(RuntimeError, match="launch failed"):
        c.prefill(["b"], [k], [g])
    assert list(c._requests) == ["a"] and c.length("a") == 19
    assert c._free_pages == twin._free_pages and c._free_blocks == twin._free_blocks
    k2, g2 = toks(2)
    with pytest.raises(RuntimeError, match="launch failed"):
        c.decode(["a"], k2.view(1, 2, D), g2.view(1, 2, D))  # 21 tokens: 5 pools, a second page
    w = twin._block_pages.shape[1]  # c's rows may have been widened: the rest is -1
    assert c._free_pages == twin._free_pages and torch.equal(c._block_pages[:, :w], twin._block_pages)
    assert bool((c._block_pages[:, w:] == -1).all())
    assert c.page_table(["a"]).tolist() == twin.page_table(["a"]).tolist()
    del c._write_step
    for cc, tt in ((c, toks), (twin, toks1)):
        if cc is twin:
            tt(70), tt(2)  # the twin's generator in step with c's
        k, g = tt(70)
        cc.prefill(["b"], [k], [g])
        k, g = tt(2)
        cc.decode(["a"], k.view(1, 2, D), g.view(1, 2, D))
    assert c.ring_block("b") == twin.ring_block("b")
    assert c.page_table(["a", "b"]).tolist() == twin.page_table(["a", "b"]).tolist()
    same_bytes(c.kv_cache, twin.kv_cache, "kv_cache after the failed steps")
    same_bytes(c.tail, twin.tail, "tail after the failed steps")


def test_mappings_computed_once_write_another_layer(backend):
    """An engine's flow: one cache plans the step, a second layer's buffers are written by the raw
    decode op with ``decode_slot_mappings`` of the cache's page table, ring blocks and positions;
    both layers end byte-identical (same keys / gates / ape), random bytes everywhere else."""
    from kpool import kpool_decode_update_and_maybe_write_cache_batched
    from kpool.planning import decode_slot_mappings
    P, page = 4, 16
    h = Harness(pool=P, spec=3, page=page, num_pages=12, max_requests=3, seed=51)
    c, rids, toks = h.cache, ["a", "b", "c"], Tokens(52)
    h.prefill(rids, [37, 6, 64])
    kv2, tail2 = c.kv_cache.clone(), c.tail.clone()  # layer 2 after the same prefill, random bytes elsewhere
    for step in range(6):
        counts = [1 + (step + i) % 4 for i in range(3)]
        width = max(counts)
        keys = torch.zeros(3, width, D, dtype=torch.bfloat16, device=DEVICE)
        gates = torch.zeros_like(keys)
        for i, n in enumerate(counts):
            k, g = toks(n)
            keys[i, :n], gates[i, :n] = k, g
        meta = c.decode(rids, keys, gates)
        blocks = torch.tensor([c.ring_block(r) for r in rids], device=DEVICE)
        slots, tslots = decode_slot_mappings(meta.positions, blocks, meta.page_table, P, page, c.ring)
        assert torch.equal(slots, meta.slot_mapping) and torch.equal(tslots, meta.tail_slot_mapping)
        kpool_decode_update_and_maybe_write_cache_batched(kv2, tail2, tslots, keys, gates, c.ape, slots,
                                                          meta.positions, P, layout=c.layout, fp8_dtype=c.fp8_dtype)
        same_bytes(kv2, c.kv_cache, f"step {step}: layer 2 kv_cache")
        same_bytes(tail2, c.tail, f"step {step}: layer 2 tail")
        c.accept(rids, [max(1, n - 1) for n in counts])


def test_prefill_plan_writes_another_layer(backend):
    """The prefill form of the engine flow: ``prefill_plan`` from the cache's per-request state
    (cu_seqlens, positions already written, ring blocks, page table) gives the step's metadata,
    and ``write_prefill`` of those tables on a second layer's buffers leaves them byte-identical
    to the cache's (chunks starting mid-pool, ending on and off pool boundaries, empty ones)."""
    from kpool import prefill_plan, write_prefill
    P, page = 4, 16
    h = Harness(pool=P, spec=1, page=page, num_pages=16, max_requests=3, seed=61)
    c, rids, toks = h.cache, ["a", "b", "c"], Tokens(62)
    kv2, tail2 = c.kv_cache.clone(), c.tail.clone()
    for lengths in ([5, 8, 0], [7, 1, 66], [0, 3, 2], [4, 70, 9]):
        starts = [c.length(r) if r in c.requests else 0 for r in rids]
        chunks = [toks(n) for n in lengths]
        meta = h.prefill(rids, lengths, chunks=chunks)
        cu = meta.cu_seqlens.tolist()
        plan = prefill_plan(cu, starts, [c.ring_block(r) for r in rids], meta.page_table.cpu(), P, page, c.ring)
        for name in ("positions", "slot_mapping", "tail_slot_mapping", "pool_meta", "pool_locs"):
            assert torch.equal(getattr(plan, name).to(getattr(meta, name).dtype), getattr(meta, name).cpu()), name
        keys = torch.cat([k for k, _ in chunks]) if sum(lengths) else torch.zeros(0, D, dtype=torch.bfloat16)
        gates = torch.cat([g for _, g in chunks]) if sum(lengths) else torch.zeros(0, D, dtype=torch.bfloat16)
        write_prefill(kv2, tail2, keys.to(DEVICE), gates.to(DEVICE), c.ape, plan.pools.to(DEVICE),
                      plan.requests.to(DEVICE), P, layout=c.layout, fp8_dtype=c.fp8_dtype)
        same_bytes(kv2, c.kv_cache, f"{lengths}: layer 2 kv_cache")
        same_bytes(tail2, c.tail, f"{lengths}: layer 2 tail")


def test_readme_engine_example():
    """The README's engine example, run as it stands: each layer's whole ``kv_cache`` is the
    oracle's entries at the slots the engine's page table gives and zeros elsewhere, and its
    whole ring holds exactly the tokens the writers put there (the prefill's kept tail and the
    verify step's tokens, at ``pos % RING`` of the request's block)."""
    from pathlib import Path
    from kpool.layout import resolve_fp8_dtype, resolve_layout
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    code = text.split("<!-- engine-example:start -->")[1].split("<!-- engine-example:end -->")[0]
    code = code.split("```python")[1].split("```")[0]
    ns: dict = {}
    exec(compile(code, "README.md (engine example)", "exec"), ns)  # noqa: S102
    P, PAGE, RING, dev = ns["P"], ns["PAGE"], ns["RING"], ns["dev"]
    layout, fp8 = resolve_layout(None, torch.device(dev), PAGE), resolve_fp8_dtype(None, torch.device(dev))
    for layer in range(ns["LAYERS"]):
        pk, pg = (t.cpu() for t in ns["prefill_kg"][layer])
        vk, vg = (t.cpu() for t in ns["verify_kg"][layer])
        kv_want = torch.zeros_like(ns["kv"][layer], device="cpu").view(-1)
        tail_want = torch.zeros_like(ns["tail"][layer], device="cpu")
        for r, (row0, row1), block, pages in ((0, (0, 300), 2, [7, 3]), (1, (300, 370), 0, [5])):
            keys, gates = torch.cat((pk[row0:row1], vk[r])), torch.cat((pg[row0:row1], vg[r]))
            n = keys.shape[0] // P
            codes, scales = numerics.compress_pools(keys[:n * P].view(n, P, D), gates[:n * P].view(n, P, D),
                                                    ns["ape"][layer].cpu(), fp8)
            offsets = _entry_offsets([_pool_slot(pages, m, PAGE) for m in range(n)], PAGE, layout)
            kv_want[offsets[:, :D]] = codes
            kv_want[offsets[:, D:]] = scales.view(torch.uint8).reshape(n, 4)
            prompt = row1 - row0
            kept = min(prompt, prompt % P)  # the prefill seeds its incomplete pool's tokens
            for pos in list(range(prompt - kept, prompt)) + list(range(prompt, keys.shape[0])):
                tail_want[block, 0, pos % RING], tail_want[block, 1, pos % RING] = keys[pos], gates[pos]
        same_bytes(ns["kv"][layer].cpu(), kv_want.view(ns["kv"][layer].shape), f"layer {layer}: kv_cache")
        same_bytes(ns["tail"][layer].cpu(), tail_want, f"layer {layer}: tail")


def test_write_layer_matches_a_cache_of_its_own(backend):
    """One cache plans every step; a second layer's buffers are written by ``write_layer`` (its own
    keys, gates and ape) and selected with ``topk_indices(kv_cache=...)``: the same bytes and rows
    as a second ``KPoolCache`` fed that layer's tokens on the same schedule (prefill lists and
    packed, mid-pool chunks, verify steps as tensors and lists, accept, free and a new id)."""
    g = torch.Generator().manual_seed(71)
    apes = [(torch.randn(4, D, generator=g) * 0.5).to(DEVICE) for _ in range(2)]
    caches = [KPoolCache(24, page_size=16, pool_size=4, max_requests=3, max_spec_tokens=2, ape=a, device=DEVICE)
              for a in apes]
    planner, twin = caches
    kv1, tail1 = planner.layer_buffers()
    kv1.copy_(random_bytes_like(planner.kv_cache.shape, DEVICE, 72))
    tail1.view(torch.uint8).copy_(random_bytes_like(tail1.view(torch.uint8).shape, DEVICE, 73))
    planner.kv_cache.copy_(random_bytes_like(planner.kv_cache.shape, DEVICE, 74))
    twin.kv_cache.copy_(kv1)
    twin.tail.copy_(tail1)
    toks = [Tokens(75), Tokens(76)]  # layer 0's and layer 1's tokens
    with pytest.raises(ValueError, match="there has been none"):
        planner.write_layer(kv1, tail1, *toks[0](1), apes[1])

    def step(kind, rids, counts, form):
        data = [[tk(n) for n in counts] for tk in toks]
        for layer, cache in enumerate(caches):
            keys, gates = [k for k, _ in data[layer]], [g for _, g in data[layer]]
            if form == "tensor":
                keys, gates = torch.stack(keys), torch.stack(gates)
            elif form == "packed":
                keys, gates = torch.cat(keys), torch.cat(gates)
            kw = {"cu_seqlens": [0] + [sum(counts[:i + 1]) for i in range(len(counts))]} if form == "packed" else {}
            getattr(cache, kind)(rids, keys, gates, **kw)
            if layer == 1:
                planner.write_layer(kv1, tail1, keys, gates, apes[1])
        same_bytes(kv1, twin.kv_cache, f"{kind} {rids} {counts}: kv_cache")
        same_bytes(tail1, twin.tail, f"{kind} {rids} {counts}: tail")

    def select(rids, rows):
        q = torch.randn(rows, 16, D, generator=g).to(torch.bfloat16).to(DEVICE)
        w = torch.randn(rows, 16, generator=g).to(DEVICE)
        want = twin.topk_indices(rids, q, w, index_topk=16)
        assert torch.equal(planner.topk_indices(rids, q, w, index_topk=16, kv_cache=kv1), want)

    step("prefill", ["a", "b"], [37, 6], "list")
    step("prefill", ["b", "c"], [45, 70], "packed")
    select(["b", "c"], 115)
    step("decode", ["a", "b", "c"], [3, 3, 3], "tensor")
    select(["a", "b", "c"], 9)
    for c in caches:
        c.accept(["a", "b", "c"], [1, 3, 2])
    step("decode", ["c", "a"], [2, 3], "list")
    for c in caches:
        c.free("b")
    step("prefill", ["d", "a"], [9, 2], "list")
    select(["d", "a"], 11)
    # misuse: each raises before writing anything
    kv_before, tail_before = kv1.clone(), tail1.clone()
    with pytest.raises(ValueError, match="already written"):
        planner.write_layer(kv1, tail1, *toks[1](11), apes[1])
    with pytest.raises(ValueError, match="pair from this cache's layer_buffers"):
        planner.write_layer(kv1.clone(), tail1, *toks[1](11), apes[1])
    with pytest.raises(ValueError, match="pair from this cache's layer_buffers"):
        planner.write_layer(kv1, tail1.clone(), *toks[1](11), apes[1])
    with pytest.raises(ValueError, match="requests are live"):
        planner.layer_buffers()
    for _ in range(2):  # two steps the layer does not get
        k, g = toks[0](1)
        planner.decode(["d"], k.view(1, 1, D), g.view(1, 1, D))
    k, g = toks[1](1)
    with pytest.raises(ValueError, match=r"missed steps 6\.\.6"):
        planner.write_layer(kv1, tail1, k.view(1, 1, D), g.view(1, 1, D), apes[1])
    same_bytes(kv1, kv_before, "rejected writes: kv_cache")
    same_bytes(tail1, tail_before, "rejected writes: tail")
    small = KPoolCache(4, page_size=16, pool_size=4, max_requests=1, max_spec_tokens=1, ape=apes[0], device=DEVICE)
    kv, tail = small.layer_buffers()
    kv_shrunk, tail_b = small.layer_buffers()
    k, g = toks[0](5)
    small.prefill(["z"], [k], [g])
    with pytest.raises(ValueError, match="keys must have shape"):
        small.write_layer(kv, tail, *toks[1](3), apes[1])
    # the writes launch without the public ops' checks: a layer pair or the cache's own buffers
    # changed in place or replaced, a strided ape raise before anything is written
    kv_shrunk.resize_(1, 16, 132)
    with pytest.raises(ValueError, match=r"kv_cache \(torch.uint8 \[1, 16, 132\].*not the buffer it was when "
                                         r"layer_buffers\(\) gave it"):
        small.write_layer(kv_shrunk, tail_b, *([t] for t in toks[1](5)), apes[1])
    kv_shrunk.resize_(kv.shape)  # back in its own storage: the same buffer again
    tail_b.data = tail_b.data.to(torch.float16)  # same object, shape and strides
    with pytest.raises(ValueError, match=r"tail \(torch.float16"):
        small.write_layer(kv_shrunk, tail_b, *([t] for t in toks[1](5)), apes[1])
    with pytest.raises(ValueError, match="ape must have a unit inner stride"):
        small.write_layer(kv, tail, *([t] for t in toks[1](5)), apes[1].repeat(1, 2)[:, ::2])
    own = {name: getattr(small, name) for name in ("kv_cache", "tail", "ape")}
    tail_view = small.tail.view_as(small.tail)  # its memory, to point the tail back at
    kv_before, tail_before = small.kv_cache.clone(), small.tail.clone()
    for name, change in (("tail", lambda: small.tail.set_(torch.zeros(1, 2, small.ring, 64, dtype=torch.bfloat16,
                                                                       device=DEVICE))),
                         ("kv_cache", lambda: setattr(small, "kv_cache", small.kv_cache.clone())),
                         ("ape", lambda: setattr(small, "ape", own["ape"].t().contiguous().t()))):
        change()
        for step in (lambda: small.prefill(["z"], *([t] for t in toks[0](3))),
                     lambda: small.decode(["z"], *([t] for t in toks[0](1)))):
            with pytest.raises(ValueError, match=rf"^{name} \(.*not the buffer it was when the cache allocated it"):
                step()
        if name == "tail":
            small.tail.set_(tail_view)
        else:
            setattr(small, name, own[name])
    assert small.length("z") == 5
    same_bytes(small.kv_cache, kv_before, "steps refused for changed buffers: kv_cache")
    same_bytes(small.tail, tail_before, "steps refused for changed buffers: tail")
    with pytest.raises(ValueError, match=r"hold \[4\] tokens per request; the step wrote \[5\]"):
        small.write_layer(kv, tail, *([t] for t in toks[1](4)), apes[1])
    small.write_layer(kv, tail, *([t] for t in toks[1](5)), apes[1])
    k, g = toks[0](2)
    small.decode(["z"], [k], [g])
    with pytest.raises(ValueError, match=r"hold \[1\] tokens per request; the step wrote \[2\]"):
        small.write_layer(kv, tail, *([t] for t in toks[1](1)), apes[1])



def test_topk_indices_reads_only_unchanged_buffers(backend):
    """``topk_indices`` scores through the unchecked launcher (``launch_paged_pool_topk``): the
    cache's own kv_cache, or a layer's, replaced or changed in place since it was allocated
    raises before anything is launched; put back, it is read again."""
    g = torch.Generator().manual_seed(91)
    ape = (torch.randn(4, D, generator=g) * 0.5).to(DEVICE)
    c = KPoolCache(8, page_size=16, pool_size=4, max_requests=1, max_spec_tokens=1, ape=ape, device=DEVICE)
    kv1, tail1 = c.layer_buffers()
    k, gt = Tokens(92)(40)
    c.prefill(["z"], [k], [gt])
    c.write_layer(kv1, tail1, [k], [gt], ape)
    q = torch.randn(40, 16, D, generator=g).to(torch.bfloat16).to(DEVICE)
    w = torch.randn(40, 16, generator=g).to(DEVICE)
    want = c.topk_indices(["z"], q, w, index_topk=8)  # select_k = 2: the rows from position 11 on are scored
    assert torch.equal(c.topk_indices(["z"], q, w, index_topk=8, kv_cache=kv1), want)  # the same keys
    own = c.kv_cache
    for kv, change, undo, since in (
            (None, lambda: setattr(c, "kv_cache", own.clone()), lambda: setattr(c, "kv_cache", own),
             "the cache allocated it"),
            (kv1, lambda: kv1.resize_(1, 16, 132), lambda: kv1.resize_(own.shape), r"layer_buffers\(\) gave it")):
        change()
        with pytest.raises(ValueError, match=rf"^kv_cache \(.*not the buffer it was when {since}"):
            c.topk_indices(["z"], q, w, index_topk=8, kv_cache=kv)
        undo()
        assert torch.equal(c.topk_indices(["z"], q, w, index_topk=8, kv_cache=kv), want)


def test_configuration_is_read_only():
    """The sizes and formats a cache was built with cannot be re-bound: its steps launch their
    kernels with them unchecked (a P above the ape's rows would read past it)."""
    c = KPoolCache(4, page_size=16, pool_size=4, max_requests=2, max_spec_tokens=1, ape=torch.zeros(4, D),
                   device=DEVICE)
    fixed = {"device": c.device, "pool_size": 4, "page_size": 16, "max_spec_tokens": 1, "ring": 8,
             "layout": c.layout, "fp8_dtype": c.fp8_dtype, "round_scale": True}
    for name, value in fixed.items():
        assert getattr(c, name) == value, name
        with pytest.raises(AttributeError, match=name):
            setattr(c, name, value)


def test_layer_guards_and_failed_steps(backend):
    """A step whose write raises leaves the cache as it was (lengths, metadata, step count: the
    next step and every layer's write_layer go on); ``topk_indices(kv_cache=)`` takes only this
    cache's buffers or a layer that has every step; the metadata tensors are the caller's to change
    (write_layer replays the cache's own tables); buffers the caller drops are freed."""
    import gc
    import weakref
    g = torch.Generator().manual_seed(81)
    ape = (torch.randn(4, D, generator=g) * 0.5).to(DEVICE)
    planner, twin = (KPoolCache(8, page_size=16, pool_size=4, max_requests=2, max_spec_tokens=1, ape=ape,
                                device=DEVICE) for _ in range(2))
    kv1, tail1 = planner.layer_buffers()
    dropped = weakref.ref(planner.layer_buffers()[0])
    gc.collect()
    assert dropped() is None, "layer buffers the caller dropped are still alive"
    toks, toks1 = Tokens(82), Tokens(83)
    k, gt = toks(9)
    k1, g1 = toks1(9)
    planner.prefill(["a"], [k], [gt])
    twin.prefill(["a"], [k1], [g1])
    q = torch.randn(9, 16, D, generator=g).to(torch.bfloat16).to(DEVICE)
    w = torch.randn(9, 16, generator=g).to(DEVICE)
    with pytest.raises(ValueError, match="has received 0 of the cache's 1 steps"):
        planner.topk_indices(["a"], q, w, index_topk=4, kv_cache=kv1)
    with pytest.raises(ValueError, match="this cache's or one from its layer_buffers"):
        planner.topk_indices(["a"], q, w, index_topk=4, kv_cache=kv1.clone())
    planner.write_layer(kv1, tail1, [k1], [g1], ape)
    meta0, len0 = planner.metadata(), planner.length("a")
    with pytest.raises(ValueError, match="allows 2"):  # an empty batch of 3-token steps: nothing planned
        planner.decode([], torch.zeros(0, 3, D, dtype=torch.bfloat16, device=DEVICE),
                       torch.zeros(0, 3, D, dtype=torch.bfloat16, device=DEVICE))
    k3, g3 = toks(3)
    with pytest.raises(ValueError, match="request 'a' sends 3 tokens in one step; max_spec_tokens = 1 allows 2"):
        planner.decode(["a"], [k3], [g3])
    real_write = planner._write_step

    def failing(*args):
        raise RuntimeError("launch failed")
    planner._write_step = failing
    k, gt = toks(2)
    with pytest.raises(RuntimeError, match="launch failed"):
        planner.decode(["a"], k.view(1, 2, D), gt.view(1, 2, D))
    planner._write_step = real_write
    assert planner.metadata() is meta0 and planner.length("a") == len0
    planner.decode(["a"], k.view(1, 2, D), gt.view(1, 2, D))
    k1, g1 = toks1(2)
    twin.decode(["a"], k1.view(1, 2, D), g1.view(1, 2, D))
    meta = planner.metadata()
    for t in (meta.tail_slot_mapping, meta.slot_mapping, meta.positions):
        t.fill_(0)  # the caller's copies
    planner.write_layer(kv1, tail1, k1.view(1, 2, D), g1.view(1, 2, D), ape)
    same_bytes(kv1, twin.kv_cache, "layer after an edited metadata(): kv_cache")
    same_bytes(tail1, twin.tail, "layer after an edited metadata(): tail")
    q, w = q[:2], w[:2]
    assert torch.equal(planner.topk_indices(["a"], q, w, index_topk=4, kv_cache=kv1),
                       twin.topk_indices(["a"], q, w, index_topk=4))


# --- 5. packed input form ----------------------------------------------------------------

def test_packed_matches_list(backend):
    """``cu_seqlens=`` packed input (dense, padded row strides, different strides for keys and
    gates, tensor or list offsets) writes the same bytes as the list form."""
    P = 4
    steps = [(["a", "b", "c"], [5, 0, 9]), (["c", "a"], [2, 7]), (["b", "a", "c"], [3, 1, 4])]
    variants = [dict(row_pad=0), dict(row_pad=8), dict(row_pad=8, gate_pad=24), dict(row_pad=0, cu="list")]
    harnesses = [Harness(pool=P, spec=1, page=16, num_pages=4, max_requests=3, seed=41)
                 for _ in range(1 + len(variants))]
    toks = Tokens(42)
    for rids, lengths in steps:
        chunks = [toks(n) for n in lengths]
        harnesses[0].prefill(rids, lengths, chunks=chunks)
        for h, v in zip(harnesses[1:], variants):
            keys, gates = packed(chunks, v["row_pad"], v.get("gate_pad"))
            assert v["row_pad"] == 0 or keys.stride(0) == D + v["row_pad"]
            cu = [0]
            for n in lengths:
                cu.append(cu[-1] + n)
            cu = cu if v.get("cu") == "list" else torch.tensor(cu, dtype=torch.int32, device=DEVICE)
            meta = h.cache.prefill(rids, keys, gates, cu_seqlens=cu)
            ref = harnesses[0]
            same_bytes(h.cache.kv_cache, ref.cache.kv_cache, f"{v}: kv_cache")
            same_bytes(h.cache.tail, ref.cache.tail, f"{v}: tail")
            rmeta = ref.cache.metadata()
            for name in ("positions", "slot_mapping", "tail_slot_mapping", "page_table", "cu_seqlens", "pool_locs"):
                assert torch.equal(getattr(meta, name), getattr(rmeta, name)), f"{v}: metadata {name}"
    harnesses[0].check_state("list form")


def test_decode_tensor_views(backend):
    """Decode keys / gates given as ``[B, next_n, 128]`` views with padded strides (different for
    keys and gates) write the same bytes as the list form."""
    hs = [Harness(pool=4, spec=3, page=16, num_pages=2, max_requests=2, seed=61) for _ in range(2)]
    toks = Tokens(62)
    first = [toks(5), toks(2)]
    for h in hs:
        h.prefill(["a", "b"], [5, 2], chunks=first)
    for step, (n, acc) in enumerate([(3, [1, 3]), (4, [4, 0]), (2, [2, 2])]):
        chunks = [toks(n), toks(n)]
        hs[0].decode(["b", "a"], [n, n], chunks=chunks)
        kbuf = torch.zeros(2, n + 1, D + 64, dtype=torch.bfloat16, device=DEVICE)
        gbuf = torch.zeros(2, n, D + 32, dtype=torch.bfloat16, device=DEVICE)
        for i, (k, g) in enumerate(chunks):
            kbuf[i, :n, :D] = k
            gbuf[i, :, :D] = g
        keys, gates = kbuf[:, :n, :D], gbuf[:, :, :D]
        assert not keys.is_contiguous() and keys.stride() != gates.stride()
        hs[1].cache.decode(["b", "a"], keys, gates)
        same_bytes(hs[1].cache.kv_cache, hs[0].cache.kv_cache, f"step {step}: kv_cache")
        same_bytes(hs[1].cache.tail, hs[0].cache.tail, f"step {step}: tail")
        hs[0].accept(["b", "a"], acc)
        hs[1].cache.accept(["b", "a"], acc)


@pytest.mark.parametrize("pool", [3, 4, 5, 16])
def test_backends_write_identical_bytes(monkeypatch, pool):
    """The same schedule (with rejected drafts that write pools) on the torch and Triton backends
    leaves the WHOLE kv_cache and ring byte-identical after every step, rolled-back bytes included;
    pool sizes that are not powers of two (3, 5) too."""
    P = pool
    hs = {be: Harness(pool=P, spec=3, page=16, layout="preshuffle", fp8=torch.float8_e4m3fnuz, num_pages=3,
                      max_requests=3, seed=71) for be in ("torch", "triton")}
    schedule = [("prefill", ["a", "b"], [P + 1, 2 * P - 2]), ("decode", ["a", "b"], [2, 4]),
                ("accept", ["a", "b"], [2, 1]), ("decode", ["b", "a"], [3, 4]), ("accept", ["b"], [3]),
                ("prefill", ["c", "a"], [P - 1, 3]), ("decode", ["c", "b"], [1, 4]), ("free", "b", None),
                ("prefill", ["d", "c"], [2 * P + 1, P + 1]), ("decode", ["d", "a"], [3, 0])]
    for i, (op, rids, arg) in enumerate(schedule):
        for be, h in hs.items():
            monkeypatch.setenv("KPOOL_BACKEND", be)
            if op == "free":
                h.free(rids)
            else:
                getattr(h, op)(rids, arg)
        same_bytes(hs["triton"].cache.kv_cache, hs["torch"].cache.kv_cache, f"step {i} {op}: kv_cache")
        same_bytes(hs["triton"].cache.tail, hs["torch"].cache.tail, f"step {i} {op}: tail")
