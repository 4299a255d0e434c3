"""The fast decode re-plan's contract with the installed flashinfer (CPU only).

The GPU tests (``tests/gpu/test_fast_plan.py``) check that a re-plan through
``fast_decode_plan`` equals a full ``plan()``; these check, without a GPU, that every
argument of a decode call reaches ``fast_decode_plan`` or is pinned by the wrapper's
compiled module, and when the fast path is offered at all.
"""

from __future__ import annotations

import inspect
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import flashplan as fp
from flashplan.executor.flashinfer.adapter import (
    _ARRAYS,
    _PASSED,
    fast_decode_available,
    flashinfer_support,
)
from flashplan.executor.flashinfer.calls import WrapperKind, call_skeleton
from flashplan.executor.flashinfer.policy import ExecutorPolicy
from flashplan.testing import decode_layouts, head_configs

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    flashinfer = pytest.importorskip("flashinfer")

#: plan() arguments fast_decode_plan does not take: fixed by the compiled module, which
#: the re-plan reuses only when the wrapper's last plan() had the same constants.
_PINNED_BY_MODULE = {"o_data_type"}


def test_passed_arguments_are_fast_decode_plan_parameters() -> None:
    params = inspect.signature(flashinfer.fast_decode_plan).parameters
    assert set(_PASSED) | set(_ARRAYS) <= set(params)
    assert "global_override_indptr_cpu" in params


@settings(max_examples=30)
@given(
    layout=decode_layouts(),
    heads=head_configs(),
    policy=st.sampled_from(
        [
            ExecutorPolicy(),
            ExecutorPolicy(deterministic=True),
            ExecutorPolicy(decode_tensor_cores=False),
        ]
    ),
)
def test_every_decode_argument_is_passed_or_pinned(
    layout: fp.BatchLayout, heads: fp.HeadConfig, policy: ExecutorPolicy
) -> None:
    spec = fp.plan(layout, heads)
    for gc in call_skeleton(spec, policy, sm90=True):
        call = gc.paged
        assert call is not None and call.wrapper.kind is WrapperKind.DECODE
        names = {name for name, _ in call.kwargs}
        assert names <= set(_PASSED) | set(_ARRAYS) | _PINNED_BY_MODULE, names
        # the arrays are the only per-batch arguments; all others are constants
        assert {name for name, _ in call.placeholders} == set(_ARRAYS)


def test_fast_path_on_the_installed_flashinfer_as_the_table_says() -> None:
    """(The table's answers for fake modules: ``tests/test_adapter.py``.)"""
    support = flashinfer_support(flashinfer)
    assert fast_decode_available(flashinfer) == (support is not None and support.fast_decode)
