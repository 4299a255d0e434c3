"""`ItemDelimiters`: where the items of each request start (multi-item scoring).

A scoring request is a prompt followed by candidate items, each item introduced by a
delimiter token (``prompt <d> item1 <d> item2 <d> …``). The record holds, per request,
the positions of the delimiter tokens among the request's *new* tokens of this step,
flat: request ``i``'s delimiters are ``positions[indptr[i]:indptr[i + 1]]``. The
visibility rules they imply are in ``docs/semantics.md`` (multi-item scoring).

Build it from a ragged list (:meth:`ItemDelimiters.from_lists`, or let
:meth:`BatchLayout.extend(..., item_delimiters=...) <flashplan.BatchLayout.extend>`
convert one), or from the flat arrays directly. The record checks what it can alone —
integers, sorted, no repeats, ``>= 0``, per request — and :class:`~flashplan.BatchLayout`
checks the rest (below the request's new-token count, FlashInfer's uint16 limits).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from functools import cached_property
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
import torch

from flashplan.arrays import INT32_MAX, IntArray, array_key, readonly_when_unpickled, seal_inplace
from flashplan.errors import LayoutError
from flashplan.layout.convert import as_lengths
from flashplan.layout.group import AttentionGroup

__all__ = ["FIELD", "MAX_ITEM_ROW", "ItemDelimiters", "as_item_delimiters", "check_items_fit"]

#: Largest ``token_pos_in_items_len`` (and so in-item position) flashplan plans:
#: FlashInfer's multi-item positions are uint16.
MAX_ITEM_ROW = 65535

#: The name every error about delimiters carries (the :class:`~flashplan.BatchLayout` field).
FIELD = "item_delimiters"

_INT32_MIN = -INT32_MAX - 1


def _flat_positions(field: str, value: object) -> IntArray:
    """Delimiter positions as read-only int32 ``[total]``; negative values pass here (the
    record names the request they belong to)."""
    try:
        return as_lengths(field, value, minimum=_INT32_MIN)
    except LayoutError as exc:
        if exc.request is None:
            raise
        # as_lengths counts elements; here an element is a delimiter, not a request.
        raise LayoutError(field, exc.message, delimiter=exc.request, **exc.values) from None


def _indptr(field: str, value: object) -> IntArray:
    """``[0, n0, n0 + n1, …]`` as read-only int32 ``[bs + 1]``, non-decreasing."""
    try:
        out = as_lengths(field, value)
    except LayoutError as exc:
        raise LayoutError(field, f"indptr {exc.message}", index=exc.request, **exc.values) from None
    if out.shape[0] == 0 or int(out[0]) != 0:
        raise LayoutError(field, "indptr must start with 0 (it has batch size + 1 entries)")
    down = np.diff(out) < 0
    if down.any():
        i = int(np.flatnonzero(down)[0])
        raise LayoutError(
            field,
            "indptr must be non-decreasing",
            request=i,
            start=int(out[i]),
            end=int(out[i + 1]),
        )
    return out


@readonly_when_unpickled
@attrs.frozen
class ItemDelimiters:
    """Per request, the delimiter positions among its new tokens (multi-item scoring).

    Request ``i``'s delimiters are ``positions[indptr[i]:indptr[i + 1]]``, counted from
    the request's first new token of this step (0 = the first new token), sorted and
    without repeats. A request with none is a plain causal request. The record compares
    and hashes by value.

    >>> d = ItemDelimiters.from_lists([[7, 9, 11, 13], None, [0, 2]])
    >>> d.positions.tolist(), d.indptr.tolist()
    ([7, 9, 11, 13, 0, 2], [0, 4, 4, 6])
    >>> d.counts.tolist(), d.first.tolist()
    ([4, 0, 2], [7, -1, 0])

    Attributes:
        indptr: int32 ``[bs + 1]`` (delimiters): request ``i``'s slice of ``positions``.
        positions: int32 ``[indptr[-1]]`` (tokens, from the request's first new token).

    Raises:
        LayoutError: (field ``item_delimiters``) non-integers, an ``indptr`` that does not
            start at 0, decreases or does not end at ``len(positions)``, and — naming the
            first offending request — a negative position, an unsorted or repeated one.
    """

    indptr: IntArray = attrs.field(converter=lambda v: _indptr(FIELD, v), eq=array_key)
    positions: IntArray = attrs.field(converter=lambda v: _flat_positions(FIELD, v), eq=array_key)

    def __attrs_post_init__(self) -> None:
        total = int(self.indptr[-1])
        if total != self.positions.shape[0]:
            raise LayoutError(
                FIELD,
                "indptr must end at the number of positions",
                indptr_end=total,
                positions=self.positions.shape[0],
            )
        pos = self.positions
        if not pos.size:
            return
        negative = pos < 0
        if negative.any():
            k = int(np.flatnonzero(negative)[0])
            self._raise_at(k, "must be >= 0 (positions count the request's new tokens from 0)")
        # Within a request, each position must exceed the one before it (int32 steps
        # cannot overflow: positions are >= 0). A step into the next request is no step.
        step = np.diff(pos)
        bad = step <= 0
        if bad.any():
            opens = self.indptr[1:-1]  # each later request's first delimiter
            bad[opens[(opens > 0) & (opens < pos.shape[0])] - 1] = False
        if bad.any():
            k = int(np.flatnonzero(bad)[0]) + 1
            what = "must not repeat a position" if step[k - 1] == 0 else "must be sorted"
            self._raise_at(k, what, previous=int(pos[k - 1]))

    def _raise_at(self, k: int, message: str, **values: Any) -> None:
        i = int(np.searchsorted(self.indptr, k, side="right")) - 1
        raise LayoutError(
            FIELD,
            message,
            request=i,
            delimiter=k - int(self.indptr[i]),
            position=int(self.positions[k]),
            **values,
        )

    # -- constructors -------------------------------------------------------------------
    @classmethod
    def from_lists(cls, per_request: object) -> ItemDelimiters:
        """From one entry per request: a sequence of ints (list, tuple, numpy array or
        CPU tensor) or ``None`` (no delimiter).

        Raises:
            LayoutError: naming the first offending request: an entry that is not a 1-D
                sequence of integers (strings, device tensors, floats such as 2.5),
                a negative, unsorted or repeated position.
        """
        if isinstance(per_request, (str, bytes)) or not isinstance(
            per_request, (Sequence, np.ndarray)
        ):
            raise LayoutError(
                FIELD,
                "must be an ItemDelimiters or one entry per request (a sequence of ints, or None)",
                type=type(per_request).__name__,
            )
        entries = list(per_request)
        types = set(map(type, entries))
        flat: object = None
        lengths: list[int] | None = None
        if types <= _LIST_TYPES:  # one pass over Python ints
            flat = list(itertools.chain.from_iterable(e for e in entries if e is not None))
        elif types <= _TENSOR_TYPES:  # one concatenation (sglang hands over CPU tensors)
            present = entries if _NONE not in types else [e for e in entries if e is not None]
            flat = _cat_host_tensors(present) if present else []
            if flat is not None:  # 1-D parts: numel() (len(), shape[0] cost more)
                lengths = (
                    list(map(torch.Tensor.numel, entries))
                    if _NONE not in types
                    else [0 if e is None else e.numel() for e in entries]
                )
        if flat is None:  # anything else, entry by entry (naming the first bad request)
            for i, e in enumerate(entries):
                _check_entry(i, e)
            flat = _concatenate(
                [_entry_array(i, e) for i, e in enumerate(entries) if e is not None]
            )
        if lengths is None:
            lengths = [_entry_length(e) for e in entries]
        indptr = np.zeros(len(entries) + 1, dtype=np.int64)
        np.cumsum(np.array(lengths, dtype=np.int64), out=indptr[1:])
        try:
            positions = as_lengths(FIELD, flat, minimum=_INT32_MIN)
        except LayoutError as exc:
            if exc.request is None:
                raise
            k = exc.request
            i = int(np.searchsorted(indptr, k, side="right")) - 1
            raise LayoutError(
                FIELD, exc.message, request=i, delimiter=k - int(indptr[i]), **exc.values
            ) from None
        if indptr[-1] > INT32_MAX:
            raise LayoutError(FIELD, "more delimiters than int32 counts", total=int(indptr[-1]))
        # indptr (from lengths: 0, non-decreasing) and positions (int32, sealed) are what
        # the converters would return; the positions' own rules are checked below.
        self = object.__new__(cls)
        object.__setattr__(self, "indptr", seal_inplace(indptr))
        object.__setattr__(self, "positions", positions)
        self.__attrs_post_init__()
        return self

    @classmethod
    def none(cls, batch_size: int) -> ItemDelimiters:
        """``batch_size`` requests without delimiters (a multi-item batch of plain requests)."""
        return cls(np.zeros(batch_size + 1, dtype=np.int32), np.zeros(0, dtype=np.int32))

    # -- derived ------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        """Number of requests."""
        return int(self.indptr.shape[0] - 1)

    @cached_property
    def counts(self) -> IntArray:
        """int32 ``[bs]`` (delimiters): how many each request has."""
        return seal_inplace(np.diff(self.indptr))

    @cached_property
    def has_items(self) -> npt.NDArray[np.bool_]:
        """bool ``[bs]``: whether each request has at least one delimiter."""
        out = self.counts > 0
        out.flags.writeable = False
        return out

    @cached_property
    def first(self) -> IntArray:
        """int32 ``[bs]`` (tokens): each request's first delimiter, ``-1`` where none."""
        at = np.minimum(self.indptr[:-1], max(self.positions.shape[0] - 1, 0))
        first = self.positions[at] if self.positions.size else np.zeros_like(at)
        return seal_inplace(np.where(self.has_items, first, -1))

    @cached_property
    def last(self) -> IntArray:
        """int32 ``[bs]`` (tokens): each request's last delimiter, ``-1`` where none."""
        at = np.maximum(self.indptr[1:] - 1, 0)
        last = self.positions[at] if self.positions.size else np.zeros_like(at)
        return seal_inplace(np.where(self.has_items, last, -1))

    def request(self, i: int) -> npt.NDArray[np.int32]:
        """Request ``i``'s delimiter positions (a read-only view)."""
        return self.positions[int(self.indptr[i]) : int(self.indptr[i + 1])]

    def to_lists(self) -> list[list[int]]:
        """One list of positions per request (for printing and tests)."""
        return [self.request(i).tolist() for i in range(self.batch_size)]


def _entry_length(entry: object) -> int:
    """Delimiters in one request's checked (1-D) entry: ``numel()`` of a tensor (its
    ``len()`` or ``shape[0]`` costs several times more), ``len()`` of anything else."""
    if entry is None:
        return 0
    if isinstance(entry, torch.Tensor):
        return entry.numel()
    return len(entry)  # type: ignore[arg-type]


_NONE = type(None)
_LIST_TYPES = {list, tuple, _NONE}
_TENSOR_TYPES = {torch.Tensor, _NONE}


def _cat_host_tensors(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """The concatenation of 1-D CPU tensors, or ``None`` when any part is not one (checked
    on the result: one cat instead of a device and shape check per request — ``cat``
    refuses 0-d parts and parts of different ranks, so a 1-D result means 1-D parts)."""
    try:
        flat = torch.cat(parts)
    except (RuntimeError, TypeError):
        return None
    return flat if flat.dim() == 1 and flat.device.type == "cpu" else None


def _check_entry(request: int, entry: object) -> None:
    """Refuse one request's entry that is not ``None`` or a 1-D host sequence."""
    if entry is None or isinstance(entry, (list, tuple)):
        return
    if isinstance(entry, torch.Tensor):
        if entry.device.type != "cpu":
            raise LayoutError(
                FIELD,
                "must be host data (a device tensor would need a sync to read)",
                request=request,
                device=str(entry.device),
            )
    elif not isinstance(entry, np.ndarray):
        raise LayoutError(
            FIELD,
            "each request's delimiters must be a 1-D sequence of ints, or None",
            request=request,
            type=type(entry).__name__,
        )
    if entry.ndim != 1:
        raise LayoutError(
            FIELD,
            "each request's delimiters must be 1-D",
            request=request,
            shape=tuple(entry.shape),
        )


def _entry_array(request: int, entry: object) -> IntArray:
    """One request's delimiters as int32 (mixed input kinds: each entry on its own)."""
    try:
        return as_lengths(FIELD, entry, minimum=_INT32_MIN)
    except LayoutError as exc:
        if exc.request is None:
            raise
        raise LayoutError(
            FIELD, exc.message, request=request, delimiter=exc.request, **exc.values
        ) from None


def _concatenate(parts: list[IntArray]) -> IntArray:
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)


def as_item_delimiters(field: str, value: object) -> ItemDelimiters | None:
    """The :class:`~flashplan.BatchLayout` converter: ``None``, an :class:`ItemDelimiters`,
    or one entry per request (:meth:`ItemDelimiters.from_lists`)."""
    del field  # every delimiter error names FIELD
    if value is None or isinstance(value, ItemDelimiters):
        return value
    return ItemDelimiters.from_lists(value)


def check_items_fit(
    items: ItemDelimiters,
    *,
    extend: bool,
    extend_lens: IntArray,
    groups: Sequence[AttentionGroup],
) -> None:
    """The delimiters against their batch: an extend step (``extend``), one entry per
    request, every delimiter below its request's ``extend_lens`` (tokens), FlashInfer's
    uint16 limit on a row, and groups that can hold items (causal, no window; cross
    groups ignore items).

    Raises:
        LayoutError: naming the field (``item_delimiters`` or ``groups``), the request and
            the values.
    """
    bs = int(extend_lens.shape[0])
    if not extend:
        raise LayoutError(
            FIELD, "multi-item scoring is an extend step; a decode layout takes no delimiters"
        )
    if items.batch_size != bs:
        raise LayoutError(
            FIELD,
            "batch size differs from seq_lens",
            seq_lens_size=bs,
            item_delimiters_size=items.batch_size,
        )
    has = items.has_items
    ext = extend_lens
    over = has & (items.last >= ext)
    if over.any():
        i = int(np.flatnonzero(over)[0])
        mine = items.request(i)
        raise LayoutError(
            FIELD,
            "must be below the request's number of new tokens (extend_len)",
            request=i,
            position=int(mine[np.searchsorted(mine, ext[i])]),
            extend_len=int(ext[i]),
        )
    row = np.where(has, ext.astype(np.int64) - items.first, 0)
    long = row > MAX_ITEM_ROW
    if long.any():
        i = int(np.flatnonzero(long)[0])
        raise LayoutError(
            FIELD,
            f"at most {MAX_ITEM_ROW} new tokens may follow the first delimiter, itself "
            "included: FlashInfer's multi-item positions (token_pos_in_items) are uint16",
            request=i,
            token_pos_in_items_len=int(row[i]),
            first_delimiter=int(items.first[i]),
            extend_len=int(ext[i]),
        )
    for g in groups:
        if g.cross_attention:
            continue  # cross groups attend to the encoder and ignore items
        if g.has_window:
            raise LayoutError(
                "groups",
                "a multi-item batch cannot be planned for a sliding-window group: "
                "FlashInfer's multi-item mode runs with the window off (the reference "
                "file turns it off); plan windowed layers without item_delimiters",
                window_left=g.window_left,
            )
        if g.has_chunks:
            raise LayoutError(
                "groups",
                "a multi-item batch cannot be planned for a chunked group: FlashInfer's "
                "multi-item mask has no chunk bound (and a chunk would cut into the prompt an "
                "item must see); plan chunked layers without item_delimiters",
                attention_chunk_size=g.attention_chunk_size,
            )
        if not g.causal:
            raise LayoutError(
                "groups",
                "multi-item scoring is causal: a bidirectional group cannot hold items",
                group=g.describe(),
            )
