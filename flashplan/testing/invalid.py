"""The invalid-input catalogue: Hypothesis strategies that draw input flashplan must
refuse, each with the error field and request the refusal must name."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
from hypothesis import strategies as st

from flashplan.layout.batch import MAX_ITEM_ROW, Mode
from flashplan.layout.shared_prefix import ShareLevel
from flashplan.testing.constructors import construct
from flashplan.testing.valid import attention_groups, item_requests

__all__ = ["INVALID_KINDS", "InvalidCase", "invalid_layout_kwargs"]


@attrs.frozen
class InvalidCase:
    """An invalid input and the error it must raise.

    Attributes:
        constructor: name of the constructor (a key of
            :data:`~flashplan.testing.constructors.CONSTRUCTORS`).
        kwargs: its keyword arguments.
        field: the field the :class:`~flashplan.FlashplanError` must name.
        request: index of the first offending request the error must name, or ``None``
            when the error is about the batch or record as a whole.
        kind: which rule is broken (``"negative_length"``, ``"string_length"`` …).
    """

    constructor: str
    kwargs: dict[str, Any]
    field: str
    request: int | None = None
    kind: str = ""

    def build(self) -> Any:
        """Call the constructor with the kwargs (it is expected to raise)."""
        return construct(self.constructor, self.kwargs)


@st.composite
def _valid_batch(draw: st.DrawFn, min_batch: int = 1) -> tuple[list[int], list[int]]:
    """``(seq_lens, prefix_lens)`` of a valid extend batch, 1..6 requests."""
    bs = draw(st.integers(min_batch, 6))
    seq = draw(st.lists(st.integers(1, 40), min_size=bs, max_size=bs))
    pre = [draw(st.integers(0, s)) for s in seq]
    return seq, pre


def _offenders(draw: st.DrawFn, bs: int) -> list[int]:
    return sorted(draw(st.lists(st.integers(0, bs - 1), min_size=1, max_size=bs, unique=True)))


_NON_INTEGRAL = (2.5, 0.5, -1.5, 1e-3, math.nan, math.inf, -math.inf)
_STRINGS = ("3", "x", "", "2.5", "one")
_BAD_PAGE_SIZES: tuple[Any, ...] = (0, -1, -16, 2.0, 1.5, "16", None, True, 16.0)


#: The routes to a layout from all its fields (``mode`` included): the attrs ``__init__``,
#: :meth:`BatchLayout.of` and ``attrs.evolve`` of a valid layout.
_RAW_CTORS = ("BatchLayout", "BatchLayout.of", "evolve(BatchLayout)")
#: The routes to an extend layout: :meth:`BatchLayout.extend` and the raw routes.
_EXTEND_CTORS = ("BatchLayout.extend", *_RAW_CTORS)


def _layout_fields(ctor: str) -> tuple[str, ...]:
    if ctor in _EXTEND_CTORS:
        return ("seq_lens", "prefix_lens", "encoder_lens")
    return {
        "BatchLayout.decode": ("seq_lens", "encoder_lens"),
        "BatchLayout.from_extend_lens": ("extend_lens", "prefix_lens"),
    }[ctor]


def _layout_kwargs(ctor: str, seq: list[int], pre: list[int]) -> dict[str, Any]:
    """Valid kwargs for a layout constructor over this batch (an extend but for
    ``BatchLayout.decode``)."""
    if ctor == "BatchLayout.decode":
        return {"seq_lens": list(seq)}
    if ctor in _EXTEND_CTORS:
        return _extend_kwargs(ctor, {"seq_lens": list(seq), "prefix_lens": list(pre)})
    return {"extend_lens": [s - p for s, p in zip(seq, pre, strict=True)], "prefix_lens": list(pre)}


def _extend_kwargs(ctor: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``BatchLayout.extend``'s kwargs for ``ctor`` (the raw routes add ``mode``)."""
    return {"mode": Mode.EXTEND, **kwargs} if ctor in _RAW_CTORS else kwargs


_LAYOUT_CTORS = (
    "BatchLayout.decode", "BatchLayout.extend", "BatchLayout.from_extend_lens", *_RAW_CTORS,
)  # fmt: skip


@st.composite
def _bad_values(draw: st.DrawFn, kind: str) -> InvalidCase:
    """Negative, too large, non-integral or string values injected into one per-request field."""
    ctor = draw(st.sampled_from(_LAYOUT_CTORS))
    field = draw(st.sampled_from(_layout_fields(ctor)))
    seq, pre = draw(_valid_batch())
    kwargs = _layout_kwargs(ctor, seq, pre)
    if field == "encoder_lens":
        kwargs["encoder_lens"] = draw(
            st.lists(st.integers(0, 40), min_size=len(seq), max_size=len(seq))
        )
    values: list[Any] = list(kwargs[field])
    bad = _offenders(draw, len(values))
    for i in bad:
        if kind == "negative_length":
            values[i] = -draw(st.integers(1, 1000))
        elif kind == "int32_overflow":
            values[i] = draw(st.integers(2**31, 2**62))
        elif kind == "non_integral_length":
            values[i] = draw(st.sampled_from(_NON_INTEGRAL))
        else:
            values[i] = draw(st.sampled_from(_STRINGS))
    if kind == "non_integral_length":  # integral floats elsewhere are accepted
        values = [
            float(v) if i not in bad and draw(st.booleans()) else v for i, v in enumerate(values)
        ]
    kwargs[field] = values
    return InvalidCase(ctor, kwargs, field, bad[0], kind)


@st.composite
def _prefix_over_seq(draw: st.DrawFn) -> InvalidCase:
    seq, pre = draw(_valid_batch())
    bad = _offenders(draw, len(seq))
    for i in bad:
        pre[i] = seq[i] + draw(st.integers(1, 50))
    ctor = draw(st.sampled_from(_EXTEND_CTORS))
    kwargs = _extend_kwargs(ctor, {"seq_lens": seq, "prefix_lens": pre})
    return InvalidCase(ctor, kwargs, "prefix_lens", bad[0], "prefix_over_seq")


@st.composite
def _decode_zero(draw: st.DrawFn) -> InvalidCase:
    seq, _ = draw(_valid_batch())
    bad = _offenders(draw, len(seq))
    for i in bad:
        seq[i] = 0
    return InvalidCase(
        "BatchLayout.decode", {"seq_lens": seq}, "seq_lens", bad[0], "decode_zero_length"
    )


@st.composite
def _decode_not_one_token(draw: st.DrawFn) -> InvalidCase:
    """A decode layout built from all its fields whose prefix is not ``seq_lens - 1``
    (issue 50: accepted by ``__init__``, it planned one write and read two new keys)."""
    seq, _ = draw(_valid_batch())
    pre = [s - 1 for s in seq]
    bad = _offenders(draw, len(seq))
    for i in bad:
        pre[i] = draw(st.sampled_from([p for p in range(seq[i] + 4) if p != seq[i] - 1]))
    ctor = draw(st.sampled_from(_RAW_CTORS))
    kwargs = {"mode": Mode.DECODE, "seq_lens": seq, "prefix_lens": pre}
    return InvalidCase(ctor, kwargs, "seq_lens", bad[0], "decode_not_one_token")


@st.composite
def _items_on_decode(draw: st.DrawFn) -> InvalidCase:
    """Delimiters (valid in themselves) on a decode layout built from all its fields."""
    seq, _ = draw(_valid_batch())
    delims = [draw(st.sampled_from(([0], None, (), [0]))) for _ in seq]
    kwargs = {
        "mode": Mode.DECODE, "seq_lens": seq, "prefix_lens": [s - 1 for s in seq],
        "item_delimiters": delims,
    }  # fmt: skip
    ctor = draw(st.sampled_from(_RAW_CTORS))
    return InvalidCase(ctor, kwargs, "item_delimiters", None, "items_on_decode")


@st.composite
def _int32_totals(draw: st.DrawFn) -> InvalidCase:
    """Rows that each fit int32 whose new tokens or pages in all do not (page size 1)."""
    bs = draw(st.integers(2, 4))
    big = 2**31 - 1
    seq = [draw(st.integers(big // 2 + 1, big)) for _ in range(bs)]
    pre = [s - draw(st.sampled_from((0, 1, s))) for s in seq]
    ctor = draw(st.sampled_from((*_EXTEND_CTORS, "BatchLayout.decode")))
    if ctor == "BatchLayout.decode":
        kwargs: dict[str, Any] = {"seq_lens": seq}
    else:
        kwargs = _extend_kwargs(ctor, {"seq_lens": seq, "prefix_lens": pre, "page_size": 1})
    return InvalidCase(ctor, kwargs, "seq_lens", None, "int32_totals")


_SHARE_FAULTS = ("sizes", "count", "shared_len", "overlap")


@st.composite
def _bad_share_level(draw: st.DrawFn) -> InvalidCase:
    """A :class:`~flashplan.ShareLevel` with one fault, on each route to one."""
    n = draw(st.integers(1, 4))
    count = [draw(st.integers(2, 5)) for _ in range(n)]
    first = [sum(count[:g]) + 2 * g for g in range(n)]
    shared = [draw(st.integers(1, 64)) for _ in range(n)]
    fault = draw(st.sampled_from(_SHARE_FAULTS))
    g = draw(st.integers(0, n - 1))
    field, request = fault, None
    if fault == "sizes":
        shared.append(7)
        field = "shared_len"
    elif fault == "count":
        count[g] = draw(st.integers(0, 1))
        request = first[g]
    elif fault == "shared_len":
        shared[g] = 0
    else:
        first.insert(g + 1, first[g] + count[g] - 1)
        count.insert(g + 1, 2)
        shared.insert(g + 1, 1)
        field = "first"
    ctor = draw(st.sampled_from(("ShareLevel", "ShareLevel.from_ranges", "evolve(ShareLevel)")))
    kwargs = {"first": first, "count": count, "shared_len": shared}
    return InvalidCase(ctor, kwargs, field, request, "bad_share_level")


@st.composite
def _bad_shared_prefix(draw: st.DrawFn) -> InvalidCase:
    """A :class:`~flashplan.SharedPrefix` without a level, with a level of another type,
    or with an inner level outside its outer groups or sharing no more tokens."""
    outer = ShareLevel.from_ranges([0], [4], [16])
    fault = draw(st.sampled_from(("empty", "type", "outside", "fewer")))
    levels: Any
    field = "levels"
    if fault == "empty":
        levels = draw(st.sampled_from(((), [])))
    elif fault == "type":
        levels = (outer, draw(st.sampled_from((None, 3, "level", (0, 2, 4)))))
    elif fault == "outside":
        levels = (outer, ShareLevel.from_ranges([3], [2], [32]))
    else:
        levels = (outer, ShareLevel.from_ranges([0], [2], [draw(st.integers(1, 16))]))
        field = "shared_len"
    ctor = draw(st.sampled_from(("SharedPrefix", "evolve(SharedPrefix)")))
    return InvalidCase(ctor, {"levels": levels}, field, None, "bad_shared_prefix")


@st.composite
def _batch_mismatch(draw: st.DrawFn) -> InvalidCase:
    ctor = draw(st.sampled_from(_LAYOUT_CTORS))
    seq, pre = draw(_valid_batch())
    kwargs = _layout_kwargs(ctor, seq, pre)
    if ctor in _EXTEND_CTORS:
        field = draw(st.sampled_from(("prefix_lens", "encoder_lens")))
    else:  # decode has no prefix argument; from_extend_lens checks its own prefix size
        field = "encoder_lens" if ctor == "BatchLayout.decode" else "prefix_lens"
    size = draw(st.integers(0, len(seq) + 3).filter(lambda n: n != len(seq)))
    if field == "prefix_lens":
        kwargs["prefix_lens"] = [0] * size
    else:
        kwargs["encoder_lens"] = draw(st.lists(st.integers(0, 40), min_size=size, max_size=size))
    return InvalidCase(ctor, kwargs, field, None, "batch_size_mismatch")


@st.composite
def _bad_page_size(draw: st.DrawFn) -> InvalidCase:
    ctor = draw(st.sampled_from(_LAYOUT_CTORS))
    seq, pre = draw(_valid_batch())
    kwargs = _layout_kwargs(ctor, seq, pre)
    kwargs["page_size"] = draw(st.sampled_from(_BAD_PAGE_SIZES) | st.integers(-100, 0))
    return InvalidCase(ctor, kwargs, "page_size", None, "bad_page_size")


@st.composite
def _cross_without_encoder(draw: st.DrawFn) -> InvalidCase:
    ctor = draw(st.sampled_from(_LAYOUT_CTORS))
    seq, pre = draw(_valid_batch())
    kwargs = _layout_kwargs(ctor, seq, pre)
    others = draw(
        st.lists(
            attention_groups(kinds=("full", "sliding", "bidirectional")), max_size=2, unique=True
        )
    )
    cross = draw(attention_groups(kinds=("cross",)))
    groups = [*others, cross]
    kwargs["groups"] = tuple(draw(st.permutations(groups)))
    return InvalidCase(ctor, kwargs, "encoder_lens", None, "cross_without_encoder")


@st.composite
def _bad_groups(draw: st.DrawFn) -> InvalidCase:
    ctor = draw(st.sampled_from(_LAYOUT_CTORS))
    seq, pre = draw(_valid_batch())
    kwargs = _layout_kwargs(ctor, seq, pre)
    if draw(st.booleans()):
        kwargs["groups"] = ()
    else:
        g = draw(attention_groups(kinds=("full", "sliding", "bidirectional")))
        kwargs["groups"] = (g, g)
    return InvalidCase(ctor, kwargs, "groups", None, "bad_groups")


@st.composite
def _bad_window(draw: st.DrawFn) -> InvalidCase:
    which = draw(st.sampled_from(("below_minus_one", "non_causal", "cross", "non_int")))
    if which == "below_minus_one":
        w = draw(st.integers(-(1 << 20), -2))
        if draw(st.booleans()):
            return InvalidCase(
                "AttentionGroup.sliding",
                {"window_left": w},
                "window_left",
                None,
                "window_below_minus_one",
            )
        return InvalidCase(
            draw(_group_ctor()), {"window_left": w}, "window_left", None, "window_below_minus_one"
        )
    if which == "non_int":
        not_int: Any = draw(st.sampled_from((2.5, 3.0, "4", None, True)))
        return InvalidCase(
            draw(_group_ctor()), {"window_left": not_int}, "window_left", None, "window_not_int"
        )
    w = draw(st.integers(0, 300))
    kwargs: dict[str, Any] = {"window_left": w, "causal": False}
    if which == "cross":
        kwargs["cross_attention"] = True
    return InvalidCase(draw(_group_ctor()), kwargs, "window_left", None, "window_non_causal")


def _group_ctor() -> st.SearchStrategy[str]:
    """``AttentionGroup(...)`` or ``attrs.evolve`` of a sliding group."""
    return st.sampled_from(("AttentionGroup", "evolve(AttentionGroup)"))


@st.composite
def _bad_heads(draw: st.DrawFn) -> InvalidCase:
    if draw(st.booleans()):
        kv = draw(st.integers(2, 16))
        qo = draw(st.integers(1, 64).filter(lambda q: q % kv != 0))
        return InvalidCase(
            draw(st.sampled_from(("HeadConfig", "evolve(HeadConfig)"))),
            {"num_qo_heads": qo, "num_kv_heads": kv, "head_dim": 128},
            "num_kv_heads",
            None,
            "heads_not_dividing",
        )
    field = draw(st.sampled_from(("num_qo_heads", "num_kv_heads", "head_dim")))
    kwargs: dict[str, Any] = {"num_qo_heads": 8, "num_kv_heads": 2, "head_dim": 128}
    kwargs[field] = draw(st.sampled_from((0, -1, 2.0, "8", None, True)))
    ctor = draw(st.sampled_from(("HeadConfig", "evolve(HeadConfig)")))
    return InvalidCase(ctor, kwargs, field, None, "heads_not_positive_int")


def _cross_causal() -> st.SearchStrategy[InvalidCase]:
    return st.sampled_from(({}, {"causal": True})).map(
        lambda extra: InvalidCase(
            "AttentionGroup", {"cross_attention": True, **extra}, "causal", None, "cross_causal"
        )
    )


@st.composite
def _item_batch(draw: st.DrawFn) -> tuple[list[int], list[int], list[list[Any] | None]]:
    """A valid multi-item batch (1..5 requests, some without delimiters)."""
    bs = draw(st.integers(1, 5))
    seq: list[int] = []
    pre: list[int] = []
    delims: list[list[Any] | None] = []
    for _ in range(bs):
        s, p, d = draw(item_requests(max_prefix=8, max_items=4, max_item_len=4))
        plain = draw(st.integers(0, 3)) == 0
        seq.append(s)
        pre.append(p)
        delims.append(None if plain else d)
    return seq, pre, delims


_ITEM_FAULTS = ("unsorted", "repeated", "negative", "beyond_extend", "not_int", "uint16_row")


@st.composite
def _bad_delimiters(draw: st.DrawFn, fault: str) -> InvalidCase:
    """Delimiters broken in one way in some requests; the first of them must be named."""
    seq, pre, delims = draw(_item_batch())
    if fault == "unsorted":  # needs two distinct delimiters to put out of order
        usable = [i for i, d in enumerate(delims) if d is not None and len(d) >= 2]
        if not usable:
            seq.append(12)
            pre.append(0)
            delims.append([3, 7])
            usable = [len(seq) - 1]
        bad = sorted(draw(st.lists(st.sampled_from(usable), min_size=1, unique=True)))
    else:
        bad = _offenders(draw, len(seq))
    for i in bad:
        d: list[Any] = list(delims[i] or [])
        ext = seq[i] - pre[i]
        if fault == "unsorted":
            d = d[::-1]
        elif fault == "repeated":
            if not d:
                seq[i] += 2
                d = [seq[i] - pre[i] - 1]
            k = draw(st.integers(0, len(d) - 1))
            d.insert(k, d[k])
        elif fault == "negative":
            d.insert(0, -draw(st.integers(1, 100)))
        elif fault == "beyond_extend":
            d.append(ext + draw(st.integers(0, 50)))
        elif fault == "not_int":
            d.append(draw(st.sampled_from((2.5, "3", True, None, 1e-3))))
        else:  # uint16_row: from the first delimiter on, one token too many (or more)
            first = d[0] if d else 0
            d = d or [0]
            seq[i] = pre[i] + first + MAX_ITEM_ROW + draw(st.sampled_from((1, 2, 1000)))
        delims[i] = d
    ctor = draw(st.sampled_from(_EXTEND_CTORS))
    kwargs = _extend_kwargs(ctor, {"seq_lens": seq, "prefix_lens": pre, "item_delimiters": delims})
    return InvalidCase(ctor, kwargs, "item_delimiters", bad[0], f"items_{fault}")


@st.composite
def _items_batch_mismatch(draw: st.DrawFn) -> InvalidCase:
    seq, pre, delims = draw(_item_batch())
    size = draw(st.integers(0, len(seq) + 3).filter(lambda n: n != len(seq)))
    delims = (delims * (size // max(len(delims), 1) + 1))[:size]
    ctor = draw(st.sampled_from(_EXTEND_CTORS))
    kwargs = _extend_kwargs(ctor, {"seq_lens": seq, "prefix_lens": pre, "item_delimiters": delims})
    return InvalidCase(ctor, kwargs, "item_delimiters", None, "items_batch_mismatch")


@st.composite
def _items_bad_group(draw: st.DrawFn) -> InvalidCase:
    """A sliding-window or bidirectional group in a multi-item batch."""
    seq, pre, delims = draw(_item_batch())
    bad = draw(attention_groups(kinds=("sliding", "bidirectional")))
    others = draw(st.lists(attention_groups(kinds=("full",)), max_size=2, unique=True))
    groups = tuple(draw(st.permutations([*others, bad])))
    ctor = draw(st.sampled_from(_EXTEND_CTORS))
    kwargs = _extend_kwargs(
        ctor, {"seq_lens": seq, "prefix_lens": pre, "item_delimiters": delims, "groups": groups}
    )
    return InvalidCase(ctor, kwargs, "groups", None, "items_bad_group")


_INVALID_KINDS: Mapping[str, Callable[[], st.SearchStrategy[InvalidCase]]] = {
    "negative_length": lambda: _bad_values("negative_length"),
    "int32_overflow": lambda: _bad_values("int32_overflow"),
    "non_integral_length": lambda: _bad_values("non_integral_length"),
    "string_length": lambda: _bad_values("string_length"),
    "prefix_over_seq": _prefix_over_seq,
    "decode_zero_length": _decode_zero,
    "decode_not_one_token": _decode_not_one_token,
    "items_on_decode": _items_on_decode,
    "int32_totals": _int32_totals,
    "bad_share_level": _bad_share_level,
    "bad_shared_prefix": _bad_shared_prefix,
    "batch_size_mismatch": _batch_mismatch,
    "bad_page_size": _bad_page_size,
    "cross_without_encoder": _cross_without_encoder,
    "bad_groups": _bad_groups,
    "bad_window": _bad_window,
    "bad_heads": _bad_heads,
    "cross_causal": _cross_causal,
    **{f"items_{f}": functools.partial(_bad_delimiters, f) for f in _ITEM_FAULTS},
    "items_batch_mismatch": _items_batch_mismatch,
    "items_bad_group": _items_bad_group,
}

#: Kinds of invalid input :func:`invalid_layout_kwargs` can draw.
INVALID_KINDS: tuple[str, ...] = tuple(_INVALID_KINDS)


def invalid_layout_kwargs(*, kinds: Sequence[str] | None = None) -> st.SearchStrategy[InvalidCase]:
    """Draw invalid constructor input and the error it must raise.

    Each draw is an :class:`InvalidCase`: constructor name, kwargs, the expected error
    field, the first offending request's index (or ``None``) and the kind of rule
    broken. Build it with ``case.build()``; it must raise a
    :class:`~flashplan.FlashplanError` whose ``field`` and ``request`` match. The
    constructor is drawn among the routes to the record (named constructors, the attrs
    ``__init__``, ``attrs.evolve`` of a valid record:
    :data:`~flashplan.testing.constructors.CONSTRUCTORS`), which must refuse alike.
    Every draw breaks exactly one rule:

    * negative lengths (``seq_lens``, ``prefix_lens``, ``encoder_lens``, ``extend_lens``),
    * lengths beyond int32 (up to 2**62),
    * non-integral floats (2.5, NaN, ±inf) among ints or integral floats,
    * strings among the lengths,
    * ``prefix_lens > seq_lens`` (the first offender is expected),
    * batch-size mismatches between per-request fields,
    * ``page_size <= 0`` or not an int (2.0, "16", ``None``, ``True``),
    * a decode request with ``seq_len = 0``, or (from all fields) whose prefix is not
      ``seq_len - 1``; delimiters on a decode layout,
    * rows that fit int32 whose new tokens or pages in all do not (``seq_lens``),
    * ``encoder_lens`` of the wrong size, a cross group without ``encoder_lens``,
    * no group, or a repeated group,
    * ``window_left < -1`` or not an int, a window on a non-causal (or cross) group,
    * a causal cross group,
    * head counts that do not divide, non-positive head sizes,
    * multi-item delimiters (``item_delimiters``) that are unsorted, repeated,
      negative, not below the request's new-token count, not integers, or leave more
      than 65535 tokens from the first delimiter on (FlashInfer's uint16 positions);
      one entry per request missing or extra; a sliding-window or bidirectional group
      in a multi-item batch,
    * a :class:`~flashplan.ShareLevel` of arrays of different lengths, a group of fewer
      than 2 requests or sharing no token, groups that overlap; a
      :class:`~flashplan.SharedPrefix` without a level, with a level that is not one, or
      an inner level outside its outer group or sharing no more tokens.

    Args:
        kinds: restrict to some of :data:`INVALID_KINDS`.
    """
    chosen = INVALID_KINDS if kinds is None else tuple(kinds)
    unknown = set(chosen) - set(_INVALID_KINDS)
    if unknown:
        raise ValueError(f"unknown invalid kinds {sorted(unknown)}; known: {INVALID_KINDS}")
    return st.one_of(*(_INVALID_KINDS[k]() for k in chosen))
