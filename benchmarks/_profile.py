#!/usr/bin/env python3
"""Part ``profile`` of ``run_gpu.py``: where a decode step's host time goes in the
FlashInfer executor. Per batch size (1, 64, 256; kv 4096 + U[0, 32), page 16, 32/8
heads x 128, bf16, fresh lengths each step) the phases of ``apply`` timed one by one
(the GPU idle before each step), then cProfile over the same loop; medians of the run's
``--steps`` (default 100) after 10 warm-up steps. Needs CUDA."""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import time
from typing import Any

import numpy as np
import torch

import flashplan as fp
from flashplan.executor.flashinfer import FlashInferExecutor
from flashplan.executor.flashinfer.buffers import Staged

HEADS = fp.HeadConfig(32, 8, 128, q_dtype=torch.bfloat16)


def _lens(rng: np.random.Generator, bs: int) -> np.ndarray:
    return 4096 + rng.integers(0, 32, bs)


def _table(rng: np.random.Generator, bs: int) -> fp.PageTable:
    longest = fp.plan(fp.BatchLayout.decode(_lens(rng, bs) + 64, page_size=16), HEADS)
    return fp.PageTable.shuffled(longest.pages_needed, seed=0, device="cuda")


def phases(ex: FlashInferExecutor, bs: int, steps: int) -> dict[str, float]:
    """Median µs of each phase of apply, as ``FlashInferExecutor.apply`` runs them."""
    rng = np.random.default_rng(bs)
    table = _table(rng, bs)
    buffers = ex._buffers
    out: dict[str, list[float]] = {}

    def tick(name: str, t0: float) -> float:
        t1 = time.perf_counter()
        out.setdefault(name, []).append((t1 - t0) * 1e6)
        return t1

    for k in range(steps + 10):
        torch.cuda.synchronize()
        t = time.perf_counter()
        layout = fp.BatchLayout.decode(_lens(rng, bs), page_size=16)
        t = tick("layout", t)
        spec = fp.plan(layout, HEADS)
        t = tick("plan", t)
        calls = buffers.skeleton(spec)
        t = tick("skeleton", t)
        dplan = buffers.device_plan(spec, calls, table)
        t = tick("device_plan (call_inputs, gather jobs, manifest)", t)
        staged = Staged(dplan, buffers.staging)
        t = tick("stage (pinned tensor + one copy)", t)
        page, _, masks = buffers.gather_and_mask(dplan, staged, table)
        t = tick("gather launch", t)
        buffers.plan_wrappers(calls, dplan, staged, page, masks)
        t = tick("wrappers' plan()", t)
        buffers.pool.mark(torch.cuda.current_stream())
        t = tick("pool mark (event)", t)
        if k < 10:
            out.clear()
    return {name: statistics.median(v) for name, v in out.items()}


def part_profile(rep: Any) -> None:
    """The tables above into ``rep.md`` (``Report`` of ``_common``)."""
    from _common import ENV

    if not ENV.cuda:
        rep.md += ["### profile", "", "skipped: needs CUDA", ""]
        return
    steps = ENV.sizes.steps
    lines = [f"### apply's host time by phase ({torch.cuda.get_device_name()})", ""]
    for bs in (1, 64, 256):
        ex = FlashInferExecutor()
        lines += [f"#### batch {bs}", "", "| phase | µs (median) |", "|---|---|"]
        for name, us in phases(ex, bs, steps).items():
            lines.append(f"| {name} | {us:.1f} |")
        rng = np.random.default_rng(0)
        table = _table(rng, bs)
        prof = cProfile.Profile()
        for k in range(steps + 10):
            if k == 10:
                prof.enable()
            ex.apply(fp.plan(fp.BatchLayout.decode(_lens(rng, bs), page_size=16), HEADS), table)
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
        lines += ["", "```", text.getvalue()[-6000:], "```", ""]
    rep.md += lines
