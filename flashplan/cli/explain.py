"""``python -m flashplan explain``: show the plan of a small layout and what each query sees.

Example::

    python -m flashplan explain --seq-lens 7,40 --prefix-lens 0,33 --window 4
    python -m flashplan explain --seq-lens 14,5 --delimiters "7,9,11,13;"   # multi-item

prints the plan (:func:`flashplan.cli.render.describe_plan`) and, per group, a picture of
the visibility rules (:func:`flashplan.oracle.visibility`: rows are queries with their
absolute positions, columns are keys, ``#`` visible, ``.`` hidden). It then checks that
the plan's kernel calls (:func:`flashplan.materialize`) show exactly those keys,
and exits with 1 if they do not. ``--shared LEVELS`` plans the batch with cascade levels
and shows and checks them too (:mod:`flashplan.cli.cascade_text`). ``--png FILE`` draws
the same pictures with matplotlib, colouring each visible key by the kernel call that
covers it (paged or ragged) and the keys a kernel reads but masks out.

**Size.** The pictures and the check build every group's dense ``[queries, keys]``
masks, so their work grows with the batch's *cells*: queries x keys summed over the
requests (a group's key space: decoder or encoder keys). A group with more than
``--max-cells`` cells (:data:`DEFAULT_MAX_CELLS`, a 4096-token prefill) is not drawn or
checked; its block says so and names the limit, while the layout, the plan's tables and
the cascade check (linear in the batch) are still printed. ``--png`` draws every cell,
so it refuses such a batch (exit status 2, the limit in the message).
Every option is checked before any planning: a ``--png`` file that cannot be written
(a missing directory, a directory, no write permission) or a missing matplotlib is
refused at once, with exit status 2.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import attrs
import numpy as np
import numpy.typing as npt

from flashplan.cli.cascade_text import cascade_problem, describe_cascade, shared_prefix_arg
from flashplan.cli.render import (
    COVER_NONE,
    COVER_PAGED,
    COVER_RAGGED,
    ascii_visibility,
    describe_group,
    describe_header,
    format_ints,
    kernel_coverage,
)
from flashplan.errors import LayoutError, MissingDependencyError, PlanIntegrityError
from flashplan.layout.batch import BatchLayout
from flashplan.layout.drafts import DraftTree
from flashplan.layout.group import AttentionGroup
from flashplan.layout.heads import HeadConfig
from flashplan.layout.shared_prefix import SharedPrefix
from flashplan.oracle import key_space_len, visibility
from flashplan.planning.planner import plan
from flashplan.planning.spec import PlanSpec
from flashplan.planning.visibility import materialize

__all__ = [
    "DEFAULT_MAX_CELLS",
    "MissingDependencyError",
    "build_layout",
    "check_plan",
    "command",
    "configure",
    "delimiter_lists",
    "dense_cells",
    "draw_png",
    "explain",
    "int_list",
    "item_tags",
    "png_problem",
]

#: Heads used by ``explain`` (they do not change the plan's arrays).
EXPLAIN_HEADS = HeadConfig(8, 2, 64)

#: Default of ``--max-cells``: the most cells (queries x keys summed over the requests)
#: of one group that ``explain`` draws and checks densely, 2**24 (a 4096-token prefill);
#: the dense masks take a few bytes and tens of nanoseconds per cell.
DEFAULT_MAX_CELLS = 1 << 24


def int_list(text: str) -> list[int]:
    """Parse ``"7,40"`` (commas, optional spaces) into ``[7, 40]`` for argparse."""
    parts = [p.strip() for p in text.split(",")]
    if parts == [""]:
        return []
    try:
        return [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers such as 7,40; got {text!r}"
        ) from None


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an int ``>= minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer; got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}; got {value}")
        return value

    return parse


def delimiter_lists(text: str) -> list[list[int]]:
    """Parse ``--delimiters``: one entry per request, separated by ``;``; each entry the
    request's delimiter positions (among its new tokens), separated by ``,``; an empty
    entry (or ``-``) for a request without delimiters.

    ``"7,9,11,13"`` is one request; ``"7,9,11,13;"`` two, the second without; ``"3,6,8;
    2,4,8,11"`` two requests with delimiters.
    """
    out: list[list[int]] = []
    for entry in text.split(";"):
        entry = entry.strip()
        if entry in ("", "-"):
            out.append([])
            continue
        try:
            out.append(int_list(entry))
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(
                f"expected per-request delimiter lists such as '7,9,11,13;' (';' between "
                f"requests, ',' between positions, empty for none); got {text!r}"
            ) from None
    return out


def configure(parser: argparse.ArgumentParser) -> None:
    """Add ``explain``'s arguments to ``parser``."""
    parser.add_argument(
        "--seq-lens",
        type=int_list,
        default=None,
        metavar="L,L,...",
        help="decoder KV length of each request after the step (new tokens included); "
        "required but with --parents",
    )
    parser.add_argument(
        "--prefix-lens",
        type=int_list,
        default=None,
        metavar="P,P,...",
        help="tokens already cached per request (extend; default 0)",
    )
    parser.add_argument(
        "--decode",
        action="store_true",
        help="a decode step: one new token per request (prefix = seq - 1)",
    )
    parser.add_argument(
        "--parents",
        default=None,
        metavar="-1,0,0,1[;...]",
        help="a target-verify step: each request's draft tree as parent indices (-1 at "
        "token 0), one tree for all or one per request separated by ';'; the prefixes "
        "are --prefix-lens",
    )
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV page (16)")
    parser.add_argument(
        "--window",
        type=int,
        action="append",
        default=[],
        metavar="W",
        help="add a sliding-window group with window_left W (a query at p "
        "sees keys p-W..p; HF sliding_window = W + 1); repeatable",
    )
    parser.add_argument(
        "--chunk",
        type=int,
        action="append",
        default=[],
        metavar="C",
        help="add a chunked local attention group (Llama 4 attention_chunk_size C: a query "
        "at p sees keys C*(p//C)..p); repeatable",
    )
    parser.add_argument(
        "--local",
        type=int_list,
        action="append",
        default=[],
        metavar="L,R",
        help="add a bidirectional-window group (a query at p sees keys p-L..p+R; "
        "ModernBERT / EmbeddingGemma local layers); repeatable",
    )
    parser.add_argument(
        "--sinks",
        action="store_true",
        help="give every group attention sinks (gpt-oss; the pictures are the same, the "
        "plan names the kernel call that folds the sink in)",
    )
    parser.add_argument(
        "--cross", action="store_true", help="add a cross-attention group (needs --encoder-lens)"
    )
    parser.add_argument(
        "--encoder-lens",
        type=int_list,
        default=None,
        metavar="N,N,...",
        help="encoder tokens per request (their pages come first in the page-table row)",
    )
    parser.add_argument(
        "--bidirectional",
        action="store_true",
        help="make the full-attention group non-causal (each new token "
        "sees every key of its request)",
    )
    parser.add_argument(
        "--delimiters",
        type=delimiter_lists,
        default=None,
        metavar="D,D,..;D,..",
        help="multi-item scoring: per request (';' between requests) the delimiter "
        "positions among its new tokens (',' between them; empty for a request without); "
        "e.g. '7,9,11,13;' for two requests, the second plain",
    )
    parser.add_argument(
        "--shared",
        type=shared_prefix_arg,
        default=None,
        metavar="LEVELS",
        help="shared prefixes, planned with cascade levels: levels separated by ';', "
        "groups by ',', each first-last:tokens (e.g. '0-3:20; 1-2:33')",
    )
    parser.add_argument(
        "--path",
        choices=("auto", "paged", "ragged"),
        default="auto",
        help="extend path of self-attention groups (auto)",
    )
    parser.add_argument(
        "--max-cols",
        type=_int_at_least(8),
        default=80,
        help="widest picture drawn in full, in keys (80; at least 8)",
    )
    parser.add_argument(
        "--max-cells",
        type=_int_at_least(1),
        default=DEFAULT_MAX_CELLS,
        metavar="N",
        help="most cells (queries x keys, summed over the requests) of a group drawn and "
        f"checked densely ({DEFAULT_MAX_CELLS}, a 4096-token prefill); a larger group "
        "gets its plan table only, and --png refuses it",
    )
    parser.add_argument(
        "--png",
        metavar="FILE",
        default=None,
        help="also draw the pictures into a PNG file (needs matplotlib; the file's "
        "directory must exist and be writable; refused over --max-cells)",
    )


def build_layout(args: argparse.Namespace) -> BatchLayout:
    """The layout described by ``explain``'s arguments.

    Raises:
        LayoutError: invalid lengths, page size, window or encoder lengths, or
            ``--prefix-lens`` together with ``--decode``.
    """
    base = AttentionGroup.bidirectional() if args.bidirectional else AttentionGroup.full()
    groups = [base]
    for w in args.window:
        g = AttentionGroup() if w == -1 else AttentionGroup.sliding(w)
        if g not in groups:
            groups.append(g)
    for c in args.chunk:
        g = AttentionGroup.chunked(c)
        if g not in groups:
            groups.append(g)
    for bounds in args.local:
        if len(bounds) != 2:
            raise LayoutError("local", "takes two bounds L,R", value=bounds)
        g = AttentionGroup.bidirectional(window_left=bounds[0], window_right=bounds[1])
        if g not in groups:
            groups.append(g)
    if args.cross:
        groups.append(AttentionGroup.cross())
    if args.sinks:
        groups = [attrs.evolve(g, sinks=True) for g in groups]
    if args.parents is not None:
        if args.decode or args.prefix_lens is None:
            raise LayoutError("parents", "a verify step takes --prefix-lens (and not --decode)")
        trees = [int_list(t) for t in args.parents.split(";")]
        if len(trees) == 1:
            trees = trees * len(args.prefix_lens)
        if len({len(t) for t in trees}) != 1 or len(trees) != len(args.prefix_lens):
            raise LayoutError(
                "parents", "one tree (or one per request) of the same size N is needed"
            )
        draft = DraftTree.from_parents(np.array(trees, dtype=np.int64).reshape(len(trees), -1))
        return BatchLayout.verify(
            args.prefix_lens,
            draft,
            page_size=args.page_size,
            groups=groups,
            encoder_lens=args.encoder_lens,
        )
    if args.seq_lens is None:
        raise LayoutError("seq_lens", "--seq-lens is required (or --parents for a verify step)")
    if args.decode:
        if args.prefix_lens is not None:
            raise LayoutError(
                "prefix_lens", "cannot be given with --decode (a decode step has prefix = seq - 1)"
            )
        if getattr(args, "delimiters", None) is not None:
            raise LayoutError(
                "item_delimiters", "cannot be given with --decode (multi-item scoring is an extend)"
            )
        return BatchLayout.decode(
            args.seq_lens, page_size=args.page_size, groups=groups, encoder_lens=args.encoder_lens
        )
    return BatchLayout.extend(
        args.seq_lens,
        args.prefix_lens,
        page_size=args.page_size,
        groups=groups,
        encoder_lens=args.encoder_lens,
        item_delimiters=getattr(args, "delimiters", None),
    )


def item_tags(spec: PlanSpec, layout: BatchLayout) -> list[list[str] | None] | None:
    """Per request, a label per query of a multi-item batch: ``<d>`` for a delimiter,
    ``iK`` for a token of item K (the item after delimiter K), nothing for the prefix;
    each followed by ``@`` and its RoPE position where it differs from the query's own
    position. ``None`` for an ordinary batch, and for a request without delimiters."""
    items = layout.item_delimiters
    if items is None:
        return None
    out: list[list[str] | None] = []
    qo = spec.qo_indptr.tolist()
    for i in range(layout.batch_size):
        d = items.request(i).tolist()
        if not d:
            out.append(None)
            continue
        pre = int(layout.prefix_lens[i])
        rope = spec.positions[qo[i] : qo[i + 1]].tolist()
        marks = set(d)
        tags = []
        item = 0
        for j in range(int(layout.extend_lens[i])):
            if j in marks:
                item += 1
                tag = "<d>"
            else:
                tag = f"i{item}" if item else ""
            if rope[j] != pre + j:
                tag += f" @{rope[j]}"
            tags.append(tag)
        out.append(tags)
    return out


def dense_cells(layout: BatchLayout, group: AttentionGroup) -> int:
    """The cells of ``group``'s dense masks: queries x keys (the group's key space),
    summed over the requests; what the picture and the check of the group cost (the
    oracle's :func:`~flashplan.oracle.visibility` and :func:`~flashplan.materialize`
    each build one bool per cell)."""
    keys = key_space_len(layout, group).astype(np.int64)
    return int(np.dot(layout.extend_lens.astype(np.int64), keys))


def _over_limit(cells: int, max_cells: int) -> str:
    """The sentence that says a group's cells are over ``--max-cells``."""
    return (
        f"{cells:,} cells (queries x keys summed over the requests), over the limit of "
        f"{max_cells:,} (--max-cells)"
    )


def check_plan(spec: PlanSpec, layout: BatchLayout, group: AttentionGroup) -> str | None:
    """``None`` when the plan's kernel calls show exactly the oracle's keys, else why not."""
    try:
        got = materialize(spec, group)
    except PlanIntegrityError as exc:
        return str(exc)
    for i, (g, want) in enumerate(zip(got, visibility(layout, group), strict=True)):
        if g.shape != want.shape or not np.array_equal(g, want):
            return f"request {i}: the kernel calls do not show the keys the rules say"
    return None


def explain(
    layout: BatchLayout,
    *,
    extend_path: str = "auto",
    heads: HeadConfig = EXPLAIN_HEADS,
    max_cols: int = 80,
    shared_prefix: SharedPrefix | None = None,
    max_cells: int = DEFAULT_MAX_CELLS,
) -> tuple[str, bool]:
    """The text ``explain`` prints for ``layout``, and whether every plan check that ran
    passed.

    With ``shared_prefix`` the batch is planned with ``cascade="on"``, and the cascade
    levels and own parts are shown and checked too
    (:mod:`~flashplan.cli.cascade_text`). A group with more than ``max_cells`` cells
    (:func:`dense_cells`) gets its plan table and a line naming the limit instead of
    its picture and dense check, so the work stays linear in the batch beyond it."""
    spec = plan(
        layout, heads, extend_path=extend_path, shared_prefix=shared_prefix,
        cascade="off" if shared_prefix is None else "on",
    )  # fmt: skip
    ok = True
    seq, pre = layout.seq_lens, layout.prefix_lens
    blocks = [
        f"layout: {layout.mode.value}, seq_lens {format_ints(seq)}, "
        f"prefix_lens {format_ints(pre)}, extend_lens {format_ints(layout.extend_lens)}, "
        f"page_size {layout.page_size}"
        + (
            ""
            if layout.encoder_lens is None
            else f", encoder_lens {format_ints(layout.encoder_lens)}"
        )
        + (
            ""
            if layout.item_delimiters is None
            else f", item_delimiters {layout.item_delimiters.to_lists()}"
        ),
        describe_header(spec),
    ]
    starts = spec.prefix_lens
    tags = item_tags(spec, layout)
    qo = spec.qo_indptr.tolist()
    # A verify tree's rows are labelled by position (prefix + depth), not by slot.
    positions = (
        [spec.positions[qo[i] : qo[i + 1]] for i in range(spec.batch_size)]
        if layout.draft is not None
        else None
    )
    for index, gp in enumerate(spec.group_plans):
        group = gp.group
        cells = dense_cells(layout, group)
        if cells > max_cells:
            blocks.append(
                describe_group(spec, gp, index=index)
                + "\n\n"
                + textwrap.fill(
                    f"visibility: not drawn or checked: {_over_limit(cells, max_cells)}; "
                    "raise it to draw and check this group (time and memory grow with "
                    "the cells)",
                    width=90,
                    initial_indent="  ",
                    subsequent_indent="  ",
                )
            )
            continue
        key_name = "encoder keys" if group.cross_attention else "keys"
        group_tags = None if group.cross_attention else tags
        pictures = ascii_visibility(
            visibility(layout, group),
            q_start=starts,
            positions=positions,
            key_name=key_name,
            max_cols=max_cols,
            row_tags=group_tags,
        )
        legend = ""
        if group_tags is not None:
            legend = (
                "\n  rows: <d> a delimiter, iK a token of item K, untagged the prefix; "
                "@p its RoPE position where it is not its own"
            )
        problem = check_plan(spec, layout, group)
        if problem is None:
            verdict = "check: the plan's kernel calls show exactly these keys"
        else:
            ok = False
            verdict = f"MISMATCH: {problem}"
        blocks.append(
            describe_group(spec, gp, index=index)
            + "\n\n  visibility ('#' visible, '.' hidden; rows: queries by position):"
            + legend
            + "\n"
            + _indent(pictures, "  ")
            + f"\n  {verdict}"
        )
    if shared_prefix is not None:
        problem = cascade_problem(spec, layout)
        ok &= problem is None
        blocks.append(
            describe_cascade(spec)
            + "\n  "
            + (
                "check: the levels and own parts read each request's keys exactly once"
                if problem is None
                else f"MISMATCH: {problem}"
            )
        )
    return "\n\n".join(blocks), ok


def _indent(text: str, prefix: str) -> str:
    return "\n".join(prefix + line if line else line for line in text.splitlines())


# ---------------------------------------------------------------------------- PNG
_COLOURS = {
    "hidden": (1.0, 1.0, 1.0),
    "masked": (0.85, 0.85, 0.85),
    "paged": (0.12, 0.47, 0.71),
    "ragged": (1.0, 0.50, 0.05),
    "unread": (0.84, 0.15, 0.16),
}
#: The same colours as uint8 RGB (a picture's pixels: 3 bytes per cell, not 24).
_RGB8 = {name: np.round(np.array(c) * 255).astype(np.uint8) for name, c in _COLOURS.items()}


def _int_ticks(first: int, count: int, most: int = 8) -> list[int]:
    """At most ``most`` integer ticks over ``first .. first + count - 1``."""
    step = max(1, -(-count // most))
    ticks = list(range(first, first + count, step))
    return ticks


#: Most rows and columns of a request's mask a PNG panel is drawn from (a panel is a few
#: hundred pixels wide; nearest-neighbour display would pick that few anyway).
_PANEL_CELLS = 1024


def _panel_rgb(mask: npt.NDArray[np.bool_], cover: npt.NDArray[np.int8]) -> npt.NDArray[np.uint8]:
    """A panel's pixels: uint8 RGB ``[rows, cols, 3]`` from a request's bool ``mask``
    ``[queries, keys]`` and its int8 ``cover`` ``[keys]`` (:func:`kernel_coverage`),
    every k-th row and column where there are more than :data:`_PANEL_CELLS`."""
    e, n = mask.shape
    rows, cols = -(-e // _PANEL_CELLS), -(-n // _PANEL_CELLS)
    m, c = mask[::rows, ::cols], cover[None, ::cols]
    rgb = np.empty((*m.shape, 3), dtype=np.uint8)
    rgb[:] = _RGB8["hidden"]
    rgb[~m & (c != COVER_NONE)] = _RGB8["masked"]
    rgb[m & (c == COVER_PAGED)] = _RGB8["paged"]
    rgb[m & (c == COVER_RAGGED)] = _RGB8["ragged"]
    rgb[m & (c == COVER_NONE)] = _RGB8["unread"]
    return rgb


def draw_png(spec: PlanSpec, layout: BatchLayout, path: str) -> None:
    """Draw every group's visibility pictures into the PNG file ``path``.

    One row of panels per group, one panel per request; rows are queries (by absolute
    position), columns are keys. A visible key is blue when the paged call (decode or
    paged prefill) covers it and orange when the ragged call does; light grey keys are
    read by a kernel but masked out (leading keys of a page, or the window); white keys
    are not read. Red would mark a visible key no call reads (a planner bug).

    Raises:
        MissingDependencyError: matplotlib is not installed.
        OSError: the file cannot be written.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:
        raise MissingDependencyError(
            "--png needs matplotlib: pip install 'flashplan[plot]' (or pip install matplotlib)"
        ) from None

    bs, ng = layout.batch_size, len(spec.group_plans)
    starts = spec.prefix_lens
    fig = Figure(figsize=(max(6.0, 3.2 * max(bs, 1)), 2.8 * ng + 0.8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(ng, max(bs, 1), squeeze=False)
    for r, gp in enumerate(spec.group_plans):
        masks = visibility(layout, gp.group)
        cover = kernel_coverage(spec, gp.group)
        for i in range(max(bs, 1)):
            ax = axes[r][i]
            ax.set_title(f"{gp.group.describe()}\nrequest {i} [{gp.path.value}]", fontsize=8)
            if i >= bs or masks[i].size == 0:
                ax.axis("off")
                ax.text(
                    0.5,
                    0.5,
                    "no queries or no keys",
                    ha="center",
                    va="center",
                    fontsize=8,
                    transform=ax.transAxes,
                )
                continue
            e, n = masks[i].shape
            p0 = int(starts[i])
            ax.imshow(
                _panel_rgb(masks[i], cover[i]),
                interpolation="nearest",
                aspect="auto",
                extent=(-0.5, n - 0.5, p0 + e - 0.5, p0 - 0.5),
            )
            ax.set_xlabel("encoder key" if gp.group.cross_attention else "key", fontsize=8)
            ax.set_ylabel("query position", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.set_xticks(_int_ticks(0, n))
            ax.set_yticks(_int_ticks(p0, e))
    handles = [
        Patch(color=_COLOURS["paged"], label="visible, paged call (decode / paged prefill)"),
        Patch(color=_COLOURS["ragged"], label="visible, ragged call (new tokens)"),
        Patch(color=_COLOURS["masked"], label="read by a kernel, masked out"),
        Patch(facecolor=_COLOURS["hidden"], edgecolor="0.6", label="not read"),
    ]
    fig.legend(handles=handles, loc="outside lower center", ncol=2, fontsize=8)
    fig.savefig(path, dpi=110, format="png")  # whatever the file name's suffix


# ---------------------------------------------------------------------------- command
def png_problem(path: str) -> str | None:
    """Why ``--png path`` cannot be honoured, or ``None``; checked before any work.

    Refused: an empty path, a directory, a file in a directory that does not exist or
    is not writable, an existing file that is not writable, and no matplotlib (looked
    up, not imported).
    """
    if not path:
        return "--png: the file name is empty"
    target = Path(path)
    parent = target.parent
    if target.is_dir():
        return f"--png: {path!r} is a directory, not a file"
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        return f"--png: the directory {str(parent)!r} of {path!r} {what}"
    if target.exists():
        if not os.access(target, os.W_OK):
            return f"--png: {path!r} exists and is not writable"
    elif not os.access(parent, os.W_OK | os.X_OK):
        return f"--png: the directory {str(parent)!r} of {path!r} is not writable"
    if importlib.util.find_spec("matplotlib") is None:
        return "--png needs matplotlib: pip install 'flashplan[plot]' (or pip install matplotlib)"
    return None


def _png_size_problem(layout: BatchLayout, max_cells: int) -> str | None:
    """Why ``--png`` refuses ``layout`` (a group over ``max_cells``), or ``None``."""
    for index, group in enumerate(layout.groups):
        cells = dense_cells(layout, group)
        if cells > max_cells:
            return (
                f"--png draws every cell: group {index} ({group.describe()}) has "
                f"{_over_limit(cells, max_cells)}: draw a smaller batch or raise --max-cells"
            )
    return None


def _refuse(problem: str) -> int:
    """Report a refused option as argparse does (one line on stderr); exit status 2."""
    print(f"flashplan explain: error: {problem}", file=sys.stderr)
    return 2


def command(args: argparse.Namespace) -> int:
    """Run ``explain``; return the exit status (0 ok, 1 plan mismatch or a PNG write
    that failed, 2 an option refused before any planning: a ``--png`` file that cannot
    be written, no matplotlib, or a batch over ``--max-cells`` with ``--png``).

    Raises:
        FlashplanError: invalid layout (the caller reports it and exits with 2).
    """
    if args.png is not None and (problem := png_problem(args.png)) is not None:
        return _refuse(problem)
    layout = build_layout(args)
    if args.png is not None and (problem := _png_size_problem(layout, args.max_cells)):
        return _refuse(problem)
    text, ok = explain(
        layout,
        extend_path=args.path,
        max_cols=args.max_cols,
        shared_prefix=args.shared,
        max_cells=args.max_cells,
    )
    print(text)
    if args.png is not None:
        spec = plan(layout, EXPLAIN_HEADS, extend_path=args.path)
        try:
            draw_png(spec, layout, args.png)
        except (MissingDependencyError, OSError) as exc:
            print(f"flashplan explain: error: {exc}", file=sys.stderr)
            return 1
        print(f"\nwrote {args.png}")
    return 0 if ok else 1
