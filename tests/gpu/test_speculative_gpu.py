"""Speculative modes on real FlashInfer kernels vs the reference executor (H200):
target verify (trees and chains, every group kind, windows that bite inside the tree),
draft extend and the multi-step draft decode, sync-free."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import flashplan as fp
from flashplan.executor.flashinfer import ExecutorPolicy, FlashInferExecutor

from .helpers import rel_err, run_both, stable_seed, syncs_raise

DEV = "cuda"
HEADS = fp.HeadConfig(num_qo_heads=16, num_kv_heads=4, head_dim=128)
GROUPS = (
    fp.AttentionGroup.full(),
    fp.AttentionGroup.sliding(3),
    fp.AttentionGroup.sliding(40, logits_soft_cap=30.0),
    fp.AttentionGroup.cross(),
)


def _executor() -> fp.Executor:
    return FlashInferExecutor(policy=ExecutorPolicy(prefill_backend="fa2"))


def _tree(kind: str, bs: int, n: int, rng: np.random.Generator) -> fp.DraftTree:
    if kind == "chain":
        return fp.DraftTree.chain(bs, n)
    parents = np.full((bs, n), -1, dtype=np.int64)
    for j in range(1, n):
        parents[:, j] = rng.integers(0, j, bs)
    return fp.DraftTree.from_parents(parents)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("n", [1, 4, 8, 64])
@pytest.mark.parametrize("kind", ["tree", "chain"])
def test_verify_matches_reference(page_size: int, n: int, kind: str) -> None:
    rng = np.random.default_rng(stable_seed("verify", page_size, n, kind))
    prefix = np.array([0, 2, 3, 40, 41, 300])
    enc = rng.integers(0, 30, prefix.shape[0])
    layout = fp.BatchLayout.verify(
        prefix, _tree(kind, prefix.shape[0], n, rng), page_size=page_size, groups=GROUPS,
        encoder_lens=enc,
    )  # fmt: skip
    for group, out_err, lse_err, cache_err in run_both(layout, HEADS, _executor(), seed=n):
        assert out_err <= 1e-2, group
        assert lse_err <= 5e-2, group
        assert cache_err == 0.0, group


def test_eagle_verify_and_draft_extend() -> None:
    tree = fp.DraftTree.eagle(4, topk=4, steps=3)
    layout = fp.BatchLayout.verify([17, 100, 4095, 1], tree, page_size=16, groups=GROUPS[:3])
    for group, out_err, _, cache_err in run_both(layout, HEADS, _executor(), seed=1):
        assert out_err <= 1e-2 and cache_err == 0.0, group
    extend = fp.BatchLayout.draft_extend(
        [30, 200, 7], [1, 4, 2], tokens_per_request=4, page_size=16, groups=GROUPS[:3]
    )
    for group, out_err, _, cache_err in run_both(
        extend, HEADS, _executor(), extend_path="paged", seed=2
    ):
        assert out_err <= 1e-2 and cache_err == 0.0, group


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("topk", "steps"), [(1, 1), (1, 5), (4, 3), (8, 5)])
def test_multi_step_draft_decode_matches_reference(page_size: int, topk: int, steps: int) -> None:
    prefix = [1, 16, 17, 300]
    groups = GROUPS[:3]
    draft = fp.DraftDecode(prefix, topk, steps, page_size=page_size, groups=groups)
    specs = fp.plan_steps(draft, HEADS)
    prompt = fp.PageTable.shuffled(
        [(p + page_size - 1) // page_size for p in prefix], seed=3, device=DEV
    )
    assert prompt.num_pages is not None
    own = draft.branch_pages
    branch_pages = (
        torch.arange(
            prompt.num_pages, prompt.num_pages + len(prefix) * topk * own, dtype=torch.int32
        )
        .reshape(len(prefix), topk, own)
        .to(DEV)
    )
    table = fp.PageTable.draft_branches(prompt, prefix, topk, branch_pages, page_size=page_size)
    pool = prompt.num_pages + len(prefix) * topk * own
    gen = torch.Generator(device=DEV).manual_seed(steps)
    caches = [
        torch.randn(pool, 2, page_size, 4, 128, generator=gen, device=DEV).to(torch.bfloat16)
        for _ in groups
    ]
    ref_caches = [c.clone() for c in caches]
    ex = _executor()
    torch.cuda.synchronize()
    views = ex.apply_steps(specs, table)
    ref_views = fp.ReferenceExecutor().apply_steps(specs, table)
    rows = len(prefix) * topk
    for view, ref_view in zip(views, ref_views, strict=True):
        for group, cache, ref_cache in zip(groups, caches, ref_caches, strict=True):
            q = torch.randn(rows, 16, 128, generator=gen, device=DEV).to(torch.bfloat16)
            k = torch.randn(rows, 4, 128, generator=gen, device=DEV).to(torch.bfloat16)
            out = view.run(group, q, k, k, cache)
            want = ref_view.run(group, q, k, k, ref_cache)
            assert rel_err(out, want) <= 1e-2, group
            assert torch.equal(cache, ref_cache), group


def test_verify_and_draft_steps_never_sync() -> None:
    tree = fp.DraftTree.eagle(3, topk=2, steps=2)
    verify = fp.plan(
        fp.BatchLayout.verify([9, 40, 300], tree, page_size=16, groups=GROUPS[:2]), HEADS
    )
    draft = fp.DraftDecode([9, 40, 300], 2, 3, page_size=16, groups=GROUPS[:2])
    steps = fp.plan_steps(draft, HEADS)
    table = fp.PageTable.shuffled(verify.pages_needed, device=DEV)
    cache = torch.randn(int(table.num_pages or 1) + 64, 2, 16, 4, 128, device=DEV).to(
        torch.bfloat16
    )
    branch_pages = torch.arange(
        int(table.num_pages or 0), int(table.num_pages or 0) + 6, dtype=torch.int32, device=DEV
    ).reshape(3, 2, 1)
    branches = fp.PageTable.draft_branches(table, [9, 40, 300], 2, branch_pages, page_size=16)
    ex = _executor()
    q = torch.randn(verify.total_q, 16, 128, device=DEV).to(torch.bfloat16)
    k = torch.randn(verify.total_q, 4, 128, device=DEV).to(torch.bfloat16)
    qd = torch.randn(6, 16, 128, device=DEV).to(torch.bfloat16)
    kd = torch.randn(6, 4, 128, device=DEV).to(torch.bfloat16)
    for attempt in range(2):  # the first round loads modules
        with syncs_raise(attempt == 1):
            ex.apply(verify, table)
            for g in GROUPS[:2]:
                ex.run(g, q, k, k, cache)
            for view in ex.apply_steps(steps, branches):
                for g in GROUPS[:2]:
                    view.run(g, qd, kd, kd, cache)
    torch.cuda.synchronize()


def _draft_batch(
    prefix: list[int], topk: int, steps: int, page_size: int, seed: int
) -> tuple[tuple[fp.PlanSpec, ...], fp.PageTable, int]:
    """A multi-step draft's step plans, its branch table and the pool it needs."""
    draft = fp.DraftDecode(prefix, topk, steps, page_size=page_size, groups=GROUPS[:3])
    prompt = fp.PageTable.shuffled(
        [(p + page_size - 1) // page_size for p in prefix], seed=seed, device=DEV
    )
    start = int(prompt.num_pages or 0)
    count = len(prefix) * topk * draft.branch_pages
    branch_pages = torch.arange(start, start + count, dtype=torch.int32, device=DEV)
    table = fp.PageTable.draft_branches(
        prompt, prefix, topk, branch_pages.reshape(len(prefix), topk, -1), page_size=page_size
    )
    return fp.plan_steps(draft, HEADS), table, start + count


@pytest.mark.parametrize("tensor_cores", [True, False])
@pytest.mark.parametrize("page_size", [1, 16])
def test_draft_steps_equal_each_step_applied_alone(tensor_cores: bool, page_size: int) -> None:
    """One executor over draft batches of 1024, 4 and 768 branches (one batch twice):
    every step's output and LSE from ``apply_steps`` equal, bit for bit, a fresh
    executor's ``apply`` of that step alone (the same ``plan()`` arguments)."""
    policy = ExecutorPolicy(decode_tensor_cores=tensor_cores)
    ex = FlashInferExecutor(policy=policy)
    rng = np.random.default_rng(stable_seed("share", tensor_cores, page_size))
    gen = torch.Generator(device=DEV).manual_seed(page_size)
    batches = [
        ([int(x) for x in rng.integers(1, 600, 128)], 8, 4),
        ([int(x) for x in rng.integers(1, 600, 128)], 8, 4),
        ([5, 900, 17, 250], 1, 3),  # 4 branches
        ([int(x) for x in rng.integers(1, 600, 96)], 8, 5),
    ]
    for i, (prefix, topk, steps) in enumerate(batches):
        specs, table, pool = _draft_batch(prefix, topk, steps, page_size, seed=i)
        cache = torch.randn(pool, 2, page_size, 4, 128, generator=gen, device=DEV)
        cache = cache.to(torch.bfloat16)
        rows = len(prefix) * topk
        q = torch.randn(rows, 16, 128, generator=gen, device=DEV).to(torch.bfloat16)
        views = ex.apply_steps(specs, table)
        for k, view in enumerate(views):
            alone = FlashInferExecutor(policy=policy)
            alone.apply(specs[k], table)
            for group in GROUPS[:3]:
                out, lse = view.run(group, q, None, None, cache, return_lse=True)
                want, want_lse = alone.run(group, q, None, None, cache, return_lse=True)
                assert torch.equal(out, want) and torch.equal(lse, want_lse), (i, k, group)
        torch.cuda.synchronize()
