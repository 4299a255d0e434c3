#!/usr/bin/env python3
"""The example engine on a GPU against Hugging Face transformers (issue 29).

A Llama-shaped model of about 1.5B parameters with random bf16 weights (16 layers,
hidden 2048, 32 query / 8 KV heads x 128, MLP 8192, vocabulary 32000) decodes
``--new`` tokens (greedy, no EOS) after prompts of ``--prompt`` random tokens, for each
batch size:

  engine eager    ``examples.engine.Engine`` on the FlashInferExecutor (FA2 prefill),
                  every step eager (HF's modules, flashplan attention)
  engine graphs   the same engine with ``cuda_graphs=(batch,)``: decode steps replayed
                  from a CUDA graph captured at start-up
  engine compiled (``--compile``) the engine with graphs, its forward compiled by
                  ``torch.compile`` (inductor) with attention through flashplan's custom
                  op ``flashplan::run``: the norms, RoPE and activations fused
  HF static       ``model.generate(..., cache_implementation="static",
                  disable_compile=True)`` with sdpa attention, the same weights, the whole
                  batch in one padded tensor: HF's eager forward over a static cache
  HF compiled     (``--hf-compile``) the same without ``disable_compile``: transformers
                  then compiles the decoding forward itself (``torch.compile``; its
                  auto-compile for static caches on CUDA)

Every variant runs once at full length first (warm-up: HF's compilation and the
engine's graph capture are not timed). Run BF (before this) warmed HF up with 4 tokens
only, and transformers' auto-compile, on by default, compiled during the timed run.

Figures: wall seconds of the whole run (prefill + decode, synchronized), generated
tokens per second over it, decode-only tokens/s (the engine: the decode steps' wall
time; HF: the run minus a ``max_new_tokens=1`` run), and for the engine the share of a
decode step that is flashplan's host work (layout + plan + apply, or a bucket's replay
planning; ``Engine.decode_host_s``): the sum's mean per step, and the per-step median
(``Engine.decode_host_samples``), both over the mean decode step. A mean well above the
median is a few slow steps (a garbage collection, a page-table regrowth) landing inside
the timers; ``--freeze-gc`` freezes the start-up objects out of the collector's scans,
as serving engines do. One warm-up run of each first.

``--parts spec``: speculative decoding at batch 1 (``examples.engine.speculative``,
eager, FlashInfer): a chain of ``--k`` drafts from a draft model made of the target's
first 2 layers (same vocabulary and embeddings), against the target's plain greedy
decode; tokens equal, acceptance and speed-up reported. With random weights such a draft
never agrees with its target (acceptance 0.0 on the CPU box, 64-token prompt, 24
tokens): a random model's logits are near ties, which any further layer reorders. So the
target's layers past the draft's are damped: their output projections (``o_proj``,
``down_proj``) are scaled by ``--spec-damp`` (default 0.01), which keeps their cost and
makes the target's greedy tokens close to its first two layers', as a trained draft's
are to its target's (acceptance 0.79 on the CPU box at 0.01; 1.0 turns it off).

    python3 benchmarks/bench_engine.py [--batches 1,8,64] [--prompt 1024] [--new 128]
        [--parts engine,hf,spec] [--hf-compile] [--compile] [--spec-damp 0.01]
        [--md OUT.md] [--json OUT.json]
    python3 benchmarks/bench_engine.py --tp 2 --parts none --batches 64   # 2 GPUs, NCCL
    python3 benchmarks/bench_engine.py --parts overlap [--md OUT.md]      # issue 54

The engine parts run the engine's default loop, the plain one (``--overlap``: the
overlapped loop).

``--parts overlap`` (issue 54): the plain and the overlapped step loop side by side
(``Engine(overlap=False)`` / ``Engine(overlap=True)``), with graphs (a bucket of the
batch), at each batch size: tokens/s over the whole run (prefill + decode, one warm-up
run of each first, then a timed run without events), and the GPU's idle time between
decode steps, from a third run whose every step's GPU work is bracketed by CUDA events
(``Engine.step_events``: one before the step's first copy, one before its forward or
replay, one after the copy of its sampled tokens). Idle is the gap from one decode step's
end event to the next decode step's start event, as a share of the step (start to
start): the summed gaps over the summed periods, and the median of each pair's share;
"to forward" also counts the next step's page-table copy and apply before its replay.
The greedy tokens of both loops must be equal. Without CUDA the part is skipped.

``--tp N`` (issue 30): the model sharded over N GPUs (``examples.engine.tensor_parallel``,
one process per GPU over NCCL), the engine with graphs at the largest batch, against the
same engine on one GPU; and the time of a decode step's all-reduces (two per layer of
``[batch, hidden]`` bf16) timed alone, as a share of the step.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from transformers import AutoModelForCausalLM, LlamaConfig

from examples.engine.engine import Engine, Request
from examples.engine.hf_attention import ATTN_IMPLEMENTATION
from examples.engine.hf_models import DecoderOnly, adapter_for
from examples.engine.overlap import StepGaps, event_times, step_gaps
from examples.engine.run import make_executor
from examples.engine.speculative import (
    draft_from,
    greedy_decode,
    speculative_decode,
)

DEV = torch.device("cuda")
PAGE = 16


def config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=4096, rope_theta=500000.0, tie_word_embeddings=False,
    )  # fmt: skip


def build(attn: str, device: torch.device | None = None) -> torch.nn.Module:
    """The model with seeded random bf16 weights, made on ``device`` (default: GPU 0)."""
    torch.manual_seed(0)
    with torch.device(device or DEV):
        model = AutoModelForCausalLM.from_config(
            config(), attn_implementation=attn, dtype=torch.bfloat16
        )
    return model.eval()


def prompts(batch: int, length: int, seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(3, config().vocab_size, (batch, length)).tolist()


def make_engine(
    model: torch.nn.Module | DecoderOnly,
    batch: int,
    prompt: int,
    new: int,
    graphs: bool,
    compile: str | None = None,
    overlap: bool = True,
) -> Engine:
    """The benchmark's engine for ``batch`` requests of ``prompt + new`` tokens, with the
    benchmark's prompts queued (graphs: one bucket of ``batch``; ``overlap``: the
    overlapped step loop, else the plain one)."""
    adapter = model if isinstance(model, DecoderOnly) else adapter_for(model)
    width = -(-(prompt + new + 1) // PAGE)
    engine = Engine(
        adapter, make_executor(adapter.model.device), page_size=PAGE,
        num_pages=batch * width + 2, max_running=batch, token_budget=min(16384, batch * prompt),
        max_request_tokens=prompt + new + 1, cuda_graphs=(batch,) if graphs else (),
        compile=compile, overlap=overlap,
    )  # fmt: skip
    for p in prompts(batch, prompt):
        engine.add(Request(p, new))
    return engine


def run_engine(
    model: torch.nn.Module | DecoderOnly,
    batch: int,
    prompt: int,
    new: int,
    graphs: bool,
    compile: str | None = None,
    freeze_gc: bool = False,
    overlap: bool = True,
) -> dict[str, float]:
    """One engine run: wall s, decode wall s, decode steps, flashplan's decode host s
    (sums, and per step: medians and the largest). ``freeze_gc``: ``gc.freeze()`` after
    start-up; ``overlap``: the overlapped step loop, else the plain one."""
    engine = make_engine(model, batch, prompt, new, graphs, compile, overlap)
    if freeze_gc:  # what serving engines do after start-up (vLLM, SGLang): the objects
        gc.collect()  # made so far (model, graphs, the queued requests) are never
        gc.freeze()  # scanned again by the cyclic collector
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        decode_start = None
        while engine.has_work():
            before, start = engine.decode_steps, time.perf_counter()
            assert engine.step() is not None
            if engine.decode_steps > before and decode_start is None:
                decode_start = start  # the first step of decodes alone
        torch.cuda.synchronize()
        end = time.perf_counter()
    finally:  # a failed variant (reported, the others run on) leaves the collector as it was
        if freeze_gc:
            gc.unfreeze()
    assert decode_start is not None
    samples = np.array(engine.decode_host_samples).reshape(-1, 3) * 1e6
    return {
        "wall_s": end - t0,
        "decode_s": end - decode_start,
        "decode_steps": engine.decode_steps,
        "host_s": engine.decode_host_s,
        # µs per decode step of each part of flashplan's host work
        "host_parts_us": {
            k: v / max(engine.decode_steps, 1) * 1e6 for k, v in engine.decode_host_parts.items()
        },
        "replayed": engine.replayed_steps,
        # per step, µs: the median of each part, and of their sum, and the sum's largest
        "host_parts_median_us": dict(
            zip(("layout", "plan", "apply"), np.median(samples, axis=0).tolist(), strict=True)
        ),
        "host_median_us": float(np.median(samples.sum(axis=1))),
        "host_max_us": float(samples.sum(axis=1).max()),
    }


def run_hf(
    model: torch.nn.Module, batch: int, prompt: int, new: int, *, compiled: bool = False
) -> float:
    """Wall seconds of one ``generate`` with a static cache, greedy, exactly ``new``
    tokens; ``compiled``: transformers' own auto-compile of the forward left on."""
    ids = torch.tensor(prompts(batch, prompt), device=DEV)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
        do_sample=False, cache_implementation="static", pad_token_id=0,
        disable_compile=not compiled,
    )  # fmt: skip
    torch.cuda.synchronize()
    assert out.shape[1] == prompt + new
    return time.perf_counter() - t0


def bench_engine_and_hf(args: argparse.Namespace, parts: set[str]) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    fp_model = build(ATTN_IMPLEMENTATION) if "engine" in parts else None
    hf_model = build("sdpa") if "hf" in parts else None
    for batch in args.batches:
        row: dict[str, object] = {"batch": batch}
        tokens = batch * args.new
        if fp_model is not None:
            variants = [("eager", False, None), ("graphs", True, None)]
            if args.compile:
                variants.append(("compiled", True, "inductor"))
            for key, graphs, backend in variants:
                try:
                    run_engine(  # warm-up
                        fp_model, batch, args.prompt, args.new, graphs, backend,
                        overlap=args.overlap,
                    )  # fmt: skip
                    r = run_engine(
                        fp_model, batch, args.prompt, args.new, graphs, backend,
                        freeze_gc=args.freeze_gc, overlap=args.overlap,
                    )  # fmt: skip
                except Exception as exc:  # reported; the other variants still run
                    if backend is None:
                        raise
                    print(f"batch {batch} engine {key} failed: {exc!r}", flush=True)
                    row[f"{key}_error"] = repr(exc)[:300]
                    continue
                row[f"{key}_tok_s"] = tokens / r["wall_s"]
                row[f"{key}_decode_tok_s"] = batch * r["decode_steps"] / r["decode_s"]
                step = r["decode_s"] / r["decode_steps"]
                row[f"{key}_step_ms"] = step * 1e3
                row[f"{key}_host_share"] = r["host_s"] / r["decode_steps"] / step
                row[f"{key}_host_parts_us"] = r["host_parts_us"]
                row[f"{key}_host_median_share"] = r["host_median_us"] * 1e-6 / step
                row[f"{key}_host_parts_median_us"] = r["host_parts_median_us"]
                row[f"{key}_replayed"] = r["replayed"]
                print(f"batch {batch} engine {key}: {r}", flush=True)
        for compiled in (False, True) if hf_model is not None else ():
            if compiled and not args.hf_compile:
                continue
            key = "hfc" if compiled else "hf"
            run_hf(hf_model, batch, args.prompt, args.new, compiled=compiled)  # warm-up
            run_hf(hf_model, batch, args.prompt, 1, compiled=compiled)
            wall = run_hf(hf_model, batch, args.prompt, args.new, compiled=compiled)
            prefill = run_hf(hf_model, batch, args.prompt, 1, compiled=compiled)
            row[f"{key}_tok_s"] = tokens / wall
            row[f"{key}_decode_tok_s"] = batch * (args.new - 1) / max(wall - prefill, 1e-9)
            row[f"{key}_step_ms"] = (wall - prefill) / (args.new - 1) * 1e3
            print(f"batch {batch} {key}: wall {wall:.3f} s, prefill {prefill:.3f} s", flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
    return rows


@dataclass
class LoopRun:
    """One run of :func:`run_loop`: wall seconds, each request's generated tokens and,
    when the steps were bracketed by CUDA events, the idle time between decode steps."""

    wall_s: float
    tokens: list[list[int]]
    gaps: StepGaps | None


def run_loop(
    model: torch.nn.Module, batch: int, prompt: int, new: int, overlap: bool, events: bool
) -> LoopRun:
    """One run of the engine with graphs (a bucket of ``batch``), the overlapped or the
    plain loop; ``events``: every step's GPU work bracketed by CUDA events
    (``Engine.step_events``), read into :class:`StepGaps` after the run."""
    engine = make_engine(model, batch, prompt, new, True, overlap=overlap)
    requests = list(engine.waiting)
    if events:
        engine.step_events = []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while engine.has_work():
        assert engine.step() is not None
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    gaps = None
    if engine.step_events is not None:
        marks = engine.step_events
        gaps = step_gaps(event_times(marks), np.array([m.decode for m in marks]))
    return LoopRun(wall, [r.output for r in requests], gaps)


def bench_overlap(args: argparse.Namespace) -> list[str]:
    """``--parts overlap``: the plain and the overlapped loop side by side, with graphs,
    at each batch size (see the module docstring); a table, or a line saying why not."""
    if not torch.cuda.is_available():
        return ["", "overlapped vs plain step loop: skipped (no CUDA device)"]
    model = build(ATTN_IMPLEMENTATION)
    lines = [
        "",
        f"overlapped vs plain step loop, {torch.cuda.get_device_name()}, the model above, "
        f"prompts {args.prompt}, {args.new} new tokens, graphs (a bucket of the batch); idle: "
        "GPU time from a decode step's end event to the next one's start event, over the "
        "step (summed, and the median of each step's share)",
        "",
        "| batch | plain tok/s | overlapped tok/s | overlapped / plain "
        "| step ms plain / overlapped | idle share plain | idle share overlapped "
        "| idle µs (median) plain / overlapped | idle to forward share plain / overlapped "
        "| tokens equal |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for batch in args.batches:
        timed: dict[bool, LoopRun] = {}
        gaps: dict[bool, StepGaps] = {}
        for overlap in (False, True):
            name = "overlapped" if overlap else "plain"
            run_loop(model, batch, args.prompt, args.new, overlap, events=False)  # warm-up
            timed[overlap] = run_loop(model, batch, args.prompt, args.new, overlap, False)
            marked = run_loop(model, batch, args.prompt, args.new, overlap, events=True)
            assert marked.gaps is not None
            gaps[overlap] = marked.gaps
            print(f"batch {batch} {name}: {timed[overlap].wall_s:.3f} s, {marked.gaps}", flush=True)
        tok = {k: batch * args.new / v.wall_s for k, v in timed.items()}
        p, o = gaps[False], gaps[True]
        lines.append(
            f"| {batch} | {tok[False]:.0f} | {tok[True]:.0f} | {tok[True] / tok[False]:.3f}x "
            f"| {p.step_ms:.3f} / {o.step_ms:.3f} "
            f"| {p.idle_share:.1%} ({p.idle_share_median:.1%}) "
            f"| {o.idle_share:.1%} ({o.idle_share_median:.1%}) "
            f"| {p.idle_us:.0f} / {o.idle_us:.0f} "
            f"| {p.to_forward_share:.1%} / {o.to_forward_share:.1%} "
            f"| {timed[False].tokens == timed[True].tokens} |"
        )
        torch.cuda.empty_cache()
    return lines


def damp_past(model: torch.nn.Module, first: int, factor: float) -> None:
    """Scale the output projections (``o_proj``, ``down_proj``) of ``model``'s layers
    from ``first`` on by ``factor``: their cost stays, their share of the residual
    stream shrinks (see the module docstring, ``--parts spec``)."""
    with torch.no_grad():
        for layer in model.model.layers[first:]:
            layer.self_attn.o_proj.weight.mul_(factor)
            layer.mlp.down_proj.weight.mul_(factor)


def bench_speculative(args: argparse.Namespace) -> dict[str, object]:
    model = build(ATTN_IMPLEMENTATION)
    damp_past(model, 2, args.spec_damp)
    target, draft = adapter_for(model), draft_from(model, num_layers=2)
    ps = prompts(1, args.prompt, seed=2)
    greedy_decode(target, ps, 4)  # warm-up
    speculative_decode(target, draft, ps, 4, args.k)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    plain = greedy_decode(target, ps, args.new)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    spec = speculative_decode(target, draft, ps, args.new, args.k)
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    # bf16 on the GPU: the verify (prefill) and decode kernels round differently, so a
    # near-tie of a random model's logits may break the other way (fp32 on the CPU: equal)
    first_diff = next(  # batch 1: the one request's tokens
        (i for i, (a, b) in enumerate(zip(spec.tokens[0], plain[0], strict=False)) if a != b),
        None,
    )
    return {
        "plain_s": t1 - t0, "spec_s": t2 - t1, "speedup": (t1 - t0) / (t2 - t1),
        "acceptance": spec.acceptance, "rounds": spec.rounds,
        "tokens_equal": spec.tokens == plain, "first_diff": first_diff,
        "tokens": len(plain[0]), "damp": args.spec_damp,
    }  # fmt: skip


def tp_worker(rank: int, world: int, init: str, args: argparse.Namespace, out: str) -> None:
    """One rank of ``--tp``: the model sharded over ``world`` GPUs (NCCL), the engine with
    graphs at ``args.batches[-1]``; rank 0 also times the step's all-reduces alone."""
    import torch.distributed as dist

    from examples.engine.tensor_parallel import shard_decoder_only

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        dev = torch.device("cuda", rank)
        adapter = shard_decoder_only(adapter_for(build(ATTN_IMPLEMENTATION, dev)), rank, world)
        batch = args.batches[-1]
        run_engine(adapter, batch, args.prompt, 8, True)  # warm-up
        r = run_engine(adapter, batch, args.prompt, args.new, True)
        # the all-reduces of one decode step alone: two per layer of [batch, hidden] bf16
        c = config()
        x = torch.randn(batch, c.hidden_size, device=dev, dtype=torch.bfloat16)
        for _ in range(10):
            dist.all_reduce(x)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(20):
            start.record()
            for _ in range(2 * c.num_hidden_layers):
                dist.all_reduce(x)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        if rank == 0:
            r["all_reduce_ms"] = float(np.median(times))
            torch.save(r, out)
    finally:
        dist.destroy_process_group()


def bench_tp(args: argparse.Namespace) -> list[str]:
    """``--tp N``: tokens/s of the engine (graphs) at the largest batch on N GPUs against
    one GPU, and the all-reduce share of a decode step."""
    import tempfile

    import torch.multiprocessing as mp

    batch = args.batches[-1]
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/tp.pt"
        mp.spawn(tp_worker, args=(args.tp, f"{tmp}/rendezvous", args, out), nprocs=args.tp)
        tp = torch.load(out)
    model = build(ATTN_IMPLEMENTATION)
    run_engine(model, batch, args.prompt, 8, True)
    one = run_engine(model, batch, args.prompt, args.new, True)
    tok = lambda r: batch * args.new / r["wall_s"]  # noqa: E731
    step = tp["decode_s"] / tp["decode_steps"] * 1e3
    return [
        "",
        f"tensor parallel, batch {batch}, graphs: {args.tp} GPUs {tok(tp):.0f} tok/s, 1 GPU "
        f"{tok(one):.0f} tok/s ({tok(tp) / tok(one):.2f}x); decode step {step:.2f} ms on "
        f"{args.tp} GPUs, of which all-reduces {tp['all_reduce_ms']:.2f} ms "
        f"({tp['all_reduce_ms'] / step:.0%}, timed alone)",
    ]


def table(rows: list[dict[str, object]], args: argparse.Namespace) -> list[str]:
    f = lambda r, k, fmt: "" if k not in r else format(r[k], fmt)  # noqa: E731
    lines = [
        f"engine vs HF, {torch.cuda.get_device_name()}, Llama-shaped ~1.5B bf16 (16 layers, "
        f"2048 hidden, 32/8 heads x 128), prompts {args.prompt}, {args.new} new tokens, "
        f"page {PAGE}",
        "",
        "| batch | engine eager tok/s | engine graphs tok/s | HF static tok/s | graphs / HF "
        "| eager / HF | decode tok/s eager / graphs / HF | step ms eager / graphs / HF "
        "| flashplan host share eager / graphs | HF compiled tok/s | graphs / HF compiled "
        "| engine compiled+graphs tok/s | compiled / HF | compiled / HF compiled "
        "| compiled decode tok/s, step ms, host share "
        "| host share, per-step median: graphs / compiled |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = lambda k, base="hf_tok_s": (  # noqa: E731
            f"{r[k] / r[base]:.2f}x" if k in r and base in r else ""
        )
        lines.append(
            f"| {r['batch']} | {f(r, 'eager_tok_s', '.0f')} | {f(r, 'graphs_tok_s', '.0f')} "
            f"| {f(r, 'hf_tok_s', '.0f')} | {ratio('graphs_tok_s')} | {ratio('eager_tok_s')} "
            f"| {f(r, 'eager_decode_tok_s', '.0f')} / {f(r, 'graphs_decode_tok_s', '.0f')} / "
            f"{f(r, 'hf_decode_tok_s', '.0f')} "
            f"| {f(r, 'eager_step_ms', '.2f')} / {f(r, 'graphs_step_ms', '.2f')} / "
            f"{f(r, 'hf_step_ms', '.2f')} "
            f"| {f(r, 'eager_host_share', '.1%')} / {f(r, 'graphs_host_share', '.1%')} "
            f"| {f(r, 'hfc_tok_s', '.0f')} | {ratio('graphs_tok_s', 'hfc_tok_s')} "
            f"| {f(r, 'compiled_tok_s', '.0f')} | {ratio('compiled_tok_s')} "
            f"| {ratio('compiled_tok_s', 'hfc_tok_s')} "
            f"| {f(r, 'compiled_decode_tok_s', '.0f')}, {f(r, 'compiled_step_ms', '.2f')}, "
            f"{f(r, 'compiled_host_share', '.1%')} "
            f"| {f(r, 'graphs_host_median_share', '.1%')} / "
            f"{f(r, 'compiled_host_median_share', '.1%')} |"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 64])
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument(
        "--spec-damp", type=float, default=0.01,
        help="--parts spec: scale of the target's layers past the draft's (1.0: none)",
    )  # fmt: skip
    ap.add_argument("--parts", default="engine,hf,spec", help="of engine, hf, spec, overlap")
    ap.add_argument("--hf-compile", action="store_true")
    ap.add_argument(
        "--freeze-gc", action="store_true", help="gc.freeze() after each engine's start-up, "
        "as serving engines do (the host-share columns then leave the collector's scans of "
        "start-up objects out)",
    )  # fmt: skip
    ap.add_argument(
        "--compile", action="store_true", help="also the engine with graphs over its forward "
        "compiled by torch.compile (inductor; attention through the custom op)",
    )  # fmt: skip
    ap.add_argument("--tp", type=int, default=0, help="tensor-parallel GPUs (the --tp part)")
    ap.add_argument(
        "--overlap", action="store_true",
        help="the engine parts with the overlapped step loop (default: the plain one)",
    )  # fmt: skip
    ap.add_argument("--md", type=Path)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    out: dict[str, object] = {}
    lines: list[str] = []
    if parts & {"engine", "hf"}:
        rows = bench_engine_and_hf(args, parts)
        out["rows"] = rows
        lines += table(rows, args)
    if args.tp:
        lines += bench_tp(args)
    if "overlap" in parts:
        lines += bench_overlap(args)
    if "spec" in parts:
        s = bench_speculative(args)
        out["speculative"] = s
        lines += [
            "",
            f"speculative decoding, batch 1, chain of {args.k} from a 2-layer draft (target "
            f"layers 2+ damped x{args.spec_damp}): plain "
            f"{s['plain_s']:.3f} s, speculative {s['spec_s']:.3f} s, speed-up "
            f"{s['speedup']:.2f}x, acceptance {s['acceptance']:.2f}, tokens equal: "
            f"{s['tokens_equal']} (first difference at token {s['first_diff']} of "
            f"{s['tokens']})",
        ]
    text = "\n".join(lines)
    print(text, flush=True)
    if args.md:
        args.md.write_text(text + "\n")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
