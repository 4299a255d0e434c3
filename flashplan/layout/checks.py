"""The checks a `BatchLayout` runs on its fields, alone and against each other.

The field converters (``seq_lens``, ``prefix_lens``, …) run from attrs' ``__init__``
(so from every constructor and from ``attrs.evolve``); :func:`check_layout` runs from
``__attrs_post_init__`` and checks the fields against each other. Each function checks
one rule and raises a :class:`~flashplan.errors.LayoutError` that names the field, the
request and the offending values.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

from flashplan.arrays import INT32_MAX, IntArray
from flashplan.errors import FieldTypeError, LayoutError
from flashplan.layout.convert import ArrayLike, as_flags, as_int, as_lengths
from flashplan.layout.drafts import DraftTree, check_draft_fits
from flashplan.layout.group import AttentionGroup, as_groups
from flashplan.layout.items import FIELD as ITEMS
from flashplan.layout.items import ItemDelimiters, as_item_delimiters, check_items_fit
from flashplan.layout.mode import Mode
from flashplan.lengths import ceil_pages

__all__ = [
    "check_encoder",
    "check_layout",
    "check_lengths",
    "check_totals",
    "draft_field",
    "encoder_cached_field",
    "encoder_lens_field",
    "first_index",
    "groups_field",
    "item_delimiters_field",
    "mode_field",
    "optional_flags",
    "optional_lengths",
    "page_size_field",
    "prefix_lens_field",
    "seq_lens_field",
]


def optional_lengths(field: str, value: object) -> IntArray | None:
    return None if value is None else as_lengths(field, value)


def optional_flags(field: str, value: object) -> npt.NDArray[np.bool_] | None:
    return None if value is None else as_flags(field, value)


def first_index(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


# -- field converters (BatchLayout's attrs converters: one per field) ------------------------
def mode_field(value: object) -> Mode:
    """``mode``: a :class:`Mode` (its value strings are refused)."""
    if not isinstance(value, Mode):
        raise FieldTypeError("mode", "must be a flashplan.Mode", value=value)
    return value


def seq_lens_field(value: ArrayLike) -> IntArray:
    """``seq_lens`` as read-only int32 ``[bs]`` (tokens, each ``>= 0``)."""
    return as_lengths("seq_lens", value)


def prefix_lens_field(value: ArrayLike) -> IntArray:
    """``prefix_lens`` as read-only int32 ``[bs]`` (tokens, each ``>= 0``)."""
    return as_lengths("prefix_lens", value)


def encoder_lens_field(value: ArrayLike | None) -> IntArray | None:
    """``encoder_lens`` as read-only int32 ``[bs]`` (tokens), or ``None``."""
    return optional_lengths("encoder_lens", value)


def page_size_field(value: int) -> int:
    """``page_size`` as an int in ``[1, INT32_MAX]`` (tokens)."""
    return as_int("page_size", value, minimum=1)


def groups_field(value: Iterable[AttentionGroup] | AttentionGroup) -> tuple[AttentionGroup, ...]:
    """``groups``: one group or an iterable of distinct groups, as a tuple."""
    return as_groups("groups", value)


def encoder_cached_field(value: object) -> npt.NDArray[np.bool_] | None:
    """``encoder_cached`` as a read-only bool ``[bs]``, or ``None``."""
    return optional_flags("encoder_cached", value)


def draft_field(value: object) -> DraftTree | None:
    """``draft``: a :class:`DraftTree` or ``None``."""
    if value is not None and not isinstance(value, DraftTree):
        raise FieldTypeError("draft", "must be a DraftTree", value=type(value).__name__)
    return value


def item_delimiters_field(value: object) -> ItemDelimiters | None:
    """``item_delimiters``: ``None``, an :class:`ItemDelimiters` or one entry per request."""
    return as_item_delimiters(ITEMS, value)


# -- the fields against each other ----------------------------------------------------------
def check_layout(
    mode: Mode,
    seq: IntArray,
    prefix: IntArray,
    encoder: IntArray | None,
    page_size: int,
    groups: tuple[AttentionGroup, ...],
    cached: npt.NDArray[np.bool_] | None,
    draft: DraftTree | None,
    items: ItemDelimiters | None,
) -> None:
    """Every rule between a layout's converted fields (what ``__attrs_post_init__`` runs):
    the lengths, the draft, the encoder, the delimiters, then the totals a plan holds in
    int32."""
    check_lengths(mode, seq, prefix)
    if (draft is not None) != (mode is Mode.VERIFY):
        raise LayoutError("draft", "a verify batch, and only a verify batch, has a draft")
    if draft is not None:
        check_draft_fits(draft, new_tokens=seq - prefix, groups=groups)
    check_encoder(seq, encoder, cached, groups)
    if items is not None:
        check_items_fit(items, extend=mode is Mode.EXTEND, extend_lens=seq - prefix, groups=groups)
    check_totals(seq, prefix, encoder, cached, page_size)


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


def check_totals(
    seq: IntArray,
    prefix: IntArray,
    encoder: IntArray | None,
    cached: npt.NDArray[np.bool_] | None,
    page_size: int,
) -> None:
    """The sums a plan holds in int32 index pointers, for checked lengths of one batch
    size (``prefix <= seq``): the new tokens of all requests (the queries' indptr), each
    row's last token (encoder pages + decoder tokens, row tokens) and the pages of all
    rows (the page indptr, pages), and the encoder tokens written this step (the
    encoder's indptr). So every derived value of an accepted layout fits int32
    (``decoder_start``, ``row_spans``, ``pages_needed``) and :func:`flashplan.plan`
    meets no total beyond int32.

    Without an encoder, one int64 sum of ``seq_lens`` settles it on the common path: a
    row's pages and new tokens are at most its ``seq_len``.

    Raises:
        LayoutError: ``seq_lens`` (naming the total, or the request whose row ends
            beyond int32) or ``encoder_lens`` (naming the request whose encoder, rounded
            to a page, ends beyond int32, or the total written).
    """
    if encoder is None and (not seq.size or np.add.reduce(seq, dtype=np.int64) <= INT32_MAX):
        return
    wide = seq.astype(np.int64)
    new = int(np.add.reduce(wide - prefix))
    if new > INT32_MAX:
        raise LayoutError(
            "seq_lens",
            "the new tokens (seq_lens - prefix_lens) of all requests exceed int32: a plan "
            "indexes them with int32 index pointers",
            total_new_tokens=new,
        )
    end = wide
    if encoder is not None:
        start = ceil_pages(encoder.astype(np.int64), page_size) * page_size
        if start.size and int(np.maximum.reduce(start)) > INT32_MAX:
            i = int(np.argmax(start))
            raise LayoutError(
                "encoder_lens", "encoder length rounded to a page exceeds int32", request=i,
                value=int(start[i]),
            )  # fmt: skip
        end = start + wide
        if end.size and int(np.maximum.reduce(end)) > INT32_MAX:
            i = int(np.flatnonzero(end > INT32_MAX)[0])  # the first offender
            raise LayoutError(
                "seq_lens", "encoder + decoder tokens exceed int32", request=i, end=int(end[i])
            )
    pages = int(np.add.reduce(ceil_pages(end, page_size)))
    if pages > INT32_MAX:
        raise LayoutError(
            "seq_lens",
            "the pages of all rows exceed int32: a plan indexes them with int32 index "
            "pointers (a larger page size needs fewer)",
            total_pages=pages,
            page_size=page_size,
        )
    if encoder is not None:
        written = encoder if cached is None else np.where(cached, 0, encoder)
        total = int(np.add.reduce(written, dtype=np.int64))
        if total > INT32_MAX:
            raise LayoutError(
                "encoder_lens",
                "the encoder tokens written this step (encoder_lens where not "
                "encoder_cached) exceed int32 in all: a plan indexes them with int32 "
                "index pointers",
                total_encoder_tokens=total,
            )
