#!/usr/bin/env python3
"""FP8 KV cache: decode bandwidth and host cost (issue 27).

Decode of 256 requests x 4096 cached keys, page 16, 32 query / 8 KV heads x 128, bf16
queries, one layer, the cache read only (no new K/V written), on both of FlashInfer's
decode kernels (``tc``: tensor cores, the FA2 prefill kernel; ``cuda``: the CUDA-core
decode kernel):

  flashplan      ``FlashInferExecutor.run(group, q, None, None, cache, k_scale=, v_scale=)``
                 after one ``apply``; number scales (folded into the softmax scale on the
                 host) and 0-d tensor scales (``q * k_scale`` and ``out *= v_scale`` on
                 the device: two small extra kernels)
  raw            FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` planned and run by
                 hand on the same cache (number scales)

Kernel time: ``triton.testing.do_bench`` (CUDA events, median). Bandwidth: the cache's
bytes (K and V of every token, at the cache dtype's size: 1 byte per element for fp8)
over the kernel time; the copy bandwidth is a device-to-device copy of 4 GiB, counted as
bytes read + written, measured in the same run. Host: ``BatchLayout.decode`` +
``plan`` + ``apply`` per step (µs, median of 200 after warm-up), bf16 against fp8.

    python3 benchmarks/bench_fp8.py [--json OUT.json] [--md OUT.md]
    python3 benchmarks/bench_fp8.py --probe-fa3   # does FA3 take bf16 q over an fp8 cache?
    python3 benchmarks/bench_fp8.py --probe-xqa   # FlashInfer's XQA decode on the same batch
    python3 benchmarks/bench_fp8.py --probe-splits  # raw tensor-core decode, KV split settings

``--probe-fa3`` plans and runs FlashInfer's paged prefill wrapper with ``backend="fa3"``,
bf16 queries and an e4m3 cache (a JIT build of minutes if it compiles at all) and prints
what happened against a float32 reference. ``--probe-xqa`` times FlashInfer's XQA decode
kernel (``xqa_batch_decode_with_kv_cache``: block tables, no LSE, a JIT build) on the same
e4m3 batch and compares its output with the FA2 tensor-core kernel's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _timing import host_us, kernel_ms, pinned

import flashplan as fp
from flashplan.executor.flashinfer import ExecutorPolicy, FlashInferExecutor

BATCH, KV_LEN, PAGE, HQ, HKV, D = 256, 4096, 16, 32, 8, 128
DEV = "cuda"
FULL = fp.AttentionGroup.full()
DTYPES = {"bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def random_cache(
    num_pages: int, dtype: torch.dtype, gen: torch.Generator | None = None
) -> torch.Tensor:
    """A ``[num_pages, 2, PAGE, HKV, D]`` cache of standard normal values in ``dtype``,
    drawn in slices (no float32 copy of it all)."""
    cache = torch.empty(num_pages, 2, PAGE, HKV, D, dtype=dtype, device=DEV)
    for i in range(0, num_pages, 4096):
        part = cache[i : i + 4096]
        part.copy_(torch.randn(part.shape, generator=gen, device=DEV))
    return cache


def decode_batch(
    dtype: torch.dtype,
) -> tuple[fp.HeadConfig, np.ndarray, fp.PlanSpec, fp.PageTable, torch.Tensor, torch.Tensor]:
    """The benchmark's decode batch with a ``dtype`` cache: ``(heads, lens, spec, table,
    cache, q)``, the cache and bf16 queries drawn from one seeded generator."""
    heads = fp.HeadConfig(HQ, HKV, D, q_dtype=torch.bfloat16, kv_dtype=dtype)
    lens = np.full(BATCH, KV_LEN)
    spec = fp.plan(fp.BatchLayout.decode(lens, page_size=PAGE), heads)
    table = fp.PageTable.shuffled(spec.pages_needed, seed=1, device=DEV)
    assert table.num_pages is not None
    gen = torch.Generator(device=DEV).manual_seed(0)
    cache = random_cache(table.num_pages, dtype, gen)
    q = torch.randn(BATCH, HQ, D, generator=gen, device=DEV).to(torch.bfloat16)
    return heads, lens, spec, table, cache, q


def copy_tb_s() -> float:
    """Device-to-device copy bandwidth (TB/s, bytes read + written) of 4 GiB."""
    src = torch.empty(1 << 32, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    ms = kernel_ms(lambda: dst.copy_(src))
    return 2 * (1 << 32) / (ms * 1e-3) / 1e12


def measure(name: str, tensor_cores: bool) -> dict[str, float | str]:
    """Kernel times and bandwidth of one cache dtype on one decode kernel kind."""
    import flashinfer

    dtype = DTYPES[name]
    heads, lens, spec, table, cache, q = decode_batch(dtype)
    ex = FlashInferExecutor(policy=ExecutorPolicy(decode_tensor_cores=tensor_cores))
    ex.apply(spec, table)
    fp8 = name != "bf16"
    numbers = (0.37, 1.9) if fp8 else (None, None)
    tensors = tuple(torch.tensor(s, device=DEV) for s in (0.37, 1.9)) if fp8 else (None, None)
    out: dict[str, float | str] = {"kv": name, "kernel": "tc" if tensor_cores else "cuda"}
    out["flashplan_ms"] = kernel_ms(
        lambda: ex.run(FULL, q, None, None, cache, k_scale=numbers[0], v_scale=numbers[1])
    )
    if fp8:
        out["flashplan_tensor_scales_ms"] = kernel_ms(
            lambda: ex.run(FULL, q, None, None, cache, k_scale=tensors[0], v_scale=tensors[1])
        )
    # raw FlashInfer on the same cache and page ids
    rows = table.rows.astype(np.int64)
    pages = table.pages.cpu()
    part = spec.group_plans[0].paged
    assert part is not None
    idx = torch.cat(
        [pages[r, s : s + n] for r, s, n in zip(rows, part.start_page, part.num_pages, strict=True)]
    ).to(DEV)
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device=DEV)
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        ws, "NHD", use_tensor_cores=tensor_cores, backend="fa2"
    )
    w.plan(
        pinned(part.page_indptr), idx, pinned(part.last_page_len), HQ, HKV, D, PAGE,
        q_data_type=torch.bfloat16, kv_data_type=dtype, non_blocking=True,
    )  # fmt: skip
    out["raw_ms"] = kernel_ms(lambda: w.run(q, cache, k_scale=numbers[0], v_scale=numbers[1]))
    # agreement of flashplan and raw on this batch (max abs difference / max |raw|)
    a = ex.run(FULL, q, None, None, cache, k_scale=numbers[0], v_scale=numbers[1])
    b = w.run(q, cache, k_scale=numbers[0], v_scale=numbers[1])
    out["vs_raw"] = float((a.float() - b.float()).abs().max() / b.float().abs().max())
    read = BATCH * KV_LEN * 2 * HKV * D * cache.element_size()
    out["bytes_read"] = read
    out["flashplan_tb_s"] = read / (float(out["flashplan_ms"]) * 1e-3) / 1e12

    # host: one decode step's layout + plan + apply
    def step() -> None:
        ex.apply(fp.plan(fp.BatchLayout.decode(lens, page_size=PAGE), heads), table)

    out["host_step_us"] = host_us(step, n=200, warmup=20)
    return out


def probe_fa3() -> str:
    """Whether FlashInfer's FA3 paged prefill runs bf16 queries over an e4m3 cache."""
    import flashinfer

    gen = torch.Generator(device=DEV).manual_seed(0)
    q = torch.randn(64, HQ, D, generator=gen, device=DEV).to(torch.bfloat16)
    kv = torch.randn(8, 2, PAGE, HKV, D, generator=gen, device=DEV)
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device=DEV)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    try:
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa3")
        w.plan(
            i32([0, 64]), i32([0, 8]), i32(list(range(8))).to(DEV), i32([PAGE]), HQ, HKV, D,
            PAGE, causal=True, q_data_type=torch.bfloat16, kv_data_type=torch.float8_e4m3fn,
        )  # fmt: skip
        out = w.run(q, kv.to(torch.float8_e4m3fn))
    except Exception as exc:  # the finding is the exception itself
        return f"refused: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    # float32 reference on the dequantized cache: 64 queries, the last 64 of 128 keys
    k = kv[:, 0].to(torch.float8_e4m3fn).float().reshape(-1, HKV, D)
    v = kv[:, 1].to(torch.float8_e4m3fn).float().reshape(-1, HKV, D)
    k, v = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)
    s = torch.einsum("qhd,khd->hqk", q.float(), k) / D**0.5
    pos = torch.arange(64, device=DEV)[:, None] + 64
    s = s.masked_fill(torch.arange(128, device=DEV)[None] > pos, float("-inf"))
    ref = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
    err = float((out.float() - ref).abs().max() / ref.abs().max())
    return f"ran: max rel error {err:.2e} against float32"


def probe_xqa() -> str:
    """XQA decode over the benchmark's e4m3 batch: kernel time, bandwidth, and its output
    against flashplan's (FA2, tensor cores)."""
    from flashinfer.decode import xqa_batch_decode_with_kv_cache

    _, _, spec, table, cache, q = decode_batch(torch.float8_e4m3fn)
    ex = FlashInferExecutor()
    ex.apply(spec, table)
    want = ex.run(FULL, q, None, None, cache, k_scale=0.37, v_scale=1.9)
    blocks = table.pages[torch.from_numpy(table.rows.astype(np.int64)).to(DEV)].contiguous()
    seq = torch.full((BATCH,), KV_LEN, dtype=torch.int32, device=DEV)
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device=DEV)
    call = lambda: xqa_batch_decode_with_kv_cache(  # noqa: E731
        q, cache, ws, blocks, seq, KV_LEN, bmm1_scale=0.37 / D**0.5, bmm2_scale=1.9
    )
    try:
        got = call()
        ms = kernel_ms(call)
    except Exception as exc:  # the finding is the exception itself
        return f"refused: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    err = float((got.float() - want.float()).abs().max() / want.float().abs().max())
    tb_s = BATCH * KV_LEN * 2 * HKV * D / (ms * 1e-3) / 1e12
    fa2 = kernel_ms(lambda: ex.run(FULL, q, None, None, cache, k_scale=0.37, v_scale=1.9))
    return (
        f"ran: {ms:.3f} ms ({tb_s:.2f} TB/s; FA2 tensor cores {fa2:.3f} ms), max rel "
        f"difference from FA2 {err:.2e}"
    )


def probe_splits() -> list[str]:
    """Raw FlashInfer tensor-core decode of the benchmark's batch (bf16 and e4m3 caches)
    under FlashInfer's KV-split settings and with sequential page ids: kernel ms, TB/s."""
    import flashinfer

    lines = []
    for name in ("bf16", "e4m3"):
        dtype = DTYPES[name]
        heads = fp.HeadConfig(HQ, HKV, D, q_dtype=torch.bfloat16, kv_dtype=dtype)
        spec = fp.plan(fp.BatchLayout.decode(np.full(BATCH, KV_LEN), page_size=PAGE), heads)
        part = spec.group_plans[0].paged
        assert part is not None
        n = int(part.page_indptr[-1])
        cache = random_cache(n, dtype)
        shuffled = torch.randperm(n, device=DEV).to(torch.int32)
        sequential = torch.arange(n, device=DEV, dtype=torch.int32)
        q = torch.randn(BATCH, HQ, D, device=DEV).to(torch.bfloat16)
        ws = torch.zeros(256 << 20, dtype=torch.uint8, device=DEV)
        read = BATCH * KV_LEN * 2 * HKV * D * cache.element_size()
        variants: list[tuple[str, dict[str, object], torch.Tensor]] = [
            ("default", {}, shuffled),
            ("no split", {"disable_split_kv": True}, shuffled),
            ("split 512", {"fixed_split_size": 512}, shuffled),
            ("split 1024", {"fixed_split_size": 1024}, shuffled),
            ("split 2048", {"fixed_split_size": 2048}, shuffled),
            ("sequential pages", {}, sequential),
        ]
        for label, kwargs, ids in variants:
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                ws, "NHD", use_tensor_cores=True, backend="fa2"
            )
            w.plan(
                pinned(part.page_indptr), ids, pinned(part.last_page_len), HQ, HKV, D, PAGE,
                q_data_type=torch.bfloat16, kv_data_type=dtype, **kwargs,
            )  # fmt: skip
            ms = kernel_ms(lambda w=w: w.run(q, cache))
            lines.append(f"{name} {label}: {ms:.3f} ms {read / ms / 1e9:.2f} TB/s")
        torch.cuda.empty_cache()
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--md", type=Path)
    ap.add_argument("--probe-fa3", action="store_true")
    ap.add_argument("--probe-xqa", action="store_true")
    ap.add_argument("--probe-splits", action="store_true")
    args = ap.parse_args()
    if args.probe_splits:
        print("\n".join(probe_splits()), flush=True)
        return
    if args.probe_fa3:
        print(f"FA3, bf16 q over an e4m3 cache: {probe_fa3()}", flush=True)
    if args.probe_xqa:
        print(f"XQA decode, bf16 q over an e4m3 cache: {probe_xqa()}", flush=True)
    if args.probe_fa3 or args.probe_xqa:
        return
    copy = copy_tb_s()
    torch.cuda.empty_cache()
    rows = []
    for tc in (True, False):
        for name in DTYPES:
            rows.append(measure(name, tc))
            torch.cuda.empty_cache()  # this row's cache is gone: free it before the next
    bf16 = {r["kernel"]: r for r in rows if r["kv"] == "bf16"}
    lines = [
        f"fp8 KV decode, {torch.cuda.get_device_name()}, batch {BATCH} x {KV_LEN}, page "
        f"{PAGE}, {HQ}/{HKV} heads x {D}, bf16 q; copy bandwidth {copy:.2f} TB/s "
        "(read + write)",
        "",
        "| kv | kernel | flashplan ms | tensor scales ms | raw ms | TB/s | of copy bw "
        "| tokens/s vs bf16 | host step µs | host vs bf16 | vs raw |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        base = bf16[str(r["kernel"])]
        tensor = r.get("flashplan_tensor_scales_ms")
        lines.append(
            f"| {r['kv']} | {r['kernel']} | {float(r['flashplan_ms']):.3f} "
            f"| {'' if tensor is None else f'{float(tensor):.3f}'} | {float(r['raw_ms']):.3f} "
            f"| {float(r['flashplan_tb_s']):.2f} | {float(r['flashplan_tb_s']) / copy:.0%} "
            f"| {float(base['flashplan_ms']) / float(r['flashplan_ms']):.2f}x "
            f"| {float(r['host_step_us']):.1f} "
            f"| {float(r['host_step_us']) / float(base['host_step_us']):.2f}x "
            f"| {float(r['vs_raw']):.1e} |"
        )
    text = "\n".join(lines)
    print(text)
    if args.md:
        args.md.write_text(text + "\n")
    if args.json:
        args.json.write_text(json.dumps({"copy_tb_s": copy, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
