"""`ReferenceExecutor`: the same plans, computed in plain torch on any device.

It follows the kernel paths of the plan — a paged call over gathered pages, a
ragged call over the new tokens, and a base-2 log-sum-exp merge of the two — with
the kernels' own masking rules (bottom-right causal, ``window_left``, packed
custom mask), so it is a faithful oracle for the FlashInfer executor and a
fallback where there is no GPU. Math runs in ``compute_dtype`` (float32 by
default; float64 for tight tests). Each call is vectorized over the batch by
padding to the plan's host-known maxima; memory is ``bs * heads * max_q * max_kv``
scores, so it is meant for tests, demos and modest batches.
"""

from __future__ import annotations

import math

import attrs
import numpy as np
import torch

from flashplan.errors import PlanMismatchError
from flashplan.executor.checks import check_run_args
from flashplan.kernels.merge_state import merge_state_torch
from flashplan.layout.group import AttentionGroup
from flashplan.layout.page_table import PageTable
from flashplan.plan.materialize import kernel_visibility
from flashplan.plan.spec import GroupPlan, PagedPart, PlanSpec, RaggedPart

__all__ = ["ReferenceExecutor"]

_LN2 = math.log(2.0)


@attrs.frozen(eq=False)
class _Gathered:
    """Device index tensors of one kernel call, padded to ``[bs, max_q, max_kv]``."""

    kv_page: torch.Tensor  # int64 [bs, max_kv] physical page of kernel key c (0 when padding)
    kv_slot: torch.Tensor  # int64 [bs, max_kv] slot in that page
    visible: torch.Tensor  # bool [bs, max_q, max_kv] kernel visibility incl. padding


@attrs.frozen(eq=False)
class _Applied:
    spec: PlanSpec
    q_index: torch.Tensor  # int64 [bs, max_q] row of q for (request, j); 0 for padding
    q_valid: torch.Tensor  # bool [bs, max_q]
    new_page: torch.Tensor  # int64 [total_q] page of each new token's K/V
    new_slot: torch.Tensor  # int64 [total_q]
    enc_page: torch.Tensor  # int64 [total_encoder]
    enc_slot: torch.Tensor  # int64 [total_encoder]
    paged: dict[int, _Gathered]  # group index -> paged call
    ragged: dict[int, torch.Tensor]  # group index -> bool [bs, max_q, max_q] visibility


def _padded_rows(indptr: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """``(index [bs, width], valid [bs, width])`` of segment rows, host int64/bool."""
    lens = np.diff(indptr.astype(np.int64))
    j = np.arange(width, dtype=np.int64)[None, :]
    valid = j < lens[:, None]
    index = np.where(valid, indptr[:-1, None].astype(np.int64) + j, 0)
    return index, valid


def _custom_mask(part: PagedPart, qo_lens: np.ndarray, max_q: int) -> np.ndarray:
    """bool ``[bs, max_q, max_kv]`` unpacked from the plan's packed mask."""
    assert part.packed_mask is not None and part.mask_indptr is not None
    bits = np.unpackbits(part.packed_mask, bitorder="little")
    kv = part.kv_lens.astype(np.int64)[:, None, None]
    j = np.arange(max_q)[None, :, None]
    c = np.arange(part.max_kv_len)[None, None, :]
    index = part.mask_indptr[:-1].astype(np.int64)[:, None, None] * 8 + j * kv + c
    valid = (j < qo_lens.astype(np.int64)[:, None, None]) & (c < kv)
    index = np.where(valid, index, 0)
    if bits.size == 0:
        return np.zeros(valid.shape, dtype=bool)
    return valid & (bits[np.minimum(index, bits.size - 1)] != 0)


def _token_slots(
    pages: torch.Tensor,
    rows: np.ndarray,
    first: np.ndarray,
    counts: np.ndarray,
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Physical (page, slot) of logical tokens ``first[i] + [0, counts[i])``, int64 ``[sum]``."""
    req = np.repeat(np.arange(counts.shape[0]), counts)
    offset = np.arange(req.shape[0]) - np.repeat(np.cumsum(counts) - counts, counts)
    token = first.astype(np.int64)[req] + offset
    dev = pages.device
    row_t = torch.from_numpy(rows.astype(np.int64)[req]).to(dev)
    col_t = torch.from_numpy(token // page_size).to(dev)
    page = pages[row_t, col_t].long() if req.size else torch.zeros(0, dtype=torch.long, device=dev)
    slot = torch.from_numpy(token % page_size).to(dev)
    return page, slot


class ReferenceExecutor:
    """Runs a :class:`~flashplan.PlanSpec` with plain torch (CPU or GPU).

    Usage mirrors the FlashInfer executor: ``apply(spec, table)`` once per batch,
    then ``run(group, q, k_new, v_new, kv_cache)`` per layer.

    Args:
        page_map: optional int32 tensor mapping full-pool page ids to the page ids of a
            separate sliding-window KV pool (last entry -1), applied to windowed
            groups' reads and writes — the same contract as the FlashInfer executor's.
        compute_dtype: dtype of the attention math (``torch.float32`` or
            ``torch.float64``); outputs are cast to the plan's ``out_dtype``.
    """

    def __init__(
        self, *, compute_dtype: torch.dtype = torch.float32, page_map: torch.Tensor | None = None
    ) -> None:
        self.compute_dtype = compute_dtype
        self.page_map = page_map
        self._applied: _Applied | None = None

    @property
    def spec(self) -> PlanSpec | None:
        """The plan applied last, or ``None``."""
        return None if self._applied is None else self._applied.spec

    def apply(self, spec: PlanSpec, table: PageTable) -> None:
        """Prepare index tensors for ``spec`` on the table's device.

        Raises:
            PageTableError: the table does not cover the plan's pages.
        """
        table.check_covers(spec.pages_needed)
        dev = table.pages.device
        ps = spec.page_size
        qo_lens = np.diff(spec.qo_indptr)
        max_q = spec.max_q_len
        q_index, q_valid = _padded_rows(spec.qo_indptr, max_q)
        new_page, new_slot = _token_slots(
            table.pages, table.rows, spec.new_token_start, qo_lens, ps
        )
        if spec.encoder_indptr is not None:
            enc_lens = np.diff(spec.encoder_indptr)
            enc_page, enc_slot = _token_slots(
                table.pages, table.rows, np.zeros_like(enc_lens), enc_lens, ps
            )
        else:
            enc_page = enc_slot = torch.zeros(0, dtype=torch.long, device=dev)
        paged: dict[int, _Gathered] = {}
        ragged: dict[int, torch.Tensor] = {}
        for index, gp in enumerate(spec.group_plans):
            if gp.paged is not None:
                gathered = self._gather_paged(gp, gp.paged, table, qo_lens, max_q, dev, ps)
                if self.page_map is not None and gp.group.has_window:
                    gathered = attrs.evolve(
                        gathered, kv_page=self.page_map.to(dev)[gathered.kv_page].long()
                    )
                paged[index] = gathered
            if gp.ragged is not None:
                ragged[index] = self._ragged_visibility(gp, gp.ragged, qo_lens, max_q, dev)
        self._applied = _Applied(
            spec=spec,
            q_index=torch.from_numpy(q_index).to(dev),
            q_valid=torch.from_numpy(q_valid).to(dev),
            new_page=new_page,
            new_slot=new_slot,
            enc_page=enc_page,
            enc_slot=enc_slot,
            paged=paged,
            ragged=ragged,
        )

    @staticmethod
    def _gather_paged(
        gp: GroupPlan,
        part: PagedPart,
        table: PageTable,
        qo_lens: np.ndarray,
        max_q: int,
        dev: torch.device,
        ps: int,
    ) -> _Gathered:
        max_kv = part.max_kv_len
        c = np.arange(max_kv, dtype=np.int64)[None, :]
        valid_c = c < part.kv_lens.astype(np.int64)[:, None]
        token = np.where(valid_c, part.start_page.astype(np.int64)[:, None] * ps + c, 0)
        rows = np.repeat(table.rows.astype(np.int64)[:, None], max_kv, axis=1)
        page = table.pages[
            torch.from_numpy(rows).to(dev), torch.from_numpy(token // ps).to(dev)
        ].long()
        visible = kernel_visibility(
            qo_lens, part.kv_lens, max_q, max_kv, causal=part.causal, window_left=gp.window_left
        )
        if part.mask is not None:
            visible &= _custom_mask(part, qo_lens, max_q)
        return _Gathered(
            kv_page=page,
            kv_slot=torch.from_numpy(token % ps).to(dev),
            visible=torch.from_numpy(visible).to(dev),
        )

    @staticmethod
    def _ragged_visibility(
        gp: GroupPlan, part: RaggedPart, qo_lens: np.ndarray, max_q: int, dev: torch.device
    ) -> torch.Tensor:
        kv_lens = np.diff(part.kv_indptr)
        seen = kernel_visibility(
            qo_lens, kv_lens, max_q, max_q, causal=part.causal, window_left=gp.window_left
        )
        return torch.from_numpy(seen).to(dev)

    def run(
        self,
        group: AttentionGroup,
        q: torch.Tensor,
        k_new: torch.Tensor | None,
        v_new: torch.Tensor | None,
        kv_cache: torch.Tensor,
        *,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attention of one layer of ``group``.

        Args:
            group: a group the applied plan was made for.
            q: ``[total_q, num_qo_heads, head_dim]`` queries (``q_dtype``).
            k_new, v_new: ``[total_q, num_kv_heads, head_dim]`` new K/V of a self
                group, or ``[total_encoder, num_kv_heads, head_dim]`` encoder K/V of
                a cross group; written into ``kv_cache`` first. ``None`` when the
                cache already holds them.
            kv_cache: ``[num_pages, 2, page_size, num_kv_heads, head_dim]`` (NHD).
            return_lse: also return the log-sum-exp, float32 ``[total_q, num_qo_heads]``,
                **base 2**; ``-inf`` for a query that sees no key (its output is 0).

        Returns:
            ``out [total_q, num_qo_heads, head_dim]`` (``out_dtype``), or ``(out, lse)``.
        """
        applied = self._applied
        gp = check_run_args(
            None if applied is None else applied.spec, group, q, k_new, v_new, kv_cache
        )
        assert applied is not None
        spec = applied.spec
        index = spec.group_plans.index(gp)
        if k_new is not None and v_new is not None:
            if group.cross_attention:
                page, slot = applied.enc_page, applied.enc_slot
            else:
                page, slot = applied.new_page, applied.new_slot
                if self.page_map is not None and group.has_window:
                    page = self.page_map.to(page.device)[page].long()
            kv_cache[page, 0, slot] = k_new
            kv_cache[page, 1, slot] = v_new
        scale = group.scale_for(spec.heads.head_dim)
        states = []
        if index in applied.paged:
            g = applied.paged[index]
            k = kv_cache[g.kv_page, 0, g.kv_slot]  # [bs, max_kv, Hkv, D]
            v = kv_cache[g.kv_page, 1, g.kv_slot]
            states.append(self._attend(q, k, v, g.visible, applied, scale, group.logits_soft_cap))
        if index in applied.ragged:
            if k_new is None or v_new is None:
                raise PlanMismatchError(
                    f"group {group.describe()!r} runs on the ragged path: pass k_new and v_new"
                )
            k = k_new[applied.q_index]  # [bs, max_q, Hkv, D]
            v = v_new[applied.q_index]
            states.append(
                self._attend(q, k, v, applied.ragged[index], applied, scale, group.logits_soft_cap)
            )
        out, lse = states[0]
        for other_out, other_lse in states[1:]:
            out, lse = merge_state_torch(out, lse, other_out, other_lse)
        out = out.to(spec.heads.out_dtype)
        return (out, lse) if return_lse else out

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        visible: torch.Tensor,
        applied: _Applied,
        scale: float,
        soft_cap: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One kernel call: ``(out [total_q, Hq, D] in compute dtype, lse float32 base 2)``."""
        cd = self.compute_dtype
        bs, max_q = applied.q_index.shape
        hq, d = q.shape[1], q.shape[2]
        hkv = k.shape[2]
        qp = q[applied.q_index].to(cd).view(bs, max_q, hkv, hq // hkv, d)
        logits = torch.einsum("bqhgd,bkhd->bhgqk", qp, k.to(cd)) * scale
        if soft_cap:
            logits = soft_cap * torch.tanh(logits / soft_cap)
        logits = logits.masked_fill(~visible[:, None, None], float("-inf"))
        lse_e = torch.logsumexp(logits, dim=-1)  # [bs, hkv, g, max_q], natural log
        # A query that sees no key has lse = -inf: clamp so its probabilities are exp(-inf) = 0.
        probs = torch.exp(logits - lse_e.unsqueeze(-1).clamp_min(torch.finfo(cd).min))
        out = torch.einsum("bhgqk,bkhd->bqhgd", probs, v.to(cd)).reshape(bs, max_q, hq, d)
        lse = (lse_e / _LN2).permute(0, 3, 1, 2).reshape(bs, max_q, hq)
        valid = applied.q_valid
        total_q = q.shape[0]
        flat_out = torch.zeros(total_q, hq, d, dtype=cd, device=q.device)
        flat_lse = torch.full((total_q, hq), float("-inf"), dtype=torch.float32, device=q.device)
        rows = applied.q_index[valid]
        flat_out[rows] = out[valid]
        flat_lse[rows] = lse[valid].float()
        return flat_out, flat_lse
