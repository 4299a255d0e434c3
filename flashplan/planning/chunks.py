"""Planning chunked local attention and bidirectional windows (pure, host, vectorized).

**Chunked local attention** (``AttentionGroup.attention_chunk_size`` C): the query at
position ``p`` sees keys ``C * (p // C) <= k <= p``.

* When C is a multiple of the page size, every chunk starts on a page boundary, and a
  request's new tokens are split at chunk boundaries into *virtual requests*
  (:class:`~flashplan.planning.parts.VirtualRequests`): virtual request ``(i, c)``
  holds request ``i``'s new tokens in chunk ``c`` and reads the keys from the chunk's
  first token on, with the plain causal kernel (no mask, no window). A virtual
  request's pages are a run of its request's pages, so the page ids are gathered per
  request as for any other group and the virtual spans split them finer. A batch whose
  every request stays inside one chunk (every decode step) needs no split: the plan is
  a page-aligned trim.
* Otherwise (a chunk start inside a page) the group runs one paged prefill whose
  :class:`~flashplan.planning.masks.PositionMask` states the chunk rule, decode steps
  included.

**Bidirectional windows** (non-causal, ``window_left`` and ``window_right``): the query
at ``p`` sees ``p - window_left <= k <= p + window_right`` within its request. One
paged prefill over ``[max(P - window_left, 0), L)`` with a
:class:`~flashplan.planning.masks.PositionMask` (four integers per request, expanded
where it is used). A decode step's query is the request's last token: it sees
``[L - 1 - window_left, L)``, a causal sliding window.
"""

from __future__ import annotations

import numpy as np

from flashplan.arrays import IntArray, constant_operand, seal_inplace
from flashplan.layout.batch import BatchLayout
from flashplan.layout.group import AttentionGroup
from flashplan.lengths import Lengths, PageSpans
from flashplan.planning.masks import PositionMask
from flashplan.planning.parts import KernelPath, PagedPart, RaggedPart, VirtualRequests

__all__ = ["chunk_split", "needs_position_mask", "plan_chunked", "plan_position_masked"]


def needs_position_mask(group: AttentionGroup, page_size: int) -> bool:
    """Whether ``group`` runs on one paged prefill with a
    :class:`~flashplan.planning.masks.PositionMask` in extend batches (a bidirectional
    window, or a chunk that does not start on a page boundary); decode steps of a
    chunked group need it too when the chunk is not a multiple of the page size."""
    return group.has_band or (group.has_chunks and group.attention_chunk_size % page_size != 0)


def chunk_split(
    prefix: IntArray, seq: IntArray, chunk: int
) -> tuple[IntArray, IntArray, IntArray, IntArray]:
    """The virtual requests of a chunked extend: ``(request, chunk_first, q_first,
    q_end)``, read-only int32 ``[n]`` (a request index, then positions).

    Request ``i`` with new tokens at positions ``[P, L)`` has one virtual request per
    chunk those touch (``P // C`` to ``(L - 1) // C``), and one without queries when it
    has no new token; virtual request ``(i, c)`` holds the new tokens at
    ``[max(c * C, P), min((c + 1) * C, L))`` and its chunk starts at ``c * C``.
    Positions fit int32 (the layout checks its lengths), so the arithmetic stays int32.
    """
    c = constant_operand(chunk)
    first_chunk = prefix // c
    counts = np.maximum((seq - 1) // c - first_chunk + 1, 1)
    request = np.repeat(np.arange(prefix.shape[0], dtype=np.int32), counts)
    starts = np.cumsum(counts, dtype=np.int32) - counts
    k = np.arange(request.shape[0], dtype=np.int32) - np.repeat(starts, counts)
    chunk_first = (first_chunk[request] + k) * c
    q_first = np.maximum(chunk_first, prefix[request])
    q_end = np.maximum(np.minimum(chunk_first + c, seq[request]), q_first)
    return (
        seal_inplace(request), seal_inplace(chunk_first), seal_inplace(q_first),
        seal_inplace(q_end),
    )  # fmt: skip


def plan_chunked(
    layout: BatchLayout, group: AttentionGroup, ragged_path: bool, queries: Lengths
) -> tuple[KernelPath, PagedPart | None, RaggedPart | None, VirtualRequests | None]:
    """A chunked group of an extend batch whose chunk is a multiple of the page size:
    ``(path, paged, ragged, virtual)``.

    Paged path: virtual request ``(i, c)`` reads row tokens ``[c * C, q_end)`` of its
    decoder (new tokens written first), causal. Ragged path: the ragged call's keys are
    each virtual request's own new tokens (causal), and where a request has a cached
    prefix its first virtual request also reads the prefix's part of its chunk,
    ``[c * C, P)``, from the cache (non-causal: every query of the chunk sees all of
    it), merged through the LSE.

    A batch whose every request's new tokens lie in one chunk (the common case: a
    chunk of 8192 and prefill chunks that do not cross it) needs no split: the group is
    a page-aligned trim of the unchunked plan, computed without :func:`chunk_split`.
    ``queries`` are the plan's.
    """
    ps = layout.page_size
    chunk = group.attention_chunk_size
    prefix32, seq32 = layout.prefix_lens, layout.seq_lens
    c = constant_operand(chunk)
    chunk_start32 = prefix32 // c * c  # the chunk of each request's first new token
    # the last new token (position L - 1) lies in a later chunk iff L - start > C (a
    # request without new tokens has L = P < start + C)
    crosses = (seq32 - chunk_start32) > c
    if not crosses.size or not np.logical_or.reduce(crosses):
        return _plan_unsplit(layout, chunk_start32, ragged_path, queries)
    # some request crosses a chunk boundary: one virtual request per request and chunk
    # (int32 throughout: row tokens fit int32, checked when the layout was built)
    encoder = layout.encoder_lens is not None
    base = layout.decoder_start
    request, chunk_first, q_first, q_end = chunk_split(prefix32, seq32, chunk)
    q_lens = seal_inplace(q_end - q_first)
    virtual = VirtualRequests(request, Lengths.from_lens(q_lens, "extend_lens"))
    new = layout.extend_lens > 0
    req_first = base + chunk_start32 if encoder else chunk_start32
    b = base[request] if encoder else None
    first = b + chunk_first if b is not None else chunk_first
    seq = base + seq32 if encoder else seq32
    prefix = base + prefix32 if encoder else prefix32
    if not ragged_path:
        spans = PageSpans.between(req_first, np.where(new, seq, req_first), ps)
        v_end = b + q_end if b is not None else q_end
        virtual_spans = PageSpans.between(first, np.where(q_lens > 0, v_end, first), ps)
        paged = PagedPart.over(spans, causal=True, window_left=-1, virtual=virtual_spans)
        return KernelPath.PAGED, paged, None, virtual
    ragged = RaggedPart.over(virtual.queries, causal=True, window_left=-1)
    if not np.logical_or.reduce(prefix32 > chunk_start32):
        return KernelPath.RAGGED, None, ragged, virtual  # no cached key inside any chunk
    # the cached part of each request's first chunk: [c * C, P), for its first virtual one
    spans = PageSpans.between(req_first, np.where(new, prefix, req_first), ps)
    lead = np.r_[True, request[1:] != request[:-1]] & (q_lens > 0)
    virtual_spans = PageSpans.between(first, np.where(lead, prefix[request], first), ps)
    paged = PagedPart.over(spans, causal=False, window_left=-1, virtual=virtual_spans)
    return KernelPath.RAGGED_PAGED, paged, ragged, virtual


def _plan_unsplit(
    layout: BatchLayout, chunk_start: IntArray, ragged_path: bool, queries: Lengths
) -> tuple[KernelPath, PagedPart | None, RaggedPart | None, VirtualRequests | None]:
    """:func:`plan_chunked` of a batch that crosses no chunk boundary: each request
    reads its row from ``chunk_start`` (int32 ``[bs]``, decoder positions: the start of
    the chunk its new tokens are in), causal, no window."""
    ps = layout.page_size
    encoder = layout.encoder_lens is not None
    base = layout.decoder_start
    first = base + chunk_start if encoder else chunk_start  # row tokens (fit int32)
    new = layout.extend_lens > 0
    if not ragged_path:
        end = np.where(new, base + layout.seq_lens if encoder else layout.seq_lens, first)
        paged = PagedPart.over(PageSpans.between(first, end, ps), causal=True, window_left=-1)
        return KernelPath.PAGED, paged, None, None
    ragged = RaggedPart.over(queries, causal=True, window_left=-1)
    if not new.size or not np.logical_or.reduce(layout.prefix_lens > chunk_start):
        return KernelPath.RAGGED, None, ragged, None  # no cached key inside any chunk
    end = np.where(new, base + layout.prefix_lens if encoder else layout.prefix_lens, first)
    paged = PagedPart.over(PageSpans.between(first, end, ps), causal=False, window_left=-1)
    return KernelPath.RAGGED_PAGED, paged, ragged, None


def chunk_decode_first(layout: BatchLayout, chunk: int) -> np.ndarray:
    """int64 ``[bs]`` (decoder positions): where the chunk of each decode query (the
    request's last token, ``L - 1``) starts: ``C * ((L - 1) // C)`` (0 for ``L = 0``)."""
    last = np.maximum(layout.seq_lens.astype(np.int64) - 1, 0)
    return last // chunk * chunk


def plan_position_masked(layout: BatchLayout, group: AttentionGroup) -> PagedPart:
    """One paged prefill with a :class:`~flashplan.planning.masks.PositionMask` (a
    bidirectional window, or a chunk inside pages), decode steps included: request
    ``i`` reads decoder positions ``[first, L)`` with ``first`` the first key any of its
    queries sees (``max(P - window_left, 0)``, or the start of the first query's
    chunk), from the page that holds it; the mask hides the rest."""
    ps = layout.page_size
    base = layout.decoder_start.astype(np.int64)
    prefix = layout.prefix_lens.astype(np.int64)
    seq = layout.seq_lens.astype(np.int64)
    if group.has_chunks:
        first_key = prefix // group.attention_chunk_size * group.attention_chunk_size
    elif group.window_left >= 0:
        first_key = np.maximum(prefix - group.window_left, 0)
    else:
        first_key = np.zeros_like(prefix)
    first_key = np.where(layout.extend_lens > 0, first_key, seq)  # no query: no key
    spans = PageSpans.between(base + first_key, base + seq, ps)
    col = spans.start_page.astype(np.int64) * ps - base  # decoder position of column 0
    mask = PositionMask(
        layout.extend_lens, spans.kv_lens, seal_inplace(prefix, np.int64),
        seal_inplace(col, np.int64), group.causal, group.window_left, group.window_right,
        group.attention_chunk_size,
    )  # fmt: skip
    return PagedPart.over(spans, causal=False, window_left=-1, position_mask=mask)
