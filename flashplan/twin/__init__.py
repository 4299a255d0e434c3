"""A CPU twin of FlashInfer's wrapper API: the decode, paged and ragged prefill wrappers
(and their CUDA-graph and attention-sink variants), ``fast_decode_plan``,
``merge_state`` and XQA's decode (``xqa``), computing in torch the attention FlashInfer documents.

Pass :data:`flashinfer_twin` as ``FlashInferExecutor(flashinfer=...)`` to run the whole
FlashInfer executor (translation, staging, gathers, masks, ``plan()``/``run()``, graph
buckets replayed eagerly) on any device, the CPU included: CI runs the executor this way,
and a GPU test compares the twin with real FlashInfer on the same inputs.
"""

from flashplan.twin.wrappers import flashinfer_twin

__all__ = ["flashinfer_twin"]
