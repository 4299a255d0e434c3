"""The FlashInfer executor's whole orchestration on the CPU, over the twin of FlashInfer
(:mod:`flashplan.twin`): CUDA-graph buckets replayed eagerly (padding, fixed buffers,
graph-mode wrappers planned per replay) over many batches, multi-step draft decodes,
the checked mode and fp8 caches — each against the reference executor. (Every eager
mode over hundreds of varied batches: ``tests/test_long_lived.py``.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import flashplan as fp
from flashplan.executor.flashinfer import FlashInferExecutor, GraphBucket, capture, graph_executor
from flashplan.testing.batches import bushy_tree_parents
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


def _layout(kind: str, rng: np.random.Generator, bs: int, ps: int) -> fp.BatchLayout:
    prefix = rng.integers(0, MAX_TOKENS - 40, bs)
    if kind == "decode":
        return fp.BatchLayout.decode(prefix + 1, page_size=ps, groups=GROUPS)
    if kind == "verify":
        parents = bushy_tree_parents(rng, bs, 6, reach=6)
        parents[:, 2] = 0  # tokens 1 and 2 both children of the root: a tree, not a chain
        tree = fp.DraftTree.from_parents(parents)
        return fp.BatchLayout.verify(prefix, tree, page_size=ps, groups=GROUPS)
    accepted = rng.integers(1, 5, bs)
    return fp.BatchLayout.draft_extend(
        prefix, accepted, tokens_per_request=4, page_size=ps, groups=GROUPS
    )


class _Replayer:
    """One bucket's graph executor, its static inputs and its "captured" forward."""

    def __init__(self, parent: FlashInferExecutor, bucket: GraphBucket, first: fp.PlanSpec,
                 table: fp.PageTable, pool: int, seed: int) -> None:  # fmt: skip
        self.gen = torch.Generator().manual_seed(seed)
        n, ps = bucket.total_q, first.page_size
        self.q = torch.randn(n, 4, 16, generator=self.gen)
        self.k = torch.randn(n, 2, 16, generator=self.gen)
        self.caches = [torch.randn(pool, 2, ps, 2, 16, generator=self.gen) for _ in GROUPS]
        self.gx = graph_executor(parent, bucket)
        self.gx.apply(first, table)
        self.step = capture(self.gx, self.forward)
        assert self.step.graph is None  # the twin: replays run eagerly

    def forward(self) -> list[torch.Tensor]:
        pairs = zip(GROUPS, self.caches, strict=True)
        return [self.gx.run(g, self.q, self.k, self.k, c) for g, c in pairs]

    def check(self, spec: fp.PlanSpec, table: fp.PageTable) -> float:
        """Replay ``spec``; the worst relative error against the reference (inf where a
        cache write differs)."""
        n = spec.total_q
        self.q.copy_(torch.randn(self.q.shape, generator=self.gen))
        self.k.copy_(torch.randn(self.k.shape, generator=self.gen))
        before = [c.clone() for c in self.caches]
        outs = self.step.replay(spec, table)
        ref = fp.ReferenceExecutor()
        ref.apply(spec, table)
        worst = 0.0
        for group, out, cache, base in zip(GROUPS, outs, self.caches, before, strict=True):
            want = ref.run(group, self.q[:n], self.k[:n], self.k[:n], base)
            worst = max(worst, _rel(out[:n], want))
            if not torch.equal(cache, base):  # base now holds the reference's writes
                worst = float("inf")
        return worst


@pytest.mark.parametrize("page_size", [1, 16])
def test_graph_buckets_replay_many_batches(page_size: int) -> None:
    """Decode, verify and draft-extend buckets made from one eager executor, replayed in
    turn over 40 batches of other sizes, lengths, trees and tables (eager batches of the
    parent in between): each replay equals the reference on its real rows."""
    rng = np.random.default_rng(page_size)
    parent = _executor()
    max_pages = -(-MAX_TOKENS // page_size) + 1
    buckets = {
        "decode": GraphBucket.decode(batch_size=6, max_pages=max_pages),
        "verify": GraphBucket.verify(batch_size=3, max_pages=max_pages, num_tokens=6),
        "draft_extend": GraphBucket.extend(batch_size=3, max_pages=max_pages, tokens_per_request=4),
    }
    replayers = {}
    for index, (kind, bucket) in enumerate(buckets.items()):
        spec = fp.plan(_layout(kind, rng, bucket.batch_size, page_size), HEADS, extend_path="paged")
        table = fp.PageTable.shuffled(spec.pages_needed, seed=index)
        pool = int(table.num_pages or 0) + 8 * max_pages
        replayers[kind] = _Replayer(parent, bucket, spec, table, pool, seed=index)
    wrong, previous = [], "(first)"
    for step in range(40):
        kind = str(rng.choice(list(buckets)))
        bs = int(rng.integers(1, buckets[kind].batch_size + 1))
        spec = fp.plan(_layout(kind, rng, bs, page_size), HEADS, extend_path="paged")
        table = fp.PageTable.shuffled(
            spec.pages_needed, seed=step, spare_pages=int(rng.integers(0, 30)),
            extra_rows=int(rng.integers(0, 4)),
        )  # fmt: skip
        label = f"{step}: {kind} bs={bs}"
        err = replayers[kind].check(spec, table)
        if err > TOL:
            wrong.append(f"{label} (err {err:.3g}) after {previous}")
        if step % 5 == 0:
            eager = fp.plan(_layout("decode", rng, 3, page_size), HEADS)
            parent.apply(eager, fp.PageTable.shuffled(eager.pages_needed, seed=step))
        previous = label
    assert not wrong, wrong


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
