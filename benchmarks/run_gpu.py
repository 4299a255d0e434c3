#!/usr/bin/env python3
"""flashplan's benchmarks, one entry point: flashplan vs raw FlashInfer vs sglang's way,
and (``--compare-tree``) the working tree vs an older checkout, side by side.

The target table (issue 51), on one GPU machine, from the repository root. Beforehand, on
the CPU machine, put the commit before the executor's rebuild into ``.old`` (plain files,
not a ``git worktree``: a worktree's ``.git`` link makes it a nested repository, which the
device tool sends without its files; ``.old`` is untracked and not ignored, so it travels
with the working tree, ~2 MB)::

    rm -rf .old && mkdir .old && git archive efdfb65 flashplan examples benchmarks | tar -x -C .old

then on the GPU machine (two commands: each stays under the 10-minute limit)::

    source .whl/setup.sh && export PYTHONPATH=$PWD:$PYTHONPATH && \\
      python3 benchmarks/run_gpu.py --compare-tree .old --old-label efdfb65 --out $OUT
    source .whl/setup.sh && export PYTHONPATH=$PWD:$PYTHONPATH && \\
      python3 benchmarks/run_gpu.py --compare-tree .old --old-label efdfb65 \\
        --parts engine,overlap --out $OUT/engine

Each writes ``OUT/compare.md`` (the targets' rows first: old, new, new / old; then every
row; then each tree's own tables) and ``OUT/compare.json``. Expected wall time on an H100
(estimated, both trees, Triton compiles and FlashInfer module loads of a fresh machine
included): 4 to 7 minutes for the first command, 3 to 5 for the engine's.

Without ``--compare-tree`` the parts run here, on the flashplan that ``import flashplan``
finds, into ``OUT/bench.md`` and ``OUT/bench.json``. A CPU smoke run (no GPU, no
FlashInfer kernels: the new executor over the CPU twin ``flashplan.twin.flashinfer_twin``,
tiny sizes, a few seconds; every default part: about a minute)::

    python3 benchmarks/run_gpu.py --parts host --device cpu --twin --out /tmp/bench

Parts (``--parts``, comma-separated; default ``host,verify,multi_item,graph,kernel,sync``;
``all``: every part):

  host        a decode step's host time with COLD caches (64 MB of host memory rewritten
              before each call, fresh lengths each call: a decode loop), batch
              1/64/256/1024, kv 4096, page 16: flashplan ``BatchLayout.decode`` + ``plan``
              + ``apply`` vs FlashInfer's bare ``plan()`` (inputs made ahead) vs sglang's
              way (device cumsum + Triton gather + ``plan()`` with device indptrs); the
              ratio to the bare ``plan()``; hot caches and behind a 20 ms kernel too.
  verify      64 x 64-token trees over 4096: plan + apply vs bare ``plan()`` vs sglang's
              way (hot and cold caches), and the kernel vs raw FlashInfer.
  multi_item  256 x (512-token prompt + 32 items): layout + plan + apply + positions vs
              bare ``plan()`` vs sglang's per-request loop + ``plan()``.
  graph       32-layer decode, kv 4096, page 16, batch 1/8/64/256: layout + plan +
              ``step.replay(spec, table)`` vs a raw FlashInfer step captured by hand
              (sglang's buffer refresh + ``plan()`` + replay), synced wall time per step.
  kernel      the device-to-device copy ceiling; decode through flashplan vs raw
              FlashInfer (tensor and CUDA cores) on the same inputs, as bandwidth.
  sync        ``torch.cuda.set_sync_debug_mode("error")`` around apply, run, positions,
              a verify apply and a graph replay; host waits it cannot see, counted.
  engine      the example engine (``bench_engine.py --parts engine``: Llama-shaped
              ~1.5B, prompts 1024, 128 new tokens), plain loop, eager and CUDA graphs,
              batch 1 and 64: tokens/s. Runs each tree's own ``benchmarks/bench_engine.py``
              and ``examples/engine`` in a subprocess.
  overlap     ``bench_engine.py --parts overlap``: the plain vs the overlapped loop.
  draft, fp8, cascade, extend, deterministic, window, xqa: further parts (``_parts_extra``).
  profile     where apply's host time goes: each phase timed, then cProfile, at batch 1,
              64, 256 (``_profile``).

Host times: ``time.perf_counter``, the GPU idle before each call, medians after warm-up,
jobs of a table taken round by round. GPU times: CUDA events (``triton.testing.do_bench``),
medians after warm-up. ``--compare-tree DIR`` runs the same parts, from this file's
measuring code (which uses only API both executors have), in two subprocesses:
``PYTHONPATH`` = this repository, then ``DIR``; each checks which flashplan it imported.
``--repeat N`` alternates the two N times and keeps each row's median.

Files: this script; ``_common.py`` (device, timing, report), ``_raw.py`` (raw FlashInfer
and sglang's way), ``_parts_host.py``, ``_parts_gpu.py``, ``_parts_extra.py`` (the parts),
``bench_engine.py`` (the engine, run as a subprocess; also usable alone).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DEFAULT = ("host", "verify", "multi_item", "graph", "kernel", "sync")
EXTRA = ("draft", "fp8", "cascade", "extend", "deterministic", "window", "xqa", "profile")
ENGINE = ("engine", "overlap")
ALL = DEFAULT + EXTRA + ENGINE
HIGHER = ("TB/s", "tok/s")  # units where higher is better (and metrics saying so)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--parts",
        default=",".join(DEFAULT),
        help=f"comma-separated, of: {', '.join(ALL)}; or 'all'",
    )
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-out"), help="output folder")
    ap.add_argument(
        "--compare-tree",
        metavar="DIR",
        help="also run the parts on the flashplan in DIR (a plain checkout of an "
        "older commit inside the repo copy, e.g. .old) and print old/new ratios",
    )
    ap.add_argument("--old-label", help="name of the --compare-tree commit in the tables")
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="with --compare-tree: alternate the two trees this many times, keep each row's median",
    )
    ap.add_argument("--device", default=None, help="cuda (default) or cpu (with --twin)")
    ap.add_argument(
        "--twin",
        action="store_true",
        help="the new executor over flashplan.twin.flashinfer_twin (CPU smoke run)",
    )
    ap.add_argument("--quick", action="store_true", help="tiny sizes (implied on the CPU)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per graph case (50)")
    ap.add_argument("--engine-batches", default="1,64")
    ap.add_argument("--engine-prompt", type=int, default=1024)
    ap.add_argument("--engine-new", type=int, default=128)
    # internal: one side of --compare-tree
    ap.add_argument("--side", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--tree", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    parts = ALL if args.parts == "all" else tuple(p for p in args.parts.split(",") if p)
    unknown = set(parts) - set(ALL)
    if unknown:
        ap.error(f"unknown parts {sorted(unknown)}; choose from {', '.join(ALL)}")
    args.part_list = [p for p in ALL if p in parts]
    if args.device is None:
        args.device = "cpu" if args.twin and not _cuda_available() else "cuda"
    if args.device == "cpu":
        args.quick = True
        if not args.twin:
            ap.error("--device cpu needs --twin (FlashInfer's kernels need CUDA)")
    return args


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


# -- one tree, in this process -------------------------------------------------------------
def run_here(args: argparse.Namespace) -> dict[str, Any]:
    """Run the selected parts on the flashplan this process imports."""
    if args.tree is not None:  # an editable install's finder would fill in, from another
        # tree, any flashplan module that this tree lacks: only PYTHONPATH's tree counts
        sys.meta_path[:] = [
            f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")
        ]
    import _common
    import torch

    import flashplan

    where = Path(flashplan.__file__).resolve()
    if args.tree is not None and Path(args.tree).resolve() not in where.parents:
        raise SystemExit(
            f"[bench] imported {where}, not the flashplan of {args.tree}: "
            "check PYTHONPATH (and any installed flashplan)"
        )
    env = _common.configure(args.device, args.twin, args.quick, args.steps)
    rep = _common.Report()
    meta = {
        "side": args.side or "here",
        "flashplan": str(where.parent),
        "tree": str(args.tree or REPO),
        "device": torch.cuda.get_device_name() if env.cuda else "cpu",
        "flashinfer": str(getattr(env.fi, "__version__", "?")),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "host_cpus": os.cpu_count(),
        "quick": args.quick,
        "twin": args.twin,
    }
    print(f"[bench] {meta}", flush=True)
    failed, seconds = [], {}
    for part in args.part_list:
        t0 = time.perf_counter()
        try:
            if part in ENGINE:
                run_engine(part, args, rep)
            elif not env.cuda and part in ("draft", "window"):
                rep.md += [f"### {part}", "", "skipped: sglang's side needs CUDA", ""]
            else:
                part_fn(part)(rep)
        except Exception:  # report and go on: one broken part must not hide the rest
            failed.append(part)
            tb = traceback.format_exc()
            print(f"[bench] part {part} FAILED:\n{tb}", flush=True)
            rep.md += [f"### {part}: FAILED", "", "```", tb.strip()[-3000:], "```", ""]
            if env.cuda:
                torch.cuda.synchronize()
        seconds[part] = time.perf_counter() - t0
        print(f"[bench] part {part}: {seconds[part]:.1f} s", flush=True)
        if env.cuda:
            torch.cuda.empty_cache()
    meta["part_seconds"] = seconds
    meta["failed"] = failed
    foreign = [
        name
        for name, mod in sorted(sys.modules.items())
        if name.split(".")[0] in ("flashplan", "examples")
        and getattr(mod, "__file__", None)
        and where.parent.parent not in Path(mod.__file__).resolve().parents
    ]
    if foreign:  # modules of another tree: the comparison would mix the two
        meta["failed"].append(f"modules from another tree: {', '.join(foreign[:10])}")
    return {"meta": meta, "rows": rep.rows, "md": rep.md}


def part_fn(part: str) -> Any:
    if part in ("host", "verify", "multi_item", "sync"):
        import _parts_host

        return getattr(_parts_host, f"part_{part}")
    if part in ("graph", "kernel"):
        import _parts_gpu

        return getattr(_parts_gpu, f"part_{part}")
    if part == "profile":
        import _profile

        return _profile.part_profile
    import _parts_extra

    return _parts_extra.PARTS[part]


def child_env(tree: Path) -> dict[str, str]:
    """This environment with ``PYTHONPATH`` = ``tree`` first, without the other trees."""
    env = dict(os.environ)
    drop = {REPO.resolve(), tree.resolve()}
    keep = [
        p
        for p in env.get("PYTHONPATH", "").split(os.pathsep)
        if p and Path(p).resolve() not in drop
    ]
    env["PYTHONPATH"] = os.pathsep.join([str(tree), *keep])
    return env


def run_engine(part: str, args: argparse.Namespace, rep: Any) -> None:
    """``bench_engine.py`` of the tree under test, in a subprocess over that tree."""
    import _common

    if not _common.ENV.cuda:
        rep.md += [f"### {part}", "", "skipped: the engine benchmark needs CUDA", ""]
        return
    tree = Path(args.tree or REPO).resolve()
    script = tree / "benchmarks" / "bench_engine.py"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / ("engine.json" if part == "engine" else "overlap.md")
        cmd = [
            sys.executable,
            str(script),
            "--parts",
            part,
            "--batches",
            args.engine_batches,
            "--prompt",
            str(args.engine_prompt),
            "--new",
            str(args.engine_new),
            "--json" if part == "engine" else "--md",
            str(out),
        ]
        print(f"[bench] {' '.join(cmd)}", flush=True)
        proc = subprocess.run(cmd, env=child_env(tree), cwd=tree, capture_output=True, text=True)
        sys.stdout.write(proc.stdout[-4000:])
        if proc.returncode != 0:
            raise RuntimeError(f"{script} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        text = out.read_text()
    if part == "engine":
        rows = json.loads(text)["rows"]
        lines = []
        for r in rows:
            loop = r.get("loop", "plain")  # (older trees: the plain loop only)
            case = f"engine B{r['batch']}, {loop} loop"
            for key, metric in (
                ("graphs_tok_s", "graphs: tok/s"),
                ("eager_tok_s", "eager: tok/s"),
                ("graphs_decode_tok_s", "graphs: decode tok/s"),
                ("eager_decode_tok_s", "eager: decode tok/s"),
            ):
                if key in r:
                    rep.add("engine", case, metric, r[key], "tok/s", key=key == "graphs_tok_s")
            for key, metric in (
                ("graphs_host_share", "graphs: flashplan host share of a step"),
                ("eager_host_share", "eager: flashplan host share of a step"),
            ):
                if key in r:
                    rep.add("engine", case, metric, r[key], "x")
            lines.append(
                [
                    str(r["batch"]),
                    f"{r.get('eager_tok_s', 0):.0f}",
                    f"{r.get('graphs_tok_s', 0):.0f}",
                    f"{r.get('graphs_host_share', 0):.1%}",
                ]
            )
        rep.table(
            f"Example engine, {rows[0].get('loop', 'plain') if rows else 'plain'} loop "
            f"(prompts {args.engine_prompt}, {args.engine_new} new)",
            ["batch", "eager tok/s", "graphs tok/s", "graphs: host share"],
            lines,
        )
        return
    # overlap: bench_engine's markdown table, one row per batch
    lines = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not cells[0].isdigit():
            continue
        case = f"engine B{cells[0]}, graphs"
        rep.add("overlap", case, "plain loop: tok/s", float(cells[1]), "tok/s")
        rep.add("overlap", case, "overlapped loop: tok/s", float(cells[2]), "tok/s", key=True)
        lines.append(cells[:4])
    rep.table(
        "Overlapped vs plain step loop (graphs)",
        ["batch", "plain tok/s", "overlapped tok/s", "overlapped / plain"],
        lines,
    )
    rep.md += ["", text.strip(), ""]


# -- two trees, in subprocesses ------------------------------------------------------------
def run_side(args: argparse.Namespace, side: str, tree: Path, tmp: Path, k: int) -> dict[str, Any]:
    result = tmp / f"{side}-{k}.json"
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--parts",
        ",".join(args.part_list),
        "--side",
        side,
        "--tree",
        str(tree),
        "--result",
        str(result),
        "--device",
        args.device,
        "--engine-batches",
        args.engine_batches,
        "--engine-prompt",
        str(args.engine_prompt),
        "--engine-new",
        str(args.engine_new),
        "--out",
        str(tmp),
    ]
    if args.quick:
        cmd.append("--quick")
    if args.twin:  # (a tree before the rebuild has no CPU twin: that side then fails)
        cmd.append("--twin")
    if args.steps is not None:
        cmd += ["--steps", str(args.steps)]
    print(f"[bench] === {side} ({tree}) ===", flush=True)
    proc = subprocess.run(cmd, env=child_env(tree), cwd=REPO)
    if proc.returncode != 0 or not result.exists():
        return {
            "meta": {"side": side, "tree": str(tree), "failed": ["(the run)"]},
            "rows": [],
            "md": [f"### {side}: the run failed (exit {proc.returncode}; see the log)"],
        }
    return json.loads(result.read_text())


def _key(row: dict[str, Any]) -> tuple[str, str, str]:
    return row["part"], row["case"], row["metric"]


def merged(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One side's repeats as one result: each row's median (booleans: any True)."""
    first = results[0]
    if len(results) == 1:
        return first
    values: dict[tuple[str, str, str], list[Any]] = {}
    for r in results:
        for row in r["rows"]:
            values.setdefault(_key(row), []).append(row["value"])
    rows = []
    for row in first["rows"]:
        vals = [v for v in values[_key(row)] if v is not None]
        if not vals:
            value = None
        elif isinstance(vals[0], bool):
            value = any(vals)
        else:
            value = statistics.median(vals)
        rows.append({**row, "value": value})
    return {**first, "rows": rows}


def _cell(value: Any, unit: str) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if unit == "x":
        return f"{value:.3f}"
    if unit in ("ms", "TB/s"):
        return f"{value:.3f}"
    return f"{value:.1f}" if abs(value) < 100 else f"{value:.0f}"


def _verdict(row: dict[str, Any], old: Any, new: Any) -> tuple[str, str]:
    if (
        not isinstance(old, (int, float))
        or not isinstance(new, (int, float))
        or isinstance(old, bool)
    ):
        if isinstance(old, bool) or isinstance(new, bool):
            return "", "" if old == new else "changed"
        return "", ""
    if old == 0:
        return "", ""
    ratio = new / old
    higher = row["unit"] in HIGHER or "higher" in row["metric"]
    better = ratio > 1.03 if higher else ratio < 0.97
    worse = ratio < 0.97 if higher else ratio > 1.03
    return f"{ratio:.3f}", "better" if better else "**worse**" if worse else "same"


def compare_md(old: dict[str, Any], new: dict[str, Any], old_label: str) -> list[str]:
    om, nm = old["meta"], new["meta"]
    lines = [
        f"# flashplan: working tree (new) vs {old_label} (old)",
        "",
        f"{nm.get('device')}, flashinfer {nm.get('flashinfer')}, torch {nm.get('torch')}, "
        f"{nm.get('date')}; new: {nm.get('flashplan')}, old: {om.get('flashplan')}. "
        "new / old < 1 is faster for times (µs, ms, ratios to a baseline), > 1 for TB/s and "
        "tok/s; ±3 % counts as the same. Rows of raw FlashInfer and sglang's way run the "
        "same code in both trees: their new / old shows the host's drift between the two "
        "runs (use --repeat 3 to alternate the trees and keep medians).",
        "",
    ]
    for label, m in (("new", nm), ("old", om)):
        if m.get("failed"):
            lines += [f"**{label}: failed parts: {', '.join(m['failed'])}**", ""]
    old_rows = {_key(r): r for r in old["rows"]}
    for title, keep in (("Targets", True), ("Every row", False)):
        lines += [
            f"## {title}",
            "",
            "| part | case | metric | unit | old | new | new / old | |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for row in new["rows"]:
            if keep and not row["key"]:
                continue
            o = old_rows.get(_key(row), {}).get("value")
            ratio, verdict = _verdict(row, o, row["value"])
            lines.append(
                f"| {row['part']} | {row['case']} | {row['metric']} | {row['unit']} "
                f"| {_cell(o, row['unit'])} | {_cell(row['value'], row['unit'])} | {ratio} "
                f"| {verdict} |"
            )
        only_old = [r for r in old["rows"] if _key(r) not in {_key(n) for n in new["rows"]}]
        for row in only_old if not keep else []:
            lines.append(
                f"| {row['part']} | {row['case']} | {row['metric']} | {row['unit']} "
                f"| {_cell(row['value'], row['unit'])} | — | | |"
            )
        lines.append("")
    lines += ["## new: the tables", "", *new["md"], "## old: the tables", "", *old["md"]]
    return lines


def compare(args: argparse.Namespace) -> int:
    tree = Path(args.compare_tree).resolve()
    if not (tree / "flashplan" / "__init__.py").exists():
        raise SystemExit(f"--compare-tree {tree}: no flashplan package there")
    label = args.old_label or tree.name
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {"new": [], "old": []}
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.repeat):
            for side, root in (("new", REPO), ("old", tree)):
                runs[side].append(run_side(args, side, root, Path(tmp), k))
    new, old = merged(runs["new"]), merged(runs["old"])
    text = "\n".join(compare_md(old, new, label)) + "\n"
    (out / "compare.md").write_text(text)
    (out / "compare.json").write_text(
        json.dumps({"new": runs["new"], "old": runs["old"]}, indent=1, default=str)
    )
    print(text)
    print(f"[bench] wrote {out / 'compare.md'}, {out / 'compare.json'}")
    return 1 if new["meta"].get("failed") or old["meta"].get("failed") else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.compare_tree:
        return compare(args)
    result = run_here(args)
    if args.result:  # one side of --compare-tree: the parent writes the files
        Path(args.result).write_text(json.dumps(result, default=str))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    m = result["meta"]
    head = [
        f"# flashplan benchmarks: {m['device']}, flashinfer {m['flashinfer']}, "
        f"torch {m['torch']}, {m['date']} ({m['flashplan']})",
        "",
    ]
    keys = ["## Targets", "", "| part | case | metric | unit | value |", "|---|---|---|---|---|"]
    keys += [
        f"| {r['part']} | {r['case']} | {r['metric']} | {r['unit']} "
        f"| {_cell(r['value'], r['unit'])} |"
        for r in result["rows"]
        if r["key"]
    ]
    text = "\n".join(head + keys + ["", *result["md"]]) + "\n"
    (out / "bench.md").write_text(text)
    (out / "bench.json").write_text(json.dumps(result, indent=1, default=str))
    print(text)
    if m["failed"]:
        print(f"[bench] FAILED parts: {', '.join(m['failed'])}")
    print(f"[bench] wrote {out / 'bench.md'}, {out / 'bench.json'}")
    return 1 if m["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
