"""The hostile-input contract on the FlashInfer executor (H200): NaN outside the written
keys never leaks, arguments are checked before any write, bad page ids are caught
(checked mode) or neutralised and counted (default mode)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import flashplan as fp
from flashplan.executor.flashinfer import ExecutorPolicy, FlashInferExecutor

from .helpers import rel_err

DEV = "cuda"
HEADS = fp.HeadConfig(num_qo_heads=8, num_kv_heads=2, head_dim=128)
GROUPS = (fp.AttentionGroup.full(), fp.AttentionGroup.sliding(6), fp.AttentionGroup.cross())


def _batch(mode: str, page_size: int) -> fp.BatchLayout:
    if mode == "decode":
        return fp.BatchLayout.decode(
            [1, 20, 70, 300], page_size=page_size, groups=GROUPS, encoder_lens=[0, 5, 17, 40]
        )
    return fp.BatchLayout.extend(
        [9, 40, 3, 70],
        [0, 33, 0, 60],
        page_size=page_size,
        groups=GROUPS,
        encoder_lens=[4, 0, 9, 33],
    )


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("mode", ["decode", "paged", "ragged"])
def test_nan_outside_the_written_keys_never_leaks(page_size: int, mode: str) -> None:
    layout = _batch(mode, page_size)
    path = "ragged" if mode == "ragged" else "paged"
    spec = fp.plan(layout, HEADS, extend_path=path)
    table = fp.PageTable.shuffled(spec.pages_needed, seed=5, spare_pages=6, device=DEV)
    assert table.num_pages is not None
    ex = FlashInferExecutor(policy=ExecutorPolicy(prefill_backend="fa2"))
    ex.apply(spec, table)
    pages = table.pages.cpu()
    for group in layout.groups:
        cache = torch.full(
            (table.num_pages, 2, page_size, 2, 128), math.nan, dtype=torch.bfloat16, device=DEV
        )
        for i in range(layout.batch_size):  # the keys the request owns
            row = int(table.rows[i])
            if group.cross_attention:
                tokens = np.arange(int(layout.encoder_lens[i]))  # type: ignore[index]
            else:
                start = int(layout.decoder_start[i])
                tokens = start + np.arange(int(layout.seq_lens[i]))
            for t in tokens.tolist():
                cache[int(pages[row, t // page_size]), :, t % page_size] = torch.randn(
                    2, 2, 128, device=DEV
                ).to(torch.bfloat16)
        rows = spec.total_encoder if group.cross_attention else spec.total_q
        q = torch.randn(spec.total_q, 8, 128, device=DEV).to(torch.bfloat16)
        k = torch.randn(rows, 2, 128, device=DEV).to(torch.bfloat16)
        out = ex.run(group, q, k, k, cache)
        assert torch.isfinite(out).all(), group


def test_arguments_are_checked_before_any_write() -> None:
    layout = _batch("paged", 16)
    spec = fp.plan(layout, HEADS, extend_path="ragged")
    table = fp.PageTable.shuffled(spec.pages_needed, device=DEV)
    ex = FlashInferExecutor()
    ex.apply(spec, table)
    full = layout.groups[0]
    cache = torch.randn(int(table.num_pages or 1), 2, 16, 2, 128, device=DEV).to(torch.bfloat16)
    q = torch.randn(spec.total_q, 8, 128, device=DEV).to(torch.bfloat16)
    k = torch.randn(spec.total_q, 2, 128, device=DEV).to(torch.bfloat16)
    before = cache.clone()
    bad_args = [
        (q, k.to("meta"), k),
        (q, k, k.cpu()),
        (q, k[:-1], k[:-1]),
        (q, k.float(), k.float()),
        (q.cpu(), k, k),
        (None, k, k),
        ([1, 2], k, k),
    ]
    for args in bad_args:
        with pytest.raises(fp.PlanMismatchError):
            ex.run(full, *args, cache)  # type: ignore[arg-type]
    for bad_cache in (cache.cpu(), cache.float(), np.zeros(3), cache[:, :, :8]):
        with pytest.raises(fp.PlanMismatchError):
            ex.run(full, q, k, k, bad_cache)  # type: ignore[arg-type]
    torch.cuda.synchronize()
    assert torch.equal(cache, before)
    with pytest.raises(fp.PageTableError):
        ex.apply(spec, fp.PageTable(table.pages.cpu(), table.rows))
    ex.run(full, q, k, k, cache)  # the applied plan still runs
    with pytest.raises(fp.UnsupportedError):
        FlashInferExecutor("cpu")


def _poisoned(spec: fp.PlanSpec, table: fp.PageTable, request: int, value: int) -> fp.PageTable:
    pages = table.pages.clone()
    row = int(table.rows[request])
    pages[row, int(spec.write_start[request]) // spec.page_size] = value
    return fp.PageTable(pages, table.rows, num_pages=table.num_pages)


@pytest.mark.parametrize("value", [-1, 10_000, 2**31 - 1])
def test_checked_mode_names_the_request_of_a_bad_page_id(value: int) -> None:
    layout = fp.BatchLayout.extend([9, 40, 30], [4, 33, 20], page_size=16)
    spec = fp.plan(layout, HEADS)
    table = fp.PageTable.shuffled(spec.pages_needed, device=DEV)
    ex = FlashInferExecutor(check_pages=True)
    with pytest.raises(fp.PageTableError) as err:
        ex.apply(spec, _poisoned(spec, table, 1, value))
    assert err.value.request == 1


def test_checked_mode_refuses_ids_beyond_the_cache_and_shared_write_slots() -> None:
    layout = fp.BatchLayout.decode([9, 41], page_size=16)
    spec = fp.plan(layout, HEADS)
    table = fp.PageTable.sequential(spec.pages_needed, device=DEV)  # num_pages = 4
    ex = FlashInferExecutor(check_pages=True)
    ex.apply(spec, fp.PageTable(table.pages, table.rows))  # pool size not given
    small = torch.zeros(3, 2, 16, 2, 128, dtype=torch.bfloat16, device=DEV)
    q = torch.randn(2, 8, 128, device=DEV).to(torch.bfloat16)
    with pytest.raises(fp.PageTableError) as err:
        ex.run(fp.AttentionGroup(), q, None, None, small)
    assert err.value.request == 1
    shared = table.pages.clone()
    shared[1, 2] = shared[0, 0]  # token 8 of both requests: one slot
    with pytest.raises(fp.PageTableError):
        ex.apply(spec, fp.PageTable(shared, table.rows))


def _expected_writes(
    cache: torch.Tensor, spec: fp.PlanSpec, table: fp.PageTable, k: torch.Tensor
) -> torch.Tensor:
    """The cache after writing ``k`` (as K and V) at every slot whose page id is valid."""
    want = cache.clone()
    pages, ps = table.pages.cpu(), spec.page_size
    qo = spec.qo_indptr.tolist()
    for i in range(spec.batch_size):
        row = int(table.rows[i])
        for j, t in enumerate(
            range(int(spec.write_start[i]), int(spec.write_start[i]) + qo[i + 1] - qo[i])
        ):
            page = int(pages[row, t // ps])
            if 0 <= page < cache.shape[0]:
                want[page, 0, t % ps] = k[qo[i] + j]
                want[page, 1, t % ps] = k[qo[i] + j]
    return want


@pytest.mark.parametrize("value", [-1, 10_000])
def test_default_mode_neutralises_and_counts_bad_ids(value: int) -> None:
    layout = fp.BatchLayout.extend([9, 40, 30], [4, 33, 20], page_size=16)
    spec = fp.plan(layout, HEADS)
    table = fp.PageTable.shuffled(spec.pages_needed, device=DEV)
    poisoned = _poisoned(spec, table, 1, value)
    ex = FlashInferExecutor()
    ex.apply(spec, poisoned)  # the table gives the pool size: reads of 10000 go to page 0
    cache = torch.randn(int(table.num_pages or 1), 2, 16, 2, 128, device=DEV).to(torch.bfloat16)
    q = torch.randn(spec.total_q, 8, 128, device=DEV).to(torch.bfloat16)
    k = torch.randn(spec.total_q, 2, 128, device=DEV).to(torch.bfloat16)
    want = _expected_writes(cache, spec, poisoned, k)
    out = ex.run(fp.AttentionGroup(), q, k, k, cache)
    torch.cuda.synchronize()
    count, first_job = ex.page_errors().tolist()
    assert count >= 1 and first_job < 2**31 - 1
    # Only the valid slots were written: -1 did not wrap around, 10000 wrote nowhere.
    assert torch.equal(cache, want)
    assert torch.isfinite(out).all()  # the bad id's read went to page 0, in bounds


def test_a_good_batch_after_a_bad_one_is_unaffected() -> None:
    layout = fp.BatchLayout.decode([9, 40, 300], page_size=16)
    spec = fp.plan(layout, HEADS)
    table = fp.PageTable.shuffled(spec.pages_needed, device=DEV)
    ex = FlashInferExecutor()
    ex.apply(spec, _poisoned(spec, table, 0, -5))
    cache = torch.randn(int(table.num_pages or 1), 2, 16, 2, 128, device=DEV).to(torch.bfloat16)
    q = torch.randn(3, 8, 128, device=DEV).to(torch.bfloat16)
    ex.run(fp.AttentionGroup(), q, None, None, cache)
    ex.apply(spec, table)
    out = ex.run(fp.AttentionGroup(), q, None, None, cache)
    ref = fp.ReferenceExecutor()
    ref.apply(spec, table)
    assert rel_err(out, ref.run(fp.AttentionGroup(), q, None, None, cache)) <= 1e-2
