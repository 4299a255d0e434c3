"""flashplan: pure planning of FlashInfer attention batches.

Layout (host records) -> planning (frozen ``PlanSpec``) -> executor (FlashInfer or
pure-torch reference).

The top level holds what a user needs: the layout records, ``plan`` / ``plan_steps``, the
reference executor and the errors. ``import flashplan`` loads neither Triton nor
FlashInfer; the GPU executor's names (``FlashInferExecutor``, ``graph_executor``,
``GraphBucket``, ``capture``, ``ExecutorPolicy``) are reachable here too, imported on first
use. The plan's parts (``PagedPart``, ``PlanKey``, ``KernelPath`` …) live in
:mod:`flashplan.planning`.
"""

from __future__ import annotations

import importlib
from typing import Any

from flashplan.draft_kv import compact_accepted, copy_prefix_pages
from flashplan.errors import (
    BucketError,
    DeviceUnavailableError,
    FieldTypeError,
    FlashplanError,
    LayoutError,
    OptionError,
    OptionTypeError,
    PageTableError,
    PlanIntegrityError,
    PlanMismatchError,
    RunTypeError,
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
from flashplan.layout.shared_prefix import (
    SharedPrefix,
    ShareLevel,
    check_shared_pages,
    share_pages,
)
from flashplan.planning import ExtendPath, PlanSpec, materialize, plan, plan_steps
from flashplan.planning.cascade import cascade_levels, cascade_pays

#: The FlashInfer executor's public names, imported on first use (CUDA, Triton and
#: flashinfer-python are needed to use them, not to import flashplan).
_GPU_NAMES = {
    "ExecutorPolicy": "flashplan.executor.flashinfer",
    "FlashInferExecutor": "flashplan.executor.flashinfer",
    "GraphBucket": "flashplan.executor.flashinfer",
    "graph_executor": "flashplan.executor.flashinfer",
    "capture": "flashplan.executor.flashinfer",
    # registers the flashplan::run custom op on first use (torch.library)
    "AttentionOp": "flashplan.executor.custom_op",
    "attention": "flashplan.executor.custom_op",
}

__all__ = [
    "AttentionGroup",
    "AttentionOp",
    "BatchLayout",
    "BucketError",
    "DeviceUnavailableError",
    "DraftDecode",
    "DraftTree",
    "Executor",
    "ExecutorPolicy",
    "ExtendPath",
    "FieldTypeError",
    "FlashInferExecutor",
    "FlashplanError",
    "GraphBucket",
    "HeadConfig",
    "ItemDelimiters",
    "LayoutError",
    "Mode",
    "OptionError",
    "OptionTypeError",
    "PageTable",
    "PageTableError",
    "PlanIntegrityError",
    "PlanMismatchError",
    "PlanSpec",
    "ReferenceExecutor",
    "RunTypeError",
    "ShareLevel",
    "SharedPrefix",
    "UnsupportedError",
    "attention",
    "capture",
    "cascade_levels",
    "cascade_pays",
    "check_shared_pages",
    "compact_accepted",
    "copy_prefix_pages",
    "graph_executor",
    "materialize",
    "plan",
    "plan_steps",
    "share_pages",
]


def __getattr__(name: str) -> Any:
    home = _GPU_NAMES.get(name)
    if home is None:
        raise AttributeError(f"module 'flashplan' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)


def __dir__() -> list[str]:
    return sorted({*__all__, "__version__"})


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("flashplan")
    except PackageNotFoundError:  # pragma: no cover - a tree that is not installed
        return "0+unknown"


__version__ = _package_version()
