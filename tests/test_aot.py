"""Ahead-of-time compile matrix (issue 6): every kernel of kpool.ops compiles for every target.

The compiles run in worker processes with TRITON_INTERPRET off (this process may be
interpreting); see ``kpool.aot``.
"""

import importlib
import sys
import textwrap

import pytest

from kpool import aot

FAKE = """
import triton
import triton.language as tl

from kpool.aot import KernelSpec, axis, native_fp8_param


@triton.jit
def _helper(x):
    return x * 2.0


@triton.jit
def _encode(x, FNUZ: tl.constexpr, NATIVE: tl.constexpr):
    if NATIVE:  # Triton's fp32 -> fp8 conversion: what sm_80 cannot compile for e4m3fn
        if FNUZ:
            y = x.to(tl.float8e4b8).to(tl.uint8, bitcast=True)
        else:
            y = x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:  # stands for the software encoder (integer ops)
        y = x.to(tl.int32).to(tl.uint8)
    return y


@triton.jit
def _native_fp8_kernel(x_ptr, y_ptr, n, FNUZ: tl.constexpr, NATIVE_FP8: tl.constexpr, MODE: tl.constexpr,
                       BLOCK: tl.constexpr):
    # MODE 0: native conversion iff NATIVE_FP8; 1: always (ignores the flag); 2: never
    i = tl.arange(0, BLOCK)
    x = _helper(tl.load(x_ptr + i, mask=i < n, other=0.0))
    if MODE == 0:
        y = _encode(x, FNUZ, NATIVE_FP8)
    elif MODE == 1:
        y = _encode(x, FNUZ, True)
    else:
        y = _encode(x, FNUZ, False)
    tl.store(y_ptr + i, y, mask=i < n)
"""

SPECS = """
AOT_SPECS = {"_native_fp8_kernel": KernelSpec(ptrs=dict(x_ptr="fp32", y_ptr="u8"), cross=(axis("FNUZ", (False,)),),
                                              fixed=dict(BLOCK=128, MODE=1), target_derive=native_fp8_param)}
"""

# NATIVE_FP8 set by the case against what the kernel does
FLAG_SPECS = """
AOT_SPECS = {"_native_fp8_kernel": KernelSpec(
    ptrs=dict(x_ptr="fp32", y_ptr="u8"), cross=(axis("FNUZ", (False,)),),
    cycle=([dict(MODE=1, NATIVE_FP8=False), dict(MODE=2, NATIVE_FP8=True), dict(MODE=0, NATIVE_FP8=True)],),
    fixed=dict(BLOCK=128))}
"""

# kernels with a NATIVE_FP8 choice: the fp8 writers (encoder) and the scorers (decoder)
FP8_KERNELS = ("_compress_kernel", "_prefill_kernel", "_decode_update_kernel", "_fwht_quant_kernel",
               "_paged_logits_kernel", "_ragged_logits_kernel", "_paged_topk_kernel", "_refine_kernel")
FP8_MODULES = ["kpool.ops.compress", "kpool.ops.prefill", "kpool.ops.decode", "kpool.ops.quant", "kpool.ops.logits",
               "kpool.ops.score"]

# a kernel launched with PDL that skips the wait (MODE 1) against one that waits (MODE 0)
PDL_FAKE = """
import triton
import triton.language as tl

from kpool.aot import KernelSpec, axis
from kpool.ops import _pdl


@triton.jit
def _pdl_kernel(x_ptr, n, MODE: tl.constexpr, PDL: tl.constexpr):
    if MODE == 0:
        _pdl.grid_dependency_sync(PDL)
    i = tl.arange(0, 128)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)


AOT_SPECS = {"_pdl_kernel": KernelSpec(ptrs=dict(x_ptr="fp32"), cross=(axis("MODE", (0, 1)),))}
"""


def _fake_module(tmp_path, monkeypatch, name, source):
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop(name, None)
    return importlib.import_module(name)


def test_discovery_finds_the_package_kernels():
    kernels = aot.discover_kernels()
    assert "_compress_kernel" in kernels
    assert kernels["_compress_kernel"][0].__name__ == "kpool.ops.compress"
    assert all(name.startswith("_") and name.endswith("_kernel") for name in kernels)
    assert "pool_vector" not in kernels and "_load_token" not in kernels  # helpers are not kernels
    assert "_downcast_selftest_kernel" in kernels  # found outside kpool.ops too (kpool._interpreter)
    registry = aot.check_registry()  # every kernel of the package has a spec, or is excluded with a reason
    assert set(registry) == set(kernels) - set(aot.EXCLUDED)


def test_job_list_does_not_depend_on_target_order():
    """The workers rebuild the job list from the canonical target order and compare digests:
    ``--targets sm_90,sm_80`` once failed with "job list differs from the parent's"."""
    kernels = ["_decode_update_kernel"]
    a = aot.build_jobs(targets=["sm_90", "sm_80", "gfx942"], kernels=kernels)
    b = aot.build_jobs(targets=["gfx942", "sm_80", "sm_90"], kernels=kernels)
    assert aot._jobs_digest(a) == aot._jobs_digest(b)
    assert list(dict.fromkeys(j.target for j in a)) == ["sm_80", "sm_90", "gfx942"]


def test_unregistered_kernel_fails(tmp_path, monkeypatch):
    mod = _fake_module(tmp_path, monkeypatch, "kpool_aot_orphan", FAKE)
    assert set(aot.discover_kernels([mod])) == {"_native_fp8_kernel"}
    with pytest.raises(aot.AotSpecError, match="_native_fp8_kernel .*has no AOT spec"):
        aot.check_registry([mod])
    with pytest.raises(aot.AotSpecError, match="_native_fp8_kernel"):
        aot.build_jobs(modules=[mod])
    # ... and a spec naming no kernel fails too
    mod = _fake_module(tmp_path, monkeypatch, "kpool_aot_stale", FAKE.replace("_native_fp8_kernel", "_gone") + SPECS)
    with pytest.raises(aot.AotSpecError, match="_native_fp8_kernel names no kernel"):
        aot.check_registry([mod])


def test_bad_spec_is_named(tmp_path, monkeypatch):
    bad = SPECS.replace('ptrs=dict(x_ptr="fp32", y_ptr="u8")', 'ptrs=dict(x_ptr="fp32")')
    mod = _fake_module(tmp_path, monkeypatch, "kpool_aot_badspec", FAKE + bad)
    with pytest.raises(aot.AotSpecError, match="_native_fp8_kernel: pointer argument y_ptr has no type"):
        aot.build_jobs(modules=[mod])


def test_failure_names_kernel_and_target(tmp_path, monkeypatch):
    """A native fp32 -> e4m3fn conversion does not compile for sm_80 (SPEC.md §6): the matrix
    reports that job as failed, naming the kernel and the target; sm_90 compiles it."""
    mod = _fake_module(tmp_path, monkeypatch, "kpool_aot_fp8", FAKE + SPECS)
    results = aot.compile_matrix(["sm_80", "sm_90"], progress=False, modules=[mod.__name__])
    by_target = {r.target: r for r in results if "hints=aligned" in r.label}
    assert not by_target["sm_80"].ok and by_target["sm_90"].ok, [r.describe() for r in results]
    assert "NATIVE_FP8=0" in by_target["sm_80"].label and "NATIVE_FP8=2" in by_target["sm_90"].label
    text = by_target["sm_80"].describe()
    assert text.startswith("_native_fp8_kernel for sm_80 [") and "FAILED" in text, text
    assert by_target["sm_90"].native_fp8 and by_target["sm_90"].stages[-1] == "cubin"
    table = aot.format_results(results)
    assert "FAILED _native_fp8_kernel for sm_80" in table
    assert "  sm_90: _native_fp8_kernel (e4m3fn)" in table, table


COPY_FAKE = """
import triton
import triton.language as tl

from kpool.aot import KernelSpec, axis


@triton.jit
def _copy_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(y_ptr + i, tl.load(x_ptr + i, mask=i < n), mask=i < n)


AOT_SPECS = {"_copy_kernel": KernelSpec(ptrs=dict(x_ptr="fp32", y_ptr="fp32"), cross=(axis("BLOCK", (64, 128)),))}
"""


def test_each_worker_compiles_one_target(tmp_path, monkeypatch):
    """A worker process compiles the jobs of one target only (Triton keeps per-process backend
    state across targets: triton 3.6 failed an e4m3fnuz kernel for gfx942 compiled after a
    gfx950 job in the same process); with fewer workers than targets, the matrix starts more
    until every job is compiled."""
    mod = _fake_module(tmp_path, monkeypatch, "kpool_aot_workers", COPY_FAKE)
    targets = ["sm_90", "gfx942", "gfx950"]
    results = aot.compile_matrix(targets, progress=False, jobs=2, modules=[mod.__name__])
    assert all(r.ok for r in results) and sorted({r.target for r in results}) == sorted(targets), \
        [r.describe() for r in results]
    per_worker = {}
    for r in results:
        per_worker.setdefault(r.worker, set()).add(r.target)
    assert len(per_worker) >= len(targets) and all(len(t) == 1 for t in per_worker.values()), per_worker


def test_fp8_types_only_with_native_flag(tmp_path, monkeypatch):
    """fp8 types in the TTIR exactly when NATIVE_FP8 is set: a kernel converting natively while
    NATIVE_FP8 is False fails (it would rely on a conversion sm_80 lacks), and so does one
    that ignores NATIVE_FP8=True; the kernel that follows the flag compiles."""
    mod = _fake_module(tmp_path, monkeypatch, "kpool_aot_flag", FAKE + FLAG_SPECS)
    results = aot.compile_matrix(["sm_90"], progress=False, modules=[mod.__name__])
    by_mode = {r.label.split("MODE=")[1][0]: r for r in results}
    assert set(by_mode) == {"0", "1", "2"}, [r.label for r in results]
    assert by_mode["0"].ok and by_mode["0"].native_fp8, by_mode["0"].describe()
    assert not by_mode["1"].ok and "fp8 types in the TTIR with NATIVE_FP8=0" in by_mode["1"].error
    assert not by_mode["2"].ok and "NATIVE_FP8 set but no fp8 type" in by_mode["2"].error
    assert by_mode["1"].stages[-1] == "cubin"  # it compiled: the check, not the compiler, failed it


def test_fp8_kernels_follow_the_native_fp8_table():
    """The fp8 writers' and scorers' NATIVE_FP8 per target and format is _backend.native_fp8_mode's
    (what native_fp8 picks by default at run time): software on sm_80, e4m3fn native on sm_90 /
    sm_100 (the satfinite conversion alone) / gfx950, e4m3fnuz native on gfx942; every target gets
    both formats."""
    import torch

    from kpool._backend import FP8_CONVERSION, FP8_SATFINITE, native_fp8_mode
    expect = {"sm_80": (False, False), "sm_90": (True, False), "sm_100": (True, False),
              "gfx942": (False, True), "gfx950": (True, False)}  # (e4m3fn, e4m3fnuz)
    jobs = aot.build_jobs(kernels=list(FP8_KERNELS), modules=FP8_MODULES)
    seen = set()
    for j in jobs:
        fnuz = j.constexprs["FNUZ"]
        native = j.constexprs["NATIVE_FP8"]
        backend, arch = aot.TARGETS[j.target][:2]
        assert native == native_fp8_mode(backend, arch, torch.float8_e4m3fnuz if fnuz else torch.float8_e4m3fn)
        assert bool(native) == expect[j.target][fnuz], (j.target, j.kernel, j.label)
        assert native in ((FP8_SATFINITE,) if backend == "cuda" else (FP8_CONVERSION,)) or not native
        assert f"NATIVE_FP8={int(native)}" in j.label
        seen.add((j.kernel, j.target, fnuz))
    assert seen == {(k, t, f) for k in FP8_KERNELS for t in aot.TARGETS for f in (False, True)}


def test_launch_options_the_launchers_use():
    """Per-case compile options (``_opt_`` keys): the decode kernel compiles with every warp
    count ``decode_warps`` picks; the fused scorer with its NUM_WARPS; leaves at both ends
    of ``plan_leaves``' range, below KB (never one leaf per row) and above (top-k); the prefill writer
    with its register cap at the P that has one."""
    from kpool.ops import decode, prefill, score, topk
    jobs = aot.build_jobs(targets=["sm_90"], kernels=["_decode_update_kernel", "_paged_topk_kernel",
                                                      "_chunk_topk_kernel"])
    warps = {j.options.get("num_warps") for j in jobs if j.kernel == "_decode_update_kernel"}
    assert warps == {decode.decode_warps(b, n) for b in (1, 1 << 20) for n in (1, 4)} == {1, 2, 4}
    assert {j.options.get("num_warps") for j in jobs if j.kernel == "_paged_topk_kernel"} == {score.NUM_WARPS}
    # the filtering leaves (score.filters: of at most KB pools, and wide ones of 2 x KB) and the exact
    # ones, filtering only where it can be chosen; one-leaf launches only from KB pools up
    filt = {(c["FILTER"], c["FINAL"], c["NT"] * c["BN"] // c["KB"])
            for c in (j.constexprs for j in jobs if j.kernel == "_paged_topk_kernel")}
    assert {(True, False, 0), (True, False, 1), (True, False, 2), (False, False, 0), (False, True, 1)} <= filt
    assert not any(f and (final or ratio > 2) for f, final, ratio in filt)
    assert not any(final and ratio == 0 for _, final, ratio in filt)
    # the scorer's register caps, per (FILTER, ROWS, H), as launch_options sets them on CUDA:
    # capped, and also uncapped (a small grid's, score.small_grid)
    caps = {(c["FILTER"], c["ROWS"], c["H"], j.options.get("maxnreg"))
            for j, c in ((j, j.constexprs) for j in jobs if j.kernel == "_paged_topk_kernel")}
    assert caps and all(cap in {score.max_regs(f, rows, h), None} for f, rows, h, cap in caps)
    assert {cap for f, _, _, cap in caps if not f} == {score.MAX_REGS, None}
    # and its pipeline stages, per FILTER, as the launcher passes them
    stages = {(j.constexprs["FILTER"], j.constexprs["STAGES"]) for j in jobs if j.kernel == "_paged_topk_kernel"}
    assert stages == {(f, score.pipeline_stages(f)) for f in (False, True)}
    leaves = {(j.constexprs["KB"], j.constexprs["CHUNK"]) for j in jobs if j.kernel == "_chunk_topk_kernel"}
    assert any(c < kb for kb, c in leaves) and any(c >= kb for kb, c in leaves)
    assert min(c for _, c in leaves) == topk.MIN_CHUNK
    # the prefill writer's register cap, per P, as launch_options sets it on CUDA
    caps = {(j.constexprs["P"], j.options.get("maxnreg")) for j in aot.build_jobs(targets=["sm_90"],
                                                                                  kernels=["_prefill_kernel"])}
    assert caps == {(p, prefill.MAX_REGS.get(p)) for p in (4, 16)} and prefill.MAX_REGS
    # the decode walk's (one-token steps) register caps, per (P, warps), as decode_options sets them
    caps = {(c["P"], c["NB"], j.options.get("num_warps"), j.options.get("maxnreg"))
            for j, c in ((j, j.constexprs) for j in jobs if j.kernel == "_decode_update_kernel")}
    assert all(cap == (decode.ONE_TOKEN_MAX_REGS.get((p, w)) if nb == 1 else None) for p, nb, w, cap in caps)
    assert any(cap for *_, cap in caps)


def test_decode_steps_are_the_ones_the_launcher_takes():
    """Every decode job is a (P, RING, step) the launcher accepts (RING a multiple of P, at
    least P + next_n - 1 for the step's largest next_n), and the steps of KPoolCache's rings
    (1, 2, 4, 8 tokens at ``ring_size(P, next_n - 1)``) are all compiled."""
    from kpool.layout import ring_size
    from kpool.ops import decode
    shapes = {(c["P"], c["RING"], c.get("next_n", "i32"), c["NB"]) for c in (j.constexprs for j in aot.build_jobs(
        targets=["sm_90"], kernels=["_decode_update_kernel"]))}
    assert all(ring % p == 0 and ring >= p + nb - 1 for p, ring, _, nb in shapes)
    assert all((next_n == 1) == (nb == 1) and decode.step_tiles(nb, p)["NB"] == nb for p, _, next_n, nb in shapes)
    assert {(p, ring_size(p, n - 1), n) for p in (4, 16) for n in (1, 2, 4, 8)} <= {(p, r, nb) for p, r, _, nb in shapes}

def test_register_caps_apply_to_cuda_only(monkeypatch):
    """The launchers' ``maxnreg`` (``_backend.register_cap``): set on CUDA targets, never on
    ROCm or the interpreter, not for a P without a cap, nor under ``KPOOL_REGISTER_CAP=0``."""
    from kpool import _backend
    from kpool.ops import decode, prefill, score
    for target, capped in ((("cuda", 90), True), (("hip", "gfx942"), False), (("interpreter", None), False)):
        monkeypatch.setattr(_backend, "device_target", lambda device, t=target: t)
        assert score.launch_options("cpu").get("maxnreg") == (score.MAX_REGS if capped else None)
        assert prefill.launch_options("cpu", 16).get("maxnreg") == (prefill.MAX_REGS[16] if capped else None)
        assert "maxnreg" not in prefill.launch_options("cpu", 4)
        # decode: one-token steps at P = 16 (2 warps above SMALL_BATCH requests, 4 up to it); none
        # for verify steps or for P = 4 at 4 warps
        for b, warps in ((decode.SMALL_BATCH + 1, 2), (1, 4)):
            want = decode.ONE_TOKEN_MAX_REGS[16, warps] if capped else None
            assert decode.decode_options(b, 1, 16, "cpu") == dict(num_warps=warps, **({"maxnreg": want} if want else {}))
        assert decode.decode_options(1, 1, 4, "cpu") == dict(num_warps=4)
        assert decode.decode_options(1 << 20, 4, 16, "cpu") == dict(num_warps=1)
        with monkeypatch.context() as m:  # KPOOL_REGISTER_CAP=0: no cap anywhere
            m.setenv(_backend.REGISTER_CAP_ENV, "0")
            assert "maxnreg" not in score.launch_options("cpu", True)
            assert "maxnreg" not in prefill.launch_options("cpu", 16)
            assert "maxnreg" not in decode.decode_options(1 << 20, 1, 16, "cpu")


def test_small_leaf_grids_run_uncapped(monkeypatch):
    """``score.launch_options`` on CUDA: a leaf grid that takes no more waves uncapped
    (``UNCAPPED_PER_SM`` programs per SM, ``FILTER_UNCAPPED_PER_SM`` for one-row filtering
    leaves of at most 32 heads) than at its cap compiles without one, a larger one with the
    usual cap (exact or filtering leaves, one or two rows, 64 heads; two-row filtering leaves of
    at most 32 heads their own); a launch that gives no
    grid size (refine) keeps ``MAX_REGS``; no SM count (off the GPU): never uncapped."""
    from kpool import _backend
    from kpool.ops import score, topk
    monkeypatch.setattr(_backend, "device_target", lambda device: ("cuda", 90))
    monkeypatch.setattr(topk, "_sm_count", lambda device: 132)
    assert score.REGISTERS_PER_SM // (score.MAX_REGS * 32 * score.NUM_WARPS) == 3  # 3 exact leaves per SM capped
    assert score.REGISTERS_PER_SM // (score.FILTER_MAX_REGS * 32 * score.NUM_WARPS) == 6  # 6 filtering ones
    exact = score.UNCAPPED_PER_SM * 132 * 2  # two waves uncapped, two at the cap (3 per SM)
    for programs in (1, score.UNCAPPED_PER_SM * 132, exact):
        assert "maxnreg" not in score.launch_options("cpu", programs=programs)
    assert score.launch_options("cpu", programs=exact + 1)["maxnreg"] == score.MAX_REGS  # three waves vs two
    assert score.launch_options("cpu", rows=2, programs=exact + 1)["maxnreg"] == score.MAX_REGS
    one = score.FILTER_UNCAPPED_PER_SM * 132  # one wave either way
    assert "maxnreg" not in score.launch_options("cpu", True, programs=one)
    assert score.launch_options("cpu", True, programs=one + 1)["maxnreg"] == score.FILTER_MAX_REGS
    assert "maxnreg" not in score.launch_options("cpu", True, heads=64, programs=score.UNCAPPED_PER_SM * 132)
    assert score.launch_options("cpu", True, heads=64, programs=one)["maxnreg"] == score.FILTER_MAX_REGS_H64
    assert score.launch_options("cpu", True, rows=2, programs=exact + 1)["maxnreg"] == score.FILTER_MAX_REGS_ROWS2
    assert score.launch_options("cpu", True, rows=2, heads=64, programs=exact + 1)["maxnreg"] == score.MAX_REGS
    assert score.launch_options("cpu")["maxnreg"] == score.MAX_REGS
    monkeypatch.setattr(topk, "_sm_count", lambda device: 0)
    assert score.launch_options("cpu", programs=1)["maxnreg"] == score.MAX_REGS


def test_pdl_launch_on_cuda_sm90_and_later_only(monkeypatch):
    """``_backend.pdl_launch``: ``PDL`` and ``launch_pdl`` on CUDA sm_90+ unless ``KPOOL_PDL=0``;
    ``PDL=False`` and no ``launch_pdl`` (an option other backends reject) elsewhere."""
    from kpool import _backend
    on = {"PDL": True, "launch_pdl": True}
    for target, want in ((("cuda", 90), on), (("cuda", 100), on), (("cuda", 80), {"PDL": False}),
                         (("hip", "gfx942"), {"PDL": False}), (("interpreter", None), {"PDL": False})):
        monkeypatch.setattr(_backend, "device_target", lambda device, t=target: t)
        monkeypatch.delenv(_backend.PDL_ENV, raising=False)
        assert _backend.pdl_launch("cpu") == want, target
        monkeypatch.setenv(_backend.PDL_ENV, "0")
        assert _backend.pdl_launch("cpu") == {"PDL": False}, target


def test_pdl_follows_the_target_and_a_kernel_must_wait(tmp_path, monkeypatch):
    """Every package kernel (kpool.ops._pdl) takes ``PDL`` and compiles with it set exactly on
    the targets ``has_pdl`` names; on sm_90 a kernel whose PTX does not wait on the previous
    grid while ``PDL`` is set fails the matrix, and on sm_80 (``PDL`` unset) both forms compile."""
    from kpool._backend import has_pdl
    kernels = set(aot.discover_kernels()) - set(aot.EXCLUDED)
    pdl = {(j.kernel, j.target, j.constexprs.get("PDL")) for j in aot.build_jobs()}
    assert pdl == {(k, t, has_pdl(*aot.TARGETS[t][:2])) for k in kernels for t in aot.TARGETS}
    mod = _fake_module(tmp_path, monkeypatch, "kpool_aot_pdl", PDL_FAKE)
    results = {(r.target, r.label.split("MODE=")[1][0]): r
               for r in aot.compile_matrix(["sm_80", "sm_90"], progress=False, modules=[mod.__name__])}
    assert results["sm_90", "0"].ok and results["sm_80", "0"].ok and results["sm_80", "1"].ok
    assert not results["sm_90", "1"].ok and "griddepcontrol.wait" in results["sm_90", "1"].error


def test_every_kernel_compiles_for_every_target(capsys):
    results = aot.compile_matrix(progress=True)
    with capsys.disabled():  # the table goes to the CI log, pass or fail
        print("\n" + aot.format_results(results))
    failures = [r.describe() for r in results if not r.ok]
    assert not failures, "\n".join(failures)
    kernels = set(aot.discover_kernels()) - set(aot.EXCLUDED)
    assert {(r.kernel, r.target) for r in results} == {(k, t) for k in kernels for t in aot.TARGETS}
    for r in results:  # all the way to the binary
        assert r.stages[-1] == ("cubin" if aot.TARGETS[r.target][0] == "cuda" else "hsaco"), r.describe()
    # fp8 types reach the TTIR exactly in the NATIVE_FP8 != 0 jobs (the matrix fails any other
    # job with them): the writers and scorers on targets with the native conversion, nothing on sm_80
    for r in results:
        assert r.native_fp8 == ("NATIVE_FP8=0" not in r.label and "NATIVE_FP8=" in r.label), r.describe()
    native = {t: {r.kernel for r in results if r.target == t and r.native_fp8} for t in aot.TARGETS}
    assert native == {t: set() if t == "sm_80" else set(FP8_KERNELS) for t in aot.TARGETS}, native
    fp8_kernels = {r.kernel for r in results if "FNUZ=" in r.label}
    assert set(FP8_KERNELS) <= fp8_kernels
    for k in fp8_kernels:
        for target in aot.TARGETS:
            labels = [r.label for r in results if r.kernel == k and r.target == target]
            assert any("FNUZ=0" in lb for lb in labels) and any("FNUZ=1" in lb for lb in labels), (k, target)
