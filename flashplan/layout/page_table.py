"""`PageTable`: where each request's KV pages live."""

from __future__ import annotations

import attrs
import numpy as np
import torch

from flashplan.errors import LayoutError, PageTableError
from flashplan.layout.arrays import ArrayLike, IntArray, as_lengths, cumsum0

__all__ = ["PageTable"]


def _check_pages(
    instance: PageTable, attribute: attrs.Attribute[torch.Tensor], value: torch.Tensor
) -> None:
    if (
        not isinstance(value, torch.Tensor)
        or value.dtype != torch.int32
        or value.dim() != 2
        or value.shape[1] < 1
    ):
        raise PageTableError(
            "pages",
            "must be an int32 tensor [rows, max_pages] with max_pages >= 1",
            dtype=getattr(value, "dtype", type(value)),
            shape=tuple(getattr(value, "shape", ())),
        )


def _rows(rows: ArrayLike) -> IntArray:
    try:
        return as_lengths("rows", rows)
    except PageTableError:
        raise
    except LayoutError as err:
        raise PageTableError(err.field, err.message, request=err.request, **err.values) from None


@attrs.frozen(eq=False)
class PageTable:
    """A page-id table and the row of each request.

    Logical token ``t`` of request ``i`` lives in slot ``t % page_size`` of page
    ``pages[rows[i], t // page_size]``. With ``page_size = 1`` this is sglang's
    ``req_to_token`` table.

    Attributes:
        pages: int32 tensor ``[num_rows, max_pages]`` of page ids, on any device
            (the executors gather from it on the cache's device).
        rows: host int32 array ``[bs]``: the table row of each request.
    """

    pages: torch.Tensor = attrs.field(validator=_check_pages)
    rows: IntArray = attrs.field(converter=lambda r: _rows(r))

    def __attrs_post_init__(self) -> None:
        num_rows = self.pages.shape[0]
        bad = np.flatnonzero(self.rows >= num_rows)
        if bad.size:
            i = int(bad[0])
            raise PageTableError(
                "rows",
                "row out of range of the table",
                request=i,
                row=int(self.rows[i]),
                num_rows=num_rows,
            )

    @property
    def batch_size(self) -> int:
        """Number of requests the table addresses."""
        return int(self.rows.shape[0])

    @property
    def max_pages(self) -> int:
        """Columns of the table: the most pages one request may use."""
        return int(self.pages.shape[1])

    def check_covers(self, pages_needed: IntArray) -> None:
        """Raise :class:`PageTableError` unless every request has room for its pages.

        Args:
            pages_needed: int32 ``[bs]``, pages each request uses (from the plan).
        """
        if pages_needed.shape[0] != self.batch_size:
            raise PageTableError(
                "rows",
                "batch size differs from the plan",
                table_batch_size=self.batch_size,
                plan_batch_size=int(pages_needed.shape[0]),
            )
        bad = np.flatnonzero(pages_needed > self.max_pages)
        if bad.size:
            i = int(bad[0])
            raise PageTableError(
                "pages",
                "table row too short for the request's KV",
                request=i,
                pages_needed=int(pages_needed[i]),
                max_pages=self.max_pages,
            )

    @classmethod
    def sequential(
        cls,
        pages_needed: ArrayLike,
        *,
        max_pages: int | None = None,
        first_page: int = 0,
        device: torch.device | str = "cpu",
    ) -> PageTable:
        """A table giving request ``i`` its own consecutive pages, one row each.

        Handy for demos and tests: request ``i`` gets pages
        ``first_page + sum(pages_needed[:i]) + [0, pages_needed[i])``; unused
        slots hold 0.

        Args:
            pages_needed: int ``[bs]`` pages per request (e.g. ``spec.pages_needed``).
            max_pages: table width (default: the largest request, at least 1).
        """
        need = as_lengths("pages_needed", pages_needed)
        width = max(int(need.max()) if need.size else 0, 1) if max_pages is None else max_pages
        starts = cumsum0(need)[:-1].astype(np.int64) + first_page
        cols = np.arange(width, dtype=np.int64)
        table = np.where(cols[None, :] < need[:, None], starts[:, None] + cols[None, :], 0)
        pages = torch.from_numpy(table.astype(np.int32)).to(device)
        return cls(pages=pages, rows=np.arange(need.shape[0], dtype=np.int32))
