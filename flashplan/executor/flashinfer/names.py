"""The names of a batch's staged arrays and integers (no other module spells one):
``[s<step>/][g<group>. | l<level>.][mask. | items. | qo.]<field>``, e.g. ``qo_indptr``
(int32 ``[bs + 1]``, tokens), ``g<i>.page_indptr`` (``[bs + 1]``, pages),
``g<i>.last_page_len`` and ``g<i>.kv_lens`` (``[bs]``, tokens), ``l<k>.q_rows``. Gather
regions: :mod:`~flashplan.executor.gathers`.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from flashplan.executor.gathers import WRITE, is_pages_region, level_pages_region, pages_region

__all__ = [
    "JOBS", "QO_INDPTR", "WRITE", "GroupArray", "ItemField", "ItemPart", "LevelArray",
    "MaskField", "Parsed", "batch_int", "group_array", "group_int", "is_pages_region",
    "item_name", "item_part", "level_array", "level_int", "level_pages_region", "level_part",
    "mask_name", "pages_region", "parse", "step_of", "step_prefix",
]  # fmt: skip

#: The job table's slice: :attr:`~flashplan.executor.gathers.GatherJobs.table` flattened
#: (int32 ``6 * num_jobs``).
JOBS = "jobs"
#: The batch's query indptr (int32 ``[bs + 1]``, tokens).
QO_INDPTR = "qo_indptr"
#: A group's staged arrays.
GroupArray = Literal["page_indptr", "last_page_len", "kv_lens", "qo_indptr"]
#: A group's (or a cascade level's) batch integers.
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
#: The parts of a multi-item group's token positions: the items' starts and lengths
#: (staged), the dense size and the longest item (integers).
ItemPart = Literal["start", "length", "size", "longest"]


def step_prefix(step: int | None) -> str:
    """The prefix of step ``step``'s names in a multi-step draft (``""``: none)."""
    return "" if step is None else f"s{step}/"


def step_of(prefix: str) -> int:
    """The step of a name prefix (``"s3/"`` -> 3, ``""`` -> 0)."""
    return int(prefix[1:-1]) if prefix else 0


def batch_int(field: Literal["qo.total", "qo.max_len"], prefix: str = "") -> str:
    """A batch-wide integer's name."""
    return prefix + field


def group_array(group: int, field: GroupArray | GroupInt, prefix: str = "") -> str:
    """Group ``group``'s staged array or batch integer ``field``."""
    return f"{prefix}g{group}.{field}"


def level_part(level: int) -> str:
    """The part name of cascade level ``level``'s call among a batch's planned wrappers
    (beside ``"paged"`` and ``"ragged"``)."""
    return f"level{level}"


def level_array(level: int, field: LevelArray | GroupInt, prefix: str = "") -> str:
    """Cascade level ``level``'s staged array or batch integer ``field``."""
    return f"{prefix}l{level}.{field}"


#: The names of a group's or a level's batch integers (spelled as its arrays').
group_int, level_int = group_array, level_array


def mask_name(group: int, field: MaskField, prefix: str = "") -> str:
    """Group ``group``'s device-built mask array ``field``."""
    return f"{prefix}g{group}.mask.{field}"


def item_name(group: int, field: ItemField, prefix: str = "") -> str:
    """Group ``group``'s multi-item tensor or integer ``field``."""
    return f"{prefix}g{group}.items.{field}"


def item_part(positions: str, part: ItemPart) -> str:
    """Part ``part`` of the token positions named ``positions``."""
    return f"{positions}.{part}"


class Parsed(NamedTuple):
    """A name's step prefix, group (``None``: batch-wide), kind (``"mask"``, ``"qo"``…), field."""

    prefix: str
    group: int | None
    kind: str
    field: str


def parse(name: str) -> Parsed:
    """The parts of a staged array's or integer's name (the constructors' inverse)."""
    prefix = ""
    group: int | None = None
    if name.startswith("s") and "/" in name:
        head, name = name.split("/", 1)
        prefix = head + "/"
    if name.startswith("g") and "." in name:
        head, name = name.split(".", 1)
        group = int(head[1:])
    kind, _, field = name.rpartition(".")
    return Parsed(prefix, group, kind, field)
