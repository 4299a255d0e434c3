"""`PageTable`: where each request's KV pages live."""

from __future__ import annotations

import attrs
import numpy as np
import torch

from flashplan.arrays import INT32_MAX, IntArray, array_key, indptr
from flashplan.errors import LayoutError, PageTableError
from flashplan.layout.convert import ArrayLike, as_int, as_lengths

__all__ = ["PageTable"]


def checked_pages(field: str, value: object) -> torch.Tensor:
    """``value`` if it is a page-id table (:attr:`PageTable.pages`'s check).

    Raises:
        PageTableError: not a dense int32 ``[rows, max_pages]`` tensor with
            ``max_pages >= 1``.
    """
    if (
        not isinstance(value, torch.Tensor)
        or value.dtype != torch.int32
        or value.dim() != 2
        or value.shape[1] < 1
        or value.layout != torch.strided
    ):
        raise PageTableError(
            field,
            "must be a dense int32 tensor [rows, max_pages] with max_pages >= 1",
            dtype=getattr(value, "dtype", type(value).__name__),
            shape=tuple(getattr(value, "shape", ())),
        )
    return value


def _as_table_error(err: LayoutError) -> PageTableError:
    return PageTableError(err.field, err.message, request=err.request, **err.values)


def _rows(field: str, value: object) -> IntArray:
    try:
        return as_lengths(field, value)
    except PageTableError:
        raise
    except LayoutError as err:
        raise _as_table_error(err) from None


def _first_shared_row(rows: IntArray) -> tuple[int, int] | None:
    """``(earlier, later)`` requests of the first pair that share a row, or ``None``."""
    if rows.size < 2:
        return None
    order = np.argsort(rows, kind="stable")
    same = rows[order[1:]] == rows[order[:-1]]
    if not same.any():
        return None
    later = order[1:][same]
    earlier = order[:-1][same]
    k = int(np.argmin(later))
    return int(earlier[k]), int(later[k])


def checked_num_pages(field: str, value: object) -> int | None:
    """``value`` as a pool size, or ``None`` (:attr:`PageTable.num_pages`'s check).

    Raises:
        PageTableError: not an int ``>= 1`` (bools, floats and strings included).
    """
    if value is None:
        return None
    try:
        return as_int(field, value, minimum=1)
    except LayoutError as err:
        raise _as_table_error(err) from None


@attrs.frozen(eq=False)
class PageTable:
    """A page-id table and the row of each request.

    Row token ``t`` of request ``i`` lives in slot ``t % page_size`` of page
    ``pages[rows[i], t // page_size]``. With ``page_size = 1`` this is sglang's
    ``req_to_token`` table. Columns that a plan neither reads nor writes may hold
    anything (padding ids such as ``-1`` or ``2**31 - 1``).

    The record compares by identity: ``pages`` is a (possibly device) tensor whose
    values may change between steps, so value equality would need a device read.

    Attributes:
        pages: int32 tensor ``[num_rows, max_pages]`` of page ids, on any device
            (the executors gather from it on the cache's device).
        rows: host int32 array ``[bs]``: the table row of each request, distinct.
        num_pages: the size of the page pool the ids point into, or ``None``. When
            given, the executors check every id a plan uses against it
            (:class:`~flashplan.ReferenceExecutor` always checks against the cache).
    """

    pages: torch.Tensor = attrs.field(converter=lambda v: checked_pages("pages", v))
    rows: IntArray = attrs.field(converter=lambda v: _rows("rows", v), eq=array_key)
    num_pages: int | None = attrs.field(
        default=None, converter=lambda v: checked_num_pages("num_pages", v)
    )

    def __attrs_post_init__(self) -> None:
        num_rows = self.pages.shape[0]
        out = self.rows >= num_rows
        shared = _first_shared_row(self.rows)
        first_out = int(np.flatnonzero(out)[0]) if out.any() else None
        if first_out is not None and (shared is None or first_out <= shared[1]):
            raise PageTableError(
                "rows",
                "row out of range of the table",
                request=first_out,
                row=int(self.rows[first_out]),
                num_rows=num_rows,
            )
        if shared is not None:
            raise PageTableError(
                "rows",
                "two requests share a table row (they would overwrite each other's KV)",
                request=shared[1],
                row=int(self.rows[shared[1]]),
                other_request=shared[0],
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
        if pages_needed.size and int(np.maximum.reduce(pages_needed)) > self.max_pages:
            i = int(np.flatnonzero(pages_needed > self.max_pages)[0])
            raise PageTableError(
                "pages",
                "table row too short for the request's KV",
                request=i,
                pages_needed=int(pages_needed[i]),
                max_pages=self.max_pages,
            )

    # -- named constructors -------------------------------------------------------------
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
        slots hold 0. ``num_pages`` is set to the pool this implies.

        Args:
            pages_needed: int ``[bs]`` pages per request (e.g. ``spec.pages_needed``).
            max_pages: table width (default: the largest request, at least 1).
            first_page: id of the first page handed out.

        Raises:
            PageTableError: a page id would exceed int32.
        """
        need = _table_lengths("pages_needed", pages_needed)
        width = _width(need, max_pages, 0)
        first = _table_int("first_page", first_page, minimum=0)
        starts = indptr(need, "pages_needed")[:-1].astype(np.int64) + first
        end = first + int(need.sum())
        if end > INT32_MAX:
            raise PageTableError(
                "first_page", "page ids would exceed int32", first_page=first, last_page=end - 1
            )
        cols = np.arange(width, dtype=np.int64)
        table = np.where(cols[None, :] < need[:, None], starts[:, None] + cols[None, :], 0)
        pages = torch.from_numpy(table.astype(np.int32)).to(device)
        rows = np.arange(need.shape[0], dtype=np.int32)
        return cls(pages=pages, rows=rows, num_pages=max(end, 1))

    @classmethod
    def draft_branches(
        cls,
        table: PageTable,
        prefix_lens: ArrayLike,
        topk: int,
        branch_pages: torch.Tensor,
        *,
        page_size: int,
        num_pages: int | None = None,
    ) -> PageTable:
        """The table of a multi-step draft decode: one row per branch.

        Row ``i * topk + b`` is branch ``b`` of request ``i``: the request's full prefix
        pages (``prefix_lens[i] // page_size`` columns of its row in ``table``, shared,
        never written), then the branch's own ``branch_pages[i, b]``. With
        ``page_size > 1`` the engine copies the prefix's partial last page into each
        branch's first own page (its K/V for every layer) before the draft steps; with
        ``page_size = 1`` the own pages are the branch's draft-token slots. Built on the
        table's device with a few tensor ops: no sync.

        Args:
            table: the requests' table (its ``rows`` give each request's row).
            prefix_lens: int ``[bs]`` (tokens) host prefix lengths.
            topk: branches per request.
            branch_pages: int32 ``[bs, topk, pages_per_branch]`` on the table's device
                (``DraftDecode.branch_pages`` pages per branch suffice).
            page_size: tokens per page.
            num_pages: the pool size both tables' ids point into, if known.

        Raises:
            PageTableError: shapes or devices that do not match.
        """
        prefix = _table_lengths("prefix_lens", prefix_lens)
        k = _table_int("topk", topk, minimum=1)
        bs = int(prefix.shape[0])
        if bs != table.batch_size:
            raise PageTableError(
                "prefix_lens",
                "batch size differs from the table",
                table_batch_size=table.batch_size,
            )
        if (
            not isinstance(branch_pages, torch.Tensor)
            or branch_pages.dtype != torch.int32
            or branch_pages.dim() != 3
            or tuple(branch_pages.shape[:2]) != (bs, k)
            or branch_pages.device != table.pages.device
        ):
            raise PageTableError(
                "branch_pages",
                f"must be an int32 tensor [bs={bs}, topk={k}, pages] on {table.pages.device}",
                shape=tuple(getattr(branch_pages, "shape", ())),
            )
        ps = _table_int("page_size", page_size, minimum=1)
        dev = table.pages.device
        own = int(branch_pages.shape[2])
        full = prefix.astype(np.int64) // ps  # shared full pages per request
        widest = int(full.max()) if bs else 0
        if widest > table.max_pages:
            i = int(np.flatnonzero(full > table.max_pages)[0])  # the first offender
            raise PageTableError(
                "prefix_lens", "the table row is shorter than the prefix", request=i,
                full_pages=int(full[i]), max_pages=table.max_pages,
            )  # fmt: skip
        width = max(widest + own, 1)
        rows = torch.from_numpy(np.repeat(table.rows.astype(np.int64), k)).to(dev)
        shared = table.pages[rows]  # [bs * topk, max_pages]
        if shared.shape[1] < width:
            pad = shared.new_zeros(shared.shape[0], width - shared.shape[1])
            shared = torch.cat([shared, pad], dim=1)
        cols = torch.arange(width, device=dev)[None, :]
        full_t = torch.from_numpy(np.repeat(full, k)).to(dev)[:, None]
        mine = branch_pages.reshape(bs * k, own)
        index = (cols - full_t).clamp(0, max(own - 1, 0))
        pages = torch.where(cols < full_t, shared[:, :width], torch.gather(mine, 1, index))
        return cls(pages.contiguous(), np.arange(bs * k, dtype=np.int32), num_pages)

    @classmethod
    def shuffled(
        cls,
        pages_needed: ArrayLike,
        *,
        seed: int = 0,
        spare_pages: int = 3,
        extra_rows: int = 1,
        extra_columns: int = 0,
        device: torch.device | str = "cpu",
    ) -> PageTable:
        """A table as a running engine leaves it, for tests, demos and benchmarks.

        Every request gets its own pages, but the ids are a random permutation of the
        pool (not consecutive, not ordered), the pool has ``spare_pages`` pages that
        nobody uses, the table has ``extra_rows`` rows that belong to no request, each
        request sits in a random row, and unused entries hold random valid ids, which
        planners must never read. ``num_pages`` is the pool size.

        Args:
            pages_needed: int ``[bs]`` pages per request (e.g. ``spec.pages_needed``).
            seed: seed of the shuffles (numpy's ``default_rng``).
            spare_pages, extra_rows, extra_columns: sizes of the unused parts (>= 0).
        """
        need = _table_lengths("pages_needed", pages_needed)
        spare = _table_int("spare_pages", spare_pages, minimum=0)
        n_extra = _table_int("extra_rows", extra_rows, minimum=0)
        rng = np.random.default_rng(_table_int("seed", seed, minimum=0, maximum=2**63 - 1))
        bs = int(need.shape[0])
        pool = int(need.sum()) + spare
        if pool > INT32_MAX:
            raise PageTableError("pages_needed", "the pool exceeds int32 pages", pool=pool)
        width = _width(need, None, _table_int("extra_columns", extra_columns, minimum=0))
        ids = rng.permutation(pool)
        rows = rng.permutation(bs + n_extra)[:bs]
        table = rng.integers(0, max(pool, 1), size=(bs + n_extra, width), dtype=np.int64)
        starts = indptr(need, "pages_needed").astype(np.int64)
        cols = np.arange(width, dtype=np.int64)
        used = cols[None, :] < need[:, None]
        src = np.where(used, starts[:-1, None] + cols[None, :], 0)
        table[rows[:, None].repeat(width, 1)[used], np.broadcast_to(cols, used.shape)[used]] = (
            ids[src[used]] if pool else 0
        )
        pages = torch.from_numpy(table.astype(np.int32)).to(device)
        return cls(pages=pages, rows=rows.astype(np.int32), num_pages=max(pool, 1))


def _table_int(field: str, value: object, *, minimum: int, maximum: int = INT32_MAX) -> int:
    try:
        return as_int(field, value, minimum=minimum, maximum=maximum)
    except LayoutError as err:
        raise _as_table_error(err) from None


def _table_lengths(field: str, value: object) -> IntArray:
    try:
        return as_lengths(field, value)
    except LayoutError as err:
        raise _as_table_error(err) from None


def _width(need: IntArray, max_pages: int | None, extra: int) -> int:
    if max_pages is not None:  # may be too narrow: check_covers then refuses the batch
        return _table_int("max_pages", max_pages, minimum=1)
    return max((int(need.max()) if need.size else 0) + extra, 1)
