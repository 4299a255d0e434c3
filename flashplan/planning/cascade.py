"""Cascade levels of a batch with shared prefixes: which pages each level's kernel call
reads for which queries, what is left to each request, and whether it pays.

For a :class:`~flashplan.SharedPrefix` over a batch, level ``l``'s call treats each of
its groups as one kernel request: the queries of all the group's members (their query
rows, consecutive in the batch) attend — without a causal mask: every shared key precedes
every query — to the group's whole shared pages that the level before it did not cover,
read from the group's first member's page-table row. Each request's own call then reads
its row from the first page no level covered. The states are merged by LSE (base 2):

    out_i = Σ_parts 2^(lse_part - lse_i) · out_part,   lse_i = log2 Σ_parts 2^lse_part

which is the attention over the union of the parts' keys because the parts partition the
request's keys (:func:`cascade_levels`' invariant; ``tests/test_shared_prefix.py`` checks
it and the merge against dense float64 attention). Page granularity: level ``l`` of a
group covers pages ``[P_(l-1), P_l)`` with ``P_l = shared_len_l // page_size`` (``P_-1 =
0``); a shared partial page is read by each member's own call, and a group whose level
adds no whole page has no kernel request in it.

``plan(layout, heads, shared_prefix=..., cascade="on" | "auto")`` records the levels in
:attr:`PlanSpec.cascade <flashplan.PlanSpec>` for the groups that can run on them; both
executors run them (the FlashInfer executor eagerly: a CUDA-graph bucket refuses them).
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from flashplan.arrays import array_key, concat_ranges, readonly_when_unpickled, seal_inplace
from flashplan.errors import FieldTypeError, LayoutError, PlanMismatchError
from flashplan.layout.batch import BatchLayout
from flashplan.layout.heads import HeadConfig
from flashplan.layout.mode import Mode
from flashplan.layout.shared_prefix import SharedPrefix
from flashplan.lengths import PageSpans
from flashplan.planning.masks import TreeMask
from flashplan.planning.parts import PagedPart

__all__ = [
    "Cascade",
    "CascadeLevel",
    "CascadePlan",
    "cascade_bytes",
    "cascade_levels",
    "cascade_levels_if_any",
    "cascade_pays",
    "own_tree_mask",
]

IntArray = npt.NDArray[np.int32]


@readonly_when_unpickled
@attrs.frozen
class CascadeLevel:
    """One level's kernel call: one kernel request per group.

    Attributes:
        qo_indptr: int32 ``[groups + 1]``: group ``g``'s queries are the call's rows
            ``qo_indptr[g] .. qo_indptr[g + 1] - 1``.
        q_rows: int32 ``[qo_indptr[-1]]``: the batch query row of each of the call's rows
            (its groups' members' rows, in batch order; requests in no group of the
            level are not in the call, so an executor gathers ``q`` by these rows).
        row_of: int32 ``[groups]``: the request whose page-table row the group's pages
            are read from (its first member).
        spans: the pages read per group (:class:`~flashplan.lengths.PageSpans` over row
            tokens ``[P_(l-1) * page_size, P_l * page_size)``, at least one page each).
        row_start_page, row_pages: int32 ``[bs]`` (pages): per request, the first
            page-table column and the pages the call reads from its row — its group's
            shared pages at a group's first member, none elsewhere (an executor's
            gather jobs, one per request as for every other call).
    """

    qo_indptr: IntArray = attrs.field(eq=array_key)
    q_rows: IntArray = attrs.field(eq=array_key)
    row_of: IntArray = attrs.field(eq=array_key)
    spans: PageSpans
    row_start_page: IntArray = attrs.field(eq=array_key)
    row_pages: IntArray = attrs.field(eq=array_key)

    def group_of_row(self, row: int) -> int:
        """The group whose kernel request runs batch query row ``row``, or -1 (the row's
        request is in no group of this level)."""
        at = int(np.searchsorted(self.q_rows, row))
        if at == self.q_rows.shape[0] or self.q_rows[at] != row:
            return -1
        return int(np.searchsorted(self.qo_indptr, at, side="right")) - 1

    def leaves_rows_out(self, total_q: int) -> bool:
        """Whether the call runs fewer than a batch's ``total_q`` query rows (some
        requests are in no group of the level): an executor then gathers ``q`` by
        :attr:`q_rows` and writes the merge back to them; otherwise the call's rows are
        the batch's, in order."""
        return int(self.qo_indptr[-1]) != total_q

    @functools.cached_property
    def max_queries(self) -> int:
        """The most query rows of one group's kernel request (0 without groups): a
        decode step's level is kept from step to step, and so is this."""
        sizes = np.diff(self.qo_indptr)
        return int(sizes.max()) if sizes.size else 0


@readonly_when_unpickled
@attrs.frozen
class CascadePlan:
    """The levels of a batch and each request's own part.

    Attributes:
        levels: one :class:`CascadeLevel` per level of the sharing, outermost first,
            with the groups that add at least one whole page over the level before
            (a group that adds none reads nothing and is left out, and a level left
            without groups is left out too: no kernel request ever reads zero keys).
        own: each request's own keys: row tokens ``[shared_pages * page_size,
            seq_len)`` (:class:`~flashplan.lengths.PageSpans`; its innermost group's
            whole shared pages left out).
        shared_pages: int32 ``[bs]`` (pages): the leading pages of each request that the
            levels read.
    """

    levels: tuple[CascadeLevel, ...]
    own: PageSpans
    shared_pages: IntArray = attrs.field(eq=array_key)


@attrs.frozen
class Cascade:
    """A plan's cascade (:attr:`PlanSpec.cascade <flashplan.PlanSpec>`): the levels, and
    the groups (indices into ``spec.group_plans``) whose paged call runs as the levels
    plus each request's own part instead.

    Attributes:
        levels: the levels and own parts (:func:`cascade_levels`).
        groups: the group plans that run on them, in order.
        own_causal: per entry of ``groups``, whether that group's own calls are causal
            (its paged call's flag: a bidirectional group's new tokens see every new
            token of their request, a causal group's the earlier ones). Without a
            tree mask each group runs its own call with its own flag
            (:meth:`own_call`).
        own_mask: a tree verify's mask over each request's own keys
            (:func:`own_tree_mask`: the groups' tree mask without the columns the
            levels read; every draft token sees every shared key), or ``None``.
    """

    levels: CascadePlan
    groups: tuple[int, ...]
    own_causal: tuple[bool, ...] = attrs.field()
    own_mask: TreeMask | None = None

    @own_causal.validator
    def _one_flag_per_group(self, attribute: attrs.Attribute[Any], value: object) -> None:
        if not isinstance(value, tuple) or len(value) != len(self.groups):
            raise LayoutError(
                "own_causal", "one causal flag per cascade group", groups=self.groups,
                own_causal=value,
            )  # fmt: skip

    @functools.cached_property
    def _own_calls(self) -> dict[bool, PagedPart]:
        """The own call for each causal flag the groups use (built once per plan)."""
        mask = self.own_mask
        return {
            causal: PagedPart.over(
                self.levels.own, causal=causal and mask is None, window_left=-1, mask=mask
            )
            for causal in set(self.own_causal)
        }

    def own_call(self, group_index: int) -> PagedPart:
        """Group plan ``group_index``'s own call (it must be one of :attr:`groups`):
        its paged call over :attr:`CascadePlan.own` — bottom-right aligned causal for
        a causal group (the own keys end with the request's new tokens, which no level
        shares), non-causal for a bidirectional one, or under :attr:`own_mask`; no
        window (a windowed group never runs on levels). Both executors run it as the
        group's paged call, and :func:`~flashplan.materialize` reads it.

        Raises:
            PlanMismatchError: ``group_index`` does not run on the levels.
        """
        try:
            at = self.groups.index(group_index)
        except ValueError:
            raise PlanMismatchError(
                "group_index", "the group does not run on cascade levels",
                group_index=group_index, cascade_groups=self.groups,
            ) from None  # fmt: skip
        return self._own_calls[self.own_causal[at]]


def own_tree_mask(mask: TreeMask, part_start_page: IntArray, own: PageSpans) -> TreeMask:
    """A tree verify's :class:`~flashplan.planning.masks.TreeMask` over each request's
    own keys: ``mask`` (over the keys of a call that starts at page
    ``part_start_page``) with its first ``(own.start_page - part_start_page) *
    page_size`` columns cut off — the pages the levels read, all of them visible to
    every draft token of a windowless group. The draft columns stay in the own part
    (a sharing never covers tokens the step adds)."""
    shift = (own.start_page.astype(np.int64) - part_start_page) * own.page_size
    return TreeMask(
        mask.qo_lens, own.kv_lens, seal_inplace(mask.first_visible - shift), mask.row_offsets,
        seal_inplace(mask.tail_start - shift), mask.tail_words,
    )  # fmt: skip


def cascade_levels(layout: BatchLayout, shared: SharedPrefix) -> CascadePlan:
    """The cascade levels of ``layout``'s self-attention keys under ``shared``.

    Keys are counted in the layout's decoder rows (``decoder_start`` is added: an
    encoder-decoder row keeps its encoder tokens first, which no level shares).

    Everything that depends on the sharing and the page size alone (members, pages,
    the levels' spans of a decoder-only row) is computed once per ``(shared,
    page_size)`` and kept (:func:`_sharing_of`); per batch only the checks against its
    lengths, the query rows and the own parts are computed.

    Raises:
        LayoutError: ``shared`` does not fit the batch (:meth:`SharedPrefix.check_batch`).
        FieldTypeError: arguments of the wrong record types.
    """
    return _levels_of(layout, _checked_sharing(layout, shared))


def cascade_levels_if_any(layout: BatchLayout, shared: SharedPrefix) -> CascadePlan | None:
    """:func:`cascade_levels`, or ``None`` when the batch has no level (no group shares
    a whole page): the planner's entry, which checks the sharing once."""
    sharing = _checked_sharing(layout, shared)
    return _levels_of(layout, sharing) if sharing.levels else None


def _levels_of(layout: BatchLayout, sharing: _Sharing) -> CascadePlan:
    """The levels and own parts of ``layout`` under a checked sharing."""
    bs, ps = layout.batch_size, layout.page_size
    base = layout.decoder_start
    row_base = bool(np.logical_or.reduce(base)) if bs else False
    decode = layout.mode is Mode.DECODE
    if not decode:
        qo_indptr = np.concatenate([[0], np.cumsum(layout.seq_lens - layout.prefix_lens)])
    levels = []
    for level in sharing.levels:
        if decode and not row_base:  # the same call every step: kept per batch size
            made = level.decode_levels.get(bs)
            if made is None:
                made = level.decode_levels[bs] = CascadeLevel(
                    level.count_indptr, level.members32, level.row_of, level.spans,
                    *_row_pages(bs, level.row_of, level.spans),
                )  # fmt: skip
            levels.append(made)
            continue
        if decode:  # one query row per request: the rows are the members
            q_rows, qo = level.members32, level.count_indptr
        else:
            members = level.members
            rows = concat_ranges(qo_indptr[members], qo_indptr[members + 1] - qo_indptr[members])
            q_rows = seal_inplace(rows.astype(np.int32))
            sizes = qo_indptr[level.ends] - qo_indptr[level.firsts]
            qo = seal_inplace(np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32))
        spans = level.spans
        if row_base:  # encoder tokens first in each row: the spans move with them
            b = base[level.firsts]
            spans = PageSpans.between(b + spans.first_token, b + spans.end_token, ps)
        levels.append(
            CascadeLevel(qo, q_rows, level.row_of, spans, *_row_pages(bs, level.row_of, spans))
        )
    covered, first = _own_starts(sharing, bs, ps)
    if row_base:
        own = PageSpans.from_page_start(covered, layout.seq_lens, ps, base=base)
    else:
        own = PageSpans.from_checked_page_start(covered, first, layout.seq_lens, ps)
    return CascadePlan(tuple(levels), own, covered)


def _own_starts(sharing: _Sharing, bs: int, page_size: int) -> tuple[IntArray, IntArray]:
    """Per request of a batch of ``bs``, the whole pages its levels cover and the row
    token its own part starts at (int32 ``[bs]`` each, read-only; kept per batch size:
    the sharing's page size is ``page_size``)."""
    held = sharing.own_starts.get(bs)
    if held is None:
        covered = np.zeros(bs, dtype=np.int32)
        covered[: sharing.end] = sharing.covered
        first = covered.astype(np.int64) * page_size  # whole pages of int32 tokens: fits
        held = sharing.own_starts[bs] = (
            seal_inplace(covered),
            seal_inplace(first.astype(np.int32)),
        )
    return held


def _checked_sharing(layout: BatchLayout, shared: SharedPrefix) -> _Sharing:
    """The sharing's arrays at the layout's page size, checked against the batch."""
    if not isinstance(layout, BatchLayout):
        raise FieldTypeError("layout", "must be a BatchLayout", value=type(layout).__name__)
    if not isinstance(shared, SharedPrefix):
        raise FieldTypeError("shared", "must be a SharedPrefix", value=type(shared).__name__)
    bs = layout.batch_size
    sharing = _sharing_of(shared, layout.page_size)
    prefix = layout.prefix_lens
    if sharing.end > bs or (sharing.deepest > prefix[: sharing.end]).any():
        shared.check_batch(bs, prefix)  # raises, naming the level, group and request
    return sharing


def _row_pages(bs: int, row_of: IntArray, spans: PageSpans) -> tuple[IntArray, IntArray]:
    """:attr:`CascadeLevel.row_start_page` and ``row_pages`` of a batch of ``bs``."""
    start = np.zeros(bs, dtype=np.int32)
    num = np.zeros(bs, dtype=np.int32)
    start[row_of] = spans.start_page
    num[row_of] = spans.pages.lens
    return seal_inplace(start), seal_inplace(num)


@attrs.frozen(eq=False)
class _LevelArrays:
    """One level's arrays that depend on the sharing and the page size alone (and its
    decode steps' :class:`CascadeLevel` per batch size, made on first use)."""

    firsts: npt.NDArray[np.int64]  # [groups] first member
    ends: npt.NDArray[np.int64]  # [groups] one past the last member
    members: npt.NDArray[np.int64]  # [members] group by group
    members32: IntArray  # the same, int32, sealed (a decode step's query rows)
    count_indptr: IntArray  # int32 [groups + 1] (a decode step's qo_indptr)
    row_of: IntArray  # int32 [groups], sealed
    spans: PageSpans  # the groups' pages in a row without encoder tokens
    decode_levels: dict[int, CascadeLevel] = attrs.field(factory=dict)


@attrs.frozen(eq=False)
class _Sharing:
    """The arrays of a sharing at one page size (:func:`_sharing_of`)."""

    levels: tuple[_LevelArrays, ...]
    end: int  # one past the last request in any group
    deepest: npt.NDArray[np.int64]  # [end] tokens each request shares (0: none)
    covered: IntArray  # int32 [end] whole pages the levels read for each request
    # per batch size: covered pages and own parts' first tokens (:func:`_own_starts`)
    own_starts: dict[int, tuple[IntArray, IntArray]] = attrs.field(factory=dict)


@functools.lru_cache(maxsize=64)
def _sharing_of(shared: SharedPrefix, page_size: int) -> _Sharing:
    """Everything of :func:`cascade_levels` that depends only on ``shared`` and the page
    size, kept per value (a step loop plans the same sharing step after step)."""
    end = max(int((lv.first.astype(np.int64) + lv.count).max(initial=0)) for lv in shared.levels)
    covered = np.zeros(end, dtype=np.int64)
    levels = []
    for level in shared.levels:
        firsts = level.first.astype(np.int64)
        count = level.count.astype(np.int64)
        pages = level.shared_len.astype(np.int64) // page_size
        before = covered[firsts]  # the outer level's pages for this group (all members')
        adds = pages > before  # a group that adds no whole page has no call: left out
        if not adds.all():
            firsts, count, pages, before = firsts[adds], count[adds], pages[adds], before[adds]
            if not firsts.size:
                continue  # a level that adds no page anywhere: no call at all
        members = concat_ranges(firsts, count)
        start_token = before * page_size
        stop_token = pages * page_size
        levels.append(
            _LevelArrays(
                firsts, firsts + count, members, seal_inplace(members.astype(np.int32)),
                seal_inplace(np.concatenate([[0], np.cumsum(count)]).astype(np.int32)),
                seal_inplace(firsts.astype(np.int32)),
                PageSpans.between(start_token, stop_token, page_size),
            )
        )  # fmt: skip
        covered[members] = np.repeat(pages, count)
    deepest = shared.deepest_tokens(end)
    return _Sharing(tuple(levels), end, deepest, seal_inplace(covered.astype(np.int32)))


def cascade_bytes(
    layout: BatchLayout,
    shared: SharedPrefix,
    heads: HeadConfig,
    *,
    levels: CascadePlan | None = None,
) -> tuple[int, int]:
    """KV bytes a batch's self-attention reads without and with cascade levels (every
    request's keys once, against each group's shared pages once plus each request's own
    keys): ``(plain, cascade)``. ``levels``: the batch's :func:`cascade_levels`, when
    the caller has them."""
    plan = cascade_levels(layout, shared) if levels is None else levels
    per_token = 2 * heads.num_kv_heads * heads.head_dim * heads.kv_dtype.itemsize
    plain = int(layout.seq_lens.astype(np.int64).sum())
    cascade = int(plan.own.kv_lens.astype(np.int64).sum()) + sum(
        int(lv.spans.kv_lens.astype(np.int64).sum()) for lv in plan.levels
    )
    return plain * per_token, cascade * per_token


def cascade_pays(
    layout: BatchLayout,
    shared: SharedPrefix,
    heads: HeadConfig,
    *,
    bandwidth_bytes_per_us: float = 3.05e6,
    shared_read_bytes_per_us: float = 8.0e6,
    overhead_us_per_level: float = 65.0,
    levels: CascadePlan | None = None,
) -> bool:
    """Whether cascade levels are expected to make the batch's attention faster (the
    model of ``cascade="auto"``).

    Without levels, the members of a group read the same physical pages, so much of
    what a plain call reads comes from the L2 cache: its time is modelled as the larger
    of its logical KV bytes at ``shared_read_bytes_per_us`` and its distinct bytes at
    ``bandwidth_bytes_per_us``. With levels, every byte is read once, at the copy
    bandwidth, plus ``overhead_us_per_level`` per level (the level's prefill call, which
    runs few query rows over many keys, and the merge).

    Calibrated on an H100 (run BE; ``benchmarks/run_gpu.py --parts cascade``): the copy bandwidth
    of issue 27's run (3.05 TB/s); plain calls over shared pages ran at 7.3-8.5 TB/s of
    logical bytes; cascade calls took 52-84 µs per level beyond their bytes. Three
    batches (64 x (8192 + 256) in one group, 256 in groups of 8 over 2048, and the same
    with two levels) all pay, as measured (2.25x, 1.69x, 1.39x). Nothing shared, or too
    little, never pays. ``levels``: the batch's :func:`cascade_levels`, when the caller
    has them.
    """
    plan = cascade_levels(layout, shared) if levels is None else levels
    plain, cascade = cascade_bytes(layout, shared, heads, levels=plan)
    plain_us = max(plain / shared_read_bytes_per_us, cascade / bandwidth_bytes_per_us)
    cascade_us = cascade / bandwidth_bytes_per_us + overhead_us_per_level * len(plan.levels)
    return cascade_us < plain_us
