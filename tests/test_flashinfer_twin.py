"""The CPU twin of FlashInfer's wrapper API (``flashplan.twin``).

Property tests: random layouts of every mode (decode, extend with and without prefix on
every extend path, verify trees, multi-item scoring; windows, soft caps, sinks, chunked
and bidirectional-window groups, cross groups, page sizes 1/2/3/16, GQA) are planned
with ``fp.plan`` and translated (``translate``); each call's placeholders are resolved
on the host as the executor resolves them on the device (page ids gathered by the
gather job table, masks built by the mask builder's torch twin, multi-item positions
filled by ``fill_runs``' torch twin); the twin's wrappers are planned and run with them,
their states merged and sinks folded as the executor's ``run_group`` does, and the
result must equal the float64 oracle (``dense_attention`` over ``visibility``) to
float32 rounding.

Hand-made cases pin single rules: decode with GQA and a soft cap, causal alignment with
``qo_len < kv_len``, windows, the packed mask's bit order and 0.7.4's offsets, CUDA-graph
wrappers re-planned with a smaller (padded) batch and their fixed buffers, plan-time
copies against run-time reads, empty requests, sinks, fp8 scales, ``merge_state``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flashplan as fp
from flashplan.errors import (
    BucketError,
    FlashplanError,
    PageTableError,
    PlanMismatchError,
    UnsupportedError,
)
from flashplan.executor.flashinfer import ExecutorPolicy, translate
from flashplan.executor.flashinfer.calls import (
    BatchInt,
    BuiltMask,
    CallInputs,
    DeviceIndices,
    HostArray,
    ItemPositions,
    PlanCall,
    StagedArray,
    WrapperKind,
)
from flashplan.executor.gathers import gather_jobs
from flashplan.kernels.custom_mask import build_custom_mask_torch
from flashplan.kernels.runs import fill_runs_torch
from flashplan.oracle import dense_attention, key_row_tokens, visibility
from flashplan.testing import (
    GROUP_KINDS,
    LOCAL_GROUP_KINDS,
    attention_groups,
    decode_layouts,
    extend_layouts,
    multi_item_layouts,
    verify_layouts,
)
from flashplan.torch_kernels import fold_sinks_torch, gather_slots_torch
from flashplan.twin.wrappers import fast_decode_plan, flashinfer_twin, merge_state

TWIN = flashinfer_twin
WS = torch.zeros(1 << 10, dtype=torch.uint8)  # the twin reads only the workspace's device
LN2 = math.log(2.0)
TOL = {"rtol": 2e-5, "atol": 2e-5}  # float32 twin vs float64 oracle
PROPERTY = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------- helpers
def _i32(values: Any) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _pages_tensor(values: np.ndarray) -> torch.Tensor:
    """An int32 host array as a (fresh, contiguous) CPU tensor, as the executor stages it."""
    return torch.tensor(np.asarray(values, dtype=np.int32), dtype=torch.int32)


def _dense(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seen: np.ndarray, *, scale: float,
    cap: float = 0.0, sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The oracle's float64 attention of one request with an explicit scale and cap."""
    group = fp.AttentionGroup.full(sm_scale=scale, logits_soft_cap=cap)
    return dense_attention(q, k, v, seen, group, sinks)


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got.double(), want.double(), **TOL, msg=what)


class Resolved:
    """A plan's FlashInfer calls resolved on the host: every placeholder as the tensor
    the executor would hand to ``plan()`` (page ids gathered by the job table, masks
    built, multi-item positions filled)."""

    def __init__(self, spec: fp.PlanSpec, table: fp.PageTable, policy: ExecutorPolicy) -> None:
        self.translation = translate(spec, policy, sm90=False)
        inputs = self.translation.inputs
        self.inputs = inputs
        self.jobs = gather_jobs(
            spec, table.rows, spans=inputs.spans, level_spans=inputs.level_spans
        )
        total = self.jobs.total
        self.page = torch.full((max(total, 1),), -1, dtype=torch.int32)
        offset = torch.full_like(self.page, -1)
        cols = [torch.from_numpy(np.array(c)) for c in self.jobs.columns()]
        gather_slots_torch(table.pages, *cols, self.page, offset, total=total)

    def kwargs(self, call: PlanCall) -> dict[str, Any]:
        out = {}
        for name, value in call.kwargs:
            out[name] = self._value(value)
        return out

    def _value(self, value: Any) -> Any:
        inputs = self.inputs
        if isinstance(value, HostArray):
            return _pages_tensor(inputs.host[value.name])
        if isinstance(value, StagedArray):
            words = _pages_tensor(inputs.host[value.name])
            view = words.view(getattr(torch, value.dtype))
            return view[: inputs.elements[value.name]]
        if isinstance(value, BatchInt):
            return inputs.ints[value.name]
        if isinstance(value, ItemPositions):
            return _filled_items(value, inputs)
        if isinstance(value, DeviceIndices):
            r = self.jobs.region(value.region)
            return self.page[r.lo : r.hi]
        if isinstance(value, BuiltMask):
            return _built_mask(value.group_index, inputs)
        return value


def _filled_items(placeholder: ItemPositions, inputs: CallInputs) -> torch.Tensor:
    """FlashInfer's uint16 ``token_pos_in_items``, filled as the executor fills it."""
    name = placeholder.name
    out = torch.zeros(inputs.ints[f"{name}.size"], dtype=torch.uint16)
    start, length = (_pages_tensor(inputs.host[f"{name}.{k}"]) for k in ("start", "length"))
    fill_runs_torch(start, 1, length, out, inputs.ints[f"{name}.longest"])
    return out


def _built_mask(index: int, inputs: CallInputs) -> torch.Tensor:
    """A group's packed mask, built as the executor builds it on the device, in a buffer
    of garbage (``0xA5``) where no request's bits go."""
    recipe, g, host = inputs.masks[index], f"g{index}.mask.", inputs.host

    def t(name: str) -> torch.Tensor:
        return _pages_tensor(host[g + name])

    buf = torch.full((recipe.total_bytes,), 0xA5, dtype=torch.uint8)
    offsets = t("indptr")[:-1]
    if recipe.position:
        position = (t("col_position"), t("rule"))
        build_custom_mask_torch(
            t("row_position"), t("qo_lens"), t("kv_lens"), offsets, buf, position=position
        )
        return buf
    tree = None
    n = recipe.num_tokens
    if n:
        bs = host[g + "qo_lens"].shape[0]
        packed = host[g + "tail_words"].copy().view(np.uint8)[: bs * n * ((n + 7) // 8)]
        tree = (t("row_offsets"), t("tail_start"), torch.from_numpy(packed.copy()))
    build_custom_mask_torch(
        t("first_visible"), t("qo_lens"), t("kv_lens"), offsets, buf, tree=tree, num_tokens=n
    )
    return buf


def _slots(
    layout: fp.BatchLayout, table: fp.PageTable, i: int, tokens: np.ndarray
) -> tuple[torch.Tensor, torch.Tensor]:
    """(page ids, slots) of request ``i``'s row tokens ``tokens``."""
    ps = layout.page_size
    row = table.pages[int(table.rows[i])].long()
    t = torch.from_numpy(np.asarray(tokens, dtype=np.int64))
    return row[t // ps], t % ps


def _new_kv(
    layout: fp.BatchLayout, table: fp.PageTable, cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The new tokens' K/V ``[total_q, kv_heads, dim]`` in query order (as written into
    the cache: what a ragged call gets as ``k`` / ``v``)."""
    ks, vs = [], []
    starts, prefix, ext = layout.decoder_start, layout.prefix_lens, layout.extend_lens
    for i in range(layout.batch_size):
        tokens = int(starts[i]) + int(prefix[i]) + np.arange(int(ext[i]))
        page, slot = _slots(layout, table, i, tokens)
        ks.append(cache[page, 0, slot])
        vs.append(cache[page, 1, slot])
    shape = (0, *cache.shape[3:])
    return (torch.cat(ks) if ks else cache.new_zeros(shape)), (
        torch.cat(vs) if vs else cache.new_zeros(shape)
    )


def _run_group(
    resolved: Resolved, index: int, q: torch.Tensor, cache: torch.Tensor,
    new_kv: tuple[torch.Tensor, torch.Tensor], sinks: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One group's attention on the twin, as the executor's ``run_group`` orchestrates
    it: the ragged and paged calls (the paged one on the sink kernel when it is a sink
    wrapper), merged by ``merge_state``, sinks folded once when not in the kernel."""
    gc = resolved.translation.calls[index]
    assert not gc.levels  # planned without cascade
    states = []
    if gc.ragged is not None:
        w = _wrapper(gc.ragged)
        w.plan(**resolved.kwargs(gc.ragged))
        states.append(w.run(q, *new_kv, return_lse=True))
    in_kernel = False
    if gc.paged is not None:
        w = _wrapper(gc.paged)
        w.plan(**resolved.kwargs(gc.paged))
        in_kernel = gc.paged.wrapper.sink is not None
        if in_kernel:
            assert sinks is not None
            scale = gc.paged.as_dict()["sm_scale"]
            states.append(w.run(q, cache, sinks, scale, return_lse=True))
        else:
            states.append(w.run(q, cache, return_lse=True))
    out, lse = states[0]
    if len(states) == 2:
        out, lse = merge_state(out, lse, *states[1])
    if sinks is not None and not in_kernel:
        out, lse = fold_sinks_torch(out, lse, sinks)
    return out, lse


def _wrapper(call: PlanCall) -> Any:
    key = call.wrapper
    return getattr(TWIN, key.class_name)(WS, **key.constructor_kwargs())


def _check_against_oracle(
    layout: fp.BatchLayout, heads: fp.HeadConfig, policy: ExecutorPolicy, seed: int,
    **plan_kw: Any,
) -> None:  # fmt: skip
    """Plan ``layout``, run every group on the twin, compare with the oracle."""
    try:
        spec = fp.plan(layout, heads, **plan_kw)
        table = fp.PageTable.shuffled(layout.pages_needed, seed=seed)
        resolved = Resolved(spec, table, policy)
    except FlashplanError:
        return  # a combination flashplan refuses (its own tests pin which)
    gen = torch.Generator().manual_seed(seed)
    assert table.num_pages is not None
    shape = (table.num_pages, 2, layout.page_size, heads.num_kv_heads, heads.head_dim)
    cache = torch.randn(shape, generator=gen)
    q = torch.randn(spec.total_q, heads.num_qo_heads, heads.head_dim, generator=gen)
    new_kv = _new_kv(layout, table, cache)
    qo = spec.qo_indptr
    for index, gp in enumerate(spec.group_plans):
        group = gp.group
        sinks = torch.randn(heads.num_qo_heads, generator=gen) if group.sinks else None
        out, lse = _run_group(resolved, index, q, cache, new_kv, sinks)
        assert out.dtype == heads.out_dtype and lse.dtype == torch.float32
        seen_all = visibility(layout, group)
        for i, tokens in enumerate(key_row_tokens(layout, group)):
            page, slot = _slots(layout, table, i, tokens)
            k, v = cache[page, 0, slot].double(), cache[page, 1, slot].double()
            rows = slice(int(qo[i]), int(qo[i + 1]))
            want_o, want_s = dense_attention(q[rows].double(), k, v, seen_all[i], group, sinks)
            what = f"group {group.describe()!r}, request {i}"
            _close(out[rows], want_o, what)
            _close(lse[rows], want_s, what)


# --------------------------------------------------------------------------- strategies
_HEADS = st.sampled_from(
    [fp.HeadConfig(4, 2, 64, torch.float32), fp.HeadConfig(2, 2, 32, torch.float32),
     fp.HeadConfig(3, 1, 16, torch.float32)]
)  # fmt: skip
_POLICY = st.builds(ExecutorPolicy, decode_tensor_cores=st.sampled_from((None, True, False)))
_ALL_KINDS = GROUP_KINDS + LOCAL_GROUP_KINDS


def _groups(kinds: tuple[str, ...], max_size: int = 2) -> st.SearchStrategy[list[Any]]:
    return st.lists(
        attention_groups(kinds=kinds, sinks=True), min_size=1, max_size=max_size, unique=True
    )


@st.composite
def _layouts(draw: st.DrawFn, mode: str) -> tuple[fp.BatchLayout, dict[str, Any]]:
    """A layout of ``mode`` and the ``fp.plan`` keywords to plan it with."""
    kw: dict[str, Any] = {"max_batch": 5, "max_len": 40, "long_len": 100}
    plan_kw: dict[str, Any] = {}
    if mode == "decode":
        layout = draw(decode_layouts(groups=draw(_groups(_ALL_KINDS)), **kw))
    elif mode.startswith("extend/"):  # a path, on prefixes (drawn but for ragged: some)
        groups = draw(_groups(_ALL_KINDS))
        prefix = True if mode == "extend/ragged" else draw(st.booleans())
        layout = draw(extend_layouts(groups=groups, prefix=prefix, **kw))
        plan_kw["extend_path"] = mode.removeprefix("extend/")
        plan_kw["chunked_extend"] = draw(st.sampled_from(("split", "mask")))
    elif mode == "verify":
        groups = draw(_groups(("full", "sliding", "cross")))
        layout = draw(verify_layouts(groups=groups, **kw))
    else:
        groups = draw(_groups(("full",)))
        layout = draw(multi_item_layouts(groups=groups, max_batch=4))
        plan_kw["extend_path"] = draw(st.sampled_from(("auto", "paged")))
    return layout, plan_kw


# --------------------------------------------------------------------------- properties
@pytest.mark.parametrize(
    "mode", ["decode", "extend/auto", "extend/paged", "extend/ragged", "verify", "items"]
)
def test_twin_runs_the_plans_calls_as_the_oracle_attends(mode: str) -> None:
    """Every mode and group kind: the twin's result of flashplan's calls (merged and
    folded as the executor does) is the oracle's attention (float32 against float64)."""

    @PROPERTY
    @given(_layouts(mode), _HEADS, _POLICY, st.integers(0, 2**16))
    def check(case, heads, policy, seed) -> None:  # type: ignore[no-untyped-def]
        layout, plan_kw = case
        _check_against_oracle(layout, heads, policy, seed, **plan_kw)

    check()


@PROPERTY
@given(
    st.lists(st.integers(0, 40), min_size=1, max_size=6), st.sampled_from((1, 2, 16)),
    st.integers(-1, 12), st.sampled_from((0.0, 5.0)), st.booleans(), st.integers(0, 2**16),
)  # fmt: skip
def test_paged_prefill_is_dense_attention_by_its_own_rules(
    kv_lens: list[int], page_size: int, window: int, cap: float, causal: bool, seed: int
) -> None:
    """The paged prefill wrapper alone, over random requests (some with more queries
    than keys): query ``j`` of ``qo_len`` sees ``k <= kv_len - qo_len + j`` when causal
    and ``k >= that - window``; pages in random order, last pages partly filled."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    qo_lens = [int(rng.integers(0, 5)) for _ in kv_lens]
    pages = [(n + page_size - 1) // page_size for n in kv_lens]
    ids = rng.permutation(sum(pages) + 2).astype(np.int32)
    last = [n - (p - 1) * page_size if p else 0 for n, p in zip(kv_lens, pages, strict=True)]
    cache = torch.randn(len(ids), 2, page_size, 2, 16, generator=gen)
    q = torch.randn(sum(qo_lens), 4, 16, generator=gen)
    w = TWIN.BatchPrefillWithPagedKVCacheWrapper(WS, "NHD", backend="fa2")
    w.plan(
        _i32(np.cumsum([0, *qo_lens])), _i32(np.cumsum([0, *pages])), torch.from_numpy(ids),
        _i32(last), 4, 2, 16, page_size, causal=causal, window_left=window,
        logits_soft_cap=cap, q_data_type=torch.float32, sm_scale=0.3,
    )  # fmt: skip
    out, lse = w.run(q, cache, return_lse=True)
    start, first = 0, 0
    for qo, kv, p in zip(qo_lens, kv_lens, pages, strict=True):
        own = torch.from_numpy(ids[first : first + p]).long()
        k = cache[own, 0].reshape(-1, 2, 16)[:kv].double()
        v = cache[own, 1].reshape(-1, 2, 16)[:kv].double()
        pos = np.arange(qo)[:, None] + kv - qo
        key = np.arange(kv)[None, :]
        seen = (key <= pos) if causal else np.ones((qo, kv), dtype=bool)
        if window >= 0:
            seen = seen & (key >= pos - window)
        want_o, want_s = _dense(q[start : start + qo].double(), k, v, seen, scale=0.3, cap=cap)
        _close(out[start : start + qo], want_o, "out")
        _close(lse[start : start + qo], want_s, "lse")
        start, first = start + qo, first + p


# --------------------------------------------------------------------------- by hand
def _decode_case(seed: int = 0) -> dict[str, Any]:
    """Three decode requests over a shuffled pool: 7 keys, none, 4 keys (page size 4)."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "cache": torch.randn(6, 2, 4, 2, 8, generator=gen),
        "q": torch.randn(3, 4, 8, generator=gen),
        "indptr": _i32([0, 2, 2, 3]),
        "indices": _i32([5, 1, 3]),
        "last": _i32([3, 1, 4]),
    }


def test_decode_by_hand_with_gqa_and_soft_cap() -> None:
    c = _decode_case()
    w = TWIN.BatchDecodeWithPagedKVCacheWrapper(WS, "NHD", use_tensor_cores=False)
    w.plan(
        c["indptr"], c["indices"], c["last"], 4, 2, 8, 4, logits_soft_cap=2.0,
        q_data_type=torch.float32, o_data_type=torch.float64, sm_scale=0.5,
    )  # fmt: skip
    out, lse = w.run(c["q"], c["cache"], return_lse=True)
    assert out.dtype == torch.float64 and lse.dtype == torch.float32
    cache, q = c["cache"].double(), c["q"].double()
    for i, (pages, n) in enumerate((([5, 1], 7), ([], 0), ([3], 4))):
        k = cache[pages, 0].reshape(-1, 2, 8)[:n]
        v = cache[pages, 1].reshape(-1, 2, 8)[:n]
        # by hand: head h reads KV head h // 2; logits 2 * tanh(0.5 * q.k / 2)
        for h in range(4):
            s = 2.0 * torch.tanh(0.5 * (k[:, h // 2] @ q[i, h]) / 2.0)
            if n == 0:
                assert out[i, h].abs().max() == 0 and lse[i, h] == -math.inf
                continue
            p = torch.softmax(s, 0)
            torch.testing.assert_close(out[i, h], p @ v[:, h // 2], **TOL)
            assert lse[i, h].item() == pytest.approx(torch.logsumexp(s, 0).item() / LN2, abs=1e-5)


def test_float64_query_computes_in_float64() -> None:
    """A float64 query is attended in float64 (the twin as a float64 reference)."""
    c = _decode_case(12)
    w = TWIN.BatchDecodeWithPagedKVCacheWrapper(WS, "NHD")
    w.plan(c["indptr"], c["indices"], c["last"], 4, 2, 8, 4, q_data_type=torch.float64,
           kv_data_type=torch.float32)  # fmt: skip
    out, lse = w.run(c["q"].double(), c["cache"], return_lse=True)
    assert out.dtype == torch.float64
    k, v = (c["cache"][[5, 1], j].reshape(-1, 2, 8)[:7].double() for j in (0, 1))
    want_o, want_s = _dense(c["q"][:1].double(), k, v, np.ones((1, 7), dtype=bool), scale=8**-0.5)
    torch.testing.assert_close(out[:1], want_o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse[:1].double(), want_s, rtol=1e-6, atol=1e-6)  # LSE: float32


def test_causal_prefill_aligns_queries_bottom_right() -> None:
    """qo_len 2 < kv_len 5: query 0 sees keys 0..3, query 1 all five (not keys 0, 0..1)."""
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(2, 2, 4, 1, 8, generator=gen)
    q = torch.randn(2, 1, 8, generator=gen)
    w = TWIN.BatchPrefillWithPagedKVCacheWrapper(WS, "NHD")
    args = (_i32([0, 2]), _i32([0, 2]), _i32([1, 0]), _i32([1]), 1, 1, 8, 4)
    w.plan(*args, causal=True, q_data_type=torch.float32)
    out = w.run(q, cache)
    keys = torch.cat([cache[1], cache[0]], dim=1)[:, :5].double()  # [2, 5, 1, 8]
    for j, seen in enumerate((4, 5)):
        mask = np.zeros((1, 5), dtype=bool)
        mask[0, :seen] = True
        want, _ = _dense(q[j : j + 1].double(), keys[0], keys[1], mask, scale=8**-0.5)
        _close(out[j : j + 1], want, f"query {j}")
    w.plan(*args, causal=False, q_data_type=torch.float32)
    assert not torch.allclose(w.run(q, cache)[0], out[0])  # the flag changed the answer


def test_window_keeps_w_plus_one_keys() -> None:
    """window_left 1 on a decode of 7 keys: keys 5 and 6 only."""
    c = _decode_case(2)
    w = TWIN.BatchDecodeWithPagedKVCacheWrapper(WS, "NHD", use_tensor_cores=True)
    w.plan(c["indptr"], c["indices"], c["last"], 4, 2, 8, 4, window_left=1, q_data_type="float32")
    out = w.run(c["q"], c["cache"])
    k = c["cache"][[5, 1], 0].reshape(-1, 2, 8)[5:7].double()
    v = c["cache"][[5, 1], 1].reshape(-1, 2, 8)[5:7].double()
    want, _ = _dense(c["q"][:1].double(), k, v, np.ones((1, 2), dtype=bool), scale=8**-0.5)
    _close(out[:1], want, "windowed request 0")
    with pytest.raises(PlanMismatchError):
        w.run(c["q"], c["cache"], window_left=3)  # FlashInfer asserts the plan's window


def _mask_case() -> tuple[list[np.ndarray], torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two ragged requests (3 x 5 and 2 x 4) with random masks, packed where FlashInfer
    0.7.4 reads them: request 1 at byte 3 * 5 = 15 (a bit count as a byte offset)."""
    rng = np.random.default_rng(3)
    masks = [rng.random((3, 5)) < 0.5, rng.random((2, 4)) < 0.5]
    masks[0][:, 0] = True  # every query sees something
    buf = np.full(15 + 1, 0xA5, dtype=np.uint8)
    buf[:2] = np.packbits(masks[0].reshape(-1), bitorder="little")
    buf[15:16] = np.packbits(masks[1].reshape(-1), bitorder="little")
    gen = torch.Generator().manual_seed(3)
    return (
        masks,
        torch.from_numpy(buf),
        torch.randn(5, 2, 8, generator=gen),
        torch.randn(9, 2, 2, 8, generator=gen),
    )


def test_packed_mask_bits_and_offsets() -> None:
    masks, buf, q, kv = _mask_case()
    w = TWIN.BatchPrefillWithRaggedKVCacheWrapper(WS, "NHD")
    w.plan(
        _i32([0, 3, 5]), _i32([0, 5, 9]), 2, 2, 8, packed_custom_mask=buf, causal=True,
        q_data_type=torch.float32,
    )  # fmt: skip
    out, lse = w.run(q, kv[:, 0], kv[:, 1], return_lse=True)
    for i, (rows, keys) in enumerate(((slice(0, 3), slice(0, 5)), (slice(3, 5), slice(5, 9)))):
        k, v = kv[keys, 0].double(), kv[keys, 1].double()
        want_o, want_s = _dense(q[rows].double(), k, v, masks[i], scale=8**-0.5)
        _close(out[rows], want_o, f"request {i} (the mask replaces the causal flag)")
        _close(lse[rows], want_s, f"request {i}")
    # the byte-packed layout (request 1 at byte 2) is not where 0.7.4 reads
    moved = buf.clone()
    moved[2:3] = buf[15:16]
    moved[15:16] = 0
    w.plan(
        _i32([0, 3, 5]), _i32([0, 5, 9]), 2, 2, 8, packed_custom_mask=moved, q_data_type="float32"
    )
    assert not torch.allclose(w.run(q, kv[:, 0], kv[:, 1])[3:], out[3:])
    with pytest.raises(FlashplanError, match="outside the mask buffer"):
        w.plan(_i32([0, 3, 5]), _i32([0, 5, 9]), 2, 2, 8, packed_custom_mask=buf[:15],
               q_data_type="float32")  # fmt: skip
        w.run(q, kv[:, 0], kv[:, 1])


def test_eager_plan_copies_indptrs_and_keeps_page_ids() -> None:
    """An eager plan copies its index pointers (FlashInfer's host scheduler reads them
    at plan time) and keeps the page ids it is given (its kernels read them at run)."""
    c = _decode_case(4)
    w = TWIN.BatchDecodeWithPagedKVCacheWrapper(WS, "NHD")
    w.plan(c["indptr"], c["indices"], c["last"], 4, 2, 8, 4, q_data_type=torch.float32)
    before = w.run(c["q"], c["cache"])
    c["indptr"].zero_()
    c["last"].fill_(1)
    torch.testing.assert_close(w.run(c["q"], c["cache"]), before)
    c["indices"][2] = 0  # the third request's page, rewritten before the run
    after = w.run(c["q"], c["cache"])
    torch.testing.assert_close(after[:2], before[:2])
    assert not torch.allclose(after[2], before[2])


def test_replan_runs_the_new_plan() -> None:
    c = _decode_case(5)
    w = TWIN.BatchDecodeWithPagedKVCacheWrapper(WS, "NHD")
    w.plan(c["indptr"], c["indices"], c["last"], 4, 2, 8, 4, q_data_type=torch.float32)
    first = w.run(c["q"], c["cache"])
    w.plan(_i32([0, 1]), _i32([3]), _i32([2]), 4, 2, 8, 4, q_data_type=torch.float32)
    second = w.run(c["q"][:1], c["cache"])
    k = c["cache"][3, 0, :2].double()
    v = c["cache"][3, 1, :2].double()
    want, _ = _dense(c["q"][:1].double(), k, v, np.ones((1, 2), dtype=bool), scale=8**-0.5)
    _close(second, want, "the second plan's request")
    assert not torch.allclose(second, first[:1])
    with pytest.raises(PlanMismatchError, match="rows"):
        w.run(c["q"], c["cache"])  # three rows for a plan of one request


def _graph_decode(bs: int, max_pages: int) -> tuple[Any, dict[str, torch.Tensor]]:
    bufs = {
        "paged_kv_indptr_buffer": torch.zeros(bs + 1, dtype=torch.int32),
        "paged_kv_indices_buffer": torch.zeros(max_pages, dtype=torch.int32),
        "paged_kv_last_page_len_buffer": torch.zeros(bs, dtype=torch.int32),
    }
    return TWIN.BatchDecodeWithPagedKVCacheWrapper(WS, "NHD", use_cuda_graph=True, **bufs), bufs


def test_graph_wrapper_replanned_with_a_smaller_padded_batch() -> None:
    """A CUDA-graph decode wrapper of 3 rows, planned with 3 requests, then with 1 real
    request padded to 3 (empty requests) and fewer page ids: the run reads the fixed
    buffers (plan() refreshed them), equals an eager wrapper on the real request, and
    the padding rows are empty; an unpadded smaller batch is refused."""
    c = _decode_case(6)
    w, bufs = _graph_decode(3, 8)
    assert w.is_cuda_graph_enabled
    w.plan(c["indptr"], c["indices"], c["last"], 4, 2, 8, 4, q_data_type=torch.float32)
    full = w.run(c["q"], c["cache"])
    eager = TWIN.BatchDecodeWithPagedKVCacheWrapper(WS, "NHD")
    eager.plan(c["indptr"], c["indices"], c["last"], 4, 2, 8, 4, q_data_type=torch.float32)
    torch.testing.assert_close(full, eager.run(c["q"], c["cache"]))
    w.plan(_i32([0, 1, 1, 1]), _i32([2]), _i32([3, 0, 0]), 4, 2, 8, 4, q_data_type="float32")
    assert bufs["paged_kv_indices_buffer"][:3].tolist() == [2, 1, 3]  # tail left as it was
    out, lse = w.run(c["q"], c["cache"], return_lse=True)
    eager.plan(_i32([0, 1]), _i32([2]), _i32([3]), 4, 2, 8, 4, q_data_type=torch.float32)
    torch.testing.assert_close(out[:1], eager.run(c["q"][:1], c["cache"]))
    assert out[1:].abs().max() == 0 and bool((lse[1:] == -math.inf).all())
    bufs["paged_kv_indices_buffer"][0] = 5  # a run reads the buffers, not the plan's tensors
    assert not torch.allclose(w.run(c["q"], c["cache"])[:1], out[:1])
    with pytest.raises(PlanMismatchError, match="fixed"):
        w.plan(_i32([0, 1]), _i32([2]), _i32([3]), 4, 2, 8, 4, q_data_type="float32")
    with pytest.raises(BucketError):
        w.plan(_i32([0, 9, 9, 9]), _i32(range(9)), _i32([1, 0, 0]), 4, 2, 8, 4)


def test_fast_decode_plan_copies_nothing() -> None:
    """``fast_decode_plan`` on a CUDA-graph wrapper leaves the fixed buffers to the
    caller (a stale buffer shows); on an eager one the run reads the very tensors."""
    c = _decode_case(7)
    w, bufs = _graph_decode(3, 8)
    w.plan(c["indptr"], c["indices"], c["last"], 4, 2, 8, 4, q_data_type=torch.float32)
    planned = w.run(c["q"], c["cache"])
    other = {"indptr": _i32([0, 1, 2, 3]), "indices": _i32([0, 2, 4]), "last": _i32([4, 4, 4])}
    fast_decode_plan(w, other["indptr"], other["indices"], other["last"], 4, 2, 8, 4,
                     q_data_type=torch.float32)  # fmt: skip
    torch.testing.assert_close(w.run(c["q"], c["cache"]), planned)  # buffers not refreshed
    bufs["paged_kv_indptr_buffer"].copy_(other["indptr"])
    bufs["paged_kv_indices_buffer"][:3].copy_(other["indices"])
    bufs["paged_kv_last_page_len_buffer"].copy_(other["last"])
    refreshed = w.run(c["q"], c["cache"])
    eager = TWIN.BatchDecodeWithPagedKVCacheWrapper(WS, "NHD")
    eager.plan(other["indptr"], other["indices"], other["last"], 4, 2, 8, 4, q_data_type="float32")
    torch.testing.assert_close(refreshed, eager.run(c["q"], c["cache"]))
    fast_decode_plan(eager, c["indptr"], c["indices"], c["last"], 4, 2, 8, 4,
                     q_data_type=torch.float32)  # fmt: skip
    torch.testing.assert_close(eager.run(c["q"], c["cache"]), planned)
    with pytest.raises(PlanMismatchError, match="compiled"):
        fast_decode_plan(eager, c["indptr"], c["indices"], c["last"], 4, 2, 8, 4)  # float16
    with pytest.raises(PlanMismatchError, match="planned once"):
        fast_decode_plan(_graph_decode(3, 8)[0], c["indptr"], c["indices"], c["last"], 4, 2, 8, 4)


def test_graph_prefill_reads_its_fixed_mask_and_bounds_rows() -> None:
    _, buf, q, kv = _mask_case()
    pages = kv.reshape(9, 1, 2, 2, 8).transpose(1, 2).reshape(9, 2, 1, 2, 8)  # page size 1
    fixed = {
        "qo_indptr_buf": torch.zeros(3, dtype=torch.int32),
        "paged_kv_indptr_buf": torch.zeros(3, dtype=torch.int32),
        "paged_kv_indices_buf": torch.zeros(9, dtype=torch.int32),
        "paged_kv_last_page_len_buf": torch.zeros(2, dtype=torch.int32),
        "custom_mask_buf": torch.zeros(16, dtype=torch.uint8),
        "mask_indptr_buf": torch.zeros(3, dtype=torch.int32),
    }
    w = TWIN.BatchPrefillWithPagedKVCacheWrapper(WS, "NHD", use_cuda_graph=True, **fixed)
    args = (_i32([0, 3, 5]), _i32([0, 5, 9]), _i32(range(9)), _i32([1, 1]), 2, 2, 8, 1)
    w.plan(*args, packed_custom_mask=buf, q_data_type=torch.float32)
    assert fixed["mask_indptr_buf"].tolist() == [0, 15, 23]
    eager = TWIN.BatchPrefillWithRaggedKVCacheWrapper(WS, "NHD")
    eager.plan(_i32([0, 3, 5]), _i32([0, 5, 9]), 2, 2, 8, packed_custom_mask=buf,
               q_data_type=torch.float32)  # fmt: skip
    torch.testing.assert_close(w.run(q, pages), eager.run(q, kv[:, 0], kv[:, 1]))
    padded = torch.cat([q, q[:2]])  # a bucket's extra rows: undefined (NaN) in the twin
    assert bool(w.run(padded, pages)[5:].isnan().all())
    with pytest.raises(BucketError, match="rows"):
        w.plan(_i32([0, 3, 6]), *args[1:], packed_custom_mask=buf, q_data_type="float32")


def test_empty_requests_give_zero_and_minus_infinity() -> None:
    """No page (and no query, and a masked span of one unread page with
    ``last_page_len`` 0): output 0, LSE -inf; with a sink, LSE ``sink / ln 2``."""
    cache = torch.randn(2, 2, 4, 1, 8)
    q = torch.randn(3, 2, 8)
    plan = (_i32([0, 1, 1, 3]), _i32([0, 0, 1, 1]), _i32([1]), _i32([0, 0, 0]), 2, 1, 8, 4)
    w = TWIN.BatchPrefillWithPagedKVCacheWrapper(WS, "NHD")
    w.plan(*plan, causal=True, q_data_type=torch.float32)
    out, lse = w.run(q, cache, return_lse=True)
    assert out.abs().max() == 0 and bool((lse == -math.inf).all())
    sinks = torch.tensor([0.5, -1.0])
    s = TWIN.BatchAttentionWithAttentionSinkWrapper(
        WS, "NHD", q_data_type=torch.float32, kv_data_type=torch.float32, head_dim_qk=8,
        head_dim_vo=8, window_left=-1,
    )  # fmt: skip
    s.plan(*plan, causal=True, q_data_type=torch.float32)
    out, lse = s.run(q, cache, sinks, 0.3, return_lse=True)
    assert out.abs().max() == 0
    torch.testing.assert_close(lse, (sinks / LN2).expand(3, 2))


def test_sink_wrappers_add_the_sink_to_the_denominator() -> None:
    c = _decode_case(8)
    sinks = torch.tensor([0.3, -0.7, 2.0, 0.0])
    ctor = {"q_data_type": torch.float32, "kv_data_type": torch.float32, "head_dim_qk": 8,
            "head_dim_vo": 8, "window_left": -1}  # fmt: skip
    s = TWIN.BatchDecodeWithAttentionSinkWrapper(WS, "NHD", backend="fa2", **ctor)
    assert s.use_tensor_cores
    s.plan(
        c["indptr"], c["indices"], c["last"], 4, 2, 8, 4, q_data_type=torch.float32, sm_scale=123.0
    )  # fmt: skip  (the run's scale is the one used)
    out, lse = s.run(c["q"], c["cache"], sinks, 0.4, return_lse=True)
    plain = TWIN.BatchDecodeWithPagedKVCacheWrapper(WS, "NHD")
    plain.plan(c["indptr"], c["indices"], c["last"], 4, 2, 8, 4, q_data_type=torch.float32,
               sm_scale=0.4)  # fmt: skip
    want_o, want_s = fold_sinks_torch(*plain.run(c["q"], c["cache"], return_lse=True), sinks)
    torch.testing.assert_close(out, want_o, **TOL)
    torch.testing.assert_close(lse, want_s, **TOL)
    for bad, err in (({"logits_soft_cap": 5.0}, UnsupportedError),
                     ({"window_left": 3}, PlanMismatchError),
                     ({"o_data_type": torch.float64}, UnsupportedError)):  # fmt: skip
        with pytest.raises(err):
            s.plan(c["indptr"], c["indices"], c["last"], 4, 2, 8, 4, q_data_type=torch.float32,
                   **bad)  # fmt: skip
    with pytest.raises(UnsupportedError, match="custom_mask_buf"):
        TWIN.BatchAttentionWithAttentionSinkWrapper(WS, custom_mask_buf=torch.zeros(4), **ctor)


def test_fp8_cache_read_as_stored_with_scales() -> None:
    """An fp8 cache is read as stored; ``k_scale`` multiplies the softmax scale and
    ``v_scale`` the output, as FlashInfer's run applies them."""
    c = _decode_case(9)
    stored = c["cache"].to(torch.float8_e4m3fn)
    w = TWIN.BatchDecodeWithPagedKVCacheWrapper(WS, "NHD")
    w.plan(c["indptr"], c["indices"], c["last"], 4, 2, 8, 4, q_data_type=torch.float32,
           kv_data_type=torch.float8_e4m3fn, sm_scale=0.25)  # fmt: skip
    out = w.run(c["q"], stored, k_scale=2.0, v_scale=3.0)
    ref = TWIN.BatchDecodeWithPagedKVCacheWrapper(WS, "NHD")
    ref.plan(c["indptr"], c["indices"], c["last"], 4, 2, 8, 4, q_data_type=torch.float32,
             sm_scale=0.5)  # fmt: skip
    torch.testing.assert_close(out, 3.0 * ref.run(c["q"], stored.float()), **TOL)
    with pytest.raises(PlanMismatchError, match="k_cache"):
        w.run(c["q"], c["cache"])  # a float32 cache for an fp8 plan


def test_multi_item_max_item_len_below_a_position_is_refused() -> None:
    """An item token at in-item position 2 with ``max_item_len`` 1: FlashInfer's kernel
    would skip one of its keys; the twin refuses. With 2 the item rule holds."""
    q = torch.randn(4, 1, 8)
    cache = torch.randn(6, 2, 1, 1, 8)
    common = (_i32([0, 4]), _i32([0, 6]), _i32(range(6)), _i32([1]), 1, 1, 8, 1)
    tpos = torch.tensor([0, 1, 2, 0], dtype=torch.int16).view(torch.uint16)  # keys 2..5
    w = TWIN.BatchPrefillWithPagedKVCacheWrapper(WS, "NHD")

    def plan(longest: int) -> None:
        w.plan(
            *common, causal=True, q_data_type=torch.float32,
            prefix_len_ptr=torch.tensor([2], dtype=torch.int32).view(torch.uint32),
            token_pos_in_items_ptr=tpos, token_pos_in_items_len=4,
            max_item_len_ptr=torch.tensor([longest], dtype=torch.int16).view(torch.uint16),
        )  # fmt: skip

    plan(1)
    with pytest.raises(FlashplanError, match="max_item_len"):
        w.run(q, cache)
    plan(2)
    out = w.run(q, cache)
    seen = np.zeros((4, 6), dtype=bool)
    seen[:, :2] = True  # the prefix
    seen[1, 3] = seen[2, 3] = seen[2, 4] = True  # item tokens: their item up to themselves
    k, v = cache[:, 0, 0].double(), cache[:, 1, 0].double()
    want, _ = _dense(q.double(), k, v, seen, scale=8**-0.5)
    _close(out, want, "multi-item request")


def test_merge_state_is_attention_over_the_union() -> None:
    gen = torch.Generator().manual_seed(10)
    q, k, v = (torch.randn(n, 2, 8, generator=gen).double() for n in (3, 7, 7))
    full = np.ones((3, 7), dtype=bool)
    a, b = full.copy(), full.copy()
    a[:, 4:], b[:, :4] = False, False
    o_a, s_a = _dense(q, k, v, a, scale=0.3)
    o_b, s_b = _dense(q, k, v, b, scale=0.3)
    o, s = merge_state(o_a.float(), s_a.float(), o_b.float(), s_b.float())
    want_o, want_s = _dense(q, k, v, full, scale=0.3)
    _close(o, want_o, "merged out")
    _close(s, want_s, "merged lse")
    empty = torch.full_like(s_a, -math.inf).float()
    o, s = merge_state(o_a.float(), empty, o_b.float(), empty)
    assert o.abs().max() == 0 and bool((s == -math.inf).all())


def test_refusals() -> None:
    """What the twin does not compute, or FlashInfer would misread, raises."""
    c = _decode_case(11)
    w = TWIN.BatchDecodeWithPagedKVCacheWrapper(WS, "NHD")
    with pytest.raises(PlanMismatchError, match="before plan"):
        w.run(c["q"], c["cache"])
    cases: list[tuple[Callable[[], Any], type[Exception]]] = [
        (lambda: TWIN.BatchDecodeWithPagedKVCacheWrapper(WS, "HND"), UnsupportedError),
        (lambda: w.plan(c["indptr"], c["indices"], c["last"], 4, 2, 8, 4, windw_left=3),
         UnsupportedError),
        (lambda: w.plan(c["indptr"], c["indices"], c["last"], 4, 2, 8, 4,
                        pos_encoding_mode="ROPE_LLAMA"), UnsupportedError),
        (lambda: w.plan(c["indptr"], c["indices"], c["last"], 3, 2, 8, 4), FlashplanError),
    ]  # fmt: skip
    for make, err in cases:
        with pytest.raises(err):
            make()
    w.plan(c["indptr"], c["indices"], c["last"], 4, 2, 8, 4, q_data_type=torch.float32)
    with pytest.raises(PlanMismatchError, match="q"):
        w.run(c["q"].half(), c["cache"])
    with pytest.raises(PageTableError):
        w.run(c["q"], c["cache"][:4])  # page 5 is outside this cache
    w.plan(c["indptr"], c["indices"], _i32([3, 1, 5]), 4, 2, 8, 4, q_data_type=torch.float32)
    with pytest.raises(FlashplanError, match="last_page_len"):
        w.run(c["q"], c["cache"])


def test_namespace_has_what_the_executor_reads() -> None:
    """The module-like namespace: a 0.7.4 version string, every wrapper class the
    executor's call records name (``WrapperKey.class_name``) and XQA's function."""
    from flashplan.executor.flashinfer.call_types import SINK_WRAPPERS

    assert TWIN.__version__.split("+")[0] == "0.7.4"
    classes = [k.value for k in WrapperKind if k is not WrapperKind.XQA]
    for name in classes + list(SINK_WRAPPERS.values()):
        assert isinstance(getattr(TWIN, name), type), name
    assert callable(TWIN.fast_decode_plan) and callable(TWIN.merge_state)
    assert callable(TWIN.xqa)
