"""Buffers the FlashInfer executor keeps across batches (allocated once, grown
geometrically, never per call).

* :class:`PinnedRing`: pinned host staging slots. A slot is handed out only when the
  copies that read it last have completed (its mark on the executor's
  :class:`~flashplan.executor.flashinfer.timeline.Timeline` has passed: read without
  waiting); when every slot is busy the ring grows instead of waiting.
* :class:`DeviceBuffer`: a device tensor that grows to the largest size asked for.
* :class:`SliceViews`: the named views of a staging buffer, made once per layout.
* :class:`WrapperPool`: FlashInfer wrappers, never re-planned while a queued copy of
  their previous plan may still read their pinned buffer.

Everything else is stream-ordered: the executor issues every copy, gather and kernel
on the current stream, so a device buffer is rewritten only after the kernels that
read it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import torch

from flashplan.executor.flashinfer.caches import LayoutMemo

if TYPE_CHECKING:
    from flashplan.executor.flashinfer.staging import StagingManifest
    from flashplan.executor.flashinfer.timeline import Timeline

__all__ = [
    "DeviceBuffer",
    "PinnedRing",
    "PinnedSlot",
    "SliceViews",
    "StagedViews",
    "WrapperPool",
    "WrapperSlot",
]


def _grown(current: int, needed: int) -> int:
    return max(needed, 2 * current, 1024)


@attrs.define(eq=False)
class PinnedSlot:
    """One pinned int32 staging buffer (``host``; ``array`` is its numpy view) and the
    mark after its last reader.

    Attributes:
        mark: the generation of the :class:`~flashplan.executor.flashinfer.timeline.Timeline`
            mark after the copy that read the slot last (taken once the copy is queued:
            ``Timeline.upcoming``); 0 before any.
    """

    host: torch.Tensor
    mark: int = 0
    array: np.ndarray = attrs.field(init=False, repr=False)
    capacity: int = attrs.field(init=False)  # entries the slot holds

    def __attrs_post_init__(self) -> None:
        self.replace(self.host)

    def replace(self, host: torch.Tensor) -> None:
        """Hold ``host`` (pinned, 1-D) from now on: its numpy view (writes land in the
        pinned memory) and size."""
        self.host = host
        self.array = host.numpy()
        self.capacity = int(host.shape[0])


class PinnedRing:
    """A ring of pinned staging slots (see module docstring).

    Args:
        timeline: the owner's marks (a slot is idle once its mark has passed).
        dtype: element type of the slots.
    """

    def __init__(self, timeline: Timeline, dtype: torch.dtype = torch.int32) -> None:
        self.timeline = timeline
        self.dtype = dtype
        self.slots: list[PinnedSlot] = []

    def acquire(self, size: int) -> PinnedSlot:
        """An idle slot of at least ``size`` entries: an idle one that is big enough,
        else an idle one regrown, else a new one. Never waits for the GPU."""
        passed = self.timeline.passed
        for slot in self.slots:
            if passed(slot.mark) and slot.capacity >= size:
                return slot
        for slot in self.slots:
            if passed(slot.mark):
                slot.replace(
                    torch.empty(_grown(slot.capacity, size), dtype=self.dtype, pin_memory=True)
                )
                return slot
        largest = max((s.capacity for s in self.slots), default=0)
        slot = PinnedSlot(torch.empty(_grown(largest, size), dtype=self.dtype, pin_memory=True))
        self.slots.append(slot)
        return slot


class DeviceBuffer:
    """A device tensor of ``dtype`` that grows to the largest size asked for.

    A regrown buffer is a new allocation: the old one goes back to torch's caching
    allocator, which reuses it only after the kernels queued on it.
    """

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device = device
        self.dtype = dtype
        self.tensor = torch.empty(0, dtype=dtype, device=device)

    def get(self, size: int) -> torch.Tensor:
        """The first ``size`` entries of the buffer (grown if needed)."""
        return self.reserve(size)[:size]

    def reserve(self, size: int) -> torch.Tensor:
        """The whole buffer, grown to at least ``size`` entries if needed (no slicing:
        for readers that take their bounds from elsewhere)."""
        if self.tensor.shape[0] < size:
            self.tensor = torch.empty(
                _grown(self.tensor.shape[0], size), dtype=self.dtype, device=self.device
            )
        return self.tensor


class StagedViews(dict[str, torch.Tensor]):
    """Name -> view of one tensor's slice, each made on its first lookup.

    Attributes:
        tensor: the staging tensor the views share memory with.
        manifest: its named slices.
        memo: what an owner derives from these views and keeps as long as they are
            kept, each entry under a key of everything else it depends on
            (:class:`~flashplan.executor.flashinfer.caches.LayoutMemo`).
    """

    __slots__ = ("manifest", "memo", "tensor")

    def __init__(self, tensor: torch.Tensor, manifest: StagingManifest) -> None:
        super().__init__()
        self.tensor = tensor
        self.manifest = manifest
        self.memo = LayoutMemo()

    def __missing__(self, name: str) -> torch.Tensor:
        s = self.manifest[name]
        view = self[name] = self.tensor[s.offset : s.offset + s.size]
        return view


class SliceViews:
    """Views of the named slices of staging tensors, kept per (tensor, manifest).

    A step loop stages the same few layouts (manifests are memoized on their names and
    sizes) into the same few buffers (the pinned ring's slots, the device copy), and a
    torch slice costs microseconds of host time: a slice's view is made at its first
    lookup and handed out again after. A pair met once (a batch size not seen before)
    costs only the views it uses, as plain slicing would. At most ``capacity`` pairs are
    kept (the oldest dropped); an entry holds its tensor, so its ``id`` is not reused
    while kept.
    """

    def __init__(self, capacity: int = 8) -> None:
        self.capacity = capacity
        self._entries: dict[tuple[int, StagingManifest], StagedViews] = {}

    def of(self, tensor: torch.Tensor, manifest: StagingManifest) -> StagedViews:
        """Each slice of ``manifest`` as a view of ``tensor`` (1-D, at least
        ``manifest.total`` entries), by name."""
        key = (id(tensor), manifest)
        views = self._entries.get(key)
        if views is not None and views.tensor is tensor:
            return views
        views = StagedViews(tensor, manifest)
        if len(self._entries) >= self.capacity:
            del self._entries[next(iter(self._entries))]
        self._entries[key] = views
        return views


@attrs.define(eq=False)
class WrapperSlot:
    """One FlashInfer wrapper and the mark after the copies of its last ``plan()``.

    Attributes:
        wrapper: the FlashInfer wrapper.
        mark: the generation of the timeline mark after the copies of its last
            ``plan()`` or re-plan (``Timeline.upcoming`` once they are queued); 0:
            never planned.
        fixed: device buffers the wrapper was made with and reads at run time, by name
            (a graph-mode decode wrapper's ``"indptr"`` int32 ``[bs + 1]`` and
            ``"last_page_len"`` int32 ``[bs]``); for an eager prefill wrapper whose
            field a re-plan pointed at the staging buffer, its own ``"kv_lens"`` buffer
            (:func:`~flashplan.executor.flashinfer.adapter.restore_own_buffers`).
        planned_with: the constant ``plan()`` arguments of its last full ``plan()``
            (:attr:`~flashplan.executor.flashinfer.calls.PlanCall.constants`), which
            fixed its compiled module; ``None`` before one, or after one that failed.
        replannable: whether its last full ``plan()`` took the path a prefill re-plan
            re-creates (:func:`~flashplan.executor.flashinfer.adapter.replannable`).
        scheduled: what the scheduler's last run on this wrapper read (its last full
            ``plan()`` or a later re-plan): ``(spec, arrays)`` — the plan (PlanSpec) it
            came from and the bytes of the int32 host arrays it read (a CUDA-core
            decode's page indptr; a paged prefill's ``qo_indptr``, page indptr and KV
            lengths; ``None`` for a tensor-core decode, compared by plan object only);
            ``None`` before one (see ``wrapper_plans``).
        plan_inputs: (eager) what its last full ``plan()`` read (``wrapper_plans``):
            a call with the same inputs keeps that plan and calls nothing.
        info_flags: the wrapper's plan info object last read and what was read of it
            (:func:`~flashplan.executor.flashinfer.adapter.plan_flags`).
    """

    wrapper: Any
    mark: int = 0
    fixed: dict[str, torch.Tensor] = attrs.field(factory=dict)
    planned_with: tuple[tuple[str, Any], ...] | None = None
    replannable: bool = False
    scheduled: tuple[object, tuple[bytes, ...] | None] | None = None
    plan_inputs: tuple[tuple[str, Any], ...] | None = None
    info_flags: tuple[Any, int, int, bool, bool] | None = None


class WrapperPool:
    """Wrappers by key, several per key when the host plans ahead of the GPU.

    FlashInfer's ``plan()`` writes the plan into the wrapper's pinned host buffer at
    once and queues its copy to the device: planning the same wrapper again before
    that copy has run would overwrite what the queued copy reads (and the kernels of
    the earlier batch would run with the later plan). So a wrapper is re-planned only
    once its previous plan's copies have completed (its mark on the owner's timeline
    has passed: read without waiting);
    when every wrapper of a key is busy, the pool makes another one instead of
    waiting (each holds FlashInfer's 8 MiB device and 8 MiB pinned int workspaces), up
    to ``max_per_key`` wrappers; past that the host is that many steps ahead of the GPU
    and the pool waits for the oldest plan's copies (making more would only cost memory
    and allocation time: measured on an H200, 16 wrappers per key slowed a step by 25%).

    With ``grow=False`` (CUDA graphs: the captured kernels read one wrapper's buffers)
    the pool keeps one wrapper per key and waits for its previous plan's copies — a
    wait only when the host runs a whole step ahead of the GPU on the same bucket.
    """

    def __init__(self, timeline: Timeline, *, grow: bool = True, max_per_key: int = 4) -> None:
        self.timeline = timeline
        self.grow = grow
        self.max_per_key = max_per_key if grow else 1
        self.slots: dict[Any, list[WrapperSlot]] = {}

    def acquire(self, key: Any, make: Callable[..., WrapperSlot], *args: Any) -> WrapperSlot:
        """An idle wrapper for ``key`` (``make(*args)`` makes a new slot when needed)."""
        slots = self.slots.setdefault(key, [])
        passed = self.timeline.passed
        for slot in slots:
            if passed(slot.mark):
                return slot
        if len(slots) >= self.max_per_key:
            slot = slots.pop(0)  # the oldest plan: the first whose copies will be done
            slots.append(slot)
            self.timeline.wait(slot.mark)  # documented: the host is max_per_key steps ahead
            return slot
        slot = make(*args)
        slots.append(slot)
        return slot

    def mark_planned(self, slot: WrapperSlot) -> None:
        """Note that the copies of ``slot``'s plan are queued: the owner's next timeline
        mark (recorded after them) is the one that frees it."""
        slot.mark = self.timeline.upcoming
