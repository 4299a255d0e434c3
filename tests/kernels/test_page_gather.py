"""gather_page_indices / token_slots: Triton kernels vs torch twins vs brute force.

On a host without CUDA, ``conftest.py`` makes the Triton kernels run under Triton's
interpreter on CPU tensors; the ``gpu`` tests run the compiled kernels on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashplan.errors import FlashplanError
from flashplan.kernels import page_gather, segments
from flashplan.kernels.page_gather import (
    gather_page_indices,
    gather_page_indices_torch,
    token_slots,
    token_slots_torch,
)

SENTINEL = -7  # never a page id (ids are >= -1) nor an offset
# 25 examples keep this file at a few seconds; a profile asking for more (e.g.
# HYPOTHESIS_PROFILE=thorough) gets what it asks for.
HYP = settings(
    max_examples=settings().max_examples if settings().max_examples > 100 else 25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
requires_interpreter = pytest.mark.skipif(
    page_gather.triton_mode() != "interpret",
    reason=f"Triton kernels are in mode {page_gather.triton_mode()!r}, not 'interpret' "
    "(on a CUDA host the gpu tests cover them)",
)
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


# --------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Table:
    """A page table given as nested lists, laid out in memory one of several ways."""

    values: list[list[int]]  # [num_rows][max_pages] page ids in [-1, pool]
    layout: str  # "contiguous" | "row_view" | "transposed"
    pool: int  # full-pool page count; page_map has pool + 1 entries
    page_map: list[int] | None  # [pool + 1], last entry -1

    def tensor(self, device: str) -> torch.Tensor:
        """The table as an int32 [num_rows, max_pages] tensor with this case's strides."""
        t = torch.tensor(self.values, dtype=torch.int32)
        rows, cols = t.shape
        if self.layout == "row_view":  # a column slice of a wider table: row stride > cols
            wide = torch.full((rows, cols + 3), 12345, dtype=torch.int32)
            wide[:, 2 : 2 + cols] = t
            return wide.to(device)[:, 2 : 2 + cols]
        if self.layout == "transposed":  # column stride = rows, row stride = 1
            return t.t().contiguous().to(device).t()
        return t.to(device)

    def map_tensor(self, device: str) -> torch.Tensor | None:
        if self.page_map is None:
            return None
        return torch.tensor(self.page_map, dtype=torch.int32, device=device)

    def lookup(self, row: int, col: int) -> int:
        """Brute-force page id (through page_map, Python negative indexing) of one cell."""
        page = self.values[row][col]
        return page if self.page_map is None else self.page_map[page]


@st.composite
def tables(draw: st.DrawFn, max_rows: int = 4, max_pages: int = 9) -> Table:
    num_rows = draw(st.integers(1, max_rows))
    width = draw(st.integers(1, max_pages))
    pool = draw(st.integers(1, 30))
    cell = st.integers(-1, pool)  # -1 (padding) and pool (the map's last entry) included
    values = [[draw(cell) for _ in range(width)] for _ in range(num_rows)]
    layout = draw(st.sampled_from(["contiguous", "row_view", "transposed"]))
    page_map = None
    if draw(st.booleans()):
        page_map = [*draw(st.lists(st.integers(0, 50), min_size=pool, max_size=pool)), -1]
    return Table(values, layout, pool, page_map)


@dataclass(frozen=True)
class Batch:
    """Per-request host ints: table row, start (pages or tokens), count, output start."""

    rows: list[int]
    starts: list[int]
    counts: list[int]
    indptr: list[int]  # [bs + 1]; gaps between requests allowed

    def tensors(self, device: str) -> tuple[torch.Tensor, ...]:
        return tuple(
            torch.tensor(x, dtype=torch.int32, device=device)
            for x in (self.rows, self.starts, self.counts, self.indptr)
        )

    @property
    def out_len(self) -> int:
        return self.indptr[-1] + 2


@st.composite
def batches(draw: st.DrawFn, num_rows: int, capacity: int) -> Batch:
    """Requests with starts/counts such that start + count <= capacity (0 counts too)."""
    bs = draw(st.integers(0, 5))
    rows, starts, counts = [], [], []
    indptr = [draw(st.integers(0, 2))]
    for _ in range(bs):
        rows.append(draw(st.integers(0, num_rows - 1)))
        start = draw(st.integers(0, capacity))
        count = draw(st.integers(0, capacity - start))
        starts.append(start)
        counts.append(count)
        indptr.append(indptr[-1] + count + draw(st.integers(0, 2)))
    return Batch(rows, starts, counts, indptr)


@st.composite
def gather_cases(draw: st.DrawFn) -> tuple[Table, Batch]:
    table = draw(tables())
    return table, draw(batches(len(table.values), len(table.values[0])))


@st.composite
def slot_cases(draw: st.DrawFn) -> tuple[Table, Batch, int, torch.dtype, torch.dtype]:
    table = draw(tables())
    page_size = draw(st.sampled_from([1, 2, 3, 4, 16]))
    batch = draw(batches(len(table.values), len(table.values[0]) * page_size))
    dtypes = st.sampled_from([torch.int32, torch.int64])
    return table, batch, page_size, draw(dtypes), draw(dtypes)


# --------------------------------------------------------------------------- oracles


def brute_gather(table: Table, batch: Batch) -> list[int]:
    out = [SENTINEL] * batch.out_len
    for i, row in enumerate(batch.rows):
        for p in range(batch.counts[i]):
            out[batch.indptr[i] + p] = table.lookup(row, batch.starts[i] + p)
    return out


def brute_slots(table: Table, batch: Batch, page_size: int) -> tuple[list[int], list[int]]:
    pages = [SENTINEL] * batch.out_len
    offsets = [SENTINEL] * batch.out_len
    for i, row in enumerate(batch.rows):
        for j in range(batch.counts[i]):
            t = batch.starts[i] + j
            pages[batch.indptr[i] + j] = table.lookup(row, t // page_size)
            offsets[batch.indptr[i] + j] = t % page_size
    return pages, offsets


# --------------------------------------------------------------------------- runners


def run_gather(table: Table, batch: Batch, device: str, impl: str) -> list[int]:
    pages = table.tensor(device)
    rows, starts, counts, indptr = batch.tensors(device)
    out = torch.full((batch.out_len,), SENTINEL, dtype=torch.int32, device=device)
    page_map = table.map_tensor(device)
    if impl == "triton":
        gather_page_indices(pages, rows, starts, counts, indptr, out, page_map=page_map)
    else:
        total = sum(batch.counts)
        gather_page_indices_torch(pages, rows, starts, counts, indptr, out, total, page_map)
    result: list[int] = out.tolist()
    return result


def run_slots(
    table: Table,
    batch: Batch,
    page_size: int,
    dtypes: tuple[torch.dtype, torch.dtype],
    device: str,
    impl: str,
) -> tuple[list[int], list[int]]:
    pages = table.tensor(device)
    rows, first, counts, indptr = batch.tensors(device)
    out_page = torch.full((batch.out_len,), SENTINEL, dtype=dtypes[0], device=device)
    out_off = torch.full((batch.out_len,), SENTINEL, dtype=dtypes[1], device=device)
    page_map = table.map_tensor(device)
    if impl == "triton":
        token_slots(
            pages, rows, first, counts, indptr, page_size, out_page, out_off, page_map=page_map
        )
    else:
        total = sum(batch.counts)
        token_slots_torch(
            pages, rows, first, counts, indptr, page_size, out_page, out_off, total, page_map
        )
    assert out_page.dtype == dtypes[0] and out_off.dtype == dtypes[1]
    return out_page.tolist(), out_off.tolist()


# --------------------------------------------------------------------------- CPU tests


@HYP
@given(gather_cases())
def test_gather_torch_matches_brute_force(case: tuple[Table, Batch]) -> None:
    table, batch = case
    assert run_gather(table, batch, "cpu", "torch") == brute_gather(table, batch)


@requires_interpreter
@HYP
@given(gather_cases())
def test_gather_triton_interpreted_matches(case: tuple[Table, Batch]) -> None:
    table, batch = case
    expected = brute_gather(table, batch)
    assert run_gather(table, batch, "cpu", "triton") == expected
    assert run_gather(table, batch, "cpu", "torch") == expected


@HYP
@given(slot_cases())
def test_token_slots_torch_matches_brute_force(
    case: tuple[Table, Batch, int, torch.dtype, torch.dtype],
) -> None:
    table, batch, page_size, page_dtype, off_dtype = case
    got = run_slots(table, batch, page_size, (page_dtype, off_dtype), "cpu", "torch")
    assert got == brute_slots(table, batch, page_size)


@requires_interpreter
@HYP
@given(slot_cases())
def test_token_slots_triton_interpreted_matches(
    case: tuple[Table, Batch, int, torch.dtype, torch.dtype],
) -> None:
    table, batch, page_size, page_dtype, off_dtype = case
    expected = brute_slots(table, batch, page_size)
    dtypes = (page_dtype, off_dtype)
    assert run_slots(table, batch, page_size, dtypes, "cpu", "triton") == expected
    assert run_slots(table, batch, page_size, dtypes, "cpu", "torch") == expected


BLOCK = segments._BLOCK  # elements per loop iteration of the gather kernel program


def long_case() -> tuple[Table, Batch]:
    """Requests spanning 2-3 kernel blocks, unaligned starts, gaps, a page_map."""
    gen = torch.Generator().manual_seed(0)
    width, pool = 2 * BLOCK + 300, 2000
    values = torch.randint(-1, pool + 1, (3, width), generator=gen).tolist()
    page_map = [*torch.randint(0, 5000, (pool,), generator=gen).tolist(), -1]
    table = Table(values, "row_view", pool, page_map)
    counts = [2 * BLOCK + 76, 0, BLOCK + 1]
    indptr = [3]
    for count in counts:
        indptr.append(indptr[-1] + count + 1)  # a gap after each request
    batch = Batch(rows=[2, 0, 1], starts=[5, 0, 100], counts=counts, indptr=indptr)
    return table, batch


def long_slots_case() -> tuple[Table, Batch, int]:
    """Token slots of long requests (page_size 2): several blocks per request."""
    table, batch = long_case()
    counts = [2 * BLOCK + 6, 0, BLOCK + 88]
    indptr = [0]
    for count in counts:
        indptr.append(indptr[-1] + count)
    return table, Batch(batch.rows, [7, 0, 3], counts, indptr), 2


@requires_interpreter
def test_multi_block_requests_interpreted() -> None:
    table, batch = long_case()
    assert run_gather(table, batch, "cpu", "triton") == brute_gather(table, batch)
    table, slots, page_size = long_slots_case()
    dtypes = (torch.int32, torch.int64)
    got = run_slots(table, slots, page_size, dtypes, "cpu", "triton")
    assert got == brute_slots(table, slots, page_size)


def test_multi_block_requests_torch() -> None:
    table, batch = long_case()
    assert run_gather(table, batch, "cpu", "torch") == brute_gather(table, batch)
    table, slots, page_size = long_slots_case()
    got = run_slots(table, slots, page_size, (torch.int64, torch.int32), "cpu", "torch")
    assert got == brute_slots(table, slots, page_size)


def test_cpu_launcher_works_in_any_mode() -> None:
    """On CPU the launcher uses the interpreter or the torch twin; both give the result."""
    table, batch = long_case()
    assert run_gather(table, batch, "cpu", "triton") == brute_gather(table, batch)


def test_argument_errors() -> None:
    pages = torch.zeros((2, 4), dtype=torch.int32)
    one = torch.zeros(1, dtype=torch.int32)
    indptr = torch.zeros(2, dtype=torch.int32)
    out = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(FlashplanError, match="pages"):
        gather_page_indices(pages.long(), one, one, one, indptr, out)
    with pytest.raises(FlashplanError, match="page_indptr"):
        gather_page_indices(pages, one, one, one, one, out)
    with pytest.raises(FlashplanError, match="num_pages"):
        gather_page_indices(pages, one, one, indptr, indptr, out)
    with pytest.raises(FlashplanError, match="out"):
        gather_page_indices(pages, one, one, one, indptr, out[::2])
    with pytest.raises(FlashplanError, match="page_size"):
        token_slots(pages, one, one, one, indptr, 0, out, out)
    with pytest.raises(FlashplanError, match="out_offset"):
        token_slots(pages, one, one, one, indptr, 4, out, out.float())
    with pytest.raises(FlashplanError, match="total"):
        gather_page_indices_torch(pages, one, one, one, indptr, out, -1)


# --------------------------------------------------------------------------- GPU tests


@pytest.mark.gpu
@requires_cuda
@HYP
@given(gather_cases())
def test_gather_gpu(case: tuple[Table, Batch]) -> None:
    table, batch = case
    expected = brute_gather(table, batch)
    assert run_gather(table, batch, "cuda", "triton") == expected
    assert run_gather(table, batch, "cuda", "torch") == expected


@pytest.mark.gpu
@requires_cuda
@HYP
@given(slot_cases())
def test_token_slots_gpu(case: tuple[Table, Batch, int, torch.dtype, torch.dtype]) -> None:
    table, batch, page_size, page_dtype, off_dtype = case
    expected = brute_slots(table, batch, page_size)
    dtypes = (page_dtype, off_dtype)
    assert run_slots(table, batch, page_size, dtypes, "cuda", "triton") == expected
    assert run_slots(table, batch, page_size, dtypes, "cuda", "torch") == expected


@pytest.mark.gpu
@requires_cuda
def test_gpu_multi_block_and_no_sync() -> None:
    """Long requests on the compiled kernels, launched under sync-debug mode 'error'."""
    table, batch = long_case()
    pages = table.tensor("cuda")
    rows, starts, counts, indptr = batch.tensors("cuda")
    page_map = table.map_tensor("cuda")
    out = torch.full((batch.out_len,), SENTINEL, dtype=torch.int32, device="cuda")
    out_twin = out.clone()
    out_page = out.clone()
    out_off = out.clone()
    total = sum(batch.counts)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gather_page_indices(pages, rows, starts, counts, indptr, out, page_map=page_map)
        gather_page_indices_torch(pages, rows, starts, counts, indptr, out_twin, total, page_map)
        token_slots(pages, rows, starts, counts, indptr, 1, out_page, out_off, page_map=page_map)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    expected = brute_gather(table, batch)
    assert out.tolist() == expected
    assert out_twin.tolist() == expected
    assert out_page.tolist() == expected  # page_size 1: token t is page column t
    assert out_off.tolist() == [0 if x != SENTINEL else SENTINEL for x in expected]
