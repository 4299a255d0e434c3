"""GPU tests: run real FlashInfer kernels; skipped cleanly without CUDA or flashinfer."""

from __future__ import annotations

import importlib.util

import pytest
import torch


def _gpu_ready() -> str | None:
    if not torch.cuda.is_available():
        return "needs CUDA"
    if importlib.util.find_spec("flashinfer") is None:
        return "needs flashinfer-python"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = _gpu_ready()
    for item in items:
        if "tests/gpu" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=reason))
