"""Tail-ring seeding: ``kpool_seed_tail_cache`` (token-granular tail slots) and
``kpool.ops.tail.seed_requests`` (one row of metadata per request).

The ring is pre-filled with random bf16 (or a sentinel) and the WHOLE underlying buffer
(padding between heads / blocks included) is compared byte for byte with independent
per-token / per-request Python loops written here, under both backends (torch reference
and the Triton kernels). SPEC §6 traps are named in test names.
"""

from __future__ import annotations

import contextlib
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _util import TAIL_OVERLAP_CASES, assert_bytes_equal, make_tail, strided_copy, view_tail
from kpool import kpool_seed_tail_cache
from kpool.ops.tail import seed_requests

D = 128


# --------------------------------------------------------------------------- buffers / oracles

def rows_view(x, device, pad=0):
    """``x [n, 128]`` on ``device``, as a view with row stride ``128 + pad`` when ``pad``."""
    if not pad:
        return x.to(device)
    buf = torch.zeros((x.shape[0], D + pad), dtype=x.dtype)
    buf[:, :D] = x
    return buf.to(device)[:, :D]


def oracle_seed(tail, key, gate, tslot, kpool):
    """Each block's last ``kpool`` rows with a valid tail slot ``t`` (scanning from the end of
    the batch) are copied to block ``t // RING``, ring slot ``t % RING``."""
    ring = tail.shape[2]
    n_ts = tail.shape[0] * ring
    ts = [int(v) for v in tslot.tolist()]
    taken = {}
    for i in reversed(range(len(ts))):
        t = ts[i]
        if not 0 <= t < n_ts:
            continue
        taken[t // ring] = taken.get(t // ring, 0) + 1
        if taken[t // ring] > kpool:
            continue
        tail[t // ring, 0, t % ring] = key[i]
        tail[t // ring, 1, t % ring] = gate[i]


def oracle_seed_row_rule(tail, key, gate, tslot, kpool):
    """The seed's rule: token ``i`` is copied unless token ``i + kpool`` has a valid slot in the
    same block (equal to ``oracle_seed`` when no padding sits inside a request)."""
    ring = tail.shape[2]
    n_ts = tail.shape[0] * ring
    ts = [int(v) for v in tslot.tolist()]
    for i, t in enumerate(ts):
        if not 0 <= t < n_ts:
            continue
        if i + kpool < len(ts) and 0 <= ts[i + kpool] < n_ts and ts[i + kpool] // ring == t // ring:
            continue
        tail[t // ring, 0, t % ring] = key[i]
        tail[t // ring, 1, t % ring] = gate[i]


def oracle_seed_requests(tail, key, gate, meta):
    """Per request row ``(end_row, end_pos, block, n_keep)``: rows ``end_row - n_keep + j`` go
    to ring slot ``(end_pos - n_keep + j) % RING`` of ``block``; ``block < 0`` skips."""
    ring = tail.shape[2]
    for end_row, end_pos, block, n_keep in meta.tolist():
        if block < 0:
            continue
        for j in range(n_keep):
            tail[block, 0, (end_pos - n_keep + j) % ring] = key[end_row - n_keep + j]
            tail[block, 1, (end_pos - n_keep + j) % ring] = gate[end_row - n_keep + j]


class Batch:
    """A prefill batch: requests ``(block, start_pos, length)`` laid out back to back, with
    padding rows (tail slot -1) inserted before the real tokens numbered in ``pad_before``
    (counting real tokens from 0; ``n_tokens`` puts a row at the end)."""

    def __init__(self, requests, ring, seed, pad_before=(), n_pad_end=0):
        g = torch.Generator().manual_seed(seed)
        self.requests, self.ring = requests, ring
        ts, self.rows = [], []  # rows[r] = the batch rows of request r, in position order
        pad_before = sorted(pad_before)  # padding rows go before the k-th real token
        k = 0
        for block, start, length in requests:
            rr = []
            for j in range(length):
                while pad_before and pad_before[0] == k:
                    ts.append(-1)
                    pad_before.pop(0)
                k += 1
                rr.append(len(ts))
                ts.append(block * ring + (start + j) % ring)
            self.rows.append(rr)
        ts += [-1] * (n_pad_end + len(pad_before))
        self.tslot = torch.tensor(ts, dtype=torch.int64)
        n = len(ts)
        self.key = (torch.randn((n, D), generator=g)).to(torch.bfloat16)
        self.gate = (torch.randn((n, D), generator=g) * 2).to(torch.bfloat16)

    def last_tokens(self, r, k):
        """``(rows, positions)`` of request ``r``'s last ``k`` tokens."""
        block, start, length = self.requests[r]
        k = min(k, length)
        return self.rows[r][length - k:], list(range(start + length - k, start + length))


def run_seed(tail_base, geom, batch, P, device, idx_dtype=torch.int64, row_pad=0):
    tail = view_tail(tail_base, *geom)
    kpool_seed_tail_cache(tail, rows_view(batch.key, device, row_pad), rows_view(batch.gate, device, row_pad),
                          batch.tslot.to(idx_dtype).to(device), P)


def check_seed(batch, P, ring, device, num_blocks, block_pad=0, head_pad=0, idx_dtype=torch.int64, row_pad=0,
               seed=0):
    """Run the op and the oracle from the same random ring; compare whole buffers. Returns
    ``(before, after)`` base buffers."""
    geom = (num_blocks, ring, block_pad, head_pad)
    before, _ = make_tail(num_blocks, ring, device, seed, block_pad, head_pad)
    got, want = before.clone(), before.clone()
    run_seed(got, geom, batch, P, device, idx_dtype, row_pad)
    oracle_seed(view_tail(want, *geom), batch.key.to(device), batch.gate.to(device), batch.tslot, P)
    assert_bytes_equal(got, want, "tail ring (whole buffer)")
    return before, got


# --------------------------------------------------------------------------- kpool_seed_tail_cache

# (id, P, ring/P, block_pad, head_pad, idx dtype, key row pad, requests as (length, start))
SEED_CASES = [
    ("P4-R4", 4, 1, 0, 0, torch.int64, 0, [(7, 0), (2, 5), (4, 0), (13, 3)]),
    ("P4-R8-padded-int32", 4, 2, 256, 0, torch.int32, 0, [(9, 0), (1, 0), (3, 6), (12, 17)]),
    ("P16-R16-padded-heads-strided-rows", 16, 1, 64, 128, torch.int64, 128, [(40, 0), (5, 11), (16, 16)]),
    ("P16-R32-int32", 16, 2, 0, 0, torch.int32, 0, [(33, 0), (18, 30), (2, 0), (70, 5)]),
]


@pytest.mark.parametrize("case", SEED_CASES, ids=[c[0] for c in SEED_CASES])
def test_seed_matches_oracle(case, backend, device):
    """Several requests of lengths below, at and above P (and RING), at random starting
    positions, padding after the last request: whole ring buffer equals the oracle."""
    _, P, rmul, bpad, hpad, idt, rpad, reqs = case
    ring = P * rmul
    rng = random.Random(P + rmul)
    blocks = rng.sample(range(len(reqs) + 2), len(reqs))
    batch = Batch([(b, s, n) for b, (n, s) in zip(blocks, reqs)], ring, seed=1, n_pad_end=5)
    check_seed(batch, P, ring, device, len(reqs) + 2, bpad, hpad, idt, rpad)


def test_seed_every_request_tail(backend, device):
    """Every request's trailing min(len, P) tokens land in its ring (slot pos % RING), not
    only the batch's last P tokens (trap: PD transfer and decode need every request's tail).
    The last request is shorter than P, so the batch's last P rows span two requests."""
    P, ring = 4, 8
    reqs = [(2, 0, 11), (0, 3, 6), (5, 0, 1), (1, 9, 4), (4, 2, 2)]
    batch = Batch(reqs, ring, seed=2)
    _, got = check_seed(batch, P, ring, device, 6)
    tail = view_tail(got, 6, ring)
    for r, (block, _, _) in enumerate(reqs):
        rows, positions = batch.last_tokens(r, P)
        for row, pos in zip(rows, positions):
            assert torch.equal(tail[block, 0, pos % ring].cpu(), batch.key[row]), f"request {r} pos {pos} key"
            assert torch.equal(tail[block, 1, pos % ring].cpu(), batch.gate[row]), f"request {r} pos {pos} gate"


@pytest.mark.parametrize("pads", [(2 * 4 * D + 256, 0), (2 * 4 * D + 256, 64)], ids=["block-pad", "block-and-head-pad"])
def test_seed_padded_tail_stride_dense_location_untouched(pads, backend, device):
    """Upstream bug (PR #57477): a seed addressing blocks with the dense stride 2*RING*128
    instead of ``stride(0)``. The ring is a view with padded block (and head) strides over
    a buffer of sentinels (-123); seeding block 1 writes exactly its own rows: every other
    element, the dense-stride location of block 1 (inside block 0's padding) included,
    stays -123."""
    P, ring = 4, 4
    block_pad, head_pad = pads
    batch = Batch([(1, 0, 6)], ring, seed=3, n_pad_end=2)
    base, tail = make_tail(3, ring, device, 0, block_pad, head_pad, fill=-123.0)
    run_seed(base, (3, ring, block_pad, head_pad), batch, P, device)
    expect = torch.full_like(base, -123.0)
    oracle_seed(view_tail(expect, 3, ring, block_pad, head_pad), batch.key.to(device), batch.gate.to(device),
                batch.tslot, P)
    assert_bytes_equal(base, expect, "tail buffer")
    dense = view_tail(base, 3, ring, block_pad, head_pad).storage_offset() + 1 * 2 * ring * D  # block 1, dense stride
    assert (base[dense:dense + 2 * ring * D] == -123).all(), "dense-stride location of block 1 was written"
    rows, positions = batch.last_tokens(0, P)
    assert torch.equal(tail[1, 0, [p % ring for p in positions]].cpu(), batch.key[rows])
    assert torch.equal(tail[1, 1, [p % ring for p in positions]].cpu(), batch.gate[rows])


def test_seed_ring_larger_than_pool(backend, device):
    """RING = 2P: a request of 2P+3 tokens in one block seeds only its last P tokens (the
    earlier tokens of its block are skipped), at slots pos % RING; the
    other P ring slots keep their bytes."""
    P, ring = 4, 8
    batch = Batch([(0, 5, 2 * P + 3), (2, 1, 3)], ring, seed=4)
    before, got = check_seed(batch, P, ring, device, 3)
    t0, t1 = view_tail(before, 3, ring), view_tail(got, 3, ring)
    _, positions = batch.last_tokens(0, P)
    seeded = {p % ring for p in positions}
    for s in range(ring):
        if s in seeded:
            continue
        assert torch.equal(t1[0, :, s].cpu(), t0[0, :, s].cpu()), f"slot {s} (not among the last P) changed"


@pytest.mark.parametrize("where", ["start", "middle", "end", "between-requests"])
def test_seed_tslot_padding(where, backend, device):
    """-1 tail slots (padding) at the start, in the middle of a request, at the end and
    between requests never form an address; each request's last P valid tokens are seeded."""
    P, ring = 4, 4
    pad_before, n_end = {"start": ([0, 0], 0), "middle": ([3, 5], 0), "end": ([], 4),
                         "between-requests": ([6, 6, 6], 1)}[where]
    batch = Batch([(0, 0, 6), (2, 3, 5)], ring, seed=5, pad_before=pad_before, n_pad_end=n_end)
    assert (batch.tslot < 0).sum() == len(pad_before) + n_end
    check_seed(batch, P, ring, device, 3)


@pytest.mark.parametrize("seed", range(4))
def test_seed_rule_equals_row_rule_without_interior_padding(seed):
    """Without padding inside a request, "each block's last P valid rows" is the seed's rule
    "row i + P is in another block" (so the seed-compatible function keeps the seed's bytes)."""
    P, ring = 4, 8
    batch = Batch([(0, 3, 9), (2, 0, 2), (1, 5, 14)], ring, seed=seed, pad_before=[9, 11], n_pad_end=2)
    a = torch.zeros(3, 2, ring, 128, dtype=torch.bfloat16)
    b = a.clone()
    oracle_seed(a, batch.key, batch.gate, batch.tslot, P)
    oracle_seed_row_rule(b, batch.key, batch.gate, batch.tslot, P)
    assert torch.equal(a, b)


def test_seed_request_across_program_boundary(backend, device):
    """Rows are handled 64 per program: requests straddling rows 64 and 128, whose
    look-ahead rows live in the next program, are seeded exactly as the per-token rule says."""
    P, ring = 16, 32
    reqs = [(3, 0, 60), (0, 7, 13), (1, 0, 57), (2, 4, 3)]  # rows 0-59, 60-72, 73-129, 130-132
    batch = Batch(reqs, ring, seed=6)
    assert batch.tslot.numel() > 128
    _, got = check_seed(batch, P, ring, device, 5)
    tail = view_tail(got, 5, ring)
    for r, (block, _, _) in enumerate(reqs):
        rows, positions = batch.last_tokens(r, P)
        assert torch.equal(tail[block, 0, [p % ring for p in positions]].cpu(), batch.key[rows])


def valid_rule_rows(tslot: list[int], kpool: int, ring: int, n_ts: int) -> list[int]:
    """The rows the rule copies: on the valid rows in order, whatever their blocks, the r-th
    valid row is copied unless the (r + kpool)-th valid row is in the same block."""
    valid = [i for i, t in enumerate(tslot) if 0 <= t < n_ts]
    return [i for r, i in enumerate(valid)
            if not (r + kpool < len(valid) and tslot[valid[r + kpool]] // ring == tslot[i] // ring)]


def oracle_seed_valid_rule(tail, key, gate, tslot, kpool):
    """``valid_rule_rows`` copied to their ring slots."""
    ring = tail.shape[2]
    ts = tslot.tolist()
    for i in valid_rule_rows(ts, kpool, ring, tail.shape[0] * ring):
        t = ts[i]
        tail[t // ring, 0, t % ring] = key[i]
        tail[t // ring, 1, t % ring] = gate[i]


@pytest.mark.parametrize("seed", range(3))
def test_seed_interleaved_blocks_follow_the_valid_row_rule(seed, backend, device):
    """Blocks that recur non-contiguously (A A B A C B ...) with padding between rows, over
    several programs: row r is compared with the (r + kpool)-th valid row, not with "its
    block's last kpool rows". Every (block, slot) is used once, so the bytes are defined."""
    P, ring, nb = 4, 64, 5
    g = torch.Generator().manual_seed(seed)
    used = [0] * nb
    ts = []
    while len(ts) < 300:
        if torch.rand((), generator=g) < 0.15:
            ts.append(-1)
            continue
        b = int(torch.randint(nb, (), generator=g))
        if used[b] < ring:
            ts.append(b * ring + used[b])
            used[b] += 1
    tslot = torch.tensor(ts, dtype=torch.int64)
    key = torch.randn((len(ts), D), generator=g).to(torch.bfloat16)
    gate = torch.randn((len(ts), D), generator=g).to(torch.bfloat16)
    base, tail = make_tail(nb, ring, device, seed)
    want = base.clone()
    kpool_seed_tail_cache(tail, key.to(device), gate.to(device), tslot.to(device), P)
    oracle_seed_valid_rule(view_tail(want, nb, ring), key.to(device), gate.to(device), tslot, P)
    assert_bytes_equal(base, want, "tail ring (whole buffer)")


@pytest.mark.parametrize("P,ring", [(4, 8), (80, 160)], ids=["P4", "P80-look-ahead-beyond-own-rows"])
def test_seed_long_padding_runs(P, ring, backend, device):
    """Padding runs longer than a program's window (512 rows): at the start, inside a
    request (its last P valid rows straddle 1,300 padding rows) and at the end, so the
    look-ahead reads several further windows or reaches the end of the batch; P = 80
    looks further ahead than a program's 64 rows."""
    reqs = [(1, 0, 150), (0, 3, 2 * P + 5), (2, 7, 3)]
    mid = 150 + P + 2  # inside request 1, fewer than P valid rows before its end
    batch = Batch(reqs, ring, seed=P, pad_before=[0] * 700 + [mid] * 1300, n_pad_end=1200)
    check_seed(batch, P, ring, device, 3)


def test_seed_empty(backend, device):
    base, tail = make_tail(2, 4, device, 7)
    before = base.clone()
    e = torch.zeros((0, D), dtype=torch.bfloat16, device=device)
    kpool_seed_tail_cache(tail, e, e, torch.zeros(0, dtype=torch.int64, device=device), 4)
    assert_bytes_equal(base, before, "tail")


def test_seed_unchecked_out_of_range_tslot_writes_nothing(backend, device, monkeypatch):
    """With KPOOL_CHECK=0 (no host range check) a tail slot past the buffer is skipped."""
    monkeypatch.setenv("KPOOL_CHECK", "0")
    P, ring = 4, 4
    batch = Batch([(0, 0, 3), (1, 2, 2)], ring, seed=8)
    batch.tslot[1] = 2 * ring + 1  # one block past the end
    check_seed(batch, P, ring, device, 2, block_pad=64)


def test_seed_determinism(backend, device):
    P, ring = 16, 32
    batch = Batch([(0, 3, 40), (2, 0, 9)], ring, seed=9, n_pad_end=3)
    outs = []
    for _ in range(2):
        base, _ = make_tail(3, ring, device, 10, 64)
        run_seed(base, (3, ring, 64, 0), batch, P, device)
        outs.append(base)
    assert_bytes_equal(outs[0], outs[1], "run 1 vs run 2")


# --------------------------------------------------------------------------- seed_requests

# (id, P/keep, ring, block_pad, head_pad, meta rows as (request rows start, length, end_pos, block, n_keep))
META_CASES = [
    ("basic", 4, 4, 0, 0, [(0, 6, 6, 1, 4), (6, 3, 11, 0, 3)]),
    ("skip-block-neg-and-n_keep-0", 4, 8, 0, 0, [(0, 5, 5, -1, 4), (5, 4, 9, 2, 0), (9, 7, 7, 1, 4)]),
    ("ring-wraparound", 4, 8, 0, 0, [(0, 10, 18, 0, 4), (10, 3, 9, 2, 3)]),
    ("keep-not-pow2-padded", 5, 10, 256, 128, [(0, 12, 23, 1, 5), (12, 2, 2, 0, 2), (14, 9, 40, 3, 5)]),
    ("P16-R32", 16, 32, 64, 0, [(0, 40, 45, 2, 16), (40, 7, 7, 0, 7), (47, 20, 64, 1, 16)]),
]


@pytest.mark.parametrize("case", META_CASES, ids=[c[0] for c in META_CASES])
def test_seed_requests_meta(case, backend, device):
    """``seed_requests`` rows ``(end_row, end_pos, block, n_keep)``: ``block < 0`` and
    ``n_keep = 0`` skip, ``n_keep < keep``, keep not a power of two, ring wrap-around,
    padded strides; whole buffer equals the per-request loop."""
    _, keep, ring, bpad, hpad, reqs = case
    n_rows = max(r0 + n for r0, n, *_ in reqs) + 3
    g = torch.Generator().manual_seed(11)
    key = (torch.randn((n_rows, D), generator=g)).to(torch.bfloat16).to(device)
    gate = (torch.randn((n_rows, D), generator=g) * 2).to(torch.bfloat16).to(device)
    meta = torch.tensor([(r0 + n, end_pos, block, n_keep) for r0, n, end_pos, block, n_keep in reqs],
                        dtype=torch.int64, device=device)
    nb = 4
    base, tail = make_tail(nb, ring, device, 12, bpad, hpad)
    want = base.clone()
    seed_requests(tail, key, gate, meta, keep)
    oracle_seed_requests(view_tail(want, nb, ring, bpad, hpad), key, gate, meta)
    assert_bytes_equal(base, want, "tail ring (whole buffer)")
    assert not torch.equal(base, make_tail(nb, ring, device, 12, bpad, hpad)[0]), "nothing was seeded"


def test_seed_requests_empty(backend, device):
    base, tail = make_tail(2, 4, device, 13)
    before = base.clone()
    key = torch.zeros((3, D), dtype=torch.bfloat16, device=device)
    seed_requests(tail, key, key, torch.zeros((0, 4), dtype=torch.int64, device=device), 4)
    assert_bytes_equal(base, before, "tail")


# --------------------------------------------------------------------------- validation

def _valid(device, ring=8, n=5):
    tail = torch.zeros((3, 2, ring, D), dtype=torch.bfloat16, device=device)
    key = torch.zeros((n, D), dtype=torch.bfloat16, device=device)
    tslot = torch.tensor([0, 1, 2, -1, 9][:n], device=device)
    return dict(tail_kv_cache=tail, key=key, gate_score=key.clone(), tslot=tslot, kpool=4)


def _bf16(shape, dv):
    return torch.zeros(shape, dtype=torch.bfloat16, device=dv)


SEED_BAD = [
    ("key-dtype", lambda a, dv: {"key": a["key"].float()}, TypeError, "key"),
    ("gate_score-dtype", lambda a, dv: {"gate_score": a["gate_score"].half()}, TypeError, "gate_score"),
    ("tslot-dtype", lambda a, dv: {"tslot": a["tslot"].float()}, TypeError, "tslot"),
    ("tail-dtype", lambda a, dv: {"tail_kv_cache": a["tail_kv_cache"].float()}, TypeError, "tail_kv_cache"),
    ("key-rank", lambda a, dv: {"key": a["key"][0]}, ValueError, "key"),
    ("key-headdim", lambda a, dv: {"key": a["key"][:, :64], "gate_score": a["gate_score"][:, :64]},
     ValueError, "key"),
    ("gate_score-shape", lambda a, dv: {"gate_score": a["gate_score"][:4]}, ValueError, "gate_score"),
    ("tslot-shape", lambda a, dv: {"tslot": a["tslot"][:4]}, ValueError, "tslot"),
    ("tslot-rank", lambda a, dv: {"tslot": a["tslot"][None]}, ValueError, "tslot"),
    ("tail-rank", lambda a, dv: {"tail_kv_cache": a["tail_kv_cache"][0]}, ValueError, "tail_kv_cache"),
    ("tail-heads", lambda a, dv: {"tail_kv_cache": _bf16((3, 1, 8, D), dv)}, ValueError, "tail_kv_cache"),
    ("tail-dim", lambda a, dv: {"tail_kv_cache": _bf16((3, 2, 8, 64), dv)}, ValueError, "tail_kv_cache"),
    ("ring-not-multiple-of-P", lambda a, dv: {"tail_kv_cache": _bf16((3, 2, 6, D), dv)}, ValueError, "ring"),
    ("ring-smaller-than-P", lambda a, dv: {"kpool": 16}, ValueError, "ring"),
    ("tail-inner-stride", lambda a, dv: {"tail_kv_cache": strided_copy(a["tail_kv_cache"])}, ValueError,
     "tail_kv_cache"),
    ("tail-row-stride", lambda a, dv: {"tail_kv_cache": strided_copy(a["tail_kv_cache"], 2)}, ValueError,
     "tail_kv_cache"),
    *TAIL_OVERLAP_CASES,
    ("key-inner-stride", lambda a, dv: {"key": strided_copy(a["key"])}, ValueError, "key"),
    ("gate_score-inner-stride", lambda a, dv: {"gate_score": strided_copy(a["gate_score"])}, ValueError, "gate_score"),
    ("gate_score-device", lambda a, dv: {"gate_score": a["gate_score"].to("meta")}, ValueError, "gate_score"),
    ("tslot-device", lambda a, dv: {"tslot": a["tslot"].to("meta")}, ValueError, "tslot"),
    ("tail-device", lambda a, dv: {"tail_kv_cache": a["tail_kv_cache"].to("meta")}, ValueError, "tail_kv_cache"),
    ("tslot-out-of-range", lambda a, dv: {"tslot": torch.tensor([0, 1, 2, -1, 24], device=dv)}, ValueError,
     "tslot"),
    # rows 1 and 4 (valid ranks 1 and 3) both seeded into slot 9: two programs, one slot
    ("tslot-repeat", lambda a, dv: {"tslot": torch.tensor([0, 9, 2, -1, 9], device=dv)}, ValueError,
     r"^tslot: ring slots seeded repeat: \[9\]"),
    ("head_dim", lambda a, dv: {"head_dim": 64}, ValueError, "head_dim"),
    ("kpool", lambda a, dv: {"kpool": 0}, ValueError, r"^kpool must be a positive int"),
]


@pytest.mark.parametrize("bad", SEED_BAD, ids=[b[0] for b in SEED_BAD])
def test_seed_rejects(bad, backend, device):
    """Invalid arguments raise an error naming the argument, and nothing is written."""
    _, mutate, exc, match = bad
    args = _valid(device)
    args.update(mutate(args, device))
    keep = args["tail_kv_cache"].clone() if args["tail_kv_cache"].device.type != "meta" else None
    with pytest.raises(exc, match=match):
        kpool_seed_tail_cache(**args)
    if keep is not None:
        assert_bytes_equal(args["tail_kv_cache"], keep, "tail after a rejected call")


def test_seed_valid_args_accepted(backend, device):
    """The base of the rejection cases is itself valid (each case fails for its own reason)."""
    args = _valid(device)
    args["key"] = torch.ones_like(args["key"])
    kpool_seed_tail_cache(**args)
    assert args["tail_kv_cache"][1, 0, 1].eq(1).all()  # tslot 9 = block 1, slot 1 (last row of the batch)
    # a request longer than its ring (RING = P = 4) repeats slots, but only its last P are seeded
    base, tail = make_tail(2, 4, device, seed=5)
    want = base.clone()
    key = torch.randn((7, D), generator=torch.Generator().manual_seed(6)).bfloat16().to(device)
    tslot = torch.tensor([0, 1, 2, -1, 3, 0, 1], device=device)
    kpool_seed_tail_cache(tail, key, key.flip(1), tslot, 4)
    oracle_seed(view_tail(want, 2, 4), key, key.flip(1), tslot, 4)
    assert_bytes_equal(base, want, "tail ring after a wrapped request (whole buffer)")
    assert_bytes_equal(tail[0, 0], key[[5, 6, 2, 4]], "block 0's keys: the request's last 4 tokens")


# --------------------------------------------------------------------------- property test

@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_random_prefill_batches(data, backend, device):
    """Random batches: 1-5 requests of random lengths at random starting positions in
    distinct blocks, padding rows before, between and after requests, P in {4, 16}, RING
    in {P, 2P}, padded strides. The whole ring equals the per-token oracle, every request's
    last min(len, P) tokens are in its ring, and ``seed_requests`` with ``n_keep = min(len, P)``
    gives the same bytes. (Padding INSIDE a request: see ``test_seed_padding_inside_a_long_request``.)"""
    P = data.draw(st.sampled_from([4, 16]), label="P")
    ring = P * data.draw(st.sampled_from([1, 2]), label="ring/P")
    n_req = data.draw(st.integers(1, 5), label="requests")
    nb = n_req + data.draw(st.integers(0, 2), label="spare blocks")
    blocks = data.draw(st.permutations(range(nb)), label="blocks")[:n_req]
    reqs = [(b, data.draw(st.integers(0, 3 * ring)), data.draw(st.integers(1, 2 * P + 3))) for b in blocks]
    bounds = [sum(n for *_, n in reqs[:r]) for r in range(n_req + 1)]
    pad_before = data.draw(st.lists(st.sampled_from(bounds), max_size=4), label="padding before token")
    pads = data.draw(st.tuples(st.sampled_from([0, 64, 256]), st.sampled_from([0, 128])), label="pads")
    idt = data.draw(st.sampled_from([torch.int32, torch.int64]), label="tslot dtype")
    batch = Batch(reqs, ring, seed=data.draw(st.integers(0, 2**20)), pad_before=pad_before,
                  n_pad_end=data.draw(st.integers(0, 3)))
    before, got = check_seed(batch, P, ring, device, nb, *pads, idx_dtype=idt, seed=len(reqs))
    tail = view_tail(got, nb, ring, *pads)
    for r, (block, _, _) in enumerate(reqs):
        rows, positions = batch.last_tokens(r, P)
        assert torch.equal(tail[block, 0, [p % ring for p in positions]].cpu(), batch.key[rows])
    meta = torch.tensor([(rr[-1] + 1, s + n, b, min(n, P)) for (b, s, n), rr in zip(reqs, batch.rows)],
                        dtype=torch.int64, device=device)
    other = before.clone()
    seed_requests(view_tail(other, nb, ring, *pads), batch.key.to(device), batch.gate.to(device), meta, P)
    assert_bytes_equal(other, got, "seed_requests vs kpool_seed_tail_cache")


def test_seed_padding_inside_a_long_request(backend, device):
    """A request of 24 tokens (P = RING = 16) with one padding row before its last token:
    its last 16 valid tokens (positions 8..23) must be in the ring and nothing else of it."""
    P, ring = 16, 16
    batch = Batch([(0, 0, 4), (1, 0, 24), (2, 0, 4)], ring, seed=6, pad_before=[27])
    before = make_tail(3, ring, device, 0)[0]
    got = before.clone()
    run_seed(got, (3, ring), batch, P, device)
    want = before.clone()
    tail = view_tail(want, 3, ring)
    for r, (block, _, _) in enumerate(batch.requests):
        rows, positions = batch.last_tokens(r, P)
        tail[block, 0, [p % ring for p in positions]] = batch.key[rows].to(device)
        tail[block, 1, [p % ring for p in positions]] = batch.gate[rows].to(device)
    assert_bytes_equal(got, want, "tail ring (whole buffer)")


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(ring=st.sampled_from([4, 8]), kpool=st.sampled_from([1, 2, 4]),
       tslot=st.lists(st.integers(-1, 2 * 8 - 1), max_size=24))
def test_seed_repeat_check_matches_the_rule(ring, kpool, tslot):
    """A call raises exactly when two rows the seed's rule copies share a ring slot (random
    slots, padding anywhere, blocks interleaved); the copied rows are the rule's."""
    from kpool.ops.tail import _seeded
    tslot = [t if t < 2 * ring else t % (2 * ring) for t in tslot]
    t = torch.tensor(tslot, dtype=torch.int64)
    rows = valid_rule_rows(tslot, kpool, ring, 2 * ring)
    assert _seeded(t, kpool, ring).nonzero().flatten().tolist() == rows
    slots = [tslot[i] for i in rows]
    tail = torch.zeros((2, 2, ring, D), dtype=torch.bfloat16)
    key = torch.zeros((len(tslot), D), dtype=torch.bfloat16)
    repeat = len(set(slots)) < len(slots)
    with pytest.raises(ValueError, match="^tslot: ring slots seeded repeat") if repeat else contextlib.nullcontext():
        kpool_seed_tail_cache(tail, key, key, t, kpool)
