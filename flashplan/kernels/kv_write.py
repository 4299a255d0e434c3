"""Write a step's new K/V rows into a paged cache, skipping slots marked unusable.

``kv_cache[page[i], 0, offset[i]] = k[i]`` and ``kv_cache[page[i], 1, offset[i]] = v[i]``
for every row ``i`` whose ``offset[i] >= 0`` and whose ``page[i]`` lies inside the
cache. A negative offset is how :func:`flashplan.kernels.gather_slots` marks a slot
whose page id was bad, and how CUDA-graph buffers mark padding rows: such rows are
written nowhere. Rows skipped for a page beyond the cache are counted in ``status``.
One launch writes K and V; nothing is read back to the host.

An fp8 cache (``torch.float8_e4m3fn`` / ``torch.float8_e5m2``) takes K/V in fp16 or bf16
and stores them quantized with per-tensor scales (:mod:`flashplan.fp8`: divided in
float32 with IEEE rounding, saturated to the format's range, NaN kept, rounded to
nearest even); a scale is a number or a 0-d float32 tensor read on the device.
"""

from __future__ import annotations

import torch

from flashplan.errors import FlashplanError
from flashplan.fp8 import Scale, check_scale, fp8_max, quantize
from flashplan.kernels._triton import HAS_TRITON, device_guard, runs_on_triton, tl, triton
from flashplan.layout.heads import FP8_DTYPES
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
        k_scale,
        v_scale,
        top,
        HAS_STATUS: tl.constexpr,
        QUANTIZE: tl.constexpr,
        SCALE_PTR: tl.constexpr,
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
            if QUANTIZE:  # fp8: x / scale in float32, saturated (NaN kept), then cast
                if SCALE_PTR:
                    ks = tl.load(k_scale)
                    vs = tl.load(v_scale)
                else:
                    ks = k_scale
                    vs = v_scale
                kq = tl.math.div_rn(k.to(tl.float32), ks)
                vq = tl.math.div_rn(v.to(tl.float32), vs)
                kq = tl.where(kq > top, top, tl.where(kq < -top, -top, kq))
                vq = tl.where(vq > top, top, tl.where(vq < -top, -top, vq))
                tl.store(dst, kq.to(cache_ptr.dtype.element_ty), mask=ok)
                tl.store(dst + c_kv, vq.to(cache_ptr.dtype.element_ty), mask=ok)
            else:
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
    fp8 = kv_cache.dtype in FP8_DTYPES
    for name, t in (("k", k), ("v", v)):
        dtype_ok = t.dtype in (torch.float16, torch.bfloat16) if fp8 else t.dtype == kv_cache.dtype
        if tuple(t.shape) != want or not dtype_ok or t.device != kv_cache.device:
            raise FlashplanError(
                name,
                "expected [rows, heads, head_dim] on the device of kv_cache, of its dtype "
                "(an fp8 cache: float16 or bfloat16)",
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
    k_scale: Scale | None = None,
    v_scale: Scale | None = None,
) -> None:
    """Write rows ``k[i]``, ``v[i]`` at ``(page[i], offset[i])`` (see module docstring).

    Args:
        kv_cache: ``[num_pages, 2, page_size, num_kv_heads, head_dim]``, any strides.
        k, v: ``[rows, num_kv_heads, head_dim]`` in the cache's dtype (an fp8 cache:
            float16 or bfloat16).
        page, offset: int32/int64 ``[>= rows]``: page id and in-page slot per row;
            ``offset < 0`` skips the row.
        status: optional int32 ``[2]`` (:func:`~flashplan.kernels.new_status`);
            ``status[0]`` counts rows skipped for a page outside the cache.
        k_scale, v_scale: an fp8 cache's scales (:func:`flashplan.fp8.check_scale`;
            ``None``: 1.0); refused for another cache.
    """
    rows = k.shape[0]
    _check(kv_cache, k, v, page, offset, rows)
    fp8 = kv_cache.dtype in FP8_DTYPES
    ks, vs = _scales(kv_cache, k_scale, v_scale, fp8)
    if rows == 0:
        return
    # an fp8 cache on the CPU takes the torch twin (Triton's interpreter has no fp8 cast)
    if (fp8 and kv_cache.device.type == "cpu") or not runs_on_triton(
        kv_cache.device, "write_kv_torch"
    ):
        scales = (ks, vs) if fp8 else (None, None)
        write_kv_torch(
            kv_cache, k, v, page, offset, status=status, k_scale=scales[0], v_scale=scales[1]
        )
        return
    scale_ptr = isinstance(ks, torch.Tensor)
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
            ks,
            vs,
            fp8_max(kv_cache.dtype) if fp8 else 0.0,
            HAS_STATUS=status is not None,
            QUANTIZE=fp8,
            SCALE_PTR=scale_ptr,
            BLOCK=_BLOCK,
        )


def _scales(
    kv_cache: torch.Tensor, k_scale: Scale | None, v_scale: Scale | None, fp8: bool
) -> tuple[Scale, Scale]:
    """The write's scales, checked (tensors by their metadata only: no sync); both
    numbers or both tensors, so one kernel variant reads them."""
    if not fp8:
        if k_scale is not None or v_scale is not None:
            raise FlashplanError(
                "k_scale", "scales are for fp8 caches", kv_dtype=str(kv_cache.dtype)
            )
        return 1.0, 1.0
    dev = kv_cache.device
    ks = check_scale("k_scale", k_scale, dev, read=False)
    vs = check_scale("v_scale", v_scale, dev, read=False)
    if isinstance(ks, torch.Tensor) != isinstance(vs, torch.Tensor):  # one number, one tensor
        ks, vs = (_as_tensor(ks, dev), _as_tensor(vs, dev))
    return ks, vs


def _as_tensor(scale: Scale, device: torch.device) -> torch.Tensor:
    """A number as a 0-d float32 tensor on ``device`` (a fill, no sync)."""
    if isinstance(scale, torch.Tensor):
        return scale
    return torch.full((), scale, dtype=torch.float32, device=device)


def write_kv_torch(
    kv_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    page: torch.Tensor,
    offset: torch.Tensor,
    *,
    status: torch.Tensor | None = None,
    k_scale: Scale | None = None,
    v_scale: Scale | None = None,
) -> None:
    """Same contract as :func:`write_kv` in plain torch (boolean indexing: it reads the
    skip mask, a device sync on a GPU — meant for CPU tensors)."""
    rows = k.shape[0]
    _check(kv_cache, k, v, page, offset, rows)
    if kv_cache.dtype in FP8_DTYPES:
        ks, vs = _scales(kv_cache, k_scale, v_scale, True)
        k, v = quantize(k, ks, kv_cache.dtype), quantize(v, vs, kv_cache.dtype)
    else:
        _scales(kv_cache, k_scale, v_scale, False)
    p, o = page[:rows].long(), offset[:rows].long()
    outside = p >= kv_cache.shape[0]
    keep = (o >= 0) & (p >= 0) & ~outside
    if status is not None:
        status[0] += ((o >= 0) & outside).sum().to(torch.int32)
    kv_cache[p[keep], 0, o[keep]] = k[keep]
    kv_cache[p[keep], 1, o[keep]] = v[keep]
