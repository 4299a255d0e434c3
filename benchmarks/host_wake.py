#!/usr/bin/env python3
"""Why a decode step's host work costs more inside the example engine than in a loop
(GPU machine; issue 29).

The engine's graph-replayed decode step at batch 64 spends ~45 µs in
``BatchLayout.decode``, ~50 µs in ``plan`` and ~200 µs in the replay planning, where a
back-to-back loop of the same calls spends a fraction of that. This script times the
three parts of the engine's step (decode batch, kv 4096, page 16, 32/8 heads x 128,
a CUDA-graph bucket over a bound page table, as the engine runs it) under conditions
that separate the suspects:

  hot            the parts back to back (the GPU synchronized before each step)
  after GPU wait a 5 ms kernel, then ``torch.cuda.synchronize()`` (the host waits, as
                 the engine waits for its sampled tokens), then the step
  after sleep    ``time.sleep(0.005)`` (the thread off the CPU for 5 ms), then the step
  after flush    64 MB of host memory rewritten (CPU caches evicted, as an engine's
                 own Python and a forward pass evict them), then the step
  after python   ~1 ms of unrelated Python (dicts, lists, attribute lookups over 64
                 objects: what an engine's scheduler and sampler run), then the step

    python3 benchmarks/host_wake.py [--batch 64] [--n 200]

Medians (µs) per part and of the whole step, each condition ``--n`` steps; the
conditions take turns step by step so a noisy host's drift reaches them alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _timing import sleep_cycles

import flashplan as fp
from flashplan.executor.flashinfer import FlashInferExecutor
from flashplan.executor.flashinfer.bucket import GraphBucket
from flashplan.executor.flashinfer.graphs import capture

HEADS = fp.HeadConfig(num_qo_heads=32, num_kv_heads=8, head_dim=128)
PAGE, KV = 16, 4096


class _Req:
    """A stand-in for an engine's request record (what its scheduler walks)."""

    def __init__(self, i: int) -> None:
        self.row = i
        self.tokens = list(range(40))
        self.num_cached = 1000 + i
        self.meta = {"id": i, "stop": (2, 3), "n": 1}


def _python_work(reqs: list[_Req]) -> int:
    """About a millisecond of engine-like Python: walk, copy and sort per request."""
    acc = 0
    for _ in range(12):
        batch = sorted(reqs, key=lambda r: (r.num_cached % 7, r.row))
        for r in batch:
            t = [*r.tokens[-8:], r.row]
            acc += len(t) + r.meta["n"] + sum(t[:3])
            r.meta = dict(r.meta, seen=acc)
    return acc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--n", type=int, default=200)
    args = parser.parse_args()
    bs = args.batch
    lens = [KV - 8 + (i % 8) for i in range(bs)]
    spec0 = fp.plan(fp.BatchLayout.decode(lens, page_size=PAGE), HEADS)
    longest = fp.plan(fp.BatchLayout.decode([n + 500 for n in lens], page_size=PAGE), HEADS)
    table = fp.PageTable.shuffled(longest.pages_needed, seed=0, device="cuda")
    ex = FlashInferExecutor()
    ex.bind_page_table(table.pages, num_pages=table.num_pages)
    gx = ex.for_bucket(GraphBucket.decode(bs, -(-(KV + 600) // PAGE)))
    gx.apply(spec0, table)
    q = torch.randn(bs, 32, 128, device="cuda", dtype=torch.bfloat16)
    cache = torch.randn(int(table.num_pages or 1), 2, PAGE, 8, 128, device="cuda",
                        dtype=torch.bfloat16)  # fmt: skip
    group = fp.AttentionGroup.full()
    step_graph = capture(gx, lambda: gx.run(group, q, None, None, cache))
    del step_graph  # (the apply below is the replay planning; the replay itself not timed)

    grow = [0]

    def step() -> tuple[float, float, float]:
        grow[0] = (grow[0] + 1) % 500
        seq = [n + grow[0] for n in lens]  # every request one token longer, as a loop
        t0 = time.perf_counter()
        layout = fp.BatchLayout.decode(seq, page_size=PAGE)
        t1 = time.perf_counter()
        spec = fp.plan(layout, HEADS)
        t2 = time.perf_counter()
        gx.apply(spec, table)
        t3 = time.perf_counter()
        return (t1 - t0) * 1e6, (t2 - t1) * 1e6, (t3 - t2) * 1e6

    cycles = sleep_cycles(5.0)
    flush = np.zeros(64 << 18, dtype=np.int32)
    reqs = [_Req(i) for i in range(bs)]

    def gpu_wait() -> None:
        torch.cuda._sleep(cycles)
        torch.cuda.synchronize()

    def os_sleep() -> None:
        time.sleep(0.005)

    def flush_caches() -> None:
        flush.__iadd__(1)

    def python() -> None:
        _python_work(reqs)

    conditions: dict[str, Callable[[], None]] = {
        "hot": lambda: None,
        "after GPU wait (5 ms)": gpu_wait,
        "after sleep (5 ms)": os_sleep,
        "after flush (64 MB)": flush_caches,
        "after python (~1 ms)": python,
    }
    for _ in range(20):
        step()
    times: dict[str, list[tuple[float, float, float]]] = {c: [] for c in conditions}
    names = list(conditions)
    for i in range(args.n):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            torch.cuda.synchronize()
            conditions[name]()
            times[name].append(step())
    torch.cuda.synchronize()
    print(
        f"decode step host parts, batch {bs}, kv {KV}, page {PAGE}, graph bucket over a "
        f"bound table, {torch.cuda.get_device_name()}; median µs of {args.n}"
    )
    print()
    print("| condition | layout | plan | apply | step | step / hot |")
    print("|---|---|---|---|---|---|")
    hot = statistics.median(sum(t) for t in times["hot"])
    for name, ts in times.items():
        parts = [statistics.median(t[j] for t in ts) for j in range(3)]
        total = statistics.median(sum(t) for t in ts)
        print(
            f"| {name} | {parts[0]:.1f} | {parts[1]:.1f} | {parts[2]:.1f} | {total:.1f} "
            f"| {total / hot:.2f}x |"
        )


if __name__ == "__main__":
    main()
