"""Compress + write: complete pools ``[n, P, 128]`` bf16 -> fp8 entries in the paged cache.

Implementations (same inputs, same generator seeds):

* ``ours``: ``kpool.kpool_compress_and_write_cache(..., layout="plain")``.
* ``seed``: the seed's ``kpool_compress_and_write_cache``; its wrapper picks the preshuffled
  layout whenever PAGE > 1, so at PAGE 64 it always writes preshuffle (its only layout).
* ``torch``: ``kpool.reference.compress_and_write`` on the device's tensors (the unfused
  torch path: softmax, weighted sum, Hadamard, quant, scatter; eager, host syncs).

Bytes (memory floor): keys + gates read once (``n*P*128*2*2``), ``ape`` once, ``loc``
(int64) once, one 132-byte entry written per pool. ``loc``: consecutive slots inside
randomly permuted pages (how a prefill lays out a request's pools).

``KPOOL_BENCH_GATES`` places the gates against the keys (every impl alike; the README's records
are ``apart``): ``apart``, two allocations (at 262,144 pools, 2^28 bytes each); ``offset``, one
buffer with the gates ``GATES_OFFSET`` bytes after the keys' end; ``interleaved``, each token's key
and gate side by side (``[n, P, 2, 128]``). For ``benchmarks/ab.py``: whether a time depends on
where the two streams fall in DRAM.
"""

from __future__ import annotations

import os

import torch

from kpool.layout import cdiv

OP = "compress"
TITLE = "compress + write"
PAGE = 64
HEAD = 128
FP8 = torch.float8_e4m3fn
CHECK_POOLS = 16_384  # pools in the exactness check (CPU reference)
GATE_PLACEMENTS = ("apart", "offset", "interleaved")
GATES = os.environ.get("KPOOL_BENCH_GATES", "apart")  # module docstring
GATES_OFFSET = 6 << 10  # bytes between the keys' end and the gates' start (``offset``)


def cases(mode):
    if GATES not in GATE_PLACEMENTS:
        raise ValueError(f"KPOOL_BENCH_GATES must be one of {GATE_PLACEMENTS}, got {GATES!r}")
    if mode == "dry":
        sizes = [(4, 16), (16, 16)]
    elif mode == "quick":
        sizes = [(4, 262_144), (16, 262_144)]
    else:
        sizes = [(p, n) for p in (4, 16) for n in (65_536, 262_144)]
    return [{"label": f"P={p} pools={n}", "P": p, "pools": n, "page": PAGE, "layout_ours": "plain",
             "layout_seed": "preshuffle"} for p, n in sizes]


def impls(case):
    return ["ours", "seed", "torch"]


def targets(case):
    return [{"impl": "ours", "kind": "min_frac_copy", "value": 0.85, "text": ">=0.85 of floor"}]


def floor_bytes(p, n):
    return n * p * HEAD * 2 * 2 + p * HEAD * 4 + n * 8 + n * (HEAD + 4)


def check_exact(ctx, fn, p, n):
    """Run ``fn`` (plain layout, e4m3fn) on up to ``CHECK_POOLS`` pools and compare the whole cache
    with the torch reference on the CPU: ``{"exact", "exact_note"}``."""
    from kpool import reference
    n_chk = min(n, CHECK_POOLS)
    kv, k, g, ape, loc = make_inputs(ctx, p, n_chk, 99)
    b, kc, gc, apec, locc = ctx.cpu(kv, k, g, ape, loc)
    fn(kv, k, g, ape, loc)
    reference.compress_and_write(b, kc, gc, apec, locc, None, FP8, "plain")
    diff = int((kv.cpu() != b).sum())
    return {"exact": diff == 0,
            "exact_note": f"whole cache ({n_chk} pools) vs the torch reference on the CPU: {diff} bytes differ"}


def keys_and_gates(ctx, p, n, seed, placement):
    """bf16 keys and gates ``[n, p, 128]`` each, placed as ``placement`` (``GATE_PLACEMENTS``)."""
    if placement == "apart":
        return ctx.randn((n, p, HEAD), seed), ctx.randn((n, p, HEAD), seed + 1)
    numel = n * p * HEAD
    if placement == "offset":
        pad = GATES_OFFSET // 2  # bf16 elements
        buf = ctx.randn((2 * numel + pad,), seed)
        return buf[:numel].view(n, p, HEAD), buf[numel + pad:].view(n, p, HEAD)
    buf = ctx.randn((n, p, 2, HEAD), seed)  # interleaved
    return buf[:, :, 0], buf[:, :, 1]


def make_inputs(ctx, p, n, i):
    base = 1000 * i + 17 * p
    num_pages = cdiv(n, PAGE) + 1
    pages = ctx.randperm(num_pages, base + 3)
    j = torch.arange(n, device=ctx.device)
    loc = pages[j // PAGE] * PAGE + j % PAGE
    k, g = keys_and_gates(ctx, p, n, base + 1, GATES)
    return (ctx.rand_bytes((num_pages, PAGE, HEAD + 4), base + 4), k, g,
            ctx.randn((p, HEAD), base + 5, dtype=torch.float32, scale=0.5),
            loc.to(torch.int64))


def bench(ctx, case, impl):
    import kpool
    from kpool import reference
    p, n = case["P"], case["pools"]
    if impl == "ours":
        def fn(kv, k, g, ape, loc):
            kpool.kpool_compress_and_write_cache(kv, k, g, ape, loc, p, layout="plain", fp8_dtype=FP8)
    elif impl == "seed":
        seed = ctx.require_seed()

        def fn(kv, k, g, ape, loc):
            seed.kpool_compress_and_write_cache(kv, k, g, ape, loc, p)
    elif impl == "torch":
        def fn(kv, k, g, ape, loc):
            reference.compress_and_write(kv, k, g, ape, loc, None, FP8, "plain")
    else:
        raise ValueError(impl)
    extra = {"layout": "preshuffle" if impl == "seed" else "plain", "gates": GATES}
    if impl == "ours" and ctx.check:
        extra.update(check_exact(ctx, fn, p, n))
    nbytes = floor_bytes(p, n)
    alloc = nbytes + (cdiv(n, PAGE) + 1) * PAGE * (HEAD + 4)
    return ctx.run(fn, lambda i: make_inputs(ctx, p, n, i), bytes=nbytes, alloc_bytes=alloc,
                   graph=impl != "torch", **extra)
