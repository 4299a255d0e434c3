"""The device work of a plain paged batch, laid out without the general translation.

Most steps an engine plans are decodes, and most of the rest paged extends or tree
verifies: every group on one paged call (the decode kernel, or one paged prefill), with
no multi-item tensor, virtual request, ragged part, cascade level, encoder or
window-pool page map, and no custom mask but (eager) a verify's tree mask.
For such a batch :func:`~.batch_arrays.call_inputs`,
:func:`~flashplan.executor.gathers.job_parts`, :func:`~.bucket.padded_inputs` and
:func:`~.staging.device_plan` spend most of their host time on generality (dicts of
named arrays built, parsed and merged, each group's job parts worked out, the staging
layout looked up from the names and sizes). A :class:`PagedLane` is what those steps
derive from the call skeleton alone, worked out once per skeleton: the staged arrays'
names, the batch integers' names, the job table's regions, divisors and map flags. Per
batch it lists the arrays and builds the job table (with the general path's own table
builders, :func:`~flashplan.executor.gathers.job_table` and :func:`~.bucket.bucket_jobs`).

The result is the general path's :class:`~.staging.DevicePlan`, field for field (the
CPU suite checks it against the general path over random decode and extend batches,
eager and in CUDA-graph buckets); a skeleton the lane does not cover gets ``None`` from
:meth:`PagedLane.of`, and the executor takes the general path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
import numpy as np

import flashplan.executor.flashinfer.names as names
from flashplan.executor.flashinfer.batch_arrays import (
    CUSTOM_MASK_FIELDS,
    custom_mask_arrays,
    decode_scheduler_kv_lens,
)
from flashplan.executor.flashinfer.bucket import bucket_jobs, padded_indptr, padded_lengths
from flashplan.executor.flashinfer.staging import DevicePlan, StagingManifest
from flashplan.executor.gathers import WRITE, divisors_and_flags, job_table, pages_region
from flashplan.layout.mode import Mode
from flashplan.planning.masks import TreeMask
from flashplan.planning.spec import KernelPath

if TYPE_CHECKING:
    from flashplan.arrays import IntArray
    from flashplan.executor.flashinfer.bucket import BucketLayout, GraphBucket
    from flashplan.executor.flashinfer.call_types import GroupCalls, MaskRecipe
    from flashplan.executor.gathers import GatherJobs, JobPart
    from flashplan.planning.spec import PlanSpec

__all__ = ["PagedLane", "lane_of"]

#: The batch integers' names of the queries' total and longest request.
_QO_TOTAL, _QO_MAX_LEN = names.batch_int("qo.total"), names.batch_int("qo.max_len")


@attrs.frozen(eq=False)
class PagedLane:
    """The staging of a plain paged skeleton (see module docstring).

    Attributes:
        calls: the skeleton (one paged call per group, in group order).
        prefill: per call, whether it is a paged prefill (FlashInfer derives its KV
            lengths and longest KV on the host: staged as ``g<i>.kv_lens`` and
            ``g<i>.max_kv_len``) rather than a decode.
        tensor_cores: per call, whether it is a decode on tensor cores (its scheduler
            also reads ``qo_indptr`` and the KV lengths).
        masked: per call, whether it carries a verify's tree mask (its arrays are
            staged after the call's, ``g<i>.mask.*``: eager lanes only).
        manifest_names: the staged arrays' names in buffer order, the job table first.
        region_key: per region, ``(name, divisor, page-map flag)``: each group's page
            ids (divisor 1), then the write slots (divisor the page size); no page map.
        max_kv_names: per paged prefill call, its group index and the name of its
            longest KV among the batch integers (``g<i>.max_kv_len``).
        region_flags: the regions' divisors and page-map flags as the job table takes
            them (:func:`~flashplan.executor.gathers.divisors_and_flags` of
            ``region_key``).
    """

    calls: tuple[GroupCalls, ...]
    prefill: tuple[bool, ...]
    tensor_cores: tuple[bool, ...]
    masked: tuple[bool, ...]
    manifest_names: tuple[str, ...]
    region_key: tuple[tuple[str, int, int], ...]
    max_kv_names: tuple[tuple[int, str], ...]
    region_flags: IntArray = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        flags = divisors_and_flags(tuple([(div, flag) for _, div, flag in self.region_key]))
        object.__setattr__(self, "region_flags", flags)

    @classmethod
    def of(
        cls,
        spec: PlanSpec,
        calls: tuple[GroupCalls, ...],
        *,
        window_pool: bool = False,
        tree_masks: bool = False,
    ) -> PagedLane | None:
        """The lane of ``calls`` (``spec``'s skeleton), or ``None`` where it does not
        apply: a group without a paged call or with a ragged one, a masked call (but a
        verify's tree mask where ``tree_masks``: an eager executor), one with
        multi-item tensors or cascade levels, a group over virtual requests, a
        cross-attention group, a group kept in a sliding-window pool (``window_pool``:
        the executor has a page map), or a skeleton that skips a group. Depends only on
        what the skeleton's key fixes (the executor keeps one per skeleton): in a
        verify plan every masked self group carries a :class:`TreeMask`."""
        plans = spec.group_plans
        if spec.cascade is not None or len(calls) != len(plans):
            return None
        trees = tree_masks and spec.key.mode is Mode.VERIFY
        prefill, tensor_cores = [], []
        for k, gc in enumerate(calls):
            gp = plans[k]
            if (
                gc.group_index != k
                or gc.path not in (KernelPath.DECODE, KernelPath.PAGED)
                or gc.paged is None
                or gc.ragged is not None
                or (gc.masked and not trees)
                or gc.levels
                or gc.paged.item_args
                or gp.virtual is not None
                or gp.group.cross_attention
                or (window_pool and gp.group.uses_window_pool)
                or gp.paged is None
            ):
                return None
            prefill.append(gc.path is KernelPath.PAGED)
            tensor_cores.append(not prefill[-1] and bool(gc.paged.wrapper.use_tensor_cores))
        manifest_names = [names.JOBS]
        if any(prefill) or any(tensor_cores):
            manifest_names.append(names.QO_INDPTR)
        for k, (pf, tc) in enumerate(zip(prefill, tensor_cores, strict=True)):
            manifest_names += [names.group_array(k, "page_indptr"),
                               names.group_array(k, "last_page_len")]  # fmt: skip
            if pf or tc:
                manifest_names.append(names.group_array(k, "kv_lens"))
            if calls[k].masked:
                manifest_names += [names.mask_name(k, field) for field in CUSTOM_MASK_FIELDS]
        pages = tuple((pages_region(k), 1, 0) for k in range(len(calls)))
        masked = tuple(gc.masked for gc in calls)
        max_kv = tuple((k, names.group_int(k, "max_kv_len")) for k, pf in enumerate(prefill) if pf)
        return cls(
            calls, tuple(prefill), tuple(tensor_cores), masked, tuple(manifest_names),
            (*pages, (WRITE, spec.page_size, 0)), max_kv,
        )  # fmt: skip

    def _parts(self, spec: PlanSpec) -> list[JobPart]:
        """The job parts :func:`~flashplan.executor.gathers.job_parts` gives ``spec``."""
        parts: list[JobPart] = []
        for (name, div, flag), gp in zip(self.region_key, spec.group_plans, strict=False):
            part = gp.paged
            assert part is not None
            parts.append((name, part.start_page, part.num_pages, div, flag))
        name, div, flag = self.region_key[-1]
        parts.append((name, spec.write_start, spec.qo_lens, div, flag))
        return parts

    def _arrays(
        self, spec: PlanSpec, masks: dict[int, MaskRecipe], pads: int = 0, tokens: int = 1
    ) -> list[IntArray]:
        """The ``plan()`` arrays in manifest order (after the job table), padded by
        ``pads`` requests of ``tokens`` queries and one key each (a CUDA-graph
        bucket's, which has no masks); each tree mask's recipe goes into ``masks``."""
        arrays: list[IntArray] = []
        if len(self.manifest_names) > 1 and self.manifest_names[1] == names.QO_INDPTR:
            arrays.append(padded_indptr(spec.qo_indptr, pads, tokens))
        lanes = zip(self.prefill, self.tensor_cores, self.masked, spec.group_plans, strict=True)
        for k, (pf, tc, masked, gp) in enumerate(lanes):
            part = gp.paged
            assert part is not None
            spans = part.spans
            arrays += [padded_indptr(spans.pages.indptr, pads, 1),
                       padded_lengths(spans.last_page_len, pads)]  # fmt: skip
            if pf:
                arrays.append(padded_lengths(spans.kv_lens, pads))
            elif tc:
                arrays.append(padded_lengths(decode_scheduler_kv_lens(part), pads))
            if masked:
                # a tree's call reads its N >= 1 draft keys at least: no empty span
                # (which the general path would widen to one page)
                assert isinstance(part.mask, TreeMask)
                mask_arrays, masks[k] = custom_mask_arrays(part.mask)
                arrays += mask_arrays
        return arrays

    def _ints(self, spec: PlanSpec) -> dict[str, int]:
        """The batch integers a paged prefill re-plan reads (eager only: FlashInfer's
        ``plan()`` derives them itself)."""
        if not self.max_kv_names:
            return {}
        ints = {_QO_TOTAL: spec.total_q, _QO_MAX_LEN: spec.max_q_len}
        plans = spec.group_plans
        for k, name in self.max_kv_names:
            part = plans[k].paged
            assert part is not None
            ints[name] = part.spans.max_kv_len
        return ints

    def _plan(
        self,
        jobs: GatherJobs,
        arrays: list[IntArray],
        ints: dict[str, int],
        masks: dict[int, MaskRecipe],
    ) -> DevicePlan:
        arrays.insert(0, jobs.table.reshape(-1))
        manifest = StagingManifest.named(self.manifest_names, tuple([a.shape[0] for a in arrays]))
        return DevicePlan(self.calls, jobs, manifest, tuple(arrays), masks, ints, {})

    def device_plan(self, spec: PlanSpec, rows: IntArray) -> DevicePlan:
        """``spec``'s device work for a table whose request ``i`` sits in ``rows[i]``:
        what :func:`~.staging.device_plan` of the general path gives.

        Raises:
            UnsupportedError: a batch that gathers more entries than int32 offsets
                reach (as the general path).
        """
        rows32 = np.asarray(rows, dtype=np.int32)
        jobs = job_table(self._parts(spec), rows32, spec.batch_size, self.region_flags)
        masks: dict[int, MaskRecipe] = {}
        arrays = self._arrays(spec, masks)
        return self._plan(jobs, arrays, self._ints(spec), masks)

    def bucket_plan(
        self, spec: PlanSpec, rows: IntArray, layout: BucketLayout, bucket: GraphBucket
    ) -> DevicePlan:
        """``spec``'s device work padded to ``bucket`` in its fixed regions (``layout``):
        what the general path gives a CUDA-graph bucket (``spec`` fits it; no batch
        integers: a bucket's wrappers are planned by ``plan()``, which derives them)."""
        bs = spec.batch_size
        jobs = bucket_jobs(self._parts(spec), rows, bs, layout, bucket, self.region_key)
        pads = bucket.batch_size - bs
        assert not any(self.masked), "a bucket's lane has no masks (tree_masks=False)"
        arrays = self._arrays(spec, {}, pads, bucket.tokens_per_request)
        return self._plan(jobs, arrays, {}, {})


def lane_of(
    lanes: dict[int, tuple[tuple[GroupCalls, ...], PagedLane | None]],
    spec: PlanSpec,
    calls: tuple[GroupCalls, ...],
    window_pool: bool,
    tree_masks: bool = False,
) -> PagedLane | None:
    """The paged lane of skeleton ``calls`` (``spec``'s), made once and kept in
    ``lanes`` (an executor's :attr:`~.strategy.OwnedBuffers.lanes`: one executor, one
    ``tree_masks``) by the skeleton tuple's ``id``, checked against it (the entry holds
    the tuple)."""
    held = lanes.get(id(calls))
    if held is not None and held[0] is calls:
        return held[1]
    lane = PagedLane.of(spec, calls, window_pool=window_pool, tree_masks=tree_masks)
    lanes[id(calls)] = (calls, lane)
    return lane
