#!/usr/bin/env python3
"""Attention sinks, chunked local attention and bidirectional windows: kernel time and
host cost (issue 26).

**Sinks** (gpt-oss shapes: 64 query / 8 KV heads x 64, bf16, page 16): GPU time per
call of three ways to run the same attention, each captured in a CUDA graph of 20 calls
and replayed (CUDA events around each replay, median of 30 replays / 20), so that host
launch overhead is not counted:

  raw, no sink   FlashInfer's wrapper ``run()`` without sinks (what a sink kernel
                 cannot beat: it reads the same KV and adds a term)
  raw sink       FlashInfer's own sink wrapper (``BatchDecodeWithAttentionSinkWrapper``
                 / ``BatchAttentionWithAttentionSinkWrapper``, JIT-built) called by hand
  flashplan      ``FlashInferExecutor.run(group, ..., sinks=...)``: the plan's call on
                 FlashInfer's sink kernel (its sink wrapper, planned by flashplan)

Decode at batch 1, 64 and 256 over 4096 keys, and an extend of 16 x (2048 cached + 512
new), for the sliding-window-128 and the full layer; the output of flashplan against the
raw sink wrapper's (max abs error relative to the output's largest value); and one long
decode (32768 keys, split over many CTAs) with large sinks, where a sink counted more
than once would show in that error.
``--compile-only`` builds the sink wrappers' JIT modules and exits (run it in the
background while something else uses the GPU).

**Chunked planning** (host): ``plan()`` of an extend batch of 256 requests (cached
prefixes 0..3000, 1..600 new tokens, page 16) with a chunked group (Llama 4's 8192; and
512, so that most requests cross a chunk boundary) against the same batch with a
full-attention group; medians of 300 after 20 warm-up calls.

**Bidirectional windows** (EmbeddingGemma-like encoder pass: 64 requests of 256..2048
tokens, window 255 on both sides, 16/4 heads x 128, page 16): host time of ``plan()`` and
``apply()`` (the position mask is built on the device by the fused gather launch), the
device time of building the mask alone, and the same masks built the way the reference
file builds custom masks (a Python loop over the requests, torch ops per request).

    python3 benchmarks/bench_local.py [--skip-gpu] [--compile-only] [--parts sinks,chunks,band]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flashplan as fp
from flashplan.executor.flashinfer.calls import SINK_WRAPPERS, WrapperKind

HQ, HKV, D, PAGE = 64, 8, 64, 16
SINK_LAYERS = (("window 128", 127), ("full", -1))
WORKSPACE = 256 << 20


# --------------------------------------------------------------------------- timing
def _host_us(fn: Callable[[], object], n: int = 300, warmup: int = 20) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def _idle_host_us(fn: Callable[[], object], n: int = 50, warmup: int = 5) -> float:
    """Median host time (µs) of ``fn`` issued on an idle GPU (synchronized before)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def _graph_us(fn: Callable[[], object], inner: int = 20, reps: int = 30) -> float:
    """GPU µs per call of ``fn``: ``inner`` calls captured in one CUDA graph, replayed
    ``reps`` times after warm-up (median replay / inner). Where ``fn`` cannot be
    captured, the ``inner`` calls are queued on the stream instead (host overhead may
    then show) and the figure is returned negative, so that the table marks it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    sign = 1.0
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(inner):
                fn()
    except Exception as err:
        print(f"  (not captured: {type(err).__name__}: {err}; timing queued calls)")
        torch.cuda.synchronize()
        sign = -1.0

        def replay() -> None:
            for _ in range(inner):
                fn()
    else:
        replay = graph.replay
    for _ in range(3):
        replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / inner)
    return sign * statistics.median(times)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-6))


# --------------------------------------------------------------------------- sinks
def _sink_wrapper(kind: WrapperKind, window: int):
    """FlashInfer's sink wrapper replacing ``kind`` (the library's own mapping), FA2."""
    import flashinfer

    ws = torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda")
    return getattr(flashinfer, SINK_WRAPPERS[kind])(
        ws, "NHD", backend="fa2", q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
        head_dim_qk=D, head_dim_vo=D, window_left=window,
    )  # fmt: skip


def compile_sink_modules() -> None:
    """Build (JIT) every sink module this benchmark uses."""
    for _, window in SINK_LAYERS:
        t0 = time.perf_counter()
        _sink_wrapper(WrapperKind.DECODE, window)
        _sink_wrapper(WrapperKind.PAGED_PREFILL, window)
        print(f"sink modules, window {window}: {time.perf_counter() - t0:.0f} s", flush=True)


def _page_ids(table: fp.PageTable, part: object) -> torch.Tensor:
    """The page ids a paged part reads, in order (built on the host once, for the raw
    wrappers)."""
    rows = table.pages.cpu().numpy()
    start, num = part.start_page, part.num_pages  # type: ignore[attr-defined]
    ids = [rows[i, int(start[i]) : int(start[i] + num[i])] for i in range(len(start))]
    return torch.from_numpy(np.concatenate(ids)).cuda()


def sink_kernels() -> list[str]:
    import flashinfer

    from flashplan.executor.flashinfer import ExecutorPolicy, FlashInferExecutor

    heads = fp.HeadConfig(num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D)
    scale = D**-0.5
    lines = [
        f"flashinfer {flashinfer.__version__}; GPU µs per call (CUDA graph of 20 calls)",
        "",
        "| step | layer | raw, no sink | raw sink wrapper | flashplan | raw sink / flashplan "
        "| raw no-sink / flashplan | flashplan vs raw sink (rel err) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    cases: list[tuple[str, list[int], list[int]]] = [
        (f"decode {bs} x 4096", [4096] * bs, [4095] * bs) for bs in (1, 64, 256)
    ]
    cases.append(("extend 16 x (2048 + 512)", [2560] * 16, [2048] * 16))
    # one long request (FlashInfer splits its keys over many CTAs) with sinks worth a
    # large share of the mass: a sink counted once per split would show in the error
    cases.append(("decode 1 x 32768, sinks + 8", [32768], [32767]))
    gen = torch.Generator(device="cuda").manual_seed(0)
    for label, seq, prefix in cases:
        decode = label.startswith("decode")
        sinks = torch.randn(HQ, generator=gen, device="cuda") * 2
        if label.endswith("+ 8"):
            sinks = sinks.abs() + 8.0
        for layer, window in SINK_LAYERS:
            group = fp.AttentionGroup(window_left=window, sinks=True)
            if decode:
                layout = fp.BatchLayout.decode(seq, page_size=PAGE, groups=[group])
            else:
                layout = fp.BatchLayout.extend(seq, prefix, page_size=PAGE, groups=[group])
            spec = fp.plan(layout, heads, extend_path="paged")
            table = fp.PageTable.sequential(spec.pages_needed, device="cuda")
            cache = torch.randn(
                int(table.num_pages or 1), 2, PAGE, HKV, D, generator=gen, device="cuda"
            ).to(torch.bfloat16)
            q = torch.randn(spec.total_q, HQ, D, generator=gen, device="cuda").to(torch.bfloat16)
            ex = FlashInferExecutor(policy=ExecutorPolicy(prefill_backend="fa2"))
            ex.apply(spec, table)
            part = spec.group_plan(group).paged
            assert part is not None
            dev = torch.device("cuda")
            indptr = torch.from_numpy(part.page_indptr).to(dev)
            ids = _page_ids(table, part)
            last = torch.from_numpy(part.last_page_len).to(dev)
            ws = torch.empty(WORKSPACE, dtype=torch.uint8, device=dev)
            if decode:
                tc = ex.calls[0].paged.wrapper.use_tensor_cores  # type: ignore[union-attr]
                raw = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tc)
                raw.plan(indptr, ids, last, HQ, HKV, D, PAGE, window_left=window,
                         q_data_type=torch.bfloat16)  # fmt: skip
                sink = _sink_wrapper(WrapperKind.DECODE, window)
                sink.plan(indptr, ids, last, HQ, HKV, D, PAGE, window_left=window,
                          q_data_type=torch.bfloat16)  # fmt: skip
            else:
                qo = torch.from_numpy(spec.qo_indptr).to(dev)
                raw = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
                sink = _sink_wrapper(WrapperKind.PAGED_PREFILL, window)
                for w in (raw, sink):
                    w.plan(qo, indptr, ids, last, HQ, HKV, D, PAGE, causal=True,
                           window_left=window, q_data_type=torch.bfloat16)  # fmt: skip
            t_raw = _graph_us(lambda: raw.run(q, cache))
            t_sink = _graph_us(lambda: sink.run(q, cache, sinks, scale))
            t_fp = _graph_us(lambda: ex.run(group, q, None, None, cache, sinks=sinks))
            got = ex.run(group, q, None, None, cache, sinks=sinks)
            err = _rel(got, sink.run(q, cache, sinks, scale))
            lines.append(
                f"| {label} | {layer} | {t_raw:.1f} | {t_sink:.1f} | {t_fp:.1f} | "
                f"{t_sink / t_fp:.3f} | {t_raw / t_fp:.3f} | {err:.1e} |"
            )
    return lines


# --------------------------------------------------------------------------- chunks
def chunked_planning() -> list[str]:
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, 3000, 256)
    seq = prefix + rng.integers(1, 600, 256)
    heads = fp.HeadConfig(num_qo_heads=40, num_kv_heads=8, head_dim=128)
    lines = [
        "| extend path | group | plan() µs | vs full | requests split | kernel rows |",
        "|---|---|---|---|---|---|",
    ]
    for path in ("paged", "ragged"):
        full = fp.BatchLayout.extend(seq, prefix, page_size=PAGE, groups=[fp.AttentionGroup()])
        base = _host_us(lambda: fp.plan(full, heads, extend_path=path))
        lines.append(f"| {path} | full | {base:.1f} | 1.00× | - | 256 |")
        for chunk in (8192, 512):
            group = fp.AttentionGroup.chunked(chunk)
            layout = fp.BatchLayout.extend(seq, prefix, page_size=PAGE, groups=[group])
            t = _host_us(lambda: fp.plan(layout, heads, extend_path=path))
            gp = fp.plan(layout, heads, extend_path=path).group_plan(group)
            split = int(((seq - 1) // chunk != prefix // chunk).sum())
            rows = gp.virtual.batch_size if gp.virtual is not None else 256
            lines.append(
                f"| {path} | chunked {chunk} | {t:.1f} | {t / base:.2f}× | {split} | {rows} |"
            )
    return lines


# --------------------------------------------------------------------------- bands
def _loop_masks(seq: list[int], window: int, dev: torch.device) -> torch.Tensor:
    """The masks built the reference file's way: per request, dense on the device,
    flattened, concatenated (then packed by FlashInfer's own packbits)."""
    import flashinfer

    parts = []
    for n in seq:
        pos = torch.arange(n, device=dev)
        dense = (pos[None, :] - pos[:, None]).abs() <= window
        parts.append(dense.flatten())
    flat = torch.cat(parts)
    return flashinfer.packbits(flat, bitorder="little")


def band_masks() -> list[str]:
    from flashplan.executor.flashinfer import FlashInferExecutor
    from flashplan.kernels import build_custom_mask

    rng = np.random.default_rng(1)
    seq = rng.integers(256, 2049, 64).tolist()
    heads = fp.HeadConfig(num_qo_heads=16, num_kv_heads=4, head_dim=128)
    band = fp.AttentionGroup.bidirectional(window_left=255, window_right=255)
    full = fp.AttentionGroup.bidirectional()
    dev = torch.device("cuda")
    lines = [
        "| batch | group | plan() µs | apply() µs (host) | mask bytes |",
        "|---|---|---|---|---|",
    ]
    specs = {}
    for label, group in (("band 255/255", band), ("full bidirectional", full)):
        layout = fp.BatchLayout.extend(seq, [0] * len(seq), page_size=PAGE, groups=[group])
        spec = fp.plan(layout, heads, extend_path="paged")
        table = fp.PageTable.sequential(spec.pages_needed, device=dev)
        ex = FlashInferExecutor()
        t_plan = _host_us(lambda: fp.plan(layout, heads, extend_path="paged"), n=100)

        t_apply = _idle_host_us(lambda: ex.apply(spec, table))
        pm = spec.group_plan(group).paged.position_mask  # type: ignore[union-attr]
        size = int(pm.indptr[-1]) if pm is not None else 0
        specs[label] = (spec, pm)
        lines.append(f"| 64 x 256..2048 | {label} | {t_plan:.1f} | {t_apply:.1f} | {size:,} |")
    _, pm = specs["band 255/255"]
    assert pm is not None
    q, kv = pm.qo_lens.astype(np.int64), pm.kv_lens.astype(np.int64)
    sizes = (q * kv + 7) // 8
    offsets = np.concatenate([[0], np.cumsum(sizes)])  # compact, in bytes
    nbytes = int(sizes.max())

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32)).to(dev)

    out = torch.empty(int(offsets[-1]), dtype=torch.uint8, device=dev)
    rule = torch.tensor([0, 255, 255, 0], dtype=torch.int32, device=dev)
    args = (t(pm.row_position), t(q), t(kv), t(offsets[:-1]), out, nbytes)
    pos = (t(pm.col_position), rule)
    t_dev = _graph_us(lambda: build_custom_mask(*args, position=pos), inner=5, reps=20)

    def loop() -> None:
        _loop_masks(seq, 255, dev)
        torch.cuda.synchronize()

    t_loop = _host_us(loop, n=10, warmup=2)
    lines += [
        "",
        f"- position mask built on the device (its kernel alone): {t_dev:.1f} µs for "
        f"{int(offsets[-1]):,} bytes",
        f"- the same masks built per request in a Python loop (torch ops on the device, "
        f"FlashInfer's packbits, synchronized): {t_loop:.0f} µs "
        f"({t_loop / t_dev:.0f}× the device build)",
    ]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip-gpu", action="store_true", help="host planning only (no CUDA)")
    ap.add_argument("--compile-only", action="store_true", help="build the sink modules")
    ap.add_argument("--parts", default="chunks,sinks,band")
    args = ap.parse_args()
    if args.compile_only:
        compile_sink_modules()
        return
    parts = args.parts.split(",")
    if "chunks" in parts:
        print("## chunked planning (host)\n")
        print("\n".join(chunked_planning()), flush=True)
    if args.skip_gpu or not torch.cuda.is_available():
        return
    if "sinks" in parts:
        print("\n## sinks (GPU)\n")
        print("\n".join(sink_kernels()), flush=True)
    if "band" in parts:
        print("\n## bidirectional windows (GPU)\n")
        print("\n".join(band_masks()), flush=True)


if __name__ == "__main__":
    main()
