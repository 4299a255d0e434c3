"""Hypothesis strategies that draw *valid* batch layouts of every mode, and the records
they are made of: attention groups, decode and extend layouts, multi-item scoring
requests and layouts, draft trees and target-verify layouts. What a layout is planned
and run with (heads, page tables, KV caches): :mod:`flashplan.testing.valid_kv`;
invalid input: :mod:`flashplan.testing.invalid`.

Sizes are small by default (at most 8 requests,
sequence lengths mostly up to 64 tokens and now and then up to 300) so that dense
oracles stay cheap; every bound is a keyword argument.

The edge cases that break attention planners are drawn on purpose: page sizes that do
not divide the lengths (1, 2, 3, 16), windows of 0 keys back, windows shorter and
longer than the sequences, requests with no new token, with one new token, with no
token at all, encoders of length 0, several groups per layout. Multi-item scoring
batches (:func:`multi_item_layouts`) mix requests with and without delimiters and draw
items of length 1, empty items (two adjacent delimiters), a delimiter as the last token,
a delimiter as the first new token, and cached prefixes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from hypothesis import strategies as st

from flashplan.layout import AttentionGroup, BatchLayout
from flashplan.layout.drafts import DraftTree

__all__ = [
    "GROUP_KINDS",
    "LOCAL_GROUP_KINDS",
    "PAGE_SIZES",
    "attention_groups",
    "decode_layouts",
    "draft_trees",
    "extend_layouts",
    "fixed_token_extend_layouts",
    "item_requests",
    "layouts",
    "multi_item_layouts",
    "verify_layouts",
]

#: Page sizes drawn by default: the token table (1), sizes that divide nothing (2, 3),
#: and a production size (16).
PAGE_SIZES: tuple[int, ...] = (1, 2, 3, 16)
#: Kinds of :class:`~flashplan.AttentionGroup` drawn by :func:`attention_groups`.
GROUP_KINDS: tuple[str, ...] = ("full", "sliding", "bidirectional", "cross")
#: The local kinds, drawn only when asked for: ``"chunked"`` (chunked local attention,
#: chunk sizes that divide page sizes, are multiples of them, or neither) and
#: ``"local"`` (a bidirectional window: non-causal with both bounds).
LOCAL_GROUP_KINDS: tuple[str, ...] = ("chunked", "local")
_CHUNKS = (1, 2, 3, 4, 5, 7, 8, 16, 32, 48)

_SOFT_CAPS = (1.0, 20.0, 30.0, 50.0)
_LONG_WINDOWS = (127, 1023, 4095, 1 << 20)


# --------------------------------------------------------------------------- groups
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
    sinks: bool = False,
) -> AttentionGroup:
    """Draw an :class:`~flashplan.AttentionGroup`.

    Args:
        kinds: subset of :data:`GROUP_KINDS` to draw from: ``"full"`` (causal, no
            window), ``"sliding"`` (causal with ``window_left >= 0``: 0 and other small
            windows, windows around typical lengths, and windows far longer than any
            drawn sequence), ``"bidirectional"`` (non-causal self-attention),
            ``"cross"`` (attention to the encoder; a layout holding it needs
            ``encoder_lens``), and the :data:`LOCAL_GROUP_KINDS` (``"chunked"``,
            ``"local"``) when listed.
        windows: strategy for ``window_left`` of sliding groups (default: the mix above).
        max_window: clamp drawn windows to this value.
        soft_cap: whether a logits soft cap may be drawn (otherwise always 0 = off).
        sm_scale: whether an explicit softmax scale may be drawn (otherwise ``None``).
        sinks: whether attention sinks may be drawn (on any kind; otherwise off).
    """
    kind = draw(st.sampled_from(tuple(kinds)))
    with_sinks = draw(st.booleans()) if sinks else False
    cap = draw(st.sampled_from((0.0, 0.0, *_SOFT_CAPS))) if soft_cap else 0.0
    scale = draw(st.sampled_from((None, None, None, 0.125, 0.5))) if sm_scale else None
    kw: dict[str, Any] = dict(logits_soft_cap=cap, sm_scale=scale, sinks=with_sinks)
    if kind == "full":
        return AttentionGroup.full(**kw)
    if kind == "sliding":
        window = draw(windows if windows is not None else _windows(max_window))
        return AttentionGroup.sliding(window, **kw)
    if kind == "bidirectional":
        return AttentionGroup.bidirectional(**kw)
    if kind == "cross":
        return AttentionGroup.cross(**kw)
    if kind == "chunked":
        return AttentionGroup.chunked(draw(st.sampled_from(_CHUNKS)), **kw)
    if kind == "local":
        left = draw(windows if windows is not None else _windows(max_window))
        right = draw(windows if windows is not None else _windows(max_window))
        return AttentionGroup.bidirectional(window_left=left, window_right=right, **kw)
    raise ValueError(
        f"unknown group kind {kind!r}; expected one of {GROUP_KINDS + LOCAL_GROUP_KINDS}"
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
    return tuple(draw(_distinct_groups(kinds, max_groups))), has_encoder


def _distinct_groups(
    kinds: Sequence[str], max_groups: int
) -> st.SearchStrategy[list[AttentionGroup]]:
    """1 to ``max_groups`` distinct groups of ``kinds``."""
    return st.lists(attention_groups(kinds=kinds), min_size=1, max_size=max_groups, unique=True)


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


@st.composite
def fixed_token_extend_layouts(
    draw: st.DrawFn,
    *,
    min_batch: int = 1,
    max_batch: int = 4,
    max_tokens: int = 4,
    max_prefix: int = 30,
    page_size: int | None = None,
    page_sizes: Sequence[int] = PAGE_SIZES,
    kinds: Sequence[str] = ("full", "sliding"),
    max_groups: int = 2,
) -> BatchLayout:
    """Draw an extend :class:`~flashplan.BatchLayout` whose every request adds the same
    number of new tokens (1 to ``max_tokens``) after a cached prefix of 0 to
    ``max_prefix`` tokens: the batches a fixed-token extend bucket replays (CUDA graphs
    of a draft extend or a verify chain).

    Args:
        min_batch, max_batch: bounds on the number of requests (at least 1).
        page_size: fix the page size; otherwise drawn from ``page_sizes``.
        kinds: the group kinds drawn (1 to ``max_groups`` distinct groups; no cross
            group: a bucket writes no encoder K/V).
    """
    ps = _page_size(draw, page_size, page_sizes)
    groups = draw(_distinct_groups(kinds, max_groups))
    tokens = draw(st.integers(1, max_tokens))
    bs = draw(st.integers(max(min_batch, 1), max(max_batch, 1)))
    prefix = draw(st.lists(st.integers(0, max_prefix), min_size=bs, max_size=bs))
    return BatchLayout.from_extend_lens([tokens] * bs, prefix, page_size=ps, groups=groups)


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


# --------------------------------------------------------------------------- multi-item
@st.composite
def item_requests(
    draw: st.DrawFn,
    *,
    with_prefix: bool = True,
    max_prefix: int = 24,
    max_prompt: int = 12,
    max_items: int = 5,
    max_item_len: int = 6,
) -> tuple[int, int, list[int]]:
    """Draw one multi-item scoring request: ``(seq_len, prefix_len, delimiters)``.

    The new tokens are a prompt (0 tokens: the first new token is a delimiter), then
    for each item a delimiter and the item's tokens (0 tokens: two adjacent
    delimiters; 1 token: the usual single-token candidate), and, one draw in two, a
    closing delimiter (the last token is a delimiter, as in the reference file's
    examples). At least one delimiter; ``prefix_len`` cached tokens come before
    (``with_prefix``).
    """
    prefix = draw(st.integers(0, max_prefix)) if with_prefix else 0
    prompt = draw(st.integers(0, max_prompt))
    lengths = draw(
        st.lists(
            st.one_of(st.just(1), st.integers(0, max_item_len)), min_size=1, max_size=max_items
        )
    )
    delimiters = []
    at = prompt
    for n in lengths:
        delimiters.append(at)
        at += 1 + n
    if draw(st.booleans()):
        delimiters.append(at)  # closing delimiter: the last token
        at += 1
    return prefix + at, prefix, delimiters


@st.composite
def multi_item_layouts(
    draw: st.DrawFn,
    *,
    min_batch: int = 0,
    max_batch: int = 6,
    plain: bool = True,
    prefix: bool | None = None,
    page_size: int | None = None,
    page_sizes: Sequence[int] = PAGE_SIZES,
    groups: Iterable[AttentionGroup] | None = None,
    encoder: bool | None = None,
    max_prompt: int = 12,
    max_items: int = 5,
    max_item_len: int = 6,
    max_len: int = 40,
) -> BatchLayout:
    """Draw a multi-item scoring :class:`~flashplan.BatchLayout` (an extend with
    ``item_delimiters``).

    Each request is drawn by :func:`item_requests`, or, one in four when ``plain``, is
    a plain request without delimiters (any extend request, empty ones included), so
    batches mix the two in any order.

    Args:
        min_batch, max_batch: bounds on the number of requests (0 = empty batch).
        plain: allow requests without delimiters.
        prefix: ``False``: no cached prefix; ``True``: prefixes drawn; ``None``: either.
        page_size: fix the page size; otherwise drawn from ``page_sizes``.
        groups: fix the groups (causal full-attention or cross groups: multi-item
            batches refuse the others); otherwise one or two causal full-attention
            groups (soft caps and scales drawn), and a cross group one draw in three
            when the layout has an encoder.
        encoder: force ``encoder_lens`` on/off; ``None`` draws it (on for cross groups).
        max_prompt, max_items, max_item_len: bounds of :func:`item_requests`.
        max_len: bound on the plain requests' lengths.
    """
    ps = _page_size(draw, page_size, page_sizes)
    with_prefix = draw(st.booleans()) if prefix is None else prefix
    if groups is not None:
        gs = tuple(groups)
        has_encoder = any(g.cross_attention for g in gs) or (
            draw(st.booleans()) if encoder is None else encoder
        )
    else:
        has_encoder = draw(st.booleans()) if encoder is None else encoder
        gs = tuple(draw(_distinct_groups(("full",), 2)))
        if has_encoder and draw(st.integers(0, 2)) == 0:
            gs = (*gs, AttentionGroup.cross())
    bs = draw(st.integers(min_batch, max_batch))
    seq: list[int] = []
    pre: list[int] = []
    delims: list[list[int] | None] = []
    for _ in range(bs):
        if plain and draw(st.integers(0, 3)) == 0:
            s, p = draw(_extend_request(with_prefix, max_len, max_len))
            seq.append(s)
            pre.append(p)
            delims.append(None)
            continue
        s, p, d = draw(
            item_requests(
                with_prefix=with_prefix,
                max_prompt=max_prompt,
                max_items=max_items,
                max_item_len=max_item_len,
            )
        )
        seq.append(s)
        pre.append(p)
        delims.append(d)
    enc = (
        draw(st.lists(_length(0, max_len, max_len), min_size=bs, max_size=bs))
        if has_encoder
        else None
    )
    return BatchLayout.extend(
        seq, pre, page_size=ps, groups=gs, encoder_lens=enc, item_delimiters=delims
    )


# --------------------------------------------------------------------------- speculative
@st.composite
def draft_trees(
    draw: st.DrawFn,
    batch_size: int,
    *,
    max_tokens: int = 9,
    num_tokens: int | None = None,
) -> DraftTree:
    """Draw a :class:`~flashplan.layout.drafts.DraftTree` for ``batch_size`` requests: a
    random tree per request (each parent drawn among the earlier tokens), a chain, or
    EAGLE's shape (``topk`` branches of ``steps`` tokens under the root).

    Args:
        batch_size: requests.
        max_tokens: most draft tokens per request (``N``), when ``num_tokens`` is not set.
        num_tokens: fix ``N`` (EAGLE shapes are drawn only when it fits).
    """
    kind = draw(st.sampled_from(("random", "random", "chain", "eagle")))
    if kind == "eagle":
        topk = draw(st.integers(1, 3))
        steps = draw(st.integers(1, 3))
        if num_tokens is None or 1 + topk * steps == num_tokens:
            return DraftTree.eagle(batch_size, topk, steps)
    n = num_tokens if num_tokens is not None else draw(st.integers(1, max_tokens))
    if kind == "chain":
        return DraftTree.chain(batch_size, n)
    rows = []
    for _ in range(batch_size):
        rows.append([-1] + [draw(st.integers(0, j - 1)) for j in range(1, n)])
    return DraftTree.from_parents(np.array(rows, dtype=np.int32).reshape(batch_size, n))


@st.composite
def verify_layouts(
    draw: st.DrawFn,
    *,
    min_batch: int = 0,
    max_batch: int = 6,
    max_len: int = 64,
    long_len: int = 200,
    max_tokens: int = 9,
    page_size: int | None = None,
    page_sizes: Sequence[int] = PAGE_SIZES,
    groups: Iterable[AttentionGroup] | None = None,
    encoder: bool | None = None,
    max_groups: int = 3,
) -> BatchLayout:
    """Draw a target-verify :class:`~flashplan.BatchLayout` (``BatchLayout.verify``):
    prefixes (0 included) and a draft tree per request; groups are causal self groups
    (any window) and, with an encoder, cross groups."""
    ps = _page_size(draw, page_size, page_sizes)
    if groups is None:
        has_encoder = draw(st.booleans()) if encoder is None else encoder
        kinds = ("full", "sliding", "cross") if has_encoder else ("full", "sliding")
        gs = tuple(
            draw(
                st.lists(
                    attention_groups(kinds=kinds), min_size=1, max_size=max_groups, unique=True
                )
            )
        )
    else:
        gs = tuple(groups)
        has_encoder = any(g.cross_attention for g in gs) or bool(encoder)
    bs = draw(st.integers(min_batch, max_batch))
    prefix = draw(st.lists(_length(0, max_len, long_len), min_size=bs, max_size=bs))
    tree = draw(draft_trees(bs, max_tokens=max_tokens))
    enc = (
        draw(st.lists(_length(0, max_len, long_len), min_size=bs, max_size=bs))
        if has_encoder
        else None
    )
    return BatchLayout.verify(prefix, tree, page_size=ps, groups=gs, encoder_lens=enc)
