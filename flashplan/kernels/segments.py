"""One launch for every page-table gather of a batch ("segment slots").

A *segment* reads ``counts[s]`` consecutive logical positions ``first[s] + k`` of
page-table row ``rows[s]`` with a divisor ``div[s]``::

    out_page[dst[s] + k]   = pages[rows[s], (first[s] + k) // div[s]]
    out_offset[dst[s] + k] = (first[s] + k) % div[s]

With ``div = 1`` a segment is a run of page-table columns (FlashInfer's
``kv_indices`` of one request); with ``div = page_size`` it is a run of tokens
(their KV write slots: page id and in-page offset). The executor packs the page
gathers of every group and the write slots of the new (and encoder) tokens into
one segment list and launches :func:`segment_slots` once per batch, instead of
one kernel per job: on the host, a Triton launch costs tens of microseconds.
Segments with ``use_map[s] != 0`` translate page ids through ``page_map``
(full-pool id -> sliding-window-pool id; negative ids index it from the end).
"""

from __future__ import annotations

import torch

from flashplan.errors import FlashplanError
from flashplan.kernels._triton import HAS_TRITON, tl, triton, triton_mode

__all__ = ["segment_slots", "segment_slots_torch"]

_BLOCK = 1024

if HAS_TRITON:

    @triton.jit
    def _segment_slots_kernel(
        pages_ptr,
        pages_row_stride,
        pages_col_stride,
        rows_ptr,
        first_ptr,
        counts_ptr,
        dst_ptr,
        div_ptr,
        use_map_ptr,
        out_page_ptr,
        out_offset_ptr,
        page_map_ptr,
        page_map_len,
        HAS_MAP: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        s = tl.program_id(0)
        row = tl.load(rows_ptr + s).to(tl.int64)
        first = tl.load(first_ptr + s).to(tl.int64)
        n = tl.load(counts_ptr + s)
        dst = tl.load(dst_ptr + s).to(tl.int64)
        div = tl.load(div_ptr + s).to(tl.int64)
        base = pages_ptr + row * pages_row_stride
        for off in range(0, n, BLOCK):
            k = off + tl.arange(0, BLOCK)
            valid = k < n
            t = first + k.to(tl.int64)
            col = t // div
            page = tl.load(base + col * pages_col_stride, mask=valid, other=0)
            if HAS_MAP:
                use = tl.load(use_map_ptr + s)
                if use != 0:
                    idx = tl.where(page < 0, page + page_map_len, page)
                    page = tl.load(page_map_ptr + idx, mask=valid, other=0)
            tl.store(out_page_ptr + dst + k, page, mask=valid)
            tl.store(out_offset_ptr + dst + k, t - col * div, mask=valid)  # cast to out dtype


def _check(
    pages: torch.Tensor,
    seg: tuple[torch.Tensor, ...],
    out_page: torch.Tensor,
    out_offset: torch.Tensor,
    page_map: torch.Tensor | None,
) -> int:
    if pages.dtype != torch.int32 or pages.dim() != 2:
        raise FlashplanError(
            f"pages: expected int32 [rows, max_pages], got {pages.dtype} {tuple(pages.shape)}"
        )
    n = seg[0].shape[0]
    for name, t in zip(("rows", "first", "counts", "dst", "div", "use_map"), seg, strict=True):
        if t.dtype != torch.int32 or t.shape != (n,) or t.device != pages.device:
            raise FlashplanError(
                f"{name}: expected int32 [{n}] on {pages.device}, got "
                f"{t.dtype} {tuple(t.shape)} on {t.device}"
            )
        if not t.is_contiguous():
            raise FlashplanError(f"{name}: must be contiguous")
    for name, t in (("out_page", out_page), ("out_offset", out_offset)):
        if t.dtype not in (torch.int32, torch.int64) or t.dim() != 1 or t.device != pages.device:
            raise FlashplanError(f"{name}: expected an int32/int64 1-D tensor on {pages.device}")
    if page_map is not None and (page_map.dtype != torch.int32 or page_map.dim() != 1):
        raise FlashplanError("page_map: expected an int32 1-D tensor")
    return n


def segment_slots(
    pages: torch.Tensor,
    rows: torch.Tensor,
    first: torch.Tensor,
    counts: torch.Tensor,
    dst: torch.Tensor,
    div: torch.Tensor,
    use_map: torch.Tensor,
    out_page: torch.Tensor,
    out_offset: torch.Tensor,
    page_map: torch.Tensor | None = None,
) -> None:
    """Run every segment (see module docstring) in one Triton launch; no host sync.

    Args:
        pages: int32 ``[num_rows, max_pages]`` page table (any strides).
        rows, first, counts, dst, div, use_map: int32 ``[num_segments]``: table row,
            first logical position (columns when ``div = 1``, tokens otherwise),
            length, output offset, divisor (1 or page_size) and page-map flag.
        out_page, out_offset: int32 or int64 ``[>= max(dst + counts)]`` outputs; entries
            no segment addresses are left untouched.
        page_map: optional int32 ``[pool + 1]`` full -> window page-id map.

    On CPU tensors the kernel runs under Triton's interpreter when enabled, else the
    torch twin runs (needs the total; computed from the host-readable CPU counts).
    """
    seg = (rows, first, counts, dst, div, use_map)
    n = _check(pages, seg, out_page, out_offset, page_map)
    if n == 0:
        return
    mode = triton_mode()
    if pages.device.type == "cpu" and mode != "interpret":
        segment_slots_torch(pages, *seg, out_page, out_offset, int(counts.sum()), page_map=page_map)
        return
    if mode == "unavailable":
        raise RuntimeError("Triton is not installed: use segment_slots_torch()")
    has_map = page_map is not None
    map_arg = page_map if page_map is not None else out_page
    map_len = page_map.shape[0] if page_map is not None else 0
    _segment_slots_kernel[(n,)](
        pages,
        pages.stride(0),
        pages.stride(1),
        rows,
        first,
        counts,
        dst,
        div,
        use_map,
        out_page,
        out_offset,
        map_arg,
        map_len,
        HAS_MAP=has_map,
        BLOCK=_BLOCK,
    )


def segment_slots_torch(
    pages: torch.Tensor,
    rows: torch.Tensor,
    first: torch.Tensor,
    counts: torch.Tensor,
    dst: torch.Tensor,
    div: torch.Tensor,
    use_map: torch.Tensor,
    out_page: torch.Tensor,
    out_offset: torch.Tensor,
    total: int,
    page_map: torch.Tensor | None = None,
) -> None:
    """Same contract as :func:`segment_slots` in plain vectorized torch.

    ``total`` (host int) is ``sum(counts)``; passing it keeps this sync-free on a GPU.
    """
    _check(pages, (rows, first, counts, dst, div, use_map), out_page, out_offset, page_map)
    if total == 0:
        return
    dev = pages.device
    seg = torch.repeat_interleave(
        torch.arange(counts.shape[0], device=dev), counts.long(), output_size=total
    )
    starts = torch.cumsum(counts.long(), 0) - counts.long()
    k = torch.arange(total, device=dev) - starts[seg]
    t = first.long()[seg] + k
    d = div.long()[seg]
    col = t // d
    page = pages[rows.long()[seg], col]
    if page_map is not None:
        mapped = page_map[page.long()]
        page = torch.where(use_map[seg] != 0, mapped, page)
    out = dst.long()[seg] + k
    out_page[out] = page.to(out_page.dtype)
    out_offset[out] = (t - col * d).to(out_offset.dtype)
