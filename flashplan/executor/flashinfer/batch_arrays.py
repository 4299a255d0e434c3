"""The batch's arrays behind a call skeleton's placeholders (:func:`call_inputs`):
indptrs, last-page lengths, scheduler KV lengths, mask recipes and multi-item tensors,
host-only and pure; what the executor stages for one batch."""

from __future__ import annotations

import functools

import numpy as np
import numpy.typing as npt

import flashplan.executor.flashinfer.names as names
from flashplan.arrays import (
    INT32_MAX,
    IntArray,
    constant_operand,
    indptr,
    running_sum,
    seal_inplace,
    zeros,
)
from flashplan.errors import UnsupportedError
from flashplan.executor.flashinfer.call_types import (
    BatchInt,
    CallInputs,
    GroupCalls,
    ItemPositions,
    MaskRecipe,
)
from flashplan.planning.cascade import CascadePlan
from flashplan.planning.masks import CustomMask, PositionMask, TreeMask
from flashplan.planning.spec import KernelPath, PagedPart, PlanSpec

__all__ = [
    "CUSTOM_MASK_FIELDS",
    "bytes_as_int32",
    "call_inputs",
    "custom_mask_arrays",
    "decode_scheduler_kv_lens",
    "flashinfer_mask_offsets",
    "int32_words",
]


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
    host: dict[str, IntArray] = {names.QO_INDPTR: spec.qo_indptr} if uses_qo or tc_decode else {}
    spans: dict[int, tuple[IntArray, IntArray]] = {}
    masks: dict[int, MaskRecipe] = {}
    ints: dict[str, int] = {}
    if uses_qo:
        ints[names.batch_int("qo.total")] = spec.total_q
        ints[names.batch_int("qo.max_len")] = spec.max_q_len
    elements: dict[str, int] = {}
    cascade = spec.cascade
    for gc in calls:
        gp = spec.group_plans[gc.group_index]
        index = gc.group_index
        if gp.virtual is not None:  # the kernels run over the virtual requests' rows
            vq = gp.virtual.queries
            host[names.group_array(index, "qo_indptr")] = vq.indptr
            ints[names.group_int(index, "qo.total")] = vq.total
            ints[names.group_int(index, "qo.max_len")] = vq.max_len
        # a group on cascade levels: its paged call reads each request's own keys
        part = cascade.own_call(index) if gc.levels and cascade is not None else gp.paged
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
        host[names.group_array(index, "page_indptr")] = page_indptr
        host[names.group_array(index, "last_page_len")] = call.last_page_len
        if gc.path is not KernelPath.DECODE:
            # What FlashInfer's prefill plan() derives on the host (a re-plan without it:
            # adapter.replan_prefill): the KV lengths its get_seq_lens computes,
            # max(pages - 1, 0) * page_size + last_page_len, are the part's own (an empty
            # span has last_page_len 0 and at most one page), and the longest.
            host[names.group_array(index, "kv_lens")] = call.kv_lens
            ints[names.group_int(index, "max_kv_len")] = call.max_kv_len
        elif gc.paged is not None and gc.paged.wrapper.use_tensor_cores:
            host[names.group_array(index, "kv_lens")] = decode_scheduler_kv_lens(part)
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
                    host[names.item_part(value.name, "start")] = items.item_start
                    host[names.item_part(value.name, "length")] = items.item_length
                    ints[names.item_part(value.name, "size")] = (
                        items.batch_size * items.token_pos_in_items_len
                    )
                    ints[names.item_part(value.name, "longest")] = items.max_length
                    continue
                arr: npt.NDArray[np.unsignedinteger] = getattr(items, _ITEM_ARRAYS[name])
                host[value.name] = int32_words(arr)
                elements[value.name] = int(arr.shape[0])
    level_spans: tuple[tuple[IntArray, IntArray], ...] = ()
    if cascade is not None and any(gc.levels for gc in calls):
        level_spans = _level_inputs(cascade.levels, spec.total_q, host, ints)
    return CallInputs(host, spans, masks, ints, elements, level_spans)


def _level_inputs(
    plan: CascadePlan, total_q: int, host: dict[str, IntArray], ints: dict[str, int]
) -> tuple[tuple[IntArray, IntArray], ...]:
    """Every cascade level's arrays into ``host`` and ``ints`` (``l<k>.*``); returns
    each level's ``(start_page, num_pages)`` per request for the gather: a group's
    shared pages at its first member's row, nothing at the other rows."""
    out = []
    for k, level in enumerate(plan.levels):
        spans = level.spans
        host[names.level_array(k, "qo_indptr")] = level.qo_indptr
        host[names.level_array(k, "page_indptr")] = spans.pages.indptr
        host[names.level_array(k, "last_page_len")] = spans.last_page_len
        host[names.level_array(k, "kv_lens")] = spans.kv_lens
        if level.leaves_rows_out(total_q):  # gathered by its rows
            host[names.level_array(k, "q_rows")] = level.q_rows
        ints[names.level_int(k, "qo.total")] = int(level.qo_indptr[-1])
        ints[names.level_int(k, "qo.max_len")] = level.max_queries
        ints[names.level_int(k, "max_kv_len")] = spans.max_kv_len
        out.append((level.row_start_page, level.row_pages))
    return tuple(out)


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


#: A custom (threshold or tree) mask's staged arrays, in staging order
#: (``g<index>.mask.<field>``); a threshold mask stages the first four.
CUSTOM_MASK_FIELDS: tuple[names.MaskField, ...] = (
    "qo_lens", "kv_lens", "indptr", "first_visible", "row_offsets", "tail_start", "tail_words",
)  # fmt: skip


def _mask_offsets(mask: CustomMask | PositionMask) -> tuple[IntArray, int, int]:
    """``mask``'s :func:`flashinfer_mask_offsets` as sealed int32 ``[bs + 1]``, its total
    bits and its largest request's bytes.

    Raises:
        UnsupportedError: a mask too large for the mask kernel's int32 offsets.
    """
    sizes = np.multiply(mask.qo_lens, mask.kv_lens, dtype=np.int64)  # bits per request
    offsets = running_sum(sizes)
    total = int(offsets[-1])
    if total > INT32_MAX - 8:  # the mask kernel's int32 element indices
        raise UnsupportedError(
            "extend_path", "a custom mask of this many elements exceeds int32 offsets: plan "
            "this batch with extend_path='paged'", mask_elements=total,
        )  # fmt: skip
    max_bytes = (int(np.maximum.reduce(sizes)) + 7) // 8 if total else 0
    return seal_inplace(offsets), total, max_bytes  # int32: the total fits (checked above)


def custom_mask_arrays(mask: CustomMask) -> tuple[list[IntArray], MaskRecipe]:
    """A threshold or tree mask's staged int32 arrays, in :data:`CUSTOM_MASK_FIELDS`
    order (a threshold mask's first four), and its :class:`MaskRecipe`. ``indptr`` is
    :func:`flashinfer_mask_offsets`: FlashInfer's ``mask_indptr``, whose first ``bs``
    entries are also where the mask kernel writes each request's bytes.

    Raises:
        UnsupportedError: a mask too large for the mask kernel's int32 offsets.
    """
    offsets, total, max_bytes = _mask_offsets(mask)
    first = mask.first_visible
    bs = first.shape[0]
    if first is zeros((bs,), "int64"):  # the planner's shared zeros (a whole-row tree)
        first32 = zeros((bs,), "int32")
    else:
        # the int32 staging copy must not wrap a far-off threshold: clamped, then cast
        # (the ufuncs themselves: np.clip's Python wrapper costs more than both)
        first = np.maximum(first, constant_operand(-INT32_MAX, np.int64))
        np.minimum(first, constant_operand(INT32_MAX, np.int64), out=first)
        first32 = seal_inplace(first)
    arrays = [mask.qo_lens, mask.kv_lens, offsets, first32]
    if not isinstance(mask, TreeMask):
        return arrays, MaskRecipe(max_bytes=max_bytes, total_bytes=max(total, 1))
    arrays += [
        mask.row_offsets.reshape(-1),  # read-only int32, C order
        seal_inplace(mask.tail_start),  # in [0, kv_len]
        # the rows' packed bits (a view of the mask's own: a tree's, preset by the planner)
        bytes_as_int32(mask.tail_words.reshape(-1)),
    ]
    n = int(mask.row_offsets.shape[1])
    return arrays, MaskRecipe(max_bytes=max_bytes, total_bytes=max(total, 1), num_tokens=n)


def _mask_recipe(
    index: int, mask: CustomMask | PositionMask, host: dict[str, IntArray]
) -> MaskRecipe:
    """Group ``index``'s mask as int32 arrays in ``host`` (``g<index>.mask.*``) and its
    sizes (:func:`custom_mask_arrays`; a position mask's own arrays)."""
    name = functools.partial(names.mask_name, index)
    if not isinstance(mask, PositionMask):
        arrays, recipe = custom_mask_arrays(mask)
        for field, values in zip(CUSTOM_MASK_FIELDS, arrays, strict=False):
            host[name(field)] = values
        return recipe
    offsets, total, max_bytes = _mask_offsets(mask)
    host[name("qo_lens")] = mask.qo_lens
    host[name("kv_lens")] = mask.kv_lens
    host[name("indptr")] = offsets
    # positions fit int32 (the layout checks its lengths); a bound beyond any
    # position is no bound, so the rule is capped at int32 too
    host[name("row_position")] = seal_inplace(mask.row_position)
    host[name("col_position")] = seal_inplace(mask.col_position)
    rule = np.array([mask.causal, mask.window_left, mask.window_right, mask.chunk], dtype=np.int64)
    host[name("rule")] = seal_inplace(np.minimum(rule, INT32_MAX))
    return MaskRecipe(max_bytes, max(total, 1), position=True)
