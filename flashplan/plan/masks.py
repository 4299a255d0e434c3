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

from flashplan.layout.arrays import IntArray, cumsum0, frozen_array

__all__ = [
    "CustomMask",
    "mask_indptr",
    "pack_dense",
    "pack_threshold_rows",
    "threshold_rows",
    "unpack_request",
]


@attrs.frozen(eq=False)
class CustomMask:
    """A per-request custom mask of a paged kernel call.

    Two forms: *threshold rows* — row ``j`` of request ``i`` sees columns
    ``c >= first_visible[i] + j`` (clipped to ``[0, kv_len]``), the shape of a
    sliding window seen through a trimmed prefix, stored as one int per request
    and expanded only where it is used (on the GPU by a kernel, on the host by
    :attr:`packed`) — or *explicit* packed bytes.

    Attributes:
        qo_lens: int32 ``[bs]`` (tokens) rows per request.
        kv_lens: int32 ``[bs]`` (tokens) columns per request (the kernel's kv length).
        indptr: int32 ``[bs + 1]`` (bytes) offsets of the compact packed form:
            ``ceil(qo_len * kv_len / 8)`` bytes per request, byte-aligned.
        first_visible: int64 ``[bs]`` (columns) for the threshold form, else ``None``.
        explicit: uint8 ``[indptr[-1]]`` packed bytes for the explicit form, else ``None``.
    """

    qo_lens: IntArray
    kv_lens: IntArray
    indptr: IntArray
    first_visible: npt.NDArray[np.int64] | None = None
    explicit: npt.NDArray[np.uint8] | None = None

    @classmethod
    def from_threshold(
        cls, qo_lens: IntArray, kv_lens: IntArray, first_visible: npt.NDArray[np.int64]
    ) -> CustomMask:
        """Threshold-row form (see class docstring)."""
        return cls(
            qo_lens,
            kv_lens,
            mask_indptr(qo_lens, kv_lens),
            first_visible=frozen_array(first_visible, np.int64),
        )

    @classmethod
    def from_dense(cls, masks: list[npt.NDArray[np.bool_]]) -> CustomMask:
        """Explicit form from per-request ``[qo_len, kv_len]`` boolean matrices."""
        packed, indptr = pack_dense(masks)
        qo = frozen_array(np.array([m.shape[0] for m in masks], dtype=np.int64))
        kv = frozen_array(np.array([m.shape[1] for m in masks], dtype=np.int64))
        return cls(qo, kv, indptr, explicit=packed)

    @cached_property
    def packed(self) -> npt.NDArray[np.uint8]:
        """uint8 ``[indptr[-1]]``: the compact packed bytes (computed once, on the host)."""
        if self.explicit is not None:
            return self.explicit
        assert self.first_visible is not None
        return pack_threshold_rows(
            self.qo_lens, self.kv_lens, threshold_rows(self.qo_lens, self.first_visible)
        )[0]


def threshold_rows(
    qo_lens: IntArray, first_visible: npt.NDArray[np.int64]
) -> npt.NDArray[np.int64]:
    """Expand per-request ``first_visible`` to one value per row: ``first_visible[i] + j``."""
    q = qo_lens.astype(np.int64)
    req = np.repeat(np.arange(q.shape[0]), q)
    row = np.arange(req.shape[0]) - np.repeat(cumsum0(q)[:-1].astype(np.int64), q)
    return first_visible.astype(np.int64)[req] + row


def mask_indptr(qo_lens: IntArray, kv_lens: IntArray) -> IntArray:
    """int32 ``[bs + 1]`` (bytes): byte offsets of each request's packed mask."""
    bits = qo_lens.astype(np.int64) * kv_lens.astype(np.int64)
    return cumsum0((bits + 7) // 8)


def pack_threshold_rows(
    qo_lens: IntArray, kv_lens: IntArray, first_visible: npt.NDArray[np.int64]
) -> tuple[npt.NDArray[np.uint8], IntArray]:
    """Pack masks whose every row is "hidden up to a column, visible after it".

    Row ``j`` of request ``i`` sees columns ``c`` with
    ``first_visible_row <= c < kv_lens[i]``. This is the shape of a sliding window
    seen through a trimmed prefix. The work is vectorized over all rows of the
    batch: each row's visible run is written as whole 0xFF bytes (a difference
    array and one cumulative sum) plus at most two partial boundary bytes.

    Args:
        qo_lens: int32 ``[bs]`` (tokens) rows per request.
        kv_lens: int32 ``[bs]`` (tokens) columns per request.
        first_visible: int64 ``[sum(qo_lens)]`` (columns, clamped to ``[0, kv_len]``
            here), in request-then-row order.

    Returns:
        ``(packed uint8 [indptr[-1]], indptr int32 [bs + 1] in bytes)``.
    """
    indptr = mask_indptr(qo_lens, kv_lens)
    total_bytes = int(indptr[-1])
    req = np.repeat(np.arange(qo_lens.shape[0]), qo_lens)
    row_in_req = np.arange(req.shape[0]) - np.repeat(cumsum0(qo_lens)[:-1], qo_lens)
    m = kv_lens.astype(np.int64)[req]
    base_bit = indptr.astype(np.int64)[req] * 8 + row_in_req * m
    start = base_bit + np.clip(first_visible, 0, m)
    stop = base_bit + m
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
    return frozen_array(out, np.uint8), indptr


def pack_dense(masks: list[npt.NDArray[np.bool_]]) -> tuple[npt.NDArray[np.uint8], IntArray]:
    """Pack per-request dense boolean matrices (a simple, loop-based form for tests)."""
    parts = [np.packbits(np.asarray(m, dtype=bool).ravel(), bitorder="little") for m in masks]
    sizes = np.array([p.shape[0] for p in parts], dtype=np.int64)
    packed = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint8)
    return frozen_array(packed, np.uint8), cumsum0(sizes)


def unpack_request(
    packed: npt.NDArray[np.uint8], indptr: IntArray, request: int, qo_len: int, kv_len: int
) -> npt.NDArray[np.bool_]:
    """Request ``request``'s ``[qo_len, kv_len]`` boolean matrix from a packed mask."""
    chunk = packed[int(indptr[request]) : int(indptr[request + 1])]
    bits = np.unpackbits(chunk, bitorder="little")[: qo_len * kv_len]
    return bits.astype(bool).reshape(qo_len, kv_len)
