"""What every flashplan kernel module shares: the optional Triton import, its mode,
where a launch goes, and the device guard around it.

Triton decides at ``@triton.jit`` decoration time whether a kernel is compiled or
interpreted (``TRITON_INTERPRET=1``), so every kernel module is defined in one mode;
:func:`triton_mode` reports it from a probe kernel decorated here, before the others.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Literal

import torch

__all__ = [
    "HAS_TRITON",
    "device_guard",
    "runs_on_triton",
    "tl",
    "triton",
    "triton_mode",
]

try:  # Triton is optional: every launcher has a plain-torch twin.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    HAS_TRITON = False
    triton = tl = None
else:
    HAS_TRITON = True

if HAS_TRITON:

    @triton.jit
    def _mode_probe_kernel(x_ptr):
        tl.store(x_ptr, tl.load(x_ptr))


def triton_mode() -> Literal["compiled", "interpret", "unavailable"]:
    """How flashplan's Triton kernels run.

    Returns:
        ``"unavailable"`` when Triton is not installed; ``"interpret"`` when the kernels
        were defined with ``TRITON_INTERPRET=1`` (they then run on CPU tensors through
        Triton's interpreter); ``"compiled"`` otherwise (real GPU kernels; CPU tensors
        then go to the torch twins).
    """
    if not HAS_TRITON:
        return "unavailable"
    if isinstance(_mode_probe_kernel, triton.runtime.JITFunction):
        return "compiled"
    return "interpret"


def runs_on_triton(device: torch.device, torch_twin: str) -> bool:
    """Whether a launch on ``device`` goes to the Triton kernel (else the torch twin).

    CPU tensors run the kernel only under Triton's interpreter; a GPU needs Triton.

    Raises:
        RuntimeError: a non-CPU device without Triton (names the torch twin to use).
    """
    mode = triton_mode()
    if device.type == "cpu":
        return mode == "interpret"
    if mode == "unavailable":
        raise RuntimeError(
            f"Triton is not installed: cannot launch on {device}; use {torch_twin}()"
        )
    return True


def device_guard(device: torch.device) -> AbstractContextManager[object]:
    """A context that makes ``device`` current for a Triton launch (CUDA devices only):
    Triton launches on the current device, which may differ from the tensors'."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return nullcontext()
