"""`Mode`: what kind of step a batch is."""

from __future__ import annotations

import enum

__all__ = ["Mode"]


class Mode(enum.Enum):
    """What kind of step a batch is.

    * ``DECODE``: one new token per request, planned on FlashInfer's decode kernels.
    * ``EXTEND``: any number of new tokens per request (prefill, chunked prefill,
      block-bidirectional extend, draft extend, multi-item scoring).
    * ``VERIFY``: speculative target verify: each request's ``N`` draft tokens, a tree
      (:class:`~flashplan.layout.drafts.DraftTree`), after its prefix.
    """

    DECODE = "decode"
    EXTEND = "extend"
    VERIFY = "verify"
