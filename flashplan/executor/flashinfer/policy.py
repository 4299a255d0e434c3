"""Kernel choices of the FlashInfer executor (:class:`ExecutorPolicy`; the defaults'
measurements are in ``docs/benchmarks.md``) and its checked settings
(:class:`ExecutorSettings`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs
import torch

from flashplan.errors import OptionError, UnsupportedError, as_option
from flashplan.layout.convert import as_bool
from flashplan.layout.heads import HeadConfig
from flashplan.planning.parts import GroupPlan

if TYPE_CHECKING:
    from flashplan.executor.flashinfer.xqa import XqaBuffers

__all__ = [
    "TENSOR_CORE_MIN_BATCH", "XQA_PAGE_SIZES", "ExecutorPolicy", "ExecutorSettings",
    "decode_uses_tensor_cores", "decode_uses_xqa", "prefill_backend", "split_kwargs",
    "xqa_refusal",
]  # fmt: skip

_FA3_DTYPES = (torch.float16, torch.bfloat16)
_FA3_HEAD_DIMS = (64, 128, 256)


def _backend(field: str, value: object) -> str:
    if value not in ("auto", "fa2", "fa3"):
        raise OptionError(field, "must be 'auto', 'fa2' or 'fa3'", value=value)
    return str(value)


def _decode_backend(value: object) -> str:
    if value not in ("auto", "fa2", "xqa"):
        raise OptionError("decode_backend", "must be 'auto', 'fa2' or 'xqa'", value=value)
    return str(value)


def _optional_bool(field: str, value: object) -> bool | None:
    return None if value is None else as_option(as_bool, field, value)


@attrs.frozen
class ExecutorPolicy:
    """Which FlashInfer kernels to use.

    Attributes:
        decode_tensor_cores: ``True``/``False`` forces the decode kernel kind;
            ``None`` lets :func:`decode_uses_tensor_cores` decide.
        prefill_backend: ``"fa2"``, ``"fa3"`` or ``"auto"`` (:func:`prefill_backend`
            decides per call). Calls with a custom mask or multi-item tensors always
            use FA2.
        decode_backend: ``"xqa"`` runs every decode call on FlashInfer's XQA kernel
            (TensorRT-LLM's; ``docs/guide-fp8.md``) and refuses, naming the group, one it
            cannot run (:func:`xqa_refusal`); ``"fa2"`` never uses it; ``"auto"``
            (:func:`decode_uses_xqa`) uses it where it was measured faster: e4m3 caches
            on Hopper. XQA returns no LSE: ``run(..., return_lse=True)`` on a group it
            runs is refused.
        deterministic: batch-invariant results, bit-identical whatever else is in the
            batch and between an eager step and a CUDA-graph replay: tensor-core decode,
            ``disable_split_kv``, FA2 under ``"auto"``, no ragged paths
            (``docs/guide-cuda-graphs.md``).
    """

    decode_tensor_cores: bool | None = attrs.field(
        default=None, converter=lambda v: _optional_bool("decode_tensor_cores", v)
    )
    prefill_backend: str = attrs.field(
        default="auto", converter=lambda v: _backend("prefill_backend", v)
    )
    deterministic: bool = attrs.field(
        default=False, converter=lambda v: as_option(as_bool, "deterministic", v)
    )
    decode_backend: str = attrs.field(default="auto", converter=_decode_backend)

    def __attrs_post_init__(self) -> None:
        if self.deterministic and self.decode_tensor_cores is False:
            raise OptionError(
                "decode_tensor_cores", "deterministic mode runs decode on tensor cores (the "
                "CUDA-core kernel has no fixed split)", decode_tensor_cores=False,
            )  # fmt: skip


#: Smallest decode batch that goes to the tensor-core kernel by default.
TENSOR_CORE_MIN_BATCH = 4


def decode_uses_tensor_cores(heads: HeadConfig, policy: ExecutorPolicy, batch_size: int) -> bool:
    """Tensor-core decode for batches of :data:`TENSOR_CORE_MIN_BATCH` or more (always in
    deterministic mode), CUDA cores below, unless the policy forces one."""
    if policy.deterministic:
        return True
    if policy.decode_tensor_cores is not None:
        return policy.decode_tensor_cores
    del heads  # the head layout does not move the crossover
    return batch_size >= TENSOR_CORE_MIN_BATCH


#: Page sizes XQA's kernels are built for.
XQA_PAGE_SIZES = (16, 32, 64, 128)
_XQA_Q_DTYPES = (torch.float16, torch.bfloat16)


def xqa_refusal(
    gp: GroupPlan, heads: HeadConfig, page_size: int, *, multi_item: bool, cascade: bool
) -> str | None:
    """Why XQA cannot run group ``gp``'s decode call (``None``: it can): XQA takes fp16 /
    bf16 queries over an e4m3 cache or one of the queries' dtype, output in the queries'
    dtype, pages of :data:`XQA_PAGE_SIZES`, head_dim a multiple of 16 up to 256, a window
    and sinks; it has no soft cap, custom mask, multi-item tensors, cross-attention
    (a request with no keys), virtual requests, or returned LSE (so no cascade levels)."""
    q, kv = heads.q_dtype, heads.kv_dtype
    if q not in _XQA_Q_DTYPES:
        return f"its queries are {q} (XQA takes float16 or bfloat16)"
    if kv not in (torch.float8_e4m3fn, q):
        return f"its cache is {kv} (XQA takes float8_e4m3fn or the queries' dtype)"
    if heads.out_dtype != q:
        return f"its output dtype {heads.out_dtype} is not the queries' {q}"
    if page_size not in XQA_PAGE_SIZES:
        return f"its page size {page_size} is not one of {XQA_PAGE_SIZES}"
    if heads.head_dim % 16 or heads.head_dim > 256:
        return f"its head_dim {heads.head_dim} is not a multiple of 16 up to 256"
    group = gp.group
    reasons = (
        (bool(group.logits_soft_cap), "it has a soft cap"),
        (group.cross_attention, "it is a cross-attention group"),
        (gp.uses_custom_mask, "its call carries a custom mask"),
        (multi_item, "it has multi-item tensors"),
        (gp.virtual is not None, "it is split into virtual requests"),
        (cascade, "it runs on cascade levels (merged by LSE)"),
    )
    return next((why for hit, why in reasons if hit), None)


def decode_uses_xqa(heads: HeadConfig, policy: ExecutorPolicy, *, sm90: bool) -> bool:
    """Whether a batch's decode calls go to XQA (each one :func:`xqa_refusal` allows):
    always under ``"xqa"``, never under ``"fa2"``; under ``"auto"``, e4m3 caches on Hopper
    (sm_90), where XQA reads the cache at the copy bandwidth (``docs/benchmarks.md``)."""
    if policy.decode_backend != "auto":
        return policy.decode_backend == "xqa"
    return sm90 and heads.kv_dtype == torch.float8_e4m3fn


def prefill_backend(
    heads: HeadConfig,
    policy: ExecutorPolicy,
    *,
    custom_mask: bool,
    sm90: bool,
    multi_item: bool = False,
    sinks: bool = False,
) -> str:
    """FlashInfer prefill backend for one call, ``"fa2"`` or ``"fa3"``: ``"auto"`` picks
    FA3 on Hopper (sm_90) for fp16/bf16 and head_dim 64/128/256, else FA2 (and in
    deterministic mode). Calls with a custom mask, multi-item tensors or sinks run on FA2.

    Raises:
        UnsupportedError: ``"fa3"`` forced for heads its kernels do not take.
    """
    if custom_mask or multi_item or sinks:
        return "fa2"
    fa3_kernels = (
        heads.q_dtype in _FA3_DTYPES
        and heads.kv_dtype == heads.q_dtype
        and heads.head_dim in _FA3_HEAD_DIMS
    )
    if policy.prefill_backend == "fa3" and not fa3_kernels:
        raise UnsupportedError(
            "prefill_backend", f"'fa3' needs fp16/bf16 q and kv of one dtype and head_dim in "
            f"{_FA3_HEAD_DIMS} (use 'auto' or 'fa2')", q_dtype=heads.q_dtype,
            kv_dtype=heads.kv_dtype, head_dim=heads.head_dim,
        )  # fmt: skip
    if policy.prefill_backend != "auto":
        return policy.prefill_backend
    return "fa3" if sm90 and fa3_kernels and not policy.deterministic else "fa2"


def split_kwargs(policy: ExecutorPolicy) -> list[tuple[str, object]]:
    """The KV-split arguments of a ``plan()`` call: none by default; ``disable_split_kv``
    in deterministic mode, so that no request's result depends on the batch."""
    return [("disable_split_kv", True)] if policy.deterministic else []


@attrs.frozen(eq=False)
class ExecutorSettings:
    """A FlashInfer executor's checked construction arguments, shared with its graph
    executors; ``workspace``: uint8 ``[workspace_bytes]``, zeroed, every wrapper's float
    workspace; ``sink_decode``: ``flashinfer`` has ``BatchDecodeWithAttentionSinkWrapper``."""

    device: torch.device
    flashinfer: Any
    policy: ExecutorPolicy
    workspace_bytes: int
    workspace: torch.Tensor
    page_map: torch.Tensor | None
    check_pages: bool
    sm90: bool
    sink_decode: bool
    twin: bool = False
    xqa: XqaBuffers | None = None
