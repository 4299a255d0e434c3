"""The names of a batch's staged arrays, batch integers and gather regions.

One module spells them; every other module builds them with these constructors, whose
field arguments are ``Literal`` types a type checker holds to the known fields, and
reads them back with :func:`parse`. A name is a plain string (a dict key hashed once,
compared fast on the host path) of the form::

    [s<step>/][g<group>.][mask. | items. | qo.]<field>

* batch-wide: ``qo_indptr`` (int32 ``[bs + 1]``, tokens), the integers ``qo.total``
  and ``qo.max_len``, and the gather job table ``jobs``;
* per group ``g<i>.``: ``page_indptr`` (``[bs + 1]``, pages), ``last_page_len``
  (``[bs]``, tokens), ``kv_lens`` (``[bs]``, tokens), a virtual-request group's own
  ``qo_indptr`` and ``qo.*`` integers, ``max_kv_len`` (an integer);
* a group's device-built mask ``g<i>.mask.<field>`` and multi-item tensors
  ``g<i>.items.<field>``;
* cascade level ``l``'s call (shared by every group that runs on the levels)
  ``l<l>.<field>``: ``qo_indptr`` (``[groups + 1]``), ``page_indptr``,
  ``last_page_len``, ``kv_lens``, ``q_rows`` (the batch row of each of its query rows,
  staged only where the level leaves some rows out) and the integers ``l<l>.qo.total``,
  ``l<l>.qo.max_len`` and ``l<l>.max_kv_len``;
* a multi-step draft's step ``k``: every name of that step under ``s<k>/``.

Gather regions (:class:`~flashplan.executor.gathers.Region` names, shared with the
reference executor and re-exported here from :mod:`~flashplan.executor.gathers`) are
``pages/<group>``, ``pages/l<level>`` (a cascade level's shared pages), ``write``,
``write/window`` and ``encoder``.
"""

from __future__ import annotations

import functools
from typing import Literal, NamedTuple

from flashplan.executor.gathers import (
    ENCODER,
    WRITE,
    WRITE_WINDOW,
    is_pages_region,
    level_pages_region,
    pages_region,
)

__all__ = [
    "ENCODER",
    "JOBS",
    "QO_INDPTR",
    "WRITE",
    "WRITE_WINDOW",
    "GroupArray",
    "ItemField",
    "ItemPart",
    "LevelArray",
    "MaskField",
    "Parsed",
    "batch_int",
    "group_array",
    "group_int",
    "is_pages_region",
    "item_name",
    "item_part",
    "level_array",
    "level_int",
    "level_pages_region",
    "mask_name",
    "pages_region",
    "parse",
    "step_of",
    "step_prefix",
]

#: Name of the job table's slice: :attr:`~flashplan.executor.gathers.GatherJobs.table`
#: flattened, ``6 * num_jobs`` int32 (its six columns end to end, in
#: :func:`~flashplan.kernels.gather_slots` order).
JOBS = "jobs"
#: The batch's query indptr (int32 ``[bs + 1]``, tokens).
QO_INDPTR = "qo_indptr"
#: A group's staged arrays.
GroupArray = Literal["page_indptr", "last_page_len", "kv_lens", "qo_indptr"]
#: A group's batch integers.
GroupInt = Literal["max_kv_len", "qo.total", "qo.max_len"]
#: A cascade level's staged arrays.
LevelArray = Literal["qo_indptr", "page_indptr", "last_page_len", "kv_lens", "q_rows"]
#: The arrays of a device-built mask (threshold, tree or position mask).
MaskField = Literal[
    "qo_lens", "kv_lens", "indptr", "first_visible", "row_offsets", "tail_start",
    "tail_words", "row_position", "col_position", "rule",
]  # fmt: skip
#: A multi-item group's tensors and integers.
ItemField = Literal["prefix_len", "max_len", "tpos", "tpos_len", "start", "length"]


def step_prefix(step: int | None) -> str:
    """The prefix of step ``step``'s names in a multi-step draft (``""``: none)."""
    return "" if step is None else f"s{step}/"


def step_of(prefix: str) -> int:
    """The step a name prefix belongs to (``"s3/"`` -> 3; ``""``, a single apply -> 0):
    the inverse of :func:`step_prefix`."""
    return int(prefix[1:-1]) if prefix else 0


def batch_int(field: Literal["qo.total", "qo.max_len"], prefix: str = "") -> str:
    """A batch-wide integer's name."""
    return prefix + field


def group_array(group: int, field: GroupArray, prefix: str = "") -> str:
    """Group ``group``'s staged array ``field``."""
    return f"{prefix}g{group}.{field}"


def group_int(group: int, field: GroupInt, prefix: str = "") -> str:
    """Group ``group``'s batch integer ``field``."""
    return f"{prefix}g{group}.{field}"


def level_array(level: int, field: LevelArray, prefix: str = "") -> str:
    """Cascade level ``level``'s staged array ``field``."""
    return f"{prefix}l{level}.{field}"


def level_int(level: int, field: GroupInt, prefix: str = "") -> str:
    """Cascade level ``level``'s batch integer ``field``."""
    return f"{prefix}l{level}.{field}"


def mask_name(group: int, field: MaskField, prefix: str = "") -> str:
    """Group ``group``'s device-built mask array ``field``."""
    return f"{prefix}g{group}.mask.{field}"


def item_name(group: int, field: ItemField, prefix: str = "") -> str:
    """Group ``group``'s multi-item tensor or integer ``field`` (the token positions'
    parts: :func:`item_part`)."""
    return f"{prefix}g{group}.items.{field}"


#: The parts of a multi-item group's token positions (``item_name(g, "tpos")``): the
#: items' starts and lengths (staged) and the dense size and longest item (integers).
ItemPart = Literal["start", "length", "size", "longest"]


def item_part(positions: str, part: ItemPart) -> str:
    """Part ``part`` of the token positions named ``positions``."""
    return f"{positions}.{part}"


class Parsed(NamedTuple):
    """A name's parts: its step prefix, group (``None``: batch-wide), kind (``""``,
    ``"mask"``, ``"items"`` or ``"qo"``) and field."""

    prefix: str
    group: int | None
    kind: str
    field: str


@functools.lru_cache(maxsize=4096)
def parse(name: str) -> Parsed:
    """The parts of a staged array's or integer's name (the inverse of the
    constructors above). Memoized: a pure function of the name, read every replay."""
    prefix = ""
    if name.startswith("s") and "/" in name:
        head, name = name.split("/", 1)
        prefix = head + "/"
    group = None
    if name.startswith("g") and "." in name:
        head, name = name.split(".", 1)
        group = int(head[1:])
    kind, _, field = name.rpartition(".")
    return Parsed(prefix, group, kind, field)
