"""Every ```python block of ``README.md`` and ``docs/*.md`` (but the generated
``docs/api.md``) runs, and prints what the page shows it prints.

* A page's blocks run in order, in one namespace, as a reader pasting them into one
  Python session would: a block may use what an earlier block of its page defined, never
  what another page did. Each page runs in a fresh working directory (nothing lands in
  the repository) with the repository root importable (``examples.engine``, as from a
  clone), torch seeded with 0.
* A block that needs CUDA and FlashInfer (the FlashInfer executor, CUDA graphs,
  ``torch.cuda``) is fenced ```python cuda: GitHub takes the first word of the info
  string as the language, so it still renders as Python. The CPU run here skips those
  blocks, so no other block may depend on a name only a CUDA block defines;
  ``tests/gpu/test_doc_blocks_gpu.py`` runs each page that has CUDA blocks whole, on a GPU.
* Code that is not meant to run (pseudo-code, a signature, an abridged excerpt of a
  method) is fenced ```text.
* A ```text block right after a ```python block (nothing but blank lines between) is that
  block's output: on the CPU, what the block prints must equal it, numbers written in
  exponent notation (error magnitudes such as ``4.9e-07``, which the CPU's vector unit
  may round otherwise) within a factor of 10.

Tracebacks name the Markdown file and its lines: each block is compiled at its own lines.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

#: Words that may follow ``python`` in a fence's info string.
TAGS = frozenset({"cuda"})

#: Generated from the docstrings (``python docs/gen_api.py``): its examples are not run here.
GENERATED = frozenset({"api.md"})

_FENCE = re.compile(
    r"^ {0,3}(?P<fence>`{3,}|~{3,})(?P<info>[^\n]*)\n(?P<code>.*?)^ {0,3}(?P=fence)[ \t]*$",
    re.M | re.S,
)
_EXPONENT = re.compile(r"[-+]?\d+(?:\.\d+)?e[-+]?\d+")


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page.

    Attributes:
        path: the page.
        line: the page line (1-based) of the block's first code line.
        info: the words of the fence's info string (``("python", "cuda")``).
        code: the block's text, fences excluded.
        output: for a ```python block followed by a ```text block with nothing but blank
            lines between, that block's text (what the code prints); else ``None``.
    """

    path: Path
    line: int
    info: tuple[str, ...]
    code: str
    output: str | None = None

    @property
    def language(self) -> str:
        return self.info[0] if self.info else ""

    @property
    def needs_cuda(self) -> bool:
        return "cuda" in self.info[1:]

    @property
    def where(self) -> str:
        path = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return f"{path}:{self.line}"


def pages() -> list[Path]:
    """README.md and docs/*.md, but the generated pages."""
    return [ROOT / "README.md", *(p for p in sorted(DOCS.glob("*.md")) if p.name not in GENERATED)]


def fenced_blocks(path: Path) -> list[Block]:
    """Every fenced code block of a Markdown page, in page order, each ```python block
    with the output a ```text block right after it shows."""
    text = path.read_text(encoding="utf-8")
    matches = list(_FENCE.finditer(text))
    blocks = []
    for m, after in zip(matches, [*matches[1:], None], strict=True):
        info = tuple(m.group("info").split())
        output = _shown_output(text, m, after) if info[:1] == ("python",) else None
        line = text.count("\n", 0, m.start("code")) + 1
        blocks.append(Block(path, line, info, m.group("code"), output))
    return blocks


def _shown_output(text: str, block: re.Match[str], after: re.Match[str] | None) -> str | None:
    """The code of ``after`` if it is a ```text block with only blank lines between it
    and ``block``."""
    if after is None or text[block.end() : after.start()].strip():
        return None
    return after.group("code") if after.group("info").split()[:1] == ["text"] else None


def python_blocks(path: Path) -> list[Block]:
    return [b for b in fenced_blocks(path) if b.language == "python"]


def same_output(got: str, shown: str) -> bool:
    """``got`` is ``shown``, but exponent-notation numbers agree within a factor of 10."""
    if _EXPONENT.sub("#", got) != _EXPONENT.sub("#", shown):
        return False
    pairs = zip(_EXPONENT.findall(got), _EXPONENT.findall(shown), strict=True)
    return all(_within_10x(float(a), float(b)) for a, b in pairs)


def _within_10x(a: float, b: float) -> bool:
    if a == b:
        return True
    return a * b > 0 and 0.1 <= a / b <= 10


def run_page(path: Path, *, cuda: bool) -> int:
    """Run a page's ```python blocks in order in one fresh namespace (its CUDA blocks only
    when ``cuda``), in the current working directory, and check what each prints against
    the output the page shows (CPU runs only); the number of blocks run. A block's
    exception propagates, its traceback at the block's lines of the page."""
    import torch

    torch.manual_seed(0)
    name = "docs_page_" + re.sub(r"\W", "_", path.stem)
    module = types.ModuleType(name)  # a real module: classes, dataclasses, pickling work
    module.__file__ = str(path)
    sys.modules[name] = module
    run = 0
    try:
        for block in python_blocks(path):
            if block.needs_cuda and not cuda:
                continue
            if needs_transformers(block) and importlib.util.find_spec("transformers") is None:
                pytest.skip(f"{block.where} needs transformers (the test extra)")
            printed = _run_block(block, module.__dict__)
            if block.output is not None and not cuda:
                assert same_output(printed, block.output), (
                    f"{block.where}: the block printed\n{printed}\nthe page shows\n{block.output}"
                )
            run += 1
    finally:
        del sys.modules[name]
    return run


def _run_block(block: Block, namespace: dict[str, object]) -> str:
    """Execute one block in ``namespace``; what it printed (also echoed)."""
    code = compile("\n" * (block.line - 1) + block.code, str(block.path), "exec")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(code, namespace)
    print(out.getvalue(), end="")
    return out.getvalue()


def needs_transformers(block: Block) -> bool:
    return "transformers" in block.code or "examples.engine" in block.code


@pytest.fixture
def reader_session(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh working directory, the repository root importable."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))
    return tmp_path


CPU_PAGES = [p for p in pages() if any(not b.needs_cuda for b in python_blocks(p))]


@pytest.mark.parametrize("path", CPU_PAGES, ids=lambda p: p.name)
def test_page_runs_on_the_cpu(path: Path, reader_session: Path) -> None:
    """The page's blocks but its CUDA ones run, in order, in one namespace, and print
    what the page shows."""
    assert run_page(path, cuda=False) > 0


# --------------------------------------------------------------------------- conventions


def test_python_blocks_are_tagged_with_known_words() -> None:
    """``python`` alone or ``python cuda``: a misspelt tag would run a CUDA block on the
    CPU, or hide a block from both runs."""
    bad = [
        f"{b.where}: ```{' '.join(b.info)}"
        for p in pages()
        for b in python_blocks(p)
        if set(b.info[1:]) - TAGS or len(b.info[1:]) != len(set(b.info[1:]))
    ]
    assert not bad, "unknown fence tags:\n" + "\n".join(bad)


def test_python_is_fenced_as_python() -> None:
    """Python code is fenced ``python`` (run) or ``text`` (not run): ``py``, ``python3``,
    ``pycon`` and the like would escape both runs."""
    aliases = {"py", "py3", "python3", "pycon", "pyi", "ipython", "sage"}
    bad = [
        f"{b.where}: ```{b.language}"
        for p in pages()
        for b in fenced_blocks(p)
        if b.language.lower() in aliases
    ]
    assert not bad, "Python fenced under another name:\n" + "\n".join(bad)


# --------------------------------------------------------------------------- the runner itself

_PAGE = """# t

```python
x = 1
```

```bash
exit 1
```

```python cuda
import torch; torch.cuda.init()
```

~~~python
y = x + 1
print(f"y = {y}, err {y * 1e-7:.1e}")
~~~

```text
y = 2, err 2.0e-07
```

```python
assert y == 3, y
```
"""


def test_blocks_are_found_with_their_lines_tags_and_outputs(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(_PAGE, encoding="utf-8")
    blocks = python_blocks(page)
    assert [(b.line, b.needs_cuda, b.output) for b in blocks] == [
        (4, False, None),
        (12, True, None),
        (16, False, "y = 2, err 2.0e-07\n"),
        (25, False, None),
    ]


def test_a_failing_block_is_reported_at_its_page_line(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(_PAGE, encoding="utf-8")
    with pytest.raises(AssertionError) as info:
        run_page(page, cuda=False)  # skips the CUDA block; the last block fails
    assert str(info.value) == "2"
    assert (info.traceback[-1].path, info.traceback[-1].lineno + 1) == (page, 25)


def test_a_wrong_output_is_reported(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(_PAGE.replace("y = 2, err", "y = 3, err"), encoding="utf-8")
    with pytest.raises(AssertionError, match=r"page.md:16: the block printed"):
        run_page(page, cuda=False)


@pytest.mark.parametrize(
    ("got", "shown", "same"),
    [
        ("err 4.9e-07\n", "err 4.9e-07\n", True),
        ("err 5.3e-07\n", "err 4.9e-07\n", True),  # another CPU's rounding
        ("err 4.9e-05\n", "err 4.9e-07\n", False),  # 100x: a real change
        ("err -4.9e-07\n", "err 4.9e-07\n", False),
        ("[1 2]\n", "[1 3]\n", False),  # other numbers compare exactly
        ("a 1.0e-07 b\n", "a 1.0e-07 c\n", False),
    ],
)
def test_same_output(got: str, shown: str, same: bool) -> None:
    assert same_output(got, shown) is same
