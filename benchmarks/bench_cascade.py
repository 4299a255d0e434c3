#!/usr/bin/env python3
"""Shared prefixes on FlashInfer: cascade levels against plain plans (issue 28).

Decode batches, page 16, bf16, 32 query / 8 KV heads x 128, one layer, the cache read
only (no new K/V written), on a page table that keeps the sharing promise (the members
of a group hold its shared pages on the same page ids, as a prefix-caching engine does;
``flashplan.share_pages``):

  one prompt     64 requests x (8192 shared + 256 own), all in one group
  groups of 8    256 requests in 32 groups of 8 x (2048 shared + 128 own)
  two levels     256 requests: 1024 tokens shared by all, then groups of 8 sharing
                 1024 more, + 128 own
  nothing        64 requests x 8448, pairs sharing 8 tokens (less than a page): what
                 ``cascade="auto"`` plans, against no ``shared_prefix`` at all

For each: the kernel time (``triton.testing.do_bench``: CUDA events, L2 flushed, median)
of ``FlashInferExecutor.run`` on the plan without cascade, on the same table (``plain``)
and on a table where every request has its own pages (``plain, own pages``: nothing for
the L2 cache to share), and on the cascade plan (``cascade="on"``: one paged prefill call
per level, each request's own decode call, the LSE merges); the KV bytes each reads
(``flashplan.planning.cascade.cascade_bytes``); the host time of ``plan`` + ``apply``
(median of 200, GPU idle); what ``cascade="auto"`` decides; and the largest difference
between the cascade and the plain outputs (relative to the largest plain output).

    python3 benchmarks/bench_cascade.py [--json OUT.json] [--md OUT.md]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _timing import host_us, kernel_ms

import flashplan as fp
from flashplan.executor.flashinfer import FlashInferExecutor
from flashplan.planning.cascade import cascade_bytes

PAGE, HQ, HKV, D = 16, 32, 8, 128
DEV = "cuda"
FULL = fp.AttentionGroup.full()
HEADS = fp.HeadConfig(HQ, HKV, D, q_dtype=torch.bfloat16)


def cases() -> dict[str, tuple[fp.BatchLayout, fp.SharedPrefix]]:
    """The benchmark's batches and their sharing."""
    one = fp.BatchLayout.decode(np.full(64, 8192 + 256), page_size=PAGE)
    groups8 = [range(8 * g, 8 * g + 8) for g in range(32)]
    many = fp.BatchLayout.decode(np.full(256, 2048 + 128), page_size=PAGE)
    pairs = [range(2 * g, 2 * g + 2) for g in range(32)]
    return {
        "one prompt: 64 x (8192 + 256)": (one, fp.SharedPrefix.from_groups([range(64)], [8192])),
        "groups of 8: 256 x (2048 + 128)": (
            many, fp.SharedPrefix.from_groups(groups8, [2048] * 32),
        ),
        "two levels: 256 x (1024 + 1024 + 128)": (
            many, fp.SharedPrefix.nested(
                fp.ShareLevel.from_groups([range(256)], [1024]),
                fp.ShareLevel.from_groups(groups8, [2048] * 32),
            ),
        ),
        "nothing: 64 x 8448, pairs share 8": (
            one, fp.SharedPrefix.from_groups(pairs, [8] * 32),
        ),
    }  # fmt: skip


def batch_inputs(
    layout: fp.BatchLayout, shared: fp.SharedPrefix
) -> tuple[fp.PageTable, fp.PageTable, torch.Tensor, torch.Tensor]:
    """``(table with its own pages per request, table keeping the sharing promise,
    bf16 cache [num_pages, 2, PAGE, HKV, D], bf16 decode queries [bs, HQ, D])``."""
    own_pages = fp.PageTable.shuffled(layout.pages_needed, seed=1, device=DEV)
    table = fp.PageTable(
        fp.share_pages(shared, own_pages.pages, own_pages.rows, PAGE),
        own_pages.rows,
        own_pages.num_pages,
    )
    assert table.num_pages is not None
    gen = torch.Generator(device=DEV).manual_seed(0)
    cache = torch.randn(
        table.num_pages, 2, PAGE, HKV, D, generator=gen, device=DEV, dtype=torch.bfloat16
    )
    q = torch.randn(layout.batch_size, HQ, D, generator=gen, device=DEV, dtype=torch.bfloat16)
    return own_pages, table, cache, q


def measure(name: str, layout: fp.BatchLayout, shared: fp.SharedPrefix) -> dict[str, object]:
    own_pages, table, cache, q = batch_inputs(layout, shared)
    plain = fp.plan(layout, HEADS)
    auto = fp.plan(layout, HEADS, shared_prefix=shared, cascade="auto")
    on = fp.plan(layout, HEADS, shared_prefix=shared, cascade="on")
    out: dict[str, object] = {"case": name, "auto": "cascade" if auto.cascade else "plain"}
    plain_bytes, cascade_read = cascade_bytes(layout, shared, HEADS)
    out["plain_gb"], out["cascade_gb"] = plain_bytes / 1e9, cascade_read / 1e9

    def run_ms(spec: fp.PlanSpec, tbl: fp.PageTable) -> tuple[float, torch.Tensor]:
        ex = FlashInferExecutor()
        ex.apply(spec, tbl)
        ms = kernel_ms(lambda: ex.run(FULL, q, None, None, cache))
        return ms, ex.run(FULL, q, None, None, cache)

    out["plain_ms"], o_plain = run_ms(plain, table)
    out["plain_own_pages_ms"], _ = run_ms(plain, own_pages)
    out["cascade_ms"], o_cascade = run_ms(on, table)
    out["auto_ms"], _ = run_ms(auto, table)
    out["speedup"] = float(out["plain_ms"]) / float(out["cascade_ms"])  # type: ignore[arg-type]
    out["speedup_vs_own_pages"] = float(out["plain_own_pages_ms"]) / float(out["cascade_ms"])  # type: ignore[arg-type]
    out["auto_vs_plain"] = float(out["auto_ms"]) / float(out["plain_ms"])  # type: ignore[arg-type]
    ref = o_plain.float()
    out["max_rel_diff"] = float((o_cascade.float() - ref).abs().max() / ref.abs().max())

    def host(spec_of) -> float:  # type: ignore[no-untyped-def]
        ex = FlashInferExecutor()

        def step() -> None:
            ex.apply(spec_of(), table)

        return host_us(step, n=200, warmup=20)

    out["host_plain_us"] = host(lambda: fp.plan(layout, HEADS))
    out["host_cascade_us"] = host(
        lambda: fp.plan(layout, HEADS, shared_prefix=shared, cascade="on")
    )
    out["host_auto_us"] = host(lambda: fp.plan(layout, HEADS, shared_prefix=shared, cascade="auto"))
    out["host_ratio"] = float(out["host_cascade_us"]) / float(out["host_plain_us"])  # type: ignore[arg-type]
    out["host_auto_ratio"] = float(out["host_auto_us"]) / float(out["host_plain_us"])  # type: ignore[arg-type]
    print(out, flush=True)
    return out


def table_md(rows: list[dict[str, object]]) -> list[str]:
    lines = [
        f"Device: {torch.cuda.get_device_name()}; flashplan cascade vs plain, decode, "
        f"page {PAGE}, bf16 {HQ}/{HKV} x {D}, one layer.",
        "",
        "| batch | plain ms | plain, own pages ms | cascade ms | speed-up | "
        "KV read plain / cascade GB | auto picks | auto / plain | host plain µs | "
        "host cascade µs | host ratio | host auto ratio | max rel diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['plain_ms']:.3f} | {r['plain_own_pages_ms']:.3f} | "
            f"{r['cascade_ms']:.3f} | {r['speedup']:.2f}× | "
            f"{r['plain_gb']:.2f} / {r['cascade_gb']:.2f} | {r['auto']} | "
            f"{r['auto_vs_plain']:.3f}× | {r['host_plain_us']:.0f} | "
            f"{r['host_cascade_us']:.0f} | {r['host_ratio']:.2f}× | "
            f"{r['host_auto_ratio']:.2f}× | {r['max_rel_diff']:.1e} |"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--md", type=Path)
    args = ap.parse_args()
    rows = [measure(name, *case) for name, case in cases().items()]
    md = "\n".join(table_md(rows))
    print(md)
    if args.md:
        args.md.write_text(md + "\n")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
