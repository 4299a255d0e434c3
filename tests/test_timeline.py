"""The executor's :class:`Timeline` (CPU, with stand-in events): a slot is idle only
once the mark after its work has passed, marks count as passed in the order they were
made, one query answers for every slot of a mark, and events are reused only after
their mark has passed."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashplan.executor.flashinfer.timeline import Timeline


class FakeEvent:
    """A CUDA event stand-in: ``done`` is set by the test (the GPU's progress)."""

    def __init__(self, log: list[FakeEvent]) -> None:
        self.done = False
        self.recorded = 0
        self.queries = 0
        self.log = log
        log.append(self)

    def record(self, stream: object) -> None:
        self.done = False
        self.recorded += 1
        self.log.append(self)  # the last entry: the event recorded last

    def query(self) -> bool:
        self.queries += 1
        return self.done

    def synchronize(self) -> None:
        self.done = True


def _timeline(log: list[FakeEvent] | None = None) -> tuple[Timeline, list[FakeEvent]]:
    """A timeline over stand-in events, and the events it made (in order); ``log``
    gets every event as it is recorded."""
    records: list[FakeEvent] = [] if log is None else log
    made: list[FakeEvent] = []

    def make() -> FakeEvent:
        made.append(FakeEvent(records))
        return made[-1]

    return Timeline(torch.device("cpu"), event=make), made


def test_a_slot_is_free_once_the_mark_after_its_work_has_passed() -> None:
    tl, made = _timeline()
    assert tl.passed(0)  # a slot never used
    slot = tl.upcoming  # its work queued: it takes the next mark
    assert not tl.passed(slot)  # not marked yet
    assert tl.mark(None) == slot  # type: ignore[arg-type]
    assert not tl.passed(slot)
    made[0].done = True
    assert tl.passed(slot) and tl.passed_upto == slot
    queries = made[0].queries
    assert tl.passed(slot) and made[0].queries == queries  # known passed: no query


def test_marks_pass_in_order_and_one_query_serves_a_mark() -> None:
    tl, made = _timeline()
    first, second = tl.mark(None), tl.mark(None)  # type: ignore[arg-type]
    made[1].done = True  # the later mark's event completed first (another stream)
    assert not tl.passed(second)  # never early: the older mark is still pending
    made[0].done = True
    assert tl.passed(second) and tl.passed(first)
    assert tl.passed_upto == second


def test_events_are_reused_only_after_their_mark_has_passed() -> None:
    tl, made = _timeline()
    g1 = tl.mark(None)  # type: ignore[arg-type]
    tl.mark(None)  # type: ignore[arg-type]
    assert len(made) == 2  # the first is still pending: a new event
    made[0].done = True
    assert tl.passed(g1)
    tl.mark(None)  # type: ignore[arg-type]
    assert len(made) == 2 and made[0].recorded == 2  # the passed one, recorded again


def test_wait_blocks_until_the_mark_has_passed() -> None:
    tl, made = _timeline()
    g1, g2 = tl.mark(None), tl.mark(None)  # type: ignore[arg-type]
    tl.wait(g2)
    assert all(e.done for e in made) and tl.passed_upto == g2 and tl.passed(g1)


def test_pending_marks_are_bounded_without_queries() -> None:
    tl, made = _timeline()
    for _ in range(200):
        tl.mark(None)  # type: ignore[arg-type]
        for e in made:  # the GPU keeps up; nobody asks
            e.done = True
    assert len(tl._pending) <= 65 and len(made) <= 66


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["use", "mark", "progress"]), st.integers(0, 30)),
                max_size=60))  # fmt: skip
def test_never_early_against_a_model(ops: list[tuple[str, int]]) -> None:
    """Random slot uses, marks and GPU progress (in order, as one stream runs): a slot
    judged idle took a mark that the GPU has completed, with every mark before it; and
    once the GPU has completed a slot's mark, the slot is judged idle."""
    records: list[FakeEvent] = []
    tl, _ = _timeline(records)
    slots: list[int] = []  # each slot's generation, taken after its work was queued
    events: list[FakeEvent] = []  # the event of each mark when it was recorded
    completed: list[bool] = []  # per mark, whether the GPU has run up to it
    for op, arg in ops:
        if op == "use":
            slots.append(tl.upcoming)
        elif op == "mark":
            g = tl.mark(None)  # type: ignore[arg-type]
            assert g == len(completed) + 1
            events.append(records[-1])
            completed.append(False)
        else:  # the GPU runs the oldest `arg % 3` marks not run yet
            todo = [g for g, c in enumerate(completed) if not c][: arg % 3]
            for g in todo:
                completed[g] = True
                events[g].done = True
        for g in slots:
            if tl.passed(g):
                assert g == 0 or (g <= len(completed) and all(completed[:g]))
            else:
                assert g > len(completed) or not all(completed[:g])
