"""Run flashplan's Triton kernels under Triton's interpreter on hosts without CUDA.

Triton (3.x, checked on 3.9) reads ``TRITON_INTERPRET`` through
``triton.knobs.runtime.interpret`` when ``@triton.jit`` *decorates* a function: the
decorator returns an ``InterpretedFunction`` or a ``JITFunction`` then, once for good.
Importing ``triton`` does not fix the mode and launching does not revisit it. flashplan's
kernels are decorated when ``flashplan.kernels.page_gather`` / ``.merge_state`` are
imported, so the variable must be set before that import.

This conftest is imported before the test modules of this folder, so on a host without
CUDA it sets ``TRITON_INTERPRET=1`` (unless the environment already says otherwise) and,
if another test or conftest imported the kernel modules earlier in the same pytest
process with compiled kernels, reloads them: a reload re-runs the decorators in the same
module namespace, so every reference to the launchers sees the interpreted kernels.

On a CUDA host nothing is changed: the kernels stay compiled, the interpreter tests skip
and the ``gpu`` tests run the real kernels.
"""

from __future__ import annotations

import importlib
import os
import sys

import torch

KERNEL_MODULES = ("flashplan.kernels.page_gather", "flashplan.kernels.merge_state")

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ["TRITON_INTERPRET"].strip().lower() in ("1", "true", "on", "yes", "y"):
        for _name in KERNEL_MODULES:
            _module = sys.modules.get(_name)
            if _module is not None and _module.triton_mode() == "compiled":
                importlib.reload(_module)
