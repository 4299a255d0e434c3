"""The speculative KV moves (``flashplan.draft_kv``) on the GPU: equal to the same moves
on the CPU, and sync-free (``set_sync_debug_mode("error")``)."""

from __future__ import annotations

import numpy as np
import torch

import flashplan as fp

from .helpers import syncs_raise


def _table(bs: int, width: int, pool: int, seed: int) -> fp.PageTable:
    rng = np.random.default_rng(seed)
    ids = rng.permutation(np.arange(1, pool))[: (bs + 1) * width].reshape(bs + 1, width)
    rows = rng.permutation(bs + 1)[:bs].astype(np.int32)
    return fp.PageTable(torch.from_numpy(ids.astype(np.int32)), rows, pool)


def test_moves_on_the_gpu_equal_the_cpu_and_never_sync() -> None:
    bs, ps, pool = 8, 16, 256
    cpu = _table(bs, 8, pool, 0)
    gpu = fp.PageTable(cpu.pages.cuda(), cpu.rows, cpu.num_pages)
    gen = torch.Generator().manual_seed(1)
    caches = [torch.randn(pool, 2, ps, 2, 64, generator=gen) for _ in range(3)]
    on_gpu = [c.cuda() for c in caches]
    tree = fp.DraftTree.eagle(bs, 2, 3)
    rng = np.random.default_rng(2)
    prefix = rng.integers(1, 60, bs)
    paths = [[0, 4, 5, 6] if i % 2 else [0, 1, 2] for i in range(bs)]
    own = torch.arange(200, 200 + bs * 2 * 2, dtype=torch.int32).reshape(bs, 2, 2)
    fp.compact_accepted(caches, cpu, prefix, tree, paths, page_size=ps)
    fp.copy_prefix_pages(caches, cpu, prefix, own, page_size=ps)
    own_gpu = own.cuda()  # the upload is the test's, not the move's: outside the check
    with syncs_raise():  # (which waits for the GPU first)
        fp.compact_accepted(on_gpu, gpu, prefix, tree, paths, page_size=ps)
        fp.copy_prefix_pages(on_gpu, gpu, prefix, own_gpu, page_size=ps)
    for want, got in zip(caches, on_gpu, strict=True):
        assert torch.equal(got.cpu(), want)
