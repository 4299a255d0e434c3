"""Raw FlashInfer and sglang's way: what flashplan is compared with, built only from
FlashInfer's public API, torch and the plan's host arrays (``PlanSpec`` fields, the same
in every flashplan tree), never from the executor under test.

* **raw FlashInfer** ("bare ``plan()``"): a wrapper's ``plan()`` on inputs an engine would
  have ready: pinned host indptrs and last-page lengths, the page ids already gathered on
  the device, a mask packed ahead, multi-item tensors built ahead.
* **sglang's way** (its FlashInfer backend, ``../shared/reference/sglang_flashinfer_backend
  .py.txt``, "the reference file"): lengths on the device, a device ``cumsum`` of the page
  counts, its Triton gather ``create_flashinfer_kv_indices_triton`` of the page ids, then
  ``plan()`` with those *device* indptrs, which FlashInfer copies back to the host (a
  sync); a verify hands ``plan()`` the boolean tree mask (FlashInfer packs it on the
  device); multi-item scoring builds its tensors in a per-request loop
  (``_process_multi_item_scoring``); a CUDA graph's replay refreshes the graph wrapper's
  fixed buffers with the same cumsum and gather, then plans with host indptrs.

On the CPU (a smoke run over the twin) the Triton gather is replaced by torch indexing.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl
from _common import DT, ENV, HKV, HQ, PAGE, D, pinned

import flashplan as fp

#: The raw decode wrappers' ``plan()`` / ``fast_decode_plan`` arguments after the arrays.
_DECODE_SHAPE = (HQ, HKV, D, PAGE)
_DECODE_KW: dict[str, Any] = {"q_data_type": DT, "kv_data_type": DT, "non_blocking": True}


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


def ref_gather(
    pages: torch.Tensor,
    rows: torch.Tensor,
    npages: torch.Tensor,
    indptr: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """sglang's page-id gather: request ``i``'s first ``npages[i]`` ids of table row
    ``rows[i]`` at ``out[indptr[i]:]`` (Triton on CUDA; torch on the CPU)."""
    if pages.is_cuda:
        ref_kv_indices_kernel[(rows.shape[0],)](
            pages, rows, npages, indptr, out, pages.stride(0), BLOCK=512
        )
        return
    width = int(npages.max()) if npages.numel() else 0
    cols = torch.arange(width)
    keep = cols[None, :] < npages[:, None]
    flat = pages[rows.long(), :width][keep]
    out[: flat.shape[0]] = flat


def decode_inputs(
    spec: fp.PlanSpec, table: fp.PageTable
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode plan's bare ``plan()`` inputs, made with torch (untimed): pinned indptr,
    device page ids, pinned last-page lengths."""
    part = spec.group_plans[0].paged
    assert part is not None
    pages = table.pages.cpu()
    idx = torch.cat(
        [
            pages[int(r), int(s) : int(s) + int(n)]
            for r, s, n in zip(table.rows, part.start_page, part.num_pages, strict=True)
        ]
    )
    return pinned(part.page_indptr), idx.to(ENV.device), pinned(part.last_page_len)


def decode_wrapper(ws: torch.Tensor, tensor_cores: bool, **graph: Any) -> Any:
    """A raw decode wrapper (FA2 backend, as flashplan's decode wrappers)."""
    return ENV.fi.BatchDecodeWithPagedKVCacheWrapper(
        ws, "NHD", use_tensor_cores=tensor_cores, backend="fa2", **graph
    )


def bare_decode_plan(w: Any, indptr: torch.Tensor, idx: torch.Tensor, last: torch.Tensor) -> None:
    w.plan(indptr, idx, last, *_DECODE_SHAPE, **_DECODE_KW)


def tensor_cores(batch_size: int) -> bool:
    """flashplan's default decode kernel kind for a batch (the same rule in every tree)."""
    try:
        from flashplan.executor.flashinfer.policy import (
            ExecutorPolicy,
            decode_uses_tensor_cores,
        )
    except ImportError:  # pragma: no cover - a tree without it
        return batch_size >= 4
    return bool(decode_uses_tensor_cores(fp.HeadConfig(HQ, HKV, D), ExecutorPolicy(), batch_size))


class SglangDecode:
    """sglang's per-batch preparation of a decode wrapper (see the module docstring):
    ``fill`` (device cumsum + Triton gather into ``indices``), then ``plan_device``
    (``plan()`` with the device indptr: FlashInfer reads it back, a sync), ``plan_host``
    (``plan()`` with pinned host arrays) or ``plan_fast`` (``fast_decode_plan`` with the
    host indptr as ``global_override_indptr_cpu``: its CUDA-graph replay path)."""

    def __init__(self, wrapper: Any, table: fp.PageTable, indices: torch.Tensor) -> None:
        self.w, self.pages, self.indices = wrapper, table.pages, indices
        self.rows = torch.from_numpy(table.rows.astype(np.int32)).to(ENV.device)
        bs = table.rows.shape[0]
        self.indptr = torch.zeros(bs + 1, dtype=torch.int32, device=ENV.device)
        self.lens = torch.zeros(bs, dtype=torch.int32, device=ENV.device)
        self.lens_cpu = np.zeros(bs, dtype=np.int64)
        self.npages: torch.Tensor | None = None
        self.ring = [pinned(np.zeros(2 * bs + 1)) for _ in range(4)]
        self.turn = 0

    def set_lens(self, lens: np.ndarray, lens_dev: torch.Tensor | None = None) -> None:
        """The batch's sequence lengths (sglang holds them on the device already)."""
        self.lens_cpu = np.asarray(lens, dtype=np.int64)
        self.lens = (
            lens_dev
            if lens_dev is not None
            else torch.from_numpy(self.lens_cpu.astype(np.int32)).to(ENV.device)
        )

    def fill(self) -> None:
        npages = (self.lens + PAGE - 1) // PAGE
        self.indptr[1:] = torch.cumsum(npages, 0)
        ref_gather(self.pages, self.rows, npages, self.indptr, self.indices)
        self.npages = npages

    def last_page_len(self) -> torch.Tensor:
        assert self.npages is not None
        return self.lens - (self.npages - 1) * PAGE

    def plan_device(self) -> None:
        self.w.plan(
            self.indptr,
            self.indices,
            self.last_page_len(),
            *_DECODE_SHAPE,
            **_DECODE_KW,
        )

    def host_arrays(self) -> tuple[torch.Tensor, torch.Tensor]:
        buf = self.ring[self.turn]
        self.turn = (self.turn + 1) % len(self.ring)
        bs = self.lens_cpu.shape[0]
        host = buf.numpy()
        npages = (self.lens_cpu + PAGE - 1) // PAGE
        host[0] = 0
        np.cumsum(npages, out=host[1 : bs + 1])
        host[bs + 1 :] = self.lens_cpu - (npages - 1) * PAGE
        return buf[: bs + 1], buf[bs + 1 :]

    def plan_host(self) -> None:
        indptr, last = self.host_arrays()
        self.w.plan(
            indptr,
            self.indices,
            last,
            *_DECODE_SHAPE,
            **_DECODE_KW,
        )

    def plan_fast(self) -> None:
        indptr, last = self.host_arrays()
        ENV.fi.fast_decode_plan(
            self.w,
            indptr,
            self.indices,
            last,
            *_DECODE_SHAPE,
            **_DECODE_KW,
            global_override_indptr_cpu=indptr,
        )


class RawCapturedDecode:
    """Raw FlashInfer captured by hand, sglang's way: a graph-mode decode wrapper on fixed
    buffers; per step sglang's refresh (device cumsum + Triton gather straight into the
    fixed indices buffer), ``plan()`` with host indptrs (``fast``: ``fast_decode_plan``,
    sglang's own replay path), then ``graph.replay()``. On the CPU: no graph, the layers
    run eagerly."""

    def __init__(
        self,
        table: fp.PageTable,
        lens: np.ndarray,
        max_pages: int,
        tc: bool,
        ws: torch.Tensor,
        fast: bool = False,
    ) -> None:
        bs, dev = lens.shape[0], ENV.device
        self.fast = fast
        self.indptr_buf = torch.zeros(bs + 1, dtype=torch.int32, device=dev)
        self.indices_buf = torch.zeros(bs * max_pages, dtype=torch.int32, device=dev)
        self.last_buf = torch.ones(bs, dtype=torch.int32, device=dev)
        self.wrapper = decode_wrapper(
            ws,
            tc,
            use_cuda_graph=True,
            paged_kv_indptr_buffer=self.indptr_buf,
            paged_kv_indices_buffer=self.indices_buf,
            paged_kv_last_page_len_buffer=self.last_buf,
        )
        self.ref = SglangDecode(self.wrapper, table, self.indices_buf)
        self.ref.set_lens(lens)
        if fast:  # the refresh writes the fixed buffers themselves
            self.ref.indptr = self.indptr_buf
        self.graph: torch.cuda.CUDAGraph | None = None
        self.forward: Any = None
        self.out: torch.Tensor | None = None

    def plan(self) -> None:
        self.ref.fill()
        if self.fast:
            self.last_buf.copy_(self.ref.last_page_len())
            self.ref.plan_fast()
        else:
            self.ref.plan_host()

    def capture(self, q: torch.Tensor, cache: torch.Tensor, layers: int) -> None:
        self.ref.fill()
        self.ref.plan_host()  # the first plan is a full plan() (it loads the module)

        def forward() -> torch.Tensor:
            out = q
            for _ in range(layers):
                out = self.wrapper.run(q, cache)
            return out

        self.forward = forward
        if not ENV.cuda:
            return
        cur = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            forward()
        cur.wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = forward()

    def step(self) -> torch.Tensor:
        self.plan()
        if self.graph is None:
            return self.forward()
        self.graph.replay()
        assert self.out is not None
        return self.out


# -- verify --------------------------------------------------------------------------------
def mask_offsets(qo_lens: np.ndarray, kv_lens: np.ndarray) -> np.ndarray:
    """Byte offset of each request's packed mask where flashinfer 0.7.4's kernel reads it:
    the running sum of ``qo * kv`` (bits counted, added to a byte pointer: flashinfer PR
    #2201)."""
    sizes = np.multiply(qo_lens, kv_lens, dtype=np.int64)
    return np.concatenate([[0], np.cumsum(sizes)])


def bare_verify(spec: fp.PlanSpec, table: fp.PageTable, ws: torch.Tensor) -> tuple[Any, Any]:
    """FlashInfer's bare ``plan()`` of a verify plan's first group with every input
    prepared ahead: the packed mask at 0.7.4's offsets, pinned indptrs, gathered page ids.
    Returns ``(call, wrapper)``."""
    part = spec.group_plans[0].paged
    assert part is not None and part.mask is not None
    offsets = mask_offsets(part.mask.qo_lens, part.mask.kv_lens)
    packed = np.zeros(int(offsets[-1]) + 8, dtype=np.uint8)
    for i in range(spec.batch_size):
        bits = np.packbits(part.mask.dense(i).reshape(-1), bitorder="little")
        packed[int(offsets[i]) : int(offsets[i]) + bits.shape[0]] = bits
    mask_dev = torch.from_numpy(packed).to(ENV.device)
    qo, kv, last = pinned(spec.qo_indptr), pinned(part.page_indptr), pinned(part.last_page_len)
    _, idx, _ = decode_inputs(spec, table)
    raw = ENV.fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")

    def call() -> None:
        raw.plan(
            qo,
            kv,
            idx,
            last,
            HQ,
            HKV,
            D,
            PAGE,
            packed_custom_mask=mask_dev,
            causal=False,
            q_data_type=DT,
            kv_data_type=DT,
            non_blocking=True,
        )

    return call, raw


def sglang_verify(
    layout: fp.BatchLayout, spec: fp.PlanSpec, table: fp.PageTable, ws: torch.Tensor
) -> tuple[Any, Any]:
    """sglang's eager verify: device qo indptr, device cumsum of the page counts, its
    gather, and the draft's boolean tree mask (as its tree builder leaves it) handed to
    ``plan()``, which reads the indptrs back (a sync) and packs the mask on the device.
    ``(None, None)`` over the twin (it takes packed masks only)."""
    if ENV.twin:
        return None, None
    part = spec.group_plans[0].paged
    assert part is not None and part.mask is not None and layout.draft is not None
    bs, n, dev = spec.batch_size, layout.draft.num_tokens, ENV.device
    bool_mask = torch.from_numpy(
        np.concatenate([part.mask.dense(i).reshape(-1) for i in range(bs)])
    ).to(dev)
    seq_dev = torch.from_numpy(layout.seq_lens.astype(np.int32)).to(dev)
    rows_dev = torch.from_numpy(table.rows.astype(np.int32)).to(dev)
    wrapper = ENV.fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
    max_pages = int(part.num_pages.max())

    def call() -> None:
        qo = torch.arange(0, (bs + 1) * n, n, dtype=torch.int32, device=dev)
        pages = (seq_dev + PAGE - 1) // PAGE
        kv = torch.zeros(bs + 1, dtype=torch.int32, device=dev)
        kv[1:] = torch.cumsum(pages, 0)
        ids = torch.empty(bs * max_pages, dtype=torch.int32, device=dev)
        ref_gather(table.pages, rows_dev, pages, kv, ids)
        last_dev = seq_dev - (pages - 1) * PAGE
        wrapper.plan(
            qo,
            kv,
            ids,
            last_dev,
            HQ,
            HKV,
            D,
            PAGE,
            custom_mask=bool_mask,
            causal=False,
            q_data_type=DT,
            kv_data_type=DT,
        )

    return call, wrapper


# -- multi-item scoring --------------------------------------------------------------------
def sglang_multi_item(
    delims_cpu: list[torch.Tensor],
    prefix_lens_cpu: list[int],
    extend_lens_cpu: list[int],
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor] | None:
    """sglang's ``_process_multi_item_scoring``, with its algorithm and its per-request
    device operations (a ``.item()``, a host-to-device copy, ``arange``, ``searchsorted``,
    a gather, a cast and a positions write per request, a padding ``cat`` per request and
    a ``stack`` of per-request maxima): ``(prefix_len_ptr, token_pos_in_items_ptr,
    token_pos_in_items_len, max_item_len_ptr)``."""
    dev = ENV.device
    prefix_len_ptr: list[int] = []
    rows: list[torch.Tensor] = []
    seq_start = 0
    for i, ext in enumerate(extend_lens_cpu):
        seq_end = seq_start + ext
        idx_cpu = delims_cpu[i]
        if len(idx_cpu) == 0:
            seq_start = seq_end
            continue
        first = idx_cpu[0].item()
        idx = idx_cpu.to(dev, non_blocking=True)
        prefix_len = first + prefix_lens_cpu[i]
        prefix_len_ptr.append(prefix_len)
        suffix = ext - first
        rel = idx - first
        steps = torch.arange(suffix, dtype=torch.int64, device=dev)
        bucket = torch.searchsorted(rel, steps, right=True)
        last = rel[torch.clamp(bucket - 1, min=0)]
        in_item = steps - last
        rows.append(in_item.to(torch.uint16))
        positions[seq_start + first : seq_end] = prefix_len + in_item - 1
        seq_start = seq_end
    if not rows:
        return None
    width = max(t.numel() for t in rows)
    rows = [
        torch.cat([t, torch.zeros(width - t.numel(), dtype=torch.uint16, device=dev)]) for t in rows
    ]
    return (
        torch.tensor(prefix_len_ptr, dtype=torch.uint32, device=dev),
        torch.cat(rows, dim=0),
        width & 0xFFFFFFFF,
        torch.stack([t.to(torch.int32).max().to(torch.uint16) for t in rows], dim=0),
    )
