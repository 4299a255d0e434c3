#!/usr/bin/env python3
"""The floor of a decode re-plan on this machine: what no executor can go below.

Issue #24 asks for this before the rebuild: a re-plan needs the compiled module's
plan entry (FlashInfer's host scheduler), one pinned host-to-device copy of the staged
arrays, and one Triton launch (the page gather). Their sum is the physical limit of an
eager re-plan; every target is also reported as a multiple of it. Decode, kv 4096,
page 16, 32/8 heads x 128, bf16, host µs (median, GPU idle and synchronized before each
call)::

    python3 benchmarks/floor.py [--out OUT] [--reps 200]

Columns:
  module plan    ``wrapper._cached_module.plan(*args)`` alone, with the arguments
                 ``fast_decode_plan`` gives it (recorded from one call; benchmark only)
  fast_decode    ``flashinfer.fast_decode_plan(wrapper, ...)`` (the module plan entry plus
                 FlashInfer's Python around it)
  copy           one pinned-to-device ``copy_(non_blocking=True)`` of as many int32 as the
                 executor stages for the batch (``DevicePlan.manifest.total``)
  launch         one launch of a trivial Triton kernel bound for direct launch
                 (flashplan's ``DirectLaunch``; the gather is one such launch)
  floor          module plan + copy + launch
  bare plan()    FlashInfer's public ``plan()`` on ready pinned indptrs and device page ids
  apply          ``FlashInferExecutor.apply(spec, table)`` of an already-planned spec
  step           ``BatchLayout.decode`` + ``plan`` + ``apply`` (what #24's target times),
                 the same lengths every call
  loop step      the same, as a decode loop: every request one token longer each call
                 (new page counts once per page, new KV lengths every call)
  blocks         step and bare plan() again, each timed in a block of its own calls
                 (``run_gpu.py``'s way: the bare ``plan()``'s best case)
  alternated     step and bare plan() alone, call by call (a b b a …): each follows the
                 other as often as itself (the round-by-round columns rotate four jobs,
                 three of them flashplan's, whose code then stays warm for the step:
                 that favours the step)
  cold           step and bare plan() with cold CPU caches (64 MB of host memory
                 rewritten before each call, as an engine's forward pass does between
                 two plans): ``_timing.cold_us``
  schedules kept the share of the step executor's decode re-plans that kept the
                 scheduler's last plan (``plan_counts``)

The floor's parts are timed one after the other (``--reps`` calls each); bare plan(),
apply, step and loop step round by round (``_timing.interleaved_us``: every job once per
round, the order rotated), so a noisy host's drift reaches them alike; the ratios to the
bare ``plan()`` are medians of the rounds' paired ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl
from _timing import alternating_us, cold_us, host_us, interleaved_us, paired_ratio, pinned

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flashinfer

import flashplan as fp
from flashplan.executor.flashinfer import ExecutorPolicy, FlashInferExecutor
from flashplan.executor.flashinfer.calls import call_inputs, call_skeleton
from flashplan.executor.flashinfer.policy import decode_uses_tensor_cores
from flashplan.executor.flashinfer.staging import device_plan
from flashplan.executor.gathers import gather_jobs

try:  # where the direct launch lives (the adapter, after #24's step 1)
    from flashplan.executor.flashinfer.adapter import DirectLaunch
except ImportError:
    from flashplan.kernels._triton import DirectLaunch  # type: ignore[no-redef]

HQ, HKV, D, PAGE, KV = 32, 8, 128, 16, 4096
HEADS = fp.HeadConfig(num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D)
DT = torch.bfloat16
DEV = torch.device("cuda")


@triton.jit(do_not_specialize=["n"], do_not_specialize_on_alignment=["src", "dst"])
def _copy_kernel(src, dst, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < n
    tl.store(dst + offs, tl.load(src + offs, mask=keep), mask=keep)


class Recorder:
    """Stands in for a wrapper's compiled module for one call: records the plan
    entry's arguments and forwards everything (benchmark only)."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self.args: tuple[Any, ...] | None = None

    def plan(self, *args: Any) -> Any:
        self.args = args
        return self.module.plan(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.module, name)


#: Tokens a decode loop's requests grow by before starting over (``loop step``).
LOOP = 256


class LoopLens:
    """A decode loop's sequence lengths: every request one token longer per step,
    back to the start after :data:`LOOP` steps."""

    def __init__(self, lens: np.ndarray) -> None:
        self.lens, self.step = lens, 0

    def next(self) -> np.ndarray:
        self.step = (self.step + 1) % LOOP
        return self.lens + self.step


def bare_decode_plan(
    spec: fp.PlanSpec, table: fp.PageTable
) -> tuple[Callable[[], None], Any, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """FlashInfer's bare decode ``plan()`` of ``spec`` (one group) with its inputs ready,
    as an engine would hold them: pinned host indptr and last page lengths, the gathered
    page ids on the device; the decode kernel kind the executor picks, backend ``"fa2"``
    as its decode wrappers. Returns the call, its wrapper and ``(indptr, page ids, last
    page lengths)``."""
    part = spec.group_plans[0].paged
    assert part is not None
    indptr, last = pinned(part.page_indptr), pinned(part.last_page_len)
    rows = table.rows.astype(np.int64)
    pages = table.pages.cpu()
    idx = torch.cat(
        [pages[r, s : s + n] for r, s, n in zip(rows, part.start_page, part.num_pages, strict=True)]
    ).to(DEV)
    tc = decode_uses_tensor_cores(HEADS, ExecutorPolicy(), spec.batch_size)
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device=DEV)
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tc, backend="fa2")

    def bare() -> None:
        w.plan(indptr, idx, last, HQ, HKV, D, PAGE, q_data_type=DT, kv_data_type=DT,
               non_blocking=True)  # fmt: skip

    return bare, w, (indptr, idx, last)


class DecodeCase(NamedTuple):
    """A decode batch and the jobs the decode benchmarks compare on it
    (:func:`decode_case`).

    Attributes:
        lens: int ``[bs]`` sequence lengths (tokens), all ``KV``.
        spec: the batch's plan.
        table: a shuffled page table holding it.
        executor: a fresh eager executor (not yet applied).
        step: ``BatchLayout.decode`` + ``plan`` + ``executor.apply`` of the batch (a
            fresh layout and plan each call).
        pure: ``BatchLayout.decode`` + ``plan`` alone.
        bare: FlashInfer's bare ``plan()`` of the batch (:func:`bare_decode_plan`).
        wrapper: the bare ``plan()``'s wrapper.
        bare_inputs: its ``(indptr, page ids, last page lengths)``.
    """

    lens: np.ndarray
    spec: fp.PlanSpec
    table: fp.PageTable
    executor: FlashInferExecutor
    step: Callable[[], None]
    pure: Callable[[], None]
    bare: Callable[[], None]
    wrapper: Any
    bare_inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def decode_case(bs: int, *, seed: int, room: int = 0) -> DecodeCase:
    """``bs`` requests of ``KV`` tokens (page ``PAGE``), over a table shuffled with
    ``seed`` whose rows hold ``room`` more tokens each (a decode loop's growth)."""
    lens = np.full(bs, KV)
    spec = fp.plan(fp.BatchLayout.decode(lens, page_size=PAGE), HEADS)
    need = spec.pages_needed
    if room:
        need = fp.plan(fp.BatchLayout.decode(lens + room, page_size=PAGE), HEADS).pages_needed
    table = fp.PageTable.shuffled(need, seed=seed, device=DEV)
    bare, wrapper, inputs = bare_decode_plan(spec, table)
    ex = FlashInferExecutor()

    def step() -> None:
        ex.apply(fp.plan(fp.BatchLayout.decode(lens, page_size=PAGE), HEADS), table)

    def pure() -> None:
        fp.plan(fp.BatchLayout.decode(lens, page_size=PAGE), HEADS)

    return DecodeCase(lens, spec, table, ex, step, pure, bare, wrapper, inputs)


def measure(bs: int, reps: int) -> dict[str, float]:
    # room for the decode loop below: every request up to LOOP tokens longer
    case = decode_case(bs, seed=bs, room=LOOP)
    lens, spec, table, ex, step = case.lens, case.spec, case.table, case.executor, case.step
    bare, w, (indptr, idx, last) = case.bare, case.wrapper, case.bare_inputs
    tc = bool(w.use_tensor_cores)
    kwargs = dict(q_data_type=DT, kv_data_type=DT, non_blocking=True)
    bare()
    indptr_dev, last_dev = indptr.to(DEV), last.to(DEV)

    def fast() -> None:
        flashinfer.fast_decode_plan(
            w, indptr_dev, idx, last if tc else last_dev, HQ, HKV, D, PAGE,
            global_override_indptr_cpu=indptr, **kwargs,
        )  # fmt: skip

    recorder = Recorder(w._cached_module)
    w._cached_module = recorder
    fast()
    w._cached_module = recorder.module
    args = recorder.args
    assert args is not None, "fast_decode_plan did not call the module's plan entry"
    module = recorder.module

    def module_plan() -> None:
        module.plan(*args)

    # the executor's staging size for this batch
    calls = call_skeleton(spec, ExecutorPolicy(), sm90=torch.cuda.get_device_capability() == (9, 0))
    inputs = call_inputs(spec, calls)
    jobs = gather_jobs(spec, table.rows, window_pool=False, spans=inputs.spans)
    entries = device_plan(calls, jobs, inputs.host, inputs.masks).manifest.total
    host = torch.zeros(entries, dtype=torch.int32).pin_memory()
    dev = torch.empty(entries, dtype=torch.int32, device=DEV)

    def copy() -> None:
        dev.copy_(host, non_blocking=True)

    direct = DirectLaunch(_copy_kernel)
    src = torch.zeros(entries, dtype=torch.int32, device=DEV)
    dst = torch.empty_like(src)
    block = 1024
    grid = triton.cdiv(entries, block)
    pointers = (src.data_ptr(), dst.data_ptr(), entries, block)

    def launch() -> None:
        direct(grid, ("copy", block), (src, dst, entries, block), (entries,), pointers)

    launch()  # compiles the variant, the next launches go direct
    ex.apply(spec, table)

    def apply() -> None:
        ex.apply(spec, table)

    loop = LoopLens(lens)
    ex_loop = FlashInferExecutor()

    def loop_step() -> None:
        ex_loop.apply(fp.plan(fp.BatchLayout.decode(loop.next(), page_size=PAGE), HEADS), table)

    out = {"batch": bs, "staged_entries": entries, "direct_launches": 0}
    for name, fn in (
        ("module_plan", module_plan), ("fast_decode", fast), ("copy", copy), ("launch", launch),
    ):  # fmt: skip
        out[f"{name}_us"] = host_us(fn, n=reps, warmup=20)
    # the compared jobs round by round (drift of the host reaches all alike)
    rounds = interleaved_us(
        {"bare_plan": bare, "apply": apply, "step": step, "loop_step": loop_step}, n=reps
    )
    for name, times in rounds.items():
        out[f"{name}_us"] = statistics.median(times)
    out["step_ratio"] = paired_ratio(rounds["step"], rounds["bare_plan"])
    out["loop_step_ratio"] = paired_ratio(rounds["loop_step"], rounds["bare_plan"])
    out["direct_launches"] = direct.direct
    out["floor_us"] = out["module_plan_us"] + out["copy_us"] + out["launch_us"]
    # the same two jobs in blocks of their own calls (run_gpu.py's way: the bare plan()'s
    # best case, its code and data hot in the CPU caches)
    out["bare_plan_blocks_us"] = host_us(bare, n=reps, warmup=20)
    out["step_blocks_us"] = host_us(step, n=reps, warmup=20)
    alt_step, alt_bare = alternating_us(step, bare, n=reps)
    out["alternated_ratio"] = paired_ratio(alt_step, alt_bare)
    cold = cold_us({"step": step, "bare": bare}, n=max(reps // 3, 20))
    out["cold_step_us"] = statistics.median(cold["step"])
    out["cold_bare_us"] = statistics.median(cold["bare"])
    counts = ex.plan_counts
    out["kept"] = counts["schedules_kept"] / max(counts["fast_decode_plan"], 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args()
    rows = [measure(bs, args.reps) for bs in (1, 64, 256, 1024)]
    head = (
        f"floor of a decode re-plan, {torch.cuda.get_device_name()}, flashinfer "
        f"{flashinfer.__version__}, triton {triton.__version__}, {time.strftime('%Y-%m-%d')};"
        f" kv {KV}, page {PAGE}, heads {HQ}/{HKV} x {D}; host µs, median of {args.reps}"
    )
    lines = [
        head,
        "",
        "| batch | staged int32 | module plan | fast_decode_plan | copy | launch | **floor** "
        "| bare plan() | apply | step | step / bare | step / floor | bare / floor "
        "| loop step | loop step / bare | blocks: step / bare | alternated step / bare "
        "| cold: step / bare | schedules kept |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['batch']} | {r['staged_entries']} | {r['module_plan_us']:.1f} "
            f"| {r['fast_decode_us']:.1f} | {r['copy_us']:.1f} | {r['launch_us']:.1f} "
            f"| **{r['floor_us']:.1f}** | {r['bare_plan_us']:.1f} | {r['apply_us']:.1f} "
            f"| {r['step_us']:.1f} | {r['step_ratio']:.2f}x "
            f"| {r['step_us'] / r['floor_us']:.2f}x | {r['bare_plan_us'] / r['floor_us']:.2f}x "
            f"| {r['loop_step_us']:.1f} | {r['loop_step_ratio']:.2f}x "
            f"| {r['step_blocks_us']:.1f} / {r['bare_plan_blocks_us']:.1f} = "
            f"{r['step_blocks_us'] / r['bare_plan_blocks_us']:.2f}x | {r['alternated_ratio']:.2f}x "
            f"| {r['cold_step_us']:.1f} / {r['cold_bare_us']:.1f} = "
            f"{r['cold_step_us'] / r['cold_bare_us']:.2f}x | {r['kept']:.0%} |"
        )
    text = "\n".join(lines)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "floor.json"), "w") as f:
            json.dump(rows, f, indent=1)
        with open(os.path.join(args.out, "floor.md"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
