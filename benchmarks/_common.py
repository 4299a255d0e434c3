"""What every benchmark part shares (imported by ``run_gpu.py``'s parts; Python puts this
folder first on ``sys.path`` when it runs a script here).

* :data:`ENV`: the run's device, FlashInfer module (the real one on CUDA, or the CPU twin
  ``flashplan.twin.flashinfer_twin`` for a smoke run) and sizes (full, or ``quick``);
  :func:`executor` makes a ``FlashInferExecutor`` through the API that the old and the
  new executor both have (``FlashInferExecutor(device, policy=...)``; the twin only with
  the new one).
* Timing: host time by ``time.perf_counter`` (the GPU synchronized before each call,
  median after warm-up), jobs taken round by round (:func:`rounds_us`, optionally with
  cold CPU caches), GPU time by CUDA events (:func:`kernel_ms`: ``triton.testing.do_bench``,
  L2 flushed, median after warm-up), synced step wall time (:func:`step_us`).
* :class:`Report`: the measurements of one run, as flat rows ``(part, case, metric,
  value, unit)`` that ``run_gpu.py --compare-tree`` joins between two trees, plus the
  markdown each part writes.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

# -- the run's settings ------------------------------------------------------------------
HQ, HKV, D, PAGE = 32, 8, 128, 16
DT = torch.bfloat16


@dataclass
class Sizes:
    """Batch sizes and repetitions of the parts (``quick``: a CPU smoke run)."""

    kv: int = 4096  # decode KV length (tokens)
    loop: int = 256  # a decode loop's growth: fresh lengths drawn from kv + [0, loop)
    host_batches: tuple[int, ...] = (1, 64, 256, 1024)
    host_rounds: int = 40  # cold rounds (64 MB flushed before each call)
    hot_rounds: int = 100
    graph_batches: tuple[int, ...] = (1, 8, 64, 256)
    layers: int = 32
    steps: int = 50
    verify: tuple[int, int, int] = (64, 64, 4096)  # requests, draft tokens, prefix
    multi_item: tuple[int, int, int, int] = (256, 512, 32, 8)  # bs, prompt, items, item len
    multi_item_rounds: int = 15
    kernel_batches: tuple[int, ...] = (1, 64, 256)
    flush_mb: int = 64


QUICK = Sizes(
    kv=256,
    loop=32,
    host_batches=(1, 8),
    host_rounds=4,
    hot_rounds=5,
    graph_batches=(1, 2),
    layers=1,
    steps=3,
    verify=(4, 8, 256),
    multi_item=(4, 64, 4, 4),
    multi_item_rounds=2,
    kernel_batches=(1, 2),
    flush_mb=4,
)


@dataclass
class Env:
    """The run's device and FlashInfer module (see the module docstring)."""

    device: torch.device = field(default_factory=lambda: torch.device("cuda"))
    twin: bool = False
    sizes: Sizes = field(default_factory=Sizes)
    fi: Any = None  # flashinfer, or flashplan.twin.flashinfer_twin

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


ENV = Env()


def configure(device: str, twin: bool, quick: bool, steps: int | None) -> Env:
    """Set :data:`ENV` (call once, before the parts run)."""
    ENV.device = torch.device(device)
    ENV.twin = twin
    ENV.sizes = QUICK if quick else Sizes()
    if steps is not None:
        ENV.sizes.steps = steps
    if twin:
        from flashplan.twin import flashinfer_twin  # the new tree only

        ENV.fi = flashinfer_twin
    else:
        import warnings

        with warnings.catch_warnings():  # flashinfer's import-time deprecation notices
            warnings.simplefilter("ignore", DeprecationWarning)
            import flashinfer

        ENV.fi = flashinfer
    return ENV


def executor(policy: Any = None) -> Any:
    """A fresh ``FlashInferExecutor`` on the run's device (over the twin in twin mode)."""
    from flashplan.executor.flashinfer import FlashInferExecutor

    if ENV.twin:
        return FlashInferExecutor(ENV.device, policy=policy, flashinfer=ENV.fi)
    return FlashInferExecutor(ENV.device, policy=policy)


def workspace(nbytes: int = 256 << 20) -> torch.Tensor:
    """A zeroed float workspace for raw FlashInfer wrappers."""
    return torch.zeros(nbytes, dtype=torch.uint8, device=ENV.device)


def sync() -> None:
    if ENV.cuda:
        torch.cuda.synchronize(ENV.device)


def pinned(values: object) -> torch.Tensor:
    """``values`` (integers) as an int32 host tensor of their shape, pinned on CUDA: the
    ready host inputs a bare ``plan()`` is timed with."""
    array = np.asarray(values)
    out = torch.empty(array.shape, dtype=torch.int32, pin_memory=ENV.cuda)
    out.numpy()[...] = array
    return out


# -- host timing -------------------------------------------------------------------------
def idle_call_us(fn: Callable[[], object]) -> float:
    """Host time (µs) of one call of ``fn`` issued on an idle GPU."""
    sync()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6


def host_us(fn: Callable[[], object], n: int = 30, warmup: int = 5) -> float:
    """Median host time (µs) of ``fn`` in a block of its own calls, GPU idle before each."""
    for _ in range(warmup):
        fn()
    times = [idle_call_us(fn) for _ in range(n)]
    sync()
    return statistics.median(times)


class Flush:
    """Rewrites ``mb`` MB of host memory: evicts the CPU caches, as the forward pass an
    engine runs between two plans does."""

    def __init__(self, mb: int) -> None:
        self.buf = np.zeros(max(mb, 1) << 18, dtype=np.int32)

    def __call__(self) -> None:
        self.buf += 1


def rounds_us(
    jobs: dict[str, Callable[[], object]],
    n: int,
    *,
    cold: bool = False,
    before: Callable[[int], None] | None = None,
    warmup: int = 3,
) -> dict[str, list[float]]:
    """Host times (µs) of every job, round by round: each round calls every job once, the
    order rotated from round to round, the GPU idle before each call, so a noisy host's
    drift reaches every job alike and round ``i``'s times are a pair (:func:`paired`).
    ``cold``: :class:`Flush` before each call (cold CPU caches); ``before(i)``: called
    (untimed) at the start of round ``i`` (fresh inputs for the round)."""
    flush = Flush(ENV.sizes.flush_mb) if cold else None
    names = list(jobs)
    for i in range(warmup):
        if before is not None:
            before(i)
        for fn in jobs.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(n):
        if before is not None:
            before(warmup + i)
        k = i % len(names)
        for name in names[k:] + names[:k]:
            if flush is not None:
                flush()
            times[name].append(idle_call_us(jobs[name]))
    sync()
    return times


def med(times: list[float]) -> float:
    return statistics.median(times)


def paired(a: list[float], b: list[float]) -> float:
    """Median over the rounds of ``a[i] / b[i]``."""
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def sleep_cycles(ms: float) -> int:
    """Cycles of ``torch.cuda._sleep`` that keep the GPU busy for about ``ms``."""
    sync()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    torch.cuda._sleep(10_000_000)
    e1.record()
    sync()
    return int(10_000_000 / e0.elapsed_time(e1) * ms)


def behind_us(fn: Callable[[], object], cycles: int, n: int = 5) -> float:
    """Median host time (µs) of ``fn`` issued right after a ``cycles``-long kernel (a
    call that waits for the GPU shows the kernel's length)."""
    fn()
    times = []
    for _ in range(n):
        sync()
        torch.cuda._sleep(cycles)
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
        sync()
    return statistics.median(times)


# -- device timing -----------------------------------------------------------------------
def kernel_ms(fn: Callable[[], object], rep: int = 100, warmup: int = 25) -> float:
    """Median GPU time of ``fn`` (ms): CUDA events around each call, L2 flushed before,
    after warm-up (``triton.testing.do_bench``). On the CPU: host time (a smoke run)."""
    if not ENV.cuda:
        return host_us(fn, n=3, warmup=1) / 1e3
    import triton

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def graph_ms(fn: Callable[[], object], rep: int = 200) -> float:
    """Median GPU time of ``fn`` (ms) replayed in a CUDA graph (no host time between
    launches; L2 not flushed: for kernels of a few µs, where a host call would
    outlast the kernel). On the CPU: :func:`kernel_ms`."""
    if not ENV.cuda:
        return kernel_ms(fn)
    import triton

    fn()  # first call: modules loaded, buffers made, outside the capture
    sync()
    return float(triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median"))


def step_us(fn: Callable[[], object], steps: int, warmup: int = 5) -> tuple[float, float]:
    """(median wall time of one synced step, mean per step of ``steps`` back to back)."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e6)
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    sync()
    return statistics.median(times), (time.perf_counter() - t0) * 1e6 / steps


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


# -- syncs -------------------------------------------------------------------------------
def raises_on_sync(fn: Callable[[], object]) -> bool | None:
    """Whether ``fn`` fails under ``torch.cuda.set_sync_debug_mode("error")`` (it syncs);
    ``None`` off CUDA."""
    if not ENV.cuda:
        return None
    fn()
    sync()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError:
        return True
    finally:
        torch.cuda.set_sync_debug_mode("default")
        sync()
    return False


class WaitCounter:
    """Counts host waits that ``set_sync_debug_mode`` does not see: ``Event.synchronize``,
    ``Stream.synchronize`` and ``torch.cuda.synchronize`` called inside the block."""

    def __init__(self) -> None:
        self.count = 0
        self._saved: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> WaitCounter:
        for owner, name in (
            (torch.cuda.Event, "synchronize"),
            (torch.cuda.Stream, "synchronize"),
            (torch.cuda, "synchronize"),
        ):
            original = getattr(owner, name)

            def counted(*args: Any, _f: Any = original, **kwargs: Any) -> Any:
                self.count += 1
                return _f(*args, **kwargs)

            self._saved.append((owner, name, original))
            setattr(owner, name, counted)
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved = []


# -- the report --------------------------------------------------------------------------
@dataclass
class Report:
    """One run's measurements (flat rows, joined between trees) and markdown."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    md: list[str] = field(default_factory=list)

    def add(
        self,
        part: str,
        case: str,
        metric: str,
        value: float | bool | None,
        unit: str = "µs",
        *,
        key: bool = False,
    ) -> None:
        """One measurement. ``unit``: "µs", "ms", "x" (a ratio, lower is better unless
        the metric says otherwise), "TB/s", "tok/s", "bool"; ``key``: a target's row."""
        if isinstance(value, (bool, np.bool_)) or value is None:
            v: Any = None if value is None else bool(value)
        else:
            v = float(value)
        self.rows.append(
            {"part": part, "case": case, "metric": metric, "value": v, "unit": unit, "key": key}
        )

    def table(self, title: str, header: list[str], lines: list[list[str]], note: str = "") -> None:
        self.md += [f"### {title}", ""]
        if note:
            self.md += [note, ""]
        self.md.append("| " + " | ".join(header) + " |")
        self.md.append("|" + "---|" * len(header))
        self.md += ["| " + " | ".join(cells) + " |" for cells in lines]
        self.md.append("")


def fmt(value: float | None, digits: int = 0) -> str:
    return "—" if value is None else f"{value:.{digits}f}"
