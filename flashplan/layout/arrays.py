"""Host integer arrays: conversion, validation and value-based comparison.

Per-request data is held as read-only ``numpy`` int32 arrays (one array per
field, never one object per request). Conversion accepts sequences of ints,
numpy arrays and *CPU* torch tensors; a device tensor is refused, because reading
it would be a device sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Union

import numpy as np
import numpy.typing as npt
import torch

from flashplan.errors import LayoutError

__all__ = ["IntArray", "array_key", "as_lengths", "frozen_array", "cumsum0"]

IntArray = npt.NDArray[np.int32]
ArrayLike = Union[Sequence[int], npt.NDArray[Any], torch.Tensor]

_INT32_MAX = np.iinfo(np.int32).max


def frozen_array(values: npt.NDArray[Any], dtype: Any = np.int32) -> npt.NDArray[Any]:
    """Return ``values`` as a contiguous read-only array of ``dtype``."""
    out = np.ascontiguousarray(values, dtype=dtype)
    if out is values:
        out = out.copy()
    out.flags.writeable = False
    return out


def array_key(a: npt.NDArray[Any] | None) -> object:
    """Hashable value key of an array (dtype, shape, bytes); ``None`` stays ``None``."""
    if a is None:
        return None
    return (a.dtype.str, a.shape, a.tobytes())


def cumsum0(lengths: npt.NDArray[Any]) -> IntArray:
    """``[0, l0, l0 + l1, …]`` as int32 ``[n + 1]`` (an indptr), overflow-checked."""
    out = np.zeros(lengths.shape[0] + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    if out[-1] > _INT32_MAX:
        raise LayoutError("lengths", "total exceeds int32", total=int(out[-1]))
    return out.astype(np.int32)


def as_lengths(field: str, values: ArrayLike, *, minimum: int = 0) -> IntArray:
    """Validate per-request integers and return them as a read-only int32 array ``[bs]``.

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
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise LayoutError(field, "must be a 1-D sequence of ints", shape=arr.shape)
    if arr.dtype == np.bool_:
        raise LayoutError(field, "must hold ints, not bools")
    if arr.dtype.kind not in "iu":
        if arr.dtype.kind == "f":
            bad = np.flatnonzero(~np.isfinite(arr) | (arr != np.round(arr)))
            if bad.size:
                i = int(bad[0])
                raise LayoutError(field, "must hold integers", request=i, value=arr[i].item())
        elif arr.size:
            try:
                as_int = [int(v) for v in arr.tolist()]
            except (TypeError, ValueError):
                raise LayoutError(field, "must hold integers", dtype=str(arr.dtype)) from None
            for i, (v, raw) in enumerate(zip(as_int, arr.tolist())):
                if isinstance(raw, bool) or v != raw:
                    raise LayoutError(field, "must hold integers", request=i, value=raw)
        arr = arr.astype(np.int64) if arr.size else np.zeros(0, dtype=np.int64)
    low = np.flatnonzero(arr < minimum)
    if low.size:
        i = int(low[0])
        raise LayoutError(field, f"must be >= {minimum}", request=i, value=int(arr[i]))
    high = np.flatnonzero(arr > _INT32_MAX)
    if high.size:
        i = int(high[0])
        raise LayoutError(field, "exceeds int32", request=i, value=int(arr[i]))
    return frozen_array(arr)
