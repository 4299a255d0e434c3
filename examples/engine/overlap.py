"""The overlapped step loop's bookkeeping: sampled tokens stay on the device, read one step late.

flashplan's layout, plan and ``apply`` never wait for the GPU, so the engine can plan and
queue step N+1 while the GPU runs step N (``Engine(overlap=True)``, the default):

1. step N is queued: page table, input ids, apply, forward, sampling, and a non-blocking
   copy of its sampled tokens into pinned memory followed by a CUDA event
   (:class:`TokenReader`); its tokens stay on the device (:attr:`Launched.tokens`);
2. step N+1 is scheduled, laid out, planned, applied and queued on the host while the
   GPU runs step N. Its requests that decode feed the tokens step N sampled: they are
   gathered on the device from step N's token tensor (:func:`input_ids`), nothing is read;
3. only then does the host wait for step N's event and read its tokens (one step late):
   :func:`commit` appends them to the requests' outputs and finds the finished ones.

The host's view of a request therefore runs one step behind what is queued. A request
counts what queued steps will have done (:func:`mark_launched`): ``queued`` tokens fed by
steps not read yet (the next layout's prefix is ``num_cached + queued``) and ``unread``
tokens sampled by them. A finish by ``max_new_tokens`` is known on the host when the step
that samples the last token is queued (the count needs no token value): the request
leaves then, as in the plain loop, and is not scheduled again (without a stop token the
two loops run the same steps). A finish by a stop token is seen only when the token is
read, after the next step has been queued with the request decoding in it: that extra
step's token is discarded (``StepOutput.discarded``), and the request's pages and row are
given back after the read, behind the extra step in stream order. Either way the tokens
equal the plain loop's, token for token.

At most one step is queued beyond the one being read: each pinned slot (two here, two in
the engine's page table and in each graph bucket) is rewritten only after the step that
used it two steps before has been read, hence has run.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from .engine import Request, StepOutput

__all__ = [
    "Launched",
    "PendingTokens",
    "StepEvents",
    "StepGaps",
    "TokenReader",
    "commit",
    "event_times",
    "input_ids",
    "mark_launched",
    "on_device",
    "step_gaps",
]


def on_device(
    values: Sequence[float] | np.ndarray, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``values`` as a 1-D ``dtype`` tensor on ``device``: from pinned memory,
    non-blocking, on a GPU (no wait for the work queued before it; a pageable copy
    would wait for the whole stream)."""
    t = torch.as_tensor(values).to(dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class PendingTokens:
    """One step's sampled tokens on their way to the host (:meth:`TokenReader.start`)."""

    def __init__(self, reader: TokenReader, slot: int, count: int) -> None:
        self._reader, self._slot, self.count = reader, slot, count

    def values(self) -> np.ndarray:
        """int64 ``[count]`` host copy of the tokens; on a GPU waits for the copy's event
        (the step's GPU work up to its sampling). Read once."""
        return self._reader._finish(self._slot, self.count)


class TokenReader:
    """Reads sampled tokens back to the host without a wait at the copy: two slots of
    int64 ``[capacity]``, pinned with a CUDA event each on a GPU (the copy is queued
    non-blocking, the event after it; the read waits for the event), plain host tensors on
    the CPU (the copy is done at once). A slot is reused every other step, so at most
    two steps may be started and not read.

    Args:
        capacity: the most tokens a step samples (the engine's page-table rows).
        device: the model's device.
    """

    def __init__(self, capacity: int, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._slots = [
            torch.empty(capacity, dtype=torch.int64, pin_memory=self._cuda) for _ in range(2)
        ]
        self._events = [torch.cuda.Event() for _ in range(2)] if self._cuda else []
        self._busy = [False, False]
        self._next = 0
        #: reads done so far (tests count them)
        self.reads = 0

    def start(self, tokens: torch.Tensor) -> PendingTokens:
        """Queue the copy of ``tokens`` (int64 ``[n]`` on the device, ``n <= capacity``)
        to the host; read it with :meth:`PendingTokens.values`.

        Raises:
            RuntimeError: both slots hold steps not read yet.
        """
        k = self._next
        if self._busy[k]:
            raise RuntimeError("a third step's tokens were started before the first was read")
        self._next ^= 1
        n = int(tokens.shape[0])
        self._slots[k][:n].copy_(tokens, non_blocking=self._cuda)
        if self._cuda:
            self._events[k].record()
        self._busy[k] = True
        return PendingTokens(self, k, n)

    def _finish(self, k: int, n: int) -> np.ndarray:
        if not self._busy[k]:
            raise RuntimeError("these tokens were read already")
        if self._cuda:
            self._events[k].synchronize()
        self._busy[k] = False
        self.reads += 1
        return self._slots[k][:n].numpy().copy()


@dataclass(eq=False)
class Launched:
    """A step whose GPU work is queued and whose sampled tokens the host has not read.

    Attributes:
        out: the step's output; ``sampled``, ``finished`` and ``discarded`` are filled by
            :func:`commit` when the tokens are read.
        samplers: the requests that sample this step, in the order of :attr:`tokens`
            (children forked this step included).
        tokens: int64 ``[len(samplers)]`` on the device: the sampled tokens, which the next
            step's decodes feed (:func:`input_ids`).
        pending: their copy to the host.
    """

    out: StepOutput
    samplers: list[Request]
    tokens: torch.Tensor
    pending: PendingTokens


def mark_launched(batch: list[tuple[Request, int]], samplers: list[Request]) -> list[Request]:
    """Count what a queued step will have done, before anything of it is read: each
    request of ``batch`` fed ``n`` tokens (``queued``; its encoder K/V is cached), and each
    of ``samplers`` sampled the token at index ``token_slot`` of the step's tokens
    (``unread``). Returns the samplers that have now sampled ``max_new_tokens`` tokens
    (known without their values)."""
    for r, n in batch:
        r.queued += n
        r.encoder_cached = True
    full = []
    for i, r in enumerate(samplers):
        r.unread += 1
        r.token_slot = i
        if len(r.output) + r.unread >= r.max_new_tokens:
            full.append(r)
    return full


def commit(
    step: Launched, values: np.ndarray, eos: int | None
) -> tuple[dict[int, int], list[Request], list[Request]]:
    """Book a step whose tokens (``values``, int64 ``[len(step.samplers)]``) were just read:
    its fed tokens are cached, and each sampler's token is appended, unless the request
    was done before (a stop token read one step late: the token is discarded). A request
    is done when it has ``max_new_tokens`` tokens or samples ``eos``.

    Returns:
        (request id -> token appended, requests done with this step, requests whose token
        was discarded), the latter two in sampler order.
    """
    for r, n in step.out.batch:
        r.queued -= n
        r.num_cached += n
    sampled: dict[int, int] = {}
    finished: list[Request] = []
    discarded: list[Request] = []
    for r, token in zip(step.samplers, values.tolist(), strict=True):
        r.unread -= 1
        if r.done:
            discarded.append(r)
            continue
        r.tokens.append(token)
        r.output.append(token)
        sampled[r.rid] = token
        if len(r.output) >= r.max_new_tokens or token == eos:
            r.done = True
            finished.append(r)
    return sampled, finished, discarded


def input_ids(
    batch: list[tuple[Request, int]],
    prefix: Sequence[int],
    last_tokens: torch.Tensor | None,
    device: torch.device,
) -> list[int] | torch.Tensor:
    """A step's new tokens, request after request (``sum(n)`` of them).

    Request ``r`` feeds ``r.tokens[prefix : prefix + n]``, except a request whose newest
    token is sampled but not read (``unread``: a decode): that token is at ``token_slot``
    of ``last_tokens`` (int64 ``[samplers]`` on ``device``, the previous step's).

    Returns:
        Host ints when every token is on the host (the plain loop, or prompt chunks
        only). Otherwise an int64 device tensor, built without reading the device:
        ``last_tokens`` itself when the step's requests are the previous step's samplers
        in order, each decoding; else a gather of it (one pinned copy of the host tokens
        and the gather's indices, one ``index_copy_``).
    """
    lens = np.fromiter((n for _, n in batch), np.int64, len(batch))
    unread = np.fromiter((r.unread > 0 for r, _ in batch), bool, len(batch))
    if not unread.any():
        return [t for (r, n), p in zip(batch, prefix, strict=True) for t in r.tokens[p : p + n]]
    assert last_tokens is not None and (lens[unread] == 1).all(), "unread tokens are decodes"
    slots = np.fromiter((r.token_slot for r, _ in batch), np.int64, len(batch))[unread]
    if unread.all():
        if slots.size == last_tokens.shape[0] and (slots == np.arange(slots.size)).all():
            return last_tokens
        return last_tokens.index_select(0, on_device(slots, torch.int64, device))
    starts = np.cumsum(lens) - lens
    host = np.zeros(int(lens.sum()), np.int64)  # the device tokens' places: 0 until gathered
    for j in np.flatnonzero(~unread).tolist():
        r, p, n = batch[j][0], prefix[j], int(lens[j])
        host[starts[j] : starts[j] + n] = r.tokens[p : p + n]
    total, k = host.size, slots.size
    packed = on_device(np.concatenate([host, starts[unread], slots]), torch.int64, device)
    ids = packed[:total]
    ids.index_copy_(0, packed[total : total + k], last_tokens.index_select(0, packed[total + k :]))
    return ids


# -- measuring the GPU's idle time between steps (benchmarks/bench_engine.py) ---------------
EVENT_NAMES = ("start", "forward", "end")


class StepEvents:
    """Timing marks of one step's work, recorded by the engine when
    :attr:`Engine.step_events` is a list: ``start`` before the step's first copy (its page
    table), ``forward`` before its forward or graph replay (after its apply), ``end`` after
    the copy of its sampled tokens. On a GPU they are CUDA events (timing on), so the gaps
    between steps are the GPU's idle time; elsewhere (``cuda=False``) the host clock at
    each mark, where every op runs when it is called and nothing overlaps (the CPU smoke
    mode of ``benchmarks/bench_engine.py``). ``timing=False``: records nothing.

    Attributes:
        decode: the step decodes only.
        events: the CUDA events by name (``cuda`` and ``timing``).
        host_ms: the host clock at each mark, ms (``timing`` without ``cuda``).
    """

    def __init__(self, decode: bool, timing: bool = True, *, cuda: bool = True) -> None:
        self.decode = decode
        self.events: dict[str, torch.cuda.Event] = {}
        self.host_ms: dict[str, float] = {}
        self._host = timing and not cuda
        if timing and cuda:
            self.events = {n: torch.cuda.Event(enable_timing=True) for n in EVENT_NAMES}

    def record(self, name: str) -> None:
        """Record mark ``name``: a CUDA event on the current stream, or the host clock
        (nothing when timing is off)."""
        if self.events:
            self.events[name].record()
        elif self._host:
            self.host_ms[name] = time.perf_counter() * 1e3


def event_times(steps: Sequence[StepEvents]) -> np.ndarray:
    """float64 ``[steps, 3]`` milliseconds of each step's start, forward and end marks
    after the first step's start. CUDA events: call after the GPU has run them
    (synchronize)."""
    if not steps[0].events:  # the host clock
        origin = steps[0].host_ms["start"]
        return np.array(
            [[s.host_ms[n] - origin for n in EVENT_NAMES] for s in steps], dtype=np.float64
        )
    first = steps[0].events["start"]
    return np.array(
        [[first.elapsed_time(s.events[n]) for n in EVENT_NAMES] for s in steps], dtype=np.float64
    )


@dataclass(frozen=True)
class StepGaps:
    """The GPU's idle time between consecutive decode steps.

    Attributes:
        pairs: pairs of consecutive decode steps measured.
        step_ms: median period of a step (one start to the next), ms.
        idle_us: median gap between a step's end and the next step's start, µs.
        idle_share: summed gaps over summed periods.
        idle_share_median: median of each pair's gap over its period.
        to_forward_share: summed gaps from a step's end to the next step's forward (the
            next step's page-table copy and apply included) over summed periods.
    """

    pairs: int
    step_ms: float
    idle_us: float
    idle_share: float
    idle_share_median: float
    to_forward_share: float


def step_gaps(times: np.ndarray, decode: np.ndarray) -> StepGaps:
    """:class:`StepGaps` of ``times`` (float ms ``[steps, 3]``: each step's start,
    forward and end events, from one origin; :func:`event_times`) over the pairs of
    consecutive steps that both decode (``decode``: bool ``[steps]``).

    Raises:
        ValueError: no two consecutive decode steps.
    """
    pairs = np.flatnonzero(decode[:-1] & decode[1:])
    if not pairs.size:
        raise ValueError("decode: no two consecutive decode steps to measure")
    start, forward, end = (times[:, i] for i in range(3))
    idle = start[pairs + 1] - end[pairs]
    to_forward = forward[pairs + 1] - end[pairs]
    period = start[pairs + 1] - start[pairs]
    return StepGaps(
        pairs=int(pairs.size),
        step_ms=float(np.median(period)),
        idle_us=float(np.median(idle)) * 1e3,
        idle_share=float(idle.sum() / period.sum()),
        idle_share_median=float(np.median(idle / period)),
        to_forward_share=float(to_forward.sum() / period.sum()),
    )
