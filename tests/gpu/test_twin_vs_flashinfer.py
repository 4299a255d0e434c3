"""The CPU twin (:mod:`flashplan.twin`) held to real FlashInfer: the same wrapper calls,
constructor, ``plan()`` and ``run()`` arguments, on the same bf16 inputs, run on
FlashInfer (CUDA) and on the twin (CPU), so the twin cannot drift from what CI trusts it
for; and the whole executor over each: ``FlashInferExecutor()`` and
``FlashInferExecutor(device="cuda", flashinfer=flashinfer_twin)`` on the same plans,
tables and inputs (decode on both kernels, extends on both paths, verify trees, windows,
sinks, cross groups, a CUDA-graph bucket's replays against the twin's eager replays).

Covered: decode with and without tensor cores (plain, windowed, soft-capped, GQA, pages
partly filled, page sizes 1 and 16), paged prefill (causal with ``qo_len < kv_len``,
non-causal, windowed, soft-capped, a packed custom mask at 0.7.4's offsets, multi-item
scoring, an empty request), ragged prefill (causal and not), both sink wrappers, an fp8
cache with ``k_scale`` / ``v_scale``, ``fast_decode_plan`` and ``merge_state``. Outputs
agree to a relative error of 1e-2 and LSEs (base 2) to 5e-2; empty rows are 0 / -inf on
both; both executors write the same cache bytes. Skipped without CUDA
(``tests/gpu/conftest.py``).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np
import pytest
import torch

import flashplan as fp
from flashplan.executor.flashinfer import (
    CapturedStep,
    ExecutorPolicy,
    FlashInferExecutor,
    GraphBucket,
    capture,
)
from flashplan.twin import flashinfer_twin

from .helpers import rel_err, run_both, stable_seed

OUT_TOL, LSE_TOL = 1e-2, 5e-2
BF16 = torch.bfloat16


def import_flashinfer() -> Any:
    """The installed ``flashinfer`` (its import-time deprecation notices silenced)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import flashinfer
    return flashinfer


class _Host:
    """An index array handed to ``plan()`` on the host, as the executor hands its pinned
    ones (FlashInfer copies them; the page ids, masks and multi-item tensors it keeps go
    on the device)."""

    def __init__(self, values: Any) -> None:
        self.t = torch.tensor(np.asarray(values), dtype=torch.int32)


def _on(value: Any, device: str) -> Any:
    """``value`` (a tensor, or a tuple, list or dict of them) on ``device``; a
    :class:`_Host` array on the host; other values as given."""
    if isinstance(value, _Host):
        return value.t
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_on(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _on(v, device) for k, v in value.items()}
    return value


def _both(
    cls: str, ctor: dict[str, Any], plan: tuple[tuple, dict], run: tuple[tuple, dict]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``cls(workspace, **ctor)``, ``plan(*plan)``, ``run(*run, return_lse=True)`` on
    FlashInfer (every tensor moved to CUDA) and on the twin (CPU): ``[(out, lse)] * 2``
    on the CPU, FlashInfer's first."""
    got = []
    for module, device in ((import_flashinfer(), "cuda"), (flashinfer_twin, "cpu")):
        size = 128 << 20 if device == "cuda" else 16
        workspace = torch.zeros(size, dtype=torch.uint8, device=device)
        wrapper = getattr(module, cls)(workspace, **_on(ctor, device))
        wrapper.plan(*_on(plan[0], device), **_on(plan[1], device))
        out, lse = wrapper.run(*_on(run[0], device), **run[1], return_lse=True)
        got.append((out.float().cpu(), lse.float().cpu()))
    return got


def _agree(got: list[tuple[torch.Tensor, torch.Tensor]], what: str) -> None:
    """The twin's ``(out, lse)`` equals FlashInfer's within the tolerances (rows that see
    nothing: out 0 and LSE -inf on both)."""
    (o_fi, s_fi), (o_tw, s_tw) = got
    assert o_fi.shape == o_tw.shape and s_fi.shape == s_tw.shape, what
    err = rel_err(o_tw, o_fi)
    assert err <= OUT_TOL, f"{what}: output rel err {err:.3g}"
    empty_fi, empty_tw = s_fi == -math.inf, s_tw == -math.inf
    assert torch.equal(empty_fi, empty_tw), f"{what}: LSE -inf rows differ"
    finite = ~empty_tw
    lse_err = float((s_fi[finite] - s_tw[finite]).abs().max()) if finite.any() else 0.0
    assert lse_err <= LSE_TOL, f"{what}: LSE abs err {lse_err:.3g}"


def _paged(
    kv_lens: list[int], page_size: int, kv_heads: int, head_dim: int, seed: int,
    dtype: torch.dtype = BF16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """A shuffled pool holding ``kv_lens`` tokens per request: ``(cache, indptr, indices,
    last_page_len)`` (int32 arrays)."""
    rng = np.random.default_rng(seed)
    pages = [(n + page_size - 1) // page_size for n in kv_lens]
    ids = rng.permutation(sum(pages) + 3).astype(np.int32)[: sum(pages)]
    last = [n - (p - 1) * page_size if p else 0 for n, p in zip(kv_lens, pages, strict=True)]
    gen = torch.Generator().manual_seed(seed)
    shape = (sum(pages) + 3, 2, page_size, kv_heads, head_dim)
    cache = torch.randn(shape, generator=gen).to(dtype)
    return cache, _Host(np.cumsum([0, *pages])), torch.from_numpy(ids), _Host(last)


def _q(rows: int, heads: int, head_dim: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, heads, head_dim, generator=torch.Generator().manual_seed(seed)).to(
        BF16
    )


@pytest.mark.parametrize("tensor_cores", [False, True])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("window", "cap"), [(-1, 0.0), (37, 0.0), (-1, 30.0)])
def test_decode(tensor_cores: bool, page_size: int, window: int, cap: float) -> None:
    kv_lens = [1, 17, 300, 64, 129]
    cache, indptr, indices, last = _paged(kv_lens, page_size, 2, 128, seed=1)
    q = _q(len(kv_lens), 8, 128, seed=2)
    plan = (indptr, indices, last, 8, 2, 128, page_size), {
        "window_left": window, "logits_soft_cap": cap, "q_data_type": BF16,
        "kv_data_type": BF16, "o_data_type": BF16, "sm_scale": 0.1, "non_blocking": True,
    }  # fmt: skip
    ctor = {"kv_layout": "NHD", "use_tensor_cores": tensor_cores, "backend": "fa2"}
    got = _both("BatchDecodeWithPagedKVCacheWrapper", ctor, plan, ((q, cache), {}))
    _agree(got, f"decode tc={tensor_cores} page={page_size} window={window} cap={cap}")


_PREFILL = [
    ("causal", {"causal": True}),
    ("non-causal", {"causal": False}),
    ("windowed", {"causal": True, "window_left": 20}),
    ("soft-capped", {"causal": True, "logits_soft_cap": 30.0}),
]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("name", "flags"), _PREFILL)
def test_paged_prefill(page_size: int, name: str, flags: dict[str, Any]) -> None:
    """Requests with ``qo_len < kv_len`` (a cached prefix), ``qo_len == kv_len`` and one
    with no key at all (non-causal: its queries see nothing)."""
    qo_lens, kv_lens = [1, 7, 33, 12, 3], [40, 7, 100, 12, 0]
    cache, kv_indptr, indices, last = _paged(kv_lens, page_size, 2, 128, seed=3)
    qo = _Host(np.cumsum([0, *qo_lens]))
    q = _q(sum(qo_lens), 8, 128, seed=4)
    plan = (qo, kv_indptr, indices, last, 8, 2, 128, page_size), {
        "q_data_type": BF16, "kv_data_type": BF16, "o_data_type": BF16, "sm_scale": 0.1,
        **flags,
    }  # fmt: skip
    ctor = {"kv_layout": "NHD", "backend": "fa2"}
    got = _both("BatchPrefillWithPagedKVCacheWrapper", ctor, plan, ((q, cache), {}))
    _agree(got, f"paged prefill {name} page={page_size}")


def test_masked_paged_prefill() -> None:
    """A packed custom mask, each request's bits where 0.7.4 reads them: at byte
    ``sum_{r<i} qo_r * kv_r`` (its plan() counts bits; the kernel adds bytes)."""
    qo_lens, kv_lens = [3, 9, 5], [20, 9, 37]
    rng = np.random.default_rng(5)
    masks = [rng.random((q, k)) < 0.6 for q, k in zip(qo_lens, kv_lens, strict=True)]
    offsets = np.cumsum([0, *[q * k for q, k in zip(qo_lens, kv_lens, strict=True)]])
    buf = np.zeros(int(offsets[-1]) + 8, dtype=np.uint8)
    for m, off in zip(masks, offsets, strict=False):
        packed = np.packbits(m.reshape(-1), bitorder="little")
        buf[off : off + packed.shape[0]] = packed
    cache, kv_indptr, indices, last = _paged(kv_lens, 16, 2, 128, seed=6)
    qo = _Host(np.cumsum([0, *qo_lens]))
    plan = (qo, kv_indptr, indices, last, 8, 2, 128, 16), {
        "packed_custom_mask": torch.from_numpy(buf), "causal": False, "q_data_type": BF16,
        "kv_data_type": BF16, "o_data_type": BF16,
    }  # fmt: skip
    q = _q(sum(qo_lens), 8, 128, seed=7)
    got = _both("BatchPrefillWithPagedKVCacheWrapper", {"backend": "fa2"}, plan, ((q, cache), {}))
    _agree(got, "masked paged prefill")


def test_multi_item_paged_prefill() -> None:
    """One request: 5 prefix keys, then items [d a a d b d] (d: delimiter)."""
    cache, kv_indptr, indices, last = _paged([11], 16, 2, 128, seed=8)
    tpos = torch.tensor([0, 1, 2, 0, 1, 0, 0, 0], dtype=torch.int16).view(torch.uint16)
    plan = (_Host([0, 6]), kv_indptr, indices, last, 8, 2, 128, 16), {
        "causal": True, "q_data_type": BF16, "kv_data_type": BF16, "o_data_type": BF16,
        "prefix_len_ptr": torch.tensor([5], dtype=torch.int32).view(torch.uint32),
        "token_pos_in_items_ptr": tpos, "token_pos_in_items_len": 8,
        "max_item_len_ptr": torch.tensor([2], dtype=torch.int16).view(torch.uint16),
    }  # fmt: skip
    q = _q(6, 8, 128, seed=9)
    got = _both("BatchPrefillWithPagedKVCacheWrapper", {"backend": "fa2"}, plan, ((q, cache), {}))
    _agree(got, "multi-item paged prefill")


@pytest.mark.parametrize("causal", [True, False])
def test_ragged_prefill(causal: bool) -> None:
    qo_lens, kv_lens = [5, 31, 1], [5, 40, 9]
    gen = torch.Generator().manual_seed(10)
    k, v = (torch.randn(sum(kv_lens), 2, 128, generator=gen).to(BF16) for _ in range(2))
    qo, kv = _Host(np.cumsum([0, *qo_lens])), _Host(np.cumsum([0, *kv_lens]))
    plan = (qo, kv, 8, 2, 128), {
        "causal": causal, "q_data_type": BF16, "kv_data_type": BF16, "o_data_type": BF16,
        "sm_scale": 0.1,
    }  # fmt: skip
    q = _q(sum(qo_lens), 8, 128, seed=11)
    ctor = {"kv_layout": "NHD", "backend": "fa2"}
    got = _both("BatchPrefillWithRaggedKVCacheWrapper", ctor, plan, ((q, k, v), {}))
    _agree(got, f"ragged prefill causal={causal}")


@pytest.mark.parametrize("window", [-1, 24])
def test_sink_wrappers(window: int) -> None:
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0, 1.5, -3.0, 0.25, 1.0])
    ctor = {"kv_layout": "NHD", "backend": "fa2", "q_data_type": BF16, "kv_data_type": BF16,
            "head_dim_qk": 128, "head_dim_vo": 128, "window_left": window}  # fmt: skip
    dtypes = {"q_data_type": BF16, "kv_data_type": BF16, "o_data_type": BF16}
    kv_lens = [9, 70, 33]
    cache, indptr, indices, last = _paged(kv_lens, 16, 2, 128, seed=12)
    q = _q(3, 8, 128, seed=13)
    plan = (indptr, indices, last, 8, 2, 128, 16), {"window_left": window, **dtypes}
    got = _both("BatchDecodeWithAttentionSinkWrapper", ctor, plan, ((q, cache, sinks, 0.1), {}))
    _agree(got, f"sink decode window={window}")
    qo = _Host([0, 4, 10, 13])
    plan = (qo, indptr, indices, last, 8, 2, 128, 16), {
        "causal": True, "window_left": window, **dtypes,
    }  # fmt: skip
    q = _q(13, 8, 128, seed=14)
    got = _both("BatchAttentionWithAttentionSinkWrapper", ctor, plan, ((q, cache, sinks, 0.1), {}))
    _agree(got, f"sink prefill window={window}")


def test_fp8_cache_with_scales() -> None:
    """bf16 queries over an e4m3 cache: ``k_scale`` multiplies the softmax scale,
    ``v_scale`` the output, the cache is read as stored."""
    cache, indptr, indices, last = _paged([50, 7, 200], 16, 2, 128, seed=15)
    cache = cache.float().to(torch.float8_e4m3fn)
    plan = (indptr, indices, last, 8, 2, 128, 16), {
        "q_data_type": BF16, "kv_data_type": torch.float8_e4m3fn, "o_data_type": BF16,
    }  # fmt: skip
    q = _q(3, 8, 128, seed=16)
    run = (q, cache), {"k_scale": 0.7, "v_scale": 1.3}
    for tc in (False, True):
        ctor = {"use_tensor_cores": tc, "backend": "fa2"}
        _agree(_both("BatchDecodeWithPagedKVCacheWrapper", ctor, plan, run), f"fp8 tc={tc}")


def test_fast_decode_plan_replans_like_plan() -> None:
    """An eager decode wrapper planned once, then re-planned by ``fast_decode_plan`` with
    another batch (device arrays, as an executor passes them)."""
    first = _paged([30, 5], 16, 2, 128, seed=17)
    second = _paged([64, 1, 100], 16, 2, 128, seed=18)
    dtypes = {"q_data_type": BF16, "kv_data_type": BF16}
    got = []
    for module, device in ((import_flashinfer(), "cuda"), (flashinfer_twin, "cpu")):
        workspace = torch.zeros(128 << 20 if device == "cuda" else 16, dtype=torch.uint8,
                                device=device)  # fmt: skip
        w = module.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
        w.plan(*_on(first[1:], device), 8, 2, 128, 16, o_data_type=BF16, **dtypes)
        cache, *host = second  # fast_decode_plan keeps the arrays: on the device
        arrays = [(a.t if isinstance(a, _Host) else a).to(device) for a in host]
        module.fast_decode_plan(w, *arrays, 8, 2, 128, 16, **dtypes)
        cache = cache.to(device)
        out, lse = w.run(_q(3, 8, 128, seed=19).to(device), cache, return_lse=True)
        got.append((out.float().cpu(), lse.float().cpu()))
    _agree(got, "fast_decode_plan")


def test_merge_state() -> None:
    gen = torch.Generator().manual_seed(20)
    v_a, v_b = (torch.randn(9, 8, 128, generator=gen).to(BF16) for _ in range(2))
    s_a, s_b = (torch.randn(9, 8, generator=gen) * 3 for _ in range(2))
    s_a[0] = -math.inf
    fi = import_flashinfer().merge_state(*_on((v_a, s_a, v_b, s_b), "cuda"))
    tw = flashinfer_twin.merge_state(v_a, s_a, v_b, s_b)
    _agree([(fi[0].float().cpu(), fi[1].cpu()), (tw[0].float(), tw[1])], "merge_state")


# -- the whole executor over FlashInfer and over the twin ---------------------------------
DEV = "cuda"
HEADS = fp.HeadConfig(num_qo_heads=16, num_kv_heads=4, head_dim=128)
FULL = fp.AttentionGroup.full()
CAP = fp.AttentionGroup.full(logits_soft_cap=30.0)
W5 = fp.AttentionGroup.sliding(5)
W127_CAP = fp.AttentionGroup.sliding(127, logits_soft_cap=30.0)
CROSS = fp.AttentionGroup.cross()
SINK = fp.AttentionGroup.full(sinks=True)
SINK_W127 = fp.AttentionGroup.sliding(127, sinks=True)
#: FlashInfer's sink kernel has no soft cap: this group's sink is folded into the state.
SINK_CAP = fp.AttentionGroup.full(sinks=True, logits_soft_cap=30.0)


def _executor_pair(
    policy: ExecutorPolicy | None = None,
) -> tuple[FlashInferExecutor, FlashInferExecutor]:
    """``FlashInferExecutor()`` on real FlashInfer, and one over the twin on the same
    CUDA device (the same staging, gathers, masks and KV writes; the twin's attention)."""
    real = FlashInferExecutor(policy=policy)
    twin = FlashInferExecutor(device=DEV, policy=policy, flashinfer=flashinfer_twin)
    return real, twin


def _lengths(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Sequence and cached-prefix lengths across window edges (5, 127) and page edges, a
    prefill from 0, a single new token, and a few long requests."""
    seq = np.array([1, 5, 6, 7, 16, 17, 127, 128, 129, *rng.integers(1, 700, 4)])
    prefix = (seq * rng.random(seq.shape[0])).astype(np.int64)
    prefix[2], prefix[5] = 0, seq[5] - 1
    return seq, prefix


def _executor_case(
    case: str, rng: np.random.Generator, page_size: int
) -> tuple[fp.BatchLayout, str, ExecutorPolicy | None]:
    """``(layout, extend_path, policy)`` of one case of
    :func:`test_twin_executor_equals_flashinfer_executor`."""
    seq, prefix = _lengths(rng)
    enc = rng.integers(0, 40, seq.shape[0])
    groups: tuple[fp.AttentionGroup, ...]
    if case.startswith("decode"):
        policy = ExecutorPolicy(decode_tensor_cores=case == "decode-tensor-cores")
        groups = (FULL, W5, W127_CAP, CROSS)
        layout = fp.BatchLayout.decode(seq, page_size=page_size, groups=groups, encoder_lens=enc)
        return layout, "auto", policy
    if case.startswith("extend"):
        groups = (FULL, W5, W127_CAP, fp.AttentionGroup.bidirectional(), CROSS)
        layout = fp.BatchLayout.extend(
            seq, prefix, page_size=page_size, groups=groups, encoder_lens=enc
        )
        return layout, case.removeprefix("extend-"), None
    if case == "verify-tree":
        n = 7
        parents = [[-1] + [int(rng.integers(0, j)) for j in range(1, n)] for _ in range(6)]
        tree = fp.DraftTree.from_parents(parents)
        layout = fp.BatchLayout.verify(
            rng.integers(0, 300, 6), tree, page_size=page_size, groups=(FULL, W5, CAP)
        )
        return layout, "auto", None
    if case == "sliding-windows":  # windows, bidirectional windows and chunks (masks)
        groups = (
            W5,
            W127_CAP,
            fp.AttentionGroup.bidirectional(window_left=15, window_right=15),
            fp.AttentionGroup.chunked(24),
        )
        return fp.BatchLayout.extend(seq, prefix, page_size=page_size, groups=groups), "paged", None
    if case == "sinks-decode":
        layout = fp.BatchLayout.decode(seq, page_size=page_size, groups=(SINK, SINK_W127, SINK_CAP))
        return layout, "auto", None
    if case.startswith("sinks-extend"):
        groups = (SINK, SINK_W127, SINK_CAP, fp.AttentionGroup.chunked(32, sinks=True))
        layout = fp.BatchLayout.extend(seq, prefix, page_size=page_size, groups=groups)
        return layout, case.removeprefix("sinks-extend-"), None
    raise AssertionError(case)


EXECUTOR_CASES = [
    "decode-cuda-cores",
    "decode-tensor-cores",
    "extend-paged",
    "extend-ragged",
    "verify-tree",
    "sliding-windows",
    "sinks-decode",
    "sinks-extend-paged",
    "sinks-extend-ragged",
]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("case", EXECUTOR_CASES)
def test_twin_executor_equals_flashinfer_executor(case: str, page_size: int) -> None:
    """The same plan, table and inputs on ``FlashInferExecutor()`` and on
    ``FlashInferExecutor(device="cuda", flashinfer=flashinfer_twin)``: every group's
    output and LSE agree within the bf16 tolerances (queries that see no key: on both),
    and both write the same cache bytes."""
    rng = np.random.default_rng(stable_seed("twin executor", case, page_size))
    layout, path, policy = _executor_case(case, rng, page_size)
    real, twin = _executor_pair(policy)
    results = run_both(layout, HEADS, twin, extend_path=path, seed=page_size, reference=real)
    assert len(results) == len(layout.groups)
    for group, out_err, lse_err, cache_err in results:
        assert out_err <= OUT_TOL, (case, group.describe(), out_err)
        assert lse_err <= LSE_TOL, (case, group.describe(), lse_err)
        assert cache_err == 0.0, (case, group.describe())


def _graph_batches(
    kind: str, rng: np.random.Generator, page_size: int
) -> tuple[GraphBucket, tuple[fp.AttentionGroup, ...], list[fp.BatchLayout]]:
    """A bucket, its groups and batches of several sizes (the first fills the bucket;
    padding requests in the others)."""
    if kind == "decode":
        groups: tuple[fp.AttentionGroup, ...] = (FULL, W5, W127_CAP, SINK_W127)
        bucket = GraphBucket.decode(batch_size=8, max_pages=400 // page_size + 2)
        layouts = [
            fp.BatchLayout.decode(rng.integers(1, 400, bs), page_size=page_size, groups=groups)
            for bs in (8, 3, 1, 6)
        ]
        return bucket, groups, layouts
    n, groups = 7, (FULL, W5, CAP)
    bucket = GraphBucket.verify(batch_size=4, max_pages=320 // page_size + 2, num_tokens=n)
    layouts = []
    for bs in (4, 2, 1, 3):
        parents = [[-1] + [int(rng.integers(0, j)) for j in range(1, n)] for _ in range(bs)]
        tree = fp.DraftTree.from_parents(parents)
        layouts.append(
            fp.BatchLayout.verify(
                rng.integers(0, 300, bs), tree, page_size=page_size, groups=groups
            )
        )
    return bucket, groups, layouts


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("kind", ["decode", "verify"])
def test_twin_graph_bucket_equals_flashinfer_replays(kind: str, page_size: int) -> None:
    """A CUDA-graph bucket made from each executor: FlashInfer's graph captured and
    replayed, the twin's step replayed eagerly (a :class:`CapturedStep` without a
    graph: plan into the fixed buffers, run the forward), on the same static inputs,
    over batches of several sizes: the real rows' outputs and LSE agree within the bf16
    tolerances, and both write the same cache bytes (padding requests write nowhere)."""
    rng = np.random.default_rng(stable_seed("twin graph", kind, page_size))
    bucket, groups, layouts = _graph_batches(kind, rng, page_size)
    specs = [fp.plan(layout, HEADS) for layout in layouts]
    tables = [
        fp.PageTable.shuffled(s.pages_needed, seed=k, spare_pages=3, device=DEV)
        for k, s in enumerate(specs)
    ]
    pool = max(int(t.num_pages or 0) for t in tables)
    gen = torch.Generator(device=DEV).manual_seed(stable_seed("twin graph inputs", kind))

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=DEV).to(BF16)

    hq, hkv, d = HEADS.num_qo_heads, HEADS.num_kv_heads, HEADS.head_dim
    rows = bucket.total_q
    q, k, v = rand(rows, hq, d), rand(rows, hkv, d), rand(rows, hkv, d)
    sinks = torch.randn(hq, generator=gen, device=DEV) * 3
    base = [rand(pool, 2, page_size, hkv, d) for _ in groups]
    steps: list[CapturedStep[list[tuple[torch.Tensor, torch.Tensor]]]] = []
    caches: list[list[torch.Tensor]] = []
    real, twin = _executor_pair()
    for ex in (real, twin):
        gx = ex.for_bucket(bucket)
        gx.apply(specs[0], tables[0])
        own = [c.clone() for c in base]

        def forward(
            gx: FlashInferExecutor = gx, own: list[torch.Tensor] = own
        ) -> list[tuple[torch.Tensor, torch.Tensor]]:
            return [
                gx.run(g, q, k, v, c, return_lse=True, sinks=sinks if g.sinks else None)
                for g, c in zip(groups, own, strict=True)
            ]

        # FlashInfer's step is captured; the twin's replays plan and run it eagerly
        eager = CapturedStep(gx, None, forward(), forward) if ex is twin else None
        steps.append(capture(gx, forward) if eager is None else eager)
        caches.append(own)
    for spec, table in zip(specs, tables, strict=True):
        for t in (q, k, v):
            t.copy_(rand(*t.shape))  # padding rows get new values too
        for own in caches:
            for c, b in zip(own, base, strict=True):
                c.copy_(b)
        outs = [[(o.clone(), s.clone()) for o, s in step.replay(spec, table)] for step in steps]
        torch.cuda.synchronize()
        n = spec.total_q
        for group, (o_fi, s_fi), (o_tw, s_tw) in zip(groups, *outs, strict=True):
            got = [
                (o_fi[:n].float().cpu(), s_fi[:n].cpu()),
                (o_tw[:n].float().cpu(), s_tw[:n].cpu()),
            ]
            _agree(got, f"{kind} bucket, batch of {spec.batch_size}, {group.describe()}")
        for c_fi, c_tw in zip(*caches, strict=True):
            assert torch.equal(c_fi, c_tw), (kind, spec.batch_size)
