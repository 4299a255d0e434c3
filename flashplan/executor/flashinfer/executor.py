"""`FlashInferExecutor`: applies a `PlanSpec` to FlashInfer wrappers and runs kernels.

The thin stateful part of flashplan. ``apply(spec, table)``:

1. translates the plan into ``plan()`` call descriptions (:func:`translate`, pure);
2. packs every int32 host array the batch needs into one pinned buffer and
   sends it to the device with a single non-blocking copy;
3. gathers each group's page ids (``kv_indices``) and the new tokens' write slots
   from the page table with Triton kernels, on the device;
4. calls each wrapper's ``plan()`` with pinned host indptrs (so FlashInfer never
   reads back from the device) and the device page ids.

``run(group, q, k_new, v_new, kv_cache)`` writes the new K/V into the cache and
runs the group's kernels; everything a kernel compiles in (window, soft cap,
scale, causal, mask, dtypes) comes from the plan and is never overridden at run
time. Nothing in apply or run waits for the GPU.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from flashplan.errors import PageTableError, PlanMismatchError
from flashplan.executor.checks import check_run_args
from flashplan.executor.flashinfer.calls import (
    BuiltMask,
    GatheredIndices,
    GroupCalls,
    HostArray,
    PlanCall,
    WrapperKey,
    host_arrays,
    translate,
)
from flashplan.executor.flashinfer.merge import merge_states
from flashplan.executor.flashinfer.policy import ExecutorPolicy
from flashplan.kernels.segments import segment_slots
from flashplan.kernels.threshold_mask import build_threshold_mask
from flashplan.layout.group import AttentionGroup
from flashplan.layout.page_table import PageTable
from flashplan.plan.spec import PlanSpec

__all__ = ["FlashInferExecutor"]

_DEFAULT_WORKSPACE_BYTES = 256 * 1024 * 1024


def _import_flashinfer() -> Any:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import flashinfer
    return flashinfer


class _Staging:
    """One batch's host arrays in a pinned int32 buffer, and its device copy."""

    def __init__(self, arrays: list[np.ndarray], device: torch.device) -> None:
        sizes = [a.shape[0] for a in arrays]
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        total = max(int(offsets[-1]), 1)
        # The caching host allocator reuses a pinned block only once the copies that
        # read it have completed (it records an event per copy): no overwrite hazard.
        self.host = torch.empty(total, dtype=torch.int32, pin_memory=True)
        if arrays:
            np.concatenate(arrays, out=self.host.numpy()[: int(offsets[-1])])
        self.device = torch.empty(total, dtype=torch.int32, device=device)
        self.device.copy_(self.host, non_blocking=True)
        self._offsets = offsets

    def host_view(self, index: int) -> torch.Tensor:
        return self.host[int(self._offsets[index]) : int(self._offsets[index + 1])]

    def device_view(self, index: int) -> torch.Tensor:
        return self.device[int(self._offsets[index]) : int(self._offsets[index + 1])]


class FlashInferExecutor:
    """Runs :class:`~flashplan.PlanSpec` s on FlashInfer kernels (CUDA).

    Same contract as :class:`~flashplan.ReferenceExecutor`: ``apply(spec, table)``
    once per batch, then ``run(group, q, k_new, v_new, kv_cache)`` per layer.

    Args:
        device: the CUDA device of the KV cache (default: the current device).
        policy: kernel choices (:class:`ExecutorPolicy`; defaults measured on H200).
        workspace_bytes: size of the float workspace shared by all wrappers.
        page_map: optional int32 device tensor mapping full-pool page ids to the
            page ids of a separate sliding-window KV pool (last entry -1); applied
            to windowed groups' gathered page ids and write slots.
    """

    def __init__(
        self,
        device: torch.device | str | None = None,
        *,
        policy: ExecutorPolicy | None = None,
        workspace_bytes: int = _DEFAULT_WORKSPACE_BYTES,
        page_map: torch.Tensor | None = None,
    ) -> None:
        self._fi = _import_flashinfer()
        self.device = (
            torch.device(device)
            if device is not None
            else torch.device("cuda", torch.cuda.current_device())
        )
        if self.device.type != "cuda":
            raise PlanMismatchError(f"FlashInferExecutor needs a CUDA device, got {self.device}")
        if self.device.index is None:  # "cuda" means the current device; tensors say cuda:N
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.policy = policy or ExecutorPolicy()
        self.sm90 = torch.cuda.get_device_capability(self.device) == (9, 0)
        self._workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=self.device)
        self._wrappers: dict[WrapperKey, Any] = {}
        self.page_map = page_map
        self._spec: PlanSpec | None = None
        self._calls: tuple[GroupCalls, ...] = ()
        self._staging: _Staging | None = None
        self._masks: list[torch.Tensor] = []
        self._slots: dict[bool, tuple[torch.Tensor, torch.Tensor]] = {}

    # -- wrappers -----------------------------------------------------------------------
    def _wrapper(self, key: WrapperKey) -> Any:
        wrapper = self._wrappers.get(key)
        if wrapper is None:
            cls = getattr(self._fi, key.kind.value)
            wrapper = cls(self._workspace, **key.constructor_kwargs())
            self._wrappers[key] = wrapper
        return wrapper

    @property
    def spec(self) -> PlanSpec | None:
        """The plan applied last, or ``None``."""
        return self._spec

    @property
    def calls(self) -> tuple[GroupCalls, ...]:
        """The FlashInfer call descriptions of the applied plan."""
        return self._calls

    # -- apply --------------------------------------------------------------------------
    def apply(self, spec: PlanSpec, table: PageTable) -> None:
        """Plan every wrapper for ``spec``; sync-free.

        Raises:
            PageTableError: the table is too small for the plan or not on this device.
        """
        table.check_covers(spec.pages_needed)
        if table.pages.device != self.device:
            raise PageTableError(
                "pages",
                "the page table must live on the executor's device",
                table_device=str(table.pages.device),
                device=str(self.device),
            )
        calls = translate(spec, self.policy, sm90=self.sm90)
        plan_inputs = host_arrays(calls)

        # One segment per page-table gather: each group's page ids (columns), the new
        # tokens' write slots and the encoder tokens' write slots (tokens).
        bs = spec.batch_size
        ps = spec.page_size
        seg_first: list[np.ndarray] = []
        seg_counts: list[np.ndarray] = []
        seg_dst: list[np.ndarray] = []
        seg_div: list[int] = []
        seg_map: list[int] = []
        regions: dict[object, tuple[int, int]] = {}
        region = 0

        def add(key: object, first: np.ndarray, indptr: np.ndarray, div: int, use_map: int) -> None:
            nonlocal region
            seg_first.append(first)
            seg_counts.append(np.diff(indptr))
            seg_dst.append(indptr[:-1] + region)
            seg_div.append(div)
            seg_map.append(use_map)
            regions[key] = (region, region + int(indptr[-1]))
            region += int(indptr[-1])

        for gc in calls:
            if gc.gather is not None:
                windowed = (
                    self.page_map is not None and spec.group_plans[gc.group_index].group.has_window
                )
                add(gc.group_index, gc.gather.start_page, gc.gather.page_indptr, 1, int(windowed))
        add("new", spec.new_token_start, spec.qo_indptr, ps, 0)
        if spec.encoder_indptr is not None:
            add("encoder", np.zeros(bs, dtype=np.int32), spec.encoder_indptr, ps, 0)
        num_segments = len(seg_div)
        segments = [
            np.tile(table.rows, num_segments),
            np.concatenate(seg_first),
            np.concatenate(seg_counts),
            np.concatenate(seg_dst),
            np.repeat(np.array(seg_div, dtype=np.int32), bs),
            np.repeat(np.array(seg_map, dtype=np.int32), bs),
        ]

        # Everything int32 goes into one pinned buffer -> one H2D copy.
        arrays: list[np.ndarray] = list(segments)
        mask_index: dict[int, int] = {}
        for gc in calls:
            if gc.device_mask is not None:
                dm = gc.device_mask
                mask_index[gc.group_index] = len(arrays)
                arrays += [dm.first_visible, dm.qo_lens, dm.kv_lens, dm.byte_offsets]
        input_index: dict[int, int] = {}
        for host in plan_inputs:
            if host.values.dtype == np.int32:
                input_index[id(host.values)] = len(arrays)
                arrays.append(host.values)
        staging = _Staging(arrays, self.device)

        # Every gather of the batch in one kernel launch.
        out_page = torch.empty(max(region, 1), dtype=torch.int32, device=self.device)
        out_offset = torch.empty_like(out_page)
        view = staging.device_view
        segment_slots(
            table.pages,
            view(0),
            view(1),
            view(2),
            view(3),
            view(4),
            view(5),
            out_page,
            out_offset,
            page_map=self.page_map,
        )
        gathered = {
            key: out_page[lo:hi] for key, (lo, hi) in regions.items() if isinstance(key, int)
        }
        self._slots = {False: self._region(out_page, out_offset, regions["new"])}
        if "encoder" in regions:
            self._slots[True] = self._region(out_page, out_offset, regions["encoder"])

        masks: list[torch.Tensor] = []
        built: dict[int, torch.Tensor] = {}
        for group_index, first in mask_index.items():
            rule = calls[group_index].device_mask
            assert rule is not None
            buf = torch.empty(rule.total_bytes, dtype=torch.uint8, device=self.device)
            build_threshold_mask(
                staging.device_view(first),
                staging.device_view(first + 1),
                staging.device_view(first + 2),
                staging.device_view(first + 3),
                buf,
                rule.max_bytes,
            )
            built[group_index] = buf
            masks.append(buf)

        def resolve(value: Any) -> Any:
            if isinstance(value, HostArray):
                if value.values.dtype == np.int32:
                    return staging.host_view(input_index[id(value.values)])
                pinned = torch.empty(value.values.shape[0], dtype=torch.uint8, pin_memory=True)
                pinned.numpy()[:] = value.values
                masks.append(pinned)
                return pinned
            if isinstance(value, GatheredIndices):
                return gathered[value.group_index]
            if isinstance(value, BuiltMask):
                return built[value.group_index]
            return value

        for gc in calls:
            for call in (gc.paged, gc.ragged):
                if call is not None:
                    self._plan(call, resolve)
        self._spec, self._calls, self._staging, self._masks = spec, calls, staging, masks

    @staticmethod
    def _region(
        out_page: torch.Tensor, out_offset: torch.Tensor, bounds: tuple[int, int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(page id, in-page offset) int32 views of one region of the gather outputs."""
        lo, hi = bounds
        return out_page[lo:hi], out_offset[lo:hi]

    def _plan(self, call: PlanCall, resolve: Any) -> None:
        kwargs = {name: resolve(value) for name, value in call.kwargs}
        self._wrapper(call.wrapper).plan(**kwargs)

    # -- run ----------------------------------------------------------------------------
    def run(
        self,
        group: AttentionGroup,
        q: torch.Tensor,
        k_new: torch.Tensor | None,
        v_new: torch.Tensor | None,
        kv_cache: torch.Tensor,
        *,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attention of one layer of ``group`` on FlashInfer kernels.

        Arguments and results as :meth:`flashplan.ReferenceExecutor.run`: ``q``
        ``[total_q, num_qo_heads, head_dim]``, ``k_new``/``v_new``
        ``[total_q, num_kv_heads, head_dim]`` (encoder rows for a cross group, or
        ``None``), ``kv_cache`` ``[num_pages, 2, page_size, num_kv_heads, head_dim]``;
        returns ``out`` and, with ``return_lse``, float32 base-2 LSE ``[total_q, num_qo_heads]``.

        Raises:
            PlanMismatchError: the group was not planned, or a tensor's shape, dtype
                or device contradicts the plan.
        """
        spec = self._spec
        gp = check_run_args(spec, group, q, k_new, v_new, kv_cache)
        assert spec is not None
        if q.device != self.device:
            raise PlanMismatchError(f"q on {q.device}, executor on {self.device}")
        gc = self._calls[spec.group_plans.index(gp)]
        if k_new is not None and v_new is not None:
            page, offset = self._slots[group.cross_attention]
            if self.page_map is not None and group.has_window:
                page = self.page_map[page.long()]
            kv_cache[page, 0, offset] = k_new
            kv_cache[page, 1, offset] = v_new
        elif gc.ragged is not None:
            raise PlanMismatchError(
                f"group {group.describe()!r} runs on the ragged path: pass k_new and v_new"
            )
        if spec.total_q == 0:
            out = q.new_zeros(q.shape, dtype=spec.heads.out_dtype)
            lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
            return (out, lse) if return_lse else out
        states = []
        if gc.ragged is not None:
            wrapper = self._wrappers[gc.ragged.wrapper]
            states.append(wrapper.run(q, k_new, v_new, return_lse=return_lse or gc.merges))
        if gc.paged is not None:
            wrapper = self._wrappers[gc.paged.wrapper]
            states.append(wrapper.run(q, kv_cache, return_lse=return_lse or gc.merges))
        if gc.merges:
            (o_a, s_a), (o_b, s_b) = states
            out, lse = merge_states(o_a, s_a, o_b, s_b)
            return (out, lse) if return_lse else out
        return states[0]
