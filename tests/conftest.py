"""Shared pytest configuration for the CPU test suite."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

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
