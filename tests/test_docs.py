"""The documentation stays true to the code.

* ``docs/api.md`` is what ``python docs/gen_api.py`` writes from the docstrings today;
* every relative link of ``README.md`` and ``docs/*.md`` reaches an existing file (and,
  for a Markdown file, an existing heading when the link names one);
* every ``fp.<name>`` / ``flashplan.<dotted.name>``, ``from flashplan.<module> import
  <names>`` and ``<PublicRecord>.<member>`` written in code (inline or fenced) in those
  files names something that exists.

Docs being written elsewhere (``PENDING``) are checked as soon as they are in ``docs/``.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

#: Guides being written as these tests are: a link to one of them is accepted while it
#: does not exist yet. Once they are in docs/, they are checked like every other file.
PENDING = {"guide-engine.md", "guide-speculative.md", "guide-cuda-graphs.md"}


@cache
def gen_api() -> ModuleType:
    """docs/gen_api.py, imported in-process (docs/ is not a package)."""
    spec = importlib.util.spec_from_file_location("gen_api", DOCS / "gen_api.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gen_api", module)
    spec.loader.exec_module(module)
    return module


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT))


_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})[^\n]*\n.*?^ {0,3}\1[ \t]*$", re.M | re.S)
_SPAN = re.compile(r"(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)


def split_code(text: str) -> tuple[str, list[str]]:
    """``text`` without its code (fenced blocks and inline spans), and the code."""
    code: list[str] = []

    def block(match: re.Match[str]) -> str:
        code.append(match.group(0))
        return "\n" * match.group(0).count("\n")

    def span(match: re.Match[str]) -> str:
        code.append(match.group(2))
        return " "

    text = _FENCE.sub(block, text)
    return _SPAN.sub(span, text), code


# --------------------------------------------------------------------------- (a) api.md


def test_api_md_is_generated_from_the_docstrings() -> None:
    problem = gen_api().check()
    assert problem is None, problem


# --------------------------------------------------------------------------- (b) links

_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)
_HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+(.+?)[ \t#]*$", re.M)
_HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.I)


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown text (repeats get -1, -2 …)."""
    prose = _FENCE.sub("", text)
    anchors: set[str] = set(_HTML_ANCHOR.findall(prose))
    counts: dict[str, int] = {}
    for heading in _HEADING.findall(prose):
        heading = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links: their text
        base = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = counts.get(base, 0)
        counts[base] = n + 1
        anchors.add(base if n == 0 else f"{base}-{n}")
    return anchors


@cache
def anchors(path: Path) -> frozenset[str]:
    return frozenset(heading_anchors(path.read_text(encoding="utf-8")))


def test_relative_links_reach_existing_files_and_headings() -> None:
    bad: list[str] = []
    for path in markdown_files():
        prose, _ = split_code(path.read_text(encoding="utf-8"))
        for target in _LINK.findall(prose) + _REFERENCE.findall(prose):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto: …
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.exists():
                if not (dest.parent == DOCS and dest.name in PENDING):
                    bad.append(f"{shown(path)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{shown(path)}: {target} (no such heading)")
    assert not bad, "broken links:\n" + "\n".join(bad)


# --------------------------------------------------------------------------- (c) names

_NAME = re.compile(r"(?<![\w./-])(fp|flashplan)((?:\.[A-Za-z_]\w*)+)")
_IMPORT = re.compile(r"^\s*from\s+(flashplan[\w.]*)\s+import\s+\(?([\w\s,]+?)\)?\s*$", re.M)
_MEMBER = re.compile(r"(?<![\w.])([A-Z]\w*)\.([A-Za-z_]\w*)")


def names_in(code: str) -> set[str]:
    """Dotted flashplan names in a piece of code: ``fp.X.y``, ``flashplan.x.Y``, what a
    ``from flashplan.x import A, B`` imports, and ``Record.field`` of a public record."""
    import flashplan

    names = {"flashplan" + m.group(2) for m in _NAME.finditer(code)}
    for m in _IMPORT.finditer(code):
        names.update(f"{m.group(1)}.{n.strip()}" for n in m.group(2).split(",") if n.strip())
    for m in _MEMBER.finditer(code):
        if m.group(1) in flashplan.__all__:
            names.add(f"flashplan.{m.group(1)}.{m.group(2)}")
    return names


def test_names_in_code_exist() -> None:
    resolve, is_missing = gen_api().resolve_dotted, gen_api().is_missing
    bad: list[str] = []
    for path in markdown_files():
        _, code = split_code(path.read_text(encoding="utf-8"))
        for name in sorted(set().union(*map(names_in, code))):
            if is_missing(resolve(name)):
                bad.append(f"{shown(path)}: {name}")
    assert not bad, "names in the docs that do not exist:\n" + "\n".join(bad)
