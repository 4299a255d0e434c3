"""Hostile input never crashes, corrupts the cache or silently lies (issue 11).

* Fuzzing: every public entry point fed junk values and types raises only flashplan
  errors; after a refused ``apply`` / ``run`` the cache is bit-identical and the earlier
  plan still runs.
* The reference executor reads only each request's own keys: caches full of NaN outside
  the written keys give finite outputs (0 where a query sees no key), and NaN in the
  inputs is never hidden.
* Page ids are checked before any write; derived values never overflow; records stay
  read-only through pickle and deepcopy; errors pickle.
"""

from __future__ import annotations

import copy
import math
import pickle
from decimal import Decimal
from fractions import Fraction
from typing import Any

import attrs
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashplan as fp
from flashplan.__main__ import main
from flashplan.lengths import PageSpans
from flashplan.planning import PagedPart
from flashplan.testing import extend_layouts, layouts, page_tables

HEADS = fp.HeadConfig(4, 2, 16, q_dtype=torch.float32)

JUNK: tuple[Any, ...] = (
    None,
    "x",
    "3",
    b"3",
    1j,
    2.5,
    -1,
    2**40,
    -(2**70),
    math.nan,
    math.inf,
    True,
    [],
    [1, "x"],
    [1, None],
    [[1, 2]],
    {"a": 1},
    object(),
    torch.tensor(0.5),
    torch.tensor([1.0, 2.0], dtype=torch.bfloat16),
    torch.tensor([1, 2], dtype=torch.int64).to_sparse(),
    torch.tensor([1.0, 2.0], requires_grad=True),
    np.array([[1, 2]]),
    np.array(["a"]),
    Fraction(1, 3),
    Decimal("0.5"),
    fp.AttentionGroup(),
)
junk = st.sampled_from(JUNK) | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True)


def _only_flashplan_errors(fn: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except fp.FlashplanError as exc:
        assert isinstance(exc, ValueError)
        str(exc)  # the message renders
        return exc


# --------------------------------------------------------------------------- fuzzing
@settings(max_examples=150)
@given(
    ctor=st.sampled_from(["decode", "extend", "from_extend_lens", "block_extend", "init"]),
    field=st.sampled_from(
        ["seq_lens", "prefix_lens", "encoder_lens", "page_size", "groups", "encoder_cached"]
    ),
    value=junk,
)
def test_layout_constructors_refuse_junk_with_flashplan_errors(
    ctor: str, field: str, value: Any
) -> None:
    kwargs: dict[str, Any] = {"seq_lens": [5, 3], "prefix_lens": [1, 0], "page_size": 4}
    kwargs[field] = value
    if ctor == "decode":
        kwargs.pop("prefix_lens")
        fn: Any = fp.BatchLayout.decode
    elif ctor == "extend":
        fn = fp.BatchLayout.extend
    elif ctor == "from_extend_lens":
        kwargs["extend_lens"] = kwargs.pop("seq_lens")
        fn = fp.BatchLayout.from_extend_lens
    elif ctor == "block_extend":
        kwargs.pop("prefix_lens")
        fn = lambda **kw: fp.BatchLayout.block_extend(block_size=2, **kw)  # noqa: E731
    else:
        fn = lambda **kw: fp.BatchLayout.of(fp.Mode.EXTEND, **kw)  # noqa: E731
    got = _only_flashplan_errors(fn, **kwargs)
    if isinstance(got, fp.BatchLayout):  # accepted: it must be a sound, frozen record
        assert not got.seq_lens.flags.writeable and got.seq_lens.dtype == np.int32
        assert hash(got) == hash(attrs.evolve(got))


@settings(max_examples=150)
@given(
    field=st.sampled_from(
        ["window_left", "cross_attention", "causal", "logits_soft_cap", "sm_scale"]
    ),
    value=junk,
)
def test_attention_group_refuses_junk(field: str, value: Any) -> None:
    got = _only_flashplan_errors(fp.AttentionGroup, **{field: value})
    if isinstance(got, fp.AttentionGroup):
        for name in ("logits_soft_cap",):
            assert type(getattr(got, name)) is float
        assert got.sm_scale is None or type(got.sm_scale) is float
        assert type(got.causal) is bool and type(got.cross_attention) is bool
        hash(got)


@settings(max_examples=100)
@given(
    field=st.sampled_from(
        ["num_qo_heads", "num_kv_heads", "head_dim", "q_dtype", "kv_dtype", "out_dtype"]
    ),
    value=junk | st.sampled_from([torch.int32, torch.float64, torch.complex64]),
)
def test_head_config_refuses_junk(field: str, value: Any) -> None:
    kwargs: dict[str, Any] = {"num_qo_heads": 4, "num_kv_heads": 2, "head_dim": 16}
    kwargs[field] = value
    _only_flashplan_errors(fp.HeadConfig, **kwargs)


@settings(max_examples=80)
@given(layout=junk, heads=junk, path=junk)
def test_plan_refuses_junk(layout: Any, heads: Any, path: Any) -> None:
    good = fp.BatchLayout.extend([3], page_size=2)
    for args in ((layout, HEADS), (good, heads)):
        with pytest.raises(fp.FlashplanError):
            fp.plan(*args)
    _only_flashplan_errors(fp.plan, good, HEADS, extend_path=path)


@settings(max_examples=80)
@given(pages=junk, rows=junk, num_pages=junk)
def test_page_table_refuses_junk(pages: Any, rows: Any, num_pages: Any) -> None:
    ok = torch.zeros(2, 3, dtype=torch.int32)
    _only_flashplan_errors(fp.PageTable, pages, [0, 1])
    _only_flashplan_errors(fp.PageTable, ok, rows)
    _only_flashplan_errors(fp.PageTable, ok, [0, 1], num_pages)
    _only_flashplan_errors(fp.PageTable.sequential, rows)
    _only_flashplan_errors(fp.PageTable.sequential, [1, 2], first_page=num_pages)


def _setup(seed: int = 0) -> tuple[Any, ...]:
    layout = fp.BatchLayout.extend(
        [9, 5, 12],
        [4, 0, 11],
        encoder_lens=[3, 0, 6],
        page_size=2,
        groups=(fp.AttentionGroup.full(), fp.AttentionGroup.sliding(2), fp.AttentionGroup.cross()),
    )
    spec = fp.plan(layout, HEADS, extend_path="ragged")
    table = fp.PageTable.shuffled(spec.pages_needed, seed=seed)
    assert table.num_pages is not None
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(table.num_pages, 2, 2, 2, 16, generator=gen)
    q = torch.randn(spec.total_q, 4, 16, generator=gen)
    k = torch.randn(spec.total_q, 2, 16, generator=gen)
    v = torch.randn(spec.total_q, 2, 16, generator=gen)
    return layout, spec, table, cache, q, k, v


@settings(max_examples=120)
@given(position=st.integers(0, 5), value=junk)
def test_refused_run_leaves_cache_and_plan_intact(position: int, value: Any) -> None:
    layout, spec, table, cache, q, k, v = _setup()
    ex = fp.ReferenceExecutor()
    ex.apply(spec, table)
    group = layout.groups[0]
    args: list[Any] = [group, q, k, v, cache]
    before = cache.clone()
    if position < 5:
        args[position] = value
        got = _only_flashplan_errors(ex.run, *args)
    else:
        got = _only_flashplan_errors(ex.run, *args, return_lse=value)
    if isinstance(got, fp.FlashplanError):
        assert torch.equal(cache, before)  # nothing was written
    ex.run(group, q, k, v, cache.clone())  # the plan still runs


@settings(max_examples=60)
@given(spec=junk, table=junk)
def test_refused_apply_keeps_the_earlier_plan(spec: Any, table: Any) -> None:
    layout, good, good_table, cache, q, k, v = _setup()
    ex = fp.ReferenceExecutor()
    ex.apply(good, good_table)
    with pytest.raises(fp.FlashplanError):
        ex.apply(spec, good_table)
    with pytest.raises(fp.FlashplanError):
        ex.apply(good, table)
    assert ex.spec is good
    ex.run(layout.groups[0], q, k, v, cache)


def test_executor_options_are_checked_at_construction() -> None:
    for dtype in (torch.int32, torch.float16, "float32", None):
        with pytest.raises(fp.OptionError) as err:
            fp.ReferenceExecutor(compute_dtype=dtype)  # type: ignore[arg-type]
        assert err.value.field == "compute_dtype"
        assert not isinstance(err.value, fp.LayoutError)  # the batch is not at fault
    for page_map in (torch.zeros(3), np.zeros(3, dtype=np.int32), [0, 1]):
        with pytest.raises(fp.OptionError) as err:
            fp.ReferenceExecutor(page_map=page_map)  # type: ignore[arg-type]
        assert err.value.field == "page_map"


def test_numbers_are_normalised_or_refused_before_use() -> None:
    assert fp.AttentionGroup(sm_scale=Fraction(1, 2)) == fp.AttentionGroup(sm_scale=0.5)
    assert fp.AttentionGroup(sm_scale=Decimal("0.5")) == fp.AttentionGroup(sm_scale=0.5)
    assert hash(fp.AttentionGroup(logits_soft_cap=30)) == hash(
        fp.AttentionGroup(logits_soft_cap=30.0)
    )
    for field, value in [
        ("sm_scale", torch.tensor(0.5)),
        ("sm_scale", True),
        ("sm_scale", 1j),
        ("sm_scale", "x"),
        ("logits_soft_cap", None),
        ("logits_soft_cap", "x"),
        ("causal", "False"),
        ("causal", 0),
        ("cross_attention", "no"),
        ("window_left", 2**64),
    ]:
        with pytest.raises(fp.LayoutError) as err:
            fp.AttentionGroup(**{field: value})
        assert err.value.field == field
    with pytest.raises(fp.LayoutError) as err:
        fp.BatchLayout.extend([5, True])
    assert (err.value.field, err.value.request) == ("seq_lens", 1)
    with pytest.raises(fp.LayoutError) as err:
        fp.BatchLayout.extend([3], groups=None)  # type: ignore[arg-type]
    assert err.value.field == "groups"
    single = fp.BatchLayout.extend([3], groups=fp.AttentionGroup.sliding(2))
    assert single.groups == (fp.AttentionGroup.sliding(2),)
    with pytest.raises(fp.LayoutError) as err:
        fp.plan(single, HEADS, extend_path="bogus")
    assert err.value.field == "extend_path"


@pytest.mark.parametrize(
    ("values", "index"),
    [([1, 2**64, -(2**70)], 1), ([1, -1, 2.5], 1), ([1, 2j], 1), ([0.5, -3], 0), ([3, "x", -1], 1)],
)
def test_the_first_offending_request_is_named(values: list[Any], index: int) -> None:
    with pytest.raises(fp.LayoutError) as err:
        fp.BatchLayout.extend(values)
    assert (err.value.field, err.value.request) == ("seq_lens", index)


def test_tensors_numpy_cannot_take_are_refused_or_read_safely() -> None:
    got = fp.BatchLayout.extend(torch.tensor([3.0, 4.0], dtype=torch.bfloat16, requires_grad=True))
    assert got.seq_lens.tolist() == [3, 4]
    assert fp.BatchLayout.extend(torch.tensor([3, 4]).to(torch.float16)).seq_lens.tolist() == [3, 4]
    for bad in (torch.tensor([3, 4]).to_sparse(), torch.tensor([True]), torch.tensor([1j])):
        with pytest.raises(fp.LayoutError):
            fp.BatchLayout.extend(bad)
    with pytest.raises(fp.LayoutError):
        fp.BatchLayout.extend(torch.tensor([3, 4], device="meta"))


# --------------------------------------------------------------------------- overflow
def test_derived_values_never_overflow() -> None:
    with pytest.raises(fp.LayoutError) as err:
        fp.BatchLayout.extend([3], encoder_lens=[2**31 - 1], page_size=16)
    assert (err.value.field, err.value.request) == ("encoder_lens", 0)
    for ps in (2**31, 2**40):
        with pytest.raises(fp.LayoutError) as err:
            fp.BatchLayout.extend([3], page_size=ps)
        assert err.value.field == "page_size"
    with pytest.raises(fp.PageTableError) as err:
        fp.PageTable.sequential([2, 3], first_page=2**40)
    assert err.value.field == "first_page"
    with pytest.raises(fp.PageTableError):
        fp.PageTable.sequential([2, 3], first_page=2**31 - 3)


@pytest.mark.parametrize("window", [2**31 - 1, 2**31, 2**62, 2**63 - 1])
@pytest.mark.parametrize("mode", ["decode", "extend-paged", "extend-ragged"])
def test_any_window_at_least_the_sequence_is_full_attention(window: int, mode: str) -> None:
    full, wide = fp.AttentionGroup.full(), fp.AttentionGroup.sliding(window)
    if mode == "decode":
        layout = fp.BatchLayout.decode([1, 7, 40], page_size=4, groups=(full, wide))
    else:
        layout = fp.BatchLayout.extend([9, 40, 3], [4, 33, 0], page_size=4, groups=(full, wide))
    spec = fp.plan(
        layout, HEADS, extend_path=mode.removeprefix("extend-") if "-" in mode else "auto"
    )
    for a, b in zip(fp.materialize(spec, full), fp.materialize(spec, wide), strict=True):
        assert np.array_equal(a, b)


# --------------------------------------------------------------------------- NaN caches
def _written(
    spec: fp.PlanSpec, layout: fp.BatchLayout, table: fp.PageTable
) -> list[tuple[int, int]]:
    """(page, slot) of every key the batch's requests own: cached prefix and new tokens,
    and the encoder tokens."""
    ps = layout.page_size
    out = []
    for i in range(layout.batch_size):
        row = int(table.rows[i])
        tokens = [int(layout.decoder_start[i]) + t for t in range(int(layout.seq_lens[i]))]
        if layout.encoder_lens is not None:
            tokens += list(range(int(layout.encoder_lens[i])))
        out += [(int(table.pages[row, t // ps]), t % ps) for t in tokens]
    return out


@settings(max_examples=40, deadline=None)
@given(
    layout=layouts(max_batch=5, max_len=24, long_len=40, page_sizes=(1, 2, 16)),
    path=st.sampled_from(["paged", "ragged"]),
    data=st.data(),
)
def test_nan_everywhere_else_in_the_cache_never_leaks(
    layout: fp.BatchLayout, path: str, data: st.DataObject
) -> None:
    """Outside the keys the requests own, the cache is NaN (uninitialised, evicted, other
    requests' pages): every output is finite, 0 for a query that sees no key."""
    spec = fp.plan(layout, HEADS, extend_path=path)
    table, pool = data.draw(page_tables(spec))
    cache = torch.full((max(pool, 1), 2, layout.page_size, 2, 16), math.nan)
    for page, slot in _written(spec, layout, table):
        cache[page, :, slot] = torch.randn(2, 2, 16)
    ex = fp.ReferenceExecutor()
    ex.apply(spec, table)
    for group in layout.groups:
        rows = spec.total_encoder if group.cross_attention else spec.total_q
        q = torch.randn(spec.total_q, 4, 16)
        k, v = torch.randn(rows, 2, 16), torch.randn(rows, 2, 16)
        out, lse = ex.run(group, q, k, v, cache.clone(), return_lse=True)
        assert torch.isfinite(out).all()
        blind = torch.isneginf(lse)
        assert (out[blind.all(dim=1)] == 0).all()


def test_issue_repro_encoder_region_the_self_cache_never_wrote() -> None:
    heads = fp.HeadConfig(4, 4, 16, q_dtype=torch.float32)
    full = fp.AttentionGroup.full()
    layout = fp.BatchLayout.extend(
        [4, 11], [3, 10], encoder_lens=[5, 5], page_size=1, groups=(full, fp.AttentionGroup.cross())
    )
    for path in ("paged", "ragged"):
        spec = fp.plan(layout, heads, extend_path=path)
        table = fp.PageTable.sequential(spec.pages_needed)
        cache = torch.full((int(spec.pages_needed.sum()), 2, 1, 4, 16), math.nan)
        for i in range(2):  # only the decoder prefix is written
            for t in range(int(layout.prefix_lens[i])):
                page = int(table.pages[int(table.rows[i]), int(layout.decoder_start[i]) + t])
                cache[page, :, 0] = torch.randn(2, 4, 16)
        ex = fp.ReferenceExecutor()
        ex.apply(spec, table)
        q, k, v = torch.randn(spec.total_q, 4, 16), torch.randn(2, 4, 16), torch.randn(2, 4, 16)
        assert torch.isfinite(ex.run(full, q, k, v, cache)).all()


@pytest.mark.parametrize("path", ["paged", "ragged"])
@pytest.mark.parametrize("where", ["q", "k_new"])
def test_nan_in_inputs_is_never_hidden(path: str, where: str) -> None:
    layout, _, _, cache, q, k, v = _setup()
    spec = fp.plan(layout, HEADS, extend_path=path)
    table = fp.PageTable.shuffled(spec.pages_needed, seed=0)
    ex = fp.ReferenceExecutor()
    ex.apply(spec, table)
    full = layout.groups[0]
    (q if where == "q" else k)[0] = math.nan  # request 0's first new token
    out, lse = ex.run(full, q, k, v, cache, return_lse=True)
    assert torch.isnan(out[0]).all() and torch.isnan(lse[0]).all()


# --------------------------------------------------------------------------- page ids
def test_bad_page_ids_are_refused_before_any_write() -> None:
    layout, spec, table, cache, q, k, v = _setup()
    full = layout.groups[0]
    pages = table.pages.clone()
    row, col = int(table.rows[2]), int(spec.write_start[2]) // 2  # a written column
    for bad in (-1, table.num_pages, 2**31 - 1):
        pages[row, col] = bad
        ex = fp.ReferenceExecutor()
        ex.apply(spec, fp.PageTable(pages, table.rows))
        before = cache.clone()
        with pytest.raises(fp.PageTableError) as err:
            ex.run(full, q, k, v, cache)
        assert err.value.request == 2
        assert torch.equal(cache, before)


def test_two_requests_writing_one_slot_are_refused() -> None:
    layout = fp.BatchLayout.extend([3, 3], page_size=4)
    spec = fp.plan(layout, HEADS)
    pages = torch.tensor([[5, 0], [5, 1]], dtype=torch.int32)  # both rows write page 5
    with pytest.raises(fp.PageTableError) as err:
        fp.ReferenceExecutor().apply(spec, fp.PageTable(pages, [0, 1]))
    assert (err.value.request, err.value.values["other_request"]) == (1, 0)


def test_a_shared_prefix_page_is_fine_when_nobody_writes_it() -> None:
    """Two requests read one prefix page (5) and write their new tokens to their own
    pages (1, 2): accepted, page 5 is left as it was, each new token lands in its own
    slot, and each request's output is float64 attention over the shared prefix and its
    own new tokens."""
    from flashplan.oracle import dense_attention, visibility

    layout = fp.BatchLayout.extend([6, 6], [4, 4], page_size=4)
    spec = fp.plan(layout, HEADS)
    pages = torch.tensor([[5, 1], [5, 2]], dtype=torch.int32)  # page 5: a shared prefix
    ex = fp.ReferenceExecutor()
    ex.apply(spec, fp.PageTable(pages, [0, 1]))
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(6, 2, 4, 2, 16, generator=gen)
    q, k, v = (torch.randn(4, h, 16, generator=gen) for h in (4, 2, 2))
    before = cache.clone()
    group = layout.groups[0]
    out, lse = ex.run(group, q, k, v, cache, return_lse=True)

    # Writes: new tokens 4, 5 of request i (rows 2i, 2i + 1) go to slots 0, 1 of its page.
    want_cache = before.clone()
    for i, page in enumerate((1, 2)):
        want_cache[page, 0, :2], want_cache[page, 1, :2] = (
            k[2 * i : 2 * i + 2],
            v[2 * i : 2 * i + 2],
        )
    assert torch.equal(cache[5], before[5])  # the shared prefix page is not written
    assert torch.equal(cache, want_cache)  # nor is any other slot

    # Reads: the shared prefix (page 5, tokens 0..3), then the request's own new tokens.
    seen = visibility(layout, group)
    for i in range(2):
        rows = slice(2 * i, 2 * i + 2)
        keys = torch.cat([before[5, 0], k[rows]])
        values = torch.cat([before[5, 1], v[rows]])
        want_out, want_lse = dense_attention(q[rows], keys, values, seen[i], group)
        torch.testing.assert_close(out[rows].double(), want_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[rows].double(), want_lse, atol=1e-5, rtol=1e-5)


def test_a_page_table_on_the_meta_device_is_refused_before_any_write() -> None:
    """A table whose page ids live on ``meta`` (no data) with a CPU cache: a
    PageTableError naming ``pages`` and the device, not torch's NotImplementedError; the
    refused apply leaves the executor as it was and writes nothing."""
    layout, spec, table, cache, q, k, v = _setup()
    meta = fp.PageTable(table.pages.to("meta"), table.rows, table.num_pages)
    full = layout.groups[0]
    before = cache.clone()

    fresh = fp.ReferenceExecutor()
    with pytest.raises(fp.PageTableError) as err:
        fresh.apply(spec, meta)
    assert isinstance(err.value, ValueError)
    assert err.value.field == "pages"
    assert err.value.values == {"device": "meta"}
    assert "meta" in str(err.value)
    assert fresh.spec is None
    with pytest.raises(fp.PlanMismatchError):  # nothing half-applied that run could use
        fresh.run(full, q, k, v, cache)
    assert torch.equal(cache, before)

    ex = fp.ReferenceExecutor()
    ex.apply(spec, table)
    with pytest.raises(fp.PageTableError) as err:
        ex.apply(spec, meta)
    assert err.value.field == "pages"
    with pytest.raises(fp.PageTableError):
        ex.apply_steps([spec], meta)
    assert ex.spec is spec
    assert torch.equal(cache, before)
    # The earlier plan still runs, as a fresh executor with the good table does.
    good = fp.ReferenceExecutor()
    good.apply(spec, table)
    assert torch.equal(ex.run(full, q, k, v, cache.clone()), good.run(full, q, k, v, cache.clone()))


def test_an_evicted_window_page_that_is_read_is_refused() -> None:
    window = fp.AttentionGroup.sliding(3)
    layout = fp.BatchLayout.decode([10], page_size=2, groups=(window,))
    spec = fp.plan(layout, HEADS)
    table = fp.PageTable.sequential(spec.pages_needed)
    page_map = torch.arange(5, dtype=torch.int32)
    page_map[4] = -1  # the page holding tokens 8, 9: read by the window
    ex = fp.ReferenceExecutor(page_map=page_map)
    ex.apply(spec, table)
    with pytest.raises(fp.PageTableError):
        ex.run(window, torch.randn(1, 4, 16), None, None, torch.randn(5, 2, 2, 2, 16))
    page_map[4], page_map[0] = 4, -1  # an evicted page the window does not read: fine
    ex.apply(spec, table)
    ex.run(window, torch.randn(1, 4, 16), None, None, torch.randn(5, 2, 2, 2, 16))


def test_tensors_on_other_devices_are_refused() -> None:
    layout, spec, table, cache, q, k, v = _setup()
    ex = fp.ReferenceExecutor()
    ex.apply(spec, table)
    full = layout.groups[0]
    for args in (
        (q.to("meta"), k, v, cache),
        (q, k.to("meta"), v, cache),
        (q, k, v, cache.to("meta")),
    ):
        before = cache.clone()
        with pytest.raises(fp.PlanMismatchError):
            ex.run(full, *args)
        assert torch.equal(cache, before)


# --------------------------------------------------------------------------- records
@settings(max_examples=25)
@given(extend_layouts(max_batch=4))
def test_records_stay_read_only_through_pickle_and_deepcopy(layout: fp.BatchLayout) -> None:
    spec = fp.plan(layout, HEADS)
    for clone in (pickle.loads(pickle.dumps(layout)), copy.deepcopy(layout)):
        assert clone == layout and hash(clone) == hash(layout)
        assert not clone.seq_lens.flags.writeable and not clone.prefix_lens.flags.writeable
    for clone in (pickle.loads(pickle.dumps(spec)), copy.deepcopy(spec)):
        assert clone == spec
        assert not clone.qo_indptr.flags.writeable and not clone.positions.flags.writeable
        for gp in clone.group_plans:
            if gp.paged is not None:
                assert not gp.paged.first_token.flags.writeable
                assert not gp.paged.page_indptr.flags.writeable


def test_plans_of_equal_inputs_are_equal() -> None:
    layout = fp.BatchLayout.extend([9, 5], [4, 0], page_size=4, groups=fp.AttentionGroup.sliding(2))
    a, b = (
        fp.plan(layout, HEADS, extend_path="ragged"),
        fp.plan(layout, HEADS, extend_path="ragged"),
    )
    assert a == b and hash(a) == hash(b) and a is not b
    assert a != fp.plan(layout, HEADS, extend_path="paged")


def test_errors_pickle_and_copy() -> None:
    with pytest.raises(fp.LayoutError) as err:
        fp.BatchLayout.extend([3, -1])
    for clone in (pickle.loads(pickle.dumps(err.value)), copy.deepcopy(err.value)):
        assert type(clone) is fp.LayoutError
        assert (clone.field, clone.request, clone.values, str(clone)) == (
            err.value.field,
            err.value.request,
            err.value.values,
            str(err.value),
        )
    for exc in (
        fp.PlanMismatchError("q", "x", shape=(3, 4)),
        fp.UnsupportedError("extend_path", "y", request=2),
        fp.PageTableError("rows", "z"),
        fp.FieldTypeError("page_size", "must be an int", value=1.5),
    ):
        clone = pickle.loads(pickle.dumps(exc))
        assert type(clone) is type(exc) and str(clone) == str(exc)
        assert (clone.field, clone.request, clone.values) == (exc.field, exc.request, exc.values)


# --------------------------------------------------------------------------- CLI
@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--device=nope"],
        ["demo", "--device=cuda:7"] if not torch.cuda.is_available() else ["demo", "--device=xla"],
        ["explain", "--seq-lens", "5", "--window=99999999999999999999"],
        ["explain", "--seq-lens", "5", "--page-size", "99999999999"],
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err and "\n" not in err and "Traceback" not in err, err


@pytest.mark.parametrize("dtype", [np.int64, np.uint32, np.uint64])
def test_plan_records_refuse_values_that_would_wrap_in_int32(dtype: Any) -> None:
    """Hand-built page spans whose wide-integer arrays hold values beyond
    int32 is refused naming the field and the request, never wrapped into a wrong plan."""
    big = np.array([3, 2**31 + 5], dtype=dtype)
    with pytest.raises(fp.LayoutError) as err:
        PageSpans.between(np.array([0, 0], dtype=dtype), big, 16)
    assert (err.value.field, err.value.request) == ("end_token", 1)
    ok = PagedPart.over(
        PageSpans.between(np.array([0, 1], dtype=dtype), np.array([3, 9], dtype=dtype), 4),
        causal=True, window_left=-1,
    )  # fmt: skip
    assert ok.end_token.dtype == np.int32 and ok.num_pages.tolist() == [1, 3]
    if dtype is np.int64:
        with pytest.raises(fp.LayoutError) as err:
            PageSpans.between(np.array([-(2**31) - 1, 0]), np.array([3, 4]), 4)
        assert (err.value.field, err.value.request) == ("first_token", 0)
