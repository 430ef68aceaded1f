#!/usr/bin/env python3
"""Benchmark: the loss of one sequence-parallel shard, megaloss's chunked CE vs DeepSpeed's
``TiledFusedLogitsLoss`` (``deepspeed/runtime/sequence_parallel/ulysses_sp.py``, the loss of its
Arctic Long Sequence Training recipe), side by side on the same shapes.

Under Ulysses SP each rank computes the loss of its ``tokens / sp`` slice. Both losses avoid the
whole ``[tokens, vocab]`` logits: DeepSpeed cuts the slice into ``shards`` and runs
``lm_head`` + ``F.cross_entropy`` with autograd per shard (backward inside forward); megaloss runs
its chunk kernel (gradients formed in forward, one ``[chunk, V]`` working set). Each loss's
memory is measured in a fresh process: the peak above inputs, weight and their gradients
(``tools/_bench_common.py`` explains the method); time is the median fwd+bwd of interleaved
runs, in the last of those processes once its peak is read (both losses warmed up there).
Shards for DeepSpeed are chosen so its tile holds the same number of tokens as megaloss's chunk.

    python3 tools/bench_sp_loss.py                         # sequence 16384 over SP 1, 2, 4
    python3 tools/bench_sp_loss.py --seq 8192 --sp 2 --hidden 512 --vocab 16000
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_common import MemoryProbe, format_table, median, mib, run_worker, write_csv  # noqa: E402

COLUMNS = ["sp", "tokens_per_rank", "hidden", "vocab", "chunk", "megaloss_MiB", "tiled_MiB",
           "mem_ratio", "megaloss_s", "tiled_s", "time_ratio", "loss_abs_diff"]


def _worker(spec: Dict[str, Any]) -> Dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

    from megaloss.losses import linear_cross_entropy

    torch.set_num_threads(spec["threads"])
    n, hidden, vocab, chunk = spec["tokens"], spec["hidden"], spec["vocab"], spec["chunk"]
    head = torch.nn.Linear(hidden, vocab, bias=False)

    def tiled(h, y):
        def loss_fn(module, x, t):
            return F.cross_entropy(module(x).float(), t.view(-1), reduction="sum")
        shards = max(1, math.ceil(n / chunk))
        return TiledFusedLogitsLoss.apply(loss_fn, head, h, y, None, shards, [head.weight],
                                          "sum") / n

    def mega(h, y):
        return linear_cross_entropy(h, head.weight, y, chunk_size=chunk)

    fns = {"megaloss": mega, "tiled": tiled}
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, generator=gen) * 0.02)
    h = torch.randn(1, n, hidden, generator=gen).requires_grad_()
    y = torch.randint(0, vocab, (1, n), generator=gen)
    h.grad, head.weight.grad = torch.zeros_like(h), torch.zeros_like(head.weight)
    for fn in fns.values():  # warm-up at a tiny size: lazily created state joins the baseline
        fn(h[:, :8].detach().requires_grad_(), y[:, :8]).backward()
    gc.collect()
    if spec["mode"] == "memory":
        probe = MemoryProbe("cpu")
        probe.start()
        loss = fns[spec["method"]](h, y)
        loss.backward()
        memory = {"extra_bytes": probe.peak_above_baseline(), "loss": float(loss)}
        if not spec.get("then_timing"):
            return memory
        # the peak is read: this process (both losses warmed up as a timing process's are)
        # times them too, one process start-up less per SP size
        return {**memory, "times": _times(fns, h, y, spec["repeats"])}
    return {"times": _times(fns, h, y, spec["repeats"])}


def _times(fns, h, y, repeats: int) -> Dict[str, List[float]]:
    """fwd+bwd seconds of every loss, ``repeats`` interleaved rounds after a discarded one."""
    times: Dict[str, List[float]] = {m: [] for m in fns}
    for r in range(repeats + 1):
        for m in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            t0 = time.perf_counter()
            fns[m](h, y).backward()
            if r:
                times[m].append(time.perf_counter() - t0)
    return times


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=16384, help="global sequence length (default 16384)")
    p.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4], help="SP sizes (default 1 2 4)")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--chunk", type=int, default=1024, help="tokens per chunk / tile")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--csv", metavar="PATH")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(_worker(json.loads(args.worker))))
        return 0
    script = os.path.abspath(__file__)
    rows = []
    for sp in args.sp:
        base = dict(tokens=args.seq // sp, hidden=args.hidden, vocab=args.vocab, chunk=args.chunk,
                    threads=args.threads, repeats=args.repeats)
        # a fresh process per loss for its peak; the last one then times both
        mem = {m: run_worker(script, {**base, "mode": "memory", "method": m,
                                      "then_timing": m == "tiled"}, args.threads, args.timeout)
               for m in ("megaloss", "tiled")}
        tim = mem["tiled"]
        for name, res in mem.items():
            if "error" in res:
                print(f"# sp={sp} {name}: {res['error']}", file=sys.stderr)
        t = {m: median(tim.get("times", {}).get(m, [])) for m in ("megaloss", "tiled")}
        mm, mt = (mib(mem[m].get("extra_bytes", math.nan)) for m in ("megaloss", "tiled"))
        rows.append({"sp": sp, "tokens_per_rank": base["tokens"], "hidden": args.hidden,
                     "vocab": args.vocab, "chunk": args.chunk, "megaloss_MiB": mm,
                     "tiled_MiB": mt, "mem_ratio": mm / mt, "megaloss_s": t["megaloss"],
                     "tiled_s": t["tiled"], "time_ratio": t["megaloss"] / t["tiled"],
                     "loss_abs_diff": abs(mem["megaloss"].get("loss", math.nan)
                                          - mem["tiled"].get("loss", math.nan))})
        print(format_table(rows[-1:], COLUMNS), flush=True)
    print("\n" + format_table(rows, COLUMNS))
    print("ratios = megaloss / DeepSpeed TiledFusedLogitsLoss; memory = peak above inputs, "
          "weight and their gradients")
    if args.csv:
        write_csv(args.csv, rows, COLUMNS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
