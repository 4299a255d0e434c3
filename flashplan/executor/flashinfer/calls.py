"""The pure PlanSpec -> FlashInfer calls translation (the call records live in
:mod:`~flashplan.executor.flashinfer.call_types`, the batch arrays in
:mod:`~flashplan.executor.flashinfer.batch_arrays`; both re-exported here).

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

import functools
from typing import Any

import flashplan.executor.flashinfer.names as names
from flashplan.errors import UnsupportedError
from flashplan.executor.flashinfer.batch_arrays import (
    bytes_as_int32,
    call_inputs,
    decode_scheduler_kv_lens,
    flashinfer_mask_offsets,
    int32_words,
)
from flashplan.executor.flashinfer.call_types import (
    PLACEHOLDERS,
    SINK_WRAPPERS,
    BatchInt,
    BuiltMask,
    CallInputs,
    DeviceIndices,
    GroupCalls,
    HostArray,
    ItemPositions,
    MaskRecipe,
    Placeholder,
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
    prefill_backend,
    split_kwargs,
)
from flashplan.layout.heads import HeadConfig
from flashplan.planning.spec import GroupPlan, KernelPath, PlanKey, PlanSpec

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
    "SkeletonKey",
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


#: What a call skeleton depends on besides the policy (:func:`skeleton_key`).
SkeletonKey = tuple[
    PlanKey, bool, tuple[bool, ...], tuple[bool, ...], tuple[bool, ...], tuple[int, ...], int
]


def skeleton_key(
    spec: PlanSpec, policy: ExecutorPolicy, batch_size: int | None = None
) -> SkeletonKey:
    """What a skeleton depends on besides the policy: the plan's key, the decode kernel
    kind (a function of the batch size, or of ``batch_size`` when given: a CUDA-graph
    bucket's), which groups carry a custom mask, which carry multi-item tensors (in a
    multi-item batch — ``key.multi_item`` — every self group's paged call), which run
    over virtual requests (chunked local attention across a chunk boundary), and which
    run on cascade levels and how many levels there are."""
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
    # (the own calls' causal flags follow from the groups in the key: each group's own)
    return spec.key, tensor_cores, masked, items, virtual, cascade.groups, levels


def check_runnable(spec: PlanSpec, *, graph: bool = False) -> None:
    """Refuse a plan whose kernel calls this executor does not run as planned.

    A chunked extend whose new tokens cross a chunk boundary runs over virtual requests
    (:attr:`~flashplan.planning.GroupPlan.virtual`): more kernel rows than requests,
    which a CUDA-graph bucket (``graph``: the caller is one) has no fixed buffers for.
    Decode and verify steps never split that way (their queries see one chunk each); an
    extend that a bucket replays is planned with ``plan(..., chunked_extend="mask")``
    (one position-masked call per request), or runs eagerly. The executor refuses rather
    than run a different mask.

    A plan with cascade levels (``plan(..., shared_prefix=..., cascade=...)``) runs
    eagerly; a CUDA-graph bucket refuses it (its fixed buffers have no room for the
    levels' calls yet).

    Raises:
        UnsupportedError: naming the group, or ``cascade``.
    """
    if not graph:
        return
    if spec.cascade is not None:
        raise UnsupportedError(
            "cascade",
            "a CUDA-graph bucket does not run cascade levels yet: run this step eagerly, "
            "or plan it with cascade='off'",
            groups=spec.cascade.groups,
        )
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
    key, tensor_cores, masked, items, virtual, cascaded, levels = skeleton_key(
        spec, policy, batch_size
    )
    heads = key.heads
    cascade = spec.cascade
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
        qo_indptr = HostArray(
            names.group_array(index, "qo_indptr") if virtual[index] else names.QO_INDPTR
        )
        if gp.paged is not None:
            # a group on cascade levels runs its own call (the plan's, flags included)
            part = cascade.own_call(index) if cascade and index in cascaded else gp.paged
            pages = DeviceIndices(names.pages_region(index))
            page_indptr = HostArray(names.group_array(index, "page_indptr"))
            last_page_len = HostArray(names.group_array(index, "last_page_len"))
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
                    item = functools.partial(names.item_name, index)
                    args += [
                        ("prefix_len_ptr", StagedArray(item("prefix_len"), "uint32")),
                        ("token_pos_in_items_ptr", ItemPositions(item("tpos"))),
                        ("token_pos_in_items_len", BatchInt(item("tpos_len"))),
                        ("max_item_len_ptr", StagedArray(item("max_len"), "uint16")),
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
        level_calls: tuple[PlanCall, ...] = ()
        if index in cascaded:
            # FA2 unless the policy forces FA3: a level's call then re-plans through the
            # compiled scheduler every batch, as the own decode call does (a full FA3
            # plan() would cost more host time than the level saves on a decode step)
            backend = "fa3" if policy.prefill_backend == "fa3" else "fa2"
            prefill_backend(heads, policy, custom_mask=False, sm90=sm90)  # its refusals
            level_calls = tuple(
                PlanCall(
                    WrapperKey(WrapperKind.PAGED_PREFILL, group, backend, False, level=k),
                    tuple(_level_args(k, heads, key.page_size) + split_kwargs(policy) + common),
                )
                for k in range(levels)
            )
        out.append(GroupCalls(index, gp.path, paged, ragged, masked[index], level_calls))
    return tuple(out)


def _level_args(level: int, heads: HeadConfig, page_size: int) -> list[tuple[str, Any]]:
    """The ``plan()`` arguments of cascade level ``level``'s call: every sharing group
    one kernel request (its members' query rows, its shared pages), no causal mask and
    no window (every shared key precedes every query; windowed groups never run on
    levels)."""
    return [
        ("qo_indptr", HostArray(names.level_array(level, "qo_indptr"))),
        ("paged_kv_indptr", HostArray(names.level_array(level, "page_indptr"))),
        ("paged_kv_indices", DeviceIndices(names.level_pages_region(level))),
        ("paged_kv_last_page_len", HostArray(names.level_array(level, "last_page_len"))),
        ("head_dim_qk", heads.head_dim),
        ("page_size", page_size),
        ("causal", False),
        ("window_left", -1),
    ]


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
    silently see every key (a verify tree, a position mask; measured in run AU). An
    fp8 cache folds its sinks too: the sink variant's fp8-KV build is a separate JIT
    module that flashplan's GPU tests have not run.
    """
    part = gp.paged
    if part is None or not part.sinks or gp.group.logits_soft_cap or multi_item:
        return None
    if heads.kv_is_fp8:  # the sink variant's fp8 build is not one flashplan's tests ran
        return None
    if gp.uses_custom_mask:
        return None
    return SinkKernel(heads.q_dtype, heads.kv_dtype, heads.head_dim, part.window_left)


def translate(spec: PlanSpec, policy: ExecutorPolicy, *, sm90: bool) -> Translation:
    """Describe every FlashInfer ``plan()`` call of ``spec`` and the arrays it needs.

    Args:
        spec: the plan.
        policy: kernel choices (:class:`ExecutorPolicy`).
        sm90: whether the target GPU is Hopper (enables FA3 under ``"auto"``).
    """
    calls = call_skeleton(spec, policy, sm90=sm90)
    return Translation(calls, call_inputs(spec, calls))
