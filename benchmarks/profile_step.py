#!/usr/bin/env python3
"""cProfile of ``floor.py``'s decode step (GPU machine): ``BatchLayout.decode`` + ``plan``
+ ``FlashInferExecutor.apply``, called in a block of its own calls (``run_gpu.py``'s
way), with the GPU synchronized before each call, and the same for FlashInfer's bare
``plan()`` of the batch::

    python3 benchmarks/profile_step.py [--batch 64] [--n 400] [--lines 45]

Prints the uninstrumented medians of both (µs), the function calls per call, and each
profile sorted by own time and by cumulative time. cProfile's own overhead inflates
every call (about a third of a microsecond): compare functions within one profile.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import pstats
import sys
from collections.abc import Callable

import torch
from _timing import host_us

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from floor import KV, PAGE, decode_case


def profiled(fn: Callable[[], object], n: int, lines: int) -> tuple[int, str]:
    """``fn`` called ``n`` times under cProfile (GPU synchronized before each call):
    function calls per call and the two sorted listings."""
    prof = cProfile.Profile()
    for _ in range(n):
        torch.cuda.synchronize()
        prof.enable()
        fn()
        prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(lines)
    stats.sort_stats("cumulative").print_stats(lines)
    return stats.total_calls // n, out.getvalue()  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--n", type=int, default=400)
    parser.add_argument("--lines", type=int, default=45)
    args = parser.parse_args()
    case = decode_case(args.batch, seed=0)
    bare, step, pure = case.bare, case.step, case.pure

    def apply() -> None:
        case.executor.apply(case.spec, case.table)

    gc.disable()
    jobs = {"bare plan()": bare, "step": step, "layout + plan": pure, "apply": apply}
    times = {name: host_us(fn, n=args.n, warmup=50) for name, fn in jobs.items()}
    medians = ", ".join(f"{k} {v:.1f}" for k, v in times.items())
    gpu = torch.cuda.get_device_name()
    print(f"decode batch {args.batch}, kv {KV}, page {PAGE}, {gpu}; blocks, µs: {medians}")
    for name, fn in (("step", step), ("bare plan()", bare)):
        calls, text = profiled(fn, args.n, args.lines)
        print(f"== {name}: {calls} function calls per call ==")
        print(text)


if __name__ == "__main__":
    main()
