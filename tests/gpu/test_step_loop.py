"""An engine's step loop on real kernels: CUDA-graph replay == eager, padding is
harmless, deterministic mode is batch-invariant, staging never races, no sync.

Every replay test keeps the engine's shape: static input tensors captured once, then per
step fresh batch contents copied into them, ``step.replay(spec, table)``, and the real
rows of the outputs compared with an eager step of the same batch on a fresh executor.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import numpy as np
import pytest
import torch

import flashplan as fp
from flashplan.executor.flashinfer import ExecutorPolicy, FlashInferExecutor
from flashplan.executor.flashinfer.bucket import GraphBucket
from flashplan.executor.flashinfer.graphs import capture, graph_executor

from .helpers import rel_err, stable_seed, syncs_raise

DEV = "cuda"
HEADS = fp.HeadConfig(num_qo_heads=16, num_kv_heads=4, head_dim=128)
FULL = fp.AttentionGroup.full()
W5 = fp.AttentionGroup.sliding(5)
CAP = fp.AttentionGroup.full(logits_soft_cap=30.0)
W70 = fp.AttentionGroup.sliding(70, logits_soft_cap=20.0)
CROSS = fp.AttentionGroup.cross()


class Engine:
    """Static tensors of one bucket, a captured graph, and per-step refills."""

    def __init__(
        self,
        groups: tuple[fp.AttentionGroup, ...],
        bucket: GraphBucket,
        first: fp.PlanSpec,
        table: fp.PageTable,
        pool: int,
        *,
        policy: ExecutorPolicy,
        page_map: torch.Tensor | None = None,
        seed: int = 0,
        busy: bool = False,
    ) -> None:
        """``busy``: a long kernel is queued before the first apply and before every
        step, so the host applies, captures, replays and runs the eager step far ahead
        of the GPU (as under compute-sanitizer, or in an engine that runs ahead): no
        buffer a queued copy or kernel still reads may be reused."""
        self.groups, self.bucket, self.policy, self.page_map = groups, bucket, policy, page_map
        self.busy = busy
        self.gen = torch.Generator(device=DEV).manual_seed(seed)
        n, ps = bucket.total_q, first.page_size
        hq, hkv, d = HEADS.num_qo_heads, HEADS.num_kv_heads, HEADS.head_dim
        self.q = self.rand(n, hq, d)
        self.k = self.rand(n, hkv, d)
        self.v = self.rand(n, hkv, d)
        self.caches = [self.rand(pool, 2, ps, hkv, d) for _ in groups]
        self.base = [c.clone() for c in self.caches]
        if busy:
            torch.cuda._sleep(int(2e8))
        self.gx = graph_executor(FlashInferExecutor(policy=policy, page_map=page_map), bucket)
        self.gx.apply(first, table)
        self.step = capture(self.gx, self.forward)

    def rand(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen, device=DEV).to(torch.bfloat16)

    def forward(self) -> list[torch.Tensor]:
        out = []
        for group, cache in zip(self.groups, self.caches, strict=True):
            k, v = (None, None) if group.cross_attention else (self.k, self.v)
            out.append(self.gx.run(group, self.q, k, v, cache))
        return out

    def replay_and_eager(
        self, spec: fp.PlanSpec, table: fp.PageTable
    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per group: (replayed out, eager out, cache after replay, cache after eager)."""
        n = spec.total_q
        if self.busy:
            torch.cuda._sleep(int(2e8))
        self.q.copy_(self.rand(*self.q.shape))  # padding rows get garbage too
        self.k.copy_(self.rand(*self.k.shape))
        self.v.copy_(self.rand(*self.v.shape))
        for cache, base in zip(self.caches, self.base, strict=True):
            cache.copy_(base)
        outs = self.step.replay(spec, table)
        # the backend the graph's prefill wrappers run (FA2), so that the comparison also
        # holds under compute-sanitizer, which does not run FlashInfer's FA3 kernels
        # faithfully (benchmarks/results/log-2026-12-02-to-06.md, runs BW-BX)
        eager_policy = attrs.evolve(self.policy, prefill_backend="fa2")
        eager = FlashInferExecutor(policy=eager_policy, page_map=self.page_map)
        eager.apply(spec, table)
        result = []
        for group, out, cache, base in zip(self.groups, outs, self.caches, self.base, strict=True):
            eager_cache = base.clone()
            k, v = (None, None) if group.cross_attention else (self.k[:n], self.v[:n])
            want = eager.run(group, self.q[:n], k, v, eager_cache)
            result.append((out[:n].clone(), want, cache.clone(), eager_cache))
        torch.cuda.synchronize()
        return result

    def check_replays(self, specs: list[fp.PlanSpec], tables: list[fp.PageTable]) -> None:
        """Every plan replays as its eager step: outputs within bf16 tolerance, and the
        whole cache equal (padding rows write nowhere)."""
        for spec, table in zip(specs, tables, strict=True):
            for group, (got, want, cache, eager_cache) in zip(
                self.groups, self.replay_and_eager(spec, table), strict=True
            ):
                assert rel_err(got, want) <= 1e-2, (group, spec.batch_size)
                assert torch.equal(cache, eager_cache), (group, spec.batch_size)


def _decode_batches(rng: np.random.Generator, page_size: int) -> list[np.ndarray]:
    """Batches of 8 (full bucket), 3 and 1 requests, lengths across window edges."""
    return [
        np.array([1, 5, 6, 7, 70, 71, 72, 300]),
        rng.integers(1, 400, 3),
        np.array([page_size * 4]),
    ]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("swa_pool", [False, True])
@pytest.mark.parametrize("busy", [False, True], ids=["idle", "busy"])
def test_decode_replay_equals_eager(page_size: int, swa_pool: bool, busy: bool) -> None:
    rng = np.random.default_rng(stable_seed("decode", page_size, swa_pool))
    groups = (FULL, W5, CAP, W70, CROSS)
    bucket = GraphBucket.decode(batch_size=8, max_pages=(512 + 64) // page_size + 2)
    batches = _decode_batches(rng, page_size)
    specs, tables = [], []
    for seq in batches:
        enc = rng.integers(0, 64, seq.shape[0])
        layout = fp.BatchLayout.decode(seq, page_size=page_size, groups=groups, encoder_lens=enc)
        spec = fp.plan(layout, HEADS)
        specs.append(spec)
        tables.append(fp.PageTable.shuffled(spec.pages_needed, seed=len(specs), device=DEV))
    pool = max(int(t.num_pages or 0) for t in tables)
    page_map = None
    if swa_pool:  # window pool page of full page p: pool - 1 - p
        page_map = torch.arange(pool - 1, -1, -1, dtype=torch.int32, device=DEV)
    engine = Engine(
        groups,
        bucket,
        specs[0],
        tables[0],
        pool,
        policy=ExecutorPolicy(),
        page_map=page_map,
        busy=busy,
    )
    engine.check_replays(specs, tables)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("tensor_cores", [False, True])
def test_decode_graph_replays_many_batches(page_size: int, tensor_cores: bool) -> None:
    """30 varied decode batches (1 to 8 requests, lengths across window edges and page
    boundaries, tables with spare pages and rows) through one captured graph, on both
    decode kernels: each replay equals an eager step of a fresh executor."""
    rng = np.random.default_rng(stable_seed("many decode replays", page_size, tensor_cores))
    groups = (FULL, W5, CAP, W70)
    bucket = GraphBucket.decode(batch_size=8, max_pages=600 // page_size + 2)

    def layout(bs: int) -> fp.BatchLayout:
        return fp.BatchLayout.decode(rng.integers(1, 600, bs), page_size=page_size, groups=groups)

    specs = [fp.plan(layout(8), HEADS)]
    specs += [fp.plan(layout(int(rng.integers(1, 9))), HEADS) for _ in range(30)]
    tables = [
        fp.PageTable.shuffled(
            spec.pages_needed,
            seed=100 + k,
            spare_pages=5,
            extra_rows=int(rng.integers(0, 4)),
            device=DEV,
        )
        for k, spec in enumerate(specs)
    ]
    pool = max(int(t.num_pages or 0) for t in tables)
    policy = ExecutorPolicy(decode_tensor_cores=tensor_cores)
    engine = Engine(groups, bucket, specs[0], tables[0], pool, policy=policy, seed=page_size)
    engine.check_replays(specs[1:], tables[1:])


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("busy", [False, True], ids=["idle", "busy"])
def test_fixed_token_extend_replay_equals_eager(page_size: int, busy: bool) -> None:
    """The draft-extend shape: every request extends by the same number of tokens."""
    rng = np.random.default_rng(stable_seed("extend", page_size))
    tokens = 3
    groups = (FULL, W5)
    bucket = GraphBucket.extend(batch_size=6, max_pages=400 // page_size + 2, tokens_per_request=3)
    specs, tables = [], []
    for bs in (6, 2, 4):
        prefix = rng.integers(0, 380, bs)
        layout = fp.BatchLayout.from_extend_lens(
            [tokens] * bs, prefix, page_size=page_size, groups=groups
        )
        spec = fp.plan(layout, HEADS, extend_path="paged")
        specs.append(spec)
        tables.append(fp.PageTable.shuffled(spec.pages_needed, seed=bs, device=DEV))
    pool = max(int(t.num_pages or 0) for t in tables)
    engine = Engine(groups, bucket, specs[0], tables[0], pool, policy=ExecutorPolicy(), busy=busy)
    engine.check_replays(specs, tables)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("busy", [False, True], ids=["idle", "busy"])
def test_tree_verify_replay_equals_eager(page_size: int, busy: bool) -> None:
    """Target verify in a graph: the tree masks are built into fixed buffers; windows
    that bite inside the tree, padding requests in every round but the first."""
    rng = np.random.default_rng(stable_seed("verify", page_size))
    n = 7
    groups = (FULL, W5, CAP)
    bucket = GraphBucket.verify(batch_size=4, max_pages=320 // page_size + 2, num_tokens=n)
    specs, tables = [], []
    for bs in (4, 2, 1):
        prefix = rng.integers(0, 300, bs)
        if bs == 2:  # random trees
            parents = [[-1] + [int(rng.integers(0, j)) for j in range(1, n)] for _ in range(bs)]
            tree = fp.DraftTree.from_parents(parents)
        else:
            tree = fp.DraftTree.eagle(bs, topk=2, steps=3)
        layout = fp.BatchLayout.verify(prefix, tree, page_size=page_size, groups=groups)
        spec = fp.plan(layout, HEADS)
        assert all(gp.uses_custom_mask for gp in spec.group_plans)
        specs.append(spec)
        tables.append(fp.PageTable.shuffled(spec.pages_needed, seed=bs, device=DEV))
    pool = max(int(t.num_pages or 0) for t in tables)
    engine = Engine(groups, bucket, specs[0], tables[0], pool, policy=ExecutorPolicy(), busy=busy)
    engine.check_replays(specs, tables)
    chain = fp.plan(
        fp.BatchLayout.verify([9], fp.DraftTree.chain(1, n), page_size=page_size, groups=groups),
        HEADS,
    )
    with pytest.raises(fp.PlanMismatchError, match="chain"):
        engine.step.replay(chain, fp.PageTable.shuffled(chain.pages_needed, device=DEV))
    engine.step.replay(specs[1], tables[1])  # the earlier plan still replays
    torch.cuda.synchronize()


def test_a_plan_that_does_not_fit_is_refused_before_anything_runs() -> None:
    bucket = GraphBucket.decode(batch_size=2, max_pages=4)
    spec = fp.plan(fp.BatchLayout.decode([5, 9], page_size=16), HEADS)
    table = fp.PageTable.shuffled(spec.pages_needed, device=DEV)
    engine = Engine((FULL,), bucket, spec, table, 8, policy=ExecutorPolicy())
    too_long = fp.plan(fp.BatchLayout.decode([5, 90], page_size=16), HEADS)
    with pytest.raises(fp.BucketError) as err:
        engine.step.replay(too_long, fp.PageTable.shuffled(too_long.pages_needed, device=DEV))
    assert (err.value.field, err.value.request) == ("max_pages", 1)
    other_groups = fp.plan(fp.BatchLayout.decode([5], page_size=16, groups=(W5,)), HEADS)
    with pytest.raises(fp.PlanMismatchError):
        engine.gx.apply(other_groups, fp.PageTable.shuffled(other_groups.pages_needed, device=DEV))
    engine.step.replay(spec, table)  # the earlier plan still replays
    torch.cuda.synchronize()


def test_graph_executors_refuse_what_a_graph_cannot_replay() -> None:
    """check_pages mode (reads back from the device) is refused with a clear error; a
    refused first plan fixes no key; the steps per apply are fixed like the key."""
    with pytest.raises(fp.UnsupportedError, match="check_pages"):
        graph_executor(FlashInferExecutor(check_pages=True), GraphBucket.decode(2, 4))
    gx = graph_executor(FlashInferExecutor(), GraphBucket.decode(batch_size=2, max_pages=4))
    too_big = fp.plan(fp.BatchLayout.decode([5, 9, 3], page_size=16), HEADS)
    with pytest.raises(fp.BucketError):
        gx.apply(too_big, fp.PageTable.sequential(too_big.pages_needed, device=DEV))
    windowed = fp.plan(fp.BatchLayout.decode([5, 9], page_size=16, groups=(W5,)), HEADS)
    table = fp.PageTable.sequential(windowed.pages_needed, device=DEV)
    gx.apply(windowed, table)
    draft = fp.DraftDecode([5, 9], topk=1, steps=2, page_size=16, groups=(W5,))
    with pytest.raises(fp.PlanMismatchError, match="step"):
        gx.apply_steps(fp.plan_steps(draft, HEADS), table)
    gx.apply(windowed, table)  # still the one-step plan it was fixed with
    torch.cuda.synchronize()


def draft_rounds(
    page_size: int, topk: int, steps: int, groups: tuple[fp.AttentionGroup, ...], seed: str
) -> tuple[list[tuple[tuple[fp.PlanSpec, ...], fp.PageTable]], int]:
    """Three rounds of a multi-step draft decode (4, 3 and 1 requests: padding branches
    in all but the first), each ``(step plans, branch table)``, and the pool size."""
    rng = np.random.default_rng(stable_seed(seed, page_size))
    rounds, pool = [], 0
    for requests in (4, 3, 1):
        prefix = rng.integers(1, 300, requests)
        draft = fp.DraftDecode(prefix, topk, steps, page_size=page_size, groups=groups)
        prompt = fp.PageTable.shuffled(
            (prefix + page_size - 1) // page_size, seed=requests, device=DEV
        )
        assert prompt.num_pages is not None
        own = draft.branch_pages
        start = prompt.num_pages
        branch_pages = torch.arange(
            start, start + requests * topk * own, dtype=torch.int32, device=DEV
        ).reshape(requests, topk, own)
        table = fp.PageTable.draft_branches(prompt, prefix, topk, branch_pages, page_size=page_size)
        rounds.append((fp.plan_steps(draft, HEADS), table))
        pool = max(pool, start + requests * topk * own)
    return rounds, pool


def check_draft_replays(
    executor: FlashInferExecutor,
    rounds: list[tuple[tuple[fp.PlanSpec, ...], fp.PageTable]],
    pool: int,
    bucket: GraphBucket,
    groups: tuple[fp.AttentionGroup, ...],
    table_of: Callable[[fp.PageTable], fp.PageTable] = lambda table: table,
    *,
    busy: bool = False,
) -> None:
    """Capture every draft step in one graph on ``executor`` (a bucket's graph executor;
    ``table_of`` gives each round's table as the executor takes it), then replay each
    round: outputs and caches equal a fresh eager ``apply_steps`` of the same round.
    ``busy``: a long kernel is queued before the capture and before every round (see
    :class:`Engine`)."""
    page_size = rounds[0][0][0].page_size
    steps = len(rounds[0][0])
    gen = torch.Generator(device=DEV).manual_seed(page_size)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=DEV).to(torch.bfloat16)

    n, hq, hkv, d = bucket.total_q, HEADS.num_qo_heads, HEADS.num_kv_heads, HEADS.head_dim
    qs, ks, vs = ([rand(n, h, d) for _ in range(steps)] for h in (hq, hkv, hkv))
    caches = [rand(pool, 2, page_size, hkv, d) for _ in groups]
    base = [c.clone() for c in caches]
    if busy:
        torch.cuda._sleep(int(2e8))
    views = executor.apply_steps(rounds[0][0], table_of(rounds[0][1]))

    def forward() -> list[torch.Tensor]:
        return [
            view.run(group, qs[s], ks[s], vs[s], cache)
            for s, view in enumerate(views)
            for group, cache in zip(groups, caches, strict=True)
        ]

    captured = capture(executor, forward)
    for specs, branches in rounds:
        if busy:
            torch.cuda._sleep(int(2e8))
        for t in (*qs, *ks, *vs):
            t.copy_(rand(*t.shape))
        for cache, b in zip(caches, base, strict=True):
            cache.copy_(b)
        table = table_of(branches)
        outs = captured.replay(specs, table)
        eager_caches = [b.clone() for b in base]
        rows = specs[0].total_q
        want = [
            view.run(group, qs[s][:rows], ks[s][:rows], vs[s][:rows], cache)
            for s, view in enumerate(FlashInferExecutor().apply_steps(specs, table))
            for group, cache in zip(groups, eager_caches, strict=True)
        ]
        torch.cuda.synchronize()
        for got, exp in zip(outs, want, strict=True):
            assert rel_err(got[:rows], exp) <= 1e-2, (page_size, rows)
        for cache, eager_cache in zip(caches, eager_caches, strict=True):
            assert torch.equal(cache, eager_cache), (page_size, rows)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("busy", [False, True], ids=["idle", "busy"])
def test_multi_step_draft_replay_equals_eager(page_size: int, busy: bool) -> None:
    """Every step of a multi-step draft decode in one graph, re-planned per round with one
    apply_steps: outputs and caches equal an eager apply_steps of the same round, with
    padding branches in every round."""
    topk, steps, groups = 2, 3, (FULL, W5)
    bucket = GraphBucket.decode(batch_size=4 * topk, max_pages=320 // page_size + 2)
    rounds, pool = draft_rounds(page_size, topk, steps, groups, "draft")
    check_draft_replays(
        graph_executor(FlashInferExecutor(), bucket), rounds, pool, bucket, groups, busy=busy
    )


def test_replay_planning_is_sync_free() -> None:
    bucket = GraphBucket.decode(batch_size=8, max_pages=40)
    layouts = [
        fp.BatchLayout.decode(s, page_size=16, groups=(FULL, W5)) for s in ([9] * 8, [300, 2])
    ]
    specs = [fp.plan(lay, HEADS) for lay in layouts]
    tables = [
        fp.PageTable.shuffled(s.pages_needed, seed=i, device=DEV) for i, s in enumerate(specs)
    ]
    engine = Engine((FULL, W5), bucket, specs[0], tables[0], 64, policy=ExecutorPolicy())
    engine.step.replay(specs[1], tables[1])
    with syncs_raise():
        for spec, table in zip(specs, tables, strict=True):
            engine.step.replay(spec, table)
    torch.cuda.synchronize()


# --------------------------------------------------------------------------- deterministic
def _one_request_in(
    ex: fp.Executor, others: list[int], position: int, kv: torch.Tensor, q: torch.Tensor
) -> torch.Tensor:
    """The output of a 3000-token request decoded beside ``others`` at ``position``; it
    always reads pages 0..187 (the same cache bytes), the others pages from 200 on."""
    seq = [*others[:position], 3000, *others[position:]]
    spec = fp.plan(fp.BatchLayout.decode(seq, page_size=16), HEADS)
    need = spec.pages_needed.tolist()
    rows = np.zeros((len(seq), max(need)), dtype=np.int32)
    at = 200
    for i, n in enumerate(need):
        if i == position:
            rows[i, :n] = np.arange(n)
        else:
            rows[i, :n] = at + np.arange(n)
            at += n
    assert at <= kv.shape[0]
    table = fp.PageTable(torch.from_numpy(rows).to(DEV), np.arange(len(seq)), num_pages=kv.shape[0])
    qs = torch.randn(len(seq), HEADS.num_qo_heads, HEADS.head_dim, device=DEV).to(torch.bfloat16)
    qs[position] = q
    ex.apply(spec, table)
    return ex.run(FULL, qs, None, None, kv)[position].clone()


def test_deterministic_mode_is_batch_invariant_and_replay_equal() -> None:
    policy = ExecutorPolicy(deterministic=True)
    gen = torch.Generator(device=DEV).manual_seed(7)
    kv = torch.randn(12000, 2, 16, 4, 128, generator=gen, device=DEV).to(torch.bfloat16)
    q = torch.randn(16, 128, generator=gen, device=DEV).to(torch.bfloat16)
    ex = FlashInferExecutor(policy=policy)
    compositions = [([], 0), ([8000], 0), ([9, 8000, 40], 2), ([100] * 6, 5), ([4000] * 40, 17)]
    outs = [_one_request_in(ex, others, pos, kv, q) for others, pos in compositions]
    for got in outs[1:]:
        assert torch.equal(got, outs[0])
    # Replay of the same request in a padded bucket: bit-identical to eager.
    spec = fp.plan(fp.BatchLayout.decode([3000, 17], page_size=16), HEADS)
    rows = np.zeros((2, 188), dtype=np.int32)
    rows[0] = np.arange(188)
    rows[1, :2] = [200, 201]
    table = fp.PageTable(torch.from_numpy(rows).to(DEV), [0, 1], num_pages=12000)
    gx = graph_executor(FlashInferExecutor(policy=policy), GraphBucket.decode(8, 200))
    q_static = torch.randn(8, 16, 128, device=DEV).to(torch.bfloat16)
    gx.apply(spec, table)
    step = capture(gx, lambda: gx.run(FULL, q_static, None, None, kv))
    q_static[0] = q
    out = step.replay(spec, table)
    torch.cuda.synchronize()
    assert torch.equal(out[0], outs[0])


# --------------------------------------------------------------------------- staging
def test_back_to_back_plans_behind_a_busy_gpu_are_all_correct() -> None:
    """8 different plans applied and run while a long kernel holds the GPU: no staging
    buffer and no FlashInfer wrapper is reused while a queued copy may read it."""
    ex = FlashInferExecutor(policy=ExecutorPolicy())
    ref = fp.ReferenceExecutor()
    rng = np.random.default_rng(3)
    cases = []
    for i in range(8):
        seq = rng.integers(1, 500, 3 + i)
        spec = fp.plan(fp.BatchLayout.decode(seq, page_size=16, groups=(FULL, W5)), HEADS)
        table = fp.PageTable.shuffled(spec.pages_needed, seed=i, device=DEV)
        cache = torch.randn(int(table.num_pages or 1), 2, 16, 4, 128, device=DEV).to(torch.bfloat16)
        q = torch.randn(spec.total_q, 16, 128, device=DEV).to(torch.bfloat16)
        cases.append((spec, table, cache, q))
    for spec, table, cache, q in cases:  # warm-up: module loads, wrapper creation
        ex.apply(spec, table)
        for g in (FULL, W5):
            ex.run(g, q, None, None, cache)
    torch.cuda.synchronize()
    torch.cuda._sleep(int(1e9))  # ~0.5 s of GPU time queued first
    outs = []
    for spec, table, cache, q in cases:
        ex.apply(spec, table)
        outs.append([ex.run(g, q, None, None, cache) for g in (FULL, W5)])
    torch.cuda.synchronize()
    for (spec, table, cache, q), got in zip(cases, outs, strict=True):
        ref.apply(spec, table)
        for g, out in zip((FULL, W5), got, strict=True):
            assert rel_err(out, ref.run(g, q, None, None, cache)) <= 1e-2


def test_a_workspace_too_small_is_a_clear_error() -> None:
    ex = FlashInferExecutor(
        workspace_bytes=1 << 20, policy=ExecutorPolicy(decode_tensor_cores=True)
    )
    raised = []
    for seq in ([65536], [32768] * 2, [4096] * 64):
        spec = fp.plan(fp.BatchLayout.decode(seq, page_size=16), fp.HeadConfig(32, 8, 128))
        table = fp.PageTable.sequential(spec.pages_needed, device=DEV)
        try:
            ex.apply(spec, table)
        except fp.UnsupportedError as exc:
            assert "workspace_bytes" in str(exc)
            raised.append(seq)
    assert raised, "no plan needed more than a 1 MiB workspace"
