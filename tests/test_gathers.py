"""Gather-job tables: ``GatherJobs(...)`` stores what ``gather_jobs`` and ``concat_jobs``
build (read-only C-contiguous int32 ``[6, n]``); ``GatherJobs.from_table`` checks a table
built elsewhere."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings

import flashplan as fp
from flashplan.executor.gathers import GatherJobs, concat_jobs, gather_jobs
from flashplan.testing import layouts

HEADS = fp.HeadConfig(num_qo_heads=4, num_kv_heads=2, head_dim=64)


def _check_table(jobs: GatherJobs) -> None:
    table = jobs.table
    assert table.dtype == np.int32 and table.ndim == 2 and table.shape[0] == 6
    assert table.flags.c_contiguous and not table.flags.writeable
    ends = [r.hi for r in jobs.regions]
    assert jobs.total == (ends[-1] if ends else 0)


@settings(max_examples=40, deadline=None)
@given(layouts(max_batch=6))
def test_built_tables_pass_the_factory_checks(layout: fp.BatchLayout) -> None:
    spec = fp.plan(layout, HEADS)
    rows = np.arange(layout.batch_size)[::-1]
    jobs = gather_jobs(spec, rows)
    _check_table(jobs)
    again = GatherJobs.from_table(jobs.table, jobs.regions, jobs.total)
    assert again.table is jobs.table and again.regions == jobs.regions
    both = concat_jobs([jobs, jobs], ["a/", "b/"])
    _check_table(both)
    assert both.total == 2 * jobs.total and both.num_jobs == 2 * jobs.num_jobs


@pytest.mark.parametrize(
    ("table", "message"),
    [
        (np.zeros((6, 3), np.int64), "int32"),
        (np.zeros((5, 3), np.int32), r"\[6, n\]"),
        (np.zeros(18, np.int32), r"\[6, n\]"),
        (np.zeros((6, 3), np.int32), "read-only"),  # writable
        (np.zeros((3, 6), np.int32).T, r"\[6, n\]|C-contiguous"),
    ],
)
def test_from_table_refuses_other_tables(table: np.ndarray, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GatherJobs.from_table(table, (), 0)


def test_from_table_refuses_a_strided_read_only_table() -> None:
    table = np.zeros((6, 6), np.int32)[:, ::2]
    table.setflags(write=False)
    with pytest.raises(ValueError, match="C-contiguous"):
        GatherJobs.from_table(table, (), 0)
