"""The planner's trusted construction paths give the records the validated ones give.

``BatchLayout.decode`` (without encoder) and ``plan()`` build their records through
private ``_from_checked`` class methods that skip converters and checks, and preset some
cached properties. Every record they make must equal the one the public constructors
make from the same fields, with equal derived arrays (read-only int32), and user input
must still be refused with the same errors.
"""

from __future__ import annotations

import pickle
from typing import Any

import attrs
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import flashplan as fp
from flashplan.arrays import INT32_MAX
from flashplan.errors import LayoutError
from flashplan.layout.batch import BatchLayout, Mode
from flashplan.planning.masks import TreeMask
from flashplan.planning.spec import GroupPlan, PagedPart, PlanSpec, RaggedPart
from flashplan.testing import (
    attention_groups,
    decode_layouts,
    head_configs,
    layouts,
    multi_item_layouts,
    verify_layouts,
)

LAYOUT_DERIVED = (
    "extend_lens",
    "encoder_new_lens",
    "encoder_pages",
    "decoder_start",
    "pages_needed",
)
PAGED_DERIVED = (
    "start_page",
    "kv_lens",
    "num_pages",
    "last_page_len",
    "page_indptr",
    "max_kv_len",
    "total_pages",
)
SPEC_DERIVED = ("qo_lens", "write_start", "max_q_len", "total_q", "total_encoder")


def _same(a: Any, b: Any, what: str) -> None:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        assert isinstance(a, np.ndarray) and isinstance(b, np.ndarray), what
        assert a.dtype == b.dtype, what
        assert not a.flags.writeable, what
        np.testing.assert_array_equal(a, b, err_msg=what)
    else:
        assert a == b, what


def _fields(record: Any) -> dict[str, Any]:
    return {f.name: getattr(record, f.name) for f in attrs.fields(type(record))}


def _validated_layout(layout: BatchLayout) -> BatchLayout:
    return BatchLayout(**_fields(layout))


def _validated_paged(part: PagedPart) -> PagedPart:
    fields = _fields(part)
    if part.mask is not None:  # the planner builds tree masks without their converters
        again = type(part.mask)(**_fields(part.mask))
        assert part.mask == again and hash(part.mask) == hash(again)
        for name, value in _fields(part.mask).items():
            _same(value, getattr(again, name), f"mask.{name}")
        derived = ("indptr", "tail_words") if isinstance(again, TreeMask) else ("indptr",)
        for name in derived:  # a tree's packed bits are preset from its draft's
            _same(getattr(part.mask, name), getattr(again, name), f"mask.{name}")
        fields["mask"] = again
    if part.items is not None:  # and multi-item tensors without theirs
        items = type(part.items)(**_fields(part.items))
        assert part.items == items and hash(part.items) == hash(items)
        for name, value in _fields(part.items).items():
            _same(value, getattr(items, name), f"items.{name}")
        fields["items"] = items
    return PagedPart(**fields)


def _validated_group(gp: GroupPlan) -> GroupPlan:
    fields = _fields(gp)
    if gp.paged is not None:
        fields["paged"] = _validated_paged(gp.paged)
    if gp.ragged is not None:
        fields["ragged"] = RaggedPart(**_fields(gp.ragged))
    return GroupPlan(**fields)


def _validated_spec(spec: PlanSpec) -> PlanSpec:
    fields = _fields(spec)
    fields["group_plans"] = tuple(_validated_group(gp) for gp in spec.group_plans)
    return PlanSpec(**fields)


def _check_layout(layout: BatchLayout) -> None:
    again = _validated_layout(layout)
    assert layout == again and hash(layout) == hash(again)
    for name in LAYOUT_DERIVED:
        _same(getattr(layout, name), getattr(again, name), name)
    for arr in (layout.seq_lens, layout.prefix_lens):
        assert arr.dtype == np.int32 and not arr.flags.writeable


def _check_spec(spec: PlanSpec) -> None:
    again = _validated_spec(spec)
    assert spec == again and hash(spec) == hash(again)
    for name in SPEC_DERIVED:
        _same(getattr(spec, name), getattr(again, name), name)
    for field, value in _fields(spec).items():
        if isinstance(value, np.ndarray):
            assert value.dtype == np.int32 and not value.flags.writeable, field
    for mine, theirs in zip(spec.group_plans, again.group_plans, strict=True):
        for field in ("key_start", "num_keys"):
            value = getattr(mine, field)
            assert value.dtype == np.int32 and not value.flags.writeable, field
        if mine.paged is None:
            continue
        assert theirs.paged is not None
        for field in ("first_token", "end_token"):
            value = getattr(mine.paged, field)
            assert value.dtype == np.int32 and not value.flags.writeable, field
        for name in PAGED_DERIVED:
            _same(getattr(mine.paged, name), getattr(theirs.paged, name), name)
    # Pickling keeps the value (and read-only arrays).
    back = pickle.loads(pickle.dumps(spec))
    assert back == spec
    assert all(not gp.key_start.flags.writeable for gp in back.group_plans)


@given(decode_layouts(max_batch=12, encoder=False))
def test_decode_fast_path_equals_the_constructor(layout: BatchLayout) -> None:
    assert layout.mode is Mode.DECODE and layout.encoder_lens is None
    _check_layout(layout)
    # The same lengths through the validated constructor, from a plain list.
    again = BatchLayout(
        Mode.DECODE,
        layout.seq_lens.tolist(),
        (layout.seq_lens - 1).tolist(),
        page_size=layout.page_size,
        groups=layout.groups,
    )
    assert again == layout


@given(
    st.one_of(
        layouts(max_batch=12),
        decode_layouts(max_batch=12, page_sizes=(1, 3, 16, 64)),
        verify_layouts(),
        multi_item_layouts(),
    ),
    head_configs(),
)
def test_planned_records_equal_the_validated_ones(layout: BatchLayout, heads: Any) -> None:
    _check_layout(layout)
    for path in ("auto", "paged", "ragged"):
        try:
            spec = fp.plan(layout, heads, extend_path=path)
        except LayoutError:
            continue  # a path this batch cannot take (checked elsewhere)
        _check_spec(spec)


@given(
    st.lists(st.integers(1, 64), min_size=0, max_size=6),
    st.sampled_from((1, 2, 16)),
    st.lists(attention_groups(kinds=("full", "sliding")), min_size=1, max_size=3, unique=True),
)
def test_decode_plan_equals_the_constructor_path(
    seq: list[int], page_size: int, groups: list[fp.AttentionGroup]
) -> None:
    fast = BatchLayout.decode(seq, page_size=page_size, groups=groups)
    slow = BatchLayout(Mode.DECODE, seq, [s - 1 for s in seq], page_size=page_size, groups=groups)
    heads = fp.HeadConfig(4, 1, 64)
    assert fast == slow
    assert fp.plan(fast, heads) == fp.plan(slow, heads)
    _check_spec(fp.plan(fast, heads))


def test_derived_arrays_near_int32_max() -> None:
    """Spans that end at the last int32 row token: no sum may wrap."""
    first, end = [0, INT32_MAX - 5, 7, 9], [INT32_MAX, INT32_MAX, 7, 3]
    part = PagedPart(first, end, 16, True, -1)
    kv = [e - f // 16 * 16 if e > f else 0 for f, e in zip(first, end, strict=True)]
    pages = [-(-k // 16) for k in kv]
    assert part.kv_lens.tolist() == kv == [INT32_MAX, 15, 0, 0]
    assert part.num_pages.tolist() == pages
    assert part.last_page_len.tolist() == [
        k - (p - 1) * 16 if k else 0 for k, p in zip(kv, pages, strict=True)
    ]
    assert part.start_page.tolist() == [0, (INT32_MAX - 5) // 16, 0, 0]
    layout = BatchLayout.decode([INT32_MAX, 1], page_size=1 << 20)
    assert layout.pages_needed.tolist() == [(INT32_MAX >> 20) + 1, 1]
    _check_spec(fp.plan(layout, fp.HeadConfig(4, 1, 64)))


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
    slow = _error(lambda: BatchLayout(Mode.DECODE, seq, [2, 4], **kwargs))
    assert fast == slow


@pytest.mark.parametrize(
    ("seq", "index"), [([3, 0], 1), ([3, -1], 1), ([True, 2], 0), ([1, 2**31], 1), ([1.5], 0)]
)
def test_decode_names_the_bad_request(seq: list[Any], index: int) -> None:
    _, message = _error(lambda: BatchLayout.decode(seq, page_size=16))
    assert message.startswith(f"seq_lens[{index}]: ")
