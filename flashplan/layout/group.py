"""`AttentionGroup`: the static description of one kind of attention layer."""

from __future__ import annotations

import math

import attrs

from flashplan.errors import LayoutError
from flashplan.layout.arrays import as_int, is_int

__all__ = ["AttentionGroup"]


def _check_window(instance: AttentionGroup, attribute: attrs.Attribute[int], value: int) -> None:
    if not is_int(value):
        raise LayoutError("window_left", "must be an int", window_left=value)
    if value < -1:
        raise LayoutError("window_left", "must be -1 (full attention) or >= 0", window_left=value)


def _check_soft_cap(
    instance: AttentionGroup, attribute: attrs.Attribute[float], value: float
) -> None:
    if not math.isfinite(value) or value < 0:
        raise LayoutError(
            "logits_soft_cap", "must be a finite number >= 0 (0 = off)", logits_soft_cap=value
        )


def _check_sm_scale(
    instance: AttentionGroup, attribute: attrs.Attribute[float | None], value: float | None
) -> None:
    if value is not None and (not math.isfinite(value) or value <= 0):
        raise LayoutError("sm_scale", "must be a finite number > 0 or None", sm_scale=value)


@attrs.frozen
class AttentionGroup:
    """One kind of attention layer; every layer of a group shares one plan.

    A model with global and sliding-window layers has two groups; an
    encoder-decoder model adds a cross-attention group. Groups are hashable and
    compare by value: they are part of a plan's static key.

    Attributes:
        window_left: sliding window, FlashInfer/sglang convention: a query at
            position ``p`` sees keys ``p - window_left <= k <= p`` (``window_left + 1``
            keys). ``-1`` means full attention. A Hugging Face ``sliding_window`` of
            ``S`` is ``window_left = S - 1``.
        cross_attention: attend to the request's encoder tokens instead of the
            decoder tokens. Cross groups are non-causal and have no window.
        causal: a query sees keys up to its own position (bottom-right aligned);
            ``False`` lets every new token see every key of the request.
        logits_soft_cap: ``cap * tanh(logits / cap)`` before the softmax; 0 = off.
        sm_scale: softmax scale; ``None`` means ``1 / sqrt(head_dim)``.
    """

    window_left: int = attrs.field(default=-1, converter=as_int, validator=_check_window)
    cross_attention: bool = attrs.field(default=False, converter=bool)
    causal: bool = attrs.field(default=True, converter=bool)
    logits_soft_cap: float = attrs.field(default=0.0, converter=float, validator=_check_soft_cap)
    sm_scale: float | None = attrs.field(default=None, validator=_check_sm_scale)

    def __attrs_post_init__(self) -> None:
        if self.cross_attention and self.causal:
            raise LayoutError(
                "causal",
                "cross-attention is non-causal: pass causal=False (or use AttentionGroup.cross())",
                cross_attention=True,
                causal=True,
            )
        if self.window_left >= 0 and not self.causal:
            raise LayoutError(
                "window_left",
                "a sliding window needs a causal group",
                window_left=self.window_left,
                causal=False,
                cross_attention=self.cross_attention,
            )

    # -- named constructors -------------------------------------------------------------
    @classmethod
    def full(cls, *, logits_soft_cap: float = 0.0, sm_scale: float | None = None) -> AttentionGroup:
        """Causal self-attention over every earlier token."""
        return cls(logits_soft_cap=logits_soft_cap, sm_scale=sm_scale)

    @classmethod
    def sliding(
        cls, window_left: int, *, logits_soft_cap: float = 0.0, sm_scale: float | None = None
    ) -> AttentionGroup:
        """Causal self-attention over the last ``window_left + 1`` keys."""
        return cls(window_left=window_left, logits_soft_cap=logits_soft_cap, sm_scale=sm_scale)

    @classmethod
    def bidirectional(
        cls, *, logits_soft_cap: float = 0.0, sm_scale: float | None = None
    ) -> AttentionGroup:
        """Non-causal self-attention: each new token sees every key of its request."""
        return cls(causal=False, logits_soft_cap=logits_soft_cap, sm_scale=sm_scale)

    @classmethod
    def cross(
        cls, *, logits_soft_cap: float = 0.0, sm_scale: float | None = None
    ) -> AttentionGroup:
        """Non-causal attention to the request's encoder tokens."""
        return cls(
            cross_attention=True, causal=False, logits_soft_cap=logits_soft_cap, sm_scale=sm_scale
        )

    # -- derived ------------------------------------------------------------------------
    @property
    def has_window(self) -> bool:
        """True for a sliding-window group (``window_left >= 0``)."""
        return self.window_left >= 0

    def scale_for(self, head_dim: int) -> float:
        """The softmax scale for ``head_dim``: ``sm_scale`` or ``1 / sqrt(head_dim)``."""
        return self.sm_scale if self.sm_scale is not None else 1.0 / math.sqrt(head_dim)

    def describe(self) -> str:
        """Short human-readable name, e.g. ``"self causal window=127 cap=30"``."""
        parts = ["cross" if self.cross_attention else "self"]
        parts.append("causal" if self.causal else "bidirectional")
        if self.has_window:
            parts.append(f"window={self.window_left}")
        if self.logits_soft_cap:
            parts.append(f"cap={self.logits_soft_cap:g}")
        if self.sm_scale is not None:
            parts.append(f"scale={self.sm_scale:g}")
        return " ".join(parts)
