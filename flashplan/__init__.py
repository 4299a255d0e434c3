"""flashplan: pure planning of FlashInfer attention batches.

Layout (host records) -> plan (frozen ``PlanSpec``) -> executor (FlashInfer or
pure-torch reference).
"""

from flashplan.errors import (
    FlashplanError,
    LayoutError,
    PageTableError,
    PlanMismatchError,
    UnsupportedError,
)
from flashplan.executor import ReferenceExecutor
from flashplan.layout import AttentionGroup, BatchLayout, HeadConfig, Mode, PageTable
from flashplan.plan import (
    ExtendPath,
    GroupPlan,
    KernelPath,
    PagedPart,
    PlanKey,
    PlanSpec,
    RaggedPart,
    plan,
)

__all__ = [
    "AttentionGroup",
    "BatchLayout",
    "ExtendPath",
    "FlashplanError",
    "GroupPlan",
    "HeadConfig",
    "KernelPath",
    "LayoutError",
    "Mode",
    "PageTable",
    "PageTableError",
    "PagedPart",
    "PlanKey",
    "PlanMismatchError",
    "PlanSpec",
    "RaggedPart",
    "ReferenceExecutor",
    "UnsupportedError",
    "plan",
]

__version__ = "0.1.0"
