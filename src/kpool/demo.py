"""``kpool demo``: a serving session at GLM-5.3-Flash indexer geometry, checked against the oracle.

Several requests of different lengths go through ``KPoolCache``: chunked prefill (chunk
boundaries anywhere, also mid-pool), then decode and speculative-verify steps with random
acceptance (rejected drafts carry different tokens than the ones later accepted). After
every step each live request's pooled entries are compared byte for byte with the torch
oracle of its committed tokens, and its ring with the tokens of its incomplete pool.

A second layer's buffers follow the engine path: the same tokens written from each step's
plan (``planning.prefill_plan`` + ``write_prefill``, ``planning.decode_slot_mappings`` + the decode
op) must stay byte-identical to the cache's, as every layer of a model shares one plan.
"""

from __future__ import annotations

import contextlib
import random
import statistics
import sys
import time

import torch
from torch.nn.utils.rnn import pad_sequence

from . import numerics, reference
from ._backend import backend_for
from .cache import KPoolCache
from .layout import ENTRY_BYTES, HEAD_DIM, cdiv
from .ops.decode import kpool_decode_update_and_maybe_write_cache_batched
from .ops.prefill import write_prefill
from .planning import decode_slot_mappings, prefill_plan


class EngineLayer:
    """A second layer's ``kv_cache`` / ring written from the steps' plans, as an engine with its
    own scheduler would (the plan inputs taken from the cache's ``StepMetadata``)."""

    def __init__(self, cache: KPoolCache):
        self.cache = cache
        self.kv_cache, self.tail = cache.kv_cache.clone(), cache.tail.clone()

    def _write_args(self):
        c = self.cache
        return dict(layout=c.layout, fp8_dtype=c.fp8_dtype, round_scale=c.round_scale)

    def prefill(self, ids, starts, keys, gates) -> None:
        c, meta = self.cache, self.cache.metadata()
        plan = prefill_plan(meta.cu_seqlens.cpu(), starts, [c.ring_block(r) for r in ids], meta.page_table.cpu(),
                            c.pool_size, c.page_size, c.ring)
        dev = c.device
        write_prefill(self.kv_cache, self.tail, keys, gates, c.ape, plan.pools.to(dev), plan.requests.to(dev),
                      c.pool_size, **self._write_args())

    def decode(self, ids, keys, gates) -> None:
        c, meta = self.cache, self.cache.metadata()
        blocks = torch.tensor([c.ring_block(r) for r in ids], device=c.device)
        slots, tail_slots = decode_slot_mappings(meta.positions, blocks, meta.page_table, c.pool_size, c.page_size,
                                                 c.ring)
        kpool_decode_update_and_maybe_write_cache_batched(self.kv_cache, self.tail, tail_slots, keys, gates, c.ape,
                                                          slots, meta.positions, c.pool_size, **self._write_args())

    def check(self) -> None:
        if not (torch.equal(self.kv_cache, self.cache.kv_cache) and torch.equal(self.tail, self.cache.tail)):
            raise AssertionError("the engine-path layer differs from the cache's bytes")


class Progress:
    """Minimal progress bar on stderr (no dependency)."""

    def __init__(self, total: int, label: str):
        self.total, self.label, self.done, self.t0 = total, label, 0, time.perf_counter()

    def update(self, n: int = 1, note: str = "") -> None:
        self.done += n
        frac = self.done / max(self.total, 1)
        bar = "#" * int(30 * frac) + "-" * (30 - int(30 * frac))
        elapsed = time.perf_counter() - self.t0
        sys.stderr.write(f"\r{self.label} [{bar}] {self.done}/{self.total} {elapsed:5.1f}s {note}")
        sys.stderr.flush()
        if self.done >= self.total:
            sys.stderr.write("\n")


@contextlib.contextmanager
def _timed(times: list, device: torch.device):
    """Append the block's wall time to ``times``, the device work it queued included."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    yield
    if device.type == "cuda":
        torch.cuda.synchronize()
    times.append(time.perf_counter() - t0)


def _check_request(cache: KPoolCache, rid, keys: torch.Tensor, gates: torch.Tensor, ape: torch.Tensor,
                   oracle: dict) -> int:
    """Compare a request's pooled entries and ring with the oracle; returns the pools checked.

    ``oracle[rid]`` caches the oracle entries of committed pools (committed pools never change).
    """
    p, n = cache.pool_size, keys.shape[0]
    n_pools = n // p
    have_codes, have_scales = oracle.get(rid, (torch.empty(0, HEAD_DIM, dtype=torch.uint8), torch.empty(0)))
    done = have_codes.shape[0]
    if n_pools > done:
        new = slice(done * p, n_pools * p)
        c, s = numerics.compress_pools(keys[new].view(-1, p, HEAD_DIM), gates[new].view(-1, p, HEAD_DIM), ape,
                                       cache.fp8_dtype, cache.round_scale)
        have_codes, have_scales = torch.cat((have_codes, c)), torch.cat((have_scales, s))
        oracle[rid] = (have_codes, have_scales)
    codes, scales = cache.pooled_keys(rid)
    want_codes, want_scales = have_codes[:n_pools], have_scales[:n_pools]
    if not (torch.equal(codes.cpu(), want_codes) and torch.equal(scales.cpu(), want_scales)):
        bad = (codes.cpu() != want_codes).any(1).nonzero().flatten().tolist()
        raise AssertionError(f"request {rid}: pooled entries differ from the oracle at pools {bad[:8]}")
    ring = cache.tail[cache.ring_block(rid)].cpu()
    for q in range(n_pools * p, n):
        if not (torch.equal(ring[0, q % cache.ring], keys[q]) and torch.equal(ring[1, q % cache.ring], gates[q])):
            raise AssertionError(f"request {rid}: ring slot of position {q} does not hold its token")
    return n_pools


def _check_selection(cache, ids, counts, drafts, streams, ape, gen, stats, device, index_topk, heads):
    """Run the indexer selection for the verify step's tokens (random q / head weights), check
    causality for every row and one request's rows against the serving oracle, byte for byte."""
    total = sum(counts)
    q = torch.randn(total, heads, HEAD_DIM, generator=gen).to(torch.bfloat16)
    w = torch.randn(total, heads, generator=gen)
    with _timed(stats["select_times"], device):
        rows = cache.topk_indices(ids, q.to(device), w.to(device), index_topk=index_topk).cpu()
    stats["select_rows"] += total
    start = 0
    pick = ids[stats["decode_steps"] % len(ids)]
    for r, n, (k, g) in zip(ids, counts, drafts):
        first = cache._get(r).step_start
        pos = torch.arange(first, first + n)
        mine = rows[start: start + n]
        if (mine > pos[:, None]).any():
            raise AssertionError(f"request {r}: a selected index exceeds its query position")
        stats["select_rows_topk"] += int(((pos + 1) // cache.pool_size > index_topk // cache.pool_size).sum())
        if r == pick:
            keys = torch.cat((streams[r][0], k))
            gates = torch.cat((streams[r][1], g))
            want = reference.serving_topk_indices(q[start: start + n], w[start: start + n], keys, gates, ape, pos,
                                                  cache.pool_size, index_topk, cache.fp8_dtype, cache.round_scale)[0]
            if not torch.equal(mine, want):
                raise AssertionError(f"request {r}: selected indices differ from the serving oracle")
            stats["select_rows_checked"] += n
        start += n


def run_demo(*, requests: int = 8, max_prompt: int = 6000, decode_steps: int = 48, max_spec_tokens: int = 3,
             pool_size: int = 4, page_size: int = 64, seed: int = 0, device=None, quiet: bool = False,
             index_topk: int = 2048, heads: int = 32) -> dict:
    """Run the session and return its summary (raises AssertionError on any mismatch)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    ape = (torch.randn(pool_size, HEAD_DIM, generator=gen) * 0.5)
    lengths = [rng.randint(1, max_prompt) for _ in range(requests)]
    total_tokens = sum(lengths) + requests * decode_steps * (max_spec_tokens + 1)
    num_pages = requests * (cdiv(total_tokens, pool_size * page_size * requests) + 2)
    cache = KPoolCache(num_pages, page_size=page_size, pool_size=pool_size, max_requests=requests,
                       max_spec_tokens=max_spec_tokens, ape=ape, device=device)
    streams = {r: (torch.empty(0, HEAD_DIM, dtype=torch.bfloat16), torch.empty(0, HEAD_DIM, dtype=torch.bfloat16))
               for r in range(requests)}

    def tokens(n):
        k = torch.randn(n, HEAD_DIM, generator=gen).to(torch.bfloat16)
        g = (torch.randn(n, HEAD_DIM, generator=gen) * 2).to(torch.bfloat16)
        return k, g

    stats = {"prefill_steps": 0, "decode_steps": 0, "tokens": 0, "pools_checked": 0, "rejected_drafts": 0,
             "prefill_times": [], "decode_times": [], "checks": 0, "select_times": [], "select_rows": 0,
             "select_rows_checked": 0, "select_rows_topk": 0}
    todo = dict(enumerate(lengths))
    prefill_rounds = []
    while any(todo.values()):  # chunked prefill: each round takes a random chunk of every unfinished prompt
        round_ = []
        for r, left in todo.items():
            if left:
                n = min(left, rng.choice([rng.randint(1, 7), rng.randint(64, 1200)]))
                round_.append((r, n))
                todo[r] -= n
        prefill_rounds.append(round_)
    bar = None if quiet else Progress(len(prefill_rounds) + decode_steps, "kpool demo")

    oracle: dict = {}
    layer2 = EngineLayer(cache)

    def check_all():
        for r, (k, g) in streams.items():
            stats["pools_checked"] += _check_request(cache, r, k, g, ape, oracle)
        layer2.check()
        stats["checks"] += 1

    for round_ in prefill_rounds:
        chunks = [tokens(n) for _, n in round_]
        ids = [r for r, _ in round_]
        starts = [cache.length(r) if r in cache.requests else 0 for r in ids]
        with _timed(stats["prefill_times"], device):
            cache.prefill(ids, [k.to(device) for k, _ in chunks], [g.to(device) for _, g in chunks])
        layer2.prefill(ids, starts, torch.cat([k for k, _ in chunks]).to(device),
                       torch.cat([g for _, g in chunks]).to(device))
        for r, (k, g) in zip(ids, chunks):
            streams[r] = (torch.cat((streams[r][0], k)), torch.cat((streams[r][1], g)))
            stats["tokens"] += k.shape[0]
        stats["prefill_steps"] += 1
        check_all()
        if bar:
            bar.update(note="prefill")
    for _ in range(decode_steps):
        ids = list(range(requests))
        counts = [rng.randint(1, max_spec_tokens + 1) for _ in ids]
        drafts = [tokens(n) for n in counts]
        with _timed(stats["decode_times"], device):
            cache.decode(ids, [k.to(device) for k, _ in drafts], [g.to(device) for _, g in drafts])
        layer2.decode(ids, *(pad_sequence(rows, batch_first=True).to(device) for rows in zip(*drafts)))
        _check_selection(cache, ids, counts, drafts, streams, ape, gen, stats, device, index_topk, heads)
        accepted = [rng.randint(1, n) for n in counts]
        cache.accept(ids, accepted)
        for r, (k, g), a in zip(ids, drafts, accepted):
            streams[r] = (torch.cat((streams[r][0], k[:a])), torch.cat((streams[r][1], g[:a])))
            stats["tokens"] += a
            stats["rejected_drafts"] += k.shape[0] - a
        stats["decode_steps"] += 1
        check_all()
        if bar:
            bar.update(note="decode/verify")
    committed = sum(cache.length(r) for r in range(requests))
    pools = sum(cache.length(r) // pool_size for r in range(requests))
    stats.update(
        device=str(device), backend=backend_for(device), requests=requests, committed_tokens=committed,
        pools=pools, pool_size=pool_size, page_size=page_size, ring=cache.ring, layout=cache.layout,
        fp8=str(cache.fp8_dtype).replace("torch.", ""),
        pooled_cache_bytes=pools * ENTRY_BYTES, per_token_cache_bytes=committed * ENTRY_BYTES,
        ring_bytes=cache.tail.numel() * 2,
    )
    return stats


def format_summary(s: dict) -> str:
    compiling = " incl. Triton compiling" if s["backend"] == "triton" else ""

    def per_step(times):  # the median is a warm step: a shape's first call also compiles its kernels
        if not times:
            return "none timed"
        return f"median {1e3 * statistics.median(times):.2f} ms per step, {sum(times):.1f} s in all{compiling}"
    lines = [
        "kpool demo — GLM-5.3-Flash indexer geometry "
        f"(P={s['pool_size']}, head dim 128, page {s['page_size']}, ring {s['ring']}, {s['layout']}, {s['fp8']})",
        f"  device / backend       : {s['device']} / {s['backend']}",
        f"  requests               : {s['requests']}",
        f"  committed tokens       : {s['committed_tokens']} ({s['rejected_drafts']} rejected drafts rolled back)",
        f"  pools written          : {s['pools']}",
        f"  indexer cache          : {s['pooled_cache_bytes'] / 2**20:.2f} MiB pooled vs "
        f"{s['per_token_cache_bytes'] / 2**20:.2f} MiB per-token "
        f"({s['per_token_cache_bytes'] / max(s['pooled_cache_bytes'], 1):.1f}x smaller)",
        f"  prefill steps          : {s['prefill_steps']} ({per_step(s['prefill_times'])})",
        f"  decode/verify steps    : {s['decode_steps']} ({per_step(s['decode_times'])}; host planning included)",
        f"  indexer selection      : {s['select_rows']} verify-token rows "
        f"(H=32, top-2048: {s['select_rows_topk']} rows "
        f"with more than 512 visible pools), {per_step(s['select_times'])}",
        f"  checks passed          : {s['checks']} whole-cache checks, {s['pools_checked']} pool entries "
        "byte-identical to the oracle, rings hold every incomplete pool's tokens,",
        f"                           {s['select_rows_checked']} selection rows identical to the serving oracle, "
        "no index past its query,",
        "                           a second layer written from each step's plan (prefill_plan + write_prefill, "
        "decode_slot_mappings) identical to the cache's",
    ]
    return "\n".join(lines)
