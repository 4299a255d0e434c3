"""Run the example engine on a tiny random-weight model and check it against Hugging Face.

Examples (from the repository root)::

  python examples/engine/run.py --model llama                 # CPU, reference executor, fp32
  python examples/engine/run.py --model bart --page-size 1
  python examples/engine/run.py --model gpt-oss               # attention sinks
  python examples/engine/run.py --model llama4                # chunked attention
  python examples/engine/run.py --model embeddinggemma        # encoder-only: one packed pass
  python examples/engine/run.py --model llama --kv-dtype fp8_e4m3  # fp8 KV cache, bf16 model
  python examples/engine/run.py --model llama --n 3 --temperature 0.8 --cascade on
                                                              # 3 samples per prompt, shared
  python examples/engine/run.py --model gemma2 --device cuda  # FlashInferExecutor, bf16
  python examples/engine/run.py --model gemma2 --executor twin  # FlashInferExecutor, CPU twin
  python examples/engine/run.py --model llama --plain-loop    # the plain step loop
  python examples/engine/run.py --model path/to/checkpoint    # from_pretrained, real weights
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

if __package__ in (None, ""):  # run as a script: make `examples.engine` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
try:
    import transformers  # noqa: F401
except ImportError:
    sys.exit("examples/engine needs transformers: pip install -e '.[test]' (it pins it)")

import flashplan as fp
from examples.engine.engine import Engine, Request, StepOutput, embed
from examples.engine.hf_models import TINY_CONFIGS, EncoderOnly, adapter_for, load_model
from examples.engine.parity import check_embed_parity, check_parity, reference_model

#: ``--kv-dtype`` choices (``None``: the model's dtype).
KV_DTYPES: dict[str, torch.dtype | None] = {
    "model": None,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}

#: Parity with HF's fp32 forward: (greedy near-tie margin in logits, logit tolerance
#: relative to the largest reference logit). fp32 checks absolutely (1e-4); a bf16 model
#: rounds its activations (measured: 1.4-1.8% of the largest logit on the tiny models).
#: An fp8 cache also rounds every cached K/V element (relative error up to 2**-4 for e4m3,
#: 2**-3 for e5m2, scale 1), which the logits carry through the layers: measured with the
#: seven tiny decoder models (2026-12-05, CPU, reference executor), 2.5-9.3% (e4m3) and
#: 5.4-21.9% (e5m2) of the largest logit, and greedy tokens that differ only where HF's two
#: best logits lie within 0.5 (e4m3) / 1.0 (e5m2). The exact semantics are checked
#: elsewhere (``tests/test_fp8.py``: the reference against float64 over the dequantized
#: cache); this is an end-to-end bound, empirical and stated.
TOLERANCES = {
    "fp32": (0.0, 0.0),
    "bf16": (0.25, 0.03),
    "fp8_e4m3": (0.5, 0.12),
    "fp8_e5m2": (1.0, 0.3),
}


#: ``--executor`` choices.
EXECUTORS = ("auto", "reference", "flashinfer", "twin")


def make_executor(
    device: torch.device, prefill_backend: str = "fa2", kind: str = "auto"
) -> fp.Executor:
    """The executor of ``kind``: ``"auto"`` is the reference executor on CPU and FlashInfer
    on CUDA (FA2 prefill: no slow FA3 builds); ``"twin"`` is the FlashInfer executor over
    flashplan's torch twin of FlashInfer (:data:`flashplan.twin.flashinfer_twin`), on any
    device, the CPU included."""
    if kind not in EXECUTORS:
        raise ValueError(f"executor must be one of {EXECUTORS}, not {kind!r}")
    if kind == "reference" or (kind == "auto" and device.type != "cuda"):
        return fp.ReferenceExecutor()
    from flashplan.executor.flashinfer import ExecutorPolicy, FlashInferExecutor

    policy = ExecutorPolicy(prefill_backend=prefill_backend)
    if kind == "twin":
        from flashplan.twin import flashinfer_twin

        return FlashInferExecutor(device, policy=policy, flashinfer=flashinfer_twin)
    return FlashInferExecutor(device, policy=policy)


def make_requests(
    vocab: int,
    encoder_decoder: bool,
    n: int,
    max_new_tokens: int,
    seed: int,
    *,
    samples: int = 1,
    temperature: float = 0.0,
) -> list[Request]:
    """``n`` requests with prompts of 1 to 40 tokens (long ones get chunked), each asking
    for ``samples`` samples at ``temperature``. Request ``i`` gets the sampling seed
    ``10_000 * seed + samples * i`` (its sample ``k``: that plus ``k``), so no two samples
    of a run share a seed."""
    rng = np.random.default_rng(seed)
    lens = [5, 37, 12, 1, 23, 3, 40, 9][:n] + list(rng.integers(1, 41, max(0, n - 8)))
    reqs = []
    for i, length in enumerate(lens):
        prompt = rng.integers(3, vocab, int(length)).tolist()
        new = max_new_tokens - i % 3
        source = None
        if encoder_decoder:  # the source to the encoder; a decoder prefix after BART's start 2
            prompt, source = [2, *prompt[: length // 2]], prompt
        sample_seed = 10_000 * seed + samples * i
        request = Request(prompt, new, encoder_prompt=source, n=samples)
        request.temperature, request.seed = temperature, sample_seed
        reqs.append(request)
    return reqs


def run_embed(
    adapter: EncoderOnly,
    executor: fp.Executor,
    ref: torch.nn.Module,
    prompts: list[list[int]],
    *,
    page_size: int,
    extend_path: str,
    fp32: bool,
) -> int:
    """An encoder-only model: every prompt in one packed pass (:func:`engine.embed`), each
    prompt's last hidden states compared with HF's forward of that prompt alone."""
    hidden = embed(adapter, executor, prompts, page_size=page_size, extend_path=extend_path)
    spec = executor.spec
    assert spec is not None
    print(f"one packed pass (extend, no prefix), prompts of {[len(p) for p in prompts]} tokens")
    for gp in spec.group_plans:
        print(f"  {gp.group.describe()}: {gp.path.value}")
    for i, h in enumerate(hidden):
        print(f"request {i}: hidden states {tuple(h.shape)}")
    parity = check_embed_parity(ref, prompts, hidden)
    print(parity.line())
    atol = 1e-4 if fp32 else 0.05 * parity.max_ref
    ok = parity.ok(atol)
    print(f"parity {'OK' if ok else 'FAILED'} (tolerance {atol:.1e})")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="llama", help=f"{', '.join(TINY_CONFIGS)} or a checkpoint")
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--executor", default="auto", choices=EXECUTORS,
        help="auto: the reference executor on CPU, FlashInfer on CUDA; twin: the FlashInfer "
        "executor over flashplan's torch twin of FlashInfer (runs on the CPU)",
    )  # fmt: skip
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--kv-tokens", type=int, default=384, help="KV cache size per layer")
    p.add_argument("--max-running", type=int, default=3)
    p.add_argument("--token-budget", type=int, default=16, help="new tokens per step")
    p.add_argument("--extend-path", default="auto", choices=["auto", "paged", "ragged"])
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n", type=int, default=1, help="samples per request (parallel sampling)")
    p.add_argument(
        "--temperature", type=float, default=0.0,
        help="sampling temperature (0: greedy); seeded from --seed, one generator per sample",
    )  # fmt: skip
    p.add_argument(
        "--cascade", default="auto", choices=["off", "on", "auto"],
        help="plan the decode steps of a request's samples with cascade levels over their "
        "shared prompt pages: never, always or where flashplan expects a gain",
    )  # fmt: skip
    p.add_argument(
        "--kv-dtype", default="model", choices=sorted(KV_DTYPES),
        help="KV cache dtype: the model's, or fp8 (K/V quantized with scale 1; the model runs "
        "in bf16, also on the CPU)",
    )  # fmt: skip
    p.add_argument(
        "--compile", action="store_true",
        help="run the model's forward under torch.compile (inductor; decoder-only models), "
        "attention through flashplan's custom op",
    )  # fmt: skip
    p.add_argument(
        "--plain-loop", dest="overlap", action="store_false",
        help="the plain step loop, which reads each step's sampled tokens back before "
        "planning the next (default: the overlapped loop, which plans and queues the next "
        "step first and reads this step's tokens one step late)",
    )  # fmt: skip
    args = p.parse_args(argv)

    device = torch.device(args.device)
    kv_dtype = KV_DTYPES[args.kv_dtype]
    # an fp8 cache takes fp16 / bf16 queries: the model runs in bf16 then
    dtype = torch.bfloat16 if device.type == "cuda" or kv_dtype else torch.float32
    model = load_model(args.model, dtype=dtype, device=device, seed=args.seed)
    ref = reference_model(model)  # fp32, HF eager attention, same weights
    adapter = adapter_for(model)
    fp32 = dtype == torch.float32  # bf16: tolerance, and HF near-ties may pick either token
    config: Any = model.config  # the model's PretrainedConfig
    if isinstance(adapter, EncoderOnly):  # no decoding: one packed pass of every prompt
        reqs = make_requests(config.vocab_size, False, args.requests, 1, args.seed)
        return run_embed(
            adapter, make_executor(device, kind=args.executor), ref, [r.prompt for r in reqs],
            page_size=args.page_size, extend_path=args.extend_path, fp32=fp32,
        )  # fmt: skip
    encdec = bool(config.is_encoder_decoder)
    if args.n > 1 and encdec:
        p.error("--n > 1 (parallel sampling) needs a decoder-only model")
    if args.compile and encdec:
        p.error("--compile needs a decoder-only model")
    engine = Engine(
        adapter,
        make_executor(device, kind=args.executor),
        page_size=args.page_size,
        num_pages=args.kv_tokens // args.page_size,
        max_running=max(args.max_running, args.n),  # rows for every sample of a request
        token_budget=args.token_budget,
        extend_path=args.extend_path,
        kv_dtype=kv_dtype,
        cascade=args.cascade,
        compile="inductor" if args.compile else None,
        overlap=args.overlap,
    )
    reqs = make_requests(
        config.vocab_size, encdec, args.requests, args.max_new_tokens, args.seed,
        samples=args.n, temperature=args.temperature,
    )  # fmt: skip
    steps: list[StepOutput] = []
    for out in engine.run(reqs):  # RuntimeError when none can be admitted: raise --kv-tokens
        steps.append(out)
        work = [f"r{r.rid} " + ("decode" if n == 1 else f"chunk {n}") for r, n in out.batch]
        if out.layout.encoder_cached is not None:  # requests joining: their encoder ran now
            joined = ~out.layout.encoder_cached
            work = [w + (" +encoder" if j else "") for w, j in zip(work, joined, strict=True)]
        if out.forked:
            work.append("forked " + " ".join(f"r{c.rid}" for c in out.forked))
        cascade = " cascade" if out.spec.cascade is not None else ""
        print(f"step {len(steps):2d} ({out.layout.mode.value}{cascade}): {', '.join(work)}")
    for r in reqs:
        src = f" (encoder {len(r.encoder_prompt)} tokens)" if r.encoder_prompt else ""
        if r.n == 1:
            print(f"request {r.rid}: prompt {len(r.prompt)} tokens{src} -> {r.output}")
            continue
        print(f"request {r.rid}: prompt {len(r.prompt)} tokens{src} -> {r.n} samples")
        for s in r.samples:
            seed = f", seed {s.seed}" if s.temperature > 0 else ""
            print(f"  sample {s.sample} (r{s.rid}{seed}): {s.output}")
    print(f"KV pages handed out again after being freed: {engine.allocator.reused}")
    print(f"steps planned with cascade levels: {engine.cascade_steps} of {len(steps)}")
    margin, rel = TOLERANCES["fp32" if fp32 else args.kv_dtype if kv_dtype else "bf16"]
    # every sample's logits; its tokens only when greedy (a drawn token is not HF's argmax)
    first_tokens = 0 if args.temperature > 0 else None
    samples = [s for r in reqs for s in r.samples]
    parity = check_parity(ref, samples, steps, first_tokens=first_tokens, tie_margin=margin)
    print(parity.line())
    atol = 1e-4 if fp32 else rel * parity.max_ref_logit
    ok = parity.ok(atol)
    print(f"parity {'OK' if ok else 'FAILED'} (tolerance {atol:.1e})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
