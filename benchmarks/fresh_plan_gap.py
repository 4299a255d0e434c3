#!/usr/bin/env python3
"""Where a fresh verify plan's host time goes when it is applied at once (H200).

``bench_speculative.py`` times flashplan's plan + apply, FlashInfer's bare ``plan()``,
``plan`` alone and ``apply`` alone (one fixed plan) in blocks of 30 calls; on a noisy
host, the blocks drift apart. This script times every variant below *call by call*,
interleaved (one call of each per iteration, in a rotating order, the GPU synchronized
before each call), so that drift hits all of them alike, and prints medians and
quartiles:

* ``raw``: FlashInfer's bare ``plan()`` with every input prepared ahead
  (``bench_speculative.bare_verify_plan``);
* ``fresh``: ``plan(layout)`` + ``apply`` (bench_speculative's flashplan row);
* ``plan``: ``plan(layout)`` alone; ``apply_fixed``: ``apply`` of one plan again;
* ``apply_fresh``: ``apply`` of a plan made (untimed) just before;
* ``fresh_kept``: ``fresh`` with the previous plans kept alive, so that no plan is freed
  inside the timed call;
* ``fresh_nogc``: ``fresh`` with Python's garbage collector off;
* ``split_plan`` / ``split_apply``: ``fresh`` with a clock read between its two calls.

Run from the repo root on the GPU machine (after ``source .whl/setup.sh``)::

    python3 benchmarks/fresh_plan_gap.py --out OUT [--n 300]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_speculative import DEV, HEADS, bare_verify_plan, verify_batch

import flashplan as fp
from flashplan.executor.flashinfer import ExecutorPolicy, FlashInferExecutor


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="folder for fresh_plan_gap.json")
    ap.add_argument("--n", type=int, default=300, help="iterations (one call of each)")
    args = ap.parse_args()

    layout, spec, table = verify_batch()
    ex = FlashInferExecutor(policy=ExecutorPolicy(prefill_backend="fa2"))
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device=DEV)
    raw_plan, _ = bare_verify_plan(spec, table, ws)
    kept: list[fp.PlanSpec] = []
    ready: list[fp.PlanSpec] = []

    def fresh() -> None:
        ex.apply(fp.plan(layout, HEADS), table)

    def fresh_kept() -> None:
        s = fp.plan(layout, HEADS)
        kept.append(s)
        ex.apply(s, table)

    split: list[float] = []

    def fresh_split() -> None:
        s = fp.plan(layout, HEADS)
        split.append(time.perf_counter())
        ex.apply(s, table)

    def fresh_nogc() -> None:
        ex.apply(fp.plan(layout, HEADS), table)

    def plan_alone() -> None:
        fp.plan(layout, HEADS)

    def apply_fixed() -> None:
        ex.apply(spec, table)

    def apply_fresh() -> None:
        ex.apply(ready.pop(), table)

    jobs: dict[str, Callable[[], None]] = {
        "raw": raw_plan,
        "fresh": fresh,
        "plan": plan_alone,
        "apply_fixed": apply_fixed,
        "apply_fresh": apply_fresh,
        "fresh_kept": fresh_kept,
        "fresh_nogc": fresh_nogc,
        "split": fresh_split,
    }
    for _ in range(20):
        for name, fn in jobs.items():
            if name == "apply_fresh":
                ready.append(fp.plan(layout, HEADS))
            fn()
    kept.clear()
    split.clear()
    times: dict[str, list[float]] = {k: [] for k in jobs}
    names = list(jobs)
    for it in range(args.n):
        order = names[it % len(names) :] + names[: it % len(names)]
        for name in order:
            fn = jobs[name]
            if name == "apply_fresh":
                ready.append(fp.plan(layout, HEADS))
            if name == "fresh_nogc":
                gc.disable()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            if name == "fresh_nogc":
                gc.enable()
            times[name].append((t1 - t0) * 1e6)
            if name == "split":
                mid = split.pop()
                times.setdefault("split_plan", []).append((mid - t0) * 1e6)
                times.setdefault("split_apply", []).append((t1 - mid) * 1e6)
        if len(kept) > 64:
            kept.clear()  # outside any timed call
    torch.cuda.synchronize()

    def q(v: list[float], p: float) -> float:
        return float(np.percentile(v, p))

    print(f"verify 64 x 64-token trees over 4096, page 16: {args.n} interleaved iterations")
    print("| variant | median µs | p25 | p75 | / raw (medians) | median of paired ratios |")
    print("|---|---|---|---|---|---|")
    raw = times["raw"]
    summary = {}
    for name, v in times.items():
        med = statistics.median(v)
        paired = statistics.median(a / b for a, b in zip(v, raw, strict=True))
        summary[name] = {"median": med, "p25": q(v, 25), "p75": q(v, 75), "paired": paired}
        print(
            f"| {name} | {med:.1f} | {q(v, 25):.1f} | {q(v, 75):.1f} | "
            f"{med / statistics.median(raw):.2f} | {paired:.2f} |"
        )
    print(f"cpu affinity: {len(os.sched_getaffinity(0))} cores; gc thresholds {gc.get_threshold()}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "fresh_plan_gap.json"), "w") as f:
            json.dump({"summary": summary, "times_us": times}, f)


if __name__ == "__main__":
    main()
