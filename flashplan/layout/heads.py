"""`HeadConfig`: head counts, head size and dtypes of the attention layers."""

from __future__ import annotations

import attrs
import torch

from flashplan.errors import LayoutError
from flashplan.layout.convert import as_int

__all__ = ["FP8_DTYPES", "HeadConfig"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: The 8-bit float formats a KV cache may be stored in (with fp16 / bf16 queries).
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _float_dtype(
    instance: HeadConfig, attribute: attrs.Attribute[torch.dtype], value: torch.dtype
) -> None:
    if not isinstance(value, torch.dtype) or value not in _FLOAT_DTYPES:
        raise LayoutError(
            attribute.name, "must be torch.float16, torch.bfloat16 or torch.float32", value=value
        )


def _cache_dtype(
    instance: HeadConfig, attribute: attrs.Attribute[torch.dtype], value: torch.dtype
) -> None:
    if not isinstance(value, torch.dtype) or value not in (*_FLOAT_DTYPES, *FP8_DTYPES):
        raise LayoutError(
            attribute.name,
            "must be torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn or "
            "torch.float8_e5m2",
            value=value,
        )


@attrs.frozen(cache_hash=True)  # a dict key every step: hashed once
class HeadConfig:
    """Shapes and dtypes shared by every layer of a plan.

    Attributes:
        num_qo_heads: query/output heads per token.
        num_kv_heads: key/value heads per token; must divide ``num_qo_heads``
            (MHA: equal, GQA: fewer, MQA: 1).
        head_dim: size of one head (elements).
        q_dtype: dtype of queries (default ``torch.bfloat16``).
        kv_dtype: dtype of the KV cache (default: ``q_dtype``): ``q_dtype`` or another
            float, or an 8-bit float (``torch.float8_e4m3fn``, ``torch.float8_e5m2``)
            with fp16 / bf16 queries. New K/V come in :attr:`kv_input_dtype`; an fp8
            cache stores them quantized by a per-tensor scale (``docs/semantics.md``,
            "FP8 KV cache").
        out_dtype: dtype of the attention output (default: ``q_dtype``).

    Raises:
        LayoutError: a dtype outside these, an fp8 cache with fp32 queries, or a head
            count that does not divide.
    """

    num_qo_heads: int = attrs.field(converter=lambda v: as_int("num_qo_heads", v, minimum=1))
    num_kv_heads: int = attrs.field(converter=lambda v: as_int("num_kv_heads", v, minimum=1))
    head_dim: int = attrs.field(converter=lambda v: as_int("head_dim", v, minimum=1))
    q_dtype: torch.dtype = attrs.field(default=torch.bfloat16, validator=_float_dtype)
    kv_dtype: torch.dtype = attrs.field(validator=_cache_dtype)
    out_dtype: torch.dtype = attrs.field(validator=_float_dtype)

    @kv_dtype.default
    def _kv_dtype_default(self) -> torch.dtype:
        return self.q_dtype

    @out_dtype.default
    def _out_dtype_default(self) -> torch.dtype:
        return self.q_dtype

    def __attrs_post_init__(self) -> None:
        if self.kv_is_fp8 and self.q_dtype not in (torch.float16, torch.bfloat16):
            raise LayoutError(
                "kv_dtype",
                "an fp8 KV cache takes float16 or bfloat16 queries",
                kv_dtype=self.kv_dtype,
                q_dtype=self.q_dtype,
            )
        if self.num_qo_heads % self.num_kv_heads:
            raise LayoutError(
                "num_kv_heads",
                "must divide num_qo_heads",
                num_qo_heads=self.num_qo_heads,
                num_kv_heads=self.num_kv_heads,
            )

    def shard(self, world_size: int) -> HeadConfig:
        """One rank's heads under tensor parallelism over ``world_size`` ranks: each
        rank holds a contiguous block of ``num_qo_heads / world_size`` query heads and
        the ``num_kv_heads / world_size`` KV heads they read (query head ``h`` of a rank
        reads its KV head ``h // group_size``, as on one device). Every rank plans the
        same layout with this config.

        Raises:
            LayoutError: ``world_size`` below 1, or not dividing ``num_kv_heads``
                (a KV head is not split across ranks).
        """
        world = as_int("world_size", world_size, minimum=1)
        if self.num_kv_heads % world:
            raise LayoutError(
                "num_kv_heads",
                "must be divisible by the tensor-parallel world size",
                num_kv_heads=self.num_kv_heads,
                world_size=world,
            )
        return attrs.evolve(
            self, num_qo_heads=self.num_qo_heads // world, num_kv_heads=self.num_kv_heads // world
        )

    @property
    def kv_is_fp8(self) -> bool:
        """Whether the KV cache is stored in an 8-bit float format (quantized)."""
        return self.kv_dtype in FP8_DTYPES

    @property
    def kv_input_dtype(self) -> torch.dtype:
        """dtype of the new K/V a step writes: ``kv_dtype``, or for an fp8 cache the
        queries' dtype (the model's projections, quantized on write)."""
        return self.q_dtype if self.kv_is_fp8 else self.kv_dtype

    @property
    def group_size(self) -> int:
        """Query heads per KV head (1 = MHA)."""
        return self.num_qo_heads // self.num_kv_heads
