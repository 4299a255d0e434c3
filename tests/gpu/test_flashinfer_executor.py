"""FlashInfer executor == reference executor, on real kernels (H200)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import flashplan as fp

from .helpers import run_both, stable_seed, syncs_raise

TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _executor(backend: str = "fa2", tensor_cores: bool | None = None) -> fp.Executor:
    from flashplan.executor.flashinfer import ExecutorPolicy, FlashInferExecutor

    return FlashInferExecutor(
        policy=ExecutorPolicy(prefill_backend=backend, decode_tensor_cores=tensor_cores)
    )


def _lens(rng: np.random.Generator, bs: int, mode: str) -> tuple[np.ndarray, np.ndarray]:
    seq = rng.integers(1, 300, bs)
    seq[0] = 1  # single-token request
    if mode == "decode":
        return seq, seq - 1
    if mode == "noprefix":
        return seq, np.zeros_like(seq)
    prefix = (seq * rng.random(bs)).astype(np.int64)
    prefix[-1] = 0  # an empty prefix inside a batch with prefixes
    if bs > 2:
        prefix[1] = seq[1]  # an empty extend
    return seq, prefix


CASES = [
    (mode, ps, dtype, d, hq, hkv, cap)
    for mode in ("decode", "noprefix", "prefix-ragged", "prefix-paged")
    for ps in (1, 16)
    for dtype in (torch.bfloat16, torch.float16)
    for d in (64, 128)
    for hq, hkv in ((8, 8), (16, 4), (8, 1))
    for cap in (0.0, 30.0)
]


@pytest.mark.parametrize(("mode", "page_size", "dtype", "head_dim", "hq", "hkv", "cap"), CASES)
def test_matches_reference(mode, page_size, dtype, head_dim, hq, hkv, cap):
    rng = np.random.default_rng(stable_seed(mode, page_size, dtype, head_dim, hq, hkv, cap))
    seq, prefix = _lens(rng, 5, mode)
    heads = fp.HeadConfig(num_qo_heads=hq, num_kv_heads=hkv, head_dim=head_dim, q_dtype=dtype)
    group = fp.AttentionGroup(logits_soft_cap=cap)
    if mode == "decode":
        layout = fp.BatchLayout.decode(seq, page_size=page_size, groups=[group])
    else:
        layout = fp.BatchLayout.extend(seq, prefix, page_size=page_size, groups=[group])
    path = "paged" if mode == "prefix-paged" else "ragged"
    for _, out_err, lse_err, cache_err in run_both(layout, heads, _executor(), extend_path=path):
        assert out_err <= TOL[dtype]
        assert lse_err <= 5e-2
        assert cache_err == 0.0


@pytest.mark.parametrize("tensor_cores", [True, False])
def test_decode_kernel_kinds(tensor_cores):
    heads = fp.HeadConfig(num_qo_heads=32, num_kv_heads=8, head_dim=128)
    layout = fp.BatchLayout.decode([1, 17, 4096, 300], page_size=16)
    for _, out_err, _, _ in run_both(layout, heads, _executor(tensor_cores=tensor_cores)):
        assert out_err <= 1e-2


@pytest.mark.parametrize("path", ["ragged", "paged"])
def test_fa3_extend(path):
    heads = fp.HeadConfig(num_qo_heads=32, num_kv_heads=8, head_dim=128)
    layout = fp.BatchLayout.extend([700, 5, 1, 300], [500, 0, 0, 299], page_size=16)
    for _, out_err, _, _ in run_both(layout, heads, _executor("fa3"), extend_path=path):
        assert out_err <= 1e-2


def test_all_empty_prefix_and_empty_batch_rows():
    heads = fp.HeadConfig(num_qo_heads=8, num_kv_heads=2, head_dim=128)
    layout = fp.BatchLayout.extend([0, 3, 0], [0, 0, 0], page_size=16)
    for _, out_err, _, _ in run_both(layout, heads, _executor(), extend_path="paged"):
        assert out_err <= 1e-2


def test_plan_equals_run_refuses_unplanned_group():
    heads = fp.HeadConfig(num_qo_heads=8, num_kv_heads=2, head_dim=128)
    layout = fp.BatchLayout.decode([5, 9], page_size=16)
    ex = _executor()
    spec = fp.plan(layout, heads)
    ex.apply(spec, fp.PageTable.sequential(spec.pages_needed, device="cuda"))
    q = torch.zeros(2, 8, 128, dtype=torch.bfloat16, device="cuda")
    cache = torch.zeros(4, 2, 16, 2, 128, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(fp.PlanMismatchError, match="window=4"):
        ex.run(fp.AttentionGroup(window_left=4), q, None, None, cache)
    with pytest.raises(fp.PlanMismatchError, match="dtype"):
        ex.run(fp.AttentionGroup(), q.half(), None, None, cache)


@pytest.mark.parametrize("mode", ["decode", "ragged", "paged", "noprefix"])
def test_apply_and_run_never_sync(mode):
    heads = fp.HeadConfig(num_qo_heads=8, num_kv_heads=2, head_dim=128)
    group = fp.AttentionGroup()
    ex = _executor()

    def layout(seed: int) -> fp.BatchLayout:
        rng = np.random.default_rng(seed)
        seq = rng.integers(2, 200, 6)
        if mode == "decode":
            return fp.BatchLayout.decode(seq, page_size=16)
        prefix = np.zeros_like(seq) if mode == "noprefix" else seq // 2
        return fp.BatchLayout.extend(seq, prefix, page_size=16)

    path = "paged" if mode == "paged" else "ragged"
    cache = torch.randn(64, 2, 16, 2, 128, device="cuda").to(torch.bfloat16)
    for seed in (0, 1):  # first round warms up (module loads), second runs under "error"
        spec = fp.plan(layout(seed), heads, extend_path=path)
        table = fp.PageTable.sequential(spec.pages_needed, device="cuda")
        q = torch.randn(spec.total_q, 8, 128, device="cuda").to(torch.bfloat16)
        k = torch.randn(spec.total_q, 2, 128, device="cuda").to(torch.bfloat16)
        with syncs_raise(seed == 1):
            ex.apply(spec, table)
            ex.run(group, q, k, k, cache)
    torch.cuda.synchronize()


def test_nan_is_never_hidden_on_the_merged_path():
    """NaN in q reaches the output on ragged + paged (the merge must not take a NaN side
    for an empty one), as on the paged path."""
    heads = fp.HeadConfig(num_qo_heads=8, num_kv_heads=2, head_dim=128)
    layout = fp.BatchLayout.extend([40, 9], [33, 0], page_size=16)
    for path in ("ragged", "paged"):
        spec = fp.plan(layout, heads, extend_path=path)
        table = fp.PageTable.shuffled(spec.pages_needed, seed=1, device="cuda")
        ex = _executor()
        ex.apply(spec, table)
        cache = torch.randn(table.num_pages, 2, 16, 2, 128, device="cuda").to(torch.bfloat16)
        q = torch.randn(spec.total_q, 8, 128, device="cuda").to(torch.bfloat16)
        k = torch.randn(spec.total_q, 2, 128, device="cuda").to(torch.bfloat16)
        q[0] = float("nan")
        out, lse = ex.run(fp.AttentionGroup(), q, k, k, cache, return_lse=True)
        assert torch.isnan(out[0]).all() and torch.isnan(lse[0]).all(), path
        assert torch.isfinite(out[1:]).all(), path


def _prefill_sequence(page_size: int, seed: int) -> list[fp.BatchLayout]:
    """Paged prefill batches of every kind one after another, batch sizes shrinking and
    growing: extends over cached prefixes (full, windowed with a soft cap,
    bidirectional), the same batch twice, multi-item scoring, verify trees (a window
    carried by the mask), then plain extends and multi-item again."""
    rng = np.random.default_rng(seed)
    groups = (
        fp.AttentionGroup.full(),
        fp.AttentionGroup.sliding(40, logits_soft_cap=30.0),
        fp.AttentionGroup.bidirectional(),
    )

    def extend(bs: int, lo: int, hi: int) -> fp.BatchLayout:
        seq = rng.integers(lo, hi, bs)
        pre = (seq * rng.uniform(0, 0.9, bs)).astype(np.int64)
        return fp.BatchLayout.extend(seq, pre, page_size=page_size, groups=groups)

    parents = np.full((5, 8), -1, dtype=np.int64)
    for j in range(1, 8):
        parents[:, j] = rng.integers(0, j, 5)
    tree = fp.DraftTree.from_parents(parents)
    verify_groups = (fp.AttentionGroup.full(), fp.AttentionGroup.sliding(30))
    again = extend(7, 100, 900)
    return [
        extend(3, 5, 40),
        again,
        again,
        extend(2, 1, 2000),
        fp.BatchLayout.extend(
            [40, 18, 25, 9],
            [3, 0, 5, 0],
            page_size=page_size,
            item_delimiters=[[2, 9, 14, 30], [4, 5, 6], None, [0, 8]],
        ),
        fp.BatchLayout.verify(
            rng.integers(20, 300, 5), tree, page_size=page_size, groups=verify_groups
        ),
        fp.BatchLayout.verify(
            rng.integers(1, 90, 5), tree, page_size=page_size, groups=verify_groups
        ),
        extend(5, 1, 300),
        fp.BatchLayout.extend(
            [33, 7], [0, 2], page_size=page_size, item_delimiters=[[1, 2, 20], None]
        ),
    ]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "e4m3"])
def test_one_executor_over_paged_prefill_batches(page_size: int, kv_dtype: torch.dtype) -> None:
    """One executor (FA2, paged path) over a sequence of paged prefill batches of every
    kind (:func:`_prefill_sequence`): the wrappers it plans again with other masks,
    items and lengths equal the reference on every batch, on a bf16 and an fp8 cache."""
    heads = fp.HeadConfig(16, 4, 128, q_dtype=torch.bfloat16, kv_dtype=kv_dtype)
    scales = (0.37, 1.9) if kv_dtype != torch.bfloat16 else None
    ex = _executor()
    seed = stable_seed("prefill sequence", page_size, str(kv_dtype))
    for step, layout in enumerate(_prefill_sequence(page_size, seed)):
        for group, out_err, lse_err, cache_err in run_both(
            layout, heads, ex, extend_path="paged", seed=step, scales=scales
        ):
            assert out_err <= 1e-2, (step, group.describe(), out_err)
            assert lse_err <= 5e-2, (step, group.describe(), lse_err)
            assert cache_err == 0.0, (step, group.describe())
