"""Write a step's new K/V rows into a paged cache, skipping slots marked unusable.

``kv_cache[page[i], 0, offset[i]] = k[i]`` and ``kv_cache[page[i], 1, offset[i]] = v[i]``
for every row ``i`` whose ``offset[i] >= 0`` and whose ``page[i]`` lies inside the
cache. A negative offset is how :func:`flashplan.kernels.gather_slots` marks a slot
whose page id was bad, and how CUDA-graph buffers mark padding rows: such rows are
written nowhere. Rows skipped for a page beyond the cache are counted in ``status``.
One launch writes K and V; nothing is read back to the host.
"""

from __future__ import annotations

import torch

from flashplan.errors import FlashplanError
from flashplan.kernels._triton import HAS_TRITON, device_guard, runs_on_triton, tl, triton
from flashplan.torch_kernels import tensor_values

__all__ = ["write_kv", "write_kv_torch"]

_BLOCK = 1024

if HAS_TRITON:

    @triton.jit
    def _write_kv_kernel(
        cache_ptr,
        c_page,
        c_kv,
        c_slot,
        c_head,
        c_dim,
        k_ptr,
        v_ptr,
        k_row,
        k_head,
        k_dim,
        v_row,
        v_head,
        v_dim,
        page_ptr,
        offset_ptr,
        num_pages,
        status_ptr,
        head_dim,
        width,
        HAS_STATUS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        i = tl.program_id(0).to(tl.int64)
        blk = tl.program_id(1)
        page = tl.load(page_ptr + i).to(tl.int64)
        offset = tl.load(offset_ptr + i).to(tl.int64)
        out_of_pool = page >= num_pages
        if HAS_STATUS:  # noqa: SIM102 - a constexpr branch, then a runtime one
            if (offset >= 0) & out_of_pool & (blk == 0):
                tl.atomic_add(status_ptr, 1)
        if (offset >= 0) & (page >= 0) & ~out_of_pool:
            e = blk * BLOCK + tl.arange(0, BLOCK)
            ok = e < width
            h = (e // head_dim).to(tl.int64)
            d = (e % head_dim).to(tl.int64)
            dst = cache_ptr + page * c_page + offset * c_slot + h * c_head + d * c_dim
            k = tl.load(k_ptr + i * k_row + h * k_head + d * k_dim, mask=ok)
            v = tl.load(v_ptr + i * v_row + h * v_head + d * v_dim, mask=ok)
            tl.store(dst, k, mask=ok)
            tl.store(dst + c_kv, v, mask=ok)


def _check(
    kv_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    page: torch.Tensor,
    offset: torch.Tensor,
    rows: int,
) -> None:
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise FlashplanError(
            "kv_cache",
            "expected [pages, 2, page_size, heads, head_dim]",
            shape=tuple(kv_cache.shape),
        )
    want = (rows, kv_cache.shape[3], kv_cache.shape[4])
    for name, t in (("k", k), ("v", v)):
        if tuple(t.shape) != want or t.dtype != kv_cache.dtype or t.device != kv_cache.device:
            raise FlashplanError(
                name,
                "expected [rows, heads, head_dim] of the dtype and device of kv_cache",
                **tensor_values(t),
                expected_dtype=str(kv_cache.dtype),
                expected_shape=want,
                expected_device=str(kv_cache.device),
            )
    for name, t in (("page", page), ("offset", offset)):
        if (
            t.dtype not in (torch.int32, torch.int64)
            or t.dim() != 1
            or t.shape[0] < rows
            or t.device != kv_cache.device
        ):
            raise FlashplanError(
                name,
                "expected an int32/int64 1-D tensor of >= rows entries on the device of kv_cache",
                rows=rows,
                **tensor_values(t),
                kv_cache_device=str(kv_cache.device),
            )


def write_kv(
    kv_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    page: torch.Tensor,
    offset: torch.Tensor,
    *,
    status: torch.Tensor | None = None,
) -> None:
    """Write rows ``k[i]``, ``v[i]`` at ``(page[i], offset[i])`` (see module docstring).

    Args:
        kv_cache: ``[num_pages, 2, page_size, num_kv_heads, head_dim]``, any strides.
        k, v: ``[rows, num_kv_heads, head_dim]`` in the cache's dtype.
        page, offset: int32/int64 ``[>= rows]``: page id and in-page slot per row;
            ``offset < 0`` skips the row.
        status: optional int32 ``[2]`` (:func:`~flashplan.kernels.new_status`);
            ``status[0]`` counts rows skipped for a page outside the cache.
    """
    rows = k.shape[0]
    _check(kv_cache, k, v, page, offset, rows)
    if rows == 0:
        return
    if not runs_on_triton(kv_cache.device, "write_kv_torch"):
        write_kv_torch(kv_cache, k, v, page, offset, status=status)
        return
    width = k.shape[1] * k.shape[2]
    with device_guard(kv_cache.device):
        _write_kv_kernel[(rows, triton.cdiv(width, _BLOCK))](
            kv_cache,
            *kv_cache.stride(),
            k,
            v,
            *k.stride(),
            *v.stride(),
            page,
            offset,
            kv_cache.shape[0],
            status if status is not None else page,
            k.shape[2],
            width,
            HAS_STATUS=status is not None,
            BLOCK=_BLOCK,
        )


def write_kv_torch(
    kv_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    page: torch.Tensor,
    offset: torch.Tensor,
    *,
    status: torch.Tensor | None = None,
) -> None:
    """Same contract as :func:`write_kv` in plain torch (boolean indexing: it reads the
    skip mask, a device sync on a GPU — meant for CPU tensors)."""
    rows = k.shape[0]
    _check(kv_cache, k, v, page, offset, rows)
    p, o = page[:rows].long(), offset[:rows].long()
    outside = p >= kv_cache.shape[0]
    keep = (o >= 0) & (p >= 0) & ~outside
    if status is not None:
        status[0] += ((o >= 0) & outside).sum().to(torch.int32)
    kv_cache[p[keep], 0, o[keep]] = k[keep]
    kv_cache[p[keep], 1, o[keep]] = v[keep]
