"""Where the project's Triton kernels run: CUDA with Triton installed, or any device under
TRITON_INTERPRET=1 (Triton's interpreter, which the tests use on a CPU). Triton is optional:
without it every kernel module falls back to its torch ops."""

from __future__ import annotations

import os

import torch

try:  # Triton is optional
    import triton
except ImportError:  # pragma: no cover - depends on the installation
    triton = None


def triton_usable(device: torch.device) -> bool:
    """Whether a Triton kernel runs on tensors of `device`."""
    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def compiling() -> bool:
    """Whether torch.compile is tracing this code now (torch.compiler.is_compiling, which
    older torch builds lack: then never)."""
    is_compiling = getattr(torch.compiler, "is_compiling", None)
    return bool(is_compiling is not None and is_compiling())
