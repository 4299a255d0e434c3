"""Packed "threshold-row" custom masks built on the device.

A threshold-row mask (see :class:`flashplan.planning.masks.ThresholdMask`) gives row
``j`` of request ``i`` the columns ``c >= clamp(first_visible[i] + j, 0, kv_len)``.
These kernels expand it straight into bit-packed bytes (little-endian: element
``e`` is bit ``e % 8`` of byte ``e // 8``), request ``i``'s bytes starting at byte
``byte_offsets[i]`` of ``out``. The host only describes the mask (one int per
request); the mask itself — possibly hundreds of MB for long windowed prefixes —
is written at device bandwidth.
"""

from __future__ import annotations

import torch

from flashplan.errors import FlashplanError
from flashplan.kernels._triton import HAS_TRITON, device_guard, runs_on_triton, tl, triton

__all__ = ["build_threshold_mask", "build_threshold_mask_torch"]

_BLOCK = 1024

if HAS_TRITON:

    @triton.jit
    def _threshold_mask_kernel(
        first_visible_ptr,
        qo_lens_ptr,
        kv_lens_ptr,
        byte_offsets_ptr,
        out_ptr,
        BLOCK: tl.constexpr,
    ):
        # Grid (bs, byte blocks): one program writes BLOCK bytes of one request.
        i = tl.program_id(0)
        blk = tl.program_id(1)
        q = tl.load(qo_lens_ptr + i).to(tl.int64)
        kv = tl.load(kv_lens_ptr + i).to(tl.int64)
        first = tl.load(first_visible_ptr + i).to(tl.int64)
        base = tl.load(byte_offsets_ptr + i).to(tl.int64)
        n_elem = q * kv
        n_bytes = (n_elem + 7) // 8
        b = blk * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        valid = b < n_bytes
        kv_safe = tl.maximum(kv, 1)
        byte = (b * 0).to(tl.int32)
        for bit in tl.static_range(8):  # no tl.sum: it is a jit helper, not a builtin
            e = b * 8 + bit
            row = e // kv_safe
            col = e - row * kv_safe
            thr = tl.minimum(tl.maximum(first + row, 0), kv)
            seen = (col >= thr) & (e < n_elem)
            byte = byte | (seen.to(tl.int32) << bit)
        tl.store(out_ptr + base + b, byte.to(tl.uint8), mask=valid)


def _check(
    first_visible: torch.Tensor,
    qo_lens: torch.Tensor,
    kv_lens: torch.Tensor,
    byte_offsets: torch.Tensor,
    out: torch.Tensor,
) -> int:
    bs = qo_lens.shape[0]
    for name, t in (
        ("first_visible", first_visible),
        ("qo_lens", qo_lens),
        ("kv_lens", kv_lens),
        ("byte_offsets", byte_offsets),
    ):
        if t.dtype not in (torch.int32, torch.int64) or t.dim() != 1 or t.shape[0] != bs:
            raise FlashplanError(
                f"{name}: expected an int32/int64 tensor [{bs}], got {t.dtype} {tuple(t.shape)}"
            )
        if t.device != out.device or not t.is_contiguous():
            raise FlashplanError(f"{name}: must be contiguous and on {out.device}")
    if out.dtype != torch.uint8 or out.dim() != 1:
        raise FlashplanError(
            f"out: expected a uint8 1-D tensor, got {out.dtype} {tuple(out.shape)}"
        )
    return bs


def build_threshold_mask(
    first_visible: torch.Tensor,
    qo_lens: torch.Tensor,
    kv_lens: torch.Tensor,
    byte_offsets: torch.Tensor,
    out: torch.Tensor,
    max_bytes: int,
) -> None:
    """Write the packed threshold-row mask of every request into ``out`` (Triton).

    Args:
        first_visible: int32/int64 ``[bs]`` (columns): row 0's first visible column.
        qo_lens, kv_lens: int32 ``[bs]`` (tokens) rows and columns per request.
        byte_offsets: int32/int64 ``[bs]`` (bytes) where request i's bytes start in ``out``.
        out: uint8 ``[>= max(byte_offsets + ceil(qo*kv/8))]`` on the same device.
        max_bytes: host int, the largest ``ceil(qo_len * kv_len / 8)`` (sizes the grid).

    Bytes outside the requests' ranges are left untouched. No host sync. On CPU
    tensors the kernel runs under Triton's interpreter when enabled, else the
    torch twin runs.
    """
    bs = _check(first_visible, qo_lens, kv_lens, byte_offsets, out)
    if bs == 0 or max_bytes <= 0:
        return
    if not runs_on_triton(out.device, "build_threshold_mask_torch"):
        build_threshold_mask_torch(first_visible, qo_lens, kv_lens, byte_offsets, out)
        return
    grid = (bs, triton.cdiv(max_bytes, _BLOCK))
    with device_guard(out.device):
        _threshold_mask_kernel[grid](
            first_visible, qo_lens, kv_lens, byte_offsets, out, BLOCK=_BLOCK
        )


def build_threshold_mask_torch(
    first_visible: torch.Tensor,
    qo_lens: torch.Tensor,
    kv_lens: torch.Tensor,
    byte_offsets: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Same contract as :func:`build_threshold_mask`, in plain vectorized torch.

    Reads the lengths (a host read on CPU tensors; on a device it would sync, so
    use it on CPU only).
    """
    _check(first_visible, qo_lens, kv_lens, byte_offsets, out)
    q = qo_lens.long()
    kv = kv_lens.long()
    n_bytes = (q * kv + 7) // 8
    total = int(n_bytes.sum())
    if total == 0:
        return
    req = torch.repeat_interleave(
        torch.arange(q.shape[0], device=out.device), n_bytes, output_size=total
    )
    starts = torch.cumsum(n_bytes, 0) - n_bytes
    local = torch.arange(total, device=out.device) - starts[req]
    e = local[:, None] * 8 + torch.arange(8, device=out.device)[None, :]
    kv_r = kv[req][:, None]
    row = e // kv_r.clamp_min(1)
    col = e - row * kv_r
    thr = (first_visible.long()[req][:, None] + row).clamp(min=0)
    thr = torch.minimum(thr, kv_r)
    seen = (col >= thr) & (e < (q * kv)[req][:, None])
    byte = (seen.to(torch.int32) << torch.arange(8, device=out.device, dtype=torch.int32)).sum(1)
    out[byte_offsets.long()[req] + local] = byte.to(torch.uint8)
