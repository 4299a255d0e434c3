"""Decode re-plans (adapter.replan_decode: the compiled scheduler) equal ``plan()`` calls.

An executor with ``fast_plan=True`` (the default) and one with ``fast_plan=False`` run
the same sequence of decode batches — the first with short requests, the later ones
longer, so nothing the first plan left behind could pass for a later one — and must
give bit-identical outputs and the same FlashInfer plan info, with no sync. Covered:
CUDA-core decode (batch below 4) and tensor-core decode (pages 1 and 16), eager and
CUDA-graph replay, windows and soft caps.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import flashplan as fp
from flashplan.executor.flashinfer import ExecutorPolicy, FlashInferExecutor
from flashplan.executor.flashinfer.bucket import GraphBucket
from flashplan.executor.flashinfer.graphs import capture, graph_executor

from .helpers import stable_seed, syncs_raise

DEV = "cuda"
HEADS = fp.HeadConfig(num_qo_heads=16, num_kv_heads=4, head_dim=128)
GROUPS = (fp.AttentionGroup.full(), fp.AttentionGroup.sliding(40, logits_soft_cap=30.0))


def _batches(batch_size: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [
        rng.integers(1, 20, batch_size),  # short first: the only full plan()
        rng.integers(200, 900, batch_size),
        rng.integers(1, 1200, batch_size),
    ]


def _plan_infos(ex: FlashInferExecutor) -> list[object]:
    return [list(w._plan_info) for w in ex.planned_wrappers.values()]


def _decode_case(
    seq: np.ndarray, page_size: int, heads: fp.HeadConfig, gen: torch.Generator, seed: int
) -> tuple[fp.PlanSpec, fp.PageTable, list[torch.Tensor]]:
    """A decode batch of ``seq`` over ``GROUPS``: its plan, a shuffled page table just
    large enough and a random bf16 cache per group."""
    spec = fp.plan(fp.BatchLayout.decode(seq, page_size=page_size, groups=GROUPS), heads)
    table = fp.PageTable.shuffled(spec.pages_needed, seed=seed, device=DEV)
    assert table.num_pages is not None
    hkv, d = heads.num_kv_heads, heads.head_dim
    shape = (table.num_pages, 2, page_size, hkv, d)
    caches = [torch.randn(shape, generator=gen, device=DEV).to(torch.bfloat16) for _ in GROUPS]
    return spec, table, caches


def _apply_both_and_compare(
    fast: FlashInferExecutor,
    full: FlashInferExecutor,
    spec: fp.PlanSpec,
    table: fp.PageTable,
    qkv: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None],
    caches: list[torch.Tensor],
    where: object,
    *,
    full_syncs_raise: bool = True,
) -> None:
    """Apply ``spec`` on both executors (no sync: the fast one always, the full one
    where ``full_syncs_raise``), run every group (on a copy of its cache where new K/V
    is written) and check outputs, LSE and the wrappers' plan info bit for bit."""
    q, k, v = qkv
    outs = {}
    for name, ex in (("fast", fast), ("full", full)):
        with syncs_raise(name == "fast" or full_syncs_raise):
            ex.apply(spec, table)
            outs[name] = [
                ex.run(g, q, k, v, c if k is None else c.clone(), return_lse=True)
                for g, c in zip(GROUPS, caches, strict=True)
            ]
    torch.cuda.synchronize()
    for group, (o_fast, l_fast), (o_full, l_full) in zip(
        GROUPS, outs["fast"], outs["full"], strict=True
    ):
        assert torch.equal(o_fast, o_full), (group, where)
        assert torch.equal(l_fast, l_full), (group, where)
    assert _plan_infos(fast) == _plan_infos(full), where


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("batch_size", [2, 9])  # CUDA-core and tensor-core decode
def test_fast_decode_plan_equals_plan_eager(page_size: int, batch_size: int) -> None:
    seed = stable_seed("fast eager", page_size, batch_size)
    gen = torch.Generator(device=DEV).manual_seed(seed)
    fast = FlashInferExecutor(fast_plan=True)
    full = FlashInferExecutor(fast_plan=False)
    hq, hkv, d = HEADS.num_qo_heads, HEADS.num_kv_heads, HEADS.head_dim
    for step, seq in enumerate(_batches(batch_size, seed)):
        spec, table, caches = _decode_case(seq, page_size, HEADS, gen, step)
        q = torch.randn(batch_size, hq, d, generator=gen, device=DEV).to(torch.bfloat16)
        k = torch.randn(batch_size, hkv, d, generator=gen, device=DEV).to(torch.bfloat16)
        v = torch.randn_like(k)
        _apply_both_and_compare(fast, full, spec, table, (q, k, v), caches, step)
    assert fast.plan_counts["fast_decode_plan"] > 0
    assert full.plan_counts["fast_decode_plan"] == 0


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("batch_size", [1, 8])  # CUDA-core and tensor-core decode
def test_fast_decode_plan_equals_plan_in_graphs(page_size: int, batch_size: int) -> None:
    seed = stable_seed("fast graph", page_size, batch_size)
    gen = torch.Generator(device=DEV).manual_seed(seed)
    batches = _batches(batch_size, seed)
    steps, _ = _replay_both_and_compare(batches, page_size, HEADS, 1300, gen, writes=True)
    assert steps["fast"].executor.plan_counts["fast_decode_plan"] >= len(batches) * len(GROUPS)
    assert steps["full"].executor.plan_counts["fast_decode_plan"] == 0


def _replay_both_and_compare(
    batches: list[np.ndarray],
    page_size: int,
    heads: fp.HeadConfig,
    longest: int,
    gen: torch.Generator,
    *,
    writes: bool,
) -> tuple[dict[str, Any], int]:
    """Capture a decode step of every group in a bucket of the batches' size (requests
    up to ``longest`` tokens) on two graph executors, ``fast_plan`` on and off, then
    replay every batch on both (writing new K/V where ``writes``) and check outputs, plan
    info and caches bit for bit. Returns the steps by ``"fast"`` / ``"full"`` and the fast
    executor's ``schedules_kept`` before the first replay."""
    batch_size = len(batches[0])
    specs = [
        fp.plan(fp.BatchLayout.decode(seq, page_size=page_size, groups=GROUPS), heads)
        for seq in batches
    ]
    tables = [
        fp.PageTable.shuffled(s.pages_needed, seed=i, device=DEV) for i, s in enumerate(specs)
    ]
    pool = max(int(t.num_pages or 0) for t in tables)
    hq, hkv, d = heads.num_qo_heads, heads.num_kv_heads, heads.head_dim
    bucket = GraphBucket.decode(batch_size=batch_size, max_pages=longest // page_size + 2)
    q = torch.randn(batch_size, hq, d, generator=gen, device=DEV).to(torch.bfloat16)
    k = v = None
    if writes:
        k = torch.randn(batch_size, hkv, d, generator=gen, device=DEV).to(torch.bfloat16)
        v = torch.randn_like(k)
    base = [
        torch.randn(pool, 2, page_size, hkv, d, generator=gen, device=DEV).to(torch.bfloat16)
        for _ in GROUPS
    ]
    steps: dict[str, Any] = {}
    caches = {}
    for name, fast in (("fast", True), ("full", False)):
        gx = graph_executor(FlashInferExecutor(policy=ExecutorPolicy(), fast_plan=fast), bucket)
        gx.apply(specs[0], tables[0])
        caches[name] = [c.clone() for c in base]

        def forward(gx: FlashInferExecutor = gx, cs: list[torch.Tensor] = caches[name]) -> object:
            return [gx.run(g, q, k, v, c) for g, c in zip(GROUPS, cs, strict=True)]

        steps[name] = capture(gx, forward)
    kept_before = steps["fast"].executor.plan_counts["schedules_kept"]
    for i, (spec, table) in enumerate(zip(specs, tables, strict=True)):
        outs = {}
        for name, step in steps.items():
            for cache, b in zip(caches[name], base, strict=True):
                cache.copy_(b)
            with syncs_raise():
                outs[name] = [o.clone() for o in step.replay(spec, table)]
        torch.cuda.synchronize()
        for group, got, want in zip(GROUPS, outs["fast"], outs["full"], strict=True):
            assert torch.equal(got, want), (group, i)
        assert _plan_infos(steps["fast"].executor) == _plan_infos(steps["full"].executor), i
        for got_cache, want_cache in zip(caches["fast"], caches["full"], strict=True):
            assert torch.equal(got_cache, want_cache), i
    return steps, kept_before


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("batch_size", [2, 9])  # CUDA-core and tensor-core decode
def test_kept_schedules_equal_plan(page_size: int, batch_size: int) -> None:
    """A decode loop (every request one token longer each step, some steps' plans
    applied twice): where the scheduler's inputs are unchanged the re-plan keeps its
    last plan (``schedules_kept``), and every output, LSE and plan info still equals an
    executor that calls ``plan()`` every step."""
    seed = stable_seed("kept schedules", page_size, batch_size)
    gen = torch.Generator(device=DEV).manual_seed(seed)
    fast = FlashInferExecutor(fast_plan=True)
    full = FlashInferExecutor(fast_plan=False)
    hq, hkv, d = HEADS.num_qo_heads, HEADS.num_kv_heads, HEADS.head_dim
    start = np.random.default_rng(seed).integers(30, 300, batch_size)
    table = fp.PageTable.shuffled(
        fp.plan(fp.BatchLayout.decode(start + 40, page_size=page_size), HEADS).pages_needed,
        seed=seed % 1000, device=DEV,
    )  # fmt: skip
    assert table.num_pages is not None
    caches = [
        torch.randn(table.num_pages, 2, page_size, hkv, d, generator=gen, device=DEV).to(
            torch.bfloat16
        )
        for _ in GROUPS
    ]
    kept_before = 0
    for step in range(24):
        seq = start + step
        spec = fp.plan(fp.BatchLayout.decode(seq, page_size=page_size, groups=GROUPS), HEADS)
        for again in range(1 + (step % 5 == 0)):  # every fifth plan applied twice
            q = torch.randn(batch_size, hq, d, generator=gen, device=DEV).to(torch.bfloat16)
            _apply_both_and_compare(
                fast, full, spec, table, (q, None, None), caches, (step, again),
                full_syncs_raise=False,
            )  # fmt: skip
            kept = fast.plan_counts["schedules_kept"]
            if again:  # the same plan: every wrapper kept its schedule
                assert kept - kept_before == len(GROUPS), step
            kept_before = kept
    assert full.plan_counts["schedules_kept"] == 0
    if batch_size < 4 and page_size == 16:  # page counts change every 16 steps at most
        assert fast.plan_counts["schedules_kept"] >= 24


#: 32/8 heads: a tensor-core decode batch splits no keys above 2 * SMs // 8 requests.
WIDE_HEADS = fp.HeadConfig(num_qo_heads=32, num_kv_heads=8, head_dim=128)


def _unsplit_batch_size() -> int:
    """The smallest batch FlashInfer's tensor-core decode scheduler never splits here
    (more query tiles than ``2 * SMs // num_kv_heads``)."""
    num_sm = torch.cuda.get_device_properties(DEV).multi_processor_count
    return 2 * num_sm // WIDE_HEADS.num_kv_heads + 1


def _length_mix(batch_size: int, seed: int) -> list[np.ndarray]:
    """Batches of one size: short, long, mixed, one long request among short ones, and
    short again (a schedule kept from a long batch serves a short one too)."""
    rng = np.random.default_rng(seed)
    one_long = rng.integers(1, 30, batch_size)
    one_long[batch_size // 2] = 2900
    return [
        rng.integers(1, 20, batch_size),
        rng.integers(1500, 2900, batch_size),
        rng.integers(1, 2900, batch_size),
        one_long,
        rng.integers(1, 9, batch_size),
    ]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("above", [True, False])  # the unsplit batch size, or one below
def test_unsplit_schedules_stand_for_any_lengths(page_size: int, above: bool) -> None:
    """A tensor-core decode batch too large to split keeps its first schedule for any KV
    lengths (``adapter.schedule_stands``: no scheduler run, ``schedules_kept``), and
    every output, LSE and plan info equals an executor that calls ``plan()`` every
    batch; one request fewer, the scheduler runs for every batch."""
    bs = _unsplit_batch_size() - (0 if above else 1)
    seed = stable_seed("unsplit stands", page_size, bs)
    gen = torch.Generator(device=DEV).manual_seed(seed)
    fast = FlashInferExecutor(fast_plan=True)
    full = FlashInferExecutor(fast_plan=False)
    hq, d = WIDE_HEADS.num_qo_heads, WIDE_HEADS.head_dim
    batches = _length_mix(bs, seed)
    for step, seq in enumerate(batches):
        spec, table, caches = _decode_case(seq, page_size, WIDE_HEADS, gen, step)
        q = torch.randn(bs, hq, d, generator=gen, device=DEV).to(torch.bfloat16)
        _apply_both_and_compare(fast, full, spec, table, (q, None, None), caches, step)
    kept = fast.plan_counts["schedules_kept"]
    assert kept == ((len(batches) - 1) * len(GROUPS) if above else 0)
    assert fast.plan_counts["fast_decode_plan"] == (len(batches) - 1) * len(GROUPS)


@pytest.mark.parametrize("page_size", [1, 16])
def test_unsplit_schedules_stand_in_graphs(page_size: int) -> None:
    """The same in a CUDA-graph bucket of the unsplit batch size: every replay after the
    first keeps the captured schedule, bit for bit with replays planned by ``plan()``."""
    bs = _unsplit_batch_size()
    seed = stable_seed("unsplit stands graph", page_size)
    gen = torch.Generator(device=DEV).manual_seed(seed)
    batches = _length_mix(bs, seed)
    steps, kept_before = _replay_both_and_compare(
        batches, page_size, WIDE_HEADS, 2900, gen, writes=False
    )
    kept = steps["fast"].executor.plan_counts["schedules_kept"] - kept_before
    assert kept == len(batches) * len(GROUPS)  # every replay kept the schedule
    assert steps["full"].executor.plan_counts["schedules_kept"] == 0
