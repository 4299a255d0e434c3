"""Shared set-up of the GPU tests: random batches run on both executors."""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

import flashplan as fp


def stable_seed(*parts: object) -> int:
    """A seed that is the same in every process (``hash()`` of strings is not)."""
    return zlib.crc32(repr(parts).encode())


@contextmanager
def syncs_raise(active: bool = True) -> Iterator[None]:
    """Wait for the GPU, then (when ``active``) make every synchronizing CUDA call inside
    the block raise (``torch.cuda.set_sync_debug_mode("error")``); the default mode after."""
    torch.cuda.synchronize()
    if active:
        torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| (0 for empty tensors)."""
    if out.numel() == 0:
        return 0.0
    denom = ref.double().abs().max().clamp_min(1e-6)
    return float((out.double() - ref.double()).abs().max() / denom)


def flashinfer_executor(**policy: object) -> fp.Executor:
    """A FlashInferExecutor with the given ExecutorPolicy fields."""
    from flashplan.executor.flashinfer import ExecutorPolicy, FlashInferExecutor

    return FlashInferExecutor(policy=ExecutorPolicy(**policy))  # type: ignore[arg-type]


def run_both(
    layout: fp.BatchLayout,
    heads: fp.HeadConfig,
    executor: fp.Executor,
    *,
    extend_path: str = "auto",
    seed: int = 0,
    device: str = "cuda",
    scales: tuple[float | torch.Tensor, float | torch.Tensor] | None = None,
    reference: fp.Executor | None = None,
) -> list[tuple[fp.AttentionGroup, float, float, float]]:
    """Run every group on ``executor`` and on ``reference`` (default: a fresh
    :class:`~flashplan.ReferenceExecutor`) over the same table and inputs; per group
    (group, output rel err, finite-LSE max abs err, cache rel err).

    ``scales``: an fp8 cache's ``(k_scale, v_scale)``, passed to both executors (new
    K/V are then drawn in the queries' dtype, the cache in its fp8 format). A 0-d tensor
    ``k_scale`` is compared with the reference on the folded queries ``bf16(q · k_scale)``.

    Asserts that both executors agree on which queries see no key (LSE ``-inf``).
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    spec = fp.plan(layout, heads, extend_path=extend_path)
    table = fp.PageTable.shuffled(spec.pages_needed, seed=seed, device=device)
    assert table.num_pages is not None
    ref = fp.ReferenceExecutor() if reference is None else reference
    ref.apply(spec, table)
    executor.apply(spec, table)
    results = []
    hq, hkv, d = heads.num_qo_heads, heads.num_kv_heads, heads.head_dim
    for group in layout.groups:
        cache = torch.randn(
            table.num_pages, 2, layout.page_size, hkv, d, generator=gen, device=device
        ).to(heads.kv_dtype)
        cache_ref = cache.clone()
        q = torch.randn(spec.total_q, hq, d, generator=gen, device=device).to(heads.q_dtype)
        rows = spec.total_encoder if group.cross_attention else spec.total_q
        k = torch.randn(rows, hkv, d, generator=gen, device=device).to(heads.kv_input_dtype)
        v = torch.randn(rows, hkv, d, generator=gen, device=device).to(heads.kv_input_dtype)
        sinks = None
        if group.sinks:  # sink logits around the scores' scale, so that they matter
            sinks = torch.randn(hq, generator=gen, device=device) * 3
        k_scale, v_scale = (None, None) if scales is None else scales
        out, lse = executor.run(
            group, q, k, v, cache, return_lse=True, sinks=sinks, k_scale=k_scale, v_scale=v_scale
        )
        out_ref, lse_ref = ref.run(
            group, q, k, v, cache_ref, return_lse=True, sinks=sinks, k_scale=k_scale,
            v_scale=v_scale,
        )  # fmt: skip
        if isinstance(k_scale, torch.Tensor):
            # A 0-d k_scale is folded into the queries once, bf16(q · k_scale): that one
            # documented rounding (docs/semantics.md, bounded by tests/test_fp8.py) is not
            # the executor's; compare with the reference on the folded queries, the cache
            # as both executors just wrote it.
            folded_q = (q.float() * k_scale).to(q.dtype)
            out_ref, lse_ref = ref.run(
                group, folded_q, None, None, cache_ref, return_lse=True, sinks=sinks,
                v_scale=v_scale,
            )  # fmt: skip
        finite = torch.isfinite(lse_ref)
        assert torch.equal(torch.isfinite(lse), finite), (
            f"group {group.describe()}: queries that see no key differ "
            f"({int((torch.isfinite(lse) != finite).sum())} entries)"
        )
        blind = ~finite.any(dim=1)
        assert not out[blind].any(), "a query that sees no key must output 0"
        lse_err = float((lse[finite] - lse_ref[finite]).abs().max()) if finite.any() else 0.0
        results.append((group, rel_err(out, out_ref), lse_err, rel_err(cache, cache_ref)))
    return results


def random_lens(rng: np.random.Generator, bs: int, lo: int, hi: int) -> np.ndarray:
    """``bs`` lengths in ``[lo, hi)``."""
    return rng.integers(lo, hi, bs)
