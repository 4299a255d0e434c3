"""`segment_slots`: one launch for page gathers and write slots, vs brute force."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashplan.kernels import segments
from flashplan.kernels.page_gather import triton_mode


@st.composite
def cases(draw: st.DrawFn) -> dict[str, np.ndarray]:
    num_rows = draw(st.integers(1, 4))
    max_pages = draw(st.integers(1, 9))
    pool = draw(st.integers(1, 40))
    pages = np.array(
        draw(
            st.lists(
                st.integers(0, pool - 1),
                min_size=num_rows * max_pages,
                max_size=num_rows * max_pages,
            )
        ),
        dtype=np.int32,
    )
    pages = pages.reshape(num_rows, max_pages)
    n = draw(st.integers(0, 6))
    rows, first, counts, div, use_map = [], [], [], [], []
    for _ in range(n):
        d = draw(st.sampled_from([1, 1, 2, 3, 16]))
        capacity = max_pages * d
        f = draw(st.integers(0, capacity))
        c = draw(st.integers(0, capacity - f))
        rows.append(draw(st.integers(0, num_rows - 1)))
        first.append(f)
        counts.append(c)
        div.append(d)
        use_map.append(draw(st.integers(0, 1)))
    counts_a = np.array(counts, dtype=np.int32)
    dst = np.concatenate([[0], np.cumsum(counts_a)])[:-1].astype(np.int32) if n else counts_a
    page_map = np.array([*draw(st.permutations(list(range(pool)))), -1], dtype=np.int32)
    return {
        "pages": pages,
        "rows": np.array(rows, dtype=np.int32),
        "first": np.array(first, dtype=np.int32),
        "counts": counts_a,
        "dst": dst,
        "div": np.array(div, dtype=np.int32),
        "use_map": np.array(use_map, dtype=np.int32),
        "page_map": page_map,
    }


def brute(case: dict[str, np.ndarray], with_map: bool) -> tuple[list[int], list[int]]:
    pages, out_p, out_o = case["pages"], [], []
    for r, f, c, d, u in zip(
        case["rows"], case["first"], case["counts"], case["div"], case["use_map"], strict=True
    ):
        for k in range(c):
            t = int(f) + k
            page = int(pages[r, t // d])
            if with_map and u:
                page = int(case["page_map"][page])
            out_p.append(page)
            out_o.append(t % int(d))
    return out_p, out_o


def run(case: dict[str, np.ndarray], impl: str, with_map: bool) -> tuple[list[int], list[int]]:
    t = {k: torch.from_numpy(v.copy()) for k, v in case.items()}
    total = int(case["counts"].sum())
    out_p = torch.full((total + 3,), -7, dtype=torch.int32)
    out_o = torch.full((total + 3,), -7, dtype=torch.int32)
    args = (
        t["pages"],
        t["rows"],
        t["first"],
        t["counts"],
        t["dst"],
        t["div"],
        t["use_map"],
        out_p,
        out_o,
    )
    page_map = t["page_map"] if with_map else None
    if impl == "torch":
        segments.segment_slots_torch(*args, total, page_map=page_map)
    else:
        segments.segment_slots(*args, page_map=page_map)
    assert out_p[total:].eq(-7).all() and out_o[total:].eq(-7).all()  # nothing past the end
    return out_p[:total].tolist(), out_o[:total].tolist()


@settings(max_examples=40, deadline=None)
@given(cases(), st.booleans())
def test_torch_twin_matches_brute_force(case: dict[str, np.ndarray], with_map: bool) -> None:
    assert run(case, "torch", with_map) == brute(case, with_map)


@pytest.mark.skipif(triton_mode() != "interpret", reason="needs Triton's interpreter (CPU)")
@settings(max_examples=25, deadline=None)
@given(cases(), st.booleans())
def test_triton_kernel_matches_brute_force(case: dict[str, np.ndarray], with_map: bool) -> None:
    assert run(case, "triton", with_map) == brute(case, with_map)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_kernel_on_gpu() -> None:
    rng = np.random.default_rng(0)
    pages = rng.integers(0, 500, (6, 300)).astype(np.int32)
    case = {
        "pages": pages,
        "rows": np.array([0, 5, 2, 3], dtype=np.int32),
        "first": np.array([0, 17, 4000, 5], dtype=np.int32),
        "counts": np.array([300, 2000, 700, 0], dtype=np.int32),
        "dst": np.array([0, 300, 2300, 3000], dtype=np.int32),
        "div": np.array([1, 16, 16, 1], dtype=np.int32),
        "use_map": np.array([1, 0, 1, 0], dtype=np.int32),
        "page_map": np.concatenate([rng.permutation(500), [-1]]).astype(np.int32),
    }
    t = {k: torch.from_numpy(v).cuda() for k, v in case.items()}
    out_p = torch.empty(3000, dtype=torch.int32, device="cuda")
    out_o = torch.empty(3000, dtype=torch.int32, device="cuda")
    segments.segment_slots(
        t["pages"],
        t["rows"],
        t["first"],
        t["counts"],
        t["dst"],
        t["div"],
        t["use_map"],
        out_p,
        out_o,
        page_map=t["page_map"],
    )
    want_p, want_o = brute(case, True)
    assert out_p.tolist() == want_p and out_o.tolist() == want_o
