"""Merging two partial attention states on the GPU (base-2 LSE end to end)."""

from __future__ import annotations

import torch

from flashplan.kernels.merge_state import merge_state_triton

__all__ = ["merge_state_max_heads", "merge_states"]

_MAX_THREADS_PER_BLOCK = 1024


def merge_state_max_heads(head_dim: int, element_size: int) -> int:
    """Most heads FlashInfer's ``merge_state`` CUDA kernel can launch with.

    Its block is ``(head_dim / vec_size, num_heads)`` threads with
    ``vec_size = max(16 / element_size, head_dim / 32)``; a block may not exceed
    1024 threads.
    """
    vec_size = max(16 // element_size, head_dim // 32)
    threads_x = max(head_dim // vec_size, 1)
    return _MAX_THREADS_PER_BLOCK // threads_x


def merge_states(
    v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``(v_a, s_a)`` and ``(v_b, s_b)``: v ``[tokens, heads, head_dim]``,
    s float32 ``[tokens, heads]`` base 2. FlashInfer's kernel where it can launch,
    flashplan's Triton kernel (grid over tokens x heads) beyond that."""
    heads, head_dim = v_a.shape[1], v_a.shape[2]
    if heads <= merge_state_max_heads(head_dim, v_a.element_size()):
        from flashinfer import merge_state

        return merge_state(v_a, s_a, v_b, s_b)
    return merge_state_triton(v_a, s_a, v_b, s_b)
