"""Run-time argument checks shared by every executor ("plan = run")."""

from __future__ import annotations

import torch

from flashplan.errors import PlanMismatchError
from flashplan.layout.group import AttentionGroup
from flashplan.plan.spec import GroupPlan, PlanSpec

__all__ = ["check_run_args"]


def _expect_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != shape:
        raise PlanMismatchError(
            f"{name}: expected shape {shape} from the plan, got {tuple(t.shape)}"
        )


def _expect_dtype(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    if t.dtype != dtype:
        raise PlanMismatchError(f"{name}: planned dtype {dtype}, got {t.dtype}")


def check_run_args(
    spec: PlanSpec | None,
    group: AttentionGroup,
    q: torch.Tensor,
    k_new: torch.Tensor | None,
    v_new: torch.Tensor | None,
    kv_cache: torch.Tensor,
) -> GroupPlan:
    """Check a ``run`` call against the applied plan; return the group's plan.

    Shapes and dtypes only (metadata: no device access).

    Raises:
        PlanMismatchError: nothing applied, group not planned, or a tensor whose
            shape or dtype contradicts the plan.
    """
    if spec is None:
        raise PlanMismatchError("run() before apply(): apply a PlanSpec first")
    gp = spec.group_plan(group)
    heads = spec.heads
    d = heads.head_dim
    _expect_shape("q", q, (spec.total_q, heads.num_qo_heads, d))
    _expect_dtype("q", q, heads.q_dtype)
    if (k_new is None) != (v_new is None):
        raise PlanMismatchError("k_new and v_new must both be given or both be None")
    if k_new is not None and v_new is not None:
        rows = spec.total_encoder if group.cross_attention else spec.total_q
        for name, t in (("k_new", k_new), ("v_new", v_new)):
            _expect_shape(name, t, (rows, heads.num_kv_heads, d))
            _expect_dtype(name, t, heads.kv_dtype)
    if kv_cache.dim() != 5 or tuple(kv_cache.shape[1:]) != (
        2,
        spec.page_size,
        heads.num_kv_heads,
        d,
    ):
        raise PlanMismatchError(
            "kv_cache: expected [num_pages, 2, page_size, num_kv_heads, head_dim] = "
            f"[*, 2, {spec.page_size}, {heads.num_kv_heads}, {d}], got {tuple(kv_cache.shape)}"
        )
    _expect_dtype("kv_cache", kv_cache, heads.kv_dtype)
    if q.device != kv_cache.device:
        raise PlanMismatchError(f"q on {q.device} but kv_cache on {kv_cache.device}")
    return gp
