"""``run``: one layer of one group on an applied batch — write the new K/V, run the
group's planned kernels, merge or fold their states. Nothing here waits for the GPU."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from flashplan.kernels.kv_write import write_kv
from flashplan.kernels.merge_state import fold_sinks_triton, merge_state_triton

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
        write_kv(
            kv_cache, k_new, v_new, batch.page[r.lo : r.hi], batch.offset[r.lo : r.hi],
            status=status,
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
    want_lse = return_lse or gc.merges or fold is not None
    states = []
    if gc.ragged is not None:
        wrapper = batch.planned[(args.index, "ragged")]
        states.append(wrapper.run(q, k_new, v_new, return_lse=want_lse))
    if gc.paged is not None:
        wrapper = batch.planned[(args.index, "paged")]
        if in_kernel:  # the sink wrapper's run(q, cache, sinks, sm_scale)
            scale = group.scale_for(spec.heads.head_dim)
            states.append(wrapper.run(q, kv_cache, sinks, scale, return_lse=want_lse))
        else:
            states.append(wrapper.run(q, kv_cache, return_lse=want_lse))
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
