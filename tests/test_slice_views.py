"""`SliceViews`: the executor's cache of staged arrays' views (CPU tensors here).

A view must be exactly ``tensor[offset : offset + size]`` of its manifest slice (sharing
the tensor's memory, so what the staging copy writes is what ``plan()`` reads), made only
when looked up, reused for the same tensor object and manifest, and never handed out for
another tensor that happens to reuse an evicted entry's address.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from flashplan.executor.flashinfer.buffers import SliceViews
from flashplan.executor.flashinfer.staging import StagingManifest


def _manifest(sizes: list[int]) -> StagingManifest:
    return StagingManifest.of({f"a{k}": np.zeros(n, np.int32) for k, n in enumerate(sizes)})


@given(st.lists(st.integers(0, 9), min_size=1, max_size=8), st.data())
def test_views_are_the_manifest_slices(sizes: list[int], data: st.DataObject) -> None:
    manifest = _manifest(sizes)
    tensor = torch.arange(manifest.total + 3, dtype=torch.int32)
    views = SliceViews().of(tensor, manifest)
    names = data.draw(st.lists(st.sampled_from([s.name for s in manifest.slices]), max_size=5))
    for name in names:
        s = manifest[name]
        view = views[name]
        assert view.tolist() == list(range(s.offset, s.offset + s.size))
        if s.size:
            assert view.data_ptr() == tensor.data_ptr() + 4 * s.offset  # no copy
    assert set(dict(views)) == set(names)  # only the views looked up were made


def test_views_are_reused_per_tensor_and_manifest() -> None:
    manifest = _manifest([3, 2, 4])
    cache = SliceViews(capacity=2)
    t1, t2 = torch.zeros(9, dtype=torch.int32), torch.zeros(9, dtype=torch.int32)
    v1 = cache.of(t1, manifest)
    first = v1["a1"]
    assert cache.of(t1, manifest) is v1 and v1["a1"] is first
    v2 = cache.of(t2, manifest)
    assert v2 is not v1
    v2["a1"].fill_(7)  # writes land in t2, not t1
    assert t2[3:5].tolist() == [7, 7] and t1.tolist() == [0] * 9
    other = _manifest([9])
    cache.of(t1, other)  # a third pair: the oldest (t1, manifest) is dropped
    assert cache.of(t2, manifest) is v2
    assert cache.of(t1, manifest) is not v1  # rebuilt, equal views
    assert cache.of(t1, manifest)["a1"].data_ptr() == first.data_ptr()
