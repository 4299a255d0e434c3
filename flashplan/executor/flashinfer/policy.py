"""Kernel choices of the FlashInfer executor: a documented, overridable policy.

The defaults come from measurements on an H200 (``benchmarks/run_gpu.py``;
figures in ``docs/benchmarks.md``). Override any field by passing your own
:class:`ExecutorPolicy` to :class:`~flashplan.executor.flashinfer.FlashInferExecutor`
(and the extend path through ``flashplan.plan(..., extend_path=...)``).
"""

from __future__ import annotations

import attrs
import torch

from flashplan.errors import OptionError, UnsupportedError, as_option
from flashplan.layout.convert import as_bool
from flashplan.layout.heads import HeadConfig

__all__ = [
    "TENSOR_CORE_MIN_BATCH",
    "ExecutorPolicy",
    "decode_uses_tensor_cores",
    "prefill_backend",
    "split_kwargs",
]

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
        deterministic: batch-invariant results (what sglang's
            ``enable_deterministic_inference`` is for): one request's output is
            bit-identical whatever else is in the batch, wherever it sits, and
            between an eager step and a CUDA-graph replay. Decode always runs on
            tensor cores, no kernel splits a request's KV across work items
            (``disable_split_kv``: nothing is reduced in a batch-dependent order),
            ``prefill_backend="auto"`` means FA2 (the backend CUDA graphs replay, so
            an eager extend and its replay run the same kernel), and plans on a ragged
            path are refused (plan with
            ``extend_path="paged"``: otherwise a request's kernels would depend on
            the rest of the batch). See ``docs/guide-cuda-graphs.md`` for why this
            differs from the reference file's fixed split tiles.
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
                "decode_tensor_cores",
                "deterministic mode runs decode on tensor cores (the CUDA-core kernel "
                "has no fixed split)",
                decode_tensor_cores=False,
            )


#: Smallest decode batch that goes to the tensor-core kernel by default.
TENSOR_CORE_MIN_BATCH = 4


def decode_uses_tensor_cores(heads: HeadConfig, policy: ExecutorPolicy, batch_size: int) -> bool:
    """Tensor-core (prefill-kernel) decode for batches of 4 or more, CUDA cores below.

    Measured on the H200 (bf16, head_dim 128, kv 4096, page 16; ``docs/benchmarks.md``):
    from batch 16 up the tensor-core kernel is 1.3-2.4x faster for GQA (32/8, 32/4)
    and reaches the copy bandwidth at batch 64+ where the CUDA-core kernel reaches
    about 70% of it; MHA (32/32) is within 3% either way. At batch 1 the CUDA-core
    kernel is faster (18-33 us vs 29-44 us); at batch 4 they tie or tensor cores
    win. The choice selects a wrapper (part of its key), never the plan.
    """
    if policy.deterministic:
        return True
    if policy.decode_tensor_cores is not None:
        return policy.decode_tensor_cores
    del heads  # measured: the head layout does not move the crossover
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
    """FlashInfer prefill backend for one call: ``"fa2"`` or ``"fa3"``.

    ``"auto"`` picks FA3 on Hopper (sm_90) for fp16/bf16 and head_dim 64/128/256
    without a custom mask (measured ~1.4x faster than FA2 for a 16 x (2048 + 512)
    extend on an H200), FA2 otherwise, and FA2 in deterministic mode (the backend
    CUDA-graph replays use, so eager and replayed extends agree bit for bit). Calls
    with a custom mask or multi-item tensors
    always run on FA2, whatever the policy: FlashInfer 0.7.4's FA3 kernels carry the
    multi-item rule too (``hopper/mainloop_mma.cuh``), but the reference file and
    flashplan's GPU tests use FA2 only. Calls on FlashInfer's attention-sink kernel
    (``sinks``) run on its FA2 variant too: its FA3 variant is a separate JIT module of
    several minutes' build per variant, which flashplan's GPU tests have not run.
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
    """The KV-split arguments of a ``plan()`` call: none by default (FlashInfer splits
    long requests across work items as the batch suggests); ``disable_split_kv`` in
    deterministic mode, so that no request's result depends on the batch. (A fixed
    split tile, the reference file's eager choice, cannot be replayed in a CUDA graph:
    FlashInfer's graph plans must keep their split decision, which a fixed tile makes
    depend on the batch.)"""
    return [("disable_split_kv", True)] if policy.deterministic else []
