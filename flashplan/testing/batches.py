"""Fixed example batches that benchmarks and tests share (no Hypothesis needed).

:func:`scoring_batch` is the multi-item scoring batch of the ``multi_item`` benchmark
(``benchmarks/run_gpu.py``; a prompt followed by items, each after a delimiter, and a
closing delimiter), and :func:`bushy_tree_parents` the draft trees of its ``verify`` and
``draft`` parts, each drawn from a numpy generator so that every
user of one seed gets the same batch. :func:`large_logit_fp8_batches` are the two fp8
batches of issue 50 whose keys reach the formats' range (logits in the hundreds), where
an fp8 tensor scale's rounding shows (``docs/semantics.md``, FP8 KV cache).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from flashplan.layout import AttentionGroup, BatchLayout
from flashplan.layout.heads import HeadConfig
from flashplan.layout.page_table import PageTable
from flashplan.planning.spec import PlanSpec

__all__ = [
    "Fp8Batch",
    "ScoringBatch",
    "bushy_tree_parents",
    "large_logit_fp8_batches",
    "large_logit_inputs",
    "scoring_batch",
]


class ScoringBatch(NamedTuple):
    """A multi-item scoring batch, request by request (plain lists: the ragged input an
    engine hands over).

    Attributes:
        extend_lens: new tokens of each request (prompt, delimiters and items).
        delimiters: each request's delimiter positions among its new tokens: one before
            every item and one at the end (``BatchLayout.extend(..., item_delimiters=)``).
        item_lengths: each request's item lengths (tokens, delimiters excluded).
    """

    extend_lens: list[int]
    delimiters: list[list[int]]
    item_lengths: list[list[int]]


def scoring_batch(
    rng: np.random.Generator,
    batch_size: int,
    *,
    prompt: int = 512,
    items: int = 32,
    max_item_len: int = 8,
) -> ScoringBatch:
    """``batch_size`` requests of a ``prompt``-token prompt and ``items`` items of
    ``U[1, max_item_len]`` tokens, drawn from ``rng`` (one ``rng.integers`` call per
    request).

    >>> b = scoring_batch(np.random.default_rng(0), 1, prompt=3, items=2, max_item_len=2)
    >>> b.item_lengths, b.delimiters, b.extend_lens
    ([[2, 2]], [[3, 6, 9]], [10])
    """
    ext, delims, lengths = [], [], []
    for _ in range(batch_size):
        lens = rng.integers(1, max_item_len + 1, items).tolist()
        row, at = [], prompt
        for n in lens:
            row.append(at)
            at += 1 + n
        row.append(at)  # the closing delimiter
        ext.append(at + 1)
        delims.append(row)
        lengths.append(lens)
    return ScoringBatch(ext, delims, lengths)


def bushy_tree_parents(
    rng: np.random.Generator, batch_size: int, num_tokens: int, *, reach: int = 8
) -> np.ndarray:
    """int64 ``[batch_size, num_tokens]`` parent indices of random draft trees (for
    ``DraftTree.from_parents``): token 0 is the root (-1) and token ``j`` hangs under one
    of the ``reach`` tokens before it, drawn from ``rng`` (one ``rng.integers`` call per
    token, for the whole batch): EAGLE-like trees, bushy near their end.

    >>> bushy_tree_parents(np.random.default_rng(0), 2, 4).tolist()
    [[-1, 0, 1, 1], [-1, 0, 1, 0]]
    """
    parents = np.full((batch_size, num_tokens), -1, dtype=np.int64)
    for j in range(1, num_tokens):
        parents[:, j] = rng.integers(max(0, j - reach), j, batch_size)
    return parents


class Fp8Batch(NamedTuple):
    """An fp8 batch with its scales and the size of its new K/V.

    Attributes:
        name: what it is.
        layout, heads: the batch and its heads (bf16 queries over an fp8 cache).
        k_scale, v_scale: the cache's per-tensor scales.
        new_kv_std: standard deviation of the new K/V a test draws (values beyond
            ``fp8_max * scale`` saturate the format).
    """

    name: str
    layout: BatchLayout
    heads: HeadConfig
    k_scale: float
    v_scale: float
    new_kv_std: float


def large_logit_fp8_batches() -> list[Fp8Batch]:
    """Issue 50's two fp8 batches (item 2): a decode over an e5m2 cache (windowed sink,
    bidirectional and band groups with their own scales) and an extend over an e4m3 cache
    whose new K/V saturate the format (two sliding windows and a soft-capped band with
    sinks)."""
    g = AttentionGroup
    bf16 = torch.bfloat16
    decode = BatchLayout.decode(
        [26, 257, 264, 210, 38], page_size=8,
        groups=[g.sliding(2, sinks=True, sm_scale=0.11), g.bidirectional(),
                g.bidirectional(window_left=7, window_right=9, sm_scale=0.3)],
    )  # fmt: skip
    extend = BatchLayout.extend(
        [137, 177, 93], [0, 82, 0], page_size=16,
        groups=[g.sliding(7), g.sliding(16),
                g.bidirectional(window_left=7, window_right=5, sinks=True, logits_soft_cap=5.0,
                                sm_scale=0.11)],
    )  # fmt: skip
    return [
        Fp8Batch(
            "decode, e5m2", decode, HeadConfig(2, 2, 128, q_dtype=bf16, kv_dtype=torch.float8_e5m2),
            2.4118, 3.4396, 1.0,
        ),
        Fp8Batch(
            "extend, e4m3, saturated new K/V", extend,
            HeadConfig(16, 4, 128, q_dtype=bf16, kv_dtype=torch.float8_e4m3fn), 2.4186, 2.3357,
            2000.0,
        ),
    ]  # fmt: skip


def large_logit_inputs(
    case: Fp8Batch, spec: PlanSpec, table: PageTable, *, seed: int, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs of one :func:`large_logit_fp8_batches` batch planned as ``spec`` over
    ``table``: ``(cache, q, k_new, v_new, sink_logits)`` — a cache of random finite fp8
    values over the format's whole range ``[table.num_pages, 2, page_size, kv_heads,
    head_dim]``, queries ``[total_q, qo_heads, head_dim]`` and new K/V ``[total_q,
    kv_heads, head_dim]`` in the queries' dtype (the new K/V of standard deviation
    ``case.new_kv_std``), float32 sink logits ``[qo_heads]``; drawn from ``seed``."""
    heads, ps = case.heads, case.layout.page_size
    assert table.num_pages is not None
    gen = torch.Generator().manual_seed(seed)
    shape = (table.num_pages, 2, ps, heads.num_kv_heads, heads.head_dim)
    raw = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).view(heads.kv_dtype)
    values = raw.float()
    cache = torch.where(torch.isfinite(values), values, 0.0).to(heads.kv_dtype)
    q = torch.randn(spec.total_q, heads.num_qo_heads, heads.head_dim, generator=gen)
    rows = (spec.total_q, heads.num_kv_heads, heads.head_dim)
    k_new = torch.randn(rows, generator=gen) * case.new_kv_std
    v_new = torch.randn(rows, generator=gen) * case.new_kv_std
    sinks = torch.randn(heads.num_qo_heads, generator=gen) * 3
    half = heads.q_dtype
    return (
        cache.to(device), q.to(half).to(device), k_new.to(half).to(device),
        v_new.to(half).to(device), sinks.to(device),
    )  # fmt: skip
