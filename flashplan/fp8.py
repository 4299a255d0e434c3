"""FP8 KV caches: what is stored, what attention reads, and the per-tensor scales.

A cache of dtype ``torch.float8_e4m3fn`` or ``torch.float8_e5m2`` (``HeadConfig.kv_dtype``)
stores each new K (V) element ``x`` (in the queries' dtype) as

    stored = round_to_nearest_even(clamp(x / k_scale, -M, M))      (M: the format's max)

so a value beyond the format's range **saturates** to ``±M`` (``±inf`` too), and NaN stays
NaN. Attention reads ``float(stored) * k_scale``. ``k_scale`` and ``v_scale`` are
per-tensor (one per layer and per K / V), positive and finite: a Python number, or a
0-d float32 tensor on the cache's device (an engine's calibrated scale, read by the
kernels without a sync; its value is then the caller's promise, checked where a check
may read it back).

The functions here are the torch definitions (the reference executor's, and the twin
the write kernel is tested against).
"""

from __future__ import annotations

import math

import torch

from flashplan.errors import PlanMismatchError
from flashplan.layout.heads import FP8_DTYPES

__all__ = ["Scale", "check_scale", "dequantize", "fp8_max", "quantize", "scale_value"]

#: A per-tensor scale: a Python number or a 0-d float32 tensor on the cache's device.
Scale = float | torch.Tensor


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an fp8 ``dtype`` (448 for e4m3fn, 57344 for e5m2)."""
    return float(torch.finfo(dtype).max)


def check_scale(name: str, value: object, device: torch.device, *, read: bool) -> Scale:
    """``value`` as a scale for a cache on ``device`` (``name``: ``"k_scale"`` or
    ``"v_scale"``; ``None`` means 1.0).

    A number must be positive and finite. A tensor must be a 0-d float32 tensor on
    ``device``; with ``read=True`` its value is read (a sync on a GPU) and checked too.

    Raises:
        PlanMismatchError: (a ``ValueError``) a scale of another type, shape, dtype or
            device, or one that is zero, negative or not finite.
    """
    if value is None:
        return 1.0
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.dtype != torch.float32 or value.device != device:
            raise PlanMismatchError(
                name, f"a tensor scale must be a 0-d float32 tensor on {device}",
                shape=tuple(value.shape), dtype=str(value.dtype), device=str(value.device),
            )  # fmt: skip
        if read:
            _check_number(name, float(value))
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PlanMismatchError(
            name, "must be a number or a 0-d float32 tensor", type=type(value).__name__
        )
    _check_number(name, float(value))
    return float(value)


def _check_number(name: str, value: float) -> None:
    if not math.isfinite(value) or value <= 0:
        raise PlanMismatchError(name, "must be positive and finite", value=value)


def scale_value(scale: Scale, like: torch.Tensor) -> torch.Tensor | float:
    """``scale`` ready to multiply ``like`` with: a number as is, a tensor cast to
    ``like``'s dtype (no sync)."""
    return scale.to(like.dtype) if isinstance(scale, torch.Tensor) else scale


def quantize(x: torch.Tensor, scale: Scale, dtype: torch.dtype) -> torch.Tensor:
    """``x`` stored in the fp8 ``dtype`` with ``scale`` (module docstring): divided in
    float32, saturated to the format's range (NaN kept), rounded to nearest even."""
    if dtype not in FP8_DTYPES:
        raise PlanMismatchError("kv_dtype", "not an fp8 dtype", dtype=str(dtype))
    top = fp8_max(dtype)
    y = x.to(torch.float32)
    y = y / scale_value(scale, y)
    return y.clamp(-top, top).to(dtype)  # clamp keeps NaN; every value now fits


def dequantize(stored: torch.Tensor, scale: Scale, dtype: torch.dtype) -> torch.Tensor:
    """What attention reads from fp8 ``stored``: ``stored * scale`` in ``dtype``."""
    y = stored.to(dtype)
    return y * scale_value(scale, y)
