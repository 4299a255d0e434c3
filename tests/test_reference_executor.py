"""ReferenceExecutor == float64 dense attention built from the oracle (never from the plan).

For random layouts (every mode, group kind, page size and extend path), head layouts
(MHA / GQA / MQA) and dtypes (fp32, bf16), the reference executor's output and base-2
LSE must equal attention computed in float64 over the keys that
``flashplan.oracle.visibility`` says each query sees, and the new K/V must land in the
slots the layout implies.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashplan as fp
from flashplan.oracle import dense_attention as oracle_attention
from flashplan.oracle import key_row_tokens, visibility
from flashplan.testing import (
    attention_groups,
    head_configs,
    layouts,
    page_tables,
    verify_layouts,
)

TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}  # fp32 math: only rounding error


def read_tokens(
    cache: torch.Tensor, table: fp.PageTable, i: int, tokens: np.ndarray, page_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    row = int(table.rows[i])
    page = table.pages[row, torch.from_numpy(tokens // page_size)].long()
    slot = torch.from_numpy(tokens % page_size)
    return cache[page, 0, slot], cache[page, 1, slot]


def dense_attention(
    layout: fp.BatchLayout,
    group: fp.AttentionGroup,
    q: torch.Tensor,
    cache: torch.Tensor,
    table: fp.PageTable,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 output [total_q, Hq, D] and base-2 LSE [total_q, Hq], from the oracle."""
    qo = np.concatenate([[0], np.cumsum(layout.extend_lens)])
    outs, lses = [], []
    tokens = key_row_tokens(layout, group)
    for i, seen in enumerate(visibility(layout, group)):
        k, v = read_tokens(cache, table, i, tokens[i], layout.page_size)
        o, s = oracle_attention(q[qo[i] : qo[i + 1]], k, v, seen, group)
        outs.append(o)
        lses.append(s)
    if not outs:
        return torch.zeros(0, q.shape[1], q.shape[2], dtype=torch.float64), torch.zeros(
            0, q.shape[1], dtype=torch.float64
        )
    return torch.cat(outs), torch.cat(lses)


@st.composite
def small_window_layouts(draw: st.DrawFn) -> fp.BatchLayout:
    """Layouts (verify ones too) whose groups include windows small enough to bite."""
    if draw(st.integers(0, 3)) == 0:
        verify_groups = attention_groups(kinds=("full", "sliding", "cross"), max_window=6)
        groups = draw(st.lists(verify_groups, min_size=1, max_size=3, unique=True))
        return draw(
            verify_layouts(
                max_batch=4, max_len=30, long_len=60, page_sizes=(1, 2, 16), groups=groups
            )
        )
    groups = draw(st.lists(attention_groups(max_window=16), min_size=1, max_size=3, unique=True))
    cross = any(g.cross_attention for g in groups)
    return draw(
        layouts(
            max_batch=5,
            max_len=40,
            long_len=90,
            page_sizes=(1, 2, 16),
            groups=groups,
            encoder=True if cross else None,
        )
    )


@settings(max_examples=60, deadline=None)
@given(
    layout=small_window_layouts(),
    heads=head_configs(
        head_dims=(16, 32), dtypes=(torch.float32, torch.bfloat16), max_kv_heads=2, max_group_size=4
    ),
    extend_path=st.sampled_from(["paged", "ragged"]),
    seed=st.integers(0, 2**31 - 1),
    data=st.data(),
)
def test_reference_matches_dense_float64(
    layout: fp.BatchLayout,
    heads: fp.HeadConfig,
    extend_path: str,
    seed: int,
    data: st.DataObject,
) -> None:
    if layout.mode is fp.Mode.VERIFY:
        extend_path = "paged"
    spec = fp.plan(layout, heads, extend_path=extend_path)
    table, pool = data.draw(page_tables(spec))
    gen = torch.Generator().manual_seed(seed)
    ex = fp.ReferenceExecutor()
    ex.apply(spec, table)
    hq, hkv, d = heads.num_qo_heads, heads.num_kv_heads, heads.head_dim
    for group in layout.groups:
        cache = torch.randn(pool, 2, layout.page_size, hkv, d, generator=gen).to(heads.kv_dtype)
        q = torch.randn(spec.total_q, hq, d, generator=gen).to(heads.q_dtype)
        rows = spec.total_encoder if group.cross_attention else spec.total_q
        k_new = torch.randn(rows, hkv, d, generator=gen).to(heads.kv_dtype)
        v_new = torch.randn(rows, hkv, d, generator=gen).to(heads.kv_dtype)
        out, lse = ex.run(group, q, k_new, v_new, cache, return_lse=True)

        # 1. the new K/V landed where the layout says
        qo = np.concatenate([[0], np.cumsum(layout.extend_lens)])
        for i in range(layout.batch_size):
            if group.cross_attention:
                enc = np.concatenate([[0], np.cumsum(layout.encoder_lens)])
                lo, hi, tokens = enc[i], enc[i + 1], key_row_tokens(layout, group)[i]
            else:
                lo, hi = qo[i], qo[i + 1]
                tokens = key_row_tokens(layout, group)[i][int(layout.prefix_lens[i]) :]
            k_got, v_got = read_tokens(cache, table, i, tokens, layout.page_size)
            assert torch.equal(k_got, k_new[lo:hi]) and torch.equal(v_got, v_new[lo:hi])

        # 2. attention equals float64 dense attention over the oracle's keys
        ref_out, ref_lse = dense_attention(layout, group, q, cache, table)
        assert out.shape == (spec.total_q, hq, d) and out.dtype == heads.out_dtype
        if out.numel():
            err = (out.double() - ref_out).abs().max() / ref_out.abs().max().clamp_min(1e-6)
            assert err <= TOL[heads.q_dtype], (group, float(err))
        finite = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), finite), group  # -inf exactly where no key
        assert torch.allclose(lse.double()[finite], ref_lse[finite], atol=1e-3, rtol=1e-4)
        assert (out[~finite.all(dim=1)] == 0).all()  # rows that see nothing are 0


@settings(max_examples=25, deadline=None)
@given(
    group=attention_groups(kinds=("sliding",), max_window=12),
    heads=head_configs(head_dims=(16,), dtypes=(torch.float32,), max_kv_heads=2),
    seed=st.integers(0, 2**31 - 1),
    data=st.data(),
)
def test_paths_agree(
    group: fp.AttentionGroup, heads: fp.HeadConfig, seed: int, data: st.DataObject
) -> None:
    """Paged-only and ragged + paged (masked prefix, base-2 merge) give the same attention."""
    layout = data.draw(layouts(max_batch=4, max_len=40, groups=[group], encoder=False))
    if layout.mode is not fp.Mode.EXTEND:
        return
    outs = []
    for path in ("paged", "ragged"):
        spec = fp.plan(layout, heads, extend_path=path)
        table = fp.PageTable.sequential(spec.pages_needed)
        gen = torch.Generator().manual_seed(seed)
        cache = torch.randn(
            int(spec.pages_needed.sum()) + 1,
            2,
            layout.page_size,
            heads.num_kv_heads,
            heads.head_dim,
            generator=gen,
        )
        q = torch.randn(spec.total_q, heads.num_qo_heads, heads.head_dim, generator=gen)
        k = torch.randn(spec.total_q, heads.num_kv_heads, heads.head_dim, generator=gen)
        ex = fp.ReferenceExecutor(compute_dtype=torch.float64)
        ex.apply(spec, table)
        outs.append(ex.run(group, q, k, k, cache, return_lse=True))
    (o1, l1), (o2, l2) = outs
    assert torch.allclose(o1, o2, atol=1e-5)
    assert torch.equal(torch.isfinite(l1), torch.isfinite(l2))


def test_ragged_run_without_new_kv_is_refused() -> None:
    heads = fp.HeadConfig(num_qo_heads=2, num_kv_heads=1, head_dim=8, q_dtype=torch.float32)
    layout = fp.BatchLayout.extend([5], [2])
    spec = fp.plan(layout, heads, extend_path="ragged")
    ex = fp.ReferenceExecutor()
    ex.apply(spec, fp.PageTable.sequential(spec.pages_needed))
    with pytest.raises(fp.PlanMismatchError, match="ragged"):
        ex.run(fp.AttentionGroup(), torch.zeros(3, 2, 8), None, None, torch.zeros(5, 2, 1, 1, 8))


@settings(max_examples=20, deadline=None)
@given(window=st.integers(0, 12), seed=st.integers(0, 2**31 - 1), data=st.data())
def test_swa_page_map(window: int, seed: int, data: st.DataObject) -> None:
    """A windowed group reading/writing a window pool through a page map equals the same
    group on a full pool holding the same contents; other groups ignore the map."""
    group = fp.AttentionGroup(window_left=window)
    layout = data.draw(layouts(min_batch=1, max_batch=4, max_len=30, groups=[group], encoder=False))
    heads = fp.HeadConfig(num_qo_heads=2, num_kv_heads=1, head_dim=8, q_dtype=torch.float32)
    spec = fp.plan(layout, heads, extend_path=data.draw(st.sampled_from(["paged", "ragged"])))
    table = fp.PageTable.sequential(spec.pages_needed)
    total = max(int(spec.pages_needed.sum()), 1)
    perm = torch.from_numpy(np.random.default_rng(seed).permutation(total).astype(np.int32))
    page_map = torch.cat([perm, torch.tensor([-1], dtype=torch.int32)])
    gen = torch.Generator().manual_seed(seed)
    window_pool = torch.randn(total, 2, layout.page_size, 1, 8, generator=gen)
    full_pool = window_pool[perm.long()].clone()  # full page p lives at window page perm[p]
    q = torch.randn(spec.total_q, 2, 8, generator=gen)
    k = torch.randn(spec.total_q, 1, 8, generator=gen)
    mapped = fp.ReferenceExecutor(page_map=page_map)
    mapped.apply(spec, table)
    plain = fp.ReferenceExecutor()
    plain.apply(spec, table)
    out_mapped = mapped.run(group, q, k, k, window_pool)
    out_plain = plain.run(group, q, k, k, full_pool)
    assert torch.equal(out_mapped, out_plain)
    assert torch.equal(window_pool[perm.long()], full_pool)  # writes went through the map
