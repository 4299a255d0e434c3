"""`PlanSpec` and `GroupPlan`: the frozen output of planning (the kernel calls' records,
`PagedPart` and `RaggedPart`, are in :mod:`flashplan.planning.parts`).

A plan splits into a hashable static :class:`PlanKey` (mode, groups, page size,
heads, kernel path per group — never the batch's own lengths) and host int32
arrays. Executors cache wrappers by key and feed the arrays to the kernels.
All arrays are read-only numpy arrays on the host; units are given per field.
Every record compares and hashes by value; fields that follow from others are
properties, never stored, so a record cannot contradict itself.

Token coordinates (see :class:`~flashplan.BatchLayout`): a *row token* indexes a
request's page-table row; a *position* counts decoder tokens from 0.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from functools import cached_property

import attrs
import numpy as np
import numpy.typing as npt

from flashplan.arrays import (
    IntArray,
    array_key,
    filled,
    int32_field,
    readonly_when_unpickled,
    same_length,
    seal_inplace,
)
from flashplan.errors import FieldTypeError, LayoutError, PlanMismatchError
from flashplan.layout.batch import Mode
from flashplan.layout.group import AttentionGroup
from flashplan.layout.heads import HeadConfig
from flashplan.lengths import Lengths
from flashplan.planning.cascade import Cascade
from flashplan.planning.parts import GroupPlan, KernelPath, PagedPart, RaggedPart, VirtualRequests
from flashplan.planning.pictures import ascii_visibility
from flashplan.planning.positions import PositionRuns
from flashplan.planning.visibility import materialize

__all__ = [
    "ExtendPath",
    "GroupPlan",
    "KernelPath",
    "PagedPart",
    "PlanKey",
    "PlanSpec",
    "RaggedPart",
    "VirtualRequests",
]


class ExtendPath(enum.Enum):
    """How an extend batch's self-attention groups are planned (a planning choice)."""

    AUTO = "auto"
    PAGED = "paged"
    RAGGED = "ragged"

    @classmethod
    def parse(cls, value: object) -> ExtendPath:
        """An :class:`ExtendPath` from itself or its value (``"auto"``, ``"paged"``,
        ``"ragged"``); :class:`~flashplan.LayoutError` for anything else."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            for member in cls:
                if value == member.value:
                    return member
        raise LayoutError("extend_path", "must be 'auto', 'paged' or 'ragged'", extend_path=value)


@attrs.frozen(cache_hash=True)  # a dict key every step: hashed once
class PlanKey:
    """The static, hashable part of a plan.

    Two batches with equal keys can share wrappers, buffers and compiled kernels;
    the key never depends on the batch's lengths beyond the kernel path chosen.
    ``groups`` are the groups as planned: resolved to an explicit ``sm_scale``
    (:meth:`AttentionGroup.resolved`), so equal computations give equal keys.
    ``multi_item`` says whether the batch is a multi-item scoring batch (its self
    groups' paged calls run FlashInfer's multi-item mask mode): whether the layout has
    ``item_delimiters``, never whether this batch's requests happen to hold one.
    """

    mode: Mode
    groups: tuple[AttentionGroup, ...]
    paths: tuple[KernelPath, ...]
    page_size: int
    heads: HeadConfig
    multi_item: bool = False


@readonly_when_unpickled
@attrs.frozen
class PlanSpec:
    """A complete, frozen plan for one batch: what every executor needs.

    Example: a decode step of two requests with 5 and 9 tokens, page size 4:

    >>> import flashplan as fp
    >>> spec = fp.plan(fp.BatchLayout.decode([5, 9], page_size=4), fp.HeadConfig(4, 1, 64))
    >>> spec.qo_indptr.tolist(), spec.positions.tolist(), spec.write_start.tolist()
    ([0, 1, 2], [4, 8], [4, 8])
    >>> paged = spec.group_plans[0].paged
    >>> paged.page_indptr.tolist(), paged.last_page_len.tolist(), spec.pages_needed.tolist()
    ([0, 2, 5], [1, 1], [2, 3])

    Build it with :meth:`of` (as :func:`~flashplan.plan` does); ``__init__`` stores the
    fields.

    Attributes:
        key: the static part (:class:`PlanKey`).
        queries: new tokens (queries) per request and their index pointers
            (:class:`~flashplan.lengths.Lengths`, tokens): :attr:`qo_lens` and
            :attr:`qo_indptr` (request i's queries and new K/V rows are
            ``q[qo_indptr[i]:qo_indptr[i+1]]``).
        prefix_lens: int32 ``[bs]`` (tokens) decoder tokens cached before the step.
        decoder_start: int32 ``[bs]`` (row tokens) where decoder position 0 lives.
        position_runs: each new token's decoder position (for RoPE) as runs
            (:class:`~flashplan.planning.positions.PositionRuns`): ``P + j`` for new
            token ``j``, except in a multi-item batch from a request's first delimiter
            on (``prefix_len + pos_in_item - 1``: :mod:`flashplan.planning.items`) and
            in a verify batch (``P + depth``). :attr:`positions` is the same as one
            int32 array.
        encoder: the encoder tokens whose K/V a cross group's ``run`` writes, per
            request (:class:`~flashplan.lengths.Lengths`; 0 for a cached encoder), or
            ``None`` without encoder: :attr:`encoder_indptr` indexes the rows.
        pages_needed: int32 ``[bs]`` (pages) each page-table row must hold.
        group_plans: one :class:`GroupPlan` per group of ``key.groups``, same order.
        cascade: the shared-prefix levels some groups run on
            (:class:`~flashplan.planning.cascade.Cascade`), or ``None``.
    """

    key: PlanKey
    queries: Lengths
    prefix_lens: IntArray = attrs.field(eq=array_key)
    decoder_start: IntArray = attrs.field(eq=array_key)
    position_runs: PositionRuns
    encoder: Lengths | None
    pages_needed: IntArray = attrs.field(eq=array_key)
    group_plans: tuple[GroupPlan, ...]
    cascade: Cascade | None = None

    @classmethod
    def of(
        cls,
        key: PlanKey,
        queries: Lengths,
        *,
        prefix_lens: object,
        decoder_start: object,
        position_runs: PositionRuns,
        encoder: Lengths | None,
        pages_needed: object,
        group_plans: Iterable[GroupPlan],
    ) -> PlanSpec:
        """A plan from its parts (the planner builds every plan this way).

        Raises:
            LayoutError: arrays that are not 1-D integers of one entry per request,
                position runs that do not cover one position per query, or not one
                :class:`GroupPlan` per group of ``key``.
            FieldTypeError: a part of the wrong type.
        """
        if not isinstance(key, PlanKey):
            raise FieldTypeError("key", "must be a PlanKey", value=type(key).__name__)
        for name, value in (("queries", queries), ("encoder", encoder)):
            if not isinstance(value, Lengths) and (name == "queries" or value is not None):
                raise FieldTypeError(name, "must be Lengths", value=type(value).__name__)
        if not isinstance(position_runs, PositionRuns):
            raise FieldTypeError(
                "position_runs", "must be PositionRuns", value=type(position_runs).__name__
            )
        prefix = int32_field("prefix_lens", prefix_lens)
        start = int32_field("decoder_start", decoder_start)
        pages = int32_field("pages_needed", pages_needed)
        same_length("plan", prefix, start, pages)
        bs = queries.batch_size
        if prefix.shape[0] != bs:
            raise LayoutError("prefix_lens", "must have one entry per request", batch_size=bs)
        if encoder is not None and encoder.batch_size != bs:
            raise LayoutError("encoder", "must have one entry per request", batch_size=bs)
        if encoder is None and start is not filled(0, bs) and start.any():
            i = int(np.flatnonzero(start)[0])
            raise LayoutError(
                "decoder_start", "must be 0 without an encoder", request=i, value=int(start[i])
            )
        # (runs of the queries' own lengths cover them: the decode and extend plans')
        if position_runs.length is not queries.lens and position_runs.total != queries.total:
            raise LayoutError(
                "position_runs", "must cover one position per query", total_q=queries.total,
                covered=position_runs.total,
            )  # fmt: skip
        plans = tuple(group_plans)
        for i, gp in enumerate(plans):
            if not isinstance(gp, GroupPlan):
                raise FieldTypeError(
                    "group_plans", "must hold GroupPlan records", index=i, value=type(gp).__name__
                )
        if len(plans) != len(key.groups):
            raise LayoutError("group_plans", "must have one plan per group of the key")
        return cls(key, queries, prefix, start, position_runs, encoder, pages, plans)

    @property
    def batch_size(self) -> int:
        """Number of requests."""
        return self.queries.batch_size

    @property
    def qo_indptr(self) -> IntArray:
        """int32 ``[bs + 1]`` (tokens): request i's queries (and new K/V rows) are
        ``q[qo_indptr[i]:qo_indptr[i+1]]``."""
        return self.queries.indptr

    @property
    def qo_lens(self) -> IntArray:
        """int32 ``[bs]`` (tokens): new tokens (queries) per request."""
        return self.queries.lens

    @property
    def total_q(self) -> int:
        """Rows of ``q`` (tokens)."""
        return self.queries.total

    @property
    def max_q_len(self) -> int:
        """Most new tokens of one request (tokens)."""
        return self.queries.max_len

    @property
    def encoder_indptr(self) -> IntArray | None:
        """int32 ``[bs + 1]`` (tokens) into the encoder K/V rows a cross group's ``run``
        writes (requests whose encoder is cached have none), or ``None`` without
        encoder."""
        return None if self.encoder is None else self.encoder.indptr

    @cached_property
    def positions(self) -> IntArray:
        """int32 ``[total_q]``: each new token's decoder position (for RoPE), from
        :attr:`position_runs` (materialized on first read; the FlashInfer executor
        builds them on the device instead: ``executor.positions``)."""
        return self.position_runs.positions()

    @cached_property
    def write_start(self) -> IntArray:
        """int32 ``[bs]`` (row tokens): where each request's first new token's K/V is
        written (``decoder_start + prefix_lens``)."""
        if self.encoder is None:  # decoder_start is 0 (checked): the prefix lengths
            return self.prefix_lens
        # int32 sum: equal to the int64 sum cast down (a layout checks that it fits).
        return seal_inplace(self.decoder_start + self.prefix_lens)

    @property
    def heads(self) -> HeadConfig:
        """Head configuration the plan was made for."""
        return self.key.heads

    @property
    def page_size(self) -> int:
        """Tokens per KV page."""
        return self.key.page_size

    @property
    def total_encoder(self) -> int:
        """Rows of encoder K/V (tokens); 0 without encoder."""
        return 0 if self.encoder is None else self.encoder.total

    def group_index(self, group: AttentionGroup) -> int:
        """Position of ``group``'s plan in :attr:`group_plans`.

        A group matches the plan of any group that resolves to the same computation
        (:meth:`AttentionGroup.resolved`): ``sm_scale=None`` and an explicit
        ``1 / sqrt(head_dim)`` find the same plan.

        Raises:
            PlanMismatchError: ``group`` is not an :class:`AttentionGroup` or was not
                planned.
        """
        if not isinstance(group, AttentionGroup):
            raise PlanMismatchError(
                "group", "expected an AttentionGroup", type=type(group).__name__, value=group
            )
        wanted = group.resolved(self.heads.head_dim)
        for index, planned in enumerate(self.key.groups):
            if planned == wanted:
                return index
        raise PlanMismatchError(
            "group", f"{group.describe()!r} was not planned", group=group,
            planned=[g.describe() for g in self.key.groups],
        )  # fmt: skip

    def group_plan(self, group: AttentionGroup) -> GroupPlan:
        """The plan of ``group`` (see :meth:`group_index`)."""
        return self.group_plans[self.group_index(group)]

    # -- views (for people: a test, a notebook, a bug report) ---------------------------
    def to_dense(self, group: AttentionGroup) -> list[npt.NDArray[np.bool_]]:
        """Per request, bool ``[qo_len, num_keys]``: which of the group's keys (tokens of
        its key space: the decoder tokens, or the encoder tokens of a cross group) each new
        token sees, rebuilt from this plan's kernel calls alone
        (:func:`flashplan.materialize`; compare with :func:`flashplan.oracle.visibility`).

        >>> import flashplan as fp
        >>> spec = fp.plan(fp.BatchLayout.extend([3], [1]), fp.HeadConfig(4, 1, 64))
        >>> spec.to_dense(fp.AttentionGroup())[0].astype(int).tolist()
        [[1, 1, 0], [1, 1, 1]]

        Raises:
            PlanMismatchError: ``group`` was not planned.
            PlanIntegrityError: a kernel call would read a key twice or outside the
                group's key space (a planner bug).
        """
        return materialize(self, group)

    def to_string(self, group: AttentionGroup, *, max_cols: int = 80, max_rows: int = 32) -> str:
        """The group's visibility (:meth:`to_dense`) as text: one picture per request,
        a row per query labelled with its position, ``#`` where it sees a key, and how many
        keys it sees (as ``explain`` draws it; ``max_cols`` keys and ``max_rows`` queries
        are drawn in full, the middle of larger pictures is elided).

        >>> import flashplan as fp
        >>> spec = fp.plan(fp.BatchLayout.extend([3], [1]), fp.HeadConfig(4, 1, 64))
        >>> print(spec.to_string(fp.AttentionGroup()))
        request 0: 2 queries at positions 1..2; 3 keys
             0 2
             | |
          1  ##.   2: 0..1
          2  ###   3: 0..2
        """
        qo = self.qo_indptr
        positions = [self.positions[int(qo[i]) : int(qo[i + 1])] for i in range(self.batch_size)]
        return ascii_visibility(
            self.to_dense(group), positions=positions,
            key_name="encoder keys" if group.cross_attention else "keys",
            max_cols=max_cols, max_rows=max_rows, indent="",
        )  # fmt: skip
