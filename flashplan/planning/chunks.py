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

from flashplan.arrays import IntArray, seal_inplace
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
) -> tuple[IntArray, np.ndarray, np.ndarray, np.ndarray]:
    """The virtual requests of a chunked extend: ``(request int32 [n], chunk_first,
    q_first, q_end)`` (the last three int64 ``[n]``, positions).

    Request ``i`` with new tokens at positions ``[P, L)`` has one virtual request per
    chunk those touch (``P // C`` to ``(L - 1) // C``), and one without queries when it
    has no new token; virtual request ``(i, c)`` holds the new tokens at
    ``[max(c * C, P), min((c + 1) * C, L))`` and its chunk starts at ``c * C``.
    """
    p = prefix.astype(np.int64)
    L = seq.astype(np.int64)
    first_chunk = p // chunk
    counts = np.maximum((L - 1) // chunk - first_chunk + 1, 1)
    bs = p.shape[0]
    request = np.repeat(np.arange(bs, dtype=np.int32), counts)
    starts = np.cumsum(counts) - counts
    k = np.arange(request.shape[0], dtype=np.int64) - np.repeat(starts, counts)
    c = first_chunk[request] + k
    chunk_first = c * chunk
    q_first = np.maximum(chunk_first, p[request])
    q_end = np.maximum(np.minimum(chunk_first + chunk, L[request]), q_first)
    return seal_inplace(request), chunk_first, q_first, q_end


def plan_chunked(
    layout: BatchLayout, group: AttentionGroup, ragged_path: bool
) -> tuple[KernelPath, PagedPart | None, RaggedPart | None, VirtualRequests | None]:
    """A chunked group of an extend batch whose chunk is a multiple of the page size:
    ``(path, paged, ragged, virtual)``.

    Paged path: virtual request ``(i, c)`` reads row tokens ``[c * C, q_end)`` of its
    decoder (new tokens written first), causal. Ragged path: the ragged call's keys are
    each virtual request's own new tokens (causal), and where a request has a cached
    prefix its first virtual request also reads the prefix's part of its chunk,
    ``[c * C, P)``, from the cache (non-causal: every query of the chunk sees all of
    it), merged through the LSE.
    """
    ps = layout.page_size
    chunk = group.attention_chunk_size
    base = layout.decoder_start.astype(np.int64)
    prefix = layout.prefix_lens.astype(np.int64)
    seq = layout.seq_lens.astype(np.int64)
    request, chunk_first, q_first, q_end = chunk_split(layout.prefix_lens, layout.seq_lens, chunk)
    q_lens = seal_inplace(q_end - q_first)
    split = request.shape[0] != layout.batch_size  # some request crosses a chunk boundary
    queries = Lengths.from_lens(q_lens, "extend_lens") if split else None
    new = layout.extend_lens > 0
    req_first = base + prefix // chunk * chunk  # each request's first chunk's start
    b = base[request]
    if not ragged_path:
        spans = PageSpans.between(req_first, np.where(new, base + seq, req_first), ps)
        virtual_spans = None
        if split:
            first = b + chunk_first
            virtual_spans = PageSpans.between(first, np.where(q_lens > 0, b + q_end, first), ps)
        paged = PagedPart.over(spans, causal=True, window_left=-1, virtual=virtual_spans)
        return KernelPath.PAGED, paged, None, _virtual(request, queries)
    keys = queries if queries is not None else Lengths.from_lens(layout.extend_lens, "extend_lens")
    ragged = RaggedPart.over(keys, causal=True, window_left=-1)
    if not np.any(prefix):
        return KernelPath.RAGGED, None, ragged, _virtual(request, queries)
    # the cached part of each request's first chunk: [c * C, P), for its first virtual one
    spans = PageSpans.between(req_first, np.where(new, base + prefix, req_first), ps)
    virtual_spans = None
    if split:
        lead = np.r_[True, request[1:] != request[:-1]] & (q_lens > 0)
        first = b + chunk_first
        virtual_spans = PageSpans.between(first, np.where(lead, b + prefix[request], first), ps)
    paged = PagedPart.over(spans, causal=False, window_left=-1, virtual=virtual_spans)
    return KernelPath.RAGGED_PAGED, paged, ragged, _virtual(request, queries)


def _virtual(request: IntArray, queries: Lengths | None) -> VirtualRequests | None:
    return None if queries is None else VirtualRequests(request, queries)


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
