"""Planning policy: which kernel path an extend batch takes.

The default is a documented function of the layout and heads, chosen from the
benchmarks in ``docs/benchmarks.md``; pass ``extend_path=`` to :func:`flashplan.plan`
to override it.
"""

from __future__ import annotations

import numpy as np

from flashplan.layout.batch import BatchLayout
from flashplan.layout.heads import HeadConfig
from flashplan.planning.spec import ExtendPath

__all__ = ["default_extend_path"]


def default_extend_path(layout: BatchLayout, heads: HeadConfig) -> ExtendPath:
    """Choose ragged vs paged for an extend batch's self-attention groups.

    * A multi-item batch: ``PAGED`` — FlashInfer's multi-item mode exists only in its
      paged prefill kernel.
    * An fp8 KV cache: ``PAGED`` — attention reads every key as the cache stores it
      (quantized), the new tokens' too, which the ragged kernel over the unquantized
      new K/V would not.
    * No request has a cached prefix: ``RAGGED`` — attention over the new tokens
      alone, no page gather, one kernel.
    * Otherwise: ``PAGED`` — one paged prefill over prefix + new tokens, which
      avoids the second kernel and the merge of partial states (8–14% of the
      ragged+paged time for a 16 x (2048 + 512) batch on an H200), and needs no
      custom mask for windowed groups.
    """
    if layout.is_multi_item or heads.kv_is_fp8:  # (head shapes do not move the choice)
        return ExtendPath.PAGED
    if not np.any(layout.prefix_lens):
        return ExtendPath.RAGGED
    return ExtendPath.PAGED
