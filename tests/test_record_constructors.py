"""Every record is built by one checking constructor, and the planner's records are
exactly what those constructors build from plain data.

Plan records store their fields as given (attrs' ``__init__``) and are built by named
constructors that convert, check and derive (``PageSpans.between``, ``Lengths.from_lens``,
``PagedPart.over``, ``GroupPlan.of``, ``PlanSpec.of``, the masks' and the multi-item
tensors' factories). The planner calls the same constructors with its own sealed arrays;
rebuilding each record from Python lists must give an equal record with equal derived
arrays, and the page math must match a per-request computation in Python integers.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

import flashplan as fp
from flashplan.arrays import INT32_MAX, indptr
from flashplan.errors import FieldTypeError, LayoutError
from flashplan.layout.batch import BatchLayout, Mode
from flashplan.lengths import Lengths, PageSpans, ceil_pages, page_split
from flashplan.planning import GroupPlan, KernelPath, PagedPart, PlanSpec, RaggedPart
from flashplan.planning.items import MultiItemTensors
from flashplan.planning.masks import ThresholdMask, TreeMask
from flashplan.planning.positions import PositionRuns
from flashplan.testing import (
    attention_groups,
    decode_layouts,
    head_configs,
    layouts,
    multi_item_layouts,
    verify_layouts,
)

HEADS = fp.HeadConfig(4, 1, 64)


def _same(a: Any, b: Any, what: str) -> None:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        assert isinstance(a, np.ndarray) and isinstance(b, np.ndarray), what
        assert a.dtype == b.dtype, what
        assert not a.flags.writeable and not b.flags.writeable, what
        np.testing.assert_array_equal(a, b, err_msg=what)
    else:
        assert a == b, what


def _python_spans(first: list[int], end: list[int], ps: int) -> dict[str, list[int]]:
    """The page math of each span in Python integers, one request at a time."""
    start = [f // ps if e > f else 0 for f, e in zip(first, end, strict=True)]
    kv = [e - s * ps if e > f else 0 for f, e, s in zip(first, end, start, strict=True)]
    pages = [-(-k // ps) for k in kv]
    last = [k - (p - 1) * ps if k else 0 for k, p in zip(kv, pages, strict=True)]
    indptr = [sum(pages[:i]) for i in range(len(pages) + 1)]
    return {"start_page": start, "kv_lens": kv, "pages": pages, "last": last, "indptr": indptr}


def _check_spans(spans: PageSpans) -> None:
    again = PageSpans.between(spans.first_token.tolist(), spans.end_token.tolist(), spans.page_size)
    assert again == spans and hash(again) == hash(spans)
    for name in ("first_token", "end_token", "start_page", "kv_lens", "last_page_len"):
        _same(getattr(spans, name), getattr(again, name), name)
    _same(spans.pages.lens, again.pages.lens, "pages")
    _same(spans.pages.indptr, again.pages.indptr, "page_indptr")
    want = _python_spans(spans.first_token.tolist(), spans.end_token.tolist(), spans.page_size)
    assert spans.start_page.tolist() == want["start_page"]
    assert spans.kv_lens.tolist() == want["kv_lens"]
    assert spans.pages.lens.tolist() == want["pages"]
    assert spans.last_page_len.tolist() == want["last"]
    assert spans.pages.indptr.tolist() == want["indptr"]
    assert spans.max_kv_len == max(want["kv_lens"], default=0)


def _rebuilt_mask(mask: Any) -> Any:
    if isinstance(mask, ThresholdMask):
        return ThresholdMask.from_arrays(
            mask.qo_lens.tolist(), mask.kv_lens.tolist(), mask.first_visible.tolist()
        )
    return TreeMask.from_bits(
        mask.qo_lens.tolist(), mask.kv_lens.tolist(), mask.first_visible.tolist(),
        mask.row_offsets.tolist(), mask.tail_start.tolist(), mask.tail_bits.tolist(),
    )  # fmt: skip


def _rebuilt_items(items: MultiItemTensors) -> MultiItemTensors:
    return MultiItemTensors.from_items(
        items.prefix_len_ptr.tolist(), items.token_pos_in_items_len, items.max_item_len.tolist(),
        items.item_start.tolist(), items.item_length.tolist(),
    )  # fmt: skip


def _rebuilt_paged(part: PagedPart) -> PagedPart:
    _check_spans(part.spans)
    spans = PageSpans.between(part.first_token.tolist(), part.end_token.tolist(), part.page_size)
    mask = None if part.mask is None else _rebuilt_mask(part.mask)
    if mask is not None:
        assert mask == part.mask and hash(mask) == hash(part.mask)
        _same(mask.indptr, part.mask.indptr, "mask.indptr")
        np.testing.assert_array_equal(mask.packed, part.mask.packed)
    items = None if part.items is None else _rebuilt_items(part.items)
    if items is not None:
        assert items == part.items and hash(items) == hash(part.items)
    return PagedPart.over(
        spans, causal=part.causal, window_left=part.window_left, mask=mask, items=items
    )


def _rebuilt_spec(spec: PlanSpec) -> PlanSpec:
    plans = []
    for gp in spec.group_plans:
        paged = None if gp.paged is None else _rebuilt_paged(gp.paged)
        ragged = None
        if gp.ragged is not None:
            keys = Lengths.from_lens(gp.ragged.kv_lens.tolist())
            ragged = RaggedPart.over(
                keys, causal=gp.ragged.causal, window_left=gp.ragged.window_left
            )
            _same(ragged.kv_indptr, gp.ragged.kv_indptr, "kv_indptr")
        plans.append(
            GroupPlan.of(
                gp.group,
                gp.path,
                paged=paged,
                ragged=ragged,
                key_start=gp.key_start.tolist(),
                num_keys=gp.num_keys.tolist(),
            )
        )
    runs = PositionRuns.from_runs(
        spec.position_runs.first.tolist(), spec.position_runs.length.tolist()
    )
    encoder = None if spec.encoder is None else Lengths.from_lens(spec.encoder.lens.tolist())
    return PlanSpec.of(
        spec.key, Lengths.from_lens(spec.qo_lens.tolist()),
        prefix_lens=spec.prefix_lens.tolist(), decoder_start=spec.decoder_start.tolist(),
        position_runs=runs, encoder=encoder, pages_needed=spec.pages_needed.tolist(),
        group_plans=plans,
    )  # fmt: skip


def _check_spec(spec: PlanSpec) -> None:
    again = _rebuilt_spec(spec)
    assert spec == again and hash(spec) == hash(again)
    for name in ("qo_indptr", "qo_lens", "write_start", "positions", "pages_needed"):
        _same(getattr(spec, name), getattr(again, name), name)
    for name in ("max_q_len", "total_q", "total_encoder", "batch_size"):
        assert getattr(spec, name) == getattr(again, name), name
    assert spec.write_start.tolist() == (spec.decoder_start + spec.prefix_lens).tolist()
    for mine, theirs in zip(spec.group_plans, again.group_plans, strict=True):
        for name in ("key_start", "num_keys"):
            _same(getattr(mine, name), getattr(theirs, name), name)
    back = pickle.loads(pickle.dumps(spec))  # pickling keeps the value and read-only arrays
    assert back == spec
    assert all(not gp.key_start.flags.writeable for gp in back.group_plans)
    assert not back.queries.indptr.flags.writeable


@given(
    st.one_of(
        layouts(max_batch=12),
        decode_layouts(max_batch=12, page_sizes=(1, 3, 16, 64)),
        verify_layouts(),
        multi_item_layouts(),
    ),
    head_configs(),
)
def test_planned_records_equal_the_checked_constructors(layout: BatchLayout, heads: Any) -> None:
    for path in ("auto", "paged", "ragged"):
        try:
            spec = fp.plan(layout, heads, extend_path=path)
        except LayoutError:
            continue  # a path this batch cannot take (checked elsewhere)
        _check_spec(spec)


@given(
    st.lists(st.tuples(st.integers(0, 3000), st.integers(0, 3000)), max_size=8),
    st.sampled_from((1, 2, 3, 16, 64)),
)
def test_page_spans_match_python_integers(bounds: list[tuple[int, int]], ps: int) -> None:
    first, end = [f for f, _ in bounds], [e for _, e in bounds]
    spans = PageSpans.between(first, end, ps)
    _check_spans(spans)
    rows = PageSpans.from_row_start(end, ps)
    assert rows == PageSpans.between([0] * len(end), end, ps)
    _check_spans(rows)
    starts = [f // ps for f in first]  # spans from a page boundary, with and without a base
    at_page = PageSpans.from_page_start(starts, end, ps)
    assert at_page == PageSpans.between([s * ps for s in starts], end, ps)
    _check_spans(at_page)
    start32 = np.array(starts, dtype=np.int32)
    checked = PageSpans.from_checked_page_start(
        start32, start32 * ps, np.array(end, dtype=np.int32), ps
    )
    assert checked == at_page  # the same spans from arrays a caller keeps
    base = [7 * k for k in range(len(end))]
    moved = PageSpans.from_page_start(starts, end, ps, base=base)
    assert moved == PageSpans.between(
        [s * ps + b for s, b in zip(starts, base, strict=True)],
        [e + b for e, b in zip(end, base, strict=True)], ps,
    )  # fmt: skip
    tokens = np.array(end, dtype=np.int32)
    assert ceil_pages(tokens, ps).tolist() == [-(-t // ps) for t in end]
    pages, last = page_split(tokens, ps)
    assert pages.tolist() == [-(-t // ps) for t in end]
    assert last.tolist() == [t - (-(-t // ps) - 1) * ps if t else 0 for t in end]


def test_page_math_near_int32_max() -> None:
    """Spans that end at the last int32 row token: no sum may wrap."""
    first, end = [0, INT32_MAX - 5, 7, 9], [INT32_MAX, INT32_MAX, 7, 3]
    spans = PageSpans.between(first, end, 16)
    assert spans.kv_lens.tolist() == [INT32_MAX, 15, 0, 0]
    _check_spans(spans)
    layout = BatchLayout.decode([INT32_MAX, 1], page_size=1 << 20)
    assert layout.pages_needed.tolist() == [(INT32_MAX >> 20) + 1, 1]
    _check_spec(fp.plan(layout, HEADS))
    with pytest.raises(LayoutError) as info:  # pages in all beyond int32
        PageSpans.from_row_start([INT32_MAX, INT32_MAX, INT32_MAX], 1)
    assert info.value.field == "pages"


@given(
    st.lists(st.integers(1, 64), min_size=0, max_size=6),
    st.sampled_from((1, 2, 16)),
    st.lists(attention_groups(kinds=("full", "sliding")), min_size=1, max_size=3, unique=True),
)
def test_decode_layout_equals_the_general_constructor(
    seq: list[int], page_size: int, groups: list[fp.AttentionGroup]
) -> None:
    fast = BatchLayout.decode(seq, page_size=page_size, groups=groups)
    slow = BatchLayout.of(
        Mode.DECODE, seq, [s - 1 for s in seq], page_size=page_size, groups=groups
    )
    assert fast == slow
    assert fp.plan(fast, HEADS) == fp.plan(slow, HEADS)
    _check_spec(fp.plan(fast, HEADS))


def _error(fn: Any) -> tuple[type, str]:
    with pytest.raises(LayoutError) as info:
        fn()
    return type(info.value), str(info.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"page_size": 0},
        {"page_size": 2.0},
        {"page_size": 0, "groups": "full"},
        {"groups": ()},
        {"groups": "full"},
        {"groups": (fp.AttentionGroup(), fp.AttentionGroup())},
        {"groups": fp.AttentionGroup.cross()},
        {"encoder_cached": [True, False]},
    ],
)
def test_decode_refuses_what_the_constructor_refuses(kwargs: dict[str, Any]) -> None:
    seq = [3, 5]
    fast = _error(lambda: BatchLayout.decode(seq, **kwargs))
    slow = _error(lambda: BatchLayout.of(Mode.DECODE, seq, [2, 4], **kwargs))
    assert fast == slow


@pytest.mark.parametrize(
    ("seq", "index"), [([3, 0], 1), ([3, -1], 1), ([True, 2], 0), ([1, 2**31], 1), ([1.5], 0)]
)
def test_decode_names_the_bad_request(seq: list[Any], index: int) -> None:
    _, message = _error(lambda: BatchLayout.decode(seq, page_size=16))
    assert message.startswith(f"seq_lens[{index}]: ")


def test_constructors_refuse_records_that_contradict_themselves() -> None:
    spans = PageSpans.between([0, 0], [6, 9], 4)
    with pytest.raises(LayoutError) as info:
        PageSpans.between([0, -1], [6, 9], 4)
    assert (info.value.field, info.value.request) == ("first_token", 1)
    with pytest.raises(LayoutError):
        PageSpans.between([0], [6, 9], 4)
    with pytest.raises(LayoutError) as info:
        Lengths.from_lens([3, -2], "extend_lens")
    assert (info.value.field, info.value.request) == ("extend_lens", 1)
    with pytest.raises(LayoutError) as info:  # the mask's columns are not the keys read
        PagedPart.over(spans, causal=False, window_left=-1,
                       mask=ThresholdMask.from_arrays([1, 1], [6, 4], [0, 0]))  # fmt: skip
    assert info.value.field == "mask"
    with pytest.raises(FieldTypeError):
        PagedPart.over(spans, causal=1, window_left=-1)
    with pytest.raises(LayoutError) as info:
        PagedPart.over(spans, causal=True, window_left=-2)
    assert info.value.field == "window_left"
    part = PagedPart.over(spans, causal=True, window_left=-1)
    group = fp.AttentionGroup()
    with pytest.raises(LayoutError) as info:  # a paged path without its paged call
        GroupPlan.of(group, KernelPath.PAGED, paged=None, ragged=None,
                     key_start=[0, 0], num_keys=[6, 9])  # fmt: skip
    assert info.value.field == "paged"
    plan = GroupPlan.of(group, KernelPath.PAGED, paged=part, ragged=None,
                        key_start=[0, 0], num_keys=[6, 9])  # fmt: skip
    spec = fp.plan(BatchLayout.extend([6, 9], [5, 8], page_size=4), HEADS, extend_path="paged")
    kwargs: dict[str, Any] = {
        "prefix_lens": [5, 8], "decoder_start": [0, 0], "position_runs": spec.position_runs,
        "encoder": None, "pages_needed": [2, 3],
    }  # fmt: skip
    assert PlanSpec.of(spec.key, spec.queries, group_plans=[plan], **kwargs) == spec
    with pytest.raises(LayoutError) as info:
        PlanSpec.of(spec.key, spec.queries, group_plans=[plan, plan], **kwargs)
    assert info.value.field == "group_plans"
    with pytest.raises(LayoutError) as info:  # one position per query
        PlanSpec.of(spec.key, Lengths.from_lens([2, 1]), group_plans=[plan], **kwargs)
    assert info.value.field == "position_runs"
    with pytest.raises(FieldTypeError):
        PlanSpec.of(spec.key, [1, 1], group_plans=[plan], **kwargs)  # type: ignore[arg-type]


@given(
    st.lists(st.one_of(st.integers(0, 40), st.integers(INT32_MAX // 3, INT32_MAX)), max_size=12),
    st.sampled_from([np.int32, np.int64]),
)
@example([INT32_MAX, INT32_MAX, 2], np.int32)  # 2**32: the int32 end reads 0, not negative
@example([INT32_MAX, 1], np.int32)
def test_indptr_equals_a_python_running_sum_and_refuses_a_total_beyond_int32(
    lengths: list[int], dtype: type
) -> None:
    """``indptr`` (summed in int32 for int32 lengths: a wrap reads negative) gives the
    running sum of Python integers, and raises exactly when the total passes int32."""
    values = np.array(lengths, dtype=dtype)
    want = [0]
    for n in lengths:
        want.append(want[-1] + n)
    if want[-1] > INT32_MAX:
        with pytest.raises(LayoutError, match="total exceeds int32") as err:
            indptr(values, "pages")
        assert err.value.field == "pages"
        assert f"total={want[-1]}" in str(err.value)
        return
    got = indptr(values, "pages")
    assert got.dtype == np.int32 and not got.flags.writeable
    assert got.tolist() == want
