"""Run flashplan's Triton kernels under Triton's interpreter on hosts without CUDA.

Triton (3.x, checked on 3.9) reads ``TRITON_INTERPRET`` through
``triton.knobs.runtime.interpret`` when ``@triton.jit`` *decorates* a function: the
decorator returns an ``InterpretedFunction`` or a ``JITFunction`` then, once for good.
Importing ``triton`` does not fix the mode and launching does not revisit it. flashplan's
kernels are decorated when their module (``flashplan.kernels.page_gather``, …) is
imported, so the variable must be set before that import.

This conftest is imported before the test modules of this folder, so on a host without
CUDA it sets ``TRITON_INTERPRET=1`` (unless the environment already sets it) and, if
another test or conftest imported kernel modules earlier in the same pytest process with
compiled kernels, reloads them: a reload re-runs the decorators in the same module
namespace, so every reference to the launchers sees the interpreted kernels. A module
whose kernel calls another module's jit helpers (``flashplan.kernels.fused``) imported
them by name, so the modules are reloaded twice: the second pass re-imports helpers
that the first pass had already made interpreted.

On a CUDA host nothing is changed: the kernels stay compiled, the interpreter tests skip
and the ``gpu`` tests run the real kernels.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

import torch

_TRUE = ("1", "true", "on", "yes", "y")


def _modules_with_compiled_kernels() -> list[ModuleType]:
    """Imported ``flashplan.kernels.*`` modules that hold a compiled ``JITFunction``."""
    try:
        from triton.runtime import JITFunction
    except ImportError:
        return []
    return [
        module
        for name, module in sorted(sys.modules.items())
        if name.startswith("flashplan.kernels.")
        and module is not None
        and any(isinstance(value, JITFunction) for value in vars(module).values())
    ]


if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ["TRITON_INTERPRET"].strip().lower() in _TRUE:
        _stale = _modules_with_compiled_kernels()
        for _ in range(2):
            for _module in _stale:
                importlib.reload(_module)
