"""Attention sinks, chunked local attention and bidirectional windows, on the CPU.

Properties over every mode, page size and extend path:

* the plan's kernel calls, replayed on the host (:func:`flashplan.materialize`), show
  each query exactly the keys the oracle states from ``docs/semantics.md``;
* the virtual requests of a chunked extend partition each request's new tokens into
  runs that each stay inside one chunk;
* a position mask packs to the same bits as its dense form;
* the reference executor equals float64 dense attention over the oracle's keys, sinks
  included (the sink is counted once, also where a group's keys are split over a
  ragged and a paged call and merged);
* a sink changes the output by the oracle's amount, and a silently dropped sink fails.
"""

from __future__ import annotations

import math

import attrs
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashplan as fp
from flashplan.errors import LayoutError, PlanMismatchError, UnsupportedError
from flashplan.oracle import dense_attention as oracle_attention
from flashplan.oracle import key_row_tokens, visibility
from flashplan.planning.chunks import chunk_split, needs_position_mask
from flashplan.planning.masks import PositionMask, pack_dense
from flashplan.testing import (
    GROUP_KINDS,
    LOCAL_GROUP_KINDS,
    attention_groups,
    head_configs,
    layouts,
    page_tables,
    verify_layouts,
)
from flashplan.torch_kernels import fold_sinks_torch, merge_state_torch

HEADS = fp.HeadConfig(num_qo_heads=4, num_kv_heads=2, head_dim=16, q_dtype=torch.float32)
SELF_KINDS = tuple(k for k in GROUP_KINDS if k != "cross") + LOCAL_GROUP_KINDS


@st.composite
def local_layouts(draw: st.DrawFn, *, max_batch: int = 6, max_len: int = 48) -> fp.BatchLayout:
    """Decode or extend layouts with at least one local group (sinks drawn anywhere)."""
    local = draw(attention_groups(kinds=LOCAL_GROUP_KINDS, max_window=12, sinks=True))
    others = draw(
        st.lists(attention_groups(kinds=SELF_KINDS, max_window=12, sinks=True), max_size=2)
    )
    groups = list(dict.fromkeys([local, *others]))
    return draw(layouts(max_batch=max_batch, max_len=max_len, long_len=120, groups=groups))


@st.composite
def chunked_verifies(draw: st.DrawFn) -> fp.BatchLayout:
    """Verify layouts with a chunked group (chunk boundaries inside draft trees)."""
    chunked = draw(attention_groups(kinds=("chunked",), sinks=True))
    other = draw(attention_groups(kinds=("full", "sliding"), max_window=8, sinks=True))
    groups = list(dict.fromkeys([chunked, other]))
    return draw(verify_layouts(max_batch=4, max_len=40, long_len=80, groups=groups))


def _plans(layout: fp.BatchLayout, heads: fp.HeadConfig = HEADS) -> list[tuple[str, fp.PlanSpec]]:
    """The layout's plan on every extend path it can run on; the ragged path of a group
    that needs a position mask is refused by name."""
    out = []
    chunked = any(g.has_chunks for g in layout.groups)
    for path in ("auto", "paged", "ragged"):
        if layout.mode is fp.Mode.VERIFY and path == "ragged":
            continue
        # chunked_extend="mask" plans every chunked group of an extend as a position mask
        for how in ("split", "mask") if chunked else ("split",):
            masked = any(
                needs_position_mask(g, layout.page_size) or (how == "mask" and g.has_chunks)
                for g in layout.groups
                if not g.cross_attention
            )
            if path == "ragged" and masked and layout.mode is fp.Mode.EXTEND:  # asked for
                with pytest.raises(LayoutError) as err:
                    fp.plan(layout, heads, extend_path=path, chunked_extend=how)
                assert err.value.field == "extend_path"
                continue
            spec = fp.plan(layout, heads, extend_path=path, chunked_extend=how)
            if how == "mask" and layout.mode is fp.Mode.EXTEND:  # no virtual request left
                assert all(gp.virtual is None for gp in spec.group_plans)
            out.append((f"{path}/{how}", spec))
    return out


def _check_against_oracle(layout: fp.BatchLayout) -> None:
    for path, spec in _plans(layout):
        for g in layout.groups:
            got = fp.materialize(spec, g)
            want = visibility(layout, g)
            for i, (a, b) in enumerate(zip(got, want, strict=True)):
                assert a.shape == b.shape
                if not np.array_equal(a, b):
                    diff = np.argwhere(a != b)[:8].tolist()
                    pytest.fail(f"path={path} {g.describe()} request {i}: differ at {diff}")


# --------------------------------------------------------------------------- planning
@settings(max_examples=150, deadline=None)
@given(local_layouts())
def test_local_plans_show_the_oracles_keys(layout: fp.BatchLayout) -> None:
    _check_against_oracle(layout)


@settings(max_examples=80, deadline=None)
@given(chunked_verifies())
def test_chunked_verify_shows_the_oracles_keys(layout: fp.BatchLayout) -> None:
    _check_against_oracle(layout)


def test_oracle_rules_by_hand() -> None:
    """The inequalities of docs/semantics.md on one small request each."""
    chunked = fp.AttentionGroup.chunked(4)
    layout = fp.BatchLayout.extend([10], [3], page_size=2, groups=[chunked])
    (seen,) = visibility(layout, chunked)  # queries at positions 3..9
    for j, p in enumerate(range(3, 10)):
        assert np.flatnonzero(seen[j]).tolist() == list(range(p // 4 * 4, p + 1))
    band = fp.AttentionGroup.bidirectional(window_left=2, window_right=1)
    layout = fp.BatchLayout.extend([8], [0], page_size=3, groups=[band])
    (seen,) = visibility(layout, band)
    for p in range(8):
        assert np.flatnonzero(seen[p]).tolist() == list(range(max(p - 2, 0), min(p + 2, 8)))


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 80), st.integers(0, 80)), max_size=8),
    st.integers(1, 20),
)
def test_chunk_split_partitions_new_tokens(reqs: list[tuple[int, int]], chunk: int) -> None:
    seq = np.array([max(a, b) for a, b in reqs], dtype=np.int32)
    pre = np.array([min(a, b) for a, b in reqs], dtype=np.int32)
    request, chunk_first, q_first, q_end = chunk_split(pre, seq, chunk)
    assert np.all(np.diff(request) >= 0)
    for i in range(len(reqs)):
        mine = request == i
        assert mine.sum() >= 1  # every request has a virtual request
        lo, hi = q_first[mine], q_end[mine]
        # the runs tile [P, L) in order, each inside its chunk
        new = int(seq[i]) - int(pre[i])
        assert int((hi - lo).sum()) == new
        if new:
            assert lo[0] == pre[i] and hi[-1] == seq[i]
            assert np.array_equal(lo[1:], hi[:-1])
            assert np.all(chunk_first[mine] == lo // chunk * chunk)
            assert np.all((hi - 1) // chunk == lo // chunk)
            assert mine.sum() == (int(seq[i]) - 1) // chunk - int(pre[i]) // chunk + 1


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 9), st.integers(0, 30), st.integers(0, 30), st.integers(0, 30)),
        max_size=5,
    ),
    st.booleans(),
    st.integers(-1, 6),
    st.integers(-1, 6),
    st.integers(0, 7),
)
def test_position_mask_packs_its_dense_form(
    reqs: list[tuple[int, int, int, int]], causal: bool, left: int, right: int, chunk: int
) -> None:
    q, kv, row, col = (np.array([r[k] for r in reqs], dtype=np.int64) for k in range(4))
    m = PositionMask.from_arrays(
        q, kv, row, col, causal=causal, window_left=left, window_right=right, chunk=chunk
    )
    dense = [m.dense(i) for i in range(len(reqs))]
    for i, d in enumerate(dense):  # the rule, key by key
        for j in range(q[i]):
            for c in range(kv[i]):
                p, k = row[i] + j, col[i] + c
                ok = (not causal or k <= p) and (left < 0 or k >= p - left)
                ok = ok and (right < 0 or k <= p + right)
                ok = ok and (not chunk or k // chunk == p // chunk)
                assert bool(d[j, c]) == ok
    assert np.array_equal(m.packed, pack_dense(dense)[0])
    assert np.array_equal(m.indptr, pack_dense(dense)[1])


def test_planner_uses_virtual_requests_across_chunk_boundaries() -> None:
    g = fp.AttentionGroup.chunked(8)
    layout = fp.BatchLayout.extend([20, 5], [3, 0], page_size=4, groups=[g])
    spec = fp.plan(layout, HEADS, extend_path="paged")
    gp = spec.group_plan(g)
    assert gp.virtual is not None
    # request 0 (new tokens 3..19) touches chunks 0, 1, 2; request 1 only chunk 0
    assert gp.virtual.request.tolist() == [0, 0, 0, 1]
    assert gp.virtual.queries.lens.tolist() == [5, 8, 4, 5]
    # a decode step never splits: its query is one token in one chunk (a page trim)
    dec = fp.plan(fp.BatchLayout.decode([17, 9], page_size=4, groups=[g]), HEADS)
    gp = dec.group_plan(g)
    assert gp.virtual is None and gp.paged is not None and gp.paged.position_mask is None
    assert gp.paged.kv_lens.tolist() == [1, 1]  # positions 16 and 8 start a chunk


# --------------------------------------------------------------------------- sinks math
def test_fold_sinks_is_a_merge_with_a_value_zero_key() -> None:
    gen = torch.Generator().manual_seed(0)
    v = torch.randn(5, 3, 8, generator=gen, dtype=torch.float64)
    s = torch.randn(5, 3, generator=gen).float() * 4
    s[0] = -math.inf  # a query that sees no key
    v[0] = 0
    sinks = torch.randn(3, generator=gen).float()
    got_v, got_s = fold_sinks_torch(v, s, sinks)
    want_v, want_s = merge_state_torch(
        v, s, torch.zeros_like(v), (sinks / math.log(2))[None].expand(5, 3).contiguous()
    )
    assert torch.allclose(got_v, want_v, atol=1e-12) and torch.allclose(got_s, want_s)
    assert torch.all(got_v[0] == 0) and torch.allclose(got_s[0], sinks / math.log(2))


def test_dense_attention_sinks_by_hand() -> None:
    """One query, two keys: out = sum(p_k v_k) with p_k = e^l_k / (e^l_0 + e^l_1 + e^s)."""
    g = fp.AttentionGroup.full(sm_scale=1.0)
    q = torch.tensor([[[1.0, 0.0]]], dtype=torch.float64)
    k = torch.tensor([[[1.0, 0.0]], [[0.0, 0.0]]], dtype=torch.float64)
    v = torch.tensor([[[2.0, 0.0]], [[0.0, 4.0]]], dtype=torch.float64)
    seen = np.ones((1, 2), dtype=bool)
    sinks = torch.tensor([0.5])
    out, lse = oracle_attention(q, k, v, seen, g, sinks)
    z = math.e + 1 + math.exp(0.5)
    assert torch.allclose(out[0, 0], torch.tensor([2 * math.e / z, 4 / z], dtype=torch.float64))
    assert math.isclose(float(lse[0, 0]), math.log2(z), rel_tol=1e-12)


# --------------------------------------------------------------------------- executor
def _read(cache: torch.Tensor, table: fp.PageTable, i: int, tokens: np.ndarray, ps: int):
    row = int(table.rows[i])
    page = table.pages[row, torch.from_numpy(tokens // ps)].long()
    slot = torch.from_numpy(tokens % ps)
    return cache[page, 0, slot], cache[page, 1, slot]


def _dense(layout, group, q, cache, table, sinks):
    qo = np.concatenate([[0], np.cumsum(layout.extend_lens)])
    tokens = key_row_tokens(layout, group)
    outs, lses = [], []
    for i, seen in enumerate(visibility(layout, group)):
        k, v = _read(cache, table, i, tokens[i], layout.page_size)
        o, s = oracle_attention(q[qo[i] : qo[i + 1]], k, v, seen, group, sinks)
        outs.append(o)
        lses.append(s)
    hq, d = q.shape[1], q.shape[2]
    outs.append(torch.zeros(0, hq, d, dtype=torch.float64))
    lses.append(torch.zeros(0, hq, dtype=torch.float64))
    return torch.cat(outs), torch.cat(lses)


@st.composite
def local_runs(draw: st.DrawFn) -> fp.BatchLayout:
    if draw(st.integers(0, 3)) == 0:
        return draw(chunked_verifies())
    return draw(local_layouts(max_batch=4, max_len=36))


@settings(max_examples=60, deadline=None)
@given(
    layout=local_runs(),
    heads=head_configs(head_dims=(16,), dtypes=(torch.float32,), max_kv_heads=2),
    path=st.sampled_from(["auto", "paged", "ragged"]),
    seed=st.integers(0, 2**31 - 1),
    data=st.data(),
)
def test_reference_equals_float64_oracle(
    layout: fp.BatchLayout, heads: fp.HeadConfig, path: str, seed: int, data: st.DataObject
) -> None:
    plans = dict(_plans(layout, heads))
    path = data.draw(
        st.sampled_from(sorted(k for k in plans if k.startswith(path)) or ["paged/split"])
    )
    spec = plans[path]
    table, pool = data.draw(page_tables(spec))
    gen = torch.Generator().manual_seed(seed)
    ex = fp.ReferenceExecutor(compute_dtype=torch.float64)
    ex.apply(spec, table)
    hq, hkv, d = heads.num_qo_heads, heads.num_kv_heads, heads.head_dim
    for group in layout.groups:
        cache = torch.randn(pool, 2, layout.page_size, hkv, d, generator=gen)
        q = torch.randn(spec.total_q, hq, d, generator=gen)
        k_new = torch.randn(spec.total_q, hkv, d, generator=gen)
        v_new = torch.randn(spec.total_q, hkv, d, generator=gen)
        sinks = torch.randn(hq, generator=gen) * 2 if group.sinks else None
        out, lse = ex.run(group, q, k_new, v_new, cache, return_lse=True, sinks=sinks)
        want, want_lse = _dense(layout, group, q, cache, table, sinks)
        assert torch.allclose(out.double(), want, atol=1e-5), (path, group.describe())
        finite = torch.isfinite(want_lse)
        assert torch.equal(torch.isfinite(lse), finite)
        assert torch.allclose(lse.double()[finite], want_lse[finite], atol=1e-4)


def test_sinks_change_the_output_by_the_oracles_amount() -> None:
    """A sink group on the ragged + paged path (prefix in the cache, new tokens ragged):
    the sink is folded once; a dropped sink, or a missing / malformed one, is caught."""
    g = fp.AttentionGroup.full(sinks=True)
    layout = fp.BatchLayout.extend([12, 7], [5, 0], page_size=4, groups=[g])
    spec = fp.plan(layout, HEADS, extend_path="ragged")
    gp = spec.group_plan(g)
    assert gp.path is fp.planning.KernelPath.RAGGED_PAGED
    assert gp.ragged is not None and gp.ragged.sinks and gp.paged is not None
    assert not gp.paged.sinks  # the sink is folded into exactly one call
    table = fp.PageTable.sequential(spec.pages_needed)
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(table.num_pages, 2, 4, 2, 16, generator=gen)
    q = torch.randn(spec.total_q, 4, 16, generator=gen)
    k_new = torch.randn(spec.total_q, 2, 16, generator=gen)
    v_new = torch.randn(spec.total_q, 2, 16, generator=gen)
    sinks = torch.tensor([3.0, -1.0, 0.0, 5.0])
    ex = fp.ReferenceExecutor(compute_dtype=torch.float64)
    ex.apply(spec, table)
    out, lse = ex.run(g, q, k_new, v_new, cache, return_lse=True, sinks=sinks)  # writes
    want, want_lse = _dense(layout, g, q, cache, table, sinks)
    assert torch.allclose(out.double(), want, atol=1e-6)
    assert torch.allclose(lse.double(), want_lse, atol=1e-5)
    nosink, nosink_lse = _dense(layout, g, q, cache, table, None)
    # the sink's share of the mass: out = out_without * 2**(lse_without - lse)
    share = torch.exp2(nosink_lse - want_lse)[..., None]
    assert torch.allclose(out.double(), nosink * share, atol=1e-6)
    assert (out.double() - nosink).abs().max() > 0.1  # a dropped sink fails
    with pytest.raises(PlanMismatchError) as err:
        ex.run(g, q, None, None, cache)
    assert err.value.field == "sinks"
    with pytest.raises(PlanMismatchError):
        ex.run(g, q, None, None, cache, sinks=sinks[:2])
    with pytest.raises(PlanMismatchError):
        ex.run(g, q, None, None, cache, sinks=sinks.double())
    plain = fp.AttentionGroup.full()
    spec2 = fp.plan(fp.BatchLayout.extend([12, 7], [5, 0], page_size=4, groups=[plain]), HEADS)
    ex.apply(spec2, table)
    with pytest.raises(PlanMismatchError) as err:
        ex.run(plain, q, k_new, v_new, cache, sinks=sinks)
    assert err.value.field == "sinks"


def test_flashinfer_executor_refuses_virtual_requests_in_graphs_only() -> None:
    """A chunked extend across a chunk boundary (virtual requests) in a CUDA-graph
    bucket is refused by name, on any machine (the check is pure); eagerly, and every
    position mask (bidirectional windows, chunks inside pages) in either mode, runs."""
    from flashplan.executor.flashinfer.calls import check_runnable

    heads = HEADS
    chunked = fp.AttentionGroup.chunked(8)
    split = fp.plan(fp.BatchLayout.extend([20], [3], page_size=4, groups=[chunked]), heads)
    assert split.group_plan(chunked).virtual is not None
    with pytest.raises(UnsupportedError) as err:
        check_runnable(split, graph=True)
    assert err.value.field == "groups" and chunked.describe() in str(err.value)
    check_runnable(split)
    band = fp.AttentionGroup.bidirectional(window_left=3, window_right=2)
    masked = fp.plan(fp.BatchLayout.extend([9], [0], page_size=4, groups=[band]), heads)
    inside = fp.AttentionGroup.chunked(6)  # chunks that start inside 4-token pages
    inside_decode = fp.plan(fp.BatchLayout.decode([20], page_size=4, groups=[inside]), heads)
    for spec in (masked, inside_decode):
        assert any(
            gp.paged is not None and gp.paged.position_mask is not None for gp in spec.group_plans
        )
        check_runnable(spec)
        check_runnable(spec, graph=True)
    decode = fp.plan(fp.BatchLayout.decode([20, 3], page_size=4, groups=[chunked]), heads)
    check_runnable(decode, graph=True)
    sink = fp.AttentionGroup.sliding(7, sinks=True)
    check_runnable(fp.plan(fp.BatchLayout.extend([20], [3], page_size=4, groups=[sink]), heads))


# ------------------------------------------------------ non-finite sink logits (issue 50)
_ODD_SINKS = torch.tensor([math.nan, math.inf, -math.inf, 0.7])  # heads 0..3


def _sink_paths() -> list[tuple[str, fp.BatchLayout, str, fp.SharedPrefix | None]]:
    """One sink group on every path that folds or computes a sink: decode, paged-only
    extend, ragged + paged extend (the merge folds it), chunked (virtual requests)."""
    sink = fp.AttentionGroup.full(sinks=True)
    chunk = fp.AttentionGroup.chunked(4, sinks=True)
    return [
        ("decode", fp.BatchLayout.decode([5, 9], page_size=2, groups=[sink]), "auto", None),
        ("paged", fp.BatchLayout.extend([7, 9], [3, 0], page_size=2, groups=[sink]), "paged",
         None),
        ("ragged", fp.BatchLayout.extend([7, 9], [3, 4], page_size=2, groups=[sink]), "ragged",
         None),
        ("chunked", fp.BatchLayout.extend([9, 11], [2, 3], page_size=2, groups=[chunk]),
         "paged", None),
    ]  # fmt: skip


@pytest.mark.parametrize("name", [p[0] for p in _sink_paths()])
def test_non_finite_sink_logits_follow_one_rule(name: str) -> None:
    """Issue 50, item 6: ``-inf`` is no sink (the same group without sinks), NaN and
    ``+inf`` give the head NaN outputs and LSE, a finite logit the oracle's value — on
    every path of the reference executor, and in the oracle itself."""
    ((_, layout, path, _),) = [p for p in _sink_paths() if p[0] == name]
    heads = fp.HeadConfig(4, 2, 8, q_dtype=torch.float32)
    spec = fp.plan(layout, heads, extend_path=path)
    plain_layout = layout.with_groups(attrs.evolve(layout.groups[0], sinks=False))
    plain_spec = fp.plan(plain_layout, heads, extend_path=path)
    table = fp.PageTable.sequential(spec.pages_needed)
    gen = torch.Generator().manual_seed(7)
    pool = int(spec.pages_needed.sum())
    cache = torch.randn(pool, 2, layout.page_size, 2, 8, generator=gen)
    q = torch.randn(spec.total_q, 4, 8, generator=gen)
    k, v = (torch.randn(spec.total_q, 2, 8, generator=gen) for _ in range(2))
    results, written = [], []
    for s, lay, sp in ((_ODD_SINKS, layout, spec), (None, plain_layout, plain_spec)):
        ex = fp.ReferenceExecutor(compute_dtype=torch.float64)
        ex.apply(sp, table)
        written.append(cache.clone())
        results.append(ex.run(lay.groups[0], q, k, v, written[-1], return_lse=True, sinks=s))
    (out, lse), (plain_out, plain_lse) = results
    assert torch.isnan(out[:, :2]).all() and torch.isnan(lse[:, :2]).all()
    torch.testing.assert_close(out[:, 2], plain_out[:, 2])
    torch.testing.assert_close(lse[:, 2], plain_lse[:, 2])
    assert torch.isfinite(out[:, 3]).all() and torch.isfinite(lse[:, 3]).all()
    want, want_lse = _dense(layout, layout.groups[0], q, written[0], table, _ODD_SINKS)
    assert torch.isnan(want[:, :2]).all() and torch.isnan(want_lse[:, :2]).all()
    torch.testing.assert_close(out[:, 2:].double(), want[:, 2:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse[:, 2:].double(), want_lse[:, 2:], atol=1e-4, rtol=1e-5)


def test_fold_sinks_non_finite_logits() -> None:
    """The torch fold (the CPU twin of the Triton fold and merge) applies the rule to
    empty and non-empty states alike."""
    from flashplan.torch_kernels import fold_sinks_torch

    v = torch.randn(3, 4, 8)
    s = torch.tensor([[0.5] * 4, [-math.inf] * 4, [2.0] * 4])
    out, lse = fold_sinks_torch(v, s, _ODD_SINKS)
    assert torch.isnan(out[:, :2]).all() and torch.isnan(lse[:, :2]).all()
    torch.testing.assert_close(out[:, 2], torch.where(s[:, 2:3] > -math.inf, v[:, 2], 0.0))
    torch.testing.assert_close(lse[:, 2], s[:, 2])
    assert torch.isfinite(out[:, 3]).all() and torch.isfinite(lse[:, 3]).all()
