"""Scoring + selection (issue 5): pooled fp8 logits, deterministic top-k over pools, expansion + tail.

GLM-5.3-Flash geometry: H = 32 heads x 128 dims, P = 4, index_topk = 2048 (select_k = 512),
PAGE = 64 pool entries per page, e4m3fn, plain layout.

Cases:

* ``decode``: ``B`` requests, one query each at the last position of a ``ctx``-token
  context (``ctx / P`` visible pools on randomly permuted pages); a ``ctx=LO-HI`` case spreads
  the requests' contexts evenly from ``LO`` to ``HI`` tokens (a serving batch of mixed lengths); ``B=4``
  at 128K is a small, latency-bound batch between the one-request target and 32 requests. ``ours`` is
  ``kpool.cache.score_and_select`` (query rotation + fp8, head-weight folding, the fused
  ``paged_pool_topk`` (scores and selects without a logits row in memory),
  ``expand_pools_and_append_tail``: the device part of ``KPoolCache.topk_indices`` for a
  decode step) under CUDA-graph replay.
  Bytes (memory floor): every visible pool's 132-byte entry read once (the issue's floor),
  plus the queries, head weights and page table read and the indices written (<1%).
  Targets: B = 32 at 128K and B = 128 at 1M within 2x of the floor; B = 1 at 128K <= 10 us.
* ``ragged``: ``ragged_pool_logits`` alone (the prefill logits op that writes a logits row):
  ``queries`` causal queries (the last of ``4 * pools`` tokens, each seeing ``(pos + 1) // 4``
  pools) against ``pools`` gathered pooled keys. Bytes: keys, scales, queries and weights read
  once, the ``[queries, pools]`` fp32 logits written once; TFLOP/s as for ``prefill``.
  ``torch``: dequantize, matmul, relu, head weights, head sum, mask (query chunks).
* ``prefill``: one request, a chunk of ``queries`` tokens ending at position ``4 * pools - 1``
  (each query sees its ``(pos + 1) // 4`` pools, about ``pools``). ``ours`` is
  ``KPoolCache.topk_indices`` itself (eager: host planning + row chunks under
  ``KPOOL_LOGITS_BUDGET_MB``). Reported: TFLOP/s (``2 * H * 128`` per visible pool per query)
  next to the fp8 matmul rate measured on the same GPU (``torch._scaled_mm``, 8192^3, e4m3fn,
  bf16 out) as ``frac_fp8_mm``.

``torch``: the plain torch path engines fall back to: our query quantization, then dequantize
the gathered keys to bf16, matmul, relu, per-head weights, head sum, mask, ``torch.topk``,
and the reference expansion (eager, requests / rows in chunks to bound memory).

``$KPOOL_BENCH_HEADS`` (default 32) times another head count (16 or 64: the issue's other H),
e.g. ``KPOOL_BENCH_HEADS=64 python benchmarks/ab.py --op score ...``; the README's records are H = 32.
``$KPOOL_BENCH_TOPK`` (default 2048) sets the full and quick modes' ``index_topk`` (4096: select_k 1,024).
``$KPOOL_BENCH_DECODE`` adds decode cases to every mode's, as comma-separated ``B:CTX[:NEXT_N]``
(``CTX`` in tokens), e.g. ``KPOOL_BENCH_DECODE=2:131072,1:131072:2`` for small batches and verify steps.

Exactness (``ctx.check``): ours on a reduced case vs the CPU torch reference (decode:
``kpool.reference`` logits + selection + expansion; prefill: ``reference.serving_topk_indices``
from the raw token keys).
"""

from __future__ import annotations

import os

import torch

from kpool.layout import cdiv

OP = "score"
TITLE = "scoring + selection (issue 5)"
P = 4
HEADS = int(os.environ.get("KPOOL_BENCH_HEADS", "32"))  # module docstring
TOPK = int(os.environ.get("KPOOL_BENCH_TOPK", "2048"))  # module docstring
EXTRA_DECODE = os.environ.get("KPOOL_BENCH_DECODE", "")  # module docstring
HEAD = 128
PAGE = 64
ENTRY = HEAD + 4
FP8 = torch.float8_e4m3fn
MM_SIZE = 8192  # fp8 matmul rate: MM_SIZE^3 torch._scaled_mm
TORCH_ELEMS = 1 << 28  # torch path: fp32 score elements per chunk (1 GiB)
_FP8_MM = {}


def cases(mode):
    if mode == "dry":
        dec = [(2, 1024, 1), (1, 512, 2), (3, (256, 1024), 1)]
        pre = [(8, 96)]
        rag = [(8, 300)]
        topk = 64
    elif mode == "quick":
        dec = [(32, 131072, 1), (1, 131072, 1)]
        pre = [(8192, 32768)]
        rag = [(1024, 32768)]
        topk = TOPK
    else:
        dec = [(32, 131072, 1), (128, 1048576, 1), (1, 131072, 1), (4, 131072, 1), (32, (4096, 131072), 1),
               (32, 32768, 1)]
        pre = [(8192, 4096), (8192, 8192), (8192, 32768)]  # rows of 4-8, 12-16 and 30-32 leaves of 512 pools
        rag = [(1024, 32768)]
        topk = TOPK
    dec = dec + extra_decode_cases(EXTRA_DECODE)
    out = [{"label": f"decode B={b} ctx={_ctx_label(c)}" + (f" n={n}" if n > 1 else ""), "kind": "decode",
            "batch": b, "ctx": c[1] if isinstance(c, tuple) else c, "ctx_lo": c[0] if isinstance(c, tuple) else None,
            "next_n": n, "rows": b * n, "index_topk": topk, "P": P, "heads": HEADS} for b, c, n in dec]
    out += [{"label": f"prefill q={q} pools={n}", "kind": "prefill", "queries": q, "pools": n, "rows": q,
             "index_topk": topk,
             "P": P, "heads": HEADS} for q, n in pre]
    out += [{"label": f"ragged logits q={q} pools={n}", "kind": "ragged", "queries": q, "pools": n, "rows": q,
             "P": P, "heads": HEADS} for q, n in rag]
    return out


def extra_decode_cases(spec: str) -> list:
    """``(B, CTX, NEXT_N)`` of each ``B:CTX[:NEXT_N]`` in the comma-separated ``spec``."""
    out = []
    for item in filter(None, (t.strip() for t in spec.split(","))):
        parts = item.split(":")
        if len(parts) not in (2, 3) or not all(x.isdigit() and int(x) > 0 for x in parts):
            raise ValueError(f"KPOOL_BENCH_DECODE takes B:CTX[:NEXT_N] items of positive ints, got {item!r}")
        b, c, n = (int(x) for x in parts + ["1"] * (3 - len(parts)))
        out.append((b, c, n))
    return out


def _k(n):
    return f"{n // 1048576}M" if n >= 1048576 and n % 1048576 == 0 else (f"{n // 1024}K" if n >= 1024 else str(n))


def _ctx_label(c):
    return f"{_k(c[0])}-{_k(c[1])}" if isinstance(c, tuple) else _k(c)


def contexts(b, c, lo=None):
    """Context tokens of the ``b`` requests: all ``c``, or evenly spread from ``lo`` to ``c``
    (multiples of ``P``), int64 ``[b]``."""
    if lo is None or b == 1:
        return torch.full((b,), c, dtype=torch.int64)
    return torch.linspace(lo, c, b, dtype=torch.float64).long() // P * P


def impls(case):
    return ["ours", "torch"]


def targets(case):
    if case["kind"] != "decode":
        return []
    b, c = case["batch"], case["ctx"]
    if case.get("ctx_lo") is not None or case["next_n"] != 1:  # the targets are decode steps of one query
        return []
    if (b, c) in ((32, 131072), (128, 1048576)):
        return [{"impl": "ours", "kind": "min_frac_copy", "value": 0.5, "text": "<=2x floor"}]
    if (b, c) == (1, 131072):
        return [{"impl": "ours", "kind": "max_us", "value": 10.0, "text": "<= 10 us"}]
    return []


# ----------------------------------------------------------------------------- inputs

def make_kv(ctx, num_pages, seed):
    """Valid pooled entries: random non-NaN e4m3fn codes, power-of-two scales 2^-10 .. 2^-6."""
    from kpool.exactness import finite_pages_
    kv = ctx.rand_bytes((num_pages, PAGE, ENTRY), seed)
    exps = ctx.randint(117, 122, (num_pages, PAGE), seed + 1, dtype=torch.int32)
    finite_pages_(kv.view(num_pages, PAGE * ENTRY), exps)
    return kv


def make_decode(ctx, b, c, nn, i, lo=None):
    base = 7907 * i + b + c
    dev = ctx.device
    pools = c // P
    pages_per = cdiv(pools, PAGE)
    num_pages = b * pages_per
    pt = ctx.randperm(num_pages, base + 1).view(b, pages_per).to(torch.int32)
    last = contexts(b, c, lo).to(dev)[:, None] - nn  # each request's first query position
    pos = (last + torch.arange(nn, device=dev)[None, :]).to(torch.int32).contiguous()
    return (ctx.randn((b, nn, HEADS, HEAD), base + 2, scale=2.0), ctx.randn((b, nn, HEADS), base + 3,
                                                                                dtype=torch.float32),
            make_kv(ctx, num_pages, base + 4), pt, pos)


def decode_bytes(b, c, nn, width, lo=None):
    pools = contexts(b, c, lo) // P  # visible pools per request (every query row of a step sees about as many)
    return int(nn * pools.sum() * ENTRY + b * nn * HEADS * (HEAD * 2 + 4) + cdiv(pools, PAGE).sum() * 4
               + b * nn * width * 4)


# ----------------------------------------------------------------------------- implementations

def _ours_decode(case):
    from kpool.cache import score_and_select
    topk, pools = case["index_topk"], case["ctx"] // P

    def fn(q, w, kv, pt, pos):
        return score_and_select(q, w, kv, pt, pos, pool_size=P, index_topk=topk, max_pools=pools, layout="plain",
                                fp8_dtype=FP8)
    return fn


def torch_select(q8, qs, w_raw, keys, kscale, pos, select_k, width):
    """Plain torch scoring of rows against keys ``[G, N, 128]`` fp8 (``G`` = 1 or one per row group):
    dequantize, matmul, relu, head weights, head sum, mask, torch.topk, reference expansion."""
    from kpool import reference
    rows, heads = q8.shape[:2]
    w = reference.fold_head_weights(w_raw, qs)  # [rows, H]
    k = keys.to(torch.bfloat16)  # [G, N, 128]
    scores = torch.einsum("grhd,gnd->grhn", q8.to(torch.bfloat16).view(k.shape[0], -1, heads, HEAD), k).float()
    scores = scores * kscale[:, None, None, :]
    logits = (scores.relu_() * w.view(k.shape[0], -1, heads, 1)).sum(2).view(rows, -1)  # [rows, N]
    lens = torch.div(pos.view(-1).long() + 1, P, rounding_mode="floor")
    j = torch.arange(logits.shape[1], device=logits.device)
    logits = logits.masked_fill(j[None, :] >= lens[:, None], float("-inf"))
    vals, ids = torch.topk(logits, min(select_k, logits.shape[1]), dim=1)
    ids = torch.where(torch.isinf(vals) & (vals < 0), -1, ids)
    return reference.expand_pools_and_append_tail(ids, pos.view(-1).long() + 1, P, width=width)


def _torch_decode(case):
    import kpool
    topk = case["index_topk"]
    select_k, width = topk // P, topk + P - 1

    def fn(q, w, kv, pt, pos):
        b, nn = pos.shape
        q8, qs = kpool.fwht128_quant_fp8(q, fp8_dtype=FP8)
        num_pages = kv.shape[0]
        flat = kv.view(num_pages, PAGE * ENTRY)
        codes = flat[:, : PAGE * HEAD].view(num_pages, PAGE, HEAD)  # uint8 (gathered, then viewed as fp8)
        scales = flat[:, PAGE * HEAD:].view(torch.float32)
        per = max(1, TORCH_ELEMS // (nn * HEADS * pt.shape[1] * PAGE))
        outs = []
        for s in range(0, b, per):
            e = min(b, s + per)
            pg = pt[s:e].long()
            keys = codes[pg].view(e - s, -1, HEAD).view(FP8)  # [g, pools, 128]
            ksc = scales[pg].view(e - s, -1)
            outs.append(torch_select(q8[s:e].reshape(-1, HEADS, HEAD), qs[s:e].reshape(-1, HEADS),
                                     w[s:e].reshape(-1, HEADS), keys, ksc, pos[s:e], select_k, width))
        return torch.cat(outs)
    return fn


def _reference_decode(q, w, kv, pt, pos, topk):
    """CPU torch reference of the decode pipeline (kpool.reference only)."""
    from kpool import reference
    b, nn = pos.shape
    codes, qs = reference.fwht128_quant_fp8(q.reshape(-1, HEAD), FP8)
    wf = reference.fold_head_weights(w, qs.view(b, nn, HEADS))
    lens = torch.div(pos.long() + 1, P, rounding_mode="floor")
    logits = reference.paged_pool_logits(codes.view(torch.uint8).view(b, nn, HEADS, HEAD), kv, wf, lens, pt,
                                         "plain", FP8, int(lens.max()))
    ids = reference.select_pools(logits, lens.view(-1), topk // P)
    return reference.expand_pools_and_append_tail(ids, pos.view(-1).long() + 1, P, width=topk + P - 1)


def _bench_decode(ctx, case, impl):
    b, c, nn, topk, lo = case["batch"], case["ctx"], case["next_n"], case["index_topk"], case.get("ctx_lo")
    fn = _ours_decode(case) if impl == "ours" else _torch_decode(case)
    extra = {}
    if impl == "ours" and ctx.check:
        cb, cc = min(b, 4), min(c, 131072)  # 4 x 128K: long rows, filtered like the case (score.filters)
        a = make_decode(ctx, cb, cc, nn, 99, lo and min(lo, cc))
        got = _ours_decode(dict(case, ctx=cc))(*a).cpu()
        want = _reference_decode(*ctx.cpu(*a), topk)
        same = bool(torch.equal(got, want))
        extra.update(exact=same, exact_note=f"indices of {cb} requests at ctx {cc} vs the torch reference on the CPU"
                                            f"{'' if same else ': ' + str(int((got != want).sum())) + ' differ'}")
    nbytes = decode_bytes(b, c, nn, topk + P - 1, lo)
    extra["floor_note"] = "pooled cache bytes read once (+ queries, weights, page table, indices: <1%)"
    if impl == "torch":
        extra["note"] = "plain torch path (dequantize, matmul, relu, head sum, torch.topk), eager"
    return ctx.run(fn, lambda i: make_decode(ctx, b, c, nn, i, lo), bytes=nbytes, graph=impl == "ours", **extra)


# ----------------------------------------------------------------------------- prefill

def make_prefill(ctx, n_q, pools, i, topk):
    """A KPoolCache holding one request of ``4 * pools`` tokens whose last step is the ``n_q``-query chunk."""
    from kpool.cache import KPoolCache
    base = 6133 * i + n_q
    length = pools * P
    keys = ctx.randn((length, HEAD), base + 1, scale=2.0)
    gates = ctx.randn((length, HEAD), base + 2)
    ape = ctx.randn((P, HEAD), base + 3, dtype=torch.float32, scale=0.5)
    cache = KPoolCache(cdiv(pools, PAGE), page_size=PAGE, pool_size=P, max_requests=1, ape=ape,
                       device=ctx.device, layout="plain", fp8_dtype=FP8)
    if length > n_q:
        cache.prefill(["r"], [keys[: length - n_q]], [gates[: length - n_q]])
    cache.prefill(["r"], [keys[length - n_q:]], [gates[length - n_q:]])
    q = ctx.randn((n_q, HEADS, HEAD), base + 4, scale=2.0)
    w = ctx.randn((n_q, HEADS), base + 5, dtype=torch.float32)
    return cache, q, w, (keys, gates, ape)


def fp8_mm_tflops(ctx):
    """Measured ``torch._scaled_mm`` rate (TFLOP/s) of an MM_SIZE^3 e4m3fn GEMM, bf16 out (None on the CPU)."""
    if not ctx.cuda:
        return None, "no fp8 matmul rate on the CPU"
    key = str(ctx.device)
    if key not in _FP8_MM:
        n = MM_SIZE
        a = ctx.randn((n, n), 1).to(FP8)
        bt = ctx.randn((n, n), 2).to(FP8)
        one = torch.ones((), dtype=torch.float32, device=ctx.device)
        try:
            t = ctx.time(lambda: torch._scaled_mm(a, bt.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                         [()], graph=True)
            _FP8_MM[key] = (2 * n ** 3 / t["us"] / 1e6, f"torch._scaled_mm {n}^3 e4m3fn -> bf16: {t['us']:.1f} us")
        except Exception as e:  # noqa: BLE001
            _FP8_MM[key] = (None, f"torch._scaled_mm failed: {type(e).__name__}: {str(e)[:120]}")
        del a, bt
    return _FP8_MM[key]


def _torch_prefill(case):
    import kpool
    n_q, topk = case["queries"], case["index_topk"]
    select_k, width = topk // P, topk + P - 1

    def fn(cache, q, w, raw):
        q8, qs = kpool.fwht128_quant_fp8(q, fp8_dtype=FP8)
        req = cache.requests[0]
        n = cache.length(req) // P
        kv = cache.kv_cache  # gather the request's pools through its pages (as engines do), dequantize below
        pg = cache.page_table([req])[0].long()
        flat = kv.view(kv.shape[0], PAGE * ENTRY)[pg]
        codes = flat[:, : PAGE * HEAD].reshape(-1, HEAD)[:n]
        scales = flat[:, PAGE * HEAD:].contiguous().view(torch.float32).reshape(-1)[:n]
        pos = torch.arange(n * P - n_q, n * P, device=q.device)
        per = max(1, TORCH_ELEMS // (HEADS * n))
        return torch.cat([torch_select(q8[s:s + per], qs[s:s + per].view(-1, HEADS), w[s:s + per],
                                       codes.view(FP8)[None], scales[None], pos[s:s + per], select_k, width)
                          for s in range(0, n_q, per)])
    return fn


def _bench_prefill(ctx, case, impl):
    from kpool import reference
    n_q, pools, topk = case["queries"], case["pools"], case["index_topk"]
    width = topk + P - 1
    extra = {}
    if impl == "ours":
        def fn(cache, q, w, raw):
            return cache.topk_indices(["r"], q, w, index_topk=topk)
        if ctx.check:
            cq, cn = min(n_q, 64), min(pools, 16384)  # long rows: filtered like the case (score.filters)
            cache, q, w, (keys, gates, ape) = make_prefill(ctx, cq, cn, 99, topk)
            got = fn(cache, q, w, None).cpu()
            pos = torch.arange(cn * P - cq, cn * P)
            want, _, _ = reference.serving_topk_indices(*ctx.cpu(q, w, keys, gates, ape), pos, P, topk, FP8)
            same = bool(torch.equal(got, want))
            extra.update(exact=same, exact_note=f"indices of {cq} queries over {cn} pools vs "
                                                f"reference.serving_topk_indices on the CPU")
            del cache, q, w, keys, gates
    else:
        fn = _torch_prefill(case)
        extra["note"] = "plain torch path (gather, dequantize, matmul, relu, head sum, torch.topk), eager"
    # useful work: each query row against each of its visible pools, all heads
    length = pools * P
    vis = sum((p + 1) // P for p in range(length - n_q, length))
    flops = 2 * HEADS * HEAD * vis
    nbytes = n_q * HEADS * (HEAD * 2 + 4) + pools * ENTRY + n_q * width * 4
    rec = ctx.run(fn, lambda i: make_prefill(ctx, n_q, pools, i, topk), bytes=nbytes, graph=False, **extra)
    rec["flops"] = flops
    rec["tflops"] = flops / rec["us"] / 1e6 if rec.get("us") else None
    mm, note = fp8_mm_tflops(ctx)
    rec.update(fp8_mm_tflops=mm, fp8_mm_note=note)
    if mm and rec["tflops"]:
        rec["frac_fp8_mm"] = rec["tflops"] / mm
    return rec


# ----------------------------------------------------------------------------- ragged logits

def make_ragged(ctx, n_q, pools, i):
    """Rotated fp8 queries ``[n_q, H, 128]``, folded weights, ``pools`` valid key codes and
    scales, causal windows ``[0, (pos + 1) // P)`` of the last ``n_q`` of ``P * pools`` tokens."""
    import kpool
    from kpool import reference
    base = 4421 * i + n_q
    q8, qs = kpool.fwht128_quant_fp8(ctx.randn((n_q, HEADS, HEAD), base + 1, scale=2.0), fp8_dtype=FP8)
    w = reference.fold_head_weights(ctx.randn((n_q, HEADS), base + 2, dtype=torch.float32), qs)
    kv = make_kv(ctx, cdiv(pools, PAGE), base + 3).view(-1, PAGE * ENTRY)
    codes = kv[:, : PAGE * HEAD].reshape(-1, HEAD)[:pools].view(FP8)
    scales = kv[:, PAGE * HEAD:].contiguous().view(torch.float32).reshape(-1)[:pools]
    pos = torch.arange(pools * P - n_q, pools * P, device=ctx.device)
    ke = torch.div(pos + 1, P, rounding_mode="floor")
    return q8, codes, scales, w, torch.zeros_like(ke), ke


def _torch_ragged(q8, codes, scales, w, ks, ke):
    n_q, n = q8.shape[0], codes.shape[0]
    k = codes.to(torch.bfloat16)
    per = max(1, TORCH_ELEMS // (HEADS * n))
    j = torch.arange(n, device=q8.device)
    outs = []
    for s in range(0, n_q, per):
        sc = torch.einsum("rhd,nd->rhn", q8[s:s + per].to(torch.bfloat16), k).float() * scales
        lg = (sc.relu_() * w[s:s + per, :, None]).sum(1)
        vis = (j[None] >= ks[s:s + per, None]) & (j[None] < ke[s:s + per, None])
        outs.append(lg.masked_fill(~vis, float("-inf")))
    return torch.cat(outs)


def _bench_ragged(ctx, case, impl):
    from kpool import reference
    from kpool.ops.logits import ragged_pool_logits
    n_q, pools = case["queries"], case["pools"]
    extra = {}
    if impl == "ours":
        def fn(q8, codes, scales, w, ks, ke):
            return ragged_pool_logits(q8, codes, scales, w, ks, ke)
        if ctx.check:
            a = make_ragged(ctx, min(n_q, 16), min(pools, 2048), 99)
            got = fn(*a).cpu()
            q8, codes, scales, w, ks, ke = ctx.cpu(*a)
            want = reference.ragged_pool_logits(q8.view(torch.uint8), codes.view(torch.uint8), scales, w, ks, ke, FP8)
            same = bool(torch.equal(got.view(torch.int32), want.view(torch.int32)))
            extra.update(exact=same, exact_note=f"logits bits of {a[0].shape[0]} queries x {a[1].shape[0]} pools vs "
                                                "reference.ragged_pool_logits on the CPU")
    else:
        fn = _torch_ragged
        extra["note"] = "plain torch path (dequantize, matmul, relu, head weights, head sum, mask), eager"
    length = pools * P
    vis = sum((p + 1) // P for p in range(length - n_q, length))
    nbytes = pools * ENTRY + n_q * HEADS * (HEAD + 4) + 2 * n_q * 8 + n_q * pools * 4
    rec = ctx.run(fn, lambda i: make_ragged(ctx, n_q, pools, i), bytes=nbytes, graph=impl == "ours", **extra)
    rec["flops"] = 2 * HEADS * HEAD * vis
    rec["tflops"] = rec["flops"] / rec["us"] / 1e6 if rec.get("us") else None
    return rec


def bench(ctx, case, impl):
    if impl not in ("ours", "torch"):
        raise ValueError(impl)
    if case["kind"] == "decode":
        return _bench_decode(ctx, case, impl)
    if case["kind"] == "ragged":
        return _bench_ragged(ctx, case, impl)
    return _bench_prefill(ctx, case, impl)
