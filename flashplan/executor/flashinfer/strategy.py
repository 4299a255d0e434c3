"""The buffers strategy of a FlashInfer executor: who owns every buffer and cache.

An executor is one facade (:class:`~flashplan.executor.flashinfer.FlashInferExecutor`)
over a strategy that decides where the batch's device data lives:

* :class:`~flashplan.executor.flashinfer.eager.EagerBuffers`: buffers that grow to the
  largest batch, wrappers made on demand (several per key while the host plans ahead of
  the GPU);
* :class:`~flashplan.executor.flashinfer.graph_buffers.GraphBuffers`: the fixed buffers
  and graph-mode wrappers of one CUDA-graph bucket, sized by a
  :class:`~flashplan.executor.flashinfer.bucket.GraphBucket`.

Both own an :class:`OwnedBuffers` (the pinned staging ring, the device staging copy,
the wrapper pool, the call skeletons, …); the executor's steps (stage, gather, plan,
run) are the same functions over either.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import attrs
import torch

from flashplan.executor.flashinfer.buffers import DeviceBuffer, PinnedRing, SliceViews, WrapperPool
from flashplan.executor.flashinfer.timeline import Timeline
from flashplan.kernels.fused import direct_launcher
from flashplan.kernels.gather import new_status

if TYPE_CHECKING:
    from flashplan.executor.checks import RunArgs
    from flashplan.executor.flashinfer.adapter import DirectLaunch
    from flashplan.executor.flashinfer.bound_table import BoundTable, CapturedWork
    from flashplan.executor.flashinfer.bucket import GraphBucket
    from flashplan.executor.flashinfer.buffers import WrapperSlot
    from flashplan.executor.flashinfer.calls import GroupCalls, WrapperKey
    from flashplan.executor.flashinfer.paged_lane import PagedLane
    from flashplan.executor.flashinfer.settings import ExecutorSettings
    from flashplan.executor.flashinfer.staging import DevicePlan
    from flashplan.kernels.fused import BoundGatherAndMask
    from flashplan.layout.page_table import PageTable
    from flashplan.planning.spec import PlanSpec

__all__ = ["BuffersStrategy", "OwnedBuffers", "PlanCounts"]


@attrs.define
class PlanCounts:
    """FlashInfer planning calls made so far, by route.

    Attributes:
        full: full ``plan()`` calls.
        decode_replans: decode re-plans through the compiled scheduler.
        prefill_replans: paged prefill re-plans through the compiled scheduler.
        plans_kept: (eager) full ``plan()`` calls skipped: the wrapper's last ``plan()``
            read the same inputs (an FA3 cascade level while the sharing holds).
        schedules_kept: re-plans that kept the scheduler's last plan (its inputs
            unchanged, or a tensor-core decode batch too large to split:
            ``wrapper_plans``).
        schedules_shared: decode re-plans of a multi-step draft's step that ran on
            another step's unsplit schedule instead of the scheduler
            (``adapter.adopt_schedule``).
    """

    full: int = 0
    decode_replans: int = 0
    prefill_replans: int = 0
    schedules_kept: int = 0
    plans_kept: int = 0
    schedules_shared: int = 0


@attrs.define(eq=False)
class OwnedBuffers:
    """Every buffer and cache an executor keeps between applies (see
    :mod:`~flashplan.executor.flashinfer.caches` for each one's key).

    Args:
        device: the executor's CUDA device.
        grow: whether the wrapper pool may hold several wrappers per key (eager) or
            one (CUDA graphs: :class:`~flashplan.executor.flashinfer.buffers.WrapperPool`).

    Attributes:
        timeline: the marks after each apply's queued work, by which the staging ring
            and the pool tell idle slots and wrappers from busy ones.
        pool: FlashInfer wrappers by ``(step prefix, WrapperKey)``.
        skeletons: call skeletons by their static key.
        lanes: each skeleton's paged lane (``None``: the general translation), by the
            skeleton tuple's ``id`` (the entry holds the tuple).
        ring: pinned host staging slots.
        staged: the device copy of the staging data (int32).
        views: the named views of staging tensors, per tensor and manifest.
        out_page: gathered page ids (int32, eager strategy).
        out_offset: gathered in-page offsets (int32, eager strategy).
        mask_bufs: built custom masks (uint8) per group index (eager strategy).
        item_bufs: multi-item ``token_pos_in_items`` (int16 bytes of uint16) per name.
        runs_staged: the staged position runs (int32).
        positions: the applied plan's RoPE positions (int32).
        step_positions: each step's positions of ``apply_steps``.
        status: int32 ``[2]``: bad page ids met, first bad gather job.
        direct: the fused gather launch's compiled variants (``None``: launch through
            Triton's Python path).
        counts: the planning calls made so far.
        launched: the last apply's bound gather launch (``None``: launched unbound).
        refresh: (graph strategy) per decode wrapper, by ``(step prefix, WrapperKey)``,
            its ``(fixed buffer, staged view)`` pairs of the last apply (indptr, last-page
            lengths): what a re-plan copies, or a graph captures
            (:class:`~flashplan.executor.flashinfer.bound_table.CapturedWork`).
    """

    device: torch.device
    grow: bool
    timeline: Timeline = attrs.field(init=False)
    pool: WrapperPool = attrs.field(init=False)
    ring: PinnedRing = attrs.field(init=False)
    skeletons: dict[object, tuple[GroupCalls, ...]] = attrs.field(factory=dict)
    lanes: dict[int, tuple[tuple[GroupCalls, ...], PagedLane | None]] = attrs.field(factory=dict)
    views: SliceViews = attrs.field(factory=SliceViews)
    item_bufs: dict[str, DeviceBuffer] = attrs.field(factory=dict)
    mask_bufs: dict[int, DeviceBuffer] = attrs.field(factory=dict)
    step_positions: list[DeviceBuffer] = attrs.field(factory=list)
    counts: PlanCounts = attrs.field(factory=PlanCounts)
    direct: DirectLaunch | None = attrs.field(factory=direct_launcher)
    launched: BoundGatherAndMask | None = None
    refresh: dict[object, tuple[tuple[torch.Tensor, torch.Tensor], ...]] = attrs.field(factory=dict)
    staged: DeviceBuffer = attrs.field(init=False)
    out_page: DeviceBuffer = attrs.field(init=False)
    out_offset: DeviceBuffer = attrs.field(init=False)
    runs_staged: DeviceBuffer = attrs.field(init=False)
    positions: DeviceBuffer = attrs.field(init=False)
    status: torch.Tensor = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        dev = self.device
        self.timeline = Timeline(dev)
        self.pool = WrapperPool(self.timeline, grow=self.grow)
        self.ring = PinnedRing(self.timeline)
        self.staged = DeviceBuffer(dev, torch.int32)
        self.out_page = DeviceBuffer(dev, torch.int32)
        self.out_offset = DeviceBuffer(dev, torch.int32)
        self.runs_staged = DeviceBuffer(dev, torch.int32)
        self.positions = DeviceBuffer(dev, torch.int32)
        self.status = new_status(dev)

    def step_positions_buffer(self, step: int) -> DeviceBuffer:
        """Step ``step``'s positions buffer of ``apply_steps`` (made on first use)."""
        while len(self.step_positions) <= step:
            self.step_positions.append(DeviceBuffer(self.device, torch.int32))
        return self.step_positions[step]


class BuffersStrategy(Protocol):
    """Where an executor's batch data lives; the eager and the graph strategies.

    Attributes:
        settings: the executor's settings.
        owned: the buffers and caches it keeps.
        bucket: the CUDA-graph bucket (``None``: eager).
        graph: the wrappers read fixed buffers (CUDA graphs).
        fast_prefill: paged prefill wrappers may be re-planned through the compiled
            scheduler.
        bound: the page table every apply takes (``bind_page_table``), or ``None``.
        captured: (graph strategy) the gather and copies its graph replays, or ``None``.
    """

    @property
    def settings(self) -> ExecutorSettings: ...
    @property
    def owned(self) -> OwnedBuffers: ...
    @property
    def bucket(self) -> GraphBucket | None: ...
    @property
    def graph(self) -> bool: ...
    @property
    def fast_prefill(self) -> bool: ...

    bound: BoundTable | None
    captured: CapturedWork | None

    def admit(self, spec: PlanSpec) -> None:
        """Refuse a plan this strategy cannot hold (a graph: one beyond its bucket)."""
        ...

    def admit_steps(self, specs: tuple[PlanSpec, ...]) -> None:
        """Refuse the steps of a multi-step draft this strategy cannot hold."""
        ...

    def skeleton(self, spec: PlanSpec) -> tuple[GroupCalls, ...]:
        """``spec``'s FlashInfer calls (kept per static key)."""
        ...

    def device_plan(
        self, spec: PlanSpec, calls: tuple[GroupCalls, ...], table: PageTable
    ) -> DevicePlan:
        """``spec``'s device work: gather jobs, staging manifest and masks."""
        ...

    def steps_device_plan(
        self,
        steps: list[tuple[PlanSpec, tuple[GroupCalls, ...]]],
        table: PageTable,
        prefixes: list[str],
    ) -> DevicePlan:
        """The device work of every step of a multi-step draft, names under prefixes."""
        ...

    def gather_out(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The gather's output buffers (page ids, in-page offsets), at least ``size``."""
        ...

    def mask_out(self, group_index: int, size: int) -> torch.Tensor:
        """The uint8 buffer group ``group_index``'s mask is built into (``size`` bytes)."""
        ...

    def make_wrapper(self, key: WrapperKey, group_index: int, prefix: str) -> WrapperSlot:
        """A new FlashInfer wrapper for ``key``."""
        ...

    @property
    def run_rows(self) -> int | None:
        """The query rows ``run`` takes (a bucket's ``total_q``); ``None``: the plan's."""
        ...

    def check_run(self, args: RunArgs) -> None:
        """Refuse a checked ``run`` call this strategy cannot run (a bucket: encoder
        writes)."""
        ...
