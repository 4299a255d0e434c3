#!/usr/bin/env python3
"""Ways to run one cascade decode on FlashInfer's kernels, timed side by side (issue 28).

The batches of ``bench_cascade.py`` that miss their targets: 64 requests x (8192 shared
+ 256 own) in one group, and 256 requests in groups of 8 x (2048 shared + 128 own);
decode, page 16, bf16, 32 query / 8 KV heads x 128, raw FlashInfer wrappers (no
flashplan executor), so the figures say what the kernels allow:

* ``plain``: one decode call over every request's whole row (the shared pages on the
  same page ids), CUDA-core and tensor-core decode;
* ``sequential``: the shared level as one FA2 paged prefill call (each group's queries
  over its shared pages, not causal), the own parts as one decode call, one LSE merge:
  what flashplan's cascade plan runs today;
* ``split N``: the same with the level call's KV split in chunks of N pages
  (``fixed_split_size``), to fill the GPU's SMs in fewer partial waves;
* ``own on tensor cores``: the own call as a tensor-core decode;
* ``two streams``: the level call and the own call on two streams forked from the
  current one (both only read the cache), joined before the merge;
* ``one call``: the level rows and the own rows as the requests of one FA2 paged
  prefill call (``q`` given twice), then the merge;
* each of these also replayed from a CUDA graph (launch gaps removed).

Kernel time: ``triton.testing.do_bench`` (CUDA events, L2 flushed before each call,
median); every variant's output is compared with the plain call's.

    python3 benchmarks/cascade_kernel_options.py [--md OUT.md]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import flashinfer
import torch
from triton.testing import do_bench

PAGE, HQ, HKV, D = 16, 32, 8, 128
DEV = "cuda"
WS = 256 << 20


def ms(fn: Callable[[], object]) -> float:
    return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))


def graphed(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` captured once in a CUDA graph; the returned callable replays it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def i32(values: list[int] | torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.int32, device=DEV)


class Case:
    """One batch: ``groups`` groups of ``members`` requests, ``shared`` tokens shared per
    group (whole pages), ``own`` tokens of each request's own (whole pages)."""

    def __init__(self, groups: int, members: int, shared: int, own: int) -> None:
        self.groups, self.members, self.shared, self.own = groups, members, shared, own
        self.bs = groups * members
        sp, op = shared // PAGE, own // PAGE
        self.sp, self.op = sp, op
        pool = groups * sp + self.bs * op
        gen = torch.Generator(device=DEV).manual_seed(0)
        self.cache = torch.randn(pool, 2, PAGE, HKV, D, generator=gen, device=DEV).to(
            torch.bfloat16
        )
        self.q = torch.randn(self.bs, HQ, D, generator=gen, device=DEV).to(torch.bfloat16)
        shared_ids = torch.arange(groups * sp, dtype=torch.int32, device=DEV).view(groups, sp)
        own_ids = (groups * sp + torch.arange(self.bs * op, dtype=torch.int32, device=DEV)).view(
            self.bs, op
        )
        group_of = torch.arange(self.bs, device=DEV) // members
        self.rows = torch.cat([shared_ids[group_of], own_ids], dim=1)  # [bs, sp + op]
        self.shared_ids, self.own_ids = shared_ids, own_ids

    def ws(self) -> torch.Tensor:
        return torch.empty(WS, dtype=torch.uint8, device=DEV)

    def decode(self, rows: torch.Tensor, tensor_cores: bool, **kw: object) -> Callable:
        bs, n = rows.shape
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.ws(), "NHD", use_tensor_cores=tensor_cores
        )
        w.plan(
            i32(list(range(0, bs * n + 1, n))),
            rows.reshape(-1).contiguous(),
            i32([PAGE] * bs),
            HQ,
            HKV,
            D,
            PAGE,
            q_data_type=torch.bfloat16,
            kv_data_type=torch.bfloat16,
            **kw,
        )
        return lambda q: w.run(q, self.cache, return_lse=True)

    def prefill(self, qo: list[int], kv: list[int], ids: torch.Tensor, **kw: object) -> Any:
        """An FA2 paged prefill wrapper planned over ``qo`` / ``kv`` (page) indptrs and
        page ``ids``, every page full, no causal mask."""
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.ws(), "NHD", backend="fa2")
        w.plan(
            i32(qo),
            i32(kv),
            ids.contiguous(),
            i32([PAGE] * (len(qo) - 1)),
            HQ,
            HKV,
            D,
            PAGE,
            causal=False,
            q_data_type=torch.bfloat16,
            kv_data_type=torch.bfloat16,
            **kw,
        )
        return w

    def level(self, **kw: object) -> Callable:
        """Each group's members' queries over the group's shared pages (not causal)."""
        g, m, sp = self.groups, self.members, self.sp
        qo, kv = list(range(0, g * m + 1, m)), list(range(0, g * sp + 1, sp))
        w = self.prefill(qo, kv, self.shared_ids.reshape(-1), **kw)
        return lambda q: w.run(q, self.cache, return_lse=True)

    def one_call(self) -> Callable:
        """Level rows (group by group) then own rows (one per request), one prefill."""
        g, m, sp, op, bs = self.groups, self.members, self.sp, self.op, self.bs
        qo = list(range(0, g * m + 1, m)) + [g * m + i for i in range(1, bs + 1)]
        kv = list(range(0, g * sp + 1, sp)) + [g * sp + op * i for i in range(1, bs + 1)]
        w = self.prefill(qo, kv, torch.cat([self.shared_ids.reshape(-1), self.own_ids.reshape(-1)]))
        q2 = torch.empty(2 * bs, HQ, D, dtype=torch.bfloat16, device=DEV)

        def run(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            q2[:bs].copy_(q)
            q2[bs:].copy_(q)
            o, s = w.run(q2, self.cache, return_lse=True)
            return flashinfer.merge_state(o[:bs], s[:bs], o[bs:], s[bs:])

        return run


def cascade(level: Callable, own: Callable) -> Callable:
    def run(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ol, sl = level(q)
        oo, so = own(q)
        return flashinfer.merge_state(ol, sl, oo, so)

    return run


def two_streams(level: Callable, own: Callable) -> Callable:
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def run(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cur = torch.cuda.current_stream()
        s1.wait_stream(cur)
        s2.wait_stream(cur)
        with torch.cuda.stream(s1):
            ol, sl = level(q)
        with torch.cuda.stream(s2):
            oo, so = own(q)
        cur.wait_stream(s1)
        cur.wait_stream(s2)
        for t in (ol, sl, oo, so):
            t.record_stream(cur)
        return flashinfer.merge_state(ol, sl, oo, so)

    return run


def measure(name: str, case: Case) -> list[str]:
    q = case.q
    plain_cc = case.decode(case.rows, False)
    plain_tc = case.decode(case.rows, True)
    want = plain_cc(q)[0].float()
    own_cc = case.decode(case.own_ids, False)
    own_tc = case.decode(case.own_ids, True)
    variants: dict[str, Callable] = {
        "plain (CUDA-core decode)": plain_cc,
        "plain (tensor-core decode)": plain_tc,
        "level call alone": case.level(),
        "own call alone (CUDA cores)": own_cc,
        "own call alone (tensor cores)": own_tc,
        "sequential": cascade(case.level(), own_cc),
        "sequential, own on tensor cores": cascade(case.level(), own_tc),
    }
    for split in (8, 16, 32, 64):
        if split < case.sp:
            variants[f"level alone, split {split} pages"] = case.level(fixed_split_size=split)
            variants[f"sequential, split {split} pages"] = cascade(
                case.level(fixed_split_size=split), own_cc
            )
    variants["two streams"] = two_streams(case.level(), own_cc)
    variants["two streams, own on tensor cores"] = two_streams(case.level(), own_tc)
    variants["one call"] = case.one_call()
    lines = [f"### {name}", "", "| variant | eager ms | graph ms | max rel diff vs plain |"]
    lines.append("|---|---|---|---|")
    scale = want.abs().max()
    for label, fn in variants.items():
        try:
            eager = ms(lambda fn=fn: fn(q))
            try:
                graph = f"{ms(graphed(lambda fn=fn: fn(q))):.4f}"
            except Exception as exc:
                graph = f"({type(exc).__name__})"
            out = fn(q)[0].float()
            alone = out.shape != want.shape or "alone" in label
            diff = "—" if alone else f"{float((out - want).abs().max() / scale):.1e}"
            lines.append(f"| {label} | {eager:.4f} | {graph} | {diff} |")
        except Exception as exc:
            lines.append(f"| {label} | failed: {type(exc).__name__}: {str(exc)[:120]} | | |")
        print(lines[-1], flush=True)
    lines.append("")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--md", type=Path)
    args = ap.parse_args()
    lines = [f"Device: {torch.cuda.get_device_name()}", ""]
    cases = {
        "one prompt: 64 x (8192 + 256)": Case(1, 64, 8192, 256),
        "groups of 8: 256 x (2048 + 128)": Case(32, 8, 2048, 128),
    }
    for name, case in cases.items():
        lines += measure(name, case)
    if args.md:
        args.md.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
