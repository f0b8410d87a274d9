"""Backend choice: Triton kernels (CUDA, ROCm, or the CPU interpreter) or the torch reference.

``KPOOL_BACKEND=auto|triton|torch``. ``auto`` takes Triton for GPU tensors and torch for
CPU tensors; ``triton`` on CPU tensors needs ``TRITON_INTERPRET=1``.

``KPOOL_FP8_ENCODER=software|native``: how the Triton writers turn fp32 into fp8 codes.
``software`` (default) uses integer ops (``_jit.fp8_encode``), available on every target;
``native`` uses Triton's conversion where the target has one for the format (sm_89+ and
gfx950 for e4m3fn, gfx942 for e4m3fnuz, the interpreter with kpool's exact downcasts) and
falls back to software elsewhere. Both give the same bytes; benchmarks/NOTES.md has the
H200 measurement behind the default.
"""

from __future__ import annotations

import os

import torch

BACKENDS = ("auto", "triton", "torch")
FP8_ENCODERS = ("software", "native")
FP8_ENCODER_ENV = "KPOOL_FP8_ENCODER"


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


def native_fp8(device: torch.device, fp8_dtype: torch.dtype) -> bool:
    """Whether Triton writers on ``device`` encode ``fp8_dtype`` with the native conversion."""
    choice = os.environ.get(FP8_ENCODER_ENV, "software").strip().lower() or "software"
    if choice not in FP8_ENCODERS:
        raise ValueError(f"{FP8_ENCODER_ENV} must be one of {FP8_ENCODERS}, got {choice!r}")
    if choice == "software":
        return False
    fnuz = fp8_dtype == torch.float8_e4m3fnuz
    if device.type == "cpu":
        return interpreting()
    if torch.version.hip is not None:
        arch = torch.cuda.get_device_properties(device).gcnArchName.split(":")[0]
        return arch == ("gfx942" if fnuz else "gfx950")
    return not fnuz and torch.cuda.get_device_capability(device) >= (8, 9)
