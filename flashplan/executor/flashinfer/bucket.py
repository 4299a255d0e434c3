"""CUDA-graph buckets: fixed buffer sizes and padding, as pure host functions.

A CUDA graph replays kernels with the arguments (pointers, grid sizes) they were
captured with, so every buffer a captured step reads must keep its address and size.
An engine picks a few *buckets* — batch sizes such as 1, 2, 4, 8, 16, 24, 32, … 256,
each with a most-pages-per-request bound — captures one graph per bucket and replays
the smallest bucket a batch fits in. Everything here is a pure function of the
bucket, tested on the CPU:

* :meth:`GraphBucket.layout` gives the fixed gather regions (their bases and
  capacities) that the graph's kernels read: every group's page ids and the write
  slots of the bucket's tokens.
* :func:`bucket_gather_jobs` writes a batch's gather jobs into those regions and adds
  *fill jobs* for the padding requests: each padding request reads one valid dummy
  page and writes nowhere (offset -1, which :func:`~flashplan.kernels.write_kv` skips).
* :func:`padded_inputs` pads the ``plan()`` host arrays to the bucket's batch size
  (one page of one key per padding request), so FlashInfer plans exactly the fixed
  batch size its graph wrappers were made for.
* :func:`check_fits` refuses a plan that does not fit, naming the request.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import attrs
import numpy as np
import numpy.typing as npt

import flashplan.executor.flashinfer.names as names
from flashplan.arrays import INT32_MAX, IntArray, seal_inplace
from flashplan.errors import BucketError
from flashplan.executor.flashinfer.calls import MaskRecipe, bytes_as_int32
from flashplan.executor.gathers import (
    WRITE,
    WRITE_WINDOW,
    GatherJobs,
    JobPart,
    Region,
    is_pages_region,
    job_parts,
    pages_region,
)
from flashplan.layout.batch import Mode
from flashplan.layout.convert import as_int
from flashplan.planning.spec import KernelPath, PlanKey, PlanSpec

__all__ = [
    "BucketLayout",
    "GraphBucket",
    "bucket_gather_jobs",
    "bucket_jobs",
    "check_fits",
    "padded_indptr",
    "padded_inputs",
    "padded_lengths",
    "padded_masks",
]


def _bucket_mode(field: str, value: object) -> Mode:
    if isinstance(value, Mode):
        return value
    raise BucketError(field, "must be a flashplan.Mode", value=value)


@attrs.frozen(cache_hash=True)  # a key of the per-step template cache
class BucketLayout:
    """Where a bucket's fixed gather regions live in its gather output buffer.

    Attributes:
        regions: each region at its fixed base, with its capacity (entries).
        total: entries in all regions.
    """

    regions: tuple[Region, ...]
    total: int

    def region(self, name: str) -> Region:
        """The fixed region called ``name``."""
        for r in self.regions:
            if r.name == name:
                return r
        raise KeyError(name)


@attrs.frozen(cache_hash=True)  # a key of the per-step template cache
class GraphBucket:
    """The fixed shape a CUDA graph is captured for.

    Attributes:
        mode: :attr:`Mode.DECODE`; :attr:`Mode.EXTEND` with the same number of new
            tokens for every request (the draft-extend shape); or :attr:`Mode.VERIFY`
            (target verify of ``tokens_per_request`` draft tokens per request: tree
            masks live in fixed buffers too).
        batch_size: requests the graph runs (a smaller batch is padded to it).
        max_pages: most pages one request's kernel call may read (page-table columns).
        tokens_per_request: new tokens per request (1 for decode).
        dummy_page: the page id padding requests read (a valid page of the cache;
            its contents do not matter).
    """

    mode: Mode = attrs.field(converter=lambda v: _bucket_mode("mode", v))
    batch_size: int = attrs.field(converter=lambda v: as_int("batch_size", v, minimum=1))
    max_pages: int = attrs.field(converter=lambda v: as_int("max_pages", v, minimum=1))
    tokens_per_request: int = attrs.field(
        default=1, converter=lambda v: as_int("tokens_per_request", v, minimum=1)
    )
    dummy_page: int = attrs.field(default=0, converter=lambda v: as_int("dummy_page", v, minimum=0))

    def __attrs_post_init__(self) -> None:
        if self.mode is Mode.DECODE and self.tokens_per_request != 1:
            raise BucketError(
                "tokens_per_request", "a decode bucket has one token per request",
                tokens_per_request=self.tokens_per_request,
            )  # fmt: skip
        for what, value in (
            ("batch_size * max_pages", self.batch_size * self.max_pages),
            ("batch_size * tokens_per_request", self.total_q),
        ):
            if value > INT32_MAX:
                raise BucketError("batch_size", f"{what} exceeds int32", value=value)

    @classmethod
    def decode(cls, batch_size: int, max_pages: int, *, dummy_page: int = 0) -> GraphBucket:
        """A decode bucket: ``batch_size`` requests of one token, up to ``max_pages``."""
        return cls(Mode.DECODE, batch_size, max_pages, 1, dummy_page)

    @classmethod
    def extend(
        cls, batch_size: int, max_pages: int, tokens_per_request: int, *, dummy_page: int = 0
    ) -> GraphBucket:
        """An extend bucket with a fixed ``tokens_per_request`` (draft extend)."""
        return cls(Mode.EXTEND, batch_size, max_pages, tokens_per_request, dummy_page)

    @classmethod
    def verify(
        cls, batch_size: int, max_pages: int, num_tokens: int, *, dummy_page: int = 0
    ) -> GraphBucket:
        """A target-verify bucket: ``num_tokens`` draft tokens per request (``N`` of the
        :class:`~flashplan.DraftTree`), up to ``max_pages`` pages per request."""
        return cls(Mode.VERIFY, batch_size, max_pages, num_tokens, dummy_page)

    def mask_bytes(self, page_size: int) -> int:
        """Bytes of the fixed custom-mask buffer of one masked group (a verify tree):
        every request's ``tokens_per_request x (max_pages * page_size)`` mask laid at
        FlashInfer 0.7.4's offsets, which count one byte per mask element
        (:func:`~flashplan.executor.flashinfer.calls.flashinfer_mask_offsets`)."""
        return self.total_q * self.max_pages * page_size

    @property
    def total_q(self) -> int:
        """Rows of ``q`` (and of new K/V) the graph runs: ``batch_size * tokens_per_request``."""
        return self.batch_size * self.tokens_per_request

    def layout(self, key: PlanKey, *, window_pool: bool) -> BucketLayout:
        """The fixed gather regions of a graph for plans with ``key``.

        Every group with a paged call gets ``batch_size * max_pages`` page ids; the
        write slots of self groups get ``total_q`` entries (twice, mapped and unmapped,
        with a sliding-window pool and a windowed group).
        """
        sizes: list[tuple[str, int]] = []
        for index, path in enumerate(key.paths):
            if path is not KernelPath.RAGGED:
                sizes.append((pages_region(index), self.batch_size * self.max_pages))
        if any(not g.cross_attention for g in key.groups):
            sizes.append((WRITE, self.total_q))
            if window_pool and any(g.uses_window_pool for g in key.groups):
                sizes.append((WRITE_WINDOW, self.total_q))
        regions = []
        base = 0
        for name, size in sizes:
            regions.append(Region(name, base, base + size))
            base += size
        return BucketLayout(tuple(regions), max(base, 1))


def check_fits(spec: PlanSpec, bucket: GraphBucket) -> None:
    """Raise :class:`~flashplan.BucketError` unless ``spec`` fits ``bucket``.

    A fitting plan is not a multi-item batch, has the bucket's mode, at most
    ``batch_size`` requests, exactly ``tokens_per_request`` new tokens each, paged calls
    only (so the only custom masks are a verify's tree masks, which the bucket's fixed
    mask buffers hold), and no paged call reading more than ``max_pages`` pages for a
    request.
    """
    if spec.key.multi_item:
        raise BucketError(
            "item_delimiters",
            "CUDA-graph buckets do not run multi-item batches (run them eagerly)",
        )
    if spec.key.mode is not bucket.mode:
        raise BucketError(
            "mode", "the plan's mode differs from the bucket's",
            plan_mode=spec.key.mode.value, bucket_mode=bucket.mode.value,
        )  # fmt: skip
    if spec.batch_size > bucket.batch_size:
        raise BucketError(
            "batch_size", "the batch is larger than the bucket",
            batch_size=spec.batch_size, bucket_batch_size=bucket.batch_size,
        )  # fmt: skip
    # (a decode plan has one new token per request by construction)
    wrong = None if spec.key.mode is Mode.DECODE else spec.qo_lens != bucket.tokens_per_request
    if wrong is not None and wrong.any():
        i = int(np.flatnonzero(wrong)[0])
        raise BucketError(
            "tokens_per_request", "every request of a bucket has the same number of new tokens",
            request=i, new_tokens=int(spec.qo_lens[i]),
            tokens_per_request=bucket.tokens_per_request,
        )  # fmt: skip
    for index, gp in enumerate(spec.group_plans):
        if gp.path in (KernelPath.RAGGED, KernelPath.RAGGED_PAGED):
            raise BucketError(
                "paths", "CUDA-graph buckets run paged paths only: plan with extend_path='paged'",
                group=index, path=gp.path.value,
            )  # fmt: skip
        pages = None if gp.paged is None else gp.paged.num_pages
        if pages is not None and pages.size and np.maximum.reduce(pages) > bucket.max_pages:
            i = int(np.flatnonzero(pages > bucket.max_pages)[0])
            raise BucketError(
                "max_pages", "a request reads more pages than the bucket holds",
                request=i, group=index, pages=int(pages[i]), max_pages=bucket.max_pages,
            )  # fmt: skip


@functools.lru_cache(maxsize=256)
def _bucket_template(
    bucket: BucketLayout,
    parts: tuple[tuple[str, int, int], ...],
    batch_size: int,
    graph: GraphBucket,
) -> tuple[tuple[Region, ...], IntArray, IntArray, npt.NDArray[np.int64]]:
    """What the fixed job table of ``parts`` (region name, divisor, page-map flag) in
    ``bucket`` holds whatever the batch: ``(fixed regions, table template, region
    bases, padding offsets)``. The template is int32 ``[6, parts, graph.batch_size]``
    (read-only) with every job's divisor and map flag and the padding requests' fill
    jobs but their destinations; the bases are int32 ``[parts]`` (the regions' first
    entries: a bucket's offsets are int32); the padding offsets int64 ``[parts, pads]``,
    each fill job's output after its region's real entries."""
    pads = graph.batch_size - batch_size
    fixed = tuple(bucket.region(name) for name, _, _ in parts)
    per_pad = np.array(
        [1 if is_pages_region(name) else graph.tokens_per_request for name, _, _ in parts],
        dtype=np.int64,
    )
    table = np.empty((6, len(parts), graph.batch_size), dtype=np.int32)
    table[4] = np.array([div for _, div, _ in parts], np.int32)[:, None]
    table[5] = np.array([flag for _, _, flag in parts], np.int32)[:, None]
    table[0, :, batch_size:] = -1  # no row: a fill job reads the dummy page ...
    table[1, :, batch_size:] = graph.dummy_page
    table[2, :, batch_size:] = per_pad[:, None].astype(np.int32)
    table[4:, :, batch_size:] = np.array([1, 0], np.int32)[:, None, None]  # ... as a column
    table.setflags(write=False)
    bases = np.array([f.lo for f in fixed], dtype=np.int32)
    pad_offsets = per_pad[:, None] * np.arange(pads, dtype=np.int64)
    return fixed, table, bases, pad_offsets


def bucket_gather_jobs(
    spec: PlanSpec,
    rows: npt.NDArray[np.integer],
    bucket: BucketLayout,
    graph: GraphBucket,
    *,
    window_pool: bool = False,
    spans: Mapping[int, tuple[IntArray, IntArray]] | None = None,
) -> GatherJobs:
    """A batch's gather jobs in a bucket's fixed regions, padded: the jobs of
    :func:`~flashplan.executor.gathers.gather_jobs` (without encoder writes: a bucket
    writes no encoder K/V), each region's at its fixed base; then every padding request
    (``spec.batch_size .. graph.batch_size - 1``) gets a fill job per region, one dummy
    page in a page-id region, ``tokens_per_request`` unwritable slots in a write region,
    from a template kept per bucket and batch size. The page-id regions end where
    FlashInfer's ``kv_indices`` end (real pages, then one per padding request); write
    regions span all ``total_q`` slots.

    Args:
        spec: the plan (it fits ``graph``: :func:`check_fits`).
        rows: int ``[bs]`` table row per request.
        bucket: the fixed layout (:meth:`GraphBucket.layout`).
        graph: the bucket.
        window_pool, spans: as :func:`~flashplan.executor.gathers.gather_jobs`.
    """
    parts = job_parts(spec, window_pool, spans, False)
    return bucket_jobs(parts, rows, spec.batch_size, bucket, graph)


def bucket_jobs(
    parts: list[JobPart],
    rows: npt.NDArray[np.integer],
    bs: int,
    bucket: BucketLayout,
    graph: GraphBucket,
    key: tuple[tuple[str, int, int], ...] | None = None,
) -> GatherJobs:
    """:func:`bucket_gather_jobs` of the job parts ``parts``
    (:func:`~flashplan.executor.gathers.job_parts` of a ``bs``-request plan); ``key``:
    their ``(region name, divisor, page-map flag)``, when the caller keeps them."""
    if key is None:
        key = tuple([(p[0], p[3], p[4]) for p in parts])
    fixed, template, bases, pad_offsets = _bucket_template(bucket, key, bs, graph)
    table = template.copy()
    table[0, :, :bs] = np.asarray(rows, dtype=np.int32)
    for k, part in enumerate(parts):
        table[1, k, :bs] = part[1]
        table[2, k, :bs] = part[2]
    counts = table[2, :, :bs]
    # [parts, bs]: each region's running sum, in int32 (a region's real entries fit its
    # int32 capacity), then each job's first output: the sum before it plus the base
    ends = np.add.accumulate(counts, axis=1) if bs else np.zeros((len(parts), 1), np.int32)
    first = table[3, :, :bs]
    np.subtract(ends[:, :bs], counts, out=first)
    first += bases[:, None]
    sizes = tuple(ends[:, -1].tolist()) if bs else (0,) * len(parts)
    if pad_offsets.shape[1]:
        table[3, :, bs:] = pad_offsets + (bases + np.array(sizes))[:, None]
    table.setflags(write=False)
    regions = _filled_regions(fixed, sizes, pad_offsets.shape[1])
    return GatherJobs(table.reshape(6, -1), regions, bucket.total)


@functools.lru_cache(maxsize=256)
def _filled_regions(
    fixed: tuple[Region, ...], sizes: tuple[int, ...], pads: int
) -> tuple[Region, ...]:
    """The regions of a bucket's job table holding ``sizes`` real entries each and
    ``pads`` padding requests: a page-id region ends after its real pages and one page per
    padding request (where FlashInfer's ``kv_indices`` end); a write region keeps its
    fixed bounds. Memoized: a decode loop's page counts change once a page."""
    return tuple(
        Region(f.name, f.lo, f.lo + size + pads) if is_pages_region(f.name) else f
        for f, size in zip(fixed, sizes, strict=True)
    )


def padded_inputs(
    host: Mapping[str, IntArray], batch_size: int, graph: GraphBucket
) -> dict[str, IntArray]:
    """The ``plan()`` host arrays padded to the bucket's batch size.

    ``qo_indptr`` gains ``tokens_per_request`` rows per padding request; each group's
    ``page_indptr`` one page and its ``last_page_len`` and ``kv_lens`` one key (the dummy
    page's slot 0).
    A verify's tree-mask arrays gain padding requests of ``tokens_per_request`` rows
    whose every row sees that one key, at the offsets FlashInfer computes for them (their
    sizes: :func:`padded_masks`).

    Raises:
        BucketError: an array this function does not know how to pad.
    """
    pads = graph.batch_size - batch_size
    n = graph.tokens_per_request
    out: dict[str, IntArray] = {}
    for name, values in host.items():
        parsed = names.parse(name)
        field = parsed.field
        if field in ("qo_indptr", "page_indptr") and not parsed.kind:
            out[name] = padded_indptr(values, pads, n if field == "qo_indptr" else 1)
        elif parsed.kind == "mask":
            out[name] = _padded_mask_array(name, field, values, host, pads, n)
        elif field in ("last_page_len", "kv_lens"):  # one key per padding request
            out[name] = padded_lengths(values, pads)
        else:
            raise BucketError(name, "this host array cannot be padded to a bucket")
    return out


def padded_indptr(values: IntArray, pads: int, step: int) -> IntArray:
    """An indptr (int32 ``[bs + 1]``) run on by ``pads`` padding requests of ``step``
    entries each (the padded end fits int32: the bucket's sizes do)."""
    if not pads:
        return values
    return seal_inplace(np.concatenate([values, _pad_tail(pads, step) + values[-1]]))


def padded_lengths(values: IntArray, pads: int) -> IntArray:
    """Per-request lengths (int32 ``[bs]``: last-page lengths, KV lengths) with one key
    per padding request (the dummy page's slot 0)."""
    if not pads:
        return values
    return seal_inplace(np.concatenate([values, _pad_tail(pads, 0)]))


@functools.lru_cache(maxsize=256)
def _pad_tail(pads: int, step: int) -> IntArray:
    """int32 ``[pads]``, read-only: ``step, 2 step, …`` (what the padding requests add
    to an indptr's last entry), or ones for ``step = 0`` (their one key each)."""
    tail = (
        np.arange(1, pads + 1, dtype=np.int32) * np.int32(step) if step else np.ones(pads, np.int32)
    )
    tail.setflags(write=False)
    return tail


#: Per padding request (one key: the dummy page's slot 0), the entries of a tree or
#: position mask's per-request arrays: a padding request's first row sees its one key
#: (a position mask's rows sit at positions 0, 1, ... over the key at 0: every rule
#: shows it to row 0; later rows of a multi-token bucket may see nothing).
_MASK_PAD = {
    "kv_lens": 1,
    "first_visible": 0,
    "tail_start": 1,  # the key is a prefix key (below the draft columns)
    "row_offsets": 0,
    "row_position": 0,
    "col_position": 0,
}


def _padded_mask_array(
    name: str,
    field: str,
    values: IntArray,
    host: Mapping[str, IntArray],
    pads: int,
    n: int,
) -> IntArray:
    """One array of a device-built tree mask (``g<i>.mask.<field>``) padded with
    ``pads`` requests of ``n`` rows and one key each, which see that key."""
    prefix = name[: -len(field)]
    if field == "indptr":  # FlashInfer's offsets run on: n x 1 elements each
        tail = int(values[-1]) + n * np.arange(1, pads + 1, dtype=np.int64)
        return seal_inplace(np.concatenate([values.astype(np.int64), tail]))
    if field == "tail_words":  # [bs, n, ceil(n / 8)] packed rows as int32: no draft bits
        row_bytes = n * ((n + 7) // 8)
        used = int(host[prefix + "qo_lens"].shape[0]) * row_bytes
        words = np.zeros(used + pads * row_bytes, dtype=np.uint8)
        words[:used] = values.view(np.uint8)[:used]
        return bytes_as_int32(words)
    if field == "rule":  # one rule for the whole mask
        return values
    if field == "qo_lens":
        value = n
    elif field in _MASK_PAD:
        value = _MASK_PAD[field]
    else:
        raise BucketError(name, "this mask array cannot be padded to a bucket")
    count = pads * (n if field == "row_offsets" else 1)
    return seal_inplace(np.concatenate([values, np.full(count, value, np.int32)]))


def padded_masks(
    masks: Mapping[int, MaskRecipe], batch_size: int, graph: GraphBucket
) -> dict[int, MaskRecipe]:
    """The mask sizes of :func:`padded_inputs`' masks: each padding request adds
    ``tokens_per_request`` bytes at FlashInfer's offsets (one per element: ``n x 1``)."""
    pads = graph.batch_size - batch_size
    n = graph.tokens_per_request
    if not pads:
        return dict(masks)
    return {
        index: attrs.evolve(
            r, max_bytes=max(r.max_bytes, (n + 7) // 8), total_bytes=r.total_bytes + pads * n
        )
        for index, r in masks.items()
    }
