"""Long random sequences of batches, for testing an executor as an engine uses it.

An engine keeps one executor for the life of the process and feeds it batch after batch:
other modes, group sets, page sizes, heads, paths and page tables. Whatever the executor
keeps from one ``apply`` to the next must not leak into a later batch.
:func:`batch_sequence` draws such a sequence: every mode (:data:`SEQUENCE_MODES`), page
size, path and group kind, a new shuffled page table per batch, heads fixed or drawn per
batch. :mod:`flashplan.testing.checking` runs it through one long-lived executor and
compares every batch with a fresh oracle.

Batch ``i`` of seed ``s`` is drawn from ``numpy.random.default_rng((s, i))`` alone, so a
failure names its batch (and the one before it) and the batch can be drawn again on its
own (:func:`random_batch`). Needs no Hypothesis.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import attrs
import numpy as np
import torch

from flashplan.layout.batch import BatchLayout
from flashplan.layout.draft_decode import DraftDecode
from flashplan.layout.drafts import DraftTree
from flashplan.layout.group import AttentionGroup
from flashplan.layout.heads import HeadConfig
from flashplan.layout.page_table import PageTable
from flashplan.planning.chunks import needs_position_mask
from flashplan.planning.planner import plan, plan_steps
from flashplan.planning.spec import PlanSpec
from flashplan.testing.batches import bushy_tree_parents

__all__ = [
    "FIXED_HEADS",
    "SEQUENCE_MODES",
    "SEQUENCE_PAGE_SIZES",
    "VARIED_HEADS",
    "Batch",
    "batch_sequence",
    "random_batch",
]

#: Every kind of batch :func:`random_batch` draws.
SEQUENCE_MODES = (
    "decode",
    "extend",
    "multi_item",
    "verify_tree",
    "verify_chain",
    "draft_extend",
    "draft_extend_fixed",
    "draft_decode",
    "block_extend",
)

#: Page sizes drawn (tokens per page).
SEQUENCE_PAGE_SIZES = (1, 4, 8, 16)

#: One model's heads (query heads, KV heads, head size), kept for a whole sequence.
FIXED_HEADS = (32, 8, 128)

#: Heads drawn per batch when they vary (query heads per KV head 1, 2, 4 and 8).
VARIED_HEADS = ((32, 8, 128), (16, 16, 64), (8, 4, 64), (16, 2, 128), (4, 4, 128))

_PATHS = ("auto", "paged", "ragged")


@attrs.frozen(eq=False)
class Batch:
    """One batch of a sequence, ready to apply.

    Attributes:
        index: position in the sequence.
        seed: the seed of its inputs (queries, new K/V, caches).
        label: what it is, for failure messages (mode, sizes, page size, groups, heads,
            path).
        groups: the groups to run (the layout's own records).
        heads: the heads it is planned for.
        specs: its plan, or every step's plan of a multi-step draft decode.
        steps: whether ``specs`` are applied together (``apply_steps``).
        table: its page table, on the batch's device (a new one per batch: shuffled ids,
            spare pages, extra rows and columns).
        num_pages: pages in the pool the table points into.
    """

    index: int
    seed: int
    label: str
    groups: tuple[AttentionGroup, ...]
    heads: HeadConfig
    specs: tuple[PlanSpec, ...]
    steps: bool
    table: PageTable
    num_pages: int


def _heads(rng: np.random.Generator, vary: bool, dtype: torch.dtype) -> HeadConfig:
    hq, hkv, d = VARIED_HEADS[int(rng.integers(len(VARIED_HEADS)))] if vary else FIXED_HEADS
    return HeadConfig(num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, q_dtype=dtype)


def _self_group(rng: np.random.Generator, *, window: bool, sinks: bool) -> AttentionGroup:
    """A causal self group: full or windowed, with or without soft cap, explicit scale or
    (where ``sinks``) attention sinks."""
    cap = float(rng.choice([0.0, 30.0, 50.0])) if rng.random() < 0.4 else 0.0
    scale = float(rng.choice([0.05, 0.1])) if rng.random() < 0.2 else None
    sink = sinks and rng.random() < 0.25
    if window and rng.random() < 0.6:
        w = int(rng.choice([0, 3, 15, 40, 127, 300]))
        return AttentionGroup.sliding(w, logits_soft_cap=cap, sm_scale=scale, sinks=sink)
    return AttentionGroup.full(logits_soft_cap=cap, sm_scale=scale, sinks=sink)


def _local_group(rng: np.random.Generator, *, band: bool) -> AttentionGroup:
    """A chunked group (chunks on and off page boundaries), or where ``band`` a
    bidirectional window; sinks on some."""
    sink = rng.random() < 0.3
    if band and rng.random() < 0.4:
        left, right = (int(v) for v in rng.choice([0, 2, 7, 31], 2))
        return AttentionGroup.bidirectional(window_left=left, window_right=right, sinks=sink)
    return AttentionGroup.chunked(int(rng.choice([4, 8, 16, 24, 64])), sinks=sink)


def _groups(
    rng: np.random.Generator,
    *,
    window: bool = True,
    cross: bool = False,
    bidirectional: bool = False,
    local: bool = False,
) -> tuple[AttentionGroup, ...]:
    """1–3 distinct self groups (0–2 windows), a bidirectional group where allowed, a
    chunked or bidirectional-window group and sinks where ``local``, and one cross group
    where asked."""
    out: list[AttentionGroup] = []
    for _ in range(int(rng.integers(1, 4))):
        g = _self_group(rng, window=window, sinks=local)
        if g not in out:
            out.append(g)
    if bidirectional and rng.random() < 0.4:
        out.append(AttentionGroup.bidirectional())
    if local and rng.random() < 0.4:
        g = _local_group(rng, band=bidirectional)
        if g not in out:
            out.append(g)
    if cross:
        out.append(AttentionGroup.cross(logits_soft_cap=30.0 if rng.random() < 0.3 else 0.0))
    return tuple(out)


def _lens(rng: np.random.Generator, bs: int, lo: int, hi: int, long: int = 0) -> np.ndarray:
    """``bs`` lengths in ``[lo, hi)``, one in five drawn up to ``long`` instead."""
    out = rng.integers(lo, hi, bs)
    if long > hi:
        far = rng.random(bs) < 0.2
        out[far] = rng.integers(lo, long, int(far.sum()))
    return out


def _tree(rng: np.random.Generator, bs: int, n: int, chain: bool) -> DraftTree:
    """A chain, or random trees whose token ``j`` hangs under any earlier token."""
    if chain:
        return DraftTree.chain(bs, n)
    return DraftTree.from_parents(bushy_tree_parents(rng, bs, n, reach=n))


def _delimiters(rng: np.random.Generator, ext: np.ndarray) -> list[list[int] | None]:
    """Per request: sorted delimiter positions among its new tokens, ``None`` (a plain
    request) or ``[]``; one batch in six has every list empty."""
    if rng.random() < 1 / 6:
        return [[] for _ in ext]
    out: list[list[int] | None] = []
    for e in ext.tolist():
        kind = rng.random()
        if kind < 0.15:
            out.append(None)
        elif kind < 0.25:
            out.append([])
        else:
            first = int(rng.integers(0, e))
            rest = rng.choice(np.arange(first + 1, e), size=min(e - first - 1, 6), replace=False)
            out.append(sorted([first, *[int(x) for x in rest if rng.random() < 0.6]]))
    return out


def _table(
    rng: np.random.Generator, pages_needed: np.ndarray, device: torch.device | str
) -> PageTable:
    return PageTable.shuffled(
        pages_needed,
        seed=int(rng.integers(2**31)),
        spare_pages=int(rng.integers(0, 5)),
        extra_rows=int(rng.integers(0, 3)),
        extra_columns=int(rng.integers(0, 3)),
        device=device,
    )


def _label(
    index: int,
    mode: str,
    detail: str,
    page_size: int,
    groups: Sequence[AttentionGroup],
    heads: HeadConfig,
) -> str:
    """What a batch is, for failure messages."""
    described = ", ".join(g.describe() for g in groups)
    h = f"{heads.num_qo_heads}/{heads.num_kv_heads}x{heads.head_dim} {heads.q_dtype}"
    return f"{index}: {mode} {detail} page={page_size} groups=[{described}] heads={h}"


def random_batch(
    seed: int,
    index: int,
    *,
    device: torch.device | str = "cpu",
    vary_heads: bool = True,
    dtype: torch.dtype = torch.bfloat16,
    modes: Sequence[str] = SEQUENCE_MODES,
    page_sizes: Sequence[int] = SEQUENCE_PAGE_SIZES,
    max_batch: int = 6,
    scale: float = 1.0,
) -> Batch:
    """Batch ``index`` of sequence ``seed`` (drawn from ``default_rng((seed, index))``).

    Args:
        seed, index: which batch.
        device: where its page table lives.
        vary_heads: draw the heads per batch (:data:`VARIED_HEADS`); else
            :data:`FIXED_HEADS`.
        dtype: the heads' query / KV / output dtype.
        modes: the kinds of batch to draw from (:data:`SEQUENCE_MODES`).
        page_sizes: the page sizes to draw from.
        max_batch: most requests.
        scale: lengths are drawn up to ``scale`` times their default bounds (a CPU
            suite uses a fraction).
    """
    rng = np.random.default_rng((seed, index))
    # plain extends twice as often: they cover the most paths (ragged, ragged + paged)
    weights = np.array([2.0 if m == "extend" else 1.0 for m in modes])
    mode = str(rng.choice(list(modes), p=weights / weights.sum()))
    ps = int(rng.choice(list(page_sizes)))
    heads = _heads(rng, vary_heads, dtype)
    bs = int(rng.integers(1, max_batch + 1))

    def n(value: int) -> int:
        return max(int(value * scale), 2)

    path = "auto"
    detail = ""
    if mode == "draft_decode":
        prefix = _lens(rng, bs, 1, n(200), n(1200))
        topk, count = int(rng.choice([1, 2, 4])), int(rng.integers(1, 5))
        groups = _groups(rng)
        draft = DraftDecode(prefix, topk, count, page_size=ps, groups=groups)
        specs = plan_steps(draft, heads)
        prompt = _table(rng, -(-prefix // ps), device)
        assert prompt.num_pages is not None
        own = draft.branch_pages
        num_pages = prompt.num_pages + bs * topk * own
        branch = torch.arange(prompt.num_pages, num_pages, dtype=torch.int32)
        branch = branch[torch.from_numpy(rng.permutation(bs * topk * own))]
        table = PageTable.draft_branches(
            prompt, prefix, topk, branch.reshape(bs, topk, own).to(device), page_size=ps,
            num_pages=num_pages,
        )  # fmt: skip
        detail = f"bs={bs} topk={topk} steps={count} prefix={prefix.tolist()}"
        label = _label(index, mode, detail, ps, groups, heads)
        return Batch(index, _seed(seed, index), label, groups, heads, specs, True, table,
                     num_pages)  # fmt: skip
    encoder = None
    if mode == "decode":
        cross = rng.random() < 0.3
        groups = _groups(rng, cross=cross, local=True)
        seq = _lens(rng, bs, 1, n(300), n(3000))
        if cross:
            encoder = rng.integers(0, n(40), bs)
            cached = rng.random(bs) < 0.7
            layout = BatchLayout.decode(seq, page_size=ps, groups=groups, encoder_lens=encoder,
                                        encoder_cached=cached)  # fmt: skip
        else:
            layout = BatchLayout.decode(seq, page_size=ps, groups=groups)
        detail = f"seq={seq.tolist()}"
    elif mode in ("extend", "multi_item", "block_extend"):
        cross = rng.random() < 0.3
        if cross:
            encoder = rng.integers(0, n(40), bs)
        # a third of the batches have no cached prefix anywhere (the ragged path)
        cached = rng.random(bs) < (0.7 if rng.random() < 2 / 3 else 0.0)
        prefix = _lens(rng, bs, 0, n(200), n(2000)) * cached
        if mode == "block_extend":
            block = int(rng.choice([1, 4, 16, 32]))
            groups = (AttentionGroup.bidirectional(), *_groups(rng, window=False, cross=cross))
            path = str(rng.choice(_PATHS))
            layout = BatchLayout.block_extend(prefix + block, block, page_size=ps, groups=groups,
                                              encoder_lens=encoder)  # fmt: skip
            detail = f"block={block} prefix={prefix.tolist()}"
        else:
            ext = _lens(rng, bs, 1, n(64), n(400))
            items = None
            if mode == "multi_item":
                groups = _groups(rng, window=False, cross=cross)
                items = _delimiters(rng, ext)
                path = str(rng.choice(["auto", "paged"]))
            else:
                groups = _groups(rng, cross=cross, bidirectional=True, local=True)
                path = str(rng.choice(_PATHS))
                if path == "ragged" and any(  # a position mask runs paged only
                    needs_position_mask(g, ps) for g in groups if not g.cross_attention
                ):
                    path = "paged"
            layout = BatchLayout.extend(prefix + ext, prefix, page_size=ps, groups=groups,
                                        encoder_lens=encoder, item_delimiters=items)  # fmt: skip
            detail = f"prefix={prefix.tolist()} ext={ext.tolist()}"
            if items is not None:
                detail += f" items={items}"
    elif mode in ("verify_tree", "verify_chain"):
        cross = rng.random() < 0.3
        groups = _groups(rng, cross=cross, local=True)
        prefix = _lens(rng, bs, 0, n(300), n(3000))
        tokens = int(rng.choice([1, 2, 4, 8, 16]))
        tree = _tree(rng, bs, tokens, mode == "verify_chain")
        if cross:
            encoder = rng.integers(0, n(40), bs)
        layout = BatchLayout.verify(prefix, tree, page_size=ps, groups=groups,
                                    encoder_lens=encoder)  # fmt: skip
        detail = f"N={tokens} prefix={prefix.tolist()}"
    else:  # draft_extend, draft_extend_fixed
        groups = _groups(rng)
        prefix = _lens(rng, bs, 0, n(300), n(2000))
        fixed = int(rng.choice([2, 4, 8])) if mode == "draft_extend_fixed" else None
        accepted = rng.integers(1, (fixed or 8) + 1, bs)
        layout = BatchLayout.draft_extend(prefix, accepted, tokens_per_request=fixed,
                                          page_size=ps, groups=groups)  # fmt: skip
        path = str(rng.choice(["auto", "paged"]))
        detail = f"prefix={prefix.tolist()} accepted={accepted.tolist()} fixed={fixed}"
    if encoder is not None:
        detail += f" encoder={encoder.tolist()}"
    spec = plan(layout, heads, extend_path=path)
    table = _table(rng, spec.pages_needed, device)
    assert table.num_pages is not None
    label = _label(index, mode, f"bs={bs} {detail}", ps, layout.groups, heads) + f" path={path}"
    return Batch(index, _seed(seed, index), label, layout.groups, heads, (spec,), False, table,
                 table.num_pages)  # fmt: skip


def _seed(seed: int, index: int) -> int:
    return (seed * 1_000_003 + index) % (2**31)


def batch_sequence(seed: int, count: int, **kwargs: object) -> Iterator[Batch]:
    """Batches ``0 .. count - 1`` of sequence ``seed`` (:func:`random_batch`'s keyword
    arguments apply to every batch)."""
    for index in range(count):
        yield random_batch(seed, index, **kwargs)  # type: ignore[arg-type]
