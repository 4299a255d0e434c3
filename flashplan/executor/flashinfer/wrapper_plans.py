"""Planning the FlashInfer wrappers of a batch: every call's ``plan()`` (or its fast
re-plan through the compiled scheduler, :mod:`~flashplan.executor.flashinfer.adapter`).

A call's arguments are resolved once per call, staging layout and pinned slot
(:class:`~flashplan.executor.flashinfer.caches.BoundCall`); per batch only the
placeholders that change (gathered page ids, built masks, the batch's ints,
multi-item tensors) are resolved.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

import flashplan.executor.flashinfer.names as names
from flashplan.errors import UnsupportedError
from flashplan.executor.flashinfer.adapter import (
    adopt_schedule,
    replan_decode,
    replan_prefill,
    replannable,
    restore_own_buffers,
    schedule_stands,
    unsplit_schedule,
)
from flashplan.executor.flashinfer.caches import BoundCall, BoundCallKey, DecodeViews, PrefillViews
from flashplan.executor.flashinfer.calls import (
    BatchInt,
    BuiltMask,
    DeviceIndices,
    GroupCalls,
    HostArray,
    ItemPositions,
    PlanCall,
    StagedArray,
    WrapperKind,
)
from flashplan.executor.flashinfer.device_work import fill_item_positions, region_view
from flashplan.executor.flashinfer.replan_arrays import DecodeArrays, PrefillArrays

if TYPE_CHECKING:
    from flashplan.executor.flashinfer.buffers import StagedViews, WrapperSlot
    from flashplan.executor.flashinfer.staging import DevicePlan
    from flashplan.executor.flashinfer.strategy import BuffersStrategy
    from flashplan.planning.spec import PlanSpec

__all__ = [
    "Planned", "Slots", "bound_call", "call_plan", "level_part", "plan_calls", "plan_step_calls",
]  # fmt: skip

#: The planned wrapper of each call, by ``(group index, "paged" | "ragged" | "level<k>")``.
Planned = dict[tuple[int, str], Any]
#: The wrapper slot of each call, by the same keys.
Slots = dict[tuple[int, str], "WrapperSlot"]

#: torch dtypes of the staged views handed to plan() (the multi-item tensors).
_VIEW_DTYPES = {"uint32": torch.uint32, "uint16": torch.uint16}


def bound_call(
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
    decode: DecodeViews | None = None
    prefill: PrefillViews | None = None
    mask_indptr = None
    level = call.wrapper.level
    # a cascade level's call has its own arrays and integers (``l<k>.*``)
    array = partial(names.group_array, index) if level < 0 else partial(names.level_array, level)
    integer = partial(names.group_int, index) if level < 0 else partial(names.level_int, level)
    max_kv = integer("max_kv_len", prefix)
    ints = (names.batch_int("qo.total", prefix), names.batch_int("qo.max_len", prefix), max_kv)
    ind = array("page_indptr", prefix)
    last = array("last_page_len", prefix)
    kv = array("kv_lens", prefix)
    if call.wrapper.kind is WrapperKind.DECODE:
        if call.wrapper.use_tensor_cores:  # the scheduler's qo_indptr and KV lengths
            qo = prefix + names.QO_INDPTR
            decode = (host[ind], staged[ind], host[last], staged[last],
                      host[qo], staged[qo], host[kv])  # fmt: skip
        else:
            decode = (host[ind], staged[ind], host[last], staged[last], None, None, None)
    elif call.wrapper.kind is WrapperKind.PAGED_PREFILL:
        qo_name = next(
            v.name for n, v in call.placeholders if n == "qo_indptr" and isinstance(v, HostArray)
        )
        qo = prefix + qo_name
        prefill = (host[qo], staged[qo], host[ind], staged[ind], staged[last],
                   host[kv], staged[kv])  # fmt: skip
        if any(isinstance(v, BuiltMask) for _, v in call.placeholders):
            mask_indptr = staged[names.mask_name(index, "indptr", prefix)]
        if qo_name != names.QO_INDPTR:  # virtual requests or a level: their own integers
            ints = (integer("qo.total", prefix), integer("qo.max_len", prefix), max_kv)
    inputs: tuple[np.ndarray, ...] | None = None
    if decode is not None and decode[4] is None:  # a CUDA-core decode: its page indptr
        inputs = (decode[0].numpy(),)
    elif prefill is not None:  # qo_indptr, the page indptr, the KV lengths
        inputs = (prefill[0].numpy(), prefill[2].numpy(), prefill[5].numpy())
    indices = next((v for n, v in dynamic if n == "indices"), None) if decode else None
    bound = BoundCall(
        host, kwargs, tuple(dynamic), decode, prefill, mask_indptr, ints, inputs, indices
    )
    staged.memo.calls[memo_key] = bound
    return bound


def _schedule_changed(held: WrapperSlot, spec: PlanSpec, bound: BoundCall, num_sm: int) -> bool:
    """Whether a re-plan must run the scheduler: not when its inputs equal those of the
    scheduler's last run on this wrapper (whose plan, ``_plan_info`` and the int
    workspace, then stands), nor when that run's schedule is the one the scheduler gives
    these queries whatever the KV lengths (``adapter.schedule_stands`` on a device of
    ``num_sm`` multiprocessors: a batch of more query tiles than FlashInfer ever splits;
    a tensor-core decode or a paged prefill, not a CUDA-core decode).

    The inputs are fixed by the call's constants (equal: the caller checked
    ``planned_with``) and the host arrays the scheduler reads. The same plan object has
    the same arrays; otherwise the values of :attr:`BoundCall.schedule_inputs` (numpy
    views of the pinned int32 host arrays: a CUDA-core decode's page indptr; a paged
    prefill's ``qo_indptr``, page indptr and KV lengths) are compared, as bytes: a few
    hundred nanoseconds for arrays of a batch (a decode loop changes a CUDA-core
    decode's page indptr once per page of new tokens; a cascade level's arrays stay the
    same while its sharing does). A tensor-core decode has none (its KV lengths change
    at every step of a decode loop: comparing them would cost more than it saves): its
    queries are one per request, so the batch size stands for them. Records the inputs
    when the scheduler runs.
    """
    last = held.scheduled
    if last is not None and last[0] is spec:
        return False
    decode = bound.decode
    if decode is not None and decode[4] is not None:  # a tensor-core decode
        bs = decode[2].shape[0]
        if last is not None and schedule_stands(held, bound.kwargs, bs, num_sm, bs):
            return False
    data = _input_bytes(bound)
    if data is not None and last is not None and last[1] is not None:
        if last[1] == data:
            return False
        qo = bound.schedule_inputs[0] if bound.schedule_inputs is not None else None
        if (
            bound.prefill is not None
            and qo is not None
            and last[1][0] == data[0]  # the same queries (qo_indptr)
            # each request with a query is a query tile or more; the batch size bounds
            # them: checked first, without the diff
            and schedule_stands(held, bound.kwargs, qo.shape[0] - 1, num_sm)
            and schedule_stands(held, bound.kwargs, int(np.count_nonzero(np.diff(qo))), num_sm)
        ):
            return False
    held.scheduled = (spec, data)
    return True


def _input_bytes(bound: BoundCall) -> tuple[bytes, ...] | None:
    """The scheduler inputs' bytes (int32: equal bytes are equal values of equal
    length), as :attr:`WrapperSlot.scheduled` keeps them (``None``: not compared)."""
    inputs = bound.schedule_inputs
    return None if inputs is None else tuple([a.tobytes() for a in inputs])


#: dtypes of the host tensors ``plan()`` reads (indptrs, lengths, masks' bytes).
_HOST_DTYPES = frozenset({torch.int32, torch.int64, torch.uint8, torch.bool})


def _plan_inputs(kwargs: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """What a full ``plan()`` read, to tell whether the next call's would be the same:
    per argument in order, a host tensor's bytes (pinned views of another ring slot
    hold equal values), a device tensor itself (compared by identity: the staged views,
    gathered regions and built masks are the same objects while their layout is, and
    their contents are rewritten before the kernels run), any other value as it is."""
    out = []
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            if value.device.type == "cpu" and value.dtype in _HOST_DTYPES:
                value = (value.dtype, value.numpy().tobytes())
            else:
                value = _Same(value)
        out.append((name, value))
    return tuple(out)


class _Same:
    """A device tensor compared by identity (it holds the tensor: no reused id)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.tensor is self.tensor

    __hash__ = None  # type: ignore[assignment]


def _same_plan_inputs(last: tuple[tuple[str, Any], ...] | None, kwargs: dict[str, Any]) -> bool:
    """Whether ``kwargs`` are the inputs of the wrapper's last full ``plan()``
    (:func:`_plan_inputs`): then its plan — the scheduler's work partition, the device
    copies of the indptrs — stands, and an eager wrapper is not planned again (its
    kernels read the gathered ids and built masks, rewritten in place, at run time)."""
    return last is not None and last == _plan_inputs(kwargs)


def plan_calls(
    strategy: BuffersStrategy,
    spec: PlanSpec,
    calls: tuple[GroupCalls, ...],
    dplan: DevicePlan,
    host: StagedViews,
    staged: StagedViews,
    page: torch.Tensor,
    masks: dict[int, torch.Tensor],
    prefix: str = "",
    leaders: Slots | None = None,
    slots: Slots | None = None,
) -> Planned:
    """Plan every wrapper of ``calls`` (of ``spec``); placeholders resolve against the views of the
    staged host slot (``host``) and of its device copy (``staged``), the gathered page
    ids and the built masks (names under ``prefix``: a multi-step draft's step).

    A wrapper whose last full ``plan()`` had the call's constants is re-planned through
    the compiled scheduler where the settings allow (decode; eager FA2 paged prefill);
    otherwise ``plan()`` runs. ``leaders``: (a multi-step draft's other steps) the slots
    that planned the same calls of another step of this batch size: an eager decode
    re-plan whose leader's schedule is unsplit runs on it instead of the scheduler
    (``adapter.adopt_schedule``). ``slots``: filled with each call's slot.
    """
    settings, owned = strategy.settings, strategy.owned
    counts = owned.counts

    def resolve(value: Any) -> Any:
        if isinstance(value, StagedArray):
            # A typed view of the persistent device staging buffer: FlashInfer keeps it
            # for run(); it stays valid until the next apply rewrites the buffer.
            words = staged[prefix + value.name]
            return words.view(_VIEW_DTYPES[value.dtype])[: dplan.elements[prefix + value.name]]
        if isinstance(value, BatchInt):
            return dplan.ints[prefix + value.name]
        if isinstance(value, DeviceIndices):
            return region_view(staged, page, dplan.jobs.region(prefix + value.region))
        if isinstance(value, BuiltMask):
            return masks[value.group_index]
        if isinstance(value, ItemPositions):
            return fill_item_positions(owned, dplan, staged, prefix + value.name)
        raise AssertionError(f"unresolved placeholder {value!r}")  # pragma: no cover

    planned: Planned = {}
    for gc in calls:
        for part, call in _calls_of(gc):
            if call is None:
                continue
            key, index = call.wrapper, gc.group_index
            held = owned.pool.acquire((prefix, key), strategy.make_wrapper, key, index, prefix)
            bound = bound_call(call, host, staged, prefix, index, part)
            if strategy.graph and strategy.captured is None and bound.decode and held.fixed:
                owned.refresh[(prefix, key)] = (
                    (held.fixed["indptr"], bound.decode[1]),
                    (held.fixed["last_page_len"], bound.decode[3]),
                )
            same_constants = held.planned_with is call.constants or (
                held.planned_with == call.constants  # None before a full plan()
            )
            if (
                settings.fast_decode
                and bound.decode is not None
                and key.sink is None  # a sink wrapper's JIT module: plan() each time
                and same_constants
            ):
                # a decode re-plan's one per-batch argument: the gathered page ids (it
                # reads only constants from the bound arguments)
                arrays = DecodeArrays(*bound.decode, resolve(bound.decode_indices))
                leader = None if leaders is None else leaders.get((index, part))
                shared = (
                    leader is not None
                    and not strategy.graph
                    and leader.planned_with == call.constants
                    and unsplit_schedule(leader)
                )
                schedule = not shared and _schedule_changed(held, spec, bound, settings.num_sm)
                replan_decode(
                    held, bound.kwargs, arrays, graph=strategy.graph, schedule=schedule,
                    refresh=strategy.captured is None,  # else the graph copies them
                )  # fmt: skip
                if shared:
                    assert leader is not None
                    adopt_schedule(held, leader)
                    held.scheduled = None  # its own scheduler's last plan is not what runs
                    counts.schedules_shared += 1
                counts.decode_replans += 1
                held.plan_inputs = None  # the wrapper now holds this re-plan
                counts.schedules_kept += not schedule and not shared
                owned.pool.mark_planned(held)
                planned[(index, part)] = held.wrapper
                if slots is not None:
                    slots[(index, part)] = held
                continue
            kwargs = dict(bound.kwargs)
            for name, value in bound.dynamic:
                kwargs[name] = resolve(value)
            if (
                strategy.fast_prefill
                and bound.prefill is not None
                and held.replannable  # its last full plan() took replan_prefill's path
                and same_constants
            ):
                ints = dplan.ints
                total, max_q, max_kv = bound.prefill_ints
                prefill = PrefillArrays(
                    *bound.prefill, indices=kwargs["paged_kv_indices"],
                    mask_indptr_device=bound.mask_indptr, total_rows=ints[total],
                    max_q_len=ints[max_q], max_kv_len=ints[max_kv],
                )  # fmt: skip
                schedule = _schedule_changed(held, spec, bound, settings.num_sm)
                replan_prefill(held, kwargs, prefill, schedule=schedule)
                counts.prefill_replans += 1
                held.plan_inputs = None
                counts.schedules_kept += not schedule
            elif (
                settings.fast_plan
                and not strategy.graph
                and key.sink is None  # a sink wrapper's JIT module: not checked, plan()
                and same_constants
                and _same_plan_inputs(held.plan_inputs, kwargs)
            ):
                counts.plans_kept += 1  # plan() on these very inputs stands
            else:
                held.planned_with = None  # until this plan() succeeds
                held.replannable = False
                held.scheduled = None
                held.plan_inputs = None
                restore_own_buffers(held)
                call_plan(held.wrapper, kwargs, settings.workspace_bytes)
                held.planned_with = call.constants
                if not strategy.graph:
                    held.plan_inputs = _plan_inputs(kwargs)
                if bound.decode is not None or bound.prefill is not None:
                    # plan() ran the scheduler on these inputs
                    held.scheduled = (spec, _input_bytes(bound))
                # what replannable() reads is fixed by the constructor, the constant
                # arguments and this plan(): checked once per full plan()
                held.replannable = bound.prefill is not None and replannable(held.wrapper, kwargs)
                counts.full += 1
            owned.pool.mark_planned(held)
            planned[(index, part)] = held.wrapper
            if slots is not None:
                slots[(index, part)] = held
    return planned


def plan_step_calls(
    strategy: BuffersStrategy,
    steps: list[tuple[PlanSpec, tuple[GroupCalls, ...]]],
    dplan: DevicePlan,
    host: StagedViews,
    staged: StagedViews,
    page: torch.Tensor,
    prefixes: list[str],
) -> list[Planned]:
    """:func:`plan_calls` of every step of a multi-step draft (``steps``: each step's
    plan and calls; its names under ``prefixes[k]``), the last step first: a step of its
    batch size then runs its eager decode calls on the last step's schedule where that
    is unsplit (``leaders``), one scheduler run instead of one per step. The last step
    reads the most keys, so its schedule's work items cover every step's (an unsplit
    schedule's kernels take each KV length from the step's own indptr anyway)."""
    last = len(steps) - 1
    leaders: Slots = {}
    planned: dict[int, Planned] = {}
    for k in (last, *range(last)):
        spec, calls = steps[k]
        follows = k != last and spec.batch_size == steps[last][0].batch_size
        planned[k] = plan_calls(
            strategy, spec, calls, dplan, host, staged, page, {}, prefixes[k],
            leaders=leaders if follows else None, slots=leaders if k == last else None,
        )  # fmt: skip
    return [planned[k] for k in range(len(steps))]


def _calls_of(gc: GroupCalls) -> list[tuple[str, PlanCall | None]]:
    """A group's calls by part name: ``"paged"``, ``"ragged"``, then its cascade levels'
    (``"level<k>"``, :func:`level_part`)."""
    parts: list[tuple[str, PlanCall | None]] = [("paged", gc.paged), ("ragged", gc.ragged)]
    parts += [(level_part(k), call) for k, call in enumerate(gc.levels)]
    return parts


def level_part(level: int) -> str:
    """The part name of cascade level ``level``'s call in :data:`Planned`."""
    return f"level{level}"


def call_plan(wrapper: Any, kwargs: dict[str, Any], workspace_bytes: int) -> None:
    """``wrapper.plan(**kwargs)``; a workspace too small for it raises
    :class:`~flashplan.UnsupportedError` naming ``workspace_bytes``."""
    try:
        wrapper.plan(**kwargs)
    except RuntimeError as exc:
        text = str(exc).lower()
        if "workspace" in text or "buffer size" in text or "out of memory" in text:
            raise UnsupportedError(
                "workspace_bytes",
                f"FlashInfer's plan() needs more workspace than this executor has ({exc}); "
                "construct the executor with a larger workspace_bytes",
                workspace_bytes=workspace_bytes,
            ) from exc
        raise
