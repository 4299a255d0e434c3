"""`ComparingExecutor`: an executor that runs every call on two executors and records
how far apart they are — for checking an engine's step loop against an oracle.

Hand it to an engine in place of its executor::

    tee = ComparingExecutor(FlashInferExecutor("cuda"))   # oracle: ReferenceExecutor
    engine = Engine(adapter, tee, ...)
    ...  # run the engine's steps
    assert tee.worst().out_err <= 1e-2, tee.summary()

The engine sees the executor under test (its outputs and positions go on through the
model, as they would without the tee). The oracle gets a fresh instance per ``apply``,
the same plan, table and inputs, and its own shadow copy of every KV cache (made the
first time the cache is seen), so a wrong write of the executor under test shows up as
a cache that differs from its shadow instead of being copied into the oracle's input.
Every comparison reads back from the device: a test tool, not for a hot path.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import attrs
import torch

from flashplan.executor.protocol import Executor
from flashplan.executor.reference import ReferenceExecutor
from flashplan.layout.group import AttentionGroup
from flashplan.layout.page_table import PageTable
from flashplan.planning.spec import PlanSpec

__all__ = ["AttentionDiff", "CallRecord", "ComparingExecutor", "attention_diff", "out_error"]


class AttentionDiff(NamedTuple):
    """How one attention result differs from the oracle's (:func:`attention_diff`).

    Attributes:
        out_err: ``max |out - ref| / max |ref|`` (``inf`` where not finite).
        lse_err: ``max |lse - ref|`` where the oracle's LSE is finite (log2 units).
        blind_ok: the same queries see no key (LSE ``-inf``) on both, and those output 0.
    """

    out_err: float
    lse_err: float
    blind_ok: bool


def out_error(out: torch.Tensor, want: torch.Tensor) -> float:
    """``max |out - want| / max |want|`` over ``[rows, heads, head_dim]`` (0 when empty,
    ``inf`` when not finite; reads back: a sync)."""
    if not out.numel():
        return 0.0
    diff = (out.double() - want.double()).abs().max()
    scale = want.double().abs().max().clamp_min(1e-6)
    return float(diff / scale) if bool(torch.isfinite(diff)) else math.inf


def attention_diff(
    out: torch.Tensor, lse: torch.Tensor, want: torch.Tensor, want_lse: torch.Tensor
) -> AttentionDiff:
    """Compare ``out`` ``[rows, heads, head_dim]`` and float32 base-2 ``lse``
    ``[rows, heads]`` with the oracle's ``want`` and ``want_lse`` (reads back: a sync)."""
    out_err = out_error(out, want)
    finite = torch.isfinite(want_lse)
    blind_ok = torch.equal(torch.isfinite(lse), finite)
    lse_err = 0.0
    if blind_ok and bool(finite.any()):
        lse_err = float((lse[finite] - want_lse[finite]).abs().max())
    blind = ~finite.any(dim=1) if finite.dim() == 2 else ~finite
    if bool(out[blind].any()):
        blind_ok = False
    return AttentionDiff(out_err, lse_err, blind_ok)


@attrs.frozen
class CallRecord:
    """One ``run`` compared.

    Attributes:
        step: how many applies came before it (0-based index of its batch).
        group: the group it ran.
        out_err: ``max |out - ref| / max |ref|``.
        lse_err: ``max |lse - ref|`` where the oracle's LSE is finite (log2 units).
        blind_ok: the same queries see no key on both, and those output 0.
        cache_ok: the KV cache equals its shadow bit for bit after the call.
    """

    step: int
    group: AttentionGroup
    out_err: float
    lse_err: float
    blind_ok: bool
    cache_ok: bool


class ComparingExecutor:
    """Runs everything on ``primary`` and on a fresh ``oracle()`` (see module doc).

    Args:
        primary: the executor under test (its results are returned).
        oracle: makes the executor compared with, once per ``apply``
            (default :class:`~flashplan.ReferenceExecutor`).

    Attributes:
        records: every compared ``run``, in order.
    """

    def __init__(
        self, primary: Executor, oracle: Callable[[], Executor] = ReferenceExecutor
    ) -> None:
        self.primary = primary
        self._make_oracle = oracle
        self._oracle: Executor | None = None
        self._shadows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._step = -1
        self.records: list[CallRecord] = []

    @property
    def spec(self) -> PlanSpec | None:
        """The plan applied last (the primary's)."""
        return self.primary.spec

    def apply(self, spec: PlanSpec, table: PageTable) -> None:
        """Apply ``spec`` to the primary and to a fresh oracle."""
        self.primary.apply(spec, table)
        self._oracle = self._make_oracle()
        self._oracle.apply(spec, table)
        self._step += 1

    def positions(self) -> torch.Tensor:
        """The primary's positions (checked equal to the oracle's)."""
        got = self.primary.positions()
        assert self._oracle is not None, "positions() before apply()"
        want = self._oracle.positions()
        if not torch.equal(got.cpu(), want.cpu()):
            raise AssertionError(f"step {self._step}: positions() differs from the oracle's")
        return got

    def apply_steps(
        self, specs: tuple[PlanSpec, ...] | list[PlanSpec], table: PageTable
    ) -> tuple[Executor, ...]:
        """Not compared: the primary's views (a step loop of multi-step drafts is checked
        by :func:`flashplan.testing.checking.check_sequence`)."""
        return self.primary.apply_steps(specs, table)

    def _shadow(self, kv_cache: torch.Tensor | None) -> torch.Tensor | None:
        if kv_cache is None:
            return None
        held = self._shadows.get(id(kv_cache))
        if held is None or held[0] is not kv_cache:
            held = self._shadows[id(kv_cache)] = (kv_cache, kv_cache.clone())
        return held[1]

    def run(
        self,
        group: AttentionGroup,
        q: torch.Tensor,
        k_new: torch.Tensor | None,
        v_new: torch.Tensor | None,
        kv_cache: torch.Tensor | None,
        *,
        return_lse: bool = False,
        sinks: torch.Tensor | None = None,
        k_scale: float | torch.Tensor | None = None,
        v_scale: float | torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Run on both, record the comparison, return the primary's result (``out``, or
        ``(out, lse)`` with ``return_lse``: the protocol's overloads are not restated in
        this test helper). ``sinks``, ``k_scale``, ``v_scale``: given to both."""
        assert self._oracle is not None, "run() before apply()"
        shadow = self._shadow(kv_cache)
        # scales only where given: an executor written before fp8 caches takes none
        scales = {n: s for n, s in (("k_scale", k_scale), ("v_scale", v_scale)) if s is not None}
        want, want_lse = self._oracle.run(
            group, q, k_new, v_new, shadow, return_lse=True, sinks=sinks, **scales
        )
        out, lse = self.primary.run(
            group, q, k_new, v_new, kv_cache, return_lse=True, sinks=sinks, **scales
        )
        diff = attention_diff(out, lse, want, want_lse)
        cache_ok = kv_cache is None or (shadow is not None and torch.equal(kv_cache, shadow))
        self.records.append(CallRecord(self._step, group, *diff, cache_ok))
        return (out, lse) if return_lse else out

    def bad(self, out_tol: float = 1e-2, lse_tol: float = 5e-2) -> list[CallRecord]:
        """The records outside the tolerances or failing an exact check."""
        return [
            r
            for r in self.records
            if r.out_err > out_tol or r.lse_err > lse_tol or not (r.blind_ok and r.cache_ok)
        ]

    def summary(self, out_tol: float = 1e-2, lse_tol: float = 5e-2) -> str:
        """Steps and calls compared, the worst errors and the first bad calls."""
        bad = self.bad(out_tol, lse_tol)
        worst_out = max((r.out_err for r in self.records), default=0.0)
        worst_lse = max((r.lse_err for r in self.records), default=0.0)
        lines = [
            f"{self._step + 1} steps, {len(self.records)} calls compared, {len(bad)} bad; "
            f"worst out err {worst_out:.3g}, lse err {worst_lse:.3g}"
        ]
        lines += [f"  {r}" for r in bad[:10]]
        return "\n".join(lines)
