"""``executor.run`` as a ``torch.library`` custom op, so a model's attention layer
compiles under ``torch.compile(fullgraph=True)`` and can be captured in a CUDA graph.

FlashInfer's own custom-op registration is a no-op in 0.7.x (its issue #2733), so
engines wrap attention themselves; :class:`AttentionOp` does it once, for every executor
(the FlashInfer executors and :class:`~flashplan.ReferenceExecutor` alike)::

    attend = flashplan.AttentionOp(executor, group)   # once, per layer kind

    def layer(q, k, v, kv_cache):                     # compiles with fullgraph=True
        return flashplan.attention(attend, q, k, v, kv_cache)
        # = executor.run(group, q, k, v, kv_cache) on the plan applied at the call

The op is ``flashplan::run(AttentionOp op, Tensor q, Tensor? k_new, Tensor? v_new,
Tensor(a!)? kv_cache, ScalarType out_dtype, Tensor? sinks) -> Tensor`` (``sinks``: a sink
group's float32 ``[num_qo_heads]`` sink logits). It writes ``k_new`` / ``v_new``
into ``kv_cache``, which the schema declares mutated, so the compiler keeps the writes
before every later read of the cache. The :class:`AttentionOp` is an opaque reference
object: the compiled graph holds that very object (guarded by identity) and never looks
inside it; each call runs the plan its executor holds then, so one trace serves every
step of the same shapes.

The fake (meta) implementation gives ``q``'s shape ``[total_q, num_qo_heads,
head_dim]`` in the ``out_dtype`` argument (the compiler cannot look into the executor).
"""

from __future__ import annotations

import torch
from torch._library.opaque_object import register_opaque_type
from torch._opaque_base import OpaqueBase

from flashplan.errors import FieldTypeError, PlanMismatchError
from flashplan.executor.protocol import Executor
from flashplan.layout.group import AttentionGroup
from flashplan.planning.spec import PlanSpec

__all__ = ["AttentionOp", "attention"]


class AttentionOp(OpaqueBase):
    """One group's attention through an executor, as an argument of the custom op
    ``torch.ops.flashplan.run`` (module docstring); call it with :func:`attention`.

    Args:
        executor: the executor whose ``run`` the op calls (any :class:`Executor`).
        group: the group it runs (looked up in the plan applied at each call).

    Raises:
        FieldTypeError: ``executor`` has no ``run`` / ``spec``, or ``group`` is not an
            :class:`~flashplan.AttentionGroup`.
    """

    def __init__(self, executor: Executor, group: AttentionGroup) -> None:
        if not callable(getattr(executor, "run", None)) or not hasattr(executor, "spec"):
            raise FieldTypeError(
                "executor", "must be a flashplan executor", value=type(executor).__name__
            )
        if not isinstance(group, AttentionGroup):
            raise FieldTypeError("group", "must be an AttentionGroup", value=type(group).__name__)
        self.executor = executor
        self.group = group

    def spec(self) -> PlanSpec:
        """The executor's applied plan.

        Raises:
            PlanMismatchError: no plan applied, or the group was not planned.
        """
        spec = self.executor.spec
        if spec is None:
            raise PlanMismatchError("run", "call apply() before run()")
        spec.group_index(self.group)  # raises for a group the plan does not have
        return spec

    def __repr__(self) -> str:
        return f"AttentionOp({type(self.executor).__name__}, {self.group.describe()!r})"


def attention(
    op: AttentionOp,
    q: torch.Tensor,
    k_new: torch.Tensor | None,
    v_new: torch.Tensor | None,
    kv_cache: torch.Tensor | None,
    *,
    out_dtype: torch.dtype | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """``op.executor.run(op.group, q, k_new, v_new, kv_cache, sinks=sinks)`` through the custom op
    ``torch.ops.flashplan.run``: traceable by ``torch.compile(fullgraph=True)``.

    ``out_dtype`` is the plan's ``HeadConfig.out_dtype`` (default: ``q``'s dtype, as
    ``HeadConfig``'s): the compiler must know the output's dtype without reading the
    executor, so it is an argument of the op. ``k_scale`` / ``v_scale``: an fp8 cache's
    scales (:mod:`flashplan.fp8`), a number or a 0-d float32 tensor; passed to ``run``
    only when given.

    Returns:
        ``[total_q, num_qo_heads, head_dim]`` of ``out_dtype``.

    Raises:
        PlanMismatchError: as ``run`` (no plan applied, the group not planned, arguments
            that contradict the plan), or an ``out_dtype`` that is not the plan's.
    """
    dtype = q.dtype if out_dtype is None else out_dtype
    # the op's schema takes each scale as a tensor or as a number (one union per argument
    # is not a schema type)
    k_t, k_f = (k_scale, None) if isinstance(k_scale, torch.Tensor) else (None, k_scale)
    v_t, v_f = (v_scale, None) if isinstance(v_scale, torch.Tensor) else (None, v_scale)
    return run(op, q, k_new, v_new, kv_cache, dtype, sinks, k_t, v_t, k_f, v_f)


register_opaque_type(AttentionOp, typ="reference")


@torch.library.custom_op("flashplan::run", mutates_args=("kv_cache",))
def run(
    op: AttentionOp,
    q: torch.Tensor,
    k_new: torch.Tensor | None,
    v_new: torch.Tensor | None,
    kv_cache: torch.Tensor | None,
    out_dtype: torch.dtype,
    sinks: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    k_scale_value: float | None = None,
    v_scale_value: float | None = None,
) -> torch.Tensor:
    """The op: ``op.executor.run(op.group, ...)`` on the plan applied now (each scale a
    tensor or a number, or neither)."""
    planned = op.spec().heads.out_dtype
    if planned != out_dtype:
        raise PlanMismatchError("out_dtype", "must be the plan's", planned=planned, got=out_dtype)
    k = k_scale if k_scale is not None else k_scale_value
    v = v_scale if v_scale is not None else v_scale_value
    if k is None and v is None:  # an executor without fp8 support takes no scales
        return op.executor.run(op.group, q, k_new, v_new, kv_cache, sinks=sinks)
    return op.executor.run(op.group, q, k_new, v_new, kv_cache, sinks=sinks, k_scale=k, v_scale=v)


@run.register_fake
def _run_fake(
    op: AttentionOp,
    q: torch.Tensor,
    k_new: torch.Tensor | None,
    v_new: torch.Tensor | None,
    kv_cache: torch.Tensor | None,
    out_dtype: torch.dtype,
    sinks: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    k_scale_value: float | None = None,
    v_scale_value: float | None = None,
) -> torch.Tensor:
    # (the executor is opaque here: the shape is q's, the dtype an argument)
    return q.new_empty(q.shape, dtype=out_dtype)
