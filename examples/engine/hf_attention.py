"""Hugging Face attention through flashplan: the convention mapping and the attention function.

transformers calls a registered attention function from every attention module as
``fn(module, query, key, value, attention_mask, scaling=..., dropout=..., [sliding_window=...,
softcap=...,] **kwargs)`` with ``query`` ``[batch, heads, tokens, head_dim]``. The engine feeds
one packed row (``batch = 1``) holding every new token of the step, and passes a
:class:`StepContext` as the keyword argument ``flashplan``; the function below turns each call
into one ``executor.run(group, q, k_new, v_new, kv_cache)``.

HF's conventions map to flashplan's in exactly one place each: :func:`hf_window_left`,
:func:`hf_sm_scale` and :func:`hf_soft_cap`, bundled in :class:`HFConventions` so that a test
can swap one for a wrong one and watch parity fail.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn
from transformers import AttentionInterface

import flashplan as fp

#: The name under which :func:`flashplan_attention` is registered with transformers. Not
#: "flashplan": transformers takes any name containing "flash" for a FlashAttention flavour
#: (``is_flash_attention_requested``) and tries to load such a kernel.
ATTN_IMPLEMENTATION = "fplan"


# -- the three conventions, one function each -------------------------------------------------
def hf_window_left(sliding_window: int | None) -> int:
    """HF ``sliding_window`` S (a query sees itself and the S − 1 keys before it: S keys)
    -> flashplan ``window_left`` = S − 1 (keys ``p − window_left .. p``); ``None`` -> −1 (full)."""
    return -1 if sliding_window is None else int(sliding_window) - 1


def hf_sm_scale(scaling: float) -> float:
    """HF ``scaling`` (``module.scaling``: ``head_dim**-0.5``, or Gemma's
    ``query_pre_attn_scalar**-0.5``) -> flashplan ``sm_scale``. Always explicit: flashplan's
    default, ``1 / sqrt(head_dim)``, is wrong for Gemma."""
    return float(scaling)


def hf_soft_cap(softcap: float | None) -> float:
    """HF ``softcap`` (Gemma 2's ``attn_logit_softcapping``: ``cap * tanh(logits / cap)`` on the
    scaled logits) -> flashplan ``logits_soft_cap``; ``None`` -> 0.0 (off)."""
    return 0.0 if softcap is None else float(softcap)


class Kind(enum.Enum):
    """What an attention module computes, hence its group and cache."""

    SELF = "self"  # decoder self-attention: causal, maybe windowed, cached
    ENCODER = "encoder"  # encoder self-attention: bidirectional, no cache
    CROSS = "cross"  # decoder -> encoder attention, shares the decoder layer's cache


class HFCall(NamedTuple):
    """The attention arguments an HF module passes to its attention function."""

    scaling: float
    sliding_window: int | None = None
    softcap: float | None = None


@dataclass(frozen=True)
class HFConventions:
    """HF -> flashplan mapping of one attention call to its :class:`flashplan.AttentionGroup`."""

    window_left: Callable[[int | None], int] = hf_window_left
    sm_scale: Callable[[float], float] = hf_sm_scale
    soft_cap: Callable[[float | None], float] = hf_soft_cap

    def group(self, kind: Kind, call: HFCall) -> fp.AttentionGroup:
        """The group of a call of ``kind`` with HF arguments ``call``."""
        scale, cap = self.sm_scale(call.scaling), self.soft_cap(call.softcap)
        if kind is Kind.CROSS:
            return fp.AttentionGroup.cross(logits_soft_cap=cap, sm_scale=scale)
        if kind is Kind.ENCODER:
            return fp.AttentionGroup.bidirectional(logits_soft_cap=cap, sm_scale=scale)
        window = self.window_left(call.sliding_window)
        return fp.AttentionGroup(window_left=window, logits_soft_cap=cap, sm_scale=scale)


def expected_call(module: nn.Module) -> HFCall:
    """What ``module`` will pass its attention function, read from the module the way the
    modeling code reads it, so that groups can be planned before the forward. (Mistral passes
    ``config.sliding_window``; Gemma and Qwen2 set ``module.sliding_window`` per layer type.)
    If this disagrees with the real call, ``run`` raises ``PlanMismatchError``: never silent."""
    window = getattr(module, "sliding_window", getattr(module.config, "sliding_window", None))
    return HFCall(float(module.scaling), window, getattr(module, "attn_logit_softcapping", None))


@dataclass(frozen=True)
class Binding:
    """An attention module's kind and the index of its KV cache (``None``: no cache)."""

    kind: Kind
    cache: int | None


@dataclass(frozen=True)
class StepContext:
    """Everything the attention function needs for one forward, passed as ``flashplan=``.

    Attributes:
        executor: an executor on which this forward's plan was applied.
        bindings: every attention module of the model -> its :class:`Binding`.
        kv_caches: one cache per decoder layer, ``[num_pages, 2, page_size, kv_heads,
            head_dim]`` in the model's dtype.
        conventions: the HF -> flashplan mapping.
    """

    executor: fp.Executor
    bindings: Mapping[nn.Module, Binding]
    kv_caches: list[torch.Tensor]
    conventions: HFConventions


def _tokens_first(x: torch.Tensor) -> torch.Tensor:
    """HF ``[1, heads, tokens, head_dim]`` -> flashplan ``[tokens, heads, head_dim]``."""
    if x.shape[0] != 1:
        raise ValueError(f"flashplan attention expects one packed row, got batch {x.shape[0]}")
    return x[0].transpose(0, 1).contiguous()


def flashplan_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """One HF attention call as one ``executor.run``.

    Args:
        module: the HF attention module (looked up in ``kwargs["flashplan"].bindings``).
        query: ``[1, num_qo_heads, total_q, head_dim]``, RoPE applied.
        key, value: ``[1, num_kv_heads, rows, head_dim]``: the step's new tokens (self), or
            the encoder rows to write (cross: the uncached requests', ``spec.total_encoder``
            rows, after which the caller may add a placeholder row: see ``EncoderDecoder``).
        attention_mask: ``None`` (a registered function gets no mask from transformers; the
            plan holds the masking).
        scaling, sliding_window, softcap: HF's attention arguments (:class:`HFCall`).

    Returns:
        ``([1, total_q, num_qo_heads, head_dim], None)``, what HF's attention functions return.
    """
    ctx: StepContext = kwargs["flashplan"]
    if attention_mask is not None or (dropout and module.training):
        raise ValueError("flashplan attention runs in eval mode, without an HF mask")
    if scaling is None:
        raise ValueError(f"{type(module).__name__} passed no scaling")
    binding = ctx.bindings[module]
    group = ctx.conventions.group(binding.kind, HFCall(scaling, sliding_window, softcap))
    q, k, v = _tokens_first(query), _tokens_first(key), _tokens_first(value)
    if binding.kind is Kind.CROSS:  # the plan's encoder rows to write (0: all cached)
        rows = ctx.executor.spec.total_encoder if ctx.executor.spec else 0
        k, v = (k[:rows], v[:rows]) if rows else (None, None)
    cache = None if binding.cache is None else ctx.kv_caches[binding.cache]
    out = ctx.executor.run(group, q, k, v, cache)
    return out.unsqueeze(0), None


AttentionInterface.register(ATTN_IMPLEMENTATION, flashplan_attention)
