"""Rebuild "which key each query sees" from a plan's kernel calls alone.

:func:`materialize` applies FlashInfer's masking rules (:mod:`flashplan.kernel_rules`)
to the arguments a plan gives each kernel call, and places the result in the group's
key space. Comparing it with :mod:`flashplan.oracle` — which states the rules from the
layout — checks the planner. Written per request for clarity: a test and ``explain``
aid, not a hot path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np
import numpy.typing as npt

from flashplan.errors import PlanIntegrityError
from flashplan.kernel_rules import MultiItemArgs, kernel_visibility
from flashplan.layout.group import AttentionGroup
from flashplan.planning.parts import GroupPlan

if TYPE_CHECKING:
    from flashplan.planning.cascade import Cascade


class _Plan(Protocol):
    """What :func:`materialize` reads of a :class:`~flashplan.PlanSpec` (a protocol, so
    that the plan's own views can call it without an import cycle)."""

    @property
    def batch_size(self) -> int: ...
    @property
    def page_size(self) -> int: ...
    @property
    def qo_lens(self) -> npt.NDArray[np.int32]: ...
    @property
    def qo_indptr(self) -> npt.NDArray[np.int32]: ...
    @property
    def group_plans(self) -> tuple[GroupPlan, ...]: ...
    @property
    def cascade(self) -> Cascade | None: ...
    def group_plan(self, group: AttentionGroup) -> GroupPlan: ...


__all__ = ["PlanIntegrityError", "materialize"]


def _one_call(
    qo_len: int,
    kv_len: int,
    *,
    causal: bool,
    window_left: int,
    mask: npt.NDArray[np.bool_] | None = None,
    items: MultiItemArgs | None = None,
) -> npt.NDArray[np.bool_]:
    """``[qo_len, kv_len]`` visibility of one request's kernel call (custom mask or
    multi-item rule applied)."""
    seen = kernel_visibility(
        np.array([qo_len]),
        np.array([kv_len]),
        qo_len,
        kv_len,
        causal=causal,
        window_left=window_left,
        items=items,
    )[0]
    return seen if mask is None else seen & mask


def materialize(spec: _Plan, group: AttentionGroup) -> list[npt.NDArray[np.bool_]]:
    """Per request, ``[qo_len, num_keys]`` booleans built from the plan's kernel calls.

    Entry ``[j, k]`` is true when new token ``j`` of the request attends to key ``k``
    of the group's key space.

    A group that runs on cascade levels (:attr:`PlanSpec.cascade
    <flashplan.PlanSpec>`) is rebuilt from those calls instead of its paged call: each
    level's call over its group's shared pages (every key visible; read from the group's
    first member's row, which holds the same pages: the sharing's promise) and the
    request's own call (:meth:`Cascade.own_call <flashplan.planning.cascade.Cascade.own_call>`).

    Raises:
        PlanMismatchError: ``group`` was not planned.
        PlanIntegrityError: a kernel call would read a key outside the group's key
            space, or two calls would read the same key for the same query.
    """
    gp = spec.group_plan(group)
    ps = spec.page_size
    qo = spec.qo_lens
    bs = spec.batch_size
    # The calls' entries: the plan's requests, or the group's virtual requests; entry v
    # belongs to request req[v] and holds its queries from row offset[v] on.
    if gp.virtual is None:
        req = np.arange(bs)
        entry_q = qo.astype(np.int64)
    else:
        req = gp.virtual.request.astype(np.int64)
        entry_q = gp.virtual.queries.lens.astype(np.int64)
    starts = np.cumsum(entry_q) - entry_q
    offset = starts - starts[np.searchsorted(req, req)]
    out = [np.zeros((int(qo[i]), int(gp.num_keys[i])), dtype=bool) for i in range(bs)]
    cascade = spec.cascade
    on_levels = [] if cascade is None else [
        k for k in cascade.groups if gp is spec.group_plans[k]
    ]  # fmt: skip
    if not on_levels:
        cascade = None
    # a group on cascade levels: its paged call is its own call (over the plan's requests)
    paged = gp.paged if cascade is None else cascade.own_call(on_levels[0])
    for v in range(req.shape[0]):
        i, e, row = int(req[v]), int(entry_q[v]), int(offset[v])
        k_total = int(gp.num_keys[i])
        parts: list[tuple[int, npt.NDArray[np.bool_]]] = []
        if cascade is not None:
            parts += _level_calls(cascade, spec, i, int(gp.key_start[i]))
        if paged is not None:
            p = paged
            call = p.call_spans
            mask = p.dense_mask(v)
            seen = _one_call(
                e, int(call.kv_lens[v]), causal=p.causal, window_left=p.window_left, mask=mask,
                items=None if p.items is None else p.items.request(v),
            )  # fmt: skip
            parts.append((int(call.start_page[v]) * ps - int(gp.key_start[i]), seen))
        if gp.ragged is not None:
            r = gp.ragged
            n = int(r.kv_lens[v])
            # the entry's keys are its own new tokens: after the request's cached prefix
            first = k_total - int(qo[i]) + row
            parts.append((first, _one_call(e, n, causal=r.causal, window_left=r.window_left)))
        pic = out[i][row : row + e]
        for first, seen in parts:
            keys = first + np.arange(seen.shape[1])
            inside = (keys >= 0) & (keys < k_total)
            if seen[:, ~inside].any():
                raise PlanIntegrityError(
                    f"request {i}: plan shows keys outside [0, {k_total}) of group "
                    f"{gp.group.describe()!r}"
                )
            sub = seen[:, inside]
            cols = keys[inside]
            if (pic[:, cols] & sub).any():
                raise PlanIntegrityError(f"request {i}: two kernel calls read the same key")
            pic[:, cols] |= sub
    return out


def _level_calls(
    cascade: Cascade, spec: _Plan, i: int, key_start: int
) -> list[tuple[int, npt.NDArray[np.bool_]]]:
    """Request ``i``'s calls on cascade levels: ``(first key, [qo_len, kv_len]
    visibility)`` of each level's call its rows are in (no mask: every key shows)."""
    e = int(spec.qo_lens[i])
    parts = []
    for level in cascade.levels.levels:
        g = level.group_of_row(int(spec.qo_indptr[i]))
        if g >= 0:
            first = int(level.spans.start_page[g]) * spec.page_size - key_start
            parts.append((first, np.ones((e, int(level.spans.kv_lens[g])), dtype=bool)))
    return parts
