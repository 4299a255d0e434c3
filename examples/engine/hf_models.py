"""The models the engine runs: tiny random-weight configs, loading, and per-family adapters.

An adapter says which HF attention module is which (:class:`~hf_attention.Binding`) and runs
one packed forward. Decoder-only models (gpt-oss and Llama 4 included) go through HF's own
``forward`` with ``position_ids = spec.positions``. BART's ``forward`` derives its learned
positions from a cache length, which a packed batch of several requests has not, so its
adapter calls BART's own modules in the order ``BartEncoder`` / ``BartDecoder.forward`` do,
with per-request positions. Encoder-only models (EmbeddingGemma: Gemma 3 with
``use_bidirectional_attention``; ModernBERT; both loaded with ``AutoModel``) have no LM head
and no decoding: :class:`EncoderOnly` returns last hidden states (``engine.embed``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    BartConfig,
    Gemma2Config,
    Gemma3TextConfig,
    GptOssConfig,
    Llama4TextConfig,
    LlamaConfig,
    MistralConfig,
    ModernBertConfig,
    PretrainedConfig,
)

import flashplan as fp

from .hf_attention import ATTN_IMPLEMENTATION, Binding, Kind, StepContext

# Shared sizes: head_dim 64 (a FlashInfer head size), 4 query heads on 2 KV heads (GQA).
_DECODER = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=512,
    initializer_range=0.1,
)

#: ``--model`` name -> a tiny config (random weights, built with no download).
TINY_CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    "llama": lambda: LlamaConfig(num_hidden_layers=2, **_DECODER),
    # Alternating sliding (window 6) and full layers, soft cap 2, scale 32**-0.5 (not 64**-0.5).
    "gemma2": lambda: Gemma2Config(
        num_hidden_layers=4,
        sliding_window=6,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=30.0,
        query_pre_attn_scalar=32,
        **_DECODER,
    ),
    # Two sliding layers (window 5: narrower than a 16-token page) per full one.
    "gemma3": lambda: Gemma3TextConfig(
        num_hidden_layers=3,
        sliding_window=5,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        query_pre_attn_scalar=48,
        **_DECODER,
    ),
    "mistral": lambda: MistralConfig(num_hidden_layers=2, sliding_window=5, **_DECODER),
    "bart": lambda: BartConfig(
        vocab_size=512,
        d_model=128,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=256,
        decoder_ffn_dim=256,
        max_position_embeddings=256,
        init_std=0.1,
    ),
    # Attention sinks on every layer; sliding (window 6) and full layers alternating (the
    # default layer_types). YaRN as in gpt-oss, its factor matching the sizes (no HF warning).
    "gpt-oss": lambda: GptOssConfig(
        num_hidden_layers=2,
        sliding_window=6,
        # every expert active: a bf16 run cannot flip a discrete router choice, so the
        # GPU parity test (bf16 engine vs fp32 HF) measures attention, not routing
        num_local_experts=2,
        num_experts_per_tok=2,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 128,
        },
        **_DECODER,
    ),
    # Chunked attention (chunk 8, inside a 16-token page) on the three RoPE layers, full NoPE
    # attention on the fourth (no_rope_layers' default interval 4); MoE on layers 1 and 3 (one
    # routed expert: see gpt-oss's comment).
    # attn_temperature_tuning (default on) is exact only below floor_scale tokens: see
    # DecoderOnly.max_tokens.
    "llama4": lambda: Llama4TextConfig(
        num_hidden_layers=4,
        attention_chunk_size=8,
        intermediate_size_mlp=256,
        num_local_experts=1,  # one routed expert (and the shared one): no discrete choice
        interleave_moe_layer_step=2,
        **_DECODER,
    ),
    # EmbeddingGemma-style encoder: bidirectional; the configured window 10 becomes HF's
    # sliding_window 10 // 2 + 1 = 6 (keys with |q - k| <= 5) on two sliding layers per full
    # (fully bidirectional) one. AutoModel: Gemma3TextModel, no LM head.
    "embeddinggemma": lambda: Gemma3TextConfig(
        num_hidden_layers=3,
        sliding_window=10,
        use_bidirectional_attention=True,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        query_pre_attn_scalar=48,
        **_DECODER,
    ),
    # ModernBERT encoder: bidirectional; local_attention 8 (keys with |q - k| <= 8 // 2 = 4:
    # HF's config.sliding_window, which the modules pass as 4 + 1) on layers 1 and 2, full
    # bidirectional attention on layer 0 (global_attn_every_n_layers' default 3). 2 heads of
    # 64, no GQA. Special token ids inside the tiny vocabulary. AutoModel: ModernBertModel.
    "modernbert": lambda: ModernBertConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=2,
        local_attention=8,
        max_position_embeddings=512,
        initializer_range=0.1,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        cls_token_id=1,
        sep_token_id=2,
    ),
}


def is_encoder_only(config: PretrainedConfig) -> bool:
    """Whether a config is an encoder-only (embedding) model: Gemma 3 with
    ``use_bidirectional_attention`` (EmbeddingGemma), or ModernBERT. Loaded with
    ``AutoModel``."""
    if config.model_type == "modernbert":
        return True
    return bool(getattr(config, "use_bidirectional_attention", False))


def load_model(
    name: str,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    attn_implementation: str = ATTN_IMPLEMENTATION,
    seed: int = 0,
) -> nn.Module:
    """A :data:`TINY_CONFIGS` model with random weights (seeded), or ``from_pretrained(name)``
    for a local path or Hub id with weights. In eval mode, on ``device``. Encoder-only models
    (:func:`is_encoder_only`) load without an LM head (``AutoModel``)."""
    tiny = name in TINY_CONFIGS
    config = TINY_CONFIGS[name]() if tiny else AutoConfig.from_pretrained(name)
    auto: Any = AutoModelForCausalLM
    if config.is_encoder_decoder:
        auto = AutoModelForSeq2SeqLM
    elif is_encoder_only(config):
        auto = AutoModel
    if tiny:
        torch.manual_seed(seed)
        model = auto.from_config(config, attn_implementation=attn_implementation, dtype=dtype)
    else:
        model = auto.from_pretrained(name, attn_implementation=attn_implementation, dtype=dtype)
    return model.to(device).eval()


def _heads(config: PretrainedConfig, num_heads: int, num_kv: int, dtype: torch.dtype):
    """The model's head counts and size (``head_dim``, else ``hidden_size // num_heads``)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    return fp.HeadConfig(num_heads, num_kv, head_dim, q_dtype=dtype)


class DecoderOnly:
    """Llama, Gemma 2/3, Mistral, Qwen2, gpt-oss, Llama 4 (text) and the like:
    ``model.model.layers[i].self_attn``, causal.

    Attributes:
        max_tokens: the most tokens a packed forward, and a request, may hold for the forward
            to be exact (``None``: no limit). Llama 4's ``attn_temperature_tuning`` scales the
            NoPE layers' queries by ``log1p(floor((i + 1) / floor_scale)) * attn_scale + 1``
            with ``i`` the token's index in the packed row (HF counts from the row's start
            plus the cache length), which is not the token's position in a packed batch; the
            factor is exactly 1 while ``i + 1 < floor_scale`` (8192), in HF's forward of a
            request alone too, so the engine keeps its steps and requests below
            ``floor_scale`` tokens rather than pass per-token scales HF has no argument for.
    """

    is_encoder_decoder = False
    is_encoder_only = False

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        c = model.config
        self.num_layers: int = c.num_hidden_layers
        self.heads = _heads(c, c.num_attention_heads, c.num_key_value_heads, model.dtype)
        self.encoder_heads: fp.HeadConfig | None = None
        self.bindings: dict[nn.Module, Binding] = {
            layer.self_attn: Binding(Kind.SELF, i) for i, layer in enumerate(model.model.layers)
        }
        if not all(getattr(m, "is_causal", True) for m in self.bindings):
            raise ValueError("a decoder-only model with non-causal attention: use EncoderOnly")
        self.max_tokens: int | None = None
        if getattr(c, "attn_temperature_tuning", False) and not all(c.no_rope_layers):
            self.max_tokens = int(c.floor_scale) - 1

    def compiled(self, backend: Any = "inductor") -> DecoderOnly:
        """This adapter over ``torch.compile(model, backend=backend)``: the same modules
        and bindings, its forward compiled (inductor fuses the norms, RoPE and activations)
        with attention through the custom op ``flashplan::run`` when the step's context
        comes from :meth:`StepContext.for_compile`."""
        twin = copy.copy(self)
        twin.model = torch.compile(self.model, backend=backend)
        return twin

    @torch.no_grad()
    def decode(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        rows: torch.Tensor,
        ctx: StepContext,
        encoder_states: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``[len(rows), vocab]`` (float) of the packed tokens ``ids`` (int64
        ``[total_q]``) at RoPE ``positions`` (int64 ``[total_q]``), kept at ``rows``."""
        out = self.model(
            input_ids=ids[None],
            position_ids=positions[None],
            use_cache=False,
            logits_to_keep=rows,
            flashplan=ctx,
        )
        return out.logits[0]


class EncoderOnly:
    """EmbeddingGemma (``Gemma3TextModel`` with ``use_bidirectional_attention``) and ModernBERT
    (``ModernBertModel``): ``model.layers[i].self_attn`` (ModernBERT: ``.attn``),
    bidirectional (windowed on sliding layers), each layer
    writing its K/V into the context's cache ``i`` and reading it back (a bidirectional window
    runs on one paged prefill with a position mask, which reads the keys from a cache;
    ``engine.embed`` gives every layer one shared scratch cache). No LM head: the output is
    the last hidden states (after the final norm)."""

    is_encoder_decoder = False
    is_encoder_only = True

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        c = model.config
        self.num_layers: int = c.num_hidden_layers
        num_kv = getattr(c, "num_key_value_heads", None) or c.num_attention_heads  # ModernBERT: MHA
        self.heads = _heads(c, c.num_attention_heads, num_kv, model.dtype)
        self.bindings: dict[nn.Module, Binding] = {
            _attention_module(layer): Binding(Kind.ENCODER, i)
            for i, layer in enumerate(model.layers)
        }
        if any(getattr(m, "is_causal", False) for m in self.bindings):
            raise ValueError("an encoder-only model with causal attention: use DecoderOnly")

    @torch.no_grad()
    def encode(self, ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """Last hidden states ``[n, hidden_size]`` (the model's dtype) of packed prompts ``ids``
        (int64 ``[n]``) at per-request RoPE ``positions`` (int64 ``[n]``)."""
        out = self.model(
            input_ids=ids[None], position_ids=positions[None], use_cache=False, flashplan=ctx
        )
        return out.last_hidden_state[0]


def _attention_module(layer: nn.Module) -> nn.Module:
    """An encoder layer's attention module: ``self_attn`` (Gemma 3), else ``attn`` (ModernBERT)."""
    for name in ("self_attn", "attn"):
        attn = getattr(layer, name, None)
        if isinstance(attn, nn.Module):
            return attn
    raise ValueError(f"{type(layer).__name__} has neither self_attn nor attn")


class EncoderDecoder:
    """BART: encoder layers (bidirectional, no cache), decoder self + cross attention sharing
    one cache per decoder layer."""

    is_encoder_decoder = True
    is_encoder_only = False
    max_tokens: int | None = None

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        c = model.config
        self.num_layers: int = c.decoder_layers
        h, eh = c.decoder_attention_heads, c.encoder_attention_heads
        self.heads = fp.HeadConfig(h, h, c.d_model // h, q_dtype=model.dtype)
        self.encoder_heads = fp.HeadConfig(eh, eh, c.d_model // eh, q_dtype=model.dtype)
        enc, dec = model.model.encoder, model.model.decoder
        self.bindings = {layer.self_attn: Binding(Kind.ENCODER, None) for layer in enc.layers}
        for i, layer in enumerate(dec.layers):
            self.bindings[layer.self_attn] = Binding(Kind.SELF, i)
            self.bindings[layer.encoder_attn] = Binding(Kind.CROSS, i)  # the same cache

    @torch.no_grad()
    def encode(self, ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """Encoder output ``[1, n, d_model]`` of packed prompts ``ids`` (int64 ``[n]``) at
        per-request ``positions`` (int64 ``[n]``)."""
        enc = self.model.model.encoder
        h = enc.embed_tokens(ids[None]) + enc.embed_positions(ids[None], position_ids=positions)
        h = enc.layernorm_embedding(h)
        for layer in enc.layers:
            h = layer(h, None, flashplan=ctx)
        return h

    @torch.no_grad()
    def decode(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        rows: torch.Tensor,
        ctx: StepContext,
        encoder_states: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``[len(rows), vocab]`` (see :meth:`DecoderOnly.decode`). ``encoder_states``
        ``[1, n, d_model]`` holds the encoder output of the requests whose encoder K/V is not
        cached yet, or ``None``: cross layers project and write only those rows."""
        dec = self.model.model.decoder
        if encoder_states is None:  # HF cannot project 0 rows: one placeholder row, dropped by
            # the attention function, which keeps the plan's spec.total_encoder rows (here 0).
            encoder_states = ids.new_zeros(
                (1, 1, self.model.config.d_model), dtype=self.model.dtype
            )
        h = dec.embed_tokens(ids[None]) + dec.embed_positions(ids[None], position_ids=positions)
        h = dec.layernorm_embedding(h)
        for layer in dec.layers:
            h = layer(h, None, encoder_states, use_cache=False, flashplan=ctx)
        return self.model.lm_head(h[0, rows]) + self.model.final_logits_bias[0]


def adapter_for(model: nn.Module) -> DecoderOnly | EncoderDecoder | EncoderOnly:
    """The adapter of a loaded model."""
    if model.config.is_encoder_decoder:
        return EncoderDecoder(model)
    return EncoderOnly(model) if is_encoder_only(model.config) else DecoderOnly(model)
