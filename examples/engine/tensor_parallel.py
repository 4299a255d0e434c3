"""Tensor parallelism for the example engine: a decoder-only model's attention heads and
MLP columns split across the ranks of a ``torch.distributed`` group.

Each rank holds a contiguous block of query heads and the KV heads they read
(``fp.HeadConfig.shard``), plans the same layout with its share of the heads and keeps
its share of the KV cache. The projections are Megatron-style: ``q_proj``, ``k_proj``,
``v_proj``, ``gate_proj`` and ``up_proj`` split by output rows (column parallel),
``o_proj`` and ``down_proj`` by input columns (row parallel), whose partial outputs are
summed over the group (one all-reduce each, a bias counted once). Embeddings, norms and
the LM head are replicated, so every rank computes the same logits.

Supported: the Llama-shaped models of ``hf_models`` whose attention reshapes by
``head_dim`` (llama, mistral, gemma2, gemma3).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .hf_models import DecoderOnly

__all__ = ["shard_decoder_only"]


def _rows(linear: nn.Linear, rank: int, world: int) -> None:
    """Keep ``linear``'s output rows of this rank (column parallel)."""
    out = linear.out_features // world
    lo = rank * out
    linear.weight = nn.Parameter(linear.weight.detach()[lo : lo + out].clone())
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.detach()[lo : lo + out].clone())
    linear.out_features = out


def _columns(linear: nn.Linear, rank: int, world: int, group: Any, reduce: bool) -> None:
    """Keep ``linear``'s input columns of this rank and sum the partial outputs over
    ``group`` (row parallel; the bias is added on rank 0 only, so it counts once)."""
    width = linear.in_features // world
    lo = rank * width
    linear.weight = nn.Parameter(linear.weight.detach()[:, lo : lo + width].clone())
    if linear.bias is not None and rank != 0:
        linear.bias = nn.Parameter(torch.zeros_like(linear.bias))
    linear.in_features = width
    if not reduce:
        return

    def all_reduce(module: nn.Module, inputs: object, output: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(output, group=group)
        return output

    linear.register_forward_hook(all_reduce)


def shard_decoder_only(
    adapter: DecoderOnly, rank: int, world_size: int, group: Any = None, *, reduce: bool = True
) -> DecoderOnly:
    """Split ``adapter``'s model across ``world_size`` ranks in place (this process is
    ``rank``) and give the adapter its share of the heads; returns the adapter.
    ``reduce=False`` leaves the row-parallel outputs unsummed (a negative control: the
    ranks' logits then differ from one process's).

    Raises:
        ValueError: a model whose heads or MLP width the world size does not divide, or
            one this module does not know how to split.
    """
    heads = adapter.heads.shard(world_size)  # raises for KV heads it does not divide
    for layer in adapter.model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
            raise ValueError(f"{type(attn).__name__}: not a q/k/v/o attention")
        if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            raise ValueError(f"{type(mlp).__name__}: not a gated MLP")
        if mlp.down_proj.in_features % world_size:
            raise ValueError(f"the MLP width does not divide over {world_size} ranks")
        for linear in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
            _rows(linear, rank, world_size)
        _columns(attn.o_proj, rank, world_size, group, reduce)
        _columns(mlp.down_proj, rank, world_size, group, reduce)
    adapter.heads = heads
    return adapter
