"""Per-request lengths and the page math, written once for layouts and plans.

* :func:`ceil_pages` and :func:`page_split`: the pages that hold ``t`` tokens, and how
  many tokens the last of them holds. Every page count in flashplan comes from these
  two (the layout's ``pages_needed``, the encoder's pages, a kernel call's pages).
* :class:`Lengths`: lengths with their index pointers and maximum (as xformers'
  ``_SeqLenInfo``): a plan's queries, a ragged call's keys, a paged call's pages.
* :class:`PageSpans`: spans ``[first_token, end_token)`` of page-table rows and the
  pages a paged kernel reads for them.

Records here follow attrs' advice: the generated ``__init__`` stores the fields, and the
named constructors (:meth:`Lengths.from_lens`, :meth:`PageSpans.between`, …) convert,
check and derive. Everything is host data: read-only int32 numpy arrays.
"""

from __future__ import annotations

import functools
from functools import cached_property

import attrs
import numpy as np
import numpy.typing as npt

from flashplan.arrays import (
    IntArray,
    array_key,
    constant_operand,
    filled,
    indptr,
    int32_field,
    readonly_when_unpickled,
    same_length,
    seal_inplace,
)
from flashplan.errors import LayoutError
from flashplan.layout.convert import as_int

__all__ = ["Lengths", "PageSpans", "ceil_pages", "page_split"]


def ceil_pages(tokens: npt.NDArray[np.integer], page_size: int) -> npt.NDArray[np.integer]:
    """``ceil(tokens / page_size)`` (pages), for ``tokens >= 0``, as a fresh array of
    ``tokens``' dtype: ``(tokens - 1) // page_size + 1``, which is 0 for 0 tokens and
    holds no sum that could wrap."""
    one = constant_operand(1, tokens.dtype)
    pages = (tokens - one) // constant_operand(page_size, tokens.dtype)
    pages += one
    return pages


def page_split(
    tokens: IntArray, page_size: int, *, fewest: int | None = None
) -> tuple[IntArray, IntArray]:
    """``(pages, last_page_len)`` of int32 ``tokens >= 0``, both fresh int32 ``[n]``:
    :func:`ceil_pages`, and the tokens of the last page, in ``[1, page_size]`` (0 for 0
    tokens, which have no page), so that ``(pages - 1) * page_size + last_page_len``
    gives back ``tokens``. One ``divmod`` of ``tokens - 1`` gives both (a shift and a
    mask for a power-of-two page size). ``fewest``: ``tokens``' minimum, when the caller
    has it."""
    one = constant_operand(1)
    if page_size == 1:  # a page per token, each holding one
        pages, last = tokens.copy(), np.ones_like(tokens)
    elif page_size & (page_size - 1) == 0:  # a power of two: a shift and a mask
        before = tokens - one
        pages = before >> constant_operand(page_size.bit_length() - 1)
        last = before & constant_operand(page_size - 1)
        pages += one
        last += one
    else:
        pages, last = np.divmod(tokens - one, constant_operand(page_size))
        pages += one
        last += one
    if fewest is None:
        fewest = int(np.minimum.reduce(tokens)) if tokens.size else 1
    if fewest == 0:
        last[tokens == 0] = 0  # divmod(-1, ps) = (-1, ps - 1): no page, no last page
    return pages, last


@readonly_when_unpickled
@attrs.frozen
class Lengths:
    """Per-request lengths (tokens or pages) with their index pointers and maximum.

    Build it with :meth:`from_lens` or :meth:`uniform`; ``__init__`` stores what they
    derived.

    >>> n = Lengths.from_lens([3, 0, 2], "extend_lens")
    >>> n.indptr.tolist(), n.max_len, n.total
    ([0, 3, 3, 5], 3, 5)

    Attributes:
        lens: int32 ``[bs]``, each ``>= 0``.
        indptr: int32 ``[bs + 1]``: ``[0, l0, l0 + l1, …]`` (entry ``i`` is where
            request ``i``'s rows begin).
    """

    lens: IntArray = attrs.field(eq=array_key)
    indptr: IntArray = attrs.field(eq=False)  # follows from lens

    @classmethod
    def from_lens(cls, lens: object, field: str = "lengths") -> Lengths:
        """From lengths (any 1-D integer array; a sealed int32 one is kept).

        Raises:
            LayoutError: not 1-D integers, a negative length (naming the request) or a
                total beyond int32 (naming ``field``).
        """
        values = int32_field(field, lens)
        if values.size and np.minimum.reduce(values) < 0:
            i = int(np.flatnonzero(values < 0)[0])
            raise LayoutError(field, "must be >= 0", request=i, value=int(values[i]))
        return cls(values, indptr(values, field))

    @staticmethod
    @functools.lru_cache(maxsize=64)
    def uniform(batch_size: int, length: int, field: str = "lengths") -> Lengths:
        """``batch_size`` requests of ``length`` each, made once per shape and shared (a
        decode or verify loop meets a few shapes).

        Raises:
            LayoutError: the total exceeds int32 (naming ``field``).
        """
        return Lengths.from_lens(filled(length, batch_size), field)

    @property
    def batch_size(self) -> int:
        """Number of requests."""
        return int(self.lens.shape[0])

    @property
    def total(self) -> int:
        """The sum of the lengths: ``indptr[-1]``."""
        return int(self.indptr[-1])

    @cached_property
    def max_len(self) -> int:
        """The longest length, 0 for an empty batch."""
        # (the ufunc itself: ndarray.max's Python wrapper costs more at these sizes)
        return int(np.maximum.reduce(self.lens)) if self.lens.size else 0


@readonly_when_unpickled
@attrs.frozen
class PageSpans:
    """Spans ``[first_token[i], end_token[i])`` of page-table rows (row tokens), and the
    whole pages a paged kernel reads to see them.

    The read starts at the page that holds ``first_token`` (:attr:`start_page`), so it
    may include up to ``page_size - 1`` leading keys that a window or custom mask hides.
    An empty span (``end_token <= first_token``) reads no page and has
    ``last_page_len = 0``, so that FlashInfer's ``(pages - 1) * page_size +
    last_page_len`` counts no phantom key. Build it with :meth:`between` or
    :meth:`from_row_start`; ``__init__`` stores what they derived.

    Example: page size 4; request 0 reads tokens 0..5, request 1 tokens 9..16:

    >>> s = PageSpans.between([0, 9], [6, 17], 4)
    >>> s.start_page.tolist(), s.pages.lens.tolist(), s.last_page_len.tolist()
    ([0, 2], [2, 3], [2, 1])
    >>> s.kv_lens.tolist(), s.pages.indptr.tolist()
    ([6, 9], [0, 2, 5])

    Attributes:
        first_token: int32 ``[bs]`` (row tokens) the first key a call must show.
        end_token: int32 ``[bs]`` (row tokens) one past the last key.
        page_size: tokens per page.
        start_page: int32 ``[bs]`` (pages): the first column of the row read (0 when
            empty).
        kv_lens: int32 ``[bs]`` (tokens): keys read, counted from ``start_page``.
        pages: the pages read per request (:class:`Lengths`: ``ceil(kv_lens /
            page_size)`` and their index pointers).
        last_page_len: int32 ``[bs]`` (tokens) in the last page read, in
            ``[1, page_size]``; 0 for an empty span.
    """

    first_token: IntArray = attrs.field(eq=array_key)
    end_token: IntArray = attrs.field(eq=array_key)
    page_size: int
    # derived by the constructors (compared through the three fields above)
    start_page: IntArray = attrs.field(eq=False)
    kv_lens: IntArray = attrs.field(eq=False)
    pages: Lengths = attrs.field(eq=False)
    last_page_len: IntArray = attrs.field(eq=False)

    @classmethod
    def between(
        cls, first_token: object, end_token: object, page_size: object, *, field: str = "pages"
    ) -> PageSpans:
        """Spans between two bounds (1-D integer arrays of one length; sealed int32 ones
        are kept); ``field`` names a page total beyond int32.

        Raises:
            LayoutError: arrays that are not 1-D integers of one length or beyond int32,
                a negative ``first_token`` (naming the request), a page size below 1,
                or more pages in all than int32 holds.
        """
        first = int32_field("first_token", first_token)
        end = int32_field("end_token", end_token)
        ps = as_int("page_size", page_size, minimum=1)
        same_length("paged", first, end)
        if first.size and np.minimum.reduce(first) < 0:
            i = int(np.flatnonzero(first < 0)[0])
            raise LayoutError("first_token", "must be >= 0", request=i)
        # int32 throughout: 0 <= start_page * page_size <= first_token, and a non-empty
        # span's kv_lens lies in [1, end_token]; empty spans are set to 0.
        start = first // constant_operand(ps)
        kv = end - start * constant_operand(ps)
        nonempty = end > first
        if not nonempty.all():
            start = np.where(nonempty, start, 0).astype(np.int32, copy=False)
            kv = np.where(nonempty, kv, 0).astype(np.int32, copy=False)
        return cls._derived(first, end, ps, seal_inplace(start), seal_inplace(kv), field, None)

    @classmethod
    def from_page_start(
        cls,
        start_page: object,
        end_token: object,
        page_size: object,
        *,
        base: object = None,
        field: str = "pages",
    ) -> PageSpans:
        """Spans that start at a page boundary: row tokens ``[base + start_page *
        page_size, base + end_token)`` (``base``: int ``[bs]`` row tokens before the
        counted ones, e.g. an encoder's, or ``None`` for 0). What :meth:`between`
        gives for those bounds, with less to derive (a cascade's own parts, every step).

        Raises:
            LayoutError: as :meth:`between`, or a negative ``start_page``.
        """
        ps = as_int("page_size", page_size, minimum=1)
        start = int32_field("start_page", start_page)
        end = int32_field("end_token", end_token)
        same_length("paged", start, end)
        if start.size and np.minimum.reduce(start) < 0:
            i = int(np.flatnonzero(start < 0)[0])
            raise LayoutError("start_page", "must be >= 0", request=i)
        if base is not None:
            row = np.asarray(base, dtype=np.int64)
            return cls.between(start.astype(np.int64) * ps + row, end + row, ps, field=field)
        return cls.from_checked_page_start(
            start, seal_inplace(start * constant_operand(ps)), end, ps, field=field
        )

    @classmethod
    def from_checked_page_start(
        cls,
        start_page: IntArray,
        first_token: IntArray,
        end_token: IntArray,
        page_size: int,
        *,
        field: str = "pages",
    ) -> PageSpans:
        """:meth:`from_page_start` (no ``base``) for arrays already checked: read-only
        int32 ``[bs]`` of one length, ``start_page >= 0`` and ``first_token = start_page *
        page_size`` (a caller that keeps them from step to step: a cascade's own parts);
        only ``end_token`` is new.

        Raises:
            LayoutError: as :meth:`between` (more pages in all than int32 holds).
        """
        kv = end_token - first_token
        if kv.size and np.minimum.reduce(kv) <= 0:  # empty spans: no page, as between's
            return cls.between(first_token, end_token, page_size, field=field)
        return cls._derived(
            first_token, end_token, page_size, start_page, seal_inplace(kv), field, None
        )

    @classmethod
    def from_row_start(
        cls, end_token: object, page_size: object, *, field: str = "pages"
    ) -> PageSpans:
        """Spans from row token 0 to ``end_token`` (whole rows: a decode step's keys, an
        encoder's tokens).

        Raises:
            LayoutError: as :meth:`between`.
        """
        end = int32_field("end_token", end_token)
        ps = as_int("page_size", page_size, minimum=1)
        fewest = int(np.minimum.reduce(end)) if end.size else 1
        if fewest < 0:
            i = int(np.flatnonzero(end < 0)[0])
            raise LayoutError("end_token", "must be >= 0", request=i)
        zeros = filled(0, end.shape[0])
        return cls._derived(zeros, end, ps, zeros, end, field, fewest)

    @classmethod
    def _derived(
        cls,
        first: IntArray,
        end: IntArray,
        page_size: int,
        start: IntArray,
        kv: IntArray,
        field: str,
        fewest: int | None,
    ) -> PageSpans:
        pages, last = page_split(kv, page_size, fewest=fewest)
        pages.setflags(write=False)  # our own fresh arrays, >= 0: stored as they are
        last.setflags(write=False)
        return cls(first, end, page_size, start, kv, Lengths(pages, indptr(pages, field)), last)

    @property
    def batch_size(self) -> int:
        """Number of spans (requests)."""
        return int(self.first_token.shape[0])

    @cached_property
    def max_kv_len(self) -> int:
        """The longest span read (tokens), 0 for an empty batch."""
        return int(np.maximum.reduce(self.kv_lens)) if self.kv_lens.size else 0
