"""CUDA-graph buckets: fixed buffer sizes and padding, as pure host functions. A CUDA
graph replays the pointers and grid sizes of its capture, so an engine captures one graph
per *bucket* (a batch size and a most-pages-per-request bound) and replays the smallest
one a batch fits (:func:`check_fits`), padded to it.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import accumulate

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
    Region,
    is_pages_region,
    job_parts,
    pages_region,
)
from flashplan.layout.batch import Mode
from flashplan.layout.convert import as_int
from flashplan.planning.spec import KernelPath, PlanKey, PlanSpec

__all__ = [
    "BucketLayout", "GraphBucket", "bucket_gather_jobs", "check_fits", "padded_inputs",
    "padded_masks",
]  # fmt: skip


def _bucket_mode(field: str, value: object) -> Mode:
    if isinstance(value, Mode):
        return value
    raise BucketError(field, "must be a flashplan.Mode", value=value)


@attrs.frozen(cache_hash=True)
class BucketLayout:
    """Where a bucket's fixed gather regions live in its gather output buffer:
    ``regions``, each at its fixed base with its capacity (entries), ``total`` entries."""

    regions: tuple[Region, ...]
    total: int

    def region(self, name: str) -> Region:
        """The fixed region called ``name``."""
        for r in self.regions:
            if r.name == name:
                return r
        raise KeyError(name)


@attrs.frozen(cache_hash=True)
class GraphBucket:
    """The fixed shape a CUDA graph is captured for.

    Attributes:
        mode: :attr:`Mode.DECODE`, :attr:`Mode.EXTEND` (draft extend) or
            :attr:`Mode.VERIFY` (target verify, tree masks included).
        batch_size: requests the graph runs (a smaller batch is padded to it).
        max_pages: most pages one request's kernel call may read (page-table columns).
        tokens_per_request: new tokens per request (1 for decode).
        dummy_page: the page id padding requests read (any valid page of the cache).
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
        for what, value in (("batch_size * max_pages", self.batch_size * self.max_pages),
                            ("batch_size * tokens_per_request", self.total_q)):  # fmt: skip
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
        """Bytes of one masked group's fixed mask buffer: every request's ``tokens_per_request
        x (max_pages * page_size)`` mask at FlashInfer's offsets (one byte per element)."""
        return self.total_q * self.max_pages * page_size

    @property
    def total_q(self) -> int:
        """Rows of ``q`` (and of new K/V) the graph runs: ``batch_size * tokens_per_request``."""
        return self.batch_size * self.tokens_per_request

    def layout(self, key: PlanKey, *, window_pool: bool) -> BucketLayout:
        """The fixed gather regions for plans with ``key``: ``batch_size * max_pages`` page
        ids per paged group, ``total_q`` write slots (twice with a window pool)."""
        paged = [i for i, path in enumerate(key.paths) if path is not KernelPath.RAGGED]
        sizes = [(pages_region(i), self.batch_size * self.max_pages) for i in paged]
        if any(not g.cross_attention for g in key.groups):
            sizes.append((WRITE, self.total_q))
            if window_pool and any(g.uses_window_pool for g in key.groups):
                sizes.append((WRITE_WINDOW, self.total_q))
        bounds = list(accumulate([size for _, size in sizes], initial=0))
        regions = tuple(map(Region, [name for name, _ in sizes], bounds[:-1], bounds[1:]))
        return BucketLayout(regions, max(bounds[-1], 1))


def check_fits(spec: PlanSpec, bucket: GraphBucket) -> None:
    """Raise :class:`~flashplan.BucketError` unless ``spec`` fits ``bucket``: not a
    multi-item batch, the bucket's mode, at most ``batch_size`` requests of exactly
    ``tokens_per_request`` new tokens, paged calls only (so the only custom masks are a
    verify's tree masks) reading at most ``max_pages`` pages per request."""
    if spec.key.multi_item:
        raise BucketError(
            "item_delimiters", "CUDA-graph buckets do not run multi-item batches (run them eagerly)"
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


def bucket_gather_jobs(
    spec: PlanSpec, rows: npt.NDArray[np.integer], bucket: BucketLayout, graph: GraphBucket, *,
    window_pool: bool = False, spans: Mapping[int, tuple[IntArray, IntArray]] | None = None,
    dense: frozenset[int] = frozenset(),
) -> GatherJobs:  # fmt: skip
    """The gather jobs of ``spec`` (it fits ``graph``; ``rows``: int ``[bs]`` table row per
    request) in the fixed regions ``bucket``, without encoder writes, padded: per padding
    request a fill job per region, reading the dummy page (page-id regions: one entry, so
    they end where FlashInfer's ``kv_indices`` end) or writing nowhere (write regions:
    ``tokens_per_request`` entries). ``window_pool``, ``spans``: as
    :func:`~flashplan.executor.gathers.gather_jobs`; ``dense``: the groups whose region is
    a dense block table of ``max_pages`` columns (XQA), request ``i``'s row at ``i *
    max_pages``, the whole fixed region."""
    bs, pads = spec.batch_size, graph.batch_size - spec.batch_size
    parts = job_parts(spec, window_pool, spans, False)
    dense_regions = {pages_region(i) for i in dense}
    table = np.empty((6, len(parts), graph.batch_size), dtype=np.int32)
    table[0, :, :bs] = rows
    table[0:2, :, bs:] = np.array([-1, graph.dummy_page], np.int32)[:, None, None]
    table[4:6, :, bs:] = np.array([1, 0], np.int32)[:, None, None]  # the page as a column
    regions = []
    for k, (name, first, counts, div, use_map) in enumerate(parts):
        fixed, pages = bucket.region(name), is_pages_region(name)
        table[1:3, k, :bs] = first, counts
        table[2, k, bs:] = 1 if pages else graph.tokens_per_request
        table[4:6, k, :bs] = np.array([div, use_map], np.int32)[:, None]
        if name in dense_regions:  # a row of max_pages per request
            table[3, k] = fixed.lo + graph.max_pages * np.arange(graph.batch_size, dtype=np.int32)
            regions.append(fixed)
            continue
        ends = np.add.accumulate(table[2, k])  # int32: a region's entries fit its capacity
        table[3, k] = ends - table[2, k] + fixed.lo
        size = int(ends[bs - 1]) if bs else 0
        regions.append(Region(name, fixed.lo, fixed.lo + size + pads) if pages else fixed)
    table.setflags(write=False)
    return GatherJobs(table.reshape(6, -1), tuple(regions), bucket.total)


def padded_inputs(
    host: Mapping[str, IntArray], batch_size: int, graph: GraphBucket
) -> dict[str, IntArray]:
    """The ``plan()`` host arrays padded to the bucket's batch size: each padding request
    has ``tokens_per_request`` query rows and one key (the dummy page's slot 0).

    Raises:
        BucketError: an array this function does not know how to pad.
    """
    pads, n = graph.batch_size - batch_size, graph.tokens_per_request
    out: dict[str, IntArray] = {}
    for name, values in host.items():
        parsed = names.parse(name)
        field = parsed.field
        if field in ("qo_indptr", "page_indptr") and not parsed.kind:
            step = n if field == "qo_indptr" else 1
            tail = values[-1] + step * np.arange(1, pads + 1, dtype=np.int32)
        elif parsed.kind == "mask":
            out[name] = _padded_mask_array(name, field, values, host, pads, n)
            continue
        elif field in ("last_page_len", "kv_lens"):  # one key per padding request
            tail = np.ones(pads, np.int32)
        else:
            raise BucketError(name, "this host array cannot be padded to a bucket")
        out[name] = seal_inplace(np.concatenate([values, tail])) if pads else values
    return out


#: Per padding request, the entries of a tree or position mask's per-request arrays:
#: its first row sees its one key (a position mask's rows sit at positions 0, 1, ...
#: over the key at 0; later rows of a multi-token bucket may see nothing).
_MASK_PAD = {
    "kv_lens": 1, "first_visible": 0, "row_offsets": 0, "row_position": 0, "col_position": 0,
    "tail_start": 1,  # the key is a prefix key (below the draft columns)
}  # fmt: skip


def _padded_mask_array(
    name: str, field: str, values: IntArray, host: Mapping[str, IntArray], pads: int, n: int
) -> IntArray:
    """One array of a device-built mask (``g<i>.mask.<field>``) padded with ``pads``
    requests of ``n`` rows and one key each, which see that key."""
    if field == "indptr":  # FlashInfer's offsets run on: n x 1 elements each
        tail = int(values[-1]) + n * np.arange(1, pads + 1, dtype=np.int64)
        return seal_inplace(np.concatenate([values.astype(np.int64), tail]))
    if field == "tail_words":  # [bs, n, ceil(n / 8)] packed rows as int32: no draft bits
        row_bytes = n * ((n + 7) // 8)
        used = int(host[name[: -len(field)] + "qo_lens"].shape[0]) * row_bytes
        words = np.zeros(used + pads * row_bytes, dtype=np.uint8)
        words[:used] = values.view(np.uint8)[:used]
        return bytes_as_int32(words)
    if field == "rule":  # one rule for the whole mask
        return values
    if field != "qo_lens" and field not in _MASK_PAD:
        raise BucketError(name, "this mask array cannot be padded to a bucket")
    value = n if field == "qo_lens" else _MASK_PAD[field]
    count = pads * (n if field == "row_offsets" else 1)
    return seal_inplace(np.concatenate([values, np.full(count, value, np.int32)]))


def padded_masks(
    masks: Mapping[int, MaskRecipe], batch_size: int, graph: GraphBucket
) -> dict[int, MaskRecipe]:
    """The mask sizes of :func:`padded_inputs`' masks: each padding request adds
    ``tokens_per_request`` bytes at FlashInfer's offsets (one per element: ``n x 1``)."""
    pads, n = graph.batch_size - batch_size, graph.tokens_per_request
    if not pads:
        return dict(masks)
    return {
        index: attrs.evolve(
            r, max_bytes=max(r.max_bytes, (n + 7) // 8), total_bytes=r.total_bytes + pads * n
        )
        for index, r in masks.items()
    }
