"""Console script ``kpool``: ``demo`` (serving session checked against the oracle),
``bench`` (benchmarks vs the seed baseline, GPU), ``check`` (ahead-of-time compile matrix)."""

from __future__ import annotations

import argparse
import json
import sys


def _demo(args) -> int:
    from .demo import format_summary, run_demo

    stats = run_demo(requests=args.requests, max_prompt=args.max_prompt, decode_steps=args.decode_steps,
                     max_spec_tokens=args.max_spec_tokens, seed=args.seed, device=args.device)
    print(format_summary(stats))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(stats, f, indent=2)
    return 0


def _check(args) -> int:
    from . import aot

    results = aot.compile_matrix()
    failed = [r for r in results if not r.ok]
    print(f"compiled {len(results) - len(failed)}/{len(results)} kernel specializations")
    for r in failed:
        print(f"FAILED {r}")
    return 1 if failed else 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # kpool.bench parses its own options (argparse's REMAINDER drops leading ones)
        from . import bench
        return bench.main(argv[1:])
    parser = argparse.ArgumentParser(prog="kpool", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    demo = sub.add_parser("demo", help="serving session through KPoolCache, checked against the oracle")
    demo.add_argument("--requests", type=int, default=8)
    demo.add_argument("--max-prompt", type=int, default=6000)
    demo.add_argument("--decode-steps", type=int, default=48)
    demo.add_argument("--max-spec-tokens", type=int, default=3)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--device", default=None, help="cuda / cpu (default: cuda if available)")
    demo.add_argument("--json", default=None, help="also write the summary as JSON")
    demo.set_defaults(fn=_demo)
    sub.add_parser("bench", help="benchmarks vs the seed and the torch path (GPU); kpool bench --help")
    check = sub.add_parser("check", help="compile every kernel for sm_80/90/100, gfx942/950")
    check.set_defaults(fn=_check)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
