"""How far the GPU has come through an executor's queued work, read without waiting.

A pinned staging slot may be rewritten, and a FlashInfer wrapper planned again, only
once the GPU has run the copies that read them. Each used to carry its own CUDA event,
recorded after its use and queried before the next: an apply of one wrapper paid two
records and two queries (driver calls of a few microseconds each). A :class:`Timeline`
records one event per *mark* instead: an apply marks once, after everything it queued,
and every slot and wrapper it used keeps that mark's number (its *generation*). Marks
pass in the order they were made, so the timeline keeps the last generation it has seen
pass: a slot at or below it is idle without a driver call, and one query of the oldest
pending mark answers for every slot marked with it.

The rule that keeps this correct: a slot takes :attr:`Timeline.upcoming` (the next
mark's generation) only *after* its work is queued, so whichever mark comes next is
recorded after that work, on the stream the executor queues on. Events on different
streams may complete out of order; the timeline then waits for the older one before it
counts a newer one as passed (never early, at worst late).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Timeline"]

#: Marks kept pending before :meth:`Timeline.mark` drops those that have passed (the
#: slots' checks drop them as they go; this bounds the events held when they do not).
_MAX_PENDING = 64


class Timeline:
    """One executor's marks and the GPU's progress through them (see module docstring).

    Args:
        device: the CUDA device the marks are recorded on.
        event: makes the events (``torch.cuda.Event``; the CPU tests pass a stand-in
            with ``record(stream)``, ``query()`` and ``synchronize()``).

    Attributes:
        passed_upto: every mark up to this generation has passed (0: none yet).
        upcoming: the generation the next :meth:`mark` gets (what a slot whose work is
            queued takes).
    """

    def __init__(self, device: torch.device, event: Callable[[], Any] = torch.cuda.Event) -> None:
        self.device = device
        self._event = event
        self.passed_upto = 0
        self.upcoming = 1
        self._pending: deque[tuple[int, Any]] = deque()
        self._free: list[Any] = []

    def mark(self, stream: torch.cuda.Stream) -> int:
        """Record a mark after everything queued on ``stream`` so far; its generation
        (one event record; events are reused once their mark has passed)."""
        event = self._free.pop() if self._free else self._event()
        event.record(stream)
        generation = self.upcoming
        self.upcoming = generation + 1
        self._pending.append((generation, event))
        if len(self._pending) > _MAX_PENDING:  # nobody asked for a while: catch up
            self.passed(generation)
        return generation

    def passed(self, generation: int) -> bool:
        """Whether the GPU has passed mark ``generation`` and every mark before it
        (never waits). 0 (never marked) has passed; a generation not marked yet has
        not."""
        if generation <= self.passed_upto:
            return True
        pending = self._pending
        while pending:
            first, event = pending[0]
            if not event.query():
                return False
            pending.popleft()
            self._free.append(event)
            self.passed_upto = first
            if first >= generation:
                return True
        return False

    def wait(self, generation: int) -> None:
        """Block the host until mark ``generation`` has passed (a generation not marked
        yet: until the device has run everything queued so far, its work included)."""
        if generation >= self.upcoming:
            torch.cuda.synchronize(self.device)
            self.passed(self.upcoming - 1)  # every mark made so far has passed
            return
        while not self.passed(generation):
            self._pending[0][1].synchronize()
