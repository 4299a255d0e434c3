"""Re-planning a decode wrapper without FlashInfer's ``plan()`` overhead.

FlashInfer's public ``plan()`` checks its arguments, copies the indptrs and last-page
lengths to the device, resolves the backend and builds (or looks up) the compiled
module on every call. flashplan has already staged those arrays on the device (one
copy for the whole batch) and fixes every compiled-in argument in the plan, so a
decode wrapper that was planned once with the same constant arguments only needs
FlashInfer's host scheduler run again. FlashInfer exports exactly that as
``flashinfer.fast_decode_plan(wrapper, ...)`` — the reference file replays its decode
CUDA graphs through it. flashplan calls it as a function (it never replaces a
wrapper's method), and only when it is sync-free and equivalent:

* **the same compiled module:** the wrapper's last full ``plan()`` had the same
  constant arguments (:attr:`WrapperSlot.planned_with`): dtypes, heads, page size,
  window, soft cap, scale, split options. The first plan of a wrapper, and any plan
  whose constants differ, goes through ``plan()``;
* **a known FlashInfer:** a version whose ``fast_decode_plan`` was checked against
  ``plan()`` (:data:`FAST_DECODE_VERSIONS`; the GPU tests compare the two bit for
  bit, eager and graph, CUDA-core and tensor-core decode). Elsewhere ``plan()`` runs.

What it is given, per mode:

* **graph mode** (the wrapper reads fixed buffers): flashplan refreshes the wrapper's
  fixed indptr and last-page-length buffers from the staged device copy (two
  device-to-device copies) — ``fast_decode_plan`` leaves them to the caller — and hands
  it the pinned host arrays for its scheduler;
* **eager mode:** the wrapper is given the staged device views to read at run time
  and the pinned host indptr (``global_override_indptr_cpu``) for its scheduler. Its
  tensor-core branch reads ``last_page_len`` back to the host, so it gets the pinned
  host array and the wrapper's last-page-length tensor is then pointed at the staged
  device view (the one field ``fast_decode_plan`` would otherwise have set to it).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from flashplan.executor.flashinfer.buffers import WrapperSlot

__all__ = ["FAST_DECODE_VERSIONS", "DecodeArrays", "fast_decode_available", "replan_decode"]

#: flashinfer-python versions whose ``fast_decode_plan`` flashplan checked against
#: ``plan()`` (the GPU test ``test_fast_decode_plan_equals_plan``).
FAST_DECODE_VERSIONS = ("0.7.4",)

#: The ``plan()`` keywords of a decode call that ``fast_decode_plan`` takes too; the
#: others (``o_data_type``) are compiled into the module, which the constants pin.
_PASSED = frozenset(
    {
        "num_qo_heads",
        "num_kv_heads",
        "head_dim",
        "page_size",
        "pos_encoding_mode",
        "window_left",
        "logits_soft_cap",
        "q_data_type",
        "kv_data_type",
        "data_type",
        "sm_scale",
        "rope_scale",
        "rope_theta",
        "non_blocking",
        "fixed_split_size",
        "disable_split_kv",
    }
)
#: The array arguments, passed separately (:class:`DecodeArrays`).
_ARRAYS = frozenset({"indptr", "indices", "last_page_len"})


def fast_decode_available(fi: Any) -> bool:
    """Whether the imported flashinfer module ``fi`` has a checked ``fast_decode_plan``."""
    version = str(getattr(fi, "__version__", "")).split("+")[0]
    return version in FAST_DECODE_VERSIONS and callable(getattr(fi, "fast_decode_plan", None))


class DecodeArrays(NamedTuple):
    """The arrays of one decode ``plan()`` call, on both sides of the staging copy.

    Attributes:
        indptr_host, indptr_device: int32 ``[bs + 1]`` (pages) page indptr: a pinned
            host view of the staging slot and its device copy.
        last_page_len_host, last_page_len_device: int32 ``[bs]`` (tokens), likewise.
        indices: int32 ``[indptr[-1]]`` (page ids) on the device (gathered).
    """

    indptr_host: torch.Tensor
    indptr_device: torch.Tensor
    last_page_len_host: torch.Tensor
    last_page_len_device: torch.Tensor
    indices: torch.Tensor


def replan_decode(
    fi: Any,
    slot: WrapperSlot,
    kwargs: dict[str, Any],
    arrays: DecodeArrays,
    *,
    graph: bool,
) -> None:
    """Re-plan ``slot``'s decode wrapper with ``fi.fast_decode_plan`` (see module doc).

    The caller guarantees the conditions above: ``fast_decode_available(fi)``, and
    ``slot.planned_with`` equals the call's constants. Issues no sync: every array the
    scheduler reads is on the host, every one a kernel reads is on the device.

    Args:
        fi: the flashinfer module.
        slot: the wrapper (graph mode: with its ``fixed`` ``"indptr"`` and
            ``"last_page_len"`` buffers).
        kwargs: the call's ``plan()`` keyword arguments.
        arrays: the batch's arrays (:class:`DecodeArrays`).
        graph: whether the wrapper was made with ``use_cuda_graph=True``.
    """
    passed = {name: value for name, value in kwargs.items() if name in _PASSED}
    wrapper = slot.wrapper
    if graph:
        slot.fixed["indptr"].copy_(arrays.indptr_device, non_blocking=True)
        slot.fixed["last_page_len"].copy_(arrays.last_page_len_device, non_blocking=True)
        fi.fast_decode_plan(
            wrapper, arrays.indptr_host, arrays.indices, arrays.last_page_len_host,
            global_override_indptr_cpu=arrays.indptr_host, **passed,
        )  # fmt: skip
        return
    tensor_cores = bool(wrapper.use_tensor_cores)
    fi.fast_decode_plan(
        wrapper,
        arrays.indptr_device,
        arrays.indices,
        arrays.last_page_len_host if tensor_cores else arrays.last_page_len_device,
        global_override_indptr_cpu=arrays.indptr_host,
        **passed,
    )
    if tensor_cores:  # the kernel reads the device copy, as after plan()
        wrapper._paged_kv_last_page_len_buf = arrays.last_page_len_device
