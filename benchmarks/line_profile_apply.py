#!/usr/bin/env python3
"""Line profile of the verify or decode host path (GPU machine; needs ``line_profiler``).

    python3 benchmarks/line_profile_apply.py --out OUT [--n 300] [--case decode --batch 64]

``--case verify`` (default): ``bench_speculative.py``'s verify batch (64 requests x
64-token trees over 4096, page 16, the FA2 policy) planned and applied ``--n`` times,
each on a fresh plan. ``--case decode``: ``floor.py``'s decode step (``--batch``
requests over 4096 keys, page 16: ``BatchLayout.decode`` + ``plan`` + ``apply``, the
default policy). Each under ``line_profiler`` in two conditions, and FlashInfer's bare
``plan()`` of the same batch (the benchmark's yardstick) profiled the same way:

* ``idle``: the GPU synchronized before each call;
* ``busy``: each call issued right after a 2 ms kernel (``torch.cuda._sleep``), as an
  engine plans while the previous step still runs.

Writes ``OUT/line_<condition>.txt`` (flashplan's functions) and
``OUT/line_raw_<condition>.txt`` (FlashInfer's ``plan()``), and prints the totals.
line_profiler's own overhead inflates every line (a few hundred ns each): compare lines
within one file, not with the benchmark's uninstrumented times.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _timing import sleep_cycles
from bench_speculative import HEADS, bare_verify_plan, verify_batch
from line_profiler import LineProfiler

import flashplan as fp
import flashplan.executor.flashinfer.adapter as adapter_mod
import flashplan.executor.flashinfer.batch_arrays as batch_arrays_mod
import flashplan.executor.flashinfer.buffers as buffers_mod
import flashplan.executor.flashinfer.device_work as device_work_mod
import flashplan.executor.flashinfer.eager as eager_mod
import flashplan.executor.flashinfer.paged_lane as paged_lane_mod
import flashplan.executor.flashinfer.staging as staging_mod
import flashplan.executor.flashinfer.timeline as timeline_mod
import flashplan.executor.flashinfer.wrapper_plans as wrapper_plans_mod
import flashplan.executor.gathers as gathers_mod
import flashplan.kernels.fused as fused_mod
import flashplan.layout.batch as batch_mod
import flashplan.planning.planner as planner_mod
from flashplan.executor.checks import check_apply_args
from flashplan.executor.flashinfer import ExecutorPolicy, FlashInferExecutor

#: flashplan's functions on the verify host path, profiled line by line.
FUNCTIONS = [
    planner_mod.plan,
    FlashInferExecutor.apply,
    eager_mod.EagerBuffers.device_plan,
    device_work_mod.stage,
    device_work_mod.upload,
    device_work_mod.gather_and_mask,
    wrapper_plans_mod.plan_calls,
    wrapper_plans_mod.bound_call,
    batch_arrays_mod.call_inputs,
    batch_arrays_mod._mask_recipe,
    gathers_mod.gather_jobs,
    gathers_mod.job_table,
    staging_mod.device_plan,
    staging_mod.DevicePlan.write_into,
    adapter_mod.replan_prefill,
    fused_mod.launch_gather_and_mask,
    fused_mod.BoundGatherAndMask.__call__,
    adapter_mod.DirectLaunch.__call__,
    buffers_mod.PinnedRing.acquire,
    buffers_mod.WrapperPool.acquire,
    timeline_mod.Timeline.mark,
    timeline_mod.Timeline.passed,
    check_apply_args,
]

#: What a decode step adds (the layout, the decode planner, the paged lane).
DECODE_FUNCTIONS = [
    batch_mod.BatchLayout.decode,
    planner_mod._plan_decode,
    planner_mod._decode_group,
    paged_lane_mod.PagedLane.device_plan,
    eager_mod.EagerBuffers.skeleton,
    FlashInferExecutor._check_plan,
    adapter_mod.replan_decode,
    wrapper_plans_mod._schedule_changed,
]


def profile(
    fn: Callable[[], object], functions: list[Callable[..., object]], n: int, busy: int
) -> tuple[str, float]:
    """``fn`` called ``n`` times under a line profiler of ``functions`` (each after a
    sync, then a ``busy``-cycle sleep kernel when ``busy``); the report and the median
    uninstrumented-by-perf_counter wall time per call (µs, profiler overhead included)."""
    prof = LineProfiler()
    for f in functions:
        prof.add_function(f)
    median = plain(prof(fn), n, busy)
    buf = io.StringIO()
    prof.print_stats(stream=buf, output_unit=1e-6, stripzeros=True)
    return buf.getvalue(), median


def plain(fn: Callable[[], object], n: int, busy: int) -> float:
    """Median host time of ``fn`` (µs, no profiler), each call after a sync and, with
    ``busy``, a ``busy``-cycle sleep kernel."""
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        if busy:
            torch.cuda._sleep(busy)
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return float(np.median(times))


def decode_step(bs: int) -> tuple[Callable[[], None], Callable[[], None], Any]:
    """``floor.py``'s decode step of ``bs`` requests over 4096 keys (page 16, a fresh
    layout and plan each call, the default policy) and FlashInfer's bare ``plan()`` of
    the same batch (``floor.decode_case``), and that call's wrapper."""
    from floor import decode_case

    case = decode_case(bs, seed=bs)
    return case.step, case.bare, case.wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--n", type=int, default=300)
    parser.add_argument("--case", choices=("verify", "decode"), default="verify")
    parser.add_argument("--batch", type=int, default=64, help="decode requests")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dev = torch.device("cuda")
    functions = FUNCTIONS
    if args.case == "verify":
        layout, spec, table = verify_batch()
        ex = FlashInferExecutor(policy=ExecutorPolicy(prefill_backend="fa2"))

        def ours() -> None:
            ex.apply(fp.plan(layout, HEADS), table)

        # FlashInfer's bare plan() with the mask packed ahead (bench_speculative's yardstick)
        raw_plan, raw = bare_verify_plan(
            spec, table, torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
        )
    else:
        ours, raw_plan, raw = decode_step(args.batch)
        functions = FUNCTIONS + DECODE_FUNCTIONS
    for _ in range(30):
        ours()

    for _ in range(30):
        raw_plan()
    raw_fns = [type(raw).plan]
    busy = sleep_cycles(2.0)
    conditions = (("idle", 0), ("busy", busy))
    # Plain timings first: once a line profiler has run, the interpreter keeps tracing
    # hooks that slow every later call (seen on the H200: 1083 µs for a 211 µs plan()).
    for cond, cycles in conditions:
        ours_us, raw_us = plain(ours, args.n, cycles), plain(raw_plan, args.n, cycles)
        print(f"{cond}: flashplan plan + apply {ours_us:.0f} µs, bare plan() {raw_us:.0f} µs "
              f"(ratio {ours_us / raw_us:.2f}; no profiler)")  # fmt: skip
    for cond, cycles in conditions:
        text, med = profile(ours, functions, args.n, cycles)
        with open(os.path.join(args.out, f"line_{cond}.txt"), "w") as f:
            f.write(text)
        raw_text, raw_med = profile(raw_plan, raw_fns, args.n, cycles)
        with open(os.path.join(args.out, f"line_raw_{cond}.txt"), "w") as f:
            f.write(raw_text)
        print(f"{cond}: flashplan plan + apply {med:.0f} µs, bare plan() {raw_med:.0f} µs "
              "(medians under the line profiler)")  # fmt: skip


if __name__ == "__main__":
    main()
