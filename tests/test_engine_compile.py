"""The engine's forward under ``torch.compile`` (``Engine(compile=...)``), on the CPU.

The compiled forward runs attention through the custom op ``flashplan::run``
(:meth:`StepContext.for_compile`): the test's backend records every graph dynamo hands
it and then runs it as ``aot_eager`` does (tracing through AOT autograd, the op's fake
implementation included, without inductor's C++ compile). It must trace the whole
forward without a graph break, hold the op once per layer, and give the eager engine's
tokens and logits exactly.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flashplan as fp
from examples.engine.engine import Engine, Request
from examples.engine.hf_models import adapter_for, load_model


class Recording:
    """A ``torch.compile`` backend that keeps the FX graphs and runs them via aot_eager."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, inputs: list[Any]) -> Any:
        from torch._dynamo.backends.debugging import aot_eager

        self.graphs.append(gm)
        return aot_eager(gm, inputs)

    def op_calls(self) -> list[int]:
        """Per graph, its calls of ``flashplan::run``."""
        op = torch.ops.flashplan.run.default
        return [sum(n.target is op for n in g.graph.nodes) for g in self.graphs]


def run(compile: Any, name: str = "llama") -> tuple[list[list[int]], list[torch.Tensor]]:
    adapter = adapter_for(load_model(name))
    engine = Engine(
        adapter, fp.ReferenceExecutor(), page_size=4, num_pages=64, max_running=4,
        token_budget=16, keep_all_logits=True, compile=compile,
    )  # fmt: skip
    requests = [Request(list(range(3, 3 + n)), 5) for n in (7, 5, 11)]
    logits = [out.logits for out in engine.run(requests)]
    return [r.output for r in requests], logits


@pytest.mark.parametrize("name", ["llama", "gemma2"])  # gemma2: windows and soft caps
def test_compiled_forward_equals_eager(name: str) -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    backend = Recording()
    tokens, logits = run(backend, name)
    assert not counters["graph_break"], dict(counters["graph_break"])
    layers = load_model(name).config.num_hidden_layers
    calls = backend.op_calls()
    assert calls and all(c == layers for c in calls), calls  # prefill, decode (dynamic)
    eager_tokens, eager_logits = run(None, name)
    assert tokens == eager_tokens
    for got, want in zip(logits, eager_logits, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch._dynamo.reset()


def test_compiled_call_is_checked() -> None:
    """A module whose call differs from the one planned is refused while tracing."""
    from examples.engine.hf_attention import StepContext

    adapter = adapter_for(load_model("llama"))
    engine = Engine(adapter, fp.ReferenceExecutor(), page_size=4, num_pages=16, compile="eager")
    ctx = engine._forward_ctx
    assert isinstance(ctx, StepContext) and ctx.compiled is not None
    module = next(iter(ctx.compiled))
    module.scaling = module.scaling * 2  # the call no longer matches the planned group
    engine.add(Request([3, 4, 5], 2))
    try:
        with pytest.raises(Exception, match="not the one planned"):
            engine.step()
    finally:
        module.scaling = module.scaling / 2
        torch._dynamo.reset()
