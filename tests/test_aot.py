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

from kpool.aot import KernelSpec, axis


@triton.jit
def _helper(x):
    return x * 2.0


@triton.jit
def _native_fp8_kernel(x_ptr, y_ptr, n, FNUZ: tl.constexpr, BLOCK: tl.constexpr):
    # fp32 -> fp8 with Triton's native conversion: what sm_80 cannot compile for e4m3fn
    i = tl.arange(0, BLOCK)
    x = _helper(tl.load(x_ptr + i, mask=i < n, other=0.0))
    if FNUZ:
        y = x.to(tl.float8e4b8)
    else:
        y = x.to(tl.float8e4nv)
    tl.store(y_ptr + i, y.to(tl.uint8, bitcast=True), mask=i < n)
"""

SPECS = """
AOT_SPECS = {"_native_fp8_kernel": KernelSpec(ptrs=dict(x_ptr="fp32", y_ptr="u8"), cross=(axis("FNUZ", (False,)),),
                                              fixed=dict(BLOCK=128))}
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
    assert "pool_vector" not in kernels and "_slot_source" not in kernels  # helpers are not kernels
    assert "_downcast_selftest_kernel" in kernels  # found outside kpool.ops too (kpool._interpreter)
    registry = aot.check_registry()  # every kernel of the package has a spec, or is excluded with a reason
    assert set(registry) == set(kernels) - set(aot.EXCLUDED)


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
    by_target = {r.target: r for r in results if r.label.startswith("FNUZ=0 hints=aligned")}
    assert not by_target["sm_80"].ok and by_target["sm_90"].ok, [r.describe() for r in results]
    text = by_target["sm_80"].describe()
    assert text.startswith("_native_fp8_kernel for sm_80 [") and "FAILED" in text, text
    assert by_target["sm_90"].native_fp8 and by_target["sm_90"].stages[-1] == "cubin"
    assert "FAILED _native_fp8_kernel for sm_80" in aot.format_results(results)


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
    # fp8 is software (integer ops) in every kernel: no fp8 type reaches the IR, so every
    # target takes both formats; sm_80 (no native e4m3fn conversion) compiles the e4m3fn cases
    assert not [r.describe() for r in results if r.native_fp8]
    fp8_kernels = {r.kernel for r in results if "FNUZ=" in r.label}
    assert {"_compress_kernel", "_decode_update_kernel", "_fwht_quant_kernel"} <= fp8_kernels
    for k in fp8_kernels:
        for target in aot.TARGETS:
            labels = [r.label for r in results if r.kernel == k and r.target == target]
            assert any("FNUZ=0" in lb for lb in labels) and any("FNUZ=1" in lb for lb in labels), (k, target)
