"""The reference executor's index preparation: which cache slots a kernel call reads,
which rows of ``q`` each of its entries (requests, or virtual requests) holds, and the
attention sinks' fold (host numpy and plain torch; see
:class:`~flashplan.executor.reference.ReferenceExecutor`)."""

from __future__ import annotations

import attrs
import numpy as np
import numpy.typing as npt
import torch

from flashplan.errors import PageTableError
from flashplan.executor.checks import first_shared_slot
from flashplan.executor.gathers import GatherJobs, level_pages_region, pages_region
from flashplan.kernel_rules import kernel_visibility
from flashplan.layout.page_table import PageTable
from flashplan.lengths import Lengths
from flashplan.planning.cascade import Cascade
from flashplan.planning.spec import GroupPlan, PagedPart, PlanSpec

__all__ = [
    "CallRows",
    "PagedCall",
    "Slots",
    "call_rows",
    "cascade_calls",
    "check_collisions",
    "entries",
    "entry_queries",
    "paged_call",
]


@attrs.frozen(eq=False)
class CallRows:
    """The query rows of a kernel call's entries, padded: ``index`` int64 ``[n, max_q]``
    (the row of ``q`` of query ``j`` of entry ``v``; 0 for padding) and ``valid`` bool
    ``[n, max_q]``, on the device; ``host_valid`` is ``valid`` on the host."""

    index: torch.Tensor
    valid: torch.Tensor
    host_valid: npt.NDArray[np.bool_]

    @property
    def shape(self) -> tuple[int, int]:
        """``(n, max_q)``."""
        return (int(self.index.shape[0]), int(self.index.shape[1]))


def call_rows(queries: Lengths, dev: torch.device) -> CallRows:
    """The padded query rows of entries whose queries are ``queries``."""
    index, valid = padded_rows(queries.indptr, queries.max_len)
    return CallRows(torch.from_numpy(index).to(dev), torch.from_numpy(valid).to(dev), valid)


def entry_queries(spec: PlanSpec, gp: GroupPlan) -> tuple[Lengths, npt.NDArray[np.int64]]:
    """The queries of the group's kernel-call entries and the request of each."""
    if gp.virtual is None:
        return spec.queries, np.arange(spec.batch_size, dtype=np.int64)
    return gp.virtual.queries, gp.virtual.request.astype(np.int64)


def paged_call(
    part: PagedPart,
    queries: Lengths,
    request: npt.NDArray[np.int64],
    region_page: np.ndarray,
    region_offset: np.ndarray,
    dev: torch.device,
    what: str,
    *,
    rows: CallRows | None = None,
) -> PagedCall:
    """One paged kernel call over its entries (the plan's requests, or the group's
    virtual requests, whose pages lie end to end in the call's gathered region).
    ``rows``: the entries' query rows when they are not ``queries``' own consecutive
    spans (a cascade level's groups)."""
    call = part.call_spans
    ps = part.page_size
    entry, c = entries(call.kv_lens)
    at = call.pages.indptr[:-1].astype(np.int64)[entry] + c // ps
    keys = Slots(region_page[at], c % ps, request[entry], region_offset[at] < 0, what)
    max_kv = call.max_kv_len
    qo_lens = queries.lens
    visible = kernel_visibility(
        qo_lens, call.kv_lens, queries.max_len, max_kv, causal=part.causal,
        window_left=part.window_left, items=part.items,
    )  # fmt: skip
    if part.mask is not None or part.position_mask is not None:
        for v in np.flatnonzero((qo_lens > 0) & (call.kv_lens > 0)).tolist():
            q, kv = int(qo_lens[v]), int(call.kv_lens[v])
            dense = part.dense_mask(v)
            assert dense is not None
            visible[v, :q, :kv] &= dense
    page_t, slot_t = keys.device(dev)
    return PagedCall(
        keys=keys,
        padded_index=torch.from_numpy(entry * max_kv + c).to(dev),
        page=page_t,
        slot=slot_t,
        visible=torch.from_numpy(visible).to(dev),
        max_kv=max_kv,
        rows=call_rows(queries, dev) if rows is None else rows,
    )


def cascade_calls(
    cascade: Cascade,
    spec: PlanSpec,
    jobs: GatherJobs,
    page: np.ndarray,
    offset: np.ndarray,
    dev: torch.device,
) -> dict[int, list[PagedCall]]:
    """The kernel calls of each group that runs on cascade levels (keyed by its index
    in ``spec.group_plans``): one per level (its groups as entries: their members'
    query rows, the group's shared pages, every key visible; shared by the groups),
    then each request's own call (:meth:`Cascade.own_call
    <flashplan.planning.cascade.Cascade.own_call>`: the group's own causal flag or the
    tree mask). The pages are the batch's gather's (``jobs``, gathered into ``page`` /
    ``offset``, built with the cascade's own spans and level spans as the FlashInfer
    executor builds them): each level's region ``pages/l<k>`` and each group's own
    region for its own calls."""

    def region(name: str) -> tuple[np.ndarray, np.ndarray]:
        r = jobs.region(name)
        return page[r.lo : r.hi], offset[r.lo : r.hi]

    levels = []
    for index, level in enumerate(cascade.levels.levels):
        sizes = np.diff(level.qo_indptr)
        idx, valid = padded_rows(level.qo_indptr, level.max_queries)
        index_rows = np.where(valid, level.q_rows.astype(np.int64)[idx], 0)
        entry_rows = CallRows(
            torch.from_numpy(index_rows).to(dev), torch.from_numpy(valid).to(dev), valid
        )
        part = PagedPart.over(level.spans, causal=False, window_left=-1)
        levels.append(
            paged_call(
                part, Lengths.from_lens(sizes, "qo_lens"), level.row_of.astype(np.int64),
                *region(level_pages_region(index)), dev, f"reads for cascade level {index}",
                rows=entry_rows,
            )
        )  # fmt: skip
    request = np.arange(spec.batch_size, dtype=np.int64)
    calls = {}
    for group in cascade.groups:
        own = paged_call(
            cascade.own_call(group), spec.queries, request, *region(pages_region(group)), dev,
            f"reads for group {group}'s own cascade parts",
        )  # fmt: skip
        calls[group] = [*levels, own]
    return calls


@attrs.frozen(eq=False)
class Slots:
    """Host (page, slot) of a list of cache entries, with the request each belongs to."""

    page: npt.NDArray[np.int64]
    slot: npt.NDArray[np.int64]
    request: npt.NDArray[np.int64]
    bad: npt.NDArray[np.bool_]  # the gather found no valid page id
    what: str  # "reads group 0's keys", "writes the new tokens' K/V" …

    def check(self, num_pages: int, table: PageTable) -> None:
        """Raise PageTableError for the first entry whose page is bad or outside the cache."""
        wrong = self.bad | (self.page >= num_pages)
        if wrong.any():
            k = int(np.flatnonzero(wrong)[0])
            i = int(self.request[k])
            raise PageTableError(
                "pages",
                f"a page id the plan {self.what} is not a page of the KV cache "
                "(negative, evicted from the window pool, or beyond the cache)",
                request=i,
                row=int(table.rows[i]),
                num_pages=num_pages,
            )

    def device(self, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.from_numpy(self.page).to(dev), torch.from_numpy(self.slot).to(dev)


@attrs.frozen(eq=False)
class PagedCall:
    """One paged kernel call: its keys' cache slots and where they go in the padding."""

    keys: Slots
    padded_index: torch.Tensor  # int64 [n_keys]: b * max_kv + c of each key
    page: torch.Tensor  # int64 [n_keys] on the device
    slot: torch.Tensor
    visible: torch.Tensor  # bool [n, max_q, max_kv]: n calls' entries (virtual requests)
    max_kv: int
    rows: CallRows  # the entries' query rows


def padded_rows(indptr: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """``(index [bs, width], valid [bs, width])``: the rows of each indptr span, padded
    (host int64 / bool)."""
    lens = np.diff(indptr.astype(np.int64))
    j = np.arange(width, dtype=np.int64)[None, :]
    valid = j < lens[:, None]
    index = np.where(valid, indptr[:-1, None].astype(np.int64) + j, 0)
    return index, valid


def entries(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(request, k)`` of every entry of per-request runs of ``counts`` entries."""
    c = counts.astype(np.int64)
    req = np.repeat(np.arange(c.shape[0]), c)
    k = np.arange(req.shape[0]) - np.repeat(np.cumsum(c) - c, c)
    return req, k


def check_collisions(slots: Slots, page_size: int, table: PageTable) -> None:
    """Raise PageTableError when two entries would write the same cache slot."""
    ok = ~slots.bad
    if not ok.any():
        return
    shared = first_shared_slot(slots.page[ok].astype(np.int64) * page_size + slots.slot[ok])
    if shared is not None:
        reqs = slots.request[ok][list(shared)]
        first, second = sorted(int(r) for r in reqs)
        raise PageTableError(
            "pages",
            f"two tokens the plan {slots.what} share one cache slot (their rows hold the "
            "same page id), so one would overwrite the other",
            request=second,
            other_request=first,
            page=int(slots.page[ok][shared[0]]),
        )
