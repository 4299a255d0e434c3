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
    indptr,
    readonly_when_unpickled,
    seal_inplace,
)
from flashplan.errors import LayoutError
from flashplan.layout.batch import BatchLayout
from flashplan.layout.convert import as_int
from flashplan.layout.items import ItemDelimiters

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


def plan_items(layout: BatchLayout) -> tuple[MultiItemTensors, IntArray]:
    """The multi-item tensors of ``layout`` and its new tokens' RoPE positions.

    Returns:
        ``(tensors, positions)``: :class:`MultiItemTensors` for the keys of the
        request's decoder (the paged call's own key coordinates when it reads from the
        first decoder page), and int32 ``[total_q]`` positions (module docstring).

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
    qo_ptr = indptr(ext, "extend_lens")

    # Everything from a request's first delimiter on is its *row*: column c is new token
    # first + c. On the [bs, stride] grid of rows (FlashInfer's padded layout itself) the
    # in-item position of column c is c minus the column of the last delimiter at or
    # before it (column 0 is always one); columns past the row's end are padding.
    row_len = ext - first  # 0 for a request without delimiters
    cols = np.arange(stride, dtype=np.int32)
    in_row = cols < row_len[:, None]
    last = np.zeros((bs, stride), dtype=np.int32)
    owner = np.repeat(np.arange(bs, dtype=np.int32), items.counts)
    at = items.positions - first[owner]
    last.reshape(-1)[owner * stride + at] = at  # flat: one index array, not two
    np.maximum.accumulate(last, axis=1, out=last)
    grid = np.where(in_row, cols - last, 0)  # int32 [bs, stride]
    longest = grid.max(axis=1, initial=0)  # the longest item (a delimiter is 0)

    positions = _positions(items, owner, prefix, ext, first, prefix_len, qo_ptr)
    padded = grid.astype(np.uint16).reshape(-1)
    # uint32 / uint16 hold every value: prefix_len <= seq_len fits int32 (so uint32),
    # and no row is longer than MAX_ITEM_ROW (checked when the layout was built).
    tensors = MultiItemTensors._from_checked(
        seal_inplace(prefix_len, np.uint32),
        seal_inplace(padded, np.uint16),
        stride,
        seal_inplace(longest, np.uint16),
    )
    return tensors, seal_inplace(positions)


def _positions(
    items: ItemDelimiters,
    owner: IntArray,
    prefix: IntArray,
    ext: IntArray,
    first: IntArray,
    prefix_len: IntArray,
    qo_ptr: IntArray,
) -> IntArray:
    """int32 ``[total_q]``: ``P + j`` before a request's first delimiter, then
    ``max(prefix_len - 1 + k, 0)`` for the ``k``-th token from the last delimiter.

    The new tokens split into *segments* along which the position grows by one: each
    request's tokens before its first delimiter (starting at ``P``; all of them without
    delimiters), then one per delimiter (starting at ``prefix_len - 1``, up to the next
    delimiter). Laid out in q order — request ``i``'s first segment, then its
    delimiters' — each segment's first token steps from the previous token's position to
    the segment's start value and every other token by one: a running sum over one
    array of the tokens (torch's CPU scan, in place), and no work per request or item
    beyond a few small arrays.
    """
    bs, n = prefix.shape[0], items.positions.shape[0]
    starts = qo_ptr[:-1]
    # Every segment's (start row in q, start value, length), request segments first.
    seg_q = np.empty(bs + n, dtype=np.int32)
    seg_value = np.empty(bs + n, dtype=np.int32)
    seg_len = np.empty(bs + n, dtype=np.int32)
    at_request = np.arange(bs, dtype=np.int32) + items.indptr[:-1]  # q order slots
    at_delim = np.arange(n, dtype=np.int32) + owner + 1
    seg_q[at_request] = starts
    seg_value[at_request] = prefix
    seg_len[at_request] = first  # ext where a request has no delimiter
    delim_q = starts[owner] + items.positions
    seg_q[at_delim] = delim_q
    seg_value[at_delim] = prefix_len[owner] - 1
    nxt = np.empty(n, dtype=np.int32)  # the next delimiter, or the request's end
    if n:
        nxt[:-1] = items.positions[1:]
        last = items.indptr[1:][items.counts > 0] - 1  # each request's last delimiter
        nxt[last] = ext[owner[last]]
    seg_len[at_delim] = nxt - items.positions
    # One fresh array of total_q: +1 per token, and at each segment's first token the
    # step from the previous token's position to the segment's start value; a running
    # sum in place then gives every position.
    keep = seg_len > 0
    q0, value, length = seg_q[keep], seg_value[keep], seg_len[keep]
    positions = np.ones(int(qo_ptr[-1]), dtype=np.int32)
    if q0.shape[0]:
        positions[q0[0]] = value[0]
        positions[q0[1:]] = value[1:] - (value[:-1] + length[:-1] - 1)
    # The running sum in place, through torch's CPU scan (a view of the same memory):
    # numpy's add.accumulate is ~3x slower on a scoring batch's 10^5+ tokens.
    torch.from_numpy(positions).cumsum_(0)
    below = prefix_len[owner] == 0  # a delimiter at row 0 of a request without prefix
    if below.any():
        positions[delim_q[below]] = 0
    return seal_inplace(positions)
