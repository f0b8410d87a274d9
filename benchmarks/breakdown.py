#!/usr/bin/env python
"""Per-kernel GPU time of chosen benchmark cases (where a step's time goes).

    KPOOL_PDL=0 python benchmarks/breakdown.py --op score --cases 'decode B=32 ctx=128K' [--src TREE] --out k.json

Runs each matching case's ``ours`` (or ``--impl``) eagerly over rotated input sets (as
``run_all.py`` builds them) under ``torch.profiler`` and prints, per kernel name in launch
order, its calls per step and mean device time, with the step's kernel-time sum. With PDL on,
a kernel's interval includes its wait for the previous one (it starts early), so per-kernel
times are meaningful with ``KPOOL_PDL=0``; the sum is then the serialized step, an upper
bound of the graph-replayed time ``run_all.py`` reports. ``--out`` writes the table as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import defaultdict
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))


def kernel_table(fn, sets, steps: int) -> list:
    """Profile ``steps`` eager calls of ``fn`` (set ``k % len(sets)``): ``[{name, calls, us}]`` per
    kernel name in first-launch order, ``calls`` per step and ``us`` the mean device time per call."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    for s in sets:  # compile and warm up
        fn(*s)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for k in range(steps):
            fn(*sets[k % len(sets)])
        torch.cuda.synchronize()
    total, calls, order = defaultdict(float), defaultdict(int), {}
    for ev in prof.events():
        if ev.device_type.name != "CUDA" or ev.device_time_total <= 0:
            continue
        order.setdefault(ev.name, len(order))
        total[ev.name] += ev.device_time_total
        calls[ev.name] += 1
    return [{"name": n, "calls": calls[n] / steps, "us": total[n] / calls[n]} for n in sorted(order, key=order.get)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--op", required=True)
    ap.add_argument("--cases", default=".", help="regular expression on case labels")
    ap.add_argument("--impl", default="ours")
    ap.add_argument("--sets", type=int, default=4, help="input sets rotated over (cold-ish L2)")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--src", default=str(BENCH_DIR.parent / "src"), help="the src tree holding kpool (an A/B variant)")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(args.src).resolve()))

    import harness
    ctx = harness.Ctx("full", "cuda", check=False)
    mod = harness.load_op_module(args.op)
    results = []

    def run(fn, make_set, **_):
        rows = kernel_table(fn, [make_set(i) for i in range(args.sets)], args.steps)
        step = sum(r["us"] * r["calls"] for r in rows)
        for r in rows:
            print(f"  {r['calls']:5.2f} x {r['us']:9.2f} us  {r['name'][:110]}")
        print(f"  step (serialized kernel time): {step:.2f} us", flush=True)
        results.append({"case": label, "impl": args.impl, "pdl": os.environ.get("KPOOL_PDL", "1"),
                        "kernels": rows, "step_us": step})
        return {"us": step}

    ctx.run = run
    for case in mod.cases("full"):
        label = case["label"]
        if re.search(args.cases, label):
            print(f"{args.op} / {label} / {args.impl}:", flush=True)
            mod.bench(ctx, case, args.impl)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
