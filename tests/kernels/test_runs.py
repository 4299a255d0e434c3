"""fill_runs (Triton) and fill_runs_torch vs a brute force straight from the definition:
``out[start[s] + j] = max(first[s] + j, 0)`` for ``j < length[s]``, with ``first`` per run
or one integer for every run (the multi-item items).

On a host without CUDA, ``conftest.py`` makes the Triton kernel run under Triton's
interpreter on CPU tensors; the ``gpu`` tests run the compiled kernel on CUDA.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashplan.errors import FlashplanError
from flashplan.kernels import triton_mode
from flashplan.kernels.runs import fill_runs, fill_runs_torch

HYP = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
requires_interpreter = pytest.mark.skipif(
    triton_mode() != "interpret",
    reason=f"Triton kernel is in mode {triton_mode()!r}, not 'interpret'",
)
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SENTINEL = 12345


@st.composite
def run_sets(draw: st.DrawFn) -> tuple[list[int], list[int], list[int], int]:
    """Runs laid end to end (possibly with gaps left untouched), and the buffer size."""
    n = draw(st.integers(0, 12))
    first = draw(st.lists(st.integers(-3, 70000), min_size=n, max_size=n))
    length = draw(st.lists(st.integers(0, 300), min_size=n, max_size=n))
    gaps = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    start, at = [], 0
    for g, ln in zip(gaps, length, strict=True):
        at += g
        start.append(at)
        at += ln
    return start, first, length, at + draw(st.integers(0, 5))


def brute_force(
    start: list[int], first: list[int], length: list[int], size: int, dtype: torch.dtype
) -> list[int]:
    out = [SENTINEL] * size
    for s0, f, n in zip(start, first, length, strict=True):
        for j in range(n):
            out[s0 + j] = max(f + j, 0)
    if dtype == torch.uint16:
        out = [v & 0xFFFF for v in out]
    return out


def _run(fill, runs, dtype: torch.dtype, device: str, one_first: int | None) -> list[int]:
    """Fill ``runs``; with ``one_first``, every run starts at that one integer instead of
    its own ``first``."""
    start, first, length, size = runs
    t = [torch.tensor(a, dtype=torch.int32, device=device) for a in (start, first, length)]
    out = torch.full((size,), SENTINEL, dtype=torch.int32, device=device).to(dtype)
    fill(t[0], t[1] if one_first is None else one_first, t[2], out, max(length, default=0))
    return out.to(torch.int32).cpu().tolist()


def _want(runs, dtype: torch.dtype, one_first: int | None) -> list[int]:
    start, first, length, size = runs
    if one_first is not None:
        first = [one_first] * len(first)
    return brute_force(start, first, length, size, dtype)


DTYPES = st.sampled_from([torch.int32, torch.uint16])
FIRSTS = st.sampled_from([None, 1, 0, -2])


@requires_interpreter
@HYP
@given(runs=run_sets(), dtype=DTYPES, one=FIRSTS)
def test_kernel_interpreted(runs, dtype: torch.dtype, one: int | None) -> None:
    assert _run(fill_runs, runs, dtype, "cpu", one) == _want(runs, dtype, one)


@HYP
@given(runs=run_sets(), dtype=DTYPES, one=FIRSTS)
def test_torch_twin(runs, dtype: torch.dtype, one: int | None) -> None:
    assert _run(fill_runs_torch, runs, dtype, "cpu", one) == _want(runs, dtype, one)


@requires_cuda
@HYP
@given(runs=run_sets(), dtype=DTYPES, one=FIRSTS)
def test_kernel_on_cuda(runs, dtype: torch.dtype, one: int | None) -> None:
    want = _want(runs, dtype, one)
    assert _run(fill_runs, runs, dtype, "cuda", one) == want
    assert _run(fill_runs_torch, runs, dtype, "cuda", one) == want


@pytest.mark.parametrize("fill", [fill_runs, fill_runs_torch])
def test_wrong_runs_never_write_past_the_buffer(fill) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if fill is fill_runs and device == "cpu" and triton_mode() != "interpret":
        pytest.skip("the compiled kernel needs CUDA")
    backing = torch.full((40,), SENTINEL, dtype=torch.int32, device=device)
    out = backing[:10]  # runs below claim 5 + 9 tokens and start at -2
    start = torch.tensor([-2, 5], dtype=torch.int32, device=device)
    first = torch.tensor([0, 7], dtype=torch.int32, device=device)
    length = torch.tensor([5, 9], dtype=torch.int32, device=device)
    fill(start, first, length, out, 9)
    got = backing.cpu().numpy()
    assert got[:10].tolist() == [2, 3, 4, SENTINEL, SENTINEL, 7, 8, 9, 10, 11]
    assert np.all(got[10:] == SENTINEL)


def test_bad_arguments_are_refused() -> None:
    ok = torch.zeros(3, dtype=torch.int32)
    out = torch.zeros(8, dtype=torch.int32)
    with pytest.raises(FlashplanError, match="length"):
        fill_runs_torch(ok, ok, torch.zeros(2, dtype=torch.int32), out, 1)
    with pytest.raises(FlashplanError, match="first"):
        fill_runs_torch(ok, ok.long(), ok, out, 1)
    with pytest.raises(FlashplanError, match="out"):
        fill_runs_torch(ok, ok, ok, out.float(), 1)
    for first in (1.5, 2**31, "1"):
        with pytest.raises(FlashplanError, match="first"):
            fill_runs_torch(ok, first, ok, out, 1)  # type: ignore[arg-type]
