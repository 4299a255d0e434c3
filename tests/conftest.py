"""Shared pytest configuration for the CPU test suite."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings


def _threads_per_worker() -> int | None:
    """Under pytest-xdist (``-n N``): the CPUs this process may use, shared out among the
    N workers (at least 1 each); ``None`` in a plain run."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers:
        return None
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cpus or 1) // max(1, int(workers)))


# xdist: each worker gets its share of the CPUs for torch's intra-op threads. Otherwise
# every worker runs as many OpenMP threads as there are cores: on CI's 2 cores, 2 workers
# x 2 threads spin against each other and the engine tests run several times slower.
# OMP_NUM_THREADS also reaches the processes the tests start (gloo ranks, the CLI); a
# value set by hand is left alone.
_THREADS = _threads_per_worker()
if _THREADS is not None and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)
    import torch

    torch.set_num_threads(_THREADS)

# Hypothesis: small, fast runs by default (each property test draws at most 60 examples).
# Pick another profile with HYPOTHESIS_PROFILE=thorough for a longer local run.
settings.register_profile(
    "flashplan",
    max_examples=60,
    deadline=None,
    derandomize=False,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "thorough",
    parent=settings.get_profile("flashplan"),
    max_examples=1000,
)
# CI: the same examples on every run (a red CI is then caused by a commit, never by a new
# draw); no example database. .ci/run sets HYPOTHESIS_PROFILE=ci; local runs stay random.
settings.register_profile(
    "ci",
    parent=settings.get_profile("flashplan"),
    derandomize=True,
    database=None,
    print_blob=True,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "flashplan"))
