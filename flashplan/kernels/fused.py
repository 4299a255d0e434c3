"""A batch's page-table gathers and one custom mask in a single launch.

On the host a Triton launch costs tens of microseconds (its Python launcher binds and
specializes every argument), several times what the kernels themselves take for a
speculative verify or a windowed extend. :func:`launch_gather_and_mask` runs the
programs of :func:`~flashplan.kernels.gather_slots` (one per gather job) and of
:func:`~flashplan.kernels.build_custom_mask` (one per block of a request's mask bytes)
as one grid: program ``p < num_jobs`` is gather job ``p``, the rest are mask blocks.
Both bodies are the very jit functions the separate kernels run, so the results are the
same bytes.

The mask's per-request arrays are given as offsets into one int32 staging tensor (the
executors' staging buffer holds them), so the launch binds three tensors for them
instead of seven views.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from flashplan.kernels._triton import HAS_TRITON, device_guard, runs_on_triton, tl, triton
from flashplan.kernels.custom_mask import (
    MASK_POSITION,
    MASK_THRESHOLD,
    MASK_TREE,
    build_custom_mask,
    build_custom_mask_torch,
)
from flashplan.kernels.gather import gather_slots_torch

__all__ = ["StagedMask", "launch_gather_and_mask"]

_GATHER_BLOCK = 1024
_MASK_BLOCK = 2048


class StagedMask(NamedTuple):
    """A custom mask whose inputs lie in an int32 staging tensor.

    Offsets count int32 entries of ``staged``; each array has one entry per request
    (``row_offsets``: ``batch_size * num_tokens``; ``tail_words``: the tree's
    ``batch_size * N * ceil(N / 8)`` bytes of packed rows, four to an entry), as the
    arguments of :func:`~flashplan.kernels.build_custom_mask`.

    Attributes:
        staged: int32 1-D tensor holding the arrays.
        first_visible, qo_lens, kv_lens, byte_offsets: offsets of the int32 ``[bs]``
            threshold base (columns; a position mask's row positions), rows, columns
            (tokens) and output byte offsets.
        row_offsets, tail_start, tail_words: offsets of a tree mask's arrays (ignored
            for a threshold mask); a position mask's rule (four int32) is at
            ``row_offsets`` and its column positions (int32 ``[bs]``) at ``tail_start``.
        batch_size: requests.
        num_tokens: ``N`` of a tree mask, 0 otherwise.
        max_bytes: the largest ``ceil(qo_len * kv_len / 8)`` (sizes the grid).
        out: uint8 1-D output tensor (bytes outside the requests' ranges untouched).
        position: a position mask (:data:`~flashplan.kernels.custom_mask.MASK_POSITION`).
    """

    staged: torch.Tensor
    first_visible: int
    qo_lens: int
    kv_lens: int
    byte_offsets: int
    row_offsets: int
    tail_start: int
    tail_words: int
    batch_size: int
    num_tokens: int
    max_bytes: int
    out: torch.Tensor
    position: bool = False

    @property
    def kind(self) -> int:
        """The mask kernel's ``KIND``: threshold, tree or position."""
        if self.position:
            return MASK_POSITION
        return MASK_TREE if self.num_tokens else MASK_THRESHOLD

    def view(self, offset: int, size: int) -> torch.Tensor:
        """``size`` int32 entries of ``staged`` from ``offset``."""
        return self.staged[offset : offset + size]

    def build(self, *, twin: bool = False) -> None:
        """Build the mask alone: :func:`~flashplan.kernels.build_custom_mask` (its own
        launch) on views of ``staged``, or its torch twin with ``twin``."""
        bs, n = self.batch_size, self.num_tokens
        tree = position = None
        if self.position:
            position = (self.view(self.tail_start, bs), self.view(self.row_offsets, 4))
        elif n:
            start = 4 * self.tail_words  # bytes: four to an int32 entry
            tree = (
                self.view(self.row_offsets, bs * n),
                self.view(self.tail_start, bs),
                self.staged.view(torch.uint8)[start : start + bs * n * ((n + 7) // 8)],
            )
        arrays = (
            self.view(self.first_visible, bs),
            self.view(self.qo_lens, bs),
            self.view(self.kv_lens, bs),
            self.view(self.byte_offsets, bs),
            self.out,
        )
        if twin:
            build_custom_mask_torch(*arrays, tree=tree, num_tokens=n, position=position)
        else:
            build_custom_mask(*arrays, self.max_bytes, tree=tree, num_tokens=n, position=position)


if HAS_TRITON:
    from flashplan.kernels.custom_mask import mask_block
    from flashplan.kernels.gather import gather_job

    # Nothing is specialized on values or alignment, so that a compiled variant depends
    # only on the constexprs and dtypes (DirectLaunch keys): the kernel's loads and
    # stores are scattered or masked per element, which alignment hints do not speed up.
    @triton.jit(
        do_not_specialize=[
            "pages_row_stride", "pages_col_stride", "num_jobs", "page_map_len", "num_pages",
            "fv_off", "qo_off", "kv_off", "bo_off", "ro_off", "ts_off", "tb_off",
            "mask_blocks", "N",
        ],
        do_not_specialize_on_alignment=[
            "pages_ptr", "jobs_ptr", "out_page_ptr", "out_offset_ptr", "page_map_ptr",
            "status_ptr", "staged_ptr", "mask_out_ptr",
        ],
    )  # fmt: skip
    def _gather_and_mask_kernel(
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
        staged_ptr,
        fv_off,
        qo_off,
        kv_off,
        bo_off,
        ro_off,
        ts_off,
        tb_off,
        mask_out_ptr,
        mask_blocks,
        N,
        HAS_MAP: tl.constexpr,
        HAS_STATUS: tl.constexpr,
        HAS_MASK: tl.constexpr,
        KIND: tl.constexpr,
        GATHER_BLOCK: tl.constexpr,
        MASK_BLOCK: tl.constexpr,
    ):
        p = tl.program_id(0)
        if p < num_jobs:
            gather_job(
                p, pages_ptr, pages_row_stride, pages_col_stride, jobs_ptr, num_jobs,
                out_page_ptr, out_offset_ptr, page_map_ptr, page_map_len, num_pages,
                status_ptr, HAS_MAP=HAS_MAP, HAS_STATUS=HAS_STATUS, BLOCK=GATHER_BLOCK,
            )  # fmt: skip
        elif HAS_MASK:
            m = p - num_jobs
            i = m // mask_blocks
            # the tree's packed rows are bytes of the int32 staging data (four to an entry)
            staged_bytes = staged_ptr.to(tl.pointer_type(tl.uint8), bitcast=True)
            mask_block(
                i, m - i * mask_blocks, staged_ptr + fv_off, staged_ptr + qo_off,
                staged_ptr + kv_off, staged_ptr + bo_off, mask_out_ptr, staged_ptr + ro_off,
                staged_ptr + ts_off, staged_bytes + 4 * tb_off.to(tl.int64), N, KIND=KIND,
                BLOCK=MASK_BLOCK,
            )  # fmt: skip


def launch_gather_and_mask(
    pages: torch.Tensor,
    jobs: torch.Tensor,
    out_page: torch.Tensor,
    out_offset: torch.Tensor,
    *,
    page_map: torch.Tensor | None,
    num_pages: int,
    status: torch.Tensor | None,
    mask: StagedMask | None,
) -> None:
    """Run every gather job and build ``mask`` in one launch; no host sync, no checks.

    For callers that build every argument themselves (the executors, on the host's hot
    path), like :func:`~flashplan.kernels.gather.launch_gather_jobs`.

    Args:
        pages: int32 ``[num_rows, max_pages]`` page table.
        jobs: int32 ``[6, num_jobs]`` job table, rows contiguous and ``num_jobs`` apart
            (:func:`~flashplan.kernels.gather_slots`' columns).
        out_page, out_offset: int32 / int64 1-D outputs of the gather.
        page_map, num_pages, status: as :func:`~flashplan.kernels.gather_slots`.
        mask: the mask to build (:class:`StagedMask`), or ``None`` (gathers only).

    On CPU tensors the kernel runs under Triton's interpreter when enabled, else the
    torch twins run one after the other.
    """
    num_jobs = jobs.shape[1]
    mask_blocks = 0
    if mask is not None and mask.batch_size and mask.max_bytes > 0:
        mask_blocks = -(-mask.max_bytes // _MASK_BLOCK)
    else:
        mask = None
    if num_jobs == 0 and mask is None:
        return
    device = pages.device
    if not runs_on_triton(device, "gather_slots_torch"):
        _torch_twins(pages, jobs, out_page, out_offset, page_map, num_pages, status, mask)
        return
    programs = num_jobs + (mask.batch_size * mask_blocks if mask is not None else 0)
    args, _, _ = _kernel_arguments(
        pages, jobs, out_page, out_offset, page_map, num_pages, status, mask, mask_blocks
    )
    other = device.type == "cuda" and device.index != torch.cuda.current_device()
    guard = device_guard(device) if other else None
    if guard is not None:
        guard.__enter__()
    try:
        _gather_and_mask_kernel[(programs,)](*args)
    finally:
        if guard is not None:
            guard.__exit__(None, None, None)


def _kernel_arguments(
    pages: torch.Tensor,
    jobs: torch.Tensor,
    out_page: torch.Tensor,
    out_offset: torch.Tensor,
    page_map: torch.Tensor | None,
    num_pages: int,
    status: torch.Tensor | None,
    mask: StagedMask | None,
    mask_blocks: int,
) -> tuple[tuple[object, ...], tuple[object, ...], tuple[int, ...]]:
    """The fused kernel's arguments in order (``num_pages`` at index 9, the mask's
    staging tensor at 11, its output at 19, ``mask_blocks`` at 20), the variant key a
    :class:`DirectLaunch` files them under, and every int argument (to check against
    int32). Absent optional tensors are stood in for by ``out_page`` (never read)."""
    num_jobs = jobs.shape[1]
    if mask is not None:
        kind = mask.kind
        more = (0, 0, 0)
        if kind == MASK_TREE:
            more = (mask.row_offsets, mask.tail_start, mask.tail_words)
        elif kind == MASK_POSITION:  # the rule and the column positions
            more = (mask.row_offsets, mask.tail_start, 0)
        offsets: tuple[int, ...] = (
            mask.first_visible, mask.qo_lens, mask.kv_lens, mask.byte_offsets, *more
        )  # fmt: skip
        staged, mask_out, n = mask.staged, mask.out, mask.num_tokens
    else:
        kind, offsets = MASK_THRESHOLD, (0,) * 7
        staged, mask_out, n = jobs, out_page, 0
    map_len = page_map.shape[0] if page_map is not None else 0
    has_map, has_status, has_mask = page_map is not None, status is not None, mask is not None
    strides = (pages.stride(0), pages.stride(1))
    args = (
        pages, *strides, jobs, num_jobs, out_page, out_offset,
        page_map if page_map is not None else out_page, map_len, num_pages,
        status if status is not None else out_page, staged, *offsets,
        mask_out, mask_blocks, n, has_map, has_status, has_mask, kind, _GATHER_BLOCK,
        _MASK_BLOCK,
    )  # fmt: skip
    key = (has_map, has_status, has_mask, kind, out_page.dtype, out_offset.dtype)
    ints = (*strides, num_jobs, map_len, num_pages, *offsets, mask_blocks, n)
    return args, key, ints


def _torch_twins(
    pages: torch.Tensor,
    jobs: torch.Tensor,
    out_page: torch.Tensor,
    out_offset: torch.Tensor,
    page_map: torch.Tensor | None,
    num_pages: int,
    status: torch.Tensor | None,
    mask: StagedMask | None,
) -> None:
    """The launch's work with the plain-torch twins (CPU tensors without the interpreter)."""
    if jobs.shape[1]:
        counts = jobs[2]
        rows, first, _, dst, div, use_map = jobs.unbind(0)
        gather_slots_torch(
            pages, rows, first, counts, dst, div, use_map, out_page, out_offset,
            total=int(counts.sum()), page_map=page_map, num_pages=num_pages, status=status,
        )  # fmt: skip
    if mask is not None:
        mask.build(twin=True)
