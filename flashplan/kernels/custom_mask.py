"""Packed custom masks built on the device, in FlashInfer's layout.

Three shapes (:mod:`flashplan.planning.masks`), one kernel:

* a *threshold* mask — row ``j`` of request ``i`` sees columns
  ``c >= clamp(first_visible[i] + j, 0, kv_len)`` (a sliding window seen through a
  trimmed prefix);
* a *tree* mask — row ``t`` sees prefix columns ``c < tail_start[i]`` with
  ``c >= clamp(first_visible[i] + row_offsets[i, t], 0, kv_len)`` and draft column
  ``tail_start[i] + a`` when bit ``a`` of row ``t``'s ``tail_words`` is set (a
  speculative verify tree; each row's ``N`` bits packed little-endian into
  ``ceil(N / 8)`` bytes, as :attr:`~flashplan.planning.masks.TreeMask.tail_words`);
* a *position* mask — row ``j`` is the query at position ``p = row_position[i] + j``,
  column ``c`` the key at ``k = col_position[i] + c``, and the query sees the key when
  the group's rule holds: ``k <= p`` (causal), ``p - k <= window_left``, ``k - p <=
  window_right`` and ``k // chunk == p // chunk`` (each bound only when set; a
  bidirectional window, or chunked attention whose chunks start inside pages:
  :class:`~flashplan.planning.masks.PositionMask`). The rule is four int32 —
  ``(causal, window_left, window_right, chunk)``, -1 / 0 for "none" — read from the
  device, so one compiled kernel serves every group.

Bits are packed little-endian (element ``e`` is bit ``e % 8`` of byte ``e // 8``),
request ``i``'s bytes starting at byte ``byte_offsets[i]`` of ``out``. The host only
describes the mask (an int or two per request, the packed N x N draft bits of a tree); the
mask itself — possibly hundreds of MB for long windowed prefixes — is written at device
bandwidth.
"""

from __future__ import annotations

import torch

from flashplan.errors import FlashplanError
from flashplan.kernels._triton import HAS_TRITON, device_guard, runs_on_triton, tl, triton
from flashplan.torch_kernels import tensor_values

__all__ = ["MASK_POSITION", "MASK_THRESHOLD", "MASK_TREE", "build_custom_mask",
           "build_custom_mask_torch"]  # fmt: skip

_BLOCK = 2048

#: The kernel's ``KIND`` (a compile-time constant): which of the three masks it builds.
MASK_THRESHOLD, MASK_TREE, MASK_POSITION = 0, 1, 2

if HAS_TRITON:

    @triton.jit
    def _bit_range(lo, hi):
        """int32 byte with bits ``[lo, hi)`` set; ``lo``, ``hi`` in ``[0, 8]``, 0 if
        ``hi <= lo`` (the two masks then share no bit)."""
        return (0xFF << lo) & ((1 << hi) - 1)

    @triton.jit
    def _threshold_byte_wide(e0, kv, n_elem, first):
        """The threshold mask byte starting at element ``e0`` (int32 ``[BLOCK]``, a
        valid byte of the request) of a request with rows of ``kv >= 8`` columns, in
        closed form, int32 throughout.

        A byte covers at most two rows, and a row ``r`` sees the columns
        ``c >= clamp(first + r, 0, kv)``, so each row's part is one run of bits:

        * row ``row0`` holds bits ``[0, hi0)``, ``hi0 = min(kv - col0, 8)`` (column
          ``col0 + j``); it sees ``[lo0, hi0)``, ``lo0 = clamp(thr0 - col0, 0, 8)``.
          ``row0 <= q - 1``, so ``n_elem - e0 >= kv - col0``: no cut by the request end;
        * row ``row0 + 1`` holds bits ``[hi0, 8)`` (column ``j - hi0 < 8 <= kv``); it sees
          ``[min(hi0 + thr1, 8), left)``, ``left = clamp(n_elem - e0, 0, 8)`` the bits
          inside the request (empty when ``row0`` fills the byte or is the last row).
        """
        row0 = e0 // kv
        col0 = e0 - row0 * kv
        thr0 = tl.minimum(tl.maximum(first + row0, 0), kv)
        lo0 = tl.minimum(tl.maximum(thr0 - col0, 0), 8)
        hi0 = tl.minimum(kv - col0, 8)
        thr1 = tl.minimum(tl.maximum(first + row0 + 1, 0), kv)
        lo1 = tl.minimum(hi0 + thr1, 8)
        left = tl.minimum(tl.maximum(n_elem - e0, 0), 8)
        return _bit_range(lo0, hi0) | _bit_range(lo1, left)

    @triton.jit
    def _mask_byte(
        e0,
        row0,
        col0,
        kv32,
        n_elem,
        first,
        kv,
        i,
        N,
        tail,
        row_offsets_ptr,
        tail_words_ptr,
        causal,
        window_left,
        window_right,
        chunk,
        KIND: tl.constexpr,
        WIDE: tl.constexpr,
    ):
        """The 8 mask bits of the bytes starting at elements ``e0`` (row ``row0``,
        column ``col0``), packed little-endian, one bit at a time. ``WIDE``: rows of at
        least 8 columns, so a byte crosses at most one row end (a compare, not a
        division, per bit). Threshold: int32 (``first``, ``kv`` int32); tree: rows and
        columns in int64 (``first``, ``kv``, ``tail`` int64) for the table indices;
        position: int32 (``first`` the row position, ``tail`` the column position, and
        the rule ``causal`` .. ``chunk``; a query and a key position differ by less than
        2**31, so their difference is int32 and no bound is added to a position)."""
        byte = (e0 * 0).to(tl.int32)
        for bit in tl.static_range(8):  # no tl.sum: it is a jit helper, not a builtin
            inside = e0 + bit < n_elem
            c = col0 + bit
            if WIDE:  # noqa: SIM108 - a constexpr branch, resolved when compiling
                wrap = (c >= kv32).to(tl.int32)
            else:
                wrap = c // kv32
            if KIND == 1:  # tree
                row = (row0 + wrap).to(tl.int64)
                col = (c - wrap * kv32).to(tl.int64)
                shift = tl.load(row_offsets_ptr + i * N + row, mask=inside, other=0).to(tl.int64)
                thr = tl.minimum(tl.maximum(first + shift, 0), kv)
                in_prefix = (col >= thr) & (col < tail)
                a = col - tail
                in_tail = (a >= 0) & (a < N) & inside
                width = (N + 7) // 8  # bytes per packed row
                word = tl.load(
                    tail_words_ptr + (i * N + row) * width + (a >> 3), mask=in_tail, other=0
                ).to(tl.int32)
                draft = (word >> (a & 7).to(tl.int32)) & 1
                seen = inside & (in_prefix | (draft != 0))
            elif KIND == 2:  # position
                p = first + row0 + wrap  # the query's position
                k = tail + c - wrap * kv32  # the key's position
                d = p - k
                seen = inside & ((causal == 0) | (d >= 0))
                seen = seen & ((window_left < 0) | (d <= window_left))
                seen = seen & ((window_right < 0) | (d >= -window_right))
                step = tl.maximum(chunk, 1)
                seen = seen & ((chunk <= 0) | (p // step == k // step))
            else:
                row = row0 + wrap
                col = c - wrap * kv32
                thr = tl.minimum(tl.maximum(first + row, 0), kv)
                seen = (col >= thr) & inside
            byte = byte | (seen.to(tl.int32) << bit)
        return byte

    @triton.jit
    def mask_block(
        i,
        blk,
        first_visible_ptr,
        qo_lens_ptr,
        kv_lens_ptr,
        byte_offsets_ptr,
        out_ptr,
        row_offsets_ptr,
        tail_start_ptr,
        tail_words_ptr,
        N,
        KIND: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """Bytes ``[blk * BLOCK, (blk + 1) * BLOCK)`` of request ``i``'s mask (one
        program's work). Also called by the fused launch (:mod:`flashplan.kernels.fused`).

        A request has fewer than 2**31 - 8 elements (checked on the host), so element
        indices fit int32: one int32 division per byte. Threshold masks are int32
        throughout; rows of 8+ columns take the closed form (_threshold_byte_wide),
        narrower rows, tree and position masks the per-bit loop (_mask_byte). A position
        mask reads ``first_visible_ptr`` as row positions, ``tail_start_ptr`` as column
        positions and its rule (four int32) at ``row_offsets_ptr``."""
        q32 = tl.load(qo_lens_ptr + i).to(tl.int32)
        kv32 = tl.load(kv_lens_ptr + i).to(tl.int32)
        n_elem = q32 * kv32
        n_bytes = (n_elem + 7) // 8
        b = blk * BLOCK + tl.arange(0, BLOCK)
        if blk * BLOCK < n_bytes:
            valid = b < n_bytes
            kv_safe = tl.maximum(kv32, 1)
            e0 = tl.where(valid, b, 0) * 8
            dst = out_ptr + tl.load(byte_offsets_ptr + i).to(tl.int64)
            first_raw = tl.load(first_visible_ptr + i)
            causal = 0
            window_left = -1
            window_right = -1
            chunk = 0
            if KIND == 1:  # tree
                first = first_raw.to(tl.int64)
                kv = kv32.to(tl.int64)
                tail = tl.load(tail_start_ptr + i).to(tl.int64)
            elif KIND == 2:  # position: row and column positions, the rule
                first = first_raw.to(tl.int32)
                kv = kv32
                tail = tl.load(tail_start_ptr + i).to(tl.int32)
                causal = tl.load(row_offsets_ptr).to(tl.int32)
                window_left = tl.load(row_offsets_ptr + 1).to(tl.int32)
                window_right = tl.load(row_offsets_ptr + 2).to(tl.int32)
                chunk = tl.load(row_offsets_ptr + 3).to(tl.int32)
            else:
                # Clamped to [-q, kv]: the thresholds of rows 0..q are unchanged and
                # first + row stays int32 whatever the input dtype (q + kv <= q*kv + 1).
                first = tl.minimum(tl.maximum(first_raw, -q32), kv32).to(tl.int32)
                kv = kv32
                tail = 0
            if kv32 >= 8:
                if KIND == 0:
                    byte = _threshold_byte_wide(e0, kv32, n_elem, first)
                else:
                    row0 = e0 // kv_safe
                    byte = _mask_byte(
                        e0, row0, e0 - row0 * kv_safe, kv_safe, n_elem, first, kv, i, N,
                        tail, row_offsets_ptr, tail_words_ptr, causal, window_left,
                        window_right, chunk, KIND=KIND, WIDE=True,
                    )  # fmt: skip
            else:
                row0 = e0 // kv_safe
                byte = _mask_byte(
                    e0, row0, e0 - row0 * kv_safe, kv_safe, n_elem, first, kv, i, N, tail,
                    row_offsets_ptr, tail_words_ptr, causal, window_left, window_right, chunk,
                    KIND=KIND, WIDE=False,
                )  # fmt: skip
            tl.store(dst + b, byte.to(tl.uint8), mask=valid)

    @triton.jit
    def _custom_mask_kernel(
        first_visible_ptr,
        qo_lens_ptr,
        kv_lens_ptr,
        byte_offsets_ptr,
        out_ptr,
        row_offsets_ptr,
        tail_start_ptr,
        tail_words_ptr,
        N,
        KIND: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # Grid (bs, byte blocks): one program writes BLOCK bytes of one request.
        mask_block(
            tl.program_id(0), tl.program_id(1), first_visible_ptr, qo_lens_ptr, kv_lens_ptr,
            byte_offsets_ptr, out_ptr, row_offsets_ptr, tail_start_ptr, tail_words_ptr, N,
            KIND=KIND, BLOCK=BLOCK,
        )  # fmt: skip


def _check(
    arrays: dict[str, torch.Tensor],
    out: torch.Tensor,
    tree: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    position: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> int:
    bs = arrays["qo_lens"].shape[0]
    for name, t in arrays.items():
        if t.dtype not in (torch.int32, torch.int64) or t.dim() != 1 or t.shape[0] != bs:
            raise FlashplanError(
                name,
                "expected an int32/int64 [batch] tensor",
                batch=bs,
                **tensor_values(t),
            )
        if t.device != out.device or not t.is_contiguous():
            raise FlashplanError(
                name,
                "must be contiguous and on the device of out",
                contiguous=t.is_contiguous(),
                device=str(t.device),
                out_device=str(out.device),
            )
    if out.dtype != torch.uint8 or out.dim() != 1:
        raise FlashplanError("out", "expected a uint8 1-D tensor", **tensor_values(out))
    if tree is not None:
        row_offsets, tail_start, tail_words = tree
        for name, t, dtypes in (
            ("row_offsets", row_offsets, (torch.int32, torch.int64)),
            ("tail_start", tail_start, (torch.int32, torch.int64)),
            ("tail_words", tail_words, (torch.uint8,)),
        ):
            if t.dtype not in dtypes or t.dim() != 1 or t.device != out.device:
                raise FlashplanError(
                    name,
                    "expected a 1-D tensor of a supported dtype on the device of out",
                    dtype=str(t.dtype),
                    supported=tuple(str(d) for d in dtypes),
                    shape=tuple(t.shape),
                    device=str(t.device),
                    out_device=str(out.device),
                )
        if tail_start.shape[0] != bs:
            raise FlashplanError(
                "tail_start",
                "expected one entry per request [batch]",
                batch=bs,
                shape=tuple(tail_start.shape),
            )
    if position is not None:
        if tree is not None:
            raise FlashplanError("position", "a mask is a tree or a position mask, not both")
        col_position, rule = position
        for name, t, size in (("col_position", col_position, bs), ("rule", rule, 4)):
            if (
                t.dtype not in (torch.int32, torch.int64)
                or t.shape != (size,)
                or t.device != out.device
            ):
                raise FlashplanError(
                    name,
                    f"expected an int32/int64 [{size}] tensor on the device of out",
                    **tensor_values(t),
                    out_device=str(out.device),
                )
    return bs


def build_custom_mask(
    first_visible: torch.Tensor,
    qo_lens: torch.Tensor,
    kv_lens: torch.Tensor,
    byte_offsets: torch.Tensor,
    out: torch.Tensor,
    max_bytes: int,
    *,
    tree: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    num_tokens: int = 0,
    position: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Write the packed custom mask of every request into ``out`` (Triton); no sync.

    Args:
        first_visible: int32/int64 ``[bs]`` (columns) the threshold base; for a
            position mask, (positions) the query position of each request's row 0.
        qo_lens, kv_lens: int32 ``[bs]`` (tokens) rows and columns per request.
        byte_offsets: int32/int64 ``[bs]`` (bytes) where request i's bytes start in ``out``.
        out: uint8 ``[>= max(byte_offsets + ceil(qo*kv/8))]`` on the same device.
        max_bytes: host int, the largest ``ceil(qo_len * kv_len / 8)`` (sizes the grid).
            Each request's ``qo_len * kv_len`` must be below ``2**31 - 8`` (the
            executor refuses larger masks: FlashInfer's offsets are int32 too).
        tree: for a tree mask, ``(row_offsets [bs * N], tail_start [bs], tail_words
            [bs * N * ceil(N / 8)])`` (int32, int32, uint8: each row's ``N`` draft bits
            packed little-endian), row-major per request.
        num_tokens: ``N`` of a tree mask.
        position: for a position mask, ``(col_position, rule)``: int32/int64 ``[bs]``
            (positions) the key position of each request's column 0, and int32/int64
            ``[4]`` the rule ``(causal, window_left, window_right, chunk)`` (0/1, then
            -1 or a bound in tokens, then 0 or a chunk size in tokens). Positions and
            bounds must fit int32.

    Bytes outside the requests' ranges are left untouched. On CPU tensors the kernel
    runs under Triton's interpreter when enabled, else the torch twin runs.
    """
    arrays = {
        "first_visible": first_visible,
        "qo_lens": qo_lens,
        "kv_lens": kv_lens,
        "byte_offsets": byte_offsets,
    }
    bs = _check(arrays, out, tree, position)
    if bs == 0 or max_bytes <= 0:
        return
    if not runs_on_triton(out.device, "build_custom_mask_torch"):
        build_custom_mask_torch(
            first_visible, qo_lens, kv_lens, byte_offsets, out, tree=tree,
            num_tokens=num_tokens, position=position,
        )  # fmt: skip
        return
    grid = (bs, triton.cdiv(max_bytes, _BLOCK))
    if tree is not None:
        kind = MASK_TREE
        row_offsets, tail_start, tail_words = tree
    elif position is not None:  # the rule where a tree's row offsets go
        kind = MASK_POSITION
        row_offsets, tail_start, tail_words = position[1], position[0], out
    else:
        kind = MASK_THRESHOLD
        row_offsets, tail_start, tail_words = out, out, out
    with device_guard(out.device):
        _custom_mask_kernel[grid](
            first_visible,
            qo_lens,
            kv_lens,
            byte_offsets,
            out,
            row_offsets,
            tail_start,
            tail_words,
            num_tokens,
            KIND=kind,
            BLOCK=_BLOCK,
        )


def build_custom_mask_torch(
    first_visible: torch.Tensor,
    qo_lens: torch.Tensor,
    kv_lens: torch.Tensor,
    byte_offsets: torch.Tensor,
    out: torch.Tensor,
    *,
    tree: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    num_tokens: int = 0,
    position: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Same contract as :func:`build_custom_mask`, in plain vectorized torch.

    Reads the lengths (a host read on CPU tensors; on a device it would sync, so
    use it on CPU only).
    """
    arrays = {
        "first_visible": first_visible,
        "qo_lens": qo_lens,
        "kv_lens": kv_lens,
        "byte_offsets": byte_offsets,
    }
    _check(arrays, out, tree, position)
    q = qo_lens.long()
    kv = kv_lens.long()
    n_bytes = (q * kv + 7) // 8
    total = int(n_bytes.sum())
    if total == 0:
        return
    dev = out.device
    req = torch.repeat_interleave(torch.arange(q.shape[0], device=dev), n_bytes, output_size=total)
    starts = torch.cumsum(n_bytes, 0) - n_bytes
    local = torch.arange(total, device=dev) - starts[req]
    e = local[:, None] * 8 + torch.arange(8, device=dev)[None, :]
    kv_r = kv[req][:, None]
    row = e // kv_r.clamp_min(1)
    col = e - row * kv_r
    inside = e < (q * kv)[req][:, None]
    first = first_visible.long()[req][:, None]
    if position is not None:
        causal, window_left, window_right, chunk = (int(v) for v in position[1].tolist())
        p = first + row  # the query's position
        k = position[0].long()[req][:, None] + col  # the key's position
        seen = inside
        if causal:
            seen = seen & (k <= p)
        if window_left >= 0:
            seen = seen & (p - k <= window_left)
        if window_right >= 0:
            seen = seen & (k - p <= window_right)
        if chunk > 0:
            seen = seen & (p // chunk == k // chunk)
    elif tree is None:
        thr = torch.minimum((first + row).clamp(min=0), kv_r)
        seen = (col >= thr) & inside
    else:
        n = num_tokens
        width = (n + 7) // 8  # bytes per packed row
        row_offsets, tail_start, tail_words = tree
        safe_row = torch.where(inside, row, 0)
        shift = row_offsets.long()[req[:, None] * n + safe_row]
        thr = torch.minimum((first + shift).clamp(min=0), kv_r)
        tail = tail_start.long()[req][:, None]
        a = col - tail
        in_tail = (a >= 0) & (a < n) & inside
        safe_a = torch.where(in_tail, a, 0)
        index = torch.where(in_tail, (req[:, None] * n + safe_row) * width + (safe_a >> 3), 0)
        if tail_words.numel():
            draft = ((tail_words.long()[index] >> (safe_a & 7)) & 1) != 0
        else:
            draft = torch.zeros_like(in_tail)
        seen = inside & (((col >= thr) & (col < tail)) | (in_tail & draft))
    byte = (seen.to(torch.int32) << torch.arange(8, device=dev, dtype=torch.int32)).sum(1)
    out[byte_offsets.long()[req] + local] = byte.to(torch.uint8)
