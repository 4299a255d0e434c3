"""Fixed example batches that benchmarks and tests share (no Hypothesis needed).

:func:`scoring_batch` is the multi-item scoring batch of ``benchmarks/bench_multi_item.py``
(a prompt followed by items, each after a delimiter, and a closing delimiter), drawn from
a numpy generator so that every user of one seed gets the same batch.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["ScoringBatch", "scoring_batch"]


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
