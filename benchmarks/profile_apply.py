#!/usr/bin/env python3
"""Where does the host time of ``FlashInferExecutor.apply`` go? (GPU machine)

    python3 benchmarks/profile_apply.py [--batch 256] [--page-size 16] [--n 200]
                                        [--no-graph] [--no-cprofile] [--fixed]

For a decode batch (kv 4096, 32/8 heads x 128, bf16) it times, on an idle GPU, every
stage of ``apply`` (``graph_executor.apply`` too: the CUDA-graph replay planning) with
manual timers wrapped around the executor's own steps:

  check_fits         (graph) whether the plan fits the bucket
  check_apply_args   argument and page-table checks
  skeleton           the cached call skeleton (a dict lookup once warm)
  device_plan        the pure host work: call_inputs + gather_jobs (a graph:
                     bucket_gather_jobs and padded_inputs) + device_plan (the staging
                     buffer)
  stage              pinned ring slot + numpy copy into it + the one host-to-device copy
  gather + mask      the one launch of the gathers and the first custom mask
                     (launch_gather_and_mask, or its binding BoundGatherAndMask, through
                     the compiled launcher), and the views around it
  extra masks        mask launches of the second and later masked groups
  pool.acquire       picking an idle FlashInfer wrapper
  plan()             FlashInfer's own plan() calls (via ``_call_plan``)
  fast_decode_plan   decode re-plans through FlashInfer's fast_decode_plan (``replan_decode``)
  mark events        the one timeline mark after the apply's queued work (its event record)
  other              the rest of apply (placeholder resolution, bookkeeping)

Each apply gets a fresh plan (as in a step loop: the plan's derived arrays are cached
properties, computed by their first reader); ``--fixed`` times the stages once more with
one plan applied again and again. Medians per apply over ``--n`` applies;
then a cProfile of the same loop (sorted by own time).

The stage names follow the executor's parts (``flashplan/executor/flashinfer/``); a
stage whose function no longer exists is reported as missing rather than failing.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import flashinfer

from _timing import blocked_us, host_us, sleep_cycles

import flashplan as fp
import flashplan.executor.flashinfer.device_work as device_work_mod
import flashplan.executor.flashinfer.eager as eager_mod
import flashplan.executor.flashinfer.executor as executor_mod
import flashplan.executor.flashinfer.graph_buffers as graph_buffers_mod
import flashplan.executor.flashinfer.wrapper_plans as wrapper_plans_mod
from flashplan.executor.flashinfer import ExecutorPolicy, FlashInferExecutor
from flashplan.executor.flashinfer.bucket import GraphBucket
from flashplan.executor.flashinfer.graphs import capture
from flashplan.kernels.fused import BoundGatherAndMask, StagedMask
from flashplan.testing.batches import bushy_tree_parents, scoring_batch

HEADS = fp.HeadConfig(num_qo_heads=32, num_kv_heads=8, head_dim=128)

# (label, depth) in report order; depth 1 = part of the stage above
STAGES = [
    ("check_fits", 0),
    ("check_apply_args", 0),
    ("skeleton", 0),
    ("device_plan", 0),
    ("call_inputs", 1),
    ("gather_jobs", 1),
    ("bucket_gather_jobs", 1),
    ("padded_inputs", 1),
    ("staging layout (device_plan())", 1),
    ("stage", 0),
    ("ring.acquire", 1),
    ("gather + mask", 0),
    ("fused launch", 1),
    ("extra masks", 0),
    ("pool.acquire", 0),
    ("plan()", 0),
    ("fast_decode_plan", 0),
    ("prefill re-plan (replan_prefill)", 0),
    ("multi-item fill (memset + fill_runs)", 0),
    ("mark events", 0),
]


class StageTimer:
    """Wraps callables so that each call's wall time is added to a per-apply counter."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)
        self.per_apply: list[dict[str, float]] = []
        self.missing: list[str] = []
        self.last_call: dict[str, tuple[Any, tuple[Any, ...], dict[str, Any]]] = {}
        self._restore: list[tuple[Any, str, Any, bool]] = []

    def wrap(self, owner: Any, name: str, label: str) -> None:
        if not hasattr(owner, name):
            self.missing.append(f"{label} ({getattr(owner, '__name__', owner)}.{name})")
            return
        original = getattr(owner, name)
        own = name in vars(owner) if hasattr(owner, "__dict__") else True
        current, last = self.current, self.last_call

        def timed(*args: Any, **kwargs: Any) -> Any:
            last[label] = (original, args, kwargs)
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                current[label] += time.perf_counter() - t0

        setattr(owner, name, timed)  # on a class, a plain function stays a method
        self._restore.append((owner, name, original, own))

    def restore(self) -> None:
        for owner, name, original, own in reversed(self._restore):
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)
        self._restore.clear()

    @contextmanager
    def apply(self) -> Iterator[None]:
        self.current.clear()
        t0 = time.perf_counter()
        yield
        total = time.perf_counter() - t0
        row = dict(self.current)
        row["total"] = total
        self.per_apply.append(row)


def instrument(timer: StageTimer, ex: FlashInferExecutor, graph: bool) -> None:
    """Wrap the executor's steps (its parts' module functions and its strategy's
    methods) in timers."""
    owned = ex._buffers.owned  # the executor's parts (not its API)
    strategy = type(ex._buffers)  # (a slotted attrs class: wrapped on the class)
    mod = graph_buffers_mod if graph else eager_mod
    if graph:
        timer.wrap(graph_buffers_mod, "check_fits", "check_fits")
    timer.wrap(executor_mod, "check_apply_args", "check_apply_args")
    timer.wrap(strategy, "skeleton", "skeleton")
    timer.wrap(strategy, "device_plan", "device_plan")
    timer.wrap(mod, "call_inputs", "call_inputs")
    if graph:  # the jobs straight into the bucket's fixed regions, and the padding
        timer.wrap(mod, "bucket_gather_jobs", "bucket_gather_jobs")
        timer.wrap(mod, "padded_inputs", "padded_inputs")
    else:
        timer.wrap(mod, "gather_jobs", "gather_jobs")
    timer.wrap(mod, "device_plan", "staging layout (device_plan())")
    timer.wrap(executor_mod, "stage", "stage")
    timer.wrap(owned.ring, "acquire", "ring.acquire")
    timer.wrap(executor_mod, "gather_and_mask", "gather + mask")
    timer.wrap(device_work_mod, "launch_gather_and_mask", "fused launch")
    timer.wrap(BoundGatherAndMask, "__call__", "fused launch")  # the bound launches
    timer.wrap(StagedMask, "build", "extra masks")
    timer.wrap(owned.pool, "acquire", "pool.acquire")
    timer.wrap(wrapper_plans_mod, "call_plan", "plan()")
    timer.wrap(wrapper_plans_mod, "replan_decode", "fast_decode_plan")
    timer.wrap(wrapper_plans_mod, "replan_prefill", "prefill re-plan (replan_prefill)")
    timer.wrap(wrapper_plans_mod, "fill_item_positions", "multi-item fill (memset + fill_runs)")
    timer.wrap(owned.timeline, "mark", "mark events")


def report(title: str, timer: StageTimer) -> None:
    rows = timer.per_apply
    print(f"\n== {title}: host time per apply, µs (median / mean over {len(rows)}) ==")

    def stat(label: str) -> tuple[float, float]:
        vals = [r.get(label, 0.0) * 1e6 for r in rows]
        return statistics.median(vals), statistics.fmean(vals)

    total_med, total_mean = stat("total")
    top = 0.0
    for label, depth in STAGES:
        if not any(label in r for r in rows):
            continue
        med, mean = stat(label)
        if depth == 0:
            top += mean
        pct = 100 * mean / total_mean
        print(f"  {'  ' * depth}{label:<{34 - 2 * depth}} {med:8.1f} {mean:8.1f}  {pct:5.1f}%")
    other = total_mean - top
    pct = 100 * other / total_mean
    print(f"  {'other (resolve, bookkeeping)':<34} {'':8} {other:8.1f}  {pct:5.1f}%")
    print(f"  {'total apply':<34} {total_med:8.1f} {total_mean:8.1f}  100.0%")
    if timer.missing:
        print(f"  (not found, not timed: {', '.join(timer.missing)})")


def idle_us(fn: Callable[[], object], n: int = 100) -> float:
    """Median time of ``fn`` alone on an idle GPU (synchronized before each call)."""
    return host_us(fn, n, warmup=10)


BARE_PLAN_ARGS = (
    "indptr", "indices", "last_page_len", "num_qo_heads", "num_kv_heads", "head_dim",
    "page_size", "q_data_type", "kv_data_type", "non_blocking",
)  # fmt: skip


def isolated(timer: StageTimer) -> None:
    """The last plan() call and gather launch of an apply, replayed alone: their own
    cost, without the rest of apply around them."""
    print("  -- the same calls replayed alone (median µs, idle GPU) --")
    if "plan()" in timer.last_call:
        call_plan, (wrapper, kwargs, *rest), _ = timer.last_call["plan()"]
        t = idle_us(lambda: call_plan(wrapper, kwargs, *rest))
        print(f"  {'plan() with the kwargs of apply':<34} {t:8.1f}")
        if all(k in kwargs for k in BARE_PLAN_ARGS):  # a decode call
            bare = {k: kwargs[k] for k in BARE_PLAN_ARGS}
            extra = sorted(set(kwargs) - set(bare))
            t = idle_us(lambda: wrapper.plan(**bare))
            print(f"  {'plan() without ' + ', '.join(extra):<34} {t:8.1f}")
    if "fast_decode_plan" in timer.last_call:
        fn, args, kwargs = timer.last_call["fast_decode_plan"]
        print(f"  {'fast_decode_plan re-plan':<34} {idle_us(lambda: fn(*args, **kwargs)):8.1f}")
    if "prefill re-plan (replan_prefill)" in timer.last_call:
        fn, args, kwargs = timer.last_call["prefill re-plan (replan_prefill)"]
        print(f"  {'prefill re-plan':<34} {idle_us(lambda: fn(*args, **kwargs)):8.1f}")
    if "fused launch" in timer.last_call:
        fn, args, kwargs = timer.last_call["fused launch"]
        print(f"  {'fused launch':<34} {idle_us(lambda: fn(*args, **kwargs)):8.1f}")


def apply_any(ex: FlashInferExecutor, spec: Any, table: fp.PageTable) -> None:
    """``apply`` for a plan, ``apply_steps`` for a multi-step draft's tuple of plans."""
    if isinstance(spec, tuple):
        ex.apply_steps(spec, table)
    else:
        ex.apply(spec, table)


def run(title: str, ex: FlashInferExecutor, make: Callable[[], Any], table: fp.PageTable,
        n: int, cprofile: bool) -> None:  # fmt: skip
    for _ in range(20):
        apply_any(ex, make(), table)
    torch.cuda.synchronize()
    specs = [make() for _ in range(n)]
    t0 = time.perf_counter()
    for spec in specs:
        apply_any(ex, spec, table)
    back_to_back = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    timer = StageTimer()
    instrument(timer, ex, graph=ex.bucket is not None)
    try:
        for spec in [make() for _ in range(n)]:
            torch.cuda.synchronize()
            with timer.apply():
                apply_any(ex, spec, table)
    finally:
        timer.restore()
        torch.cuda.synchronize()
    report(title, timer)
    isolated(timer)
    print(f"  (uninstrumented, {n} applies back to back, no sync: {back_to_back:.1f} µs each)")
    spec = make()
    idle = idle_us(lambda: apply_any(ex, spec, table), n=20)
    behind = blocked_us(lambda: apply_any(ex, spec, table), sleep_cycles(20.0))
    verdict = "waits for the GPU" if behind > 10_000 else "does not wait"
    print(f"  apply issued right after a 20 ms kernel: {behind:.1f} µs (idle GPU: {idle:.1f}): "
          f"{verdict}")  # fmt: skip
    if cprofile:
        specs = [make() for _ in range(n)]
        prof = cProfile.Profile()
        prof.enable()
        for spec in specs:
            apply_any(ex, spec, table)
        prof.disable()
        torch.cuda.synchronize()
        print(f"\n-- cProfile of {n} applies ({title}), by own time --")
        pstats.Stats(prof).sort_stats("tottime").print_stats(60)


def _case_layout(case: str) -> tuple[fp.BatchLayout, str]:
    """The layouts of the speculative and multi-item benchmarks (same seeds)."""
    rng = np.random.default_rng(0)
    if case == "extend":
        layout = fp.BatchLayout.extend([2560] * 64, [2048] * 64, page_size=16)
        return layout, "extend 64 x 512 new tokens over 2048 cached, page 16"
    if case == "verify":
        tree = fp.DraftTree.from_parents(bushy_tree_parents(rng, 64, 64))
        layout = fp.BatchLayout.verify([4096] * 64, tree, page_size=16)
        return layout, "verify 64 x 64-token trees over 4096, page 16"
    ext, delims, _ = scoring_batch(rng, 256)  # bench_multi_item's batch
    layout = fp.BatchLayout.extend(ext, item_delimiters=delims)
    return layout, "multi-item 256 x (512 + 32 items of 1-8), page 1"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--kv", type=int, default=4096)
    parser.add_argument("--n", type=int, default=200, help="applies per measurement")
    parser.add_argument("--no-graph", action="store_true", help="skip the graph executor's apply")
    parser.add_argument("--no-cprofile", action="store_true")
    parser.add_argument(
        "--fixed", action="store_true",
        help="also time the stages with one plan applied again and again (a fresh plan's "
        "extra cost is the difference)",
    )  # fmt: skip
    parser.add_argument(
        "--case", choices=("decode", "extend", "verify", "multi_item", "draft"),
        default="decode",
        help="decode (the default); extend: 64 x 512 new tokens over 2048 cached (page "
        "16); verify: bench_speculative's 64 x 64-token trees over 4096 (page 16); "
        "multi_item: bench_multi_item's 256 x (512 + 32 items), page 1; draft: "
        "bench_speculative's multi-step draft (256 requests, topk 8, 5 steps, page 1: "
        "plan_steps + apply_steps)",
    )  # fmt: skip
    args = parser.parse_args()
    ps = args.page_size
    lens = np.full(args.batch, args.kv)
    policy = ExecutorPolicy()
    if args.case == "decode":

        def make() -> fp.PlanSpec:
            return fp.plan(fp.BatchLayout.decode(lens, page_size=ps), HEADS)

        what = f"decode batch {args.batch}, kv {args.kv}, page {ps}"
    elif args.case == "draft":
        prefix = np.random.default_rng(1).integers(500, 4000, 256)
        draft = fp.DraftDecode(prefix, 8, 5, page_size=1)

        def make() -> Any:
            return fp.plan_steps(draft, HEADS)

        what = "multi-step draft 256 x topk 8 x 5 steps over 500-4000, page 1"
    else:
        layout, what = _case_layout(args.case)
        policy = ExecutorPolicy(prefill_backend="fa2")  # as the benchmarks run them

        def make() -> fp.PlanSpec:
            return fp.plan(layout, HEADS)

    if args.case == "draft":
        prompt = fp.PageTable.sequential(prefix, device="cuda")
        pool = int(prompt.num_pages or 0)
        slots = torch.arange(pool, pool + 256 * 8 * 5, dtype=torch.int32, device="cuda")
        table = fp.PageTable.draft_branches(
            prompt, prefix, 8, slots.reshape(256, 8, 5), page_size=1
        )
    else:
        table = fp.PageTable.shuffled(make().pages_needed, seed=0, device="cuda")
    print(
        f"{what}, heads 32/8 x 128, "
        f"{torch.cuda.get_device_name()}, flashinfer {flashinfer.__version__}"
    )
    run("FlashInferExecutor.apply", FlashInferExecutor(policy=policy), make, table, args.n,
        not args.no_cprofile)  # fmt: skip
    if args.fixed:
        one = make()
        run("FlashInferExecutor.apply, one plan applied again and again",
            FlashInferExecutor(policy=policy), lambda: one, table, args.n, False)  # fmt: skip
    if args.case == "decode" and not args.no_graph:
        max_pages = -(-args.kv // ps)
        gx = FlashInferExecutor().for_bucket(GraphBucket.decode(args.batch, max_pages))
        run("graph executor apply (replay planning)", gx, make, table, args.n,
            not args.no_cprofile)  # fmt: skip
        # the same over a bound page table, captured: the gather and the indptr refresh
        # replay inside the graph (one layer's run, to have a graph at all)
        bound = FlashInferExecutor()
        bound.bind_page_table(table.pages, num_pages=table.num_pages)
        bx = bound.for_bucket(GraphBucket.decode(args.batch, max_pages))
        bx.apply(make(), table)
        q = torch.randn(args.batch, 32, 128, device="cuda", dtype=torch.bfloat16)
        cache = torch.randn(int(table.num_pages or 1), 2, ps, 8, 128, device="cuda",
                            dtype=torch.bfloat16)  # fmt: skip
        group = fp.AttentionGroup.full()
        capture(bx, lambda: bx.run(group, q, None, None, cache))
        run("graph executor apply, bound table (gather captured)", bx, make, table, args.n,
            not args.no_cprofile)  # fmt: skip


if __name__ == "__main__":
    main()
