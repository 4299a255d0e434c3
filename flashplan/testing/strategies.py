"""Hypothesis strategies that draw flashplan inputs: groups, heads, layouts, tables, caches.

Every strategy draws *valid* input unless its name says otherwise
(:func:`invalid_layout_kwargs`). Sizes are small by default (at most 8 requests,
sequence lengths mostly up to 64 tokens and now and then up to 300) so that dense
oracles stay cheap; every bound is a keyword argument.

The edge cases that break attention planners are drawn on purpose: page sizes that do
not divide the lengths (1, 2, 3, 16), windows of 0 keys back, windows shorter and
longer than the sequences, requests with no new token, with one new token, with no
token at all, encoders of length 0, several groups per layout.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from hypothesis import strategies as st

from flashplan.layout import AttentionGroup, BatchLayout, HeadConfig, PageTable

__all__ = [
    "DTYPES",
    "GROUP_KINDS",
    "HEAD_DIMS",
    "INVALID_KINDS",
    "PAGE_SIZES",
    "InvalidCase",
    "attention_groups",
    "construct",
    "decode_layouts",
    "extend_layouts",
    "head_configs",
    "invalid_layout_kwargs",
    "kv_caches",
    "layouts",
    "page_tables",
]

#: Page sizes drawn by default: the token table (1), sizes that divide nothing (2, 3),
#: and a production size (16).
PAGE_SIZES: tuple[int, ...] = (1, 2, 3, 16)
#: Head sizes drawn by default.
HEAD_DIMS: tuple[int, ...] = (64, 128, 256)
#: Floating dtypes drawn by default.
DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32)
#: Kinds of :class:`~flashplan.AttentionGroup` drawn by :func:`attention_groups`.
GROUP_KINDS: tuple[str, ...] = ("full", "sliding", "bidirectional", "cross")

_SOFT_CAPS = (1.0, 20.0, 30.0, 50.0)
_LONG_WINDOWS = (127, 1023, 4095, 1 << 20)


# --------------------------------------------------------------------------- groups / heads
def _windows(max_window: int | None) -> st.SearchStrategy[int]:
    small = st.integers(0, 8)  # 0 = "only the query's own key"
    medium = st.integers(9, 300)
    large = st.sampled_from(_LONG_WINDOWS)
    out = st.one_of(small, small, medium, large)
    if max_window is not None:
        out = out.map(lambda w: min(w, max_window))
    return out


@st.composite
def attention_groups(
    draw: st.DrawFn,
    *,
    kinds: Sequence[str] = GROUP_KINDS,
    windows: st.SearchStrategy[int] | None = None,
    max_window: int | None = None,
    soft_cap: bool = True,
    sm_scale: bool = True,
) -> AttentionGroup:
    """Draw an :class:`~flashplan.AttentionGroup`.

    Args:
        kinds: subset of :data:`GROUP_KINDS` to draw from: ``"full"`` (causal, no
            window), ``"sliding"`` (causal with ``window_left >= 0``: 0 and other small
            windows, windows around typical lengths, and windows far longer than any
            drawn sequence), ``"bidirectional"`` (non-causal self-attention),
            ``"cross"`` (attention to the encoder; a layout holding it needs
            ``encoder_lens``).
        windows: strategy for ``window_left`` of sliding groups (default: the mix above).
        max_window: clamp drawn windows to this value.
        soft_cap: whether a logits soft cap may be drawn (otherwise always 0 = off).
        sm_scale: whether an explicit softmax scale may be drawn (otherwise ``None``).
    """
    kind = draw(st.sampled_from(tuple(kinds)))
    cap = draw(st.sampled_from((0.0, 0.0, *_SOFT_CAPS))) if soft_cap else 0.0
    scale = draw(st.sampled_from((None, None, None, 0.125, 0.5))) if sm_scale else None
    if kind == "full":
        return AttentionGroup.full(logits_soft_cap=cap, sm_scale=scale)
    if kind == "sliding":
        window = draw(windows if windows is not None else _windows(max_window))
        return AttentionGroup.sliding(window, logits_soft_cap=cap, sm_scale=scale)
    if kind == "bidirectional":
        return AttentionGroup.bidirectional(logits_soft_cap=cap, sm_scale=scale)
    if kind == "cross":
        return AttentionGroup.cross(logits_soft_cap=cap, sm_scale=scale)
    raise ValueError(f"unknown group kind {kind!r}; expected one of {GROUP_KINDS}")


@st.composite
def head_configs(
    draw: st.DrawFn,
    *,
    head_dims: Sequence[int] = HEAD_DIMS,
    dtypes: Sequence[torch.dtype] = DTYPES,
    max_kv_heads: int = 8,
    max_group_size: int = 8,
    mixed_dtypes: bool = False,
) -> HeadConfig:
    """Draw a :class:`~flashplan.HeadConfig`: MHA, GQA or MQA.

    Args:
        head_dims: head sizes to draw from.
        dtypes: dtypes to draw from.
        max_kv_heads: most KV heads (MHA and GQA).
        max_group_size: most query heads per KV head (GQA and MQA).
        mixed_dtypes: draw ``kv_dtype`` and ``out_dtype`` independently of ``q_dtype``
            (default: all three equal, as FlashInfer's fp16/bf16 kernels expect).
    """
    kind = draw(st.sampled_from(("mha", "gqa", "mqa")))
    if kind == "mha":
        kv, group = draw(st.integers(1, max_kv_heads)), 1
    elif kind == "gqa":
        kv = draw(st.integers(1, max_kv_heads))
        group = draw(st.integers(min(2, max_group_size), max_group_size))
    else:
        kv, group = 1, draw(st.integers(1, max_group_size))
    q_dtype = draw(st.sampled_from(tuple(dtypes)))
    kv_dtype = draw(st.sampled_from(tuple(dtypes))) if mixed_dtypes else q_dtype
    out_dtype = draw(st.sampled_from(tuple(dtypes))) if mixed_dtypes else q_dtype
    return HeadConfig(
        num_qo_heads=kv * group,
        num_kv_heads=kv,
        head_dim=draw(st.sampled_from(tuple(head_dims))),
        q_dtype=q_dtype,
        kv_dtype=kv_dtype,
        out_dtype=out_dtype,
    )


# --------------------------------------------------------------------------- layouts
def _length(lo: int, max_len: int, long_len: int) -> st.SearchStrategy[int]:
    """Mostly ``[lo, max_len]``; one draw in four from ``[lo, long_len]``."""
    lo = min(lo, max_len)
    short = st.integers(lo, max_len)
    if long_len <= max_len:
        return short
    return st.one_of(short, short, short, st.integers(lo, long_len))


@st.composite
def _groups_and_encoder(
    draw: st.DrawFn,
    groups: Iterable[AttentionGroup] | None,
    encoder: bool | None,
    max_groups: int,
) -> tuple[tuple[AttentionGroup, ...], bool]:
    if groups is not None:
        fixed = tuple(groups)
        needs_encoder = any(g.cross_attention for g in fixed)
        if encoder is False and needs_encoder:
            raise ValueError("encoder=False with a cross-attention group")
        has_encoder = needs_encoder or (draw(st.booleans()) if encoder is None else encoder)
        return fixed, has_encoder
    has_encoder = draw(st.booleans()) if encoder is None else encoder
    kinds = GROUP_KINDS if has_encoder else tuple(k for k in GROUP_KINDS if k != "cross")
    drawn = draw(
        st.lists(attention_groups(kinds=kinds), min_size=1, max_size=max_groups, unique=True)
    )
    return tuple(drawn), has_encoder


def _page_size(draw: st.DrawFn, page_size: int | None, page_sizes: Sequence[int]) -> int:
    return page_size if page_size is not None else draw(st.sampled_from(tuple(page_sizes)))


@st.composite
def decode_layouts(
    draw: st.DrawFn,
    *,
    min_batch: int = 0,
    max_batch: int = 8,
    max_len: int = 64,
    long_len: int = 300,
    page_size: int | None = None,
    page_sizes: Sequence[int] = PAGE_SIZES,
    groups: Iterable[AttentionGroup] | None = None,
    encoder: bool | None = None,
    max_groups: int = 3,
) -> BatchLayout:
    """Draw a decode :class:`~flashplan.BatchLayout` (one new token per request).

    Args:
        min_batch, max_batch: bounds on the number of requests (0 = empty batch).
        max_len: usual upper bound on ``seq_lens`` (>= 1; a 1 means "only the new token").
        long_len: now and then (one length in four) lengths go up to this instead.
        page_size: fix the page size; otherwise drawn from ``page_sizes``.
        groups: fix the groups; otherwise 1 to ``max_groups`` distinct groups are drawn
            (a cross group only when the layout has an encoder).
        encoder: ``True``/``False`` to force ``encoder_lens`` on/off (lengths 0 included);
            ``None`` draws it (always on when ``groups`` holds a cross group).
    """
    ps = _page_size(draw, page_size, page_sizes)
    gs, has_encoder = draw(_groups_and_encoder(groups, encoder, max_groups))
    bs = draw(st.integers(min_batch, max_batch))
    seq = draw(st.lists(_length(1, max(max_len, 1), long_len), min_size=bs, max_size=bs))
    enc = (
        draw(st.lists(_length(0, max_len, long_len), min_size=bs, max_size=bs))
        if has_encoder
        else None
    )
    return BatchLayout.decode(seq, page_size=ps, groups=gs, encoder_lens=enc)


_REQUEST_KINDS = ("general", "general", "general", "empty_extend", "single_token", "zero_length")


@st.composite
def _extend_request(
    draw: st.DrawFn, with_prefix: bool, max_len: int, long_len: int
) -> tuple[int, int]:
    """One request's ``(seq_len, prefix_len)``."""
    kind = draw(st.sampled_from(_REQUEST_KINDS))
    if kind == "zero_length":
        return 0, 0
    if kind == "single_token":
        seq = draw(_length(1, max_len, long_len)) if with_prefix else 1
        return seq, seq - 1
    if kind == "empty_extend":  # cached tokens, nothing new (0 tokens when no prefix)
        seq = draw(_length(0, max_len, long_len)) if with_prefix else 0
        return seq, seq
    seq = draw(_length(0, max_len, long_len))
    prefix = draw(st.integers(0, seq)) if with_prefix else 0
    return seq, prefix


@st.composite
def extend_layouts(
    draw: st.DrawFn,
    *,
    min_batch: int = 0,
    max_batch: int = 8,
    max_len: int = 64,
    long_len: int = 300,
    page_size: int | None = None,
    page_sizes: Sequence[int] = PAGE_SIZES,
    groups: Iterable[AttentionGroup] | None = None,
    encoder: bool | None = None,
    prefix: bool | None = None,
    max_groups: int = 3,
) -> BatchLayout:
    """Draw an extend (prefill / chunked prefill) :class:`~flashplan.BatchLayout`.

    Each request is one of: a general request (``0 <= prefix_len <= seq_len``), an empty
    extend (cached tokens, no new one), a single new token, or a zero-length request
    (no token at all).

    Args:
        min_batch, max_batch: bounds on the number of requests (0 = empty batch).
        max_len: usual upper bound on ``seq_lens``; ``long_len``: the occasional one.
        page_size: fix the page size; otherwise drawn from ``page_sizes``.
        groups: fix the groups; otherwise 1 to ``max_groups`` distinct groups are drawn.
        encoder: force ``encoder_lens`` on/off; ``None`` draws it (on for cross groups).
        prefix: ``False``: no request has a cached prefix (a plain prefill);
            ``True``: prefixes are drawn (a request may still draw 0);
            ``None``: draw which of the two.
    """
    ps = _page_size(draw, page_size, page_sizes)
    gs, has_encoder = draw(_groups_and_encoder(groups, encoder, max_groups))
    with_prefix = draw(st.booleans()) if prefix is None else prefix
    bs = draw(st.integers(min_batch, max_batch))
    reqs = draw(st.lists(_extend_request(with_prefix, max_len, long_len), min_size=bs, max_size=bs))
    seq = [s for s, _ in reqs]
    pre = [p for _, p in reqs]
    enc = (
        draw(st.lists(_length(0, max_len, long_len), min_size=bs, max_size=bs))
        if has_encoder
        else None
    )
    return BatchLayout.extend(seq, pre, page_size=ps, groups=gs, encoder_lens=enc)


def layouts(
    *,
    min_batch: int = 0,
    max_batch: int = 8,
    max_len: int = 64,
    long_len: int = 300,
    page_size: int | None = None,
    page_sizes: Sequence[int] = PAGE_SIZES,
    groups: Iterable[AttentionGroup] | None = None,
    encoder: bool | None = None,
    max_groups: int = 3,
) -> st.SearchStrategy[BatchLayout]:
    """Draw a :class:`~flashplan.BatchLayout` of any mode (decode or extend).

    Takes the keyword arguments common to :func:`decode_layouts` and
    :func:`extend_layouts`.
    """
    fixed = None if groups is None else tuple(groups)
    kw: dict[str, Any] = dict(
        min_batch=min_batch,
        max_batch=max_batch,
        max_len=max_len,
        long_len=long_len,
        page_size=page_size,
        page_sizes=page_sizes,
        groups=fixed,
        encoder=encoder,
        max_groups=max_groups,
    )
    return st.one_of(decode_layouts(**kw), extend_layouts(**kw))


# --------------------------------------------------------------------------- tables / caches
def _pages_needed(source: Any) -> np.ndarray:
    need = getattr(source, "pages_needed", source)  # PlanSpec, BatchLayout or ints
    if isinstance(need, torch.Tensor):
        need = need.cpu().numpy()
    out = np.asarray(need, dtype=np.int64).reshape(-1)
    if (out < 0).any():
        raise ValueError(f"pages_needed must be >= 0, got {out.tolist()}")
    return out


@st.composite
def page_tables(
    draw: st.DrawFn,
    spec_or_pages_needed: Any,
    *,
    max_extra_columns: int = 3,
    max_spare_pages: int = 8,
    max_extra_rows: int = 2,
    shuffle: bool = True,
    device: torch.device | str = "cpu",
) -> tuple[PageTable, int]:
    """Draw a page table holding a batch, and the size of the page pool it points into.

    Every request gets its own pages: the ids of different requests never overlap.
    Page ids are a random permutation of ``[0, num_pages)`` (so a request's pages are
    not consecutive or ordered), the pool has spare pages nobody uses, the table has
    extra columns beyond the longest request and extra rows, and each request's row is
    drawn at random. Entries past a request's ``pages_needed`` hold arbitrary (valid)
    page ids, which planners must never read.

    Args:
        spec_or_pages_needed: a :class:`~flashplan.PlanSpec` or
            :class:`~flashplan.BatchLayout` (their ``pages_needed``) or int ``[bs]``.
        max_extra_columns: most columns beyond the longest request.
        max_spare_pages: most unused pages in the pool.
        max_extra_rows: most table rows that belong to no request.
        shuffle: draw page ids and rows at random (otherwise in order).
        device: device of the returned table's ``pages``.

    Returns:
        ``(table, num_pages)``: a :class:`~flashplan.PageTable` and the number of pages
        in the pool (size a KV cache with it, e.g. with :func:`kv_caches`).
    """
    need = _pages_needed(spec_or_pages_needed)
    bs = int(need.shape[0])
    spare = draw(st.integers(0, max_spare_pages))
    extra_cols = draw(st.integers(0, max_extra_columns))
    extra_rows = draw(st.integers(0, max_extra_rows))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    num_pages = int(need.sum()) + spare
    ids = rng.permutation(num_pages) if shuffle else np.arange(num_pages)
    width = max((int(need.max()) if bs else 0) + extra_cols, 1)
    num_rows = bs + extra_rows
    rows = rng.permutation(num_rows)[:bs] if shuffle else np.arange(bs)
    table = rng.integers(0, max(num_pages, 1), size=(num_rows, width), dtype=np.int64)
    offset = 0
    for i in range(bs):
        n = int(need[i])
        table[rows[i], :n] = ids[offset : offset + n]
        offset += n
    pages = torch.from_numpy(table.astype(np.int32)).to(device)
    return PageTable(pages=pages, rows=rows.astype(np.int32)), num_pages


@st.composite
def kv_caches(
    draw: st.DrawFn,
    num_pages: int,
    page_size: int,
    heads: HeadConfig,
    dtype: torch.dtype | None = None,
    *,
    device: torch.device | str = "cpu",
    scale: float = 1.0,
) -> torch.Tensor:
    """Draw a random paged KV cache ``[num_pages, 2, page_size, num_kv_heads, head_dim]``.

    Index 0 of dim 1 holds keys, 1 values (FlashInfer's NHD layout). Values are
    ``scale`` times standard normal samples from a drawn seed (shrinks to seed 0).

    Args:
        num_pages: pages in the pool (e.g. the second value of :func:`page_tables`).
        page_size: tokens per page.
        heads: the head configuration (KV heads, head size, default dtype).
        dtype: cache dtype (default ``heads.kv_dtype``).
        device: where the cache lives.
        scale: standard deviation of the values.
    """
    seed = draw(st.integers(0, 2**32 - 1))
    gen = torch.Generator().manual_seed(seed)
    shape = (num_pages, 2, page_size, heads.num_kv_heads, heads.head_dim)
    cache = torch.randn(shape, generator=gen, dtype=torch.float32) * scale
    return cache.to(dtype=dtype or heads.kv_dtype, device=device)


# --------------------------------------------------------------------------- invalid input
_CONSTRUCTORS: Mapping[str, Callable[..., Any]] = {
    "BatchLayout.decode": BatchLayout.decode,
    "BatchLayout.extend": BatchLayout.extend,
    "BatchLayout.from_extend_lens": BatchLayout.from_extend_lens,
    "AttentionGroup": AttentionGroup,
    "AttentionGroup.sliding": AttentionGroup.sliding,
    "HeadConfig": HeadConfig,
}


def construct(constructor: str, kwargs: Mapping[str, Any]) -> Any:
    """Call the constructor named by an :func:`invalid_layout_kwargs` draw.

    ``constructor`` is one of ``"BatchLayout.decode"``, ``"BatchLayout.extend"``,
    ``"BatchLayout.from_extend_lens"``, ``"AttentionGroup"``, ``"AttentionGroup.sliding"``,
    ``"HeadConfig"``.
    """
    return _CONSTRUCTORS[constructor](**kwargs)


class _Triple(NamedTuple):
    constructor: str
    kwargs: dict[str, Any]
    field: str


class InvalidCase(_Triple):
    """An invalid input: ``(constructor, kwargs, field)``, plus ``request`` and ``kind``.

    Unpacks as the triple ``(constructor name, kwargs, expected error field)``.

    Attributes:
        request: index of the first offending request the error must name, or ``None``
            when the error is about the batch or record as a whole.
        kind: which rule is broken (``"negative_length"``, ``"string_length"`` …).
    """

    request: int | None
    kind: str

    def __new__(
        cls,
        constructor: str,
        kwargs: dict[str, Any],
        field: str,
        request: int | None = None,
        kind: str = "",
    ) -> InvalidCase:
        self = super().__new__(cls, constructor, kwargs, field)
        self.request = request
        self.kind = kind
        return self

    def __repr__(self) -> str:
        return (
            f"InvalidCase(constructor={self.constructor!r}, kwargs={self.kwargs!r}, "
            f"field={self.field!r}, request={self.request!r}, kind={self.kind!r})"
        )

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


def _layout_fields(ctor: str) -> tuple[str, ...]:
    return {
        "BatchLayout.decode": ("seq_lens", "encoder_lens"),
        "BatchLayout.extend": ("seq_lens", "prefix_lens", "encoder_lens"),
        "BatchLayout.from_extend_lens": ("extend_lens", "prefix_lens"),
    }[ctor]


def _layout_kwargs(ctor: str, seq: list[int], pre: list[int]) -> dict[str, Any]:
    """Valid kwargs for a layout constructor over this batch."""
    if ctor == "BatchLayout.decode":
        return {"seq_lens": list(seq)}
    if ctor == "BatchLayout.extend":
        return {"seq_lens": list(seq), "prefix_lens": list(pre)}
    return {"extend_lens": [s - p for s, p in zip(seq, pre, strict=True)], "prefix_lens": list(pre)}


_LAYOUT_CTORS = ("BatchLayout.decode", "BatchLayout.extend", "BatchLayout.from_extend_lens")


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
    return InvalidCase(
        "BatchLayout.extend",
        {"seq_lens": seq, "prefix_lens": pre},
        "prefix_lens",
        bad[0],
        "prefix_over_seq",
    )


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
def _batch_mismatch(draw: st.DrawFn) -> InvalidCase:
    ctor = draw(st.sampled_from(_LAYOUT_CTORS))
    seq, pre = draw(_valid_batch())
    kwargs = _layout_kwargs(ctor, seq, pre)
    if ctor == "BatchLayout.extend":
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
            "AttentionGroup", {"window_left": w}, "window_left", None, "window_below_minus_one"
        )
    if which == "non_int":
        not_int: Any = draw(st.sampled_from((2.5, 3.0, "4", None, True)))
        return InvalidCase(
            "AttentionGroup", {"window_left": not_int}, "window_left", None, "window_not_int"
        )
    w = draw(st.integers(0, 300))
    kwargs: dict[str, Any] = {"window_left": w, "causal": False}
    if which == "cross":
        kwargs["cross_attention"] = True
    return InvalidCase("AttentionGroup", kwargs, "window_left", None, "window_non_causal")


@st.composite
def _bad_heads(draw: st.DrawFn) -> InvalidCase:
    if draw(st.booleans()):
        kv = draw(st.integers(2, 16))
        qo = draw(st.integers(1, 64).filter(lambda q: q % kv != 0))
        return InvalidCase(
            "HeadConfig",
            {"num_qo_heads": qo, "num_kv_heads": kv, "head_dim": 128},
            "num_kv_heads",
            None,
            "heads_not_dividing",
        )
    field = draw(st.sampled_from(("num_qo_heads", "num_kv_heads", "head_dim")))
    kwargs: dict[str, Any] = {"num_qo_heads": 8, "num_kv_heads": 2, "head_dim": 128}
    kwargs[field] = draw(st.sampled_from((0, -1, 2.0, "8", None, True)))
    return InvalidCase("HeadConfig", kwargs, field, None, "heads_not_positive_int")


def _cross_causal() -> st.SearchStrategy[InvalidCase]:
    return st.sampled_from(({}, {"causal": True})).map(
        lambda extra: InvalidCase(
            "AttentionGroup", {"cross_attention": True, **extra}, "causal", None, "cross_causal"
        )
    )


_INVALID_KINDS: Mapping[str, Callable[[], st.SearchStrategy[InvalidCase]]] = {
    "negative_length": lambda: _bad_values("negative_length"),
    "int32_overflow": lambda: _bad_values("int32_overflow"),
    "non_integral_length": lambda: _bad_values("non_integral_length"),
    "string_length": lambda: _bad_values("string_length"),
    "prefix_over_seq": _prefix_over_seq,
    "decode_zero_length": _decode_zero,
    "batch_size_mismatch": _batch_mismatch,
    "bad_page_size": _bad_page_size,
    "cross_without_encoder": _cross_without_encoder,
    "bad_groups": _bad_groups,
    "bad_window": _bad_window,
    "bad_heads": _bad_heads,
    "cross_causal": _cross_causal,
}

#: Kinds of invalid input :func:`invalid_layout_kwargs` can draw.
INVALID_KINDS: tuple[str, ...] = tuple(_INVALID_KINDS)


def invalid_layout_kwargs(*, kinds: Sequence[str] | None = None) -> st.SearchStrategy[InvalidCase]:
    """Draw invalid constructor input and the error it must raise.

    Each draw is an :class:`InvalidCase`, which unpacks as
    ``(constructor name, kwargs, expected error field)`` and also carries ``request``
    (the first offending request's index, or ``None``) and ``kind``. Build it with
    :func:`construct` (or ``case.build()``); it must raise a
    :class:`~flashplan.FlashplanError` whose ``field`` and ``request`` match.
    Every draw breaks exactly one rule:

    * negative lengths (``seq_lens``, ``prefix_lens``, ``encoder_lens``, ``extend_lens``),
    * lengths beyond int32 (up to 2**62),
    * non-integral floats (2.5, NaN, ±inf) among ints or integral floats,
    * strings among the lengths,
    * ``prefix_lens > seq_lens`` (the first offender is expected),
    * batch-size mismatches between per-request fields,
    * ``page_size <= 0`` or not an int (2.0, "16", ``None``, ``True``),
    * a decode request with ``seq_len = 0``,
    * ``encoder_lens`` of the wrong size, a cross group without ``encoder_lens``,
    * no group, or a repeated group,
    * ``window_left < -1`` or not an int, a window on a non-causal (or cross) group,
    * a causal cross group,
    * head counts that do not divide, non-positive head sizes.

    Args:
        kinds: restrict to some of :data:`INVALID_KINDS`.
    """
    chosen = INVALID_KINDS if kinds is None else tuple(kinds)
    unknown = set(chosen) - set(_INVALID_KINDS)
    if unknown:
        raise ValueError(f"unknown invalid kinds {sorted(unknown)}; known: {INVALID_KINDS}")
    return st.one_of(*(_INVALID_KINDS[k]() for k in chosen))
