"""Text pictures of visibility masks: which keys each query sees, one picture per request.

:func:`ascii_visibility` draws what :func:`flashplan.materialize` or the oracle returns;
``explain`` prints it, and :meth:`flashplan.PlanSpec.to_string` draws a plan's group.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

__all__ = ["ascii_visibility", "position_text"]


def position_text(values: npt.NDArray[np.integer]) -> str:
    """``"5..9"`` for consecutive positions, else the list (``"7, 8, 8, 9"``)."""
    if values.size == 0:
        return "-"
    lo, hi = int(values[0]), int(values[-1])
    if values.size == hi - lo + 1 and (np.diff(values) == 1).all():
        return str(lo) if lo == hi else f"{lo}..{hi}"
    return ", ".join(str(int(v)) for v in values)


_GAP = " ~ "


def _columns(n: int, max_cols: int, first_visible: int) -> list[int | None]:
    """Key index of each display column (``None`` = the gap marker): head, gap, tail.

    The head is the first ``max_cols // 4`` keys; when the first visible key of the drawn
    rows would fall into the gap, the tail is widened (down to a 4-key head) to show it.
    """
    if n <= max_cols:
        return list(range(n))
    room = max_cols - len(_GAP)
    head = max(max_cols // 4, 1)
    tail = room - head
    if head <= first_visible < n - tail:
        want = n - max(first_visible - 2, 0)
        if want <= room - 4:
            tail, head = want, room - want
    return [*range(head), *([None] * len(_GAP)), *range(n - tail, n)]


def _ruler(cols: list[int | None]) -> tuple[str, str]:
    """Two lines: key labels and ``|`` ticks under the labelled columns."""
    width = len(cols)
    labels = [" "] * (width + 8)
    ticks = [" "] * width
    taken: list[tuple[int, int]] = []
    keyed = [(c, k) for c, k in enumerate(cols) if k is not None]
    if not keyed:
        return "", ""
    # Priority: first key, last key, first key after the gap, then multiples of 10.
    wanted = [keyed[0], keyed[-1]]
    wanted += [(c, k) for c, k in keyed if c > 0 and cols[c - 1] is None]
    wanted += [(c, k) for c, k in keyed if k % 10 == 0]
    for c, k in wanted:
        text = str(k)
        lo, hi = c, c + len(text)
        if any(lo <= t_hi and t_lo <= hi for t_lo, t_hi in taken):  # keep one blank between
            continue
        taken.append((lo, hi))
        labels[lo:hi] = text
        ticks[c] = "|"
    return "".join(labels).rstrip(), "".join(ticks).rstrip()


def _picture(
    mask: npt.NDArray[np.bool_],
    labels: npt.NDArray[np.int64],
    *,
    max_cols: int,
    max_rows: int,
    indent: str,
    tags: Sequence[str] | None = None,
) -> list[str]:
    e, n = mask.shape
    half = max(max_rows // 2, 1)
    if e > max_rows:
        shown: list[int | None] = [*range(half), None, *range(e - half, e)]
    else:
        shown = list(range(e))
    drawn = mask[[j for j in shown if j is not None]]
    seen_cols = np.flatnonzero(drawn.any(axis=0))
    cols = _columns(n, max_cols, int(seen_cols[0]) if seen_cols.size else n)
    keyed = np.array([k for k in cols if k is not None], dtype=np.int64)
    pos_w = max(3, len(str(int(labels.max()) if labels.size else 0)))
    tag_w = max((len(t) for t in tags), default=0) if tags is not None else 0
    label_w = pos_w + (tag_w + 1 if tag_w else 0)
    pad = indent + " " * (label_w + 2)
    lines = []
    if n:
        label_line, tick_line = _ruler(cols)
        lines += [pad + label_line, pad + tick_line]
    for j in shown:
        if j is None:
            lines.append(f"{indent}{'~':>{label_w}}  ({e - 2 * half} rows not shown)")
            continue
        row = mask[j]
        cells = np.full(len(cols), " ", dtype="<U1")
        is_key = np.array([k is not None for k in cols], dtype=bool)
        cells[is_key] = np.where(row[keyed], "#", ".")
        if not is_key.all():
            cells[~is_key] = list(_GAP)
        vis = np.flatnonzero(row)
        if vis.size == 0:
            note = "0"
        elif vis.size == int(vis[-1]) - int(vis[0]) + 1:
            note = f"{vis.size}: {vis[0]}..{vis[-1]}"
        else:
            note = f"{vis.size}: {vis[0]}..{vis[-1]} (with gaps)"
        label = f"{int(labels[j]):>{pos_w}}"
        if tag_w:
            assert tags is not None
            label += " " + tags[j].ljust(tag_w)
        lines.append(f"{indent}{label}  {''.join(cells)}   {note}")
    return lines


def ascii_visibility(
    masks: Sequence[npt.NDArray[np.bool_]],
    *,
    q_start: Sequence[int] | npt.NDArray[np.integer] | None = None,
    positions: Sequence[npt.NDArray[np.integer]] | None = None,
    key_name: str = "keys",
    max_cols: int = 80,
    max_rows: int = 32,
    indent: str = "  ",
    row_tags: Sequence[Sequence[str] | None] | None = None,
) -> str:
    """Draw per-request visibility masks as text.

    One picture per request: a ruler of key indices, then one row per query labelled
    with its absolute position, ``#`` where the query sees the key and ``.`` where it
    does not, and after the row how many keys it sees and the first..last of them.
    Pictures wider than ``max_cols`` keys show the first ``max_cols // 4`` keys, a
    `` ~ `` gap and the last keys (the per-row counts still cover every key); more than
    ``max_rows`` queries show the first and last ``max_rows // 2`` rows.

    Args:
        masks: one boolean array ``[num_queries_i, num_keys_i]`` per request.
        q_start: absolute position of each request's first query (default 0): for a
            self group the request's cached prefix length ``P``.
        positions: instead of ``q_start``, each request's query positions (a verify
            tree's are not consecutive).
        key_name: what the columns are, for the per-request title (``"keys"``,
            ``"encoder keys"``).
        max_cols: widest picture drawn in full (>= 8).
        max_rows: most query rows drawn in full (>= 2).
        indent: prefix of every line.
        row_tags: per request, a short label per query drawn after its position (or
            ``None`` for none), e.g. the token kinds of a multi-item request.
    """
    max_cols = max(int(max_cols), 8)
    max_rows = max(int(max_rows), 2)
    starts = [0] * len(masks) if q_start is None else [int(s) for s in q_start]
    if len(starts) != len(masks):
        raise ValueError(f"q_start has {len(starts)} entries for {len(masks)} masks")
    if positions is not None and len(positions) != len(masks):
        raise ValueError(f"positions has {len(positions)} entries for {len(masks)} masks")
    if not masks:
        return "(no requests)"
    lines: list[str] = []
    for i, (m, s) in enumerate(zip(masks, starts, strict=True)):
        m = np.asarray(m, dtype=bool)
        if m.ndim != 2:
            raise ValueError(f"masks[{i}] must be 2-D [queries, keys], got shape {m.shape}")
        e, n = m.shape
        labels = (
            np.asarray(positions[i], dtype=np.int64)
            if positions is not None
            else s + np.arange(e, dtype=np.int64)
        )
        qs = "query" if e == 1 else "queries"
        where = f" at position{'s' if e > 1 else ''} {position_text(labels)}" if e else ""
        keys = key_name.removesuffix("s") if n == 1 else key_name
        lines.append(f"request {i}: {e} {qs}{where}; {n} {keys}")
        if e == 0:
            continue
        if n == 0:
            lines.append(f"{indent}(no {key_name}: every query sees nothing, output 0, LSE -inf)")
            continue
        tags = None if row_tags is None else row_tags[i]
        lines += _picture(m, labels, max_cols=max_cols, max_rows=max_rows, indent=indent, tags=tags)
    return "\n".join(lines)
