"""Host-time parts of ``run_gpu.py``: ``host`` (a decode step with cold caches),
``verify`` and ``multi_item`` (plan + apply), and ``sync`` (no device syncs). Each job is
timed on an idle GPU with ``time.perf_counter`` (µs), medians after warm-up; jobs compared
in one table are timed round by round (``_common.rounds_us``), so a noisy host's drift
reaches them alike, and their ratios are medians of the rounds' paired ratios."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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
    WaitCounter,
    behind_us,
    executor,
    fmt,
    kernel_ms,
    med,
    paired,
    pinned,
    raises_on_sync,
    rounds_us,
    sleep_cycles,
    sync,
    workspace,
)
from _raw import (
    SglangDecode,
    bare_decode_plan,
    bare_verify,
    decode_inputs,
    decode_wrapper,
    ref_gather,
    sglang_multi_item,
    sglang_verify,
    tensor_cores,
)

import flashplan as fp

HEADS = fp.HeadConfig(num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D)


def _pages(lens: np.ndarray) -> np.ndarray:
    return (np.asarray(lens, dtype=np.int64) + PAGE - 1) // PAGE


# -- host: a decode step, cold caches ------------------------------------------------------
class DecodeShapes:
    """A decode batch whose lengths are drawn afresh for every round (``kv + U[0,
    loop)`` per request: a decode loop's new KV lengths and page counts, nothing a cache
    keyed by content could keep), with each round's inputs for the three ways made
    ahead, untimed: flashplan's host lengths, the bare ``plan()``'s pinned indptr, device
    page ids and pinned last-page lengths, and sglang's device lengths."""

    def __init__(self, bs: int) -> None:
        s = ENV.sizes
        self.bs, self.rng = bs, np.random.default_rng(bs)
        room = np.full(bs, s.kv + s.loop)
        self.table = fp.PageTable.shuffled(_pages(room), seed=bs, device=ENV.device)
        self.pages_cpu = self.table.pages.cpu()
        self.rows = self.table.rows.astype(np.int64)
        self.lens = np.full(bs, s.kv)
        self.new(0)

    def new(self, _round: int) -> None:
        s = ENV.sizes
        self.lens = s.kv + self.rng.integers(0, s.loop, self.bs)
        npages = _pages(self.lens)
        self.indptr = pinned(np.concatenate([[0], np.cumsum(npages)]))
        self.last = pinned(self.lens - (npages - 1) * PAGE)
        idx = torch.cat([self.pages_cpu[r, :n] for r, n in zip(self.rows, npages, strict=True)])
        self.idx = idx.to(ENV.device)
        self.lens_dev = torch.from_numpy(self.lens.astype(np.int32)).to(ENV.device)


def part_host(rep: Report) -> None:
    s = ENV.sizes
    ws = workspace()
    cycles = sleep_cycles(20.0) if ENV.cuda else 0
    lines = []
    for bs in s.host_batches:
        shapes = DecodeShapes(bs)
        ex = executor()
        tc = tensor_cores(bs)
        w_bare, w_ref = decode_wrapper(ws, tc), decode_wrapper(ws, tc)
        part_pages = int(_pages(np.full(bs, s.kv + s.loop)).sum())
        ref = SglangDecode(
            w_ref, shapes.table, torch.empty(part_pages, dtype=torch.int32, device=ENV.device)
        )

        def flashplan_step() -> None:
            layout = fp.BatchLayout.decode(shapes.lens, page_size=PAGE)
            ex.apply(fp.plan(layout, HEADS), shapes.table)

        def bare() -> None:
            bare_decode_plan(w_bare, shapes.indptr, shapes.idx, shapes.last)

        def sglang() -> None:
            ref.set_lens(shapes.lens, shapes.lens_dev)
            ref.fill()
            ref.plan_device()

        jobs = {"flashplan": flashplan_step, "bare": bare, "sglang": sglang}
        cold = rounds_us(jobs, s.host_rounds, cold=True, before=shapes.new)
        hot = rounds_us(jobs, s.hot_rounds)
        c = {k: med(v) for k, v in cold.items()}
        h = {k: med(v) for k, v in hot.items()}
        r_bare, r_ref = (
            paired(cold["flashplan"], cold["bare"]),
            paired(cold["flashplan"], cold["sglang"]),
        )
        hot_bare = paired(hot["flashplan"], hot["bare"])
        case = f"decode B{bs}"
        for name, label in (
            ("flashplan", "flashplan step"),
            ("bare", "FI bare plan()"),
            ("sglang", "sglang way"),
        ):
            rep.add("host", case, f"cold: {label}", c[name], key=name == "flashplan")
            rep.add("host", case, f"hot: {label}", h[name])
        rep.add("host", case, "cold: flashplan / bare plan()", r_bare, "x", key=True)
        rep.add("host", case, "cold: flashplan / sglang way", r_ref, "x", key=True)
        rep.add("host", case, "hot: flashplan / bare plan()", hot_bare, "x")
        b = {}
        if ENV.cuda:
            b = {
                "flashplan": behind_us(flashplan_step, cycles),
                "sglang": behind_us(sglang, cycles),
            }
            rep.add("host", case, "behind 20 ms kernel: flashplan step", b["flashplan"])
            rep.add("host", case, "behind 20 ms kernel: sglang way", b["sglang"])
        lines.append(
            [
                str(bs),
                fmt(c["flashplan"]),
                fmt(c["bare"]),
                fmt(c["sglang"]),
                f"**{r_bare:.2f}**",
                f"{r_ref:.2f}",
                fmt(h["flashplan"]),
                fmt(h["bare"]),
                fmt(h["sglang"]),
                f"{hot_bare:.2f}",
                fmt(b.get("flashplan")),
                fmt(b.get("sglang")),
            ]
        )
        print(f"[host] B{bs}: cold {c}, hot {h}", flush=True)
    rep.table(
        f"Decode step host time, cold caches (kv {s.kv} + U[0, {s.loop}), page {PAGE}, "
        f"{HQ}/{HKV} x {D}, bf16), µs",
        [
            "batch",
            "flashplan step",
            "FI bare plan()",
            "sglang way",
            "step / bare",
            "step / sglang",
            "hot: step",
            "hot: bare",
            "hot: sglang",
            "hot: step / bare",
            "behind 20 ms: step",
            "behind 20 ms: sglang",
        ],
        lines,
        note="flashplan step = `BatchLayout.decode` + `plan` + `apply` of fresh lengths every "
        "call (a decode loop); FI bare plan() = the decode wrapper's `plan()` on that call's "
        "pinned indptr / last-page lengths and device page ids, made ahead (untimed); sglang "
        "way = device cumsum + Triton gather + `plan()` with device indptrs (a read-back). "
        f"Cold: {s.flush_mb} MB of host memory rewritten before each call, "
        f"{s.host_rounds} rounds; hot: the same lengths back to back, {s.hot_rounds} rounds; "
        "ratios: medians of the rounds' paired ratios. *behind 20 ms*: issued right after a "
        "20 ms kernel (a way that waits for the GPU shows it).",
    )


# -- verify --------------------------------------------------------------------------------
def verify_batch() -> tuple[fp.BatchLayout, fp.PlanSpec, fp.PageTable]:
    """``bs`` requests x ``n``-token EAGLE-like trees (``bushy_tree_parents``, seed 0) over
    a ``prefix``-token prefix, page 16, one full group; a sequential page table."""
    from flashplan.testing import bushy_tree_parents

    bs, n, prefix = ENV.sizes.verify
    tree = fp.DraftTree.from_parents(bushy_tree_parents(np.random.default_rng(0), bs, n))
    layout = fp.BatchLayout.verify([prefix] * bs, tree, page_size=PAGE)
    spec = fp.plan(layout, HEADS)
    return layout, spec, fp.PageTable.sequential(spec.pages_needed, device=ENV.device)


def part_verify(rep: Report) -> None:
    from flashplan.executor.flashinfer import ExecutorPolicy

    s = ENV.sizes
    layout, spec, table = verify_batch()
    group = layout.groups[0]
    ws = workspace()
    ex = executor(ExecutorPolicy(prefill_backend="fa2"))

    def flashplan_host() -> None:
        ex.apply(fp.plan(layout, HEADS), table)

    bare, raw = bare_verify(spec, table, ws)
    sglang, _ = sglang_verify(layout, spec, table, ws)
    jobs: dict[str, Callable[[], object]] = {"flashplan": flashplan_host, "bare": bare}
    if sglang is not None:
        jobs["sglang"] = sglang
    for fn in jobs.values():
        fn()
    hot = rounds_us(jobs, s.hot_rounds)
    cold = rounds_us(jobs, s.host_rounds, cold=True)
    # kernels: flashplan's run and the raw wrapper's on the same inputs
    assert table.num_pages is not None
    cache = torch.randn(table.num_pages, 2, PAGE, HKV, D, device=ENV.device, dtype=DT)
    q = torch.randn(spec.total_q, HQ, D, device=ENV.device, dtype=DT)
    ex.apply(spec, table)
    bare()
    ours, theirs = ex.run(group, q, None, None, cache), raw.run(q, cache)
    diff = float((ours.float() - theirs.float()).abs().max())
    k_fp = kernel_ms(lambda: ex.run(group, q, None, None, cache), rep=50, warmup=10)
    k_raw = kernel_ms(lambda: raw.run(q, cache), rep=50, warmup=10)
    bs, n, prefix = s.verify
    case = f"verify {bs} x {n} over {prefix}"
    lines = []
    for mode, times in (("hot", hot), ("cold", cold)):
        m = {k: med(v) for k, v in times.items()}
        r_bare = paired(times["flashplan"], times["bare"])
        r_ref = paired(times["flashplan"], times["sglang"]) if "sglang" in times else None
        rep.add("verify", case, f"{mode}: flashplan plan + apply", m["flashplan"], key=True)
        rep.add("verify", case, f"{mode}: FI bare plan()", m["bare"])
        rep.add("verify", case, f"{mode}: sglang way", m.get("sglang"))
        rep.add("verify", case, f"{mode}: flashplan / bare plan()", r_bare, "x", key=True)
        rep.add("verify", case, f"{mode}: flashplan / sglang way", r_ref, "x")
        lines.append(
            [
                mode,
                fmt(m["flashplan"]),
                fmt(m["bare"]),
                fmt(m.get("sglang")),
                f"{r_bare:.2f}",
                fmt(r_ref, 2),
            ]
        )
    rep.add("verify", case, "kernel: flashplan", k_fp, "ms")
    rep.add("verify", case, "kernel: raw FI", k_raw, "ms")
    rep.add("verify", case, "kernel: flashplan / raw", k_fp / k_raw, "x", key=True)
    rep.table(
        f"Verify: {bs} requests x {n}-token trees over {prefix}, page {PAGE}, host µs",
        [
            "caches",
            "flashplan plan + apply",
            "FI bare plan()",
            "sglang way",
            "fp / bare",
            "fp / sglang",
        ],
        lines,
        note="flashplan = `plan(layout)` + `apply` (FA2 policy; the mask built on the "
        "device); bare = `plan()` with the mask packed ahead and ready pinned indptrs; "
        "sglang way = device indptrs + Triton gather + `plan(custom_mask=bool mask)` (reads "
        f"back, packs). Kernel: flashplan {k_fp:.3f} ms, raw {k_raw:.3f} ms "
        f"({k_fp / k_raw:.3f}x); max |flashplan - raw| = {diff:.3g}.",
    )
    print(f"[verify] {lines}", flush=True)


# -- multi-item ----------------------------------------------------------------------------
def part_multi_item(rep: Report) -> None:
    from flashplan.executor.flashinfer import ExecutorPolicy
    from flashplan.testing.batches import scoring_batch

    s = ENV.sizes
    bs, prompt, items, item_len = s.multi_item
    dev = ENV.device
    batch = scoring_batch(
        np.random.default_rng(0), bs, prompt=prompt, items=items, max_item_len=item_len
    )
    ext = list(batch.extend_lens)
    delims_cpu = [torch.tensor(d, dtype=torch.int64) for d in batch.delimiters]  # sglang's
    prefix = [0] * bs
    ex = executor(ExecutorPolicy(prefill_backend="fa2"))
    # page 1: sglang's token table (req_to_token)
    spec = fp.plan(fp.BatchLayout.extend(ext, prefix, item_delimiters=delims_cpu), HEADS)
    table = fp.PageTable.shuffled(spec.pages_needed, seed=0, device=dev)

    def flashplan_host() -> None:
        layout = fp.BatchLayout.extend(ext, prefix, item_delimiters=delims_cpu)
        ex.apply(fp.plan(layout, HEADS), table)
        ex.positions()  # RoPE positions on the device

    part = spec.group_plans[0].paged
    items_t = spec.group_plans[0].items
    assert part is not None and items_t is not None
    ws = workspace()
    raw = ENV.fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
    sg = ENV.fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
    qo = pinned(spec.qo_indptr)
    kv, idx, last = decode_inputs(spec, table)
    ready = (
        torch.from_numpy(items_t.prefix_len_ptr.view(np.int32).copy()).to(dev).view(torch.uint32),
        torch.from_numpy(items_t.rows.reshape(-1).view(np.int16).copy()).to(dev).view(torch.uint16),
        int(items_t.token_pos_in_items_len),
        torch.from_numpy(items_t.max_item_len.view(np.int16).copy()).to(dev).view(torch.uint16),
    )

    def plan_items(w: Any, qo_: Any, kv_: Any, idx_: Any, last_: Any, t: Any) -> None:
        w.plan(
            qo_,
            kv_,
            idx_,
            last_,
            HQ,
            HKV,
            D,
            1,
            causal=True,
            q_data_type=DT,
            kv_data_type=DT,
            prefix_len_ptr=t[0],
            token_pos_in_items_ptr=t[1],
            token_pos_in_items_len=t[2],
            max_item_len_ptr=t[3],
            non_blocking=True,
        )

    def bare() -> None:
        plan_items(raw, qo, kv, idx, last, ready)

    ext_dev = torch.tensor(ext, dtype=torch.int32, device=dev)
    rows_dev = torch.from_numpy(table.rows.astype(np.int32)).to(dev)
    base = torch.from_numpy(np.concatenate([np.arange(e) for e in ext])).to(dev)
    positions = base.clone()

    def sglang() -> None:
        positions.copy_(base)
        t = sglang_multi_item(delims_cpu, prefix, ext, positions)
        assert t is not None
        qo_d = torch.zeros(bs + 1, dtype=torch.int32, device=dev)
        qo_d[1:] = torch.cumsum(ext_dev, 0)
        kv_d = torch.zeros(bs + 1, dtype=torch.int32, device=dev)
        kv_d[1:] = torch.cumsum(ext_dev, 0)
        ids = torch.empty(int(sum(ext)) + 256, dtype=torch.int32, device=dev)
        ref_gather(table.pages, rows_dev, ext_dev, kv_d, ids)
        last_d = torch.ones(bs, dtype=torch.int32, device=dev)
        plan_items(sg, qo_d, kv_d, ids, last_d, t)

    # the same tensors (checked once)
    ex.apply(spec, table)
    t = sglang_multi_item(delims_cpu, prefix, ext, positions)
    assert t is not None
    same = (
        t[0].view(torch.int32).cpu().numpy().tolist() == items_t.prefix_len_ptr.tolist()
        and t[1].view(torch.int16).cpu().numpy().astype(np.uint16).tolist()
        == items_t.rows.reshape(-1).tolist()
        and np.array_equal(ex.positions().cpu().numpy(), positions.cpu().numpy())
    )
    jobs = {"flashplan": flashplan_host, "bare": bare, "sglang": sglang}
    hot = rounds_us(jobs, s.multi_item_rounds, warmup=2)
    cold = rounds_us(jobs, s.multi_item_rounds, cold=True, warmup=1)
    case = f"multi-item {bs} x ({prompt} + {items} items)"
    lines = []
    for mode, times in (("hot", hot), ("cold", cold)):
        m = {k: med(v) for k, v in times.items()}
        r_bare, r_ref = (
            paired(times["flashplan"], times["bare"]),
            paired(times["flashplan"], times["sglang"]),
        )
        rep.add(
            "multi_item", case, f"{mode}: flashplan layout + plan + apply", m["flashplan"], key=True
        )
        rep.add("multi_item", case, f"{mode}: FI bare plan()", m["bare"])
        rep.add("multi_item", case, f"{mode}: sglang way", m["sglang"])
        rep.add("multi_item", case, f"{mode}: flashplan / bare plan()", r_bare, "x", key=True)
        rep.add("multi_item", case, f"{mode}: flashplan / sglang way", r_ref, "x", key=True)
        lines.append(
            [
                mode,
                fmt(m["flashplan"]),
                fmt(m["bare"]),
                fmt(m["sglang"]),
                f"{r_bare:.2f}",
                f"{r_ref:.3f}",
            ]
        )
    rep.add("multi_item", case, "same tensors as sglang's loop", same, "bool")
    rep.table(
        f"Multi-item scoring: {bs} x ({prompt}-token prompt + {items} items of U[1, "
        f"{item_len}]), page 1, host µs",
        ["caches", "flashplan", "FI bare plan()", "sglang way", "fp / bare", "fp / sglang"],
        lines,
        note="flashplan = `BatchLayout.extend(item_delimiters=)` + `plan` + `apply` + "
        "`positions()`; bare = `plan()` with the multi-item tensors built ahead; sglang way "
        "= its per-request loop (tensors and positions) + device cumsums + Triton gather + "
        f"`plan()` with device indptrs. Same tensors and positions: {same}.",
    )
    print(f"[multi_item] {lines}", flush=True)


# -- sync ----------------------------------------------------------------------------------
def part_sync(rep: Report) -> None:
    """Under ``torch.cuda.set_sync_debug_mode("error")``: does each call sync?"""
    if not ENV.cuda:
        rep.md += ["### Syncs", "", "skipped: set_sync_debug_mode needs CUDA", ""]
        return
    from flashplan.executor.flashinfer import ExecutorPolicy, GraphBucket, capture, graph_executor

    s = ENV.sizes
    bs = 64 if 64 in s.host_batches else s.host_batches[-1]
    shapes = DecodeShapes(bs)
    ex = executor()
    lens = shapes.lens
    spec = fp.plan(fp.BatchLayout.decode(lens, page_size=PAGE), HEADS)
    table = shapes.table
    group = fp.BatchLayout.decode(lens, page_size=PAGE).groups[0]
    assert table.num_pages is not None
    cache = torch.randn(table.num_pages, 2, PAGE, HKV, D, device=ENV.device, dtype=DT)
    q = torch.randn(bs, HQ, D, device=ENV.device, dtype=DT)
    ws = workspace()
    ref = SglangDecode(
        decode_wrapper(ws, tensor_cores(bs)),
        table,
        torch.empty(int(spec.pages_needed.sum()), dtype=torch.int32, device=ENV.device),
    )
    ref.set_lens(lens)
    checks: list[tuple[str, Callable[[], object], bool]] = []
    checks.append((f"decode B{bs}: apply", lambda: ex.apply(spec, table), True))
    checks.append(
        (
            f"decode B{bs}: layout + plan + apply",
            lambda: ex.apply(fp.plan(fp.BatchLayout.decode(lens, page_size=PAGE), HEADS), table),
            True,
        )
    )
    checks.append((f"decode B{bs}: run", lambda: ex.run(group, q, None, None, cache), True))
    checks.append(
        (
            f"decode B{bs}: apply + positions()",
            lambda: (ex.apply(spec, table), ex.positions()),
            True,
        )
    )
    vlayout, _, vtable = verify_batch()
    vx = executor(ExecutorPolicy(prefill_backend="fa2"))
    checks.append(("verify: plan + apply", lambda: vx.apply(fp.plan(vlayout, HEADS), vtable), True))
    gx = graph_executor(executor(), GraphBucket.decode(bs, int(spec.pages_needed.max()) + 1))
    gx.apply(spec, table)
    step = capture(gx, lambda: gx.run(group, q, None, None, cache))
    checks.append(
        (
            f"graph B{bs}: layout + plan + replay",
            lambda: step.replay(fp.plan(fp.BatchLayout.decode(lens, page_size=PAGE), HEADS), table),
            True,
        )
    )
    checks.append(
        (
            f"sglang way, decode B{bs} (expected to sync)",
            lambda: (ref.fill(), ref.plan_device()),
            False,
        )
    )
    lines = []
    for name, fn, ours in checks:
        syncs = raises_on_sync(fn)
        rep.add("sync", name, "syncs (error mode raised)", syncs, "bool", key=ours)
        lines.append([name, "raised (syncs)" if syncs else "ok (no sync)"])
    # waits the debug mode does not see: graph replays issued back to back behind a busy
    # GPU (the host runs ahead of the GPU, as an overlapped loop does)
    cycles = sleep_cycles(20.0)

    def replays() -> None:
        for _ in range(3):
            step.replay(fp.plan(fp.BatchLayout.decode(lens, page_size=PAGE), HEADS), table)

    replays()
    sync()
    torch.cuda._sleep(cycles)
    with WaitCounter() as waits:
        import time

        t0 = time.perf_counter()
        replays()
        host = (time.perf_counter() - t0) * 1e6
    sync()
    rep.add(
        "sync",
        f"graph B{bs}: 3 replays behind a 20 ms kernel",
        "host waits (Event/Stream synchronize)",
        waits.count,
        "count",
    )
    rep.add("sync", f"graph B{bs}: 3 replays behind a 20 ms kernel", "host time", host)
    lines.append(
        [
            f"graph B{bs}: 3 replays behind a 20 ms kernel",
            f"{waits.count} event/stream waits, host {host:.0f} µs",
        ]
    )
    rep.table(
        'Syncs: `torch.cuda.set_sync_debug_mode("error")` around each call',
        ["call", "result"],
        lines,
        note="The debug mode sees stream/device synchronizations and device-to-host reads; "
        "an `Event.synchronize` (a wait for an earlier step's copies) it does not: those "
        "are counted separately, with the host time of three replays issued behind a "
        "20 ms kernel (20000 µs or more: the host waited for the GPU).",
    )
    print(f"[sync] {lines}", flush=True)
