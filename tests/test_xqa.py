"""XQA decodes (``ExecutorPolicy.decode_backend``) on the CPU: which calls the policy
sends to XQA and what it refuses, by name; the whole XQA path of the executor over the
twin (dense block tables gathered, lengths staged, scales mapped, windows and sinks) —
eager, in a CUDA-graph bucket, over multi-step drafts, in the checked mode and over one
long-lived executor — against the reference executor on the e4m3-rounded queries that
XQA's kernel reads."""

from __future__ import annotations

import math

import attrs
import numpy as np
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import flashplan as fp
from flashplan.executor.flashinfer import (
    ExecutorPolicy,
    FlashInferExecutor,
    GraphBucket,
    capture,
    graph_executor,
)
from flashplan.executor.flashinfer.calls import WrapperKind, call_skeleton
from flashplan.executor.flashinfer.xqa import xqa_scratch_bytes, xqa_sm_count
from flashplan.executor.gathers import gather_jobs
from flashplan.twin import flashinfer_twin
from flashplan.twin.xqa import e4m3_queries

E4M3 = torch.float8_e4m3fn
HEADS = fp.HeadConfig(8, 2, 32, q_dtype=torch.bfloat16, kv_dtype=E4M3)
GROUPS = (
    fp.AttentionGroup.full(),
    fp.AttentionGroup.sliding(20),
    fp.AttentionGroup.full(sinks=True),
    fp.AttentionGroup.sliding(40, sinks=True),
)
SOFT_CAP = fp.AttentionGroup.full(logits_soft_cap=30.0)
#: Twin against reference on the same (rounded) queries: float32 against float32, bf16 out.
TOL = 1e-2
XQA = ExecutorPolicy(decode_backend="xqa")


def _executor(policy: ExecutorPolicy = XQA, **kw: object) -> FlashInferExecutor:
    return FlashInferExecutor(flashinfer=flashinfer_twin, policy=policy, **kw)  # type: ignore[arg-type]


def _rounded(q: torch.Tensor) -> torch.Tensor:
    return e4m3_queries(q).to(q.dtype)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6))


def _kinds(spec: fp.PlanSpec, policy: ExecutorPolicy, *, sm90: bool) -> list[WrapperKind]:
    calls = call_skeleton(spec, policy, sm90=sm90, xqa=True)
    return [gc.paged.wrapper.kind for gc in calls if gc.paged is not None]


# -- the choice -----------------------------------------------------------------------------
def test_auto_picks_xqa_for_e4m3_decodes_on_hopper_only() -> None:
    groups = (*GROUPS, SOFT_CAP)
    spec = fp.plan(fp.BatchLayout.decode([5, 40], page_size=16, groups=groups), HEADS)
    auto = ExecutorPolicy()
    assert _kinds(spec, auto, sm90=True) == [WrapperKind.XQA] * 4 + [WrapperKind.DECODE]
    assert _kinds(spec, auto, sm90=False) == [WrapperKind.DECODE] * 5
    assert _kinds(spec, ExecutorPolicy(decode_backend="fa2"), sm90=True) == [WrapperKind.DECODE] * 5
    bf16 = fp.HeadConfig(8, 2, 32, q_dtype=torch.bfloat16)
    spec16 = fp.plan(fp.BatchLayout.decode([5, 40], page_size=16), bf16)
    assert _kinds(spec16, auto, sm90=True) == [WrapperKind.DECODE]  # FA2 is as fast there
    assert _kinds(spec16, XQA, sm90=True) == [WrapperKind.XQA]  # forced: XQA runs bf16 too
    extend = fp.plan(fp.BatchLayout.extend([5, 40], [3, 2], page_size=16), HEADS)
    assert _kinds(extend, XQA, sm90=True) == [WrapperKind.PAGED_PREFILL]  # decodes only
    no_xqa = call_skeleton(spec, auto, sm90=True, xqa=False)  # flashinfer without xqa
    assert all(gc.paged.wrapper.kind is WrapperKind.DECODE for gc in no_xqa if gc.paged)


@pytest.mark.parametrize(
    ("layout_kw", "heads", "why"),
    [
        ({"groups": (SOFT_CAP,)}, HEADS, "soft cap"),
        (
            {},
            fp.HeadConfig(8, 2, 32, q_dtype=torch.bfloat16, kv_dtype=torch.float8_e5m2),
            "float8_e5m2",
        ),
        ({"page_size": 8}, HEADS, "page size 8"),
        ({}, fp.HeadConfig(8, 2, 24, q_dtype=torch.bfloat16, kv_dtype=E4M3), "head_dim 24"),
        ({}, fp.HeadConfig(8, 2, 32, q_dtype=torch.float32), "float32"),
    ],
)
def test_forced_xqa_refuses_what_it_cannot_run_by_name(
    layout_kw: dict[str, object], heads: fp.HeadConfig, why: str
) -> None:
    kw = {"page_size": 16, **layout_kw}
    spec = fp.plan(fp.BatchLayout.decode([5, 40], **kw), heads)  # type: ignore[arg-type]
    with pytest.raises(fp.UnsupportedError, match=rf"decode_backend.*{why}") as info:
        _kinds(spec, XQA, sm90=True)
    assert "'fa2'" in str(info.value)
    assert _kinds(spec, ExecutorPolicy(), sm90=True) == [WrapperKind.DECODE]  # auto: FA2


def test_forced_xqa_needs_flashinfer_with_xqa() -> None:
    spec = fp.plan(fp.BatchLayout.decode([5], page_size=16), HEADS)
    with pytest.raises(fp.UnsupportedError, match=r"flashinfer\.xqa"):
        call_skeleton(spec, XQA, sm90=True, xqa=False)
    with pytest.raises(fp.OptionError, match="decode_backend"):
        ExecutorPolicy(decode_backend="trtllm")


def test_dense_block_table_rows() -> None:
    """An XQA group's region holds one row of ``width`` page ids per request (the gather's
    dense layout), its page ids first."""
    spec = fp.plan(fp.BatchLayout.decode([5, 40, 17], page_size=16), HEADS)
    table = fp.PageTable.shuffled(spec.pages_needed, seed=0)
    part = spec.group_plans[0].paged
    assert part is not None
    jobs = gather_jobs(spec, table.rows, spans={0: (part.start_page, part.num_pages)},
                       widths={0: 3})  # fmt: skip
    r = jobs.region("pages/0")
    assert (r.lo, r.size) == (0, 9)
    assert jobs.dst[:3].tolist() == [0, 3, 6]
    written = jobs.written()[r.lo : r.hi].reshape(3, 3)
    assert written.tolist() == [[True, False, False], [True, True, True], [True, True, False]]


# -- the executor over the twin -------------------------------------------------------------
def _run_groups(
    ex: FlashInferExecutor, spec: fp.PlanSpec, table: fp.PageTable, groups: tuple, seed: int,
    scales: tuple[object, object],
) -> float:  # fmt: skip
    """Every group on ``ex`` and a fresh reference (rounded queries); the worst error
    (inf where the caches written differ)."""
    gen = torch.Generator().manual_seed(seed)
    ref = fp.ReferenceExecutor()
    ref.apply(spec, table)
    ps, n = spec.page_size, spec.total_q
    worst = 0.0
    for group in groups:
        cache = torch.randn(int(table.num_pages or 0), 2, ps, 2, 32, generator=gen).to(E4M3)
        q = torch.randn(n, 8, 32, generator=gen).to(torch.bfloat16)
        k = torch.randn(n, 2, 32, generator=gen).to(torch.bfloat16)
        sinks = torch.randn(8, generator=gen) * 3 if group.sinks else None
        c_ref = cache.clone()
        out = ex.run(group, q, k, k, cache, sinks=sinks, k_scale=scales[0], v_scale=scales[1])
        ref.run(group, q, k, k, c_ref, sinks=sinks, k_scale=0.37, v_scale=1.9)
        if not torch.equal(cache.view(torch.uint8), c_ref.view(torch.uint8)):
            return float("inf")
        want = ref.run(group, _rounded(q), None, None, c_ref, sinks=sinks, k_scale=0.37,
                       v_scale=1.9)  # fmt: skip
        worst = max(worst, _rel(out, want))
    return worst


@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("scales", ["number", "tensor"])
def test_xqa_decode_equals_reference(page_size: int, scales: str) -> None:
    pair = (0.37, 1.9) if scales == "number" else (torch.tensor(0.37), torch.tensor(1.9))
    seq = [1, 2, 16, 17, 33, 64, 65, 150, 401]
    spec = fp.plan(fp.BatchLayout.decode(seq, page_size=page_size, groups=GROUPS), HEADS)
    table = fp.PageTable.shuffled(spec.pages_needed, seed=page_size, spare_pages=7)
    ex = _executor()
    ex.apply(spec, table)
    assert _run_groups(ex, spec, table, GROUPS, page_size, pair) <= TOL


def test_return_lse_is_refused_before_any_write() -> None:
    spec = fp.plan(fp.BatchLayout.decode([5, 40], page_size=16), HEADS)
    table = fp.PageTable.shuffled(spec.pages_needed, seed=0)
    ex = _executor()
    ex.apply(spec, table)
    cache = torch.zeros(int(table.num_pages or 0), 2, 16, 2, 32).to(E4M3)
    q = torch.randn(2, 8, 32).to(torch.bfloat16)
    k = torch.ones(2, 2, 32).to(torch.bfloat16)
    with pytest.raises(fp.UnsupportedError, match=r"no LSE.*decode_backend='fa2'"):
        ex.run(spec.key.groups[0], q, k, k, cache, return_lse=True)
    assert not cache.view(torch.uint8).any()  # nothing written


def test_nan_and_inf_sink_logits_give_nan_heads_on_xqa() -> None:
    group = fp.AttentionGroup.full(sinks=True)
    spec = fp.plan(fp.BatchLayout.decode([5, 40], page_size=16, groups=(group,)), HEADS)
    table = fp.PageTable.shuffled(spec.pages_needed, seed=0)
    ex = _executor()
    ex.apply(spec, table)
    cache = torch.randn(int(table.num_pages or 0), 2, 16, 2, 32).to(E4M3)
    sinks = torch.zeros(8)
    sinks[1], sinks[5] = float("nan"), float("inf")
    out = ex.run(group, torch.randn(2, 8, 32).to(torch.bfloat16), None, None, cache, sinks=sinks)
    assert out[:, [1, 5]].isnan().all() and not out[:, [0, 2, 3, 4, 6, 7]].isnan().any()


def test_graph_bucket_replays_equal_eager_bit_for_bit_and_the_reference() -> None:
    """A decode bucket over XQA (its dense table of ``max_pages`` columns, its own
    lengths buffer) replayed over batches of other sizes and tables: each replay equals
    an eager XQA decode of the same inputs bit for bit, and the reference."""
    rng = np.random.default_rng(1)
    ps, bucket = 16, GraphBucket.decode(batch_size=6, max_pages=30)
    parent = _executor()
    gx = graph_executor(parent, bucket)
    pool = 6 * 30 + 5
    gen = torch.Generator().manual_seed(0)
    caches = [torch.randn(pool, 2, ps, 2, 32, generator=gen).to(E4M3) for _ in GROUPS]
    q = torch.zeros(6, 8, 32, dtype=torch.bfloat16)
    sinks = torch.randn(8, generator=gen) * 3

    def forward() -> list[torch.Tensor]:
        return [gx.run(g, q, None, None, c, sinks=sinks if g.sinks else None, k_scale=0.37,
                       v_scale=1.9) for g, c in zip(GROUPS, caches, strict=True)]  # fmt: skip

    first = fp.plan(fp.BatchLayout.decode([3] * 6, page_size=ps, groups=GROUPS), HEADS)
    gx.apply(first, fp.PageTable.shuffled(first.pages_needed, seed=0))
    step = capture(gx, forward)
    eager = _executor()
    for i in range(12):
        bs = int(rng.integers(1, 7))
        spec = fp.plan(fp.BatchLayout.decode(rng.integers(1, 470, bs), page_size=ps,
                                             groups=GROUPS), HEADS)  # fmt: skip
        table = fp.PageTable.shuffled(spec.pages_needed, seed=i, spare_pages=int(rng.integers(9)))
        q.copy_(torch.randn(q.shape, generator=gen))
        outs = step.replay(spec, table)
        eager.apply(spec, table)
        ref = fp.ReferenceExecutor()
        ref.apply(spec, table)
        for g, c, o in zip(GROUPS, caches, outs, strict=True):
            s = sinks if g.sinks else None
            want = eager.run(g, q[:bs], None, None, c, sinks=s, k_scale=0.37, v_scale=1.9)
            assert torch.equal(o[:bs], want), (i, g.describe())
            oracle = ref.run(g, _rounded(q[:bs]), None, None, c, sinks=s, k_scale=0.37,
                             v_scale=1.9)  # fmt: skip
            assert _rel(o[:bs], oracle) <= TOL, (i, g.describe())


def test_multi_step_draft_decode_on_xqa() -> None:
    seq = np.array([5, 60, 130, 17])
    specs = [fp.plan(fp.BatchLayout.decode(seq + s, page_size=16, groups=GROUPS), HEADS)
             for s in range(3)]  # fmt: skip
    table = fp.PageTable.shuffled(specs[-1].pages_needed, seed=1)
    cache = torch.randn(int(table.num_pages or 0), 2, 16, 2, 32).to(E4M3)
    q = torch.randn(4, 8, 32).to(torch.bfloat16)
    sinks = torch.randn(8)
    ex = _executor()
    gx = ex.for_bucket(GraphBucket.decode(batch_size=6, max_pages=20))
    q_pad = torch.cat([q, torch.zeros(2, 8, 32, dtype=torch.bfloat16)])
    eager_steps, graph_steps = ex.apply_steps(specs, table), gx.apply_steps(specs, table)
    for k, spec in enumerate(specs):
        ref = fp.ReferenceExecutor()
        ref.apply(spec, table)
        for g in GROUPS:
            s = sinks if g.sinks else None
            want = ref.run(g, _rounded(q), None, None, cache, sinks=s)
            assert _rel(eager_steps[k].run(g, q, None, None, cache, sinks=s), want) <= TOL
            got = graph_steps[k].run(g, q_pad, None, None, cache, sinks=s)[:4]
            assert _rel(got, want) <= TOL


def test_checked_mode_reads_only_the_table_entries_written() -> None:
    """The checked mode ignores a dense table's unused columns and still names a request
    whose page id is bad."""
    spec = fp.plan(fp.BatchLayout.decode([9, 300, 4], page_size=16), HEADS)
    table = fp.PageTable.shuffled(spec.pages_needed, seed=0)
    cache = torch.randn(int(table.num_pages or 0), 2, 16, 2, 32).to(E4M3)
    ex = _executor(check_pages=True)
    for _ in range(2):  # the second apply over the first's leftovers
        ex.apply(spec, table)
        ex.run(spec.key.groups[0], torch.randn(3, 8, 32).to(torch.bfloat16), None, None, cache)
    row = int(table.rows[2])
    table.pages[row, 0] = -3
    with pytest.raises(fp.PageTableError, match=r"pages\[2\].*not a valid page id"):
        ex.apply(spec, table)


def test_one_executor_mixes_xqa_decodes_with_fa2_extends_and_verifies() -> None:
    """One long-lived executor: decodes on XQA, extends and verifies on FA2 prefill,
    batches of varied sizes, page tables and lengths; each equals a fresh reference."""
    rng = np.random.default_rng(4)
    ex = _executor()
    wrong = []
    for step in range(16):  # each kind 4 times or more
        bs = int(rng.integers(1, 9))
        prefix = rng.integers(0, 300, bs)
        kind = ("decode", "decode", "extend", "verify")[step % 4]
        if kind == "decode":
            layout = fp.BatchLayout.decode(prefix + 1, page_size=16, groups=GROUPS)
        elif kind == "extend":
            layout = fp.BatchLayout.extend(prefix, rng.integers(1, 6, bs), page_size=16,
                                           groups=GROUPS)  # fmt: skip
        else:
            tree = fp.DraftTree.from_parents(np.tile([-1, 0, 0, 1], (bs, 1)))
            layout = fp.BatchLayout.verify(prefix, tree, page_size=16, groups=GROUPS)
        spec = fp.plan(layout, HEADS, extend_path="paged")
        table = fp.PageTable.shuffled(spec.pages_needed, seed=step, extra_rows=step % 3)
        ex.apply(spec, table)
        if kind == "decode":
            err = _run_groups(ex, spec, table, GROUPS, step, (0.37, 1.9))
        else:  # FA2 reads the queries unrounded: compare with the reference as they are
            err = _fa2_error(ex, spec, table, step)
        if err > (TOL if kind == "decode" else 3e-2):
            wrong.append((step, kind, err))
    assert not wrong, wrong


def _fa2_error(ex: FlashInferExecutor, spec: fp.PlanSpec, table: fp.PageTable, seed: int) -> float:
    gen = torch.Generator().manual_seed(seed)
    ref = fp.ReferenceExecutor()
    ref.apply(spec, table)
    worst = 0.0
    for group in GROUPS:
        cache = torch.randn(int(table.num_pages or 0), 2, 16, 2, 32, generator=gen).to(E4M3)
        q = torch.randn(spec.total_q, 8, 32, generator=gen).to(torch.bfloat16)
        sinks = torch.randn(8, generator=gen) if group.sinks else None
        out = ex.run(group, q, None, None, cache, sinks=sinks, k_scale=0.37, v_scale=1.9)
        want = ref.run(group, q, None, None, cache, sinks=sinks, k_scale=0.37, v_scale=1.9)
        worst = max(worst, _rel(out, want))
    return worst


# -- XQA's split and scratch (pure host arithmetic) -----------------------------------------
def _kernel_parts(sm_count: int, units: int, max_seq_len: int) -> int:
    """XQA 0.7.4's split per sequence and KV head (``launchHopperF8MHAFlashInfer``):
    ``min(max(1, round(floor(3 * sm_count / units) * 0.25)), ceil(max_seq_len / 64))``
    (64: the smallest key tile, an upper bound on the grid)."""
    split = math.floor((3 * sm_count // units) * 0.25 + 0.5)  # C round: half up here
    return min(max(1, split), -(-max_seq_len // 64))


@given(
    sms=st.integers(1, 200),
    rows=st.integers(1, 4096),
    kv_heads=st.sampled_from([1, 2, 4, 8, 16]),
    pages=st.integers(1, 4096),
    page_size=st.sampled_from([16, 32, 64, 128]),
    group=st.sampled_from([1, 2, 4, 8, 16, 64]),
    head_dim=st.sampled_from([64, 128, 256]),
)
def test_xqa_split_is_its_own_and_fits_the_scratch(
    sms: int, rows: int, kv_heads: int, pages: int, page_size: int, group: int, head_dim: int
) -> None:
    """The sm_count passed is the GPU's (XQA's own split), the scratch it is given holds
    every part's row sums, maxima and partial outputs, and deterministic plans get one
    part."""
    units, max_seq = rows * kv_heads, pages * page_size
    smc = xqa_sm_count(sms, deterministic=False)
    assert smc == sms
    parts = _kernel_parts(smc, units, max_seq)
    if parts > 1:  # split: the kernel writes rows * kv_heads * parts partial results
        used = units * parts * group * (8 + 2 * head_dim) + group * 2 * head_dim
        assert used <= xqa_scratch_bytes(sms, group, head_dim)
    assert _kernel_parts(xqa_sm_count(sms, deterministic=True), units, max_seq) == 1


@given(junk=st.one_of(st.text(max_size=8), st.integers(), st.none(), st.booleans()))
def test_decode_backend_junk_is_refused_by_every_route(junk: object) -> None:
    """Anything but 'auto' / 'fa2' / 'xqa' raises a flashplan OptionError (a ValueError)
    naming the field, from the constructor and from ``attrs.evolve``."""
    assume(junk not in ("auto", "fa2", "xqa"))
    for build in (
        lambda: ExecutorPolicy(decode_backend=junk),  # type: ignore[arg-type]
        lambda: attrs.evolve(ExecutorPolicy(), decode_backend=junk),
    ):
        with pytest.raises(fp.OptionError) as err:
            build()
        assert err.value.field == "decode_backend" and isinstance(err.value, ValueError)
