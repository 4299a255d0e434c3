"""FlashInfer executor: pure call translation, policy, and the stateful executor.

``calls`` and ``policy`` are pure and import on any machine; constructing
:class:`FlashInferExecutor` needs CUDA and flashinfer-python.
"""

from flashplan.executor.flashinfer.calls import (
    GatheredIndices,
    GroupCalls,
    HostArray,
    PlanCall,
    WrapperKey,
    WrapperKind,
    translate,
)
from flashplan.executor.flashinfer.executor import FlashInferExecutor
from flashplan.executor.flashinfer.policy import ExecutorPolicy

__all__ = [
    "ExecutorPolicy",
    "FlashInferExecutor",
    "GatheredIndices",
    "GroupCalls",
    "HostArray",
    "PlanCall",
    "WrapperKey",
    "WrapperKind",
    "translate",
]
