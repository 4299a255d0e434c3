"""FlashInfer executor: pure call translation, staging layout, policy, and the stateful
executor.

``calls``, ``staging``, ``bucket`` and ``policy`` are pure and, like ``adapter`` (the only
code touching FlashInfer's and Triton's private API, and its version table), import on any
machine; constructing :class:`FlashInferExecutor` (or a CUDA-graph :class:`GraphExecutor`)
needs CUDA and flashinfer-python.
"""

from flashplan.executor.flashinfer.bucket import GraphBucket, check_fits
from flashplan.executor.flashinfer.calls import (
    BuiltMask,
    CallInputs,
    DeviceIndices,
    GroupCalls,
    HostArray,
    MaskRecipe,
    PlanCall,
    Translation,
    WrapperKey,
    WrapperKind,
    translate,
)
from flashplan.executor.flashinfer.executor import DEFAULT_WORKSPACE_BYTES, FlashInferExecutor
from flashplan.executor.flashinfer.graphs import CapturedStep, GraphExecutor, capture
from flashplan.executor.flashinfer.policy import ExecutorPolicy
from flashplan.executor.flashinfer.staging import DevicePlan, StagingManifest, device_plan

__all__ = [
    "DEFAULT_WORKSPACE_BYTES",
    "BuiltMask",
    "CallInputs",
    "CapturedStep",
    "DeviceIndices",
    "DevicePlan",
    "ExecutorPolicy",
    "FlashInferExecutor",
    "GraphBucket",
    "GraphExecutor",
    "GroupCalls",
    "HostArray",
    "MaskRecipe",
    "PlanCall",
    "StagingManifest",
    "Translation",
    "WrapperKey",
    "WrapperKind",
    "capture",
    "check_fits",
    "device_plan",
    "translate",
]
