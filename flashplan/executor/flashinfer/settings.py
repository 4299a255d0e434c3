"""What a FlashInfer executor is constructed with: one frozen record of settings.

Every part of the executor (the buffers strategy, the wrapper planning, the device
work, the run) reads its settings from one :class:`ExecutorSettings`; a graph
executor made from an eager one shares the same record, workspace included.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from flashplan.errors import DeviceUnavailableError, OptionTypeError, UnsupportedError, as_option
from flashplan.executor.checks import check_page_map
from flashplan.executor.flashinfer.adapter import (
    check_version,
    fast_decode_available,
    fast_prefill_available,
)
from flashplan.executor.flashinfer.policy import ExecutorPolicy
from flashplan.layout.convert import as_bool, as_int

__all__ = ["DEFAULT_WORKSPACE_BYTES", "ExecutorSettings", "import_flashinfer"]

#: Default size of the float workspace all wrappers share (bytes): FlashInfer's
#: recommended 128 MiB doubled, for split-KV partial results of large batches.
DEFAULT_WORKSPACE_BYTES = 256 * 1024 * 1024


def import_flashinfer() -> Any:
    """``import flashinfer`` with its import-time deprecation warnings silenced."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import flashinfer
    return flashinfer


def cuda_device(device: torch.device | str | None) -> torch.device:
    """``device`` as a ``cuda:N`` device (default: the current one).

    Whether CUDA is here is asked first: on a machine without it torch's own calls
    (``torch.cuda.current_device()``) raise a bare ``AssertionError``, not the
    documented error.

    Raises:
        UnsupportedError: not a torch device, or not CUDA.
        DeviceUnavailableError: (an ``UnsupportedError`` and a ``RuntimeError``) no
            CUDA here, or a device index this machine does not have.
    """
    dev = _as_device(device)
    if dev is not None and dev.type != "cuda":
        raise UnsupportedError("device", "FlashInferExecutor needs a CUDA device", device=str(dev))
    if not torch.cuda.is_available():
        raise DeviceUnavailableError(
            "device", "FlashInferExecutor needs CUDA, which is not available here"
        )
    if dev is None or dev.index is None:  # "cuda" means the current device: tensors say cuda:N
        return torch.device("cuda", torch.cuda.current_device())
    count = torch.cuda.device_count()
    if not 0 <= dev.index < count:
        raise DeviceUnavailableError(
            "device", f"no such CUDA device: this machine has {count}", device=str(dev)
        )
    return dev


def _as_device(device: object) -> torch.device | None:
    """``device`` as a torch device, ``None`` for ``None`` (the current CUDA device).

    Raises:
        UnsupportedError: not something ``torch.device`` takes.
    """
    if device is None:
        return None
    if isinstance(device, bool):
        raise UnsupportedError("device", "not a torch device", value=device)
    try:
        if isinstance(device, int):  # an index: of a CUDA device, as torch reads it there
            return torch.device("cuda", device)
        return torch.device(device)  # type: ignore[call-overload]  # any value: checked here
    except (RuntimeError, TypeError, ValueError) as exc:
        raise UnsupportedError("device", f"not a torch device ({exc})", value=device) from None


@attrs.frozen(eq=False)
class ExecutorSettings:
    """A FlashInfer executor's construction arguments, checked, and what follows from them.

    Attributes:
        device: the CUDA device of the KV cache.
        flashinfer: the imported ``flashinfer`` module (its version checked).
        policy: kernel choices.
        workspace_bytes: size of ``workspace`` (bytes).
        workspace: uint8 ``[workspace_bytes]`` device tensor, zeroed at construction:
            the float workspace every wrapper shares.
        page_map: int32 ``[num_full_pages]`` device tensor mapping full-pool page ids
            to a sliding-window pool's ids (negative: evicted), or ``None``.
        check_pages: the checked mode (reads back from the device on every call).
        fast_plan: the constructor's ``fast_plan``.
        fast_decode: decode wrappers are re-planned through the compiled scheduler
            (``fast_plan`` and a flashinfer version the adapter checked).
        fast_prefill: eager FA2 paged prefill wrappers likewise.
        sm90: the device is compute capability 9.0 (decides kernel choices).
        num_sm: the device's streaming multiprocessors (FlashInfer's scheduler sizes
            its grid by them: ``adapter.schedule_stands``).
    """

    device: torch.device
    flashinfer: Any
    policy: ExecutorPolicy
    workspace_bytes: int
    workspace: torch.Tensor
    page_map: torch.Tensor | None
    check_pages: bool
    fast_plan: bool
    fast_decode: bool
    fast_prefill: bool
    sm90: bool
    num_sm: int

    @classmethod
    def make(
        cls,
        device: torch.device | str | None,
        policy: ExecutorPolicy | None,
        workspace_bytes: int,
        page_map: torch.Tensor | None,
        check_pages: bool,
        fast_plan: bool,
    ) -> ExecutorSettings:
        """Check the constructor's arguments (see :class:`FlashInferExecutor`) and
        allocate the workspace.

        Raises:
            UnsupportedError: no CUDA, or ``device`` is not a CUDA device.
            OptionError: an argument of the wrong range;
                :class:`~flashplan.OptionTypeError` of the wrong type.
        """
        dev = cuda_device(device)
        fi = import_flashinfer()
        check_version(str(fi.__version__))
        if policy is not None and not isinstance(policy, ExecutorPolicy):
            raise OptionTypeError("policy", "must be an ExecutorPolicy", value=policy)
        size = as_option(as_int, "workspace_bytes", workspace_bytes, minimum=1 << 20)
        checked = as_option(as_bool, "check_pages", check_pages)
        fast = as_option(as_bool, "fast_plan", fast_plan)
        page_map = check_page_map(page_map, dev)
        return cls(
            device=dev,
            flashinfer=fi,
            policy=policy or ExecutorPolicy(),
            workspace_bytes=size,
            # zeroed: FlashInfer asks for a zero-initialised float workspace on first use
            workspace=torch.zeros(size, dtype=torch.uint8, device=dev),
            page_map=page_map,
            check_pages=checked,
            fast_plan=fast,
            fast_decode=fast and fast_decode_available(fi),
            fast_prefill=fast and fast_prefill_available(fi),
            sm90=torch.cuda.get_device_capability(dev) == (9, 0),
            num_sm=torch.cuda.get_device_properties(dev).multi_processor_count,
        )
