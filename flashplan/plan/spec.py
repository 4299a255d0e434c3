"""`PlanSpec`, `GroupPlan` and their parts: the frozen output of planning.

A plan splits into a hashable static :class:`PlanKey` (mode, groups, page size,
heads, kernel path per group — never the batch's own lengths) and host int32
arrays. Executors cache wrappers by key and feed the arrays to the kernels.
All arrays are read-only numpy arrays on the host; units are given per field.
"""

from __future__ import annotations

import enum

import attrs
import numpy as np
import numpy.typing as npt

from flashplan.errors import PlanMismatchError
from flashplan.layout.arrays import IntArray
from flashplan.layout.batch import Mode
from flashplan.layout.group import AttentionGroup
from flashplan.layout.heads import HeadConfig
from flashplan.plan.masks import CustomMask

__all__ = [
    "ExtendPath",
    "GroupPlan",
    "KernelPath",
    "PagedPart",
    "PlanKey",
    "PlanSpec",
    "RaggedPart",
]


class KernelPath(enum.Enum):
    """Which kernels compute a group's attention.

    ``DECODE``: paged decode kernel, one query per request.
    ``PAGED``: paged prefill kernel over the whole visible KV (new tokens written first).
    ``RAGGED``: ragged prefill over the new tokens only (no cached prefix anywhere).
    ``RAGGED_PAGED``: ragged prefill over the new tokens + paged prefill over the
    cached prefix, merged through their base-2 log-sum-exp.
    """

    DECODE = "decode"
    PAGED = "paged"
    RAGGED = "ragged"
    RAGGED_PAGED = "ragged+paged"


class ExtendPath(enum.Enum):
    """How an extend batch's self-attention groups are planned (a planning choice)."""

    AUTO = "auto"
    PAGED = "paged"
    RAGGED = "ragged"


@attrs.frozen
class PlanKey:
    """The static, hashable part of a plan.

    Two batches with equal keys can share wrappers, buffers and compiled kernels;
    the key never depends on the batch's lengths beyond the kernel path chosen.
    """

    mode: Mode
    groups: tuple[AttentionGroup, ...]
    paths: tuple[KernelPath, ...]
    page_size: int
    heads: HeadConfig


@attrs.frozen(eq=False)
class PagedPart:
    """The paged-KV kernel call of a group.

    Each request ``i`` reads ``num_pages[i]`` consecutive entries of its page-table
    row starting at column ``start_page[i]``; the kernel sees
    ``kv_lens[i] = (num_pages[i] - 1) * page_size + last_page_len[i]`` keys (0 when
    the segment is empty), the first of which is logical token
    ``start_page[i] * page_size``.

    Attributes:
        page_indptr: int32 ``[bs + 1]`` (pages): request i's pages are
            ``kv_indices[page_indptr[i]:page_indptr[i+1]]`` after the gather.
        start_page: int32 ``[bs]`` (pages): first column of the row read.
        num_pages: int32 ``[bs]`` (pages).
        last_page_len: int32 ``[bs]`` (tokens) in ``[1, page_size]``, 0 for an empty segment.
        kv_lens: int32 ``[bs]`` (tokens) keys the kernel sees.
        causal: the kernel's causal flag (bottom-right aligned).
        mask: the custom mask (:class:`~flashplan.plan.masks.CustomMask`) or ``None``:
            per request a row-major ``qo_len x kv_len`` boolean matrix; its packed
            form is bit-packed little-endian, each request starting on a byte boundary.
        total_pages: ``page_indptr[-1]``.
        max_kv_len: ``max(kv_lens)`` (tokens), 0 for an empty batch.
    """

    page_indptr: IntArray
    start_page: IntArray
    num_pages: IntArray
    last_page_len: IntArray
    kv_lens: IntArray
    causal: bool
    mask: CustomMask | None
    total_pages: int
    max_kv_len: int

    @property
    def packed_mask(self) -> npt.NDArray[np.uint8] | None:
        """uint8 ``[mask_indptr[-1]]``: the mask's compact packed bytes, or ``None``."""
        return None if self.mask is None else self.mask.packed

    @property
    def mask_indptr(self) -> IntArray | None:
        """int32 ``[bs + 1]`` (bytes) of :attr:`packed_mask`, or ``None``."""
        return None if self.mask is None else self.mask.indptr


@attrs.frozen(eq=False)
class RaggedPart:
    """The ragged-KV kernel call of a group: keys are this step's new tokens.

    Attributes:
        kv_indptr: int32 ``[bs + 1]`` (tokens) into ``k_new``/``v_new`` (equals the
            plan's ``qo_indptr``).
        causal: the kernel's causal flag.
        max_kv_len: longest ragged segment (tokens).
    """

    kv_indptr: IntArray
    causal: bool
    max_kv_len: int


@attrs.frozen(eq=False)
class GroupPlan:
    """How one attention group runs for this batch.

    Attributes:
        group: the group this plan is for.
        path: kernel path (:class:`KernelPath`).
        window_left: the window compiled into every kernel of the group (-1 = none).
        paged: the paged kernel call, or ``None`` on the pure ragged path.
        ragged: the ragged kernel call, or ``None`` on paged paths.
        key_offset: int32 ``[bs]`` (tokens): logical token of the group's key 0
            (decoder groups: the encoder's page-rounded length; cross groups: 0).
        num_keys: int32 ``[bs]`` (tokens): keys in the group's key space
            (``seq_lens`` for self groups, ``encoder_lens`` for cross groups).
    """

    group: AttentionGroup
    path: KernelPath
    window_left: int
    paged: PagedPart | None
    ragged: RaggedPart | None
    key_offset: IntArray
    num_keys: IntArray

    @property
    def uses_custom_mask(self) -> bool:
        """Whether the paged call carries a custom mask."""
        return self.paged is not None and self.paged.mask is not None


@attrs.frozen(eq=False)
class PlanSpec:
    """A complete, frozen plan for one batch: what every executor needs.

    Attributes:
        key: the static part (:class:`PlanKey`).
        qo_indptr: int32 ``[bs + 1]`` (tokens): request i's queries (and new K/V
            rows) are ``q[qo_indptr[i]:qo_indptr[i+1]]``.
        max_q_len: longest query segment (tokens).
        total_q: rows of ``q`` (tokens).
        new_token_start: int32 ``[bs]`` (tokens): logical token of each request's
            first new token (where its new K/V is written).
        encoder_indptr: int32 ``[bs + 1]`` (tokens) into encoder K/V rows, or ``None``.
        pages_needed: int32 ``[bs]`` (pages) each page-table row must hold.
        group_plans: one :class:`GroupPlan` per group of ``key.groups``, same order.
    """

    key: PlanKey
    qo_indptr: IntArray
    max_q_len: int
    total_q: int
    new_token_start: IntArray
    encoder_indptr: IntArray | None
    pages_needed: IntArray
    group_plans: tuple[GroupPlan, ...]

    @property
    def batch_size(self) -> int:
        """Number of requests."""
        return int(self.qo_indptr.shape[0] - 1)

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
        return 0 if self.encoder_indptr is None else int(self.encoder_indptr[-1])

    def group_plan(self, group: AttentionGroup) -> GroupPlan:
        """The plan of ``group``; :class:`PlanMismatchError` if it was not planned."""
        for gp in self.group_plans:
            if gp.group == group:
                return gp
        raise PlanMismatchError(
            f"group {group.describe()!r} ({group!r}) was not planned; planned groups: "
            + ", ".join(g.describe() for g in self.key.groups)
        )

    def materialize(self, group: AttentionGroup) -> list[npt.NDArray[np.bool_]]:
        """Dense visibility per request, rebuilt from the plan's kernel calls alone.

        Returns ``[qo_len_i, num_keys_i]`` boolean arrays: entry ``[j, k]`` is true
        when new token ``j`` of request ``i`` attends to key ``k`` of the group's
        key space. See :func:`flashplan.plan.materialize.materialize`.
        """
        from flashplan.plan.materialize import materialize

        return materialize(self, group)
