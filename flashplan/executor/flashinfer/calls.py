"""Frozen descriptions of FlashInfer calls, and the pure PlanSpec -> calls translation.

Translation has two halves, both pure and host-only (tested against the installed
flashinfer's signatures on a CPU-only machine):

* :func:`call_skeleton` depends only on static things — the plan's key, the policy,
  the decode kernel kind and which groups carry a custom mask — so an executor
  computes it once per key. It says which wrapper each call goes to and every
  ``plan()`` argument, with array arguments left as named placeholders:
  :class:`HostArray` (a host array of the batch, handed to ``plan()`` as a pinned CPU
  tensor), :class:`StagedArray` (a host array a kernel reads, handed to ``plan()`` as a
  typed view of the device staging buffer: the multi-item tensors),
  :class:`BatchInt` (an integer of the batch), :class:`DeviceIndices` (page ids
  gathered on the device), :class:`BuiltMask` (a custom mask built on the device) and
  :class:`ItemPositions` (a multi-item ``token_pos_in_items`` filled on the device).
* :func:`call_inputs` computes the batch's arrays behind those names.

:func:`translate` does both.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from functools import cached_property
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
import torch

from flashplan.arrays import (
    INT32_MAX,
    IntArray,
    constant_operand,
    indptr,
    running_sum,
    seal_inplace,
)
from flashplan.errors import UnsupportedError
from flashplan.executor.flashinfer.policy import (
    ExecutorPolicy,
    decode_uses_tensor_cores,
    prefill_backend,
    split_kwargs,
)
from flashplan.executor.gathers import pages_region
from flashplan.layout.group import AttentionGroup
from flashplan.layout.heads import HeadConfig
from flashplan.planning.masks import CustomMask, PositionMask, TreeMask
from flashplan.planning.spec import GroupPlan, KernelPath, PagedPart, PlanKey, PlanSpec

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
    "bytes_as_int32",
    "call_inputs",
    "call_skeleton",
    "check_runnable",
    "decode_scheduler_kv_lens",
    "flashinfer_mask_offsets",
    "int32_words",
    "sink_kernel",
    "skeleton_key",
    "translate",
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
    """

    kind: WrapperKind
    group: AttentionGroup
    backend: str  # "fa2" / "fa3"; decode wrappers always "fa2" (never auto-routed)
    use_tensor_cores: bool  # decode only; False for prefill wrappers
    sink: SinkKernel | None = None

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
        paged: the paged wrapper's plan call (decode or paged prefill), if any.
        ragged: the ragged prefill wrapper's plan call, if any.
        masked: whether the paged call carries a device-built custom mask.
    """

    group_index: int
    path: KernelPath
    paged: PlanCall | None
    ragged: PlanCall | None
    masked: bool = False

    @property
    def merges(self) -> bool:
        """Whether the group's two partial states are merged (ragged + paged)."""
        return self.paged is not None and self.ragged is not None


@attrs.frozen(eq=False)
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
    """

    host: Mapping[str, IntArray]
    spans: Mapping[int, tuple[IntArray, IntArray]]
    masks: Mapping[int, MaskRecipe]
    ints: Mapping[str, int] = attrs.field(factory=dict)
    elements: Mapping[str, int] = attrs.field(factory=dict)


@attrs.frozen(eq=False)
class Translation:
    """A plan's calls and the arrays they need."""

    calls: tuple[GroupCalls, ...]
    inputs: CallInputs


def skeleton_key(
    spec: PlanSpec, policy: ExecutorPolicy, batch_size: int | None = None
) -> tuple[PlanKey, bool, tuple[bool, ...], tuple[bool, ...], tuple[bool, ...]]:
    """What a skeleton depends on besides the policy: the plan's key, the decode kernel
    kind (a function of the batch size, or of ``batch_size`` when given: a CUDA-graph
    bucket's), which groups carry a custom mask, which carry multi-item tensors (in a
    multi-item batch — ``key.multi_item`` — every self group's paged call) and which run
    over virtual requests (chunked local attention across a chunk boundary)."""
    bs = spec.batch_size if batch_size is None else batch_size
    tensor_cores = decode_uses_tensor_cores(spec.heads, policy, bs)
    masked = tuple(gp.uses_custom_mask for gp in spec.group_plans)
    items = tuple(gp.items is not None for gp in spec.group_plans)
    virtual = tuple(gp.virtual is not None for gp in spec.group_plans)
    return spec.key, tensor_cores, masked, items, virtual


def check_runnable(spec: PlanSpec, *, graph: bool = False) -> None:
    """Refuse a plan whose kernel calls this executor does not run as planned.

    A chunked extend whose new tokens cross a chunk boundary runs over virtual requests
    (:attr:`~flashplan.planning.GroupPlan.virtual`): more kernel rows than requests,
    which a CUDA-graph bucket (``graph``: the caller is one) has no fixed buffers for.
    Decode and verify steps never split that way (their queries see one chunk each); an
    extend that a bucket replays is planned with ``plan(..., chunked_extend="mask")``
    (one position-masked call per request), or runs eagerly. The executor refuses rather
    than run a different mask.

    Raises:
        UnsupportedError: naming the group.
    """
    if not graph:
        return
    for gp in spec.group_plans:
        if gp.virtual is not None:
            raise UnsupportedError(
                "groups",
                f"group {gp.group.describe()!r}: this batch splits it into virtual requests "
                "(new tokens across a chunk boundary), which a CUDA-graph bucket does not "
                "run: plan it with chunked_extend='mask' (one position-masked call per "
                "request), or run this step eagerly",
                group=gp.group.describe(),
            )  # fmt: skip


def call_skeleton(
    spec: PlanSpec, policy: ExecutorPolicy, *, sm90: bool, batch_size: int | None = None
) -> tuple[GroupCalls, ...]:
    """Every ``plan()`` call of ``spec``, arrays as placeholders.

    The result depends only on :func:`skeleton_key` (and the policy and GPU), so an
    executor may reuse it for every plan with the same skeleton key. ``batch_size``
    overrides the batch size that picks the decode kernel (a CUDA-graph bucket's). The window and
    causal flag of each call are the plan's own (:attr:`PagedPart.window_left`, …).

    A multi-item call passes FlashInfer's four multi-item arguments (``prefix_len_ptr``
    and ``max_item_len_ptr`` as :class:`StagedArray`, ``token_pos_in_items_ptr`` as
    :class:`ItemPositions`, ``token_pos_in_items_len`` as :class:`BatchInt`) and runs
    on FA2, like a masked call.

    Raises:
        UnsupportedError: the policy forces a kernel the heads cannot run.
    """
    key, tensor_cores, masked, items, virtual = skeleton_key(spec, policy, batch_size)
    heads = key.heads
    out = []
    for index, (group, gp) in enumerate(zip(key.groups, spec.group_plans, strict=True)):
        common: list[tuple[str, Any]] = [
            ("num_qo_heads", heads.num_qo_heads),
            ("num_kv_heads", heads.num_kv_heads),
            ("logits_soft_cap", float(group.logits_soft_cap)),
            ("sm_scale", group.scale_for(heads.head_dim)),
            ("q_data_type", heads.q_dtype),
            ("kv_data_type", heads.kv_dtype),
            ("o_data_type", heads.out_dtype),
            ("non_blocking", True),
        ]
        paged = ragged = None
        # a group over virtual requests has its own query index pointers (the same rows)
        qo_indptr = HostArray(f"g{index}.qo_indptr" if virtual[index] else "qo_indptr")
        if gp.paged is not None:
            part = gp.paged
            pages = DeviceIndices(pages_region(index))
            page_indptr = HostArray(f"g{index}.page_indptr")
            last_page_len = HostArray(f"g{index}.last_page_len")
            sink = sink_kernel(gp, heads, multi_item=items[index])
            if gp.path is KernelPath.DECODE:
                wrapper = WrapperKey(
                    WrapperKind.DECODE, group, "fa2", tensor_cores or sink is not None, sink
                )
                args: list[tuple[str, Any]] = [
                    ("indptr", page_indptr),
                    ("indices", pages),
                    ("last_page_len", last_page_len),
                    ("head_dim", heads.head_dim),
                    ("page_size", key.page_size),
                    ("window_left", part.window_left),
                ]
                args += split_kwargs(policy)
            else:
                backend = prefill_backend(
                    heads, policy, custom_mask=masked[index], multi_item=items[index], sm90=sm90,
                    sinks=sink is not None,
                )  # fmt: skip
                wrapper = WrapperKey(WrapperKind.PAGED_PREFILL, group, backend, False, sink)
                args = [
                    ("qo_indptr", qo_indptr),
                    ("paged_kv_indptr", page_indptr),
                    ("paged_kv_indices", pages),
                    ("paged_kv_last_page_len", last_page_len),
                    ("head_dim_qk", heads.head_dim),
                    ("page_size", key.page_size),
                    ("causal", part.causal),
                    ("window_left", part.window_left),
                ]
                if masked[index]:
                    args.append(("packed_custom_mask", BuiltMask(index)))
                if items[index]:
                    args += [
                        ("prefix_len_ptr", StagedArray(f"g{index}.items.prefix_len", "uint32")),
                        ("token_pos_in_items_ptr", ItemPositions(f"g{index}.items.tpos")),
                        ("token_pos_in_items_len", BatchInt(f"g{index}.items.tpos_len")),
                        ("max_item_len_ptr", StagedArray(f"g{index}.items.max_len", "uint16")),
                    ]
                args += split_kwargs(policy)
            paged = PlanCall(wrapper, tuple(args + common))
        if gp.ragged is not None:
            backend = prefill_backend(heads, policy, custom_mask=False, sm90=sm90)
            wrapper = WrapperKey(WrapperKind.RAGGED_PREFILL, group, backend, False)
            args = [
                ("qo_indptr", qo_indptr),
                ("kv_indptr", qo_indptr),
                ("head_dim_qk", heads.head_dim),
                ("causal", gp.ragged.causal),
                ("window_left", gp.ragged.window_left),
            ]
            args += split_kwargs(policy)
            ragged = PlanCall(wrapper, tuple(args + common))
        out.append(GroupCalls(index, gp.path, paged, ragged, masked[index]))
    return tuple(out)


def sink_kernel(gp: GroupPlan, heads: HeadConfig, *, multi_item: bool) -> SinkKernel | None:
    """The sink kernel variant of a group's paged call, or ``None``: the sink is then
    folded into the call's (or the merged) state after the kernel, or the group has none.

    A paged call that the plan gives the group's sinks (a decode or paged-only prefill;
    the ragged call takes them where there is one, and the merge folds them in) runs on
    FlashInfer's sink kernel, which applies the sink inside the softmax, unless the group
    has a logits soft cap (the sink variant has none), the call carries multi-item
    tensors (the variant's parameters have none) or a custom mask: flashinfer 0.7.4's
    ``AttentionSink`` variant defines its own logits mask (the window alone), which
    replaces the one that reads the packed custom mask, so a masked call on it would
    silently see every key (a verify tree, a position mask; measured in run AU).
    """
    part = gp.paged
    if part is None or not part.sinks or gp.group.logits_soft_cap or multi_item:
        return None
    if gp.uses_custom_mask:
        return None
    return SinkKernel(heads.q_dtype, heads.kv_dtype, heads.head_dim, part.window_left)


#: The MultiItemTensors field behind each staged multi-item plan() argument.
_ITEM_ARRAYS = {"prefix_len_ptr": "prefix_len_ptr", "max_item_len_ptr": "max_item_len"}


def call_inputs(spec: PlanSpec, calls: tuple[GroupCalls, ...]) -> CallInputs:
    """The batch's arrays behind ``calls``' placeholders.

    With a custom mask, an empty span is given one (unread) page and
    ``last_page_len = 0``: flashinfer 0.7.4 sizes each request's mask as
    ``qo_len * ((pages - 1) * page_size + last_page_len)`` without clamping, so zero
    pages would give a negative size and shift every later request's mask. The kernel
    still sees ``kv_len = 0`` (FlashInfer clamps there).

    A prefill call's KV lengths (FlashInfer's formula) go into ``host`` as
    ``g<i>.kv_lens`` and a masked call's ``mask_indptr`` as ``g<i>.mask.indptr``, with
    the batch's ``qo.total``, ``qo.max_len`` and each call's ``g<i>.max_kv_len`` in
    ``ints``: what FlashInfer's ``plan()`` derives itself, for a re-plan without it
    (:func:`~flashplan.executor.flashinfer.adapter.replan_prefill`).

    The multi-item tensors of a call go into ``host``: ``prefix_len_ptr`` and
    ``max_item_len`` as int32 words (:func:`int32_words`, their element counts in
    ``elements``), and the items behind ``token_pos_in_items`` (:class:`ItemPositions`:
    their starts and lengths, the dense size and the longest item in ``ints``);
    ``token_pos_in_items_len`` goes into ``ints``.

    Raises:
        UnsupportedError: a custom mask too large for flashinfer's int32 offsets.
    """
    # Every prefill call (paged or ragged) takes qo_indptr; decode calls do not, but a
    # tensor-core decode re-plan hands it to the scheduler (adapter.replan_decode).
    uses_qo = any(gc.ragged is not None or gc.path is not KernelPath.DECODE for gc in calls)
    tc_decode = any(
        gc.paged is not None and gc.path is KernelPath.DECODE and gc.paged.wrapper.use_tensor_cores
        for gc in calls
    )
    host: dict[str, IntArray] = {"qo_indptr": spec.qo_indptr} if uses_qo or tc_decode else {}
    spans: dict[int, tuple[IntArray, IntArray]] = {}
    masks: dict[int, MaskRecipe] = {}
    ints: dict[str, int] = {}
    if uses_qo:
        ints["qo.total"] = spec.total_q
        ints["qo.max_len"] = int(np.maximum.reduce(spec.qo_lens)) if spec.batch_size else 0
    elements: dict[str, int] = {}
    for gc in calls:
        gp = spec.group_plans[gc.group_index]
        index = gc.group_index
        if gp.virtual is not None:  # the kernels run over the virtual requests' rows
            vq = gp.virtual.queries
            host[f"g{index}.qo_indptr"] = vq.indptr
            ints[f"g{index}.qo.total"] = vq.total
            ints[f"g{index}.qo.max_len"] = vq.max_len
        part = gp.paged
        if part is None:
            continue
        # the gather reads each request's span; the kernel is planned over the call's
        # spans (the virtual requests', whose pages lie end to end in the same region)
        start, num = part.start_page, part.num_pages
        call = part.call_spans
        page_indptr = call.pages.indptr
        if gc.masked and part.kv_lens.size and not np.logical_and.reduce(part.kv_lens):
            empty = part.kv_lens == 0
            start = seal_inplace(np.where(empty, 0, start))
            num = seal_inplace(np.where(empty, 1, num))
            page_indptr = indptr(num, "pages")
        spans[index] = (start, num)
        host[f"g{index}.page_indptr"] = page_indptr
        host[f"g{index}.last_page_len"] = call.last_page_len
        if gc.path is not KernelPath.DECODE:
            # What FlashInfer's prefill plan() derives on the host (a re-plan without it:
            # adapter.replan_prefill): the KV lengths its get_seq_lens computes,
            # max(pages - 1, 0) * page_size + last_page_len, are the part's own (an empty
            # span has last_page_len 0 and at most one page), and the longest.
            host[f"g{index}.kv_lens"] = call.kv_lens
            ints[f"g{index}.max_kv_len"] = call.max_kv_len
        elif gc.paged is not None and gc.paged.wrapper.use_tensor_cores:
            host[f"g{index}.kv_lens"] = decode_scheduler_kv_lens(part)
        if gc.masked:
            mask = part.mask if part.mask is not None else part.position_mask
            assert mask is not None
            masks[index] = _mask_recipe(index, mask, host)
        staged = gc.paged.item_args if gc.paged is not None else ()
        if staged:
            items = part.items
            assert items is not None, "a multi-item call needs the plan's multi-item tensors"
            for name, value in staged:
                if isinstance(value, BatchInt):
                    ints[value.name] = items.token_pos_in_items_len
                    continue
                if isinstance(value, ItemPositions):
                    host[f"{value.name}.start"] = items.item_start
                    host[f"{value.name}.length"] = items.item_length
                    ints[f"{value.name}.size"] = items.batch_size * items.token_pos_in_items_len
                    ints[f"{value.name}.longest"] = items.max_length
                    continue
                arr: npt.NDArray[np.unsignedinteger] = getattr(items, _ITEM_ARRAYS[name])
                host[value.name] = int32_words(arr)
                elements[value.name] = int(arr.shape[0])
    return CallInputs(host=host, spans=spans, masks=masks, ints=ints, elements=elements)


def int32_words(values: npt.NDArray[np.unsignedinteger]) -> IntArray:
    """The bytes of a uint16 / uint32 array as read-only int32 words (a uint16 array of
    odd length gets one zero element first), so that it rides in the int32 staging
    buffer; a ``.view(dtype)`` of the staged words gives the values back (little-endian
    on both sides)."""
    raw = np.ascontiguousarray(values)
    if raw.nbytes % 4:
        raw = np.concatenate([raw, np.zeros((4 - raw.nbytes % 4) // raw.itemsize, raw.dtype)])
    out = raw.view(np.int32)
    if out.flags.writeable:  # our own padded copy, or a caller's writable array
        out = out.copy() if np.shares_memory(out, values) else out
        out.flags.writeable = False
    return out


def flashinfer_mask_offsets(
    qo_lens: npt.NDArray[np.integer], kv_lens: npt.NDArray[np.integer]
) -> npt.NDArray[np.int64]:
    """Byte offset at which flashinfer 0.7.4's kernel reads each request's packed mask.

    Given ``packed_custom_mask``, flashinfer 0.7.4's ``plan()`` computes the offsets as
    the running sum of ``qo_len * kv_len`` — a count of *bits* — and its kernel adds
    them to a *byte* pointer (known bug, flashinfer PR #2201). So request ``i``'s bytes
    must start at byte ``sum_{r<i} qo_r * kv_r``. Returns int64 ``[bs + 1]``.
    """
    return running_sum(np.multiply(qo_lens, kv_lens, dtype=np.int64))


def decode_scheduler_kv_lens(part: PagedPart) -> IntArray:
    """int32 ``[bs]`` (tokens): the KV lengths FlashInfer's tensor-core decode scheduler
    gets from ``fast_decode_plan``: ``max(pages - 1, 0) * page_size + last_page_len``, with
    ``last_page_len`` taken as 1 at page size 1 — the part's own ``kv_lens`` except for
    an empty span at page size 1 (a cross group over an empty encoder), which counts one."""
    kv = part.kv_lens
    if part.page_size > 1 or not kv.size or np.logical_and.reduce(kv):
        return kv
    return seal_inplace(np.where(kv == 0, 1, kv))


def bytes_as_int32(values: npt.NDArray[np.uint8]) -> IntArray:
    """uint8 bytes reinterpreted as int32 words (zero-padded to a multiple of 4), so that
    they travel in the int32 staging buffer; the device views them back as uint8."""
    if values.shape[0] % 4 == 0 and values.flags.c_contiguous:  # a view, no copy
        words = values.view(np.int32)
        words.flags.writeable = False  # this view only (the staging copy only reads it)
        return words
    padded = np.zeros((values.shape[0] + 3) // 4 * 4, dtype=np.uint8)
    padded[: values.shape[0]] = values
    return seal_inplace(padded.view(np.int32))


def _mask_recipe(
    index: int, mask: CustomMask | PositionMask, host: dict[str, IntArray]
) -> MaskRecipe:
    """Group ``index``'s mask as int32 arrays in ``host`` (``g<index>.mask.*``) and its
    sizes. ``mask.indptr`` is :func:`flashinfer_mask_offsets`: FlashInfer's
    ``mask_indptr``, whose first ``bs`` entries are also where the mask kernel writes
    each request's bytes."""
    sizes = np.multiply(mask.qo_lens, mask.kv_lens, dtype=np.int64)  # bits per request
    offsets = running_sum(sizes)
    total = int(offsets[-1])
    if total > INT32_MAX - 8:  # the mask kernel's int32 element indices
        raise UnsupportedError(
            "extend_path", "a custom mask of this many elements exceeds int32 offsets: plan "
            "this batch with extend_path='paged'", mask_elements=total,
        )  # fmt: skip
    g = f"g{index}.mask."
    host[g + "qo_lens"] = mask.qo_lens
    host[g + "kv_lens"] = mask.kv_lens
    host[g + "indptr"] = seal_inplace(offsets)  # int32: total fits (checked above)
    max_bytes = (int(np.maximum.reduce(sizes)) + 7) // 8 if total else 0
    if isinstance(mask, PositionMask):
        # positions fit int32 (the layout checks its lengths); a bound beyond any
        # position is no bound, so the rule is capped at int32 too
        host[g + "row_position"] = seal_inplace(mask.row_position)
        host[g + "col_position"] = seal_inplace(mask.col_position)
        rule = np.array(
            [mask.causal, mask.window_left, mask.window_right, mask.chunk], dtype=np.int64
        )
        host[g + "rule"] = seal_inplace(np.minimum(rule, INT32_MAX))
        return MaskRecipe(max_bytes, max(total, 1), position=True)
    # the int32 staging copy must not wrap a far-off threshold: clamped, then cast
    # (the ufuncs themselves: np.clip's Python wrapper costs more than both)
    low, high = constant_operand(-INT32_MAX, np.int64), constant_operand(INT32_MAX, np.int64)
    first = np.maximum(mask.first_visible, low)
    host[g + "first_visible"] = seal_inplace(np.minimum(first, high, out=first))
    num_tokens = 0
    if isinstance(mask, TreeMask):
        num_tokens = int(mask.row_offsets.shape[1])
        host[g + "row_offsets"] = mask.row_offsets.reshape(-1)  # read-only int32, C order
        host[g + "tail_start"] = seal_inplace(mask.tail_start)  # in [0, kv_len]
        # the rows' packed bits (a view of the mask's own: a tree's, preset by the planner)
        host[g + "tail_words"] = bytes_as_int32(mask.tail_words.reshape(-1))
    return MaskRecipe(max_bytes=max_bytes, total_bytes=max(total, 1), num_tokens=num_tokens)


def translate(spec: PlanSpec, policy: ExecutorPolicy, *, sm90: bool) -> Translation:
    """Describe every FlashInfer ``plan()`` call of ``spec`` and the arrays it needs.

    Args:
        spec: the plan.
        policy: kernel choices (:class:`ExecutorPolicy`).
        sm90: whether the target GPU is Hopper (enables FA3 under ``"auto"``).
    """
    calls = call_skeleton(spec, policy, sm90=sm90)
    return Translation(calls, call_inputs(spec, calls))
