"""A small continuous-batching engine: HF model, flashplan attention, paged KV, greedy decoding.

Per step (:meth:`Engine.step`): admit -> layout -> plan -> apply -> model forward (attention
through flashplan) -> sample -> free the pages of finished requests. Encoder-only models
(EmbeddingGemma) have no step loop: :func:`embed` runs several prompts in one packed
bidirectional pass. See docs/guide-engine.md.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import attrs
import numpy as np
import torch

import flashplan as fp

from .graphs import DecodeGraphs
from .hf_attention import HFConventions, Kind, StepContext, planned_groups
from .hf_models import DecoderOnly, EncoderDecoder, EncoderOnly


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(eq=False)
class Request:
    """One generation request and its state in the engine.

    Attributes:
        prompt: decoder prompt token ids (at least one).
        max_new_tokens: tokens to generate.
        encoder_prompt: encoder token ids (encoder-decoder models only).
        rid: id given by :meth:`Engine.add`.
        tokens: prompt + generated tokens (decoder).
        output: generated tokens.
        num_cached: decoder tokens whose K/V is in the cache (the layout's ``prefix_len``).
        pages: KV page ids of the request's page-table row, in order (encoder pages first).
        row: the request's page-table row, while running.
        encoder_cached: whether its encoder K/V has been written.
    """

    prompt: list[int]
    max_new_tokens: int
    encoder_prompt: list[int] | None = None
    rid: int = -1
    tokens: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    num_cached: int = 0
    pages: list[int] = field(default_factory=list)
    row: int = -1
    encoder_cached: bool = False

    @property
    def pending(self) -> int:
        """Tokens still to feed (no K/V yet): the prompt's rest, or 1 while decoding."""
        return len(self.tokens) - self.num_cached

    def worst_case_pages(self, page_size: int) -> int:
        """Pages of the row at the end: encoder pages + decoder tokens (pages)."""
        enc = _cdiv(len(self.encoder_prompt or ()), page_size)
        return enc + _cdiv(len(self.prompt) + self.max_new_tokens, page_size)


class PageAllocator:
    """A free list of KV page ids: pages are taken from its end and given back to it."""

    def __init__(self, num_pages: int) -> None:
        self.free: list[int] = list(range(num_pages - 1, -1, -1))  # hands out 0, 1, 2, ...
        self.ever_used: set[int] = set()
        self.reused = 0  # pages handed out again after a request gave them back

    def alloc(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"out of KV pages: need {n}, {len(self.free)} free")
        pages = [self.free.pop() for _ in range(n)]
        self.reused += sum(p in self.ever_used for p in pages)
        self.ever_used.update(pages)
        return pages

    def release(self, pages: list[int]) -> None:
        self.free.extend(reversed(pages))


@dataclass
class StepOutput:
    """What one step computed. ``batch`` lists (request, new tokens) in batch order; ``logits``
    row ``j`` belongs to ``owners[j]`` at decoder position ``positions[j]``; ``sampled`` maps
    request id -> the token sampled this step."""

    batch: list[tuple[Request, int]]
    layout: fp.BatchLayout
    spec: fp.PlanSpec
    logits: torch.Tensor  # [rows, vocab], the model's dtype
    owners: list[Request]
    positions: list[int]
    sampled: dict[int, int]
    finished: list[Request]


class Engine:
    """Continuous batching over an HF model whose attention runs through flashplan.

    Args:
        adapter: the model (:func:`hf_models.adapter_for`).
        executor: ``fp.ReferenceExecutor()`` (any device) or ``FlashInferExecutor`` (CUDA).
        page_size: tokens per KV page.
        num_pages: pages in each layer's KV cache.
        max_running: requests in flight at once (rows of the page table).
        token_budget: new tokens per step; decodes take 1 each, prompt chunks share the rest.
        max_request_tokens: the most tokens (encoder + decoder) one request may hold.
        extend_path: ``"auto"``, ``"paged"`` or ``"ragged"`` (``fp.plan``'s ``extend_path``).
        conventions: the HF -> flashplan mapping (tests perturb it).
        keep_all_logits: return the logits of every new token, not only each request's last.
        eos_token_id: stop a request when it samples this token.
        kv_dtype: the decoder KV caches' dtype (default: the model's); an fp8 dtype
            (``torch.float8_e4m3fn`` / ``torch.float8_e5m2``) stores K/V quantized with
            ``kv_scales`` (``docs/semantics.md``, "FP8 KV cache").
        kv_scales: an fp8 cache's ``(k_scale, v_scale)``, the same for every layer.
        cuda_graphs: batch sizes of the CUDA-graph buckets captured at start-up (needs
            the FlashInferExecutor and a decoder-only model): a step of decodes alone
            replays the smallest bucket that holds it (:mod:`.graphs`); ``()``: none.
    """

    def __init__(
        self,
        adapter: DecoderOnly | EncoderDecoder,
        executor: fp.Executor,
        *,
        page_size: int = 16,
        num_pages: int = 256,
        max_running: int = 8,
        token_budget: int = 64,
        max_request_tokens: int = 1024,
        extend_path: str = "auto",
        conventions: HFConventions = HFConventions(),  # noqa: B008 (frozen)
        keep_all_logits: bool = False,
        eos_token_id: int | None = None,
        kv_dtype: torch.dtype | None = None,
        kv_scales: tuple[float, float] = (1.0, 1.0),
        cuda_graphs: Sequence[int] = (),
    ) -> None:
        if getattr(adapter, "is_encoder_only", False):
            raise ValueError("an encoder-only model generates nothing: use embed()")
        limit = adapter.max_tokens
        if limit is not None and max(token_budget, max_request_tokens) > limit:
            raise ValueError(  # Llama 4's temperature tuning (see DecoderOnly.max_tokens)
                f"token_budget and max_request_tokens must be <= {limit} for this model"
            )
        self.adapter, self.executor = adapter, executor
        self.page_size, self.token_budget, self.extend_path = page_size, token_budget, extend_path
        self.max_request_tokens = max_request_tokens
        self.keep_all_logits, self.eos = keep_all_logits, eos_token_id
        model = adapter.model
        self.device = model.device
        # One group per kind of attention layer, planned before the forward from the modules.
        groups = planned_groups(adapter.bindings, conventions)
        self.groups = (*groups[Kind.SELF], *groups[Kind.CROSS])
        self.encoder_groups = groups[Kind.ENCODER]
        # One cache per decoder layer (self and cross attention of a layer share it).
        h = adapter.heads if kv_dtype is None else attrs.evolve(adapter.heads, kv_dtype=kv_dtype)
        self.heads = h
        shape = (num_pages, 2, page_size, h.num_kv_heads, h.head_dim)
        caches = [torch.zeros(shape, dtype=h.kv_dtype, device=self.device)]
        caches += [torch.zeros_like(caches[0]) for _ in range(adapter.num_layers - 1)]
        scales = kv_scales if h.kv_is_fp8 else None
        self.ctx = StepContext(executor, adapter.bindings, caches, conventions, scales)
        self.allocator = PageAllocator(num_pages)
        # Host page table: one row per running request, -1 where no page is allocated.
        self.table = np.full((max_running, _cdiv(max_request_tokens, page_size) + 1), -1, np.int32)
        self.free_rows = list(range(max_running - 1, -1, -1))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._next_id = 0
        self.graphs: DecodeGraphs | None = None
        self.replayed_steps = 0
        #: host seconds of flashplan's part of decode-only steps (layout, plan, apply or
        #: a bucket's replay planning) and how many such steps ran: benchmarks read them
        self.decode_host_s, self.decode_steps = 0.0, 0
        if cuda_graphs:
            if not isinstance(adapter, DecoderOnly):
                raise ValueError("CUDA graphs are for decoder-only models")
            scratch = self.allocator.alloc(1)[0]  # the capture's writes; never a request's
            self.graphs = DecodeGraphs(
                adapter, executor, self.ctx, self.groups, h, cuda_graphs,
                max_pages=self.table.shape[1], page_size=page_size, scratch_page=scratch,
            )  # fmt: skip

    # -- requests ---------------------------------------------------------------------------
    def add(self, request: Request) -> Request:
        """Queue a request; it is admitted when a row and its worst-case pages are free."""
        if not request.prompt or request.max_new_tokens < 1:
            raise ValueError("a request needs a prompt and at least one token to generate")
        if (request.encoder_prompt is not None) != self.adapter.is_encoder_decoder:
            raise ValueError("encoder_prompt is needed by, and only by, encoder-decoder models")
        tokens = len(request.encoder_prompt or ()) + len(request.prompt) + request.max_new_tokens
        too_long = tokens > self.max_request_tokens
        if too_long or request.worst_case_pages(self.page_size) > self.table.shape[1]:
            raise ValueError("request longer than max_request_tokens")
        request.rid, self._next_id = self._next_id, self._next_id + 1
        request.tokens = list(request.prompt)
        self.waiting.append(request)
        return request

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _uncommitted_pages(self) -> int:
        """Free pages not promised to running requests' future tokens."""
        promised = sum(r.worst_case_pages(self.page_size) - len(r.pages) for r in self.running)
        return len(self.allocator.free) - promised

    def _schedule(self) -> list[tuple[Request, int]]:
        """This step's (request, new tokens): every decode, then prompt chunks in arrival
        order within the token budget, admitting waiting requests while rows and pages last."""
        batch = [(r, 1) for r in self.running if r.pending == 1]
        budget = self.token_budget - len(batch)
        for r in self.running:
            if r.pending > 1 and budget > 0:
                batch.append((r, min(r.pending, budget)))
                budget -= batch[-1][1]
        while self.waiting and budget > 0 and self.free_rows:
            r = self.waiting[0]
            if r.worst_case_pages(self.page_size) > self._uncommitted_pages():
                break
            self.waiting.popleft()
            r.row = self.free_rows.pop()
            self.running.append(r)
            batch.append((r, min(r.pending, budget)))
            budget -= batch[-1][1]
        return batch

    # -- one step ---------------------------------------------------------------------------
    def step(self) -> StepOutput | None:
        """Run one batch; ``None`` when there is nothing to run."""
        batch = self._schedule()
        if not batch:
            return None
        reqs = [r for r, _ in batch]
        # 1. Layout: host integers only. A step of decodes alone plans on the decode kernels.
        prefix = [r.num_cached for r in reqs]
        seq = [r.num_cached + n for r, n in batch]
        enc: dict = {}
        if self.adapter.is_encoder_decoder:
            enc = dict(
                encoder_lens=[len(r.encoder_prompt or ()) for r in reqs],
                encoder_cached=[r.encoder_cached for r in reqs],  # joining requests: False
            )
        kw = dict(page_size=self.page_size, groups=self.groups, **enc)
        t0 = time.perf_counter()
        if all(n == 1 for _, n in batch):
            layout = fp.BatchLayout.decode(seq, **kw)
        else:
            layout = fp.BatchLayout.extend(seq, prefix, **kw)
        host = time.perf_counter() - t0
        # 2. Pages: grow each row to what the layout needs, from the free list.
        for r, need in zip(reqs, layout.pages_needed.tolist(), strict=True):
            r.pages += self.allocator.alloc(need - len(r.pages))
            self.table[r.row, : len(r.pages)] = r.pages
        pages = torch.from_numpy(self.table).to(self.device)
        table = fp.PageTable(pages, rows=[r.row for r in reqs])
        # 3. Encoder pass for joining requests (its own plan; no cache).
        encoder_states = self._encode([r for r in reqs if not r.encoder_cached], pages)
        # 4. Plan once, apply once, then every layer runs its group on this plan (or
        #    replay a captured decode step, which applies the plan to its bucket).
        t0 = time.perf_counter()
        spec = fp.plan(layout, self.heads, extend_path=self.extend_path)
        host += time.perf_counter() - t0
        ids = [t for r, n in batch for t in r.tokens[r.num_cached : r.num_cached + n]]
        last = spec.qo_indptr[1:] - 1  # each request's last new token
        keep = np.arange(spec.total_q) if self.keep_all_logits else last
        bucket = None
        if self.graphs is not None and layout.mode is fp.Mode.DECODE:
            bucket = self.graphs.bucket_for(len(reqs))
        if bucket is not None:
            assert self.graphs is not None
            replay = self.graphs.prepare(bucket, spec, table, ids)
            host += self.graphs.last_apply_s
            logits = replay()[: len(reqs)]
            self.replayed_steps += 1
        else:
            t0 = time.perf_counter()
            self.executor.apply(spec, table)
            host += time.perf_counter() - t0
            logits = self.adapter.decode(
                torch.tensor(ids, device=self.device),
                self.executor.positions().long(),  # RoPE, built on the device from the plan
                torch.from_numpy(keep).to(self.device, torch.int64),
                self.ctx,
                encoder_states,
            )
        if layout.mode is fp.Mode.DECODE:
            self.decode_host_s += host
            self.decode_steps += 1
        # 5. Greedy sampling for requests whose last new token is their last known token.
        sample_rows = last if self.keep_all_logits else np.arange(len(reqs))
        sample = torch.as_tensor(sample_rows, dtype=torch.int64, device=self.device)
        next_tokens = logits[sample].argmax(-1).tolist()  # the step's one device -> host read
        sampled, finished = {}, []
        for (r, n), token in zip(batch, next_tokens, strict=True):
            r.num_cached += n
            r.encoder_cached = True
            if r.pending == 0:  # the prompt is all in: this token is generated
                r.tokens.append(token)
                r.output.append(token)
                sampled[r.rid] = token
                if len(r.output) >= r.max_new_tokens or token == self.eos:
                    finished.append(r)
        # 6. Finished requests give their pages and row back.
        for r in finished:
            self.allocator.release(r.pages)
            self.table[r.row] = -1
            self.free_rows.append(r.row)
            self.running.remove(r)
        owners = [reqs[int(i)] for i in np.searchsorted(spec.qo_indptr, keep, side="right") - 1]
        positions = spec.positions[keep].tolist()
        return StepOutput(batch, layout, spec, logits, owners, positions, sampled, finished)

    def _encode(self, joining: list[Request], pages: torch.Tensor) -> torch.Tensor | None:
        """Encoder output ``[1, n, d_model]`` of the joining requests (batch order), or
        ``None``: a bidirectional plan on the ragged path, run with ``kv_cache=None``."""
        if not self.adapter.is_encoder_decoder or not joining:
            return None
        assert isinstance(self.adapter, EncoderDecoder) and self.adapter.encoder_heads
        lens = [len(r.encoder_prompt or ()) for r in joining]
        layout = fp.BatchLayout.extend(lens, page_size=self.page_size, groups=self.encoder_groups)
        spec = fp.plan(layout, self.adapter.encoder_heads, extend_path="ragged")
        # Nothing is read or written, but apply wants a table covering the encoder's pages.
        self.executor.apply(spec, fp.PageTable(pages, rows=[r.row for r in joining]))
        ids = torch.tensor([t for r in joining for t in r.encoder_prompt or ()], device=self.device)
        return self.adapter.encode(ids, self.executor.positions().long(), self.ctx)


def embed(
    adapter: EncoderOnly,
    executor: fp.Executor,
    prompts: Sequence[Sequence[int]],
    *,
    page_size: int = 16,
    extend_path: str = "auto",
    conventions: HFConventions = HFConventions(),  # noqa: B008 (frozen)
) -> list[torch.Tensor]:
    """Encoder-only pass: every prompt in one packed bidirectional forward.

    One ``BatchLayout.extend(lens, [0] * bs)`` planned for the model's groups (bidirectional,
    windowed on sliding layers), applied once; every layer runs its group on it. A
    bidirectional window runs on one paged prefill with a position mask, which reads the
    keys from a KV cache, so the pass writes each layer's K/V into a scratch cache: one
    cache, ``[sum(pages_needed), 2, page_size, num_kv_heads, head_dim]``, shared by every
    layer (a layer's K/V is read only by its own call), and a page table whose rows hold
    each request's pages, handed out last page first so that page ids are not row offsets.

    Args:
        adapter: an :class:`~hf_models.EncoderOnly` model.
        executor: ``fp.ReferenceExecutor()`` or ``FlashInferExecutor``.
        prompts: token ids of each request (at least one token each).
        page_size: tokens per scratch KV page.
        extend_path: ``"auto"`` or ``"paged"`` (``fp.plan`` refuses ``"ragged"`` for a
            bidirectional window).
        conventions: the HF -> flashplan mapping (tests perturb it).

    Returns:
        Per prompt, its last hidden states ``[len(prompt), hidden_size]`` (the model's dtype).
    """
    if not prompts or not all(prompts):
        raise ValueError("embed needs at least one prompt, each of at least one token")
    groups = planned_groups(adapter.bindings, conventions)[Kind.ENCODER]  # all its modules
    lens = [len(p) for p in prompts]
    layout = fp.BatchLayout.extend(lens, [0] * len(lens), page_size=page_size, groups=groups)
    spec = fp.plan(layout, adapter.heads, extend_path=extend_path)
    need = layout.pages_needed.tolist()
    free = list(range(sum(need)))  # popped from the end: the last page id first
    table = np.full((len(lens), max(need)), -1, np.int32)
    for row, n in enumerate(need):
        table[row, :n] = [free.pop() for _ in range(n)]
    device = adapter.model.device
    h = adapter.heads
    scratch = torch.zeros(
        (sum(need), 2, page_size, h.num_kv_heads, h.head_dim), dtype=h.kv_dtype, device=device
    )
    executor.apply(spec, fp.PageTable(torch.from_numpy(table).to(device), rows=range(len(lens))))
    ctx = StepContext(executor, adapter.bindings, [scratch] * adapter.num_layers, conventions)
    ids = torch.tensor([t for p in prompts for t in p], device=device)
    hidden = adapter.encode(ids, executor.positions().long(), ctx)
    return list(hidden.split(lens))
