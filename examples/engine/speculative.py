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

It runs its own plain loop, not ``Engine``'s (whose default loop is overlapped,
:mod:`.overlap`): each round's layout needs the number of drafts the previous verify
accepted, which the host reads before it plans the next round.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch

import flashplan as fp

from .hf_attention import HFConventions, Kind, StepContext, planned_groups
from .hf_models import DecoderOnly, adapter_for
from .run import make_executor

__all__ = [
    "SpeculativeRun",
    "draft_from",
    "greedy_decode",
    "speculative_decode",
]


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
    device: torch.device = field(init=False)

    def __post_init__(self) -> None:
        conv = HFConventions()
        self.groups = planned_groups(self.adapter.bindings, conv)[Kind.SELF]
        h = self.adapter.heads
        self.device = self.adapter.model.device
        shape = (self.num_pages, 2, self.page_size, h.num_kv_heads, h.head_dim)
        caches = [
            torch.zeros(shape, dtype=h.kv_dtype, device=self.device)
            for _ in range(self.adapter.num_layers)
        ]
        self.ctx = StepContext(self.executor, self.adapter.bindings, caches, conv)

    def forward(self, layout: fp.BatchLayout, table: fp.PageTable, ids: list[int]) -> torch.Tensor:
        """Logits ``[total_q, vocab]`` of every new token of ``layout``."""
        spec = fp.plan(layout, self.adapter.heads, extend_path="paged")
        self.executor.apply(spec, table)
        rows = torch.arange(spec.total_q, device=self.device)
        return self.adapter.decode(
            torch.tensor(ids, device=self.device), self.executor.positions().long(), rows, self.ctx
        ).float()


def _request_table(
    prompts: list[list[int]],
    room: int,
    page_size: int,
    extra_pages: int = 0,
    device: torch.device | None = None,
) -> fp.PageTable:
    """One row per request, each ``room`` tokens of its own pages, in a pool with
    ``extra_pages`` more (a tree's branch pages) after them; on ``device``."""
    width = -(-room // page_size)
    pages = torch.arange(len(prompts) * width, dtype=torch.int32).reshape(len(prompts), width)
    return fp.PageTable(
        pages.to(device), rows=np.arange(len(prompts)), num_pages=pages.numel() + extra_pages
    )


def _prefill(model: _Model, table: fp.PageTable, prompts: list[list[int]]) -> None:
    """Cache every prompt token but the last (the first pending token)."""
    lens = [len(p) - 1 for p in prompts]
    layout = fp.BatchLayout.extend(lens, page_size=model.page_size, groups=model.groups)
    model.forward(layout, table, [t for p in prompts for t in p[:-1]])


def greedy_decode(
    target: DecoderOnly, prompts: list[list[int]], max_new: int, *, page_size: int = 16
) -> list[list[int]]:
    """The target alone, one token per step: each request's first ``max_new`` tokens."""
    device = target.model.device
    table = _request_table(prompts, max(map(len, prompts)) + max_new + 1, page_size, 0, device)
    assert table.num_pages is not None
    model = _Model(target, make_executor(device), table.num_pages, page_size)
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
        drafted: draft depth offered (``k`` per request and round: a tree's depth, not
            its ``topk * k`` tokens).
        accepted: draft tokens accepted.
        moved: accepted paths that left the tree's first branch (their K/V moved by
            ``fp.compact_accepted``).
    """

    tokens: list[list[int]]
    rounds: int
    drafted: int
    accepted: int
    moved: int = 0

    @property
    def acceptance(self) -> float:
        """Accepted / drafted: the share of the offered depth accepted."""
        return self.accepted / max(self.drafted, 1)


def speculative_decode(
    target: DecoderOnly,
    draft: DecoderOnly,
    prompts: list[list[int]],
    max_new: int,
    k: int,
    *,
    topk: int = 1,
    page_size: int = 16,
) -> SpeculativeRun:
    """Greedy speculative decoding of ``prompts`` (each at least 2 tokens), ``k`` draft
    tokens per branch: one chain (``topk=1``, module docstring), or an EAGLE tree of
    ``topk`` branches (the draft's ``topk`` best first tokens, each continued greedily by a
    multi-step draft decode over branch rows; see :func:`_draft_tree`)."""
    room = max(map(len, prompts)) + max_new + (topk + 1) * k + 2  # a verify: L + topk*k + 1
    bs = len(prompts)
    # branch pages for a tree's draft decode: past the requests' rows in one pool
    per_branch = -(-(page_size - 1 + k) // page_size) + 1
    device = target.model.device
    table = _request_table(prompts, room, page_size, bs * topk * per_branch, device)
    rows_end, pool = table.pages.numel(), table.num_pages
    assert pool is not None
    own = torch.arange(rows_end, pool, dtype=torch.int32).reshape(bs, topk, per_branch)
    own = own.to(device)
    tgt = _Model(target, make_executor(device), pool, page_size)
    drf = _Model(draft, make_executor(device), pool, page_size)
    for m in (tgt, drf):
        _prefill(m, table, prompts)
    seqs = [list(p) for p in prompts]  # every token, the pending one last
    cached = np.array([len(p) - 1 for p in prompts])  # the target's
    draft_cached = cached.copy()
    out: list[list[int]] = [[] for _ in prompts]
    rounds = drafted = accepted = moved = 0
    while min(map(len, out)) < max_new:
        rounds += 1
        # 1. draft: catch up through the pending token, then propose
        layout = fp.BatchLayout.extend(cached + 1, draft_cached, page_size=page_size,
                                       groups=drf.groups)  # fmt: skip
        ids = [t for s, c in zip(seqs, draft_cached.tolist(), strict=True) for t in s[c:]]
        logits = drf.forward(layout, table, ids)
        first = logits[torch.from_numpy(np.cumsum(cached + 1 - draft_cached) - 1)]
        if topk == 1:
            tree, tokens = _draft_chain(drf, table, cached, first, k)
        else:
            tree, tokens = _draft_tree(drf, table, cached, first, k, topk, own)
        # 2. verify: the pending token and the tree, at L + depth
        layout = fp.BatchLayout.verify(cached, tree, page_size=page_size, groups=tgt.groups)
        ids = [t for s, d in zip(seqs, tokens.tolist(), strict=True) for t in (s[-1], *d)]
        preds = tgt.forward(layout, table, ids).argmax(-1).view(bs, tree.num_tokens).cpu().numpy()
        # 3. accept: from the root, follow the child holding the target's prediction
        full = np.concatenate([np.full((bs, 1), -1), tokens], axis=1)  # token per node
        paths = [_greedy_path(tree.parents[i], full[i], preds[i]) for i in range(bs)]
        fp.compact_accepted(tgt.ctx.kv_caches, table, cached, tree, paths, page_size=page_size)
        for i, path in enumerate(paths):
            new = [*full[i, path[1:]].tolist(), int(preds[i, path[-1]])]
            seqs[i] += new
            out[i] += new
        agree = np.array([len(p) - 1 for p in paths])
        moved += sum(p != list(range(len(p))) for p in paths)
        drafted += bs * k
        accepted += int(agree.sum())
        # a chain: the draft cached the pending token and d1 .. d(k-1) on the request
        # rows; a tree: the pending token only (the branches' K/V is on branch pages)
        draft_cached = cached + (np.minimum(agree + 1, k) if topk == 1 else 1)
        cached = cached + agree + 1
    return SpeculativeRun([o[:max_new] for o in out], rounds, drafted, accepted, moved)


def _greedy_path(parents: np.ndarray, tokens: np.ndarray, preds: np.ndarray) -> list[int]:
    """The accepted path: from the root, the child whose token is the target's
    prediction at the current node, while there is one."""
    path = [0]
    while True:
        children = np.flatnonzero((parents == path[-1]) & (tokens == preds[path[-1]]))
        if not children.size:
            return path
        path.append(int(children[0]))


def _draft_chain(  # type: ignore[no-untyped-def]
    drf: _Model, table: fp.PageTable, cached: np.ndarray, first: torch.Tensor, k: int
):
    """A chain of ``k`` drafts: the best first token, then ``k - 1`` greedy decodes on
    the request rows. Returns the tree and the draft tokens ``[bs, k]``."""
    drafts = [first.argmax(-1).tolist()]
    for s in range(1, k):
        layout = fp.BatchLayout.decode(cached + 1 + s, page_size=drf.page_size, groups=drf.groups)
        drafts.append(drf.forward(layout, table, drafts[-1]).argmax(-1).tolist())
    return fp.DraftTree.chain(len(cached), k + 1), np.array(drafts).T


def _draft_tree(  # type: ignore[no-untyped-def]
    drf: _Model,
    table: fp.PageTable,
    cached: np.ndarray,
    first: torch.Tensor,
    k: int,
    topk: int,
    own: torch.Tensor,
):
    """An EAGLE tree: the draft's ``topk`` best first tokens, each continued by ``k - 1``
    greedy steps of a multi-step draft decode over branch rows (``fp.DraftDecode``,
    ``PageTable.draft_branches``; each branch's first own page starts as a copy of the
    request's partial last page, ``fp.copy_prefix_pages``). Returns the tree and the
    draft tokens ``[bs, topk * k]`` (branch-major, as ``DraftTree.eagle``)."""
    bs, ps = len(cached), drf.page_size
    branch = [first.topk(topk, dim=-1).indices]  # [bs, topk]: each branch's first token
    if k > 1:
        plan = fp.DraftDecode(cached + 1, topk, k - 1, page_size=ps, groups=drf.groups)
        rows = fp.PageTable.draft_branches(table, plan.prefix_lens, topk,
                                           own[:, :, : plan.branch_pages], page_size=ps,
                                           num_pages=table.num_pages)  # fmt: skip
        fp.copy_prefix_pages(drf.ctx.kv_caches, table, plan.prefix_lens, own, page_size=ps)
        specs = fp.plan_steps(plan, drf.adapter.heads)
        views = drf.executor.apply_steps(specs, rows)
        for view in views:  # step s: each branch's s-th token in, its next token out
            ctx = dataclasses.replace(drf.ctx, executor=view)
            ids = branch[-1].reshape(-1)
            rows = torch.arange(len(ids), device=ids.device)
            logits = drf.adapter.decode(ids, view.positions().long(), rows, ctx)
            branch.append(logits.argmax(-1).view(bs, topk))
    tokens = torch.stack(branch, dim=2).reshape(bs, topk * k)  # [bs, branch, depth]
    return fp.DraftTree.eagle(bs, topk, k), tokens.cpu().numpy()


def main(argv: list[str] | None = None) -> int:
    """``python -m examples.engine.speculative --model llama --k 3`` (from the repository
    root): speculative vs plain greedy decoding of six random prompts; prints the
    acceptance and whether the tokens agree."""
    import argparse

    from .hf_models import load_model

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--model", default="llama")
    p.add_argument("--k", type=int, default=3, help="draft tokens per branch and round")
    p.add_argument("--topk", type=int, default=1, help="branches (1: a chain; more: a tree)")
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
        topk=args.topk, page_size=args.page_size,
    )  # fmt: skip
    same = run.tokens == want
    print(f"{run.rounds} rounds, {args.topk} branch(es) of {args.k}: acceptance "
          f"{run.acceptance:.2f} ({run.accepted}/{run.drafted}), {run.moved} paths moved; "
          f"tokens equal to greedy decoding: {same}")  # fmt: skip
    return 0 if same else 1


if __name__ == "__main__":  # python -m examples.engine.speculative (repository root)
    raise SystemExit(main())
