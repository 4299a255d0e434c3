#!/usr/bin/env python3
"""Multi-item scoring on the H200: flashplan's host planning vs the reference file's
per-request loop, and the multi-item kernel vs scoring the items as separate requests.

Run on the GPU machine from the repo root (after ``source .whl/setup.sh``)::

    python3 benchmarks/bench_multi_item.py --out OUT_DIR

The batch: 256 requests, each a 512-token prompt followed by 32 items of U[1, 8] tokens,
every item after a delimiter and a closing delimiter at the end (the reference file's
format), no cached prefix, page size 1 (sglang's token table), heads 32 q / 8 kv x 128,
bf16. Side by side in one run:

* **host**: building the batch's multi-item tensors and RoPE positions.
  - flashplan: ``BatchLayout.extend(..., item_delimiters=<per-request CPU tensors>)`` +
    ``plan`` + ``FlashInferExecutor.apply`` (which also gathers the page ids and calls
    FlashInfer's ``plan()``) + the positions' upload; wall time until the GPU is done.
  - the reference file's way (``_process_multi_item_scoring``, re-implemented here with
    the same algorithm and the same per-request device operations: a ``.item()``, a
    host-to-device copy, ``arange``, ``searchsorted``, a gather, a cast and an in-place
    positions write per request, then a padding ``cat`` per request and a ``stack`` of
    per-request maxima); it builds the multi-item tensors only.
  Both produce the same tensors (checked). The reference loop's misalignment on a batch
  with a request without delimiters is shown too.
* **kernel**: one attention layer.
  - multi-item: one paged prefill (FA2) over 256 x (512 + items) tokens;
  - separate requests, prompt cached: the prompts' prefill (256 x 512) plus 8192 item
    requests (512 cached prompt keys + the item), as an engine with a prefix cache does;
  - separate requests, no cache: 8192 requests of prompt + item (``--no-full``: skip).
  Separate requests run on FA2 and on the default policy (FA3 on the H200).

Kernel times: ``triton.testing.do_bench`` (CUDA events, L2 flushed, median after
warm-up). Host times: ``time.perf_counter`` medians after warm-up, GPU synchronised
before and after. Results: ``OUT/bench_multi_item.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import flashinfer
import triton
from _timing import host_us, kernel_ms, synced_us

import flashplan as fp
from flashplan.executor.flashinfer import ExecutorPolicy, FlashInferExecutor
from flashplan.testing.batches import scoring_batch as _scoring_batch

HQ, HKV, D = 32, 8, 128
DT = torch.bfloat16
DEV = torch.device("cuda")
BS, PROMPT, ITEMS, MAX_ITEM = 256, 512, 32, 8

parser = argparse.ArgumentParser()
parser.add_argument("--out", default=os.environ.get("OUT", "."))
parser.add_argument("--batch", type=int, default=BS)
parser.add_argument("--no-full", action="store_true", help="skip the no-cache separate case")
ARGS = parser.parse_args()
os.makedirs(ARGS.out, exist_ok=True)
RESULTS: dict[str, object] = {
    "gpu": torch.cuda.get_device_name(),
    "flashinfer": flashinfer.__version__,
    "torch": torch.__version__,
    "triton": triton.__version__,
    "date": time.strftime("%Y-%m-%d"),
}
MD: list[str] = []


def log(*args: object) -> None:
    print("[bench]", *args, flush=True)


def save() -> None:
    with open(os.path.join(ARGS.out, "bench_multi_item.json"), "w") as f:
        json.dump(RESULTS, f, indent=1)
    with open(os.path.join(ARGS.out, "bench_multi_item.md"), "w") as f:
        f.write("\n".join(MD) + "\n")


# ------------------------------------------------------------------------ the batch
def scoring_batch(
    rng: np.random.Generator, bs: int
) -> tuple[list[int], list[list[int]], list[list[int]]]:
    """(extend_lens, delimiters per request, item lengths per request)."""
    return _scoring_batch(rng, bs, prompt=PROMPT, items=ITEMS, max_item_len=MAX_ITEM)


# ------------------------------------------------------------------------ reference way
def reference_multi_item(
    delims_cpu: list[torch.Tensor],
    prefix_lens_cpu: list[int],
    extend_lens_cpu: list[int],
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor] | None:
    """The reference file's algorithm, per request with device ops (see module doc)."""
    prefix_len_ptr: list[int] = []
    rows: list[torch.Tensor] = []
    seq_start = 0
    for i, ext in enumerate(extend_lens_cpu):
        seq_end = seq_start + ext
        idx_cpu = delims_cpu[i]
        if len(idx_cpu) == 0:  # the reference skips it: later rows shift (the bug)
            seq_start = seq_end
            continue
        first = idx_cpu[0].item()
        idx = idx_cpu.to(DEV, non_blocking=True)
        prefix_len = first + prefix_lens_cpu[i]
        prefix_len_ptr.append(prefix_len)
        suffix = ext - first
        rel = idx - first
        steps = torch.arange(suffix, dtype=torch.int64, device=DEV)
        bucket = torch.searchsorted(rel, steps, right=True)
        last = rel[torch.clamp(bucket - 1, min=0)]
        in_item = steps - last
        rows.append(in_item.to(torch.uint16))
        positions[seq_start + first : seq_end] = prefix_len + in_item - 1
        seq_start = seq_end
    if not rows:
        return None
    width = max(t.numel() for t in rows)
    rows = [
        torch.cat([t, torch.zeros(width - t.numel(), dtype=torch.uint16, device=DEV)]) for t in rows
    ]
    return (
        torch.tensor(prefix_len_ptr, dtype=torch.uint32, device=DEV),
        torch.cat(rows, dim=0),
        width & 0xFFFFFFFF,
        torch.stack([t.to(torch.int32).max().to(torch.uint16) for t in rows], dim=0),
    )


def random_table(need: np.ndarray, rng: np.random.Generator) -> tuple[fp.PageTable, int]:
    total = int(need.sum())
    perm = rng.permutation(total).astype(np.int32)
    width = int(need.max())
    pages = np.zeros((need.shape[0], width), dtype=np.int32)
    starts = np.concatenate([[0], np.cumsum(need)])
    for i in range(need.shape[0]):  # set-up, not timed
        pages[i, : need[i]] = perm[starts[i] : starts[i + 1]]
    rows = np.arange(need.shape[0], dtype=np.int32)
    return fp.PageTable(pages=torch.from_numpy(pages).to(DEV), rows=rows), total


# ------------------------------------------------------------------------ host part
def part_host(heads: fp.HeadConfig) -> None:
    rng = np.random.default_rng(0)
    ext, delims, _ = scoring_batch(rng, ARGS.batch)
    bs = len(ext)
    delims_cpu = [torch.tensor(d, dtype=torch.int64) for d in delims]  # what sglang holds
    prefix_cpu = [0] * bs
    total_q = int(sum(ext))
    ex = FlashInferExecutor(policy=ExecutorPolicy(prefill_backend="fa2"))
    first = fp.plan(fp.BatchLayout.extend(ext, item_delimiters=delims_cpu), heads)
    table, _ = random_table(first.pages_needed.astype(np.int64), rng)
    table_pages = table.pages.cpu().numpy()  # set-up, not timed
    pinned = torch.empty(total_q, dtype=torch.int32, pin_memory=True)
    positions_dev = torch.empty(total_q, dtype=torch.int32, device=DEV)

    def ours_plan() -> fp.PlanSpec:
        layout = fp.BatchLayout.extend(ext, prefix_cpu, item_delimiters=delims_cpu)
        return fp.plan(layout, heads)

    def ours() -> None:
        spec = ours_plan()
        ex.apply(spec, table)
        ex.positions()  # built on the device from the plan's position runs

    def ours_host_positions() -> None:  # the positions materialized on the host instead
        spec = ours_plan()
        ex.apply(spec, table)
        pinned.numpy()[:] = spec.positions
        positions_dev.copy_(pinned, non_blocking=True)

    spec = ours_plan()
    ex.apply(spec, table)
    assert np.array_equal(ex.positions().cpu().numpy(), spec.positions)  # set-up check

    # What the reference file does next with its tensors: the paged wrapper's plan()
    # (given ready host indptrs and device page ids here, which spares it the
    # reference's own index kernel and device-to-host reads).
    part = spec.group_plans[0].paged
    assert part is not None
    raw = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
        torch.zeros(256 << 20, dtype=torch.uint8, device=DEV), "NHD", backend="fa2"
    )
    pin = {
        name: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32)).pin_memory()
        for name, a in (
            ("qo", spec.qo_indptr), ("kv", part.page_indptr), ("last", part.last_page_len),
        )
    }  # fmt: skip
    page_ids = torch.from_numpy(
        np.concatenate([table_pages[i, : int(part.num_pages[i])] for i in range(bs)])
    ).to(DEV)

    def ref_plan(ref: tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]) -> None:
        raw.plan(
            pin["qo"], pin["kv"], page_ids, pin["last"], heads.num_qo_heads,
            heads.num_kv_heads, heads.head_dim, 1, causal=True, q_data_type=DT,
            prefix_len_ptr=ref[0], token_pos_in_items_ptr=ref[1],
            token_pos_in_items_len=ref[2], max_item_len_ptr=ref[3], non_blocking=True,
        )  # fmt: skip

    def apply_only() -> None:
        ex.apply(spec, table)

    base = torch.from_numpy(np.concatenate([np.arange(e) for e in ext])).to(DEV)
    ref_positions = base.clone()

    def theirs() -> None:
        ref_positions.copy_(base)
        reference_multi_item(delims_cpu, prefix_cpu, ext, ref_positions)

    def theirs_and_plan() -> None:
        ref_positions.copy_(base)
        ref = reference_multi_item(delims_cpu, prefix_cpu, ext, ref_positions)
        assert ref is not None
        ref_plan(ref)

    t_plan = host_us(ours_plan)
    t_apply = host_us(apply_only)
    t_positions = host_us(lambda: (ex.apply(spec, table), ex.positions())) - host_us(apply_only)
    # The host is noisy: the four jobs are timed in three interleaved rounds (medians of
    # 30 calls for flashplan's, of 8 for the loops) and each reports the median round.
    samples: dict[str, list[float]] = {"ours": [], "host": [], "theirs": [], "plan": []}
    for _ in range(3):
        samples["ours"].append(synced_us(ours))
        samples["host"].append(synced_us(ours_host_positions))
        samples["theirs"].append(synced_us(theirs, n=8, warmup=1))
        samples["plan"].append(synced_us(theirs_and_plan, n=8, warmup=1))
    t_ours, t_ours_host, t_theirs, t_theirs_plan = (
        statistics.median(samples[k]) for k in ("ours", "host", "theirs", "plan")
    )

    # the same tensors
    ref = reference_multi_item(delims_cpu, prefix_cpu, ext, ref_positions)
    assert ref is not None
    items = spec.group_plans[0].items
    assert items is not None
    same = (
        ref[0].view(torch.int32).cpu().numpy().tolist() == items.prefix_len_ptr.tolist()
        and ref[1].view(torch.int16).cpu().numpy().astype(np.uint16).tolist()
        == items.token_pos_in_items.tolist()
        and ref[2] == items.token_pos_in_items_len
        and ref[3].view(torch.int16).cpu().numpy().astype(np.uint16).tolist()
        == items.max_item_len.tolist()
        and ref_positions.cpu().numpy().tolist() == spec.positions.tolist()
    )
    # the reference loop on a batch whose middle request has no delimiter
    mixed = list(delims_cpu)
    mixed[bs // 2] = torch.zeros(0, dtype=torch.int64)
    ref_mixed = reference_multi_item(mixed, prefix_cpu, ext, base.clone())
    assert ref_mixed is not None
    rows_ref = int(ref_mixed[0].shape[0])
    ours_mixed = fp.plan(fp.BatchLayout.extend(ext, item_delimiters=mixed), heads)
    ours_items = ours_mixed.group_plans[0].items
    assert ours_items is not None
    shifted = ref_mixed[0].view(torch.int32).cpu().numpy()[bs // 2]
    RESULTS["host"] = {
        "batch": bs,
        "total_q": total_q,
        "flashplan_layout_plan_us": t_plan,
        "flashplan_apply_host_us": t_apply,
        "flashplan_positions_on_device_host_us": t_positions,
        "flashplan_layout_plan_apply_positions_synced_us": t_ours,
        "flashplan_with_host_positions_upload_synced_us": t_ours_host,
        "reference_loop_synced_us": t_theirs,
        "reference_loop_and_plan_synced_us": t_theirs_plan,
        "speedup": t_theirs / t_ours,
        "speedup_with_plan_on_both_sides": t_theirs_plan / t_ours,
        "same_tensors": bool(same),
        "mixed_batch_rows_reference": rows_ref,
        "mixed_batch_rows_flashplan": ours_items.batch_size,
        "mixed_batch_reference_prefix_len_of_plain_request": int(shifted),
        "mixed_batch_flashplan_prefix_len_of_plain_request": int(
            ours_items.prefix_len_ptr[bs // 2]
        ),
    }
    log(RESULTS["host"])
    MD.extend(
        [
            "### Multi-item planning (host)",
            "",
            f"{bs} requests, a {PROMPT}-token prompt and {ITEMS} items of U[1, {MAX_ITEM}] "
            f"tokens each ({total_q} new tokens), page size 1. Wall time until the GPU is done:",
            "",
            "| | time |",
            "| --- | ---: |",
            f"| flashplan: layout + plan (host only) | {t_plan:.0f} µs |",
            f"| flashplan: apply (host issue: stage, 1 copy, gather, FlashInfer plan()) | "
            f"{t_apply:.0f} µs |",
            f"| flashplan: `executor.positions()` (runs copied, one fill launch) | "
            f"{t_positions:.0f} µs |",
            "| **flashplan: layout + plan + apply + positions on the device, synced** | "
            f"**{t_ours:.0f} µs** |",
            "| flashplan, the positions materialized on the host and uploaded instead, "
            f"synced | {t_ours_host:.0f} µs |",
            f"| reference file's per-request loop (multi-item tensors + positions only), "
            f"synced | **{t_theirs:.0f} µs** |",
            "| reference file's loop + FlashInfer plan() with its tensors (flashplan's "
            f"apply plans too), synced | {t_theirs_plan:.0f} µs |",
            f"| speedup: loop / flashplan | **{t_theirs / t_ours:.1f}x** |",
            f"| speedup: loop + plan() / flashplan | **{t_theirs_plan / t_ours:.1f}x** |",
            "",
            f"Identical tensors and positions: {same}. With request {bs // 2} made plain (no "
            f"delimiter), the reference loop returns {rows_ref} rows for {bs} requests, so "
            f"request {bs // 2} reads request {bs // 2 + 1}'s prefix_len_ptr ({int(shifted)}); "
            f"flashplan returns {ours_items.batch_size} rows, prefix_len_ptr "
            f"{int(ours_items.prefix_len_ptr[bs // 2])} (= its seq_len: plain causal) for it.",
            "",
        ]
    )
    save()


# ------------------------------------------------------------------------ kernel part
def _normal(*shape: int) -> torch.Tensor:
    return torch.empty(*shape, dtype=DT, device=DEV).normal_()


def _time_multi_item(heads: fp.HeadConfig, ext: list[int], delims: list[list[int]]) -> float:
    """One paged prefill (FA2) over every prompt and item of the batch."""
    rng = np.random.default_rng(2)
    spec = fp.plan(fp.BatchLayout.extend(ext, item_delimiters=delims), heads)
    table, pages = random_table(spec.pages_needed.astype(np.int64), rng)
    cache = _normal(pages, 2, 1, HKV, D)
    q = _normal(spec.total_q, HQ, D)
    ex = FlashInferExecutor(policy=ExecutorPolicy(prefill_backend="fa2"))
    ex.apply(spec, table)
    return kernel_ms(lambda: ex.run(fp.AttentionGroup(), q, None, None, cache))


def _time_cached_prompt(
    heads: fp.HeadConfig, bs: int, item_lens: np.ndarray, policy: ExecutorPolicy | None
) -> tuple[float, float]:
    """(prompts' prefill, item requests over the cached prompt) kernel times."""
    rng = np.random.default_rng(3)
    group = fp.AttentionGroup()
    p_spec = fp.plan(fp.BatchLayout.extend([PROMPT] * bs), heads)  # no prefix: ragged
    p_ex = FlashInferExecutor(policy=policy)
    p_tab, p_pages = random_table(p_spec.pages_needed.astype(np.int64), rng)
    p_ex.apply(p_spec, p_tab)
    pq = _normal(p_spec.total_q, HQ, D)
    pk, pv = _normal(p_spec.total_q, HKV, D), _normal(p_spec.total_q, HKV, D)
    p_cache = _normal(p_pages, 2, 1, HKV, D)
    t_prompt = kernel_ms(lambda: p_ex.run(group, pq, pk, pv, p_cache))
    # item requests share their request's prompt slots (page size 1: token slots)
    n_items = item_lens.shape[0]
    i_layout = fp.BatchLayout.extend(PROMPT + item_lens, np.full(n_items, PROMPT))
    i_spec = fp.plan(i_layout, heads)  # a cached prefix: paged
    rows = np.zeros((n_items, PROMPT + MAX_ITEM), dtype=np.int32)
    prompt_slots = np.arange(bs * PROMPT, dtype=np.int32).reshape(bs, PROMPT)
    rows[:, :PROMPT] = np.repeat(prompt_slots, ITEMS, axis=0)
    own = bs * PROMPT + np.arange(n_items * MAX_ITEM, dtype=np.int32)
    rows[:, PROMPT:] = own.reshape(n_items, MAX_ITEM)
    i_tab = fp.PageTable(
        pages=torch.from_numpy(rows).to(DEV), rows=np.arange(n_items, dtype=np.int32)
    )
    i_cache = _normal(bs * PROMPT + n_items * MAX_ITEM, 2, 1, HKV, D)
    i_ex = FlashInferExecutor(policy=policy)
    i_ex.apply(i_spec, i_tab)
    iq = _normal(i_spec.total_q, HQ, D)
    t_items = kernel_ms(lambda: i_ex.run(group, iq, None, None, i_cache))
    return t_prompt, t_items


def _time_no_cache(
    heads: fp.HeadConfig, item_lens: np.ndarray, policy: ExecutorPolicy | None
) -> float:
    """Every item as a request of its whole prompt + the item (ragged, no prefix)."""
    spec = fp.plan(fp.BatchLayout.extend(PROMPT + item_lens), heads)
    ex = FlashInferExecutor(policy=policy)
    ex.apply(spec, fp.PageTable.sequential(spec.pages_needed, device=DEV))
    q = _normal(spec.total_q, HQ, D)
    k, v = _normal(spec.total_q, HKV, D), _normal(spec.total_q, HKV, D)
    return kernel_ms(lambda: ex.run(fp.AttentionGroup(), q, k, v, None), rep=50)


def part_kernel(heads: fp.HeadConfig) -> None:
    rng = np.random.default_rng(1)
    ext, delims, lengths = scoring_batch(rng, ARGS.batch)
    bs = len(ext)
    res: dict[str, float] = {"multi_item_fa2_ms": _time_multi_item(heads, ext, delims)}
    torch.cuda.empty_cache()
    item_lens = np.array([n for lens in lengths for n in lens], dtype=np.int64)
    policies = (("fa2", ExecutorPolicy(prefill_backend="fa2")), ("auto", None))
    for name, policy in policies:
        t_prompt, t_items = _time_cached_prompt(heads, bs, item_lens, policy)
        res[f"separate_cached_prompt_{name}_prompt_ms"] = t_prompt
        res[f"separate_cached_prompt_{name}_items_ms"] = t_items
        res[f"separate_cached_prompt_{name}_ms"] = t_prompt + t_items
        torch.cuda.empty_cache()
    if not ARGS.no_full:
        for name, policy in policies:
            res[f"separate_no_cache_{name}_ms"] = _time_no_cache(heads, item_lens, policy)
            torch.cuda.empty_cache()

    RESULTS["kernel"] = res
    log(res)
    mi = res["multi_item_fa2_ms"]
    lines = [
        "### Multi-item kernel vs separate requests",
        "",
        f"One attention layer, {bs} x ({PROMPT}-token prompt + {ITEMS} items of U[1, "
        f"{MAX_ITEM}]), {HQ}/{HKV} heads x {D}, bf16, page size 1:",
        "",
        "| | kernel time | vs multi-item |",
        "| --- | ---: | ---: |",
        f"| multi-item, one paged prefill (FA2) | **{mi:.3f} ms** | 1.00x |",
    ]
    for name in ("fa2", "auto"):
        t = res[f"separate_cached_prompt_{name}_ms"]
        lines.append(
            f"| separate, prompt cached ({name}): prompts "
            f"{res[f'separate_cached_prompt_{name}_prompt_ms']:.3f} ms + {bs * ITEMS} item "
            f"requests {res[f'separate_cached_prompt_{name}_items_ms']:.3f} ms | "
            f"{t:.3f} ms | {t / mi:.2f}x |"
        )
    for name in ("fa2", "auto"):
        key = f"separate_no_cache_{name}_ms"
        if key in res:
            lines.append(
                f"| separate, no cache ({name}): {bs * ITEMS} requests of prompt + item | "
                f"{res[key]:.3f} ms | {res[key] / mi:.2f}x |"
            )
    MD.extend([*lines, ""])
    save()


def main() -> None:
    heads = fp.HeadConfig(num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, q_dtype=DT)
    part_host(heads)
    part_kernel(heads)
    save()
    print("\n".join(MD))


if __name__ == "__main__":
    main()
