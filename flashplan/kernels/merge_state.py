"""Merging two partial attention states (e.g. the keys of a ragged and of a paged call).

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

from flashplan.kernels._triton import HAS_TRITON, device_guard, runs_on_triton, tl, triton
from flashplan.torch_kernels import check_states as _check_states
from flashplan.torch_kernels import merge_state_torch

__all__ = ["merge_state_torch", "merge_state_triton"]


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
        BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        # One program per (token, block of BLOCK_H heads), flattened into grid axis 0: no
        # limit on the number of heads (grid axes 1 and 2 stop at 65535).
        pid = tl.program_id(0).to(tl.int64)
        n = pid // num_head_blocks
        h = (pid - n * num_head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
        h_ok = h < num_heads
        s_a = tl.load(
            s_a_ptr + n * s_a_stride_n + h * s_a_stride_h, mask=h_ok, other=float("-inf")
        ).to(tl.float32)
        s_b = tl.load(
            s_b_ptr + n * s_b_stride_n + h * s_b_stride_h, mask=h_ok, other=float("-inf")
        ).to(tl.float32)
        empty_a = s_a == float("-inf")
        empty_b = s_b == float("-inf")
        both = empty_a & empty_b
        nan = (s_a != s_a) | (s_b != s_b)  # NaN on either side makes the result NaN
        m0 = tl.where(both | nan, 0.0, tl.maximum(s_a, s_b))
        w_a = tl.where(empty_a, 0.0, tl.exp2(s_a - m0))
        w_b = tl.where(empty_b, 0.0, tl.exp2(s_b - m0))
        denom = tl.where(both, 1.0, w_a + w_b)  # in [1, 2] when some side is not empty
        s = tl.where(both, float("-inf"), m0 + tl.log2(denom))
        s = tl.where(nan, float("nan"), s)
        c_a = w_a / denom  # 0 for an empty side and for padding heads
        c_b = w_b / denom
        d = tl.arange(0, BLOCK_D)[None, :]
        # An empty side (LSE -inf) is not read: its v may be anything (NaN included).
        # A non-empty side is always read, so NaN in its v reaches the output.
        lim_a = tl.where(empty_a | ~h_ok, 0, head_dim)[:, None]
        lim_b = tl.where(empty_b | ~h_ok, 0, head_dim)[:, None]
        v_a = tl.load(
            v_a_ptr + n * v_a_stride_n + h[:, None] * v_a_stride_h + d * v_a_stride_d,
            mask=d < lim_a,
            other=0.0,
        ).to(tl.float32)
        v_b = tl.load(
            v_b_ptr + n * v_b_stride_n + h[:, None] * v_b_stride_h + d * v_b_stride_d,
            mask=d < lim_b,
            other=0.0,
        ).to(tl.float32)
        v = v_a * c_a[:, None] + v_b * c_b[:, None]
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
    v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
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

    Returns:
        ``(v, s)``: ``v`` contiguous ``[tokens, heads, head_dim]`` in ``v_a``'s dtype
        (merged in float32, then cast), ``s`` contiguous float32 ``[tokens, heads]``
        base-2 log-sum-exp of the union (-inf where both sides are empty, with ``v = 0``).

    Raises:
        FlashplanError: shape, dtype or device mismatch.
        RuntimeError: a non-CPU device without Triton installed.
    """
    _check_states(v_a, s_a, v_b, s_b)
    if not runs_on_triton(v_a.device, "merge_state_torch"):
        return merge_state_torch(v_a, s_a, v_b, s_b)
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
            v,
            s,
            heads,
            head_blocks,
            head_dim,
            *v_a.stride(),
            *v_b.stride(),
            *s_a.stride(),
            *s_b.stride(),
            BLOCK_H=block_h,
            BLOCK_D=block_d,
            num_warps=max(1, min(8, block_h * block_d // 256)),
        )
    return v, s
