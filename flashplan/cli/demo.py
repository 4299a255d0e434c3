"""``python -m flashplan demo``: plan, run and check a mixed example batch.

The demo builds three batches that touch most of the planner's cases, page size 16,
GQA with 8 query heads and 2 KV heads of size 64:

* a decode batch (a first token, page-boundary lengths, a long request) with a
  full-attention group and a sliding-window group;
* an extend batch — requests with and without cached prefix, one empty request, two
  single-token requests — with a full, a sliding-window and a cross-attention group
  (some requests without encoder tokens), planned with the default path;
* the same extend batch planned on the ragged path (ragged + paged with a merge, and a
  custom mask for the windowed prefix);
* a multi-item scoring batch (a question followed by delimiter-separated answers,
  items of one and of several tokens, a cached prefix, and a request without
  delimiters in the middle of the batch) with a full-attention group (soft cap) and a
  cross-attention group, on FlashInfer's multi-item mask.

For each batch it prints the plan (:func:`flashplan.cli.render.describe_plan`), writes
the cached prefix into a paged KV cache with shuffled page ids, runs every group on the
best executor available (the FlashInfer executor when CUDA and flashinfer are usable,
else :class:`~flashplan.executor.reference.ReferenceExecutor`), and compares the output
and LSE with a float64 dense attention computed straight from
:func:`flashplan.oracle.visibility` and the K/V the demo wrote. It also checks that the
executor wrote the new K/V to the slots the layout implies.
"""

from __future__ import annotations

import math
import sys
from typing import Any, TextIO

import numpy as np
import torch

from flashplan.cli.render import describe_plan
from flashplan.executor.protocol import Executor
from flashplan.executor.reference import ReferenceExecutor
from flashplan.layout.batch import BatchLayout
from flashplan.layout.group import AttentionGroup
from flashplan.layout.heads import HeadConfig
from flashplan.layout.page_table import PageTable
from flashplan.oracle import dense_attention, key_row_tokens, visibility
from flashplan.planning.planner import plan

__all__ = ["demo_batches", "make_executor", "run_demo", "tolerance_for"]

PAGE_SIZE = 16
NUM_QO_HEADS = 8
NUM_KV_HEADS = 2
HEAD_DIM = 64
WINDOW_LEFT = 20  # Hugging Face sliding_window = 21

#: Value the demo fills unused cache slots with: a kernel that reads a key it should
#: not would get huge logits and a visibly wrong output.
GARBAGE = 8.0


def tolerance_for(dtype: torch.dtype) -> float:
    """Largest accepted relative error vs the float64 oracle: 1e-2 for bf16, 2e-3 for
    fp16 and fp32 (the quality bars of docs/benchmarks.md)."""
    return 1e-2 if dtype == torch.bfloat16 else 2e-3


def demo_batches(page_size: int = PAGE_SIZE) -> list[tuple[str, BatchLayout, str]]:
    """The demo's batches as ``(title, layout, extend_path)``."""
    full = AttentionGroup.full()
    sliding = AttentionGroup.sliding(WINDOW_LEFT)
    cross = AttentionGroup.cross()
    decode = BatchLayout.decode([1, 16, 17, 40, 100], page_size=page_size, groups=(full, sliding))
    # req 0: prefix 33 (not page-aligned) + 7 new    req 3: prefix 49 + 1 new token
    # req 1: no prefix, 7 new, no encoder            req 4: a single token, no prefix
    # req 2: empty (no tokens at all)                req 5: prefix 32 (page-aligned) + 38 new
    extend = BatchLayout.extend(
        [40, 7, 0, 50, 1, 70],
        [33, 0, 0, 49, 0, 32],
        encoder_lens=[12, 0, 5, 16, 20, 33],
        page_size=page_size,
        groups=(full, sliding, cross),
    )
    # Multi-item scoring. req 0: a 7-token question, then <d> a <d> b <d> c <d> (the
    # reference file's example); req 1: a plain request (no delimiter) with a cached
    # prefix of 20; req 2: 40 cached tokens, a 5-token prompt, items of 3, 0 (two
    # adjacent delimiters) and 8 tokens; req 3: no prompt, the first new token a delimiter.
    scoring = BatchLayout.extend(
        [14, 29, 59, 9],
        [0, 20, 40, 0],
        encoder_lens=[5, 0, 18, 3],
        page_size=page_size,
        groups=(AttentionGroup.full(logits_soft_cap=30.0), cross),
        item_delimiters=[[7, 9, 11, 13], None, [5, 9, 10], [0, 4]],
    )
    return [
        ("decode: full + sliding window", decode, "auto"),
        ("extend: full + sliding window + cross, default path", extend, "auto"),
        ("extend: full + sliding window + cross, ragged path", extend, "ragged"),
        ("multi-item scoring: full (soft cap) + cross, paged path", scoring, "auto"),
    ]


def make_executor(device: torch.device) -> tuple[Executor, str]:
    """The best executor for ``device`` and a line saying which it is and why.

    :class:`~flashplan.executor.flashinfer.FlashInferExecutor` on a CUDA device when it
    imports and constructs (CUDA + flashinfer-python), else
    :class:`~flashplan.executor.reference.ReferenceExecutor`.
    """
    if device.type != "cuda":
        return ReferenceExecutor(), f"ReferenceExecutor on {device} (no CUDA device)"
    try:
        from flashplan.executor.flashinfer import FlashInferExecutor

        return FlashInferExecutor(device), f"FlashInferExecutor on {device}"
    except Exception as exc:  # ImportError, or flashinfer failing to load or initialise
        why = f"FlashInfer executor unavailable: {type(exc).__name__}: {exc}"
        return ReferenceExecutor(), f"ReferenceExecutor on {device} ({why})"


def _slots(table: PageTable, request: int, tokens: np.ndarray, ps: int) -> tuple[Any, Any]:
    row = int(table.rows[request])
    dev = table.pages.device
    t = torch.from_numpy(tokens.astype(np.int64)).to(dev)
    return table.pages[row, t // ps].long(), t % ps


def _errors(
    out: torch.Tensor, lse: torch.Tensor, ref_out: torch.Tensor, ref_lse: torch.Tensor
) -> tuple[float, float]:
    """(max |out - ref| / max |ref|, max |lse - ref| over finite entries; inf on mismatch)."""
    o = out.double().cpu()
    r = ref_out.cpu()
    scale = max(float(r.abs().max()) if r.numel() else 0.0, 1e-30)
    out_err = float((o - r).abs().max()) / scale if r.numel() else 0.0
    if not math.isfinite(out_err):
        out_err = math.inf
    lo, lr = lse.double().cpu(), ref_lse.cpu()
    finite = torch.isfinite(lr)
    if not torch.equal(torch.isfinite(lo), finite) or bool((lo[~finite] > -math.inf).any()):
        return out_err, math.inf
    lse_err = float((lo[finite] - lr[finite]).abs().max()) if bool(finite.any()) else 0.0
    return out_err, lse_err


def _run_batch(
    title: str,
    layout: BatchLayout,
    path: str,
    heads: HeadConfig,
    device: torch.device,
    gen: torch.Generator,
    stream: TextIO,
) -> float:
    spec = plan(layout, heads, extend_path=path)
    print(f"== {title} ==", file=stream)
    print(describe_plan(spec), file=stream)
    print(file=stream)
    ex, which = make_executor(device)
    seed = int(torch.randint(0, 2**31 - 1, (), generator=gen))
    table = PageTable.shuffled(spec.pages_needed, seed=seed, device=device)
    assert table.num_pages is not None
    ex.apply(spec, table)
    ps, dtype = layout.page_size, heads.q_dtype
    hq, hkv, d = heads.num_qo_heads, heads.num_kv_heads, heads.head_dim
    prefix = layout.prefix_lens.tolist()

    def rand(*shape: int) -> torch.Tensor:
        x = torch.randn(*shape, generator=gen, dtype=torch.float32)
        return x.to(dtype).to(device)  # the rounded values are the truth

    print(f"executor: {which}; {dtype} inputs; float64 dense oracle", file=stream)
    worst = 0.0
    qo = spec.qo_indptr.tolist()
    for index, group in enumerate(layout.groups):
        # Each group is one layer with its own cache, filled with garbage first.
        cache = torch.full((table.num_pages, 2, ps, hkv, d), GARBAGE, dtype=dtype, device=device)
        q = rand(spec.total_q, hq, d)
        tokens = key_row_tokens(layout, group)
        keys_k = [rand(t.shape[0], hkv, d) for t in tokens]
        keys_v = [rand(t.shape[0], hkv, d) for t in tokens]
        # The rows this step writes: all encoder keys, or the decoder's new tokens (the
        # cached prefix is written first, as an engine would have left it).
        new = [0 if group.cross_attention else p for p in prefix]
        for i, first in enumerate(new):
            page, slot = _slots(table, i, tokens[i][:first], ps)
            cache[page, 0, slot] = keys_k[i][:first]
            cache[page, 1, slot] = keys_v[i][:first]
        k_in = torch.cat([k[first:] for k, first in zip(keys_k, new, strict=True)])
        v_in = torch.cat([v[first:] for v, first in zip(keys_v, new, strict=True)])
        out, lse = ex.run(group, q, k_in, v_in, cache, return_lse=True)

        writes_ok = True
        for i, first in enumerate(new):
            page, slot = _slots(table, i, tokens[i][first:], ps)
            writes_ok &= bool(torch.equal(cache[page, 0, slot], keys_k[i][first:]))
            writes_ok &= bool(torch.equal(cache[page, 1, slot], keys_v[i][first:]))

        ref = [
            dense_attention(q[qo[i] : qo[i + 1]], keys_k[i], keys_v[i], seen, group)
            for i, seen in enumerate(visibility(layout, group))
        ]
        ref_out = torch.cat([o for o, _ in ref]).cpu()
        ref_lse = torch.cat([s for _, s in ref]).cpu()
        out_err, lse_err = _errors(out, lse, ref_out, ref_lse)
        err = max(out_err, lse_err if math.isfinite(lse_err) else math.inf)
        worst = max(worst, err)
        gp = spec.group_plans[index]
        print(
            f"  group {index}: {group.describe():<24} path {gp.path.value:<13} "
            f"out max rel err {out_err:.2e}   lse max abs err {lse_err:.2e}   "
            f"kv writes {'ok' if writes_ok else 'WRONG'}",
            file=stream,
        )
        if not writes_ok:
            worst = math.inf
    print(file=stream)
    return worst


def run_demo(
    device: torch.device | str | None = None, *, seed: int = 0, stream: TextIO | None = None
) -> float:
    """Plan, run and check the demo batches; return the worst error.

    Args:
        device: where to run (default: ``cuda`` when available, else ``cpu``). Inputs are
            bfloat16 on CUDA and float32 on the CPU.
        seed: seed of the random inputs and page shuffles.
        stream: where to print (default: standard output).

    Returns:
        The worst error over every batch and group: the largest of the output's
        ``max |out - ref| / max |ref|`` and the LSE's max absolute error (base 2) over
        queries that see a key; ``inf`` if an LSE is finite where it should be ``-inf``
        or the reverse, or if a K/V write went to the wrong slot. Compare with
        :func:`tolerance_for`.
    """
    stream = sys.stdout if stream is None else stream
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    heads = HeadConfig(NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM, q_dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    worst = 0.0
    for title, layout, path in demo_batches():
        worst = max(worst, _run_batch(title, layout, path, heads, dev, gen, stream))
    tol = tolerance_for(dtype)
    verdict = "OK" if worst <= tol else "FAILED"
    print(f"worst error {worst:.2e} (tolerance {tol:.0e} for {dtype}): {verdict}", file=stream)
    return worst
