"""The staging names: one module builds them, ``parse`` reads them back, and every name
a batch stages is one the constructors make."""

from __future__ import annotations

import typing

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import flashplan.executor.flashinfer.names as names
from flashplan.executor.flashinfer.calls import translate
from flashplan.executor.flashinfer.policy import ExecutorPolicy
from flashplan.testing.sequences import batch_sequence

STEPS = st.none() | st.integers(0, 9)
GROUPS = st.integers(0, 40)


@given(GROUPS, st.sampled_from(typing.get_args(names.GroupArray)), STEPS)
def test_group_arrays_parse_back(group: int, field: str, step: int | None) -> None:
    prefix = names.step_prefix(step)
    got = names.parse(names.group_array(group, field, prefix))  # type: ignore[arg-type]
    assert got == names.Parsed(prefix, group, "", field)


@given(GROUPS, st.sampled_from(typing.get_args(names.MaskField)), STEPS)
def test_mask_arrays_parse_back(group: int, field: str, step: int | None) -> None:
    prefix = names.step_prefix(step)
    got = names.parse(names.mask_name(group, field, prefix))  # type: ignore[arg-type]
    assert got == names.Parsed(prefix, group, "mask", field)


@given(GROUPS, st.sampled_from(["qo.total", "qo.max_len"]), STEPS)
def test_integers_parse_back(group: int, field: str, step: int | None) -> None:
    prefix = names.step_prefix(step)
    kind, _, leaf = field.partition(".")
    assert names.parse(names.batch_int(field, prefix)) == (prefix, None, kind, leaf)  # type: ignore[arg-type]
    assert names.parse(names.group_int(group, field, prefix)) == (prefix, group, kind, leaf)  # type: ignore[arg-type]


def test_every_staged_name_comes_from_the_constructors() -> None:
    """Over a long batch sequence, each staged array and integer parses into a known
    kind and field (a name spelled by hand elsewhere would not)."""
    known = {
        "": set(typing.get_args(names.GroupArray)) | {names.QO_INDPTR},
        "mask": set(typing.get_args(names.MaskField)),
        "qo": {"total", "max_len"},
        "items": set(typing.get_args(names.ItemField)),
    }
    seen = 0
    for batch in batch_sequence(7, 120, max_batch=4):
        for spec in batch.specs:
            inputs = translate(spec, ExecutorPolicy(), sm90=True).inputs
            for name in [*inputs.host, *inputs.ints]:
                parsed = names.parse(name)
                if parsed.kind.startswith("items."):  # a token positions' part
                    assert parsed.field in typing.get_args(names.ItemPart), name
                    continue
                if parsed.kind == "" and parsed.group is None:
                    assert name == names.QO_INDPTR, name
                else:
                    assert parsed.field in known[parsed.kind] or (
                        parsed.field == "max_kv_len" and parsed.kind == ""
                    ), name
                seen += 1
    assert seen > 500
    assert np.all([names.is_pages_region(names.pages_region(i)) for i in range(5)])
    assert not names.is_pages_region(names.WRITE)


@given(STEPS)
def test_step_of_inverts_step_prefix(step: int | None) -> None:
    assert names.step_of(names.step_prefix(step)) == (0 if step is None else step)
