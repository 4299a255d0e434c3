"""A page table bound to an executor for its life, and the device work a CUDA graph
captures because of it.

An engine keeps one device page table for the life of the process (int32
``[rows, max_pages]``, rewritten in place between steps). Bound with
:meth:`~flashplan.executor.flashinfer.FlashInferExecutor.bind_page_table`, every apply
takes that very tensor, so a bucket's graph executor can capture the batch's page
gather (and the refresh of its decode wrappers' fixed indptrs) into the graph itself:
a replay's planning then only stages the batch's arrays (one copy) and runs the
decode scheduler where its inputs changed; the gather's launch, and the two copies per
decode wrapper, run inside the replay.

Everything captured reads fixed device addresses: the staged job table and indptrs
(the bucket's staging layout does not change between batches of its key), the bound
table, the bucket's fixed output buffers. An apply whose work would not be the
captured one (another staging buffer or layout: a plan the capture did not cover) is
refused instead of replaying stale pointers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
import torch

from flashplan.errors import PageTableError, PlanMismatchError
from flashplan.layout.page_table import PageTable, checked_num_pages, checked_pages

if TYPE_CHECKING:
    from flashplan.kernels.fused import BoundGatherAndMask

__all__ = ["BoundTable", "CapturedWork", "bound_table"]


@attrs.frozen(eq=False)
class BoundTable:
    """The page table an executor is bound to.

    Attributes:
        pages: int32 ``[rows, max_pages]`` device tensor of page ids (the engine's;
            flashplan only reads it).
        num_pages: the pool size every apply's table states (``None``: unchecked ids
            beyond the pool; the gather's bound on ids is captured with the graph).
        address: ``pages.data_ptr()`` when bound (a tensor given new storage in place
            is refused: a captured gather reads the old address).
    """

    pages: torch.Tensor
    num_pages: int | None
    address: int

    def check(self, table: PageTable) -> None:
        """Refuse a ``table`` that is not the bound one (identity, address, pool size).

        Raises:
            PlanMismatchError: another tensor, or another ``num_pages``.
            PageTableError: the bound tensor was given new storage.
        """
        pages = table.pages
        if pages is not self.pages or table.num_pages != self.num_pages:
            raise PlanMismatchError(
                "table",
                "this executor is bound to a page table (bind_page_table): every apply "
                "takes that tensor, with the num_pages it was bound with",
                bound_shape=tuple(self.pages.shape), num_pages=self.num_pages,
                given_shape=tuple(pages.shape), given_num_pages=table.num_pages,
            )  # fmt: skip
        if pages.data_ptr() != self.address:
            raise PageTableError(
                "pages",
                "the bound page table was given new storage (resized or set_()): a "
                "captured gather reads the old address; bind a new executor's table",
            )


def bound_table(pages: object, device: torch.device, num_pages: object) -> BoundTable:
    """The checked :class:`BoundTable` of ``pages`` for an executor on ``device``: the
    checks of :class:`~flashplan.PageTable`'s ``pages`` and ``num_pages``, and a
    contiguous tensor on ``device``.

    Raises:
        PageTableError: not a dense int32 ``[rows, max_pages]`` tensor, not contiguous,
            not on ``device``; a ``num_pages`` that is not an int ``>= 1``.
    """
    table = checked_pages("pages", pages)
    if not table.is_contiguous():
        raise PageTableError(
            "pages", "a bound page table is a contiguous tensor", shape=tuple(table.shape)
        )
    if table.device != device:
        raise PageTableError(
            "pages", "the page table must live on the executor's device",
            table_device=str(table.device), device=str(device),
        )  # fmt: skip
    return BoundTable(table, checked_num_pages("num_pages", num_pages), table.data_ptr())


@attrs.frozen(eq=False)
class CapturedWork:
    """The device work of an apply that a graph captured (a bound table's bucket).

    Attributes:
        launch: the bound gather launch the graph replays (its job table is the staged
            one of the bucket's layout).
        num_pages: the pool size it was captured with.
        copies: ``(fixed buffer, staged view)`` pairs: each decode wrapper's fixed
            indptr and last-page lengths, refreshed from the staged device copy.
    """

    launch: BoundGatherAndMask
    num_pages: int
    copies: tuple[tuple[torch.Tensor, torch.Tensor], ...]

    def record(self) -> None:
        """Issue the work on the current stream (inside a capture: record it)."""
        self.launch(self.num_pages, 0)
        for dst, src in self.copies:
            dst.copy_(src, non_blocking=True)
