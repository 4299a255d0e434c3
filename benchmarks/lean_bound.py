#!/usr/bin/env python3
"""How much of a decode step is the executor's orchestration? (GPU machine)

``floor.py``'s decode step (``BatchLayout.decode`` + ``plan`` + ``apply``) against the
same step whose apply is cut down to its device work alone — the paged lane's arrays,
one pinned slot written, one copy, the bound gather launch, the decode wrapper's four
fields, one timeline mark — with every check, memo lookup and record of the real
apply left out (an apply no executor could ship: it trusts that the batch has the
last one's skeleton, staging layout, buffers and wrapper). The difference is the most
any consolidation of the orchestration could save::

    python3 benchmarks/lean_bound.py [--reps 300]

Blocks of each job's own calls and alternated with FlashInfer's bare ``plan()``, GPU
synchronized before each call; host µs, medians. Then the lean apply's parts, each timed
alone in a block (the lane's arrays on fresh plans, as a step meets them): what is
left of a step once the orchestration is gone.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from _timing import alternating_us, host_us, paired_ratio

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from floor import HEADS, KV, PAGE, decode_case

import flashplan as fp
from flashplan.executor.flashinfer.paged_lane import lane_of


def measure(bs: int, reps: int) -> dict[str, float]:
    case = decode_case(bs, seed=0)
    lens, spec, table, ex = case.lens, case.spec, case.table, case.executor
    bare, step, pure = case.bare, case.step, case.pure
    ex.apply(spec, table)
    owned = ex._buffers.owned  # benchmark only: the executor's parts
    calls = ex._buffers.skeleton(spec)
    lane = lane_of(owned.lanes, spec, calls, False, tree_masks=True)
    assert lane is not None
    launch = owned.launched
    assert launch is not None
    (held,) = [s for slots in owned.pool.slots.values() for s in slots]
    w = held.wrapper
    fields = (w._paged_kv_indptr_buf, w._paged_kv_indices_buf, w._paged_kv_last_page_len_buf,
              getattr(w, "_qo_indptr_buf", None))  # fmt: skip
    staged = owned.staged.tensor
    num_pages = table.num_pages or 0
    stream = torch.cuda.current_stream()

    def lean_apply(s: fp.PlanSpec) -> None:
        dplan = lane.device_plan(s, table.rows)
        total = dplan.manifest.total
        slot = owned.ring.acquire(total)
        dplan.write_into(slot.array)
        staged[:total].copy_(slot.host[:total], non_blocking=True)
        slot.mark = owned.timeline.upcoming
        launch(num_pages, 0)
        w._paged_kv_indptr_buf, w._paged_kv_indices_buf = fields[0], fields[1]
        w._paged_kv_last_page_len_buf = fields[2]
        if fields[3] is not None:
            w._qo_indptr_buf = fields[3]
        held.mark = owned.timeline.upcoming
        owned.timeline.mark(stream)

    def lean_step() -> None:
        lean_apply(fp.plan(fp.BatchLayout.decode(lens, page_size=PAGE), HEADS))

    out: dict[str, float] = {"batch": bs}
    for name, fn in (("bare", bare), ("step", step), ("lean", lean_step), ("pure", pure)):
        out[name] = host_us(fn, n=reps, warmup=30)
    for name, fn in (("step", step), ("lean", lean_step)):
        a, b = alternating_us(fn, bare, n=reps)
        out[f"alt_{name}"] = paired_ratio(a, b)
    # the lean apply's parts alone
    fresh = iter([fp.plan(fp.BatchLayout.decode(lens, page_size=PAGE), HEADS)
                  for _ in range(reps + 40)])  # fmt: skip
    out["lane"] = host_us(lambda: lane.device_plan(next(fresh), table.rows), n=reps, warmup=30)
    dplan = lane.device_plan(spec, table.rows)
    total = dplan.manifest.total

    def slot_write() -> None:
        slot = owned.ring.acquire(total)
        dplan.write_into(slot.array)

    host = owned.ring.acquire(total).host[:total]
    out["slot"] = host_us(slot_write, n=reps, warmup=30)
    out["copy"] = host_us(lambda: staged[:total].copy_(host, non_blocking=True), n=reps, warmup=30)
    out["launch"] = host_us(lambda: launch(num_pages, 0), n=reps, warmup=30)
    out["mark"] = host_us(lambda: owned.timeline.mark(stream), n=reps, warmup=30)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=300)
    args = parser.parse_args()
    print(f"decode kv {KV}, page {PAGE}, {torch.cuda.get_device_name()}; host µs, medians")
    print("| batch | bare plan() | layout + plan | step | lean step | saved | blocks: step / bare "
          "| lean / bare | alternated: step / bare | lean / bare |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = [measure(bs, args.reps) for bs in (1, 64, 256)]
    for r in rows:
        print(
            f"| {r['batch']:.0f} | {r['bare']:.1f} | {r['pure']:.1f} | {r['step']:.1f} "
            f"| {r['lean']:.1f} | {r['step'] - r['lean']:.1f} | {r['step'] / r['bare']:.2f}x "
            f"| {r['lean'] / r['bare']:.2f}x | {r['alt_step']:.2f}x | {r['alt_lean']:.2f}x |"
        )
    print()
    print("the lean apply's parts, each alone (µs):")
    print("| batch | lane arrays (fresh plan) | slot + write | copy | bound launch | mark |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['batch']:.0f} | {r['lane']:.1f} | {r['slot']:.1f} | {r['copy']:.1f} "
            f"| {r['launch']:.1f} | {r['mark']:.1f} |"
        )


if __name__ == "__main__":
    main()
