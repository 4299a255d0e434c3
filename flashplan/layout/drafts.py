"""`DraftTree`: the speculative draft tokens of a target-verify step, as a tree per request.

Each request brings ``N`` draft tokens (the same ``N`` for the batch) after its prefix.
Token 0 is the root (the token that follows the prefix, parent ``-1``); every other
token ``j`` has a parent ``parents[j] < j``. Query ``j`` sees the prefix, its ancestors
and itself; its position (for RoPE and for sliding windows) is ``prefix + depth(j)``.
A chain (``parents[j] = j - 1``) is a causal extend.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property

import attrs
import numpy as np
import numpy.typing as npt
import torch

from flashplan.arrays import (
    array_key,
    copy_readonly,
    first_beyond_int32,
    readonly_when_unpickled,
    seal_inplace,
)
from flashplan.errors import FieldTypeError, LayoutError
from flashplan.layout.convert import as_int
from flashplan.layout.group import AttentionGroup

__all__ = ["DraftTree", "check_draft_fits"]


def _row_popcounts(words: npt.NDArray[np.uint8]) -> npt.NDArray[np.int32]:
    """int32 ``[bs, N]``: the set bits of each ``[bs, N, W]`` row of bytes, counted eight
    bytes at a time (a row zero-padded to whole uint64 words; the bit-parallel popcount:
    a dozen batch-wide operations instead of a sum over ``N x N`` bools)."""
    bs, n, width = words.shape
    k = (width + 7) // 8
    if width != 8 * k:
        padded = np.zeros((bs, n, 8 * k), dtype=np.uint8)
        padded[..., :width] = words
        words = padded
    x = words.view(np.uint64)  # [bs, N, k]
    x = x - ((x >> np.uint64(1)) & np.uint64(0x5555555555555555))
    x = (x & np.uint64(0x3333333333333333)) + ((x >> np.uint64(2)) & np.uint64(0x3333333333333333))
    x = (x + (x >> np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)
    x = (x * np.uint64(0x0101010101010101)) >> np.uint64(56)  # each word's count, < 65
    counts = x[..., 0] if k == 1 else np.add.reduce(x, axis=2)
    return counts.astype(np.int32)


def _parents(field: str, value: object) -> npt.NDArray[np.int32]:
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise LayoutError(field, "must be host data (a device tensor would need a sync)")
        value = value.detach().numpy()
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError):
        raise LayoutError(field, "must be an integer array [bs, N]") from None
    if arr.ndim != 2 or arr.dtype.kind not in "iu":
        raise LayoutError(
            field, "must be an integer array [bs, N]", shape=arr.shape, dtype=str(arr.dtype)
        )
    beyond = first_beyond_int32(arr)  # would wrap into a valid parent
    if beyond is not None:
        i, token = beyond
        raise LayoutError(
            field, "a parent index exceeds int32", request=i, token=token,
            parent=int(arr[i, token]),
        )  # fmt: skip
    return copy_readonly(arr)


@readonly_when_unpickled
@attrs.frozen
class DraftTree:
    """Per request, ``N`` draft tokens forming a tree (see module docstring).

    >>> t = DraftTree.from_parents([[-1, 0, 0, 1]])  # root, two children, a grandchild
    >>> t.depth.tolist(), t.is_chain
    ([[0, 1, 1, 2]], False)
    >>> t.ancestors[0].astype(int).tolist()          # row j: ancestors of j and j itself
    [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]

    Attributes:
        parents: int32 ``[bs, N]``: each token's parent index, ``-1`` for token 0.
    """

    parents: npt.NDArray[np.int32] = attrs.field(
        converter=lambda v: _parents("parents", v), eq=array_key
    )

    def __attrs_post_init__(self) -> None:
        bs, n = self.parents.shape
        if n == 0:
            raise LayoutError("parents", "a draft needs at least one token (N >= 1)", shape=(bs, n))
        root = self.parents[:, 0] != -1
        j = np.arange(n)[None, :]
        bad = (self.parents[:, 1:] < 0) | (self.parents[:, 1:] >= j[:, 1:])
        if root.any() or bad.any():
            first_root = int(np.flatnonzero(root)[0]) if root.any() else bs
            rows, cols = np.nonzero(bad)
            first_bad = int(rows[0]) if rows.size else bs
            if first_root <= first_bad:
                raise LayoutError(
                    "parents",
                    "token 0 is the root: its parent must be -1",
                    request=first_root,
                    token=0,
                    parent=int(self.parents[first_root, 0]),
                )
            token = int(cols[0]) + 1
            raise LayoutError(
                "parents",
                "a draft token's parent must be an earlier token (0 <= parent < token); "
                "only token 0 is a root",
                request=first_bad,
                token=token,
                parent=int(self.parents[first_bad, token]),
            )

    # -- constructors ---------------------------------------------------------------
    @classmethod
    def from_parents(cls, parents: object) -> DraftTree:
        """The tree of ``parents`` (int ``[bs, N]``, ``-1`` at token 0)."""
        return cls(parents)

    @classmethod
    def chain(cls, batch_size: int, num_tokens: int) -> DraftTree:
        """``batch_size`` chains of ``num_tokens`` tokens (``parents[j] = j - 1``)."""
        bs = as_int("batch_size", batch_size, minimum=0)
        n = as_int("num_tokens", num_tokens, minimum=1)
        return cls(np.broadcast_to(np.arange(-1, n - 1, dtype=np.int32), (bs, n)))

    @classmethod
    def eagle(cls, batch_size: int, topk: int, steps: int) -> DraftTree:
        """EAGLE's shape: the root, then ``topk`` branches of ``steps`` tokens each.

        ``N = 1 + topk * steps``; branch ``b`` is tokens ``1 + b * steps`` ..
        ``(b + 1) * steps``, a chain hanging from the root: ``steps`` draft tokens per
        branch. (How many :class:`~flashplan.DraftDecode` steps an engine's draft loop
        runs to produce them depends on whether its draft model has the root cached:
        ``docs/guide-speculative.md`` works one round through.)
        """
        bs = as_int("batch_size", batch_size, minimum=0)
        k = as_int("topk", topk, minimum=1)
        s = as_int("steps", steps, minimum=1)
        j = np.arange(1, 1 + k * s)
        parent = np.where((j - 1) % s == 0, 0, j - 1)
        row = np.concatenate([[-1], parent]).astype(np.int32)
        return cls(np.broadcast_to(row, (bs, row.shape[0])))

    @classmethod
    def from_mask(cls, mask: object) -> DraftTree:
        """The tree whose ancestor-or-self matrix is ``mask`` (bool ``[bs, N, N]``: row
        ``j`` is true at ``j`` and its ancestors).

        Raises:
            LayoutError: the mask is not a tree's (naming the request and the token).
        """
        if isinstance(mask, torch.Tensor):
            if mask.device.type != "cpu":
                raise LayoutError("mask", "must be host data (a device tensor would need a sync)")
            mask = mask.detach().numpy()
        m = np.asarray(mask)
        if m.ndim != 3 or m.shape[1] != m.shape[2] or m.dtype != np.bool_:
            raise LayoutError("mask", "must be a bool array [bs, N, N]", shape=m.shape)
        n = m.shape[1]
        if n == 0:
            raise LayoutError("mask", "a draft needs at least one token (N >= 1)")
        j = np.arange(n)
        # The parent of j is its latest earlier ancestor.
        earlier = m & (j[None, None, :] < j[None, :, None])
        has = earlier.any(axis=2)
        last = n - 1 - np.argmax(earlier[:, :, ::-1], axis=2)
        parents = np.where(has, last, -1).astype(np.int32)
        first = parents[:, 0]
        orphans = (parents[:, 1:] == -1) | (first != -1)[:, None]
        if orphans.any():
            i, t = (int(x[0]) for x in np.nonzero(orphans))
            raise LayoutError(
                "mask", "every draft token but token 0 needs an ancestor", request=i, token=t + 1
            )
        tree = cls(parents)
        wrong = tree.ancestors != m
        if wrong.any():
            i, t, k = (int(x[0]) for x in np.nonzero(wrong))
            raise LayoutError(
                "mask",
                "contradicts its tree: a row must be the token, its parent and all the "
                "parent's ancestors",
                request=i,
                token=t,
                key=k,
            )
        return tree

    # -- derived --------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        """Requests."""
        return int(self.parents.shape[0])

    @property
    def num_tokens(self) -> int:
        """Draft tokens per request (``N``)."""
        return int(self.parents.shape[1])

    @cached_property
    def ancestor_words(self) -> npt.NDArray[np.uint8]:
        """uint8 ``[bs, N, ceil(N / 8)]``: the rows of :attr:`ancestors` bit-packed
        little-endian (token ``k`` of row ``j`` is bit ``k % 8`` of byte ``k // 8``,
        FlashInfer's bit order), built directly by pointer doubling over the whole
        batch: after round ``r`` a row holds its ancestors less than ``2**r`` steps up
        and ``up`` points ``2**r`` steps up (at the root once past it: the root's row is
        in every row, so OR-ing it again changes nothing), so ``ceil(log2(depth + 1))``
        rounds of a few batch-wide gathers suffice (6 for 64 tokens)."""
        bs, n = self.parents.shape
        width = (n + 7) // 8
        words = np.zeros((bs, n, width), dtype=np.uint8)
        own = np.arange(n)
        words[:, own, own >> 3] = np.left_shift(1, own & 7).astype(np.uint8)
        rows = words.reshape(bs * n, width)  # a view: row i * n + j is token j of request i
        whole = rows.view(f"V{width}").reshape(-1)  # each row one item: a fast 1-D gather
        up = self.parents.astype(np.intp)
        up[:, 0] = 0  # the root points at itself
        up += np.arange(0, bs * n, n)[:, None]  # flat row indices
        up = up.reshape(-1)
        while True:
            # the gather copies first, so every row reads the rows of the last round
            rows |= whole[up].view(np.uint8).reshape(bs * n, width)
            further = up[up]
            if np.array_equal(further, up):  # every pointer at its root: rows complete
                break
            up = further
        return seal_inplace(words, np.uint8)

    @cached_property
    def ancestors(self) -> npt.NDArray[np.bool_]:
        """bool ``[bs, N, N]``: ``[i, j, k]`` when token ``k`` is ``j`` or an ancestor of
        ``j`` (:attr:`ancestor_words` unpacked)."""
        n = self.num_tokens
        bits = np.unpackbits(self.ancestor_words, axis=2, count=n, bitorder="little")
        return seal_inplace(bits.view(np.bool_), bool)

    @cached_property
    def depth(self) -> npt.NDArray[np.int32]:
        """int32 ``[bs, N]``: each token's depth (the root's is 0): a chain's token ``j``
        is at depth ``j``; a tree's depth is its row of :attr:`ancestor_words` counted,
        less one (itself)."""
        bs, n = self.parents.shape
        if self.is_chain:
            depth = np.empty((bs, n), dtype=np.int32)
            depth[:] = np.arange(n, dtype=np.int32)
            return seal_inplace(depth)
        return seal_inplace(_row_popcounts(self.ancestor_words) - 1)

    @cached_property
    def is_chain(self) -> bool:
        """Whether every request's draft is a chain (a causal extend)."""
        n = self.num_tokens
        return bool((self.parents == np.arange(-1, n - 1)[None, :]).all())


def check_draft_fits(
    draft: object, *, new_tokens: npt.NDArray[np.integer], groups: Sequence[AttentionGroup]
) -> None:
    """A verify batch's draft against the batch: a :class:`DraftTree` of one tree per
    request, whose ``N`` tokens are each request's new tokens (``new_tokens``,
    ``seq_lens - prefix_lens``), planned for causal self groups (and cross groups).

    Raises:
        FieldTypeError: not a DraftTree.
        LayoutError: another batch size, a request with another number of new tokens
            (naming it), or a bidirectional self group.
    """
    if not isinstance(draft, DraftTree):
        raise FieldTypeError("draft", "must be a DraftTree", value=type(draft).__name__)
    bs = int(new_tokens.shape[0])
    if draft.batch_size != bs:
        raise LayoutError(
            "draft", "batch size differs from seq_lens", seq_lens_size=bs,
            draft_size=draft.batch_size,
        )  # fmt: skip
    wrong = new_tokens != draft.num_tokens
    if wrong.any():
        i = int(np.flatnonzero(wrong)[0])
        raise LayoutError(
            "seq_lens", "a verify step adds the draft's N tokens to each request", request=i,
            new_tokens=int(new_tokens[i]), num_draft_tokens=draft.num_tokens,
        )  # fmt: skip
    if any(not g.causal and not g.cross_attention for g in groups):
        raise LayoutError("groups", "verify batches plan causal self groups (and cross groups)")
