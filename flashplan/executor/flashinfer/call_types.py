"""Frozen descriptions of FlashInfer calls: which wrapper a call goes to
(:class:`WrapperKey`), its ``plan()`` arguments with array arguments left as named
placeholders (:class:`PlanCall`), a group's calls (:class:`GroupCalls`) and the batch's
arrays behind the placeholders (:class:`CallInputs`). Pure and host-only; the
translation that makes them is :mod:`~flashplan.executor.flashinfer.calls`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from functools import cached_property
from typing import Any

import attrs
import torch

from flashplan.arrays import IntArray
from flashplan.layout.group import AttentionGroup
from flashplan.planning.spec import KernelPath

__all__ = [
    "PLACEHOLDERS",
    "SINK_WRAPPERS",
    "BatchInt",
    "BuiltMask",
    "CallInputs",
    "DeviceIndices",
    "GroupCalls",
    "HostArray",
    "ItemPositions",
    "MaskRecipe",
    "Placeholder",
    "PlanCall",
    "SinkKernel",
    "StagedArray",
    "Translation",
    "WrapperKey",
    "WrapperKind",
]


class WrapperKind(enum.Enum):
    """The FlashInfer wrapper class a call goes to."""

    DECODE = "BatchDecodeWithPagedKVCacheWrapper"
    PAGED_PREFILL = "BatchPrefillWithPagedKVCacheWrapper"
    RAGGED_PREFILL = "BatchPrefillWithRaggedKVCacheWrapper"


#: FlashInfer's attention-sink wrappers, by the kind of call they replace.
SINK_WRAPPERS = {
    WrapperKind.DECODE: "BatchDecodeWithAttentionSinkWrapper",
    WrapperKind.PAGED_PREFILL: "BatchAttentionWithAttentionSinkWrapper",
}


@attrs.frozen(cache_hash=True)
class SinkKernel:
    """The attention-sink kernel variant a sink wrapper is built for.

    FlashInfer's sink wrappers (``BatchDecodeWithAttentionSinkWrapper``,
    ``BatchAttentionWithAttentionSinkWrapper``) compile a JIT variant whose dtypes, head
    size and sliding-window flag are fixed at construction, and apply the sink inside the
    kernel (the sink logits and the softmax scale are ``run()`` arguments). So these are
    part of the wrapper's key.

    Attributes:
        q_dtype, kv_dtype: the variant's query and KV dtypes.
        head_dim: its head size.
        window_left: the call's window (-1: none); the variant is built with or without
            a sliding window by its sign, and ``plan()`` takes the value.
    """

    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    head_dim: int
    window_left: int

    def constructor_kwargs(self) -> dict[str, Any]:
        """The sink wrapper's own ``__init__`` arguments."""
        return {
            "q_data_type": self.q_dtype,
            "kv_data_type": self.kv_dtype,
            "head_dim_qk": self.head_dim,
            "head_dim_vo": self.head_dim,
            "window_left": self.window_left,
        }


@attrs.frozen(cache_hash=True)
class WrapperKey:
    """Identifies one wrapper instance: kind, group and construction options.

    Each group has its own wrappers because the window, soft cap, scale and
    causal flag are compiled in at ``plan()`` time. ``sink``: the call applies its
    group's attention sinks in FlashInfer's sink kernel (:class:`SinkKernel`), so the
    wrapper is FlashInfer's sink wrapper of that kind (always tensor cores for decode).
    ``level``: the cascade level whose shared pages the call reads (each level has its
    own wrapper, planned once per batch); -1 for the group's own calls.
    """

    kind: WrapperKind
    group: AttentionGroup
    backend: str  # "fa2" / "fa3"; decode wrappers always "fa2" (never auto-routed)
    use_tensor_cores: bool  # decode only; False for prefill wrappers
    sink: SinkKernel | None = None
    level: int = -1

    @property
    def class_name(self) -> str:
        """The FlashInfer wrapper class to construct."""
        return self.kind.value if self.sink is None else SINK_WRAPPERS[self.kind]

    def constructor_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the wrapper's ``__init__`` besides the workspace."""
        kwargs: dict[str, Any] = {"kv_layout": "NHD", "backend": self.backend}
        if self.sink is not None:  # the sink decode wrapper always uses tensor cores
            kwargs.update(self.sink.constructor_kwargs())
        elif self.kind is WrapperKind.DECODE:
            kwargs["use_tensor_cores"] = self.use_tensor_cores
        return kwargs


@attrs.frozen
class HostArray:
    """Placeholder: the batch's host array called ``name`` (:attr:`CallInputs.host`),
    passed to ``plan()`` as a pinned CPU tensor."""

    name: str


@attrs.frozen
class StagedArray:
    """Placeholder: the batch's array called ``name`` (:attr:`CallInputs.host`, its bytes
    packed into int32 words) that a *kernel* reads. It is staged with the other host
    arrays and handed to ``plan()`` as a view, of dtype ``dtype``, of the device copy of
    the staging buffer: FlashInfer keeps the tensor (it does not copy it) and reads it
    at run time, and it checks no dtype, so the view has exactly the kernel's dtype.
    The view holds :attr:`CallInputs.elements` ``[name]`` elements."""

    name: str
    dtype: str  # "uint32" or "uint16"


@attrs.frozen
class BatchInt:
    """Placeholder: an integer of the batch (:attr:`CallInputs.ints`), such as
    ``token_pos_in_items_len``."""

    name: str


@attrs.frozen
class DeviceIndices:
    """Placeholder: the page ids (FlashInfer's ``kv_indices``) the executor gathers on
    the device into the gather region called ``region``."""

    region: str


@attrs.frozen
class BuiltMask:
    """Placeholder: the packed custom mask the executor builds on the device for a
    group (from the batch's :class:`MaskRecipe`)."""

    group_index: int


@attrs.frozen
class ItemPositions:
    """Placeholder: FlashInfer's dense ``token_pos_in_items`` (uint16) for a group's
    multi-item call, which the executor fills on the device from the batch's items
    (:class:`~flashplan.planning.items.MultiItemTensors`; their ``item_start`` and
    ``item_length`` are staged as ``<name>.start`` and ``<name>.length``, and
    :attr:`CallInputs.ints` holds ``<name>.size``, the entries, and ``<name>.longest``,
    the longest item). The dense array never exists on the host."""

    name: str


#: Any placeholder of a skeleton's ``plan()`` arguments.
Placeholder = HostArray | StagedArray | BatchInt | DeviceIndices | BuiltMask | ItemPositions

#: The placeholder classes (for ``isinstance``).
PLACEHOLDERS = (HostArray, StagedArray, BatchInt, DeviceIndices, BuiltMask, ItemPositions)


@attrs.frozen(cache_hash=True)  # part of an executor's memo key every batch: hashed once
class PlanCall:
    """One ``wrapper.plan(**kwargs)`` call (every argument passed by keyword)."""

    wrapper: WrapperKey
    kwargs: tuple[tuple[str, Any], ...]

    def as_dict(self) -> dict[str, Any]:
        """The keyword arguments, placeholders unresolved."""
        return dict(self.kwargs)

    @cached_property
    def constants(self) -> tuple[tuple[str, Any], ...]:
        """The keyword arguments that are no placeholder (the same for every batch)."""
        return tuple((n, v) for n, v in self.kwargs if not isinstance(v, PLACEHOLDERS))

    @cached_property
    def placeholders(self) -> tuple[tuple[str, Placeholder], ...]:
        """The keyword arguments an executor resolves per batch."""
        return tuple((n, v) for n, v in self.kwargs if isinstance(v, PLACEHOLDERS))

    @cached_property
    def item_args(self) -> tuple[tuple[str, StagedArray | BatchInt | ItemPositions], ...]:
        """The placeholders of the multi-item tensors (empty for other calls)."""
        kinds = (StagedArray, BatchInt, ItemPositions)
        return tuple((n, v) for n, v in self.placeholders if isinstance(v, kinds))


@attrs.frozen
class GroupCalls:
    """Every FlashInfer call of one group.

    Attributes:
        group_index: position of the group in ``spec.group_plans``.
        path: kernel path of the group.
        paged: the paged wrapper's plan call (decode or paged prefill), if any. In a
            group that runs on cascade levels it reads each request's own keys only.
        ragged: the ragged prefill wrapper's plan call, if any.
        masked: whether the paged call carries a device-built custom mask.
        levels: the group's cascade level calls, outermost first (non-causal paged
            prefill calls over each level's shared pages, one kernel request per
            sharing group; :mod:`~flashplan.planning.cascade`); empty without cascade.
    """

    group_index: int
    path: KernelPath
    paged: PlanCall | None
    ragged: PlanCall | None
    masked: bool = False
    levels: tuple[PlanCall, ...] = ()

    @property
    def merges(self) -> bool:
        """Whether the group's two partial states are merged (ragged + paged)."""
        return self.paged is not None and self.ragged is not None


@attrs.frozen
class MaskRecipe:
    """How big the device-built custom mask of one group is (the values live in
    :attr:`CallInputs.host` under ``g<index>.mask.*``).

    Attributes:
        max_bytes: largest per-request packed size (bytes; sizes the kernel's grid).
        total_bytes: size of the buffer flashinfer reads (bytes).
        num_tokens: ``N`` of a tree mask (its ``row_offsets``, ``tail_start`` and
            ``tail_words`` arrays are staged too), 0 otherwise.
        position: a position mask (a bidirectional window, or a chunk inside pages),
            staged as ``row_position``, ``col_position`` (int32 ``[bs]``) and ``rule``
            (int32 ``[4]``: ``causal, window_left, window_right, chunk``) instead of a
            threshold base.
    """

    max_bytes: int
    total_bytes: int
    num_tokens: int = 0
    position: bool = False


@attrs.frozen(eq=False)
class CallInputs:
    """The arrays of one batch behind the skeleton's placeholders.

    Attributes:
        host: int32 host arrays by name (``"qo_indptr"``, ``"g0.page_indptr"``,
            ``"g0.last_page_len"``, ``"g1.mask.first_visible"``, and the multi-item
            tensors' words ``"g0.items.prefix_len"`` …).
        spans: per group with a paged call, the ``(start_page, num_pages)`` the
            device gathers (the plan's own span, but see :func:`call_inputs`).
        masks: per masked group, its :class:`MaskRecipe`.
        ints: the integers behind :class:`BatchInt` placeholders.
        elements: per :class:`StagedArray` name, its elements in its own dtype.
        level_spans: per cascade level, the ``(start_page, num_pages)`` (int32
            ``[bs]``) the device gathers from each request's row: a sharing group's
            shared pages at its first member, none at the others.
    """

    host: Mapping[str, IntArray]
    spans: Mapping[int, tuple[IntArray, IntArray]]
    masks: Mapping[int, MaskRecipe]
    ints: Mapping[str, int] = attrs.field(factory=dict)
    elements: Mapping[str, int] = attrs.field(factory=dict)
    level_spans: tuple[tuple[IntArray, IntArray], ...] = ()


@attrs.frozen(eq=False)
class Translation:
    """A plan's calls and the arrays they need."""

    calls: tuple[GroupCalls, ...]
    inputs: CallInputs
