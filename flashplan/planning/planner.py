"""`plan(layout, heads) -> PlanSpec`: pure, host-only, vectorized over the batch."""

from __future__ import annotations

import functools

import attrs
import numpy as np

from flashplan.arrays import INT32_MAX, IntArray, filled, seal_inplace, zeros
from flashplan.errors import FieldTypeError, LayoutError
from flashplan.layout.batch import BatchLayout, Mode
from flashplan.layout.draft_decode import DraftDecode
from flashplan.layout.group import AttentionGroup
from flashplan.layout.heads import HeadConfig
from flashplan.layout.shared_prefix import SharedPrefix
from flashplan.lengths import Lengths, PageSpans
from flashplan.planning.cascade import (
    Cascade,
    cascade_levels_if_any,
    cascade_pays,
    own_tree_mask,
)
from flashplan.planning.chunks import (
    chunk_decode_first,
    needs_position_mask,
    plan_chunked,
    plan_position_masked,
)
from flashplan.planning.items import MultiItemTensors, plan_items
from flashplan.planning.masks import ThresholdMask, TreeMask, pack_tail_bits
from flashplan.planning.policy import default_extend_path
from flashplan.planning.positions import PositionRuns
from flashplan.planning.spec import (
    ExtendPath,
    GroupPlan,
    KernelPath,
    PagedPart,
    PlanKey,
    PlanSpec,
    RaggedPart,
    VirtualRequests,
)

__all__ = ["plan", "plan_steps", "planned_groups"]


@functools.lru_cache(maxsize=1024)
def planned_groups(
    groups: tuple[AttentionGroup, ...], head_dim: int
) -> tuple[tuple[AttentionGroup, ...], tuple[AttentionGroup, ...]]:
    """``(as given, resolved)``: the layout's groups with duplicates of one computation
    dropped (first one kept), and the same groups with an explicit ``sm_scale``.

    Memoized: a pure function of hashable, frozen inputs, called every step."""
    given: list[AttentionGroup] = []
    resolved: list[AttentionGroup] = []
    for group in groups:
        r = group.resolved(head_dim)
        if r not in resolved:
            given.append(group)
            resolved.append(r)
    return tuple(given), tuple(resolved)


def plan(
    layout: BatchLayout,
    heads: HeadConfig,
    *,
    extend_path: ExtendPath | str = ExtendPath.AUTO,
    chunked_extend: str = "split",
    shared_prefix: SharedPrefix | None = None,
    cascade: str = "off",
) -> PlanSpec:
    """Plan every attention group of ``layout`` for the given heads.

    Pure and host-only: reads nothing from any device and has no side effect.
    Groups that compute the same attention (``sm_scale=None`` and an explicit
    ``1 / sqrt(head_dim)``) are planned once.

    Args:
        layout: the batch.
        heads: head counts and dtypes (part of the plan's static key).
        extend_path: for extend batches, ``"paged"`` (one paged prefill over
            prefix + new tokens), ``"ragged"`` (ragged prefill over the new tokens,
            plus a paged prefill over the prefix merged in when any request has
            one) or ``"auto"`` (:func:`~flashplan.planning.policy.default_extend_path`).
            Ignored for decode batches and cross-attention groups. A multi-item
            batch runs on FlashInfer's paged prefill only (its ragged kernel ignores
            the multi-item tensors): ``"auto"`` is paged and ``"ragged"`` is refused.
        chunked_extend: how an extend plans a chunked group whose chunks start on page
            boundaries: ``"split"`` (a page-aligned trim, or virtual requests where new
            tokens cross a chunk boundary: plain causal kernels) or ``"mask"`` (always
            one paged prefill with a position mask: one kernel row per request and a
            custom mask in every batch, the fixed shape a CUDA-graph extend bucket
            runs). Decode steps and verify batches are planned alike either way; a
            chunk that starts inside a page always takes the mask.
        shared_prefix: which requests share leading tokens on the same pages
            (:class:`~flashplan.SharedPrefix`; checked against the batch), or ``None``.
        cascade: ``"off"`` (default), ``"on"`` or ``"auto"``: with ``shared_prefix``,
            record the cascade levels (:attr:`PlanSpec.cascade`) for the groups that can
            run on them — self groups without a window, chunks, sinks or mask (a
            verify's tree mask excepted) on a decode, paged-only extend or verify path
            — always (``"on"``) or where :func:`~flashplan.cascade_pays` expects them
            to pay (``"auto"``). Other groups, and multi-item batches, plan without
            levels.

    Raises:
        LayoutError: ``layout`` or ``heads`` is not the right record, ``extend_path``
            is not one of the three names, or ``"ragged"`` for a multi-item batch or a
            position-masked group; ``chunked_extend`` is not ``"split"`` or ``"mask"``;
            ``cascade`` is not one of its three names; ``shared_prefix`` does not fit the
            batch (:meth:`~flashplan.SharedPrefix.check_batch`).
    """
    if not isinstance(layout, BatchLayout):
        raise FieldTypeError("layout", "must be a BatchLayout", value=type(layout).__name__)
    if not isinstance(heads, HeadConfig):
        raise FieldTypeError("heads", "must be a HeadConfig", value=type(heads).__name__)
    choice = ExtendPath.parse(extend_path)
    if chunked_extend not in ("split", "mask"):
        raise LayoutError(
            "chunked_extend", "must be 'split' or 'mask'", chunked_extend=chunked_extend
        )
    mask_chunks = chunked_extend == "mask"
    if layout.is_multi_item and choice is ExtendPath.RAGGED:
        raise LayoutError(
            "extend_path",
            "a multi-item batch runs on FlashInfer's paged prefill only (the ragged kernel "
            "silently ignores the multi-item tensors): plan it with 'paged' or 'auto'",
            extend_path=extend_path,
        )
    if choice is ExtendPath.RAGGED and layout.mode is Mode.EXTEND:
        for g in layout.groups:
            if not g.cross_attention and _masked(g, layout.page_size, mask_chunks):
                raise LayoutError(
                    "extend_path",
                    f"group {g.describe()!r} runs on one paged prefill with a position mask "
                    "(a bidirectional window, a chunk that does not start on a page "
                    "boundary, or chunks with chunked_extend='mask'): plan it with 'paged' "
                    "or 'auto'",
                    extend_path=choice.value,
                    page_size=layout.page_size,
                )
    if heads.kv_is_fp8 and choice is ExtendPath.RAGGED and layout.mode is Mode.EXTEND:
        raise LayoutError(
            "extend_path",
            "an fp8 KV cache is read as stored (quantized), the new tokens' keys too; the "
            "ragged kernel would read the unquantized new K/V: plan it with 'paged' or "
            "'auto'",
            extend_path=choice.value,
            kv_dtype=heads.kv_dtype,
        )
    if layout.mode is Mode.EXTEND and choice is ExtendPath.AUTO:
        # ('auto' puts a position-masked group on its paged prefill, as cross groups)
        choice = default_extend_path(layout, heads)
    if layout.mode is Mode.VERIFY and choice is ExtendPath.RAGGED:
        raise LayoutError(
            "extend_path", "verify batches run on the paged path", extend_path=choice.value
        )

    if cascade not in ("off", "on", "auto"):
        raise LayoutError("cascade", "must be 'off', 'on' or 'auto'", cascade=cascade)
    if shared_prefix is not None and not isinstance(shared_prefix, SharedPrefix):
        raise FieldTypeError(
            "shared_prefix", "must be a SharedPrefix", value=type(shared_prefix).__name__
        )
    spec = _plan(layout, heads, choice, mask_chunks)
    if shared_prefix is None or cascade == "off":
        return spec
    return _with_cascade(spec, layout, heads, shared_prefix, cascade == "auto")


def _with_cascade(
    spec: PlanSpec, layout: BatchLayout, heads: HeadConfig, shared: SharedPrefix, auto: bool
) -> PlanSpec:
    """``spec`` with its cascade levels for the groups that can run on them."""
    levels = cascade_levels_if_any(layout, shared)  # checks the sharing against the batch
    if levels is None or layout.is_multi_item:  # no whole page shared, or multi-item
        return spec
    groups = tuple(i for i, gp in enumerate(spec.group_plans) if _cascades(gp))
    if not groups or (auto and not cascade_pays(layout, shared, heads, levels=levels)):
        return spec
    parts = [spec.group_plans[k].paged for k in groups]
    # a tree verify: every such group is causal, with the same windowless tree mask (of
    # its draft); otherwise each group's own calls keep its causal flag (bidirectional
    # groups see every new token of their request)
    own_mask = None
    first = parts[0]
    assert first is not None
    if isinstance(first.mask, TreeMask):
        own_mask = own_tree_mask(first.mask, first.start_page, levels.own)
    own_causal = tuple(bool(p is not None and p.causal) for p in parts)
    return attrs.evolve(spec, cascade=Cascade(levels, groups, own_causal, own_mask))


def _cascades(gp: GroupPlan) -> bool:
    """Whether a group's paged call can run as cascade levels plus own parts: a self
    group seeing every earlier key (no window or chunks; no mask but a verify's tree),
    sinks-free, on a decode or paged-only path over the plan's requests."""
    g = gp.group
    tree_only = gp.paged is not None and gp.paged.position_mask is None and (
        gp.paged.mask is None or isinstance(gp.paged.mask, TreeMask)
    )  # fmt: skip
    return (
        not g.cross_attention
        and g.window_left < 0
        and g.window_right < 0
        and not g.has_chunks
        and not g.sinks
        and gp.path in (KernelPath.DECODE, KernelPath.PAGED)
        and gp.virtual is None
        and tree_only
        and gp.items is None
    )


def _plan(
    layout: BatchLayout, heads: HeadConfig, choice: ExtendPath, mask_chunks: bool
) -> PlanSpec:
    """The plan without cascade levels (arguments checked)."""
    if layout.mode is Mode.DECODE:
        return _plan_decode(layout, heads)
    if layout.draft is not None:  # every request adds the draft's N tokens (validated)
        queries = Lengths.uniform(layout.batch_size, layout.draft.num_tokens, "extend_lens")
    else:
        queries = Lengths.from_lens(layout.extend_lens, "extend_lens")
    items: MultiItemTensors | None = None
    if layout.draft is not None:
        # one position per draft token: prefix + depth (int32: below seq_lens)
        positions = (layout.prefix_lens[:, None] + layout.draft.depth).reshape(-1)
        runs = PositionRuns(seal_inplace(positions), filled(1, positions.shape[0]))
    elif layout.is_multi_item:
        items, runs = plan_items(layout)
    else:
        # P, P + 1, ... for each request's new tokens: one run per request
        runs = PositionRuns(layout.prefix_lens, queries.lens)
    given, resolved = planned_groups(layout.groups, heads.head_dim)
    group_plans = tuple(_plan_group(layout, g, choice, queries, items, mask_chunks) for g in given)
    return PlanSpec.of(
        _plan_key(layout, resolved, tuple(gp.path for gp in group_plans), heads),
        queries,
        prefix_lens=layout.prefix_lens,
        decoder_start=layout.decoder_start,
        position_runs=runs,
        encoder=_encoder_lengths(layout),
        pages_needed=layout.pages_needed,
        group_plans=group_plans,
    )


def _plan_key(
    layout: BatchLayout,
    resolved: tuple[AttentionGroup, ...],
    paths: tuple[KernelPath, ...],
    heads: HeadConfig,
) -> PlanKey:
    return _interned_key(
        layout.mode, resolved, paths, layout.page_size, heads, layout.is_multi_item
    )


@functools.lru_cache(maxsize=1024)
def _interned_key(
    mode: Mode,
    groups: tuple[AttentionGroup, ...],
    paths: tuple[KernelPath, ...],
    page_size: int,
    heads: HeadConfig,
    multi_item: bool,
) -> PlanKey:
    """One :class:`PlanKey` object per distinct key (memoized: keys are immutable), so
    that an executor's caches keyed on it match by identity instead of comparing
    every field every step."""
    return PlanKey(mode, groups, paths, page_size, heads, multi_item)


def _encoder_lengths(layout: BatchLayout) -> Lengths | None:
    new = layout.encoder_new_lens
    return None if new is None else Lengths.from_lens(new, "encoder_lens")


def _plan_decode(layout: BatchLayout, heads: HeadConfig) -> PlanSpec:
    """A decode batch: one new token per request, every self group on the decode path.

    Built from the layout's own sealed arrays (shared, never copied): the new token of
    request ``i`` is query ``i``, at position ``prefix_lens[i]``.
    """
    queries = Lengths.uniform(layout.batch_size, 1, "extend_lens")
    given, key = _decode_statics(layout.groups, heads, layout.page_size)
    return PlanSpec.of(
        key,
        queries,
        prefix_lens=layout.prefix_lens,
        decoder_start=layout.decoder_start,
        # one new token each, at the position after its prefix: a run of one per request
        position_runs=PositionRuns(layout.prefix_lens, queries.lens),
        encoder=_encoder_lengths(layout),
        pages_needed=layout.pages_needed,
        group_plans=tuple(_decode_group(layout, g) for g in given),
    )


@functools.lru_cache(maxsize=1024)
def _decode_statics(
    groups: tuple[AttentionGroup, ...], heads: HeadConfig, page_size: int
) -> tuple[tuple[AttentionGroup, ...], PlanKey]:
    """The groups a decode batch plans (:func:`planned_groups`) and its key: every
    group of a decode batch (self or cross) runs on the decode path.

    Memoized: a pure function of hashable, frozen inputs, called every step."""
    given, resolved = planned_groups(groups, heads.head_dim)
    key = PlanKey(
        mode=Mode.DECODE,
        groups=resolved,
        paths=tuple(_decode_path(g, page_size) for g in given),
        page_size=page_size,
        heads=heads,
        multi_item=False,  # a decode layout takes no item delimiters
    )
    return given, key


def _decode_path(group: AttentionGroup, page_size: int) -> KernelPath:
    """A decode step's path: the decode kernel, except for a chunked group whose chunks
    start inside pages (one paged prefill with a position mask)."""
    if group.has_chunks and needs_position_mask(group, page_size):
        return KernelPath.PAGED
    return KernelPath.DECODE


def _group_plan(
    group: AttentionGroup,
    path: KernelPath,
    paged: PagedPart | None,
    ragged: RaggedPart | None,
    key_start: IntArray,
    num_keys: IntArray,
    virtual: VirtualRequests | None = None,
) -> GroupPlan:
    """:meth:`GroupPlan.of`, with a sink group's sinks folded into exactly one call: the
    ragged call where there is one (every query sees at least itself there), else the
    paged call."""
    if group.sinks:
        if ragged is not None:
            ragged = attrs.evolve(ragged, sinks=True)
        else:
            assert paged is not None
            paged = attrs.evolve(paged, sinks=True)
    return GroupPlan.of(
        group, path, paged=paged, ragged=ragged, key_start=key_start, num_keys=num_keys,
        virtual=virtual,
    )  # fmt: skip


def _decode_group(layout: BatchLayout, group: AttentionGroup) -> GroupPlan:
    """One group of a decode batch. The new token at row token ``end - 1`` sees the keys
    ``[first, end)`` of its row: ``end = decoder_start + seq_lens`` (checked to fit
    int32 when the layout was built) and, with a window ``w``, ``first = decoder_start
    + max(seq_lens - (w + 1), 0)``, so int32 arithmetic cannot wrap."""
    if group.cross_attention:
        return _plan_cross(layout, group)
    seq = layout.seq_lens
    base = layout.decoder_start
    window = _window(group)
    if group.has_chunks:
        if needs_position_mask(group, layout.page_size):
            paged = plan_position_masked(layout, group)
            return _group_plan(
                group, KernelPath.PAGED, paged, None, layout.decoder_start, layout.seq_lens
            )
        # the query's chunk starts on a page boundary: a trim, the kernel's window off
        first = seal_inplace(base + chunk_decode_first(layout, group.attention_chunk_size))
        end = seq if layout.encoder_lens is None else seal_inplace(base + seq)
        spans = PageSpans.between(first, end, layout.page_size)
    elif (whole := _whole_rows(layout, window)) is not None:
        spans = whole
    else:
        end = seq if layout.encoder_lens is None else seal_inplace(base + seq)
        if window >= 0:
            hidden = min(window + 1, INT32_MAX)  # an int32 operand: seq - hidden cannot wrap
            first = seal_inplace(base + np.maximum(seq - hidden, 0))
        else:
            first = base
        spans = PageSpans.between(first, end, layout.page_size)
    # (a bidirectional window's decode query is its request's last token: the keys
    # [L - 1 - window_left, L), the causal kernel's sliding window)
    paged = PagedPart.over(spans, causal=True, window_left=window)
    return _group_plan(group, KernelPath.DECODE, paged, None, layout.decoder_start, layout.seq_lens)


def plan_steps(draft: DraftDecode, heads: HeadConfig) -> tuple[PlanSpec, ...]:
    """Plan every step of a multi-step draft decode (one decode plan per step, over
    ``batch_size * topk`` branches; see :class:`~flashplan.layout.draft_decode.DraftDecode`).

    Apply them together with ``executor.apply_steps(specs, branch_table)``.
    """
    if not isinstance(draft, DraftDecode):
        raise FieldTypeError("draft", "must be a DraftDecode", value=type(draft).__name__)
    return tuple(plan(draft.step(s), heads) for s in range(draft.steps))


def _row_tokens(values: np.ndarray) -> IntArray:
    """Row tokens computed in int64 from a validated layout, sealed as int32."""
    return seal_inplace(values)


def _window(group: AttentionGroup) -> int:
    """The group's window, capped at int32: a longer window than any row is full."""
    return min(group.window_left, INT32_MAX)


def _masked(group: AttentionGroup, page_size: int, mask_chunks: bool) -> bool:
    """Whether an extend runs ``group`` on one paged prefill with a position mask."""
    return needs_position_mask(group, page_size) or (mask_chunks and group.has_chunks)


def _plan_group(
    layout: BatchLayout,
    group: AttentionGroup,
    choice: ExtendPath,
    queries: Lengths,
    items: MultiItemTensors | None = None,
    mask_chunks: bool = False,
) -> GroupPlan:
    """One group's plan; ``items`` (a multi-item batch: layouts refuse windowed and
    bidirectional groups there) go to every self group's paged call, in its key
    coordinates, which are decoder positions (no window: the call reads from the
    decoder's first page, which starts on a page boundary)."""
    if group.cross_attention:
        return _plan_cross(layout, group)
    if layout.mode is Mode.VERIFY:
        return _plan_verify(layout, group)
    if layout.mode is Mode.DECODE:
        return _decode_group(layout, group)
    if _masked(group, layout.page_size, mask_chunks):
        return _group_plan(
            group, KernelPath.PAGED, plan_position_masked(layout, group), None,
            layout.decoder_start, layout.seq_lens,
        )  # fmt: skip
    if group.has_chunks:
        path, paged_c, ragged_c, virtual = plan_chunked(
            layout, group, ragged_path=choice is not ExtendPath.PAGED, queries=queries
        )
        return _group_plan(
            group, path, paged_c, ragged_c, layout.decoder_start, layout.seq_lens, virtual
        )
    base = layout.decoder_start
    window = _window(group)
    ps = layout.page_size
    paged: PagedPart | None
    ragged: RaggedPart | None = None
    if choice is ExtendPath.PAGED:
        path = KernelPath.PAGED
        spans = _whole_rows(layout, window)
        if spans is None:
            # validated to fit int32 when the layout was built
            end = _row_tokens(base + layout.seq_lens.astype(np.int64))
            prefix = layout.prefix_lens.astype(np.int64)
            first = _row_tokens(base + np.maximum(prefix - window, 0)) if window >= 0 else base
            spans = PageSpans.between(first, end, ps)
        paged = PagedPart.over(spans, causal=group.causal, window_left=window, items=items)
    else:
        prefix = layout.prefix_lens.astype(np.int64)
        ragged = RaggedPart.over(queries, causal=group.causal, window_left=window)
        if not np.any(prefix):
            path, paged = KernelPath.RAGGED, None
        else:
            path = KernelPath.RAGGED_PAGED
            paged = _prefix_part(base.astype(np.int64), prefix, queries.lens, window, ps)
    return _group_plan(group, path, paged, ragged, layout.decoder_start, layout.seq_lens)


def _plan_verify(layout: BatchLayout, group: AttentionGroup) -> GroupPlan:
    """A causal self group of a verify batch: one paged prefill over prefix + drafts.

    A chain is a causal extend (its tokens' positions are their slots), so the kernel's
    causal flag and window are exact. A tree needs a :class:`TreeMask`: the kernel's
    window measures from a token's slot ``L + t``, but the window must follow its
    position ``L + depth(t)``, so the mask carries the window and the kernel's is off.

    Every value is computed in int32 without wrapping: ``end = decoder_start +
    seq_lens`` was checked to fit when the layout was built, ``prefix - window >=
    -INT32_MAX`` (the window is capped at int32) and every other value lies between 0
    and ``end``.
    """
    draft = layout.draft
    assert draft is not None
    ps = layout.page_size
    prefix = layout.prefix_lens
    base = layout.decoder_start
    # decoder_start is 0 without an encoder: the layout's own (read-only) lengths then
    end = layout.seq_lens if layout.encoder_lens is None else base + layout.seq_lens
    window = _window(group)
    chunk = group.attention_chunk_size
    spans = None if chunk else _whole_rows(layout, window)
    whole = spans is not None  # every call reads its whole row, from page 0 on
    if spans is None:
        first = base + np.maximum(prefix - window, 0) if window >= 0 else base
        if chunk:  # the root's chunk: every draft token sits at or after it
            first = base + prefix // chunk * chunk
        spans = PageSpans.between(first, end, ps)
    mask = None
    use_mask = not draft.is_chain or chunk > 0  # a chunk boundary may cut a chain too
    if use_mask and whole:
        # no window, chunk or encoder: the keys start at position 0, so the prefix
        # threshold is 0 and the drafts start at column prefix (the tree's own rows)
        bs, n = draft.depth.shape
        mask = TreeMask(
            layout.extend_lens, spans.kv_lens, zeros((bs,), "int64"), zeros((bs, n), "int32"),
            seal_inplace(prefix.astype(np.int64), np.int64), draft.ancestor_words,
        )  # fmt: skip
    elif use_mask:
        span_first = np.multiply(spans.start_page, ps, dtype=np.int64)  # decoder positions
        if layout.encoder_lens is not None:
            span_first -= base
        depth = draft.depth
        prefix64 = prefix.astype(np.int64)
        if chunk:  # row t sees prefix keys from its chunk's start, drafts in its chunk
            pos = prefix64[:, None] + depth
            threshold = -span_first
            offsets = seal_inplace(pos // chunk * chunk)
            block = pos // chunk
            bits = draft.ancestors & (block[:, None, :] == block[:, :, None])
            words = pack_tail_bits(bits)
        elif window >= 0:
            threshold = prefix64 - window - span_first
            offsets = depth
            bits = draft.ancestors & (depth[:, None, :] >= depth[:, :, None] - window)
            words = pack_tail_bits(bits)
        else:
            words = draft.ancestor_words  # the tree's own packed rows: no packing per plan
            threshold = -span_first  # only the leading keys of the first page
            offsets = zeros(depth.shape, "int32")
        tail = prefix64 - span_first  # column of draft token 0
        threshold.setflags(write=False)
        tail.setflags(write=False)
        # Fresh arrays of the mask's dtypes (the packed bits: the draft's own, or fresh
        # ones), true by construction: the mask stores them as they are.
        mask = TreeMask(layout.extend_lens, spans.kv_lens, threshold, offsets, tail, words)
    paged = PagedPart.over(
        spans, causal=not use_mask, window_left=-1 if use_mask else window, mask=mask
    )
    return _group_plan(group, KernelPath.PAGED, paged, None, layout.decoder_start, layout.seq_lens)


def _whole_rows(layout: BatchLayout, window: int) -> PageSpans | None:
    """The layout's own :attr:`~flashplan.layout.batch.BatchLayout.row_spans` where a
    call reads each request's whole row, row token 0 to its last token (no window, no
    encoder: what ``PageSpans.between(decoder_start, decoder_start + seq_lens)`` gives,
    already derived for ``pages_needed``); ``None`` otherwise."""
    if window >= 0 or layout.encoder_lens is not None:
        return None
    return layout.row_spans


def _plan_cross(layout: BatchLayout, group: AttentionGroup) -> GroupPlan:
    assert layout.encoder_lens is not None  # checked when the layout was built
    paged = PagedPart.over(layout.encoder_spans, causal=False, window_left=-1)
    path = KernelPath.DECODE if layout.mode is Mode.DECODE else KernelPath.PAGED
    return _group_plan(group, path, paged, None, filled(0, layout.batch_size), layout.encoder_lens)


def _prefix_part(
    base: np.ndarray, prefix: np.ndarray, qo_lens: IntArray, window: int, page_size: int
) -> PagedPart:
    """The cached prefix of a ragged+paged extend, trimmed to the window.

    Query ``j`` (position ``P + j``) sees prefix keys ``k >= P + j - window``. The
    kernel's own window is bottom-right aligned to the trimmed span, which does not
    match, so when the window bites inside the span the rule is expressed as a
    :class:`~flashplan.planning.masks.ThresholdMask` and the kernel's window is off.
    """
    first_key = np.maximum(prefix - window, 0) if window >= 0 else np.zeros_like(prefix)
    spans = PageSpans.between(base + first_key, base + prefix, page_size)
    mask = None
    if window >= 0:
        span_first = spans.start_page.astype(np.int64) * page_size - base  # decoder positions
        q = qo_lens.astype(np.int64)
        # The window bites for the last new token when it hides the span's first key.
        bites = (spans.kv_lens > 0) & (q > 0) & (span_first < prefix + q - 1 - window)
        if np.any(bites):
            mask = ThresholdMask.from_arrays(qo_lens, spans.kv_lens, prefix - window - span_first)
    return PagedPart.over(spans, causal=False, window_left=-1, mask=mask)
