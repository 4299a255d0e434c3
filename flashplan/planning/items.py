"""FlashInfer's multi-item scoring tensors, planned from a layout's delimiters (host numpy,
vectorized over the batch: no per-request Python loop).

For request ``i`` with ``P`` cached tokens, ``E`` new tokens and first delimiter ``f``
(among the new tokens), FlashInfer's paged prefill in multi-item mode takes:

* ``prefix_len_ptr[i] = P + f`` (uint32): every key before it is the shared prefix;
* a row of ``token_pos_in_items`` (uint16) over the new tokens from ``f`` on: 0 at each
  delimiter, 1, 2, … inside an item; rows are zero-padded to one length,
  ``token_pos_in_items_len`` (the longest row of the batch);
* ``max_item_len[i]`` (uint16): the largest value of the row (the longest item). The
  kernel skips key tiles using it, so it must never be smaller.

A request without delimiters gets ``prefix_len_ptr = seq_len`` (every query is then a
"prefix" query: plain causal), a zero row and ``max_item_len = 0``: one row per request,
never skipped (the reference file skips such requests and misaligns the batch).

``token_pos_in_items`` is zero except inside the items, where it counts 1, 2, …, so
:class:`MultiItemTensors` keeps it as its **items**: where each non-empty item starts in
the padded rows and how long it is (two int32 per item). The dense array is built from
them when read on the host (:attr:`MultiItemTensors.token_pos_in_items`), and the
FlashInfer executor builds it on the device from the items (one memset and one
:func:`~flashplan.kernels.fill_runs` launch), so planning never touches the
``batch_size * token_pos_in_items_len`` entries.

RoPE positions: prefix tokens keep ``P + j``; from the first delimiter on, a token at
in-item position ``t`` sits at ``prefix_len + t - 1`` — each item is positioned as if it
directly followed the prefix, and a delimiter shares the last prefix token's position
(0 when the prefix is empty: no query sees such a delimiter, and a RoPE table must not be
indexed at -1).
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from flashplan.arrays import (
    INT32_MAX,
    IntArray,
    array_key,
    indptr,
    readonly_when_unpickled,
    seal_inplace,
)
from flashplan.errors import LayoutError
from flashplan.layout.batch import BatchLayout
from flashplan.layout.convert import as_int
from flashplan.layout.items import ItemDelimiters
from flashplan.planning.positions import PositionRuns

__all__ = ["MultiItemTensors", "plan_items"]

U16 = npt.NDArray[np.uint16]
U32 = npt.NDArray[np.uint32]

#: The largest value a uint16 entry of ``token_pos_in_items`` holds (an item's length).
MAX_ITEM_LEN = int(np.iinfo(np.uint16).max)


def _typed(field: str, value: object, dtype: Any, index: str = "request") -> npt.NDArray[Any]:
    """A read-only 1-D array of ``dtype``, from any integer array whose values fit it
    (an error names the offending entry as ``index``)."""
    arr = np.asarray(value)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise LayoutError(
            field, "must be a 1-D integer array", shape=arr.shape, dtype=str(arr.dtype)
        )
    if arr.dtype == dtype and not arr.flags.writeable and arr.flags.c_contiguous:
        return arr
    info = np.iinfo(dtype)
    if arr.size and (int(arr.min()) < info.min or int(arr.max()) > info.max):
        i = int(np.flatnonzero((arr < info.min) | (arr > info.max))[0])
        raise LayoutError(
            field, f"does not fit {np.dtype(dtype).name}", **{index: i}, value=int(arr[i])
        )
    out = np.array(arr, dtype=dtype, copy=True, order="C")
    out.flags.writeable = False
    return out


@readonly_when_unpickled
@attrs.frozen
class MultiItemTensors:
    """The multi-item arguments of one paged prefill call, in FlashInfer's dtypes.

    ``token_pos_in_items`` is held as its items (module docstring): item ``k`` covers
    entries ``item_start[k] … item_start[k] + item_length[k] - 1`` of it, which hold
    ``1, 2, …, item_length[k]``; every other entry (a delimiter, padding, the row of a
    request without delimiters) is 0. Build it from the planner (:func:`plan_items`),
    from the items (:meth:`from_items`), or from a dense array (:meth:`from_rows`).
    ``MultiItemTensors(...)`` itself stores its arguments as given: read-only arrays of
    the dtypes below that pass :meth:`from_items`' checks (the planner's).

    Example — the reference file's two-request batch: items of lengths 2, 1 after a
    3-token prompt, and items of lengths 1, 3, 2 after a 2-token prompt, each item after
    a delimiter and a delimiter at the end:

    >>> import flashplan as fp
    >>> lay = fp.BatchLayout.extend([9, 12], item_delimiters=[[3, 6, 8], [2, 4, 8, 11]])
    >>> items = plan_items(lay)[0]
    >>> items.prefix_len_ptr.tolist(), items.token_pos_in_items_len, items.max_item_len.tolist()
    ([3, 2], 10, [2, 3])
    >>> items.rows.tolist()
    [[0, 1, 2, 0, 1, 0, 0, 0, 0, 0], [0, 1, 0, 1, 2, 3, 0, 1, 2, 0]]
    >>> items.item_start.tolist(), items.item_length.tolist()
    ([1, 4, 11, 13, 17], [2, 1, 1, 3, 2])

    Attributes:
        prefix_len_ptr: uint32 ``[bs]`` (keys of the call): keys before it are the
            shared prefix; queries before it are plain causal.
        token_pos_in_items_len: row length of ``token_pos_in_items`` (tokens).
        max_item_len: uint16 ``[bs]`` (tokens): at least the longest item of each row.
        item_start: int32 ``[items]`` (entries of ``token_pos_in_items``): where each
            non-empty item's first token sits, ascending.
        item_length: int32 ``[items]`` (tokens): each item's length, 1 … 65535.
    """

    prefix_len_ptr: U32 = attrs.field(eq=array_key)
    token_pos_in_items_len: int
    max_item_len: U16 = attrs.field(eq=array_key)
    item_start: IntArray = attrs.field(eq=array_key)
    item_length: IntArray = attrs.field(eq=array_key)

    @classmethod
    def from_items(
        cls, prefix_len_ptr: object, token_pos_in_items_len: object, max_item_len: object,
        item_start: object, item_length: object,
    ) -> MultiItemTensors:  # fmt: skip
        """From FlashInfer's arguments with ``token_pos_in_items`` as its items: any
        integer arrays whose values fit the fields' dtypes (copied to read-only arrays
        of those dtypes unless they are already).

        Raises:
            LayoutError: arrays of the wrong shape or sizes, values outside the dtypes,
                items that overlap, leave their row or are empty (naming the item and its
                request), or a ``max_item_len`` below its row's longest item (FlashInfer
                would silently skip visible keys).
        """
        tensors = cls(
            _typed("prefix_len_ptr", prefix_len_ptr, np.uint32),
            as_int("token_pos_in_items_len", token_pos_in_items_len, minimum=0),
            _typed("max_item_len", max_item_len, np.uint16),
            _typed("item_start", item_start, np.int32, "item"),
            _typed("item_length", item_length, np.int32, "item"),
        )
        tensors._check()
        return tensors

    @classmethod
    def from_rows(
        cls, prefix_len_ptr: object, token_pos_in_items: object, token_pos_in_items_len: object,
        max_item_len: object,
    ) -> MultiItemTensors:  # fmt: skip
        """From FlashInfer's four arguments as they are (``token_pos_in_items`` dense:
        uint16-valued ``[bs * token_pos_in_items_len]``).

        Raises:
            LayoutError: besides :meth:`from_items`' refusals, a dense array of the wrong size
                or one that is not of the multi-item form: an entry that is neither 0
                nor one more than the entry before it in its row (naming the request
                and the column).
        """
        prefix = _typed("prefix_len_ptr", prefix_len_ptr, np.uint32)
        bs = prefix.shape[0]
        stride = as_int("token_pos_in_items_len", token_pos_in_items_len, minimum=0)
        dense = _typed("token_pos_in_items", token_pos_in_items, np.uint16, "entry")
        if dense.shape[0] != bs * stride:
            raise LayoutError(
                "token_pos_in_items",
                "must hold batch_size * token_pos_in_items_len entries",
                batch_size=bs,
                token_pos_in_items_len=stride,
                size=dense.shape[0],
            )
        values = dense.astype(np.int64)
        before = np.empty_like(values)
        if values.size:
            before[0] = -1
            before[1:] = values[:-1]
            before[:: max(stride, 1)] = -1  # column 0 has no entry before it in its row
        bad = (values > 0) & (values != before + 1)
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            raise LayoutError(
                "token_pos_in_items",
                "each entry must be 0 (a delimiter or padding) or one more than the entry "
                "before it in its row",
                request=k // stride,
                column=k % stride,
                value=int(values[k]),
            )
        starts = np.flatnonzero(values == 1)
        after = np.append(values[1:], 0)
        if values.size:
            after[stride - 1 :: stride] = 0  # a row's last column ends its item
        ends = np.flatnonzero((values > 0) & (after != values + 1))
        return cls.from_items(prefix, stride, max_item_len, starts, ends - starts + 1)

    def _check(self) -> None:
        """:meth:`from_items`' checks of the converted fields."""
        bs, stride = self.prefix_len_ptr.shape[0], self.token_pos_in_items_len
        if self.max_item_len.shape[0] != bs:
            raise LayoutError(
                "max_item_len", "must have one entry per request", batch_size=bs,
                size=self.max_item_len.shape[0],
            )  # fmt: skip
        start, length = self.item_start, self.item_length
        if length.shape != start.shape:
            raise LayoutError(
                "item_length", "must have one entry per item", items=start.shape[0],
                size=length.shape[0],
            )  # fmt: skip
        if bs * stride > INT32_MAX:  # FlashInfer indexes rows in 32 bits
            raise LayoutError(
                "token_pos_in_items_len",
                "batch_size * token_pos_in_items_len exceeds int32",
                batch_size=bs,
                token_pos_in_items_len=stride,
            )
        if not start.size:
            return
        s64 = start.astype(np.int64)
        row = s64 // max(stride, 1)
        end = s64 + length  # one past the item's last entry
        checks = (
            ("item_length", (length < 1) | (length > MAX_ITEM_LEN), "must be 1 … 65535"),
            ("item_start", (s64 < 0) | (s64 >= bs * stride), "must lie inside the rows"),
            ("item_length", end > (row + 1) * stride, "must end inside the item's row"),
            ("item_start", s64 % max(stride, 1) == 0, "must follow a delimiter (column 0 is one)"),
        )
        for field, bad, message in checks:
            if bad.any():
                self._raise_at(field, int(np.flatnonzero(bad)[0]), message)
        overlap = s64[1:] < end[:-1]
        if overlap.any():
            k = int(np.flatnonzero(overlap)[0]) + 1
            self._raise_at("item_start", k, "must start after the item before it ends")
        short = self.max_item_len[row] < length
        if short.any():
            k = int(np.flatnonzero(short)[0])
            raise LayoutError(
                "max_item_len",
                "must be at least the longest item of the request's row "
                "(FlashInfer skips key tiles by it)",
                request=int(row[k]),
                max_item_len=int(self.max_item_len[row[k]]),
                item=k,
                item_length=int(length[k]),
            )

    def _raise_at(self, field: str, k: int, message: str) -> None:
        stride = self.token_pos_in_items_len
        row = int(self.item_start[k]) // stride if stride else -1
        raise LayoutError(
            field,
            message,
            item=k,
            request=row if 0 <= row < self.batch_size else None,
            item_start=int(self.item_start[k]),
            item_length=int(self.item_length[k]),
            token_pos_in_items_len=self.token_pos_in_items_len,
        )

    @property
    def batch_size(self) -> int:
        """Number of requests."""
        return int(self.prefix_len_ptr.shape[0])

    @property
    def num_items(self) -> int:
        """Non-empty items in the batch."""
        return int(self.item_start.shape[0])

    @cached_property
    def max_length(self) -> int:
        """The longest item (tokens); 0 without items."""
        return int(self.item_length.max()) if self.num_items else 0

    @cached_property
    def token_pos_in_items(self) -> U16:
        """uint16 ``[bs * token_pos_in_items_len]`` (tokens): per request, from the query
        at ``prefix_len_ptr`` on, the query's position in its item (0 = delimiter),
        zero-padded — FlashInfer's dense array, built from the items (read-only)."""
        out = np.zeros(self.batch_size * self.token_pos_in_items_len, dtype=np.uint16)
        if self.num_items:
            length = self.item_length
            # entry e of item k holds e - item_start[k] + 1
            first = indptr(length, "item_length")[:-1]  # each item's first token among all
            offset = np.repeat(self.item_start.astype(np.int64) - first, length)
            inside = np.arange(offset.shape[0], dtype=np.int64)
            inside += offset
            out[inside] = inside - np.repeat(self.item_start.astype(np.int64) - 1, length)
        out.flags.writeable = False
        return out

    @cached_property
    def rows(self) -> U16:
        """uint16 ``[bs, token_pos_in_items_len]``: ``token_pos_in_items`` per request."""
        return self.token_pos_in_items.reshape(self.batch_size, self.token_pos_in_items_len)

    def request(self, i: int) -> MultiItemTensors:
        """The same tensors for request ``i`` alone (a batch of one; its row unpadded to
        the batch's length)."""
        stride = self.token_pos_in_items_len
        own = (self.item_start >= i * stride) & (self.item_start < (i + 1) * stride)
        # request i's own items, shifted to row 0: valid as the batch's are
        return MultiItemTensors(
            self.prefix_len_ptr[i : i + 1],
            stride,
            self.max_item_len[i : i + 1],
            seal_inplace(self.item_start[own] - np.int32(i * stride)),
            seal_inplace(self.item_length[own]),
        )


def plan_items(layout: BatchLayout) -> tuple[MultiItemTensors, PositionRuns]:
    """The multi-item tensors of ``layout`` and its new tokens' RoPE positions.

    Returns:
        ``(tensors, runs)``: :class:`MultiItemTensors` for the keys of the request's
        decoder (the paged call's own key coordinates when it reads from the first
        decoder page), and the positions (module docstring) as
        :class:`~flashplan.planning.positions.PositionRuns`.

    Raises:
        LayoutError: ``layout`` is not a multi-item batch.
    """
    items = layout.item_delimiters
    if items is None:
        raise LayoutError("item_delimiters", "not a multi-item batch")
    bs = layout.batch_size
    prefix, ext = layout.prefix_lens, layout.extend_lens  # int32
    has, counts, delims = items.has_items, items.counts, items.positions
    first = np.where(has, items.first, ext)  # new tokens before the first delimiter
    stride = int((ext - first).max()) if bs else 0  # the longest row
    if bs * stride > INT32_MAX:  # FlashInfer indexes rows in 32 bits
        raise LayoutError(
            "item_delimiters",
            "batch_size * token_pos_in_items_len exceeds int32",
            batch_size=bs,
            token_pos_in_items_len=stride,
        )
    prefix_len = np.where(has, prefix + first, layout.seq_lens)

    # Delimiter k opens a stretch of gap[k] tokens: itself, then its item (up to the next
    # delimiter of its request, or the request's end).
    n = delims.shape[0]
    gap = np.empty(n, dtype=np.int32)
    longest = np.zeros(bs, dtype=np.int32)
    if n:
        gap[:-1] = delims[1:]
        gap[(items.indptr[1:] - 1)[has]] = ext[has]  # a request's last delimiter
        gap -= delims
        longest[has] = np.maximum.reduceat(gap, items.indptr[:-1][has]) - 1
    # Column c of request i's row is new token first[i] + c, at entry i * stride + c;
    # item k starts one entry after its delimiter. Only non-empty items are kept.
    row_base = np.arange(bs, dtype=np.int32) * np.int32(stride) - first + 1
    item_start = np.repeat(row_base, counts) + delims  # int32: bs * stride fits
    item_length = gap - 1
    if n and not item_length.all():
        keep = item_length > 0
        item_start, item_length = item_start[keep], item_length[keep]

    runs = _position_runs(items, prefix, first, prefix_len, gap)
    # uint32 / uint16 hold every value: prefix_len <= seq_len fits int32 (so uint32),
    # and no row is longer than MAX_ITEM_ROW (checked when the layout was built).
    tensors = MultiItemTensors(
        seal_inplace(prefix_len, np.uint32),
        stride,
        seal_inplace(longest, np.uint16),
        seal_inplace(item_start),
        seal_inplace(item_length),
    )
    return tensors, runs


def _position_runs(
    items: ItemDelimiters,
    prefix: IntArray,
    first: IntArray,
    prefix_len: IntArray,
    gap: IntArray,
) -> PositionRuns:
    """The new tokens' positions as runs: ``P + j`` before a request's first delimiter,
    then ``max(prefix_len - 1 + k, 0)`` for the ``k``-th token from the last delimiter.

    The runs, in q order: each request's tokens before its first delimiter (from ``P``;
    all of them without delimiters), then one per delimiter (from ``prefix_len - 1``, for
    the delimiter's ``gap``: up to the next delimiter or the request's end; the runs clamp
    the ``-1`` of a delimiter over an empty prefix at 0). ``bs + n`` runs for ``n``
    delimiters: nothing per token.
    """
    bs, n = prefix.shape[0], gap.shape[0]
    # Per request, its own run then its delimiters' runs: the pairs (P, prefix_len - 1)
    # repeated (1, count) times give every run's first position in q order.
    pair = np.empty(2 * bs, dtype=np.int32)
    pair[0::2] = prefix
    pair[1::2] = prefix_len - 1
    times = np.ones(2 * bs, dtype=np.int32)
    times[1::2] = items.counts
    run_first = np.repeat(pair, times)
    own = np.zeros(bs + n, dtype=bool)  # the requests' own runs
    own[np.arange(bs, dtype=np.int32) + items.indptr[:-1]] = True
    run_len = np.empty(bs + n, dtype=np.int32)
    run_len[own] = first  # ext where a request has no delimiter
    run_len[~own] = gap
    return PositionRuns(seal_inplace(run_first), seal_inplace(run_len))
