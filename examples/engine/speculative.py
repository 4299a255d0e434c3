"""Speculative decoding in the example engine: a draft model proposes ``k`` tokens per
request (a chain), the target verifies them in one ``Mode.VERIFY`` forward, and greedy
acceptance keeps the longest agreeing prefix plus the target's own next token. Lossless:
with greedy sampling the tokens equal the target's own greedy decode.

Both models share one page table (each its own caches). Per round, with ``L`` the
target's cached tokens and ``x`` the pending token (generated, not yet cached):

1. **Draft.** The draft model catches up on the accepted tokens it has not cached (an
   extend of 1 or 2 tokens ending with ``x``), which proposes ``d1``; ``k - 1`` decode
   steps propose ``d2 .. dk``.
2. **Verify.** ``BatchLayout.verify(L, DraftTree.chain(bs, k + 1))`` over ``x, d1 ..
   dk`` at positions ``L .. L + k``: the target's logits at every draft position.
3. **Accept.** ``a`` tokens (``x`` and the agreeing drafts) stay cached; the target's
   prediction after them is the next pending token. A chain's accepted tokens already
   sit at ``L .. L + a - 1`` (``fp.compact_accepted`` moves nothing, and is called to
   show where a tree would need it).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import numpy as np
import torch

import flashplan as fp

from .hf_attention import HFConventions, Kind, StepContext, expected_call
from .hf_models import DecoderOnly, adapter_for

__all__ = ["SpeculativeRun", "draft_from", "greedy_decode", "speculative_decode"]


def draft_from(model: torch.nn.Module, num_layers: int = 1) -> DecoderOnly:
    """A draft model: the target's first ``num_layers`` layers with its embeddings, norm
    and LM head (a copy; same vocabulary, so its guesses often agree)."""
    draft = copy.deepcopy(model)
    draft.model.layers = draft.model.layers[:num_layers]
    draft.config.num_hidden_layers = num_layers
    if hasattr(draft.config, "layer_types"):
        draft.config.layer_types = draft.config.layer_types[:num_layers]
    return adapter_for(draft)


@dataclass
class _Model:
    """One model's caches and forward over plans on a shared table."""

    adapter: DecoderOnly
    executor: fp.Executor
    num_pages: int
    page_size: int
    groups: tuple[fp.AttentionGroup, ...] = field(init=False)
    ctx: StepContext = field(init=False)

    def __post_init__(self) -> None:
        conv = HFConventions()
        groups = {conv.group(Kind.SELF, expected_call(m)): None for m in self.adapter.bindings}
        self.groups = tuple(groups)
        h = self.adapter.heads
        shape = (self.num_pages, 2, self.page_size, h.num_kv_heads, h.head_dim)
        caches = [torch.zeros(shape, dtype=h.kv_dtype) for _ in range(self.adapter.num_layers)]
        self.ctx = StepContext(self.executor, self.adapter.bindings, caches, conv)

    def forward(self, layout: fp.BatchLayout, table: fp.PageTable, ids: list[int]) -> torch.Tensor:
        """Logits ``[total_q, vocab]`` of every new token of ``layout``."""
        spec = fp.plan(layout, self.adapter.heads, extend_path="paged")
        self.executor.apply(spec, table)
        rows = torch.arange(spec.total_q)
        return self.adapter.decode(
            torch.tensor(ids), self.executor.positions().long(), rows, self.ctx
        ).float()


def _setup(adapter: DecoderOnly, prompts: list[list[int]], room: int, page_size: int):  # type: ignore[no-untyped-def]
    """A model over a table of one row per request, each ``room`` tokens."""
    width = -(-room // page_size)
    pages = torch.arange(len(prompts) * width, dtype=torch.int32).reshape(len(prompts), width)
    table = fp.PageTable(pages, rows=np.arange(len(prompts)), num_pages=pages.numel())
    return _Model(adapter, fp.ReferenceExecutor(), pages.numel(), page_size), table


def _prefill(model: _Model, table: fp.PageTable, prompts: list[list[int]]) -> None:
    """Cache every prompt token but the last (the first pending token)."""
    lens = [len(p) - 1 for p in prompts]
    layout = fp.BatchLayout.extend(lens, page_size=model.page_size, groups=model.groups)
    model.forward(layout, table, [t for p in prompts for t in p[:-1]])


def greedy_decode(
    target: DecoderOnly, prompts: list[list[int]], max_new: int, *, page_size: int = 16
) -> list[list[int]]:
    """The target alone, one token per step: each request's first ``max_new`` tokens."""
    model, table = _setup(target, prompts, max(map(len, prompts)) + max_new + 1, page_size)
    _prefill(model, table, prompts)
    cached = np.array([len(p) - 1 for p in prompts])
    pending = [p[-1] for p in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    for _ in range(max_new):
        layout = fp.BatchLayout.decode(cached + 1, page_size=page_size, groups=model.groups)
        pending = model.forward(layout, table, pending).argmax(-1).tolist()
        cached += 1
        for o, t in zip(out, pending, strict=True):
            o.append(t)
    return out


@dataclass
class SpeculativeRun:
    """Tokens and acceptance of :func:`speculative_decode`.

    Attributes:
        tokens: each request's first ``max_new`` generated tokens.
        rounds: draft + verify rounds run.
        drafted: draft tokens proposed (``k`` per request and round).
        accepted: draft tokens accepted.
    """

    tokens: list[list[int]]
    rounds: int
    drafted: int
    accepted: int

    @property
    def acceptance(self) -> float:
        """Accepted / drafted."""
        return self.accepted / max(self.drafted, 1)


def speculative_decode(
    target: DecoderOnly,
    draft: DecoderOnly,
    prompts: list[list[int]],
    max_new: int,
    k: int,
    *,
    page_size: int = 16,
) -> SpeculativeRun:
    """Greedy speculative decoding of ``prompts`` (each at least 2 tokens) with chains of
    ``k`` draft tokens (module docstring)."""
    room = max(map(len, prompts)) + max_new + 2 * k + 2
    tgt, table = _setup(target, prompts, room, page_size)
    drf = _Model(draft, fp.ReferenceExecutor(), tgt.num_pages, page_size)
    for m in (tgt, drf):
        _prefill(m, table, prompts)
    bs = len(prompts)
    seqs = [list(p) for p in prompts]  # every token, the pending one last
    cached = np.array([len(p) - 1 for p in prompts])  # the target's
    draft_cached = cached.copy()
    out: list[list[int]] = [[] for _ in prompts]
    rounds = drafted = accepted = 0
    while min(map(len, out)) < max_new:
        rounds += 1
        # 1. draft: catch up to the pending token (1 or 2 tokens), then k - 1 decodes
        layout = fp.BatchLayout.extend(cached + 1, draft_cached, page_size=page_size,
                                       groups=drf.groups)  # fmt: skip
        ids = [t for s, c in zip(seqs, draft_cached.tolist(), strict=True) for t in s[c:]]
        logits = drf.forward(layout, table, ids)
        last = np.cumsum(cached + 1 - draft_cached) - 1
        drafts = [logits[torch.from_numpy(last)].argmax(-1).tolist()]
        for s in range(1, k):
            layout = fp.BatchLayout.decode(cached + 1 + s, page_size=page_size, groups=drf.groups)
            drafts.append(drf.forward(layout, table, drafts[-1]).argmax(-1).tolist())
        proposal = np.array(drafts).T  # [bs, k]
        # 2. verify: the pending token and the k drafts, a chain, at L .. L + k
        tree = fp.DraftTree.chain(bs, k + 1)
        layout = fp.BatchLayout.verify(cached, tree, page_size=page_size, groups=tgt.groups)
        ids = [t for s, d in zip(seqs, proposal.tolist(), strict=True) for t in (s[-1], *d)]
        preds = tgt.forward(layout, table, ids).argmax(-1).view(bs, k + 1).numpy()
        # 3. accept the agreeing prefix; the target's next prediction becomes pending
        agree = np.cumprod(preds[:, :k] == proposal, axis=1).sum(axis=1)  # drafts kept
        paths = [list(range(int(n) + 1)) for n in agree]
        fp.compact_accepted(tgt.ctx.kv_caches, table, cached, tree, paths, page_size=page_size)
        for i in range(bs):
            new = [*proposal[i, : agree[i]].tolist(), int(preds[i, agree[i]])]
            seqs[i] += new
            out[i] += new
        drafted += bs * k
        accepted += int(agree.sum())
        # the draft cached the pending token and d1 .. d(k-1): all but d(k) when all agree
        draft_cached = cached + np.minimum(agree + 1, k)
        cached = cached + agree + 1
    return SpeculativeRun([o[:max_new] for o in out], rounds, drafted, accepted)


def main(argv: list[str] | None = None) -> int:
    """``python -m examples.engine.speculative --model llama --k 3`` (from the repository
    root): speculative vs plain greedy decoding of six random prompts; prints the
    acceptance and whether the tokens agree."""
    import argparse

    from .hf_models import load_model

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--model", default="llama")
    p.add_argument("--k", type=int, default=3, help="draft tokens per round (a chain)")
    p.add_argument(
        "--draft-layers", type=int, default=1, help="the target's layers the draft keeps"
    )
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--page-size", type=int, default=16)
    args = p.parse_args(argv)
    model = load_model(args.model)
    target = adapter_for(model)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, model.config.vocab_size, n).tolist() for n in (5, 17, 2, 30, 9, 12)]
    want = greedy_decode(target, prompts, args.max_new_tokens, page_size=args.page_size)
    run = speculative_decode(
        target, draft_from(model, args.draft_layers), prompts, args.max_new_tokens, args.k,
        page_size=args.page_size,
    )  # fmt: skip
    same = run.tokens == want
    print(f"{run.rounds} rounds of {args.k} drafts: acceptance {run.acceptance:.2f} "
          f"({run.accepted}/{run.drafted}); tokens equal to greedy decoding: {same}")  # fmt: skip
    return 0 if same else 1


if __name__ == "__main__":  # python -m examples.engine.speculative (repository root)
    raise SystemExit(main())
