"""Everything a FlashInfer executor keeps from one ``apply`` to the next, and its key.

An engine keeps one executor for the life of the process and feeds it batches of every
shape, mode, group set and head configuration. Whatever the executor keeps between
applies must therefore be found again only for a batch it is right for. **The rule:**

    An object kept between applies is looked up by a key that holds *everything* it
    was derived from. Where part of that is a tensor (whose identity, not value,
    matters), the entry holds the tensor and is checked against it with ``is`` on every
    use. An object that cannot be keyed so is rebuilt on every apply, or its contents
    are rewritten before anything reads them.

A key never stands for its inputs by a part of them: a slice name, a group's index or a
staging layout (the names and sizes of the staged arrays) alone does not fix what a
``plan()`` call passes. That was the cause of the long-lived-executor bug (issue #23): a
call's resolved ``plan()`` arguments were kept per staging layout and group index, and
two batches of equal array sizes but other heads, windows, soft caps or causal flags
(a new group set, a new model) share a staging layout, so the later batch was planned
with the earlier batch's compiled-in arguments.

Every kept object, in one place:

===========================  ===================================  =======================
kept object                  key (everything it depends on)       checked on use
===========================  ===================================  =======================
call skeleton                :func:`~.calls.skeleton_key` (plan   the policy and the GPU
(``OwnedBuffers.skeletons``) key, decode kernel kind, masked and  are the executor's own,
                             multi-item groups; a graph's bucket  fixed at construction
                             batch size)
a skeleton's paged lane      ``id`` of the skeleton tuple (which  the tuple (``is``: the
(``OwnedBuffers.lanes``)     holds its key's consequences); the   entry holds it)
                             page map's presence and whether
                             tree masks may take it (eager) are
                             fixed at construction
wrapper (``WrapperPool``)    ``(step prefix, WrapperKey)``: kind, its last full ``plan()``'s
                             group, backend, tensor cores         constants equal the
                                                                  call's
                                                                  (``planned_with``), or
                                                                  ``plan()`` runs
a wrapper's last schedule    the scheduler's inputs: the call's   the same ``PlanSpec``
(decode, paged prefill;      constants (checked as above) and     (``is``), or equal
``WrapperSlot.scheduled``)   the host arrays it reads (indptrs,   values of those arrays;
                             KV lengths); of a batch too large    or unsplit and the same
                             to split, the queries alone          queries
                                                                  (``schedule_stands``)
named views of a staging     ``(id(tensor), StagingManifest)``    ``views.tensor is
tensor (``SliceViews``)                                           tensor``
bound ``plan()`` arguments   :class:`BoundCallKey`: step prefix,  ``bound.host is host``
(:attr:`LayoutMemo.calls`)   group, part, the whole ``PlanCall``
                             (constants and placeholders), the
                             pinned views' ``id``
a gather region's view       the region's name                    the page buffer and the
(:attr:`LayoutMemo.regions`)                                      region's bounds
the job table view           (the views' manifest: one per memo)  —
a staged mask's layout       :class:`MaskKey`: group, tree size,  the output buffer
(:attr:`LayoutMemo.masks`)   position mask or not                 (``is``)
the bound fused launch       the staged mask's offsets and kind   every bound tensor
(:attr:`LayoutMemo.launch`)  (:func:`mask_layout`)                (``binds()``: identity
                                                                  and address)
the staging copy's views     ``id`` of the pinned slot's tensor   the slot's tensor
(:attr:`LayoutMemo.uploads`)                                      (``is``)
pinned staging slots         —                                    reused only when idle
(``PinnedRing``)                                                  (its timeline mark has
                                                                  passed), else a new one
device buffers (staging      — (sized to the largest batch)       rewritten by this
copy, gathered ids, masks,                                        apply before any kernel
items, positions)                                                 reads them (stream
                                                                  order)
a graph executor's fixed     the first apply's plan key, masked   every later apply: a
buffers and wrappers         groups and steps per apply (the      plan of another key,
(``GraphBuffers.fixed``)     graph was captured for them)         mask set or step count
                                                                  is refused
                                                                  (``PlanMismatchError``)
===========================  ===================================  =======================

The memo of one staging layout (:class:`LayoutMemo`) lives with that layout's device
views (:class:`~flashplan.executor.flashinfer.buffers.StagedViews`), so a memo entry is
implicitly keyed by the device staging tensor and the manifest as well; each entry's
key holds the rest. ``tests/gpu/test_long_lived.py`` checks the rule as engines use
an executor: one executor over hundreds of varied batches, against the reference.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import attrs
import torch

if TYPE_CHECKING:
    import numpy as np

    from flashplan.executor.flashinfer.calls import PlanCall
    from flashplan.executor.gathers import Region
    from flashplan.kernels.fused import BoundGatherAndMask, StagedMask

__all__ = ["BoundCall", "BoundCallKey", "LayoutMemo", "MaskKey", "mask_layout"]

_T = torch.Tensor
#: A decode call's staged views in ``replan_arrays.DecodeArrays`` order, ``indices`` excluded:
#: host and device page indptr, host and device last-page lengths, and for a
#: tensor-core decode host and device qo_indptr and host KV lengths (else ``None``).
DecodeViews = tuple[_T, _T, _T, _T, _T | None, _T | None, _T | None]
#: A paged prefill call's staged views in ``replan_arrays.PrefillArrays`` order, up to
#: ``kv_lens_device``.
PrefillViews = tuple[_T, _T, _T, _T, _T, _T, _T]


class BoundCallKey(NamedTuple):
    """What one call's bound ``plan()`` arguments are derived from (besides the device
    views the memo belongs to).

    Attributes:
        prefix: the step's name prefix (``""``; ``"s<k>/"`` in a multi-step draft).
        group_index: the group's position in the plan.
        part: ``"paged"`` or ``"ragged"``.
        call: the whole call: every constant (heads, page size, window, soft cap, scale,
            causal flag, dtypes, split options) and every placeholder (hashed once:
            ``PlanCall`` caches its hash).
        host: ``id`` of the pinned host views the arguments were resolved against (the
            entry holds them, so the id is not reused while it is kept).
    """

    prefix: str
    group_index: int
    part: str
    call: PlanCall
    host: int


class MaskKey(NamedTuple):
    """What a staged mask's offsets are derived from (besides the manifest).

    Attributes:
        group_index: the masked group.
        num_tokens: ``N`` of a tree mask, 0 otherwise (which arrays it reads).
        position: a position mask (which arrays it reads, and the kernel's kind).
    """

    group_index: int
    num_tokens: int
    position: bool = False


def mask_layout(mask: StagedMask | None) -> tuple[int, ...] | None:
    """The integers a bound launch fixes from ``mask``: every offset, the batch size and
    the tree size and the kind (not ``max_bytes``, which each launch passes); ``None``
    without one."""
    if mask is None:
        return None
    return (mask.first_visible, mask.qo_lens, mask.kv_lens, mask.byte_offsets,
            mask.row_offsets, mask.tail_start, mask.tail_words, mask.batch_size,
            mask.num_tokens, mask.kind)  # fmt: skip


@attrs.frozen(eq=False)
class BoundCall:
    """One ``plan()`` call's arguments that depend only on the call and the staging
    layout, resolved against one pair of views (kept in :attr:`LayoutMemo.calls` under
    its :class:`BoundCallKey`, so made once per call, layout and pinned slot instead of
    every batch).

    Attributes:
        host: the host views (a ``StagedViews``) the arguments were resolved against
            (held, so that the entry is recognised by identity).
        kwargs: the constant arguments and the host arrays' views (pinned).
        dynamic: the placeholders each batch resolves (gathered page ids, built masks,
            the batch's ints, multi-item tensors).
        decode: a decode call's indptr and last-page lengths, host and device views
            (:data:`DecodeViews`), else ``None``.
        prefill: a paged prefill call's views (:data:`PrefillViews`), else ``None``.
        mask_indptr: a masked paged prefill call's ``mask_indptr`` (device view).
        prefill_ints: a paged prefill call's names in the device plan's ``ints`` of its
            total query rows, longest query and longest KV.
        schedule_inputs: numpy views of the pinned host arrays the call's scheduler
            reads, compared by value to skip a re-run (a paged prefill's ``qo_indptr``,
            page indptr and KV lengths; a CUDA-core decode's page indptr), or ``None``
            (a tensor-core decode: compared by plan object only; ``wrapper_plans``).
        decode_indices: a decode call's placeholder of its gathered page ids (the one
            per-batch argument of a decode re-plan), else ``None``.
    """

    host: dict[str, torch.Tensor]
    kwargs: dict[str, Any]
    dynamic: tuple[tuple[str, Any], ...]
    decode: DecodeViews | None
    prefill: PrefillViews | None
    mask_indptr: torch.Tensor | None
    prefill_ints: tuple[str, str, str] = ("", "", "")
    schedule_inputs: tuple[np.ndarray, ...] | None = None
    decode_indices: object = None


@attrs.define(eq=False)
class LayoutMemo:
    """What the executor derives from one staging layout's device views and keeps with
    them (see the module's table for each field's key and check).

    Attributes:
        calls: per :class:`BoundCallKey`, the call's arguments resolved against the
            views.
        regions: per gather region name, ``(page buffer, region, view)``: the view
            ``page[region.lo:region.hi]``.
        job_table: the staged job table as int32 ``[6, num_jobs]``, or ``None``.
        masks: per :class:`MaskKey`, the group's :class:`~flashplan.kernels.StagedMask`.
        launch: ``(mask_layout, binding)`` of the last bound fused launch, or ``None``.
        uploads: per ``id`` of a pinned slot's tensor, ``(that tensor, device
            destination, host source)``: the staging copy's two views.
    """

    calls: dict[BoundCallKey, BoundCall] = attrs.field(factory=dict)
    regions: dict[str, tuple[torch.Tensor, Region, torch.Tensor]] = attrs.field(factory=dict)
    job_table: torch.Tensor | None = None
    masks: dict[MaskKey, StagedMask] = attrs.field(factory=dict)
    launch: tuple[tuple[int, ...] | None, BoundGatherAndMask] | None = None
    uploads: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = attrs.field(factory=dict)
