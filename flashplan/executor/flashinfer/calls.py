"""The pure PlanSpec -> FlashInfer calls translation (the records:
:mod:`~flashplan.executor.flashinfer.call_types`, re-exported here). :func:`call_skeleton`
(a function of :func:`skeleton_key`) gives every wrapper and ``plan()`` argument, arrays
as placeholders; :func:`call_inputs` the batch's arrays behind them; :func:`translate`
both.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

import flashplan.executor.flashinfer.names as names
from flashplan.arrays import INT32_MAX, constant_operand, indptr, running_sum, seal_inplace, zeros
from flashplan.errors import UnsupportedError
from flashplan.executor.flashinfer.call_types import (
    BatchInt,
    BuiltMask,
    CallInputs,
    DeviceArray,
    DeviceIndices,
    GroupCalls,
    HostArray,
    ItemPositions,
    MaskRecipe,
    PlanCall,
    SinkKernel,
    StagedArray,
    Translation,
    WrapperKey,
    WrapperKind,
)
from flashplan.executor.flashinfer.policy import (
    ExecutorPolicy,
    decode_uses_tensor_cores,
    decode_uses_xqa,
    prefill_backend,
    split_kwargs,
    xqa_refusal,
)
from flashplan.layout.heads import HeadConfig
from flashplan.planning.cascade import CascadePlan
from flashplan.planning.masks import CustomMask, PositionMask, TreeMask
from flashplan.planning.parts import PagedPart
from flashplan.planning.spec import GroupPlan, KernelPath, PlanKey, PlanSpec

if TYPE_CHECKING:
    from flashplan.arrays import IntArray

__all__ = [
    "BatchInt", "BuiltMask", "CallInputs", "DeviceArray", "DeviceIndices", "GroupCalls",
    "HostArray",
    "ItemPositions", "MaskRecipe", "PlanCall", "SkeletonKey", "StagedArray", "Translation",
    "WrapperKey", "WrapperKind", "bytes_as_int32", "call_inputs", "call_skeleton",
    "check_runnable", "flashinfer_mask_offsets", "int32_words", "sink_kernel",
    "skeleton_key", "translate",
]  # fmt: skip

#: What a call skeleton depends on besides the policy (:func:`skeleton_key`).
SkeletonKey = tuple[
    PlanKey, bool, tuple[bool, ...], tuple[bool, ...], tuple[bool, ...], tuple[int, ...], int
]


def skeleton_key(
    spec: PlanSpec, policy: ExecutorPolicy, batch_size: int | None = None
) -> SkeletonKey:
    """What a skeleton depends on besides the policy: the plan's key, the decode kernel
    kind (of the batch size, or a bucket's ``batch_size``), which groups carry a custom
    mask, multi-item tensors or virtual requests, and the cascade groups and levels."""
    bs = spec.batch_size if batch_size is None else batch_size
    tensor_cores = decode_uses_tensor_cores(spec.heads, policy, bs)
    plans = spec.group_plans
    masked = tuple([gp.uses_custom_mask for gp in plans])
    items = tuple([gp.items is not None for gp in plans])
    virtual = tuple([gp.virtual is not None for gp in plans])
    cascade = spec.cascade
    if cascade is None:
        return spec.key, tensor_cores, masked, items, virtual, (), 0
    levels = len(cascade.levels.levels)
    return spec.key, tensor_cores, masked, items, virtual, cascade.groups, levels


def check_runnable(spec: PlanSpec, *, graph: bool = False) -> None:
    """Refuse a plan a CUDA-graph bucket (``graph``) cannot run: cascade levels, or a group
    over virtual requests (more kernel rows than requests).

    Raises:
        UnsupportedError: naming the group, or ``cascade``.
    """
    if not graph:
        return
    if spec.cascade is not None:
        raise UnsupportedError(
            "cascade", "a CUDA-graph bucket does not run cascade levels yet: run this step "
            "eagerly, or plan it with cascade='off'", groups=spec.cascade.groups,
        )  # fmt: skip
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
    spec: PlanSpec, policy: ExecutorPolicy, *, sm90: bool, batch_size: int | None = None,
    sink_decode: bool = True, xqa: bool = False,
) -> tuple[GroupCalls, ...]:  # fmt: skip
    """Every ``plan()`` call of ``spec``, arrays as placeholders (a function of
    :func:`skeleton_key`, the policy and the GPU). ``batch_size``: a CUDA-graph bucket's,
    which picks the decode kernel; ``sink_decode``: FlashInfer has its sink decode wrapper;
    ``xqa``: FlashInfer has ``xqa`` and this GPU runs it.

    Raises:
        UnsupportedError: the policy forces a kernel the heads cannot run (naming the
            group and why for ``decode_backend='xqa'``).
    """
    key, tensor_cores, masked, items, virtual, cascaded, levels = skeleton_key(
        spec, policy, batch_size
    )
    heads = key.heads
    cascade = spec.cascade
    if policy.decode_backend == "xqa" and not xqa:
        raise UnsupportedError(
            "decode_backend", "'xqa' needs flashinfer.xqa and an sm_90, sm_100 or sm_120 GPU "
            "(use 'auto' or 'fa2')",
        )  # fmt: skip
    xqa_decodes = xqa and decode_uses_xqa(heads, policy, sm90=sm90)
    split = split_kwargs(policy)
    out = []
    for index, (group, gp) in enumerate(zip(key.groups, spec.group_plans, strict=True)):
        common: list[tuple[str, Any]] = [
            *split, ("num_qo_heads", heads.num_qo_heads), ("num_kv_heads", heads.num_kv_heads),
            ("logits_soft_cap", float(group.logits_soft_cap)),
            ("sm_scale", group.scale_for(heads.head_dim)), ("q_data_type", heads.q_dtype),
            ("kv_data_type", heads.kv_dtype), ("o_data_type", heads.out_dtype),
            ("non_blocking", True),
        ]  # fmt: skip
        paged = ragged = None
        # a group over virtual requests has its own query indptr (the same rows)
        qo_indptr = HostArray(
            names.group_array(index, "qo_indptr") if virtual[index] else names.QO_INDPTR
        )
        if gp.paged is not None:
            # a group on cascade levels runs its own call (the plan's, flags included)
            part = cascade.own_call(index) if cascade and index in cascaded else gp.paged
            pages = DeviceIndices(names.pages_region(index))
            page_indptr = HostArray(names.group_array(index, "page_indptr"))
            last_page_len = HostArray(names.group_array(index, "last_page_len"))
            decode = gp.path is KernelPath.DECODE
            sink = sink_kernel(gp, heads, multi_item=items[index])
            sink = None if decode and not sink_decode else sink
            on_xqa = decode and xqa_decodes and _takes_xqa(
                gp, heads, key.page_size, policy, multi_item=items[index],
                cascade=index in cascaded,
            )  # fmt: skip
            args: list[tuple[str, Any]]
            if on_xqa:  # its own arguments: XQA plans nothing on the host
                wrapper = WrapperKey(WrapperKind.XQA, group, "xqa", False)
                scale = group.scale_for(heads.head_dim)
                args = _xqa_args(index, part, heads, key.page_size, scale, policy)
            elif decode:
                tc = tensor_cores or sink is not None
                wrapper = WrapperKey(WrapperKind.DECODE, group, "fa2", tc, sink)
                args = [
                    ("indptr", page_indptr), ("indices", pages), ("last_page_len", last_page_len),
                    ("head_dim", heads.head_dim), ("page_size", key.page_size),
                    ("window_left", part.window_left),
                ]  # fmt: skip
            else:
                backend = prefill_backend(
                    heads, policy, custom_mask=masked[index], multi_item=items[index], sm90=sm90,
                    sinks=sink is not None,
                )  # fmt: skip
                wrapper = WrapperKey(WrapperKind.PAGED_PREFILL, group, backend, False, sink)
                args = [
                    ("qo_indptr", qo_indptr), ("paged_kv_indptr", page_indptr),
                    ("paged_kv_indices", pages), ("paged_kv_last_page_len", last_page_len),
                    ("head_dim_qk", heads.head_dim), ("page_size", key.page_size),
                    ("causal", part.causal), ("window_left", part.window_left),
                ]  # fmt: skip
                if masked[index]:
                    args.append(("packed_custom_mask", BuiltMask(index)))
                if items[index]:
                    item = functools.partial(names.item_name, index)
                    args += [
                        ("prefix_len_ptr", StagedArray(item("prefix_len"), "uint32")),
                        ("token_pos_in_items_ptr", ItemPositions(item("tpos"))),
                        ("token_pos_in_items_len", BatchInt(item("tpos_len"))),
                        ("max_item_len_ptr", StagedArray(item("max_len"), "uint16")),
                    ]
            paged = PlanCall(wrapper, tuple(args if on_xqa else args + common))
        if gp.ragged is not None:
            backend = prefill_backend(heads, policy, custom_mask=False, sm90=sm90)
            wrapper = WrapperKey(WrapperKind.RAGGED_PREFILL, group, backend, False)
            args = [
                ("qo_indptr", qo_indptr), ("kv_indptr", qo_indptr), ("head_dim_qk", heads.head_dim),
                ("causal", gp.ragged.causal), ("window_left", gp.ragged.window_left),
            ]  # fmt: skip
            ragged = PlanCall(wrapper, tuple(args + common))
        level_calls: tuple[PlanCall, ...] = ()
        if index in cascaded:  # FA2 unless the policy forces FA3
            backend = "fa3" if policy.prefill_backend == "fa3" else "fa2"
            prefill_backend(heads, policy, custom_mask=False, sm90=sm90)  # its refusals
            level_calls = tuple(
                PlanCall(
                    WrapperKey(WrapperKind.PAGED_PREFILL, group, backend, False, level=k),
                    tuple(_level_args(k, heads, key.page_size) + common),
                )
                for k in range(levels)
            )
        out.append(GroupCalls(index, gp.path, paged, ragged, masked[index], level_calls))
    return tuple(out)


def _takes_xqa(
    gp: GroupPlan, heads: HeadConfig, page_size: int, policy: ExecutorPolicy, *,
    multi_item: bool, cascade: bool,
) -> bool:  # fmt: skip
    """Whether this group's decode goes to XQA; ``decode_backend='xqa'`` refuses one that
    cannot (:func:`~.policy.xqa_refusal`)."""
    why = xqa_refusal(gp, heads, page_size, multi_item=multi_item, cascade=cascade)
    if why is not None and policy.decode_backend == "xqa":
        raise UnsupportedError(
            "decode_backend", f"group {gp.group.describe()!r} cannot run on XQA: {why} (use "
            "decode_backend='auto', which leaves such a group on FA2, or 'fa2')",
            group=gp.group.describe(),
        )  # fmt: skip
    return why is None


def _xqa_args(
    index: int, part: PagedPart, heads: HeadConfig, page_size: int, sm_scale: float,
    policy: ExecutorPolicy,
) -> list[tuple[str, Any]]:  # fmt: skip
    """The ``plan()`` arguments of an XQA decode (:class:`~.xqa.XqaDecode`): the group's
    dense block table (gathered into its pages region, one row of ``widths[index]``
    columns per request) and its keys per request."""
    return [
        ("block_tables", DeviceIndices(names.pages_region(index))),
        ("seq_lens", DeviceArray(names.group_array(index, "kv_lens"), "uint32")),
        ("page_size", page_size), ("num_qo_heads", heads.num_qo_heads),
        ("num_kv_heads", heads.num_kv_heads), ("head_dim", heads.head_dim),
        ("window_left", part.window_left), ("sm_scale", sm_scale),
        ("q_data_type", heads.q_dtype), ("kv_data_type", heads.kv_dtype),
        ("o_data_type", heads.out_dtype), ("sinks", part.sinks),
        ("deterministic", policy.deterministic),
    ]  # fmt: skip


def _level_args(level: int, heads: HeadConfig, page_size: int) -> list[tuple[str, Any]]:
    """The ``plan()`` arguments of cascade level ``level``'s call: one kernel request per
    sharing group, no causal mask, no window (every shared key precedes every query)."""
    return [
        ("qo_indptr", HostArray(names.level_array(level, "qo_indptr"))),
        ("paged_kv_indptr", HostArray(names.level_array(level, "page_indptr"))),
        ("paged_kv_indices", DeviceIndices(names.level_pages_region(level))),
        ("paged_kv_last_page_len", HostArray(names.level_array(level, "last_page_len"))),
        ("head_dim_qk", heads.head_dim), ("page_size", page_size), ("causal", False),
        ("window_left", -1),
    ]  # fmt: skip


def sink_kernel(gp: GroupPlan, heads: HeadConfig, *, multi_item: bool) -> SinkKernel | None:
    """The sink kernel variant of a sink group's paged call, or ``None`` (the sink is then
    folded in after the kernel): not with a soft cap, multi-item tensors, an fp8 cache or
    a custom mask (flashinfer 0.7.4's variant replaces it with the window alone)."""
    part = gp.paged
    if part is None or not part.sinks or gp.group.logits_soft_cap or multi_item:
        return None
    if heads.kv_is_fp8 or gp.uses_custom_mask:
        return None
    return SinkKernel(heads.q_dtype, heads.kv_dtype, heads.head_dim, part.window_left)


def translate(
    spec: PlanSpec, policy: ExecutorPolicy, *, sm90: bool, sink_decode: bool = True,
    xqa: bool = False,
) -> Translation:  # fmt: skip
    """Describe every FlashInfer ``plan()`` call of ``spec`` and the arrays it needs, under
    ``policy`` (:class:`ExecutorPolicy`); ``sm90``: the GPU is Hopper (FA3 under
    ``"auto"``); ``sink_decode``: FlashInfer has its sink decode wrapper; ``xqa``: it has
    ``xqa`` and the GPU runs it."""
    calls = call_skeleton(spec, policy, sm90=sm90, sink_decode=sink_decode, xqa=xqa)
    return Translation(calls, call_inputs(spec, calls))


#: The MultiItemTensors field behind each staged multi-item plan() argument.
_ITEM_ARRAYS = {"prefix_len_ptr": "prefix_len_ptr", "max_item_len_ptr": "max_item_len"}


def call_inputs(spec: PlanSpec, calls: tuple[GroupCalls, ...]) -> CallInputs:
    """The batch's arrays behind ``calls``' placeholders. With a custom mask an empty span
    gets one unread page and ``last_page_len = 0``: flashinfer 0.7.4 sizes a request's
    mask by ``(pages - 1) * page_size + last_page_len``, so zero pages would shift the rest.

    Raises:
        UnsupportedError: a custom mask too large for flashinfer's int32 offsets.
    """
    uses_qo = any(gc.ragged is not None or gc.path is not KernelPath.DECODE for gc in calls)
    host: dict[str, IntArray] = {names.QO_INDPTR: spec.qo_indptr} if uses_qo else {}
    spans: dict[int, tuple[IntArray, IntArray]] = {}
    masks: dict[int, MaskRecipe] = {}
    ints: dict[str, int] = {}
    elements: dict[str, int] = {}
    widths: dict[int, int] = {}
    cascade = spec.cascade
    for gc in calls:
        index = gc.group_index
        gp = spec.group_plans[index]
        if gp.virtual is not None:  # the kernels run over the virtual requests' rows
            vq = gp.virtual.queries
            host[names.group_array(index, "qo_indptr")] = vq.indptr
        # a group on cascade levels: its paged call reads each request's own keys
        part = cascade.own_call(index) if gc.levels and cascade is not None else gp.paged
        if part is None:
            continue
        # the gather reads each request's span, the kernel the call's (virtual requests')
        start, num = part.start_page, part.num_pages
        call = part.call_spans
        page_indptr = call.pages.indptr
        if gc.masked and part.kv_lens.size and not np.logical_and.reduce(part.kv_lens):
            empty = part.kv_lens == 0
            start = seal_inplace(np.where(empty, 0, start))
            num = seal_inplace(np.where(empty, 1, num))
            page_indptr = indptr(num, "pages")
        spans[index] = (start, num)
        if gc.paged is not None and gc.paged.wrapper.kind is WrapperKind.XQA:
            host[names.group_array(index, "kv_lens")] = call.kv_lens  # each at least 1
            widths[index] = max(int(np.maximum.reduce(num)), 1) if num.size else 1
            continue
        host[names.group_array(index, "page_indptr")] = page_indptr
        host[names.group_array(index, "last_page_len")] = call.last_page_len
        if gc.masked:
            mask = part.mask if part.mask is not None else part.position_mask
            assert mask is not None
            masks[index] = _mask_recipe(index, mask, host)
        for name, value in gc.paged.kwargs if gc.paged is not None else ():
            if not isinstance(value, (StagedArray, BatchInt, ItemPositions)):
                continue
            items = part.items
            assert items is not None, "a multi-item call needs the plan's multi-item tensors"
            if isinstance(value, BatchInt):
                ints[value.name] = items.token_pos_in_items_len
            elif isinstance(value, ItemPositions):
                host[names.item_part(value.name, "start")] = items.item_start
                host[names.item_part(value.name, "length")] = items.item_length
                size = items.batch_size * items.token_pos_in_items_len
                ints[names.item_part(value.name, "size")] = size
                ints[names.item_part(value.name, "longest")] = items.max_length
            else:
                arr: npt.NDArray[np.unsignedinteger] = getattr(items, _ITEM_ARRAYS[name])
                host[value.name] = int32_words(arr)
                elements[value.name] = int(arr.shape[0])
    level_spans: tuple[tuple[IntArray, IntArray], ...] = ()
    if cascade is not None and any(gc.levels for gc in calls):
        level_spans = _level_inputs(cascade.levels, spec.total_q, host)
    return CallInputs(host, spans, masks, ints, elements, level_spans, widths)


def _level_inputs(
    plan: CascadePlan, total_q: int, host: dict[str, IntArray]
) -> tuple[tuple[IntArray, IntArray], ...]:
    """Every cascade level's arrays into ``host`` (``l<k>.*``); returns each
    level's ``(start_page, num_pages)`` per request for the gather: a group's shared pages
    at its first member's row, nothing at the other rows."""
    out = []
    for k, level in enumerate(plan.levels):
        spans = level.spans
        host[names.level_array(k, "qo_indptr")] = level.qo_indptr
        host[names.level_array(k, "page_indptr")] = spans.pages.indptr
        host[names.level_array(k, "last_page_len")] = spans.last_page_len
        if level.leaves_rows_out(total_q):  # gathered by its rows
            host[names.level_array(k, "q_rows")] = level.q_rows
        out.append((level.row_start_page, level.row_pages))
    return tuple(out)


def int32_words(values: npt.NDArray[np.unsignedinteger]) -> IntArray:
    """The bytes of a uint16 / uint32 array as read-only int32 words (a uint16 array of
    odd length gets one zero element more); a ``.view(dtype)`` of the staged words gives
    the values back (little-endian on both sides)."""
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
    """int64 ``[bs + 1]``: the byte offset at which flashinfer 0.7.4's kernel reads each
    request's packed mask, ``sum_{r<i} qo_r * kv_r``: its ``plan()`` sums ``qo_len *
    kv_len`` *bits* and its kernel adds them to a *byte* pointer (flashinfer PR #2201)."""
    return running_sum(np.multiply(qo_lens, kv_lens, dtype=np.int64))


def bytes_as_int32(values: npt.NDArray[np.uint8]) -> IntArray:
    """uint8 bytes as int32 words (zero-padded to a multiple of 4), for the int32 staging
    buffer; the device views them back as uint8."""
    if values.shape[0] % 4 == 0 and values.flags.c_contiguous:  # a view, no copy
        words = values.view(np.int32)
        words.flags.writeable = False  # this view only
        return words
    padded = np.zeros((values.shape[0] + 3) // 4 * 4, dtype=np.uint8)
    padded[: values.shape[0]] = values
    return seal_inplace(padded.view(np.int32))


def _mask_recipe(
    index: int, mask: CustomMask | PositionMask, host: dict[str, IntArray]
) -> MaskRecipe:
    """Group ``index``'s mask as int32 arrays in ``host`` (``g<index>.mask.*``; ``indptr``:
    :func:`flashinfer_mask_offsets`) and its sizes.

    Raises:
        UnsupportedError: a mask too large for the mask kernel's int32 offsets.
    """
    name = functools.partial(names.mask_name, index)
    sizes = np.multiply(mask.qo_lens, mask.kv_lens, dtype=np.int64)  # bits per request
    offsets = running_sum(sizes)
    total = int(offsets[-1])
    if total > INT32_MAX - 8:  # the mask kernel's int32 element indices
        raise UnsupportedError(
            "extend_path", "a custom mask of this many elements exceeds int32 offsets: plan "
            "this batch with extend_path='paged'", mask_elements=total,
        )  # fmt: skip
    max_bytes = (int(np.maximum.reduce(sizes)) + 7) // 8 if total else 0
    host[name("qo_lens")] = mask.qo_lens
    host[name("kv_lens")] = mask.kv_lens
    host[name("indptr")] = seal_inplace(offsets)  # int32: the total fits (checked above)
    if isinstance(mask, PositionMask):  # positions fit int32; the rule is capped at it
        host[name("row_position")] = seal_inplace(mask.row_position)
        host[name("col_position")] = seal_inplace(mask.col_position)
        rule = [mask.causal, mask.window_left, mask.window_right, mask.chunk]
        host[name("rule")] = seal_inplace(np.minimum(np.array(rule, np.int64), INT32_MAX))
        return MaskRecipe(max_bytes, max(total, 1), position=True)
    first, bs = mask.first_visible, mask.first_visible.shape[0]
    if first is zeros((bs,), "int64"):  # the planner's shared zeros (a whole-row tree)
        host[name("first_visible")] = zeros((bs,), "int32")
    else:  # clamped to int32, then cast
        first = np.maximum(first, constant_operand(-INT32_MAX, np.int64))
        np.minimum(first, constant_operand(INT32_MAX, np.int64), out=first)
        host[name("first_visible")] = seal_inplace(first)
    if not isinstance(mask, TreeMask):
        return MaskRecipe(max_bytes, max(total, 1))
    host[name("row_offsets")] = mask.row_offsets.reshape(-1)  # read-only int32, C order
    host[name("tail_start")] = seal_inplace(mask.tail_start)  # in [0, kv_len]
    host[name("tail_words")] = bytes_as_int32(mask.tail_words.reshape(-1))  # packed rows
    return MaskRecipe(max_bytes, max(total, 1), num_tokens=int(mask.row_offsets.shape[1]))
