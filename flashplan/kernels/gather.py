"""One launch for every page-table gather job of a batch.

A *gather job* ``s`` reads ``counts[s]`` consecutive entries ``first[s] + k`` of
page-table row ``rows[s]`` with a divisor ``div[s]``::

    out_page[dst[s] + k]   = pages[rows[s], (first[s] + k) // div[s]]
    out_offset[dst[s] + k] = (first[s] + k) % div[s]

With ``div = 1`` a job is a run of page-table columns (FlashInfer's ``kv_indices`` of
one request); with ``div = page_size`` it is a run of row tokens (their KV write
slots: page id and in-page offset). The executors put the gathers of every group and
the write slots of a step into one job table (:mod:`flashplan.executor.gathers`) and
launch :func:`gather_slots` once per batch: on the host a Triton launch costs tens of
microseconds, so one launch instead of one per job matters.

Jobs with ``use_map[s] != 0`` translate page ids through ``page_map`` (full-pool id ->
sliding-window-pool id; a negative entry marks a page the window pool has evicted).

A *fill job* (``rows[s] < 0``) reads no table: it writes page id ``first[s]`` and
in-page offset ``-1`` to each of its ``counts[s]`` outputs. CUDA-graph buckets use it
for padding requests: a valid dummy page to read, and no slot to write.

**Bad page ids** are never used: an id below 0, at or beyond ``num_pages`` (when
given), or mapped to a negative window-pool id is replaced by page 0 with in-page
offset ``-1`` — an in-bounds read that writers skip (:func:`flashplan.kernels.write_kv`
ignores slots with a negative offset) — and counted in ``status`` when given:
``status[0]`` += the number of bad entries, ``status[1]`` = min(itself, the first bad
job's index). Nothing is read back to the host.
"""

from __future__ import annotations

import torch

from flashplan.kernels._triton import HAS_TRITON, device_guard, runs_on_triton, tl, triton
from flashplan.torch_kernels import NO_BAD_JOB, gather_slots_torch
from flashplan.torch_kernels import check_gather_args as _check

__all__ = [
    "NO_BAD_JOB",
    "gather_slots",
    "gather_slots_torch",
    "launch_gather_jobs",
    "new_status",
]

_BLOCK = 1024


if HAS_TRITON:

    @triton.jit
    def gather_job(
        s,
        pages_ptr,
        pages_row_stride,
        pages_col_stride,
        jobs_ptr,
        num_jobs,
        out_page_ptr,
        out_offset_ptr,
        page_map_ptr,
        page_map_len,
        num_pages,
        status_ptr,
        HAS_MAP: tl.constexpr,
        HAS_STATUS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """Gather job ``s`` of the table (one program's work; see the module docstring).
        Also called by the fused launch (:mod:`flashplan.kernels.fused`)."""
        job = jobs_ptr + s  # column c of the [6, num_jobs] job table at job + c * num_jobs
        row = tl.load(job).to(tl.int64)
        first = tl.load(job + num_jobs).to(tl.int64)
        n = tl.load(job + 2 * num_jobs)
        dst = tl.load(job + 3 * num_jobs).to(tl.int64)
        div = tl.load(job + 4 * num_jobs).to(tl.int64)
        base = pages_ptr + tl.maximum(row, 0) * pages_row_stride
        for off in range(0, n, BLOCK):
            k = off + tl.arange(0, BLOCK)
            valid = k < n
            rows_k = k.to(tl.int64) * 0 + row  # per element: masks stay 1-D
            fill = rows_k < 0
            reads = rows_k >= 0
            t = first + k.to(tl.int64)
            col = t // div
            page = tl.load(base + col * pages_col_stride, mask=valid & reads, other=0)
            page = tl.where(fill, first, page)
            bad = (page < 0) & reads
            if num_pages > 0:
                bad = bad | ((page >= num_pages) & reads)
            if HAS_MAP:
                use = tl.load(job + 5 * num_jobs)
                if use != 0:
                    outside = (page >= page_map_len) & reads
                    bad = bad | outside
                    ok = valid & reads & (bad == 0)
                    mapped = tl.load(page_map_ptr + page, mask=ok, other=-1)
                    bad = bad | ((mapped < 0) & reads)
                    page = tl.where(reads, mapped, page)
            bad = bad & valid
            offset = tl.where(bad | fill, -1, t - col * div)
            page = tl.where(bad, 0, page)
            tl.store(out_page_ptr + dst + k, page, mask=valid)
            tl.store(out_offset_ptr + dst + k, offset, mask=valid)  # cast to out dtype
            if HAS_STATUS:  # bad ids are rare: one masked atomic per bad entry
                zero = k * 0
                tl.atomic_add(status_ptr + zero, zero + 1, mask=bad)
                tl.atomic_min(status_ptr + 1 + zero, zero + s, mask=bad)

    @triton.jit
    def _gather_slots_kernel(
        pages_ptr,
        pages_row_stride,
        pages_col_stride,
        jobs_ptr,
        num_jobs,
        out_page_ptr,
        out_offset_ptr,
        page_map_ptr,
        page_map_len,
        num_pages,
        status_ptr,
        HAS_MAP: tl.constexpr,
        HAS_STATUS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        gather_job(
            tl.program_id(0), pages_ptr, pages_row_stride, pages_col_stride, jobs_ptr,
            num_jobs, out_page_ptr, out_offset_ptr, page_map_ptr, page_map_len, num_pages,
            status_ptr, HAS_MAP=HAS_MAP, HAS_STATUS=HAS_STATUS, BLOCK=BLOCK,
        )  # fmt: skip


def new_status(device: torch.device | str) -> torch.Tensor:
    """A fresh ``status`` tensor for :func:`gather_slots`: int32 ``[2]`` = (0, NO_BAD_JOB)."""
    return torch.tensor([0, NO_BAD_JOB], dtype=torch.int32, device=device)


def gather_slots(
    pages: torch.Tensor,
    rows: torch.Tensor,
    first: torch.Tensor,
    counts: torch.Tensor,
    dst: torch.Tensor,
    div: torch.Tensor,
    use_map: torch.Tensor,
    out_page: torch.Tensor,
    out_offset: torch.Tensor,
    *,
    total: int,
    page_map: torch.Tensor | None = None,
    num_pages: int = 0,
    status: torch.Tensor | None = None,
) -> None:
    """Run every gather job (see module docstring) in one Triton launch; no host sync.

    Args:
        pages: int32 ``[num_rows, max_pages]`` page table (any strides).
        rows, first, counts, dst, div, use_map: int32 ``[num_jobs]``: table row, first
            entry (columns when ``div = 1``, row tokens otherwise), length, output
            offset, divisor (1 or page_size) and page-map flag.
        out_page, out_offset: int32 or int64 ``[>= max(dst + counts)]`` outputs; entries
            no job addresses are left untouched.
        total: host int, ``sum(counts)`` (the torch twin's output size; no sync).
        page_map: optional int32 ``[full pool]`` full -> window page-id map.
        num_pages: size of the page pool the table's ids point into (0 = unknown:
            only negative ids are caught).
        status: optional int32 ``[2]`` (:func:`new_status`) that counts bad ids.

    On CPU tensors the kernel runs under Triton's interpreter when enabled, else the
    torch twin runs.
    """
    jobs = (rows, first, counts, dst, div, use_map)
    n = _check(pages, jobs, out_page, out_offset, page_map, status)
    if n == 0 or total == 0:
        return
    if not runs_on_triton(pages.device, "gather_slots_torch"):
        gather_slots_torch(
            pages, *jobs, out_page, out_offset, total=total, page_map=page_map,
            num_pages=num_pages, status=status,
        )  # fmt: skip
        return
    launch_gather_jobs(
        pages, torch.stack(jobs), out_page, out_offset,
        page_map=page_map, num_pages=num_pages, status=status,
    )  # fmt: skip


def launch_gather_jobs(
    pages: torch.Tensor,
    jobs: torch.Tensor,
    out_page: torch.Tensor,
    out_offset: torch.Tensor,
    *,
    page_map: torch.Tensor | None,
    num_pages: int,
    status: torch.Tensor | None,
) -> None:
    """:func:`gather_slots`'s Triton launch for a job table staged as one tensor, with
    no argument checks: for callers that build every argument themselves (the
    executors, whose staging buffer holds the table), on the host's hot path.

    Args:
        pages: int32 ``[num_rows, max_pages]`` page table.
        jobs: int32 ``[6, num_jobs]``, rows contiguous and ``num_jobs`` apart (a view of
            one contiguous buffer): rows, first, counts, dst, div, use_map.
        out_page, out_offset, page_map, num_pages, status: as :func:`gather_slots`.
    """
    num_jobs = jobs.shape[1]
    if num_jobs == 0:
        return
    device = pages.device
    # Triton launches on the current device; enter a guard only when it is another one
    # (a guard costs more host time than the check).
    other = device.type == "cuda" and device.index != torch.cuda.current_device()
    guard = device_guard(device) if other else None
    if guard is not None:
        guard.__enter__()
    try:
        _gather_slots_kernel[(num_jobs,)](
            pages,
            pages.stride(0),
            pages.stride(1),
            jobs,
            num_jobs,
            out_page,
            out_offset,
            page_map if page_map is not None else out_page,
            page_map.shape[0] if page_map is not None else 0,
            num_pages,
            status if status is not None else out_page,
            HAS_MAP=page_map is not None,
            HAS_STATUS=status is not None,
            BLOCK=_BLOCK,
        )
    finally:
        if guard is not None:
            guard.__exit__(None, None, None)
