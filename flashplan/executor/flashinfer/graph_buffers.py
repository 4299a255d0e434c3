"""The CUDA-graph buffers strategy: one bucket's fixed buffers and graph-mode wrappers.

Every buffer the graph reads (page ids, indptrs, last-page lengths, write slots, tree
masks) has a fixed address and a size fixed by the bucket (:class:`GraphBucket`). The
first apply fixes the plan key (groups, paths, heads), the groups with a custom mask
and the steps per apply the graph is captured for; a later plan of another key, mask
set or step count is refused (see :mod:`~flashplan.executor.flashinfer.graphs`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
import torch

import flashplan.executor.flashinfer.names as names
from flashplan.arrays import INT32_MAX, IntArray
from flashplan.errors import BucketError, PlanMismatchError
from flashplan.executor.flashinfer.bucket import (
    BucketLayout,
    GraphBucket,
    bucket_gather_jobs,
    check_fits,
    padded_inputs,
    padded_masks,
)
from flashplan.executor.flashinfer.buffers import WrapperSlot
from flashplan.executor.flashinfer.calls import (
    GroupCalls,
    MaskRecipe,
    WrapperKey,
    WrapperKind,
    call_inputs,
    call_skeleton,
    skeleton_key,
)
from flashplan.executor.flashinfer.paged_lane import lane_of
from flashplan.executor.flashinfer.staging import DevicePlan, device_plan
from flashplan.executor.flashinfer.strategy import OwnedBuffers
from flashplan.executor.gathers import GatherJobs, concat_jobs, pages_region

if TYPE_CHECKING:
    from flashplan.executor.checks import RunArgs
    from flashplan.executor.flashinfer.bound_table import BoundTable, CapturedWork
    from flashplan.executor.flashinfer.settings import ExecutorSettings
    from flashplan.layout.page_table import PageTable
    from flashplan.planning.spec import PlanKey, PlanSpec

__all__ = ["FixedShape", "GraphBuffers"]


@attrs.frozen
class FixedShape:
    """What a graph strategy's first apply fixed.

    Attributes:
        key: the plan key (groups, paths, heads) the graph is captured for.
        layout: the bucket's fixed gather regions for that key (one step's).
        steps: steps per apply (1 for ``apply``; ``len(specs)`` for ``apply_steps``).
        masked: per group, whether it has a custom mask.
        page: int32 ``[layout.total * steps]`` fixed gathered page ids.
        offset: int32 ``[layout.total * steps]`` fixed in-page offsets (-1: no slot).
        masks: per masked group, its fixed uint8 mask buffer
            (``bucket.mask_bytes(page_size)`` bytes).
    """

    key: PlanKey
    layout: BucketLayout
    steps: int
    masked: tuple[bool, ...]
    page: torch.Tensor
    offset: torch.Tensor
    masks: dict[int, torch.Tensor]


@attrs.define(eq=False)
class GraphBuffers:
    """The fixed buffers and graph-mode wrappers of one bucket (module docstring).

    One wrapper per key (the graph reads its buffers: the pool waits rather than make
    another); FA2 prefill (the backend FlashInfer's graph plans are checked with);
    prefill wrappers always re-planned through ``plan()``. With a bound page table
    (``bound``), :func:`~flashplan.executor.flashinfer.graphs.capture` captures the
    gather and the decode wrappers' indptr refresh (``captured``): an apply then only
    stages and schedules.
    """

    settings: ExecutorSettings
    bucket: GraphBucket
    bound: BoundTable | None = None
    owned: OwnedBuffers = attrs.field(init=False)
    graph: bool = attrs.field(init=False, default=True)
    fast_prefill: bool = attrs.field(init=False, default=False)
    fixed: FixedShape | None = attrs.field(init=False, default=None)
    captured: CapturedWork | None = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        self.owned = OwnedBuffers(self.settings.device, grow=False)

    # -- what a plan must have -----------------------------------------------------------
    def admit(self, spec: PlanSpec) -> None:
        """Refuse a plan beyond the bucket (:func:`check_fits`)."""
        check_fits(spec, self.bucket)

    def admit_steps(self, specs: tuple[PlanSpec, ...]) -> None:
        """Refuse another number of steps than the first apply's, or a step beyond the
        bucket."""
        self._check_steps(len(specs))
        for spec in specs:
            check_fits(spec, self.bucket)

    def _check_steps(self, steps: int) -> None:
        if self.fixed is not None and steps != self.fixed.steps:
            raise PlanMismatchError(
                "specs",
                f"this graph executor was first applied with {self.fixed.steps} step(s) per "
                f"apply (its fixed buffers hold that many); got {steps}: use one graph "
                "executor per number of steps",
            )

    def _bucket_layout(self, spec: PlanSpec) -> BucketLayout:
        """The fixed regions for ``spec``'s key (the key of the first applied plan)."""
        if self.fixed is None:
            return self.bucket.layout(spec.key, window_pool=self.settings.page_map is not None)
        if spec.key is not self.fixed.key and spec.key != self.fixed.key:
            raise PlanMismatchError(
                "spec", "a graph executor runs plans of the key it was first applied with "
                "(groups, paths, heads)", key=spec.key, fixed=self.fixed.key,
            )  # fmt: skip
        return self.fixed.layout

    def _check_masks(self, calls: tuple[GroupCalls, ...], page_size: int) -> None:
        """The groups with a custom mask are part of a graph's shape: its kernels were
        captured with or without one."""
        masked = tuple(gc.masked for gc in calls)
        if self.fixed is not None and masked != self.fixed.masked:
            raise PlanMismatchError(
                "spec",
                "this graph executor was first applied with custom masks on the groups "
                f"{self.fixed.masked} (a tree verify has one, a chain verify none); got "
                f"{masked}: use one graph executor for trees and another for chains",
            )
        if any(masked):
            capacity = self.bucket.mask_bytes(page_size)
            if capacity > INT32_MAX:
                raise BucketError(
                    "max_pages",
                    "the bucket's fixed mask buffer would exceed FlashInfer's int32 mask "
                    "offsets (batch_size * tokens_per_request * max_pages * page_size)",
                    mask_bytes=capacity,
                )

    def _fix(
        self, key: PlanKey, layout: BucketLayout, calls: tuple[GroupCalls, ...], steps: int = 1
    ) -> None:
        """Fix the shape and allocate the fixed buffers (first successful plan only):
        ``steps`` copies of ``layout``, end to end, and a mask buffer per masked group."""
        if self.fixed is not None:
            return
        dev = self.settings.device
        total = layout.total * steps
        size = self.bucket.mask_bytes(key.page_size)
        self.fixed = FixedShape(
            key=key,
            layout=layout,
            steps=steps,
            masked=tuple(gc.masked for gc in calls),
            page=torch.zeros(total, dtype=torch.int32, device=dev),
            offset=torch.full((total,), -1, dtype=torch.int32, device=dev),
            masks={
                gc.group_index: torch.zeros(size, dtype=torch.uint8, device=dev)
                for gc in calls
                if gc.masked
            },
        )

    # -- capture ----------------------------------------------------------------------------
    def capturable_work(self) -> CapturedWork | None:
        """The last apply's gather and decode indptr refresh, for a graph to capture:
        only with a bound page table, a bound launch and no custom mask (a mask's
        launch size changes with the batch); ``None``: they stay per apply."""
        from flashplan.executor.flashinfer.bound_table import CapturedWork

        launch = self.owned.launched
        if self.bound is None or launch is None or self.fixed is None or self.fixed.masks:
            return None
        copies = tuple(pair for pairs in self.owned.refresh.values() for pair in pairs)
        return CapturedWork(launch, self.bound.num_pages or 0, copies)

    # -- the strategy ----------------------------------------------------------------------
    def skeleton(self, spec: PlanSpec) -> tuple[GroupCalls, ...]:
        """The eager skeleton with the bucket's batch size deciding the decode kernel,
        and FA2 prefill."""
        key = ("graph", skeleton_key(spec, self.settings.policy, self.bucket.batch_size))
        calls = self.owned.skeletons.get(key)
        if calls is None:
            policy = attrs.evolve(self.settings.policy, prefill_backend="fa2")
            calls = call_skeleton(
                spec, policy, sm90=self.settings.sm90, batch_size=self.bucket.batch_size
            )
            self.owned.skeletons[key] = calls
        return calls

    def _bucket_parts(
        self, spec: PlanSpec, calls: tuple[GroupCalls, ...], table: PageTable
    ) -> tuple[BucketLayout, GatherJobs, dict[str, IntArray], dict[int, MaskRecipe]]:
        """``spec``'s jobs in the bucket's fixed regions, its padded ``plan()`` arrays and
        its padded masks' sizes."""
        layout = self._bucket_layout(spec)
        self._check_masks(calls, spec.page_size)
        inputs = call_inputs(spec, calls)
        fixed = bucket_gather_jobs(
            spec, table.rows, layout, self.bucket, window_pool=self.settings.page_map is not None,
            spans=inputs.spans,
        )  # fmt: skip
        host = padded_inputs(inputs.host, spec.batch_size, self.bucket)
        return layout, fixed, host, padded_masks(inputs.masks, spec.batch_size, self.bucket)

    def device_plan(
        self, spec: PlanSpec, calls: tuple[GroupCalls, ...], table: PageTable
    ) -> DevicePlan:
        """``spec`` padded to the bucket, in its fixed regions; fixes the shape on the
        first apply."""
        self._check_steps(1)
        lane = lane_of(self.owned.lanes, spec, calls, self.settings.page_map is not None)
        if lane is not None:  # a plain paged batch: no masks to pad
            layout = self._bucket_layout(spec)
            self._check_masks(calls, spec.page_size)
            dplan = lane.bucket_plan(spec, table.rows, layout, self.bucket)
        else:
            layout, fixed, host, masks = self._bucket_parts(spec, calls, table)
            dplan = device_plan(calls, fixed, host, masks)
        self._fix(spec.key, layout, calls)  # nothing above refused the plan
        return dplan

    def steps_device_plan(
        self,
        steps: list[tuple[PlanSpec, tuple[GroupCalls, ...]]],
        table: PageTable,
        prefixes: list[str],
    ) -> DevicePlan:
        """Each step's jobs in its own copy of the bucket's fixed regions (step ``k``
        ``k`` layouts on) and its padded ``plan()`` arrays; fixes the shape on the first
        apply."""
        parts = [self._bucket_parts(spec, calls, table) for spec, calls in steps]
        combined = concat_jobs([jobs for _, jobs, _, _ in parts], prefixes)
        host = {
            p + name: a
            for p, (_, _, arrays, _) in zip(prefixes, parts, strict=True)
            for name, a in arrays.items()
        }
        dplan = device_plan((), combined, host, {})
        self._fix(steps[0][0].key, parts[0][0], steps[0][1], len(steps))
        return dplan

    def gather_out(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The fixed gather buffers (the bucket bounds every batch's size)."""
        assert self.fixed is not None
        return self.fixed.page, self.fixed.offset

    def mask_out(self, group_index: int, size: int) -> torch.Tensor:
        """The group's fixed mask buffer's first ``size`` bytes."""
        assert self.fixed is not None
        buf = self.fixed.masks[group_index]
        if size > buf.shape[0]:  # check_fits bounds every mask: never reached
            raise BucketError(
                "max_pages", "a mask larger than the bucket's fixed mask buffer",
                group=group_index, mask_bytes=size, capacity=int(buf.shape[0]),
            )  # fmt: skip
        return buf[:size]

    def make_wrapper(self, key: WrapperKey, group_index: int, prefix: str) -> WrapperSlot:
        """A graph-mode wrapper over fixed indptr buffers and the group's fixed page
        ids (step ``k`` of a multi-step draft: its own copy of the regions)."""
        assert self.fixed is not None
        bs = self.bucket.batch_size
        dev = self.settings.device
        workspace = self.settings.workspace

        def ints(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int32, device=dev)

        cls = getattr(self.settings.flashinfer, key.class_name)
        kwargs = key.constructor_kwargs()
        if key.kind is WrapperKind.RAGGED_PREFILL:  # pragma: no cover - refused by check_fits
            raise PlanMismatchError("paths", "CUDA-graph buckets run paged paths only")
        layout = self.fixed.layout
        r = layout.region(pages_region(group_index))
        base = layout.total * names.step_of(prefix)  # step k's regions: k layouts on
        indices = self.fixed.page[base + r.lo : base + r.hi]
        if key.kind is WrapperKind.DECODE:
            fixed = {"indptr": ints(bs + 1), "last_page_len": ints(bs)}
            wrapper = cls(
                workspace,
                use_cuda_graph=True,
                paged_kv_indptr_buffer=fixed["indptr"],
                paged_kv_indices_buffer=indices,
                paged_kv_last_page_len_buffer=fixed["last_page_len"],
                **kwargs,
            )
            return WrapperSlot(wrapper, fixed=fixed)
        mask = self.fixed.masks.get(group_index)
        if mask is not None:  # FlashInfer's plan() copies the built mask onto itself
            kwargs["custom_mask_buf"] = mask
            kwargs["mask_indptr_buf"] = ints(bs + 1)
        if key.sink is None:  # (FlashInfer's sink prefill wrapper takes no such bound)
            kwargs["max_total_num_rows"] = self.bucket.total_q
        wrapper = cls(
            workspace,
            use_cuda_graph=True,
            qo_indptr_buf=ints(bs + 1),
            paged_kv_indptr_buf=ints(bs + 1),
            paged_kv_indices_buf=indices,
            paged_kv_last_page_len_buf=ints(bs),
            **kwargs,
        )
        return WrapperSlot(wrapper)

    @property
    def run_rows(self) -> int:
        """``run`` takes the bucket's ``total_q`` rows (padding rows' outputs ignored)."""
        return self.bucket.total_q

    def check_run(self, args: RunArgs) -> None:
        """A bucket writes no encoder K/V."""
        if args.writes and args.plan.group.cross_attention:
            raise PlanMismatchError(
                "k_new",
                "a CUDA-graph bucket writes no encoder K/V: write them in an eager step "
                "and pass k_new=v_new=None for cross groups in the graph",
            )
