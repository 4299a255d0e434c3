"""Argument checks shared by every executor ("plan = run"), all before any write.

Everything here reads tensor metadata only (type, shape, dtype, device, layout): no
device access, no sync.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
import torch

from flashplan.errors import OptionError, PageTableError, PlanMismatchError, RunTypeError
from flashplan.fp8 import Scale, check_scale
from flashplan.layout.group import AttentionGroup
from flashplan.layout.heads import HeadConfig
from flashplan.layout.page_table import PageTable
from flashplan.planning.spec import GroupPlan, PlanSpec

__all__ = [
    "RunArgs",
    "check_apply_args",
    "check_page_map",
    "check_run_args",
    "first_shared_slot",
]


def _tensor(name: str, t: object, device: torch.device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise RunTypeError(name, "expected a torch.Tensor", type=type(t).__name__)
    if t.layout != torch.strided:
        raise PlanMismatchError(name, "expected a dense tensor", layout=str(t.layout))
    if t.device != device:
        raise PlanMismatchError(
            name, "not on the device the plan was applied on", device=str(t.device),
            applied_on=str(device),
        )  # fmt: skip
    return t


def _expect(name: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if tuple(t.shape) != shape:
        raise PlanMismatchError(
            name, "shape differs from the plan's", planned=shape, shape=tuple(t.shape)
        )
    if t.dtype != dtype:
        raise PlanMismatchError(name, "dtype differs from the plan's", planned=dtype, dtype=t.dtype)


#: Device types whose tensors hold no data: an executor could not read page ids there.
_UNREADABLE_DEVICES = frozenset({"meta"})


def check_apply_args(spec: object, table: object) -> tuple[PlanSpec, PageTable]:
    """Check ``apply``'s arguments' types, that the table's page ids can be read, and
    that the table covers the plan.

    Raises:
        PlanMismatchError: ``spec`` is not a PlanSpec or ``table`` not a PageTable.
        PageTableError: the table's ``pages`` live on a device without data (``meta``),
            or the table is too small for the plan.
    """
    if not isinstance(spec, PlanSpec):
        raise RunTypeError("spec", "expected a PlanSpec", type=type(spec).__name__)
    if not isinstance(table, PageTable):
        raise RunTypeError("table", "expected a PageTable", type=type(table).__name__)
    device = table.pages.device  # metadata only: no device access
    if device.type in _UNREADABLE_DEVICES:
        raise PageTableError(
            "pages",
            "must hold readable page ids: a tensor on this device has no data to gather",
            device=str(device),
        )
    table.check_covers(spec.pages_needed)
    return spec, table


@attrs.frozen(eq=False)
class RunArgs:
    """The checked arguments of one ``run`` call.

    Attributes:
        index: the group's position in ``spec.group_plans``.
        plan: the group's plan.
        writes: whether ``k_new`` / ``v_new`` are written into the cache.
        k_scale, v_scale: an fp8 cache's per-tensor scales (:mod:`flashplan.fp8`: a
            number or a 0-d float32 tensor); 1.0 for any other cache.
    """

    index: int
    plan: GroupPlan
    writes: bool
    k_scale: Scale = 1.0
    v_scale: Scale = 1.0


def check_run_args(
    spec: PlanSpec | None,
    device: torch.device | None,
    group: object,
    q: object,
    k_new: object,
    v_new: object,
    kv_cache: object,
    return_lse: object,
    *,
    total_q: int | None = None,
    sinks: object = None,
    k_scale: object = None,
    v_scale: object = None,
    read_scales: bool = True,
) -> RunArgs:
    """Check a ``run`` call against the applied plan, before anything is written.

    ``kv_cache`` may be ``None`` only for a group whose plan has no paged call (the
    ragged path: attention over ``k_new`` / ``v_new`` alone, nothing cached).
    ``total_q`` overrides the plan's query rows (a CUDA-graph bucket runs its own).

    Raises:
        PlanMismatchError: nothing applied; the group was not planned; a tensor that
            is not a dense torch tensor on the applied device, or whose shape or dtype
            contradicts the plan; a ragged group without ``k_new``; a missing cache;
            ``return_lse`` that is not a bool; sink logits missing for a sink group,
            given to a group without sinks, or not float32 ``[num_qo_heads]`` on the
            applied device; scales given for a cache that is not fp8, or a scale that is
            not positive and finite (:func:`flashplan.fp8.check_scale`; a tensor's
            value only with ``read_scales``, which reads it back).
    """
    if spec is None or device is None:
        raise PlanMismatchError("spec", "run() before apply(): apply a PlanSpec first")
    index = spec.group_index(group)  # type: ignore[arg-type]
    gp = spec.group_plans[index]
    assert isinstance(group, AttentionGroup)
    if not isinstance(return_lse, bool):
        raise RunTypeError("return_lse", "expected a bool", value=return_lse)
    heads = spec.heads
    _check_sinks(sinks, gp.sinks, heads.num_qo_heads, device)
    d = heads.head_dim
    q_rows = spec.total_q if total_q is None else total_q
    _expect("q", _tensor("q", q, device), (q_rows, heads.num_qo_heads, d), heads.q_dtype)
    if (k_new is None) != (v_new is None):
        raise PlanMismatchError("k_new", "k_new and v_new must both be given or both be None")
    writes = k_new is not None
    if writes:
        rows = spec.total_encoder if group.cross_attention else q_rows
        for name, t in (("k_new", k_new), ("v_new", v_new)):
            _expect(
                name, _tensor(name, t, device), (rows, heads.num_kv_heads, d),
                heads.kv_input_dtype,
            )  # fmt: skip
    elif gp.ragged is not None:
        raise PlanMismatchError(
            "k_new", "the group runs on the ragged path: pass k_new and v_new",
            group=group.describe(),
        )  # fmt: skip
    scales = _scales(heads, k_scale, v_scale, device, read_scales)
    if kv_cache is None:
        if gp.paged is not None:
            raise PlanMismatchError(
                "kv_cache", "the group reads the paged KV cache; only ragged-path groups run "
                "without a cache", group=group.describe(), path=gp.path.value,
            )  # fmt: skip
        return RunArgs(index, gp, False, *scales)
    cache = _tensor("kv_cache", kv_cache, device)
    want: tuple[Any, ...] = (2, spec.page_size, heads.num_kv_heads, d)
    if cache.dim() != 5 or tuple(cache.shape[1:]) != want:
        raise PlanMismatchError(
            "kv_cache", "expected [num_pages, 2, page_size, num_kv_heads, head_dim] = "
            f"[*, 2, {spec.page_size}, {heads.num_kv_heads}, {d}]", shape=tuple(cache.shape),
        )  # fmt: skip
    if cache.dtype != heads.kv_dtype:
        raise PlanMismatchError(
            "kv_cache", "dtype differs from the plan's", planned=heads.kv_dtype, dtype=cache.dtype
        )
    return RunArgs(index, gp, writes, *scales)


def _scales(
    heads: HeadConfig, k_scale: object, v_scale: object, device: torch.device, read: bool
) -> tuple[Scale, Scale]:
    """An fp8 cache's scales, checked; none for another cache."""
    if not heads.kv_is_fp8:
        for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
            if value is not None:
                raise PlanMismatchError(
                    name, "scales are for fp8 KV caches: pass None",
                    kv_dtype=heads.kv_dtype, type=type(value).__name__,
                )  # fmt: skip
        return 1.0, 1.0
    return (
        check_scale("k_scale", k_scale, device, read=read),
        check_scale("v_scale", v_scale, device, read=read),
    )


def _check_sinks(sinks: object, wanted: bool, num_qo_heads: int, device: torch.device) -> None:
    """A sink group's ``run`` takes its sink logits, float32 ``[num_qo_heads]`` on the
    applied device; other groups take none."""
    if not wanted:
        if sinks is not None:
            raise PlanMismatchError(
                "sinks", "the group was planned without attention sinks: pass sinks=None",
                type=type(sinks).__name__,
            )  # fmt: skip
        return
    if sinks is None:
        raise PlanMismatchError(
            "sinks", "the group was planned with attention sinks: pass its sink logits, a "
            "float32 [num_qo_heads] tensor",
        )  # fmt: skip
    t = _tensor("sinks", sinks, device)
    _expect("sinks", t, (num_qo_heads,), torch.float32)


def check_page_map(page_map: object, device: torch.device | None = None) -> torch.Tensor | None:
    """An executor's ``page_map`` (full-pool page id -> sliding-window pool page id, a
    negative entry: evicted), checked: ``None``, or an int32 1-D tensor (on ``device``
    where one is given: the FlashInfer executor's).

    Raises:
        OptionError: anything else.
    """
    if page_map is None:
        return None
    if (
        not isinstance(page_map, torch.Tensor)
        or page_map.dtype != torch.int32
        or page_map.dim() != 1
        or (device is not None and page_map.device != device)
    ):
        where = "" if device is None else f" on {device}"
        raise OptionError(
            "page_map", f"must be an int32 1-D tensor{where}", value=type(page_map).__name__
        )
    return page_map


def first_shared_slot(flat: npt.NDArray[np.int64]) -> tuple[int, int] | None:
    """The first two entries of ``flat`` (int ``[n]`` cache slots, ``page * page_size +
    offset``) that name one slot, as indices into ``flat`` (the earlier first), taking the
    slots in sorted order; ``None`` when every slot is distinct. Both executors' write
    collision checks."""
    order = np.argsort(flat, kind="stable")
    same = np.flatnonzero(flat[order[1:]] == flat[order[:-1]])
    if not same.size:
        return None
    k = int(same[0])
    return int(order[k]), int(order[k + 1])
