"""Every page-table gather of one batch, as one table of *gather jobs* (pure, host).

A gather job reads ``count`` consecutive entries of one page-table row — page-table
columns (``div = 1``: the page ids of a kernel call's page span) or row tokens
(``div = page_size``: the page id and in-page offset each new token's K/V is written
to). :func:`flashplan.kernels.gather_slots` runs every job of a batch in one launch;
both executors use the same job table, so they read and write the same slots.

The outputs of the jobs are laid end to end; :class:`GatherJobs` names the *region*
of each purpose:

* ``"pages/l<l>"``: the shared pages of cascade level ``l``'s groups, in group order
  (each read from its first member's row: :func:`gather_jobs`' ``level_spans``), first;
* ``"pages/<g>"``: the page ids (FlashInfer's ``kv_indices``) of group ``g``'s paged
  call, in request order (``page_indptr`` offsets within the region), or, for a call
  that reads a dense block table (XQA), one row of ``width`` entries per request (its
  page ids first; the rest of the row is not written);
* ``"write"``: the write slots of the new tokens of self groups in the full pool;
* ``"write/window"``: the same slots mapped into the sliding-window pool (only with a
  page map and a windowed group): windowed groups write there;
* ``"encoder"``: the write slots of the encoder tokens a cross group writes.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import attrs
import numpy as np
import numpy.typing as npt

from flashplan.arrays import INT32_MAX, IntArray
from flashplan.errors import PlanMismatchError, UnsupportedError
from flashplan.layout.group import AttentionGroup
from flashplan.planning.spec import PlanSpec

__all__ = [
    "ENCODER",
    "WRITE",
    "WRITE_WINDOW",
    "GatherJobs",
    "JobPart",
    "Region",
    "concat_jobs",
    "divisors_and_flags",
    "gather_jobs",
    "gather_jobs_steps",
    "is_pages_region",
    "job_parts",
    "job_table",
    "level_pages_region",
    "pages_region",
    "write_region",
]


class Region(NamedTuple):
    """Outputs ``[lo, hi)`` of the job table: what one purpose gathered (a named
    tuple: one is made per region and step)."""

    name: str
    lo: int
    hi: int

    @property
    def size(self) -> int:
        """Entries in the region."""
        return self.hi - self.lo


@attrs.frozen(eq=False)
class GatherJobs:
    """The job table of one batch (see module docstring).

    Attributes:
        table: int32 ``[6, n]``, read-only: one row per job column, in
            :func:`~flashplan.kernels.gather_slots` order (``rows``, ``first``,
            ``counts``, ``dst``, ``div``, ``use_map``, each also a property below). It
            travels to the device as one block.
        regions: the named output regions, in order.
        total: entries in all regions.

    The columns, each int32 ``[n]`` (a view of ``table``):

    * ``rows``: page-table row of each job;
    * ``first``: first column (``div = 1``) or row token (``div = page_size``);
    * ``counts``: entries the job reads;
    * ``dst``: where the job's first output goes;
    * ``div``: 1 (columns) or the page size (tokens);
    * ``use_map``: 1 where page ids go through the sliding-window page map.
    """

    table: IntArray
    regions: tuple[Region, ...]
    total: int

    @classmethod
    def from_table(cls, table: IntArray, regions: tuple[Region, ...], total: int) -> GatherJobs:
        """A record from a table built elsewhere, checked: ``GatherJobs(...)`` stores
        its table as given, which must be C-contiguous read-only int32 ``[6, n]`` (as
        :func:`gather_jobs`' tables are).

        Raises:
            ValueError: a table of another dtype, shape or layout, or a writable one.
        """
        _check_table(table)
        return cls(table, regions, total)

    @property
    def num_jobs(self) -> int:
        """Jobs in the table."""
        return int(self.table.shape[1])

    @property
    def rows(self) -> IntArray:
        return self.table[0]

    @property
    def first(self) -> IntArray:
        return self.table[1]

    @property
    def counts(self) -> IntArray:
        return self.table[2]

    @property
    def dst(self) -> IntArray:
        return self.table[3]

    @property
    def div(self) -> IntArray:
        return self.table[4]

    @property
    def use_map(self) -> IntArray:
        return self.table[5]

    def step(self, prefix: str) -> GatherJobs:
        """The same table with only the regions named under ``prefix`` (one step of a
        multi-step draft: :func:`gather_jobs_steps`), their names without it."""
        regions = tuple(
            r._replace(name=r.name.removeprefix(prefix))
            for r in self.regions
            if r.name.startswith(prefix)
        )
        return attrs.evolve(self, regions=regions)

    def region(self, name: str) -> Region:
        """The region called ``name`` (``KeyError`` when the batch has none)."""
        for r in self.regions:
            if r.name == name:
                return r
        raise KeyError(name)

    def has(self, name: str) -> bool:
        """Whether the batch has a region called ``name``."""
        return any(r.name == name for r in self.regions)

    def written(self) -> npt.NDArray[np.bool_]:
        """bool ``[total]``: the outputs some job writes (a dense block table's rows end
        in entries none writes). For checks that read the outputs back, not a hot path."""
        counts = self.counts.astype(np.int64)
        before = np.add.accumulate(counts) - counts
        steps = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(before, counts)
        out = np.zeros(self.total, dtype=bool)
        out[np.repeat(self.dst.astype(np.int64), counts) + steps] = True
        return out

    def columns(self) -> tuple[IntArray, ...]:
        """The six job arrays in :func:`~flashplan.kernels.gather_slots` order."""
        return tuple(self.table)


def _check_table(table: IntArray) -> None:
    if table.dtype != np.int32 or table.ndim != 2 or table.shape[0] != 6:
        raise ValueError(f"a job table is int32 [6, n], got {table.dtype} {table.shape}")
    if not table.flags.c_contiguous or table.flags.writeable:
        raise ValueError("a job table is a C-contiguous read-only array")


#: Region of the new tokens' write slots (full pool).
WRITE = "write"
#: Region of the same slots mapped into the sliding-window pool.
WRITE_WINDOW = "write/window"
#: Region of the encoder tokens' write slots (cross groups).
ENCODER = "encoder"


def pages_region(group_index: int) -> str:
    """Name of the region holding group ``group_index``'s page ids."""
    return f"pages/{group_index}"


def level_pages_region(level: int) -> str:
    """Name of the region holding cascade level ``level``'s shared page ids."""
    return f"pages/l{level}"


def write_region(group: AttentionGroup, window_pool: bool) -> str:
    """The region of ``group``'s write slots: the encoder tokens' for a cross group; the
    window pool's for a group kept there (``window_pool``: the executor has a page map);
    the full pool's otherwise. Both executors write through it."""
    if group.cross_attention:
        return ENCODER
    if window_pool and group.uses_window_pool:
        return WRITE_WINDOW
    return WRITE


def is_pages_region(name: str) -> bool:
    """Whether region ``name`` holds a group's page ids (else write slots)."""
    return name.startswith("pages/")


def gather_jobs(
    spec: PlanSpec,
    rows: npt.NDArray[np.integer],
    *,
    window_pool: bool = False,
    spans: Mapping[int, tuple[IntArray, IntArray]] | None = None,
    level_spans: Sequence[tuple[IntArray, IntArray]] = (),
    widths: Mapping[int, int] | None = None,
) -> GatherJobs:
    """The gather jobs of ``spec`` for a table whose request ``i`` sits in ``rows[i]``.

    Args:
        spec: the plan.
        rows: int ``[bs]`` table row per request (:attr:`PageTable.rows`).
        window_pool: windowed groups keep their KV in a separate pool reached through
            a page map: their page ids and writes are mapped.
        spans: per group index, ``(start_page, num_pages)`` to gather instead of the
            paged call's own span (an executor's quirk workaround).
        level_spans: per cascade level, ``(start_page, num_pages)``, int32 ``[bs]``:
            the pages each request's row gives the level (a group's shared pages at
            its first member, nothing at the others), gathered into region
            ``"pages/l<level>"`` before the groups' regions (so that a level's region
            keeps its place while its sharing does, however the own parts grow).
        widths: per group index, the row width (pages) of a dense block table: request
            ``i``'s page ids go to entries ``[i * width, i * width + num_pages[i])`` of
            the group's region (each request's pages must fit its row).
    """
    r32 = np.asarray(rows, dtype=np.int32)
    parts = job_parts(spec, window_pool, spans, True)
    parts[0:0] = [
        (level_pages_region(k), start, num, 1, 0) for k, (start, num) in enumerate(level_spans)
    ]
    dense = {pages_region(i): w for i, w in (widths or {}).items()}
    return job_table(parts, r32, spec.batch_size, widths=dense)


def gather_jobs_steps(
    specs: Sequence[PlanSpec],
    rows: npt.NDArray[np.integer],
    prefixes: Sequence[str],
    *,
    window_pool: bool = False,
    spans: Sequence[Mapping[int, tuple[IntArray, IntArray]] | None] | None = None,
    widths: Sequence[Mapping[int, int]] | None = None,
) -> GatherJobs:
    """The gather jobs of several plans over one table (the steps of a multi-step draft
    decode), end to end in one table: what :func:`concat_jobs` of each plan's
    :func:`gather_jobs` gives, region names prefixed, built at once.

    Args:
        specs: the plans, all of one batch size (the table's).
        rows: int ``[bs]`` table row per request.
        prefixes: one region-name prefix per plan.
        window_pool, spans, widths: as :func:`gather_jobs` (``spans`` and ``widths`` one
            per plan).
    """
    parts: list[JobPart] = []
    dense: dict[str, int] = {}
    bs = specs[0].batch_size if specs else 0
    for k, (spec, prefix) in enumerate(zip(specs, prefixes, strict=True)):
        if spec.batch_size != bs:
            raise PlanMismatchError(
                "specs", "every step's plan must have the first one's batch size", step=k,
                batch_size=spec.batch_size, first_batch_size=bs,
            )  # fmt: skip
        own = job_parts(spec, window_pool, spans[k] if spans else None, True)
        parts += [(prefix + p[0], p[1], p[2], p[3], p[4]) for p in own]
        for i, width in (widths[k] if widths else {}).items():
            dense[prefix + pages_region(i)] = width
    return job_table(parts, np.asarray(rows, dtype=np.int32), bs, widths=dense)


#: One part of a job table: region name, first (int32 ``[bs]``), counts (int32
#: ``[bs]``), divisor, page-map flag.
JobPart = tuple[str, IntArray, IntArray, int, int]


def job_parts(
    spec: PlanSpec,
    window_pool: bool,
    spans: Mapping[int, tuple[IntArray, IntArray]] | None,
    encoder_writes: bool,
) -> list[JobPart]:
    """The parts of :func:`gather_jobs`' table, in region order (one job per request
    each; arguments as :func:`gather_jobs`'). ``encoder_writes``: gather the encoder
    tokens' write slots (a CUDA-graph bucket, which writes no encoder K/V, leaves them
    out)."""
    bs = spec.batch_size
    ps = spec.page_size
    parts: list[JobPart] = []
    windowed = False
    for index, gp in enumerate(spec.group_plans):
        uses_map = window_pool and gp.group.uses_window_pool
        windowed |= uses_map
        if gp.paged is None:
            continue
        start, num = (spans or {}).get(index, (gp.paged.start_page, gp.paged.num_pages))
        parts.append((pages_region(index), start, num, 1, int(uses_map)))
    has_self = any(not gp.group.cross_attention for gp in spec.group_plans)
    if has_self:
        parts.append((WRITE, spec.write_start, spec.qo_lens, ps, 0))
        if windowed:
            parts.append((WRITE_WINDOW, spec.write_start, spec.qo_lens, ps, 1))
    if (
        encoder_writes
        and spec.encoder_indptr is not None
        and any(gp.group.cross_attention for gp in spec.group_plans)
    ):
        parts.append((ENCODER, np.zeros(bs, np.int32), np.diff(spec.encoder_indptr), ps, 0))
    return parts


@functools.lru_cache(maxsize=256)
def divisors_and_flags(per_part: tuple[tuple[int, int], ...]) -> IntArray:
    """int32 ``[2, parts, 1]``: each part's divisor and page-map flag, ready to broadcast
    over its jobs (read-only, made once per parts signature)."""
    out = np.array(per_part, dtype=np.int32).T[..., None].copy()
    out.setflags(write=False)
    return out


def job_table(
    parts: list[JobPart], rows: IntArray, bs: int, flags: IntArray | None = None, *,
    widths: Mapping[str, int] | None = None,
) -> GatherJobs:  # fmt: skip
    """The job table of ``parts`` (name, first, counts, div, use_map), each ``[bs]``,
    over table rows ``rows`` (int ``[bs]``); ``flags``: the parts' divisors and
    page-map flags as :func:`divisors_and_flags` gives them, when the caller keeps
    them; ``widths``: by region name, a dense block table's row width (each job's
    output starts a row; its counts must fit it).

    Few numpy calls (this runs every step): the rows are broadcast into every part at
    once, each part's first and counts are filled by slice, the divisors and map flags
    of all parts by one broadcast each, and ``dst`` is one running sum over every
    part's counts, since the parts' outputs lie end to end.
    """
    n = len(parts)
    size = n * bs
    table = np.empty((6, size), dtype=np.int32)
    by_part = table.reshape(6, n, bs)
    by_part[0] = rows
    for k, part in enumerate(parts):
        by_part[1, k] = part[1]
        by_part[2, k] = part[2]
    if flags is None:
        flags = divisors_and_flags(tuple([(p[3], p[4]) for p in parts]))
    by_part[4:6] = flags
    steps: IntArray = table[2]  # the entries each job's output takes
    if widths:
        steps = table[2].copy()
        for k, part in enumerate(parts):
            if part[0] in widths:
                steps[k * bs : (k + 1) * bs] = widths[part[0]]
    ends = np.add.accumulate(steps, dtype=np.int64) if size else np.zeros(0, np.int64)
    total = int(ends[-1]) if size else 0
    if total > INT32_MAX:
        raise UnsupportedError(
            "pages", "a batch that gathers this many page ids and slots exceeds int32 offsets",
            gathered=total,
        )  # fmt: skip
    if size:  # dst: the running sum before each job
        table[3, 0] = 0
        table[3, 1:] = ends[:-1]  # (fits int32: checked above)
    bounds = [0, *ends[bs - 1 :: bs].tolist()] if bs else [0] * (n + 1)
    regions = tuple(map(Region, [p[0] for p in parts], bounds[:-1], bounds[1:]))
    table.setflags(write=False)
    return GatherJobs(table, regions, total)  # C-contiguous read-only int32 [6, n]


def concat_jobs(tables: list[GatherJobs], prefixes: list[str]) -> GatherJobs:
    """Several job tables as one (their outputs end to end), region names prefixed.

    A multi-step draft decode gathers every step's page ids in one launch.
    """
    shift = np.cumsum([0] + [t.total for t in tables])
    if int(shift[-1]) > INT32_MAX:
        raise UnsupportedError(
            "pages", "jobs that gather this many page ids and slots exceed int32 offsets",
            gathered=int(shift[-1]),
        )  # fmt: skip
    sizes = [t.num_jobs for t in tables]
    table = np.empty((6, sum(sizes)), dtype=np.int32)
    at = 0
    for t, size, base in zip(tables, sizes, shift.tolist(), strict=False):
        table[:, at : at + size] = t.table
        table[3, at : at + size] += base  # each table's outputs after the earlier ones
        at += size
    regions = tuple(
        Region(prefix + r.name, r.lo + int(shift[i]), r.hi + int(shift[i]))
        for i, (t, prefix) in enumerate(zip(tables, prefixes, strict=True))
        for r in t.regions
    )
    table.setflags(write=False)
    return GatherJobs(table, regions, int(shift[-1]))
