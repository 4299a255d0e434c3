"""Timing helpers the GPU benchmark scripts share (imported as ``_timing`` by the
scripts in this folder, which Python puts first on ``sys.path`` when it runs one)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
import triton


def pinned(values: object) -> torch.Tensor:
    """``values`` (integers) as a pinned int32 host tensor of their shape (a copy): the
    ready host inputs a bare ``plan()`` is timed with."""
    array = np.asarray(values)
    out = torch.empty(array.shape, dtype=torch.int32, pin_memory=True)
    out.numpy()[...] = array
    return out


def idle_call_us(fn: Callable[[], object]) -> float:
    """Host time (µs) of one call of ``fn`` issued on an idle GPU (synchronized first)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6


def host_us(fn: Callable[[], object], n: int = 30, warmup: int = 5) -> float:
    """Median host time of ``fn`` alone (µs), the GPU synchronized before each call."""
    for _ in range(warmup):
        fn()
    times = [idle_call_us(fn) for _ in range(n)]
    torch.cuda.synchronize()
    return statistics.median(times)


def alternating_us(
    a: Callable[[], object], b: Callable[[], object], n: int = 200, warmup: int = 5
) -> tuple[list[float], list[float]]:
    """Host times (µs) of ``a`` and ``b`` timed call by call in the order a b b a a b …
    (the GPU synchronized before each call): each job follows the other as often as it
    follows itself, so drift of a noisy host and the state one job leaves behind (CPU
    caches) reach both alike. Returns both lists of ``n`` times (:func:`interleaved_us`
    of the two jobs)."""
    times = interleaved_us({"a": a, "b": b}, n=n, warmup=warmup)
    return times["a"], times["b"]


def interleaved_us(
    jobs: dict[str, Callable[[], object]], n: int = 200, warmup: int = 10
) -> dict[str, list[float]]:
    """Host times (µs) of every job, timed round by round: each round calls every job
    once (the GPU synchronized before each call), the order rotated from one round to
    the next. A noisy host's drift (its clock, other tenants) then reaches every job
    alike, and round ``i``'s times of two jobs are a pair measured within microseconds
    of each other (:func:`paired_ratio`). Returns ``n`` times per job, in round order."""
    for _ in range(warmup):
        for fn in jobs.values():
            fn()
    names = list(jobs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(n):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            times[name].append(idle_call_us(jobs[name]))
    torch.cuda.synchronize()
    return times


def paired_ratio(a: list[float], b: list[float]) -> float:
    """Median of ``a[i] / b[i]`` over the rounds of :func:`interleaved_us`."""
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def cold_us(
    jobs: dict[str, Callable[[], object]], n: int = 60, flush_mb: int = 64, warmup: int = 3
) -> dict[str, list[float]]:
    """Host times (µs) of each job with cold CPU caches, the jobs taken in turn: before
    each call ``flush_mb`` MB of host memory are rewritten (evicting the job's code and
    data from the CPU caches, as the forward pass an engine runs between two plans
    does) and the GPU is synchronized. Returns ``n`` times per job."""
    flush = np.zeros(flush_mb << 18, dtype=np.int32)
    for _ in range(warmup):
        for fn in jobs.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in jobs}
    for _ in range(n):
        for name, fn in jobs.items():
            flush += 1
            times[name].append(idle_call_us(fn))
    torch.cuda.synchronize()
    return times


def synced_us(fn: Callable[[], object], n: int = 30, warmup: int = 5) -> float:
    """Median wall time of ``fn`` from an idle GPU until the GPU is done (µs)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def kernel_ms(fn: Callable[[], object], rep: int = 100, warmup: int = 25) -> float:
    """Median kernel time of ``fn`` (ms): ``triton.testing.do_bench`` (CUDA events, L2
    flushed)."""
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def sleep_cycles(ms: float) -> int:
    """Cycles of ``torch.cuda._sleep`` that keep the GPU busy for about ``ms``."""
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    torch.cuda._sleep(10_000_000)
    e1.record()
    torch.cuda.synchronize()
    return int(10_000_000 / e0.elapsed_time(e1) * ms)


def blocked_us(fn: Callable[[], object], cycles: int, n: int = 5) -> float:
    """Median host time of ``fn`` issued right after a ``cycles``-long kernel."""
    fn()
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)
