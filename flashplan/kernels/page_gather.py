"""Device-side gathers from a page table: KV page indices and KV write slots.

Two jobs, each as a Triton kernel plus a plain-torch twin with the same contract:

* :func:`gather_page_indices` / :func:`gather_page_indices_torch` build FlashInfer's
  ``kv_indices`` (a flat int32 list of **page ids**) from a page table, a row per
  request, a first page and a page count per request.
* :func:`token_slots` / :func:`token_slots_torch` give the KV-cache write slots of new
  **tokens**: for each new token, the page id that holds it and its slot in that page.

Units: ``pages`` holds page ids; ``start_page`` / ``num_pages`` / ``page_indptr`` count
pages; ``first_pos`` / ``counts`` / ``indptr`` count tokens; a page holds ``page_size``
tokens, so logical token ``t`` of a request lives in slot ``t % page_size`` of page
``pages[row, t // page_size]``.

``page_map`` (optional, both jobs): an int32 1-D tensor that maps a full-pool page id to a
window-pool page id (sliding-window KV pools). By convention its last entry is -1, and a
negative page id indexes it from the end as torch indexing does, so the padding id -1
maps to -1.

Dispatch: the Triton launchers never read a value back to the host (no ``.item()``,
``.cpu()``, ``.tolist()``; sizes come from tensor shapes). On CUDA tensors they launch the
Triton kernel. On CPU tensors they run the kernel under Triton's interpreter when the
kernels were defined with ``TRITON_INTERPRET=1`` (see :func:`triton_mode`), otherwise
they fall back to the torch twin (reading a CPU tensor is no device sync). Without Triton
installed only CPU tensors are accepted by the launchers; the ``*_torch`` twins work on
any device and are sync-free given their host-int size argument.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

from flashplan.errors import FlashplanError
from flashplan.kernels._triton import triton_mode
from flashplan.kernels.segments import segment_slots, segment_slots_torch

__all__ = [
    "gather_page_indices",
    "gather_page_indices_torch",
    "token_slots",
    "token_slots_torch",
    "triton_mode",
]


def _use_triton(device: torch.device, torch_twin: str) -> bool:
    """Whether a launch on ``device`` goes to Triton (True) or to the torch twin (False)."""
    mode = triton_mode()
    if device.type == "cpu":
        return mode == "interpret"
    if mode == "unavailable":
        raise RuntimeError(
            f"Triton is not installed: cannot launch on {device}; use {torch_twin}(), "
            "which needs the host-known total size"
        )
    return True


def _check_int_tensor(
    name: str,
    t: torch.Tensor,
    ndim: int,
    device: torch.device,
    dtypes: tuple[torch.dtype, ...] = (torch.int32,),
) -> None:
    """Check dtype, rank, device and (for 1-D) unit stride of an index tensor (no sync)."""
    if t.dtype not in dtypes:
        raise FlashplanError(f"{name}: dtype must be one of {dtypes}, got {t.dtype}")
    if t.dim() != ndim:
        raise FlashplanError(f"{name}: expected a {ndim}-D tensor, got shape {tuple(t.shape)}")
    if t.device != device:
        raise FlashplanError(f"{name}: on {t.device}, expected {device} like `pages`")
    if ndim == 1 and not t.is_contiguous():
        raise FlashplanError(f"{name}: must be contiguous (stride 1), got stride {t.stride()}")


def _check_batch(
    pages: torch.Tensor,
    rows: torch.Tensor,
    starts: tuple[str, torch.Tensor],
    counts: tuple[str, torch.Tensor],
    indptr: tuple[str, torch.Tensor],
    outs: tuple[tuple[str, torch.Tensor, tuple[torch.dtype, ...]], ...],
    page_map: torch.Tensor | None,
) -> int:
    """Validate the shared arguments of both jobs from metadata only; return batch size."""
    device = pages.device
    _check_int_tensor("pages", pages, 2, device)
    _check_int_tensor("rows", rows, 1, device)
    bs = rows.shape[0]
    for name, t in (starts, counts):
        _check_int_tensor(name, t, 1, device)
        if t.shape[0] != bs:
            raise FlashplanError(f"{name}: has {t.shape[0]} entries, rows has {bs}")
    name, t = indptr
    _check_int_tensor(name, t, 1, device)
    if t.shape[0] != bs + 1:
        raise FlashplanError(f"{name}: has {t.shape[0]} entries, expected bs + 1 = {bs + 1}")
    for name, t, dtypes in outs:
        _check_int_tensor(name, t, 1, device, dtypes)
    if page_map is not None:
        _check_int_tensor("page_map", page_map, 1, device)
    return bs


def gather_page_indices(
    pages: torch.Tensor,
    rows: torch.Tensor,
    start_page: torch.Tensor,
    num_pages: torch.Tensor,
    page_indptr: torch.Tensor,
    out: torch.Tensor,
    page_map: torch.Tensor | None = None,
) -> None:
    """Gather each request's KV page ids into a flat list (FlashInfer's ``kv_indices``).

    For request ``i`` and ``p`` in ``[0, num_pages[i])``::

        out[page_indptr[i] + p] = pages[rows[i], start_page[i] + p]

    or ``page_map[pages[rows[i], start_page[i] + p]]`` when ``page_map`` is given. Entries
    of ``out`` not addressed this way are left untouched. One Triton program per request
    (grid ``(bs,)``) loops over its pages in chunks of 2048; nothing is read back to the
    host, the batch size is ``rows.shape[0]``.

    Args:
        pages: int32 ``[num_rows, max_pages]`` page table, page ids; any strides (a
            non-contiguous view of a larger table is fine).
        rows: int32 ``[bs]``, the table row of each request.
        start_page: int32 ``[bs]``, first page (a column of ``pages``) of each request,
            in pages.
        num_pages: int32 ``[bs]``, pages to gather per request (0 is allowed); the caller
            guarantees ``start_page + num_pages <= max_pages``.
        page_indptr: int32 ``[bs + 1]``, where request ``i``'s pages start in ``out``, in
            pages (normally the exclusive prefix sum of ``num_pages``).
        out: int32 ``[>= page_indptr[i] + num_pages[i] for every i]``, contiguous; written.
        page_map: optional int32 ``[pool_pages + 1]`` full-pool → window-pool page id map,
            last entry -1; negative ids index it from the end.

    Raises:
        FlashplanError: a dtype, rank, device, contiguity or batch-size mismatch.
        RuntimeError: a non-CPU device without Triton installed.
    """
    bs = _check_batch(
        pages,
        rows,
        ("start_page", start_page),
        ("num_pages", num_pages),
        ("page_indptr", page_indptr),
        (("out", out, (torch.int32,)),),
        page_map,
    )
    if bs == 0:
        return
    if not _use_triton(pages.device, "gather_page_indices_torch"):
        total = int(num_pages.sum())  # CPU tensor: a host read, not a device sync
        gather_page_indices_torch(
            pages, rows, start_page, num_pages, page_indptr, out, total, page_map=page_map
        )
        return
    ones, use_map = _segment_flags(rows, 1, page_map)
    with _device_guard(pages.device):
        segment_slots(
            pages,
            rows,
            start_page,
            num_pages,
            page_indptr[:-1],
            ones,
            use_map,
            out,
            torch.empty_like(out),
            page_map=page_map,
        )


def gather_page_indices_torch(
    pages: torch.Tensor,
    rows: torch.Tensor,
    start_page: torch.Tensor,
    num_pages: torch.Tensor,
    page_indptr: torch.Tensor,
    out: torch.Tensor,
    total_pages: int,
    page_map: torch.Tensor | None = None,
) -> None:
    """Plain-torch twin of :func:`gather_page_indices` (CPU fallback and test oracle).

    Same arguments, shapes, dtypes and effect as :func:`gather_page_indices`, plus
    ``total_pages``: a host int equal to ``sum(num_pages)`` (in pages), which sizes the
    vectorized expansion (``repeat_interleave(..., output_size=total_pages)``) so that no
    value is read back from the device. Vectorized over the batch: no per-request Python
    loop. A wrong ``total_pages`` gives wrong results or an indexing error.

    Raises:
        FlashplanError: a dtype, rank, device, contiguity or batch-size mismatch, or a
            negative ``total_pages``.
    """
    _check_batch(
        pages,
        rows,
        ("start_page", start_page),
        ("num_pages", num_pages),
        ("page_indptr", page_indptr),
        (("out", out, (torch.int32,)),),
        page_map,
    )
    if total_pages < 0:
        raise FlashplanError(f"total_pages: must be >= 0, got {total_pages}")
    if total_pages == 0:
        return
    ones, use_map = _segment_flags(rows, 1, page_map)
    segment_slots_torch(
        pages,
        rows,
        start_page,
        num_pages,
        page_indptr[:-1],
        ones,
        use_map,
        out,
        torch.empty_like(out),
        total_pages,
        page_map=page_map,
    )


def token_slots(
    pages: torch.Tensor,
    rows: torch.Tensor,
    first_pos: torch.Tensor,
    counts: torch.Tensor,
    indptr: torch.Tensor,
    page_size: int,
    out_page: torch.Tensor,
    out_offset: torch.Tensor,
    page_map: torch.Tensor | None = None,
) -> None:
    """KV-cache write slots of new tokens: page id and in-page offset of each token.

    For request ``i``, ``j`` in ``[0, counts[i])`` and logical token position
    ``t = first_pos[i] + j``::

        out_page[indptr[i] + j]   = pages[rows[i], t // page_size]   (or page_map[...] of it)
        out_offset[indptr[i] + j] = t % page_size

    so the token's K/V go to ``cache[out_page[k], out_offset[k]]`` of a
    ``[num_pages, page_size, ...]`` cache (flat slot ``out_page * page_size +
    out_offset``: compute it in int64 for pools over 2**31 tokens). Entries not addressed
    are left untouched. One Triton program per request (grid ``(bs,)``) loops over its
    tokens in chunks of 2048; ``page_size`` is compiled in (one kernel variant per page
    size). Nothing is read back to the host.

    Args:
        pages: int32 ``[num_rows, max_pages]`` page table, page ids; any strides.
        rows: int32 ``[bs]``, the table row of each request.
        first_pos: int32 ``[bs]``, logical position (in tokens) of each request's first
            new token, e.g. its cached prefix length.
        counts: int32 ``[bs]``, new tokens per request (0 is allowed); the caller
            guarantees ``ceil((first_pos + counts) / page_size) <= max_pages``.
        indptr: int32 ``[bs + 1]``, where request ``i``'s tokens start in the outputs, in
            tokens (normally the exclusive prefix sum of ``counts``).
        page_size: tokens per page, a host int ``>= 1``.
        out_page: int32 or int64 ``[>= total tokens]``, contiguous; receives page ids
            (window-pool ids when ``page_map`` is given).
        out_offset: int32 or int64 ``[>= total tokens]``, contiguous; receives the slot in
            the page, in tokens, ``0 <= offset < page_size``.
        page_map: optional int32 ``[pool_pages + 1]`` full-pool → window-pool page id map,
            last entry -1; negative ids index it from the end.

    Raises:
        FlashplanError: a dtype, rank, device, contiguity or batch-size mismatch, or
            ``page_size < 1``.
        RuntimeError: a non-CPU device without Triton installed.
    """
    bs = _check_token_slots(
        pages, rows, first_pos, counts, indptr, page_size, out_page, out_offset, page_map
    )
    if bs == 0:
        return
    if not _use_triton(pages.device, "token_slots_torch"):
        total = int(counts.sum())  # CPU tensor: a host read, not a device sync
        token_slots_torch(
            pages,
            rows,
            first_pos,
            counts,
            indptr,
            page_size,
            out_page,
            out_offset,
            total,
            page_map=page_map,
        )
        return
    div, use_map = _segment_flags(rows, page_size, page_map)
    with _device_guard(pages.device):
        segment_slots(
            pages,
            rows,
            first_pos,
            counts,
            indptr[:-1],
            div,
            use_map,
            out_page,
            out_offset,
            page_map=page_map,
        )


def token_slots_torch(
    pages: torch.Tensor,
    rows: torch.Tensor,
    first_pos: torch.Tensor,
    counts: torch.Tensor,
    indptr: torch.Tensor,
    page_size: int,
    out_page: torch.Tensor,
    out_offset: torch.Tensor,
    total: int,
    page_map: torch.Tensor | None = None,
) -> None:
    """Plain-torch twin of :func:`token_slots` (CPU fallback and test oracle).

    Same arguments, shapes, dtypes and effect as :func:`token_slots`, plus ``total``: a
    host int equal to ``sum(counts)`` (in tokens), which sizes the vectorized expansion so
    that no value is read back from the device. No per-request Python loop.

    Raises:
        FlashplanError: a dtype, rank, device, contiguity or batch-size mismatch,
            ``page_size < 1`` or a negative ``total``.
    """
    _check_token_slots(
        pages, rows, first_pos, counts, indptr, page_size, out_page, out_offset, page_map
    )
    if total < 0:
        raise FlashplanError(f"total: must be >= 0, got {total}")
    if total == 0:
        return
    div, use_map = _segment_flags(rows, page_size, page_map)
    segment_slots_torch(
        pages,
        rows,
        first_pos,
        counts,
        indptr[:-1],
        div,
        use_map,
        out_page,
        out_offset,
        total,
        page_map=page_map,
    )


def _check_token_slots(
    pages: torch.Tensor,
    rows: torch.Tensor,
    first_pos: torch.Tensor,
    counts: torch.Tensor,
    indptr: torch.Tensor,
    page_size: int,
    out_page: torch.Tensor,
    out_offset: torch.Tensor,
    page_map: torch.Tensor | None,
) -> int:
    """Validate :func:`token_slots`'s arguments from metadata only; return batch size."""
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise FlashplanError(f"page_size: must be an int >= 1, got {page_size!r}")
    index_dtypes = (torch.int32, torch.int64)
    return _check_batch(
        pages,
        rows,
        ("first_pos", first_pos),
        ("counts", counts),
        ("indptr", indptr),
        (("out_page", out_page, index_dtypes), ("out_offset", out_offset, index_dtypes)),
        page_map,
    )


def _segment_flags(
    rows: torch.Tensor, div: int, page_map: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-request ``div`` and ``use_map`` int32 tensors for :mod:`flashplan.kernels.segments`
    (one segment per request; built on ``rows``'s device, no sync)."""
    use_map = torch.ones_like(rows) if page_map is not None else torch.zeros_like(rows)
    return torch.full_like(rows, div), use_map


def _device_guard(device: torch.device) -> AbstractContextManager[object]:
    """A context that makes ``device`` current for a Triton launch (CUDA devices only)."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return nullcontext()
