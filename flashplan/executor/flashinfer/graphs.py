"""CUDA-graph capture and replay on FlashInfer's graph-mode wrappers.

An engine's step loop with graphs, per bucket (:class:`GraphBucket`)::

    graph_ex = executor.for_bucket(GraphBucket.decode(batch_size=8, max_pages=256))
    graph_ex.apply(first_spec, table)                  # any batch that fits the bucket
    step = capture(graph_ex, lambda: model_forward(graph_ex, static_inputs))
    ...
    # every step: fill the static inputs, then
    step.replay(spec, table)                           # replay planning + graph replay

A graph executor is a :class:`~flashplan.executor.flashinfer.FlashInferExecutor` over
the bucket's fixed buffers (:class:`~flashplan.executor.flashinfer.graph_buffers.GraphBuffers`):
every buffer the graph reads — page ids, indptrs, last-page lengths, write slots — has a
fixed address and a size fixed by the bucket. Its ``apply`` is the replay planning: it
runs outside the graph, pads the batch to the bucket (padding requests read one dummy
page and write nowhere), fills the fixed buffers in place (no allocation, no sync) and
plans FlashInfer wrappers made with ``use_cuda_graph=True``. Its ``run`` takes the
bucket's shapes: ``q`` of ``bucket.total_q`` rows, whose padding rows' outputs are to
be ignored. ``graph_executor(executor, bucket)`` is the same as
``executor.for_bucket(bucket)``.

Only paged paths replay — decode, extends with a fixed token count per request (draft
extend) and target verify (:meth:`GraphBucket.verify`: each masked group's tree mask is
built into a fixed buffer the graph-mode prefill wrapper was made with): FlashInfer's
graph plans must keep their launch configuration between replays, which holds for a
fixed batch size and row capacity (see ``docs/guide-cuda-graphs.md``). A multi-step
draft decode replays as one graph too: ``apply_steps`` plans every step into its own
fixed buffers with one staging copy and one gather launch, and
``step.replay(specs, table)`` takes the steps' plans.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

import attrs
import torch

from flashplan.errors import PlanMismatchError, RunTypeError
from flashplan.executor.flashinfer.bucket import GraphBucket
from flashplan.executor.flashinfer.executor import FlashInferExecutor
from flashplan.executor.flashinfer.graph_buffers import GraphBuffers
from flashplan.layout.page_table import PageTable
from flashplan.planning.spec import PlanSpec

__all__ = ["CapturedStep", "capture", "graph_executor"]

T = TypeVar("T")


def graph_executor(parent: FlashInferExecutor, bucket: GraphBucket) -> FlashInferExecutor:
    """The CUDA-graph executor of ``bucket`` made from ``parent``: the same as
    ``parent.for_bucket(bucket)`` (see :meth:`FlashInferExecutor.for_bucket` and the
    module docstring). It shares ``parent``'s device, policy, workspace and page map.
    The first ``apply`` fixes the plan key (groups, paths, heads) the graph is captured
    for; later applies must have it.

    Raises:
        PlanMismatchError: ``parent`` is not a :class:`FlashInferExecutor` or ``bucket``
            not a :class:`GraphBucket`.
        UnsupportedError: ``parent`` runs in ``check_pages`` mode, whose checks read back
            from the device, which a captured graph cannot do: capture from an executor
            in the default mode (bad ids are then neutralised and counted).
    """
    if not isinstance(parent, FlashInferExecutor):
        raise RunTypeError("parent", "expected a FlashInferExecutor", type=type(parent).__name__)
    return parent.for_bucket(bucket)


@attrs.define(eq=False)
class CapturedStep(Generic[T]):
    """A captured CUDA graph, its executor and the forward's outputs.

    Attributes:
        executor: the graph executor (``executor.bucket`` set) the graph reads.
        graph: the ``torch.cuda.CUDAGraph``.
        output: what the captured forward returned: static tensors that each replay
            overwrites (rows of padding requests hold garbage).
    """

    executor: FlashInferExecutor
    graph: torch.cuda.CUDAGraph
    output: T

    def replay(
        self,
        spec: PlanSpec | tuple[PlanSpec, ...] | list[PlanSpec] | None = None,
        table: PageTable | None = None,
    ) -> T:
        """Plan ``spec`` on ``table`` (when given) into the fixed buffers, then replay.

        ``spec`` may be a sequence of plans: the steps of a multi-step draft decode,
        applied with ``apply_steps``. Returns :attr:`output`, valid once the replay's
        kernels have run.
        """
        if (spec is None) != (table is None):
            raise PlanMismatchError("table", "replay() takes both spec and table, or neither")
        if spec is not None and table is not None:
            if isinstance(spec, (tuple, list)):
                self.executor.apply_steps(spec, table)
            else:
                self.executor.apply(spec, table)
        self.graph.replay()
        return self.output


def capture(
    executor: FlashInferExecutor,
    forward: Callable[[], T],
    *,
    warmup: int = 1,
    pool: Any = None,
) -> CapturedStep[T]:
    """Capture ``forward`` (which calls ``executor.run``) into a CUDA graph.

    The executor must be a bucket's graph executor, applied with a batch that fits
    the bucket. ``forward`` runs ``warmup`` times eagerly on a side stream first (module
    loading, autotuning, allocations), then once under capture.

    With a bound page table (:meth:`FlashInferExecutor.bind_page_table`, before the
    capture) the graph also replays the page gather and the refresh of the decode
    wrappers' fixed indptrs, which later applies then leave to it (unless a group has
    a custom mask, whose launch size changes with the batch).

    Args:
        executor: the bucket's graph executor (:meth:`FlashInferExecutor.for_bucket`).
        forward: the step to capture: reads static input tensors, returns outputs.
        warmup: eager runs before capture.
        pool: a memory pool handle to share between graphs (``torch.cuda.graph_pool_handle()``).
    """
    if not isinstance(executor, FlashInferExecutor) or executor.bucket is None:
        raise PlanMismatchError(
            "executor",
            "capture() needs a graph executor: executor.for_bucket(bucket)",
            type=type(executor).__name__,
        )
    if executor.spec is None:
        raise PlanMismatchError("executor", "apply a plan to the graph executor before capture()")
    current = torch.cuda.current_stream(executor.device)
    side = torch.cuda.Stream(executor.device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        for _ in range(warmup):
            forward()
    current.wait_stream(side)
    buffers = executor._buffers  # the bucket's GraphBuffers
    assert isinstance(buffers, GraphBuffers)
    work = buffers.capturable_work()  # with a bound page table: the gather, in the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        if work is not None:
            work.record()
        output = forward()
    buffers.captured = work
    return CapturedStep(executor, graph, output)
