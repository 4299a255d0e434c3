"""Fill runs of values that grow by one, on the device: a plan's RoPE positions, and the
in-item positions of a multi-item batch.

``out[start[s] + j] = max(first[s] + j, 0)`` for ``0 <= j < length[s]``, for every run
``s``. For positions (:class:`~flashplan.planning.positions.PositionRuns`) the host sends
``start``, ``first`` and ``length``, three int32 per run; for FlashInfer's
``token_pos_in_items`` (:class:`~flashplan.planning.items.MultiItemTensors`: every item
counts 1, 2, …) ``first`` is the one integer 1 and the host sends two int32 per item.
One launch writes every run; nothing is read back to the host. A store that would land
outside ``out`` is dropped, so wrong runs can never write past the buffer.
"""

from __future__ import annotations

import torch

from flashplan.errors import FlashplanError
from flashplan.kernels._triton import HAS_TRITON, device_guard, runs_on_triton, tl, triton
from flashplan.torch_kernels import tensor_values

__all__ = ["fill_runs", "fill_runs_torch"]

_BLOCK = 256

if HAS_TRITON:

    @triton.jit
    def _fill_runs_kernel(
        start_ptr, first_ptr, first_value, length_ptr, out_ptr, out_size,
        BLOCK: tl.constexpr, PER_RUN_FIRST: tl.constexpr,
    ):  # fmt: skip
        s = tl.program_id(0)
        blk = tl.program_id(1)
        length = tl.load(length_ptr + s)
        if blk * BLOCK < length:
            j = blk * BLOCK + tl.arange(0, BLOCK)
            first = tl.load(first_ptr + s) if PER_RUN_FIRST else first_value
            # int32: first + j <= the run's last value, which fits int32 (PositionRuns)
            value = tl.maximum(first + j, 0)
            dst = tl.load(start_ptr + s).to(tl.int64) + j
            ok = (j < length) & (dst >= 0) & (dst < out_size)
            tl.store(out_ptr + dst, value.to(out_ptr.dtype.element_ty), mask=ok)


def _check(
    start: torch.Tensor, first: torch.Tensor | int, length: torch.Tensor, out: torch.Tensor
) -> None:
    runs = start.shape[0] if start.dim() == 1 else -1
    arrays = [("start", start), ("length", length)]
    if isinstance(first, torch.Tensor):
        arrays.insert(1, ("first", first))
    elif not isinstance(first, int) or not -(2**31) <= first < 2**31:
        raise FlashplanError(
            "first", "fill_runs needs an int32 tensor or an int32-range int", value=first
        )
    for name, t in arrays:
        if t.dtype != torch.int32 or t.dim() != 1 or t.shape[0] != runs or not t.is_contiguous():
            raise FlashplanError(
                name,
                "must be a contiguous int32 [runs] tensor like start",
                runs=runs,
                **tensor_values(t),
                contiguous=t.is_contiguous(),
            )
        if t.device != out.device:
            raise FlashplanError(
                name,
                "must be on the device of out",
                device=str(t.device),
                out_device=str(out.device),
            )
    if out.dim() != 1 or not out.is_contiguous() or out.dtype not in (torch.int32, torch.uint16):
        raise FlashplanError(
            "out",
            "must be a contiguous int32 or uint16 1-D tensor",
            **tensor_values(out),
            contiguous=out.is_contiguous(),
        )


def _has_work(
    start: torch.Tensor,
    first: torch.Tensor | int,
    length: torch.Tensor,
    out: torch.Tensor,
    max_length: int,
) -> bool:
    """Check the arguments (raising as :func:`fill_runs` says); whether any run has a
    token to write."""
    _check(start, first, length, out)
    return start.shape[0] > 0 and max_length > 0 and out.numel() > 0


def fill_runs(
    start: torch.Tensor,
    first: torch.Tensor | int,
    length: torch.Tensor,
    out: torch.Tensor,
    max_length: int,
) -> None:
    """Write every run into ``out`` (module docstring); one launch, sync-free.

    Args:
        start: int32 ``[runs]`` (entries of ``out``): where each run begins, ascending
            (the kernel does not need the order; the torch twin's search does).
        first: int32 ``[runs]``: each run's first value (clamped at 0 when negative),
            or one int for every run.
        length: int32 ``[runs]`` (entries): each run's length, ``>= 0``.
        out: int32 or uint16 ``[n]``, on the same device; entries no run covers are left
            as they are.
        max_length: a host bound ``>= max(length)`` (sets the grid; never read from the
            device).

    Raises:
        FlashplanError: tensors of the wrong dtype, shape or device.
    """
    if not _has_work(start, first, length, out, max_length):
        return
    if not runs_on_triton(out.device, "fill_runs_torch"):
        _fill_runs_torch(start, first, length, out)
        return
    grid = (start.shape[0], triton.cdiv(max_length, _BLOCK))
    per_run = isinstance(first, torch.Tensor)
    first_ptr, first_value = (first, 0) if per_run else (start, first)
    with device_guard(out.device):
        _fill_runs_kernel[grid](
            start, first_ptr, first_value, length, out, out.numel(),
            BLOCK=_BLOCK, PER_RUN_FIRST=per_run,
        )  # fmt: skip


def fill_runs_torch(
    start: torch.Tensor,
    first: torch.Tensor | int,
    length: torch.Tensor,
    out: torch.Tensor,
    max_length: int,
) -> None:
    """:func:`fill_runs` in plain torch (any device; vectorized, sync-free, memory
    proportional to ``out``). ``start`` must ascend (runs in order, as a plan's are).

    Each entry finds its run by a binary search of ``start`` (the last run starting at
    or before it, which skips empty runs sharing its start) and is written only if that
    run covers it, so wrong runs never reach outside ``out``. ``max_length`` sizes
    nothing here.
    """
    if _has_work(start, first, length, out, max_length):
        _fill_runs_torch(start, first, length, out)


def _fill_runs_torch(
    start: torch.Tensor, first: torch.Tensor | int, length: torch.Tensor, out: torch.Tensor
) -> None:
    """:func:`fill_runs_torch` on checked arguments with work to do."""
    n = out.numel()
    t = torch.arange(n, device=out.device, dtype=torch.int64)
    begin = start.to(torch.int64)
    run = (torch.searchsorted(begin, t, right=True) - 1).clamp_min(0)
    j = t - begin[run]
    covered = (j >= 0) & (j < length.to(torch.int64)[run])
    base = first.to(torch.int64)[run] if isinstance(first, torch.Tensor) else first
    value = (base + j).clamp_min(0).to(torch.int32)
    # in int32: torch has few uint16 ops
    out.copy_(torch.where(covered, value, out.to(torch.int32)).to(out.dtype))
