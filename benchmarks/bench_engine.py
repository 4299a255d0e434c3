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
    python3 benchmarks/bench_engine.py --parts overlap [--md OUT.md] [--json OUT.json]
    python3 benchmarks/bench_engine.py --parts fp8 [--md OUT.md] [--json OUT.json]
    python3 benchmarks/bench_engine.py --parts overlap,fp8 --device cpu  # CPU smoke run

The engine parts run the engine's default loop, the overlapped one (``--plain-loop``:
the plain loop); the rows of ``--json`` say which (``"loop"``).

``--parts overlap`` (issue 54): the plain and the overlapped step loop side by side
(``Engine(overlap=False)`` / ``Engine(overlap=True)``), with graphs (a bucket of the
batch), at each batch size: tokens/s over the whole run (prefill + decode; one warm-up
run of each loop first, then ``--repeat`` timed runs without events, the two loops
alternating, the median kept), and the GPU's idle time between decode steps, from one
more run of each loop whose every step's GPU work is bracketed by CUDA events
(``Engine.step_events``: one before the step's first copy, one before its forward or
replay, one after the copy of its sampled tokens). Idle is the gap from one decode
step's end event to the next decode step's start event, as a share of the step (start
to start): the summed gaps over the summed periods (the figure the targets use), and the
median of each pair's share; "to forward" also counts the next step's page-table copy
and apply before its replay; decode tok/s is the batch over the median step period (GPU
clock). The greedy tokens of both loops must be equal. Each row is checked against
issue 54's targets (:data:`OVERLAP_TARGETS`); ``--md`` writes the table, ``--json`` every
figure. ``--device cpu`` runs the same code on a tiny Llama over the FlashInfer twin,
without graphs and with host-clock marks in place of CUDA events (a smoke run: on the CPU
every op runs when called, nothing overlaps, and the targets do not apply).

``--parts fp8`` (issue 52): an fp8 e4m3 KV cache in the engine on the FlashInfer
executor with its default policy (:func:`fp8_parity`), against Hugging Face's fp32 eager
forward of each request alone and against the same engine over a bf16 cache: max and
mean |logit diff|, greedy agreement. The tiny models of ``--fp8-models`` (and ``bench``:
the model above, 8 prompts of 256 tokens, 32 new tokens, graphs) on a GPU; ``--device
cpu``: the tiny models over the twin.

``--tp N`` (issue 30): the model sharded over N GPUs (``examples.engine.tensor_parallel``,
one process per GPU over NCCL), the engine with graphs at the largest batch, against the
same engine on one GPU; and the time of a decode step's all-reduces (two per layer of
``[batch, hidden]`` bf16) timed alone, as a share of the step.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from transformers import AutoModelForCausalLM, LlamaConfig

from examples.engine.engine import Engine, Request, StepOutput
from examples.engine.hf_attention import ATTN_IMPLEMENTATION
from examples.engine.hf_models import DecoderOnly, adapter_for, load_model
from examples.engine.overlap import StepGaps, event_times, step_gaps
from examples.engine.parity import check_parity, compare_runs, reference_model
from examples.engine.run import make_executor, make_requests
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


def prompts(batch: int, length: int, seed: int = 1, vocab: int | None = None) -> list[list[int]]:
    """``batch`` prompts of ``length`` random tokens (of ``vocab``: the model above's)."""
    rng = np.random.default_rng(seed)
    return rng.integers(3, vocab or config().vocab_size, (batch, length)).tolist()


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_engine(
    model: torch.nn.Module | DecoderOnly,
    batch: int,
    prompt: int,
    new: int,
    graphs: bool,
    compile: str | None = None,
    overlap: bool = True,
    executor: str = "auto",
) -> Engine:
    """The benchmark's engine for ``batch`` requests of ``prompt + new`` tokens, with the
    benchmark's prompts queued (graphs: one bucket of ``batch``; ``overlap``: the
    overlapped step loop, else the plain one; ``executor``: ``run.make_executor``'s
    kind, ``"twin"`` on the CPU)."""
    adapter = model if isinstance(model, DecoderOnly) else adapter_for(model)
    width = -(-(prompt + new + 1) // PAGE)
    engine = Engine(
        adapter, make_executor(adapter.model.device, kind=executor), page_size=PAGE,
        num_pages=batch * width + 2, max_running=batch, token_budget=min(16384, batch * prompt),
        max_request_tokens=prompt + new + 1, cuda_graphs=(batch,) if graphs else (),
        compile=compile, overlap=overlap,
    )  # fmt: skip
    for p in prompts(batch, prompt, vocab=adapter.model.config.vocab_size):
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
            row["loop"] = "overlapped" if args.overlap else "plain"
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
    when the steps were bracketed by timing marks, the idle time between decode steps."""

    wall_s: float
    tokens: list[list[int]]
    gaps: StepGaps | None


def run_loop(
    model: torch.nn.Module,
    batch: int,
    prompt: int,
    new: int,
    overlap: bool,
    events: bool,
    *,
    graphs: bool = True,
    executor: str = "auto",
    freeze_gc: bool = False,
) -> LoopRun:
    """One run of the engine (``graphs``: a bucket of ``batch``), the overlapped or the
    plain loop; ``events``: every step's work bracketed by timing marks
    (``Engine.step_events``: CUDA events on a GPU, the host clock on the CPU), read into
    :class:`StepGaps` after the run; ``freeze_gc``: ``gc.freeze()`` after start-up."""
    engine = make_engine(model, batch, prompt, new, graphs, overlap=overlap, executor=executor)
    requests = list(engine.waiting)
    if events:
        engine.step_events = []
    if freeze_gc:
        gc.collect()
        gc.freeze()
    try:
        sync(engine.device)
        t0 = time.perf_counter()
        while engine.has_work():
            assert engine.step() is not None
        sync(engine.device)
        wall = time.perf_counter() - t0
    finally:
        if freeze_gc:
            gc.unfreeze()
    gaps = None
    if engine.step_events is not None:
        marks = engine.step_events
        gaps = step_gaps(event_times(marks), np.array([m.decode for m in marks]))
    return LoopRun(wall, [r.output for r in requests], gaps)


#: Issue 54's targets, per batch size: (the overlapped loop's idle share of a decode step
#: at most, its tokens/s over the plain loop's at least); ``None``: no idle target there.
#: Every batch: greedy tokens equal.
OVERLAP_TARGETS: dict[int, tuple[float | None, float]] = {
    1: (0.02, 1.05),
    8: (None, 1.0),
    64: (0.02, 1.0),
}


def overlap_targets(row: dict[str, Any]) -> dict[str, bool]:
    """Which of issue 54's targets a row of :func:`bench_overlap` meets (name -> met);
    a batch size the issue names no target for must at least not be slower."""
    idle, ratio = OVERLAP_TARGETS.get(int(row["batch"]), (None, 1.0))
    met = {"tokens equal": bool(row["tokens_equal"])}
    met[f"tok/s >= {ratio:.2f}x plain"] = row["tok_s_ratio"] >= ratio
    if idle is not None:
        met[f"idle <= {idle:.0%} of the step"] = row["overlapped"]["idle_share"] <= idle
    return met


def overlap_targets_text() -> str:
    """:data:`OVERLAP_TARGETS` in words."""
    parts = []
    for batch, (idle, ratio) in OVERLAP_TARGETS.items():
        words = [f"tok/s >= {ratio:.2f}x plain"]
        if idle is not None:
            words.append(f"idle <= {idle:.0%} of the step")
        parts.append(f"batch {batch}: " + ", ".join(words))
    return "; ".join(parts) + "; greedy tokens equal at every batch"


def loop_figures(batch: int, new: int, walls: list[float], gaps: StepGaps) -> dict[str, Any]:
    """One loop's figures at one batch size: the timed runs' median wall and tokens/s
    (``new`` tokens per request), the decode tokens/s of the marked run (the batch over
    the median step period) and its :class:`StepGaps`."""
    wall = float(np.median(walls))
    return {
        "wall_s": wall,
        "walls_s": walls,
        "tok_s": batch * new / wall,
        "decode_tok_s": batch * 1e3 / gaps.step_ms,
        **dataclasses.asdict(gaps),
    }


def overlap_table(rows: list[dict[str, Any]], title: str) -> list[str]:
    """:func:`bench_overlap`'s rows as a markdown table with a targets line. The first
    four columns (batch, plain tok/s, overlapped tok/s, ratio) are what
    ``benchmarks/run_gpu.py --parts overlap`` reads."""
    lines = [
        "",
        title,
        "",
        "| batch | plain tok/s | overlapped tok/s | overlapped / plain "
        "| decode tok/s plain / overlapped | step ms plain / overlapped "
        "| idle share plain | idle share overlapped | idle µs (median) plain / overlapped "
        "| idle to forward share plain / overlapped | tokens equal | targets |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p, o = r["plain"], r["overlapped"]
        missed = [name for name, ok in r["targets"].items() if not ok]
        lines.append(
            f"| {r['batch']} | {p['tok_s']:.0f} | {o['tok_s']:.0f} | {r['tok_s_ratio']:.3f}x "
            f"| {p['decode_tok_s']:.0f} / {o['decode_tok_s']:.0f} "
            f"| {p['step_ms']:.3f} / {o['step_ms']:.3f} "
            f"| {p['idle_share']:.1%} ({p['idle_share_median']:.1%}) "
            f"| {o['idle_share']:.1%} ({o['idle_share_median']:.1%}) "
            f"| {p['idle_us']:.0f} / {o['idle_us']:.0f} "
            f"| {p['to_forward_share']:.1%} / {o['to_forward_share']:.1%} "
            f"| {r['tokens_equal']} | {'met' if not missed else 'missed: ' + ', '.join(missed)} |"
        )
    return lines


def bench_overlap(args: argparse.Namespace) -> tuple[list[str], dict[str, Any]]:
    """``--parts overlap``: the plain and the overlapped loop side by side, with graphs,
    at each batch size (see the module docstring); the table's lines (or a line saying
    why not) and every figure (``--json``'s ``"overlap"``). ``args.device``: ``"cuda"``
    (the model above, the FlashInfer executor, graphs, CUDA events) or ``"cpu"`` (the
    smoke run: a tiny Llama over the twin, no graphs, the host clock)."""
    device = torch.device(getattr(args, "device", "cuda"))
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        line = "overlapped vs plain step loop: skipped (no CUDA device; --device cpu: smoke run)"
        return ["", line], {"skipped": "no CUDA device"}
    if cuda:
        model = build(ATTN_IMPLEMENTATION, device)
        kind, card = "auto", torch.cuda.get_device_name(device)
        what = (
            "Llama-shaped ~1.5B bf16 (16 layers, 2048 hidden, 32/8 heads x 128), "
            "FlashInferExecutor (FA2 prefill), CUDA graphs (a bucket of the batch), CUDA events"
        )
    else:
        model = load_model("llama", device=device)
        kind, card = "twin", "CPU"
        what = (
            "SMOKE RUN: tiny Llama (2 layers, hidden 128, fp32), FlashInferExecutor over the "
            "CPU twin, no graphs, host-clock marks (every op runs when called: nothing "
            "overlaps; not the targets' measurement)"
        )
    repeat = max(1, int(getattr(args, "repeat", 3)))
    kw: dict[str, Any] = dict(
        graphs=cuda, executor=kind, freeze_gc=bool(getattr(args, "freeze_gc", False))
    )
    rows: list[dict[str, Any]] = []
    for batch in args.batches:
        walls: dict[bool, list[float]] = {False: [], True: []}
        tokens: dict[bool, list[list[int]]] = {}
        for overlap in (False, True):  # warm-up
            run_loop(model, batch, args.prompt, args.new, overlap, False, **kw)
        for _ in range(repeat):  # the two loops alternate
            for overlap in (False, True):
                r = run_loop(model, batch, args.prompt, args.new, overlap, False, **kw)
                walls[overlap].append(r.wall_s)
                if tokens.setdefault(overlap, r.tokens) != r.tokens:
                    raise AssertionError(f"batch {batch}: two runs of one loop differ")
        figures = {}
        for overlap in (False, True):
            marked = run_loop(model, batch, args.prompt, args.new, overlap, True, **kw)
            assert marked.gaps is not None
            figures[overlap] = loop_figures(batch, args.new, walls[overlap], marked.gaps)
            name = "overlapped" if overlap else "plain"
            print(f"batch {batch} {name}: {figures[overlap]}", flush=True)
        row: dict[str, Any] = {
            "batch": batch,
            "plain": figures[False],
            "overlapped": figures[True],
            "tok_s_ratio": figures[True]["tok_s"] / figures[False]["tok_s"],
            "decode_tok_s_ratio": figures[True]["decode_tok_s"] / figures[False]["decode_tok_s"],
            "tokens_equal": tokens[False] == tokens[True],
        }
        row["targets"] = overlap_targets(row)
        rows.append(row)
        if cuda:
            torch.cuda.empty_cache()
    title = (
        f"overlapped vs plain step loop, {card}, {what}; prompts {args.prompt}, {args.new} "
        f"new tokens; tok/s: median of {repeat} timed runs (prefill + decode); decode tok/s: "
        "the batch over the median decode step (start to start); idle: time from a decode "
        "step's end mark to the next one's start mark over the step (summed, and in brackets "
        "the median of each step's share)"
    )
    lines = overlap_table(rows, title)
    met = all(all(r["targets"].values()) for r in rows)
    verdict = "all met" if met else "NOT all met"
    if not cuda:
        verdict += " (CPU smoke run: the targets are for a GPU with graphs)"
    lines += ["", f"issue 54's targets ({overlap_targets_text()}): {verdict}"]
    result = {
        "device": card,
        "setup": what,
        "prompt": args.prompt,
        "new": args.new,
        "repeat": repeat,
        "graphs": cuda,
        "rows": rows,
        "targets_met": met,
    }
    return lines, result


# -- an fp8 KV cache in the engine vs Hugging Face (issue 52) -------------------------------
#: The tiny models ``--parts fp8`` runs by default (``bench``: the model above, CUDA only):
#: a full-attention Llama, Mistral's window, Gemma 2's soft cap (no XQA: FA2), gpt-oss's
#: sinks over windows.
FP8_MODELS = ("llama", "mistral", "gemma2", "gpt-oss", "bench")


def default_policy_executor(device: torch.device) -> Any:
    """The FlashInfer executor with its default policy (``ExecutorPolicy()``): on a GPU,
    FlashInfer; elsewhere its CPU twin."""
    from flashplan.executor.flashinfer import FlashInferExecutor

    if device.type == "cuda":
        return FlashInferExecutor(device)
    from flashplan.twin import flashinfer_twin

    return FlashInferExecutor(device, flashinfer=flashinfer_twin)


def fp8_parity(
    model: torch.nn.Module,
    make_reqs: Callable[[], list[Request]],
    engine_kw: dict[str, Any],
    *,
    kv_dtype: torch.dtype = torch.float8_e4m3fn,
    ref: torch.nn.Module | None = None,
) -> dict[str, Any]:
    """The engine over a ``kv_dtype`` cache and over the model's dtype (bf16), each on a
    fresh FlashInfer executor with its default policy, the same requests
    (``make_reqs()``, made anew per run; ``engine_kw``: the rest of ``Engine``'s
    arguments), every logits row kept: each run against HF's fp32 eager forward of every
    request alone (``ref``: :func:`reference_model`'s copy; made when ``None``), and the
    fp8 run against the bf16 one (:func:`parity.compare_runs`). Greedy tokens: equal to
    HF's argmax, or not, and then whether HF's top two logits there are within twice
    the run's max |logit diff| (the most that diff can move two logits apart: a
    "numerical tie"; a token differing outside it is an error, not rounding)."""
    device = next(model.parameters()).device
    ref = reference_model(model) if ref is None else ref
    runs: dict[str, tuple[list[Request], list[StepOutput]]] = {}
    out: dict[str, Any] = {}
    for key, dtype in (("bf16 cache", None), ("fp8 cache", kv_dtype)):
        executor = default_policy_executor(device)
        engine = Engine(
            adapter_for(model), executor, kv_dtype=dtype, keep_all_logits=True, **engine_kw
        )
        reqs = make_reqs()
        steps = list(engine.run(reqs))
        runs[key] = (reqs, steps)
        first = check_parity(ref, reqs, steps, tie_margin=float("inf"))  # every difference
        top = first.max_ref_logit
        second = check_parity(ref, reqs, steps, tie_margin=2 * first.max_abs_diff)
        out[key] = {
            "cache_dtype": str(engine.ctx.kv_caches[0].dtype),
            "policy": repr(getattr(executor, "policy", None)),
            "max_abs_diff": first.max_abs_diff,
            "max_rel_diff": first.max_abs_diff / top,
            "mean_abs_diff": first.mean_abs_diff,
            "mean_rel_diff": first.mean_abs_diff / top,
            "max_ref_logit": top,
            "rows": first.rows,
            "tokens": first.tokens,
            "tokens_equal_hf": first.tokens - first.ties,
            "numerical_ties": second.ties,
            "mismatches": len(second.mismatches),
            "replayed_steps": engine.replayed_steps,
            "steps": len(steps),
        }
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    diff = compare_runs(*runs["fp8 cache"], *runs["bf16 cache"])
    out["fp8 vs bf16 cache"] = dataclasses.asdict(diff) | {
        "max_rel_diff": diff.max_abs_diff / out["fp8 cache"]["max_ref_logit"],
        "mean_rel_diff": diff.mean_abs_diff / out["fp8 cache"]["max_ref_logit"],
    }
    return out


def bench_fp8(args: argparse.Namespace) -> tuple[list[str], dict[str, Any]]:
    """``--parts fp8``: :func:`fp8_parity` per model of ``args.fp8_models`` on
    ``args.device``; the table's lines and every figure (``--json``'s ``"fp8"``). A model
    that fails is reported, the others still run."""
    device = torch.device(getattr(args, "device", "cuda"))
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        return ["", "fp8 KV cache parity: skipped (no CUDA device)"], {"skipped": "no CUDA"}
    card = torch.cuda.get_device_name(device) if cuda else "CPU (FlashInfer twin)"
    results: dict[str, Any] = {}
    for name in args.fp8_models:
        try:
            if name == "bench":
                if not cuda:
                    continue
                model = build(ATTN_IMPLEMENTATION, device)
                vocab = config().vocab_size

                def make_reqs(v: int = vocab) -> list[Request]:
                    return [Request(p, 32) for p in prompts(8, 256, seed=3, vocab=v)]

                kw: dict[str, Any] = dict(
                    page_size=PAGE, num_pages=8 * 19 + 2, max_running=8, token_budget=2048,
                    max_request_tokens=289, cuda_graphs=(8,),
                )  # fmt: skip
            else:
                model = load_model(name, dtype=torch.bfloat16, device=device)
                vocab = model.config.vocab_size

                def make_reqs(v: int = vocab) -> list[Request]:
                    return make_requests(v, False, 6, 16, 0)

                kw = dict(page_size=16, num_pages=24, max_running=3, token_budget=16)
            results[name] = fp8_parity(model, make_reqs, kw)
        except Exception as exc:  # reported; the other models still run
            print(f"fp8 parity {name} failed: {exc!r}", flush=True)
            results[name] = {"error": repr(exc)[:300]}
        else:
            print(f"fp8 parity {name}: {results[name]}", flush=True)
        finally:
            if cuda:
                torch.cuda.empty_cache()
    lines = [
        "",
        f"fp8 e4m3 KV cache (scales 1.0) vs a bf16 cache in the engine, {card}, bf16 model, "
        "the FlashInfer executor's default policy, every logits row vs HF's fp32 eager "
        "forward of each request alone (tiny models: 6 requests of 1-40 prompt tokens, 16 "
        "new, 3 at a time; bench: the model above, 8 x 256 prompt tokens, 32 new, graphs). "
        "% : of max |HF logit|. Greedy: tokens equal to HF's argmax (numerical ties: HF's "
        "top two within 2x the run's max diff; mismatches: beyond it)",
        "",
        "| model | cache | max abs diff vs HF | mean abs diff vs HF | greedy = HF "
        "| numerical ties / mismatches | fp8 vs bf16 cache: max / mean abs diff "
        "| tokens equal to the bf16 run (until the first difference) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, res in results.items():
        if "error" in res:
            lines.append(f"| {name} | failed: {res['error']} | | | | | | |")
            continue
        d = res["fp8 vs bf16 cache"]
        for key in ("bf16 cache", "fp8 cache"):
            r = res[key]
            vs_bf16 = (
                f"{d['max_abs_diff']:.3f} ({d['max_rel_diff']:.1%}) / "
                f"{d['mean_abs_diff']:.4f} ({d['mean_rel_diff']:.2%})"
                if key == "fp8 cache"
                else ""
            )
            same = f"{d['same_prefix']}/{d['tokens']}" if key == "fp8 cache" else ""
            lines.append(
                f"| {name} | {r['cache_dtype'].removeprefix('torch.')} "
                f"| {r['max_abs_diff']:.3f} ({r['max_rel_diff']:.1%}) "
                f"| {r['mean_abs_diff']:.4f} ({r['mean_rel_diff']:.2%}) "
                f"| {r['tokens_equal_hf']}/{r['tokens']} "
                f"| {r['numerical_ties']} / {r['mismatches']} | {vs_bf16} | {same} |"
            )
    return lines, {"device": card, "models": results}


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
        run_engine(adapter, batch, args.prompt, 8, True, overlap=args.overlap)  # warm-up
        r = run_engine(adapter, batch, args.prompt, args.new, True, overlap=args.overlap)
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
    run_engine(model, batch, args.prompt, 8, True, overlap=args.overlap)
    one = run_engine(model, batch, args.prompt, args.new, True, overlap=args.overlap)
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
    loop = "overlapped" if args.overlap else "plain"
    lines = [
        f"engine vs HF, {torch.cuda.get_device_name()}, Llama-shaped ~1.5B bf16 (16 layers, "
        f"2048 hidden, 32/8 heads x 128), prompts {args.prompt}, {args.new} new tokens, "
        f"page {PAGE}, the engine's {loop} step loop",
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


#: ``--parts`` names.
PARTS = ("engine", "hf", "spec", "overlap", "fp8")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 64])
    ap.add_argument(
        "--prompt", type=int, default=None, help="prompt tokens (default: 1024; cpu: 16)"
    )
    ap.add_argument("--new", type=int, default=None, help="new tokens (default: 128; cpu: 8)")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument(
        "--spec-damp", type=float, default=0.01,
        help="--parts spec: scale of the target's layers past the draft's (1.0: none)",
    )  # fmt: skip
    ap.add_argument("--parts", default="engine,hf,spec", help=f"of {', '.join(PARTS)}")
    ap.add_argument(
        "--device", default="cuda", choices=("cuda", "cpu"),
        help="cpu: a smoke run of the overlap and fp8 parts on tiny models over the "
        "FlashInfer twin (no graphs, host-clock marks)",
    )  # fmt: skip
    ap.add_argument(
        "--repeat", type=int, default=3,
        help="--parts overlap: timed runs of each loop per batch size (median kept)",
    )  # fmt: skip
    ap.add_argument(
        "--fp8-models", type=lambda s: s.split(","), default=list(FP8_MODELS),
        help=f"--parts fp8: tiny model names, and 'bench' (the model above, CUDA only); "
        f"default {','.join(FP8_MODELS)}",
    )  # fmt: skip
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
        "--plain-loop", dest="overlap", action="store_false",
        help="the engine parts (engine, --tp) with the plain step loop (default: the "
        "engine's default, the overlapped loop)",
    )  # fmt: skip
    ap.add_argument("--md", type=Path)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    parts = set(args.parts.split(",")) - {"none", ""}
    if parts - set(PARTS):
        ap.error(f"unknown parts {sorted(parts - set(PARTS))}: choose from {', '.join(PARTS)}")
    cpu = args.device == "cpu"
    if cpu and (parts - {"overlap", "fp8"} or args.tp):
        ap.error("--device cpu runs the overlap and fp8 parts only")
    if args.prompt is None:
        args.prompt = 16 if cpu else 1024
    if args.new is None:
        args.new = 8 if cpu else 128
    out: dict[str, object] = {}
    lines: list[str] = []
    if parts & {"engine", "hf"}:
        rows = bench_engine_and_hf(args, parts)
        out["rows"] = rows
        lines += table(rows, args)
    if args.tp:
        lines += bench_tp(args)
    if "overlap" in parts:
        overlap_lines, out["overlap"] = bench_overlap(args)
        lines += overlap_lines
    if "fp8" in parts:
        fp8_lines, out["fp8"] = bench_fp8(args)
        lines += fp8_lines
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
