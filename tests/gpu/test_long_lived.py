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

import pytest
import torch

import flashplan as fp
from flashplan.executor.flashinfer import ExecutorPolicy, FlashInferExecutor
from flashplan.testing.checking import apply_batch, batch_inputs, check_batch, check_sequence
from flashplan.testing.graph_buckets import check_bucket_replays
from flashplan.testing.sequences import Batch, batch_sequence

from .helpers import stable_seed, syncs_raise

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
MAX_TOKENS = 768  # per request (48 pages of 16)


@pytest.mark.parametrize("page_size", [1, 16])
def test_graph_buckets_replay_many_batches(page_size: int) -> None:
    wrong = check_bucket_replays(
        FlashInferExecutor(policy=ExecutorPolicy(prefill_backend="fa2")), HEADS, GROUPS,
        page_size=page_size, device=DEV, dtype=torch.bfloat16, tol=1e-2, steps=60,
        max_tokens=MAX_TOKENS, batch_size=8, max_spare_pages=60,
        seed=stable_seed("graph-long-lived", page_size),
    )  # fmt: skip
    assert not wrong, wrong
