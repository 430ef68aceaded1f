#!/usr/bin/env python3
"""Benchmark: per-token log-probs + entropy, fwd+bwd: ``megaloss.linear_log_probs`` vs the
full-logits paths, side by side; and its per-rank memory under tensor parallelism.

Every method computes, on the same inputs (``hidden [N, H]``, ``weight [V, H]``, both requiring
grad, random labels, temperature 0.9), the per-token log-probabilities and entropy, and
back-propagates the loss ``sum(a * log_probs) + sum(c * entropy)`` with random per-token ``a``,
``c`` (what a policy loss hands to its primitive):

* ``full_log_softmax``: ``logits = F.linear(h, w).float() / T``, ``logits.log_softmax(-1)``
  gathered at the labels, entropy ``-(p * log p).sum(-1)``;
* ``full_selective``: TRL's ``selective_log_softmax`` formula (``trl/trainer/utils.py``:
  ``logits.gather(labels) - logsumexp(logits)``) and its ``entropy_from_logits``
  (``logsumexp(logits) - (softmax(logits) * logits).sum(-1)``), on the same full logits;
* ``megaloss``: ``linear_log_probs(..., return_entropy=True)`` (chunked, recompute in backward);
* the two schedules where both apply, a loss linear in ``log_probs`` with weights known in
  forward (no entropy): ``megaloss_lp`` (``linear_log_probs``, recompute in backward: 4 GEMMs)
  vs ``megaloss_ce_fwd`` (``linear_cross_entropy(loss_weights=a, reduction="sum")``, the
  gradient formed in forward: 3 GEMMs). Their loss is ``-sum(a * log_probs)`` (``a > 0``).

Measured as ``tools/bench_ce.py`` does (method in ``tools/_bench_common.py``): extra peak memory
above inputs, weight and their preallocated ``.grad`` in a fresh process per method and size;
time as the median of ``--repeats`` interleaved rounds (after a discarded full-size one) in
the last of those processes once its peak is read, ratios taken within a round. ``--tp`` then
runs ``megaloss`` (log-probs + entropy) vocab-parallel over TP spawned gloo ranks sharing
this machine's cores: extra peak memory per rank (max over ranks) and time.

    python3 tools/bench_log_probs.py          # N in {4096, 16384}, H=1024, V=32000, TP 1 2 4
    python3 tools/bench_log_probs.py --sizes 1024 --hidden 256 --vocab 8000 --tp 1 2 --csv lp.csv
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_common import (  # noqa: E402
    MALLOC_ENV,
    MemoryProbe,
    format_table,
    median,
    mib,
    require_positive,
    run_worker,
    vocab_shard,
    write_csv,
)

METHODS = ("full_log_softmax", "full_selective", "megaloss", "megaloss_lp", "megaloss_ce_fwd")
TEMPERATURE = 0.9
COLUMNS = ["tokens", "hidden", "vocab", "chunk_size", "threads", "method", "time_s",
           "time_vs_full", "extra_MiB", "mem_vs_full", "loss", "loss_diff_vs_full", "repeats",
           "mem_method"]
TABLE_COLUMNS = ["tokens", "method", "time_s", "time_vs_full", "extra_MiB", "mem_vs_full",
                 "loss", "loss_diff_vs_full"]
TP_COLUMNS = ["tp", "tokens", "hidden", "vocab", "rows_per_rank", "threads_per_rank", "time_s",
              "extra_MiB", "extra_MiB_min", "mem_vs_tp1", "loss", "loss_same_on_all_ranks"]


def _inputs(n: int, hidden: int, vocab: int, seed: int):
    """The inputs, a function of the seed alone: one CPU generator draws ``h [N, H]``, ``w [V, H]
    * 0.02``, ``labels [N]``, then ``a, c [N]`` uniform in [0.5, 1.5)."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=gen)
    w = torch.randn(vocab, hidden, generator=gen).mul_(0.02)
    y = torch.randint(0, vocab, (n,), generator=gen)
    a = torch.rand(n, generator=gen) + 0.5
    c = torch.rand(n, generator=gen) + 0.5
    return h, w, y, a, c


def _loss_fn(method: str, chunk: int):
    """``fn(h, w, y, a, c) -> scalar loss`` of ``method``."""
    import torch
    import torch.nn.functional as F

    from megaloss import linear_cross_entropy, linear_log_probs

    def full_logits(h, w):
        return F.linear(h, w).float() / TEMPERATURE

    if method == "full_log_softmax":
        def fn(h, w, y, a, c):
            logp = full_logits(h, w).log_softmax(-1)
            lp = logp.gather(-1, y[:, None])[:, 0]
            ent = -(logp.exp() * logp).sum(-1)
            return (a * lp).sum() + (c * ent).sum()
    elif method == "full_selective":
        def fn(h, w, y, a, c):
            logits = full_logits(h, w)
            lse = torch.logsumexp(logits, -1)
            lp = logits.gather(-1, y[:, None])[:, 0] - lse
            ent = lse - (logits.softmax(-1) * logits).sum(-1)
            return (a * lp).sum() + (c * ent).sum()
    elif method == "megaloss":
        def fn(h, w, y, a, c):
            out = linear_log_probs(h, w, y, temperature=TEMPERATURE, return_entropy=True,
                                   chunk_size=chunk)
            return (a * out.log_probs).sum() + (c * out.entropy).sum()
    elif method == "megaloss_lp":
        def fn(h, w, y, a, c):
            out = linear_log_probs(h, w, y, temperature=TEMPERATURE, chunk_size=chunk)
            return -(a * out.log_probs).sum()
    elif method == "megaloss_ce_fwd":
        def fn(h, w, y, a, c):  # CE of logits / T: the temperature folded into the hidden states
            return linear_cross_entropy(h / TEMPERATURE, w, y, loss_weights=a, reduction="sum",
                                        chunk_size=chunk)
    else:
        raise ValueError(f"unknown method {method!r}")
    return fn


def _worker(spec: Dict[str, Any]) -> Dict[str, Any]:
    """``mode="memory"``: one fwd+bwd of ``spec["method"]`` under the memory probe (with
    ``then_timing``, the timing rounds after it in the same process, the other methods warmed up
    then); ``mode="timing"``: interleaved warm rounds of every method."""
    import torch
    torch.set_num_threads(spec["threads"])
    n, hidden, vocab, chunk = spec["tokens"], spec["hidden"], spec["vocab"], spec["chunk_size"]
    methods = [spec["method"]] if spec["mode"] == "memory" else list(spec["methods"])
    fns = {m: _loss_fn(m, chunk) for m in methods}

    def warm_up(names):  # on min(N, chunk) tokens at the real H and V (thread pool, allocator)
        hw, ww, yw, aw, cw = _inputs(min(n, chunk), hidden, vocab, spec["seed"] + 1)
        hw.requires_grad_(), ww.requires_grad_()
        for m in names:
            fns[m](hw, ww, yw, aw, cw).backward()

    warm_up(methods)
    h, w, y, a, c = _inputs(n, hidden, vocab, spec["seed"])
    h.requires_grad_(), w.requires_grad_()
    h.grad, w.grad = torch.zeros_like(h), torch.zeros_like(w)
    gc.collect()

    if spec["mode"] == "memory":
        probe = MemoryProbe("cpu")
        probe.start()
        loss = fns[spec["method"]](h, w, y, a, c)
        loss.backward()
        memory = {"extra_bytes": probe.peak_above_baseline(), "loss": float(loss.detach()),
                  "mem_method": probe.method}
        if not spec.get("then_timing"):
            return memory
        # the peak is read: this process times every method too (one start-up less a size)
        others = [m for m in spec["methods"] if m not in fns]
        fns.update({m: _loss_fn(m, chunk) for m in others})
        warm_up(others)
        methods = list(spec["methods"])
        return {**memory, "times": _times(fns, methods, (h, w, y, a, c), spec)}
    return {"times": _times(fns, methods, (h, w, y, a, c), spec)}


def _times(fns, methods: List[str], inputs, spec: Dict[str, Any]) -> Dict[str, List[float]]:
    """Seconds of fwd+bwd per method: interleaved rounds (order rotated), round 0 discarded."""
    times: Dict[str, List[float]] = {m: [] for m in methods}
    spent = 0.0
    for r in range(spec["repeats"] + 1):  # round 0: full-size warm-up
        k = r % len(methods)
        for m in methods[k:] + methods[:k]:
            t0 = time.perf_counter()
            fns[m](*inputs).backward()
            dt = time.perf_counter() - t0
            if r > 0:
                times[m].append(dt)
                spent += dt
        if r > 0 and spent >= spec["budget"]:
            break
    return times


def _tp_rank(rank: int, tp: int, spec: Dict[str, Any]) -> Dict[str, Any]:
    """One TP rank (run by :func:`megaloss.testing.run_distributed`, gloo initialised)."""
    import torch
    import torch.distributed as dist

    from megaloss import VocabParallelOptions, linear_log_probs

    n, hidden, vocab, chunk = spec["tokens"], spec["hidden"], spec["vocab"], spec["chunk_size"]

    def step(h, w, y, a, c, v):
        out = linear_log_probs(h, w, y, temperature=TEMPERATURE, return_entropy=True,
                               chunk_size=chunk,
                               vocab_parallel_options=VocabParallelOptions(vocab_size=v))
        loss = (a * out.log_probs).sum() + (c * out.entropy).sum()
        loss.backward()
        return loss

    hw = torch.randn(8, hidden, requires_grad=True)
    ww = torch.randn(math.ceil(64 / tp), hidden, requires_grad=True)
    step(hw, ww, torch.zeros(8, dtype=torch.long), torch.ones(8), torch.ones(8), 64)
    del hw, ww
    h, full, y, a, c = _inputs(n, hidden, vocab, spec["seed"])  # replicated over TP
    w = vocab_shard(full, tp, rank)
    del full
    h.requires_grad_(), w.requires_grad_()
    h.grad, w.grad = torch.zeros_like(h), torch.zeros_like(w)
    gc.collect()
    dist.barrier()
    probe = MemoryProbe("cpu")
    probe.start()
    loss = float(step(h, w, y, a, c, vocab).detach())
    extra = probe.peak_above_baseline()
    times = []
    for _ in range(spec["repeats"]):
        dist.barrier()
        t0 = time.perf_counter()
        step(h, w, y, a, c, vocab)
        times.append(time.perf_counter() - t0)
    return {"extra_bytes": extra, "times": times, "loss": loss}


def _single_device_rows(args, n: int) -> List[Dict[str, Any]]:
    script = os.path.abspath(__file__)
    base = {"tokens": n, "hidden": args.hidden, "vocab": args.vocab,
            "chunk_size": args.chunk_size, "threads": args.threads, "seed": args.seed,
            "repeats": args.repeats, "budget": args.time_budget, "methods": args.methods}
    # a fresh process per method for its peak; the last of them then times every method
    memory = {m: run_worker(script, {**base, "mode": "memory", "method": m,
                                     "then_timing": m == args.methods[-1]}, args.threads,
                            args.timeout) for m in args.methods}
    timing = memory[args.methods[-1]]
    times = timing.get("times", {})
    full_mem = memory.get("full_log_softmax", {}).get("extra_bytes", math.nan)
    full_loss = memory.get("full_log_softmax", {}).get("loss", math.nan)
    rows = []
    for m in args.methods:
        mem = memory[m]
        pairs = zip(times.get(m, []), times.get("full_log_softmax", []))
        extra = mem.get("extra_bytes", math.nan)
        ref_loss = (full_loss if m in ("full_selective", "megaloss")
                    else memory.get("megaloss_lp", {}).get("loss", math.nan))
        rows.append({
            "tokens": n, "hidden": args.hidden, "vocab": args.vocab,
            "chunk_size": args.chunk_size, "threads": args.threads, "method": m,
            "time_s": median(times.get(m, [])),
            "time_vs_full": median([x / f for x, f in pairs if f > 0]),
            "extra_MiB": mib(extra), "mem_vs_full": extra / full_mem if full_mem else math.nan,
            "loss": mem.get("loss", math.nan),
            # full paths and megaloss against full_log_softmax; megaloss_ce_fwd against
            # megaloss_lp (the same loss, the other schedule)
            "loss_diff_vs_full": abs(mem.get("loss", math.nan) - ref_loss)
            if m != "full_log_softmax" and m != "megaloss_lp" else 0.0,
            "repeats": len(times.get(m, [])), "mem_method": mem.get("mem_method", ""),
            "error": mem.get("error") or timing.get("error", ""),
        })
    return rows


def _tp_rows(args, n: int) -> List[Dict[str, Any]]:
    from megaloss.testing import run_distributed
    os.environ.update(MALLOC_ENV)
    rows = []
    for tp in args.tp:
        threads = max(1, args.cpus // tp)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        spec = {"tokens": n, "hidden": args.hidden, "vocab": args.vocab,
                "chunk_size": args.chunk_size, "seed": args.seed, "repeats": args.repeats}
        ranks = run_distributed(_tp_rank, tp, spec, timeout=args.timeout,
                                threads_per_rank=threads)
        losses = [r["loss"] for r in ranks]
        rows.append({"tp": tp, "tokens": n, "hidden": args.hidden, "vocab": args.vocab,
                     "rows_per_rank": math.ceil(args.vocab / tp), "threads_per_rank": threads,
                     "time_s": max(median(r["times"]) for r in ranks),
                     "extra_MiB": max(mib(r["extra_bytes"]) for r in ranks),
                     "extra_MiB_min": min(mib(r["extra_bytes"]) for r in ranks),
                     "loss": losses[0],
                     "loss_same_on_all_ranks": max(losses) - min(losses) <= 1e-6 * abs(
                         losses[0])})
    base = next((r["extra_MiB"] for r in rows if r["tp"] == 1), math.nan)
    for r in rows:
        r["mem_vs_tp1"] = r["extra_MiB"] / base if base and not math.isnan(base) else math.nan
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[4096, 16384],
                   help="token counts N (default 4096 16384)")
    p.add_argument("--hidden", type=int, default=1024, help="hidden size H (default 1024)")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary V (default 32000)")
    p.add_argument("--chunk-size", type=int, default=1024, help="megaloss chunk (default 1024)")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS),
                   help="methods of the side-by-side table (default: all)")
    p.add_argument("--tp", type=int, nargs="*", default=[1, 2, 4],
                   help="TP sizes for the per-rank table, at the largest N (default 1 2 4; "
                        "none: skip)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds (default 3)")
    p.add_argument("--time-budget", type=float, default=60.0,
                   help="stop repeating once the timed runs took this many seconds (default 60)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="torch threads of the single-device processes")
    p.add_argument("--cpus", type=int, default=os.cpu_count() or 1,
                   help="cores shared by the TP ranks: each gets max(1, cpus // TP) threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per process")
    p.add_argument("--csv", metavar="PATH", help="write the side-by-side table as CSV")
    p.add_argument("--tp-csv", metavar="PATH", help="write the TP table as CSV")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        import json
        print(json.dumps(_worker(json.loads(args.worker))))
        return 0
    require_positive(p, args, ("hidden", "vocab", "chunk_size", "repeats", "threads", "cpus"))
    if any(s < 1 for s in args.sizes) or any(t < 1 for t in args.tp):
        p.error("--sizes and --tp must be >= 1")

    rows = []
    for n in args.sizes:
        t0 = time.perf_counter()
        rows += _single_device_rows(args, n)
        print(f"# N={n}: done ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    print(f"log-probs + entropy fwd+bwd, CPU fp32, H={args.hidden}, V={args.vocab}, "
          f"chunk={args.chunk_size}, T={TEMPERATURE}; extra_MiB = peak above inputs, weight and "
          f"their grads; *_vs_full = against full_log_softmax (time: median of per-round "
          f"ratios); megaloss_lp / megaloss_ce_fwd: -sum(a log_probs), recompute in backward "
          f"vs gradient in forward (loss_diff of the latter vs the former)")
    print(format_table(rows, TABLE_COLUMNS))
    errors = [f"{r['tokens']} {r['method']}: {r['error']}" for r in rows if r.get("error")]
    if args.csv:
        write_csv(args.csv, rows, COLUMNS)
    tp_rows = _tp_rows(args, max(args.sizes)) if args.tp else []
    if tp_rows:
        print(f"\nvocab-parallel linear_log_probs + entropy fwd+bwd per TP rank, "
              f"N={max(args.sizes)} (replicated), V={args.vocab}: extra_MiB = per-rank peak "
              f"above inputs, weight shard and grads (max over ranks); the ranks share "
              f"{args.cpus} cores")
        print(format_table(tp_rows, TP_COLUMNS))
        if args.tp_csv:
            write_csv(args.tp_csv, tp_rows, TP_COLUMNS)
    for e in errors:
        print(f"error: {e}", file=sys.stderr)
    ok = not errors and all(r["loss_same_on_all_ranks"] for r in tp_rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
