"""Testing helpers for code built on flashplan: public Hypothesis strategies.

Property-test your integration with the same generators flashplan's own tests use::

    from hypothesis import given
    from flashplan.testing import extend_layouts, head_configs

    @given(extend_layouts(max_batch=4), head_configs())
    def test_my_backend(layout, heads):
        spec = flashplan.plan(layout, heads)
        ...

This subpackage is the only part of flashplan that needs ``hypothesis``
(``pip install flashplan[test]``). It is imported lazily: ``import flashplan.testing``
works without it, and the first use of a strategy raises an :class:`ImportError`
that says what to install.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "DTYPES",
    "GROUP_KINDS",
    "HEAD_DIMS",
    "INVALID_KINDS",
    "PAGE_SIZES",
    "InvalidCase",
    "attention_groups",
    "construct",
    "decode_layouts",
    "extend_layouts",
    "head_configs",
    "invalid_layout_kwargs",
    "kv_caches",
    "layouts",
    "page_tables",
]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        module = importlib.import_module("flashplan.testing.strategies")
    except ImportError as exc:  # pragma: no cover - depends on the environment
        if exc.name == "hypothesis":
            raise ImportError(
                "flashplan.testing needs hypothesis: pip install 'flashplan[test]' "
                "(or pip install hypothesis)"
            ) from exc
        raise
    return getattr(module, name)


def __dir__() -> list[str]:
    return sorted(__all__)
