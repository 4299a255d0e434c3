"""A small continuous-batching engine: HF model, flashplan attention, paged KV, sampling.

Per step (:meth:`Engine.step`): admit -> layout -> plan -> apply -> model forward (attention
through flashplan) -> sample (greedy, or with a temperature) -> fork the samples of
requests with ``n > 1`` -> read the sampled tokens -> free the pages of finished requests.
By default the loop is overlapped (:mod:`.overlap`): the next step is planned and queued
while the GPU runs the current one, its decodes feed the sampled tokens on the device, and
the host reads them one step late. ``Engine(overlap=False)`` (``run.py --plain-loop``) is
the plain loop, which reads each step's tokens before planning the next; speculative
decoding (:mod:`.speculative`) runs its own plain loop. A request's samples share its
prompt's pages and are planned with shared-prefix (cascade) levels. Encoder-only models
(EmbeddingGemma) have no step loop: :func:`embed` runs several prompts in one packed
bidirectional pass. See docs/guide-engine.md ("Parallel sampling", "The overlapped loop").
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import attrs
import numpy as np
import torch

import flashplan as fp

from .device_table import DevicePageTable
from .graphs import DecodeGraphs
from .hf_attention import HFConventions, Kind, StepContext, planned_groups
from .hf_models import DecoderOnly, EncoderDecoder, EncoderOnly
from .overlap import (
    Launched,
    StepEvents,
    TokenReader,
    commit,
    input_ids,
    mark_launched,
)
from .overlap import on_device as _on_device

#: the events of a step when nobody measures (records nothing)
_NO_EVENTS = StepEvents(decode=False, timing=False)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(eq=False)
class Request:
    """One generation request and its state in the engine.

    Attributes:
        prompt: decoder prompt token ids (at least one).
        max_new_tokens: tokens to generate (per sample).
        encoder_prompt: encoder token ids (encoder-decoder models only).
        n: samples to generate from the prompt (parallel sampling; decoder-only models).
            The prompt is prefilled once; when it is all cached, the engine forks ``n - 1``
            child requests (:attr:`children`) that share its pages.
        temperature: 0 for greedy decoding, else each token is drawn from
            ``softmax(logits / temperature)``.
        seed: seed of the sampling generator (``temperature > 0``): sample ``k`` of the
            request (the request itself is sample 0) draws with a generator seeded
            ``seed + k``, so a request with ``n = 1`` and seed ``seed + k`` draws what sample
            ``k`` draws. ``None``: a seed drawn by :meth:`Engine.add` from torch's global
            generator, recorded here.
        rid: id given by :meth:`Engine.add` (children: given when they are forked).
        tokens: prompt + generated tokens (decoder).
        output: generated tokens.
        num_cached: decoder tokens whose K/V is in the cache, as of the steps read (the
            layout's ``prefix_len`` is :attr:`planned`, which adds the queued steps').
        pages: KV page ids of the request's page-table row, in order (encoder pages first);
            a forked family's first ``len(prompt) // page_size`` pages are the same ids.
        row: the request's page-table row, while running.
        encoder_cached: whether its encoder K/V has been written.
        parent: the request a child was forked from (``None``: not a child).
        sample: the sample's index in its family (0: the request that was added).
        children: the samples forked from this request (``n - 1`` once forked).
        generator: the sample's own random generator on the model's device
            (``temperature > 0``), seeded ``seed`` (see above).
        reserved_rows: page-table rows held for the children not forked yet.
        queued: tokens fed by steps queued but not read yet (overlapped loop): their K/V is
            written once those steps have run; ``num_cached + queued`` (:attr:`planned`)
            is the next layout's prefix. 0 between steps of the plain loop.
        unread: tokens sampled by steps not read yet (overlapped loop: 0 or 1, 2 for a
            moment while the next step is queued).
        token_slot: the index of the newest unread token in its step's sampled tokens.
        done: its last token is read (``max_new_tokens`` reached, or the stop token):
            the token of an extra step queued before that was known is discarded.
    """

    prompt: list[int]
    max_new_tokens: int
    encoder_prompt: list[int] | None = None
    n: int = 1
    temperature: float = 0.0
    seed: int | None = None
    rid: int = -1
    tokens: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    num_cached: int = 0
    pages: list[int] = field(default_factory=list)
    row: int = -1
    encoder_cached: bool = False
    parent: Request | None = field(default=None, repr=False)
    sample: int = 0
    children: list[Request] = field(default_factory=list, repr=False)
    generator: torch.Generator | None = field(default=None, repr=False)
    reserved_rows: list[int] = field(default_factory=list, repr=False)
    queued: int = 0
    unread: int = 0
    token_slot: int = -1
    done: bool = False

    @property
    def planned(self) -> int:
        """Tokens whose K/V is written once every queued step has run."""
        return self.num_cached + self.queued

    @property
    def pending(self) -> int:
        """Tokens still to feed (no K/V yet, none queued): the prompt's rest, or 1 while
        decoding; 0 once its last token is sampled (read or not: a request that has
        sampled ``max_new_tokens`` tokens is not scheduled again)."""
        if self.done or len(self.output) + self.unread >= self.max_new_tokens:
            return 0
        return len(self.tokens) + self.unread - self.planned

    @property
    def samples(self) -> list[Request]:
        """The family's samples, in order: this request, then the children forked from it."""
        return [self, *self.children]

    @property
    def unforked(self) -> int:
        """Children still to fork (``n - 1`` until the prompt is all in, then 0)."""
        return 0 if self.parent is not None else self.n - 1 - len(self.children)

    def worst_case_pages(self, page_size: int) -> int:
        """Pages of the row at the end: encoder pages + decoder tokens (pages)."""
        enc = _cdiv(len(self.encoder_prompt or ()), page_size)
        return enc + _cdiv(len(self.prompt) + self.max_new_tokens, page_size)

    def shared_pages(self, page_size: int) -> int:
        """Whole prompt pages a forked family shares (a partial last page is each
        sample's own copy)."""
        return len(self.prompt) // page_size

    def pages_to_come(self, page_size: int) -> int:
        """Pages this request (and its children not forked yet) may still take from the
        free list: the rest of its own row, and per child to fork its row's worst case
        but the shared prompt pages. At admission: ``n * own + shared`` pages with
        ``own = worst_case_pages - shared_pages``."""
        own = self.worst_case_pages(page_size) - self.shared_pages(page_size)
        return self.worst_case_pages(page_size) - len(self.pages) + self.unforked * own


class PageAllocator:
    """A free list of KV page ids and how many rows hold each page. Pages are taken from
    the free list's end and handed out with one holder; :meth:`share` adds a holder (a
    forked sample's row holding its parent's prompt pages) and :meth:`release` removes
    one, giving back to the free list the pages whose last holder released them.

    Attributes:
        free: page ids not held by any row (the next one handed out last).
        holders: int32 ``[num_pages]``: rows holding each page (0: free, or never used).
        ever_used: page ids ever handed out.
        reused: pages handed out again after a request gave them back.
        handed_out: pages taken from the free list in all (shared pages count once).
    """

    def __init__(self, num_pages: int) -> None:
        self.free: list[int] = list(range(num_pages - 1, -1, -1))  # hands out 0, 1, 2, ...
        self.holders = np.zeros(num_pages, np.int32)
        self.ever_used: set[int] = set()
        self.reused = 0
        self.handed_out = 0

    def alloc(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"out of KV pages: need {n}, {len(self.free)} free")
        pages = [self.free.pop() for _ in range(n)]
        self.holders[pages] = 1
        self.reused += sum(p in self.ever_used for p in pages)
        self.ever_used.update(pages)
        self.handed_out += n
        return pages

    def share(self, pages: list[int]) -> list[int]:
        """One more holder of ``pages`` (held pages, distinct); returns them."""
        if len(set(pages)) != len(pages) or not (self.holders[pages] > 0).all():
            raise RuntimeError(f"can only share distinct held pages, got {pages}")
        self.holders[pages] += 1
        return list(pages)

    def release(self, pages: list[int]) -> None:
        """One holder less of each of ``pages`` (distinct): those left with none are free."""
        if len(set(pages)) != len(pages) or not (self.holders[pages] > 0).all():
            raise RuntimeError(f"can only release distinct held pages, got {pages}")
        self.holders[pages] -= 1
        self.free.extend(p for p in reversed(pages) if self.holders[p] == 0)


@dataclass
class StepOutput:
    """What one step computed. ``batch`` lists (request, new tokens) in batch order; ``logits``
    row ``j`` belongs to ``owners[j]`` at decoder position ``positions[j]``; ``sampled`` maps
    request id -> the token sampled this step (children forked this step included, though
    not in ``batch``: they drew from their parent's row). ``table`` is the step's page table
    (the engine's device copy, :attr:`Engine.device_table`, as the step sent it: read it
    before the next step, which refreshes it in place; its rows are ``batch``'s) and
    ``shared_prefix`` the sharing it was planned with (``None``: no family of samples
    decoding together); ``spec.cascade`` says whether the plan runs levels for it.
    ``finished`` are the requests whose last token this step sampled, ``discarded`` those
    that ran this step after it (overlapped loop: a stop token read one step late).

    With the overlapped loop a step is returned after the next one was queued: its
    requests' tokens, outputs and ``num_cached`` are this step's, but ``running``, the
    pages and the live ``table`` already hold the next step's (each row of this batch
    keeps its ids, and what the next step added: a row given back is never handed out by
    the step queued next)."""

    batch: list[tuple[Request, int]]
    layout: fp.BatchLayout
    spec: fp.PlanSpec
    logits: torch.Tensor  # [rows, vocab], the model's dtype
    owners: list[Request]
    positions: list[int]
    sampled: dict[int, int]
    finished: list[Request]
    table: fp.PageTable | None = None
    shared_prefix: fp.SharedPrefix | None = None
    forked: list[Request] = field(default_factory=list)
    replayed: bool = False  # the step was replayed from a CUDA-graph bucket
    discarded: list[Request] = field(default_factory=list)


class Engine:
    """Continuous batching over an HF model whose attention runs through flashplan.

    Args:
        adapter: the model (:func:`hf_models.adapter_for`).
        executor: ``fp.ReferenceExecutor()`` (any device) or ``FlashInferExecutor`` (CUDA).
        page_size: tokens per KV page.
        num_pages: pages in each layer's KV cache.
        max_running: requests in flight at once (rows of the page table: twice as many
            with the overlapped loop, see ``overlap``).
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
            replays the smallest bucket that holds it (:mod:`.graphs`), unless its plan
            has cascade levels (a bucket refuses them: that step runs eagerly); a size above
            ``max_running`` shrinks to it; ``()``: none.
        cascade: ``fp.plan``'s ``cascade`` for the steps where samples of one request
            decode together (``"off"``, ``"on"`` or ``"auto"``): their shared prompt
            pages are read once per family (see docs/guide-shared-prefix.md).
        compile: a ``torch.compile`` backend (``"inductor"``, or a callable) to run the
            model's forward compiled with (decoder-only models), eager steps and captured
            decode steps alike: inductor fuses the norms, RoPE and activations around
            attention, which runs through the custom op ``flashplan::run``
            (``fp.attention``), kept whole by the compiler. ``None``: eager.
        overlap: the overlapped loop (:mod:`.overlap`, the default): :meth:`step` queues
            the next step, planned on the host while the GPU runs the current one and fed
            the current one's sampled tokens on the device, before it reads the current
            one's tokens (one step late) and returns its output. ``False``: the plain
            loop, which reads each step's tokens back before planning the next (``run.py
            --plain-loop``). Both give the same tokens; with ``eos_token_id`` the
            overlapped loop runs one extra decode of a request that stopped, its token
            discarded (:attr:`StepOutput.discarded`). (Speculative decoding,
            :mod:`.speculative`, runs its own plain loop: a round's layout needs the
            previous round's accepted count on the host.) The overlapped loop's page
            table has ``2 * max_running`` rows, handed out first in, first out, so that
            the step queued next never reuses a row the step being returned ran.
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
        cascade: str = "auto",
        compile: Any = None,
        overlap: bool = True,
    ) -> None:
        if cascade not in ("off", "on", "auto"):
            raise ValueError(f"cascade must be 'off', 'on' or 'auto', not {cascade!r}")
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
        self.cascade = cascade
        self.overlap = bool(overlap)
        model = adapter.model
        self.device: torch.device = next(model.parameters()).device
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
        # the forward every eager step runs, and its context
        self._forward: DecoderOnly | EncoderDecoder = adapter
        self._forward_ctx = self.ctx
        if compile is not None:
            if not isinstance(adapter, DecoderOnly):
                raise ValueError("compile is for decoder-only models")
            self._forward, self._forward_ctx = adapter.compiled(compile), self.ctx.for_compile()
        self.allocator = PageAllocator(num_pages)
        # Host page table: one row per running request, -1 where no page is allocated.
        # The overlapped loop has twice the rows, handed out first in, first out: a row
        # given back is not handed out by the step queued next, so that the step returned
        # meanwhile still shows its rows' ids in the live table (StepOutput.table).
        self.max_running = max_running
        rows = max_running * (2 if self.overlap else 1)
        self.table = np.full((rows, _cdiv(max_request_tokens, page_size) + 1), -1, np.int32)
        # ... and its one device copy for the engine's life, refreshed at each step's start
        self.device_table = DevicePageTable(self.table.shape, self.device)
        #: free page-table rows, handed out first in, first out
        self.free_rows: deque[int] = deque(range(self.table.shape[0]))
        self._rows_held = 0  # rows of running requests and those reserved for children
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._next_id = 0
        self.graphs: DecodeGraphs | None = None
        self.replayed_steps = 0
        #: steps whose plan had cascade levels (samples of a request decoding together)
        self.cascade_steps = 0
        self._last_sharing: tuple[object, fp.SharedPrefix] | None = None
        #: running requests of a sampled family (n > 1, or forked from one)
        self._family_members = 0
        #: host seconds of flashplan's part of decode-only steps (layout, plan, apply or
        #: a bucket's replay planning) and how many such steps ran: benchmarks read them
        self.decode_host_s, self.decode_steps = 0.0, 0
        #: the same seconds by part ("layout", "plan" incl. the sharing, "apply": the
        #: eager apply or a bucket's replay planning)
        self.decode_host_parts = {"layout": 0.0, "plan": 0.0, "apply": 0.0}
        #: the last decode-only steps' host seconds, one (layout, plan, apply) per step
        #: (medians next to the sums' means: a Python garbage collection that lands in
        #: a step's timers is not flashplan's work)
        self.decode_host_samples: deque[tuple[float, float, float]] = deque(maxlen=4096)
        #: sampled tokens back to the host (pinned, non-blocking, one event per step)
        self.reader = TokenReader(max_running, self.device)
        #: the step queued and not read yet (overlapped loop), and the last queued step's
        #: sampled tokens on the device (its successor's decodes feed them)
        self._in_flight: Launched | None = None
        self._last_tokens: torch.Tensor | None = None
        #: a list: every step's work is bracketed by timing marks, CUDA events on a GPU,
        #: the host clock elsewhere (:class:`.overlap.StepEvents`), appended here
        #: (benchmarks/bench_engine.py)
        self.step_events: list[StepEvents] | None = None
        if cuda_graphs:
            if not isinstance(adapter, DecoderOnly):
                raise ValueError("CUDA graphs are for decoder-only models")
            scratch = self.allocator.alloc(1)[0]  # the capture's writes; never a request's
            # no step runs more than max_running requests: larger buckets shrink to it
            sizes = sorted({min(int(b), max_running) for b in cuda_graphs})
            self.graphs = DecodeGraphs(
                self._forward, executor, self._forward_ctx, self.groups, h, sizes,
                table=self.device_table.pages, page_size=page_size, scratch_page=scratch,
            )  # fmt: skip

    # -- requests ---------------------------------------------------------------------------
    def add(self, request: Request) -> Request:
        """Queue a request; it is admitted when rows for its ``n`` samples and their
        worst-case pages are free."""
        if not request.prompt or request.max_new_tokens < 1:
            raise ValueError("a request needs a prompt and at least one token to generate")
        if (request.encoder_prompt is not None) != self.adapter.is_encoder_decoder:
            raise ValueError("encoder_prompt is needed by, and only by, encoder-decoder models")
        if not 1 <= request.n <= self.max_running:
            raise ValueError(f"n must be 1 to max_running ({self.max_running}) samples")
        if request.n > 1 and self.adapter.is_encoder_decoder:
            raise ValueError("parallel sampling (n > 1) is for decoder-only models")
        if not request.temperature >= 0.0:
            raise ValueError("temperature must be >= 0 (0: greedy)")
        tokens = len(request.encoder_prompt or ()) + len(request.prompt) + request.max_new_tokens
        too_long = tokens > self.max_request_tokens
        if too_long or request.worst_case_pages(self.page_size) > self.table.shape[1]:
            raise ValueError("request longer than max_request_tokens")
        request.rid, self._next_id = self._next_id, self._next_id + 1
        request.tokens = list(request.prompt)
        if request.temperature > 0:
            if request.seed is None:  # recorded, so that the run can be repeated
                request.seed = int(torch.randint(2**62, ()).item())
            request.generator = self._generator(request.seed)
        self.waiting.append(request)
        return request

    def has_work(self) -> bool:
        """Requests waiting or running, or a queued step whose tokens are not read yet."""
        return bool(self.waiting or self.running or self._in_flight is not None)

    def _generator(self, seed: int) -> torch.Generator:
        """A random generator on the model's device, seeded ``seed``."""
        return torch.Generator(device=self.device).manual_seed(seed)

    def _uncommitted_pages(self) -> int:
        """Free pages not promised to running requests' future tokens (and their samples')."""
        promised = sum(r.pages_to_come(self.page_size) for r in self.running)
        return len(self.allocator.free) - promised

    def _schedule(self) -> list[tuple[Request, int]]:
        """This step's (request, new tokens): every decode, then prompt chunks in arrival
        order within the token budget, admitting waiting requests while rows and pages last
        (a row and the worst-case pages for each of a request's ``n`` samples)."""
        batch = [(r, 1) for r in self.running if r.pending == 1]
        budget = self.token_budget - len(batch)
        for r in self.running:
            if r.pending > 1 and budget > 0:
                batch.append((r, min(r.pending, budget)))
                budget -= batch[-1][1]
        while (
            self.waiting and budget > 0 and self._rows_held + self.waiting[0].n <= self.max_running
        ):
            r = self.waiting[0]
            if r.pages_to_come(self.page_size) > self._uncommitted_pages():
                break
            self.waiting.popleft()
            r.row = self.free_rows.popleft()
            r.reserved_rows = [self.free_rows.popleft() for _ in range(r.n - 1)]
            self._rows_held += r.n
            self.table[[r.row, *r.reserved_rows]] = -1  # what a finished request left there
            self.running.append(r)
            self._family_members += r.n > 1
            batch.append((r, min(r.pending, budget)))
            budget -= batch[-1][1]
        return batch

    def _shared_prefix(self, batch: list[tuple[Request, int]]) -> fp.SharedPrefix | None:
        """The sharing of this step's batch: each run of consecutive decodes of one forked
        family (at least 2 of its samples) is a group sharing the family's prompt (its
        whole pages are the same ids in every member's row). A prompt shorter than a page
        shares no whole page, hence no group. ``None`` when there is no group."""

        if not self._family_members:
            return None  # no sampled family running (the usual step): nothing to scan

        def family(entry: tuple[Request, int]) -> Request | None:
            r, n = entry
            root = r.parent or r
            decoding = n == 1 and r.planned >= len(root.prompt)
            forked = root.n > 1 and not root.unforked
            whole = root.shared_pages(self.page_size) > 0
            return root if decoding and forked and whole else None

        groups: list[range] = []
        shared_lens: list[int] = []
        start = 0
        for root, run in itertools.groupby(batch, key=family):
            size = sum(1 for _ in run)
            if root is not None and size >= 2:
                groups.append(range(start, start + size))
                shared_lens.append(len(root.prompt))
            start += size
        if not groups:
            return None
        # the same families step after step: one record (and flashplan's per-sharing
        # arrays, kept per value) while they do not change
        key = (tuple((g.start, g.stop) for g in groups), tuple(shared_lens))
        if self._last_sharing is None or self._last_sharing[0] != key:
            level = fp.ShareLevel.from_ranges(
                [g.start for g in groups], [len(g) for g in groups], shared_lens
            )
            self._last_sharing = (key, fp.SharedPrefix.nested(level))
        return self._last_sharing[1]

    def _fork(self, parent: Request, pages: torch.Tensor) -> list[Request]:
        """Fork ``parent``'s ``n - 1`` samples, its prompt all cached (this step wrote its
        last tokens): each child holds the parent's whole prompt pages (shared: one more
        holder each) and a fresh copy of its partial last page (every layer's cache), on a
        row reserved at admission; the children follow the parent in :attr:`running`.
        ``pages`` is the step's page table on the device (the parent's row is complete)."""
        ps, prompt_len = self.page_size, len(parent.prompt)
        shared = parent.pages[: parent.shared_pages(ps)]
        children = []
        for k in range(1, parent.n):
            child = Request(
                parent.prompt, parent.max_new_tokens, n=1, temperature=parent.temperature,
                seed=None if parent.seed is None else parent.seed + k,
            )  # fmt: skip
            child.rid, self._next_id = self._next_id, self._next_id + 1
            child.parent, child.sample = parent, k
            child.tokens, child.num_cached = list(parent.prompt), prompt_len
            child.encoder_cached = True  # decoder-only: no encoder
            child.row = parent.reserved_rows.pop()
            child.pages = self.allocator.share(shared)
            if prompt_len % ps:  # the partial last page: its own copy
                child.pages += self.allocator.alloc(1)
            if child.seed is not None and child.temperature > 0:
                child.generator = self._generator(child.seed)
            self.table[child.row, : len(child.pages)] = child.pages
            children.append(child)
        if prompt_len % ps:
            copies = _on_device([c.pages[-1] for c in children], torch.int32, self.device)
            copies = copies.view(1, -1, 1)  # [1 request, n - 1 branches, 1 page]
            # an fp8 cache is copied as bytes (index_copy_ has no fp8 kernel on the CPU)
            caches = [
                c.view(torch.uint8) if c.element_size() == 1 else c for c in self.ctx.kv_caches
            ]
            fp.copy_prefix_pages(
                caches, fp.PageTable(pages, rows=[parent.row]), [prompt_len], copies,
                page_size=ps,
            )  # fmt: skip
        parent.children = children
        at = self.running.index(parent) + 1
        self.running[at:at] = children
        self._family_members += len(children)
        return children

    def _sample(
        self, logits: torch.Tensor, rows: list[int], samplers: list[Request]
    ) -> torch.Tensor:
        """The next token of each of ``samplers`` from logits row ``rows[i]`` (of
        ``logits``, ``[rows, vocab]``): the argmax at temperature 0, else a draw from
        ``softmax(logits / temperature)`` (float32) with the sampler's generator (one
        ``multinomial`` per such sampler: each has its own generator). Returns int64
        ``[len(samplers)]`` on the device; nothing is read back here."""
        if not samplers:
            return torch.zeros(0, dtype=torch.int64, device=self.device)
        if rows == list(range(len(rows))):  # every row in order (a step of decodes alone)
            picked = logits[: len(rows)]
        else:
            picked = logits[_on_device(rows, torch.int64, self.device)]  # [samplers, vocab]
        greedy = picked.argmax(-1)
        if all(r.temperature == 0 for r in samplers):
            return greedy
        temps = [r.temperature or 1.0 for r in samplers]  # (1.0: a greedy row, unused)
        temp = _on_device(temps, torch.float32, self.device)
        probs = torch.softmax(picked.float() / temp[:, None], dim=-1)
        tokens = [
            torch.multinomial(probs[i], 1, generator=r.generator)
            if r.temperature > 0
            else greedy[i : i + 1]
            for i, r in enumerate(samplers)
        ]
        return torch.cat(tokens)

    def run(self, requests: Iterable[Request] = ()) -> Iterator[StepOutput]:
        """Queue ``requests``, then step until no work is left, yielding each step's
        output (:meth:`step`: with the overlapped loop, once the next step is queued).

        Raises:
            RuntimeError: work is left but no step can run (no waiting request can be
                admitted: too few pages or rows for it).
        """
        for r in requests:
            self.add(r)
        while self.has_work():
            out = self.step()
            if out is None:
                raise RuntimeError(
                    "no request could be admitted: too few pages (num_pages) or rows "
                    "(max_running) for the next waiting request"
                )
            yield out

    # -- one step ---------------------------------------------------------------------------
    def step(self) -> StepOutput | None:
        """Run one batch and return its output, its sampled tokens read; ``None`` when
        there is nothing to run.

        The plain loop queues a step and reads its tokens. The overlapped loop returns
        the oldest step not returned yet: it queues the next step first (planned on the
        host while the GPU runs that one, a first call queueing two), then reads the
        oldest step's tokens, one step late (:mod:`.overlap`)."""
        if not self.overlap:
            launched = self._launch()
            return None if launched is None else self._read(launched)
        if self._in_flight is None:
            self._in_flight = self._launch()
            if self._in_flight is None:
                return None
        running = self._in_flight
        self._in_flight = self._launch()  # step N + 1, queued behind step N
        return self._read(running)

    def _launch(self) -> Launched | None:
        """Schedule, lay out, plan and queue one step; ``None`` when nothing can be
        scheduled. The host work comes first, then the step's GPU work in stream order
        (page table, encoder, input ids, apply, forward, sampling, the sampled tokens'
        copy to the host). Reads nothing back: the sampled tokens stay on the device."""
        batch = self._schedule()
        if not batch:
            return None
        reqs = [r for r, _ in batch]
        # 1. Layout: host integers only, over the K/V the queued steps will have written.
        #    A step of decodes alone plans on the decode kernels.
        prefix = [r.planned for r in reqs]
        seq = [p + n for p, (_, n) in zip(prefix, batch, strict=True)]
        enc: dict = {}
        if self.adapter.is_encoder_decoder:
            enc = dict(
                encoder_lens=[len(r.encoder_prompt or ()) for r in reqs],
                encoder_cached=[r.encoder_cached for r in reqs],  # joining requests: False
            )
        kw = dict(page_size=self.page_size, groups=self.groups, **enc)
        t0 = time.perf_counter()
        if all(n == 1 for _, n in batch):
            # an int32 array: the layout checks it in two reductions (a list of ints is
            # first scanned for bools and converted)
            layout = fp.BatchLayout.decode(np.array(seq, dtype=np.int32), **kw)
        else:
            layout = fp.BatchLayout.extend(seq, prefix, **kw)
        layout_s = time.perf_counter() - t0
        # 2. Pages: grow each row to what the layout needs, from the free list.
        for r, need in zip(reqs, layout.pages_needed.tolist(), strict=True):
            r.pages += self.allocator.alloc(need - len(r.pages))
            self.table[r.row, : len(r.pages)] = r.pages
        # 3. Plan once (with cascade levels where samples of one request decode together).
        t0 = time.perf_counter()
        shared = self._shared_prefix(batch)
        spec = fp.plan(
            layout, self.heads, extend_path=self.extend_path, shared_prefix=shared,
            cascade=self.cascade,
        )  # fmt: skip
        plan_s = time.perf_counter() - t0
        self.cascade_steps += spec.cascade is not None
        # the new tokens: host ints, or (decodes of the last step's unread samples) on
        # the device, gathered from that step's tokens
        ids = input_ids(batch, prefix, self._last_tokens, self.device)
        last = spec.qo_indptr[1:] - 1  # each request's last new token
        keep = np.arange(spec.total_q) if self.keep_all_logits else last
        bucket = None
        if self.graphs is not None and layout.mode is fp.Mode.DECODE and spec.cascade is None:
            bucket = self.graphs.bucket_for(len(reqs))  # (a bucket refuses cascade plans)
        # 4. The GPU work, queued: page table, encoder pass for joining requests (its own
        #    plan; no cache), apply once and the forward (every layer runs its group on
        #    this plan), or a captured decode step's replay (which applies the plan to
        #    its bucket).
        cuda = self.device.type == "cuda"
        events = (
            _NO_EVENTS
            if self.step_events is None
            else StepEvents(layout.mode is fp.Mode.DECODE, cuda=cuda)
        )
        events.record("start")
        pages = self.device_table.send(self.table)  # the same tensor every step
        table = fp.PageTable(pages, rows=[r.row for r in reqs])
        encoder_states = self._encode([r for r in reqs if not r.encoder_cached], pages)
        logits, apply_s = self._forward_step(
            bucket, spec, table, ids, keep, encoder_states, events
        )  # fmt: skip
        if layout.mode is fp.Mode.DECODE:
            self._count_decode_host(layout_s, plan_s, apply_s)
        # 5. Sampling, for requests whose last new token is their last known token. The
        #    tokens stay on the device; their copy to the host is queued.
        logits_row = last if self.keep_all_logits else np.arange(len(reqs))
        samplers, rows, forked = self._samplers(batch, prefix, logits_row, pages)
        tokens = self._sample(logits, rows, samplers)
        pending = self.reader.start(tokens)
        events.record("end")
        if self.step_events is not None:
            self.step_events.append(events)
        full = mark_launched(batch, samplers)
        self._last_tokens = tokens
        # a request that has sampled max_new_tokens tokens is done (no token value needed):
        # it leaves now, as in the plain loop; the steps queued next use its pages and row
        # only after this one in stream order
        for r in full:
            self._release(r)
        owners = [reqs[int(i)] for i in np.searchsorted(spec.qo_indptr, keep, side="right") - 1]
        positions = spec.positions[keep].tolist()
        out = StepOutput(
            batch, layout, spec, logits, owners, positions, {}, [], table, shared, forked,
            bucket is not None,
        )  # fmt: skip
        return Launched(out, samplers, tokens, pending)

    def _forward_step(
        self,
        bucket: int | None,
        spec: fp.PlanSpec,
        table: fp.PageTable,
        ids: list[int] | torch.Tensor,
        keep: np.ndarray,
        encoder_states: torch.Tensor | None,
        events: StepEvents,
    ) -> tuple[torch.Tensor, float]:
        """Queue the step's forward: apply once, then every layer runs its group on this
        plan, or replay graph bucket ``bucket`` (which applies the plan to its buffers).
        ``ids``: the new tokens (host ints, or int64 on the device); ``keep``: the token
        rows whose logits to keep. Returns the logits (``[len(keep), vocab]``, or the
        bucket's first rows) and the host seconds of the apply."""
        if bucket is not None:
            assert self.graphs is not None
            replay = self.graphs.prepare(bucket, spec, table, ids)
            events.record("forward")
            # a copy: the graph's output buffer is the next replay's too
            logits = replay()[: table.batch_size].clone()
            self.replayed_steps += 1
            return logits, self.graphs.last_apply_s
        t0 = time.perf_counter()
        self.executor.apply(spec, table)
        apply_s = time.perf_counter() - t0
        events.record("forward")
        if not isinstance(ids, torch.Tensor):
            ids = _on_device(ids, torch.int64, self.device)
        logits = self._forward.decode(
            ids,
            self.executor.positions().long(),  # RoPE, built on the device from the plan
            _on_device(keep, torch.int64, self.device),
            self._forward_ctx,
            encoder_states,
        )
        return logits, apply_s

    def _count_decode_host(self, layout_s: float, plan_s: float, apply_s: float) -> None:
        """Add a decode-only step's host seconds (layout, plan, apply) to the counters."""
        self.decode_host_s += layout_s + plan_s + apply_s
        parts = self.decode_host_parts
        parts["layout"] += layout_s
        parts["plan"] += plan_s
        parts["apply"] += apply_s
        self.decode_host_samples.append((layout_s, plan_s, apply_s))
        self.decode_steps += 1

    def _samplers(
        self,
        batch: list[tuple[Request, int]],
        prefix: list[int],
        logits_row: np.ndarray,
        pages: torch.Tensor,
    ) -> tuple[list[Request], list[int], list[Request]]:
        """The requests that sample this step, the logits row of each (``logits_row[j]``:
        batch entry ``j``'s last kept row) and the children forked: every request whose
        last new token is its last known token; a request with n > 1 whose prompt is now
        all in forks its samples first (``pages``: the step's device table), and each
        draws its first token from the parent's logits row."""
        samplers: list[Request] = []
        rows: list[int] = []
        forked: list[Request] = []
        for j, (r, n) in enumerate(batch):
            if prefix[j] + n < len(r.tokens) + r.unread:  # still feeding its prompt
                continue
            family = [r, *self._fork(r, pages)] if r.unforked else [r]
            forked += family[1:]
            samplers += family
            rows += [int(logits_row[j])] * len(family)
        return samplers, rows, forked

    def _read(self, step: Launched) -> StepOutput:
        """6. Read ``step``'s sampled tokens (waiting for their copy, which waits for the
        step's GPU work up to its sampling) and book them (:func:`.overlap.commit`); a
        request that sampled the stop token leaves now (one step late in the overlapped
        loop: after the next step, where it decodes once more, was queued). Returns the
        step's output, complete."""
        out = step.out
        out.sampled, out.finished, out.discarded = commit(step, step.pending.values(), self.eos)
        for r in out.finished:
            if r in self.running:  # (one that reached max_new_tokens has left already)
                self._release(r)
        return out

    def _release(self, r: Request) -> None:
        """A finished request leaves: its pages (one holder less each; the last holder
        of a shared page frees it), its row (its ids stay in the table until the row is
        handed out again: the live table still shows the step that ran them) and its
        place in :attr:`running`."""
        assert not r.reserved_rows, "a request finishes after forking its samples"
        self.allocator.release(r.pages)
        self.free_rows.append(r.row)
        self._rows_held -= 1
        self.running.remove(r)
        self._family_members -= r.n > 1 or r.parent is not None

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
        ids = _on_device(
            [t for r in joining for t in r.encoder_prompt or ()], torch.int64, self.device
        )
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
    device = next(adapter.model.parameters()).device
    h = adapter.heads
    scratch = torch.zeros(
        (sum(need), 2, page_size, h.num_kv_heads, h.head_dim), dtype=h.kv_dtype, device=device
    )
    executor.apply(spec, fp.PageTable(torch.from_numpy(table).to(device), rows=range(len(lens))))
    ctx = StepContext(executor, adapter.bindings, [scratch] * adapter.num_layers, conventions)
    ids = torch.tensor([t for p in prompts for t in p], device=device)
    hidden = adapter.encode(ids, executor.positions().long(), ctx)
    return list(hidden.split(lens))
