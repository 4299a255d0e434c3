"""``flashinfer.xqa`` (0.7.x) computed in torch: the decode call of FlashInfer's XQA
kernel, one query token per request, for the twin (:data:`~flashplan.twin.flashinfer_twin`).

For request ``b`` of ``L = seq_lens[b, 0]`` keys (tokens ``[0, L)`` of the pages
``page_table[b, :ceil(L / page_size)]``) and query head ``h`` over KV head ``h //
(num_q_heads // num_kv_heads)``::

    logits = q[b, 0, h] . k_cache[key] * q_scale * kv_scale' / sqrt(head_dim)
    out[b, 0, h] = sum softmax(logits) * v_cache[key] * kv_scale' * rcp_out_scale

where ``kv_scale'`` is ``kv_scale`` for an e4m3 cache and 1 for a cache of the queries'
dtype; with ``sliding_win_size = w > 0`` only keys ``[L - w, L)`` count; ``sinks[kh, j]``
(natural-log units) adds ``exp(sink)`` to the softmax's denominator of query head ``kh *
group + j``. Over an e4m3 cache the Hopper kernel rounds the queries to e4m3 (saturating
at 448) before the products, which the twin does too; it computes the rest in float32
(the kernel also rounds the probabilities to e4m3: the twin is that much more exact).

What XQA would misread silently raises a flashplan error: a page size it has no kernel
for, an e5m2 cache (read as 16-bit), a length beyond the table's width, page ids outside
the cache, shapes or dtypes unlike its documented ones.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from flashplan.errors import PlanMismatchError, UnsupportedError

__all__ = ["e4m3_queries", "xqa"]

_PAGE_SIZES = (16, 32, 64, 128)
_E4M3_MAX = 448.0


def e4m3_queries(q: torch.Tensor) -> torch.Tensor:
    """float32 ``q`` as XQA's Hopper kernel reads it over an e4m3 cache: saturated at
    ±448 and rounded to e4m3 (exact in bf16 and fp16 again)."""
    return q.float().clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn).float()


def _scale(value: float | torch.Tensor) -> torch.Tensor:
    """A scale as a float32 0-d tensor (a tensor's first element: XQA reads ``ptr[0]``)."""
    if isinstance(value, torch.Tensor):
        return value.reshape(-1)[0].float()
    return torch.tensor(float(value))


def xqa(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
    seq_lens: torch.Tensor, output: torch.Tensor, workspace_buffer: torch.Tensor,
    semaphores: torch.Tensor, num_kv_heads: int, page_size: int,
    sinks: torch.Tensor | None = None, q_scale: float | torch.Tensor = 1.0,
    kv_scale: float | torch.Tensor = 1.0, sliding_win_size: int = 0, kv_layout: str = "NHD",
    sm_count: int | None = None, enable_pdl: bool | None = None, rcp_out_scale: float = 1.0,
    q_seq_len: int = 1, mask: torch.Tensor | None = None, **unsupported: Any,
) -> None:  # fmt: skip
    """Write the attention of ``q`` ``[bs, 1, num_q_heads, head_dim]`` over the paged
    ``k_cache`` / ``v_cache`` ``[pages, page_size, num_kv_heads, head_dim]`` (NHD) into
    ``output`` (``q``'s shape and dtype); ``page_table`` int32 ``[bs, width]``,
    ``seq_lens`` uint32 ``[bs, 1]`` (module docstring). ``workspace_buffer``,
    ``semaphores``, ``sm_count`` and ``enable_pdl`` change nothing computed.

    Raises:
        UnsupportedError: what the twin does not compute (speculative decoding, HND,
            NVFP4 scale caches) or XQA has no kernel for.
        PlanMismatchError: shapes, dtypes, lengths or page ids XQA would misread.
    """
    del workspace_buffer, semaphores, sm_count, enable_pdl
    if unsupported or q_seq_len != 1 or mask is not None or kv_layout != "NHD":
        raise UnsupportedError(
            "xqa", "the twin computes XQA's decode (one query token, NHD, no NVFP4 scales)",
            options=sorted(unsupported), q_seq_len=q_seq_len, kv_layout=kv_layout,
        )  # fmt: skip
    if page_size not in _PAGE_SIZES:
        raise UnsupportedError(
            "page_size", f"XQA has kernels for {_PAGE_SIZES}", page_size=page_size
        )
    kv_dtype = k_cache.dtype
    fp8 = kv_dtype == torch.float8_e4m3fn
    if q.dtype not in (torch.float16, torch.bfloat16) or kv_dtype not in (
        torch.float8_e4m3fn, q.dtype
    ) or v_cache.dtype != kv_dtype:  # fmt: skip
        raise PlanMismatchError(
            "k_cache", "XQA takes fp16/bf16 queries over an e4m3 cache or one of their dtype "
            "(it reads e5m2 as 16-bit)", q_dtype=q.dtype, kv_dtype=kv_dtype,
        )  # fmt: skip
    bs, _, hq, dim = q.shape
    if (
        q.dim() != 4 or q.shape[1] != 1 or output.shape != q.shape or output.dtype != q.dtype
        or k_cache.shape != v_cache.shape
        or tuple(k_cache.shape[1:]) != (page_size, num_kv_heads, dim)
        or page_table.dtype != torch.int32 or page_table.dim() != 2 or page_table.shape[0] != bs
        or seq_lens.dtype != torch.uint32 or tuple(seq_lens.shape) != (bs, 1)
        or hq % num_kv_heads
    ):  # fmt: skip
        raise PlanMismatchError(
            "q", "shapes or dtypes unlike XQA's", q=tuple(q.shape), output=tuple(output.shape),
            k_cache=tuple(k_cache.shape), page_table=tuple(page_table.shape),
            seq_lens=(tuple(seq_lens.shape), seq_lens.dtype),
        )  # fmt: skip
    lens = seq_lens.view(torch.int32).reshape(-1).tolist()
    width, pages_in_cache = page_table.shape[1], k_cache.shape[0]
    group = hq // num_kv_heads
    kv_factor = _scale(kv_scale) if fp8 else torch.tensor(1.0)
    qk_scale = _scale(q_scale) * kv_factor / math.sqrt(dim)
    out_scale = kv_factor * rcp_out_scale
    queries = e4m3_queries(q[:, 0]) if fp8 else q[:, 0].float()
    for b, length in enumerate(lens):
        n = (length + page_size - 1) // page_size
        if not 1 <= length <= width * page_size:
            raise PlanMismatchError(
                "seq_lens", "XQA reads 1 to width * page_size keys per request",
                request=b, seq_len=length, width=width, page_size=page_size,
            )  # fmt: skip
        ids = page_table[b, :n].long()
        if bool(((ids < 0) | (ids >= pages_in_cache)).any()):
            raise PlanMismatchError(
                "page_table", "a page id outside the cache", request=b,
                ids=ids.tolist(), num_pages=pages_in_cache,
            )  # fmt: skip
        start = max(length - sliding_win_size, 0) if sliding_win_size > 0 else 0
        k = k_cache[ids].reshape(-1, num_kv_heads, dim)[start:length].float()
        v = v_cache[ids].reshape(-1, num_kv_heads, dim)[start:length].float()
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        logits = torch.einsum("hd,khd->hk", queries[b], k) * qk_scale  # [hq, keys]
        top = logits.max(dim=-1).values
        if sinks is not None:
            top = torch.maximum(top, sinks.reshape(-1).float())
        p = torch.exp(logits - top[:, None])
        den = p.sum(dim=-1)
        if sinks is not None:
            den = den + torch.exp(sinks.reshape(-1).float() - top)
        o = torch.einsum("hk,khd->hd", p, v) / den[:, None] * out_scale
        output[b, 0] = o.to(output.dtype)
