"""``write_prefill`` and ``prefill_plan`` called directly (an engine's prefill path).

The bytes they write are checked against ``KPoolCache`` in ``test_cache.py``
(``test_prefill_plan_writes_another_layer``); here: every table entry that would read or write
outside what the call owns raises ``ValueError`` naming the table and changes nothing, and
``prefill_plan`` rejects inconsistent per-request state.
"""

from __future__ import annotations

import pytest
import torch

from kpool import prefill_plan, reference, write_prefill
from kpool.layout import entry_byte_offsets, flat_bytes, ring_size

from _util import assert_bytes_equal, random_bytes_like, spy_launches

P, PAGE, D = 4, 16, 128
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _batch():
    """Request 0: 9 new tokens (pools 0, 1 inside, 1 seeded); request 1: 7 tokens from position
    3 (head pool 0 from the ring, pool 1 inside, 2 seeded). Random bytes everywhere."""
    g = torch.Generator().manual_seed(3)
    ring = ring_size(P, 1)
    kv = random_bytes_like((3, PAGE, D + 4), DEVICE, 4)
    tail = random_bytes_like((2, 2, ring, D * 2), DEVICE, 5).view(torch.bfloat16)
    key = torch.randn(16, D, generator=g).to(torch.bfloat16).to(DEVICE)
    gate = torch.randn(16, D, generator=g).to(torch.bfloat16).to(DEVICE)
    ape = (torch.randn(P, D, generator=g) * 0.5).to(DEVICE)
    plan = prefill_plan([0, 9, 16], [0, 3], [1, 0], [[2, -1], [0, -1]], P, PAGE, ring)
    assert plan.requests[1, 6] == 3 and plan.pools.shape[0] == 3  # the head pool reads 3 ring slots
    return kv, tail, key, gate, ape, plan


def test_plan_writes(backend):
    """The plan's pools (head pool included) and nothing else change; the same bytes as the
    reference on a CPU copy."""
    kv, tail, key, gate, ape, plan = _batch()
    kv_ref, tail_ref = kv.cpu().clone(), tail.cpu().clone()
    reference.write_prefill(kv_ref, tail_ref, key.cpu(), gate.cpu(), ape.cpu(), plan.pools, plan.requests, P,
                            torch.float8_e4m3fn, "plain")
    before = flat_bytes(kv).clone()
    write_prefill(kv, tail, key, gate, ape, plan.pools.to(DEVICE), plan.requests.to(DEVICE), P, layout="plain",
                  fp8_dtype=torch.float8_e4m3fn)
    assert_bytes_equal(kv.cpu(), kv_ref, "kv_cache")
    assert_bytes_equal(tail.cpu(), tail_ref, "tail")
    changed = set((flat_bytes(kv) != before).nonzero().flatten().tolist())
    codes, scales = entry_byte_offsets(kv, plan.pool_locs.to(DEVICE), "plain")
    assert changed <= set(codes.flatten().tolist() + scales.flatten().tolist())
    assert sorted(plan.pool_locs.tolist()) == [0, 1, 2 * PAGE, 2 * PAGE + 1]


@pytest.mark.parametrize("n_pools", [1, 2, 3])
def test_ragged_pool_grids(n_pools, monkeypatch):
    """Pool programs of up to 2 pools (as on a GPU at P=4): a ragged grid's last program reads
    the last 2 pools of the table and writes only its own; the reference's bytes either way."""
    from kpool.ops import compress, prefill
    monkeypatch.setenv("KPOOL_BACKEND", "triton")
    monkeypatch.setattr(compress, "INTERPRETER_BLOCK_POOLS", 2)
    tiles = spy_launches(monkeypatch, prefill, "_prefill_kernel", "BN")
    kv, tail, key, gate, ape, plan = _batch()
    pools = plan.pools[:n_pools]  # pools are independent programs: a shorter table writes fewer
    kv_ref, tail_ref = kv.cpu().clone(), tail.cpu().clone()
    reference.write_prefill(kv_ref, tail_ref, key.cpu(), gate.cpu(), ape.cpu(), pools, plan.requests, P,
                            torch.float8_e4m3fn, "plain")
    write_prefill(kv, tail, key, gate, ape, pools.to(DEVICE), plan.requests.to(DEVICE), P, layout="plain",
                  fp8_dtype=torch.float8_e4m3fn)
    assert tiles == [min(n_pools, 2)]
    assert_bytes_equal(kv.cpu(), kv_ref, f"kv_cache ({n_pools} pools)")
    assert_bytes_equal(tail.cpu(), tail_ref, "tail")


BAD = [  # (table, row, column, value, message)
    ("pools", 0, 0, -1, "reads token rows"),
    ("pools", 2, 0, 13, "reads token rows"),  # rows 13..16 of 16
    ("pools", 1, 1, 3 * PAGE, "writes a slot outside"),
    ("requests", 0, 3, P + 1, "n_keep outside"),
    ("requests", 0, 3, -1, "n_keep outside"),
    ("requests", 1, 0, 17, "seeds rows"),
    ("requests", 0, 0, 0, "seeds rows"),  # rows end_row - n_keep < 0
    ("requests", 1, 1, 1, "seeds rows"),  # positions end_pos - n_keep < 0
    ("requests", 0, 2, 2, "ring block outside"),
    ("requests", 1, 6, P, "ring slots outside"),
    ("requests", 1, 6, -2, "ring slots outside"),
    ("requests", 1, 2, -1, "no ring block"),  # a head pool reads block -1
    ("requests", 1, 4, 13, "completes a head pool"),
    ("requests", 1, 4, -4, "completes a head pool"),
    ("requests", 1, 5, -1, "completes a head pool"),
    ("requests", 1, 7, 3 * PAGE, "writes a head pool outside"),
]


def _rejected(edit, message):
    """``_batch``'s tables after ``edit(tables)`` (``{"pools": .., "requests": ..}``, copies):
    ``write_prefill`` raises ``message`` and changes no byte of ``kv_cache`` / ``tail``."""
    kv, tail, key, gate, ape, plan = _batch()
    tables = {"pools": plan.pools.clone(), "requests": plan.requests.clone()}
    edit(tables)
    kv0, tail0 = kv.clone(), tail.clone()
    with pytest.raises(ValueError, match=message):
        write_prefill(kv, tail, key, gate, ape, tables["pools"].to(DEVICE), tables["requests"].to(DEVICE), P,
                      layout="plain", fp8_dtype=torch.float8_e4m3fn)
    assert_bytes_equal(kv, kv0, "kv_cache")
    assert_bytes_equal(tail, tail0, "tail")


@pytest.mark.parametrize("table, row, col, value, message", BAD)
def test_bad_tables_raise_and_write_nothing(backend, table, row, col, value, message):
    def edit(tables):
        tables[table][row, col] = value
    _rejected(edit, f"{table} row {row} .*{message}|{table} row {row} {message}")


def test_argument_errors():
    kv, tail, key, gate, ape, plan = _batch()
    pools, requests = plan.pools.to(DEVICE), plan.requests.to(DEVICE)
    args = dict(kv_cache=kv, tail=tail, key=key, gate=gate, ape=ape, pools=pools, requests=requests, pool_size=P)
    for name, value, exc, message in (
            ("pools", pools.to(torch.int32), TypeError, "pools must have dtype torch.int64"),
            ("requests", requests[:, :4], ValueError, r"requests must have shape \[\*, 8\]"),
            ("requests", requests.t().contiguous().t(), ValueError, "requests must be contiguous"),
            ("gate", gate[:-1], ValueError, "gate must have shape"),
            ("ape", ape[:2], ValueError, "ape must have shape"),
            ("tail", tail[:, :, :2], ValueError, "tail ring size"),
            ("pool_size", 0, ValueError, "pool_size")):
        with pytest.raises(exc, match=message):
            write_prefill(**dict(args, **{name: value}), layout="plain")


def test_plan_rejects_inconsistent_state():
    ring = ring_size(P, 0)
    with pytest.raises(ValueError, match="page_table row 0 has no page 1"):
        prefill_plan([0, 80], [0], [0], [[3, -1]], P, PAGE, ring)  # pools 16..19 need page 1
    with pytest.raises(ValueError, match="page_table has 1 pages per row"):
        prefill_plan([0, 80], [0], [0], [[3]], P, PAGE, ring)
    with pytest.raises(ValueError, match="cu_seqlens must be non-decreasing"):
        prefill_plan([0, 5, 3], [0, 0], [0, 1], [[0], [1]], P, PAGE, ring)
    with pytest.raises(ValueError, match="starts non-negative"):
        prefill_plan([0, 5], [-4], [0], [[0]], P, PAGE, ring)
    with pytest.raises(ValueError, match=r"cu_seqlens \[R \+ 1\]"):
        prefill_plan([0, 5], [0, 0], [0, 1], [[0], [1]], P, PAGE, ring)
    for i, name in enumerate(("cu_seqlens", "starts", "ring_blocks", "page_table")):  # a missing argument
        args = [[0, 5], [0], [0], [[0]]]
        args[i] = None
        with pytest.raises(TypeError, match=rf"^{name} must be"):
            prefill_plan(*args, P, PAGE, ring)
    assert prefill_plan([0, 5], [0], [0], torch.tensor([[0]]).numpy(), P, PAGE, ring).pools.shape == (1, 2)  # an array
    plan = prefill_plan([0, 2], [5], [1], [[-1]], P, PAGE, ring)  # positions 5, 6 complete no pool: no page
    assert plan.pools.shape == (0, 2) and plan.requests.tolist() == [[2, 7, 1, 2, 0, 0, 0, -1]]


@pytest.mark.parametrize("table, row, col, source, message", [
    ("pools", 1, 1, ("pools", 0, 1), "cache slots written repeat"),
    ("requests", 1, 7, ("pools", 2, 1), "cache slots written repeat"),  # the head pool onto a listed pool
    ("requests", 1, 2, ("requests", 0, 2), "ring blocks of the requests that seed or read a ring repeat"),
])
def test_racing_tables_raise_and_write_nothing(backend, table, row, col, source, message):
    """Programs run concurrently: a slot written by two of them, or one request seeding the ring
    another reads, raises instead of leaving bytes that depend on their order."""
    src_table, src_row, src_col = source

    def edit(tables):
        tables[table][row, col] = tables[src_table][src_row, src_col]
    _rejected(edit, message)


def test_plan_rejects_bad_input():
    """Non-integers (never truncated), a negative ring block, sizes; a device page table gives a
    plan on its device, equal to the host plan."""
    ring = ring_size(P, 0)
    for args, exc, message in (
            (([0, 5.5], [0], [0], [[0]]), TypeError, "cu_seqlens must hold integers"),
            (([0, 5], torch.tensor([1.0]), [0], [[0]]), TypeError, "starts must have dtype"),
            (([0, 5], [0], [True], [[0]]), TypeError, "ring_blocks must hold integers"),
            (([0, 5], [0], [0], [[0.5]]), TypeError, "page_table must have dtype"),
            (([0, 5], [0], [-1], [[0]]), ValueError, "ring_blocks must be non-negative")):
        with pytest.raises(exc, match=message):
            prefill_plan(*args, P, PAGE, ring)
    for sizes, message in (((0, PAGE, ring), "pool_size"), ((P, 0, ring), "page_size"), ((P, PAGE, 0), "ring"),
                           ((P, PAGE, 6), "multiple of pool_size")):
        with pytest.raises(ValueError, match=message):
            prefill_plan([0, 5], [0], [0], [[0]], *sizes)
    host = prefill_plan([0, 9, 16], [0, 3], [1, 0], [[2, -1], [0, -1]], P, PAGE, ring)
    dev = prefill_plan(torch.tensor([0, 9, 16], device=DEVICE), torch.tensor([0, 3], device=DEVICE),
                       torch.tensor([1, 0], dtype=torch.int32, device=DEVICE),
                       torch.tensor([[2, -1], [0, -1]], dtype=torch.int32, device=DEVICE), P, PAGE, ring)
    for name, a, b in zip(host._fields, host, dev):
        assert b.device.type == torch.device(DEVICE).type and torch.equal(a, b.cpu()), name


def test_requests_without_a_ring_may_repeat_block_minus_one(backend):
    """``block < 0`` means no ring: several such rows seed nothing and are not a repeat."""
    kv, tail, key, gate, ape, plan = _batch()
    requests = plan.requests.clone()
    requests[:, 2] = -1
    requests[1, 4:] = torch.tensor([0, 0, 0, -1])  # and no head pool (it would read a ring)
    tail0 = tail.clone()
    kv_ref = kv.cpu().clone()
    reference.write_prefill(kv_ref, tail0.cpu().clone(), key.cpu(), gate.cpu(), ape.cpu(), plan.pools, requests, P,
                            torch.float8_e4m3fn, "plain")
    write_prefill(kv, tail, key, gate, ape, plan.pools.to(DEVICE), requests.to(DEVICE), P, layout="plain",
                  fp8_dtype=torch.float8_e4m3fn)
    assert_bytes_equal(kv.cpu(), kv_ref, "kv_cache")
    assert_bytes_equal(tail, tail0, "tail")
