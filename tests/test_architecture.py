"""The package's shape: an acyclic import graph, and worked examples that still hold."""

from __future__ import annotations

import ast
import doctest
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "flashplan"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, name: str) -> set[str]:
    """flashplan modules that ``path`` imports at any depth (functions included)."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("flashplan")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            if base.startswith("flashplan"):
                out.add(base)
                out |= {f"{base}.{a.name}" for a in node.names}
    return out


def test_import_graph_has_no_cycles() -> None:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {
        name: {m for m in _imports(path, name) if m in modules and m != name}
        for name, path in modules.items()
    }
    # A package importing its own submodules is how packages re-export; submodules
    # importing their package's __init__ would close a loop through it.
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = [*stack[stack.index(nxt) :], nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)


@pytest.mark.parametrize(
    "module",
    ["flashplan.planning.spec", "flashplan.planning.masks", "flashplan.arrays"],
)
def test_docstring_examples_hold(module: str) -> None:
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    if module != "flashplan.arrays":
        assert result.attempted > 0


def test_import_flashplan_loads_no_triton_and_no_kernel_module() -> None:
    """``import flashplan`` (layouts, planning, the reference executor) stays light: Triton
    and flashplan's kernel modules load only when a GPU path is imported."""
    import subprocess
    import sys

    code = (
        "import sys, flashplan; "
        "print(sorted(m for m in sys.modules if m == 'triton' or m.startswith('triton.') "
        "or m.startswith('flashplan.kernels') or m.startswith('flashplan.executor.flashinfer')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_top_level_holds_the_user_api_only() -> None:
    import flashplan as fp
    import flashplan.executor.flashinfer as fi

    names = set(dir(fp))
    assert not names & {"PackageNotFoundError", "_version", "PagedPart", "RaggedPart",
                        "PositionRuns", "PlanKey", "MultiItemTensors", "KernelPath",
                        "GroupPlan"}  # fmt: skip
    assert {"BatchLayout", "plan", "ReferenceExecutor", "FieldTypeError"} <= names
    assert set(fp.__all__) <= names
    # the GPU executor's names resolve on first use, to the executor package's own
    assert fp.FlashInferExecutor is fi.FlashInferExecutor and fp.capture is fi.capture
    with pytest.raises(AttributeError):
        _ = fp.PagedPart  # reachable by its module path: flashplan.planning.PagedPart
