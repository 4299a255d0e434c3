"""FlashInfer's wrapper API, computed in torch: a CPU twin of the part of ``flashinfer``
(0.7.x) that flashplan's executor calls, so that CI runs the executor without a GPU.

:data:`flashinfer_twin` stands where the imported module would: the decode, paged and
ragged prefill wrappers (with their CUDA-graph variants), the two attention-sink
wrappers, ``fast_decode_plan``, ``merge_state`` and ``xqa`` (:mod:`~flashplan.twin.xqa`),
with 0.7.4's constructor and
``plan()`` keywords. Keywords that change nothing computed (``non_blocking``,
``disable_split_kv``, …) are taken; features flashplan does not use (RoPE, unpacked
masks, HND, several queries per decode request) and unknown keywords raise
:class:`~flashplan.errors.UnsupportedError`. ``run()`` computes the attention
FlashInfer documents (:mod:`~flashplan.twin.attention` states the
rules), request by request: a test double that computes, not a mock. As FlashInfer:

* ``plan()`` copies the index pointers and last-page lengths (its host scheduler reads
  them then) and keeps page ids, packed mask and multi-item tensors as given
  (``.to(device)``: its kernels read them at run time); a run uses the latest plan.
* A CUDA-graph wrapper's ``plan()`` copies every array into the fixed buffers given at
  construction and ``run()`` reads them there (``fast_decode_plan`` copies nothing), so
  a stale buffer shows; its batch size is fixed, query rows past the plan's are NaN.
* Request ``i``'s mask bits start at byte ``sum_{r<i} qo_r * kv_r`` (0.7.4 counts bits
  and adds them to a byte pointer, flashinfer PR #2201).

What FlashInfer would misread silently raises a flashplan error instead: page ids
outside the cache, a last-page length above the page size, mask bytes past the buffer,
a ``max_item_len`` that makes the kernel skip keys, shapes or dtypes unlike the plan's,
and a sink wrapper planned with what its kernel ignores (soft cap, mask, items, another
output dtype).
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

import torch

from flashplan.errors import BucketError, FlashplanError, PlanMismatchError, UnsupportedError
from flashplan.torch_kernels import merge_state_torch
from flashplan.twin.attention import (
    Arrays,
    KeySource,
    KVCache,
    Logits,
    Params,
    mask_indptr,
    paged_keys,
    paged_kv_lens,
    ragged_keys,
    run_batch,
)
from flashplan.twin.xqa import xqa

__all__ = [
    "BatchAttentionWithAttentionSinkWrapper",
    "BatchDecodeWithAttentionSinkWrapper",
    "BatchDecodeWithPagedKVCacheWrapper",
    "BatchPrefillWithPagedKVCacheWrapper",
    "BatchPrefillWithRaggedKVCacheWrapper",
    "fast_decode_plan",
    "flashinfer_twin",
    "merge_state",
]

#: The FlashInfer version whose API the twin follows (local suffix ``+twin``).
__version__ = "0.7.4+twin"

Tensor = torch.Tensor
DType = str | torch.dtype | None

#: FlashInfer keywords that change nothing the twin computes (any value is accepted).
_INERT = frozenset({
    "backend", "disable_split_kv", "fixed_split_size", "global_override_indptr_cpu",
    "non_blocking", "rope_scale", "rope_theta", "use_fp16_qk_reduction",
})  # fmt: skip
#: FlashInfer keywords the twin computes at their default only (the ragged kernel
#: ignores the multi-item tensors: refused rather than ignored).
_DEFAULTS: Mapping[str, Any] = {
    "pos_encoding_mode": "NONE", "q_len_per_req": 1, "custom_mask": None, "data_type": None,
    "jit_args": None, "jit_kwargs": None, "prefix_len_ptr": None,
    "token_pos_in_items_ptr": None, "token_pos_in_items_len": 0, "max_item_len_ptr": None,
}  # fmt: skip


def _options(where: str, options: Mapping[str, Any]) -> None:
    """Check the keywords of ``where`` (a FlashInfer call) that the twin takes without
    computing them: inert ones, or others at FlashInfer's default.

    Raises:
        UnsupportedError: a keyword the twin does not know, or a feature it does not
            compute.
    """
    for name, value in options.items():
        if name in _INERT:
            continue
        if name not in _DEFAULTS:
            raise UnsupportedError(name, f"not a keyword the twin's {where} takes", value=value)
        default = _DEFAULTS[name]
        if value is not default and (default is None or value != default):
            raise UnsupportedError(name, "not computed by the FlashInfer twin", value=value)


def _dtypes(q: DType, kv: DType, o: DType) -> dict[str, torch.dtype]:
    """A plan's ``q_dtype``, ``kv_dtype`` and ``o_dtype`` (dtypes or their names; the KV
    and output dtypes default to the query's, the query's to float16)."""

    def as_dtype(value: DType, default: torch.dtype) -> torch.dtype:
        out = getattr(torch, value, None) if isinstance(value, str) else value
        out = default if value is None else out
        if not isinstance(out, torch.dtype):
            raise FlashplanError("data_type", "not a torch dtype or its name", value=value)
        return out

    q_dtype = as_dtype(q, torch.float16)
    return {"q_dtype": q_dtype, "kv_dtype": as_dtype(kv, q_dtype), "o_dtype": as_dtype(o, q_dtype)}


def _buffers(**given: Tensor | None) -> list[Tensor]:
    """A CUDA-graph wrapper's fixed buffers, in order (each must be a tensor)."""
    for name, t in given.items():
        if not isinstance(t, torch.Tensor):
            raise FlashplanError(name, "must be a tensor in CUDA-graph mode", value=t)
    return [t for t in given.values() if t is not None]


def _taken(t: Tensor, device: torch.device) -> Tensor:
    """An array FlashInfer's host scheduler reads at plan time: copied then."""
    return t.to(device, copy=True)


class _TwinWrapper:
    """What every twin wrapper shares: the workspace's device, the fixed buffers of a
    CUDA-graph wrapper, the stored plan and the run."""

    def __init__(self, workspace: Tensor, kv_layout: str, options: Mapping[str, Any]) -> None:
        _options(f"{type(self).__name__}()", options)
        if kv_layout != "NHD":
            raise UnsupportedError("kv_layout", "the twin reads NHD caches only", value=kv_layout)
        self.device = workspace.device
        self._fixed: Arrays | None = None
        self._params: Params | None = None
        self._arrays: Arrays | None = None

    @property
    def is_cuda_graph_enabled(self) -> bool:
        """Whether the wrapper runs over fixed buffers (``use_cuda_graph=True``)."""
        return self._fixed is not None

    def _check_plan(self, params: Params, arrays: Arrays) -> None:
        """A wrapper's own refusals of a plan (the sink wrappers')."""

    def _store(self, params: Params, arrays: Arrays, *, copy: bool = True) -> None:
        """Keep a plan. A CUDA-graph wrapper copies the arrays into its fixed buffers
        (not with ``copy`` off: ``fast_decode_plan``, whose caller wrote them) and runs
        over the buffers."""
        self._check_plan(params, arrays)
        if self._fixed is not None:
            arrays.copy_into(self._fixed, copy=copy)
            arrays = self._fixed
        self._params, self._arrays = params, arrays

    def _run(
        self, q: Tensor, keys: KeySource, *, q_scale: float | None = None,
        k_scale: float | None = None, v_scale: float | None = None, out: Tensor | None = None,
        lse: Tensor | None = None, return_lse: bool = False, window_left: int | None = None,
        sm_scale: float | None = None, sinks: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:  # fmt: skip
        """The planned attention of ``q`` over ``keys``: ``out`` (written into the given
        one), and with ``return_lse`` also ``lse``. ``q_scale`` and ``k_scale`` multiply
        the softmax scale, ``v_scale`` the output; ``window_left`` must be the plan's;
        ``sm_scale`` replaces the plan's and ``sinks`` (float ``[num_qo_heads]``) add
        the sink term (the sink wrappers' run)."""
        if self._params is None or self._arrays is None:
            raise PlanMismatchError("plan", "run() before plan()")
        params, arrays = self._params, self._arrays
        if window_left is not None and window_left != params.window_left:
            raise PlanMismatchError(
                "window_left", "must be the plan's", value=window_left, planned=params.window_left
            )
        scale = params.sm_scale if sm_scale is None else float(sm_scale)
        for factor in (q_scale, k_scale):
            scale *= 1.0 if factor is None else float(factor)
        o, s = run_batch(
            q, params, arrays, keys, Logits(scale, params.soft_cap), sinks=sinks,
            v_scale=None if v_scale is None else float(v_scale),
            exact_rows=self._fixed is None or arrays.qo_indptr is None,
        )  # fmt: skip
        for name, given, made in (("out", out, o), ("lse", lse, s)):
            if given is not None and (given.shape != made.shape or given.dtype != made.dtype):
                raise PlanMismatchError(
                    name, "shape or dtype unlike the run's", shape=tuple(given.shape),
                    dtype=given.dtype, expected=(tuple(made.shape), made.dtype),
                )  # fmt: skip
        o = o if out is None else out.copy_(o)
        if not return_lse:
            return o
        return o, (s if lse is None else lse.copy_(s))

    def run(self, q: Tensor, paged_kv_cache: KVCache, **kwargs: Any) -> Any:
        """Attention of ``q`` (decode: ``[batch_size, num_qo_heads, head_dim]``; paged
        prefill: ``[qo_indptr[-1], …]``) over the planned pages of ``paged_kv_cache``
        (NHD ``[pages, 2, page_size, num_kv_heads, head_dim]`` or a ``(k, v)`` tuple of
        ``[pages, page_size, num_kv_heads, head_dim]``); keywords ``q_scale``,
        ``k_scale``, ``v_scale``, ``out``, ``lse``, ``return_lse``, ``window_left``."""
        return self._run(q, paged_keys(paged_kv_cache), **kwargs)


class BatchDecodeWithPagedKVCacheWrapper(_TwinWrapper):
    """FlashInfer's decode wrapper: one query per request over its pages."""

    def __init__(
        self, float_workspace_buffer: Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
        use_tensor_cores: bool = False, paged_kv_indptr_buffer: Tensor | None = None,
        paged_kv_indices_buffer: Tensor | None = None,
        paged_kv_last_page_len_buffer: Tensor | None = None, **options: Any,
    ) -> None:  # fmt: skip
        super().__init__(float_workspace_buffer, kv_layout, options)
        self.use_tensor_cores = bool(use_tensor_cores)  # the same attention either way
        if use_cuda_graph:
            indptr, indices, last = _buffers(
                paged_kv_indptr_buffer=paged_kv_indptr_buffer,
                paged_kv_indices_buffer=paged_kv_indices_buffer,
                paged_kv_last_page_len_buffer=paged_kv_last_page_len_buffer,
            )
            self._fixed = Arrays(None, indptr, indices, last)

    def plan(
        self, indptr: Tensor, indices: Tensor, last_page_len: Tensor, num_qo_heads: int,
        num_kv_heads: int, head_dim: int, page_size: int, *, window_left: int = -1,
        logits_soft_cap: float | None = None, q_data_type: DType = "float16",
        kv_data_type: DType = None, o_data_type: DType = None, sm_scale: float | None = None,
        **options: Any,
    ) -> None:  # fmt: skip
        """Plan a decode batch: request ``i`` reads pages ``indices[indptr[i]:indptr[i+1]]``
        (int32), the last one holding ``last_page_len[i]`` tokens."""
        _options("decode plan()", options)
        params = Params.make(
            num_qo_heads, num_kv_heads, head_dim, page_size=page_size, causal=False,
            window_left=window_left, soft_cap=logits_soft_cap, sm_scale=sm_scale,
            **_dtypes(q_data_type, kv_data_type, o_data_type),
        )  # fmt: skip
        dev = self.device
        self._store(
            params, Arrays(None, _taken(indptr, dev), indices.to(dev), _taken(last_page_len, dev))
        )


def fast_decode_plan(
    self: BatchDecodeWithPagedKVCacheWrapper, indptr: Tensor, indices: Tensor,
    last_page_len: Tensor, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int, *,
    window_left: int = -1, logits_soft_cap: float | None = None, q_data_type: DType = None,
    kv_data_type: DType = None, sm_scale: float | None = None, **options: Any,
) -> None:  # fmt: skip
    """FlashInfer's ``fast_decode_plan``: re-plan decode wrapper ``self`` after a full
    ``plan()``, whose compiled dtypes and output dtype stay. It copies nothing: a
    CUDA-graph wrapper's run reads its fixed buffers, which the caller must have
    refreshed; an eager wrapper's reads these very tensors.

    Raises:
        PlanMismatchError: no decode wrapper planned before, or other dtypes.
    """
    _options("fast_decode_plan()", options)
    if not isinstance(self, BatchDecodeWithPagedKVCacheWrapper) or self._params is None:
        raise PlanMismatchError("plan", "fast_decode_plan needs a decode wrapper planned once")
    old = self._params
    dtypes = _dtypes(q_data_type, kv_data_type, old.o_dtype)
    if (dtypes["q_dtype"], dtypes["kv_dtype"]) != (old.q_dtype, old.kv_dtype):
        raise PlanMismatchError(
            "q_data_type", "fast_decode_plan reuses the kernel plan() compiled",
            dtypes=tuple(dtypes.values()), planned=(old.q_dtype, old.kv_dtype),
        )  # fmt: skip
    params = Params.make(
        num_qo_heads, num_kv_heads, head_dim, page_size=page_size, causal=False,
        window_left=window_left, soft_cap=logits_soft_cap, sm_scale=sm_scale, **dtypes,
    )  # fmt: skip
    self._store(params, Arrays(None, indptr, indices, last_page_len), copy=False)


class BatchPrefillWithPagedKVCacheWrapper(_TwinWrapper):
    """FlashInfer's paged prefill wrapper: query rows ``qo_indptr`` per request over
    its pages."""

    def __init__(
        self, float_workspace_buffer: Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
        qo_indptr_buf: Tensor | None = None, paged_kv_indptr_buf: Tensor | None = None,
        paged_kv_indices_buf: Tensor | None = None,
        paged_kv_last_page_len_buf: Tensor | None = None, custom_mask_buf: Tensor | None = None,
        mask_indptr_buf: Tensor | None = None, *, max_total_num_rows: int | None = None,
        **options: Any,
    ) -> None:  # fmt: skip
        super().__init__(float_workspace_buffer, kv_layout, options)
        self._max_rows = max_total_num_rows
        if use_cuda_graph:
            qo, kv, indices, last = _buffers(
                qo_indptr_buf=qo_indptr_buf, paged_kv_indptr_buf=paged_kv_indptr_buf,
                paged_kv_indices_buf=paged_kv_indices_buf,
                paged_kv_last_page_len_buf=paged_kv_last_page_len_buf,
                **({} if custom_mask_buf is None else {"mask_indptr_buf": mask_indptr_buf}),
            )[:4]  # fmt: skip
            # with a mask buffer the kernel is always masked (FlashInfer's mask mode)
            self._fixed = Arrays(qo, kv, indices, last, custom_mask_buf, mask_indptr_buf)

    def plan(
        self, qo_indptr: Tensor, paged_kv_indptr: Tensor, paged_kv_indices: Tensor,
        paged_kv_last_page_len: Tensor, num_qo_heads: int, num_kv_heads: int, head_dim_qk: int,
        page_size: int, *, packed_custom_mask: Tensor | None = None, causal: bool = False,
        sm_scale: float | None = None, window_left: int = -1, logits_soft_cap: float | None = None,
        q_data_type: DType = "float16", kv_data_type: DType = None, o_data_type: DType = None,
        prefix_len_ptr: Tensor | None = None, token_pos_in_items_ptr: Tensor | None = None,
        token_pos_in_items_len: int = 0, max_item_len_ptr: Tensor | None = None, **options: Any,
    ) -> None:  # fmt: skip
        """Plan a paged prefill: request ``i``'s query rows ``qo_indptr[i]:qo_indptr[i+1]``
        over its pages, with the causal flag, window, soft cap and scale compiled in; a
        packed custom mask (uint8) or the multi-item tensors (uint32 ``prefix_len_ptr``,
        uint16 ``token_pos_in_items_ptr`` and ``max_item_len_ptr``) replace the causal
        flag."""
        _check_head_dim_vo(options, head_dim_qk)
        _options("paged prefill plan()", options)
        dev = self.device
        items = (prefix_len_ptr, token_pos_in_items_ptr, max_item_len_ptr)
        params = Params.make(
            num_qo_heads, num_kv_heads, head_dim_qk, page_size=page_size, causal=bool(causal),
            window_left=window_left, soft_cap=logits_soft_cap, sm_scale=sm_scale,
            items=_items(*items, int(token_pos_in_items_len), dev),
            **_dtypes(q_data_type, kv_data_type, o_data_type),
        )  # fmt: skip
        qo, kv = _taken(qo_indptr, dev), _taken(paged_kv_indptr, dev)
        last = _taken(paged_kv_last_page_len, dev)
        self._check_rows(int(qo[-1]))
        mask = offsets = None
        if packed_custom_mask is not None:
            qo_lens = torch.diff(qo.long()).tolist()
            offsets = mask_indptr(qo_lens, paged_kv_lens(kv, last, page_size), dev)
            mask = packed_custom_mask.to(dev)
        self._store(params, Arrays(qo, kv, paged_kv_indices.to(dev), last, mask, offsets))

    def _check_rows(self, rows: int) -> None:
        """A CUDA-graph wrapper's query rows stay within ``max_total_num_rows`` (the
        first plan's rows when not given)."""
        if self._fixed is None:
            return
        if self._max_rows is None:
            self._max_rows = rows
        if rows > self._max_rows:
            raise BucketError(
                "qo_indptr", "more query rows than the CUDA-graph wrapper's bound",
                rows=rows, max_total_num_rows=self._max_rows,
            )  # fmt: skip


def _items(
    prefix_len: Tensor | None, tpos: Tensor | None, longest: Tensor | None, tpos_len: int,
    device: torch.device,
) -> tuple[Tensor, Tensor, int, Tensor] | None:  # fmt: skip
    """A plan's multi-item tensors (all three or none), kept as FlashInfer keeps them:
    ``(prefix_len_ptr, token_pos_in_items_ptr, token_pos_in_items_len, max_item_len_ptr)``."""
    if prefix_len is None and tpos is None and longest is None:
        return None
    if prefix_len is None or tpos is None or longest is None:
        raise FlashplanError(
            "prefix_len_ptr", "multi-item scoring takes all three of prefix_len_ptr, "
            "token_pos_in_items_ptr and max_item_len_ptr",
        )  # fmt: skip
    return prefix_len.to(device), tpos.to(device), tpos_len, longest.to(device)


def _check_head_dim_vo(options: dict[str, Any], head_dim_qk: int) -> None:
    """Take ``head_dim_vo`` out of ``options``: the twin computes it equal to
    ``head_dim_qk`` only."""
    vo = options.pop("head_dim_vo", None)
    if vo is not None and vo != head_dim_qk:
        raise UnsupportedError("head_dim_vo", "the twin needs head_dim_qk", value=vo)


class BatchPrefillWithRaggedKVCacheWrapper(_TwinWrapper):
    """FlashInfer's ragged prefill wrapper: query rows ``qo_indptr`` over the key rows
    ``kv_indptr`` of the ``k`` / ``v`` tensors passed to ``run``."""

    def __init__(
        self, float_workspace_buffer: Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
        qo_indptr_buf: Tensor | None = None, kv_indptr_buf: Tensor | None = None,
        custom_mask_buf: Tensor | None = None, mask_indptr_buf: Tensor | None = None,
        **options: Any,
    ) -> None:  # fmt: skip
        super().__init__(float_workspace_buffer, kv_layout, options)
        if use_cuda_graph:
            qo, kv = _buffers(
                qo_indptr_buf=qo_indptr_buf, kv_indptr_buf=kv_indptr_buf,
                **({} if custom_mask_buf is None else {"mask_indptr_buf": mask_indptr_buf}),
            )[:2]  # fmt: skip
            self._fixed = Arrays(qo, kv, mask=custom_mask_buf, mask_indptr=mask_indptr_buf)

    def plan(
        self, qo_indptr: Tensor, kv_indptr: Tensor, num_qo_heads: int, num_kv_heads: int,
        head_dim_qk: int, *, packed_custom_mask: Tensor | None = None, causal: bool = False,
        window_left: int = -1, logits_soft_cap: float | None = None, sm_scale: float | None = None,
        q_data_type: DType = "float16", kv_data_type: DType = None, o_data_type: DType = None,
        **options: Any,
    ) -> None:  # fmt: skip
        """Plan a ragged prefill (arguments as the paged wrapper's; FlashInfer's ragged
        kernel ignores multi-item tensors, which the twin refuses)."""
        _check_head_dim_vo(options, head_dim_qk)
        _options("ragged prefill plan()", options)
        params = Params.make(
            num_qo_heads, num_kv_heads, head_dim_qk, page_size=0, causal=bool(causal),
            window_left=window_left, soft_cap=logits_soft_cap, sm_scale=sm_scale,
            **_dtypes(q_data_type, kv_data_type, o_data_type),
        )  # fmt: skip
        dev = self.device
        qo, kv = _taken(qo_indptr, dev), _taken(kv_indptr, dev)
        mask = offsets = None
        if packed_custom_mask is not None:
            lens = torch.diff(qo.long()).tolist(), torch.diff(kv.long()).tolist()
            offsets, mask = mask_indptr(*lens, dev), packed_custom_mask.to(dev)
        self._store(params, Arrays(qo, kv, mask=mask, mask_indptr=offsets))

    def run(self, q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> Any:  # type: ignore[override]  # FlashInfer's ragged run takes k and v
        """Attention of ``q`` ``[qo_indptr[-1], num_qo_heads, head_dim]`` over the rows of
        ``k`` / ``v`` ``[kv_indptr[-1], num_kv_heads, head_dim]`` (keywords as the
        paged run's)."""
        return self._run(q, ragged_keys(k, v), **kwargs)


class _SinkVariant:
    """FlashInfer's attention-sink kernel variant, fixed when a sink wrapper is made:
    dtypes, head size, a sliding window or not. It has no soft cap, reads neither a
    custom mask nor multi-item tensors, and writes the query dtype."""

    def __init__(
        self, q_dtype: torch.dtype, kv_dtype: torch.dtype, head_dim_qk: int, head_dim_vo: int,
        window_left: int,
    ) -> None:  # fmt: skip
        if head_dim_vo != head_dim_qk:
            raise UnsupportedError("head_dim_vo", "the twin needs head_dim_qk", value=head_dim_vo)
        self.built = (q_dtype, kv_dtype, head_dim_qk, window_left >= 0)

    def check(self, params: Params, arrays: Arrays) -> None:
        """Refuse a plan that the variant would not compute as planned."""
        planned = (params.q_dtype, params.kv_dtype, params.head_dim, params.window_left >= 0)
        if planned != self.built:
            raise PlanMismatchError(
                "plan", "unlike the sink kernel built at construction (dtypes, head_dim, "
                "sliding window)", planned=planned, built=self.built,
            )  # fmt: skip
        for name, wanted in (
            ("logits_soft_cap", params.soft_cap), ("packed_custom_mask", arrays.mask is not None),
            ("prefix_len_ptr", params.items is not None),
            ("o_data_type", params.o_dtype != params.q_dtype),
        ):  # fmt: skip
            if wanted:
                raise UnsupportedError(name, "FlashInfer's sink kernel would not apply it")


class _SinkRun(_TwinWrapper):
    """The sink wrappers' plan check and ``run(q, paged_kv_cache, sinks, sm_scale)``."""

    _variant: _SinkVariant

    def _check_plan(self, params: Params, arrays: Arrays) -> None:
        self._variant.check(params, arrays)

    def run(self, q: Tensor, paged_kv_cache: KVCache, *args: Any, **kwargs: Any) -> Any:
        """The paged run with sink logits ``sinks`` (float32 ``[num_qo_heads]``, natural
        log units) and the softmax scale ``sm_scale`` (the plan's is not used), passed
        after the cache as FlashInfer's sink wrappers take them."""
        if len(args) != 2:
            raise PlanMismatchError("sinks", "a sink run takes sinks and sm_scale", given=len(args))
        sinks, sm_scale = args
        if sinks.dim() != 1 or sinks.shape[0] != q.shape[1]:
            raise PlanMismatchError("sinks", "must be [num_qo_heads]", shape=tuple(sinks.shape))
        return self._run(q, paged_keys(paged_kv_cache), sm_scale=sm_scale, sinks=sinks, **kwargs)


class BatchDecodeWithAttentionSinkWrapper(_SinkRun, BatchDecodeWithPagedKVCacheWrapper):
    """FlashInfer's decode wrapper on the attention-sink kernel (tensor cores); other
    keywords (its CUDA-graph buffers) go to the decode wrapper."""

    def __init__(
        self, float_workspace_buffer: Tensor, kv_layout: str = "NHD", *,
        q_data_type: torch.dtype = torch.bfloat16, kv_data_type: torch.dtype = torch.bfloat16,
        head_dim_qk: int = 128, head_dim_vo: int = 128, window_left: int = -1, **kwargs: Any,
    ) -> None:  # fmt: skip
        BatchDecodeWithPagedKVCacheWrapper.__init__(
            self, float_workspace_buffer, kv_layout, use_tensor_cores=True, **kwargs
        )
        self._variant = _SinkVariant(
            q_data_type, kv_data_type, head_dim_qk, head_dim_vo, window_left
        )


class BatchAttentionWithAttentionSinkWrapper(_SinkRun, BatchPrefillWithPagedKVCacheWrapper):
    """FlashInfer's paged prefill wrapper on the attention-sink kernel; other keywords
    (its CUDA-graph buffers) go to the paged prefill wrapper, but no mask buffer (the
    kernel would ignore the mask)."""

    def __init__(
        self, float_workspace_buffer: Tensor, kv_layout: str = "NHD", *,
        q_data_type: torch.dtype = torch.bfloat16, kv_data_type: torch.dtype = torch.bfloat16,
        head_dim_qk: int = 128, head_dim_vo: int = 128, window_left: int = -1, **kwargs: Any,
    ) -> None:  # fmt: skip
        for name in ("custom_mask_buf", "max_total_num_rows"):  # the mask: it would ignore it
            if kwargs.get(name) is not None:
                raise UnsupportedError(name, "FlashInfer's sink prefill wrapper takes none")
        BatchPrefillWithPagedKVCacheWrapper.__init__(
            self, float_workspace_buffer, kv_layout, **kwargs
        )
        self._variant = _SinkVariant(
            q_data_type, kv_data_type, head_dim_qk, head_dim_vo, window_left
        )


def merge_state(v_a: Tensor, s_a: Tensor, v_b: Tensor, s_b: Tensor) -> tuple[Tensor, Tensor]:
    """FlashInfer's ``merge_state``: partial states ``(v [n, h, d], s [n, h])`` (base-2
    LSE) over two disjoint key sets merged into the state over their union (``v`` in
    ``v_a``'s dtype); an empty side (``s = -inf``) adds nothing, two give 0 and -inf."""
    return merge_state_torch(v_a, s_a, v_b, s_b)


#: Stands where the imported ``flashinfer`` module would (``ExecutorSettings.flashinfer``).
flashinfer_twin = types.SimpleNamespace(
    __version__=__version__,
    BatchDecodeWithPagedKVCacheWrapper=BatchDecodeWithPagedKVCacheWrapper,
    BatchPrefillWithPagedKVCacheWrapper=BatchPrefillWithPagedKVCacheWrapper,
    BatchPrefillWithRaggedKVCacheWrapper=BatchPrefillWithRaggedKVCacheWrapper,
    BatchDecodeWithAttentionSinkWrapper=BatchDecodeWithAttentionSinkWrapper,
    BatchAttentionWithAttentionSinkWrapper=BatchAttentionWithAttentionSinkWrapper,
    fast_decode_plan=fast_decode_plan,
    merge_state=merge_state,
    xqa=xqa,
)
