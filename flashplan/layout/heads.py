"""`HeadConfig`: head counts, head size and dtypes of the attention layers."""

from __future__ import annotations

import attrs
import torch

from flashplan.errors import LayoutError
from flashplan.layout.convert import as_int

__all__ = ["HeadConfig"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _float_dtype(
    instance: HeadConfig, attribute: attrs.Attribute[torch.dtype], value: torch.dtype
) -> None:
    if not isinstance(value, torch.dtype) or value not in _FLOAT_DTYPES:
        raise LayoutError(
            attribute.name, "must be torch.float16, torch.bfloat16 or torch.float32", value=value
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
        kv_dtype: dtype of the KV cache and of new K/V (default: ``q_dtype``).
        out_dtype: dtype of the attention output (default: ``q_dtype``).
    """

    num_qo_heads: int = attrs.field(converter=lambda v: as_int("num_qo_heads", v, minimum=1))
    num_kv_heads: int = attrs.field(converter=lambda v: as_int("num_kv_heads", v, minimum=1))
    head_dim: int = attrs.field(converter=lambda v: as_int("head_dim", v, minimum=1))
    q_dtype: torch.dtype = attrs.field(default=torch.bfloat16, validator=_float_dtype)
    kv_dtype: torch.dtype = attrs.field(validator=_float_dtype)
    out_dtype: torch.dtype = attrs.field(validator=_float_dtype)

    @kv_dtype.default
    def _kv_dtype_default(self) -> torch.dtype:
        return self.q_dtype

    @out_dtype.default
    def _out_dtype_default(self) -> torch.dtype:
        return self.q_dtype

    def __attrs_post_init__(self) -> None:
        if self.num_qo_heads % self.num_kv_heads:
            raise LayoutError(
                "num_kv_heads",
                "must divide num_qo_heads",
                num_qo_heads=self.num_qo_heads,
                num_kv_heads=self.num_kv_heads,
            )

    @property
    def group_size(self) -> int:
        """Query heads per KV head (1 = MHA)."""
        return self.num_qo_heads // self.num_kv_heads
