#!/usr/bin/env python
"""A/B timing of chosen benchmark cases across source trees and patches.

    python benchmarks/ab.py --op score --cases 'decode B=32 ctx=128K|decode B=128 ctx=1M' \\
        --variant main=src \\
        --variant both96=../wt-both/src::'import kpool.ops.score as s; s.FILTER_MAX_REGS = 96'

Each ``--variant NAME=SRC[::PATCH]`` runs in its own process: ``SRC`` (a ``src`` tree holding
``kpool``) first on ``sys.path``, then ``PATCH`` (Python, run after importing kpool and
before any kernel compiles: module constants such as register caps or tile sizes), then the
op's cases whose label matches ``--cases`` (a regular expression), timed as ``run_all.py``
times them (CUDA-graph replay of small launches, inputs rotated for a cold L2, median) but
without the byte checks. One line per (variant, case, impl); ``--out`` also writes them as
JSON, with each variant's environment (GPU, versions, commit, source digest, patch). For
comparisons only: the README's numbers come from ``run_all.py`` records.

``--occupy-sms 0,39`` times every case once per listed count of SMs held by a spinning
kernel (``occupy.py``: on an H100, 39 held leave each other SM about an H200's share of the
bandwidth), with the copy bandwidth measured under the same hold.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent


def parse_variant(text: str) -> dict:
    """``NAME=SRC[::PATCH]`` -> ``{"name", "src", "patch"}`` (SRC made absolute)."""
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        raise argparse.ArgumentTypeError(f"--variant takes NAME=SRC[::PATCH], got {text!r}")
    src, _, patch = rest.partition("::")
    return {"name": name, "src": str(Path(src).resolve()), "patch": patch}


def run_variant(variant: dict, op: str, cases: str, impls: list, mode: str, device: str, seed_path,
                occupy_sms=(0,)) -> list:
    """This process times ``variant`` (its tree already first on ``sys.path``): records."""
    sys.path.insert(0, str(BENCH_DIR))
    import harness
    import kpool  # noqa: F401  (the variant's tree)
    if variant["patch"]:
        exec(variant["patch"], {})
    seed, err = harness.load_seed(seed_path or harness.default_seed_path())
    ctx = harness.Ctx(mode, device, seed, err, check=False)
    mod = harness.load_op_module(op)
    meta = dict(harness.environment(ctx, seed_path), variant=variant["name"], patch=variant["patch"], holds=[])
    out = [meta]
    for n in occupy_sms:
        if n:
            import occupy
            ctx.occupier = occupy.Occupier(n, ctx.device)
        hold = dict(occupy_sms=n, copy_gbps=ctx.measure_copy()["gbps"] if ctx.cuda else None)
        for case in mod.cases(mode):
            if not re.search(cases, case["label"]):
                continue
            for impl in impls or mod.impls(case):
                rec = mod.bench(ctx, case, impl)
                out.append({"variant": variant["name"], "case": case["label"], "impl": impl, "us": rec.get("us"),
                            "occupy_sms": n, "kpool_file": kpool.__file__})
                print(f"{variant['name']:14s} {case['label']:34s} {impl:12s} held {n:3d} "
                      f"{rec.get('us') or float('nan'):10.3f} us", flush=True)
        if ctx.occupier is not None:
            hold.update(ctx.occupier.report())
            ctx.occupier = None
        meta["holds"].append(hold)
        print(f"{variant['name']:14s} held {n:3d}: {hold}", flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--op", required=True, help="bench module: compress, prefill, decode, expand, seed_tail, score")
    p.add_argument("--cases", default=".", help="regular expression on the case labels")
    p.add_argument("--impls", default="ours", help="comma-separated implementations (default: ours)")
    p.add_argument("--variant", type=parse_variant, action="append", default=[], help="NAME=SRC[::PATCH]")
    p.add_argument("--mode", default="full", choices=("full", "quick", "dry"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed-path", default=None)
    p.add_argument("--occupy-sms", default="0", help="comma-separated counts of SMs held while timing (occupy.py)")
    p.add_argument("--out", default=None, help="JSON of the records and each variant's environment")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # JSON of one variant: run it here
    a = p.parse_args(argv)
    impls = [i for i in a.impls.split(",") if i]
    holds = [int(n) for n in a.occupy_sms.split(",") if n]
    if any(holds) and a.device == "cpu":
        p.error("--occupy-sms holds SMs of a CUDA device: use 0 with --device cpu")
    if not a.child and not a.variant:
        p.error("at least one --variant NAME=SRC[::PATCH]")
    if a.child:
        recs = run_variant(json.loads(a.child), a.op, a.cases, impls, a.mode, a.device, a.seed_path, holds)
        print("AB-RECORDS " + json.dumps(recs), flush=True)
        return 0
    records, variants = [], []
    for v in a.variant:
        env = dict(os.environ, PYTHONPATH=v["src"] + os.pathsep + os.environ.get("PYTHONPATH", ""))
        cmd = [sys.executable, __file__, "--op", a.op, "--cases", a.cases, "--impls", a.impls, "--mode", a.mode,
               "--device", a.device, "--occupy-sms", a.occupy_sms, "--child", json.dumps(v)]
        if a.seed_path:
            cmd += ["--seed-path", a.seed_path]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        for line in proc.stdout.splitlines():
            if line.startswith("AB-RECORDS "):
                meta, *recs = json.loads(line[len("AB-RECORDS "):])
                variants.append(meta)
                records += recs
            else:
                print(line, flush=True)
        if proc.returncode:
            print(f"{v['name']}: exit {proc.returncode}\n{proc.stderr[-2000:]}", file=sys.stderr, flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"op": a.op, "cases": a.cases, "mode": a.mode, "variants": variants, "records": records}, f,
                      indent=1)
    return 0 if records else 1


if __name__ == "__main__":
    sys.exit(main())
