"""flashplan: pure planning of FlashInfer attention batches.

Layout (host records) -> planning (frozen ``PlanSpec``) -> executor (FlashInfer or
pure-torch reference).
"""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

from flashplan.errors import (
    BucketError,
    FlashplanError,
    LayoutError,
    PageTableError,
    PlanMismatchError,
    UnsupportedError,
)
from flashplan.executor import Executor, ReferenceExecutor
from flashplan.layout import (
    AttentionGroup,
    BatchLayout,
    DraftDecode,
    DraftTree,
    HeadConfig,
    ItemDelimiters,
    Mode,
    PageTable,
)
from flashplan.planning import (
    ExtendPath,
    GroupPlan,
    KernelPath,
    MultiItemTensors,
    PagedPart,
    PlanIntegrityError,
    PlanKey,
    PlanSpec,
    PositionRuns,
    RaggedPart,
    materialize,
    plan,
    plan_steps,
)

__all__ = [
    "AttentionGroup",
    "BatchLayout",
    "BucketError",
    "DraftDecode",
    "DraftTree",
    "Executor",
    "ExtendPath",
    "FlashplanError",
    "GroupPlan",
    "HeadConfig",
    "ItemDelimiters",
    "KernelPath",
    "LayoutError",
    "Mode",
    "MultiItemTensors",
    "PageTable",
    "PageTableError",
    "PagedPart",
    "PlanIntegrityError",
    "PlanKey",
    "PlanMismatchError",
    "PlanSpec",
    "PositionRuns",
    "RaggedPart",
    "ReferenceExecutor",
    "UnsupportedError",
    "materialize",
    "plan",
    "plan_steps",
]

try:
    __version__ = _version("flashplan")
except PackageNotFoundError:  # pragma: no cover - running from a tree that is not installed
    __version__ = "0+unknown"
