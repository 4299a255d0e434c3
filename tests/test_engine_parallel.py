"""Parallel sampling (``Request.n > 1``) in the example engine, on the CPU reference executor.

A request with ``n`` samples is prefilled once; when its prompt is all cached the engine
forks ``n - 1`` children that hold the parent's whole prompt pages (the same page ids,
counted by holders in the allocator) and a copy of its partial last page, and the decode
steps of a family are planned with shared-prefix (cascade) levels. Checked here: the
tokens do not depend on the cascade, each sample draws what a lone request with its seed
draws, every logits row matches HF's forward of that sample alone, the pages are shared,
counted and all given back, and the plans' sharing keeps the page-table promise.
"""

from __future__ import annotations

import collections
import functools
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: examples.engine

import flashplan as fp
from examples.engine.engine import Engine, Request, StepOutput
from examples.engine.hf_models import DecoderOnly, EncoderDecoder, adapter_for, load_model
from examples.engine.parity import check_parity, reference_model

PAGE = 4  # tokens per page: prompts of 10 and 13 tokens end inside a page, 8 on a boundary
NUM_PAGES = 64
ATOL = 1e-4  # fp32 engine vs fp32 HF


@functools.cache
def models(name: str = "llama") -> tuple[torch.nn.Module, torch.nn.Module]:
    """(engine model with random weights, fp32 eager HF reference with the same weights)."""
    model = load_model(name)
    return model, reference_model(model)


def prompt(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 512, length).tolist()


def families(temperature: float) -> list[Request]:
    """Three samples of a 10-token prompt, a plain request, two samples of a 13-token
    prompt and three of an 8-token one (whole pages only), 4 to 6 new tokens each."""
    return [
        Request(prompt(10, 1), 6, n=3, temperature=temperature, seed=100),
        Request(prompt(7, 2), 5, temperature=temperature, seed=7),
        Request(prompt(13, 3), 6, n=2, temperature=temperature, seed=200),
        Request(prompt(8, 4), 4, n=3, temperature=temperature, seed=300),
    ]


def check_pages(engine: Engine) -> None:
    """Every page is held by as many running rows as hold it in their page lists, and
    the free list holds each unheld page exactly once."""
    held = collections.Counter(p for r in engine.running for p in r.pages)
    holders = engine.allocator.holders
    assert dict(held) == {int(p): int(holders[p]) for p in np.flatnonzero(holders)}
    free = engine.allocator.free
    assert len(free) == len(set(free)) and set(free) == set(range(len(holders))) - set(held)


def check_families(engine: Engine) -> None:
    """Each running child follows its family in ``running`` and holds the parent's whole
    prompt pages on the same ids, and its own copy of a partial last page."""
    for r in engine.running:
        root = r.parent or r
        if root.n == 1 or root.unforked:
            continue
        members = [s for s in root.samples if s in engine.running]
        at = engine.running.index(members[0])
        assert engine.running[at : at + len(members)] == members
        whole = len(root.prompt) // PAGE
        assert r.pages[:whole] == root.pages[:whole]
        if r is not root and len(root.prompt) % PAGE:
            assert r.pages[whole] != root.pages[whole]


def run(
    requests: list[Request],
    *,
    cascade: str = "on",
    max_running: int = 9,
    num_pages: int = NUM_PAGES,
    eos_token_id: int | None = None,
) -> tuple[Engine, list[StepOutput]]:
    """Run ``requests`` to the end (llama, page size 4, 16 tokens a step), checking the
    pages, the families and, on every step planned with a sharing, that the step's table
    keeps its promise (``fp.check_shared_pages``). Each step's ``table`` is a snapshot
    (the engine refreshes its own in place)."""
    adapter = adapter_for(models()[0])
    assert isinstance(adapter, DecoderOnly)
    engine = Engine(
        adapter, fp.ReferenceExecutor(), page_size=PAGE, num_pages=num_pages,
        max_running=max_running, token_budget=16, keep_all_logits=True, cascade=cascade,
        eos_token_id=eos_token_id,
    )  # fmt: skip
    steps = []
    for out in engine.run(requests):
        if out.shared_prefix is not None:
            assert out.table is not None
            fp.check_shared_pages(out.shared_prefix, out.table.pages, out.table.rows, PAGE)
        check_families(engine)
        check_pages(engine)
        if out.table is not None:  # the engine's live table: keep this step's ids
            out.table = fp.PageTable(out.table.pages.clone(), rows=out.table.rows)
        steps.append(out)
    assert not engine.running and sorted(engine.allocator.free) == list(range(num_pages))
    assert not engine.allocator.holders.any()
    return engine, steps


def outputs(requests: list[Request]) -> list[list[int]]:
    return [s.output for r in requests for s in r.samples]


def seed_of(r: Request) -> int:
    assert r.seed is not None
    return r.seed


def test_samples_do_not_depend_on_cascade() -> None:
    """n = 3 and 2 at temperature 0.8, fixed seeds: the same tokens with and without
    cascade levels, the levels really planned with "on", and every logits row of every
    sample equal to HF's forward of that sample alone."""
    on, off = families(0.8), families(0.8)
    engine_on, steps = run(on, cascade="on")
    engine_off, _ = run(off, cascade="off")
    assert outputs(on) == outputs(off)
    assert engine_on.cascade_steps > 0 and engine_off.cascade_steps == 0
    assert [len(r.samples) for r in on] == [3, 1, 2, 3]
    for r in on:  # the samples drew differently: each has its own generator and seed
        assert len({tuple(s.output) for s in r.samples}) == r.n
        assert [s.seed for s in r.samples] == [seed_of(r) + k for k in range(r.n)]
    parity = check_parity(models()[1], [s for r in on for s in r.samples], steps, first_tokens=0)
    assert parity.max_abs_diff <= ATOL, parity.line()
    # The levels covered what they should: each group is the decoding samples of one
    # family, sharing its prompt; every family was a group.
    prompts = set()
    for out in steps:
        if out.spec.cascade is None:
            continue
        assert out.shared_prefix is not None
        (level,) = out.shared_prefix.levels
        groups = zip(
            level.first.tolist(), level.count.tolist(), level.shared_len.tolist(), strict=True
        )
        for first, count, shared_len in groups:
            members = [r for r, _ in out.batch[first : first + count]]
            root = members[0].parent or members[0]
            assert all(m in root.samples and m.num_cached >= shared_len for m in members)
            assert shared_len == len(root.prompt)
            prompts.add(int(shared_len))
    assert prompts == {10, 13, 8}


def test_each_sample_draws_as_a_lone_request_with_its_seed() -> None:
    """Sample k of a request with seed s draws what a request with n = 1 and seed s + k
    draws: the families' tokens equal those of each prompt submitted n times."""
    fam = families(0.8)
    run(fam, cascade="on")
    lone = [
        Request(r.prompt, r.max_new_tokens, temperature=0.8, seed=seed_of(r) + k)
        for r in families(0.8)
        for k in range(r.n)
    ]
    run(lone, cascade="off")
    assert outputs(fam) == [r.output for r in lone]


def test_pages_are_shared_counted_and_given_back() -> None:
    """A family takes its prompt's whole pages once: the pages handed out are each
    family's row once plus, per child, the row but the shared pages (run's checks: holders
    equal the rows holding each page, every page free exactly once at the end). Samples
    of one new token finish in the step that forks them."""
    fam = [*families(0.8), Request(prompt(10, 5), 1, n=3, temperature=0.8, seed=400)]
    engine, _ = run(fam)
    lone = [Request(r.prompt, r.max_new_tokens) for r in fam for _ in range(r.n)]
    engine_lone, _ = run(lone)

    def row_pages(r: Request) -> int:  # the last token is sampled, never fed
        return -(-(len(r.prompt) + r.max_new_tokens - 1) // PAGE)

    want = sum(row_pages(r) + (r.n - 1) * (row_pages(r) - len(r.prompt) // PAGE) for r in fam)
    assert engine.allocator.handed_out == want
    assert engine_lone.allocator.handed_out == sum(r.n * row_pages(r) for r in fam) > want
    assert [len(s.output) for s in fam[-1].samples] == [1, 1, 1]


def test_parent_finishing_first_leaves_the_shared_pages_to_its_samples() -> None:
    """A parent that draws the end-of-sequence token as its first token finishes in the
    step that forks its samples; they keep its prompt pages (run's checks: holders, the
    promise), decode on, and their logits still match HF's."""
    first = [Request(prompt(10, 1), 6, n=3, temperature=0.8, seed=100)]
    run(first)
    eos = first[0].output[0]
    again = [Request(prompt(10, 1), 6, n=3, temperature=0.8, seed=100)]
    engine, steps = run(again, eos_token_id=eos)
    assert again[0].output == [eos]
    for s, want in zip(again[0].children, first[0].children, strict=True):
        cut = want.output.index(eos) + 1 if eos in want.output else len(want.output)
        assert s.output == want.output[:cut] and len(s.output) > 1
    assert engine.cascade_steps > 0
    parity = check_parity(models()[1], again[0].samples, steps, first_tokens=0)
    assert parity.max_abs_diff <= ATOL, parity.line()


def test_admission_reserves_every_sample() -> None:
    """Rows and pages for all n samples are reserved when a request is admitted: with
    exactly the family's worst case of pages (a row of 4 pages, and 2 samples x 2 own
    pages), or of rows, the next request waits until the family is done instead of
    taking what the fork needs."""

    def joins_after(first: Request, second: Request, steps: list[StepOutput]) -> bool:
        joined = next(i for i, out in enumerate(steps) if any(r is second for r, _ in out.batch))
        done = max(i for i, o in enumerate(steps) if any(r in o.finished for r in first.samples))
        return joined > done

    first = Request(prompt(10, 1), 6, n=3, temperature=0.8, seed=100)
    second = Request(prompt(10, 2), 6)
    assert first.pages_to_come(PAGE) == 8  # 4 + 2 samples x (4 - 2 shared)
    engine, steps = run([first, second], num_pages=8)
    assert joins_after(first, second, steps)
    first, second = Request(prompt(10, 1), 6, n=3), Request(prompt(10, 2), 6, n=2)
    _, steps = run([first, second], max_running=4)  # rows: 3 + 2 > 4
    assert joins_after(first, second, steps)
    with pytest.raises(ValueError, match="n must be"):
        engine.add(Request([1, 2], 2, n=10))
    with pytest.raises(ValueError, match="temperature"):
        engine.add(Request([1, 2], 2, temperature=-1.0))


def test_greedy_samples_equal_the_single_output() -> None:
    """Temperature 0: both samples of n = 2 are the greedy output of n = 1."""
    pair = [Request(prompt(10, 1), 6, n=2), Request(prompt(13, 3), 5, n=2)]
    single = [Request(prompt(10, 1), 6), Request(prompt(13, 3), 5)]
    run(pair)
    run(single)
    for p, s in zip(pair, single, strict=True):
        assert [c.output for c in p.samples] == [s.output, s.output]


def test_step_sharing_and_a_broken_promise() -> None:
    """The sharing a decode step is planned with: one group per family, its members'
    batch rows, the prompt's length; its table keeps the promise, and a table where a
    sample's shared page is another id breaks it (``PageTableError``)."""
    reqs = [Request(prompt(10, 1), 4, n=3, temperature=0.8, seed=1), Request(prompt(9, 2), 4)]
    _, steps = run(reqs)
    out = next(o for o in steps if o.spec.cascade is not None and o.layout.mode is fp.Mode.DECODE)
    assert out.shared_prefix is not None and out.table is not None
    (level,) = out.shared_prefix.levels
    batch = [r for r, _ in out.batch]
    assert batch[:3] == reqs[0].samples
    assert (level.first.tolist(), level.count.tolist(), level.shared_len.tolist()) == (
        [0], [3], [10],
    )  # fmt: skip
    cascade = out.spec.cascade
    assert cascade is not None and cascade.levels.levels[0].row_of.tolist() == [0]
    broken = out.table.pages.clone()
    broken[out.table.rows[2], 1] = broken[out.table.rows[2], 2]  # sample 2's 2nd page
    with pytest.raises(fp.PageTableError, match="same page ids"):
        fp.check_shared_pages(out.shared_prefix, broken, out.table.rows, PAGE)


def test_partial_page_copy_is_needed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: without the copy of the prompt's partial last page, the
    children's logits are wrong (they read a page no one wrote)."""
    ref = models()[1]
    reqs = [Request(prompt(10, 1), 4, n=2)]
    monkeypatch.setattr(fp, "copy_prefix_pages", lambda *args, **kwargs: 0)
    _, steps = run(reqs)
    parity = check_parity(ref, reqs[0].samples, steps, first_tokens=0)
    assert parity.max_abs_diff > 100 * ATOL, parity.line()


def test_encoder_decoder_refuses_samples() -> None:
    adapter = adapter_for(load_model("bart"))
    assert isinstance(adapter, EncoderDecoder)
    engine = Engine(adapter, fp.ReferenceExecutor(), num_pages=8)
    with pytest.raises(ValueError, match="decoder-only"):
        engine.add(Request([2, 5], 2, encoder_prompt=[5, 6], n=2))
