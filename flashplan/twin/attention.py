"""The attention FlashInfer 0.7.4's kernels compute over a planned batch, in torch: the
records a twin ``plan()`` stores (:class:`Params`, :class:`Arrays`), which keys each
query of a request sees, the softmax over them, and the run over a batch's requests.
The CPU twin's wrappers (:mod:`~flashplan.twin.wrappers`) are its API.

The rules, as FlashInfer's kernels state them (request with ``qo_len`` queries and
``kv_len`` keys; query ``j`` sits at key position ``p = kv_len - qo_len + j``):

* **keys**: a paged request's pages ``indices[indptr[i]:indptr[i + 1]]``, the last one
  holding ``last_page_len[i]`` tokens (``kv_len = (pages - 1) * page_size + last``, 0
  without pages); a ragged request's key rows ``kv_indptr[i]:kv_indptr[i + 1]``;
* **causal** (aligned bottom-right): key ``k`` is visible iff ``k <= p``;
* **window** ``W >= 0``: additionally ``k >= p - W`` (``-1``: no window);
* **packed custom mask** (replaces the causal flag; the window still applies): bit
  ``j * kv_len + k`` of the request's bytes, little-endian within a byte (bit ``e % 8``
  of byte ``e // 8``), from byte ``mask_indptr[i]`` on;
* **multi-item scoring** (replaces mask and causal flag; always causal, window kept): a
  query with ``p < prefix_len`` is causal; any other sees the keys ``k < prefix_len``
  and ``p - t < k <= p`` with ``t`` its ``token_pos_in_items`` entry (0 at a
  delimiter, which so sees the prefix only);
* **logits**: ``s = sm_scale * q.k`` (run's ``q_scale``/``k_scale`` multiply
  ``sm_scale``), then ``cap * tanh(s / cap)`` with a soft cap; GQA: query head ``h``
  reads KV head ``h // (num_qo_heads // num_kv_heads)``;
* **sink** (FlashInfer's attention-sink variant): one more denominator term
  ``exp(sinks[h])`` that carries no value; the LSE includes it;
* **output**: softmax-weighted values (times run's ``v_scale``) in the plan's
  ``o_data_type``; the LSE float32 in **base 2**; a query that sees no key (and has no
  sink) gets output 0 and LSE ``-inf``. Math in float32 (float64 for a float64 query).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import attrs
import torch

from flashplan.errors import BucketError, FlashplanError, PageTableError, PlanMismatchError

__all__ = [
    "Arrays",
    "Items",
    "KeySource",
    "Logits",
    "Params",
    "attend",
    "check_indptr",
    "item_visibility",
    "mask_indptr",
    "packed_bits",
    "paged_keys",
    "paged_kv_lens",
    "ragged_keys",
    "run_batch",
    "visible_keys",
]

Tensor = torch.Tensor
#: A paged KV cache: NHD ``[pages, 2, page_size, heads, dim]`` or a ``(k, v)`` tuple of
#: ``[pages, page_size, heads, dim]``.
KVCache = Tensor | tuple[Tensor, Tensor]

_LN2 = math.log(2.0)


@attrs.frozen
class Logits:
    """How a call turns ``q . k`` into logits.

    Attributes:
        sm_scale: softmax scale (the plan's or the sink run's, times run's
            ``q_scale`` and ``k_scale``).
        soft_cap: logits soft cap (0: off).
    """

    sm_scale: float
    soft_cap: float


@attrs.frozen(eq=False)
class Items:
    """One request's multi-item scoring tensors, as FlashInfer's kernel reads them.

    Attributes:
        prefix_len: keys (and query positions) below this are the shared prefix.
        positions: int64 ``[token_pos_in_items_len]``: the request's row of
            ``token_pos_in_items`` (entry ``p - prefix_len`` for the query at key
            position ``p``).
        max_item_len: the request's ``max_item_len_ptr`` entry.
    """

    prefix_len: int
    positions: torch.Tensor
    max_item_len: int


def visible_keys(
    qo_len: int, kv_len: int, *, causal: bool, window_left: int,
    mask_bits: torch.Tensor | None = None, items: Items | None = None, request: int = 0,
    device: torch.device | None = None,
) -> torch.Tensor:  # fmt: skip
    """bool ``[qo_len, kv_len]``: whether query ``j`` of a request sees key ``k``, by the
    rules of the module docstring (multi-item, else custom mask, else causal flag; the
    window always).

    Args:
        mask_bits: bool ``[qo_len, kv_len]`` of a packed custom mask (:func:`packed_bits`).
        items: the request's multi-item tensors.
        request: the request's index (for errors).

    Raises:
        FlashplanError: a multi-item row too short, or a ``max_item_len`` below a
            query's position in its item (FlashInfer's kernel would skip keys).
    """
    if items is not None:
        return item_visibility(qo_len, kv_len, items, window_left, request=request, device=device)
    pos = torch.arange(qo_len, device=device)[:, None] + (kv_len - qo_len)
    key = torch.arange(kv_len, device=device)[None, :]
    if mask_bits is not None:
        seen = mask_bits.clone()
    elif causal:
        seen = key <= pos
    else:
        seen = torch.ones(qo_len, kv_len, dtype=torch.bool, device=device)
    if window_left >= 0:
        seen &= key >= pos - window_left
    return seen


def packed_bits(
    mask: torch.Tensor, byte_offset: int, qo_len: int, kv_len: int, *, request: int = 0
) -> torch.Tensor:
    """bool ``[qo_len, kv_len]``: the request's bits of a packed custom mask, read from
    byte ``byte_offset`` of ``mask`` (uint8 ``[n]``) on, little-endian, row-major.

    Raises:
        FlashplanError: the request's bytes lie outside ``mask`` (FlashInfer would read
            past the buffer).
    """
    n = qo_len * kv_len
    if n == 0:
        return torch.zeros(qo_len, kv_len, dtype=torch.bool, device=mask.device)
    n_bytes = (n + 7) // 8
    if byte_offset < 0 or byte_offset + n_bytes > mask.numel():
        raise FlashplanError(
            "packed_custom_mask", "the request's bytes lie outside the mask buffer",
            request=request, byte_offset=byte_offset, bytes=n_bytes, buffer_bytes=mask.numel(),
        )  # fmt: skip
    data = mask[byte_offset : byte_offset + n_bytes].to(torch.int64)
    bits = (data[:, None] >> torch.arange(8, device=mask.device)[None, :]) & 1
    return bits.reshape(-1)[:n].reshape(qo_len, kv_len).bool()


def item_visibility(
    qo_len: int, kv_len: int, items: Items, window_left: int, *, request: int = 0,
    device: torch.device | None = None,
) -> torch.Tensor:  # fmt: skip
    """bool ``[qo_len, kv_len]``: FlashInfer's multi-item scoring mask of one request
    (module docstring).

    Raises:
        FlashplanError: ``token_pos_in_items`` has no entry for a query, or
            ``max_item_len`` is below a query's entry.
    """
    pos = torch.arange(qo_len, device=device) + (kv_len - qo_len)
    key = torch.arange(kv_len, device=device)[None, :]
    seen = key <= pos[:, None]
    if window_left >= 0:
        seen &= key >= pos[:, None] - window_left
    in_items = pos >= items.prefix_len
    index = (pos - items.prefix_len)[in_items]
    if index.numel() and int(index.max()) >= items.positions.numel():
        raise FlashplanError(
            "token_pos_in_items_ptr", "the request's row has no entry for a query past the prefix",
            request=request, needed=int(index.max()) + 1, row_length=items.positions.numel(),
        )  # fmt: skip
    t = torch.zeros(qo_len, dtype=torch.int64, device=device)
    t[in_items] = items.positions.to(device)[index]
    if in_items.any() and int(t.max()) > items.max_item_len:
        raise FlashplanError(
            "max_item_len_ptr",
            "below a query's position in its item: FlashInfer's kernel skips the keys "
            "before position - max_item_len", request=request, max_item_len=items.max_item_len,
            largest_position=int(t.max()),
        )  # fmt: skip
    item_keys = (key < items.prefix_len) | (key > (pos - t)[:, None])
    return seen & (item_keys | ~in_items[:, None])


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seen: torch.Tensor, logits: Logits,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One request's attention in ``q``'s dtype (float32 or float64).

    Args:
        q: ``[qo_len, num_qo_heads, head_dim]``.
        k, v: ``[kv_len, num_kv_heads, head_dim]`` (query head ``h`` reads KV head
            ``h // (num_qo_heads // num_kv_heads)``), any float dtype.
        seen: bool ``[qo_len, kv_len]`` (:func:`visible_keys`).
        logits: scale and soft cap.
        sinks: float ``[num_qo_heads]`` sink logits (natural-log units), or ``None``.

    Returns:
        ``(out [qo_len, num_qo_heads, head_dim], lse [qo_len, num_qo_heads])`` in ``q``'s
        dtype, the LSE in base 2.
    """
    qo_len, hq, _ = q.shape
    group = hq // max(k.shape[1], 1)
    kh = k.to(q.dtype).repeat_interleave(group, dim=1)
    vh = v.to(q.dtype).repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, kh) * logits.sm_scale
    if logits.soft_cap > 0:
        s = logits.soft_cap * torch.tanh(s / logits.soft_cap)
    s = s.masked_fill(~seen[None], -math.inf)
    if sinks is not None:
        column = sinks.to(q.dtype)[:, None, None].expand(hq, qo_len, 1)
        lse = torch.logsumexp(torch.cat([s, column], dim=-1), dim=-1)
    else:
        lse = torch.logsumexp(s, dim=-1)  # [hq, qo_len]; -inf where nothing is seen
    base = torch.where(lse == -math.inf, torch.zeros_like(lse), lse)
    p = torch.exp(s - base[..., None])  # 0 where not seen
    out = torch.einsum("hqk,khd->qhd", p, vh)
    return out, (lse / _LN2).T


# --------------------------------------------------------------------------- a planned batch
@attrs.frozen
class Params:
    """What a ``plan()`` fixes besides the arrays (the compiled kernel's settings).

    ``page_size`` is 0 for a ragged wrapper; ``items`` holds the multi-item tensors by
    reference: ``(prefix_len_ptr, token_pos_in_items_ptr, token_pos_in_items_len,
    max_item_len_ptr)``.
    """

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    causal: bool
    window_left: int
    soft_cap: float
    sm_scale: float
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    o_dtype: torch.dtype
    items: tuple[Tensor, Tensor, int, Tensor] | None = None

    @classmethod
    def make(cls, num_qo_heads: int, num_kv_heads: int, head_dim: int, **kw: Any) -> Params:
        """Checked settings; ``kw`` the other fields, of which ``sm_scale`` (default
        ``1 / sqrt(head_dim)``) and ``soft_cap`` (default 0) may be ``None``.

        Raises:
            FlashplanError: heads that GQA cannot pair, or a window below -1.
        """
        if num_kv_heads < 1 or num_qo_heads % num_kv_heads:
            raise FlashplanError(
                "num_qo_heads", "must be a multiple of num_kv_heads",
                num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
            )  # fmt: skip
        if kw["window_left"] < -1:
            raise FlashplanError("window_left", "must be >= -1", value=kw["window_left"])
        scale = kw.pop("sm_scale")
        kw["sm_scale"] = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
        kw["soft_cap"] = float(kw["soft_cap"] or 0.0)
        return cls(num_qo_heads, num_kv_heads, head_dim, **kw)

    def request_items(self, i: int) -> Items | None:
        """Request ``i``'s multi-item tensors, or ``None``."""
        if self.items is None:
            return None
        prefix, tpos, length, longest = self.items
        row = tpos[i * length : (i + 1) * length].to(torch.int64)
        return Items(int(prefix[i].to(torch.int64)), row, int(longest[i].to(torch.int64)))


@attrs.frozen
class Arrays:
    """The index arrays a run reads: ``qo_indptr`` (``None``: one query per request, a
    decode), ``kv_indptr`` (pages, or ragged key rows), ``indices`` and
    ``last_page_len`` (paged only), ``mask`` (uint8) and ``mask_indptr`` (its byte
    offsets) of a custom mask; int32 unless said."""

    qo_indptr: Tensor | None
    kv_indptr: Tensor
    indices: Tensor | None = None
    last_page_len: Tensor | None = None
    mask: Tensor | None = None
    mask_indptr: Tensor | None = None

    @property
    def batch_size(self) -> int:
        """Requests (``len(kv_indptr) - 1``)."""
        return int(self.kv_indptr.shape[0]) - 1

    def copy_into(self, fixed: Arrays, *, copy: bool = True) -> None:
        """Copy these arrays into a CUDA-graph wrapper's fixed buffers ``fixed`` (with
        ``copy`` off only check that they fit).

        Raises:
            PlanMismatchError: another batch size than the buffers'.
            BucketError: page ids or mask bytes beyond their buffer.
        """
        if self.batch_size != fixed.batch_size:
            raise PlanMismatchError(
                "indptr", "a CUDA-graph wrapper's batch size is fixed",
                batch_size=self.batch_size, fixed=fixed.batch_size,
            )  # fmt: skip
        for name in ("qo_indptr", "kv_indptr", "last_page_len", "mask_indptr"):
            src, dst = getattr(self, name), getattr(fixed, name)
            if copy and src is not None and dst is not None:
                dst.copy_(src)
        for name in ("indices", "mask"):
            src, dst = getattr(self, name), getattr(fixed, name)
            if src is None or dst is None:
                continue
            if src.numel() > dst.numel():
                raise BucketError(
                    name, "longer than the CUDA-graph wrapper's buffer",
                    length=src.numel(), buffer=dst.numel(),
                )  # fmt: skip
            if copy:
                dst[: src.numel()].copy_(src)


def mask_indptr(qo_lens: list[int], kv_lens: list[int], device: torch.device) -> Tensor:
    """FlashInfer 0.7.4's mask offsets: the running sum of ``qo_len * kv_len`` (bits),
    which its kernel reads as byte offsets (flashinfer PR #2201). int32 ``[bs + 1]``."""
    sums = [0]
    for q, kv in zip(qo_lens, kv_lens, strict=True):
        sums.append(sums[-1] + q * kv)
    return torch.tensor(sums, dtype=torch.int32, device=device)


def paged_kv_lens(indptr: Tensor, last: Tensor, page_size: int) -> list[int]:
    """kv lengths by FlashInfer's planner formula ``(pages - 1) * page_size + last``
    (negative for an empty span, as its ``plan()`` counts one for the mask offsets)."""
    pages = torch.diff(indptr.to(torch.int64)).tolist()
    return [(n - 1) * page_size + int(x) for n, x in zip(pages, last.tolist(), strict=True)]


def check_indptr(name: str, values: list[int], limit: int) -> None:
    """Raise :class:`~flashplan.errors.FlashplanError` unless the index pointer
    ``values`` is non-decreasing within ``[0, limit]``."""
    for i in range(len(values) - 1):
        if not 0 <= values[i] <= values[i + 1] <= limit:
            raise FlashplanError(
                name, "must be non-decreasing within [0, limit]", request=i,
                start=values[i], end=values[i + 1], limit=limit,
            )  # fmt: skip


#: Request ``i``'s keys and values ``[kv_len, num_kv_heads, head_dim]`` under a plan.
KeySource = Callable[[int, Params, Arrays], tuple[Tensor, Tensor]]


def run_batch(
    q: Tensor, params: Params, arrays: Arrays, keys: KeySource, logits: Logits, *,
    sinks: Tensor | None = None, v_scale: float | None = None, exact_rows: bool = True,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Every request's attention: ``(out [rows, num_qo_heads, head_dim]`` in the plan's
    ``o_data_type``, ``lse [rows, num_qo_heads]`` float32 base 2). Rows no request
    covers (CUDA-graph padding, ``exact_rows`` off) are NaN: FlashInfer leaves them
    undefined.

    Raises:
        PlanMismatchError: ``q`` unlike the plan (heads, size, dtype, rows).
        FlashplanError: index arrays out of range (see :func:`paged_keys`).
    """
    bs = arrays.batch_size
    qo = list(range(bs + 1)) if arrays.qo_indptr is None else arrays.qo_indptr.tolist()
    _check_q(q, params, qo[-1], exact=exact_rows)
    check_indptr("qo_indptr", qo, q.shape[0])
    math_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf = q.to(math_dtype)
    out = torch.full(q.shape, math.nan, dtype=math_dtype, device=q.device)
    lse = torch.full(q.shape[:2], math.nan, dtype=torch.float32, device=q.device)
    masks = _mask_reader(params, arrays, qo)
    for i in range(bs):
        k, v = keys(i, params, arrays)
        seen = visible_keys(
            qo[i + 1] - qo[i], k.shape[0], causal=params.causal,
            window_left=params.window_left, mask_bits=masks(i, k.shape[0]),
            items=params.request_items(i), request=i, device=q.device,
        )  # fmt: skip
        o, s = attend(qf[qo[i] : qo[i + 1]], k, v, seen, logits, sinks)
        out[qo[i] : qo[i + 1]], lse[qo[i] : qo[i + 1]] = o, s.float()
    if v_scale is not None:
        out *= v_scale
    return out.to(params.o_dtype), lse


def _check_like(name: str, t: Tensor, tail: tuple[int, ...], dtype: torch.dtype) -> None:
    """Raise :class:`~flashplan.errors.PlanMismatchError` unless ``t`` is
    ``[n, *tail]`` of ``dtype`` (the plan's)."""
    if t.dim() != 1 + len(tail) or tuple(t.shape[1:]) != tail or t.dtype != dtype:
        raise PlanMismatchError(
            name, "shape or dtype unlike the plan's", shape=tuple(t.shape), dtype=t.dtype,
            planned_shape=("n", *tail), planned_dtype=dtype,
        )  # fmt: skip


def _check_q(q: Tensor, params: Params, rows: int, *, exact: bool) -> None:
    """``q`` is ``[rows, num_qo_heads, head_dim]`` of the planned dtype (at least
    ``rows`` rows unless ``exact``)."""
    _check_like("q", q, (params.num_qo_heads, params.head_dim), params.q_dtype)
    if q.shape[0] < rows or (exact and q.shape[0] != rows):
        raise PlanMismatchError("q", "rows unlike the plan's", rows=q.shape[0], planned=rows)


def _mask_reader(
    params: Params, arrays: Arrays, qo: list[int]
) -> Callable[[int, int], Tensor | None]:
    """Request ``i``'s custom mask bits given its kv length (``None``: no mask, or the
    multi-item rule replaces it)."""
    mask, offsets = arrays.mask, arrays.mask_indptr
    if mask is None or offsets is None or params.items is not None:
        return lambda i, kv_len: None
    starts, flat = offsets.tolist(), mask.view(torch.uint8).reshape(-1)
    return lambda i, kv_len: packed_bits(flat, starts[i], qo[i + 1] - qo[i], kv_len, request=i)


def _cache_parts(cache: KVCache, params: Params) -> tuple[Tensor, Tensor]:
    """``(k, v)`` pages ``[pages, page_size, num_kv_heads, head_dim]`` of an NHD cache."""
    k, v = (cache[:, 0], cache[:, 1]) if isinstance(cache, Tensor) else cache
    tail = (params.page_size, params.num_kv_heads, params.head_dim)
    _check_like("k_cache", k, tail, params.kv_dtype)
    _check_like("v_cache", v, tail, params.kv_dtype)
    return k, v


def paged_keys(cache: KVCache) -> KeySource:
    """A paged cache's :data:`KeySource` (the module docstring's keys).

    Raises (when called):
        PlanMismatchError: a cache unlike the plan (page size, heads, dim, dtype).
        PageTableError: a page id outside the cache.
        FlashplanError: a last-page length outside ``[0, page_size]``, or an indptr
            beyond the page ids.
    """

    def keys(i: int, params: Params, arrays: Arrays) -> tuple[Tensor, Tensor]:
        k_pages, v_pages = _cache_parts(cache, params)
        assert arrays.indices is not None and arrays.last_page_len is not None
        lo, hi = (int(x) for x in arrays.kv_indptr[i : i + 2].tolist())
        check_indptr("paged_kv_indptr", [lo, hi], arrays.indices.numel())
        pages = arrays.indices[lo:hi].to(torch.int64)
        if pages.numel() and not 0 <= int(pages.min()) <= int(pages.max()) < k_pages.shape[0]:
            raise PageTableError(
                "indices", "page id outside the cache", request=i,
                pages=pages.tolist(), num_pages=k_pages.shape[0],
            )  # fmt: skip
        last, ps = int(arrays.last_page_len[i]), params.page_size
        if pages.numel() and not 0 <= last <= ps:
            raise FlashplanError(
                "last_page_len", "must be in [0, page_size]", request=i, value=last, page_size=ps
            )
        kv_len = (pages.numel() - 1) * ps + last if pages.numel() else 0
        shape = (-1, params.num_kv_heads, params.head_dim)
        return k_pages[pages].reshape(shape)[:kv_len], v_pages[pages].reshape(shape)[:kv_len]

    return keys


def ragged_keys(k: Tensor, v: Tensor) -> KeySource:
    """Ragged keys ``k``, ``v`` ``[total_kv, num_kv_heads, head_dim]``' :data:`KeySource`:
    request ``i`` reads rows ``kv_indptr[i]:kv_indptr[i + 1]``.

    Raises (when called):
        PlanMismatchError: ``k`` / ``v`` unlike the plan.
        FlashplanError: an indptr beyond their rows.
    """

    def keys(i: int, params: Params, arrays: Arrays) -> tuple[Tensor, Tensor]:
        _check_like("k", k, (params.num_kv_heads, params.head_dim), params.kv_dtype)
        _check_like("v", v, (params.num_kv_heads, params.head_dim), params.kv_dtype)
        lo, hi = (int(x) for x in arrays.kv_indptr[i : i + 2].tolist())
        check_indptr("kv_indptr", [lo, hi], min(k.shape[0], v.shape[0]))
        return k[lo:hi], v[lo:hi]

    return keys
