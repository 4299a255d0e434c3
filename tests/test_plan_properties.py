"""Properties of the planner's layout math, over every mode, page size, group and extend path.

The central property: a plan's kernel calls, replayed on the host
(:func:`flashplan.materialize`), show every query exactly the keys that the oracle
(:func:`flashplan.oracle.visibility`, stated from docs/semantics.md without looking at any plan)
says it may see. The others pin the page arithmetic (indptrs, page counts, last-page
lengths, window trims, mask sizes) that FlashInfer's host planner consumes and that
visibility alone cannot see (a segment may read extra keys that a mask then hides).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import attrs
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import flashplan
from flashplan import (
    AttentionGroup,
    BatchLayout,
    ExtendPath,
    HeadConfig,
    Mode,
    PlanSpec,
    materialize,
)
from flashplan.arrays import array_key
from flashplan.lengths import PageSpans
from flashplan.oracle import visibility
from flashplan.planning import GroupPlan, KernelPath, PagedPart, planned_groups
from flashplan.planning.masks import pack_dense, pack_threshold_rows, unpack_request
from flashplan.testing import (
    attention_groups,
    decode_layouts,
    extend_layouts,
    head_configs,
    layouts,
    verify_layouts,
)

PATHS = ("auto", "paged", "ragged")
HEADS = HeadConfig(num_qo_heads=4, num_kv_heads=2, head_dim=64)


# --------------------------------------------------------------------------- helpers
def _arrays(obj: Any, name: str = "spec") -> Iterator[tuple[str, np.ndarray]]:
    """Every numpy array reachable from a plan (attrs records and tuples)."""
    if isinstance(obj, np.ndarray):
        yield name, obj
    elif attrs.has(type(obj)):
        for f in attrs.fields(type(obj)):
            yield from _arrays(getattr(obj, f.name), f"{name}.{f.name}")
    elif isinstance(obj, tuple):
        for i, item in enumerate(obj):
            yield from _arrays(item, f"{name}[{i}]")


def _scalars(obj: Any, name: str = "spec") -> Iterator[tuple[str, Any]]:
    """Every non-array leaf reachable from a plan."""
    if isinstance(obj, np.ndarray):
        return
    if attrs.has(type(obj)) and not isinstance(obj, (AttentionGroup, HeadConfig)):
        for f in attrs.fields(type(obj)):
            yield from _scalars(getattr(obj, f.name), f"{name}.{f.name}")
    elif isinstance(obj, tuple):
        for i, item in enumerate(obj):
            yield from _scalars(item, f"{name}[{i}]")
    else:
        yield name, obj


def _plans(layout: BatchLayout, heads: HeadConfig = HEADS) -> Iterator[tuple[str, PlanSpec]]:
    for path in PATHS:
        yield path, flashplan.plan(layout, heads, extend_path=path)


def _enc(layout: BatchLayout, i: int) -> int:
    return 0 if layout.encoder_lens is None else int(layout.encoder_lens[i])


def _design_range(layout: BatchLayout, gp: GroupPlan, i: int) -> tuple[int, int]:
    """The key range ``[first, end)`` (group key space) that docs/semantics.md says the
    paged call covers."""
    g = gp.group
    seq, pre = int(layout.seq_lens[i]), int(layout.prefix_lens[i])
    new = seq - pre
    w = g.window_left
    if g.cross_attention:
        return 0, _enc(layout, i)
    if gp.path is KernelPath.DECODE:  # decode trim: min(L, W + 1) keys
        keep = seq if w < 0 else min(seq, w + 1)
        return seq - keep, seq
    if gp.path is KernelPath.PAGED:  # paged-only extend: min(L, W + E) keys
        keep = seq if w < 0 else min(seq, w + new)
        return seq - keep, seq
    assert gp.path is KernelPath.RAGGED_PAGED  # prefix part: [max(P - W, 0), P)
    return (0 if w < 0 else max(pre - w, 0)), pre


def _paged_expect(first: int, end: int, base: int, ps: int) -> tuple[int, int, int, int]:
    """(start_page, num_pages, last_page_len, kv_lens) of tokens [first, end) + base, by hand."""
    if end <= first:
        return 0, 0, 0, 0
    start_page = (base + first) // ps
    kv = base + end - start_page * ps
    pages = -(-kv // ps)
    return start_page, pages, kv - (pages - 1) * ps, kv


def _ceil_div(a: np.ndarray, b: int) -> np.ndarray:
    return -(-a.astype(np.int64) // b)


@st.composite
def windowed_extends(draw: st.DrawFn, max_window: int = 24) -> BatchLayout:
    """Extend batches with cached prefixes and small windows: where custom masks bite."""
    w = draw(st.integers(0, max_window))
    others = draw(st.lists(attention_groups(kinds=("full", "sliding")), max_size=1, unique=True))
    groups = list(dict.fromkeys([AttentionGroup.sliding(w), *others]))
    return draw(extend_layouts(prefix=True, groups=groups, max_len=48, long_len=96))


@st.composite
def mid_page_windows(draw: st.DrawFn) -> BatchLayout:
    """Batches whose windows start strictly inside a page for every request."""
    ps = draw(st.sampled_from((2, 3, 16)))
    w = draw(st.integers(0, 40))
    decode = draw(st.booleans())
    bs = draw(st.integers(1, 6))
    seq, pre = [], []
    for _ in range(bs):
        # First visible key (of the first query) = k * ps + r with 0 < r < ps.
        first = draw(st.integers(0, 6)) * ps + draw(st.integers(1, ps - 1))
        if decode:
            length = first + w + 1
            seq.append(length)
            pre.append(length - 1)
        else:
            p = first + w
            seq.append(p + draw(st.integers(1, 20)))
            pre.append(p)
    enc = draw(st.none() | st.lists(st.integers(0, 40), min_size=bs, max_size=bs))
    groups = [AttentionGroup.sliding(w)]
    if enc is not None and draw(st.booleans()):
        groups.append(AttentionGroup.cross())
    if decode:
        return BatchLayout.decode(seq, page_size=ps, groups=groups, encoder_lens=enc)
    return BatchLayout.extend(seq, pre, page_size=ps, groups=groups, encoder_lens=enc)


# --------------------------------------------------------------------------- the main property
def _check_matches_oracle(layout: BatchLayout, heads: HeadConfig = HEADS) -> None:
    for path, spec in _plans(layout, heads):
        for g in layout.groups:
            got = materialize(spec, g)
            want = visibility(layout, g)
            assert len(got) == len(want) == layout.batch_size
            for i, (a, b) in enumerate(zip(got, want, strict=True)):
                keys = _enc(layout, i) if g.cross_attention else int(layout.seq_lens[i])
                assert a.shape == b.shape == (int(layout.extend_lens[i]), keys)
                assert a.dtype == np.bool_
                if not np.array_equal(a, b):
                    diff = np.argwhere(a != b)[:8].tolist()
                    pytest.fail(
                        f"path={path} group={g.describe()} request {i}: plan and oracle "
                        f"differ at (query, key) {diff}"
                    )


@given(layouts(), head_configs())
def test_materialize_equals_oracle(layout: BatchLayout, heads: HeadConfig) -> None:
    _check_matches_oracle(layout, heads)


@given(windowed_extends())
def test_materialize_equals_oracle_windowed_prefix(layout: BatchLayout) -> None:
    _check_matches_oracle(layout)


@given(mid_page_windows())
def test_windows_starting_mid_page(layout: BatchLayout) -> None:
    _check_matches_oracle(layout)
    w = layout.groups[0].window_left
    for _, spec in _plans(layout):
        gp = spec.group_plan(layout.groups[0])
        assert gp.paged is not None
        for i in range(layout.batch_size):
            seq, pre = int(layout.seq_lens[i]), int(layout.prefix_lens[i])
            first = seq - (w + 1) if layout.mode is Mode.DECODE else pre - w
            assert first % layout.page_size != 0
            if gp.path is KernelPath.RAGGED_PAGED and w == 0:
                continue  # window 0: the prefix is invisible, nothing is read
            # The segment starts at the page holding the first visible key, before it.
            start = int(gp.paged.start_page[i]) * layout.page_size - int(gp.key_start[i])
            assert start < first < start + layout.page_size


# --------------------------------------------------------------------------- indptrs
@given(layouts(), st.sampled_from(PATHS))
def test_qo_indptr_and_totals(layout: BatchLayout, path: str) -> None:
    spec = flashplan.plan(layout, HEADS, extend_path=path)
    qo = spec.qo_indptr
    bs = layout.batch_size
    assert qo.dtype == np.int32 and qo.shape == (bs + 1,)
    assert qo[0] == 0
    assert (np.diff(qo) >= 0).all()
    assert np.diff(qo).tolist() == layout.extend_lens.tolist()
    assert int(qo[-1]) == spec.total_q == layout.total_new_tokens
    assert spec.max_q_len == (int(layout.extend_lens.max()) if bs else 0)
    assert spec.batch_size == bs
    assert spec.page_size == layout.page_size
    assert spec.heads == HEADS
    if layout.mode is Mode.DECODE:
        assert np.diff(qo).tolist() == [1] * bs
    assert (
        spec.write_start.tolist()
        == (layout.decoder_start.astype(np.int64) + layout.prefix_lens).tolist()
    )
    if layout.encoder_lens is None:
        assert spec.encoder_indptr is None and spec.total_encoder == 0
    else:
        enc = spec.encoder_indptr
        assert enc is not None and enc[0] == 0 and enc.shape == (bs + 1,)
        assert np.diff(enc).tolist() == layout.encoder_lens.tolist()
        assert spec.total_encoder == int(layout.encoder_lens.sum())
    enc_pages = (
        np.zeros(bs, np.int64)
        if layout.encoder_lens is None
        else _ceil_div(layout.encoder_lens, layout.page_size)
    )
    assert spec.pages_needed.tolist() == np.maximum(layout.pages_needed, enc_pages).tolist()


@given(layouts(), st.sampled_from(PATHS))
def test_page_math(layout: BatchLayout, path: str) -> None:
    spec = flashplan.plan(layout, HEADS, extend_path=path)
    ps = layout.page_size
    bs = layout.batch_size
    for gp in spec.group_plans:
        if gp.ragged is not None:
            r = gp.ragged
            assert r.kv_indptr.tolist() == spec.qo_indptr.tolist()
            assert r.max_kv_len == spec.max_q_len
            assert r.causal == gp.group.causal
        p = gp.paged
        if p is None:
            continue
        ind = p.page_indptr
        assert ind.dtype == np.int32 and ind.shape == (bs + 1,)
        assert ind[0] == 0
        assert (np.diff(ind) >= 0).all()
        assert np.diff(ind).tolist() == p.num_pages.tolist()
        assert int(ind[-1]) == p.total_pages
        kv = p.kv_lens.astype(np.int64)
        assert p.num_pages.tolist() == _ceil_div(kv, ps).tolist()
        assert p.max_kv_len == (int(kv.max()) if bs else 0)
        for i in range(bs):
            n, last, pages = int(kv[i]), int(p.last_page_len[i]), int(p.num_pages[i])
            if n == 0:
                assert (pages, last, int(p.start_page[i])) == (0, 0, 0)
            else:
                assert 1 <= last <= ps
                assert (pages - 1) * ps + last == n
        for arr in (p.start_page, p.num_pages, p.last_page_len, p.kv_lens):
            assert arr.dtype == np.int32 and arr.shape == (bs,)


@given(layouts(), st.sampled_from(PATHS))
def test_segments_follow_design_formulas(layout: BatchLayout, path: str) -> None:
    """Each paged call covers exactly the range docs/semantics.md gives, starting at its
    first key's page."""
    spec = flashplan.plan(layout, HEADS, extend_path=path)
    ps = layout.page_size
    for gp in spec.group_plans:
        if gp.paged is None:
            assert gp.path is KernelPath.RAGGED
            assert not layout.prefix_lens.any()
            continue
        p = gp.paged
        for i in range(layout.batch_size):
            first, end = _design_range(layout, gp, i)
            base = int(gp.key_start[i])
            got = (
                int(p.start_page[i]),
                int(p.num_pages[i]),
                int(p.last_page_len[i]),
                int(p.kv_lens[i]),
            )
            assert got == _paged_expect(first, end, base, ps), (gp.path, gp.group, i)


@given(layouts(), st.sampled_from(PATHS))
def test_segments_end_at_last_visible_key(layout: BatchLayout, path: str) -> None:
    """Reads end exactly at the last visible key and start less than a page before the first."""
    spec = flashplan.plan(layout, HEADS, extend_path=path)
    ps = layout.page_size
    for gp in spec.group_plans:
        vis = visibility(layout, gp.group)
        for i in range(layout.batch_size):
            pre, new = int(layout.prefix_lens[i]), int(layout.extend_lens[i])
            if new == 0:
                continue  # no query: nothing is visible
            seen = vis[i].any(axis=0)
            if gp.path is KernelPath.RAGGED_PAGED:
                seen = seen[:pre]  # the paged call holds the prefix; the ragged one the rest
                assert gp.ragged is not None
                assert int(gp.ragged.kv_indptr[i + 1] - gp.ragged.kv_indptr[i]) == new
            elif gp.path is KernelPath.RAGGED:
                assert pre == 0 and gp.paged is None
                assert bool(seen.all())
                continue
            p = gp.paged
            assert p is not None
            keys = np.flatnonzero(seen)
            if keys.size == 0:
                assert int(p.kv_lens[i]) == 0
                continue
            start = int(p.start_page[i]) * ps - int(gp.key_start[i])
            end = start + int(p.kv_lens[i])
            assert end == int(keys[-1]) + 1
            assert start <= int(keys[0]) < start + ps
            # Every key between the first and last visible one is visible to some query.
            assert keys.size == keys[-1] - keys[0] + 1


@given(decode_layouts(groups=None), st.sampled_from(PATHS))
def test_decode_window_trims(layout: BatchLayout, path: str) -> None:
    """Decode: min(L, W + 1) keys are visible, and the read starts on that key's page."""
    spec = flashplan.plan(layout, HEADS, extend_path=path)
    ps = layout.page_size
    for gp in spec.group_plans:
        if gp.group.cross_attention:
            continue
        w = gp.group.window_left
        seen = materialize(spec, gp.group)
        for i in range(layout.batch_size):
            seq = int(layout.seq_lens[i])
            keep = seq if w < 0 else min(seq, w + 1)
            assert seen[i].shape == (1, seq)
            assert int(seen[i].sum()) == keep
            assert bool(seen[i][0, seq - keep :].all())
            base = int(gp.key_start[i])
            assert gp.paged is not None
            assert int(gp.paged.start_page[i]) == (base + seq - keep) // ps


@given(extend_layouts(), st.sampled_from(("paged", "auto")))
def test_paged_extend_window_trims(layout: BatchLayout, path: str) -> None:
    """Paged-only extend: the last min(L, W + E) keys are read (and visible to some query)."""
    spec = flashplan.plan(layout, HEADS, extend_path=path)
    ps = layout.page_size
    for gp in spec.group_plans:
        if gp.path is not KernelPath.PAGED or gp.group.cross_attention:
            continue
        w = gp.group.window_left
        assert gp.paged is not None and gp.ragged is None and not gp.uses_custom_mask
        seen = materialize(spec, gp.group)
        for i in range(layout.batch_size):
            seq, new = int(layout.seq_lens[i]), int(layout.extend_lens[i])
            keep = seq if w < 0 else min(seq, w + new)
            base = int(gp.key_start[i])
            if keep == 0:  # nothing to read (L = 0, or W = 0 with no new token)
                assert int(gp.paged.kv_lens[i]) == int(gp.paged.num_pages[i]) == 0
                continue
            start = int(gp.paged.start_page[i])
            assert start == (base + seq - keep) // ps
            assert int(gp.paged.kv_lens[i]) == keep + (base + seq - keep) % ps
            if new:
                assert int(seen[i].any(axis=0).sum()) == keep


@given(st.one_of(windowed_extends(), layouts()), st.sampled_from(PATHS))
def test_mask_indptr_is_byte_aligned(layout: BatchLayout, path: str) -> None:
    spec = flashplan.plan(layout, HEADS, extend_path=path)
    qo = np.diff(spec.qo_indptr).astype(np.int64)
    for gp in spec.group_plans:
        p = gp.paged
        if p is None or p.mask is None:
            continue
        assert gp.path is KernelPath.RAGGED_PAGED and gp.group.window_left >= 0
        assert p.window_left == -1  # the mask carries the window, not the kernel
        assert p.mask is not None
        ind = p.mask.indptr
        assert ind.dtype == np.int32 and ind.shape == (layout.batch_size + 1,)
        assert ind[0] == 0
        sizes = (qo * p.kv_lens.astype(np.int64) + 7) // 8
        assert np.diff(ind).tolist() == sizes.tolist()
        assert p.mask.packed.dtype == np.uint8
        assert p.mask.packed.shape == (int(ind[-1]),)
        # Padding bits past qo * kv in each request's last byte are zero.
        for i in range(layout.batch_size):
            bits = np.unpackbits(p.mask.packed[ind[i] : ind[i + 1]], bitorder="little")
            assert not bits[int(qo[i] * p.kv_lens[i]) :].any()


def test_ragged_prefix_mask_example() -> None:
    """A hand-checked windowed prefix: W = 2, P = 5, E = 3, page size 4."""
    g = AttentionGroup.sliding(2)
    layout = BatchLayout.extend([8], [5], page_size=4, groups=(g,))
    spec = flashplan.plan(layout, HEADS, extend_path="ragged")
    gp = spec.group_plan(g)
    assert gp.path is KernelPath.RAGGED_PAGED
    p = gp.paged
    assert p is not None and p.mask is not None and p.mask.packed is not None
    # Prefix keys 3, 4 are needed; the read starts at page 0 (keys 0..4).
    assert (int(p.start_page[0]), int(p.kv_lens[0]), int(p.last_page_len[0])) == (0, 5, 1)
    mask = unpack_request(p.mask.packed, p.mask.indptr, 0, 3, 5)
    # Query at 5 sees prefix keys 3, 4; at 6 sees 4; at 7 sees none.
    assert mask.astype(int).tolist() == [[0, 0, 0, 1, 1], [0, 0, 0, 0, 1], [0, 0, 0, 0, 0]]
    _check_matches_oracle(layout)


# --------------------------------------------------------------------------- windows
@given(layouts())
def test_window_minus_one_is_no_window(layout: BatchLayout) -> None:
    assert AttentionGroup(window_left=-1) == AttentionGroup.full() == AttentionGroup.sliding(-1)
    for _, spec in _plans(layout):
        for gp in spec.group_plans:
            if gp.group.window_left != -1:
                continue
            assert not gp.group.has_window
            assert all(c.window_left == -1 for c in (gp.paged, gp.ragged) if c is not None)
            assert not gp.uses_custom_mask
            if gp.paged is None or gp.group.cross_attention:
                continue
            # No window: a paged call reads from the request's first decoder page.
            nonempty = gp.paged.kv_lens > 0
            first_tok = gp.paged.start_page.astype(np.int64) * layout.page_size
            assert (first_tok[nonempty] == gp.key_start[nonempty]).all()


@given(st.data())
def test_window_at_least_seq_equals_full(data: st.DataObject) -> None:
    full = AttentionGroup.full()
    base = data.draw(layouts(groups=(full,), max_len=48, long_len=96), label="layout")
    longest = int(base.seq_lens.max()) if base.batch_size else 0
    w = data.draw(st.integers(max(longest, 0), longest + 64) | st.just(1 << 30), label="window")
    swa = AttentionGroup.sliding(w)
    layout = base.with_groups(full, swa)
    for _, spec in _plans(layout):
        gp_full, gp_swa = spec.group_plan(full), spec.group_plan(swa)
        assert gp_full.path is gp_swa.path
        for a, b in zip(materialize(spec, full), materialize(spec, swa), strict=True):
            assert np.array_equal(a, b)
        assert not gp_swa.uses_custom_mask
        if gp_full.paged is not None:
            assert gp_swa.paged is not None
            for f in ("start_page", "num_pages", "last_page_len", "kv_lens", "page_indptr"):
                assert getattr(gp_full.paged, f).tolist() == getattr(gp_swa.paged, f).tolist()
    for a, b in zip(visibility(layout, full), visibility(layout, swa), strict=True):
        assert np.array_equal(a, b)


# --------------------------------------------------------------------------- pages read
@given(layouts(), st.sampled_from(PATHS))
def test_pages_needed_covers_every_page_read(layout: BatchLayout, path: str) -> None:
    spec = flashplan.plan(layout, HEADS, extend_path=path)
    ps = layout.page_size
    need = spec.pages_needed.astype(np.int64)
    for gp in spec.group_plans:
        p = gp.paged
        if p is None:
            continue
        end = p.start_page.astype(np.int64) + p.num_pages
        assert (end <= need).all(), (gp.group, end.tolist(), need.tolist())
        nonempty = p.kv_lens > 0
        if gp.group.cross_attention:
            # Cross groups read only the encoder's pages.
            assert (end <= _ceil_div(layout.encoder_lens, ps)).all()  # type: ignore[arg-type]
            assert not p.start_page.any()
        else:
            # Self groups never read the encoder's pages.
            first_tok = p.start_page.astype(np.int64) * ps
            assert (first_tok[nonempty] >= layout.decoder_start[nonempty]).all()


# --------------------------------------------------------------------------- group plans
@given(layouts(), st.sampled_from(PATHS))
def test_group_plan_fields(layout: BatchLayout, path: str) -> None:
    spec = flashplan.plan(layout, HEADS, extend_path=path)
    # Groups that compute the same thing (sm_scale None or 1/sqrt(64)) are planned once.
    given, resolved = planned_groups(layout.groups, HEADS.head_dim)
    assert spec.key.groups == resolved
    assert len(set(resolved)) == len(resolved)
    assert {g.resolved(HEADS.head_dim) for g in layout.groups} == set(resolved)
    assert len(spec.group_plans) == len(given)
    for g in layout.groups:
        assert spec.group_plan(g).group.resolved(HEADS.head_dim) == g.resolved(HEADS.head_dim)
    has_prefix = bool(layout.prefix_lens.any())
    for g, gp in zip(given, spec.group_plans, strict=True):
        assert gp.group == g and spec.group_plan(g) is gp
        if g.cross_attention:
            assert gp.paged is not None and gp.paged.window_left == -1
            assert gp.key_start.tolist() == [0] * layout.batch_size
            assert gp.num_keys.tolist() == layout.encoder_lens.tolist()  # type: ignore[union-attr]
            assert gp.paged is not None and not gp.paged.causal and gp.ragged is None
            expected = KernelPath.DECODE if layout.mode is Mode.DECODE else KernelPath.PAGED
            assert gp.path is expected
            continue
        # Every call compiles the group's window in, except the prefix call of
        # ragged + paged, whose window a custom mask carries.
        if gp.ragged is not None:
            assert gp.ragged.window_left == g.window_left
        if gp.paged is not None:
            want = -1 if gp.path is KernelPath.RAGGED_PAGED else g.window_left
            assert gp.paged.window_left == want
        assert gp.key_start.tolist() == layout.decoder_start.tolist()
        assert gp.num_keys.tolist() == layout.seq_lens.tolist()
        if layout.mode is Mode.DECODE:
            expected = KernelPath.DECODE
        elif path == "paged" or (path == "auto" and has_prefix):
            expected = KernelPath.PAGED
        else:
            expected = KernelPath.RAGGED_PAGED if has_prefix else KernelPath.RAGGED
        assert gp.path is expected
        if gp.path is KernelPath.DECODE:
            # One query at the last position: causal or not, it sees every key before it.
            assert gp.paged is not None and gp.ragged is None
        elif gp.path is KernelPath.PAGED:
            assert gp.paged is not None and gp.paged.causal == g.causal and gp.ragged is None
        elif gp.path is KernelPath.RAGGED_PAGED:
            # The prefix is all before every new token: no causal mask on that call.
            assert gp.paged is not None and not gp.paged.causal and gp.ragged is not None
        if gp.uses_custom_mask:
            assert gp.path is KernelPath.RAGGED_PAGED and g.has_window
    assert spec.key.paths == tuple(gp.path for gp in spec.group_plans)


def test_unplanned_group_is_refused() -> None:
    spec = flashplan.plan(BatchLayout.decode([3]), HEADS)
    with pytest.raises(flashplan.PlanMismatchError):
        spec.group_plan(AttentionGroup.sliding(3))
    with pytest.raises(flashplan.PlanMismatchError):
        materialize(spec, AttentionGroup.sliding(3))


@given(decode_layouts())
def test_decode_ignores_extend_path(layout: BatchLayout) -> None:
    specs = [spec for _, spec in _plans(layout)]
    first = dict(_arrays(specs[0]))
    for other in specs[1:]:
        assert other.key == specs[0].key
        arrays = dict(_arrays(other))
        assert arrays.keys() == first.keys()
        for name, arr in arrays.items():
            assert array_key(arr) == array_key(first[name]), name


# --------------------------------------------------------------------------- plan key
@given(st.data(), st.sampled_from(PATHS), head_configs())
def test_plan_key_is_static(data: st.DataObject, path: str, heads: HeadConfig) -> None:
    a = data.draw(layouts(), label="a")
    kw: dict[str, Any] = dict(groups=a.groups, page_size=a.page_size)
    other = decode_layouts(**kw) if a.mode is Mode.DECODE else extend_layouts(**kw)
    b = data.draw(other, label="b")
    ka = flashplan.plan(a, heads, extend_path=path).key
    kb = flashplan.plan(b, heads, extend_path=path).key
    assert hash(ka) == hash(attrs.evolve(ka))
    assert (ka == kb) == (ka.paths == kb.paths)
    if ka.paths == kb.paths:
        assert hash(ka) == hash(kb)
        assert {ka: "wrappers"}[kb] == "wrappers"
    if a.mode is Mode.DECODE or path == "paged":
        assert ka == kb  # the path never depends on the lengths here
    resolved = planned_groups(a.groups, heads.head_dim)[1]
    assert (ka.mode, ka.groups, ka.page_size, ka.heads) == (a.mode, resolved, a.page_size, heads)
    # The key holds no per-request data.
    assert not list(_arrays(ka))


def test_plan_key_differs_on_static_config() -> None:
    layout = BatchLayout.decode([4, 9], page_size=16)
    base = flashplan.plan(layout, HEADS).key
    assert flashplan.plan(layout.replace(page_size=1), HEADS).key != base
    assert flashplan.plan(layout.with_groups(AttentionGroup.sliding(3)), HEADS).key != base
    assert flashplan.plan(layout, attrs.evolve(HEADS, head_dim=128)).key != base
    assert flashplan.plan(BatchLayout.decode([1, 2, 3], page_size=16), HEADS).key == base


# --------------------------------------------------------------------------- purity
@given(layouts(), st.sampled_from(PATHS))
def test_planning_is_deterministic_and_pure(layout: BatchLayout, path: str) -> None:
    before = {
        f.name: array_key(getattr(layout, f.name))
        for f in attrs.fields(BatchLayout)
        if isinstance(getattr(layout, f.name), np.ndarray)
    }
    one = flashplan.plan(layout, HEADS, extend_path=path)
    two = flashplan.plan(layout, HEADS, extend_path=ExtendPath(path))
    assert one.key == two.key
    a, b = dict(_arrays(one)), dict(_arrays(two))
    assert a.keys() == b.keys()
    for name, arr in a.items():
        assert arr.dtype == b[name].dtype and arr.shape == b[name].shape, name
        assert np.array_equal(arr, b[name]), name
    assert dict(_scalars(one)) == dict(_scalars(two))
    after = {name: array_key(getattr(layout, name)) for name in before}
    assert before == after
    for name in before:
        assert not getattr(layout, name).flags.writeable
    assert layout == BatchLayout.of(
        layout.mode,
        layout.seq_lens,
        layout.prefix_lens,
        layout.encoder_lens,
        layout.page_size,
        layout.groups,
    )


def test_plan_arrays_are_read_only() -> None:
    g = AttentionGroup.sliding(2)
    layout = BatchLayout.extend(
        [5, 7], [2, 3], page_size=3, groups=(g, AttentionGroup.cross()), encoder_lens=[4, 0]
    )
    for path in PATHS:
        spec = flashplan.plan(layout, HEADS, extend_path=path)
        writable = [name for name, arr in _arrays(spec) if arr.flags.writeable]
        assert not writable, f"path={path}: writable plan arrays {writable}"


# --------------------------------------------------------------------------- masks / pages
@st.composite
def _threshold_rows(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    bs = draw(st.integers(0, 8))
    qo = draw(st.lists(st.integers(0, 12), min_size=bs, max_size=bs))
    kv = draw(st.lists(st.integers(0, 40) | st.integers(0, 3), min_size=bs, max_size=bs))
    first = [draw(st.integers(-5, k + 5)) for q, k in zip(qo, kv, strict=True) for _ in range(q)]
    return (np.array(qo, np.int32), np.array(kv, np.int32), np.array(first, np.int64))


@given(_threshold_rows())
def test_pack_threshold_rows_matches_dense(rows: tuple[np.ndarray, ...]) -> None:
    qo, kv, first = rows
    dense, row = [], 0
    for q, k in zip(qo.tolist(), kv.tolist(), strict=True):
        m = np.zeros((q, k), dtype=bool)
        for j in range(q):
            m[j, min(max(int(first[row]), 0), k) :] = True
            row += 1
        dense.append(m)
    packed, indptr = pack_threshold_rows(qo, kv, first)
    want, want_indptr = pack_dense(dense)
    assert indptr.tolist() == want_indptr.tolist()
    assert packed.dtype == np.uint8
    assert packed.tobytes() == want.tobytes()
    for i, m in enumerate(dense):
        assert np.array_equal(unpack_request(packed, indptr, i, m.shape[0], m.shape[1]), m)


@given(
    st.lists(st.tuples(st.integers(0, 200), st.integers(0, 200)), max_size=8),
    st.sampled_from((1, 2, 3, 4, 16, 64)),
)
def test_paged_segments_brute_force(spans: list[tuple[int, int]], page_size: int) -> None:
    first = np.array([f for f, _ in spans], dtype=np.int32)
    end = np.array([e for _, e in spans], dtype=np.int32)
    seg = PagedPart.over(PageSpans.between(first, end, page_size), causal=True, window_left=-1)
    indptr = [0]
    for i, (f, e) in enumerate(spans):
        if e <= f:
            want = (0, 0, 0, 0)
        else:
            start_page = f // page_size
            tokens = e - start_page * page_size
            pages = math.ceil(tokens / page_size)
            # The pages hold [f, e) and nothing past the page holding e - 1.
            assert start_page * page_size <= f < (start_page + 1) * page_size
            assert (start_page + pages - 1) * page_size <= e - 1 < (start_page + pages) * page_size
            want = (start_page, pages, tokens - (pages - 1) * page_size, tokens)
        got = (
            int(seg.start_page[i]),
            int(seg.num_pages[i]),
            int(seg.last_page_len[i]),
            int(seg.kv_lens[i]),
        )
        assert got == want, (f, e, page_size)
        indptr.append(indptr[-1] + want[1])
    assert seg.page_indptr.tolist() == indptr
    for arr in (seg.start_page, seg.num_pages, seg.last_page_len, seg.kv_lens, seg.page_indptr):
        assert arr.dtype == np.int32
        assert not arr.flags.writeable


@given(
    st.one_of(layouts(), verify_layouts()),
    st.sampled_from(PATHS),
)
def test_whole_row_calls_read_the_layouts_row_spans(layout: BatchLayout, path: str) -> None:
    """A paged call that reads each request's whole row (a decode, a paged extend or a
    verify of a group without window or chunks, no encoder) is planned on the layout's
    own ``row_spans`` (derived once per layout, shared with ``pages_needed``), which are
    the spans ``PageSpans.between`` gives for row token 0 to the row's end."""
    if layout.mode is Mode.VERIFY:
        path = "paged"  # (a verify runs on the paged path only)
    spec = flashplan.plan(layout, HEADS, extend_path=path)
    end = layout.decoder_start.astype(np.int64) + layout.seq_lens  # encoder, then decoder
    whole = PageSpans.between(np.zeros_like(end), end, layout.page_size)
    assert layout.row_spans == whole
    for gp in spec.group_plans:
        g = gp.group
        reads_whole_rows = (
            gp.paged is not None
            and gp.path in (KernelPath.DECODE, KernelPath.PAGED)
            and not g.cross_attention
            and g.window_left < 0
            and not g.has_chunks
            and layout.encoder_lens is None
            and gp.paged.position_mask is None
        )
        if reads_whole_rows:
            assert gp.paged is not None
            assert gp.paged.spans is layout.row_spans
