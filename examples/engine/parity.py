"""Parity with Hugging Face: each request alone, full forward, eager attention, no cache.

:func:`check_parity` compares a generation run's logits (decoder models);
:func:`check_embed_parity` an encoder-only pass's last hidden states (EmbeddingGemma, ModernBERT).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .engine import Request, StepOutput


def reference_model(model: nn.Module) -> nn.Module:
    """An fp32 copy of ``model`` on HF's eager attention (the same weights)."""
    ref = copy.deepcopy(model).float()
    ref.set_attn_implementation("eager")
    return ref.eval()


@torch.no_grad()
def reference_logits(ref: nn.Module, request: Request) -> torch.Tensor:
    """float32 ``[len(tokens), vocab]``: HF's logits at every decoder position of the
    request's tokens, computed by one forward of the request alone."""
    dev = ref.device
    tokens = torch.tensor([request.tokens], device=dev)
    if ref.config.is_encoder_decoder:
        src = torch.tensor([request.encoder_prompt], device=dev)
        out = ref(input_ids=src, decoder_input_ids=tokens, use_cache=False)
    else:
        out = ref(input_ids=tokens, use_cache=False)
    return out.logits[0].float()


@dataclass
class Parity:
    """Engine vs HF.

    Attributes:
        max_abs_diff: largest |engine logit − HF logit| over every logits row of every step.
        max_ref_logit: largest |HF logit| seen (for relative tolerances).
        rows: logits rows compared.
        tokens: generated tokens compared; ``mismatches`` lists ``(request id, index)`` of those
            whose HF argmax differs (greedy parity: the engine's tokens are fed back to both).
        ties: differing tokens not counted as mismatches, because HF's top two logits there
            are closer than the ``tie_margin`` of :func:`check_parity`.
        mean_abs_diff: mean |engine logit − HF logit| over every element compared.
    """

    max_abs_diff: float
    max_ref_logit: float
    rows: int
    tokens: int
    mismatches: list[tuple[int, int]]
    ties: int = 0
    mean_abs_diff: float = 0.0

    def ok(self, atol: float) -> bool:
        return self.max_abs_diff <= atol and not self.mismatches

    def line(self) -> str:
        return (
            f"parity vs HF eager fp32 (each request alone, no cache): max |logit diff| "
            f"{self.max_abs_diff:.2e} over {self.rows} logits rows (max |logit| "
            f"{self.max_ref_logit:.2f}); greedy tokens equal: "
            f"{self.tokens - len(self.mismatches) - self.ties}/{self.tokens}"
            + (f", {self.ties} differ at HF near-ties" if self.ties else "")
        )


def check_parity(
    ref: nn.Module,
    requests: list[Request],
    steps: list[StepOutput],
    *,
    first_tokens: int | None = None,
    tie_margin: float = 0.0,
) -> Parity:
    """Compare every logits row of ``steps`` and the first ``first_tokens`` (all when
    ``None``) generated tokens of each request with ``ref`` (:func:`reference_model`).
    A differing token where HF's top two logits are within ``tie_margin`` is a tie, not a
    mismatch (for bf16 runs; 0 in fp32: every token must match)."""
    want = {r.rid: reference_logits(ref, r).cpu() for r in requests}
    diff, rows, total = 0.0, 0, 0.0
    for out in steps:
        got = out.logits.float().cpu()
        for j, (r, pos) in enumerate(zip(out.owners, out.positions, strict=True)):
            err = (got[j] - want[r.rid][pos]).abs()
            diff, total = max(diff, float(err.max())), total + float(err.mean())
            rows += 1
    mismatches, tokens, ties = [], 0, 0
    for r in requests:
        start = len(r.prompt) - 1  # the position whose logits give output[0]
        for k, token in enumerate(r.output[:first_tokens]):
            tokens += 1
            top2 = want[r.rid][start + k].topk(2)
            if int(top2.indices[0]) == token:
                continue
            if float(top2.values[0] - top2.values[1]) < tie_margin:
                ties += 1
            else:
                mismatches.append((r.rid, k))
    top = max(float(w.abs().max()) for w in want.values())
    return Parity(diff, top, rows, tokens, mismatches, ties, total / max(rows, 1))


@dataclass
class RunDiff:
    """Two runs of the same requests compared (:func:`compare_runs`).

    Attributes:
        max_abs_diff: largest |logit difference| over the rows compared.
        mean_abs_diff: mean |logit difference| over every element of those rows.
        rows: logits rows compared: each (request, position) both runs kept whose tokens
            up to that position are the same in both (after a request's first differing
            token the two runs decode different sequences).
        tokens: generated tokens of the first run.
        same_prefix: of those, the tokens before each request's first difference from
            the second run (greedy agreement of the two runs).
    """

    max_abs_diff: float
    mean_abs_diff: float
    rows: int
    tokens: int
    same_prefix: int

    def line(self) -> str:
        return (
            f"max |logit diff| {self.max_abs_diff:.2e}, mean {self.mean_abs_diff:.2e} over "
            f"{self.rows} logits rows; generated tokens equal until the first difference: "
            f"{self.same_prefix}/{self.tokens}"
        )


def compare_runs(
    requests: Sequence[Request],
    steps: Sequence[StepOutput],
    other_requests: Sequence[Request],
    other_steps: Sequence[StepOutput],
) -> RunDiff:
    """Compare a run's logits with another run's of the same requests (request ``i`` of
    one with request ``i`` of the other: two engines given the same workload), for
    example an fp8 KV cache against the model's dtype: every (request, position) both
    runs kept, while the request's tokens up to it are the same in both."""

    def rows(
        reqs: Sequence[Request], run: Sequence[StepOutput]
    ) -> dict[tuple[int, int], torch.Tensor]:
        index = {r.rid: i for i, r in enumerate(reqs)}
        return {
            (index[r.rid], pos): out.logits[j]
            for out in run
            for j, (r, pos) in enumerate(zip(out.owners, out.positions, strict=True))
            if r.rid in index
        }

    a, b = rows(requests, steps), rows(other_requests, other_steps)
    diff, total, count = 0.0, 0.0, 0
    for (i, pos), row in a.items():
        if (i, pos) not in b or requests[i].tokens[: pos + 1] != other_requests[i].tokens[
            : pos + 1
        ]:
            continue
        err = (row.float() - b[(i, pos)].float()).abs()
        diff, total, count = max(diff, float(err.max())), total + float(err.mean()), count + 1
    tokens = sum(len(r.output) for r in requests)
    same = 0
    for r, o in zip(requests, other_requests, strict=True):
        same += next(
            (k for k, (x, y) in enumerate(zip(r.output, o.output, strict=False)) if x != y),
            min(len(r.output), len(o.output)),
        )
    return RunDiff(diff, total / max(count, 1), count, tokens, same)


@torch.no_grad()
def reference_hidden(ref: nn.Module, prompt: Sequence[int]) -> torch.Tensor:
    """float32 ``[len(prompt), hidden_size]``: HF's last hidden states of an encoder-only
    model (``AutoModel``, no LM head) for the prompt alone (no padding, no cache)."""
    ids = torch.tensor([list(prompt)], device=ref.device)
    return ref(input_ids=ids, use_cache=False).last_hidden_state[0].float()


@dataclass
class EmbedParity:
    """An encoder-only pass vs HF.

    Attributes:
        max_abs_diff: largest |engine − HF| over every hidden-state element of every prompt.
        max_ref: largest |HF hidden state| seen (for relative tolerances).
        rows: token rows compared (the prompts' lengths summed).
    """

    max_abs_diff: float
    max_ref: float
    rows: int

    def ok(self, atol: float) -> bool:
        return self.max_abs_diff <= atol

    def line(self) -> str:
        return (
            f"parity vs HF eager fp32 (each prompt alone, no padding): max |hidden diff| "
            f"{self.max_abs_diff:.2e} over {self.rows} token rows (max |hidden| "
            f"{self.max_ref:.2f})"
        )


def check_embed_parity(
    ref: nn.Module, prompts: Sequence[Sequence[int]], hidden: Sequence[torch.Tensor]
) -> EmbedParity:
    """Compare each prompt's hidden states ``hidden[i]`` (``[len(prompts[i]), hidden_size]``,
    any dtype and device) with ``ref``'s forward of that prompt alone
    (:func:`reference_model` of an encoder-only model)."""
    diff, top, rows = 0.0, 0.0, 0
    for prompt, got in zip(prompts, hidden, strict=True):
        want = reference_hidden(ref, prompt).cpu()
        diff = max(diff, float((got.float().cpu() - want).abs().max()))
        top = max(top, float(want.abs().max()))
        rows += len(prompt)
    return EmbedParity(diff, top, rows)
