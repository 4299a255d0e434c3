"""Every page of ``README.md`` and ``docs/*.md`` with a ```python cuda block runs whole on
a GPU: all its ```python blocks, CUDA ones included, in order, in one namespace, in a
fresh working directory (the rules: ``tests/test_doc_blocks.py``, which runs the other
blocks on the CPU and checks their printed outputs). ``tests/gpu/conftest.py`` marks
these tests ``gpu`` and skips them without CUDA or FlashInfer.
"""

from __future__ import annotations

import gc
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _doc_blocks() -> ModuleType:
    """tests/test_doc_blocks.py, imported by path (tests/ is not a package)."""
    name = "_doc_blocks_rules"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "tests" / "test_doc_blocks.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


rules = _doc_blocks()
CUDA_PAGES = [p for p in rules.pages() if any(b.needs_cuda for b in rules.python_blocks(p))]


def test_some_pages_have_cuda_blocks() -> None:
    assert CUDA_PAGES, "no ```python cuda block found: the extraction is broken"


@pytest.mark.parametrize("path", CUDA_PAGES, ids=lambda p: p.name)
def test_page_runs_whole_on_the_gpu(
    path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))
    try:
        ran = rules.run_page(path, cuda=True)
        torch.cuda.synchronize()  # a kernel's error surfaces here, at the latest
    finally:
        gc.collect()
        torch.cuda.empty_cache()
    assert ran == len(rules.python_blocks(path))
