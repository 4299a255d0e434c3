"""Hugging Face attention through flashplan: the convention mapping and the attention function.

transformers calls a registered attention function from every attention module as
``fn(module, query, key, value, attention_mask, scaling=..., dropout=..., [sliding_window=...,
softcap=...,] **kwargs)`` with ``query`` ``[batch, heads, tokens, head_dim]``. The engine feeds
one packed row (``batch = 1``) holding every new token of the step, and passes a
:class:`StepContext` as the keyword argument ``flashplan``; the function below turns each call
into one ``executor.run(group, q, k_new, v_new, kv_cache[, sinks=...])``. Under
``torch.compile`` (a context from :meth:`StepContext.for_compile`) it runs the custom op
``flashplan::run`` instead, each module's group resolved before tracing.

HF's conventions map to flashplan's in exactly one place each: :func:`hf_window_left`,
:func:`hf_sm_scale`, :func:`hf_soft_cap`, :func:`hf_sink_logits` (gpt-oss),
:func:`hf_chunk_size` (Llama 4) and :func:`hf_bidirectional_window` (EmbeddingGemma,
ModernBERT), bundled in :class:`HFConventions` so that a test can swap one for a wrong one and
watch parity fail. They map what a module passes its attention function. What a user holds is
the config: :func:`hf_config_groups` maps a config object to each layer's group, family by
family, as the one table of docs/guide-local-attention.md states it (the tests check that it
gives the groups the modules' calls give, and the keys HF's own masks keep).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, NamedTuple, cast

import torch
from torch import nn
from transformers import AttentionInterface, PretrainedConfig

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


def hf_sink_logits(s_aux: torch.Tensor | None) -> torch.Tensor | None:
    """HF ``s_aux`` (gpt-oss passes ``module.sinks``: one learned logit per query head,
    ``[num_attention_heads]`` in the model's dtype, concatenated by HF's eager attention as an
    extra logit column that is softmaxed with the scaled logits and then dropped) -> flashplan's
    run-time sink logits, float32 ``[num_qo_heads]`` (natural-log units, not scaled or capped),
    whose presence also marks the group ``sinks=True``; ``None`` -> ``None`` (no sinks)."""
    return None if s_aux is None else s_aux.detach().float()


def hf_chunk_size(attention_chunk_size: int | None) -> int:
    """HF ``attention_chunk_size`` C of a ``"chunked_attention"`` layer (Llama 4: the query at
    position p sees keys k <= p with k // C == p // C; see :func:`hf_layer_chunk`) -> flashplan
    ``attention_chunk_size`` = C (keys ``C * (p // C) .. p``); ``None`` -> 0 (no chunks)."""
    return 0 if attention_chunk_size is None else int(attention_chunk_size)


def hf_bidirectional_window(sliding_window: int | None) -> tuple[int, int]:
    """The ``sliding_window`` S a bidirectional layer passes its attention function (HF's
    exclusive bound: the layer's mask keeps the keys with |q − k| < S) -> flashplan
    ``(window_left, window_right)`` = (S − 1, S − 1); ``None`` -> (−1, −1) (every key of the
    request). EmbeddingGemma passes its config's ``sliding_window`` (which
    ``Gemma3TextConfig(use_bidirectional_attention=True)`` has already turned from the
    configured W into S = W // 2 + 1); ModernBERT passes ``local_attention // 2 + 1`` (its
    mask keeps |q − k| <= ``config.sliding_window`` = ``local_attention // 2``). Both give
    S − 1: W // 2 and ``local_attention // 2``."""
    if sliding_window is None:
        return -1, -1
    return int(sliding_window) - 1, int(sliding_window) - 1


def hf_layer_chunk(module: nn.Module) -> int | None:
    """The chunk of ``module``'s layer: ``config.attention_chunk_size`` on a layer whose
    ``config.layer_types[module.layer_idx]`` is ``"chunked_attention"`` (Llama 4), else
    ``None``. HF builds the chunk into the mask and never passes it to the attention function,
    so both the planner (:func:`expected_call`) and the attention function read it here."""
    config = getattr(module, "config", None)
    layer_types = getattr(config, "layer_types", None)
    idx = getattr(module, "layer_idx", None)
    if layer_types is None or idx is None or layer_types[idx] != "chunked_attention":
        return None
    return int(config.attention_chunk_size)


# -- a config object, family by family (the table of docs/guide-local-attention.md) -------------
def _head_scale(config: PretrainedConfig) -> float:
    """``head_dim**-0.5`` (``head_dim``, else ``hidden_size // num_attention_heads``): the
    ``scaling`` of Mistral, gpt-oss, Llama 4 and ModernBERT."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return float(head_dim**-0.5)


def _mistral_group(config: PretrainedConfig, layer_type: str) -> fp.AttentionGroup:
    """Mistral: every layer passes ``config.sliding_window`` S (``None``: full)."""
    return fp.AttentionGroup(
        window_left=hf_window_left(config.sliding_window), sm_scale=_head_scale(config)
    )


def _gemma_group(config: PretrainedConfig, layer_type: str) -> fp.AttentionGroup:
    """Gemma 2, Gemma 3 and EmbeddingGemma (Gemma 3 with ``use_bidirectional_attention``):
    ``config.sliding_window`` S on ``"sliding_attention"`` layers, scale
    ``query_pre_attn_scalar**-0.5``; Gemma 2's ``attn_logit_softcapping`` (Gemma 3's modules
    never pass theirs)."""
    window = config.sliding_window if layer_type == "sliding_attention" else None
    scale = hf_sm_scale(config.query_pre_attn_scalar**-0.5)
    if getattr(config, "use_bidirectional_attention", False):
        left, right = hf_bidirectional_window(window)
        return fp.AttentionGroup.bidirectional(window_left=left, window_right=right, sm_scale=scale)
    cap = config.attn_logit_softcapping if config.model_type == "gemma2" else None
    return fp.AttentionGroup(
        window_left=hf_window_left(window), logits_soft_cap=hf_soft_cap(cap), sm_scale=scale
    )


def _gpt_oss_group(config: PretrainedConfig, layer_type: str) -> fp.AttentionGroup:
    """gpt-oss: ``config.sliding_window`` S on ``"sliding_attention"`` layers; sinks on all."""
    window = config.sliding_window if layer_type == "sliding_attention" else None
    return fp.AttentionGroup(
        window_left=hf_window_left(window), sinks=True, sm_scale=_head_scale(config)
    )


def _llama4_group(config: PretrainedConfig, layer_type: str) -> fp.AttentionGroup:
    """Llama 4: ``config.attention_chunk_size`` C on ``"chunked_attention"`` layers."""
    chunk = config.attention_chunk_size if layer_type == "chunked_attention" else None
    return fp.AttentionGroup(
        attention_chunk_size=hf_chunk_size(chunk), sm_scale=_head_scale(config)
    )


def _modernbert_group(config: PretrainedConfig, layer_type: str) -> fp.AttentionGroup:
    """ModernBERT: keys with |q − k| <= ``local_attention // 2`` on ``"sliding_attention"``
    layers (``config.sliding_window`` is that radius itself, not S with S − 1 to see)."""
    radius = config.local_attention // 2 if layer_type == "sliding_attention" else -1
    return fp.AttentionGroup.bidirectional(
        window_left=radius, window_right=radius, sm_scale=_head_scale(config)
    )


#: ``config.model_type`` -> the group of one layer of that family, from the config and the
#: layer's ``config.layer_types`` entry.
_FAMILIES: dict[str, Callable[[PretrainedConfig, str], fp.AttentionGroup]] = {
    "mistral": _mistral_group,
    "gemma2": _gemma_group,
    "gemma3_text": _gemma_group,
    "gpt_oss": _gpt_oss_group,
    "llama4_text": _llama4_group,
    "modernbert": _modernbert_group,
}


def hf_config_groups(config: PretrainedConfig) -> tuple[fp.AttentionGroup, ...]:
    """Each layer's group (``num_hidden_layers`` of them, in layer order), read from a
    Hugging Face config object as docs/guide-local-attention.md's table states it: Mistral,
    Gemma 2, Gemma 3 and EmbeddingGemma (``Gemma3TextConfig``), gpt-oss, Llama 4 (text) and
    ModernBERT. The config is the constructed object, not its JSON:
    ``Gemma3TextConfig(use_bidirectional_attention=True)`` holds ``sliding_window`` = W // 2 + 1
    for a configured W. Groups carry the window, chunk, sinks, soft cap and an explicit
    ``sm_scale``, as the engine builds them from the modules' calls.

    Raises:
        ValueError: a ``model_type`` the table does not cover.
    """
    family = _FAMILIES.get(config.model_type)
    if family is None:
        raise ValueError(
            f"model_type {config.model_type!r} has no mapping; known: {sorted(_FAMILIES)}"
        )
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    return tuple(family(config, t) for t in types[: config.num_hidden_layers])


class Kind(enum.Enum):
    """What an attention module computes, hence its group and cache."""

    SELF = "self"  # decoder self-attention: causal, maybe windowed or chunked, cached
    ENCODER = "encoder"  # encoder self-attention: bidirectional, maybe windowed (no cache for
    # BART's ragged pass; a scratch cache for EmbeddingGemma's paged one)
    CROSS = "cross"  # decoder -> encoder attention, shares the decoder layer's cache


class HFCall(NamedTuple):
    """The attention arguments an HF module passes to its attention function."""

    scaling: float
    sliding_window: int | None = None
    softcap: float | None = None
    s_aux: torch.Tensor | None = None  # gpt-oss's sink logits (``module.sinks``)
    chunk: int | None = None  # not passed: the layer's chunk (:func:`hf_layer_chunk`)


@dataclass(frozen=True)
class HFConventions:
    """HF -> flashplan mapping of one attention call to its :class:`flashplan.AttentionGroup`."""

    window_left: Callable[[int | None], int] = hf_window_left
    sm_scale: Callable[[float], float] = hf_sm_scale
    soft_cap: Callable[[float | None], float] = hf_soft_cap
    sink_logits: Callable[[torch.Tensor | None], torch.Tensor | None] = hf_sink_logits
    chunk_size: Callable[[int | None], int] = hf_chunk_size
    bidirectional_window: Callable[[int | None], tuple[int, int]] = hf_bidirectional_window

    def resolve(self, kind: Kind, call: HFCall) -> tuple[fp.AttentionGroup, torch.Tensor | None]:
        """The group of a call of ``kind`` with HF arguments ``call``, and the sink logits its
        ``run`` takes (float32 ``[num_qo_heads]``, or ``None`` for a group without sinks)."""
        scale, cap = self.sm_scale(call.scaling), self.soft_cap(call.softcap)
        sinks = self.sink_logits(call.s_aux)
        has_sinks = sinks is not None
        if kind is Kind.CROSS:
            group = fp.AttentionGroup.cross(logits_soft_cap=cap, sm_scale=scale, sinks=has_sinks)
        elif kind is Kind.ENCODER:
            left, right = self.bidirectional_window(call.sliding_window)
            group = fp.AttentionGroup.bidirectional(
                window_left=left, window_right=right, logits_soft_cap=cap, sm_scale=scale,
                sinks=has_sinks,
            )  # fmt: skip
        else:
            group = fp.AttentionGroup(
                window_left=self.window_left(call.sliding_window),
                attention_chunk_size=self.chunk_size(call.chunk),
                logits_soft_cap=cap,
                sm_scale=scale,
                sinks=has_sinks,
            )
        return group, sinks

    def group(self, kind: Kind, call: HFCall) -> fp.AttentionGroup:
        """The group of a call of ``kind`` with HF arguments ``call``."""
        return self.resolve(kind, call)[0]


def planned_groups(
    bindings: Mapping[nn.Module, Binding], conventions: HFConventions
) -> dict[Kind, tuple[fp.AttentionGroup, ...]]:
    """Each kind's attention groups, one per distinct group of its modules (in module
    order), planned before the forward from what each module will pass
    (:func:`expected_call`)."""
    groups: dict[Kind, dict[fp.AttentionGroup, None]] = {k: {} for k in Kind}
    for module, b in bindings.items():
        groups[b.kind][conventions.group(b.kind, expected_call(module))] = None
    return {k: tuple(g) for k, g in groups.items()}


def expected_call(module: nn.Module) -> HFCall:
    """What ``module`` will pass its attention function, read from the module the way the
    modeling code reads it, so that groups can be planned before the forward. (Mistral passes
    ``config.sliding_window``; Gemma, Qwen2, gpt-oss and ModernBERT set
    ``module.sliding_window`` per layer type; gpt-oss passes ``s_aux=module.sinks``.) If this
    disagrees with the real call, ``run`` raises ``PlanMismatchError``: never silent."""
    window = getattr(module, "sliding_window", getattr(module.config, "sliding_window", None))
    cap = getattr(module, "attn_logit_softcapping", None)
    s_aux = getattr(module, "sinks", None)
    s_aux = s_aux if isinstance(s_aux, torch.Tensor) else None
    scaling = getattr(module, "scaling", None)
    if scaling is None:  # ModernBERT keeps none and passes scaling=module.head_dim**-0.5
        scaling = cast(int, module.head_dim) ** -0.5
    return HFCall(float(scaling), window, cap, s_aux, hf_layer_chunk(module))


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
        kv_scales: an fp8 cache's ``(k_scale, v_scale)`` (every layer's), else ``None``.
    """

    executor: fp.Executor
    bindings: Mapping[nn.Module, Binding]
    kv_caches: list[torch.Tensor]
    conventions: HFConventions
    kv_scales: tuple[float, float] | None = None
    compiled: Mapping[nn.Module, CompiledCall] | None = None

    def for_compile(self) -> StepContext:
        """This context with every self-attention module's call resolved ahead of time
        (:class:`CompiledCall`), for a forward under ``torch.compile``: the attention
        function then runs the custom op ``flashplan::run`` (``fp.attention``), which the
        compiler keeps whole, and builds no record while it is traced.

        Raises:
            ValueError: a cross-attention or encoder module (their calls depend on the
                applied plan's encoder rows: eager only).
        """
        calls = {}
        for module, b in self.bindings.items():
            if b.kind is not Kind.SELF or b.cache is None:
                raise ValueError("only decoder self-attention runs compiled")
            call = expected_call(module)
            group, sinks = self.conventions.resolve(b.kind, call)
            op = fp.AttentionOp(self.executor, group)
            calls[module] = CompiledCall(op, call, sinks, self.kv_caches[b.cache])
        return replace(self, compiled=calls)


@dataclass(frozen=True)
class CompiledCall:
    """One module's attention call, resolved before a compiled forward is traced.

    Attributes:
        op: the custom op's reference to the executor and the module's group.
        expected: the arguments the module will pass (:func:`expected_call`); the traced
            call must pass these, else :class:`~flashplan.PlanMismatchError`.
        sinks: the run-time sink logits (float32 ``[num_qo_heads]``) or ``None``.
        cache: the module's KV cache.
    """

    op: fp.AttentionOp
    expected: HFCall
    sinks: torch.Tensor | None
    cache: torch.Tensor


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
    s_aux: torch.Tensor | None = None,
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
        scaling, sliding_window, softcap, s_aux: HF's attention arguments (:class:`HFCall`;
            ``s_aux``: gpt-oss's sink logits, ``[num_qo_heads]`` in the model's dtype). The
            layer's chunk (Llama 4) is not an argument: it is read from ``module``.

    Returns:
        ``([1, total_q, num_qo_heads, head_dim], None)``, what HF's attention functions return.
    """
    ctx: StepContext = kwargs["flashplan"]
    if attention_mask is not None or (dropout and module.training):
        raise ValueError("flashplan attention runs in eval mode, without an HF mask")
    if scaling is None:
        raise ValueError(f"{type(module).__name__} passed no scaling")
    if ctx.compiled is not None:
        return _compiled_attention(ctx, module, query, key, value, scaling, sliding_window,
                                   softcap, s_aux), None  # fmt: skip
    binding = ctx.bindings[module]
    call = HFCall(scaling, sliding_window, softcap, s_aux, hf_layer_chunk(module))
    group, sinks = ctx.conventions.resolve(binding.kind, call)
    q, k, v = _tokens_first(query), _tokens_first(key), _tokens_first(value)
    if binding.kind is Kind.CROSS:  # the plan's encoder rows to write (0: all cached)
        rows = ctx.executor.spec.total_encoder if ctx.executor.spec else 0
        k, v = (k[:rows], v[:rows]) if rows else (None, None)
    cache = None if binding.cache is None else ctx.kv_caches[binding.cache]
    if ctx.kv_scales is not None and cache is not None:  # an fp8 cache and its scales
        k_scale, v_scale = ctx.kv_scales
        out = ctx.executor.run(group, q, k, v, cache, sinks=sinks, k_scale=k_scale, v_scale=v_scale)
    else:
        out = ctx.executor.run(group, q, k, v, cache, sinks=sinks)
    return out.unsqueeze(0), None


def _compiled_attention(
    ctx: StepContext,
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
    sliding_window: int | None,
    softcap: float | None,
    s_aux: torch.Tensor | None,
) -> torch.Tensor:
    """:func:`flashplan_attention` under ``torch.compile``: the module's call resolved
    ahead of time (:meth:`StepContext.for_compile`), its arguments checked against it
    (constants while tracing: the check costs nothing per step), then the custom op."""
    assert ctx.compiled is not None
    entry = ctx.compiled[module]
    want = entry.expected
    same = (scaling, sliding_window, softcap) == (want.scaling, want.sliding_window, want.softcap)
    if not same or s_aux is not want.s_aux or hf_layer_chunk(module) != want.chunk:
        raise fp.PlanMismatchError(
            "group", "the module's attention call is not the one planned",
            module=type(module).__name__,
        )  # fmt: skip
    q, k, v = _tokens_first(query), _tokens_first(key), _tokens_first(value)
    scales = ctx.kv_scales
    if scales is not None:
        out = fp.attention(entry.op, q, k, v, entry.cache, sinks=entry.sinks,
                           k_scale=scales[0], v_scale=scales[1])  # fmt: skip
    else:
        out = fp.attention(entry.op, q, k, v, entry.cache, sinks=entry.sinks)
    return out.unsqueeze(0)


AttentionInterface.register(ATTN_IMPLEMENTATION, flashplan_attention)
