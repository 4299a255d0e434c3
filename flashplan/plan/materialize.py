"""Rebuild "which key each query sees" from a plan's kernel calls alone.

This restates what FlashInfer's kernels do with the arguments a plan gives them
(bottom-right aligned causal mask, window ``c + qo_len + window >= kv_len + j``,
custom mask bits), so comparing it with :mod:`flashplan.oracle` — which states
the rules from the layout — checks the planner. It is a debugging and test aid,
written per request for clarity, not a hot path.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from flashplan.plan.masks import unpack_request
from flashplan.plan.spec import GroupPlan, PlanSpec

__all__ = ["PlanIntegrityError", "kernel_visibility", "materialize"]


class PlanIntegrityError(AssertionError):
    """A plan reads keys outside its group's key space, or reads one key twice."""


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

    FlashInfer's rules for request ``i`` with ``qo = qo_lens[i]`` and ``kv = kv_lens[i]``:
    causal ``c <= j + kv - qo`` (bottom-right aligned), window
    ``c + qo + window_left >= kv + j``; entries past ``qo`` / ``kv`` (padding) are hidden.
    The reference executor runs on the same statement of the rules.
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


def _one_call(
    qo_len: int,
    kv_len: int,
    *,
    causal: bool,
    window_left: int,
    mask: npt.NDArray[np.bool_] | None = None,
) -> npt.NDArray[np.bool_]:
    """``[qo_len, kv_len]`` visibility of one request's kernel call (custom mask applied)."""
    seen = kernel_visibility(
        np.array([qo_len]),
        np.array([kv_len]),
        qo_len,
        kv_len,
        causal=causal,
        window_left=window_left,
    )[0]
    return seen if mask is None else seen & mask


def materialize(spec: PlanSpec, group: object) -> list[npt.NDArray[np.bool_]]:
    """Per request, ``[qo_len, num_keys]`` booleans built from the plan's kernel calls.

    Raises:
        PlanIntegrityError: if a kernel call would read a key outside the group's
            key space or two calls would read the same key for the same query.
    """
    gp: GroupPlan = spec.group_plan(group)  # type: ignore[arg-type]
    ps = spec.page_size
    qo = np.diff(spec.qo_indptr)
    out = []
    for i in range(spec.batch_size):
        e, k_total = int(qo[i]), int(gp.num_keys[i])
        pic = np.zeros((e, k_total), dtype=bool)
        parts: list[tuple[int, npt.NDArray[np.bool_]]] = []
        if gp.paged is not None:
            p = gp.paged
            m = int(p.kv_lens[i])
            mask = None
            if p.packed_mask is not None and p.mask_indptr is not None:
                mask = unpack_request(p.packed_mask, p.mask_indptr, i, e, m)
            seen = _one_call(e, m, causal=p.causal, window_left=gp.window_left, mask=mask)
            parts.append((int(p.start_page[i]) * ps - int(gp.key_offset[i]), seen))
        if gp.ragged is not None:
            r = gp.ragged
            n = int(r.kv_indptr[i + 1] - r.kv_indptr[i])
            seen = _one_call(e, n, causal=r.causal, window_left=gp.window_left)
            parts.append((k_total - n, seen))
        for first, seen in parts:
            keys = first + np.arange(seen.shape[1])
            inside = (keys >= 0) & (keys < k_total)
            if seen[:, ~inside].any():
                raise PlanIntegrityError(
                    f"request {i}: plan shows keys outside [0, {k_total}) of group "
                    f"{gp.group.describe()!r}"
                )
            sub = seen[:, inside]
            cols = keys[inside]
            if (pic[:, cols] & sub).any():
                raise PlanIntegrityError(f"request {i}: two kernel calls read the same key")
            pic[:, cols] |= sub
        out.append(pic)
    return out
