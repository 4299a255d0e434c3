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
import torch

from flashplan.arrays import (
    INT32_MAX,
    IntArray,
    array_key,
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


def _typed(field: str, value: object, dtype: Any) -> npt.NDArray[Any]:
    """A read-only 1-D array of ``dtype``, from any integer array whose values fit it."""
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
            field, f"does not fit {np.dtype(dtype).name}", request=i, value=int(arr[i])
        )
    out = np.array(arr, dtype=dtype, copy=True, order="C")
    out.flags.writeable = False
    return out


@readonly_when_unpickled
@attrs.frozen
class MultiItemTensors:
    """The multi-item arguments of one paged prefill call, in FlashInfer's dtypes.

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

    Attributes:
        prefix_len_ptr: uint32 ``[bs]`` (keys of the call): keys before it are the
            shared prefix; queries before it are plain causal.
        token_pos_in_items: uint16 ``[bs * token_pos_in_items_len]`` (tokens): per
            request, from the query at ``prefix_len_ptr`` on, the query's position in its
            item (0 = delimiter), zero-padded.
        token_pos_in_items_len: row length of ``token_pos_in_items`` (tokens).
        max_item_len: uint16 ``[bs]`` (tokens): at least the largest value of each row.

    Raises:
        LayoutError: arrays of the wrong shape or sizes, values outside the dtypes, or a
            ``max_item_len`` below its row's largest position (FlashInfer would silently
            skip visible keys).
    """

    prefix_len_ptr: U32 = attrs.field(
        converter=lambda v: _typed("prefix_len_ptr", v, np.uint32), eq=array_key
    )
    token_pos_in_items: U16 = attrs.field(
        converter=lambda v: _typed("token_pos_in_items", v, np.uint16), eq=array_key
    )
    token_pos_in_items_len: int = attrs.field(
        converter=lambda v: as_int("token_pos_in_items_len", v, minimum=0)
    )
    max_item_len: U16 = attrs.field(
        converter=lambda v: _typed("max_item_len", v, np.uint16), eq=array_key
    )

    @classmethod
    def _from_checked(
        cls, prefix_len_ptr: U32, token_pos_in_items: U16, token_pos_in_items_len: int,
        max_item_len: U16,
    ) -> MultiItemTensors:  # fmt: skip
        """Internal (:func:`plan_items`): tensors from read-only arrays of FlashInfer's
        dtypes that pass ``__init__``'s checks by construction (``max_item_len`` is each
        row's largest position); nothing is copied or checked again."""
        self = object.__new__(cls)
        _set = object.__setattr__
        _set(self, "prefix_len_ptr", prefix_len_ptr)
        _set(self, "token_pos_in_items", token_pos_in_items)
        _set(self, "token_pos_in_items_len", token_pos_in_items_len)
        _set(self, "max_item_len", max_item_len)
        return self

    def __attrs_post_init__(self) -> None:
        bs = self.prefix_len_ptr.shape[0]
        if self.max_item_len.shape[0] != bs:
            raise LayoutError(
                "max_item_len", "must have one entry per request", batch_size=bs,
                size=self.max_item_len.shape[0],
            )  # fmt: skip
        if self.token_pos_in_items.shape[0] != bs * self.token_pos_in_items_len:
            raise LayoutError(
                "token_pos_in_items",
                "must hold batch_size * token_pos_in_items_len entries",
                batch_size=bs,
                token_pos_in_items_len=self.token_pos_in_items_len,
                size=self.token_pos_in_items.shape[0],
            )
        if self.token_pos_in_items_len:
            short = self.max_item_len < self.rows.max(axis=1)
            if short.any():
                i = int(np.flatnonzero(short)[0])
                raise LayoutError(
                    "max_item_len",
                    "must be at least the largest position of the request's row "
                    "(FlashInfer skips key tiles by it)",
                    request=i,
                    max_item_len=int(self.max_item_len[i]),
                    largest=int(self.rows[i].max()),
                )

    @property
    def batch_size(self) -> int:
        """Number of requests."""
        return int(self.prefix_len_ptr.shape[0])

    @cached_property
    def rows(self) -> U16:
        """uint16 ``[bs, token_pos_in_items_len]``: ``token_pos_in_items`` per request."""
        return self.token_pos_in_items.reshape(self.batch_size, self.token_pos_in_items_len)

    def request(self, i: int) -> MultiItemTensors:
        """The same tensors for request ``i`` alone (a batch of one; its row unpadded to
        the batch's length)."""
        return MultiItemTensors(
            self.prefix_len_ptr[i : i + 1],
            self.rows[i],
            self.token_pos_in_items_len,
            self.max_item_len[i : i + 1],
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
    has = items.has_items
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

    # Everything from a request's first delimiter on is its *row*: column c is new token
    # first + c. On the [bs, stride] grid of rows (FlashInfer's padded layout itself,
    # flat) the in-item position of a cell is its index minus the index of the last
    # delimiter cell at or before it (a row's column 0 is always one). Delimiter cells
    # ascend, so that index is a running sum of the gaps between them (torch's in-place
    # CPU scan over a view: numpy's accumulate is several times slower). Cells past a
    # row's end are padding.
    n = items.positions.shape[0]
    row_len = ext - first  # 0 for a request without delimiters
    owner = np.repeat(np.arange(bs, dtype=np.int32), items.counts)
    cell = owner * stride + (items.positions - first[owner])  # int32: bs * stride fits
    grid = np.arange(bs * stride, dtype=np.int32)
    if n:
        last = np.zeros(bs * stride, dtype=np.int32)
        last[cell[0]] = cell[0]
        last[cell[1:]] = np.diff(cell)
        torch.from_numpy(last).cumsum_(0)
        grid -= last
    rows = grid.reshape(bs, stride)
    rows[np.arange(stride, dtype=np.int32) >= row_len[:, None]] = 0  # padding
    longest = rows.max(axis=1, initial=0)  # the longest item (a delimiter is 0)

    runs = _position_runs(items, owner, prefix, ext, first, prefix_len)
    padded = grid.astype(np.uint16)
    # uint32 / uint16 hold every value: prefix_len <= seq_len fits int32 (so uint32),
    # and no row is longer than MAX_ITEM_ROW (checked when the layout was built).
    tensors = MultiItemTensors._from_checked(
        seal_inplace(prefix_len, np.uint32),
        seal_inplace(padded, np.uint16),
        stride,
        seal_inplace(longest, np.uint16),
    )
    return tensors, runs


def _position_runs(
    items: ItemDelimiters,
    owner: IntArray,
    prefix: IntArray,
    ext: IntArray,
    first: IntArray,
    prefix_len: IntArray,
) -> PositionRuns:
    """The new tokens' positions as runs: ``P + j`` before a request's first delimiter,
    then ``max(prefix_len - 1 + k, 0)`` for the ``k``-th token from the last delimiter.

    The runs, in q order: each request's tokens before its first delimiter (from ``P``;
    all of them without delimiters), then one per delimiter (from ``prefix_len - 1``, up
    to the next delimiter or the request's end; the runs clamp the ``-1`` of a delimiter
    over an empty prefix at 0). ``bs + n`` runs for ``n`` delimiters: nothing per token.
    """
    bs, n = prefix.shape[0], items.positions.shape[0]
    run_first = np.empty(bs + n, dtype=np.int32)
    run_len = np.empty(bs + n, dtype=np.int32)
    at_request = np.arange(bs, dtype=np.int32) + items.indptr[:-1]  # q order slots
    at_delim = np.arange(n, dtype=np.int32) + owner + 1
    run_first[at_request] = prefix
    run_len[at_request] = first  # ext where a request has no delimiter
    run_first[at_delim] = prefix_len[owner] - 1
    nxt = np.empty(n, dtype=np.int32)  # the next delimiter, or the request's end
    if n:
        nxt[:-1] = items.positions[1:]
        last = items.indptr[1:][items.counts > 0] - 1  # each request's last delimiter
        nxt[last] = ext[owner[last]]
    run_len[at_delim] = nxt - items.positions
    return PositionRuns._from_checked(seal_inplace(run_first), seal_inplace(run_len))
