"""Human-readable renderings of plans and visibility masks (pure functions, host only).

:func:`describe_plan` prints what a :class:`~flashplan.PlanSpec` asks the kernels to do,
group by group and request by request. :func:`ascii_visibility` draws per-request boolean
masks (rows = queries, columns = keys; ``#`` visible, ``.`` hidden), e.g. the oracle's
:func:`flashplan.oracle.visibility` or :meth:`~flashplan.PlanSpec.materialize`.
:func:`kernel_coverage` says which kernel call of a group reads which key.

Positions and keys in the output are in the group's key space: decoder positions
``0 .. seq_len - 1`` for self-attention groups, encoder positions ``0 .. enc_len - 1`` for
cross-attention groups.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from flashplan.layout.group import AttentionGroup
from flashplan.planning.pictures import ascii_visibility, position_text
from flashplan.planning.spec import GroupPlan, KernelPath, PlanSpec

__all__ = [
    "COVER_NONE",
    "COVER_PAGED",
    "COVER_RAGGED",
    "ascii_visibility",
    "describe_group",
    "describe_header",
    "describe_plan",
    "format_ints",
    "kernel_coverage",
]

#: :func:`kernel_coverage` value: no kernel call of the group reads the key.
COVER_NONE = 0
#: :func:`kernel_coverage` value: the paged call (decode or paged prefill) reads the key.
COVER_PAGED = 1
#: :func:`kernel_coverage` value: the ragged call (this step's new K/V) reads the key.
COVER_RAGGED = 2

_PATH_TEXT = {
    KernelPath.DECODE: "decode kernel over the paged KV (one query per request)",
    KernelPath.PAGED: "paged prefill over the visible KV, new tokens included "
    "(their K/V is written to the cache first)",
    KernelPath.RAGGED: "ragged prefill over the new tokens only (no cached prefix)",
    KernelPath.RAGGED_PAGED: "ragged prefill over the new tokens + paged prefill over the "
    "cached prefix, merged through their base-2 LSE",
}


# ---------------------------------------------------------------------------- plan text
def _dtype_name(dtype: object) -> str:
    return str(dtype).removeprefix("torch.")


def describe_header(spec: PlanSpec) -> str:
    """The batch-wide lines of :func:`describe_plan` (mode, sizes, heads, groups)."""
    key, heads = spec.key, spec.heads
    bs = spec.batch_size
    dtypes = _dtype_name(heads.q_dtype)
    if heads.kv_dtype != heads.q_dtype or heads.out_dtype != heads.q_dtype:
        dtypes = (
            f"q {_dtype_name(heads.q_dtype)}, kv {_dtype_name(heads.kv_dtype)}, "
            f"out {_dtype_name(heads.out_dtype)}"
        )
    lines = [
        f"plan: {key.mode.value}, {bs} request{'s' if bs != 1 else ''}, "
        f"page_size {key.page_size}, heads {heads.num_qo_heads} q / {heads.num_kv_heads} kv "
        f"x {heads.head_dim} ({dtypes})",
        f"  new tokens: total_q {spec.total_q}, max_q_len {spec.max_q_len}, "
        f"qo_indptr {format_ints(spec.qo_indptr)}",
        f"  pages_needed per table row: {format_ints(spec.pages_needed)}",
    ]
    if spec.encoder_indptr is not None:
        lines.append(
            f"  encoder: rows of k_enc/v_enc written this step (encoder_indptr) "
            f"{format_ints(spec.encoder_indptr)}, "
            f"decoder KV starts at row token {format_ints(spec.decoder_start)}"
        )
    groups = ", ".join(
        f"{g.describe()} [{p.value}]" for g, p in zip(key.groups, key.paths, strict=True)
    )
    lines.append(f"  groups: {groups}")
    return "\n".join(lines)


def _window_text(gp: GroupPlan) -> str:
    g = gp.group
    if g.cross_attention:
        return "cross-attention: every query sees all encoder keys of its request (non-causal)"
    if not g.causal and g.window_right >= 0:
        return (
            f"bidirectional window {g.window_left}..{g.window_right}: a query at position p "
            f"sees keys p-{g.window_left}..p+{g.window_right} of its request"
        )
    if not g.causal:
        return "non-causal: every new token sees every key of its request"
    if g.attention_chunk_size:
        c = g.attention_chunk_size
        return (
            f"chunk {c}: a query at position p sees keys {c}*(p//{c})..p "
            f"(Hugging Face attention_chunk_size = {c})"
        )
    w = g.window_left
    if w < 0:
        return "window_left -1 (full attention): a query at position p sees keys 0..p"
    return (
        f"window_left {w}: a query at position p sees keys p-{w}..p "
        f"({w + 1} keys; Hugging Face sliding_window = {w + 1})"
    )


def _range(lo: int, hi: int) -> str:
    """``[lo, hi)`` or ``-`` when empty."""
    return f"[{lo}, {hi})" if hi > lo else "-"


def describe_group(spec: PlanSpec, gp: GroupPlan, *, index: int | None = None) -> str:
    """The lines of :func:`describe_plan` for one group."""
    g = gp.group
    name = g.describe() if index is None else f"{index}: {g.describe()}"
    lines = [f"group {name}", f"  path {gp.path.value}: {_PATH_TEXT[gp.path]}"]
    lines.append(f"  {_window_text(gp)}")
    parts = []
    if gp.paged is not None:
        p = gp.paged
        mask = "custom mask" if p.mask is not None else "no custom mask"
        if p.position_mask is not None:
            mask = "position mask"
        if p.items is not None:
            mask = "multi-item mask"
        parts.append(
            f"paged call: {'causal' if p.causal else 'non-causal'}, {mask}, "
            f"{p.total_pages} page{'' if p.total_pages == 1 else 's'}, max_kv_len {p.max_kv_len}"
        )
    if gp.ragged is not None:
        r = gp.ragged
        parts.append(
            f"ragged call: {'causal' if r.causal else 'non-causal'}, max_kv_len {r.max_kv_len}"
        )
    lines.append("  " + "; ".join(parts))
    if g.sinks:
        folded = "ragged" if gp.ragged is not None and gp.ragged.sinks else "paged"
        lines.append(f"  sinks: folded into the {folded} call's state once (run takes sinks=)")
    if gp.virtual is not None:
        v = gp.virtual
        runs = ", ".join(
            f"{int(r)}:{int(n)}" for r, n in zip(v.request, v.queries.lens, strict=True)
        )
        lines.append(f"  virtual requests (request:queries, one per chunk touched): {runs}")

    ps = spec.page_size
    qo_ptr = spec.qo_indptr.astype(np.int64)
    n_keys = gp.num_keys.astype(np.int64)
    qo = spec.qo_lens.astype(np.int64)
    first_key = gp.first_key
    headers = ["req", "queries", "positions"]
    if gp.paged is not None:
        headers += ["start_page", "pages", "last_page_len", "kv_len", "paged keys"]
    if gp.ragged is not None:
        headers += ["k_new rows", "ragged keys"]
    headers += ["trim", "mask"]
    rows = []
    for i in range(spec.batch_size):
        q0, q1 = int(qo_ptr[i]), int(qo_ptr[i + 1])
        row = [str(i), _range(q0, q1), position_text(spec.positions[q0:q1])]
        has_mask = False
        if gp.paged is not None:
            p = gp.paged
            kv = int(p.kv_lens[i])
            first = int(p.start_page[i]) * ps - int(gp.key_start[i])
            row += [
                str(int(p.start_page[i])),
                str(int(p.num_pages[i])),
                str(int(p.last_page_len[i])),
                str(kv),
                _range(first, first + kv) if kv else "-",
            ]
            if p.mask is not None or p.position_mask is not None:
                has_mask = kv > 0 and q1 > q0
        if gp.ragged is not None:
            r0, r1 = int(gp.ragged.kv_indptr[i]), int(gp.ragged.kv_indptr[i + 1])
            hi = int(n_keys[i])
            row += [_range(r0, r1), _range(hi - (r1 - r0), hi)]
        sees_keys = qo[i] > 0 and n_keys[i] > first_key[i]
        row += [str(int(first_key[i])) if sees_keys else "-", "yes" if has_mask else "no"]
        rows.append(row)
    lines += ["  " + line for line in _table(headers, rows)]
    if gp.items is not None:
        lines += _describe_items(spec, gp)
    return "\n".join(lines)


def _compact(
    values: Sequence[int] | npt.NDArray[np.integer], limit: int = 48, *, runs: bool = True
) -> str:
    """``"0..6,6,7,6"``: the values comma-separated, runs of three or more consecutive
    values as ``a..b`` (unless ``runs`` is false), cut at about ``limit`` characters."""
    vals = [int(v) for v in values]
    parts: list[str] = []
    k = 0
    while k < len(vals):
        end = k
        while runs and end + 1 < len(vals) and vals[end + 1] == vals[end] + 1:
            end += 1
        if end - k >= 2:
            parts.append(f"{vals[k]}..{vals[end]}")
            k = end + 1
        else:
            parts.append(str(vals[k]))
            k += 1
    text = ""
    for n, part in enumerate(parts):
        piece = part if n == 0 else "," + part
        if len(text) + len(piece) > limit:
            return text + ",…"
        text += piece
    return text or "-"


def _describe_items(spec: PlanSpec, gp: GroupPlan) -> list[str]:
    """The multi-item lines of a group: FlashInfer's four arguments and the RoPE
    positions, per request."""
    items = gp.items
    assert items is not None and gp.paged is not None
    stride = items.token_pos_in_items_len
    lines = [
        "  multi-item scoring: the paged call runs FlashInfer's multi-item mask (causal, no "
        "window); a query",
        "  at or after prefix_len_ptr reads its in-item position from its request's row of "
        "token_pos_in_items",
        f"  (0 = delimiter); rows padded to token_pos_in_items_len {stride}; 'rope' = "
        "PlanSpec.positions",
    ]
    headers = ["req", "prefix_len_ptr", "max_item_len", "token_pos_in_items", "pad", "rope"]
    kv = gp.paged.kv_lens.astype(np.int64)
    qo_ptr = spec.qo_indptr
    rows = []
    for i in range(spec.batch_size):
        p = int(items.prefix_len_ptr[i])
        own = max(int(kv[i]) - p, 0)
        row_text = _compact(items.rows[i][:own], runs=False) if own else "- (plain causal)"
        rope = spec.positions[int(qo_ptr[i]) : int(qo_ptr[i + 1])]
        rows.append(
            [str(i), str(p), str(int(items.max_item_len[i])), row_text, str(stride - own),
             _compact(rope)]
        )  # fmt: skip
    left = {"token_pos_in_items", "rope"}
    lines += ["  " + line for line in _table(headers, rows, left=left)]
    return lines


def describe_plan(spec: PlanSpec) -> str:
    """A readable account of ``spec``: per group, its path, window and per-request calls.

    Per request: the query range (``qo_indptr``) and absolute positions of its new tokens;
    for the paged call the first page-table column read (``start_page``), the number of
    pages, ``last_page_len``, the keys the kernel sees (``kv_len``) and which keys of the
    group's key space they are; for the ragged call the rows of ``k_new`` / ``v_new`` and
    the keys they are; ``trim``, the first key any query of the request sees (``-`` when
    it sees none: no queries or no keys); and whether the paged call carries a custom
    mask for the request.
    """
    blocks = [describe_header(spec)]
    blocks += [describe_group(spec, gp, index=k) for k, gp in enumerate(spec.group_plans)]
    return "\n\n".join(blocks)


def format_ints(a: Sequence[int] | npt.NDArray[np.integer]) -> str:
    """``"[1, 2, 3]"`` for any sequence of ints (numpy arrays included)."""
    return "[" + ", ".join(str(int(v)) for v in a) + "]"


def _table(headers: list[str], rows: list[list[str]], *, left: set[str] | None = None) -> list[str]:
    """Right-aligned columns, two spaces apart (text columns, or those named in
    ``left``, left-aligned)."""
    widths = [max([len(h)] + [len(r[c]) for r in rows]) for c, h in enumerate(headers)]
    left_cols = {
        c
        for c, h in enumerate(headers)
        if h in ("queries", "positions") or "keys" in h or "rows" in h or h in (left or ())
    }

    def fmt(cells: list[str]) -> str:
        out = [
            cell.ljust(w) if c in left_cols else cell.rjust(w)
            for c, (cell, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(out).rstrip()

    return [fmt(headers)] + [fmt(r) for r in rows]


# ---------------------------------------------------------------------------- coverage
def kernel_coverage(spec: PlanSpec, group: AttentionGroup) -> list[npt.NDArray[np.int8]]:
    """Which kernel call of ``group`` reads each key, per request.

    Returns one int8 array ``[num_keys_i]`` per request (keys in the group's key space):
    :data:`COVER_PAGED` for keys the paged call (decode or paged prefill) reads,
    :data:`COVER_RAGGED` for keys the ragged call reads (this step's new tokens),
    :data:`COVER_NONE` for keys no call reads. A key read by a call may still be hidden
    from a query by the kernel's causal flag, window or custom mask.
    """
    gp = spec.group_plan(group)
    ps = spec.page_size
    out = []
    for i in range(spec.batch_size):
        n = int(gp.num_keys[i])
        cover = np.zeros(n, dtype=np.int8)
        if gp.paged is not None and gp.paged.kv_lens[i] > 0:
            first = int(gp.paged.start_page[i]) * ps - int(gp.key_start[i])
            lo, hi = max(first, 0), min(first + int(gp.paged.kv_lens[i]), n)
            cover[lo:hi] = COVER_PAGED
        if gp.ragged is not None:
            m = int(gp.ragged.kv_lens[i])
            cover[max(n - m, 0) : n] = COVER_RAGGED
        out.append(cover)
    return out


# ---------------------------------------------------------------------------- pictures
