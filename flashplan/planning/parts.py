"""`GroupPlan` and its kernel calls, `PagedPart` and `RaggedPart`: how one group runs.

A group's plan (:class:`~flashplan.planning.GroupPlan`) runs on the paged-KV kernel, on the
ragged kernel over the new tokens, or on both with a merge; each part holds its call's
per-request arrays (host, read-only int32; units per field) and derives its page math.
"""

from __future__ import annotations

import enum
from functools import cached_property

import attrs
import numpy as np
import numpy.typing as npt

from flashplan.arrays import (
    IntArray,
    array_key,
    constant_operand,
    indptr,
    int32_field,
    readonly_when_unpickled,
    same_length,
    seal_inplace,
)
from flashplan.errors import LayoutError
from flashplan.layout.convert import as_bool, as_int
from flashplan.layout.group import AttentionGroup
from flashplan.planning.items import MultiItemTensors
from flashplan.planning.masks import CustomMask

__all__ = ["GroupPlan", "KernelPath", "PagedPart", "RaggedPart"]


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
    ``[first_token[i], end_token[i])`` of its page-table row.

    Only the two bounds are stored; everything the kernel needs follows from them.
    The call reads whole pages, starting at the page that holds ``first_token``
    (:attr:`start_page`), so it may read up to ``page_size - 1`` leading keys that the
    kernel's window or custom mask hides. An empty span (``end_token <= first_token``)
    reads no page and has ``last_page_len = 0``, so that FlashInfer's
    ``(pages - 1) * page_size + last_page_len`` counts no phantom key.

    Example: two requests, page size 4; request 0 reads tokens 0..5, request 1 a
    window of tokens 9..16 of a 17-token row:

    >>> p = PagedPart(first_token=[0, 9], end_token=[6, 17], page_size=4,
    ...               causal=True, window_left=-1)
    >>> p.start_page.tolist(), p.num_pages.tolist(), p.last_page_len.tolist()
    ([0, 2], [2, 3], [2, 1])
    >>> p.kv_lens.tolist(), p.page_indptr.tolist(), p.max_kv_len
    ([6, 9], [0, 2, 5], 9)

    Attributes:
        first_token: int32 ``[bs]`` (row tokens) first key the call must show.
        end_token: int32 ``[bs]`` (row tokens) one past the last key.
        page_size: tokens per page.
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
    """

    first_token: IntArray = attrs.field(
        converter=lambda v: int32_field("first_token", v), eq=array_key
    )
    end_token: IntArray = attrs.field(converter=lambda v: int32_field("end_token", v), eq=array_key)
    page_size: int = attrs.field(converter=lambda v: as_int("page_size", v, minimum=1))
    causal: bool = attrs.field(converter=lambda v: as_bool("causal", v))
    window_left: int = attrs.field(converter=lambda v: as_int("window_left", v, minimum=-1))
    mask: CustomMask | None = attrs.field(default=None)
    items: MultiItemTensors | None = attrs.field(
        default=None,
        validator=attrs.validators.optional(attrs.validators.instance_of(MultiItemTensors)),
    )

    @classmethod
    def _from_checked(
        cls,
        first_token: IntArray,
        end_token: IntArray,
        page_size: int,
        causal: bool,
        window_left: int,
        mask: CustomMask | None,
        items: MultiItemTensors | None,
        *,
        start_page: IntArray | None = None,
        kv_lens: IntArray | None = None,
        num_pages: IntArray | None = None,
        last_page_len: IntArray | None = None,
        page_indptr: IntArray | None = None,
        max_kv_len: int | None = None,
    ) -> PagedPart:
        """Internal (the planner): a part from values that already are what the
        converters return (read-only int32 arrays of one length, ``first_token >= 0``, a
        page size >= 1, a bool, a window >= -1) and pass ``__init__``'s checks; nothing
        is converted or checked again. The keyword arguments preset cached properties
        with arrays the caller already holds, each equal to what the property computes
        (tests check both)."""
        self = object.__new__(cls)
        _set = object.__setattr__
        _set(self, "first_token", first_token)
        _set(self, "end_token", end_token)
        _set(self, "page_size", page_size)
        _set(self, "causal", causal)
        _set(self, "window_left", window_left)
        _set(self, "mask", mask)
        _set(self, "items", items)
        if start_page is not None:
            _set(self, "start_page", start_page)
        if kv_lens is not None:
            _set(self, "kv_lens", kv_lens)
        if num_pages is not None:
            _set(self, "num_pages", num_pages)
        if last_page_len is not None:
            _set(self, "last_page_len", last_page_len)
        if page_indptr is not None:
            _set(self, "page_indptr", page_indptr)
        if max_kv_len is not None:
            _set(self, "max_kv_len", max_kv_len)
        return self

    @staticmethod
    def _derived_nonempty(
        first_token: IntArray, end_token: IntArray, page_size: int
    ) -> tuple[IntArray, IntArray, IntArray, IntArray]:
        """Internal (the planner): ``(start_page, kv_lens, num_pages, last_page_len)``
        for spans that are all non-empty (``first_token < end_token``, int32, ``end_token``
        known to fit): what the cached properties below compute, without their
        empty-span cases, as fresh read-only int32 arrays to preset with
        :meth:`_from_checked`. Every value lies between 0 and ``end_token``, so the int32
        arithmetic cannot wrap."""
        ps, one = constant_operand(page_size), constant_operand(1)  # cheaper than Python ints
        start_page = first_token // ps
        kv_lens = end_token - start_page * ps
        # pages - 1 and last_page_len - 1 in one call: kv_lens - 1 = (pages - 1) * ps + rest
        num_pages, last_page_len = np.divmod(kv_lens - one, ps)
        num_pages += one
        last_page_len += one
        for a in (start_page, kv_lens, num_pages, last_page_len):
            a.setflags(write=False)
        return start_page, kv_lens, num_pages, last_page_len

    def __attrs_post_init__(self) -> None:
        same_length("paged", self.first_token, self.end_token)
        if self.first_token.size and int(self.first_token.min()) < 0:
            i = int(np.flatnonzero(self.first_token < 0)[0])
            raise LayoutError("first_token", "must be >= 0", request=i)
        if self.mask is not None and not np.array_equal(self.mask.kv_lens, self.kv_lens):
            raise LayoutError("mask", "the mask's columns must be the keys the call reads")
        if self.items is not None:
            self._check_items(self.items)

    def _check_items(self, items: MultiItemTensors) -> None:
        if self.mask is not None:
            raise LayoutError(
                "items", "a call carries a custom mask or multi-item tensors, not both"
            )
        if items.batch_size != self.first_token.shape[0]:
            raise LayoutError(
                "items", "must have one entry per request",
                batch_size=self.first_token.shape[0], items_batch_size=items.batch_size,
            )  # fmt: skip
        # Queries at or after prefix_len read their row: it must reach the last key.
        after = self.kv_lens.astype(np.int64) - items.prefix_len_ptr
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

    # int32 arithmetic throughout (Python int operands keep int32 arrays int32):
    # 0 <= start_page * page_size <= first_token, and a non-empty span's kv_lens is in
    # [1, end_token]; entries of empty spans may wrap in the intermediate values, but
    # np.where replaces them by 0.
    @cached_property
    def _nonempty(self) -> npt.NDArray[np.bool_]:
        return self.end_token > self.first_token

    @cached_property
    def start_page(self) -> IntArray:
        """int32 ``[bs]`` (pages): first column of the row read (0 when empty)."""
        return seal_inplace(np.where(self._nonempty, self.first_token // self.page_size, 0))

    @cached_property
    def kv_lens(self) -> IntArray:
        """int32 ``[bs]`` (tokens): keys the kernel sees, counted from ``start_page``."""
        keys = self.end_token - self.start_page * self.page_size
        return seal_inplace(np.where(self._nonempty, keys, 0))

    @cached_property
    def num_pages(self) -> IntArray:
        """int32 ``[bs]`` (pages): ``ceil(kv_lens / page_size)``."""
        # (kv - 1) // ps + 1: no sum that could pass int32, and 0 for kv = 0.
        pages = (self.kv_lens - 1) // self.page_size
        pages += 1
        return seal_inplace(pages)

    @cached_property
    def last_page_len(self) -> IntArray:
        """int32 ``[bs]`` (tokens): in ``[1, page_size]``, 0 for an empty span."""
        full = (self.num_pages - 1) * self.page_size
        return seal_inplace(np.where(self._nonempty, self.kv_lens - full, 0))

    @cached_property
    def page_indptr(self) -> IntArray:
        """int32 ``[bs + 1]`` (pages): request i's page ids are
        ``kv_indices[page_indptr[i]:page_indptr[i+1]]`` after the gather."""
        return indptr(self.num_pages, "pages")

    @property
    def total_pages(self) -> int:
        """Pages the call reads in all: ``page_indptr[-1]``."""
        return int(self.page_indptr[-1])

    @cached_property
    def max_kv_len(self) -> int:
        """Longest span (tokens), 0 for an empty batch."""
        # (the ufunc itself: ndarray.max's Python wrapper costs more at these sizes)
        return int(np.maximum.reduce(self.kv_lens)) if self.kv_lens.size else 0


@readonly_when_unpickled
@attrs.frozen
class RaggedPart:
    """The ragged-KV kernel call of a group: keys are this step's new tokens.

    Attributes:
        kv_indptr: int32 ``[bs + 1]`` (tokens) into ``k_new``/``v_new`` (equals the
            plan's ``qo_indptr``).
        causal: the kernel's causal flag.
        window_left: the window compiled into this call (-1 = none).
    """

    kv_indptr: IntArray = attrs.field(converter=lambda v: int32_field("kv_indptr", v), eq=array_key)
    causal: bool = attrs.field(converter=lambda v: as_bool("causal", v))
    window_left: int = attrs.field(converter=lambda v: as_int("window_left", v, minimum=-1))

    @cached_property
    def kv_lens(self) -> IntArray:
        """int32 ``[bs]`` (tokens): keys per request."""
        return seal_inplace(self.kv_indptr[1:] - self.kv_indptr[:-1])

    @cached_property
    def max_kv_len(self) -> int:
        """Longest ragged span (tokens)."""
        # (the ufunc itself: ndarray.max's Python wrapper costs more at these sizes)
        return int(np.maximum.reduce(self.kv_lens)) if self.kv_lens.size else 0


@readonly_when_unpickled
@attrs.frozen
class GroupPlan:
    """How one attention group runs for this batch.

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
    """

    group: AttentionGroup = attrs.field(validator=attrs.validators.instance_of(AttentionGroup))
    path: KernelPath = attrs.field(validator=attrs.validators.instance_of(KernelPath))
    paged: PagedPart | None
    ragged: RaggedPart | None
    key_start: IntArray = attrs.field(converter=lambda v: int32_field("key_start", v), eq=array_key)
    num_keys: IntArray = attrs.field(converter=lambda v: int32_field("num_keys", v), eq=array_key)

    @classmethod
    def _from_checked(
        cls,
        group: AttentionGroup,
        path: KernelPath,
        paged: PagedPart | None,
        ragged: RaggedPart | None,
        key_start: IntArray,
        num_keys: IntArray,
    ) -> GroupPlan:
        """Internal (the planner): a group plan from values that already pass
        ``__init__``'s converters and checks (read-only int32 arrays, parts that match
        ``path``); nothing is converted or checked again."""
        self = object.__new__(cls)
        _set = object.__setattr__
        _set(self, "group", group)
        _set(self, "path", path)
        _set(self, "paged", paged)
        _set(self, "ragged", ragged)
        _set(self, "key_start", key_start)
        _set(self, "num_keys", num_keys)
        return self

    def __attrs_post_init__(self) -> None:
        if (self.paged is None) != (self.path is KernelPath.RAGGED):
            raise LayoutError("paged", f"path {self.path.value} and the paged call disagree")
        if (self.ragged is not None) != (self.path in (KernelPath.RAGGED, KernelPath.RAGGED_PAGED)):
            raise LayoutError("ragged", f"path {self.path.value} and the ragged call disagree")
        same_length("group_plan", self.key_start, self.num_keys)

    @property
    def uses_custom_mask(self) -> bool:
        """Whether the paged call carries a custom mask."""
        return self.paged is not None and self.paged.mask is not None

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
