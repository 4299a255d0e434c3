"""Read-only host integer arrays: the data type every flashplan record holds.

Per-request data lives in read-only ``numpy`` arrays (one array per field, never one
object per request). Two ways to make one, named by whether they copy:

* :func:`copy_readonly` always copies: use it for an array someone else may hold.
* :func:`seal_inplace` never copies an array of the right dtype and layout: it marks
  the caller's own freshly computed array read-only.

:func:`indptr` turns lengths into FlashInfer-style index pointers (checked int32; the
plain int64 running sum under it is :func:`running_sum`), and
:func:`checked_int32` casts a derived value computed in int64 to int32 after checking
that it fits, so no derived length, offset or page id can wrap around.
"""

from __future__ import annotations

import functools
from typing import Any, TypeVar

import attrs
import numpy as np
import numpy.typing as npt

from flashplan.errors import LayoutError

__all__ = [
    "INT32_MAX",
    "INT32_MIN",
    "IntArray",
    "array_key",
    "checked_int32",
    "concat_ranges",
    "constant_operand",
    "copy_readonly",
    "filled",
    "first_beyond_int32",
    "indptr",
    "int32_field",
    "readonly_when_unpickled",
    "running_sum",
    "same_length",
    "seal_inplace",
    "zeros",
]

IntArray = npt.NDArray[np.int32]

#: Largest value of every int32 array flashplan hands to a kernel.
INT32_MAX = int(np.iinfo(np.int32).max)


@functools.lru_cache(maxsize=256)
def constant_operand(value: int, dtype: Any = np.int32) -> npt.NDArray[Any]:
    """A read-only 0-d array of ``dtype`` holding ``value`` (made once per value and
    dtype, shared).

    As the other operand of array arithmetic of that dtype it gives the same result as
    the Python int, at about half the host cost at batch sizes: numpy 2 checks a Python
    int operand against the array's dtype on every call.
    """
    out = np.array(value, dtype=dtype)
    out.setflags(write=False)
    return out


@functools.lru_cache(maxsize=64)
def filled(value: int, size: int) -> IntArray:
    """A read-only int32 ``[size]`` holding ``value`` everywhere, made once per value
    and size and shared (read-only, so records may share it: a step loop meets the same
    few batch sizes)."""
    out = np.empty(size, dtype=np.int32)
    out.fill(value)  # cheaper than np.full
    out.setflags(write=False)
    return out


@functools.lru_cache(maxsize=64)
def zeros(shape: tuple[int, ...], dtype: str) -> npt.NDArray[Any]:
    """A read-only array of zeros of ``shape`` and ``dtype``, made once per shape and
    dtype and shared (as :func:`filled`)."""
    out = np.zeros(shape, dtype=dtype)
    out.setflags(write=False)
    return out


def copy_readonly(values: npt.ArrayLike, dtype: Any = np.int32) -> npt.NDArray[Any]:
    """A fresh contiguous read-only copy of ``values`` as ``dtype`` (always copies)."""
    out = np.array(values, dtype=dtype, copy=True, order="C")
    out.setflags(write=False)
    return out


def seal_inplace(values: npt.NDArray[Any], dtype: Any = np.int32) -> npt.NDArray[Any]:
    """Mark the caller's own array read-only, casting it to ``dtype`` only if needed.

    Never copies an array that already has ``dtype`` and C layout: the caller gives up
    the right to write it. Never pass an array someone else holds (use
    :func:`copy_readonly` then).
    """
    out = values.astype(dtype, copy=False)
    if not out.flags.c_contiguous:
        out = np.ascontiguousarray(out)
    out.setflags(write=False)  # cheaper than out.flags.writeable = False
    return out


def checked_int32(field: str, values: npt.NDArray[Any], what: str) -> IntArray:
    """Seal an int64 array computed by flashplan as int32, refusing values that overflow.

    Raises:
        LayoutError: naming ``field``, the first request whose value does not fit in
            int32 and that value (``what`` says what the value is).
    """
    if values.size:
        over = (values > INT32_MAX) | (values < -INT32_MAX - 1)
        if over.any():
            i = int(np.flatnonzero(over)[0])
            raise LayoutError(field, f"{what} exceeds int32", request=i, value=int(values[i]))
    return seal_inplace(values)


def indptr(lengths: npt.NDArray[Any], field: str = "lengths") -> IntArray:
    """``[0, l0, l0 + l1, …]``: read-only int32 ``[n + 1]`` index pointers of lengths
    ``>= 0``.

    int32 lengths (the common case: sealed per-request arrays) are summed in int32: each
    is below ``2**31``, so the first running sum to pass int32 lands in ``[2**31,
    2**32)`` and reads negative, which one reduction finds (cheaper than an int64 sum
    and a cast back).

    Raises:
        LayoutError: the total exceeds int32 (named after ``field``).
    """
    if lengths.dtype == np.int32:
        out = np.empty(lengths.shape[0] + 1, dtype=np.int32)
        out[0] = 0
        np.add.accumulate(lengths, out=out[1:])
        if np.minimum.reduce(out) < 0:
            total = int(running_sum(lengths)[-1])
            raise LayoutError(field, "total exceeds int32", total=total)
        out.setflags(write=False)
        return out
    wide = running_sum(lengths)
    if wide[-1] > INT32_MAX:
        raise LayoutError(field, "total exceeds int32", total=int(wide[-1]))
    return seal_inplace(wide)


def concat_ranges(starts: npt.NDArray[Any], counts: npt.NDArray[Any]) -> npt.NDArray[np.int64]:
    """int64 ``[sum(counts)]``: the runs ``starts[i], ..., starts[i] + counts[i] - 1``, one
    after the other (counts ``>= 0``).

    >>> concat_ranges(np.array([4, 0, 9]), np.array([2, 0, 3])).tolist()
    [4, 5, 9, 10, 11]
    """
    c = np.asarray(counts, dtype=np.int64)
    shift = np.asarray(starts, dtype=np.int64) - running_sum(c)[:-1]
    return np.repeat(shift, c) + np.arange(int(c.sum()))


def running_sum(values: npt.NDArray[Any]) -> npt.NDArray[np.int64]:
    """``[0, v0, v0 + v1, …]``: int64 ``[n + 1]``, summed in int64 (no check, no seal)."""
    out = np.empty(values.shape[0] + 1, dtype=np.int64)
    out[0] = 0
    # The ufunc itself: np.cumsum's Python wrapper costs more than the sum at these sizes.
    np.add.accumulate(values, dtype=np.int64, out=out[1:])
    return out


def array_key(a: npt.NDArray[Any] | None) -> object:
    """Hashable value key of an array (dtype, shape, bytes); ``None`` stays ``None``.

    Used as attrs' ``eq`` key so that records holding arrays compare and hash by value.
    """
    if a is None:
        return None
    return (a.dtype.str, a.shape, a.tobytes())


_Record = TypeVar("_Record", bound=type)


def readonly_when_unpickled(cls: _Record) -> _Record:
    """Class decorator for attrs records holding arrays: pickling and ``copy.deepcopy``
    give back *read-only* arrays, as the original holds (numpy restores them writable,
    which would let a copy's hash change under it). Apply it above ``@attrs.frozen``."""
    restore = cls.__setstate__  # type: ignore[attr-defined]

    def __setstate__(self: Any, state: Any) -> None:
        restore(self, state)
        for field in attrs.fields(type(self)):
            value = getattr(self, field.name)
            if isinstance(value, np.ndarray):
                value.flags.writeable = False

    cls.__setstate__ = __setstate__  # type: ignore[attr-defined]
    return cls


#: Smallest int32.
INT32_MIN = -INT32_MAX - 1


def first_beyond_int32(arr: npt.NDArray[Any]) -> tuple[int, ...] | None:
    """The index (row-major) of the first entry of the integer array ``arr`` that an
    int32 cast would wrap, or ``None`` (always for int32 and narrower dtypes)."""
    if arr.dtype.itemsize < 4 or arr.dtype == np.int32 or not arr.size:
        return None
    outside = (arr < INT32_MIN) | (arr > INT32_MAX)
    if not outside.any():
        return None
    return tuple(int(x) for x in np.argwhere(outside)[0])


def int32_field(field: str, value: object) -> IntArray:
    """``value`` (a 1-D integer array) as a read-only int32 array, for a record's field
    converter; a sealed int32 array is kept as it is.

    Raises:
        LayoutError: not 1-D integers, or an entry beyond int32 (naming the request).
    """
    if (
        type(value) is np.ndarray
        and value.dtype == np.int32
        and value.ndim == 1
        and not value.flags.writeable
    ):  # sealed: kept as it is, before any conversion
        return value
    arr = np.asarray(value)
    if arr.ndim == 1 and arr.size == 0 and arr.dtype.kind == "f":
        arr = arr.astype(np.int32)  # an empty list: numpy reads it as float64
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise LayoutError(field, "must be a 1-D integer array", shape=getattr(value, "shape", None))
    if arr.dtype == np.int32 and not arr.flags.writeable:
        return arr
    beyond = first_beyond_int32(arr)  # would wrap in the int32 cast
    if beyond is not None:
        (i,) = beyond
        raise LayoutError(field, "exceeds int32", request=i, value=int(arr[i]))
    return seal_inplace(np.array(arr, dtype=np.int32))


def same_length(field: str, *arrays: npt.NDArray[Any]) -> None:
    """Raise :class:`~flashplan.LayoutError` unless every array has one entry per request."""
    sizes = {a.shape[0] for a in arrays}
    if len(sizes) > 1:
        raise LayoutError(field, "arrays must have one entry per request", sizes=sorted(sizes))
