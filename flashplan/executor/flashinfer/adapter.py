"""The one module of flashplan that touches FlashInfer's or Triton's private API, and the
one table of the versions each use was checked against (:data:`SUPPORTED`).

Everywhere else flashplan calls FlashInfer's public ``plan()`` / ``run()`` and launches
Triton kernels as ``kernel[grid](*args)``. Here, each only on a version in the table:

* **decode re-plans** (:func:`replan_decode`): the compiled scheduler called directly,
  or not at all where its last schedule stands (:func:`schedule_stands`); a draft step's
  wrapper runs on another step's unsplit schedule (:func:`adopt_schedule`);
* **paged prefill re-plans** (:func:`replan_prefill`): the private fields that paged
  prefill ``plan()`` sets, and its compiled scheduler called directly (or not);
* **direct Triton launches** (:class:`DirectLaunch`): a compiled kernel's launcher
  called with the arguments ``JITFunction.run`` passes it.

On a FlashInfer version not in the table every wrapper is planned through ``plan()``
and :func:`check_version` warns (:class:`FlashInferVersionWarning`) once per process and
version; on a Triton version not in it every launch goes through ``kernel[grid]``.

The table also vouches for two flashinfer 0.7.4 quirks flashplan works around
(``tests/test_flashinfer_calls.py``): **packed mask offsets** summed in bits but added to
a byte pointer (flashinfer PR #2201: :func:`~.calls.flashinfer_mask_offsets`), and
**empty masked spans** given a negative mask size (one unread page instead,
``last_page_len = 0``: :func:`~.calls.call_inputs`).

A re-plan issues no sync and no copy, and runs only after a full ``plan()`` with the same
constants (``WrapperSlot.planned_with``). This module imports no other executor module
(but, for its annotations, the records of :mod:`~.replan_arrays`).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Hashable, Iterable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol

import attrs
import torch

from flashplan.arrays import INT32_MAX
from flashplan.kernels._triton import HAS_TRITON, triton, triton_mode
from flashplan.layout.heads import FP8_DTYPES

if TYPE_CHECKING:  # plain records of the arrays a re-plan takes
    from flashplan.executor.flashinfer.replan_arrays import DecodeArrays, PrefillArrays

__all__ = [
    "SUPPORTED", "DirectLaunch", "FlashInferVersionWarning",
    "Slot", "Support", "VersionTable", "adopt_schedule", "base_version",
    "check_version", "direct_launch_known", "fast_decode_available", "fast_prefill_available",
    "flashinfer_support", "plan_flags", "replan_decode", "replan_prefill", "replannable",
    "restore_own_buffers", "schedule_stands", "unsplit_schedule",
]  # fmt: skip


# -- the version table -------------------------------------------------------------------
@attrs.frozen
class Support:
    """What flashplan relies on in one flashinfer-python version (its mask quirks, as
    above, for every version in the table).

    Attributes:
        flashinfer: the version, without a local ``+…`` suffix.
        fast_decode: :func:`replan_decode` re-creates its decode ``plan()``,
            :func:`unsplit_schedule` reads its plan info and :func:`schedule_stands`
            knows when its scheduler splits (GPU tests ``test_fast_plan``).
        fast_prefill: :func:`replan_prefill` re-creates its paged prefill ``plan()``
            (GPU test ``test_fast_prefill_plan_equals_plan``).
    """

    flashinfer: str
    fast_decode: bool
    fast_prefill: bool


def _keyed(supports: Iterable[Support]) -> Mapping[str, Support]:
    return MappingProxyType({s.flashinfer: s for s in supports})


@attrs.frozen
class VersionTable:
    """The versions flashplan's private-API uses were checked against.

    Attributes:
        flashinfer: :class:`Support` by flashinfer-python version (read-only).
        triton_direct_launch: Triton versions whose compiled-kernel launcher
            :class:`DirectLaunch` calls (``test_direct_launches_equal_the_jit_launches``).
    """

    flashinfer: Mapping[str, Support] = attrs.field(converter=_keyed)
    triton_direct_launch: tuple[str, ...]


#: The one version table (see :class:`VersionTable`).
SUPPORTED = VersionTable(
    flashinfer=(Support(flashinfer="0.7.4", fast_decode=True, fast_prefill=True),),
    triton_direct_launch=("3.6.0", "3.9.0"),
)


class FlashInferVersionWarning(UserWarning):
    """The installed flashinfer is not one whose quirks flashplan was checked against."""


def base_version(version: object) -> str:
    """``version`` as a string without its local suffix (``"0.7.4+cu130"``: ``"0.7.4"``)."""
    return str(version).split("+")[0]


def flashinfer_support(fi: Any) -> Support | None:
    """The table's record for the imported flashinfer module ``fi``; ``None`` if unknown."""
    return SUPPORTED.flashinfer.get(base_version(getattr(fi, "__version__", "")))


def check_version(version: str) -> bool:
    """Whether flashinfer ``version`` is in the table; warn
    (:class:`FlashInferVersionWarning`, once per process and version) if not."""
    if base_version(version) in SUPPORTED.flashinfer:
        return True
    _warn_unknown(version)
    return False


@functools.cache
def _warn_unknown(version: str) -> None:
    """:func:`check_version`'s warning, once per version (at the executor's caller)."""
    warnings.warn(
        f"flashinfer {version} is not a version flashplan was checked against "
        f"({', '.join(SUPPORTED.flashinfer)}): every wrapper is planned through plan() "
        "(no fast re-plans), and its custom-mask offsets and empty masked spans are "
        "worked around as in 0.7.4 (see flashplan.executor.flashinfer.adapter); run "
        "the GPU tests (nox -s gpu) before trusting masked extends",
        FlashInferVersionWarning,
        stacklevel=4,
    )


def fast_decode_available(fi: Any) -> bool:
    """Whether flashinfer module ``fi`` is a version :func:`replan_decode` knows."""
    support = flashinfer_support(fi)
    return support is not None and support.fast_decode


def fast_prefill_available(fi: Any) -> bool:
    """Whether flashinfer module ``fi`` is a version :func:`replan_prefill` knows."""
    support = flashinfer_support(fi)
    return support is not None and support.fast_prefill


def direct_launch_known(triton_version: str) -> bool:
    """Whether :class:`DirectLaunch` may call the compiled launcher of this Triton."""
    return base_version(triton_version) in SUPPORTED.triton_direct_launch


class Slot(Protocol):
    """What a re-plan uses of a ``buffers.WrapperSlot`` (no executor module imported)."""

    wrapper: Any
    fixed: dict[str, torch.Tensor]
    info_flags: tuple[Any, int, int, bool, bool] | None


def plan_flags(slot: Slot) -> tuple[int, int, bool, bool] | None:
    """``(entries, total rows, enable_cuda_graph, split_kv)`` of ``slot``'s plan info
    (0.7.4's decode and prefill plan infos end with the two flags; a prefill plan info's
    second entry is its total rows), or ``None`` before a plan. Read once per plan info
    object (kept in ``slot.info_flags``): each entry of FlashInfer's FFI array costs
    about a microsecond to read."""
    info = getattr(slot.wrapper, "_plan_info", None)
    if info is None:
        return None
    held = slot.info_flags
    if held is None or held[0] is not info:
        n = len(info)
        if n >= 3:  # three reads of the array, by plain index
            held = (info, n, int(info[1]), bool(info[n - 2]), bool(info[n - 1]))
        else:
            held = (info, n, -1, True, True)
        slot.info_flags = held
    return held[1:]


# -- decode: the compiled scheduler without plan() ---------------------------------------
#: The decode ``plan()`` keywords a re-plan reads (``fast_decode_plan``'s parameters;
#: the others, ``o_data_type``, are compiled in: the constants pin them).
_PASSED = frozenset({
    "num_qo_heads", "num_kv_heads", "head_dim", "page_size", "pos_encoding_mode",
    "window_left", "logits_soft_cap", "q_data_type", "kv_data_type", "data_type",
    "sm_scale", "rope_scale", "rope_theta", "non_blocking", "fixed_split_size",
    "disable_split_kv",
})  # fmt: skip
#: The array arguments, passed separately (:class:`DecodeArrays`).
_ARRAYS = frozenset({"indptr", "indices", "last_page_len"})


@functools.lru_cache(maxsize=32)
def _empty(dtype: torch.dtype | str, device: torch.device) -> torch.Tensor:
    """A 0-element tensor of ``dtype`` (or its name) on ``device``: the CUDA-core decode
    scheduler reads the dtypes from it (made once; it holds no data, so it is shared)."""
    return torch.empty(0, dtype=getattr(torch, dtype) if isinstance(dtype, str) else dtype,
                       device=device)  # fmt: skip


def replan_decode(
    slot: Slot, kwargs: dict[str, Any], arrays: DecodeArrays, *, graph: bool,
    schedule: bool = True, refresh: bool = True,
) -> None:  # fmt: skip
    """Re-plan ``slot``'s decode wrapper through its compiled scheduler
    (``_cached_module.plan``) on the staged arrays, as vLLM's ``fast_plan_decode`` and
    flashinfer 0.7.4's ``fast_decode_plan`` do, without their per-call Python.

    Graph mode (``graph``): the slot's ``fixed`` indptr and last-page lengths are
    refreshed from the staged device copy (``refresh=False``: a captured graph copies
    them); eager: the wrapper's fields point at the staged views. The caller guarantees
    ``fast_decode_available(fi)``, an FA2 wrapper and ``slot.planned_with`` equal to the
    call's constants (``kwargs``: its ``plan()`` keywords). ``schedule=False``: the last
    plan (``_plan_info``, the int workspace) stands: the scheduler is skipped. No sync."""
    w = slot.wrapper
    tensor_cores = bool(w.use_tensor_cores)
    if graph and refresh:
        slot.fixed["indptr"].copy_(arrays.indptr_device, non_blocking=True)
        slot.fixed["last_page_len"].copy_(arrays.last_page_len_device, non_blocking=True)
    elif not graph:
        w._paged_kv_indptr_buf = arrays.indptr_device
        w._paged_kv_indices_buf = arrays.indices
        w._paged_kv_last_page_len_buf = arrays.last_page_len_device
        if tensor_cores:
            w._qo_indptr_buf = arrays.qo_indptr_device
    if not schedule:
        return
    _own_workspace_back(slot)  # the scheduler writes the wrapper's own workspace again
    bs = arrays.last_page_len_host.shape[0]
    hq, hkv, dim = kwargs["num_qo_heads"], kwargs["num_kv_heads"], kwargs["head_dim"]
    window = kwargs.get("window_left", -1)
    soft_cap = kwargs.get("logits_soft_cap")
    graph_enabled = w.is_cuda_graph_enabled
    switch = torch.cuda.current_device() != w.device.index
    with torch.cuda.device(w.device) if switch else contextlib.nullcontext():
        if tensor_cores:
            split = kwargs.get("fixed_split_size")
            w._plan_info = w._cached_module.plan(
                w._float_workspace_buffer, w._int_workspace_buffer,
                w._pin_memory_int_workspace_buffer, arrays.qo_indptr_host, arrays.indptr_host,
                arrays.kv_lens_host, bs, bs, hq, hkv, kwargs["page_size"], graph_enabled,
                dim, dim, False, window, -1 if split is None else split,
                kwargs.get("disable_split_kv", False), 0, 1, True,
            )  # fmt: skip
        else:
            q_dtype = kwargs.get("q_data_type") or kwargs.get("data_type") or torch.float16
            kv_dtype = kwargs.get("kv_data_type") or kwargs.get("data_type") or q_dtype
            w._plan_info = w._cached_module.plan(
                w._float_workspace_buffer, w._int_workspace_buffer,
                w._pin_memory_int_workspace_buffer, arrays.indptr_host, bs, hq, hkv,
                kwargs["page_size"], graph_enabled, window,
                0.0 if soft_cap is None else soft_cap, dim, dim,
                _empty(q_dtype, w.device), _empty(kv_dtype, w.device),
            )  # fmt: skip


def unsplit_schedule(slot: Slot) -> bool:
    """Whether ``slot``'s last schedule is eager and gives each request one work item
    (flashinfer 0.7.4's decode and prefill plan infos end ``enable_cuda_graph,
    split_kv``: both false). Its kernels then read each KV length from the wrapper's
    indptr, never the chunk size: it serves any batch of its size and constants."""
    flags = plan_flags(slot)
    return flags is not None and not flags[2] and not flags[3]


def schedule_stands(
    slot: Slot, kwargs: dict[str, Any], query_tiles: int, num_sm: int,
    total_rows: int | None = None,
) -> bool:  # fmt: skip
    """Whether ``slot``'s last schedule from flashinfer 0.7.4's prefill scheduler (a
    tensor-core decode's or an eager paged prefill's) serves a batch of at least
    ``query_tiles`` query tiles whatever its KV lengths, so the scheduler need not run.
    It splits no KV once there are more tiles than ``2 * num_sm // num_kv_heads``
    (``PrefillSplitQOKVIndptr``), and the unsplit schedule depends only on the queries
    and the constants (one work item per query tile). The one value that differs, the
    int workspace's chunk size, is read only when split (``prefill.cuh``). The caller
    guarantees the constants are the last plan's, this wrapper's scheduler made it,
    and the same queries: ``total_rows`` (checked here) or compared by the caller."""
    split = kwargs.get("fixed_split_size")
    budget = 2 * num_sm // kwargs["num_kv_heads"]  # no SM count known: no budget
    if num_sm <= 0 or query_tiles <= budget or (split is not None and split > 0):
        return False  # (checked first: no plan info read for a batch the scheduler splits)
    flags = plan_flags(slot)
    return (
        flags is not None and flags[0] == 15 and not flags[3]  # a prefill plan, unsplit
        and (total_rows is None or flags[1] == total_rows)
    )  # fmt: skip


def adopt_schedule(slot: Slot, leader: Slot) -> None:
    """Run ``slot``'s decode kernels on ``leader``'s unsplit schedule (plan info, int
    workspace; a draft step of its batch size and constants, checked by the caller;
    :func:`replan_decode` with ``schedule=False`` pointed the fields at the step's
    arrays). ``slot``'s own workspace waits in ``fixed``. Eager wrappers only."""
    w = slot.wrapper
    slot.fixed.setdefault("int_workspace", w._int_workspace_buffer)
    w._int_workspace_buffer = leader.wrapper._int_workspace_buffer
    w._plan_info = leader.wrapper._plan_info


# -- paged prefill: the scheduler without plan() -----------------------------------------
_HALF_DTYPES = (torch.float16, torch.bfloat16)


def replannable(wrapper: Any, kwargs: dict[str, Any]) -> bool:
    """Whether ``wrapper``'s last ``plan()`` took the path :func:`replan_prefill`
    re-creates: an eager FA2 wrapper running FlashInfer's own compiled module, without
    per-token scales, with fp16 / bf16 queries and fp16 / bf16 / fp8 KV."""
    return (
        not wrapper.is_cuda_graph_enabled
        and getattr(wrapper, "_backend", None) == "fa2"
        and getattr(wrapper, "_jit_module", None) is None
        and getattr(wrapper, "_cached_module", None) is not None
        and not getattr(wrapper, "_use_token_head_sf", True)
        and kwargs.get("q_data_type") in _HALF_DTYPES
        and kwargs.get("kv_data_type") in (*_HALF_DTYPES, *FP8_DTYPES)
    )


def restore_own_buffers(slot: Slot) -> None:
    """Give ``slot``'s wrapper back its own KV lengths buffer (:func:`replan_prefill`
    aims the field at the staging buffer) and int workspace (:func:`adopt_schedule`).
    Call it before every full ``plan()``, which writes into both."""
    own = slot.fixed.pop("kv_lens", None)
    if own is not None:
        slot.wrapper._kv_lens_buffer = own
    _own_workspace_back(slot)


def _own_workspace_back(slot: Slot) -> None:
    """Point ``slot``'s wrapper at its own int workspace again (kept in ``fixed`` while
    it ran on a leader's: :func:`adopt_schedule`)."""
    workspace = slot.fixed.pop("int_workspace", None)
    if workspace is not None:
        slot.wrapper._int_workspace_buffer = workspace


def replan_prefill(
    slot: Slot, kwargs: dict[str, Any], arrays: PrefillArrays, *, schedule: bool = True
) -> None:
    """Re-plan ``slot``'s eager paged prefill wrapper without ``plan()``: set the fields
    flashinfer 0.7.4's ``plan()`` sets on this path (eager, FA2, its own module, fp16 /
    bf16 / fp8 KV), pointed at the staged arrays, and call the compiled scheduler with
    ``plan()``'s arguments — without its argument checks, host metadata and copies.

    The caller guarantees ``fast_prefill_available(fi)``, ``replannable(wrapper,
    kwargs)`` after the last full ``plan()`` and ``slot.planned_with`` equal to the
    call's constants. ``kwargs``: the ``plan()`` keywords (placeholders resolved);
    ``schedule=False``: the scheduler's last plan stands (the fields still move)."""
    w = slot.wrapper
    bs = int(arrays.kv_lens_host.shape[0])
    w._batch_size = bs
    w._num_qo_heads = kwargs["num_qo_heads"]
    w._num_kv_heads = kwargs["num_kv_heads"]
    w._eagle_verify_fp8kv_sm90_state = None
    w._prefix_len_ptr = kwargs.get("prefix_len_ptr")
    w._token_pos_in_items_ptr = kwargs.get("token_pos_in_items_ptr")
    w._token_pos_in_items_len = kwargs.get("token_pos_in_items_len", 0)
    w._max_item_len_ptr = kwargs.get("max_item_len_ptr")
    w._qo_indptr_last = arrays.total_rows
    w._max_q_len = arrays.max_q_len
    w._max_kv_len = arrays.max_kv_len
    w._cudnn_paged_bounds = None
    # plan() copies the KV lengths into the wrapper's own buffer, which the FA2 kernels
    # never read: the field points at the staged copy instead, and the wrapper's own
    # buffer comes back (restore_own_buffers) before a full plan() writes into it.
    slot.fixed.setdefault("kv_lens", w._kv_lens_buffer)
    w._kv_lens_buffer = arrays.kv_lens_device
    w._qo_indptr_buf = arrays.qo_indptr_device
    w._paged_kv_indptr_buf = arrays.page_indptr_device
    w._paged_kv_last_page_len_buf = arrays.last_page_len_device
    w._paged_kv_indices_buf = arrays.indices
    mask = kwargs.get("packed_custom_mask")
    w._custom_mask_buf = mask
    w._mask_indptr_buf = arrays.mask_indptr_device if mask is not None else None
    w._block_tables = None
    head_dim = kwargs["head_dim_qk"]
    fixed_split = kwargs.get("fixed_split_size")
    if schedule:  # the scheduler, as plan() runs it on this path
        w._plan_info = w._cached_module.plan(
            w._float_workspace_buffer, w._int_workspace_buffer,
            w._pin_memory_int_workspace_buffer, arrays.qo_indptr_host,
            arrays.page_indptr_host, arrays.kv_lens_host,
            w._max_total_num_rows or arrays.total_rows, bs, kwargs["num_qo_heads"],
            kwargs["num_kv_heads"], kwargs["page_size"],
            False,  # is_cuda_graph_enabled (eager wrappers only)
            head_dim, kwargs.get("head_dim_vo") or head_dim, kwargs.get("causal", False),
            kwargs.get("window_left", -1), fixed_split if fixed_split else -1,
            bool(kwargs.get("disable_split_kv", False)),
            0, 0, False,  # colocated CTAs; uniform_q_len, fixed (no promise: graphs read it)
        )  # fmt: skip
    w._seq_lens_kv = None
    w._seq_lens_q = None


# -- Triton: direct launches -------------------------------------------------------------
class DirectLaunch:
    """Launches of one ``@triton.jit`` kernel that skip Triton's Python binder after the
    first launch of each variant.

    ``kernel[grid](*args)`` binds and specializes every argument on every call: tens of
    microseconds of host time. For a kernel whose ints are all ``do_not_specialize`` and
    pointers all ``do_not_specialize_on_alignment``, the variant depends only on the
    constexprs, dtypes and device (the caller's ``key``): a key's first launch goes
    through ``kernel[grid]`` and keeps the compiled kernel, later ones call its launcher
    as ``JITFunction.run`` does (Triton ``SUPPORTED.triton_direct_launch``). Another
    version, the interpreter or an int beyond int32: ``kernel[grid]``. Launch hooks are
    called as Triton calls them. One instance per owner: no global state.

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
            HAS_TRITON and triton_mode() == "compiled" and direct_launch_known(triton.__version__)
        )

    def __call__(
        self,
        grid: int,
        key: Hashable,
        args: tuple[Any, ...],
        ints: tuple[int, ...],
        pointers: tuple[Any, ...] | None = None,
        device: int | None = None,
    ) -> None:
        """Launch ``grid`` programs with ``args`` (every parameter in order, constexprs
        too); ``ints``: the int arguments (checked to fit int32); ``pointers``: ``args``
        with each tensor as its ``data_ptr()`` (the caller holds the tensors), taken as
        they are (a variant's first launch and one under a launch hook get ``args``);
        ``device``: the current CUDA device, when the caller has just read it."""
        if not self.enabled:
            self.kernel[(grid,)](*args)
            return
        fits = not ints or (max(ints) <= INT32_MAX and min(ints) >= -INT32_MAX)
        driver = triton.runtime.driver.active
        if device is None:
            device = driver.get_current_device()
        variant = self.variants.get((device, key)) if fits else None
        if variant is None:
            compiled = self.kernel[(grid,)](*args)
            if fits:
                self.variants[(device, key)] = compiled
            return
        stream = driver.get_current_stream(device)
        # as JITFunction.run, but a hook chain holding no hook (Triton 3.6 keeps empty
        # ones in place of none) calls nothing: no hook, no launch metadata bound for it
        hooks = triton.knobs.runtime
        enter, leave = hooks.launch_enter_hook, hooks.launch_exit_hook
        metadata = None
        if (enter is not None and getattr(enter, "calls", 1) != []) or (
            leave is not None and getattr(leave, "calls", 1) != []
        ):
            metadata = variant.launch_metadata((grid,), stream, *args)
        else:
            enter = leave = None
            args = args if pointers is None else pointers
        variant.run(
            grid, 1, 1, stream, variant.function, variant.packed_metadata, metadata, enter,
            leave, *args,
        )  # fmt: skip
        self.direct += 1
