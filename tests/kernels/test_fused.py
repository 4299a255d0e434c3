"""`launch_gather_and_mask`: one launch == the gather launch + the mask launch.

Random job tables (fill jobs, bad ids, the window page map) and random threshold and
tree masks are laid out in one int32 staging tensor, as the executor stages them; the
fused launch must write exactly the bytes the two separate launchers write (those are
held to brute force in ``test_gather.py``), including the status counters and the bytes
it must leave alone. Runs under Triton's interpreter on CPU and compiled on CUDA.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashplan.kernels import build_custom_mask, gather_slots, new_status, triton_mode
from flashplan.kernels.fused import (
    StagedMask,
    _torch_twins,
    launch_gather_and_mask,
)


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda")
    if triton_mode() != "interpret":
        pytest.skip("needs Triton's interpreter (CPU) or CUDA")
    return torch.device("cpu")


def _case(seed: int, num_jobs: int, bs: int, n: int, with_map: bool) -> dict[str, object]:
    """Jobs over a small table and a mask (a tree of ``n`` tokens when ``n > 0``, a
    position mask when ``n < 0``, else a threshold mask), staged end to end."""
    rng = np.random.default_rng(seed)
    rows_t, max_pages, pool = 3, 7, 30
    pages = rng.integers(-1, pool + 2, (rows_t, max_pages)).astype(np.int32)
    div = rng.choice([1, 1, 2, 16], num_jobs)
    first = np.array([rng.integers(0, max_pages * d + 1) for d in div], dtype=np.int64)
    counts = np.array(
        [rng.integers(0, max_pages * d - f + 1) for d, f in zip(div, first, strict=True)],
        dtype=np.int64,
    )
    rows = rng.integers(0, rows_t, num_jobs)
    fill = rng.random(num_jobs) < 0.2
    rows = np.where(fill, -1, rows)
    first = np.where(fill, rng.integers(0, pool, num_jobs), first)
    dst = np.concatenate([[0], np.cumsum(counts)])[:-1]
    use_map = rng.integers(0, 2, num_jobs)
    table = np.stack([rows, first, counts, dst, div, use_map]).astype(np.int32)
    page_map = np.where(rng.random(pool) < 0.2, -1, rng.permutation(pool)).astype(np.int32)

    kv = rng.integers(max(n, 1), max(n, 1) + 40, bs)
    qo = np.full(bs, n) if n > 0 else rng.integers(0, 12, bs)
    first_visible = rng.integers(-6, 30, bs) if n >= 0 else rng.integers(0, 60, bs)
    n_bytes = (qo * kv + 7) // 8
    byte_offsets = np.cumsum(n_bytes + 2) - n_bytes  # gaps the launch must not touch
    arrays = [table.reshape(-1), first_visible, qo, kv, byte_offsets]
    if n < 0:  # a position mask: its rule, then its column positions
        rule = [rng.integers(0, 2), *rng.choice([-1, 0, 2, 9], 2), rng.choice([0, 4, 16])]
        arrays += [np.array(rule), np.maximum(first_visible + rng.integers(-20, 5, bs), 0)]
    elif n:
        row_offsets = rng.integers(0, 4, (bs, n)).reshape(-1)
        tail_start = kv - n
        bits = rng.random((bs, n, n)) < 0.5
        packed = np.packbits(bits, axis=2, bitorder="little").reshape(-1)  # rows packed
        words = np.zeros((packed.shape[0] + 3) // 4 * 4, np.uint8)
        words[: packed.shape[0]] = packed
        arrays += [row_offsets, tail_start, words.view(np.int32)]
    sizes = [a.shape[0] for a in arrays]
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    staged = np.concatenate([np.asarray(a, dtype=np.int32) for a in arrays])
    return {
        "pages": pages, "page_map": page_map if with_map else None, "num_pages": pool,
        "num_jobs": num_jobs, "total": int(counts.sum()), "staged": staged,
        "offsets": offsets, "bs": bs, "n": n,
        "max_bytes": int(n_bytes.max()) if bs else 0,
        "mask_size": int(byte_offsets[-1] + n_bytes[-1] + 3) if bs else 4,
    }  # fmt: skip


def _run(
    case: dict[str, object],
    fused: bool,
    dev: torch.device,
    twins: bool = False,
) -> tuple[torch.Tensor, ...]:
    pages = torch.from_numpy(case["pages"]).to(dev)  # type: ignore[arg-type]
    pm = case["page_map"]
    page_map = None if pm is None else torch.from_numpy(pm).to(dev)  # type: ignore[arg-type]
    staged = torch.from_numpy(case["staged"]).to(dev)  # type: ignore[arg-type]
    num_jobs, bs, n = case["num_jobs"], case["bs"], case["n"]
    assert isinstance(num_jobs, int) and isinstance(bs, int) and isinstance(n, int)
    total = case["total"]
    assert isinstance(total, int)
    out_page = torch.full((total + 5,), -7, dtype=torch.int32, device=dev)
    out_offset = out_page.clone()
    mask_out = torch.full((case["mask_size"],), 0xA5, dtype=torch.uint8, device=dev)  # type: ignore[call-overload]
    status = new_status(dev)
    off = [int(x) for x in case["offsets"]]  # type: ignore[attr-defined]
    jobs = staged[: 6 * num_jobs].view(6, num_jobs)
    max_bytes = case["max_bytes"]
    assert isinstance(max_bytes, int)
    if fused:
        more = (off[5], off[6], off[7]) if n > 0 else (off[5], off[6], 0) if n < 0 else (0, 0, 0)
        mask = StagedMask(
            staged, off[1], off[2], off[3], off[4], *more, bs, max(n, 0), max_bytes, mask_out,
            n < 0,
        )  # fmt: skip
        if twins:
            num_pages = case["num_pages"]
            assert isinstance(num_pages, int)
            _torch_twins(pages, jobs, out_page, out_offset, page_map, num_pages, status, mask)
        else:
            launch_gather_and_mask(
                pages, jobs, out_page, out_offset, page_map=page_map,
                num_pages=case["num_pages"], status=status, mask=mask,  # type: ignore[arg-type]
            )  # fmt: skip
    else:
        gather_slots(
            pages, *jobs, out_page, out_offset, total=total, page_map=page_map,
            num_pages=case["num_pages"], status=status,  # type: ignore[arg-type]
        )  # fmt: skip
        v = [staged[off[k] : off[k + 1]] for k in range(len(off) - 1)]
        row_bytes = n * ((n + 7) // 8)
        tree_args = (v[5], v[6], v[7].view(torch.uint8)[: bs * row_bytes]) if n > 0 and bs else None
        position = (v[6], v[5]) if n < 0 else None
        build_custom_mask(
            v[1], v[2], v[3], v[4], mask_out, max_bytes, tree=tree_args, num_tokens=max(n, 0),
            position=position,
        )  # fmt: skip
    return out_page.cpu(), out_offset.cpu(), mask_out.cpu(), status.cpu()


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    num_jobs=st.integers(0, 6),
    bs=st.integers(0, 4),
    n=st.sampled_from([0, 0, 1, 3, 9, -1, -1]),
    with_map=st.booleans(),
)
def test_fused_launch_equals_the_two_launches(
    seed: int, num_jobs: int, bs: int, n: int, with_map: bool
) -> None:
    dev = _device()
    case = _case(seed, num_jobs, bs, n, with_map)
    want = _run(case, False, dev)
    got = _run(case, True, dev)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_fused_launch_without_a_mask_gathers_only() -> None:
    dev = _device()
    case = _case(3, 5, 0, 0, True)
    pages = torch.from_numpy(case["pages"]).to(dev)  # type: ignore[arg-type]
    staged = torch.from_numpy(case["staged"]).to(dev)  # type: ignore[arg-type]
    total = case["total"]
    assert isinstance(total, int)
    outs = [torch.full((total + 2,), -7, dtype=torch.int32, device=dev) for _ in range(4)]
    args = dict(page_map=None, num_pages=30, status=None)
    launch_gather_and_mask(pages, staged[:30].view(6, 5), outs[0], outs[1], mask=None, **args)  # type: ignore[arg-type]
    gather_slots(pages, *staged[:30].view(6, 5), outs[2], outs[3], total=total, num_pages=30)
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3])


def test_torch_twins_path_matches() -> None:
    """CPU tensors without the interpreter take the torch twins; they agree too."""
    if triton_mode() != "interpret":
        pytest.skip("compares the twins with the interpreted kernels")
    case = _case(11, 4, 3, 3, True)
    want = _run(case, False, torch.device("cpu"))
    got = _run(case, True, torch.device("cpu"), twins=True)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
