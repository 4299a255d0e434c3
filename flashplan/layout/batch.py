"""`BatchLayout`: one forward batch described on the host."""

from __future__ import annotations

from collections.abc import Iterable
from functools import cached_property
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from flashplan.arrays import (
    INT32_MAX,
    IntArray,
    array_key,
    checked_int32,
    readonly_when_unpickled,
    seal_inplace,
)
from flashplan.errors import FieldTypeError, LayoutError
from flashplan.layout.convert import ArrayLike, as_flags, as_int, as_lengths
from flashplan.layout.drafts import DraftTree, check_draft_fits
from flashplan.layout.group import DEFAULT_GROUPS, AttentionGroup, as_groups
from flashplan.layout.items import FIELD as ITEMS
from flashplan.layout.items import MAX_ITEM_ROW, ItemDelimiters, as_item_delimiters, check_items_fit
from flashplan.layout.mode import Mode

__all__ = [
    "DEFAULT_GROUPS",
    "MAX_ITEM_ROW",
    "BatchLayout",
    "Mode",
    "as_groups",
]  # (DEFAULT_GROUPS, as_groups: layout.group; MAX_ITEM_ROW: layout.items; Mode: layout.mode)


def _optional_lengths(field: str, value: object) -> IntArray | None:
    return None if value is None else as_lengths(field, value)


def _optional_flags(field: str, value: object) -> npt.NDArray[np.bool_] | None:
    return None if value is None else as_flags(field, value)


def _mode(field: str, value: object) -> Mode:
    if not isinstance(value, Mode):
        raise FieldTypeError(field, "must be a flashplan.Mode", value=value)
    return value


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


@readonly_when_unpickled
@attrs.frozen
class BatchLayout:
    """Everything planning needs about one batch, as host data.

    Per-request arrays are read-only int32 numpy arrays of shape ``[bs]``; the
    record compares and hashes by value. Build it with a named constructor
    (:meth:`decode`, :meth:`extend`, :meth:`from_extend_lens`); ``__init__`` takes the
    same per-request data (any sequence of ints, integer array or CPU tensor) and
    every path converts and validates it the same way.

    Token coordinates: a *row token* is the index of a logical token in a request's
    page-table row (row token ``t`` lives in slot ``t % page_size`` of page
    ``row[t // page_size]``). A *position* counts decoder tokens from 0. Without an
    encoder the two coincide; with one, decoder position ``p`` is row token
    ``decoder_start + p``.

    Attributes:
        mode: the kind of step (:class:`Mode`).
        seq_lens: decoder KV length of each request after this step, new tokens
            included (tokens).
        prefix_lens: decoder tokens already in the KV cache before this step
            (tokens); ``extend_lens = seq_lens - prefix_lens`` are the new tokens.
        encoder_lens: encoder tokens of each request (tokens), or ``None`` for a
            decoder-only model. The encoder KV occupies the first
            ``ceil(encoder_len / page_size)`` pages of the request's page-table
            row; decoder tokens start at the next page boundary (:attr:`decoder_start`).
        page_size: tokens per KV page (1 = sglang's token table).
        groups: the attention groups (kinds of layers) this batch is planned for;
            a single group is accepted.
        draft: the draft trees of a :attr:`Mode.VERIFY` batch (``None`` otherwise);
            ``extend_lens`` are then its ``N`` tokens per request.
        encoder_cached: per request, whether its encoder K/V is already in the cache
            (written in an earlier step), or ``None`` for none. A cross group's
            ``run`` writes the encoder K/V of the other requests only: its ``k_new`` /
            ``v_new`` hold just their rows (``PlanSpec.encoder_indptr``). A request
            that joins a running encoder-decoder batch is the one uncached request.
        item_delimiters: multi-item scoring (:class:`~flashplan.layout.items.ItemDelimiters`):
            per request, the positions of the delimiter tokens among its new tokens,
            or ``None`` for an ordinary batch. Given, the batch is a *multi-item batch*:
            a request's prefix is its cached prefix plus its new tokens before the first
            delimiter; an item token sees the prefix and the earlier tokens of its own
            item, a delimiter sees only the prefix; a request without delimiters is
            plain causal. Extend only; causal groups without window (and cross groups,
            which ignore items). See ``docs/semantics.md``.
    """

    mode: Mode = attrs.field(converter=lambda v: _mode("mode", v))
    seq_lens: IntArray = attrs.field(converter=lambda v: as_lengths("seq_lens", v), eq=array_key)
    prefix_lens: IntArray = attrs.field(
        converter=lambda v: as_lengths("prefix_lens", v), eq=array_key
    )
    encoder_lens: IntArray | None = attrs.field(
        default=None, converter=lambda v: _optional_lengths("encoder_lens", v), eq=array_key
    )
    page_size: int = attrs.field(default=1, converter=lambda v: as_int("page_size", v, minimum=1))
    groups: tuple[AttentionGroup, ...] = attrs.field(
        default=DEFAULT_GROUPS, converter=lambda v: as_groups("groups", v)
    )
    encoder_cached: npt.NDArray[np.bool_] | None = attrs.field(
        default=None, converter=lambda v: _optional_flags("encoder_cached", v), eq=array_key
    )
    draft: DraftTree | None = attrs.field(default=None)
    item_delimiters: ItemDelimiters | None = attrs.field(
        default=None, converter=lambda v: as_item_delimiters(ITEMS, v)
    )

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
            i = _first(over)
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
                i = _first(not_one)
                raise LayoutError(
                    "seq_lens",
                    "a decode step adds exactly one token per request",
                    request=i,
                    seq_len=int(self.seq_lens[i]),
                    prefix_len=int(self.prefix_lens[i]),
                )
        if (self.draft is not None) != (self.mode is Mode.VERIFY):
            raise LayoutError("draft", "a verify batch, and only a verify batch, has a draft")
        if self.draft is not None:
            check_draft_fits(self.draft, new_tokens=self.seq_lens - self.prefix_lens,
                             groups=self.groups)  # fmt: skip
        if self.encoder_lens is not None and self.encoder_lens.shape[0] != bs:
            raise LayoutError(
                "encoder_lens",
                "batch size differs from seq_lens",
                seq_lens_size=bs,
                encoder_lens_size=self.encoder_lens.shape[0],
            )
        if self.encoder_lens is None and any(g.cross_attention for g in self.groups):
            raise LayoutError("encoder_lens", "a cross-attention group needs encoder_lens")
        if self.encoder_cached is not None:
            if self.encoder_lens is None:
                raise LayoutError("encoder_cached", "needs encoder_lens")
            if self.encoder_cached.shape[0] != bs:
                raise LayoutError(
                    "encoder_cached",
                    "batch size differs from seq_lens",
                    seq_lens_size=bs,
                    encoder_cached_size=self.encoder_cached.shape[0],
                )
        if self.item_delimiters is not None:
            check_items_fit(
                self.item_delimiters, extend=self.mode is Mode.EXTEND,
                extend_lens=self.extend_lens, groups=self.groups,
            )  # fmt: skip
        # Derived values, in wide integers, must fit the int32 arrays kernels get.
        _ = self.decoder_start, self.pages_needed

    @classmethod
    def _from_checked(
        cls,
        mode: Mode,
        seq_lens: IntArray,
        prefix_lens: IntArray,
        encoder_lens: IntArray | None,
        page_size: int,
        groups: tuple[AttentionGroup, ...],
        encoder_cached: npt.NDArray[np.bool_] | None,
        draft: DraftTree | None,
        item_delimiters: ItemDelimiters | None,
    ) -> BatchLayout:
        """Internal: a layout from fields that already are what the converters return
        and that already pass every check of ``__init__`` (read-only int32 arrays, a
        validated page size, a tuple of distinct groups …). Nothing is converted or
        checked again: only flashplan's own constructors call it, and only with values
        they validated (tests check that it gives records equal to ``__init__``'s)."""
        self = object.__new__(cls)
        _set = object.__setattr__
        _set(self, "mode", mode)
        _set(self, "seq_lens", seq_lens)
        _set(self, "prefix_lens", prefix_lens)
        _set(self, "encoder_lens", encoder_lens)
        _set(self, "page_size", page_size)
        _set(self, "groups", groups)
        _set(self, "encoder_cached", encoder_cached)
        _set(self, "draft", draft)
        _set(self, "item_delimiters", item_delimiters)
        return self

    # -- named constructors -------------------------------------------------------------
    @classmethod
    def decode(
        cls,
        seq_lens: ArrayLike,
        *,
        page_size: int = 1,
        groups: Iterable[AttentionGroup] | AttentionGroup = DEFAULT_GROUPS,
        encoder_lens: ArrayLike | None = None,
        encoder_cached: object = None,
    ) -> BatchLayout:
        """A decode step: each request adds one token; ``seq_lens`` count it (>= 1)."""
        seq = as_lengths("seq_lens", seq_lens, minimum=1)
        prefix = seal_inplace(seq - 1)
        if encoder_lens is not None or encoder_cached is not None:
            return cls(Mode.DECODE, seq, prefix, encoder_lens, page_size, groups, encoder_cached)
        # The common step, without encoder: the same checks as the constructor, in its
        # order, minus those that hold by construction (seq_lens >= 1 was checked, so
        # prefix_lens = seq_lens - 1 is in [0, seq_lens) and the step adds one token;
        # without encoder, every derived value is at most seq_lens, which fits int32).
        ps = as_int("page_size", page_size, minimum=1)
        checked = as_groups("groups", groups)
        if any(g.cross_attention for g in checked):
            raise LayoutError("encoder_lens", "a cross-attention group needs encoder_lens")
        return cls._from_checked(Mode.DECODE, seq, prefix, None, ps, checked, None, None, None)

    @classmethod
    def extend(
        cls,
        seq_lens: ArrayLike,
        prefix_lens: ArrayLike | None = None,
        *,
        page_size: int = 1,
        groups: Iterable[AttentionGroup] | AttentionGroup = DEFAULT_GROUPS,
        encoder_lens: ArrayLike | None = None,
        encoder_cached: object = None,
        item_delimiters: object = None,
    ) -> BatchLayout:
        """An extend (prefill) step: request i adds ``seq_lens[i] - prefix_lens[i]`` tokens.

        ``prefix_lens`` defaults to zeros (no cached prefix). ``item_delimiters`` makes it
        a multi-item scoring batch: one entry per request, the delimiter positions among
        its new tokens (a sequence of ints, or ``None`` for a plain causal request), or an
        :class:`~flashplan.layout.items.ItemDelimiters`.

        >>> lay = BatchLayout.extend([14, 5], item_delimiters=[[7, 9, 11, 13], None])
        >>> lay.is_multi_item, lay.item_delimiters.counts.tolist()
        (True, [4, 0])
        """
        seq = as_lengths("seq_lens", seq_lens)
        prefix = seal_inplace(np.zeros_like(seq)) if prefix_lens is None else prefix_lens
        return cls(
            Mode.EXTEND,
            seq,
            prefix,
            encoder_lens,
            page_size,
            groups,
            encoder_cached,
            item_delimiters=item_delimiters,
        )

    @classmethod
    def from_extend_lens(
        cls,
        extend_lens: ArrayLike,
        prefix_lens: ArrayLike | None = None,
        **kwargs: Any,
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
        seq = checked_int32("seq_lens", ext.astype(np.int64) + prefix, "prefix + extend length")
        return cls.extend(seq, prefix, **kwargs)

    @classmethod
    def verify(
        cls,
        prefix_lens: ArrayLike,
        draft: DraftTree,
        *,
        page_size: int = 1,
        groups: Iterable[AttentionGroup] | AttentionGroup = DEFAULT_GROUPS,
        encoder_lens: ArrayLike | None = None,
        encoder_cached: object = None,
    ) -> BatchLayout:
        """A speculative target-verify step: request ``i`` holds ``prefix_lens[i]`` cached
        tokens and verifies the ``N`` draft tokens of ``draft`` (a
        :class:`~flashplan.layout.drafts.DraftTree`; :meth:`DraftTree.chain` for chains,
        :meth:`DraftTree.eagle` for EAGLE's shape). The drafts' K/V is written at row
        tokens ``prefix .. prefix + N - 1``; query ``j`` sits at position
        ``prefix + depth(j)`` and sees the prefix, its ancestors and itself.
        """
        if not isinstance(draft, DraftTree):
            raise FieldTypeError("draft", "must be a DraftTree", value=type(draft).__name__)
        prefix = as_lengths("prefix_lens", prefix_lens)
        if draft.batch_size != prefix.shape[0]:
            raise LayoutError(
                "draft",
                "batch size differs from prefix_lens",
                prefix_lens_size=prefix.shape[0],
                draft_size=draft.batch_size,
            )
        seq = checked_int32(
            "prefix_lens", prefix.astype(np.int64) + draft.num_tokens, "prefix + draft length"
        )
        return cls(Mode.VERIFY, seq, prefix, encoder_lens, page_size, groups, encoder_cached, draft)

    @classmethod
    def draft_extend(
        cls,
        prefix_lens: ArrayLike,
        accepted_lens: ArrayLike,
        *,
        tokens_per_request: int | None = None,
        page_size: int = 1,
        groups: Iterable[AttentionGroup] | AttentionGroup = DEFAULT_GROUPS,
    ) -> BatchLayout:
        """The draft model's extend after a verify: request ``i`` adds its
        ``accepted_lens[i]`` accepted tokens after ``prefix_lens[i]`` cached ones.

        With ``tokens_per_request = n`` (the fixed shape a CUDA graph replays), every
        request adds ``n`` tokens: the first ``accepted_lens[i]`` are real and the rest
        padding. Causality keeps padding out of every real token's keys; padding tokens'
        outputs are meaningless (ignore those rows), and their K/V lands in the request's
        own slots past its accepted tokens, beyond the request's cached length (later
        steps write over them) — so the table must hold ``prefix + n`` tokens per
        request.

        Raises:
            LayoutError: an accepted length above ``tokens_per_request`` (naming the
                request).
        """
        prefix = as_lengths("prefix_lens", prefix_lens)
        accepted = as_lengths("accepted_lens", accepted_lens)
        if accepted.shape != prefix.shape:
            raise LayoutError(
                "accepted_lens",
                "batch size differs from prefix_lens",
                prefix_lens_size=prefix.shape[0],
                accepted_lens_size=accepted.shape[0],
            )
        new = accepted
        if tokens_per_request is not None:
            n = as_int("tokens_per_request", tokens_per_request, minimum=1)
            over = accepted > n
            if over.any():
                i = _first(over)
                raise LayoutError(
                    "accepted_lens",
                    "more accepted tokens than tokens_per_request",
                    request=i,
                    accepted=int(accepted[i]),
                    tokens_per_request=n,
                )
            new = seal_inplace(np.full_like(prefix, n))
        seq = checked_int32("prefix_lens", prefix.astype(np.int64) + new, "prefix + new tokens")
        return cls(Mode.EXTEND, seq, prefix, None, page_size, groups)

    @classmethod
    def block_extend(
        cls,
        seq_lens: ArrayLike,
        block_size: int,
        *,
        page_size: int = 1,
        groups: Iterable[AttentionGroup] | AttentionGroup | None = None,
        encoder_lens: ArrayLike | None = None,
        encoder_cached: object = None,
    ) -> BatchLayout:
        """A block-bidirectional extend (diffusion LMs): each request's last
        ``block_size`` tokens are new and see the prefix and every token of the block.

        ``prefix_lens = seq_lens - block_size`` (each ``seq_len >= block_size``);
        ``groups`` defaults to one :meth:`AttentionGroup.bidirectional` group.
        """
        seq = as_lengths("seq_lens", seq_lens)
        block = as_int("block_size", block_size, minimum=1)
        short = seq < block
        if short.any():
            i = _first(short)
            raise LayoutError(
                "seq_lens",
                "must be at least block_size",
                request=i,
                seq_len=int(seq[i]),
                block_size=block,
            )
        prefix = seal_inplace(seq - np.int32(block))
        if groups is None:
            groups = (AttentionGroup.bidirectional(),)
        return cls(Mode.EXTEND, seq, prefix, encoder_lens, page_size, groups, encoder_cached)

    # -- derived ------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        """Number of requests."""
        return int(self.seq_lens.shape[0])

    @cached_property
    def extend_lens(self) -> IntArray:
        """New tokens per request, int32 ``[bs]`` (tokens)."""
        return seal_inplace(self.seq_lens - self.prefix_lens)

    @property
    def is_multi_item(self) -> bool:
        """Whether this is a multi-item scoring batch (``item_delimiters`` given, even if
        no request has a delimiter: the plan's key says so, not the batch's contents)."""
        return self.item_delimiters is not None

    @property
    def total_new_tokens(self) -> int:
        """Rows of ``q`` / ``k_new`` / ``v_new`` for this step."""
        return int(self.extend_lens.sum())

    @cached_property
    def encoder_new_lens(self) -> IntArray | None:
        """Encoder tokens whose K/V a cross group writes this step, int32 ``[bs]``
        (``encoder_lens``, 0 where ``encoder_cached``), or ``None`` without encoder."""
        if self.encoder_lens is None:
            return None
        if self.encoder_cached is None:
            return self.encoder_lens
        return seal_inplace(np.where(self.encoder_cached, 0, self.encoder_lens))

    @cached_property
    def encoder_pages(self) -> IntArray:
        """Pages the encoder KV occupies at the start of each row, int32 ``[bs]`` (pages)."""
        if self.encoder_lens is None:
            return seal_inplace(np.zeros_like(self.seq_lens))
        ps = self.page_size
        return seal_inplace((self.encoder_lens.astype(np.int64) + ps - 1) // ps)

    @cached_property
    def decoder_start(self) -> IntArray:
        """Row token of each request's decoder position 0, int32 ``[bs]`` (tokens).

        0 without encoder; else the encoder's length rounded up to a page boundary.

        Raises:
            LayoutError: the rounded value exceeds int32.
        """
        if self.encoder_lens is None:
            return seal_inplace(np.zeros(self.seq_lens.shape[0], dtype=np.int32))
        start = self.encoder_pages.astype(np.int64) * self.page_size
        return checked_int32("encoder_lens", start, "encoder length rounded to a page")

    @cached_property
    def pages_needed(self) -> IntArray:
        """Pages each request's page-table row must hold, int32 ``[bs]`` (pages).

        Raises:
            LayoutError: the row's last token (encoder + decoder) exceeds int32.
        """
        ps = self.page_size
        if self.encoder_lens is None:  # ceil(seq / ps) in int32, with no sum that could wrap
            pages = (self.seq_lens - 1) // ps
            pages += 1
            return seal_inplace(pages)
        end = self.decoder_start.astype(np.int64) + self.seq_lens
        if end.size and int(end.max()) > INT32_MAX:
            i = int(np.argmax(end))
            raise LayoutError(
                "seq_lens", "encoder + decoder tokens exceed int32", request=i, end=int(end[i])
            )
        return seal_inplace(np.maximum((end + ps - 1) // ps, self.encoder_pages))

    def with_groups(self, *groups: AttentionGroup) -> BatchLayout:
        """The same batch planned for other groups."""
        return attrs.evolve(self, groups=groups)
