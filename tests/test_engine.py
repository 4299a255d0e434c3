"""The example engine (examples/engine) against Hugging Face, on the CPU reference executor.

At every step each request's logits must equal HF's own full forward of that request alone
(eager attention, no cache, fp32) within 1e-4, and the greedy tokens must be equal; and a
convention mapped wrongly (window off by one, soft cap missing, wrong scale) must break that.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: examples.engine

import flashplan as fp
from examples.engine.engine import Engine, Request, StepOutput
from examples.engine.hf_attention import (
    ATTN_IMPLEMENTATION,
    HFCall,
    HFConventions,
    Kind,
    hf_sm_scale,
    hf_soft_cap,
    hf_window_left,
)
from examples.engine.hf_models import TINY_CONFIGS, adapter_for, load_model
from examples.engine.parity import Parity, check_parity, reference_model
from examples.engine.run import make_requests
from flashplan.planning import KernelPath

ATOL = 1e-4  # fp32 engine vs fp32 HF
# gpt-oss, llama4 and embeddinggemma (sinks, chunks, an encoder-only pass with bidirectional
# windows) have their own scenarios in tests/test_engine_local_models.py.
MODELS = ["llama", "gemma2", "gemma3", "mistral", "bart"]
WINDOWED = {"gemma2", "gemma3", "mistral"}
KV_TOKENS = 384  # KV capacity per layer: 24 pages of 16, or 384 pages of 1


@functools.cache
def models(name: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(engine model with random weights, fp32 eager HF reference with the same weights)."""
    model = load_model(name)
    return model, reference_model(model)


def check_step(out: StepOutput | None, engine: Engine, vocab: int) -> StepOutput:
    """What a step's output promises (keep_all_logits=True; see StepOutput): one logits
    row per new token in batch order, owned by its request at decoder position
    ``prefix_len + j``; a token sampled for, and only for, each request whose prompt is
    all in, the greedy token of its last row; finished requests are those done."""
    assert isinstance(out, StepOutput)
    counts = [n for _, n in out.batch]
    assert out.layout.extend_lens.tolist() == counts
    assert tuple(out.logits.shape) == (sum(counts), vocab)
    assert torch.isfinite(out.logits).all()
    assert out.owners == [r for r, n in out.batch for _ in range(n)]
    prefix = out.layout.prefix_lens.tolist()
    assert out.positions == [p + j for p, n in zip(prefix, counts, strict=True) for j in range(n)]
    last = (np.cumsum(counts) - 1).tolist()
    for (r, _), row in zip(out.batch, last, strict=True):
        if r.rid in out.sampled:
            token = out.sampled[r.rid]
            assert 0 <= token < vocab
            assert token == int(out.logits[row].argmax()) == r.output[-1]
            assert r.num_cached == len(r.tokens) - 1  # all but the new token is cached
        else:
            assert r.num_cached < len(r.prompt) and not r.output  # still feeding its prompt
    assert set(out.sampled) <= {r.rid for r, _ in out.batch}
    done = [r for r, _ in out.batch if len(r.output) == r.max_new_tokens]  # no EOS token
    assert [r.rid for r in out.finished] == [r.rid for r in done]
    assert not any(r in engine.running for r in out.finished)
    return out


def run_engine(
    model: torch.nn.Module,
    *,
    page_size: int = 16,
    extend_path: str = "auto",
    conventions: HFConventions = HFConventions(),  # noqa: B008 (frozen)
    overlap: bool = True,
) -> tuple[Engine, list, list[StepOutput], list[bool]]:
    """Six requests (prompts 1..40 tokens, 6..8 new tokens), 3 at a time, 16 tokens a step,
    on the engine's default loop, the overlapped one (``overlap=False``: the plain loop).
    Returns the engine, requests, steps and, per step, whether a page-table row was
    non-contiguous."""
    engine = Engine(
        adapter_for(model),
        fp.ReferenceExecutor(),
        page_size=page_size,
        num_pages=KV_TOKENS // page_size,
        max_running=3,
        token_budget=16,
        extend_path=extend_path,
        conventions=conventions,
        keep_all_logits=True,  # compare every new token, not only the sampled ones
        overlap=overlap,
    )
    reqs = make_requests(model.config.vocab_size, model.config.is_encoder_decoder, 6, 8, 0)
    steps, scattered = [], []
    for step in engine.run(reqs):
        out = check_step(step, engine, model.config.vocab_size)
        steps.append(out)
        scattered.append(any(np.any(np.diff(r.pages) != 1) for r in engine.running))
    return engine, reqs, steps, scattered


def test_conventions() -> None:
    assert hf_window_left(None) == -1 and hf_window_left(5) == 4 and hf_window_left(1) == 0
    assert hf_soft_cap(None) == 0.0 and hf_soft_cap(50) == 50.0
    assert hf_sm_scale(32**-0.5) == 32**-0.5
    conv = HFConventions()
    g = conv.group(Kind.SELF, HFCall(0.125, 6, 2.0))
    assert (g.window_left, g.logits_soft_cap, g.sm_scale) == (5, 2.0, 0.125)
    assert conv.group(Kind.CROSS, HFCall(0.125)) == fp.AttentionGroup.cross(sm_scale=0.125)
    assert conv.group(Kind.ENCODER, HFCall(0.125)) == fp.AttentionGroup.bidirectional(
        sm_scale=0.125
    )


@pytest.mark.parametrize("extend_path", ["auto", "paged", "ragged"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("name", MODELS)
def test_parity_with_hf(name: str, page_size: int, extend_path: str) -> None:
    model, ref = models(name)
    engine, reqs, steps, scattered = run_engine(model, page_size=page_size, extend_path=extend_path)
    parity = check_parity(ref, reqs, steps)
    assert parity.max_abs_diff <= ATOL, parity.line()
    assert not parity.mismatches, parity.line()
    assert parity.tokens == sum(r.max_new_tokens for r in reqs)

    # The batches were what the test means to cover.
    ext = [s.layout.extend_lens for s in steps]
    assert any((e == 1).any() and (e > 1).any() for e in ext), "no decode mixed with a chunk"
    assert any(((s.layout.prefix_lens > 0) & (s.layout.extend_lens > 1)).any() for s in steps), (
        "no prompt chunk after an earlier chunk"
    )
    assert any(s.layout.mode is fp.Mode.DECODE for s in steps)
    assert engine.allocator.reused > 0, "no freed page was reused"
    assert any(scattered), "page tables were all contiguous"
    assert not engine.running and len(engine.allocator.free) == KV_TOKENS // page_size
    paths = {gp.path for s in steps for gp in s.spec.group_plans if not gp.group.cross_attention}
    want = {
        "paged": {KernelPath.PAGED, KernelPath.DECODE},
        "ragged": {KernelPath.RAGGED, KernelPath.RAGGED_PAGED, KernelPath.DECODE},
        "auto": {KernelPath.RAGGED, KernelPath.PAGED, KernelPath.DECODE},
    }[extend_path]
    assert paths == want
    if name in WINDOWED and extend_path == "ragged":  # a window cutting into the prefix
        assert any(gp.uses_custom_mask for s in steps for gp in s.spec.group_plans)
    if model.config.is_encoder_decoder:  # a request joined a batch with cached encoders
        assert any(
            s.layout.encoder_cached.any() and not s.layout.encoder_cached.all() for s in steps
        )


@pytest.mark.parametrize(
    ("name", "page_size", "extend_path"),
    [("llama", 16, "auto"), ("gemma2", 1, "ragged"), ("bart", 16, "paged")],
)
def test_plain_loop_parity_with_hf(name: str, page_size: int, extend_path: str) -> None:
    """The plain loop (``Engine(overlap=False)``, ``run.py --plain-loop``), one flag away
    from the default: the same parity with HF, step outputs as :func:`check_step` states
    them, and the same tokens as the default (overlapped) loop."""
    model, ref = models(name)
    engine, reqs, steps, _ = run_engine(
        model, page_size=page_size, extend_path=extend_path, overlap=False
    )
    assert not engine.overlap and engine.table.shape[0] == 3  # no rows for a queued step
    parity = check_parity(ref, reqs, steps)
    assert parity.max_abs_diff <= ATOL and not parity.mismatches, parity.line()
    _, default_reqs, default_steps, _ = run_engine(
        model, page_size=page_size, extend_path=extend_path
    )
    assert [r.output for r in reqs] == [r.output for r in default_reqs]
    assert len(steps) == len(default_steps)
    assert not engine.running and len(engine.allocator.free) == KV_TOKENS // page_size


def _window_shift(shift: int) -> HFConventions:
    def window_left(sliding_window: int | None) -> int:
        return hf_window_left(sliding_window) + (shift if sliding_window else 0)

    return dataclasses.replace(HFConventions(), window_left=window_left)


WRONG = {
    "window one wider": _window_shift(+1),
    "window one narrower": _window_shift(-1),
    "soft cap missing": dataclasses.replace(HFConventions(), soft_cap=lambda cap: 0.0),
    "scale 1/sqrt(head_dim)": dataclasses.replace(HFConventions(), sm_scale=lambda s: 64**-0.5),
}
CONTROLS = [("gemma2", wrong) for wrong in WRONG] + [
    ("mistral", "window one wider"),  # window 5, narrower than a 16-token page
    ("mistral", "window one narrower"),
]


@pytest.mark.parametrize(("name", "wrong"), CONTROLS)
def test_negative_controls(name: str, wrong: str) -> None:
    """Each wrong convention on its own breaks parity, far beyond the tolerance."""
    model, ref = models(name)
    assert check_parity(ref, *run_engine(model)[1:3]).ok(ATOL)  # the control's baseline
    _, reqs, steps, _ = run_engine(model, conventions=WRONG[wrong])
    parity: Parity = check_parity(ref, reqs, steps)
    assert parity.max_abs_diff > 100 * ATOL, parity.line()
    assert not parity.ok(ATOL)


def test_call_disagreeing_with_plan_raises() -> None:
    """Gemma 3 keeps ``attn_logit_softcapping`` on its modules but never passes it to the
    attention function: the engine plans a capped group, HF's call asks for an uncapped one,
    and ``run`` refuses it instead of computing something else."""
    from transformers import AutoModelForCausalLM

    config = TINY_CONFIGS["gemma3"]()
    config.attn_logit_softcapping = 5.0
    model = AutoModelForCausalLM.from_config(config, attn_implementation=ATTN_IMPLEMENTATION)
    engine = Engine(adapter_for(model.eval()), fp.ReferenceExecutor(), num_pages=8)
    engine.add(make_requests(config.vocab_size, False, 1, 2, 0)[0])
    with pytest.raises(fp.PlanMismatchError, match="was not planned"):
        engine.step()


def test_one_reference_executor_across_models_equals_fresh_ones() -> None:
    """One ReferenceExecutor kept across models (heads and groups change between runs)
    and page sizes, each step compared with a fresh one (ComparingExecutor): bit for
    bit, and every KV cache equal to its shadow."""
    from flashplan.testing.compare import ComparingExecutor

    executor = fp.ReferenceExecutor()
    decoders = [*MODELS, "llama4", "gpt-oss"]
    for name, page_size in [(n, 16) for n in decoders] + [("gemma2", 1), ("llama4", 1)]:
        model, _ = models(name)
        tee = ComparingExecutor(executor)
        engine = Engine(
            adapter_for(model), tee, page_size=page_size, num_pages=KV_TOKENS // page_size,
            max_running=3, token_budget=16,
        )  # fmt: skip
        for _ in engine.run(
            make_requests(model.config.vocab_size, model.config.is_encoder_decoder, 8, 6, 1)
        ):
            pass
        assert tee.records and not tee.bad(0.0, 0.0), f"{name} {page_size}: {tee.summary()}"


@pytest.mark.parametrize(("name", "kv_dtype"), [("llama", "fp8_e4m3"), ("gemma2", "fp8_e5m2")])
def test_fp8_cache_parity_with_hf(name: str, kv_dtype: str) -> None:
    """``run.py --kv-dtype fp8_*``: a bf16 model over an fp8 cache, on the reference
    executor, within the stated fp8 tolerance of HF's fp32 forward (``run.TOLERANCES``),
    greedy tokens equal outside HF's near-ties; the cache really is fp8."""
    from examples.engine import run

    seen: list[torch.dtype] = []
    real = Engine.__init__

    def spy(self: Engine, *args: object, **kwargs: object) -> None:
        real(self, *args, **kwargs)  # type: ignore[arg-type]
        seen.extend(c.dtype for c in self.ctx.kv_caches)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Engine, "__init__", spy)
        assert run.main(["--model", name, "--kv-dtype", kv_dtype]) == 0
    assert seen and set(seen) == {run.KV_DTYPES[kv_dtype]}


@pytest.mark.parametrize("overlap", [True, False])
def test_fp8_cache_decodes_on_xqa_over_the_twin(overlap: bool) -> None:
    """The engine over an e4m3 cache on the FlashInfer executor with decodes forced onto
    XQA (``ExecutorPolicy(decode_backend="xqa")``; the twin's XQA rounds the queries to
    e4m3 as Hopper's kernel does): tiny Llama in bf16, page 16, six requests three at a
    time (chunked prompts, joining and finishing), the overlapped and the plain loop.
    XQA ran the decodes; every logits row is within ``run.TOLERANCES["fp8_e4m3"]`` of
    HF's fp32 forward, and within that of the same engine with FA2 decodes; greedy tokens
    equal HF's outside its near-ties."""
    import types

    from examples.engine.parity import compare_runs
    from examples.engine.run import TOLERANCES
    from flashplan.executor.flashinfer import ExecutorPolicy, FlashInferExecutor
    from flashplan.twin import flashinfer_twin

    model = load_model("llama", dtype=torch.bfloat16)
    ref = reference_model(model)
    calls: list[int] = []

    def counted_xqa(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return flashinfer_twin.xqa(*args, **kwargs)

    twin = types.SimpleNamespace(**{**vars(flashinfer_twin), "xqa": counted_xqa})

    def run(backend: str) -> tuple[list[Request], list[StepOutput]]:
        ex = FlashInferExecutor(policy=ExecutorPolicy(decode_backend=backend), flashinfer=twin)
        engine = Engine(
            adapter_for(model), ex, page_size=16, num_pages=24, max_running=3,
            token_budget=16, keep_all_logits=True, kv_dtype=torch.float8_e4m3fn,
            overlap=overlap,
        )  # fmt: skip
        reqs = make_requests(model.config.vocab_size, False, 6, 12, 0)
        return reqs, list(engine.run(reqs))

    reqs, steps = run("xqa")
    assert calls, "no decode ran on XQA"
    calls.clear()
    fa2_reqs, fa2_steps = run("fa2")
    assert not calls
    margin, rel = TOLERANCES["fp8_e4m3"]
    parity = check_parity(ref, reqs, steps, tie_margin=margin)
    assert parity.ok(rel * parity.max_ref_logit), parity.line()
    both = compare_runs(reqs, steps, fa2_reqs, fa2_steps)
    assert both.rows > 0 and both.max_abs_diff <= rel * parity.max_ref_logit, both.line()


def test_run_refuses_work_that_can_never_be_admitted() -> None:
    """``Engine.run`` raises when work is left but no step can run (a prompt whose
    pages the pool can never hold), instead of spinning or yielding nothing."""
    model, _ = models("llama")
    engine = Engine(adapter_for(model), fp.ReferenceExecutor(), page_size=4, num_pages=3)
    with pytest.raises(RuntimeError, match="no request could be admitted"):
        list(engine.run([Request(list(range(3, 23)), 4)]))


def test_one_device_page_table_for_the_engine() -> None:
    """Every step plans over the same device page table (``Engine.device_table``),
    holding the host table's ids as the step sent them."""
    model, _ = models("llama")
    engine = Engine(adapter_for(model), fp.ReferenceExecutor(), page_size=4, num_pages=32)
    tables = []
    for out in engine.run([Request(list(range(3, 12)), 4), Request(list(range(5, 10)), 6)]):
        assert out.table is not None
        assert out.table.pages is engine.device_table.pages
        rows = out.table.rows
        # the step's rows as the step sent them (finished requests clear theirs after)
        sent = out.table.pages.numpy()[rows]
        for i, (r, _) in enumerate(out.batch):
            assert sent[i, : len(r.pages)].tolist() == r.pages
        tables.append(out.table.pages)
    assert len(tables) > 2 and all(t is tables[0] for t in tables)
