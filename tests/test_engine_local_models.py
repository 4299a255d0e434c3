"""gpt-oss, Llama 4, EmbeddingGemma and ModernBERT through the example engine
(examples/engine), on the CPU reference executor, against Hugging Face's eager forward; and
every model family's config -> group mapping against that family's own Hugging Face code.

- gpt-oss: attention sinks (``s_aux``) on alternating sliding-window and full layers;
- Llama 4 (text): chunked local attention (chunk 8) on RoPE layers, full attention on NoPE;
- EmbeddingGemma and ModernBERT: an encoder-only pass, bidirectional windows on sliding
  layers and full bidirectional attention on the others, several prompts packed into one
  batch.

Decoder models run the continuous-batching step loop (requests joining and finishing,
prompts chunked by the token budget, page sizes 1 and 16, decoding across chunk
boundaries): every logits row within 1e-4 of HF's forward of the request alone and equal
greedy tokens. The encoder-only pass: every hidden state within 1e-4 of HF's forward of
each prompt alone. And each convention mapped wrongly (a sink dropped, a chunk off by one,
a one-sided or wider window) must break that parity.

The mapping from a config object (``hf_config_groups``, the one table of
docs/guide-local-attention.md) is checked per family, Mistral, Gemma 2 and 3, gpt-oss,
Llama 4, EmbeddingGemma and ModernBERT, on tiny random-weight models (EmbeddingGemma's and
ModernBERT's published windows included): each layer's group sees exactly the keys the mask
HF's modeling code builds keeps, and is the group the engine plans from the module's call.
The docs' snippets that state a mapping are run and compared with it.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import cast

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from transformers import AutoModel, PretrainedConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: examples.engine

import flashplan as fp
from examples.engine.engine import Engine, Request, StepOutput, embed
from examples.engine.hf_attention import (
    HFConventions,
    Kind,
    expected_call,
    hf_bidirectional_window,
    hf_chunk_size,
    hf_config_groups,
    hf_layer_chunk,
    hf_sink_logits,
)
from examples.engine.hf_models import (
    TINY_CONFIGS,
    EncoderOnly,
    adapter_for,
    is_encoder_only,
    load_model,
)
from examples.engine.parity import check_embed_parity, check_parity, reference_model
from flashplan.oracle import visibility
from flashplan.planning import KernelPath

ROOT = Path(__file__).resolve().parents[1]

ATOL = 1e-4  # fp32 engine vs fp32 HF
KV_TOKENS = 384  # KV capacity per layer: 24 pages of 16, or 384 pages of 1
CHUNK = 8  # TINY_CONFIGS["llama4"]'s attention_chunk_size
SINK_WINDOW = 6  # TINY_CONFIGS["gpt-oss"]'s sliding_window
EMBED_WINDOW = 6  # TINY_CONFIGS["embeddinggemma"]: configured 10, HF's 10 // 2 + 1
BERT_RADIUS = 4  # TINY_CONFIGS["modernbert"]: local_attention 8, keys |q - k| <= 8 // 2
ENCODERS = ["embeddinggemma", "modernbert"]
# Prompts of 9 to 60 tokens (chunked by the 16-token budget), 10 to 12 new tokens each:
# every request decodes across at least one chunk boundary.
PROMPT_LENS = [23, 9, 41, 20, 60, 30]
EMBED_LENS = [5, 37, 12, 1, 23, 60, 9]


@functools.cache
def models(name: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(engine model with random weights, fp32 eager HF reference with the same weights)."""
    model = load_model(name)
    return model, reference_model(model)


def prompts(lens: list[int], vocab: int = 512, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, n).tolist() for n in lens]


def run_engine(
    model: torch.nn.Module,
    *,
    page_size: int = 16,
    extend_path: str = "auto",
    conventions: HFConventions = HFConventions(),  # noqa: B008 (frozen)
) -> tuple[Engine, list[Request], list[StepOutput]]:
    """Six requests (:data:`PROMPT_LENS`), three at a time, 16 new tokens a step, every
    logits row kept. Checks each step's bookkeeping on the way."""
    engine = Engine(
        adapter_for(model),
        fp.ReferenceExecutor(),
        page_size=page_size,
        num_pages=KV_TOKENS // page_size,
        max_running=3,
        token_budget=16,
        extend_path=extend_path,
        conventions=conventions,
        keep_all_logits=True,
    )
    reqs = [Request(p, 10 + i % 3) for i, p in enumerate(prompts(PROMPT_LENS))]
    steps = []
    for out in engine.run(reqs):
        counts = [n for _, n in out.batch]
        assert out.layout.extend_lens.tolist() == counts
        assert out.owners == [r for r, n in out.batch for _ in range(n)]
        assert tuple(out.logits.shape) == (sum(counts), model.config.vocab_size)
        steps.append(out)
    assert not engine.running and len(engine.allocator.free) == KV_TOKENS // page_size
    return engine, reqs, steps


def query_spans(steps: list[StepOutput]) -> list[tuple[int, int, int]]:
    """(step, first position, new tokens) of every request of every step."""
    return [
        (i, int(p), int(n))
        for i, s in enumerate(steps)
        for p, n in zip(s.layout.prefix_lens, s.layout.extend_lens, strict=True)
    ]


# -- conventions --------------------------------------------------------------------------
def test_conventions() -> None:
    s_aux = torch.tensor([0.5, -1.0], dtype=torch.bfloat16)
    assert hf_sink_logits(None) is None
    sinks = hf_sink_logits(s_aux)
    assert sinks is not None and sinks.dtype == torch.float32 and sinks.tolist() == [0.5, -1.0]
    assert hf_chunk_size(None) == 0 and hf_chunk_size(8192) == 8192
    assert hf_bidirectional_window(None) == (-1, -1) and hf_bidirectional_window(6) == (5, 5)

    def groups(name: str) -> dict[fp.AttentionGroup, None]:
        bindings = adapter_for(models(name)[0]).bindings.items()
        return {HFConventions().group(b.kind, expected_call(m)): None for m, b in bindings}

    # gpt-oss: sliding and full layers alternating, every one with sinks (module.sinks).
    assert list(groups("gpt-oss")) == [
        fp.AttentionGroup.sliding(SINK_WINDOW - 1, sinks=True, sm_scale=64**-0.5),
        fp.AttentionGroup.full(sinks=True, sm_scale=64**-0.5),
    ]
    # Llama 4: the chunk is read from the layer (layer_types), not from the call.
    llama4 = models("llama4")[0]
    chunks = [hf_layer_chunk(layer.self_attn) for layer in llama4.model.layers]
    assert chunks == [CHUNK, CHUNK, CHUNK, None]
    assert list(llama4.config.no_rope_layers) == [1, 1, 1, 0]  # the full layer is NoPE
    assert list(groups("llama4")) == [
        fp.AttentionGroup.chunked(CHUNK, sm_scale=64**-0.5),
        fp.AttentionGroup.full(sm_scale=64**-0.5),
    ]
    # EmbeddingGemma: |q - k| <= S - 1 on sliding layers, every key on full ones.
    scale = 48**-0.5
    assert list(groups("embeddinggemma")) == [
        fp.AttentionGroup.bidirectional(
            window_left=EMBED_WINDOW - 1, window_right=EMBED_WINDOW - 1, sm_scale=scale
        ),
        fp.AttentionGroup.bidirectional(sm_scale=scale),
    ]
    call = expected_call(models("embeddinggemma")[0].layers[0].self_attn)
    assert call.sliding_window == EMBED_WINDOW
    assert HFConventions().group(Kind.ENCODER, call).has_band


def test_engine_refuses_what_it_cannot_run_exactly() -> None:
    """An encoder-only model has no step loop; Llama 4's temperature tuning (NoPE layers'
    query scale from packed-row indices, exactly 1 below floor_scale tokens) bounds the
    step and the request."""
    with pytest.raises(ValueError, match="embed"):
        Engine(adapter_for(models("embeddinggemma")[0]), fp.ReferenceExecutor())
    adapter = adapter_for(models("llama4")[0])
    assert adapter.max_tokens == 8191
    with pytest.raises(ValueError, match="8191"):
        Engine(adapter, fp.ReferenceExecutor(), token_budget=8192)
    with pytest.raises(ValueError, match="8191"):
        Engine(adapter, fp.ReferenceExecutor(), max_request_tokens=8192)


# -- gpt-oss and Llama 4: the step loop ----------------------------------------------------
CASES = [
    ("gpt-oss", 16, "auto"),
    ("gpt-oss", 1, "ragged"),  # sinks on both calls of a ragged + paged extend
    ("gpt-oss", 16, "paged"),
    ("llama4", 16, "auto"),  # chunks inside pages: position masks
    ("llama4", 1, "auto"),  # chunks on page boundaries: virtual requests
    ("llama4", 1, "ragged"),
]


@pytest.mark.parametrize(("name", "page_size", "extend_path"), CASES)
def test_parity_with_hf(name: str, page_size: int, extend_path: str) -> None:
    model, ref = models(name)
    engine, reqs, steps = run_engine(model, page_size=page_size, extend_path=extend_path)
    parity = check_parity(ref, reqs, steps)
    assert parity.max_abs_diff <= ATOL, parity.line()
    assert not parity.mismatches, parity.line()
    assert parity.tokens == sum(r.max_new_tokens for r in reqs)

    # The batches were what the test means to cover.
    spans = query_spans(steps)
    assert any(s.layout.mode is fp.Mode.DECODE for s in steps)
    assert any((e == 1).any() and (e > 1).any() for e in (s.layout.extend_lens for s in steps))
    assert engine.allocator.reused > 0, "no freed page was reused"
    plans = [gp for s in steps for gp in s.spec.group_plans]
    if name == "gpt-oss":
        assert all(gp.group.sinks for gp in plans)
        # a prompt chunk after a prefix longer than the window, and decodes past the window
        assert any(n > 1 and p > SINK_WINDOW for _, p, n in spans)
        assert any(n == 1 and p > SINK_WINDOW for _, p, n in spans)
        if extend_path == "ragged":  # the sink folded into one of two merged calls
            assert any(gp.path is KernelPath.RAGGED_PAGED for gp in plans)
    else:
        # prompt chunks crossing a chunk boundary and starting inside a chunk, decodes
        # starting a new chunk, in a mixed step and in a decode-only step
        assert any(n > 1 and (p + 1) // CHUNK < (p + n - 1) // CHUNK for _, p, n in spans)
        assert any(n > 1 and p % CHUNK for _, p, n in spans)
        new_chunk = {i for i, p, n in spans if n == 1 and p % CHUNK == 0}
        assert any(steps[i].layout.mode is fp.Mode.DECODE for i in new_chunk)
        assert any(steps[i].layout.mode is fp.Mode.EXTEND for i in new_chunk)
        chunked = [gp for gp in plans if gp.group.has_chunks and gp.paged is not None]
        if page_size == 16:
            assert any(gp.paged.position_mask is not None for gp in chunked)
        else:
            assert any(gp.virtual is not None for gp in chunked)


def _chunk_shift(shift: int) -> HFConventions:
    def chunk_size(chunk: int | None) -> int:
        return hf_chunk_size(chunk) + (shift if chunk else 0)

    return dataclasses.replace(HFConventions(), chunk_size=chunk_size)


WRONG = {
    "sink dropped": ("gpt-oss", dataclasses.replace(HFConventions(), sink_logits=lambda s: None)),
    "chunk one longer": ("llama4", _chunk_shift(+1)),
    "chunk one shorter": ("llama4", _chunk_shift(-1)),
}


@pytest.mark.parametrize("wrong", WRONG)
def test_negative_controls(wrong: str) -> None:
    """Each wrong convention on its own breaks parity, far beyond the tolerance (its
    baseline, the right mapping, is test_parity_with_hf's first case of the model)."""
    name, conventions = WRONG[wrong]
    model, ref = models(name)
    _, reqs, steps = run_engine(model, conventions=conventions)
    if wrong == "sink dropped":
        assert not any(gp.group.sinks for s in steps for gp in s.spec.group_plans)
    parity = check_parity(ref, reqs, steps)
    assert parity.max_abs_diff > 100 * ATOL, parity.line()
    assert not parity.ok(ATOL)


def test_sinks_through_comparing_executor() -> None:
    """gpt-oss's step loop through ComparingExecutor (the tee passes each sink group's
    logits to both executors): each call vs a fresh reference executor, bit for bit."""
    from flashplan.testing.compare import ComparingExecutor

    model, _ = models("gpt-oss")
    tee = ComparingExecutor(fp.ReferenceExecutor())
    engine = Engine(adapter_for(model), tee, num_pages=KV_TOKENS // 16, max_running=3)
    for _ in engine.run(Request(p, 4) for p in prompts(PROMPT_LENS[:3])):
        pass
    assert tee.records and not tee.bad(0.0, 0.0), tee.summary()


# -- EmbeddingGemma: one packed encoder-only pass ------------------------------------------
def run_embed(
    page_size: int,
    extend_path: str = "auto",
    conventions: HFConventions = HFConventions(),  # noqa: B008 (frozen)
    name: str = "embeddinggemma",
) -> tuple[list[torch.Tensor], fp.PlanSpec]:
    model, _ = models(name)
    adapter = adapter_for(model)
    assert isinstance(adapter, EncoderOnly)
    executor = fp.ReferenceExecutor()
    hidden = embed(
        adapter, executor, prompts(EMBED_LENS), page_size=page_size, extend_path=extend_path,
        conventions=conventions,
    )  # fmt: skip
    assert executor.spec is not None
    return hidden, executor.spec


@pytest.mark.parametrize("name", ENCODERS)
@pytest.mark.parametrize("extend_path", ["auto", "paged"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_embed_parity_with_hf(page_size: int, extend_path: str, name: str) -> None:
    """Seven prompts of 1 to 60 tokens in one pass, each equal to HF's forward of it alone."""
    _, ref = models(name)
    hidden, spec = run_embed(page_size, extend_path, name=name)
    assert [tuple(h.shape) for h in hidden] == [(n, 128) for n in EMBED_LENS]
    parity = check_embed_parity(ref, prompts(EMBED_LENS), hidden)
    assert parity.ok(ATOL), parity.line()
    paths = {gp.group.has_band: gp.path for gp in spec.group_plans}
    assert paths[True] is KernelPath.PAGED  # a bidirectional window: one masked paged call
    want_full = KernelPath.RAGGED if extend_path == "auto" else KernelPath.PAGED
    assert paths[False] is want_full
    assert any(
        gp.paged is not None and gp.paged.position_mask is not None for gp in spec.group_plans
    )


def test_embed_refuses_the_ragged_path() -> None:
    with pytest.raises(fp.LayoutError, match="position mask"):
        run_embed(16, "ragged")


def _one_sided(sliding_window: int | None) -> tuple[int, int]:
    left, _ = hf_bidirectional_window(sliding_window)
    return left, (0 if sliding_window else -1)  # keys p - S + 1 .. p: a causal window


def _one_wider(sliding_window: int | None) -> tuple[int, int]:
    """The passed ``sliding_window`` read as the radius: ModernBERT passes
    ``local_attention // 2 + 1``, one more than its mask's radius (the issue-50 trap)."""
    left, right = hf_bidirectional_window(sliding_window)
    return (left + 1, right + 1) if sliding_window else (left, right)


def _one_narrower(sliding_window: int | None) -> tuple[int, int]:
    """EmbeddingGemma's old doc snippet: 255 for the published 512 (S − 2, not S − 1)."""
    left, right = hf_bidirectional_window(sliding_window)
    return (left - 1, right - 1) if sliding_window else (left, right)


EMBED_WRONG = {
    "one-sided window (window_right = 0)": _one_sided,
    "window one wider on each side": _one_wider,
    "window one narrower on each side": _one_narrower,
}


@pytest.mark.parametrize("name", ENCODERS)
@pytest.mark.parametrize("wrong", EMBED_WRONG)
def test_embed_negative_controls(wrong: str, name: str) -> None:
    _, ref = models(name)
    conventions = dataclasses.replace(HFConventions(), bidirectional_window=EMBED_WRONG[wrong])
    hidden, _ = run_embed(16, conventions=conventions, name=name)
    parity = check_embed_parity(ref, prompts(EMBED_LENS), hidden)
    assert parity.max_abs_diff > 100 * ATOL, parity.line()


# -- each family's config -> groups, against its own Hugging Face code ---------------------
def _with(name: str, **fields: object) -> Callable[[], PretrainedConfig]:
    """TINY_CONFIGS[name] rebuilt with ``fields`` (through the config class's constructor,
    so that EmbeddingGemma's rewrite of ``sliding_window`` runs on the new value)."""

    def build() -> PretrainedConfig:
        config = TINY_CONFIGS[name]()
        return type(config).from_dict({**config.to_dict(), **fields})

    return build


#: case -> (config, tokens of the probe sequence: more than every window and chunk).
MAPPING_CASES: dict[str, tuple[Callable[[], PretrainedConfig], int]] = {
    **{name: (TINY_CONFIGS[name], 24) for name in
       ["mistral", "gemma2", "gemma3", "gpt-oss", "llama4", "embeddinggemma", "modernbert"]},
    # the published windows: gpt-oss 128, EmbeddingGemma 512 (held as 257), ModernBERT 128
    "gpt-oss sliding_window=128": (_with("gpt-oss", sliding_window=128), 160),
    "embeddinggemma sliding_window=512": (_with("embeddinggemma", sliding_window=512), 300),
    "modernbert local_attention=128": (_with("modernbert", local_attention=128), 160),
}  # fmt: skip


def _attention(layer: torch.nn.Module) -> torch.nn.Module:
    """A layer's attention module: ``self_attn``, or ModernBERT's ``attn``."""
    return cast(torch.nn.Module, getattr(layer, "self_attn", None) or layer.attn)


@torch.no_grad()
def hf_masks(
    config: PretrainedConfig, tokens: int
) -> tuple[list[np.ndarray], list[torch.nn.Module]]:
    """Per layer, the keys HF's own modeling code lets each query see: bool
    ``[tokens, tokens]`` read from the mask each attention module receives in an eager
    forward of one sequence (a float mask: 0 keeps a key; ``None``: every key); and the
    layers' attention modules (eager attention, random weights)."""
    torch.manual_seed(0)
    model = AutoModel.from_config(config, attn_implementation="eager")
    model.eval()
    seen: dict[int, np.ndarray] = {}

    def hook(i: int) -> Callable[..., None]:
        def record(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            mask = kwargs["attention_mask"]
            if mask is None:
                seen[i] = np.ones((tokens, tokens), bool)
                return
            assert tuple(mask.shape) == (1, 1, tokens, tokens)
            keep = mask[0, 0] if mask.dtype == torch.bool else mask[0, 0] == 0
            seen[i] = keep.numpy()

        return record

    attentions = [_attention(layer) for layer in cast(torch.nn.ModuleList, model.layers)]
    for i, attention in enumerate(attentions):
        attention.register_forward_pre_hook(hook(i), with_kwargs=True)
    model(input_ids=torch.arange(3, 3 + tokens)[None])
    return [seen[i] for i in range(len(attentions))], attentions


@pytest.mark.parametrize("case", MAPPING_CASES)
def test_config_groups_are_what_hf_computes(case: str) -> None:
    """Each layer's group from the config (``hf_config_groups``: the docs' table) sees, on
    one sequence, exactly the keys HF's modeling code keeps for that layer; and it is the
    group the engine plans from what the layer's module passes (``expected_call``)."""
    build, tokens = MAPPING_CASES[case]
    config = build()
    groups = hf_config_groups(config)
    assert len(groups) == config.num_hidden_layers
    assert any(g.has_window or g.has_chunks for g in groups)  # a mapping to check
    want, attentions = hf_masks(config, tokens)
    layout = fp.BatchLayout.extend([tokens], [0], page_size=16, groups=tuple(set(groups)))
    for i, (group, keep) in enumerate(zip(groups, want, strict=True)):
        got = visibility(layout, group)[0]
        assert np.array_equal(got, keep), (case, i, group, np.argwhere(got != keep)[:4])
    kind = Kind.ENCODER if is_encoder_only(config) else Kind.SELF
    engine = [HFConventions().group(kind, expected_call(m)) for m in attentions]
    assert engine == list(groups)


def test_published_windows() -> None:
    """The numbers the docs give for the published configs, from the config objects."""
    gemma = _with("embeddinggemma", sliding_window=512)()
    assert gemma.sliding_window == 257  # the constructor's rewrite: 512 // 2 + 1
    assert (hf_config_groups(gemma)[0].window_left, hf_config_groups(gemma)[0].window_right) == (
        256,
        256,
    )
    bert = hf_config_groups(_with("modernbert", local_attention=128)())
    assert [(g.window_left, g.window_right) for g in bert] == [(-1, -1), (64, 64), (64, 64)]
    assert [g.window_left for g in hf_config_groups(_with("gpt-oss", sliding_window=128)())] == [
        127,
        -1,
    ]


def test_config_groups_refuse_an_unknown_family() -> None:
    with pytest.raises(ValueError, match="bart"):
        hf_config_groups(TINY_CONFIGS["bart"]())


# -- the docs' snippets that state a mapping ------------------------------------------------
_PYTHON = re.compile(r"^```python\n(.*?)^```", re.M | re.S)


def doc_blocks(name: str) -> list[str]:
    """The fenced python blocks of docs/``name``."""
    return _PYTHON.findall((ROOT / "docs" / name).read_text())


def _seen(group: fp.AttentionGroup) -> tuple[object, ...]:
    """What decides which keys a group's query sees, and whether it has sinks."""
    return (group.causal, group.window_left, group.window_right, group.attention_chunk_size,
            group.sinks)  # fmt: skip


def test_doc_snippets_give_the_mapping() -> None:
    """guide-local-attention.md's first snippet (a group per kind, named after a model) and
    its table's snippet (groups from config objects) run, and give the groups
    ``hf_config_groups`` gives for the published configs."""
    from transformers import Gemma3TextConfig, GptOssConfig, Llama4TextConfig, ModernBertConfig

    blocks = doc_blocks("guide-local-attention.md")
    picture: dict[str, object] = {}
    exec(blocks[0], picture)  # our own docs
    published = {
        "sink_local": (GptOssConfig(), 0),  # sliding_window 128; layer 0 sliding
        "sink_full": (GptOssConfig(), 1),
        "chunked": (Llama4TextConfig(), 0),  # attention_chunk_size 8192; layer 0 chunked
        "band": (Gemma3TextConfig(sliding_window=512, use_bidirectional_attention=True), 0),
    }
    for var, (config, layer) in published.items():
        group = picture[var]
        assert isinstance(group, fp.AttentionGroup)
        assert _seen(group) == _seen(hf_config_groups(config)[layer]), var
    table = next(b for b in blocks if "ModernBertConfig(" in b)
    ns: dict[str, object] = {}
    exec(table, ns)
    assert isinstance(ns["gemma"], Gemma3TextConfig) and isinstance(ns["bert"], ModernBertConfig)
    for var, config_var in [("embedding_gemma_local", "gemma"), ("modernbert_local", "bert")]:
        cfg, group = ns[config_var], ns[var]
        assert isinstance(cfg, PretrainedConfig) and isinstance(group, fp.AttentionGroup)
        want = hf_config_groups(cfg)[list(cfg.layer_types).index("sliding_attention")]
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        assert _seen(group) == _seen(want), var
        assert group.scale_for(head_dim) == want.scale_for(head_dim), var
