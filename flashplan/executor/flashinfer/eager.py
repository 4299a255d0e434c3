"""The eager buffers strategy: buffers that grow to the largest batch, wrappers made on
demand (see :mod:`~flashplan.executor.flashinfer.strategy`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
import torch

from flashplan.executor.flashinfer.buffers import DeviceBuffer, WrapperSlot
from flashplan.executor.flashinfer.calls import call_inputs, call_skeleton, skeleton_key
from flashplan.executor.flashinfer.paged_lane import lane_of
from flashplan.executor.flashinfer.staging import DevicePlan, device_plan
from flashplan.executor.flashinfer.strategy import OwnedBuffers
from flashplan.executor.gathers import gather_jobs, gather_jobs_steps

if TYPE_CHECKING:
    from flashplan.executor.checks import RunArgs
    from flashplan.executor.flashinfer.bound_table import BoundTable, CapturedWork
    from flashplan.executor.flashinfer.bucket import GraphBucket
    from flashplan.executor.flashinfer.calls import GroupCalls, WrapperKey
    from flashplan.executor.flashinfer.settings import ExecutorSettings
    from flashplan.layout.page_table import PageTable
    from flashplan.planning.spec import PlanSpec

__all__ = ["EagerBuffers"]


@attrs.define(eq=False)
class EagerBuffers:
    """Buffers sized to the largest batch so far; wrappers made as needed (several per
    key while the host plans ahead of the GPU: :class:`WrapperPool`)."""

    settings: ExecutorSettings
    owned: OwnedBuffers = attrs.field(init=False)
    bucket: GraphBucket | None = attrs.field(init=False, default=None)
    graph: bool = attrs.field(init=False, default=False)
    bound: BoundTable | None = attrs.field(init=False, default=None)
    captured: CapturedWork | None = attrs.field(init=False, default=None)  # never: no graph

    def __attrs_post_init__(self) -> None:
        self.owned = OwnedBuffers(self.settings.device, grow=True)

    @property
    def fast_prefill(self) -> bool:
        """Paged prefill wrappers are re-planned through the compiled scheduler where the
        settings allow."""
        return self.settings.fast_prefill

    def admit(self, spec: PlanSpec) -> None:
        """Every plan fits."""

    def admit_steps(self, specs: tuple[PlanSpec, ...]) -> None:
        """Any number of steps fits."""

    def skeleton(self, spec: PlanSpec) -> tuple[GroupCalls, ...]:
        """``spec``'s calls, kept per :func:`~.calls.skeleton_key`."""
        policy = self.settings.policy
        key = skeleton_key(spec, policy)
        calls = self.owned.skeletons.get(key)
        if calls is None:
            calls = call_skeleton(spec, policy, sm90=self.settings.sm90)
            self.owned.skeletons[key] = calls
        return calls

    def device_plan(
        self, spec: PlanSpec, calls: tuple[GroupCalls, ...], table: PageTable
    ) -> DevicePlan:
        """``spec``'s gather jobs, staged arrays and masks (a plain paged batch's
        through its skeleton's :class:`~.paged_lane.PagedLane`)."""
        window_pool = self.settings.page_map is not None
        lane = lane_of(self.owned.lanes, spec, calls, window_pool, tree_masks=True)
        if lane is not None:
            return lane.device_plan(spec, table.rows)
        inputs = call_inputs(spec, calls)
        jobs = gather_jobs(
            spec, table.rows, window_pool=window_pool, spans=inputs.spans,
            level_spans=inputs.level_spans,
        )  # fmt: skip
        return device_plan(
            calls, jobs, inputs.host, inputs.masks, ints=inputs.ints, elements=inputs.elements
        )

    def steps_device_plan(
        self,
        steps: list[tuple[PlanSpec, tuple[GroupCalls, ...]]],
        table: PageTable,
        prefixes: list[str],
    ) -> DevicePlan:
        """All steps' gather jobs in one table and their ``plan()`` arrays in one
        staging buffer, names under their prefixes (no masks: draft decodes have none)."""
        inputs = [call_inputs(spec, calls) for spec, calls in steps]
        combined = gather_jobs_steps(
            [spec for spec, _ in steps], table.rows, prefixes,
            window_pool=self.settings.page_map is not None, spans=[i.spans for i in inputs],
        )  # fmt: skip
        host = {
            p + name: a for p, i in zip(prefixes, inputs, strict=True) for name, a in i.host.items()
        }
        return device_plan((), combined, host, {})

    def gather_out(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The gather's output buffers, whole (readers take their regions' bounds from
        the job table)."""
        return self.owned.out_page.reserve(size), self.owned.out_offset.reserve(size)

    def mask_out(self, group_index: int, size: int) -> torch.Tensor:
        """Group ``group_index``'s mask buffer, whole (FlashInfer finds each request's
        bytes through ``mask_indptr``)."""
        bufs = self.owned.mask_bufs
        buf = bufs.get(group_index)
        if buf is None:
            buf = bufs[group_index] = DeviceBuffer(self.settings.device, torch.uint8)
        return buf.reserve(size)

    def make_wrapper(self, key: WrapperKey, group_index: int, prefix: str) -> WrapperSlot:
        """A wrapper on the shared workspace (eager wrappers own no per-group buffers)."""
        del group_index, prefix
        cls = getattr(self.settings.flashinfer, key.class_name)
        return WrapperSlot(cls(self.settings.workspace, **key.constructor_kwargs()))

    @property
    def run_rows(self) -> int | None:
        """``run`` takes the plan's query rows."""
        return None

    def check_run(self, args: RunArgs) -> None:
        """Every checked call runs."""
