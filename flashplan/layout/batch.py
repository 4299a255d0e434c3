"""`BatchLayout`: one forward batch described on the host."""

from __future__ import annotations

from collections.abc import Iterable
from functools import cached_property
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from flashplan.arrays import (
    IntArray,
    array_key,
    checked_int32,
    constant_operand,
    filled,
    readonly_when_unpickled,
    seal_inplace,
)
from flashplan.errors import FieldTypeError, LayoutError
from flashplan.layout.checks import (
    check_encoder,
    check_layout,
    check_totals,
    draft_field,
    encoder_cached_field,
    encoder_lens_field,
    first_index,
    groups_field,
    item_delimiters_field,
    mode_field,
    page_size_field,
    prefix_lens_field,
    seq_lens_field,
)
from flashplan.layout.convert import ArrayLike, as_int, as_lengths
from flashplan.layout.drafts import DraftTree
from flashplan.layout.group import DEFAULT_GROUPS, AttentionGroup, as_groups
from flashplan.layout.items import MAX_ITEM_ROW, ItemDelimiters
from flashplan.layout.mode import Mode
from flashplan.lengths import PageSpans, ceil_pages

__all__ = [
    "DEFAULT_GROUPS",
    "MAX_ITEM_ROW",
    "BatchLayout",
    "Mode",
    "as_groups",
]  # (DEFAULT_GROUPS, as_groups: layout.group; MAX_ITEM_ROW: layout.items; Mode: layout.mode)


@readonly_when_unpickled
@attrs.frozen
class BatchLayout:
    """Everything planning needs about one batch, as host data.

    Per-request arrays are read-only int32 numpy arrays of shape ``[bs]``; the
    record compares and hashes by value. Build it with a named constructor
    (:meth:`decode`, :meth:`extend`, :meth:`from_extend_lens`, :meth:`verify`,
    :meth:`draft_extend`, :meth:`block_extend`) or from every field (``BatchLayout(...)``,
    or :meth:`of`, the same with typed arguments). Every path converts and checks alike:
    ``__init__`` converts each field and checks the fields against each other, so
    ``attrs.evolve`` (and :meth:`replace`) checks too, and no invalid layout exists to
    be planned (the rules: :mod:`flashplan.layout`). An accepted layout also keeps every
    total a plan indexes with int32 within int32 (new tokens, the rows' pages, the
    encoder tokens written), so none of its properties raises.

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

    mode: Mode = attrs.field(converter=mode_field)
    seq_lens: IntArray = attrs.field(converter=seq_lens_field, eq=array_key)
    prefix_lens: IntArray = attrs.field(converter=prefix_lens_field, eq=array_key)
    encoder_lens: IntArray | None = attrs.field(
        default=None, converter=encoder_lens_field, eq=array_key
    )
    page_size: int = attrs.field(default=1, converter=page_size_field)
    groups: tuple[AttentionGroup, ...] = attrs.field(default=DEFAULT_GROUPS, converter=groups_field)
    encoder_cached: npt.NDArray[np.bool_] | None = attrs.field(
        default=None, converter=encoder_cached_field, eq=array_key
    )
    draft: DraftTree | None = attrs.field(default=None, converter=draft_field)
    item_delimiters: ItemDelimiters | None = attrs.field(
        default=None, converter=item_delimiters_field
    )

    def __attrs_post_init__(self) -> None:
        # The converters checked each field alone; here the fields against each other.
        check_layout(
            self.mode, self.seq_lens, self.prefix_lens, self.encoder_lens, self.page_size,
            self.groups, self.encoder_cached, self.draft, self.item_delimiters,
        )  # fmt: skip

    # -- the general constructor ----------------------------------------------------------
    @classmethod
    def of(
        cls,
        mode: Mode,
        seq_lens: ArrayLike,
        prefix_lens: ArrayLike,
        encoder_lens: ArrayLike | None = None,
        page_size: int = 1,
        groups: Iterable[AttentionGroup] | AttentionGroup = DEFAULT_GROUPS,
        encoder_cached: object = None,
        draft: DraftTree | None = None,
        item_delimiters: object = None,
    ) -> BatchLayout:
        """A layout from every field: ``BatchLayout(...)`` itself, with the fields typed
        (the named constructors below compute the fields of their kind of step and call
        it; :meth:`replace` and ``attrs.evolve`` run the same checks).

        Per-request data is any sequence of ints, integer array or CPU tensor.

        Raises:
            LayoutError: any field that is invalid or contradicts another, naming the
                field and the first offending request
                (:class:`~flashplan.errors.FieldTypeError` for a wrong type).
        """
        return cls(
            mode, seq_lens, prefix_lens, encoder_lens, page_size, groups, encoder_cached,
            draft, item_delimiters,
        )  # fmt: skip

    def replace(self, **changes: Any) -> BatchLayout:
        """This layout with some fields changed: ``attrs.evolve``, checked as every
        constructor is."""
        return attrs.evolve(self, **changes)

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
        prefix = seal_inplace(seq - constant_operand(1))
        if encoder_lens is not None or encoder_cached is not None:
            return cls(Mode.DECODE, seq, prefix, encoder_lens, page_size, groups, encoder_cached)
        ps = as_int("page_size", page_size, minimum=1)
        return cls._decode_of(seq, prefix, ps, as_groups("groups", groups))

    @classmethod
    def _decode_of(
        cls, seq: IntArray, prefix: IntArray, page_size: int, groups: tuple[AttentionGroup, ...]
    ) -> BatchLayout:
        """The decode layout without encoder of fields :meth:`decode` converted
        (``seq >= 1`` and ``prefix = seq - 1``, both sealed int32 ``[bs]``), equal to
        ``BatchLayout(Mode.DECODE, seq, prefix, None, page_size, groups)``: the rules
        between the fields that such fields can still break are checked here, the rest
        hold by construction, so ``__init__`` does not convert and check them again."""
        check_encoder(seq, None, None, groups)  # a cross group without encoder
        check_totals(seq, prefix, None, None, page_size)
        self = object.__new__(cls)
        store = object.__setattr__
        store(self, "mode", Mode.DECODE)
        store(self, "seq_lens", seq)
        store(self, "prefix_lens", prefix)
        store(self, "encoder_lens", None)
        store(self, "page_size", page_size)
        store(self, "groups", groups)
        store(self, "encoder_cached", None)
        store(self, "draft", None)
        store(self, "item_delimiters", None)
        return self

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
        return cls.of(
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
        return cls.of(
            Mode.VERIFY, seq, prefix, encoder_lens, page_size, groups, encoder_cached, draft
        )

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
                i = first_index(over)
                raise LayoutError(
                    "accepted_lens",
                    "more accepted tokens than tokens_per_request",
                    request=i,
                    accepted=int(accepted[i]),
                    tokens_per_request=n,
                )
            new = seal_inplace(np.full_like(prefix, n))
        seq = checked_int32("prefix_lens", prefix.astype(np.int64) + new, "prefix + new tokens")
        return cls.of(Mode.EXTEND, seq, prefix, None, page_size, groups)

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
            i = first_index(short)
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
        return cls.of(Mode.EXTEND, seq, prefix, encoder_lens, page_size, groups, encoder_cached)

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
            return filled(0, self.batch_size)
        return seal_inplace(ceil_pages(self.encoder_lens, self.page_size))

    @cached_property
    def decoder_start(self) -> IntArray:
        """Row token of each request's decoder position 0, int32 ``[bs]`` (tokens).

        0 without encoder; else the encoder's length rounded up to a page boundary (it
        fits int32: the layout checked each row's end when it was built).
        """
        if self.encoder_lens is None:
            return filled(0, self.batch_size)
        start = self.encoder_pages.astype(np.int64) * self.page_size
        return seal_inplace(start)

    @cached_property
    def row_spans(self) -> PageSpans:
        """Each request's whole row, row token 0 to its last token (encoder pages, then
        the decoder's ``seq_lens`` tokens), and the pages it covers
        (:class:`~flashplan.lengths.PageSpans`): without an encoder, the keys of a decode
        step and of a paged extend's or a verify's call for a group without window or
        chunks (the planner shares this record with those calls). Never raises: each
        row's end and the pages of all rows fit int32 (checked when the layout was built).
        """
        if self.encoder_lens is None:
            return PageSpans.from_row_start(self.seq_lens, self.page_size, field="seq_lens")
        end = self.decoder_start.astype(np.int64) + self.seq_lens
        return PageSpans.from_row_start(seal_inplace(end), self.page_size, field="seq_lens")

    @cached_property
    def encoder_spans(self) -> PageSpans:
        """The encoder's tokens at the start of each row (a cross group's keys), with
        their pages (:class:`~flashplan.lengths.PageSpans`).

        Raises:
            LayoutError: the layout has no encoder.
        """
        if self.encoder_lens is None:
            raise LayoutError("encoder_lens", "the layout has no encoder")
        return PageSpans.from_row_start(self.encoder_lens, self.page_size)

    @property
    def pages_needed(self) -> IntArray:
        """Pages each request's page-table row must hold, int32 ``[bs]`` (pages): its
        :attr:`row_spans`' pages (the decoder's last token's page; an empty decoder
        after an encoder still needs the encoder's pages, which end where it starts).

        Never raises: a layout whose rows need more pages in all than int32 holds (or
        whose row ends past int32) is refused when it is built, naming ``seq_lens`` and
        the total (:func:`~flashplan.plan` indexes the pages with int32 index pointers).
        """
        return self.row_spans.pages.lens

    def with_groups(self, *groups: AttentionGroup) -> BatchLayout:
        """The same batch planned for other groups."""
        return self.replace(groups=groups)
