"""FP8 KV caches on FlashInfer: the executor's outputs, LSE and written cache equal the
reference executor's (which dequantizes in float32) for every mode FlashInfer 0.7.4 runs
with an fp8 cache on sm_90 — decode on both kernel kinds, paged extend with a prefix,
verify trees (custom masks), multi-item scoring, CUDA-graph replays — with number and
tensor scales, in both fp8 formats; and nothing waits for the GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import flashplan as fp
from flashplan.executor.flashinfer import ExecutorPolicy, FlashInferExecutor
from flashplan.executor.flashinfer.bucket import GraphBucket
from flashplan.executor.flashinfer.graphs import capture

from .helpers import rel_err, run_both, stable_seed, syncs_raise

DEV = "cuda"
FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FULL = fp.AttentionGroup.full()
GROUPS = (FULL, fp.AttentionGroup.sliding(50), fp.AttentionGroup.full(sinks=True))
#: (k_scale, v_scale): away from 1.0, so that a scale dropped or applied twice shows.
NUMBERS = (0.37, 1.9)
#: FlashInfer computes in bf16 (P rounded once before P.V); the reference in float32 on
#: the same dequantized cache: the bf16 bounds of test_flashinfer_executor.py.
OUT_TOL, LSE_TOL = 1e-2, 5e-2
#: A 0-d tensor ``v_scale`` multiplies the kernel's bf16 output after the kernel (passing
#: it in would be a sync): one more rounding, at most half a bf16 ulp (2⁻⁹) of each element.
TENSOR_V_SCALE_ROUNDING = 2.0**-9
#: FlashInfer keeps logits and the LSE in float32 (base 2): with logits near 10⁵ (the large
#: logit batches) a few float32 ulps (2⁻²³ each) exceed the absolute bound; allow 8.
LSE_REL_TOL = 8 * 2.0**-23
#: These tests check FA2's fp8 kernels (with their LSE): XQA's decode, which the default
#: policy picks for e4m3 on Hopper, has its own tests (test_xqa_gpu.py).
FA2 = ExecutorPolicy(decode_backend="fa2")


def _heads(kv: str) -> fp.HeadConfig:
    return fp.HeadConfig(16, 4, 128, q_dtype=torch.bfloat16, kv_dtype=FP8[kv])


def _scales(kind: str) -> tuple[float | torch.Tensor, float | torch.Tensor]:
    if kind == "number":
        return NUMBERS
    return tuple(torch.tensor(s, device=DEV) for s in NUMBERS)  # type: ignore[return-value]


def _check(
    results: list[tuple[fp.AttentionGroup, float, float, float]], scales: str = "number"
) -> None:
    out_tol = OUT_TOL + (TENSOR_V_SCALE_ROUNDING if scales == "tensor" else 0.0)
    for group, out_err, lse_err, cache_err in results:
        assert out_err <= out_tol, (group.describe(), out_err)
        assert lse_err <= LSE_TOL, (group.describe(), lse_err)
        assert cache_err == 0.0, (group.describe(), cache_err)  # same bytes written


@pytest.mark.parametrize("kv", list(FP8))
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("tensor_cores", [False, True])
@pytest.mark.parametrize("scales", ["number", "tensor"])
def test_decode_matches_reference(kv: str, page_size: int, tensor_cores: bool, scales: str):
    rng = np.random.default_rng(stable_seed("fp8 decode", kv, page_size, tensor_cores, scales))
    seq = rng.integers(1, 400, 7)
    layout = fp.BatchLayout.decode(seq, page_size=page_size, groups=GROUPS)
    ex = FlashInferExecutor(
        policy=ExecutorPolicy(decode_tensor_cores=tensor_cores, decode_backend="fa2")
    )
    _check(run_both(layout, _heads(kv), ex, scales=_scales(scales)), scales)


@pytest.mark.parametrize("kv", list(FP8))
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("scales", ["number", "tensor"])
def test_paged_extend_with_prefix_matches_reference(kv: str, page_size: int, scales: str):
    rng = np.random.default_rng(stable_seed("fp8 extend", kv, page_size, scales))
    seq = rng.integers(1, 500, 5)
    prefix = (seq * rng.random(5)).astype(np.int64)
    prefix[0] = 0
    layout = fp.BatchLayout.extend(seq, prefix, page_size=page_size, groups=GROUPS)
    _check(
        run_both(layout, _heads(kv), FlashInferExecutor(policy=FA2), scales=_scales(scales)), scales
    )


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("scales", ["number", "tensor"])
def test_verify_tree_matches_reference(page_size: int, scales: str):
    rng = np.random.default_rng(stable_seed("fp8 verify", page_size, scales))
    parents = np.full((4, 6), -1, dtype=np.int64)
    for j in range(1, 6):
        parents[:, j] = rng.integers(0, j, 4)
    tree = fp.DraftTree.from_parents(parents)
    groups = (FULL, fp.AttentionGroup.sliding(30))
    layout = fp.BatchLayout.verify(
        rng.integers(1, 300, 4), tree, page_size=page_size, groups=groups
    )
    _check(
        run_both(layout, _heads("e4m3"), FlashInferExecutor(policy=FA2), scales=_scales(scales)),
        scales,
    )


@pytest.mark.parametrize("page_size", [1, 16])
def test_multi_item_matches_reference(page_size: int):
    layout = fp.BatchLayout.extend(
        [40, 18, 25], [3, 0, 5], page_size=page_size,
        item_delimiters=[[2, 9, 14, 30], [4, 5, 6], None],
    )  # fmt: skip
    _check(
        run_both(layout, _heads("e4m3"), FlashInferExecutor(policy=FA2), scales=_scales("tensor")),
        "tensor",
    )


def test_apply_and_run_never_sync():
    heads = _heads("e4m3")
    layout = fp.BatchLayout.decode([30, 200, 7], page_size=16, groups=GROUPS)
    spec = fp.plan(layout, heads)
    table = fp.PageTable.shuffled(spec.pages_needed, seed=3, device=DEV)
    assert table.num_pages is not None
    cache = torch.zeros(table.num_pages, 2, 16, 4, 128, device=DEV).to(heads.kv_dtype)
    q = torch.randn(3, 16, 128, device=DEV).to(torch.bfloat16)
    k = torch.randn(3, 4, 128, device=DEV).to(torch.bfloat16)
    sinks = torch.zeros(16, device=DEV)
    ks, vs = _scales("tensor")
    ex = FlashInferExecutor(policy=FA2)
    ex.apply(spec, table)  # compiles and loads the kernels
    with syncs_raise():
        for _ in range(2):
            ex.apply(spec, table)
            for g in GROUPS:
                ex.run(g, q, k, k, cache, sinks=sinks if g.sinks else None, k_scale=ks, v_scale=vs)
    torch.cuda.synchronize()


@pytest.mark.parametrize("page_size", [1, 16])
def test_graph_replay_reads_tensor_scales_at_replay(page_size: int):
    """A replayed decode reads the scale tensors' values of the replay, not the
    capture's: three replays with other scales, each against a fresh reference run."""
    heads = _heads("e4m3")
    gen = torch.Generator(device=DEV).manual_seed(stable_seed("fp8 graph", page_size))
    rng = np.random.default_rng(stable_seed("fp8 graph lens", page_size))
    bucket = GraphBucket.decode(batch_size=8, max_pages=320 // page_size + 2)
    gx = FlashInferExecutor(policy=FA2).for_bucket(bucket)
    num_pages = 8 * (320 // page_size + 2)
    kv = torch.randn(num_pages, 2, page_size, 4, 128, generator=gen, device=DEV).to(heads.kv_dtype)
    q = torch.zeros(8, 16, 128, device=DEV, dtype=torch.bfloat16)
    k, v = torch.zeros(8, 4, 128, device=DEV, dtype=torch.bfloat16), torch.zeros_like(q[:, :4])
    ks, vs = torch.tensor(1.0, device=DEV), torch.tensor(1.0, device=DEV)

    def batch(bs: int) -> tuple[fp.PlanSpec, fp.PageTable]:
        spec = fp.plan(fp.BatchLayout.decode(rng.integers(1, 300, bs), page_size=page_size), heads)
        rows = torch.randperm(num_pages, generator=torch.Generator().manual_seed(bs))
        need = int(spec.pages_needed.max())
        ids = rows[: bs * need].reshape(bs, need).to(torch.int32)
        return spec, fp.PageTable(ids.to(DEV), np.arange(bs), num_pages=num_pages)

    spec, table = batch(5)
    gx.apply(spec, table)
    step = capture(gx, lambda: gx.run(FULL, q, k, v, kv, k_scale=ks, v_scale=vs))
    ref = fp.ReferenceExecutor()
    for bs, scales in ((5, (0.37, 1.9)), (8, (2.5, 0.25)), (3, (1.0, 1.0)), (6, (0.8, 3.0))):
        spec, table = batch(bs)
        for t in (q, k, v):
            t.copy_(torch.randn(t.shape, generator=gen, device=DEV))
        ks.fill_(scales[0])
        vs.fill_(scales[1])
        kv_ref = kv.clone()
        out = step.replay(spec, table)
        ref.apply(spec, table)
        want = ref.run(FULL, q[:bs], k[:bs], v[:bs], kv_ref, k_scale=scales[0], v_scale=scales[1])
        torch.cuda.synchronize()
        assert rel_err(out[:bs], want) <= OUT_TOL, (bs, scales)
        assert torch.equal(kv.view(torch.uint8), kv_ref.view(torch.uint8)), (bs, scales)


@pytest.mark.parametrize("index", [0, 1])
@pytest.mark.parametrize("policy", [{}, {"decode_tensor_cores": False}])
def test_large_logit_batches_number_and_tensor_scales(index: int, policy: dict) -> None:
    """Issue 50, item 2, on FlashInfer with one executor for both scale kinds: over the
    issue's two batches (keys across the formats' range, saturated new K/V), a number
    scale matches the reference executor within the bf16 bounds; a 0-d tensor scale
    matches the reference run on the folded query ``bf16(q · k_scale)`` within the same
    bounds — the fold's one rounding is the whole difference (``docs/semantics.md``);
    both write the same cache bytes."""
    from flashplan.testing import large_logit_fp8_batches, large_logit_inputs

    case = large_logit_fp8_batches()[index]
    spec = fp.plan(case.layout, case.heads)
    table = fp.PageTable.shuffled(spec.pages_needed, seed=index, device=DEV)
    cache, q, k_new, v_new, sink_logits = large_logit_inputs(
        case, spec, table, seed=index, device=DEV
    )
    ks, vs = case.k_scale, case.v_scale
    tensors = (torch.tensor(ks, device=DEV), torch.tensor(vs, device=DEV))
    ex = FlashInferExecutor(policy=ExecutorPolicy(decode_backend="fa2", **policy))
    ref = fp.ReferenceExecutor()
    for group in case.layout.groups:
        sinks = sink_logits if group.sinks else None
        got = {}
        for kind, (k_s, v_s) in (("number", (ks, vs)), ("tensor", tensors)):
            c = cache.clone()
            ex.apply(spec, table)
            out, lse = ex.run(
                group, q, k_new, v_new, c, return_lse=True, sinks=sinks, k_scale=k_s, v_scale=v_s
            )
            got[kind] = (out, lse, c)
        c_ref = cache.clone()
        ref.apply(spec, table)
        want = ref.run(
            group, q, k_new, v_new, c_ref, return_lse=True, sinks=sinks, k_scale=ks, v_scale=vs
        )
        folded_q = (q.float() * ks).to(q.dtype)
        want_folded = ref.run(
            group, folded_q, None, None, c_ref, return_lse=True, sinks=sinks, v_scale=vs
        )
        for kind, (out_ref, lse_ref) in (("number", want), ("tensor", want_folded)):
            out, lse, c = got[kind]
            finite = torch.isfinite(lse_ref)
            assert torch.equal(torch.isfinite(lse), finite), (kind, group.describe())
            out_tol = OUT_TOL + (TENSOR_V_SCALE_ROUNDING if kind == "tensor" else 0.0)
            assert rel_err(out, out_ref) <= out_tol, (kind, group.describe(), rel_err(out, out_ref))
            lse_err = (lse - lse_ref)[finite].abs()
            lse_tol = LSE_TOL + LSE_REL_TOL * lse_ref[finite].abs()
            assert bool((lse_err <= lse_tol).all()), (kind, group.describe(), float(lse_err.max()))
            assert torch.equal(c.view(torch.uint8), c_ref.view(torch.uint8)), kind
