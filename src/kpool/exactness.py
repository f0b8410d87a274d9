"""Large-scale exactness run: Triton kernels on a GPU vs the torch oracle on the CPU.

``python -m kpool.exactness [--pools 65536]`` writes random pools with the Triton
kernels into a cache pre-filled with random bytes and compares every byte of it (and of
the rings) with the CPU reference, for P in {4, 16}, both fp8 formats and both layouts;
then decode / verify steps (``decode_cases``: next_n 1, 4 and P + 1, at 64 requests and at
``--decode-requests``, covering every warp count of the decode kernel); then the scorers
(``check_scores``: paged logits and the fused selection over requests x random fp8 pools of each
``--score-shapes`` (default: 32 x 16,384; 2 x 32,768, a small grid the scorer also filters; 8 x
8,192, one it scores exactly in leaves of 256), both formats, both layouts, ``--heads``; each line
says whether the fused selection's leaves filtered, ``ops/score.py``); then ``--select-cases``
random selection cases (``check_selection``: requests, verify rows, lengths, heads,
``select_k``, exact ties, fused expansion all drawn at random). ``--ops`` picks a subset
(``compress,decode,score,select``) so that a run fits a device call's time limit. Prints one
line per case and exits non-zero on any differing byte.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import sys
import time

import torch

from .layout import cdiv


def _rand_inputs(n_pools, p, gen):
    keys = torch.randn(n_pools, p, 128, generator=gen).to(torch.bfloat16)
    scale = torch.exp(torch.randn(n_pools, 1, 1, generator=gen) * 2)  # magnitudes spread over ~e^±6
    gates = (torch.randn(n_pools, p, 128, generator=gen) * 3).to(torch.bfloat16)
    ape = torch.randn(p, 128, generator=gen)
    return (keys * scale).to(torch.bfloat16), gates, ape


def _diff(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.cpu().view(torch.uint8) != b.cpu().view(torch.uint8)).sum())


def _with_backend(name, fn):
    old = os.environ.get("KPOOL_BACKEND")
    os.environ["KPOOL_BACKEND"] = name
    try:
        return fn()
    finally:
        if old is None:
            os.environ.pop("KPOOL_BACKEND")
        else:
            os.environ["KPOOL_BACKEND"] = old


def check_compress(n_pools, p, fp8_dtype, layout, device, gen, page=64):
    import kpool

    keys, gates, ape = _rand_inputs(n_pools, p, gen)
    num_pages = cdiv(n_pools, page) + 1
    kv = torch.randint(0, 256, (num_pages, page, 132), dtype=torch.uint8, generator=gen)
    loc = torch.randperm(num_pages * page, generator=gen)[:n_pools]
    ref = kv.clone()
    _with_backend("torch", lambda: kpool.kpool_compress_and_write_cache(
        ref, keys, gates, ape, loc, p, layout=layout, fp8_dtype=fp8_dtype))
    got = kv.to(device)
    _with_backend("triton", lambda: kpool.kpool_compress_and_write_cache(
        got, keys.to(device), gates.to(device), ape.to(device), loc.to(device), p, layout=layout, fp8_dtype=fp8_dtype))
    return _diff(got, ref), got.numel()


def check_decode(num_req, next_n, p, ring, fp8_dtype, layout, device, gen, page=64):
    import kpool

    pos0 = torch.randint(0, 10_000, (num_req, 1), generator=gen)
    positions = (pos0 + torch.arange(next_n)).to(torch.int32)
    blocks = torch.randperm(num_req, generator=gen)[:, None]
    tail_slots = blocks * ring + positions.to(torch.int64) % ring
    pools = positions.to(torch.int64) // p
    num_pages = cdiv(num_req * (pools.max().item() + 1), page) + 1
    # each request's pools map to distinct slots: request-major, pool-minor
    slot_mapping = torch.where((positions + 1) % p == 0, (blocks * (pools.max() + 1) + pools) % (num_pages * page), -1)
    keys = torch.randn(num_req, next_n, 128, generator=gen).to(torch.bfloat16)
    gates = (torch.randn(num_req, next_n, 128, generator=gen) * 3).to(torch.bfloat16)
    ape = torch.randn(p, 128, generator=gen)
    tail = torch.randn(num_req, 2, ring, 128, generator=gen).to(torch.bfloat16)
    kv = torch.randint(0, 256, (num_pages, page, 132), dtype=torch.uint8, generator=gen)
    ref_kv, ref_tail = kv.clone(), tail.clone()
    args = (tail_slots, keys, gates, ape, slot_mapping, positions, p)
    _with_backend("torch", lambda: kpool.kpool_decode_update_and_maybe_write_cache_batched(
        ref_kv, ref_tail, *args, layout=layout, fp8_dtype=fp8_dtype))
    got_kv, got_tail = kv.to(device), tail.to(device)
    _with_backend("triton", lambda: kpool.kpool_decode_update_and_maybe_write_cache_batched(
        got_kv, got_tail, *(a.to(device) for a in args[:-1]), p, layout=layout, fp8_dtype=fp8_dtype))
    return _diff(got_kv, ref_kv) + _diff(got_tail, ref_tail), got_kv.numel() + got_tail.numel() * 2


def _finite_codes(shape, fp8_dtype, gen):
    """Uniformly random finite codes of the format (every magnitude, subnormals, both zeros)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes = codes[~torch.isnan(codes.view(fp8_dtype).float())]
    return codes[torch.randint(0, codes.numel(), shape, generator=gen)]


def finite_pages_(pages: torch.Tensor, exps: torch.Tensor) -> torch.Tensor:
    """Valid e4m3fn entries in place (the scorers' benchmark and sanitizer caches): ``pages``
    uint8 ``[N, >= PAGE * 132]`` of random bytes (each page's ``PAGE * 128`` codes, then its
    ``PAGE`` fp32 scales, plain layout; a padded page stride allowed) gets its NaN codes (0x7F /
    0xFF) flipped to a finite neighbour and its scales set to ``2^(exps - 127)`` (``exps`` int32
    ``[N, PAGE]``). Returns ``pages``."""
    from kpool.layout import ENTRY_BYTES, HEAD_DIM
    page = exps.shape[1]
    codes = pages[:, : page * HEAD_DIM]
    codes.copy_(torch.where((codes & 0x7F) == 0x7F, codes ^ 1, codes))
    pages[:, page * HEAD_DIM: page * ENTRY_BYTES].view(torch.int32).copy_(exps << 23)
    return pages


@contextlib.contextmanager
def filter_decisions():
    """Record whether each fused selection's leaf launch inside the block filters (a list of
    bools, one per launch of several leaves: ``ops.score.wide_plan``'s FILTER; also the tests'
    record of it)."""
    from kpool.ops import score
    real, seen = score.wide_plan, []

    def spy(*args, **kwargs):
        plan = real(*args, **kwargs)
        if plan[1] > 1:
            seen.append(plan[2])
        return plan
    score.wide_plan = spy
    try:
        yield seen
    finally:
        score.wide_plan = real


def _random_paged_cache(requests, pools, fp8_dtype, layout, gen, page, dup_every=0):
    """The scoring checks' cache: every entry of a random-byte uint8 ``[pages, page, 132]`` cache
    rewritten with uniformly random finite codes and power-of-two scales (every 7th x 1.375);
    with ``dup_every`` > 0 every ``dup_every``-th entry a copy of a random one (same codes and
    scale: exact ties across leaves and pages). Returns ``(kv, page_table)``, the table int64
    ``[requests, cdiv(pools, page)]`` of shuffled distinct pages (one page left unused)."""
    from kpool.layout import write_entries
    pages_per = cdiv(pools, page)
    num_pages = requests * pages_per + 1
    kv = torch.randint(0, 256, (num_pages, page, 132), dtype=torch.uint8, generator=gen)
    slots = num_pages * page
    codes = _finite_codes((slots, 128), fp8_dtype, gen)
    scales = torch.exp2(torch.randint(-14, -4, (slots,), generator=gen).float())
    scales[::7] *= 1.375
    if dup_every:
        src = torch.randint(0, slots, (slots,), generator=gen)
        dup = torch.arange(slots) % dup_every == 0
        codes[dup], scales[dup] = codes[src[dup]], scales[src[dup]]
    write_entries(kv, torch.arange(slots), codes, scales, layout)
    page_table = torch.randperm(num_pages, generator=gen)[: requests * pages_per].view(requests, pages_per)
    return kv, page_table


def check_scores(num_req, n_pools, heads, select_k, fp8_dtype, layout, device, gen, page=64):
    """``paged_pool_logits`` and ``paged_pool_topk`` (Triton on ``device``) vs the torch
    reference on the CPU: requests of up to ``n_pools`` random pools each (uniformly random
    finite codes, power-of-two and other scales) on shuffled pages of a random-byte cache,
    random visible counts (some at most ``select_k``). Returns ``(differing values, compared,
    filtered)``: logits compared as fp32 bits (any NaN matches any NaN), selections as int32;
    ``filtered``: whether the fused selection's leaves filtered (``score.wide_plan``)."""
    import kpool
    from kpool import reference

    kv, page_table = _random_paged_cache(num_req, n_pools, fp8_dtype, layout, gen, page)
    pool_lens = torch.randint(0, n_pools + 1, (num_req, 1), generator=gen)
    few = max(1, num_req // 8)  # rows seeing at most select_k pools
    pool_lens[:few] = torch.randint(0, select_k + 1, (few, 1), generator=gen)
    q = _finite_codes((num_req, 1, heads, 128), fp8_dtype, gen).view(fp8_dtype)
    w = torch.randn(num_req, 1, heads, generator=gen) * 0.05
    args = (q, kv, w, pool_lens, page_table)
    opts = dict(layout=layout, fp8_dtype=fp8_dtype, max_pools=n_pools)
    want = _with_backend("torch", lambda: kpool.paged_pool_logits(*args, **opts))
    want_ids = reference.select_pools(want, pool_lens.view(-1), select_k)
    dev = tuple(a.to(device) for a in args)
    got = _with_backend("triton", lambda: kpool.paged_pool_logits(*dev, **opts)).cpu()
    with filter_decisions() as filtered:
        got_ids = _with_backend("triton", lambda: kpool.paged_pool_topk(*dev, select_k, **opts)).cpu()
    same = (got.view(torch.int32) == want.view(torch.int32)) | (torch.isnan(got) & torch.isnan(want))
    return int((~same).sum()) + int((got_ids != want_ids).sum()), got.numel() + got_ids.numel(), any(filtered)


def random_selection_case(gen, max_rows_x_pools=1 << 20):
    """One random ``check_selection`` case: a dict of ``requests``, ``next_n``, ``pools`` (the
    longest row's), ``heads``, ``select_k``, ``dup_every``, ``expand``, ``round_width`` (the
    expansion's width rounded up to a multiple of 128) and the fp8 format / layout, drawn so
    that rows x pools stays under ``max_rows_x_pools``."""
    def pick(options):
        return options[int(torch.randint(0, len(options), (1,), generator=gen))]

    next_n = pick((1, 1, 2, 3, 4, 5, 256))  # 256: a prefill chunk's rows (KPoolCache scores them as one request)
    requests = pick((1, 2, 3, 8, 17, 32, 64))
    select_k = pick((1, 7, 64, 256, 512, 512, 1024, 2048))
    cap = max(64, max_rows_x_pools // (requests * next_n))
    pools = int(torch.randint(1, cap + 1, (1,), generator=gen))
    return dict(requests=requests, next_n=next_n, pools=pools, heads=pick((16, 32, 32, 64)), select_k=select_k,
                dup_every=pick((0, 0, 3, 50)), expand=pick((False, True)), round_width=pick((False, True)),
                fp8_dtype=pick((torch.float8_e4m3fn, torch.float8_e4m3fnuz)), layout=pick(("plain", "preshuffle")))


def check_selection(case, device, gen, page=64):
    """``paged_pool_topk`` (Triton on ``device``, with and without its fused expansion) vs the
    torch reference on the CPU for one ``random_selection_case``: ``next_n`` rows per request
    whose visible counts grow along the step (a verify step, or a prefill chunk's rows as
    ``KPoolCache.topk_indices`` scores them), some requests at most ``select_k`` pools, and with
    ``dup_every`` > 0 every ``dup_every``-th entry a copy of a random one (same codes and scale:
    exact ties across leaves and pages). Returns ``(differing values, compared, filtered)``."""
    import kpool
    from kpool import reference

    b, n, pools, k = case["requests"], case["next_n"], case["pools"], case["select_k"]
    fp8_dtype, layout = case["fp8_dtype"], case["layout"]
    kv, page_table = _random_paged_cache(b, pools, fp8_dtype, layout, gen, page, case["dup_every"])
    last = torch.randint(0, pools + 1, (b, 1), generator=gen)
    last[: max(1, b // 8)] = torch.randint(0, min(k, pools) + 1, (max(1, b // 8), 1), generator=gen)
    steps = torch.randint(0, 2, (b, n), generator=gen)  # row j sees the pools of rows > j less their steps
    pool_lens = (last - (steps.flip(1).cumsum(1).flip(1) - steps)).clamp_min(0)
    q = _finite_codes((b, n, case["heads"], 128), fp8_dtype, gen).view(fp8_dtype)
    w = torch.randn(b, n, case["heads"], generator=gen) * 0.05
    args = (q, kv, w, pool_lens, page_table)
    opts = dict(layout=layout, fp8_dtype=fp8_dtype, max_pools=pools)
    want = reference.select_pools(_with_backend("torch", lambda: kpool.paged_pool_logits(*args, **opts)),
                                  pool_lens.view(-1), k)
    dev = tuple(a.to(device) for a in args)
    with filter_decisions() as filtered:
        got = _with_backend("triton", lambda: kpool.paged_pool_topk(*dev, k, **opts)).cpu()
    diff, total = int((got != want).sum()), got.numel()
    if case["expand"]:
        p = 4
        seq_lens = (pool_lens.view(-1) * p + torch.randint(0, p, (b * n,), generator=gen)).to(torch.int32)
        width = cdiv(k * p + p - 1, 128) * 128 if case["round_width"] else None
        want_tok = reference.expand_pools_and_append_tail(want, seq_lens, p, width=width)
        got_tok = _with_backend("triton", lambda: kpool.paged_pool_topk(
            *dev, k, **opts, expand=(seq_lens.to(device), p, width))).cpu()
        diff, total = diff + int((got_tok != want_tok).sum()), total + got_tok.numel()
    return diff, total, any(filtered)


def decode_cases(p, many):
    """``(ring multiple, next_n, requests)`` of the decode checks: plain decode and a 4-token
    verify step, each with many requests and with 64 (every warp count of ``decode.decode_warps``
    and register cap of ``decode.decode_options``),
    and a verify step longer than a pool (``next_n = P + 1``: two completions in one step, the
    later one from this step's own tokens) at the least ring it allows (RING = 2P = P + next_n - 1)."""
    return ((1, 1, many), (1, 1, 64), (2, 4, many), (2, 4, 64), (2, p + 1, 64), (2, p + 1, many))


OPS = ("compress", "decode", "score", "select")


def _op_list(text: str) -> tuple:
    ops = tuple(o.strip() for o in text.split(",") if o.strip())
    unknown = [o for o in ops if o not in OPS]
    if unknown or not ops:
        raise argparse.ArgumentTypeError(f"--ops takes a comma list of {OPS}, got {text!r}")
    return ops


def _shape_list(text: str) -> tuple:
    """``--score-shapes``: ``"32x16384,2x32768"`` -> ``((32, 16384), (2, 32768))``."""
    try:
        shapes = tuple(tuple(int(n) for n in item.strip().split("x")) for item in text.split(",") if item.strip())
    except ValueError:
        shapes = ()
    if not shapes or any(len(sh) != 2 or min(sh) < 1 for sh in shapes):
        raise argparse.ArgumentTypeError(f"--score-shapes takes a comma list of REQUESTSxPOOLS, got {text!r}")
    return shapes


def run_checks(ops, pools, decode_requests, score_shapes, heads, device, gen, log=print,
               select_cases=0, select_budget_s=float("inf"), select_size=1 << 20):
    """The cases of ``ops`` (a subset of ``OPS``) on ``device``; returns ``(rows, differing)``:
    one dict per case and the total of differing bytes / values. ``log`` gets one line per case.
    ``score``: ``check_scores`` at each ``(requests, pools)`` of ``score_shapes``, for each of ``heads``.
    ``select``: ``select_cases`` random ``check_selection`` cases of at most ``select_size``
    rows x pools, none started after ``select_budget_s`` seconds."""
    rows, bad = [], 0
    for p in (4, 16):
        for fp8 in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
            for layout in ("plain", "preshuffle") if "compress" in ops else ():
                t0 = time.perf_counter()
                diff, total = check_compress(pools, p, fp8, layout, device, gen)
                rows.append(dict(op="compress", P=p, fp8=str(fp8), layout=layout, pools=pools,
                                 bytes_compared=total, differing_bytes=diff))
                log(f"compress P={p:2d} {str(fp8):22s} {layout:10s} pools={pools} "
                    f"differing bytes {diff} / {total}  ({time.perf_counter() - t0:.1f}s)")
                bad += diff
            for ring_mult, next_n, num_req in decode_cases(p, decode_requests) if "decode" in ops else ():
                diff, total = check_decode(num_req, next_n, p, p * ring_mult, fp8, "plain", device, gen)
                rows.append(dict(op="decode", P=p, fp8=str(fp8), ring=p * ring_mult, next_n=next_n,
                                 requests=num_req, bytes_compared=total, differing_bytes=diff))
                log(f"decode   P={p:2d} {str(fp8):22s} ring={p * ring_mult} next_n={next_n} "
                    f"requests={num_req} differing bytes {diff} / {total}")
                bad += diff
    for (requests, n_pools), h in itertools.product(score_shapes, heads) if "score" in ops else ():
        for fp8 in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
            for layout in ("plain", "preshuffle"):
                t0 = time.perf_counter()
                diff, total, filtered = check_scores(requests, n_pools, h, 512, fp8, layout, device, gen)
                rows.append(dict(op="score", H=h, fp8=str(fp8), layout=layout, requests=requests,
                                 pools=n_pools, filtered=filtered, values_compared=total, differing_values=diff))
                log(f"score    H={h} {str(fp8):22s} {layout:10s} requests={requests} "
                    f"pools={n_pools} {'filtered' if filtered else 'exact leaves'} "
                    f"differing values {diff} / {total}  ({time.perf_counter() - t0:.1f}s)")
                bad += diff
    t_start = time.perf_counter()
    for i in range(select_cases if "select" in ops else 0):
        if time.perf_counter() - t_start > select_budget_s:
            log(f"select   stopped after {i} cases (--select-budget-s {select_budget_s:g})")
            break
        case = random_selection_case(gen, select_size)
        t0 = time.perf_counter()
        diff, total, filtered = check_selection(case, device, gen)
        desc = " ".join(f"{key}={str(v).replace('torch.float8_', '')}" for key, v in case.items())
        rows.append(dict(op="select", **{key: str(v) for key, v in case.items()}, filtered=filtered,
                         values_compared=total, differing_values=diff))
        log(f"select   {desc} {'filtered' if filtered else 'exact leaves'} "
            f"differing values {diff} / {total}  ({time.perf_counter() - t0:.1f}s)")
        bad += diff
    return rows, bad


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ops", type=_op_list, default=OPS, help="comma list of compress, decode, score, select")
    parser.add_argument("--pools", type=int, default=65536)
    parser.add_argument("--decode-requests", type=int, default=2048)
    parser.add_argument("--score-shapes", type=_shape_list, default=((32, 16384), (2, 32768), (8, 8192)),
                        help="comma list of REQUESTSxPOOLS for the scoring cases")
    parser.add_argument("--heads", type=lambda t: tuple(int(h) for h in t.split(",")), default=(32,),
                        help="comma list of H for the scoring cases")
    parser.add_argument("--select-cases", type=int, default=40, help="random selection cases (--ops select)")
    parser.add_argument("--select-size", type=int, default=1 << 20, help="most rows x pools of a selection case")
    parser.add_argument("--select-budget-s", type=float, default=float("inf"),
                        help="start no selection case after this many seconds")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no GPU: this run compares GPU kernels with the CPU oracle", file=sys.stderr)
        return 2
    rows, bad = run_checks(args.ops, args.pools, args.decode_requests, args.score_shapes, args.heads,
                           torch.device("cuda"), torch.Generator().manual_seed(1234),
                           log=lambda line: print(line, flush=True), select_cases=args.select_cases,
                           select_budget_s=args.select_budget_s, select_size=args.select_size)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                           triton=__import__("triton").__version__, rows=rows), f, indent=2)
    print("EXACT" if bad == 0 else f"MISMATCH: {bad} differing bytes")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
