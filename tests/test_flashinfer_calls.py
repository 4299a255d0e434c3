"""`translate()` against the *installed* flashinfer, on the CPU (no GPU, no mock wrappers).

For random layouts (decode, extend with and without prefix, every extend path, windows,
cross groups, soft caps, page sizes 1/2/16, MHA/GQA/MQA) the translated calls must

* bind to the real signatures of the flashinfer wrappers (``plan`` / ``__init__``),
* carry exactly the plan's values (window, soft cap, scale, causal flags, dtypes, heads,
  page size, host arrays) and the policy's kernel choices,
* and, where a custom mask is passed, put every request's mask bits where flashinfer
  reads them. flashinfer 0.7.4's ``plan()`` computes the packed mask offsets with its
  host function ``_compute_page_mask_indptr`` as a running sum of ``qo_len * kv_len``
  (bits), and its kernel adds them to a byte pointer (flashinfer PR #2201). We call that
  very function on the translated host arrays and read the bits at the offsets it
  returns, as the kernel does. If flashinfer changes that function (fixes the units,
  clamps empty spans, renames it), these tests fail and the workarounds in
  ``flashplan.executor.flashinfer.calls`` (``flashinfer_mask_offsets``, ``call_inputs``)
  must be revisited.
"""

from __future__ import annotations

import inspect
import math
import warnings
from typing import Any

import attrs
import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import flashplan as fp
from flashplan import BatchLayout, HeadConfig, PlanSpec
from flashplan.executor.flashinfer.calls import (
    BatchInt,
    BuiltMask,
    CallInputs,
    DeviceArray,
    DeviceIndices,
    GroupCalls,
    HostArray,
    ItemPositions,
    PlanCall,
    StagedArray,
    WrapperKind,
    call_skeleton,
    skeleton_key,
    translate,
)
from flashplan.executor.flashinfer.policy import (
    TENSOR_CORE_MIN_BATCH,
    ExecutorPolicy,
    decode_uses_tensor_cores,
    prefill_backend,
)
from flashplan.executor.flashinfer.staging import JOBS, device_plan
from flashplan.executor.flashinfer.xqa import XqaDecode
from flashplan.executor.gathers import gather_jobs, pages_region
from flashplan.kernels.custom_mask import build_custom_mask_torch
from flashplan.kernels.runs import fill_runs_torch
from flashplan.planning import GroupPlan, KernelPath
from flashplan.planning.masks import PositionMask, TreeMask, unpack_request
from flashplan.testing import (
    LOCAL_GROUP_KINDS,
    attention_groups,
    decode_layouts,
    extend_layouts,
    head_configs,
    layouts,
    multi_item_layouts,
    verify_layouts,
)

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    flashinfer = pytest.importorskip("flashinfer")
    from flashinfer.page import get_seq_lens as _get_seq_lens

    # Private in flashinfer: imported by name on purpose, so that a rename fails loudly.
    from flashinfer.prefill import _compute_page_mask_indptr

PAGE_SIZES = (1, 2, 16)
HEAD_DIMS = (64, 96, 128, 256)  # 96: a head size FA3 does not take
PATHS = ("auto", "paged", "ragged")
_FA3_DTYPES = (torch.float16, torch.bfloat16)
_WORKSPACE = object()  # stands in for the float workspace tensor when binding __init__


# --------------------------------------------------------------------------- helpers
def _t(values: np.ndarray) -> torch.Tensor:
    """CPU tensor copy of a (read-only) host array, as the executor's pinned views are."""
    return torch.tensor(np.array(values))


def _wrapper_cls(kind: WrapperKind) -> Any:
    return getattr(flashinfer, kind.value)


def _plan_fn(kind: WrapperKind) -> Any:
    """The function whose signature a ``plan(**kwargs)`` call must bind to.

    ``BatchDecodeWithPagedKVCacheWrapper.plan`` in flashinfer 0.7.4 is
    ``plan(self, indptr, ..., page_size, *deprecated_positional_args, **kwargs)`` and
    forwards ``**kwargs`` to ``_plan_impl``: binding against ``plan`` would accept any
    keyword (a misspelt ``window_left`` would only fail on the GPU). ``_plan_impl``
    declares the real keyword-only parameters, so decode calls are bound against it.
    The prefill wrappers' ``plan`` declares every parameter and has no ``**kwargs``.
    """
    cls = _wrapper_cls(kind)
    return cls._plan_impl if kind is WrapperKind.DECODE else cls.plan


def _fa3_capable(heads: HeadConfig) -> bool:
    return (
        heads.q_dtype in _FA3_DTYPES
        and heads.kv_dtype == heads.q_dtype
        and heads.head_dim in (64, 128, 256)
    )


def _expected_backend(
    heads: HeadConfig, policy: ExecutorPolicy, *, masked: bool, sm90: bool, sinks: bool = False
) -> str:
    """The documented prefill backend rules, restated independently of the policy module."""
    if masked or sinks:
        return "fa2"
    if policy.prefill_backend != "auto":
        return policy.prefill_backend
    fa3 = (
        sm90
        and not policy.deterministic  # graphs replay FA2: deterministic eager matches them
        and heads.q_dtype in _FA3_DTYPES
        and heads.kv_dtype == heads.q_dtype
        and heads.head_dim in (64, 128, 256)
    )
    return "fa3" if fa3 else "fa2"


_VIEWS = {"uint32": np.uint32, "uint16": np.uint16}
_ITEM_KWARGS = (
    "prefix_len_ptr",
    "token_pos_in_items_ptr",
    "token_pos_in_items_len",
    "max_item_len_ptr",
)


def _staged_view(words: np.ndarray, placeholder: StagedArray, inputs: CallInputs) -> np.ndarray:
    """What the executor hands to plan() for a StagedArray: the staged int32 words seen
    as the placeholder's dtype (the device does ``.view(torch.uint16)`` on the same
    little-endian bytes), cut to the array's elements."""
    assert words.dtype == np.int32
    return words.view(_VIEWS[placeholder.dtype])[: inputs.elements[placeholder.name]]


def _filled_items(placeholder: ItemPositions, inputs: CallInputs) -> np.ndarray:
    """What the executor hands to plan() for ItemPositions: a zeroed uint16 array of
    ``<name>.size`` entries with every staged item filled with 1, 2, … (here by
    fill_runs' torch twin, which the kernel tests hold equal to the Triton kernel)."""
    name = placeholder.name
    out = torch.zeros(inputs.ints[f"{name}.size"], dtype=torch.uint16)
    start, length = (
        torch.from_numpy(inputs.host[f"{name}.{k}"].copy()) for k in ("start", "length")
    )
    fill_runs_torch(start, 1, length, out, inputs.ints[f"{name}.longest"])
    return out.numpy()


def _resolved(call: PlanCall, inputs: CallInputs) -> dict[str, Any]:
    """The call's keyword arguments with host placeholders replaced by their arrays."""
    out = {}
    for name, value in call.kwargs:
        if isinstance(value, HostArray):
            value = inputs.host[value.name]
        elif isinstance(value, StagedArray):
            value = _staged_view(inputs.host[value.name], value, inputs)
        elif isinstance(value, BatchInt):
            value = inputs.ints[value.name]
        elif isinstance(value, ItemPositions):
            value = _filled_items(value, inputs)
        out[name] = value
    return out


def _flashinfer_kv_lens(kw: dict[str, Any], indptr: str, last: str) -> np.ndarray:
    """kv lengths as flashinfer's host planner derives them (clamped formula)."""
    page_indptr, last_page_len, page_size = kw[indptr], kw[last], kw["page_size"]
    fi = _get_seq_lens(_t(page_indptr), _t(last_page_len), page_size).numpy()
    # The same formula by hand, in case get_seq_lens changes: clamp(pages - 1, 0) * ps + last.
    pages = np.diff(page_indptr.astype(np.int64))
    by_hand = np.maximum(pages - 1, 0) * page_size + last_page_len.astype(np.int64)
    np.testing.assert_array_equal(fi, by_hand)
    return fi


def _check_bind(call: PlanCall) -> None:
    names = [name for name, _ in call.kwargs]
    assert len(names) == len(set(names)), f"duplicate plan() keyword in {names}"
    cls = getattr(flashinfer, call.wrapper.class_name)  # a sink call: FlashInfer's sink wrapper
    assert issubclass(cls, _wrapper_cls(call.wrapper.kind))  # planned as its kind is
    inspect.signature(cls.__init__).bind(None, _WORKSPACE, **call.wrapper.constructor_kwargs())
    inspect.signature(_plan_fn(call.wrapper.kind)).bind(None, **call.as_dict())
    _check_sink_kernel(call)


def _check_sink_kernel(call: PlanCall) -> None:
    """A sink wrapper is built for the call's own dtypes, head size and window, on FA2."""
    sink = call.wrapper.sink
    if sink is None:
        return
    kw = call.as_dict()
    assert call.wrapper.backend == "fa2"
    assert sink.window_left == kw["window_left"]
    assert (sink.q_dtype, sink.kv_dtype) == (kw["q_data_type"], kw["kv_data_type"])
    assert sink.head_dim == kw.get("head_dim", kw.get("head_dim_qk"))
    assert kw["logits_soft_cap"] == 0.0  # the sink variant has no soft cap
    assert "prefix_len_ptr" not in kw  # nor multi-item tensors
    assert "packed_custom_mask" not in kw  # and it ignores a custom mask


def _check_common(spec: PlanSpec, gp: GroupPlan, kw: dict[str, Any], window: int) -> None:
    heads, group = spec.heads, gp.group
    assert kw["num_qo_heads"] == heads.num_qo_heads
    assert kw["num_kv_heads"] == heads.num_kv_heads
    # The window the plan's call compiles in, and no other.
    assert kw["window_left"] == window
    assert isinstance(kw["logits_soft_cap"], float)
    assert kw["logits_soft_cap"] == group.logits_soft_cap
    scale = group.sm_scale if group.sm_scale is not None else 1.0 / math.sqrt(heads.head_dim)
    assert kw["sm_scale"] == pytest.approx(scale, rel=1e-12)
    assert kw["q_data_type"] == heads.q_dtype
    assert kw["kv_data_type"] == heads.kv_dtype
    assert kw["o_data_type"] == heads.out_dtype
    assert kw["non_blocking"] is True
    # Nothing flashplan does not plan for may be switched on.
    assert kw.get("pos_encoding_mode", "NONE") == "NONE"
    assert "custom_mask" not in kw  # only the packed form is ever passed
    assert "fixed_split_size" not in kw  # graph-unsafe; deterministic mode disables splits
    for name, value in kw.items():
        if isinstance(value, np.ndarray) and name not in _ITEM_KWARGS:
            # The executor stages every host array through one int32 pinned buffer.
            assert value.dtype == np.int32, (name, value.dtype)


def _check_paged_arrays(
    gp: GroupPlan, gc: GroupCalls, kw: dict[str, Any], pspec: PlanSpec, inputs: CallInputs
) -> None:
    part = gp.paged
    assert part is not None
    start, num = inputs.spans[gc.group_index]
    masked = part.mask is not None or part.position_mask is not None
    empty = part.kv_lens == 0
    if masked:
        # Empty spans get one unread page and last_page_len 0 (see call_inputs).
        np.testing.assert_array_equal(num, np.where(empty, 1, part.num_pages))
        np.testing.assert_array_equal(start, np.where(empty, 0, part.start_page))
    else:
        np.testing.assert_array_equal(num, part.num_pages)
        np.testing.assert_array_equal(start, part.start_page)
    page_indptr = inputs.host[f"g{gc.group_index}.page_indptr"]
    assert page_indptr[0] == 0
    # the gather reads each request's span; a group over virtual requests plans its
    # kernel over their spans, which run end to end over those pages
    call = part.call_spans
    rows = call.kv_lens.shape[0]
    if gp.virtual is None:
        np.testing.assert_array_equal(np.diff(page_indptr), num)
    else:
        assert not masked and rows == gp.virtual.request.shape[0]
        np.testing.assert_array_equal(page_indptr, call.pages.indptr)
        assert int(page_indptr[-1]) <= int(num.sum())
        # each virtual request's pages lie inside its request's gathered pages
        gathered = np.concatenate([[0], np.cumsum(num)])
        request = gp.virtual.request
        assert (page_indptr[:-1] >= gathered[request]).all()
        assert (page_indptr[1:] <= gathered[request + 1]).all()

    indptr_name, last_name = (
        ("indptr", "last_page_len")
        if gc.path is KernelPath.DECODE
        else ("paged_kv_indptr", "paged_kv_last_page_len")
    )
    np.testing.assert_array_equal(kw[indptr_name], page_indptr)
    np.testing.assert_array_equal(kw[last_name], call.last_page_len)
    assert kw[indptr_name].shape == (rows + 1,)
    assert kw[last_name].shape == (rows,)
    assert kw["page_size"] == pspec.page_size
    # flashinfer's own kv lengths: no phantom keys for empty segments, nothing dropped.
    np.testing.assert_array_equal(_flashinfer_kv_lens(kw, indptr_name, last_name), call.kv_lens)


def _flashinfer_mask_offsets(kw: dict[str, Any]) -> np.ndarray:
    """Mask offsets exactly as flashinfer's ``plan()`` computes them from these arguments."""
    offsets = _compute_page_mask_indptr(
        _t(kw["qo_indptr"]),
        _t(kw["paged_kv_indptr"]),
        _t(kw["paged_kv_last_page_len"]),
        kw["page_size"],
    )
    return offsets.numpy().astype(np.int64)


def _mask_buffer(index: int, gp: GroupPlan, kw: dict[str, Any], inputs: CallInputs) -> np.ndarray:
    """The uint8 buffer flashinfer's kernel will read as ``packed_custom_mask``.

    Threshold-row masks are built on the device by the executor (``BuiltMask`` + the
    batch's ``g<i>.mask.*`` arrays): here the same builder runs on CPU tensors (its
    torch twin), into a buffer pre-filled with garbage as ``torch.empty`` would be.
    """
    part = gp.paged
    assert part is not None
    if part.position_mask is not None:
        return _position_mask_buffer(index, part.position_mask, kw, inputs)
    assert part.mask is not None
    assert kw["packed_custom_mask"] == BuiltMask(index)
    recipe = inputs.masks[index]
    assert not recipe.position
    bs = gp.num_keys.shape[0]
    arrays = {
        name: inputs.host[f"g{index}.mask.{name}"]
        for name in ("first_visible", "qo_lens", "kv_lens")
    }
    # The mask kernel writes request i at byte mask_indptr[i] (FlashInfer's offsets).
    arrays["byte_offsets"] = inputs.host[f"g{index}.mask.indptr"][:-1]
    for name, arr in arrays.items():
        # The executor stages these through its int32 pinned buffer.
        assert arr.dtype == np.int32 and arr.shape == (bs,), (name, arr.dtype, arr.shape)
    qo_lens = np.diff(kw["qo_indptr"].astype(np.int64))
    np.testing.assert_array_equal(arrays["qo_lens"], qo_lens)
    np.testing.assert_array_equal(arrays["kv_lens"], part.kv_lens)
    np.testing.assert_array_equal(
        arrays["first_visible"], np.clip(part.mask.first_visible, -(2**31 - 1), 2**31 - 1)
    )
    assert recipe.num_tokens == (
        part.mask.row_offsets.shape[1] if hasattr(part.mask, "row_offsets") else 0
    )
    np.testing.assert_array_equal(arrays["byte_offsets"], _flashinfer_mask_offsets(kw)[:-1])
    n_bytes = (qo_lens * part.kv_lens.astype(np.int64) + 7) // 8
    assert recipe.max_bytes == (int(n_bytes.max()) if bs else 0)
    end = arrays["byte_offsets"].astype(np.int64) + n_bytes
    assert recipe.total_bytes >= max(int(end.max()) if bs else 0, 1)
    buf = torch.full((recipe.total_bytes,), 0xA5, dtype=torch.uint8)
    tree = None
    if recipe.num_tokens:
        n = recipe.num_tokens
        words = inputs.host[f"g{index}.mask.tail_words"]
        assert words.dtype == np.int32  # staged through the int32 buffer
        packed = words.copy().view(np.uint8)[: bs * n * ((n + 7) // 8)]
        np.testing.assert_array_equal(  # each row's bits, packed little-endian
            packed, np.packbits(part.mask.tail_bits, axis=2, bitorder="little").reshape(-1)
        )
        bits = torch.from_numpy(packed.copy())
        tree = (
            _t(inputs.host[f"g{index}.mask.row_offsets"]),
            _t(inputs.host[f"g{index}.mask.tail_start"]),
            bits,
        )
    # The torch twin of the executor's Triton kernel (same contract; the kernel itself is
    # checked against it in tests/kernels): independent of Triton's interpreter mode.
    build_custom_mask_torch(
        *(_t(arrays[n]) for n in arrays), buf, tree=tree, num_tokens=recipe.num_tokens
    )
    return buf.numpy()


def _position_mask_buffer(
    index: int, mask: PositionMask, kw: dict[str, Any], inputs: CallInputs
) -> np.ndarray:
    """:func:`_mask_buffer` of a position mask: its staged arrays (row and column
    positions, the rule) are the mask's own, and the torch twin builds from them."""
    assert kw["packed_custom_mask"] == BuiltMask(index)
    recipe = inputs.masks[index]
    assert recipe.position and recipe.num_tokens == 0
    g = f"g{index}.mask."
    host = inputs.host
    for name in ("row_position", "col_position", "qo_lens", "kv_lens", "rule", "indptr"):
        assert host[g + name].dtype == np.int32, name  # the int32 staging buffer
    assert g + "first_visible" not in host and g + "tail_words" not in host
    np.testing.assert_array_equal(host[g + "row_position"], mask.row_position)
    np.testing.assert_array_equal(host[g + "col_position"], mask.col_position)
    np.testing.assert_array_equal(host[g + "qo_lens"], mask.qo_lens)
    np.testing.assert_array_equal(host[g + "kv_lens"], mask.kv_lens)
    rule = [int(mask.causal), mask.window_left, mask.window_right, mask.chunk]
    assert host[g + "rule"].tolist() == [min(v, 2**31 - 1) for v in rule]
    offsets = host[g + "indptr"]
    np.testing.assert_array_equal(offsets, _flashinfer_mask_offsets(kw))
    n_bytes = (mask.qo_lens.astype(np.int64) * mask.kv_lens + 7) // 8
    assert recipe.max_bytes == (int(n_bytes.max()) if n_bytes.size else 0)
    buf = torch.full((recipe.total_bytes,), 0xA5, dtype=torch.uint8)
    build_custom_mask_torch(
        _t(host[g + "row_position"]), _t(host[g + "qo_lens"]), _t(host[g + "kv_lens"]),
        _t(offsets[:-1]), buf, position=(_t(host[g + "col_position"]), _t(host[g + "rule"])),
    )  # fmt: skip
    return buf.numpy()


def _check_mask_layout(
    pspec: PlanSpec, index: int, gp: GroupPlan, kw: dict[str, Any], inputs: CallInputs
) -> None:
    """Read every request's mask bits where flashinfer 0.7.4's kernel reads them."""
    part = gp.paged
    assert part is not None
    mask = part.mask if part.mask is not None else part.position_mask
    assert mask is not None
    buf = _mask_buffer(index, gp, kw, inputs)
    offsets = _flashinfer_mask_offsets(kw)
    assert offsets.shape == (pspec.batch_size + 1,)
    qo_lens = np.diff(pspec.qo_indptr.astype(np.int64))
    kv_lens = part.kv_lens.astype(np.int64)
    fi_kv = _flashinfer_kv_lens(kw, "paged_kv_indptr", "paged_kv_last_page_len")
    np.testing.assert_array_equal(fi_kv, kv_lens)
    for i in range(pspec.batch_size):
        q, kv, off = int(qo_lens[i]), int(kv_lens[i]), int(offsets[i])
        assert off >= 0, f"request {i}: flashinfer mask offset {off} < 0 (offsets {offsets})"
        # In flashinfer 0.7.4 the offsets count bits (PR #2201); consecutive requests
        # are qo_len * kv_len apart. A change here means flashinfer's units changed.
        assert int(offsets[i + 1]) - off == q * kv, (
            f"request {i}: flashinfer's mask offsets {offsets.tolist()} no longer step by "
            "qo_len * kv_len; flashinfer changed _compute_page_mask_indptr: revisit "
            "flashplan.executor.flashinfer.calls (flashinfer_mask_offsets)"
        )
        n = q * kv
        if n == 0:
            assert off <= buf.shape[0]
            continue
        e = np.arange(n, dtype=np.int64)
        byte = off + e // 8  # custom_mask_ptr = mask + mask_indptr[i]; ptr[e / 8] >> e % 8
        assert int(byte[-1]) < buf.shape[0], (
            f"request {i}: kernel reads byte {int(byte[-1])} of a {buf.shape[0]}-byte mask"
        )
        bits = ((buf[byte] >> (e % 8).astype(np.uint8)) & 1).astype(bool).reshape(q, kv)
        want = unpack_request(mask.packed, mask.indptr, i, q, kv)
        np.testing.assert_array_equal(
            bits, want, err_msg=f"request {i} (qo_len={q}, kv_len={kv}): mask bits misplaced"
        )


def _xqa_expected(
    spec: PlanSpec, policy: ExecutorPolicy, *, sm90: bool, xqa: bool
) -> dict[int, bool] | str:
    """XQA's documented rules, restated independently of the policy module: per group
    index whether its decode call goes to XQA, or the message that the translation must
    refuse with (``decode_backend='xqa'`` without XQA, or over a group XQA cannot run)."""
    if policy.decode_backend == "xqa" and not xqa:
        return "'xqa' needs flashinfer.xqa"
    heads = spec.heads
    wanted = xqa and (
        policy.decode_backend == "xqa"
        or (policy.decode_backend == "auto" and sm90 and heads.kv_dtype == torch.float8_e4m3fn)
    )
    cascaded = skeleton_key(spec, policy)[5]
    out = {}
    for index, gp in enumerate(spec.group_plans):
        if gp.path is not KernelPath.DECODE or not wanted:
            out[index] = False
            continue
        q, group = heads.q_dtype, gp.group
        runs = (
            q in (torch.float16, torch.bfloat16)
            and heads.kv_dtype in (torch.float8_e4m3fn, q)
            and heads.out_dtype == q
            and spec.page_size in (16, 32, 64, 128)
            and heads.head_dim % 16 == 0
            and heads.head_dim <= 256
            and not group.logits_soft_cap
            and not group.cross_attention
            and not gp.uses_custom_mask
            and gp.items is None
            and gp.virtual is None
            and index not in cascaded
        )
        if not runs and policy.decode_backend == "xqa":
            return "cannot run on XQA"
        out[index] = runs
    return out


def _check_xqa_call(
    spec: PlanSpec, index: int, gp: GroupPlan, call: PlanCall, inputs: CallInputs,
    policy: ExecutorPolicy,
) -> None:  # fmt: skip
    """An XQA decode call: bound to :meth:`XqaDecode.plan`, the group's pages region as a
    dense block table of rows as wide as its longest request, its keys per request
    staged as uint32, and the group's window, scale, sinks and dtypes."""
    heads, part = spec.heads, gp.paged
    assert part is not None and gp.virtual is None
    assert call.wrapper.kind is WrapperKind.XQA and call.wrapper.backend == "xqa"
    assert call.wrapper.use_tensor_cores is False and call.wrapper.sink is None
    names = [name for name, _ in call.kwargs]
    assert len(names) == len(set(names)), names
    inspect.signature(XqaDecode.plan).bind(None, **call.as_dict())
    kw = call.as_dict()
    assert kw["block_tables"] == DeviceIndices(pages_region(index))
    assert kw["seq_lens"] == DeviceArray(f"g{index}.kv_lens", "uint32")
    lens = inputs.host[f"g{index}.kv_lens"]
    assert lens.dtype == np.int32 and bool((lens >= 1).all())
    np.testing.assert_array_equal(lens, part.kv_lens)
    np.testing.assert_array_equal(inputs.spans[index][1], part.num_pages)
    assert inputs.widths[index] == max(int(part.num_pages.max(initial=0)), 1)
    assert kw["page_size"] == spec.page_size and kw["head_dim"] == heads.head_dim
    assert (kw["num_qo_heads"], kw["num_kv_heads"]) == (heads.num_qo_heads, heads.num_kv_heads)
    assert kw["window_left"] == part.window_left
    assert kw["sm_scale"] == pytest.approx(gp.group.scale_for(heads.head_dim), rel=1e-12)
    assert (kw["q_data_type"], kw["kv_data_type"], kw["o_data_type"]) == (
        heads.q_dtype, heads.kv_dtype, heads.out_dtype
    )  # fmt: skip
    assert kw["sinks"] is part.sinks
    assert kw["deterministic"] is policy.deterministic


def check_translation(
    spec: PlanSpec, policy: ExecutorPolicy, *, sm90: bool, xqa: bool = False
) -> tuple[GroupCalls, ...]:
    """Every property of ``translate(spec, policy, sm90=sm90, xqa=xqa)``; returns the
    calls (none where the translation must refuse, which it is checked to do)."""
    on_xqa = _xqa_expected(spec, policy, sm90=sm90, xqa=xqa)
    if isinstance(on_xqa, str):
        with pytest.raises(fp.UnsupportedError, match="decode_backend") as info:
            translate(spec, policy, sm90=sm90, xqa=xqa)
        assert on_xqa in str(info.value)
        return ()
    translation = translate(spec, policy, sm90=sm90, xqa=xqa)
    calls, inputs = translation.calls, translation.inputs
    heads = spec.heads
    assert len(calls) == len(spec.group_plans)
    for index, (gc, gp) in enumerate(zip(calls, spec.group_plans, strict=True)):
        group = gp.group
        assert gc.group_index == index
        # a group split into virtual requests plans its kernels over their rows
        qo_indptr = spec.qo_indptr if gp.virtual is None else gp.virtual.queries.indptr
        if gp.virtual is not None:
            assert qo_indptr[-1] == spec.qo_indptr[-1]  # the same rows of q, split finer
            assert set(spec.qo_indptr.tolist()) <= set(qo_indptr.tolist())
        assert gc.path is gp.path
        has_paged = gp.path is not KernelPath.RAGGED
        has_ragged = gp.path in (KernelPath.RAGGED, KernelPath.RAGGED_PAGED)
        assert (gc.paged is not None) == has_paged == (gp.paged is not None)
        assert (gc.ragged is not None) == has_ragged == (gp.ragged is not None)
        assert (index in inputs.spans) == has_paged
        assert gc.merges == (gp.path is KernelPath.RAGGED_PAGED)
        assert gc.masked == gp.uses_custom_mask == (index in inputs.masks)

        if gc.paged is not None and on_xqa[index]:
            _check_xqa_call(spec, index, gp, gc.paged, inputs, policy)
        elif gc.paged is not None:
            call = gc.paged
            _check_bind(call)
            kw = _resolved(call, inputs)
            assert gp.paged is not None
            _check_common(spec, gp, kw, gp.paged.window_left)
            # Wrappers are keyed by the computation: the group with its scale resolved.
            assert call.wrapper.group == group.resolved(heads.head_dim)
            masked = gp.uses_custom_mask
            assert ("packed_custom_mask" in kw) == masked
            # The call the plan gives the sinks runs on FlashInfer's sink kernel, unless a
            # soft cap, multi-item tensors or a custom mask (which flashinfer 0.7.4's sink
            # variant ignores) rule it out: then the sink is folded into the state.
            sink_kernel = (
                gp.paged.sinks and not group.logits_soft_cap and gp.items is None and not masked
                and not heads.kv_is_fp8
            )  # fmt: skip
            assert (call.wrapper.sink is not None) == sink_kernel
            assert kw.get("paged_kv_indices", kw.get("indices")) == DeviceIndices(
                pages_region(index)
            )
            if gp.path is KernelPath.DECODE:
                assert call.wrapper.kind is WrapperKind.DECODE
                assert call.wrapper.backend == "fa2"
                want_tc = (
                    True
                    if policy.deterministic or call.wrapper.sink is not None  # sink: always
                    else policy.decode_tensor_cores
                    if policy.decode_tensor_cores is not None
                    else spec.batch_size >= TENSOR_CORE_MIN_BATCH
                )
                assert call.wrapper.use_tensor_cores is want_tc
                ctor = call.wrapper.constructor_kwargs()
                assert ctor.get("use_tensor_cores", want_tc) is want_tc
                assert kw["head_dim"] == heads.head_dim
                assert "causal" not in kw and "is_causal" not in kw
                assert not masked
            else:
                assert call.wrapper.kind is WrapperKind.PAGED_PREFILL
                assert call.wrapper.use_tensor_cores is False
                assert "use_tensor_cores" not in call.wrapper.constructor_kwargs()
                # FA2 for masked and multi-item calls (FlashInfer's FA2 rule, tested)
                assert call.wrapper.backend == _expected_backend(
                    heads, policy, masked=masked or gp.items is not None, sm90=sm90,
                    sinks=call.wrapper.sink is not None,
                )  # fmt: skip
                assert kw["head_dim_qk"] == heads.head_dim
                np.testing.assert_array_equal(kw["qo_indptr"], qo_indptr)
                # The prefix part of ragged+paged is non-causal; a paged-only call is
                # causal exactly when the group is (cross groups: never).
                # A verify tree's mask carries causality itself.
                # So does a position mask (a bidirectional window or a chunk inside pages).
                tree = isinstance(gp.paged.mask, TreeMask) or gp.paged.position_mask is not None
                want_causal = False if gp.path is KernelPath.RAGGED_PAGED or tree else group.causal
                assert kw["causal"] is want_causal
                assert gp.paged.causal is want_causal
            assert call.wrapper.constructor_kwargs()["kv_layout"] == "NHD"
            _check_paged_arrays(gp, gc, kw, spec, inputs)
            if masked:
                assert call.wrapper.backend == "fa2"
                _check_mask_layout(spec, index, gp, kw, inputs)
            _check_items(spec, gp, call, kw)
            assert kw.get("disable_split_kv", False) is policy.deterministic
            if masked:
                _check_mask_indptr(index, kw, inputs)

        if gc.ragged is not None:
            call = gc.ragged
            _check_bind(call)
            kw = _resolved(call, inputs)
            assert gp.ragged is not None
            assert call.wrapper.sink is None  # FlashInfer has no ragged sink kernel
            _check_common(spec, gp, kw, gp.ragged.window_left)
            assert call.wrapper.kind is WrapperKind.RAGGED_PREFILL
            assert call.wrapper.group == group.resolved(heads.head_dim)
            assert call.wrapper.use_tensor_cores is False
            assert call.wrapper.backend == _expected_backend(heads, policy, masked=False, sm90=sm90)
            assert kw["head_dim_qk"] == heads.head_dim
            assert kw["causal"] is group.causal
            assert gp.ragged.causal is group.causal
            assert "packed_custom_mask" not in kw and "page_size" not in kw
            np.testing.assert_array_equal(kw["qo_indptr"], qo_indptr)
            np.testing.assert_array_equal(kw["kv_indptr"], gp.ragged.kv_indptr)
            np.testing.assert_array_equal(kw["kv_indptr"], qo_indptr)
            assert kw.get("disable_split_kv", False) is policy.deterministic

    # Every host array the calls name is in the inputs, and the inputs hold nothing else
    # but the mask recipes' arrays.
    named = {
        v.name
        for gc in calls
        for call in (gc.paged, gc.ragged)
        if call is not None
        for _, v in call.kwargs
        if isinstance(v, (HostArray, StagedArray, DeviceArray))
    }
    extra = {n for n in inputs.host if ".mask." in n}
    items = {
        f"{v.name}.{k}"
        for gc in calls
        for _, v in (gc.paged.kwargs if gc.paged is not None else ())
        if isinstance(v, ItemPositions)
        for k in ("start", "length")
    }
    assert set(inputs.host) == named | extra | items
    _check_staging(spec, translation)
    return calls


def _check_mask_indptr(index: int, kw: dict[str, Any], inputs: CallInputs) -> None:
    """The staged byte offsets of a group's mask (``mask.indptr``, where the mask kernel
    writes each request) are FlashInfer's own, from the call's arrays."""
    want = _compute_page_mask_indptr(
        _t(kw["qo_indptr"]), _t(kw["paged_kv_indptr"]), _t(kw["paged_kv_last_page_len"]),
        kw["page_size"],
    ).numpy()  # fmt: skip
    np.testing.assert_array_equal(inputs.host[f"g{index}.mask.indptr"], want)


def _check_items(spec: PlanSpec, gp: GroupPlan, call: PlanCall, kw: dict[str, Any]) -> None:
    """Multi-item calls carry FlashInfer's four arguments in its exact dtypes (it checks
    none), equal to the plan's tensors; other calls carry none of them."""
    items = gp.items
    present = [name for name in _ITEM_KWARGS if name in kw]
    if items is None:
        assert not present, present
        return
    assert spec.key.multi_item and not gp.group.cross_attention
    assert present == list(_ITEM_KWARGS)
    assert call.wrapper.kind is WrapperKind.PAGED_PREFILL
    assert call.wrapper.backend == "fa2"  # FA2 whatever the policy
    assert "packed_custom_mask" not in kw
    raw = dict(call.kwargs)
    assert raw["prefix_len_ptr"].dtype == "uint32"
    assert raw["max_item_len_ptr"].dtype == "uint16"
    assert isinstance(raw["token_pos_in_items_ptr"], ItemPositions)  # filled on the device
    assert isinstance(raw["token_pos_in_items_len"], BatchInt)
    for name, want in (
        ("prefix_len_ptr", items.prefix_len_ptr),
        ("token_pos_in_items_ptr", items.token_pos_in_items),
        ("max_item_len_ptr", items.max_item_len),
    ):
        got = kw[name]
        assert got.dtype == want.dtype, (name, got.dtype)
        np.testing.assert_array_equal(got, want, err_msg=name)
    assert kw["prefix_len_ptr"].shape == (spec.batch_size,)
    assert kw["max_item_len_ptr"].shape == (spec.batch_size,)
    assert kw["token_pos_in_items_len"] == items.token_pos_in_items_len
    assert isinstance(kw["token_pos_in_items_len"], int)
    assert kw["token_pos_in_items_ptr"].shape == (spec.batch_size * items.token_pos_in_items_len,)
    # The kernel's row of request i starts at i * token_pos_in_items_len (prefill.cuh).
    for i in range(spec.batch_size):
        stride = items.token_pos_in_items_len
        row = kw["token_pos_in_items_ptr"][i * stride : (i + 1) * stride]
        np.testing.assert_array_equal(row, items.rows[i])
    assert kw["causal"] is True  # multi-item mode is causal anyway; plan() sizes work by it


def _check_staging(spec: PlanSpec, translation: Any) -> None:
    """The staging manifest names every array, and the data holds exactly them."""
    rows = np.arange(spec.batch_size, dtype=np.int32)[::-1].copy()
    inputs = translation.inputs
    jobs = gather_jobs(spec, rows, spans=inputs.spans, widths=inputs.widths)
    dplan = device_plan(
        translation.calls,
        jobs,
        inputs.host,
        inputs.masks,
        ints=inputs.ints,
        elements=inputs.elements,
    )
    arrays = {JOBS: jobs.table.reshape(-1)} | dict(inputs.host)
    assert [s.name for s in dplan.manifest.slices] == list(arrays)
    end = 0
    for s in dplan.manifest.slices:
        assert s.offset == end
        end = s.end
        np.testing.assert_array_equal(dplan.data[s.offset : s.end], arrays[s.name])
    assert dplan.manifest.total == max(end, 1) == dplan.data.shape[0]
    # The page ids each paged call gathers are its own span's.
    for index, (_, num) in inputs.spans.items():
        r = jobs.region(pages_region(index))
        width = inputs.widths.get(index)  # an XQA call's dense table: a row per request
        assert r.size == (int(num.sum()) if width is None else width * spec.batch_size)
    # The multi-item tensors come back, bit for bit, from typed views of the staged data.
    for gc in translation.calls:
        items = spec.group_plans[gc.group_index].items
        for name, value in gc.paged.kwargs if gc.paged is not None else ():
            if isinstance(value, StagedArray):
                s = dplan.manifest[value.name]
                got = _staged_view(dplan.data[s.offset : s.end], value, inputs)
                want = {
                    "prefix_len_ptr": items.prefix_len_ptr,
                    "max_item_len_ptr": items.max_item_len,
                }[name]
                assert got.dtype == want.dtype
                np.testing.assert_array_equal(got, want)
                assert dplan.elements[value.name] == want.shape[0]


# --------------------------------------------------------------------------- strategies
_DECODE_BACKENDS = st.sampled_from(("auto", "fa2", "xqa"))
policies = st.builds(
    ExecutorPolicy,
    decode_tensor_cores=st.sampled_from((None, True, False)),
    prefill_backend=st.sampled_from(("auto", "fa2", "fa3")),
    decode_backend=_DECODE_BACKENDS,
) | st.builds(
    ExecutorPolicy,
    decode_tensor_cores=st.sampled_from((None, True)),
    prefill_backend=st.sampled_from(("auto", "fa2")),
    deterministic=st.just(True),
    decode_backend=_DECODE_BACKENDS,
)


@st.composite
def any_layouts(draw: st.DrawFn) -> BatchLayout:
    mode = draw(
        st.sampled_from(
            ("decode", "extend", "extend_prefix", "extend_no_prefix", "verify", "multi_item")
        )
    )
    kw: dict[str, Any] = {"page_sizes": PAGE_SIZES, "max_len": 40, "long_len": 120}
    if mode == "decode":
        return draw(decode_layouts(**kw))
    if mode == "verify":
        return draw(verify_layouts(page_sizes=PAGE_SIZES))
    if mode == "multi_item":
        return draw(multi_item_layouts(page_sizes=PAGE_SIZES))
    prefix = {"extend": None, "extend_prefix": True, "extend_no_prefix": False}[mode]
    return draw(extend_layouts(prefix=prefix, **kw))


@st.composite
def windowed_prefix_layouts(draw: st.DrawFn) -> BatchLayout:
    """Extends with cached prefixes and small windows: the ragged path needs custom masks."""
    sliding = attention_groups(kinds=("sliding",), windows=st.integers(0, 12))
    others = attention_groups(kinds=("full", "sliding", "bidirectional"))
    groups = draw(
        st.lists(st.one_of(sliding, sliding, others), min_size=1, max_size=3, unique=True)
    )
    return draw(
        extend_layouts(
            prefix=True,
            groups=groups,
            encoder=False,
            min_batch=1,
            page_sizes=PAGE_SIZES,
            max_len=40,
            long_len=120,
        )
    )


# --------------------------------------------------------------------------- tests
@settings(max_examples=40)
@given(
    layout=any_layouts(),
    heads=head_configs(head_dims=HEAD_DIMS),
    extend_path=st.sampled_from(PATHS),
    policy=policies,
    sm90=st.booleans(),
    xqa=st.booleans(),
    fp8=st.booleans(),
)
def test_translate_binds_and_matches_plan(
    layout: BatchLayout, heads: HeadConfig, extend_path: str, policy: ExecutorPolicy, sm90: bool,
    xqa: bool, fp8: bool,
) -> None:  # fmt: skip
    """``xqa``: FlashInfer has ``xqa`` and the GPU runs it; ``fp8``: an e4m3 cache."""
    if fp8:  # fp16 / bf16 queries over the e4m3 cache
        q = heads.q_dtype if heads.q_dtype in _FA3_DTYPES else torch.bfloat16
        heads = attrs.evolve(heads, q_dtype=q, out_dtype=q, kv_dtype=torch.float8_e4m3fn)
        extend_path = "paged" if extend_path == "ragged" else extend_path  # ragged: refused
    assume(policy.prefill_backend != "fa3" or _fa3_capable(heads))  # refused: tested below
    if layout.mode is fp.Mode.VERIFY and extend_path == "ragged":
        with pytest.raises(fp.LayoutError):
            fp.plan(layout, heads, extend_path=extend_path)
        return
    if layout.is_multi_item and extend_path == "ragged":
        extend_path = "paged"  # refused for multi-item batches (tests/test_multi_item.py)
    spec = fp.plan(layout, heads, extend_path=extend_path)
    check_translation(spec, policy, sm90=sm90, xqa=xqa)


@st.composite
def _xqa_decode_layouts(draw: st.DrawFn) -> BatchLayout:
    """Decode batches XQA can mostly run: pages of 16, 32 or 128 (now and then 1), full
    and sliding groups with sinks, now and then a soft cap."""
    groups = draw(
        st.lists(
            attention_groups(kinds=("full", "sliding"), sinks=True, soft_cap=draw(st.booleans())),
            min_size=1, max_size=3, unique=True,
        )
    )  # fmt: skip
    return draw(decode_layouts(page_sizes=(1, 16, 16, 32, 128), groups=groups, encoder=False))


@settings(max_examples=40)
@given(
    layout=_xqa_decode_layouts(),
    heads=head_configs(head_dims=(64, 96, 128, 256), dtypes=_FA3_DTYPES),
    policy=st.builds(
        ExecutorPolicy,
        decode_backend=st.sampled_from(("auto", "xqa", "xqa")),
        deterministic=st.booleans(),
    ),
    sm90=st.booleans(),
    fp8=st.booleans(),
)
def test_xqa_translation_of_decodes(
    layout: BatchLayout, heads: HeadConfig, policy: ExecutorPolicy, sm90: bool, fp8: bool
) -> None:
    """Decode batches where XQA is there (``xqa=True``) and mostly able to run them,
    some over an e4m3 cache: each decode call goes to XQA exactly when the policy's rules
    say so, with its dense table and lengths (:func:`_check_xqa_call`), and
    ``decode_backend='xqa'`` refuses a group XQA cannot run (pages of 1, a soft cap)."""
    if fp8:
        heads = attrs.evolve(heads, kv_dtype=torch.float8_e4m3fn)
    spec = fp.plan(layout, heads)
    calls = check_translation(spec, policy, sm90=sm90, xqa=True)
    kinds = {gc.paged.wrapper.kind for gc in calls if gc.paged is not None}
    assert kinds <= {WrapperKind.XQA, WrapperKind.DECODE}


def test_forced_fa3_refuses_heads_it_cannot_run() -> None:
    heads = HeadConfig(4, 2, 96, q_dtype=torch.float16)
    spec = fp.plan(BatchLayout.extend([5, 9], [0, 3], page_size=16), heads, extend_path="paged")
    with pytest.raises(fp.UnsupportedError, match="fa3"):
        translate(spec, ExecutorPolicy(prefill_backend="fa3"), sm90=True)


@settings(max_examples=40)
@given(
    layout=windowed_prefix_layouts(),
    heads=head_configs(head_dims=(64, 128)),
    policy=policies,
    sm90=st.booleans(),
)
def test_ragged_paged_masks_land_where_flashinfer_reads(
    layout: BatchLayout, heads: HeadConfig, policy: ExecutorPolicy, sm90: bool
) -> None:
    assume(policy.prefill_backend != "fa3" or _fa3_capable(heads))
    spec = fp.plan(layout, heads, extend_path="ragged")
    check_translation(spec, policy, sm90=sm90)


@st.composite
def local_group_layouts(draw: st.DrawFn) -> BatchLayout:
    """Decode, extend and verify layouts with a chunked or bidirectional-window group
    (position masks where a chunk starts inside a page or a window has a right bound;
    virtual requests where a chunked extend crosses a chunk boundary), sinks anywhere."""
    local = draw(attention_groups(kinds=LOCAL_GROUP_KINDS, max_window=12, sinks=True))
    other = draw(attention_groups(kinds=("full", "sliding"), max_window=12, sinks=True))
    groups = list(dict.fromkeys([local, other]))
    if draw(st.booleans()) and local.causal:  # a verify (chunk boundaries inside trees)
        return draw(verify_layouts(max_batch=4, max_len=40, long_len=80, groups=groups))
    return draw(
        layouts(max_batch=6, max_len=40, long_len=120, groups=groups, page_sizes=PAGE_SIZES)
    )


@settings(max_examples=60)
@given(
    layout=local_group_layouts(),
    heads=head_configs(head_dims=(64, 128)),
    extend_path=st.sampled_from(PATHS),
    policy=policies,
    sm90=st.booleans(),
)
def test_local_groups_translate_and_masks_land_where_flashinfer_reads(
    layout: BatchLayout, heads: HeadConfig, extend_path: str, policy: ExecutorPolicy, sm90: bool
) -> None:
    """Position masks are built on the device from their staged rows, columns and rule,
    and land where FlashInfer reads them; virtual requests plan over their own rows."""
    assume(policy.prefill_backend != "fa3" or _fa3_capable(heads))
    try:
        spec = fp.plan(layout, heads, extend_path=extend_path)
    except fp.LayoutError as err:  # a verify or a position-masked group on the ragged path
        assert extend_path == "ragged" and err.field == "extend_path"
        return
    check_translation(spec, policy, sm90=sm90)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_masked_call_with_empty_segments(page_size: int) -> None:
    """A fixed batch that always takes the custom-mask path and has every awkward request:
    no prefix (empty paged segment, 7 queries), a long prefix, no token at all, cached
    tokens but nothing new, and a prefix shorter than the window."""
    layout = BatchLayout.extend(
        seq_lens=[7, 40, 0, 9, 12, 30],
        prefix_lens=[0, 33, 0, 9, 3, 20],
        page_size=page_size,
        groups=[fp.AttentionGroup.sliding(4), fp.AttentionGroup.full(logits_soft_cap=30.0)],
    )
    heads = HeadConfig(num_qo_heads=8, num_kv_heads=2, head_dim=128)
    spec = fp.plan(layout, heads, extend_path="ragged")
    gp = spec.group_plans[0]
    assert gp.path is KernelPath.RAGGED_PAGED and gp.uses_custom_mask
    assert gp.paged is not None and gp.paged.kv_lens[0] == 0 and gp.paged.num_pages[0] == 0
    calls = check_translation(spec, ExecutorPolicy(), sm90=True)
    inputs = translate(spec, ExecutorPolicy(), sm90=True).inputs
    kw = _resolved(calls[0].paged, inputs)  # type: ignore[arg-type]
    assert calls[0].paged.wrapper.backend == "fa2"  # type: ignore[union-attr]
    assert calls[0].ragged.wrapper.backend == "fa3"  # type: ignore[union-attr]
    # Fed to flashinfer as planned (0 pages), the empty segment would give a negative
    # mask size and shift every later request; the translation pads it to one page.
    raw = _compute_page_mask_indptr(
        _t(spec.qo_indptr), _t(gp.paged.page_indptr), _t(gp.paged.last_page_len), page_size
    )
    assert int(raw[1]) < 0
    assert int(kw["paged_kv_indptr"][1]) == 1
    assert int(kw["paged_kv_last_page_len"][0]) == 0
    assert calls[0].masked and isinstance(kw["packed_custom_mask"], BuiltMask)


def test_translate_does_not_pack_threshold_masks_on_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """A threshold-row mask is expanded on the device; translate() must not pack it on
    the host too (reading ``ThresholdMask.packed`` would: it packs the whole mask)."""
    layout = BatchLayout.extend(
        seq_lens=[7, 40, 30],
        prefix_lens=[0, 33, 20],
        page_size=16,
        groups=[fp.AttentionGroup.sliding(4)],
    )
    spec = fp.plan(layout, HeadConfig(8, 2, 128), extend_path="ragged")
    assert spec.group_plans[0].paged.mask is not None  # type: ignore[union-attr]

    def no_host_packing(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("translate() packed a threshold mask on the host")

    import flashplan.planning.masks as masks_module  # a module import (no sys.modules detour)

    monkeypatch.setattr(masks_module, "pack_threshold_rows", no_host_packing)
    (gc,) = translate(spec, ExecutorPolicy(), sm90=True).calls
    assert gc.masked


def test_flashinfer_mask_offsets_still_count_bits() -> None:
    """Canary for the flashinfer bug that flashinfer_mask_layout works around.

    flashinfer 0.7.4: mask offsets are ``cumsum(qo_len * ((pages - 1) * page_size +
    last_page_len))`` — bits, unclamped. If this fails, flashinfer changed the function
    (e.g. PR #2201 landed): flashinfer_mask_layout and _gather_for must follow.
    """
    qo = torch.tensor([0, 3, 5, 9], dtype=torch.int32)
    kv_indptr = torch.tensor([0, 2, 3, 3], dtype=torch.int32)
    last = torch.tensor([3, 5, 0], dtype=torch.int32)
    got = _compute_page_mask_indptr(qo, kv_indptr, last, 16).tolist()
    # 3 * (16 + 3) = 57 bits, 2 * 5 = 10 bits, 4 * (-16 + 0) = -64 for zero pages.
    assert got == [0, 57, 67, 3], (
        f"flashinfer._compute_page_mask_indptr changed: {got}; revisit flashinfer_mask_layout"
    )


def test_decode_plan_signature_is_forwarded_to_plan_impl() -> None:
    """Binding decode calls against ``_plan_impl`` is only meaningful while the public
    ``plan`` forwards to it with the same leading parameters."""
    cls = flashinfer.BatchDecodeWithPagedKVCacheWrapper
    public = list(inspect.signature(cls.plan).parameters.values())
    impl = list(inspect.signature(cls._plan_impl).parameters)
    assert public[-1].kind is inspect.Parameter.VAR_KEYWORD
    leading = [p.name for p in public if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert impl[: len(leading)] == leading
    assert "_plan_impl" in inspect.getsource(cls.plan)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("sm90", [False, True])
@pytest.mark.parametrize("choice", ["auto", "fa2", "fa3"])
@pytest.mark.parametrize(
    ("q_dtype", "kv_dtype", "head_dim"),
    [
        (torch.bfloat16, torch.bfloat16, 128),
        (torch.float16, torch.float16, 64),
        (torch.float16, torch.float16, 256),
        (torch.bfloat16, torch.bfloat16, 96),
        (torch.float32, torch.float32, 128),
        (torch.float16, torch.bfloat16, 128),
    ],
)
def test_prefill_backend_rules(
    masked: bool,
    sm90: bool,
    choice: str,
    q_dtype: torch.dtype,
    kv_dtype: torch.dtype,
    head_dim: int,
) -> None:
    heads = HeadConfig(4, 2, head_dim, q_dtype=q_dtype, kv_dtype=kv_dtype)
    policy = ExecutorPolicy(prefill_backend=choice)
    if choice == "fa3" and not masked and not _fa3_capable(heads):
        with pytest.raises(fp.UnsupportedError):
            prefill_backend(heads, policy, custom_mask=masked, sm90=sm90)
        return
    got = prefill_backend(heads, policy, custom_mask=masked, sm90=sm90)
    if masked:
        want = "fa2"
    elif choice != "auto":
        want = choice
    else:
        fa3 = sm90 and q_dtype == kv_dtype and q_dtype != torch.float32 and head_dim != 96
        want = "fa3" if fa3 else "fa2"
    assert got == want


@pytest.mark.parametrize("override", [None, True, False])
@pytest.mark.parametrize("batch_size", [1, TENSOR_CORE_MIN_BATCH - 1, TENSOR_CORE_MIN_BATCH, 16])
def test_decode_tensor_cores_override(override: bool | None, batch_size: int) -> None:
    heads = HeadConfig(32, 8, 128)
    policy = ExecutorPolicy(decode_tensor_cores=override)
    got = decode_uses_tensor_cores(heads, policy, batch_size)
    assert got is (batch_size >= TENSOR_CORE_MIN_BATCH if override is None else override)
    layout = BatchLayout.decode(([5, 17, 1, 40] * 4)[:batch_size], page_size=16)
    (gc,) = translate(fp.plan(layout, heads), policy, sm90=True).calls
    assert gc.paged is not None and gc.paged.wrapper.kind is WrapperKind.DECODE
    assert gc.paged.wrapper.use_tensor_cores is got
    assert gc.paged.wrapper.constructor_kwargs()["use_tensor_cores"] is got


def test_skeleton_is_static_and_cached_by_its_key() -> None:
    """Two batches with one skeleton key get equal skeletons; the graph's batch size
    overrides the one that picks the decode kernel."""
    heads = HeadConfig(32, 8, 128)
    policy = ExecutorPolicy()
    a = fp.plan(BatchLayout.decode([5, 17, 1, 40, 9], page_size=16), heads)
    b = fp.plan(BatchLayout.decode([3, 2, 100, 7, 7], page_size=16), heads)
    assert skeleton_key(a, policy) == skeleton_key(b, policy)
    assert call_skeleton(a, policy, sm90=True) == call_skeleton(b, policy, sm90=True)
    small = fp.plan(BatchLayout.decode([5], page_size=16), heads)
    (gc,) = call_skeleton(small, policy, sm90=True)
    assert gc.paged is not None and not gc.paged.wrapper.use_tensor_cores
    (gc,) = call_skeleton(small, policy, sm90=True, batch_size=64)
    assert gc.paged is not None and gc.paged.wrapper.use_tensor_cores


def test_deterministic_policy() -> None:
    with pytest.raises(fp.OptionError) as err:
        ExecutorPolicy(deterministic=True, decode_tensor_cores=False)
    assert err.value.field == "decode_tensor_cores"
    with pytest.raises(fp.OptionTypeError) as err:  # also a TypeError
        ExecutorPolicy(deterministic="yes")  # type: ignore[arg-type]
    assert err.value.field == "deterministic" and isinstance(err.value, TypeError)
    with pytest.raises(fp.OptionError) as err:
        ExecutorPolicy(prefill_backend="fa4")
    assert err.value.field == "prefill_backend" and not isinstance(err.value, fp.LayoutError)
    heads = HeadConfig(32, 8, 128)
    policy = ExecutorPolicy(deterministic=True)
    for bs in (1, 2, 64):
        assert decode_uses_tensor_cores(heads, policy, bs)


# --------------------------------------------------------------------------- multi-item
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("policy", [ExecutorPolicy(), ExecutorPolicy(prefill_backend="fa3")])
def test_multi_item_call(page_size: int, policy: ExecutorPolicy) -> None:
    """The reference file's batch beside a plain request (first, which the reference
    file would drop from prefix_len_ptr) and a cross group: the multi-item arguments
    bind to FlashInfer's paged plan(), in its dtypes, on FA2 even when FA3 is forced."""
    layout = BatchLayout.extend(
        [5, 9, 12, 14],
        [2, 0, 0, 3],
        page_size=page_size,
        groups=(fp.AttentionGroup.full(logits_soft_cap=30.0), fp.AttentionGroup.cross()),
        encoder_lens=[3, 0, 17, 1],
        item_delimiters=[None, [3, 6, 8], [2, 4, 8, 11], [0, 1, 2, 3, 4]],
    )
    heads = HeadConfig(8, 2, 128, q_dtype=torch.bfloat16)
    spec = fp.plan(layout, heads)
    calls = check_translation(spec, policy, sm90=True)
    gc_self, gc_cross = calls
    assert gc_self.paged is not None and gc_cross.paged is not None
    kw = gc_self.paged.as_dict()
    assert isinstance(kw["prefix_len_ptr"], StagedArray)
    assert not any(name in gc_cross.paged.as_dict() for name in _ITEM_KWARGS)
    inputs = translate(spec, policy, sm90=True).inputs
    resolved = _resolved(gc_self.paged, inputs)
    assert resolved["prefix_len_ptr"].tolist() == [5, 3, 2, 3]  # the plain request: seq_len
    assert resolved["max_item_len_ptr"].tolist() == [0, 2, 3, 6]
    assert resolved["token_pos_in_items_len"] == 11
    # 4 uint16 = 2 int32 words; 4 uint32 = 4 words
    words = {
        name: inputs.host[v.name].shape[0] for name, v in kw.items() if isinstance(v, StagedArray)
    }
    assert words == {"prefix_len_ptr": 4, "max_item_len_ptr": 2}
    # token_pos_in_items (4 x 11 entries) travels as its 6 non-empty items, 2 words each
    tpos = kw["token_pos_in_items_ptr"]
    assert isinstance(tpos, ItemPositions)
    assert inputs.host[f"{tpos.name}.length"].tolist() == [2, 1, 1, 3, 2, 6]
    assert inputs.host[f"{tpos.name}.start"].tolist() == [12, 15, 23, 25, 29, 38]
    assert inputs.ints[f"{tpos.name}.size"] == 44 and inputs.ints[f"{tpos.name}.longest"] == 6


def test_multi_item_skeleton_key() -> None:
    """Whether a batch is multi-item is part of the skeleton key; its lengths are not."""
    heads = HeadConfig(8, 2, 128)
    policy = ExecutorPolicy()
    a = fp.plan(BatchLayout.extend([14, 5], item_delimiters=[[7, 9], None]), heads)
    b = fp.plan(BatchLayout.extend([30, 9], [0, 4], item_delimiters=[None, [1, 2]]), heads)
    plain = fp.plan(BatchLayout.extend([14, 5], [1, 0]), heads)
    assert skeleton_key(a, policy) == skeleton_key(b, policy) != skeleton_key(plain, policy)
    assert call_skeleton(a, policy, sm90=False) == call_skeleton(b, policy, sm90=False)


def test_int32_words_round_trip() -> None:
    from flashplan.executor.flashinfer.calls import int32_words

    for values in (
        np.array([0, 1, 65535, 7, 9], np.uint16),
        np.array([0, 1, 2, 3], np.uint16),
        np.array([], np.uint16),
        np.array([0, 2**32 - 1, 5], np.uint32),
    ):
        values.flags.writeable = False
        words = int32_words(values)
        assert words.dtype == np.int32 and not words.flags.writeable
        assert words.nbytes >= values.nbytes and words.nbytes - values.nbytes < 4
        back = words.view(values.dtype)[: values.shape[0]]
        np.testing.assert_array_equal(back, values)
        # the same bytes through torch, as the executor views the device copy
        staged = torch.zeros(words.shape[0] + 3, dtype=torch.int32)  # a buffer, as on the device
        staged[1 : 1 + words.shape[0]] = torch.from_numpy(words.copy())
        t = staged[1 : 1 + words.shape[0]].view(
            torch.uint16 if values.dtype == np.uint16 else torch.uint32
        )
        assert t[: values.shape[0]].tolist() == values.tolist()


def test_graph_buckets_refuse_multi_item() -> None:
    from flashplan.errors import BucketError
    from flashplan.executor.flashinfer.bucket import GraphBucket, check_fits

    spec = fp.plan(BatchLayout.extend([4, 4], item_delimiters=[[1], None]), HeadConfig(8, 2, 128))
    with pytest.raises(BucketError) as err:
        check_fits(spec, GraphBucket.extend(2, 4, 4))
    assert err.value.field == "item_delimiters"
