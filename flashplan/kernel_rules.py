"""FlashInfer's masking rules: which key one kernel call shows each of its queries.

This is the executor-facing statement of "who sees what", written from the kernels'
side: given the lengths and flags of one call, which entries survive. It sits beside
:mod:`flashplan.oracle`, which states the same thing from the layout's side, so that
the two independent statements can be compared (:func:`flashplan.materialize`) and
the reference executor computes exactly what the kernels compute.

For request ``i`` with ``qo = qo_lens[i]`` queries and ``kv = kv_lens[i]`` keys, query
``j`` sits at key position ``L = j + kv - qo`` (bottom-right aligned):

* causal: query ``j`` sees key ``c`` when ``c <= L``;
* window ``W >= 0``: also ``c + W >= L``;
* a custom mask, when given, is AND-ed in;
* **multi-item scoring** (FlashInfer 0.7.4's ``MaskMode::kMultiItemScoring``, FA2
  ``logits_mask_multi_item_scoring`` in ``attention/prefill.cuh``; the FA3 mainloop
  states the same rule), with ``p = prefix_len_ptr[i]`` and the request's row ``tpos``
  of ``token_pos_in_items``: the causal bound always applies (whatever the causal
  flag); a query with ``L < p`` is a prefix query and sees every key up to itself;
  a query with ``L >= p`` reads ``t = tpos[L - p]`` and sees ``c < p`` (the prefix) or
  ``L - t < c <= L`` (itself and the ``t - 1`` tokens before it: its own item; nothing
  for a delimiter, ``t = 0``). The kernel also skips whole key tiles between the
  prefix and ``L - max_item_len[i]``; which ones depends on its tile sizes, so keys
  ``p <= c < L - max_item_len`` are treated as hidden here: a ``max_item_len`` below
  the true largest ``t`` shows up as missing keys, as it would on the GPU.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import numpy.typing as npt

from flashplan.errors import PlanIntegrityError

__all__ = ["MultiItemArgs", "kernel_visibility"]


class MultiItemArgs(Protocol):
    """The multi-item arguments of one call
    (:class:`~flashplan.planning.items.MultiItemTensors` is one)."""

    @property
    def prefix_len_ptr(self) -> npt.NDArray[np.uint32]: ...

    @property
    def token_pos_in_items(self) -> npt.NDArray[np.uint16]: ...

    @property
    def token_pos_in_items_len(self) -> int: ...

    @property
    def max_item_len(self) -> npt.NDArray[np.uint16]: ...


def kernel_visibility(
    qo_lens: npt.NDArray[np.integer],
    kv_lens: npt.NDArray[np.integer],
    max_q: int,
    max_kv: int,
    *,
    causal: bool,
    window_left: int,
    items: MultiItemArgs | None = None,
) -> npt.NDArray[np.bool_]:
    """bool ``[bs, max_q, max_kv]``: what a kernel call shows query ``j`` of key ``c``.

    Entries past ``qo_lens[i]`` / ``kv_lens[i]`` (padding) are hidden. ``window_left``
    of -1 means no window; ``items`` switches on the multi-item rule (module docstring).

    Raises:
        PlanIntegrityError: a query after the prefix would read past its ``token_pos_in_items``
            row (the kernel would read another request's row).
    """
    qo = qo_lens.astype(np.int64)[:, None, None]
    kv = kv_lens.astype(np.int64)[:, None, None]
    j = np.arange(max_q)[None, :, None]
    c = np.arange(max_kv)[None, None, :]
    rows = j < qo
    seen = rows & (c < kv)
    pos = j + kv - qo  # the query's key position
    if causal or items is not None:
        seen &= c <= pos
    if window_left >= 0:
        seen &= c + qo + window_left >= kv + j
    if items is not None:
        bs = qo.shape[0]
        p = items.prefix_len_ptr.astype(np.int64)[:, None, None]
        stride = int(items.token_pos_in_items_len)
        after = rows & (pos >= p)  # [bs, max_q, 1]
        at = pos - p
        if (after & (at >= stride)).any():
            raise PlanIntegrityError("a query reads past its token_pos_in_items row")
        t = np.zeros(after.shape, dtype=np.int64)
        if stride and bs:
            table = items.token_pos_in_items.reshape(bs, stride).astype(np.int64)
            t = np.take_along_axis(table, np.clip(at[:, :, 0], 0, stride - 1), axis=1)[..., None]
        longest = items.max_item_len.astype(np.int64)[:, None, None]
        item = (c > pos - t) & (c >= pos - longest)
        seen &= ~after | (c < p) | item
    return seen
