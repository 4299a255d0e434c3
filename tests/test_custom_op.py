"""``AttentionOp``: ``executor.run`` as the ``flashplan::run`` custom op, compiled.

A decoder layer (projections around attention) compiled with ``torch.compile(
fullgraph=True)`` must equal the eager layer bit for bit, outputs and KV cache, over
several steps of one executor (one trace for steps of the same shapes). The compiler
here is ``aot_eager`` (functionalization and the op's fake implementation, without
code generation); the GPU test (``tests/gpu/test_custom_op_gpu.py``) runs Inductor with
the FlashInfer executor and a CUDA-graph capture.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import flashplan as fp
from flashplan.errors import FieldTypeError, PlanMismatchError

HEADS = fp.HeadConfig(4, 2, 16, q_dtype=torch.float32, kv_dtype=torch.float32,
                      out_dtype=torch.float32)  # fmt: skip
GROUPS = (fp.AttentionGroup.full(), fp.AttentionGroup.sliding(5))
PAGE = 4
POOL = 32  # pages in the KV cache


class Layer(torch.nn.Module):
    """Projections around one attention call (what a model's decoder layer does)."""

    def __init__(self, attend: fp.AttentionOp) -> None:
        super().__init__()
        hq, hkv, d = HEADS.num_qo_heads, HEADS.num_kv_heads, HEADS.head_dim
        gen = torch.Generator().manual_seed(0)
        self.wq = torch.nn.Parameter(torch.randn(32, hq * d, generator=gen) / 8)
        self.wkv = torch.nn.Parameter(torch.randn(32, 2 * hkv * d, generator=gen) / 8)
        self.wo = torch.nn.Parameter(torch.randn(hq * d, 32, generator=gen) / 8)
        self.attend = attend

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        hq, hkv, d = HEADS.num_qo_heads, HEADS.num_kv_heads, HEADS.head_dim
        q = (x @ self.wq).view(-1, hq, d)
        k, v = (x @ self.wkv).view(-1, 2, hkv, d).unbind(1)
        out = fp.attention(self.attend, q, k.contiguous(), v.contiguous(), kv_cache)
        return x + out.reshape(-1, hq * d) @ self.wo


def _step(seq: list[int], prefix: list[int] | None, seed: int):  # type: ignore[no-untyped-def]
    layout = (
        fp.BatchLayout.decode(seq, page_size=PAGE, groups=GROUPS)
        if prefix is None
        else fp.BatchLayout.extend(seq, prefix, page_size=PAGE, groups=GROUPS)
    )
    spec = fp.plan(layout, HEADS)
    table = fp.PageTable.shuffled(spec.pages_needed, seed=seed)
    assert table.num_pages is not None
    gen = torch.Generator().manual_seed(seed)
    # one pool size for every step (a cache of another size would be another shape)
    assert table.num_pages <= POOL
    cache = torch.randn(POOL, 2, PAGE, HEADS.num_kv_heads, HEADS.head_dim, generator=gen)
    x = torch.randn(spec.total_q, 32, generator=gen)
    return spec, table, cache, x


@pytest.mark.parametrize("group", GROUPS, ids=lambda g: g.describe())
def test_compiled_layer_equals_eager_layer(group: fp.AttentionGroup) -> None:
    ex = fp.ReferenceExecutor(compute_dtype=torch.float32)
    layer = Layer(fp.AttentionOp(ex, group))
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, fullgraph=True, backend=counter)
    steps = [
        _step([9, 3, 14], None, 1),  # decode
        _step([7, 12, 5], None, 2),  # decode, the same shapes: no new trace
        _step([9, 20, 6], [4, 13, 0], 3),  # extend: another shape
    ]
    with torch.no_grad():
        for i, (spec, table, cache, x) in enumerate(steps):
            ex.apply(spec, table)
            eager_cache, compiled_cache = cache.clone(), cache.clone()
            want = layer(x, eager_cache)
            got = compiled(x, compiled_cache)
            assert torch.equal(got, want), i
            assert torch.equal(compiled_cache, eager_cache), i  # the op's K/V writes
            assert not torch.equal(compiled_cache, cache), i  # (which did happen)
            if i == 1:
                assert counter.frame_count == 1  # one trace for both decode steps
    assert counter.frame_count <= 3


def test_refusals() -> None:
    with pytest.raises(FieldTypeError):
        fp.AttentionOp(object(), GROUPS[0])  # type: ignore[arg-type]
    with pytest.raises(FieldTypeError):
        fp.AttentionOp(fp.ReferenceExecutor(), "full")  # type: ignore[arg-type]
    ex = fp.ReferenceExecutor()
    q = torch.zeros(1, HEADS.num_qo_heads, HEADS.head_dim)
    with pytest.raises(PlanMismatchError):  # no plan applied
        fp.attention(fp.AttentionOp(ex, GROUPS[0]), q, None, None, None)
    spec, table, _, _ = _step([3], None, 0)
    ex.apply(spec, table)
    with pytest.raises(PlanMismatchError):  # a group that was not planned
        fp.attention(fp.AttentionOp(ex, fp.AttentionGroup.sliding(2)), q, None, None, None)


@pytest.mark.parametrize("tensor_scales", [False, True])
def test_compiled_layer_over_an_fp8_cache_equals_eager(tensor_scales: bool) -> None:
    """The op passes an fp8 cache's scales (numbers or 0-d tensors) to ``run``: the
    compiled layer equals the eager one bit for bit, stored bytes included."""
    heads = fp.HeadConfig(4, 2, 16, q_dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn)
    group = fp.AttentionGroup.full()
    ex = fp.ReferenceExecutor(compute_dtype=torch.float32)
    attend = fp.AttentionOp(ex, group)
    ks, vs = (torch.tensor(0.5), torch.tensor(2.0)) if tensor_scales else (0.5, 2.0)
    gen = torch.Generator().manual_seed(5)
    wq = torch.randn(32, 64, generator=gen).to(torch.bfloat16)
    wkv = torch.randn(32, 64, generator=gen).to(torch.bfloat16)

    def layer(x: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        q = (x @ wq).view(-1, 4, 16)
        k, v = (x @ wkv).view(-1, 2, 2, 16).unbind(1)
        return fp.attention(
            attend, q, k.contiguous(), v.contiguous(), kv_cache, k_scale=ks, v_scale=vs
        )

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    spec = fp.plan(fp.BatchLayout.decode([9, 3, 14], page_size=PAGE, groups=(group,)), heads)
    table = fp.PageTable.shuffled(spec.pages_needed, seed=3)
    cache = (torch.randn(POOL, 2, PAGE, 2, 16, generator=gen) * 4).to(torch.float8_e4m3fn)
    x = torch.randn(spec.total_q, 32, generator=gen).to(torch.bfloat16)
    ex.apply(spec, table)
    eager_cache, compiled_cache = cache.clone(), cache.clone()
    with torch.no_grad():
        want = layer(x, eager_cache)
        got = compiled(x, compiled_cache)
    assert torch.equal(got, want)
    assert torch.equal(compiled_cache.view(torch.uint8), eager_cache.view(torch.uint8))
    assert not torch.equal(compiled_cache.view(torch.uint8), cache.view(torch.uint8))
