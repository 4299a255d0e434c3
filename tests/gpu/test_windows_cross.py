"""Sliding-window and cross-attention groups on real FlashInfer kernels vs the reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import flashplan as fp

from .helpers import run_both

FULL = fp.AttentionGroup()
W4 = fp.AttentionGroup(window_left=4)
W127 = fp.AttentionGroup(window_left=127, logits_soft_cap=30.0)
CROSS = fp.AttentionGroup.cross()


def _executor() -> fp.Executor:
    from flashplan.executor.flashinfer import ExecutorPolicy, FlashInferExecutor

    return FlashInferExecutor(policy=ExecutorPolicy(prefill_backend="fa2"))


def _seq_lens(rng: np.random.Generator) -> np.ndarray:
    # shorter than both windows, exactly at each window edge (W + 1 keys), around them, long
    edge = np.array([1, 3, 5, 6, 127, 128, 129, 300])
    return np.concatenate([edge, rng.integers(1, 400, 4)])


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("mode", ["decode", "ragged", "paged", "noprefix"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_three_groups_and_cross(page_size, mode, dtype):
    rng = np.random.default_rng(page_size * 7 + len(mode))
    seq = _seq_lens(rng)
    enc = rng.integers(0, 50, seq.shape[0])
    enc[0] = 0  # a request without encoder tokens
    groups = [FULL, W4, W127, CROSS]
    if mode == "decode":
        layout = fp.BatchLayout.decode(seq, page_size=page_size, groups=groups, encoder_lens=enc)
    else:
        if mode == "noprefix":
            prefix = np.zeros_like(seq)
        else:
            prefix = (seq * rng.random(seq.shape[0])).astype(np.int64)
            prefix[3] = seq[3] - 1  # one new token right at a window edge
        layout = fp.BatchLayout.extend(
            seq, prefix, page_size=page_size, groups=groups, encoder_lens=enc
        )
    heads = fp.HeadConfig(num_qo_heads=16, num_kv_heads=4, head_dim=128, q_dtype=dtype)
    path = "paged" if mode in ("paged", "decode") else "ragged"
    spec = fp.plan(layout, heads, extend_path=path)
    if mode == "ragged":
        assert spec.group_plan(W4).uses_custom_mask  # the windowed prefix needs the mask
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    for group, out_err, lse_err, cache_err in run_both(
        layout, heads, _executor(), extend_path=path, seed=page_size
    ):
        assert out_err <= tol, group
        assert lse_err <= 5e-2, group
        assert cache_err == 0.0, group


def test_swa_page_map_decode():
    """Windowed groups read/write through a full->window page-id map."""
    from flashplan.executor.flashinfer import FlashInferExecutor

    heads = fp.HeadConfig(num_qo_heads=8, num_kv_heads=2, head_dim=128)
    layout = fp.BatchLayout.decode([5, 40, 200], page_size=16, groups=[W4])
    spec = fp.plan(layout, heads)
    table = fp.PageTable.sequential(spec.pages_needed, device="cuda")
    total = int(spec.pages_needed.sum())
    # window pool: page p of the full pool lives at window page (total - 1 - p); last entry -1
    page_map = torch.tensor([*range(total - 1, -1, -1), -1], dtype=torch.int32, device="cuda")
    window_pool = torch.randn(total, 2, 16, 2, 128, device="cuda").to(torch.bfloat16)
    full_view = window_pool[page_map[:-1].long()]  # the same contents seen through full ids
    q = torch.randn(3, 8, 128, device="cuda").to(torch.bfloat16)
    ex = FlashInferExecutor(page_map=page_map)
    ex.apply(spec, table)
    out = ex.run(W4, q, None, None, window_pool)
    ref = fp.ReferenceExecutor()
    ref.apply(spec, table)
    out_ref = ref.run(W4, q, None, None, full_view)
    assert (out.float() - out_ref.float()).abs().max() / out_ref.float().abs().max() <= 1e-2
