"""Pure planning: `BatchLayout` -> `PlanSpec` (host data only)."""

from flashplan.plan.planner import plan
from flashplan.plan.policy import default_extend_path
from flashplan.plan.spec import (
    ExtendPath,
    GroupPlan,
    KernelPath,
    PagedPart,
    PlanKey,
    PlanSpec,
    RaggedPart,
)

__all__ = [
    "ExtendPath",
    "GroupPlan",
    "KernelPath",
    "PagedPart",
    "PlanKey",
    "PlanSpec",
    "RaggedPart",
    "default_extend_path",
    "plan",
]
