"""FlashInfer's masking rules: which key one kernel call shows each of its queries.

This is the executor-facing statement of "who sees what", written from the kernels'
side: given the lengths and flags of one call, which entries survive. It sits beside
:mod:`flashplan.oracle`, which states the same thing from the layout's side, so that
the two independent statements can be compared (:func:`flashplan.materialize`) and
the reference executor computes exactly what the kernels compute.

For request ``i`` with ``qo = qo_lens[i]`` queries and ``kv = kv_lens[i]`` keys:

* causal: query ``j`` sees key ``c`` when ``c <= j + kv - qo`` (bottom-right aligned);
* window ``W >= 0``: also ``c + qo + W >= kv + j``;
* a custom mask, when given, is AND-ed in.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["kernel_visibility"]


def kernel_visibility(
    qo_lens: npt.NDArray[np.integer],
    kv_lens: npt.NDArray[np.integer],
    max_q: int,
    max_kv: int,
    *,
    causal: bool,
    window_left: int,
) -> npt.NDArray[np.bool_]:
    """bool ``[bs, max_q, max_kv]``: what a kernel call shows query ``j`` of key ``c``.

    Entries past ``qo_lens[i]`` / ``kv_lens[i]`` (padding) are hidden. ``window_left``
    of -1 means no window.
    """
    qo = qo_lens.astype(np.int64)[:, None, None]
    kv = kv_lens.astype(np.int64)[:, None, None]
    j = np.arange(max_q)[None, :, None]
    c = np.arange(max_kv)[None, None, :]
    seen = (j < qo) & (c < kv)
    if causal:
        seen &= c <= j + kv - qo
    if window_left >= 0:
        seen &= c + qo + window_left >= kv + j
    return seen
