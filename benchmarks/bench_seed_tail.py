"""Ring seeding from a prefill batch: each request's last tokens go into its tail ring.

``R`` requests of random lengths (a random partition of ``T`` tokens, each starting at
position 0), tail block = a random permutation of ``R`` blocks, RING = P (the seed's
ring), token-major ``key``/``gate`` ``[T, 128]`` bf16, ``tslot [T]`` int32.

* ``ours``: ``kpool.kpool_seed_tail_cache`` (seed-compatible, token-granular ``tslot``).
* ``ours_per_request``: ``kpool.ops.tail.seed_requests`` with ``meta [R, 4]`` int64
  ``(end_row, end_pos, block, n_keep = min(len, P))``: one program per request.
* ``seed``: the seed's ``kpool_seed_tail_cache`` (one program per token).
* ``torch``: ``kpool.reference.seed_tail`` (eager; ``nonzero`` host sync).

Bytes: the kept rows' key + gate read and written (``n_keep*512`` B each way) plus the
metadata that API must read (``tslot``: ``T*4`` B; ``meta``: ``R*32`` B).
"""

from __future__ import annotations

import torch

OP = "seed_tail"
TITLE = "ring seeding"
HEAD = 128


def cases(mode):
    if mode == "dry":
        sizes = [(3, 64, 4)]
    elif mode == "quick":
        sizes = [(64, 65_536, 4)]
    else:
        sizes = [(64, 65_536, 4), (64, 65_536, 16), (512, 262_144, 4)]
    return [{"label": f"P={p} R={r} T={t}", "P": p, "requests": r, "tokens": t} for r, t, p in sizes]


def impls(case):
    return ["ours", "ours_per_request", "seed", "torch"]


def targets(case):
    if case["requests"] == 64 and case["tokens"] == 65_536:
        return [{"impl": i, "kind": "max_us", "value": 5.0, "text": "<= 5 us"} for i in ("ours_per_request", "ours")]
    return []


def lengths(r, t, seed):
    g = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(t - 1, generator=g)[: r - 1] + 1
    edges = torch.cat((torch.tensor([0]), cuts.sort().values, torch.tensor([t])))
    return (edges[1:] - edges[:-1]).tolist()


def make_inputs(ctx, r, t, p, i):
    base = 15485863 * (i + 1) + p
    lens = lengths(r, t, base)
    dev = ctx.device
    blocks = ctx.randperm(r, base + 1).cpu()
    req = torch.repeat_interleave(torch.arange(r), torch.tensor(lens))
    starts = torch.cumsum(torch.tensor([0] + lens[:-1]), 0)
    pos = torch.arange(t) - starts[req]
    tslot = (blocks[req] * p + pos % p).to(torch.int32)
    ends = torch.cumsum(torch.tensor(lens), 0)
    meta = torch.stack((ends, torch.tensor(lens), blocks, torch.tensor(lens).clamp(max=p)), 1).to(torch.int64)
    return (ctx.randn((r, 2, p, HEAD), base + 2),
            ctx.randn((t, HEAD), base + 3),
            ctx.randn((t, HEAD), base + 4),
            tslot.to(dev), meta.to(dev))


def bench(ctx, case, impl):
    import kpool
    from kpool import reference
    from kpool.ops import tail as tail_ops
    r, t, p = case["requests"], case["tokens"], case["P"]
    if impl == "ours":
        def fn(tail, key, gate, tslot, meta):
            kpool.kpool_seed_tail_cache(tail, key, gate, tslot, p)
    elif impl == "ours_per_request":
        def fn(tail, key, gate, tslot, meta):
            tail_ops.seed_requests(tail, key, gate, meta, p)
    elif impl == "seed":
        seed = ctx.require_seed()

        def fn(tail, key, gate, tslot, meta):
            seed.kpool_seed_tail_cache(tail, key, gate, tslot, p)
    elif impl == "torch":
        def fn(tail, key, gate, tslot, meta):
            reference.seed_tail(tail, key, gate, tslot, p)
    else:
        raise ValueError(impl)
    extra = {"ring": p}
    if ctx.check and impl in ("ours", "ours_per_request", "seed"):
        a = make_inputs(ctx, r, t, p, 99)
        ref = ctx.cpu(*a)
        fn(*a)
        reference.seed_tail(*ref[:4], p)
        diff = int((a[0].cpu() != ref[0]).sum())
        extra.update(exact=diff == 0, exact_note=f"ring vs the torch reference seed_tail on the CPU: {diff} elements "
                                                 "differ")
    kept = sum(min(n, p) for n in lengths(r, t, 15485863 + p))
    meta_bytes = r * 32 if impl == "ours_per_request" else t * 4
    nbytes = kept * 2 * HEAD * 2 * 2 + meta_bytes
    alloc = t * HEAD * 2 * 2 + t * 4 + r * (32 + 2 * p * HEAD * 2)
    extra["kept_rows"] = kept
    return ctx.run(fn, lambda i: make_inputs(ctx, r, t, p, i), bytes=nbytes, alloc_bytes=alloc,
                   graph=impl != "torch", **extra)
