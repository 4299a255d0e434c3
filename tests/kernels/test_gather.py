"""`gather_slots` and `write_kv`: one launch each, vs brute force (torch twin and Triton).

Page tables hold bad ids on purpose (negative, beyond the pool, evicted from the window
pool) and job tables hold fill jobs: a bad id must come out as page 0 / offset -1 and be
counted, a fill job as its constant page / offset -1, and nothing may be written past
the jobs' outputs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashplan.kernels import (
    NO_BAD_JOB,
    gather_slots,
    gather_slots_torch,
    new_status,
    triton_mode,
    write_kv,
    write_kv_torch,
)

INTERPRET = pytest.mark.skipif(
    triton_mode() != "interpret", reason="needs Triton's interpreter (CPU)"
)


@st.composite
def cases(draw: st.DrawFn) -> dict[str, object]:
    num_rows = draw(st.integers(1, 4))
    max_pages = draw(st.integers(1, 9))
    pool = draw(st.integers(1, 40))
    ids = st.one_of(st.integers(0, pool - 1), st.sampled_from([-1, pool, pool + 5]))
    pages = np.array(
        draw(st.lists(ids, min_size=num_rows * max_pages, max_size=num_rows * max_pages)),
        dtype=np.int32,
    ).reshape(num_rows, max_pages)
    n = draw(st.integers(0, 6))
    rows, first, counts, div, use_map = [], [], [], [], []
    for _ in range(n):
        d = draw(st.sampled_from([1, 1, 2, 3, 16]))
        capacity = max_pages * d
        f = draw(st.integers(0, capacity))
        c = draw(st.integers(0, capacity - f))
        fill = draw(st.integers(0, 4)) == 0
        rows.append(-1 if fill else draw(st.integers(0, num_rows - 1)))
        first.append(draw(st.integers(0, pool - 1)) if fill else f)
        counts.append(c)
        div.append(d)
        use_map.append(draw(st.integers(0, 1)))
    counts_a = np.array(counts, dtype=np.int32)
    dst = np.concatenate([[0], np.cumsum(counts_a)])[:-1].astype(np.int32) if n else counts_a
    evicted = draw(st.lists(st.booleans(), min_size=pool, max_size=pool))
    perm = np.array(draw(st.permutations(list(range(pool)))), dtype=np.int32)
    page_map = np.where(evicted, -1, perm).astype(np.int32)
    return {
        "pages": pages,
        "rows": np.array(rows, dtype=np.int32),
        "first": np.array(first, dtype=np.int32),
        "counts": counts_a,
        "dst": dst,
        "div": np.array(div, dtype=np.int32),
        "use_map": np.array(use_map, dtype=np.int32),
        "page_map": page_map,
        "num_pages": draw(st.sampled_from([0, pool])),
    }


def brute(case: dict[str, object], with_map: bool) -> tuple[list[int], list[int], int, int]:
    """(pages, offsets, number of bad ids, first bad job) by the documented rules."""
    pages = case["pages"]
    page_map = case["page_map"]
    num_pages = int(case["num_pages"])  # type: ignore[call-overload]
    out_p: list[int] = []
    out_o: list[int] = []
    n_bad, first_bad = 0, NO_BAD_JOB
    jobs = zip(
        case["rows"], case["first"], case["counts"], case["div"], case["use_map"],  # type: ignore[call-overload]
        strict=True,
    )  # fmt: skip
    for s, (r, f, c, d, u) in enumerate(jobs):
        for k in range(int(c)):
            if r < 0:  # a fill job
                out_p.append(int(f))
                out_o.append(-1)
                continue
            t = int(f) + k
            page = int(pages[r, t // d])  # type: ignore[index]
            bad = page < 0 or (num_pages > 0 and page >= num_pages)
            if with_map and u and not bad:
                bad = page >= len(page_map) or int(page_map[page]) < 0  # type: ignore[index, arg-type]
                page = -1 if bad else int(page_map[page])  # type: ignore[index]
            if bad:
                n_bad += 1
                first_bad = min(first_bad, s)
                out_p.append(0)
                out_o.append(-1)
            else:
                out_p.append(page)
                out_o.append(t % int(d))
    return out_p, out_o, n_bad, first_bad


def run(
    case: dict[str, object], impl: str, with_map: bool, device: str = "cpu"
) -> tuple[list[int], list[int], int, int]:
    t = {
        k: torch.from_numpy(v.copy()).to(device)
        for k, v in case.items()
        if isinstance(v, np.ndarray)
    }
    total = int(case["counts"].sum())  # type: ignore[attr-defined]
    out_p = torch.full((total + 3,), -7, dtype=torch.int32, device=device)
    out_o = torch.full((total + 3,), -7, dtype=torch.int32, device=device)
    status = new_status(device)
    cols = (t["rows"], t["first"], t["counts"], t["dst"], t["div"], t["use_map"])
    fn = gather_slots_torch if impl == "torch" else gather_slots
    fn(
        t["pages"], *cols, out_p, out_o, total=total,
        page_map=t["page_map"] if with_map else None,
        num_pages=int(case["num_pages"]),  # type: ignore[call-overload]
        status=status,
    )  # fmt: skip
    assert out_p[total:].eq(-7).all() and out_o[total:].eq(-7).all()  # nothing past the end
    n_bad, first_bad = status.tolist()
    return out_p[:total].tolist(), out_o[:total].tolist(), n_bad, first_bad


@settings(max_examples=60, deadline=None)
@given(cases(), st.booleans())
def test_torch_twin_matches_brute_force(case: dict[str, object], with_map: bool) -> None:
    assert run(case, "torch", with_map) == brute(case, with_map)


@INTERPRET
@settings(max_examples=25, deadline=None)
@given(cases(), st.booleans())
def test_triton_kernel_matches_brute_force(case: dict[str, object], with_map: bool) -> None:
    assert run(case, "triton", with_map) == brute(case, with_map)


def test_no_status_no_count() -> None:
    pages = torch.tensor([[3, -1, 2]], dtype=torch.int32)
    out_p = torch.empty(3, dtype=torch.int32)
    out_o = torch.empty(3, dtype=torch.int32)
    one = torch.ones(1, dtype=torch.int32)
    zero = torch.zeros(1, dtype=torch.int32)
    gather_slots(pages, zero, zero, one * 3, zero, one, zero, out_p, out_o, total=3)
    assert out_p.tolist() == [3, 0, 2] and out_o.tolist() == [0, -1, 0]


# --------------------------------------------------------------------------- write_kv
@st.composite
def writes(draw: st.DrawFn) -> tuple[torch.Tensor, ...]:
    pool, ps, h, d = draw(st.integers(1, 6)), draw(st.sampled_from([1, 2, 16])), 2, 3
    n = draw(st.integers(0, 10))
    slots = draw(st.lists(st.tuples(st.integers(0, pool - 1), st.integers(0, ps - 1)),
                          min_size=n, max_size=n, unique=True))  # fmt: skip
    page = torch.tensor([p for p, _ in slots], dtype=torch.int32)
    offset = torch.tensor([o for _, o in slots], dtype=torch.int32)
    skip = torch.tensor(draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=torch.bool)
    outside = torch.tensor(draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=torch.bool)
    offset = torch.where(skip, -1, offset)
    page = torch.where(outside & ~skip, pool + 2, page)
    cache = torch.randn(pool, 2, ps, h, d)
    k, v = torch.randn(n, h, d), torch.randn(n, h, d)
    return cache, k, v, page.reshape(n), offset.reshape(n)


def _write_brute(cache, k, v, page, offset):  # type: ignore[no-untyped-def]
    want = cache.clone()
    outside = 0
    for i in range(k.shape[0]):
        p, o = int(page[i]), int(offset[i])
        if o < 0:
            continue
        if p >= cache.shape[0]:
            outside += 1
            continue
        want[p, 0, o], want[p, 1, o] = k[i], v[i]
    return want, outside


@settings(max_examples=40, deadline=None)
@given(writes(), st.sampled_from(["torch", "triton"]))
def test_write_kv_matches_brute_force(case: tuple[torch.Tensor, ...], impl: str) -> None:
    if impl == "triton" and triton_mode() != "interpret":
        pytest.skip("needs Triton's interpreter (CPU)")
    cache, k, v, page, offset = case
    want, outside = _write_brute(cache, k, v, page, offset)
    status = new_status("cpu")
    (write_kv_torch if impl == "torch" else write_kv)(cache, k, v, page, offset, status=status)
    assert torch.equal(cache, want)
    assert int(status[0]) == outside


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernels_on_gpu() -> None:
    rng = np.random.default_rng(0)
    pages = rng.integers(-2, 520, (6, 300)).astype(np.int32)
    case: dict[str, object] = {
        "pages": pages,
        "rows": np.array([0, 5, 2, 3, -1], dtype=np.int32),
        "first": np.array([0, 17, 4000, 5, 9], dtype=np.int32),
        "counts": np.array([300, 2000, 700, 0, 40], dtype=np.int32),
        "dst": np.array([0, 300, 2300, 3000, 3000], dtype=np.int32),
        "div": np.array([1, 16, 16, 1, 1], dtype=np.int32),
        "use_map": np.array([1, 0, 1, 0, 0], dtype=np.int32),
        "page_map": np.where(rng.random(500) < 0.1, -1, rng.permutation(500)).astype(np.int32),
        "num_pages": 500,
    }
    assert run(case, "triton", True, "cuda") == brute(case, True)
    cache = torch.randn(8, 2, 16, 4, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(5, 4, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(5, 4, 64, device="cuda", dtype=torch.bfloat16)
    page = torch.tensor([0, 7, 3, 9, 2], dtype=torch.int32, device="cuda")
    offset = torch.tensor([0, 15, -1, 4, 8], dtype=torch.int32, device="cuda")
    want, outside = _write_brute(cache.cpu(), k.cpu(), v.cpu(), page.cpu(), offset.cpu())
    status = new_status("cuda")
    write_kv(cache, k, v, page, offset, status=status)
    assert torch.equal(cache.cpu(), want) and int(status[0]) == outside == 1


# --------------------------------------------------------------------------- threshold masks
def _threshold_firsts(q: int, k: int) -> st.SearchStrategy[int]:
    """First visible columns: negative (to below -q), zero, positive, beyond kv_len."""
    return st.one_of(
        st.integers(-q - 3, k + q + 3),
        st.sampled_from([-q - 1, -q, -1, 0, 1, k - 1, k, k + 1, k + q, -(2**31), 2**31 - 1]),
    )


def _shuffled_offsets(draw: st.DrawFn, n_bytes: list[int]) -> tuple[list[int], int]:
    """Each request's first byte, the requests laid out in a shuffled order with 0..3
    spare bytes before and between them; and the end of the last one's gap."""
    order = draw(st.permutations(range(len(n_bytes))))
    offsets, at = [0] * len(n_bytes), draw(st.integers(0, 3))
    for index in order:
        offsets[index] = at
        at += n_bytes[index] + draw(st.integers(0, 3))
    return offsets, at


@st.composite
def threshold_cases(draw: st.DrawFn) -> dict[str, object]:
    """Requests of 0..20 rows x 0..40 columns (kv < 8: the per-bit path, 8+: the
    closed form) placed in a shuffled order with gaps, int32 or int64 arrays, an
    optional kernel block (several programs per request) and spare grid blocks."""
    bs = draw(st.integers(0, 6))
    qo = draw(st.lists(st.integers(0, 20), min_size=bs, max_size=bs))
    kv = draw(st.lists(st.one_of(st.integers(0, 8), st.integers(9, 40)), min_size=bs, max_size=bs))
    first = [draw(_threshold_firsts(q, k)) for q, k in zip(qo, kv, strict=True)]
    n_bytes = [(q * k + 7) // 8 for q, k in zip(qo, kv, strict=True)]
    offsets, at = _shuffled_offsets(draw, n_bytes)
    dtypes = draw(st.lists(st.sampled_from([torch.int32, torch.int64]), min_size=4, max_size=4))
    arrays = tuple(
        torch.tensor(x, dtype=d) for x, d in zip((first, qo, kv, offsets), dtypes, strict=True)
    )
    return {
        "arrays": arrays,
        "size": at + 2,
        "max_bytes": max(n_bytes, default=0) + draw(st.sampled_from([0, 0, 1, 9])),
        "block": draw(st.sampled_from([None, None, 8, 32])),
    }


@settings(max_examples=50, deadline=None)
@given(threshold_cases())
def test_threshold_mask_kernel_matches_torch_twin(case: dict[str, object]) -> None:
    """Byte for byte vs the torch twin; bytes outside the requests keep their 0xA5."""
    if triton_mode() != "interpret":
        pytest.skip("needs Triton's interpreter (CPU)")
    from unittest import mock

    import flashplan.kernels.custom_mask as custom_mask
    from flashplan.kernels import build_custom_mask, build_custom_mask_torch

    arrays = case["arrays"]
    assert isinstance(arrays, tuple) and isinstance(case["size"], int)
    assert isinstance(case["max_bytes"], int)
    want = torch.full((case["size"],), 0xA5, dtype=torch.uint8)
    got = want.clone()
    build_custom_mask_torch(*arrays, want)
    block = case["block"] or custom_mask._BLOCK
    with mock.patch.object(custom_mask, "_BLOCK", block):
        build_custom_mask(*arrays, got, case["max_bytes"])
    assert torch.equal(got, want)


def test_threshold_mask_kernel_row_boundaries() -> None:
    """Every column offset of a byte against a row end (kv 1..17 around 8), one
    request spanning several kernel blocks, offsets not byte-aligned to anything."""
    if triton_mode() != "interpret":
        pytest.skip("needs Triton's interpreter (CPU)")
    import flashplan.kernels.custom_mask as custom_mask
    from flashplan.kernels import build_custom_mask, build_custom_mask_torch

    shapes = [(q, k, f) for k in range(1, 18) for q, f in ((3, -1), (5, k // 2 - 2))]
    shapes.append((custom_mask._BLOCK // 4 + 3, 37, 5))  # > 1 block of bytes
    qo, kv, first = (torch.tensor(c, dtype=torch.int32) for c in zip(*shapes, strict=True))
    n_bytes = (qo.long() * kv.long() + 7) // 8
    offsets = (torch.cumsum(n_bytes + 1, 0) - n_bytes).to(torch.int32)
    want = torch.full((int(n_bytes.sum()) + len(shapes) + 3,), 0xA5, dtype=torch.uint8)
    got = want.clone()
    build_custom_mask_torch(first, qo, kv, offsets, want)
    build_custom_mask(first, qo, kv, offsets, got, int(n_bytes.max()))
    assert torch.equal(got, want)


@settings(max_examples=25, deadline=None)
@given(
    bs=st.integers(0, 4),
    n=st.integers(1, 12),
    prefix=st.integers(0, 20),
    seed=st.integers(0, 2**31 - 1),
)
def test_tree_mask_kernel_matches_torch_twin(bs: int, n: int, prefix: int, seed: int) -> None:
    if triton_mode() != "interpret":
        pytest.skip("needs Triton's interpreter (CPU)")
    from flashplan.kernels import build_custom_mask, build_custom_mask_torch

    rng = np.random.default_rng(seed)
    kv = rng.integers(n, n + prefix + 1, bs)
    tail = kv - n
    first = rng.integers(-5, 10, bs)
    offsets = rng.integers(0, 4, (bs, n))
    bits = rng.random((bs, n, n)) < 0.5
    n_bytes = (n * kv + 7) // 8
    starts = np.concatenate([[0], np.cumsum(n_bytes)])[:-1].astype(np.int32)
    size = int(n_bytes.sum()) + 3

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))

    words = np.packbits(bits, axis=2, bitorder="little").reshape(-1)
    tree = (t(offsets.reshape(-1)), t(tail), torch.from_numpy(words))
    args = (t(first), t(np.full(bs, n)), t(kv), t(starts))
    want = torch.full((size,), 0xA5, dtype=torch.uint8)
    got = want.clone()
    build_custom_mask_torch(*args, want, tree=tree, num_tokens=n)
    build_custom_mask(*args, got, int(n_bytes.max()) if bs else 0, tree=tree, num_tokens=n)
    assert torch.equal(got, want)


# --------------------------------------------------------------------------- position masks
@st.composite
def position_cases(draw: st.DrawFn) -> dict[str, object]:
    """Requests of 0..20 rows x 0..40 columns at any row and column positions (columns
    before, around and after the rows), any rule: causal or not, left and right bounds
    (0, small, none), chunks (none, 1, small, larger than the rows); shuffled byte
    offsets with gaps the kernel must leave alone."""
    bs = draw(st.integers(0, 5))
    qo = draw(st.lists(st.integers(0, 20), min_size=bs, max_size=bs))
    kv = draw(st.lists(st.one_of(st.integers(0, 8), st.integers(9, 40)), min_size=bs, max_size=bs))
    row = draw(st.lists(st.integers(0, 200), min_size=bs, max_size=bs))
    col = [max(r + draw(st.integers(-45, 10)), 0) for r in row]
    bounds = st.sampled_from([-1, -1, 0, 1, 3, 7, 2**31 - 1])
    rule = (
        draw(st.booleans()),
        draw(bounds),
        draw(bounds),
        draw(st.sampled_from([0, 0, 1, 3, 6, 16, 64])),
    )
    n_bytes = [(q * k + 7) // 8 for q, k in zip(qo, kv, strict=True)]
    offsets, at = _shuffled_offsets(draw, n_bytes)
    dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    return {
        "lists": (qo, kv, row, col, rule),
        "arrays": tuple(torch.tensor(x, dtype=dtype) for x in (row, qo, kv, offsets)),
        "position": (torch.tensor(col, dtype=dtype), torch.tensor(rule, dtype=torch.int32)),
        "offsets": offsets,
        "size": at + 2,
        "max_bytes": max(n_bytes, default=0) + draw(st.sampled_from([0, 0, 1, 9])),
    }


def _position_dense(case: dict[str, object], request: int) -> np.ndarray:
    """Request ``request``'s mask straight from its rule (brute force over positions)."""
    qo, kv, row, col, (causal, left, right, chunk) = case["lists"]  # type: ignore[misc]
    p = row[request] + np.arange(qo[request])[:, None]
    k = col[request] + np.arange(kv[request])[None, :]
    seen = np.ones((qo[request], kv[request]), dtype=bool)
    if causal:
        seen &= k <= p
    if left >= 0:
        seen &= p - k <= left
    if right >= 0:
        seen &= k - p <= right
    if chunk:
        seen &= p // chunk == k // chunk
    return seen


@settings(max_examples=60, deadline=None)
@given(position_cases())
def test_position_mask_twin_matches_brute_force(case: dict[str, object]) -> None:
    """The torch twin writes each request's rule at its byte offset, bits little-endian,
    and leaves every other byte alone; the planner's PositionMask states the same bits."""
    from flashplan.kernels import build_custom_mask_torch
    from flashplan.planning.masks import PositionMask

    out = torch.full((case["size"],), 0xA5, dtype=torch.uint8)  # type: ignore[call-overload]
    build_custom_mask_torch(*case["arrays"], out, position=case["position"])  # type: ignore[misc]
    got = out.numpy()
    qo, kv, row, col, (causal, left, right, chunk) = case["lists"]  # type: ignore[misc]
    ints = (np.array(x, dtype=np.int64) for x in (qo, kv, row, col))
    mask = PositionMask.from_arrays(
        *ints, causal=causal, window_left=left, window_right=right, chunk=chunk
    )
    touched = np.zeros(got.shape[0], dtype=bool)
    for i, off in enumerate(case["offsets"]):  # type: ignore[arg-type]
        n = qo[i] * kv[i]
        want = _position_dense(case, i)
        np.testing.assert_array_equal(mask.dense(i), want)
        bits = np.unpackbits(got[off : off + (n + 7) // 8], bitorder="little")[:n]
        np.testing.assert_array_equal(bits.reshape(want.shape).astype(bool), want)
        touched[off : off + (n + 7) // 8] = True
    assert (got[~touched] == 0xA5).all()


@INTERPRET
@settings(max_examples=40, deadline=None)
@given(position_cases())
def test_position_mask_kernel_matches_torch_twin(case: dict[str, object]) -> None:
    """Byte for byte vs the torch twin (Triton's interpreter), one launch per case."""
    from flashplan.kernels import build_custom_mask, build_custom_mask_torch

    want = torch.full((case["size"],), 0xA5, dtype=torch.uint8)  # type: ignore[call-overload]
    got = want.clone()
    build_custom_mask_torch(*case["arrays"], want, position=case["position"])  # type: ignore[misc]
    build_custom_mask(*case["arrays"], got, case["max_bytes"], position=case["position"])  # type: ignore[misc]
    assert torch.equal(got, want)


def test_position_mask_refuses_a_tree_and_bad_rules() -> None:
    from flashplan.errors import FlashplanError
    from flashplan.kernels import build_custom_mask_torch

    one = torch.ones(1, dtype=torch.int32)
    out = torch.zeros(4, dtype=torch.uint8)
    with pytest.raises(FlashplanError) as err:  # a rule of 3 entries
        build_custom_mask_torch(one, one, one, one * 0, out, position=(one, one.repeat(3)))
    assert err.value.field == "rule"
    with pytest.raises(FlashplanError) as err:  # a float column position
        build_custom_mask_torch(one, one, one, one * 0, out, position=(one.float(), one.repeat(4)))
    assert err.value.field == "col_position"
    with pytest.raises(FlashplanError) as err:
        tree = (one, one, torch.zeros(1, dtype=torch.uint8))
        build_custom_mask_torch(
            one, one, one, one * 0, out, tree=tree, num_tokens=1, position=(one, one.repeat(4))
        )
    assert err.value.field == "position"
