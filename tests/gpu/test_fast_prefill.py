"""Paged prefill re-plans without ``plan()`` (``adapter.replan_prefill``) equal full
``plan()`` calls, field by field.

An executor with ``fast_plan=True`` (the default) and one with ``fast_plan=False`` apply
the same sequence of batches on FA2 — plain extends over cached prefixes (full, windowed
with a soft cap, bidirectional), a multi-item scoring batch, a verify batch with a tree
mask (a window carried by the mask), then plain extends again, with batch sizes that
shrink and grow — and after every apply each wrapper of the first must hold exactly the
state the same wrapper of the second got from ``plan()``: every field FlashInfer keeps
(``_plan_info``, indptrs, page ids, KV lengths, mask and multi-item tensors, lengths,
flags) by value, and the same outputs bit for bit. The first executor must have taken
the fast route (counted in ``plan_counts``) and never synced. One batch comes twice (new
plans of the same arrays): its re-plans keep the scheduler's last plan
(``schedules_kept``), which must equal ``plan()``'s too.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import pytest
import torch

import flashplan as fp
from flashplan.executor.flashinfer import ExecutorPolicy, FlashInferExecutor

from .helpers import stable_seed, syncs_raise

DEV = "cuda"
HEADS = fp.HeadConfig(num_qo_heads=16, num_kv_heads=4, head_dim=128, q_dtype=torch.bfloat16)
EXTEND_GROUPS = (
    fp.AttentionGroup.full(),
    fp.AttentionGroup.sliding(40, logits_soft_cap=30.0),
    fp.AttentionGroup.bidirectional(),
)
#: The buffers a wrapper is made with (identical objects on both sides are not the
#: point) and its compiled module (one per process and arguments).
_OWN = {
    "_float_workspace_buffer",
    "_int_workspace_buffer",
    "_pin_memory_int_workspace_buffer",
    "_cached_module",
}


def _layouts(page_size: int, seed: int) -> list[fp.BatchLayout]:
    rng = np.random.default_rng(seed)

    def extend(bs: int, lo: int, hi: int) -> fp.BatchLayout:
        seq = rng.integers(lo, hi, bs)
        pre = (seq * rng.uniform(0, 0.9, bs)).astype(np.int64)
        return fp.BatchLayout.extend(seq, pre, page_size=page_size, groups=EXTEND_GROUPS)

    parents = np.full((5, 8), -1, dtype=np.int64)
    for j in range(1, 8):
        parents[:, j] = rng.integers(0, j, 5)
    tree = fp.DraftTree.from_parents(parents)
    verify_groups = (fp.AttentionGroup.full(), fp.AttentionGroup.sliding(30))
    again = extend(7, 100, 900)
    return [
        extend(3, 5, 40),  # first: the only full plan() of each wrapper
        again,
        again,  # the same arrays planned again: each wrapper keeps its schedule
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


def _value(x: Any) -> Any:
    """A comparable form of one wrapper field: tensors by dtype, shape, device and bytes;
    containers item by item; plain values as they are; any other object by its type (a
    helper object each wrapper makes for itself is not state that a plan sets)."""
    if isinstance(x, torch.Tensor):
        raw = x.detach().contiguous().view(torch.uint8).cpu()
        return ("tensor", x.dtype, tuple(x.shape), x.device.type, raw.numpy().tobytes())
    if isinstance(x, (list, tuple)):
        return tuple(_value(v) for v in x)
    if isinstance(x, dict):
        return tuple((k, _value(v)) for k, v in sorted(x.items(), key=lambda kv: str(kv[0])))
    if x is None or isinstance(x, (bool, int, float, str, torch.dtype, torch.device)):
        return x
    return ("object", type(x).__qualname__)


def _assert_same_state(fast: Any, full: Any, masks: tuple[Any, Any], where: str) -> None:
    """Every field of the re-planned wrapper ``fast`` as ``plan()`` left ``full``; the
    custom mask: each the mask its own executor built (``masks``: their buffers), of one
    dtype and size (FlashInfer 0.7.4's bit-as-byte offsets leave gaps between requests
    that no one writes, so the bytes are compared through the outputs)."""
    assert set(vars(fast)) == set(vars(full)), where
    for name in sorted(vars(full)):
        if name in _OWN:
            continue
        got, want = getattr(fast, name), getattr(full, name)
        if name == "_kv_lens_buffer":  # plan() writes the batch's entries (the rest: stale)
            got, want = got[: full._batch_size], want[: full._batch_size]
        if name == "_custom_mask_buf" and want is not None:
            assert got is not None, where
            for mask, built in zip((got, want), masks, strict=True):
                assert mask.data_ptr() == built.data_ptr(), where
            got, want = (got.dtype, tuple(got.shape)), (want.dtype, tuple(want.shape))
        got, want = _value(got), _value(want)
        assert got == want, f"{where}: field {name} differs"


def _assert_same_wrappers(fast: FlashInferExecutor, full: FlashInferExecutor, step: int) -> None:
    """Every planned wrapper of ``fast`` as ``plan()`` left the same wrapper of ``full``
    (:func:`_assert_same_state`; the custom masks: each executor's own buffer)."""
    assert fast.planned_wrappers.keys() == full.planned_wrappers.keys()
    for key, wrapper in full.planned_wrappers.items():
        built = tuple(
            ex._buffers.owned.mask_bufs[key[0]].tensor
            if key[0] in ex._buffers.owned.mask_bufs
            else None
            for ex in (fast, full)
        )
        _assert_same_state(fast.planned_wrappers[key], wrapper, built, f"step {step}, call {key}")


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_fast_prefill_plan_equals_plan(page_size: int, kv_dtype: torch.dtype) -> None:
    heads = attrs.evolve(HEADS, kv_dtype=kv_dtype)
    seed = stable_seed("fast prefill", page_size, str(kv_dtype))
    gen = torch.Generator(device=DEV).manual_seed(seed)
    policy = ExecutorPolicy(prefill_backend="fa2")
    fast = FlashInferExecutor(policy=policy, fast_plan=True)
    full = FlashInferExecutor(policy=policy, fast_plan=False)
    hq, hkv, d = HEADS.num_qo_heads, HEADS.num_kv_heads, HEADS.head_dim
    for step, layout in enumerate(_layouts(page_size, seed)):
        spec = fp.plan(layout, heads, extend_path="paged")
        table = fp.PageTable.shuffled(spec.pages_needed, seed=step, device=DEV)
        assert table.num_pages is not None
        cache = torch.randn(table.num_pages, 2, page_size, hkv, d, generator=gen, device=DEV)
        cache = cache.to(kv_dtype)
        q = torch.randn(spec.total_q, hq, d, generator=gen, device=DEV).to(torch.bfloat16)
        outs = {}
        for name, ex in (("fast", fast), ("full", full)):
            with syncs_raise(name == "fast"):
                ex.apply(spec, table)
                outs[name] = [
                    ex.run(g, q, None, None, cache, return_lse=True) for g in layout.groups
                ]
        torch.cuda.synchronize()
        for group, (o_fast, l_fast), (o_full, l_full) in zip(
            layout.groups, outs["fast"], outs["full"], strict=True
        ):
            assert torch.equal(o_fast, o_full), (group, step)
            assert torch.equal(l_fast, l_full), (group, step)
        _assert_same_wrappers(fast, full, step)
        _check_kv_lens_fields(fast, step)
    assert fast.plan_counts["fast_prefill_plan"] >= 8  # every wrapper after its first plan
    # the repeated batch's re-plans kept the scheduler's last plan (and the state checks
    # above found it equal to plan()'s)
    assert fast.plan_counts["schedules_kept"] >= len(EXTEND_GROUPS)
    assert full.plan_counts["fast_prefill_plan"] == 0
    # The sequence makes full plan() calls on wrappers that were re-planned (a verify
    # batch's tree mask changes the constants of the full group's wrapper, and the
    # extend after it changes them back).
    assert fast.plan_counts["plan"] > sum(
        len(slots) for slots in fast._buffers.owned.pool.slots.values()
    )


def _check_kv_lens_fields(ex: FlashInferExecutor, step: int) -> None:
    """A re-planned prefill wrapper's KV-lengths field is a view of the staging buffer
    and it keeps its own buffer aside; after a full ``plan()`` the field is its own
    buffer again (``plan()`` writes into it: never into the staging buffer)."""
    staged = ex._buffers.owned.staged.tensor
    lo, hi = staged.data_ptr(), staged.data_ptr() + staged.numel() * staged.element_size()
    for slots in ex._buffers.owned.pool.slots.values():
        for slot in slots:
            field = getattr(slot.wrapper, "_kv_lens_buffer", None)
            if field is None or slot.planned_with is None:
                continue
            inside = lo <= field.data_ptr() < hi
            assert inside == ("kv_lens" in slot.fixed), (step, inside)
            if inside:
                own = slot.fixed["kv_lens"]
                assert not lo <= own.data_ptr() < hi, step


#: 32/8 heads: FlashInfer's prefill scheduler splits no KV above 2 * SMs // 8 query tiles.
WIDE_HEADS = attrs.evolve(HEADS, num_qo_heads=32, num_kv_heads=8)


@pytest.mark.parametrize("page_size", [1, 16])
def test_prefill_schedules_stand_for_any_kv_lengths(page_size: int) -> None:
    """Verify and extend batches of more requests than FlashInfer's scheduler ever
    splits, with the same queries and other KV lengths each time: every re-plan after
    the first of a query layout keeps its schedule (``adapter.schedule_stands``;
    ``schedules_kept``), and every wrapper field and output equals ``plan()``'s."""
    num_sm = torch.cuda.get_device_properties(DEV).multi_processor_count
    bs = 2 * num_sm // WIDE_HEADS.num_kv_heads + 1
    seed = stable_seed("prefill stands", page_size)
    rng = np.random.default_rng(seed)
    gen = torch.Generator(device=DEV).manual_seed(seed)
    parents = np.full((bs, 6), -1, dtype=np.int64)
    for j in range(1, 6):
        parents[:, j] = rng.integers(0, j, bs)
    tree = fp.DraftTree.from_parents(parents)
    groups = (fp.AttentionGroup.full(), fp.AttentionGroup.sliding(30))
    new = rng.integers(1, 40, bs)  # one extend's new tokens, kept across its batches

    def verify(lo: int, hi: int) -> fp.BatchLayout:
        return fp.BatchLayout.verify(rng.integers(lo, hi, bs), tree, page_size=page_size,
                                     groups=groups)  # fmt: skip

    def extend(lo: int, hi: int) -> fp.BatchLayout:
        prefix = rng.integers(lo, hi, bs)
        return fp.BatchLayout.extend(prefix + new, prefix, page_size=page_size, groups=groups)

    layouts = [verify(10, 40), verify(900, 2000), verify(10, 2000), verify(6, 12),
               extend(0, 30), extend(1000, 2000), extend(0, 2000)]  # fmt: skip
    policy = ExecutorPolicy(prefill_backend="fa2")
    fast = FlashInferExecutor(policy=policy, fast_plan=True)
    full = FlashInferExecutor(policy=policy, fast_plan=False)
    hq, hkv, d = WIDE_HEADS.num_qo_heads, WIDE_HEADS.num_kv_heads, WIDE_HEADS.head_dim
    kept = []
    for step, layout in enumerate(layouts):
        spec = fp.plan(layout, WIDE_HEADS, extend_path="paged")
        table = fp.PageTable.shuffled(spec.pages_needed, seed=step, device=DEV)
        assert table.num_pages is not None
        cache = torch.randn(table.num_pages, 2, page_size, hkv, d, generator=gen, device=DEV)
        cache = cache.to(torch.bfloat16)
        q = torch.randn(spec.total_q, hq, d, generator=gen, device=DEV).to(torch.bfloat16)
        outs = {}
        for name, ex in (("fast", fast), ("full", full)):
            with syncs_raise(name == "fast"):
                ex.apply(spec, table)
                outs[name] = [ex.run(g, q, None, None, cache, return_lse=True) for g in groups]
        torch.cuda.synchronize()
        for group, (o_fast, l_fast), (o_full, l_full) in zip(
            groups, outs["fast"], outs["full"], strict=True
        ):
            assert torch.equal(o_fast, o_full), (group, step)
            assert torch.equal(l_fast, l_full), (group, step)
        _assert_same_wrappers(fast, full, step)
        kept.append(fast.plan_counts["schedules_kept"])
    # the first verify and the first extend plan() (new constants); every later batch
    # of the same queries keeps the schedule of each of its calls
    gained = np.diff([0, *kept]).tolist()
    assert gained == [0, 2, 2, 2, 0, 2, 2], gained
    assert full.plan_counts["schedules_kept"] == 0
