#!/usr/bin/env python
"""Achieved bandwidth vs size for each op, from a results JSON (one PNG, a panel per op).

    python benchmarks/plot.py benchmarks/results/h200.json [-o benchmarks/results/h200.png]

Lines: one per implementation and per fixed parameter (P, next_n, ...); the dashed line is
the device copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SIZE_KEY = {"compress": "pools", "prefill": "tokens", "decode": "batch", "expand": "rows", "seed_tail": "tokens",
            "score": "rows", "fp8": "pools"}
# parameters that tell one line from another (the rest follow from them and the size)
LINE_KEYS = {"decode": ("P", "next_n"), "seed_tail": ("P", "requests"), "score": ("kind", "ctx", "ctx_lo", "pools")}
STYLE = {"ours": ("tab:blue", "-"), "ours_ring2P": ("tab:cyan", "-"), "ours_per_request": ("tab:blue", "-"),
         "ours_gathered": ("tab:purple", "-."), "seed": ("tab:red", "--"), "seed_upstream": ("tab:orange", "--"),
         "torch": ("tab:gray", ":")}
MARKERS = "osD^vP*Xh"


def series(doc):
    """``{op: {(impl, fixed-params): [(size, gbps), ...]}}`` of the records that have a bandwidth."""
    by_op: dict = {}
    for r in doc["results"]:
        if r.get("status") == "ok" and r.get("gbps"):
            by_op.setdefault(r["op"], []).append(r)
    out = {}
    for op, recs in by_op.items():
        key = SIZE_KEY.get(op)
        params = LINE_KEYS.get(op, ("P",))
        varying = [k for k in params if len({json.dumps(r["params"].get(k)) for r in recs}) > 1]
        lines: dict = {}
        for r in recs:
            fixed = tuple((k, r["params"][k]) for k in varying if r["params"].get(k) is not None)
            size = r["params"].get(key, 0)
            lines.setdefault((r["impl"], fixed), []).append((size, r["gbps"]))
        out[op] = {k: sorted(v) for k, v in lines.items()}
    return out


def plot(doc, out_png) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    data = series(doc)
    ops = [op for op in SIZE_KEY if op in data] + [op for op in data if op not in SIZE_KEY]
    if not ops:
        raise ValueError("no record with a bandwidth to plot")
    ncols = min(len(ops), 3)
    nrows = -(-len(ops) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.2 * ncols, 4.6 * nrows), squeeze=False)
    copy = (doc.get("copy_bandwidth") or {}).get("gbps")
    meta = doc["meta"]
    for ax, op in zip(axes.flat, ops):
        fixeds = sorted({str(f) for _, f in data[op]})
        for (impl, fixed), pts in sorted(data[op].items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
            color, ls = STYLE.get(impl, (None, "-"))
            n = fixeds.index(str(fixed))  # the same marker for the same parameters across implementations
            label = impl + ("" if not fixed else " " + " ".join(f"{k}={v}" for k, v in fixed))
            xs, ys = zip(*pts)
            ax.plot(xs, ys, linestyle=ls, color=color, marker=MARKERS[n % len(MARKERS)], markersize=5, label=label,
                    alpha=0.9)
        if copy:
            ax.axhline(copy, color="black", linestyle="--", linewidth=1, label=f"copy {copy:.0f} GB/s")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(SIZE_KEY.get(op, "size"))
        ax.set_ylabel("achieved GB/s")
        ax.set_title(op)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
    for ax in list(axes.flat)[len(ops):]:
        ax.axis("off")
    title = f"kpool: achieved bandwidth vs size — {meta.get('gpu') or meta.get('device')}"
    if not meta.get("timing_valid", True):
        title += " (DRY RUN: timings meaningless)"
    fig.suptitle(title)
    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json")
    ap.add_argument("-o", "--out", default=None, help="PNG path (default: the JSON's path with .png)")
    args = ap.parse_args(argv)
    doc = json.loads(Path(args.json).read_text())
    out = plot(doc, args.out or str(Path(args.json).with_suffix(".png")))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
