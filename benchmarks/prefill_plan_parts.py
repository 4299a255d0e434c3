"""Where FlashInfer's paged prefill ``plan()`` spends its host time (H200, a diagnostic).

For the multi-item benchmark batch (256 x (512-token prompt + 32 items), page 1) and the
verify benchmark batch (64 x 64-token trees over 4096, page 16), the median host time of

* ``plan()`` on ready pinned indptrs and device page ids (and the batch's multi-item
  tensors or a mask buffer),
* its compiled scheduler alone (``wrapper._cached_module.plan`` with the arguments
  ``plan()`` passes it in flashinfer 0.7.4 — private; checked to give the same plan info),
* one pageable host-to-device copy of a batch-sized int32 array (``plan()`` makes one or
  two of those),

which is what a re-plan without ``plan()`` (``flashplan.executor.flashinfer.adapter``)
can save. Run from the repository root on the GPU machine::

    python3 benchmarks/prefill_plan_parts.py
"""

from __future__ import annotations

import os
import sys
from typing import Any

sys.argv = [sys.argv[0], "--out", os.environ.get("OUT", "/tmp")]  # bench_multi_item's parser
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench_multi_item as B  # noqa: E402  (the scoring batch)
import flashinfer  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from _timing import host_us, pinned  # noqa: E402  (median host time, GPU idle before each call)

import flashplan as fp  # noqa: E402
from flashplan.executor.flashinfer.calls import flashinfer_mask_offsets  # noqa: E402

DEV = "cuda"
HEADS = fp.HeadConfig(32, 8, 128, q_dtype=torch.bfloat16)


def to_device(values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A uint32 / uint16 host array as a device tensor of that dtype (same bytes)."""
    words = np.ascontiguousarray(values).view(np.int32 if dtype == torch.uint32 else np.int16)
    return torch.from_numpy(words.copy()).to(DEV).view(dtype)


def report(title: str, spec: fp.PlanSpec, extra: dict[str, Any], causal: bool) -> None:
    part = spec.group_plans[0].paged
    assert part is not None
    ps, bs = spec.page_size, spec.batch_size
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=DEV)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2")
    qo, kv = pinned(spec.qo_indptr), pinned(part.page_indptr)
    last, kv_lens = pinned(part.last_page_len), pinned(part.kv_lens)
    ids = torch.arange(part.total_pages, dtype=torch.int32, device=DEV)
    hq, hkv, d = HEADS.num_qo_heads, HEADS.num_kv_heads, HEADS.head_dim

    def plan() -> None:
        wrapper.plan(
            qo, kv, ids, last, hq, hkv, d, ps, causal=causal, q_data_type=torch.bfloat16,
            non_blocking=True, **extra,
        )  # fmt: skip

    t_plan = host_us(plan, n=60)
    # flashinfer 0.7.4's arguments of the eager FA2 scheduler (prefill.py, plan())
    args = [
        wrapper._float_workspace_buffer, wrapper._int_workspace_buffer,
        wrapper._pin_memory_int_workspace_buffer, qo, kv, kv_lens, spec.total_q, bs, hq, hkv,
        ps, False, d, d, causal, -1, -1, False, 0, 0, False,
    ]  # fmt: skip
    t_scheduler = host_us(lambda: wrapper._cached_module.plan(*args), n=60)
    same = list(wrapper._cached_module.plan(*args)) == list(wrapper._plan_info)
    pageable = torch.from_numpy(np.array(part.kv_lens, dtype=np.int32))
    dst = torch.empty(bs, dtype=torch.int32, device=DEV)
    t_copy = host_us(lambda: dst.copy_(pageable, non_blocking=True), n=60)
    print(
        f"{title}: plan() {t_plan:.1f} us | compiled scheduler alone {t_scheduler:.1f} us "
        f"(same plan info: {same}) | one pageable H2D copy {t_copy:.1f} us"
    )


def main() -> None:
    rng = np.random.default_rng(0)
    ext, delims, _ = B.scoring_batch(rng, 256)
    spec = fp.plan(fp.BatchLayout.extend(ext, item_delimiters=delims), HEADS)
    items = spec.group_plans[0].items
    assert items is not None
    extra = {
        "prefix_len_ptr": to_device(items.prefix_len_ptr, torch.uint32),
        "token_pos_in_items_ptr": to_device(items.token_pos_in_items, torch.uint16),
        "token_pos_in_items_len": items.token_pos_in_items_len,
        "max_item_len_ptr": to_device(items.max_item_len, torch.uint16),
    }
    report("multi-item 256 x (512 + 32 items), page 1", spec, extra, True)

    bs, n = 64, 64
    parents = np.full((bs, n), -1, dtype=np.int64)
    for j in range(1, n):
        parents[:, j] = rng.integers(max(0, j - 8), j, bs)
    tree = fp.DraftTree.from_parents(parents)
    vspec = fp.plan(fp.BatchLayout.verify([4096] * bs, tree, page_size=16), HEADS)
    paged = vspec.group_plans[0].paged
    assert paged is not None and paged.mask is not None
    offsets = flashinfer_mask_offsets(paged.mask.qo_lens, paged.mask.kv_lens)
    mask = torch.zeros(int(offsets[-1]) + 8, dtype=torch.uint8, device=DEV)
    report("verify 64 x 64 over 4096, page 16", vspec, {"packed_custom_mask": mask}, False)


if __name__ == "__main__":
    main()
