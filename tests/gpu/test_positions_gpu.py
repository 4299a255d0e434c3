"""``FlashInferExecutor.positions()``: RoPE positions built on the device from the plan's
position runs equal the host plan's ``PlanSpec.positions`` for every mode, never sync,
and each step of ``apply_steps`` keeps its own."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import flashplan as fp
from flashplan.testing.batches import scoring_batch

from .helpers import flashinfer_executor, stable_seed, syncs_raise

HEADS = fp.HeadConfig(num_qo_heads=4, num_kv_heads=2, head_dim=64)


def _layouts(rng: np.random.Generator, page_size: int) -> list[fp.BatchLayout]:
    seq = rng.integers(1, 300, 7)
    prefix = np.minimum(rng.integers(0, 200, 7), seq - 1)
    parents = np.array([[-1, 0, 0, 1, 1, 2]] * 3)
    return [
        fp.BatchLayout.decode(seq, page_size=page_size),
        fp.BatchLayout.extend(seq, prefix, page_size=page_size),
        fp.BatchLayout.extend(
            [40, 9, 1, 25],
            [0, 5, 0, 3],
            page_size=page_size,
            item_delimiters=[[10, 13, 20, 39], None, [0], [0, 1, 7]],
        ),
        fp.BatchLayout.verify([64, 3, 17], fp.DraftTree.from_parents(parents), page_size=page_size),
    ]


@pytest.mark.parametrize("page_size", [1, 16])
def test_positions_equal_the_plan(page_size: int) -> None:
    rng = np.random.default_rng(stable_seed("positions", page_size))
    ex = flashinfer_executor(prefill_backend="fa2")
    with pytest.raises(fp.PlanMismatchError):
        ex.positions()
    for layout in _layouts(rng, page_size) * 2:  # twice: buffers reused
        spec = fp.plan(layout, HEADS)
        table = fp.PageTable.shuffled(spec.pages_needed, seed=1, device="cuda")
        with syncs_raise():
            ex.apply(spec, table)
            out = ex.positions()
            assert ex.positions() is out  # one build per apply
        assert out.dtype == torch.int32 and out.device.type == "cuda"
        assert out.cpu().numpy().tolist() == spec.positions.tolist(), layout.mode


def test_long_multi_item_batch() -> None:
    """A scoring batch's 10^4+ positions, runs of 1 to 512 tokens."""
    ext, delims, _ = scoring_batch(np.random.default_rng(3), 64)
    spec = fp.plan(fp.BatchLayout.extend(ext, item_delimiters=delims), HEADS)
    ex = flashinfer_executor(prefill_backend="fa2")
    ex.apply(spec, fp.PageTable.sequential(spec.pages_needed, device="cuda"))
    with syncs_raise():
        out = ex.positions()
    np.testing.assert_array_equal(out.cpu().numpy(), spec.positions)


def test_each_step_keeps_its_positions() -> None:
    draft = fp.DraftDecode(prefix_lens=[5, 17, 30], topk=2, steps=3, page_size=1)
    specs = fp.plan_steps(draft, HEADS)
    ex = flashinfer_executor()
    table = fp.PageTable.sequential(specs[-1].pages_needed, device="cuda")  # the longest step
    views = ex.apply_steps(specs, table)
    with syncs_raise():
        outs = [v.positions() for v in views]
    for spec, out in zip(specs, outs, strict=True):
        assert out.cpu().numpy().tolist() == spec.positions.tolist()


def test_graph_executor_positions() -> None:
    """A CUDA-graph executor gives the applied (unpadded) plan's positions too."""
    from flashplan.executor.flashinfer import FlashInferExecutor
    from flashplan.executor.flashinfer.bucket import GraphBucket
    from flashplan.executor.flashinfer.graphs import graph_executor

    gx = graph_executor(FlashInferExecutor(), GraphBucket.decode(batch_size=8, max_pages=40))
    for seq in ([5, 9, 30], [1, 2, 3, 4, 5, 6, 7]):
        spec = fp.plan(fp.BatchLayout.decode(seq, page_size=16), HEADS)
        gx.apply(spec, fp.PageTable.sequential(spec.pages_needed, device="cuda"))
        with syncs_raise():
            out = gx.positions()
        assert out.cpu().numpy().tolist() == spec.positions.tolist() == [s - 1 for s in seq]
