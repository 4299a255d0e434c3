"""The FlashInfer executor's whole orchestration on the CPU, over the twin of FlashInfer
(:mod:`flashplan.twin`): CUDA-graph buckets replayed eagerly (padding, fixed buffers,
graph-mode wrappers planned per replay) over many batches, multi-step draft decodes,
the checked mode and fp8 caches — each against the reference executor. (Every eager
mode over hundreds of varied batches: ``tests/test_long_lived.py``.)"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

import flashplan as fp
from flashplan.executor.flashinfer import FlashInferExecutor, GraphBucket
from flashplan.testing.graph_buckets import check_bucket_replays
from flashplan.twin import flashinfer_twin

HEADS = fp.HeadConfig(num_qo_heads=4, num_kv_heads=2, head_dim=16, q_dtype=torch.float32)
GROUPS = (
    fp.AttentionGroup.full(),
    fp.AttentionGroup.sliding(15),
    fp.AttentionGroup.sliding(40, logits_soft_cap=30.0),
)
MAX_TOKENS = 300
TOL = 1e-4  # float32 on both sides


def _executor(**kwargs: object) -> FlashInferExecutor:
    return FlashInferExecutor(flashinfer=flashinfer_twin, **kwargs)  # type: ignore[arg-type]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-6)) if b.numel() else 0.0


@pytest.mark.parametrize("page_size", [1, 16])
def test_graph_buckets_replay_many_batches(page_size: int) -> None:
    """Decode, verify and draft-extend buckets made from one eager executor, replayed in
    turn over 40 batches of other sizes, lengths, trees and tables (eager batches of the
    parent in between): each replay equals the reference on its real rows
    (:func:`flashplan.testing.graph_buckets.check_bucket_replays`; on a GPU:
    ``tests/gpu/test_long_lived.py``)."""
    wrong = check_bucket_replays(
        _executor(), HEADS, GROUPS, page_size=page_size, device="cpu", dtype=torch.float32,
        tol=TOL, steps=40, max_tokens=MAX_TOKENS, batch_size=6, seed=page_size,
    )  # fmt: skip
    assert not wrong, wrong


class _OffByOneGraphDecode(flashinfer_twin.BatchDecodeWithPagedKVCacheWrapper):  # type: ignore[name-defined,misc]
    """A graph-mode decode wrapper whose first request's output is off by 1e-3: a replay
    bug for :func:`check_bucket_replays` to find (eager decodes stay right)."""

    def run(self, q: torch.Tensor, paged_kv_cache: object, **kwargs: object) -> object:
        out = super().run(q, paged_kv_cache, **kwargs)
        if self.is_cuda_graph_enabled:
            out[0] += 1e-3
        return out


def test_bucket_replay_check_finds_a_wrong_replay() -> None:
    """The check above can fail: over a twin whose graph-mode decode is off by 1e-3 on
    one request, decode replays are reported, and only those."""
    twin = types.SimpleNamespace(**vars(flashinfer_twin))
    twin.BatchDecodeWithPagedKVCacheWrapper = _OffByOneGraphDecode
    parent = FlashInferExecutor(flashinfer=twin)  # type: ignore[arg-type]
    wrong = check_bucket_replays(
        parent, HEADS, GROUPS, page_size=16, device="cpu", dtype=torch.float32, tol=TOL,
        steps=12, max_tokens=MAX_TOKENS, batch_size=6, seed=3,
    )  # fmt: skip
    assert wrong and all(": decode bs=" in line for line in wrong), wrong


def test_multi_step_draft_decode_in_a_bucket_and_eager() -> None:
    """A three-step draft decode through ``apply_steps``: eager, and replayed in a
    bucket; every step's output equals the reference's."""
    rng = np.random.default_rng(7)
    seq = rng.integers(5, 200, 4)
    specs = [fp.plan(fp.BatchLayout.decode(seq + s, page_size=4, groups=GROUPS), HEADS)
             for s in range(3)]  # fmt: skip
    table = fp.PageTable.shuffled(specs[-1].pages_needed, seed=1)
    pool = int(table.num_pages or 0)
    cache = torch.randn(pool, 2, 4, 2, 16)
    q = torch.randn(4, 4, 16)
    ex = _executor()
    bucket = GraphBucket.decode(batch_size=6, max_pages=64)
    gx = ex.for_bucket(bucket)
    steps_eager = ex.apply_steps(specs, table)
    steps_graph = gx.apply_steps(specs, table)
    q_pad = torch.cat([q, torch.zeros(bucket.total_q - 4, 4, 16)])
    for k, spec in enumerate(specs):
        ref = fp.ReferenceExecutor()
        ref.apply(spec, table)
        for group in GROUPS:
            want = ref.run(group, q, None, None, cache)
            assert _rel(steps_eager[k].run(group, q, None, None, cache), want) <= TOL
            assert _rel(steps_graph[k].run(group, q_pad, None, None, cache)[:4], want) <= TOL


def test_checked_mode_names_the_request_with_a_bad_page() -> None:
    spec = fp.plan(fp.BatchLayout.decode([9, 30, 4], page_size=4), HEADS)
    table = fp.PageTable.shuffled(spec.pages_needed, seed=0)
    row = int(table.rows[1])
    table.pages[row, 0] = -3  # request 1's first page
    with pytest.raises(fp.PageTableError, match=rf"pages\[1\].*not a valid page id \(row={row}\)"):
        _executor(check_pages=True).apply(spec, table)
    ex = _executor()  # the default mode: counted on the device, never used
    ex.apply(spec, table)
    assert int(ex.page_errors()[0]) >= 1


@pytest.mark.parametrize("scales", ["number", "tensor"])
def test_fp8_cache_decode_and_extend(scales: str) -> None:
    """An e4m3 cache: the write quantizes as the reference's, and the attention over the
    dequantized cache equals the reference's (a tensor ``k_scale`` against the reference
    on the folded queries, as the executor documents)."""
    heads = fp.HeadConfig(4, 2, 16, q_dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn)
    ks, vs = 0.37, 1.9
    k_s, v_s = (ks, vs) if scales == "number" else (torch.tensor(ks), torch.tensor(vs))
    for layout in (fp.BatchLayout.decode([7, 33, 60], page_size=4, groups=GROUPS),
                   fp.BatchLayout.extend([9, 20], [3, 0], page_size=4, groups=GROUPS)):  # fmt: skip
        spec = fp.plan(layout, heads, extend_path="paged")
        table = fp.PageTable.shuffled(spec.pages_needed, seed=3)
        ex, ref = _executor(), fp.ReferenceExecutor()
        ex.apply(spec, table)
        ref.apply(spec, table)
        for group in GROUPS:
            cache = torch.randn(int(table.num_pages or 0), 2, 4, 2, 16).to(torch.float8_e4m3fn)
            q = torch.randn(spec.total_q, 4, 16).to(torch.bfloat16)
            k = torch.randn(spec.total_q, 2, 16).to(torch.bfloat16)
            c1, c2 = cache.clone(), cache.clone()
            out = ex.run(group, q, k, k, c1, k_scale=k_s, v_scale=v_s)
            ref.run(group, q, k, k, c2, k_scale=ks, v_scale=vs)
            assert torch.equal(c1.view(torch.uint8), c2.view(torch.uint8))
            q_ref = (q.float() * ks).to(q.dtype) if scales == "tensor" else q
            want = ref.run(group, q_ref, None, None, c2, k_scale=None if scales == "tensor" else ks,
                           v_scale=vs)  # fmt: skip
            assert _rel(out.float(), want.float()) <= 2e-2, group.describe()
