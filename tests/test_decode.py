"""``kpool_decode_update_and_maybe_write_cache_batched``: decode / speculative-verify writes.

Every test pre-fills the K cache with random bytes and the tail ring with random bf16,
runs the op under the ``backend`` fixture (torch reference, Triton kernel), and compares
the WHOLE underlying buffers (padding between pages / ring blocks included) byte for
byte with ``oracle_decode``: an independent per-token Python loop written here from
SPEC.md §3-§4 (completion read, then stash) that builds each pool from the ring and
calls ``numerics.compress_pools`` + ``layout.write_entries``. Since both backends are
compared with the same oracle, they also match each other. Several tests also compare
with the prefill writer ``kpool_compress_and_write_cache`` on the same pools (pool
immutability: one formulation in every writer). SPEC §6 traps are named in test names.
"""

from __future__ import annotations

import contextlib
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _util import (TAIL_OVERLAP_CASES, ReadBacks, assert_bytes_equal, make_tail, random_bytes_like, strided_copy,
                   view_tail)
from kpool import kpool_compress_and_write_cache, kpool_decode_update_and_maybe_write_cache_batched
from kpool import layout as L
from kpool import numerics

FN, FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz
D = 128
decode_update = kpool_decode_update_and_maybe_write_cache_batched


# --------------------------------------------------------------------------- buffers

def make_kv(num_pages, page, device, seed, pad_bytes=0, lead_pages=0):
    """Random-byte base buffer and a ``[num_pages, page, 132]`` view of it.

    ``pad_bytes`` pads the page stride (a multiple of 4); ``lead_pages`` leaves whole
    pages before the view (non-zero storage offset); one guard page follows it."""
    stride = page * 132 + pad_bytes
    base = random_bytes_like(((num_pages + lead_pages + 1) * stride,), device, seed)  # + a guard page
    return base, view_kv(base, num_pages, page, pad_bytes, lead_pages)


def view_kv(base, num_pages, page, pad_bytes=0, lead_pages=0):
    stride = page * 132 + pad_bytes
    return torch.as_strided(base, (num_pages, page, 132), (stride, 132, 1), lead_pages * stride)


def bf16_randn(shape, gen, scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).to(torch.bfloat16)


# --------------------------------------------------------------------------- oracle

def oracle_decode(kv, tail, tail_slot_mapping, key, gate, ape, slot_mapping, positions, P, fp8_dtype, layout,
                  round_scale=True):
    """SPEC §4, one token at a time: per request row, per token in row order, a token at
    ``pos`` with ``(pos+1) % P == 0``, a valid pool slot and a valid tail slot compresses
    ring positions ``pos-P+1 .. pos-1`` of ITS OWN block (``tslot // RING``) plus itself
    and writes the entry; then every token with ``pos >= 0`` and a valid tail slot is
    stashed at ring slot ``pos % RING``. Out-of-range slots never address anything."""
    ring = tail.shape[2]
    num_slots = kv.shape[0] * kv.shape[1]
    num_tslots = tail.shape[0] * ring
    B, N = positions.shape
    for b in range(B):
        for t in range(N):
            pos, loc, ts = int(positions[b, t]), int(slot_mapping[b, t]), int(tail_slot_mapping[b, t])
            if pos < 0 or ts < 0 or ts >= num_tslots:
                continue
            blk = ts // ring
            if (pos + 1) % P == 0 and 0 <= loc < num_slots:
                ks, gs = [], []
                for j in range(P):
                    q = pos - (P - 1) + j
                    if q == pos:
                        ks.append(key[b, t].clone())
                        gs.append(gate[b, t].clone())
                    else:
                        ks.append(tail[blk, 0, q % ring].clone())
                        gs.append(tail[blk, 1, q % ring].clone())
                codes, scale = numerics.compress_pools(torch.stack(ks)[None], torch.stack(gs)[None], ape,
                                                       fp8_dtype, round_scale)
                L.write_entries(kv, torch.tensor([loc], device=kv.device), codes, scale, layout)
            tail[blk, 0, pos % ring] = key[b, t]
            tail[blk, 1, pos % ring] = gate[b, t]


def prefill_entries(kv, keys, gates, locs, ape, P, fp8_dtype, layout):
    """The prefill writer on complete pools: ``keys/gates [n, P, 128]`` at ``locs [n]``."""
    kpool_compress_and_write_cache(kv, keys, gates, ape, locs, P, layout=layout, fp8_dtype=fp8_dtype)


# --------------------------------------------------------------------------- scenario

class Sched:
    """Requests with fixed token streams, distinct tail blocks and pool slots, and two copies
    of the caches: ``lib`` (the op under test) and ``ora`` (the oracle)."""

    def __init__(self, device, seed, P, ring, page, layout, fp8, n_req, max_pos, kv_pad=0, lead_pages=0,
                 block_pad=0, head_pad=0, spare_blocks=2, magnitude=1.0, round_scale=True, num_pages=None):
        self.device, self.P, self.ring, self.page = device, P, ring, page
        self.layout, self.fp8, self.n_req, self.round_scale = layout, fp8, n_req, round_scale
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        n_pools = max_pos // P + 2
        self.num_pages = num_pages or -(-(n_req * n_pools + 3) // page)
        self.kv_geom = (self.num_pages, page, kv_pad, lead_pages)
        self.kv_base, _ = make_kv(self.num_pages, page, device, seed + 1, kv_pad, lead_pages)
        self.num_blocks = n_req + spare_blocks
        self.tail_geom = (self.num_blocks, ring, block_pad, head_pad)
        self.tail_base, _ = make_tail(self.num_blocks, ring, device, seed + 2, block_pad, head_pad)
        self.blocks = self.rng.sample(range(self.num_blocks), n_req)
        perm = torch.randperm(self.num_pages * page, generator=self.gen)
        self.pool_slot = perm[: n_req * n_pools].view(n_req, n_pools).tolist()
        self.keys = bf16_randn((n_req, max_pos + 1, D), self.gen, magnitude)
        self.gates = bf16_randn((n_req, max_pos + 1, D), self.gen, 2.0)
        self.ape = torch.randn((P, D), generator=self.gen).to(device)
        self.cursor = [0] * n_req
        self.lib_kv_base, self.lib_tail_base = self.kv_base.clone(), self.tail_base.clone()
        self.ora_kv_base, self.ora_tail_base = self.kv_base.clone(), self.tail_base.clone()

    # views
    def kv(self, base):
        return view_kv(base, *self.kv_geom)

    def tail(self, base):
        return view_tail(base, *self.tail_geom)

    def tslot(self, r, pos):
        return self.blocks[r] * self.ring + pos % self.ring

    def loc(self, r, pos):
        return self.pool_slot[r][pos // self.P] if (pos + 1) % self.P == 0 else -1

    def start(self, r, pos):
        """Request ``r`` resumes at ``pos``: its ring holds tokens ``[pos - RING, pos)`` (a
        consistent prefix, as prefill seeding or earlier decode steps left it)."""
        self.cursor[r] = pos
        for base in (self.lib_tail_base, self.ora_tail_base):
            tail = self.tail(base)
            for q in range(max(0, pos - self.ring), pos):
                tail[self.blocks[r], 0, q % self.ring] = self.keys[r, q].to(self.device)
                tail[self.blocks[r], 1, q % self.ring] = self.gates[r, q].to(self.device)

    def step(self, rows, next_n, pad_kind="neg", idx_dtype=torch.int64, strided=False):
        """One call's arguments. ``rows[r]``: the rows (ascending) holding request ``r``'s next
        ``len(rows[r])`` tokens; every other row is padding of kind ``neg`` (pos, slots -1),
        ``garbage`` (pos -1, random valid pool/tail slots), ``pos_only`` (a valid-looking
        position, slots -1) or ``mixed``. Advances the cursors."""
        B = self.n_req
        pos = torch.full((B, next_n), -1, dtype=torch.int64)
        ts = torch.full_like(pos, -1)
        loc = torch.full_like(pos, -1)
        key = bf16_randn((B, next_n, D), self.gen)
        gate = bf16_randn((B, next_n, D), self.gen)
        used = set()
        for r, rr in enumerate(rows):
            for i, row in enumerate(rr):
                p = self.cursor[r] + i
                pos[r, row], ts[r, row], loc[r, row] = p, self.tslot(r, p), self.loc(r, p)
                key[r, row], gate[r, row] = self.keys[r, p], self.gates[r, p]
                used.add((r, row))
            self.cursor[r] += len(rr)
        for r in range(B):
            for row in range(next_n):
                if (r, row) in used:
                    continue
                kind = self.rng.choice(["neg", "garbage", "pos_only"]) if pad_kind == "mixed" else pad_kind
                if kind == "garbage":
                    ts[r, row] = self.rng.randrange(self.num_blocks * self.ring)
                    loc[r, row] = self.rng.randrange(self.num_pages * self.page)
                elif kind == "pos_only":
                    pos[r, row] = self.rng.choice([0, self.P - 1, self.rng.randrange(64)])
        args = [ts, key, gate, loc, pos]
        if strided:  # transposed views with padded strides (unit inner stride)
            args = [self._spread(a.to(idx_dtype) if a.dtype == torch.int64 else a) for a in args]
        else:
            args = [a.to(self.device).to(idx_dtype) if a.dtype == torch.int64 else a.to(self.device) for a in args]
        return dict(zip(("ts", "key", "gate", "loc", "pos"), args))

    def _spread(self, x):
        """``x [B, n, ...]`` as a view of a ``[n, B(+1), ...]`` buffer (rows padded, dims swapped)."""
        B, n = x.shape[:2]
        if x.ndim == 3:
            buf = torch.zeros((n, B, 2 * D), dtype=x.dtype)
            buf[..., :D] = x.transpose(0, 1)
            return buf.to(self.device).transpose(0, 1)[..., :D]
        buf = torch.zeros((n, B + 1), dtype=x.dtype)
        buf[:, :B] = x.t()
        return buf.to(self.device)[:, :B].t()

    def apply(self, a, what=""):
        """Run the op on the ``lib`` copy and the oracle on the ``ora`` copy; compare whole buffers."""
        decode_update(self.kv(self.lib_kv_base), self.tail(self.lib_tail_base), a["ts"], a["key"], a["gate"],
                      self.ape, a["loc"], a["pos"], self.P, round_scale=self.round_scale,
                      layout=self.layout, fp8_dtype=self.fp8)
        oracle_decode(self.kv(self.ora_kv_base), self.tail(self.ora_tail_base), a["ts"], a["key"], a["gate"],
                      self.ape, a["loc"], a["pos"], self.P, self.fp8, self.layout, self.round_scale)
        self.check(what)

    def check(self, what=""):
        assert_bytes_equal(self.lib_kv_base, self.ora_kv_base, f"kv_cache (whole buffer) {what}")
        assert_bytes_equal(self.lib_tail_base, self.ora_tail_base, f"tail ring (whole buffer) {what}")

    def expected_pools_kv(self, pools):
        """The initial K cache after the PREFILL writer wrote ``pools`` = [(r, m)] of the streams."""
        base = self.kv_base.clone()
        if pools:
            P = self.P
            keys = torch.stack([self.keys[r, m * P:(m + 1) * P] for r, m in pools]).to(self.device)
            gates = torch.stack([self.gates[r, m * P:(m + 1) * P] for r, m in pools]).to(self.device)
            locs = torch.tensor([self.pool_slot[r][m] for r, m in pools], device=self.device)
            kpool_compress_and_write_cache(self.kv(base), keys, gates, self.ape, locs, P, round_scale=self.round_scale,
                                           layout=self.layout, fp8_dtype=self.fp8)
        return base


def contiguous_rows(n):
    return list(range(n))


def spec_ring(P, next_n, kind="pow2"):
    """A valid ring for steps of ``next_n`` tokens (the op needs ``RING >= P + next_n - 1``):
    ``pow2`` = ``L.ring_size(P, next_n - 1)`` (the project's rule; RING = P at next_n = 1),
    ``min`` = the least multiple of P that fits (the bound itself where P divides it),
    ``big`` = 2 x ``pow2`` (room to spare)."""
    if kind == "min":
        return -(-(P + next_n - 1) // P) * P
    return L.ring_size(P, next_n - 1) * (2 if kind == "big" else 1)


# --------------------------------------------------------------------------- matrix

# (id, P, ring kind (spec_ring), layout, fp8, PAGE, next_n, n_req, kv_pad, lead_pages, block_pad, head_pad,
#  magnitude, round_scale, idx_dtype, strided)
CASES = [
    ("plain_decode-P4-R4-plain-fn-page32", 4, "pow2", "plain", FN, 32, 1, 3, 0, 0, 0, 0, 1.0, True, torch.int64,
     False),
    ("P4-R8-preshuffle-fnuz-page64-n4-padded", 4, "pow2", "preshuffle", FNUZ, 64, 4, 3, 64, 1, 256, 0, 1.0, True,
     torch.int32, False),
    ("P16-R32-preshuffle-fn-page32-n2-big", 16, "pow2", "preshuffle", FN, 32, 2, 2, 0, 0, 0, 0, 300.0, True,
     torch.int64, True),
    ("P16-R64-plain-fnuz-page64-n7-padded-noround", 16, "big", "plain", FNUZ, 64, 7, 2, 8, 0, 128, 128, 1.0, False,
     torch.int32, False),
    ("P4-R12-plain-fnuz-page64-n7-padded-strided", 4, "min", "plain", FNUZ, 64, 7, 2, 4, 2, 64, 128, 1e-3, True,
     torch.int64, True),
    ("P4-R8-preshuffle-fn-page32-n2", 4, "pow2", "preshuffle", FN, 32, 2, 4, 0, 0, 0, 0, 1.0, True, torch.int32,
     False),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_decode_matches_oracle(case, backend, device):
    """Random multi-request steps (random starts, valid counts, padding anywhere) over the
    matrix P, RING (P for plain decode; the minimal, power-of-two and a larger ring for
    verify steps), layout, fp8 format, PAGE, padded strides, index dtypes, input strides."""
    run_case(case, device)


@pytest.mark.parametrize("stash_first", [False, True], ids=["stash-after", "stash-first"])
@pytest.mark.parametrize("case", [CASES[0], CASES[4]], ids=[CASES[0][0], CASES[4][0]])
def test_walk_stash_placement_at_any_batch(case, stash_first, backend, device, monkeypatch):
    """The in-order walk (one-token steps; the padded steps of ``CASES[4]`` that are not regular)
    stashes each token before its completion up to ``decode.WALK_STASH_FIRST_BATCH`` requests and
    after it above: with the threshold forced below and above the batch, both give the oracle's bytes."""
    from kpool.ops import decode
    monkeypatch.setattr(decode, "WALK_STASH_FIRST_BATCH", 1 << 20 if stash_first else 0)
    run_case(case, device)


def run_case(case, device):
    """Two random steps of a ``CASES`` row, every step's whole buffers checked (``Sched.apply``)."""
    (id_, P, kind, layout, fp8, page, next_n, n_req, kv_pad, lead, bpad, hpad, mag, rs, idt, strided) = case
    ring = spec_ring(P, next_n, kind)
    assert f"-R{ring}-" in id_
    sc = Sched(device, 11 + P + next_n, P, ring, page, layout, fp8, n_req, max_pos=4 * P + 2 * next_n,
               kv_pad=kv_pad, lead_pages=lead, block_pad=bpad, head_pad=hpad, magnitude=mag, round_scale=rs)
    for r in range(n_req):
        sc.start(r, sc.rng.randrange(0, 3 * P))
    sc.start(0, 2 * P - 1 - (next_n - 1) // 2)  # request 0 completes a pool in the middle of its rows
    for step in range(2):
        rows = []
        for r in range(n_req):
            k = next_n if r == 0 else sc.rng.randrange(0, next_n + 1)
            rows.append(sorted(sc.rng.sample(range(next_n), k)))
        sc.apply(sc.step(rows, next_n, pad_kind="mixed", idx_dtype=idt, strided=strided), f"step {step}")


@pytest.mark.parametrize("P", [4, 16])
def test_pool_completes_mid_batch(P, backend, device):
    """Completions in rows 1 and 2 of a 4-row verify step; the written entries equal the
    prefill writer's on the same pools, everything else keeps its random bytes."""
    sc = Sched(device, 5, P, 2 * P, 32, "plain", FN, 2, max_pos=3 * P)
    sc.start(0, P - 2)      # rows: P-2, P-1 (completes pool 0), P, P+1
    sc.start(1, 2 * P - 3)  # rows: 2P-3, 2P-2, 2P-1 (completes pool 1), 2P
    sc.apply(sc.step([contiguous_rows(4), contiguous_rows(4)], 4))
    assert_bytes_equal(sc.lib_kv_base, sc.expected_pools_kv([(0, 0), (1, 1)]), "kv_cache vs prefill writer")


@pytest.mark.parametrize("P,kind,layout", [(4, "min", "plain"), (4, "big", "preshuffle"), (16, "pow2", "plain")],
                         ids=["P4-R12", "P4-R32", "P16-R32"])
def test_several_completions_in_one_verify_step(P, kind, layout, backend, device):
    """next_n > P: one step completes two (P=4: three) pools of a request, the first from
    ring and row slots, the later ones built only from this step's own earlier tokens
    (read-after-stash inside a step). Rings: the least that fits (P=16: RING = P + next_n
    - 1 exactly), and one with room to spare."""
    next_n = 2 * P + 1 if P == 4 else P + 1
    sc = Sched(device, 6, P, spec_ring(P, next_n, kind), 32, layout, FNUZ, 2, max_pos=4 * P)
    sc.start(0, P - 1)  # P=4: 3..11 completes pools 0, 1, 2;  P=16: 15..31 completes pools 0, 1
    sc.start(1, 1)
    rows1 = sorted(sc.rng.sample(range(next_n), next_n - 2))
    sc.apply(sc.step([contiguous_rows(next_n), rows1], next_n))
    n_done = (P - 1 + next_n) // P
    want = [(0, m) for m in range(n_done)] + [(1, m) for m in range((1 + len(rows1)) // P)]
    assert_bytes_equal(sc.lib_kv_base, sc.expected_pools_kv(want), "kv_cache vs prefill writer")


@pytest.mark.parametrize("P", [4, 16])
def test_leading_invalid_tail_slot(P, backend, device):
    """Upstream regression: rows ``pos = [-1, 13, 14, 15]``, tail slot -1 first, completion
    at 15. The request's block is 2, so a block taken from the first (clamped) row would
    address block 0: blocks 0, 1, 3 must keep their bytes."""
    sc = Sched(device, 7, P, spec_ring(P, 4), 64, "preshuffle", FN, 1, max_pos=16, spare_blocks=3)
    sc.blocks = [2]
    sc.start(0, 13)
    a = sc.step([[1, 2, 3]], 4)
    assert a["ts"][0, 0].item() == -1 and a["pos"][0].tolist() == [-1, 13, 14, 15]
    sc.apply(a)
    tail0, tail = sc.tail(sc.tail_base), sc.tail(sc.lib_tail_base)
    for blk in (0, 1, 3):
        assert_bytes_equal(tail[blk], tail0[blk], f"tail block {blk} (not the request's)")
    assert_bytes_equal(sc.lib_kv_base, sc.expected_pools_kv([(0, 15 // P)]), "kv_cache vs prefill writer")


@pytest.mark.parametrize("lead", ["neg", "garbage"])
def test_tail_block_from_each_token(lead, backend, device):
    """The tail block comes from each token's own tail slot. Trap: deriving it from the
    row's first token when that token is padding (tail slot -1, or a stale slot of another
    block). Also: a row carrying tokens of two requests (different blocks) completes both."""
    P, ring = 4, 8
    sc = Sched(device, 8, P, ring, 32, "plain", FN, 2, max_pos=24, spare_blocks=2)
    sc.blocks = [3, 1]
    sc.start(0, 6)
    sc.start(1, 2)
    a = sc.step([[1, 2], [3, 4]], 5, pad_kind="neg")  # row 0 pad; rows 1-2: req 0 (6, 7); rows 3-4: req 1 (2, 3)
    if lead == "garbage":  # a stale tail slot in block 0 and a valid pool slot on the padding row
        a["ts"][0, 0], a["loc"][0, 0] = 0 * ring + 3, 0
    # pack request 1's rows into request 0's row: one row, two blocks
    for name in ("ts", "loc", "pos", "key", "gate"):
        a[name][0, 3:] = a[name][1, 3:]
        a[name][1, :] = -1 if name in ("ts", "loc", "pos") else a[name][1, :]
    sc.apply(a)
    tail0, tail = sc.tail(sc.tail_base), sc.tail(sc.lib_tail_base)
    for blk in (0, 2):
        assert_bytes_equal(tail[blk], tail0[blk], f"tail block {blk} (no request's)")
    assert torch.equal(tail[3, 0, 7 % ring].cpu(), sc.keys[0, 7]) and torch.equal(tail[1, 1, 2].cpu(), sc.gates[1, 2])
    assert_bytes_equal(sc.lib_kv_base, sc.expected_pools_kv([(0, 1), (1, 0)]), "kv_cache vs prefill writer")


@pytest.mark.parametrize("where", ["start", "middle", "end", "everywhere"])
def test_padding_sentinels(where, backend, device):
    """-1 sentinels (and garbage slots / stale positions on padding rows) at the start, in
    the middle and at the end of a request's rows never form an address; the request's real
    tokens still complete their pool and are stashed."""
    P, next_n = 4, 7
    rows = {"start": [3, 4, 5, 6], "middle": [0, 2, 3, 6], "end": [0, 1, 2, 3], "everywhere": [1, 3, 4, 5]}[where]
    sc = Sched(device, 9, P, spec_ring(P, next_n), 32, "preshuffle", FNUZ, 2, max_pos=24)
    sc.start(0, 5)  # tokens 5, 6, 7 (completes pool 1), 8
    sc.start(1, 2)  # tokens 2, 3 (completes pool 0)
    sc.apply(sc.step([rows, [r for r in rows[:2]]], next_n, pad_kind="mixed"))
    assert_bytes_equal(sc.lib_kv_base, sc.expected_pools_kv([(0, 1), (1, 0)]), "kv_cache vs prefill writer")


def test_stash_gated_on_tail_slot_not_pool_slot(backend, device):
    """Decode, one token per step, through a whole pool whose ring slots start stale: tokens
    with slot_mapping -1 must still be stashed (gate on the TAIL slot), so the completing
    token compresses the decoded tokens, not stale ring entries (upstream bug)."""
    P = 4
    sc = Sched(device, 10, P, P, 32, "plain", FN, 2, max_pos=16)
    sc.start(0, 8)  # ring of request 0 holds tokens 4..7; slots are about to be overwritten by 8..10
    sc.start(1, 2)
    for step in range(P):
        a = sc.step([[0], [0]], 1)
        sc.apply(a, f"step {step}")
        tail = sc.tail(sc.lib_tail_base)
        assert torch.equal(tail[sc.blocks[0], 0, (8 + step) % P].cpu(), sc.keys[0, 8 + step]), "token not stashed"
    assert_bytes_equal(sc.lib_kv_base, sc.expected_pools_kv([(0, 2), (1, 0)]), "kv_cache vs prefill writer")


@pytest.mark.parametrize("P", [4, 16], ids=["P=4", "P=16"])
def test_decode_writer_matches_prefill_writer(P, backend, device):
    """Token streams (P=4: two requests) fed through decode one token per step across a pool
    completion, and in verify steps of random next_n (random valid counts, trailing padding):
    every pool completed on the way is byte-identical to the prefill writer's entry for the
    same tokens, and nothing else in the cache changes (pool immutability). The ring fits
    the largest step (next_n = 7)."""
    choices = [2, 4, 7] if P == 4 else [4, 7]
    n_pools = 3 if P == 4 else 2
    n_req = 2 if P == 4 else 1  # P=16 is slow in the interpreter: one request
    sc = Sched(device, 20 + P, P, spec_ring(P, max(choices)), 64 if P == 4 else 32, "plain" if P == 4 else "preshuffle",
               FN if P == 4 else FNUZ, n_req, max_pos=n_pools * P + 8)
    starts = [0, 3][:n_req]
    for r, p0 in enumerate(starts):
        sc.start(r, p0)
    end = n_pools * P + 1

    def verify_until(stop):
        while sc.cursor[0] < stop:
            next_n = sc.rng.choice(choices)
            rows = [contiguous_rows(min(next_n, stop - sc.cursor[0]))]
            rows += [contiguous_rows(min(sc.rng.randrange(1, next_n + 1), end - sc.cursor[r])) for r in range(1, n_req)]
            sc.apply(sc.step(rows, next_n), "verify")

    # P=4: a whole pool token by token first; P=16: verify steps up to 4 tokens before the
    # end of pool 0, then token by token across its completion, then verify steps again.
    tbt_from = 0 if P == 4 else P - 4
    verify_until(tbt_from)
    for _ in range(min(P, 5)):
        sc.apply(sc.step([[0]] + [[0] if sc.cursor[r] < end else [] for r in range(1, n_req)], 1), "token-by-token")
    verify_until(n_pools * P)
    pools = [(r, m) for r in range(n_req) for m in range(sc.cursor[r] // P) if m * P + P - 1 >= starts[r]]
    assert len(pools) >= n_pools * n_req - 1
    assert_bytes_equal(sc.lib_kv_base, sc.expected_pools_kv(pools), "kv_cache vs prefill writer")


@pytest.mark.parametrize("P,kind,next_n", [(4, "pow2", 1), (4, "pow2", 2), (4, "min", 9), (4, "pow2", 5),
                                           (16, "pow2", 17), (16, "big", 4)],
                         ids=["P4-R4-n1", "P4-R8-n2", "P4-R12-n9", "P4-R8-n5", "P16-R32-n17", "P16-R64-n4"])
def test_regular_steps_only(P, kind, next_n, backend, device):
    """Every request's step regular (its valid tokens a prefix at consecutive positions, one
    ring block; shorter requests padded at the end): the Triton kernel's step-tile path for
    the whole launch, several completions per step, completions whose slots come partly from
    the ring and partly from the step's own rows. Rings: RING = P for plain decode, steps at
    the ring's limit (RING = P + next_n - 1: n5, n9, n17), a ring with room to spare. Whole
    cache and ring against the in-order oracle, three steps."""
    sc = Sched(device, 70 + P + next_n, P, spec_ring(P, next_n, kind), 32, "plain", FN, 4,
               max_pos=4 * P + 3 * next_n)
    for r in range(4):
        sc.start(r, sc.rng.randrange(0, 2 * P))
    for step in range(3):
        rows = [contiguous_rows(next_n), contiguous_rows(next_n - 1), contiguous_rows(1), []]
        sc.apply(sc.step(rows, next_n), f"step {step}")


@pytest.mark.parametrize("P", [4, 16])
def test_rejected_draft_redo(P, backend, device):
    """RING = ring_size(P, 3) >= P + num_spec. Step 1 verifies positions 2P-3 .. 2P (one bonus
    token + 3 drafts); the drafts complete pool 1, then all three are rejected. Step 2
    re-sends positions 2P-2 .. 2P+1 with the accepted tokens: pool 1 is rewritten from the
    accepted tokens and equals the prefill writer's. With RING = P the draft at 2P would
    overwrite the ring slot of position P that the redo needs (the per-token oracle shows
    the corrupted pool): the op rejects that ring and writes nothing."""
    num_spec = 3
    ring = L.ring_size(P, num_spec)
    assert ring >= P + num_spec and ring % P == 0

    def run(ring_size, use_oracle_only):
        sc = Sched(device, 30 + P, P, ring_size, 32, "preshuffle", FN, 1, max_pos=3 * P)
        sc.start(0, 2 * P - 3)
        a = sc.step([[0, 1, 2, 3]], 4)
        draft_k, draft_g = bf16_randn((3, D), sc.gen), bf16_randn((3, D), sc.gen, 2.0)
        a["key"][0, 1:], a["gate"][0, 1:] = draft_k.to(device), draft_g.to(device)  # drafts differ
        if use_oracle_only:
            oracle_decode(sc.kv(sc.lib_kv_base), sc.tail(sc.lib_tail_base), a["ts"], a["key"], a["gate"], sc.ape,
                          a["loc"], a["pos"], P, sc.fp8, sc.layout)
        else:
            sc.apply(a, "draft step")
        sc.cursor[0] = 2 * P - 2  # only the bonus token was accepted
        a = sc.step([[0, 1, 2, 3]], 4)
        assert a["pos"][0].tolist() == [2 * P - 2, 2 * P - 1, 2 * P, 2 * P + 1]
        if use_oracle_only:
            oracle_decode(sc.kv(sc.lib_kv_base), sc.tail(sc.lib_tail_base), a["ts"], a["key"], a["gate"], sc.ape,
                          a["loc"], a["pos"], P, sc.fp8, sc.layout)
        else:
            sc.apply(a, "redo step")
        return sc

    sc = run(ring, False)
    assert_bytes_equal(sc.lib_kv_base, sc.expected_pools_kv([(0, 1)]), "kv_cache vs prefill writer after redo")
    small = run(P, True)  # the scenario bites: a one-pool ring corrupts the redo
    assert not torch.equal(small.lib_kv_base, small.expected_pools_kv([(0, 1)]))
    small = Sched(device, 30 + P, P, P, 32, "preshuffle", FN, 1, max_pos=3 * P)
    small.start(0, 2 * P - 3)
    with pytest.raises(ValueError, match="tail_kv_cache.*too small"):
        small.apply(small.step([[0, 1, 2, 3]], 4), "draft step at RING = P")
    small.check("after the rejected call")  # the oracle never ran: its copies hold the starting bytes


@pytest.mark.parametrize("layout,fp8", [("plain", FN), ("plain", FNUZ), ("preshuffle", FN), ("preshuffle", FNUZ)])
def test_entry_bytes_at_spec_offsets(layout, fp8, backend, device):
    """A pool completed by decode at page 1, state 17 (PAGE 32, padded page stride): its
    codes and fp32 scale sit at the SPEC §3 byte offsets (written out here), no other
    byte changes; e4m3fnuz uses FP8_MAX 240 (codes within range), e4m3fn 448."""
    P, page, pad = 4, 32, 16
    sc = Sched(device, 40, P, spec_ring(P, 3), page, layout, fp8, 1, max_pos=8, kv_pad=pad, num_pages=3)
    sc.pool_slot = [[page + 17, page + 17]]
    sc.start(0, 5)
    sc.apply(sc.step([[0, 1, 2]], 3))
    codes, scale = numerics.compress_pools(sc.keys[0, 4:8][None].to(device), sc.gates[0, 4:8][None].to(device),
                                           sc.ape, fp8)
    stride = page * 132 + pad
    s = 17
    d = torch.arange(D)
    if layout == "plain":
        off = s * 128 + d
    else:
        off = (s // 16) * 2048 + (d // 16) * 256 + (s % 16) * 16 + d % 16
    key_off = stride + off
    scale_off = stride + page * 128 + 4 * s + torch.arange(4)
    got = sc.lib_kv_base.cpu()
    assert torch.equal(got[key_off], codes[0].cpu())
    assert torch.equal(got[scale_off], scale.cpu().view(torch.uint8))
    vals = got[key_off].view(fp8).float()
    fmax = torch.finfo(fp8).max  # ue8m0 scale: the largest code lands in (FP8_MAX/2, FP8_MAX]
    assert not torch.isnan(vals).any() and fmax / 2 <= vals.abs().max() <= fmax
    mask = torch.ones_like(got, dtype=torch.bool)
    mask[key_off], mask[scale_off] = False, False
    assert torch.equal(got[mask], sc.kv_base.cpu()[mask]), "bytes outside the entry changed"


def test_slot_mapping_on_non_completing_token_is_ignored(backend, device):
    """A pool slot given on a token that does not complete a pool writes nothing."""
    sc = Sched(device, 41, 4, 8, 32, "plain", FN, 1, max_pos=12)
    sc.start(0, 4)
    a = sc.step([[0, 1]], 2)  # positions 4, 5: no completion
    a["loc"][0] = torch.tensor([3, 7], device=device)
    sc.apply(a)
    assert_bytes_equal(sc.lib_kv_base, sc.kv_base, "kv_cache")


@pytest.mark.parametrize("shape", [(0, 4), (3, 0), (0, 0)], ids=["B=0", "next_n=0", "B=0-next_n=0"])
def test_empty_batch(shape, backend, device):
    sc = Sched(device, 42, 4, 8, 32, "plain", FN, 1, max_pos=8)
    B, n = shape
    ints = torch.full((B, n), -1, dtype=torch.int64, device=device)
    key = torch.zeros((B, n, D), dtype=torch.bfloat16, device=device)
    decode_update(sc.kv(sc.lib_kv_base), sc.tail(sc.lib_tail_base), ints, key, key, sc.ape, ints, ints, 4,
                  layout="plain", fp8_dtype=FN)
    sc.check()
    assert_bytes_equal(sc.lib_kv_base, sc.kv_base, "kv_cache")
    assert_bytes_equal(sc.lib_tail_base, sc.tail_base, "tail")


def test_unchecked_out_of_range_slots_write_nothing(backend, device, monkeypatch):
    """With KPOOL_CHECK=0 (no host range check), a pool slot or tail slot past the end of its
    buffer is skipped: no byte outside the owned entries changes (padded buffers compared whole)."""
    monkeypatch.setenv("KPOOL_CHECK", "0")
    sc = Sched(device, 43, 4, spec_ring(4, 2), 32, "plain", FN, 2, max_pos=12, kv_pad=8, block_pad=64)
    sc.start(0, 2)
    sc.start(1, 6)
    a = sc.step([[0, 1], [0, 1]], 2)  # request 0 completes pool 0 at 3; request 1 completes pool 1 at 7
    a["loc"][0, 1] = sc.num_pages * sc.page  # one past the last slot
    a["ts"][1, 0] = sc.num_blocks * sc.ring + 2  # one block past the last
    sc.apply(a)


def test_unchecked_out_of_range_pool_slot_on_the_in_order_walk(backend, device, monkeypatch):
    """As above, on the in-order walk (next_n = 1, and a step led by a padding row): a pool
    slot one past the cache is skipped there too (the guard bytes after the view compared)."""
    monkeypatch.setenv("KPOOL_CHECK", "0")
    for seed, next_n, rows in ((44, 1, [[0]]), (45, 2, [[1]])):
        sc = Sched(device, seed, 4, spec_ring(4, next_n), 32, "plain", FN, 1, max_pos=12, kv_pad=8)
        sc.start(0, 3)
        a = sc.step(rows, next_n)  # position 3 completes pool 0
        a["loc"][0, next_n - 1] = sc.num_pages * sc.page
        sc.apply(a)


def test_consecutive_positions_in_two_blocks(backend, device):
    """A row carrying two requests whose positions happen to continue each other (6, 7 in
    block 3, then 8, 9 in block 1) is not one request's regular step: each token is stashed
    in its own block and each completion reads its own ring."""
    P, ring = 4, 8
    sc = Sched(device, 8, P, ring, 32, "plain", FN, 2, max_pos=24, spare_blocks=2)
    sc.blocks = [3, 1]
    sc.start(0, 6)
    sc.start(1, 8)
    a = sc.step([[0, 1], [2, 3]], 4)  # request 0: row 0 cols 0-1 (6, 7); request 1: row 1 cols 2-3 (8, 9)
    for name in ("ts", "loc", "pos", "key", "gate"):  # request 1's tokens into row 0
        a[name][0, 2:] = a[name][1, 2:]
        if name in ("ts", "loc", "pos"):
            a[name][1, :] = -1
    assert a["pos"][0].tolist() == [6, 7, 8, 9]
    sc.apply(a)  # whole kv / ring buffers vs the per-token oracle
    tail = sc.tail(sc.lib_tail_base)
    assert torch.equal(tail[1, 0, 8 % ring].cpu(), sc.keys[1, 8]) and torch.equal(tail[1, 0, 9 % ring].cpu(), sc.keys[1, 9])


@pytest.mark.parametrize("metadata_ready", [False, True])
@pytest.mark.parametrize("P", [4, 16])
def test_index_tensors_rewritten_in_place_before_every_step(P, metadata_ready, backend, device, monkeypatch):
    """Twelve back-to-back steps of 24 requests whose index tensors (positions, tail and pool
    slots, int32) and rows are ONE set of buffers, rewritten by torch ops before each launch,
    with no host sync between steps (``KPOOL_CHECK=0``). By default the index tensors are
    rewritten last, by the kernel just before the update, which under PDL waits for it before
    its first load; with ``metadata_ready`` (the kernel loads them before that wait,
    ``ops/decode.py``) they are rewritten first and the rows last, as the contract allows.
    Each request sends 0-4 tokens a step; the whole buffers equal the oracle's after the last step."""
    monkeypatch.setenv("KPOOL_CHECK", "0")
    n_req, next_n = 24, 4
    sc = Sched(device, 60 + P, P, L.ring_size(P, next_n - 1), 64, "plain", FN, n_req, max_pos=2 * P + 12 * next_n)
    for r in range(n_req):
        sc.start(r, sc.rng.randrange(2 * P))
    steps = [sc.step([list(range(sc.rng.randrange(next_n + 1))) for _ in range(n_req)], next_n)
             for _ in range(12)]
    meta = {name: torch.empty(steps[0][name].shape, dtype=torch.int32, device=device) for name in ("ts", "loc", "pos")}
    rows = {name: torch.empty_like(steps[0][name]) for name in ("key", "gate")}
    order = (*meta.items(), *rows.items()) if metadata_ready else (*rows.items(), *meta.items())
    kv, tail = sc.kv(sc.lib_kv_base), sc.tail(sc.lib_tail_base)
    for a in steps:
        for name, buf in order:
            torch.add(a[name], 0, out=buf)
        decode_update(kv, tail, meta["ts"], rows["key"], rows["gate"], sc.ape, meta["loc"], meta["pos"], P,
                      layout=sc.layout, fp8_dtype=sc.fp8, metadata_ready=metadata_ready)
    for a in steps:
        oracle_decode(sc.kv(sc.ora_kv_base), sc.tail(sc.ora_tail_base), a["ts"], a["key"], a["gate"], sc.ape,
                      a["loc"], a["pos"], P, sc.fp8, sc.layout)
    assert sum(int((a["pos"] >= 0).sum()) for a in steps) > 12 * n_req  # steps of several tokens on average
    sc.check("after twelve steps from rewritten buffers")


def test_determinism(backend, device):
    """The same step twice from the same buffers: identical bytes."""
    outs = []
    for _ in range(2):
        sc = Sched(device, 44, 4, 8, 64, "preshuffle", FNUZ, 3, max_pos=40)
        sc.start(0, 13)
        sc.start(1, 30)
        sc.start(2, 1)
        sc.apply(sc.step([[0, 1, 2, 3], [1, 2], [0, 2, 3]], 4))
        outs.append((sc.lib_kv_base, sc.lib_tail_base))
    assert_bytes_equal(outs[0][0], outs[1][0], "kv_cache run 1 vs run 2")
    assert_bytes_equal(outs[0][1], outs[1][1], "tail run 1 vs run 2")


# --------------------------------------------------------------------------- validation

def _valid_args(device, P=4, ring=8, page=32, B=2, n=3):
    """Valid for ``RING >= P + n - 1``; columns past the third are padding (-1)."""
    kv = torch.zeros((4, page, 132), dtype=torch.uint8, device=device)
    tail = torch.zeros((3, 2, ring, D), dtype=torch.bfloat16, device=device)

    def ints(rows):
        return torch.nn.functional.pad(torch.tensor(rows), (0, max(n - 3, 0)), value=-1)[:B, :n].to(device)

    key = torch.zeros((B, n, D), dtype=torch.bfloat16, device=device)
    ape = torch.zeros((P, D), dtype=torch.float32, device=device)
    loc = ints([[-1, -1, -1], [-1, 5, -1]])
    pos = ints([[0, 1, 2], [2, 3, -1]])
    ts = torch.where(pos >= 0, torch.tensor([[0], [1]], device=device)[:B] * ring + pos % ring, -1)  # blocks 0, 1
    return dict(kv_cache=kv, tail_kv_cache=tail, tail_slot_mapping=ts, key=key, slot_score=key.clone(), ape=ape,
                slot_mapping=loc, positions=pos, pool_size=P)


BAD = [
    # (id, mutate(args, device) -> kwargs-updates, error type, message regex)
    ("key-dtype", lambda a, dv: {"key": a["key"].float()}, TypeError, "key"),
    ("slot_score-dtype", lambda a, dv: {"slot_score": a["slot_score"].half()}, TypeError, "slot_score"),
    ("ape-dtype", lambda a, dv: {"ape": a["ape"].bfloat16()}, TypeError, "ape"),
    ("kv_cache-dtype", lambda a, dv: {"kv_cache": a["kv_cache"].view(torch.int8)}, TypeError, "kv_cache"),
    ("tail-dtype", lambda a, dv: {"tail_kv_cache": a["tail_kv_cache"].half()}, TypeError, "tail_kv_cache"),
    ("positions-dtype", lambda a, dv: {"positions": a["positions"].float()}, TypeError, "positions"),
    ("slot_mapping-dtype", lambda a, dv: {"slot_mapping": a["slot_mapping"].to(torch.int16)}, TypeError,
     "slot_mapping"),
    ("tail_slot_mapping-dtype", lambda a, dv: {"tail_slot_mapping": a["tail_slot_mapping"] >= 0}, TypeError,
     "tail_slot_mapping"),
    ("key-rank", lambda a, dv: {"key": a["key"][0]}, ValueError, "key"),
    ("key-headdim", lambda a, dv: {"key": a["key"][..., :64], "slot_score": a["slot_score"][..., :64]},
     ValueError, "key"),
    ("slot_score-shape", lambda a, dv: {"slot_score": a["slot_score"][:, :2]}, ValueError, "slot_score"),
    ("ape-shape", lambda a, dv: {"ape": torch.zeros((5, D), device=dv)}, ValueError, "ape"),
    ("positions-shape", lambda a, dv: {"positions": a["positions"][:, :2]}, ValueError, "positions"),
    ("slot_mapping-shape", lambda a, dv: {"slot_mapping": a["slot_mapping"].reshape(-1)}, ValueError,
     "slot_mapping"),
    ("tail_slot_mapping-shape", lambda a, dv: {"tail_slot_mapping": a["tail_slot_mapping"][:1]}, ValueError,
     "tail_slot_mapping"),
    ("kv_cache-lastdim", lambda a, dv: {"kv_cache": torch.zeros((4, 32, 128), dtype=torch.uint8, device=dv)},
     ValueError, "kv_cache"),
    ("kv_cache-rank", lambda a, dv: {"kv_cache": a["kv_cache"].reshape(-1, 132)}, ValueError, "kv_cache"),
    ("tail-heads", lambda a, dv: {"tail_kv_cache": torch.zeros((3, 3, 8, D), dtype=torch.bfloat16, device=dv)},
     ValueError, "tail_kv_cache"),
    ("tail-dim", lambda a, dv: {"tail_kv_cache": torch.zeros((3, 2, 8, 64), dtype=torch.bfloat16, device=dv)},
     ValueError, "tail_kv_cache"),
    ("ring-not-multiple-of-P", lambda a, dv: {"tail_kv_cache": torch.zeros((3, 2, 6, D), dtype=torch.bfloat16,
                                                                           device=dv)}, ValueError, "ring"),
    ("ring-smaller-than-P", lambda a, dv: {"tail_kv_cache": torch.zeros((3, 2, 8, D), dtype=torch.bfloat16,
                                                                        device=dv), "pool_size": 16,
                                           "ape": torch.zeros((16, D), device=dv)}, ValueError, "ring"),
    # RING >= P + next_n - 1 (room for the drafts); each valid with one token fewer (test_valid_args_accepted)
    ("ring-P-with-speculation", lambda a, dv: _valid_args(dv, ring=4, n=2), ValueError,
     "tail_kv_cache.*too small"),
    ("ring-2P-next_n-6", lambda a, dv: _valid_args(dv, ring=8, n=6), ValueError, "tail_kv_cache.*too small"),
    *TAIL_OVERLAP_CASES,
    ("key-inner-stride", lambda a, dv: {"key": strided_copy(a["key"])}, ValueError, "key"),
    ("slot_score-inner-stride", lambda a, dv: {"slot_score": strided_copy(a["slot_score"])}, ValueError, "slot_score"),
    ("ape-inner-stride", lambda a, dv: {"ape": strided_copy(a["ape"])}, ValueError, "ape"),
    ("kv_cache-inner-stride", lambda a, dv: {"kv_cache": strided_copy(a["kv_cache"])}, ValueError, "kv_cache"),
    ("kv_cache-row-stride", lambda a, dv: {"kv_cache": strided_copy(a["kv_cache"], 1)}, ValueError, "kv_cache"),
    ("tail-inner-stride", lambda a, dv: {"tail_kv_cache": strided_copy(a["tail_kv_cache"])}, ValueError,
     "tail_kv_cache"),
    ("tail-row-stride", lambda a, dv: {"tail_kv_cache": strided_copy(a["tail_kv_cache"], 2)}, ValueError,
     "tail_kv_cache"),
    ("key-device", lambda a, dv: {"key": a["key"].to("meta"), "slot_score": a["slot_score"].to("meta")},
     ValueError, "device|meta"),
    ("slot_score-device", lambda a, dv: {"slot_score": a["slot_score"].to("meta")}, ValueError, "slot_score"),
    ("ape-device", lambda a, dv: {"ape": a["ape"].to("meta")}, ValueError, "ape"),
    ("kv_cache-device", lambda a, dv: {"kv_cache": a["kv_cache"].to("meta")}, ValueError, "kv_cache"),
    ("tail-device", lambda a, dv: {"tail_kv_cache": a["tail_kv_cache"].to("meta")}, ValueError, "tail_kv_cache"),
    ("positions-device", lambda a, dv: {"positions": a["positions"].to("meta")}, ValueError, "positions"),
    ("slot_mapping-out-of-range", lambda a, dv: {"slot_mapping": torch.tensor([[-1, -1, -1], [-1, 4 * 32, -1]],
                                                                              device=dv)}, ValueError,
     "slot_mapping"),
    ("tail_slot_mapping-out-of-range", lambda a, dv: {"tail_slot_mapping": torch.tensor([[0, 1, 2], [24, 9, -1]],
                                                                                        device=dv)},
     ValueError, "tail_slot_mapping"),
    # built with RING = 4 for a tail of RING = 8: request 1's tokens would land in block 0
    ("tail_slot_mapping-other-ring", lambda a, dv: {"tail_slot_mapping": torch.tensor([[0, 1, 2], [6, 7, -1]],
                                                                                      device=dv)},
     ValueError, r"tail_slot_mapping\[1, 0\] = 6 for position 2: not block \* RING \+ pos % RING"),
    # requests run concurrently: two completions writing one slot, or two rows in one ring block, race
    ("slot_mapping-repeat", lambda a, dv: {"positions": torch.tensor([[1, 2, 3], [2, 3, -1]], device=dv),
                                           "tail_slot_mapping": torch.tensor([[1, 2, 3], [10, 11, -1]], device=dv),
                                           "slot_mapping": torch.tensor([[-1, -1, 5], [-1, 5, -1]], device=dv)},
     ValueError, r"slot_mapping: cache slots of completing tokens repeat: \[5\]"),
    ("tail_slot_mapping-shared-block", lambda a, dv: {"positions": torch.tensor([[0, 1, 2], [4, 5, -1]], device=dv),
                                                      "tail_slot_mapping": torch.tensor([[0, 1, 2], [4, 5, -1]],
                                                                                        device=dv),
                                                      "slot_mapping": torch.full((2, 3), -1, device=dv)},
     ValueError, r"tail_slot_mapping: ring blocks of the requests \(rows\) repeat: \[0\]"),
    ("preshuffle-page24", lambda a, dv: {"kv_cache": torch.zeros((4, 24, 132), dtype=torch.uint8, device=dv),
                                         "layout": "preshuffle"}, ValueError, "preshuffle"),
    ("head_dim", lambda a, dv: {"head_dim": 64}, ValueError, "head_dim"),
    ("pool_size", lambda a, dv: {"pool_size": 0}, ValueError, "pool_size"),
    ("layout", lambda a, dv: {"layout": "shuffled"}, ValueError, "layout"),
    ("fp8_dtype", lambda a, dv: {"fp8_dtype": torch.float16}, TypeError, "fp8_dtype"),
    ("metadata_ready", lambda a, dv: {"metadata_ready": 1}, TypeError, "metadata_ready"),
]


@pytest.mark.parametrize("bad", BAD, ids=[b[0] for b in BAD])
def test_decode_rejects(bad, backend, device):
    """Invalid arguments raise an error naming the argument, before anything is written."""
    _, mutate, exc, match = bad
    args = _valid_args(device)
    args.update(mutate(args, device))
    bufs = [t.clone() for t in (args["kv_cache"], args["tail_kv_cache"]) if t.device.type != "meta"]
    with pytest.raises(exc, match=match):
        decode_update(**args)
    after = [t for t in (args["kv_cache"], args["tail_kv_cache"]) if t.device.type != "meta"]
    for b, t in zip(bufs, after):
        assert_bytes_equal(t, b, "buffer after a rejected call")


@pytest.mark.parametrize("bad", [None, "slot_mapping-out-of-range", "tail_slot_mapping-out-of-range",
                                 "tail_slot_mapping-other-ring", "slot_mapping-repeat",
                                 "tail_slot_mapping-shared-block"])
def test_value_checks_read_back_once(bad, device, monkeypatch):
    """The slot ranges, the ring-slot rule and the repeat checks cost the host one read-back
    together: counted up to the write, which is stubbed out."""
    import kpool.ops.decode as decode_module
    monkeypatch.setenv("KPOOL_BACKEND", "torch")
    writes = []
    monkeypatch.setattr(decode_module.reference, "decode_update", lambda *a, **k: writes.append(a))
    args = _valid_args(device)
    if bad is not None:
        args.update(next(case for case in BAD if case[0] == bad)[1](args, device))
    with ReadBacks() as mode:
        if bad is None:
            decode_update(**args)
        else:
            with pytest.raises(ValueError, match="^tail_slot_mapping" if "tail" in bad else "^slot_mapping"):
                decode_update(**args)
    # a valid call: that one read; a bad one: found by it (the message then reads the offending entry)
    assert (mode.reads if bad is None else mode.reads[:1]) == ["tolist"], mode.reads
    assert len(writes) == (bad is None)


def test_valid_args_accepted(backend, device):
    """The base of the rejection cases is itself valid (so each case fails for its own reason)."""
    decode_update(**_valid_args(device), layout="plain")
    decode_update(**_valid_args(device, page=64), layout="preshuffle", fp8_dtype=FNUZ)  # PAGE % 16 == 0
    decode_update(**_valid_args(device, ring=4, n=1), layout="plain")  # RING = P without speculation
    decode_update(**_valid_args(device, ring=8, n=5), layout="plain")  # RING = P + next_n - 1
    # a slot repeated on tokens that complete no pool (vLLM-style per-token slots) is not written twice
    decode_update(**dict(_valid_args(device), slot_mapping=torch.tensor([[7, 7, 7], [5, 5, -1]], device=device)),
                  layout="plain")


# --------------------------------------------------------------------------- property test

@settings(max_examples=8, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_random_decode_schedules(data, backend, device):
    """Random schedules: 1-3 requests at random starting positions (ring pre-filled by their
    prefix), RING = P, 2P or 4P, 1-3 steps of random next_n up to 7 and up to what the ring
    allows (RING >= P + next_n - 1, the limit itself among the draws; plain decode at RING =
    P) with random valid counts and padding placement and kinds, random draft rejections
    (cursor rewinds, different tokens re-sent); every step's whole buffers equal the oracle's."""
    P = data.draw(st.sampled_from([4, 16]), label="P")
    ring = P * data.draw(st.sampled_from([1, 2, 4]), label="ring/P")
    max_n = min(7, ring - P + 1)
    layout = data.draw(st.sampled_from(["plain", "preshuffle"]), label="layout")
    fp8 = data.draw(st.sampled_from([FN, FNUZ]), label="fp8")
    page = data.draw(st.sampled_from([32, 64]), label="PAGE")
    n_req = data.draw(st.integers(1, 3 if P == 4 else 2), label="requests")  # keeps the interpreter quick
    n_steps = data.draw(st.integers(1, 3), label="steps")
    pads = data.draw(st.tuples(st.sampled_from([0, 4, 64]), st.sampled_from([0, 128])), label="kv_pad, block_pad")
    seed = data.draw(st.integers(0, 2**20), label="seed")
    sc = Sched(device, seed, P, ring, page, layout, fp8, n_req, max_pos=3 * P + 3 * 7 + 2,
               kv_pad=pads[0], block_pad=pads[1], magnitude=data.draw(st.sampled_from([1.0, 50.0])))
    for r in range(n_req):
        sc.start(r, data.draw(st.integers(0, 3 * P), label=f"start {r}"))
    for step in range(n_steps):
        next_n = data.draw(st.sampled_from(sorted({n for n in (1, 2, 4) if n <= max_n} | {max_n}))
                           | st.integers(1, max_n), label="next_n")
        rows = []
        for r in range(n_req):
            k = data.draw(st.integers(0, next_n), label="valid")
            perm = data.draw(st.permutations(range(next_n)), label="placement")
            rows.append(sorted(perm[:k]))
        pad_kind = data.draw(st.sampled_from(["neg", "garbage", "pos_only", "mixed"]), label="padding")
        sc.apply(sc.step(rows, next_n, pad_kind=pad_kind), f"step {step}")
        for r in range(n_req):  # reject some drafts: the stream gets new tokens at those positions
            back = data.draw(st.integers(0, max(len(rows[r]) - 1, 0)), label="rejected")
            if back:
                sc.cursor[r] -= back
                c = sc.cursor[r]
                sc.keys[r, c:c + back] = bf16_randn((back, D), sc.gen)
                sc.gates[r, c:c + back] = bf16_randn((back, D), sc.gen, 2.0)


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(P=st.sampled_from([1, 4]), B=st.integers(1, 5), n=st.integers(1, 4), data=st.data())
def test_step_repeat_checks_match_a_loop(P, B, n, data):
    """The decode update's repeat checks (``_step_writes``) raise exactly when a loop over the
    step finds two completing tokens with one cache slot, or two rows with live tokens in one
    ring block (random blocks, slots from a small set, padding anywhere)."""
    from kpool._checks import check_index_ranges
    from kpool.ops.decode import _step_writes
    ring = 2 * P + n
    ring += -ring % P
    blocks = data.draw(st.lists(st.integers(0, 3), min_size=B, max_size=B))
    pos = [[data.draw(st.integers(-1, 9)) for _ in range(n)] for _ in range(B)]
    loc = [[data.draw(st.sampled_from([-1, 0, 1, 2])) for _ in range(n)] for _ in range(B)]
    dead_slot = [[data.draw(st.booleans()) and data.draw(st.booleans()) for _ in range(n)] for _ in range(B)]
    ts = [[-1 if dead_slot[b][j] or pos[b][j] < 0 else blocks[b] * ring + pos[b][j] % ring for j in range(n)]
          for b in range(B)]
    live = [(b, j) for b in range(B) for j in range(n) if pos[b][j] >= 0 and ts[b][j] >= 0]
    written = [loc[b][j] for b, j in live if pos[b][j] % P == P - 1 and loc[b][j] >= 0]
    users = {}
    for b, _ in live:
        users.setdefault(blocks[b], set()).add(b)
    expect = ("^slot_mapping" if len(set(written)) < len(written)
              else "^tail_slot_mapping" if any(len(rows) > 1 for rows in users.values()) else None)
    tensors = [torch.tensor(x, dtype=torch.int64) for x in (ts, loc, pos)]
    with pytest.raises(ValueError, match=expect) if expect else contextlib.nullcontext():
        check_index_ranges([], distinct=_step_writes(*tensors, P, ring))
