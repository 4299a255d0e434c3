"""Planning edges that the oracle comparison alone does not pin down (a mutation audit).

:func:`flashplan.materialize` against :func:`flashplan.oracle.visibility` checks *what*
each query sees. These tests pin how a plan gets there where a wrong plan would still
show the right keys, or where the oracle comparison draws the case too rarely: which
calls carry a custom mask, which pages verify and local-attention calls read, which
groups run on cascade levels (encoder-decoder rows included) and when levels pay, how a
chunked extend splits into virtual requests, that ``materialize`` itself refuses a plan
that reads a key twice or outside the key space, and how a wide picture keeps its first
visible key. Every expected value comes from the layout (through the oracle or by hand),
never from the plan. Two ``xfail(strict=True)`` tests record cascade bugs of
encoder-decoder batches (see their reasons).
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import flashplan as fp
from flashplan import AttentionGroup, BatchLayout, HeadConfig
from flashplan.lengths import PageSpans
from flashplan.oracle import visibility
from flashplan.planning import KernelPath, PagedPart
from flashplan.planning.pictures import ascii_visibility
from flashplan.testing import (
    LOCAL_GROUP_KINDS,
    attention_groups,
    extend_layouts,
    layouts,
    verify_layouts,
)

HEADS = HeadConfig(num_qo_heads=4, num_kv_heads=2, head_dim=64)
CHUNK3, CHUNK4, CHUNK8 = (AttentionGroup.chunked(c) for c in (3, 4, 8))
BAND = AttentionGroup.bidirectional(window_left=3, window_right=2)


# --------------------------------------------------------------------------- windows
@st.composite
def _windowed_prefix_extends(draw: st.DrawFn) -> BatchLayout:
    """Extend batches with cached prefixes and a small window: where a ragged+paged
    plan's prefix call may or may not need a mask."""
    w = draw(st.integers(0, 12))
    return draw(
        extend_layouts(
            prefix=True,
            groups=[AttentionGroup.sliding(w)],
            max_len=40,
            long_len=80,
            page_sizes=(1, 2, 3, 4, 16),
        )
    )


@settings(max_examples=80, deadline=None)
@given(_windowed_prefix_extends())
def test_ragged_prefix_call_has_a_mask_only_where_the_window_bites(layout: BatchLayout) -> None:
    """A windowed group's prefix call of a ragged+paged extend carries a custom mask iff
    some query of the batch does not see every prefix key the call reads (a custom mask
    costs the kernel its fast path: one that hides nothing is a planning defect that
    visibility cannot see); without one it compiles no window and is not causal."""
    group = layout.groups[0]
    spec = fp.plan(layout, HEADS, extend_path="ragged")
    gp = spec.group_plan(group)
    if gp.path is KernelPath.RAGGED:
        assert not layout.prefix_lens.any()
        return
    assert gp.path is KernelPath.RAGGED_PAGED and gp.paged is not None
    p = gp.paged
    needed = False
    for i, seen in enumerate(visibility(layout, group)):
        lo = int(p.start_page[i]) * layout.page_size - int(gp.key_start[i])
        hi = lo + int(p.kv_lens[i])
        assert hi <= int(layout.prefix_lens[i])  # the call reads cached keys only
        needed |= not bool(seen[:, lo:hi].all())
    assert (p.mask is not None) == needed
    assert not p.causal and p.window_left == -1


def test_ragged_prefix_call_without_a_biting_window_by_hand() -> None:
    """W = 3, P = 8, one new token, page size 1: the prefix call reads keys 5..7, all
    visible to the query at 8: no mask. Two new tokens: the query at 9 loses key 5."""
    g = AttentionGroup.sliding(3)
    one = fp.plan(
        BatchLayout.extend([9], [8], page_size=1, groups=[g]), HEADS, extend_path="ragged"
    )
    p = one.group_plan(g).paged
    assert p is not None and (int(p.start_page[0]), int(p.kv_lens[0])) == (5, 3)
    assert p.mask is None
    two = fp.plan(
        BatchLayout.extend([10], [8], page_size=1, groups=[g]), HEADS, extend_path="ragged"
    )
    p = two.group_plan(g).paged
    assert p is not None and p.mask is not None
    assert p.mask.dense(0).astype(int).tolist() == [[1, 1, 1], [0, 1, 1]]


# --------------------------------------------------------------------------- verify pages
@st.composite
def _verify_batches(draw: st.DrawFn) -> BatchLayout:
    """Verify batches with full, sliding, chunked and cross groups."""
    encoder = draw(st.booleans())
    kinds = ("full", "sliding", "chunked", "cross") if encoder else ("full", "sliding", "chunked")
    groups = draw(
        st.lists(attention_groups(kinds=kinds, max_window=20), min_size=1, max_size=3, unique=True)
    )
    return draw(
        verify_layouts(max_batch=4, max_len=60, long_len=120, groups=groups, encoder=encoder)
    )


@settings(max_examples=80, deadline=None)
@given(_verify_batches())
@example(BatchLayout.verify([20, 5], fp.DraftTree.chain(2, 3), page_size=4, groups=[CHUNK8]))
def test_verify_calls_read_from_the_first_visible_keys_page(layout: BatchLayout) -> None:
    """A verify batch's paged call reads each request's keys from the page that holds
    the first key any of its draft tokens sees (the root's window or chunk start) to the
    last one: less than a page of keys before the first visible one, nothing after the
    last (the oracle's keys, not the plan's)."""
    spec = fp.plan(layout, HEADS)
    ps = layout.page_size
    for gp in spec.group_plans:
        assert gp.path is KernelPath.PAGED and gp.paged is not None
        p = gp.paged
        for i, seen in enumerate(visibility(layout, gp.group)):
            keys = np.flatnonzero(seen.any(axis=0))
            if keys.size == 0:
                assert int(p.kv_lens[i]) == 0
                continue
            start = int(p.start_page[i]) * ps - int(gp.key_start[i])
            assert start <= int(keys[0]) < start + ps, (gp.group.describe(), i)
            assert start + int(p.kv_lens[i]) == int(keys[-1]) + 1, (gp.group.describe(), i)


# --------------------------------------------------------------------------- cascade
@pytest.mark.parametrize("window", [0, 1, 5])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("mode", ["decode", "extend"])
def test_windowed_groups_never_run_on_cascade_levels(
    window: int, page_size: int, mode: str
) -> None:
    """A level call shows every shared key to every query: a sliding window (``W = 0``,
    each query seeing only itself, included) must plan without levels, and its plan
    still shows the oracle's keys; the full group beside it runs on the levels."""
    full, swa = AttentionGroup.full(), AttentionGroup.sliding(window)
    prefix = np.array([24, 24, 30, 17])
    if mode == "decode":
        layout = BatchLayout.decode(prefix + 1, page_size=page_size, groups=[full, swa])
    else:
        layout = BatchLayout.extend(prefix + 3, prefix, page_size=page_size, groups=[full, swa])
    shared = fp.SharedPrefix.from_groups([range(0, 3)], [16])
    spec = fp.plan(layout, HEADS, extend_path="paged", shared_prefix=shared, cascade="on")
    assert spec.cascade is not None
    assert spec.cascade.groups == (spec.group_index(full),)
    for g in (full, swa):
        for i, (got, want) in enumerate(
            zip(fp.materialize(spec, g), visibility(layout, g), strict=True)
        ):
            np.testing.assert_array_equal(got, want, err_msg=f"{g.describe()} request {i}")


@pytest.mark.parametrize("mode", ["plain", "items", "ragged"])
def test_ragged_paged_and_multi_item_groups_never_run_on_cascade_levels(mode: str) -> None:
    """Levels replace a group's paged call over the whole row: a ragged+paged extend
    (whose ragged call holds the new tokens) and a multi-item batch (whose paged call
    carries the item tensors) plan without them, and still show the oracle's keys."""
    prefix = np.array([24, 24, 30, 17])
    full = AttentionGroup.full()
    shared = fp.SharedPrefix.from_groups([range(0, 3)], [16])
    if mode == "ragged":
        layout = BatchLayout.extend(prefix + 3, prefix, page_size=4, groups=[full])
    else:  # "items": a delimiter among request 1's new tokens
        delims = [[], [1], [], []] if mode == "items" else None
        layout = BatchLayout.extend(
            prefix + 3, prefix, page_size=4, groups=[full], item_delimiters=delims
        )
    path = "ragged" if mode == "ragged" else "paged"
    spec = fp.plan(layout, HEADS, extend_path=path, shared_prefix=shared, cascade="on")
    if mode == "plain":  # the control: a paged extend without delimiters runs on levels
        assert spec.cascade is not None and spec.cascade.groups == (0,)
    else:
        assert spec.cascade is None
    for i, (got, want) in enumerate(
        zip(fp.materialize(spec, full), visibility(layout, full), strict=True)
    ):
        np.testing.assert_array_equal(got, want, err_msg=f"request {i}")


def _encoder_cascade(mode: str, enc: list[int]) -> tuple[BatchLayout, fp.SharedPrefix]:
    """Requests 0..2 share 16 decoder tokens (4 pages of 4) after encoders of ``enc``."""
    full, cross = AttentionGroup.full(), AttentionGroup.cross()
    prefix = np.array([24, 24, 30, 17])
    kw: dict[str, Any] = dict(page_size=4, groups=[full, cross], encoder_lens=enc)
    if mode == "decode":
        layout = BatchLayout.decode(prefix + 1, **kw)
    else:
        layout = BatchLayout.extend(prefix + 3, prefix, **kw)
    return layout, fp.SharedPrefix.from_groups([range(0, 3)], [16])


def _check_cascade_matches_oracle(layout: BatchLayout, shared: fp.SharedPrefix) -> None:
    full, cross = layout.groups
    spec = fp.plan(layout, HEADS, extend_path="paged", shared_prefix=shared, cascade="on")
    assert spec.cascade is not None and spec.cascade.groups == (spec.group_index(full),)
    for g in (full, cross):
        for i, (got, want) in enumerate(
            zip(fp.materialize(spec, g), visibility(layout, g), strict=True)
        ):
            np.testing.assert_array_equal(got, want, err_msg=f"{g.describe()} request {i}")


@pytest.mark.parametrize("mode", ["decode", "extend"])
def test_cascade_levels_of_an_encoder_decoder_batch(mode: str) -> None:
    """Encoder tokens come first in each row: the levels and own parts of the decoder's
    shared prefix move with them (a level reading the encoder's pages would show keys
    outside the decoder's key space, an own part from row token 16 would read the
    level's keys again); cross groups never run on levels."""
    _check_cascade_matches_oracle(*_encoder_cascade(mode, [5, 5, 5, 0]))


@pytest.mark.xfail(
    strict=True,
    raises=fp.PlanIntegrityError,
    reason="materialize (planning/visibility.py _level_calls) places a level's keys with "
    "the key_start of each member, but the level's spans are row tokens of the group's "
    "first member's row: members whose encoders differ in length get keys outside their "
    "key space (explain reports a mismatch for a plan that computes the plain result)",
)
@pytest.mark.parametrize("mode", ["decode", "extend"])
def test_cascade_levels_with_encoders_of_different_lengths(mode: str) -> None:
    """Members of one group whose encoders differ: the shared decoder pages sit at other
    row columns in each member's row, and ``materialize`` still shows the oracle's keys."""
    _check_cascade_matches_oracle(*_encoder_cascade(mode, [5, 5, 9, 0]))


@pytest.mark.xfail(
    strict=True,
    reason="for an encoder-decoder batch, share_pages / check_shared_pages (the documented "
    "promise) share row columns [0, shared_len // page_size) -- the encoder's pages first -- "
    "while the planner's levels read the first member's decoder pages from column "
    "decoder_start // page_size on: with a table that keeps the promise, cascade='on' "
    "gives other outputs than cascade='off'",
)
def test_cascade_on_equals_off_for_an_encoder_decoder_batch_on_a_promised_table() -> None:
    """DESIGN: a batch with a shared prefix gives the result of the same batch planned
    without sharing, on a page table that keeps the sharing's promise (built by
    :func:`flashplan.share_pages` and accepted by :func:`flashplan.check_shared_pages`)."""
    layout, shared = _encoder_cascade("decode", [5, 5, 5, 0])
    layout = layout.with_groups(layout.groups[0])
    heads = HeadConfig(4, 2, 8, q_dtype=torch.float32)
    bs, ps = layout.batch_size, layout.page_size
    width = int(layout.pages_needed.max())
    rng = np.random.default_rng(0)
    ids = torch.from_numpy(rng.permutation(bs * width).reshape(bs, width).astype(np.int32))
    pages = fp.share_pages(shared, ids, np.arange(bs), ps)
    fp.check_shared_pages(shared, pages, np.arange(bs), ps)
    table = fp.PageTable(pages, np.arange(bs), bs * width)
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(bs * width, 2, ps, 2, 8, generator=gen)
    q, k, v = (torch.randn(bs, h, 8, generator=gen) for h in (4, 2, 2))
    outs = []
    for cascade in ("off", "on"):
        spec = fp.plan(layout, heads, shared_prefix=shared, cascade=cascade)
        assert (spec.cascade is not None) == (cascade == "on")
        ex = fp.ReferenceExecutor(compute_dtype=torch.float64)
        ex.apply(spec, table)
        outs.append(ex.run(layout.groups[0], q, k, v, cache.clone(), return_lse=True))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("bandwidth", "shared_read", "overhead"),
    [
        (3.05e6, 8.0e6, 65.0),
        (1.0, 1e30, 0.0),
        (1.0, 1e30, 1e-3),
        (2.0, 1.0, 5.0),
        (1.0, 1.0, "saved"),
        (1.0, 1.0, "saved - 1"),
    ],
)
def test_cascade_pays_is_the_documented_model(
    bandwidth: float, shared_read: float, overhead: float | str
) -> None:
    """``cascade_pays`` is ``True`` iff the levels' modelled time is strictly below the
    plain call's, with the docstring's model restated from the layout's lengths (plain:
    every request's keys; levels: each group's whole shared pages once plus each
    request's keys after them). Ties do not pay: overhead 0 with an unbounded
    shared-read rate, or a level overhead equal to the bytes the levels save (at one
    byte per µs), where one byte less pays."""
    heads = HeadConfig(8, 2, 64)
    prefix = np.array([40, 40, 40, 40, 9, 33])
    layout = BatchLayout.decode(prefix + 1, page_size=4)
    shared = fp.SharedPrefix.from_groups([range(0, 4), range(4, 6)], [37, 8])
    per_token = 2 * 2 * 64 * 2
    seq = [int(s) for s in prefix + 1]
    plain = sum(seq) * per_token
    whole = [37 // 4 * 4] * 4 + [8 // 4 * 4] * 2  # each member's group's whole shared pages
    cascade = 37 // 4 * 4 + 8 // 4 * 4 + sum(s - w for s, w in zip(seq, whole, strict=True))
    cascade *= per_token
    kind = overhead
    if isinstance(overhead, str):  # one level: the overhead that makes a tie, or 1 less
        overhead = float(plain - cascade) - (1.0 if overhead == "saved - 1" else 0.0)
    plain_us = max(plain / shared_read, cascade / bandwidth)
    cascade_us = cascade / bandwidth + overhead * 1  # one level
    got = fp.cascade_pays(
        layout, shared, heads, bandwidth_bytes_per_us=bandwidth,
        shared_read_bytes_per_us=shared_read, overhead_us_per_level=overhead,
    )  # fmt: skip
    assert got == (cascade_us < plain_us)
    if kind in ("saved", "saved - 1"):
        assert got == (kind == "saved - 1")


# --------------------------------------------------------------------------- chunked splits
@st.composite
def _chunked_extends(draw: st.DrawFn) -> BatchLayout:
    """Extend batches with a chunked group whose chunks start on page boundaries, lengths
    around the chunk boundaries; in half the batches no request's new tokens leave their
    chunk (the unsplit plan)."""
    ps = draw(st.sampled_from((1, 2, 4)))
    chunk = ps * draw(st.integers(1, 4))
    bs = draw(st.integers(1, 5))
    inside = draw(st.booleans())
    seq, pre = [], []
    for _ in range(bs):
        p = draw(st.integers(0, 3) | st.integers(0, 3).map(lambda k: k * chunk))
        p = draw(st.just(p) | st.integers(0, 30))
        room = chunk - p % chunk  # new tokens that stay in the first one's chunk
        if inside:
            e = draw(st.integers(0, room) | st.sampled_from((0, room)))
        else:
            e = draw(st.integers(0, 2 * chunk + 1) | st.sampled_from((0, room, chunk)))
        seq.append(p + e)
        pre.append(p)
    group = AttentionGroup.chunked(chunk)
    return BatchLayout.extend(seq, pre, page_size=ps, groups=[group])


@settings(max_examples=100, deadline=None)
@given(_chunked_extends(), st.sampled_from(("paged", "ragged")))
@example(BatchLayout.extend([5, 6, 8], [5, 4, 6], page_size=2, groups=[CHUNK4]), "paged")
@example(BatchLayout.extend([5, 6, 8], [5, 4, 6], page_size=2, groups=[CHUNK4]), "ragged")
@example(BatchLayout.extend([8, 3], [4, 0], page_size=2, groups=[CHUNK4]), "ragged")
@example(BatchLayout.extend([9, 7], [3, 7], page_size=2, groups=[CHUNK4]), "paged")
@example(BatchLayout.extend([9, 7], [3, 7], page_size=2, groups=[CHUNK4]), "ragged")
def test_chunked_extends_split_into_one_virtual_request_per_touched_chunk(
    layout: BatchLayout, path: str
) -> None:
    """Chunks on page boundaries: a batch whose every request's new tokens lie in one
    chunk plans no virtual requests; otherwise each request has one virtual request per
    chunk its new tokens touch (one without queries when it has none), none of them
    empty, each holding exactly its chunk's new tokens. On the ragged path a paged call
    over the cached keys exists iff some request has a cached key in its first new
    token's chunk; a request without a new token reads no key. Counted token by token
    from the layout."""
    group = layout.groups[0]
    c = group.attention_chunk_size
    spec = fp.plan(layout, HEADS, extend_path=path)
    gp = spec.group_plan(group)
    touched = [
        sorted({p // c for p in range(int(pre), int(seq))})
        for pre, seq in zip(layout.prefix_lens, layout.seq_lens, strict=True)
    ]
    if all(len(t) <= 1 for t in touched):
        assert gp.virtual is None
    else:
        assert gp.virtual is not None
        want_request, want_q = [], []
        for i, chunks in enumerate(touched):
            p, s = int(layout.prefix_lens[i]), int(layout.seq_lens[i])
            if not chunks:
                want_request.append(i)
                want_q.append(0)
            for k in chunks:
                want_request.append(i)
                want_q.append(min((k + 1) * c, s) - max(k * c, p))
        assert gp.virtual.request.tolist() == want_request
        assert gp.virtual.queries.lens.tolist() == want_q
    if path == "ragged":
        cached_in_chunk = [
            int(p) % c != 0 and int(s) > int(p)
            for p, s in zip(layout.prefix_lens, layout.seq_lens, strict=True)
        ]
        if not any(int(p) % c for p in layout.prefix_lens):
            assert gp.path is KernelPath.RAGGED and gp.paged is None
        elif any(cached_in_chunk):
            assert gp.path is KernelPath.RAGGED_PAGED
    if gp.paged is not None:
        idle = layout.extend_lens == 0
        assert not gp.paged.kv_lens[idle].any()
    for i, (got, want) in enumerate(
        zip(fp.materialize(spec, group), visibility(layout, group), strict=True)
    ):
        np.testing.assert_array_equal(got, want, err_msg=f"request {i}")


# --------------------------------------------------------------------------- local groups
@st.composite
def _local_layouts(draw: st.DrawFn) -> BatchLayout:
    """Decode or extend batches with chunked groups and bidirectional bands."""
    groups = draw(
        st.lists(
            attention_groups(kinds=LOCAL_GROUP_KINDS, max_window=12), min_size=1, max_size=2,
            unique=True,
        )
    )  # fmt: skip
    return draw(layouts(max_batch=5, max_len=48, long_len=100, groups=groups))


@settings(max_examples=80, deadline=None)
@given(
    _local_layouts(),
    st.sampled_from(("auto", "paged", "ragged")),
    st.sampled_from(("split", "mask")),
)
@example(BatchLayout.extend([20, 7], [10, 7], page_size=2, groups=[CHUNK3]), "paged", "split")
@example(BatchLayout.extend([20, 7], [10, 7], page_size=1, groups=[BAND]), "auto", "split")
def test_local_groups_read_from_the_first_visible_keys_page(
    layout: BatchLayout, path: str, how: str
) -> None:
    """Chunked and bidirectional-band groups (position masks, page-aligned trims,
    virtual requests) read each request's keys from the page that holds the first key a
    query sees to the last one it sees (on a ragged+paged path the paged call holds the
    cached keys), and a request without a new token reads nothing: the oracle's keys."""
    try:
        spec = fp.plan(layout, HEADS, extend_path=path, chunked_extend=how)
    except fp.LayoutError:
        assert path == "ragged"  # a position-masked group refuses the ragged path
        return
    ps = layout.page_size
    for gp in spec.group_plans:
        p = gp.paged
        for i, seen in enumerate(visibility(layout, gp.group)):
            pre = int(layout.prefix_lens[i])
            keys = np.flatnonzero(seen.any(axis=0))
            if gp.path is KernelPath.RAGGED_PAGED:
                keys = keys[keys < pre]
            elif gp.path is KernelPath.RAGGED:
                assert p is None
                continue
            assert p is not None
            if keys.size == 0:
                assert int(p.kv_lens[i]) == 0, (gp.group.describe(), i)
                continue
            start = int(p.start_page[i]) * ps - int(gp.key_start[i])
            assert start <= int(keys[0]) < start + ps, (gp.group.describe(), i)
            assert start + int(p.kv_lens[i]) == int(keys[-1]) + 1, (gp.group.describe(), i)


# --------------------------------------------------------------------------- materialize
def _with_paged(spec: fp.PlanSpec, paged: PagedPart) -> fp.PlanSpec:
    """``spec`` with its one group's paged call replaced (a broken planner's output)."""
    (gp,) = spec.group_plans
    return attrs.evolve(spec, group_plans=(attrs.evolve(gp, paged=paged),))


def test_materialize_refuses_a_key_read_by_two_calls() -> None:
    """A ragged+paged plan whose prefix call also reads the first new token would count
    that key twice in the softmax (the merge adds both calls' terms), even though every
    query still *sees* the right keys: ``materialize`` refuses it instead of or-ing the
    calls together."""
    g = AttentionGroup.full()
    layout = BatchLayout.extend([8, 6], [5, 2], page_size=4, groups=[g])
    spec = fp.plan(layout, HEADS, extend_path="ragged")
    assert spec.group_plan(g).path is KernelPath.RAGGED_PAGED
    fp.materialize(spec, g)  # the planner's own plan is fine
    over = PagedPart.over(PageSpans.between([0, 0], [6, 2], 4), causal=False, window_left=-1)
    with pytest.raises(fp.PlanIntegrityError, match="request 0: two kernel calls"):
        fp.materialize(_with_paged(spec, over), g)


def test_materialize_refuses_a_key_outside_the_key_space() -> None:
    """A paged call that reads one key past a request's last token (a phantom key of a
    wrong ``last_page_len``) is refused, not cropped to the key space."""
    g = AttentionGroup.full()
    layout = BatchLayout.extend([8, 6], [5, 2], page_size=4, groups=[g])
    spec = fp.plan(layout, HEADS, extend_path="paged")
    fp.materialize(spec, g)
    past = PagedPart.over(PageSpans.between([0, 0], [8, 7], 4), causal=True, window_left=-1)
    with pytest.raises(fp.PlanIntegrityError, match="request 1: plan shows keys outside"):
        fp.materialize(_with_paged(spec, past), g)


# --------------------------------------------------------------------------- pictures
def _check_wide_row(max_cols: int, n: int, first: int) -> None:
    """One query seeing keys ``first..n - 1`` of ``n``, drawn ``max_cols`` wide: every
    visible key is drawn (one ``#`` each), beside the gap, and the note names them."""
    row = np.zeros((1, n), dtype=bool)
    row[0, first:] = True
    drawn = ascii_visibility([row], max_cols=max_cols, indent="").splitlines()[-1]
    label, cells, note = drawn[:3], drawn[5 : 5 + max_cols], drawn[5 + max_cols :]
    assert label == "  0" and len(cells) == max_cols and " ~ " in cells
    assert cells.count("#") == n - first, (max_cols, n, first, cells)
    assert note == f"   {n - first}: {first}..{n - 1}"


@settings(max_examples=60, deadline=None)
@given(st.integers(40, 120), st.data())
def test_pictures_show_the_first_visible_key_past_the_head(max_cols: int, data: Any) -> None:
    """``ascii_visibility`` draws a wide row as a head of ``max_cols // 4`` keys, a
    `` ~ `` gap and a tail; when the first visible key lies past the head and the keys
    from two before it to the end fit beside a 4-key head, the tail is widened to show
    it: every visible key of the row is drawn, and the picture stays ``max_cols`` wide."""
    n = data.draw(st.integers(max_cols + 1, 3 * max_cols), label="keys")
    room = max_cols - len(" ~ ") - 4  # the tail beside a 4-key head
    lo = max(max_cols // 4, n - room + 2)
    _check_wide_row(max_cols, n, data.draw(st.integers(lo, n - 1), label="first visible"))


@pytest.mark.parametrize(("max_cols", "n", "first"), [(80, 90, 20), (80, 90, 21), (40, 41, 10)])
def test_pictures_widen_the_tail_from_the_first_key_past_the_head(
    max_cols: int, n: int, first: int
) -> None:
    """The boundary of the rule above: the first visible key is the first key past the
    head (key ``max_cols // 4``), by hand."""
    _check_wide_row(max_cols, n, first)
