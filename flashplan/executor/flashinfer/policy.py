"""Kernel choices of the FlashInfer executor (:class:`ExecutorPolicy`; the defaults'
measurements are in ``docs/benchmarks.md``) and its checked settings
(:class:`ExecutorSettings`)."""

from __future__ import annotations

from typing import Any

import attrs
import torch

from flashplan.errors import OptionError, UnsupportedError, as_option
from flashplan.layout.convert import as_bool
from flashplan.layout.heads import HeadConfig

__all__ = [
    "TENSOR_CORE_MIN_BATCH", "ExecutorPolicy", "ExecutorSettings", "decode_uses_tensor_cores",
    "prefill_backend", "split_kwargs",
]  # fmt: skip

_FA3_DTYPES = (torch.float16, torch.bfloat16)
_FA3_HEAD_DIMS = (64, 128, 256)


def _backend(field: str, value: object) -> str:
    if value not in ("auto", "fa2", "fa3"):
        raise OptionError(field, "must be 'auto', 'fa2' or 'fa3'", value=value)
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
