"""Backend choice: Triton kernels (CUDA, ROCm, or the CPU interpreter) or the torch reference.

``KPOOL_BACKEND=auto|triton|torch``. ``auto`` takes Triton for GPU tensors and torch for
CPU tensors; ``triton`` on CPU tensors needs ``TRITON_INTERPRET=1``.

``KPOOL_FP8_ENCODER=auto|software|native``: how the Triton writers (compress, decode,
query quant) turn fp32 into fp8 codes. ``native`` is Triton's conversion
(``.to(tl.float8e4nv)`` / ``.to(tl.float8e4b8)``, ``_jit.fp8_encode_native``), used only
where the target has it for the format (``has_native_fp8``: CUDA sm_89+ for e4m3fn, ROCm
gfx942 for e4m3fnuz and gfx950 for e4m3fn, the CPU interpreter with kpool's exact
downcasts); elsewhere (sm_80, e4m3fnuz on CUDA, ...) it falls back to ``software``.
``software`` is integer ops on the fp32 bits (``_jit.fp8_encode``), available on every
target. ``native_fp8`` gives the writers' ``NATIVE_FP8`` as a mode: 0 software,
``FP8_CONVERSION`` (clamp to ``±FP8_MAX``, convert, set the canonical NaN code: ROCm and the
interpreter) or ``FP8_SATFINITE`` (the conversion alone, on CUDA: ``cvt.rn.satfinite``
saturates to ±448 and gives the canonical 0x7F for every NaN, checked on an H200 for both
signs and several payloads; H200 compress P=4 -2% without the NaN select). ``auto``
(default) is the measured choice: native where the target has the conversion, software
elsewhere, i.e. the same as ``native`` today (H200, compress+write: native 8% faster at
P=4 and P=16; benchmarks/LOG.md). All give the same bytes.
The same choice picks the scorers' decoder (fp8 -> fp16 conversion, or the table
``_jit_fp8.halves_table``; same halves). The AOT compile matrix (``kpool.aot``) compiles
each target with the ``auto`` choice, from the same table (``native_fp8_mode``).
"""

from __future__ import annotations

import functools
import inspect
import os

import torch

BACKENDS = ("auto", "triton", "torch")
FP8_CONVERSION = 1  # NATIVE_FP8 modes (module docstring)
FP8_SATFINITE = 2
FP8_ENCODERS = ("auto", "software", "native")
FP8_ENCODER_ENV = "KPOOL_FP8_ENCODER"
PDL_ENV = "KPOOL_PDL"
REGISTER_CAP_ENV = "KPOOL_REGISTER_CAP"


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def backend_for(device: torch.device) -> str:
    """``"triton"`` or ``"torch"`` for tensors on ``device``."""
    choice = os.environ.get("KPOOL_BACKEND", "auto").strip().lower() or "auto"
    if choice not in BACKENDS:
        raise ValueError(f"KPOOL_BACKEND must be one of {BACKENDS}, got {choice!r}")
    if choice == "torch":
        return "torch"
    if device.type == "cpu":
        if choice == "triton":
            if not interpreting():
                raise RuntimeError("KPOOL_BACKEND=triton with CPU tensors needs TRITON_INTERPRET=1 "
                                   "(set before triton is imported)")
            return "triton"
        return "torch"
    return "triton"


def on_device_of(name: str):
    """Decorator of the functions that launch kernels: they run with the current CUDA device set
    to that of their tensor argument ``name``, as torch's own ops do. Triton launches on the
    current device (and its current stream), so without it a tensor on another GPU than the
    current one would be handed to a kernel running on the wrong GPU. Nothing is switched for
    CPU tensors, when that device is already current, or when ``name`` is not a tensor (the
    function's own checks then raise)."""
    def wrap(fn):
        pos = list(inspect.signature(fn).parameters).index(name)

        @functools.wraps(fn)
        def run(*args, **kwargs):
            device = getattr(args[pos] if pos < len(args) else kwargs.get(name), "device", None)
            if device is None or device.type != "cuda" or device.index == torch.cuda.current_device():
                return fn(*args, **kwargs)
            with torch.cuda.device(device.index):
                return fn(*args, **kwargs)
        return run
    return wrap


def row_select() -> bool:
    """``ROW_SELECT`` of the ring-fed writers (``_jit.load_slot``): everywhere but ROCm builds."""
    return torch.version.hip is None


def fp8_encoder() -> str:
    """``KPOOL_FP8_ENCODER`` (one of ``FP8_ENCODERS``; unset or empty: ``"auto"``)."""
    choice = os.environ.get(FP8_ENCODER_ENV, "auto").strip().lower() or "auto"
    if choice not in FP8_ENCODERS:
        raise ValueError(f"{FP8_ENCODER_ENV} must be one of {FP8_ENCODERS}, got {choice!r}")
    return choice


def has_native_fp8(backend: str, arch, fp8_dtype: torch.dtype) -> bool:
    """Whether Triton has a native fp32 -> ``fp8_dtype`` conversion on a target.

    The one table behind ``native_fp8`` (run time) and the AOT matrix (``kpool.aot``).
    ``backend``: ``"cuda"`` (``arch``: compute capability as an int, 89 for sm_89),
    ``"hip"`` (``arch``: gfx name, ``"gfx942"``; ``":feature"`` suffixes ignored) or
    ``"interpreter"`` (``arch`` ignored: both formats, exact through ``kpool._interpreter``).
    e4m3fn: sm_89+, gfx950. e4m3fnuz: gfx942 (CUDA has no fnuz conversion).
    """
    if fp8_dtype == torch.float8_e4m3fnuz:
        fnuz = True
    elif fp8_dtype == torch.float8_e4m3fn:
        fnuz = False
    else:
        raise ValueError(f"fp8_dtype must be torch.float8_e4m3fn or torch.float8_e4m3fnuz, got {fp8_dtype}")
    if backend == "interpreter":
        return True
    if backend == "cuda":
        return not fnuz and int(arch) >= 89
    if backend == "hip":
        return str(arch).split(":")[0] == ("gfx942" if fnuz else "gfx950")
    raise ValueError(f"backend must be 'cuda', 'hip' or 'interpreter', got {backend!r}")


def native_fp8_mode(backend: str, arch, fp8_dtype: torch.dtype) -> int:
    """``NATIVE_FP8`` on a target (``has_native_fp8``'s arguments): 0 where it has no
    conversion for the format, ``FP8_SATFINITE`` on CUDA, else ``FP8_CONVERSION``."""
    if not has_native_fp8(backend, arch, fp8_dtype):
        return 0
    return FP8_SATFINITE if backend == "cuda" else FP8_CONVERSION


def native_fp8(device: torch.device, fp8_dtype: torch.dtype) -> int:
    """``NATIVE_FP8`` of Triton writers on ``device`` for ``fp8_dtype`` (module docstring):
    truthy when they encode with the native conversion.

    ``KPOOL_FP8_ENCODER``: ``software`` -> 0; ``auto`` (default) and ``native`` ->
    ``native_fp8_mode`` of the device's target (0 where it has no conversion: the
    software encoder, same bytes). CPU tensors: the interpreter's (``FP8_CONVERSION`` when
    ``TRITON_INTERPRET`` is on, else 0: no Triton kernel runs there).
    """
    device = torch.device(device)
    if fp8_encoder() == "software":
        return 0
    if device.type == "cpu" and not interpreting():
        return 0
    return native_fp8_mode(*device_target(device), fp8_dtype)


def device_target(device) -> tuple:
    """``(backend, arch)`` of ``device`` as ``has_native_fp8`` takes them: ``("interpreter",
    None)`` for the CPU, ``("hip", gfx name)`` on ROCm, ``("cuda", 10 * major + minor)``.
    Looked up once per GPU (the launchers ask on every call)."""
    device = torch.device(device)
    if device.type == "cpu":
        return "interpreter", None
    return _gpu_target(device.index if device.index is not None else torch.cuda.current_device())


def register_cap(device, regs) -> dict:
    """``{"maxnreg": regs}`` for a CUDA ``device`` (a CUDA-only compile option), else ``{}``
    (also when ``regs`` is None: no cap, and when ``KPOOL_REGISTER_CAP`` is ``0``: for
    compute-sanitizer's memcheck, whose instrumented 64-head filtering leaves return wrong
    selections at their caps; ``scripts/sanitize_cases.py``)."""
    if regs is None or os.environ.get(REGISTER_CAP_ENV, "1").strip() == "0" or device_target(device)[0] != "cuda":
        return {}
    return {"maxnreg": regs}


def has_pdl(backend: str, arch) -> bool:
    """Whether a target has programmatic dependent launch (PDL): CUDA sm_90 and later."""
    return backend == "cuda" and arch >= 90


def pdl_launch(device) -> dict:
    """Launch arguments of the kernels that take part in programmatic dependent launch:
    ``PDL=True`` (the kernel's first statement waits for the previous kernel in the stream,
    ``ops._pdl.grid_dependency_sync``) and Triton's ``launch_pdl`` option (the kernel may be
    launched while the previous one runs) where the device has PDL (``has_pdl``) and
    ``KPOOL_PDL`` is not ``0``; else ``{"PDL": False}`` (ROCm, sm_80, the interpreter)."""
    if os.environ.get(PDL_ENV, "1").strip() == "0" or not has_pdl(*device_target(device)):
        return {"PDL": False}
    return {"PDL": True, "launch_pdl": True}


@functools.lru_cache(maxsize=None)
def _gpu_target(index: int) -> tuple:
    if torch.version.hip is not None:
        return "hip", torch.cuda.get_device_properties(index).gcnArchName
    major, minor = torch.cuda.get_device_capability(index)
    return "cuda", major * 10 + minor
