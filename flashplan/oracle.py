"""The oracle: "query j may see key k", stated straight from a `BatchLayout`.

Independent of the planner on purpose: it never looks at a `PlanSpec`. Tests
compare it with :meth:`PlanSpec.materialize` and use it to build float64 dense
attention. Semantics (DESIGN §2): new token ``j`` of request ``i`` sits at
decoder position ``P + j``; a causal self group shows keys ``k <= P + j``, a
window ``W >= 0`` also requires ``k >= P + j - W``; a bidirectional group shows
every key ``k < L``; a cross group shows every encoder key.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from flashplan.layout.batch import BatchLayout
from flashplan.layout.group import AttentionGroup

__all__ = ["key_space_len", "visibility"]


def key_space_len(layout: BatchLayout, group: AttentionGroup) -> npt.NDArray[np.int32]:
    """Keys in the group's key space per request: encoder or decoder length."""
    if group.cross_attention:
        assert layout.encoder_lens is not None
        return layout.encoder_lens
    return layout.seq_lens


def visibility(layout: BatchLayout, group: AttentionGroup) -> list[npt.NDArray[np.bool_]]:
    """Per request, a ``[extend_len, num_keys]`` boolean matrix of visible keys."""
    out = []
    keys_per_req = key_space_len(layout, group)
    for prefix, new, n_keys in zip(
        layout.prefix_lens.tolist(), layout.extend_lens.tolist(), keys_per_req.tolist(), strict=True
    ):
        pos = prefix + np.arange(new)[:, None]
        key = np.arange(n_keys)[None, :]
        seen = np.ones((new, n_keys), dtype=bool)
        if not group.cross_attention:
            if group.causal:
                seen &= key <= pos
            if group.window_left >= 0:
                seen &= key >= pos - group.window_left
        out.append(seen)
    return out
