"""The arrays one re-plan takes (:mod:`~flashplan.executor.flashinfer.adapter`'s
``replan_decode`` and ``replan_prefill``): views of a batch's staged arrays on both
sides of the staging copy, pinned host views (what FlashInfer's scheduler reads) and
device views (what its kernels read). Plain records: no FlashInfer API here."""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["DecodeArrays", "PrefillArrays"]


class DecodeArrays(NamedTuple):
    """The arrays of one decode ``plan()`` call, on both sides of the staging copy.

    Attributes:
        indptr_host, indptr_device: int32 ``[bs + 1]`` page indptr (pages), pinned and on device.
        last_page_len_host, last_page_len_device: int32 ``[bs]`` (tokens), likewise.
        qo_indptr_host, qo_indptr_device, kv_lens_host: a tensor-core decode's int32
            ``[bs + 1]`` ``0, 1, …, bs`` and ``[bs]`` scheduler KV lengths (tokens:
            ``calls.decode_scheduler_kv_lens``); ``None`` otherwise.
        indices: int32 ``[indptr[-1]]`` (page ids) on the device (gathered).
    """

    indptr_host: torch.Tensor
    indptr_device: torch.Tensor
    last_page_len_host: torch.Tensor
    last_page_len_device: torch.Tensor
    qo_indptr_host: torch.Tensor | None
    qo_indptr_device: torch.Tensor | None
    kv_lens_host: torch.Tensor | None
    indices: torch.Tensor


class PrefillArrays(NamedTuple):
    """The arrays of one paged prefill ``plan()`` call: pinned views of the staging slot
    (host: what the scheduler reads) and of its device copy (what the kernels read).

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
