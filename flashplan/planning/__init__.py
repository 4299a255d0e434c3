"""Pure planning: `BatchLayout` -> `PlanSpec` (host data only)."""

from flashplan.errors import PlanIntegrityError
from flashplan.lengths import Lengths, PageSpans
from flashplan.planning.items import MultiItemTensors, plan_items
from flashplan.planning.masks import CustomMask, ThresholdMask, TreeMask
from flashplan.planning.planner import plan, plan_steps, planned_groups
from flashplan.planning.policy import default_extend_path
from flashplan.planning.positions import PositionRuns
from flashplan.planning.spec import (
    ExtendPath,
    GroupPlan,
    KernelPath,
    PagedPart,
    PlanKey,
    PlanSpec,
    RaggedPart,
)
from flashplan.planning.visibility import materialize

__all__ = [
    "CustomMask",
    "ExtendPath",
    "GroupPlan",
    "KernelPath",
    "Lengths",
    "MultiItemTensors",
    "PageSpans",
    "PagedPart",
    "PlanIntegrityError",
    "PlanKey",
    "PlanSpec",
    "PositionRuns",
    "RaggedPart",
    "ThresholdMask",
    "TreeMask",
    "default_extend_path",
    "materialize",
    "plan",
    "plan_items",
    "plan_steps",
    "planned_groups",
]
