"""The command line: ``python -m flashplan demo`` / ``explain`` and the text renderings.

Expected lines are derived by hand from the semantics (docs/semantics.md), not copied from the
tool's output: e.g. a decode query at position 4 with ``window_left = 2`` sees keys 2..4.
"""

from __future__ import annotations

import io
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import flashplan as fp
from flashplan import AttentionGroup, BatchLayout, HeadConfig, plan
from flashplan.__main__ import main
from flashplan.cli.demo import run_demo, tolerance_for
from flashplan.cli.render import (
    COVER_NONE,
    COVER_PAGED,
    COVER_RAGGED,
    ascii_visibility,
    describe_plan,
    kernel_coverage,
)

HEADS = HeadConfig(8, 2, 64)


ROOT = pathlib.Path(__file__).resolve().parents[1]


def _cpu_env() -> dict[str, str]:
    env = dict(os.environ)
    env["CUDA_VISIBLE_DEVICES"] = ""  # the demo must run (and pass) on the CPU
    # Import this checkout's flashplan even when it is not installed.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flashplan", *args],
        capture_output=True,
        text=True,
        env=_cpu_env(),
        cwd=ROOT,
        timeout=300,
    )


def _explain(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(["explain", *args]) == 0
    return capsys.readouterr().out


def _group_block(text: str, title: str) -> list[str]:
    """The lines of the block of the group titled ``group N: <title>``."""
    blocks = text.split("\n\n")
    for k, block in enumerate(blocks):
        first = block.splitlines()[0]
        if first.startswith("group ") and first.split(": ", 1)[1] == title:
            # the group's block runs until the next "group" block
            rest = []
            for later in blocks[k + 1 :]:
                if later.startswith("group "):
                    break
                rest.append(later)
            return "\n\n".join([block, *rest]).splitlines()
    raise AssertionError(f"no group {title!r} in:\n{text}")


def _plan_row(lines: list[str], req: int) -> list[str]:
    """Whitespace-split cells of request ``req``'s row in a group's plan table."""
    header = next(k for k, line in enumerate(lines) if line.strip().startswith("req "))
    return lines[header + 1 + req].split()


def _picture_row(lines: list[str], position: int) -> str:
    """The picture row of the query at ``position``: its cells and note, after the label."""
    start = next(k for k, line in enumerate(lines) if "visibility (" in line)
    rows = [
        line.strip()
        for line in lines[start:]
        if line.strip().startswith(f"{position}  ") and ("#" in line or "." in line)
    ]
    return rows[0].removeprefix(f"{position}  ")


# ---------------------------------------------------------------------------- demo
def test_demo_in_process_reports_error_below_tolerance() -> None:
    out = io.StringIO()
    worst = run_demo("cpu", stream=out)
    text = out.getvalue()
    assert 0.0 <= worst <= tolerance_for(torch.float32)
    assert "ReferenceExecutor" in text
    # Every group of every batch reports its error and correct KV writes.
    assert text.count("kv writes ok") == 2 + 3 + 3 + 2
    assert "multi-item mask" in text and "prefix_len_ptr" in text
    assert "WRONG" not in text
    assert "path ragged+paged" in text and "path decode" in text
    assert text.rstrip().endswith("OK")


def test_demo_subprocess_exits_zero() -> None:
    proc = _run_cli("demo")
    assert proc.returncode == 0, proc.stderr
    assert "worst error" in proc.stdout
    assert proc.stdout.rstrip().endswith("OK")
    assert "Traceback" not in proc.stderr


# ---------------------------------------------------------------------------- explain
def test_explain_decode_window_shows_last_three_keys(capsys: pytest.CaptureFixture[str]) -> None:
    text = _explain(capsys, "--decode", "--seq-lens", "5", "--window", "2")
    window = _group_block(text, "self causal window=2")
    full = _group_block(text, "self causal")
    # window_left 2: the query at position 4 sees keys 2, 3, 4 (HF sliding_window 3).
    assert _picture_row(window, 4) == "..###   3: 2..4"
    assert _picture_row(full, 4) == "#####   5: 0..4"
    assert any("Hugging Face sliding_window = 3" in line for line in window)
    # One page of 5 tokens; the kernel reads keys [0, 5) and the window trims to key 2.
    assert _plan_row(window, 0) == [
        "0",
        "[0,",
        "1)",
        "4",
        "0",
        "1",
        "5",
        "5",
        "[0,",
        "5)",
        "2",
        "no",
    ]
    assert "check: the plan's kernel calls show exactly these keys" in window[-1]


def test_explain_extend_window_paged_and_ragged(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--seq-lens", "7,40", "--prefix-lens", "0,33", "--window", "4"]
    paged = _group_block(_explain(capsys, *args, "--path", "paged"), "self causal window=4")
    # Request 1: queries at 33..39 see p-4..p. Paged-only trim min(L, W + E) = 11 keys from
    # key 29, which lives in page 1 (keys 16..31): the kernel reads pages 1, 2 = 24 keys
    # [16, 40) with last_page_len 40 - 32 = 8; the window hides 16..28.
    assert _plan_row(paged, 1) == [
        "1", "[7,", "14)", "33..39", "1", "2", "8", "24", "[16,", "40)", "29", "no",
    ]  # fmt: skip
    assert _picture_row(paged, 33) == "." * 29 + "#####" + "." * 6 + "   5: 29..33"
    assert _picture_row(paged, 39) == "." * 35 + "#####" + "   5: 35..39"
    # Request 0 (no prefix): query 6 sees keys 2..6.
    assert _picture_row(paged, 6) == "..#####   5: 2..6"

    ragged = _group_block(_explain(capsys, *args, "--path", "ragged"), "self causal window=4")
    assert "path ragged+paged" in ragged[1]
    # Prefix part: keys [29, 33) needed -> from page 1: [16, 33), 17 keys, last page 1 key;
    # the window bites inside it, so the paged call carries a custom mask. Ragged part:
    # the 7 new tokens, rows [7, 14) of k_new, keys [33, 40).
    assert _plan_row(ragged, 1) == [
        "1", "[7,", "14)", "33..39", "1", "2", "1", "17", "[16,", "33)",
        "[7,", "14)", "[33,", "40)", "29", "yes",
    ]  # fmt: skip
    assert _picture_row(ragged, 33) == _picture_row(paged, 33)


def test_explain_page_math_and_cross(capsys: pytest.CaptureFixture[str]) -> None:
    text = _explain(
        capsys, "--seq-lens", "17,3", "--prefix-lens", "16,0", "--cross",
        "--encoder-lens", "20,0", "--path", "paged",
    )  # fmt: skip
    # Encoder 20 tokens -> 2 pages; decoder KV of request 0 starts at token 32.
    assert "decoder KV starts at row token [32, 0]" in text
    cross = _group_block(text, "cross bidirectional")
    assert _plan_row(cross, 0) == [
        "0", "[0,", "1)", "16", "0", "2", "4", "20", "[0,", "20)", "0", "no",
    ]  # fmt: skip
    # Request 1 has no encoder tokens: empty segment, last_page_len 0, no visible key.
    assert _plan_row(cross, 1) == ["1", "[1,", "4)", "0..2", "0", "0", "0", "0", "-", "-", "no"]
    assert any("(no encoder keys: every query sees nothing" in line for line in cross)
    full = _group_block(text, "self causal")
    # 17 decoder tokens from token 32: pages 2 and 3 of the row, 17 = 16 + 1 keys.
    assert _plan_row(full, 0) == [
        "0", "[0,", "1)", "16", "2", "2", "1", "17", "[0,", "17)", "0", "no",
    ]  # fmt: skip
    assert _picture_row(cross, 16) == "#" * 20 + "   20: 0..19"


def test_explain_bidirectional(capsys: pytest.CaptureFixture[str]) -> None:
    text = _explain(capsys, "--seq-lens", "4", "--prefix-lens", "1", "--bidirectional")
    block = _group_block(text, "self bidirectional")
    for pos in (1, 2, 3):
        assert _picture_row(block, pos) == "####   4: 0..3"


def test_explain_multi_item(capsys: pytest.CaptureFixture[str]) -> None:
    """The reference file's example beside a plain request with a cached prefix."""
    text = _explain(
        capsys, "--seq-lens", "14,5", "--prefix-lens", "0,2", "--delimiters", "7,9,11,13;"
    )
    assert "item_delimiters [[7, 9, 11, 13], []]" in text
    block = _group_block(text, "self causal")
    assert any("multi-item mask" in line for line in block)
    table = next(k for k, line in enumerate(block) if line.strip().startswith("req  prefix_len"))
    # prefix_len_ptr 7 (the question), max_item_len 1, positions of the answers after it
    assert block[table + 1].split() == ["0", "7", "1", "0,1,0,1,0,1,0", "0", "0..6,6,7,6,7,6,7,6"]
    # the plain request: prefix_len_ptr = seq_len, so FlashInfer leaves it causal
    assert block[table + 2].split()[:3] == ["1", "5", "0"]
    rows = {
        int(line.split()[0]): line
        for line in block
        if line.strip()[:2].strip().isdigit() and ("#" in line or "." in line)
    }
    # a delimiter sees the question only; "London" (position 8) the question and itself
    assert "<d> @6" in rows[7] and rows[7].rstrip().endswith("7: 0..6")
    assert "i1 @7" in rows[8] and "#######.#....." in rows[8]
    assert "check: the plan's kernel calls show exactly these keys" in text


def test_delimiter_lists() -> None:
    from flashplan.cli.explain import delimiter_lists

    assert delimiter_lists("7,9,11,13") == [[7, 9, 11, 13]]
    assert delimiter_lists("7,9,11,13;") == [[7, 9, 11, 13], []]
    assert delimiter_lists("3, 6, 8; -; 2,4") == [[3, 6, 8], [], [2, 4]]


def test_explain_truncates_wide_pictures(capsys: pytest.CaptureFixture[str]) -> None:
    text = _explain(capsys, "--decode", "--seq-lens", "300", "--window", "2")
    row = _picture_row(_group_block(text, "self causal window=2"), 299)
    assert " ~ " in row
    assert row.endswith("..###   3: 297..299")
    assert len(row) < 120


def test_explain_png(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    target = tmp_path / "plan.png"
    args = ["--seq-lens", "7,40", "--prefix-lens", "0,33", "--window", "4", "--path", "ragged"]
    text = _explain(capsys, *args, "--png", str(target))
    assert f"wrote {target}" in text
    data = target.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--seq-lens=5,-2"], "seq_lens[1]: must be >= 0"),
        (["--seq-lens", "5", "--prefix-lens", "7"], "prefix_lens[0]: must not exceed seq_lens"),
        (["--seq-lens", "5,6", "--prefix-lens", "1"], "prefix_lens: batch size differs"),
        (["--seq-lens", "5", "--window", "-3"], "window_left: must be >= -1"),
        (["--seq-lens", "5", "--page-size", "0"], "page_size: must be >= 1"),
        (["--seq-lens", "5", "--cross"], "encoder_lens: a cross-attention group needs"),
        (["--seq-lens", "5", "--decode", "--prefix-lens", "4"], "prefix_lens: cannot be given"),
        (["--seq-lens", "5,x"], "expected comma-separated integers"),
        (["--seq-lens", "5", "--delimiters", "1;"], "item_delimiters: batch size differs"),
        (["--seq-lens", "5", "--delimiters", "3,1"], "item_delimiters[0]: must be sorted"),
        (["--seq-lens", "5", "--delimiters", "5"], "item_delimiters[0]: must be below"),
        (["--seq-lens", "5", "--delimiters", "1", "--path", "ragged"], "extend_path:"),
        (["--seq-lens", "5", "--delimiters", "1", "--window", "3"], "groups: a multi-item"),
        (["--seq-lens", "5", "--delimiters", "1", "--decode"], "item_delimiters: cannot be"),
        (["--seq-lens", "5", "--delimiters", "1,a"], "per-request delimiter lists"),
        (["--seq-lens", "9,9", "--shared", "0-1"], "first-last:tokens"),
        (["--seq-lens", "9,9", "--shared", "0-0:4"], "at least 2 requests"),
        (["--seq-lens", "9,9", "--decode", "--shared", "0-1:9"], "shared_len"),
    ],
)
def test_bad_input_exits_2_with_message(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["explain", *args]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_bad_input_subprocess_no_traceback() -> None:
    proc = _run_cli("explain", "--seq-lens=5,-2")
    assert proc.returncode == 2
    assert "flashplan explain: error: seq_lens[1]: must be >= 0 (value=-2)" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_main_without_command_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "demo" in capsys.readouterr().err
    assert main(["--help"]) == 0
    assert "explain" in capsys.readouterr().out


def test_explain_shared_prefix_levels(capsys: pytest.CaptureFixture[str]) -> None:
    out = _explain(
        capsys, "--seq-lens", "40,44,50,36", "--decode", "--page-size", "4",
        "--shared", "0-3:20; 1-2:33",
    )  # fmt: skip
    assert "group 0: query rows 0..3; pages 0..4 of request 0's row (tokens 0..19)" in out
    assert "group 0: query rows 1..2; pages 5..7 of request 1's row (tokens 20..31)" in out
    assert "request 2: tokens 32..49 (from page 8)" in out
    assert "request 3: tokens 20..35 (from page 5)" in out
    assert "check: the levels and own parts read each request's keys exactly once" in out


def test_cascade_problem_finds_a_wrong_partition() -> None:
    """The explain check is not vacuous: own parts moved by one page are found."""
    import attrs

    from flashplan.cli.cascade_text import cascade_problem
    from flashplan.lengths import PageSpans

    layout = fp.BatchLayout.decode([40, 44, 50, 36], page_size=4)
    shared = fp.SharedPrefix.from_groups([range(4)], [20])
    spec = fp.plan(layout, fp.HeadConfig(8, 2, 64), shared_prefix=shared, cascade="on")
    assert spec.cascade is not None and cascade_problem(spec, layout) is None
    own = spec.cascade.levels.own
    moved = PageSpans.between(own.first_token + 4, own.end_token, 4)
    levels = attrs.evolve(spec.cascade.levels, own=moved)
    broken = attrs.evolve(spec, cascade=attrs.evolve(spec.cascade, levels=levels))
    assert cascade_problem(broken, layout) == (
        "request 0: the levels and its own part do not read each key once"
    )


# ---------------------------------------------------------------------------- render
def test_ascii_visibility_rows_and_columns() -> None:
    mask = np.array([[True, False, True], [False, False, False]])
    text = ascii_visibility([mask, np.zeros((0, 2), bool)], q_start=[10, 0], indent="")
    lines = text.splitlines()
    assert lines[0] == "request 0: 2 queries at positions 10..11; 3 keys"
    assert " 10  #.#   2: 0..2 (with gaps)" in lines
    assert " 11  ...   0" in lines
    assert lines[-1] == "request 1: 0 queries; 2 keys"
    assert ascii_visibility([]) == "(no requests)"


def test_ascii_visibility_truncates_rows() -> None:
    mask = np.tril(np.ones((100, 100), dtype=bool))
    text = ascii_visibility([mask], max_rows=10, max_cols=40)
    assert "(90 rows not shown)" in text
    assert "99  " in text and "50  " not in text
    assert max(len(line) for line in text.splitlines()) < 80


def test_describe_plan_and_coverage_ragged() -> None:
    layout = BatchLayout.extend([7, 40], [0, 33], page_size=16)
    spec = plan(layout, HEADS, extend_path="ragged")
    text = describe_plan(spec)
    assert text.startswith("plan: extend, 2 requests, page_size 16")
    assert "path ragged+paged" in text
    cover = kernel_coverage(spec, AttentionGroup())
    assert (cover[0] == COVER_RAGGED).all()
    assert (cover[1][:33] == COVER_PAGED).all() and (cover[1][33:] == COVER_RAGGED).all()
    decode = plan(BatchLayout.decode([40], page_size=16, groups=[AttentionGroup.sliding(4)]), HEADS)
    (c,) = kernel_coverage(decode, AttentionGroup.sliding(4))
    # Keys 35..39 are needed, page 2 (keys 32..39) is read; keys 0..31 are not.
    assert (c[:32] == COVER_NONE).all() and (c[32:] == COVER_PAGED).all()


def test_explain_parents_accepts_a_leading_minus_one(capsys: pytest.CaptureFixture[str]) -> None:
    """``--parents -1,0,0,1`` (space, not ``=``): the root's -1 is a value, not an option."""
    spaced = _explain(capsys, "--prefix-lens", "5,9", "--parents", "-1,0,0,1", "--page-size", "4")
    joined = _explain(capsys, "--prefix-lens", "5,9", "--parents=-1,0,0,1", "--page-size", "4")
    assert spaced == joined
    assert spaced.startswith("layout: verify")


# ---------------------------------------------------------------------------- explain size
# Issue 50, item 7: ``explain`` built every group's dense [queries, keys] masks whatever
# the size (30,000 tokens: 47-97 s and 3.7 GB; 100,000: killed), and checked --png only
# after all that work.

#: A batch far too large to plan quickly: a plan would allocate gigabytes.
HUGE = ["--seq-lens", "2000000000", "--prefix-lens", "0"]


@pytest.fixture
def no_planning(monkeypatch: pytest.MonkeyPatch) -> None:
    """``explain`` may not plan: a refusal must come before any planning."""
    import flashplan.cli.explain as cli_explain

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("explain planned the batch before refusing an option")

    monkeypatch.setattr(cli_explain, "plan", refuse)


def _refused(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """``explain``'s stderr for ``args``, which it must refuse (exit status 2) at once."""
    import time

    start = time.perf_counter()
    assert main(["explain", *args]) == 2
    assert time.perf_counter() - start < 0.5
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    return captured.err


@pytest.mark.usefixtures("no_planning")
@pytest.mark.parametrize(
    ("where", "message"),
    [
        ("missing/plan.png", "missing' of "),
        ("", "is a directory, not a file"),
        ("a-file/plan.png", "a-file' of "),
    ],
    ids=["missing directory", "a directory", "under a file"],
)
def test_explain_refuses_a_bad_png_path_before_planning(
    where: str, message: str, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A --png file that cannot be written is refused first (exit status 2, one line
    naming --png and the path), even for a batch that would take minutes to draw."""
    (tmp_path / "a-file").write_text("not a directory")
    target = str(tmp_path / where) if where else str(tmp_path)
    err = _refused(capsys, *HUGE, "--png", target)
    assert err.startswith("flashplan explain: error: --png: ") and message in err
    assert not (tmp_path / "missing").exists()


@pytest.mark.usefixtures("no_planning")
def test_explain_refuses_png_without_matplotlib_before_planning(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    err = _refused(capsys, *HUGE, "--png", str(tmp_path / "plan.png"))
    assert "--png needs matplotlib: pip install 'flashplan[plot]'" in err
    assert not (tmp_path / "plan.png").exists()


@pytest.mark.usefixtures("no_planning")
def test_explain_refuses_png_over_the_cell_limit_naming_it(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--png draws every cell: a group over --max-cells is refused before planning,
    the count and the limit named."""
    from flashplan.cli.explain import DEFAULT_MAX_CELLS

    target = tmp_path / "plan.png"
    err = _refused(capsys, "--seq-lens", "30000", "--prefix-lens", "0", "--png", str(target))
    assert DEFAULT_MAX_CELLS == 4096 * 4096
    assert (
        "--png draws every cell: group 0 (self causal) has 900,000,000 cells (queries x keys "
        "summed over the requests), over the limit of 16,777,216 (--max-cells)"
    ) in err
    # queries x keys: the self group's 1 x 4 + 2 x 5 = 14 <= 16; the cross group's keys
    # are the encoder's, 1 x 5 + 2 x 6 = 17 > 16
    cross = ["--seq-lens", "4,5", "--prefix-lens", "3,3", "--encoder-lens", "5,6", "--cross"]
    err = _refused(capsys, *cross, "--max-cells", "16", "--png", str(target))
    assert (
        "group 1 (cross bidirectional) has 17 cells" in err
        and "the limit of 16 (--max-cells)" in err
    )
    assert not target.exists()


def test_explain_summarises_a_group_over_the_cell_limit(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Without --png a batch over --max-cells still gets its plan tables (linear), and
    each group over the limit a line naming its cells and the limit instead of its
    picture and dense check; a group within the limit is drawn and checked as before."""
    args = ["--seq-lens", "60", "--prefix-lens", "0", "--window", "2", "--max-cells", "3600"]
    text = _explain(capsys, *args)
    assert _picture_row(_group_block(text, "self causal"), 59).endswith("60: 0..59")
    text = _explain(capsys, *args[:-1], "3599")
    full = _group_block(text, "self causal")
    assert _plan_row(full, 0)[:3] == ["0", "[0,", "60)"]
    assert " ".join(line.strip() for line in full[-3:]) == (
        "visibility: not drawn or checked: 3,600 cells (queries x keys summed over the "
        "requests), over the limit of 3,599 (--max-cells); raise it to draw and check this "
        "group (time and memory grow with the cells)"
    )
    assert not any("#" in line for line in full)
    assert text.count("not drawn or checked") == 2
    assert "check: the plan's kernel calls show exactly these keys" not in text


def test_explain_of_a_long_prefill_is_linear(capsys: pytest.CaptureFixture[str]) -> None:
    """30,000 tokens (900,000,000 cells; 47-97 s and 3.7 GB before the limit) print their
    plan at once; 10,000,000 tokens too."""
    import time

    for tokens in (30_000, 10_000_000):
        start = time.perf_counter()
        text = _explain(capsys, "--seq-lens", str(tokens), "--prefix-lens", "0")
        assert time.perf_counter() - start < 10.0
        assert f"{tokens * tokens:,} cells" in text
        assert f"total_q {tokens}, max_q_len {tokens}" in text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-cols", "7"], "argument --max-cols: must be >= 8; got 7"),
        (["--max-cells", "0"], "argument --max-cells: must be >= 1; got 0"),
        (["--max-cells", "1e6"], "argument --max-cells: expected an integer; got '1e6'"),
    ],
)
@pytest.mark.usefixtures("no_planning")
def test_explain_refuses_bad_limits(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert message in _refused(capsys, *HUGE, *args)


def test_explain_png_takes_any_file_name(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--png FILE writes a PNG whatever FILE's suffix (matplotlib would otherwise pick the
    format from it and raise on ``.txt``)."""
    pytest.importorskip("matplotlib")
    target = tmp_path / "plan.txt"
    _explain(capsys, "--seq-lens", "5", "--png", str(target))
    assert target.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_png_panel_draws_at_most_1024_rows_and_columns() -> None:
    """A large request's panel is drawn from every k-th row and column (3 bytes a
    pixel), with the colours of the cells it keeps."""
    from flashplan.cli.explain import _RGB8, _panel_rgb

    mask = np.tril(np.ones((3000, 2050), dtype=bool))
    cover = np.full(2050, COVER_RAGGED, dtype=np.int8)
    cover[:1000] = COVER_PAGED
    rgb = _panel_rgb(mask, cover)
    assert rgb.shape == (1000, 684, 3) and rgb.dtype == np.uint8
    rows, cols = np.arange(0, 3000, 3)[:, None], np.arange(0, 2050, 3)[None, :]
    want = np.where(cols < 1000, 1, 2) * (cols <= rows)  # 0 masked, 1 paged, 2 ragged
    for code, name in enumerate(("masked", "paged", "ragged")):
        assert (rgb[want == code] == _RGB8[name]).all()
    small = _panel_rgb(mask[:5, :7], cover[:7])
    assert small.shape == (5, 7, 3)


@given(
    lens=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40), st.integers(1, 9)),
                  min_size=1, max_size=5),
    window=st.integers(-1, 5),
)  # fmt: skip
def test_dense_cells_counts_the_cells_explain_builds(
    lens: list[tuple[int, int, int]], window: int
) -> None:
    """``dense_cells`` is the number of cells of the oracle's masks (what the picture
    and the check build), for self and cross groups."""
    from flashplan.cli.explain import dense_cells
    from flashplan.oracle import visibility

    seq = [p + e for p, e, _ in lens]
    groups = [AttentionGroup.sliding(window), AttentionGroup.cross()]
    layout = BatchLayout.extend(
        seq, [p for p, _, _ in lens], groups=groups, encoder_lens=[n for *_, n in lens]
    )
    for group in groups:
        assert dense_cells(layout, group) == sum(m.size for m in visibility(layout, group))


def test_cascade_check_is_linear_in_the_batch() -> None:
    """The --shared check reads each level's rows once: 20,000 requests in one group
    (each request used to rebuild the group's 20,000 rows as a set: 4e8 steps)."""
    import time

    from flashplan.cli.cascade_text import cascade_problem

    n = 20_000
    layout = BatchLayout.decode([40] * n, page_size=4)
    shared = fp.SharedPrefix.from_groups([range(n)], [20])
    spec = plan(layout, HEADS, shared_prefix=shared, cascade="on")
    start = time.perf_counter()
    assert cascade_problem(spec, layout) is None
    assert time.perf_counter() - start < 5.0


def test_cascade_problem_finds_a_level_that_runs_some_rows_of_a_request() -> None:
    import attrs

    from flashplan.cli.cascade_text import cascade_problem

    layout = fp.BatchLayout.extend([40, 44, 50], [30, 30, 30], page_size=4)
    shared = fp.SharedPrefix.from_groups([range(3)], [20])
    spec = fp.plan(layout, HEADS, shared_prefix=shared, cascade="on")
    assert spec.cascade is not None and cascade_problem(spec, layout) is None
    (level,) = spec.cascade.levels.levels
    rows = level.q_rows.copy()
    rows[12] = rows[11]  # request 1's third row (rows 10..23) is not run, its second twice
    broken_level = attrs.evolve(level, q_rows=rows)
    levels = attrs.evolve(spec.cascade.levels, levels=(broken_level,))
    broken = attrs.evolve(spec, cascade=attrs.evolve(spec.cascade, levels=levels))
    assert cascade_problem(broken, layout) == (
        "request 1: level 0 runs some of its query rows only"
    )
