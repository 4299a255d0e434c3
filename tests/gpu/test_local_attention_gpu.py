"""Attention sinks, chunked local attention and bidirectional windows on real FlashInfer
kernels vs the reference.

Sink groups run on FlashInfer's own sink kernels (decode, paged prefill, verify masks,
CUDA graphs) and, where those cannot (a soft cap, a ragged + paged merge), with the sink
folded into the state. A silently ignored sink fails here: each sink case also checks
that the output moved from the sink-free output by the oracle's amount. Chunk boundaries
are placed inside a prefill (virtual requests, paged and ragged paths), inside a verify
tree, and at the decode step that starts a new chunk; page sizes 1 and 16. Chunks that
are not a multiple of the page size and bidirectional windows run on one paged prefill
with a position mask built on the device, eagerly and replayed from a CUDA graph.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import flashplan as fp
from flashplan.errors import UnsupportedError

from .helpers import flashinfer_executor, rel_err, run_both

DEV = "cuda"
HEADS = fp.HeadConfig(num_qo_heads=16, num_kv_heads=4, head_dim=128)
SINK_FULL = fp.AttentionGroup.full(sinks=True)
SINK_W127 = fp.AttentionGroup.sliding(127, sinks=True)  # gpt-oss: window 128 + sinks
CHUNK_64 = fp.AttentionGroup.chunked(64)
CHUNK_SINKS = fp.AttentionGroup.chunked(32, sinks=True)
TOL_OUT, TOL_LSE = 1e-2, 5e-2


def _executor() -> fp.Executor:
    return flashinfer_executor()


def _check(results: list[tuple[fp.AttentionGroup, float, float, float]]) -> None:
    for group, out_err, lse_err, cache_err in results:
        assert out_err <= TOL_OUT, (group.describe(), out_err)
        assert lse_err <= TOL_LSE, (group.describe(), lse_err)
        assert cache_err == 0.0, group.describe()


def _lengths(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Sequence and prefix lengths with chunk boundaries (32, 64) inside new tokens, new
    tokens that start exactly on a boundary, and requests inside one chunk."""
    seq = np.array([1, 31, 32, 33, 64, 65, 200, 129, 700, *rng.integers(1, 600, 5)])
    prefix = (seq * rng.random(seq.shape[0])).astype(np.int64)
    prefix[1], prefix[4], prefix[5] = 0, 32, 63  # a prefill from 0; new from a boundary
    return seq, prefix


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("mode", ["decode", "paged", "ragged", "noprefix"])
def test_sinks_and_chunks_match_reference(page_size: int, mode: str) -> None:
    rng = np.random.default_rng(page_size + len(mode))
    seq, prefix = _lengths(rng)
    # a soft-capped sink group: FlashInfer's sink kernel has no soft cap, so its sink is
    # folded into the kernel's state instead (the other sink groups run on that kernel)
    capped = fp.AttentionGroup.full(sinks=True, logits_soft_cap=30.0)
    groups = [SINK_FULL, SINK_W127, CHUNK_64, CHUNK_SINKS, capped, fp.AttentionGroup.full()]
    if mode == "decode":
        seq = np.concatenate([seq, [65, 129, 33]])  # each decode query starts a new chunk
        layout = fp.BatchLayout.decode(seq, page_size=page_size, groups=groups)
    else:
        if mode == "noprefix":
            prefix = np.zeros_like(seq)
        layout = fp.BatchLayout.extend(seq, prefix, page_size=page_size, groups=groups)
    path = "ragged" if mode in ("ragged", "noprefix") else "paged"
    spec = fp.plan(layout, HEADS, extend_path=path)
    if mode != "decode":
        assert spec.group_plan(CHUNK_64).virtual is not None  # boundaries inside the batch
    _check(run_both(layout, HEADS, _executor(), extend_path=path, seed=page_size))


@pytest.mark.parametrize("page_size", [1, 16])
def test_chunked_and_sink_verify_match_reference(page_size: int) -> None:
    rng = np.random.default_rng(page_size)
    prefix = np.array([60, 62, 63, 64, 127, 5, *rng.integers(0, 500, 4)])
    parents = [-1, 0, 1, 2, 0, 4, 1, 6]  # a tree of depth 3: boundaries cut through it
    tree = fp.DraftTree.from_parents([parents] * prefix.shape[0])
    groups = [fp.AttentionGroup.chunked(64, sinks=True), SINK_W127, CHUNK_SINKS]
    layout = fp.BatchLayout.verify(prefix, tree, page_size=page_size, groups=groups)
    _check(run_both(layout, HEADS, _executor(), seed=page_size))


def test_a_dropped_sink_fails() -> None:
    """The FlashInfer output with sinks equals the reference's and differs from the
    sink-free output by the sink's share of the softmax mass (out * 2**(lse0 - lse))."""
    layout = fp.BatchLayout.decode([5, 300, 1000], page_size=16, groups=[SINK_FULL])
    spec = fp.plan(layout, HEADS)
    table = fp.PageTable.shuffled(spec.pages_needed, seed=0, device=DEV)
    gen = torch.Generator(device=DEV).manual_seed(0)
    cache = torch.randn(table.num_pages, 2, 16, 4, 128, generator=gen, device=DEV)
    cache = cache.to(torch.bfloat16)
    q = torch.randn(3, 16, 128, generator=gen, device=DEV).to(torch.bfloat16)
    sinks = torch.full((16,), 4.0, device=DEV)  # a sink worth several keys
    ex = flashinfer_executor()
    ex.apply(spec, table)
    out, lse = ex.run(SINK_FULL, q, None, None, cache, return_lse=True, sinks=sinks)
    plain_spec = fp.plan(
        fp.BatchLayout.decode([5, 300, 1000], page_size=16, groups=[fp.AttentionGroup()]), HEADS
    )
    ex.apply(plain_spec, table)
    out0, lse0 = ex.run(fp.AttentionGroup(), q, None, None, cache, return_lse=True)
    share = torch.exp2(lse0 - lse)[..., None]
    assert rel_err(out, (out0.float() * share).to(out.dtype)) <= TOL_OUT
    assert rel_err(out, out0) > 0.05  # the sink moved the output
    with pytest.raises(fp.PlanMismatchError):
        ex.run(fp.AttentionGroup(), q, None, None, cache, sinks=sinks)


def test_graph_replay_of_sink_and_chunked_decode() -> None:
    """A CUDA-graph bucket over sink and chunked groups: replays equal eager runs, over
    batches whose decode steps start new chunks."""
    from flashplan.executor.flashinfer import (
        FlashInferExecutor,
        GraphBucket,
        capture,
        graph_executor,
    )

    groups = (SINK_W127, CHUNK_64)
    gen = torch.Generator(device=DEV).manual_seed(3)
    kv = torch.randn(4000, 2, 16, 4, 128, generator=gen, device=DEV).to(torch.bfloat16)
    sinks = torch.randn(16, generator=gen, device=DEV) * 3
    gx = graph_executor(FlashInferExecutor(), GraphBucket.decode(8, 64))
    q_static = torch.zeros(8, 16, 128, device=DEV, dtype=torch.bfloat16)
    first = fp.plan(fp.BatchLayout.decode([10, 20], page_size=16, groups=groups), HEADS)
    table0 = fp.PageTable.sequential(first.pages_needed, device=DEV)
    gx.apply(first, table0)

    def forward() -> tuple[torch.Tensor, torch.Tensor]:
        a = gx.run(SINK_W127, q_static, None, None, kv, sinks=sinks)
        b = gx.run(CHUNK_64, q_static, None, None, kv)
        return a, b

    step = capture(gx, forward)
    eager = fp.ReferenceExecutor()
    for seq in ([65, 129, 64, 1000], [1, 2, 3, 4, 5, 6, 7, 8], [700, 129, 193]):
        spec = fp.plan(fp.BatchLayout.decode(seq, page_size=16, groups=groups), HEADS)
        table = fp.PageTable.shuffled(spec.pages_needed, seed=len(seq), device=DEV)
        q = torch.randn(len(seq), 16, 128, generator=gen, device=DEV).to(torch.bfloat16)
        q_static.zero_()
        q_static[: len(seq)] = q
        a, b = step.replay(spec, table)
        eager.apply(spec, table)
        want_a = eager.run(SINK_W127, q, None, None, kv, sinks=sinks)
        want_b = eager.run(CHUNK_64, q, None, None, kv)
        torch.cuda.synchronize()
        assert rel_err(a[: len(seq)], want_a) <= TOL_OUT
        assert rel_err(b[: len(seq)], want_b) <= TOL_OUT


@pytest.mark.parametrize("page_size", [1, 16])
def test_bidirectional_windows_and_chunks_inside_pages_match_reference(page_size: int) -> None:
    """Position masks: bidirectional windows (EmbeddingGemma-like, and one-sided
    bounds of 0), and chunks that start inside pages (chunk 24 on 16-token pages), in
    extends with and without prefixes and in decode steps."""
    rng = np.random.default_rng(7 + page_size)
    seq, prefix = _lengths(rng)
    groups = [
        fp.AttentionGroup.bidirectional(window_left=15, window_right=15),
        fp.AttentionGroup.bidirectional(window_left=0, window_right=40, sinks=True),
        fp.AttentionGroup.chunked(24),
        fp.AttentionGroup.chunked(40, sinks=True),
    ]
    for mode in ("prefill", "prefix", "decode"):
        if mode == "decode":
            layout = fp.BatchLayout.decode(seq, page_size=page_size, groups=groups)
        else:
            p = np.zeros_like(seq) if mode == "prefill" else prefix
            layout = fp.BatchLayout.extend(seq, p, page_size=page_size, groups=groups)
        spec = fp.plan(layout, HEADS)
        if page_size == 16:  # the masked groups really take the position-mask path
            masked = [gp.paged.position_mask is not None for gp in spec.group_plans if gp.paged]
            assert any(masked), mode
        _check(run_both(layout, HEADS, _executor(), seed=page_size))


def test_graph_replay_of_position_masked_decode() -> None:
    """A decode bucket over a chunked group whose chunks start inside pages (chunk 24
    on 16-token pages: a paged prefill with a position mask in the captured graph),
    replayed over batches whose queries start new chunks mid-page: equals the
    reference."""
    from flashplan.executor.flashinfer import (
        FlashInferExecutor,
        GraphBucket,
        capture,
        graph_executor,
    )

    odd = fp.AttentionGroup.chunked(24, sinks=True)
    groups = (odd, fp.AttentionGroup.full())
    gen = torch.Generator(device=DEV).manual_seed(5)
    kv = torch.randn(4000, 2, 16, 4, 128, generator=gen, device=DEV).to(torch.bfloat16)
    sinks = torch.randn(16, generator=gen, device=DEV) * 3
    gx = graph_executor(FlashInferExecutor(), GraphBucket.decode(8, 64))
    q_static = torch.zeros(8, 16, 128, device=DEV, dtype=torch.bfloat16)
    first = fp.plan(fp.BatchLayout.decode([10, 20], page_size=16, groups=groups), HEADS)
    assert first.group_plan(odd).paged.position_mask is not None  # type: ignore[union-attr]
    gx.apply(first, fp.PageTable.sequential(first.pages_needed, device=DEV))

    def forward() -> torch.Tensor:
        return gx.run(odd, q_static, None, None, kv, sinks=sinks)

    step = capture(gx, forward)
    ref = fp.ReferenceExecutor()
    for seq in ([25, 49, 24, 1000], [1, 2, 3, 4, 5, 6, 7, 8], [700, 73, 193]):
        spec = fp.plan(fp.BatchLayout.decode(seq, page_size=16, groups=groups), HEADS)
        table = fp.PageTable.shuffled(spec.pages_needed, seed=len(seq), device=DEV)
        q = torch.randn(len(seq), 16, 128, generator=gen, device=DEV).to(torch.bfloat16)
        q_static.zero_()
        q_static[: len(seq)] = q
        out = step.replay(spec, table)
        ref.apply(spec, table)
        want = ref.run(odd, q, None, None, kv, sinks=sinks)
        torch.cuda.synchronize()
        assert rel_err(out[: len(seq)], want) <= TOL_OUT


def test_graph_replay_of_chunked_extends_planned_with_masks() -> None:
    """An extend bucket (4 new tokens per request) over a chunked group: planned with
    chunked_extend="mask", every batch (boundaries crossed or not) is one position-masked
    call per request, which the bucket replays; equal to the reference, KV writes
    included."""
    from flashplan.executor.flashinfer import (
        FlashInferExecutor,
        GraphBucket,
        capture,
        graph_executor,
    )

    chunked = fp.AttentionGroup.chunked(16, sinks=True)
    gen = torch.Generator(device=DEV).manual_seed(9)
    kv = torch.randn(600, 2, 16, 4, 128, generator=gen, device=DEV).to(torch.bfloat16)
    sinks = torch.randn(16, generator=gen, device=DEV) * 3
    gx = graph_executor(FlashInferExecutor(), GraphBucket.extend(4, 16, 4))
    q_s = torch.zeros(16, 16, 128, device=DEV, dtype=torch.bfloat16)
    k_s, v_s = (torch.zeros(16, 4, 128, device=DEV, dtype=torch.bfloat16) for _ in range(2))

    def spec_of(prefix: list[int]) -> fp.PlanSpec:
        layout = fp.BatchLayout.extend(
            [p + 4 for p in prefix], prefix, page_size=16, groups=[chunked]
        )
        return fp.plan(layout, HEADS, extend_path="paged", chunked_extend="mask")

    first = spec_of([3, 20])
    gx.apply(first, fp.PageTable.sequential(first.pages_needed, device=DEV))

    def forward() -> torch.Tensor:
        return gx.run(chunked, q_s, k_s, v_s, kv, sinks=sinks)

    step = capture(gx, forward)
    ref = fp.ReferenceExecutor()
    for prefix in ([14, 30, 60, 100], [0, 1, 2], [13, 45, 77, 2]):  # boundaries at 16, 32 …
        spec = spec_of(prefix)
        assert spec.group_plans[0].virtual is None
        assert spec.group_plans[0].paged.position_mask is not None  # type: ignore[union-attr]
        table = fp.PageTable.shuffled(spec.pages_needed, seed=len(prefix), device=DEV)
        n = spec.total_q
        q = torch.randn(n, 16, 128, generator=gen, device=DEV).to(torch.bfloat16)
        k = torch.randn(n, 4, 128, generator=gen, device=DEV).to(torch.bfloat16)
        v = torch.randn(n, 4, 128, generator=gen, device=DEV).to(torch.bfloat16)
        for static, value in ((q_s, q), (k_s, k), (v_s, v)):
            static.zero_()
            static[:n] = value
        kv_ref = kv.clone()
        out = step.replay(spec, table)
        ref.apply(spec, table)
        want = ref.run(chunked, q, k, v, kv_ref, sinks=sinks)
        torch.cuda.synchronize()
        assert rel_err(out[:n], want) <= TOL_OUT
        assert torch.equal(kv, kv_ref)  # the replay wrote the new K/V where the plan says


def test_virtual_requests_are_refused_in_graph_buckets() -> None:
    from flashplan.executor.flashinfer import FlashInferExecutor, GraphBucket, graph_executor

    chunked = fp.AttentionGroup.chunked(16)
    gx = graph_executor(FlashInferExecutor(), GraphBucket.extend(4, 16, 4))
    spec = fp.plan(
        fp.BatchLayout.extend([18, 40], [14, 36], page_size=16, groups=[chunked]),
        HEADS, extend_path="paged",
    )  # fmt: skip
    assert spec.group_plan(chunked).virtual is not None  # request 0 crosses position 16
    table = fp.PageTable.sequential(spec.pages_needed, device=DEV)
    with pytest.raises(UnsupportedError) as err:
        gx.apply(spec, table)
    assert err.value.field == "groups"


@pytest.mark.parametrize(
    "mode", ["decode", "paged", "ragged", "soft_cap", "chunked"]
)  # the sink kernel (decode, paged prefill), the merge fold, the state fold
def test_non_finite_sink_logits_follow_one_rule(mode: str) -> None:
    """Issue 50, item 6, on FlashInfer: heads whose sink logit is NaN or +inf give NaN
    outputs and LSE, a -inf head equals the group without sinks, the other heads equal
    the reference — on FlashInfer's sink kernel and on the folds alike (no sync)."""
    cap = 30.0 if mode == "soft_cap" else 0.0
    group = (
        fp.AttentionGroup.chunked(32, sinks=True)
        if mode == "chunked"
        else fp.AttentionGroup.full(sinks=True, logits_soft_cap=cap)
    )
    plain = fp.AttentionGroup.chunked(32) if mode == "chunked" else fp.AttentionGroup.full(
        logits_soft_cap=cap
    )  # fmt: skip
    rng = np.random.default_rng(11)
    prefix = rng.integers(20, 200, 5)
    if mode == "decode":
        lays = [fp.BatchLayout.decode(prefix + 1, page_size=16, groups=g) for g in (group, plain)]
    else:
        seq = prefix + rng.integers(2, 50, 5)
        lays = [fp.BatchLayout.extend(seq, prefix, page_size=16, groups=g) for g in (group, plain)]
    path = "ragged" if mode == "ragged" else "paged"
    sinks = torch.randn(16, device=DEV)
    sinks[0], sinks[1], sinks[2] = float("nan"), float("inf"), float("-inf")
    results = []
    for lay, s in zip(lays, (sinks, None), strict=True):
        spec = fp.plan(lay, HEADS, extend_path=path)
        table = fp.PageTable.sequential(spec.pages_needed, device=DEV)
        gen = torch.Generator(device=DEV).manual_seed(3)
        cache = torch.randn(int(spec.pages_needed.sum()), 2, 16, 4, 128, generator=gen, device=DEV)
        cache = cache.to(torch.bfloat16)
        q = torch.randn(spec.total_q, 16, 128, generator=gen, device=DEV).to(torch.bfloat16)
        k, v = (
            torch.randn(spec.total_q, 4, 128, generator=gen, device=DEV).to(torch.bfloat16)
            for _ in "kv"
        )
        for ex in (_executor(), fp.ReferenceExecutor()):
            ex.apply(spec, table)
            results.append(ex.run(lay.groups[0], q, k, v, cache.clone(), return_lse=True, sinks=s))
    (out, lse), (out_ref, lse_ref), (plain_out, plain_lse), _ = results
    assert torch.isnan(out[:, :2]).all() and torch.isnan(lse[:, :2]).all()
    assert torch.isnan(out_ref[:, :2]).all() and torch.isnan(lse_ref[:, :2]).all()
    assert rel_err(out[:, 2], plain_out[:, 2]) <= TOL_OUT
    assert float((lse[:, 2] - plain_lse[:, 2]).abs().max()) <= TOL_LSE
    assert rel_err(out[:, 3:], out_ref[:, 3:]) <= TOL_OUT
    assert float((lse[:, 3:] - lse_ref[:, 3:]).abs().max()) <= TOL_LSE
