"""The device work of an apply: one staging copy, one fused gather (+ mask) launch, the
multi-item and position fills. Functions over a buffers strategy
(:mod:`~flashplan.executor.flashinfer.strategy`); none waits for the GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import numpy as np
import torch

import flashplan.executor.flashinfer.names as names
from flashplan.errors import PlanMismatchError
from flashplan.executor.flashinfer.buffers import DeviceBuffer
from flashplan.executor.flashinfer.caches import MaskKey, mask_layout
from flashplan.executor.flashinfer.names import JOBS
from flashplan.executor.flashinfer.staging import DevicePlan
from flashplan.kernels.fused import (
    BoundGatherAndMask,
    StagedMask,
    bind_gather_and_mask,
    launch_gather_and_mask,
)
from flashplan.kernels.runs import fill_runs

if TYPE_CHECKING:
    from flashplan.executor.flashinfer.bound_table import CapturedWork
    from flashplan.executor.flashinfer.buffers import PinnedSlot, StagedViews
    from flashplan.executor.flashinfer.calls import MaskRecipe
    from flashplan.executor.flashinfer.strategy import BuffersStrategy, OwnedBuffers
    from flashplan.executor.gathers import Region
    from flashplan.layout.page_table import PageTable
    from flashplan.planning.spec import PlanSpec

__all__ = [
    "fill_item_positions",
    "fill_positions",
    "gather_and_mask",
    "region_view",
    "stage",
    "staged_mask",
    "upload",
]

#: Device gather results: int32 page ids and in-page offsets (whole buffers; regions
#: are read through the job table's bounds).
Gathered = tuple[torch.Tensor, torch.Tensor]


def upload(
    owned: OwnedBuffers,
    target: DeviceBuffer,
    total: int,
    write: Callable[[np.ndarray], object],
    memo: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None,
) -> tuple[torch.Tensor, PinnedSlot]:
    """``write`` ``total`` int32 entries into an idle pinned slot, then one non-blocking
    copy of them into ``target``. The slot takes the owner's next timeline mark, which
    the caller makes (``owned.timeline.mark``) once the rest of its work is queued too
    (the slot is returned for callers that keep it). ``memo`` keeps the
    copy's two ``[:total]`` views per slot, keyed by the slot tensor's ``id`` and
    checked against it (for a caller whose ``target`` and ``total`` it is tied to:
    :attr:`~flashplan.executor.flashinfer.caches.LayoutMemo.uploads`)."""
    slot = owned.ring.acquire(total)
    write(slot.array)
    key = id(slot.host)
    pair = memo.get(key) if memo is not None else None
    if pair is None or pair[0] is not slot.host:
        pair = (slot.host, target.get(total), slot.host[:total])
        if memo is not None:
            memo[key] = pair
    pair[1].copy_(pair[2], non_blocking=True)
    slot.mark = owned.timeline.upcoming  # the copy is queued: the next mark frees the slot
    return pair[1], slot


def stage(owned: OwnedBuffers, dplan: DevicePlan) -> tuple[PinnedSlot, StagedViews, StagedViews]:
    """Upload the staging data: the slot (freed by the caller's next timeline mark, as
    :func:`upload` says) and the named views
    of both sides (made once per buffer and manifest; the copy's own views are kept
    with the device views)."""
    total = dplan.manifest.total
    device = owned.views.of(owned.staged.reserve(total), dplan.manifest)
    _, slot = upload(owned, owned.staged, total, dplan.write_into, memo=device.memo.uploads)
    return slot, owned.views.of(slot.host, dplan.manifest), device


def region_view(views: StagedViews, page: torch.Tensor, region: Region) -> torch.Tensor:
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


def gather_and_mask(
    strategy: BuffersStrategy, dplan: DevicePlan, views: StagedViews, table: PageTable
) -> tuple[Gathered, dict[int, torch.Tensor]]:
    """The gather and the first masked group's mask in one launch, any further mask in
    its own: ((page ids, in-page offsets), each masked group's mask). ``views`` are the
    named views of the device copy of the staging data. A graph that captured the
    gather (:class:`~flashplan.executor.flashinfer.bound_table.CapturedWork`) replays
    it: nothing is launched here, once the batch's gather is checked to be the
    captured one."""
    owned, page_map = strategy.owned, strategy.settings.page_map
    jobs = dplan.jobs
    page, offset = strategy.gather_out(max(jobs.total, 1))
    if strategy.captured is not None:
        _check_captured(strategy.captured, views)
        return (page, offset), {}
    built: dict[int, torch.Tensor] = {}
    fused = None
    for index, recipe in dplan.masks.items():
        out = strategy.mask_out(index, recipe.total_bytes)
        mask = staged_mask(dplan, views, index, recipe, out)
        built[index] = mask.out
        if fused is None:
            fused = mask
        else:  # a batch's second and later masked groups: a launch each
            mask.build()
    # [6, num_jobs] (none when the jobs gather nothing)
    job_table = _job_table(views) if jobs.total else views.tensor[:0].view(6, 0)
    num_pages = table.num_pages or 0
    launch = _bound_launch(strategy, views, table.pages, job_table, page, offset, fused)
    owned.launched = launch
    if launch is not None:
        launch(num_pages, fused.max_bytes if fused is not None else 0)
    else:
        launch_gather_and_mask(
            table.pages, job_table, page, offset, page_map=page_map, num_pages=num_pages,
            status=owned.status, mask=fused, direct=owned.direct,
        )  # fmt: skip
    return (page, offset), built


def _check_captured(captured: CapturedWork, views: StagedViews) -> None:
    """Refuse a batch whose gather is not the one a graph captured (its staging
    buffer or layout changed: the captured launch would read stale addresses)."""
    held = views.memo.launch
    if held is None or held[1] is not captured.launch:
        raise PlanMismatchError(
            "spec",
            "this graph captured its page gather for another staging layout; a plan of "
            "the bucket's key keeps the layout, so this one differs from the captured "
            "plan's (capture a graph for it)",
        )


def _bound_launch(
    strategy: BuffersStrategy,
    views: StagedViews,
    pages: torch.Tensor,
    job_table: torch.Tensor,
    page: torch.Tensor,
    offset: torch.Tensor,
    mask: StagedMask | None,
) -> BoundGatherAndMask | None:
    """The fused launch bound to these tensors (:func:`bind_gather_and_mask`), made once
    per layout, mask layout and set of buffers (kept in the views' memo and checked
    against all three); ``None``: launch unbound."""
    page_map, status = strategy.settings.page_map, strategy.owned.status
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
        direct=strategy.owned.direct,
    )  # fmt: skip
    if bound is not None:
        views.memo.launch = (layout, bound)
    return bound


def staged_mask(
    dplan: DevicePlan, views: StagedViews, index: int, recipe: MaskRecipe, out: torch.Tensor
) -> StagedMask:
    """Group ``index``'s mask: its inputs as offsets into the staged device tensor
    (``views.tensor``), built into ``out`` (made once per layout, :class:`MaskKey` and
    output buffer; a batch with another largest mask only replaces ``max_bytes``)."""
    key = MaskKey(index, recipe.num_tokens, recipe.position)
    held = views.memo.masks.get(key)
    if held is not None and held.out is out:
        if held.max_bytes != recipe.max_bytes:  # the batch's own size, same arrays
            held = views.memo.masks[key] = held._replace(max_bytes=recipe.max_bytes)
        return held
    manifest, num_tokens = dplan.manifest, recipe.num_tokens

    def at(field: names.MaskField) -> int:
        return manifest[names.mask_name(index, field)].offset

    qo = manifest[names.mask_name(index, "qo_lens")]
    more = (0, 0, 0)
    if num_tokens:
        more = (at("row_offsets"), at("tail_start"), at("tail_words"))
    if recipe.position:  # the kernel's slots: rule, column positions, row positions
        more = (at("rule"), at("col_position"), 0)
        first = at("row_position")
    else:
        first = at("first_visible")
    # each request's first byte: the first bs entries of FlashInfer's mask_indptr
    mask = StagedMask(
        views.tensor, first, qo.offset, at("kv_lens"), at("indptr"),
        *more, qo.size, num_tokens, recipe.max_bytes, out, recipe.position,
    )  # fmt: skip
    views.memo.masks[key] = mask
    return mask


def fill_item_positions(
    owned: OwnedBuffers, dplan: DevicePlan, staged: Mapping[str, torch.Tensor], name: str
) -> torch.Tensor:
    """FlashInfer's uint16 ``token_pos_in_items`` for the items staged under ``name``
    (:class:`~flashplan.executor.flashinfer.calls.ItemPositions`): zeroed, then every
    item's 1, 2, … written by one launch. Each name has its own buffer: FlashInfer
    keeps the tensor until the wrapper is planned again."""
    size = dplan.ints[names.item_part(name, "size")]
    buf = owned.item_bufs.get(name)
    if buf is None:
        buf = owned.item_bufs[name] = DeviceBuffer(owned.device, torch.int16)
    out = buf.reserve(max(size, 1))[:size]
    out.zero_()  # int16: torch fills few uint16 tensors; the bytes are the same
    out = out.view(torch.uint16)
    fill_runs(
        staged[names.item_part(name, "start")],
        1,
        staged[names.item_part(name, "length")],
        out,
        dplan.ints[names.item_part(name, "longest")],
    )
    return out


def fill_positions(
    owned: OwnedBuffers, spec: PlanSpec, out_buffer: DeviceBuffer, stream: torch.cuda.Stream
) -> torch.Tensor:
    """``spec``'s RoPE positions, int32 ``[total_q]``, built on the device into
    ``out_buffer``: its position runs (three int32 per run) in one copy, one fill
    launch."""
    runs = spec.position_runs
    n = runs.num_runs
    columns = (runs.start, runs.first, runs.length)
    staged, _ = upload(
        owned, owned.runs_staged, max(3 * n, 1), lambda a: np.concatenate(columns, out=a[: 3 * n])
    )
    out = out_buffer.get(spec.total_q)
    fill_runs(staged[:n], staged[n : 2 * n], staged[2 * n : 3 * n], out, runs.max_length)
    owned.timeline.mark(stream)
    return out
