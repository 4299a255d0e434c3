"""The oracle: "query j may see key k", stated straight from a `BatchLayout`, and the
float64 attention that follows from it.

Independent of the planner on purpose: it never looks at a `PlanSpec`. Tests
compare it with :func:`flashplan.materialize` (the same picture rebuilt from the
plan's kernel calls with :mod:`flashplan.kernel_rules`) and use
:func:`dense_attention` as the ground truth for both executors. The rules are those
of ``docs/semantics.md``: new token ``j`` of request ``i`` sits at decoder position
``P + j``; a causal self group shows keys ``k <= P + j``, a window ``W >= 0`` also
requires ``k >= P + j - W``; a chunked group (``attention_chunk_size`` C) requires
``k // C == (P + j) // C``; a bidirectional group shows every key ``k < L``, and with a
bidirectional window ``P + j - window_left <= k <= P + j + window_right``; a cross
group shows every encoder key. Sinks add ``exp(s_h)`` to each query's softmax
denominator (:func:`dense_attention`).

Multi-item scoring (a layout with ``item_delimiters``; self groups are causal without
window there): with the request's first delimiter at new token ``f``, the *prefix* is
keys ``k < P + f``; a new token before ``f`` is causal as usual; a delimiter sees the
prefix only; an item token at ``P + j`` whose item's delimiter is at ``P + d`` sees the
prefix and keys ``P + d < k <= P + j``. A request without delimiters is plain causal.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt
import torch

from flashplan.layout.batch import BatchLayout
from flashplan.layout.group import AttentionGroup

__all__ = ["dense_attention", "key_row_tokens", "key_space_len", "visibility"]

_LN2 = math.log(2.0)


def key_space_len(layout: BatchLayout, group: AttentionGroup) -> npt.NDArray[np.int32]:
    """Keys in the group's key space per request: encoder or decoder length."""
    if group.cross_attention:
        assert layout.encoder_lens is not None
        return layout.encoder_lens
    return layout.seq_lens


def key_row_tokens(layout: BatchLayout, group: AttentionGroup) -> list[npt.NDArray[np.int64]]:
    """Per request, the row token of each key of the group's key space.

    Cross groups: the encoder's tokens ``0 .. enc_len - 1``; self groups: the decoder's,
    which start at the page boundary after the encoder.
    """
    lens = key_space_len(layout, group).tolist()
    if group.cross_attention:
        return [np.arange(n, dtype=np.int64) for n in lens]
    starts = layout.decoder_start.tolist()
    return [s + np.arange(n, dtype=np.int64) for s, n in zip(starts, lens, strict=True)]


def visibility(layout: BatchLayout, group: AttentionGroup) -> list[npt.NDArray[np.bool_]]:
    """Per request, a ``[extend_len, num_keys]`` boolean matrix of visible keys."""
    if layout.draft is not None and not group.cross_attention:
        return _verify_visibility(layout, group)
    out = []
    keys_per_req = key_space_len(layout, group)
    items = None if group.cross_attention else layout.item_delimiters
    for i, (prefix, new, n_keys) in enumerate(
        zip(
            layout.prefix_lens.tolist(),
            layout.extend_lens.tolist(),
            keys_per_req.tolist(),
            strict=True,
        )
    ):
        pos = prefix + np.arange(new)[:, None]
        key = np.arange(n_keys)[None, :]
        seen = np.ones((new, n_keys), dtype=bool)
        if not group.cross_attention:
            seen &= _position_rule(group, pos, key)
        if items is not None and items.counts[i]:
            seen &= _item_rule(prefix, new, items.request(i).tolist(), n_keys)
        out.append(seen)
    return out


def _position_rule(group: AttentionGroup, pos: np.ndarray, key: np.ndarray) -> np.ndarray:
    """bool: whether a self group's query at position ``pos`` sees the key at position
    ``key`` (broadcast), by the group's causal flag, window, right bound and chunk."""
    seen = np.ones(np.broadcast_shapes(pos.shape, key.shape), dtype=bool)
    if group.causal:
        seen &= key <= pos
    if group.window_left >= 0:
        seen &= key >= pos - group.window_left
    if group.window_right >= 0:
        seen &= key <= pos + group.window_right
    if group.attention_chunk_size:
        seen &= key // group.attention_chunk_size == pos // group.attention_chunk_size
    return seen


def _item_rule(prefix: int, new: int, delimiters: list[int], n_keys: int) -> np.ndarray:
    """bool ``[new, n_keys]``: the multi-item restriction of one request, token by token."""
    allowed = np.ones((new, n_keys), dtype=bool)
    shared = prefix + delimiters[0]  # cached prefix + new tokens before the first delimiter
    item_start = None  # position of the current item's first token
    marks = set(delimiters)
    for j in range(delimiters[0], new):
        p = prefix + j
        allowed[j] = False
        allowed[j, :shared] = True  # everyone after the prefix sees the whole prefix
        if j in marks:
            item_start = p + 1  # a delimiter sees only the prefix; its item starts after it
        else:
            assert item_start is not None
            allowed[j, item_start : p + 1] = True  # earlier tokens of its item, and itself
    return allowed


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seen: npt.NDArray[np.bool_],
    group: AttentionGroup,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention of one request over the keys ``seen`` allows.

    With ``sinks`` (a sink group), query head ``h``'s softmax denominator gets one more
    term ``exp(sinks[h])`` that carries no value, and the LSE includes it (the sink is a
    key of value 0 that every query sees): a query that sees no key then has output 0
    and LSE ``sinks[h] / ln 2``. A ``-inf`` logit is no sink; a NaN or ``+inf`` one
    gives the head NaN outputs and LSE (``docs/semantics.md``).

    Args:
        q: ``[num_queries, num_qo_heads, head_dim]``.
        k, v: ``[num_keys, num_kv_heads, head_dim]`` (GQA: query heads share KV heads
            in groups of ``num_qo_heads // num_kv_heads``).
        seen: bool ``[num_queries, num_keys]`` (e.g. one entry of :func:`visibility`).
        group: gives the scale (``group.scale_for(head_dim)``) and the soft cap.
        sinks: float ``[num_qo_heads]`` sink logits (natural-log units, not scaled or
            capped), or ``None``.

    Returns:
        ``(out [num_queries, num_qo_heads, head_dim], lse [num_queries, num_qo_heads])``
        in float64, the LSE in base 2; a query that sees no key gets output 0 and LSE
        ``-inf``.
    """
    e, hq, d = q.shape
    scale = group.scale_for(d)
    if e == 0 or k.shape[0] == 0 or not seen.any():
        out = torch.zeros(e, hq, d, dtype=torch.float64, device=q.device)
        lse = torch.full((e, hq), -math.inf, dtype=torch.float64, device=q.device)
        if sinks is not None:
            lse = sinks.double().to(q.device)[None, :].expand(e, hq) / _LN2
        return _undefined_sinks(out, lse, sinks)
    gs = hq // k.shape[1]
    kh = k.double().repeat_interleave(gs, dim=1)
    vh = v.double().repeat_interleave(gs, dim=1)
    mask = torch.from_numpy(np.ascontiguousarray(seen)).to(q.device)
    logits = torch.einsum("qhd,khd->hqk", q.double(), kh) * scale
    if group.logits_soft_cap:
        cap = group.logits_soft_cap
        logits = cap * torch.tanh(logits / cap)
    logits = logits.masked_fill(~mask[None], -math.inf)
    if sinks is not None:  # one more column per head: the sink's logit, with value 0
        sink_col = sinks.double().to(q.device)[:, None, None].expand(hq, e, 1)
        lse = torch.logsumexp(torch.cat([logits, sink_col], dim=-1), dim=-1)
    else:
        lse = torch.logsumexp(logits, dim=-1)  # [Hq, E], natural log
    probs = torch.exp(logits - lse.clamp_min(-1e300)[..., None])
    probs = probs.masked_fill(~mask[None], 0.0)  # keys nobody sees contribute nothing
    out = torch.einsum("hqk,khd->qhd", probs, vh.masked_fill(~mask.any(0)[:, None, None], 0.0))
    return _undefined_sinks(out, (lse / _LN2).T, sinks)


def _undefined_sinks(
    out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule for non-finite sink logits: a head whose logit is NaN or ``+inf`` has
    NaN outputs and LSE (``-inf`` is no sink and has already been folded as 0)."""
    if sinks is None:
        return out, lse
    undefined = ~(sinks.to(out.device) < math.inf)
    nan = torch.tensor(math.nan, dtype=out.dtype, device=out.device)
    return (
        torch.where(undefined[None, :, None], nan, out),
        torch.where(undefined[None, :], nan.to(lse.dtype), lse),
    )


def _verify_visibility(layout: BatchLayout, group: AttentionGroup) -> list[npt.NDArray[np.bool_]]:
    """Verify: draft token ``t`` (position ``P + depth(t)``, key slot ``P + t``) sees every
    prefix key and the slots of its ancestors and itself; a window ``W`` keeps the keys
    whose *position* is at least ``P + depth(t) - W`` (a draft key's position is
    ``P + depth``), a chunk ``C`` the keys whose position is in the query's chunk."""
    draft = layout.draft
    assert draft is not None
    out = []
    for i, prefix in enumerate(layout.prefix_lens.tolist()):
        n = draft.num_tokens
        depth = draft.depth[i].astype(np.int64)
        parents = draft.parents[i].tolist()
        seen = np.zeros((n, prefix + n), dtype=bool)
        for t in range(n):
            pos = prefix + int(depth[t])
            p = np.array(pos)
            for k in range(prefix):
                seen[t, k] = _position_rule(group, p, np.array(k))
            a = t
            while a >= 0:  # the token, then its parent, up to the root
                key_pos = prefix + int(depth[a])
                seen[t, prefix + a] = _position_rule(group, p, np.array(key_pos))
                a = parents[a]
        out.append(seen)
    return out
