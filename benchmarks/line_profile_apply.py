#!/usr/bin/env python3
"""Line profile of the verify host path (GPU machine; needs ``line_profiler``).

    python3 benchmarks/line_profile_apply.py --out OUT [--n 300]

``bench_speculative.py``'s verify batch (64 requests x 64-token trees over 4096, page
16, the FA2 policy) planned and applied ``--n`` times, each on a fresh plan, under
``line_profiler`` in two conditions, and FlashInfer's bare ``plan()`` of the same batch
(the benchmark's yardstick) profiled the same way:

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
import warnings
from collections.abc import Callable

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import flashinfer

from _timing import sleep_cycles
from line_profiler import LineProfiler

import flashplan as fp
import flashplan.executor.flashinfer.buffers as buffers_mod
import flashplan.executor.flashinfer.calls as calls_mod
import flashplan.executor.flashinfer.executor as executor_mod
import flashplan.executor.flashinfer.fast_prefill as fast_prefill_mod
import flashplan.executor.flashinfer.staging as staging_mod
import flashplan.executor.gathers as gathers_mod
import flashplan.kernels.fused as fused_mod
import flashplan.planning.planner as planner_mod
from flashplan.executor.checks import check_apply_args
from flashplan.executor.flashinfer import ExecutorPolicy, FlashInferExecutor
from flashplan.executor.flashinfer.calls import flashinfer_mask_offsets
from flashplan.kernels._triton import DirectLaunch
from flashplan.testing import bushy_tree_parents

HEADS = fp.HeadConfig(32, 8, 128)
PS = 16

#: flashplan's functions on the verify host path, profiled line by line.
FUNCTIONS = [
    planner_mod.plan,
    FlashInferExecutor.apply,
    FlashInferExecutor._device_plan,
    FlashInferExecutor._stage,
    FlashInferExecutor._upload,
    FlashInferExecutor._gather_and_mask,
    FlashInferExecutor._plan_calls,
    executor_mod._bound_call,
    calls_mod.call_inputs,
    calls_mod._mask_recipe,
    gathers_mod.gather_jobs,
    gathers_mod._job_table,
    staging_mod.device_plan,
    staging_mod.DevicePlan.write_into,
    fast_prefill_mod.replan_prefill,
    fused_mod.launch_gather_and_mask,
    DirectLaunch.__call__,
    buffers_mod.PinnedRing.acquire,
    buffers_mod.WrapperPool.acquire,
    buffers_mod.WrapperPool.mark_planned,
    buffers_mod.PinnedSlot.mark_read,
    check_apply_args,
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
    wrapped = prof(fn)
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        if busy:
            torch.cuda._sleep(busy)
        t0 = time.perf_counter()
        wrapped()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    buf = io.StringIO()
    prof.print_stats(stream=buf, output_unit=1e-6, stripzeros=True)
    return buf.getvalue(), float(np.median(times))


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--n", type=int, default=300)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dev = torch.device("cuda")
    bs, n, prefix = 64, 64, 4096
    tree = fp.DraftTree.from_parents(bushy_tree_parents(np.random.default_rng(0), bs, n))
    layout = fp.BatchLayout.verify([prefix] * bs, tree, page_size=PS)
    spec = fp.plan(layout, HEADS)
    table = fp.PageTable.sequential(spec.pages_needed, device=dev)
    ex = FlashInferExecutor(policy=ExecutorPolicy(prefill_backend="fa2"))

    def ours() -> None:
        ex.apply(fp.plan(layout, HEADS), table)

    for _ in range(30):
        ours()

    # FlashInfer's bare plan() with the mask packed ahead (bench_speculative's yardstick)
    part = spec.group_plans[0].paged
    assert part is not None and part.mask is not None
    offsets = flashinfer_mask_offsets(part.mask.qo_lens, part.mask.kv_lens)
    packed = np.zeros(int(offsets[-1]) + 8, dtype=np.uint8)
    for i in range(bs):
        bits = np.packbits(part.mask.dense(i).reshape(-1), bitorder="little")
        packed[int(offsets[i]) : int(offsets[i]) + bits.shape[0]] = bits
    mask_dev = torch.from_numpy(packed).to(dev)

    def pinned(a: np.ndarray) -> torch.Tensor:
        t = torch.empty(a.shape, dtype=torch.int32, pin_memory=True)
        t.numpy()[:] = a
        return t

    qo, kv, last = pinned(spec.qo_indptr), pinned(part.page_indptr), pinned(part.last_page_len)
    indices = table.pages[:, : int(part.num_pages.max())].reshape(-1)[: part.total_pages]
    indices = indices.contiguous()
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
    raw = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")

    def raw_plan() -> None:
        raw.plan(
            qo, kv, indices, last, 32, 8, 128, PS, packed_custom_mask=mask_dev, causal=False,
            q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, non_blocking=True,
        )  # fmt: skip

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
        text, med = profile(ours, FUNCTIONS, args.n, cycles)
        with open(os.path.join(args.out, f"line_{cond}.txt"), "w") as f:
            f.write(text)
        raw_text, raw_med = profile(raw_plan, raw_fns, args.n, cycles)
        with open(os.path.join(args.out, f"line_raw_{cond}.txt"), "w") as f:
            f.write(raw_text)
        print(f"{cond}: flashplan plan + apply {med:.0f} µs, bare plan() {raw_med:.0f} µs "
              "(medians under the line profiler)")  # fmt: skip


if __name__ == "__main__":
    main()
