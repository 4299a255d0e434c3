"""FlashInfer executor: pure call translation, staging layout, policy, and the stateful
executor.

``calls``, ``staging``, ``bucket`` and ``policy`` are pure and, like ``adapter`` (the only
code touching FlashInfer's and Triton's private API, and its version table), import on any
machine; constructing :class:`FlashInferExecutor` (or a CUDA-graph :class:`graph_executor`)
needs CUDA and flashinfer-python.
"""

from flashplan.executor.flashinfer.bucket import GraphBucket
from flashplan.executor.flashinfer.calls import translate
from flashplan.executor.flashinfer.executor import DEFAULT_WORKSPACE_BYTES, FlashInferExecutor
from flashplan.executor.flashinfer.graphs import CapturedStep, capture, graph_executor
from flashplan.executor.flashinfer.policy import ExecutorPolicy

# What a user calls. The translation records (calls, call_types), the staging layout
# (staging) and the bucket checks (bucket.check_fits) are importable from their modules;
# they are the executor's own vocabulary, not part of the package's surface.
__all__ = [
    "DEFAULT_WORKSPACE_BYTES",
    "CapturedStep",
    "ExecutorPolicy",
    "FlashInferExecutor",
    "GraphBucket",
    "capture",
    "graph_executor",
    "translate",
]
