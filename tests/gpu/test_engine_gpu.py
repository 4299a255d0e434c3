"""The example engine (examples/engine) on FlashInfer kernels in bf16, against HF in fp32.

The same engine and scenario as tests/test_engine.py (chunked prompts mixed with decodes,
pages from a free list, reuse after a request finishes), with ``FlashInferExecutor`` (FA2
prefill) in place of the reference executor. Logits must match HF's fp32 eager forward of
each request alone within bf16 tolerance, and the first greedy tokens must be equal (except
where HF's own top two logits are closer than bf16 can resolve). gpt-oss (sinks) and Llama 4
(chunks) run the same scenario; EmbeddingGemma's packed encoder-only pass
(tests/test_engine_local_models.py) must match HF's hidden states of each prompt alone.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: examples.engine

import flashplan as fp
from examples.engine.engine import Engine, embed
from examples.engine.hf_models import (
    TINY_CONFIGS,
    EncoderOnly,
    adapter_for,
    is_encoder_only,
    load_model,
)
from examples.engine.parity import check_embed_parity, check_parity, reference_model
from examples.engine.run import make_requests

pytestmark = pytest.mark.gpu

# Seen on an H200 (flashinfer 0.7.4, transformers 5.17): max |logit diff| 0.044 to 0.103,
# 1.0 to 2.0 % of max |HF logit|, the whole model being bf16; up to 2 of 18 tokens at ties.
REL_TOL = 0.05  # max |logit diff| / max |HF logit|
TIE = 0.25  # HF top-two logit margin below which bf16 may pick the other token (~2.5x error)
FIRST_TOKENS = 3  # greedy tokens per request that must be equal
DECODERS = [name for name, config in TINY_CONFIGS.items() if not is_encoder_only(config())]
CASES = [(name, 16, "auto") for name in DECODERS] + [
    ("llama", 1, "ragged"),
    ("gemma2", 1, "ragged"),  # windowed prefix: custom mask
    ("mistral", 16, "ragged"),
    ("bart", 1, "paged"),
    ("gpt-oss", 1, "ragged"),  # sinks folded into a ragged + paged extend
    ("llama4", 1, "auto"),  # chunks on page boundaries: virtual requests (page 16: masks)
]


@pytest.mark.parametrize(("name", "page_size", "extend_path"), CASES)
def test_engine_on_flashinfer(name: str, page_size: int, extend_path: str) -> None:
    _scenario(name, page_size, extend_path)


@pytest.mark.parametrize(
    ("name", "page_size"), [("llama", 16), ("gemma2", 1), ("gpt-oss", 16), ("llama4", 16)]
)
def test_engine_decode_steps_replayed_from_cuda_graphs(name: str, page_size: int) -> None:
    """The same scenario with decode steps replayed from graph buckets of 2 and 4 rows
    (4 shrinks to the engine's 3 running requests; windows and soft caps: gemma2; sinks:
    gpt-oss; chunks: llama4): parity with HF."""
    engine = _scenario(name, page_size, "auto", cuda_graphs=(2, 4))
    assert engine.replayed_steps > 0


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_compiled_engine_with_graphs(name: str) -> None:
    """The scenario with the forward under ``torch.compile`` (inductor; attention through
    the custom op), eager steps and decode steps captured in graph buckets: parity with
    HF as the eager forward's."""
    torch._dynamo.reset()
    try:
        engine = _scenario(name, 16, "auto", cuda_graphs=(2, 4), compile="inductor")
    finally:
        torch._dynamo.reset()
    assert engine.replayed_steps > 0


def _scenario(
    name: str,
    page_size: int,
    extend_path: str,
    cuda_graphs: tuple[int, ...] = (),
    compile: str | None = None,
) -> Engine:
    from flashplan.executor.flashinfer import ExecutorPolicy, FlashInferExecutor

    model = load_model(name, dtype=torch.bfloat16, device="cuda")
    ref = reference_model(model)  # fp32 copy, HF eager attention
    executor = FlashInferExecutor("cuda", policy=ExecutorPolicy(prefill_backend="fa2"))
    engine = Engine(
        adapter_for(model),
        executor,
        page_size=page_size,
        num_pages=384 // page_size,
        max_running=3,
        token_budget=16,
        extend_path=extend_path,
        keep_all_logits=True,
        cuda_graphs=cuda_graphs,
        compile=compile,
    )
    reqs = make_requests(model.config.vocab_size, model.config.is_encoder_decoder, 6, 8, 0)
    steps = list(engine.run(reqs))
    # the plans ran on FlashInfer's kernels: the last eager step's on this executor (a
    # step replayed from a graph bucket applies its plan to the bucket's executor)
    eager = [s for s in steps if not s.replayed]
    assert executor.spec is eager[-1].spec
    assert len(eager) < len(steps) if cuda_graphs else len(eager) == len(steps)
    assert engine.allocator.reused > 0
    assert any(s.layout.mode is fp.Mode.EXTEND for s in steps)
    assert any(s.layout.mode is fp.Mode.DECODE for s in steps)

    parity = check_parity(ref, reqs, steps, first_tokens=FIRST_TOKENS, tie_margin=TIE)
    print(f"\n{name} page_size={page_size} {extend_path}: {parity.line()}")
    assert parity.max_abs_diff <= REL_TOL * parity.max_ref_logit, parity.line()
    assert not parity.mismatches, parity.line()
    assert parity.ties <= parity.tokens // 4, parity.line()  # ties stay the exception
    return engine


def test_engine_step_loop_matches_reference_step_by_step() -> None:
    """The engine's step loop on ONE FlashInferExecutor kept across every model (heads,
    groups and conventions change between runs) and page sizes 1 and 16: requests join
    and finish, prompts are chunked, decodes mix in; every attention call of every step
    is compared with a fresh reference executor on the same plan and inputs, and every
    KV cache with its shadow (:class:`flashplan.testing.compare.ComparingExecutor`)."""
    from flashplan.executor.flashinfer import ExecutorPolicy, FlashInferExecutor
    from flashplan.testing.compare import ComparingExecutor

    executor = FlashInferExecutor("cuda", policy=ExecutorPolicy(prefill_backend="fa2"))
    lines = []
    for page_size in (1, 16):
        for name in DECODERS:
            model = load_model(name, dtype=torch.bfloat16, device="cuda")
            tee = ComparingExecutor(executor)
            engine = Engine(
                adapter_for(model), tee, page_size=page_size, num_pages=768 // page_size,
                max_running=4, token_budget=24, extend_path="auto",
            )  # fmt: skip
            reqs = make_requests(model.config.vocab_size, model.config.is_encoder_decoder,
                                 16, 12, page_size)  # fmt: skip
            steps = sum(1 for _ in engine.run(reqs))
            assert steps >= 20 and engine.allocator.reused > 0
            lines.append(f"{name} page_size={page_size}: {tee.summary()}")
            assert not tee.bad(), lines[-1]
    print("\n" + "\n".join(lines))


@pytest.mark.parametrize(("page_size", "extend_path"), [(16, "auto"), (1, "paged")])
def test_embed_on_flashinfer(page_size: int, extend_path: str) -> None:
    """EmbeddingGemma: prompts of 1 to 60 tokens in one packed pass on FlashInfer (the
    bidirectional windows on one paged prefill with a position mask), each prompt's hidden
    states vs HF's fp32 forward of it alone, within bf16 tolerance."""
    import numpy as np

    from flashplan.executor.flashinfer import ExecutorPolicy, FlashInferExecutor

    model = load_model("embeddinggemma", dtype=torch.bfloat16, device="cuda")
    ref = reference_model(model)
    adapter = adapter_for(model)
    assert isinstance(adapter, EncoderOnly)
    executor = FlashInferExecutor("cuda", policy=ExecutorPolicy(prefill_backend="fa2"))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 512, n).tolist() for n in (5, 37, 12, 1, 23, 60, 9)]
    hidden = embed(adapter, executor, prompts, page_size=page_size, extend_path=extend_path)
    assert executor.spec is not None
    assert any(gp.paged is not None and gp.paged.position_mask is not None
               for gp in executor.spec.group_plans)  # fmt: skip
    parity = check_embed_parity(ref, prompts, hidden)
    print(f"\nembeddinggemma page_size={page_size} {extend_path}: {parity.line()}")
    assert parity.max_abs_diff <= REL_TOL * parity.max_ref, parity.line()


@pytest.mark.parametrize("cascade", ["on", "off"])
def test_parallel_samples_on_flashinfer(cascade: str) -> None:
    """Parallel sampling (greedy, n = 3 and 2) on FlashInfer, page 16: the samples share
    their prompt's whole pages and, with ``cascade="on"``, decode on cascade levels
    (eagerly); every logits row of every sample matches HF's forward of that sample
    alone, and the greedy samples of one prompt are the same tokens."""
    import numpy as np

    from examples.engine.engine import Request
    from flashplan.executor.flashinfer import ExecutorPolicy, FlashInferExecutor

    model = load_model("llama", dtype=torch.bfloat16, device="cuda")
    ref = reference_model(model)
    executor = FlashInferExecutor("cuda", policy=ExecutorPolicy(prefill_backend="fa2"))
    engine = Engine(
        adapter_for(model), executor, page_size=16, num_pages=64, max_running=8,
        token_budget=64, keep_all_logits=True, cascade=cascade,
    )  # fmt: skip
    rng = np.random.default_rng(5)
    reqs = [
        Request(rng.integers(3, 512, 40).tolist(), 6, n=3),
        Request(rng.integers(3, 512, 23).tolist(), 5),
        Request(rng.integers(3, 512, 35).tolist(), 6, n=2),
    ]
    steps = list(engine.run(reqs))
    assert (engine.cascade_steps > 0) == (cascade == "on")
    samples = [s for r in reqs for s in r.samples]
    assert len(samples) == 6
    parity = check_parity(ref, samples, steps, first_tokens=FIRST_TOKENS, tie_margin=TIE)
    print(f"\nparallel samples, cascade {cascade}: {parity.line()}")
    assert parity.max_abs_diff <= REL_TOL * parity.max_ref_logit, parity.line()
    assert not parity.mismatches, parity.line()
    for r in reqs:  # greedy: every sample of a prompt decodes the same tokens
        assert all(s.output[:FIRST_TOKENS] == r.output[:FIRST_TOKENS] for s in r.samples)


@pytest.mark.parametrize("cuda_graphs", [(), (2, 4)])
def test_overlapped_loop_equals_plain_on_flashinfer(cuda_graphs: tuple[int, ...]) -> None:
    """The overlapped step loop (``Engine(overlap=True)``, the engine's default: step N+1
    planned and queued before step N's tokens are read, its decodes fed from the device)
    against the plain loop (``overlap=False``) on FlashInfer in bf16: llama, page 16,
    six requests three at a time (joining and finishing, chunked prompts), eagerly and
    with decode steps replayed from graph buckets of 2 and 4. Without a stop token both
    loops run the same steps: the same batches, bit-equal logits, equal tokens. With a
    stop token (its finish read one step late, an extra decode step discarded) the
    batches differ after it: the tokens must still be equal, but where the plain loop's
    top two logits are within bf16's reach (``TIE``) a differing batch may round the
    other way."""
    from examples.engine.engine import Request, StepOutput
    from flashplan.executor.flashinfer import ExecutorPolicy, FlashInferExecutor

    model = load_model("llama", dtype=torch.bfloat16, device="cuda")

    def run(
        overlap: bool, eos: int | None = None
    ) -> tuple[list[Request], list[StepOutput], Engine]:
        executor = FlashInferExecutor("cuda", policy=ExecutorPolicy(prefill_backend="fa2"))
        engine = Engine(
            adapter_for(model), executor, page_size=16, num_pages=24, max_running=3,
            token_budget=16, keep_all_logits=True, cuda_graphs=cuda_graphs,
            eos_token_id=eos, overlap=overlap,
        )  # fmt: skip
        reqs = make_requests(model.config.vocab_size, False, 6, 8, 0)
        steps = list(engine.run(reqs))
        assert not engine.running and len(engine.allocator.free) == 24 - bool(cuda_graphs)
        assert (engine.replayed_steps > 0) == bool(cuda_graphs)
        return reqs, steps, engine

    plain_reqs, plain_steps, _ = run(False)
    reqs, steps, _ = run(True)
    assert [r.output for r in reqs] == [r.output for r in plain_reqs]
    assert [[(r.rid, n) for r, n in s.batch] for s in steps] == [
        [(r.rid, n) for r, n in s.batch] for s in plain_steps
    ]
    for a, b in zip(steps, plain_steps, strict=True):
        assert torch.equal(a.logits, b.logits)

    outputs = [r.output for r in plain_reqs]
    eos = next(t for o in outputs for t in o[1:-1] if any(t not in other for other in outputs))
    plain_reqs, plain_steps, _ = run(False, eos)
    reqs, steps, _ = run(True, eos)
    assert any(s.discarded for s in steps)
    rows = {  # (request id, position) -> the plain loop's logits row there
        (r.rid, pos): s.logits[j].float()
        for s in plain_steps
        for j, (r, pos) in enumerate(zip(s.owners, s.positions, strict=True))
    }
    for got, want in zip(reqs, plain_reqs, strict=True):
        if got.output == want.output:
            continue
        k = next(
            (i for i, (a, b) in enumerate(zip(got.output, want.output, strict=False)) if a != b),
            min(len(got.output), len(want.output)),
        )
        top2 = rows[(want.rid, len(want.prompt) - 1 + k)].topk(2).values
        assert float(top2[0] - top2[1]) < TIE, (got.rid, k, got.output, want.output)


# -- an fp8 e4m3 KV cache (issue 52) --------------------------------------------------------
# e4m3 keeps 3 mantissa bits: a cached K/V element is rounded with a relative error of at
# most 2**-4 (scale 1.0; below 2**-6 the step is 2**-10 absolute), and on Hopper the
# executor's default policy decodes e4m3 caches on XQA, which also rounds the queries and
# the softmax probabilities to e4m3 (the same bound each). What that does to the logits
# is measured, not derived: the same tiny Llama and workload on the CPU (bf16 model,
# reference executor, exact attention over the dequantized cache; llama, mistral and
# gpt-oss, 3 to 5 workloads each) gave a mean |logit diff| from HF's fp32 forward of
# 0.93-1.11 % of max |HF logit| (a bf16 cache: 0.18-0.23 %), and a max of 6.7-13.0 %
# (a bf16 cache: 1.2-2.0 %; the max is one element of some 60 000, so heavy-tailed);
# emulating XQA's e4m3 queries and probabilities on the FlashInfer twin moved the mean by
# +3 % of itself (1.15 %) and the max within that range. The bf16 model on a GPU adds its
# own rounding (REL_TOL above: measured 1.0-2.0 % max). Bounds: the mean within 2 % (1.7x
# the worst mean seen), the max within 20 % (the worst max seen plus the GPU's bf16 share,
# with a third on top for the tail). Greedy tokens: a logit moved by at most d can flip
# the argmax only where HF's top two are within 2d, so no token may differ from HF's
# argmax outside that margin, and such numerical ties stay a minority (CPU: at most 9 of
# 90 tokens).
FP8_MEAN_REL = 0.02  # mean |logit diff| / max |HF logit|
FP8_MAX_REL = 0.20  # max |logit diff| / max |HF logit|


@pytest.mark.parametrize("cuda_graphs", [(), (2, 4)])
def test_fp8_e4m3_cache_parity_with_hf(cuda_graphs: tuple[int, ...]) -> None:
    """The engine over an e4m3 KV cache (``Engine(kv_dtype=torch.float8_e4m3fn)``,
    ``run.py --kv-dtype fp8_e4m3``, scales 1.0) on the FlashInfer executor with its
    default policy (XQA decodes on Hopper where the installed flashplan has them, FA2
    otherwise), eagerly and with decode steps replayed from graph buckets of 2 and 4:
    tiny Llama in bf16, page 16, six requests three at a time (chunked prompts, joining
    and finishing), 14 to 16 new tokens each, every logits row against HF's fp32 eager
    forward of each request alone and against the same engine over a bf16 cache, within
    the bounds stated above (FP8_MEAN_REL, FP8_MAX_REL)."""
    from examples.engine.parity import compare_runs
    from flashplan.executor.flashinfer import FlashInferExecutor

    model = load_model("llama", dtype=torch.bfloat16, device="cuda")
    ref = reference_model(model)

    def run(kv_dtype: torch.dtype | None):  # type: ignore[no-untyped-def]
        engine = Engine(
            adapter_for(model), FlashInferExecutor("cuda"), page_size=16, num_pages=24,
            max_running=3, token_budget=16, keep_all_logits=True, kv_dtype=kv_dtype,
            cuda_graphs=cuda_graphs,
        )  # fmt: skip
        reqs = make_requests(model.config.vocab_size, False, 6, 16, 0)
        steps = list(engine.run(reqs))
        assert (engine.replayed_steps > 0) == bool(cuda_graphs)
        assert not engine.running and len(engine.allocator.free) == 24 - bool(cuda_graphs)
        return engine, reqs, steps

    engine, reqs, steps = run(torch.float8_e4m3fn)
    assert {c.dtype for c in engine.ctx.kv_caches} == {torch.float8_e4m3fn}
    parity = check_parity(ref, reqs, steps)  # every difference a mismatch: counted next
    top = parity.max_ref_logit
    greedy = check_parity(ref, reqs, steps, tie_margin=2 * parity.max_abs_diff)
    _, bf16_reqs, bf16_steps = run(None)
    bf16 = check_parity(ref, bf16_reqs, bf16_steps)
    both = compare_runs(reqs, steps, bf16_reqs, bf16_steps)
    print(
        f"\ne4m3 cache, graphs {cuda_graphs}: {parity.line()}; mean |logit diff| "
        f"{parity.mean_abs_diff:.2e} ({parity.mean_abs_diff / top:.2%}), max "
        f"{parity.max_abs_diff / top:.2%} of max |logit|; numerical ties {greedy.ties}"
        f"\nbf16 cache: mean {bf16.mean_abs_diff / top:.2%}, max {bf16.max_abs_diff / top:.2%}"
        f"\ne4m3 vs bf16 cache: {both.line()}"
    )
    assert parity.mean_abs_diff <= FP8_MEAN_REL * top, parity.line()
    assert parity.max_abs_diff <= FP8_MAX_REL * top, parity.line()
    assert not greedy.mismatches, greedy.line()
    assert greedy.ties <= greedy.tokens // 4, greedy.line()
    # the cache's rounding alone: the same engine and kernels over a bf16 cache
    assert both.rows > 0 and both.mean_abs_diff <= FP8_MEAN_REL * top, both.line()
    assert both.max_abs_diff <= FP8_MAX_REL * top, both.line()
    # and it is the cache's: the bf16 cache is closer to HF
    assert bf16.mean_abs_diff < parity.mean_abs_diff, (bf16.line(), parity.line())
