"""Shared prefixes (issue 28, the planning side): the `SharedPrefix` record's checks, the
cascade levels' invariants (every request's keys partitioned into its groups' shared
pages and its own part), and the LSE merge of the levels against dense float64 attention
computed straight from the layout, on page tables that keep the callers' promise."""

from __future__ import annotations

import doctest
import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import flashplan as fp
import flashplan.layout.shared_prefix as shared_prefix_module
from flashplan.oracle import visibility


# ---------------------------------------------------------------------------- strategies
@st.composite
def batches(draw, verify: bool = False):  # type: ignore[no-untyped-def]
    """A decode or extend batch (or, with ``verify``, also a tree or chain verify),
    nested groups of consecutive requests, shared lengths within every member's cached
    tokens."""
    page_size = draw(st.sampled_from([1, 2, 4, 16]))
    bs = draw(st.integers(2, 9))
    prefix = np.array(draw(st.lists(st.integers(0, 70), min_size=bs, max_size=bs)))
    tree = None
    if verify and draw(st.booleans()):
        n = draw(st.integers(1, 5))
        parents = np.full((bs, n), -1, dtype=np.int64)
        for j in range(1, n):
            parents[:, j] = draw(st.lists(st.integers(0, j - 1), min_size=bs, max_size=bs))
        tree = fp.DraftTree.from_parents(parents)
    decode = draw(st.booleans()) and tree is None
    new = np.ones(bs, np.int64) if decode else np.array(
        draw(st.lists(st.integers(1, 5), min_size=bs, max_size=bs))
    )  # fmt: skip
    levels = []
    # outer level: a few groups of consecutive requests
    cuts = sorted(set(draw(st.lists(st.integers(1, bs - 1), max_size=3))))
    bounds = [0, *cuts, bs]
    outer = [(a, b) for a, b in itertools.pairwise(bounds) if b - a >= 2]
    outer = [g for g in outer if draw(st.booleans()) or g is outer[0]] if outer else []
    outer_lens = []
    for a, b in outer:
        cap = int(prefix[a:b].min())
        outer_lens.append(draw(st.integers(1, cap)) if cap >= 1 else 0)
    outer = [g for g, n in zip(outer, outer_lens, strict=True) if n >= 1]
    outer_lens = [n for n in outer_lens if n >= 1]
    if outer:
        levels.append(fp.ShareLevel.from_groups([range(a, b) for a, b in outer], outer_lens))
        # an inner level: a sub-range of some outer groups, sharing more
        inner, inner_lens = [], []
        for (a, b), n in zip(outer, outer_lens, strict=True):
            if b - a >= 2 and draw(st.booleans()):
                lo = draw(st.integers(a, b - 2))
                hi = draw(st.integers(lo + 2, b))
                cap = int(prefix[lo:hi].min())
                if cap > n:
                    inner.append(range(lo, hi))
                    inner_lens.append(draw(st.integers(n + 1, cap)))
        if inner:
            levels.append(fp.ShareLevel.from_groups(inner, inner_lens))
    if tree is not None:
        layout = fp.BatchLayout.verify(prefix, tree, page_size=page_size)
    elif decode:
        layout = fp.BatchLayout.decode(prefix + 1, page_size=page_size)
    else:
        layout = fp.BatchLayout.extend(prefix + new, prefix, page_size=page_size)
    shared = fp.SharedPrefix.nested(*levels) if levels else None
    return layout, shared


def _promised_table(layout: fp.BatchLayout, shared: fp.SharedPrefix, seed: int) -> np.ndarray:
    """Page ids ``[bs, width]``: unique pages per request, except that every member of a
    group holds its group's first member's whole shared pages (the callers' promise)."""
    rng = np.random.default_rng(seed)
    need = layout.pages_needed.astype(np.int64)
    width = int(need.max())
    ids = rng.permutation(layout.batch_size * width).reshape(layout.batch_size, width)
    for level in shared.levels:
        for f, c, n in zip(level.first, level.count, level.shared_len, strict=True):
            pages = int(n) // layout.page_size
            ids[f + 1 : f + c, :pages] = ids[f, :pages]
    return ids


def _attend(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, float]:
    """float64 softmax attention of one query over keys; (out, base-2 LSE)."""
    if k.shape[0] == 0:
        return np.zeros_like(q), -math.inf
    s = k @ q
    m = s.max()
    w = np.exp(s - m)
    return (w @ v) / w.sum(), (m + math.log(w.sum())) / math.log(2)


# -------------------------------------------------------------------------------- tests
@given(batches())
def test_levels_partition_every_requests_keys(case) -> None:  # type: ignore[no-untyped-def]
    layout, shared = case
    if shared is None:
        return
    cp = fp.cascade_levels(layout, shared)
    ps = layout.page_size
    qo = np.concatenate([[0], np.cumsum(layout.seq_lens - layout.prefix_lens)])
    deepest = shared.deepest_tokens(layout.batch_size)
    for i in range(layout.batch_size):
        spans = []
        for lv in cp.levels:
            g = lv.group_of_row(int(qo[i]))
            if g >= 0:
                s = lv.spans
                assert s.kv_lens[g] > 0  # no kernel request reads nothing
                spans.append((int(s.first_token[g]), int(s.end_token[g])))
        spans.append((int(cp.own.first_token[i]), int(cp.own.end_token[i])))
        tokens = [t for a, b in sorted(spans) for t in range(a, b)]
        assert tokens == list(range(int(layout.seq_lens[i]))), (i, spans)
        # levels read whole pages only, only cached tokens, and every whole shared page
        for a, b in spans[:-1]:
            assert a % ps == 0 and b % ps == 0 and b <= layout.prefix_lens[i]
        assert cp.own.first_token[i] == deepest[i] // ps * ps
    # a group's call runs every query row of its members (consecutive requests from
    # its first member), in batch order
    for lv in cp.levels:
        assert (np.diff(lv.q_rows) > 0).all() and lv.qo_indptr[-1] == lv.q_rows.shape[0]
        # the gather reads each group's pages from its first member's row, nothing else
        want_start = np.zeros(layout.batch_size, np.int32)
        want_pages = np.zeros(layout.batch_size, np.int32)
        want_start[lv.row_of] = lv.spans.start_page
        want_pages[lv.row_of] = lv.spans.pages.lens
        assert lv.row_start_page.tolist() == want_start.tolist()
        assert lv.row_pages.tolist() == want_pages.tolist()
        owner = np.searchsorted(qo, lv.q_rows, side="right") - 1
        for g in range(lv.row_of.shape[0]):
            mine = owner[lv.qo_indptr[g] : lv.qo_indptr[g + 1]]
            members = np.unique(mine)
            assert members[0] == lv.row_of[g]
            assert members.tolist() == list(range(members[0], members[-1] + 1))
            want = np.concatenate([np.arange(qo[m], qo[m + 1]) for m in members])
            assert lv.q_rows[lv.qo_indptr[g] : lv.qo_indptr[g + 1]].tolist() == want.tolist()


@given(batches(), st.integers(0, 2**16))
def test_merged_levels_equal_dense_attention(case, seed: int) -> None:  # type: ignore[no-untyped-def]
    """Each level's call over its representative's pages, each request's own call
    (causal), merged by LSE: equal to dense causal attention of every query over its
    request's row, in float64."""
    layout, shared = case
    if shared is None:
        return
    ps, d = layout.page_size, 8
    ids = _promised_table(layout, shared, seed)
    rng = np.random.default_rng(seed)
    pool_k = rng.standard_normal((ids.max() + 1, ps, d))
    pool_v = rng.standard_normal((ids.max() + 1, ps, d))

    def row_tokens(i: int, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        t = np.arange(a, b)
        pages = ids[i, t // ps]
        return pool_k[pages, t % ps], pool_v[pages, t % ps]

    cp = fp.cascade_levels(layout, shared)
    qo = np.concatenate([[0], np.cumsum(layout.seq_lens - layout.prefix_lens)])
    queries = rng.standard_normal((int(qo[-1]), d))
    for i in range(layout.batch_size):
        for r in range(int(qo[i]), int(qo[i + 1])):
            pos = int(layout.prefix_lens[i]) + r - int(qo[i])
            want, want_lse = _attend(queries[r], *row_tokens(i, 0, pos + 1))
            parts = []
            for lv in cp.levels:
                g = lv.group_of_row(int(qo[i]))
                if g >= 0:  # the level's call: the group's first member's row, no mask
                    s = lv.spans
                    rep = int(lv.row_of[g])
                    first = int(s.start_page[g]) * ps
                    parts.append(
                        _attend(queries[r], *row_tokens(rep, first, first + int(s.kv_lens[g])))
                    )
            own = cp.own
            a = int(own.first_token[i])
            parts.append(_attend(queries[r], *row_tokens(i, a, pos + 1)))  # causal
            lses = np.array([p[1] for p in parts])
            lse = np.log2(np.sum(np.exp2(lses[np.isfinite(lses)])))
            out = sum(np.exp2(p[1] - lse) * p[0] for p in parts if np.isfinite(p[1]))
            np.testing.assert_allclose(out, want, rtol=1e-10, atol=1e-12)
            assert abs(lse - want_lse) < 1e-9


@given(batches(), st.integers(0, 2**16))
def test_check_shared_pages_finds_a_broken_promise(case, seed: int) -> None:  # type: ignore[no-untyped-def]
    layout, shared = case
    if shared is None:
        return
    ids = _promised_table(layout, shared, seed)
    rows = np.arange(layout.batch_size)
    fp.check_shared_pages(shared, torch.from_numpy(ids.astype(np.int32)), rows, layout.page_size)
    level = shared.levels[-1]
    g = int(np.argmax(level.shared_len // layout.page_size))
    n = int(level.shared_len[g]) // layout.page_size
    if n == 0:
        return
    broken = ids.copy()
    m = int(level.first[g]) + 1
    broken[m, n - 1] = ids.max() + 1
    with pytest.raises(fp.PageTableError) as err:
        fp.check_shared_pages(
            shared, torch.from_numpy(broken.astype(np.int32)), rows, layout.page_size
        )
    assert err.value.request == m and err.value.values["column"] == n - 1


def test_levels_of_a_parallel_sampling_batch() -> None:
    """64 requests in groups of 8 over a 2048-token prompt, 16 tokens each of their own:
    one call per group over the 128 shared pages, each request's own call over 1 page."""
    seq = np.full(64, 2048 + 16)
    layout = fp.BatchLayout.decode(seq, page_size=16)
    shared = fp.SharedPrefix.from_groups([range(8 * g, 8 * g + 8) for g in range(8)], [2048] * 8)
    cp = fp.cascade_levels(layout, shared)
    (lv,) = cp.levels
    assert lv.qo_indptr.tolist() == list(range(0, 65, 8))
    assert lv.spans.pages.lens.tolist() == [128] * 8
    assert cp.own.start_page.tolist() == [128] * 64 and cp.own.kv_lens.tolist() == [16] * 64
    heads = fp.HeadConfig(32, 8, 128)
    plain, cascade = fp.planning.cascade.cascade_bytes(layout, shared, heads)
    assert plain == 64 * 2064 * 2 * 8 * 128 * 2 and cascade == (8 * 2048 + 64 * 16) * 4096
    # the model (calibrated on run BE): at 64 requests the L2 cache already serves
    # most of the plain call's repeated reads (68 µs), less than a level costs (88 µs);
    # at 256 in groups of 8 over 2048 (measured: 1.69x) the levels pay
    assert not fp.cascade_pays(layout, shared, heads)
    many = fp.BatchLayout.decode(np.full(256, 2048 + 128), page_size=16)
    groups = fp.SharedPrefix.from_groups([range(8 * g, 8 * g + 8) for g in range(32)], [2048] * 32)
    assert fp.cascade_pays(many, groups, heads)
    # a shared page's worth of tokens is not worth a level
    small = fp.SharedPrefix.from_groups([range(0, 2)], [16])
    assert not fp.cascade_pays(layout, small, heads)


@pytest.mark.parametrize(
    ("make", "field", "values"),
    [
        (lambda: fp.SharedPrefix.from_groups([[0, 2]], [5]), "groups", {"group": 0}),
        (lambda: fp.SharedPrefix.from_groups([[3]], [5]), "count", {"group": 0, "count": 1}),
        (lambda: fp.SharedPrefix.from_groups([[0, 1], [1, 2]], [4, 4]), "first", {"group": 1}),
        (lambda: fp.SharedPrefix.from_groups([[0, 1]], [0]), "shared_len", {"group": 0}),
        (
            lambda: fp.SharedPrefix.nested(
                fp.ShareLevel.from_groups([[0, 1, 2]], [8]),
                fp.ShareLevel.from_groups([[2, 3]], [12]),
            ),
            "levels",
            {"level": 1, "group": 0},
        ),
        (
            lambda: fp.SharedPrefix.nested(
                fp.ShareLevel.from_groups([[0, 1, 2]], [8]),
                fp.ShareLevel.from_groups([[0, 1]], [8]),
            ),
            "shared_len",
            {"level": 1, "outer_shared_len": 8},
        ),
        (lambda: fp.SharedPrefix.nested(), "levels", {}),
    ],
)
def test_bad_sharing_is_refused_by_name(make, field: str, values: dict) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(fp.LayoutError) as err:
        make()
    assert err.value.field == field
    for k, v in values.items():
        assert err.value.values.get(k, getattr(err.value, k, None)) == v, (k, err.value)


def test_sharing_that_does_not_fit_the_batch_is_refused() -> None:
    layout = fp.BatchLayout.decode([20, 20, 9], page_size=4)  # cached: 19, 19, 8
    with pytest.raises(fp.LayoutError, match="past the batch") as err:
        fp.cascade_levels(layout, fp.SharedPrefix.from_groups([[2, 3]], [4]))
    assert err.value.values["count"] == 2
    with pytest.raises(fp.LayoutError, match="cached") as err:
        fp.cascade_levels(layout, fp.SharedPrefix.from_groups([[1, 2]], [12]))
    assert err.value.request == 2 and err.value.values["prefix_len"] == 8
    with pytest.raises(fp.FieldTypeError):
        fp.cascade_levels(layout, [[0, 1]])  # type: ignore[arg-type]


def test_docstring_examples_hold() -> None:
    result = doctest.testmod(shared_prefix_module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


@given(batches(verify=True), st.integers(0, 2**16))
def test_reference_executor_runs_cascade_plans_as_plain_ones(case, seed: int) -> None:  # type: ignore[no-untyped-def]
    """``plan(..., shared_prefix=, cascade="on")`` on the reference executor: outputs,
    LSE and written cache equal the plan without levels (float64 math), new tokens
    written in the same step; decode, extend and tree or chain verify batches (a tree's
    own calls run under the tree mask without the shared columns)."""
    layout, shared = case
    heads = fp.HeadConfig(4, 2, 8, q_dtype=torch.float32)
    plans = [
        fp.plan(layout, heads, extend_path="paged", shared_prefix=shared, cascade=c)
        for c in ("off", "on")
    ]
    assert plans[0].cascade is None
    if shared is None:
        assert plans[1].cascade is None
        return
    if plans[1].cascade is None:  # nothing shared a whole page
        assert not fp.cascade_levels(layout, shared).levels
        return
    assert plans[1].cascade.groups == (0,)
    ids = _promised_table(layout, shared, seed)
    table = fp.PageTable(
        torch.from_numpy(ids.astype(np.int32)), np.arange(layout.batch_size), int(ids.max()) + 1
    )
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(int(ids.max()) + 1, 2, layout.page_size, 2, 8, generator=gen)
    total = plans[0].total_q
    q, k, v = (torch.randn(total, h, 8, generator=gen) for h in (4, 2, 2))
    results = []
    for spec in plans:
        ex = fp.ReferenceExecutor(compute_dtype=torch.float64)
        ex.apply(spec, table)
        c = cache.clone()
        out, lse = ex.run(layout.groups[0], q, k, v, c, return_lse=True)
        results.append((out, lse, c))
    (o0, l0, c0), (o1, l1, c1) = results
    assert torch.equal(c0, c1)
    torch.testing.assert_close(o1, o0, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(l1, l0, rtol=1e-6, atol=1e-6)


def test_cascade_choices() -> None:
    """``auto`` records the levels where they pay, ``off`` never; groups that cannot run
    on them (a window, sinks) plan without; the FlashInfer executor runs the plan eagerly
    and refuses it by name in a CUDA-graph bucket; a bad choice is refused."""
    from flashplan.executor.flashinfer.calls import check_runnable

    heads = fp.HeadConfig(32, 8, 128)
    groups = (fp.AttentionGroup.full(), fp.AttentionGroup.sliding(64))
    layout = fp.BatchLayout.decode(np.full(256, 2176), page_size=16, groups=groups)
    big = fp.SharedPrefix.from_groups([range(8 * g, 8 * g + 8) for g in range(32)], [2048] * 32)
    small = fp.SharedPrefix.from_groups([range(0, 2)], [16])
    auto = fp.plan(layout, heads, shared_prefix=big, cascade="auto")
    assert auto.cascade is not None and auto.cascade.groups == (0,)  # not the window
    assert fp.plan(layout, heads, shared_prefix=small, cascade="auto").cascade is None
    assert fp.plan(layout, heads, shared_prefix=small, cascade="on").cascade is not None
    assert fp.plan(layout, heads, shared_prefix=big).cascade is None  # "off" by default
    check_runnable(auto)  # eager FlashInfer runs the levels
    with pytest.raises(fp.UnsupportedError, match="cascade"):
        check_runnable(auto, graph=True)  # a CUDA-graph bucket does not yet
    with pytest.raises(fp.LayoutError, match="cascade"):
        fp.plan(layout, heads, shared_prefix=big, cascade="yes")
    with pytest.raises(fp.FieldTypeError, match="shared_prefix"):
        fp.plan(layout, heads, shared_prefix=[[0, 1]], cascade="on")  # type: ignore[arg-type]


# ---------------------------------------------------- the FlashInfer executor's calls
def _emulated_call(
    kw: dict, rows: np.ndarray, q: np.ndarray, pool_k: np.ndarray, pool_v: np.ndarray,
    causal: bool,
) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """What a FlashInfer paged call computes from its resolved ``plan()`` arguments, in
    float64 (one head): kernel request ``r`` runs query rows ``rows[qo_indptr[r]:
    qo_indptr[r + 1]]`` over the first ``(pages - 1) * page_size + last_page_len`` keys
    of its pages (FlashInfer's formula), causal bottom-right aligned when asked."""
    indptr = kw.get("paged_kv_indptr", kw.get("indptr"))
    indices = kw.get("paged_kv_indices", kw.get("indices"))
    last = kw.get("paged_kv_last_page_len", kw.get("last_page_len"))
    qo = kw.get("qo_indptr", np.arange(indptr.shape[0]))  # decode: one row per request
    ps, d = pool_k.shape[1], q.shape[1]
    out, lse = np.zeros((rows.shape[0], d)), np.full(rows.shape[0], -math.inf)
    for r in range(indptr.shape[0] - 1):
        pages = indices[indptr[r] : indptr[r + 1]]
        kv_len = max(len(pages) - 1, 0) * ps + int(last[r])
        keys, vals = pool_k[pages].reshape(-1, d)[:kv_len], pool_v[pages].reshape(-1, d)[:kv_len]
        n = qo[r + 1] - qo[r]
        for j in range(n):
            seen = kv_len - n + j + 1 if causal else kv_len
            out[qo[r] + j], lse[qo[r] + j] = _attend(q[rows[qo[r] + j]], keys[:seen], vals[:seen])
    return out, lse


def _merge(
    a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    (oa, sa), (ob, sb) = a, b
    s = np.logaddexp2(sa, sb)
    wa = np.where(np.isinf(sa), 0.0, np.exp2(sa - np.where(np.isinf(s), 0.0, s)))
    wb = np.where(np.isinf(sb), 0.0, np.exp2(sb - np.where(np.isinf(s), 0.0, s)))
    return wa[:, None] * oa + wb[:, None] * ob, s


@given(batches(), st.integers(0, 2**16), st.booleans())
def test_flashinfer_cascade_calls_compute_dense_attention(case, seed: int, tc: bool) -> None:  # type: ignore[no-untyped-def]
    """The FlashInfer executor's calls of a cascade plan, emulated on the CPU from their
    resolved ``plan()`` arguments and the gathered page ids (the gather job table run
    on the host): the own call (causal) and every level's call (non-causal, its groups'
    members' rows — gathered by ``q_rows`` only where a level leaves rows out), merged
    by LSE as ``run`` merges them, equal dense float64 attention over each request's row.
    Every call binds to FlashInfer's ``plan()``; the staged KV lengths are FlashInfer's."""
    import inspect

    import flashinfer

    from flashplan.executor.flashinfer import ExecutorPolicy, translate
    from flashplan.executor.flashinfer.calls import DeviceIndices, HostArray, WrapperKind
    from flashplan.executor.gathers import gather_jobs, is_pages_region

    layout, shared = case
    if shared is None:
        return
    heads = fp.HeadConfig(4, 2, 64)
    spec = fp.plan(layout, heads, extend_path="paged", shared_prefix=shared, cascade="on")
    if spec.cascade is None:  # nothing shared a whole page
        return
    tr = translate(spec, ExecutorPolicy(decode_tensor_cores=tc), sm90=False)
    (gc,) = tr.calls
    inputs = tr.inputs
    assert len(gc.levels) == len(spec.cascade.levels.levels) == len(inputs.level_spans) > 0
    ids = _promised_table(layout, shared, seed)
    rows_of = np.arange(layout.batch_size)
    jobs = gather_jobs(spec, rows_of, spans=inputs.spans, level_spans=inputs.level_spans)
    gathered = np.full(jobs.total, -1)
    for r, f, c, dst, div in zip(*jobs.columns()[:5], strict=True):
        if div == 1:
            gathered[dst : dst + c] = ids[r, f : f + c]
    plan_fn = flashinfer.BatchPrefillWithPagedKVCacheWrapper.plan

    def resolved(call):  # type: ignore[no-untyped-def]
        kw = {}
        for name, value in call.kwargs:
            if isinstance(value, HostArray):
                value = inputs.host[value.name]
            elif isinstance(value, DeviceIndices):
                region = jobs.region(value.region)
                assert is_pages_region(region.name)
                value = gathered[region.lo : region.hi]
            kw[name] = value
        return kw

    rng = np.random.default_rng(seed)
    ps, d = layout.page_size, 8
    pool_k = rng.standard_normal((ids.max() + 1, ps, d))
    pool_v = rng.standard_normal((ids.max() + 1, ps, d))
    q = rng.standard_normal((spec.total_q, d))
    all_rows = np.arange(spec.total_q)
    assert gc.paged is not None
    state = _emulated_call(resolved(gc.paged), all_rows, q, pool_k, pool_v, causal=True)
    for k, call in enumerate(gc.levels):
        assert call.wrapper.kind is WrapperKind.PAGED_PREFILL and call.wrapper.level == k
        inspect.signature(plan_fn).bind(None, **call.as_dict())
        kw = resolved(call)
        assert kw["causal"] is False and kw["window_left"] == -1
        fi_kv = (
            np.maximum(np.diff(kw["paged_kv_indptr"]) - 1, 0) * ps + kw["paged_kv_last_page_len"]
        )
        assert spec.cascade is not None  # FlashInfer's KV lengths are the level's own
        assert fi_kv.tolist() == spec.cascade.levels.levels[k].spans.kv_lens.tolist()
        partial = f"l{k}.q_rows" in inputs.host
        rows = inputs.host[f"l{k}.q_rows"] if partial else all_rows
        assert int(kw["qo_indptr"][-1]) == rows.shape[0]
        assert partial == (rows.shape[0] != spec.total_q)
        o_l, s_l = _emulated_call(kw, rows, q, pool_k, pool_v, causal=False)
        o, s = _merge((state[0][rows], state[1][rows]), (o_l, s_l))
        state[0][rows], state[1][rows] = o, s
    qo = spec.qo_indptr
    for i in range(layout.batch_size):
        keys = pool_k[ids[i]].reshape(-1, d)
        vals = pool_v[ids[i]].reshape(-1, d)
        for j in range(int(qo[i + 1] - qo[i])):
            seen = int(layout.prefix_lens[i]) + j + 1
            want_o, want_s = _attend(q[qo[i] + j], keys[:seen], vals[:seen])
            np.testing.assert_allclose(state[0][qo[i] + j], want_o, rtol=1e-9, atol=1e-9)
            assert state[1][qo[i] + j] == pytest.approx(want_s, rel=1e-9, abs=1e-9)


@given(batches(), st.integers(0, 2**16))
def test_share_pages_keeps_the_promise(case, seed: int) -> None:  # type: ignore[no-untyped-def]
    """``share_pages`` over a shuffled table: the promise holds, and only the members'
    whole shared pages changed."""
    layout, shared = case
    if shared is None:
        return
    table = fp.PageTable.shuffled(layout.pages_needed, seed=seed)
    ps = layout.page_size
    pages = fp.share_pages(shared, table.pages, table.rows, ps)
    fp.check_shared_pages(shared, pages, table.rows, ps)
    changed = (pages != table.pages).numpy()
    allowed = np.zeros_like(changed)
    for level in shared.levels:
        for f, c, n in zip(level.first, level.count, level.shared_len, strict=True):
            allowed[table.rows[f + 1 : f + c], : int(n) // ps] = True
    assert not (changed & ~allowed).any()


@given(batches(verify=True))
def test_own_tree_mask_is_the_tree_mask_without_the_shared_columns(case) -> None:  # type: ignore[no-untyped-def]
    """A tree verify's own mask, row by row, is the plain plan's tree mask with the
    columns of the levels' pages cut off; those columns are all visible to every draft
    token; the FlashInfer own call carries it (and is not causal)."""
    from flashplan.executor.flashinfer import ExecutorPolicy, translate
    from flashplan.executor.flashinfer.calls import BuiltMask

    layout, shared = case
    if shared is None or layout.draft is None:
        return
    heads = fp.HeadConfig(4, 2, 64)
    plain = fp.plan(layout, heads)
    on = fp.plan(layout, heads, shared_prefix=shared, cascade="on")
    if on.cascade is None:  # nothing shared a whole page
        return
    mask = plain.group_plans[0].paged.mask
    if layout.draft.is_chain:  # a chain is causal: no masks anywhere
        assert mask is None and on.cascade.own_mask is None
        return
    own = on.cascade.own_mask
    assert own is not None
    ps = layout.page_size
    start = plain.group_plans[0].paged.start_page
    for i in range(layout.batch_size):
        cut = (int(on.cascade.levels.own.start_page[i]) - int(start[i])) * ps
        full = mask.dense(i)
        assert full[:, :cut].all()
        np.testing.assert_array_equal(own.dense(i), full[:, cut:])
    (gc,) = translate(on, ExecutorPolicy(), sm90=False).calls
    kw = gc.paged.as_dict()
    assert kw["causal"] is False and kw["packed_custom_mask"] == BuiltMask(0)


@given(batches(verify=True))
def test_materialized_cascade_calls_equal_the_oracle(case) -> None:  # type: ignore[no-untyped-def]
    """``materialize`` of a cascade plan rebuilds each request's visibility from the
    level calls and the own call (not the group's paged call): equal to the oracle's
    dense mask computed straight from the layout, and to the plain plan's."""
    layout, shared = case
    if shared is None:
        return
    heads = fp.HeadConfig(4, 2, 64)
    on = fp.plan(layout, heads, shared_prefix=shared, cascade="on")
    if on.cascade is None:
        return
    group = layout.groups[0]
    got = fp.materialize(on, group)
    for i, (g, want) in enumerate(zip(got, visibility(layout, group), strict=True)):
        np.testing.assert_array_equal(g, want, err_msg=f"request {i}")
    # and the cascade calls really are what materialize read: breaking the own part shows
    own = on.cascade.levels.own
    if on.cascade.own_mask is None and int(own.kv_lens.max()) > layout.page_size:
        import attrs

        from flashplan.lengths import PageSpans

        ps = layout.page_size
        moved = PageSpans.from_page_start(own.start_page + (own.kv_lens > ps), own.end_token, ps)
        levels = attrs.evolve(on.cascade.levels, own=moved)
        broken = attrs.evolve(on, cascade=attrs.evolve(on.cascade, levels=levels))
        bad = fp.materialize(broken, group)
        assert any(not np.array_equal(b, w) for b, w in zip(bad, got, strict=True))


# ------------------------------------------------- every group kind and mode (issue 50)
@st.composite
def grouped_batches(draw):  # type: ignore[no-untyped-def]
    """:func:`batches` of every mode (decode, extend, block extend, tree and chain
    verify) with one to three distinct groups of every self kind: causal, bidirectional,
    sliding windows, bidirectional bands, chunked, each with or without sinks, soft cap
    and scale (verify batches plan causal groups only)."""
    from flashplan.testing import LOCAL_GROUP_KINDS, attention_groups

    layout, shared = draw(batches(verify=True))
    kinds = ("full",) if layout.draft is not None else ("full", "sliding", "bidirectional")
    if layout.draft is None:
        kinds += LOCAL_GROUP_KINDS
    groups = draw(
        st.lists(
            attention_groups(kinds=kinds, max_window=40, sinks=True), min_size=1, max_size=3,
            unique=True,
        )
    )  # fmt: skip
    if layout.draft is None and layout.mode is not fp.Mode.DECODE and draw(st.booleans()):
        # a block extend: the new tokens of a request form one bidirectional block
        block = int(layout.extend_lens.max())
        seq = layout.prefix_lens + block
        layout = fp.BatchLayout.block_extend(seq, block, page_size=layout.page_size)
        groups.append(layout.groups[0])
    return layout.with_groups(*dict.fromkeys(groups)), shared


def _promise_holds(layout: fp.BatchLayout, shared: fp.SharedPrefix | None) -> bool:
    if shared is None:
        return False
    try:
        shared.check_batch(layout.batch_size, layout.prefix_lens)
    except fp.LayoutError:
        return False
    return True


@given(grouped_batches(), st.integers(0, 2**16))
def test_cascade_on_equals_off_for_every_group_kind(case, seed: int) -> None:  # type: ignore[no-untyped-def]
    """Issue 50, item 1: every group that runs on cascade levels — a bidirectional one
    too — gives, on the reference executor, the outputs and LSE of the plan without
    levels and of float64 attention computed straight from the layout's rules
    (``flashplan.oracle``); ``materialize`` of the cascade plan is the oracle's mask;
    and the FlashInfer translation of each cascade group's own call carries the own
    call's causal flag (plan = run)."""
    from flashplan.executor.flashinfer import ExecutorPolicy, translate
    from flashplan.oracle import dense_attention, key_row_tokens

    layout, shared = case
    if not _promise_holds(layout, shared):
        return
    heads = fp.HeadConfig(4, 2, 8, q_dtype=torch.float32)
    off = fp.plan(layout, heads, extend_path="paged")
    on = fp.plan(layout, heads, extend_path="paged", shared_prefix=shared, cascade="on")
    if on.cascade is None:
        return
    for at, k in enumerate(on.cascade.groups):
        gp = on.group_plans[k]
        assert gp.paged is not None and on.cascade.own_causal[at] == gp.paged.causal
        own = on.cascade.own_call(k)  # (a decode's one query: its flag changes nothing)
        assert own.causal == (gp.paged.causal and on.cascade.own_mask is None)
    for gc in translate(on, ExecutorPolicy(), sm90=False).calls:
        if gc.levels and gc.paged is not None and "causal" in gc.paged.as_dict():
            assert gc.paged.as_dict()["causal"] == on.cascade.own_call(gc.group_index).causal
    for group in layout.groups:
        got = fp.materialize(on, group)
        for i, (g, want) in enumerate(zip(got, visibility(layout, group), strict=True)):
            np.testing.assert_array_equal(g, want, err_msg=f"{group.describe()}, request {i}")

    ids = _promised_table(layout, shared, seed)
    table = fp.PageTable(
        torch.from_numpy(ids.astype(np.int32)), np.arange(layout.batch_size), int(ids.max()) + 1
    )
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(int(ids.max()) + 1, 2, layout.page_size, 2, 8, generator=gen)
    total = off.total_q
    q, k, v = (torch.randn(total, h, 8, generator=gen) for h in (4, 2, 2))
    sinks = torch.randn(4, generator=gen)
    qo = off.qo_indptr
    for group in layout.groups:
        s = sinks if group.sinks else None
        results = []
        for spec in (off, on):
            ex = fp.ReferenceExecutor(compute_dtype=torch.float64)
            ex.apply(spec, table)
            c = cache.clone()
            results.append((*ex.run(group, q, k, v, c, return_lse=True, sinks=s), c))
        (o0, l0, c0), (o1, l1, c1) = results
        assert torch.equal(c0, c1)
        torch.testing.assert_close(o1, o0, rtol=1e-6, atol=1e-6, msg=group.describe)
        torch.testing.assert_close(l1, l0, rtol=1e-6, atol=1e-6, msg=group.describe)
        # and both equal float64 attention straight from the rules, on the written cache
        seen = visibility(layout, group)
        rows = key_row_tokens(layout, group)
        flat_k = c0[:, 0].reshape(-1, 2, 8)
        flat_v = c0[:, 1].reshape(-1, 2, 8)
        ps = layout.page_size
        for i in range(layout.batch_size):
            slot = torch.from_numpy(ids[i][rows[i] // ps] * ps + rows[i] % ps)
            want_o, want_l = dense_attention(
                q[qo[i] : qo[i + 1]], flat_k[slot], flat_v[slot], seen[i], group, s
            )
            got_o, got_l = o1[qo[i] : qo[i + 1]].double(), l1[qo[i] : qo[i + 1]].double()
            torch.testing.assert_close(got_o, want_o, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got_l, want_l, rtol=1e-5, atol=1e-5)


def test_explain_of_a_bidirectional_cascade_matches() -> None:
    """The issue's own reproduction: ``explain`` of a bidirectional group on shared
    levels prints no MISMATCH and exits 0, and the own parts are non-causal."""
    import contextlib
    import io

    from flashplan.__main__ import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(
            ["explain", "--seq-lens", "6,7", "--prefix-lens", "4,4", "--page-size", "2",
             "--bidirectional", "--shared", "0-1:4"]
        )  # fmt: skip
    text = buf.getvalue()
    assert code in (0, None), text
    assert "MISMATCH" not in text
    assert "group plan 0 non-causal" in text
