"""Re-planning a paged prefill wrapper without FlashInfer's ``plan()`` overhead.

FlashInfer's paged prefill ``plan()`` does three things: it checks and canonicalizes its
arguments, derives host metadata (KV lengths, a custom mask's indptr, the longest query
and KV) with a handful of small CPU tensor ops and copies several arrays to the device,
and runs its compiled scheduler (``_cached_module.plan``). flashplan has already
computed that metadata on the host and staged every array on the device (one copy for
the whole batch), and it fixes every compiled-in argument in the plan, so a wrapper
whose last full ``plan()`` had the same constant arguments needs only the scheduler run
again and its fields pointed at the staged arrays. FlashInfer exports no such entry
point for prefill (it does for decode: ``fast_decode_plan``); the reference file writes
its own (``fast_prefill_plan``, CUDA graphs only). :func:`replan_prefill` is flashplan's,
for eager wrappers.

It sets exactly the fields flashinfer 0.7.4's ``plan()`` sets on that path (eager, FA2,
FlashInfer's own module, fp16 / bf16 KV) and calls the scheduler with the same
arguments, so it depends on that version's private fields. Hence:

* **a known FlashInfer only:** :data:`FAST_PREFILL_VERSIONS`, each checked by the GPU
  test ``test_fast_prefill_plan_equals_plan``, which compares, batch after batch (plain,
  windowed, soft-capped and bidirectional extends, multi-item, verify with a tree mask;
  pages 1 and 16), every field of a wrapper re-planned here with one planned by
  ``plan()``, and their outputs bit for bit;
* **the same compiled module:** the wrapper's last full ``plan()`` had the same constant
  arguments (:attr:`WrapperSlot.planned_with`); the first plan of a wrapper, or any with
  other constants, goes through ``plan()``;
* **the path it re-creates:** :func:`replannable` (eager, FA2, no JIT variant, no
  per-token scales, fp16 / bf16 q and KV), checked after each full ``plan()`` and kept
  with the wrapper (:attr:`WrapperSlot.replannable`). Anything else goes through
  ``plan()``.

It issues no sync and no pageable copy: the scheduler reads pinned host arrays, the
kernels read the staged device arrays (valid until the next ``apply`` rewrites the
staging buffer, like the multi-item views), the KV lengths field included (FlashInfer
copies them into a buffer of its own that its FA2 kernels never read; the wrapper gets
that buffer back before any full ``plan()``: :func:`restore_own_buffers`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from flashplan.executor.flashinfer.buffers import WrapperSlot

__all__ = [
    "FAST_PREFILL_VERSIONS",
    "PrefillArrays",
    "fast_prefill_available",
    "replan_prefill",
    "restore_own_buffers",
]

#: flashinfer-python versions whose paged prefill ``plan()`` :func:`replan_prefill`
#: re-creates (the GPU test ``test_fast_prefill_plan_equals_plan`` checks it).
FAST_PREFILL_VERSIONS = ("0.7.4",)

_HALF_DTYPES = (torch.float16, torch.bfloat16)


def fast_prefill_available(fi: Any) -> bool:
    """Whether the imported flashinfer module ``fi`` is a version :func:`replan_prefill`
    was checked against."""
    return str(getattr(fi, "__version__", "")).split("+")[0] in FAST_PREFILL_VERSIONS


def replannable(wrapper: Any, kwargs: dict[str, Any]) -> bool:
    """Whether ``wrapper``'s last ``plan()`` took the path :func:`replan_prefill`
    re-creates: an eager FA2 wrapper running FlashInfer's own compiled module, without
    per-token scales, with fp16 / bf16 queries and KV."""
    return (
        not wrapper.is_cuda_graph_enabled
        and getattr(wrapper, "_backend", None) == "fa2"
        and getattr(wrapper, "_jit_module", None) is None
        and getattr(wrapper, "_cached_module", None) is not None
        and not getattr(wrapper, "_use_token_head_sf", True)
        and kwargs.get("q_data_type") in _HALF_DTYPES
        and kwargs.get("kv_data_type") in _HALF_DTYPES
    )


def restore_own_buffers(slot: WrapperSlot) -> None:
    """Give ``slot``'s wrapper back the buffers a re-plan pointed elsewhere (its own KV
    lengths buffer: :func:`replan_prefill` aims the field at the staging buffer, which a
    full ``plan()`` must not write into). Call it before every full ``plan()``."""
    own = slot.fixed.pop("kv_lens", None)
    if own is not None:
        slot.wrapper._kv_lens_buffer = own


class PrefillArrays(NamedTuple):
    """The arrays of one paged prefill ``plan()`` call, on both sides of the staging copy.

    Host tensors are pinned views of the staging slot (what the scheduler reads); device
    tensors are views of its device copy (what the kernels read).

    Attributes:
        qo_indptr_host, qo_indptr_device: int32 ``[bs + 1]`` (tokens).
        page_indptr_host, page_indptr_device: int32 ``[bs + 1]`` (pages).
        last_page_len_device: int32 ``[bs]`` (tokens).
        kv_lens_host, kv_lens_device: int32 ``[bs]`` (tokens): FlashInfer's KV lengths,
            ``max(pages - 1, 0) * page_size + last_page_len``.
        indices: int32 ``[page_indptr[-1]]`` (page ids), gathered on the device.
        mask_indptr_device: int32 ``[bs + 1]``, FlashInfer's ``mask_indptr`` of a call
            with a custom mask (``None`` without one).
        total_rows: ``qo_indptr[-1]`` (tokens).
        max_q_len, max_kv_len: the longest query and KV of the batch (tokens).
    """

    qo_indptr_host: torch.Tensor
    qo_indptr_device: torch.Tensor
    page_indptr_host: torch.Tensor
    page_indptr_device: torch.Tensor
    last_page_len_device: torch.Tensor
    kv_lens_host: torch.Tensor
    kv_lens_device: torch.Tensor
    indices: torch.Tensor
    mask_indptr_device: torch.Tensor | None
    total_rows: int
    max_q_len: int
    max_kv_len: int


def replan_prefill(slot: WrapperSlot, kwargs: dict[str, Any], arrays: PrefillArrays) -> None:
    """Re-plan ``slot``'s paged prefill wrapper (see module doc).

    The caller guarantees the conditions above: ``fast_prefill_available(fi)``,
    ``replannable(wrapper, kwargs)``, and ``slot.planned_with`` equal to the call's
    constants (so the compiled module, heads, page size, causal flag, window, soft cap,
    scale and split options are those of the wrapper's last ``plan()``, which set every
    field that depends only on them).

    Args:
        slot: the wrapper.
        kwargs: the call's ``plan()`` keyword arguments (placeholders resolved).
        arrays: the batch's arrays (:class:`PrefillArrays`).
    """
    w = slot.wrapper
    bs = int(arrays.kv_lens_host.shape[0])
    w._batch_size = bs
    w._num_qo_heads = kwargs["num_qo_heads"]
    w._num_kv_heads = kwargs["num_kv_heads"]
    w._eagle_verify_fp8kv_sm90_state = None
    w._prefix_len_ptr = kwargs.get("prefix_len_ptr")
    w._token_pos_in_items_ptr = kwargs.get("token_pos_in_items_ptr")
    w._token_pos_in_items_len = kwargs.get("token_pos_in_items_len", 0)
    w._max_item_len_ptr = kwargs.get("max_item_len_ptr")
    w._qo_indptr_last = arrays.total_rows
    w._max_q_len = arrays.max_q_len
    w._max_kv_len = arrays.max_kv_len
    w._cudnn_paged_bounds = None
    # plan() copies the KV lengths into the wrapper's own buffer, which the FA2 kernels
    # never read: the re-plan points the field at the staged copy instead (no copy) and
    # keeps the wrapper's own buffer, which restore_own_buffers() puts back before a
    # full plan() writes into the field.
    slot.fixed.setdefault("kv_lens", w._kv_lens_buffer)
    w._kv_lens_buffer = arrays.kv_lens_device
    w._qo_indptr_buf = arrays.qo_indptr_device
    w._paged_kv_indptr_buf = arrays.page_indptr_device
    w._paged_kv_last_page_len_buf = arrays.last_page_len_device
    w._paged_kv_indices_buf = arrays.indices
    mask = kwargs.get("packed_custom_mask")
    w._custom_mask_buf = mask
    w._mask_indptr_buf = arrays.mask_indptr_device if mask is not None else None
    w._block_tables = None
    head_dim = kwargs["head_dim_qk"]
    fixed_split = kwargs.get("fixed_split_size")
    w._plan_info = w._cached_module.plan(
        w._float_workspace_buffer,
        w._int_workspace_buffer,
        w._pin_memory_int_workspace_buffer,
        arrays.qo_indptr_host,
        arrays.page_indptr_host,
        arrays.kv_lens_host,
        w._max_total_num_rows or arrays.total_rows,
        bs,
        kwargs["num_qo_heads"],
        kwargs["num_kv_heads"],
        kwargs["page_size"],
        False,  # is_cuda_graph_enabled (eager wrappers only)
        head_dim,
        kwargs.get("head_dim_vo") or head_dim,
        kwargs.get("causal", False),
        kwargs.get("window_left", -1),
        fixed_split if fixed_split else -1,
        bool(kwargs.get("disable_split_kv", False)),
        0,  # num_colocated_ctas
        0,  # uniform_q_len: no promise (only graph plans read it)
        False,  # fixed_uniform_q_len
    )
    w._seq_lens_kv = None
    w._seq_lens_q = None
