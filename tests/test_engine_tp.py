"""Tensor parallelism in the example engine on the CPU: two processes over gloo, each
with its share of the heads and MLP columns, equal one process (logits within fp32
rounding of the all-reduce's summation order, generated tokens identical); without the
all-reduce they do not."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: examples.engine

import flashplan as fp
from examples.engine.run_tp import tp_worker

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")


def _run(tmp_path: Path, model: str, reduce: bool) -> tuple[float, bool, int, int]:
    out = tmp_path / "result.pt"
    mp.spawn(tp_worker, args=(2, str(tmp_path / "rendezvous"), model, str(out), reduce), nprocs=2)
    diff, same, rows, heads, _ = torch.load(out)
    return diff, same, rows, heads


@pytest.mark.parametrize("model", ["llama", "gemma2"])
def test_two_ranks_equal_one_process(tmp_path: Path, model: str) -> None:
    diff, same, rows, heads = _run(tmp_path, model, reduce=True)
    assert heads == 2  # 4 query heads over 2 ranks
    assert rows > 50
    assert diff <= 1e-4 and same, (diff, same)


def test_without_the_all_reduce_the_ranks_differ(tmp_path: Path) -> None:
    diff, _, _, _ = _run(tmp_path, "llama", reduce=False)
    assert diff > 1e-2


def test_heads_shard_in_contiguous_blocks() -> None:
    heads = fp.HeadConfig(32, 8, 128)
    for world in (1, 2, 4, 8):
        share = heads.shard(world)
        assert share.num_qo_heads * world == 32 and share.num_kv_heads * world == 8
        assert share.group_size == heads.group_size
    with pytest.raises(fp.LayoutError, match="num_kv_heads"):
        heads.shard(3)
    with pytest.raises(fp.LayoutError, match="world_size"):
        heads.shard(0)
