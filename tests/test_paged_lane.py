"""The paged lane (``executor/flashinfer/paged_lane.py``) lays out exactly what the
general translation lays out, eager and in CUDA-graph buckets, for decodes, paged
extends and (eager) tree verifies, and covers exactly the plain paged skeletons and
verify trees."""

from __future__ import annotations

import numpy as np
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
from flashplan.executor.flashinfer.calls import call_inputs, call_skeleton
from flashplan.executor.flashinfer.paged_lane import PagedLane, lane_of
from flashplan.executor.flashinfer.policy import ExecutorPolicy
from flashplan.executor.flashinfer.staging import DevicePlan, device_plan
from flashplan.executor.gathers import gather_jobs
from flashplan.planning.masks import TreeMask
from flashplan.planning.spec import KernelPath
from flashplan.testing import (
    decode_layouts,
    extend_layouts,
    fixed_token_extend_layouts,
    page_tables,
    verify_layouts,
)

HEADS = fp.HeadConfig(num_qo_heads=8, num_kv_heads=2, head_dim=64)
#: decode kernel kinds: the policy's default (by batch size), CUDA cores, tensor cores
POLICIES = st.sampled_from(
    [ExecutorPolicy(), ExecutorPolicy(decode_tensor_cores=False),
     ExecutorPolicy(decode_tensor_cores=True)]
)  # fmt: skip


def _covered(spec: fp.PlanSpec, window_pool: bool, tree_masks: bool = False) -> bool:
    """What the lane is documented to cover, from the plan itself."""
    return spec.cascade is None and all(
        gp.path in (KernelPath.DECODE, KernelPath.PAGED)
        and gp.paged is not None
        and gp.ragged is None
        and gp.virtual is None
        and (not gp.uses_custom_mask or (tree_masks and isinstance(gp.paged.mask, TreeMask)))
        and not gp.group.cross_attention
        and not (window_pool and gp.group.uses_window_pool)
        for gp in spec.group_plans
    )


def _check_same(got: DevicePlan, want: DevicePlan) -> None:
    assert got.calls is want.calls
    assert got.manifest.slices == want.manifest.slices
    assert got.manifest.total == want.manifest.total
    assert len(got.parts) == len(want.parts)
    for a, b in zip(got.parts, want.parts, strict=True):
        assert a.dtype == b.dtype == np.int32
        assert a.tolist() == b.tolist()
    assert got.jobs.table.flags.c_contiguous and not got.jobs.table.flags.writeable
    assert got.jobs.table.tolist() == want.jobs.table.tolist()
    assert got.jobs.regions == want.jobs.regions
    assert got.jobs.total == want.jobs.total
    assert dict(got.masks) == dict(want.masks)
    assert dict(got.ints) == dict(want.ints)
    assert dict(got.elements) == dict(want.elements)
    assert got.data.tolist() == want.data.tolist()


@settings(max_examples=120, deadline=None)
@given(
    layout=st.one_of(
        decode_layouts(max_batch=6, max_len=70, long_len=200, page_sizes=(1, 2, 16)),
        extend_layouts(max_batch=6, max_len=70, long_len=200, page_sizes=(1, 2, 16)),
        verify_layouts(max_batch=6, max_len=70, long_len=200, page_sizes=(1, 2, 16)),
    ),
    extend_path=st.sampled_from(["paged", "auto"]),
    policy=POLICIES,
    window_pool=st.booleans(),
    tree_masks=st.booleans(),
    data=st.data(),
)
def test_lane_lays_out_what_the_general_path_does(
    layout: fp.BatchLayout,
    extend_path: str,
    policy: ExecutorPolicy,
    window_pool: bool,
    tree_masks: bool,
    data: st.DataObject,
) -> None:
    spec = fp.plan(layout, HEADS, extend_path=extend_path)
    calls = call_skeleton(spec, policy, sm90=True)
    lane = PagedLane.of(spec, calls, window_pool=window_pool, tree_masks=tree_masks)
    assert (lane is not None) == _covered(spec, window_pool, tree_masks)
    if lane is None:
        return
    table, _ = data.draw(page_tables(spec))
    inputs = call_inputs(spec, calls)
    jobs = gather_jobs(spec, table.rows, window_pool=window_pool, spans=inputs.spans)
    want = device_plan(
        calls, jobs, inputs.host, inputs.masks, ints=inputs.ints, elements=inputs.elements
    )
    _check_same(lane.device_plan(spec, table.rows), want)


def _general_bucket_plan(
    spec: fp.PlanSpec,
    calls: tuple,  # type: ignore[type-arg]
    rows: np.ndarray,
    bucket: GraphBucket,
    window_pool: bool,
) -> DevicePlan:
    """What a graph executor's general path lays out for ``spec`` in ``bucket``."""
    fixed = bucket.layout(spec.key, window_pool=window_pool)
    inputs = call_inputs(spec, calls)
    jobs = bucket_gather_jobs(
        spec, rows, fixed, bucket, window_pool=window_pool, spans=inputs.spans
    )
    host = padded_inputs(inputs.host, spec.batch_size, bucket)
    return device_plan(calls, jobs, host, padded_masks(inputs.masks, spec.batch_size, bucket))


def _check_bucket_lane(
    spec: fp.PlanSpec,
    bucket: GraphBucket,
    policy: ExecutorPolicy,
    window_pool: bool,
    data: st.DataObject,
) -> None:
    """The lane of ``spec`` in ``bucket`` exists exactly where documented and lays out
    what the general path does."""
    calls = call_skeleton(spec, policy, sm90=True, batch_size=bucket.batch_size)
    lane = PagedLane.of(spec, calls, window_pool=window_pool)
    assert (lane is not None) == _covered(spec, window_pool)
    if lane is None:
        return
    table, _ = data.draw(page_tables(spec))
    fixed = bucket.layout(spec.key, window_pool=window_pool)
    want = _general_bucket_plan(spec, calls, table.rows, bucket, window_pool)
    _check_same(lane.bucket_plan(spec, table.rows, fixed, bucket), want)


@settings(max_examples=60, deadline=None)
@given(
    layout=decode_layouts(
        min_batch=1, max_batch=6, max_len=70, long_len=90, encoder=False, page_sizes=(1, 2, 16)
    ).filter(lambda lay: not any(g.cross_attention for g in lay.groups)),
    extra=st.integers(0, 5),
    policy=POLICIES,
    window_pool=st.booleans(),
    data=st.data(),
)
def test_lane_pads_to_a_decode_bucket_as_the_general_path_does(
    layout: fp.BatchLayout,
    extra: int,
    policy: ExecutorPolicy,
    window_pool: bool,
    data: st.DataObject,
) -> None:
    spec = fp.plan(layout, HEADS)
    max_pages = max(int(gp.paged.num_pages.max()) for gp in spec.group_plans if gp.paged) + 1
    bucket = GraphBucket.decode(layout.batch_size + extra, max_pages, dummy_page=3)
    _check_bucket_lane(spec, bucket, policy, window_pool, data)


@settings(max_examples=40, deadline=None)
@given(
    layout=fixed_token_extend_layouts(page_sizes=(1, 2, 16)),
    extra=st.integers(0, 3),
    data=st.data(),
)
def test_lane_pads_a_fixed_token_extend_as_the_general_path_does(
    layout: fp.BatchLayout, extra: int, data: st.DataObject
) -> None:
    spec = fp.plan(layout, HEADS, extend_path="paged")
    tokens = int(layout.seq_lens[0] - layout.prefix_lens[0])
    bucket = GraphBucket.extend(layout.batch_size + extra, 64, tokens, dummy_page=0)
    check_fits(spec, bucket)
    _check_bucket_lane(spec, bucket, ExecutorPolicy(), False, data)


def test_lanes_are_kept_per_skeleton_and_refused_where_they_do_not_apply() -> None:
    spec = fp.plan(fp.BatchLayout.decode([5, 9], page_size=4), HEADS)
    calls = call_skeleton(spec, ExecutorPolicy(), sm90=True)
    lanes: dict = {}
    lane = lane_of(lanes, spec, calls, False)
    assert lane is not None and lane_of(lanes, spec, calls, False) is lane
    # a paged extend takes the lane; a ragged one, a cross group, a verify tree (custom
    # mask) the general path
    extend = fp.BatchLayout.extend([5, 9], [3, 4], page_size=4)
    paged = fp.plan(extend, HEADS, extend_path="paged")
    assert PagedLane.of(paged, call_skeleton(paged, ExecutorPolicy(), sm90=True)) is not None
    ragged = fp.plan(extend, HEADS, extend_path="ragged")
    assert PagedLane.of(ragged, call_skeleton(ragged, ExecutorPolicy(), sm90=True)) is None
    cross = fp.plan(
        fp.BatchLayout.decode(
            [5, 9], page_size=4, encoder_lens=[3, 2],
            groups=[fp.AttentionGroup(), fp.AttentionGroup(cross_attention=True, causal=False)],
        ),
        HEADS,
    )  # fmt: skip
    assert PagedLane.of(cross, call_skeleton(cross, ExecutorPolicy(), sm90=True)) is None
    tree = fp.DraftTree.from_parents([[-1, 0, 0], [-1, 0, 1]])
    verify = fp.plan(fp.BatchLayout.verify([5, 9], tree, page_size=4), HEADS)
    v_calls = call_skeleton(verify, ExecutorPolicy(), sm90=True)
    assert PagedLane.of(verify, v_calls) is None
    # ... unless the lane may stage tree masks (an eager executor's)
    assert PagedLane.of(verify, v_calls, tree_masks=True) is not None
    # a masked extend (a bidirectional window's position mask) never takes it
    bidir = fp.plan(
        fp.BatchLayout.extend(
            [5, 9],
            [3, 4],
            page_size=4,
            groups=[fp.AttentionGroup(window_left=2, window_right=1, causal=False)],
        ),
        HEADS,
        extend_path="paged",
    )
    b_calls = call_skeleton(bidir, ExecutorPolicy(), sm90=True)
    assert any(gc.masked for gc in b_calls)
    assert PagedLane.of(bidir, b_calls, tree_masks=True) is None
    # a windowed group kept in a sliding-window pool (the executor has a page map)
    windowed = fp.plan(
        fp.BatchLayout.decode([5, 9], page_size=4, groups=[fp.AttentionGroup(window_left=3)]),
        HEADS,
    )
    w_calls = call_skeleton(windowed, ExecutorPolicy(), sm90=True)
    assert PagedLane.of(windowed, w_calls, window_pool=False) is not None
    assert PagedLane.of(windowed, w_calls, window_pool=True) is None
