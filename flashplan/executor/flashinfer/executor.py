"""`FlashInferExecutor`: applies a `PlanSpec` to FlashInfer wrappers and runs kernels.

The thin stateful part of flashplan: a facade over parts, each a module of its own.

* :mod:`~.settings`: the construction arguments, checked (one frozen record);
* a **buffers strategy** (:mod:`~.strategy`): :class:`~.eager.EagerBuffers`, or the
  fixed buffers of a CUDA-graph bucket (:class:`~.graph_buffers.GraphBuffers`,
  :meth:`FlashInferExecutor.for_bucket`), which owns every buffer and cache;
* the pure translation (:mod:`~.calls`, :mod:`~.staging`);
* the device work (:mod:`~.device_work`), the wrapper planning (:mod:`~.wrapper_plans`),
  the checked mode (:mod:`~.checked`) and the run (:mod:`~.running`).

``apply(spec, table)`` reads as its steps:

1. **translate** the plan (the call skeleton is kept per static key) and lay out the
   device work (pure);
2. **stage**: every int32 host array of the batch goes into one pinned slot of a ring
   that is never overwritten while a queued copy may read it, then **one copy** into a
   persistent device buffer;
3. **one launch**: every group's page ids and every write slot (through the
   sliding-window page map where a windowed group needs it), and the first masked
   group's custom mask built on the device;
4. (``check_pages`` mode only) the gathered ids are read back and checked;
5. **plan the wrappers** with pinned host indptrs (FlashInfer never reads back from
   the device), through the compiled scheduler where a wrapper's last ``plan()`` had
   the same constants.

``run(group, q, k_new, v_new, kv_cache)`` writes the new K/V into the cache (one
Triton launch that skips unusable slots) and runs the group's kernels; everything a
kernel compiles in (window, soft cap, scale, causal, mask, dtypes) comes from the plan
and is never overridden at run time. Nothing in apply or run waits for the GPU, except
in the opt-in ``check_pages`` mode.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, overload

import torch

import flashplan.executor.flashinfer.names as names
from flashplan.errors import PageTableError, PlanMismatchError, UnsupportedError
from flashplan.executor.checks import check_apply_args, check_run_args
from flashplan.executor.flashinfer.applied import AppliedBatch, level_rows
from flashplan.executor.flashinfer.bound_table import bound_table
from flashplan.executor.flashinfer.calls import GroupCalls, check_runnable
from flashplan.executor.flashinfer.checked import check_cache_pages, check_gathered
from flashplan.executor.flashinfer.device_work import fill_positions, gather_and_mask, stage
from flashplan.executor.flashinfer.eager import EagerBuffers
from flashplan.executor.flashinfer.graph_buffers import GraphBuffers
from flashplan.executor.flashinfer.running import run_group
from flashplan.executor.flashinfer.settings import DEFAULT_WORKSPACE_BYTES, ExecutorSettings
from flashplan.executor.flashinfer.staging import DevicePlan
from flashplan.executor.flashinfer.streams import CurrentStream
from flashplan.executor.flashinfer.wrapper_plans import Planned, plan_calls, plan_step_calls
from flashplan.kernels.gather import NO_BAD_JOB
from flashplan.layout.group import AttentionGroup
from flashplan.planning.spec import KernelPath, PlanSpec

if TYPE_CHECKING:
    from flashplan.executor.flashinfer.bucket import GraphBucket
    from flashplan.executor.flashinfer.policy import ExecutorPolicy
    from flashplan.executor.flashinfer.strategy import BuffersStrategy
    from flashplan.layout.page_table import PageTable

__all__ = ["DEFAULT_WORKSPACE_BYTES", "FlashInferExecutor"]


class FlashInferExecutor:
    """Runs plans (:class:`~flashplan.PlanSpec`) on FlashInfer kernels (CUDA).

    Same contract as :class:`~flashplan.ReferenceExecutor` (the
    :class:`~flashplan.Executor` protocol): ``apply(spec, table)`` once per batch, then
    ``run(group, q, k_new, v_new, kv_cache)`` per layer, all on one CUDA stream.
    :meth:`for_bucket` makes the CUDA-graph executor of a bucket from this one.

    **Bad page ids.** By default nothing waits for the GPU, so page ids are checked on
    the device: an id below 0, at or beyond ``table.num_pages`` (when the table says
    it), or evicted from the window pool is never used — reads go to page 0 instead,
    writes are skipped, and writes to a page beyond the cache are skipped too — and
    each such id is counted in :meth:`page_errors`, which an engine may read whenever
    it syncs anyway. With ``check_pages=True`` every apply and run instead checks the
    ids and the write slots at once and raises :class:`~flashplan.PageTableError`
    naming the request: that mode reads back from the device (a sync per call).

    Args:
        device: the CUDA device of the KV cache (default: the current device).
        policy: kernel choices (:class:`ExecutorPolicy`; defaults measured on H200).
        workspace_bytes: size of the float workspace all wrappers share
            (:data:`DEFAULT_WORKSPACE_BYTES`). A plan that needs more makes ``apply``
            raise :class:`~flashplan.UnsupportedError` naming this argument.
        page_map: optional int32 device tensor mapping full-pool page ids to the
            page ids of a separate sliding-window KV pool (a negative entry marks an
            evicted page); windowed groups' page ids and write slots go through it.
        check_pages: the checked mode above.
        fast_plan: re-plan a wrapper whose last ``plan()`` had the same constant
            arguments without ``plan()``'s argument checks, host metadata and copies
            (flashplan has staged the arrays already): a decode wrapper or an eager
            FA2 paged prefill wrapper by running FlashInfer's compiled scheduler directly
            (:mod:`~flashplan.executor.flashinfer.adapter`); only with a flashinfer
            version each was checked against. ``False``: always ``plan()``.

    Raises:
        UnsupportedError: no CUDA, or ``device`` is not a CUDA device.
        OptionError: an argument of the wrong range; :class:`~flashplan.OptionTypeError`
            (also a ``TypeError``) of the wrong type.
    """

    def __init__(
        self,
        device: torch.device | str | None = None,
        *,
        policy: ExecutorPolicy | None = None,
        workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
        page_map: torch.Tensor | None = None,
        check_pages: bool = False,
        fast_plan: bool = True,
    ) -> None:
        settings = ExecutorSettings.make(
            device, policy, workspace_bytes, page_map, check_pages, fast_plan
        )
        self._assemble(settings, EagerBuffers(settings), None)

    def _assemble(
        self, settings: ExecutorSettings, buffers: BuffersStrategy, batch: AppliedBatch | None
    ) -> None:
        self._settings = settings
        self._buffers = buffers
        self._batch = batch
        self._positions: torch.Tensor | None = None  # built by positions() for _batch
        self._stream = CurrentStream(settings.device)

    @classmethod
    def _over(
        cls, settings: ExecutorSettings, buffers: BuffersStrategy, batch: AppliedBatch | None
    ) -> FlashInferExecutor:
        """An executor over these parts (a graph bucket's, or one step of a draft)."""
        executor = cls.__new__(cls)
        executor._assemble(settings, buffers, batch)
        return executor

    def for_bucket(self, bucket: GraphBucket) -> FlashInferExecutor:
        """The CUDA-graph executor of ``bucket``: the same settings and workspace, the
        bucket's fixed buffers and graph-mode wrappers
        (:mod:`~flashplan.executor.flashinfer.graphs`).

        Raises:
            PlanMismatchError: ``bucket`` is not a :class:`GraphBucket`.
            UnsupportedError: this executor runs in ``check_pages`` mode, whose checks
                read back from the device, which a captured graph cannot do.
        """
        from flashplan.executor.flashinfer.bucket import GraphBucket

        if not isinstance(bucket, GraphBucket):
            raise PlanMismatchError("bucket", "expected a GraphBucket", type=type(bucket).__name__)
        if self.check_pages:
            raise UnsupportedError(
                "check_pages",
                "check_pages=True reads back from the device on every apply and run, which "
                "a captured CUDA graph cannot do: make the graph executor from an executor "
                "in the default mode (bad page ids are neutralised and counted in "
                "page_errors())",
            )
        graph = GraphBuffers(self._settings, bucket, bound=self._buffers.bound)
        return self._over(self._settings, graph, None)

    def bind_page_table(self, pages: torch.Tensor, *, num_pages: int | None = None) -> None:
        """Bind the page table this executor takes for its life: int32
        ``[rows, max_pages]`` on its device, rewritten in place between steps. Every
        later apply must take it (``PageTable(pages, rows, num_pages)``) and graph
        executors made from this one after the call inherit it; a graph executor bound
        before :func:`~flashplan.executor.flashinfer.graphs.capture` replays the page
        gather inside its graph (:mod:`~flashplan.executor.flashinfer.bound_table`).

        Raises:
            PageTableError: not a contiguous int32 2-D tensor on this device, or a
                ``num_pages`` that is not an int ``>= 1``.
            PlanMismatchError: a graph executor already captured (its graph was
                captured without the bound table).
        """
        if self._buffers.captured is not None:
            raise PlanMismatchError("pages", "bind the page table before capture()")
        self._buffers.bound = bound_table(pages, self.device, num_pages)

    # -- settings and state ---------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """The CUDA device of the KV cache."""
        return self._settings.device

    @property
    def policy(self) -> ExecutorPolicy:
        """The kernel choices."""
        return self._settings.policy

    @property
    def page_map(self) -> torch.Tensor | None:
        """The sliding-window pool's page map (int32 device tensor), or ``None``."""
        return self._settings.page_map

    @property
    def check_pages(self) -> bool:
        """Whether every apply and run checks page ids (syncs)."""
        return self._settings.check_pages

    @property
    def fast_plan(self) -> bool:
        """Whether wrappers are re-planned through the compiled scheduler."""
        return self._settings.fast_plan

    @property
    def workspace_bytes(self) -> int:
        """The shared float workspace's size (bytes)."""
        return self._settings.workspace_bytes

    @property
    def bucket(self) -> GraphBucket | None:
        """The CUDA-graph bucket whose fixed buffers this executor fills (``None``:
        an eager executor)."""
        return self._buffers.bucket

    @property
    def plan_counts(self) -> dict[str, int]:
        """FlashInfer planning calls made so far, by route (:class:`~.strategy.PlanCounts`):
        ``"plan"`` (full ``plan()`` calls), ``"fast_decode_plan"`` (decode re-plans),
        ``"fast_prefill_plan"``, and re-plans that kept, or shared, a schedule."""
        counts = self._buffers.owned.counts
        return {
            "plan": counts.full,
            "fast_decode_plan": counts.decode_replans,
            "fast_prefill_plan": counts.prefill_replans,
            "schedules_kept": counts.schedules_kept,
            "schedules_shared": counts.schedules_shared,
            "plans_kept": counts.plans_kept,
        }

    @property
    def planned_wrappers(self) -> Planned:
        """The applied plan's planned FlashInfer wrappers, by ``(group index, "paged" |
        "ragged")`` (empty before an apply)."""
        return {} if self._batch is None else self._batch.planned

    @property
    def spec(self) -> PlanSpec | None:
        """The plan applied last, or ``None``."""
        return None if self._batch is None else self._batch.spec

    @property
    def calls(self) -> tuple[GroupCalls, ...]:
        """The FlashInfer call descriptions of the applied plan."""
        return () if self._batch is None else self._batch.dplan.calls

    @property
    def device_plan(self) -> DevicePlan | None:
        """The device work of the applied plan (jobs, staging manifest, calls)."""
        return None if self._batch is None else self._batch.dplan

    def positions(self) -> torch.Tensor:
        """int32 ``[total_q]`` device tensor: the applied plan's RoPE positions
        (:attr:`~flashplan.PlanSpec.positions`), built on the device.

        The first call after an ``apply`` sends the plan's position runs
        (:class:`~flashplan.planning.PositionRuns`: three int32 per run, far fewer than the
        tokens of an extend) in one host-to-device copy and fills the positions with one
        kernel launch; later calls return the same tensor. Sync-free: nothing is read
        back, and nothing is computed per token on the host. The tensor is this
        executor's buffer: valid until ``positions()`` is called after the next apply.

        Raises:
            PlanMismatchError: nothing applied yet.
        """
        if self._positions is not None:
            return self._positions
        batch = self._batch
        if batch is None:
            raise PlanMismatchError("spec", "positions() before apply(): apply a PlanSpec first")
        self._positions = fill_positions(
            self._buffers.owned, batch.spec, batch.positions, self._stream()
        )
        return self._positions

    def page_errors(self) -> torch.Tensor:
        """int32 ``[2]`` device tensor: bad page ids met so far, and the index of the
        first gather job that met one (``2**31 - 1`` when none). Reading it is a sync;
        :meth:`reset_page_errors` zeroes it."""
        return self._buffers.owned.status

    def reset_page_errors(self) -> None:
        """Zero the :meth:`page_errors` counters (on the device, no sync)."""
        status = self._buffers.owned.status
        status[0] = 0
        status[1] = NO_BAD_JOB

    # -- apply --------------------------------------------------------------------------
    def apply(self, spec: PlanSpec, table: PageTable) -> None:
        """Plan every wrapper for ``spec``; sync-free (unless ``check_pages``).

        A refused apply leaves the executor as it was: the earlier plan still runs. A
        graph executor's apply is the replay planning: it pads ``spec`` to the bucket and
        refills the graph's fixed buffers in place.

        Raises:
            PlanMismatchError: ``spec`` or ``table`` is not the right record (a graph
                executor: a plan key other than its first apply's).
            PageTableError: the table is too small for the plan or not on this device
                (in ``check_pages`` mode also: a bad page id, two requests writing one
                slot).
            UnsupportedError: a plan this policy cannot run (deterministic mode and a
                ragged path), one that needs more workspace than the executor has, or
                one the executor does not run yet (``calls.check_runnable``).
            BucketError: (a graph executor) the plan does not fit the bucket.
        """
        buffers, owned = self._buffers, self._buffers.owned
        if isinstance(spec, PlanSpec):
            buffers.admit(spec)
        spec, table = check_apply_args(spec, table)
        self._check_plan(spec, table)
        calls = buffers.skeleton(spec)
        dplan = buffers.device_plan(spec, calls, table)
        _, host, staged = stage(owned, dplan)
        (page, offset), masks = gather_and_mask(buffers, dplan, staged, table)
        if self.check_pages:
            check_gathered(dplan, spec, table, page, offset)
        planned = plan_calls(buffers, spec, calls, dplan, host, staged, page, masks)
        owned.timeline.mark(self._stream())  # frees the staging slot and the wrappers planned
        self._batch = AppliedBatch(
            spec, dplan, table, planned, page, offset, owned.positions, level_rows(spec, staged)
        )
        self._positions = None

    def _check_plan(self, spec: PlanSpec, table: PageTable) -> None:
        """What every apply refuses beyond the records' own checks (a bound
        executor: another table than its own)."""
        if self._buffers.bound is not None:
            self._buffers.bound.check(table)
        check_runnable(spec, graph=self._buffers.graph)
        if table.pages.device != self.device:
            raise PageTableError(
                "pages", "the page table must live on the executor's device",
                table_device=str(table.pages.device), device=str(self.device),
            )  # fmt: skip
        if self.policy.deterministic and any(
            p in (KernelPath.RAGGED, KernelPath.RAGGED_PAGED) for p in spec.key.paths
        ):
            raise UnsupportedError(
                "extend_path",
                "deterministic mode runs extends on the paged path only (on a ragged path a "
                "request's kernels would depend on the rest of the batch): plan with "
                "extend_path='paged'",
            )

    def apply_steps(
        self, specs: tuple[PlanSpec, ...] | list[PlanSpec], table: PageTable
    ) -> tuple[FlashInferExecutor, ...]:
        """Apply every step of a multi-step draft decode at once; one executor per step.

        All steps share one staging copy and one gather launch; each step's wrappers are
        planned with its own indptrs. The returned executors run their step
        (``views[s].run(group, q, k_new, v_new, kv_cache)``); they share this
        executor's buffers, so apply again only through this executor, which itself
        runs step 0 afterwards. A graph executor plans every step into its own fixed
        buffers (``step.replay(specs, table)``); its first ``apply_steps`` fixes the
        number of steps, like the key.

        Raises:
            PlanMismatchError: as :meth:`apply`, or no plan given (a graph executor:
                another number of steps than its first).
            PageTableError: as :meth:`apply`.
            UnsupportedError: as :meth:`apply`, or a plan with a custom mask (draft
                decodes have none).
            BucketError: (a graph executor) a step's plan does not fit the bucket.
        """
        buffers, owned = self._buffers, self._buffers.owned
        specs = tuple(specs)
        if not specs:
            raise PlanMismatchError("specs", "apply_steps() needs at least one step's plan")
        buffers.admit_steps(specs)
        steps = []
        for spec in specs:
            spec, table = check_apply_args(spec, table)
            self._check_plan(spec, table)
            if spec.cascade is not None:
                raise UnsupportedError(
                    "specs", "apply_steps() plans steps without cascade levels: apply a "
                    "cascade plan with apply()",
                )  # fmt: skip
            calls = buffers.skeleton(spec)
            if any(gc.masked for gc in calls):
                raise UnsupportedError("specs", "apply_steps() plans steps without custom masks")
            steps.append((spec, calls))
        prefixes = [names.step_prefix(k) for k in range(len(steps))]
        dplan = buffers.steps_device_plan(steps, table, prefixes)
        _, host, staged = stage(owned, dplan)
        (page, offset), _ = gather_and_mask(buffers, dplan, staged, table)
        planned = plan_step_calls(buffers, steps, dplan, host, staged, page, prefixes)
        batches = []
        for k, (prefix, (spec, calls)) in enumerate(zip(prefixes, steps, strict=True)):
            step_plan = DevicePlan(
                calls, dplan.jobs.step(prefix), dplan.manifest, dplan.parts, dplan.masks
            )
            batches.append(
                AppliedBatch(
                    spec, step_plan, table, planned[k], page, offset, owned.step_positions_buffer(k)
                )
            )
        owned.timeline.mark(self._stream())  # frees the staging slot and the wrappers planned
        self._batch, self._positions = batches[0], None
        return tuple(self._over(self._settings, buffers, b) for b in batches)

    # -- run ----------------------------------------------------------------------------
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
        """Attention of one layer of ``group`` on FlashInfer kernels.

        Arguments and results as :meth:`flashplan.ReferenceExecutor.run`: ``q``
        ``[total_q, num_qo_heads, head_dim]`` (a graph executor: ``bucket.total_q``
        rows, whose padding rows' outputs are to be ignored), ``k_new``/``v_new``
        ``[total_q, num_kv_heads, head_dim]`` (encoder rows for a cross group, or
        ``None``), ``kv_cache`` ``[num_pages, 2, page_size, num_kv_heads, head_dim]``
        (contiguous; ``None`` for a ragged-path group); returns ``out`` and, with
        ``return_lse``, float32 base-2 LSE ``[total_q, num_qo_heads]``. A sink
        group takes its sink logits as ``sinks`` (float32 ``[num_qo_heads]``); they count
        once and the LSE includes them (``-inf``: no sink; NaN or ``+inf``: NaN outputs
        and LSE for that head, ``docs/semantics.md``). The one call the plan marks applies them: a
        decode or paged-only prefill on FlashInfer's own sink kernel (its sink wrapper,
        FA2; :func:`~flashplan.executor.flashinfer.calls.sink_kernel`), otherwise a
        fold into the call's or the merged state on the device (a value-0 key of logit
        ``sinks[h]``, :func:`~flashplan.kernels.merge_state.fold_sinks_triton`). They
        are never passed to a kernel that ignores them. ``k_scale`` / ``v_scale``
        are an fp8 cache's per-tensor scales (a number: folded into the softmax scale on
        the host, exact; a 0-d float32 tensor: ``q * k_scale`` — rounded to the queries'
        dtype, up to 2⁻⁸ of each logit in bf16 — and ``out *= v_scale`` on the
        device, read at each CUDA-graph replay); ``None`` for another cache.

        Raises:
            PlanMismatchError: the group was not planned, or a tensor's type, shape,
                dtype or device contradicts the plan (a graph executor: encoder K/V
                given, which a bucket does not write).
            PageTableError: ``check_pages`` mode, an id outside the cache.
        """
        args = check_run_args(
            self.spec, self.device, group, q, k_new, v_new, kv_cache, return_lse,
            total_q=self._buffers.run_rows, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
            read_scales=self.check_pages,
        )  # fmt: skip
        self._buffers.check_run(args)
        batch = self._batch
        assert batch is not None and isinstance(group, AttentionGroup)
        if kv_cache is not None and not kv_cache.is_contiguous():
            raise PlanMismatchError("kv_cache", "FlashInfer needs a contiguous cache tensor")
        window_pool = self.page_map is not None
        if self.check_pages and kv_cache is not None:
            check_cache_pages(batch, args, group, int(kv_cache.shape[0]), window_pool)
        return run_group(
            batch, args, group, q, k_new, v_new, kv_cache, return_lse=return_lse, sinks=sinks,
            status=self._buffers.owned.status, window_pool=window_pool,
        )  # fmt: skip
