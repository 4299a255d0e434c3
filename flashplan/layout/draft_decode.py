"""`DraftDecode`: the multi-step draft decode of speculative decoding (EAGLE's draft
model): ``steps`` rounds of ``topk`` branches per request, each round a plain decode."""

from __future__ import annotations

from functools import cached_property

import attrs
import numpy as np
import numpy.typing as npt

from flashplan.arrays import INT32_MAX, array_key, readonly_when_unpickled, seal_inplace
from flashplan.errors import LayoutError
from flashplan.layout.batch import DEFAULT_GROUPS, BatchLayout, as_groups
from flashplan.layout.convert import as_int, as_lengths
from flashplan.layout.group import AttentionGroup
from flashplan.lengths import ceil_pages

__all__ = ["DraftDecode"]


def _steps_field(field: str, value: object) -> int:
    return as_int(field, value, minimum=1)


@readonly_when_unpickled
@attrs.frozen
class DraftDecode:
    """A multi-step draft decode: ``steps`` rounds, each a decode of ``topk`` branches per
    request (EAGLE's draft model).

    Branch ``b`` of request ``i`` is a page-table row of its own
    (:meth:`~flashplan.PageTable.draft_branches` builds them): the request's prefix
    pages, then the branch's own pages. At step ``s`` the branch's query sits at
    position ``prefix + s`` and sees the prefix and the branch's ``s`` earlier draft
    tokens; its K/V is written at row token ``prefix + s`` of the branch row. Every step
    is a plain decode over ``batch_size * topk`` branches (:meth:`step`); plan them all
    with :func:`flashplan.plan_steps` and apply them with one ``apply_steps``.

    Attributes:
        prefix_lens: int32 ``[bs]`` (tokens) each request's verified tokens.
        topk: branches per request.
        steps: draft rounds.
        page_size: tokens per KV page.
        groups: the attention groups (causal self groups).
    """

    prefix_lens: npt.NDArray[np.int32] = attrs.field(
        converter=lambda v: as_lengths("prefix_lens", v), eq=array_key
    )
    topk: int = attrs.field(converter=lambda v: _steps_field("topk", v))
    steps: int = attrs.field(converter=lambda v: _steps_field("steps", v))
    page_size: int = attrs.field(default=1, converter=lambda v: _steps_field("page_size", v))
    groups: tuple[AttentionGroup, ...] = attrs.field(
        default=None, converter=lambda v: _draft_groups(v)
    )

    def __attrs_post_init__(self) -> None:
        # Every step's decode layout must be valid: the last holds the most tokens.
        last = self.prefix_lens.astype(np.int64) + self.steps
        if last.size and int(np.maximum.reduce(last)) > INT32_MAX:
            i = int(np.flatnonzero(last > INT32_MAX)[0])
            raise LayoutError(
                "prefix_lens", "prefix + steps exceeds int32 (the last step's seq_len)",
                request=i, prefix_len=int(self.prefix_lens[i]), steps=self.steps,
            )  # fmt: skip
        pages = int(np.add.reduce(ceil_pages(last, self.page_size))) * self.topk
        if pages > INT32_MAX:
            raise LayoutError(
                "prefix_lens", "the last step's rows (topk per request) need more pages in "
                "all than int32 holds: a plan indexes them with int32 index pointers",
                total_pages=pages, topk=self.topk, page_size=self.page_size,
            )  # fmt: skip

    @property
    def batch_size(self) -> int:
        """Requests."""
        return int(self.prefix_lens.shape[0])

    @cached_property
    def branch_prefix_lens(self) -> npt.NDArray[np.int32]:
        """int32 ``[bs * topk]``: each branch's prefix (request-major)."""
        return seal_inplace(np.repeat(self.prefix_lens, self.topk))

    def step(self, s: int) -> BatchLayout:
        """The decode :class:`~flashplan.BatchLayout` of step ``s`` (0-based): each branch
        holds ``prefix + s + 1`` tokens, the new one its ``s``-th draft token."""
        step = as_int("step", s, minimum=0, maximum=self.steps - 1)
        seq = self.branch_prefix_lens.astype(np.int64) + step + 1
        return BatchLayout.decode(seq, page_size=self.page_size, groups=self.groups)

    @cached_property
    def branch_pages(self) -> int:
        """Pages each branch owns after the shared full prefix pages: room for the copy
        of the prefix's partial last page and the ``steps`` draft tokens (the most over
        the batch)."""
        tail = self.prefix_lens.astype(np.int64) % self.page_size + self.steps
        return int(ceil_pages(tail, self.page_size).max()) if tail.size else 1


def _draft_groups(value: object) -> tuple[AttentionGroup, ...]:
    groups = DEFAULT_GROUPS if value is None else as_groups("groups", value)
    if any(g.cross_attention or not g.causal for g in groups):
        raise LayoutError("groups", "a draft decode plans causal self groups")
    return groups
