"""A registry of flashplan's record constructors, by name (for the invalid-input catalogue
and for tests that build records from drawn keyword arguments).

Every route a user has to a record is here: the named constructors, the attrs
``__init__`` itself (``"BatchLayout"``, ``"ShareLevel"`` …) and ``attrs.evolve`` of a
valid record (``"evolve(BatchLayout)"`` …), so that one catalogue of invalid input is
tried on all of them alike.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs

from flashplan.layout import AttentionGroup, BatchLayout, DraftTree, HeadConfig
from flashplan.layout.shared_prefix import SharedPrefix, ShareLevel

__all__ = ["CONSTRUCTORS", "construct"]

#: The valid records that the ``evolve(...)`` routes change (each field of a draw replaces
#: the record's).
_EVOLVED: Mapping[str, Any] = {
    "BatchLayout": BatchLayout.extend([3, 4], [1, 0], page_size=2),
    "AttentionGroup": AttentionGroup.sliding(7),
    "HeadConfig": HeadConfig(8, 2, 64),
    "DraftTree": DraftTree.from_parents([[-1, 0, 0]]),
    "ShareLevel": ShareLevel.from_ranges([0], [2], [4]),
    "SharedPrefix": SharedPrefix.from_groups([[0, 1]], [4]),
}


def _evolve(name: str) -> Callable[..., Any]:
    def evolve(**changes: Any) -> Any:
        return attrs.evolve(_EVOLVED[name], **changes)

    evolve.__name__ = evolve.__qualname__ = f"evolve_{name}"
    return evolve


#: The public record constructors by name (``"BatchLayout.extend"``, ...): what the
#: invalid-input catalogue (:mod:`flashplan.testing.invalid`) calls with junk arguments.
#: ``"X"`` is the attrs ``__init__`` of record ``X``, ``"evolve(X)"`` is ``attrs.evolve``
#: of a valid ``X`` with the keyword arguments as changes.
CONSTRUCTORS: Mapping[str, Callable[..., Any]] = {
    "BatchLayout": BatchLayout,
    "BatchLayout.of": BatchLayout.of,
    "evolve(BatchLayout)": _evolve("BatchLayout"),
    "BatchLayout.decode": BatchLayout.decode,
    "BatchLayout.extend": BatchLayout.extend,
    "BatchLayout.from_extend_lens": BatchLayout.from_extend_lens,
    "AttentionGroup": AttentionGroup,
    "evolve(AttentionGroup)": _evolve("AttentionGroup"),
    "AttentionGroup.sliding": AttentionGroup.sliding,
    "HeadConfig": HeadConfig,
    "evolve(HeadConfig)": _evolve("HeadConfig"),
    "DraftTree": DraftTree,
    "evolve(DraftTree)": _evolve("DraftTree"),
    "ShareLevel": ShareLevel,
    "ShareLevel.from_ranges": ShareLevel.from_ranges,
    "evolve(ShareLevel)": _evolve("ShareLevel"),
    "SharedPrefix": SharedPrefix,
    "evolve(SharedPrefix)": _evolve("SharedPrefix"),
}


def construct(constructor: str, kwargs: Mapping[str, Any]) -> Any:
    """Call the constructor named by an :func:`invalid_layout_kwargs` draw (a key of
    :data:`CONSTRUCTORS`: ``"BatchLayout"``, ``"BatchLayout.extend"``,
    ``"evolve(BatchLayout)"``, ``"HeadConfig"`` …) with ``kwargs``."""
    return CONSTRUCTORS[constructor](**kwargs)
