"""One FlashInfer executor over many varied batches, as an engine keeps it (issue #23).

* One :class:`FlashInferExecutor` for a whole random sequence of batches — every mode
  (decode, extends with and without cached prefixes, multi-item with requests without
  delimiters and batches of empty delimiter lists, tree and chain verify, draft extend
  with and without a fixed token count, multi-step draft decode, block extend, cross
  groups with encoders), page sizes 1, 4, 8, 16, paths auto / paged / ragged, random
  group sets, heads fixed for the run or drawn per batch, a new page table per batch —
  each batch compared with a fresh reference executor. A failure names the batch and the
  one before it (``flashplan.testing.sequences`` draws the batches,
  ``flashplan.testing.checking`` compares them); ``FLASHPLAN_LONG_LIVED_BATCHES`` sets
  the length (default 500; the compute-sanitizer run uses a shorter one).
* The same executor's apply + run never synchronizes, batch after batch.
* CUDA graphs: graph executors of a decode, a verify and a draft-extend bucket made from
  one eager executor, replayed in turn over a sequence of different batches (batch
  sizes, lengths, trees, tables), each replay compared with the reference, eager steps
  of the parent executor in between.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import flashplan as fp
from flashplan.executor.flashinfer import ExecutorPolicy, FlashInferExecutor
from flashplan.executor.flashinfer.bucket import GraphBucket
from flashplan.executor.flashinfer.graphs import capture, graph_executor
from flashplan.testing.batches import bushy_tree_parents
from flashplan.testing.checking import apply_batch, batch_inputs, check_batch, check_sequence
from flashplan.testing.sequences import Batch, batch_sequence

from .helpers import rel_err, stable_seed, syncs_raise

DEV = "cuda"
BATCHES = int(os.environ.get("FLASHPLAN_LONG_LIVED_BATCHES", "500"))


@pytest.mark.parametrize("heads", ["fixed", "varied"])
@pytest.mark.parametrize("backend", ["fa2", "auto"])
def test_one_executor_many_batches(backend: str, heads: str) -> None:
    executor = FlashInferExecutor(policy=ExecutorPolicy(prefill_backend=backend))
    seed = stable_seed("long-lived", backend, heads)
    batches = batch_sequence(seed, BATCHES, device=DEV, vary_heads=heads == "varied")
    report = check_sequence(executor, batches)
    print(f"\n{backend} {heads} heads: {report.summary(limit=0)}")
    assert len(report.checks) == BATCHES
    assert not report.wrong, report.summary()


def test_long_lived_apply_and_run_never_sync() -> None:
    """A second pass over a sequence (the first loaded every module) with every
    synchronizing CUDA call raising; then the results against the reference."""
    executor = FlashInferExecutor(policy=ExecutorPolicy(prefill_backend="fa2"))
    seed = stable_seed("long-lived-syncs")
    count = min(BATCHES, 120)
    for batch in batch_sequence(seed, count, device=DEV):
        check_batch(executor, batch)  # warm-up: module loading may synchronize
    wrong = []
    for batch in batch_sequence(seed, count, device=DEV):
        outs = _run_unchecked(executor, batch)
        torch.cuda.synchronize()
        # the same batch on a fresh executor, compared after the sync-free pass
        fresh = _run_unchecked(FlashInferExecutor(policy=ExecutorPolicy(prefill_backend="fa2")),
                               batch, sync_free=False)  # fmt: skip
        for got, want in zip(outs, fresh, strict=True):
            if not torch.equal(got, want):
                wrong.append(batch.label)
                break
    assert not wrong, wrong[:5]


def _run_unchecked(executor: FlashInferExecutor, batch: Batch, *, sync_free: bool = True) -> list:
    """Apply and run every group on the batch's own inputs, with syncs raising: the
    outputs, each step's positions and the caches."""
    inputs = batch_inputs(batch)
    outs = []
    with syncs_raise(sync_free):
        for view, calls in zip(apply_batch(executor, batch), inputs.calls, strict=True):
            for (group, q, k, v, sinks), cache in zip(calls, inputs.caches, strict=True):
                outs.append(view.run(group, q, k, v, cache, sinks=sinks))
            outs.append(view.positions())
    return outs + list(inputs.caches)


# -- CUDA graphs ------------------------------------------------------------------------
HEADS = fp.HeadConfig(num_qo_heads=32, num_kv_heads=8, head_dim=128)
GROUPS = (
    fp.AttentionGroup.full(),
    fp.AttentionGroup.sliding(15),
    fp.AttentionGroup.sliding(40, logits_soft_cap=30.0),
)
MAX_PAGES = 48  # per request, at page size 16 (768 tokens)


class _Replayer:
    """One bucket's graph executor, static inputs and captured forward."""

    def __init__(self, parent: FlashInferExecutor, bucket: GraphBucket, first: fp.PlanSpec,
                 table: fp.PageTable, pool: int, seed: int) -> None:  # fmt: skip
        self.gen = torch.Generator(device=DEV).manual_seed(seed)
        n, ps = bucket.total_q, first.page_size
        self.q = self.rand(n, 32, 128)
        self.k = self.rand(n, 8, 128)
        self.caches = [self.rand(pool, 2, ps, 8, 128) for _ in GROUPS]
        self.gx = graph_executor(parent, bucket)
        self.gx.apply(first, table)
        self.step = capture(self.gx, self.forward)

    def rand(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen, device=DEV).to(torch.bfloat16)

    def forward(self) -> list[torch.Tensor]:
        pairs = zip(GROUPS, self.caches, strict=True)
        return [self.gx.run(g, self.q, self.k, self.k, c) for g, c in pairs]

    def check(self, spec: fp.PlanSpec, table: fp.PageTable) -> float:
        """Replay ``spec`` and compare with the reference; the worst relative error (inf
        where a cache write differs)."""
        n = spec.total_q
        self.q.copy_(self.rand(*self.q.shape))
        self.k.copy_(self.rand(*self.k.shape))
        before = [c.clone() for c in self.caches]
        outs = self.step.replay(spec, table)
        ref = fp.ReferenceExecutor()
        ref.apply(spec, table)
        worst = 0.0
        for group, out, cache, base in zip(GROUPS, outs, self.caches, before, strict=True):
            want = ref.run(group, self.q[:n], self.k[:n], self.k[:n], base)
            worst = max(worst, rel_err(out[:n], want))
            if not torch.equal(cache, base):  # base now holds the reference's writes
                worst = float("inf")
        return worst


def _graph_layout(kind: str, rng: np.random.Generator, bs: int, ps: int) -> fp.BatchLayout:
    prefix = rng.integers(0, 16 * MAX_PAGES - 40, bs)
    if kind == "decode":
        return fp.BatchLayout.decode(prefix + 1, page_size=ps, groups=GROUPS)
    if kind == "verify":
        tree = fp.DraftTree.from_parents(bushy_tree_parents(rng, bs, 8, reach=8))
        return fp.BatchLayout.verify(prefix, tree, page_size=ps, groups=GROUPS)
    accepted = rng.integers(1, 5, bs)
    return fp.BatchLayout.draft_extend(prefix, accepted, tokens_per_request=4, page_size=ps,
                                       groups=GROUPS)  # fmt: skip


@pytest.mark.parametrize("page_size", [1, 16])
def test_graph_buckets_replay_many_batches(page_size: int) -> None:
    rng = np.random.default_rng(stable_seed("graph-long-lived", page_size))
    parent = FlashInferExecutor(policy=ExecutorPolicy(prefill_backend="fa2"))
    max_pages = MAX_PAGES * 16 // page_size
    buckets = {
        "decode": GraphBucket.decode(batch_size=8, max_pages=max_pages),
        "verify": GraphBucket.verify(batch_size=4, max_pages=max_pages, num_tokens=8),
        "draft_extend": GraphBucket.extend(batch_size=4, max_pages=max_pages, tokens_per_request=4),
    }
    replayers = {}
    for index, (kind, bucket) in enumerate(buckets.items()):
        spec = fp.plan(_graph_layout(kind, rng, bucket.batch_size, page_size), HEADS,
                       extend_path="paged")  # fmt: skip
        table = fp.PageTable.shuffled(spec.pages_needed, seed=index, device=DEV)
        pool = int(table.num_pages or 0) + 64 * max_pages
        replayers[kind] = _Replayer(parent, bucket, spec, table, pool, seed=index)
    wrong = []
    previous = "(first)"
    for step in range(60):
        kind = str(rng.choice(list(buckets)))
        bs = int(rng.integers(1, buckets[kind].batch_size + 1))
        spec = fp.plan(_graph_layout(kind, rng, bs, page_size), HEADS, extend_path="paged")
        table = fp.PageTable.shuffled(
            spec.pages_needed, seed=step, spare_pages=int(rng.integers(0, 60)),
            extra_rows=int(rng.integers(0, 4)), device=DEV,
        )  # fmt: skip
        label = f"{step}: {kind} bs={bs}"
        err = replayers[kind].check(spec, table)
        if err > 1e-2:
            wrong.append(f"{label} (err {err:.3g}) after {previous}")
        if step % 5 == 0:  # an eager batch of the parent in between
            eager = fp.plan(_graph_layout("decode", rng, 3, page_size), HEADS)
            e_table = fp.PageTable.shuffled(eager.pages_needed, seed=step, device=DEV)
            parent.apply(eager, e_table)
        previous = label
    assert not wrong, wrong
