"""Position runs: the compact RoPE positions of a plan (``PlanSpec.position_runs``).

Expected positions come from the layout, token by token (``P + j``; a verify token at
``P + depth``; multi-item positions are checked against their own brute force in
``test_multi_item.py``), never from the runs themselves.
"""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashplan as fp
from flashplan import LayoutError
from flashplan.planning import PositionRuns
from flashplan.testing import layouts, multi_item_layouts, page_tables, verify_layouts

HEADS = fp.HeadConfig(num_qo_heads=4, num_kv_heads=2, head_dim=64)


def brute_force(first: list[int], length: list[int]) -> list[int]:
    """Run by run, token by token, from the definition."""
    return [max(f + j, 0) for f, n in zip(first, length, strict=True) for j in range(n)]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(-3, 1000), st.integers(0, 12)), max_size=30),
)
def test_runs_materialize_token_by_token(runs: list[tuple[int, int]]) -> None:
    first = [f for f, _ in runs]
    length = [n for _, n in runs]
    r = PositionRuns.from_runs(first, length)
    out = r.positions()
    assert out.dtype == np.int32 and not out.flags.writeable
    assert out.tolist() == brute_force(first, length)
    assert r.total == sum(length) and r.max_length == max(length, default=0)
    assert (
        r.start.tolist()
        == np.concatenate([[0], np.cumsum(length)[:-1]]).astype(int).tolist()[: len(runs)]
    )


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_plan_positions_follow_the_layout(data: st.DataObject) -> None:
    """Decode and extend: ``P + j`` for new token ``j``; verify: ``P + depth``."""
    kind = data.draw(st.sampled_from(["layout", "verify"]))
    layout = data.draw(layouts() if kind == "layout" else verify_layouts())
    spec = fp.plan(layout, HEADS)
    want: list[int] = []
    for i in range(layout.batch_size):
        p, e = int(layout.prefix_lens[i]), int(layout.extend_lens[i])
        if layout.draft is not None:
            want += [p + int(d) for d in layout.draft.depth[i]]
        else:
            want += [p + j for j in range(e)]
    assert spec.positions.tolist() == want
    assert spec.position_runs.total == spec.total_q
    # the runs alone give the same positions (no preset array)
    assert spec.position_runs.positions().tolist() == want


@settings(max_examples=40, deadline=None)
@given(layout=multi_item_layouts())
def test_multi_item_runs_are_few(layout: fp.BatchLayout) -> None:
    """One run per request and one per delimiter: nothing per token."""
    spec = fp.plan(layout, HEADS)
    items = layout.item_delimiters
    assert items is not None
    runs = spec.position_runs
    assert runs.num_runs == layout.batch_size + items.positions.shape[0]
    assert runs.total == spec.total_q


@settings(max_examples=60, deadline=None)
@given(layout=st.one_of(layouts(), multi_item_layouts(), verify_layouts()))
def test_planned_runs_equal_the_checked_ones(layout: fp.BatchLayout) -> None:
    """The planner stores its runs as they are; :meth:`PositionRuns.from_runs`, which
    converts and checks, gives the same record from the same arrays."""
    runs = fp.plan(layout, HEADS).position_runs
    again = PositionRuns.from_runs(runs.first, runs.length)
    assert again == runs and hash(again) == hash(runs)
    for mine, theirs in ((runs.first, again.first), (runs.length, again.length)):
        assert mine.dtype == theirs.dtype == np.int32 and not mine.flags.writeable
    # from plain lists too (copied, then the same value)
    assert PositionRuns.from_runs(runs.first.tolist(), runs.length.tolist()) == runs


def test_one_token_runs_are_their_own_positions() -> None:
    """Decode and verify plans read their positions without a copy: runs of one token
    each at positions >= 0 are ``first`` itself; a negative one is still clamped."""
    runs = PositionRuns.of_tokens([4, 0, 9])
    assert runs.positions() is runs.first
    spec = fp.plan(fp.BatchLayout.decode([3, 7, 1]), HEADS)
    assert spec.position_runs.positions() is spec.position_runs.first
    assert spec.position_runs.positions().tolist() == [2, 6, 0]
    clamped = PositionRuns.from_runs([3, -1], [1, 1])
    out = clamped.positions()
    assert out is not clamped.first and out.tolist() == [3, 0] and not out.flags.writeable
    empty = PositionRuns.from_runs([], [])
    assert empty.positions().tolist() == [] and empty.positions().dtype == np.int32
    assert PositionRuns.from_runs([5, 2], [1, 0]).positions().tolist() == [5]


def test_of_tokens_and_equality() -> None:
    a = PositionRuns.of_tokens([4, 5, 9])
    assert a.positions().tolist() == [4, 5, 9] and a.num_runs == 3
    assert a == PositionRuns.from_runs([4, 5, 9], [1, 1, 1])
    assert hash(a) == hash(copy.deepcopy(a))
    b = pickle.loads(pickle.dumps(a))
    assert b == a and not b.first.flags.writeable
    with pytest.raises(LayoutError, match=r"positions.*token.*1"):
        PositionRuns.of_tokens([3, -1])


@pytest.mark.parametrize(
    ("first", "length", "field", "detail"),
    [
        ([0, 1], [1], "length", "one entry per run"),
        ([0, 1], [2, -1], "length", "run.*1"),
        ([2**31 - 2], [3], "first", "exceeds int32"),
        ([0, 0], [2**31 - 1, 1], "length", "total exceeds int32"),
        ([[0]], [[1]], "first", "1-D"),
        ([0.5], [1], "first", "1-D integer"),
        ([2**31], [1], "first", "exceeds int32"),
    ],
)
def test_bad_runs_are_refused(first: object, length: object, field: str, detail: str) -> None:
    with pytest.raises(LayoutError, match=detail) as info:
        PositionRuns.from_runs(first, length)
    assert info.value.field == field
    assert isinstance(info.value, ValueError)


def test_plan_spec_refuses_runs_that_do_not_cover_its_queries() -> None:
    spec = fp.plan(fp.BatchLayout.extend([3, 2], [1, 0]), HEADS)
    runs = PositionRuns.from_runs([1, 0], [3, 2])  # 5 positions, 4 queries
    with pytest.raises(LayoutError, match="position_runs"):
        fp.planning.PlanSpec.of(
            spec.key, spec.queries, prefix_lens=spec.prefix_lens,
            decoder_start=spec.decoder_start, position_runs=runs, encoder=spec.encoder,
            pages_needed=spec.pages_needed, group_plans=spec.group_plans,
        )  # fmt: skip


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_reference_executor_positions(data: st.DataObject) -> None:
    layout = data.draw(st.one_of(layouts(), multi_item_layouts(), verify_layouts()))
    spec = fp.plan(layout, HEADS)
    table, _ = data.draw(page_tables(spec))
    ex = fp.ReferenceExecutor()
    with pytest.raises(fp.PlanMismatchError, match="apply"):
        ex.positions()
    ex.apply(spec, table)
    out = ex.positions()
    assert out.dtype == torch.int32 and out.tolist() == spec.positions.tolist()
