#!/usr/bin/env python3
"""Benchmark: a training step under ``torch.compile`` with megaloss's cross-entropy, against the
same step with megaloss in eager mode and against the compiled step with the plain torch loss
(``F.linear`` + ``F.cross_entropy``, which Inductor fuses as it can): time and extra peak memory
as ratios, in one run.

The step is fwd + bwd of a one-layer trunk and the lm_head loss::

    hidden = gelu(x @ w1.T)            x [N, H] (no grad), w1 [H, H]
    loss   = CE(hidden @ w.T, labels)  w [V, H], token mean over the labels that are not -100

Inputs (a documented function of ``--seed``, for the test's reference): one CPU generator draws
``x = randn(N, H)``, ``w1 = randn(H, H) / sqrt(H)``, ``w = randn(V, H) * 0.02`` and ``labels =
randint(0, V, (N,))``, in that order; then every 7th label (``labels[::7]``) is -100.

Methods (``--methods``, each in its own fresh process, run once per ``--rounds``, rounds
interleaved so that load from other processes hits every method alike):

* ``eager_ce``: the step in eager mode with ``F.linear`` + ``F.cross_entropy`` (full logits);
* ``eager_megaloss``: the step in eager mode with ``megaloss.linear_cross_entropy``;
* ``compiled_ce``: ``torch.compile`` of the ``eager_ce`` step;
* ``compiled_megaloss``: ``torch.compile`` of the ``eager_megaloss`` step (``fullgraph=True``:
  it compiles to one graph, no graph break; the chunk loop is traced, the input checks that
  would cost a host sync become in-graph asserts, see ``megaloss/ops/validation.py``).

Per process: the first step (compilation included, ``first_step_s``) and a second one untimed;
then, with the ``.grad`` buffers of ``w1`` and ``w`` preallocated, one step under the memory
probe (extra peak RSS above inputs, parameters and their gradients: ``tools/_bench_common.py``),
then ``--repeats`` timed steps; a method's time is the minimum over its steps of every round, its
memory the minimum over its rounds. Ratios: ``compiled_megaloss`` against ``eager_megaloss`` and
against ``compiled_ce``; the loss of each method against ``eager_megaloss``'s.

    python3 tools/bench_compile.py                                  # N 4096, H 1024, V 32000
    python3 tools/bench_compile.py --tokens 2048 --hidden 512 --rounds 2 --csv compile.csv
    python3 tools/bench_compile.py --backend aot_eager --tokens 256 --hidden 16 --vocab 500
"""
from __future__ import annotations

import argparse
import json
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
    mib,
    require_positive,
    run_worker,
    write_csv,
)

METHODS = ("eager_ce", "eager_megaloss", "compiled_ce", "compiled_megaloss")
IGNORE_EVERY = 7  # labels[::7] = -100

COLUMNS = ["method", "tokens", "hidden", "vocab", "backend", "threads", "time_s", "extra_MiB",
           "time_vs_eager_megaloss", "mem_vs_eager_megaloss", "time_vs_compiled_ce",
           "mem_vs_compiled_ce", "first_step_s", "loss", "loss_diff_vs_eager_megaloss",
           "repeats", "mem_method", "note"]
TABLE_COLUMNS = ["method", "time_s", "extra_MiB", "time_vs_eager_megaloss",
                 "mem_vs_eager_megaloss", "time_vs_compiled_ce", "mem_vs_compiled_ce",
                 "first_step_s", "loss_diff_vs_eager_megaloss", "note"]


def inputs(n: int, hidden: int, vocab: int, seed: int):
    """``(x, w1, w, labels)`` of the step (module docstring), fp32 on CPU, no grad."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, hidden, generator=gen)
    w1 = torch.randn(hidden, hidden, generator=gen) / math.sqrt(hidden)
    w = torch.randn(vocab, hidden, generator=gen) * 0.02
    labels = torch.randint(0, vocab, (n,), generator=gen)
    labels[::IGNORE_EVERY] = -100
    return x, w1, w, labels


def _step(method: str, chunk_size, backend: str):
    """``fn(x, w1, w, labels) -> loss`` of ``method``."""
    import torch
    import torch.nn.functional as F

    from megaloss import linear_cross_entropy

    def ce(x, w1, w, labels):
        hidden = F.gelu(F.linear(x, w1))
        return F.cross_entropy(F.linear(hidden, w), labels, ignore_index=-100)

    def megaloss(x, w1, w, labels):
        hidden = F.gelu(F.linear(x, w1))
        return linear_cross_entropy(hidden, w, labels, chunk_size=chunk_size)

    fn = ce if method.endswith("_ce") else megaloss
    if method.startswith("compiled_"):
        fn = torch.compile(fn, backend=backend, dynamic=False,
                           fullgraph=method == "compiled_megaloss")
    return fn


def _worker(spec: Dict[str, Any]) -> Dict[str, Any]:
    import gc

    import torch

    torch.set_num_threads(spec["threads"])
    x, w1, w, labels = inputs(spec["tokens"], spec["hidden"], spec["vocab"], spec["seed"])
    w1.requires_grad_()
    w.requires_grad_()
    fn = _step(spec["method"], spec["chunk_size"], spec["backend"])

    def run():
        loss = fn(x, w1, w, labels)
        loss.backward()
        return loss

    t0 = time.perf_counter()
    run()  # compiles the compiled methods
    first = time.perf_counter() - t0
    run()
    w1.grad, w.grad = torch.zeros_like(w1), torch.zeros_like(w)
    gc.collect()
    probe = MemoryProbe("cpu")
    probe.start()
    loss = run()  # the high-water mark covers this one step only
    extra = probe.peak_above_baseline()
    times: List[float] = []
    for _ in range(spec["repeats"]):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return {"times": times, "extra_bytes": extra, "loss": float(loss.detach()),
            "first_step_s": first, "mem_method": probe.method}


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 and math.isfinite(a) and math.isfinite(b) else math.nan


def _rows(args, results: Dict[str, List[Dict[str, Any]]]) -> List[Dict[str, Any]]:
    best: Dict[str, Dict[str, Any]] = {}
    for m, outs in results.items():
        ok = [o for o in outs if "error" not in o]
        errors = [o["error"] for o in outs if "error" in o]
        times = [t for o in ok for t in o["times"]]
        best[m] = {
            "time_s": min(times) if times else math.nan,
            "extra_MiB": min(mib(o["extra_bytes"]) for o in ok) if ok else math.nan,
            "first_step_s": min(o["first_step_s"] for o in ok) if ok else math.nan,
            "loss": ok[0]["loss"] if ok else math.nan,
            "repeats": len(times), "mem_method": ok[0]["mem_method"] if ok else "",
            "note": errors[0][:160] if errors else ""}
    nan = {"time_s": math.nan, "extra_MiB": math.nan, "loss": math.nan}
    ref, cce = best.get("eager_megaloss", nan), best.get("compiled_ce", nan)
    rows = []
    for m in args.methods:
        b = best[m]
        rows.append({
            "method": m, "tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab,
            "backend": args.backend if m.startswith("compiled_") else "",
            "threads": args.threads, **b,
            "time_vs_eager_megaloss": _ratio(b["time_s"], ref["time_s"]),
            "mem_vs_eager_megaloss": _ratio(b["extra_MiB"], ref["extra_MiB"]),
            "time_vs_compiled_ce": _ratio(b["time_s"], cce["time_s"]),
            "mem_vs_compiled_ce": _ratio(b["extra_MiB"], cce["extra_MiB"]),
            "loss_diff_vs_eager_megaloss": abs(b["loss"] - ref["loss"])})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096, help="tokens N (default 4096)")
    p.add_argument("--hidden", type=int, default=1024, help="hidden size H (default 1024)")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary size V (default 32000)")
    p.add_argument("--chunk-size", type=int, default=None,
                   help="megaloss's tokens per chunk (default: its automatic choice)")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS),
                   metavar="METHOD", help="of " + ", ".join(METHODS) + " (default: all)")
    p.add_argument("--backend", default="inductor",
                   help="torch.compile backend of the compiled methods (default inductor; "
                        "aot_eager traces without generating code, for quick smoke runs)")
    p.add_argument("--repeats", type=int, default=3, help="timed steps per process (default 3)")
    p.add_argument("--rounds", type=int, default=1,
                   help="fresh processes per method, interleaved (default 1)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="torch threads per worker (default: all CPUs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per process")
    p.add_argument("--csv", metavar="PATH", help="write all columns as CSV")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker:
        print(json.dumps(_worker(json.loads(args.worker))))
        return 0
    require_positive(p, args, ("tokens", "hidden", "vocab", "repeats", "rounds", "threads"))
    if args.chunk_size is not None and args.chunk_size < 1:
        p.error("--chunk-size must be >= 1")
    args.methods = list(dict.fromkeys(args.methods))
    script = os.path.abspath(__file__)
    print(f"# workers: fresh process per method and round, {args.threads} threads, "
          + " ".join(f"{k}={v}" for k, v in MALLOC_ENV.items()), file=sys.stderr)
    results: Dict[str, List[Dict[str, Any]]] = {m: [] for m in args.methods}
    for r in range(args.rounds):
        for m in args.methods:
            spec = {"method": m, "tokens": args.tokens, "hidden": args.hidden,
                    "vocab": args.vocab, "chunk_size": args.chunk_size, "backend": args.backend,
                    "repeats": args.repeats, "threads": args.threads, "seed": args.seed}
            t0 = time.perf_counter()
            out = run_worker(script, spec, args.threads, args.timeout)
            results[m].append(out)
            print(f"# round {r + 1} {m}: {out.get('error', 'ok')} "
                  f"({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    rows = _rows(args, results)
    print(f"training step fwd+bwd (gelu trunk + lm_head CE), fp32 CPU, N={args.tokens}, "
          f"H={args.hidden}, V={args.vocab}, 1/{IGNORE_EVERY} of the labels -100, "
          f"backend={args.backend}; time = min seconds over {args.rounds} x {args.repeats} "
          f"steps; MiB = extra peak memory above inputs, parameters and their grads (min over "
          f"rounds); first_step_s includes compilation")
    print(format_table(rows, TABLE_COLUMNS))
    if args.csv:
        write_csv(args.csv, rows, COLUMNS)
    return 1 if any(row["note"] for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
