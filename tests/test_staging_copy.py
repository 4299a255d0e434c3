"""The one staging copy of an apply (``buffers.Staged``): every named array of a batch's
manifest lands, on both sides of the copy, exactly in its slice — the host view is what
``plan()`` reads, the device view what kernels read (CPU tensors here)."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from flashplan.executor.flashinfer.buffers import DeviceBuffer, Staged
from flashplan.executor.flashinfer.staging import device_plan
from flashplan.executor.gathers import GatherJobs


@given(st.lists(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=9), min_size=1, max_size=6))
def test_every_array_lands_in_its_slice_on_both_sides(arrays: list[list[int]]) -> None:
    host = {f"a{k}": np.array(a, dtype=np.int32) for k, a in enumerate(arrays)}
    table = np.zeros((6, 0), np.int32)
    table.flags.writeable = False
    jobs = GatherJobs.from_table(table, (), 0)
    dplan = device_plan((), jobs, host, {})
    target = DeviceBuffer(torch.device("cpu"), torch.int32)
    target.reserve(3)[:] = -7  # a stale buffer: every slice must be overwritten
    for _ in range(2):  # a second batch reuses (and may grow) the device buffer
        staged = Staged(dplan, target)
        for name, values in host.items():
            assert staged.host(name).tolist() == values.tolist()
            assert staged.device(name).tolist() == values.tolist()
            if values.size:  # a view of the device buffer itself
                assert staged.device(name).untyped_storage().data_ptr() == (
                    target.tensor.untyped_storage().data_ptr()
                )
