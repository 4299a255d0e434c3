"""The checks a `BatchLayout` runs on its lengths and encoder fields.

Each function checks one rule and raises a :class:`~flashplan.errors.LayoutError` that
names the field, the request and the offending values.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from flashplan.arrays import IntArray
from flashplan.errors import LayoutError
from flashplan.layout.convert import as_flags, as_lengths
from flashplan.layout.group import AttentionGroup
from flashplan.layout.mode import Mode

__all__ = ["check_encoder", "check_lengths", "first_index", "optional_flags", "optional_lengths"]


def optional_lengths(field: str, value: object) -> IntArray | None:
    return None if value is None else as_lengths(field, value)


def optional_flags(field: str, value: object) -> npt.NDArray[np.bool_] | None:
    return None if value is None else as_flags(field, value)


def first_index(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def check_lengths(mode: Mode, seq: IntArray, prefix: IntArray) -> None:
    """``prefix_lens`` against ``seq_lens``: one entry per request, never longer, and
    exactly one token added per request in a decode step."""
    bs = seq.shape[0]
    if prefix.shape[0] != bs:
        raise LayoutError(
            "prefix_lens",
            "batch size differs from seq_lens",
            seq_lens_size=bs,
            prefix_lens_size=prefix.shape[0],
        )
    if not bs:
        return
    added = seq - prefix  # int32: both lie in [0, INT32_MAX]
    if mode is Mode.DECODE:  # one new token each (so no prefix exceeds its seq_len)
        if np.minimum.reduce(added) != 1 or np.maximum.reduce(added) != 1:
            i = first_index(added != 1)
            raise LayoutError(
                "seq_lens",
                "a decode step adds exactly one token per request",
                request=i,
                seq_len=int(seq[i]),
                prefix_len=int(prefix[i]),
            )
    elif np.minimum.reduce(added) < 0:
        i = first_index(added < 0)
        raise LayoutError(
            "prefix_lens",
            "must not exceed seq_lens",
            request=i,
            prefix_len=int(prefix[i]),
            seq_len=int(seq[i]),
        )


def check_encoder(
    seq: IntArray,
    encoder: IntArray | None,
    cached: npt.NDArray[np.bool_] | None,
    groups: tuple[AttentionGroup, ...],
) -> None:
    """The encoder's fields against the batch, and cross groups against the encoder."""
    bs = seq.shape[0]
    if encoder is not None and encoder.shape[0] != bs:
        raise LayoutError(
            "encoder_lens",
            "batch size differs from seq_lens",
            seq_lens_size=bs,
            encoder_lens_size=encoder.shape[0],
        )
    if encoder is None and any(g.cross_attention for g in groups):
        raise LayoutError("encoder_lens", "a cross-attention group needs encoder_lens")
    if cached is not None:
        if encoder is None:
            raise LayoutError("encoder_cached", "needs encoder_lens")
        if cached.shape[0] != bs:
            raise LayoutError(
                "encoder_cached",
                "batch size differs from seq_lens",
                seq_lens_size=bs,
                encoder_cached_size=cached.shape[0],
            )
