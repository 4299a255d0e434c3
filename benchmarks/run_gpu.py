#!/usr/bin/env python3
"""flashplan GPU benchmarks: every case side by side in one run (H200).

Run on the GPU machine from the repo root (after ``source .whl/setup.sh``; the git-ignored
``.whl/`` folder carries FlashInfer there and is filled on a CPU machine by the lent machine's
kit, ``../shared/tools/device/prepare.sh``, outside this repository: see docs/benchmarks.md)::

    python3 benchmarks/run_gpu.py --out OUT_DIR                 # every part (~50 s on H200)
    python3 benchmarks/run_gpu.py --parts graph,host --out OUT  # some parts

Parts (``--parts``, default all, run in this order):
  copy     device-to-device copy bandwidth (bytes read + written / time): the ceiling.
  decode   decode, 32/8 heads x 128, bf16, batch {1, 64, 256}, kv 4096 and U[1, 8192],
           page {1, 16}: flashplan's executor vs raw FlashInfer on the same inputs
           (tensor-core and CUDA-core decode), as KV bytes read / kernel time; plus the
           decode-kernel policy table (MHA / GQA, tensor vs CUDA cores).
  host     host time of layout + plan + apply at batch {1, 64, 256, 1024} vs
           FlashInfer's bare plan() on ready pinned tensors vs the reference file's way
           (device cumsum + Triton gather + plan() with device indptrs), idle GPU and
           behind a ~20 ms kernel, and a sync check (``torch.cuda.set_sync_debug_mode``).
           Targets: <= 1.5x bare plan(); below the reference file's way; 0 syncs.
  graph    a 32-layer decode step (kv 4096, page 16), batch {1, 8, 64, 256}:
           (a) flashplan eager (layout + plan + apply + 32 runs), (b) flashplan graph
           replay with its replay planning (layout + plan + ``step.replay(spec, table)``),
           (b') the same over a bound page table (``bind_page_table``: the gather and
           the indptr refresh replay inside the graph), (c) raw FlashInfer captured by
           hand the reference file's way (graph-mode decode wrapper on fixed buffers;
           per step device cumsum + Triton gather into the fixed indices buffer,
           ``plan()`` with host indptrs, replay). Wall time per step (synced), median of
           ``--steps`` after warm-up. Targets: (b') <= 1.02x (c) at batch 1 and 8,
           <= 1.01x at 64 and 256 (issue 24);
           (a) / (b) >= 3 at batch 1. Plus replay-planning host time alone: flashplan vs
           the raw way's plan() vs the reference file's replay path (plan() with device
           indptrs: it syncs), idle and behind a 20 ms kernel.
  deterministic  decode bs {64, 256} kv 4096: kernel time with
           ``ExecutorPolicy(deterministic=True)`` vs the default, and whether one
           request's output is bit-identical across 5 batch compositions (both policies).
  extend   extend 16 x (2048 prefix + 512 new): ragged+paged+merge vs paged-only,
           FA2 vs FA3, one layer incl. the KV write.
  window   windowed-prefix mask for 256 requests (prefix U[1, 8192], extend 512, window
           4096): flashplan's host description + Triton build vs the reference file's
           per-request loop (target >= 20x); decode with a window group: bandwidth vs the
           keys actually read.

Kernel times: triton.testing.do_bench (CUDA events, L2 flushed, median after warm-up).
Host and step times: time.perf_counter medians after warm-up. Results: OUT/bench.json,
OUT/bench.md; a summary of every target (met / MISSED) is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import flashinfer
import triton
from _ref_kernels import ref_kv_indices_kernel
from _timing import blocked_us, kernel_ms, pinned, sleep_cycles
from _timing import host_us as _host_us

import flashplan as fp
from flashplan.executor.flashinfer import ExecutorPolicy, FlashInferExecutor
from flashplan.executor.flashinfer.bucket import GraphBucket
from flashplan.executor.flashinfer.calls import translate
from flashplan.executor.flashinfer.graphs import capture, graph_executor
from flashplan.executor.flashinfer.policy import decode_uses_tensor_cores

try:  # renamed from build_threshold_mask (same leading arguments)
    from flashplan.kernels import build_custom_mask as build_mask
except ImportError:  # pragma: no cover - older trees
    from flashplan.kernels import build_threshold_mask as build_mask  # type: ignore[no-redef]

HQ, HKV, D = 32, 8, 128
HEADS = fp.HeadConfig(num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D)
DT = torch.bfloat16
DEV = torch.device("cuda")
ELT = 2
ALL_PARTS = "copy,decode,host,graph,deterministic,extend,window"

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--out", default=os.environ.get("OUT", "."))
parser.add_argument("--parts", default=ALL_PARTS, help=f"comma-separated subset of {ALL_PARTS}")
parser.add_argument("--steps", type=int, default=50, help="timed steps per graph case")
ARGS = parser.parse_args()
PARTS = set(ARGS.parts.split(","))
unknown = PARTS - set(ALL_PARTS.split(","))
if unknown:
    parser.error(f"unknown parts {sorted(unknown)}; choose from {ALL_PARTS}")
os.makedirs(ARGS.out, exist_ok=True)
RESULTS: dict[str, Any] = {
    "gpu": torch.cuda.get_device_name(),
    "flashinfer": flashinfer.__version__,
    "torch": torch.__version__,
    "triton": triton.__version__,
    "date": time.strftime("%Y-%m-%d"),
}
MD: list[str] = []
SUMMARY: list[dict[str, Any]] = []
# one float workspace for every raw FlashInfer wrapper (they run one after another)
RAW_WS = torch.zeros(256 * 1024 * 1024, dtype=torch.uint8, device=DEV)


def log(*args: object) -> None:
    print("[bench]", *args, flush=True)


def save() -> None:
    RESULTS["summary"] = SUMMARY
    with open(os.path.join(ARGS.out, "bench.json"), "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)
    with open(os.path.join(ARGS.out, "bench.md"), "w") as f:
        f.write("\n".join(MD + summary_md()) + "\n")


def target(part: str, what: str, value: str, goal: str, met: bool) -> str:
    """Record a target in the summary; returns the table mark."""
    SUMMARY.append({"part": part, "what": what, "value": value, "target": goal, "met": met})
    return "met" if met else "**MISSED**"


def summary_md() -> list[str]:
    if not SUMMARY:
        return []
    rows = ["### Targets", "", "| part | what | measured | target | |", "|---|---|---|---|---|"]
    for s in SUMMARY:
        mark = "met" if s["met"] else "**MISSED**"
        rows.append(f"| {s['part']} | {s['what']} | {s['value']} | {s['target']} | {mark} |")
    return [*rows, ""]


# ------------------------------------------------------------------------ timing helpers
def host_us(fn: Callable[[], object], n: int = 100, warmup: int = 20) -> float:
    """Median host time of ``fn`` on an idle GPU (synchronized before each call)."""
    return _host_us(fn, n, warmup)


def step_us(fn: Callable[[], object], steps: int, warmup: int = 5) -> tuple[float, float]:
    """(median wall time of one synced step, mean per step of ``steps`` back to back)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    return statistics.median(times), (time.perf_counter() - t0) * 1e6 / steps


def count_syncs(fn: Callable[[], object]) -> int:
    """Syncs torch sees in one call of ``fn`` (``set_sync_debug_mode("warn")``)."""
    fn()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    # (torch warns once per process that the sync debug mode is a prototype: not a sync)
    messages = [str(w.message).lower() for w in caught]
    return sum("synchroniz" in m and "prototype" not in m for m in messages)


def raises_on_sync(fn: Callable[[], object]) -> bool:
    """Whether ``fn`` fails under ``set_sync_debug_mode("error")`` (i.e. it syncs)."""
    fn()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError:
        return True
    finally:
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    return False


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


# ------------------------------------------------------------------------ inputs
def shuffled_table(spec: fp.PlanSpec, seed: int) -> fp.PageTable:
    """Each request gets its own pages at random places of the pool, in a random row."""
    return fp.PageTable.shuffled(spec.pages_needed, seed=seed, device=DEV)


def kv_cache(table: fp.PageTable, page_size: int) -> torch.Tensor:
    assert table.num_pages is not None
    return torch.randn(table.num_pages, 2, page_size, HKV, D, device=DEV, dtype=DT)


def raw_decode_inputs(
    spec: fp.PlanSpec, table: fp.PageTable
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pinned indptr / last_page_len and device page ids, built with torch (no flashplan)."""
    part = spec.group_plans[0].paged
    assert part is not None
    pages = table.pages.cpu()
    idx = torch.cat(
        [
            pages[int(row), s : s + n]
            for row, s, n in zip(
                table.rows.tolist(), part.start_page.tolist(), part.num_pages.tolist(), strict=True
            )
        ]
    )
    return pinned(part.page_indptr), idx.to(DEV), pinned(part.last_page_len)


def ref_kv_indices(
    pages: torch.Tensor,
    rows: torch.Tensor,
    npages: torch.Tensor,
    indptr: torch.Tensor,
    out: torch.Tensor,
) -> None:
    ref_kv_indices_kernel[(rows.shape[0],)](
        pages, rows, npages, indptr, out, pages.stride(0), BLOCK=512
    )


class RefWay:
    """The reference file's per-batch preparation of a decode wrapper: lengths on the
    device, device cumsum + Triton gather of the page ids, then ``plan()``.

    ``plan_device`` feeds ``plan()`` the device indptr / last-page lengths (its default
    path: FlashInfer copies them back to the host, a sync); ``plan_host`` feeds it host
    (pinned) ones, as its ``fast_decode_plan`` route with ``global_override_indptr_cpu``
    does. ``indices`` is the page-id output (a graph wrapper's fixed buffer, or not).
    """

    def __init__(
        self, wrapper: Any, table: fp.PageTable, lens: np.ndarray, indices: torch.Tensor
    ) -> None:
        bs = lens.shape[0]
        self.w = wrapper
        self.pages = table.pages
        self.rows = torch.from_numpy(table.rows.astype(np.int32)).to(DEV)
        self.lens_cpu = lens.astype(np.int64)
        self.lens = torch.from_numpy(lens.astype(np.int32)).to(DEV)
        self.indptr = torch.zeros(bs + 1, dtype=torch.int32, device=DEV)
        self.indices = indices
        self.npages: torch.Tensor | None = None
        self.ring = [torch.empty(2 * bs + 1, dtype=torch.int32, pin_memory=True) for _ in range(4)]
        self.turn = 0

    def fill(self) -> None:
        """Device cumsum + Triton gather (writes ``indices`` in place)."""
        npages = (self.lens + 15) // 16
        self.indptr[1:] = torch.cumsum(npages, 0)
        ref_kv_indices(self.pages, self.rows, npages, self.indptr, self.indices)
        self.npages = npages

    def last_page_len(self) -> torch.Tensor:
        """Device last-page lengths [bs] of the pages ``fill`` counted."""
        assert self.npages is not None
        return self.lens - (self.npages - 1) * 16

    def plan_device(self) -> None:
        self.w.plan(
            self.indptr, self.indices, self.last_page_len(), HQ, HKV, D, 16,
            q_data_type=DT, kv_data_type=DT, non_blocking=True,
        )  # fmt: skip

    def host_arrays(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Pinned host indptr [bs + 1] and last-page lengths [bs] (a ring slot)."""
        buf = self.ring[self.turn]
        self.turn = (self.turn + 1) % len(self.ring)
        bs = self.lens_cpu.shape[0]
        host = buf.numpy()
        npages = (self.lens_cpu + 15) // 16
        host[0] = 0
        np.cumsum(npages, out=host[1 : bs + 1])
        host[bs + 1 :] = self.lens_cpu - (npages - 1) * 16
        return buf[: bs + 1], buf[bs + 1 :]

    def plan_fast(self) -> None:
        """FlashInfer's ``fast_decode_plan`` with the host indptr as
        ``global_override_indptr_cpu``: the reference file's decode replay path (its
        graph wrapper's fixed buffers were refreshed on the device by ``fill``)."""
        indptr, last = self.host_arrays()
        flashinfer.fast_decode_plan(
            self.w, indptr, self.indices, last, HQ, HKV, D, 16,
            q_data_type=DT, kv_data_type=DT, non_blocking=True,
            global_override_indptr_cpu=indptr,
        )  # fmt: skip

    def plan_host(self) -> None:
        indptr, last = self.host_arrays()
        self.w.plan(
            indptr, self.indices, last, HQ, HKV, D, 16,
            q_data_type=DT, kv_data_type=DT, non_blocking=True,
        )  # fmt: skip


# ------------------------------------------------------------------------ copy
def part_copy() -> float:
    n = 2 * 1024**3
    src = torch.randn(n, device=DEV, dtype=DT)
    dst = torch.empty_like(src)
    ms = kernel_ms(lambda: dst.copy_(src), rep=100)
    bw = 2 * n * ELT / ms / 1e9
    RESULTS["copy_TBps"] = bw
    torch.cuda.empty_cache()
    log(f"copy {bw:.2f} TB/s")
    MD.extend(
        ["### Copy ceiling", "", f"device-to-device copy: **{bw:.2f} TB/s** (read + write)", ""]
    )
    return bw


# ------------------------------------------------------------------------ decode
def part_decode(copy_bw: float) -> None:
    rng = np.random.default_rng(0)
    cases = [
        ("B1 kv4096", [4096]),
        ("B64 kv4096", [4096] * 64),
        ("B256 kv4096", [4096] * 256),
        ("B256 kv U[1,8192]", rng.integers(1, 8193, 256).tolist()),
    ]
    rows = []
    MD.extend(
        [
            "### Decode, bf16, 32/8 heads x 128",
            "",
            "| page | case | flashplan µs | raw FI tc µs | raw FI cuda-core µs | flashplan TB/s "
            "| raw tc / flashplan | % of copy |",
            "|---|---|---|---|---|---|---|---|",
        ]
    )
    for ps in (1, 16):
        for k, (name, lens) in enumerate(cases):
            layout = fp.BatchLayout.decode(lens, page_size=ps)
            spec = fp.plan(layout, HEADS)
            table = shuffled_table(spec, seed=k)
            cache = kv_cache(table, ps)
            q = torch.randn(len(lens), HQ, D, device=DEV, dtype=DT)
            ex = FlashInferExecutor()
            ex.apply(spec, table)
            group = layout.groups[0]
            t_fp = kernel_ms(lambda: ex.run(group, q, None, None, cache))
            ours = ex.run(group, q, None, None, cache)
            indptr, idx, last = raw_decode_inputs(spec, table)
            raw = {}
            for tc in (True, False):
                w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    RAW_WS, "NHD", use_tensor_cores=tc, backend="fa2"
                )
                w.plan(indptr, idx, last, HQ, HKV, D, ps, q_data_type=DT, kv_data_type=DT)
                err = rel_err(ours, w.run(q, cache))
                assert err < 2e-2, f"flashplan != raw FlashInfer ({err})"
                raw[tc] = kernel_ms(lambda w=w: w.run(q, cache))
            kv_bytes = sum(lens) * 2 * HKV * D * ELT
            bw = kv_bytes / t_fp / 1e9
            row = {
                "page_size": ps,
                "case": name,
                "flashplan_ms": t_fp,
                "raw_tc_ms": raw[True],
                "raw_cuda_core_ms": raw[False],
                "flashplan_TBps": bw,
                "ratio_vs_raw_tc": raw[True] / t_fp,
                "frac_of_copy": bw / copy_bw,
            }
            rows.append(row)
            log(row)
            MD.append(
                f"| {ps} | {name} | {t_fp * 1e3:.1f} | {raw[True] * 1e3:.1f} | "
                f"{raw[False] * 1e3:.1f} | {bw:.2f} | {raw[True] / t_fp:.3f} | "
                f"{100 * bw / copy_bw:.0f}% |"
            )
            torch.cuda.empty_cache()
    MD.extend(
        [
            "",
            "Decode kernel kind (raw FlashInfer, kv 4096, page 16):",
            "",
            "| heads q/kv | batch | tensor-core µs | cuda-core µs |",
            "|---|---|---|---|",
        ]
    )
    policy_rows = []
    for hq, hkv in ((32, 32), (32, 8), (32, 4)):
        for bs in (1, 4, 16, 64):
            npages = [4096 // 16] * bs
            indptr = torch.tensor([0, *np.cumsum(npages).tolist()], dtype=torch.int32).pin_memory()
            idx = torch.randperm(sum(npages), device=DEV).to(torch.int32)
            last = torch.full((bs,), 16, dtype=torch.int32).pin_memory()
            cache = torch.randn(sum(npages), 2, 16, hkv, D, device=DEV, dtype=DT)
            q = torch.randn(bs, hq, D, device=DEV, dtype=DT)
            t = {}
            for tc in (True, False):
                w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    RAW_WS, "NHD", use_tensor_cores=tc, backend="fa2"
                )
                w.plan(indptr, idx, last, hq, hkv, D, 16, q_data_type=DT, kv_data_type=DT)
                t[tc] = kernel_ms(lambda w=w: w.run(q, cache))
            policy_rows.append(
                {"hq": hq, "hkv": hkv, "batch": bs, "tc_ms": t[True], "cuda_core_ms": t[False]}
            )
            MD.append(f"| {hq}/{hkv} | {bs} | {t[True] * 1e3:.1f} | {t[False] * 1e3:.1f} |")
    RESULTS["decode"] = rows
    RESULTS["decode_kernel_kind"] = policy_rows
    MD.append("")
    save()


# ------------------------------------------------------------------------ host cost
def part_host() -> None:
    cycles = sleep_cycles(20.0)
    rows = []
    MD.extend(
        [
            "### Host cost of a decode batch (kv 4096, page 16), µs, median",
            "",
            "flashplan total = `BatchLayout.decode` + `plan` + `apply` (decode wrappers "
            "re-planned through `fast_decode_plan`; *fast_plan off*: every call a full "
            "`plan()`); FI bare = "
            "`plan()` on ready pinned indptrs + device page ids; ref-file way = device "
            "cumsum + Triton gather + `plan()` with device indptrs. *behind*: issued right "
            "after a 20 ms kernel. Syncs: counted with `set_sync_debug_mode`.",
            "",
            "| batch | layout | plan | apply | flashplan total | total, fast_plan off "
            "| FI bare | total / bare "
            "| ref-file way | flashplan behind | FI bare behind | ref way behind "
            "| syncs fp / bare / ref | ≤ 1.5x bare | < ref way |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
    )
    for bs in (1, 64, 256, 1024):
        lens = np.full(bs, 4096)
        layout = fp.BatchLayout.decode(lens, page_size=16)
        spec = fp.plan(layout, HEADS)
        table = shuffled_table(spec, seed=bs)
        ex = FlashInferExecutor()
        ex.apply(spec, table)
        t_layout = host_us(lambda: fp.BatchLayout.decode(lens, page_size=16))
        t_plan = host_us(lambda: fp.plan(layout, HEADS))
        t_apply = host_us(lambda: ex.apply(spec, table))

        def flashplan_step() -> None:
            ex.apply(fp.plan(fp.BatchLayout.decode(lens, page_size=16), HEADS), table)

        t_total = host_us(flashplan_step)
        ex_full = FlashInferExecutor(fast_plan=False)
        ex_full.apply(spec, table)
        t_total_full = host_us(
            lambda: ex_full.apply(fp.plan(fp.BatchLayout.decode(lens, page_size=16), HEADS), table)
        )
        indptr, idx, last = raw_decode_inputs(spec, table)
        tc = decode_uses_tensor_cores(HEADS, ExecutorPolicy(), bs)  # flashplan's choice
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            RAW_WS, "NHD", use_tensor_cores=tc, backend="fa2"
        )

        def bare() -> None:
            w.plan(
                indptr, idx, last, HQ, HKV, D, 16,
                q_data_type=DT, kv_data_type=DT, non_blocking=True,
            )  # fmt: skip

        t_bare = host_us(bare)
        w2 = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            RAW_WS, "NHD", use_tensor_cores=tc, backend="fa2"
        )
        part = spec.group_plans[0].paged
        assert part is not None
        ref = RefWay(w2, table, lens, torch.empty(part.total_pages, dtype=torch.int32, device=DEV))

        def ref_way() -> None:
            ref.fill()
            ref.plan_device()

        t_ref = host_us(ref_way)
        b_fp = blocked_us(flashplan_step, cycles)
        b_bare = blocked_us(bare, cycles)
        b_ref = blocked_us(ref_way, cycles)
        fp_syncs = raises_on_sync(flashplan_step)
        s_fp, s_bare, s_ref = count_syncs(flashplan_step), count_syncs(bare), count_syncs(ref_way)
        ratio = t_total / t_bare
        m_ratio = target("host", f"B{bs} layout+plan+apply / bare plan()", f"{ratio:.2f}x",
                         "<= 1.5x", ratio <= 1.5)  # fmt: skip
        m_ref = target("host", f"B{bs} flashplan total vs ref-file way (idle GPU)",
                       f"{t_total:.0f} vs {t_ref:.0f} µs", "below", t_total < t_ref)  # fmt: skip
        target("host", f"B{bs} syncs in layout+plan+apply", "error mode raised"
                        if fp_syncs else "0", "0", not fp_syncs and s_fp == 0)  # fmt: skip
        row = {
            "batch": bs,
            "layout_us": t_layout,
            "plan_us": t_plan,
            "apply_us": t_apply,
            "flashplan_total_us": t_total,
            "flashplan_total_fast_plan_off_us": t_total_full,
            "fi_bare_plan_us": t_bare,
            "ratio_total_vs_bare": ratio,
            "ref_way_us": t_ref,
            "blocked_flashplan_us": b_fp,
            "blocked_bare_us": b_bare,
            "blocked_ref_way_us": b_ref,
            "syncs_flashplan": s_fp,
            "flashplan_raises_in_error_mode": fp_syncs,
            "syncs_bare": s_bare,
            "syncs_ref_way": s_ref,
        }
        rows.append(row)
        log(row)
        MD.append(
            f"| {bs} | {t_layout:.0f} | {t_plan:.0f} | {t_apply:.0f} | {t_total:.0f} | "
            f"{t_total_full:.0f} | {t_bare:.0f} | {ratio:.2f} | {t_ref:.0f} | {b_fp:.0f} "
            f"| {b_bare:.0f} | {b_ref:.0f} | {s_fp} / {s_bare} / {s_ref} | {m_ratio} | {m_ref} |"
        )
    RESULTS["host"] = rows
    MD.append("")
    save()


# ------------------------------------------------------------------------ graph
class RawCapturedDecode:
    """Raw FlashInfer captured by hand, the reference file's way: a graph-mode decode
    wrapper on fixed buffers, per step the reference file's buffer refresh (device
    cumsum + Triton gather straight into the fixed indices buffer), ``plan()`` with host
    indptrs, then ``graph.replay()``."""

    def __init__(
        self, table: fp.PageTable, lens: np.ndarray, max_pages: int, tc: bool, fast: bool = False
    ) -> None:
        bs = lens.shape[0]
        self.fast = fast
        self.indptr_buf = torch.zeros(bs + 1, dtype=torch.int32, device=DEV)
        self.indices_buf = torch.zeros(bs * max_pages, dtype=torch.int32, device=DEV)
        self.last_buf = torch.ones(bs, dtype=torch.int32, device=DEV)
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            RAW_WS, "NHD", use_cuda_graph=True, use_tensor_cores=tc, backend="fa2",
            paged_kv_indptr_buffer=self.indptr_buf,
            paged_kv_indices_buffer=self.indices_buf,
            paged_kv_last_page_len_buffer=self.last_buf,
        )  # fmt: skip
        self.ref = RefWay(self.wrapper, table, lens, self.indices_buf)
        if fast:  # the refresh writes the fixed buffers themselves
            self.ref.indptr = self.indptr_buf
        self.graph = torch.cuda.CUDAGraph()
        self.out: torch.Tensor | None = None

    def plan(self) -> None:
        self.ref.fill()
        if self.fast:
            self.last_buf.copy_(self.ref.last_page_len())
            self.ref.plan_fast()
        else:
            self.ref.plan_host()

    def capture(self, q: torch.Tensor, cache: torch.Tensor, layers: int) -> None:
        self.ref.fill()
        self.ref.plan_host()  # the first plan is a full plan() (it builds the module)

        def forward() -> torch.Tensor:
            out = q
            for _ in range(layers):
                out = self.wrapper.run(q, cache)
            return out

        cur = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            forward()
        cur.wait_stream(side)
        with torch.cuda.graph(self.graph):
            self.out = forward()

    def step(self) -> torch.Tensor:
        self.plan()
        self.graph.replay()
        assert self.out is not None
        return self.out


def part_graph() -> None:
    layers, steps = 32, ARGS.steps
    cycles = sleep_cycles(20.0)
    rows, host_rows = [], []
    MD.extend(
        [
            f"### CUDA graphs: a {layers}-layer decode step (bf16 32/8 x 128, kv 4096, page 16)",
            "",
            "Wall time per step, µs: median of "
            f"{steps} synced steps (in brackets: mean of {steps} steps back to back, no sync "
            "between). (a) eager = layout + plan + apply + 32 `run`; (b) replay = layout + "
            "plan + `step.replay(spec, table)`; (c) raw captured = the reference file's "
            "buffer refresh (device cumsum + Triton gather) + `plan()` with host indptrs + "
            "replay; (c') the same with FlashInfer's `fast_decode_plan` (host indptr "
            "override, host last-page lengths) instead of `plan()`, the reference file's "
            "decode replay path. The target is judged against (c), the issue's raw "
            "baseline. One KV cache serves all layers (the same for every variant).",
            "",
            "| batch | (a) eager | (b) flashplan replay | (b') replay, bound table "
            "| (c) raw captured | (c') raw, fast_decode_plan | (b) / (c) | (b') / (c) "
            "| (b) / (c') | (a) / (b) | (b') ≤ 1.02x raw (B1, B8), ≤ 1.01x (B64, B256) "
            "| ≥ 3x eager (B1) | max rel. err (b)/(b')/(c)/(c') vs (a) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
    )
    for bs in (1, 8, 64, 256):
        lens = np.full(bs, 4096)
        layout0 = fp.BatchLayout.decode(lens, page_size=16)
        spec0 = fp.plan(layout0, HEADS)
        group = layout0.groups[0]
        table = shuffled_table(spec0, seed=100 + bs)
        cache = kv_cache(table, 16)
        q = torch.randn(bs, HQ, D, device=DEV, dtype=DT)
        max_pages = 4096 // 16

        ex = FlashInferExecutor()

        def eager_step() -> torch.Tensor:
            ex.apply(fp.plan(fp.BatchLayout.decode(lens, page_size=16), HEADS), table)
            out = q
            for _ in range(layers):
                out = ex.run(group, q, None, None, cache)
            return out

        def replayed(gx: FlashInferExecutor) -> Callable[[], torch.Tensor]:
            """A step of layout + plan + replay of a graph captured on ``gx``."""
            gx.apply(spec0, table)

            def forward() -> torch.Tensor:
                out = q
                for _ in range(layers):
                    out = gx.run(group, q, None, None, cache)
                return out

            captured = capture(gx, forward)

            def step() -> torch.Tensor:
                spec = fp.plan(fp.BatchLayout.decode(lens, page_size=16), HEADS)
                return captured.replay(spec, table)

            return step

        gx = graph_executor(FlashInferExecutor(), GraphBucket.decode(bs, max_pages))
        graph_step = replayed(gx)
        # (b') the same over a bound page table: the gather and the indptr refresh replay
        # inside the graph
        bound = FlashInferExecutor()
        bound.bind_page_table(table.pages, num_pages=table.num_pages)
        bx = bound.for_bucket(GraphBucket.decode(bs, max_pages))
        bound_step = replayed(bx)
        assert bx._buffers.captured is not None

        tc = decode_uses_tensor_cores(HEADS, ExecutorPolicy(), bs)  # the bucket's choice
        raw = RawCapturedDecode(table, lens, max_pages, tc)
        raw.capture(q, cache, layers)
        raw_fast = RawCapturedDecode(table, lens, max_pages, tc, fast=True)
        raw_fast.capture(q, cache, layers)

        want = eager_step().clone()
        err_g = rel_err(graph_step(), want)
        err_b = rel_err(bound_step(), want)
        assert err_b < 1e-2, (bs, err_b)
        err_r = rel_err(raw.step(), want)
        err_f = rel_err(raw_fast.step(), want)
        assert err_g < 1e-2 and err_r < 1e-2 and err_f < 1e-2, (bs, err_g, err_r, err_f)

        t_f, p_f = step_us(raw_fast.step, steps)
        t_r, p_r = step_us(raw.step, steps)
        t_g, p_g = step_us(graph_step, steps)
        t_b, p_b = step_us(bound_step, steps)
        t_e, p_e = step_us(eager_step, steps)
        # how far the eager executor's buffers grew while the host ran ahead (private)
        pool = getattr(ex, "_pool", None)
        ring = getattr(ex, "_ring", None)
        n_wrappers = sum(len(v) for v in pool.slots.values()) if pool is not None else -1
        n_slots = len(ring.slots) if ring is not None else -1
        vs_raw, vs_eager = t_g / t_r, t_e / t_g
        goal = 1.02 if bs <= 8 else 1.01  # issue 24's targets
        m_raw = target("graph", f"B{bs} flashplan replay, bound table / raw captured",
                       f"{t_b / t_r:.3f}x", f"<= {goal}x", t_b / t_r <= goal)  # fmt: skip
        m_eager = "—"
        if bs == 1:
            m_eager = target("graph", "B1 eager / flashplan replay", f"{vs_eager:.2f}x",
                             ">= 3x", vs_eager >= 3.0)  # fmt: skip
        row = {
            "batch": bs,
            "eager_us": t_e,
            "replay_us": t_g,
            "raw_captured_us": t_r,
            "raw_fast_captured_us": t_f,
            "replay_vs_raw_fast": t_g / t_f,
            "bound_replay_us": t_b,
            "bound_replay_pipelined_us": p_b,
            "bound_vs_raw": t_b / t_r,
            "rel_err_bound": err_b,
            "raw_fast_pipelined_us": p_f,
            "eager_pipelined_us": p_e,
            "replay_pipelined_us": p_g,
            "raw_pipelined_us": p_r,
            "replay_vs_raw": vs_raw,
            "eager_vs_replay": vs_eager,
            "rel_err_replay": err_g,
            "rel_err_raw": err_r,
            "eager_wrappers_after_pipelined": n_wrappers,
            "eager_pinned_slots_after_pipelined": n_slots,
        }
        rows.append(row)
        log(row)
        MD.append(
            f"| {bs} | {t_e:.0f} ({p_e:.0f}) | {t_g:.0f} ({p_g:.0f}) | {t_b:.0f} ({p_b:.0f}) | "
            f"{t_r:.0f} ({p_r:.0f}) | {t_f:.0f} ({p_f:.0f}) | {vs_raw:.3f} | {t_b / t_r:.3f} | "
            f"{t_g / t_f:.3f} | {vs_eager:.2f} | {m_raw} | {m_eager} | "
            f"{err_g:.1e} / {err_b:.1e} / {err_r:.1e} / {err_f:.1e} |"
        )

        # replay planning alone (host time, idle GPU and behind a 20 ms kernel)
        def fp_planning() -> None:
            gx.apply(fp.plan(fp.BatchLayout.decode(lens, page_size=16), HEADS), table)

        def fp_bound_planning() -> None:
            bx.apply(fp.plan(fp.BatchLayout.decode(lens, page_size=16), HEADS), table)

        def ref_replay_path() -> None:
            raw.ref.fill()
            raw.ref.plan_device()

        h = {
            "batch": bs,
            "fp_layout_plan_apply_us": host_us(fp_planning),
            "fp_apply_us": host_us(lambda: gx.apply(spec0, table)),
            "fp_bound_us": host_us(fp_bound_planning),
            "fp_bound_apply_us": host_us(lambda: bx.apply(spec0, table)),
            "fp_bound_syncs": count_syncs(fp_bound_planning),
            "raw_plan_us": host_us(raw.ref.plan_host),
            "raw_refresh_plan_us": host_us(raw.plan),
            "raw_refresh_fast_us": host_us(raw_fast.plan),
            "ref_replay_path_us": host_us(ref_replay_path),
            "fp_behind_us": blocked_us(fp_planning, cycles),
            "raw_behind_us": blocked_us(raw.plan, cycles),
            "ref_behind_us": blocked_us(ref_replay_path, cycles),
            "fp_syncs": count_syncs(fp_planning),
            "replay_raises_in_error_mode": raises_on_sync(graph_step),
            "ref_syncs": count_syncs(ref_replay_path),
        }
        host_rows.append(h)
        log(h)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    MD.extend(
        [
            "",
            "Replay planning alone, host µs (median, idle GPU; *behind*: issued right after "
            "a 20 ms kernel). flashplan = layout + plan + `graph_executor.apply` (apply alone "
            "in brackets; bound table: the graph replays the gather and indptr refresh); "
            "raw `plan()` = the graph wrapper's `plan()` on pinned host "
            "indptrs; raw refresh + `plan()` = what (c) does per step before the replay; "
            "ref-file replay path = device cumsum + Triton gather + `plan()` with device "
            "indptrs.",
            "",
            "| batch | flashplan | flashplan, bound table | raw plan() | raw refresh + plan() "
            "| raw refresh + fast_decode_plan | ref-file replay path "
            "| flashplan behind | raw behind | ref path behind | syncs fp + bound / ref "
            "| replay in error mode |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
    )
    for h in host_rows:
        MD.append(
            f"| {h['batch']} | {h['fp_layout_plan_apply_us']:.0f} ({h['fp_apply_us']:.0f}) | "
            f"{h['fp_bound_us']:.0f} ({h['fp_bound_apply_us']:.0f}) | "
            f"{h['raw_plan_us']:.0f} | {h['raw_refresh_plan_us']:.0f} | "
            f"{h['raw_refresh_fast_us']:.0f} | "
            f"{h['ref_replay_path_us']:.0f} | {h['fp_behind_us']:.0f} | "
            f"{h['raw_behind_us']:.0f} | {h['ref_behind_us']:.0f} | "
            f"{h['fp_syncs']} + {h['fp_bound_syncs']} / {h['ref_syncs']} | "
            f"{'raised (syncs)' if h['replay_raises_in_error_mode'] else 'ok (0 syncs)'} |"
        )
    RESULTS["graph"] = rows
    RESULTS["graph_replay_planning"] = host_rows
    MD.append("")
    save()


# ------------------------------------------------------------------------ deterministic
def one_request_in(
    ex: FlashInferExecutor, others: list[int], position: int, kv: torch.Tensor, q: torch.Tensor
) -> torch.Tensor:
    """The output of a 4096-token request decoded beside ``others`` at ``position``; it
    always reads pages 0..255 (the same cache bytes), the others pages from 300 on."""
    seq = [*others[:position], 4096, *others[position:]]
    spec = fp.plan(fp.BatchLayout.decode(seq, page_size=16), HEADS)
    need = spec.pages_needed.tolist()
    rows = np.zeros((len(seq), max(need)), dtype=np.int32)
    at = 300
    for i, n in enumerate(need):
        if i == position:
            rows[i, :n] = np.arange(n)
        else:
            rows[i, :n] = at + np.arange(n)
            at += n
    assert at <= kv.shape[0]
    table = fp.PageTable(torch.from_numpy(rows).to(DEV), np.arange(len(seq)), num_pages=kv.shape[0])
    qs = torch.randn(len(seq), HQ, D, device=DEV, dtype=DT)
    qs[position] = q
    ex.apply(spec, table)
    return ex.run(spec.key.groups[0], qs, None, None, kv)[position].clone()


def part_deterministic() -> None:
    det, default = ExecutorPolicy(deterministic=True), ExecutorPolicy()
    rows = []
    MD.extend(
        [
            "### Deterministic mode (decode, kv 4096, page 16, bf16 32/8 x 128)",
            "",
            "| batch | default µs | deterministic µs | cost | max abs diff |",
            "|---|---|---|---|---|",
        ]
    )
    for bs in (64, 256):
        lens = [4096] * bs
        layout = fp.BatchLayout.decode(lens, page_size=16)
        spec = fp.plan(layout, HEADS)
        table = shuffled_table(spec, seed=7 + bs)
        cache = kv_cache(table, 16)
        q = torch.randn(bs, HQ, D, device=DEV, dtype=DT)
        group = layout.groups[0]
        t, outs = {}, {}
        for name, policy in (("default", default), ("deterministic", det)):
            ex = FlashInferExecutor(policy=policy)
            ex.apply(spec, table)
            outs[name] = ex.run(group, q, None, None, cache)
            t[name] = kernel_ms(lambda ex=ex: ex.run(group, q, None, None, cache))
        diff = float((outs["default"].float() - outs["deterministic"].float()).abs().max())
        cost = t["deterministic"] / t["default"]
        rows.append({"batch": bs, "default_ms": t["default"], "det_ms": t["deterministic"],
                     "cost": cost, "max_abs_diff": diff})  # fmt: skip
        log(rows[-1])
        MD.append(
            f"| {bs} | {t['default'] * 1e3:.1f} | {t['deterministic'] * 1e3:.1f} | "
            f"{cost:.3f}x | {diff:.2e} |"
        )
        torch.cuda.empty_cache()
    gen = torch.Generator(device=DEV).manual_seed(7)
    kv = torch.randn(300 + 63 * 256 + 1024, 2, 16, HKV, D, generator=gen, device=DEV).to(DT)
    q1 = torch.randn(HQ, D, generator=gen, device=DEV).to(DT)
    comps = [([], 0), ([8000], 0), ([9, 8000, 40], 2), ([100] * 6, 5), ([4096] * 63, 17)]
    ident = {}
    for name, policy in (("deterministic", det), ("default", default)):
        ex = FlashInferExecutor(policy=policy)
        outs_c = [one_request_in(ex, others, pos, kv, q1) for others, pos in comps]
        same = [torch.equal(o, outs_c[0]) for o in outs_c[1:]]
        worst = max(float((o.float() - outs_c[0].float()).abs().max()) for o in outs_c[1:])
        ident[name] = {"identical": all(same), "per_composition": same, "max_abs_diff": worst}
        log(f"bit-identity across 5 compositions ({name}): {all(same)} {same} max {worst:.2e}")
    mark = target("deterministic", "one request bit-identical across 5 batch compositions",
                  str(ident["deterministic"]["identical"]), "True",
                  bool(ident["deterministic"]["identical"]))  # fmt: skip
    d = ident["default"]
    MD.extend(
        [
            "",
            "One 4096-token request decoded alone, beside 1 (8000), 3 (9, 8000, 40), 6 "
            "(100 each) and 63 (4096 each) others, at different positions: bit-identical "
            f"output with `deterministic=True`: **{ident['deterministic']['identical']}** "
            f"({mark}); with the default policy: {d['identical']} (per composition "
            f"{d['per_composition']}, max abs diff {d['max_abs_diff']:.2e}).",
            "",
        ]
    )
    RESULTS["deterministic"] = {"kernel": rows, "bit_identity": ident}
    save()


# ------------------------------------------------------------------------ extend
def part_extend() -> None:
    layout = fp.BatchLayout.extend([2048 + 512] * 16, [2048] * 16, page_size=16)
    group = layout.groups[0]
    rows = []
    MD.extend(
        [
            "### Extend 16 x (2048 prefix + 512 new), bf16 32/8 x 128, page 16, one layer "
            "incl. KV write",
            "",
            "| path | backend | ms | vs fastest |",
            "|---|---|---|---|",
        ]
    )
    for path in ("ragged", "paged"):
        spec = fp.plan(layout, HEADS, extend_path=path)
        table = shuffled_table(spec, seed=2)
        cache = kv_cache(table, 16)
        q = torch.randn(spec.total_q, HQ, D, device=DEV, dtype=DT)
        k = torch.randn(spec.total_q, HKV, D, device=DEV, dtype=DT)
        for backend in ("fa2", "fa3"):
            ex = FlashInferExecutor(policy=ExecutorPolicy(prefill_backend=backend))
            ex.apply(spec, table)
            ms = kernel_ms(lambda ex=ex: ex.run(group, q, k, k, cache), rep=100)
            rows.append({"path": spec.key.paths[0].value, "backend": backend, "ms": ms})
            log(rows[-1])
    best = min(r["ms"] for r in rows)
    for r in rows:
        MD.append(f"| {r['path']} | {r['backend']} | {r['ms']:.3f} | {r['ms'] / best:.2f}x |")
    RESULTS["extend"] = rows
    MD.append("")
    save()


# ------------------------------------------------------------------------ window
def sglang_style_masks(
    prefix: torch.Tensor, seq: torch.Tensor, start: torch.Tensor, window: int
) -> torch.Tensor:
    """The reference file's per-request loop (device tensors, .cpu() + Python loop)."""
    prefix_cpu = prefix.detach().cpu().tolist()
    extend_cpu = (seq - prefix).detach().cpu().tolist()
    start_cpu = start.detach().cpu().tolist()
    parts = []
    for p, e, s in zip(prefix_cpu, extend_cpu, start_cpu, strict=True):
        n = int(p - s)
        if n == 0 or e == 0:
            continue
        q_abs = torch.arange(e, device=DEV).view(-1, 1) + p
        k_abs = torch.arange(n, device=DEV).view(1, -1) + s
        parts.append((k_abs >= (q_abs - window)).to(torch.uint8).view(-1))
    return torch.cat(parts)


def part_window(copy_bw: float) -> None:
    rng = np.random.default_rng(3)
    window = 4096
    bs, ext = 256, 512
    prefix = rng.integers(1, 8193, bs)
    seq = prefix + ext
    group = fp.AttentionGroup(window_left=window)
    layout = fp.BatchLayout.extend(seq, prefix, page_size=1, groups=[group])
    policy = ExecutorPolicy(prefill_backend="fa2")
    spec = fp.plan(layout, HEADS, extend_path="ragged")
    table = shuffled_table(spec, seed=3)
    ex = FlashInferExecutor(policy=policy)

    def ours() -> None:  # the whole batch preparation: plan + apply (mask built on the GPU)
        ex.apply(fp.plan(layout, HEADS, extend_path="ragged"), table)

    prefix_dev = torch.from_numpy(prefix).to(DEV)
    seq_dev = torch.from_numpy(seq).to(DEV)
    start_dev = torch.clamp(prefix_dev - window, min=0)
    qo = torch.full((bs,), ext, dtype=torch.int32, device=DEV)
    kv = (prefix_dev - start_dev).to(torch.int32)

    def theirs() -> tuple[torch.Tensor, torch.Tensor]:  # per-request loop + device packbits
        mask = sglang_style_masks(prefix_dev, seq_dev, start_dev, window)
        mask_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=DEV)
        mask_indptr[1:] = torch.cumsum(qo * kv, 0)
        return flashinfer.segment_packbits(mask, mask_indptr, bitorder="little")

    staging = torch.empty(4 * bs + 1, dtype=torch.int32, pin_memory=True)  # as an executor's ring

    def ours_mask_only() -> tuple[torch.Tensor, np.ndarray]:
        """The same job as theirs: plan + translate + upload + Triton build (the upload
        from a persistent pinned buffer, as the executor stages)."""
        tr = translate(fp.plan(layout, HEADS, extend_path="ragged"), policy, sm90=True)
        (gi, recipe), = tr.inputs.masks.items()  # fmt: skip
        names = ("first_visible", "qo_lens", "kv_lens", "indptr")  # indptr[:bs]: bytes
        np.concatenate([tr.inputs.host[f"g{gi}.mask.{n}"] for n in names], out=staging.numpy())
        dev = staging.to(DEV, non_blocking=True)
        buf = torch.empty(recipe.total_bytes, dtype=torch.uint8, device=DEV)
        n = bs
        build_mask(
            dev[:n], dev[n : 2 * n], dev[2 * n : 3 * n], dev[3 * n : 4 * n], buf, recipe.max_bytes
        )
        return buf, tr.inputs.host[f"g{gi}.mask.indptr"][:-1]

    def synced(fn: Callable[[], object]) -> Callable[[], None]:
        def inner() -> None:
            fn()
            torch.cuda.synchronize()

        return inner

    t_ours = host_us(synced(ours), n=10, warmup=3)
    t_mask = host_us(synced(ours_mask_only), n=10, warmup=3)
    t_theirs = host_us(synced(theirs), n=10, warmup=3)
    # where the mask-only job's time goes: host planning, host translation, device build
    t_plan_w = host_us(lambda: fp.plan(layout, HEADS, extend_path="ragged"), n=20, warmup=3)
    spec_w = fp.plan(layout, HEADS, extend_path="ragged")
    t_translate = host_us(lambda: translate(spec_w, policy, sm90=True), n=20, warmup=3)
    built_once, _ = ours_mask_only()
    tr_w = translate(spec_w, policy, sm90=True)
    ((gi_w, recipe_w),) = tr_w.inputs.masks.items()
    arrays_w = [
        torch.from_numpy(np.array(tr_w.inputs.host[f"g{gi_w}.mask.{n}"])).to(DEV)
        for n in ("first_visible", "qo_lens", "kv_lens", "byte_offsets")
    ]
    t_build = kernel_ms(lambda: build_mask(*arrays_w, built_once, recipe_w.max_bytes), rep=50)
    cycles = sleep_cycles(20.0)
    b_ours = blocked_us(ours, cycles)
    # identical bits: each request's packed bytes, ours (at flashplan's byte offsets) vs
    # theirs (segment_packbits' compact layout)
    built, offsets = ours_mask_only()
    packed, packed_indptr = theirs()
    built_np, packed_np = built.cpu().numpy(), packed.cpu().numpy()
    p_ptr = packed_indptr.cpu().numpy().astype(np.int64)
    sizes = np.diff(p_ptr)
    src = np.repeat(offsets.astype(np.int64), sizes) + (
        np.arange(int(sizes.sum())) - np.repeat(p_ptr[:-1], sizes)
    )
    same = bool(np.array_equal(built_np[src], packed_np[: int(p_ptr[-1])]))
    # decode with a window group: bandwidth over the keys actually read
    lens = rng.integers(1, 8193, 256).tolist()
    wgroup = fp.AttentionGroup(window_left=window - 1)
    dl = fp.BatchLayout.decode(lens, page_size=16, groups=[wgroup])
    dspec = fp.plan(dl, HEADS)
    dtable = shuffled_table(dspec, seed=4)
    cache = kv_cache(dtable, 16)
    q = torch.randn(256, HQ, D, device=DEV, dtype=DT)
    dex = FlashInferExecutor()
    dex.apply(dspec, dtable)
    t_dec = kernel_ms(lambda: dex.run(wgroup, q, None, None, cache))
    dpart = dspec.group_plans[0].paged
    assert dpart is not None
    read_tokens = int(dpart.kv_lens.sum())
    bw = read_tokens * 2 * HKV * D * ELT / t_dec / 1e9
    speed_mask, speed_all = t_theirs / t_mask, t_theirs / t_ours
    mark = target("window", "mask job (256 req.) vs reference per-request loop",
                  f"{speed_mask:.1f}x", ">= 20x", speed_mask >= 20)  # fmt: skip
    target("window", "identical mask bits", str(same), "True", same)
    RESULTS["window"] = {
        "mask_ours_plan_apply_us": t_ours,
        "mask_ours_mask_only_us": t_mask,
        "mask_ref_loop_us": t_theirs,
        "mask_plan_us": t_plan_w,
        "mask_translate_us": t_translate,
        "mask_build_kernel_ms": t_build,
        "mask_buffer_bytes": int(recipe_w.total_bytes),
        "speedup_mask_only": speed_mask,
        "speedup_plan_apply": speed_all,
        "identical_bytes": same,
        "ours_behind_20ms_kernel_us": b_ours,
        "decode_window_ms": t_dec,
        "decode_window_TBps": bw,
        "keys_read": read_tokens,
        "keys_total": int(sum(lens)),
    }
    log(RESULTS["window"])
    MD.extend(
        [
            "### Sliding window",
            "",
            "Windowed-prefix custom masks, 256 requests (prefix U[1, 8192], extend 512, "
            "window 4096), the ragged + paged path (synced, median):",
            "",
            "| job | ms | speed-up |",
            "|---|---|---|",
            f"| reference file's per-request loop + `segment_packbits` (mask only) | "
            f"{t_theirs / 1e3:.2f} | 1x |",
            f"| flashplan mask only: `plan` + translate + upload + Triton build | "
            f"**{t_mask / 1e3:.2f}** | {speed_mask:.1f}x ({mark}: ≥ 20x) |",
            f"| flashplan whole batch: `plan` + `apply` incl. both FlashInfer `plan()` calls | "
            f"{t_ours / 1e3:.2f} | {speed_all:.1f}x |",
            f"| the same, issued behind a 20 ms kernel (host time) | {b_ours / 1e3:.2f} | |",
            "",
            f"Identical mask bits (flashplan's device-built bytes vs the loop's): {same}. "
            f"The mask-only job splits into `plan` {t_plan_w / 1e3:.2f} ms + translate "
            f"{t_translate / 1e3:.2f} ms (host) + upload and the Triton build (kernel "
            f"{t_build:.3f} ms on the device, into a {recipe_w.total_bytes / 1e6:.0f} MB "
            "buffer laid out at FlashInfer 0.7.4's bit-count offsets).",
            "",
            f"Decode B256 kv U[1, 8192] with window_left {window - 1}: {t_dec * 1e3:.1f} µs for "
            f"{read_tokens} of {sum(lens)} keys = **{bw:.2f} TB/s** over the keys read "
            f"({100 * bw / copy_bw:.0f}% of copy).",
            "",
        ]
    )
    torch.cuda.empty_cache()
    save()


def print_summary() -> None:
    print("\n== targets ==")
    width = max((len(s["what"]) for s in SUMMARY), default=10)
    for s in SUMMARY:
        mark = "met" if s["met"] else "MISSED"
        print(f"{s['part']:<13} {s['what']:<{width}}  {s['value']:>22}  {s['target']:<9} {mark}")
    n_met = sum(s["met"] for s in SUMMARY)
    print(f"{n_met} of {len(SUMMARY)} targets met")


def main() -> None:
    t0 = time.perf_counter()
    timings = {}
    need_copy = bool(PARTS & {"copy", "decode", "window"})
    copy_bw = part_copy() if need_copy else 0.0
    steps: list[tuple[str, Callable[[], None]]] = [
        ("decode", lambda: part_decode(copy_bw)),
        ("host", part_host),
        ("graph", part_graph),
        ("deterministic", part_deterministic),
        ("extend", part_extend),
        ("window", lambda: part_window(copy_bw)),
    ]
    failed = []
    for name, fn in steps:
        if name in PARTS:
            t1 = time.perf_counter()
            try:
                fn()
            except Exception:  # report and go on: one broken part must not hide the rest
                failed.append(name)
                log(f"part {name} FAILED:\n{traceback.format_exc()}")
                MD.extend([f"### {name}: FAILED (see the log)", ""])
                torch.cuda.synchronize()
            timings[name] = time.perf_counter() - t1
            log(f"part {name}: {timings[name]:.1f} s")
    RESULTS["failed_parts"] = failed
    RESULTS["part_seconds"] = timings
    RESULTS["total_seconds"] = time.perf_counter() - t0
    save()
    print("\n".join(MD))
    print_summary()
    if failed:
        print(f"FAILED parts: {', '.join(failed)}")
    log(f"total {RESULTS['total_seconds']:.1f} s; wrote {ARGS.out}/bench.json, bench.md")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
