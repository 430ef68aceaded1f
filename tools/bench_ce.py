#!/usr/bin/env python3
"""Benchmark: eager torch (``F.linear`` + ``F.cross_entropy``) vs ``megaloss.linear_cross_entropy``.

For every token count N, on the same inputs (``hidden [N, H]``, ``weight [V, H]``, both requiring
grad, random labels), one forward+backward of each loss is measured for

* time: median of ``--repeats`` warm runs (fewer if ``--time-budget`` seconds per case run out;
  the count is in the CSV),
* extra peak memory: peak above the memory of inputs, weight and their (preallocated) ``.grad``
  buffers, in a fresh process per case (see ``tools/_bench_common.py`` for the method),
* roofline ratio: time of the 3 bare GEMMs of the loss's shapes, ``[N,H]x[H,V]``,
  ``[N,V]x[V,H]`` and ``[V,N]x[N,H]`` (2*N*H*V FLOPs each), divided by the loss's time.

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
                           run_worker, time_repeats, write_csv)

METHODS = ("eager", "megaloss", "gemm3")

COLUMNS = ["device", "dtype", "tokens", "hidden", "vocab", "chunk_size", "threads",
           "eager_s", "megaloss_s", "time_ratio", "gemm3_s", "roofline", "eager_roofline",
           "eager_MiB", "megaloss_MiB", "mem_ratio", "eager_repeats", "megaloss_repeats",
           "gemm3_repeats", "loss_eager", "loss_megaloss", "loss_abs_diff", "mem_method"]
TABLE_COLUMNS = ["device", "dtype", "tokens", "eager_s", "megaloss_s", "time_ratio", "gemm3_s",
                 "roofline", "eager_MiB", "megaloss_MiB", "mem_ratio", "loss_abs_diff"]


# worker (runs in a fresh process) ------------------------------------------------------------
def _worker(spec: Dict[str, Any]) -> Dict[str, Any]:
    import gc

    import torch
    import torch.nn.functional as F

    from megaloss.linear_cross_entropy import linear_cross_entropy

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(spec["seed"])
    dev, dtype = torch.device(spec["device"]), getattr(torch, spec["dtype"])
    n, hidden, vocab, chunk = spec["tokens"], spec["hidden"], spec["vocab"], spec["chunk_size"]
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def eager(h, w, y):
        return F.cross_entropy(F.linear(h, w).float(), y)

    def mega(h, w, y):
        return linear_cross_entropy(h, w, y, chunk_size=chunk)

    if spec["method"] == "gemm3":
        def gemms(h, w):
            logits = torch.mm(h, w.t())        # [N,H] x [H,V]
            torch.mm(logits, w)                # [N,V] x [V,H]  (d hidden)
            torch.mm(logits.t(), h)            # [V,N] x [N,H]  (d weight)

        small = min(n, 256)  # warm-up: kernels and thread pool, without a second full run
        gemms(torch.randn(small, hidden, device=dev, dtype=dtype),
              torch.randn(vocab, hidden, device=dev, dtype=dtype))
        h = torch.randn(n, hidden, device=dev, dtype=dtype)
        w = torch.randn(vocab, hidden, device=dev, dtype=dtype)
        times = time_repeats(lambda: gemms(h, w), spec["repeats"], spec["budget"], sync)
        return {"times": times}

    fn = eager if spec["method"] == "eager" else mega
    # Tiny warm-up so that lazily created state (thread pool, kernels) is in the baseline.
    hw = torch.randn(16, hidden, device=dev, dtype=dtype, requires_grad=True)
    ww = torch.randn(64, hidden, device=dev, dtype=dtype, requires_grad=True)
    fn(hw, ww, torch.randint(0, 64, (16,), device=dev)).backward()
    del hw, ww

    h = torch.randn(n, hidden, device=dev, dtype=dtype).requires_grad_()
    w = torch.randn(vocab, hidden, device=dev, dtype=dtype).mul_(0.02).requires_grad_()
    y = torch.randint(0, vocab, (n,), device=dev)
    # Preallocated (and touched) gradient buffers: autograd accumulates into them, so the figure
    # is the loss's memory beyond inputs, weight and their gradients.
    h.grad, w.grad = torch.zeros_like(h), torch.zeros_like(w)
    gc.collect()

    def step():
        loss = fn(h, w, y)
        loss.backward()
        return loss

    probe = MemoryProbe(dev)
    probe.start()
    t0 = time.perf_counter()
    loss = step()  # the one run that the memory figure covers; also the full-size warm-up
    sync()
    cold = time.perf_counter() - t0
    extra = probe.peak_above_baseline()
    loss_value = float(loss.detach().float())
    del loss
    times = time_repeats(step, spec["repeats"], spec["budget"], sync)
    return {"times": times, "cold_s": cold, "extra_bytes": extra, "loss": loss_value,
            "mem_method": probe.method, "baseline_slack": probe.baseline_slack}


# driver ---------------------------------------------------------------------------------------
def _configs(no_cuda: bool) -> List[Dict[str, str]]:
    configs = [{"device": "cpu", "dtype": "float32"}]
    if not no_cuda:
        import torch  # only here: the driver stays small otherwise
        if torch.cuda.is_available():
            configs.append({"device": "cuda", "dtype": "bfloat16"})
    return configs


def _row(cfg: Dict[str, str], args, n: int, res: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    def t(m):
        return median(res[m].get("times", []))

    def mem(m):
        return mib(res[m]["extra_bytes"]) if "extra_bytes" in res[m] else math.nan

    def ratio(a, b):
        return a / b if b and not math.isnan(a) and not math.isnan(b) else math.nan

    loss_e, loss_m = res["eager"].get("loss", math.nan), res["megaloss"].get("loss", math.nan)
    return {
        **cfg, "tokens": n, "hidden": args.hidden, "vocab": args.vocab,
        "chunk_size": args.chunk_size, "threads": args.threads,
        "eager_s": t("eager"), "megaloss_s": t("megaloss"),
        "time_ratio": ratio(t("megaloss"), t("eager")),
        "gemm3_s": t("gemm3"), "roofline": ratio(t("gemm3"), t("megaloss")),
        "eager_roofline": ratio(t("gemm3"), t("eager")),
        "eager_MiB": mem("eager"), "megaloss_MiB": mem("megaloss"),
        "mem_ratio": ratio(mem("megaloss"), mem("eager")),
        "eager_repeats": len(res["eager"].get("times", [])),
        "megaloss_repeats": len(res["megaloss"].get("times", [])),
        "gemm3_repeats": len(res["gemm3"].get("times", [])),
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
    p.add_argument("--repeats", type=int, default=3, help="timed runs per case (default 3)")
    p.add_argument("--time-budget", type=float, default=15.0,
                   help="stop repeating a case once its timed runs took this many seconds "
                        "(at least one timed run; default 15)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="torch threads per worker (default: all CPUs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-cuda", action="store_true", help="skip the bf16 CUDA rows")
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
    for cfg in _configs(args.no_cuda):
        for n in args.sizes:
            res = {}
            for method in METHODS:
                spec = {**cfg, "method": method, "tokens": n, "hidden": args.hidden,
                        "vocab": args.vocab, "chunk_size": args.chunk_size,
                        "repeats": args.repeats, "budget": args.time_budget,
                        "threads": args.threads, "seed": args.seed}
                t0 = time.perf_counter()
                res[method] = run_worker(script, spec, args.threads, args.timeout)
                status = res[method].get("error", "ok")
                failed |= "error" in res[method]
                print(f"# {cfg['device']} {cfg['dtype']} N={n} {method}: {status} "
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
