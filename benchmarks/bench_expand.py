"""Expand selected pools to tokens + append the always-selected tail.

``pool_ids [rows, topk/P]`` int32 (random visible pools, about 1% empty picks = -1) and
``seq_lens [rows]`` int32 -> int32 ``[rows, topk + P - 1]``.

* ``ours``: ``kpool.expand_pools_and_append_tail`` (imported lazily: recorded as an error
  while it does not exist).
* ``seed``: the seed's ``expand_pools_and_append_tail``.
* ``torch``: ``kpool.reference.expand_pools_and_append_tail`` (eager).

Bytes (memory floor): ids and seq_lens read once, the output written once.
"""

from __future__ import annotations

import torch

OP = "expand"
TITLE = "expand pools + append tail"


def cases(mode):
    if mode == "dry":
        sizes = [(4, 16, 4)]
    elif mode == "quick":
        sizes = [(8192, 2048, 4)]
    else:
        sizes = [(1024, 2048, 4), (8192, 2048, 4), (32768, 2048, 4), (8192, 2048, 16)]
    return [{"label": f"P={p} rows={r} topk={k}", "P": p, "rows": r, "topk": k} for r, k, p in sizes]


def impls(case):
    return ["ours", "seed", "torch"]


def targets(case):
    if case["rows"] == 8192 and case["topk"] == 2048 and case["P"] == 4:
        return [{"impl": "ours", "kind": "min_frac_copy", "value": 0.80, "text": ">=0.80 of floor"}]
    return []


def floor_bytes(rows, topk, p):
    return rows * (topk // p) * 4 + rows * 4 + rows * (topk + p - 1) * 4


def make_inputs(ctx, rows, topk, p, i):
    base = 104729 * i + p
    n_pools = topk // p
    seq = ctx.randint(2 * topk, 1 << 17, (rows,), base + 1)
    frac = torch.rand((rows, n_pools), generator=ctx.gen(base + 2), device=ctx.device)
    ids = (frac * (seq // p)[:, None]).to(torch.int64)
    empty = torch.rand((rows, n_pools), generator=ctx.gen(base + 3), device=ctx.device) < 0.01
    ids = torch.where(empty, -1, ids)
    return ids.to(torch.int32), seq.to(torch.int32)


def _ours():
    import kpool
    fn = getattr(kpool, "expand_pools_and_append_tail", None)
    if fn is None:
        from kpool.ops.select import expand_pools_and_append_tail as fn  # not exported yet
    return fn


def bench(ctx, case, impl):
    from kpool import reference
    rows, topk, p = case["rows"], case["topk"], case["P"]
    if impl == "ours":
        ours = _ours()

        def fn(ids, seq):
            ours(ids, seq, p)
    elif impl == "seed":
        seed = ctx.require_seed()

        def fn(ids, seq):
            seed.expand_pools_and_append_tail(ids, seq, p)
    elif impl == "torch":
        def fn(ids, seq):
            reference.expand_pools_and_append_tail(ids, seq, p)
    else:
        raise ValueError(impl)
    extra = {}
    if ctx.check and impl in ("ours", "seed"):
        ids, seq = make_inputs(ctx, rows, topk, p, 99)
        got = (_ours() if impl == "ours" else ctx.seed.expand_pools_and_append_tail)(ids, seq, p).cpu()
        want = reference.expand_pools_and_append_tail(*ctx.cpu(ids, seq), p)
        same = got.shape == want.shape and bool(torch.equal(got, want))
        extra.update(exact=same, exact_note="output vs the torch reference on the CPU")
    nbytes = floor_bytes(rows, topk, p)
    return ctx.run(fn, lambda i: make_inputs(ctx, rows, topk, p, i), bytes=nbytes, graph=impl != "torch", **extra)
