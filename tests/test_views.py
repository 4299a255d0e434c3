"""The plan's own views: ``PlanSpec.to_dense`` and ``PlanSpec.to_string`` show what the
kernels were planned to see, and agree with the oracle stated from the layout."""

from __future__ import annotations

import re

import numpy as np
import torch
from hypothesis import given, settings

import flashplan as fp
from flashplan.oracle import visibility
from flashplan.testing import layouts

HEADS = fp.HeadConfig(4, 1, 64, q_dtype=torch.float32)


@settings(max_examples=60, deadline=None)
@given(layouts(max_batch=3))
def test_to_dense_is_the_oracle_and_to_string_draws_it(layout: fp.BatchLayout) -> None:
    spec = fp.plan(layout, HEADS)
    for group in layout.groups:
        dense = spec.to_dense(group)
        want = visibility(layout, group)
        assert len(dense) == len(want) == layout.batch_size
        for got, exp in zip(dense, want, strict=True):
            assert got.dtype == np.bool_ and np.array_equal(got, exp)
        text = spec.to_string(group, max_cols=10_000, max_rows=10_000)
        headers = re.findall(r"^request (\d+): (\d+) quer", text, re.M)
        assert [int(i) for i, _ in headers] == list(range(layout.batch_size))
        assert [int(n) for _, n in headers] == [m.shape[0] for m in dense]
        # every query row ends with how many keys it sees: the dense row's sum (a
        # request without keys is one line, and draws no rows)
        counts = [int(c) for c in re.findall(r"^ *\d+  [ ~]*[#.][#. ~]*   (\d+)", text, re.M)]
        assert counts == [int(n) for m in dense if m.shape[1] for n in m.sum(axis=1)]


def test_to_string_of_a_verify_tree_labels_rows_by_position() -> None:
    tree = fp.DraftTree.from_parents([[-1, 0, 0, 1]])
    spec = fp.plan(fp.BatchLayout.verify([5], tree), HEADS)
    text = spec.to_string(fp.AttentionGroup())
    labels = [int(x) for x in re.findall(r"^\s+(\d+)  [#.]", text, re.M)]
    assert labels == [5, 6, 6, 7]  # prefix + depth, not the KV slot
