"""One executor over many varied batches, as an engine keeps it (CPU side of issue #23).

* One :class:`~flashplan.ReferenceExecutor` over a long random sequence (every mode,
  page size, path, group kind; heads that vary) gives bit for bit what a fresh one gives
  for each batch.
* The FlashInfer executor's host-side caches, run on CPU tensors over the same kind of
  sequence: a call skeleton is a function of its key, and a ``plan()`` call's bound
  arguments and a staged mask found in a layout's memo equal freshly made ones. These
  are the caches whose key missed the call (the bug); the GPU test
  ``tests/gpu/test_long_lived.py`` runs the whole executor.
"""

from __future__ import annotations

from collections import defaultdict

import torch

import flashplan as fp
from flashplan.executor.flashinfer.buffers import DeviceBuffer, SliceViews, StagedViews
from flashplan.executor.flashinfer.calls import call_inputs, call_skeleton, skeleton_key
from flashplan.executor.flashinfer.device_work import staged_mask
from flashplan.executor.flashinfer.policy import ExecutorPolicy
from flashplan.executor.flashinfer.staging import DevicePlan, device_plan
from flashplan.executor.flashinfer.wrapper_plans import bound_call
from flashplan.executor.gathers import gather_jobs
from flashplan.testing.checking import check_sequence
from flashplan.testing.sequences import SEQUENCE_MODES, Batch, batch_sequence

SEED = 20261204
CPU = {"dtype": torch.float32, "scale": 0.25}
POLICIES = (ExecutorPolicy(), ExecutorPolicy(prefill_backend="fa2"))


def test_reference_executor_long_lived_equals_fresh() -> None:
    report = check_sequence(
        fp.ReferenceExecutor(), batch_sequence(SEED, 150, **CPU), out_tol=0.0, lse_tol=0.0
    )
    assert not report.wrong, report.summary()
    assert len(report.checks) == 150


def _device_plan(batch: Batch, policy: ExecutorPolicy) -> DevicePlan:
    spec = batch.specs[0]
    calls = call_skeleton(spec, policy, sm90=True)
    inputs = call_inputs(spec, calls)
    jobs = gather_jobs(spec, batch.table.rows, window_pool=False, spans=inputs.spans)
    dplan = device_plan(calls, jobs, inputs.host, inputs.masks, ints=inputs.ints,
                        elements=inputs.elements)  # fmt: skip
    return dplan


def _same(a: object, b: object) -> bool:
    """Arguments equal: tensors by storage, offset, shape and dtype; the rest by ==."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return (a.data_ptr(), a.shape, a.dtype) == (b.data_ptr(), b.shape, b.dtype)
    return type(a) is type(b) and a == b


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


def test_bound_calls_and_masks_from_the_memo_equal_fresh_ones() -> None:
    """The executor's per-layout memo over a long sequence: the bound ``plan()``
    arguments and the staged masks it hands out equal ones made afresh. Staged into
    one persistent host and one 'device' tensor, as the executor does; batches of
    equal array sizes but other groups or heads share a layout (the bug's trigger)."""
    host_buf = DeviceBuffer(torch.device("cpu"), torch.int32)
    dev_buf = DeviceBuffer(torch.device("cpu"), torch.int32)
    mask_out: dict[int, torch.Tensor] = {}
    views = SliceViews()
    layouts_seen: dict[object, set[object]] = defaultdict(set)
    for batch in batch_sequence(SEED + 1, 400, **CPU, max_batch=3):
        if batch.steps:
            continue
        for policy in POLICIES:
            dplan = _device_plan(batch, policy)
            total = dplan.manifest.total
            host = views.of(host_buf.reserve(total), dplan.manifest)
            staged = views.of(dev_buf.reserve(total), dplan.manifest)
            layouts_seen[dplan.manifest].add(dplan.calls)
            for gc in dplan.calls:
                for part, call in (("paged", gc.paged), ("ragged", gc.ragged)):
                    if call is None:
                        continue
                    got = bound_call(call, host, staged, "", gc.group_index, part)
                    fresh_host = StagedViews(host.tensor, dplan.manifest)
                    fresh_dev = StagedViews(staged.tensor, dplan.manifest)
                    want = bound_call(call, fresh_host, fresh_dev, "", gc.group_index, part)
                    assert got.kwargs.keys() == want.kwargs.keys(), batch.label
                    for name, value in got.kwargs.items():
                        assert _same(value, want.kwargs[name]), (batch.label, name)
                    assert got.dynamic == want.dynamic, batch.label
                    assert got.prefill_ints == want.prefill_ints, batch.label
            for index, recipe in dplan.masks.items():
                out = mask_out.setdefault(index, torch.zeros(1 << 20, dtype=torch.uint8))
                got_mask = staged_mask(dplan, staged, index, recipe, out)
                fresh_dev = StagedViews(staged.tensor, dplan.manifest)
                want_mask = staged_mask(dplan, fresh_dev, index, recipe, out)
                assert got_mask[1:-1] == want_mask[1:-1], batch.label  # every int field
    shared_layouts = sum(1 for calls in layouts_seen.values() if len(calls) > 1)
    assert shared_layouts > 5  # layouts that several different call sets share


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
