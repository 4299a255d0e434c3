"""A page table bound to the executor for its life (``bind_page_table``): a graph
captured after binding replays the page gather and the decode indptr refresh itself,
and its replays equal eager steps of fresh executors over many varied batches; what a
bound executor refuses.

The bound table is one tensor rewritten in place between steps, as an engine's is;
each step's eager reference runs on a fresh, unbound executor over the same tensor.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import flashplan as fp
from flashplan.executor.flashinfer import ExecutorPolicy, FlashInferExecutor
from flashplan.executor.flashinfer.bucket import GraphBucket
from flashplan.executor.flashinfer.graphs import capture

from .helpers import rel_err, stable_seed, syncs_raise
from .test_step_loop import (  # the step-loop tests' groups and draft rounds
    CAP,
    DEV,
    FULL,
    HEADS,
    W5,
    W70,
    check_draft_replays,
    draft_rounds,
)

ROWS, POOL = 12, 4096


def _rand(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, device=DEV).to(torch.bfloat16)


def _fill(bound: torch.Tensor, spec: fp.PlanSpec, seed: int) -> fp.PageTable:
    """Rewrite the bound tensor in place with a shuffled table for ``spec`` (its rows
    at random rows of the bound table, random ids elsewhere) and return the step's
    ``PageTable`` over it."""
    shuffled = fp.PageTable.shuffled(
        spec.pages_needed, seed=seed, spare_pages=5, extra_rows=ROWS - spec.batch_size,
        device=DEV,
    )  # fmt: skip
    assert shuffled.num_pages is not None and shuffled.num_pages <= POOL
    cols = shuffled.pages.shape[1]
    assert cols <= bound.shape[1]
    bound.random_(0, POOL)
    bound[:, :cols] = shuffled.pages
    return fp.PageTable(bound, rows=shuffled.rows)


class BoundStep:
    """One bucket's graph over a bound table, with static q/k/v and caches."""

    def __init__(
        self,
        groups: tuple[fp.AttentionGroup, ...],
        bucket: GraphBucket,
        first: fp.PlanSpec,
        bound: torch.Tensor,
        *,
        policy: ExecutorPolicy,
        seed: int,
    ) -> None:
        self.groups, self.policy, self.bound = groups, policy, bound
        self.gen = torch.Generator(device=DEV).manual_seed(seed)
        n, ps = bucket.total_q, first.page_size
        hq, hkv, d = HEADS.num_qo_heads, HEADS.num_kv_heads, HEADS.head_dim
        self.q, self.k, self.v = (_rand(self.gen, n, h, d) for h in (hq, hkv, hkv))
        self.base = [_rand(self.gen, POOL, 2, ps, hkv, d) for _ in groups]
        self.caches = [c.clone() for c in self.base]
        parent = FlashInferExecutor(policy=policy)
        parent.bind_page_table(bound)
        self.gx = parent.for_bucket(bucket)  # inherits the binding
        self.gx.apply(first, _fill(bound, first, seed))
        self.step = capture(self.gx, self.forward)

    def forward(self) -> list[torch.Tensor]:
        return [
            self.gx.run(g, self.q, self.k, self.v, c)
            for g, c in zip(self.groups, self.caches, strict=True)
        ]

    def check(self, spec: fp.PlanSpec, seed: int) -> None:
        """Replay ``spec`` on a freshly rewritten bound table; outputs and caches equal
        a fresh eager executor's on the same table."""
        table = _fill(self.bound, spec, seed)
        for t in (self.q, self.k, self.v):
            t.copy_(_rand(self.gen, *t.shape))
        for cache, base in zip(self.caches, self.base, strict=True):
            cache.copy_(base)
        outs = self.step.replay(spec, table)
        eager = FlashInferExecutor(policy=self.policy)
        eager.apply(spec, table)
        n = spec.total_q
        for group, out, cache, base in zip(self.groups, outs, self.caches, self.base, strict=True):
            want_cache = base.clone()
            want = eager.run(group, self.q[:n], self.k[:n], self.v[:n], want_cache)
            torch.cuda.synchronize()
            assert rel_err(out[:n], want) <= 1e-2, (group, spec.batch_size, seed)
            assert torch.equal(cache, want_cache), (group, spec.batch_size, seed)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("tensor_cores", [False, True])
def test_bound_decode_graph_replays_many_batches(page_size: int, tensor_cores: bool) -> None:
    """30 varied decode batches (1..8 requests, lengths across window edges and page
    boundaries) through one captured graph whose gather runs in the replay."""
    rng = np.random.default_rng(stable_seed("bound", page_size, tensor_cores))
    groups = (FULL, W5, CAP, W70)
    policy = ExecutorPolicy(decode_tensor_cores=tensor_cores)
    max_pages = 600 // page_size + 2
    bucket = GraphBucket.decode(batch_size=8, max_pages=max_pages)
    bound = torch.zeros(ROWS, max_pages, dtype=torch.int32, device=DEV)

    def layout(bs: int) -> fp.BatchLayout:
        return fp.BatchLayout.decode(rng.integers(1, 600, bs), page_size=page_size, groups=groups)

    first = fp.plan(layout(8), HEADS)
    step = BoundStep(groups, bucket, first, bound, policy=policy, seed=page_size)
    assert step.gx._buffers.captured is not None  # the gather is the graph's
    launches = step.gx.plan_counts
    for k in range(30):
        spec = fp.plan(layout(int(rng.integers(1, 9))), HEADS)
        step.check(spec, seed=100 + k)
    # every decode wrapper re-planned through the scheduler, never a full plan()
    assert step.gx.plan_counts["plan"] == launches["plan"]
    spec = fp.plan(layout(5), HEADS)
    table = _fill(bound, spec, 7)
    with syncs_raise():
        step.step.replay(spec, table)
    torch.cuda.synchronize()
    with pytest.raises(fp.PlanMismatchError, match="before capture"):
        step.gx.bind_page_table(bound)


@pytest.mark.parametrize("page_size", [1, 16])
def test_bound_verify_graph_with_masks_gathers_per_apply(page_size: int) -> None:
    """A tree verify's mask launch changes size with the batch: its graph does not
    capture the gather, and still replays as eager steps over the bound table."""
    rng = np.random.default_rng(stable_seed("bound-verify", page_size))
    n, groups = 7, (FULL, W5)
    max_pages = 320 // page_size + 2
    bucket = GraphBucket.verify(batch_size=4, max_pages=max_pages, num_tokens=n)
    bound = torch.zeros(ROWS, max_pages, dtype=torch.int32, device=DEV)

    def spec(bs: int) -> fp.PlanSpec:
        tree = fp.DraftTree.eagle(bs, topk=2, steps=3)
        layout = fp.BatchLayout.verify(
            rng.integers(0, 300, bs), tree, page_size=page_size, groups=groups
        )
        return fp.plan(layout, HEADS)

    step = BoundStep(groups, bucket, spec(4), bound, policy=ExecutorPolicy(), seed=3)
    assert step.gx._buffers.captured is None
    for k, bs in enumerate((4, 2, 1, 3)):
        step.check(spec(bs), seed=200 + k)


def test_a_bound_executor_refuses_other_tables() -> None:
    bound = torch.zeros(4, 8, dtype=torch.int32, device=DEV)
    ex = FlashInferExecutor()
    with pytest.raises(fp.PageTableError, match="int32"):
        ex.bind_page_table(bound.long())
    with pytest.raises(fp.PageTableError, match="num_pages"):
        ex.bind_page_table(bound, num_pages=0)
    ex.bind_page_table(bound, num_pages=64)
    spec = fp.plan(fp.BatchLayout.decode([20, 3], page_size=16), HEADS)
    other = fp.PageTable.sequential(spec.pages_needed, max_pages=8, device=DEV)
    with pytest.raises(fp.PlanMismatchError, match="bound"):
        ex.apply(spec, other)  # another tensor
    bound[:2] = other.pages
    with pytest.raises(fp.PlanMismatchError, match="bound"):
        ex.apply(spec, fp.PageTable(bound, rows=[0, 1]))  # another num_pages
    ex.apply(spec, fp.PageTable(bound, rows=[0, 1], num_pages=64))
    bound.set_(torch.zeros(4, 8, dtype=torch.int32, device=DEV))  # new storage in place
    with pytest.raises(fp.PageTableError, match="new storage"):
        ex.apply(spec, fp.PageTable(bound, rows=[0, 1], num_pages=64))


@pytest.mark.parametrize("page_size", [1, 16])
def test_bound_multi_step_draft_graph_replays_rounds(page_size: int) -> None:
    """A multi-step draft decode in one graph over a bound table: ``apply_steps`` stages
    every step once, the captured gather serves all steps, and each round's outputs and
    caches equal a fresh eager ``apply_steps`` on the same table (padding branches in
    every round but the first)."""
    topk, steps, groups = 2, 3, (FULL, W5)
    max_pages = 320 // page_size + 4
    bucket = GraphBucket.decode(batch_size=4 * topk, max_pages=max_pages)
    rounds, pool = draft_rounds(page_size, topk, steps, groups, "bound draft")
    bound = torch.zeros(4 * topk + 2, max_pages, dtype=torch.int32, device=DEV)

    def on_bound(branches: fp.PageTable) -> fp.PageTable:
        """The round's branch table written into the bound tensor (its rows on top)."""
        rows, cols = branches.pages.shape
        bound.zero_()
        bound[:rows, :cols] = branches.pages
        return fp.PageTable(bound, rows=branches.rows)

    parent = FlashInferExecutor()
    parent.bind_page_table(bound)
    gx = parent.for_bucket(bucket)
    check_draft_replays(gx, rounds, pool, bucket, groups, on_bound)
    assert gx._buffers.captured is not None  # the gather was the graph's
