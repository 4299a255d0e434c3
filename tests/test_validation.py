"""Invalid input raises a flashplan error naming the field and the first offending request."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashplan
from flashplan import (
    AttentionGroup,
    BatchLayout,
    FlashplanError,
    HeadConfig,
    LayoutError,
    PageTable,
    PageTableError,
)
from flashplan.testing import INVALID_KINDS, InvalidCase, construct, invalid_layout_kwargs


def _raises(case: InvalidCase) -> FlashplanError:
    with pytest.raises(FlashplanError) as err:
        construct(case.constructor, case.kwargs)
    return err.value


@given(invalid_layout_kwargs())
def test_every_invalid_input_raises_a_flashplan_error(case: InvalidCase) -> None:
    field = case.field
    with pytest.raises(FlashplanError) as err:
        case.build()
    exc = err.value
    assert isinstance(exc, ValueError)
    assert isinstance(exc, LayoutError)
    assert exc.field == field, (exc.field, str(exc))
    assert exc.request == case.request, str(exc)
    # The message names the field, and the request where there is one.
    where = field if exc.request is None else f"{field}[{exc.request}]"
    assert str(exc).startswith(where + ":"), str(exc)


@pytest.mark.parametrize("kind", INVALID_KINDS)
@settings(max_examples=15)
@given(data=st.data())
def test_each_invalid_kind(kind: str, data: st.DataObject) -> None:
    """Every kind of invalid input, drawn on its own (the mix above may miss one)."""
    case = data.draw(invalid_layout_kwargs(kinds=[kind]))
    exc = _raises(case)
    assert exc.field == case.field, str(exc)
    assert exc.request == case.request, str(exc)


def test_invalid_layout_kwargs_rejects_unknown_kinds() -> None:
    with pytest.raises(ValueError, match="unknown invalid kinds"):
        invalid_layout_kwargs(kinds=["nope"])


def test_error_hierarchy() -> None:
    for cls in (
        flashplan.LayoutError,
        flashplan.PageTableError,
        flashplan.PlanMismatchError,
        flashplan.UnsupportedError,
    ):
        assert issubclass(cls, FlashplanError)
        assert issubclass(cls, ValueError)
    assert issubclass(PageTableError, LayoutError)


# --------------------------------------------------------------------------- explicit cases
@pytest.mark.parametrize(
    ("build", "field", "index"),
    [
        # negative lengths: the first offender is named
        (lambda: BatchLayout.extend([3, -1, -2]), "seq_lens", 1),
        (lambda: BatchLayout.extend([3, 4], [0, -1]), "prefix_lens", 1),
        (lambda: BatchLayout.extend([3, 4], encoder_lens=[-5, 0]), "encoder_lens", 0),
        (lambda: BatchLayout.from_extend_lens([1, 2, -3]), "extend_lens", 2),
        (lambda: BatchLayout.decode([5, -5]), "seq_lens", 1),
        # non-integer lengths
        (lambda: BatchLayout.extend([3, 2.5, 4.5]), "seq_lens", 1),
        (lambda: BatchLayout.extend([3.0, 4.0], [1.0, 0.5]), "prefix_lens", 1),
        (lambda: BatchLayout.extend([math.nan]), "seq_lens", 0),
        (lambda: BatchLayout.extend([1, math.inf]), "seq_lens", 1),
        (lambda: BatchLayout.decode(np.array([1.5, 2.0])), "seq_lens", 0),
        (lambda: BatchLayout.extend(torch.tensor([1.0, 2.5])), "seq_lens", 1),
        (lambda: BatchLayout.extend([True, False]), "seq_lens", 0),
        (lambda: BatchLayout.extend([5, True]), "seq_lens", 1),
        (lambda: BatchLayout.extend(np.array([True])), "seq_lens", 0),
        (lambda: BatchLayout.extend([[1, 2]]), "seq_lens", None),
        (lambda: BatchLayout.extend(5), "seq_lens", None),
        # int32 overflow
        (lambda: BatchLayout.extend([1, 2**31]), "seq_lens", 1),
        (
            lambda: BatchLayout.extend([2**31 - 1], encoder_lens=[1], page_size=1),
            "seq_lens",
            0,
        ),
        # prefix > seq: the first offender
        (lambda: BatchLayout.extend([3, 4, 5, 6], [0, 5, 4, 7]), "prefix_lens", 1),
        (lambda: BatchLayout.extend([0], [1]), "prefix_lens", 0),
        # batch-size mismatches
        (lambda: BatchLayout.extend([3, 4], [0]), "prefix_lens", None),
        (lambda: BatchLayout.extend([3], [0, 0]), "prefix_lens", None),
        (lambda: BatchLayout.from_extend_lens([3, 4], [0]), "prefix_lens", None),
        (lambda: BatchLayout.decode([3, 4], encoder_lens=[1, 2, 3]), "encoder_lens", None),
        (lambda: BatchLayout.extend([3, 4], encoder_lens=[]), "encoder_lens", None),
        # page size
        (lambda: BatchLayout.decode([3], page_size=0), "page_size", None),
        (lambda: BatchLayout.decode([3], page_size=-16), "page_size", None),
        (lambda: BatchLayout.extend([3], page_size=16.0), "page_size", None),
        (lambda: BatchLayout.extend([3], page_size="16"), "page_size", None),
        (lambda: BatchLayout.extend([3], page_size=True), "page_size", None),
        (lambda: BatchLayout.extend([3], page_size=None), "page_size", None),
        # decode needs >= 1 token per request
        (lambda: BatchLayout.decode([4, 0, 0]), "seq_lens", 1),
        # groups
        (
            lambda: BatchLayout.extend([3], groups=(AttentionGroup.cross(),)),
            "encoder_lens",
            None,
        ),
        (
            lambda: BatchLayout.decode(
                [3], groups=(AttentionGroup.sliding(4), AttentionGroup.cross())
            ),
            "encoder_lens",
            None,
        ),
        (lambda: BatchLayout.decode([3], groups=()), "groups", None),
        (lambda: BatchLayout.decode([3], groups=("full",)), "groups", None),
        (
            lambda: BatchLayout.decode([3], groups=(AttentionGroup(), AttentionGroup.full())),
            "groups",
            None,
        ),
        (lambda: AttentionGroup.sliding(-2), "window_left", None),
        (lambda: AttentionGroup(window_left=-100), "window_left", None),
        (lambda: AttentionGroup(window_left=3, causal=False), "window_left", None),
        (
            lambda: AttentionGroup(cross_attention=True, causal=False, window_left=0),
            "window_left",
            None,
        ),
        (lambda: AttentionGroup(cross_attention=True), "causal", None),
        (lambda: HeadConfig(num_qo_heads=12, num_kv_heads=8, head_dim=128), "num_kv_heads", None),
        (lambda: HeadConfig(num_qo_heads=7, num_kv_heads=2, head_dim=128), "num_kv_heads", None),
    ],
)
def test_explicit_invalid_inputs(build: object, field: str, index: int | None) -> None:
    with pytest.raises(FlashplanError) as err:
        build()  # type: ignore[operator]
    assert isinstance(err.value, ValueError)
    assert (err.value.field, err.value.request) == (field, index), str(err.value)


def test_error_carries_the_values() -> None:
    with pytest.raises(LayoutError) as err:
        BatchLayout.extend([3, 4, 5], [0, 9, 0])
    exc = err.value
    assert exc.values == {"prefix_len": 9, "seq_len": 4}
    assert str(exc) == "prefix_lens[1]: must not exceed seq_lens (prefix_len=9, seq_len=4)"
    with pytest.raises(LayoutError) as err:
        BatchLayout.decode([3, 0])
    assert err.value.values == {"value": 0}


def test_layouts_refuse_totals_beyond_int32_when_built() -> None:
    """Totals a plan indexes with int32 are refused when the layout is built (issue 50,
    item 4), naming the field and the total; before, the layout was accepted and
    ``pages_needed`` / ``plan`` raised later."""
    M = 2**31 - 1
    # more new tokens in all than int32 holds
    with pytest.raises(LayoutError) as err:
        BatchLayout.extend([2**30, 2**30, 2**30], page_size=16)
    assert err.value.field == "seq_lens" and err.value.values == {"total_new_tokens": 3 * 2**30}
    # every row fits, the pages of all rows do not (a page per token)
    for build in (
        lambda: BatchLayout.extend([M] * 3),
        lambda: BatchLayout.extend([M] * 3, [M - 1] * 3),
        lambda: BatchLayout.decode([M] * 3),
        lambda: BatchLayout.decode([2**30, 2**30]),
        lambda: BatchLayout.verify([2**30, 2**30], flashplan.DraftTree.chain(2, 4)),
    ):
        with pytest.raises(LayoutError) as err:
            build()
        assert err.value.field == "seq_lens" and "total" in str(err.value), str(err.value)
    # the same rows on pages of 2**20 tokens: accepted, and planned
    heads = HeadConfig(1, 1, 64)
    for layout in (
        BatchLayout.decode([M] * 3, page_size=2**20),
        BatchLayout.extend([M] * 3, [M - 1] * 3, page_size=2**20),
        BatchLayout.decode([2**30, 2**30 - 1]),  # 2**31 - 1 pages: the largest total
    ):
        assert layout.pages_needed.dtype == np.int32
        flashplan.plan(layout, heads)
    # the encoder tokens written this step, in all
    cross = (AttentionGroup(), AttentionGroup.cross())
    with pytest.raises(LayoutError) as err:
        BatchLayout.decode([1] * 3, encoder_lens=[2**30] * 3, page_size=2**20, groups=cross)
    assert (err.value.field, err.value.values) == (
        "encoder_lens",
        {"total_encoder_tokens": 3 * 2**30},
    )
    cached = BatchLayout.decode(
        [1] * 3, encoder_lens=[2**30] * 3, encoder_cached=[True, False, True], page_size=2**20,
        groups=cross,
    )  # fmt: skip
    flashplan.plan(cached, heads)  # only 2**30 encoder tokens are written


def test_draft_decode_refuses_steps_beyond_int32_when_built() -> None:
    """Every step of an accepted DraftDecode plans: its last step's rows fit int32."""
    with pytest.raises(LayoutError) as err:
        flashplan.DraftDecode([4, 2**31 - 3], topk=2, steps=5)
    assert (err.value.field, err.value.request) == ("prefix_lens", 1)
    with pytest.raises(LayoutError) as err:  # each row fits; 2 * 2 rows of pages do not
        flashplan.DraftDecode([2**30, 2**30], topk=2, steps=1)
    assert err.value.field == "prefix_lens" and err.value.values["total_pages"] > 2**31
    steps = flashplan.plan_steps(
        flashplan.DraftDecode([2**30, 2**30], topk=2, steps=2, page_size=16), HeadConfig(1, 1, 64)
    )
    assert len(steps) == 2


def _sealed(arr: object, want: list[int]) -> None:
    """``arr`` is what the converters promise (flashplan.layout.convert.as_lengths): a
    read-only 1-D int32 numpy array, here holding ``want``."""
    assert isinstance(arr, np.ndarray), type(arr)
    assert arr.dtype == np.int32 and arr.ndim == 1, (arr.dtype, arr.shape)
    assert not arr.flags.writeable
    assert arr.tolist() == want


def test_valid_edge_inputs_are_accepted() -> None:
    """The other side of validation: unusual but valid input must not raise, and becomes
    the normalised value (read-only int32 arrays, Python ints)."""
    lay = BatchLayout.extend([])
    _sealed(lay.seq_lens, [])
    _sealed(lay.prefix_lens, [])
    assert (lay.batch_size, lay.total_new_tokens) == (0, 0)

    lay = BatchLayout.decode(np.array([], dtype=np.int64))
    _sealed(lay.seq_lens, [])
    _sealed(lay.prefix_lens, [])
    assert lay.mode is flashplan.Mode.DECODE and lay.batch_size == 0

    lay = BatchLayout.extend([0, 0], [0, 0])
    _sealed(lay.seq_lens, [0, 0])
    _sealed(lay.prefix_lens, [0, 0])
    _sealed(lay.extend_lens, [0, 0])
    assert lay.total_new_tokens == 0

    # Narrow numpy dtypes are widened to int32; the input is copied, not shared.
    seq_np, pre_np = np.array([1, 2], dtype=np.uint8), np.array([0, 2], dtype=np.int16)
    lay = BatchLayout.extend(seq_np, pre_np)
    seq_np[0], pre_np[1] = 7, 1
    _sealed(lay.seq_lens, [1, 2])
    _sealed(lay.prefix_lens, [0, 2])
    _sealed(lay.extend_lens, [1, 0])

    # CPU tensors (int64 and int32) likewise; writing the tensor later changes nothing.
    seq_t, pre_t = torch.tensor([3, 4]), torch.tensor([1, 4], dtype=torch.int32)
    lay = BatchLayout.extend(seq_t, pre_t)
    seq_t[0], pre_t[0] = 9, 0
    _sealed(lay.seq_lens, [3, 4])
    _sealed(lay.prefix_lens, [1, 4])

    lay = BatchLayout.extend([3.0, 4.0], [1.0, 0.0])  # integral floats are integers
    _sealed(lay.seq_lens, [3, 4])
    _sealed(lay.prefix_lens, [1, 0])
    assert lay == BatchLayout.extend([3, 4], [1, 0])

    lay = BatchLayout.extend([2**31 - 1])  # the largest int32 is kept, not wrapped
    _sealed(lay.seq_lens, [2**31 - 1])
    _sealed(lay.extend_lens, [2**31 - 1])
    assert lay.total_new_tokens == 2**31 - 1

    cross = AttentionGroup.cross()
    lay = BatchLayout.extend([0], encoder_lens=[0], groups=(cross,))
    assert lay.encoder_lens is not None
    _sealed(lay.encoder_lens, [0])
    _sealed(lay.decoder_start, [0])
    _sealed(lay.pages_needed, [0])
    assert lay.groups == (cross,)

    lay = BatchLayout.decode([1], page_size=1 << 20)
    assert type(lay.page_size) is int and lay.page_size == 1 << 20
    _sealed(lay.prefix_lens, [0])
    _sealed(lay.pages_needed, [1])

    for window in (0, 2**31 - 1):
        group = AttentionGroup.sliding(window)
        assert group.window_left == window and group.has_window and group.causal

    heads = HeadConfig(num_qo_heads=1, num_kv_heads=1, head_dim=1)
    assert (heads.num_qo_heads, heads.num_kv_heads, heads.head_dim, heads.group_size) == (
        1,
        1,
        1,
        1,
    )


# --------------------------------------------------------------------------- device tensors
META = torch.empty(3, device="meta")
META_INT = torch.empty(3, device="meta", dtype=torch.int32)


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: BatchLayout.decode(META), "seq_lens"),
        (lambda: BatchLayout.decode(META_INT), "seq_lens"),
        (lambda: BatchLayout.extend(META_INT), "seq_lens"),
        (lambda: BatchLayout.extend([1, 2, 3], META), "prefix_lens"),
        (lambda: BatchLayout.decode([1, 2, 3], encoder_lens=META_INT), "encoder_lens"),
        (lambda: BatchLayout.from_extend_lens(META_INT), "extend_lens"),
        (lambda: BatchLayout.from_extend_lens([1, 2, 3], META_INT), "prefix_lens"),
        (
            lambda: PageTable(pages=torch.zeros(3, 2, dtype=torch.int32), rows=META_INT),
            "rows",
        ),
        (lambda: PageTable.sequential(META_INT), "pages_needed"),
    ],
)
def test_device_tensors_are_refused(build: object, field: str) -> None:
    with pytest.raises(FlashplanError) as err:
        build()  # type: ignore[operator]
    assert err.value.field == field
    assert "device" in str(err.value)
    assert err.value.values.get("device") == "meta"


def test_page_table_on_a_device_is_fine() -> None:
    # The page ids themselves may live on the device (the executor gathers there).
    table = PageTable(pages=torch.empty(2, 4, device="meta", dtype=torch.int32), rows=[0, 1])
    table.check_covers(np.array([4, 1], dtype=np.int32))
    with pytest.raises(PageTableError):
        table.check_covers(np.array([5, 1], dtype=np.int32))


# --------------------------------------------------------------------------- known bugs
@pytest.mark.parametrize(
    ("values", "index"),
    [([1, 2, "3"], 2), ([1, "x"], 1), (["x", "y"], 0), ([4, 5, "7", "8"], 2), ([1, None], 1)],
)
def test_string_lengths_name_the_first_string(values: list, index: int) -> None:
    with pytest.raises(LayoutError) as err:
        BatchLayout.extend(values)
    assert err.value.field == "seq_lens"
    assert err.value.request == index, str(err.value)


@pytest.mark.parametrize(
    ("values", "index"), [([2**70], 0), ([1, -(2**70)], 1), ([1, 2**64], 1), ([3, 1e20], 1)]
)
def test_lengths_beyond_int64_are_flashplan_errors(values: list, index: int) -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(FlashplanError) as err:
            BatchLayout.extend(values)
    assert (err.value.field, err.value.request) == ("seq_lens", index)
    message = str(err.value)
    assert "int32" in message or ">= 0" in message, message


@pytest.mark.parametrize(
    ("build", "read", "want", "plain"),
    [
        (
            lambda: BatchLayout.decode([3], page_size=np.int64(16)),
            lambda lay: lay.page_size,
            16,
            lambda: BatchLayout.decode([3], page_size=16),
        ),
        (
            lambda: AttentionGroup.sliding(np.int32(3)),
            lambda g: g.window_left,
            3,
            lambda: AttentionGroup.sliding(3),
        ),
        (
            lambda: HeadConfig(np.int64(8), 2, 128),
            lambda h: h.num_qo_heads,
            8,
            lambda: HeadConfig(8, 2, 128),
        ),
    ],
)
def test_numpy_integer_scalars_are_integers(
    build: object, read: object, want: int, plain: object
) -> None:
    """A numpy integer scalar is accepted and stored as the Python int of the same value:
    the record equals (and hashes like) the one built from a plain int."""
    record = build()  # type: ignore[operator]
    value = read(record)  # type: ignore[operator]
    assert type(value) is int, type(value)
    assert value == want
    other = plain()  # type: ignore[operator]
    assert record == other and hash(record) == hash(other)
