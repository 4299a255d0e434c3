"""CUDA-graph capture and replay on FlashInfer's graph-mode wrappers.

An engine's step loop with graphs, per bucket (:class:`GraphBucket`)::

    graph_ex = GraphExecutor(executor, GraphBucket.decode(batch_size=8, max_pages=256))
    graph_ex.apply(first_spec, table)                  # any batch that fits the bucket
    step = capture(graph_ex, lambda: model_forward(graph_ex, static_inputs))
    ...
    # every step: fill the static inputs, then
    step.replay(spec, table)                           # replay planning + graph replay

:class:`GraphExecutor` is an :class:`~flashplan.Executor` whose every buffer the
graph reads — page ids, indptrs, last-page lengths, write slots — has a fixed address
and a size fixed by the bucket. Its ``apply`` is the replay planning: it runs outside
the graph, pads the batch to the bucket (padding requests read one dummy page and
write nowhere), fills the fixed buffers in place (no allocation, no sync) and calls
FlashInfer's ``plan()`` on wrappers made with ``use_cuda_graph=True``. Its ``run``
takes the bucket's shapes: ``q`` of ``bucket.total_q`` rows, whose padding rows'
outputs are to be ignored.

Only paged paths replay — decode, extends with a fixed token count per request (draft
extend) and target verify (:meth:`GraphBucket.verify`: each masked group's tree mask is
built into a fixed buffer the graph-mode prefill wrapper was made with): FlashInfer's
graph plans must keep their launch configuration between replays, which holds for a
fixed batch size and row capacity (see ``docs/guide-cuda-graphs.md``). A multi-step
draft decode replays as one graph too: :meth:`GraphExecutor.apply_steps` plans every
step into its own fixed buffers with one staging copy and one gather launch, and
``step.replay(specs, table)`` takes the steps' plans.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

import attrs
import torch

from flashplan.arrays import INT32_MAX, IntArray
from flashplan.errors import BucketError, PlanMismatchError, UnsupportedError
from flashplan.executor.checks import RunArgs, check_run_args
from flashplan.executor.flashinfer.bucket import (
    BucketLayout,
    GraphBucket,
    bucket_jobs,
    check_fits,
    padded_inputs,
    padded_masks,
)
from flashplan.executor.flashinfer.buffers import WrapperSlot
from flashplan.executor.flashinfer.calls import (
    GroupCalls,
    MaskRecipe,
    WrapperKey,
    WrapperKind,
    call_inputs,
    call_skeleton,
    skeleton_key,
)
from flashplan.executor.flashinfer.executor import FlashInferExecutor
from flashplan.executor.flashinfer.staging import DevicePlan, device_plan
from flashplan.executor.gathers import GatherJobs, concat_jobs, gather_jobs, pages_region
from flashplan.layout.page_table import PageTable
from flashplan.planning.spec import PlanKey, PlanSpec

__all__ = ["CapturedStep", "GraphExecutor", "capture"]

T = TypeVar("T")


class GraphExecutor(FlashInferExecutor):
    """A :class:`FlashInferExecutor` for one CUDA-graph bucket (see module docstring).

    Made from an eager executor, ``GraphExecutor(executor, bucket)``; it shares its device, policy,
    workspace, page map and checked mode. The first ``apply`` fixes the plan key
    (groups, paths, heads) the graph is captured for; later applies must have it.

    Raises:
        UnsupportedError: ``parent`` runs in ``check_pages`` mode, whose checks read back
            from the device, which a captured graph cannot do: capture from an executor
            in the default mode (bad ids are then neutralised and counted).
        BucketError: (``apply``) a plan that does not fit the bucket.
    """

    def __init__(self, parent: FlashInferExecutor, bucket: GraphBucket) -> None:
        if not isinstance(bucket, GraphBucket):
            raise PlanMismatchError("bucket", "expected a GraphBucket", type=type(bucket).__name__)
        if not isinstance(parent, FlashInferExecutor):
            raise PlanMismatchError(
                "parent", "expected a FlashInferExecutor", type=type(parent).__name__
            )
        if parent.check_pages:
            raise UnsupportedError(
                "check_pages",
                "check_pages=True reads back from the device on every apply and run, which "
                "a captured CUDA graph cannot do: make the GraphExecutor from an executor "
                "in the default mode (bad page ids are neutralised and counted in "
                "page_errors())",
            )
        self.device = parent.device
        self._fi = parent._fi
        self.policy = parent.policy
        self.workspace_bytes = parent.workspace_bytes
        self.check_pages = parent.check_pages
        self.fast_plan = parent.fast_plan
        self._fast_decode = parent._fast_decode
        self._fast_prefill = False  # graph-mode prefill wrappers always go through plan()
        self.page_map = parent.page_map
        self._workspace = parent._workspace
        self._init_state()
        self.bucket = bucket
        self._key: PlanKey | None = None
        self._layout: BucketLayout | None = None
        self._fixed_page: torch.Tensor | None = None
        self._fixed_offset: torch.Tensor | None = None
        self._steps: int | None = None  # steps per apply, fixed by the first one
        self._masked: tuple[bool, ...] | None = None  # groups with a tree mask, fixed too
        self._fixed_masks: dict[int, torch.Tensor] = {}

    # -- fixed buffers ------------------------------------------------------------------
    def _bucket_layout(self, spec: PlanSpec) -> BucketLayout:
        """The fixed regions for ``spec``'s key (the key of the first applied plan)."""
        if self._key is None:
            return self.bucket.layout(spec.key, window_pool=self.page_map is not None)
        if spec.key != self._key:
            raise PlanMismatchError(
                "spec", "a graph executor runs plans of the key it was first applied with "
                "(groups, paths, heads)", key=spec.key, fixed=self._key,
            )  # fmt: skip
        assert self._layout is not None
        return self._layout

    def _check_steps(self, steps: int) -> None:
        """A graph's fixed buffers hold the steps of its first apply: one for ``apply``,
        ``len(specs)`` for ``apply_steps``."""
        if self._steps is not None and steps != self._steps:
            raise PlanMismatchError(
                "specs",
                f"this graph executor was first applied with {self._steps} step(s) per apply "
                f"(its fixed buffers hold that many); got {steps}: use one graph executor "
                "per number of steps",
            )

    def _check_masks(self, calls: tuple[GroupCalls, ...], page_size: int) -> None:
        """The groups with a custom mask are part of a graph's shape: its kernels were
        captured with or without one."""
        masked = tuple(gc.masked for gc in calls)
        if self._masked is not None and masked != self._masked:
            raise PlanMismatchError(
                "spec",
                "this graph executor was first applied with custom masks on the groups "
                f"{self._masked} (a tree verify has one, a chain verify none); got {masked}: "
                "use one graph executor for trees and another for chains",
            )
        if any(masked):
            capacity = self.bucket.mask_bytes(page_size)
            if capacity > INT32_MAX:
                raise BucketError(
                    "max_pages",
                    "the bucket's fixed mask buffer would exceed FlashInfer's int32 mask "
                    "offsets (batch_size * tokens_per_request * max_pages * page_size)",
                    mask_bytes=capacity,
                )

    def _fix_key(
        self,
        key: PlanKey,
        layout: BucketLayout,
        calls: tuple[GroupCalls, ...],
        steps: int = 1,
    ) -> None:
        """Fix the key, the masked groups and the steps per apply, and allocate the fixed
        buffers (first successful plan only): ``steps`` copies of ``layout``, end to end,
        and a fixed mask buffer per masked group."""
        if self._key is not None:
            return
        self._key, self._layout, self._steps = key, layout, steps
        self._masked = tuple(gc.masked for gc in calls)
        total = layout.total * steps
        self._fixed_page = torch.zeros(total, dtype=torch.int32, device=self.device)
        self._fixed_offset = torch.full((total,), -1, dtype=torch.int32, device=self.device)
        size = self.bucket.mask_bytes(key.page_size)
        for gc in calls:
            if gc.masked:
                self._fixed_masks[gc.group_index] = torch.zeros(
                    size, dtype=torch.uint8, device=self.device
                )

    def _mask_out(self, group_index: int, size: int) -> torch.Tensor:
        fixed = self._fixed_masks[group_index]
        if size > fixed.shape[0]:  # check_fits bounds every mask: never reached
            raise BucketError(
                "max_pages", "a mask larger than the bucket's fixed mask buffer",
                group=group_index, mask_bytes=size, capacity=int(fixed.shape[0]),
            )  # fmt: skip
        return fixed[:size]

    def _gather_out(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert self._fixed_page is not None and self._fixed_offset is not None
        return self._fixed_page, self._fixed_offset

    def _skeleton(self, spec: PlanSpec) -> tuple[GroupCalls, ...]:
        key = ("graph", skeleton_key(spec, self.policy, self.bucket.batch_size))
        calls = self._skeletons.get(key)
        if calls is None:
            calls = _graph_skeleton(spec, self)
            self._skeletons[key] = calls
        return calls

    def _bucket_parts(
        self, spec: PlanSpec, calls: tuple[GroupCalls, ...], table: PageTable
    ) -> tuple[BucketLayout, GatherJobs, dict[str, IntArray], dict[int, MaskRecipe]]:
        """``spec``'s jobs in the bucket's fixed regions, its padded ``plan()`` arrays and
        its padded masks' sizes."""
        layout = self._bucket_layout(spec)
        self._check_masks(calls, spec.page_size)
        inputs = call_inputs(spec, calls)
        jobs = gather_jobs(
            spec,
            table.rows,
            window_pool=self.page_map is not None,
            spans=inputs.spans,
            encoder_writes=False,
        )
        fixed = bucket_jobs(jobs, layout, spec.batch_size, self.bucket)
        host = padded_inputs(inputs.host, spec.batch_size, self.bucket)
        return layout, fixed, host, padded_masks(inputs.masks, spec.batch_size, self.bucket)

    def _device_plan(
        self, spec: PlanSpec, calls: tuple[GroupCalls, ...], table: PageTable
    ) -> DevicePlan:
        self._check_steps(1)
        layout, fixed, host, masks = self._bucket_parts(spec, calls, table)
        dplan = device_plan(calls, fixed, host, masks)
        self._fix_key(spec.key, layout, calls)  # nothing above refused the plan
        return dplan

    #: The graph reads one wrapper per key: wait rather than make another.
    _grow_wrappers = False
    _graph_wrappers = True

    def _make_wrapper(self, key: WrapperKey, group_index: int, prefix: str = "") -> WrapperSlot:
        assert self._layout is not None and self._fixed_page is not None
        bs = self.bucket.batch_size
        dev = self.device

        def ints(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int32, device=dev)

        cls = getattr(self._fi, key.class_name)
        kwargs = key.constructor_kwargs()
        if key.kind is WrapperKind.RAGGED_PREFILL:  # pragma: no cover - refused by check_fits
            raise PlanMismatchError("paths", "CUDA-graph buckets run paged paths only")
        r = self._layout.region(pages_region(group_index))
        base = self._layout.total * _step_of(prefix)  # step k's regions: k layouts on
        indices = self._fixed_page[base + r.lo : base + r.hi]
        if key.kind is WrapperKind.DECODE:
            fixed = {"indptr": ints(bs + 1), "last_page_len": ints(bs)}
            wrapper = cls(
                self._workspace,
                use_cuda_graph=True,
                paged_kv_indptr_buffer=fixed["indptr"],
                paged_kv_indices_buffer=indices,
                paged_kv_last_page_len_buffer=fixed["last_page_len"],
                **kwargs,
            )
            return WrapperSlot(wrapper, fixed=fixed)
        mask = self._fixed_masks.get(group_index)
        if mask is not None:  # FlashInfer's plan() copies the built mask onto itself
            kwargs["custom_mask_buf"] = mask
            kwargs["mask_indptr_buf"] = ints(bs + 1)
        if key.sink is None:  # (FlashInfer's sink prefill wrapper takes no such bound)
            kwargs["max_total_num_rows"] = self.bucket.total_q
        wrapper = cls(
            self._workspace,
            use_cuda_graph=True,
            qo_indptr_buf=ints(bs + 1),
            paged_kv_indptr_buf=ints(bs + 1),
            paged_kv_indices_buf=indices,
            paged_kv_last_page_len_buf=ints(bs),
            **kwargs,
        )
        return WrapperSlot(wrapper)

    # -- apply / run --------------------------------------------------------------------
    def apply(self, spec: PlanSpec, table: PageTable) -> None:
        """Replay planning: pad ``spec`` to the bucket and refill the graph's fixed
        buffers in place; sync-free (unless ``check_pages``).

        Raises:
            BucketError: the plan does not fit the bucket.
            PlanMismatchError: the plan's key differs from the first one applied.
            (and everything :meth:`FlashInferExecutor.apply` raises)
        """
        if isinstance(spec, PlanSpec):
            check_fits(spec, self.bucket)
        super().apply(spec, table)

    def apply_steps(
        self, specs: tuple[PlanSpec, ...] | list[PlanSpec], table: PageTable
    ) -> tuple[FlashInferExecutor, ...]:
        """Replay planning of a multi-step draft decode: every step at once (one staging
        copy, one gather launch, one ``plan()`` per step and group), each step into its
        own fixed buffers and wrappers; sync-free.

        Each step's plan is a decode of the bucket's shape (``batch_size * topk``
        branches: :func:`flashplan.plan_steps`); the first ``apply_steps`` fixes the number
        of steps, like the key. Returns one executor per step, as
        :meth:`FlashInferExecutor.apply_steps`: capture a forward that runs
        ``views[s].run(...)`` for every step, then per round
        ``step.replay(specs, table)``. This executor itself runs step 0.

        Raises:
            BucketError: a step's plan does not fit the bucket.
            PlanMismatchError: no plan, a key or number of steps other than the first
                apply's, or (as :meth:`apply`) a wrong record.
            PageTableError: as :meth:`FlashInferExecutor.apply`.
        """
        specs = tuple(specs)
        if specs:
            self._check_steps(len(specs))
        for spec in specs:
            if isinstance(spec, PlanSpec):
                check_fits(spec, self.bucket)
        views = super().apply_steps(specs, table)
        first = views[0]
        self._spec, self._table, self._planned = first._spec, first._table, first._planned
        self._plan, self._gathered = first._plan, first._gathered
        self._positions = None
        return views

    def _steps_device_plan(
        self,
        steps: list[tuple[PlanSpec, tuple[GroupCalls, ...]]],
        table: PageTable,
        prefixes: list[str],
    ) -> DevicePlan:
        """Each step's jobs in its own copy of the bucket's fixed regions (step ``k``
        ``k`` layouts on) and its padded ``plan()`` arrays; fixes the key and the number
        of steps on the first apply."""
        parts = [self._bucket_parts(spec, calls, table) for spec, calls in steps]
        combined = concat_jobs([jobs for _, jobs, _, _ in parts], prefixes)
        host = {
            p + name: a
            for p, (_, _, arrays, _) in zip(prefixes, parts, strict=True)
            for name, a in arrays.items()
        }
        dplan = device_plan((), combined, host, {})
        self._fix_key(steps[0][0].key, parts[0][0], steps[0][1], len(steps))
        return dplan

    def _check_run(
        self,
        group: object,
        q: object,
        k_new: object,
        v_new: object,
        kv_cache: object,
        return_lse: object,
        sinks: object = None,
    ) -> RunArgs:
        args = check_run_args(
            self._spec, self.device, group, q, k_new, v_new, kv_cache, return_lse,
            total_q=self.bucket.total_q, sinks=sinks,
        )  # fmt: skip
        if args.writes and args.plan.group.cross_attention:
            raise PlanMismatchError(
                "k_new",
                "a CUDA-graph bucket writes no encoder K/V: write them in an eager step "
                "and pass k_new=v_new=None for cross groups in the graph",
            )
        return args


def _step_of(prefix: str) -> int:
    """The step index of a multi-step name prefix (``"s3/"`` -> 3; ``""`` -> 0)."""
    return int(prefix[1:-1]) if prefix else 0


def _graph_skeleton(spec: PlanSpec, ex: GraphExecutor) -> tuple[GroupCalls, ...]:
    """The eager skeleton with the graph's batch size deciding the decode kernel, and
    FA2 prefill (the backend FlashInfer's graph plans are checked with)."""
    policy = attrs.evolve(ex.policy, prefill_backend="fa2")
    return call_skeleton(spec, policy, sm90=ex.sm90, batch_size=ex.bucket.batch_size)


@attrs.define(eq=False)
class CapturedStep(Generic[T]):
    """A captured CUDA graph, its executor and the forward's outputs.

    Attributes:
        executor: the :class:`GraphExecutor` the graph reads.
        graph: the ``torch.cuda.CUDAGraph``.
        output: what the captured forward returned: static tensors that each replay
            overwrites (rows of padding requests hold garbage).
    """

    executor: GraphExecutor
    graph: torch.cuda.CUDAGraph
    output: T

    def replay(
        self,
        spec: PlanSpec | tuple[PlanSpec, ...] | list[PlanSpec] | None = None,
        table: PageTable | None = None,
    ) -> T:
        """Plan ``spec`` on ``table`` (when given) into the fixed buffers, then replay.

        ``spec`` may be a sequence of plans: the steps of a multi-step draft decode,
        applied with :meth:`GraphExecutor.apply_steps`. Returns :attr:`output`, valid
        once the replay's kernels have run.
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
    executor: GraphExecutor,
    forward: Callable[[], T],
    *,
    warmup: int = 1,
    pool: Any = None,
) -> CapturedStep[T]:
    """Capture ``forward`` (which calls ``executor.run``) into a CUDA graph.

    The executor must have been applied with a batch that fits its bucket. ``forward``
    runs ``warmup`` times eagerly on a side stream first (module loading, autotuning,
    allocations), then once under capture.

    Args:
        executor: the bucket's graph executor.
        forward: the step to capture: reads static input tensors, returns outputs.
        warmup: eager runs before capture.
        pool: a memory pool handle to share between graphs (``torch.cuda.graph_pool_handle()``).
    """
    if not isinstance(executor, GraphExecutor):
        raise PlanMismatchError(
            "executor",
            "capture() needs a GraphExecutor(executor, bucket)",
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
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = forward()
    return CapturedStep(executor, graph, output)
