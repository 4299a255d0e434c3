"""One executor over many varied batches, as an engine keeps it (CPU side of issue #23).

* One :class:`~flashplan.ReferenceExecutor` over a long random sequence (every mode,
  page size, path, group kind; heads that vary) gives bit for bit what a fresh one gives
  for each batch.
* One :class:`~flashplan.executor.flashinfer.FlashInferExecutor` over the CPU twin of
  FlashInfer (:mod:`flashplan.twin`) over such a sequence equals a fresh reference
  executor for each batch, and a call skeleton (the one thing kept per key besides
  buffers and wrappers) is a function of its key. The GPU test
  ``tests/gpu/test_long_lived.py`` runs the same on real FlashInfer.
"""

from __future__ import annotations

from collections import defaultdict

import torch

import flashplan as fp
from flashplan.executor.flashinfer import FlashInferExecutor
from flashplan.executor.flashinfer.calls import call_skeleton, skeleton_key
from flashplan.executor.flashinfer.policy import ExecutorPolicy
from flashplan.testing.checking import check_sequence
from flashplan.testing.sequences import (
    SEQUENCE_MODES,
    SEQUENCE_PAGE_SIZES,
    VARIED_HEADS,
    batch_sequence,
)
from flashplan.twin import flashinfer_twin

SEED = 20261204
CPU = {"dtype": torch.float32, "scale": 0.25}
POLICIES = (ExecutorPolicy(), ExecutorPolicy(prefill_backend="fa2"))


def test_reference_executor_long_lived_equals_fresh() -> None:
    report = check_sequence(
        fp.ReferenceExecutor(), batch_sequence(SEED, 150, **CPU), out_tol=0.0, lse_tol=0.0
    )
    assert not report.wrong, report.summary()
    assert len(report.checks) == 150


def test_call_skeleton_is_a_function_of_its_key() -> None:
    """Every spec of a skeleton key gets the skeleton an executor cached for the key."""
    seen: dict[object, tuple[object, str]] = {}
    keys = defaultdict(int)
    for batch in batch_sequence(SEED, 400, **CPU):
        for spec in batch.specs:
            for policy in POLICIES:
                key = (policy, skeleton_key(spec, policy))
                calls = call_skeleton(spec, policy, sm90=True)
                held = seen.setdefault(key, (calls, batch.label))
                assert held[0] == calls, f"{batch.label}\nshares its key with {held[1]}"
                keys[key] += 1
    assert sum(1 for n in keys.values() if n > 1) > 20  # keys really are shared


def test_flashinfer_executor_long_lived_on_the_twin() -> None:
    """One FlashInfer executor over the CPU twin of FlashInfer (every wrapper kind, pool,
    buffers that grow and shrink back, skeletons kept per key) across 120 varied
    batches — every mode, page size, path and group kind, heads that vary — each equal
    to a fresh reference executor's within float32 rounding.

    120 batches, not more: in the CPU suite the executor's Triton kernels run under
    Triton's interpreter (``tests/kernels/conftest.py``), about 0.3 s a batch; the GPU test
    ``tests/gpu/test_long_lived.py`` runs the long sequences on real FlashInfer."""
    ex = FlashInferExecutor(flashinfer=flashinfer_twin)
    report = check_sequence(ex, batch_sequence(SEED + 1, 120, **CPU), out_tol=1e-4, lse_tol=1e-4)
    assert not report.wrong, report.summary()
    assert len(report.checks) == 120
    # the sequence really varies: every mode, page size and extend path, heads that vary
    labels = [c.label for c in report.checks]
    assert {label.split()[1] for label in labels} == set(SEQUENCE_MODES)
    assert {f"page={p}" for p in SEQUENCE_PAGE_SIZES} <= {w for s in labels for w in s.split()}
    assert {f"path={p}" for p in ("auto", "paged", "ragged")} <= {s.split()[-1] for s in labels}
    assert len({s.split(" heads=")[1].split()[0] for s in labels}) == len(VARIED_HEADS)


class _DriftsAfter(fp.ReferenceExecutor):
    """A reference executor that goes wrong after ``n`` applies (state carried from one
    batch to the next), by output or by a stray cache write: what the checks must catch."""

    def __init__(self, n: int, *, cache: bool = False) -> None:
        super().__init__()
        self.n, self.cache, self.applied = n, cache, 0

    def apply(self, spec: fp.PlanSpec, table: fp.PageTable) -> None:
        super().apply(spec, table)
        self.applied += 1

    def run(self, group, q, k_new, v_new, kv_cache, *, return_lse=False, sinks=None):  # type: ignore[no-untyped-def]
        out, lse = super().run(group, q, k_new, v_new, kv_cache, return_lse=True, sinks=sinks)
        if self.applied > self.n:
            if self.cache and kv_cache is not None:
                kv_cache[-1].add_(1.0)  # a write to a page nobody's plan names
            else:
                out = out + 0.1 * out.abs().max()
        return (out, lse) if return_lse else out


ONE_APPLY = tuple(m for m in SEQUENCE_MODES if m != "draft_decode")  # _DriftsAfter counts apply()


def test_checks_catch_an_executor_that_goes_wrong_later() -> None:
    report = check_sequence(_DriftsAfter(5), batch_sequence(SEED, 12, **CPU, modes=ONE_APPLY))
    assert [c.index for _, c in report.wrong] == list(range(5, 12))
    assert "after batch 4:" in report.summary()
    batches = batch_sequence(SEED, 6, **CPU, modes=ONE_APPLY)
    stray = check_sequence(_DriftsAfter(3, cache=True), batches)
    assert [c.index for _, c in stray.wrong] == [3, 4, 5]
    assert not any(c.cache_ok for _, c in stray.wrong)


def test_comparing_executor_catches_a_wrong_primary() -> None:
    from flashplan.testing.compare import ComparingExecutor

    for cache in (False, True):
        tee = ComparingExecutor(_DriftsAfter(1, cache=cache))
        for batch in batch_sequence(SEED, 3, **CPU, modes=("extend", "decode")):
            spec = batch.specs[0]
            tee.apply(spec, batch.table)
            hkv, d = batch.heads.num_kv_heads, batch.heads.head_dim
            kv = torch.randn(batch.num_pages, 2, spec.page_size, hkv, d)
            for group in batch.groups:
                rows = spec.total_encoder if group.cross_attention else spec.total_q
                q = torch.randn(spec.total_q, batch.heads.num_qo_heads, d)
                k = torch.randn(rows, hkv, d)
                sinks = torch.randn(batch.heads.num_qo_heads) if group.sinks else None
                tee.run(group, q, k, k, kv, sinks=sinks)
        bad = tee.bad()
        assert bad and {r.step for r in bad} <= {1, 2}, tee.summary()
        assert all(not r.cache_ok for r in bad) if cache else all(r.out_err > 0.05 for r in bad)
