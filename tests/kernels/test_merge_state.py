"""merge_state_triton vs merge_state_torch vs a brute-force float64 merge (base-2 LSE).

On a host without CUDA, ``conftest.py`` makes the Triton kernel run under Triton's
interpreter on CPU tensors; the ``gpu`` tests run the compiled kernel on CUDA.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashplan.errors import FlashplanError
from flashplan.kernels import triton_mode
from flashplan.kernels.merge_state import merge_state_torch, merge_state_triton

NEG_INF = float("-inf")
# 25 examples keep this file at a few seconds; a profile asking for more (e.g.
# HYPOTHESIS_PROFILE=thorough) gets what it asks for.
HYP = settings(
    max_examples=settings().max_examples if settings().max_examples > 100 else 25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
requires_interpreter = pytest.mark.skipif(
    triton_mode() != "interpret",
    reason=f"Triton kernel is in mode {triton_mode()!r}, not 'interpret' "
    "(on a CUDA host the gpu tests cover it)",
)
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# (atol, rtol) on v, by dtype: about one rounding of the output dtype.
V_TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
    torch.float64: (1e-9, 1e-9),
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]  # the kernel's
DTYPES_TORCH = [*DTYPES, torch.float64]  # the torch twin also takes float64 (reference)

State = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Case:
    tokens: int
    heads: int
    head_dim: int
    dtype_a: torch.dtype
    dtype_b: torch.dtype
    lse_scale: float  # finite lse values in [-scale, scale]
    p_empty: float  # probability that one side's lse is -inf
    layout: str  # "contiguous" | "strided" (padded strides) | "step2" | "transposed"
    nan_in_empty: bool  # put NaN in v where that side is empty (must not leak)
    seed: int

    def make(self, device: str) -> State:
        """(v_a, s_a, v_b, s_b) on ``device`` with this case's values and strides."""
        gen = torch.Generator().manual_seed(self.seed)
        shape = (self.tokens, self.heads, self.head_dim)
        out: list[torch.Tensor] = []
        for dtype in (self.dtype_a, self.dtype_b):
            v = torch.randn(shape, generator=gen).to(dtype)
            s = (torch.rand(shape[:2], generator=gen) * 2 - 1) * self.lse_scale
            s = torch.where(torch.rand(shape[:2], generator=gen) < self.p_empty, NEG_INF, s)
            if self.nan_in_empty:
                v[torch.isneginf(s)] = float("nan")
            out += [self._lay_out(v, device), self._lay_out(s, device)]
        return out[0], out[1], out[2], out[3]

    def _lay_out(self, t: torch.Tensor, device: str) -> torch.Tensor:
        if self.layout == "strided":  # a slice of a larger buffer along every dim
            big = torch.zeros([n + 2 for n in t.shape], dtype=t.dtype)
            big[tuple(slice(1, 1 + n) for n in t.shape)] = t
            return big.to(device)[tuple(slice(1, 1 + n) for n in t.shape)]
        if self.layout == "step2":  # every other element of a larger buffer, every dim
            big = torch.zeros([2 * n for n in t.shape], dtype=t.dtype)
            big[tuple(slice(None, None, 2) for _ in t.shape)] = t
            return big.to(device)[tuple(slice(None, None, 2) for _ in t.shape)]
        if self.layout == "transposed":  # tokens and heads swapped in memory
            return t.transpose(0, 1).contiguous().to(device).transpose(0, 1)
        return t.to(device)


@st.composite
def cases(
    draw: st.DrawFn,
    max_tokens: int = 6,
    max_heads: int = 5,
    dtypes: tuple[torch.dtype, ...] = tuple(DTYPES),
) -> Case:
    return Case(
        tokens=draw(st.integers(0, max_tokens)),
        # Large head counts span several head blocks of the kernel (~1024 elements each).
        heads=draw(st.one_of(st.integers(1, max_heads), st.sampled_from([17, 40]))),
        head_dim=draw(st.sampled_from([1, 2, 5, 8, 16, 33, 128])),
        dtype_a=draw(st.sampled_from(dtypes)),
        dtype_b=draw(st.sampled_from(dtypes)),
        lse_scale=draw(st.sampled_from([1.0, 30.0, 300.0])),
        p_empty=draw(st.sampled_from([0.0, 0.3, 0.7, 1.0])),
        layout=draw(st.sampled_from(["contiguous", "strided", "step2", "transposed"])),
        nan_in_empty=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def brute_merge(
    v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (token, head) float64 merge with Python's math, straight from the definition."""
    tokens, heads, head_dim = v_a.shape
    v = torch.zeros((tokens, heads, head_dim), dtype=torch.float64)
    s = torch.full((tokens, heads), NEG_INF, dtype=torch.float64)
    va, vb = v_a.double().cpu(), v_b.double().cpu()
    for n in range(tokens):
        for h in range(heads):
            la, lb = float(s_a[n, h]), float(s_b[n, h])
            if la == NEG_INF and lb == NEG_INF:
                continue  # both empty: v = 0, s = -inf
            m = max(la, lb)
            lse = m + math.log2(2.0 ** (la - m) + 2.0 ** (lb - m))
            s[n, h] = lse
            for weight_lse, part in ((la, va), (lb, vb)):
                if weight_lse != NEG_INF:
                    v[n, h] += 2.0 ** (weight_lse - lse) * part[n, h]
    return v, s


def assert_close_state(
    got: tuple[torch.Tensor, torch.Tensor],
    want: tuple[torch.Tensor, torch.Tensor],
    dtype: torch.dtype,
) -> None:
    v, s = got
    v_want, s_want = want
    assert v.dtype == dtype and s.dtype == torch.float32
    assert v.shape == v_want.shape and s.shape == s_want.shape
    assert v.is_contiguous() and s.is_contiguous()
    v, s = v.cpu(), s.cpu()
    assert not torch.isnan(v).any() and not torch.isnan(s).any()
    assert torch.equal(torch.isneginf(s), torch.isneginf(s_want.cpu()))
    finite = torch.isfinite(s_want.cpu())
    torch.testing.assert_close(
        s[finite].double(), s_want.cpu()[finite].double(), atol=1e-4, rtol=1e-6
    )
    assert (v[~finite] == 0).all()
    atol, rtol = V_TOL[dtype]
    torch.testing.assert_close(v.double(), v_want.cpu().double(), atol=atol, rtol=rtol)


def check_case(case: Case, device: str, impls: list[str]) -> None:
    state = case.make(device)
    want = brute_merge(*state)
    for impl in impls:
        fn = merge_state_triton if impl == "triton" else merge_state_torch
        assert_close_state(fn(*state), want, case.dtype_a)


# --------------------------------------------------------------------------- CPU tests


@HYP
@given(cases(dtypes=tuple(DTYPES_TORCH)))
def test_torch_matches_brute_force(case: Case) -> None:
    check_case(case, "cpu", ["torch"])


@requires_interpreter
@HYP
@given(cases())
def test_triton_interpreted_matches(case: Case) -> None:
    check_case(case, "cpu", ["triton", "torch"])


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_edge_cases(impl: str) -> None:
    """Both empty, one empty with NaN garbage, huge lse, equal lse; exact expectations."""
    fn = merge_state_triton if impl == "triton" else merge_state_torch
    nan = float("nan")
    v_a = torch.tensor([[[1.0, 2.0]], [[nan, nan]], [[3.0, 4.0]], [[1.0, 0.0]]])
    v_b = torch.tensor([[[5.0, 6.0]], [[7.0, 8.0]], [[nan, 1.0]], [[0.0, 1.0]]])
    s_a = torch.tensor([[NEG_INF], [NEG_INF], [1000.0], [2.5]])
    s_b = torch.tensor([[NEG_INF], [4.0], [NEG_INF], [2.5]])
    v, s = fn(v_a, s_a, v_b, s_b)
    assert torch.equal(v[0], torch.zeros(1, 2)) and s[0, 0] == NEG_INF
    assert torch.equal(v[1], v_b[1]) and s[1, 0] == 4.0
    assert torch.equal(v[2], v_a[2]) and s[2, 0] == 1000.0
    torch.testing.assert_close(v[3], torch.tensor([[0.5, 0.5]]))
    torch.testing.assert_close(s[3, 0], torch.tensor(3.5))


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_nan_is_never_hidden(impl: str) -> None:
    """NaN in an LSE, or in the values of a side that is not empty, reaches the output:
    a NaN side is not "empty" (a query that sees no key), whatever the other side is."""
    if impl == "triton" and triton_mode() != "interpret":
        pytest.skip("needs Triton's interpreter (CPU)")
    fn = merge_state_triton if impl == "triton" else merge_state_torch
    nan = float("nan")
    v_a = torch.tensor([[[1.0, 2.0]], [[1.0, 2.0]], [[nan, 2.0]], [[1.0, 2.0]], [[nan, 1.0]]])
    v_b = torch.tensor([[[5.0, 6.0]], [[5.0, 6.0]], [[5.0, 6.0]], [[5.0, 6.0]], [[3.0, 1.0]]])
    s_a = torch.tensor([[nan], [nan], [1.0], [1.0], [-50.0]])
    s_b = torch.tensor([[NEG_INF], [2.0], [NEG_INF], [nan], [60.0]])
    v, s = fn(v_a, s_a, v_b, s_b)
    assert torch.isnan(s[[0, 1, 3]]).all()
    assert torch.isnan(v[[0, 1, 3]]).all()
    # NaN in a non-empty side's values, even when its weight rounds to 0.
    assert torch.isnan(v[2, 0, 0]) and v[2, 0, 1] == 2.0 and s[2, 0] == 1.0
    assert torch.isnan(v[4, 0, 0]) and torch.isfinite(s[4, 0])


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_several_head_blocks(impl: str) -> None:
    """40 heads of 33 (padded to 64) span three 16-head blocks, the last one partial."""
    case = Case(3, 40, 33, torch.float16, torch.float32, 30.0, 0.3, "step2", True, 7)
    state = case.make("cpu")
    fn = merge_state_triton if impl == "triton" else merge_state_torch
    assert_close_state(fn(*state), brute_merge(*state), torch.float16)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_empty_batch(impl: str) -> None:
    fn = merge_state_triton if impl == "triton" else merge_state_torch
    v = torch.zeros((0, 3, 8), dtype=torch.bfloat16)
    s = torch.zeros((0, 3))
    out_v, out_s = fn(v, s, v, s)
    assert out_v.shape == (0, 3, 8) and out_v.dtype == torch.bfloat16
    assert out_s.shape == (0, 3) and out_s.dtype == torch.float32


def test_argument_errors() -> None:
    v = torch.zeros((2, 3, 4))
    s = torch.zeros((2, 3))
    with pytest.raises(FlashplanError, match="v_a"):
        merge_state_triton(v[0], s, v, s)
    with pytest.raises(FlashplanError, match="v_b"):
        merge_state_triton(v, s, v[:1], s)
    with pytest.raises(FlashplanError, match="s_b"):
        merge_state_torch(v, s, v, s.double())
    with pytest.raises(FlashplanError, match="s_a"):
        merge_state_torch(v, s[:1], v, s)
    with pytest.raises(FlashplanError, match="v_a"):
        merge_state_torch(v.long(), s, v, s)
    with pytest.raises(FlashplanError, match="v_b"):
        merge_state_triton(v, s, v.double(), s)  # float64: the torch twin only


# --------------------------------------------------------------------------- GPU tests


@pytest.mark.gpu
@requires_cuda
@HYP
@given(cases(max_tokens=40, max_heads=9))
def test_gpu_matches(case: Case) -> None:
    check_case(case, "cuda", ["triton", "torch"])


@pytest.mark.gpu
@requires_cuda
def test_gpu_many_heads_no_sync() -> None:
    """More heads than a CUDA grid's y/z axis allows (65535), launched sync-free."""
    case = Case(3, 70_000, 8, torch.bfloat16, torch.bfloat16, 30.0, 0.3, "strided", True, 1)
    state = case.make("cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = merge_state_triton(*state)
        twin = merge_state_torch(*state)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    want = merge_state_torch(*case.make("cpu"))  # float32 math on CPU as the oracle here
    assert_close_state(got, (want[0].double(), want[1].double()), torch.bfloat16)
    assert_close_state(twin, (want[0].double(), want[1].double()), torch.bfloat16)


# --------------------------------------------------------------------------- attention sinks
def brute_fold(
    v: torch.Tensor, s: torch.Tensor, sinks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64, from the definition: the state's keys plus one key of logit ``sinks[h]``
    (natural log) and value 0 per head; an empty state keeps only the sink."""
    s64 = s.double().cpu() * math.log(2.0)  # natural log
    sink = sinks.double().cpu()[None, :].expand_as(s64)
    total = torch.logaddexp(s64, sink)
    keep = torch.where(torch.isneginf(s64), 0.0, torch.exp(s64 - total))
    out = torch.where(keep[..., None] > 0, v.double().cpu() * keep[..., None], 0.0)
    return out, total / math.log(2.0)


def _sinks(case: Case, device: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(case.seed + 1)
    sinks = (torch.rand(case.heads, generator=gen) * 2 - 1) * case.lse_scale
    return sinks.float().to(device)


def check_sinks_case(case: Case, device: str) -> None:
    """merge(a, b) with sinks and fold(a) equal the float64 definition (and the torch
    twins), and fold(a) with sinks of -inf leaves the state as it was."""
    from flashplan.kernels.merge_state import fold_sinks_torch, fold_sinks_triton

    v_a, s_a, v_b, s_b = case.make(device)
    sinks = _sinks(case, device)
    v_m, s_m = brute_merge(v_a, s_a, v_b, s_b)
    want_v, want_s = brute_fold(v_m, s_m.float(), sinks)
    got_v, got_s = merge_state_triton(v_a, s_a, v_b, s_b, sinks=sinks)
    atol, rtol = V_TOL[case.dtype_a]
    torch.testing.assert_close(got_v.double().cpu(), want_v, atol=atol, rtol=rtol)
    torch.testing.assert_close(got_s.double().cpu(), want_s, atol=1e-4, rtol=1e-5)
    want_v, want_s = brute_fold(v_a, s_a, sinks)
    got_v, got_s = fold_sinks_triton(v_a, s_a, sinks)
    twin_v, twin_s = fold_sinks_torch(v_a, s_a, sinks)
    for v in (got_v, twin_v):
        torch.testing.assert_close(v.double().cpu(), want_v, atol=atol, rtol=rtol)
    for s in (got_s, twin_s):
        torch.testing.assert_close(s.double().cpu(), want_s, atol=1e-4, rtol=1e-5)
    if case.tokens:  # a sink of -inf is no sink: the state comes back unchanged
        none = torch.full_like(sinks, NEG_INF)
        got_v, got_s = fold_sinks_triton(v_a, s_a, none)
        seen = ~torch.isneginf(s_a)
        torch.testing.assert_close(got_s[seen], s_a[seen])
        torch.testing.assert_close(got_v[seen].float(), v_a[seen].float(), atol=atol, rtol=rtol)
        assert (got_v[~seen] == 0).all() and torch.isneginf(got_s[~seen]).all()


@requires_interpreter
@HYP
@given(cases())
def test_sinks_interpreted_match_brute_force(case: Case) -> None:
    check_sinks_case(case, "cpu")


def test_sink_argument_errors() -> None:
    from flashplan.kernels.merge_state import fold_sinks_triton

    v = torch.zeros((2, 3, 4))
    s = torch.zeros((2, 3))
    for bad in (torch.zeros(4), torch.zeros(3, dtype=torch.float64), torch.zeros(1, 3)):
        with pytest.raises(FlashplanError) as err:
            fold_sinks_triton(v, s, bad)
        assert err.value.field == "sinks"
        with pytest.raises(FlashplanError) as err:
            merge_state_triton(v, s, v, s, sinks=bad)
        assert err.value.field == "sinks"


@pytest.mark.gpu
@requires_cuda
@HYP
@given(cases(max_tokens=40, max_heads=9))
def test_gpu_sinks_match_brute_force(case: Case) -> None:
    check_sinks_case(case, "cuda")


def check_non_finite_sinks(device: str) -> None:
    """Issue 50, item 6: the Triton merge with sinks and fold (and the torch twin) give
    NaN outputs and LSE to heads whose sink logit is NaN or +inf, and leave a -inf
    head as without a sink."""
    from flashplan.kernels.merge_state import fold_sinks_torch, fold_sinks_triton

    gen = torch.Generator().manual_seed(3)
    v_a, v_b = (torch.randn(5, 4, 16, generator=gen).to(device) for _ in range(2))
    s_a, s_b = (torch.randn(5, 4, generator=gen).to(device) for _ in range(2))
    s_a[0] = NEG_INF  # a query with no key on one side
    sinks = torch.tensor([math.nan, math.inf, NEG_INF, 0.3], device=device)
    plain_v, plain_s = merge_state_triton(v_a, s_a, v_b, s_b)
    for v, s in (
        merge_state_triton(v_a, s_a, v_b, s_b, sinks=sinks),
        fold_sinks_triton(v_a, s_a, sinks),
        fold_sinks_torch(v_a, s_a, sinks),
    ):
        assert torch.isnan(v[:, :2]).all() and torch.isnan(s[:, :2]).all()
        assert torch.isfinite(v[:, 3]).all() and torch.isfinite(s[:, 3]).all()
    v, s = merge_state_triton(v_a, s_a, v_b, s_b, sinks=sinks)
    torch.testing.assert_close(v[:, 2], plain_v[:, 2])
    torch.testing.assert_close(s[:, 2], plain_s[:, 2])


@requires_interpreter
def test_non_finite_sinks_interpreted() -> None:
    check_non_finite_sinks("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_non_finite_sinks_gpu() -> None:
    check_non_finite_sinks("cuda")
