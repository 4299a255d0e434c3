"""Run the example engine with tensor parallelism and check it against one process.

On the CPU, two processes over gloo with the reference executor (from the repository
root)::

  python examples/engine/run_tp.py --model llama --world-size 2

Every rank loads the same random weights, keeps its share of the heads and MLP columns
(``tensor_parallel.shard_decoder_only``), plans the same layouts with its share of the
heads and runs the same step loop; rank 0 also runs the unsharded engine in-process and
compares every logits row and every sampled token. (A CUDA run over NCCL, one GPU per
rank, is the same worker with ``--device cuda``; it needs a machine with as many GPUs.)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

if __package__ in (None, ""):  # run as a script: make `examples.engine` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import flashplan as fp
from examples.engine.engine import Engine, StepOutput
from examples.engine.hf_models import DecoderOnly, adapter_for, load_model
from examples.engine.run import make_requests
from examples.engine.tensor_parallel import shard_decoder_only

__all__ = ["run_steps", "tp_worker"]


def run_steps(adapter: DecoderOnly, requests: int, max_new_tokens: int, seed: int):  # type: ignore[no-untyped-def]
    """Every step of the engine over ``requests`` requests (each new token's logits kept),
    and each request's generated tokens."""
    engine = Engine(
        adapter, fp.ReferenceExecutor(), page_size=16, num_pages=24, max_running=3,
        token_budget=16, keep_all_logits=True,
    )  # fmt: skip
    reqs = make_requests(adapter.model.config.vocab_size, False, requests, max_new_tokens, seed)
    for r in reqs:
        engine.add(r)
    steps: list[StepOutput] = []
    while engine.has_work():
        out = engine.step()
        assert out is not None
        steps.append(out)
    return steps, [r.output for r in reqs]


def tp_worker(
    rank: int, world: int, init_file: str, model_name: str, out: str, reduce: bool = True
) -> None:
    """One rank: shard the model, run the step loop; rank 0 compares with one process and
    writes ``(max |logit diff|, tokens equal, rows, heads per rank)`` to ``out``
    (``reduce=False``: the negative control of ``shard_decoder_only``)."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)  # fmt: skip
    try:
        torch.set_num_threads(1)
        model = load_model(model_name, seed=0)
        adapter = shard_decoder_only(adapter_for(model), rank, world, reduce=reduce)
        steps, tokens = run_steps(adapter, 6, 6, 0)
        if rank == 0:
            whole = adapter_for(load_model(model_name, seed=0))
            want_steps, want_tokens = run_steps(whole, 6, 6, 0)
            diff = max(
                float((a.logits - b.logits).abs().max())
                for a, b in zip(steps, want_steps, strict=True)
            )
            rows = sum(s.logits.shape[0] for s in steps)
            torch.save((diff, tokens == want_tokens, rows, adapter.heads.num_qo_heads), out)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="llama")
    p.add_argument("--world-size", type=int, default=2)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        init, out = os.path.join(tmp, "rendezvous"), os.path.join(tmp, "result.pt")
        mp.spawn(tp_worker, args=(args.world_size, init, args.model, out), nprocs=args.world_size)
        diff, same, rows, heads = torch.load(out)
    print(f"{args.world_size} ranks ({heads} query heads each) vs 1 process: max |logit diff| "
          f"{diff:.2e} over {rows} rows; generated tokens equal: {same}")  # fmt: skip
    ok = same and diff <= 1e-4
    print(f"tensor-parallel parity {'OK' if ok else 'FAILED'} (tolerance 1e-4, fp32)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
