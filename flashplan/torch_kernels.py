"""Plain-torch twins of flashplan's Triton kernels that the reference executor runs.

The gather of page ids and write slots (:func:`gather_slots_torch`, the contract of
:func:`flashplan.kernels.gather_slots`) and the merge of two partial attention states
(:func:`merge_state_torch`, of :func:`flashplan.kernels.merge_state_triton`), with the
argument checks the kernels share. This module imports no Triton and no kernel module, so
``import flashplan`` (which imports the reference executor) loads neither; the kernel
modules import their twins from here, and their tests compare each kernel with its twin.
"""

from __future__ import annotations

import math
from typing import TypedDict

import torch

from flashplan.errors import FlashplanError

__all__ = [
    "MERGE_V_DTYPES",
    "NO_BAD_JOB",
    "TensorValues",
    "check_gather_args",
    "check_states",
    "fold_sinks_torch",
    "gather_slots_torch",
    "mark_undefined_sinks",
    "merge_state_torch",
    "tensor_values",
]


class TensorValues(TypedDict):
    """A tensor's dtype, shape and device, as an error names them."""

    dtype: str
    shape: tuple[int, ...]
    device: str


def tensor_values(t: torch.Tensor) -> TensorValues:
    """``t``'s dtype, shape and device for an error's values
    (``FlashplanError(field, message, **tensor_values(t))``)."""
    return {"dtype": str(t.dtype), "shape": tuple(t.shape), "device": str(t.device)}


#: ``status[1]`` while no gather job has met a bad page id.
NO_BAD_JOB = 2**31 - 1

#: dtypes of the states' values the merge kernel takes.
MERGE_V_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: ... and the torch twin (the reference executor's float64 too).
_MERGE_V_DTYPES_TORCH = (*MERGE_V_DTYPES, torch.float64)


def check_gather_args(
    pages: torch.Tensor,
    jobs: tuple[torch.Tensor, ...],
    out_page: torch.Tensor,
    out_offset: torch.Tensor,
    page_map: torch.Tensor | None,
    status: torch.Tensor | None,
) -> int:
    if not isinstance(pages, torch.Tensor):
        raise FlashplanError(
            "pages", "expected an int32 [rows, max_pages] tensor", type=type(pages).__name__
        )
    if pages.dtype != torch.int32 or pages.dim() != 2:
        raise FlashplanError(
            "pages",
            "expected an int32 [rows, max_pages] tensor",
            **tensor_values(pages),
        )
    n = jobs[0].shape[0]
    for name, t in zip(("rows", "first", "counts", "dst", "div", "use_map"), jobs, strict=True):
        if t.dtype != torch.int32 or t.shape != (n,) or t.device != pages.device:
            raise FlashplanError(
                name,
                "expected an int32 [jobs] tensor on the device of pages",
                jobs=n,
                **tensor_values(t),
                pages_device=str(pages.device),
            )
        if not t.is_contiguous():
            raise FlashplanError(name, "must be contiguous", stride=tuple(t.stride()))
    for name, t in (("out_page", out_page), ("out_offset", out_offset)):
        if t.dtype not in (torch.int32, torch.int64) or t.dim() != 1 or t.device != pages.device:
            raise FlashplanError(
                name,
                "expected an int32/int64 1-D tensor on the device of pages",
                **tensor_values(t),
                pages_device=str(pages.device),
            )
    if page_map is not None and (
        page_map.dtype != torch.int32 or page_map.dim() != 1 or page_map.device != pages.device
    ):
        raise FlashplanError(
            "page_map",
            "expected an int32 1-D tensor on the device of pages",
            **tensor_values(page_map),
            pages_device=str(pages.device),
        )
    if status is not None and (
        status.dtype != torch.int32 or status.shape != (2,) or status.device != pages.device
    ):
        raise FlashplanError(
            "status",
            "expected an int32 [2] tensor on the device of pages",
            **tensor_values(status),
            pages_device=str(pages.device),
        )
    return n


def gather_slots_torch(
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
    """Same contract as :func:`gather_slots` in plain vectorized torch (no host sync:
    ``total`` is the host-known ``sum(counts)``)."""
    jobs = (rows, first, counts, dst, div, use_map)
    check_gather_args(pages, jobs, out_page, out_offset, page_map, status)
    if total == 0:
        return
    dev = pages.device
    counts64 = counts.long()
    job = torch.repeat_interleave(
        torch.arange(counts.shape[0], device=dev), counts64, output_size=total
    )
    starts = torch.cumsum(counts64, 0) - counts64
    k = torch.arange(total, device=dev) - starts[job]
    t = first.long()[job] + k
    d = div.long()[job]
    col = t // d
    row = rows.long()[job]
    fill = row < 0
    page = torch.where(fill, 0, pages[row.clamp(min=0), torch.where(fill, 0, col)].long())
    bad = (page < 0) & ~fill
    if num_pages > 0:
        bad |= (page >= num_pages) & ~fill
    if page_map is not None:
        mapped = page_map.long()[page.clamp(0, page_map.shape[0] - 1)]
        in_map = page < page_map.shape[0]
        use = (use_map[job] != 0) & ~fill
        bad |= use & (~in_map | (mapped < 0))
        page = torch.where(use, mapped, page)
    offset = torch.where(bad | fill, -1, t - col * d)
    page = torch.where(bad, 0, torch.where(fill, first.long()[job], page))
    out = dst.long()[job] + k
    out_page[out] = page.to(out_page.dtype)
    out_offset[out] = offset.to(out_offset.dtype)
    if status is not None:
        status[0] += bad.sum().to(torch.int32)
        first_bad = torch.where(bad, job, NO_BAD_JOB).min().to(torch.int32)
        status[1] = torch.minimum(status[1], first_bad)


def check_states(
    v_a: torch.Tensor,
    s_a: torch.Tensor,
    v_b: torch.Tensor,
    s_b: torch.Tensor,
    v_dtypes: tuple[torch.dtype, ...] = MERGE_V_DTYPES,
) -> None:
    """Validate shapes, dtypes and devices of two partial states (metadata only)."""
    if v_a.dim() != 3:
        raise FlashplanError("v_a", "expected [tokens, heads, head_dim]", shape=tuple(v_a.shape))
    if v_b.shape != v_a.shape:
        raise FlashplanError(
            "v_b", "must have the shape of v_a", shape=tuple(v_b.shape), v_a_shape=tuple(v_a.shape)
        )
    for name, s in (("s_a", s_a), ("s_b", s_b)):
        if s.shape != v_a.shape[:2]:
            raise FlashplanError(
                name,
                "expected [tokens, heads] of v_a",
                shape=tuple(s.shape),
                expected=tuple(v_a.shape[:2]),
            )
        if s.dtype != torch.float32:
            raise FlashplanError(name, "dtype must be torch.float32", dtype=str(s.dtype))
    for name, v in (("v_a", v_a), ("v_b", v_b)):
        if v.dtype not in v_dtypes:
            raise FlashplanError(
                name,
                "dtype not supported",
                dtype=str(v.dtype),
                supported=tuple(str(d) for d in v_dtypes),
            )
    for name, t in (("s_a", s_a), ("v_b", v_b), ("s_b", s_b)):
        if t.device != v_a.device:
            raise FlashplanError(
                name,
                "must be on the device of v_a",
                device=str(t.device),
                v_a_device=str(v_a.device),
            )


def merge_state_torch(
    v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention states in plain torch (base-2 LSE); any device.

    The CPU path of :func:`merge_state_triton`, its test oracle, and the merge that the
    reference executor uses. Same math and edge cases as the kernel: float32 (float64
    when either ``v`` is float64, which only this twin accepts), maximum factored out, a
    side with ``s = -inf`` contributes exactly 0 (its ``v`` is masked out, NaN included),
    both sides empty give ``v = 0`` and ``s = -inf``. Vectorized, no sync.

    Args:
        v_a: ``[tokens, heads, head_dim]`` bf16 / fp16 / fp32 / fp64 output over key
            key set A.
        s_a: float32 ``[tokens, heads]`` base-2 log-sum-exp of key set A; -inf = empty.
        v_b: like ``v_a`` (same shape, any of the four dtypes), key set B.
        s_b: like ``s_a``, key set B.

    Returns:
        ``(v, s)``: ``v`` contiguous ``[tokens, heads, head_dim]`` in ``v_a``'s dtype,
        ``s`` contiguous float32 ``[tokens, heads]`` base-2 log-sum-exp of the union.

    Raises:
        FlashplanError: shape, dtype or device mismatch.
    """
    check_states(v_a, s_a, v_b, s_b, _MERGE_V_DTYPES_TORCH)
    fp64 = torch.float64 in (v_a.dtype, v_b.dtype)
    math_dtype = torch.float64 if fp64 else torch.float32
    s_a = s_a.to(math_dtype)
    s_b = s_b.to(math_dtype)
    empty_a = s_a == float("-inf")
    empty_b = s_b == float("-inf")
    both = empty_a & empty_b
    nan = torch.isnan(s_a) | torch.isnan(s_b)
    zero = torch.zeros((), dtype=math_dtype, device=v_a.device)
    m0 = torch.where(both | nan, zero, torch.maximum(s_a, s_b))
    w_a = torch.where(empty_a, zero, torch.exp2(s_a - m0))
    w_b = torch.where(empty_b, zero, torch.exp2(s_b - m0))
    denom = torch.where(both, torch.ones_like(m0), w_a + w_b)
    s = torch.where(both, torch.full_like(m0, float("-inf")), m0 + torch.log2(denom))
    s = torch.where(nan, torch.full_like(m0, float("nan")), s)
    c_a = (w_a / denom).unsqueeze(-1)
    c_b = (w_b / denom).unsqueeze(-1)
    part_a = torch.where(empty_a.unsqueeze(-1), zero, v_a.to(math_dtype) * c_a)
    part_b = torch.where(empty_b.unsqueeze(-1), zero, v_b.to(math_dtype) * c_b)
    merged = torch.where(nan.unsqueeze(-1), float("nan"), part_a + part_b)
    # Elementwise ops keep the inputs' memory layout; return the kernel's (contiguous) one.
    v = merged.to(v_a.dtype).contiguous()
    return v, s.to(torch.float32).contiguous()


def fold_sinks_torch(
    v: torch.Tensor, s: torch.Tensor, sinks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold attention sinks into a state: ``(v, s)`` of a key set plus, per head ``h``,
    one more key of logit ``sinks[h]`` and value 0 (base-2 LSE in, base-2 LSE out).

    ``s' = log2(2**s + e**sinks[h])`` and ``v' = v * 2**(s - s')``: the share of the
    softmax mass that stays on the keys. A state with ``s = -inf`` (no key) becomes
    ``v' = 0`` and ``s' = sinks[h] / ln 2``. Non-finite logits follow
    ``docs/semantics.md``: ``-inf`` is no sink; NaN or ``+inf`` make the head's
    outputs and LSE NaN (:func:`mark_undefined_sinks`). Any device, vectorized, no
    sync; safe to capture in a CUDA graph.

    Args:
        v: ``[tokens, heads, head_dim]`` (any float dtype; the result keeps it).
        s: float32 ``[tokens, heads]`` base-2 log-sum-exp; -inf = no key.
        sinks: float32 ``[heads]`` sink logits, natural-log units.

    Returns:
        ``(v', s')``: ``v'`` ``[tokens, heads, head_dim]`` in ``v``'s dtype, ``s'``
        float32 ``[tokens, heads]``.
    """
    ln2 = 0.6931471805599453
    math_dtype = torch.float64 if v.dtype == torch.float64 else torch.float32
    s_e = s.to(math_dtype) * ln2  # natural log
    sink = sinks.to(device=s.device, dtype=math_dtype)[None, :]
    total = torch.logaddexp(s_e, sink)
    keep = torch.exp(s_e - total)  # 0 where s = -inf
    out = torch.where(keep[..., None] > 0, v.to(math_dtype) * keep[..., None], 0.0)
    out, lse = out.to(v.dtype), (total / ln2).float()
    mark_undefined_sinks(out, lse, sinks)
    return out, lse


def mark_undefined_sinks(out: torch.Tensor, lse: torch.Tensor | None, sinks: torch.Tensor) -> None:
    """Set, in place, the outputs and LSE of every head whose sink logit is NaN or
    ``+inf`` to NaN: the rule of ``docs/semantics.md`` (a ``-inf`` logit is no sink and
    leaves the state as it is), which every kernel path of a sink group applies, so the
    paths agree without reading the logits back on the host (one elementwise pass on
    the device, no sync; safe to capture in a CUDA graph).

    Args:
        out: ``[tokens, heads, head_dim]`` (any float dtype), written in place.
        lse: float32 ``[tokens, heads]`` (base 2), written in place, or ``None``.
        sinks: float32 ``[heads]`` sink logits on the same device.
    """
    undefined = ~(sinks < math.inf)  # NaN compares false: NaN and +inf
    out.masked_fill_(undefined[None, :, None], math.nan)
    if lse is not None:
        lse.masked_fill_(undefined[None, :], math.nan)
