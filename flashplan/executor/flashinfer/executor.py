"""`FlashInferExecutor`: applies a `PlanSpec` to FlashInfer wrappers and runs kernels.

The thin stateful part of flashplan. ``apply(spec, table)`` reads as its steps:

1. **translate** the plan (:mod:`~flashplan.executor.flashinfer.calls`; the call
   skeleton is computed once per static key) and lay out the device work
   (:func:`~flashplan.executor.flashinfer.staging.device_plan`, pure);
2. **stage**: every int32 host array of the batch goes into one pinned slot of a ring
   that is never overwritten while a queued copy may read it;
3. **one copy**: a single non-blocking host-to-device copy into a persistent buffer;
4. **one launch** (:func:`~flashplan.kernels.fused.launch_gather_and_mask`): every group's
   page ids and every write slot, mapped through the sliding-window page map where a
   windowed group needs it, and the first masked group's custom mask (threshold or
   tree) expanded on the device; any further masked group gets its own mask launch;
5. (``check_pages`` mode only) the gathered ids are read back and checked;
6. **plan() calls** with pinned host indptrs (so FlashInfer never reads back from the
   device), the device page ids and, in a multi-item batch, uint32 / uint16 views of
   the staged ``prefix_len_ptr`` and ``max_item_len`` and a ``token_pos_in_items``
   filled on the device from the staged items (one memset and one
   :func:`~flashplan.kernels.fill_runs` launch). FlashInfer keeps these tensors for its
   kernels; they stay valid until the next apply rewrites them.

``run(group, q, k_new, v_new, kv_cache)`` writes the new K/V into the cache (one
Triton launch that skips unusable slots) and runs the group's kernels (the ragged +
paged path merges its two partial states with flashplan's Triton merge, which keeps
NaN visible: see :mod:`flashplan.kernels.merge_state`); everything a
kernel compiles in (window, soft cap, scale, causal, mask, dtypes) comes from the
plan and is never overridden at run time. Nothing in apply or run waits for the GPU,
except in the opt-in ``check_pages`` mode.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, Literal, overload

import attrs
import numpy as np
import torch

from flashplan.errors import (
    OptionError,
    OptionTypeError,
    PageTableError,
    PlanMismatchError,
    UnsupportedError,
    as_option,
)
from flashplan.executor.checks import RunArgs, check_apply_args, check_run_args
from flashplan.executor.flashinfer.adapter import (
    DecodeArrays,
    PrefillArrays,
    check_version,
    fast_decode_available,
    fast_prefill_available,
    replan_decode,
    replan_prefill,
    replannable,
    restore_own_buffers,
)
from flashplan.executor.flashinfer.buffers import (
    DeviceBuffer,
    PinnedRing,
    PinnedSlot,
    SliceViews,
    StagedViews,
    WrapperPool,
    WrapperSlot,
)
from flashplan.executor.flashinfer.caches import (
    BoundCall,
    BoundCallKey,
    DecodeViews,
    MaskKey,
    PrefillViews,
    mask_layout,
)
from flashplan.executor.flashinfer.calls import (
    BatchInt,
    BuiltMask,
    DeviceIndices,
    GroupCalls,
    HostArray,
    ItemPositions,
    MaskRecipe,
    PlanCall,
    StagedArray,
    WrapperKey,
    WrapperKind,
    call_inputs,
    call_skeleton,
    check_runnable,
    skeleton_key,
)
from flashplan.executor.flashinfer.policy import ExecutorPolicy
from flashplan.executor.flashinfer.staging import JOBS, DevicePlan, device_plan
from flashplan.executor.flashinfer.streams import CurrentStream
from flashplan.executor.gathers import Region, gather_jobs, gather_jobs_steps
from flashplan.kernels.fused import (
    BoundGatherAndMask,
    StagedMask,
    bind_gather_and_mask,
    direct_launcher,
    launch_gather_and_mask,
)
from flashplan.kernels.gather import NO_BAD_JOB, new_status
from flashplan.kernels.kv_write import write_kv
from flashplan.kernels.merge_state import fold_sinks_triton, merge_state_triton
from flashplan.kernels.runs import fill_runs
from flashplan.layout.convert import as_bool, as_int
from flashplan.layout.group import AttentionGroup
from flashplan.layout.page_table import PageTable
from flashplan.planning.spec import KernelPath, PlanSpec

__all__ = ["DEFAULT_WORKSPACE_BYTES", "FlashInferExecutor"]

#: torch dtypes of the staged views handed to plan() (the multi-item tensors).
_VIEW_DTYPES = {"uint32": torch.uint32, "uint16": torch.uint16}

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


def _cuda_device(device: torch.device | str | None) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise UnsupportedError("device", f"not a torch device ({exc})", value=device) from None
    if dev.type != "cuda":
        raise UnsupportedError("device", "FlashInferExecutor needs a CUDA device", device=str(dev))
    if not torch.cuda.is_available():
        raise UnsupportedError(
            "device", "FlashInferExecutor needs CUDA, which is not available here"
        )
    if dev.index is None:  # "cuda" means the current device; tensors say cuda:N
        # (torch's stubs type index as int; it is None for a bare "cuda")
        dev = torch.device("cuda", torch.cuda.current_device())  # type: ignore[unreachable]
    return dev


def _bound_call(
    call: PlanCall, host: StagedViews, staged: StagedViews, prefix: str, index: int, part: str
) -> BoundCall:
    """``call``'s :class:`BoundCall` for these views (made on first use; kept in the
    device views' memo under a :class:`BoundCallKey` that holds the whole call)."""
    memo_key = BoundCallKey(prefix, index, part, call, id(host))
    bound = staged.memo.calls.get(memo_key)
    if bound is not None and bound.host is host:
        return bound
    kwargs = dict(call.constants)
    dynamic = []
    for name, value in call.placeholders:
        if isinstance(value, HostArray):
            kwargs[name] = host[prefix + value.name]
        else:
            dynamic.append((name, value))
    g = f"{prefix}g{index}"
    decode: DecodeViews | None = None
    prefill: PrefillViews | None = None
    mask_indptr = None
    ints = (prefix + "qo.total", prefix + "qo.max_len", g + ".max_kv_len")
    if call.wrapper.kind is WrapperKind.DECODE:
        ind, last = g + ".page_indptr", g + ".last_page_len"
        if call.wrapper.use_tensor_cores:  # the scheduler's qo_indptr and KV lengths
            qo, kv = prefix + "qo_indptr", g + ".kv_lens"
            decode = (host[ind], staged[ind], host[last], staged[last],
                      host[qo], staged[qo], host[kv])  # fmt: skip
        else:
            decode = (host[ind], staged[ind], host[last], staged[last], None, None, None)
    elif call.wrapper.kind is WrapperKind.PAGED_PREFILL:
        qo_name = next(
            v.name for n, v in call.placeholders if n == "qo_indptr" and isinstance(v, HostArray)
        )
        qo, ind, kv = prefix + qo_name, g + ".page_indptr", g + ".kv_lens"
        # a group over virtual requests has its own rows, hence its own query integers
        qo_ints = prefix + "qo" if qo_name == "qo_indptr" else g + ".qo"
        prefill = (host[qo], staged[qo], host[ind], staged[ind], staged[g + ".last_page_len"],
                   host[kv], staged[kv])  # fmt: skip
        if any(isinstance(v, BuiltMask) for _, v in call.placeholders):
            mask_indptr = staged[g + ".mask.indptr"]
        ints = (qo_ints + ".total", qo_ints + ".max_len", g + ".max_kv_len")
    bound = BoundCall(host, kwargs, tuple(dynamic), decode, prefill, mask_indptr, ints)
    staged.memo.calls[memo_key] = bound
    return bound


def _region_view(views: StagedViews, page: torch.Tensor, region: Region) -> torch.Tensor:
    """``page[region.lo:region.hi]``, the last one of each region name kept in the
    views' memo, checked against the page buffer and the bounds (a step loop gathers a
    region of the same bounds into the same output buffer batch after batch, and a
    torch slice costs microseconds)."""
    held = views.memo.regions.get(region.name)
    if held is not None and held[0] is page and held[1] == region:
        return held[2]
    view = page[region.lo : region.hi]
    views.memo.regions[region.name] = (page, region, view)
    return view


def _job_table(views: StagedViews) -> torch.Tensor:
    """The staged job table as int32 ``[6, num_jobs]`` (made once per layout)."""
    table = views.memo.job_table
    if table is None:
        table = views.memo.job_table = views[JOBS].view(6, -1)
    return table


class FlashInferExecutor:
    """Runs plans (:class:`~flashplan.PlanSpec`) on FlashInfer kernels (CUDA).

    Same contract as :class:`~flashplan.ReferenceExecutor` (the
    :class:`~flashplan.Executor` protocol): ``apply(spec, table)`` once per batch, then
    ``run(group, q, k_new, v_new, kv_cache)`` per layer, all on one CUDA stream.

    **Bad page ids.** By default nothing waits for the GPU, so page ids are checked on
    the device: an id below 0, at or beyond ``table.num_pages`` (when the table says
    it), or evicted from the window pool is never used — reads go to page 0 instead,
    writes are skipped, and writes to a page beyond the cache are skipped too — and
    each such id is counted in :meth:`page_errors`, which an engine may read whenever
    it syncs anyway. With ``check_pages=True`` every apply and run instead checks the
    ids and the write slots at once and raises :class:`~flashplan.PageTableError`
    naming the request: that mode reads back from the device (a sync per call).

    Args:
        device: the CUDA device of the KV cache (default: the current device).
        policy: kernel choices (:class:`ExecutorPolicy`; defaults measured on H200).
        workspace_bytes: size of the float workspace all wrappers share
            (:data:`DEFAULT_WORKSPACE_BYTES`). A plan that needs more makes ``apply``
            raise :class:`~flashplan.UnsupportedError` naming this argument.
        page_map: optional int32 device tensor mapping full-pool page ids to the
            page ids of a separate sliding-window KV pool (a negative entry marks an
            evicted page); windowed groups' page ids and write slots go through it.
        check_pages: the checked mode above.
        fast_plan: re-plan a wrapper whose last ``plan()`` had the same constant
            arguments without ``plan()``'s argument checks, host metadata and copies
            (flashplan has staged the arrays already): a decode wrapper or an eager
            FA2 paged prefill wrapper by running FlashInfer's compiled scheduler directly
            (:mod:`~flashplan.executor.flashinfer.adapter`); only with a flashinfer
            version each was checked against. ``False``: always ``plan()``.

    Raises:
        UnsupportedError: no CUDA, or ``device`` is not a CUDA device.
        OptionError: an argument of the wrong range; :class:`~flashplan.OptionTypeError`
            (also a ``TypeError``) of the wrong type.

    Attributes:
        plan_counts: FlashInfer planning calls made so far, by route: ``"plan"`` (full
            ``plan()`` calls), ``"fast_decode_plan"`` (decode re-plans) and
            ``"fast_prefill_plan"`` (paged prefill re-plans; see ``fast_plan``).
    """

    def __init__(
        self,
        device: torch.device | str | None = None,
        *,
        policy: ExecutorPolicy | None = None,
        workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
        page_map: torch.Tensor | None = None,
        check_pages: bool = False,
        fast_plan: bool = True,
    ) -> None:
        self.device = _cuda_device(device)
        self._fi = import_flashinfer()
        check_version(str(self._fi.__version__))
        if policy is not None and not isinstance(policy, ExecutorPolicy):
            raise OptionTypeError("policy", "must be an ExecutorPolicy", value=policy)
        self.policy = policy or ExecutorPolicy()
        self.workspace_bytes = as_option(as_int, "workspace_bytes", workspace_bytes,
                                         minimum=1 << 20)  # fmt: skip
        self.check_pages = as_option(as_bool, "check_pages", check_pages)
        self.fast_plan = as_option(as_bool, "fast_plan", fast_plan)
        self._fast_decode = self.fast_plan and fast_decode_available(self._fi)
        self._fast_prefill = self.fast_plan and fast_prefill_available(self._fi)
        if page_map is not None and (
            not isinstance(page_map, torch.Tensor)
            or page_map.dtype != torch.int32
            or page_map.dim() != 1
            or page_map.device != self.device
        ):
            raise OptionError(
                "page_map", f"must be an int32 1-D tensor on {self.device}", value=page_map
            )
        self.page_map = page_map
        # zeroed: FlashInfer asks for a zero-initialised float workspace on first use
        self._workspace = torch.zeros(self.workspace_bytes, dtype=torch.uint8, device=self.device)
        self._init_state()

    def _init_state(self) -> None:
        """The per-executor state (an executor made from another shares its settings)."""
        self.sm90 = torch.cuda.get_device_capability(self.device) == (9, 0)
        self._pool = WrapperPool(grow=self._grow_wrappers)
        self._planned: dict[tuple[int, str], Any] = {}
        self._skeletons: dict[object, tuple[GroupCalls, ...]] = {}
        self._ring = PinnedRing()
        self._staged = DeviceBuffer(self.device, torch.int32)
        self._out_page = DeviceBuffer(self.device, torch.int32)
        self._out_offset = DeviceBuffer(self.device, torch.int32)
        self._mask_bufs: dict[int, DeviceBuffer] = {}
        self._item_bufs: dict[str, DeviceBuffer] = {}
        self._status = new_status(self.device)
        self._stream = CurrentStream(self.device)
        self._views = SliceViews()
        self._direct = direct_launcher()  # the fused launch's compiled variants
        self._spec: PlanSpec | None = None
        self._plan: DevicePlan | None = None
        self._table: PageTable | None = None
        self._gathered: tuple[torch.Tensor, torch.Tensor] | None = None
        self._runs_staged = DeviceBuffer(self.device, torch.int32)
        self._positions_buf = DeviceBuffer(self.device, torch.int32)
        self._positions: torch.Tensor | None = None  # built by positions() for _spec
        self._step_positions: list[DeviceBuffer] = []  # apply_steps' views: one per step
        #: FlashInfer planning calls made so far: full ``plan()`` calls, decode re-plans
        #: (``"fast_decode_plan"``: the scheduler called as ``fast_decode_plan`` calls it)
        #: and paged prefill re-plans (see ``fast_plan``).
        self.plan_counts = {"plan": 0, "fast_decode_plan": 0, "fast_prefill_plan": 0}

    # -- state --------------------------------------------------------------------------
    @property
    def spec(self) -> PlanSpec | None:
        """The plan applied last, or ``None``."""
        return self._spec

    @property
    def calls(self) -> tuple[GroupCalls, ...]:
        """The FlashInfer call descriptions of the applied plan."""
        return () if self._plan is None else self._plan.calls

    @property
    def device_plan(self) -> DevicePlan | None:
        """The device work of the applied plan (jobs, staging manifest, calls)."""
        return self._plan

    def positions(self) -> torch.Tensor:
        """int32 ``[total_q]`` device tensor: the applied plan's RoPE positions
        (:attr:`~flashplan.PlanSpec.positions`), built on the device.

        The first call after an ``apply`` sends the plan's position runs
        (:class:`~flashplan.planning.PositionRuns`: three int32 per run, far fewer than the
        tokens of an extend) in one host-to-device copy and fills the positions with one
        kernel launch; later calls return the same tensor. Sync-free: nothing is read
        back, and nothing is computed per token on the host. The tensor is this
        executor's buffer: valid until ``positions()`` is called after the next apply.

        Raises:
            PlanMismatchError: nothing applied yet.
        """
        if self._positions is not None:
            return self._positions
        spec = self._spec
        if spec is None:
            raise PlanMismatchError("spec", "positions() before apply(): apply a PlanSpec first")
        runs = spec.position_runs
        n = runs.num_runs
        columns = (runs.start, runs.first, runs.length)
        staged, slot = self._upload(
            self._runs_staged, max(3 * n, 1), lambda a: np.concatenate(columns, out=a[: 3 * n])
        )
        out = self._positions_buf.get(spec.total_q)
        fill_runs(staged[:n], staged[n : 2 * n], staged[2 * n : 3 * n], out, runs.max_length)
        slot.mark_read(self._stream())
        self._positions = out
        return out

    def page_errors(self) -> torch.Tensor:
        """int32 ``[2]`` device tensor: bad page ids met so far, and the index of the
        first gather job that met one (``2**31 - 1`` when none). Reading it is a sync;
        :meth:`reset_page_errors` zeroes it."""
        return self._status

    def reset_page_errors(self) -> None:
        """Zero the :meth:`page_errors` counters (on the device, no sync)."""
        self._status[0] = 0
        self._status[1] = NO_BAD_JOB

    #: Eager executors make another wrapper rather than wait (see WrapperPool).
    _grow_wrappers = True

    #: Whether the wrappers read fixed buffers (CUDA graphs) or the staged views.
    _graph_wrappers = False

    def _make_wrapper(self, key: WrapperKey, group_index: int, prefix: str = "") -> WrapperSlot:
        del group_index, prefix  # eager wrappers own no per-group or per-step buffers
        cls = getattr(self._fi, key.class_name)
        return WrapperSlot(cls(self._workspace, **key.constructor_kwargs()))

    def _skeleton(self, spec: PlanSpec) -> tuple[GroupCalls, ...]:
        key = skeleton_key(spec, self.policy)
        calls = self._skeletons.get(key)
        if calls is None:
            calls = call_skeleton(spec, self.policy, sm90=self.sm90)
            self._skeletons[key] = calls
        return calls

    # -- apply --------------------------------------------------------------------------
    def apply(self, spec: PlanSpec, table: PageTable) -> None:
        """Plan every wrapper for ``spec``; sync-free (unless ``check_pages``).

        A refused apply leaves the executor as it was: the earlier plan still runs.

        Raises:
            PlanMismatchError: ``spec`` or ``table`` is not the right record.
            PageTableError: the table is too small for the plan or not on this device
                (in ``check_pages`` mode also: a bad page id, two requests writing one
                slot).
            UnsupportedError: a plan this policy cannot run (deterministic mode and a
                ragged path), one that needs more workspace than the executor has, or
                one the executor does not run yet (``calls.check_runnable``).
        """
        spec, table = check_apply_args(spec, table)
        check_runnable(spec, graph=self._graph_wrappers)
        self._check_table_device(table)
        if self.policy.deterministic and any(
            p in (KernelPath.RAGGED, KernelPath.RAGGED_PAGED) for p in spec.key.paths
        ):
            raise UnsupportedError(
                "extend_path",
                "deterministic mode runs extends on the paged path only (on a ragged path a "
                "request's kernels would depend on the rest of the batch): plan with "
                "extend_path='paged'",
            )
        calls = self._skeleton(spec)
        dplan = self._device_plan(spec, calls, table)
        slot, host_views, device_views = self._stage(dplan)
        page, offset, masks = self._gather_and_mask(dplan, device_views, table)
        if self.check_pages:
            self._check_gathered(dplan, spec, table, page, offset)

        stream = self._stream()
        planned = self._plan_calls(calls, dplan, host_views, device_views, page, masks, stream)
        slot.mark_read(stream)
        self._spec, self._plan, self._table = spec, dplan, table
        self._planned = planned
        self._gathered = (page, offset)
        self._positions = None

    def _plan_calls(
        self,
        calls: tuple[GroupCalls, ...],
        dplan: DevicePlan,
        host: StagedViews,
        staged: StagedViews,
        page: torch.Tensor,
        masks: dict[int, torch.Tensor],
        stream: torch.cuda.Stream,
        prefix: str = "",
    ) -> dict[tuple[int, str], Any]:
        """Call every wrapper's ``plan()``; placeholders resolve against the views of the
        staged host slot (``host``) and of its device copy (``staged``), the gather
        regions and the built masks (names under ``prefix``)."""

        def resolve(value: Any) -> Any:
            if isinstance(value, StagedArray):
                # A typed view of the persistent device staging buffer: FlashInfer keeps
                # it for run(); it stays valid until the next apply rewrites the buffer.
                words = staged[prefix + value.name]
                return words.view(_VIEW_DTYPES[value.dtype])[: dplan.elements[prefix + value.name]]
            if isinstance(value, BatchInt):
                return dplan.ints[prefix + value.name]
            if isinstance(value, DeviceIndices):
                return _region_view(staged, page, dplan.jobs.region(prefix + value.region))
            if isinstance(value, BuiltMask):
                return masks[value.group_index]
            if isinstance(value, ItemPositions):
                return self._fill_item_positions(dplan, staged, prefix + value.name)
            raise AssertionError(f"unresolved placeholder {value!r}")  # pragma: no cover

        planned: dict[tuple[int, str], Any] = {}
        for gc in calls:
            for part, call in (("paged", gc.paged), ("ragged", gc.ragged)):
                if call is None:
                    continue
                key, index = call.wrapper, gc.group_index
                held = self._pool.acquire(
                    (prefix, key), partial(self._make_wrapper, key, index, prefix)
                )
                bound = _bound_call(call, host, staged, prefix, index, part)
                kwargs = dict(bound.kwargs)
                for name, value in bound.dynamic:
                    kwargs[name] = resolve(value)
                if (
                    self._fast_decode
                    and bound.decode is not None
                    and key.sink is None  # a sink wrapper's JIT module: plan() each time
                    and held.planned_with == call.constants  # None before a full plan()
                ):
                    arrays = DecodeArrays(*bound.decode, indices=kwargs["indices"])
                    replan_decode(held, kwargs, arrays, graph=self._graph_wrappers)
                    self.plan_counts["fast_decode_plan"] += 1
                elif (
                    self._fast_prefill
                    and bound.prefill is not None
                    and held.replannable  # its last full plan() took replan_prefill's path
                    and held.planned_with == call.constants
                ):
                    ints = dplan.ints
                    total, max_q, max_kv = bound.prefill_ints
                    prefill = PrefillArrays(
                        *bound.prefill, indices=kwargs["paged_kv_indices"],
                        mask_indptr_device=bound.mask_indptr, total_rows=ints[total],
                        max_q_len=ints[max_q], max_kv_len=ints[max_kv],
                    )  # fmt: skip
                    replan_prefill(held, kwargs, prefill)
                    self.plan_counts["fast_prefill_plan"] += 1
                else:
                    held.planned_with = None  # until this plan() succeeds
                    held.replannable = False
                    restore_own_buffers(held)
                    self._call_plan(held.wrapper, kwargs)
                    held.planned_with = call.constants
                    # what replannable() reads is fixed by the constructor, the constant
                    # arguments and this plan(): checked once per full plan()
                    held.replannable = bound.prefill is not None and replannable(
                        held.wrapper, kwargs
                    )
                    self.plan_counts["plan"] += 1
                self._pool.mark_planned(held, stream)
                planned[(index, part)] = held.wrapper
        return planned

    # -- multi-step draft decode ------------------------------------------------------
    def apply_steps(
        self, specs: tuple[PlanSpec, ...] | list[PlanSpec], table: PageTable
    ) -> tuple[FlashInferExecutor, ...]:
        """Apply every step of a multi-step draft decode at once; one executor per step.

        All steps share one staging copy and one gather launch; each step's wrappers are
        planned with its own indptrs. The returned executors run their step
        (``views[s].run(group, q, k_new, v_new, kv_cache)``); they share this
        executor's buffers, so apply again only through this executor.

        Raises:
            PlanMismatchError: as :meth:`apply`, or no plan given.
            PageTableError: as :meth:`apply`.
            UnsupportedError: as :meth:`apply`, or a plan with a custom mask (draft
                decodes have none).
        """
        specs = tuple(specs)
        if not specs:
            raise PlanMismatchError("specs", "apply_steps() needs at least one step's plan")
        steps = []
        for spec in specs:
            spec, table = check_apply_args(spec, table)
            check_runnable(spec, graph=self._graph_wrappers)
            calls = self._skeleton(spec)
            if any(gc.masked for gc in calls):
                raise UnsupportedError("specs", "apply_steps() plans steps without custom masks")
            steps.append((spec, calls))
        self._check_table_device(table)
        prefixes = [f"s{k}/" for k in range(len(steps))]
        dplan = self._steps_device_plan(steps, table, prefixes)
        slot, host_views, device_views = self._stage(dplan)
        page, offset, _ = self._gather_and_mask(dplan, device_views, table)
        stream = self._stream()
        views = []
        while len(self._step_positions) < len(steps):
            self._step_positions.append(DeviceBuffer(self.device, torch.int32))
        for k, (prefix, (spec, calls)) in enumerate(zip(prefixes, steps, strict=True)):
            planned = self._plan_calls(
                calls, dplan, host_views, device_views, page, {}, stream, prefix
            )
            step_jobs = attrs.evolve(
                dplan.jobs,
                regions=tuple(
                    r._replace(name=r.name.removeprefix(prefix))
                    for r in dplan.jobs.regions
                    if r.name.startswith(prefix)
                ),
            )
            view = copy.copy(self)
            view._spec, view._table, view._planned = spec, table, planned
            view._plan = DevicePlan(calls, step_jobs, dplan.manifest, dplan.parts, dplan.masks)
            view._gathered = (page, offset)
            view._positions = None
            view._positions_buf = self._step_positions[k]  # each step's positions stay
            views.append(view)
        slot.mark_read(stream)
        return tuple(views)

    def _steps_device_plan(
        self,
        steps: list[tuple[PlanSpec, tuple[GroupCalls, ...]]],
        table: PageTable,
        prefixes: list[str],
    ) -> DevicePlan:
        """The device work of every step of ``apply_steps``, names under their prefixes:
        all steps' gather jobs in one table and their ``plan()`` arrays in one staging
        buffer (no masks: ``apply_steps`` refuses them)."""
        inputs = [call_inputs(spec, calls) for spec, calls in steps]
        combined = gather_jobs_steps(
            [spec for spec, _ in steps], table.rows, prefixes,
            window_pool=self.page_map is not None, spans=[i.spans for i in inputs],
        )  # fmt: skip
        host = {
            p + name: a for p, i in zip(prefixes, inputs, strict=True) for name, a in i.host.items()
        }
        return device_plan((), combined, host, {})

    def _check_table_device(self, table: PageTable) -> None:
        """Refuse a page table on another device than the executor's."""
        if table.pages.device != self.device:
            raise PageTableError(
                "pages",
                "the page table must live on the executor's device",
                table_device=str(table.pages.device),
                device=str(self.device),
            )

    def _device_plan(
        self, spec: PlanSpec, calls: tuple[GroupCalls, ...], table: PageTable
    ) -> DevicePlan:
        inputs = call_inputs(spec, calls)
        jobs = gather_jobs(
            spec, table.rows, window_pool=self.page_map is not None, spans=inputs.spans
        )
        return device_plan(
            calls, jobs, inputs.host, inputs.masks, ints=inputs.ints, elements=inputs.elements
        )

    def _gather_out(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The gather's output buffers (page ids, in-page offsets) of at least ``size``
        (whole: readers take their regions' bounds from the job table)."""
        return self._out_page.reserve(size), self._out_offset.reserve(size)

    def _stage(self, dplan: DevicePlan) -> tuple[PinnedSlot, StagedViews, StagedViews]:
        """Upload the staging data (:meth:`_upload`): the slot (the caller marks it read)
        and the named views of both sides (made once per buffer and manifest,
        :class:`SliceViews`; the copy's own views are kept with the device views)."""
        total = dplan.manifest.total
        device = self._views.of(self._staged.reserve(total), dplan.manifest)
        _, slot = self._upload(self._staged, total, dplan.write_into, memo=device.memo.uploads)
        return slot, self._views.of(slot.host, dplan.manifest), device

    def _upload(
        self,
        target: DeviceBuffer,
        total: int,
        write: Callable[[np.ndarray], object],
        memo: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None,
    ) -> tuple[torch.Tensor, PinnedSlot]:
        """``write`` ``total`` int32 entries into an idle pinned slot, then one
        non-blocking copy of them into ``target``; the caller marks the slot read.
        ``memo`` keeps the copy's two ``[:total]`` views per slot, keyed by the slot
        tensor's ``id`` and checked against it (for a caller whose ``target`` and
        ``total`` it is tied to: :attr:`LayoutMemo.uploads`)."""
        slot = self._ring.acquire(total)
        write(slot.array)
        key = id(slot.host)
        pair = memo.get(key) if memo is not None else None
        if pair is None or pair[0] is not slot.host:
            pair = (slot.host, target.get(total), slot.host[:total])
            if memo is not None:
                memo[key] = pair
        pair[1].copy_(pair[2], non_blocking=True)
        return pair[1], slot

    def _mask_out(self, group_index: int, size: int) -> torch.Tensor:
        """The uint8 buffer (at least ``size`` bytes, whole: FlashInfer finds each
        request's bytes through ``mask_indptr``) group ``group_index``'s mask is built
        into."""
        buf = self._mask_bufs.get(group_index)
        if buf is None:
            buf = self._mask_bufs[group_index] = DeviceBuffer(self.device, torch.uint8)
        return buf.reserve(size)

    def _gather_and_mask(
        self, dplan: DevicePlan, views: StagedViews, table: PageTable
    ) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
        """The gather and the first masked group's mask in one launch, any further
        mask in its own: (page ids, in-page offsets, each masked group's mask).
        ``views`` are the named views of the device copy of the staging data."""
        jobs = dplan.jobs
        page, offset = self._gather_out(max(jobs.total, 1))
        built: dict[int, torch.Tensor] = {}
        fused = None
        for index, recipe in dplan.masks.items():
            out = self._mask_out(index, recipe.total_bytes)
            mask = self._staged_mask(dplan, views, index, recipe, out)
            built[index] = mask.out
            if fused is None:
                fused = mask
            else:  # a batch's second and later masked groups: a launch each
                mask.build()
        # [6, num_jobs] (none when the jobs gather nothing)
        job_table = _job_table(views) if jobs.total else views.tensor[:0].view(6, 0)
        num_pages = table.num_pages or 0
        launch = self._bound_launch(views, table.pages, job_table, page, offset, fused)
        if launch is not None:
            launch(num_pages, fused.max_bytes if fused is not None else 0)
        else:
            launch_gather_and_mask(
                table.pages, job_table, page, offset, page_map=self.page_map,
                num_pages=num_pages, status=self._status, mask=fused, direct=self._direct,
            )  # fmt: skip
        return page, offset, built

    def _bound_launch(
        self,
        views: StagedViews,
        pages: torch.Tensor,
        job_table: torch.Tensor,
        page: torch.Tensor,
        offset: torch.Tensor,
        mask: StagedMask | None,
    ) -> BoundGatherAndMask | None:
        """The fused launch bound to these tensors (:func:`bind_gather_and_mask`), made
        once per layout, mask layout and set of buffers (kept in the views' memo and
        checked against all three); ``None``: launch unbound."""
        page_map, status = self.page_map, self._status
        layout = mask_layout(mask)
        held = views.memo.launch
        if (
            held is not None
            and held[0] == layout
            and held[1].binds(
                pages, job_table, page, offset, page_map=page_map, status=status, mask=mask
            )
        ):
            return held[1]
        bound = bind_gather_and_mask(
            pages, job_table, page, offset, page_map=page_map, status=status, mask=mask,
            direct=self._direct,
        )  # fmt: skip
        if bound is not None:
            views.memo.launch = (layout, bound)
        return bound

    @staticmethod
    def _staged_mask(
        dplan: DevicePlan, views: StagedViews, index: int, recipe: MaskRecipe, out: torch.Tensor
    ) -> StagedMask:
        """Group ``index``'s mask: its inputs as offsets into the staged device tensor
        (``views.tensor``), built into ``out`` (made once per layout, :class:`MaskKey`
        and output buffer; a batch with another largest mask only replaces
        ``max_bytes``)."""
        key = MaskKey(index, recipe.num_tokens, recipe.position)
        held = views.memo.masks.get(key)
        if held is not None and held.out is out:
            if held.max_bytes != recipe.max_bytes:  # the batch's own size, same arrays
                held = views.memo.masks[key] = held._replace(max_bytes=recipe.max_bytes)
            return held
        m, g, num_tokens = dplan.manifest, f"g{index}.mask.", recipe.num_tokens
        qo = m[g + "qo_lens"]
        more = (0, 0, 0)
        if num_tokens:
            more = (m[g + "row_offsets"].offset, m[g + "tail_start"].offset,
                    m[g + "tail_words"].offset)  # fmt: skip
        if recipe.position:  # the kernel's slots: rule, column positions, row positions
            more = (m[g + "rule"].offset, m[g + "col_position"].offset, 0)
            first = m[g + "row_position"].offset
        else:
            first = m[g + "first_visible"].offset
        # each request's first byte: the first bs entries of FlashInfer's mask_indptr
        mask = StagedMask(
            views.tensor, first, qo.offset, m[g + "kv_lens"].offset, m[g + "indptr"].offset,
            *more, qo.size, num_tokens, recipe.max_bytes, out, recipe.position,
        )  # fmt: skip
        views.memo.masks[key] = mask
        return mask

    def _fill_item_positions(
        self, dplan: DevicePlan, staged: Mapping[str, torch.Tensor], name: str
    ) -> torch.Tensor:
        """FlashInfer's uint16 ``token_pos_in_items`` for the items staged under ``name``
        (:class:`~flashplan.executor.flashinfer.calls.ItemPositions`): zeroed, then every
        item's 1, 2, … written by one launch. Each name has its own buffer: FlashInfer
        keeps the tensor until the wrapper is planned again."""
        size = dplan.ints[name + ".size"]
        buf = self._item_bufs.setdefault(name, DeviceBuffer(self.device, torch.int16))
        out = buf.reserve(max(size, 1))[:size]
        out.zero_()  # int16: torch fills few uint16 tensors; the bytes are the same
        out = out.view(torch.uint16)
        fill_runs(
            staged[name + ".start"], 1, staged[name + ".length"], out,
            dplan.ints[name + ".longest"],
        )  # fmt: skip
        return out

    def _call_plan(self, wrapper: Any, kwargs: dict[str, Any]) -> None:
        try:
            wrapper.plan(**kwargs)
        except RuntimeError as exc:
            text = str(exc).lower()
            if "workspace" in text or "buffer size" in text or "out of memory" in text:
                raise UnsupportedError(
                    "workspace_bytes",
                    f"FlashInfer's plan() needs more workspace than this executor has ({exc}); "
                    "construct the executor with a larger workspace_bytes",
                    workspace_bytes=self.workspace_bytes,
                ) from exc
            raise

    # -- checked mode -------------------------------------------------------------------
    def _check_gathered(
        self,
        dplan: DevicePlan,
        spec: PlanSpec,
        table: PageTable,
        page: torch.Tensor,
        offset: torch.Tensor,
    ) -> None:
        """check_pages mode: raise for bad ids and colliding write slots (syncs)."""
        jobs = dplan.jobs
        off = offset[: jobs.total].cpu().numpy()  # the documented sync of this mode
        pg = page[: jobs.total].cpu().numpy()
        bad = np.flatnonzero(off < 0)
        if bad.size:
            self._raise_bad(dplan, spec, table, int(bad[0]), "is not a valid page id")
        for r in jobs.regions:
            if r.name.startswith("pages/"):
                continue
            flat = pg[r.lo : r.hi].astype(np.int64) * spec.page_size + off[r.lo : r.hi]
            order = np.argsort(flat, kind="stable")
            same = np.flatnonzero(flat[order[1:]] == flat[order[:-1]])
            if same.size:
                entry = r.lo + int(order[same[0] + 1])
                self._raise_bad(dplan, spec, table, entry, "is a cache slot another token writes")

    def _raise_bad(
        self, dplan: DevicePlan, spec: PlanSpec, table: PageTable, entry: int, what: str
    ) -> None:
        jobs = dplan.jobs
        job = int(np.searchsorted(jobs.dst, entry, side="right")) - 1
        region = next(r for r in jobs.regions if r.lo <= entry < r.hi)
        request = job % max(spec.batch_size, 1)
        raise PageTableError(
            "pages",
            f"an entry the plan gathers for {region.name!r} {what}",
            request=request,
            row=int(table.rows[request]),
        )

    def _check_cache_pages(self, args: RunArgs, group: AttentionGroup, num_pages: int) -> None:
        """check_pages mode: every id this run reads or writes is inside the cache."""
        assert self._plan is not None and self._gathered is not None and self._spec is not None
        page = self._gathered[0]
        names = []
        if args.plan.paged is not None:
            names.append(f"pages/{args.index}")
        if args.writes:
            names.append(self._write_region(group).name)
        for name in names:
            r = self._plan.jobs.region(name)
            ids = page[r.lo : r.hi]
            if r.size and int(ids.max()) >= num_pages:  # the documented sync of this mode
                entry = r.lo + int(torch.argmax((ids >= num_pages).to(torch.int8)))
                assert self._table is not None
                self._raise_bad(
                    self._plan, self._spec, self._table, entry,
                    f"is beyond the KV cache's {num_pages} pages",
                )  # fmt: skip

    def _check_run(
        self,
        group: object,
        q: object,
        k_new: object,
        v_new: object,
        kv_cache: object,
        return_lse: object,
        sinks: object = None,
    ) -> RunArgs:
        return check_run_args(
            self._spec, self.device, group, q, k_new, v_new, kv_cache, return_lse, sinks=sinks
        )

    def _write_region(self, group: AttentionGroup) -> Region:
        assert self._plan is not None
        if group.cross_attention:
            return self._plan.jobs.region("encoder")
        if self.page_map is not None and group.uses_window_pool:
            return self._plan.jobs.region("write/window")
        return self._plan.jobs.region("write")

    # -- run ----------------------------------------------------------------------------
    @overload
    def run(
        self,
        group: AttentionGroup,
        q: torch.Tensor,
        k_new: torch.Tensor | None,
        v_new: torch.Tensor | None,
        kv_cache: torch.Tensor | None,
        *,
        return_lse: Literal[False] = False,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    @overload
    def run(
        self,
        group: AttentionGroup,
        q: torch.Tensor,
        k_new: torch.Tensor | None,
        v_new: torch.Tensor | None,
        kv_cache: torch.Tensor | None,
        *,
        return_lse: Literal[True],
        sinks: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def run(
        self,
        group: AttentionGroup,
        q: torch.Tensor,
        k_new: torch.Tensor | None,
        v_new: torch.Tensor | None,
        kv_cache: torch.Tensor | None,
        *,
        return_lse: bool = False,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attention of one layer of ``group`` on FlashInfer kernels.

        Arguments and results as :meth:`flashplan.ReferenceExecutor.run`: ``q``
        ``[total_q, num_qo_heads, head_dim]``, ``k_new``/``v_new``
        ``[total_q, num_kv_heads, head_dim]`` (encoder rows for a cross group, or
        ``None``), ``kv_cache`` ``[num_pages, 2, page_size, num_kv_heads, head_dim]``
        (contiguous; ``None`` for a ragged-path group); returns ``out`` and, with
        ``return_lse``, float32 base-2 LSE ``[total_q, num_qo_heads]``. A sink
        group takes its sink logits as ``sinks`` (float32 ``[num_qo_heads]``); they count
        once and the LSE includes them. The one call the plan marks applies them: a
        decode or paged-only prefill on FlashInfer's own sink kernel (its sink wrapper,
        FA2; :func:`~flashplan.executor.flashinfer.calls.sink_kernel`), otherwise a
        fold into the call's or the merged state on the device (a value-0 key of logit
        ``sinks[h]``, :func:`~flashplan.kernels.merge_state.fold_sinks_triton`). They
        are never passed to a kernel that ignores them.

        Raises:
            PlanMismatchError: the group was not planned, or a tensor's type, shape,
                dtype or device contradicts the plan.
            PageTableError: ``check_pages`` mode, an id outside the cache.
        """
        args = self._check_run(group, q, k_new, v_new, kv_cache, return_lse, sinks)
        spec, dplan = self._spec, self._plan
        assert spec is not None and dplan is not None and self._gathered is not None
        if kv_cache is not None and not kv_cache.is_contiguous():
            raise PlanMismatchError("kv_cache", "FlashInfer needs a contiguous cache tensor")
        assert isinstance(group, AttentionGroup)
        if self.check_pages and kv_cache is not None:
            self._check_cache_pages(args, group, int(kv_cache.shape[0]))
        gc = dplan.calls[args.index]
        if args.writes:
            assert kv_cache is not None and k_new is not None and v_new is not None
            r = self._write_region(group)
            page, offset = self._gathered
            write_kv(
                kv_cache, k_new, v_new, page[r.lo : r.hi], offset[r.lo : r.hi],
                status=self._status,
            )  # fmt: skip
        if q.shape[0] == 0:
            out = q.new_zeros(q.shape, dtype=spec.heads.out_dtype)
            lse = torch.full(q.shape[:2], -math.inf, dtype=torch.float32, device=q.device)
            return (out, lse) if return_lse else out
        # A sink group's sink joins its state once (the plan names one call): inside
        # FlashInfer's sink kernel where the paged call runs on it, else folded in the
        # merge of the group's two states, or in one pass over its one state.
        in_kernel = gc.paged is not None and gc.paged.wrapper.sink is not None
        fold = None if in_kernel else sinks
        want_lse = return_lse or gc.merges or fold is not None
        states = []
        if gc.ragged is not None:
            wrapper = self._planned[(args.index, "ragged")]
            states.append(wrapper.run(q, k_new, v_new, return_lse=want_lse))
        if gc.paged is not None:
            wrapper = self._planned[(args.index, "paged")]
            if in_kernel:  # the sink wrapper's run(q, cache, sinks, sm_scale)
                scale = group.scale_for(spec.heads.head_dim)
                states.append(wrapper.run(q, kv_cache, sinks, scale, return_lse=want_lse))
            else:
                states.append(wrapper.run(q, kv_cache, return_lse=want_lse))
        if gc.merges:
            (o_a, s_a), (o_b, s_b) = states
            out, lse = merge_state_triton(o_a, s_a, o_b, s_b, sinks=fold)
        elif fold is not None:
            o, lse_o = states[0]
            out, lse = fold_sinks_triton(o, lse_o, fold)
        elif return_lse:
            return states[0]
        else:
            return states[0][0] if want_lse else states[0]
        return (out, lse) if return_lse else out
