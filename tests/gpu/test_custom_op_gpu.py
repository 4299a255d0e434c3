"""``AttentionOp`` with the FlashInfer executor: a decoder layer compiled by Inductor
with ``fullgraph=True`` equals the eager layer bit for bit (outputs and the KV cache
the op writes), over decode and extend steps of one executor."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import flashplan as fp
from flashplan.executor.flashinfer import FlashInferExecutor

DEV = "cuda"
HEADS = fp.HeadConfig(num_qo_heads=16, num_kv_heads=4, head_dim=128)  # bf16
GROUPS = (fp.AttentionGroup.full(), fp.AttentionGroup.sliding(40, logits_soft_cap=30.0))
PAGE, POOL, HIDDEN = 16, 256, 256


class Layer(torch.nn.Module):
    def __init__(self, attend: fp.AttentionOp) -> None:
        super().__init__()
        hq, hkv, d = HEADS.num_qo_heads, HEADS.num_kv_heads, HEADS.head_dim
        gen = torch.Generator(device=DEV).manual_seed(0)
        dt = torch.bfloat16
        self.wq = torch.nn.Parameter(
            torch.randn(HIDDEN, hq * d, generator=gen, device=DEV).to(dt) / 16
        )
        self.wkv = torch.nn.Parameter(
            torch.randn(HIDDEN, 2 * hkv * d, generator=gen, device=DEV).to(dt) / 16
        )
        self.wo = torch.nn.Parameter(
            torch.randn(hq * d, HIDDEN, generator=gen, device=DEV).to(dt) / 16
        )
        self.attend = attend

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hq, hkv, d = HEADS.num_qo_heads, HEADS.num_kv_heads, HEADS.head_dim
        q = (x @ self.wq).view(-1, hq, d)
        k, v = (x @ self.wkv).view(-1, 2, hkv, d).unbind(1)
        out = fp.attention(self.attend, q, k.contiguous(), v.contiguous(), kv_cache)
        return out, x + out.reshape(-1, hq * d) @ self.wo


@pytest.mark.parametrize("group", GROUPS, ids=lambda g: g.describe())
def test_inductor_layer_equals_eager_layer(group: fp.AttentionGroup) -> None:
    ex = FlashInferExecutor()
    layer = Layer(fp.AttentionOp(ex, group))
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(layer, fullgraph=True, backend=counter)
    gen = torch.Generator(device=DEV).manual_seed(1)
    steps = [([90, 300, 1400, 7], None), ([700, 12, 50, 1000], None), ([90, 300, 60], [40, 0, 59])]
    with torch.no_grad():
        for i, (seq, prefix) in enumerate(steps):
            layout = (
                fp.BatchLayout.decode(seq, page_size=PAGE, groups=GROUPS)
                if prefix is None
                else fp.BatchLayout.extend(seq, prefix, page_size=PAGE, groups=GROUPS)
            )
            spec = fp.plan(layout, HEADS)
            table = fp.PageTable.shuffled(spec.pages_needed, seed=i, device=DEV)
            assert table.num_pages is not None and table.num_pages <= POOL
            cache = torch.randn(POOL, 2, PAGE, HEADS.num_kv_heads, HEADS.head_dim,
                                generator=gen, device=DEV).to(torch.bfloat16)  # fmt: skip
            x = torch.randn(spec.total_q, HIDDEN, generator=gen, device=DEV).to(torch.bfloat16)
            ex.apply(spec, table)
            eager_cache, compiled_cache = cache.clone(), cache.clone()
            want = layer(x, eager_cache)
            got = compiled(x, compiled_cache)
            assert torch.equal(got[0], want[0]), i  # attention itself
            assert torch.equal(got[1], want[1]), i  # the whole layer
            assert torch.equal(compiled_cache, eager_cache), i
            assert not torch.equal(compiled_cache, cache), i
    assert counter.frame_count <= 2  # one trace for both decode steps (then the extend)
