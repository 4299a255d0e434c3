"""What ``apply`` sends to the device, worked out on the host (pure, CPU-tested).

:func:`device_plan` turns a plan and its translated calls into one
:class:`DevicePlan`: the batch's gather jobs (:mod:`flashplan.executor.gathers`), every
int32 host array the device needs laid end to end in one *staging* buffer with named
slices (:class:`StagingManifest`: the job table, mask recipes and the ``plan()``
indptrs), and the masks to build. The executor then only copies, launches and calls:
stage -> one host-to-device copy -> one gather launch -> masks -> ``plan()`` calls.
The multi-item tensors (uint32 / uint16) ride in the same int32 staging data, as their
bytes (:func:`~flashplan.executor.flashinfer.calls.int32_words`), and reach ``plan()``
as typed views of the device copy: still one copy.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from functools import cached_property
from itertools import accumulate
from typing import NamedTuple

import attrs
import numpy as np
import numpy.typing as npt

from flashplan.executor.flashinfer.calls import GroupCalls, MaskRecipe
from flashplan.executor.flashinfer.names import JOBS
from flashplan.executor.gathers import GatherJobs

__all__ = ["JOBS", "DevicePlan", "Slice", "StagingManifest", "device_plan"]


class Slice(NamedTuple):
    """Entries ``[offset, offset + size)`` of the staging buffer, called ``name`` (a
    named tuple: one is made per staged array and step)."""

    name: str
    offset: int
    size: int

    @property
    def end(self) -> int:
        """One past the slice's last entry."""
        return self.offset + self.size


@attrs.frozen(eq=False)
class StagingManifest:
    """The named int32 slices of one batch's staging buffer, end to end.

    Attributes:
        slices: every slice, in buffer order.
        total: entries in all slices (at least 1: a buffer is never empty).
    """

    slices: tuple[Slice, ...]
    total: int
    _by_name: dict[str, Slice] = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {s.name: s for s in self.slices})

    def __getitem__(self, name: str) -> Slice:
        return self._by_name[name]

    @classmethod
    def of(cls, arrays: Mapping[str, npt.NDArray[np.int32]]) -> StagingManifest:
        """The manifest laying ``arrays`` end to end in their mapping order.

        Memoized on the names and sizes: a step loop meets the same few layouts again
        and again (a manifest is immutable, so one object serves them all)."""
        return _laid_out(tuple(arrays), tuple([values.shape[0] for values in arrays.values()]))

    @classmethod
    def named(cls, names: tuple[str, ...], sizes: tuple[int, ...]) -> StagingManifest:
        """The manifest of slices ``names`` of ``sizes`` entries, end to end (memoized
        as :meth:`of`)."""
        return _laid_out(names, sizes)


@functools.lru_cache(maxsize=256)
def _laid_out(names: tuple[str, ...], sizes: tuple[int, ...]) -> StagingManifest:
    offsets = list(accumulate(sizes, initial=0))
    slices = tuple(map(Slice, names, offsets, sizes))
    return StagingManifest(slices, max(offsets[-1], 1))


@attrs.frozen(eq=False)
class DevicePlan:
    """Everything the device side of one ``apply`` needs.

    Attributes:
        calls: the translated ``plan()`` calls (placeholders resolved against the
            manifest, the gather regions and the built masks).
        jobs: the gather jobs (page ids of each paged call and the write slots).
        manifest: the staging buffer's named slices.
        parts: the int32 arrays of the manifest's slices, in buffer order (an
            executor concatenates them straight into its pinned staging slot:
            :meth:`write_into`).
        masks: per masked group, the size of its device-built mask.
        ints: the batch's integers behind ``BatchInt`` placeholders.
        elements: per ``StagedArray`` slice, its elements in its own dtype (the
            multi-item tensors, viewed on the device as uint32 / uint16).
    """

    calls: tuple[GroupCalls, ...]
    jobs: GatherJobs
    manifest: StagingManifest
    parts: tuple[npt.NDArray[np.int32], ...]
    masks: Mapping[int, MaskRecipe]
    ints: Mapping[str, int] = attrs.field(factory=dict)
    elements: Mapping[str, int] = attrs.field(factory=dict)

    def write_into(self, out: npt.NDArray[np.int32]) -> None:
        """Write the staging buffer's contents into ``out`` (int32, at least
        ``manifest.total`` entries; entries past the last slice are left as they are)."""
        if self.parts:
            used = self.manifest.slices[-1].end
            np.concatenate(self.parts, out=out[:used])

    @cached_property
    def data(self) -> npt.NDArray[np.int32]:
        """int32 ``[manifest.total]``: the staging buffer's contents (zero-padded)."""
        out = np.zeros(self.manifest.total, dtype=np.int32)
        self.write_into(out)
        out.flags.writeable = False
        return out


def device_plan(
    calls: tuple[GroupCalls, ...],
    jobs: GatherJobs,
    host: Mapping[str, npt.NDArray[np.int32]],
    masks: Mapping[int, MaskRecipe],
    *,
    ints: Mapping[str, int] | None = None,
    elements: Mapping[str, int] | None = None,
) -> DevicePlan:
    """Lay out one batch's device work (see module docstring).

    Args:
        calls: the plan's translated calls
            (:func:`~flashplan.executor.flashinfer.calls.call_skeleton`).
        jobs: the batch's gather jobs (:func:`~flashplan.executor.gathers.gather_jobs`,
            or a CUDA-graph bucket's
            :func:`~flashplan.executor.flashinfer.bucket.bucket_gather_jobs`).
        host: the ``plan()`` host arrays by name
            (:attr:`~flashplan.executor.flashinfer.calls.CallInputs.host`).
        masks: per masked group, its mask's size.
        ints, elements: :attr:`~flashplan.executor.flashinfer.calls.CallInputs.ints` and
            ``.elements`` (multi-item batches).
    """
    arrays: dict[str, npt.NDArray[np.int32]] = {JOBS: jobs.table.reshape(-1)}
    arrays.update(host)
    manifest = StagingManifest.of(arrays)
    return DevicePlan(
        calls, jobs, manifest, tuple(arrays.values()), masks, dict(ints or {}),
        dict(elements or {}),
    )  # fmt: skip
