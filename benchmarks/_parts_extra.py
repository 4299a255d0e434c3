"""Further parts of ``run_gpu.py`` (not in the default set; CUDA only), folded from the
scripts that measured other issues' targets:

  draft          multi-step draft planning, 256 requests x topk 8 x 5 steps (page 1):
                 ``plan_steps`` + one ``apply_steps`` vs sglang's way (one index kernel
                 for every step, one read-back of the indptrs, a ``plan()`` per step)
  fp8            decode of 256 x 4096 keys with an e4m3 cache (number scales): flashplan
                 vs raw FlashInfer kernel time and bandwidth, both decode kernel kinds
  cascade        shared prefixes: one layer's ``run`` on a cascade plan vs the same batch
                 planned plain (same page table), and the host time of plan + apply
  extend         extend 16 x (2048 prefix + 512 new): ragged+paged+merge vs paged-only,
                 FA2 vs FA3, one layer incl. the KV write
  deterministic  decode kernel with ``ExecutorPolicy(deterministic=True)`` vs the default
  window         windowed-prefix masks, 256 requests: flashplan plan + apply (mask built
                 on the device) vs sglang's per-request loop + ``segment_packbits``
  xqa            issue 52's targets in one run: e4m3 and bf16 decode at batch 1/8/64/256 x
                 4096 keys, flashplan on XQA vs raw ``flashinfer.xqa`` vs flashplan and raw
                 FA2 (tensor cores), as bandwidth against the device-to-device copy and as
                 tokens/s against the bf16 decode; host plan + apply on XQA vs on FA2 (e4m3);
                 the error of both kernels against a float64 oracle on random inputs
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import triton
import triton.language as tl
from _common import (
    DT,
    ENV,
    HKV,
    HQ,
    PAGE,
    D,
    Report,
    executor,
    graph_ms,
    host_us,
    kernel_ms,
    med,
    pinned,
    rel_err,
    rounds_us,
    workspace,
)
from _raw import decode_inputs, decode_wrapper

import flashplan as fp
from flashplan.oracle import dense_attention

HEADS = fp.HeadConfig(num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D)


def _small() -> bool:
    """Tiny sizes (``--quick``, a CPU smoke run over the twin)."""
    return ENV.sizes.kv < 4096


def _cache(num_pages: int | None, ps: int = PAGE, dtype: torch.dtype = DT) -> torch.Tensor:
    assert num_pages is not None
    out = torch.empty(num_pages, 2, ps, HKV, D, device=ENV.device, dtype=dtype)
    for i in range(0, num_pages, 4096):  # no float32 copy of it all
        out[i : i + 4096].copy_(torch.randn(out[i : i + 4096].shape, device=ENV.device))
    return out


# -- draft ---------------------------------------------------------------------------------
@triton.jit
def draft_indices(
    table_ptr,
    rows_ptr,
    seq_ptr,
    slots_ptr,
    out_ptr,
    indptr_ptr,
    bs,
    topk: tl.constexpr,
    steps: tl.constexpr,
    table_stride,
    width,
    BLOCK: tl.constexpr,
):
    # sglang's generate_draft_decode_kv_indices (page 1): one program per (step,
    # request, branch) writes the prefix, then `it` draft slots
    it = tl.program_id(0) + 1
    b = tl.program_id(1)
    t = tl.program_id(2)
    seq = tl.load(seq_ptr + b).to(tl.int64)
    row = tl.load(rows_ptr + b).to(tl.int64)
    z = b * topk + t
    base = tl.load(indptr_ptr + (it - 1) * (bs * topk + 1) + z).to(tl.int64)
    for i in range(tl.cdiv(seq, BLOCK)):
        k = i * BLOCK + tl.arange(0, BLOCK)
        m = k < seq
        v = tl.load(table_ptr + row * table_stride + k, mask=m)
        tl.store(out_ptr + (it - 1) * width + base + k, v, mask=m)
    j = tl.arange(0, 8)
    mj = j < it
    v = tl.load(slots_ptr + (b * topk + t) * steps + j, mask=mj)
    tl.store(out_ptr + (it - 1) * width + base + seq + j, v, mask=mj)


def part_draft(rep: Report) -> None:
    bs, topk, steps = 256, 8, 5
    dev = ENV.device
    prefix = np.random.default_rng(1).integers(500, 4000, bs)
    draft = fp.DraftDecode(prefix, topk, steps, page_size=1)
    prompt = fp.PageTable.sequential(prefix, device=dev)
    pool = int(prompt.num_pages or 0)
    slots = torch.arange(pool, pool + bs * topk * steps, dtype=torch.int32, device=dev)
    table = fp.PageTable.draft_branches(
        prompt, prefix, topk, slots.reshape(bs, topk, steps), page_size=1
    )
    ex = executor()

    def flashplan_all() -> None:
        ex.apply_steps(fp.plan_steps(draft, HEADS), table)

    seq_dev = torch.from_numpy(prefix.astype(np.int32)).to(dev)
    rows_dev = torch.from_numpy(prompt.rows.astype(np.int32)).to(dev)
    width = int(prefix.sum()) * topk + bs * topk * steps
    indices = torch.empty(steps * width, dtype=torch.int32, device=dev)
    ws = workspace()
    wrappers = [decode_wrapper(ws, True) for _ in range(steps)]
    last_host = pinned(np.ones(bs * topk))

    def sglang() -> None:
        lens = seq_dev.repeat_interleave(topk)
        its = torch.arange(1, steps + 1, device=dev)[:, None]
        indptr = torch.zeros(steps, bs * topk + 1, dtype=torch.int32, device=dev)
        indptr[:, 1:] = torch.cumsum(lens[None, :] + its, dim=1)
        draft_indices[(steps, bs, topk)](
            prompt.pages,
            rows_dev,
            seq_dev,
            slots,
            indices,
            indptr,
            bs,
            topk,
            steps,
            prompt.pages.stride(0),
            width,
            BLOCK=512,
        )
        host = indptr.cpu()  # the one device-to-host copy (a sync)
        for s in range(steps):
            lo = s * width
            wrappers[s].plan(
                host[s],
                indices[lo : lo + int(host[s, -1])],
                last_host,
                HQ,
                HKV,
                D,
                1,
                q_data_type=DT,
                kv_data_type=DT,
            )

    t = rounds_us({"flashplan": flashplan_all, "sglang": sglang}, 20)
    ours, theirs = med(t["flashplan"]), med(t["sglang"])
    case = f"draft {bs} x topk {topk} x {steps} steps"
    rep.add("draft", case, "flashplan plan_steps + apply_steps", ours, key=True)
    rep.add("draft", case, "sglang way", theirs)
    rep.add("draft", case, "flashplan / sglang way", ours / theirs, "x", key=True)
    rep.table(
        f"Multi-step draft planning: {bs} requests, topk {topk}, {steps} steps (page 1), host µs",
        ["flashplan", "sglang way", "flashplan / sglang"],
        [[f"{ours:.0f}", f"{theirs:.0f}", f"{ours / theirs:.2f}"]],
    )


# -- fp8 -----------------------------------------------------------------------------------
def part_fp8(rep: Report) -> None:
    from flashplan.executor.flashinfer import ExecutorPolicy

    bs, kv = (2, 64) if _small() else (256, 4096)
    lines = []
    for name, dtype in (("bf16", DT), ("e4m3", torch.float8_e4m3fn)):
        heads = fp.HeadConfig(HQ, HKV, D, q_dtype=DT, kv_dtype=dtype)
        layout = fp.BatchLayout.decode(np.full(bs, kv), page_size=PAGE)
        spec = fp.plan(layout, heads)
        table = fp.PageTable.shuffled(spec.pages_needed, seed=1, device=ENV.device)
        cache = _cache(table.num_pages, dtype=dtype)
        q = torch.randn(bs, HQ, D, device=ENV.device, dtype=DT)
        scales = (0.37, 1.9) if name != "bf16" else (None, None)
        group = layout.groups[0]
        indptr, idx, last = decode_inputs(spec, table)
        ws = workspace()
        for tc in (True, False):  # FA2 against FA2 (XQA: part xqa)
            fa2 = {"decode_backend": "fa2"} if hasattr(ExecutorPolicy(), "decode_backend") else {}
            ex = executor(ExecutorPolicy(decode_tensor_cores=tc, **fa2))
            ex.apply(spec, table)
            t_fp = kernel_ms(
                lambda: ex.run(group, q, None, None, cache, k_scale=scales[0], v_scale=scales[1])
            )
            w = decode_wrapper(ws, tc)
            w.plan(indptr, idx, last, HQ, HKV, D, PAGE, q_data_type=DT, kv_data_type=dtype)
            t_raw = kernel_ms(lambda w=w: w.run(q, cache, k_scale=scales[0], v_scale=scales[1]))
            bw = bs * kv * 2 * HKV * D * cache.element_size() / t_fp / 1e9
            case = f"decode B{bs} kv{kv} {name} {'tc' if tc else 'cuda-core'}"
            rep.add("fp8", case, "flashplan", t_fp, "ms")
            rep.add("fp8", case, "raw FI", t_raw, "ms")
            rep.add("fp8", case, "flashplan / raw", t_fp / t_raw, "x", key=True)
            rep.add("fp8", case, "flashplan bandwidth", bw, "TB/s")
            lines.append([case, f"{t_fp:.3f}", f"{t_raw:.3f}", f"{t_fp / t_raw:.3f}", f"{bw:.2f}"])
        torch.cuda.empty_cache()
    rep.table(
        "FP8 KV cache decode (number scales)",
        ["case", "flashplan ms", "raw FI ms", "fp / raw", "TB/s"],
        lines,
    )


# -- cascade -------------------------------------------------------------------------------
def part_cascade(rep: Report) -> None:
    # (requests, shared, own) of one group of all, and of groups of 8
    (n1, s1, o1), (n8, s8, o8) = (
        ((8, 64, 16), (16, 32, 8)) if _small() else ((64, 8192, 256), (256, 2048, 128))
    )
    one = fp.BatchLayout.decode(np.full(n1, s1 + o1), page_size=PAGE)
    many = fp.BatchLayout.decode(np.full(n8, s8 + o8), page_size=PAGE)
    groups8 = [range(8 * g, 8 * g + 8) for g in range(n8 // 8)]
    cases = {
        f"one prompt: {n1} x ({s1} + {o1})": (
            one,
            fp.SharedPrefix.from_groups([range(n1)], [s1]),
        ),
        f"groups of 8: {n8} x ({s8} + {o8})": (
            many,
            fp.SharedPrefix.from_groups(groups8, [s8] * len(groups8)),
        ),
    }
    lines = []
    for name, (layout, shared) in cases.items():
        own = fp.PageTable.shuffled(layout.pages_needed, seed=1, device=ENV.device)
        table = fp.PageTable(
            fp.share_pages(shared, own.pages, own.rows, PAGE), own.rows, own.num_pages
        )
        cache = _cache(table.num_pages)
        q = torch.randn(layout.batch_size, HQ, D, device=ENV.device, dtype=DT)
        group = layout.groups[0]
        res = {}
        outs = {}
        for kind, kwargs in (
            ("plain", {}),
            ("cascade", {"shared_prefix": shared, "cascade": "on"}),
        ):
            ex = executor()
            ex.apply(fp.plan(layout, HEADS, **kwargs), table)
            res[kind] = kernel_ms(lambda ex=ex: ex.run(group, q, None, None, cache))
            outs[kind] = ex.run(group, q, None, None, cache)
            hx = executor()
            res[f"host {kind}"] = host_us(
                lambda hx=hx, kw=kwargs: hx.apply(fp.plan(layout, HEADS, **kw), table), n=100
            )
        err = rel_err(outs["cascade"], outs["plain"])
        rep.add("cascade", name, "run: cascade", res["cascade"], "ms")
        rep.add("cascade", name, "run: plain", res["plain"], "ms")
        rep.add(
            "cascade", name, "run: cascade / plain", res["cascade"] / res["plain"], "x", key=True
        )
        rep.add("cascade", name, "host plan + apply: cascade", res["host cascade"])
        rep.add(
            "cascade",
            name,
            "host plan + apply: cascade / plain",
            res["host cascade"] / res["host plain"],
            "x",
            key=True,
        )
        lines.append(
            [
                name,
                f"{res['plain']:.3f}",
                f"{res['cascade']:.3f}",
                f"{res['host plain']:.0f}",
                f"{res['host cascade']:.0f}",
                f"{err:.1e}",
            ]
        )
        torch.cuda.empty_cache()
    rep.table(
        "Shared prefixes (cascade), decode, one layer",
        ["batch", "plain ms", "cascade ms", "host plain µs", "host cascade µs", "rel. err"],
        lines,
    )


# -- extend --------------------------------------------------------------------------------
def part_extend(rep: Report) -> None:
    from flashplan.executor.flashinfer import ExecutorPolicy

    n, cached, new = (2, 64, 16) if _small() else (16, 2048, 512)
    layout = fp.BatchLayout.extend([cached + new] * n, [cached] * n, page_size=PAGE)
    group = layout.groups[0]
    lines = []
    for path in ("ragged", "paged"):
        spec = fp.plan(layout, HEADS, extend_path=path)
        table = fp.PageTable.shuffled(spec.pages_needed, seed=2, device=ENV.device)
        cache = _cache(table.num_pages)
        q = torch.randn(spec.total_q, HQ, D, device=ENV.device, dtype=DT)
        k = torch.randn(spec.total_q, HKV, D, device=ENV.device, dtype=DT)
        for backend in ("fa2", "fa3"):
            ex = executor(ExecutorPolicy(prefill_backend=backend))
            ex.apply(spec, table)
            ms = kernel_ms(lambda ex=ex: ex.run(group, q, k, k, cache), rep=100)
            rep.add(
                "extend",
                f"{n} x ({cached} + {new}) {path} {backend}",
                "one layer",
                ms,
                "ms",
                key=True,
            )
            lines.append([path, backend, f"{ms:.3f}"])
    rep.table(
        f"Extend {n} x ({cached} prefix + {new} new), one layer incl. the KV write",
        ["path", "backend", "ms"],
        lines,
    )


# -- deterministic -------------------------------------------------------------------------
def part_deterministic(rep: Report) -> None:
    from flashplan.executor.flashinfer import ExecutorPolicy

    lines = []
    kv = 64 if _small() else 4096
    for bs in (2, 4) if _small() else (64, 256):
        layout = fp.BatchLayout.decode(np.full(bs, kv), page_size=PAGE)
        spec = fp.plan(layout, HEADS)
        table = fp.PageTable.shuffled(spec.pages_needed, seed=7 + bs, device=ENV.device)
        cache = _cache(table.num_pages)
        q = torch.randn(bs, HQ, D, device=ENV.device, dtype=DT)
        group = layout.groups[0]
        t = {}
        for name, policy in (
            ("default", ExecutorPolicy()),
            ("deterministic", ExecutorPolicy(deterministic=True)),
        ):
            ex = executor(policy)
            ex.apply(spec, table)
            t[name] = kernel_ms(lambda ex=ex: ex.run(group, q, None, None, cache))
        cost = t["deterministic"] / t["default"]
        rep.add(
            "deterministic", f"decode B{bs} kv{kv}", "deterministic / default", cost, "x", key=True
        )
        lines.append(
            [str(bs), f"{t['default'] * 1e3:.1f}", f"{t['deterministic'] * 1e3:.1f}", f"{cost:.3f}"]
        )
        torch.cuda.empty_cache()
    rep.table(
        "Deterministic mode, decode kernel",
        ["batch", "default µs", "deterministic µs", "cost"],
        lines,
    )


# -- window --------------------------------------------------------------------------------
def part_window(rep: Report) -> None:
    from flashplan.executor.flashinfer import ExecutorPolicy

    rng = np.random.default_rng(3)
    window, bs, ext = 4096, 256, 512
    prefix = rng.integers(1, 8193, bs)
    seq = prefix + ext
    group = fp.AttentionGroup(window_left=window)
    layout = fp.BatchLayout.extend(seq, prefix, page_size=1, groups=[group])
    spec = fp.plan(layout, HEADS, extend_path="ragged")
    table = fp.PageTable.shuffled(spec.pages_needed, seed=3, device=ENV.device)
    ex = executor(ExecutorPolicy(prefill_backend="fa2"))

    def ours() -> None:
        ex.apply(fp.plan(layout, HEADS, extend_path="ragged"), table)

    dev = ENV.device
    prefix_dev = torch.from_numpy(prefix).to(dev)
    start_dev = torch.clamp(prefix_dev - window, min=0)
    qo = torch.full((bs,), ext, dtype=torch.int32, device=dev)
    kv = (prefix_dev - start_dev).to(torch.int32)

    def theirs() -> None:  # sglang's per-request loop + device packbits (the mask only)
        parts = []
        for p, s in zip(prefix_dev.cpu().tolist(), start_dev.cpu().tolist(), strict=True):
            n = int(p - s)
            if n == 0:
                continue
            q_abs = torch.arange(ext, device=dev).view(-1, 1) + p
            k_abs = torch.arange(n, device=dev).view(1, -1) + s
            parts.append((k_abs >= (q_abs - window)).to(torch.uint8).view(-1))
        mask = torch.cat(parts)
        indptr = torch.zeros(bs + 1, dtype=torch.int32, device=dev)
        indptr[1:] = torch.cumsum(qo * kv, 0)
        ENV.fi.segment_packbits(mask, indptr, bitorder="little")

    t = rounds_us({"flashplan": ours, "sglang": theirs}, 10, warmup=2)
    a, b = med(t["flashplan"]), med(t["sglang"])
    case = f"window {window}, {bs} x (U[1, 8192] + {ext})"
    rep.add("window", case, "flashplan plan + apply (whole batch)", a, key=True)
    rep.add("window", case, "sglang loop + packbits (mask only)", b)
    rep.add("window", case, "flashplan / sglang", a / b, "x", key=True)
    rep.table(
        "Windowed-prefix masks, host µs",
        ["flashplan plan + apply", "sglang loop (mask only)", "fp / sglang"],
        [[f"{a:.0f}", f"{b:.0f}", f"{a / b:.3f}"]],
    )


# -- xqa -----------------------------------------------------------------------------------
def _copy_tbps() -> float:
    """Device-to-device copy bandwidth (TB/s, bytes read + written): the ceiling."""
    n = (64 << 20) if _small() else (1 << 30)
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=ENV.device)
    dst = torch.empty_like(src)
    return 2 * n / kernel_ms(lambda: dst.copy_(src)) / 1e9


def _raw_xqa(
    spec: fp.PlanSpec, table: fp.PageTable, cache: torch.Tensor, q: torch.Tensor, *,
    q_scale: float, kv_scale: float,
) -> Callable[..., None]:  # fmt: skip
    """Raw ``flashinfer.xqa`` over a decode plan's group 0: its dense block table (int32
    ``[bs, width]``) and uint32 lengths ``[bs, 1]`` made with torch, its own semaphores,
    scratch and output (untimed), ``q`` ``[bs, HQ, D]``. Returns the call; its
    ``sm_count`` (``None``: XQA's default, the device's SM count) sets XQA's split."""
    part = spec.group_plans[0].paged
    assert part is not None
    width = int(part.num_pages.max())
    rows = torch.as_tensor(np.asarray(table.rows), device=ENV.device).long()
    dense = table.pages[rows][:, :width].contiguous()
    lens = torch.as_tensor(part.kv_lens, device=ENV.device).to(torch.int32)
    lens = lens.view(torch.uint32).view(-1, 1)
    out = torch.empty(q.shape[0], 1, HQ, D, device=ENV.device, dtype=q.dtype)
    sem = torch.zeros(2 << 20, dtype=torch.uint32, device=ENV.device)
    scratch = torch.zeros(64 << 20, dtype=torch.uint8, device=ENV.device)
    k_c, v_c = cache.unbind(1)

    def call(sm_count: int | None = None) -> None:
        ENV.fi.xqa(q.unsqueeze(1), k_c, v_c, dense, lens, out, scratch, sem, HKV, PAGE,
                   q_scale=q_scale, kv_scale=kv_scale, sm_count=sm_count)  # fmt: skip

    return call


def _decode_oracle(
    q: torch.Tensor, cache: torch.Tensor, spec: fp.PlanSpec, table: fp.PageTable,
    scales: tuple[float | None, float | None],
) -> torch.Tensor:  # fmt: skip
    """float64 decode attention over the dequantized cache, request by request
    (:func:`flashplan.oracle.dense_attention` over every key)."""
    part = spec.group_plans[0].paged
    assert part is not None
    ks, vs = (s if s is not None else 1.0 for s in scales)
    group = spec.key.groups[0]
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    for i, (row, n) in enumerate(zip(table.rows, part.kv_lens, strict=True)):
        pages = table.pages[int(row), : -(-int(n) // PAGE)].long()
        kv = cache[pages].double()  # [pages, 2, PAGE, HKV, D]
        k = kv[:, 0].reshape(-1, HKV, D)[: int(n)] * ks
        v = kv[:, 1].reshape(-1, HKV, D)[: int(n)] * vs
        out[i] = dense_attention(q[i : i + 1], k, v, np.ones((1, int(n)), bool), group)[0][0]
    return out


def _oracle_errors(kv_dtype: torch.dtype, backend: str) -> dict[str, float]:
    """Errors of one decode kernel against a float64 oracle on random inputs (unit
    normal q, K, V; e4m3 cache with scales 0.37 / 1.9; lengths 1..4096): max, p99 and
    mean |out - oracle| over max |oracle|."""
    from flashplan.executor.flashinfer import ExecutorPolicy

    heads = fp.HeadConfig(HQ, HKV, D, q_dtype=DT, kv_dtype=kv_dtype)
    rng = np.random.default_rng(52)
    lens = rng.integers(1, 256 if _small() else 4097, 8 if _small() else 64)
    spec = fp.plan(fp.BatchLayout.decode(lens, page_size=PAGE), heads)
    table = fp.PageTable.shuffled(spec.pages_needed, seed=52, device=ENV.device)
    cache = _cache(table.num_pages, dtype=kv_dtype)
    q = torch.randn(spec.total_q, HQ, D, device=ENV.device, dtype=DT)
    scales = (0.37, 1.9) if kv_dtype != DT else (None, None)
    ex = executor(ExecutorPolicy(decode_backend=backend))
    ex.apply(spec, table)
    group = spec.key.groups[0]
    out = ex.run(group, q, None, None, cache, k_scale=scales[0], v_scale=scales[1]).double()
    want = _decode_oracle(q, cache, spec, table, scales)
    err = (out - want).abs().flatten()
    top = float(want.abs().max())
    return {
        "max": float(err.max()) / top,
        "p99": float(torch.quantile(err.float()[: 1 << 24], 0.99)) / top,
        "mean": float(err.mean()) / top,
    }


def _split_sweep(batches: tuple[int, ...], kv: int, copy: float) -> list[list[str]]:
    """Raw XQA over an e4m3 cache at every batch size of ``batches`` with ``sm_count``
    from the device's own count (flashplan's :func:`xqa_sm_count`) up to 32x it: kernel
    ms and % of the copy ceiling per split."""
    from flashplan.executor.flashinfer.xqa import xqa_sm_count

    sms = torch.cuda.get_device_properties(ENV.device).multi_processor_count if (
        ENV.device.type == "cuda") else 132  # fmt: skip
    heads = fp.HeadConfig(HQ, HKV, D, q_dtype=DT, kv_dtype=torch.float8_e4m3fn)
    rows = []
    for bs in batches:
        spec = fp.plan(fp.BatchLayout.decode(np.full(bs, kv), page_size=PAGE), heads)
        table = fp.PageTable.shuffled(spec.pages_needed, seed=bs, device=ENV.device)
        cache = _cache(table.num_pages, dtype=torch.float8_e4m3fn)
        q = torch.randn(bs, HQ, D, device=ENV.device, dtype=DT)
        raw = _raw_xqa(spec, table, cache, q, q_scale=0.37 / 1.9, kv_scale=1.9)
        ours = xqa_sm_count(sms, deterministic=False)
        counts = sorted({ours, 2 * sms, 4 * sms, 8 * sms, 16 * sms, 32 * sms})
        units = bs * HKV
        for count in counts:
            parts = max(1, (3 * count // units + 2) // 4)  # XQA's split (C round, half up)
            t = kernel_ms(lambda count=count: raw(count))
            bw = bs * kv * 2 * HKV * D / t / 1e9
            label = f"{count}" + (" (XQA's own = flashplan's)" if count == ours else "")
            rows.append([f"B{bs}", label, str(parts), f"{t:.3f}", f"{100 * bw / copy:.1f}"])
    return rows


def part_xqa(rep: Report) -> None:
    from flashplan.executor.flashinfer import ExecutorPolicy

    copy = _copy_tbps()
    rep.add("xqa", "d2d copy", "bandwidth", copy, "TB/s")
    kv = 256 if _small() else 4096
    batches = (1, 2) if _small() else (1, 8, 64, 256)
    lines, host_lines, graph_lines, ms = [], [], [], {}
    for bs in batches:
        for name, dtype in (("e4m3", torch.float8_e4m3fn), ("bf16", DT)):
            heads = fp.HeadConfig(HQ, HKV, D, q_dtype=DT, kv_dtype=dtype)
            layout = fp.BatchLayout.decode(np.full(bs, kv), page_size=PAGE)
            spec = fp.plan(layout, heads)
            table = fp.PageTable.shuffled(spec.pages_needed, seed=bs, device=ENV.device)
            cache = _cache(table.num_pages, dtype=dtype)
            q = torch.randn(bs, HQ, D, device=ENV.device, dtype=DT)
            ks, vs = (0.37, 1.9) if name == "e4m3" else (None, None)
            group = layout.groups[0]
            nbytes = bs * kv * 2 * HKV * D * cache.element_size()
            times, executors = {}, {}
            for backend in ("xqa", "fa2"):
                ex = executors[backend] = executor(ExecutorPolicy(decode_backend=backend))
                ex.apply(spec, table)
                times[f"flashplan {backend}"] = kernel_ms(
                    lambda ex=ex: ex.run(group, q, None, None, cache, k_scale=ks, v_scale=vs)
                )
                if name == "e4m3" and bs in (1, 64, 256):  # host plan + apply (e4m3)
                    host = host_us(lambda ex=ex: ex.apply(fp.plan(layout, heads), table))
                    rep.add("xqa", f"host B{bs} e4m3", f"plan + apply {backend}", host, "µs")
                    host_lines.append([f"B{bs}", backend, f"{host:.0f}"])
            raw_xqa = _raw_xqa(
                spec, table, cache, q, q_scale=0.37 / 1.9 if name == "e4m3" else 1.0,
                kv_scale=1.9 if name == "e4m3" else 1.0,
            )  # fmt: skip
            times["raw xqa"] = kernel_ms(raw_xqa)
            if name == "e4m3":  # the two XQA calls without host time between launches
                xqa_ex = executors["xqa"]
                ours_g = graph_ms(
                    lambda: xqa_ex.run(group, q, None, None, cache, k_scale=ks, v_scale=vs)
                )
                raw_g = graph_ms(raw_xqa)
                rep.add("xqa", f"B{bs}", "flashplan xqa / raw xqa speed, graphs", raw_g / ours_g,
                        "x", key=True)  # fmt: skip
                graph_lines.append([f"B{bs}", f"{ours_g * 1e3:.1f}", f"{raw_g * 1e3:.1f}",
                                    f"{raw_g / ours_g:.3f}"])  # fmt: skip
            indptr, idx, last = decode_inputs(spec, table)
            w = decode_wrapper(workspace(), True)
            w.plan(indptr, idx, last, HQ, HKV, D, PAGE, q_data_type=DT, kv_data_type=dtype)
            times["raw fa2 tc"] = kernel_ms(lambda w=w: w.run(q, cache, k_scale=ks, v_scale=vs))
            for label, t in times.items():
                case = f"decode B{bs} kv{kv} {name}"
                bw = nbytes / t / 1e9
                ms[(bs, name, label)] = t
                rep.add("xqa", case, f"{label} ms", t, "ms")
                rep.add("xqa", case, f"{label} bandwidth", bw, "TB/s")
                lines.append([case, label, f"{t:.3f}", f"{bw:.2f}", f"{100 * bw / copy:.1f}"])
        ours, raw = ms[(bs, "e4m3", "flashplan xqa")], ms[(bs, "e4m3", "raw xqa")]
        bf16 = ms[(bs, "bf16", "flashplan fa2")]  # the default bf16 decode
        bw = bs * kv * 2 * HKV * D / ours / 1e9
        rep.add("xqa", f"B{bs}", "flashplan xqa / raw xqa speed", raw / ours, "x", key=True)
        rep.add("xqa", f"B{bs}", "e4m3 xqa tokens/s / bf16", bf16 / ours, "x", key=True)
        rep.add("xqa", f"B{bs}", "e4m3 xqa % of copy", 100 * bw / copy, "%", key=True)
    rep.table(
        f"Decode kernels, {kv} keys per request, page {PAGE}, {HQ}/{HKV} heads x {D}; "
        f"device-to-device copy {copy:.2f} TB/s (read + write)",
        ["case", "kernel", "ms", "TB/s", "% of copy"], lines,
    )  # fmt: skip
    summary = []
    for bs in batches:
        ours, raw = ms[(bs, "e4m3", "flashplan xqa")], ms[(bs, "e4m3", "raw xqa")]
        fa2 = ms[(bs, "e4m3", "flashplan fa2")]
        bf16, bf16_xqa = ms[(bs, "bf16", "flashplan fa2")], ms[(bs, "bf16", "flashplan xqa")]
        pct = 100 * bs * kv * 2 * HKV * D / ours / 1e9 / copy
        summary.append([f"B{bs}", f"{pct:.1f}", f"{bf16 / ours:.2f}", f"{raw / ours:.3f}",
                        f"{fa2 / ours:.2f}", f"{bf16 / bf16_xqa:.2f}"])  # fmt: skip
    rep.table(
        "XQA targets (issue 52)",
        ["batch", "e4m3 XQA % of copy", "tokens/s vs bf16 decode", "flashplan / raw XQA speed",
         "XQA speed-up over FA2 e4m3", "bf16: XQA speed-up over FA2"],
        summary,
    )  # fmt: skip
    rep.table("Host plan + apply (e4m3 decode, µs)", ["batch", "decode", "µs"], host_lines)
    rep.table(
        "XQA e4m3 decode replayed in a CUDA graph (µs; no host time between launches, L2 "
        "not flushed)", ["batch", "flashplan", "raw XQA", "flashplan / raw speed"], graph_lines,
    )  # fmt: skip
    rep.table(
        f"Raw XQA's split (its sm_count argument) at {kv} keys, e4m3: the profile behind "
        "flashplan's choice (xqa_sm_count: XQA's own)",
        ["batch", "sm_count", "parts asked (before the tile cap)", "ms", "% of copy"],
        _split_sweep(batches, kv, copy),
    )  # fmt: skip
    err_lines = []
    for name, dtype in (("e4m3", torch.float8_e4m3fn), ("bf16", DT)):
        for backend in ("xqa", "fa2"):
            e = _oracle_errors(dtype, backend)
            for stat, value in e.items():
                rep.add("xqa", f"error {name} {backend}", stat, value, "x")
            err_lines.append([name, backend, f"{e['max']:.2e}", f"{e['p99']:.2e}",
                              f"{e['mean']:.2e}"])  # fmt: skip
    rep.table(
        "Error against a float64 oracle (|out - oracle| / max |oracle|; 64 random requests, "
        "1-4096 keys, unit normal inputs, e4m3 scales 0.37 / 1.9)",
        ["cache", "kernel", "max", "p99", "mean"], err_lines,
    )  # fmt: skip


PARTS = {
    "draft": part_draft,
    "fp8": part_fp8,
    "cascade": part_cascade,
    "extend": part_extend,
    "deterministic": part_deterministic,
    "window": part_window,
    "xqa": part_xqa,
}
