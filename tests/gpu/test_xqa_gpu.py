"""Decodes on FlashInfer's XQA kernel (``ExecutorPolicy.decode_backend``): the twin's
``xqa`` equals the real one on the same inputs; the executor's XQA decodes equal the
reference executor on the dequantized cache (windows, sinks, page sizes 16 and 32, number
and tensor scales, e4m3 and bf16 caches); a graph replay equals the eager decode bit for
bit; the default policy puts e4m3 decodes on XQA and leaves what XQA cannot run on FA2,
over one long-lived executor; and nothing waits for the GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import flashplan as fp
from flashplan.executor.flashinfer import ExecutorPolicy, FlashInferExecutor
from flashplan.executor.flashinfer.bucket import GraphBucket
from flashplan.executor.flashinfer.graphs import capture
from flashplan.twin.xqa import e4m3_queries
from flashplan.twin.xqa import xqa as twin_xqa

from .helpers import rel_err, stable_seed, syncs_raise

DEV = "cuda"
E4M3, BF16 = torch.float8_e4m3fn, torch.bfloat16
GROUPS = (
    fp.AttentionGroup.full(),
    fp.AttentionGroup.sliding(100),
    fp.AttentionGroup.full(sinks=True),
    fp.AttentionGroup.sliding(63, sinks=True),
)
SOFT_CAP = fp.AttentionGroup.full(logits_soft_cap=30.0)  # XQA has no soft cap: FA2
#: XQA's Hopper kernel rounds the queries and the softmax probabilities to e4m3 (3-bit
#: mantissa: relative error up to 2^-4 each). The queries' rounding is compared away
#: (the reference runs on the e4m3-rounded queries); the probabilities' remains: each
#: output is a convex combination of values whose weights carry up to 2^-4 relative
#: error, so |out - ref| <= 2^-4 * max|v|; allow that bound relative to max|ref|, which
#: is about max|v| / 3 for these random inputs: 3 * 2^-4 ~ 0.19 would be loose; the
#: measured worst case is reported by benchmarks/run_gpu.py --parts xqa. Here: 6e-2.
E4M3_TOL = 6e-2
BF16_TOL = 1e-2  # a bf16 cache: XQA computes in bf16/float32 like FA2


def _heads(kv: torch.dtype) -> fp.HeadConfig:
    return fp.HeadConfig(32, 8, 128, q_dtype=BF16, kv_dtype=kv)


def _rounded(q: torch.Tensor, kv: torch.dtype) -> torch.Tensor:
    """The queries as XQA's Hopper kernel reads them over an e4m3 cache."""
    if kv != E4M3:
        return q
    return e4m3_queries(q).to(q.dtype)


def _inputs(spec: fp.PlanSpec, table: fp.PageTable, heads: fp.HeadConfig, seed: int, ps: int):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    n = spec.total_q
    shape = (int(table.num_pages or 0), 2, ps, heads.num_kv_heads, heads.head_dim)
    cache = torch.randn(shape, generator=gen, device=DEV).to(heads.kv_dtype)
    q = torch.randn(n, heads.num_qo_heads, heads.head_dim, generator=gen, device=DEV).to(BF16)
    k = torch.randn(n, heads.num_kv_heads, heads.head_dim, generator=gen, device=DEV).to(BF16)
    v = torch.randn(n, heads.num_kv_heads, heads.head_dim, generator=gen, device=DEV).to(BF16)
    sinks = torch.randn(heads.num_qo_heads, generator=gen, device=DEV) * 3
    return cache, q, k, v, sinks


def _compare(
    ex: FlashInferExecutor, layout: fp.BatchLayout, heads: fp.HeadConfig, seed: int,
    scales: tuple[object, object] | None,
) -> list[tuple[str, float]]:  # fmt: skip
    """Every group on ``ex`` and on a fresh reference (on the rounded queries): per group
    its relative output error; the caches written must be equal."""
    spec = fp.plan(layout, heads)
    table = fp.PageTable.shuffled(spec.pages_needed, seed=seed, device=DEV)
    ex.apply(spec, table)
    ref = fp.ReferenceExecutor()
    ref.apply(spec, table)
    out = []
    for i, group in enumerate(layout.groups):
        cache, q, k, v, sinks = _inputs(spec, table, heads, seed + i, layout.page_size)
        s = sinks if group.sinks else None
        ks, vs = scales if scales is not None else (None, None)
        c_ref = cache.clone()
        got = ex.run(group, q, k, v, cache, sinks=s, k_scale=ks, v_scale=vs)
        ref.run(group, q, k, v, c_ref, sinks=s, k_scale=ks, v_scale=vs)  # the writes
        assert torch.equal(cache.view(torch.uint8), c_ref.view(torch.uint8)), group.describe()
        kf = float(ks) if ks is not None else None
        vf = float(vs) if vs is not None else None
        want = ref.run(group, _rounded(q, heads.kv_dtype), None, None, c_ref, sinks=s,
                       k_scale=kf, v_scale=vf)  # fmt: skip
        out.append((group.describe(), rel_err(got, want)))
    return out


def _xqa_policy(**kw: object) -> ExecutorPolicy:
    return ExecutorPolicy(decode_backend="xqa", **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("kv", [E4M3, BF16], ids=["e4m3", "bf16"])
@pytest.mark.parametrize("window", [-1, 100])
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("tensor_scales", [False, True])
def test_twin_xqa_equals_flashinfer_xqa(
    kv: torch.dtype, window: int, sinks: bool, tensor_scales: bool
) -> None:
    """``flashplan.twin.xqa`` and ``flashinfer.xqa`` on the same inputs agree within the
    kernel's e4m3 probabilities (the twin rounds the queries as the kernel does)."""
    import flashinfer

    gen = torch.Generator(device=DEV).manual_seed(stable_seed("raw xqa", window, sinks))
    lens, ps, hq, hkv, d = [1, 17, 300, 1000, 2100, 33], 16, 32, 8, 128
    width = max(-(-n // ps) for n in lens)
    pool = len(lens) * width + 5
    cache = torch.randn(pool, 2, ps, hkv, d, generator=gen, device=DEV).to(kv)
    table = torch.randperm(pool, generator=gen, device=DEV)[: len(lens) * width]
    table = table.to(torch.int32).view(len(lens), width)
    seq = torch.tensor(lens, dtype=torch.int32, device=DEV).view(torch.uint32).view(-1, 1)
    q = torch.randn(len(lens), 1, hq, d, generator=gen, device=DEV).to(BF16)
    sink = (torch.randn(hq, generator=gen, device=DEV) * 3).view(hkv, -1) if sinks else None
    q_scale: object = 0.37 / 1.9
    kv_scale: object = 1.9
    if tensor_scales:
        q_scale = torch.tensor([q_scale], device=DEV)
        kv_scale = torch.tensor([kv_scale], device=DEV)
    sem = torch.zeros(2 << 20, dtype=torch.uint32, device=DEV)
    scratch = torch.zeros(32 << 20, dtype=torch.uint8, device=DEV)
    outs = []
    for fn in (flashinfer.xqa, twin_xqa):
        out = torch.empty_like(q)
        k, v = cache.unbind(1)
        fn(q, k, v, table, seq, out, scratch, sem, hkv, ps, sinks=sink, q_scale=q_scale,
           kv_scale=kv_scale, sliding_win_size=window + 1 if window >= 0 else 0)  # fmt: skip
        outs.append(out)
    assert int(sem.view(torch.int32).abs().sum()) == 0  # the kernel leaves them zero
    assert rel_err(outs[0], outs[1]) <= (E4M3_TOL if kv == E4M3 else BF16_TOL)


@pytest.mark.parametrize("kv", [E4M3, BF16], ids=["e4m3", "bf16"])
@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("scales", ["number", "tensor"])
def test_xqa_decode_matches_reference(kv: torch.dtype, page_size: int, scales: str) -> None:
    seed = stable_seed("xqa decode", str(kv), page_size, scales)
    rng = np.random.default_rng(seed)
    seq = np.array([1, 2, 63, 64, 65, 101, 1500, *rng.integers(1, 3000, 9)])
    layout = fp.BatchLayout.decode(seq, page_size=page_size, groups=GROUPS)
    pair: tuple[object, object] | None = None
    if kv == E4M3:
        pair = (0.37, 1.9)
        if scales == "tensor":
            pair = (torch.tensor(0.37, device=DEV), torch.tensor(1.9, device=DEV))
    elif scales == "tensor":
        pytest.skip("scales apply to fp8 caches")
    ex = FlashInferExecutor(policy=_xqa_policy())
    for name, err in _compare(ex, layout, _heads(kv), seed, pair):
        assert err <= (E4M3_TOL if kv == E4M3 else BF16_TOL), (name, err)


def test_return_lse_is_refused_on_xqa_and_fa2_gives_it() -> None:
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("auto picks XQA on Hopper only")
    heads = _heads(E4M3)
    spec = fp.plan(fp.BatchLayout.decode([5, 70], page_size=16), heads)
    table = fp.PageTable.shuffled(spec.pages_needed, seed=0, device=DEV)
    cache, q, _, _, _ = _inputs(spec, table, heads, 0, 16)
    ex = FlashInferExecutor()  # auto: e4m3 on Hopper decodes on XQA
    ex.apply(spec, table)
    group = spec.key.groups[0]
    with pytest.raises(fp.UnsupportedError, match="decode_backend='fa2'"):
        ex.run(group, q, None, None, cache, return_lse=True)
    fa2 = FlashInferExecutor(policy=ExecutorPolicy(decode_backend="fa2"))
    fa2.apply(spec, table)
    out, lse = fa2.run(group, q, None, None, cache, return_lse=True)
    assert out.shape == q.shape and lse.shape == q.shape[:2]


@pytest.mark.parametrize("deterministic", [False, True])
def test_graph_replay_equals_eager_bit_for_bit(deterministic: bool) -> None:
    """A decode bucket's replays equal an eager XQA decode of the same inputs bit for
    bit: in deterministic mode (one CTA per sequence and head) for every batch padded to
    the bucket; by default for batches that fill it (XQA splits a sequence by the number
    of rows, which padding changes)."""
    heads, ps, bucket_bs = _heads(E4M3), 16, 8
    bucket = GraphBucket.decode(batch_size=bucket_bs, max_pages=200)
    policy = _xqa_policy(deterministic=deterministic)
    parent = FlashInferExecutor(policy=policy)
    gx = parent.for_bucket(bucket)
    eager = FlashInferExecutor(policy=policy)
    pool = bucket_bs * 200 + 8
    gen = torch.Generator(device=DEV).manual_seed(5)
    caches = [torch.randn(pool, 2, ps, 8, 128, generator=gen, device=DEV).to(E4M3) for _ in GROUPS]
    q = torch.zeros(bucket_bs, 32, 128, device=DEV, dtype=BF16)
    sinks = torch.randn(32, generator=gen, device=DEV) * 3
    rng = np.random.default_rng(3)

    def forward() -> list[torch.Tensor]:
        return [
            gx.run(g, q, None, None, c, sinks=sinks if g.sinks else None, k_scale=0.37, v_scale=1.9)
            for g, c in zip(GROUPS, caches, strict=True)
        ]

    sizes = [bucket_bs] * 3 + ([3, 5, 1, 8, 6] if deterministic else [])
    first = fp.plan(fp.BatchLayout.decode(rng.integers(1, 3000, bucket_bs), page_size=ps,
                                          groups=GROUPS), heads)  # fmt: skip
    gx.apply(first, fp.PageTable.shuffled(first.pages_needed, seed=0, device=DEV))
    step = capture(gx, forward)
    for i, bs in enumerate(sizes):
        spec = fp.plan(fp.BatchLayout.decode(rng.integers(1, 3000, bs), page_size=ps,
                                             groups=GROUPS), heads)  # fmt: skip
        table = fp.PageTable.shuffled(spec.pages_needed, seed=i + 1, device=DEV)
        q.copy_(torch.randn(q.shape, generator=gen, device=DEV))
        outs = [o.clone() for o in step.replay(spec, table)]
        eager.apply(spec, table)
        for g, c, o in zip(GROUPS, caches, outs, strict=True):
            want = eager.run(g, q[:bs], None, None, c, sinks=sinks if g.sinks else None,
                             k_scale=0.37, v_scale=1.9)  # fmt: skip
            assert torch.equal(o[:bs], want), (i, bs, g.describe())


def test_default_policy_mixes_xqa_and_fa2_over_a_long_lived_executor() -> None:
    """One executor with the default policy over varied batches: e4m3 decodes of the
    XQA groups on XQA, the soft-cap group's on FA2, extends on FA2 — each batch equal to
    a fresh reference; and the planned kernels are the ones the policy names."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("auto picks XQA on Hopper only")
    heads = _heads(E4M3)
    groups = (*GROUPS, SOFT_CAP)
    ex = FlashInferExecutor()
    rng = np.random.default_rng(11)
    for step in range(24):
        bs = int(rng.integers(1, 17))  # (the reference's dense logits bound the sizes)
        prefix = rng.integers(0, 1500, bs)
        if step % 3 == 2:
            new = rng.integers(1, 9, bs)
            layout = fp.BatchLayout.extend(prefix + new, prefix, page_size=16, groups=groups)
        else:
            layout = fp.BatchLayout.decode(prefix + 1, page_size=16, groups=groups)
        for name, err in _compare(ex, layout, heads, 100 + step, (0.37, 1.9)):
            assert err <= E4M3_TOL, (step, name, err)
        kinds = {k[0]: type(w).__name__ for k, w in ex._batch.planned.items()}  # type: ignore[union-attr]
        if step % 3 != 2:
            assert [kinds[i] for i in range(len(groups))] == ["XqaDecode"] * 4 + [
                "BatchDecodeWithPagedKVCacheWrapper"
            ], kinds


def test_xqa_apply_and_run_never_sync() -> None:
    heads = _heads(E4M3)
    spec = fp.plan(fp.BatchLayout.decode([5, 70, 900], page_size=16, groups=GROUPS), heads)
    table = fp.PageTable.shuffled(spec.pages_needed, seed=0, device=DEV)
    cache, q, k, v, sinks = _inputs(spec, table, heads, 0, 16)
    ex = FlashInferExecutor(policy=_xqa_policy())
    scales = (torch.tensor(0.37, device=DEV), torch.tensor(1.9, device=DEV))
    ex.apply(spec, table)  # first use: buffers and modules
    ex.run(GROUPS[2], q, k, v, cache, sinks=sinks, k_scale=scales[0], v_scale=scales[1])
    with syncs_raise():
        for _ in range(3):
            ex.apply(spec, table)
            for g in GROUPS:
                ex.run(g, q, k, v, cache, sinks=sinks if g.sinks else None, k_scale=scales[0],
                       v_scale=scales[1])  # fmt: skip
