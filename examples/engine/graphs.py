"""The engine's decode steps replayed from CUDA graphs, one per batch-size bucket.

At start-up, :class:`DecodeGraphs` captures the model's whole decode forward (every layer,
the LM head) once per bucket size on a graph executor of the engine's FlashInfer executor
(``executor.for_bucket(GraphBucket.decode(...))``). A decode step of ``n`` requests then
takes the smallest bucket ``>= n``: it fills the bucket's static token ids and RoPE
positions (rows past ``n`` are padding: token 0 at position 0, whose outputs are ignored),
and the bucket's graph executor applies the batch with the engine's page table, outside
the graph, as an eager step would (one staging copy, the page gather into the bucket's
fixed buffers, each graph-mode wrapper's ``plan()``) before the replay.
Steps with prompt tokens, and decode steps larger than every bucket, run eagerly.

Capture writes each padding row's K/V nowhere (flashplan's graph buckets give padding
requests no write slot) and the captured forward's own warm-up batch writes one token into
``scratch_page`` of every layer's cache: the engine keeps that page out of its allocator.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np
import torch

import flashplan as fp

from .hf_attention import StepContext
from .hf_models import DecoderOnly

__all__ = ["DecodeGraphs"]


class DecodeGraphs:
    """Captured decode forwards of a decoder-only model, one per bucket size.

    Args:
        adapter: the model, or its compiled twin (:meth:`DecoderOnly.compiled`: each
            bucket's forward is compiled in its capture's warm-up run).
        executor: the engine's ``FlashInferExecutor`` (its graph executors share its
            workspace and policy).
        ctx: the engine's step context (caches, bindings, conventions, fp8 scales; for a
            compiled forward, :meth:`StepContext.for_compile`'s).
        groups: the model's attention groups (the plan key every replay must keep).
        heads: the plan's heads (the caches' dtype).
        batch_sizes: bucket sizes, e.g. ``(1, 8, 64)`` (at most the table's rows).
        table: the engine's device page table (int32 ``[rows, max_pages]``); the
            captures' warm-up batches fill it with ``scratch_page`` and leave it at -1.
        page_size: tokens per page.
        scratch_page: a page of every cache that no request uses (the capture's writes).
    """

    def __init__(
        self,
        adapter: DecoderOnly,
        executor: fp.Executor,
        ctx: StepContext,
        groups: tuple[fp.AttentionGroup, ...],
        heads: fp.HeadConfig,
        batch_sizes: Sequence[int],
        *,
        table: torch.Tensor,
        page_size: int,
        scratch_page: int,
    ) -> None:
        from flashplan.executor.flashinfer import FlashInferExecutor
        from flashplan.executor.flashinfer.bucket import GraphBucket
        from flashplan.executor.flashinfer.graphs import capture

        if not isinstance(executor, FlashInferExecutor):
            raise TypeError("CUDA graphs need the FlashInferExecutor")
        device = executor.device
        self.sizes = tuple(sorted(set(int(b) for b in batch_sizes)))
        num_rows, max_pages = table.shape
        if self.sizes and self.sizes[-1] > num_rows:
            raise ValueError(f"a bucket of {self.sizes[-1]} requests needs as many table rows")
        table.fill_(scratch_page)  # the warm-up batches' pages
        self.steps = {}
        # every tensor a graph reads is kept here: freed, its memory would be reused
        self.ids: dict[int, torch.Tensor] = {}
        self.positions: dict[int, torch.Tensor] = {}
        self.rows: dict[int, torch.Tensor] = {}
        # two pinned slots per bucket, each with the event of its last copy
        self._pinned: dict[int, list[torch.Tensor]] = {}
        self._copied: dict[int, list[torch.cuda.Event]] = {}
        self._next: dict[int, int] = {}
        self.last_apply_s = 0.0
        pool = torch.cuda.graph_pool_handle()
        for bs in self.sizes:
            gx = executor.for_bucket(GraphBucket.decode(batch_size=bs, max_pages=max_pages))
            # warm-up batch: every request one token long, on the scratch page
            layout = fp.BatchLayout.decode([1] * bs, page_size=page_size, groups=groups)
            gx.apply(fp.plan(layout, heads), fp.PageTable(table, rows=np.arange(bs)))
            ids = torch.zeros(bs, dtype=torch.int64, device=device)
            positions = torch.zeros(bs, dtype=torch.int64, device=device)
            rows = torch.arange(bs, device=device)
            # the engine's context on the bucket's executor (its compiled calls resolved
            # again for it, when the engine's forward is compiled)
            graph_ctx = replace(ctx, executor=gx, compiled=None)
            if ctx.compiled is not None:
                graph_ctx = graph_ctx.for_compile()
            self.steps[bs] = capture(
                gx,
                lambda ids=ids, positions=positions, rows=rows, c=graph_ctx: adapter.decode(
                    ids, positions, rows, c
                ),
                pool=pool,
            )
            self.ids[bs], self.positions[bs], self.rows[bs] = ids, positions, rows
            # host side of the per-step inputs: token ids and positions, one copy
            self._pinned[bs] = [
                torch.zeros((2, bs), dtype=torch.int64).pin_memory() for _ in range(2)
            ]
            self._copied[bs] = [torch.cuda.Event() for _ in range(2)]  # unrecorded: done
            self._next[bs] = 0
        table.fill_(-1)  # no page allocated: the engine's steps send theirs

    def bucket_for(self, batch_size: int) -> int | None:
        """The smallest bucket that holds ``batch_size`` decodes, or ``None``."""
        for bs in self.sizes:
            if bs >= batch_size:
                return bs
        return None

    def prepare(
        self,
        bs: int,
        spec: fp.PlanSpec,
        table: fp.PageTable,
        ids: Sequence[int] | torch.Tensor,
    ) -> Callable[[], torch.Tensor]:
        """Ready bucket ``bs`` for a decode step of ``len(ids)`` requests: fill its static
        token ids and positions, plan ``spec`` into its fixed buffers (host seconds of
        that planning: :attr:`last_apply_s`); returns the replay, which gives logits
        ``[bs, vocab]`` (rows past ``len(ids)`` are padding). ``ids``: host ints (sent
        with the positions in one pinned copy), or an int64 device tensor (the overlapped
        loop: the previous step's sampled tokens, copied on the device). Two pinned slots
        alternate: one waits for the GPU only if its copy of two steps before has not run
        (never in the engine's loops, which read a step before they queue the one after
        the next)."""
        n = len(ids)
        k = self._next[bs]
        self._next[bs] ^= 1
        self._copied[bs][k].synchronize()  # the slot's copy of two steps ago has run
        host = self._pinned[bs][k]
        host.zero_()
        inputs = host.numpy()
        inputs[1, :n] = spec.positions
        if isinstance(ids, torch.Tensor):
            self.ids[bs][:n].copy_(ids)
            if n < bs:
                self.ids[bs][n:].zero_()  # padding rows: token 0
        else:
            inputs[0, :n] = ids
            self.ids[bs].copy_(host[0], non_blocking=True)
        self.positions[bs].copy_(host[1], non_blocking=True)
        self._copied[bs][k].record()
        step = self.steps[bs]
        t0 = time.perf_counter()
        step.executor.apply(spec, table)
        self.last_apply_s = time.perf_counter() - t0
        return step.replay
