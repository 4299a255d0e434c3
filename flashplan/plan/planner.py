"""`plan(layout, heads) -> PlanSpec`: pure, host-only, vectorized over the batch."""

from __future__ import annotations

import numpy as np

from flashplan.errors import UnsupportedError
from flashplan.layout.arrays import IntArray, cumsum0, sealed
from flashplan.layout.batch import BatchLayout, Mode
from flashplan.layout.group import AttentionGroup
from flashplan.layout.heads import HeadConfig
from flashplan.plan.masks import CustomMask
from flashplan.plan.pages import PagedSegments, paged_segments
from flashplan.plan.policy import default_extend_path
from flashplan.plan.spec import (
    ExtendPath,
    GroupPlan,
    KernelPath,
    PagedPart,
    PlanKey,
    PlanSpec,
    RaggedPart,
)

__all__ = ["plan"]


def plan(
    layout: BatchLayout,
    heads: HeadConfig,
    *,
    extend_path: ExtendPath | str = ExtendPath.AUTO,
) -> PlanSpec:
    """Plan every attention group of ``layout`` for the given heads.

    Pure and host-only: reads nothing from any device and has no side effect.

    Args:
        layout: the batch.
        heads: head counts and dtypes (part of the plan's static key).
        extend_path: for extend batches, ``"paged"`` (one paged prefill over
            prefix + new tokens), ``"ragged"`` (ragged prefill over the new tokens,
            plus a paged prefill over the prefix merged in when any request has
            one) or ``"auto"`` (:func:`~flashplan.plan.policy.default_extend_path`).
            Ignored for decode batches and cross-attention groups.
    """
    choice = ExtendPath(extend_path)
    if layout.mode is Mode.EXTEND and choice is ExtendPath.AUTO:
        choice = default_extend_path(layout, heads)

    qo_lens = layout.extend_lens
    qo_indptr = cumsum0(qo_lens)
    kv_offset = layout.kv_offsets
    group_plans = tuple(
        _plan_group(layout, group, choice, qo_lens, qo_indptr, kv_offset) for group in layout.groups
    )
    bs = layout.batch_size
    return PlanSpec(
        key=PlanKey(
            mode=layout.mode,
            groups=layout.groups,
            paths=tuple(gp.path for gp in group_plans),
            page_size=layout.page_size,
            heads=heads,
        ),
        qo_indptr=qo_indptr,
        max_q_len=int(qo_lens.max()) if bs else 0,
        total_q=int(qo_indptr[-1]),
        new_token_start=sealed(kv_offset.astype(np.int64) + layout.prefix_lens),
        encoder_indptr=None if layout.encoder_lens is None else cumsum0(layout.encoder_lens),
        pages_needed=sealed(np.maximum(layout.pages_needed, _encoder_pages(layout))),
        group_plans=group_plans,
    )


def _encoder_pages(layout: BatchLayout) -> IntArray:
    if layout.encoder_lens is None:
        return np.zeros_like(layout.seq_lens)
    ps = layout.page_size
    return sealed((layout.encoder_lens.astype(np.int64) + ps - 1) // ps)


def _plan_group(
    layout: BatchLayout,
    group: AttentionGroup,
    choice: ExtendPath,
    qo_lens: IntArray,
    qo_indptr: IntArray,
    kv_offset: IntArray,
) -> GroupPlan:
    if group.cross_attention:
        return _plan_cross(layout, group)
    seq = layout.seq_lens.astype(np.int64)
    prefix = layout.prefix_lens.astype(np.int64)
    base = kv_offset.astype(np.int64)
    window = group.window_left
    if layout.mode is Mode.DECODE:
        path = KernelPath.DECODE
        first_key = np.maximum(seq - (window + 1), 0) if window >= 0 else np.zeros_like(seq)
        paged = _paged_part(base + first_key, base + seq, layout.page_size, causal=True)
        ragged = None
    elif choice is ExtendPath.PAGED:
        path = KernelPath.PAGED
        first_key = np.maximum(prefix - window, 0) if window >= 0 else np.zeros_like(seq)
        paged = _paged_part(base + first_key, base + seq, layout.page_size, causal=group.causal)
        ragged = None
    elif choice is ExtendPath.RAGGED:
        ragged = RaggedPart(
            kv_indptr=qo_indptr,
            causal=group.causal,
            max_kv_len=int(qo_lens.max()) if qo_lens.size else 0,
        )
        if not np.any(prefix):
            path, paged = KernelPath.RAGGED, None
        else:
            path = KernelPath.RAGGED_PAGED
            paged = _prefix_part(base, prefix, qo_lens, window, layout.page_size)
    else:  # pragma: no cover - ExtendPath is exhaustive
        raise UnsupportedError(f"extend path {choice!r}")
    return GroupPlan(
        group=group,
        path=path,
        window_left=window,
        paged=paged,
        ragged=ragged,
        key_offset=kv_offset,
        num_keys=layout.seq_lens,
    )


def _plan_cross(layout: BatchLayout, group: AttentionGroup) -> GroupPlan:
    assert layout.encoder_lens is not None  # checked when the layout was built
    enc = layout.encoder_lens.astype(np.int64)
    paged = _paged_part(np.zeros_like(enc), enc, layout.page_size, causal=False)
    return GroupPlan(
        group=group,
        path=KernelPath.DECODE if layout.mode is Mode.DECODE else KernelPath.PAGED,
        window_left=-1,
        paged=paged,
        ragged=None,
        key_offset=sealed(np.zeros_like(enc)),
        num_keys=layout.encoder_lens,
    )


def _paged_part(first: np.ndarray, end: np.ndarray, page_size: int, *, causal: bool) -> PagedPart:
    return _part_from_segments(paged_segments(first, end, page_size), causal=causal)


def _part_from_segments(
    seg: PagedSegments,
    *,
    causal: bool,
    mask: CustomMask | None = None,
) -> PagedPart:
    return PagedPart(
        page_indptr=seg.page_indptr,
        start_page=seg.start_page,
        num_pages=seg.num_pages,
        last_page_len=seg.last_page_len,
        kv_lens=seg.kv_lens,
        causal=causal,
        mask=mask,
        total_pages=int(seg.page_indptr[-1]),
        max_kv_len=int(seg.kv_lens.max()) if seg.kv_lens.size else 0,
    )


def _prefix_part(
    base: np.ndarray, prefix: np.ndarray, qo_lens: IntArray, window: int, page_size: int
) -> PagedPart:
    """The cached prefix of a ragged+paged extend, trimmed to the window.

    Query ``j`` (logical position ``P + j``) sees prefix keys ``k >= P + j - window``.
    The kernel's own window is bottom-right aligned to the trimmed segment, which
    does not match, so when the window bites inside the segment the rule is
    expressed as a custom mask (rows are "hidden up to a column, visible after").
    """
    first_key = np.maximum(prefix - window, 0) if window >= 0 else np.zeros_like(prefix)
    seg = paged_segments(base + first_key, base + prefix, page_size)
    if window < 0:
        return _part_from_segments(seg, causal=False)
    seg_first = seg.start_page.astype(np.int64) * page_size - base  # decoder coordinates
    q = qo_lens.astype(np.int64)
    # The window bites for the last new token when it hides the segment's first key.
    bites = (seg.kv_lens > 0) & (q > 0) & (seg_first < prefix + q - 1 - window)
    if not np.any(bites):
        return _part_from_segments(seg, causal=False)
    mask = CustomMask.from_threshold(qo_lens, seg.kv_lens, prefix - window - seg_first)
    return _part_from_segments(seg, causal=False, mask=mask)
