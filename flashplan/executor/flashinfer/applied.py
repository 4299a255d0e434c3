"""What an apply leaves for ``run``: one frozen record per applied batch (or step)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

import flashplan.executor.flashinfer.names as names
from flashplan.executor.gathers import write_region

if TYPE_CHECKING:
    import torch

    from flashplan.executor.flashinfer.buffers import DeviceBuffer, StagedViews
    from flashplan.executor.flashinfer.staging import DevicePlan
    from flashplan.executor.flashinfer.wrapper_plans import Planned
    from flashplan.executor.gathers import Region
    from flashplan.layout.group import AttentionGroup
    from flashplan.layout.page_table import PageTable
    from flashplan.planning.spec import PlanSpec

__all__ = ["AppliedBatch", "level_rows"]


@attrs.frozen(eq=False)
class AppliedBatch:
    """One applied plan (a whole batch, or one step of a multi-step draft).

    Attributes:
        spec: the plan.
        dplan: its device work (calls, gather jobs with this batch's or step's region
            names, staging manifest).
        table: the page table it was applied with.
        planned: the planned wrapper of each call, by ``(group index, part)``.
        page: int32 device buffer of gathered page ids (regions: ``dplan.jobs``).
        offset: int32 device buffer of gathered in-page offsets (-1: no slot).
        positions: the device buffer ``positions()`` fills for this plan.
        level_rows: per cascade level, int32 device ``[rows]``: the batch query row of
            each of the level call's rows (a view of the staged ``l<k>.q_rows``), or
            ``None`` where the level's call covers every row in batch order.
    """

    spec: PlanSpec
    dplan: DevicePlan
    table: PageTable
    planned: Planned
    page: torch.Tensor
    offset: torch.Tensor
    positions: DeviceBuffer
    level_rows: tuple[torch.Tensor | None, ...] = ()

    def write_region(self, group: AttentionGroup, window_pool: bool) -> Region:
        """The gather region of ``group``'s write slots
        (:func:`~flashplan.executor.gathers.write_region`)."""
        return self.dplan.jobs.region(write_region(group, window_pool))


def level_rows(spec: PlanSpec, staged: StagedViews) -> tuple[torch.Tensor | None, ...]:
    """Per cascade level, the staged device view of its query rows (``None`` where the
    level's call covers every row in batch order, and nothing is staged)."""
    cascade = spec.cascade
    if cascade is None:
        return ()
    total = spec.total_q
    return tuple(
        staged[names.level_array(k, "q_rows")] if level.leaves_rows_out(total) else None
        for k, level in enumerate(cascade.levels.levels)
    )
