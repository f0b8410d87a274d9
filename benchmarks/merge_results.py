#!/usr/bin/env python
"""Replace op families' records in a full results JSON by those of another run.

``python benchmarks/merge_results.py FULL.json PARTIAL.json --ops score [--out FULL.json]``

For runs that re-measure only the ops whose kernels changed, or a full run that ran out of
time before some ops (their records taken from an earlier run whose kernels are unchanged).
The merged file keeps the full run's ``meta`` and copy bandwidth and records the other run's
meta under ``meta["merged"]`` (ops, commit, date, copy bandwidth; an earlier merge keeps only
the ops this one does not replace), so the README table can say which records come from
which commit.
"""

import argparse
import json
import sys


def merge(full: dict, part: dict, ops: set) -> dict:
    if part["meta"].get("profile"):
        raise SystemExit("the partial run is a profiling run (--profile): it has no timings")
    if part["meta"].get("filter"):
        raise SystemExit(f"the partial run ran a subset of its ops' cases / impls ({part['meta']['filter']}): "
                         "it cannot replace an op family")
    missing = ops - {r["op"] for r in part["results"]}
    if missing:
        raise SystemExit(f"the partial run has no records of {sorted(missing)}")
    out = dict(full)
    order = list(dict.fromkeys(r["op"] for r in full["results"]))  # op families keep their place
    merged = [r for r in full["results"] if r["op"] not in ops] + [r for r in part["results"] if r["op"] in ops]
    out["results"] = sorted(merged, key=lambda r: order.index(r["op"]) if r["op"] in order else len(order))
    meta = dict(full["meta"])
    earlier = [dict(m, ops=[o for o in m["ops"] if o not in ops]) for m in meta.get("merged", [])]
    meta["merged"] = [m for m in earlier if m["ops"]] + [{
        "ops": sorted(ops), "commit": part["meta"]["git"]["commit"], "date_utc": part["meta"]["date_utc"],
        "copy_gbps": part["copy_bandwidth"]["gbps"], "command": part["meta"]["command"]}]
    out["meta"] = meta
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("full")
    p.add_argument("partial")
    p.add_argument("--ops", required=True, help="comma-separated op families to take from the partial run")
    p.add_argument("--out", default=None, help="default: overwrite FULL")
    a = p.parse_args(argv)
    with open(a.full) as f:
        full = json.load(f)
    with open(a.partial) as f:
        part = json.load(f)
    merged = merge(full, part, {o.strip() for o in a.ops.split(",") if o.strip()})
    with open(a.out or a.full, "w") as f:
        json.dump(merged, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
