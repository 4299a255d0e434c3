"""``explain --shared``: a batch's shared prefixes as text, and the check that its cascade
levels and own parts read each request's keys once.

Example::

    python -m flashplan explain --seq-lens 40,44,50,36 --decode --page-size 4 \\
        --shared "0-3:20; 1-2:33"

plans the batch with ``cascade="on"`` (:func:`flashplan.plan`) and prints, after the
plan, every level's groups (members, shared tokens, the pages read from the first
member's row, the call's query rows) and each request's own part, then checks that the
parts partition each request's keys ``[0, seq_len)`` (or its decoder row's, after the
encoder tokens).
"""

from __future__ import annotations

import argparse

import numpy as np

from flashplan.layout.batch import BatchLayout
from flashplan.layout.shared_prefix import SharedPrefix, ShareLevel
from flashplan.planning.cascade import CascadePlan
from flashplan.planning.spec import PlanSpec

__all__ = ["cascade_problem", "describe_cascade", "shared_prefix_arg"]


def shared_prefix_arg(text: str) -> SharedPrefix:
    """Parse ``--shared``: levels outermost first, separated by ``;``; each level's
    groups separated by ``,``; a group ``first-last:tokens`` (requests ``first`` to
    ``last`` inclusive share their first ``tokens`` tokens). ``"0-3:20; 1-2:33"``: all
    four requests share 20 tokens, requests 1 and 2 share 33.

    The record's own checks (group sizes, nesting) still apply when it is built.
    """
    levels = []
    try:
        for level_text in text.split(";"):
            ranges, lens = [], []
            for group in level_text.split(","):
                span, tokens = group.split(":")
                first, last = (int(x) for x in span.split("-"))
                ranges.append(range(first, last + 1))
                lens.append(int(tokens))
            levels.append(ShareLevel.from_groups(ranges, lens))
    except ValueError as exc:  # a LayoutError is a ValueError too: keep its message
        raise argparse.ArgumentTypeError(
            f"expected levels such as '0-3:20; 1-2:33' (';' between levels, ',' between "
            f"groups, first-last:tokens each); got {text!r} ({exc})"
        ) from None
    return SharedPrefix.nested(*levels)


def describe_cascade(spec: PlanSpec) -> str:
    """The cascade block of ``explain``: levels, groups and own parts (token and page
    ranges are a request's row tokens and page-table columns)."""
    cascade = spec.cascade
    if cascade is None:
        return "cascade: none (no group of this plan can run on levels)"
    plan = cascade.levels
    ps = spec.page_size
    lines = [f"cascade levels (group plans {list(cascade.groups)} run on them):"]
    for k, level in enumerate(plan.levels):
        spans = level.spans
        lines.append(f"  level {k}: one non-causal call, {level.row_of.shape[0]} group(s)")
        for g, owner in enumerate(level.row_of.tolist()):
            rows = level.q_rows[level.qo_indptr[g] : level.qo_indptr[g + 1]]
            first, end = int(spans.first_token[g]), int(spans.end_token[g])
            lines.append(
                f"    group {g}: query rows {_ranges(rows)}; pages {first // ps}..{end // ps - 1}"
                f" of request {owner}'s row (tokens {first}..{end - 1})"
            )  # a level's group reads at least one whole page (cascade_levels)
    if cascade.own_mask is not None:
        how = "under the tree mask"
    else:
        how = ", ".join(
            f"group plan {g} {'causal' if c else 'non-causal'}"
            for g, c in zip(cascade.groups, cascade.own_causal, strict=True)
        )
    lines.append(f"  own parts (each request's own call, {how}):")
    own = plan.own
    for i in range(spec.batch_size):
        lines.append(
            f"    request {i}: tokens {int(own.first_token[i])}..{int(own.end_token[i]) - 1}"
            f" (from page {int(own.start_page[i])})"
        )
    return "\n".join(lines)


def cascade_problem(spec: PlanSpec, layout: BatchLayout) -> str | None:
    """``None`` when the levels and own parts of ``spec`` read each request's keys (its
    row tokens ``[decoder_start, decoder_start + seq_len)``) exactly once and every
    level reads only whole cached pages; else what is wrong (naming the request).

    Linear in the batch: each level's query rows are read once (a group's members are
    found by the request of each of its rows), and each request's parts are checked as
    token intervals, not token by token.
    """
    cascade = spec.cascade
    if cascade is None:
        return None
    plan: CascadePlan = cascade.levels
    parts = _level_parts(plan, spec.qo_lens)
    for i in range(spec.batch_size):
        problem = _request_problem(spec, layout, plan, i, parts[i])
        if problem is not None:
            return problem
    return None


#: One level group's part of a request: (level, rows of the request it runs, first row
#: token, end row token).
_Part = tuple[int, int, int, int]


def _level_parts(plan: CascadePlan, qo_lens: np.ndarray) -> list[list[_Part]]:
    """Per request, the level groups that run any of its query rows, level by level.

    Args:
        plan: the cascade's levels.
        qo_lens: int ``[bs]``: each request's query rows (``spec.qo_lens``).
    """
    lens = np.asarray(qo_lens, dtype=np.int64)
    row_request = np.repeat(np.arange(lens.shape[0]), lens)  # [total_q]: request of a row
    parts: list[list[_Part]] = [[] for _ in range(lens.shape[0])]
    for k, level in enumerate(plan.levels):
        ptr = level.qo_indptr.tolist()
        for g in range(level.row_of.shape[0]):
            rows = np.unique(np.asarray(level.q_rows[ptr[g] : ptr[g + 1]], dtype=np.int64))
            rows = rows[(rows >= 0) & (rows < row_request.shape[0])]
            members, counts = np.unique(row_request[rows], return_counts=True)
            first, end = int(level.spans.first_token[g]), int(level.spans.end_token[g])
            for r, n in zip(members.tolist(), counts.tolist(), strict=True):
                parts[r].append((k, n, first, end))
    return parts


def _request_problem(
    spec: PlanSpec, layout: BatchLayout, plan: CascadePlan, i: int, levels: list[_Part]
) -> str | None:
    """What is wrong with request ``i``'s level parts and own part, or ``None``."""
    ps = spec.page_size
    spans: list[tuple[int, int]] = []
    for k, rows, a, b in levels:
        if rows != int(spec.qo_lens[i]):
            return f"request {i}: level {k} runs some of its query rows only"
        if b > a and (a % ps or b % ps):
            return f"request {i}: level {k} reads a partial page"
        spans.append((a, b))
    own = (int(plan.own.first_token[i]), int(plan.own.end_token[i]))
    start = int(layout.decoder_start[i])
    if not _tiles([*spans, own], start, start + int(layout.seq_lens[i])):
        return f"request {i}: the levels and its own part do not read each key once"
    level_ends = [b for a, b in spans if b > a]
    if level_ends and max(level_ends) > start + int(layout.prefix_lens[i]):
        return f"request {i}: a level reads tokens it adds in this step"
    return None


def _tiles(spans: list[tuple[int, int]], start: int, end: int) -> bool:
    """Whether the token ranges ``[a, b)`` (empty ones ignored) cover ``[start, end)``
    exactly once."""
    at = start
    for a, b in sorted(s for s in spans if s[1] > s[0]):
        if a != at:
            return False
        at = b
    return at == end


def _ranges(values: np.ndarray) -> str:
    """``[0, 1, 2, 5]`` -> ``"0..2, 5"``."""
    out: list[str] = []
    items = values.tolist()
    k = 0
    while k < len(items):
        j = k
        while j + 1 < len(items) and items[j + 1] == items[j] + 1:
            j += 1
        out.append(str(items[k]) if j == k else f"{items[k]}..{items[j]}")
        k = j + 1
    return ", ".join(out)
