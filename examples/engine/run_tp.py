"""Run the example engine with tensor parallelism and check it against one process.

On the CPU, two processes over gloo with the reference executor (from the repository
root)::

  python examples/engine/run_tp.py --model llama --world-size 2

Every rank loads the same random weights, keeps its share of the heads and MLP columns
(``tensor_parallel.shard_decoder_only``), plans the same layouts with its share of the
heads and runs the same step loop; rank 0 also runs the unsharded engine in-process and
compares every logits row and every sampled token.

On GPUs, one per rank over NCCL, with the FlashInfer executor and the model in bf16
(``--cuda-graphs``: decode steps replayed from graph buckets of 2 and 4 on every rank;
the row-parallel all-reduces are captured into the graphs)::

  torchrun --nproc-per-node 2 examples/engine/run_tp.py --model llama --device cuda
  python examples/engine/run_tp.py --model llama --device cuda --world-size 2  # spawns

Rank 0 compares with the unsharded model on its own GPU: logits within bf16 tolerance
(:data:`BF16_REL_TOL` of the largest logit) and the generated tokens equal.
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
from examples.engine.run import make_executor, make_requests
from examples.engine.tensor_parallel import shard_decoder_only

__all__ = ["BF16_REL_TOL", "run_steps", "tp_worker"]

#: A CUDA run's tolerance: max |logit diff| over max |logit| between the sharded and the
#: unsharded bf16 model (the all-reduce sums in another order than one matmul).
BF16_REL_TOL = 0.05


def run_steps(  # type: ignore[no-untyped-def]
    adapter: DecoderOnly,
    requests: int,
    max_new_tokens: int,
    seed: int,
    *,
    executor: fp.Executor | None = None,
    cuda_graphs: tuple[int, ...] = (),
):
    """Every step of the engine over ``requests`` requests (each new token's logits kept),
    and each request's generated tokens (the reference executor unless ``executor``)."""
    engine = Engine(
        adapter, executor or fp.ReferenceExecutor(), page_size=16, num_pages=24,
        max_running=3, token_budget=16, keep_all_logits=True, cuda_graphs=cuda_graphs,
    )  # fmt: skip
    reqs = make_requests(adapter.model.config.vocab_size, False, requests, max_new_tokens, seed)
    steps: list[StepOutput] = list(engine.run(reqs))
    return steps, [r.output for r in reqs]


def tp_worker(
    rank: int,
    world: int,
    init_file: str | None,
    model_name: str,
    out: str,
    reduce: bool = True,
    device: str = "cpu",
    cuda_graphs: bool = False,
) -> None:
    """One rank: shard the model, run the step loop; rank 0 compares with one process and
    writes ``(max |logit diff|, tokens equal, rows, heads per rank, max |logit|)`` to
    ``out`` (``reduce=False``: the negative control of ``shard_decoder_only``).

    ``device="cpu"``: gloo and the reference executor in fp32; ``"cuda"``: NCCL, GPU
    ``rank``, the FlashInfer executor in bf16 (``cuda_graphs``: decode buckets of 2 and
    4). ``init_file=None``: the rendezvous comes from torchrun's environment."""
    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    init = "env://" if init_file is None else f"file://{init_file}"
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init, rank=rank,
                            world_size=world)  # fmt: skip
    try:
        torch.set_num_threads(1)
        dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
        dtype = torch.bfloat16 if cuda else torch.float32
        graphs = (2, 4) if cuda_graphs else ()

        def executor() -> fp.Executor | None:
            return make_executor(dev) if cuda else None

        model = load_model(model_name, seed=0, dtype=dtype, device=dev)
        adapter = shard_decoder_only(adapter_for(model), rank, world, reduce=reduce)
        steps, tokens = run_steps(adapter, 6, 6, 0, executor=executor(), cuda_graphs=graphs)
        if rank == 0:
            whole = adapter_for(load_model(model_name, seed=0, dtype=dtype, device=dev))
            want_steps, want_tokens = run_steps(
                whole, 6, 6, 0, executor=executor(), cuda_graphs=graphs
            )
            diff = max(
                float((a.logits.float() - b.logits.float()).abs().max())
                for a, b in zip(steps, want_steps, strict=True)
            )
            top = max(float(b.logits.float().abs().max()) for b in want_steps)
            rows = sum(s.logits.shape[0] for s in steps)
            result = (diff, tokens == want_tokens, rows, adapter.heads.num_qo_heads, top)
            torch.save(result, out)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="llama")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--cuda-graphs", action="store_true")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    with tempfile.TemporaryDirectory() as tmp:
        out = os.environ.get("FLASHPLAN_TP_OUT", os.path.join(tmp, "result.pt"))
        extra = (True, args.device, args.cuda_graphs)
        if "RANK" in os.environ:  # under torchrun: this process is one rank
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            tp_worker(rank, world, None, args.model, out, *extra)
            if rank != 0:
                return 0
        else:
            init = os.path.join(tmp, "rendezvous")
            mp.spawn(tp_worker, args=(args.world_size, init, args.model, out, *extra),
                     nprocs=args.world_size)  # fmt: skip
            world = args.world_size
        diff, same, rows, heads, top = torch.load(out)
    print(f"{world} ranks ({heads} query heads each) vs 1 process on {args.device}: max |logit "
          f"diff| {diff:.2e} ({diff / top:.2%} of max |logit|) over {rows} rows; generated "
          f"tokens equal: {same}")  # fmt: skip
    ok = same and (diff <= BF16_REL_TOL * top if cuda else diff <= 1e-4)
    tol = f"{BF16_REL_TOL:.0%} of max |logit|, bf16" if cuda else "1e-4, fp32"
    print(f"tensor-parallel parity {'OK' if ok else 'FAILED'} (tolerance {tol})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
