#!/usr/bin/env python3
"""Benchmark: eager torch (``F.linear`` + ``F.cross_entropy``) vs ``megaloss.linear_cross_entropy``.

For every token count N, on the same inputs (``hidden [N, H]``, ``weight [V, H]``, both requiring
grad, random labels), one forward+backward of each loss is measured for

* extra peak memory: peak above the memory of inputs, weight and their (preallocated) ``.grad``
  buffers, one fresh process per loss and size running it once (method: ``tools/_bench_common.py``),
* time: in a third fresh process, after one full-size warm-up round, ``--repeats`` rounds that
  each run eager, megaloss and the 3 bare GEMMs of the loss's shapes (``[N,H]x[H,V]``,
  ``[N,V]x[V,H]``, ``[V,N]x[N,H]``, 2*N*H*V FLOPs each), order rotated per round (fewer rounds
  once ``--time-budget`` seconds are spent). Times are medians; ``time_ratio`` (megaloss / eager)
  and ``roofline`` (GEMMs / megaloss) are medians of the per-round ratios, so that load from
  other processes on a shared machine hits both sides of a ratio alike.

fp32 on CPU always; bf16 on CUDA too when ``torch.cuda.is_available()`` (unless ``--no-cuda``).
The eager baseline upcasts the logits to fp32 before the loss, as Hugging Face's causal-LM loss
does (a no-op in fp32).

    python3 tools/bench_ce.py                        # H=1024, V=32000, N in {1024, 4096, 16384}
    python3 tools/bench_ce.py --sizes 2048 --csv ce.csv --plot ce.png
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
from _bench_common import (MALLOC_ENV, MemoryProbe, format_table, median, mib,  # noqa: E402
                           run_worker, write_csv)

# Three fresh processes per size: the memory of each loss, then the timing of all three.
JOBS = (("memory", "eager"), ("memory", "megaloss"), ("timing", "all"))

COLUMNS = ["device", "dtype", "tokens", "hidden", "vocab", "chunk_size", "threads",
           "eager_s", "megaloss_s", "time_ratio", "gemm3_s", "roofline", "eager_roofline",
           "eager_MiB", "megaloss_MiB", "mem_ratio", "repeats", "loss_eager", "loss_megaloss",
           "loss_abs_diff", "mem_method"]
TABLE_COLUMNS = ["device", "dtype", "tokens", "eager_s", "megaloss_s", "time_ratio", "gemm3_s",
                 "roofline", "eager_MiB", "megaloss_MiB", "mem_ratio", "loss_abs_diff"]


# worker (runs in a fresh process) ------------------------------------------------------------
def _worker(spec: Dict[str, Any]) -> Dict[str, Any]:
    """``mode="memory"``: one fwd+bwd of ``spec["method"]`` under the memory probe.
    ``mode="timing"``: warm runs of eager, megaloss and the 3 bare GEMMs, interleaved."""
    import gc

    import torch
    import torch.nn.functional as F

    from megaloss.losses import linear_cross_entropy

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(spec["seed"])
    dev, dtype = torch.device(spec["device"]), getattr(torch, spec["dtype"])
    n, hidden, vocab, chunk = spec["tokens"], spec["hidden"], spec["vocab"], spec["chunk_size"]
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def eager(h, w, y):
        F.cross_entropy(F.linear(h, w).float(), y).backward()

    def mega(h, w, y):
        linear_cross_entropy(h, w, y, chunk_size=chunk).backward()

    def gemm3(h, w, y):
        with torch.no_grad():
            logits = torch.mm(h, w.t())        # [N,H] x [H,V]
            torch.mm(logits, w)                # [N,V] x [V,H]  (d hidden)
            torch.mm(logits.t(), h)            # [V,N] x [N,H]  (d weight)

    fns = {"eager": eager, "megaloss": mega, "gemm3": gemm3}
    methods = [spec["method"]] if spec["mode"] == "memory" else list(fns)
    # Tiny warm-up so that lazily created state (thread pool, kernels) is in the baseline.
    hw = torch.randn(16, hidden, device=dev, dtype=dtype, requires_grad=True)
    ww = torch.randn(64, hidden, device=dev, dtype=dtype, requires_grad=True)
    for m in methods:
        fns[m](hw, ww, torch.randint(0, 64, (16,), device=dev))
    del hw, ww

    # Inputs from their own CPU generator: a function of --seed alone (not of the warm-up
    # above), the same in every process of a size, and reproducible outside the tool.
    gen = torch.Generator().manual_seed(spec["seed"])
    h = torch.randn(n, hidden, generator=gen).to(dev, dtype).requires_grad_()
    w = torch.randn(vocab, hidden, generator=gen).mul_(0.02).to(dev, dtype).requires_grad_()
    y = torch.randint(0, vocab, (n,), generator=gen).to(dev)
    # Preallocated (and touched) gradient buffers: autograd accumulates into them, so the figure
    # is the loss's memory beyond inputs, weight and their gradients.
    h.grad, w.grad = torch.zeros_like(h), torch.zeros_like(w)
    gc.collect()

    if spec["mode"] == "memory":
        probe = MemoryProbe(dev)
        probe.start()
        if spec["method"] == "eager":
            loss = F.cross_entropy(F.linear(h, w).float(), y)
        else:
            loss = linear_cross_entropy(h, w, y, chunk_size=chunk)
        loss.backward()  # the one run this process makes: the high-water mark covers it only
        extra = probe.peak_above_baseline()
        return {"extra_bytes": extra, "loss": float(loss.detach().float()),
                "mem_method": probe.method, "baseline_slack": probe.baseline_slack}

    # Interleaved rounds (order rotated each round) so that all three see the same machine
    # load: the ratios are taken within a round. The first round is a full-size warm-up.
    times: Dict[str, List[float]] = {m: [] for m in methods}
    spent, rounds = 0.0, spec["repeats"] + 1
    for r in range(rounds):
        for m in methods[r % 3:] + methods[:r % 3]:
            sync()
            t0 = time.perf_counter()
            fns[m](h, w, y)
            sync()
            dt = time.perf_counter() - t0
            if r > 0:
                times[m].append(dt)
                spent += dt
        if r > 0 and spent >= spec["budget"]:
            break
    return {"times": times}


# driver ---------------------------------------------------------------------------------------
def _configs(args) -> List[Dict[str, str]]:
    configs = [{"device": "cpu", "dtype": d} for d in args.cpu_dtypes]
    if not args.no_cuda:
        import torch  # only here: the driver stays small otherwise
        if torch.cuda.is_available():
            configs += [{"device": "cuda", "dtype": d} for d in args.cuda_dtypes]
    return configs


def _row(cfg: Dict[str, str], args, n: int, res: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    times = res["timing"].get("times", {})

    def t(m):
        return median(times.get(m, []))

    def paired(a, b):  # median over rounds of time(a) / time(b) in the same round
        pairs = list(zip(times.get(a, []), times.get(b, [])))
        return median([x / y for x, y in pairs if y > 0])

    def mem(m):
        return mib(res[m]["extra_bytes"]) if "extra_bytes" in res[m] else math.nan

    loss_e, loss_m = res["eager"].get("loss", math.nan), res["megaloss"].get("loss", math.nan)
    mem_e, mem_m = mem("eager"), mem("megaloss")
    return {
        **cfg, "tokens": n, "hidden": args.hidden, "vocab": args.vocab,
        "chunk_size": args.chunk_size, "threads": args.threads,
        "eager_s": t("eager"), "megaloss_s": t("megaloss"),
        "time_ratio": paired("megaloss", "eager"),
        "gemm3_s": t("gemm3"), "roofline": paired("gemm3", "megaloss"),
        "eager_roofline": paired("gemm3", "eager"),
        "eager_MiB": mem_e, "megaloss_MiB": mem_m,
        "mem_ratio": mem_m / mem_e if mem_e > 0 else math.nan,
        "repeats": len(times.get("megaloss", [])),
        "loss_eager": loss_e, "loss_megaloss": loss_m, "loss_abs_diff": abs(loss_e - loss_m),
        "mem_method": res["megaloss"].get("mem_method", ""),
    }


def _plot(rows: List[Dict[str, Any]], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for dev, dtype in sorted({(r["device"], r["dtype"]) for r in rows}):
        sel = [r for r in rows if (r["device"], r["dtype"]) == (dev, dtype)]
        toks = [r["tokens"] for r in sel]
        for key, style in (("eager_MiB", "o-"), ("megaloss_MiB", "s-")):
            ax.plot(toks, [r[key] for r in sel], style,
                    label=f"{key.split('_')[0]} ({dev}, {dtype})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens N")
    ax.set_ylabel("extra peak memory of fwd+bwd (MiB)")
    r0 = rows[0]
    ax.set_title(f"linear + cross-entropy, H={r0['hidden']}, V={r0['vocab']}, "
                 f"chunk={r0['chunk_size']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096, 16384],
                   help="token counts N (default: 1024 4096 16384)")
    p.add_argument("--hidden", type=int, default=1024, help="hidden size H (default 1024)")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary size V (default 32000)")
    p.add_argument("--chunk-size", type=int, default=1024, help="megaloss chunk (default 1024)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds per size (default 3)")
    p.add_argument("--time-budget", type=float, default=30.0,
                   help="stop adding rounds for a size once its timed runs took this many "
                        "seconds (at least one round; default 30)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="torch threads per worker (default: all CPUs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-cuda", action="store_true", help="skip the CUDA rows")
    dtypes = ("float32", "bfloat16", "float16")
    p.add_argument("--cpu-dtypes", nargs="+", choices=dtypes, default=["float32"],
                   help="dtypes of the CPU rows (default float32; float16 shows the deferred "
                        "fp16 schedule: one extra GEMM, see megaloss/ops/chunked_linear_ce.py)")
    p.add_argument("--cuda-dtypes", nargs="+", choices=dtypes, default=["bfloat16"],
                   help="dtypes of the CUDA rows (default bfloat16)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per case")
    p.add_argument("--csv", metavar="PATH", help="write all columns as CSV")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of peak memory vs tokens")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker:
        print(json.dumps(_worker(json.loads(args.worker))))
        return 0
    for name in ("hidden", "vocab", "chunk_size", "repeats", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if any(n < 1 for n in args.sizes):
        p.error("--sizes must be >= 1")

    script = os.path.abspath(__file__)
    rows, failed = [], False
    print(f"# workers: fresh process per case, {args.threads} threads, "
          + " ".join(f"{k}={v}" for k, v in MALLOC_ENV.items()), file=sys.stderr)
    for cfg in _configs(args):
        for n in args.sizes:
            res = {}
            for mode, method in JOBS:
                spec = {**cfg, "mode": mode, "method": method, "tokens": n, "hidden": args.hidden,
                        "vocab": args.vocab, "chunk_size": args.chunk_size,
                        "repeats": args.repeats, "budget": args.time_budget,
                        "threads": args.threads, "seed": args.seed}
                t0 = time.perf_counter()
                key = method if mode == "memory" else mode
                res[key] = run_worker(script, spec, args.threads, args.timeout)
                status = res[key].get("error", "ok")
                failed |= "error" in res[key]
                print(f"# {cfg['device']} {cfg['dtype']} N={n} {mode} {method}: {status} "
                      f"({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
            rows.append(_row(cfg, args, n, res))

    print(f"linear + cross-entropy fwd+bwd, H={args.hidden}, V={args.vocab}, "
          f"chunk={args.chunk_size}; time = median seconds; MiB = extra peak memory above "
          f"inputs, weight and their grads; ratios = megaloss / eager; "
          f"roofline = time(3 bare GEMMs) / time(megaloss)")
    print(format_table(rows, TABLE_COLUMNS))
    if args.csv:
        write_csv(args.csv, rows, COLUMNS)
    if args.plot:
        _plot(rows, args.plot)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
