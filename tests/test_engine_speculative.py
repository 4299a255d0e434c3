"""Speculative decoding in the example engine (CPU, fp32, reference executor): with
greedy sampling the tokens equal the target's own greedy decode, for drafts that agree
always (the target's own layers: every draft accepted) and rarely (its first layer);
chains of 1 to 4 drafts and EAGLE trees (multi-step draft decode over branch rows,
partial pages copied, accepted paths compacted), page sizes 1, 4 and 16, full and
sliding-window models."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: examples.engine

from examples.engine.hf_models import adapter_for, load_model
from examples.engine.speculative import draft_from, greedy_decode, speculative_decode

MAX_NEW = 10


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("name", ["llama", "gemma2", "mistral"])
def test_speculative_decode_is_lossless(name: str, page_size: int) -> None:
    model = load_model(name)
    target = adapter_for(model)
    rng = np.random.default_rng(page_size)
    prompts = [rng.integers(3, 512, n).tolist() for n in (5, 17, 2, 30)]
    want = greedy_decode(target, prompts, MAX_NEW, page_size=page_size)
    same = draft_from(model, model.config.num_hidden_layers)  # the target's own layers
    weak = draft_from(model, 1)
    weak_acceptance, moved = [], 0
    for k, topk in ((1, 1), (2, 1), (4, 1), (3, 2), (1, 4)):  # chains, then EAGLE trees
        full = speculative_decode(target, same, prompts, MAX_NEW, k, topk=topk, page_size=page_size)
        assert full.tokens == want, (k, topk, "full")
        assert full.acceptance == 1.0
        assert full.rounds == -(-MAX_NEW // (k + 1))  # k + 1 tokens per round
        partial = speculative_decode(
            target, weak, prompts, MAX_NEW, k, topk=topk, page_size=page_size
        )
        assert partial.tokens == want, (k, topk, "weak")
        weak_acceptance.append(partial.acceptance)
        moved += partial.moved
    assert min(weak_acceptance) < 1.0  # some drafts were rejected: both paths ran
    if name == "llama":  # (its weak draft disagrees often enough to pick other branches)
        assert moved > 0  # accepted paths off the first branch: compaction moved K/V
