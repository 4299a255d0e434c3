"""Checking one long-lived executor, batch by batch, against a fresh oracle.

An engine keeps one executor and feeds it batch after batch; whatever the executor keeps
from one ``apply`` to the next must not leak into a later batch. :func:`check_sequence`
runs a sequence of batches (:func:`~flashplan.testing.sequences.batch_sequence`) through
the one executor under test and compares every batch with a fresh oracle (by default a
new :class:`~flashplan.ReferenceExecutor` per batch): outputs, LSEs, blind queries, KV
caches and ``positions()``. A wrong batch is reported with the batch before it::

    from flashplan.testing.checking import check_sequence
    from flashplan.testing.sequences import batch_sequence

    report = check_sequence(my_executor, batch_sequence(seed=0, count=500, device="cuda"))
    assert not report.wrong, report.summary()

:func:`check_batch` checks one batch. Needs no Hypothesis.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import attrs
import torch

from flashplan.executor.protocol import Executor
from flashplan.executor.reference import ReferenceExecutor
from flashplan.layout.group import AttentionGroup
from flashplan.testing.compare import attention_diff
from flashplan.testing.sequences import Batch

__all__ = [
    "BatchCheck",
    "BatchInputs",
    "SequenceReport",
    "apply_batch",
    "batch_inputs",
    "check_batch",
    "check_sequence",
]


@attrs.frozen
class BatchCheck:
    """How one batch on the executor under test compared with the oracle.

    Attributes:
        index, label: the batch (:attr:`Batch.index`, :attr:`Batch.label`).
        out_err: the largest ``max |out - ref| / max |ref|`` over its groups (and steps).
        lse_err: the largest ``|lse - ref|`` where the oracle's LSE is finite (log2 units).
        blind_ok: the same queries see no key (LSE ``-inf``) on both, and output 0.
        cache_ok: every KV cache is bit for bit the oracle's after the batch.
        positions_ok: ``positions()`` equals the oracle's.
    """

    index: int
    label: str
    out_err: float
    lse_err: float
    blind_ok: bool
    cache_ok: bool
    positions_ok: bool

    def ok(self, out_tol: float, lse_tol: float) -> bool:
        """Within the tolerances, and every exact check holds."""
        return (
            self.out_err <= out_tol
            and self.lse_err <= lse_tol
            and self.blind_ok
            and self.cache_ok
            and self.positions_ok
        )


#: One run of a batch's inputs: ``(group, q, k_new, v_new, sinks)`` (:class:`BatchInputs`).
Call = tuple[AttentionGroup, torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"]


@attrs.frozen(eq=False)
class BatchInputs:
    """A batch's random inputs, drawn from its seed (:func:`batch_inputs`).

    Attributes:
        caches: one KV cache per group, ``[num_pages, 2, page_size, num_kv_heads,
            head_dim]`` in the KV dtype, on the table's device.
        calls: per step (one for a batch that is not a multi-step draft), per group,
            ``(group, q, k_new, v_new, sinks)``: ``q`` ``[total_q, num_qo_heads,
            head_dim]``, ``k_new`` / ``v_new`` ``[rows, num_kv_heads, head_dim]``
            (encoder rows for a cross group), ``sinks`` float32 ``[num_qo_heads]`` for a
            sink group, else ``None``.
    """

    caches: tuple[torch.Tensor, ...]
    calls: tuple[tuple[Call, ...], ...]


def batch_inputs(batch: Batch) -> BatchInputs:
    """Random caches and run inputs for ``batch``, the same for every call with it."""
    heads, device = batch.heads, batch.table.pages.device
    gen = torch.Generator(device=device).manual_seed(batch.seed)
    hq, hkv, d = heads.num_qo_heads, heads.num_kv_heads, heads.head_dim
    ps = batch.specs[0].page_size

    def rand(*shape: int, dtype: torch.dtype = heads.kv_dtype) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    caches = tuple(rand(max(batch.num_pages, 1), 2, ps, hkv, d) for _ in batch.groups)
    calls = []
    for spec in batch.specs:
        step = []
        for group in batch.groups:
            q = rand(spec.total_q, hq, d, dtype=heads.q_dtype)
            rows = spec.total_encoder if group.cross_attention else spec.total_q
            # sink logits around the scores' scale, so that they matter
            sinks = rand(hq, dtype=torch.float32) * 3 if group.sinks else None
            step.append((group, q, rand(rows, hkv, d), rand(rows, hkv, d), sinks))
        calls.append(tuple(step))
    return BatchInputs(caches, tuple(calls))


def apply_batch(executor: Executor, batch: Batch) -> Sequence[Executor]:
    """Apply ``batch`` to ``executor``: the executor of each step (``apply_steps``' views
    for a multi-step draft, else ``executor`` itself)."""
    if batch.steps:
        return executor.apply_steps(batch.specs, batch.table)
    executor.apply(batch.specs[0], batch.table)
    return (executor,)


def check_batch(executor: Executor, batch: Batch, oracle: Executor | None = None) -> BatchCheck:
    """Apply ``batch`` to ``executor`` and to ``oracle`` (a fresh
    :class:`~flashplan.ReferenceExecutor` when not given), run every group of every step
    on both with the same random inputs (:func:`batch_inputs`) and separate copies of the
    caches, and compare.

    Reads results back (a sync): a test helper, not for a hot path.
    """
    oracle = ReferenceExecutor() if oracle is None else oracle
    inputs = batch_inputs(batch)
    caches = inputs.caches
    oracle_caches = [c.clone() for c in caches]
    views, refs = apply_batch(executor, batch), apply_batch(oracle, batch)
    out_err = lse_err = 0.0
    blind_ok = positions_ok = True
    for calls, view, ref in zip(inputs.calls, views, refs, strict=True):
        positions_ok &= torch.equal(view.positions().cpu(), ref.positions().cpu())
        for (group, q, k, v, sinks), cache, oracle_cache in zip(
            calls, caches, oracle_caches, strict=True
        ):
            out, lse = view.run(group, q, k, v, cache, return_lse=True, sinks=sinks)
            want, want_lse = ref.run(group, q, k, v, oracle_cache, return_lse=True, sinks=sinks)
            diff = attention_diff(out, lse, want, want_lse)
            out_err, lse_err = max(out_err, diff.out_err), max(lse_err, diff.lse_err)
            blind_ok &= diff.blind_ok
    cache_ok = all(torch.equal(c, o) for c, o in zip(caches, oracle_caches, strict=True))
    return BatchCheck(batch.index, batch.label, out_err, lse_err, blind_ok, cache_ok,
                      positions_ok)  # fmt: skip


@attrs.frozen
class SequenceReport:
    """What :func:`check_sequence` found.

    Attributes:
        checks: every batch's :class:`BatchCheck`, in order.
        wrong: ``(previous label, check)`` of each batch outside the tolerances.
        out_tol, lse_tol: the tolerances used.
    """

    checks: tuple[BatchCheck, ...]
    wrong: tuple[tuple[str, BatchCheck], ...]
    out_tol: float
    lse_tol: float

    def summary(self, limit: int = 10) -> str:
        """How many batches were wrong, the worst errors, and the first ``limit`` wrong
        batches with the batch before each."""
        worst_out = max((c.out_err for c in self.checks), default=0.0)
        worst_lse = max((c.lse_err for c in self.checks), default=0.0)
        lines = [
            f"{len(self.wrong)} of {len(self.checks)} batches wrong (out tol {self.out_tol}, "
            f"lse tol {self.lse_tol}); worst out err {worst_out:.3g}, lse err {worst_lse:.3g}"
        ]
        for before, c in self.wrong[:limit]:
            lines.append(
                f"  batch {c.label}\n    out err {c.out_err:.3g}, lse err {c.lse_err:.3g}, "
                f"blind ok {c.blind_ok}, cache ok {c.cache_ok}, positions ok "
                f"{c.positions_ok}\n    after batch {before}"
            )
        return "\n".join(lines)


def check_sequence(
    executor: Executor,
    batches: Iterable[Batch],
    *,
    oracle: Callable[[], Executor] = ReferenceExecutor,
    out_tol: float = 1e-2,
    lse_tol: float = 5e-2,
    before: Callable[[Batch], None] | None = None,
) -> SequenceReport:
    """Run every batch through the one ``executor`` and compare each with a fresh
    ``oracle()`` (:func:`check_batch`).

    Args:
        executor: the long-lived executor under test.
        batches: the sequence (:func:`~flashplan.testing.sequences.batch_sequence`).
        oracle: makes the executor each batch is compared with (fresh per batch).
        out_tol, lse_tol: the tolerances (relative output error; LSE, log2 units).
        before: called with each batch before it runs (progress, sync checks).
    """
    checks: list[BatchCheck] = []
    wrong: list[tuple[str, BatchCheck]] = []
    previous = "(none: the first batch)"
    for batch in batches:
        if before is not None:
            before(batch)
        check = check_batch(executor, batch, oracle())
        checks.append(check)
        if not check.ok(out_tol, lse_tol):
            wrong.append((previous, check))
        previous = batch.label
    return SequenceReport(tuple(checks), tuple(wrong), out_tol, lse_tol)
