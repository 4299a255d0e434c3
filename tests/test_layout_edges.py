"""Edges of the layout layer that a mutation audit found unpinned.

Each test compares a record's acceptance (or its error's field, request and values)
with a brute-force computation in Python integers straight from the input, at the
boundaries where an off-by-one, a dropped check or a wrong request index would show:
the int32 totals of a layout with an encoder, draft trees, the first offending request
of a verify batch, a page table's rows, sealed and float32 length arrays, and the
smaller records (``Lengths``, ``AttentionGroup``, ``HeadConfig``, ``DraftDecode``,
``SharedPrefix``, ``PageTable.draft_branches``).
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import flashplan as fp
from flashplan import BatchLayout, LayoutError, Mode, PageTableError
from flashplan.lengths import Lengths

M32 = 2**31 - 1
FULL, CROSS = fp.AttentionGroup(), fp.AttentionGroup.cross()


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _sealed(values: list[int]) -> np.ndarray:
    """A read-only int32 array that owns its data: what ``as_lengths`` keeps unconverted."""
    arr = np.array(values, dtype=np.int32)
    arr.setflags(write=False)
    return arr


# --------------------------------------------------------------------------- int32 totals
def _expected_totals(
    seq: list[int], pre: list[int], enc: list[int] | None, cached: list[bool] | None, ps: int
) -> tuple[str, set[int] | None, dict[str, int]] | None:
    """The refusal ``check_totals`` owes these fields, in Python integers: ``(field,
    offending requests or None, values)``, or ``None`` for an accepted layout."""
    new = sum(s - p for s, p in zip(seq, pre, strict=True))
    if new > M32:
        return "seq_lens", None, {"total_new_tokens": new}
    ends = list(seq)
    if enc is not None:
        starts = [_ceil(e, ps) * ps for e in enc]
        over = [i for i, s in enumerate(starts) if s > M32]
        if over:
            return "encoder_lens", {over[0]}, {"value": starts[over[0]]}
        ends = [st_ + s for st_, s in zip(starts, seq, strict=True)]
        over = [i for i, e in enumerate(ends) if e > M32]
        if over:
            return "seq_lens", set(over), {}
    pages = sum(_ceil(e, ps) for e in ends)
    if pages > M32:
        return "seq_lens", None, {"total_pages": pages, "page_size": ps}
    if enc is not None:
        flags = cached or [False] * len(enc)
        written = sum(e for e, c in zip(enc, flags, strict=True) if not c)
        if written > M32:
            return "encoder_lens", None, {"total_encoder_tokens": written}
    return None


_NEAR = st.sampled_from((0, 1, 2, 5, M32 // 2 - 1, M32 // 2, M32 // 2 + 1, M32 - 16, M32 - 1, M32))


@st.composite
def _big_encoder_batches(draw: st.DrawFn) -> dict[str, Any]:
    bs = draw(st.integers(1, 3))
    seq = [draw(_NEAR | st.integers(0, M32)) for _ in range(bs)]
    pre = [s - min(draw(st.sampled_from((0, 1, s))), s) for s in seq]
    enc = [draw(_NEAR | st.integers(0, 64)) for _ in range(bs)]
    cached = draw(st.none() | st.lists(st.booleans(), min_size=bs, max_size=bs))
    ps = draw(st.sampled_from((1, 2, 3, 16, 2**20)))
    return {"seq": seq, "pre": pre, "enc": enc, "cached": cached, "ps": ps}


def _build(case: dict[str, Any], route: str) -> BatchLayout:
    kwargs = {
        "seq_lens": case["seq"], "prefix_lens": case["pre"], "encoder_lens": case["enc"],
        "page_size": case["ps"], "groups": (FULL, CROSS), "encoder_cached": case["cached"],
    }  # fmt: skip
    if route == "extend":
        return BatchLayout.extend(**kwargs)
    if route == "init":
        return BatchLayout(Mode.EXTEND, **kwargs)
    base = BatchLayout.extend([1] * len(case["seq"]), encoder_lens=[1] * len(case["seq"]))
    return attrs.evolve(base, **kwargs)


def _boundary(seq: list[int], pre: list[int], enc: list[int], ps: int = 1) -> dict[str, Any]:
    return {"seq": seq, "pre": pre, "enc": enc, "cached": None, "ps": ps}


@settings(max_examples=40)
@given(_big_encoder_batches(), st.sampled_from(("extend", "init", "evolve")))
# each total exactly at int32 (accepted), then one past it (refused)
@example(_boundary([M32 - 1], [M32 - 2], [1]), "init")  # a row ending at int32: M32 pages
@example(_boundary([M32], [M32 - 1], [1]), "init")  # one past
@example(_boundary([0], [0], [M32]), "init")  # an encoder of int32 tokens, written
@example(_boundary([0], [0], [M32], ps=2), "init")  # rounded to a page: one past
@example(_boundary([M32 - 6, 0], [M32 - 7, 0], [1, 5]), "evolve")  # M32 pages in two rows
@example(_boundary([M32 - 5, 0], [M32 - 6, 0], [1, 5]), "evolve")  # one more page
@example(_boundary([0, 0], [0, 0], [M32 - 5, 5], ps=2), "extend")  # written: M32
@example(_boundary([0, 0], [0, 0], [M32 - 5, 6], ps=2), "extend")  # written: one past
@example(_boundary([M32 - 1, 1], [0, 0], [0, 0]), "extend")  # new tokens: M32
@example(_boundary([M32 - 1, 2], [0, 0], [0, 0]), "extend")  # new tokens: one past
def test_encoder_layouts_refuse_exactly_the_totals_beyond_int32(
    case: dict[str, Any], route: str
) -> None:
    """With an encoder every total goes the long way through ``check_totals``: each is
    accepted at exactly int32 and refused one past it, by every route, naming the field,
    the request (a row's end: one whose row overflows) and the total; an accepted
    layout's ``decoder_start`` and ``pages_needed`` are the Python values (no wrap)."""
    want = _expected_totals(case["seq"], case["pre"], case["enc"], case["cached"], case["ps"])
    if want is None:
        layout = _build(case, route)
        ps = case["ps"]
        starts = [_ceil(e, ps) * ps for e in case["enc"]]
        assert layout.decoder_start.tolist() == starts
        ends = [a + s for a, s in zip(starts, case["seq"], strict=True)]
        assert layout.pages_needed.tolist() == [_ceil(e, ps) for e in ends]
        return
    field, requests, values = want
    with pytest.raises(LayoutError) as err:
        _build(case, route)
    exc = err.value
    assert exc.field == field, str(exc)
    if requests is None:
        assert exc.request is None, str(exc)
    else:
        assert exc.request in requests, str(exc)
    assert values.items() <= exc.values.items(), str(exc)
    if field == "seq_lens" and requests is not None:  # the row's end, of the request named
        i = exc.request
        assert exc.values["end"] == _ceil(case["enc"][i], case["ps"]) * case["ps"] + case["seq"][i]


def test_row_end_beyond_int32_names_the_first_offending_request() -> None:
    """Request 0's row already ends past int32 (2**31 + 11), request 1's further: the
    error must name request 0, as every other layout error names the first offender."""
    with pytest.raises(LayoutError) as err:
        BatchLayout.decode(
            [M32 - 4, M32], encoder_lens=[10, 10], page_size=16, groups=(FULL, CROSS)
        )
    assert (err.value.field, err.value.request) == ("seq_lens", 0), str(err.value)
    assert err.value.values == {"end": 16 + M32 - 4}


# --------------------------------------------------------------------------- Lengths
@given(st.lists(st.integers(-3, 50), max_size=8))
@example([3, -1])
def test_lengths_refuse_exactly_the_negative_lengths(lens: list[int]) -> None:
    """``Lengths.from_lens`` refuses any negative length (-1 included), naming the first
    one and its value; otherwise its index pointers are the Python running sum."""
    negative = [i for i, n in enumerate(lens) if n < 0]
    if negative:
        with pytest.raises(LayoutError) as err:
            Lengths.from_lens(lens, "extend_lens")
        i = negative[0]
        assert (err.value.field, err.value.request) == ("extend_lens", i)
        assert err.value.values == {"value": lens[i]}
        return
    got = Lengths.from_lens(lens, "extend_lens")
    assert got.indptr.tolist() == [sum(lens[:k]) for k in range(len(lens) + 1)]
    assert (got.total, got.max_len) == (sum(lens), max(lens, default=0))


# --------------------------------------------------------------------------- DraftTree
def _tree_error(parents: list[list[int]]) -> tuple[int, int, int] | None:
    """``(request, token, parent)`` of the first broken rule, request by request: token 0
    must have parent -1, token ``j >= 1`` a parent in ``[0, j)``."""
    for i, row in enumerate(parents):
        if row[0] != -1:
            return i, 0, row[0]
        for j in range(1, len(row)):
            if not 0 <= row[j] < j:
                return i, j, row[j]
    return None


@st.composite
def _parent_rows(draw: st.DrawFn) -> list[list[int]]:
    bs, n = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    rows = []
    for _ in range(bs):
        row = [-1] + [draw(st.integers(0, j - 1)) for j in range(1, n)]
        for _ in range(draw(st.integers(0, 2))):  # break some entries (or none)
            row[draw(st.integers(0, n - 1))] = draw(st.integers(-3, n + 1))
        rows.append(row)
    return rows


@settings(max_examples=80)
@given(_parent_rows(), st.sampled_from(("from_parents", "init", "evolve")))
@example([[-1, 1]], "from_parents")  # a token that is its own parent
@example([[-1, 0, 0], [-1, 1, 2]], "init")
@example([[0, 2], [-1, 0]], "evolve")  # the root and token 1 broken: the root is named
def test_draft_trees_refuse_exactly_the_broken_parents(
    parents: list[list[int]], route: str
) -> None:
    """A draft tree is refused exactly when a parent breaks the rules (a self-parent
    included), naming the first offending request, the token and its parent (the root
    first within a request); an accepted tree's depths and ancestors are those found by
    walking up the parents."""
    arr = np.array(parents, dtype=np.int64)
    if route == "from_parents":
        build = lambda: fp.DraftTree.from_parents(arr)  # noqa: E731
    elif route == "init":
        build = lambda: fp.DraftTree(torch.from_numpy(arr))  # noqa: E731
    else:
        base = fp.DraftTree.chain(arr.shape[0], arr.shape[1])
        build = lambda: attrs.evolve(base, parents=arr.tolist())  # noqa: E731
    want = _tree_error(parents)
    if want is not None:
        with pytest.raises(LayoutError) as err:
            build()
        i, token, parent = want
        assert (err.value.field, err.value.request) == ("parents", i), str(err.value)
        assert err.value.values == {"token": token, "parent": parent}, str(err.value)
        return
    tree = build()
    for i, row in enumerate(parents):
        for j in range(len(row)):
            chain, k = {j}, j
            while row[k] != -1:
                k = row[k]
                chain.add(k)
            assert tree.depth[i, j] == len(chain) - 1
            assert set(np.flatnonzero(tree.ancestors[i, j]).tolist()) == chain


@pytest.mark.parametrize(
    "parents",
    [
        np.array([[-1, 2**32]], dtype=np.int64),  # token 1's parent: wraps to 0
        np.array([[2**32 - 1, 0]], dtype=np.int64),  # token 0's parent: wraps to -1
        np.array([[2**64 - 1, 0]], dtype=np.uint64),
    ],
)
def test_draft_parents_beyond_int32_are_refused(parents: np.ndarray) -> None:
    """A parent outside int32 is no earlier token: refused (naming ``parents`` and
    request 0), never wrapped into a valid one."""
    with pytest.raises(LayoutError) as err:
        fp.DraftTree.from_parents(parents)
    assert (err.value.field, err.value.request) == ("parents", 0), str(err.value)


# --------------------------------------------------------------------------- verify batches
@given(
    st.lists(st.integers(1, 4), min_size=1, max_size=5),
    st.integers(1, 4),
    st.sampled_from(("init", "of", "evolve")),
)
@example([2, 3, 1], 2, "init")
def test_verify_batch_names_the_first_request_without_n_new_tokens(
    new: list[int], n: int, route: str
) -> None:
    """A verify layout from its fields, whose requests do not all add the draft's ``N``
    tokens, is refused naming the first such request and both counts."""
    bs = len(new)
    draft = fp.DraftTree.chain(bs, n)
    pre = [3 * i for i in range(bs)]
    seq = [p + k for p, k in zip(pre, new, strict=True)]
    if route == "init":
        build = lambda: BatchLayout(Mode.VERIFY, seq, pre, draft=draft)  # noqa: E731
    elif route == "of":
        build = lambda: BatchLayout.of(Mode.VERIFY, seq, pre, draft=draft)  # noqa: E731
    else:
        base = BatchLayout.verify(pre, draft)
        build = lambda: attrs.evolve(base, seq_lens=seq)  # noqa: E731
    wrong = [i for i, k in enumerate(new) if k != n]
    if not wrong:
        assert build() == BatchLayout.verify(pre, draft)
        return
    with pytest.raises(LayoutError) as err:
        build()
    i = wrong[0]
    assert (err.value.field, err.value.request) == ("seq_lens", i), str(err.value)
    assert err.value.values == {"new_tokens": new[i], "num_draft_tokens": n}


def test_verify_names_both_batch_sizes() -> None:
    """``BatchLayout.verify`` with a draft of another batch size names ``draft`` and both
    sizes (its own check, before the layout's)."""
    with pytest.raises(LayoutError) as err:
        BatchLayout.verify([1, 2, 3], fp.DraftTree.chain(2, 2))
    assert (err.value.field, err.value.request) == ("draft", None)
    assert err.value.values == {"prefix_lens_size": 3, "draft_size": 2}


# --------------------------------------------------------------------------- delimiters
@given(
    st.lists(
        st.tuples(st.integers(1, 8), st.lists(st.integers(0, 11), max_size=4, unique=True)),
        min_size=1,
        max_size=4,
    ),
    st.booleans(),
)
@example([(4, [1, 4, 6])], False)  # two delimiters past the request: the first is named
def test_delimiter_beyond_extend_names_the_first_such_position(
    requests: list[tuple[int, list[int]]], evolve: bool
) -> None:
    """A delimiter at or past its request's new-token count is refused naming the first
    such request, the first such delimiter's position and the count."""
    ext = [e for e, _ in requests]
    delims = [sorted(d) or None for _, d in requests]
    if evolve:
        base = BatchLayout.extend(ext, item_delimiters=[None] * len(ext))
        build = lambda: attrs.evolve(base, item_delimiters=delims)  # noqa: E731
    else:
        build = lambda: BatchLayout.extend(ext, item_delimiters=delims)  # noqa: E731
    over = [
        (i, min(p for p in d if p >= e)) for i, (e, d) in enumerate(requests) if d and max(d) >= e
    ]
    if not over:
        assert build().item_delimiters.to_lists() == [d or [] for d in delims]
        return
    with pytest.raises(LayoutError) as err:
        build()
    i, position = over[0]
    assert (err.value.field, err.value.request) == ("item_delimiters", i), str(err.value)
    assert err.value.values == {"position": position, "extend_len": ext[i]}


# --------------------------------------------------------------------------- block extend
@given(st.lists(st.integers(0, 12), max_size=5), st.integers(1, 6))
@example([5, 3], 4)  # one token short of the block
def test_block_extend_refuses_exactly_the_rows_shorter_than_a_block(
    seq: list[int], block: int
) -> None:
    """``block_extend`` refuses (as ``seq_lens``, not through a negative prefix) the first
    request shorter than the block; otherwise the last ``block`` tokens are new."""
    short = [i for i, s in enumerate(seq) if s < block]
    if short:
        with pytest.raises(LayoutError) as err:
            BatchLayout.block_extend(seq, block)
        i = short[0]
        assert (err.value.field, err.value.request) == ("seq_lens", i), str(err.value)
        assert err.value.values == {"seq_len": seq[i], "block_size": block}
        return
    layout = BatchLayout.block_extend(seq, block)
    assert layout.prefix_lens.tolist() == [s - block for s in seq]
    assert layout.extend_lens.tolist() == [block] * len(seq)


# --------------------------------------------------------------------------- PageTable
def _table_error(rows: list[int], num_rows: int) -> tuple[int, int, int | None] | None:
    """``(request, row, other_request)`` of the first request whose row is out of the
    table (``other_request`` None) or taken by an earlier request."""
    for j, r in enumerate(rows):
        if r >= num_rows:
            return j, r, None
        if r in rows[:j]:
            return j, r, rows[:j].index(r)
    return None


@given(st.lists(st.integers(0, 6), max_size=7), st.integers(1, 6))
@example([1, 0, 1, 0], 2)  # two shared rows: request 2 shares first (with request 0)
def test_page_table_names_the_first_bad_row(rows: list[int], num_rows: int) -> None:
    """A table whose rows leave the table or repeat is refused naming the first request
    that does, its row and (for a shared row) the earlier request holding it."""
    pages = torch.zeros(num_rows, 2, dtype=torch.int32)
    want = _table_error(rows, num_rows)
    if want is None:
        assert fp.PageTable(pages, rows).rows.tolist() == rows
        return
    with pytest.raises(PageTableError) as err:
        fp.PageTable(pages, rows)
    j, row, other = want
    assert (err.value.field, err.value.request) == ("rows", j), str(err.value)
    if other is None:
        assert err.value.values == {"row": row, "num_rows": num_rows}
    else:
        assert err.value.values == {"row": row, "other_request": other}


@given(
    st.lists(st.integers(0, 40), min_size=1, max_size=4),
    st.sampled_from((1, 2, 4)),
    st.integers(1, 6),
)
@example([7], 2, 2)  # 3 full prefix pages, 2 columns: one page short
@example([6, 9], 3, 3)  # exactly the 3 columns: accepted
def test_draft_branches_refuse_a_row_shorter_than_the_prefix(
    prefix: list[int], ps: int, width: int
) -> None:
    """``PageTable.draft_branches`` accepts a table whose rows hold every request's full
    prefix pages (exactly as many included) and copies them into each branch row;
    otherwise it refuses, naming a request whose full pages do not fit."""
    bs, topk = len(prefix), 2
    table = fp.PageTable.sequential([width] * bs, max_pages=width)
    own = torch.full((bs, topk, 1), -7, dtype=torch.int32)
    full = [p // ps for p in prefix]
    if max(full) > width:
        with pytest.raises(PageTableError) as err:
            fp.PageTable.draft_branches(table, prefix, topk, own, page_size=ps)
        assert (err.value.field, err.value.values["max_pages"]) == ("prefix_lens", width)
        i = err.value.request
        assert i is not None and full[i] > width and err.value.values["full_pages"] == full[i]
        return
    out = fp.PageTable.draft_branches(table, prefix, topk, own, page_size=ps)
    for i in range(bs):
        for b in range(topk):
            row = out.pages[i * topk + b].tolist()
            assert row[: full[i]] == table.pages[i, : full[i]].tolist()
            assert row[full[i]] == -7


def test_draft_branches_name_the_first_request_whose_row_is_short() -> None:
    """Both requests' prefixes need more than the table's 3 columns: request 0 is named."""
    table = fp.PageTable.sequential([3, 3], max_pages=3)
    own = torch.zeros(2, 2, 1, dtype=torch.int32)
    with pytest.raises(PageTableError) as err:
        fp.PageTable.draft_branches(table, [16, 20], 2, own, page_size=4)
    assert (err.value.request, err.value.values["full_pages"]) == (0, 4), str(err.value)


# --------------------------------------------------------------------------- sealed input
@pytest.mark.parametrize(
    ("build", "field", "index", "value"),
    [
        (lambda: BatchLayout.decode(_sealed([3, 0])), "seq_lens", 1, 0),
        (lambda: BatchLayout.extend(_sealed([3, -1])), "seq_lens", 1, -1),
        (lambda: BatchLayout.extend([3, 4], _sealed([0, -2])), "prefix_lens", 1, -2),
        (lambda: BatchLayout(Mode.EXTEND, _sealed([-5]), [0]), "seq_lens", 0, -5),
        (
            lambda: attrs.evolve(
                BatchLayout.extend([1], encoder_lens=[1]), encoder_lens=_sealed([-1])
            ),
            "encoder_lens",
            0,
            -1,
        ),
        (lambda: fp.DraftDecode(_sealed([2, -1]), topk=1, steps=1), "prefix_lens", 1, -1),
        (lambda: BatchLayout.extend(np.array([2.0**31], dtype=np.float32)), "seq_lens", 0, 2**31),
        (
            lambda: BatchLayout.extend(torch.tensor([1.0, 2.0**31], dtype=torch.float32)),
            "seq_lens",
            1,
            2**31,
        ),
    ],
)
def test_sealed_and_float32_lengths_are_checked(
    build: Any, field: str, index: int, value: int
) -> None:
    """A read-only int32 array (kept as it is, unconverted) is still checked, and a
    float32 array is compared with int32's range in float64 (float32 cannot hold
    ``2**31 - 1``): both refused naming the request and the value, never kept or wrapped."""
    with pytest.raises(LayoutError) as err:
        build()
    assert (err.value.field, err.value.request) == (field, index), str(err.value)
    assert err.value.values == {"value": value}


@pytest.mark.parametrize(
    "flags",
    [np.array(True), np.ones((2, 1), dtype=bool), torch.tensor(True), torch.ones(1, 2).bool()],
)
def test_encoder_cached_must_be_one_dimensional(flags: Any) -> None:
    """``encoder_cached`` that is not 1-D (a 0-d array or tensor too) is a flashplan error
    naming the field and its shape, not a crash while reading it."""
    with pytest.raises(LayoutError) as err:
        BatchLayout.extend([1, 2], encoder_lens=[3, 4], encoder_cached=flags)
    assert (err.value.field, err.value.request) == ("encoder_cached", None), str(err.value)
    assert err.value.values == {"shape": tuple(np.shape(flags))}


# --------------------------------------------------------------------------- small records
@pytest.mark.parametrize(
    "build",
    [
        lambda: fp.AttentionGroup(attention_chunk_size=8, window_left=0),
        lambda: attrs.evolve(fp.AttentionGroup.chunked(8), window_left=0),
        lambda: attrs.evolve(fp.AttentionGroup.sliding(0), attention_chunk_size=8),
    ],
)
def test_a_chunked_group_refuses_a_window_of_zero(build: Any) -> None:
    """``window_left = 0`` is a window (one key): refused with chunks on every route."""
    with pytest.raises(LayoutError) as err:
        build()
    assert err.value.field == "attention_chunk_size"
    assert err.value.values == {"attention_chunk_size": 8, "window_left": 0}


@pytest.mark.parametrize(
    "build",
    [
        lambda: fp.AttentionGroup(window_right=0),
        lambda: attrs.evolve(fp.AttentionGroup.sliding(4), window_right=0),
    ],
)
def test_a_causal_group_refuses_a_right_bound_of_zero(build: Any) -> None:
    """``window_right = 0`` is a right bound (the query's own key): a causal group
    refuses it like any other, naming ``window_right``."""
    with pytest.raises(LayoutError) as err:
        build()
    assert err.value.field == "window_right"
    assert err.value.values == {"window_right": 0, "causal": True}


@pytest.mark.parametrize(
    "groups",
    [
        fp.AttentionGroup.bidirectional(),
        (FULL, fp.AttentionGroup.bidirectional(window_left=2, window_right=1)),
    ],
)
def test_draft_decode_refuses_a_bidirectional_group(groups: Any) -> None:
    """A draft decode is a plain decode per branch: a non-causal self group is refused
    when the record is built (on ``attrs.evolve`` too), not planned."""
    for build in (
        lambda: fp.DraftDecode([3, 5], topk=2, steps=2, groups=groups),
        lambda: attrs.evolve(fp.DraftDecode([3, 5], topk=2, steps=2), groups=groups),
    ):
        with pytest.raises(LayoutError) as err:
            build()
        assert err.value.field == "groups", str(err.value)


@pytest.mark.parametrize(
    ("build", "field", "index", "value"),
    [
        (lambda: BatchLayout.from_extend_lens([1, M32], [0, 1]), "seq_lens", 1, 2**31),
        (lambda: BatchLayout.from_extend_lens([M32], [M32]), "seq_lens", 0, 2 * M32),
        (lambda: BatchLayout.verify([3, M32], fp.DraftTree.chain(2, 2)), "prefix_lens", 1, M32 + 2),
        (lambda: BatchLayout.draft_extend([M32, 0], [1, 1]), "prefix_lens", 0, 2**31),
    ],
)
def test_computed_lengths_beyond_int32_name_the_request_and_the_sum(
    build: Any, field: str, index: int, value: int
) -> None:
    """A named constructor that adds two valid lengths refuses a sum beyond int32 with
    the sum itself (never an int32 wrap of it), naming the first such request."""
    with pytest.raises(LayoutError) as err:
        build()
    assert (err.value.field, err.value.request) == (field, index), str(err.value)
    assert err.value.values == {"value": value}
    assert "exceeds int32" in err.value.message


@given(st.integers(1, 6), st.integers(1, 4), st.integers(1, 8), st.integers(1, 8))
@example(3, 4, 4, 3)  # 12 query heads shard over 3 ranks; 4 KV heads do not
def test_head_config_shards_exactly_over_divisors_of_the_kv_heads(
    group: int, kv: int, world: int, dim: int
) -> None:
    """``shard(world)`` works exactly when ``world`` divides ``num_kv_heads`` (whatever
    ``num_qo_heads`` allows), giving each rank ``1/world`` of both head counts."""
    heads = fp.HeadConfig(kv * group, kv, 8 * dim)
    if kv % world:
        with pytest.raises(LayoutError) as err:
            heads.shard(world)
        assert err.value.field == "num_kv_heads"
        assert err.value.values == {"num_kv_heads": kv, "world_size": world}
        return
    shard = heads.shard(world)
    assert (shard.num_qo_heads, shard.num_kv_heads) == (kv * group // world, kv // world)
    assert (shard.head_dim, shard.group_size) == (heads.head_dim, group)


@given(
    st.lists(st.sampled_from((0, 5, 2**28 - 2, 2**29 - 1, 2**30 - 2, 2**30 - 1)), max_size=3),
    st.integers(1, 4),
    st.integers(1, 3),
    st.sampled_from((1, 2, 16)),
)
@example([2**30 - 2], 2, 1, 1)  # 2 * (2**30 - 1) pages: accepted
@example([2**30 - 1], 2, 1, 1)  # 2 * 2**30 pages: one past int32
@example([2**29], 4, 1, 1)  # one row fits int32 pages, its 4 branches do not
def test_draft_decode_refuses_exactly_the_branch_pages_beyond_int32(
    prefix: list[int], topk: int, steps: int, ps: int
) -> None:
    """A DraftDecode is refused exactly when its last step's ``topk`` rows per request
    need more pages in all than int32 holds (naming the total); an accepted one's last
    step plans those pages."""
    pages = topk * sum(_ceil(p + steps, ps) for p in prefix)
    if pages > M32:
        with pytest.raises(LayoutError) as err:
            fp.DraftDecode(prefix, topk=topk, steps=steps, page_size=ps)
        assert err.value.field == "prefix_lens"
        assert err.value.values == {"total_pages": pages, "topk": topk, "page_size": ps}
        return
    last = fp.DraftDecode(prefix, topk=topk, steps=steps, page_size=ps).step(steps - 1)
    assert last.pages_needed.tolist() == [_ceil(p + steps, ps) for p in prefix for _ in range(topk)]


@given(st.lists(st.integers(1, 12), min_size=2, max_size=6), st.integers(1, 12), st.data())
@example([5, 5, 9], 6, None)  # the group shares one token more than request 0 has cached
def test_shared_prefix_refuses_exactly_the_tokens_not_cached(
    prefix: list[int], shared_len: int, data: st.DataObject | None
) -> None:
    """A group may share up to each member's whole cached prefix (``shared_len ==
    prefix_len`` included), not one token more: refused by ``check_batch`` and by the
    planner's route (``cascade_levels``), naming the first such member and both counts."""
    bs = len(prefix)
    first = 0 if data is None else data.draw(st.integers(0, bs - 2))
    count = 2 if data is None else data.draw(st.integers(2, bs - first))
    shared = fp.SharedPrefix.from_groups([range(first, first + count)], [shared_len])
    layout = BatchLayout.extend([p + 1 for p in prefix], prefix, page_size=4)
    over = [i for i in range(first, first + count) if shared_len > prefix[i]]
    for check in (
        lambda: shared.check_batch(bs, layout.prefix_lens),
        lambda: fp.cascade_levels(layout, shared),
    ):
        if not over:
            check()
            continue
        with pytest.raises(LayoutError) as err:
            check()
        assert (err.value.field, err.value.request) == ("shared_prefix", over[0])
        assert err.value.values["shared_len"] == shared_len
        assert err.value.values["prefix_len"] == prefix[over[0]]
