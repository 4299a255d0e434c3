#!/usr/bin/env python3
"""Where a decode step of the example engine spends its time on the GPU (issue 29).

The model and engine of ``bench_engine.py`` (Llama-shaped ~1.5B, random bf16 weights,
page 16): ``--batch`` requests with ``--prompt``-token prompts are prefilled, then
``--steps`` decode steps are profiled, graphs on (or ``--eager``):

* wall ms per decode step (synchronized by the step's own sampling read-back), and the
  engine's host parts (layout, plan, apply or replay planning; µs per step);
* ``torch.profiler``: the GPU kernels of those steps by total time (top 25), their sum
  per step against the step's wall time (a step whose kernels sum to far less than its
  wall time is waiting on the host);
* ``cProfile`` of ``Engine.step`` over the same number of steps, by cumulative time
  (what the host does between replays: scheduling, the page table copy, planning,
  sampling and its read-back).

    python3 benchmarks/profile_engine.py [--batch 64] [--prompt 1024] [--steps 20]
        [--eager] [--compile] [--md OUT.md]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_engine import build, make_engine

from examples.engine.engine import Engine
from examples.engine.hf_attention import ATTN_IMPLEMENTATION


def engine_at_decode(
    batch: int, prompt: int, new: int, graphs: bool, compile: str | None = None
) -> Engine:
    """An engine whose requests are all prefilled (the next step decodes them all)."""
    engine = make_engine(build(ATTN_IMPLEMENTATION), batch, prompt, new, graphs, compile)
    while engine.decode_steps == 0:
        assert engine.step() is not None
    for _ in range(5):  # warm: the bucket's first replays, allocator
        engine.step()
    torch.cuda.synchronize()
    return engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--compile", action="store_true", help="the forward under torch.compile")
    ap.add_argument("--md", type=Path)
    args = ap.parse_args()
    steps = args.steps
    backend = "inductor" if args.compile else None
    engine = engine_at_decode(args.batch, args.prompt, 4 * steps + 16, not args.eager, backend)
    lines = [
        f"engine decode step profile, {torch.cuda.get_device_name()}, batch {args.batch}, "
        f"prompt {args.prompt}, {'eager' if args.eager else 'graphs'}"
        f"{', compiled' if args.compile else ''}, {steps} steps",
        "",
    ]

    # 1. wall time and the engine's host parts
    parts0 = dict(engine.decode_host_parts)
    n0 = engine.decode_steps
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / steps
    n = engine.decode_steps - n0
    parts = {k: (v - parts0.get(k, 0.0)) / n * 1e6 for k, v in engine.decode_host_parts.items()}
    lines.append(
        f"wall per decode step: {wall * 1e3:.3f} ms ({n} decode steps, "
        f"{engine.replayed_steps} replayed so far)"
    )
    lines.append(
        "flashplan host parts per step (µs): " + ", ".join(f"{k} {v:.1f}" for k, v in parts.items())
    )

    # 2. GPU kernels
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = [e for e in events if getattr(e, "self_device_time_total", 0) > 0]
    kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
    total_us = sum(e.self_device_time_total for e in kernels) / steps
    lines += [
        "",
        f"GPU time per step (sum of kernels and copies): {total_us / 1e3:.3f} ms "
        f"= {total_us / 1e3 / (wall * 1e3):.0%} of the wall step",
        "",
        "| kernel / op | µs per step | calls per step | share |",
        "|---|---|---|---|",
    ]
    for e in kernels[:25]:
        us = e.self_device_time_total / steps
        lines.append(f"| {e.key[:90]} | {us:.1f} | {e.count / steps:.1f} | {us / total_us:.1%} |")

    # 3. host
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("cumulative").print_stats(35)
    lines += ["", "cProfile of Engine.step (cumulative):", "```", buf.getvalue(), "```"]
    text = "\n".join(lines)
    print(text)
    if args.md:
        args.md.write_text(text + "\n")


if __name__ == "__main__":
    main()
