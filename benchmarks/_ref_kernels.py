"""The reference file's device kernels that the GPU benchmark scripts re-create (imported as
``_ref_kernels`` by the scripts in this folder, like ``_timing``)."""

from __future__ import annotations

import triton
import triton.language as tl


# The reference file's index kernel (sglang's create_flashinfer_kv_indices_triton, with
# kv_start_idx = 0): one program per request copies its row's first page ids.
@triton.jit
def ref_kv_indices_kernel(
    table_ptr, rows_ptr, npages_ptr, indptr_ptr, out_ptr, table_stride, BLOCK: tl.constexpr
):
    pid = tl.program_id(0)
    row = tl.load(rows_ptr + pid).to(tl.int64)
    n = tl.load(npages_ptr + pid)
    dst = tl.load(indptr_ptr + pid).to(tl.int64)
    for i in range(tl.cdiv(n, BLOCK)):
        k = i * BLOCK + tl.arange(0, BLOCK)
        m = k < n
        v = tl.load(table_ptr + row * table_stride + k, mask=m)
        tl.store(out_ptr + dst + k, v, mask=m)
