"""A registry of flashplan's record constructors, by name (for the invalid-input catalogue
and for tests that build records from drawn keyword arguments)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from flashplan.layout import AttentionGroup, BatchLayout, HeadConfig

__all__ = ["CONSTRUCTORS", "construct"]

#: The public record constructors by name (``"BatchLayout.extend"``, ...): what the
#: invalid-input catalogue (:mod:`flashplan.testing.invalid`) calls with junk arguments.
CONSTRUCTORS: Mapping[str, Callable[..., Any]] = {
    "BatchLayout.decode": BatchLayout.decode,
    "BatchLayout.extend": BatchLayout.extend,
    "BatchLayout.from_extend_lens": BatchLayout.from_extend_lens,
    "AttentionGroup": AttentionGroup,
    "AttentionGroup.sliding": AttentionGroup.sliding,
    "HeadConfig": HeadConfig,
}


def construct(constructor: str, kwargs: Mapping[str, Any]) -> Any:
    """Call the constructor named by an :func:`invalid_layout_kwargs` draw.

    ``constructor`` is one of ``"BatchLayout.decode"``, ``"BatchLayout.extend"``,
    ``"BatchLayout.from_extend_lens"``, ``"AttentionGroup"``, ``"AttentionGroup.sliding"``,
    ``"HeadConfig"``.
    """
    return CONSTRUCTORS[constructor](**kwargs)
