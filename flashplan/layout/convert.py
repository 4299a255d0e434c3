"""Converters and validators of user input, shared by every record's fields.

Each function takes the *field name* and the raw value, and returns the normalised
value or raises a :class:`~flashplan.LayoutError` naming the field, the first
offending request (for per-request data) and the value. Records call them from attrs
converters (``converter=lambda v: as_int("page_size", v, minimum=1)``; attrs runs
converters before validators), so ``__init__``, ``attrs.evolve`` and the named
constructors share one path, and nothing is converted (``float()``, ``bool()``)
before it is validated.

Accepted per-request data: sequences of ints, numpy integer (or integral float)
arrays and *CPU* torch tensors of any real dtype. A device tensor is refused: reading
it would be a device sync.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from decimal import Decimal
from fractions import Fraction
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from flashplan.arrays import INT32_MAX, IntArray, copy_readonly
from flashplan.errors import FieldTypeError, LayoutError

__all__ = [
    "ArrayLike",
    "as_bool",
    "as_flags",
    "as_int",
    "as_lengths",
    "as_real",
    "is_int",
]

ArrayLike = Sequence[int] | npt.NDArray[Any] | torch.Tensor

_REALS = (int, float, np.integer, np.floating, Fraction, Decimal)


def is_int(value: object) -> bool:
    """True for Python and numpy integers (bools excluded)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def as_int(
    field: str, value: object, *, minimum: int | None = None, maximum: int = INT32_MAX
) -> int:
    """An integer scalar in ``[minimum, maximum]`` as a Python ``int``.

    Raises:
        LayoutError: not an int (floats, strings and bools are refused) or out of range.
    """
    if not is_int(value):
        raise FieldTypeError(field, "must be an int", value=value)
    out = int(value)  # type: ignore[call-overload]
    if minimum is not None and out < minimum:
        raise LayoutError(field, f"must be >= {minimum}", value=out)
    if out > maximum:
        raise LayoutError(field, f"must be <= {maximum}", value=out)
    return out


def as_bool(field: str, value: object) -> bool:
    """A ``bool`` (or numpy bool); anything else — ``"False"``, 0, 1 — is refused."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise FieldTypeError(field, "must be a bool", value=value)


def as_real(field: str, value: object) -> float:
    """A real number (int, float, numpy scalar, Fraction, Decimal) as a finite float.

    Raises:
        LayoutError: bools, strings, complex numbers, tensors, ``None``, or a value
            that is not finite.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, _REALS):
        raise FieldTypeError(field, "must be a real number", value=value)
    try:
        out = float(value)
    except (OverflowError, ValueError):
        raise LayoutError(field, "must be a finite real number", value=value) from None
    if not math.isfinite(out):
        raise LayoutError(field, "must be a finite real number", value=value)
    return out


_BOOL_TYPES = frozenset((bool, np.bool_))


def _host_numpy(field: str, values: object) -> npt.NDArray[Any]:
    """``values`` as a numpy array (object dtype when the elements are not all numbers)."""
    if isinstance(values, np.ndarray):  # the common case first: no ABC check
        return values
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu":
            raise LayoutError(
                field,
                "must be host data (a device tensor would need a sync to read)",
                device=str(values.device),
            )
        if values.layout != torch.strided:
            raise LayoutError(field, "must be a dense tensor", layout=str(values.layout))
        t = values.detach()
        if t.dtype == torch.bool or t.is_complex():
            raise FieldTypeError(field, "must hold integers", dtype=str(t.dtype))
        if t.is_floating_point() and t.dtype not in (torch.float32, torch.float64):
            t = t.to(torch.float64)  # bfloat16, float8 …: numpy has no such dtype
        return t.numpy()
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, np.ndarray)):
        raise FieldTypeError(field, "must be a 1-D sequence of ints", type=type(values).__name__)
    if not _BOOL_TYPES.isdisjoint(map(type, values)):
        arr = np.empty(len(values), dtype=object)  # numpy would turn True into 1
        arr[:] = list(values)
        return arr
    try:
        arr = np.asarray(values)
    except (TypeError, ValueError, OverflowError):
        arr = np.empty(len(values), dtype=object)
        arr[:] = list(values)
    if arr.dtype.kind in "USVMmc":  # strings, bytes, dates, complex: element by element
        arr = np.empty(len(values), dtype=object)
        arr[:] = list(values)
    return arr


#: The problems of :func:`_element_problem` that are about an element's type.
_TYPE_PROBLEMS = frozenset({"must hold ints, not bools", "must hold integers"})


def _element_problem(value: object, minimum: int) -> str | None:
    """Why one element is not a valid length (``None`` when it is)."""
    if isinstance(value, (bool, np.bool_)):
        return "must hold ints, not bools"
    if is_int(value):
        n = int(value)  # type: ignore[call-overload]
    elif isinstance(value, (float, np.floating)) and math.isfinite(value) and value == int(value):
        n = int(value)
    else:
        return "must hold integers"
    if n < minimum:
        return f"must be >= {minimum}"
    if n > INT32_MAX:
        return "exceeds int32"
    return None


def as_lengths(field: str, values: object, *, minimum: int = 0) -> IntArray:
    """Validate per-request integers; return them as a read-only int32 array ``[bs]``.

    Integer and float arrays are checked in a few vectorized reductions; the
    element-by-element path runs only for mixed or non-numeric input and to locate
    the first offending request.

    Raises:
        LayoutError: naming ``field``, the *first* offending request (whatever is wrong
            with it: not an integer, a bool, below ``minimum``, beyond int32) and its
            value; device tensors, sparse tensors and input that is not 1-D. A
            :class:`~flashplan.errors.FieldTypeError` (also a ``TypeError``) when the
            input or an element has the wrong type.
    """
    if (
        isinstance(values, np.ndarray)
        and values.dtype == np.int32
        and values.ndim == 1
        and not values.flags.writeable
        and values.base is None
    ):  # already sealed by flashplan (a named constructor): check, don't copy
        if values.size and int(values.min()) < minimum:
            i = int(np.flatnonzero(values < minimum)[0])
            raise LayoutError(field, f"must be >= {minimum}", request=i, value=int(values[i]))
        return values
    arr = _host_numpy(field, values)
    if arr.ndim != 1:
        raise LayoutError(field, "must be a 1-D sequence of ints", shape=tuple(arr.shape))
    if arr.size == 0:
        return copy_readonly(np.zeros(0, dtype=np.int32))
    kind = arr.dtype.kind
    if kind in "iu":
        # Two reductions (no temporaries) on the common, valid path; the mask below
        # only to locate the first offending request.
        if np.minimum.reduce(arr) >= minimum and np.maximum.reduce(arr) <= INT32_MAX:
            return copy_readonly(arr)
        bad = (arr < minimum) | (arr > INT32_MAX)
    elif kind == "f":
        if arr.dtype.itemsize < 8:  # float16 / float32: INT32_MAX would not fit the dtype
            arr = arr.astype(np.float64)
        with np.errstate(invalid="ignore"):
            bad = ~np.isfinite(arr) | (arr != np.round(arr)) | (arr < minimum) | (arr > INT32_MAX)
    else:  # bools, objects: one check per element
        problems = [_element_problem(v, minimum) for v in arr.tolist()]
        bad = np.array([p is not None for p in problems], dtype=bool)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raw = arr[i]
        value = raw.item() if isinstance(raw, np.generic) else raw
        problem = _element_problem(value, minimum) or "must hold integers"
        error = FieldTypeError if problem in _TYPE_PROBLEMS else LayoutError
        raise error(field, problem, request=i, value=value)
    if kind not in "iuf":
        arr = np.array([int(v) for v in arr.tolist()], dtype=np.int64)
    return copy_readonly(arr)


def as_flags(field: str, values: object) -> npt.NDArray[np.bool_]:
    """Per-request booleans (a sequence of bools, a bool array or a CPU bool tensor) as a
    read-only bool array ``[bs]``; ints and strings are refused, naming the request."""
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu" or values.layout != torch.strided:
            raise LayoutError(field, "must be a dense host tensor", device=str(values.device))
        if values.dtype != torch.bool:
            raise FieldTypeError(field, "must hold bools", dtype=str(values.dtype))
        values = values.detach().numpy()
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, np.ndarray)):
        raise FieldTypeError(field, "must be a 1-D sequence of bools", type=type(values).__name__)
    items = list(values) if not isinstance(values, np.ndarray) else values.tolist()
    if isinstance(values, np.ndarray) and values.ndim != 1:
        raise LayoutError(field, "must be a 1-D sequence of bools", shape=values.shape)
    for i, v in enumerate(items):
        if not isinstance(v, (bool, np.bool_)):
            raise FieldTypeError(field, "must hold bools", request=i, value=v)
    return copy_readonly(np.array(items, dtype=bool), bool)
