"""Frozen descriptions of FlashInfer calls: which wrapper a call goes to
(:class:`WrapperKey`), its ``plan()`` arguments, arrays left as named placeholders
(:class:`PlanCall`), a group's calls (:class:`GroupCalls`) and the batch's arrays behind
the placeholders (:class:`CallInputs`); made by :mod:`~flashplan.executor.flashinfer.calls`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from flashplan.arrays import IntArray
from flashplan.layout.group import AttentionGroup
from flashplan.planning.spec import KernelPath

__all__ = [
    "SINK_WRAPPERS", "BatchInt", "BuiltMask", "CallInputs", "DeviceArray", "DeviceIndices",
    "GroupCalls",
    "HostArray", "ItemPositions", "MaskRecipe", "PlanCall", "SinkKernel", "StagedArray",
    "Translation", "WrapperKey", "WrapperKind",
]  # fmt: skip


class WrapperKind(enum.Enum):
    """The FlashInfer wrapper class a call goes to."""

    DECODE = "BatchDecodeWithPagedKVCacheWrapper"
    PAGED_PREFILL = "BatchPrefillWithPagedKVCacheWrapper"
    RAGGED_PREFILL = "BatchPrefillWithRaggedKVCacheWrapper"
    #: a decode on ``flashinfer.xqa`` (:class:`~flashplan.executor.flashinfer.xqa.XqaDecode`)
    XQA = "xqa"


#: FlashInfer's attention-sink wrappers, by the kind of call they replace.
SINK_WRAPPERS = {
    WrapperKind.DECODE: "BatchDecodeWithAttentionSinkWrapper",
    WrapperKind.PAGED_PREFILL: "BatchAttentionWithAttentionSinkWrapper",
}


@attrs.frozen(cache_hash=True)
class SinkKernel:
    """The attention-sink kernel variant a sink wrapper is built for (its dtypes, head
    size and window, -1: none, are fixed at construction)."""

    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    head_dim: int
    window_left: int

    def constructor_kwargs(self) -> dict[str, Any]:
        """The sink wrapper's own ``__init__`` arguments."""
        return {
            "q_data_type": self.q_dtype, "kv_data_type": self.kv_dtype,
            "head_dim_qk": self.head_dim, "head_dim_vo": self.head_dim,
            "window_left": self.window_left,
        }  # fmt: skip


@attrs.frozen(cache_hash=True)
class WrapperKey:
    """Identifies one wrapper instance: kind, group and construction options. ``sink``:
    FlashInfer's sink wrapper of that kind; ``level``: the cascade level whose shared
    pages the call reads (-1: the group's own calls)."""

    kind: WrapperKind
    group: AttentionGroup
    backend: str  # "fa2" / "fa3"; decode wrappers "fa2", XQA calls "xqa"
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
        if self.sink is not None:
            kwargs.update(self.sink.constructor_kwargs())
        elif self.kind is WrapperKind.DECODE:
            kwargs["use_tensor_cores"] = self.use_tensor_cores
        return kwargs


@attrs.frozen
class HostArray:
    """Placeholder: the batch's host array ``name`` (:attr:`CallInputs.host`), passed to
    ``plan()`` as a pinned CPU tensor."""

    name: str


@attrs.frozen
class StagedArray:
    """Placeholder: the batch's array ``name`` (its bytes as int32 words) that a kernel
    reads, passed to ``plan()`` as a ``dtype`` view of the staging buffer's device copy,
    of :attr:`CallInputs.elements` ``[name]`` elements."""

    name: str
    dtype: str  # "uint32" or "uint16"


@attrs.frozen
class DeviceArray:
    """Placeholder: the batch's int32 host array ``name`` as a kernel reads it: its staged
    device copy viewed as ``dtype`` (a 4-byte type, one element per int32)."""

    name: str
    dtype: str  # "uint32"


@attrs.frozen
class BatchInt:
    """Placeholder: an integer of the batch (:attr:`CallInputs.ints`)."""

    name: str


@attrs.frozen
class DeviceIndices:
    """Placeholder: the page ids (``kv_indices``) gathered on the device into ``region``."""

    region: str


@attrs.frozen
class BuiltMask:
    """Placeholder: the packed custom mask built on the device for a group."""

    group_index: int


@attrs.frozen
class ItemPositions:
    """Placeholder: FlashInfer's dense uint16 ``token_pos_in_items`` of a multi-item call,
    filled on the device from the items staged under ``name``
    (:func:`~flashplan.executor.flashinfer.names.item_part`)."""

    name: str


@attrs.frozen(cache_hash=True)
class PlanCall:
    """One ``wrapper.plan(**kwargs)`` call (every argument passed by keyword)."""

    wrapper: WrapperKey
    kwargs: tuple[tuple[str, Any], ...]

    def as_dict(self) -> dict[str, Any]:
        """The keyword arguments, placeholders unresolved."""
        return dict(self.kwargs)


@attrs.frozen
class GroupCalls:
    """Every FlashInfer call of one group (at ``group_index`` in ``spec.group_plans``):
    its paged call (decode or paged prefill; on cascade levels, each request's own keys)
    and ragged call, if any, whether the paged call carries a device-built custom mask,
    and its cascade level calls, outermost first."""

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
    """How big one group's device-built custom mask is: ``max_bytes``, the largest
    request's packed bytes; ``total_bytes``, the buffer flashinfer reads; ``num_tokens``,
    ``N`` of a tree mask (else 0); ``position``: a position mask."""

    max_bytes: int
    total_bytes: int
    num_tokens: int = 0
    position: bool = False


@attrs.frozen(eq=False)
class CallInputs:
    """The arrays of one batch behind the skeleton's placeholders: int32 ``host`` arrays
    and ``ints`` by name (:mod:`~flashplan.executor.flashinfer.names`), per paged group
    and per cascade level the ``(start_page, num_pages)`` (int32 ``[bs]``) gathered, per
    masked group its :class:`MaskRecipe`, per :class:`StagedArray` its ``elements``, per
    XQA group the ``widths`` of its dense block table (pages per row)."""

    host: Mapping[str, IntArray]
    spans: Mapping[int, tuple[IntArray, IntArray]]
    masks: Mapping[int, MaskRecipe]
    ints: Mapping[str, int] = attrs.field(factory=dict)
    elements: Mapping[str, int] = attrs.field(factory=dict)
    level_spans: tuple[tuple[IntArray, IntArray], ...] = ()
    widths: Mapping[int, int] = attrs.field(factory=dict)


@attrs.frozen(eq=False)
class Translation:
    """A plan's calls and the arrays they need."""

    calls: tuple[GroupCalls, ...]
    inputs: CallInputs
