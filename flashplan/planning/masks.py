"""Bit-packed custom masks, vectorized over the batch (host numpy).

FlashInfer's packed custom mask: per request a row-major ``qo_len x kv_len``
boolean matrix, flattened, bit-packed little-endian (element ``e`` is bit
``e % 8`` of byte ``e // 8``), each request starting on a byte boundary; the
mask indptr counts bytes.
"""

from __future__ import annotations

from functools import cached_property

import attrs
import numpy as np
import numpy.typing as npt

from flashplan.arrays import (
    IntArray,
    array_key,
    copy_readonly,
    indptr,
    readonly_when_unpickled,
    seal_inplace,
)
from flashplan.errors import LayoutError

__all__ = [
    "CustomMask",
    "PositionMask",
    "ThresholdMask",
    "TreeMask",
    "mask_indptr",
    "pack_dense",
    "pack_tail_bits",
    "pack_threshold_rows",
    "threshold_rows",
    "unpack_request",
]


def _mask_lengths(field: str, value: object) -> IntArray:
    arr = np.asarray(value)
    if arr.ndim != 1 or arr.dtype.kind not in "iu" or (arr.size and int(arr.min()) < 0):
        raise LayoutError(field, "must be a 1-D array of lengths >= 0", value=value)
    return copy_readonly(arr)


def _first_visible(field: str, value: object) -> npt.NDArray[np.int64]:
    arr = np.asarray(value)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise LayoutError(field, "must be a 1-D integer array", value=value)
    return copy_readonly(arr, np.int64)


@readonly_when_unpickled
@attrs.frozen
class ThresholdMask:
    """A custom mask whose rows are "hidden up to a column, visible after it".

    Row ``j`` of request ``i`` sees columns ``c`` with
    ``clamp(first_visible[i] + j, 0, kv_lens[i]) <= c < kv_lens[i]``: the shape of a
    sliding window seen through a trimmed prefix. It is stored as one integer per
    request and expanded only where it is used (on the GPU by
    :func:`flashplan.kernels.build_custom_mask`, on the host by :attr:`packed`).

    ``ThresholdMask(qo_lens, kv_lens, first_visible)`` stores the arrays as given:
    read-only arrays of the dtypes below, one entry per request (the planner's).
    :meth:`from_arrays` converts and checks any integer arrays.

    >>> m = ThresholdMask.from_arrays([2], [5], [2])  # 2 rows over 5 columns, from column 2
    >>> m.dense(0).astype(int)
    array([[0, 0, 1, 1, 1],
           [0, 0, 0, 1, 1]])
    >>> m.indptr.tolist()                  # ceil(2 * 5 / 8) bytes
    [0, 2]

    Attributes:
        qo_lens: int32 ``[bs]`` (tokens) rows per request.
        kv_lens: int32 ``[bs]`` (tokens) columns per request (the kernel's kv length).
        first_visible: int64 ``[bs]`` (columns) row 0's first visible column, before
            clamping.
    """

    qo_lens: IntArray = attrs.field(eq=array_key)
    kv_lens: IntArray = attrs.field(eq=array_key)
    first_visible: npt.NDArray[np.int64] = attrs.field(eq=array_key)

    @classmethod
    def from_arrays(cls, qo_lens: object, kv_lens: object, first_visible: object) -> ThresholdMask:
        """A mask from any 1-D integer arrays (copied to read-only int32 lengths and
        int64 thresholds).

        Raises:
            LayoutError: lengths that are not 1-D integers ``>= 0``, thresholds that are
                not 1-D integers, or arrays without one entry per request.
        """
        qo = _mask_lengths("qo_lens", qo_lens)
        kv = _mask_lengths("kv_lens", kv_lens)
        first = _first_visible("first_visible", first_visible)
        bs = qo.shape[0]
        if kv.shape[0] != bs or first.shape[0] != bs:
            raise LayoutError(
                "mask",
                "qo_lens, kv_lens and first_visible must have one entry per request",
                qo_lens=bs,
                kv_lens=kv.shape[0],
                first_visible=first.shape[0],
            )
        return cls(qo, kv, first)

    @cached_property
    def indptr(self) -> IntArray:
        """int32 ``[bs + 1]`` (bytes) offsets of the compact packed form:
        ``ceil(qo_len * kv_len / 8)`` bytes per request, byte-aligned."""
        return mask_indptr(self.qo_lens, self.kv_lens)

    @cached_property
    def packed(self) -> npt.NDArray[np.uint8]:
        """uint8 ``[indptr[-1]]``: the compact packed bytes (computed once, on the host)."""
        rows = threshold_rows(self.qo_lens, self.first_visible)
        return pack_threshold_rows(self.qo_lens, self.kv_lens, rows)[0]

    def dense(self, request: int) -> npt.NDArray[np.bool_]:
        """bool ``[qo_len, kv_len]``: request ``request``'s mask, unpacked."""
        q, kv = int(self.qo_lens[request]), int(self.kv_lens[request])
        first = int(self.first_visible[request]) + np.arange(q)[:, None]
        return np.arange(kv)[None, :] >= np.clip(first, 0, kv)


def _row_offsets(field: str, value: object) -> npt.NDArray[np.int32]:
    arr = np.asarray(value)
    if arr.ndim != 2 or arr.dtype.kind not in "iu":
        raise LayoutError(field, "must be an integer array [bs, N]", shape=arr.shape)
    return copy_readonly(arr)


def _tail_bits(field: str, value: object) -> npt.NDArray[np.bool_]:
    arr = np.asarray(value)
    if arr.ndim != 3 or arr.shape[1] != arr.shape[2] or arr.dtype != np.bool_:
        raise LayoutError(field, "must be a bool array [bs, N, N]", shape=arr.shape)
    return arr


def pack_tail_bits(bits: npt.NDArray[np.bool_]) -> npt.NDArray[np.uint8]:
    """uint8 ``[bs, N, ceil(N / 8)]`` (read-only, fresh): each row of the bool
    ``[bs, N, N]`` draft bits bit-packed little-endian (draft key ``a`` is bit ``a % 8``
    of byte ``a // 8``, the padding bits 0): :attr:`TreeMask.tail_words`."""
    return seal_inplace(np.packbits(bits, axis=2, bitorder="little"), np.uint8)


@readonly_when_unpickled
@attrs.frozen
class TreeMask:
    """The custom mask of a tree verify: a threshold over the prefix, explicit bits over
    the draft tokens.

    Request ``i`` has ``N`` rows (its draft tokens) and ``kv_lens[i]`` columns: the keys
    its call reads, the prefix's then the ``N`` drafts' from column ``tail_start[i]``
    on. Row ``t`` sees prefix column ``c < tail_start[i]`` when
    ``c >= first_visible[i] + row_offsets[i, t]`` (a sliding window measured from the
    row's *position*, or 0 to hide only the leading keys of the first page), and draft
    column ``tail_start[i] + a`` when ``tail_bits[i, t, a]`` (``a`` is an ancestor of
    ``t`` or ``t`` itself, inside the window).

    ``TreeMask(qo_lens, kv_lens, first_visible, row_offsets, tail_start, tail_words)``
    stores the arrays as given: read-only arrays of the dtypes and shapes below that
    pass :meth:`from_bits`' checks (the planner's: a tree's packed rows are its draft's
    :attr:`~flashplan.DraftTree.ancestor_words`, or window-trimmed rows packed by
    :func:`pack_tail_bits`). :meth:`from_bits` converts and checks any arrays, and packs
    the bits.

    >>> m = TreeMask.from_bits([2], [5], [1], [[0, 1]], [3], [[[True, False], [True, True]]])
    >>> m.dense(0).astype(int)
    array([[0, 1, 1, 1, 0],
           [0, 0, 1, 1, 1]])
    >>> m.tail_words.tolist()  # row 0 sees draft key 0, row 1 keys 0 and 1
    [[[1], [3]]]

    Attributes:
        qo_lens: int32 ``[bs]`` (tokens): ``N`` rows per request.
        kv_lens: int32 ``[bs]`` (tokens): columns per request.
        first_visible: int64 ``[bs]`` (columns): the prefix threshold of a row at
            offset 0.
        row_offsets: int32 ``[bs, N]`` (columns): each row's shift of that threshold.
        tail_start: int64 ``[bs]`` (columns): where the draft columns begin.
        tail_words: uint8 ``[bs, N, ceil(N / 8)]``: which draft key each row sees, each
            row bit-packed little-endian (draft key ``a`` is bit ``a % 8`` of byte
            ``a // 8``; the padding bits are 0): an eighth of the bytes of
            :attr:`tail_bits`, which is what the executors send to the device.
    """

    qo_lens: IntArray = attrs.field(eq=array_key)
    kv_lens: IntArray = attrs.field(eq=array_key)
    first_visible: npt.NDArray[np.int64] = attrs.field(eq=array_key)
    row_offsets: npt.NDArray[np.int32] = attrs.field(eq=array_key)
    tail_start: npt.NDArray[np.int64] = attrs.field(eq=array_key)
    tail_words: npt.NDArray[np.uint8] = attrs.field(eq=array_key)

    @classmethod
    def from_bits(
        cls, qo_lens: object, kv_lens: object, first_visible: object, row_offsets: object,
        tail_start: object, tail_bits: object,
    ) -> TreeMask:  # fmt: skip
        """A mask from any integer arrays and the draft bits as bool ``[bs, N, N]``
        (``tail_bits[i, t, a]``: row ``t`` sees draft key ``a``), packed here.

        Raises:
            LayoutError: lengths that are not 1-D integers ``>= 0``, thresholds or
                ``tail_start`` that are not 1-D integers, ``row_offsets`` that is not an
                integer ``[bs, N]`` array, bits that are not bool ``[bs, N, N]``, arrays
                without one entry per request, a request without ``N`` rows, or draft
                columns outside the call's keys.
        """
        qo = _mask_lengths("qo_lens", qo_lens)
        kv = _mask_lengths("kv_lens", kv_lens)
        first = _first_visible("first_visible", first_visible)
        offsets = _row_offsets("row_offsets", row_offsets)
        start = _first_visible("tail_start", tail_start)
        bits = _tail_bits("tail_bits", tail_bits)
        bs, n = offsets.shape
        sizes = {a.shape[0] for a in (qo, kv, first, start)}
        if sizes != {bs} or bits.shape[:2] != (bs, n):
            raise LayoutError("mask", "every array needs one entry per request", sizes=sizes)
        if bs and (qo != n).any():
            raise LayoutError("qo_lens", "a tree mask has N rows per request", num_tokens=n)
        if bs and ((start < 0) | (start + n > kv)).any():
            raise LayoutError("tail_start", "the draft columns must lie inside the call's keys")
        return cls(qo, kv, first, offsets, start, pack_tail_bits(bits))

    @cached_property
    def indptr(self) -> IntArray:
        """int32 ``[bs + 1]`` (bytes) offsets of the compact packed form."""
        return mask_indptr(self.qo_lens, self.kv_lens)

    @cached_property
    def tail_bits(self) -> npt.NDArray[np.bool_]:
        """bool ``[bs, N, N]`` (read-only): :attr:`tail_words` unpacked,
        ``tail_bits[i, t, a]`` when row ``t`` of request ``i`` sees draft key ``a``."""
        n = self.row_offsets.shape[1]
        bits = np.unpackbits(self.tail_words, axis=2, count=n, bitorder="little")
        return seal_inplace(bits.view(np.bool_), bool)

    def dense(self, request: int) -> npt.NDArray[np.bool_]:
        """bool ``[N, kv_len]``: request ``request``'s mask."""
        kv, start = int(self.kv_lens[request]), int(self.tail_start[request])
        n = self.row_offsets.shape[1]
        c = np.arange(kv)[None, :]
        thr = np.clip(int(self.first_visible[request]) + self.row_offsets[request], 0, kv)
        out = (c >= thr[:, None]) & (c < start)
        out[:, start : start + n] = self.tail_bits[request]
        return out

    @cached_property
    def packed(self) -> npt.NDArray[np.uint8]:
        """uint8 ``[indptr[-1]]``: the compact packed bytes (host; tests and the CPU)."""
        parts = [self.dense(i) for i in range(self.qo_lens.shape[0])]
        return pack_dense(parts)[0]


@readonly_when_unpickled
@attrs.frozen
class PositionMask:
    """A custom mask computed from positions: a bidirectional window or a chunk.

    Row ``j`` of request ``i`` is the query at position ``p = row_position[i] + j``;
    column ``c`` is the key at position ``k = col_position[i] + c``. The query sees the
    key when ``c < kv_lens[i]`` and the group's rule holds: ``k <= p`` (``causal``),
    ``k >= p - window_left`` (``window_left >= 0``), ``k <= p + window_right``
    (``window_right >= 0``) and ``k // chunk == p // chunk`` (``chunk >= 1``). Every row
    is one run of columns, so the mask is two integers per request and four per call;
    an executor expands it where it is used (on the host by :attr:`packed`).

    >>> m = PositionMask.from_arrays([3], [6], [2], [0], window_left=1, window_right=1)
    >>> m.dense(0).astype(int)
    array([[0, 1, 1, 1, 0, 0],
           [0, 0, 1, 1, 1, 0],
           [0, 0, 0, 1, 1, 1]])

    Attributes:
        qo_lens: int32 ``[bs]`` (tokens) rows per request.
        kv_lens: int32 ``[bs]`` (tokens) columns per request (the kernel's kv length).
        row_position: int64 ``[bs]`` (positions) of row 0's query.
        col_position: int64 ``[bs]`` (positions) of column 0's key.
        causal: hide keys after the query.
        window_left: left bound (tokens), -1 = none.
        window_right: right bound (tokens), -1 = none.
        chunk: chunk size (tokens), 0 = none.
    """

    qo_lens: IntArray = attrs.field(eq=array_key)
    kv_lens: IntArray = attrs.field(eq=array_key)
    row_position: npt.NDArray[np.int64] = attrs.field(eq=array_key)
    col_position: npt.NDArray[np.int64] = attrs.field(eq=array_key)
    causal: bool = False
    window_left: int = -1
    window_right: int = -1
    chunk: int = 0

    @classmethod
    def from_arrays(
        cls, qo_lens: object, kv_lens: object, row_position: object, col_position: object, *,
        causal: bool = False, window_left: int = -1, window_right: int = -1, chunk: int = 0,
    ) -> PositionMask:  # fmt: skip
        """A mask from any 1-D integer arrays (copied read-only).

        Raises:
            LayoutError: lengths that are not 1-D integers ``>= 0``, positions that are
                not 1-D integers, arrays without one entry per request, bounds below -1 or
                a negative chunk.
        """
        qo = _mask_lengths("qo_lens", qo_lens)
        kv = _mask_lengths("kv_lens", kv_lens)
        row = _first_visible("row_position", row_position)
        col = _first_visible("col_position", col_position)
        if {kv.shape[0], row.shape[0], col.shape[0]} != {qo.shape[0]}:
            raise LayoutError("mask", "every array needs one entry per request")
        if min(window_left, window_right) < -1 or chunk < 0:
            raise LayoutError(
                "mask", "bounds must be >= -1 and the chunk >= 0", window_left=window_left,
                window_right=window_right, chunk=chunk,
            )  # fmt: skip
        return cls(qo, kv, row, col, bool(causal), int(window_left), int(window_right), int(chunk))

    @cached_property
    def indptr(self) -> IntArray:
        """int32 ``[bs + 1]`` (bytes) offsets of the compact packed form."""
        return mask_indptr(self.qo_lens, self.kv_lens)

    def row_runs(
        self, pos: npt.NDArray[np.int64], col: npt.NDArray[np.int64]
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """``(first, stop)`` columns (int64, unclamped) of the visible run of the query
        at position ``pos`` over columns starting at position ``col`` (broadcast)."""
        big = np.int64(2**62)
        lo = np.full(np.broadcast_shapes(pos.shape, col.shape), -big, dtype=np.int64)
        hi = np.full(lo.shape, big, dtype=np.int64)
        if self.window_left >= 0:
            lo = np.maximum(lo, pos - self.window_left)
        if self.chunk:
            lo = np.maximum(lo, pos // self.chunk * self.chunk)
            hi = np.minimum(hi, (pos // self.chunk + 1) * self.chunk - 1)
        if self.causal:
            hi = np.minimum(hi, pos)
        if self.window_right >= 0:
            hi = np.minimum(hi, pos + self.window_right)
        return lo - col, hi + 1 - col

    @cached_property
    def packed(self) -> npt.NDArray[np.uint8]:
        """uint8 ``[indptr[-1]]``: the compact packed bytes (host; vectorized over rows)."""
        q = self.qo_lens
        req = np.repeat(np.arange(q.shape[0]), q)
        pos = threshold_rows(q, self.row_position)
        first, stop = self.row_runs(pos, self.col_position[req])
        return pack_threshold_rows(q, self.kv_lens, first, stop)[0]

    def dense(self, request: int) -> npt.NDArray[np.bool_]:
        """bool ``[qo_len, kv_len]``: request ``request``'s mask."""
        q, kv = int(self.qo_lens[request]), int(self.kv_lens[request])
        pos = int(self.row_position[request]) + np.arange(q, dtype=np.int64)[:, None]
        first, stop = self.row_runs(pos, np.array(self.col_position[request]))
        c = np.arange(kv)[None, :]
        return (c >= first) & (c < stop)


#: The custom masks a paged kernel call may carry as ``PagedPart.mask`` (a
#: :class:`PositionMask` is ``PagedPart.position_mask``: executors declare it apart).
CustomMask = ThresholdMask | TreeMask


def threshold_rows(
    qo_lens: IntArray, first_visible: npt.NDArray[np.int64]
) -> npt.NDArray[np.int64]:
    """Expand per-request ``first_visible`` to one value per row: ``first_visible[i] + j``."""
    q = qo_lens.astype(np.int64)
    req = np.repeat(np.arange(q.shape[0]), q)
    row = np.arange(req.shape[0]) - np.repeat(indptr(q)[:-1].astype(np.int64), q)
    return first_visible.astype(np.int64)[req] + row


def mask_indptr(qo_lens: IntArray, kv_lens: IntArray) -> IntArray:
    """int32 ``[bs + 1]`` (bytes): byte offsets of each request's packed mask."""
    bits = qo_lens.astype(np.int64) * kv_lens.astype(np.int64)
    return indptr((bits + 7) // 8)


def pack_threshold_rows(
    qo_lens: IntArray,
    kv_lens: IntArray,
    first_visible: npt.NDArray[np.int64],
    stop_visible: npt.NDArray[np.int64] | None = None,
) -> tuple[npt.NDArray[np.uint8], IntArray]:
    """Pack masks whose every row is one run of visible columns.

    Row ``j`` of request ``i`` sees columns ``c`` with
    ``first_visible_row <= c < stop_visible_row`` (``stop_visible`` defaults to
    ``kv_lens[i]``: "hidden up to a column, visible after it", the shape of a sliding
    window seen through a trimmed prefix; a bounded run is a bidirectional window or a
    chunk). The work is vectorized over all rows of the batch: each row's visible run
    is written as whole 0xFF bytes (a difference array and one cumulative sum) plus at
    most two partial boundary bytes.

    Args:
        qo_lens: int32 ``[bs]`` (tokens) rows per request.
        kv_lens: int32 ``[bs]`` (tokens) columns per request.
        first_visible: int64 ``[sum(qo_lens)]`` (columns, clamped to ``[0, kv_len]``
            here), in request-then-row order.
        stop_visible: int64 ``[sum(qo_lens)]`` (columns, exclusive, clamped to
            ``[0, kv_len]`` here), or ``None`` for ``kv_len``.

    Returns:
        ``(packed uint8 [indptr[-1]], indptr int32 [bs + 1] in bytes)``.
    """
    byte_ptr = mask_indptr(qo_lens, kv_lens)
    total_bytes = int(byte_ptr[-1])
    req = np.repeat(np.arange(qo_lens.shape[0]), qo_lens)
    row_in_req = np.arange(req.shape[0]) - np.repeat(indptr(qo_lens)[:-1], qo_lens)
    m = kv_lens.astype(np.int64)[req]
    base_bit = byte_ptr.astype(np.int64)[req] * 8 + row_in_req * m
    start = base_bit + np.clip(first_visible, 0, m)
    stop = base_bit + (m if stop_visible is None else np.clip(stop_visible, 0, m))
    keep = stop > start
    start, stop = start[keep], stop[keep]

    full_lo = (start + 7) // 8
    full_hi = stop // 8
    has_full = full_hi > full_lo
    diff = np.zeros(total_bytes + 1, dtype=np.int8)
    np.add.at(diff, full_lo[has_full], 1)
    np.add.at(diff, full_hi[has_full], -1)
    out = (np.cumsum(diff[:-1], dtype=np.int8) != 0).astype(np.uint8) * np.uint8(0xFF)

    # Partial bytes: the run's bits in the byte holding `start` and in the byte holding
    # `stop - 1`, when those bytes are not entirely covered.
    for lo_bit, hi_bit in (
        (start, np.minimum(stop, (start // 8 + 1) * 8)),
        (np.maximum(start, (stop - 1) // 8 * 8), stop),
    ):
        byte = lo_bit // 8
        lo = lo_bit - byte * 8
        hi = hi_bit - byte * 8
        bits = ((np.left_shift(1, hi) - 1) ^ (np.left_shift(1, lo) - 1)).astype(np.uint8)
        np.bitwise_or.at(out, byte, bits)
    return seal_inplace(out, np.uint8), byte_ptr


def pack_dense(masks: list[npt.NDArray[np.bool_]]) -> tuple[npt.NDArray[np.uint8], IntArray]:
    """Pack per-request dense boolean matrices (a simple, loop-based form for tests)."""
    parts = [np.packbits(np.asarray(m, dtype=bool).ravel(), bitorder="little") for m in masks]
    sizes = np.array([p.shape[0] for p in parts], dtype=np.int64)
    packed = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint8)
    return seal_inplace(packed, np.uint8), indptr(sizes)


def unpack_request(
    packed: npt.NDArray[np.uint8], indptr: IntArray, request: int, qo_len: int, kv_len: int
) -> npt.NDArray[np.bool_]:
    """Request ``request``'s ``[qo_len, kv_len]`` boolean matrix from a packed mask."""
    chunk = packed[int(indptr[request]) : int(indptr[request + 1])]
    bits = np.unpackbits(chunk, bitorder="little")[: qo_len * kv_len]
    return bits.astype(bool).reshape(qo_len, kv_len)
