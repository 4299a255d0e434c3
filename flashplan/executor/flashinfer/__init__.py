"""FlashInfer executor, on FlashInfer's public API: the pure translation of a plan into
call records (``call_types``, ``calls``, ``names``, ``staging``, ``bucket``, ``policy``),
the stateful executor (``executor``, ``buffers``) and CUDA-graph buckets (``graphs``).

Everything imports on any machine. :class:`FlashInferExecutor` runs on CUDA with
flashinfer-python, or anywhere over the CPU twin (``flashinfer=flashplan.twin.flashinfer_twin``).
"""

from flashplan.executor.flashinfer.bucket import GraphBucket
from flashplan.executor.flashinfer.calls import translate
from flashplan.executor.flashinfer.executor import DEFAULT_WORKSPACE_BYTES, FlashInferExecutor
from flashplan.executor.flashinfer.graphs import CapturedStep, capture, graph_executor
from flashplan.executor.flashinfer.policy import ExecutorPolicy

# what a user calls; the translation records stay importable from their modules
__all__ = [
    "DEFAULT_WORKSPACE_BYTES", "CapturedStep", "ExecutorPolicy", "FlashInferExecutor",
    "GraphBucket", "capture", "graph_executor", "translate",
]  # fmt: skip
