"""The speculative round's KV moves (``flashplan.draft_kv``) against the guide's
per-request loops, on random tables, trees, paths and page sizes; every other slot
untouched; bad paths refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashplan as fp

POOL = 64


def _table(rng: np.random.Generator, bs: int, width: int) -> fp.PageTable:
    """Rows of distinct page ids (1 and up, in a pool of at least POOL pages with spare
    ones) in shuffled rows; one row more than requests."""
    pool = max(POOL, 2 * (bs + 1) * width + 1)
    ids = rng.permutation(np.arange(1, pool))[: (bs + 1) * width].reshape(bs + 1, width)
    rows = rng.permutation(bs + 1)[:bs].astype(np.int32)
    return fp.PageTable(torch.from_numpy(ids.astype(np.int32)), rows, pool)


def _caches(rng: np.random.Generator, ps: int, pool: int, n: int = 2) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    return [torch.randn(pool, 2, ps, 2, 4, generator=gen) for _ in range(n)]


def _random_path(rng: np.random.Generator, parents: np.ndarray) -> list[int]:
    """The root, then a random walk down the tree, stopping at random."""
    path = [0]
    while rng.random() < 0.7:
        children = np.flatnonzero(parents == path[-1])
        if not children.size:
            break
        path.append(int(rng.choice(children)))
    return path


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), ps=st.sampled_from([1, 2, 3, 16]),
       bs=st.integers(1, 4), shape=st.sampled_from(["eagle", "chain", "random"]))  # fmt: skip
def test_compact_accepted_equals_the_guides_loop(seed: int, ps: int, bs: int, shape: str) -> None:
    rng = np.random.default_rng(seed)
    if shape == "eagle":
        tree = fp.DraftTree.eagle(bs, 2, 3)
    elif shape == "chain":
        tree = fp.DraftTree.chain(bs, 5)
    else:
        n = int(rng.integers(1, 9))
        tree = fp.DraftTree.from_parents(
            [[-1] + [int(rng.integers(0, j)) for j in range(1, n)] for _ in range(bs)]
        )
    width = (40 + tree.num_tokens) // ps + 2
    table = _table(rng, bs, width)
    prefix = rng.integers(0, 40, bs)
    paths = [_random_path(rng, tree.parents[i]) for i in range(bs)]
    caches = _caches(rng, ps, table.num_pages)
    want = [c.clone() for c in caches]
    for c in want:  # the guide's loop: read every source, then write
        for i, path in enumerate(paths):
            row = int(table.rows[i])

            def slot(token: int, row: int = row) -> tuple[int, int]:
                return int(table.pages[row, token // ps]), token % ps

            src = [slot(int(prefix[i]) + t) for t in path]
            dst = [slot(int(prefix[i]) + j) for j in range(len(path))]
            kv = torch.stack([c[p, :, o] for p, o in src])
            for (p, o), x in zip(dst, kv, strict=True):
                c[p, :, o] = x
    ends = fp.compact_accepted(caches, table, prefix, tree, paths, page_size=ps)
    assert ends.tolist() == [int(p) + len(a) for p, a in zip(prefix, paths, strict=True)]
    for got, exp in zip(caches, want, strict=True):
        assert torch.equal(got, exp)


def test_a_chains_accepted_path_moves_nothing() -> None:
    rng = np.random.default_rng(0)
    tree = fp.DraftTree.chain(3, 4)
    table = _table(rng, 3, 8)
    caches = _caches(rng, 4, table.num_pages)
    before = [c.clone() for c in caches]
    fp.compact_accepted(caches, table, [3, 9, 0], tree, [[0, 1, 2], [0], [0, 1, 2, 3]],
                        page_size=4)  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(caches, before, strict=True))


@pytest.mark.parametrize(
    ("paths", "match"),
    [
        ([[1, 2]], "starts at the root"),
        ([[0, 2, 3]], "child of the one before"),  # 2's parent is 0, 3's is 2: fine; see below
        ([[]], "at least the root"),
        ([[0, 9]], "outside the tree"),
    ],
)
def test_bad_paths_are_refused(paths: list[list[int]], match: str) -> None:
    tree = fp.DraftTree.from_parents([[-1, 0, 0, 1]])  # root, two children, a grandchild of 1
    rng = np.random.default_rng(1)
    table = _table(rng, 1, 4)
    if paths == [[0, 2, 3]]:  # 3 is a child of 1, not of 2
        with pytest.raises(fp.LayoutError, match=match) as err:
            fp.compact_accepted(
                _caches(rng, 4, table.num_pages), table, [5], tree, paths, page_size=4
            )
        assert "paths[0]" in str(err.value)
        return
    with pytest.raises(fp.LayoutError, match=match):
        fp.compact_accepted(_caches(rng, 4, table.num_pages), table, [5], tree, paths, page_size=4)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), ps=st.sampled_from([1, 2, 16]), bs=st.integers(1, 4),
       topk=st.integers(1, 3))  # fmt: skip
def test_copy_prefix_pages_equals_the_guides_loop(seed: int, ps: int, bs: int, topk: int) -> None:
    rng = np.random.default_rng(seed)
    table = _table(rng, bs, 6)
    prefix = rng.integers(0, 4 * ps + 1, bs)
    used = set(table.pages.flatten().tolist())
    free = [p for p in range(1, table.num_pages) if p not in used] + [0] * (bs * topk * 2)
    own = torch.tensor(free[: bs * topk * 2], dtype=torch.int32).reshape(bs, topk, 2)
    caches = _caches(rng, ps, table.num_pages)
    want = [c.clone() for c in caches]
    for c in want:  # the guide's loop
        for i, p in enumerate(prefix.tolist()):
            if p % ps:
                src = int(table.pages[int(table.rows[i]), p // ps])
                for b in range(topk):
                    c[int(own[i, b, 0])] = c[src]
    copied = fp.copy_prefix_pages(caches, table, prefix, own, page_size=ps)
    assert copied == topk * int(np.count_nonzero(prefix % ps))
    for got, exp in zip(caches, want, strict=True):
        assert torch.equal(got, exp)


def test_copy_prefix_pages_refuses_mismatched_inputs() -> None:
    rng = np.random.default_rng(2)
    table = _table(rng, 2, 4)
    own = torch.zeros(2, 2, 1, dtype=torch.int32)
    with pytest.raises(fp.PageTableError, match="branch_pages"):
        fp.copy_prefix_pages(
            _caches(rng, 4, table.num_pages), table, [3, 5], own.long(), page_size=4
        )
    with pytest.raises(fp.PageTableError, match="caches"):
        fp.copy_prefix_pages(_caches(rng, 2, table.num_pages), table, [3, 5], own, page_size=4)
    with pytest.raises(fp.LayoutError, match="prefix_lens"):
        fp.copy_prefix_pages(_caches(rng, 4, table.num_pages), table, [3], own, page_size=4)


JUNK = st.one_of(
    st.lists(st.integers(-5, 80), max_size=4),
    st.lists(st.floats(allow_nan=True), min_size=1, max_size=3),
    st.lists(st.text(max_size=2), min_size=1, max_size=3),
    st.just([[1, 2]]),
)


@settings(max_examples=60, deadline=None)
@given(prefix=JUNK, paths=st.lists(st.lists(st.integers(-2, 9), max_size=4), max_size=3))
def test_junk_is_refused_before_any_write(prefix: object, paths: list[list[int]]) -> None:
    """Junk lengths and paths: a flashplan error or a valid move, never a crash or a
    write the refused call left behind."""
    rng = np.random.default_rng(3)
    table = _table(rng, 2, 8)
    caches = _caches(rng, 4, table.num_pages)
    before = [c.clone() for c in caches]
    tree = fp.DraftTree.eagle(2, 2, 2)
    try:
        fp.compact_accepted(caches, table, prefix, tree, paths, page_size=4)
    except fp.FlashplanError:
        assert all(torch.equal(a, b) for a, b in zip(caches, before, strict=True))
    own = torch.arange(40, 48, dtype=torch.int32).reshape(2, 2, 2)
    before = [c.clone() for c in caches]
    try:
        fp.copy_prefix_pages(caches, table, prefix, own, page_size=4)
    except fp.FlashplanError:
        assert all(torch.equal(a, b) for a, b in zip(caches, before, strict=True))


def test_a_partial_page_past_the_row_is_refused_by_request() -> None:
    """Found by the junk test: a prefix whose partial last page lies past the table row
    (33 tokens of page 4 in an 8-page row) is a PageTableError naming the request."""
    rng = np.random.default_rng(3)
    table = _table(rng, 2, 8)
    caches = _caches(rng, 4, table.num_pages)
    before = [c.clone() for c in caches]
    own = torch.arange(40, 48, dtype=torch.int32).reshape(2, 2, 2)
    with pytest.raises(fp.PageTableError) as err:
        fp.copy_prefix_pages(caches, table, [0, 33], own, page_size=4)
    assert err.value.request == 1 and err.value.values["page"] == 8
    assert all(torch.equal(a, b) for a, b in zip(caches, before, strict=True))
