#!/usr/bin/env python
"""Host time of ``KPoolCache`` steps: what the CPU spends planning a step before it returns.

    python benchmarks/bench_host.py [--quick] [--out results/host_cpu.json] [--readme README.md]
    python benchmarks/bench_host.py --from results/host_h200.json --readme README.md
    TRITON_INTERPRET=1 KPOOL_BACKEND=triton python benchmarks/bench_host.py --stub launches --only "B=1 "

A serving engine calls ``prefill`` / ``decode`` + ``accept`` / ``topk_indices`` once per
layer and step, on the thread that launches the model's kernels: the bookkeeping (slot
mappings, ring slots, page tables, row plans) and the uploads are time no GPU hides.
Cases (GLM-5.3-Flash geometry: P = 4, page 64, RING 8 for 3 drafts, 32 heads):

* ``prefill``: ``R`` new requests of ``L`` tokens each, packed (``cu_seqlens``);
* ``decode``: a ``decode`` of ``next_n`` tokens per request then ``accept`` of one token each,
  ``B`` requests at ``ctx`` tokens of context (``lists``: request ``i`` sends ``1 + i % next_n``
  tokens as a list of ``[n_i, 128]`` tensors, which the cache pads);
* ``write_layer``: that decode step written into another layer's buffers (what each further
  layer of a model costs once one cache planned the step);
* ``topk_indices``: the selection of the ``B x next_n`` rows of that decode step (``next layer``:
  another layer's selection of the same step, from that layer's buffers, once the first
  layer's call planned the step: what each further layer costs).

Timing: ``time.perf_counter`` around each call; ``--rounds`` passes over every case of
``--reps`` calls each, the median (p20 / p80 kept) over all of a case's calls.
On a GPU the kernels run for real and the time is the host's until the call returns (the
stream is synchronized before each call, never inside it). Off the GPU the kernels would
run synchronously on the CPU, so their entry points in ``kpool.cache`` are replaced by
stubs that only allocate their outputs (``"kernels": "stubbed"`` in the JSON): the time is
the planning alone. The JSON records the machine, versions and commit; ``--readme``
rewrites the README's table between ``<!-- host:start -->`` and ``<!-- host:end -->`` (stubbed
kernels) or ``<!-- host-gpu:start -->`` and ``<!-- host-gpu:end -->`` (a GPU run); ``--from``
renders a stored JSON (e.g. one a device run wrote) instead of measuring.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
try:
    import kpool
except ImportError:
    sys.path.insert(0, str(ROOT / "src"))
    import kpool

import kpool.cache as cache_mod  # noqa: E402
from kpool.layout import cdiv  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, str(BENCH_DIR))
from harness import _quantile, git_info  # noqa: E402

P, PAGE, SPEC, HEADS, INDEX_TOPK = 4, 64, 3, 32, 2048
START, END = "<!-- host:start -->", "<!-- host:end -->"
GPU_START, GPU_END = "<!-- host-gpu:start -->", "<!-- host-gpu:end -->"


def markers(doc: dict) -> tuple[str, str]:
    """The README section of a run: the CPU one (kernels stubbed) or the GPU one."""
    sections = {"stubbed": (START, END), "real": (GPU_START, GPU_END)}
    kernels = doc["environment"]["kernels"]
    if kernels not in sections:
        raise SystemExit(f"a run with kernels {kernels!r} has no README section (it is for A/Bs)")
    return sections[kernels]


def cases(quick: bool) -> list[dict]:
    """Prefill batches and decode batches (with their selection), smallest first."""
    batches = [1, 64, 256] if quick else [1, 64, 256, 1024]
    out = [{"op": "prefill", "R": r, "L": n} for r, n in ([(1, 8192), (64, 1024)] if quick else
                                                        [(1, 8192), (64, 1024), (256, 1024)])]
    for b in batches:
        for n in (1, 4):
            out.append({"op": "decode", "B": b, "next_n": n, "ctx": 4096})
        if b == 256:
            out.append({"op": "decode", "B": b, "next_n": 4, "ctx": 4096, "lists": True})
        out.append({"op": "write_layer", "B": b, "next_n": 4, "ctx": 4096})
        out.append({"op": "topk_indices", "B": b, "next_n": 4, "ctx": 4096})
        out.append({"op": "topk_indices", "B": b, "next_n": 4, "ctx": 4096, "layer": True})
    return out


def label(case: dict) -> str:
    if case["op"] == "prefill":
        return f"prefill R={case['R']} L={case['L']}"
    op = "decode + accept" if case["op"] == "decode" else case["op"]
    form = " (lists of 1..next_n)" if case.get("lists") else " (next layer)" if case.get("layer") else ""
    return f"{op}{form} B={case['B']} next_n={case['next_n']} ctx={case['ctx']}"


def stubs() -> dict:
    """Stand-ins for the kernel entry points ``kpool.cache`` calls (CPU runs): each only
    allocates its outputs. ``main`` installs them as attributes of ``kpool.cache``."""
    def launch(*args, **kwargs):
        return None

    def quantize_queries(q, weights, **kwargs):
        return torch.empty(q.shape, dtype=torch.uint8), None, torch.empty(weights.shape)

    def launch_paged_pool_topk(q8, kv_cache, w, pool_lens, page_table, select_k, fp8_dtype, layout, max_pools,
                               expand):
        return torch.empty((pool_lens.numel(), expand[2]), dtype=torch.int32)

    def expand(ids, seq_lens, pool_size, *, width):
        return torch.empty((ids.shape[0], width), dtype=torch.int32)

    return {"launch_prefill": launch, "launch_decode_update": launch,
            "quantize_queries": quantize_queries, "launch_paged_pool_topk": launch_paged_pool_topk,
            "expand_pools_and_append_tail": expand}


def stub_launches() -> None:
    """Every Triton kernel launch returns at once (CPU, Triton's interpreter): the ops run their
    checks and launch set-up, no kernel. The outputs hold whatever ``torch.empty`` gave."""
    from kpool import _interpreter
    from triton.runtime.interpreter import InterpretedFunction
    if os.environ.get("KPOOL_BACKEND") != "triton" or not _interpreter.ensure_exact_downcasts():
        raise SystemExit("--stub launches runs under TRITON_INTERPRET=1 KPOOL_BACKEND=triton")
    InterpretedFunction.run = lambda self, *args, **kwargs: None


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6


def _cache(device, requests: int, tokens: int):
    pages = requests * (cdiv(tokens, P * PAGE) + 1) + 1
    ape = torch.randn(P, 128, generator=torch.Generator().manual_seed(0))
    return kpool.KPoolCache(pages, page_size=PAGE, pool_size=P, max_requests=requests, max_spec_tokens=SPEC,
                            ape=ape, device=device)


def _rows(device, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 128, generator=g).to(torch.bfloat16).to(device)


def _fill(cache, ids, ctx, device, layer=None, group=64) -> None:
    """Prefill ``ctx`` tokens for each id, ``group`` requests per call (one shared key tensor),
    each step also written into ``layer`` (``(kv_cache, tail, ape)``) when given."""
    key = _rows(device, group * ctx, 1)
    for i in range(0, len(ids), group):
        part = ids[i:i + group]
        rows = key[: len(part) * ctx]
        cache.prefill(part, rows, rows, cu_seqlens=[j * ctx for j in range(len(part) + 1)])
        if layer is not None:
            cache.write_layer(layer[0], layer[1], rows, rows, layer[2])


def measure(case: dict, device, reps: int) -> list[float]:
    """Host microseconds of ``reps`` calls of the case's step."""
    times = []
    if case["op"] == "prefill":
        r, n = case["R"], case["L"]
        cache = _cache(device, r, n)
        key = _rows(device, r * n, 2)
        cu = [i * n for i in range(r + 1)]
        for k in range(reps + 1):
            ids = [f"p{k}-{i}" for i in range(r)]
            t = _timed(lambda: cache.prefill(ids, key, key, cu_seqlens=cu), device)
            times.append(t)
            for rid in ids:
                cache.free(rid)
        return times[1:]
    b, n = case["B"], case["next_n"]
    cache = _cache(device, b, case["ctx"] + (reps + 1) * (n + 1))
    ids = [f"r{i}" for i in range(b)]
    layer = cache.layer_buffers() + (cache.ape,) if case["op"] == "write_layer" or case.get("layer") else None
    _fill(cache, ids, case["ctx"], device, layer)
    step = _rows(device, b * n, 3).view(b, n, 128)
    q = torch.randn(b * n, HEADS, 128, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16).to(device)
    w = torch.randn(b * n, HEADS, generator=torch.Generator().manual_seed(5)).to(device)
    ones = [1] * b
    if case.get("lists"):  # request i sends 1 + i % next_n tokens
        step = [step[i, : 1 + i % n] for i in range(b)]
    for _ in range(reps + 1):
        if case["op"] == "decode":
            times.append(_timed(lambda: (cache.decode(ids, step, step), cache.accept(ids, ones)), device))
        elif case["op"] == "write_layer":
            cache.decode(ids, step, step)
            times.append(_timed(lambda: cache.write_layer(layer[0], layer[1], step, step, layer[2]), device))
            cache.accept(ids, ones)
        else:
            cache.decode(ids, step, step)
            if layer is not None:  # the next layer's selection: layer 0's call planned the step
                cache.write_layer(layer[0], layer[1], step, step, layer[2])
                cache.topk_indices(ids, q, w, index_topk=INDEX_TOPK)
            kv = None if layer is None else layer[0]
            times.append(_timed(lambda: cache.topk_indices(ids, q, w, index_topk=INDEX_TOPK, kv_cache=kv), device))
            cache.accept(ids, ones)
    return times[1:]


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else the platform's processor string."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device, kernels: str) -> dict:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "cpu": cpu_name(),
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "kernels": kernels,
        "git": git_info(),
    }


def table(doc: dict) -> str:
    env = doc["environment"]
    commit = (env["git"].get("commit") or "?")[:12]
    lines = [f"<!-- generated by benchmarks/bench_host.py into {doc['path']}; do not edit -->", "",
             f"Host time per call, µs (median; p20-p80), {env['device']} ({env['cpu']}, {env['threads']} threads), "
             f"torch {env['torch']}, commit `{commit}`, kernels {env['kernels']}:", "",
             "| step | µs | p20-p80 |", "|---|---:|---|"]
    for rec in doc["records"]:
        lines.append(f"| {rec['label']} | {rec['us']:.0f} | {rec['p20_us']:.0f}-{rec['p80_us']:.0f} |")
    return "\n".join(lines)


def write_readme(path: Path, doc: dict) -> None:
    start, end = markers(doc)
    body = path.read_text()
    if start not in body or end not in body:
        raise SystemExit(f"{path} has no {start} ... {end} section")
    head, rest = body.split(start, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{start}\n{table(doc)}\n{end}{tail}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller batches (CI smoke)")
    ap.add_argument("--reps", type=int, default=10, help="timed calls per case and round")
    ap.add_argument("--rounds", type=int, default=3, help="passes over every case (the median is over all calls)")
    ap.add_argument("--only", default=None, help="regular expression: run the cases whose label matches")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--out", default=None, help="write the JSON here")
    ap.add_argument("--readme", default=None, help="rewrite this README's host-time section from the run")
    ap.add_argument("--stub", choices=("ops", "launches"), default="ops",
                    help="off the GPU: replace the cache's kernel entry points (the planning alone: the README's table), "
                         "or only Triton's launches (the ops' checks and launch set-up too; needs TRITON_INTERPRET=1 "
                         "KPOOL_BACKEND=triton, for A/Bs of the host path)")
    ap.add_argument("--from", dest="source", default=None, help="render this stored JSON (with --readme), measure nothing")
    args = ap.parse_args(argv)
    if args.source:
        if not args.readme:
            ap.error("--from needs --readme")
        doc = dict(json.loads(Path(args.source).read_text()), path=args.source)  # the header names that file
        write_readme(Path(args.readme), doc)
        return 0
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    kernels = "real" if device.type == "cuda" else {"ops": "stubbed", "launches": "launches stubbed"}[args.stub]
    if kernels == "stubbed":
        for name, fn in stubs().items():
            setattr(cache_mod, name, fn)
    elif kernels == "launches stubbed":
        stub_launches()
    chosen = [c for c in cases(args.quick) if not args.only or re.search(args.only, label(c))]
    times = {label(c): [] for c in chosen}
    for r in range(args.rounds):  # rounds over all cases: a slow spell of the machine hits them all
        for case in chosen:
            times[label(case)] += measure(case, device, args.reps)
            if r == args.rounds - 1:
                us = times[label(case)]
                print(f"{label(case):<40} {statistics.median(us):>10.0f} us  (p20 {_quantile(us, 0.2):.0f}, "
                      f"p80 {_quantile(us, 0.8):.0f})", flush=True)
    records = [dict(c, label=label(c), us=statistics.median(times[label(c)]), p20_us=_quantile(times[label(c)], 0.2),
                    p80_us=_quantile(times[label(c)], 0.8), reps=len(times[label(c)])) for c in chosen]
    doc = {"environment": environment(device, kernels), "records": records, "path": args.out or "-"}
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    if args.readme:
        write_readme(Path(args.readme), doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
