"""The flashinfer versions this executor knows, and the quirks it works around.

Two behaviours of flashinfer 0.7.4 are worked around (both checked against the
installed flashinfer by ``tests/test_flashinfer_calls.py``):

* **Packed mask offsets.** Given ``packed_custom_mask``, ``plan()`` computes each
  request's mask offset as a running sum of ``qo_len * kv_len`` — a count of bits —
  and the kernel adds it to a byte pointer (flashinfer PR #2201). flashplan lays each
  request's bytes at the offsets flashinfer computes
  (:func:`~flashplan.executor.flashinfer.calls.flashinfer_mask_offsets`).
* **Empty masked spans.** ``plan()`` sizes a masked request as
  ``qo_len * ((pages - 1) * page_size + last_page_len)`` without clamping, so a span of
  zero pages gives a negative size; flashplan gives such a span one unread page with
  ``last_page_len = 0`` (:func:`~flashplan.executor.flashinfer.calls.call_inputs`).

Another version may have fixed either (and then the workarounds would misplace mask
bits): :func:`check_version` warns.
"""

from __future__ import annotations

import warnings

__all__ = ["KNOWN_VERSIONS", "FlashInferVersionWarning", "check_version"]

#: flashinfer-python versions whose quirks flashplan's workarounds were checked against.
KNOWN_VERSIONS = ("0.7.4",)


class FlashInferVersionWarning(UserWarning):
    """The installed flashinfer is not one whose quirks flashplan was checked against."""


def check_version(version: str) -> bool:
    """Whether ``version`` is known; warn (:class:`FlashInferVersionWarning`) if not."""
    base = version.split("+")[0]
    if base in KNOWN_VERSIONS:
        return True
    warnings.warn(
        f"flashinfer {version} is not a version flashplan was checked against "
        f"({', '.join(KNOWN_VERSIONS)}): its custom-mask offsets and empty masked spans "
        "are worked around as in 0.7.4 (see flashplan.executor.flashinfer.compat); run "
        "the GPU tests (nox -s gpu) before trusting masked extends",
        FlashInferVersionWarning,
        stacklevel=3,
    )
    return False
