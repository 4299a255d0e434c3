"""`FlashInferExecutor`: applies a `PlanSpec` to FlashInfer wrappers and runs kernels.

``apply(spec, table)``: 1. translate the plan into call records (:mod:`~.calls`) laid out
for the device (:mod:`~.staging`); 2. stage every int32 host array, **one copy**; 3. **one
launch** gathers every page id and write slot and builds the first custom mask; 4.
(``check_pages`` mode) read the ids back; 5. ``plan()`` each wrapper. Nothing waits for
the GPU outside the ``check_pages`` mode.
"""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING, Any, Literal, overload

import attrs
import numpy as np
import torch

import flashplan.executor.flashinfer.names as names
from flashplan.errors import (
    DeviceUnavailableError,
    OptionTypeError,
    PageTableError,
    PlanMismatchError,
    RunTypeError,
    UnsupportedError,
    as_option,
)
from flashplan.executor.checks import (
    RunArgs,
    check_apply_args,
    check_page_map,
    check_run_args,
    first_shared_slot,
)
from flashplan.executor.flashinfer.bucket import GraphBucket
from flashplan.executor.flashinfer.buffers import Buffers, GraphBuffers, Staged
from flashplan.executor.flashinfer.calls import WrapperKind, check_runnable
from flashplan.executor.flashinfer.policy import ExecutorPolicy, ExecutorSettings
from flashplan.executor.flashinfer.staging import DevicePlan
from flashplan.executor.flashinfer.xqa import XqaBuffers
from flashplan.executor.gathers import Region, write_region
from flashplan.kernels.gather import NO_BAD_JOB
from flashplan.kernels.kv_write import write_kv
from flashplan.kernels.merge_state import fold_sinks_triton, merge_state_triton
from flashplan.layout.convert import as_bool, as_int
from flashplan.layout.group import AttentionGroup
from flashplan.planning.spec import KernelPath, PlanSpec
from flashplan.torch_kernels import mark_undefined_sinks

if TYPE_CHECKING:
    from flashplan.layout.page_table import PageTable

__all__ = [
    "DEFAULT_WORKSPACE_BYTES", "SUPPORTED_VERSIONS", "AppliedBatch", "ExecutorSettings",
    "FlashInferExecutor", "FlashInferVersionWarning",
]  # fmt: skip

#: Default size of the float workspace all wrappers share (bytes): FlashInfer's
#: recommended 128 MiB doubled, for split-KV partial results of large batches.
DEFAULT_WORKSPACE_BYTES = 256 * 1024 * 1024
#: The flashinfer-python range ``[oldest, newest]`` (``pyproject.toml``'s) whose ends the GPU
#: suite is to pass on (0.7.4 does; 0.7.0.post1 has not run yet); another version warns.
SUPPORTED_VERSIONS = ("0.7.0.post1", "0.7.4")


class FlashInferVersionWarning(UserWarning):
    """The installed flashinfer is outside :data:`SUPPORTED_VERSIONS`."""


def _version_key(version: str) -> tuple[int, ...]:
    """``"0.7.0.post1+cu130"`` as ``(0, 7, 0, 1)``: release numbers, then post release."""
    release, _, post = version.split("+")[0].partition(".post")
    parts = [int(p) if p.isdigit() else 0 for p in release.split(".")]
    return (*parts, int(post) if post.isdigit() else 0)


def check_version(version: str) -> None:
    """Warn when ``version`` is outside :data:`SUPPORTED_VERSIONS`."""
    lo, hi = (_version_key(v) for v in SUPPORTED_VERSIONS)
    if not lo <= _version_key(version) <= hi:  # (the twin's "0.7.4+twin" is 0.7.4)
        warnings.warn(
            f"flashinfer-python {version} is outside the versions flashplan's GPU suite "
            f"passes on ({SUPPORTED_VERSIONS[0]} to {SUPPORTED_VERSIONS[1]})",
            FlashInferVersionWarning, stacklevel=3,
        )  # fmt: skip


def _import_flashinfer() -> Any:
    with warnings.catch_warnings():  # its import-time deprecation notices
        warnings.simplefilter("ignore", DeprecationWarning)
        import flashinfer
    return flashinfer


def _device(device: object, twin: bool) -> torch.device:
    """``device`` checked: CUDA (the current one by default), or any device for the twin."""
    if device is None:
        device = "cpu" if twin and not torch.cuda.is_available() else "cuda"
    if isinstance(device, bool):
        raise UnsupportedError("device", "not a torch device", value=device)
    try:
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)  # type: ignore[call-overload]
    except (RuntimeError, TypeError, ValueError) as exc:
        raise UnsupportedError("device", f"not a torch device ({exc})", value=device) from None
    if dev.type != "cuda":
        if twin:
            return dev
        raise UnsupportedError("device", "FlashInferExecutor needs a CUDA device", device=str(dev))
    if not torch.cuda.is_available():
        raise DeviceUnavailableError(
            "device", "FlashInferExecutor needs CUDA, which is not available here"
        )
    if dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    if not 0 <= dev.index < torch.cuda.device_count():
        raise DeviceUnavailableError(
            "device", f"no such CUDA device: this machine has {torch.cuda.device_count()}",
            device=str(dev),
        )  # fmt: skip
    return dev


def _xqa_buffers(
    fi: Any, device: torch.device, twin: bool, policy: ExecutorPolicy
) -> XqaBuffers | None:
    """XQA's buffers where ``fi`` has ``xqa`` and the GPU runs it (sm_90, sm_100, sm_120;
    the twin anywhere), else ``None``.

    Raises:
        UnsupportedError: the policy asks for XQA where it cannot run.
    """
    runs = hasattr(fi, "xqa") and (
        twin or torch.cuda.get_device_capability(device)[0] in (9, 10, 12)
    )
    if not runs and policy.decode_backend == "xqa":
        raise UnsupportedError(
            "decode_backend", "'xqa' needs flashinfer.xqa and an sm_90, sm_100 or sm_120 GPU "
            "(use 'auto' or 'fa2')", device=str(device),
        )  # fmt: skip
    return XqaBuffers(device) if runs else None


@attrs.frozen(eq=False)
class AppliedBatch:
    """What an apply leaves for ``run``: the planned wrappers by ``(group index, "paged" |
    "ragged" | "level<k>")``, the int32 gathered page ids and in-page offsets (-1: no
    slot), per cascade level its call's int32 query rows (``None``: all, in order), and
    the draft step it is (0 for a whole batch)."""

    spec: PlanSpec
    dplan: DevicePlan
    table: PageTable
    planned: dict[tuple[int, str], Any]
    page: torch.Tensor
    offset: torch.Tensor
    level_rows: tuple[torch.Tensor | None, ...] = ()
    step: int = 0

    def write_region(self, group: AttentionGroup, window_pool: bool) -> Region:
        """The gather region of ``group``'s write slots."""
        return self.dplan.jobs.region(write_region(group, window_pool))


def level_rows(spec: PlanSpec, staged: Staged) -> tuple[torch.Tensor | None, ...]:
    """Per cascade level, the staged device view of its query rows (``None``: the level's
    call covers every row in batch order)."""
    if spec.cascade is None:
        return ()
    return tuple(
        staged.device(names.level_array(k, "q_rows")) if lv.leaves_rows_out(spec.total_q) else None
        for k, lv in enumerate(spec.cascade.levels.levels)
    )


def _merge_levels(
    batch: AppliedBatch, args: RunArgs, q: torch.Tensor, k_scale: float | None,
    kv_cache: torch.Tensor | None, own: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """A cascade group's state: its own keys' ``own`` merged by LSE with each level's call
    over the shared pages (outermost first; a level runs on its own query rows)."""
    out, lse = own
    fp8 = batch.spec.heads.kv_is_fp8
    for k, rows in enumerate(batch.level_rows):
        wrapper = batch.planned[(args.index, names.level_part(k))]
        q_level = q if rows is None else q.index_select(0, rows)
        o_level, s_level = wrapper.run(q_level, kv_cache, k_scale=k_scale, return_lse=True)
        if fp8:
            _apply_v_scale(o_level, args.v_scale)
        if rows is None:
            out, lse = merge_state_triton(out, lse, o_level, s_level)
            continue
        o_m, s_m = merge_state_triton(
            out.index_select(0, rows), lse.index_select(0, rows), o_level, s_level
        )
        out.index_put_((rows,), o_m)
        lse.index_put_((rows,), s_m)
    return out, lse


def _fold_k_scale(q: torch.Tensor, args: RunArgs) -> tuple[torch.Tensor, float | None]:
    """``(q for the kernel, k_scale for FlashInfer or None)``: a number scales the softmax
    (exact); a 0-d tensor the queries on the device, in float32 and rounded once (torch's
    ``q * k_scale`` would round the scale to bf16 first)."""
    if isinstance(args.k_scale, torch.Tensor):
        return (q.float() * args.k_scale).to(q.dtype), None
    return q, None if args.k_scale == 1.0 else args.k_scale


def _apply_v_scale(out: torch.Tensor, v_scale: float | torch.Tensor) -> None:
    """Multiply a paged call's output by an fp8 cache's ``v_scale`` in place, in float32."""
    if isinstance(v_scale, torch.Tensor):
        out.copy_(out.float() * v_scale)
    elif v_scale != 1.0:
        out.mul_(v_scale)  # a Python number: torch computes in float32 (opmath)


class FlashInferExecutor:
    """Runs plans (:class:`~flashplan.PlanSpec`) on FlashInfer kernels, with the contract
    of :class:`~flashplan.ReferenceExecutor`: ``apply(spec, table)`` once per batch, then
    ``run(group, q, k_new, v_new, kv_cache)`` per layer, on one stream.
    :meth:`for_bucket` makes a CUDA-graph bucket's executor from this one.

    **Bad page ids** (below 0, at or beyond ``table.num_pages``, or evicted from the
    window pool) are never used (reads go to page 0, writes are skipped) and are counted
    in :meth:`page_errors`. With ``check_pages=True`` every apply and run checks them and
    raises :class:`~flashplan.PageTableError` naming the request (a sync per call).

    Args:
        device: the KV cache's device (default: the current CUDA device, or the CPU with
            the twin and no CUDA).
        policy: kernel choices (:class:`ExecutorPolicy`).
        workspace_bytes: the float workspace all wrappers share (bytes).
        page_map: int32 device tensor mapping full-pool page ids to a sliding-window
            pool's (negative: evicted); windowed groups go through it.
        check_pages: the checked mode above.
        flashinfer: the FlashInfer module (default: ``import flashinfer``), or
            :data:`flashplan.twin.flashinfer_twin` to run on the CPU.

    Raises:
        UnsupportedError: ``device`` is not a CUDA device (real FlashInfer).
        DeviceUnavailableError: (also a ``RuntimeError``) no CUDA here.
        OptionError: an argument out of range (:class:`~flashplan.OptionTypeError`: of the
            wrong type).
    """

    def __init__(
        self, device: torch.device | str | int | None = None, *,
        policy: ExecutorPolicy | None = None, workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
        page_map: torch.Tensor | None = None, check_pages: bool = False, flashinfer: Any = None,
    ) -> None:  # fmt: skip
        twin = str(getattr(flashinfer, "__version__", "")).endswith("+twin")
        dev = _device(device, twin)
        fi = _import_flashinfer() if flashinfer is None else flashinfer
        check_version(str(getattr(fi, "__version__", "unknown")))
        if policy is not None and not isinstance(policy, ExecutorPolicy):
            raise OptionTypeError("policy", "must be an ExecutorPolicy", value=policy)
        size = as_option(as_int, "workspace_bytes", workspace_bytes, minimum=1 << 20)
        policy = policy or ExecutorPolicy()
        xqa = _xqa_buffers(fi, dev, twin, policy)
        settings = ExecutorSettings(
            device=dev, flashinfer=fi, policy=policy, workspace_bytes=size,
            # zeroed: FlashInfer asks for a zero-initialised float workspace
            workspace=torch.zeros(size, dtype=torch.uint8, device=dev),
            page_map=check_page_map(page_map, dev),
            check_pages=as_option(as_bool, "check_pages", check_pages),
            sm90=dev.type == "cuda" and torch.cuda.get_device_capability(dev) == (9, 0),
            sink_decode=hasattr(fi, "BatchDecodeWithAttentionSinkWrapper"), twin=twin, xqa=xqa,
        )  # fmt: skip
        self._settings = settings
        self._buffers: Buffers = Buffers(settings)
        self._batch: AppliedBatch | None = None
        self._positions: torch.Tensor | None = None  # positions() of _batch

    def _over(self, buffers: Buffers, batch: AppliedBatch | None) -> FlashInferExecutor:
        """An executor of these settings over ``buffers`` (a bucket's, or a draft step's)."""
        executor = type(self).__new__(type(self))
        executor._settings, executor._buffers, executor._batch = self._settings, buffers, batch
        executor._positions = None
        return executor

    def for_bucket(self, bucket: GraphBucket) -> FlashInferExecutor:
        """The CUDA-graph executor of ``bucket`` (:mod:`~.graphs`) on these settings.

        Raises:
            RunTypeError: ``bucket`` is not a :class:`GraphBucket`.
            UnsupportedError: this executor runs in ``check_pages`` mode.
        """
        if not isinstance(bucket, GraphBucket):
            raise RunTypeError("bucket", "expected a GraphBucket", type=type(bucket).__name__)
        if self.check_pages:
            raise UnsupportedError(
                "check_pages", "check_pages=True reads back from the device on every apply "
                "and run, which a captured CUDA graph cannot do: make the graph executor "
                "from an executor in the default mode",
            )  # fmt: skip
        return self._over(GraphBuffers(self._settings, bucket), None)

    # -- settings and state ---------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """The device of the KV cache."""
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
    def workspace_bytes(self) -> int:
        """The shared float workspace's size (bytes)."""
        return self._settings.workspace_bytes

    @property
    def bucket(self) -> GraphBucket | None:
        """The CUDA-graph bucket whose fixed buffers this executor fills (``None``: eager)."""
        return self._buffers.bucket

    @property
    def spec(self) -> PlanSpec | None:
        """The plan applied last, or ``None``."""
        return None if self._batch is None else self._batch.spec

    def positions(self) -> torch.Tensor:
        """int32 ``[total_q]`` device tensor: the applied plan's RoPE positions (no sync;
        valid until ``positions()`` after the next apply).

        Raises:
            PlanMismatchError: nothing applied yet.
        """
        if self._positions is None:
            if self._batch is None:
                raise PlanMismatchError(
                    "spec", "positions() before apply(): apply a PlanSpec first"
                )
            self._positions = self._buffers.fill_positions(self._batch.spec, self._batch.step)
        return self._positions

    def page_errors(self) -> torch.Tensor:
        """int32 ``[2]`` device tensor: bad page ids met so far, and the index of the
        first gather job that met one (``2**31 - 1`` when none). Reading it syncs."""
        return self._buffers.status

    def reset_page_errors(self) -> None:
        """Zero the :meth:`page_errors` counters (on the device, no sync)."""
        self._buffers.status[0] = 0
        self._buffers.status[1] = NO_BAD_JOB

    # -- apply --------------------------------------------------------------------------
    def apply(self, spec: PlanSpec, table: PageTable) -> None:
        """Plan every wrapper for ``spec`` (module docstring; a graph executor pads it to
        its bucket). A plan refused by a check leaves the earlier plan in place; one
        refused once the device work began leaves no plan applied.

        Raises:
            RunTypeError: ``spec`` or ``table`` is not the right record.
            PlanMismatchError: (a graph executor) another plan key than its first apply's.
            PageTableError: the table is too small for the plan or on another device (in
                ``check_pages`` mode also: a bad page id, two tokens writing one slot).
            UnsupportedError: a plan this policy cannot run, or one that needs more
                workspace than the executor has.
            BucketError: (a graph executor) the plan does not fit the bucket.
        """
        spec, table = check_apply_args(spec, table)
        buffers = self._buffers
        buffers.admit((spec,))
        self._check_plan(spec, table)
        calls = buffers.skeleton(spec)  # 1. translate
        dplan = buffers.device_plan(spec, calls, table)
        self._batch, self._positions = None, None  # the buffers the last plan reads change
        try:
            staged = Staged(dplan, buffers.staging)  # 2. one copy
            page, offset, masks = buffers.gather_and_mask(dplan, staged, table)  # 3. one launch
            if self.check_pages:
                _check_gathered(dplan, spec, table, page, offset)  # 4.
            planned = buffers.plan_wrappers(calls, dplan, staged, page, masks)  # 5. plan()
        finally:
            buffers.pool.mark(self._stream())
        rows = level_rows(spec, staged)
        self._batch = AppliedBatch(spec, dplan, table, planned, page, offset, rows)

    def _stream(self) -> torch.cuda.Stream | None:
        return torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None

    def _check_plan(self, spec: PlanSpec, table: PageTable) -> None:
        """What every apply refuses beyond the records' own checks."""
        check_runnable(spec, graph=self._buffers.bucket is not None)
        if table.pages.device != self.device:
            raise PageTableError(
                "pages", "the page table must live on the executor's device",
                table_device=str(table.pages.device), device=str(self.device),
            )  # fmt: skip
        if self.policy.deterministic and any(
            p in (KernelPath.RAGGED, KernelPath.RAGGED_PAGED) for p in spec.key.paths
        ):
            raise UnsupportedError(
                "extend_path", "deterministic mode runs extends on the paged path only (on a "
                "ragged path a request's kernels would depend on the rest of the batch): "
                "plan with extend_path='paged'",
            )  # fmt: skip

    def apply_steps(
        self, specs: tuple[PlanSpec, ...] | list[PlanSpec], table: PageTable
    ) -> tuple[FlashInferExecutor, ...]:
        """Apply every step of a multi-step draft decode at once (one staging copy, one
        gather launch); returns one executor per step over this one's buffers (apply again
        only through this one). A graph executor's first call fixes the number of steps.

        Raises:
            PlanMismatchError: as :meth:`apply`, or no plan given.
            UnsupportedError: as :meth:`apply`, or a plan with cascade levels or a mask.
        """
        specs = tuple(specs)
        if not specs:
            raise PlanMismatchError("specs", "apply_steps() needs at least one step's plan")
        buffers = self._buffers
        steps = []
        for spec in specs:
            spec, table = check_apply_args(spec, table)
            self._check_plan(spec, table)
            calls = buffers.skeleton(spec)
            if spec.cascade is not None or any(gc.masked for gc in calls):
                raise UnsupportedError(
                    "specs", "apply_steps() plans steps without cascade levels or custom "
                    "masks: apply such a plan with apply()",
                )  # fmt: skip
            steps.append((spec, calls))
        buffers.admit(specs)
        prefixes = [names.step_prefix(k) for k in range(len(steps))]
        dplan = buffers.steps_device_plan(steps, table, prefixes)
        self._batch, self._positions = None, None
        batches = []
        try:
            staged = Staged(dplan, buffers.staging)
            page, offset, _ = buffers.gather_and_mask(dplan, staged, table)
            for k, (prefix, (spec, calls)) in enumerate(zip(prefixes, steps, strict=True)):
                planned = buffers.plan_wrappers(calls, dplan, staged, page, {}, prefix)
                step_plan = DevicePlan(
                    calls, dplan.jobs.step(prefix), dplan.manifest, dplan.parts, {}
                )
                batches.append(AppliedBatch(spec, step_plan, table, planned, page, offset, (), k))
        finally:
            buffers.pool.mark(self._stream())
        self._batch = batches[0]
        return tuple(self._over(buffers, b) for b in batches)

    # -- run ----------------------------------------------------------------------------
    @overload
    def run(
        self, group: AttentionGroup, q: torch.Tensor, k_new: torch.Tensor | None,
        v_new: torch.Tensor | None, kv_cache: torch.Tensor | None, *,
        return_lse: Literal[False] = False, sinks: torch.Tensor | None = None,
        k_scale: float | torch.Tensor | None = None, v_scale: float | torch.Tensor | None = None,
    ) -> torch.Tensor: ...  # fmt: skip

    @overload
    def run(
        self, group: AttentionGroup, q: torch.Tensor, k_new: torch.Tensor | None,
        v_new: torch.Tensor | None, kv_cache: torch.Tensor | None, *,
        return_lse: Literal[True], sinks: torch.Tensor | None = None,
        k_scale: float | torch.Tensor | None = None, v_scale: float | torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...  # fmt: skip

    def run(
        self, group: AttentionGroup, q: torch.Tensor, k_new: torch.Tensor | None,
        v_new: torch.Tensor | None, kv_cache: torch.Tensor | None, *, return_lse: bool = False,
        sinks: torch.Tensor | None = None, k_scale: float | torch.Tensor | None = None,
        v_scale: float | torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Attention of one layer of ``group``, as :meth:`flashplan.ReferenceExecutor.run`:
        ``q`` ``[total_q, num_qo_heads, head_dim]`` (a graph executor: ``bucket.total_q``
        rows), ``k_new``/``v_new`` ``[total_q, num_kv_heads, head_dim]`` (or ``None``),
        ``kv_cache`` ``[num_pages, 2, page_size, num_kv_heads, head_dim]`` (contiguous).
        Returns ``out`` and, with ``return_lse``, float32 base-2 LSE ``[total_q,
        num_qo_heads]``. ``sinks``: float32 ``[num_qo_heads]`` sink logits. ``k_scale`` /
        ``v_scale``: an fp8 cache's scales (a number, or a 0-d float32 tensor).

        Raises:
            PlanMismatchError: the group was not planned, or a tensor contradicts the plan.
            RunTypeError: an argument of the wrong type.
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
        spec, gc, fp8 = batch.spec, batch.dplan.calls[args.index], batch.spec.heads.kv_is_fp8
        xqa = gc.paged is not None and gc.paged.wrapper.kind is WrapperKind.XQA
        if xqa and return_lse:  # refused before anything is written
            raise UnsupportedError(
                "return_lse", f"group {group.describe()!r} decodes on XQA, which returns no "
                "LSE: construct the executor with ExecutorPolicy(decode_backend='fa2') to "
                "get one", group=group.describe(),
            )  # fmt: skip
        w = batch.write_region(group, self.page_map is not None) if args.writes else None
        if self.check_pages and kv_cache is not None:
            reads = [names.pages_region(args.index)] if args.plan.paged is not None else []
            _check_cache_pages(batch, reads + ([w.name] if w else []), int(kv_cache.shape[0]))
        if w is not None:
            assert kv_cache is not None and k_new is not None and v_new is not None
            write_kv(
                kv_cache, k_new, v_new, batch.page[w.lo : w.hi], batch.offset[w.lo : w.hi],
                status=self._buffers.status, k_scale=args.k_scale if fp8 else None,
                v_scale=args.v_scale if fp8 else None,
            )  # fmt: skip
        if q.shape[0] == 0:
            out = q.new_zeros(q.shape, dtype=spec.heads.out_dtype)
            lse = torch.full(q.shape[:2], -math.inf, dtype=torch.float32, device=q.device)
            return (out, lse) if return_lse else out
        if xqa:
            wrapper = batch.planned[(args.index, "paged")]
            scales = (args.k_scale, args.v_scale) if fp8 else (1.0, 1.0)
            out = wrapper.run(q, kv_cache, sinks=sinks, k_scale=scales[0], v_scale=scales[1])
            if sinks is not None:  # NaN / +inf logits: NaN heads (docs/semantics.md)
                mark_undefined_sinks(out, None, sinks)
            return out
        # a sink joins the state once: in FlashInfer's sink kernel, else folded in the merge
        in_kernel = gc.paged is not None and gc.paged.wrapper.sink is not None
        fold = None if in_kernel else sinks
        want_lse = return_lse or gc.merges or fold is not None or bool(gc.levels)
        states = []
        if gc.ragged is not None:
            wrapper = batch.planned[(args.index, "ragged")]
            states.append(wrapper.run(q, k_new, v_new, return_lse=want_lse))
        if gc.paged is not None:
            wrapper = batch.planned[(args.index, "paged")]
            q_paged, k_fold = _fold_k_scale(q, args) if fp8 else (q, None)
            if in_kernel:  # the sink wrapper's run(q, cache, sinks, sm_scale)
                assert sinks is not None
                scale = group.scale_for(spec.heads.head_dim) * (k_fold or 1.0)
                state = wrapper.run(q_paged, kv_cache, sinks, scale, return_lse=want_lse)
                # NaN / +inf logits: NaN heads, as on every other path (docs/semantics.md)
                o_sink, lse_sink = state if want_lse else (state, None)
                mark_undefined_sinks(o_sink, lse_sink, sinks)
            else:
                state = wrapper.run(q_paged, kv_cache, k_scale=k_fold, return_lse=want_lse)
            if fp8:
                _apply_v_scale(state[0] if want_lse else state, args.v_scale)
            states.append(state)
            if gc.levels:  # the own keys' state, merged with every level's
                out, lse = _merge_levels(batch, args, q_paged, k_fold, kv_cache, state)
                return (out, lse) if return_lse else out
        if gc.merges:
            out, lse = merge_state_triton(*states[0], *states[1], sinks=fold)
        elif fold is not None:
            out, lse = fold_sinks_triton(states[0][0], states[0][1], fold)
        else:
            return states[0] if return_lse or not want_lse else states[0][0]
        return (out, lse) if return_lse else out


# -- the checked mode: every function below reads back from the device ------------------
def _check_gathered(
    dplan: DevicePlan, spec: PlanSpec, table: PageTable, page: torch.Tensor, offset: torch.Tensor
) -> None:
    """Raise for a bad page id, or two tokens writing one cache slot."""
    jobs = dplan.jobs
    off = offset[: jobs.total].cpu().numpy()
    pg = page[: jobs.total].cpu().numpy()
    bad = np.flatnonzero((off < 0) & jobs.written())  # (not a dense table's unused columns)
    if bad.size:
        _raise_bad(dplan, spec, table, int(bad[0]), "is not a valid page id")
    for r in jobs.regions:
        if names.is_pages_region(r.name):
            continue
        slots = pg[r.lo : r.hi].astype(np.int64) * spec.page_size + off[r.lo : r.hi]
        if (shared := first_shared_slot(slots)) is not None:
            _raise_bad(dplan, spec, table, r.lo + shared[1], "is a cache slot another token writes")


def _check_cache_pages(batch: AppliedBatch, regions: list[str], num_pages: int) -> None:
    """Every id of ``regions`` is inside the cache of ``num_pages`` pages."""
    written = torch.from_numpy(batch.dplan.jobs.written()).to(batch.page.device)
    for name in regions:
        r = batch.dplan.jobs.region(name)
        beyond = (batch.page[r.lo : r.hi] >= num_pages) & written[r.lo : r.hi]
        if r.size and bool(beyond.any()):
            entry = r.lo + int(torch.argmax(beyond.to(torch.int8)))
            _raise_bad(batch.dplan, batch.spec, batch.table, entry,
                       f"is beyond the KV cache's {num_pages} pages")  # fmt: skip


def _raise_bad(dplan: DevicePlan, spec: PlanSpec, table: PageTable, entry: int, what: str) -> None:
    jobs = dplan.jobs
    job = int(np.searchsorted(jobs.dst, entry, side="right")) - 1
    region = next(r for r in jobs.regions if r.lo <= entry < r.hi)
    request = job % max(spec.batch_size, 1)
    raise PageTableError(
        "pages", f"an entry the plan gathers for {region.name!r} {what}",
        request=request, row=int(table.rows[request]),
    )  # fmt: skip
