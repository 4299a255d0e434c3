"""The FlashInfer / Triton adapter (CPU only): its one version table, the once-only
warning on an unknown flashinfer, and that no other module of flashplan touches
FlashInfer's or Triton's private API."""

from __future__ import annotations

import ast
import subprocess
import sys
import types
import warnings
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest

import flashplan.executor.flashinfer.adapter as adapter
from flashplan.executor.flashinfer.adapter import (
    SUPPORTED,
    DirectLaunch,
    FlashInferVersionWarning,
    Support,
    check_version,
    direct_launch_known,
    fast_decode_available,
    fast_prefill_available,
    flashinfer_support,
)
from flashplan.kernels._triton import HAS_TRITON, triton, triton_mode

PACKAGE = Path(__file__).resolve().parents[1] / "flashplan"
ADAPTER = PACKAGE / "executor" / "flashinfer" / "adapter.py"


def fake(version: str, has_function: bool = True) -> types.SimpleNamespace:
    """A stand-in for the flashinfer module: its version, and ``fast_decode_plan``."""
    ns = types.SimpleNamespace(__version__=version)
    if has_function:
        ns.fast_decode_plan = lambda *a, **k: None
    return ns


# ----------------------------------------------------------------------- the version table
def test_the_table_for_0_7_4() -> None:
    want = Support(flashinfer="0.7.4", fast_decode=True, fast_prefill=True)
    assert SUPPORTED.flashinfer["0.7.4"] == want
    for version in ("0.7.4", "0.7.4+cu130"):
        assert flashinfer_support(fake(version)) == want
        assert fast_decode_available(fake(version))
        assert fast_prefill_available(fake(version))
    # a decode re-plan calls the compiled scheduler, not the exported fast_decode_plan
    assert fast_decode_available(fake("0.7.4", has_function=False))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_version("0.7.4") and check_version("0.7.4+cu130")


def test_an_unknown_version_has_no_fast_path_and_warns_once() -> None:
    fi = fake("9.9.9")
    assert flashinfer_support(fi) is None
    assert not fast_decode_available(fi) and not fast_prefill_available(fi)
    assert flashinfer_support(types.SimpleNamespace()) is None  # no __version__ at all
    adapter._warn_unknown.cache_clear()  # other tests of this process may have warned
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")  # once per process: not the filters' doing
        assert not check_version(fi.__version__)
        assert not check_version(fi.__version__)
        assert not check_version("9.9.8")  # another version warns on its own
    got = [w for w in seen if issubclass(w.category, FlashInferVersionWarning)]
    assert len(got) == 2, [str(w.message) for w in seen]
    first = str(got[0].message)
    assert "flashinfer 9.9.9 " in first and "(0.7.4)" in first and "plan()" in first
    assert "flashinfer 9.9.8 " in str(got[1].message)


def test_the_table_is_read_only() -> None:
    with pytest.raises(TypeError):
        SUPPORTED.flashinfer["9.9.9"] = Support("9.9.9", True, True)  # type: ignore[index]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        SUPPORTED.flashinfer["0.7.4"].fast_decode = False  # type: ignore[misc]
    assert all(key == s.flashinfer for key, s in SUPPORTED.flashinfer.items())


def test_the_triton_table() -> None:
    assert SUPPORTED.triton_direct_launch == ("3.6.0", "3.9.0")
    for version in ("3.6.0", "3.9.0", "3.9.0+git1234"):
        assert direct_launch_known(version)
    for version in ("3.5.1", "3.7.0", "4.0.0", ""):
        assert not direct_launch_known(version)
    direct = DirectLaunch(object())
    assert direct.enabled == (
        HAS_TRITON and triton_mode() == "compiled" and direct_launch_known(triton.__version__)
    )


def test_a_disabled_direct_launch_goes_through_the_jit_launch() -> None:
    launched: list[tuple[object, tuple[object, ...]]] = []

    class Kernel:
        def __getitem__(self, grid: object) -> object:
            return lambda *args: launched.append((grid, args))

    direct = DirectLaunch(Kernel())
    direct.enabled = False  # as under another Triton or the interpreter
    direct(3, "key", (1, 2), (2,))
    assert launched == [((3,), (1, 2))] and direct.direct == 0 and not direct.variants


def test_the_kernels_import_the_adapter_lazily() -> None:
    code = (
        "import sys, flashplan.kernels, flashplan.kernels.fused; "
        "print(sorted(m for m in sys.modules if m.startswith('flashplan.executor.flashinfer')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_adapter_stays_one_module_within_the_limit() -> None:
    assert len(ADAPTER.read_text().splitlines()) <= 500


# ------------------------------------------------------------- private API: the adapter only
#: Triton's internals the direct launch uses: a compiled kernel's launcher and metadata,
#: the runtime's driver and launch hooks.
TRITON_PRIVATE = frozenset(
    {"launch_metadata", "packed_metadata", "launch_enter_hook", "launch_exit_hook", "knobs",
     "driver"}
)  # fmt: skip
#: FlashInfer's compiled module, and the exported decode re-plan (it skips ``plan()``'s
#: checks, so it is used on checked versions only: the adapter's business).
FLASHINFER_ALWAYS = frozenset({"_cached_module", "fast_decode_plan"})


def _accesses(tree: ast.AST) -> Iterator[tuple[ast.expr, str, int]]:
    """(object, attribute, line) of every attribute access in ``tree``, ``getattr`` /
    ``setattr`` / ``hasattr`` / ``delattr`` with a constant name included."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            yield node.value, node.attr, node.lineno
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in {"getattr", "setattr", "hasattr", "delattr"}
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            yield node.args[0], node.args[1].value, node.lineno


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _is_wrapper(node: ast.expr) -> bool:
    """flashplan's names for a FlashInfer wrapper: ``w``, ``wrapper``, ``<x>.wrapper``."""
    if isinstance(node, ast.Name):
        return node.id in {"w", "wrapper"}
    return isinstance(node, ast.Attribute) and node.attr == "wrapper"


def _wrapper_fields(source: str) -> frozenset[str]:
    """The private wrapper fields ``source`` reads or writes."""
    tree = ast.parse(source)
    return frozenset(n for obj, n, _ in _accesses(tree) if _private(n) and _is_wrapper(obj))


#: Every private name the adapter uses (wrapper fields read off its own code), plus the
#: fixed ones above: no other module may access an attribute of that name.
FORBIDDEN = _wrapper_fields(ADAPTER.read_text()) | FLASHINFER_ALWAYS | TRITON_PRIVATE


def private_uses(source: str) -> list[str]:
    """Where ``source`` touches FlashInfer's or Triton's private API: any private
    attribute of a wrapper, or any attribute named in :data:`FORBIDDEN`."""
    return [
        f"{line}: {ast.unparse(obj)}.{name}"
        for obj, name, line in _accesses(ast.parse(source))
        if (_private(name) and _is_wrapper(obj)) or name in FORBIDDEN
    ]


def test_no_module_but_the_adapter_touches_private_api() -> None:
    bad = [
        f"{path.relative_to(PACKAGE.parent)}:{hit}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != ADAPTER
        for hit in private_uses(path.read_text())
    ]
    assert not bad, "private FlashInfer / Triton API outside the adapter:\n" + "\n".join(bad)


def test_the_scan_sees_the_adapters_uses() -> None:
    """The scan finds what the adapter does (so an empty result elsewhere means
    something)."""
    hits = "\n".join(private_uses(ADAPTER.read_text()))
    for needle in ("w._cached_module", "w._paged_kv_last_page_len_buf",
                   "w._qo_indptr_buf", "slot.wrapper._kv_lens_buffer", "w._plan_info",
                   "wrapper._backend", "triton.knobs", "variant.launch_metadata",
                   "variant.packed_metadata", "triton.runtime.driver"):  # fmt: skip
        assert needle in hits, needle
    assert {"_qo_indptr_buf", "_paged_kv_indices_buf", "_plan_info"} <= FORBIDDEN


@pytest.mark.parametrize(
    "line",
    [
        "wrapper._paged_kv_last_page_len_buf = arrays.last_page_len_device",
        "slot.wrapper._kv_lens_buffer = own",
        "held.wrapper._qo_indptr_buf = view",
        "w._plan_info = w._cached_module.plan(a, b)",
        "info = self._planned[key]._plan_info",
        "fi.fast_decode_plan(wrapper, indptr, indices, last_page_len)",
        "ok = getattr(wrapper, '_backend', None) == 'fa2'",
        "hooks = triton.knobs.runtime",
        "device = triton.runtime.driver.active.get_current_device()",
        "variant.run(grid, 1, 1, stream, variant.function, variant.packed_metadata, m)",
    ],
)
def test_the_scan_flags_private_uses(line: str) -> None:
    assert private_uses(line), line


@pytest.mark.parametrize(
    "line",
    [
        "wrapper.plan(**kwargs)",
        "out = held.wrapper.run(q, kv, return_lse=True)",
        "tc = wrapper.use_tensor_cores",
        "held = self._pool.acquire(key, make)",
        "r = r._replace(name=name)",
        "v = fi.__version__",
    ],
)
def test_the_scan_passes_public_uses(line: str) -> None:
    assert not private_uses(line), line
