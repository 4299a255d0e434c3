"""The bound page table's checks (pure parts, CPU): what ``bind_page_table`` accepts
and what a bound executor's apply refuses. The graph capture itself runs on the GPU
(``tests/gpu/test_bound_table.py``)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import flashplan as fp
from flashplan.executor.flashinfer.bound_table import bound_table

CPU = torch.device("cpu")


def test_binds_a_contiguous_int32_table_on_the_device() -> None:
    pages = torch.zeros(4, 8, dtype=torch.int32)
    bound = bound_table(pages, CPU, 32)
    assert bound.pages is pages and bound.num_pages == 32
    assert bound.address == pages.data_ptr()
    bound.check(fp.PageTable(pages, rows=[2, 0], num_pages=32))  # the bound one: fine


@pytest.mark.parametrize(
    ("pages", "num_pages", "match"),
    [
        (torch.zeros(4, 8, dtype=torch.int64), None, "int32"),
        (torch.zeros(8, dtype=torch.int32), None, "int32"),
        (torch.zeros(8, 4, dtype=torch.int32).t(), None, "contiguous"),
        (torch.zeros(4, 8, dtype=torch.int32), 0, "num_pages"),
        (torch.zeros(4, 8, dtype=torch.int32), True, "num_pages"),
        ([[0, 1]], None, "dense int32 tensor"),
    ],
)
def test_refuses_what_it_cannot_bind(pages: object, num_pages: object, match: str) -> None:
    with pytest.raises(fp.PageTableError, match=match):
        bound_table(pages, CPU, num_pages)  # type: ignore[arg-type]


@given(
    st.one_of(
        st.integers(max_value=0),
        st.booleans(),
        st.floats(),
        st.text(max_size=3),
        st.lists(st.integers(), max_size=2),
    )
)
def test_junk_num_pages_is_a_page_table_error(num_pages: object) -> None:
    """Whatever is not an int >= 1 (nor None) is refused as PageTable refuses it."""
    with pytest.raises(fp.PageTableError) as info:
        bound_table(torch.zeros(4, 8, dtype=torch.int32), CPU, num_pages)
    assert info.value.field == "num_pages"
    with pytest.raises(fp.PageTableError):  # the same refusal as the record's
        fp.PageTable(torch.zeros(4, 8, dtype=torch.int32), rows=[0], num_pages=num_pages)


def test_refuses_a_table_on_another_device() -> None:
    pages = torch.zeros(4, 8, dtype=torch.int32)
    with pytest.raises(fp.PageTableError, match="device") as info:
        bound_table(pages, torch.device("cuda", 0), None)
    assert info.value.field == "pages"


def test_a_bound_table_refuses_every_other_table() -> None:
    pages = torch.zeros(4, 8, dtype=torch.int32)
    bound = bound_table(pages, CPU, None)
    with pytest.raises(fp.PlanMismatchError, match="bound") as info:
        bound.check(fp.PageTable(pages.clone(), rows=[0]))  # equal values, another tensor
    assert info.value.field == "table"
    with pytest.raises(fp.PlanMismatchError, match="num_pages"):
        bound.check(fp.PageTable(pages, rows=[0], num_pages=16))
    pages.set_(torch.zeros(4, 8, dtype=torch.int32))  # new storage, same tensor object
    with pytest.raises(fp.PageTableError, match="new storage"):
        bound.check(fp.PageTable(pages, rows=[0]))
