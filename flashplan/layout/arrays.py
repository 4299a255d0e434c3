"""Host integer arrays: conversion, validation and value-based comparison.

Per-request data is held as read-only ``numpy`` int32 arrays (one array per
field, never one object per request). Conversion accepts sequences of ints,
numpy arrays and *CPU* torch tensors; a device tensor is refused, because reading
it would be a device sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from flashplan.errors import LayoutError

__all__ = [
    "IntArray",
    "array_key",
    "as_int",
    "as_lengths",
    "cumsum0",
    "frozen_array",
    "is_int",
    "sealed",
]

IntArray = npt.NDArray[np.int32]
ArrayLike = Sequence[int] | npt.NDArray[Any] | torch.Tensor

_INT32_MAX = np.iinfo(np.int32).max


def frozen_array(values: npt.NDArray[Any], dtype: Any = np.int32) -> npt.NDArray[Any]:
    """Return ``values`` as a contiguous read-only array of ``dtype``."""
    out = np.ascontiguousarray(values, dtype=dtype)
    if out is values:
        out = out.copy()
    out.flags.writeable = False
    return out


def sealed(values: npt.NDArray[Any], dtype: Any = np.int32) -> npt.NDArray[Any]:
    """Like :func:`frozen_array` for an array the caller just computed and owns.

    Skips the defensive copy: the array itself is cast if needed and made read-only.
    Never pass an array someone else holds (use :func:`frozen_array` then).
    """
    out = values.astype(dtype, copy=False)
    if not out.flags.c_contiguous:
        out = np.ascontiguousarray(out)
    out.flags.writeable = False
    return out


def array_key(a: npt.NDArray[Any] | None) -> object:
    """Hashable value key of an array (dtype, shape, bytes); ``None`` stays ``None``."""
    if a is None:
        return None
    return (a.dtype.str, a.shape, a.tobytes())


def cumsum0(lengths: npt.NDArray[Any]) -> IntArray:
    """``[0, l0, l0 + l1, …]`` as read-only int32 ``[n + 1]`` (an indptr), overflow-checked."""
    out = np.zeros(lengths.shape[0] + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    if out[-1] > _INT32_MAX:
        raise LayoutError("lengths", "total exceeds int32", total=int(out[-1]))
    return sealed(out)


def is_int(value: object) -> bool:
    """True for Python and numpy integers (bools excluded)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def as_int(value: object) -> object:
    """Convert numpy integer scalars to ``int``; anything else is returned unchanged
    (for attrs converters: validators then see plain ints)."""
    return int(value) if isinstance(value, np.integer) else value


def _scalar(value: object) -> object:
    return value.item() if isinstance(value, np.generic) else value


def _first_non_integer(field: str, values: npt.NDArray[Any]) -> None:
    """Error path: report the first element that is not an integer (a loop is fine here)."""
    for i, raw in enumerate(values.tolist()):
        ok = is_int(raw) or (isinstance(raw, float) and np.isfinite(raw) and raw == int(raw))
        if not ok:
            raise LayoutError(field, "must hold integers", request=i, value=raw)


def as_lengths(field: str, values: ArrayLike, *, minimum: int = 0) -> IntArray:
    """Validate per-request integers and return them as a read-only int32 array ``[bs]``.

    The common case (an integer array or list of ints) is fully vectorized; the
    element-by-element path runs only to name the first offending request.

    Raises:
        LayoutError: naming ``field``, the first offending request and its value,
            for non-integers, values below ``minimum`` or above int32, device
            tensors and non-1-D input.
    """
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu":
            raise LayoutError(
                field,
                "must be host data (a device tensor would need a sync to read)",
                device=str(values.device),
            )
        values = values.numpy()
    try:
        arr = np.asarray(values)
    except (TypeError, ValueError, OverflowError):
        arr = np.asarray(values, dtype=object)
    if arr.dtype.kind in "USO" and not isinstance(values, np.ndarray):
        arr = np.asarray(values, dtype=object)  # keep each element's own type for the checks
    if arr.ndim != 1:
        raise LayoutError(field, "must be a 1-D sequence of ints", shape=arr.shape)
    if arr.size == 0:
        return frozen_array(np.zeros(0, dtype=np.int32))
    if arr.dtype == np.bool_:
        raise LayoutError(field, "must hold ints, not bools")
    if arr.dtype.kind not in "iuf":
        _first_non_integer(field, arr)
        arr = np.asarray([int(v) for v in arr.tolist()], dtype=object)  # error-free: all ints
    if arr.dtype.kind == "f":
        bad = np.flatnonzero(~np.isfinite(arr) | (arr != np.round(arr)))
        if bad.size:
            i = int(bad[0])
            raise LayoutError(field, "must hold integers", request=i, value=_scalar(arr[i]))
    if arr.min() < minimum:  # one reduction in the common case; locate only on error
        i = int(np.flatnonzero(arr < minimum)[0])
        raise LayoutError(field, f"must be >= {minimum}", request=i, value=_scalar(arr[i]))
    if arr.max() > _INT32_MAX:
        i = int(np.flatnonzero(arr > _INT32_MAX)[0])
        raise LayoutError(field, "exceeds int32", request=i, value=_scalar(arr[i]))
    return frozen_array(arr.astype(np.int64))
