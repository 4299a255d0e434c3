"""Merging partial attention states (e.g. the keys of a ragged and of a paged call), and
folding attention sinks into one.

A partial state of query token ``n`` and head ``h`` over a set of keys is its output
``v[n, h, :]`` (the softmax-weighted mean of those keys' values) and its log-sum-exp
``s[n, h]`` of the scaled logits, in **base 2** (FlashInfer's convention:
``s = log2(sum_k 2^(logit_k * log2(e)))``). Two states over disjoint sets of keys merge to
the state over their union::

    s = log2(2^s_a + 2^s_b)
    v = 2^(s_a - s) · v_a + 2^(s_b - s) · v_b

computed in float32 (float64 for float64 values, torch twin only) with the maximum
factored out (no overflow for any finite lse). An
empty set has ``s = -inf`` and contributes weight 0 (its ``v`` is not even read, so
garbage there is harmless); when both are empty the result is ``v = 0``, ``s = -inf``.
NaN is never hidden: a NaN log-sum-exp on either side makes the result NaN, and a
non-empty side's ``v`` is always read, so NaN there reaches the output.

:func:`merge_state_torch` (re-exported here) lives in :mod:`flashplan.torch_kernels`, which
imports no Triton: the reference executor imports it from there and gets the same base-2
convention and the same edge cases.
"""

from __future__ import annotations

import torch

from flashplan.errors import FlashplanError
from flashplan.kernels._triton import HAS_TRITON, device_guard, runs_on_triton, tl, triton
from flashplan.torch_kernels import check_states as _check_states
from flashplan.torch_kernels import fold_sinks_torch, merge_state_torch, tensor_values

__all__ = [
    "check_sinks",
    "fold_sinks_torch",
    "fold_sinks_triton",
    "merge_state_torch",
    "merge_state_triton",
]


# Elements of v (heads x head_dim) one kernel program merges: whole heads, at least one.
# On an H200, 512-4096 all reach ~4.5 TB/s on large merges; 128 (one head) gets ~1.3.
_ELEMS_PER_PROGRAM = 2048

if HAS_TRITON:

    @triton.jit
    def _merge_state_kernel(
        v_a_ptr,
        s_a_ptr,
        v_b_ptr,
        s_b_ptr,
        sinks_ptr,
        v_out_ptr,
        s_out_ptr,
        num_heads,
        num_head_blocks,
        head_dim,
        v_a_stride_n,
        v_a_stride_h,
        v_a_stride_d,
        v_b_stride_n,
        v_b_stride_h,
        v_b_stride_d,
        s_a_stride_n,
        s_a_stride_h,
        s_b_stride_n,
        s_b_stride_h,
        HAS_B: tl.constexpr,
        HAS_SINKS: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        # One program per (token, block of BLOCK_H heads), flattened into grid axis 0: no
        # limit on the number of heads (grid axes 1 and 2 stop at 65535). Without HAS_B
        # the second state is empty (not read); with HAS_SINKS a third state joins: per
        # head one key of logit sinks[h] (natural log) and value 0 (an attention sink).
        pid = tl.program_id(0).to(tl.int64)
        n = pid // num_head_blocks
        h = (pid - n * num_head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
        h_ok = h < num_heads
        s_a = tl.load(
            s_a_ptr + n * s_a_stride_n + h * s_a_stride_h, mask=h_ok, other=float("-inf")
        ).to(tl.float32)
        if HAS_B:
            s_b = tl.load(
                s_b_ptr + n * s_b_stride_n + h * s_b_stride_h, mask=h_ok, other=float("-inf")
            ).to(tl.float32)
        else:
            s_b = tl.full([BLOCK_H], float("-inf"), tl.float32)
        if HAS_SINKS:  # base 2: a natural-log logit times log2(e)
            s_c = tl.load(sinks_ptr + h, mask=h_ok, other=float("-inf")).to(tl.float32)
            s_c = s_c * 1.4426950408889634
        else:
            s_c = tl.full([BLOCK_H], float("-inf"), tl.float32)
        empty_a = s_a == float("-inf")
        empty_b = s_b == float("-inf")
        empty_c = s_c == float("-inf")
        every = empty_a & empty_b & empty_c
        # NaN on any side makes the result NaN, and so does a +inf sink logit
        # (docs/semantics.md; torch_kernels.mark_undefined_sinks)
        nan = (s_a != s_a) | (s_b != s_b) | (s_c != s_c) | (s_c == float("inf"))
        m0 = tl.where(every | nan, 0.0, tl.maximum(tl.maximum(s_a, s_b), s_c))
        w_a = tl.where(empty_a, 0.0, tl.exp2(s_a - m0))
        w_b = tl.where(empty_b, 0.0, tl.exp2(s_b - m0))
        w_c = tl.where(empty_c, 0.0, tl.exp2(s_c - m0))
        denom = tl.where(every, 1.0, w_a + w_b + w_c)  # in [1, 3] unless all are empty
        s = tl.where(every, float("-inf"), m0 + tl.log2(denom))
        s = tl.where(nan, float("nan"), s)
        c_a = w_a / denom  # 0 for an empty side and for padding heads
        c_b = w_b / denom
        d = tl.arange(0, BLOCK_D)[None, :]
        # An empty side (LSE -inf) is not read: its v may be anything (NaN included).
        # A non-empty side is always read, so NaN in its v reaches the output.
        lim_a = tl.where(empty_a | ~h_ok, 0, head_dim)[:, None]
        v = (
            tl.load(
                v_a_ptr + n * v_a_stride_n + h[:, None] * v_a_stride_h + d * v_a_stride_d,
                mask=d < lim_a,
                other=0.0,
            ).to(tl.float32)
            * c_a[:, None]
        )
        if HAS_B:
            lim_b = tl.where(empty_b | ~h_ok, 0, head_dim)[:, None]
            v_b = tl.load(
                v_b_ptr + n * v_b_stride_n + h[:, None] * v_b_stride_h + d * v_b_stride_d,
                mask=d < lim_b,
                other=0.0,
            ).to(tl.float32)
            v = v + v_b * c_b[:, None]
        v = tl.where(nan[:, None], float("nan"), v)
        row = n * num_heads + h  # output (token, head) index; outputs are contiguous
        lim_out = tl.where(h_ok, head_dim, 0)[:, None]
        tl.store(
            v_out_ptr + row[:, None] * head_dim + d,
            v.to(v_out_ptr.dtype.element_ty),
            mask=d < lim_out,
        )
        tl.store(s_out_ptr + row, s, mask=h_ok)


def merge_state_triton(
    v_a: torch.Tensor,
    s_a: torch.Tensor,
    v_b: torch.Tensor,
    s_b: torch.Tensor,
    *,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention states with a Triton kernel (base-2 LSE).

    Grid: one program per (token, block of heads), flattened on grid axis 0, so any head
    count works; a block holds as many whole heads as fit in about 2048 elements (at
    least one head; ``head_dim`` padded to a power of two). No value is read back to the
    host. On CPU tensors the kernel runs under
    Triton's interpreter when it was defined with ``TRITON_INTERPRET=1``, otherwise this
    calls :func:`merge_state_torch`.

    Args:
        v_a: ``[tokens, heads, head_dim]`` bf16 / fp16 / fp32 output over key set A;
            any strides.
        s_a: float32 ``[tokens, heads]`` base-2 log-sum-exp of key set A; -inf = empty.
        v_b: like ``v_a`` (same shape, any of the three dtypes), key set B. (float64
            values are refused: use :func:`merge_state_torch`.)
        s_b: like ``s_a``, key set B.
        sinks: float32 ``[heads]`` attention-sink logits (natural log) to fold into the
            merged state in the same pass (:func:`fold_sinks_triton`), or ``None``.

    Returns:
        ``(v, s)``: ``v`` contiguous ``[tokens, heads, head_dim]`` in ``v_a``'s dtype
        (merged in float32, then cast), ``s`` contiguous float32 ``[tokens, heads]``
        base-2 log-sum-exp of the union (-inf where both sides are empty, with ``v = 0``).

    Raises:
        FlashplanError: shape, dtype or device mismatch.
        RuntimeError: a non-CPU device without Triton installed.
    """
    _check_states(v_a, s_a, v_b, s_b)
    if sinks is not None:
        check_sinks(sinks, v_a)
    if not runs_on_triton(v_a.device, "merge_state_torch"):
        v, s = merge_state_torch(v_a, s_a, v_b, s_b)
        return (v, s) if sinks is None else fold_sinks_torch(v, s, sinks)
    return _launch(v_a, s_a, (v_b, s_b), sinks)


def fold_sinks_triton(
    v: torch.Tensor, s: torch.Tensor, sinks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold attention sinks into a partial state in one launch (base-2 LSE): per head
    ``h`` one more key of logit ``sinks[h]`` and value 0 joins the state, so
    ``s' = log2(2**s + e**sinks[h])`` and ``v' = v * 2**(s - s')``
    (:func:`~flashplan.torch_kernels.fold_sinks_torch`, which runs on CPU tensors
    without Triton's interpreter). A state with ``s = -inf`` gives ``v' = 0`` and
    ``s' = sinks[h] / ln 2``. No sync; safe to capture in a CUDA graph.

    Args:
        v: ``[tokens, heads, head_dim]`` bf16 / fp16 / fp32 output; any strides.
        s: float32 ``[tokens, heads]`` base-2 log-sum-exp; -inf = no key.
        sinks: float32 ``[heads]`` sink logits (natural log), on ``v``'s device.

    Returns:
        ``(v', s')``: contiguous, ``v'`` in ``v``'s dtype, ``s'`` float32.

    Raises:
        FlashplanError: shape, dtype or device mismatch.
    """
    _check_states(v, s, v, s)
    check_sinks(sinks, v)
    if not runs_on_triton(v.device, "fold_sinks_torch"):
        return fold_sinks_torch(v, s, sinks)
    return _launch(v, s, None, sinks)


def check_sinks(sinks: torch.Tensor, v: torch.Tensor) -> None:
    """``sinks`` must be float32 ``[heads]`` of ``v`` ``[tokens, heads, head_dim]``, on
    its device (metadata only)."""
    if sinks.dtype != torch.float32 or sinks.shape != (v.shape[1],) or sinks.device != v.device:
        raise FlashplanError(
            "sinks", "expected float32 [heads] on the device of the state",
            heads=v.shape[1], **tensor_values(sinks), state_device=str(v.device),
        )  # fmt: skip


def _launch(
    v_a: torch.Tensor,
    s_a: torch.Tensor,
    b: tuple[torch.Tensor, torch.Tensor] | None,
    sinks: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One merge launch over ``a``, ``b`` (or none) and ``sinks`` (or none)."""
    v_b, s_b = b if b is not None else (v_a, s_a)
    tokens, heads, head_dim = v_a.shape
    v = torch.empty((tokens, heads, head_dim), dtype=v_a.dtype, device=v_a.device)
    s = torch.empty((tokens, heads), dtype=torch.float32, device=v_a.device)
    if tokens * heads == 0:
        return v, s
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_h = min(triton.next_power_of_2(heads), max(1, _ELEMS_PER_PROGRAM // block_d))
    head_blocks = triton.cdiv(heads, block_h)
    with device_guard(v_a.device):
        _merge_state_kernel[(tokens * head_blocks,)](
            v_a,
            s_a,
            v_b,
            s_b,
            sinks if sinks is not None else s_a,
            v,
            s,
            heads,
            head_blocks,
            head_dim,
            *v_a.stride(),
            *v_b.stride(),
            *s_a.stride(),
            *s_b.stride(),
            HAS_B=b is not None,
            HAS_SINKS=sinks is not None,
            BLOCK_H=block_h,
            BLOCK_D=block_d,
            num_warps=max(1, min(8, block_h * block_d // 256)),
        )
    return v, s
