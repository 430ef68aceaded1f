#!/usr/bin/env python3
"""Benchmark: the multi-token prediction (MTP) loss fwd+bwd, megaloss's chunked
``multi_token_prediction_loss`` vs Megatron-style materialised logits per depth, side by side.

Both compute, on the same inputs (main hidden states and ``D`` depths' ``h [N, H]``, the shared
``weight [V, H]``, all requiring grad; labels of samples packed ``--sample-len`` tokens apart,
``position_ids`` restarting at 0), DeepSeek-V3's ``CE_0 + 0.1 / D * sum_k CE_k`` (each a token
mean over its own rolled targets), and back-propagate it:

* ``materialised``: Megatron-LM's ``process_mtp_loss`` (``megatron/core/transformer/
  multi_token_prediction.py``) per depth: ``logits = h @ W.T`` then ``F.cross_entropy``, the
  labels rolled inside each sample (here with megaloss's ``mtp_labels``; Megatron's
  ``roll_tensor`` rolls the same way); every depth's ``[N, V]`` logits live until backward;
* ``megaloss``: :func:`megaloss.losses.multi_token.multi_token_prediction_loss`, every depth
  through the chunked linear CE (gradient formed in forward: a ``[V, H]`` weight-gradient
  buffer per depth, no logits beyond one chunk).

Measured as ``tools/bench_ce.py`` does (``tools/_bench_common.py``): extra peak memory above
inputs, weight and their preallocated ``.grad`` in a fresh process per method, time as the
median of ``--repeats`` interleaved rounds (after a discarded full-size one) in the last of those
processes once its peak is read, ratios taken within a round. ``--same-process`` runs both
methods in this process (for the test: no interpreter start-up; the second method's peak is
then read after the first ran).

    python3 tools/bench_mtp.py                 # N 1024, H 256, V 32000, D 2: ~30 s on 2 idle cores
    python3 tools/bench_mtp.py --tokens 4096 --hidden 1024 --depths 1 3 --csv mtp.csv
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
    MemoryProbe,
    add_process_arguments,
    answer_worker,
    finish,
    format_table,
    median,
    mib,
    require_positive,
    run_in_this_process,
    run_worker,
)

METHODS = ("materialised", "megaloss")
SCALING = 0.1  # Megatron-core's default mtp_loss_scaling_factor
IGNORE = -100
COLUMNS = ["tokens", "hidden", "vocab", "depth", "chunk_size", "threads", "method", "time_s",
           "time_vs_materialised", "extra_MiB", "mem_vs_materialised", "logits_MiB", "loss",
           "loss_diff", "repeats", "mem_method"]
TABLE_COLUMNS = ["depth", "method", "time_s", "time_vs_materialised", "extra_MiB",
                 "mem_vs_materialised", "logits_MiB", "loss", "loss_diff"]


def _inputs(n: int, hidden: int, vocab: int, depth: int, sample_len: int, seed: int):
    """The inputs, a function of the arguments alone: one CPU generator draws the ``D + 1``
    hidden states ``[N, H]``, then ``weight [V, H] * 0.02``, then ``labels [N]``; the last
    position of every ``sample_len``-token sample is ``-100`` (Hugging Face's shifted labels of
    packed samples), and ``position_ids = arange(N) % sample_len``."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    hs = [torch.randn(n, hidden, generator=gen) for _ in range(depth + 1)]
    w = torch.randn(vocab, hidden, generator=gen).mul_(0.02)
    y = torch.randint(0, vocab, (n,), generator=gen)
    pos = torch.arange(n) % sample_len
    y[(pos == sample_len - 1) | (torch.arange(n) == n - 1)] = IGNORE
    return hs, w, y, pos


def _loss_fn(method: str, chunk: int):
    """``fn(hs, w, y, pos) -> scalar loss`` of ``method``."""
    import torch
    import torch.nn.functional as F

    from megaloss.losses.multi_token import mtp_labels, multi_token_prediction_loss
    from megaloss.ops.cross_entropy_options import CrossEntropyOptions

    if method == "materialised":
        def fn(hs, w, y, pos):
            d = len(hs) - 1
            terms = []
            for k, h in enumerate(hs):
                target = y if k == 0 else mtp_labels(y, k, position_ids=pos)
                logits = F.linear(h, w)
                terms.append(F.cross_entropy(logits.float(), target, ignore_index=IGNORE))
            return terms[0] + SCALING / d * torch.stack(terms[1:]).sum()
    elif method == "megaloss":
        options = CrossEntropyOptions(chunk_size=chunk)

        def fn(hs, w, y, pos):
            return multi_token_prediction_loss(hs[0], w, y, hs[1:], scaling_factor=SCALING,
                                               position_ids=pos, options=options).loss
    else:
        raise ValueError(f"unknown method {method!r}")
    return fn


def _times(fns, methods: List[str], inputs, spec: Dict[str, Any]) -> Dict[str, List[float]]:
    """Seconds of fwd+bwd per method: interleaved rounds (order rotated), round 0 discarded."""
    times: Dict[str, List[float]] = {m: [] for m in methods}
    spent = 0.0
    for r in range(spec["repeats"] + 1):
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


def _worker(spec: Dict[str, Any]) -> Dict[str, Any]:
    """One fwd+bwd of ``spec["method"]`` under the memory probe; with ``then_timing`` the timing
    rounds of every method after it, in the same process."""
    import torch
    torch.set_num_threads(spec["threads"])
    n, hidden, vocab, depth = spec["tokens"], spec["hidden"], spec["vocab"], spec["depth"]
    chunk, sample_len = spec["chunk_size"], spec["sample_len"]
    fns = {m: _loss_fn(m, chunk) for m in spec["methods"]}

    def warm_up(names):  # a few tokens at the real H and V (thread pool, allocator)
        hw, ww, yw, pw = _inputs(min(n, chunk), hidden, vocab, depth, sample_len,
                                 spec["seed"] + 1)
        for t in hw + [ww]:
            t.requires_grad_()
        for m in names:
            fns[m](hw, ww, yw, pw).backward()

    warm_up([spec["method"]])
    hs, w, y, pos = _inputs(n, hidden, vocab, depth, sample_len, spec["seed"])
    for t in hs + [w]:
        t.requires_grad_()
        t.grad = torch.zeros_like(t)
    gc.collect()
    probe = MemoryProbe("cpu")
    probe.start()
    loss = fns[spec["method"]](hs, w, y, pos)
    loss.backward()
    out = {"extra_bytes": probe.peak_above_baseline(), "loss": float(loss.detach()),
           "mem_method": probe.method}
    del loss
    if spec.get("then_timing"):
        warm_up([m for m in spec["methods"] if m != spec["method"]])
        out["times"] = _times(fns, list(spec["methods"]), (hs, w, y, pos), spec)
    return out


def _rows(args, depth: int) -> List[Dict[str, Any]]:
    script = os.path.abspath(__file__)
    base = {"tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab, "depth": depth,
            "chunk_size": args.chunk_size, "sample_len": args.sample_len,
            "threads": args.threads, "seed": args.seed, "repeats": args.repeats,
            "budget": args.time_budget, "methods": list(METHODS)}
    results = {}
    for m in METHODS:
        spec = {**base, "method": m, "then_timing": m == METHODS[-1]}
        results[m] = (run_in_this_process(_worker, spec) if args.same_process
                      else run_worker(script, spec, args.threads, args.timeout))
    times = results[METHODS[-1]].get("times", {})
    ref = results["materialised"]
    logits_mib = mib((depth + 1) * args.tokens * args.vocab * 4)
    rows = []
    for m in METHODS:
        r = results[m]
        extra = r.get("extra_bytes", math.nan)
        pairs = zip(times.get(m, []), times.get("materialised", []))
        rows.append({
            "tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab, "depth": depth,
            "chunk_size": args.chunk_size, "threads": args.threads, "method": m,
            "time_s": median(times.get(m, [])),
            "time_vs_materialised": median([x / f for x, f in pairs if f > 0]),
            "extra_MiB": mib(extra),
            "mem_vs_materialised": extra / ref.get("extra_bytes", math.nan)
            if ref.get("extra_bytes") else math.nan,
            "logits_MiB": logits_mib, "loss": r.get("loss", math.nan),
            "loss_diff": abs(r.get("loss", math.nan) - ref.get("loss", math.nan)),
            "repeats": len(times.get(m, [])), "mem_method": r.get("mem_method", ""),
            "error": r.get("error") or results[METHODS[-1]].get("error", ""),
        })
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=1024, help="tokens N (default 1024)")
    p.add_argument("--hidden", type=int, default=256, help="hidden size H (default 256)")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary V (default 32000)")
    p.add_argument("--depths", type=int, nargs="+", default=[2],
                   help="MTP depths D, two rows each (default 2)")
    p.add_argument("--sample-len", type=int, default=256,
                   help="tokens per packed sample (default 256)")
    p.add_argument("--chunk-size", type=int, default=0,
                   help="megaloss's tokens per chunk (default 0: its automatic choice, "
                        "auto_chunk_size)")
    p.add_argument("--repeats", type=int, default=2, help="timed rounds (default 2)")
    p.add_argument("--time-budget", type=float, default=30.0,
                   help="stop repeating once the timed runs took this many seconds (default 30)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--csv", metavar="PATH", help="write the table as CSV")
    add_process_arguments(p, timeout_help="seconds per process")
    args = p.parse_args(argv)
    if answer_worker(args, _worker):
        return 0
    require_positive(p, args, ("tokens", "hidden", "vocab", "sample_len", "repeats", "threads"))
    if args.chunk_size < 0:
        p.error("--chunk-size must be >= 0")
    if not args.chunk_size:
        from megaloss.ops.chunk_driver import auto_chunk_size
        args.chunk_size = auto_chunk_size(args.tokens, args.vocab, args.hidden)
    if any(d < 1 for d in args.depths):
        p.error("--depths must be >= 1")

    rows = []
    for depth in args.depths:
        t0 = time.perf_counter()
        rows += _rows(args, depth)
        print(f"# D={depth}: done ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    print(f"MTP loss (main + {SCALING} / D * sum of D depths) fwd+bwd, CPU fp32, N={args.tokens}, "
          f"H={args.hidden}, V={args.vocab}, samples of {args.sample_len}, "
          f"chunk={args.chunk_size}; extra_MiB = peak above inputs, weight and their grads; "
          f"*_vs_materialised = against per-depth logits + F.cross_entropy (time: median of "
          f"per-round ratios); logits_MiB = the D + 1 fp32 [N, V] logits")
    print(format_table(rows, TABLE_COLUMNS))
    errors = [f"D={r['depth']} {r['method']}: {r['error']}" for r in rows if r.get("error")]
    return finish(errors, args.csv, rows, COLUMNS)


if __name__ == "__main__":
    sys.exit(main())
