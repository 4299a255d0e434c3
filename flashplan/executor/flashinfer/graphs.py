"""CUDA-graph buckets on FlashInfer's graph-mode wrappers: capture and replay, per
bucket (:class:`GraphBucket`)::

    graph_ex = executor.for_bucket(GraphBucket.decode(batch_size=8, max_pages=256))
    graph_ex.apply(first_spec, table)                  # any batch that fits the bucket
    step = capture(graph_ex, lambda: model_forward(graph_ex, static_inputs))
    step.replay(spec, table)                           # every step: plan, then replay

A graph executor pads each batch to the bucket in fixed buffers (:class:`~.buffers.GraphBuffers`);
its ``run`` takes ``bucket.total_q`` query rows. Over the CPU twin, ``replay`` is eager.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import attrs
import torch

from flashplan.errors import PlanMismatchError, RunTypeError
from flashplan.executor.flashinfer.bucket import GraphBucket
from flashplan.executor.flashinfer.executor import FlashInferExecutor

if TYPE_CHECKING:
    from flashplan.layout.page_table import PageTable
    from flashplan.planning.spec import PlanSpec

__all__ = ["CapturedStep", "capture", "graph_executor"]

T = TypeVar("T")


def graph_executor(parent: FlashInferExecutor, bucket: GraphBucket) -> FlashInferExecutor:
    """``parent.for_bucket(bucket)``: the CUDA-graph executor of ``bucket``; its first
    ``apply`` fixes the plan key the graph is for.

    Raises:
        RunTypeError: ``parent`` or ``bucket`` is not what the signature says.
        UnsupportedError: ``parent`` runs in ``check_pages`` mode.
    """
    if not isinstance(parent, FlashInferExecutor):
        raise RunTypeError("parent", "expected a FlashInferExecutor", type=type(parent).__name__)
    return parent.for_bucket(bucket)


@attrs.define(eq=False)
class CapturedStep(Generic[T]):
    """A captured step: its graph executor, the CUDA graph (``None`` over the CPU twin:
    replays run ``forward`` eagerly) and the forward's outputs (static tensors each
    replay overwrites; padding rows hold garbage)."""

    executor: FlashInferExecutor
    graph: torch.cuda.CUDAGraph | None
    output: T
    forward: Callable[[], T]

    def replay(
        self, spec: PlanSpec | tuple[PlanSpec, ...] | list[PlanSpec] | None = None,
        table: PageTable | None = None,
    ) -> T:  # fmt: skip
        """Plan ``spec`` on ``table`` (when given; a sequence of plans: the steps of a
        multi-step draft, through ``apply_steps``) into the fixed buffers, then replay.
        Returns :attr:`output`, valid once the replay's kernels have run."""
        if (spec is None) != (table is None):
            raise PlanMismatchError("table", "replay() takes both spec and table, or neither")
        if spec is not None and table is not None:
            if isinstance(spec, (tuple, list)):
                self.executor.apply_steps(spec, table)
            else:
                self.executor.apply(spec, table)
        if self.graph is None:
            self.output = self.forward()
        else:
            self.graph.replay()
        return self.output


def capture(
    executor: FlashInferExecutor, forward: Callable[[], T], *, warmup: int = 1, pool: Any = None
) -> CapturedStep[T]:
    """Capture ``forward`` (which calls ``executor.run``, ``executor`` a graph executor
    with a plan applied) into a CUDA graph, after ``warmup`` eager runs on a side stream.
    ``pool``: a memory pool to share between graphs (``torch.cuda.graph_pool_handle()``).
    """
    if not isinstance(executor, FlashInferExecutor) or executor.bucket is None:
        raise PlanMismatchError(
            "executor", "capture() needs a graph executor: executor.for_bucket(bucket)",
            type=type(executor).__name__,
        )  # fmt: skip
    if executor.spec is None:
        raise PlanMismatchError("executor", "apply a plan to the graph executor before capture()")
    if executor._settings.twin:  # the twin's kernels are host code: replays run eagerly
        return CapturedStep(executor, None, forward(), forward)
    current = torch.cuda.current_stream(executor.device)
    side = torch.cuda.Stream(executor.device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        for _ in range(warmup):
            forward()
    current.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = forward()
    return CapturedStep(executor, graph, output, forward)
