#!/usr/bin/env python
"""README performance table and NOTES target table, generated from a results JSON (never typed by hand).

    python benchmarks/readme_table.py benchmarks/results/h200.json              # print the block
    python benchmarks/readme_table.py benchmarks/results/h200.json --write README.md --notes benchmarks/NOTES.md

The README block sits between ``<!-- bench:start -->`` and ``<!-- bench:end -->``; ``--write``
replaces it in place (or appends a "Performance" section holding it when the markers are
missing). ``--notes`` replaces the block between ``<!-- targets:start -->`` and
``<!-- targets:end -->`` (every issue target with its measured value) in that file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

START, END = "<!-- bench:start -->", "<!-- bench:end -->"
TARGETS_START, TARGETS_END = "<!-- targets:start -->", "<!-- targets:end -->"
GROUPED = 6  # a target judged on more records than this is one summary row
MARKS = {True: "✅", False: "❌", None: "?"}  # a target met, missed, not judged
# Which of our implementations each op's main table shows, in order.
PRIMARY = {"compress": ["ours"], "prefill": ["ours"], "expand": ["ours"], "seed_tail": ["ours_per_request", "ours"],
           "score": ["ours"]}
OP_NAMES = {"compress": "compress + write", "prefill": "prefill write (token-major)",
            "expand": "expand pools + append tail", "seed_tail": "ring seeding", "decode": "decode / verify update",
            "score": "score + select (indexer)"}
IMPL_NAMES = {"ours": "ours", "ours_per_request": "ours (per request)", "ours_ring2P": "ours, RING=2P",
              "movement": "data movement only"}


def _f(x, spec):
    return "—" if x is None else format(x, spec)


def _us(x):
    if x is None:
        return "—"
    return f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def _index(doc):
    return {(r["op"], r["case"], r["impl"]): r for r in doc["results"]}


def _status(rec):
    ts = rec.get("targets") or []
    if not ts:
        return ""
    return "; ".join(f"{t['text']} {MARKS[t['ok']]}" for t in ts)


def _cell_err(rec):
    if rec is None:
        return "—"
    if rec["status"] != "ok":
        return rec["status"]
    return None


def _cell_us(rec):
    """A record's µs, or why it has none (missing, skipped, error)."""
    return _cell_err(rec) or _us(rec.get("us"))


def throughput_table(doc) -> list[str]:
    idx = _index(doc)
    cases = []
    for r in doc["results"]:
        key = (r["op"], r["case"])
        if r["op"] in PRIMARY and key not in cases:
            cases.append(key)
    if not cases:
        return []
    lines = ["| op | size | impl | ours µs | seed µs | torch µs | ours GB/s | ours / copy BW | seed / copy BW "
             "| speedup vs seed | target |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for op, case in cases:
        seed, torch_ = idx.get((op, case, "seed")), idx.get((op, case, "torch"))
        for impl in PRIMARY[op]:
            rec = idx.get((op, case, impl))
            if rec is None:
                continue
            sp = rec.get("speedup_vs_seed")
            lines.append(
                f"| {OP_NAMES.get(op, op)} | {case} | {IMPL_NAMES.get(impl, impl)} | "
                f"{_cell_us(rec)} | {_cell_us(seed)} | {_cell_us(torch_)} | {_f(rec.get('gbps'), '.0f')} | "
                f"{_f(rec.get('frac_copy'), '.2f')} | {_f((seed or {}).get('frac_copy'), '.2f')} | "
                f"{(format(sp, '.2f') + '×') if sp else '—'} | {_status(rec)} |")
    return lines


def decode_table(doc) -> list[str]:
    recs = [r for r in doc["results"] if r["op"] == "decode"]
    if not recs:
        return []
    idx = _index(doc)
    batches = sorted({r["params"]["batch"] for r in recs})
    rows = sorted({(r["params"]["P"], r["params"]["next_n"]) for r in recs})
    def ring(impl, p, nn):  # the ring the row's records ran with (bench_decode records it)
        rings = {idx.get(("decode", f"P={p} B={b} next_n={nn}", impl), {}).get("ring") for b in batches} - {None}
        return "/".join(str(r) for r in sorted(rings)) or "—"

    lines = ["Decode / verify update under CUDA-graph replay, µs per call, **ours / seed** (the seed at RING = P, "
             "which it requires; RING: ours's ring):", "",
             "| P | next_n | impl | RING | " + " | ".join(f"B={b}" for b in batches) + " |",
             "|---|---|---|---:|" + "---:|" * len(batches)]
    for impl in ("ours", "ours_ring2P"):
        for p, nn in rows:
            if not any(("decode", f"P={p} B={b} next_n={nn}", impl) in idx for b in batches):
                continue  # ours_ring2P runs only where its ring differs from ours's (bench_decode.impls)
            cells = []
            for b in batches:
                label = f"P={p} B={b} next_n={nn}"
                mine, seed = idx.get(("decode", label, impl)), idx.get(("decode", label, "seed"))
                m, s = _cell_us(mine), _cell_us(seed)
                ok = [t["ok"] for t in (mine or {}).get("targets", [])]
                mark = " ❌" if False in ok else ""
                cells.append(f"{m} / {s}{mark}")
            lines.append(f"| {p} | {nn} | {IMPL_NAMES.get(impl, impl)} | {ring(impl, p, nn)} | " + " | ".join(cells)
                         + " |")
    if any(r["impl"] == "movement" for r in recs):  # the step's data movement alone (bench_decode.movement)
        for p, nn in rows:
            cells = [_cell_us(idx.get(("decode", f"P={p} B={b} next_n={nn}", "movement"))) for b in batches]
            lines.append(f"| {p} | {nn} | {IMPL_NAMES['movement']} | {ring('movement', p, nn)} | " + " | ".join(cells)
                         + " |")
        lines += ["", "*data movement only*: the step's rows and mappings read and the rows stored at their ring "
                      "slots, with no pool work (`bench_decode.movement`): what ours costs above it is the "
                      "completions."]
    return lines


def fp8_table(doc) -> list[str]:
    """The fp8-encoder measurement (``bench_fp8``): compress + write with each encoder."""
    recs = [r for r in doc["results"] if r["op"] == "fp8"]
    if not recs:
        return []
    idx = _index(doc)
    lines = ["fp8 encoder in compress + write (e4m3fn, plain), µs (× copy BW); `KPOOL_FP8_ENCODER=auto` "
             "picks native where the target has the conversion:", "",
             "| case | software (integer ops) | native conversion | native / software |", "|---|---:|---:|---:|"]
    for case in dict.fromkeys(r["case"] for r in recs):
        sw, nat = idx.get(("fp8", case, "software")), idx.get(("fp8", case, "native"))
        cells = [_cell_err(r) or f"{_us(r.get('us'))} ({_f(r.get('frac_copy'), '.2f')})" for r in (sw, nat)]
        ratio = (nat["us"] / sw["us"]) if sw and nat and sw.get("us") and nat.get("us") else None
        lines.append(f"| {case} | {cells[0]} | {cells[1]} | {_f(ratio, '.3f')} |")
    return lines


def flops_line(doc) -> list[str]:
    """Scoring records with a FLOP count (prefill, ragged logits): TFLOP/s, and the fraction of
    the same run's measured fp8 matmul rate where it was measured."""
    recs = [r for r in doc["results"] if r["impl"] == "ours" and r["status"] == "ok" and r.get("tflops")]
    if not recs:
        return []
    parts = []
    for r in recs:
        mm = r.get("fp8_mm_tflops")
        rate = f" = {_f(r['tflops'] / mm, '.3f')} of the measured fp8 matmul ({_f(mm, '.0f')} TFLOP/s)" if mm else ""
        parts.append(f"{r['case']} {_f(r['tflops'], '.1f')} TFLOP/s{rate}")
    return ["Scoring rate (`2·H·128` FLOP per visible pool per query): " + "; ".join(parts) + "."]


def _measured(t, rec):
    """A judged record's figure for its target: the fraction of copy bandwidth, or µs."""
    if t["kind"] == "min_frac_copy":
        return f"{_f(rec.get('frac_copy'), '.2f')} of copy BW (needs {t['value']:.2f})"
    return f"{_us(rec.get('us'))} µs"


def targets_table(doc) -> list[str]:
    """Every target the results judge, with the measured figure: one row per record, or one
    summary row for a target judged on more than ``GROUPED`` records (decode's "<= seed")."""
    groups: dict = {}
    for r in doc["results"]:
        for t in r.get("targets") or []:
            groups.setdefault((r["op"], t["text"]), []).append((t, r))
    if not groups:
        return []
    lines = ["| op | case | target | measured | met |", "|---|---|---|---:|---|"]
    for (op, text), judged in groups.items():
        name = OP_NAMES.get(op, op)
        if len(judged) > GROUPED:
            ok = [t["ok"] for t, _ in judged]
            speedups = [r["speedup_vs_seed"] for _, r in judged if r.get("speedup_vs_seed")]
            worst = f" (least speedup over the seed {min(speedups):.2f}×)" if speedups else ""
            met = MARKS[True if all(ok) else (False if False in ok else None)]
            lines.append(f"| {name} | {len(judged)} cases | {text} | {sum(o is True for o in ok)} met{worst} | {met} |")
            continue
        for t, r in judged:
            impl = "" if r["impl"] == "ours" else f", {IMPL_NAMES.get(r['impl'], r['impl'])}"
            lines.append(f"| {name} | {r['case']}{impl} | {text} | {_measured(t, r)} | {MARKS[t['ok']]} |")
    return lines


def render_targets(doc, source: str = "") -> str:
    """The NOTES block: the run's header line and ``targets_table``."""
    git = doc["meta"].get("git") or {}
    head = (f"Generated by `benchmarks/readme_table.py` from {source or 'a results JSON'} (measured "
            f"{doc['meta'].get('date_utc', '?')[:10]}, commit `{(git.get('commit') or 'unknown')[:12]}`"
            f"{'; records merged from other runs as the README says' if doc['meta'].get('merged') else ''}); "
            "do not edit.")
    return "\n".join([TARGETS_START, head, "", *targets_table(doc), TARGETS_END])


def merged_note(meta) -> str:
    """Header sentences for records merged in from other runs (``merge_results.py``)."""
    return "".join(f" The {', '.join(m['ops'])} records are from another run: commit "
                   f"`{m['commit']}` ({m['date_utc'][:10]}), copy bandwidth {_f(m['copy_gbps'], '.0f')} GB/s."
                   for m in meta.get("merged", []))


def render(doc, source: str = "") -> str:
    meta = doc["meta"]
    cp = (doc.get("copy_bandwidth") or {}).get("gbps")
    git = meta.get("git") or {}
    commit = (git.get("commit") or "unknown")[:12] + (" (dirty)" if git.get("dirty") else "")
    head = (f"Measured on **{meta.get('gpu') or meta.get('device')}** ({meta.get('date_utc', '?')[:10]}, "
            f"commit `{commit}`, torch {meta.get('torch')}, triton {meta.get('triton')}, {meta.get('mode')} run); "
            f"device copy bandwidth in the same run: **{_f(cp, '.0f')} GB/s** (read + write). "
            "Memory floor = bytes (each input read once, each output written once) / copy bandwidth; "
            "\"/ copy BW\" = achieved GB/s / copy GB/s = floor / time.")
    head += merged_note(meta)
    out = [START, f"<!-- generated by benchmarks/readme_table.py from {source or 'a results JSON'}; do not edit -->",
           "", head, ""]
    if not meta.get("timing_valid", True):
        out += ["> **Dry run on CPU: these timings are meaningless** (they only exercise the code paths).", ""]
    t = throughput_table(doc)
    if t:
        out += t + [""]
    for extra in (decode_table(doc), fp8_table(doc), flops_line(doc)):
        if extra:
            out += extra + [""]
    shown = {(op, impl) for op, impls in PRIMARY.items() for impl in impls}
    others = [r for r in doc["results"] if r["op"] in PRIMARY and r["impl"] not in ("seed", "torch")
              and (r["op"], r["impl"]) not in shown and r["status"] == "ok"]
    if others:
        out.append("Other variants, µs (× copy BW): " + "; ".join(
            f"{r['op']} {r['case']} {r['impl']} {_us(r.get('us'))} ({_f(r.get('frac_copy'), '.2f')})" for r in others)
            + ".")
        out.append("")
    errs = [r for r in doc["results"] if r["status"] != "ok"]
    if errs:
        out.append(f"{len(errs)} measurement(s) did not complete: "
                   + ", ".join(f"{r['op']}/{r['case']}/{r['impl']} ({r['status']})" for r in errs[:8])
                   + (" …" if len(errs) > 8 else ""))
        out.append("")
    out.append("Seed: its wrappers write the preshuffled layout at PAGE > 1 and its decode needs RING = P; "
               "ours is measured with the plain (NVIDIA) layout. Method: `benchmarks/harness.py`.")
    out.append(END)
    return "\n".join(out)


def replace_block(text: str, block: str, start: str = START, end: str = END) -> str:
    """``text`` with the marked block replaced (or, for the README's markers, a Performance
    section appended)."""
    i, j = text.find(start), text.find(end)
    if i >= 0 and j > i:
        return text[:i] + block + text[j + len(end):]
    if i >= 0 or j >= 0 or start != START:
        raise ValueError(f"the file has {'only one of' if i >= 0 or j >= 0 else 'none of'} the markers {start} / {end}")
    sep = "" if text.endswith("\n\n") else ("\n" if text.endswith("\n") else "\n\n")
    return text + sep + "## Performance\n\n" + block + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", help="results JSON (benchmarks/results/<gpu>.json)")
    ap.add_argument("--write", metavar="README", default=None, help="rewrite this README in place")
    ap.add_argument("--notes", metavar="NOTES", default=None, help="rewrite the target block of this file in place")
    args = ap.parse_args(argv)
    doc = json.loads(Path(args.json).read_text())
    try:
        source = str(Path(args.json).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        source = Path(args.json).name
    block = render(doc, source)
    if args.write:
        path = Path(args.write)
        path.write_text(replace_block(path.read_text() if path.exists() else "", block))
        print(f"updated {path}")
    if args.notes:
        path = Path(args.notes)
        path.write_text(replace_block(path.read_text(), render_targets(doc, source), TARGETS_START, TARGETS_END))
        print(f"updated {path}")
    if not (args.write or args.notes):
        print(block)
    return 0


if __name__ == "__main__":
    sys.exit(main())
