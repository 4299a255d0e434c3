"""What every flashplan kernel module shares: the optional Triton import, its mode,
where a launch goes, and the device guard around it.

Triton decides at ``@triton.jit`` decoration time whether a kernel is compiled or
interpreted (``TRITON_INTERPRET=1``), so every kernel module is defined in one mode;
:func:`triton_mode` reports it from a probe kernel decorated here, before the others.
"""

from __future__ import annotations

from collections.abc import Hashable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Literal

import torch

from flashplan.arrays import INT32_MAX

__all__ = [
    "DIRECT_LAUNCH_VERSIONS",
    "HAS_TRITON",
    "DirectLaunch",
    "device_guard",
    "runs_on_triton",
    "tl",
    "triton",
    "triton_mode",
]

#: Triton versions whose compiled-kernel launcher :class:`DirectLaunch` calls (its
#: arguments are those ``JITFunction.run`` passes in these versions; the GPU test
#: ``test_direct_launches_equal_the_jit_launches`` checks each).
DIRECT_LAUNCH_VERSIONS = ("3.6.0", "3.9.0")

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


class DirectLaunch:
    """Launches of one ``@triton.jit`` kernel that skip Triton's Python binder after the
    first launch of each variant.

    Triton's ``kernel[grid](*args)`` binds and specializes every argument on every call
    before its compiled launcher runs: tens of microseconds of host time, more than a
    small kernel runs. For a kernel whose every int parameter is in ``do_not_specialize``
    and every pointer parameter in ``do_not_specialize_on_alignment``, the compiled
    variant depends only on the constexprs, the tensors' dtypes and the device, all of
    which the caller names in ``key``; so the first launch of a key goes through
    ``kernel[grid]`` (compiling if needed) and keeps the compiled kernel it returns, and
    later launches call that kernel's launcher with the same arguments
    ``JITFunction.run`` passes it (Triton versions :data:`DIRECT_LAUNCH_VERSIONS` only).

    Every launch goes through ``kernel[grid]`` instead under another Triton version or
    the interpreter, and so does one with an int argument beyond int32 (another
    variant). Launch hooks (profilers) are called as ``kernel[grid]`` calls them. One
    instance per owner (an executor): no global state.

    Attributes:
        kernel: the jit kernel.
        variants: compiled kernels by key.
        direct: launches made through the compiled launcher so far.
        enabled: whether launches may go direct (this Triton, compiled mode).
    """

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.variants: dict[Hashable, Any] = {}
        self.direct = 0
        self.enabled = (
            HAS_TRITON
            and triton_mode() == "compiled"
            and str(triton.__version__).split("+")[0] in DIRECT_LAUNCH_VERSIONS
        )

    def __call__(
        self,
        grid: int,
        key: Hashable,
        args: tuple[Any, ...],
        ints: tuple[int, ...],
        pointers: tuple[Any, ...] | None = None,
    ) -> None:
        """Launch ``grid`` programs with ``args`` (every parameter, constexprs included,
        in order); ``ints`` are the int arguments (checked to fit int32).

        ``pointers``: ``args`` with every tensor replaced by its ``data_ptr()``, for a
        caller that holds those tensors (so the memory stays theirs). The compiled
        launcher then takes the addresses as they are instead of calling each tensor's
        ``data_ptr`` and asking the driver about it (a driver call per tensor); the
        first launch of a variant and launches with a hook set still get ``args``."""
        if not self.enabled:
            self.kernel[(grid,)](*args)
            return
        fits = not ints or (max(ints) <= INT32_MAX and min(ints) >= -INT32_MAX)
        driver = triton.runtime.driver.active
        device = driver.get_current_device()
        variant = self.variants.get((device, key)) if fits else None
        if variant is None:
            compiled = self.kernel[(grid,)](*args)
            if fits:
                self.variants[(device, key)] = compiled
            return
        stream = driver.get_current_stream(device)
        # what JITFunction.run does after finding the variant (launch hooks included)
        hooks = triton.knobs.runtime
        enter = hooks.launch_enter_hook
        # launch_metadata returns None without an enter hook (these versions): skip
        # binding every argument to it then
        metadata = None
        if enter is not None:
            metadata = variant.launch_metadata((grid,), stream, *args)
        elif pointers is not None:
            args = pointers
        variant.run(
            grid, 1, 1, stream, variant.function, variant.packed_metadata, metadata,
            enter, hooks.launch_exit_hook, *args,
        )  # fmt: skip
        self.direct += 1
