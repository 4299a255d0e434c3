"""The models the engine runs: tiny random-weight configs, loading, and per-family adapters.

An adapter says which HF attention module is which (:class:`~hf_attention.Binding`) and runs
one packed forward. Decoder-only models go through HF's own ``forward`` with
``position_ids = spec.positions``. BART's ``forward`` derives its learned positions from a
cache length, which a packed batch of several requests has not, so its adapter calls BART's
own modules in the order ``BartEncoder`` / ``BartDecoder.forward`` do, with per-request
positions.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    BartConfig,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
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
}


def load_model(
    name: str,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    attn_implementation: str = ATTN_IMPLEMENTATION,
    seed: int = 0,
) -> nn.Module:
    """A :data:`TINY_CONFIGS` model with random weights (seeded), or ``from_pretrained(name)``
    for a local path or Hub id with weights. In eval mode, on ``device``."""
    tiny = name in TINY_CONFIGS
    config = TINY_CONFIGS[name]() if tiny else AutoConfig.from_pretrained(name)
    auto = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
    if tiny:
        torch.manual_seed(seed)
        model = auto.from_config(config, attn_implementation=attn_implementation, dtype=dtype)
    else:
        model = auto.from_pretrained(name, attn_implementation=attn_implementation, dtype=dtype)
    return model.to(device).eval()


def _heads(config: PretrainedConfig, num_heads: int, num_kv: int, dtype: torch.dtype):
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    return fp.HeadConfig(num_heads, num_kv, head_dim, q_dtype=dtype)


class DecoderOnly:
    """Llama, Gemma 2/3, Mistral, Qwen2 and the like: ``model.model.layers[i].self_attn``."""

    is_encoder_decoder = False

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        c = model.config
        self.num_layers: int = c.num_hidden_layers
        self.heads = _heads(c, c.num_attention_heads, c.num_key_value_heads, model.dtype)
        self.encoder_heads: fp.HeadConfig | None = None
        self.bindings: dict[nn.Module, Binding] = {
            layer.self_attn: Binding(Kind.SELF, i) for i, layer in enumerate(model.model.layers)
        }

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


class EncoderDecoder:
    """BART: encoder layers (bidirectional, no cache), decoder self + cross attention sharing
    one cache per decoder layer."""

    is_encoder_decoder = True

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


def adapter_for(model: nn.Module) -> DecoderOnly | EncoderDecoder:
    """The adapter of a loaded model."""
    return EncoderDecoder(model) if model.config.is_encoder_decoder else DecoderOnly(model)
