"""Cascade levels on FlashInfer (issue 28): a plan with ``shared_prefix=`` and
``cascade="on"`` run by the FlashInfer executor — one non-causal paged prefill call per
level over each group's shared pages, each request's own call, merged by LSE — equals
the reference executor's plain plan (no levels) on a table that keeps the sharing
promise: outputs, LSE and the written cache. Decode (both decode kernels), paged extend
and tree verify (the own call under the tree mask without the shared columns), page
sizes 1 and 16, one level, groups, nested levels, levels that leave rows out, groups
sharing less than a page (no level then), bf16 and an fp8 cache; one executor over a
sequence of cascade and plain batches against fresh executors; no syncs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import flashplan as fp
from flashplan.executor.flashinfer import ExecutorPolicy, FlashInferExecutor

from .helpers import rel_err, stable_seed, syncs_raise

DEV = "cuda"
#: bf16 kernels against the reference's float32: test_flashinfer_executor.py's bounds
#: (each level's merge rounds the running output to bf16 once more).
OUT_TOL, LSE_TOL = 1.5e-2, 5e-2


def _sharing(kind: str, bs: int, prefix: np.ndarray) -> fp.SharedPrefix:
    """A sharing of ``bs`` requests whose cached tokens are ``prefix``."""
    if kind == "all":  # one prompt, bs samples
        return fp.SharedPrefix.from_groups([range(bs)], [int(prefix.min())])
    if kind == "groups":  # groups of 4 (the last may be shorter; a last one alone: none)
        groups = [range(a, min(a + 4, bs)) for a in range(0, bs - 1, 4)]
        return fp.SharedPrefix.from_groups(groups, [int(prefix[g].min()) for g in groups])
    if kind == "nested":  # a system prompt for all, then pairs sharing more
        pairs = [range(a, a + 2) for a in range(0, bs - 1, 2)]
        outer = int(prefix.min()) // 3
        return fp.SharedPrefix.nested(
            fp.ShareLevel.from_groups([range(bs)], [outer]),
            fp.ShareLevel.from_groups(pairs, [int(prefix[p].min()) for p in pairs]),
        )
    if kind == "partial":  # requests in no group; an inner level over some rows only
        return fp.SharedPrefix.nested(
            fp.ShareLevel.from_groups([range(1, bs - 1)], [int(prefix[1 : bs - 1].min()) // 2]),
            fp.ShareLevel.from_groups([range(2, 4)], [int(prefix[2:4].min())]),
        )
    if kind == "short":  # pairs sharing less than a page at page 16: no level
        pairs = [range(a, a + 2) for a in range(0, bs - 1, 2)]
        return fp.SharedPrefix.from_groups(pairs, [5] * len(pairs))
    raise AssertionError(kind)


def _batch(mode: str, bs: int, page_size: int, seed: int) -> fp.BatchLayout:
    rng = np.random.default_rng(seed)
    prefix = rng.integers(40, 400, bs)
    if mode == "decode":
        return fp.BatchLayout.decode(prefix + 1, page_size=page_size)
    if mode == "verify":  # a tree of 6 draft tokens per request
        parents = np.full((bs, 6), -1, dtype=np.int64)
        for j in range(1, 6):
            parents[:, j] = rng.integers(0, j, bs)
        return fp.BatchLayout.verify(
            prefix, fp.DraftTree.from_parents(parents), page_size=page_size
        )
    return fp.BatchLayout.extend(prefix + rng.integers(1, 40, bs), prefix, page_size=page_size)


def _table(layout: fp.BatchLayout, shared: fp.SharedPrefix, seed: int) -> fp.PageTable:
    table = fp.PageTable.shuffled(layout.pages_needed, seed=seed, device=DEV)
    pages = fp.share_pages(shared, table.pages, table.rows, layout.page_size)
    return fp.PageTable(pages, table.rows, table.num_pages)


def _inputs(spec: fp.PlanSpec, table: fp.PageTable, heads: fp.HeadConfig, seed: int):  # type: ignore[no-untyped-def]
    gen = torch.Generator(device=DEV).manual_seed(seed)
    hq, hkv, d = heads.num_qo_heads, heads.num_kv_heads, heads.head_dim
    assert table.num_pages is not None
    cache = torch.randn(table.num_pages, 2, spec.page_size, hkv, d, generator=gen, device=DEV)
    q = torch.randn(spec.total_q, hq, d, generator=gen, device=DEV).to(heads.q_dtype)
    k = torch.randn(spec.total_q, hkv, d, generator=gen, device=DEV).to(heads.kv_input_dtype)
    v = torch.randn(spec.total_q, hkv, d, generator=gen, device=DEV).to(heads.kv_input_dtype)
    return cache.to(heads.kv_dtype), q, k, v


def _run(
    executor: fp.Executor, spec: fp.PlanSpec, table: fp.PageTable, inputs, scales=(None, None)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def]
    cache, q, k, v = inputs
    cache = cache.clone()
    executor.apply(spec, table)
    out, lse = executor.run(
        spec.key.groups[0], q, k, v, cache, return_lse=True, k_scale=scales[0], v_scale=scales[1]
    )
    return out, lse, cache


def _check(got, want) -> None:  # type: ignore[no-untyped-def]
    (out, lse, cache), (out_ref, lse_ref, cache_ref) = got, want
    assert torch.isfinite(lse).all() and torch.isfinite(lse_ref).all()
    assert rel_err(out, out_ref) <= OUT_TOL
    assert float((lse - lse_ref).abs().max()) <= LSE_TOL
    assert torch.equal(cache.view(torch.uint8), cache_ref.view(torch.uint8))  # same writes


@pytest.mark.parametrize("mode", ["decode", "extend", "verify"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("kind", ["all", "groups", "nested", "partial", "short"])
@pytest.mark.parametrize("tensor_cores", [False, True])
def test_cascade_matches_plain_reference(mode: str, page_size: int, kind: str, tensor_cores: bool):
    if mode != "decode" and tensor_cores:
        pytest.skip("the decode kernel kind only matters for decode")
    seed = stable_seed("cascade", mode, page_size, kind, tensor_cores)
    layout = _batch(mode, 9, page_size, seed)
    shared = _sharing(kind, 9, layout.prefix_lens)
    heads = fp.HeadConfig(16, 4, 128, q_dtype=torch.bfloat16)
    on = fp.plan(layout, heads, extend_path="paged", shared_prefix=shared, cascade="on")
    off = fp.plan(layout, heads, extend_path="paged")
    assert off.cascade is None
    if on.cascade is None:  # less than a page shared: nothing for a level to read
        assert kind == "short" and page_size > 5
        return
    table = _table(layout, shared, seed)
    inputs = _inputs(on, table, heads, seed)
    ex = FlashInferExecutor(policy=ExecutorPolicy(decode_tensor_cores=tensor_cores))
    got = _run(ex, on, table, inputs)
    assert len(on.cascade.levels.levels) > 0
    _check(got, _run(fp.ReferenceExecutor(), off, table, inputs))
    # and against FlashInfer's own plain plan of the same batch
    plain = _run(FlashInferExecutor(), off, table, inputs)
    assert rel_err(got[0], plain[0]) <= OUT_TOL


@pytest.mark.parametrize("scales", ["number", "tensor"])
def test_cascade_over_an_fp8_cache(scales: str):
    seed = stable_seed("cascade fp8", scales)
    layout = _batch("decode", 8, 16, seed)
    shared = _sharing("nested", 8, layout.prefix_lens)
    heads = fp.HeadConfig(16, 4, 128, q_dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn)
    on = fp.plan(layout, heads, shared_prefix=shared, cascade="on")
    off = fp.plan(layout, heads)
    table = _table(layout, shared, seed)
    inputs = _inputs(on, table, heads, seed)
    pair = (0.37, 1.9)
    sc = pair if scales == "number" else tuple(torch.tensor(s, device=DEV) for s in pair)
    got = _run(
        FlashInferExecutor(policy=ExecutorPolicy(decode_backend="fa2")), on, table, inputs, sc
    )
    _check(got, _run(fp.ReferenceExecutor(), off, table, inputs, sc))


def test_one_executor_over_cascade_and_plain_batches():
    """One executor over a sequence of batches — cascade plans of 1 and 2 levels, plain
    plans, decode, extend and verify, growing and shrinking batch sizes — equals a fresh
    executor per batch bit for bit, and the reference within tolerance."""
    heads = fp.HeadConfig(16, 4, 128, q_dtype=torch.bfloat16)
    kinds = ["all", None, "nested", "groups", "partial", None, "all", "nested"]
    executor = FlashInferExecutor()
    for step, kind in enumerate(kinds * 3):
        seed = stable_seed("cascade sequence", step)
        bs = 6 + (step * 5) % 11
        mode = ("extend", "decode", "verify", "decode")[step % 4]
        layout = _batch(mode, bs, 16, seed)
        shared = _sharing(kind or "all", bs, layout.prefix_lens)
        spec = fp.plan(
            layout, heads, extend_path="paged", shared_prefix=shared,
            cascade="off" if kind is None else "on",
        )  # fmt: skip
        table = _table(layout, shared, seed)
        inputs = _inputs(spec, table, heads, seed)
        got = _run(executor, spec, table, inputs)
        fresh = _run(FlashInferExecutor(), spec, table, inputs)
        for a, b in zip(got, fresh, strict=True):
            assert torch.equal(a, b), (step, kind, mode, bs)
        _check(got, _run(fp.ReferenceExecutor(), spec, table, inputs))


def test_cascade_apply_and_run_never_sync():
    heads = fp.HeadConfig(16, 4, 128, q_dtype=torch.bfloat16)
    layout = _batch("decode", 8, 16, 5)
    shared = _sharing("partial", 8, layout.prefix_lens)
    spec = fp.plan(layout, heads, shared_prefix=shared, cascade="on")
    table = _table(layout, shared, 5)
    cache, q, k, v = _inputs(spec, table, heads, 5)
    ex = FlashInferExecutor()
    ex.apply(spec, table)  # compiles and loads the kernels
    ex.run(layout.groups[0], q, k, v, cache)
    with syncs_raise():
        for _ in range(3):
            ex.apply(spec, table)
            ex.run(layout.groups[0], q, k, v, cache)
    torch.cuda.synchronize()


@pytest.mark.parametrize("page_size", [1, 16])
def test_fa3_levels_over_a_decode_loop(page_size: int):
    """FA3 level calls (``prefill_backend="fa3"``; SM90) on one executor over a decode
    loop whose sharing holds for four steps and then changes, the table's page ids
    changing every step: every step equals a fresh executor bit for bit and the
    reference's plain plan within tolerance."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("FlashInfer's FA3 kernels run on SM90")
    heads = fp.HeadConfig(16, 4, 128, q_dtype=torch.bfloat16)
    policy = ExecutorPolicy(prefill_backend="fa3")
    executor = FlashInferExecutor(policy=policy)
    rng = np.random.default_rng(stable_seed("fa3 levels", page_size))
    prefix = rng.integers(200, 400, 8)
    shared = _sharing("nested", 8, prefix)
    for step in range(6):
        if step == 4:  # another sharing: the levels' arrays change
            shared = _sharing("groups", 8, prefix)
        layout = fp.BatchLayout.decode(prefix + 1 + step, page_size=page_size)
        spec = fp.plan(layout, heads, shared_prefix=shared, cascade="on")
        assert spec.cascade is not None
        table = _table(layout, shared, 10 + step)
        inputs = _inputs(spec, table, heads, step)
        got = _run(executor, spec, table, inputs)
        fresh = _run(FlashInferExecutor(policy=policy), spec, table, inputs)
        for a, b in zip(got, fresh, strict=True):
            assert torch.equal(a, b), (page_size, step)
        _check(got, _run(fp.ReferenceExecutor(), fp.plan(layout, heads), table, inputs))


def test_bidirectional_groups_on_levels_run_the_planned_calls():
    """Issue 50, item 1: causal and bidirectional groups on the same cascade levels, over
    extend and block-extend batches of varied sizes, on one long-lived executor: each
    group's own call carries the group's causal flag in the plan (``Cascade.own_call``),
    and every group equals the reference executor's plain plan (no levels) and a fresh
    executor bit for bit (an own call run with the other flag would not)."""
    heads = fp.HeadConfig(16, 4, 128, q_dtype=torch.bfloat16)
    groups = (fp.AttentionGroup.full(), fp.AttentionGroup.bidirectional())
    executor = FlashInferExecutor()
    for step in range(12):
        seed = stable_seed("bidirectional cascade", step)
        rng = np.random.default_rng(seed)
        bs = 4 + (step * 3) % 9
        page_size = (1, 16)[step % 2]
        prefix = rng.integers(40, 300, bs)
        if step % 3 == 2:  # a block extend: every new token sees its whole block
            layout = fp.BatchLayout.block_extend(prefix + 8, 8, page_size=page_size)
            layout = layout.with_groups(fp.AttentionGroup.full(), *layout.groups)
        else:
            seq = prefix + rng.integers(2, 40, bs)
            layout = fp.BatchLayout.extend(seq, prefix, page_size=page_size, groups=groups)
        shared = _sharing(("all", "groups", "nested")[step % 3], bs, layout.prefix_lens)
        on = fp.plan(layout, heads, extend_path="paged", shared_prefix=shared, cascade="on")
        off = fp.plan(layout, heads, extend_path="paged")
        assert on.cascade is not None and len(on.cascade.groups) == len(layout.groups)
        table = _table(layout, shared, seed)
        inputs = _inputs(on, table, heads, seed)
        for at, group in enumerate(layout.groups):
            cache, q, k, v = inputs
            results = []
            for ex, spec in (
                (executor, on),
                (FlashInferExecutor(), on),
                (fp.ReferenceExecutor(), off),
            ):
                c = cache.clone()
                ex.apply(spec, table)
                results.append((*ex.run(group, q, k, v, c, return_lse=True), c))
            assert on.cascade.own_call(at).causal == group.causal
            got, fresh, want = results
            for a, b in zip(got, fresh, strict=True):
                assert torch.equal(a, b), (step, group.describe())
            _check(got, want)
