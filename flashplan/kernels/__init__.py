"""Device kernels of flashplan (Triton) and their plain-torch twins.

* :func:`gather_slots` / :func:`gather_slots_torch`: every page-table gather job of a
  batch (page ids of kernel calls, KV write slots) in one launch, bad ids caught.
* :func:`write_kv` / :func:`write_kv_torch`: new K/V rows into a paged cache, skipping
  slots marked unusable.
* :func:`build_custom_mask` / :func:`build_custom_mask_torch`: packed custom
  masks expanded on the device from one integer per request.
* :mod:`flashplan.kernels.fused`: the gather jobs and one custom mask of a batch in a
  single launch (the executors' hot path), through Triton's compiled launcher after a
  variant's first launch.
* :func:`fill_runs` / :func:`fill_runs_torch`: runs of values that grow by one (a
  plan's RoPE positions from its position runs) written in one launch.
* :func:`merge_state_triton` / :func:`merge_state_torch`: merge two partial attention
  states whose log-sum-exp is in base 2 (FlashInfer's convention).

Importing this package does not need Triton: without it, the ``*_torch`` twins (and the
launchers, on CPU tensors) still work. Triton kernels are defined when their module is
imported, and Triton decides interpret mode at that moment: set ``TRITON_INTERPRET=1``
before the first import to run them on CPU tensors through Triton's interpreter.
"""

from __future__ import annotations

from flashplan.kernels._triton import triton_mode
from flashplan.kernels.custom_mask import build_custom_mask, build_custom_mask_torch
from flashplan.kernels.gather import NO_BAD_JOB, gather_slots, gather_slots_torch, new_status
from flashplan.kernels.kv_write import write_kv, write_kv_torch
from flashplan.kernels.merge_state import merge_state_torch, merge_state_triton
from flashplan.kernels.runs import fill_runs, fill_runs_torch

__all__ = [
    "NO_BAD_JOB",
    "build_custom_mask",
    "build_custom_mask_torch",
    "fill_runs",
    "fill_runs_torch",
    "gather_slots",
    "gather_slots_torch",
    "merge_state_torch",
    "merge_state_triton",
    "new_status",
    "triton_mode",
    "write_kv",
    "write_kv_torch",
]
