"""Exact float downcasts for Triton's CPU interpreter (``TRITON_INTERPRET=1``).

The interpreter converts between float formats with a private numpy routine,
``triton.runtime.interpreter._convert_float``, that is wrong for downcasts: fp32 -> bf16
truncates (``cast_impl`` passes no rounding mode), fp32 -> fp8 loses the carry of a
round-up that crosses a power of two (127.3 -> 64), does not saturate, and fp8 -> fp32
turns NaN codes into numbers. Native GPU conversions round to nearest even (and
saturate to the largest finite value for fp8, ``satfinite``).

``ensure_exact_downcasts()`` replaces that routine with one built on torch's conversions
for fp64/fp32/fp16/bf16 <-> bf16/fp16/fp8 (e4m3fn = Triton ``fp8e4nv``, e4m3fnuz =
``fp8e4b8``, e5m2 = ``fp8e5``, e5m2fnuz = ``fp8e5b16``): round to nearest even; fp8
targets saturate to ``±max`` first (NaN stays NaN). Round-toward-zero requests and
formats torch lacks (``fp8e4b15``) go to the original routine. A self-test runs right
after patching (the converter on its own, then a tiny kernel through the interpreter's
real cast paths) and raises ``RuntimeError`` if the fix did not take.

bf16 rounding in kpool's kernels is integer ops (``ops/_jit.py``); the fp8 encoding uses the
native conversion where the target has one (``_backend.native_fp8``; the interpreter counts
as having both), so the interpreter lane exercises that path through this exact converter.

It also gives the interpreter's reductions a vectorized path for ``xor_sum`` (the
compare-and-swap step of ``tl.sort`` / ``tl.topk``), which it otherwise evaluates element
by element in Python (about a second per 512-key ``tl.topk``). XOR is associative and
commutative, so ``np.bitwise_xor.reduce`` gives the same bits. And it patches the language
once per launch instead of again at every ``@triton.jit`` helper call inside it
(``_install_single_lang_patch``: 1.5-2.4x faster kernels), and sorts integer tensors for
``tl.sort`` / ``tl.topk`` with ``np.sort`` (``_install_fast_integer_sort``: one sorted order,
the network's).
"""

from __future__ import annotations

import inspect

import numpy as np
import torch
import triton
import triton.language as tl

__all__ = ["ensure_exact_downcasts", "fix_applied", "self_test", "PATCH_POINT"]

PATCH_POINT = "triton.runtime.interpreter._convert_float"
_EXPECTED_PARAMS = ["input", "input_dtype", "output_dtype", "rounding_mode"]
# InterpreterBuilder methods whose float conversions must go through the patched global.
_CALLERS = ("cast_impl", "create_fp_to_fp")

_TORCH_DTYPES = {
    "fp64": torch.float64,
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8e4nv": torch.float8_e4m3fn,
    "fp8e4b8": torch.float8_e4m3fnuz,
    "fp8e5": torch.float8_e5m2,
    "fp8e5b16": torch.float8_e5m2fnuz,
}
_INT_OF_BITS = {8: (np.uint8, torch.uint8), 16: (np.int16, torch.int16), 32: (np.int32, torch.int32),
                64: (np.int64, torch.int64)}
_FP8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz)


def _torch_dtype(tt_dtype):
    return _TORCH_DTYPES.get(getattr(tt_dtype, "name", None))


def _make_converter(original, rtne):
    """A drop-in for ``_convert_float`` that converts through torch (RNE, fp8 saturating)."""

    def convert_float(input, input_dtype, output_dtype, rounding_mode):
        src, dst = _torch_dtype(input_dtype), _torch_dtype(output_dtype)
        if src is None or dst is None or rounding_mode not in (None, rtne):
            return original(input, input_dtype, output_dtype, rounding_mode)
        arr = np.array(input, copy=True, order="C")
        in_np, _ = _INT_OF_BITS[input_dtype.primitive_bitwidth]
        t = torch.from_numpy(arr.view(in_np)).view(src)
        if dst in _FP8:
            m = float(torch.finfo(dst).max)
            t = torch.clamp(t, -m, m)  # satfinite: ±inf and overflow -> ±max, NaN kept
        out_np, out_torch = _INT_OF_BITS[output_dtype.primitive_bitwidth]
        out = t.to(dst).view(out_torch).numpy()
        # the original returns unsigned codes of the output width; callers .view() them
        return out.view(getattr(np, f"uint{output_dtype.primitive_bitwidth}")).reshape(np.shape(input))

    convert_float._kpool_exact = True
    convert_float._kpool_original = original
    return convert_float


def _interp_module():
    try:
        from triton.runtime import interpreter
    except Exception as exc:  # pragma: no cover - depends on the installed triton
        raise RuntimeError(f"kpool: cannot import triton.runtime.interpreter to fix its float downcasts: {exc!r}")
    return interpreter


def _check_patch_point(interpreter) -> None:
    """Raise ``RuntimeError`` saying exactly what changed if the patch point is gone."""
    where = getattr(interpreter, "__file__", "triton.runtime.interpreter")
    fn = getattr(interpreter, "_convert_float", None)
    if fn is None or not callable(fn):
        raise RuntimeError(
            f"kpool: Triton's interpreter changed: {PATCH_POINT} no longer exists (in {where}); kpool cannot "
            "correct the interpreter's fp32->bf16/fp8 downcasts. Update kpool/_interpreter.py for this triton "
            f"({getattr(__import__('triton'), '__version__', '?')}).")
    original = getattr(fn, "_kpool_original", fn)
    params = list(inspect.signature(original).parameters)
    if params != _EXPECTED_PARAMS:
        raise RuntimeError(
            f"kpool: Triton's interpreter changed: {PATCH_POINT} now takes {params}, expected {_EXPECTED_PARAMS} "
            f"(in {where}). Update kpool/_interpreter.py.")
    builder = getattr(interpreter, "InterpreterBuilder", None)
    if builder is None:
        raise RuntimeError(f"kpool: Triton's interpreter changed: InterpreterBuilder is gone from {where}.")
    for name in _CALLERS:
        meth = getattr(builder, name, None)
        code = getattr(meth, "__code__", None)
        if code is None or "_convert_float" not in code.co_names:
            raise RuntimeError(
                f"kpool: Triton's interpreter changed: InterpreterBuilder.{name} no longer calls _convert_float "
                f"(in {where}), so patching {PATCH_POINT} would not fix its float conversions. "
                "Update kpool/_interpreter.py.")
    rm = getattr(getattr(interpreter, "_ir", None), "ROUNDING_MODE", None)
    if rm is None or not hasattr(rm, "RTNE"):
        raise RuntimeError(f"kpool: Triton's interpreter changed: _ir.ROUNDING_MODE.RTNE is missing (in {where}).")


def fix_applied() -> bool:
    """True when the interpreter's float converter is kpool's exact one."""
    try:
        from triton.runtime import interpreter
    except Exception:
        return False
    return bool(getattr(getattr(interpreter, "_convert_float", None), "_kpool_exact", False))


# --- self-test -----------------------------------------------------------------------------

def _probe_values() -> torch.Tensor:
    """fp32 values where a truncating / carry-losing / non-saturating converter goes wrong."""
    bits = torch.tensor([0x3F80C000,  # 1 + 2^-8 + 2^-9: bf16 rounds up
                         0x3F808000,  # bf16 tie -> even (down)
                         0x3F818000,  # bf16 tie -> even (up)
                         0x3FFFFFFF,  # bf16 round-up carries into the exponent -> 2.0
                         0x7F7FFFFF,  # fp32 max: bf16 overflows to inf, fp8 saturates
                         ], dtype=torch.int64).to(torch.int32).view(torch.float32)
    vals = torch.tensor([127.3, -127.3, 250.0, 464.0, 1000.0, -1000.0, 7e4, float("inf"), float("-inf"),
                         0.0, -0.0, 0.0146, -0.0146, 2.0 ** -10, 3.0 * 2.0 ** -10, 1.0 / 3.0, 15.5, 0.99],
                        dtype=torch.float32)
    return torch.cat((bits, vals, torch.tensor([float("nan")])))


def _expected(x: torch.Tensor, dst: torch.dtype) -> torch.Tensor:
    """Codes of ``x`` (fp32) in ``dst``, from torch alone: RNE, fp8 saturating."""
    if dst in _FP8:
        m = float(torch.finfo(dst).max)
        x = torch.clamp(x, -m, m)
    return x.to(dst)


def _same_codes(got: torch.Tensor, want: torch.Tensor) -> bool:
    # NaN payloads may differ between conversions; every NaN is accepted for a NaN.
    both_nan = torch.isnan(got.float()) & torch.isnan(want.float())
    ib = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[got.element_size()]
    return bool(((got.view(ib) == want.view(ib)) | both_nan).all())


def _check_converter(convert, interpreter) -> None:
    tl = interpreter.tl
    rtne = interpreter._ir.ROUNDING_MODE.RTNE
    x = _probe_values()
    xn = x.numpy()
    targets = [("bf16", tl.bfloat16, None), ("bf16", tl.bfloat16, rtne), ("fp16", tl.float16, rtne),
               ("fp8e4nv", tl.float8e4nv, rtne), ("fp8e4b8", tl.float8e4b8, rtne), ("fp8e5", tl.float8e5, rtne)]
    for name, tt, mode in targets:
        dst = _TORCH_DTYPES[name]
        got_np = np.asarray(convert(xn, tl.float32, tt, mode))
        got = torch.from_numpy(got_np.view(_INT_OF_BITS[tt.primitive_bitwidth][0]).copy()).view(dst)
        want = _expected(x, dst)
        if not _same_codes(got, want):
            bad = [(float(a), float(g), float(w)) for a, g, w in zip(x, got.float(), want.float())
                   if not (g == w or (g != g and w != w))][:4]
            raise RuntimeError(f"kpool: the interpreter's fp32->{name} conversion is not exact after patching "
                               f"{PATCH_POINT} (x, got, want): {bad}")
        # and back up: fp8/bf16 codes -> fp32 must be exact (NaN codes stay NaN)
        back = np.asarray(convert(got_np, tt, tl.float32, None)).view(np.float32)
        if not _same_codes(torch.from_numpy(back.copy()), want.float()):
            raise RuntimeError(f"kpool: the interpreter's {name}->fp32 conversion is not exact after patching "
                               f"{PATCH_POINT}")


@triton.jit
def _downcast_selftest_kernel(x_ptr, bf16_ptr, e4nv_ptr, e4b8_ptr, e5_ptr, N: tl.constexpr, OCP_FP8: tl.constexpr,
                              FNUZ_FP8: tl.constexpr):
    # Stores x [N] fp32 through the native cast paths as bf16 / fp8 codes.
    i = tl.arange(0, N)
    x = tl.load(x_ptr + i)
    tl.store(bf16_ptr + i, x.to(tl.bfloat16))
    if OCP_FP8:
        tl.store(e4nv_ptr + i, x.to(tl.float8e4nv).to(tl.uint8, bitcast=True))
        tl.store(e5_ptr + i, x.to(tl.float8e5).to(tl.uint8, bitcast=True))
    if FNUZ_FP8:
        tl.store(e4b8_ptr + i, x.to(tl.float8e4b8).to(tl.uint8, bitcast=True))


def _native_fp8(device: torch.device) -> tuple[bool, bool]:
    """(OCP e4m3fn/e5m2, e4m3fnuz) casts available in kernels on ``device`` (``_backend``'s table)."""
    from ._backend import device_target, has_native_fp8

    target = device_target(device)
    return has_native_fp8(*target, torch.float8_e4m3fn), has_native_fp8(*target, torch.float8_e4m3fnuz)


def self_test(device: str | torch.device = "cpu") -> None:
    """Check that kernels' fp32 -> bf16 / fp8 casts give torch's codes; ``RuntimeError`` if not.

    On ``cpu`` this runs under the interpreter (needs ``TRITON_INTERPRET=1``) and also
    checks the converter function directly; on a GPU it checks the native conversions the
    target has (OCP fp8 on sm_89+ / gfx950, e4m3fnuz on gfx942; fp8 of ±inf not compared).
    """
    device = torch.device(device)
    if device.type == "cpu":
        interpreter = _interp_module()
        _check_converter(interpreter._convert_float, interpreter)
    x = _probe_values()
    n = 1 << (x.numel() - 1).bit_length()
    x = torch.cat((x, torch.full((n - x.numel(),), 127.3))).to(device)
    outs = {"bf16": torch.empty(n, dtype=torch.bfloat16, device=device)}
    for name in ("fp8e4nv", "fp8e4b8", "fp8e5"):
        outs[name] = torch.zeros(n, dtype=torch.uint8, device=device)
    ocp, fnuz = _native_fp8(device)
    _downcast_selftest_kernel[(1,)](x, outs["bf16"], outs["fp8e4nv"], outs["fp8e4b8"], outs["fp8e5"], N=n,
                                    OCP_FP8=ocp, FNUZ_FP8=fnuz)
    names = ["bf16"] + (["fp8e4nv", "fp8e5"] if ocp else []) + (["fp8e4b8"] if fnuz else [])
    xs = x.cpu()
    for name in names:
        dst = _TORCH_DTYPES[name]
        got = outs[name].cpu()
        got = got if name == "bf16" else got.view(dst)
        want, xv = _expected(xs, dst), xs
        if device.type != "cpu" and name != "bf16":  # native fp8 casts of ±inf are target-specific
            keep = torch.isfinite(xs)
            got, want, xv = got[keep], want[keep], xs[keep]
        if not _same_codes(got, want):
            bad = (got.float() != want.float()) & ~(torch.isnan(got.float()) & torch.isnan(want.float()))
            i = int(bad.nonzero()[0])
            raise RuntimeError(
                f"kpool: a kernel's fp32->{name} cast on {device.type} gives {float(got[i].float())} for "
                f"{float(xv[i])}, torch gives {float(want[i].float())}"
                + (f"; the {PATCH_POINT} fix did not take" if device.type == "cpu" else ""))


def _install_fast_xor_reduce(interpreter) -> None:
    """Route ``tl.reduce(x, axis, _xor_combine)`` to ``np.bitwise_xor.reduce`` (same bits)."""
    ops = getattr(interpreter, "ReduceOps", None)
    combine = getattr(tl.standard, "_xor_combine", None)
    if ops is None or combine is None or getattr(ops.apply_impl, "_kpool_fast_xor", False):
        return
    original = ops.apply_impl

    def apply_impl(self, input):
        if self.combine_fn is not combine:
            return original(self, input)
        x = input[0]
        data = x.handle.data
        if self.axis is None:
            out = np.bitwise_xor.reduce(data.reshape(-1))
            out = np.reshape(out, (1,) * data.ndim) if self.keep_dims else out.item()
        else:
            out = np.bitwise_xor.reduce(data, axis=self.axis, keepdims=self.keep_dims)
        return self.to_tensor(out, x.dtype)

    apply_impl._kpool_fast_xor = True
    ops.apply_impl = apply_impl


_LANG_MODULES = {}  # id(module globals) -> _lang_modules


def _lang_modules(fn) -> frozenset:
    """ids of ``triton.language`` / ``triton.language.core`` among ``fn``'s module globals (the
    modules the interpreter's ``_patch_lang`` patches for it), cached per globals dict."""
    key = id(fn.__globals__)
    if key not in _LANG_MODULES:
        _LANG_MODULES[key] = frozenset(id(v) for v in fn.__globals__.values()
                                       if inspect.ismodule(v) and v in (tl, tl.core))
    return _LANG_MODULES[key]


def _install_single_lang_patch(interpreter) -> None:
    """Patch the language once per launch. The interpreter's ``_patch_lang`` (an
    ``inspect.getmembers`` scan of ``triton.language``, about a third of an interpreted
    kernel's time) runs for the grid and again at every ``@triton.jit`` helper call inside
    it, where the grid's patch is already in place (the helper's own scope is never
    restored: the grid's restores the originals). Inside a launch, a helper whose language
    modules the grid patched skips it; anything else patches as before. Skipped if the
    interpreter lacks these internals."""
    grid_cls = getattr(interpreter, "GridExecutor", None)
    real = getattr(interpreter, "_patch_lang", None)
    scope_cls = getattr(interpreter, "_LangPatchScope", None)
    if grid_cls is None or real is None or scope_cls is None or getattr(real, "_kpool_once", False):
        return
    patched = None  # the launch's language modules while a grid runs

    def patch_lang(fn):
        if patched is not None and _lang_modules(fn) <= patched:
            return scope_cls()  # nothing to restore
        return real(fn)

    launch = grid_cls.__call__

    def grid_call(self, *args, **kwargs):
        nonlocal patched
        if patched is not None:
            return launch(self, *args, **kwargs)
        scope = real(self.fn)
        patched = _lang_modules(self.fn)
        try:
            return launch(self, *args, **kwargs)  # its own _patch_lang: an empty scope
        finally:
            patched = None
            scope.restore()

    patch_lang._kpool_once = True
    interpreter._patch_lang = patch_lang
    grid_cls.__call__ = grid_call


def _install_fast_integer_sort(interpreter) -> None:
    """Route ``tl.sort`` / ``tl.topk`` of integer tensors along their last axis (what kpool's
    selection kernels sort: int64 keys) to ``np.sort``: integers have one sorted order, so the
    result is the bitonic network's, which the interpreter evaluates op by op (~0.1 s per
    512-key ``tl.topk``). Anything else goes to Triton's ``sort_impl``."""
    std = tl.standard
    original = getattr(std, "sort_impl", None)
    handle_cls = getattr(interpreter, "TensorHandle", None)
    unwrap = getattr(tl.core, "_unwrap_if_constexpr", None)
    if None in (original, handle_cls, unwrap) or getattr(original, "_kpool_fast", False):
        return

    def sort_impl(x, k=None, dim=None, descending=False):
        k, dim, descending = unwrap(k), unwrap(dim), unwrap(descending)
        if not x.dtype.is_int() or (dim is not None and dim != len(x.shape) - 1):
            return original(x, k=k, dim=dim, descending=descending)
        data = np.sort(x.handle.data, axis=-1)
        if descending:
            data = np.flip(data, axis=-1)
        data = np.ascontiguousarray(data if k is None else data[..., :k])
        return tl.core.tensor(handle_cls(data, x.dtype.scalar), tl.block_type(x.dtype, list(data.shape)))

    sort_impl._kpool_fast, sort_impl._kpool_original = True, original
    std.sort_impl = sort_impl


def ensure_exact_downcasts() -> bool:
    """Install the exact converter in Triton's interpreter and self-test it.

    No-op (returns False) unless ``TRITON_INTERPRET`` is set. Idempotent. Raises
    ``RuntimeError`` if the interpreter's internals changed or the fix did not take.
    """
    from ._backend import interpreting

    if not interpreting():
        return False
    interpreter = _interp_module()
    _check_patch_point(interpreter)
    _install_fast_xor_reduce(interpreter)
    _install_single_lang_patch(interpreter)
    _install_fast_integer_sort(interpreter)
    if not fix_applied():
        rtne = interpreter._ir.ROUNDING_MODE.RTNE
        interpreter._convert_float = _make_converter(interpreter._convert_float, rtne)
        try:
            self_test("cpu")
        except Exception:
            interpreter._convert_float = interpreter._convert_float._kpool_original
            raise
    return True
