#!/usr/bin/env python3
"""Host-only planning cost on the CPU box (no GPU, no FlashInfer needed).

Median wall time (``time.perf_counter``) of the pure host steps of one decode step,
kv 4096, page 16, 32 query / 8 KV heads x 128::

    python3 benchmarks/host_cpu.py                       # batch 1, 64, 256, 1024
    python3 benchmarks/host_cpu.py --batch 256 --profile # + cProfile of plan()
    python3 benchmarks/host_cpu.py --json OUT/host_cpu.json
    python3 benchmarks/host_cpu.py --batch 256 --verify     # + bench_speculative's verify

Rows:
  layout        ``BatchLayout.decode(seq_lens, page_size=16)`` (seq_lens: an int64 array)
  plan          ``flashplan.plan(layout, heads)`` (target for 256 requests: <= 30 us)
  skeleton      ``call_skeleton`` (what the executor caches per static key: cold cost)
  call_inputs   ``call_inputs(spec, calls)`` on a fresh plan
  gather_jobs   ``gather_jobs(spec, rows, spans=...)`` on a fresh plan
  device_plan   ``device_plan(calls, jobs, host, masks)`` (the staging buffer)
  translate     ``translate(spec, policy, sm90=True)`` = skeleton + call_inputs
  apply (pure)  what the eager ``FlashInferExecutor.apply`` computes on the host before
                touching the GPU: cached skeleton + call_inputs + gather_jobs + device_plan
  replay (pure) the same for a CUDA-graph bucket of the batch's size: call_inputs +
                ``bucket_gather_jobs`` (the jobs in the bucket's fixed regions, padded)
                + ``padded_inputs`` + device_plan
  step (pure)   layout + plan + apply (pure): the host work of an eager step before any
                copy, launch or FlashInfer ``plan()``
  ... lane      the same through the skeleton's paged lane (``PagedLane``), which the
                executors take for a plain paged batch instead of the general translation

Every derived array of a plan is a ``cached_property``, so the stages are timed on
*fresh* plans in pipeline order (as a step loop meets them): each stage pays for the
properties it is the first to read.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flashplan as fp
from flashplan.executor.flashinfer.bucket import GraphBucket, bucket_gather_jobs, padded_inputs
from flashplan.executor.flashinfer.calls import call_inputs, call_skeleton, translate
from flashplan.executor.flashinfer.paged_lane import PagedLane
from flashplan.executor.flashinfer.policy import ExecutorPolicy
from flashplan.executor.flashinfer.staging import device_plan
from flashplan.executor.gathers import gather_jobs
from flashplan.testing import bushy_tree_parents

HEADS = fp.HeadConfig(num_qo_heads=32, num_kv_heads=8, head_dim=128)
PAGE = 16
KV = 4096
PLAN_TARGET_US = 30.0
POLICY = ExecutorPolicy()


def median_us(fn: Callable[[], object], reps: int) -> float:
    """Median of ``reps`` timed calls after a warm-up (GC off while timing)."""
    for _ in range(max(reps // 10, 10)):
        fn()
    times = []
    gc.disable()
    try:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    finally:
        gc.enable()
    return statistics.median(times) * 1e6


def staged_us(
    make: Callable[[], fp.PlanSpec], stages: list[tuple[str, Callable[..., object]]], reps: int
) -> dict[str, float]:
    """Median time of each stage of a pipeline run on fresh plans (pipeline order).

    ``stages`` are ``(name, fn)``; ``fn(spec, state)`` may read and write ``state``.
    """
    fresh = [make() for _ in range(reps + 10)]
    times: dict[str, list[float]] = {name: [] for name, _ in stages}
    gc.disable()
    try:
        for k, spec in enumerate(fresh):
            state: dict[str, object] = {}
            for name, fn in stages:
                t0 = time.perf_counter()
                fn(spec, state)
                dt = time.perf_counter() - t0
                if k >= 10:
                    times[name].append(dt)
    finally:
        gc.enable()
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


Stage = tuple[str, Callable[[fp.PlanSpec, dict], None]]


def apply_stages(calls: tuple, rows: np.ndarray) -> list[Stage]:
    """The pure host stages of the eager ``apply`` in pipeline order, as ``staged_us``
    takes them: ``call_inputs``, ``gather_jobs`` (the table rows ``rows``) and
    ``device_plan`` (its result left in the state as ``"dplan"``)."""

    def s_inputs(spec: fp.PlanSpec, st: dict) -> None:
        st["inputs"] = call_inputs(spec, calls)

    def s_jobs(spec: fp.PlanSpec, st: dict) -> None:
        st["jobs"] = gather_jobs(spec, rows, window_pool=False, spans=st["inputs"].spans)

    def s_device(spec: fp.PlanSpec, st: dict) -> None:
        inp = st["inputs"]
        st["dplan"] = device_plan(
            calls, st["jobs"], inp.host, inp.masks, ints=inp.ints, elements=inp.elements
        )

    return [("call_inputs", s_inputs), ("gather_jobs", s_jobs), ("device_plan", s_device)]


def measure(bs: int, reps: int) -> dict[str, float]:
    lens = np.full(bs, KV, dtype=np.int64)
    rows = np.arange(bs, dtype=np.int32)
    layout = fp.BatchLayout.decode(lens, page_size=PAGE)
    spec0 = fp.plan(layout, HEADS)
    calls = call_skeleton(spec0, POLICY, sm90=True)
    bucket = GraphBucket.decode(batch_size=bs, max_pages=KV // PAGE)
    graph_calls = call_skeleton(spec0, POLICY, sm90=True, batch_size=bs)
    blayout = bucket.layout(spec0.key, window_pool=False)

    def make() -> fp.PlanSpec:
        return fp.plan(fp.BatchLayout.decode(lens, page_size=PAGE), HEADS)

    out: dict[str, float] = {"batch": bs}
    out["layout_us"] = median_us(lambda: fp.BatchLayout.decode(lens, page_size=PAGE), reps)
    out["plan_us"] = median_us(lambda: fp.plan(layout, HEADS), reps)
    out["skeleton_cold_us"] = median_us(lambda: call_skeleton(spec0, POLICY, sm90=True), reps)
    out["translate_us"] = staged_us(
        make, [("t", lambda s, st: translate(s, POLICY, sm90=True))], reps
    )["t"]

    stages = apply_stages(calls, rows)
    eager = staged_us(make, stages, reps)
    out.update({f"{k}_us": v for k, v in eager.items()})
    out["apply_pure_us"] = sum(eager.values())

    def g_inputs(spec: fp.PlanSpec, st: dict) -> None:
        st["inputs"] = call_inputs(spec, graph_calls)

    def g_bucket(spec: fp.PlanSpec, st: dict) -> None:
        st["fixed"] = bucket_gather_jobs(spec, rows, blayout, bucket, spans=st["inputs"].spans)
        st["host"] = padded_inputs(st["inputs"].host, spec.batch_size, bucket)

    def g_device(spec: fp.PlanSpec, st: dict) -> None:
        device_plan(graph_calls, st["fixed"], st["host"], st["inputs"].masks)

    replay = staged_us(
        make,
        [("in", g_inputs), ("bucket", g_bucket), ("device", g_device)],
        reps,
    )
    out["bucket_pad_us"] = replay["bucket"]
    out["replay_pure_us"] = sum(replay.values())

    def step() -> None:
        spec = fp.plan(fp.BatchLayout.decode(lens, page_size=PAGE), HEADS)
        inp = call_inputs(spec, calls)
        jobs = gather_jobs(spec, rows, window_pool=False, spans=inp.spans)
        device_plan(calls, jobs, inp.host, inp.masks)

    out["step_pure_us"] = median_us(step, reps)

    # the executors' path for a plain decode: its skeleton's paged lane
    lane = PagedLane.of(spec0, calls)
    graph_lane = PagedLane.of(spec0, graph_calls)
    assert lane is not None and graph_lane is not None
    out["lane_us"] = staged_us(make, [("l", lambda s, st: lane.device_plan(s, rows))], reps)["l"]
    out["lane_replay_us"] = staged_us(
        make, [("l", lambda s, st: graph_lane.bucket_plan(s, rows, blayout, bucket))], reps
    )["l"]

    def lane_step() -> None:
        spec = fp.plan(fp.BatchLayout.decode(lens, page_size=PAGE), HEADS)
        lane.device_plan(spec, rows)

    out["lane_step_us"] = median_us(lane_step, reps)
    return out


def measure_verify(reps: int) -> dict[str, float]:
    """The pure host work of ``bench_speculative.py``'s verify (64 requests x 64-token
    trees over 4096, page 16, the FA2 policy the benchmark uses): ``plan`` from a fixed
    layout, then what the eager ``apply`` computes before touching the GPU, including
    the copy into the staging slot (``write_into``)."""
    bs, n = 64, 64
    tree = fp.DraftTree.from_parents(bushy_tree_parents(np.random.default_rng(0), bs, n))
    layout = fp.BatchLayout.verify([KV] * bs, tree, page_size=PAGE)
    policy = ExecutorPolicy(prefill_backend="fa2")
    calls = call_skeleton(fp.plan(layout, HEADS), policy, sm90=True)
    rows = np.arange(bs, dtype=np.int32)
    slot = np.empty(1 << 20, dtype=np.int32)

    def make() -> fp.PlanSpec:
        return fp.plan(layout, HEADS)

    def s_write(spec: fp.PlanSpec, st: dict) -> None:
        st["dplan"].write_into(slot)

    parents = tree.parents

    def fresh_layout_plan() -> fp.PlanSpec:  # an engine's per-step host work before apply
        draft = fp.DraftTree.from_parents(parents)
        return fp.plan(fp.BatchLayout.verify([KV] * bs, draft, page_size=PAGE), HEADS)

    out = {"plan_us": median_us(make, reps)}
    out["tree_layout_plan_us"] = median_us(fresh_layout_plan, max(reps // 4, 50))
    stages = [*apply_stages(calls, rows), ("write_into", s_write)]
    eager = staged_us(make, stages, reps)
    out.update({f"{k}_us": v for k, v in eager.items()})
    out["apply_pure_us"] = sum(eager.values())

    def step() -> None:
        st: dict[str, object] = {}
        spec = make()
        for _, fn in stages:
            fn(spec, st)

    out["step_pure_us"] = median_us(step, reps)
    return out


VERIFY_ROWS = [
    ("tree + layout + plan (a fresh DraftTree each time)", "tree_layout_plan_us"),
    ("plan (fixed layout)", "plan_us"),
    ("call_inputs", "call_inputs_us"),
    ("gather_jobs", "gather_jobs_us"),
    ("device_plan", "device_plan_us"),
    ("write_into (the staging slot)", "write_into_us"),
    ("apply (pure) = inputs + jobs + device_plan + write", "apply_pure_us"),
    ("plan + apply (pure)", "step_pure_us"),
]


def profile_plan(bs: int, n: int = 5000) -> str:
    lens = np.full(bs, KV, dtype=np.int64)
    layout = fp.BatchLayout.decode(lens, page_size=PAGE)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fp.plan(layout, HEADS)
    prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(25)
    return buf.getvalue()


ROWS = [
    ("layout", "layout_us"),
    ("plan", "plan_us"),
    ("skeleton (cold; cached per key)", "skeleton_cold_us"),
    ("translate (skeleton + inputs)", "translate_us"),
    ("call_inputs", "call_inputs_us"),
    ("gather_jobs", "gather_jobs_us"),
    ("device_plan", "device_plan_us"),
    ("apply (pure) = inputs + jobs + device_plan", "apply_pure_us"),
    ("bucket_gather_jobs + padded_inputs", "bucket_pad_us"),
    ("replay (pure) = inputs + bucket jobs + padding + device_plan", "replay_pure_us"),
    ("step (pure) = layout + plan + apply (pure)", "step_pure_us"),
    ("apply (pure), paged lane (what the eager executor runs)", "lane_us"),
    ("replay (pure), paged lane (what a bucket runs)", "lane_replay_us"),
    ("step (pure), paged lane", "lane_step_us"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", default="1,64,256,1024", help="comma-separated batch sizes")
    parser.add_argument("--reps", type=int, default=2000, help="timed calls per row")
    parser.add_argument("--profile", action="store_true", help="cProfile plan() at 256")
    parser.add_argument("--json", default=None, help="write the figures to this file")
    parser.add_argument(
        "--verify", action="store_true", help="also the verify batch of bench_speculative.py"
    )
    args = parser.parse_args()
    sizes = [int(b) for b in args.batch.split(",")]
    results = [measure(bs, args.reps) for bs in sizes]
    print(
        f"flashplan host planning, decode kv {KV}, page {PAGE}, heads 32/8 x 128, "
        f"median of {args.reps} (us); python {sys.version.split()[0]}, numpy {np.__version__}"
    )
    print(f"| step | {' | '.join(f'B{bs}' for bs in sizes)} |")
    print(f"|---|{'---|' * len(sizes)}")
    for label, key in ROWS:
        print(f"| {label} | {' | '.join(f'{r[key]:.1f}' for r in results)} |")
    for r in results:
        if r["batch"] == 256:
            met = r["plan_us"] <= PLAN_TARGET_US
            print(
                f"\nplan() for 256 requests: {r['plan_us']:.1f} us, target <= "
                f"{PLAN_TARGET_US:.0f} us: {'MET' if met else 'MISSED'}"
            )
    verify = measure_verify(args.reps) if args.verify else None
    if verify is not None:
        print(f"\nverify 64 x 64-token trees over {KV}, page {PAGE} (bench_speculative's batch)")
        print("| step | us |\n|---|---|")
        for label, key in VERIFY_ROWS:
            print(f"| {label} | {verify[key]:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            payload = results if verify is None else {"decode": results, "verify": verify}
            json.dump(payload, f, indent=1)
    if args.profile:
        print(profile_plan(256))


if __name__ == "__main__":
    main()
