"""Page arithmetic for KV segments, vectorized over the batch (host numpy)."""

from __future__ import annotations

import attrs
import numpy as np

from flashplan.layout.arrays import IntArray, cumsum0, sealed

__all__ = ["PagedSegments", "paged_segments"]


@attrs.frozen(eq=False)
class PagedSegments:
    """Per-request page spans covering token ranges ``[first, end)`` of a table row.

    Attributes:
        start_page: int32 ``[bs]`` (pages): ``first // page_size`` (0 when empty).
        num_pages: int32 ``[bs]`` (pages): ``ceil(kv_lens / page_size)``.
        last_page_len: int32 ``[bs]`` (tokens): in ``[1, page_size]``; 0 when empty,
            so that FlashInfer's ``(pages - 1) * page_size + last`` counts no phantom key.
        kv_lens: int32 ``[bs]`` (tokens): ``end - start_page * page_size`` (0 when empty).
        page_indptr: int32 ``[bs + 1]`` (pages).
    """

    start_page: IntArray
    num_pages: IntArray
    last_page_len: IntArray
    kv_lens: IntArray
    page_indptr: IntArray


def paged_segments(first: IntArray, end: IntArray, page_size: int) -> PagedSegments:
    """Cover logical tokens ``[first[i], end[i])`` of each row with whole pages.

    A segment that starts mid-page begins at the page holding ``first[i]``; the
    extra leading keys are left to the kernel's window or mask. Empty segments
    (``end <= first``) get zero pages and ``last_page_len = 0``.

    Args:
        first: int ``[bs]`` (tokens) first logical token needed.
        end: int ``[bs]`` (tokens) one past the last logical token needed.
        page_size: tokens per page (>= 1).
    """
    first64 = first.astype(np.int64)
    end64 = end.astype(np.int64)
    nonempty = end64 > first64
    start_page = np.where(nonempty, first64 // page_size, 0)
    kv_lens = np.where(nonempty, end64 - start_page * page_size, 0)
    num_pages = (kv_lens + page_size - 1) // page_size
    last = np.where(nonempty, kv_lens - (num_pages - 1) * page_size, 0)
    return PagedSegments(
        start_page=sealed(start_page),
        num_pages=sealed(num_pages),
        last_page_len=sealed(last),
        kv_lens=sealed(kv_lens),
        page_indptr=cumsum0(num_pages),
    )
