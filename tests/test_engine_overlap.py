"""The example engine's overlapped step loop (``Engine(overlap=True)``, the default)
against its plain loop (``overlap=False``, ``run.py --plain-loop``), on the CPU reference
executor.

The overlapped loop queues step N+1 before it reads step N's sampled tokens: step N+1's
decodes feed those tokens from the device, and the host books them one step late. Checked
here: the greedy tokens equal the plain loop's, token for token, with requests joining
(admitted as rows free up, and one added mid-run), finishing at different steps (by
``max_new_tokens``, and on a stop token whose finish is seen one step late: one extra
decode step, its token discarded), chunked prompts, page sizes 1 and 16, three model
families (Llama, Gemma 2 with windows, BART encoder-decoder); every logits row of the
overlapped run, the extra steps' included, equals HF's; the reads of sampled tokens
happen one step late and the decodes' input tokens come from the device, never read by
the host first; parallel samples at a temperature draw the same tokens; the pieces
(:func:`overlap.input_ids`, :class:`overlap.TokenReader`, :func:`overlap.step_gaps`,
the host-clock marks) and the CLI flag. ``benchmarks/bench_engine.py --parts overlap``'s
CPU smoke run: tests/test_engine_bench.py.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: examples.engine

import flashplan as fp
from examples.engine import engine as engine_module
from examples.engine import overlap
from examples.engine.engine import Engine, Request, StepOutput
from examples.engine.hf_models import adapter_for, load_model
from examples.engine.parity import check_parity, reference_model
from examples.engine.run import make_requests

KV_TOKENS = 384  # KV capacity per layer: 24 pages of 16, or 384 pages of 1
ATOL = 1e-4  # fp32 engine vs fp32 HF


@functools.cache
def models(name: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(engine model with random weights, fp32 eager HF reference with the same weights)."""
    model = load_model(name)
    return model, reference_model(model)


def scenario(
    name: str, page_size: int, *, overlap: bool, eos: int | None = None
) -> tuple[Engine, list[Request], list[StepOutput]]:
    """Seven requests (prompts of 1 to 40 tokens, 6 to 8 new tokens), 3 at a time, 16 new
    tokens a step (long prompts are chunked), every logits row kept; an eighth request is
    added after the third step returned (it joins mid-run)."""
    model, _ = models(name)
    engine = Engine(
        adapter_for(model), fp.ReferenceExecutor(), page_size=page_size,
        num_pages=KV_TOKENS // page_size, max_running=3, token_budget=16,
        keep_all_logits=True, eos_token_id=eos, overlap=overlap,
    )  # fmt: skip
    encdec = model.config.is_encoder_decoder
    reqs = make_requests(model.config.vocab_size, encdec, 8, 8, 0)
    late = reqs.pop(5)  # a 3-token prompt
    steps = []
    for out in engine.run(reqs):
        steps.append(out)
        if len(steps) == 3:
            reqs.append(engine.add(late))
    assert not engine.has_work() and not engine.running
    assert len(engine.allocator.free) == KV_TOKENS // page_size
    assert not engine.allocator.holders.any()
    return engine, reqs, steps


@functools.cache
def plain_outputs(name: str) -> list[list[int]]:
    """The plain loop's tokens with no stop token (page 16)."""
    return [r.output for r in scenario(name, 16, overlap=False)[1]]


def stop_token(outputs: list[list[int]]) -> int:
    """A token that some request generates before its last token and another request
    never generates: with it as the stop token, one request stops early, another runs to
    ``max_new_tokens``."""
    for out in outputs:
        for token in out[1:-1]:
            if any(token not in other for other in outputs):
                return token
    raise AssertionError(f"no usable stop token in {outputs}")


@pytest.mark.parametrize(
    ("name", "page_size"), [("llama", 16), ("llama", 1), ("gemma2", 1), ("bart", 16)]
)
def test_overlapped_tokens_equal_the_plain_loop(name: str, page_size: int) -> None:
    eos = stop_token(plain_outputs(name))
    _, plain_reqs, plain_steps = scenario(name, page_size, overlap=False, eos=eos)
    engine, reqs, steps = scenario(name, page_size, overlap=True, eos=eos)
    assert engine.overlap and not any(s.discarded for s in plain_steps)
    assert [r.output for r in reqs] == [r.output for r in plain_reqs]

    # The run covered what it should.
    stopped = [r for r in reqs if r.output[-1] == eos and len(r.output) < r.max_new_tokens]
    assert stopped and any(len(r.output) == r.max_new_tokens for r in reqs)
    # every stop token was read one step late: its request decoded once more, discarded
    discarded = [r for s in steps for r in s.discarded]
    assert sorted(r.rid for r in discarded) == sorted(r.rid for r in stopped)
    for out in steps:  # ... in the step after the one that sampled the stop token
        for r in out.discarded:
            assert r.rid not in out.sampled and any(q is r for q, _ in out.batch)
    finished = [r.rid for s in steps for r in s.finished]
    assert sorted(finished) == sorted(r.rid for r in reqs)  # each finished once
    assert any((s.layout.extend_lens > 1).any() and (s.layout.extend_lens == 1).any()
               for s in steps), "no decode mixed with a prompt chunk"  # fmt: skip
    assert any(((s.layout.prefix_lens > 0) & (s.layout.extend_lens > 1)).any() for s in steps)
    joined = [i for i, s in enumerate(steps) for r, n in s.batch if r.rid == reqs[-1].rid]
    assert joined and joined[0] > 3  # the request added mid-run
    assert any(s.layout.mode is fp.Mode.DECODE for s in steps)
    # Every logits row, the discarded steps' included, is HF's at its position.
    parity = check_parity(models(name)[1], reqs, steps)
    assert parity.max_abs_diff <= ATOL and not parity.mismatches, parity.line()


def test_without_a_stop_token_the_steps_are_the_plain_loops() -> None:
    """A finish by ``max_new_tokens`` is known when the step is queued: the overlapped
    loop schedules exactly the plain loop's steps (same batches, same pages)."""
    _, plain_reqs, plain = scenario("gemma2", 16, overlap=False)
    _, reqs, steps = scenario("gemma2", 16, overlap=True)
    assert [r.output for r in reqs] == [r.output for r in plain_reqs]

    def batches(run: list[StepOutput]) -> list[list[tuple[int, int, tuple[int, ...]]]]:
        return [[(r.rid, n, tuple(r.pages)) for r, n in s.batch] for s in run]

    assert len(steps) == len(plain) and batches(steps) == batches(plain)
    assert [s.sampled for s in steps] == [s.sampled for s in plain]
    assert [[r.rid for r in s.finished] for s in steps] == [
        [r.rid for r in s.finished] for s in plain
    ]


@pytest.mark.parametrize("loop", ["overlapped", "plain"])
def test_sampled_tokens_are_read_one_step_late(loop: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The order of queuing steps (``_launch``) and reading their tokens: overlapped,
    step N is read after step N+1 was queued (L1 L2 R1 L3 R2 ...); plain, right after it
    was queued (L1 R1 L2 R2 ...). With the overlapped loop every decode's input token is
    one the host has not read when the step is queued: it is taken on the device from
    the previous step's tokens, and it is the right one (the request's final tokens)."""
    log: list[tuple[str, int]] = []
    fed: list[tuple[list[tuple[Request, int, int, int, int]], list[int]]] = []
    number: dict[int, int] = {}  # id(StepOutput) -> the step's number, in launch order
    alive: list[object] = []  # every StepOutput kept, so that no id() is reused
    real_launch, real_finish = Engine._launch, overlap.TokenReader._finish

    def launch(self: Engine) -> overlap.Launched | None:
        step = real_launch(self)
        if step is not None:
            alive.append(step.out)
            number[id(step.out)] = len(number) + 1
            log.append(("L", len(number)))
        return step

    def read(self: overlap.TokenReader, slot: int, count: int) -> np.ndarray:
        log.append(("R", 0))  # numbered below, from the output returned
        return real_finish(self, slot, count)

    def input_ids(batch, prefix, last, device):  # type: ignore[no-untyped-def]
        ids = overlap.input_ids(batch, prefix, last, device)
        host = [  # what the host knows of each request when the step is queued
            (r, n, p, r.unread, len(r.tokens)) for (r, n), p in zip(batch, prefix, strict=True)
        ]
        fed.append((host, torch.as_tensor(ids).tolist()))  # (the test reads; CPU)
        return ids

    monkeypatch.setattr(Engine, "_launch", launch)
    monkeypatch.setattr(overlap.TokenReader, "_finish", read)
    monkeypatch.setattr(engine_module, "input_ids", input_ids)
    model, _ = models("llama")
    engine = Engine(
        adapter_for(model), fp.ReferenceExecutor(), page_size=4, num_pages=32, max_running=2,
        token_budget=8, overlap=loop == "overlapped",
    )  # fmt: skip
    reqs = [Request(list(range(3, 14)), 5), Request(list(range(7, 10)), 3), Request([5, 6], 4)]
    returned = []
    for out in engine.run(reqs):
        returned.append(number[id(out)])
        # number the read that returned this step
        last_read = max(i for i, (kind, _) in enumerate(log) if kind == "R")
        log[last_read] = ("R", returned[-1])
    steps = len(returned)
    assert returned == list(range(1, steps + 1)) and engine.reader.reads == steps
    if loop == "plain":
        want = [(k, i) for i in range(1, steps + 1) for k in "LR"]
    else:
        want = [("L", 1)] + [e for i in range(1, steps) for e in (("L", i + 1), ("R", i))]
        want.append(("R", steps))
    assert log == want
    device_fed = 0
    for host, ids in fed:
        at = 0
        for r, n, p, unread, known in host:
            if unread:  # sampled by the step before, not read: the host lacks it
                assert loop == "overlapped" and n == 1 and known == p
                device_fed += 1
            assert ids[at : at + n] == r.tokens[p : p + n]  # the right tokens, read later
            at += n
    decodes = sum(n == 1 and p >= len(r.prompt) for host, _ in fed for r, n, p, *_ in host)
    assert device_fed == (decodes if loop == "overlapped" else 0) and decodes > 5


def test_parallel_samples_overlapped_equal_plain() -> None:
    """Samples at temperature 0.8 (n = 3 and 2, their own seeded generators) and a greedy
    request, cascade levels on: the overlapped loop draws the plain loop's tokens (the
    forks' first tokens, drawn from the parent's row, included)."""

    def run(overlap_: bool) -> list[list[int]]:
        engine = Engine(
            adapter_for(models("llama")[0]), fp.ReferenceExecutor(), page_size=4,
            num_pages=64, max_running=6, token_budget=16, cascade="on", overlap=overlap_,
        )  # fmt: skip
        rng = np.random.default_rng(3)
        reqs = [
            Request(rng.integers(3, 512, 10).tolist(), 5, n=3, temperature=0.8, seed=1),
            Request(rng.integers(3, 512, 7).tolist(), 4),
            Request(rng.integers(3, 512, 13).tolist(), 6, n=2, temperature=0.8, seed=9),
        ]
        steps = list(engine.run(reqs))
        assert engine.cascade_steps > 0 and any(s.forked for s in steps)
        return [s.output for r in reqs for s in r.samples]

    plain, overlapped = run(False), run(True)
    assert overlapped == plain and len(plain) == 6


# -- the pieces ---------------------------------------------------------------------------
@settings(max_examples=40)
@given(st.data())
def test_input_ids_gather_the_unread_tokens(data: st.DataObject) -> None:
    """:func:`overlap.input_ids`: prompt chunks from the host, each decode's unread token
    from its slot of the previous step's tokens (any order, any subset), whole."""
    count = data.draw(st.integers(1, 6))
    last = torch.tensor(data.draw(st.lists(st.integers(0, 99), min_size=count, max_size=count)))
    slots = data.draw(st.permutations(range(count)))
    batch, prefix, want = [], [], []
    for slot in slots[: data.draw(st.integers(0, count))]:
        r = Request([1, 2], 4)
        r.tokens, r.unread, r.token_slot = [1, 2], 1, slot  # its token 3 is on the device
        batch.append((r, 1))
        prefix.append(2)
        want.append(int(last[slot]))
    for _ in range(data.draw(st.integers(0 if batch else 1, 3))):  # prompt chunks
        tokens = data.draw(st.lists(st.integers(100, 200), min_size=2, max_size=8))
        p = data.draw(st.integers(0, len(tokens) - 1))
        n = data.draw(st.integers(1, len(tokens) - p))
        r = Request(tokens, 4)
        r.tokens = list(tokens)
        at = data.draw(st.integers(0, len(batch)))
        batch.insert(at, (r, n))
        prefix.insert(at, p)
        offset = sum(k for _, k in batch[:at])  # its tokens' place in the step
        want[offset:offset] = tokens[p : p + n]
    ids = overlap.input_ids(batch, prefix, last, torch.device("cpu"))
    if all(r.unread == 0 for r, _ in batch):
        assert ids == want  # host ints: nothing on the device
    else:
        assert isinstance(ids, torch.Tensor) and ids.tolist() == want
        if [r.token_slot for r, _ in batch] == list(range(count)):
            assert ids is last  # the previous step's tokens themselves


def test_token_reader_reads_each_step_once() -> None:
    reader = overlap.TokenReader(4, torch.device("cpu"))
    first = reader.start(torch.tensor([5, 6, 7]))
    second = reader.start(torch.tensor([8]))
    with pytest.raises(RuntimeError, match="third step"):
        reader.start(torch.tensor([9]))
    assert first.values().tolist() == [5, 6, 7]
    with pytest.raises(RuntimeError, match="read already"):
        first.values()
    third = reader.start(torch.tensor([1, 2]))  # the first slot again
    assert second.values().tolist() == [8] and third.values().tolist() == [1, 2]
    assert reader.reads == 3


def test_step_gaps() -> None:
    """Idle between consecutive decode steps: start of the next minus end of the one
    before, over the period start to start; a prefill step starts no pair."""
    times = np.array(
        [[0.0, 1.0, 5.0], [6.0, 6.5, 10.0], [10.2, 10.4, 14.0], [15.0, 15.1, 19.0]]
    )  # ms: an extend, then three decode steps
    gaps = overlap.step_gaps(times, np.array([False, True, True, True]))
    assert gaps.pairs == 2
    assert gaps.idle_share == pytest.approx(1.2 / 9.0)
    assert gaps.idle_share_median == pytest.approx(np.median([0.2 / 4.2, 1.0 / 4.8]))
    assert gaps.to_forward_share == pytest.approx(1.5 / 9.0)
    assert gaps.step_ms == pytest.approx(4.5) and gaps.idle_us == pytest.approx(600.0)
    with pytest.raises(ValueError, match="consecutive decode"):
        overlap.step_gaps(times, np.array([True, False, True, False]))


def test_step_marks_on_the_cpu_use_the_host_clock() -> None:
    """``Engine.step_events`` on the CPU: every step bracketed by host-clock marks in
    order (start <= forward <= end, each step after the one before it in the plain loop),
    read by :func:`overlap.event_times` and :func:`overlap.step_gaps`."""
    model, _ = models("llama")
    engine = Engine(
        adapter_for(model), fp.ReferenceExecutor(), page_size=4, num_pages=32, max_running=2,
        token_budget=8, overlap=False,
    )  # fmt: skip
    engine.step_events = []
    steps = list(engine.run([Request(list(range(3, 14)), 5), Request([5, 6], 4)]))
    marks = engine.step_events
    assert len(marks) == len(steps) and all(not m.events for m in marks)
    times = overlap.event_times(marks)
    assert times[0, 0] == 0.0 and (np.diff(times, axis=1) >= 0).all()
    assert (times[1:, 0] >= times[:-1, 2]).all()  # the plain loop: one step after another
    gaps = overlap.step_gaps(times, np.array([m.decode for m in marks]))
    assert gaps.pairs >= 2 and 0.0 <= gaps.idle_share < 1.0 and gaps.step_ms > 0
    off = overlap.StepEvents(decode=True, timing=False, cuda=False)
    off.record("start")
    assert not off.events and not off.host_ms


def test_run_cli_plain_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """The overlapped loop is the default, of ``Engine`` and of ``run.py``;
    ``run.py --plain-loop`` gives the engine the plain loop."""
    from examples.engine import run

    seen: list[bool] = []
    real = Engine.__init__

    def spy(self: Engine, *args: object, **kwargs: object) -> None:
        real(self, *args, **kwargs)  # type: ignore[arg-type]
        seen.append(self.overlap)

    monkeypatch.setattr(Engine, "__init__", spy)
    argv = ["--model", "llama", "--requests", "2", "--max-new-tokens", "3"]
    assert run.main(argv) == 0
    assert run.main([*argv, "--plain-loop"]) == 0
    assert seen == [True, False]
    assert Engine(adapter_for(models("llama")[0]), fp.ReferenceExecutor()).overlap
