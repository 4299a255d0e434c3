"""Hypothesis strategies that draw *valid* inputs a layout is planned and run with:
heads (:func:`head_configs`: MHA, GQA, MQA; head sizes and dtypes), page tables
(:func:`page_tables`: every request its own pages, ids shuffled, spare pages, extra rows
and columns) and paged KV caches sized for them (:func:`kv_caches`). The layouts
themselves: :mod:`flashplan.testing.valid`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st

from flashplan.layout import HeadConfig, PageTable

__all__ = ["DTYPES", "HEAD_DIMS", "head_configs", "kv_caches", "page_tables"]

#: Head sizes drawn by default.
HEAD_DIMS: tuple[int, ...] = (64, 128, 256)
#: Floating dtypes drawn by default.
DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32)


# --------------------------------------------------------------------------- heads
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
    spare = draw(st.integers(0, max_spare_pages))
    extra_cols = draw(st.integers(0, max_extra_columns))
    extra_rows = draw(st.integers(0, max_extra_rows))
    if not shuffle:
        table = PageTable.sequential(need, device=device)
        return table, max(int(need.sum()), 1)
    seed = draw(st.integers(0, 2**32 - 1))
    table = PageTable.shuffled(
        need,
        seed=seed,
        spare_pages=spare,
        extra_rows=extra_rows,
        extra_columns=extra_cols,
        device=device,
    )
    assert table.num_pages is not None
    return table, table.num_pages


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
