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
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "flashplan"))
