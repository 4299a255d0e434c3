"""RoPE positions of a plan's new tokens, as runs: the compact form both executors read.

A batch's positions mostly grow by one from token to token: a request's new tokens sit at
``P, P + 1, …`` after its ``P`` cached tokens, a decode token at ``P``, and in a
multi-item batch every item restarts just after the shared prefix. :class:`PositionRuns`
stores one ``(first, length)`` pair per run instead of one position per token, so that
planning never touches ``total_q`` entries (a scoring batch has 10^5+ new tokens).
:attr:`~flashplan.planning.spec.PlanSpec.positions` materializes them on the host when
read; the FlashInfer executor builds them on the device from the runs
(:meth:`~flashplan.executor.flashinfer.FlashInferExecutor.positions`).

Runs follow each other in token order: run ``s`` covers tokens ``start[s] …
start[s] + length[s] - 1``, ``start`` being the running sum of ``length``, and token
``start[s] + j`` sits at position ``max(first[s] + j, 0)``. The clamp at 0 is for a
multi-item delimiter over an empty prefix (:mod:`flashplan.planning.items`), whose run
starts at -1; every other run starts at 0 or more.
"""

from __future__ import annotations

from functools import cached_property

import attrs
import numpy as np

from flashplan.arrays import (
    INT32_MAX,
    IntArray,
    array_key,
    filled,
    indptr,
    readonly_when_unpickled,
    seal_inplace,
)
from flashplan.errors import LayoutError

__all__ = ["PositionRuns"]


def _runs_array(field: str, value: object) -> IntArray:
    arr = np.asarray(value)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise LayoutError(field, "must be a 1-D integer array", shape=arr.shape)
    if arr.dtype == np.int32 and not arr.flags.writeable and arr.flags.c_contiguous:
        return arr
    if arr.size and (int(arr.min()) < -INT32_MAX - 1 or int(arr.max()) > INT32_MAX):
        i = int(np.flatnonzero((arr < -INT32_MAX - 1) | (arr > INT32_MAX))[0])
        raise LayoutError(field, "exceeds int32", run=i, value=int(arr[i]))
    out = np.array(arr, dtype=np.int32, copy=True, order="C")
    out.setflags(write=False)
    return out


@readonly_when_unpickled
@attrs.frozen
class PositionRuns:
    """Positions of ``total`` tokens as runs that grow by one (module docstring).

    ``PositionRuns(first, length)`` stores the arrays as given: read-only C-contiguous
    int32 arrays of one length that pass :meth:`from_runs`' checks (the planner's).
    :meth:`from_runs` converts and checks any integer arrays; :meth:`of_tokens` makes
    one run per token.

    Example — an extend of two requests with 3 and 2 new tokens after 5 and 0 cached:

    >>> runs = PositionRuns.from_runs(first=[5, 0], length=[3, 2])
    >>> runs.start.tolist(), runs.total, runs.positions().tolist()
    ([0, 3], 5, [5, 6, 7, 0, 1])

    Attributes:
        first: int32 ``[S]``: the position of each run's first token (clamped at 0 when
            negative).
        length: int32 ``[S]`` (tokens): tokens per run, ``>= 0``.
    """

    first: IntArray = attrs.field(eq=array_key)
    length: IntArray = attrs.field(eq=array_key)

    @classmethod
    def from_runs(cls, first: object, length: object) -> PositionRuns:
        """Runs from any 1-D integer arrays (copied to read-only int32 unless they are
        already).

        Raises:
            LayoutError: arrays that are not 1-D integers of one length, a negative
                length, a total or a run's last position beyond int32 (naming the run).
        """
        first32 = _runs_array("first", first)
        length32 = _runs_array("length", length)
        if first32.shape != length32.shape:
            raise LayoutError(
                "length", "must have one entry per run", runs=first32.shape[0],
                size=length32.shape[0],
            )  # fmt: skip
        if length32.size:
            if int(length32.min()) < 0:
                i = int(np.flatnonzero(length32 < 0)[0])
                raise LayoutError("length", "must be >= 0", run=i, value=int(length32[i]))
            last = first32.astype(np.int64) + length32 - 1
            if int(last.max()) > INT32_MAX:
                i = int(np.flatnonzero(last > INT32_MAX)[0])
                raise LayoutError(
                    "first", "a run's last position exceeds int32", run=i, value=int(last[i])
                )
            total = int(length32.sum(dtype=np.int64))
            if total > INT32_MAX:
                raise LayoutError("length", "total exceeds int32", total=total)
        return cls(first32, length32)

    @classmethod
    def of_tokens(cls, positions: object) -> PositionRuns:
        """One run per token: ``positions`` (int ``[total]``) as they are.

        Raises:
            LayoutError: ``positions`` is not a 1-D integer array of int32 values, or
                holds a negative position (runs clamp them at 0), naming the token.
        """
        first = _runs_array("positions", positions)
        if first.size and int(first.min()) < 0:
            i = int(np.flatnonzero(first < 0)[0])
            raise LayoutError("positions", "must be >= 0", token=i, value=int(first[i]))
        return cls(first, seal_inplace(np.ones(first.shape[0], dtype=np.int32)))

    @property
    def num_runs(self) -> int:
        """``S``, the number of runs."""
        return int(self.first.shape[0])

    @cached_property
    def start(self) -> IntArray:
        """int32 ``[S]`` (tokens): each run's first token (the running sum of ``length``)."""
        return indptr(self.length, "length")[:-1]

    @cached_property
    def total(self) -> int:
        """Tokens in all runs."""
        if self._one_token_each:
            return self.num_runs
        return int(self.length.sum(dtype=np.int64))

    @cached_property
    def max_length(self) -> int:
        """The longest run (tokens); 0 without runs."""
        if self._one_token_each:
            return min(self.num_runs, 1)
        return int(self.length.max()) if self.num_runs else 0

    @property
    def _one_token_each(self) -> bool:
        """Whether ``length`` is the shared all-ones array of :func:`filled` (a verify's
        runs): every run one token, read without summing."""
        return self.length is filled(1, self.num_runs)

    def positions(self) -> IntArray:
        """int32 ``[total]``: every token's position (read-only). When every run is one
        token at a position ``>= 0`` (a decode or a verify), this is :attr:`first`
        itself; otherwise a fresh array."""
        if (  # every run one token, none clamped
            self.max_length <= 1
            and self.total == self.num_runs
            and (not self.num_runs or int(np.minimum.reduce(self.first)) >= 0)
        ):
            return self.first
        out = np.repeat(self.first - self.start, self.length)
        out += np.arange(out.shape[0], dtype=np.int32)
        if self.num_runs and int(self.first.min()) < 0:
            np.maximum(out, 0, out=out)
        return seal_inplace(out)
