"""Shared set-up of the GPU tests: random batches run on both executors."""

from __future__ import annotations

import numpy as np
import torch

import flashplan as fp


def random_table(
    spec: fp.PlanSpec, rng: np.random.Generator, device: str
) -> tuple[fp.PageTable, int]:
    """A page table with shuffled, non-overlapping pages (+ spare pages); (table, num_pages)."""
    need = spec.pages_needed.astype(np.int64)
    num_pages = int(need.sum()) + 3
    perm = rng.permutation(num_pages).astype(np.int32)
    width = int(need.max()) + 2 if need.size else 1
    table = np.zeros((need.shape[0] + 1, width), dtype=np.int32)
    starts = np.concatenate([[0], np.cumsum(need)])
    rows = rng.permutation(need.shape[0] + 1)[: need.shape[0]].astype(np.int32)
    for i, row in enumerate(rows):  # test set-up, not library code
        table[row, : need[i]] = perm[starts[i] : starts[i + 1]]
    return fp.PageTable(pages=torch.from_numpy(table).to(device), rows=rows), num_pages


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| (0 for empty tensors)."""
    if out.numel() == 0:
        return 0.0
    denom = ref.double().abs().max().clamp_min(1e-6)
    return float((out.double() - ref.double()).abs().max() / denom)


def run_both(
    layout: fp.BatchLayout,
    heads: fp.HeadConfig,
    executor: object,
    *,
    extend_path: str = "auto",
    seed: int = 0,
    device: str = "cuda",
) -> list[tuple[fp.AttentionGroup, float, float, float]]:
    """Run every group on ``executor`` and on the reference; per group
    (group, output rel err, finite-LSE max abs err, cache rel err)."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    spec = fp.plan(layout, heads, extend_path=extend_path)
    table, num_pages = random_table(spec, rng, device)
    ref = fp.ReferenceExecutor()
    ref.apply(spec, table)
    executor.apply(spec, table)  # type: ignore[attr-defined]
    results = []
    hq, hkv, d = heads.num_qo_heads, heads.num_kv_heads, heads.head_dim
    for group in layout.groups:
        cache = torch.randn(
            num_pages, 2, layout.page_size, hkv, d, generator=gen, device=device
        ).to(heads.kv_dtype)
        cache_ref = cache.clone()
        q = torch.randn(spec.total_q, hq, d, generator=gen, device=device).to(heads.q_dtype)
        rows = spec.total_encoder if group.cross_attention else spec.total_q
        k = torch.randn(rows, hkv, d, generator=gen, device=device).to(heads.kv_dtype)
        v = torch.randn(rows, hkv, d, generator=gen, device=device).to(heads.kv_dtype)
        out, lse = executor.run(group, q, k, v, cache, return_lse=True)  # type: ignore[attr-defined]
        out_ref, lse_ref = ref.run(group, q, k, v, cache_ref, return_lse=True)
        finite = torch.isfinite(lse_ref)
        lse_err = float((lse[finite] - lse_ref[finite]).abs().max()) if finite.any() else 0.0
        assert torch.equal(torch.isfinite(lse), finite) or not finite.all(), (
            "LSE -inf pattern differs"
        )
        results.append((group, rel_err(out, out_ref), lse_err, rel_err(cache, cache_ref)))
    return results
