"""Device parts of ``run_gpu.py``: ``graph`` (a CUDA-graph replayed decode step against a
raw captured one) and ``kernel`` (decode bandwidth through flashplan against raw
FlashInfer, and the copy ceiling). Kernel times: CUDA events (``_common.kernel_ms``);
step times: wall time of a synced step (``_common.step_us``), medians after warm-up."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from _common import (
    DT,
    ENV,
    HKV,
    HQ,
    PAGE,
    D,
    Report,
    executor,
    host_us,
    kernel_ms,
    rel_err,
    step_us,
    sync,
    workspace,
)
from _raw import RawCapturedDecode, decode_inputs, decode_wrapper, tensor_cores

import flashplan as fp

HEADS = fp.HeadConfig(num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D)


def _cache(table: fp.PageTable) -> torch.Tensor:
    assert table.num_pages is not None
    return torch.randn(table.num_pages, 2, PAGE, HKV, D, device=ENV.device, dtype=DT)


# -- graph ---------------------------------------------------------------------------------
def part_graph(rep: Report) -> None:
    from flashplan.executor.flashinfer import GraphBucket, capture, graph_executor

    s = ENV.sizes
    layers, steps = s.layers, s.steps
    ws = workspace()
    lines = []
    for bs in s.graph_batches:
        lens = np.full(bs, s.kv)
        layout0 = fp.BatchLayout.decode(lens, page_size=PAGE)
        spec0 = fp.plan(layout0, HEADS)
        group = layout0.groups[0]
        table = fp.PageTable.shuffled(spec0.pages_needed, seed=100 + bs, device=ENV.device)
        cache = _cache(table)
        q = torch.randn(bs, HQ, D, device=ENV.device, dtype=DT)
        max_pages = -(-s.kv // PAGE)
        ex = executor()

        def eager_step() -> torch.Tensor:
            ex.apply(fp.plan(fp.BatchLayout.decode(lens, page_size=PAGE), HEADS), table)
            out = q
            for _ in range(layers):
                out = ex.run(group, q, None, None, cache)
            return out

        gx = graph_executor(executor(), GraphBucket.decode(bs, max_pages))
        gx.apply(spec0, table)

        def forward() -> torch.Tensor:
            out = q
            for _ in range(layers):
                out = gx.run(group, q, None, None, cache)
            return out

        captured = capture(gx, forward)

        def replay_step() -> torch.Tensor:
            spec = fp.plan(fp.BatchLayout.decode(lens, page_size=PAGE), HEADS)
            return captured.replay(spec, table)

        def replay_planning() -> None:
            gx.apply(fp.plan(fp.BatchLayout.decode(lens, page_size=PAGE), HEADS), table)

        tc = tensor_cores(bs)  # the bucket's decode kernel kind
        raw = RawCapturedDecode(table, lens, max_pages, tc, ws)
        raw.capture(q, cache, layers)
        raw_fast = RawCapturedDecode(table, lens, max_pages, tc, ws, fast=True)
        raw_fast.capture(q, cache, layers)

        want = eager_step().clone()
        errs = [rel_err(f(), want) for f in (replay_step, raw.step, raw_fast.step)]
        assert max(errs) < 1e-2, (bs, errs)
        t_r, p_r = step_us(raw.step, steps)
        t_f, p_f = step_us(raw_fast.step, steps)
        t_g, p_g = step_us(replay_step, steps)
        t_e, p_e = step_us(eager_step, steps)
        h_fp = host_us(replay_planning, n=max(steps, 3))
        h_raw = host_us(raw.plan, n=max(steps, 3))
        case = f"decode B{bs}, {layers} layers"
        rep.add("graph", case, "flashplan replay (layout + plan + replay)", t_g, key=True)
        rep.add("graph", case, "raw captured (sglang refresh + plan() + replay)", t_r)
        rep.add("graph", case, "raw captured, fast_decode_plan", t_f)
        rep.add("graph", case, "flashplan eager (layout + plan + apply + runs)", t_e)
        rep.add("graph", case, "flashplan replay / raw captured", t_g / t_r, "x", key=True)
        rep.add("graph", case, "flashplan replay / raw fast_decode_plan", t_g / t_f, "x")
        rep.add("graph", case, "eager / replay (higher: graphs pay more)", t_e / t_g, "x")
        rep.add("graph", case, "pipelined: flashplan replay", p_g)
        rep.add("graph", case, "pipelined: raw captured", p_r)
        rep.add("graph", case, "replay planning host: flashplan", h_fp)
        rep.add("graph", case, "replay planning host: raw refresh + plan()", h_raw)
        lines.append(
            [
                str(bs),
                f"{t_e:.0f} ({p_e:.0f})",
                f"{t_g:.0f} ({p_g:.0f})",
                f"{t_r:.0f} ({p_r:.0f})",
                f"{t_f:.0f} ({p_f:.0f})",
                f"**{t_g / t_r:.3f}**",
                f"{t_g / t_f:.3f}",
                f"{t_e / t_g:.2f}",
                f"{h_fp:.0f} / {h_raw:.0f}",
                " / ".join(f"{e:.0e}" for e in errs),
            ]
        )
        print(f"[graph] B{bs}: {lines[-1]}", flush=True)
        sync()
        if ENV.cuda:
            torch.cuda.empty_cache()
    rep.table(
        f"CUDA graphs: a {layers}-layer decode step (kv {s.kv}, page {PAGE}, {HQ}/{HKV} x {D}, "
        "bf16), µs per step",
        [
            "batch",
            "flashplan eager",
            "flashplan replay",
            "raw captured",
            "raw, fast_decode_plan",
            "replay / raw",
            "replay / raw fast",
            "eager / replay",
            "replay planning host: fp / raw",
            "rel. err replay / raw / raw fast",
        ],
        lines,
        note=f"Median wall time of {steps} synced steps (in brackets: mean of {steps} steps "
        "back to back). flashplan replay = `BatchLayout.decode` + `plan` + "
        "`step.replay(spec, table)` of a bucket captured with `capture`; raw captured = a "
        "graph-mode FlashInfer decode wrapper captured by hand, per step sglang's buffer "
        "refresh (device cumsum + Triton gather into the fixed indices buffer) + `plan()` "
        "with host indptrs + replay (raw fast: `fast_decode_plan`, sglang's replay path). "
        "One KV cache serves every layer.",
    )


# -- kernel --------------------------------------------------------------------------------
def copy_tbps(rep: Report) -> float:
    """Device-to-device copy bandwidth (bytes read + written over time): the ceiling."""
    n = (1 << 30) if ENV.cuda else (1 << 20)
    src = torch.randn(n, device=ENV.device, dtype=DT)
    dst = torch.empty_like(src)
    ms = kernel_ms(lambda: dst.copy_(src), rep=100)
    bw = 2 * n * 2 / ms / 1e9
    rep.add("kernel", "copy", "device-to-device copy", bw, "TB/s")
    if ENV.cuda:
        torch.cuda.empty_cache()
    return bw


def part_kernel(rep: Report) -> None:
    s = ENV.sizes
    copy_bw = copy_tbps(rep)
    rng = np.random.default_rng(0)
    cases = [(f"B{bs} kv{s.kv}", np.full(bs, s.kv)) for bs in s.kernel_batches]
    big = s.kernel_batches[-1]
    cases.append((f"B{big} kv U[1,{2 * s.kv}]", rng.integers(1, 2 * s.kv + 1, big)))
    ws = workspace()
    lines = []
    for ps in (1, PAGE):
        for k, (name, lens) in enumerate(cases):
            layout = fp.BatchLayout.decode(lens, page_size=ps)
            spec = fp.plan(layout, HEADS)
            table = fp.PageTable.shuffled(spec.pages_needed, seed=k, device=ENV.device)
            assert table.num_pages is not None
            cache = torch.randn(table.num_pages, 2, ps, HKV, D, device=ENV.device, dtype=DT)
            q = torch.randn(len(lens), HQ, D, device=ENV.device, dtype=DT)
            ex = executor()
            ex.apply(spec, table)
            group = layout.groups[0]
            run: Callable[[], object] = lambda: ex.run(group, q, None, None, cache)  # noqa: E731
            t_fp = kernel_ms(run)
            ours = ex.run(group, q, None, None, cache)
            indptr, idx, last = decode_inputs(spec, table)
            raw = {}
            for tc in (True, False):
                w = decode_wrapper(ws, tc)
                w.plan(indptr, idx, last, HQ, HKV, D, ps, q_data_type=DT, kv_data_type=DT)
                err = rel_err(ours, w.run(q, cache))
                assert err < 2e-2, f"flashplan != raw FlashInfer ({err})"
                raw[tc] = kernel_ms(lambda w=w: w.run(q, cache))
            best = min(raw.values())
            bw = int(np.sum(lens)) * 2 * HKV * D * 2 / t_fp / 1e9
            case = f"decode page {ps} {name}"
            rep.add("kernel", case, "flashplan", t_fp, "ms")
            rep.add("kernel", case, "raw FI, tensor cores", raw[True], "ms")
            rep.add("kernel", case, "raw FI, CUDA cores", raw[False], "ms")
            rep.add("kernel", case, "flashplan / fastest raw", t_fp / best, "x", key=True)
            rep.add("kernel", case, "flashplan bandwidth", bw, "TB/s")
            rep.add(
                "kernel",
                case,
                "flashplan share of copy (higher is better)",
                bw / copy_bw,
                "x",
                key=ps == PAGE and "U[" not in name,
            )
            lines.append(
                [
                    str(ps),
                    name,
                    f"{t_fp * 1e3:.1f}",
                    f"{raw[True] * 1e3:.1f}",
                    f"{raw[False] * 1e3:.1f}",
                    f"**{t_fp / best:.3f}**",
                    f"{bw:.2f}",
                    f"{100 * bw / copy_bw:.0f}%",
                ]
            )
            print(f"[kernel] {lines[-1]}", flush=True)
            if ENV.cuda:
                torch.cuda.empty_cache()
    rep.table(
        f"Decode kernel, bf16 {HQ}/{HKV} x {D}: flashplan vs raw FlashInfer on the same inputs",
        [
            "page",
            "case",
            "flashplan µs",
            "raw tc µs",
            "raw cuda-core µs",
            "fp / fastest raw",
            "fp TB/s",
            "% of copy",
        ],
        lines,
        note=f"CUDA events (`triton.testing.do_bench`, L2 flushed, median). Device-to-device "
        f"copy (read + write): **{copy_bw:.2f} TB/s**. Bandwidth = KV bytes read / kernel "
        "time (at batch 1 the kernel is shorter than issuing it).",
    )
