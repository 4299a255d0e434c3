#!/usr/bin/env python3
"""Where a cascade decode's kernel time and host time go (issue 28).

For the two batches of ``bench_cascade.py`` that miss their targets (64 x (8192 +
256) in one group, 256 in groups of 8 over 2048), on the FlashInfer executor:

* kernel time (``do_bench``, CUDA events, L2 flushed, median) of each piece of one
  layer's ``run``, timed alone on the applied plan's own planned wrappers: every
  level's prefill call, the own (decode) call, each LSE merge; their sum against the
  whole ``run`` and against the plain plan's ``run`` on the same table;
* the split FlashInfer's prefill scheduler chose for each level call (its plan info,
  read from the wrapper after ``apply``);
* host time (median of 200, GPU idle) of ``plan`` and of ``apply`` separately, plain
  against cascade, and the executor's ``plan_counts`` (how each wrapper was planned:
  a level call re-planned through the compiled scheduler counts as
  ``fast_prefill_plan``).

On SM90 each batch runs a second time with FA3 level calls
(``ExecutorPolicy(prefill_backend="fa3")``): the level call is compute-bound on FA2;
an FA3 level is planned with ``plan()`` once and then kept while the sharing holds
(``plans_kept``).

    python3 benchmarks/profile_cascade.py [--md OUT.md]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _timing import host_us, kernel_ms
from bench_cascade import FULL, HEADS, batch_inputs, cases

import flashplan as fp
from flashplan.executor.flashinfer import ExecutorPolicy, FlashInferExecutor
from flashplan.executor.flashinfer.wrapper_plans import level_part
from flashplan.kernels.merge_state import merge_state_triton


def profile(
    name: str, layout: fp.BatchLayout, shared: fp.SharedPrefix, policy: ExecutorPolicy
) -> list[str]:
    _, table, cache, q = batch_inputs(layout, shared)
    on = fp.plan(layout, HEADS, shared_prefix=shared, cascade="on")
    plain = fp.plan(layout, HEADS)
    assert on.cascade is not None
    ex = FlashInferExecutor(policy=policy)
    ex.apply(on, table)
    lines = [f"### {name} (level calls: prefill_backend={policy.prefill_backend!r})", ""]
    whole = kernel_ms(lambda: ex.run(FULL, q, None, None, cache))
    own = ex.planned_wrappers[(0, "paged")]
    o, s = own.run(q, cache, return_lse=True)
    pieces = {"own call": kernel_ms(lambda: own.run(q, cache, return_lse=True))}
    for k, _ in enumerate(on.cascade.levels.levels):
        w = ex.planned_wrappers[(0, level_part(k))]
        pieces[f"level {k} call"] = kernel_ms(lambda w=w: w.run(q, cache, return_lse=True))
        ol, sl = w.run(q, cache, return_lse=True)
        pieces[f"level {k} merge"] = kernel_ms(
            lambda ol=ol, sl=sl: merge_state_triton(o, s, ol, sl)
        )
        info = getattr(w, "_plan_info", None)
        lines.append(f"- level {k} FlashInfer plan_info: {_plan_info(info)}")
    lines += ["", "| piece | kernel ms |", "|---|---|"]
    lines += [f"| {k} | {v:.4f} |" for k, v in pieces.items()]
    lines += [f"| sum of pieces | {sum(pieces.values()):.4f} |", f"| whole run | {whole:.4f} |"]
    ex_plain = FlashInferExecutor()
    ex_plain.apply(plain, table)
    plain_ms = kernel_ms(lambda: ex_plain.run(FULL, q, None, None, cache))
    lines.append(f"| plain run (same table) | {plain_ms:.4f} |")

    # host: plan and apply separately, plain against cascade
    def timed(spec_of, executor: FlashInferExecutor) -> tuple[float, float]:
        plan_us = host_us(spec_of, n=200, warmup=20)
        spec = spec_of()
        apply_us = host_us(lambda: executor.apply(spec, table), n=200, warmup=20)
        return plan_us, apply_us

    p_plain = timed(lambda: fp.plan(layout, HEADS), FlashInferExecutor())
    ex_on = FlashInferExecutor(policy=policy)
    p_on = timed(lambda: fp.plan(layout, HEADS, shared_prefix=shared, cascade="on"), ex_on)
    lines += [
        "",
        "| host µs | plan | apply | total |",
        "|---|---|---|---|",
        f"| plain | {p_plain[0]:.0f} | {p_plain[1]:.0f} | {sum(p_plain):.0f} |",
        f"| cascade | {p_on[0]:.0f} | {p_on[1]:.0f} | {sum(p_on):.0f} |",
        "",
        f"cascade executor plan_counts after the timing: {ex_on.plan_counts}",
        "",
    ]
    print("\n".join(lines), flush=True)
    return lines


def _plan_info(info: object) -> str:
    """The split FlashInfer's prefill scheduler chose (the fields of its plan info that
    say it; the raw list where the layout is unknown)."""
    if info is None:
        return "none"
    try:
        values = list(info)  # flashinfer 0.7.4: a list of int64 fields
    except TypeError:
        return repr(info)
    return f"{values[:16]}{' ...' if len(values) > 16 else ''}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--md", type=Path)
    args = ap.parse_args()
    lines = [f"Device: {torch.cuda.get_device_name()}", ""]
    policies = [ExecutorPolicy()]
    if torch.cuda.get_device_capability()[0] == 9:  # FlashInfer's FA3 kernels: SM90
        policies.append(ExecutorPolicy(prefill_backend="fa3"))
    for policy in policies:
        for name, (layout, shared) in list(cases().items())[:2]:
            lines += profile(name, layout, shared, policy)
    if args.md:
        args.md.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    np.set_printoptions(linewidth=120)
    main()
