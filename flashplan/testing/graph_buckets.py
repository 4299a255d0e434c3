"""CUDA-graph buckets checked as an engine uses them: one parent executor's decode, verify
and draft-extend buckets, each captured once, then replayed in turn over many batches of
other sizes, lengths, draft trees and page tables (with eager batches of the parent in
between); every replay compared with a fresh :class:`~flashplan.ReferenceExecutor`, its
outputs on the real rows and its KV-cache writes::

    from flashplan.executor.flashinfer import FlashInferExecutor
    from flashplan.testing.graph_buckets import check_bucket_replays

    wrong = check_bucket_replays(FlashInferExecutor(), heads, groups, page_size=16,
                                 device="cuda", dtype=torch.bfloat16, tol=1e-2)
    assert not wrong, wrong

On a GPU the buckets are real CUDA graphs; over :mod:`flashplan.twin` they replay
eagerly, and the same check runs on the CPU. Needs no Hypothesis.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from flashplan.executor.flashinfer.bucket import GraphBucket
from flashplan.executor.flashinfer.executor import FlashInferExecutor
from flashplan.executor.flashinfer.graphs import capture, graph_executor
from flashplan.executor.reference import ReferenceExecutor
from flashplan.layout.batch import BatchLayout
from flashplan.layout.drafts import DraftTree
from flashplan.layout.group import AttentionGroup
from flashplan.layout.heads import HeadConfig
from flashplan.layout.page_table import PageTable
from flashplan.planning.planner import plan
from flashplan.planning.spec import PlanSpec
from flashplan.testing.batches import bushy_tree_parents
from flashplan.testing.compare import out_error

__all__ = ["BUCKET_KINDS", "BucketReplayer", "bucket_layout", "check_bucket_replays"]

#: The bucket kinds :func:`check_bucket_replays` captures, by :func:`bucket_layout`'s name.
BUCKET_KINDS = ("decode", "verify", "draft_extend")
_TREE_TOKENS = 6  # tokens per verify tree
_DRAFT_TOKENS = 4  # tokens per request of a draft extend


def bucket_layout(
    kind: str,
    rng: np.random.Generator,
    batch_size: int,
    *,
    page_size: int,
    groups: Sequence[AttentionGroup],
    max_tokens: int,
) -> BatchLayout:
    """A random batch of ``batch_size`` requests of ``kind`` (one of :data:`BUCKET_KINDS`)
    whose cached prefixes are drawn from ``[0, max_tokens - 40)`` tokens: a decode step,
    a verify of :data:`_TREE_TOKENS`-token trees (tokens 1 and 2 both children of the
    root, so a tree and never a chain) or a draft extend of up to 4 accepted tokens."""
    prefix = rng.integers(0, max_tokens - 40, batch_size)
    if kind == "decode":
        return BatchLayout.decode(prefix + 1, page_size=page_size, groups=groups)
    if kind == "verify":
        parents = bushy_tree_parents(rng, batch_size, _TREE_TOKENS, reach=_TREE_TOKENS)
        parents[:, 2] = 0
        tree = DraftTree.from_parents(parents)
        return BatchLayout.verify(prefix, tree, page_size=page_size, groups=groups)
    if kind != "draft_extend":
        raise ValueError(f"kind must be one of {BUCKET_KINDS}, got {kind!r}")
    accepted = rng.integers(1, _DRAFT_TOKENS + 1, batch_size)
    return BatchLayout.draft_extend(
        prefix, accepted, tokens_per_request=_DRAFT_TOKENS, page_size=page_size, groups=groups
    )


class BucketReplayer:
    """One bucket's graph executor (made from ``parent``), its fixed inputs (queries,
    new K/V: ``[bucket.total_q, heads, head_dim]`` in ``dtype``; one cache per group,
    ``[pool, 2, page_size, num_kv_heads, head_dim]``) and its forward (every group's
    ``run``), captured once on ``first`` and ``table``."""

    def __init__(
        self,
        parent: FlashInferExecutor,
        bucket: GraphBucket,
        first: PlanSpec,
        table: PageTable,
        *,
        groups: Sequence[AttentionGroup],
        pool: int,
        seed: int,
        dtype: torch.dtype,
    ) -> None:
        self.groups = tuple(groups)
        self.dtype = dtype
        device = table.pages.device
        self.gen = torch.Generator(device=device).manual_seed(seed)
        h, n = first.heads, bucket.total_q
        self.q = self._rand(n, h.num_qo_heads, h.head_dim)
        self.k = self._rand(n, h.num_kv_heads, h.head_dim)
        cache_shape = (pool, 2, first.page_size, h.num_kv_heads, h.head_dim)
        self.caches = [self._rand(*cache_shape) for _ in self.groups]
        self.graph_executor = graph_executor(parent, bucket)
        self.graph_executor.apply(first, table)
        self.step = capture(self.graph_executor, self._forward)

    def _rand(self, *shape: int) -> torch.Tensor:
        device = self.gen.device
        return torch.randn(*shape, generator=self.gen, device=device).to(self.dtype)

    def _forward(self) -> list[torch.Tensor]:
        pairs = zip(self.groups, self.caches, strict=True)
        return [self.graph_executor.run(g, self.q, self.k, self.k, c) for g, c in pairs]

    def check(self, spec: PlanSpec, table: PageTable) -> float:
        """Fresh queries and K/V, then a replay of ``spec`` over ``table``: the worst
        ``max |out - ref| / max |ref|`` over the groups against a fresh reference on the
        real rows; ``inf`` where a cache write differs from the reference's."""
        n = spec.total_q
        self.q.copy_(self._rand(*self.q.shape))
        self.k.copy_(self._rand(*self.k.shape))
        before = [c.clone() for c in self.caches]
        outs = self.step.replay(spec, table)
        ref = ReferenceExecutor()
        ref.apply(spec, table)
        worst = 0.0
        for group, out, cache, base in zip(self.groups, outs, self.caches, before, strict=True):
            want = ref.run(group, self.q[:n], self.k[:n], self.k[:n], base)
            worst = max(worst, out_error(out[:n], want))
            if not torch.equal(cache, base):  # base now holds the reference's writes
                worst = float("inf")
        return worst


def check_bucket_replays(
    parent: FlashInferExecutor,
    heads: HeadConfig,
    groups: Sequence[AttentionGroup],
    *,
    page_size: int,
    device: torch.device | str,
    dtype: torch.dtype,
    tol: float,
    steps: int = 40,
    max_tokens: int = 300,
    batch_size: int = 6,
    max_spare_pages: int = 30,
    seed: int = 0,
) -> list[str]:
    """Capture a decode bucket of ``batch_size`` requests and verify and draft-extend
    buckets of half as many from ``parent`` (each bucket's first batch full), then
    ``steps`` batches: a random kind, a random size up to its bucket's, prefixes up to
    ``max_tokens`` tokens, a shuffled table with up to ``max_spare_pages`` spare pages
    and 3 extra rows; every 5th step also an eager batch on ``parent``. Returns the
    replays worse than ``tol`` (:meth:`BucketReplayer.check`), each with the step
    before it; empty when every replay is right."""
    rng = np.random.default_rng(seed)
    max_pages = -(-max_tokens // page_size) + 1
    half = max(1, batch_size // 2)
    buckets = {
        "decode": GraphBucket.decode(batch_size=batch_size, max_pages=max_pages),
        "verify": GraphBucket.verify(batch_size=half, max_pages=max_pages, num_tokens=_TREE_TOKENS),
        "draft_extend": GraphBucket.extend(
            batch_size=half, max_pages=max_pages, tokens_per_request=_DRAFT_TOKENS
        ),
    }
    pool = batch_size * max_pages + max_spare_pages

    def layout(kind: str, bs: int) -> BatchLayout:
        return bucket_layout(
            kind, rng, bs, page_size=page_size, groups=groups, max_tokens=max_tokens
        )  # fmt: skip

    replayers = {}
    for index, (kind, bucket) in enumerate(buckets.items()):
        spec = plan(layout(kind, bucket.batch_size), heads, extend_path="paged")
        table = PageTable.shuffled(spec.pages_needed, seed=index, device=device)
        replayers[kind] = BucketReplayer(
            parent, bucket, spec, table, groups=groups, pool=pool, seed=index, dtype=dtype
        )
    wrong, previous = [], "(first)"
    for step in range(steps):
        kind = str(rng.choice(BUCKET_KINDS))
        bs = int(rng.integers(1, buckets[kind].batch_size + 1))
        spec = plan(layout(kind, bs), heads, extend_path="paged")
        table = PageTable.shuffled(
            spec.pages_needed, seed=step, spare_pages=int(rng.integers(0, max_spare_pages + 1)),
            extra_rows=int(rng.integers(0, 4)), device=device,
        )  # fmt: skip
        label = f"{step}: {kind} bs={bs}"
        err = replayers[kind].check(spec, table)
        if not err <= tol:
            wrong.append(f"{label} (err {err:.3g}) after {previous}")
        if step % 5 == 0:
            eager = plan(layout("decode", 3), heads)
            parent.apply(eager, PageTable.shuffled(eager.pages_needed, seed=step, device=device))
        previous = label
    return wrong
