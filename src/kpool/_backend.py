"""Backend choice: Triton kernels (CUDA, ROCm, or the CPU interpreter) or the torch reference.

``KPOOL_BACKEND=auto|triton|torch``. ``auto`` takes Triton for GPU tensors and torch for
CPU tensors; ``triton`` on CPU tensors needs ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import os

import torch

BACKENDS = ("auto", "triton", "torch")


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
