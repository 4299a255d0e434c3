"""Fixed example batches that benchmarks and tests share (no Hypothesis needed).

:func:`scoring_batch` is the multi-item scoring batch of ``benchmarks/bench_multi_item.py``
(a prompt followed by items, each after a delimiter, and a closing delimiter), and
:func:`bushy_tree_parents` the draft trees of the verify benchmark
(``benchmarks/bench_speculative.py``), each drawn from a numpy generator so that every
user of one seed gets the same batch.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["ScoringBatch", "bushy_tree_parents", "scoring_batch"]


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
