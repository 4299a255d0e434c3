"""Custom-mask records: ``ThresholdMask.from_arrays`` and ``TreeMask.from_bits`` convert and
check what ``__init__`` (the planner's path) stores as given, and a tree's draft bits are
stored packed (``tail_words``), ``tail_bits`` being their unpack.

Expected bits come from the draft tree itself (``DraftTree.ancestors`` and ``depth``),
never from the mask.
"""

from __future__ import annotations

import copy
import pickle
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import flashplan as fp
from flashplan import LayoutError
from flashplan.planning.masks import ThresholdMask, TreeMask, pack_tail_bits
from flashplan.testing import verify_layouts

HEADS = fp.HeadConfig(num_qo_heads=4, num_kv_heads=2, head_dim=64)


def _fields(record: Any) -> list[Any]:
    return [getattr(record, f.name) for f in record.__attrs_attrs__]


# --------------------------------------------------------------------------- packing


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 3), st.integers(0, 20), st.randoms(use_true_random=False))
def test_pack_tail_bits_round_trips(bs: int, n: int, rnd: Any) -> None:
    rng = np.random.default_rng(rnd.getrandbits(32))
    bits = rng.random((bs, n, n)) < 0.5
    words = pack_tail_bits(bits)
    assert words.dtype == np.uint8 and words.shape == (bs, n, (n + 7) // 8)
    assert not words.flags.writeable and words.flags.c_contiguous
    for i, t, a in np.ndindex(bits.shape):  # draft key a is bit a % 8 of byte a // 8
        assert bool(words[i, t, a // 8] >> (a % 8) & 1) == bits[i, t, a]
    if n % 8:  # the padding bits are 0
        assert not (words[..., -1] >> (n % 8)).any()
    full = np.full(bs, n, dtype=np.int32)  # (an empty list is float: refused)
    mask = TreeMask.from_bits(
        full, full + 2, full * 0, np.zeros((bs, n), np.int32), full * 0 + 1, bits
    )
    assert mask.tail_words.tolist() == words.tolist()
    back = mask.tail_bits
    assert back.dtype == np.bool_ and back.shape == (bs, n, n) and not back.flags.writeable
    np.testing.assert_array_equal(back, bits)
    for i in range(bs):
        assert (mask.dense(i)[:, 1 : 1 + n] == bits[i]).all()


# --------------------------------------------------------------------------- ThresholdMask


def test_threshold_mask_from_arrays_converts() -> None:
    qo = np.array([2, 3], dtype=np.int64)  # writable, of another dtype: copied
    m = ThresholdMask.from_arrays(qo, [5, 4], [2, -1])
    assert (m.qo_lens.dtype, m.kv_lens.dtype, m.first_visible.dtype) == (
        np.int32, np.int32, np.int64,
    )  # fmt: skip
    assert all(not a.flags.writeable for a in _fields(m))
    qo[0] = 7
    assert m.qo_lens.tolist() == [2, 3]
    assert m.dense(0).astype(int).tolist() == [[0, 0, 1, 1, 1], [0, 0, 0, 1, 1]]
    assert m.indptr.tolist() == [0, 2, 4]
    # __init__ stores the (valid) arrays as given
    stored = ThresholdMask(*_fields(m))
    assert stored == m and all(a is b for a, b in zip(_fields(stored), _fields(m), strict=True))
    back = pickle.loads(pickle.dumps(m))
    assert back == m and hash(back) == hash(m) and not back.qo_lens.flags.writeable


@pytest.mark.parametrize(
    ("args", "field", "message"),
    [
        (([[2]], [5], [2]), "qo_lens", "1-D array of lengths >= 0"),
        (([2.0], [5], [2]), "qo_lens", "1-D array of lengths >= 0"),
        (([2], [-5], [2]), "kv_lens", "1-D array of lengths >= 0"),
        (([2], [5], [2.5]), "first_visible", "1-D integer array"),
        (([2], [5], [[2]]), "first_visible", "1-D integer array"),
        (([2, 1], [5], [2, 0]), "mask", "one entry per request"),
        (([2], [5], [2, 0]), "mask", "one entry per request"),
    ],
)
def test_threshold_mask_refuses(args: tuple[Any, ...], field: str, message: str) -> None:
    with pytest.raises(LayoutError, match=message) as info:
        ThresholdMask.from_arrays(*args)
    assert info.value.field == field


def test_threshold_mask_mismatch_names_the_sizes() -> None:
    with pytest.raises(LayoutError) as info:
        ThresholdMask.from_arrays([2, 1], [5, 5, 5], [2])
    assert info.value.values == {"qo_lens": 2, "kv_lens": 3, "first_visible": 1}


# --------------------------------------------------------------------------- TreeMask

TREE = ([2], [5], [1], [[0, 1]], [3], [[[True, False], [True, True]]])


def test_tree_mask_from_bits_packs() -> None:
    m = TreeMask.from_bits(*TREE)
    assert m.dense(0).astype(int).tolist() == [[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]]
    assert m.tail_words.tolist() == [[[1], [3]]] and m.tail_words.dtype == np.uint8
    assert m.tail_bits.tolist() == TREE[5]
    dtypes = [a.dtype for a in _fields(m)]
    assert dtypes == [np.int32, np.int32, np.int64, np.int32, np.int64, np.uint8]
    assert all(not a.flags.writeable for a in _fields(m))
    assert "tail_bits" not in {f.name for f in m.__attrs_attrs__}  # derived, not stored
    # __init__ stores the packed rows as given
    stored = TreeMask(*_fields(m))
    assert stored == m and stored.tail_words is m.tail_words
    for again in (pickle.loads(pickle.dumps(m)), copy.deepcopy(m)):
        assert again == m and hash(again) == hash(m)
        assert all(not a.flags.writeable for a in _fields(again))
        assert again.tail_bits.tolist() == TREE[5]
    # equal bits, equal masks; other bits, another mask
    assert TreeMask.from_bits(*TREE[:5], np.array(TREE[5])) == m
    assert TreeMask.from_bits(*TREE[:5], [[[True, False], [False, True]]]) != m


@pytest.mark.parametrize(
    ("index", "value", "field", "message"),
    [
        (0, [2.0], "qo_lens", "1-D array of lengths >= 0"),
        (1, [-5], "kv_lens", "1-D array of lengths >= 0"),
        (2, [1.5], "first_visible", "1-D integer array"),
        (3, [0, 1], "row_offsets", r"integer array \[bs, N\]"),
        (3, [[0.0, 1.0]], "row_offsets", r"integer array \[bs, N\]"),
        (4, [[3]], "tail_start", "1-D integer array"),
        (5, [[[1, 0], [1, 1]]], "tail_bits", r"bool array \[bs, N, N\]"),
        (5, [[[True, False]]], "tail_bits", r"bool array \[bs, N, N\]"),
        (5, [[True, False], [True, True]], "tail_bits", r"bool array \[bs, N, N\]"),
        (1, [5, 5], "mask", "one entry per request"),
        (5, np.ones((1, 3, 3), bool), "mask", "one entry per request"),
        (5, np.ones((2, 2, 2), bool), "mask", "one entry per request"),
        (0, [3], "qo_lens", "N rows per request"),
        (4, [4], "tail_start", "inside the call's keys"),
        (4, [-1], "tail_start", "inside the call's keys"),
    ],
)
def test_tree_mask_refuses(index: int, value: Any, field: str, message: str) -> None:
    args = list(TREE)
    args[index] = value
    with pytest.raises(LayoutError, match=message) as info:
        TreeMask.from_bits(*args)
    assert info.value.field == field


def test_tree_mask_without_requests_or_tokens() -> None:
    none = np.zeros(0, dtype=np.int32)
    empty = TreeMask.from_bits(
        none, none, none, none.reshape(0, 3), none, np.zeros((0, 3, 3), bool)
    )
    assert empty.tail_words.shape == (0, 3, 1) and empty.tail_bits.shape == (0, 3, 3)
    assert empty.indptr.tolist() == [0] and empty.packed.tolist() == []


@settings(max_examples=80, deadline=None)
@given(verify_layouts(max_batch=5, max_tokens=12))
def test_planned_tree_masks_equal_the_checked_ones(layout: fp.BatchLayout) -> None:
    """The planner stores each tree's packed rows; ``from_bits`` of the same arrays and
    of the unpacked bits gives the same mask, whose bits are the draft's ancestors inside
    the group's window (measured in depth)."""
    spec = fp.plan(layout, HEADS)
    draft = layout.draft
    assert draft is not None
    for gp in spec.group_plans:
        mask = gp.paged.mask if gp.paged is not None else None
        if not isinstance(mask, TreeMask):
            assert draft.is_chain or gp.group.cross_attention
            continue
        again = TreeMask.from_bits(
            mask.qo_lens, mask.kv_lens, mask.first_visible, mask.row_offsets,
            mask.tail_start, mask.tail_bits,
        )  # fmt: skip
        assert again == mask and hash(again) == hash(mask)
        for mine, theirs in zip(_fields(mask), _fields(again), strict=True):
            assert mine.dtype == theirs.dtype and mine.shape == theirs.shape
            assert not mine.flags.writeable
        want = draft.ancestors
        w = gp.group.window_left
        if w >= 0:
            depth = draft.depth.astype(np.int64)
            want = want & (depth[:, None, :] >= depth[:, :, None] - w)
        np.testing.assert_array_equal(mask.tail_bits, want)
        assert mask.tail_words.tolist() == pack_tail_bits(want).tolist()
        for i in range(layout.batch_size):
            assert mask.dense(i).shape == (draft.num_tokens, int(mask.kv_lens[i]))
