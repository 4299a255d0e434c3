"""The checked mode (``check_pages=True``): the gathered ids and write slots read back
and checked, raising :class:`~flashplan.PageTableError` naming the request. Every
function here syncs: that is the mode's documented cost."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

import flashplan.executor.flashinfer.names as names
from flashplan.errors import PageTableError
from flashplan.executor.checks import first_shared_slot

if TYPE_CHECKING:
    from flashplan.executor.checks import RunArgs
    from flashplan.executor.flashinfer.applied import AppliedBatch
    from flashplan.executor.flashinfer.staging import DevicePlan
    from flashplan.layout.group import AttentionGroup
    from flashplan.layout.page_table import PageTable
    from flashplan.planning.spec import PlanSpec

__all__ = ["check_cache_pages", "check_gathered"]


def check_gathered(
    dplan: DevicePlan, spec: PlanSpec, table: PageTable, page: torch.Tensor, offset: torch.Tensor
) -> None:
    """Raise for a bad page id, or two tokens writing one cache slot."""
    jobs = dplan.jobs
    off = offset[: jobs.total].cpu().numpy()  # the documented sync of this mode
    pg = page[: jobs.total].cpu().numpy()
    bad = np.flatnonzero(off < 0)
    if bad.size:
        _raise_bad(dplan, spec, table, int(bad[0]), "is not a valid page id")
    for r in jobs.regions:
        if names.is_pages_region(r.name):
            continue
        shared = first_shared_slot(
            pg[r.lo : r.hi].astype(np.int64) * spec.page_size + off[r.lo : r.hi]
        )
        if shared is not None:
            entry = r.lo + shared[1]
            _raise_bad(dplan, spec, table, entry, "is a cache slot another token writes")


def _raise_bad(dplan: DevicePlan, spec: PlanSpec, table: PageTable, entry: int, what: str) -> None:
    jobs = dplan.jobs
    job = int(np.searchsorted(jobs.dst, entry, side="right")) - 1
    region = next(r for r in jobs.regions if r.lo <= entry < r.hi)
    request = job % max(spec.batch_size, 1)
    raise PageTableError(
        "pages",
        f"an entry the plan gathers for {region.name!r} {what}",
        request=request,
        row=int(table.rows[request]),
    )


def check_cache_pages(
    batch: AppliedBatch, args: RunArgs, group: AttentionGroup, num_pages: int, window_pool: bool
) -> None:
    """Every id this run reads or writes is inside the cache of ``num_pages`` pages."""
    regions = []
    if args.plan.paged is not None:
        regions.append(names.pages_region(args.index))
    if args.writes:
        regions.append(batch.write_region(group, window_pool).name)
    for name in regions:
        r = batch.dplan.jobs.region(name)
        ids = batch.page[r.lo : r.hi]
        if r.size and int(ids.max()) >= num_pages:  # the documented sync of this mode
            entry = r.lo + int(torch.argmax((ids >= num_pages).to(torch.int8)))
            _raise_bad(
                batch.dplan, batch.spec, batch.table, entry,
                f"is beyond the KV cache's {num_pages} pages",
            )  # fmt: skip
