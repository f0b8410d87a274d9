"""``python -m kpool.sass``: what one kernel specialisation compiles to on an NVIDIA target, on a CPU.

A developer's tool for the kernels' inner loops (the 20th and 21st sessions' scoring work
came from it: benchmarks/LOG.md). It takes one job of ``kpool.aot``'s compile matrix (the
launchers' constexprs and options), optionally changes some constexprs or the register cap,
compiles it with the triton wheel's own tools (no GPU) and reports:

* registers, spill stores / loads, stack and shared memory (``cuobjdump -res-usage``), and the
  instruction count, all and through the last ``EXIT`` (without subroutines such as
  ``div_rn``'s slow path);
* every loop of the SASS (a backward branch): its instruction count (per warp per
  iteration) and commonest opcodes, and the memory instructions in it by kind and width
  (``LDS.U16`` vs ``LDS.128``, ``LDGSTS``, ``BAR``, ``HGMMA``, ...);
* the ``cp.async.wait_group`` counts of the PTX (how many tiles a pipelined loop keeps in
  flight).

    python -m kpool.sass _paged_topk_kernel --match FILTER=True,ROWS=1,FNUZ=False \\
        --set H=32,NT=8,KB=512,PAGE=64,PRESHUFFLE=False,FINAL=False --out /tmp/leaf

``--match`` picks the first job whose constexprs have those values (``--list`` shows them);
``--set`` overrides constexprs after that; ``--maxnreg`` replaces the launcher's register cap.
Instruction counts are a proxy: time the change on the GPU (``benchmarks/ab.py``) before keeping it.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import subprocess
import sys
import tempfile

from . import aot

_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_TARGET = re.compile(r"0x([0-9a-f]+)")
_MEMORY = re.compile(r"^(LDS|STS|LDSM|STSM|LDG|STG|LDGSTS|LDL|STL|BAR|HGMMA|DEPBAR|ATOM|RED|SHFL)\b")
_RES = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")


@dataclasses.dataclass
class Loop:
    start: int            # byte offset of the loop's first instruction
    end: int              # byte offset of its backward branch
    instructions: int     # per warp per iteration
    opcodes: collections.Counter
    memory: collections.Counter


def _parse_value(text: str):
    low = text.strip()
    if low in ("True", "False"):
        return low == "True"
    try:
        return int(low)
    except ValueError:
        try:
            return float(low)
        except ValueError:
            return low


def parse_assignments(text: str | None) -> dict:
    """``"K=V,K2=V2"`` -> ``{K: V}`` (ints, floats, True / False, else strings)."""
    out = {}
    for item in filter(None, (text or "").split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"expected KEY=VALUE, got {item!r}")
        out[key.strip()] = _parse_value(value)
    return out


def matching_jobs(kernel: str, target: str = "sm_90", tier: str = "full", match: dict | None = None) -> list:
    """The jobs of ``kpool.aot`` for ``kernel`` on the NVIDIA ``target`` whose constexprs
    equal ``match``."""
    if aot.TARGETS.get(target, ("",))[0] != "cuda":
        nvidia = [t for t, v in aot.TARGETS.items() if v[0] == "cuda"]
        raise ValueError(f"target must be an NVIDIA one (SASS): {nvidia}, got {target!r}")
    return [j for j in aot.build_jobs([target], tier, [kernel])
            if all(j.constexprs.get(k) == v for k, v in (match or {}).items())]


def pick_job(kernel: str, target: str = "sm_90", tier: str = "full", match: dict | None = None,
             overrides: dict | None = None, maxnreg: int | None = None) -> aot.AotJob:
    """The first of ``matching_jobs``, with ``overrides`` applied to its constexprs and
    ``maxnreg`` to its options."""
    jobs = matching_jobs(kernel, target, tier, match)
    if not jobs:
        raise ValueError(f"no {tier} job of {kernel} on {target} matches {match}")
    job = jobs[0]
    unknown = [k for k in (overrides or {}) if k not in job.constexprs]
    if unknown:
        raise ValueError(f"--set names no constexpr of {kernel}: {unknown}; it has {sorted(job.constexprs)}")
    options = dict(job.options)
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    return dataclasses.replace(job, constexprs={**job.constexprs, **(overrides or {})}, options=options)


def _tool(name: str) -> str:
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def disassemble(cubin: bytes) -> tuple:
    """``(sass text, resource usage dict)`` of a cubin, by the triton wheel's ``cuobjdump``."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        sass = subprocess.run([_tool("cuobjdump"), "-sass", path], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([_tool("cuobjdump"), "-res-usage", path], capture_output=True, text=True,
                             check=True).stdout
    m = _RES.search(res)
    usage = dict(zip(("registers", "stack", "shared", "local"), map(int, m.groups()))) if m else {}
    return sass, usage


def instructions(sass: str) -> list:
    """``[(byte offset, instruction text)]`` of a SASS listing."""
    return [(int(a, 16), text) for a, text in _INSTR.findall(sass)]


def _opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]


def to_last_exit(sass: str) -> int:
    """Instructions from the start through the last ``EXIT``: the kernel's own code, without
    the subroutines placed after it (e.g. ``div_rn``'s slow path, reached by ``CALL``)."""
    ops = [_opcode(t) for _, t in instructions(sass)]
    exits = [i for i, op in enumerate(ops) if op == "EXIT"]
    return exits[-1] + 1 if exits else len(ops)


def loops(sass: str) -> list:
    """Every backward branch's loop body, innermost first as they appear (``Loop``)."""
    ins = instructions(sass)
    at = {a: i for i, (a, _) in enumerate(ins)}
    found = []
    for i, (addr, text) in enumerate(ins):
        if not _opcode(text).startswith("BRA"):
            continue
        m = _TARGET.search(text)
        target = int(m.group(1), 16) if m else None
        if target is None or target >= addr or target not in at:
            continue
        body = [_opcode(t) for _, t in ins[at[target]:i + 1]]
        memory = collections.Counter(op for op in body if _MEMORY.match(op))
        found.append(Loop(target, addr, len(body), collections.Counter(op.split(".")[0] for op in body), memory))
    return found


def report(job: aot.AotJob, sass: str, usage: dict, ptx: str, shared: int) -> str:
    """The human-readable summary ``main`` prints."""
    ops = [_opcode(t) for _, t in instructions(sass)]
    lines = [f"{job.kernel} on {job.target}, from the aot job {job.label}",
             "constexprs: " + ", ".join(f"{k}={v}" for k, v in sorted(job.constexprs.items())),
             "options: " + ", ".join(f"{k}={v}" for k, v in sorted(job.options.items())),
             f"registers {usage.get('registers', '?')}, stack {usage.get('stack', '?')} B, shared {shared} B "
             f"(launch), spill stores {sum(op.startswith('STL') for op in ops)}, spill loads "
             f"{sum(op.startswith('LDL') for op in ops)}, {len(ops)} instructions ({to_last_exit(sass)} through "
             "the last EXIT)"]
    waits = collections.Counter(re.findall(r"cp\.async\.wait_group\s+(\d+)", ptx))
    if waits:
        lines.append("cp.async.wait_group: " + ", ".join(f"{n} x {k}" for k, n in sorted(waits.items())))
    for lp in loops(sass):
        lines.append(f"loop {lp.start:#x}-{lp.end:#x}: {lp.instructions} instructions per iteration; "
                     + ", ".join(f"{k} {n}" for k, n in lp.opcodes.most_common(10)))
        if lp.memory:
            lines.append("    memory / sync: " + ", ".join(f"{k} {n}" for k, n in sorted(lp.memory.items())))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kpool.sass", description=__doc__.split("\n\n")[0])
    ap.add_argument("kernel")
    ap.add_argument("--target", default="sm_90", help="sm_80, sm_90 or sm_100 (default sm_90)")
    ap.add_argument("--tier", default="full", choices=aot.TIERS, help="job matrix to pick from (default full)")
    ap.add_argument("--match", help="K=V,...: constexpr values the job must have")
    ap.add_argument("--set", dest="overrides", help="K=V,...: constexprs to change after picking")
    ap.add_argument("--maxnreg", type=int, help="register cap (default: the launcher's)")
    ap.add_argument("--list", action="store_true", help="print the matching jobs' labels and exit")
    ap.add_argument("--out", help="directory for the .sass, .ptx and .ttgir")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        ap.error("needs TRITON_INTERPRET unset or 0 (it compiles)")
    try:
        match = parse_assignments(args.match)
        if args.list:
            for j in matching_jobs(args.kernel, args.target, args.tier, match):
                print(j.label)
            return 0
        job = pick_job(args.kernel, args.target, args.tier, match, parse_assignments(args.overrides), args.maxnreg)
    except ValueError as e:
        ap.error(str(e))
    compiled = aot.compile_source(job)
    sass, usage = disassemble(compiled.asm["cubin"])
    ptx = compiled.asm.get("ptx", "")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        for ext, text in (("sass", sass), ("ptx", ptx), ("ttgir", compiled.asm.get("ttgir", ""))):
            with open(os.path.join(args.out, f"{job.kernel}.{ext}"), "w") as f:
                f.write(text)
    print(report(job, sass, usage, ptx, int(getattr(compiled.metadata, "shared", 0) or 0)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
