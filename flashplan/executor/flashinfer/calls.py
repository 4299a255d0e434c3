"""Frozen descriptions of FlashInfer calls, and the pure PlanSpec -> calls translation.

:func:`translate` turns a plan into one :class:`GroupCalls` per group: which
wrapper kinds to use and every argument of their ``plan()`` calls. Nothing here
touches a device or constructs a wrapper, so it runs (and is tested against the
installed flashinfer's signatures) on a CPU-only machine. Array arguments are
placeholders: :class:`HostArray` (a host array of the plan, handed to ``plan()``
as a pinned CPU tensor) and :class:`GatheredIndices` (the page ids the executor
gathers on the device).
"""

from __future__ import annotations

import enum
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from flashplan.errors import UnsupportedError
from flashplan.executor.flashinfer.policy import (
    ExecutorPolicy,
    decode_uses_tensor_cores,
    prefill_backend,
)
from flashplan.layout.arrays import cumsum0, frozen_array
from flashplan.layout.group import AttentionGroup
from flashplan.plan.spec import GroupPlan, KernelPath, PlanSpec

__all__ = [
    "BuiltMask",
    "DeviceMask",
    "GatheredIndices",
    "GroupCalls",
    "HostArray",
    "PageGather",
    "PlanCall",
    "WrapperKey",
    "WrapperKind",
    "flashinfer_mask_layout",
    "flashinfer_mask_offsets",
    "host_arrays",
    "translate",
]


class WrapperKind(enum.Enum):
    """The FlashInfer wrapper class a call goes to."""

    DECODE = "BatchDecodeWithPagedKVCacheWrapper"
    PAGED_PREFILL = "BatchPrefillWithPagedKVCacheWrapper"
    RAGGED_PREFILL = "BatchPrefillWithRaggedKVCacheWrapper"


@attrs.frozen
class WrapperKey:
    """Identifies one wrapper instance: kind, group and construction options.

    Each group has its own wrappers because the window, soft cap, scale and
    causal flag are compiled in at ``plan()`` time.
    """

    kind: WrapperKind
    group: AttentionGroup
    backend: str  # "fa2" / "fa3"; decode wrappers always "fa2" (never auto-routed)
    use_tensor_cores: bool  # decode only; False for prefill wrappers

    def constructor_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the wrapper's ``__init__`` besides the workspace."""
        kwargs: dict[str, Any] = {"kv_layout": "NHD", "backend": self.backend}
        if self.kind is WrapperKind.DECODE:
            kwargs["use_tensor_cores"] = self.use_tensor_cores
        return kwargs


@attrs.frozen(eq=False)
class HostArray:
    """A host array of the plan passed to ``plan()`` as a pinned CPU tensor.

    Attributes:
        name: what it is (``"qo_indptr"``, ``"page_indptr"`` …), for messages.
        values: int32 or uint8 read-only numpy array.
    """

    name: str
    values: npt.NDArray[Any]


@attrs.frozen
class GatheredIndices:
    """The flat page ids (FlashInfer's ``kv_indices``) of a group's paged call,
    gathered on the device from the page table."""

    group_index: int


@attrs.frozen(eq=False)
class PlanCall:
    """One ``wrapper.plan(**kwargs)`` call (every argument passed by keyword)."""

    wrapper: WrapperKey
    kwargs: tuple[tuple[str, Any], ...]

    def as_dict(self) -> dict[str, Any]:
        """The keyword arguments, placeholders unresolved."""
        return dict(self.kwargs)


@attrs.frozen
class BuiltMask:
    """Placeholder: the packed custom mask the executor builds on the device for a
    group (from :class:`DeviceMask`)."""

    group_index: int


@attrs.frozen(eq=False)
class DeviceMask:
    """A threshold-row custom mask to expand on the device, in FlashInfer's layout.

    Attributes:
        first_visible: int32 ``[bs]`` (columns) row 0's first visible column.
        qo_lens, kv_lens: int32 ``[bs]`` (tokens).
        byte_offsets: int32 ``[bs]`` (bytes) where flashinfer reads request i's
            mask (:func:`flashinfer_mask_offsets`).
        max_bytes: largest per-request packed size (bytes).
        total_bytes: size of the buffer to allocate (bytes).
    """

    first_visible: npt.NDArray[np.int32]
    qo_lens: npt.NDArray[np.int32]
    kv_lens: npt.NDArray[np.int32]
    byte_offsets: npt.NDArray[np.int32]
    max_bytes: int
    total_bytes: int


@attrs.frozen(eq=False)
class PageGather:
    """What the executor gathers from the page table for one paged call.

    Attributes:
        start_page: int32 ``[bs]`` (pages) first column read in each request's row.
        num_pages: int32 ``[bs]`` (pages).
        page_indptr: int32 ``[bs + 1]`` (pages) offsets into the gathered ``kv_indices``.
        total_pages: ``page_indptr[-1]``.
    """

    start_page: npt.NDArray[np.int32]
    num_pages: npt.NDArray[np.int32]
    page_indptr: npt.NDArray[np.int32]
    total_pages: int


@attrs.frozen(eq=False)
class GroupCalls:
    """Every FlashInfer call of one group.

    Attributes:
        group_index: position of the group in ``spec.group_plans``.
        path: kernel path of the group.
        paged: the paged wrapper's plan call (decode or paged prefill), if any.
        ragged: the ragged prefill wrapper's plan call, if any.
        gather: the page gather feeding the paged call, if any.
        device_mask: the custom mask to build on the device, if any.
    """

    group_index: int
    path: KernelPath
    paged: PlanCall | None
    ragged: PlanCall | None
    gather: PageGather | None
    device_mask: DeviceMask | None = None

    @property
    def merges(self) -> bool:
        """Whether the group's two partial states are merged (ragged + paged)."""
        return self.paged is not None and self.ragged is not None


def translate(spec: PlanSpec, policy: ExecutorPolicy, *, sm90: bool) -> tuple[GroupCalls, ...]:
    """Describe every FlashInfer ``plan()`` call of ``spec``; pure and host-only.

    Args:
        spec: the plan.
        policy: kernel choices (:class:`ExecutorPolicy`).
        sm90: whether the target GPU is Hopper (enables FA3 under ``"auto"``).
    """
    return tuple(
        _group_calls(spec, index, gp, policy, sm90) for index, gp in enumerate(spec.group_plans)
    )


def _common(spec: PlanSpec, gp: GroupPlan) -> list[tuple[str, Any]]:
    heads = spec.heads
    group = gp.group
    return [
        ("num_qo_heads", heads.num_qo_heads),
        ("num_kv_heads", heads.num_kv_heads),
        ("window_left", gp.window_left),
        ("logits_soft_cap", float(group.logits_soft_cap)),
        ("sm_scale", group.scale_for(heads.head_dim)),
        ("q_data_type", heads.q_dtype),
        ("kv_data_type", heads.kv_dtype),
        ("o_data_type", heads.out_dtype),
        ("non_blocking", True),
    ]


def _group_calls(
    spec: PlanSpec, index: int, gp: GroupPlan, policy: ExecutorPolicy, sm90: bool
) -> GroupCalls:
    heads = spec.heads
    paged_call = ragged_call = None
    gather = None
    device_mask = None
    if gp.paged is not None:
        p = gp.paged
        masked = p.mask is not None
        gather = _gather_for(p.start_page, p.num_pages, p.kv_lens, masked=masked)
        last_page_len = p.last_page_len
        paged_args: list[tuple[str, Any]] = []
        if gp.path is KernelPath.DECODE:
            key = WrapperKey(
                WrapperKind.DECODE,
                gp.group,
                "fa2",
                decode_uses_tensor_cores(heads, policy, spec.batch_size),
            )
            paged_args += [
                ("indptr", HostArray("page_indptr", gather.page_indptr)),
                ("indices", GatheredIndices(index)),
                ("last_page_len", HostArray("last_page_len", last_page_len)),
                ("head_dim", heads.head_dim),
                ("page_size", spec.page_size),
            ]
        else:
            backend = prefill_backend(heads, policy, custom_mask=masked, sm90=sm90)
            key = WrapperKey(WrapperKind.PAGED_PREFILL, gp.group, backend, False)
            paged_args += [
                ("qo_indptr", HostArray("qo_indptr", spec.qo_indptr)),
                ("paged_kv_indptr", HostArray("page_indptr", gather.page_indptr)),
                ("paged_kv_indices", GatheredIndices(index)),
                ("paged_kv_last_page_len", HostArray("last_page_len", last_page_len)),
                ("head_dim_qk", heads.head_dim),
                ("page_size", spec.page_size),
                ("causal", p.causal),
            ]
            if p.mask is not None and p.mask.first_visible is not None:
                device_mask = _device_mask(p.mask.first_visible, np.diff(spec.qo_indptr), p.kv_lens)
                paged_args.append(("packed_custom_mask", BuiltMask(index)))
            elif p.mask is not None:
                laid_out = flashinfer_mask_layout(
                    p.mask.packed, p.mask.indptr, np.diff(spec.qo_indptr), p.kv_lens
                )
                paged_args.append(("packed_custom_mask", HostArray("packed_mask", laid_out)))
        paged_call = PlanCall(key, tuple(paged_args + _common(spec, gp)))
    if gp.ragged is not None:
        r = gp.ragged
        backend = prefill_backend(heads, policy, custom_mask=False, sm90=sm90)
        key = WrapperKey(WrapperKind.RAGGED_PREFILL, gp.group, backend, False)
        ragged_args: list[tuple[str, Any]] = [
            ("qo_indptr", HostArray("qo_indptr", spec.qo_indptr)),
            ("kv_indptr", HostArray("kv_indptr", r.kv_indptr)),
            ("head_dim_qk", heads.head_dim),
            ("causal", r.causal),
        ]
        ragged_call = PlanCall(key, tuple(ragged_args + _common(spec, gp)))
    return GroupCalls(
        group_index=index,
        path=gp.path,
        paged=paged_call,
        ragged=ragged_call,
        gather=gather,
        device_mask=device_mask,
    )


def flashinfer_mask_offsets(
    qo_lens: npt.NDArray[np.int32], kv_lens: npt.NDArray[np.int32]
) -> npt.NDArray[np.int64]:
    """Byte offset at which flashinfer 0.7.4's kernel reads each request's packed mask.

    ``plan()`` computes them as the running sum of ``qo_len * kv_len`` (a bit
    count) and the kernel adds them to a byte pointer — see
    :func:`flashinfer_mask_layout`. Returns int64 ``[bs + 1]``.
    """
    bits = qo_lens.astype(np.int64) * kv_lens.astype(np.int64)
    return np.concatenate([[0], np.cumsum(bits)])


def _device_mask(
    first_visible: npt.NDArray[np.int64],
    qo_lens: npt.NDArray[np.int32],
    kv_lens: npt.NDArray[np.int32],
) -> DeviceMask:
    offsets = flashinfer_mask_offsets(qo_lens, kv_lens)
    if offsets[-1] > np.iinfo(np.int32).max:
        raise UnsupportedError(
            f"custom mask of {int(offsets[-1])} elements exceeds int32 offsets; "
            "plan this batch with extend_path='paged'"
        )
    n_bytes = (qo_lens.astype(np.int64) * kv_lens + 7) // 8
    lo, hi = -np.int64(2**31 - 1), np.int64(2**31 - 1)
    return DeviceMask(
        first_visible=frozen_array(np.clip(first_visible, lo, hi)),
        qo_lens=qo_lens,
        kv_lens=kv_lens,
        byte_offsets=frozen_array(offsets[:-1]),
        max_bytes=int(n_bytes.max()) if n_bytes.size else 0,
        total_bytes=max(int(offsets[-1]), 1),
    )


def _gather_for(
    start_page: npt.NDArray[np.int32],
    num_pages: npt.NDArray[np.int32],
    kv_lens: npt.NDArray[np.int32],
    *,
    masked: bool,
) -> PageGather:
    """The page gather of a paged call.

    With a custom mask, an empty segment is given one (unread) page and
    ``last_page_len = 0``: flashinfer 0.7.4 sizes each request's mask as
    ``qo_len * ((pages - 1) * page_size + last_page_len)`` without clamping, so
    zero pages would give a negative size and shift every later request's mask.
    The kernel still sees ``kv_len = 0`` (FlashInfer clamps there).
    """
    if masked:
        empty = kv_lens == 0
        if np.any(empty):
            start_page = frozen_array(np.where(empty, 0, start_page))
            num_pages = frozen_array(np.where(empty, 1, num_pages))
    page_indptr = cumsum0(num_pages)
    return PageGather(
        start_page=start_page,
        num_pages=num_pages,
        page_indptr=page_indptr,
        total_pages=int(page_indptr[-1]),
    )


def flashinfer_mask_layout(
    packed: npt.NDArray[np.uint8],
    mask_indptr: npt.NDArray[np.int32],
    qo_lens: npt.NDArray[np.int32],
    kv_lens: npt.NDArray[np.int32],
) -> npt.NDArray[np.uint8]:
    """Place each request's packed mask where flashinfer 0.7.4's kernel reads it.

    Given ``packed_custom_mask``, flashinfer 0.7.4's ``plan()`` computes the mask
    offsets as the running sum of ``qo_len * kv_len`` — a count of *bits* — and
    its kernel adds them to a *byte* pointer (known bug, flashinfer PR #2201). So
    request ``i``'s bytes must start at byte ``sum_{r<i} qo_r * kv_r``. This
    returns a uint8 buffer of that size (one byte per mask element, like an
    unpacked mask) holding the plan's compact, byte-aligned packed bytes at those
    offsets; requests' gaps are zero.

    Args:
        packed: uint8 ``[mask_indptr[-1]]`` compact packed mask (DESIGN layout).
        mask_indptr: int32 ``[bs + 1]`` (bytes) of ``packed``.
        qo_lens, kv_lens: int32 ``[bs]`` (tokens) rows and columns per request.
    """
    bit_offsets = flashinfer_mask_offsets(qo_lens, kv_lens)
    nbytes = (mask_indptr[1:].astype(np.int64) - mask_indptr[:-1]).astype(np.int64)
    req = np.repeat(np.arange(nbytes.shape[0]), nbytes)
    dest = bit_offsets[req] + np.arange(req.shape[0]) - mask_indptr[:-1].astype(np.int64)[req]
    out = np.zeros(max(int(bit_offsets[-1]), 1), dtype=np.uint8)
    out[dest] = packed
    out.flags.writeable = False
    return out


def host_arrays(calls: tuple[GroupCalls, ...]) -> list[HostArray]:
    """Every distinct :class:`HostArray` the calls reference (by identity), in order."""
    seen: dict[int, HostArray] = {}
    for gc in calls:
        for call in (gc.paged, gc.ragged):
            if call is None:
                continue
            for _, value in call.kwargs:
                if isinstance(value, HostArray) and id(value.values) not in seen:
                    seen[id(value.values)] = value
    return list(seen.values())
