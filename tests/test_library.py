"""torch.library ops (``torch.ops.kpool.*``): schemas, fakes and compiled graphs.

``torch.library.opcheck`` checks each op's declared mutations, its fake against the real
output, and its tracing; a ``torch.compile(fullgraph=True)`` graph of the write and select
ops (the ``aot_eager`` backend: it traces through the fakes, no C++ compiler needed) must
give the same bytes as the eager calls.
"""

import pytest
import torch

import kpool  # noqa: F401  (registers the ops)
from _util import assert_bytes_equal

FN = torch.float8_e4m3fn
P, PAGE, D = 4, 32, 128


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _compress_args(device):
    g = _gen(1)
    kv = torch.randint(0, 256, (2, PAGE, D + 4), dtype=torch.uint8, generator=g)
    k = torch.randn(8, P, D, generator=g).to(torch.bfloat16)
    s = torch.randn(8, P, D, generator=g).to(torch.bfloat16)
    ape = torch.randn(P, D, generator=g) * 0.5
    loc = torch.arange(8) * 3
    return [t.to(device) for t in (kv, k, s, ape, loc)] + [P, True, "plain", FN]


def _decode_args(device):
    """Two requests, a verify step of two tokens each (one completes a pool): RING = ring_size(P, 1)."""
    g = _gen(2)
    ring = kpool.layout.ring_size(P, 1)
    kv = torch.randint(0, 256, (2, PAGE, D + 4), dtype=torch.uint8, generator=g)
    tail = torch.randn(2, 2, ring, D, generator=g).to(torch.bfloat16)
    pos = torch.tensor([[2, 3], [6, 7]])
    ts = torch.tensor([[0], [1]]) * ring + pos % ring
    slot = torch.where((pos + 1) % P == 0, torch.tensor([[5], [9]]), -1)
    key = torch.randn(2, 2, D, generator=g).to(torch.bfloat16)
    gate = torch.randn(2, 2, D, generator=g).to(torch.bfloat16)
    ape = torch.randn(P, D, generator=g) * 0.5
    return [t.to(device) for t in (kv, tail, ts, key, gate, ape, slot, pos)] + [P, True, "plain", FN]


def _prefill_args(device):
    """Two requests: 7 new tokens (one pool inside, 3 seeded), then 6 tokens from position 2
    (its head pool completed from the ring, then pool 1 inside)."""
    g = _gen(5)
    ring = kpool.layout.ring_size(P, 1)
    kv = torch.randint(0, 256, (2, PAGE, D + 4), dtype=torch.uint8, generator=g)
    tail = torch.randn(2, 2, ring, D, generator=g).to(torch.bfloat16)
    key = torch.randn(13, D, generator=g).to(torch.bfloat16)
    gate = torch.randn(13, D, generator=g).to(torch.bfloat16)
    ape = torch.randn(P, D, generator=g) * 0.5
    plan = kpool.prefill_plan([0, 7, 13], [0, 2], [1, 0], [[0], [1]], P, PAGE, ring)
    return [t.to(device) for t in (kv, tail, key, gate, ape, plan.pools, plan.requests)] + [P, True, "plain", FN]


def _queries(device, rows=2, heads=16):
    g = _gen(3)
    q = torch.randn(rows, 1, heads, D, generator=g).to(torch.bfloat16)
    w = torch.randn(rows, 1, heads, generator=g)
    return q.to(device), w.to(device)


def _select_args(device):
    g = _gen(4)
    q, w = _queries(device)
    q8, _, wf = kpool.quantize_queries(q, w, fp8_dtype=FN)
    kv = torch.randint(0, 120, (4, PAGE, D + 4), dtype=torch.uint8, generator=g)
    kv[:, :, D:] = torch.tensor([1.0 / 64], dtype=torch.float32).view(torch.uint8)  # finite scales
    lens = torch.tensor([[10], [40]])
    pt = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)
    return [q8, kv.to(device), wf, lens.to(device), pt.to(device), 4, "plain", FN, 2 * PAGE]


def _expand_args(device):
    ids = torch.tensor([[3, 0, -1, 1], [2, 1, 0, 5], [0, -1, -1, -1]], dtype=torch.int32)
    return [ids.to(device), torch.tensor([17, 30, 2]).to(device), P, 32]


CASES = {
    "compress_and_write_cache": _compress_args,
    "decode_update": _decode_args,
    "write_prefill": _prefill_args,
    "fwht128_quant_fp8": lambda dev: [_queries(dev)[0], FN, True],
    "quantize_queries": lambda dev: [*_queries(dev), FN, True],
    "paged_pool_topk": _select_args,
    "expand_pools_and_append_tail": _expand_args,
}


# opcheck's schema test compares the inputs before and after with arithmetic that torch has
# no kernel for on fp8 tensors (CPU; not checked on GPUs): the scorer (fp8 queries in) gets
# the other tests
FP8_INPUTS = {"paged_pool_topk"}


@pytest.mark.parametrize("name", list(CASES))
def test_opcheck(name, backend, device):
    op = getattr(torch.ops.kpool, name).default
    utils = ("test_faketensor", "test_aot_dispatch_dynamic") if name in FP8_INPUTS else None
    torch.library.opcheck(op, CASES[name](device), **({"test_utils": utils} if utils else {}))


@pytest.mark.parametrize("name", ["compress_and_write_cache", "decode_update", "expand_pools_and_append_tail"])
def test_fakes_refuse_a_meta_tensor_among_real_ones(name):
    """A meta tensor among CPU ones sends the call to the op's fake; the fake raises naming the
    devices instead of returning as if the op had run (the writers would have written nothing)."""
    args = CASES[name]("cpu")
    k = next(i for i, a in enumerate(args) if torch.is_tensor(a) and a.dtype in (torch.int32, torch.int64))
    args[k] = args[k].to("meta")
    with pytest.raises(ValueError, match=f"kpool::{name} takes its tensors on one device, got .* on meta"):
        getattr(torch.ops.kpool, name)(*args)


@pytest.mark.parametrize("where", ["fake", "op"])
@pytest.mark.parametrize("name, extra, k, bad, message", [
    ("paged_pool_topk", [], 5, 0, "select_k must be a positive int, got 0"),
    ("paged_pool_topk", [], 5, 2**31, "select_k must be at most 2147483647, got 2147483648"),
    ("paged_pool_topk", ["seq", P, 0], 11, 2**31, "width must be at most 2147483647"),
    ("paged_pool_topk", ["seq", P, 0], 11, 18, r"width must be >= .* = 19, got 18"),
    ("paged_pool_topk", ["seq", P, 0], 10, 0, "pool_size must be a positive int, got 0"),
    ("expand_pools_and_append_tail", [], 3, 18, r"width must be >= .* = 19, got 18"),
    ("expand_pools_and_append_tail", [], 3, 2**31, "width must be at most 2147483647"),
    ("expand_pools_and_append_tail", [], 2, -4, "pool_size must be a positive int, got -4"),
])
def test_fakes_check_the_integers_that_shape_their_output(where, name, extra, k, bad, message):
    """The integers that set an output's shape are checked by the fake (all tensors on ``meta``, as
    under ``torch.compile``) with the op's own error, not turned into a shape the op would refuse."""
    args = CASES[name]("cpu") + [torch.tensor([43, 161]) if a == "seq" else a for a in extra]
    args[k] = bad
    if where == "fake":
        args = [a.to("meta") if torch.is_tensor(a) else a for a in args]
    with pytest.raises(ValueError, match=message):
        getattr(torch.ops.kpool, name)(*args)


@pytest.mark.parametrize("width", [0, 2 * PAGE + 5])
def test_paged_pool_topk_expands(backend, device, width):
    """``seq_lens`` / ``pool_size`` / ``width`` (the Python API's ``expand``): the same tokens as
    the ids through ``expand_pools_and_append_tail``; opcheck as for the ids."""
    sargs = _select_args(device)
    seq = torch.tensor([43, 161]).to(device)
    op = torch.ops.kpool.paged_pool_topk
    torch.library.opcheck(op.default, sargs + [seq, P, width],
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))
    got = op(*sargs, seq, P, width)
    want = torch.ops.kpool.expand_pools_and_append_tail(op(*sargs), seq, P, width or sargs[5] * P + P - 1)
    assert got.shape == want.shape and torch.equal(got.cpu(), want.cpu())


def _step(kv, tail, cargs, dargs, sargs, eargs):
    torch.ops.kpool.compress_and_write_cache(kv, *cargs)
    torch.ops.kpool.decode_update(kv, tail, *dargs)
    ids = torch.ops.kpool.paged_pool_topk(*sargs)
    return torch.ops.kpool.expand_pools_and_append_tail(ids, *eargs)


def test_compiled_graph_matches_eager(backend, device):
    """Write + select ops in one ``torch.compile(fullgraph=True)`` graph: same cache bytes,
    same ring bytes, same indices as the eager calls."""
    c, dec, sel = _compress_args(device), _decode_args(device), _select_args(device)
    kv0, tail0 = c[0], dec[1]
    eargs = [torch.tensor([11, 41]).to(device), P, 32]
    pt = torch.tensor([[1, 0], [0, 1]], dtype=torch.int32, device=kv0.device)  # kv0 has two pages
    sargs = [sel[0], kv0, sel[2], sel[3], pt, *sel[5:]]
    kv_e, tail_e = kv0.clone(), tail0.clone()
    want = _step(kv_e, tail_e, c[1:], dec[2:], [sargs[0], kv_e, *sargs[2:]], eargs)
    kv_c, tail_c = kv0.clone(), tail0.clone()
    got = torch.compile(_step, backend="aot_eager", fullgraph=True)(kv_c, tail_c, c[1:], dec[2:],
                                                                    [sargs[0], kv_c, *sargs[2:]], eargs)
    assert_bytes_equal(kv_c.cpu(), kv_e.cpu(), "kv_cache")
    assert_bytes_equal(tail_c.cpu(), tail_e.cpu(), "tail ring")
    assert torch.equal(got.cpu(), want.cpu())


def test_decode_slot_mappings_compiles_whole(device):
    """``decode_slot_mappings`` traces into one graph (``fullgraph=True``: no host sync, no
    data-dependent shape), so an engine can compile it into its step; same values as eager."""
    from kpool.planning import decode_slot_mappings
    pos = torch.tensor([[63, 64, 65, 66], [3, -1, -1, -1], [130, 131, 132, 133]], device=device)
    blocks = torch.tensor([2, 0, 1], device=device)
    table = torch.tensor([[4, -1, -1], [7, -1, -1], [0, 5, 6]], dtype=torch.int32, device=device)
    compiled = torch.compile(decode_slot_mappings, backend="aot_eager", fullgraph=True)
    got, want = compiled(pos, blocks, table, P, PAGE, 8), decode_slot_mappings(pos, blocks, table, P, PAGE, 8)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert want[0].tolist() == [[4 * PAGE + 15, -1, -1, -1], [7 * PAGE, -1, -1, -1], [-1, 5 * PAGE, -1, -1]]


def test_dynamic_shapes_give_the_fakes_symbolic_ints(device):
    """Under ``torch.compile(dynamic=True)`` an integer taken from a shape reaches the fake as a
    ``torch.SymInt``: its checks (``_checks.check_int``) take it as an int, one graph serves every
    width, the same tokens as eager."""
    def expand(ids, seq):
        return torch.ops.kpool.expand_pools_and_append_tail(ids, seq, P, ids.shape[1] * P + P + 5)

    compiled = torch.compile(expand, backend="aot_eager", dynamic=True, fullgraph=True)
    seq = torch.tensor([40, 50, 61]).to(device)
    for n_pools in (3, 6, 9):
        ids = (torch.arange(3 * n_pools, dtype=torch.int32).view(3, n_pools) % 7).to(device)
        got, want = compiled(ids, seq), expand(ids, seq)
        assert got.shape == (3, n_pools * P + P + 5) and torch.equal(got.cpu(), want.cpu())
