"""What a FlashInfer executor keeps between batches, and the device work of an apply:
the staging copy (:class:`Staged`), the wrappers (:class:`WrapperPool`) and the eager or
CUDA-graph buffers (:class:`Buffers`, :class:`GraphBuffers`). Nothing here waits for the
GPU.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import torch

import flashplan.executor.flashinfer.names as names
from flashplan.arrays import INT32_MAX
from flashplan.errors import BucketError, PlanMismatchError, UnsupportedError
from flashplan.executor.flashinfer.bucket import (
    GraphBucket,
    bucket_gather_jobs,
    check_fits,
    padded_inputs,
    padded_masks,
)
from flashplan.executor.flashinfer.calls import (
    BatchInt,
    BuiltMask,
    DeviceArray,
    DeviceIndices,
    GroupCalls,
    HostArray,
    ItemPositions,
    MaskRecipe,
    StagedArray,
    WrapperKey,
    WrapperKind,
    call_inputs,
    call_skeleton,
    skeleton_key,
)
from flashplan.executor.flashinfer.staging import DevicePlan, device_plan
from flashplan.executor.flashinfer.xqa import XqaDecode
from flashplan.executor.gathers import concat_jobs, gather_jobs, gather_jobs_steps, pages_region
from flashplan.kernels.fused import StagedMask, launch_gather_and_mask
from flashplan.kernels.gather import new_status
from flashplan.kernels.runs import fill_runs

if TYPE_CHECKING:
    from flashplan.arrays import IntArray
    from flashplan.executor.checks import RunArgs
    from flashplan.executor.flashinfer.bucket import BucketLayout
    from flashplan.executor.flashinfer.policy import ExecutorSettings
    from flashplan.executor.gathers import GatherJobs
    from flashplan.layout.page_table import PageTable
    from flashplan.planning.spec import PlanKey, PlanSpec

__all__ = ["Buffers", "DeviceBuffer", "GraphBuffers", "Staged", "WrapperPool"]

#: torch dtypes of the staged views handed to ``plan()`` (the multi-item tensors).
_VIEW_DTYPES = {"uint32": torch.uint32, "uint16": torch.uint16}

#: The steps of a multi-step apply: each plan and its calls.
Steps = list[tuple["PlanSpec", tuple[GroupCalls, ...]]]


class DeviceBuffer:
    """A device tensor of ``dtype`` that grows (doubling) to the largest size asked for
    (a new allocation, which torch's caching allocator reuses after the queued kernels)."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        self.tensor = torch.empty(0, dtype=dtype, device=device)

    def reserve(self, size: int) -> torch.Tensor:
        """The whole buffer, at least ``size`` entries."""
        if self.tensor.shape[0] < size:
            grown = max(size, 2 * self.tensor.shape[0], 256)
            self.tensor = torch.empty(grown, dtype=self.dtype, device=self.device)
        return self.tensor


class Staged:
    """One batch's staged int32 arrays in a fresh pinned tensor (torch's caching host
    allocator reuses a block only once the copies reading it have run) and its device
    copy: ``host(name)`` is what ``plan()`` reads, ``device(name)`` what kernels read."""

    def __init__(self, dplan: DevicePlan, target: DeviceBuffer) -> None:
        total = dplan.manifest.total
        self.manifest = dplan.manifest
        pinned = target.device.type == "cuda"
        self.host_tensor = torch.empty(total, dtype=torch.int32, pin_memory=pinned)
        dplan.write_into(self.host_tensor.numpy())
        self.device_tensor = target.reserve(total)[:total]
        self.device_tensor.copy_(self.host_tensor, non_blocking=True)

    def host(self, name: str) -> torch.Tensor:
        s = self.manifest[name]
        return self.host_tensor[s.offset : s.end]

    def device(self, name: str) -> torch.Tensor:
        s = self.manifest[name]
        return self.device_tensor[s.offset : s.end]


class WrapperPool:
    """FlashInfer wrappers by ``(step prefix, WrapperKey)``, handed out once an event after
    their last ``plan()`` (which queues a copy of their pinned int workspace) has passed.
    ``grow``: make another while all of a key are busy, up to :attr:`MAX_PER_KEY` (eager);
    beyond that, or with one wrapper (a graph's), wait for the one marked longest ago: the
    host is then that many applies ahead of the GPU."""

    MAX_PER_KEY = 4

    def __init__(self, device: torch.device, *, grow: bool) -> None:
        self.cuda, self.grow = device.type == "cuda", grow
        self.slots: dict[tuple[str, WrapperKey], list[list[Any]]] = {}
        self.used: list[list[Any]] = []  # slots planned in this apply: [wrapper, event]

    def acquire(self, key: tuple[str, WrapperKey], make: Callable[[], Any]) -> Any:
        """A wrapper of ``key`` whose last plan's copies have run (made if needed)."""
        slots = self.slots.setdefault(key, [])
        for slot in slots:
            if slot[1] is None or slot[1].query():
                break
        else:
            if not slots or (self.grow and len(slots) < self.MAX_PER_KEY):
                slot = [make(), None]
                slots.append(slot)
            else:  # the longest-marked wrapper: its event is the oldest
                slot = slots.pop(0)
                slots.append(slot)
                slot[1].synchronize()
        self.used.append(slot)
        return slot[0]

    def mark(self, stream: torch.cuda.Stream | None) -> None:
        """Record one event after this apply's ``plan()`` calls: their wrappers' busy mark."""
        event = None
        if self.cuda and self.used:
            event = torch.cuda.Event()
            event.record(stream)
        for slot in self.used:
            slot[1] = event
        self.used = []


class Buffers:
    """The eager buffers (grown to the largest batch; wrappers made as needed) and the
    device work of an apply. ``status``: int32 ``[2]``, bad page ids met, first bad job."""

    bucket: GraphBucket | None = None
    run_rows: int | None = None  # run() takes the plan's rows

    def __init__(self, settings: ExecutorSettings, *, grow: bool = True) -> None:
        dev = settings.device
        self.settings = settings
        int32 = functools.partial(DeviceBuffer, dev, torch.int32)
        self.staging, self.runs = int32(), int32()
        self.positions_out: dict[int, DeviceBuffer] = {}  # by draft step
        self.page, self.offset = int32(), int32()
        self.masks: dict[int, DeviceBuffer] = {}
        self.items: dict[str, DeviceBuffer] = {}
        self.status = new_status(dev)
        self.pool = WrapperPool(dev, grow=grow)
        self.skeletons: dict[object, tuple[GroupCalls, ...]] = {}

    def skeleton(self, spec: PlanSpec) -> tuple[GroupCalls, ...]:
        """``spec``'s calls, kept per :func:`~.calls.skeleton_key`. A bucket's batch size
        picks its decode kernel, and its prefill calls run on FA2 (the backend whose graph
        plans FlashInfer keeps fixed)."""
        bs = None if self.bucket is None else self.bucket.batch_size
        key = skeleton_key(spec, self.settings.policy, bs)
        calls = self.skeletons.get(key)
        if calls is None:
            policy = self.settings.policy
            if self.bucket is not None:
                policy = attrs.evolve(policy, prefill_backend="fa2")
            calls = self.skeletons[key] = call_skeleton(
                spec, policy, sm90=self.settings.sm90, batch_size=bs,
                sink_decode=self.settings.sink_decode, xqa=self.settings.xqa is not None,
            )  # fmt: skip
        return calls

    # -- what GraphBuffers overrides ----------------------------------------------------
    def device_plan(
        self, spec: PlanSpec, calls: tuple[GroupCalls, ...], table: PageTable
    ) -> DevicePlan:
        inputs = call_inputs(spec, calls)
        jobs = gather_jobs(
            spec, table.rows, window_pool=self.settings.page_map is not None,
            spans=inputs.spans, level_spans=inputs.level_spans, widths=inputs.widths,
        )  # fmt: skip
        return device_plan(
            calls, jobs, inputs.host, inputs.masks, ints=inputs.ints, elements=inputs.elements
        )

    def steps_device_plan(self, steps: Steps, table: PageTable, prefixes: list[str]) -> DevicePlan:
        inputs = [call_inputs(spec, calls) for spec, calls in steps]
        jobs = gather_jobs_steps(
            [spec for spec, _ in steps], table.rows, prefixes,
            window_pool=self.settings.page_map is not None, spans=[i.spans for i in inputs],
            widths=[i.widths for i in inputs],
        )  # fmt: skip
        host = {p + n: a for p, i in zip(prefixes, inputs, strict=True) for n, a in i.host.items()}
        return device_plan((), jobs, host, {})

    def gather_out(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.page.reserve(size), self.offset.reserve(size)

    def mask_out(self, group_index: int, size: int) -> torch.Tensor:
        buf = self.masks.setdefault(group_index, DeviceBuffer(self.settings.device, torch.uint8))
        return buf.reserve(size)

    def make_wrapper(self, key: WrapperKey, group_index: int, prefix: str) -> Any:
        if key.kind is WrapperKind.XQA:
            assert self.settings.xqa is not None  # (call_skeleton plans XQA only then)
            return XqaDecode(self.settings.flashinfer, self.settings.xqa)
        cls = getattr(self.settings.flashinfer, key.class_name)
        return cls(self.settings.workspace, **key.constructor_kwargs())

    def admit(self, specs: tuple[PlanSpec, ...]) -> None:
        """Refuse plans this strategy cannot hold (eager: none)."""

    def check_run(self, args: RunArgs) -> None:
        """Refuse a run this strategy cannot do (eager: none)."""

    # -- the device work -----------------------------------------------------------------
    def gather_and_mask(
        self, dplan: DevicePlan, staged: Staged, table: PageTable
    ) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
        """One launch: every gather job and the first mask (a further mask: one launch
        each). Returns the int32 page ids, in-page offsets and each built mask."""
        jobs = dplan.jobs
        page, offset = self.gather_out(max(jobs.total, 1))
        built: dict[int, torch.Tensor] = {}
        first: StagedMask | None = None
        for index, recipe in dplan.masks.items():
            out = self.mask_out(index, recipe.total_bytes)
            mask = _staged_mask(dplan, staged, index, recipe, out)
            built[index] = out
            if first is None:
                first = mask
            else:
                mask.build()  # Triton on CUDA, its torch twin on the CPU
        table_t = staged.device(names.JOBS) if jobs.total else staged.device_tensor[:0]
        launch_gather_and_mask(
            table.pages, table_t.view(6, -1 if jobs.total else 0), page, offset,
            page_map=self.settings.page_map, num_pages=table.num_pages or 0,
            status=self.status, mask=first,
        )  # fmt: skip
        return page, offset, built

    def plan_wrappers(
        self, calls: tuple[GroupCalls, ...], dplan: DevicePlan, staged: Staged,
        page: torch.Tensor, masks: dict[int, torch.Tensor], prefix: str = "",
    ) -> dict[tuple[int, str], Any]:  # fmt: skip
        """Each call's wrapper planned on the batch's arrays, by ``(group index, "paged" |
        "ragged" | "level<k>")``."""

        def resolve(value: object) -> object:
            if isinstance(value, HostArray):  # pinned host: plan() never reads back
                return staged.host(prefix + value.name)
            if isinstance(value, DeviceArray):  # a kernel reads all of it
                return staged.device(prefix + value.name).view(_VIEW_DTYPES[value.dtype])
            if isinstance(value, StagedArray):  # a kernel reads it: typed device view
                view = staged.device(prefix + value.name).view(_VIEW_DTYPES[value.dtype])
                return view[: dplan.elements[prefix + value.name]]
            if isinstance(value, BatchInt):
                return dplan.ints[prefix + value.name]
            if isinstance(value, DeviceIndices):
                r = dplan.jobs.region(prefix + value.region)
                return page[r.lo : r.hi]
            if isinstance(value, BuiltMask):
                return masks[value.group_index]
            if isinstance(value, ItemPositions):
                return self._item_positions(dplan, staged, prefix + value.name)
            return value

        planned: dict[tuple[int, str], Any] = {}
        for gc in calls:
            parts = [("paged", gc.paged), ("ragged", gc.ragged)]
            parts += [(names.level_part(k), call) for k, call in enumerate(gc.levels)]
            for part, call in parts:
                if call is None:
                    continue
                make = functools.partial(self.make_wrapper, call.wrapper, gc.group_index, prefix)
                wrapper = self.pool.acquire((prefix, call.wrapper), make)
                kwargs = {name: resolve(value) for name, value in call.kwargs}
                call_plan(wrapper, kwargs, self.settings.workspace_bytes)
                planned[(gc.group_index, part)] = wrapper
        return planned

    def _item_positions(self, dplan: DevicePlan, staged: Staged, name: str) -> torch.Tensor:
        """FlashInfer's uint16 ``token_pos_in_items`` for the items staged under ``name``
        (a buffer per name: FlashInfer keeps it until the wrapper is planned again)."""
        size = dplan.ints[names.item_part(name, "size")]
        buf = self.items.setdefault(name, DeviceBuffer(self.settings.device, torch.int16))
        out = buf.reserve(max(size, 1))[:size]
        out.zero_()  # int16: the bytes of uint16 zeros
        out = out.view(torch.uint16)
        start = staged.device(names.item_part(name, "start"))
        length = staged.device(names.item_part(name, "length"))
        fill_runs(start, 1, length, out, dplan.ints[names.item_part(name, "longest")])
        return out

    def fill_positions(self, spec: PlanSpec, step: int = 0) -> torch.Tensor:
        """``spec``'s RoPE positions, int32 ``[total_q]`` on the device (one copy, one
        launch), into draft step ``step``'s own buffer."""
        runs = spec.position_runs
        n = runs.num_runs
        pinned = self.settings.device.type == "cuda"
        host = torch.empty(max(3 * n, 1), dtype=torch.int32, pin_memory=pinned)
        np.concatenate((runs.start, runs.first, runs.length), out=host.numpy()[: 3 * n])
        dev = self.runs.reserve(host.shape[0])[: host.shape[0]]
        dev.copy_(host, non_blocking=True)
        buf = self.positions_out.setdefault(step, DeviceBuffer(self.settings.device, torch.int32))
        out = buf.reserve(spec.total_q)[: spec.total_q]
        fill_runs(dev[:n], dev[n : 2 * n], dev[2 * n : 3 * n], out, runs.max_length)
        return out


@attrs.frozen
class FixedShape:
    """What a graph executor's first apply fixed: the plan key, one step's gather regions,
    the steps per apply, the masked groups, and the fixed buffers: int32 page ids and
    offsets (``[layout.total * steps]``), a uint8 mask per masked group."""

    key: PlanKey
    layout: BucketLayout
    steps: int
    masked: tuple[bool, ...]
    page: torch.Tensor
    offset: torch.Tensor
    masks: dict[int, torch.Tensor]


class GraphBuffers(Buffers):
    """One bucket's fixed buffers and graph-mode wrappers (one wrapper per key: the
    graph reads its buffers, so a busy one is waited for, never replaced)."""

    bucket: GraphBucket

    def __init__(self, settings: ExecutorSettings, bucket: GraphBucket) -> None:
        super().__init__(settings, grow=False)
        self.bucket = bucket
        self.run_rows = bucket.total_q
        self.fixed: FixedShape | None = None

    def admit(self, specs: tuple[PlanSpec, ...]) -> None:
        """Refuse a plan beyond the bucket, or another number of steps than the first's."""
        if self.fixed is not None and len(specs) != self.fixed.steps:
            raise PlanMismatchError(
                "specs", f"this graph executor was first applied with {self.fixed.steps} "
                f"step(s) per apply; got {len(specs)}: use one graph executor per number of steps",
            )  # fmt: skip
        for spec in specs:
            check_fits(spec, self.bucket)

    def _layout(self, spec: PlanSpec, calls: tuple[GroupCalls, ...]) -> BucketLayout:
        """The fixed regions of ``spec``'s key; refuses another key or masks than the first's."""
        masked = tuple(gc.masked for gc in calls)
        if self.fixed is None:
            mask_bytes = self.bucket.mask_bytes(spec.page_size)
            if any(masked) and mask_bytes > INT32_MAX:
                raise BucketError(
                    "max_pages", "the bucket's fixed mask buffer would exceed FlashInfer's "
                    "int32 mask offsets", mask_bytes=mask_bytes,
                )  # fmt: skip
            return self.bucket.layout(spec.key, window_pool=self.settings.page_map is not None)
        if spec.key != self.fixed.key:
            raise PlanMismatchError(
                "spec", "a graph executor runs plans of the key it was first applied with "
                "(groups, paths, heads)", key=spec.key, fixed=self.fixed.key,
            )  # fmt: skip
        if masked != self.fixed.masked:
            raise PlanMismatchError(
                "spec", f"this graph executor was first applied with custom masks on the "
                f"groups {self.fixed.masked}; got {masked}: use one graph executor for "
                "trees and another for chains",
            )  # fmt: skip
        return self.fixed.layout

    def _padded(
        self, spec: PlanSpec, calls: tuple[GroupCalls, ...], table: PageTable, layout: BucketLayout
    ) -> tuple[GatherJobs, dict[str, IntArray], dict[int, MaskRecipe]]:
        """``spec``'s gather jobs in the fixed regions, its padded arrays and masks."""
        inputs = call_inputs(spec, calls)
        jobs = bucket_gather_jobs(
            spec, table.rows, layout, self.bucket, window_pool=self.settings.page_map is not None,
            spans=inputs.spans, dense=frozenset(inputs.widths),
        )  # fmt: skip
        host = padded_inputs(inputs.host, spec.batch_size, self.bucket)
        return jobs, host, padded_masks(inputs.masks, spec.batch_size, self.bucket)

    def device_plan(
        self, spec: PlanSpec, calls: tuple[GroupCalls, ...], table: PageTable
    ) -> DevicePlan:
        """``spec`` padded to the bucket, in its fixed regions."""
        layout = self._layout(spec, calls)
        jobs, host, masks = self._padded(spec, calls, table, layout)
        self._fix(spec, layout, calls, 1)
        return device_plan(calls, jobs, host, masks)

    def steps_device_plan(self, steps: Steps, table: PageTable, prefixes: list[str]) -> DevicePlan:
        """Each step padded into its own copy of the fixed regions."""
        layout = self._layout(*steps[0])
        parts = [self._padded(spec, calls, table, layout) for spec, calls in steps]
        jobs = concat_jobs([p[0] for p in parts], prefixes)
        host = {pre + n: a for pre, p in zip(prefixes, parts, strict=True) for n, a in p[1].items()}
        self._fix(steps[0][0], layout, steps[0][1], len(steps))
        return device_plan((), jobs, host, {})

    def _fix(
        self, spec: PlanSpec, layout: BucketLayout, calls: tuple[GroupCalls, ...], steps: int
    ) -> None:
        if self.fixed is not None:
            return
        dev, total = self.settings.device, layout.total * steps
        size = self.bucket.mask_bytes(spec.page_size)
        masks = {
            gc.group_index: torch.zeros(size, dtype=torch.uint8, device=dev)
            for gc in calls
            if gc.masked
        }
        self.fixed = FixedShape(
            spec.key, layout, steps, tuple(gc.masked for gc in calls),
            torch.zeros(total, dtype=torch.int32, device=dev),
            torch.full((total,), -1, dtype=torch.int32, device=dev), masks,
        )  # fmt: skip

    def gather_out(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.fixed is not None
        return self.fixed.page, self.fixed.offset

    def mask_out(self, group_index: int, size: int) -> torch.Tensor:
        assert self.fixed is not None  # check_fits bounds every mask by the buffer
        return self.fixed.masks[group_index][:size]

    def make_wrapper(self, key: WrapperKey, group_index: int, prefix: str) -> Any:
        """A graph-mode wrapper over fixed indptr buffers and the group's fixed page ids
        (step ``k`` of a multi-step draft: its own copy of the regions); an XQA decode
        over the group's fixed block table and lengths of its own."""
        assert self.fixed is not None
        if key.kind is WrapperKind.XQA:
            assert self.settings.xqa is not None
            rows = self.bucket.batch_size
            return XqaDecode(self.settings.flashinfer, self.settings.xqa, graph_rows=rows)
        bs = self.bucket.batch_size
        ints = functools.partial(torch.zeros, dtype=torch.int32, device=self.settings.device)
        cls = getattr(self.settings.flashinfer, key.class_name)
        kwargs = key.constructor_kwargs()
        r = self.fixed.layout.region(pages_region(group_index))
        base = self.fixed.layout.total * names.step_of(prefix)
        indices = self.fixed.page[base + r.lo : base + r.hi]
        if key.kind is WrapperKind.DECODE:
            return cls(
                self.settings.workspace, use_cuda_graph=True, paged_kv_indptr_buffer=ints(bs + 1),
                paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=ints(bs), **kwargs,
            )  # fmt: skip
        mask = self.fixed.masks.get(group_index)
        if mask is not None:  # plan() copies the built mask onto itself
            kwargs.update(custom_mask_buf=mask, mask_indptr_buf=ints(bs + 1))
        if "max_total_num_rows" in inspect.signature(cls.__init__).parameters:  # (0.7.4)
            kwargs["max_total_num_rows"] = self.bucket.total_q
        return cls(
            self.settings.workspace, use_cuda_graph=True, qo_indptr_buf=ints(bs + 1),
            paged_kv_indptr_buf=ints(bs + 1), paged_kv_indices_buf=indices,
            paged_kv_last_page_len_buf=ints(bs), **kwargs,
        )  # fmt: skip

    def check_run(self, args: RunArgs) -> None:
        """A bucket writes no encoder K/V."""
        if args.writes and args.plan.group.cross_attention:
            raise PlanMismatchError(
                "k_new", "a CUDA-graph bucket writes no encoder K/V: write them in an eager "
                "step and pass k_new=v_new=None for cross groups in the graph",
            )  # fmt: skip


def call_plan(wrapper: Any, kwargs: dict[str, Any], workspace_bytes: int) -> None:
    """``wrapper.plan(**kwargs)``; a workspace too small for it raises
    :class:`~flashplan.UnsupportedError` naming ``workspace_bytes``."""
    try:
        wrapper.plan(**kwargs)
    except RuntimeError as exc:
        text = str(exc).lower()
        if "workspace" in text or "buffer size" in text:  # (a CUDA OOM stays itself)
            raise UnsupportedError(
                "workspace_bytes",
                f"FlashInfer's plan() needs more workspace than this executor has ({exc}); "
                "construct the executor with a larger workspace_bytes",
                workspace_bytes=workspace_bytes,
            ) from exc
        raise


def _staged_mask(
    dplan: DevicePlan, staged: Staged, index: int, recipe: MaskRecipe, out: torch.Tensor
) -> StagedMask:
    """Group ``index``'s mask: its inputs as offsets into the staged device tensor, built
    into ``out``."""
    manifest = dplan.manifest

    def at(field: names.MaskField) -> int:
        return manifest[names.mask_name(index, field)].offset

    qo = manifest[names.mask_name(index, "qo_lens")]
    more = (0, 0, 0)
    if recipe.num_tokens:
        more = (at("row_offsets"), at("tail_start"), at("tail_words"))
    if recipe.position:  # the kernel's slots: rule, column positions, row positions
        more, first = (at("rule"), at("col_position"), 0), at("row_position")
    else:
        first = at("first_visible")
    return StagedMask(
        staged.device_tensor, first, qo.offset, at("kv_lens"), at("indptr"), *more, qo.size,
        recipe.num_tokens, recipe.max_bytes, out, recipe.position,
    )  # fmt: skip
