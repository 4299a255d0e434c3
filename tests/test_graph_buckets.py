"""CUDA-graph buckets on the CPU: buffer sizes, padding rows and refusals are pure host
functions of the bucket (the graphs themselves run in tests/gpu/test_step_loop.py).

The padded gather runs here through the gather kernel's torch twin into the bucket's
fixed buffers: the real requests' entries must equal an unpadded gather's, every
padding request must read exactly one dummy page and write nowhere, and nothing may be
written outside the fixed regions.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashplan as fp
from flashplan.executor.flashinfer.bucket import (
    GraphBucket,
    bucket_gather_jobs,
    check_fits,
    padded_inputs,
    padded_masks,
)
from flashplan.executor.flashinfer.calls import (
    call_inputs,
    call_skeleton,
    flashinfer_mask_offsets,
)
from flashplan.executor.flashinfer.policy import ExecutorPolicy
from flashplan.executor.gathers import GatherJobs, gather_jobs, pages_region
from flashplan.kernels import build_custom_mask_torch, gather_slots_torch
from flashplan.testing import (
    decode_layouts,
    fixed_token_extend_layouts,
    page_tables,
    verify_layouts,
)

HEADS = fp.HeadConfig(8, 2, 64)


def _gather(jobs, table, total: int, fill: int = -7):  # type: ignore[no-untyped-def]
    page = torch.full((max(total, 1),), fill, dtype=torch.int32)
    offset = torch.full((max(total, 1),), fill, dtype=torch.int32)
    cols = [torch.from_numpy(np.array(c, dtype=np.int32)) for c in jobs.columns()]
    gather_slots_torch(table.pages, *cols, page, offset, total=int(jobs.counts.sum()))
    return page.numpy(), offset.numpy()


def _check_replan_arrays(host: dict, page_size: int) -> None:  # type: ignore[type-arg]
    """The padded mask indptrs of prefill calls are FlashInfer's own derivation from the
    padded page indptr and last-page lengths (padding requests: one key each)."""
    for name in host:
        if not name.endswith(".mask.indptr"):
            continue
        g = name[: -len("mask.indptr")]
        pages = np.diff(host[g + "page_indptr"].astype(np.int64))
        qo = np.diff(host["qo_indptr"].astype(np.int64))
        unclamped = (pages - 1) * page_size + host[g + "last_page_len"]
        indptr = np.concatenate([[0], np.cumsum(qo * unclamped)])
        assert host[name].tolist() == indptr.tolist(), name


def test_bucket_validation_and_sizes() -> None:
    b = GraphBucket.decode(8, 256)
    assert (b.batch_size, b.max_pages, b.tokens_per_request, b.total_q) == (8, 256, 1, 8)
    with pytest.raises(fp.BucketError):
        GraphBucket(fp.Mode.DECODE, 8, 16, tokens_per_request=4)
    for bad in (0, -1, 2.5, "8", True):
        with pytest.raises(fp.LayoutError):
            GraphBucket.decode(bad, 16)  # type: ignore[arg-type]
    with pytest.raises(fp.BucketError):
        GraphBucket.decode(2**16, 2**16)  # batch_size * max_pages > int32
    groups = (fp.AttentionGroup.full(), fp.AttentionGroup.sliding(7), fp.AttentionGroup.cross())
    spec = fp.plan(
        fp.BatchLayout.decode([3, 9], page_size=4, groups=groups, encoder_lens=[2, 5]), HEADS
    )
    layout = b.layout(spec.key, window_pool=True)
    sizes = [(r.name, r.lo, r.size) for r in layout.regions]
    assert sizes == [
        ("pages/0", 0, 8 * 256),
        ("pages/1", 8 * 256, 8 * 256),
        ("pages/2", 2 * 8 * 256, 8 * 256),
        ("write", 3 * 8 * 256, 8),
        ("write/window", 3 * 8 * 256 + 8, 8),
    ]
    assert layout.total == 3 * 8 * 256 + 16
    assert [r.name for r in b.layout(spec.key, window_pool=False).regions][-1] == "write"
    e = GraphBucket.extend(4, 10, tokens_per_request=3)
    assert e.total_q == 12 and e.mode is fp.Mode.EXTEND


def test_plans_that_do_not_fit_are_refused() -> None:
    bucket = GraphBucket.decode(4, 3)
    spec = fp.plan(fp.BatchLayout.decode([3, 9, 1], page_size=4), HEADS)
    check_fits(spec, bucket)
    too_many = fp.plan(fp.BatchLayout.decode([1] * 5, page_size=4), HEADS)
    with pytest.raises(fp.BucketError) as err:
        check_fits(too_many, bucket)
    assert err.value.field == "batch_size"
    too_long = fp.plan(fp.BatchLayout.decode([3, 13, 1], page_size=4), HEADS)
    with pytest.raises(fp.BucketError) as err:
        check_fits(too_long, bucket)
    assert (err.value.field, err.value.request) == ("max_pages", 1)
    extend = fp.plan(fp.BatchLayout.extend([3, 4], [1, 1], page_size=4), HEADS)
    with pytest.raises(fp.BucketError) as err:
        check_fits(extend, bucket)
    assert err.value.field == "mode"
    eb = GraphBucket.extend(4, 3, tokens_per_request=2)
    with pytest.raises(fp.BucketError) as err:
        check_fits(fp.plan(fp.BatchLayout.extend([3, 4], [1, 1], page_size=4), HEADS), eb)
    assert (err.value.field, err.value.request) == ("tokens_per_request", 1)
    ragged = fp.plan(
        fp.BatchLayout.extend([3, 4], [1, 2], page_size=4), HEADS, extend_path="ragged"
    )
    with pytest.raises(fp.BucketError) as err:
        check_fits(ragged, eb)
    assert err.value.field == "paths"
    check_fits(
        fp.plan(fp.BatchLayout.extend([3, 4], [1, 2], page_size=4), HEADS, extend_path="paged"), eb
    )


@settings(max_examples=60, deadline=None)
@given(
    layout=decode_layouts(
        min_batch=1,
        max_batch=6,
        max_len=70,
        long_len=90,
        groups=None,
        encoder=False,
        page_sizes=(1, 2, 16),
    ).filter(lambda lay: not any(g.cross_attention for g in lay.groups)),
    extra=st.integers(0, 5),
    window_pool=st.booleans(),
    data=st.data(),
)
def test_padded_gather_matches_unpadded_and_pads_harmlessly(
    layout: fp.BatchLayout, extra: int, window_pool: bool, data: st.DataObject
) -> None:
    spec = fp.plan(layout, HEADS)
    max_pages = max(int(gp.paged.num_pages.max()) for gp in spec.group_plans if gp.paged) + 1
    bucket = GraphBucket.decode(layout.batch_size + extra, max_pages, dummy_page=3)
    check_fits(spec, bucket)
    table, _ = data.draw(page_tables(spec))
    calls = call_skeleton(spec, ExecutorPolicy(), sm90=True, batch_size=bucket.batch_size)
    inputs = call_inputs(spec, calls)
    packed = gather_jobs(spec, table.rows, window_pool=window_pool, spans=inputs.spans)
    fixed_layout = bucket.layout(spec.key, window_pool=window_pool)
    fixed = bucket_gather_jobs(
        spec, table.rows, fixed_layout, bucket, window_pool=window_pool, spans=inputs.spans
    )
    _check_same_jobs(packed, fixed, spec.batch_size, bucket)
    want_p, want_o = _gather(packed, table, packed.total)
    got_p, got_o = _gather(fixed, table, fixed_layout.total)
    bs, pads = spec.batch_size, extra
    for r_packed, r_fixed in zip(packed.regions, fixed.regions, strict=True):
        base = fixed_layout.region(r_packed.name)
        assert (r_fixed.name, r_fixed.lo) == (base.name, base.lo)
        n = r_packed.size
        # The real entries, at the region's fixed base, are the unpadded gather's.
        assert got_p[base.lo : base.lo + n].tolist() == want_p[r_packed.lo : r_packed.hi].tolist()
        assert got_o[base.lo : base.lo + n].tolist() == want_o[r_packed.lo : r_packed.hi].tolist()
        per_pad = 1  # decode: one dummy page to read, one slot not to write
        pad = slice(base.lo + n, base.lo + n + per_pad * pads)
        assert (got_p[pad] == 3).all() and (got_o[pad] == -1).all()
        # Nothing beyond the padded entries is written (the -7 sentinel survives).
        assert (got_p[base.lo + n + pads : base.hi] == -7).all()
        if r_packed.name.startswith("pages/"):
            assert r_fixed.hi == base.lo + n + pads  # FlashInfer's kv_indices end here
        else:
            assert r_fixed.hi == base.hi  # write regions span every bucket slot
    host = padded_inputs(inputs.host, bs, bucket)
    for index, gp in enumerate(spec.group_plans):
        assert gp.paged is not None
        ind = host[f"g{index}.page_indptr"]
        last = host[f"g{index}.last_page_len"]
        assert ind.shape == (bucket.batch_size + 1,) and last.shape == (bucket.batch_size,)
        assert ind[: bs + 1].tolist() == inputs.host[f"g{index}.page_indptr"].tolist()
        assert np.diff(ind)[bs:].tolist() == [1] * pads and last[bs:].tolist() == [1] * pads
        r = fixed.region(pages_region(index))
        assert r.size == int(ind[-1])
    if "qo_indptr" in host:
        assert host["qo_indptr"].tolist() == list(range(bucket.batch_size + 1))


@settings(max_examples=30, deadline=None)
@given(
    layout=fixed_token_extend_layouts(page_size=2),
    extra=st.integers(0, 3),
    data=st.data(),
)
def test_fixed_token_extend_bucket_pads_every_token(
    layout: fp.BatchLayout, extra: int, data: st.DataObject
) -> None:
    bs = layout.batch_size
    tokens = int(layout.seq_lens[0] - layout.prefix_lens[0])
    spec = fp.plan(layout, HEADS, extend_path="paged")
    bucket = GraphBucket.extend(bs + extra, 32, tokens, dummy_page=0)
    check_fits(spec, bucket)
    table, _ = data.draw(page_tables(spec))
    calls = call_skeleton(spec, ExecutorPolicy(), sm90=True, batch_size=bucket.batch_size)
    inputs = call_inputs(spec, calls)
    packed = gather_jobs(spec, table.rows, spans=inputs.spans)
    fixed_layout = bucket.layout(spec.key, window_pool=False)
    fixed = bucket_gather_jobs(spec, table.rows, fixed_layout, bucket, spans=inputs.spans)
    _check_same_jobs(packed, fixed, bs, bucket)
    _, got_o = _gather(fixed, table, fixed_layout.total)
    w = fixed.region("write")
    assert w.size == bucket.total_q
    assert (got_o[w.lo + bs * tokens : w.hi] == -1).all()  # padding tokens write nowhere
    assert (got_o[w.lo : w.lo + bs * tokens] >= 0).all()
    host = padded_inputs(inputs.host, bs, bucket)
    assert host["qo_indptr"].tolist() == [tokens * i for i in range(bucket.batch_size + 1)]
    _check_replan_arrays(host, layout.page_size)


def _check_same_jobs(
    packed: GatherJobs, fixed: GatherJobs, batch_size: int, bucket: GraphBucket
) -> None:
    """The bucket's table holds the batch's jobs first in each region, reading what the
    packed table's read (rows, first, counts, divisor, page-map flag; where they write
    is checked through the gathers), and is read-only."""
    n = len(packed.regions)
    assert [r.name for r in fixed.regions] == [r.name for r in packed.regions]
    got = fixed.table.reshape(6, n, bucket.batch_size)[:, :, :batch_size]
    want = packed.table.reshape(6, n, batch_size)
    for column in (0, 1, 2, 4, 5):
        assert np.array_equal(got[column], want[column]), column
    assert fixed.table.dtype == np.int32 and not fixed.table.flags.writeable


def test_verify_buckets_and_their_refusals() -> None:
    """A verify plan fits a verify bucket of its N (and no other bucket); its tree mask's
    fixed buffer holds every request's mask at FlashInfer's element-per-byte offsets."""
    tree = fp.DraftTree.from_parents([[-1, 0, 0, 1]] * 2)
    verify = fp.plan(fp.BatchLayout.verify([5, 9], tree, page_size=4), HEADS)
    assert verify.group_plans[0].uses_custom_mask
    bucket = GraphBucket.verify(3, 4, num_tokens=4)
    assert (bucket.mode, bucket.total_q, bucket.mask_bytes(4)) == (fp.Mode.VERIFY, 12, 12 * 16)
    check_fits(verify, bucket)
    for other, field in (
        (GraphBucket.extend(2, 16, tokens_per_request=4), "mode"),
        (GraphBucket.verify(2, 16, num_tokens=3), "tokens_per_request"),
        (GraphBucket.verify(2, 3, num_tokens=4), "max_pages"),
    ):
        with pytest.raises(fp.BucketError) as err:
            check_fits(verify, other)
        assert err.value.field == field
    with pytest.raises(fp.BucketError):
        GraphBucket("verify", 4, 16)  # type: ignore[arg-type]


def _tree_mask_bytes(host: dict, recipe, index: int, n: int) -> np.ndarray:  # type: ignore[no-untyped-def]
    """Build group ``index``'s tree mask from staged-style host arrays (torch twin)."""

    def t(name: str) -> torch.Tensor:
        return torch.from_numpy(np.array(host[f"g{index}.mask.{name}"]))

    bs = host[f"g{index}.mask.qo_lens"].shape[0]
    words = np.array(host[f"g{index}.mask.tail_words"]).view(np.uint8)
    bits = torch.from_numpy(words[: bs * n * ((n + 7) // 8)])
    out = torch.full((recipe.total_bytes,), 0xA5, dtype=torch.uint8)
    build_custom_mask_torch(
        t("first_visible"), t("qo_lens"), t("kv_lens"), t("indptr")[:bs], out,
        tree=(t("row_offsets"), t("tail_start"), bits), num_tokens=n,
    )  # fmt: skip
    return out.numpy()


@settings(max_examples=60, deadline=None)
@given(
    layout=verify_layouts(min_batch=1, max_batch=4, encoder=False, page_sizes=(1, 3, 16)),
    extra=st.integers(0, 3),
)
def test_padded_tree_masks_keep_every_real_bit_and_pad_harmlessly(
    layout: fp.BatchLayout, extra: int
) -> None:
    spec = fp.plan(layout, HEADS)
    n = layout.draft.num_tokens if layout.draft is not None else 0
    max_pages = max(int(gp.paged.num_pages.max()) for gp in spec.group_plans if gp.paged)
    bucket = GraphBucket.verify(layout.batch_size + extra, max_pages + 1, num_tokens=n)
    check_fits(spec, bucket)
    calls = call_skeleton(spec, ExecutorPolicy(), sm90=True, batch_size=bucket.batch_size)
    inputs = call_inputs(spec, calls)
    host = padded_inputs(inputs.host, spec.batch_size, bucket)
    _check_replan_arrays(host, layout.page_size)
    masks = padded_masks(inputs.masks, spec.batch_size, bucket)
    assert set(masks) == set(inputs.masks)
    bs, pads = spec.batch_size, extra
    for index, recipe in masks.items():
        real = inputs.masks[index]
        want = _tree_mask_bytes(dict(inputs.host), real, index, n)
        got = _tree_mask_bytes(host, recipe, index, n)
        assert recipe.total_bytes <= bucket.mask_bytes(spec.page_size)
        offsets = host[f"g{index}.mask.indptr"][:-1]
        assert offsets.shape == (bs + pads,)
        # FlashInfer's offsets of the padded batch (qo x kv elements, one byte each).
        qo, kv = host[f"g{index}.mask.qo_lens"], host[f"g{index}.mask.kv_lens"]
        assert offsets.tolist() == flashinfer_mask_offsets(qo, kv)[:-1].tolist()
        # Every real request's bytes are the unpadded mask's.
        used = int(flashinfer_mask_offsets(qo[:bs], kv[:bs])[-1])
        for i in range(bs):
            lo = int(offsets[i])
            size = (int(qo[i]) * int(kv[i]) + 7) // 8
            assert got[lo : lo + size].tolist() == want[lo : lo + size].tolist()
        # A padding request: n rows, one key, which every row sees.
        for k in range(pads):
            lo = int(offsets[bs + k])
            assert lo == used + n * k
            bits = np.unpackbits(got[lo : lo + (n + 7) // 8], bitorder="little")[:n]
            assert bits.tolist() == [1] * n
        assert host[f"g{index}.page_indptr"].shape == (bs + pads + 1,)
