"""`BatchLayout`: one forward batch described on the host."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from functools import cached_property

import attrs
import numpy as np

from flashplan.errors import LayoutError
from flashplan.layout.arrays import (
    ArrayLike,
    IntArray,
    array_key,
    as_int,
    as_lengths,
    is_int,
    sealed,
)
from flashplan.layout.group import AttentionGroup

__all__ = ["BatchLayout", "Mode"]


class Mode(enum.Enum):
    """What kind of step a batch is.

    ``DECODE``: one new token per request, planned on FlashInfer's decode kernels.
    ``EXTEND``: any number of new tokens per request (prefill, chunked prefill).
    """

    DECODE = "decode"
    EXTEND = "extend"


def _check_page_size(instance: BatchLayout, attribute: attrs.Attribute[int], value: int) -> None:
    if not is_int(value) or value <= 0:
        raise LayoutError("page_size", "must be a positive int", page_size=value)


def _to_groups(groups: Iterable[AttentionGroup]) -> tuple[AttentionGroup, ...]:
    return tuple(groups)


def _check_groups(
    instance: BatchLayout,
    attribute: attrs.Attribute[tuple[AttentionGroup, ...]],
    value: tuple[AttentionGroup, ...],
) -> None:
    if not value:
        raise LayoutError("groups", "at least one AttentionGroup is needed")
    for i, g in enumerate(value):
        if not isinstance(g, AttentionGroup):
            raise LayoutError(
                "groups", "must hold AttentionGroup records", request=None, index=i, value=g
            )
    if len(set(value)) != len(value):
        raise LayoutError("groups", "must not repeat a group", groups=value)


def _first_bad(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


@attrs.frozen
class BatchLayout:
    """Everything planning needs about one batch, as host data.

    Per-request arrays are read-only int32 numpy arrays of shape ``[bs]``; the
    record compares and hashes by value. Build it with a named constructor
    (:meth:`decode`, :meth:`extend`); ``__init__`` only validates.

    Attributes:
        mode: the kind of step (:class:`Mode`).
        seq_lens: decoder KV length of each request after this step, new tokens
            included (tokens).
        prefix_lens: decoder tokens already in the KV cache before this step
            (tokens); ``extend_lens = seq_lens - prefix_lens`` are the new tokens.
        encoder_lens: encoder tokens of each request (tokens), or ``None`` for a
            decoder-only model. The encoder KV occupies the first
            ``ceil(encoder_len / page_size)`` pages of the request's page-table
            row; decoder tokens start at the next page boundary.
        page_size: tokens per KV page (1 = sglang's token table).
        groups: the attention groups (kinds of layers) this batch is planned for.
    """

    mode: Mode = attrs.field(validator=attrs.validators.instance_of(Mode))
    seq_lens: IntArray = attrs.field(eq=array_key)
    prefix_lens: IntArray = attrs.field(eq=array_key)
    encoder_lens: IntArray | None = attrs.field(eq=array_key)
    page_size: int = attrs.field(converter=as_int, validator=_check_page_size)
    groups: tuple[AttentionGroup, ...] = attrs.field(converter=_to_groups, validator=_check_groups)

    def __attrs_post_init__(self) -> None:
        bs = self.seq_lens.shape[0]
        if self.prefix_lens.shape[0] != bs:
            raise LayoutError(
                "prefix_lens",
                "batch size differs from seq_lens",
                seq_lens_size=bs,
                prefix_lens_size=self.prefix_lens.shape[0],
            )
        over = self.prefix_lens > self.seq_lens
        if over.any():
            i = _first_bad(over)
            raise LayoutError(
                "prefix_lens",
                "must not exceed seq_lens",
                request=i,
                prefix_len=int(self.prefix_lens[i]),
                seq_len=int(self.seq_lens[i]),
            )
        if self.mode is Mode.DECODE:
            not_one = (self.seq_lens - self.prefix_lens) != 1
            if not_one.any():
                i = _first_bad(not_one)
                raise LayoutError(
                    "seq_lens",
                    "a decode step adds exactly one token per request",
                    request=i,
                    seq_len=int(self.seq_lens[i]),
                    prefix_len=int(self.prefix_lens[i]),
                )
        if self.encoder_lens is not None and self.encoder_lens.shape[0] != bs:
            raise LayoutError(
                "encoder_lens",
                "batch size differs from seq_lens",
                seq_lens_size=bs,
                encoder_lens_size=self.encoder_lens.shape[0],
            )
        if self.encoder_lens is None and any(g.cross_attention for g in self.groups):
            raise LayoutError("encoder_lens", "a cross-attention group needs encoder_lens")
        end = self.kv_offsets.astype(np.int64) + self.seq_lens
        if bs and int(end.max()) > np.iinfo(np.int32).max:
            i = int(np.argmax(end))
            raise LayoutError(
                "seq_lens", "encoder + decoder tokens exceed int32", request=i, end=int(end[i])
            )

    # -- named constructors -------------------------------------------------------------
    @classmethod
    def decode(
        cls,
        seq_lens: ArrayLike,
        *,
        page_size: int = 1,
        groups: Iterable[AttentionGroup] = (AttentionGroup(),),
        encoder_lens: ArrayLike | None = None,
    ) -> BatchLayout:
        """A decode step: each request adds one token; ``seq_lens`` count it (>= 1)."""
        seq = as_lengths("seq_lens", seq_lens, minimum=1)
        prefix = seq - 1
        prefix.flags.writeable = False
        return cls(
            Mode.DECODE, seq, prefix, _opt_lengths("encoder_lens", encoder_lens), page_size, groups
        )

    @classmethod
    def extend(
        cls,
        seq_lens: ArrayLike,
        prefix_lens: ArrayLike | None = None,
        *,
        page_size: int = 1,
        groups: Iterable[AttentionGroup] = (AttentionGroup(),),
        encoder_lens: ArrayLike | None = None,
    ) -> BatchLayout:
        """An extend (prefill) step: request i adds ``seq_lens[i] - prefix_lens[i]`` tokens.

        ``prefix_lens`` defaults to zeros (no cached prefix).
        """
        seq = as_lengths("seq_lens", seq_lens)
        if prefix_lens is None:
            prefix = np.zeros_like(seq)
            prefix.flags.writeable = False
        else:
            prefix = as_lengths("prefix_lens", prefix_lens)
        return cls(
            Mode.EXTEND, seq, prefix, _opt_lengths("encoder_lens", encoder_lens), page_size, groups
        )

    @classmethod
    def from_extend_lens(
        cls,
        extend_lens: ArrayLike,
        prefix_lens: ArrayLike | None = None,
        **kwargs: object,
    ) -> BatchLayout:
        """Like :meth:`extend`, from the new-token counts instead of the totals."""
        ext = as_lengths("extend_lens", extend_lens)
        prefix = (
            np.zeros_like(ext) if prefix_lens is None else as_lengths("prefix_lens", prefix_lens)
        )
        if prefix.shape != ext.shape:
            raise LayoutError(
                "prefix_lens",
                "batch size differs from extend_lens",
                extend_lens_size=ext.shape[0],
                prefix_lens_size=prefix.shape[0],
            )
        return cls.extend(ext.astype(np.int64) + prefix, prefix, **kwargs)  # type: ignore[arg-type]

    # -- derived ------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        """Number of requests."""
        return int(self.seq_lens.shape[0])

    @cached_property
    def extend_lens(self) -> IntArray:
        """New tokens per request, int32 ``[bs]`` (tokens)."""
        return sealed(self.seq_lens - self.prefix_lens)

    @property
    def total_new_tokens(self) -> int:
        """Rows of ``q`` / ``k_new`` / ``v_new`` for this step."""
        return int(self.extend_lens.sum())

    @cached_property
    def kv_offsets(self) -> IntArray:
        """Logical token where each request's decoder KV starts, int32 ``[bs]``.

        0 without encoder; else the encoder's length rounded up to a page boundary.
        """
        if self.encoder_lens is None:
            return sealed(np.zeros_like(self.seq_lens))
        ps = self.page_size
        return sealed((self.encoder_lens.astype(np.int64) + ps - 1) // ps * ps)

    @cached_property
    def pages_needed(self) -> IntArray:
        """Pages each request's page-table row must hold, int32 ``[bs]`` (pages)."""
        ps = self.page_size
        end = self.kv_offsets.astype(np.int64) + self.seq_lens
        return sealed((end + ps - 1) // ps)

    def with_groups(self, *groups: AttentionGroup) -> BatchLayout:
        """The same batch planned for other groups."""
        return attrs.evolve(self, groups=groups)


def _opt_lengths(field: str, values: ArrayLike | None) -> IntArray | None:
    return None if values is None else as_lengths(field, values)
