"""Kernel choices of the FlashInfer executor: a documented, overridable policy.

The defaults come from measurements on an H200 (``benchmarks/run_gpu.py``;
figures in ``docs/benchmarks.md``). Override any field by passing your own
:class:`ExecutorPolicy` to :class:`~flashplan.executor.flashinfer.FlashInferExecutor`
(and the extend path through ``flashplan.plan(..., extend_path=...)``).
"""

from __future__ import annotations

import attrs
import torch

from flashplan.layout.heads import HeadConfig

__all__ = ["ExecutorPolicy", "decode_uses_tensor_cores", "prefill_backend"]

_FA3_DTYPES = (torch.float16, torch.bfloat16)
_FA3_HEAD_DIMS = (64, 128, 256)


@attrs.frozen
class ExecutorPolicy:
    """Which FlashInfer kernels to use.

    Attributes:
        decode_tensor_cores: ``True``/``False`` forces the decode kernel kind;
            ``None`` lets :func:`decode_uses_tensor_cores` decide.
        prefill_backend: ``"fa2"``, ``"fa3"`` or ``"auto"`` (:func:`prefill_backend`
            decides per call). Calls with a custom mask always use FA2.
    """

    decode_tensor_cores: bool | None = None
    prefill_backend: str = attrs.field(
        default="auto", validator=attrs.validators.in_(("auto", "fa2", "fa3"))
    )


def decode_uses_tensor_cores(heads: HeadConfig, policy: ExecutorPolicy) -> bool:
    """Decode on the tensor-core (prefill) kernel unless the policy says otherwise.

    Measured on the H200 (bf16, head_dim 128, 32 query / 8 KV heads): the
    tensor-core kernel reads the cache at the copy bandwidth, the CUDA-core
    decode kernel at about 70% of it; see ``docs/benchmarks.md``.
    """
    if policy.decode_tensor_cores is not None:
        return policy.decode_tensor_cores
    del heads
    return True


def prefill_backend(
    heads: HeadConfig, policy: ExecutorPolicy, *, custom_mask: bool, sm90: bool
) -> str:
    """FlashInfer prefill backend for one call: ``"fa2"`` or ``"fa3"``.

    ``"auto"`` picks FA3 on Hopper (sm_90) for fp16/bf16 and head_dim 64/128/256
    without a custom mask (measured ~1.4x faster than FA2 for a 16 x (2048 + 512)
    extend on an H200), FA2 otherwise.
    """
    if custom_mask:
        return "fa2"
    if policy.prefill_backend != "auto":
        return policy.prefill_backend
    fa3_ok = (
        sm90
        and heads.q_dtype in _FA3_DTYPES
        and heads.kv_dtype == heads.q_dtype
        and heads.head_dim in _FA3_HEAD_DIMS
    )
    return "fa3" if fa3_ok else "fa2"
