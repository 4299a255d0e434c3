"""`Executor`: the contract both executors satisfy, stated once.

``apply(spec, table)`` once per batch, then ``run(group, q, k_new, v_new, kv_cache)``
per layer. Code written against this protocol runs on
:class:`~flashplan.ReferenceExecutor` (any device) and on
:class:`~flashplan.executor.flashinfer.FlashInferExecutor` (CUDA) unchanged.
"""

from __future__ import annotations

from typing import Literal, Protocol, overload, runtime_checkable

import torch

from flashplan.layout.group import AttentionGroup
from flashplan.layout.page_table import PageTable
from flashplan.planning.spec import PlanSpec

__all__ = ["Executor"]


@runtime_checkable
class Executor(Protocol):
    """What an executor does with a :class:`~flashplan.PlanSpec`.

    * :meth:`apply` prepares everything the plan's kernel calls need on the device of
      ``table`` (index tensors, masks, FlashInfer ``plan()`` calls). It never waits for
      the GPU. A refused apply leaves the executor as it was.
    * :meth:`run` computes one layer of ``group``: it writes ``k_new`` / ``v_new``
      (``[total_q, num_kv_heads, head_dim]`` for self groups, encoder rows for cross
      groups; ``None`` when the cache already holds them) into ``kv_cache``
      (``[num_pages, 2, page_size, num_kv_heads, head_dim]``; ``None`` for a
      ragged-path group that needs no cache), then attends. It returns ``out``
      ``[total_q, num_qo_heads, head_dim]`` and, with ``return_lse=True``, the float32
      base-2 log-sum-exp ``[total_q, num_qo_heads]`` (``-inf`` where a query sees no
      key, whose output is 0). An fp8 cache (``HeadConfig.kv_dtype``) takes its
      per-tensor ``k_scale`` / ``v_scale`` (:mod:`flashplan.fp8`). Every argument is
      checked against the plan before anything is written.
    """

    @property
    def spec(self) -> PlanSpec | None:
        """The plan applied last, or ``None``."""
        ...

    def apply(self, spec: PlanSpec, table: PageTable) -> None:
        """Prepare ``spec`` for running on ``table``'s pages."""
        ...

    def positions(self) -> torch.Tensor:
        """int32 ``[total_q]`` on the applied device: the applied plan's RoPE
        positions (:attr:`~flashplan.PlanSpec.positions`)."""
        ...

    def apply_steps(
        self, specs: tuple[PlanSpec, ...] | list[PlanSpec], table: PageTable
    ) -> tuple[Executor, ...]:
        """Prepare every step of a multi-step draft decode at once
        (:func:`flashplan.plan_steps`); one executor per step, to ``run`` that step."""
        ...

    @overload
    def run(
        self,
        group: AttentionGroup,
        q: torch.Tensor,
        k_new: torch.Tensor | None,
        v_new: torch.Tensor | None,
        kv_cache: torch.Tensor | None,
        *,
        return_lse: Literal[False] = False,
        sinks: torch.Tensor | None = None,
        k_scale: float | torch.Tensor | None = None,
        v_scale: float | torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    @overload
    def run(
        self,
        group: AttentionGroup,
        q: torch.Tensor,
        k_new: torch.Tensor | None,
        v_new: torch.Tensor | None,
        kv_cache: torch.Tensor | None,
        *,
        return_lse: Literal[True],
        sinks: torch.Tensor | None = None,
        k_scale: float | torch.Tensor | None = None,
        v_scale: float | torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def run(
        self,
        group: AttentionGroup,
        q: torch.Tensor,
        k_new: torch.Tensor | None,
        v_new: torch.Tensor | None,
        kv_cache: torch.Tensor | None,
        *,
        return_lse: bool = False,
        sinks: torch.Tensor | None = None,
        k_scale: float | torch.Tensor | None = None,
        v_scale: float | torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attention of one layer of ``group`` (see the class docstring)."""
        ...
