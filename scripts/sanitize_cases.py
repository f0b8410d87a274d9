"""Launches of every kernel, for compute-sanitizer on a CUDA GPU:

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python3 scripts/sanitize_cases.py

(without the caching allocator each tensor is its own allocation, so an access past a
tensor's end is reported instead of landing in a neighbour). The write-path cases use padded
strides, -1 sentinels and slots at the edges of the buffers; the scoring cases run every
shape of the selection (one leaf, exact leaves, filtering leaves of 256 / 512 / 1,024 pools,
one and two query rows per program, 32 and 64 heads, rows of mixed and zero length, a
filtering prefill chunk through ``KPoolCache``) and compare each fused selection with
``select_pools`` of the full logits rows. Prints one line per case; exits non-zero on a
mismatch.

The kernels run without their register caps (``KPOOL_REGISTER_CAP=0`` unless set): under
memcheck the 64-head filtering leaves at their caps (128 for one query row per program, 168
for two) select wrong pools, differently from run to run, while uncapped under memcheck, and
at every cap (128, 168, 255, none) without the sanitizer or under racecheck (no hazards), the
same launches are exact (H200, compute-sanitizer 2025.3.1, 30th session): the instrumented
code, not the kernel.
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
os.environ.setdefault("KPOOL_REGISTER_CAP", "0")

import torch  # noqa: E402

import kpool  # noqa: E402
from kpool.demo import run_demo  # noqa: E402

PAGE = 64


def main():
    dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"  # "cpu": a quick run of the torch backend
    g = torch.Generator(device=dev).manual_seed(0)
    bf = lambda *s: torch.randn(*s, device=dev, generator=g).to(torch.bfloat16)  # noqa: E731
    for p in (4, 16):
        ape = torch.randn(p, 128, device=dev, generator=g)
        base = torch.zeros(5, 32 * 132 + 64, dtype=torch.uint8, device=dev)
        kv = base[:, : 32 * 132].view(5, 32, 132)  # padded page stride
        n = 9
        loc = torch.tensor([0, 159, -1, 31, 32, 100, -1, 64, 5][:n], device=dev)
        for layout in ("plain", "preshuffle"):
            kpool.kpool_compress_and_write_cache(kv, bf(n, p, 128), bf(n, p, 128), ape, loc, p, layout=layout)
        tail_base = torch.zeros(6, 2, 2 * p + 3, 128, dtype=torch.bfloat16, device=dev)
        tail = tail_base[:, :, : 2 * p]
        pos = torch.tensor([[-1, 2 * p - 1, 2 * p], [p - 1, p, -1], [0, 1, 2]], device=dev, dtype=torch.int32)
        ts = torch.where(pos >= 0, torch.tensor([[5], [0], [2]], device=dev) * 2 * p + pos % (2 * p), -1)
        sm = torch.where((pos >= 0) & ((pos + 1) % p == 0), torch.tensor([[159], [0], [3]], device=dev), -1)
        kpool.kpool_decode_update_and_maybe_write_cache_batched(kv, tail, ts, bf(3, 3, 128), bf(3, 3, 128), ape, sm,
                                                                pos, p)
        tslot = torch.tensor([0, 1, 2, -1, 5 * 2 * p + 7, 5 * 2 * p + 6], device=dev)
        kpool.kpool_seed_tail_cache(tail, bf(6, 128), bf(6, 128), tslot, p)
        print(f"P={p}: compress, decode, seed_tail ok", flush=True)
    ids = torch.randint(-1, 300, (7, 512), device=dev, generator=g)
    seq = torch.randint(-3, 2000, (7,), device=dev, generator=g)
    kpool.expand_pools_and_append_tail(ids, seq, 4)
    kpool.expand_pools_and_append_tail(ids, seq, 4, width=2176)
    pt = torch.randint(0, 1000, (7, 2100), device=dev, generator=g, dtype=torch.int32)
    kpool.expand_pools_to_tokens(ids, ids >= 0, 2048, 4, page_table=pt)
    kpool.append_tail_to_topk(torch.zeros(7, 2048, dtype=torch.int32, device=dev), seq, seq // 4, 4)
    kpool.build_pooled_page_table(pt[:, :2048], 4)
    print("select ops ok", flush=True)
    q8, qs = kpool.fwht128_quant_fp8(bf(5, 32, 128))
    print("quant ok", flush=True)
    score_cases(dev, g, bf)
    run_demo(requests=3, max_prompt=300, decode_steps=6, device=dev, quiet=True)
    print("KPoolCache session ok", flush=True)
    if dev.startswith("cuda"):
        torch.cuda.synchronize()
    print("SANITIZE CASES DONE")


def valid_kv(num_pages, dev, g):
    """A cache of ``num_pages`` pages of finite entries (power-of-two scales) with a padded page stride."""
    from kpool.exactness import finite_pages_
    base = torch.randint(0, 256, (num_pages, PAGE * 132 + 64), dtype=torch.uint8, device=dev, generator=g)
    finite_pages_(base, torch.randint(117, 122, (num_pages, PAGE), dtype=torch.int32, device=dev, generator=g))
    return base[:, : PAGE * 132].view(num_pages, PAGE, 132)


def check(name, got, want):
    if not torch.equal(got, want):
        print(f"{name}: MISMATCH ({int((got != want).sum())} entries differ)", flush=True)
        sys.exit(1)
    print(f"{name}: ok", flush=True)


def score_cases(dev, g, bf):
    """Fused decode / verify selections (every leaf shape) against select_pools of the logits rows."""
    from kpool import exactness
    from kpool.ops import score
    cases = [  # (requests, next_n, heads, pools per request, select_k): the leaf shape on an H200 (132 SMs)
        (1, 1, 32, 100, 32),  # one leaf (FINAL)
        (1, 1, 32, 32768, 512),  # exact leaves of 128 pools
        (16, 1, 32, 8192, 512),  # filtering leaves of 256 pools, one query row per program
        (16, 2, 32, 8192, 512),  # filtering leaves of 512, two query rows per program
        (16, 1, 64, 8192, 512),  # 64 heads, one row per program: filtering leaves of 256
        (16, 2, 64, 8192, 512),  # 64 heads, two rows per program: filtering leaves of 512
        (2, 1, 32, 262144, 512),  # wide filtering leaves of 1,024 pools
    ]
    for b, n, heads, pools, select_k in cases:
        pages = -(-pools // PAGE)
        kv = valid_kv(b * pages + 3, dev, g)
        pt = torch.randperm(b * pages + 3, device=dev, generator=g)[: b * pages].view(b, pages).to(torch.int32)
        lens = torch.randint(0, pools + 1, (b, n), device=dev, generator=g)
        lens[0] = pools  # the longest row decides the launch; other rows short, long and empty
        if b > 2:
            lens[1] = 0
            lens[2] = pools // 9
        q8, _ = kpool.fwht128_quant_fp8(bf(b, n, heads, 128))
        w = torch.randn(b, n, heads, device=dev, generator=g)
        want = kpool.select_pools(kpool.paged_pool_logits(q8, kv, w, lens, pt), lens.view(-1), select_k)
        with exactness.filter_decisions() as decided:  # the launch's own decision comes last
            got = kpool.paged_pool_topk(q8, kv, w, lens, pt, select_k)
        chunk, n_chunks = score.wide_plan(b * n, pools, select_k, torch.device(dev))
        kind = "filtering" if decided and decided[-1] else "exact"
        leaves = "one leaf" if n_chunks == 1 else f"{n_chunks} {kind} leaves of {chunk}"
        name = f"paged_pool_topk B={b} next_n={n} H={heads} pools={pools} select_k={select_k} ({leaves})"
        check(name, got, want)
        seq = lens.view(-1) * 4 + torch.randint(0, 4, (b * n,), device=dev, generator=g)
        width = -(-(select_k * 4 + 3) // 128) * 128
        check(name + " expanded", kpool.paged_pool_topk(q8, kv, w, lens, pt, select_k, expand=(seq, 4, width)),
              kpool.expand_pools_and_append_tail(want, seq, 4, width=width))
        del kv
    t, n_keys = 37, 300
    q8, _ = kpool.fwht128_quant_fp8(bf(t, 32, 128))
    keys, kscale = kpool.fwht128_quant_fp8(bf(n_keys, 128))
    ks = torch.randint(0, n_keys, (t,), device=dev, generator=g)
    ke = torch.randint(0, n_keys + 1, (t,), device=dev, generator=g)
    logits = kpool.ragged_pool_logits(q8, keys, kscale, torch.randn(t, 32, device=dev, generator=g), ks, ke)
    kpool.select_pools(logits, (ke - ks).clamp(min=0), 64)
    print("ragged_pool_logits, select_pools ok", flush=True)
    prefill_case(dev, g, bf)


def prefill_case(dev, g, bf):
    """A 32K-token prompt whose last chunk (256 queries over up to 8,192 pools: filtering leaves)
    is scored through ``KPoolCache.topk_indices``, against the serving reference on the CPU."""
    from kpool import reference
    from kpool.cache import KPoolCache
    p, n_q, length = 4, 256, 32768
    keys, gates = bf(length, 128), bf(length, 128)
    ape = torch.randn(p, 128, device=dev, generator=g)
    cache = KPoolCache(length // p // PAGE + 1, page_size=PAGE, pool_size=p, max_requests=1, ape=ape, device=dev)
    cache.prefill(["r"], [keys[: length - n_q]], [gates[: length - n_q]])
    cache.prefill(["r"], [keys[length - n_q:]], [gates[length - n_q:]])
    q, w = bf(n_q, 32, 128), torch.randn(n_q, 32, device=dev, generator=g)
    got = cache.topk_indices(["r"], q, w, index_topk=2048)
    pos = torch.arange(length - n_q, length)
    want, _, _ = reference.serving_topk_indices(q.cpu(), w.cpu(), keys.cpu(), gates.cpu(), ape.cpu(), pos, p, 2048,
                                                cache.fp8_dtype)
    check(f"KPoolCache.topk_indices prefill chunk {n_q} x {length // p} pools", got.cpu(), want)


if __name__ == "__main__":
    main()
