#!/usr/bin/env python3
"""Benchmark: ``megaloss.linear_cross_entropy(..., vocab_parallel_options=...)`` per
tensor-parallel rank.

For each TP size, TP real processes (spawned, gloo, CPU) hold the same replicated
``hidden [N, H]`` and labels and one ``[ceil(V/TP), H]`` lm_head shard each, and run one
forward+backward. Reported per TP size:

* extra peak memory per rank (max and min over ranks): peak RSS above the memory of inputs,
  weight shard and their preallocated ``.grad`` buffers, in fresh processes (method:
  ``tools/_bench_common.py``);
* time: per-rank median of ``--repeats`` warm runs, max over ranks. The ranks share this
  machine's cores (``cpus // TP`` threads each), so time across TP sizes measures overhead,
  not speed-up;
* bytes communicated per token, counted by wrapping ``torch.distributed``'s collectives in the
  workers (payload = the tensor a rank hands to the collective: all-reduce buffer, all-gather
  input, reduce-scatter input), split into forward and backward and checked against the known
  collectives: forward = per chunk a MAX of ``[C]`` fp32 and one SUM of stacked ``[2, C]`` fp32
  (12 bytes/token, 16 with label smoothing; independent of V), backward = the SUM all-reduce of
  the replicated input's gradient ``[N, H]`` (4H bytes/token, as in Megatron). ``other_B`` is the
  per-call (not per-token) cross-rank shape check.

    python3 tools/bench_vocab_parallel.py             # N=4096, H=512, V=32000, TP in {1, 2, 4}
    python3 tools/bench_vocab_parallel.py --tp 1 2 --csv vp.csv
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_common import (  # noqa: E402
    MALLOC_ENV,
    MemoryProbe,
    budget_spent,
    format_table,
    median,
    mib,
    require_positive,
    vocab_shard,
    write_csv,
)

COLUMNS = ["tp", "tokens", "hidden", "vocab", "chunk_size", "rows_per_rank", "threads_per_rank",
           "time_s", "repeats", "extra_MiB", "extra_MiB_min", "mem_vs_tp1", "fwd_B_per_token",
           "fwd_expected", "fwd_calls", "bwd_B_per_token", "bwd_expected", "bwd_calls",
           "other_B", "comm_ok", "loss", "loss_same_on_all_ranks", "mem_method"]
TABLE_COLUMNS = ["tp", "rows_per_rank", "threads_per_rank", "time_s", "extra_MiB",
                 "mem_vs_tp1", "fwd_B_per_token", "fwd_calls", "bwd_B_per_token", "other_B",
                 "comm_ok", "loss", "loss_same_on_all_ranks"]

_COUNTED = ("all_reduce", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
            "reduce_scatter_single", "all_gather", "reduce_scatter", "broadcast",
            "all_to_all_single")


class CommCounter:
    """Counts payload bytes and calls of torch.distributed collectives, per phase label.

    Installed by replacing the functions on the ``torch.distributed`` module, where megaloss
    looks them up at call time (``dist.all_reduce(...)``), and the aliases of them that megaloss
    modules already imported bound at import time. A collective called from inside another
    counted one is not counted twice."""

    def __init__(self):
        self.phase = None  # None: not counting
        self.bytes: Dict[tuple, int] = {}
        self.calls: Dict[tuple, int] = {}
        self._depth = 0

    def install(self) -> None:
        import torch.distributed as dist
        wrapped = {}
        for name in _COUNTED:
            if hasattr(dist, name):
                original = getattr(dist, name)
                counted = self._wrap(name, original)
                setattr(dist, name, counted)
                wrapped[id(original)] = counted
        # Aliases megaloss bound at import time (e.g. ``megaloss.parallel.comm``'s all-gather):
        # the spawn harness imports megaloss before the worker function runs.
        for mod_name, mod in list(sys.modules.items()):
            if mod is None or not (mod_name == "megaloss" or mod_name.startswith("megaloss.")):
                continue
            for attr, value in list(vars(mod).items()):
                if id(value) in wrapped and callable(value):
                    setattr(mod, attr, wrapped[id(value)])

    def _wrap(self, name, fn):
        def counted(*args, **kwargs):
            if self.phase is not None and self._depth == 0:
                payload = self._payload(name, args, kwargs)
                key = (self.phase, name)
                self.bytes[key] = self.bytes.get(key, 0) + payload
                self.calls[key] = self.calls.get(key, 0) + 1
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
        return counted

    @staticmethod
    def _payload(name, args, kwargs) -> int:
        import torch
        if name in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_gather_single",
                    "reduce_scatter_single"):
            t = args[1] if len(args) > 1 else kwargs.get("input_tensor", kwargs.get("input"))
        elif name in ("all_gather", "reduce_scatter"):
            t = args[1] if len(args) > 1 else kwargs.get("tensor", kwargs.get("input_list"))
        else:
            t = args[0] if args else kwargs.get("tensor", kwargs.get("input"))
        ts = t if isinstance(t, (list, tuple)) else [t]
        return sum(x.numel() * x.element_size() for x in ts if isinstance(x, torch.Tensor))

    def total(self, phase: str, names=("all_reduce",)) -> tuple:
        b = sum(v for (p, n), v in self.bytes.items() if p == phase and n in names)
        c = sum(v for (p, n), v in self.calls.items() if p == phase and n in names)
        return b, c

    def other_bytes(self) -> int:
        return sum(v for (p, n), v in self.bytes.items() if n != "all_reduce")


def _rank_bench(rank: int, tp: int, spec: Dict[str, Any]) -> Dict[str, Any]:
    """One TP rank (run by :func:`megaloss.testing.run_distributed`, gloo already initialised)."""
    import gc

    import torch
    import torch.distributed as dist

    counter = CommCounter()
    counter.install()
    from megaloss import VocabParallelOptions, linear_cross_entropy

    group = dist.group.WORLD  # the spawned world is the TP group
    n, hidden, vocab, chunk = spec["tokens"], spec["hidden"], spec["vocab"], spec["chunk_size"]

    def loss_fn(h, w, y, v):
        return linear_cross_entropy(h, w, y, chunk_size=chunk, vocab_parallel_options=(
            VocabParallelOptions(tp_group=group, vocab_size=v)))

    # Tiny warm-up (kernels, gloo buffers) so that lazily created state is in the baseline.
    hw = torch.randn(8, hidden, requires_grad=True)
    ww = torch.randn(math.ceil(64 / tp), hidden, requires_grad=True)
    loss_fn(hw, ww, torch.randint(0, 64, (8,), generator=torch.Generator().manual_seed(1)),
            64).backward()
    del hw, ww

    shared = torch.Generator().manual_seed(spec["seed"])  # same on every rank: replicated input
    h = torch.randn(n, hidden, generator=shared).requires_grad_()
    y = torch.randint(0, vocab, (n,), generator=shared)
    # Every TP size shards the same full lm_head (padded rows 0), so the loss must not change
    # with TP; the full matrix is freed before the baseline.
    full = torch.randn(vocab, hidden, generator=shared).mul_(0.02)
    w = vocab_shard(full, tp, rank)
    del full
    w.requires_grad_()
    h.grad, w.grad = torch.zeros_like(h), torch.zeros_like(w)
    gc.collect()
    dist.barrier()

    probe = MemoryProbe("cpu")
    probe.start()
    counter.phase = "fwd"
    loss = loss_fn(h, w, y, vocab)
    counter.phase = "bwd"
    loss.backward()
    counter.phase = None
    extra = probe.peak_above_baseline()
    loss_value = float(loss.detach())
    del loss

    times: List[float] = []
    for _ in range(max(1, spec["repeats"])):
        dist.barrier()
        t0 = time.perf_counter()
        loss_fn(h, w, y, vocab).backward()
        times.append(time.perf_counter() - t0)
        if budget_spent(sum(times), spec["budget"]):
            break

    fwd_b, fwd_c = counter.total("fwd")
    bwd_b, bwd_c = counter.total("bwd")
    return {"extra_bytes": extra, "times": times, "loss": loss_value, "fwd_bytes": fwd_b,
            "fwd_calls": fwd_c, "bwd_bytes": bwd_b, "bwd_calls": bwd_c,
            "other_bytes": counter.other_bytes(), "mem_method": probe.method}


def _run_tp(tp: int, spec: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Spawn ``tp`` fresh gloo ranks (fixed malloc settings, ``spec['threads']`` threads each)."""
    from megaloss.testing import run_distributed
    # Read by glibc / OpenMP when each spawned interpreter starts: set before spawning.
    os.environ.update(MALLOC_ENV)
    os.environ["OMP_NUM_THREADS"] = str(spec["threads"])
    return run_distributed(_rank_bench, tp, spec, timeout=spec["timeout"],
                           threads_per_rank=spec["threads"])


def _row(tp: int, args, threads: int, ranks: List[Dict[str, Any]]) -> Dict[str, Any]:
    n = args.tokens
    fwd = [r["fwd_bytes"] / n for r in ranks]
    bwd = [r["bwd_bytes"] / n for r in ranks]
    fwd_expected = 0.0 if tp == 1 else 12.0  # MAX [C] + SUM [2, C], fp32, per token
    bwd_expected = 0.0 if tp == 1 else 4.0 * args.hidden
    losses = [r["loss"] for r in ranks]
    comm_ok = all(f == fwd_expected for f in fwd) and all(b == bwd_expected for b in bwd)
    return {
        "tp": tp, "tokens": n, "hidden": args.hidden, "vocab": args.vocab,
        "chunk_size": args.chunk_size, "rows_per_rank": math.ceil(args.vocab / tp),
        "threads_per_rank": threads,
        "time_s": max(median(r["times"]) for r in ranks),
        "repeats": min(len(r["times"]) for r in ranks),
        "extra_MiB": max(mib(r["extra_bytes"]) for r in ranks),
        "extra_MiB_min": min(mib(r["extra_bytes"]) for r in ranks),
        "fwd_B_per_token": max(fwd), "fwd_expected": fwd_expected,
        "fwd_calls": max(r["fwd_calls"] for r in ranks),
        "bwd_B_per_token": max(bwd), "bwd_expected": bwd_expected,
        "bwd_calls": max(r["bwd_calls"] for r in ranks),
        "other_B": max(r["other_bytes"] for r in ranks), "comm_ok": comm_ok,
        "loss": losses[0], "loss_same_on_all_ranks": len(set(losses)) == 1,
        "mem_method": ranks[0]["mem_method"],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4], help="TP sizes (default 1 2 4)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens N (default 4096)")
    p.add_argument("--hidden", type=int, default=512, help="hidden size H (default 512)")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary size V (default 32000)")
    p.add_argument("--chunk-size", type=int, default=1024, help="megaloss chunk (default 1024)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs (default 3)")
    p.add_argument("--time-budget", type=float, default=15.0,
                   help="stop repeating once the timed runs took this many seconds (default 15)")
    p.add_argument("--cpus", type=int, default=os.cpu_count() or 1,
                   help="cores shared by the ranks: each gets max(1, cpus // TP) threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per TP size")
    p.add_argument("--csv", metavar="PATH", help="write all columns as CSV")
    args = p.parse_args(argv)
    require_positive(p, args, ("tokens", "hidden", "vocab", "chunk_size", "repeats", "cpus"))
    if any(t < 1 for t in args.tp):
        p.error("--tp sizes must be >= 1")

    rows = []
    for tp in args.tp:
        threads = max(1, args.cpus // tp)
        spec = {"tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab,
                "chunk_size": args.chunk_size, "repeats": args.repeats,
                "budget": args.time_budget, "threads": threads, "seed": args.seed,
                "timeout": args.timeout}
        t0 = time.perf_counter()
        rows.append(_row(tp, args, threads, _run_tp(tp, spec)))
        print(f"# TP={tp}: ok ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    base = next((r["extra_MiB"] for r in rows if r["tp"] == 1), math.nan)
    for r in rows:
        r["mem_vs_tp1"] = r["extra_MiB"] / base if base and not math.isnan(base) else math.nan

    print(f"vocab-parallel linear + cross-entropy fwd+bwd, N={args.tokens}, H={args.hidden}, "
          f"V={args.vocab}, chunk={args.chunk_size}; extra_MiB = per-rank peak above inputs, "
          f"weight shard and their grads (max over ranks); B_per_token = collective payload "
          f"bytes per token per rank (fwd: all-reduces of LSE statistics; bwd: all-reduce of "
          f"d_hidden); other_B = bytes per step of the shape check")
    print(format_table(rows, TABLE_COLUMNS))
    if args.csv:
        write_csv(args.csv, rows, COLUMNS)
    return 0 if all(r["comm_ok"] and r["loss_same_on_all_ranks"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
