"""Decode calls on FlashInfer's XQA kernel (``flashinfer.xqa``, TensorRT-LLM's decode
kernel), behind a wrapper's ``plan()`` / ``run()`` contract so that the executor plans
and runs it as any other call (:class:`XqaDecode`).

XQA reads a dense block table (int32 ``[rows, width]``, the page ids of row ``i`` in its
first ``ceil(seq_lens[i] / page_size)`` columns) and uint32 ``seq_lens``; it plans
nothing on the host. Its kernel computes, for a quantized (e4m3) cache::

    logits = q . k_stored * q_scale * kv_scale / sqrt(head_dim)
    out    = softmax(logits) . v_stored * kv_scale

and for a cache of the queries' dtype the same without ``kv_scale``. A plan's softmax
scale ``s`` and an fp8 cache's ``k_scale`` / ``v_scale`` therefore map to ``kv_scale =
v_scale`` and ``q_scale = s * k_scale * sqrt(head_dim) / v_scale`` (numbers on the host,
0-d tensors on the device: no sync). Its grid depends only on the number of rows and,
through a cap that never binds below the sequences' own tiles, on the table width.

XQA splits each sequence into ``round(floor(3 * sm_count / (rows * kv_heads)) / 4)``
parts (at least 1; fewer for short sequences), one CTA each. :func:`xqa_sm_count` passes
the GPU's own SM count (XQA's own split), and ``sm_count=1`` for ``deterministic`` plans:
one CTA per sequence and head, batch-invariant results. Measured on an H100 (run XB,
``benchmarks/results/issue52-h100-2026-12-07-xb.md``): at 64 sequences x 8 KV heads no
split reads the cache faster than 90.4 % of the copy bandwidth (XQA's own, one part:
85.9 %), and asking for 12 waves of CTAs made batches 1 and 8 slower (0.66x and 0.88x
XQA's own split), so the split is XQA's.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from flashplan.errors import PlanMismatchError

__all__ = [
    "XQA_SEMAPHORE_BYTES", "XqaBuffers", "XqaDecode", "xqa_scratch_bytes", "xqa_sm_count",
]  # fmt: skip

#: XQA's semaphores (uint32, zeroed before the first call; the kernel leaves them zero):
#: the 8 MiB that ``flashinfer.decode.xqa_batch_decode_with_kv_cache`` reserves.
XQA_SEMAPHORE_BYTES = 8 * 1024 * 1024


def xqa_sm_count(sms: int, *, deterministic: bool) -> int:
    """The ``sm_count`` to pass XQA on a GPU of ``sms`` SMs: ``sms`` (XQA's own split),
    or 1 when ``deterministic`` (no split)."""
    return 1 if deterministic else sms


def xqa_scratch_bytes(sms: int, group: int, head_dim: int) -> int:
    """Bytes of XQA's scratch for split sequences at ``sm_count = sms``: per part of a
    sequence and KV head, ``group`` query heads' row sum and max (float32 each) and
    partial output (``head_dim`` 16-bit values). XQA splits only when ``rows * kv_heads
    <= sms / 2``, into at most ``0.75 * sms / (rows * kv_heads) + 0.5`` parts each: at
    most ``sms`` parts in all (twice that is reserved)."""
    per_part = group * (8 + 2 * head_dim)
    return 2 * sms * per_part + group * 2 * head_dim + (1 << 16)


class XqaBuffers:
    """An executor's XQA semaphores and scratch (made at the first XQA call; every XQA
    call of the executor and its graph executors runs on one stream and shares them). A
    scratch that must grow is replaced by a larger one and the old one kept: a captured
    graph keeps reading the one it was captured with."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        #: the GPU's SM count (XQA's split; 1 on the CPU, where the twin ignores it)
        self.sms = (
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda"
            else 1
        )
        self._semaphores: torch.Tensor | None = None
        self._scratch: list[torch.Tensor] = []

    def get(self, scratch_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(semaphores uint32 [XQA_SEMAPHORE_BYTES / 4], scratch uint8 [>= scratch_bytes])``."""
        if self._semaphores is None:
            words = XQA_SEMAPHORE_BYTES // 4
            self._semaphores = torch.zeros(words, dtype=torch.uint32, device=self.device)
        if not self._scratch or self._scratch[-1].shape[0] < scratch_bytes:
            grown = max(scratch_bytes, 2 * self._scratch[-1].shape[0] if self._scratch else 0)
            self._scratch.append(torch.empty(grown, dtype=torch.uint8, device=self.device))
        return self._semaphores, self._scratch[-1]


class XqaDecode:
    """One group's decode on ``flashinfer.xqa``, planned and run like a FlashInfer wrapper.

    ``plan(**kwargs)`` keeps the block table and lengths (device tensors the kernel reads
    at run time: valid until the buffers they view are rewritten by the next apply) and
    what the plan fixes; ``run`` launches the kernel. ``graph_rows``: a CUDA-graph
    bucket's batch size: ``plan()`` then copies the lengths into a buffer of its own, so
    that a captured launch reads them at a fixed address (the table must then be the
    bucket's fixed region).
    """

    def __init__(
        self, flashinfer: Any, buffers: XqaBuffers, *, graph_rows: int | None = None
    ) -> None:
        self._xqa = flashinfer.xqa
        self._buffers = buffers
        self._fixed_lens = (
            None
            if graph_rows is None
            else torch.ones(graph_rows, dtype=torch.int32, device=buffers.device)
        )
        self._plan: dict[str, Any] | None = None

    def plan(
        self, *, block_tables: torch.Tensor, seq_lens: torch.Tensor, page_size: int,
        num_qo_heads: int, num_kv_heads: int, head_dim: int, window_left: int, sm_scale: float,
        q_data_type: torch.dtype, kv_data_type: torch.dtype, o_data_type: torch.dtype,
        sinks: bool, deterministic: bool,
    ) -> None:  # fmt: skip
        """Keep the call: ``block_tables`` int32 ``[rows * width]`` (row-major, pages),
        ``seq_lens`` uint32 ``[rows]`` (tokens, each at least 1 and at most ``width *
        page_size``), the rest as FlashInfer's decode ``plan()`` takes them; ``sinks``:
        the group's sink logits come at run time."""
        rows = int(seq_lens.shape[0])
        if self._fixed_lens is not None:
            if rows != self._fixed_lens.shape[0]:
                raise PlanMismatchError(
                    "seq_lens", "a graph XQA call runs its bucket's rows",
                    rows=rows, bucket_rows=int(self._fixed_lens.shape[0]),
                )  # fmt: skip
            self._fixed_lens.copy_(seq_lens.view(torch.int32), non_blocking=True)
            seq_lens = self._fixed_lens.view(torch.uint32)
        self._plan = {
            "table": block_tables.view(rows, -1), "lens": seq_lens.view(rows, 1),
            "page_size": page_size, "num_qo_heads": num_qo_heads, "num_kv_heads": num_kv_heads,
            "head_dim": head_dim, "window_left": window_left, "sm_scale": sm_scale,
            "dtypes": (q_data_type, kv_data_type, o_data_type), "sinks": sinks,
            "deterministic": deterministic,
            "scratch_bytes": xqa_scratch_bytes(
                self._buffers.sms, num_qo_heads // num_kv_heads, head_dim
            ),
        }  # fmt: skip

    def run(
        self, q: torch.Tensor, kv_cache: torch.Tensor, *, sinks: torch.Tensor | None = None,
        k_scale: float | torch.Tensor = 1.0, v_scale: float | torch.Tensor = 1.0,
    ) -> torch.Tensor:  # fmt: skip
        """The attention of ``q`` ``[rows, num_qo_heads, head_dim]`` over ``kv_cache``
        ``[pages, 2, page_size, num_kv_heads, head_dim]``: ``out`` in ``q``'s dtype.
        ``sinks``: float32 ``[num_qo_heads]`` (natural-log units); ``k_scale`` /
        ``v_scale``: an e4m3 cache's scales (numbers or 0-d float32 device tensors)."""
        p = self._plan
        if p is None:
            raise PlanMismatchError("plan", "run() before plan()")
        q_dtype, kv_dtype, _ = p["dtypes"]
        rows = p["table"].shape[0]
        if q.dtype != q_dtype or kv_cache.dtype != kv_dtype or q.shape[0] != rows:
            raise PlanMismatchError(
                "q", "q and the cache must have the planned dtypes and rows",
                q_dtype=q.dtype, kv_dtype=kv_cache.dtype, rows=q.shape[0], planned_rows=rows,
            )  # fmt: skip
        if (sinks is not None) != p["sinks"]:
            raise PlanMismatchError("sinks", "pass sinks exactly when the plan has them")
        semaphores, scratch = self._buffers.get(p["scratch_bytes"])
        out = torch.empty_like(q)
        k, v = kv_cache.unbind(1)
        q_scale, kv_scale = self._scales(k_scale, v_scale, kv_dtype != q_dtype)
        hkv = p["num_kv_heads"]
        window = p["window_left"]
        self._xqa(
            q.unsqueeze(1), k, v, p["table"], p["lens"], out.unsqueeze(1), scratch, semaphores,
            hkv, p["page_size"], sinks=None if sinks is None else sinks.view(hkv, -1),
            q_scale=q_scale, kv_scale=kv_scale,
            sliding_win_size=window + 1 if window >= 0 else 0,
            sm_count=xqa_sm_count(self._buffers.sms, deterministic=p["deterministic"]),
        )  # fmt: skip
        return out

    def _scales(
        self, k_scale: float | torch.Tensor, v_scale: float | torch.Tensor, quantized: bool
    ) -> tuple[float | torch.Tensor, float | torch.Tensor]:
        """XQA's ``(q_scale, kv_scale)`` for the plan's softmax scale and the cache's
        scales (module docstring); a ``v_scale`` of 0 gives ``q_scale = 0`` (out is 0)."""
        p = self._plan
        assert p is not None
        base = p["sm_scale"] * math.sqrt(p["head_dim"])
        if not quantized:  # XQA applies kv_scale to quantized caches only
            return base, 1.0
        if isinstance(v_scale, torch.Tensor):  # on the device, no host value read
            v = v_scale.float().reshape(1)
            return torch.where(v == 0, 0.0, (k_scale * base) / v), v
        vf = float(v_scale)
        per_k = 0.0 if vf == 0 else base / vf
        if isinstance(k_scale, torch.Tensor):
            return (k_scale.float() * per_k).reshape(1), vf
        return float(k_scale) * per_k, vf
