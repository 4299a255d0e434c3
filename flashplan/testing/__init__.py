"""Testing helpers for code built on flashplan: public Hypothesis strategies.

Property-test your integration with the same generators flashplan's own tests use::

    from hypothesis import given
    from flashplan.testing import extend_layouts, head_configs

    @given(extend_layouts(max_batch=4), head_configs())
    def test_my_backend(layout, heads):
        spec = flashplan.plan(layout, heads)
        ...

Nine modules, by role: :mod:`flashplan.testing.valid` (strategies of valid layouts and
the groups, draft trees and items they are made of), :mod:`flashplan.testing.valid_kv`
(strategies of valid heads, page tables and KV caches),
:mod:`flashplan.testing.invalid` (the catalogue of input flashplan must refuse),
:mod:`flashplan.testing.constructors` (record constructors by name),
:mod:`flashplan.testing.batches` (fixed example batches the benchmarks share),
:mod:`flashplan.testing.sequences` (long seeded random batch sequences, every mode),
:mod:`flashplan.testing.checking` (one long-lived executor checked batch by batch
against a fresh oracle, as an engine keeps it), :mod:`flashplan.testing.graph_buckets`
(one executor's CUDA-graph buckets replayed over many batches, each checked against a
fresh reference) and :mod:`flashplan.testing.compare` (an executor that runs every call
on two executors, for an engine's step loop); the last five need no Hypothesis.

This subpackage is the only part of flashplan that needs ``hypothesis``
(``pip install flashplan[test]``). It is imported lazily: ``import flashplan.testing``
works without it, and the first use of a strategy raises an :class:`ImportError`
that says what to install.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "GROUP_KINDS": "valid",
    "LOCAL_GROUP_KINDS": "valid",
    "PAGE_SIZES": "valid",
    "attention_groups": "valid",
    "decode_layouts": "valid",
    "extend_layouts": "valid",
    "fixed_token_extend_layouts": "valid",
    "item_requests": "valid",
    "layouts": "valid",
    "multi_item_layouts": "valid",
    "draft_trees": "valid",
    "verify_layouts": "valid",
    "DTYPES": "valid_kv",
    "HEAD_DIMS": "valid_kv",
    "head_configs": "valid_kv",
    "kv_caches": "valid_kv",
    "page_tables": "valid_kv",
    "INVALID_KINDS": "invalid",
    "InvalidCase": "invalid",
    "invalid_layout_kwargs": "invalid",
    "CONSTRUCTORS": "constructors",
    "construct": "constructors",
    "Fp8Batch": "batches",
    "ScoringBatch": "batches",
    "large_logit_fp8_batches": "batches",
    "large_logit_inputs": "batches",
    "bushy_tree_parents": "batches",
    "scoring_batch": "batches",
    "FIXED_HEADS": "sequences",
    "SEQUENCE_MODES": "sequences",
    "SEQUENCE_PAGE_SIZES": "sequences",
    "VARIED_HEADS": "sequences",
    "Batch": "sequences",
    "batch_sequence": "sequences",
    "random_batch": "sequences",
    "BatchCheck": "checking",
    "SequenceReport": "checking",
    "check_batch": "checking",
    "check_sequence": "checking",
    "BUCKET_KINDS": "graph_buckets",
    "BucketReplayer": "graph_buckets",
    "bucket_layout": "graph_buckets",
    "check_bucket_replays": "graph_buckets",
    "AttentionDiff": "compare",
    "CallRecord": "compare",
    "ComparingExecutor": "compare",
    "attention_diff": "compare",
    "out_error": "compare",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        module = importlib.import_module(f"flashplan.testing.{home}")
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
