"""``python -m flashplan`` / the ``flashplan`` console script.

Commands:

* ``demo``: plan and run a mixed example batch on the best executor available and
  check it against a float64 dense attention (:mod:`flashplan.cli.demo`).
* ``explain``: print the plan of a layout given on the command line and a picture of
  what each query sees (:mod:`flashplan.cli.explain`); a group with more than
  ``--max-cells`` query x key cells gets its plan table only.

Exit status: 0 on success; 1 when the demo's error is above tolerance, a plan check
fails or writing the PNG fails; 2 for invalid arguments (argparse's usage errors,
flashplan's input errors, and ``explain --png`` refused before any planning: a file
that cannot be written, no matplotlib, or a batch over ``--max-cells``), reported as
one line without traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from flashplan.errors import FlashplanError

__all__ = ["build_parser", "main"]


def _demo_device(text: str | None) -> object:
    """The demo's torch device, or a one-line reason why ``text`` is not usable."""
    import torch

    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError, TypeError):
        return f"--device: {text!r} is not a torch device (e.g. cpu, cuda, cuda:1)"
    if device.type == "cuda" and not torch.cuda.is_available():
        return f"--device: {text!r} asked for, but CUDA is not available on this machine"
    if device.type not in ("cpu", "cuda"):
        return f"--device: the demo runs on cpu or cuda, not {device.type!r}"
    return device


def _demo(args: argparse.Namespace) -> int:
    import torch

    from flashplan.cli.demo import run_demo, tolerance_for

    device = _demo_device(args.device)
    if isinstance(device, str):
        print(f"flashplan demo: error: {device}", file=sys.stderr)
        return 2
    assert isinstance(device, torch.device)
    worst = run_demo(device, seed=args.seed)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return 0 if worst <= tolerance_for(dtype) else 1


def _explain(args: argparse.Namespace) -> int:
    from flashplan.cli.explain import command

    return command(args)


def build_parser() -> argparse.ArgumentParser:
    """The ``flashplan`` argument parser (sub-commands ``demo`` and ``explain``)."""
    from flashplan.cli.explain import configure

    parser = argparse.ArgumentParser(
        prog="flashplan",
        description="Plan FlashInfer attention batches: demo and explain tools.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = sub.add_parser(
        "demo",
        help="plan and run a mixed batch, check it against a float64 oracle",
        description="Plan a decode batch and an extend batch (full, sliding-window and "
        "cross-attention groups), run them on the best executor available and compare "
        "with a float64 dense attention. Exits with 1 if the error is above tolerance.",
    )
    demo.add_argument(
        "--device", default=None, help="torch device (default: cuda when available, else cpu)"
    )
    demo.add_argument("--seed", type=int, default=0, help="seed of the random inputs (0)")
    demo.set_defaults(func=_demo)
    explain = sub.add_parser(
        "explain",
        help="print the plan of a layout and what each query sees",
        description="Print the plan of a small layout and, per attention group, a picture "
        "of which keys each query sees ('#' visible, '.' hidden).",
    )
    configure(explain)
    explain.set_defaults(func=_explain)
    return parser


#: Options whose values may start with "-" (a draft tree's root is -1): argparse would
#: read "-1,0,0" as an option, so "--parents -1,0,0" is joined into "--parents=-1,0,0".
_DASH_VALUED = ("--parents",)


def _join_dash_values(argv: Sequence[str]) -> list[str]:
    out: list[str] = []
    it = iter(argv)
    for arg in it:
        if arg in _DASH_VALUED:
            value = next(it, None)
            out.append(arg if value is None else f"{arg}={value}")
        else:
            out.append(arg)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``flashplan`` command line; return the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(_join_dash_values(sys.argv[1:] if argv is None else argv))
    except SystemExit as exc:  # usage errors (2) and --help (0): return, don't exit
        return exc.code if isinstance(exc.code, int) else 0
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args))
    except FlashplanError as exc:
        print(f"flashplan {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
