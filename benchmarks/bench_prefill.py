"""The whole prefill write from token-major keys and gates: pools written + rings seeded.

``R`` fresh requests (random lengths partitioning ``T`` tokens, positions from 0), packed
token-major ``key``/``gate [T, 128]`` bf16, RING = P, PAGE = 64, each request's pools in
consecutive slots of its own randomly placed pages. Every implementation ends in the same
cache and ring state: every complete pool written, each request's last ``min(len, P)``
tokens in its ring (the seed's seeding rule). Metadata is built on the host outside the
timed region (plan/run split) and shared by the rotated input sets.

* ``ours``: the launch ``KPoolCache.prefill`` makes, without its host planning:
  ``kpool.ops.prefill.write_prefill`` (pools read straight from the token rows, ``pools
  [n_pools, 2]``, and one program per request seeding its ring, ``requests [R, 8]``).
  HOOK (lead): if ``KPoolCache.prefill``'s write changes (other launches, other metadata),
  change ``_ours_fn`` below; nothing else here depends on it.
* ``ours_gathered``: pools gathered (``index_select`` copy) + ``kpool_compress_and_write_cache``
  + ``seed_requests``: what our kernels give through the seed-compatible API.
* ``seed``: the seed used as well as it can be: complete pools gathered + its
  ``kpool_compress_and_write_cache`` (preshuffle at PAGE 64) + its ``kpool_seed_tail_cache``.
* ``seed_upstream``: the upstream serving call pattern (SPEC reference/upstream_kpool.md
  §6.1): one window per token, ``k[idx]`` with ``idx[i, j] = max(i-(P-1), 0) + j``,
  compress all ``T`` windows with ``write_mask`` on pool-completing tokens, then seed.
* ``torch``: ``kpool.reference.write_prefill`` (eager).

Bytes (single-pass floor): each token's key and gate read once (``T*512``), each pool entry
written once (``n_pools*132``), each seeded ring row written once (``kept*512``, ~0.1%).
Metadata (``pools``/``requests``/``loc``/``idx``/``tslot``) is not counted.
"""

from __future__ import annotations

import torch

from kpool.layout import cdiv

OP = "prefill"
TITLE = "prefill write (token-major)"
PAGE = 64
HEAD = 128
FP8 = torch.float8_e4m3fn
HOOK = ("bench_prefill._ours_fn: times write_prefill (its kernel, launch_prefill, is KPoolCache.prefill's write); "
        "update it if KPoolCache.prefill's write changes")


def cases(mode):
    if mode == "dry":
        sizes = [(3, 40, 4)]
    elif mode == "quick":
        sizes = [(64, 262_144, 4)]
    else:
        sizes = [(64, 262_144, 4), (64, 262_144, 16)]
    return [{"label": f"P={p} R={r} T={t}", "P": p, "requests": r, "tokens": t, "page": PAGE} for r, t, p in sizes]


def impls(case):
    return ["ours", "ours_gathered", "seed", "seed_upstream", "torch"]


def targets(case):
    if case["requests"] == 64 and case["tokens"] == 262_144:
        return [{"impl": "ours", "kind": "min_frac_copy", "value": 0.80, "text": ">=0.80 of floor"}]
    return []


def plan(r, t, p, seed=12345):
    """Host metadata (CPU tensors) of one packed prefill batch."""
    g = torch.Generator().manual_seed(seed + p)
    cuts = torch.randperm(t - 1, generator=g)[: r - 1] + 1
    edges = torch.cat((torch.tensor([0]), cuts.sort().values, torch.tensor([t])))
    lens = edges[1:] - edges[:-1]
    starts = edges[:-1]
    blocks = torch.randperm(r, generator=g)
    n_pools = lens // p
    pages_per = cdiv(n_pools, PAGE)
    num_pages = int(pages_per.sum()) + 1
    page_perm = torch.randperm(num_pages, generator=g)
    page_base = torch.cumsum(pages_per, 0) - pages_per
    req = torch.repeat_interleave(torch.arange(r), n_pools)
    m = torch.arange(int(n_pools.sum())) - torch.repeat_interleave(torch.cumsum(n_pools, 0) - n_pools, n_pools)
    first_row = starts[req] + m * p
    loc = (page_perm[page_base[req] + m // PAGE] * PAGE + m % PAGE).to(torch.int64)
    idx = first_row[:, None] + torch.arange(p)
    tok_req = torch.repeat_interleave(torch.arange(r), lens)
    pos = torch.arange(t) - starts[tok_req]
    tslot = (blocks[tok_req] * p + pos % p).to(torch.int32)
    keep = lens.clamp(max=p)
    seeds = torch.stack((edges[1:], lens, blocks, keep), 1).to(torch.int64)
    no_head = torch.tensor([0, 0, 0, -1]).expand(r, 4)  # fresh requests: no pool starts in a ring
    requests = torch.cat((seeds, no_head), 1)
    # upstream window pattern: one window per token, written where the token completes a pool
    win = (torch.arange(t) - (p - 1)).clamp(min=0)[:, None] + torch.arange(p)
    done = (pos + 1) % p == 0
    tok_pool = torch.cumsum(done.to(torch.int64), 0) - 1  # pool index (in pools order) of a completing token
    slot_map = torch.where(done, loc[tok_pool.clamp(min=0)], -1)
    wmask = done & (slot_map >= 0) & (torch.arange(t) >= p - 1)
    return {"loc": loc, "pools": torch.stack((first_row, loc), 1).to(torch.int64),
            "requests": requests, "idx": idx.reshape(-1), "tslot": tslot, "seeds": seeds, "num_pages": num_pages,
            "n_pools": int(n_pools.sum()), "kept": int(keep.sum()), "win": win.reshape(-1), "slot_map": slot_map,
            "wmask": wmask}


def make_inputs(ctx, r, t, p, num_pages, i):
    base = 32452843 * (i + 1) + p
    return (ctx.rand_bytes((num_pages, PAGE, HEAD + 4), base + 1),
            ctx.randn((r, 2, p, HEAD), base + 2),
            ctx.randn((t, HEAD), base + 3),
            ctx.randn((t, HEAD), base + 4),
            ctx.randn((p, HEAD), base + 5, dtype=torch.float32, scale=0.5))


def _ours_fn(md, p):
    """HOOK: the prefill write of ``KPoolCache.prefill`` (one launch: the checks of ``write_prefill``
    read nothing back under graph capture, so the replay times ``launch_prefill``'s kernel)."""
    from kpool.ops.prefill import write_prefill
    pools, requests = md["pools"], md["requests"]

    def fn(kv, tail, key, gate, ape):
        write_prefill(kv, tail, key, gate, ape, pools, requests, p, layout="plain", fp8_dtype=FP8)
    return fn


def _fn(ctx, impl, md, p):
    import kpool
    from kpool import reference
    from kpool.ops.tail import seed_requests
    n = md["n_pools"]
    loc, idx, tslot, seeds = md["loc"], md["idx"], md["tslot"], md["seeds"]
    if impl == "ours":
        return _ours_fn(md, p)
    if impl == "ours_gathered":
        def fn(kv, tail, key, gate, ape):
            sk = key.index_select(0, idx).view(n, p, HEAD)
            sg = gate.index_select(0, idx).view(n, p, HEAD)
            kpool.kpool_compress_and_write_cache(kv, sk, sg, ape, loc, p, layout="plain", fp8_dtype=FP8)
            seed_requests(tail, key, gate, seeds, p)
        return fn
    if impl == "seed":
        seed = ctx.require_seed()

        def fn(kv, tail, key, gate, ape):
            sk = key.index_select(0, idx).view(n, p, HEAD)
            sg = gate.index_select(0, idx).view(n, p, HEAD)
            seed.kpool_compress_and_write_cache(kv, sk, sg, ape, loc, p)
            seed.kpool_seed_tail_cache(tail, key, gate, tslot, p)
        return fn
    if impl == "seed_upstream":
        seed = ctx.require_seed()
        win, slot_map, wmask = md["win"], md["slot_map"], md["wmask"]
        t = slot_map.shape[0]

        def fn(kv, tail, key, gate, ape):
            sk = key.index_select(0, win).view(t, p, HEAD)
            sg = gate.index_select(0, win).view(t, p, HEAD)
            seed.kpool_compress_and_write_cache(kv, sk, sg, ape, slot_map, p, write_mask=wmask)
            seed.kpool_seed_tail_cache(tail, key, gate, tslot, p)
        return fn
    if impl == "torch":
        pools, requests = md["pools"], md["requests"]

        def fn(kv, tail, key, gate, ape):
            reference.write_prefill(kv, tail, key, gate, ape, pools, requests, p, FP8, "plain")
        return fn
    raise ValueError(impl)


def bench(ctx, case, impl):
    from kpool import reference
    r, t, p = case["requests"], case["tokens"], case["P"]
    md = {k: (v.to(ctx.device) if torch.is_tensor(v) else v) for k, v in plan(r, t, p).items()}
    fn = _fn(ctx, impl, md, p)
    extra = {"n_pools": md["n_pools"], "kept_rows": md["kept"],
             "layout": "preshuffle" if impl.startswith("seed") else "plain"}
    if ctx.check and impl in ("ours", "ours_gathered"):
        a = make_inputs(ctx, r, t, p, md["num_pages"], 99)
        kv, tail, key, gate, ape = ctx.cpu(*a)
        fn(*a)
        reference.write_prefill(kv, tail, key, gate, ape, *ctx.cpu(md["pools"], md["requests"]), p, FP8, "plain")
        dk, dt = int((a[0].cpu() != kv).sum()), int((a[1].cpu() != tail).sum())
        extra.update(exact=dk == 0 and dt == 0,
                     exact_note=f"cache and ring vs the torch reference on the CPU: {dk} cache bytes, "
                                f"{dt} ring elements differ")
        del a, kv, tail, key, gate
    nbytes = t * 2 * HEAD * 2 + md["n_pools"] * (HEAD + 4) + md["kept"] * 2 * HEAD * 2
    alloc = nbytes + md["num_pages"] * PAGE * (HEAD + 4)
    if impl in ("seed", "ours_gathered"):
        alloc += md["n_pools"] * p * HEAD * 2 * 2
    elif impl == "seed_upstream":
        alloc += t * p * HEAD * 2 * 2
    return ctx.run(fn, lambda i: make_inputs(ctx, r, t, p, md["num_pages"], i), bytes=nbytes, alloc_bytes=alloc,
                   graph=impl != "torch", **extra)
