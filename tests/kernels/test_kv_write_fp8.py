"""The KV write into an fp8 cache on the GPU: the Triton kernel's stored bytes equal the
torch definition's (:func:`flashplan.fp8.quantize`) bit for bit — saturation, ``inf``,
NaN, number and tensor scales, both fp8 formats, fp16 and bf16 inputs — and nothing is
read back."""

from __future__ import annotations

import math

import pytest
import torch

from flashplan.fp8 import fp8_max
from flashplan.kernels import new_status, write_kv, write_kv_torch

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bytes, a NaN of either sign equal to a NaN."""
    both_nan = torch.isnan(a.float()) & torch.isnan(b.float())
    return bool(((a.view(torch.uint8) == b.view(torch.uint8)) | both_nan).all())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("in_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tensor_scales", [False, True])
def test_triton_fp8_write_equals_the_definition(
    dtype: torch.dtype, in_dtype: torch.dtype, tensor_scales: bool
) -> None:
    gen = torch.Generator().manual_seed(11)
    rows, heads, dim, pool, ps = 37, 4, 128, 9, 16
    top = fp8_max(dtype)
    k = torch.randn(rows, heads, dim, generator=gen) * top / 4
    v = torch.randn(rows, heads, dim, generator=gen) * 3
    k[0, 0, :4] = torch.tensor([math.inf, -math.inf, math.nan, 10 * top])  # edge values
    k, v = k.to(in_dtype), v.to(in_dtype)
    page = torch.randint(0, pool + 2, (rows,), generator=gen, dtype=torch.int32)  # some outside
    offset = torch.randint(-1, ps, (rows,), generator=gen, dtype=torch.int32)  # some skipped
    ks, vs = 0.37, 1.9
    want = torch.zeros(pool, 2, ps, heads, dim, dtype=dtype)
    # unique slots per row, so the brute force order does not matter
    slot_ids = page.long() * ps + offset.long()
    keep = torch.ones(rows, dtype=torch.bool)
    seen: set[int] = set()
    for i, s in enumerate(slot_ids.tolist()):
        keep[i] = s not in seen
        seen.add(s)
    k, v, page, offset = k[keep], v[keep], page[keep], offset[keep]
    status_cpu = new_status("cpu")
    write_kv_torch(want, k, v, page, offset, status=status_cpu, k_scale=ks, v_scale=vs)
    dev = torch.device("cuda")
    got = torch.zeros(want.shape, dtype=torch.uint8, device=dev).view(dtype)
    status = new_status(dev)
    scales = (
        (torch.tensor(ks, device=dev), torch.tensor(vs, device=dev)) if tensor_scales else (ks, vs)
    )
    k_d, v_d, page_d, offset_d = (t.to(dev) for t in (k, v, page, offset))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        write_kv(
            got, k_d, v_d, page_d, offset_d, status=status, k_scale=scales[0], v_scale=scales[1]
        )
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert _same_bytes(got.cpu(), want)
    assert int(status[0]) == int(status_cpu[0])
