"""What ``apply`` sends to the device, worked out on the host: :func:`device_plan` lays a
batch's gather job table and every int32 host array end to end in one *staging* buffer
of named slices (:class:`StagingManifest`), copied to the device at once."""

from __future__ import annotations

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
    """Entries ``[offset, offset + size)`` of the staging buffer, called ``name``."""

    name: str
    offset: int
    size: int

    @property
    def end(self) -> int:
        """One past the slice's last entry."""
        return self.offset + self.size


@attrs.frozen(eq=False)
class StagingManifest:
    """The named int32 slices of one batch's staging buffer, end to end, in buffer order;
    ``total``: entries in all slices (at least 1)."""

    slices: tuple[Slice, ...]
    total: int
    _by_name: dict[str, Slice] = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {s.name: s for s in self.slices})

    def __getitem__(self, name: str) -> Slice:
        return self._by_name[name]

    @classmethod
    def of(cls, arrays: Mapping[str, npt.NDArray[np.int32]]) -> StagingManifest:
        """The manifest laying ``arrays`` end to end in their mapping order."""
        sizes = [values.shape[0] for values in arrays.values()]
        offsets = list(accumulate(sizes, initial=0))
        return cls(tuple(map(Slice, arrays, offsets, sizes)), max(offsets[-1], 1))


@attrs.frozen(eq=False)
class DevicePlan:
    """Everything the device side of one ``apply`` needs: the translated calls, the gather
    jobs, the staging buffer's named slices and their int32 arrays (``parts``, in buffer
    order), and the masks, ``ints`` and ``elements`` of
    :class:`~flashplan.executor.flashinfer.calls.CallInputs`."""

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
            np.concatenate(self.parts, out=out[: self.manifest.slices[-1].end])

    @cached_property
    def data(self) -> npt.NDArray[np.int32]:
        """int32 ``[manifest.total]``: the staging buffer's contents (zero-padded)."""
        out = np.zeros(self.manifest.total, dtype=np.int32)
        self.write_into(out)
        out.flags.writeable = False
        return out


def device_plan(
    calls: tuple[GroupCalls, ...], jobs: GatherJobs, host: Mapping[str, npt.NDArray[np.int32]],
    masks: Mapping[int, MaskRecipe], *, ints: Mapping[str, int] | None = None,
    elements: Mapping[str, int] | None = None,
) -> DevicePlan:  # fmt: skip
    """One batch's device work: ``calls``, its gather ``jobs`` and the ``plan()`` host
    arrays ``host`` laid out in one staging buffer."""
    arrays = {JOBS: jobs.table.reshape(-1), **host}
    return DevicePlan(
        calls, jobs, StagingManifest.of(arrays), tuple(arrays.values()), masks,
        dict(ints or {}), dict(elements or {}),
    )  # fmt: skip
