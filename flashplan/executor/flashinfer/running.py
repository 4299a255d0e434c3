"""``run``: one layer of one group on an applied batch — write the new K/V, run the
group's planned kernels, merge or fold their states. Nothing here waits for the GPU."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from flashplan.executor.flashinfer.wrapper_plans import level_part
from flashplan.kernels.kv_write import write_kv
from flashplan.kernels.merge_state import fold_sinks_triton, merge_state_triton
from flashplan.torch_kernels import mark_undefined_sinks

if TYPE_CHECKING:
    from flashplan.executor.checks import RunArgs
    from flashplan.executor.flashinfer.applied import AppliedBatch
    from flashplan.layout.group import AttentionGroup

__all__ = ["run_group"]


def run_group(
    batch: AppliedBatch,
    args: RunArgs,
    group: AttentionGroup,
    q: torch.Tensor,
    k_new: torch.Tensor | None,
    v_new: torch.Tensor | None,
    kv_cache: torch.Tensor | None,
    *,
    return_lse: bool,
    sinks: torch.Tensor | None,
    status: torch.Tensor,
    window_pool: bool,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of one layer of ``group`` (arguments checked: ``args``), as
    :meth:`~flashplan.executor.flashinfer.FlashInferExecutor.run` documents.

    ``status`` counts bad write slots (int32 ``[2]``); ``window_pool``: the executor
    maps windowed groups' slots through a page map.
    """
    spec = batch.spec
    gc = batch.dplan.calls[args.index]
    if args.writes:
        assert kv_cache is not None and k_new is not None and v_new is not None
        r = batch.write_region(group, window_pool)
        fp8 = spec.heads.kv_is_fp8
        write_kv(
            kv_cache, k_new, v_new, batch.page[r.lo : r.hi], batch.offset[r.lo : r.hi],
            status=status, k_scale=args.k_scale if fp8 else None,
            v_scale=args.v_scale if fp8 else None,
        )  # fmt: skip
    if q.shape[0] == 0:
        out = q.new_zeros(q.shape, dtype=spec.heads.out_dtype)
        lse = torch.full(q.shape[:2], -math.inf, dtype=torch.float32, device=q.device)
        return (out, lse) if return_lse else out

    # A sink group's sink joins its state once (the plan names one call): inside
    # FlashInfer's sink kernel where the paged call runs on it, else folded in the
    # merge of the group's two states, or in one pass over its one state.
    in_kernel = gc.paged is not None and gc.paged.wrapper.sink is not None
    fold = None if in_kernel else sinks
    want_lse = return_lse or gc.merges or fold is not None or bool(gc.levels)
    states = []
    if gc.ragged is not None:
        wrapper = batch.planned[(args.index, "ragged")]
        states.append(wrapper.run(q, k_new, v_new, return_lse=want_lse))
    if gc.paged is not None:
        wrapper = batch.planned[(args.index, "paged")]
        q_paged, k_scale = (q, None) if not spec.heads.kv_is_fp8 else _fold_k_scale(q, args)
        if in_kernel:  # the sink wrapper's run(q, cache, sinks, sm_scale)
            assert sinks is not None
            scale = group.scale_for(spec.heads.head_dim) * (k_scale or 1.0)
            state = wrapper.run(q_paged, kv_cache, sinks, scale, return_lse=want_lse)
            # NaN / +inf logits: NaN heads, as on every other path (docs/semantics.md)
            if want_lse:
                mark_undefined_sinks(state[0], state[1], sinks)
            else:
                mark_undefined_sinks(state, None, sinks)
        else:
            state = wrapper.run(q_paged, kv_cache, k_scale=k_scale, return_lse=want_lse)
        if spec.heads.kv_is_fp8:
            _apply_v_scale(state[0] if want_lse else state, args.v_scale)
        states.append(state)
        if gc.levels:  # the own keys' state, merged with every level's
            out, lse = _merge_levels(batch, args, q_paged, k_scale, kv_cache, state)
            return (out, lse) if return_lse else out
    if gc.merges:
        (o_a, s_a), (o_b, s_b) = states
        out, lse = merge_state_triton(o_a, s_a, o_b, s_b, sinks=fold)
    elif fold is not None:
        o, lse_o = states[0]
        out, lse = fold_sinks_triton(o, lse_o, fold)
    elif return_lse:
        return states[0]
    else:
        return states[0][0] if want_lse else states[0]
    return (out, lse) if return_lse else out


def _merge_levels(
    batch: AppliedBatch,
    args: RunArgs,
    q: torch.Tensor,
    k_scale: float | None,
    kv_cache: torch.Tensor | None,
    own: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """A cascade group's state: its own keys' ``own`` merged by LSE with each level's
    call over the shared pages (outermost first). A level whose call leaves some query
    rows out runs on the rows it has (gathered by its staged ``q_rows``) and its merge
    is written back to them. The parts partition each request's keys
    (:func:`~flashplan.planning.cascade.cascade_levels`), so the merge is the attention
    over all of them."""
    out, lse = own
    fp8 = batch.spec.heads.kv_is_fp8
    for k, rows in enumerate(batch.level_rows):
        wrapper = batch.planned[(args.index, level_part(k))]
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
    """An fp8 cache's ``k_scale`` where the kernel takes it: a number multiplies the
    kernel's softmax scale (FlashInfer's ``k_scale`` argument, host arithmetic: exact); a
    0-d tensor multiplies the queries on the device (FlashInfer takes its softmax scale
    only as a host number, so multiplying by the tensor there would be a sync, and a CUDA
    graph would keep the value of its capture).

    The product is computed in float32 and rounded to the queries' dtype once. (``q *
    k_scale`` would not do: on CUDA, torch casts a 0-d float32 tensor to the other
    operand's bf16 *before* multiplying, so every logit was scaled by ``bf16(k_scale)``,
    up to 2⁻⁹ off — a bias that moved the LSE of large logits by hundreds: issue 50.) What
    remains is each product's own rounding, up to 2⁻⁸ of each logit in bf16, unbiased —
    the documented cost of a device scale (``docs/semantics.md``, FP8 KV cache).
    ``(q for the kernel, k_scale for FlashInfer or None)``."""
    if isinstance(args.k_scale, torch.Tensor):
        return (q.float() * args.k_scale).to(q.dtype), None
    return q, None if args.k_scale == 1.0 else args.k_scale


def _apply_v_scale(out: torch.Tensor, v_scale: float | torch.Tensor) -> None:
    """Multiply a paged call's output by an fp8 cache's ``v_scale`` in place (attention
    is linear in V; the LSE does not depend on it), in float32: a tensor scale is not
    rounded to the output's dtype first (see :func:`_fold_k_scale`)."""
    if isinstance(v_scale, torch.Tensor):
        out.copy_(out.float() * v_scale)
    elif v_scale != 1.0:
        out.mul_(v_scale)  # a Python number: torch computes in float32 (opmath)
