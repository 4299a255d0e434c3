"""Multi-item scoring: delimiters -> FlashInfer's multi-item tensors, positions, visibility.

Expected values come from the semantics (DESIGN §2, docs/semantics.md) stated token by
token here, never from the planner: the in-item position of a token is its distance to
the last delimiter at or before it; item tokens see the prefix and their own item, a
delimiter sees only the prefix, a request without delimiters is plain causal.
"""

from __future__ import annotations

import copy
import itertools
import math
import pickle

import attrs
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashplan as fp
from flashplan import AttentionGroup, BatchLayout, HeadConfig, LayoutError
from flashplan.kernel_rules import kernel_visibility
from flashplan.layout.batch import MAX_ITEM_ROW
from flashplan.layout.items import ItemDelimiters
from flashplan.lengths import PageSpans
from flashplan.oracle import dense_attention, visibility
from flashplan.planning import KernelPath, PagedPart
from flashplan.planning.items import MultiItemTensors, plan_items
from flashplan.testing import item_requests, multi_item_layouts, page_tables

HEADS = HeadConfig(num_qo_heads=4, num_kv_heads=2, head_dim=64)
PAGE_SIZES = (1, 2, 3, 16)


# --------------------------------------------------------------------------- brute force
def brute_force(layout: BatchLayout) -> dict[str, list]:
    """The multi-item tensors and positions of ``layout``, request by request, token by
    token, from the definitions."""
    items = layout.item_delimiters
    assert items is not None
    out: dict[str, list] = {"prefix_len": [], "rows": [], "max_item_len": [], "positions": []}
    for i in range(layout.batch_size):
        p, e, s = (int(a[i]) for a in (layout.prefix_lens, layout.extend_lens, layout.seq_lens))
        d = items.request(i).tolist()
        if not d:
            out["prefix_len"].append(s)
            out["rows"].append([])
            out["max_item_len"].append(0)
            out["positions"] += [p + j for j in range(e)]
            continue
        row = []
        last = None
        for j in range(d[0], e):
            if j in d:
                last = j
            assert last is not None
            row.append(j - last)
        prefix_len = p + d[0]
        out["prefix_len"].append(prefix_len)
        out["rows"].append(row)
        out["max_item_len"].append(max(row))
        out["positions"] += [p + j for j in range(d[0])]
        out["positions"] += [max(prefix_len + t - 1, 0) for t in row]
    return out


def check_tensors(layout: BatchLayout, spec: fp.PlanSpec) -> None:
    want = brute_force(layout)
    stride = max((len(r) for r in want["rows"]), default=0)
    assert spec.positions.dtype == np.int32
    assert spec.positions.tolist() == want["positions"]
    for gp in spec.group_plans:
        if gp.group.cross_attention:
            assert gp.items is None
            continue
        it = gp.items
        assert it is not None
        assert it.prefix_len_ptr.dtype == np.uint32 and it.prefix_len_ptr.shape == (
            layout.batch_size,
        )
        assert it.token_pos_in_items.dtype == np.uint16
        assert it.max_item_len.dtype == np.uint16
        assert it.token_pos_in_items_len == stride
        assert it.token_pos_in_items.shape == (layout.batch_size * stride,)
        assert it.prefix_len_ptr.tolist() == want["prefix_len"]
        # each row, then zeros up to the common length (padding)
        padded = [r + [0] * (stride - len(r)) for r in want["rows"]]
        assert it.rows.tolist() == padded
        assert it.max_item_len.tolist() == want["max_item_len"]
        for arr in (it.prefix_len_ptr, it.token_pos_in_items, it.max_item_len):
            assert not arr.flags.writeable


def check_visibility(layout: BatchLayout, spec: fp.PlanSpec) -> None:
    for g in layout.groups:
        got, want = fp.materialize(spec, g), visibility(layout, g)
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert a.shape == b.shape
            if not np.array_equal(a, b):
                diff = np.argwhere(a != b)[:8].tolist()
                pytest.fail(f"group {g.describe()} request {i}: differ at (query, key) {diff}")


def plain_visibility(layout: BatchLayout, i: int) -> np.ndarray:
    p, e, s = (int(a[i]) for a in (layout.prefix_lens, layout.extend_lens, layout.seq_lens))
    return np.arange(s)[None, :] <= p + np.arange(e)[:, None]


# --------------------------------------------------------------------------- properties
@settings(max_examples=60)
@given(multi_item_layouts(), st.sampled_from(("auto", "paged")))
def test_materialize_equals_oracle_and_tensors(layout: BatchLayout, path: str) -> None:
    spec = fp.plan(layout, HEADS, extend_path=path)
    assert spec.key.multi_item
    for gp in spec.group_plans:
        assert gp.path is KernelPath.PAGED and gp.ragged is None
        assert gp.paged is not None and gp.paged.window_left == -1 and gp.paged.mask is None
    check_visibility(layout, spec)
    check_tensors(layout, spec)


@settings(max_examples=25)
@given(
    st.data(),
    st.sampled_from(("first", "middle", "last")),
    st.sampled_from(PAGE_SIZES),
    st.booleans(),
)
def test_mixed_batch_plain_request(
    data: st.DataObject, where: str, page_size: int, with_prefix: bool
) -> None:
    """A request without delimiters, first, in the middle or last: one row of its own,
    prefix_len = seq_len, zeros, max_item_len 0, plain causal keys and positions; the
    other requests keep their own rows (the reference file shifts them)."""
    reqs = data.draw(
        st.lists(item_requests(with_prefix=with_prefix), min_size=2, max_size=4), label="items"
    )
    plain_seq = data.draw(st.integers(0, 30), label="plain seq")
    plain_pre = data.draw(st.integers(0, plain_seq), label="plain prefix") if with_prefix else 0
    at = {"first": 0, "middle": 1, "last": len(reqs)}[where]
    reqs.insert(at, (plain_seq, plain_pre, None))
    layout = BatchLayout.extend(
        [r[0] for r in reqs],
        [r[1] for r in reqs],
        page_size=page_size,
        item_delimiters=[r[2] for r in reqs],
    )
    spec = fp.plan(layout, HEADS)
    it = spec.group_plans[0].items
    assert it is not None
    assert int(it.prefix_len_ptr[at]) == plain_seq
    assert not it.rows[at].any() and int(it.max_item_len[at]) == 0
    q0, q1 = int(spec.qo_indptr[at]), int(spec.qo_indptr[at + 1])
    assert spec.positions[q0:q1].tolist() == list(range(plain_pre, plain_seq))
    seen = fp.materialize(spec, layout.groups[0])[at]
    assert np.array_equal(seen, plain_visibility(layout, at))
    # Every other request reads its own row: rows are indexed by request.
    for i, (_, _, d) in enumerate(reqs):
        if d is not None:
            assert int(it.prefix_len_ptr[i]) == int(layout.prefix_lens[i]) + d[0]
    check_tensors(layout, spec)
    check_visibility(layout, spec)


# --------------------------------------------------------------------------- examples
def test_flashinfer_docstring_example_3_2_4() -> None:
    """Items of lengths 3, 2, 4, each after a delimiter, and a closing delimiter."""
    # prompt of 5 tokens, then <d> a a a <d> b b <d> c c c c <d>
    layout = BatchLayout.extend([18], item_delimiters=[[5, 9, 12, 17]])
    it, runs = plan_items(layout)
    positions = runs.positions()
    assert it.rows.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4, 0]]
    assert it.token_pos_in_items_len == 13
    assert it.prefix_len_ptr.tolist() == [5] and it.max_item_len.tolist() == [4]
    assert positions.tolist() == [0, 1, 2, 3, 4, 4, 5, 6, 7, 4, 5, 6, 4, 5, 6, 7, 8, 4]
    # Padded to 20 as in FlashInfer's plan() docstring: 7 more zeros (8 at the end).
    padded = MultiItemTensors.from_rows(
        it.prefix_len_ptr, np.concatenate([it.rows[0], np.zeros(7, np.uint16)]), 20, it.max_item_len
    )
    assert padded.rows[0].tolist()[-8:] == [0] * 8
    assert it.item_start.tolist() == padded.item_start.tolist() == [1, 5, 8]
    assert it.item_length.tolist() == padded.item_length.tolist() == [3, 2, 4]


def test_reference_case_1_single_sequence() -> None:
    # What is the capital of France ? <d> London <d> Paris <d> Berlin <d>
    layout = BatchLayout.extend([14], item_delimiters=[[7, 9, 11, 13]])
    spec = fp.plan(layout, HEADS)
    it = spec.group_plans[0].items
    assert it is not None
    assert it.prefix_len_ptr.tolist() == [7]
    assert it.token_pos_in_items.tolist() == [0, 1, 0, 1, 0, 1, 0]
    assert it.token_pos_in_items_len == 7
    assert it.max_item_len.tolist() == [1]
    # Each answer is positioned as if it came right after the question.
    assert spec.positions.tolist() == [0, 1, 2, 3, 4, 5, 6, 6, 7, 6, 7, 6, 7, 6]
    seen = fp.materialize(spec, layout.groups[0])[0]
    assert seen[8].nonzero()[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 8]  # London: prompt + itself
    assert seen[7].nonzero()[0].tolist() == list(range(7))  # a delimiter: the prompt only
    check_visibility(layout, spec)


def test_reference_case_2_batch_of_two() -> None:
    # seq 1: a 3-token prompt, items of 2 and 1; seq 2: a 2-token prompt, items of 1, 3, 2
    layout = BatchLayout.extend([9, 12], item_delimiters=[[3, 6, 8], [2, 4, 8, 11]])
    spec = fp.plan(layout, HEADS)
    it = spec.group_plans[0].items
    assert it is not None
    row0, row1 = [0, 1, 2, 0, 1, 0, 0, 0, 0, 0], [0, 1, 0, 1, 2, 3, 0, 1, 2, 0]
    assert it.token_pos_in_items.tolist() == [*row0, *row1]
    assert it.token_pos_in_items_len == 10
    assert it.max_item_len.tolist() == [2, 3]
    assert it.prefix_len_ptr.tolist() == [3, 2]
    check_visibility(layout, spec)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize(
    ("seq", "prefix", "delims", "row", "longest"),
    [
        (6, 0, [1, 3, 5], [0, 1, 0, 1, 0], 1),  # items of length 1, delimiter last
        (7, 0, [2, 3, 4], [0, 0, 0, 1, 2], 2),  # two adjacent delimiters (empty items)
        (5, 0, [0], [0, 1, 2, 3, 4], 4),  # delimiter first: no prompt, empty prefix
        (9, 4, [0, 2], [0, 1, 0, 1, 2], 2),  # cached prefix P = 4, delimiter first
        (12, 5, [3, 6], [0, 1, 2, 0], 2),  # cached prefix and a prompt: prefix_len 8
        (3, 0, [2], [0], 0),  # only a closing delimiter: max_item_len 0
    ],
)
def test_edge_requests(
    page_size: int, seq: int, prefix: int, delims: list[int], row: list[int], longest: int
) -> None:
    layout = BatchLayout.extend([seq], [prefix], page_size=page_size, item_delimiters=[delims])
    spec = fp.plan(layout, HEADS)
    it = spec.group_plans[0].items
    assert it is not None
    assert it.rows.tolist() == [row]
    assert it.prefix_len_ptr.tolist() == [prefix + delims[0]]
    assert it.max_item_len.tolist() == [longest]
    check_tensors(layout, spec)
    check_visibility(layout, spec)
    if prefix + delims[0] == 0:
        # An empty prefix: the first delimiter sees nothing (output 0, LSE -inf) and
        # sits at position 0, never -1.
        assert not fp.materialize(spec, layout.groups[0])[0][0].any()
        assert int(spec.positions[0]) == 0


def test_batch_without_any_delimiter_is_causal() -> None:
    layout = BatchLayout.extend([5, 0, 7], [1, 0, 7], item_delimiters=[None, [], None])
    spec = fp.plan(layout, HEADS)
    assert spec.key.multi_item and spec.key.paths == (KernelPath.PAGED,)
    it = spec.group_plans[0].items
    assert it is not None and it.token_pos_in_items_len == 0 and it.token_pos_in_items.size == 0
    assert it.prefix_len_ptr.tolist() == [5, 0, 7]
    assert spec.positions.tolist() == [1, 2, 3, 4]
    plain = fp.plan(BatchLayout.extend([5, 0, 7], [1, 0, 7]), HEADS, extend_path="paged")
    for a, b in zip(
        fp.materialize(spec, layout.groups[0]), fp.materialize(plain, layout.groups[0]), strict=True
    ):
        assert np.array_equal(a, b)
    assert spec.key != plain.key  # the key says multi-item; the batch's contents do not


def test_empty_multi_item_batch() -> None:
    layout = BatchLayout.extend([], item_delimiters=[])
    spec = fp.plan(layout, HEADS)
    it = spec.group_plans[0].items
    assert it is not None and it.batch_size == 0 and it.token_pos_in_items_len == 0


def test_encoder_and_cross_group() -> None:
    """Self groups start at the page after the encoder; cross groups ignore items."""
    groups = (AttentionGroup.full(logits_soft_cap=30.0), AttentionGroup.cross())
    for ps in PAGE_SIZES:
        layout = BatchLayout.extend(
            [14, 9], [0, 3], page_size=ps, groups=groups, encoder_lens=[5, 0],
            item_delimiters=[[7, 9, 11, 13], [1, 3]],
        )  # fmt: skip
        spec = fp.plan(layout, HEADS)
        gp_self, gp_cross = spec.group_plans
        assert gp_self.items is not None and gp_cross.items is None
        assert gp_cross.path is KernelPath.PAGED and not gp_cross.paged.causal  # type: ignore[union-attr]
        check_visibility(layout, spec)
        check_tensors(layout, spec)


# --------------------------------------------------------------------------- limits
def test_uint16_limit_itself() -> None:
    """65535 tokens from the first delimiter on are planned; 65536 are refused."""
    ok = BatchLayout.extend([3 + MAX_ITEM_ROW], [3], item_delimiters=[[0]])
    it, _ = plan_items(ok)
    assert it.token_pos_in_items_len == 65535
    assert int(it.max_item_len[0]) == 65534 == int(it.rows[0, -1])
    # a second request pushes over the limit, a plain third one does not matter
    with pytest.raises(LayoutError) as err:
        BatchLayout.extend([9, 3 + 65536, 70000], [0, 3, 0], item_delimiters=[[2], [0], None])
    assert err.value.field == "item_delimiters" and err.value.request == 1
    assert err.value.values["token_pos_in_items_len"] == 65536
    # the limit counts from the first delimiter: a long prompt is fine
    long_prompt = BatchLayout.extend([100_000], item_delimiters=[[100_000 - 5]])
    assert plan_items(long_prompt)[0].token_pos_in_items_len == 5


def test_an_item_of_65535_tokens_is_refused() -> None:
    """Its last token's position, 65535, would fit uint16, but its row (delimiter + item)
    is 65536 long: the row bound is the binding one."""
    with pytest.raises(LayoutError) as err:
        BatchLayout.extend([1 + 65535], item_delimiters=[[0]])
    assert err.value.request == 0 and err.value.values["token_pos_in_items_len"] == 65536


# --------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    ("delims", "index", "word"),
    [
        ([[1, 3], [4, 2]], 1, "sorted"),
        ([[1, 3], [2, 2, 5]], 1, "repeat"),
        ([[-1, 3], [2]], 0, ">= 0"),
        ([[1, 3], [2, 9]], 1, "below"),  # request 1 has 9 new tokens: 9 is out of range
        ([[1], [2.5]], 1, "integers"),
        ([[1], ["3"]], 1, "integers"),
        ([[True], [2]], 0, "bools"),
        ([[1], 7], 1, "sequence"),
        ([[1], "12"], 1, "sequence"),
        ([[1], np.array([[1, 2]])], 1, "1-D"),
    ],
)
def test_invalid_delimiters_name_the_request(delims: list, index: int, word: str) -> None:
    with pytest.raises(LayoutError) as err:
        BatchLayout.extend([10, 12], [0, 3], item_delimiters=delims)
    assert err.value.field == "item_delimiters"
    assert err.value.request == index, str(err.value)
    assert word in str(err.value)
    assert str(err.value).startswith(f"item_delimiters[{index}]:")


def test_other_refusals() -> None:
    with pytest.raises(LayoutError, match="batch size") as err:
        BatchLayout.extend([10, 12], item_delimiters=[[1]])
    assert err.value.field == "item_delimiters" and err.value.request is None
    with pytest.raises(LayoutError, match="decode") as err:
        BatchLayout.of(fp.Mode.DECODE, [5], [4], item_delimiters=[[0]])
    assert err.value.field == "item_delimiters"
    for group in (AttentionGroup.sliding(8), AttentionGroup.bidirectional()):
        with pytest.raises(LayoutError) as err:
            BatchLayout.extend([10], groups=(AttentionGroup(), group), item_delimiters=[[3]])
        assert err.value.field == "groups"
    with pytest.raises(LayoutError, match="window"):
        BatchLayout.extend([10], groups=AttentionGroup.sliding(0), item_delimiters=[None])
    layout = BatchLayout.extend([10], item_delimiters=[[3]])
    with pytest.raises(LayoutError, match="paged prefill only") as err:
        fp.plan(layout, HEADS, extend_path="ragged")
    assert err.value.field == "extend_path"
    with pytest.raises(LayoutError, match="host data"):
        BatchLayout.extend([10], item_delimiters=[torch.tensor([3], device="meta")])


def test_multi_item_tensors_refuse_a_short_max_item_len() -> None:
    with pytest.raises(LayoutError, match="max_item_len") as err:
        MultiItemTensors.from_rows([3, 2], [0, 1, 2, 0, 0, 1], 3, [2, 0])
    assert err.value.request == 1
    with pytest.raises(LayoutError, match="uint16"):
        MultiItemTensors.from_rows([3], [0, 70000], 2, [1])
    with pytest.raises(LayoutError, match="entries"):
        MultiItemTensors.from_rows([3], [0, 1, 2], 2, [2])
    items = MultiItemTensors.from_rows([3], [0, 1, 0], 3, [1])
    with pytest.raises(LayoutError, match="cover"):  # 5 keys from prefix_len 3 need 2, not 6
        PagedPart.over(PageSpans.between([0], [10], 4), causal=True, window_left=-1, items=items)


@settings(max_examples=60)
@given(multi_item_layouts())
def test_items_form_round_trips(layout: BatchLayout) -> None:
    """The items and the dense array say the same thing: the dense array built from the
    items has 1, 2, … over each item and 0 elsewhere, and parsing it gives the items."""
    it = plan_items(layout)[0]
    dense = it.token_pos_in_items
    want = np.zeros(dense.shape[0], dtype=np.int64)
    for s0, n in zip(it.item_start.tolist(), it.item_length.tolist(), strict=True):
        assert n >= 1 and all(want[s0 : s0 + n] == 0)
        want[s0 : s0 + n] = np.arange(1, n + 1)
    assert dense.tolist() == want.tolist()
    again = MultiItemTensors.from_rows(
        it.prefix_len_ptr, dense, it.token_pos_in_items_len, it.max_item_len
    )
    assert again == it and hash(pickle.dumps(again)) is not None
    # the planner stores its tensors as they are; from_items checks the same arrays
    checked = MultiItemTensors.from_items(
        it.prefix_len_ptr, it.token_pos_in_items_len, it.max_item_len, it.item_start,
        it.item_length,
    )  # fmt: skip
    assert checked == it and hash(checked) == hash(it)
    listed = MultiItemTensors.from_items(
        it.prefix_len_ptr.tolist(), it.token_pos_in_items_len, it.max_item_len.tolist(),
        it.item_start.tolist(), it.item_length.tolist(),
    )  # fmt: skip
    assert listed == it
    for i in range(layout.batch_size):
        alone = it.request(i)
        assert alone.rows.tolist() == [it.rows[i].tolist()]
        fields = [getattr(alone, f.name) for f in attrs.fields(MultiItemTensors)]
        assert MultiItemTensors.from_items(*fields) == alone  # valid as the batch's are
        assert all(not a.flags.writeable for a in fields if isinstance(a, np.ndarray))


def test_multi_item_tensors_refuse_bad_items() -> None:
    """Items that overlap, leave their row, sit on a delimiter column or are empty are
    refused naming the item and its request; a dense array not of the multi-item form is
    refused naming the request and column."""
    ok = MultiItemTensors.from_items([3, 2], 4, [3, 2], [1, 5], [3, 2])
    assert ok.rows.tolist() == [[0, 1, 2, 3], [0, 1, 2, 0]] and ok.max_length == 3
    bad = [
        (([3, 2], 4, [3, 2], [1, 5], [3, 0]), "item_length", 1, 1),  # empty
        (([3, 2], 4, [3, 2], [1, 5], [4, 2]), "item_length", 0, 0),  # runs past its row
        (([3, 2], 4, [3, 2], [1, 4], [3, 2]), "item_start", 1, 1),  # on column 0
        (([3, 2], 4, [3, 2], [1, 9], [3, 2]), "item_start", 1, None),  # past the rows
        (([3, 2], 4, [3, 2], [2, 1], [2, 1]), "item_start", 1, 0),  # overlap, descending
        (([3, 2], 4, [3, 1], [1, 5], [3, 2]), "max_item_len", 1, 1),  # too short
        (([3, 2], 0, [3, 2], [1], [1]), "item_start", 0, None),  # rows of length 0
    ]
    for args, field, item, request in bad:
        with pytest.raises(LayoutError) as err:
            MultiItemTensors.from_items(*args)
        assert err.value.field == field, args
        assert err.value.request == request, args
        if field != "max_item_len":
            assert err.value.values["item"] == item, args
    with pytest.raises(LayoutError, match="one entry per item"):
        MultiItemTensors.from_items([3], 4, [3], [1, 2], [1])
    with pytest.raises(LayoutError, match="int32"):
        MultiItemTensors.from_items([3] * 2, 2**30 + 1, [3] * 2, [], [])
    # the converters: dtypes and ranges, named by field and entry
    with pytest.raises(LayoutError, match="uint16") as err:
        MultiItemTensors.from_items([3], 4, [70000], [1], [3])
    assert err.value.field == "max_item_len" and err.value.request == 0
    with pytest.raises(LayoutError, match="int32") as err:
        MultiItemTensors.from_items([3], 4, [3], [2**31], [3])
    assert err.value.field == "item_start" and err.value.values["item"] == 0
    with pytest.raises(LayoutError, match="1-D integer") as err:
        MultiItemTensors.from_items([3.0], 4, [3], [1], [3])
    assert err.value.field == "prefix_len_ptr"
    with pytest.raises(fp.FieldTypeError) as type_err:
        MultiItemTensors.from_items([3], 4.0, [3], [1], [3])
    assert type_err.value.field == "token_pos_in_items_len"
    for dense, request, column in (
        ([0, 1, 3, 0, 0, 0, 0, 0], 0, 2),  # 3 after 1
        ([0, 1, 2, 0, 1, 0, 0, 0], 1, 0),  # column 0 must be a delimiter
        ([0, 1, 2, 0, 0, 0, 0, 2], 1, 3),  # 2 after 0
    ):
        with pytest.raises(LayoutError, match="one more than") as err:
            MultiItemTensors.from_rows([3, 2], dense, 4, [3, 3])
        assert (err.value.request, err.value.values["column"]) == (request, column)


def test_kernel_rule_hides_keys_a_short_max_item_len_would_skip() -> None:
    """With max_item_len too small, FlashInfer skips tiles holding visible keys; the rule
    says so (which is why the planner's max_item_len is never below the row's largest)."""
    qo, kv = np.array([6]), np.array([6])
    right = MultiItemTensors.from_rows([1], [0, 1, 2, 3, 4], 5, [4])
    full = kernel_visibility(qo, kv, 6, 6, causal=True, window_left=-1, items=right)[0]
    assert full[5].nonzero()[0].tolist() == [0, 2, 3, 4, 5]
    short = attrs.evolve(right)  # bypass the check on purpose
    object.__setattr__(short, "max_item_len", np.array([1], np.uint16))
    short = kernel_visibility(qo, kv, 6, 6, causal=True, window_left=-1, items=short)[0]
    assert short[5].nonzero()[0].tolist() == [0, 4, 5]


# --------------------------------------------------------------------------- records
def test_item_delimiters_inputs_and_records() -> None:
    lists = [[7, 9, 11, 13], None, [0, 2]]
    a = ItemDelimiters.from_lists(lists)
    b = ItemDelimiters(indptr=[0, 4, 4, 6], positions=np.array([7, 9, 11, 13, 0, 2]))
    c = ItemDelimiters.from_lists([torch.tensor([7, 9, 11, 13]), None, torch.tensor([0, 2])])
    d = ItemDelimiters.from_lists([np.array([7, 9, 11, 13]), [], (0, 2)])
    assert a == b == c == d and len({a, b, c, d}) == 1
    assert a.to_lists() == [[7, 9, 11, 13], [], [0, 2]]
    assert a.first.tolist() == [7, -1, 0] and a.last.tolist() == [13, -1, 2]
    for arr in (a.positions, a.indptr):
        assert arr.dtype == np.int32 and not arr.flags.writeable
    layout = BatchLayout.extend([14, 3, 5], item_delimiters=b)
    assert layout == BatchLayout.extend([14, 3, 5], item_delimiters=lists)
    assert layout != BatchLayout.extend([14, 3, 5])
    assert layout != BatchLayout.extend([14, 3, 5], item_delimiters=[[7, 9, 11], None, [0, 2]])
    for clone in (pickle.loads(pickle.dumps(layout)), copy.deepcopy(layout)):
        assert clone == layout and hash(clone) == hash(layout)
        assert clone.item_delimiters is not None
        assert not clone.item_delimiters.positions.flags.writeable
    spec = fp.plan(layout, HEADS)
    clone = pickle.loads(pickle.dumps(spec))
    assert clone == spec
    assert not clone.group_plans[0].items.token_pos_in_items.flags.writeable  # type: ignore[union-attr]
    with pytest.raises(LayoutError, match="indptr"):
        ItemDelimiters(indptr=[0, 2], positions=[1])
    with pytest.raises(LayoutError, match="indptr"):
        ItemDelimiters(indptr=[1, 2], positions=[1])
    assert ItemDelimiters.none(3).counts.tolist() == [0, 0, 0]
    # from_extend_lens forwards the delimiters
    assert BatchLayout.from_extend_lens([14], [2], item_delimiters=[[7]]).is_multi_item


def test_plan_key_depends_on_multi_item_only() -> None:
    a = fp.plan(BatchLayout.extend([14, 5], item_delimiters=[[7, 9], None]), HEADS).key
    b = fp.plan(BatchLayout.extend([30, 2], [4, 0], item_delimiters=[None, [0]]), HEADS).key
    assert a == b and hash(a) == hash(b) and a.multi_item


# --------------------------------------------------------------------------- reference executor
@settings(max_examples=30, deadline=None)
@given(
    layout=multi_item_layouts(
        min_batch=1, max_batch=4, max_prompt=8, max_items=4, max_item_len=4, max_len=24
    ),
    dtype=st.sampled_from((torch.float32, torch.bfloat16)),
    gqa=st.sampled_from(((2, 2), (4, 2), (4, 1))),
    seed=st.integers(0, 2**31 - 1),
    data=st.data(),
)
def test_reference_executor_matches_dense_float64(
    layout: BatchLayout,
    dtype: torch.dtype,
    gqa: tuple[int, int],
    seed: int,
    data: st.DataObject,
) -> None:
    """The reference executor (FlashInfer's multi-item rule on the plan's tensors) equals
    float64 attention over the oracle's keys (the rule stated from the delimiters)."""
    hq, hkv = gqa
    heads = HeadConfig(hq, hkv, 16, q_dtype=dtype)
    spec = fp.plan(layout, heads)
    table, pool = data.draw(page_tables(spec))
    ex = fp.ReferenceExecutor()
    ex.apply(spec, table)
    gen = torch.Generator().manual_seed(seed)
    qo = spec.qo_indptr.tolist()
    for group in layout.groups:
        cache = torch.randn(pool, 2, layout.page_size, hkv, 16, generator=gen).to(dtype)
        q = torch.randn(spec.total_q, hq, 16, generator=gen).to(dtype)
        rows = spec.total_encoder if group.cross_attention else spec.total_q
        k_new = torch.randn(rows, hkv, 16, generator=gen).to(dtype)
        v_new = torch.randn(rows, hkv, 16, generator=gen).to(dtype)
        out, lse = ex.run(group, q, k_new, v_new, cache, return_lse=True)
        ref_out, ref_lse = [], []
        for i, seen in enumerate(visibility(layout, group)):
            k, v = _keys(layout, group, table, cache, i)
            o, s = dense_attention(q[qo[i] : qo[i + 1]], k, v, seen, group)
            ref_out.append(o)
            ref_lse.append(s)
        want_out, want_lse = torch.cat(ref_out), torch.cat(ref_lse)
        if out.numel():
            err = (out.double() - want_out).abs().max() / want_out.abs().max().clamp_min(1e-6)
            assert err <= (1e-4 if dtype == torch.float32 else 1e-2), (group, float(err))
        finite = torch.isfinite(want_lse)
        assert torch.equal(torch.isfinite(lse), finite)
        assert torch.allclose(lse.double()[finite], want_lse[finite], atol=1e-3, rtol=1e-4)


def _keys(
    layout: BatchLayout,
    group: AttentionGroup,
    table: fp.PageTable,
    cache: torch.Tensor,
    i: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Request i's keys and values of the group's key space, read from the cache."""
    ps = layout.page_size
    if group.cross_attention:
        assert layout.encoder_lens is not None
        tokens = np.arange(int(layout.encoder_lens[i]))
    else:
        enc = 0 if layout.encoder_lens is None else int(layout.encoder_lens[i])
        tokens = math.ceil(enc / ps) * ps + np.arange(int(layout.seq_lens[i]))
    page = table.pages[int(table.rows[i]), torch.from_numpy(tokens // ps)].long()
    slot = torch.from_numpy(tokens % ps)
    return cache[page, 0, slot], cache[page, 1, slot]


# --------------------------------------------------------------------------- strategies
def _gaps(d: list[int]) -> list[int]:
    return [b - a for a, b in itertools.pairwise(d)]


def _any_request(lay: BatchLayout, cond: object) -> bool:
    items = lay.item_delimiters
    assert items is not None
    for i in range(lay.batch_size):
        d = items.request(i).tolist()
        if cond(d, int(lay.extend_lens[i]), int(lay.prefix_lens[i])):  # type: ignore[operator]
            return True
    return False


@pytest.mark.parametrize(
    "condition",
    [
        # items of length 1 (two delimiters 2 apart)
        lambda lay: _any_request(lay, lambda d, e, p: 2 in _gaps(d)),
        # two adjacent delimiters
        lambda lay: _any_request(lay, lambda d, e, p: 1 in _gaps(d)),
        # a delimiter as the last token, and one as the first new token
        lambda lay: _any_request(lay, lambda d, e, p: bool(d) and d[-1] == e - 1),
        lambda lay: _any_request(lay, lambda d, e, p: bool(d) and d[0] == 0),
        # a cached prefix before the items, and a plain request beside them
        lambda lay: _any_request(lay, lambda d, e, p: bool(d) and p > 0),
        lambda lay: (
            _any_request(lay, lambda d, e, p: not d) and _any_request(lay, lambda d, e, p: bool(d))
        ),
        lambda lay: lay.page_size == 3 and lay.encoder_lens is not None,
    ],
)
def test_multi_item_strategy_reaches_the_edge_cases(condition: object) -> None:
    from hypothesis import find

    find(
        multi_item_layouts(),
        condition,  # type: ignore[arg-type]
        settings=settings(max_examples=500, database=None, derandomize=True),
    )
