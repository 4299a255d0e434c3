"""The optional Triton import shared by flashplan's kernel modules, and its mode.

Triton decides at ``@triton.jit`` decoration time whether a kernel is compiled or
interpreted (``TRITON_INTERPRET=1``), so every kernel module is defined in one mode;
:func:`triton_mode` reports it from a probe kernel decorated here, before the others.
"""

from __future__ import annotations

from typing import Literal

__all__ = ["HAS_TRITON", "tl", "triton", "triton_mode"]

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
