"""`ReferenceExecutor`: the same plans, computed in plain torch on any device.

It follows the kernel paths of the plan — a paged call over the request's own pages,
a ragged call over the new tokens, and a base-2 log-sum-exp merge of the two — with
the kernels' own masking rules (:mod:`flashplan.kernel_rules`, FlashInfer's multi-item
scoring mask included), so it is a faithful oracle for the FlashInfer executor and a
fallback where there is no GPU.

Like the kernels, it reads only the keys of each request's own span: a batch is
padded to its longest span with zeros, never with other cache entries, so NaN or
garbage elsewhere in the cache (uninitialised pages, evicted window pages, an encoder
region a self cache never wrote) cannot leak in. It is also the strict executor: it
checks every page id a run reads or writes against the cache, and every write slot for
collisions, and raises a :class:`~flashplan.PageTableError` before anything is written.

Math runs in ``compute_dtype`` (float32 by default; float64 for tight tests). Each
call is vectorized over the batch; memory is ``bs * heads * max_q * max_kv`` scores,
so it is meant for tests, demos and modest batches. Index preparation happens on the
host (reading a device page table here is a sync: this executor is not a hot path).
"""

from __future__ import annotations

import math
from typing import Literal, overload

import attrs
import numpy as np
import torch

from flashplan.errors import OptionError, PlanMismatchError
from flashplan.executor.checks import RunArgs, check_apply_args, check_page_map, check_run_args
from flashplan.executor.gathers import (
    ENCODER,
    WRITE,
    WRITE_WINDOW,
    GatherJobs,
    gather_jobs,
    pages_region,
    write_region,
)
from flashplan.executor.reference_calls import (
    CallRows,
    PagedCall,
    Slots,
    call_rows,
    cascade_calls,
    check_collisions,
    entries,
    entry_queries,
    paged_call,
)
from flashplan.fp8 import Scale, dequantize, quantize
from flashplan.kernel_rules import kernel_visibility
from flashplan.layout.group import AttentionGroup
from flashplan.layout.heads import FP8_DTYPES
from flashplan.layout.page_table import PageTable
from flashplan.planning.spec import PlanSpec
from flashplan.torch_kernels import fold_sinks_torch, gather_slots_torch, merge_state_torch

__all__ = ["ReferenceExecutor"]

_LN2 = math.log(2.0)
_COMPUTE_DTYPES = (torch.float32, torch.float64)


@attrs.frozen(eq=False)
class _Applied:
    spec: PlanSpec
    table: PageTable
    device: torch.device
    writes: dict[str, tuple[Slots, torch.Tensor, torch.Tensor]]  # region -> host, page, slot
    paged: dict[int, PagedCall]
    # group index -> (the call's entries' query rows, bool [n, max_q, max_q] visibility)
    ragged: dict[int, tuple[CallRows, torch.Tensor]]
    # the calls of groups that run on cascade levels (levels, then the own parts)
    cascade: dict[int, list[PagedCall]] = attrs.field(factory=dict)


class ReferenceExecutor:
    """Runs a :class:`~flashplan.PlanSpec` with plain torch (CPU or GPU).

    Usage mirrors the FlashInfer executor: ``apply(spec, table)`` once per batch,
    then ``run(group, q, k_new, v_new, kv_cache)`` per layer.

    Args:
        compute_dtype: dtype of the attention math (``torch.float32`` or
            ``torch.float64``); outputs are cast to the plan's ``out_dtype``.
        page_map: optional int32 tensor mapping full-pool page ids to the page ids of
            a separate sliding-window KV pool (a negative entry marks an evicted
            page), applied to windowed groups' reads and writes — the same contract
            as the FlashInfer executor's.

    Raises:
        OptionError: ``compute_dtype`` or ``page_map`` is not one of the above.
    """

    def __init__(
        self, *, compute_dtype: torch.dtype = torch.float32, page_map: torch.Tensor | None = None
    ) -> None:
        if not isinstance(compute_dtype, torch.dtype) or compute_dtype not in _COMPUTE_DTYPES:
            raise OptionError(
                "compute_dtype", "must be torch.float32 or torch.float64", value=compute_dtype
            )
        self.compute_dtype = compute_dtype
        self.page_map = check_page_map(page_map)
        self._applied: _Applied | None = None

    @property
    def spec(self) -> PlanSpec | None:
        """The plan applied last, or ``None``."""
        return None if self._applied is None else self._applied.spec

    def positions(self) -> torch.Tensor:
        """int32 ``[total_q]``: the applied plan's RoPE positions
        (:attr:`~flashplan.PlanSpec.positions`) on the table's device (a fresh tensor,
        copied from the host plan).

        Raises:
            PlanMismatchError: nothing applied yet.
        """
        if self._applied is None:
            raise PlanMismatchError("spec", "positions() before apply(): apply a PlanSpec first")
        host = torch.from_numpy(self._applied.spec.positions.copy())
        return host.to(self._applied.device)

    # -- apply --------------------------------------------------------------------------
    def apply(self, spec: PlanSpec, table: PageTable) -> None:
        """Prepare index tensors for ``spec`` on the table's device.

        The table's page ids are gathered on the host. A refused apply leaves the
        executor as it was (the earlier plan still runs).

        Raises:
            PlanMismatchError: ``spec`` or ``table`` is not the right record.
            PageTableError: the table does not cover the plan's pages, or two requests'
                new tokens would be written to the same cache slot.
        """
        spec, table = check_apply_args(spec, table)
        dev = table.pages.device
        # a cascade group's paged call reads each request's own keys; the levels read
        # their groups' shared pages: gathered like the FlashInfer executor's
        cascade = spec.cascade
        own: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        if cascade is not None:  # (every group's own call reads the same spans)
            call = cascade.own_call(cascade.groups[0])
            own = dict.fromkeys(cascade.groups, (call.start_page, call.num_pages))
        jobs = gather_jobs(
            spec, table.rows, window_pool=self.page_map is not None, spans=own,
            level_spans=() if cascade is None else tuple(
                (lv.row_start_page, lv.row_pages) for lv in cascade.levels.levels
            ),
        )  # fmt: skip
        page, offset = self._gather(jobs, table)

        def region_slots(name: str, counts: np.ndarray, what: str) -> Slots:
            r = jobs.region(name)
            p, o = page[r.lo : r.hi], offset[r.lo : r.hi]
            return Slots(p, o.clip(0), entries(counts)[0], o < 0, what)

        writes: dict[str, tuple[Slots, torch.Tensor, torch.Tensor]] = {}
        for name, counts, what in (
            (WRITE, spec.qo_lens, "writes the new tokens' K/V to"),
            (WRITE_WINDOW, spec.qo_lens, "writes the new tokens' K/V to (window pool)"),
            (ENCODER, None, "writes the encoder tokens' K/V to"),
        ):
            if not jobs.has(name):
                continue
            if counts is None:
                assert spec.encoder_indptr is not None
                counts = np.diff(spec.encoder_indptr)
            slots = region_slots(name, counts, what)
            check_collisions(slots, spec.page_size, table)
            writes[name] = (slots, *slots.device(dev))

        paged: dict[int, PagedCall] = {}
        ragged: dict[int, tuple[CallRows, torch.Tensor]] = {}
        for index, gp in enumerate(spec.group_plans):
            queries, request = entry_queries(spec, gp)
            if gp.paged is not None and index not in own:  # (cascade groups: below)
                r = jobs.region(pages_region(index))
                paged[index] = paged_call(
                    gp.paged, queries, request, page[r.lo : r.hi], offset[r.lo : r.hi], dev,
                    f"reads for group {index} ({gp.group.describe()})",
                )  # fmt: skip
            if gp.ragged is not None:
                seen = kernel_visibility(
                    queries.lens, gp.ragged.kv_lens, queries.max_len, queries.max_len,
                    causal=gp.ragged.causal, window_left=gp.ragged.window_left,
                )  # fmt: skip
                ragged[index] = (call_rows(queries, dev), torch.from_numpy(seen).to(dev))
        levels: dict[int, list[PagedCall]] = {}
        if cascade is not None:
            levels = cascade_calls(cascade, spec, jobs, page, offset, dev)
        self._applied = _Applied(
            spec=spec, table=table, device=dev, writes=writes, paged=paged, ragged=ragged,
            cascade=levels,
        )  # fmt: skip

    def _gather(self, jobs: GatherJobs, table: PageTable) -> tuple[np.ndarray, np.ndarray]:
        """Run every gather job on the host: (page id, in-page offset) int64 ``[total]``."""
        page = torch.zeros(jobs.total, dtype=torch.int64)
        offset = torch.zeros(jobs.total, dtype=torch.int64)
        pages = table.pages.cpu()
        page_map = None if self.page_map is None else self.page_map.cpu()
        rows, first, counts, dst, div, use_map = (
            torch.from_numpy(np.array(c, dtype=np.int32)) for c in jobs.columns()
        )
        gather_slots_torch(
            pages, rows, first, counts, dst, div, use_map, page, offset, total=jobs.total,
            page_map=page_map, num_pages=table.num_pages or 0,
        )  # fmt: skip
        return page.numpy(), offset.numpy()

    def apply_steps(
        self, specs: tuple[PlanSpec, ...] | list[PlanSpec], table: PageTable
    ) -> tuple[ReferenceExecutor, ...]:
        """Apply every step of a multi-step draft decode; one executor per step (the
        same contract as :meth:`~flashplan.executor.flashinfer.FlashInferExecutor.apply_steps`)."""
        views = []
        for spec in specs:
            view = ReferenceExecutor(compute_dtype=self.compute_dtype, page_map=self.page_map)
            view.apply(spec, table)
            views.append(view)
        return tuple(views)

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
        k_scale: Scale | None = None,
        v_scale: Scale | None = None,
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
        k_scale: Scale | None = None,
        v_scale: Scale | None = None,
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
        k_scale: Scale | None = None,
        v_scale: Scale | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attention of one layer of ``group``.

        Args:
            group: a group the applied plan was made for.
            q: ``[total_q, num_qo_heads, head_dim]`` queries (``q_dtype``).
            k_new, v_new: ``[total_q, num_kv_heads, head_dim]`` new K/V of a self
                group, or ``[total_encoder, num_kv_heads, head_dim]`` encoder K/V of
                a cross group; written into ``kv_cache`` first. ``None`` when the
                cache already holds them.
            kv_cache: ``[num_pages, 2, page_size, num_kv_heads, head_dim]`` (NHD), or
                ``None`` for a group on the ragged path (attention over ``k_new`` /
                ``v_new`` alone; nothing is written).
            return_lse: also return the log-sum-exp, float32 ``[total_q, num_qo_heads]``,
                **base 2**; ``-inf`` for a query that sees no key (its output is 0). For
                a sink group it includes the sink term (``docs/semantics.md``).
            sinks: a sink group's sink logits, float32 ``[num_qo_heads]`` (natural-log
                units, not scaled or capped; ``-inf`` is no sink, NaN or ``+inf`` give
                that head NaN outputs and LSE); ``None`` for other groups.
            k_scale, v_scale: an fp8 cache's per-tensor scales (a positive finite
                number or a 0-d float32 tensor on the cache's device; ``None``: 1.0):
                new K/V (in ``q_dtype``) are stored as ``x / scale`` saturated to the
                format, and attention reads ``stored * scale`` (:mod:`flashplan.fp8`).
                ``None`` for any other cache.

        Returns:
            ``out [total_q, num_qo_heads, head_dim]`` (``out_dtype``), or ``(out, lse)``.

        Raises:
            PlanMismatchError: an argument contradicts the plan (see
                :func:`~flashplan.executor.checks.check_run_args`).
            PageTableError: a page id the call reads or writes is not in the cache.
        """
        applied = self._applied
        args = check_run_args(
            None if applied is None else applied.spec,
            None if applied is None else applied.device,
            group, q, k_new, v_new, kv_cache, return_lse, sinks=sinks, k_scale=k_scale,
            v_scale=v_scale,
        )  # fmt: skip
        assert applied is not None
        spec, gp = applied.spec, args.plan
        call = applied.paged.get(args.index)
        window_pool = self.page_map is not None
        write = applied.writes[write_region(group, window_pool)] if args.writes else None
        levels = applied.cascade.get(args.index)
        if kv_cache is not None:  # every check before the first write
            num_pages = int(kv_cache.shape[0])
            for c in [call] if levels is None else levels:
                if c is not None:
                    c.keys.check(num_pages, applied.table)
            if write is not None:
                write[0].check(num_pages, applied.table)
        if write is not None and kv_cache is not None:
            assert k_new is not None and v_new is not None
            _, page, slot = write
            if spec.heads.kv_is_fp8:
                k_new = quantize(k_new, args.k_scale, kv_cache.dtype)
                v_new = quantize(v_new, args.v_scale, kv_cache.dtype)
            kv_cache[page, 0, slot] = k_new
            kv_cache[page, 1, slot] = v_new
        scale = group.scale_for(spec.heads.head_dim)
        cap = group.logits_soft_cap
        states = []
        if levels is not None:  # the paged call as cascade levels and own parts
            assert kv_cache is not None
            for c in levels:
                k, v = self._padded_keys(kv_cache, c, args, self.compute_dtype)
                states.append(self._attend(q, k, v, c.visible, c.rows, scale, cap))
        elif call is not None:
            assert kv_cache is not None
            k, v = self._padded_keys(kv_cache, call, args, self.compute_dtype)
            state = self._attend(q, k, v, call.visible, call.rows, scale, cap)
            if gp.paged is not None and gp.paged.sinks:
                assert sinks is not None  # checked: a sink group's run takes them
                state = fold_sinks_torch(*state, sinks)
            states.append(state)
        if gp.ragged is not None:
            assert k_new is not None and v_new is not None
            rows, seen = applied.ragged[args.index]
            valid = rows.valid[..., None, None]
            k = torch.where(valid, k_new[rows.index], 0)  # [n, max_q, Hkv, D]
            v = torch.where(valid, v_new[rows.index], 0)
            state = self._attend(q, k, v, seen, rows, scale, cap)
            if gp.ragged.sinks:
                assert sinks is not None
                state = fold_sinks_torch(*state, sinks)
            states.append(state)
        out, lse = states[0]
        for other_out, other_lse in states[1:]:
            out, lse = merge_state_torch(out, lse, other_out, other_lse)
        out = out.to(spec.heads.out_dtype)
        return (out, lse) if return_lse else out

    @staticmethod
    def _padded_keys(
        kv_cache: torch.Tensor, call: PagedCall, args: RunArgs, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[n, max_kv, Hkv, D]`` in ``dtype``: each entry's own keys as
        attention reads them (an fp8 cache's dequantized), zeros after them."""
        hkv, d = kv_cache.shape[3], kv_cache.shape[4]
        bs = call.rows.shape[0]
        padded = []
        for kv, scale in ((0, args.k_scale), (1, args.v_scale)):
            rows = kv_cache[call.page, kv, call.slot]
            read = dequantize(rows, scale, dtype) if rows.dtype in FP8_DTYPES else rows.to(dtype)
            out = read.new_zeros(bs * call.max_kv, hkv, d)
            out[call.padded_index] = read
            padded.append(out.view(bs, call.max_kv, hkv, d))
        return padded[0], padded[1]

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        visible: torch.Tensor,
        rows: CallRows,
        scale: float,
        soft_cap: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One kernel call over its entries' rows: ``(out [total_q, Hq, D] in compute
        dtype, lse float32 base 2)``; rows no entry holds stay (0, -inf)."""
        cd = self.compute_dtype
        bs, max_q = rows.shape
        hq, d = q.shape[1], q.shape[2]
        hkv = k.shape[2]
        qp = torch.where(rows.valid[..., None, None], q[rows.index], 0)
        qp = qp.to(cd).view(bs, max_q, hkv, hq // hkv, d)
        logits = torch.einsum("bqhgd,bkhd->bhgqk", qp, k.to(cd)) * scale
        if soft_cap:
            logits = soft_cap * torch.tanh(logits / soft_cap)
        logits = logits.masked_fill(~visible[:, None, None], float("-inf"))
        lse_e = torch.logsumexp(logits, dim=-1)  # [bs, hkv, g, max_q], natural log
        # A query that sees no key has lse = -inf: clamp so its probabilities are exp(-inf) = 0.
        probs = torch.exp(logits - lse_e.unsqueeze(-1).clamp_min(torch.finfo(cd).min))
        out = torch.einsum("bhgqk,bkhd->bqhgd", probs, v.to(cd)).reshape(bs, max_q, hq, d)
        lse = (lse_e / _LN2).permute(0, 3, 1, 2).reshape(bs, max_q, hq)
        valid = rows.valid
        total_q = q.shape[0]
        flat_out = torch.zeros(total_q, hq, d, dtype=cd, device=q.device)
        flat_lse = torch.full((total_q, hq), float("-inf"), dtype=torch.float32, device=q.device)
        at = rows.index[valid]
        flat_out[at] = out[valid]
        flat_lse[at] = lse[valid].float()
        return flat_out, flat_lse
