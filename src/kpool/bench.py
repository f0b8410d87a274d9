"""``kpool bench``: our kernels, the seed baseline and the unfused torch path, side by side.

Runs the harness in the repository's ``benchmarks/`` folder (found next to the source
tree, or through ``$KPOOL_BENCH_DIR``) and prints a table of µs, GB/s, fraction of the
copy bandwidth measured in the same run, and speedup over the seed.

Usage::

    python -m kpool.bench [--quick | --dry-run] [--ops compress,decode,...] [--out PATH|auto]
                          [--seed-path PATH] [--no-check] [--budget-s S]
                          [--cases REGEX] [--impls ours,seed,...] [--list] [--profile]

``--out auto`` writes ``benchmarks/results/<gpu>.json``. ``--dry-run`` uses tiny sizes on
the CPU (Triton's interpreter) or GPU to exercise every code path; its timings mean
nothing. ``--cases`` / ``--impls`` run a subset (an A/B of a few cases costs seconds of GPU
time instead of minutes); such a run cannot be merged into the results file. The seed
module is loaded by path: ``--seed-path``, else ``$KPOOL_SEED_PATH``, else
``../shared/seed/seed_kpool.py``, else ``.seed/seed_kpool.py`` (repository root).

``--profile`` times nothing: each selected unit runs once to warm up, then once between
``cudaProfilerStart`` / ``Stop``, e.g. ``ncu --profile-from-start off --set full kpool bench
--ops decode --cases "P=4 B=1024 next_n=4" --impls ours --profile``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

_HARNESS = None


def find_bench_dir() -> Path:
    env = os.environ.get("KPOOL_BENCH_DIR")
    cands = [Path(env)] if env else []
    cands += [Path(__file__).resolve().parents[2] / "benchmarks", Path.cwd() / "benchmarks"]
    for c in cands:
        if (c / "harness.py").is_file():
            return c
    raise FileNotFoundError("benchmarks/harness.py not found: run from a kpool checkout or set KPOOL_BENCH_DIR "
                            f"(looked in {', '.join(str(c) for c in cands)})")


def harness():
    """The ``benchmarks/harness.py`` module (loaded once, by path)."""
    global _HARNESS
    if _HARNESS is None:
        path = find_bench_dir() / "harness.py"
        spec = importlib.util.spec_from_file_location("kpool_bench_harness", str(path))
        mod = importlib.util.module_from_spec(spec)
        sys.modules["kpool_bench_harness"] = mod
        spec.loader.exec_module(mod)
        _HARNESS = mod
    return _HARNESS


def _resolve_out(out_json):
    if out_json != "auto":
        return out_json
    import torch
    h = harness()
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return str(h.BENCH_DIR / "results" / f"{h.gpu_slug(name)}.json")


def run_benchmarks(ops=None, quick=False, out_json=None, seed_path=None, *, dry_run=False, check=True,
                   budget_s=None, device=None, verbose=True, cases=None, impls=None, profile=False) -> dict:
    """Run the benchmarks and return the result document.

    Parameters
    ----------
    ops : iterable of op names (default all: compress, prefill, decode, expand, seed_tail, score).
    quick : fewer sizes and repetitions.
    out_json : path to write the JSON to (``"auto"``: ``benchmarks/results/<gpu>.json``; None: none).
    seed_path : the seed module (default: ``$KPOOL_SEED_PATH``, ``../shared/seed/seed_kpool.py``,
        ``.seed/seed_kpool.py``).
    dry_run : tiny sizes that exercise every code path; the timings mean nothing.
    check : compare our outputs with the torch reference byte for byte before timing.
    budget_s : stop starting new measurements after this many seconds (the rest is recorded as skipped).
    cases : regular expression; only the cases whose label it matches (``re.search``).
    impls : iterable of implementation names (``ours``, ``seed``, ``torch``, ...); only those.
    profile : no timing; one warm-up call, then one call between profiler start / stop per unit.
    """
    h = harness()
    mode = "dry" if dry_run else ("quick" if quick else "full")
    saved = os.environ.get("KPOOL_BACKEND")
    if dry_run:
        from . import _backend
        if _backend.interpreting() and saved is None:
            os.environ["KPOOL_BACKEND"] = "triton"  # run our Triton kernels in the interpreter
    try:
        return h.run(ops=ops, mode=mode, out_json=_resolve_out(out_json), seed_path=seed_path, check=check,
                     budget_s=budget_s, device=device, verbose=verbose, cases=cases,
                     impls=set(impls) if impls else None, profile=profile)
    finally:
        if saved is None:
            os.environ.pop("KPOOL_BACKEND", None)
        else:
            os.environ["KPOOL_BACKEND"] = saved


def _parser():
    p = argparse.ArgumentParser(prog="kpool bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", default=None, help="comma-separated: compress,prefill,decode,expand,seed_tail,score")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    p.add_argument("--dry-run", action="store_true", help="tiny sizes, exercise the code paths (timings meaningless)")
    p.add_argument("--out", default=None, help="JSON output path, or 'auto' for benchmarks/results/<gpu>.json")
    p.add_argument("--seed-path", default=None, help="path of seed_kpool.py")
    p.add_argument("--no-check", action="store_true", help="skip the byte-exactness checks against the reference")
    p.add_argument("--budget-s", type=float, default=None, help="start no measurement after this many seconds")
    p.add_argument("--device", default=None, help="cuda / cpu (default: cuda if available)")
    p.add_argument("--strict", action="store_true", help="exit 1 if any measurement errored")
    p.add_argument("--cases", default=None, help="regular expression: only the cases whose label matches")
    p.add_argument("--impls", default=None, help="comma-separated: only these implementations (ours,seed,torch,...)")
    p.add_argument("--list", action="store_true", help="list the planned measurements and exit")
    p.add_argument("--profile", action="store_true",
                   help="no timing: one call per unit between cudaProfilerStart/Stop (ncu --profile-from-start off)")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    ops = [o.strip() for o in args.ops.split(",") if o.strip()] if args.ops else None
    impls = {i.strip() for i in args.impls.split(",") if i.strip()} if args.impls else None
    import torch
    from . import _backend
    if args.dry_run and not torch.cuda.is_available() and not _backend.interpreting() \
            and os.environ.get("KPOOL_BENCH_NO_REEXEC") != "1":
        # Triton's interpreter must be switched on before triton is imported: start again with it.
        env = dict(os.environ, TRITON_INTERPRET="1", KPOOL_BENCH_NO_REEXEC="1")
        src = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        argv = list(sys.argv[1:] if argv is None else argv)
        os.execve(sys.executable, [sys.executable, "-m", "kpool.bench", *argv], env)
    try:
        if args.list:
            h = harness()
            mode = "dry" if args.dry_run else ("quick" if args.quick else "full")
            mods = {op: h.load_op_module(op) for op in (ops or h.OPS)}
            for op, ci, impl in h.build_plan(list(mods), mode, mods, args.cases, impls):
                print(f"{op:9s} {mods[op].cases(mode)[ci]['label']:28s} {impl}")
            return 0
        doc = run_benchmarks(ops=ops, quick=args.quick, out_json=args.out, seed_path=args.seed_path,
                             dry_run=args.dry_run, check=not args.no_check, budget_s=args.budget_s,
                             device=args.device, cases=args.cases, impls=impls, profile=args.profile)
    except ValueError as e:  # a bad --ops / --cases / --impls
        print(f"kpool bench: {e}", file=sys.stderr)
        return 2
    if args.strict and any(r["status"] == "error" for r in doc["results"]):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
