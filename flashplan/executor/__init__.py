"""Executors: apply a `PlanSpec` and run attention.

`ReferenceExecutor` (plain torch, any device) is always available;
`flashplan.executor.flashinfer.FlashInferExecutor` needs CUDA and flashinfer-python.
Both satisfy the :class:`Executor` protocol.
"""

from flashplan.executor.protocol import Executor
from flashplan.executor.reference import ReferenceExecutor

__all__ = ["Executor", "ReferenceExecutor"]
