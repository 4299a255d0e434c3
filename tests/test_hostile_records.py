"""Hostile input on every route to a record: refused by a flashplan error naming the field,
or planned and run equal to the dense oracle (issue 50, items 3 and 4).

For each record a user builds, Hypothesis draws raw field values — ints, negative ints,
floats, bools, ``None``, strings, lists, nested lists, float / int64 / uint / bool arrays,
CPU tensors, lengths of the wrong batch size, ``prefix > seq``, decodes that add more than
one token, out-of-range delimiters, values and totals beyond int32 — and builds the record
on each route to it: the attrs ``__init__``, ``attrs.evolve`` of a valid record (and
``BatchLayout.replace``), ``BatchLayout.of`` and the named constructors. Each draw must
either raise a :class:`~flashplan.FlashplanError` (a ``ValueError``) whose ``field`` is one
the route was given, or give a record that :func:`flashplan.plan` plans and the
:class:`~flashplan.ReferenceExecutor` runs equal to float64 attention over the keys
:mod:`flashplan.oracle` says each query sees (the new K/V landing where the layout says).
Any other exception fails the test.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import flashplan as fp
from flashplan.oracle import dense_attention, key_row_tokens, visibility

HEADS = fp.HeadConfig(2, 1, 8, q_dtype=torch.float32)
GARBAGE = 8.0  # what cache slots hold before anything is written (finite: masked reads)
LAYOUT_FIELDS = frozenset(f.name for f in attrs.fields(fp.BatchLayout))
FULL, SWA = fp.AttentionGroup(), fp.AttentionGroup.sliding(2)
BIDI, BAND = (
    fp.AttentionGroup.bidirectional(),
    fp.AttentionGroup.bidirectional(window_left=1, window_right=2),
)
CHUNK, CROSS = fp.AttentionGroup.chunked(3), fp.AttentionGroup.cross()
SINK = fp.AttentionGroup.sliding(3, sinks=True, logits_soft_cap=5.0)
GROUPS = (FULL, SWA, BIDI, BAND, CHUNK, CROSS, SINK)
#: Largest page-table span (tokens) an accepted layout is run with: a valid layout of
#: ``2**31 - 1``-token rows (planned) would need terabytes of cache.
MAX_RUN_TOKENS = 4096
SPARE_PAGES = 2  # unused pages of the pool a layout is run with
HOSTILE = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    """Tiny tensors: torch's thread pool only spins on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --------------------------------------------------------------------------- raw values
def _scalar_junk() -> st.SearchStrategy[Any]:
    return st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**40), 2**40),
        st.sampled_from((2**31 - 1, 2**31, -1, 0, 2**63, -(2**70))),
        st.floats(allow_nan=True, allow_infinity=True),
        st.sampled_from((2.0, 2.5, "3", "", b"x", [[1, 2]], (), 1j, np.float64(4.0))),
        st.sampled_from((np.int64(3), np.uint8(2), np.bool_(True), np.array(3))),
    )


def _containers(values: list[int]) -> st.SearchStrategy[Any]:
    """The same integers in a container a caller may hand over."""

    def sealed() -> np.ndarray:
        a = np.array(values, dtype=np.int32)
        a.setflags(write=False)
        return a

    return st.sampled_from(
        (
            lambda: list(values),
            lambda: tuple(values),
            lambda: np.array(values, dtype=np.int64),
            lambda: np.array(values, dtype=np.int32),
            sealed,
            lambda: np.array(values, dtype=np.int64).astype(np.uint32),  # -1 wraps
            lambda: np.array(values, dtype=np.float64),
            lambda: [float(v) for v in values],
            lambda: torch.tensor(values, dtype=torch.int64),
            lambda: torch.tensor(values, dtype=torch.float32),
        )
    ).map(lambda make: make())


@st.composite
def _per_request(draw: st.DrawFn, values: list[int], hostile: bool) -> Any:
    """``values`` in some container, or (``hostile``) a corrupted form of them."""
    if not hostile:
        return draw(_containers(values))
    kind = draw(st.sampled_from(("element", "length", "nested", "scalar", "huge", "array")))
    if kind == "element" and values:
        out: list[Any] = list(values)
        out[draw(st.integers(0, len(out) - 1))] = draw(_scalar_junk())
        return out
    if kind == "length":
        return [*values, 1] if draw(st.booleans()) or not values else values[:-1]
    if kind == "nested":
        return [list(values)]
    if kind == "huge":
        big = draw(st.sampled_from((2**31 - 1, 2**31, 2**40)))
        return [big] * max(len(values), 2)
    if kind == "array":
        dtype = draw(st.sampled_from((np.float64, np.uint64, np.int64, np.bool_, np.float16)))
        arr = np.array(values, dtype=np.float64) + draw(st.sampled_from((0.5, 2**33, -3, 0)))
        with np.errstate(all="ignore"):
            return arr.astype(dtype)
    return draw(_scalar_junk())


@st.composite
def _groups(draw: st.DrawFn, encoder: bool) -> Any:
    kinds = GROUPS if encoder else tuple(g for g in GROUPS if g is not CROSS)
    groups = draw(st.lists(st.sampled_from(kinds), min_size=1, max_size=3, unique=True))
    if draw(st.booleans()):  # mostly causal: more of the mixes every mode accepts
        groups = [FULL, *(g for g in groups if g.causal and not g.sinks)][:2]
    if draw(st.integers(0, 14)) == 0:  # hostile
        return draw(st.sampled_from(((), "full", (FULL, FULL), [FULL, None], (CROSS,), 3, None)))
    return tuple(groups) if draw(st.booleans()) else groups


@st.composite
def _items(draw: st.DrawFn, ext: list[int], hostile: bool) -> Any:
    per: list[Any] = []
    for e in ext:
        if e == 0 or draw(st.integers(0, 2)) == 0:
            per.append(None)
        else:
            per.append(sorted(draw(st.sets(st.integers(0, e - 1), max_size=3))))
    if hostile and per:
        i = draw(st.integers(0, len(per) - 1))
        per[i] = draw(
            st.sampled_from(([-1], [ext[i]], [ext[i] + 5], [2, 1], [1, 1], [0.5], ["x"], 3))
        )
    if draw(st.integers(0, 9)) == 0:
        return draw(st.sampled_from((per[:-1], [*per, None], [per], "items", 7)))
    return per


@st.composite
def raw_layouts(draw: st.DrawFn) -> dict[str, Any]:
    """Every field of a :class:`~flashplan.BatchLayout`, mostly consistent and small, with
    up to two fields corrupted (``_per_request`` and friends)."""
    junk_mode = draw(st.integers(0, 19)) == 0
    mode = draw(st.sampled_from(("decode", None, 1) if junk_mode else tuple(fp.Mode)))
    bs = draw(st.integers(0, 4))
    n = draw(st.integers(1, 4))  # draft tokens (verify)
    seq = [draw(st.integers(1, 11)) for _ in range(bs)]
    if mode is fp.Mode.DECODE:
        ext = [1] * bs
    elif mode is fp.Mode.VERIFY:
        ext = [n] * bs
        seq = [s + n for s in seq]
    else:
        ext = [draw(st.integers(0, s)) for s in seq]
    pre = [s - e for s, e in zip(seq, ext, strict=True)]
    if draw(st.integers(0, 7)) == 0 and bs:  # prefix > seq, or a decode adding 2 tokens
        i = draw(st.integers(0, bs - 1))
        pre[i] = draw(st.sampled_from((seq[i] + 1, seq[i] - 2, seq[i] + 40)))
    corruptible = st.sampled_from(("seq", "pre", "enc", "cached", "items"))
    bad = set(draw(st.lists(corruptible, max_size=2))) if draw(st.integers(0, 2)) == 0 else set()
    encoder = draw(st.booleans())
    junk_page = draw(st.integers(0, 9)) == 0
    enc = [draw(st.integers(0, 9)) for _ in range(bs)]
    fields: dict[str, Any] = {
        "mode": mode,
        "seq_lens": draw(_per_request(seq, "seq" in bad)),
        "prefix_lens": draw(_per_request(pre, "pre" in bad)),
        "encoder_lens": draw(_per_request(enc, "enc" in bad)) if encoder else None,
        "page_size": draw(_scalar_junk() if junk_page else st.sampled_from((1, 2, 3, 16))),
        "groups": draw(_groups(encoder)),
    }
    if encoder and draw(st.booleans()):
        cached = [draw(st.booleans()) for _ in range(bs)]
        fields["encoder_cached"] = (
            draw(st.sampled_from(([1] * bs, [*cached, True], "yes", None)))
            if "cached" in bad
            else cached
        )
    if mode is fp.Mode.VERIFY and draw(st.integers(0, 9)) > 0:
        fields["draft"] = fp.DraftTree.chain(bs, n) if draw(st.booleans()) else _tree(draw, bs, n)
    elif draw(st.integers(0, 9)) == 0:
        fields["draft"] = draw(st.sampled_from(([[-1, 0]], "tree", fp.DraftTree.chain(bs, 2))))
    if (mode is fp.Mode.EXTEND and draw(st.integers(0, 2)) == 0) or draw(st.integers(0, 19)) == 0:
        fields["item_delimiters"] = draw(_items(ext, "items" in bad))
    return fields


def _tree(draw: st.DrawFn, bs: int, n: int) -> fp.DraftTree:
    parents = [[-1] + [draw(st.integers(0, j - 1)) for j in range(1, n)] for _ in range(bs)]
    return fp.DraftTree.from_parents(np.array(parents, dtype=np.int64).reshape(bs, n))


# --------------------------------------------------------------------------- outcomes
def refused_or_runs(
    build: Callable[[], Any],
    fields: Sequence[str],
    check: Callable[[Any], None],
) -> bool:
    """Build; a refusal must be a flashplan error naming one of ``fields``; a record must
    pass ``check``. Returns whether it was accepted."""
    try:
        record = build()
    except fp.FlashplanError as err:
        assert isinstance(err, ValueError)
        assert err.field in fields, (err.field, str(err))
        assert str(err).startswith(err.field), str(err)
        event(f"refused ({err.field})")
        return False
    event("accepted")
    check(record)
    return True


def layout_runs(layout: fp.BatchLayout, **plan_kwargs: Any) -> None:
    """An accepted layout is sound, plans, and runs equal to the oracle."""
    for name in ("seq_lens", "prefix_lens", "encoder_lens"):
        arr = getattr(layout, name)
        if arr is not None:
            assert arr.dtype == np.int32 and arr.ndim == 1 and not arr.flags.writeable, name
    assert type(layout.page_size) is int and type(layout.groups) is tuple
    assert attrs.evolve(layout) == layout and hash(attrs.evolve(layout)) == hash(layout)
    for prop in ("pages_needed", "decoder_start", "row_spans", "extend_lens", "total_new_tokens"):
        getattr(layout, prop)  # no property of an accepted layout raises
    spec = fp.plan(layout, HEADS, **plan_kwargs)
    assert spec.total_q == layout.total_new_tokens
    if (int(spec.pages_needed.sum()) + SPARE_PAGES) * layout.page_size > MAX_RUN_TOKENS:
        event("accepted and planned, too large to run (values near int32)")
        return
    matches_oracle(layout, spec, plan_kwargs.get("shared_prefix"))


def _slots(table: fp.PageTable, i: int, tokens: np.ndarray, ps: int) -> tuple[Any, Any]:
    row = int(table.rows[i])
    t = torch.from_numpy(tokens.astype(np.int64))
    return table.pages[row, t // ps].long(), t % ps


def matches_oracle(
    layout: fp.BatchLayout, spec: fp.PlanSpec, shared: fp.SharedPrefix | None = None
) -> None:
    """Run every group of ``spec`` on a fresh reference executor over a shuffled page table
    (cached keys written first, as an engine leaves them) and compare with float64
    attention over the oracle's keys, and the new K/V with the slots the layout implies."""
    gen = torch.Generator().manual_seed(layout.batch_size * 7919 + layout.page_size)
    table = fp.PageTable.shuffled(
        spec.pages_needed, seed=layout.batch_size, spare_pages=SPARE_PAGES
    )
    if shared is not None:
        table = fp.PageTable(
            fp.share_pages(shared, table.pages, table.rows, layout.page_size), table.rows,
            table.num_pages,
        )  # fmt: skip
    ex = fp.ReferenceExecutor()
    ex.apply(spec, table)
    ps, hq, hkv, d = layout.page_size, HEADS.num_qo_heads, HEADS.num_kv_heads, HEADS.head_dim
    qo = spec.qo_indptr.tolist()
    assert table.num_pages is not None
    for group in layout.groups:
        cache = torch.full((table.num_pages, 2, ps, hkv, d), GARBAGE)
        tokens = key_row_tokens(layout, group)
        keys = [torch.randn(2, len(t), hkv, d, generator=gen) for t in tokens]
        if shared is not None:  # members hold their shared tokens' K/V on the same pages
            for level in shared.levels:
                for g in range(level.num_groups):
                    first, n = int(level.first[g]), int(level.shared_len[g])
                    for m in range(first + 1, first + int(level.count[g])):
                        keys[m][:, :n] = keys[first][:, :n]
        if group.cross_attention:
            cached = layout.encoder_cached
            new = [len(t) if cached is not None and cached[i] else 0 for i, t in enumerate(tokens)]
        else:
            new = layout.prefix_lens.tolist()
        for i, first in enumerate(new):
            page, slot = _slots(table, i, tokens[i][:first], ps)
            cache[page, 0, slot], cache[page, 1, slot] = keys[i][0, :first], keys[i][1, :first]
        q = torch.randn(spec.total_q, hq, d, generator=gen)
        k_new = torch.cat([k[0, f:] for k, f in zip(keys, new, strict=True)] or [q[:0, :hkv]])
        v_new = torch.cat([k[1, f:] for k, f in zip(keys, new, strict=True)] or [q[:0, :hkv]])
        sinks = torch.randn(hq, generator=gen) if group.sinks else None
        out, lse = ex.run(group, q, k_new, v_new, cache, return_lse=True, sinks=sinks)
        for i, first in enumerate(new):
            page, slot = _slots(table, i, tokens[i][first:], ps)
            assert torch.equal(cache[page, 0, slot], keys[i][0, first:]), (group, i)
            assert torch.equal(cache[page, 1, slot], keys[i][1, first:]), (group, i)
        seen = visibility(layout, group)
        for i in range(layout.batch_size):
            want, want_lse = dense_attention(
                q[qo[i] : qo[i + 1]], keys[i][0], keys[i][1], seen[i], group, sinks
            )
            got, got_lse = out[qo[i] : qo[i + 1]].double(), lse[qo[i] : qo[i + 1]].double()
            assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (group, i)
            finite = torch.isfinite(want_lse)
            assert torch.equal(torch.isfinite(got_lse), finite), (group, i)
            assert torch.allclose(got_lse[finite], want_lse[finite], atol=1e-4), (group, i)


# --------------------------------------------------------------------------- BatchLayout
#: Valid layouts that ``attrs.evolve`` / ``replace`` change.
BASES = (
    fp.BatchLayout.extend([5, 9, 3], [2, 0, 3], page_size=2, groups=(FULL, SWA)),
    fp.BatchLayout.decode([4, 1], page_size=3),
    fp.BatchLayout.verify([4, 0], fp.DraftTree.from_parents([[-1, 0, 0], [-1, 0, 1]])),
    fp.BatchLayout.extend([9, 6], [1, 0], item_delimiters=[[2, 5], None], page_size=4),
    fp.BatchLayout.extend(
        [5, 2], [3, 0], encoder_lens=[4, 0], groups=(FULL, CROSS), encoder_cached=[True, False]
    ),
)


@pytest.mark.filterwarnings("error")
@HOSTILE
@given(
    fields=raw_layouts(),
    route=st.sampled_from(("init", "of", "evolve", "replace")),
    base=st.sampled_from(BASES),
    data=st.data(),
)
def test_layout_from_raw_fields_is_refused_or_runs(
    fields: dict[str, Any], route: str, base: fp.BatchLayout, data: st.DataObject
) -> None:
    """``BatchLayout(...)``, ``BatchLayout.of``, and ``attrs.evolve`` / ``replace`` of a
    valid layout with some of the drawn fields."""
    build: Callable[[], Any]
    if route == "init":
        build = lambda: fp.BatchLayout(**fields)  # noqa: E731
    elif route == "of":
        build = lambda: fp.BatchLayout.of(**fields)  # noqa: E731
    else:
        names = data.draw(st.lists(st.sampled_from(sorted(fields)), min_size=1, unique=True))
        changes = {k: fields[k] for k in names}
        if route == "evolve":
            build = lambda: attrs.evolve(base, **changes)  # noqa: E731
        else:
            build = lambda: base.replace(**changes)  # noqa: E731
    refused_or_runs(build, LAYOUT_FIELDS, layout_runs)


def _named(
    fields: dict[str, Any], ctor: str, data: st.DataObject
) -> tuple[Callable[[], Any], set[str]]:
    """A named constructor's call on (some of) the drawn fields, and its argument names."""
    common = {k: fields[k] for k in ("page_size", "groups") if k in fields}
    enc = {k: fields[k] for k in ("encoder_lens", "encoder_cached") if fields.get(k) is not None}
    seq, pre = fields["seq_lens"], fields["prefix_lens"]
    kwargs: dict[str, Any]
    if ctor == "decode":
        kwargs = {"seq_lens": seq, **common, **enc}
    elif ctor == "extend":
        items = (
            {"item_delimiters": fields["item_delimiters"]} if "item_delimiters" in fields else {}
        )
        kwargs = {"seq_lens": seq, "prefix_lens": pre, **common, **enc, **items}
    elif ctor == "from_extend_lens":
        kwargs = {"extend_lens": seq, "prefix_lens": pre, **common, **enc}
    elif ctor == "verify":
        draft = fields.get("draft", data.draw(st.sampled_from((None, [[-1, 0]], "x"))))
        kwargs = {"prefix_lens": pre, "draft": draft, **common, **enc}
    elif ctor == "draft_extend":
        n = data.draw(st.none() | st.integers(1, 4) | _scalar_junk())
        kwargs = {"prefix_lens": pre, "accepted_lens": seq, "tokens_per_request": n, **common}
    else:
        block = data.draw(st.integers(1, 4) | _scalar_junk())
        kwargs = {"seq_lens": seq, "block_size": block, **common, **enc}
    method = getattr(fp.BatchLayout, ctor)
    names = {*inspect.signature(method).parameters, *LAYOUT_FIELDS}  # its arguments or fields
    if "kwargs" in names:  # passed on to extend
        names |= set(inspect.signature(fp.BatchLayout.extend).parameters)
    return (lambda: method(**kwargs)), names


@pytest.mark.filterwarnings("error")
@HOSTILE
@given(
    fields=raw_layouts(),
    ctor=st.sampled_from(
        ("decode", "extend", "from_extend_lens", "verify", "draft_extend", "block_extend")
    ),
    data=st.data(),
)
def test_named_constructors_on_raw_fields_refuse_or_run(
    fields: dict[str, Any], ctor: str, data: st.DataObject
) -> None:
    build, names = _named(fields, ctor, data)
    refused_or_runs(build, names, layout_runs)


# --------------------------------------------------------------------------- other records
def _layout_for(group: fp.AttentionGroup) -> fp.BatchLayout:
    enc = {"encoder_lens": [4, 0, 6]} if group.cross_attention else {}
    return fp.BatchLayout.extend([5, 9, 3], [2, 0, 3], page_size=2, groups=(group,), **enc)


def _group_runs(group: fp.AttentionGroup) -> None:
    assert hash(group) == hash(attrs.evolve(group)) and attrs.evolve(group) == group
    layout_runs(_layout_for(group))
    if not group.cross_attention:
        layout_runs(fp.BatchLayout.decode([5, 1, 12], page_size=4, groups=group))


@st.composite
def _group_fields(draw: st.DrawFn) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, plain in (
        ("window_left", st.integers(-2, 6)),
        ("window_right", st.integers(-2, 6)),
        ("causal", st.booleans()),
        ("cross_attention", st.booleans()),
        ("logits_soft_cap", st.floats(-1, 50)),
        ("sm_scale", st.none() | st.floats(0.01, 2)),
        ("attention_chunk_size", st.integers(0, 5)),
        ("sinks", st.booleans()),
    ):
        if draw(st.integers(0, 2)) == 0:
            out[name] = draw(plain if draw(st.integers(0, 3)) else _scalar_junk())
    return out


@st.composite
def _tree_parents(draw: st.DrawFn) -> Any:
    bs, n = draw(st.integers(0, 3)), draw(st.integers(0, 5))
    rows = [[-1] + [draw(st.integers(-2, j)) for j in range(1, n)] if n else [] for _ in range(bs)]
    return draw(
        st.sampled_from(
            (
                rows,
                np.array(rows, dtype=np.int64).reshape(bs, n),
                np.array(rows, dtype=np.float64).reshape(bs, n),
                torch.tensor(rows, dtype=torch.int64).reshape(bs, n),
                [r[1:] for r in rows],
                rows[0] if rows else [],
            )
        )
        | _scalar_junk()
    )


def _tree_runs(tree: fp.DraftTree) -> None:
    assert tree.parents.dtype == np.int32 and not tree.parents.flags.writeable
    prefix = [3 * i for i in range(tree.batch_size)]
    layout_runs(fp.BatchLayout.verify(prefix, tree, page_size=2, groups=(FULL, SWA)))


def _items_run(items: fp.ItemDelimiters) -> None:
    ext = [int(last) + 2 for last in items.last]
    layout_runs(fp.BatchLayout.from_extend_lens(ext, [1] * len(ext), item_delimiters=items))


def _heads_plan(heads: fp.HeadConfig) -> None:
    assert heads.num_qo_heads % heads.num_kv_heads == 0
    fp.plan(fp.BatchLayout.extend([5, 2], [1, 0], page_size=2, groups=(FULL, SWA)), heads)


def _share_runs(shared: fp.SharedPrefix) -> None:
    """A shared prefix over a batch with enough requests and cached tokens, planned with
    cascade levels and run (when small enough)."""
    end = max(int((lv.first.astype(np.int64) + lv.count).max(initial=0)) for lv in shared.levels)
    if end > 40 or max(int(lv.shared_len.max(initial=0)) for lv in shared.levels) > 64:
        event("accepted, too large to run")
        return
    deep = shared.deepest_tokens(end)
    decode = fp.BatchLayout.decode((deep + 1).tolist(), page_size=2)
    layout_runs(decode, shared_prefix=shared, cascade="on")
    extend = fp.BatchLayout.extend((deep + 3).tolist(), deep.tolist(), page_size=2)
    layout_runs(extend, shared_prefix=shared, cascade="on")


def _share_level_runs(level: fp.ShareLevel) -> None:
    for name in ("first", "count", "shared_len"):
        assert getattr(level, name).dtype == np.int32
    _share_runs(fp.SharedPrefix.nested(level))


def _evolve_or_init(
    record: Any, cls: type, route: str, fields: dict[str, Any]
) -> Callable[[], Any]:
    if route == "init":
        return lambda: cls(**fields)
    return lambda: attrs.evolve(record, **fields)


_LEVEL = fp.ShareLevel.from_ranges([0, 3], [2, 3], [4, 6])


@st.composite
def _level_fields(draw: st.DrawFn) -> dict[str, Any]:
    n = draw(st.integers(0, 3))
    count = [draw(st.integers(0, 4)) for _ in range(n)]
    first = [sum(count[:g]) + draw(st.integers(-1, 2)) for g in range(n)]
    shared = [draw(st.integers(-1, 9)) for _ in range(n)]
    out = {}
    for name, values in (("first", first), ("count", count), ("shared_len", shared)):
        out[name] = draw(_per_request(values, draw(st.integers(0, 5)) == 0))
    return out


def _group_case(route: str, draw: st.DrawFn) -> None:
    fields = draw(_group_fields())
    build = _evolve_or_init(fp.AttentionGroup.sliding(3), fp.AttentionGroup, route, fields)
    refused_or_runs(build, set(attrs.fields_dict(fp.AttentionGroup)), _group_runs)


def _tree_case(route: str, draw: st.DrawFn) -> None:
    base = fp.DraftTree.from_parents([[-1, 0, 0, 1], [-1, 0, 1, 2]])
    build = _evolve_or_init(base, fp.DraftTree, route, {"parents": draw(_tree_parents())})
    refused_or_runs(build, {"parents"}, _tree_runs)


def _items_case(route: str, draw: st.DrawFn) -> None:
    bs = draw(st.integers(0, 3))
    counts = [draw(st.integers(0, 3)) for _ in range(bs)]
    indptr = [sum(counts[:i]) for i in range(bs + 1)]
    positions = [draw(st.integers(-1, 9)) for _ in range(indptr[-1])]
    fields = {
        "indptr": draw(_per_request(indptr, draw(st.integers(0, 4)) == 0)),
        "positions": draw(_per_request(positions, draw(st.integers(0, 4)) == 0)),
    }
    base = fp.ItemDelimiters.from_lists([[1, 4], None])
    refused_or_runs(
        _evolve_or_init(base, fp.ItemDelimiters, route, fields), {"item_delimiters"}, _items_run
    )


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int32)


def _heads_case(route: str, draw: st.DrawFn) -> None:
    fields = {}
    for name in ("num_qo_heads", "num_kv_heads", "head_dim", "q_dtype", "kv_dtype", "out_dtype"):
        required = route == "init" and not name.endswith("dtype")
        if required or draw(st.booleans()):
            plain = st.sampled_from(_DTYPES) if name.endswith("dtype") else st.integers(1, 8)
            fields[name] = draw(plain if draw(st.integers(0, 3)) else _scalar_junk())
    build = _evolve_or_init(fp.HeadConfig(8, 2, 64), fp.HeadConfig, route, fields)
    refused_or_runs(build, set(attrs.fields_dict(fp.HeadConfig)), _heads_plan)


def _level_case(route: str, draw: st.DrawFn) -> None:
    build = _evolve_or_init(_LEVEL, fp.ShareLevel, route, draw(_level_fields()))
    refused_or_runs(build, {"first", "count", "shared_len"}, _share_level_runs)


def _shared_case(route: str, draw: st.DrawFn) -> None:
    inner = fp.ShareLevel.from_ranges([0, 3], [2, 2], [draw(st.integers(1, 8)), 9])
    levels = draw(
        st.sampled_from(((_LEVEL,), (_LEVEL, inner), (inner, _LEVEL), _LEVEL, [], None))
        | st.lists(st.sampled_from((_LEVEL, inner, None)), max_size=3)
    )
    base = fp.SharedPrefix.nested(_LEVEL)
    build = _evolve_or_init(base, fp.SharedPrefix, route, {"levels": levels})
    refused_or_runs(build, {"levels", "shared_len"}, _share_runs)


def _draft_decode_case(route: str, draw: st.DrawFn) -> None:
    prefix = [draw(st.integers(0, 9)) for _ in range(draw(st.integers(0, 3)))]
    fields = {
        "prefix_lens": draw(_per_request(prefix, draw(st.integers(0, 3)) == 0)),
        "topk": draw(st.integers(1, 3) | _scalar_junk()),
        "steps": draw(st.integers(1, 3) | _scalar_junk()),
        "page_size": draw(st.sampled_from((1, 2, 16)) | _scalar_junk()),
        "groups": draw(_groups(encoder=False)),
    }
    build = _evolve_or_init(fp.DraftDecode([3, 5], 2, 2), fp.DraftDecode, route, fields)
    refused_or_runs(build, set(fields), lambda dd: fp.plan_steps(dd, HEADS))


_TABLES = (
    torch.arange(12, dtype=torch.int32).reshape(3, 4),
    torch.zeros(3, 0, dtype=torch.int32),
    torch.zeros(3, 4, dtype=torch.int64),
    [[0, 1]],
    None,
)


def _table_applies(table: fp.PageTable) -> None:
    """A table that passes is applied with a plan, or refused by a PageTableError."""
    spec = fp.plan(fp.BatchLayout.decode([1, 3, 4], page_size=1), HEADS)
    try:
        fp.ReferenceExecutor().apply(spec, table)
    except fp.PageTableError as err:
        assert err.field in ("rows", "pages", "num_pages"), str(err)


def _table_case(route: str, draw: st.DrawFn) -> None:
    rows = draw(_per_request(draw(st.permutations([0, 1, 2])), draw(st.booleans())))
    fields = {
        "pages": draw(st.sampled_from(_TABLES)),
        "rows": rows,
        "num_pages": draw(st.none() | _scalar_junk()),
    }
    build = _evolve_or_init(fp.PageTable.sequential([1, 2, 3]), fp.PageTable, route, fields)
    refused_or_runs(build, {"pages", "rows", "num_pages"}, _table_applies)


#: Per record: draws its raw fields, builds it on a route and checks the outcome.
RECORD_CASES: dict[str, Callable[[str, st.DrawFn], None]] = {
    "AttentionGroup": _group_case,
    "DraftTree": _tree_case,
    "ItemDelimiters": _items_case,
    "HeadConfig": _heads_case,
    "ShareLevel": _level_case,
    "SharedPrefix": _shared_case,
    "DraftDecode": _draft_decode_case,
    "PageTable": _table_case,
}


@pytest.mark.filterwarnings("error")
@HOSTILE
@given(
    record=st.sampled_from(sorted(RECORD_CASES)),
    route=st.sampled_from(("init", "evolve")),
    data=st.data(),
)
def test_other_records_from_raw_fields_are_refused_or_run(
    record: str, route: str, data: st.DataObject
) -> None:
    """The other records a user builds, on ``Record(...)`` and ``attrs.evolve``."""
    RECORD_CASES[record](route, data.draw)


# --------------------------------------------------------------------------- the issue's cases
def test_issue_50_layouts_from_raw_fields_are_refused() -> None:
    """The three layouts of issue 50, item 3, and item 4's totals."""
    with pytest.raises(fp.LayoutError) as err:  # was: plan() raised AttributeError
        fp.BatchLayout(fp.Mode.DECODE, [5, 7], [4, 6], item_delimiters=[[0], None])
    assert err.value.field == "item_delimiters"
    with pytest.raises(fp.LayoutError) as err:  # was: planned one write, read two new keys
        fp.BatchLayout(
            fp.Mode.DECODE, np.array([5, 6], np.int32), np.array([4, 4], np.int32), None, 1,
            (fp.AttentionGroup(),),
        )  # fmt: skip
    assert (err.value.field, err.value.request) == ("seq_lens", 1)
    with pytest.raises(fp.FieldTypeError) as err:  # was: stored as float64
        fp.BatchLayout(fp.Mode.EXTEND, [5.5, 6.0], [1, 2])
    assert (err.value.field, err.value.request) == ("seq_lens", 0)
    layout = fp.BatchLayout(fp.Mode.EXTEND, [5, 6.0], (1, 2))  # plain lists: converted
    assert layout == fp.BatchLayout.extend([5, 6], [1, 2])
    assert layout.seq_lens.dtype == np.int32 and not layout.prefix_lens.flags.writeable
    with pytest.raises(fp.LayoutError) as err:
        attrs.evolve(layout, prefix_lens=[6, 2])
    assert (err.value.field, err.value.request) == ("prefix_lens", 0)
    with pytest.raises(fp.LayoutError) as err:  # was: accepted; pages_needed raised
        fp.BatchLayout.extend([2**31 - 1] * 3)
    assert err.value.field == "seq_lens" and "total_new_tokens=6442450941" in str(err.value)
    with pytest.raises(fp.LayoutError) as err:
        fp.ShareLevel([0], [2], [0])  # was: stored; a SharedPrefix of it planned
    assert err.value.field == "shared_len"
    with pytest.raises(fp.FieldTypeError) as err:
        fp.SharedPrefix((fp.ShareLevel.from_ranges([0], [2], [4]), "level"))
    assert err.value.field == "levels"


def test_decode_shortcut_equals_the_checking_init() -> None:
    """``BatchLayout.decode`` stores its fields without ``__init__``: every field is set, and
    the record equals (and plans like) the one ``__init__`` builds from the same fields."""
    fast = fp.BatchLayout.decode([3, 1, 9], page_size=4, groups=(FULL, SWA))
    slow = fp.BatchLayout(fp.Mode.DECODE, [3, 1, 9], [2, 0, 8], None, 4, [FULL, SWA])
    assert fast == slow and hash(fast) == hash(slow)
    for field in attrs.fields(fp.BatchLayout):
        a, b = getattr(fast, field.name), getattr(slow, field.name)
        assert type(a) is type(b), field.name
    assert fp.plan(fast, HEADS) == fp.plan(slow, HEADS)
    assert math.isfinite(float(fast.pages_needed.sum()))
