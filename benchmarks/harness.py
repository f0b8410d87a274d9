"""One benchmark harness for every kpool op (DESIGN.md "Benchmarks").

Method, the same for every op and implementation:

* **Inputs rotated so L2 is cold**: each measurement builds ``n_sets`` independent input
  sets (caches included) with ``(n_sets - 1) * working_set >= 2 * L2`` where memory
  allows (at most ``MAX_SETS``); call ``k`` uses set ``k % n_sets``. Identical generator
  seeds give every implementation of a case the same inputs.
* **CUDA-graph replay**: the kernels (ours, the seed's) are captured ``K`` calls to a graph
  (``K`` a multiple of ``n_sets``, about ``TARGET_REPLAY_US`` per replay) and the graph
  is replayed between CUDA events; time per call = replay time / ``K``. The unfused torch
  path (host syncs, data-dependent shapes) is timed eagerly with events around each call.
* **Median** of many replays / calls; p20 and p80 are kept as the spread.
* **Bytes**: each input read once and each output written once (per op module).
* **Copy bandwidth**: a large device-to-device copy (bytes read + written) measured in the
  same run, at its start and end; the larger median is the ceiling. ``frac_copy`` =
  achieved GB/s / copy GB/s, which equals ``floor_us / us`` (``floor_us`` = bytes / copy
  bandwidth, the memory floor).

Each op lives in ``bench_<op>.py`` beside this file, loaded by path. A module defines
``OP``, ``TITLE``, ``cases(mode) -> list[dict]`` (each with a ``label``),
``impls(case) -> list[str]``, ``bench(ctx, case, impl) -> dict`` (from ``ctx.run``) and
``targets(case) -> list[dict]``. Every (op, case, impl) is one unit: a failure is recorded
and the run goes on; if the CUDA context dies, the remaining units run in a fresh process.

Entry points: ``kpool.bench.run_benchmarks`` / ``python -m kpool.bench`` /
``python benchmarks/run_all.py``.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import importlib.util
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
SCHEMA = 1
OPS = ("compress", "prefill", "decode", "expand", "seed_tail", "score", "fp8")
MODES = ("full", "quick", "dry")
MAX_SETS = 64
TARGET_REPLAY_US = {"full": 1000.0, "quick": 500.0, "dry": 0.0}
GRAPH_REPS = {"full": 30, "quick": 15, "dry": 2}
EVENT_REPS = {"full": 10, "quick": 5, "dry": 2}
MAX_CALLS = 2000  # calls captured in one graph at most
SMI_QUERY = "driver_version,clocks.sm,clocks.mem,clocks.max.sm,power.draw,temperature.gpu"
SUSTAIN_QUERY = "clocks.sm,power.draw,clocks_throttle_reasons.active"
SUSTAIN_SAMPLE_S = 0.1  # nvidia-smi sampling period while Ctx.sustain_s replays run
CPU_REPS = 1  # CPU / interpreter: one timed call, no warm-up (the timing means nothing there)
COPY_BYTES = {"full": 1 << 30, "quick": 1 << 30, "dry": 1 << 20}
FP8 = torch.float8_e4m3fn


# ----------------------------------------------------------------------------- helpers

def load_module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, str(path))
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def load_op_module(op: str):
    return load_module(f"kpool_bench_{op}", BENCH_DIR / f"bench_{op}.py")


def default_seed_path(root: Path = ROOT) -> Path | None:
    """``$KPOOL_SEED_PATH``, else ``../shared/seed/seed_kpool.py``, else ``.seed/seed_kpool.py``."""
    env = os.environ.get("KPOOL_SEED_PATH")
    if env:
        return Path(env)
    for cand in (root.parent / "shared" / "seed" / "seed_kpool.py", root / ".seed" / "seed_kpool.py"):
        if cand.is_file():
            return cand
    return None


def load_seed(path: Path | str | None):
    """The seed baseline module loaded by path, or ``(None, error)``."""
    if path is None:
        return None, "seed module not found (set KPOOL_SEED_PATH or copy seed_kpool.py to .seed/)"
    path = Path(path)
    if not path.is_file():
        return None, f"seed module not found at {path}"
    try:
        return load_module("kpool_seed_baseline", path), None
    except Exception as e:  # noqa: BLE001
        return None, f"seed module failed to import: {type(e).__name__}: {e}"


def sha256_file(path) -> str | None:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def source_digest() -> str:
    """sha256 over the package sources and benchmark scripts (identifies code without git)."""
    h = hashlib.sha256()
    import kpool
    pkg = Path(kpool.__file__).resolve().parent
    for base in (pkg, BENCH_DIR):
        for p in sorted(base.rglob("*.py")):
            h.update(str(p.relative_to(base.parent)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def git_info(root: Path = ROOT) -> dict:
    """Commit and dirty flag; ``$KPOOL_GIT_COMMIT`` wins (the device copy has no .git)."""
    env = os.environ.get("KPOOL_GIT_COMMIT")
    if env:
        return {"commit": env, "dirty": None, "source": "KPOOL_GIT_COMMIT"}
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip() != ""
        return {"commit": commit, "dirty": dirty, "source": "git"}
    except Exception:  # noqa: BLE001
        return {"commit": None, "dirty": None, "source": "unavailable"}


def gpu_slug(name: str | None) -> str:
    """``"NVIDIA H200"`` -> ``"h200"``: the first word holding a digit, lower case."""
    if not name:
        return "cpu"
    for word in name.replace("-", " ").split():
        if any(c.isdigit() for c in word) and word.upper() not in ("NVIDIA", "AMD"):
            return "".join(c for c in word.lower() if c.isalnum())
    return "".join(c for c in name.lower() if c.isalnum()) or "gpu"


def _nvidia_smi(query: str = SMI_QUERY, units: bool = True) -> dict:
    """``nvidia-smi --query-gpu=query`` of GPU 0 as ``{field: text}`` (``units=False``: bare numbers);
    ``{}`` where nvidia-smi is missing or fails."""
    fmt = "csv,noheader" if units else "csv,noheader,nounits"
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", f"--format={fmt}"], capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip().splitlines()
        return dict(zip(query.split(","), (v.strip() for v in out[0].split(",")))) if out else {}
    except Exception:  # noqa: BLE001
        return {}


def load_summary(samples: list) -> dict:
    """Summary of ``SUSTAIN_QUERY`` samples (``_nvidia_smi(SUSTAIN_QUERY, units=False)`` dicts)
    taken under sustained load: SM clock (median, least), board power (median, most) and every
    throttle reason seen (the OR of the ``clocks_throttle_reasons.active`` masks: 0x4 software
    power cap, 0x8 hardware slowdown, 0x20 / 0x40 software / hardware thermal, 0x80 power brake)."""
    def numbers(field, parse=float):
        out = []
        for s in samples:
            try:
                out.append(parse(s[field]))
            except (KeyError, ValueError):
                pass
        return out

    mhz, watts = numbers("clocks.sm"), numbers("power.draw")
    masks = numbers("clocks_throttle_reasons.active", lambda v: int(v, 16))
    mask = 0
    for m in masks:
        mask |= m
    return {"samples": len(samples),
            "sm_mhz": statistics.median(mhz) if mhz else None, "sm_mhz_min": min(mhz) if mhz else None,
            "power_w": statistics.median(watts) if watts else None, "power_w_max": max(watts) if watts else None,
            "throttle_mask": hex(mask) if masks else None}


def _quantile(xs, q):
    xs = sorted(xs)
    if not xs:
        return None
    i = q * (len(xs) - 1)
    lo, hi = math.floor(i), math.ceil(i)
    return xs[lo] + (xs[hi] - xs[lo]) * (i - lo)


def cuda_alive() -> bool:
    try:
        torch.cuda.synchronize()
        x = torch.ones(4, device="cuda")
        return float((x + 1).sum().item()) == 8.0
    except Exception:  # noqa: BLE001
        return False


# ----------------------------------------------------------------------------- context

class Ctx:
    """What a bench module gets: device, mode, seed module, random inputs, timing."""

    def __init__(self, mode: str, device: str, seed=None, seed_error=None, check: bool = True,
                 deadline: float | None = None):
        assert mode in MODES
        self.mode = mode
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.seed = seed
        self.seed_error = seed_error
        self.check = check
        self.deadline = deadline
        self.copy_gbps = None
        self.occupier = None  # occupy.Occupier: SMs held while timing (ab.py --occupy-sms), else None
        self.profile = False  # run(): one eager call between cudaProfilerStart / Stop, no timing
        self.sustain_s = 0.0  # > 0: graph timings also replay back to back this long, clocks sampled (_sustain)
        if self.cuda:
            props = torch.cuda.get_device_properties(self.device)
            self.l2_bytes = int(getattr(props, "L2_cache_size", 0) or 60 * 2**20)
        else:
            self.l2_bytes = 0

    # -- inputs
    def gen(self, seed: int) -> torch.Generator:
        g = torch.Generator(device=self.device)
        g.manual_seed(int(seed))
        return g

    def randn(self, shape, seed: int, dtype=torch.bfloat16, scale: float = 1.0) -> torch.Tensor:
        t = torch.randn(tuple(shape), generator=self.gen(seed), device=self.device, dtype=torch.float32)
        if scale != 1.0:
            t.mul_(scale)
        return t.to(dtype)

    def rand_bytes(self, shape, seed: int) -> torch.Tensor:
        return torch.randint(0, 256, tuple(shape), generator=self.gen(seed), device=self.device, dtype=torch.uint8)

    def randint(self, low: int, high: int, shape, seed: int, dtype=torch.int64) -> torch.Tensor:
        return torch.randint(low, high, tuple(shape), generator=self.gen(seed), device=self.device, dtype=dtype)

    def randperm(self, n: int, seed: int) -> torch.Tensor:
        return torch.randperm(n, generator=self.gen(seed), device=self.device)

    @staticmethod
    def cpu(*ts):
        """CPU copies (the exactness oracle is the torch reference on the CPU)."""
        out = tuple(t.detach().to("cpu", copy=True) if torch.is_tensor(t) else t for t in ts)
        return out if len(out) != 1 else out[0]

    def require_seed(self):
        if self.seed is None:
            raise RuntimeError(f"seed baseline unavailable: {self.seed_error}")
        return self.seed

    # -- rotation
    def n_sets(self, ws_bytes: int, alloc_bytes: int | None = None) -> int:
        """Input sets so that ``(n - 1) * ws_bytes >= 2 * L2``, within ``MAX_SETS`` and memory."""
        if not self.cuda:
            return 1
        alloc = max(int(alloc_bytes or ws_bytes), 1)
        want = 1 + math.ceil(2 * self.l2_bytes / max(int(ws_bytes), 1))
        free, _ = torch.cuda.mem_get_info(self.device)
        budget = min(24 * 2**30, free // 2)
        by_mem = max(1, budget // alloc)
        return int(max(1, min(want, MAX_SETS, by_mem)))

    def l2_cold(self, n: int, ws_bytes: int) -> bool:
        return None if not self.cuda else (n - 1) * ws_bytes >= 2 * self.l2_bytes

    # -- timing
    def _cpu_time(self, fn, sets, reps):
        ts = []
        for r in range(reps):
            a = sets[r % len(sets)]
            t0 = time.perf_counter()
            fn(*a)
            ts.append((time.perf_counter() - t0) * 1e6)
        return ts, "cpu-wallclock (meaningless)", 1

    def _event_time(self, fn, sets, reps, warm=True):
        n = len(sets)
        if warm:
            for a in sets[: min(n, 2)]:
                fn(*a)
        torch.cuda.synchronize()
        st = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        en = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        with self._held():
            for r in range(reps):
                a = sets[r % n]
                st[r].record()
                fn(*a)
                en[r].record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) * 1e3 for s, e in zip(st, en)]

    @staticmethod
    def _capture(fn, sets, k):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(k):
                fn(*sets[i % len(sets)])
        graph.replay()
        torch.cuda.synchronize()
        return graph

    def _held(self):
        """The timed loop's context: ``self.occupier`` (SMs held) or nothing."""
        return self.occupier if self.occupier is not None else contextlib.nullcontext()

    def _replay_times(self, graph, reps):
        st = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        en = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        with self._held():
            for r in range(reps):
                st[r].record()
                graph.replay()
                en[r].record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) * 1e3 for s, e in zip(st, en)]

    def _graph_time(self, fn, sets, reps):
        n = len(sets)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: compile, allocate, settle (torch's capture recipe)
            for a in sets[: min(n, 3)]:
                fn(*a)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        # calibrate with a small graph (eager timing would include host overhead), then size K
        # so one replay lasts about TARGET_REPLAY_US
        k = n * max(1, math.ceil(8 / n))
        graph = self._capture(fn, sets, k)
        est = statistics.median(self._replay_times(graph, 3)) / k
        want = min(max(n, math.ceil(TARGET_REPLAY_US[self.mode] / max(est, 0.1) / n) * n), max(n, MAX_CALLS // n * n))
        if want > k:
            del graph
            k = want
            graph = self._capture(fn, sets, k)
        ts = [t / k for t in self._replay_times(graph, reps)]
        sustained = self._sustain(graph, k) if self.sustain_s > 0 else {}
        del graph
        return ts, k, sustained

    def _sustain(self, graph, k) -> dict:
        """Replay ``graph`` (``k`` calls) back to back for ``sustain_s`` seconds while a thread
        samples ``SUSTAIN_QUERY`` every ``SUSTAIN_SAMPLE_S``: ``us_sustained`` per call and
        ``load_summary`` of the samples under the keys ``sustained_*``. A short timed loop may run
        at a boost clock that a long one (or a serving GPU) cannot hold at the board's power limit."""
        samples, stop = [], threading.Event()

        def sample():
            while not stop.is_set():
                s = _nvidia_smi(SUSTAIN_QUERY, units=False)
                if s:
                    samples.append(s)
                stop.wait(SUSTAIN_SAMPLE_S)

        thread = threading.Thread(target=sample, daemon=True)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        replays, t_end = 0, time.perf_counter() + self.sustain_s
        thread.start()
        with self._held():
            start.record()
            while time.perf_counter() < t_end:
                graph.replay()
                replays += 1
                if replays % 4 == 0:
                    torch.cuda.synchronize()  # the host stays at most 4 replays ahead of the GPU
            end.record()
            end.synchronize()
        stop.set()
        thread.join()
        summary = load_summary(samples)
        return {"us_sustained": start.elapsed_time(end) * 1e3 / (replays * k), "sustained_s": self.sustain_s,
                **{f"sustained_{key}": v for key, v in summary.items()}}

    def time(self, fn, sets, graph: bool = True) -> dict:
        """Median µs per call of ``fn(*sets[k % n])`` (graph replay or eager events); with
        ``sustain_s`` set, graph replays also give ``_sustain``'s fields."""
        note, sustained = None, {}
        if not self.cuda:
            ts, how, k = self._cpu_time(fn, sets, CPU_REPS)
        elif graph:
            try:
                ts, k, sustained = self._graph_time(fn, sets, GRAPH_REPS[self.mode])
                how = "cuda-graph replay"
            except Exception as e:  # noqa: BLE001  (capture refused: fall back to eager events)
                torch.cuda.synchronize()
                note = f"graph capture failed ({type(e).__name__}: {str(e)[:120]}); eager events"
                ts, how, k = self._event_time(fn, sets, EVENT_REPS[self.mode]), "cuda events (eager)", 1
        else:
            ts, how, k = self._event_time(fn, sets, EVENT_REPS[self.mode]), "cuda events (eager)", 1
        out = {"us": statistics.median(ts), "us_p20": _quantile(ts, 0.2), "us_p80": _quantile(ts, 0.8),
               "reps": len(ts), "calls_per_replay": k, "timing": how}
        if note:
            out["timing_note"] = note
        out.update(sustained)
        return out

    def run(self, fn, make_set, *, bytes: int, ws_bytes: int | None = None, alloc_bytes: int | None = None,
            graph: bool = True, **extra) -> dict:
        """Build rotated input sets with ``make_set(i)``, time ``fn(*set)``, return record fields.
        With ``profile`` set: one set, a warm-up call, then one call between
        ``torch.cuda.profiler.start()`` and ``stop()`` (for ``ncu --profile-from-start off``);
        no timing."""
        if self.profile:
            s = make_set(0)
            fn(*s)  # compiles and warms up outside the profiled range
            if self.cuda:
                torch.cuda.synchronize()
                torch.cuda.profiler.start()
            fn(*s)
            if self.cuda:
                torch.cuda.synchronize()
                torch.cuda.profiler.stop()
            return {"us": None, "bytes": int(bytes), "timing": "profiled (one eager call, cudaProfilerStart/Stop)",
                    **extra}
        ws = int(ws_bytes or bytes)
        n = self.n_sets(ws, alloc_bytes)
        sets = [make_set(i) for i in range(n)]
        if self.cuda:
            torch.cuda.synchronize()
        out = self.time(fn, sets, graph=graph)
        out.update(bytes=int(bytes), n_sets=n, ws_bytes=ws, l2_cold=self.l2_cold(n, ws))
        out.update(extra)
        del sets
        return out

    # -- copy bandwidth
    def measure_copy(self) -> dict:
        size = COPY_BYTES[self.mode]
        src = torch.empty(size, dtype=torch.uint8, device=self.device).random_(0, 256)
        dst = torch.empty_like(src)
        reps = max(EVENT_REPS[self.mode] * 2, 4)
        if self.cuda:
            for _ in range(3):
                dst.copy_(src)
            ts = self._event_time(lambda: dst.copy_(src), [()], reps, warm=False)
        else:
            ts, _, _ = self._cpu_time(lambda: dst.copy_(src), [()], reps)
        us = statistics.median(ts)
        return {"bytes": 2 * size, "us": us, "gbps": 2 * size / us / 1e3, "reps": reps}

    def copy_unit(self, nbytes: int) -> dict:
        """A record of a streaming kernel moving ``nbytes`` (half read, half written) over rotated
        sets, timed as the ops are (graph replay): ``torch.bitwise_not`` of int64 words, an
        elementwise kernel. Not ``copy_``, which a graph captures as a memcpy node (0.73-0.81 of
        the eager copy's bandwidth on an H100, 52nd session) and which, timed eagerly, is
        host-bound below ~30 us."""
        words = max(int(nbytes) // 16, 1)  # int64 words read (and as many written)

        def make_set(i):
            return (torch.empty(words, dtype=torch.int64, device=self.device).random_(),
                    torch.empty(words, dtype=torch.int64, device=self.device))

        return self.run(lambda src, dst: torch.bitwise_not(src, out=dst), make_set, bytes=16 * words)


# ----------------------------------------------------------------------------- units

def _err_text(e: BaseException) -> str:
    tb = traceback.format_exception(type(e), e, e.__traceback__)
    tail = "".join(tb[-3:]).strip().splitlines()[-6:]
    return f"{type(e).__name__}: {e}".strip()[:400] + (" | " + " / ".join(s.strip() for s in tail) if tail else "")


def run_unit(ctx: Ctx, mod, case: dict, impl: str) -> dict:
    rec = {"op": mod.OP, "case": case["label"], "params": {k: v for k, v in case.items() if k != "label"},
           "impl": impl, "status": "ok", "error": None}
    try:
        rec.update(mod.bench(ctx, case, impl))
        if ctx.cuda:
            torch.cuda.synchronize()
    except NotImplementedError as e:
        rec.update(status="skipped", error=f"not implemented: {e}")
    except Exception as e:  # noqa: BLE001
        rec.update(status="error", error=_err_text(e))
    finally:
        if ctx.cuda:
            try:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            except Exception:  # noqa: BLE001
                pass
    return rec


def build_plan(ops, mode, modules, cases=None, impls=None) -> list[tuple[str, int, str]]:
    """``(op, case index, impl)`` units in run order; ``cases``: a regular expression a case's
    label must contain (``re.search``), ``impls``: the implementations to keep (None: all)."""
    pattern = re.compile(cases) if cases else None
    plan, known = [], set()
    for op in ops:
        mod = modules[op]
        for ci, case in enumerate(mod.cases(mode)):
            known.update(mod.impls(case))
            if pattern is not None and not pattern.search(case["label"]):
                continue
            for impl in mod.impls(case):
                if impls is None or impl in impls:
                    plan.append((op, ci, impl))
    unknown = set(impls or ()) - known
    if unknown:
        raise ValueError(f"impls {sorted(unknown)} are not implementations of {list(ops)} (known: {sorted(known)})")
    if (cases or impls) and not plan:
        raise ValueError(f"no measurement of {list(ops)} matches cases={cases!r} impls={impls}")
    return plan


def execute(ctx: Ctx, plan, modules, sink, log=print) -> None:
    """Run ``plan`` units in order, ``sink(record)`` each; a dead CUDA context hands the rest
    of the plan to a fresh process."""
    cases = {op: modules[op].cases(ctx.mode) for op in {u[0] for u in plan}}
    for j, (op, ci, impl) in enumerate(plan):
        case = cases[op][ci]
        if ctx.deadline is not None and time.time() > ctx.deadline:
            sink({"op": op, "case": case["label"], "params": {k: v for k, v in case.items() if k != "label"},
                  "impl": impl, "status": "skipped", "error": "time budget exhausted"})
            continue
        t0 = time.time()
        rec = run_unit(ctx, modules[op], case, impl)
        rec["wall_s"] = round(time.time() - t0, 3)
        sink(rec)
        us = f"{rec['us']:.2f} us" if rec.get("us") is not None else rec["status"]
        log(f"  [{j + 1}/{len(plan)}] {op:9s} {case['label']:28s} {impl:16s} {us}"
            + (f"  ({rec['error'][:100]})" if rec.get("error") else ""), flush=True)
        if rec["status"] == "error" and ctx.cuda and not cuda_alive():
            rest = plan[j + 1:]
            log(f"  CUDA context lost after {op}/{impl}; running the remaining {len(rest)} units in a "
                "fresh process", flush=True)
            for r in _run_child(ctx, rest):
                sink(r)
            return


def _run_child(ctx: Ctx, plan) -> list[dict]:
    if not plan:
        return []
    with tempfile.TemporaryDirectory() as tmp:
        spec = {"plan": plan, "mode": ctx.mode, "device": str(ctx.device), "check": ctx.check,
                "deadline": ctx.deadline, "copy_gbps": ctx.copy_gbps,
                "seed_path": getattr(ctx, "seed_path", None), "out": str(Path(tmp) / "out.json")}
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        import kpool
        env = dict(os.environ)
        src = str(Path(kpool.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", str(spec_path)], env=env)
        out = Path(spec["out"])
        recs = json.loads(out.read_text()) if out.is_file() else []
    done = {(r["op"], r["case"], r["impl"]) for r in recs}
    if proc.returncode != 0 or len(recs) < len(plan):
        mods = {op: load_op_module(op) for op in {u[0] for u in plan}}
        for op, ci, impl in plan:
            case = mods[op].cases(ctx.mode)[ci]
            if (op, case["label"], impl) not in done:
                recs.append({"op": op, "case": case["label"], "params": {k: v for k, v in case.items() if k != "label"},
                             "impl": impl, "status": "error",
                             "error": f"child process exited with code {proc.returncode} before this unit"})
    return recs


def _child_main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    import kpool  # noqa: F401  (interpreter fix when interpreting)
    seed, seed_err = load_seed(spec["seed_path"])
    ctx = Ctx(spec["mode"], spec["device"], seed, seed_err, spec["check"], spec["deadline"])
    ctx.seed_path = spec["seed_path"]
    ctx.copy_gbps = spec["copy_gbps"]
    plan = [tuple(u) for u in spec["plan"]]
    modules = {op: load_op_module(op) for op in {u[0] for u in plan}}
    recs: list[dict] = []

    def sink(r):
        recs.append(r)
        Path(spec["out"]).write_text(json.dumps(recs))

    execute(ctx, plan, modules, sink)
    Path(spec["out"]).write_text(json.dumps(recs))
    return 0


# ----------------------------------------------------------------------------- results

def finalize(results: list[dict], copy_gbps: float | None, modules, mode: str = "full") -> None:
    """Derived figures: GB/s, fraction of copy bandwidth, floor, speedup vs seed, targets."""
    for r in results:
        us, b = r.get("us"), r.get("bytes")
        if us and b:
            r["gbps"] = b / us / 1e3
            if copy_gbps:
                r["frac_copy"] = r["gbps"] / copy_gbps
                r["floor_us"] = b / copy_gbps / 1e3
    seed_us = {(r["op"], r["case"]): r["us"] for r in results if r["impl"] == "seed" and r.get("us")}
    for r in results:
        s = seed_us.get((r["op"], r["case"]))
        if s and r.get("us") and r["impl"] != "seed":
            r["speedup_vs_seed"] = s / r["us"]
    by_key = {(r["op"], r["case"], r["impl"]): r for r in results}
    for op, mod in modules.items():
        if not hasattr(mod, "targets"):
            continue
        for case in mod.cases(mode):
            label = case["label"]
            for t in mod.targets(case):
                rec = by_key.get((op, label, t["impl"]))
                if rec is None:
                    continue
                rec.setdefault("targets", []).append({**t, "ok": _judge(t, rec, seed_us.get((op, label)))})


def _judge(t, rec, seed_us):
    us = rec.get("us")
    if us is None:
        return None
    if t["kind"] == "min_frac_copy":
        return None if rec.get("frac_copy") is None else rec["frac_copy"] >= t["value"]
    if t["kind"] == "max_us":
        return us <= t["value"]
    if t["kind"] == "max_vs_seed":
        return None if not seed_us else us <= seed_us * t["value"]
    return None


def _fmt(x, spec, dash="-"):
    """``format(x, spec)``; ``dash`` (right-aligned to the spec's width) for None."""
    if x is not None:
        return format(x, spec)
    width = re.match(r"\d*", spec).group()
    return format(dash, f">{width}") if width else dash


def format_table(doc: dict) -> str:
    """Compact text table of every record."""
    meta = doc["meta"]
    cp = doc.get("copy_bandwidth") or {}
    head = (f"kpool benchmarks: {meta.get('gpu') or meta.get('device')}  mode={meta.get('mode')}  "
            f"copy={_fmt(cp.get('gbps'), '.0f')} GB/s  torch {meta.get('torch')}  triton {meta.get('triton')}  "
            f"commit {(meta.get('git') or {}).get('commit') or '?'}")
    lines = [head]
    if not meta.get("timing_valid", True):
        lines.append("!! timings are NOT meaningful (CPU / interpreter dry run): they only exercise the code paths")
    cols = f"{'op':9s} {'case':28s} {'impl':16s} {'us':>10s} {'GB/s':>8s} {'xcopy':>6s} {'vs seed':>8s} {'exact':>5s}  target"
    lines += [cols, "-" * len(cols)]
    for r in doc["results"]:
        if r["status"] != "ok":
            lines.append(f"{r['op']:9s} {r['case']:28s} {r['impl']:16s} {r['status'].upper():>10s}  "
                         f"{(r.get('error') or '')[:90]}")
            continue
        exact = {True: "yes", False: "NO", None: "-"}[r.get("exact")]
        tg = "; ".join(f"{t['text']}: {({True: 'PASS', False: 'MISS', None: '?'})[t['ok']]}"
                       for t in r.get("targets", []))
        sp = r.get("speedup_vs_seed")
        lines.append(f"{r['op']:9s} {r['case']:28s} {r['impl']:16s} {_fmt(r.get('us'), '10.2f')} "
                     f"{_fmt(r.get('gbps'), '8.0f')} {_fmt(r.get('frac_copy'), '6.2f')} "
                     f"{(format(sp, '7.2f') + 'x') if sp else '-':>8s} {exact:>5s}  {tg}")
    for op, err in (doc.get("load_errors") or {}).items():
        lines.append(f"{op:9s} NOT RUN: bench module failed: {err[:100]}")
    for op, text in (doc.get("hooks") or {}).items():
        lines.append(f"hook {op}: {text}")
    n_err = sum(r["status"] == "error" for r in doc["results"])
    n_skip = sum(r["status"] == "skipped" for r in doc["results"])
    lines.append(f"{len(doc['results'])} records, {n_err} errors, {n_skip} skipped; elapsed {meta.get('elapsed_s')} s")
    return "\n".join(lines)


def write_json(doc: dict, path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- driver

def environment(ctx: Ctx, seed_path) -> dict:
    import triton

    import kpool
    from kpool import _backend
    meta = {
        "schema": SCHEMA,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "mode": ctx.mode,
        "device": str(ctx.device),
        "gpu": torch.cuda.get_device_name(ctx.device) if ctx.cuda else None,
        "timing_valid": ctx.cuda,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "torch_hip": torch.version.hip,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "git": git_info(),
        "source_sha256": source_digest(),
        "kpool_file": str(Path(kpool.__file__).resolve()),
        "kpool_backend": _backend.backend_for(ctx.device),
        "triton_interpret": _backend.interpreting(),
        "kpool_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("KPOOL_")},
        "seed_path": str(seed_path) if seed_path else None,
        "seed_sha256": sha256_file(seed_path) if seed_path else None,
        "seed_error": ctx.seed_error,
        "seed_note": ("the seed's wrappers use the preshuffled page layout whenever PAGE > 1 (its only layout "
                      "at PAGE 64) and its decode kernel needs RING == P; ours is measured with layout='plain'"),
        "l2_bytes": ctx.l2_bytes,
        "command": sys.argv,
        "method": ("inputs rotated across n_sets copies ((n_sets-1)*working_set >= 2*L2 where memory allows, "
                   f"max {MAX_SETS}); ours and seed timed by CUDA-graph replay of K calls (time/K), torch path "
                   "by eager CUDA events; median of reps; bytes = each input read once + each output written "
                   "once; frac_copy = GB/s / copy GB/s = floor_us / us"),
    }
    if ctx.cuda:
        p = torch.cuda.get_device_properties(ctx.device)
        meta["gpu_props"] = {"sm_count": p.multi_processor_count, "total_mem_bytes": p.total_memory,
                             "capability": f"{p.major}.{p.minor}"}
        meta["nvidia_smi"] = _nvidia_smi()
    return meta


def run(ops=None, mode="full", out_json=None, seed_path=None, check=True, budget_s=None, device=None,
        verbose=True, cases=None, impls=None, profile=False) -> dict:
    """Run the benchmarks; returns the result document (also written to ``out_json``).
    ``cases`` / ``impls``: run only these units (``build_plan``); the document records the
    filter in ``meta["filter"]``, and ``merge_results.py`` refuses such a partial document.
    ``profile``: no timing, each unit's call once between profiler start / stop (``Ctx.run``)."""
    t_start = time.time()
    log = print if verbose else (lambda *a, **k: None)
    ops = list(ops) if ops else list(OPS)
    bad = [o for o in ops if o not in OPS]
    if bad:
        raise ValueError(f"unknown ops {bad}; known: {list(OPS)}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if seed_path is None:
        seed_path = default_seed_path()
    seed, seed_err = load_seed(seed_path)
    ctx = Ctx(mode, device, seed, seed_err, check, None if budget_s is None else t_start + budget_s)
    ctx.seed_path = str(seed_path) if seed_path else None
    ctx.profile = profile
    if seed_err:
        log(f"WARNING: {seed_err}; seed columns will be errors", flush=True)
    modules = {}
    load_errors = {}
    for op in ops:
        try:
            mod = load_op_module(op)
            for case in mod.cases(mode):
                mod.impls(case)
            modules[op] = mod
        except Exception as e:  # noqa: BLE001  (a broken bench module must not stop the others)
            load_errors[op] = _err_text(e)
    doc = {"meta": environment(ctx, seed_path), "copy_bandwidth": None, "results": [], "hooks": {},
           "load_errors": load_errors}
    for op, mod in modules.items():
        if getattr(mod, "HOOK", None):
            doc["hooks"][op] = mod.HOOK
    log(f"kpool bench: mode={mode} device={doc['meta']['gpu'] or device} ops={ops}", flush=True)
    for op, err in load_errors.items():
        log(f"  {op}: bench module failed to load, skipped: {err}", flush=True)
    try:
        c0 = ctx.measure_copy()
    except Exception as e:  # noqa: BLE001
        c0 = {"error": _err_text(e)}
    ctx.copy_gbps = c0.get("gbps")
    doc["copy_bandwidth"] = {"start": c0, "gbps": ctx.copy_gbps}
    log(f"  copy bandwidth: {_fmt(ctx.copy_gbps, '.0f')} GB/s", flush=True)

    def sink(rec):
        rec["mode"] = mode
        doc["results"].append(rec)
        if out_json:
            doc["meta"]["elapsed_s"] = round(time.time() - t_start, 1)
            doc["meta"]["partial"] = True
            write_json(doc, out_json)

    plan = build_plan(list(modules), mode, modules, cases, impls)
    if cases or impls:
        doc["meta"]["filter"] = {"cases": cases, "impls": sorted(impls) if impls else None}
    doc["meta"]["profile"] = profile
    execute(ctx, plan, modules, sink, log)
    if not (ctx.cuda and not cuda_alive()):
        try:
            c1 = ctx.measure_copy()
            doc["copy_bandwidth"]["end"] = c1
            ctx.copy_gbps = max(ctx.copy_gbps or 0.0, c1["gbps"]) or None
            doc["copy_bandwidth"]["gbps"] = ctx.copy_gbps
        except Exception as e:  # noqa: BLE001
            doc["copy_bandwidth"]["end"] = {"error": _err_text(e)}
    finalize(doc["results"], ctx.copy_gbps, modules, mode)
    doc["meta"]["elapsed_s"] = round(time.time() - t_start, 1)
    doc["meta"]["partial"] = False
    if out_json:
        write_json(doc, out_json)
    log(format_table(doc), flush=True)
    if out_json:
        log(f"wrote {out_json}", flush=True)
    return doc


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        sys.exit(_child_main(sys.argv[2]))
    print("use `python -m kpool.bench` or `python benchmarks/run_all.py`", file=sys.stderr)
    sys.exit(2)
