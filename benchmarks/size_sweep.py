#!/usr/bin/env python
"""Time against size for one benchmark case: how much of a call is a fixed cost.

    python benchmarks/size_sweep.py --op compress --case 'P=4 pools=65536' --key pools \
        --sizes 16384,32768,65536,131072,262144,524288 --impls ours,seed,copy --out $OUT/sweep.json

Takes the case of ``--op`` whose label is ``--case`` (``run_all.py``'s full mode), sets its
``--key`` parameter to each size (the label follows), times each impl as ``run_all.py`` does
(graph replay, no checks) and fits ``us = fixed + size * per_unit`` per impl by least squares.
``fixed`` is what every call pays whatever its size (launch, ramp-up, drain); the steady
fraction, floor per unit / ``per_unit``, is what longer calls approach. The impl ``copy`` is a
streaming kernel moving the case's bytes (``Ctx.copy_unit``, graph replay like the ops): its fit is
the fixed cost any kernel of that size pays. ``--sustain-s S`` also replays each point's graph back
to back for S seconds while sampling the SM clock, board power and throttle reasons (``Ctx.sustain_s``):
whether a call's time at a size depends on a clock the GPU cannot hold. The JSON holds the
environment (GPU, versions, commit), the copy bandwidth, every record and the fits.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``(fixed, per_unit)`` of ``y = fixed + x * per_unit`` over ``(x, y)`` points."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    per_unit = sum((x - mx) * (y - my) for x, y in points) / sxx
    return my - per_unit * mx, per_unit


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--op", required=True, help="bench module: compress, prefill, ...")
    p.add_argument("--case", required=True, help="label of the full-mode case to scale, e.g. 'P=4 pools=65536'")
    p.add_argument("--key", required=True, help="the case parameter to set to each size, e.g. pools")
    p.add_argument("--sizes", required=True, help="comma-separated sizes")
    p.add_argument("--impls", default="ours,seed,copy",
                   help="comma-separated implementations; copy: a streaming kernel moving the same bytes")
    p.add_argument("--mode", default="full", choices=("full", "dry"), help="dry: the interpreter, tiny sizes")
    p.add_argument("--device", default="cuda")
    p.add_argument("--sustain-s", type=float, default=0.0,
                   help="also replay each point back to back this many seconds, sampling clocks and power")
    p.add_argument("--out", default=None, help="JSON path")
    a = p.parse_args(argv)

    import harness
    seed_path = harness.default_seed_path()
    seed, err = harness.load_seed(seed_path)
    ctx = harness.Ctx(a.mode, a.device, seed, err, check=False)
    ctx.sustain_s = a.sustain_s
    mod = harness.load_op_module(a.op)
    base = next((c for c in mod.cases("full") if c["label"] == a.case), None)
    if base is None or a.key not in base:
        p.error(f"no full-mode case labelled {a.case!r} with a parameter {a.key!r} in bench_{a.op}")
    copy = ctx.measure_copy()["gbps"] if ctx.cuda else None
    print(f"copy bandwidth: {copy} GB/s", flush=True)
    impls = a.impls.split(",")
    if impls == ["copy"]:
        p.error("--impls copy times the bytes of another impl's record: name one beside it")
    impls = [i for i in impls if i != "copy"] + ["copy"] * ("copy" in impls)  # copy last: it needs the bytes
    records, old = [], f"{a.key}={base[a.key]}"
    for size in (int(s) for s in a.sizes.split(",")):
        case = dict(base, **{a.key: size, "label": base["label"].replace(old, f"{a.key}={size}")})
        for impl in impls:
            if impl == "copy":
                rec = ctx.copy_unit(next(r["bytes"] for r in records if r["size"] == size and r["bytes"]))
            else:
                rec = mod.bench(ctx, case, impl)
            floor = rec["bytes"] / copy / 1e3 if copy and rec.get("bytes") else None
            sustained = {k: v for k, v in rec.items() if k.startswith(("us_sustained", "sustained_"))}
            records.append(dict(case=case["label"], size=size, impl=impl, us=rec.get("us"), bytes=rec.get("bytes"),
                                floor_us=floor, **sustained))
            frac = f"{floor / rec['us']:.3f} of copy BW" if floor and rec.get("us") else ""
            load = (f"  sustained {sustained['us_sustained']:.3f} us at {sustained['sustained_sm_mhz']} MHz, "
                    f"{sustained['sustained_power_w']} W, throttle {sustained['sustained_throttle_mask']}"
                    if sustained.get("us_sustained") else "")
            print(f"{case['label']:28s} {impl:6s} {rec.get('us') or float('nan'):12.3f} us  {frac}{load}", flush=True)
    fits = {}
    for impl in impls:
        rs = [r for r in records if r["impl"] == impl and r["us"]]
        if len(rs) < 2:
            continue
        fixed, per_unit = fit([(r["size"], r["us"]) for r in rs])
        steady = (sum(r["floor_us"] / r["size"] for r in rs) / len(rs) / per_unit) if copy else None
        fits[impl] = dict(fixed_us=fixed, us_per_unit=per_unit, steady_frac_copy=steady)
        print(f"{impl}: fixed {fixed:.2f} us + {per_unit * 1e3:.4f} us per 1,000 {a.key}"
              + (f"; steady {steady:.3f} of copy BW" if steady else ""), flush=True)
    if a.out:
        meta = harness.environment(ctx, seed_path)
        with open(a.out, "w") as f:
            json.dump(dict(meta=meta, op=a.op, case=a.case, key=a.key, copy_gbps=copy, records=records, fits=fits),
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
