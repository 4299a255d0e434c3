"""`SharedPrefix`: which requests of a batch share how many leading tokens, on the same pages.

Parallel sampling, beam search, RL rollouts and long system prompts put many requests in
one batch whose first tokens are the same cached pages. A :class:`SharedPrefix` says so,
in levels (outermost first), each a list of groups of **consecutive** requests:

>>> import flashplan as fp
>>> shared = fp.SharedPrefix.from_groups([[0, 1, 2, 3], [4, 5, 6, 7]], [8192, 8192])
>>> shared.num_levels, shared.levels[0].count.tolist()
(1, [4, 4])

A system prompt of 1024 tokens shared by all 8 requests, then each prompt's 8192 tokens
by its 4 samples, is two levels; a group of an inner level lies inside one group of the
level before it and shares more tokens:

>>> two = fp.SharedPrefix.nested(
...     fp.ShareLevel.from_groups([range(8)], [1024]),
...     fp.ShareLevel.from_groups([[0, 1, 2, 3], [4, 5, 6, 7]], [8192, 8192]),
... )
>>> two.deepest_tokens(8).tolist()
[8192, 8192, 8192, 8192, 8192, 8192, 8192, 8192]

**The caller's promise.** Group ``g``'s members hold the same ``shared_len[g]`` leading
tokens, and the whole pages among them (the first ``shared_len[g] // page_size`` pages of
every member's page-table row) are the same page ids. :func:`check_shared_pages` checks
the page ids against a page table (reading it back: a sync on a GPU); planning does not.
A partial last page cannot be shared (each request writes its next tokens after it), so
only whole pages count: the tokens of a partial page belong to each request's own part.

Checked against a batch by :meth:`SharedPrefix.check_batch`: every group lies inside the
batch, and no member shares a token it adds in this step (``shared_len <=
prefix_lens``: the shared tokens are cached, every query comes after them).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence

import attrs
import numpy as np
import numpy.typing as npt
import torch

from flashplan.arrays import array_key, concat_ranges, readonly_when_unpickled
from flashplan.errors import FieldTypeError, LayoutError, PageTableError
from flashplan.layout.convert import as_int, as_lengths

__all__ = ["ShareLevel", "SharedPrefix", "check_shared_pages", "share_pages"]

IntArray = npt.NDArray[np.int32]


def _first_field(value: object) -> IntArray:
    return as_lengths("first", value)


def _count_field(value: object) -> IntArray:
    return as_lengths("count", value)


def _shared_len_field(value: object) -> IntArray:
    return as_lengths("shared_len", value)


@readonly_when_unpickled
@attrs.frozen(cache_hash=True)
class ShareLevel:
    """One level of sharing: groups of consecutive requests and the leading tokens each
    group shares. Build it with :meth:`from_groups` or :meth:`from_ranges` (or
    ``ShareLevel(first, count, shared_len)``, which is :meth:`from_ranges`: every path,
    ``attrs.evolve`` included, converts and checks alike).

    Attributes:
        first: int32 ``[groups]``: the first request of each group (increasing).
        count: int32 ``[groups]``: requests in each group (at least 2; a group covers
            requests ``first .. first + count - 1``, disjoint from the others).
        shared_len: int32 ``[groups]`` (tokens): leading tokens the group's members share.
    """

    first: IntArray = attrs.field(converter=_first_field, eq=array_key)
    count: IntArray = attrs.field(converter=_count_field, eq=array_key)
    shared_len: IntArray = attrs.field(converter=_shared_len_field, eq=array_key)

    def __attrs_post_init__(self) -> None:
        f, c, n = self.first, self.count, self.shared_len
        if not f.shape[0] == c.shape[0] == n.shape[0]:
            raise LayoutError(
                "shared_len", "first, count and shared_len must have one length",
                first=f.shape[0], count=c.shape[0], shared_len=n.shape[0],
            )  # fmt: skip
        for g in np.flatnonzero(c < 2):
            raise LayoutError(
                "count", "a group shares between at least 2 requests", request=int(f[g]),
                group=int(g), count=int(c[g]),
            )  # fmt: skip
        for g in np.flatnonzero(n < 1):
            raise LayoutError(
                "shared_len", "a group shares at least 1 token", group=int(g),
                shared_len=int(n[g]),
            )  # fmt: skip
        ends = f.astype(np.int64) + c
        for g in np.flatnonzero(f[1:] < ends[:-1]):
            raise LayoutError(
                "first", "groups must be disjoint and in batch order", group=int(g) + 1,
                first=int(f[g + 1]), previous_end=int(ends[g]),
            )  # fmt: skip

    @classmethod
    def from_ranges(cls, first: object, count: object, shared_len: object) -> ShareLevel:
        """Groups given as first request, request count and shared tokens (1-D integers
        of one length).

        Raises:
            LayoutError: a negative first request, a group of fewer than 2 requests, a
                shared length below 1, arrays of different lengths, or groups that
                overlap or are out of order (naming the group and its values).
        """
        return cls(first, count, shared_len)

    @classmethod
    def from_groups(cls, groups: Iterable[Iterable[int]], shared_len: object) -> ShareLevel:
        """Groups given as their request indices (each a run of consecutive indices,
        e.g. ``range(4, 8)``) and the tokens each shares.

        Raises:
            LayoutError: a group whose indices are not consecutive and increasing (order
                the batch so that each group's requests sit together), and as
                :meth:`from_ranges`.
            FieldTypeError: a group that is not a sequence of ints.
        """
        first, count = [], []
        for g, members in enumerate(groups):
            try:
                idx = [as_int("groups", m, minimum=0) for m in members]
            except TypeError:
                raise FieldTypeError(
                    "groups", "each group must be a sequence of request indices", group=g
                ) from None
            if not idx or idx != list(range(idx[0], idx[0] + len(idx))):
                raise LayoutError(
                    "groups", "a group's requests must be consecutive batch indices in "
                    "order (place each group's requests together in the batch)", group=g,
                    members=idx[:8],
                )  # fmt: skip
            first.append(idx[0])
            count.append(len(idx))
        return cls.from_ranges(first, count, shared_len)

    @property
    def num_groups(self) -> int:
        return int(self.first.shape[0])

    def group_of(self, batch_size: int) -> npt.NDArray[np.int64]:
        """int64 ``[batch_size]``: each request's group in this level, or -1."""
        out = np.full(batch_size, -1, dtype=np.int64)
        out[self.members()] = np.repeat(np.arange(self.num_groups), self.count)
        return out

    def members(self) -> npt.NDArray[np.int64]:
        """int64 ``[sum(count)]``: every group's requests, group by group in batch order."""
        return concat_ranges(self.first, self.count)


def _levels_field(value: object) -> tuple[ShareLevel, ...]:
    """``levels``: one :class:`ShareLevel` or a non-empty iterable of them, as a tuple."""
    if isinstance(value, ShareLevel):
        return (value,)
    if isinstance(value, (str, bytes, np.ndarray, torch.Tensor)) or not isinstance(value, Iterable):
        raise FieldTypeError(
            "levels", "must be a ShareLevel or an iterable of them", type=type(value).__name__
        )
    try:
        levels = tuple(value)
    except TypeError:
        raise FieldTypeError(
            "levels", "must be a ShareLevel or an iterable of them", type=type(value).__name__
        ) from None
    if not levels:
        raise LayoutError("levels", "a SharedPrefix needs at least one level")
    for i, level in enumerate(levels):
        if not isinstance(level, ShareLevel):
            raise FieldTypeError(
                "levels", "must be ShareLevel records", level=i, value=type(level).__name__
            )
    return levels


@readonly_when_unpickled
@attrs.frozen(cache_hash=True)
class SharedPrefix:
    """Levels of sharing, outermost first (see the module docstring). Build it with
    :meth:`from_groups` (one level) or :meth:`nested` (or ``SharedPrefix(levels)``,
    which is :meth:`nested`: every path, ``attrs.evolve`` included, checks alike).

    Attributes:
        levels: the levels; a group of level ``l + 1`` lies inside one group of level
            ``l`` and shares more tokens than it.
    """

    levels: tuple[ShareLevel, ...] = attrs.field(converter=_levels_field)

    def __attrs_post_init__(self) -> None:
        levels = self.levels
        for i in range(1, len(levels)):
            outer, inner = levels[i - 1], levels[i]
            last = inner.first.astype(np.int64) + inner.count - 1
            outer_end = int((outer.first.astype(np.int64) + outer.count).max(initial=0))
            parent = outer.group_of(max(outer_end, int(last.max(initial=-1)) + 1))
            for g in range(inner.num_groups):
                p = parent[inner.first[g]]
                if p < 0 or parent[last[g]] != p:
                    raise LayoutError(
                        "levels", "an inner group must lie inside one group of the level "
                        "before it", level=i, group=g, first=int(inner.first[g]),
                        count=int(inner.count[g]),
                    )  # fmt: skip
                if inner.shared_len[g] <= outer.shared_len[p]:
                    raise LayoutError(
                        "shared_len", "an inner group shares more tokens than its outer "
                        "group", level=i, group=g, shared_len=int(inner.shared_len[g]),
                        outer_shared_len=int(outer.shared_len[p]),
                    )  # fmt: skip

    @classmethod
    def from_groups(cls, groups: Iterable[Iterable[int]], shared_len: object) -> SharedPrefix:
        """One level (:meth:`ShareLevel.from_groups`)."""
        return cls.nested(ShareLevel.from_groups(groups, shared_len))

    @classmethod
    def nested(cls, *levels: ShareLevel) -> SharedPrefix:
        """Levels, outermost first.

        Raises:
            LayoutError: no level, or a group of an inner level that does not lie inside
                one group of the level before it, or shares no more tokens than it
                (naming the level, the group and the values).
            FieldTypeError: a level that is not a :class:`ShareLevel`.
        """
        return cls(levels)

    @property
    def num_levels(self) -> int:
        return len(self.levels)

    def deepest_tokens(self, batch_size: int) -> npt.NDArray[np.int64]:
        """int64 ``[batch_size]`` (tokens): the most leading tokens each request shares
        with another (its innermost group's ``shared_len``; 0 for a request in none)."""
        out = np.zeros(batch_size, dtype=np.int64)
        for level in self.levels:  # inner levels share more: the last write wins
            g = level.group_of(batch_size)
            inside = g >= 0
            out[inside] = level.shared_len[g[inside]]
        return out

    def check_batch(self, batch_size: int, prefix_lens: npt.NDArray[np.integer]) -> None:
        """Refuse groups outside a batch of ``batch_size`` requests, and members that
        would share tokens this step adds (``shared_len > prefix_lens``).

        Raises:
            LayoutError: naming the level, the group, the request and the values.
        """
        for i, level in enumerate(self.levels):
            ends = level.first.astype(np.int64) + level.count
            for g in np.flatnonzero(ends > batch_size):
                raise LayoutError(
                    "shared_prefix", "a group reaches past the batch", level=i,
                    group=int(g), first=int(level.first[g]), count=int(level.count[g]),
                    batch_size=batch_size,
                )  # fmt: skip
            group = level.group_of(batch_size)
            inside = np.flatnonzero(group >= 0)
            over = inside[level.shared_len[group[inside]] > prefix_lens[inside]]
            if over.size:
                r = int(over[0])
                raise LayoutError(
                    "shared_prefix", "a request shares more tokens than it has cached "
                    "(the shared tokens must all precede this step's new tokens)", request=r,
                    level=i, group=int(group[r]), shared_len=int(level.shared_len[group[r]]),
                    prefix_len=int(prefix_lens[r]),
                )  # fmt: skip


def check_shared_pages(
    shared: SharedPrefix,
    pages: torch.Tensor,
    rows: Sequence[int] | npt.NDArray[np.integer],
    page_size: int,
) -> None:
    """Check the caller's promise against a page table: every member's whole shared
    pages are its group's first member's (reads ``pages`` back: a sync on a GPU).

    Args:
        shared: the sharing.
        pages: int32 ``[table_rows, max_pages]`` page ids (:attr:`PageTable.pages`).
        rows: int ``[batch_size]``: each request's table row (:attr:`PageTable.rows`).
        page_size: tokens per page.

    Raises:
        PageTableError: naming the request, the level, the first differing page column
            and both page ids.
    """
    table = pages.detach().cpu().numpy()
    r = np.asarray(rows, dtype=np.int64)
    for i, level in enumerate(shared.levels):
        for g in range(level.num_groups):
            n = int(level.shared_len[g]) // page_size
            first = int(level.first[g])
            want = table[r[first], :n]
            for m in range(first + 1, first + int(level.count[g])):
                got = table[r[m], :n]
                diff = np.flatnonzero(got != want)
                if diff.size:
                    col = int(diff[0])
                    raise PageTableError(
                        "pages", "a group's members must hold their shared pages on the "
                        "same page ids", request=m, level=i, group=g, column=col,
                        page=int(got[col]), first_member_page=int(want[col]),
                    )  # fmt: skip


def share_pages(
    shared: SharedPrefix,
    pages: torch.Tensor,
    rows: Sequence[int] | npt.NDArray[np.integer],
    page_size: int,
) -> torch.Tensor:
    """A copy of ``pages`` that keeps the promise :func:`check_shared_pages` checks:
    every member's whole shared pages replaced by its group's first member's, level by
    level (outermost first), as an engine that forks samples from one prompt holds them.
    The members' own pages beyond stay as they were. For tests, demos and benchmarks
    (e.g. over :meth:`PageTable.shuffled <flashplan.PageTable.shuffled>`); runs on
    ``pages``' device with index operations only (no read-back).

    Args:
        shared: the sharing.
        pages: int32 ``[table_rows, max_pages]`` page ids (:attr:`PageTable.pages`).
        rows: int ``[batch_size]``: each request's table row (:attr:`PageTable.rows`).
        page_size: tokens per page.

    Returns:
        int32 ``[table_rows, max_pages]`` on ``pages``' device.
    """
    out = pages.clone()
    r = np.asarray(rows, dtype=np.int64)
    for level in shared.levels:
        members = level.members()
        count = level.count.astype(np.int64)
        first = np.repeat(level.first.astype(np.int64), count)
        whole = np.repeat(level.shared_len.astype(np.int64) // page_size, count)
        col = np.arange(int(whole.max(initial=0)))
        keep = col[None, :] < whole[:, None]
        dst_row = np.broadcast_to(r[members][:, None], keep.shape)[keep]
        src_row = np.broadcast_to(r[first][:, None], keep.shape)[keep]
        cols = np.broadcast_to(col, keep.shape)[keep]
        to = functools.partial(torch.tensor, device=pages.device)
        out[to(dst_row), to(cols)] = out[to(src_row), to(cols)]
    return out
