"""`GroupPlan` and its kernel calls, `PagedPart` and `RaggedPart`: how one group runs.

A group's plan (:class:`~flashplan.planning.GroupPlan`) runs on the paged-KV kernel, on the
ragged kernel over the new tokens, or on both with a merge; each part holds its call's
per-request arrays (host, read-only int32; units per field). The page math is
:mod:`flashplan.lengths`'. Each record is built by a named constructor (``over``, ``of``)
that checks its inputs; ``__init__`` stores the fields.
"""

from __future__ import annotations

import enum
from functools import cached_property

import attrs
import numpy as np
import numpy.typing as npt

from flashplan.arrays import IntArray, array_key, int32_field, readonly_when_unpickled, same_length
from flashplan.errors import FieldTypeError, LayoutError
from flashplan.layout.convert import as_bool, as_int
from flashplan.layout.group import AttentionGroup
from flashplan.lengths import Lengths, PageSpans
from flashplan.planning.items import MultiItemTensors
from flashplan.planning.masks import CustomMask, PositionMask, ThresholdMask, TreeMask

__all__ = ["GroupPlan", "KernelPath", "PagedPart", "RaggedPart", "VirtualRequests"]


class KernelPath(enum.Enum):
    """Which kernels compute a group's attention.

    * ``DECODE``: paged decode kernel, one query per request.
    * ``PAGED``: paged prefill kernel over the whole visible KV (new tokens written
      first).
    * ``RAGGED``: ragged prefill over the new tokens only (no cached prefix anywhere).
    * ``RAGGED_PAGED``: ragged prefill over the new tokens + paged prefill over the
      cached prefix, merged through their base-2 log-sum-exp.
    """

    DECODE = "decode"
    PAGED = "paged"
    RAGGED = "ragged"
    RAGGED_PAGED = "ragged+paged"


@readonly_when_unpickled
@attrs.frozen
class PagedPart:
    """The paged-KV kernel call of a group: request ``i`` reads row tokens
    ``[first_token[i], end_token[i])`` of its page-table row (its :attr:`spans`).

    Build it with :meth:`over`, which checks that the mask or the multi-item tensors
    fit the spans; ``__init__`` stores the fields. The page math (start page, keys read,
    pages, last page) is the spans' (:class:`~flashplan.lengths.PageSpans`).

    Example: two requests, page size 4; request 0 reads tokens 0..5, request 1 a
    window of tokens 9..16 of a 17-token row:

    >>> from flashplan.lengths import PageSpans
    >>> p = PagedPart.over(PageSpans.between([0, 9], [6, 17], 4), causal=True, window_left=-1)
    >>> p.start_page.tolist(), p.num_pages.tolist(), p.last_page_len.tolist()
    ([0, 2], [2, 3], [2, 1])
    >>> p.kv_lens.tolist(), p.page_indptr.tolist(), p.max_kv_len
    ([6, 9], [0, 2, 5], 9)

    Attributes:
        spans: the row tokens each request reads and their pages
            (:class:`~flashplan.lengths.PageSpans`).
        causal: the kernel's causal flag (bottom-right aligned).
        window_left: the window compiled into this call (-1 = none). It equals the
            group's window except where a custom mask carries the window instead.
        mask: the custom mask (:data:`~flashplan.planning.masks.CustomMask`) or
            ``None``: per request a ``qo_len x kv_len`` boolean matrix over the keys
            the call reads.
        items: FlashInfer's multi-item tensors
            (:class:`~flashplan.planning.items.MultiItemTensors`, in the call's key
            coordinates) or ``None``. Given, the call runs FlashInfer's multi-item mask
            (:mod:`flashplan.kernel_rules`); it excludes a custom mask.
        position_mask: a :class:`~flashplan.planning.masks.PositionMask` (a custom
            mask stated by positions: a bidirectional window, or a chunk starting inside
            a page) or ``None``; it excludes ``mask`` and ``items``.
        sinks: whether this call folds the group's attention sinks in (exactly one
            call of a sink group does): its ``(out, lse)`` is that of the keys plus one
            key of logit ``sinks[h]`` and value 0, so that a merge with the group's
            other call counts the sink once.
        virtual: for a group split into virtual requests (chunked local attention,
            :class:`VirtualRequests`), the call's spans per *virtual* request — what the
            kernel is planned with (``page_indptr``, ``kv_lens``, ``last_page_len``
            over ``GroupPlan.virtual.queries``); their pages, laid end to end, are the
            pages of :attr:`spans` (per request: what is gathered). ``None``: the
            kernel runs over :attr:`spans` and the plan's queries.
    """

    spans: PageSpans
    causal: bool
    window_left: int
    mask: CustomMask | None = None
    items: MultiItemTensors | None = None
    sinks: bool = False
    virtual: PageSpans | None = None
    position_mask: PositionMask | None = None

    @classmethod
    def over(
        cls,
        spans: PageSpans,
        *,
        causal: object,
        window_left: object,
        mask: CustomMask | None = None,
        items: MultiItemTensors | None = None,
        sinks: object = False,
        virtual: PageSpans | None = None,
        position_mask: PositionMask | None = None,
    ) -> PagedPart:
        """The call that reads ``spans``.

        Raises:
            LayoutError: ``spans`` is not a :class:`~flashplan.lengths.PageSpans`, a
                window below -1, a mask whose columns are not the keys read, both a mask
                and items, items that do not fit the spans (naming the request), or
                virtual spans whose pages are not those of ``spans`` (or that come with a
                mask or items).
            FieldTypeError: ``causal`` or ``sinks`` is not a bool.
        """
        if not isinstance(spans, PageSpans):
            raise FieldTypeError("spans", "must be a PageSpans", value=type(spans).__name__)
        flag = as_bool("causal", causal)
        window = as_int("window_left", window_left, minimum=-1)
        if mask is not None:
            if not isinstance(mask, (ThresholdMask, TreeMask)):
                raise FieldTypeError("mask", "must be a custom mask", value=type(mask).__name__)
            if mask.kv_lens is not spans.kv_lens and not np.array_equal(
                mask.kv_lens, spans.kv_lens
            ):
                raise LayoutError("mask", "the mask's columns must be the keys the call reads")
        if items is not None:
            _check_items(spans, items, mask)
        if virtual is not None:
            _check_virtual(spans, virtual, mask, items)
        if position_mask is not None:
            if not isinstance(position_mask, PositionMask):
                raise FieldTypeError(
                    "position_mask", "must be a PositionMask", value=type(position_mask).__name__
                )
            if mask is not None or items is not None or virtual is not None:
                raise LayoutError(
                    "position_mask", "a call carries one mask: no custom mask, items or virtual "
                    "spans with a position mask",
                )  # fmt: skip
            if not np.array_equal(position_mask.kv_lens, spans.kv_lens):
                raise LayoutError("position_mask", "the mask's columns must be the keys read")
        return cls(
            spans, flag, window, mask, items, as_bool("sinks", sinks), virtual, position_mask
        )

    def dense_mask(self, request: int) -> npt.NDArray[np.bool_] | None:
        """bool ``[qo_len, kv_len]``: request (or virtual request) ``request``'s custom
        or position mask, or ``None`` without one."""
        if self.position_mask is not None:
            return self.position_mask.dense(request)
        return None if self.mask is None else self.mask.dense(request)

    @property
    def call_spans(self) -> PageSpans:
        """The spans the kernel is planned with: :attr:`virtual` when the group is split
        into virtual requests, else :attr:`spans`."""
        return self.spans if self.virtual is None else self.virtual

    # -- the spans' page math, under the names the kernels' arguments have -------------
    @property
    def first_token(self) -> IntArray:
        """int32 ``[bs]`` (row tokens): the first key the call must show."""
        return self.spans.first_token

    @property
    def end_token(self) -> IntArray:
        """int32 ``[bs]`` (row tokens): one past the last key."""
        return self.spans.end_token

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return self.spans.page_size

    @property
    def start_page(self) -> IntArray:
        """int32 ``[bs]`` (pages): first column of the row read (0 when empty)."""
        return self.spans.start_page

    @property
    def kv_lens(self) -> IntArray:
        """int32 ``[bs]`` (tokens): keys the kernel sees, counted from ``start_page``."""
        return self.spans.kv_lens

    @property
    def num_pages(self) -> IntArray:
        """int32 ``[bs]`` (pages): ``ceil(kv_lens / page_size)``."""
        return self.spans.pages.lens

    @property
    def last_page_len(self) -> IntArray:
        """int32 ``[bs]`` (tokens): in ``[1, page_size]``, 0 for an empty span."""
        return self.spans.last_page_len

    @property
    def page_indptr(self) -> IntArray:
        """int32 ``[bs + 1]`` (pages): request i's page ids are
        ``kv_indices[page_indptr[i]:page_indptr[i+1]]`` after the gather."""
        return self.spans.pages.indptr

    @property
    def total_pages(self) -> int:
        """Pages the call reads in all: ``page_indptr[-1]``."""
        return self.spans.pages.total

    @property
    def max_kv_len(self) -> int:
        """Longest span (tokens), 0 for an empty batch."""
        return self.spans.max_kv_len


def _check_items(spans: PageSpans, items: MultiItemTensors, mask: object) -> None:
    if not isinstance(items, MultiItemTensors):
        raise FieldTypeError("items", "must be MultiItemTensors", value=type(items).__name__)
    if mask is not None:
        raise LayoutError("items", "a call carries a custom mask or multi-item tensors, not both")
    if items.batch_size != spans.batch_size:
        raise LayoutError(
            "items", "must have one entry per request",
            batch_size=spans.batch_size, items_batch_size=items.batch_size,
        )  # fmt: skip
    # Queries at or after prefix_len read their row: it must reach the last key.
    after = spans.kv_lens.astype(np.int64) - items.prefix_len_ptr
    short = after > items.token_pos_in_items_len
    if short.any():
        i = int(np.flatnonzero(short)[0])
        raise LayoutError(
            "items",
            "a token_pos_in_items row must cover every key from prefix_len_ptr on",
            request=i,
            needed=int(after[i]),
            token_pos_in_items_len=items.token_pos_in_items_len,
        )


def _check_virtual(spans: PageSpans, virtual: object, mask: object, items: object) -> None:
    if not isinstance(virtual, PageSpans):
        raise FieldTypeError("virtual", "must be a PageSpans", value=type(virtual).__name__)
    if mask is not None or items is not None:
        raise LayoutError("virtual", "virtual requests carry no custom mask or multi-item tensors")
    if virtual.page_size != spans.page_size or virtual.pages.total != spans.pages.total:
        raise LayoutError(
            "virtual", "the virtual spans' pages must be the spans' pages, end to end",
            pages=spans.pages.total, virtual_pages=virtual.pages.total,
        )  # fmt: skip


@readonly_when_unpickled
@attrs.frozen
class VirtualRequests:
    """A group's requests split into *virtual requests*: consecutive runs of a request's
    new tokens, each planned as a request of its own (chunked local attention: one
    virtual request per request and chunk that its new tokens touch).

    Attributes:
        request: int32 ``[n]``: the request of each virtual request (non-decreasing;
            every request has at least one).
        queries: the virtual requests' queries (:class:`~flashplan.lengths.Lengths`,
            tokens): their index pointers split the plan's ``qo_indptr`` finer (the
            same rows of ``q``, in the same order).
    """

    request: IntArray = attrs.field(eq=array_key)
    queries: Lengths

    @property
    def batch_size(self) -> int:
        """Number of virtual requests."""
        return self.queries.batch_size


@readonly_when_unpickled
@attrs.frozen
class RaggedPart:
    """The ragged-KV kernel call of a group: keys are this step's new tokens.

    Build it with :meth:`over`; ``__init__`` stores the fields.

    Attributes:
        keys: keys per request (:class:`~flashplan.lengths.Lengths`, tokens): the plan's
            queries (or the group's virtual queries), whose index pointers index
            ``k_new``/``v_new``; the call's queries are the same rows.
        causal: the kernel's causal flag.
        window_left: the window compiled into this call (-1 = none).
        sinks: whether this call folds the group's sinks in (see
            :attr:`PagedPart.sinks`).
    """

    keys: Lengths
    causal: bool
    window_left: int
    sinks: bool = False

    @classmethod
    def over(
        cls, keys: Lengths, *, causal: object, window_left: object, sinks: object = False
    ) -> RaggedPart:
        """The ragged call over ``keys``.

        Raises:
            LayoutError: ``keys`` is not :class:`~flashplan.lengths.Lengths`, a window
                below -1.
            FieldTypeError: ``causal`` or ``sinks`` is not a bool.
        """
        if not isinstance(keys, Lengths):
            raise FieldTypeError("keys", "must be Lengths", value=type(keys).__name__)
        return cls(
            keys, as_bool("causal", causal), as_int("window_left", window_left, minimum=-1),
            as_bool("sinks", sinks),
        )  # fmt: skip

    @property
    def kv_indptr(self) -> IntArray:
        """int32 ``[bs + 1]`` (tokens) into ``k_new``/``v_new`` (equals the plan's
        ``qo_indptr``)."""
        return self.keys.indptr

    @property
    def kv_lens(self) -> IntArray:
        """int32 ``[bs]`` (tokens): keys per request."""
        return self.keys.lens

    @property
    def max_kv_len(self) -> int:
        """Longest ragged span (tokens)."""
        return self.keys.max_len


@readonly_when_unpickled
@attrs.frozen
class GroupPlan:
    """How one attention group runs for this batch.

    Build it with :meth:`of`; ``__init__`` stores the fields.

    Example: a causal full-attention group over two extend requests with 3 and 2
    new tokens after 5 and 0 cached tokens, page size 4, planned paged-only: the
    paged call reads row tokens ``[0, 8)`` and ``[0, 2)``.

    >>> import flashplan as fp
    >>> layout = fp.BatchLayout.extend([8, 2], [5, 0], page_size=4)
    >>> gp = fp.plan(layout, fp.HeadConfig(4, 1, 64), extend_path="paged").group_plans[0]
    >>> gp.path.value, gp.paged.page_indptr.tolist(), gp.paged.last_page_len.tolist()
    ('paged', [0, 2, 3], [4, 2])
    >>> gp.key_start.tolist(), gp.num_keys.tolist(), gp.first_key.tolist()
    ([0, 0], [8, 2], [0, 0])

    Attributes:
        group: the group this plan is for (as the layout gave it).
        path: kernel path (:class:`KernelPath`).
        paged: the paged kernel call, or ``None`` on the pure ragged path.
        ragged: the ragged kernel call, or ``None`` on paged paths.
        key_start: int32 ``[bs]`` (row tokens): where the group's key 0 lives
            (self groups: the layout's ``decoder_start``; cross groups: 0).
        num_keys: int32 ``[bs]`` (tokens): keys in the group's key space
            (``seq_lens`` for self groups, ``encoder_lens`` for cross groups).
        virtual: the virtual requests the group's kernel calls run over
            (:class:`VirtualRequests`: chunked local attention over more than one chunk
            of a request's new tokens), or ``None``: the plan's requests.
    """

    group: AttentionGroup
    path: KernelPath
    paged: PagedPart | None
    ragged: RaggedPart | None
    key_start: IntArray = attrs.field(eq=array_key)
    num_keys: IntArray = attrs.field(eq=array_key)
    virtual: VirtualRequests | None = None

    @classmethod
    def of(
        cls,
        group: AttentionGroup,
        path: KernelPath,
        *,
        paged: PagedPart | None,
        ragged: RaggedPart | None,
        key_start: object,
        num_keys: object,
        virtual: VirtualRequests | None = None,
    ) -> GroupPlan:
        """The plan of ``group`` on ``path`` with its kernel calls.

        Raises:
            LayoutError: calls that do not match ``path``, arrays that are not 1-D
                integers of one length, a sink group whose calls do not fold the sinks in
                exactly once (or a group without sinks whose calls do), or virtual
                requests that the calls do not follow.
            FieldTypeError: ``group`` or ``path`` of the wrong type.
        """
        if not isinstance(group, AttentionGroup):
            raise FieldTypeError("group", "must be an AttentionGroup", value=type(group).__name__)
        if not isinstance(path, KernelPath):
            raise FieldTypeError("path", "must be a KernelPath", value=path)
        if (paged is None) != (path is KernelPath.RAGGED):
            raise LayoutError("paged", f"path {path.value} and the paged call disagree")
        if (ragged is not None) != (path in (KernelPath.RAGGED, KernelPath.RAGGED_PAGED)):
            raise LayoutError("ragged", f"path {path.value} and the ragged call disagree")
        start = int32_field("key_start", key_start)
        keys = int32_field("num_keys", num_keys)
        same_length("group_plan", start, keys)
        folds = int(paged is not None and paged.sinks) + int(ragged is not None and ragged.sinks)
        if folds != int(group.sinks):
            raise LayoutError(
                "sinks", "a sink group's calls fold the sinks in exactly once, other groups' "
                "never", group=group.describe(), calls_with_sinks=folds,
            )  # fmt: skip
        if virtual is not None:
            _check_split(virtual, paged, ragged, start.shape[0])
        elif paged is not None and paged.virtual is not None:
            raise LayoutError("virtual", "virtual spans without the group's virtual requests")
        return cls(group, path, paged, ragged, start, keys, virtual)

    @property
    def sinks(self) -> bool:
        """Whether the group has attention sinks (its ``run`` takes ``sinks``)."""
        return self.group.sinks

    @property
    def call_queries(self) -> Lengths | None:
        """The kernel calls' queries: the virtual requests' (or ``None``: the plan's)."""
        return None if self.virtual is None else self.virtual.queries

    @property
    def uses_custom_mask(self) -> bool:  # (a virtual split carries none)
        """Whether the paged call carries a custom mask (a position mask included)."""
        return self.paged is not None and (
            self.paged.mask is not None or self.paged.position_mask is not None
        )

    @property
    def items(self) -> MultiItemTensors | None:
        """The paged call's multi-item tensors, or ``None``."""
        return None if self.paged is None else self.paged.items

    @cached_property
    def first_key(self) -> npt.NDArray[np.int64]:
        """int64 ``[bs]`` (keys of the group's key space): the first key the plan shows
        any query of each request (its window trim; 0 without a window)."""
        if self.paged is None:
            return np.zeros(self.num_keys.shape[0], dtype=np.int64)
        return np.maximum(self.paged.first_token.astype(np.int64) - self.key_start, 0)


def _check_split(
    virtual: VirtualRequests, paged: PagedPart | None, ragged: RaggedPart | None, bs: int
) -> None:
    if not isinstance(virtual, VirtualRequests):
        raise FieldTypeError("virtual", "must be VirtualRequests", value=type(virtual).__name__)
    n = virtual.batch_size
    req = virtual.request
    if req.shape[0] != n or (n and (np.any(np.diff(req) < 0) or req[0] < 0 or req[-1] >= bs)):
        raise LayoutError("virtual", "request must be non-decreasing request indices", size=n)
    if paged is not None:
        if paged.virtual is None or paged.virtual.batch_size != n:
            raise LayoutError("virtual", "the paged call needs spans per virtual request")
        per_request = np.bincount(req, weights=paged.virtual.pages.lens, minlength=bs)
        if not np.array_equal(per_request, paged.spans.pages.lens):
            raise LayoutError("virtual", "each request's virtual spans must read exactly its pages")
    if ragged is not None and ragged.keys.batch_size != n:
        raise LayoutError("virtual", "the ragged call's keys must be per virtual request")
