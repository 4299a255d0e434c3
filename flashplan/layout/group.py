"""`AttentionGroup`: the static description of one kind of attention layer."""

from __future__ import annotations

import math
from collections.abc import Iterable

import attrs
import numpy as np
import torch

from flashplan.errors import FieldTypeError, LayoutError
from flashplan.layout.convert import as_bool, as_int, as_real

__all__ = ["DEFAULT_GROUPS", "AttentionGroup", "as_groups"]


def _window(field: str, value: object) -> int:
    # Any magnitude: a window at least as long as the sequence is full attention.
    return as_int(field, value, minimum=-1, maximum=2**63 - 1)


def _chunk(field: str, value: object) -> int:
    return as_int(field, value, minimum=0, maximum=2**31 - 1)


def _soft_cap(field: str, value: object) -> float:
    cap = as_real(field, value)
    if cap < 0:
        raise LayoutError(field, "must be >= 0 (0 = off)", logits_soft_cap=value)
    return cap


def _sm_scale(field: str, value: object) -> float | None:
    if value is None:
        return None
    scale = as_real(field, value)
    if scale <= 0:
        raise LayoutError(field, "must be > 0, or None for 1/sqrt(head_dim)", sm_scale=value)
    return scale


@attrs.frozen(cache_hash=True)  # a dict key every step: hashed once
class AttentionGroup:
    """One kind of attention layer; every layer of a group shares one plan.

    A model with global and sliding-window layers has two groups; an
    encoder-decoder model adds a cross-attention group. Groups are hashable and
    compare by value: they are part of a plan's static key.

    Every field is validated before it is normalised: numbers must be real numbers
    (``Fraction`` and ``Decimal`` become floats; strings, complex numbers, tensors and
    bools are refused) and flags must be bools.

    Attributes:
        window_left: sliding window, FlashInfer/sglang convention: a query at
            position ``p`` sees keys ``p - window_left <= k <= p`` (``window_left + 1``
            keys). ``-1`` means full attention. A Hugging Face ``sliding_window`` of
            ``S`` is ``window_left = S - 1``. Any size is accepted; a window at least as
            long as a sequence shows that sequence in full. On a non-causal group it is
            the left bound of a bidirectional window (with ``window_right``).
        cross_attention: attend to the request's encoder tokens instead of the
            decoder tokens. Cross groups are non-causal and have no window, chunk or
            right bound.
        causal: a query sees keys up to its own position (bottom-right aligned);
            ``False`` lets every new token see every key of the request.
        window_right: the right bound of a bidirectional window (tokens): a query of
            a non-causal self group at position ``p`` sees keys
            ``p - window_left <= k <= p + window_right`` (and ``k < seq_len``).
            ``-1`` = no window; a non-causal group sets both bounds or neither, and a
            causal group keeps ``-1`` (its right bound is the query itself).
        attention_chunk_size: chunked local attention (Llama 4's
            ``attention_chunk_size``, tokens): a causal query at position ``p`` sees
            keys ``C * (p // C) <= k <= p``. ``0`` = off. Causal self groups only, and
            not together with a sliding window.
        sinks: the group has attention sinks (gpt-oss): one learned logit per query
            head joins every softmax denominator with no value. The logits are a
            run-time float32 ``[num_qo_heads]`` tensor passed to ``run`` like ``q``;
            the plan fixes that the group has them.
        logits_soft_cap: ``cap * tanh(logits / cap)`` before the softmax; 0 = off.
        sm_scale: softmax scale; ``None`` means ``1 / sqrt(head_dim)``. A group does
            not know its head size, so ``sm_scale=None`` and an explicit
            ``1 / sqrt(head_dim)`` are different records; :func:`flashplan.plan`
            resolves both to the same group (:meth:`resolved`) and plans it once.
    """

    window_left: int = attrs.field(default=-1, converter=lambda v: _window("window_left", v))
    cross_attention: bool = attrs.field(
        default=False, converter=lambda v: as_bool("cross_attention", v)
    )
    causal: bool = attrs.field(default=True, converter=lambda v: as_bool("causal", v))
    logits_soft_cap: float = attrs.field(
        default=0.0, converter=lambda v: _soft_cap("logits_soft_cap", v)
    )
    sm_scale: float | None = attrs.field(default=None, converter=lambda v: _sm_scale("sm_scale", v))
    window_right: int = attrs.field(default=-1, converter=lambda v: _window("window_right", v))
    attention_chunk_size: int = attrs.field(
        default=0, converter=lambda v: _chunk("attention_chunk_size", v)
    )
    sinks: bool = attrs.field(default=False, converter=lambda v: as_bool("sinks", v))

    def __attrs_post_init__(self) -> None:
        if self.cross_attention and self.causal:
            raise LayoutError(
                "causal",
                "cross-attention is non-causal: pass causal=False (or use AttentionGroup.cross())",
                cross_attention=True,
                causal=True,
            )
        if self.cross_attention and (
            self.window_left >= 0 or self.window_right >= 0 or self.attention_chunk_size
        ):
            raise LayoutError(
                "window_left"
                if self.window_left >= 0
                else "window_right"
                if self.window_right >= 0
                else "attention_chunk_size",
                "a cross group sees every encoder key: no window, right bound or chunk",
                window_left=self.window_left,
                window_right=self.window_right,
                attention_chunk_size=self.attention_chunk_size,
            )
        if self.causal and self.window_right >= 0:
            raise LayoutError(
                "window_right",
                "a right window bound needs a non-causal group (a causal query sees no key "
                "after itself)",
                window_right=self.window_right,
                causal=True,
            )
        if not self.causal and (self.window_left >= 0) != (self.window_right >= 0):
            raise LayoutError(
                "window_left" if self.window_left >= 0 else "window_right",
                "a sliding window on a non-causal group is bidirectional: set both "
                "window_left and window_right (AttentionGroup.bidirectional(window_left=..., "
                "window_right=...))",
                window_left=self.window_left,
                window_right=self.window_right,
                causal=False,
            )
        if self.attention_chunk_size and not self.causal:
            raise LayoutError(
                "attention_chunk_size",
                "chunked local attention needs a causal self group",
                attention_chunk_size=self.attention_chunk_size,
                causal=False,
            )
        if self.attention_chunk_size and self.window_left >= 0:
            raise LayoutError(
                "attention_chunk_size",
                "chunked local attention and a sliding window are exclusive (no model combines "
                "them): plan one or the other",
                attention_chunk_size=self.attention_chunk_size,
                window_left=self.window_left,
            )

    # -- named constructors -------------------------------------------------------------
    @classmethod
    def full(
        cls, *, logits_soft_cap: float = 0.0, sm_scale: float | None = None, sinks: bool = False
    ) -> AttentionGroup:
        """Causal self-attention over every earlier token."""
        return cls(logits_soft_cap=logits_soft_cap, sm_scale=sm_scale, sinks=sinks)

    @classmethod
    def sliding(
        cls,
        window_left: int,
        *,
        logits_soft_cap: float = 0.0,
        sm_scale: float | None = None,
        sinks: bool = False,
    ) -> AttentionGroup:
        """Causal self-attention over the last ``window_left + 1`` keys."""
        return cls(
            window_left=window_left, logits_soft_cap=logits_soft_cap, sm_scale=sm_scale,
            sinks=sinks,
        )  # fmt: skip

    @classmethod
    def chunked(
        cls,
        attention_chunk_size: int,
        *,
        logits_soft_cap: float = 0.0,
        sm_scale: float | None = None,
        sinks: bool = False,
    ) -> AttentionGroup:
        """Chunked local attention (Llama 4): a query at position ``p`` sees keys
        ``C * (p // C) <= k <= p`` for ``C = attention_chunk_size >= 1``."""
        if as_int("attention_chunk_size", attention_chunk_size) < 1:
            raise LayoutError(
                "attention_chunk_size", "must be >= 1 for a chunked group",
                attention_chunk_size=attention_chunk_size,
            )  # fmt: skip
        return cls(
            attention_chunk_size=attention_chunk_size, logits_soft_cap=logits_soft_cap,
            sm_scale=sm_scale, sinks=sinks,
        )  # fmt: skip

    @classmethod
    def bidirectional(
        cls,
        *,
        window_left: int = -1,
        window_right: int = -1,
        logits_soft_cap: float = 0.0,
        sm_scale: float | None = None,
        sinks: bool = False,
    ) -> AttentionGroup:
        """Non-causal self-attention: each new token sees every key of its request, or,
        with ``window_left`` and ``window_right``, the keys
        ``p - window_left <= k <= p + window_right`` around its position ``p``
        (ModernBERT / EmbeddingGemma local layers).

        With a cached prefix this is block-bidirectional extend (diffusion LMs,
        encoder-only layers): new tokens see the prefix and every new token of their
        block.
        """
        return cls(
            causal=False, window_left=window_left, window_right=window_right,
            logits_soft_cap=logits_soft_cap, sm_scale=sm_scale, sinks=sinks,
        )  # fmt: skip

    @classmethod
    def cross(
        cls, *, logits_soft_cap: float = 0.0, sm_scale: float | None = None, sinks: bool = False
    ) -> AttentionGroup:
        """Non-causal attention to the request's encoder tokens."""
        return cls(
            cross_attention=True, causal=False, logits_soft_cap=logits_soft_cap,
            sm_scale=sm_scale, sinks=sinks,
        )  # fmt: skip

    # -- derived ------------------------------------------------------------------------
    @property
    def has_window(self) -> bool:
        """True for a sliding-window group (``window_left >= 0``)."""
        return self.window_left >= 0

    @property
    def has_band(self) -> bool:
        """True for a bidirectional window (a non-causal group with both bounds)."""
        return self.window_right >= 0

    @property
    def has_chunks(self) -> bool:
        """True for chunked local attention (``attention_chunk_size >= 1``)."""
        return self.attention_chunk_size > 0

    @property
    def uses_window_pool(self) -> bool:
        """Whether the group's KV lives in the sliding-window pool of an executor with a
        ``page_map`` (every causal windowed group does; full, chunked, bidirectional
        and cross groups stay in the full pool)."""
        return self.has_window and self.causal

    def scale_for(self, head_dim: int) -> float:
        """The softmax scale for ``head_dim``: ``sm_scale`` or ``1 / sqrt(head_dim)``."""
        return self.sm_scale if self.sm_scale is not None else 1.0 / math.sqrt(head_dim)

    def resolved(self, head_dim: int) -> AttentionGroup:
        """The same group with an explicit ``sm_scale`` for ``head_dim``, so that groups
        computing the same attention compare equal."""
        if self.sm_scale is not None:
            return self
        return attrs.evolve(self, sm_scale=self.scale_for(head_dim))

    def describe(self) -> str:
        """Short human-readable name, e.g. ``"self causal window=127 cap=30"``,
        ``"self causal chunk=8192 sinks"`` or ``"self bidirectional window=-64..+64"``."""
        parts = ["cross" if self.cross_attention else "self"]
        parts.append("causal" if self.causal else "bidirectional")
        if self.has_band:
            parts.append(f"window=-{self.window_left}..+{self.window_right}")
        elif self.has_window:
            parts.append(f"window={self.window_left}")
        if self.has_chunks:
            parts.append(f"chunk={self.attention_chunk_size}")
        if self.sinks:
            parts.append("sinks")
        if self.logits_soft_cap:
            parts.append(f"cap={self.logits_soft_cap:g}")
        if self.sm_scale is not None:
            parts.append(f"scale={self.sm_scale:g}")
        return " ".join(parts)


#: The groups a layout is planned for by default: one causal full-attention group.
DEFAULT_GROUPS: tuple[AttentionGroup, ...] = (AttentionGroup(),)


def as_groups(field: str, value: object) -> tuple[AttentionGroup, ...]:
    """One group or an iterable of groups, as a tuple of distinct groups."""
    if isinstance(value, AttentionGroup):
        return (value,)
    if isinstance(value, tuple) and all(type(g) is AttentionGroup for g in value):
        groups = value  # the common case: a tuple of groups (no copy, no scan below)
    else:
        if isinstance(value, (str, bytes, torch.Tensor, np.ndarray)) or not isinstance(
            value, Iterable
        ):
            raise FieldTypeError(
                field, "must be an AttentionGroup or an iterable of them", value=value
            )
        try:
            groups = tuple(value)
        except TypeError:
            raise FieldTypeError(
                field, "must be an AttentionGroup or an iterable of them", value=value
            ) from None
    if not groups:
        raise LayoutError(field, "at least one AttentionGroup is needed")
    for i, g in enumerate(groups):
        if not isinstance(g, AttentionGroup):
            raise FieldTypeError(field, "must hold AttentionGroup records", index=i, value=g)
    if len(groups) > 1 and len(set(groups)) != len(groups):
        raise LayoutError(field, "must not repeat a group", groups=groups)
    return groups
