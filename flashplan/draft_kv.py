"""The two KV moves of a speculative-decoding round, which flashplan's plans assume the
engine makes (``docs/guide-speculative.md``), done for it: vectorized over the batch, on
the caches' device, without a sync.

* :func:`copy_prefix_pages` — before a multi-step draft decode with ``page_size > 1``:
  each request's partial last prefix page copied into the first own page of each of its
  branches (the branch's first draft token belongs in that page).
* :func:`compact_accepted` — after a target verify: each request's accepted path moved
  to the row tokens right after its prefix (verify wrote draft token ``t`` at row token
  ``L + t``; the next step reads accepted token ``j`` at ``L + j``).

Both take every cache they move K/V in (each ``[num_pages, 2, page_size, num_kv_heads,
head_dim]``: a layer's), read everything they move before writing anything, and touch no
other slot. The indices are computed on the host from host lengths and sent to the
device once (pinned, non-blocking); page ids are read from the table on the device.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

from flashplan.errors import LayoutError, PageTableError
from flashplan.layout.convert import as_int, as_lengths
from flashplan.layout.drafts import DraftTree
from flashplan.layout.page_table import PageTable

__all__ = ["compact_accepted", "copy_prefix_pages"]


def _on(device: torch.device, values: npt.NDArray[np.int64]) -> torch.Tensor:
    """int64 ``values`` on ``device``: from pinned memory, non-blocking, on a GPU."""
    t = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64))
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _check_caches(caches: Sequence[torch.Tensor], table: PageTable, page_size: int) -> None:
    for i, c in enumerate(caches):
        if (
            not isinstance(c, torch.Tensor)
            or c.dim() != 5
            or c.shape[1] != 2
            or c.shape[2] != page_size
            or c.device != table.pages.device
        ):
            raise PageTableError(
                "caches",
                f"each cache must be [num_pages, 2, page_size={page_size}, heads, head_dim] "
                f"on the table's device ({table.pages.device})",
                cache=i, shape=tuple(getattr(c, "shape", ())),
            )  # fmt: skip


def _host_lengths(field: str, values: object, batch_size: int) -> npt.NDArray[np.int64]:
    """Per-request host lengths (:func:`~flashplan.layout.convert.as_lengths`), one per
    request of the table, as int64 for the index arithmetic."""
    arr = as_lengths(field, values)
    if arr.shape[0] != batch_size:
        raise LayoutError(field, f"must hold one length per request ({batch_size})",
                          given=int(arr.shape[0]))  # fmt: skip
    return arr.astype(np.int64)


def copy_prefix_pages(
    caches: Sequence[torch.Tensor],
    table: PageTable,
    prefix_lens: object,
    branch_pages: torch.Tensor,
    *,
    page_size: int,
) -> int:
    """Copy each request's partial last prefix page into its branches' first own pages.

    For request ``i`` whose prefix ``prefix_lens[i]`` ends inside a page, page
    ``table.pages[table.rows[i], prefix_lens[i] // page_size]`` is copied, whole (K and
    V), to ``branch_pages[i, b, 0]`` for every branch ``b``, in every cache: what
    :meth:`PageTable.draft_branches` leaves to the engine before the draft steps.

    Args:
        caches: the draft model's caches, one per layer.
        table: the requests' table.
        prefix_lens: int ``[bs]`` (tokens) host prefix lengths (``DraftDecode.prefix_lens``).
        branch_pages: int32 ``[bs, topk, pages]`` on the table's device (the branches'
            own pages, as given to :meth:`PageTable.draft_branches`).
        page_size: tokens per page.

    Returns:
        The number of pages copied per cache.

    Raises:
        LayoutError: ``prefix_lens`` that is not one non-negative host integer per
            request.
        PageTableError: caches or ``branch_pages`` of another shape or device, or a
            partial last page past the request's table row (naming the request).
    """
    ps = as_int("page_size", page_size, minimum=1)
    bs = table.batch_size
    prefix = _host_lengths("prefix_lens", prefix_lens, bs)
    _check_caches(caches, table, ps)
    dev = table.pages.device
    if (
        not isinstance(branch_pages, torch.Tensor)
        or branch_pages.dtype != torch.int32
        or branch_pages.dim() != 3
        or branch_pages.shape[0] != bs
        or branch_pages.shape[2] < 1
        or branch_pages.device != dev
    ):
        raise PageTableError(
            "branch_pages", f"must be an int32 tensor [bs={bs}, topk, pages >= 1] on {dev}",
            shape=tuple(getattr(branch_pages, "shape", ())),
        )  # fmt: skip
    partial = np.flatnonzero(prefix % ps)
    if ps == 1 or not partial.size:
        return 0
    width = int(table.pages.shape[1])
    beyond = partial[prefix[partial] // ps >= width]
    if beyond.size:
        i = int(beyond[0])
        raise PageTableError(
            "prefix_lens", "the request's partial last page lies past its page-table row",
            request=i, prefix_len=int(prefix[i]), page=int(prefix[i] // ps), row_pages=width,
        )  # fmt: skip
    topk = int(branch_pages.shape[1])
    index = _on(dev, np.concatenate([table.rows[partial].astype(np.int64), prefix[partial] // ps,
                                     partial.astype(np.int64)]))  # fmt: skip
    n = partial.size
    rows, cols, reqs = index[:n], index[n : 2 * n], index[2 * n :]
    src = table.pages[rows, cols].long().repeat_interleave(topk)  # [n * topk]
    dst = branch_pages[reqs, :, 0].reshape(-1).long()
    for c in caches:
        c.index_copy_(0, dst, c.index_select(0, src))
    return int(n * topk)


def compact_accepted(
    caches: Sequence[torch.Tensor],
    table: PageTable,
    prefix_lens: object,
    tree: DraftTree,
    paths: Sequence[Sequence[int]],
    *,
    page_size: int,
) -> npt.NDArray[np.int32]:
    """Move each request's accepted path to the row tokens right after its prefix.

    Request ``i``'s verify wrote draft token ``t`` at row token ``L + t``
    (``L = prefix_lens[i]``). Its accepted path ``paths[i]`` — the root (token 0), then a
    chain of descendants in ``tree`` — is moved so that its ``j``-th token sits at row token
    ``L + j``, in every cache (tokens already in place are left alone; a chain's path
    always is). What lies beyond ``L + len(path)`` is left as it is: no plan reads it
    before a step overwrites it.

    Args:
        caches: the target's caches, one per layer.
        table: the requests' table (the verify's).
        prefix_lens: int ``[bs]`` (tokens) host prefix lengths of the verify.
        tree: the verified draft tree.
        paths: per request, the accepted token indices, root first.
        page_size: tokens per page.

    Returns:
        int32 ``[bs]``: each request's cached length after the move, ``L + len(path)``.

    Raises:
        LayoutError: a path that does not start at the root, does not follow the tree's
            parents, or is empty (naming the request and the token).
        PageTableError: caches of another shape or device, or a path beyond the table's
            row.
    """
    ps = as_int("page_size", page_size, minimum=1)
    bs = table.batch_size
    if not isinstance(tree, DraftTree) or tree.batch_size != bs:
        raise LayoutError("tree", f"must be a DraftTree of {bs} requests",
                          type=type(tree).__name__)  # fmt: skip
    prefix = _host_lengths("prefix_lens", prefix_lens, bs)
    _check_caches(caches, table, ps)
    if len(paths) != bs:
        raise LayoutError("paths", f"must hold one path per request ({bs})", given=len(paths))
    lengths = np.fromiter((len(p) for p in paths), dtype=np.int64, count=bs)
    flat = np.fromiter((int(t) for p in paths for t in p), dtype=np.int64, count=int(lengths.sum()))
    starts = np.concatenate([[0], np.cumsum(lengths)])
    req = np.repeat(np.arange(bs), lengths)
    j = np.arange(flat.shape[0]) - starts[req]  # position along the path
    _check_paths(tree, flat, req, j, lengths)
    end = prefix + lengths
    widest = np.maximum(prefix + tree.num_tokens, end)
    if bs and int(widest.max()) > table.max_pages * ps:
        i = int(np.argmax(widest))
        raise PageTableError("paths", "the verified tokens lie beyond the table's row",
                             request=i, tokens=int(widest[i]),
                             row_tokens=table.max_pages * ps)  # fmt: skip
    move = flat != j  # tokens already at L + j stay
    if move.any():
        rows = table.rows[req[move]].astype(np.int64)
        src = prefix[req[move]] + flat[move]
        dst = prefix[req[move]] + j[move]
        n = rows.shape[0]
        index = _on(table.pages.device,
                    np.concatenate([rows, src // ps, src % ps, dst // ps, dst % ps]))  # fmt: skip
        r, sp, so, dp, do = (index[k * n : (k + 1) * n] for k in range(5))
        src_page, dst_page = table.pages[r, sp].long(), table.pages[r, dp].long()
        for c in caches:
            kv = c[src_page, :, so]  # [n, 2, heads, head_dim]: every source read first
            c[dst_page, :, do] = kv
    return end.astype(np.int32)


def _check_paths(
    tree: DraftTree,
    flat: npt.NDArray[np.int64],
    req: npt.NDArray[np.int64],
    j: npt.NDArray[np.int64],
    lengths: npt.NDArray[np.int64],
) -> None:
    """Each path: non-empty, the root first, then each token a child of the one before."""
    if lengths.size and lengths.min() < 1:
        raise LayoutError("paths", "an accepted path holds at least the root",
                          request=int(np.argmin(lengths)))  # fmt: skip
    n = tree.num_tokens
    outside = (flat < 0) | (flat >= n)
    if outside.any():
        k = int(np.argmax(outside))
        raise LayoutError("paths", f"a token outside the tree's {n}", request=int(req[k]),
                          index=int(j[k]), token=int(flat[k]))  # fmt: skip
    first = j == 0
    not_root = first & (flat != 0)
    if not_root.any():
        k = int(np.argmax(not_root))
        raise LayoutError("paths", "a path starts at the root (token 0)", request=int(req[k]),
                          token=int(flat[k]))  # fmt: skip
    later = np.flatnonzero(~first)
    parent = tree.parents[req[later], flat[later]]
    broken = parent != flat[later - 1]
    if broken.any():
        k = int(later[int(np.argmax(broken))])
        raise LayoutError(
            "paths", "each accepted token is the child of the one before it",
            request=int(req[k]), index=int(j[k]), token=int(flat[k]),
            parent=int(tree.parents[req[k], flat[k]]), previous=int(flat[k - 1]),
        )  # fmt: skip
