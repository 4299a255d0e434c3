#!/usr/bin/env python3
"""Attention sinks and chunked local attention: kernel time and planning cost (#26).

Sinks (gpt-oss shapes: 64 query / 8 KV heads x 64, bf16, page 16, KV 4096 per request,
decode at batch 1, 64 and 256; the sliding-window-128 layer and the full layer): GPU
time per call (CUDA events, median of 50 after 10 warm-up calls) of

  raw        FlashInfer's decode wrapper ``run()`` without sinks, planned once (what a
             sink kernel cannot beat: it reads the same KV and adds a term)
  flashplan  ``FlashInferExecutor.run(group, ..., sinks=...)``: the same kernel with the
             LSE, and the sink folded into its state (one elementwise pass over out)
  ratio      raw / flashplan (>= 0.97 is the issue's bar against a raw sink kernel)

FlashInfer's own sink wrappers are listed when this flashinfer has them (their names
are printed), but not timed: their JIT build needs nvcc and minutes per variant.

Chunked planning (host, CPU): ``plan()`` of an extend batch of 256 requests (prefix
0..3000, 1..600 new tokens, page 16) with a chunked group (Llama 4: 8192; and 512, so
that many requests cross a boundary) against the same batch with a full-attention
group; medians of 200 after 20 warm-up calls.

    python3 benchmarks/bench_local.py [--skip-gpu]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flashplan as fp

HQ, HKV, D, PAGE, KV = 64, 8, 64, 16, 4096


def _plan_us(layout: fp.BatchLayout, heads: fp.HeadConfig, path: str, n: int = 300) -> float:
    for _ in range(20):
        fp.plan(layout, heads, extend_path=path)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fp.plan(layout, heads, extend_path=path)
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def chunked_planning() -> list[str]:
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, 3000, 256)
    seq = prefix + rng.integers(1, 600, 256)
    heads = fp.HeadConfig(num_qo_heads=40, num_kv_heads=8, head_dim=128)
    lines = [
        "| extend path | group | plan() µs | vs full | virtual requests |",
        "|---|---|---|---|---|",
    ]
    for path in ("paged", "ragged"):
        full = fp.BatchLayout.extend(seq, prefix, page_size=PAGE, groups=[fp.AttentionGroup()])
        base = _plan_us(full, heads, path)
        lines.append(f"| {path} | full | {base:.1f} | 1.00× | - |")
        for chunk in (8192, 512):
            groups = [fp.AttentionGroup.chunked(chunk)]
            layout = fp.BatchLayout.extend(seq, prefix, page_size=PAGE, groups=groups)
            t = _plan_us(layout, heads, path)
            gp = fp.plan(layout, heads, extend_path=path).group_plan(groups[0])
            n = gp.virtual.batch_size if gp.virtual is not None else 256
            lines.append(f"| {path} | chunked {chunk} | {t:.1f} | {t / base:.2f}× | {n} |")
    return lines


def _gpu_ms(fn, n: int = 50, warmup: int = 10) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def sink_kernels() -> list[str]:
    import flashinfer

    from flashplan.executor.flashinfer import FlashInferExecutor

    sink_names = sorted(n for n in dir(flashinfer) if "sink" in n.lower())
    heads = fp.HeadConfig(num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D)
    lines = [
        f"flashinfer {flashinfer.__version__}; its sink names: {', '.join(sink_names) or '-'}",
        "",
        "| decode batch | layer | raw run() µs | flashplan run(sinks=) µs | raw / flashplan |",
        "|---|---|---|---|---|",
    ]
    for bs in (1, 64, 256):
        for label, window in (("window 128", 127), ("full", -1)):
            group = fp.AttentionGroup(window_left=window, sinks=True)
            layout = fp.BatchLayout.decode([KV] * bs, page_size=PAGE, groups=[group])
            spec = fp.plan(layout, heads)
            table = fp.PageTable.sequential(spec.pages_needed, device="cuda")
            cache = torch.randn(
                int(table.num_pages or 1), 2, PAGE, HKV, D, device="cuda", dtype=torch.bfloat16
            )
            q = torch.randn(bs, HQ, D, device="cuda", dtype=torch.bfloat16)
            sinks = torch.randn(HQ, device="cuda")
            ex = FlashInferExecutor()
            ex.apply(spec, table)
            gp = spec.group_plan(group)
            assert gp.paged is not None
            ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
            raw = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                ws, "NHD", use_tensor_cores=ex.calls[0].paged.wrapper.use_tensor_cores
            )
            dev = torch.device("cuda")
            part = gp.paged
            rows = table.pages.cpu().numpy()
            ids = np.concatenate(
                [
                    rows[i, int(part.start_page[i]) : int(part.start_page[i] + part.num_pages[i])]
                    for i in range(bs)
                ]
            )  # the pages the trimmed window reads, as the reference file's way builds them
            raw.plan(
                torch.from_numpy(part.page_indptr).to(dev),
                torch.from_numpy(ids).to(dev),
                torch.from_numpy(part.last_page_len).to(dev),
                HQ, HKV, D, PAGE, window_left=window, q_data_type=torch.bfloat16,
            )  # fmt: skip
            t_raw = _gpu_ms(lambda: raw.run(q, cache)) * 1e3
            t_fp = _gpu_ms(lambda: ex.run(group, q, None, None, cache, sinks=sinks)) * 1e3
            lines.append(f"| {bs} | {label} | {t_raw:.1f} | {t_fp:.1f} | {t_raw / t_fp:.3f} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip-gpu", action="store_true", help="planning only (no CUDA needed)")
    args = ap.parse_args()
    print("## chunked planning (host)\n")
    print("\n".join(chunked_planning()))
    if not args.skip_gpu and torch.cuda.is_available():
        print("\n## sinks (GPU, CUDA events)\n")
        print("\n".join(sink_kernels()))


if __name__ == "__main__":
    main()
