"""When a re-plan may keep FlashInfer's last schedule for new KV lengths (CPU only).

``adapter.schedule_stands`` encodes a fact about flashinfer 0.7.4's prefill scheduler
(``PrefillSplitQOKVIndptr`` in ``scheduler.cuh``), which a tensor-core decode and a
paged prefill run: a batch of more query tiles than ``2 * SMs // num_kv_heads`` is
never split, whatever its KV lengths. A model of that scheduler's split decision,
written from the source, checks the fact over random batches; the rule's reading of
the plan info and ``wrapper_plans._schedule_changed``'s use of it are checked on stand-in
wrappers. The GPU tests (``tests/gpu/test_fast_plan.py``, ``test_fast_prefill.py``)
check kept schedules against ``plan()`` bit for bit.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashplan.executor.flashinfer.adapter import schedule_stands
from flashplan.executor.flashinfer.buffers import WrapperSlot
from flashplan.executor.flashinfer.caches import BoundCall
from flashplan.executor.flashinfer.wrapper_plans import _schedule_changed


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def scheduler_splits(
    qo_lens: list[int],
    kv_pages: list[int],
    *,
    gqa: int,
    cta_tile_q: int,
    max_batch_size_if_split: int,
    page_size: int,
    graph: bool,
    uniform_q_len: int,
) -> bool:
    """The split decision of flashinfer 0.7.4's ``PrefillSplitQOKVIndptr`` (no fixed
    split size, split KV allowed): ``PrefillBinarySearchKVChunkSize``, then the fixed
    uniform query length's override."""
    packed = [q * gqa for q in qo_lens]
    min_chunk = max(128 // page_size, 1)
    low, high = min_chunk, max([1, *kv_pages])
    while low < high:
        mid = (low + high) // 2
        tiles = sum(_ceil_div(p, cta_tile_q) * _ceil_div(max(k, 1), mid)
                    for p, k in zip(packed, kv_pages, strict=True))  # fmt: skip
        if tiles > max_batch_size_if_split:
            low = mid + 1
        else:
            high = mid
    split = graph or low < max([1, *kv_pages])
    total_tiles = sum(_ceil_div(p, cta_tile_q) for p in packed)
    if uniform_q_len > 0 and total_tiles > max_batch_size_if_split:
        split = False
    return split


@settings(max_examples=300, deadline=None)
@given(
    data=st.data(),
    requests=st.integers(1, 80),
    num_sm=st.integers(1, 40),
    num_kv_heads=st.sampled_from([1, 2, 4, 8]),
    gqa=st.sampled_from([1, 4, 8]),
    cta_tile_q=st.sampled_from([16, 64, 128]),
    page_size=st.sampled_from([1, 16]),
    decode=st.booleans(),
)
def test_more_tiles_than_the_split_budget_never_split(
    data: st.DataObject,
    requests: int,
    num_sm: int,
    num_kv_heads: int,
    gqa: int,
    cta_tile_q: int,
    page_size: int,
    decode: bool,
) -> None:
    """Where the rule's bound holds (requests with a query > ``2 * SMs // heads``), the
    scheduler model splits no batch of those queries, whatever the KV lengths."""
    limit = 2 * num_sm // num_kv_heads
    qo = [1] * requests if decode else data.draw(st.lists(st.integers(1, 70), min_size=requests,
                                                          max_size=requests))  # fmt: skip
    kv = data.draw(st.lists(st.integers(0, 5000), min_size=requests, max_size=requests))
    split = scheduler_splits(
        qo, kv, gqa=gqa, cta_tile_q=cta_tile_q, max_batch_size_if_split=limit,
        page_size=page_size, graph=decode and data.draw(st.booleans()),
        uniform_q_len=1 if decode else 0,
    )  # fmt: skip
    if requests > limit:
        assert not split


def test_the_bound_is_needed() -> None:
    """Below the split budget long KV is split: the rule must not keep there."""
    limit = 2 * 132 // 8
    qo, kv = [1] * (limit // 2), [4096 // 16] * (limit // 2)
    kwargs: dict[str, Any] = dict(gqa=4, cta_tile_q=16, max_batch_size_if_split=limit,
                                  page_size=16, graph=False, uniform_q_len=1)  # fmt: skip
    assert scheduler_splits(qo, kv, **kwargs)
    assert not scheduler_splits([1] * (limit + 1), [4096 // 16] * (limit + 1), **kwargs)


def _slot(plan_info: list[int] | None) -> WrapperSlot:
    return WrapperSlot(SimpleNamespace(_plan_info=plan_info, use_tensor_cores=True))


def _info(total_rows: int, split: bool, size: int = 15) -> list[int]:
    info = [0] * size
    info[1] = total_rows
    info[-1] = int(split)
    return info


KWARGS = {"num_kv_heads": 8, "fixed_split_size": None}


def test_schedule_stands_reads_the_plan_info() -> None:
    limit = 2 * 132 // 8  # 33
    assert schedule_stands(_slot(_info(34, False)), KWARGS, 34, 132, 34)
    assert not schedule_stands(_slot(_info(33, False)), KWARGS, 33, 132, 33)  # at the budget
    assert not schedule_stands(_slot(_info(34, True)), KWARGS, 34, 132, 34)  # split
    assert not schedule_stands(_slot(_info(40, False)), KWARGS, 34, 132, 34)  # other rows
    assert schedule_stands(_slot(_info(40, False)), KWARGS, limit + 1, 132)  # rows not asked
    assert not schedule_stands(_slot(_info(34, False, size=10)), KWARGS, 34, 132, 34)
    assert not schedule_stands(_slot(None), KWARGS, 34, 132, 34)
    assert not schedule_stands(_slot(_info(34, False)), KWARGS, 34, 0, 34)  # SMs unknown
    fixed = {**KWARGS, "fixed_split_size": 64}
    assert not schedule_stands(_slot(_info(34, False)), fixed, 34, 132, 34)


def _decode_bound(bs: int) -> BoundCall:
    t = torch.zeros(bs + 1, dtype=torch.int32)
    views = (t, t, t[:bs], t[:bs], t, t, t[:bs])  # tensor-core: qo_indptr and KV lengths
    return BoundCall({}, dict(KWARGS), (), views, None, None)


def _prefill_bound(qo: list[int], kv: list[int]) -> BoundCall:
    qo_indptr = np.asarray(qo, dtype=np.int32)
    pages = np.arange(len(qo), dtype=np.int32)
    lens = np.asarray(kv, dtype=np.int32)
    t = torch.from_numpy(qo_indptr)
    views = (t, t, t, t, t, t, t)  # a paged prefill's staged views (not read here)
    return BoundCall(
        {}, dict(KWARGS), (), None, views, None, schedule_inputs=(qo_indptr, pages, lens)
    )


def test_a_decode_above_the_budget_keeps_its_schedule() -> None:
    spec_a, spec_b = object(), object()
    held = _slot(_info(34, False))
    held.scheduled = (spec_a, None)
    assert not _schedule_changed(held, spec_b, _decode_bound(34), 132)  # type: ignore[arg-type]
    assert held.scheduled == (spec_a, None)  # what the scheduler last read, unchanged
    small = _slot(_info(33, False))
    small.scheduled = (spec_a, None)
    assert _schedule_changed(small, spec_b, _decode_bound(33), 132)  # type: ignore[arg-type]
    assert small.scheduled == (spec_b, None)
    never = _slot(_info(34, False))  # no scheduler run recorded: it must run
    assert _schedule_changed(never, spec_b, _decode_bound(34), 132)  # type: ignore[arg-type]


def test_a_prefill_keeps_its_schedule_for_the_same_queries_only() -> None:
    qo = list(range(0, 35 * 3, 3))  # 34 requests of 3 queries
    held = _slot(_info(qo[-1], False))
    first = _prefill_bound(qo, [5] * 34)
    assert _schedule_changed(held, object(), first, 132)  # type: ignore[arg-type]
    recorded = held.scheduled
    assert not _schedule_changed(held, object(), _prefill_bound(qo, [900] * 34), 132)  # type: ignore[arg-type]
    assert held.scheduled is recorded
    other = [*qo[:-1], qo[-1] + 1]  # another query layout: the scheduler runs
    assert _schedule_changed(held, object(), _prefill_bound(other, [900] * 34), 132)  # type: ignore[arg-type]
    empty = [0, *qo[1:34], qo[33]]  # a request without queries: 33 tiles at least, no more
    held.scheduled = (
        object(),
        tuple(a.tobytes() for a in _prefill_bound(empty, [1] * 34).schedule_inputs),
    )  # type: ignore[union-attr]
    assert _schedule_changed(held, object(), _prefill_bound(empty, [900] * 34), 132)  # type: ignore[arg-type]


class CountingInfo:
    """A plan info that counts its entry reads (FlashInfer's is an FFI array, each read
    about a microsecond)."""

    def __init__(self, values: list[int]) -> None:
        self.values, self.reads = values, 0

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, index: int) -> int:
        self.reads += 1
        return self.values[index]


def test_the_plan_info_is_read_once_per_object() -> None:
    info = CountingInfo(_info(34, False))
    slot = WrapperSlot(SimpleNamespace(_plan_info=info, use_tensor_cores=True))
    for _ in range(5):
        assert schedule_stands(slot, KWARGS, 34, 132, 34)
    assert info.reads == 3  # total rows and the two flags, once
    assert not schedule_stands(slot, KWARGS, 33, 132, 33)
    assert info.reads == 3  # a batch the scheduler may split: the info is not read
    fresh = CountingInfo(_info(34, True))  # a new plan: read again
    slot.wrapper._plan_info = fresh
    assert not schedule_stands(slot, KWARGS, 34, 132, 34)
    assert fresh.reads == 3
