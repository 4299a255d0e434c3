#!/usr/bin/env python3
"""Where does the host time of ``FlashInferExecutor.apply`` go? (cProfile, GPU machine)

python3 benchmarks/profile_apply.py [--batch 256] [--page-size 16]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
import warnings

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import flashinfer  # noqa: F401

import flashplan as fp
from flashplan.executor.flashinfer import FlashInferExecutor

parser = argparse.ArgumentParser()
parser.add_argument("--batch", type=int, default=256)
parser.add_argument("--page-size", type=int, default=16)
args = parser.parse_args()

heads = fp.HeadConfig(num_qo_heads=32, num_kv_heads=8, head_dim=128)
lens = np.full(args.batch, 4096)
layout = fp.BatchLayout.decode(lens, page_size=args.page_size)
spec = fp.plan(layout, heads)
table = fp.PageTable.sequential(spec.pages_needed, device="cuda")
ex = FlashInferExecutor()
for _ in range(20):
    ex.apply(spec, table)
torch.cuda.synchronize()
n = 200
t0 = time.perf_counter()
for _ in range(n):
    ex.apply(spec, table)
print(f"apply: {(time.perf_counter() - t0) / n * 1e6:.1f} us/iter (no sync between)")
prof = cProfile.Profile()
prof.enable()
for _ in range(n):
    ex.apply(spec, table)
prof.disable()
torch.cuda.synchronize()
stats = pstats.Stats(prof)
stats.sort_stats("tottime").print_stats(25)
stats.sort_stats("cumulative").print_stats(30)
