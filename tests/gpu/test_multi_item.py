"""Multi-item scoring on real FlashInfer kernels (H200).

1. FlashInfer executor == reference executor (which applies FlashInfer's multi-item rule,
   itself checked against the float64 oracle on the CPU), for mixed batches — requests
   without delimiters first, in the middle and last —, items of one token, empty items
   (adjacent delimiters), delimiters as the first and last tokens, cached prefixes,
   page sizes 1 and 16, MHA / GQA, bf16 / fp16, soft cap, and a cross group beside.
2. What users care about: the output of every token of every item equals scoring that
   item alone — the prompt plus that item as its own causal request, RoPE applied at the
   standalone positions — within bf16 tolerance.
3. One executor over batches of longer and then shorter items (the multi-item buffers
   reused) equals the reference every time; a plain batch after a multi-item one is
   plain again; apply + run never sync.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import flashplan as fp

from .helpers import rel_err, run_both, syncs_raise

TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
FULL = fp.AttentionGroup()


def _executor() -> object:
    from flashplan.executor.flashinfer import ExecutorPolicy, FlashInferExecutor

    return FlashInferExecutor(policy=ExecutorPolicy(prefill_backend="fa2"))


def _scoring_request(
    rng: np.random.Generator, prefix: int, prompt: int, lengths: list[int], closing: bool
) -> tuple[int, int, list[int]]:
    """(seq_len, prefix_len, delimiters): prompt, then <d> item for each item, [<d>]."""
    delims, at = [], prompt
    for n in lengths:
        delims.append(at)
        at += 1 + n
    if closing:
        delims.append(at)
        at += 1
    return prefix + at, prefix, delims


def _mixed_batch(rng: np.random.Generator, page_size: int, groups: tuple) -> fp.BatchLayout:
    reqs = [
        (int(rng.integers(1, 60)), 0, None),  # plain, first
        _scoring_request(rng, 0, 7, [1, 1, 1], True),  # the reference file's example
        _scoring_request(rng, 40, 0, [3, 0, 5], False),  # cached prefix, delimiter first
        (int(rng.integers(20, 90)), int(rng.integers(0, 20)), None),  # plain, middle
        _scoring_request(rng, 0, 200, [int(n) for n in rng.integers(1, 9, 32)], True),
        _scoring_request(rng, 17, 130, [0, 0, 2], True),  # adjacent delimiters
        (int(rng.integers(1, 40)), 0, None),  # plain, last
    ]
    enc = rng.integers(0, 40, len(reqs)) if any(g.cross_attention for g in groups) else None
    return fp.BatchLayout.extend(
        [r[0] for r in reqs],
        [r[1] for r in reqs],
        page_size=page_size,
        groups=groups,
        encoder_lens=enc,
        item_delimiters=[r[2] for r in reqs],
    )


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("hq", "hkv", "head_dim"), [(8, 8, 128), (16, 4, 128), (8, 2, 64)])
@pytest.mark.parametrize("cap", [0.0, 30.0])
def test_matches_reference(page_size, dtype, hq, hkv, head_dim, cap):
    rng = np.random.default_rng(page_size * 1000 + hq * 10 + int(cap))
    groups = (fp.AttentionGroup(logits_soft_cap=cap), fp.AttentionGroup.cross())
    layout = _mixed_batch(rng, page_size, groups)
    heads = fp.HeadConfig(num_qo_heads=hq, num_kv_heads=hkv, head_dim=head_dim, q_dtype=dtype)
    for group, out_err, lse_err, cache_err in run_both(layout, heads, _executor()):
        assert out_err <= TOL[dtype], group
        assert lse_err <= 5e-2, group
        assert cache_err == 0.0, group


@pytest.mark.parametrize("seed", range(4))
def test_random_batches_match_reference(seed):
    rng = np.random.default_rng(seed)
    reqs = []
    for _ in range(int(rng.integers(1, 9))):
        if rng.random() < 0.3:
            seq = int(rng.integers(0, 300))
            reqs.append((seq, int(rng.integers(0, seq + 1)), None))
            continue
        lengths = [int(n) for n in rng.integers(0, 12, int(rng.integers(1, 40)))]
        reqs.append(
            _scoring_request(
                rng,
                int(rng.integers(0, 300)),
                int(rng.integers(0, 300)),
                lengths,
                rng.random() < 0.5,
            )
        )
    layout = fp.BatchLayout.extend(
        [r[0] for r in reqs], [r[1] for r in reqs], page_size=int(rng.choice([1, 16])),
        item_delimiters=[r[2] for r in reqs],
    )  # fmt: skip
    heads = fp.HeadConfig(32, 8, 128)
    for _, out_err, lse_err, cache_err in run_both(layout, heads, _executor(), seed=seed):
        assert out_err <= 1e-2 and lse_err <= 5e-2 and cache_err == 0.0


# --------------------------------------------------------------------------- items alone
def _rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (NeoX halves) of ``x [n, h, d]`` at ``positions [n]``, in float32."""
    d = x.shape[-1]
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = positions.to(torch.float32)[:, None] * inv[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    a, b = x.float()[..., : d // 2], x.float()[..., d // 2 :]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


def _fill_prefix(
    cache: torch.Tensor, table: fp.PageTable, i: int, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Write request i's cached prefix (rows 0..P-1 of its table row)."""
    ps = cache.shape[2]
    t = torch.arange(k.shape[0], device=cache.device)
    page = table.pages[int(table.rows[i]), t // ps].long()
    cache[page, 0, t % ps] = k
    cache[page, 1, t % ps] = v


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("cap", [0.0, 30.0])
def test_each_item_equals_scoring_it_alone(page_size, cap):
    """Every item token's output (and every prompt token's) equals the same token in a
    standalone causal request made of the prompt and that item alone, RoPE'd at the
    standalone positions; the multi-item batch uses PlanSpec.positions for RoPE."""
    rng = np.random.default_rng(page_size + int(cap))
    gen = torch.Generator(device="cuda").manual_seed(page_size)
    dtype, hq, hkv, d = torch.bfloat16, 16, 4, 128
    heads = fp.HeadConfig(hq, hkv, d, q_dtype=dtype)
    group = fp.AttentionGroup(logits_soft_cap=cap)
    reqs = [
        _scoring_request(rng, 0, 7, [1, 1, 1], True),
        (37, 5, None),  # a plain request in the middle of the batch
        _scoring_request(rng, 24, 50, [int(n) for n in rng.integers(1, 9, 32)], True),
        _scoring_request(rng, 0, 0, [4, 2], False),  # no prompt at all
        _scoring_request(rng, 9, 3, [2, 0, 6], False),
    ]
    layout = fp.BatchLayout.extend(
        [r[0] for r in reqs], [r[1] for r in reqs], page_size=page_size, groups=group,
        item_delimiters=[r[2] for r in reqs],
    )  # fmt: skip
    spec = fp.plan(layout, heads)
    table = fp.PageTable.shuffled(spec.pages_needed, seed=page_size, device="cuda")
    num_pages = table.num_pages

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda")

    # Raw (pre-RoPE) q/k/v of every token: cached prefix and new tokens.
    raw = []
    for seq, _, _ in reqs:
        raw.append((randn(seq, hq, d), randn(seq, hkv, d), randn(seq, hkv, d)))
    cache = torch.zeros(num_pages, 2, page_size, hkv, d, dtype=dtype, device="cuda")
    positions = torch.from_numpy(spec.positions.astype(np.int64)).to("cuda")
    qo = spec.qo_indptr.tolist()
    q_rows, k_rows, v_rows = [], [], []
    for i, ((_, pre, _), (q, k, v)) in enumerate(zip(reqs, raw, strict=True)):
        cached = torch.arange(pre, device="cuda")
        _fill_prefix(cache, table, i, _rope(k[:pre], cached).to(dtype), v[:pre].to(dtype))
        pos = positions[qo[i] : qo[i + 1]]
        q_rows.append(_rope(q[pre:], pos).to(dtype))
        k_rows.append(_rope(k[pre:], pos).to(dtype))
        v_rows.append(v[pre:].to(dtype))
    ex = _executor()
    ex.apply(spec, table)  # type: ignore[attr-defined]
    out = ex.run(group, torch.cat(q_rows), torch.cat(k_rows), torch.cat(v_rows), cache)  # type: ignore[attr-defined]

    # The standalone requests: cached prefix + prompt + one item, plain causal.
    alone, where = [], []  # (seq, prefix, token indices into the request), (request, token j)
    for i, (seq, pre, delims) in enumerate(reqs):
        e = seq - pre
        if delims is None:
            alone.append((i, list(range(e))))
            continue
        f = delims[0]
        bounds = [*delims, e]
        for a, b in itertools.pairwise(bounds):
            alone.append((i, list(range(f)) + list(range(a + 1, b))))  # prompt + item a
    s_seq = [int(reqs[i][1]) + len(toks) for i, toks in alone]
    s_pre = [int(reqs[i][1]) for i, _ in alone]
    s_layout = fp.BatchLayout.extend(s_seq, s_pre, page_size=page_size, groups=group)
    s_spec = fp.plan(s_layout, heads, extend_path="paged")
    s_table = fp.PageTable.shuffled(s_spec.pages_needed, seed=page_size + 1, device="cuda")
    s_pages = s_table.num_pages
    s_cache = torch.zeros(s_pages, 2, page_size, hkv, d, dtype=dtype, device="cuda")
    sq, sk, sv = [], [], []
    for n, (i, toks) in enumerate(alone):
        seq, pre, _ = reqs[i]
        q, k, v = raw[i]
        cached = torch.arange(pre, device="cuda")
        _fill_prefix(s_cache, s_table, n, _rope(k[:pre], cached).to(dtype), v[:pre].to(dtype))
        rows = torch.tensor([pre + j for j in toks], device="cuda", dtype=torch.long)
        pos = torch.arange(pre, pre + len(toks), device="cuda")  # standalone positions
        sq.append(_rope(q[rows], pos).to(dtype))
        sk.append(_rope(k[rows], pos).to(dtype))
        sv.append(v[rows].to(dtype))
        where += [(i, j) for j in toks]
    s_ex = _executor()
    s_ex.apply(s_spec, s_table)  # type: ignore[attr-defined]
    s_out = s_ex.run(group, torch.cat(sq), torch.cat(sk), torch.cat(sv), s_cache)  # type: ignore[attr-defined]

    rows_multi = torch.tensor([qo[i] + j for i, j in where], device="cuda")
    got, want = out[rows_multi], s_out
    assert rel_err(got, want) <= 1e-2
    # Every item token was compared (prompt tokens once per item of their request).
    for i, (seq, pre, delims) in enumerate(reqs):
        if delims:
            tokens = set(range(delims[0], seq - pre)) - set(delims)
            assert {(i, j) for j in tokens} <= set(where)


# --------------------------------------------------------------------------- plumbing
def test_one_executor_over_longer_and_shorter_item_batches():
    """One executor over multi-item batches whose item tensors grow and then shrink
    (FlashInfer keeps ``token_pos_in_items`` in a buffer the executor reuses: every
    entry outside an item must be zeroed again), a batch without any item between:
    every batch equals the reference."""
    heads = fp.HeadConfig(8, 2, 128)
    ex = _executor()
    batches = [
        ([5, 14, 12], [2, 0, 0], [None, [7, 9, 11, 13], [2, 4, 8, 11]]),
        ([40, 33], [0, 3], [[1, 20, 21], [0, 29]]),
        ([9, 12], [0, 0], [[3, 6, 8], [2, 4, 8, 11]]),  # the reference file's batch
        ([30, 7], [4, 0], None),  # no items at all
        ([60, 25, 18], [10, 0, 2], [[5, 6, 30, 31], None, [0, 3, 9]]),
    ]
    for step, (seq, pre, delims) in enumerate(batches):
        layout = fp.BatchLayout.extend(seq, pre, page_size=16, item_delimiters=delims)
        for group, out_err, lse_err, cache_err in run_both(layout, heads, ex, seed=step):
            assert out_err <= 1e-2 and lse_err <= 5e-2 and cache_err == 0.0, (step, group)


def test_plain_batch_after_multi_item_is_plain_again():
    """plan() of the same wrapper without items drops the stored multi-item tensors: a
    plain batch after a multi-item one equals the reference."""
    heads = fp.HeadConfig(8, 2, 128)
    ex = _executor()
    multi = fp.BatchLayout.extend([14, 30], [0, 10], page_size=16, item_delimiters=[[7, 9], None])
    for _, out_err, _, _ in run_both(multi, heads, ex):
        assert out_err <= 1e-2
    plain = fp.BatchLayout.extend([14, 30], [0, 10], page_size=16)
    for _, out_err, lse_err, _ in run_both(plain, heads, ex, extend_path="paged"):
        assert out_err <= 1e-2 and lse_err <= 5e-2


def test_apply_and_run_never_sync():
    heads = fp.HeadConfig(num_qo_heads=8, num_kv_heads=2, head_dim=128)
    ex = _executor()
    cache = torch.randn(64, 2, 16, 2, 128, device="cuda").to(torch.bfloat16)
    for seed in (0, 1):  # the first round warms up, the second runs under "error"
        rng = np.random.default_rng(seed)
        reqs = [
            _scoring_request(rng, 3, 20, [int(n) for n in rng.integers(1, 9, 8)], True),
            (40, 7, None),
        ]
        layout = fp.BatchLayout.extend(
            [r[0] for r in reqs], [r[1] for r in reqs], page_size=16,
            item_delimiters=[r[2] for r in reqs],
        )  # fmt: skip
        spec = fp.plan(layout, heads)
        table = fp.PageTable.sequential(spec.pages_needed, device="cuda")
        q = torch.randn(spec.total_q, 8, 128, device="cuda").to(torch.bfloat16)
        k = torch.randn(spec.total_q, 2, 128, device="cuda").to(torch.bfloat16)
        with syncs_raise(seed == 1):
            ex.apply(spec, table)  # type: ignore[attr-defined]
            ex.run(FULL, q, k, k, cache)  # type: ignore[attr-defined]
    torch.cuda.synchronize()
