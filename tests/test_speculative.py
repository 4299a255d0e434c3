"""Speculative decoding on the CPU: target verify (trees and chains), draft extend,
multi-step draft decode and block-bidirectional extend.

Each mode: the plan's kernel calls show exactly the oracle's keys, positions are the
documented ones, invalid drafts are refused naming the request and the token, and the
reference executor equals float64 dense attention over the oracle's keys.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashplan as fp
from flashplan.oracle import dense_attention, key_row_tokens, visibility
from flashplan.planning import KernelPath
from flashplan.testing import attention_groups, draft_trees, page_tables, verify_layouts

HEADS = fp.HeadConfig(4, 2, 16, q_dtype=torch.float32)


def _matches_oracle(layout: fp.BatchLayout, spec: fp.PlanSpec) -> None:
    for gp in spec.group_plans:
        got = fp.materialize(spec, gp.group)
        for i, (g, want) in enumerate(zip(got, visibility(layout, gp.group), strict=True)):
            assert np.array_equal(g, want), (gp.group, i)


# --------------------------------------------------------------------------- trees
def test_tree_shapes() -> None:
    chain = fp.DraftTree.chain(2, 4)
    assert chain.is_chain and chain.depth.tolist() == [[0, 1, 2, 3]] * 2
    eagle = fp.DraftTree.eagle(1, topk=2, steps=3)
    assert eagle.parents.tolist() == [[-1, 0, 1, 2, 0, 4, 5]]
    assert eagle.depth.tolist() == [[0, 1, 2, 3, 1, 2, 3]]
    assert fp.DraftTree.eagle(3, topk=1, steps=4).is_chain
    tree = fp.DraftTree.from_parents([[-1, 0, 0, 2]])
    assert fp.DraftTree.from_mask(tree.ancestors) == tree
    assert not tree.ancestors.flags.writeable


@settings(max_examples=60, deadline=None)
@given(data=st.data(), bs=st.integers(0, 4))
def test_ancestors_follow_the_parents(data: st.DataObject, bs: int) -> None:
    """Each row holds its token and every token up its parent chain, walked one step at
    a time; the packed rows are those bits, little-endian, and the depths their count."""
    tree = data.draw(draft_trees(bs, max_tokens=70))  # rows of one to nine bytes
    n = tree.num_tokens
    want = np.zeros((bs, n, n), dtype=bool)
    for i in range(bs):
        for j in range(n):
            k = j
            while k >= 0:
                want[i, j, k] = True
                k = int(tree.parents[i, k])
    np.testing.assert_array_equal(tree.ancestors, want)
    words = tree.ancestor_words
    assert words.dtype == np.uint8 and words.shape == (bs, n, (n + 7) // 8)
    assert not words.flags.writeable and not tree.ancestors.flags.writeable
    np.testing.assert_array_equal(words, np.packbits(want, axis=2, bitorder="little"))
    np.testing.assert_array_equal(tree.depth, want.sum(axis=2) - 1)


@pytest.mark.parametrize(
    ("parents", "req", "token"),
    [
        ([[-1, 0, 1], [-1, 2, 0]], 1, 1),  # a parent at or after its child (a cycle)
        ([[-1, 0, 0], [-1, 0, 3]], 1, 2),  # out of range
        ([[-1, 0, -1]], 0, 2),  # a second root
        ([[0, 0, 1]], 0, 0),  # token 0 is not a root
        ([[-1, 0, 1], [-1, 0, -7]], 1, 2),
    ],
)
def test_invalid_trees_name_the_request_and_token(
    parents: list[list[int]], req: int, token: int
) -> None:
    with pytest.raises(fp.LayoutError) as err:
        fp.DraftTree.from_parents(parents)
    assert (err.value.field, err.value.request, err.value.values["token"]) == (
        "parents",
        req,
        token,
    )


def test_invalid_masks_and_sizes() -> None:
    good = fp.DraftTree.from_parents([[-1, 0, 1], [-1, 0, 0]]).ancestors.copy()
    bad = good.copy()
    bad[1, 2, 1] = True  # token 2 claims token 1 as an ancestor, but 1 is a sibling...
    bad[1, 2, 0] = False  # ...and drops the root: not a tree's row
    with pytest.raises(fp.LayoutError) as err:
        fp.DraftTree.from_mask(bad)
    assert (err.value.field, err.value.request) == ("mask", 1)
    contradict = good.copy()
    contradict[0, 2, 0] = False  # token 2's row misses the root, its parent's ancestor
    with pytest.raises(fp.LayoutError) as err:
        fp.DraftTree.from_mask(contradict)
    assert (err.value.request, err.value.values["token"]) == (0, 2)
    with pytest.raises(fp.LayoutError):
        fp.DraftTree.from_parents(np.zeros((2, 0), dtype=np.int32))  # N = 0
    for junk in ([1, 2], "x", [[0.5]], None):
        with pytest.raises(fp.LayoutError):
            fp.DraftTree.from_parents(junk)
    tree = fp.DraftTree.chain(2, 3)
    with pytest.raises(fp.LayoutError) as err:
        fp.BatchLayout.verify([4, 5, 6], tree)
    assert err.value.field == "draft"
    with pytest.raises(fp.LayoutError):
        fp.BatchLayout.verify([4, 5], tree, groups=fp.AttentionGroup.bidirectional())
    with pytest.raises(fp.LayoutError):
        fp.plan(fp.BatchLayout.verify([4, 5], tree), HEADS, extend_path="ragged")


@settings(max_examples=80, deadline=None)
@given(layout=verify_layouts(page_sizes=(1, 2, 3, 16)))
def test_verify_plans_show_exactly_the_oracles_keys(layout: fp.BatchLayout) -> None:
    spec = fp.plan(layout, HEADS)
    _matches_oracle(layout, spec)
    draft = layout.draft
    assert draft is not None
    want = (layout.prefix_lens[:, None].astype(np.int64) + draft.depth).reshape(-1)
    assert spec.positions.tolist() == want.tolist()
    assert spec.total_q == layout.batch_size * draft.num_tokens
    for gp in spec.group_plans:
        assert gp.path is KernelPath.PAGED
        if not gp.group.cross_attention and draft.is_chain:
            assert gp.paged is not None and gp.paged.mask is None  # chains need no mask


@settings(max_examples=60, deadline=None)
@given(
    window=st.integers(0, 6),
    prefix=st.lists(st.integers(0, 40), min_size=1, max_size=4),
    page_size=st.sampled_from([1, 2, 3, 16]),
    data=st.data(),
)
def test_windows_that_bite_inside_trees_follow_positions(
    window: int, prefix: list[int], page_size: int, data: st.DataObject
) -> None:
    tree = data.draw(draft_trees(len(prefix), max_tokens=12))
    group = fp.AttentionGroup.sliding(window)
    layout = fp.BatchLayout.verify(prefix, tree, page_size=page_size, groups=group)
    spec = fp.plan(layout, HEADS)
    _matches_oracle(layout, spec)
    if not tree.is_chain:
        assert spec.group_plans[0].paged is not None
        assert spec.group_plans[0].paged.window_left == -1  # the mask carries the window


def test_a_window_by_slot_would_be_wrong_for_a_tree() -> None:
    """EAGLE tree, window 2: token 4 (depth 1, slot 4) sees the prefix's last key; by its
    slot it would not. The plan follows the position."""
    tree = fp.DraftTree.eagle(1, topk=2, steps=3)  # token 4 starts the second branch
    layout = fp.BatchLayout.verify([10], tree, groups=fp.AttentionGroup.sliding(2))
    seen = fp.materialize(fp.plan(layout, HEADS), fp.AttentionGroup.sliding(2))[0]
    # position 11 sees keys at positions 9..11: prefix keys 9, the root (slot 10), itself.
    assert np.flatnonzero(seen[4]).tolist() == [9, 10, 14]


@settings(max_examples=30, deadline=None)
@given(
    prefix=st.lists(st.integers(0, 30), min_size=1, max_size=4),
    n=st.integers(1, 8),
    group=attention_groups(kinds=("full", "sliding"), max_window=8, soft_cap=False),
    page_size=st.sampled_from([1, 3, 16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_chain_verify_equals_a_causal_extend(
    prefix: list[int], n: int, group: fp.AttentionGroup, page_size: int, seed: int
) -> None:
    chain = fp.BatchLayout.verify(
        prefix, fp.DraftTree.chain(len(prefix), n), page_size=page_size, groups=group
    )
    extend = fp.BatchLayout.from_extend_lens(
        [n] * len(prefix), prefix, page_size=page_size, groups=group
    )
    outs = []
    for layout in (chain, extend):
        spec = fp.plan(layout, HEADS, extend_path="paged")
        assert spec.positions.tolist() == fp.plan(extend, HEADS).positions.tolist()
        table = fp.PageTable.sequential(spec.pages_needed)
        gen = torch.Generator().manual_seed(seed)
        cache = torch.randn(
            max(int(spec.pages_needed.sum()), 1), 2, page_size, 2, 16, generator=gen
        )
        q = torch.randn(spec.total_q, 4, 16, generator=gen)
        k = torch.randn(spec.total_q, 2, 16, generator=gen)
        ex = fp.ReferenceExecutor(compute_dtype=torch.float64)
        ex.apply(spec, table)
        outs.append(ex.run(group, q, k, k, cache))
    assert torch.allclose(outs[0], outs[1], atol=1e-6)


# --------------------------------------------------------------------------- draft extend
def test_draft_extend_padding_tokens_do_not_touch_real_rows() -> None:
    prefix, accepted, n = [7, 20, 3], [2, 4, 1], 4
    real = fp.BatchLayout.draft_extend(prefix, accepted, page_size=4)
    fixed = fp.BatchLayout.draft_extend(prefix, accepted, tokens_per_request=n, page_size=4)
    assert real.extend_lens.tolist() == accepted and fixed.extend_lens.tolist() == [n] * 3
    with pytest.raises(fp.LayoutError) as err:
        fp.BatchLayout.draft_extend(prefix, [2, 5, 1], tokens_per_request=4)
    assert (err.value.field, err.value.request) == ("accepted_lens", 1)
    spec_real, spec_fixed = fp.plan(real, HEADS), fp.plan(fixed, HEADS)
    table = fp.PageTable.sequential(spec_fixed.pages_needed)
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(int(spec_fixed.pages_needed.sum()), 2, 4, 2, 16, generator=gen)
    q = torch.randn(spec_fixed.total_q, 4, 16, generator=gen)
    k = torch.randn(spec_fixed.total_q, 2, 16, generator=gen)
    rows = np.concatenate([np.arange(a) + n * i for i, a in enumerate(accepted)])
    outs = []
    for spec, qq, kk in ((spec_fixed, q, k), (spec_real, q[rows], k[rows])):
        ex = fp.ReferenceExecutor(compute_dtype=torch.float64)
        ex.apply(spec, table)
        outs.append(ex.run(fp.AttentionGroup(), qq, kk, kk, base.clone()))
    assert torch.allclose(outs[0][rows], outs[1], atol=1e-6)  # the real rows agree


# --------------------------------------------------------------------------- draft decode
@settings(max_examples=25, deadline=None)
@given(
    prefix=st.lists(st.integers(1, 30), min_size=1, max_size=3),
    topk=st.sampled_from([1, 2, 4]),
    steps=st.integers(1, 4),
    page_size=st.sampled_from([1, 2, 16]),
    group=attention_groups(kinds=("full", "sliding"), max_window=5, soft_cap=False),
    seed=st.integers(0, 2**31 - 1),
)
def test_multi_step_draft_decode_each_branch_sees_its_own_drafts(
    prefix: list[int],
    topk: int,
    steps: int,
    page_size: int,
    group: fp.AttentionGroup,
    seed: int,
) -> None:
    draft = fp.DraftDecode(prefix, topk, steps, page_size=page_size, groups=group)
    specs = fp.plan_steps(draft, HEADS)
    assert len(specs) == steps
    bs = len(prefix)
    prompt = fp.PageTable.sequential(
        [(p + page_size - 1) // page_size for p in prefix], max_pages=max(prefix) + 1
    )
    assert prompt.num_pages is not None
    own = draft.branch_pages
    branch_pages = torch.arange(
        prompt.num_pages, prompt.num_pages + bs * topk * own, dtype=torch.int32
    ).reshape(bs, topk, own)
    table = fp.PageTable.draft_branches(prompt, prefix, topk, branch_pages, page_size=page_size)
    gen = torch.Generator().manual_seed(seed)
    pool = prompt.num_pages + bs * topk * own
    cache = torch.randn(pool, 2, page_size, 2, 16, generator=gen, dtype=torch.float64)
    # Each branch's own first page starts as a copy of its request's partial last page.
    for i, p in enumerate(prefix):
        if p % page_size:
            src = int(prompt.pages[i, p // page_size])
            for b in range(topk):
                cache[int(branch_pages[i, b, 0])] = cache[src]
    views = fp.ReferenceExecutor(compute_dtype=torch.float64).apply_steps(specs, table)
    keys = [[cache[0, 0, 0:0]] * topk for _ in range(bs)]  # per branch: its draft K so far
    prefix_k = []
    for i, p in enumerate(prefix):
        t = np.arange(p)
        pages = prompt.pages[i, torch.from_numpy(t // page_size)].long()
        prefix_k.append((cache[pages, 0, torch.from_numpy(t % page_size)],
                         cache[pages, 1, torch.from_numpy(t % page_size)]))  # fmt: skip
    drafts_kv: list[list[list[torch.Tensor]]] = [[[] for _ in range(topk)] for _ in range(bs)]
    for s, (spec, view) in enumerate(zip(specs, views, strict=True)):
        assert spec.positions.tolist() == np.repeat(np.array(prefix) + s, topk).tolist()
        q = torch.randn(bs * topk, 4, 16, generator=gen, dtype=torch.float64).float()
        k = torch.randn(bs * topk, 2, 16, generator=gen, dtype=torch.float64).float()
        out = view.run(group, q, k, k, cache.float())
        for i in range(bs):
            for b in range(topk):
                row = i * topk + b
                drafts_kv[i][b].append(k[row])
                kk = torch.cat([prefix_k[i][0].float(), torch.stack(drafts_kv[i][b])])
                vv = torch.cat([prefix_k[i][1].float(), torch.stack(drafts_kv[i][b])])
                n_keys = kk.shape[0]
                pos = n_keys - 1
                seen = np.ones((1, n_keys), dtype=bool)
                if group.window_left >= 0:
                    seen &= np.arange(n_keys)[None, :] >= pos - group.window_left
                want, _ = dense_attention(q[row : row + 1], kk, vv, seen, group)
                assert torch.allclose(out[row].double(), want[0], atol=1e-4), (s, i, b)
        # The steps' writes went to the branch rows: keep the cache for the next step.
        cache = cache.float()
        for i in range(bs):
            for b in range(topk):
                row = i * topk + b
                t = prefix[i] + s
                page = int(table.pages[row, t // page_size])
                cache[page, :, t % page_size] = k[row]
        cache = cache.double()
    del keys


# --------------------------------------------------------------------------- block extend
@pytest.mark.parametrize("block", [1, 4, 32])
@pytest.mark.parametrize("page_size", [1, 16])
def test_block_bidirectional_extend(block: int, page_size: int) -> None:
    seq = [block + 3, block + 17, block + 40]  # prefixes ending mid-page
    layout = fp.BatchLayout.block_extend(seq, block, page_size=page_size)
    assert layout.prefix_lens.tolist() == [s - block for s in seq]
    group = layout.groups[0]
    assert not group.causal
    for path in ("paged", "ragged"):
        spec = fp.plan(layout, HEADS, extend_path=path)
        _matches_oracle(layout, spec)
        table = fp.PageTable.sequential(spec.pages_needed)
        gen = torch.Generator().manual_seed(block)
        cache = torch.randn(int(spec.pages_needed.sum()), 2, page_size, 2, 16, generator=gen)
        q = torch.randn(spec.total_q, 4, 16, generator=gen)
        k = torch.randn(spec.total_q, 2, 16, generator=gen)
        ex = fp.ReferenceExecutor(compute_dtype=torch.float64)
        ex.apply(spec, table)
        out = ex.run(group, q, k, k, cache)
        tokens = key_row_tokens(layout, group)
        qo = spec.qo_indptr.tolist()
        for i, seen in enumerate(visibility(layout, group)):
            assert seen.all()  # every key of the request, the whole block included
            t = tokens[i]
            pages = table.pages[i, torch.from_numpy(t // page_size)].long()
            kk = cache[pages, 0, torch.from_numpy(t % page_size)]
            vv = cache[pages, 1, torch.from_numpy(t % page_size)]
            want, _ = dense_attention(q[qo[i] : qo[i + 1]], kk, vv, seen, group)
            assert torch.allclose(out[qo[i] : qo[i + 1]].double(), want, atol=1e-5)
    with pytest.raises(fp.LayoutError) as err:
        fp.BatchLayout.block_extend([3, 40], 4)
    assert (err.value.field, err.value.request) == ("seq_lens", 0)


@settings(max_examples=20, deadline=None)
@given(layout=verify_layouts(max_batch=3, page_sizes=(1, 16)), data=st.data())
def test_verify_writes_the_drafts_at_their_slots(
    layout: fp.BatchLayout, data: st.DataObject
) -> None:
    spec = fp.plan(layout, HEADS)
    table, pool = data.draw(page_tables(spec))
    cache = torch.zeros(max(pool, 1), 2, layout.page_size, 2, 16)
    ex = fp.ReferenceExecutor()
    ex.apply(spec, table)
    group = next((g for g in layout.groups if not g.cross_attention), None)
    if group is None:
        return
    k = torch.randn(spec.total_q, 2, 16)
    ex.run(group, torch.randn(spec.total_q, 4, 16), k, k, cache)
    qo = spec.qo_indptr.tolist()
    for i in range(layout.batch_size):
        t = key_row_tokens(layout, group)[i][int(layout.prefix_lens[i]) :]
        pages = table.pages[int(table.rows[i]), torch.from_numpy(t // layout.page_size)].long()
        got = cache[pages, 0, torch.from_numpy(t % layout.page_size)]
        assert torch.equal(got, k[qo[i] : qo[i + 1]])


@settings(max_examples=40, deadline=None)
@given(
    prefix=st.lists(st.integers(1, 40), min_size=1, max_size=4),
    topk=st.sampled_from([1, 2, 3]),
    steps=st.integers(1, 4),
    page_size=st.sampled_from([1, 3, 16]),
    groups=st.lists(
        attention_groups(kinds=("full", "sliding"), max_window=9),
        min_size=1,
        max_size=2,
        unique=True,
    ),
    window_pool=st.booleans(),
)
def test_all_steps_gather_jobs_equal_each_steps_jobs_end_to_end(
    prefix: list[int],
    topk: int,
    steps: int,
    page_size: int,
    groups: list[fp.AttentionGroup],
    window_pool: bool,
) -> None:
    """apply_steps builds every step's gather jobs in one table: the same table as each
    step's own jobs laid end to end."""
    from flashplan.executor.gathers import concat_jobs, gather_jobs, gather_jobs_steps

    draft = fp.DraftDecode(prefix, topk, steps, page_size=page_size, groups=groups)
    specs = fp.plan_steps(draft, HEADS)
    rows = np.arange(len(prefix) * topk)[::-1]
    prefixes = [f"s{k}/" for k in range(steps)]
    want = concat_jobs([gather_jobs(s, rows, window_pool=window_pool) for s in specs], prefixes)
    got = gather_jobs_steps(specs, rows, prefixes, window_pool=window_pool)
    assert got.regions == want.regions and got.total == want.total
    for a, b in zip(got.columns(), want.columns(), strict=True):
        assert a.dtype == b.dtype == np.int32 and a.tolist() == b.tolist()
        assert not a.flags.writeable
