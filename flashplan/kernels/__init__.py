"""Device kernels of flashplan (Triton) and their plain-torch twins.

* :func:`gather_page_indices` / :func:`gather_page_indices_torch`: a page table's rows,
  sliced per request, flattened into FlashInfer's ``kv_indices`` (page ids).
* :func:`token_slots` / :func:`token_slots_torch`: KV-cache write slots (page id, in-page
  offset) of the new tokens of a step.
* :func:`merge_state_triton` / :func:`merge_state_torch`: merge two partial attention
  states whose log-sum-exp is in base 2 (FlashInfer's convention).

Importing this package does not need Triton: without it, the ``*_torch`` twins (and the
launchers, on CPU tensors) still work. Triton kernels are defined when their module is
imported, and Triton decides interpret mode at that moment: set ``TRITON_INTERPRET=1``
before the first import to run them on CPU tensors through Triton's interpreter.
"""

from __future__ import annotations

from flashplan.kernels.merge_state import merge_state_torch, merge_state_triton
from flashplan.kernels.page_gather import (
    gather_page_indices,
    gather_page_indices_torch,
    token_slots,
    token_slots_torch,
)

__all__ = [
    "gather_page_indices",
    "gather_page_indices_torch",
    "merge_state_torch",
    "merge_state_triton",
    "token_slots",
    "token_slots_torch",
]
