#!/usr/bin/env python3
"""Benchmark: eager torch (``F.linear`` + ``F.cross_entropy``) vs ``megaloss.linear_cross_entropy``.

For every token count N, on the same inputs (``hidden [N, H]``, ``weight [V, H]``, both requiring
grad, random labels), one forward+backward of each loss is measured for

* extra peak memory: peak above the memory of inputs, weight and their (preallocated) ``.grad``
  buffers, one fresh process per loss and size running it once (method: ``tools/_bench_common.py``);
  on CUDA, where the allocator's peak statistic can be reset, the timing process measures it for
  each loss in turn instead, after one untimed run at the real size (one process per size: one
  start-up and one compile per size),
* time: in a third fresh process, after one full-size warm-up round, ``--repeats`` rounds that
  each run eager, megaloss and the 3 bare GEMMs of the loss's shapes (``[N,H]x[H,V]``,
  ``[N,V]x[V,H]``, ``[V,N]x[N,H]``, 2*N*H*V FLOPs each), order rotated per round (fewer rounds
  once ``--time-budget`` seconds are spent). Times are medians; ``time_ratio`` (megaloss / eager)
  and ``roofline`` (GEMMs / megaloss) are medians of the per-round ratios, so that load from
  other processes on a shared machine hits both sides of a ratio alike.

fp32 on CPU always (unless ``--no-cpu``); bf16 on CUDA too when ``torch.cuda.is_available()``
(unless ``--no-cuda``). The eager baseline upcasts the logits to fp32 before the loss, as Hugging
Face's causal-LM loss does (a no-op in fp32). Every loss is warmed up once on ``min(N, chunk)``
tokens at the real H and V before any measurement (kernels compiled, autotuned, cached).

``--impls`` adds implementations, measured side by side in the same processes and rounds, as
extra columns and in a second table (one row per implementation; ``--impl-csv``):

* ``megaloss_torch`` / ``megaloss_triton``: megaloss with the epilogue forced
  (``CrossEntropyOptions(impl=...)``; plain ``megaloss`` is ``impl="auto"``: Triton on CUDA);
  ``megaloss_triton`` runs on CPU only under ``TRITON_INTERPRET=1`` (slowly);
* ``megaloss_compile``: megaloss with its torch chunk epilogue wrapped in
  ``torch.compile`` — the alternative to hand-written kernels;
* ``liger``: Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss``; ``cce``: Cut Cross-Entropy's
  ``linear_cross_entropy`` (Wijmans et al. 2024, arXiv:2411.09009) — CUDA only, and only when
  importable; otherwise their cells are empty and the note says why.

    python3 tools/bench_ce.py                        # H=1024, V=32000, N in {1024, 4096, 16384}
    python3 tools/bench_ce.py --sizes 2048 --csv ce.csv --plot ce.png
    python3 tools/bench_ce.py --no-cpu --sizes 8192 --hidden 4096 --vocab 151936 \
        --impls megaloss_torch megaloss_compile liger cce --impl-csv impls.csv
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any, Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_common import (  # noqa: E402
    MALLOC_ENV,
    MemoryProbe,
    format_table,
    median,
    mib,
    require_positive,
    run_worker,
    write_csv,
)

BASE_IMPLS = ("eager", "megaloss")
EXTRA_IMPLS = ("megaloss_torch", "megaloss_triton", "megaloss_compile", "liger", "cce")

COLUMNS = ["device", "dtype", "tokens", "hidden", "vocab", "chunk_size", "threads",
           "eager_s", "megaloss_s", "time_ratio", "gemm3_s", "roofline", "eager_roofline",
           "eager_MiB", "megaloss_MiB", "mem_ratio", "repeats", "loss_eager", "loss_megaloss",
           "loss_abs_diff", "mem_method"]
TABLE_COLUMNS = ["device", "dtype", "tokens", "eager_s", "megaloss_s", "time_ratio", "gemm3_s",
                 "roofline", "eager_MiB", "megaloss_MiB", "mem_ratio", "loss_abs_diff"]
# Per extra implementation X: X_s, X_MiB, X_roofline, loss_X, X_note (appended to COLUMNS).
EXTRA_SUFFIXES = ("{}_s", "{}_MiB", "{}_roofline", "loss_{}", "{}_note")
# The side-by-side table: one row per (device, dtype, tokens, implementation).
IMPL_COLUMNS = ["device", "dtype", "tokens", "hidden", "vocab", "impl", "epilogue", "time_s",
                "time_vs_eager", "roofline", "extra_MiB", "mem_vs_eager", "loss",
                "loss_diff_vs_eager", "note"]
IMPL_TABLE_COLUMNS = ["device", "dtype", "tokens", "impl", "epilogue", "time_s", "time_vs_eager",
                      "roofline", "extra_MiB", "mem_vs_eager", "loss_diff_vs_eager", "note"]


# worker (runs in a fresh process) ------------------------------------------------------------
def _loss_fns(methods: List[str], chunk: int, dev,
              compile_backend: str = "inductor") -> Tuple[Dict[str, Any], Dict[str, str]]:
    """``{method: fn(h, w, y) -> loss}`` for the methods that can run here, and ``{method: why
    not}`` for the others."""
    import torch.nn.functional as F

    from megaloss import CrossEntropyOptions
    from megaloss.losses import linear_cross_entropy

    def forced(impl):
        opts = CrossEntropyOptions(chunk_size=chunk, impl=impl)
        return lambda h, w, y: linear_cross_entropy(h, w, y, options=opts)

    fns: Dict[str, Any] = {}
    notes: Dict[str, str] = {}
    for m in methods:
        if _cannot_run(m, dev.type):
            notes[m] = _cannot_run(m, dev.type)
            continue
        try:
            if m == "eager":
                fns[m] = lambda h, w, y: F.cross_entropy(F.linear(h, w).float(), y)
            elif m == "megaloss":
                fns[m] = lambda h, w, y: linear_cross_entropy(h, w, y, chunk_size=chunk)
            elif m == "megaloss_torch":
                fns[m] = forced("torch")
            elif m == "megaloss_triton":
                import triton  # noqa: F401  (a note, not a failure, when it is missing)
                fns[m] = forced("triton")
            elif m == "megaloss_compile":
                fns[m] = _compiled_megaloss(chunk, compile_backend)
            elif m == "liger":
                from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
                liger = LigerFusedLinearCrossEntropyLoss()
                fns[m] = lambda h, w, y, liger=liger: liger(w, h, y)  # Liger takes the weight first
            elif m == "cce":
                from cut_cross_entropy import linear_cross_entropy as cce
                fns[m] = lambda h, w, y: cce(h, w, y)
            else:
                notes[m] = "unknown implementation"
        except Exception as e:  # ImportError, or a broken install
            notes[m] = f"not importable: {type(e).__name__}: {e}"[:160]
    return fns, notes


def _cannot_run(method: str, device: str) -> str:
    """Why ``method`` cannot run on ``device`` whatever is installed ("" if it can)."""
    if device == "cuda":
        return ""
    if method in ("liger", "cce"):
        return "CUDA only"
    if method == "megaloss_triton" and os.environ.get("TRITON_INTERPRET") != "1":
        return "CUDA only (or CPU under TRITON_INTERPRET=1)"
    return ""


def _compiled_megaloss(chunk: int, backend: str):
    """megaloss with ``torch.compile`` around its torch chunk epilogue (everything after the
    chunk's GEMM), swapped into the cross-entropy kernel only while this loss runs."""
    import torch

    from megaloss import CrossEntropyOptions
    from megaloss.losses import linear_cross_entropy
    from megaloss.ops import cross_entropy_chunk

    eager = cross_entropy_chunk.torch_epilogue
    compiled = torch.compile(eager, dynamic=False, backend=backend)
    opts = CrossEntropyOptions(chunk_size=chunk, impl="torch")

    def loss_fn(h, w, y):
        cross_entropy_chunk.torch_epilogue = compiled
        try:
            return linear_cross_entropy(h, w, y, options=opts)
        finally:
            cross_entropy_chunk.torch_epilogue = eager

    return loss_fn


def _in_this_process(spec: Dict[str, Any]) -> Dict[str, Any]:
    """:func:`_worker` here, its result as a worker's JSON line would give it; an exception
    becomes ``{"error": ...}`` as a crashed worker's would."""
    try:
        return json.loads(json.dumps(_worker(spec)))
    except Exception as e:  # noqa: BLE001 - reported in the row, as run_worker does
        return {"error": f"{type(e).__name__}: {e}"[:300]}


def _worker(spec: Dict[str, Any]) -> Dict[str, Any]:
    """``mode="memory"``: one fwd+bwd of ``spec["method"]`` under the memory probe.
    ``mode="timing"``: warm runs of every method and the 3 bare GEMMs, interleaved; on CUDA
    first one fwd+bwd of each under the memory probe."""
    import gc

    import torch

    from megaloss import CrossEntropyOptions
    from megaloss.ops.cross_entropy_chunk import epilogue_impl

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(spec["seed"])
    dev, dtype = torch.device(spec["device"]), getattr(torch, spec["dtype"])
    n, hidden, vocab, chunk = spec["tokens"], spec["hidden"], spec["vocab"], spec["chunk_size"]
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    methods = [spec["method"]] if spec["mode"] == "memory" else list(spec["methods"])
    fns, notes = _loss_fns(methods, chunk, dev, spec.get("compile_backend", "inductor"))

    def run(m, h, w, y):
        loss = fns[m](h, w, y)
        loss.backward()
        return loss

    def gemm3(h, w, y):
        with torch.no_grad():
            logits = torch.mm(h, w.t())        # [N,H] x [H,V]
            torch.mm(logits, w)                # [N,V] x [V,H]  (d hidden)
            torch.mm(logits.t(), h)            # [V,N] x [N,H]  (d weight)

    # Warm-up on min(N, chunk) tokens at the real H and V, so that lazily created state (thread
    # pool, cuBLAS workspace, compiled and autotuned kernels) is in the baseline.
    n_warm = min(n, chunk)
    hw = torch.randn(n_warm, hidden, device=dev, dtype=dtype, requires_grad=True)
    ww = (torch.randn(vocab, hidden, device=dev, dtype=dtype) * 0.02).requires_grad_()
    yw = torch.randint(0, vocab, (n_warm,), device=dev)
    for m in list(fns):
        try:
            run(m, hw, ww, yw)
        except Exception as e:  # e.g. megaloss_triton on CPU without the interpreter
            notes[m] = f"failed: {type(e).__name__}: {e}"[:160]
            del fns[m]
    if spec["mode"] == "timing":
        gemm3(hw, ww, yw)
    del hw, ww, yw
    sync()

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
    epilogue = epilogue_impl(CrossEntropyOptions().impl, torch.empty(0, device=dev, dtype=dtype))

    def measure_memory(m):
        probe = MemoryProbe(dev)
        probe.start()
        loss = run(m, h, w, y)  # the high-water mark covers this one run only
        extra = probe.peak_above_baseline()
        return {"extra_bytes": extra, "loss": float(loss.detach().float()),
                "mem_method": probe.method, "baseline_slack": probe.baseline_slack}

    if spec["mode"] == "memory":
        if spec["method"] not in fns:
            return {"note": notes.get(spec["method"], "not run")}
        return measure_memory(spec["method"])

    memory: Dict[str, Dict[str, Any]] = {}
    if dev.type == "cuda":  # allocator statistics: one process measures every method in turn
        for m in list(fns):
            try:
                run(m, h, w, y)  # at the real N first: kernels autotuned on N are tuned now
                sync()
                gc.collect()
                memory[m] = measure_memory(m)
            except Exception as e:
                notes[m] = f"failed: {type(e).__name__}: {e}"[:160]
                del fns[m]
            gc.collect()

    # Interleaved rounds (order rotated each round) so that all methods see the same machine
    # load: the ratios are taken within a round. The first round is a full-size warm-up.
    order = list(fns) + ["gemm3"]
    timed = {**{m: (lambda m=m: run(m, h, w, y)) for m in fns}, "gemm3": lambda: gemm3(h, w, y)}
    times: Dict[str, List[float]] = {m: [] for m in order}
    spent, rounds = 0.0, spec["repeats"] + 1
    for r in range(rounds):
        k = r % len(order)
        for m in order[k:] + order[:k]:
            sync()
            t0 = time.perf_counter()
            timed[m]()
            sync()
            dt = time.perf_counter() - t0
            if r > 0:
                times[m].append(dt)
                spent += dt
        if r > 0 and spent >= spec["budget"]:
            break
    return {"times": times, "memory": memory, "notes": notes, "epilogue": epilogue}


# driver ---------------------------------------------------------------------------------------
def _configs(args) -> List[Dict[str, str]]:
    configs = [] if args.no_cpu else [{"device": "cpu", "dtype": d} for d in args.cpu_dtypes]
    if not args.no_cuda:
        import torch  # only here: the driver stays small otherwise
        if torch.cuda.is_available():
            configs += [{"device": "cuda", "dtype": d} for d in args.cuda_dtypes]
    return configs


def _jobs(cfg: Dict[str, str], methods: List[str]) -> List[Tuple[str, str]]:
    """CPU: a fresh process per method for its memory, then one timing process for all. CUDA:
    the timing process measures the memory too (allocator statistics reset per method)."""
    memory = [] if cfg["device"] == "cuda" else [("memory", m) for m in methods
                                                  if not _cannot_run(m, cfg["device"])]
    return memory + [("timing", "all")]


def _stats(res: Dict[str, Any], m: str) -> Dict[str, Any]:
    """What is known of method ``m``: median time, paired ratios, memory, loss, note."""
    timing = res["timing"]
    times = timing.get("times", {})
    mem = res.get("memory", {}).get(m) or timing.get("memory", {}).get(m) or {}

    def paired(a, b):  # median over rounds of time(a) / time(b) in the same round
        pairs = list(zip(times.get(a, []), times.get(b, [])))
        return median([x / y for x, y in pairs if y > 0])

    note = timing.get("notes", {}).get(m) or mem.get("note") or mem.get("error") or ""
    if not note and "error" in timing:
        note = f"timing: {timing['error']}"
    return {"s": median(times.get(m, [])), "vs_eager": paired(m, "eager"),
            "roofline": paired("gemm3", m),
            "MiB": mib(mem["extra_bytes"]) if "extra_bytes" in mem else math.nan,
            "loss": mem.get("loss", math.nan), "note": note,
            "mem_method": mem.get("mem_method", ""), "repeats": len(times.get(m, []))}


def _row(cfg: Dict[str, str], args, n: int, res: Dict[str, Any]) -> Dict[str, Any]:
    e, m = _stats(res, "eager"), _stats(res, "megaloss")
    times = res["timing"].get("times", {})
    pairs = list(zip(times.get("megaloss", []), times.get("eager", [])))
    row = {
        **cfg, "tokens": n, "hidden": args.hidden, "vocab": args.vocab,
        "chunk_size": args.chunk_size, "threads": args.threads,
        "eager_s": e["s"], "megaloss_s": m["s"],
        "time_ratio": median([x / y for x, y in pairs if y > 0]),
        "gemm3_s": median(times.get("gemm3", [])), "roofline": m["roofline"],
        "eager_roofline": e["roofline"],
        "eager_MiB": e["MiB"], "megaloss_MiB": m["MiB"],
        "mem_ratio": m["MiB"] / e["MiB"] if e["MiB"] > 0 else math.nan,
        "repeats": m["repeats"],
        "loss_eager": e["loss"], "loss_megaloss": m["loss"],
        "loss_abs_diff": abs(e["loss"] - m["loss"]),
        "mem_method": m["mem_method"],
    }
    for x in args.impls:
        st = _stats(res, x)
        row.update({f"{x}_s": st["s"], f"{x}_MiB": st["MiB"], f"{x}_roofline": st["roofline"],
                    f"loss_{x}": st["loss"], f"{x}_note": st["note"]})
    return row


def _impl_rows(cfg: Dict[str, str], args, n: int, res: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The side-by-side table: one row per implementation, ratios against eager."""
    e = _stats(res, "eager")
    rows = []
    for x in list(BASE_IMPLS) + list(args.impls):
        st = _stats(res, x)
        epilogue = {"megaloss": res["timing"].get("epilogue", ""), "megaloss_torch": "torch",
                    "megaloss_triton": "triton", "megaloss_compile": "torch.compile"}.get(x, "")
        rows.append({**cfg, "tokens": n, "hidden": args.hidden, "vocab": args.vocab, "impl": x,
                     "epilogue": epilogue, "time_s": st["s"], "time_vs_eager": st["vs_eager"],
                     "roofline": st["roofline"], "extra_MiB": st["MiB"],
                     "mem_vs_eager": st["MiB"] / e["MiB"] if e["MiB"] > 0 else math.nan,
                     "loss": st["loss"], "loss_diff_vs_eager": abs(st["loss"] - e["loss"]),
                     "note": st["note"]})
    return rows


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


def _write_csvs(args, rows: List[Dict[str, Any]], impl_rows: List[Dict[str, Any]]) -> None:
    if args.csv:
        extra = [c.format(x) for x in args.impls for c in EXTRA_SUFFIXES]
        write_csv(args.csv, rows, COLUMNS + extra)
    if args.impl_csv:
        write_csv(args.impl_csv, impl_rows, IMPL_COLUMNS)


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
    p.add_argument("--no-cpu", action="store_true", help="skip the CPU rows")
    p.add_argument("--impls", nargs="+", choices=EXTRA_IMPLS, default=[], metavar="IMPL",
                   help="implementations measured beside eager and megaloss: "
                        + ", ".join(EXTRA_IMPLS) + " (see above)")
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend of megaloss_compile (default inductor; aot_eager "
                        "traces without generating code, for quick smoke runs)")
    p.add_argument("--impl-csv", metavar="PATH",
                   help="write the side-by-side table (one row per implementation) as CSV")
    dtypes = ("float32", "bfloat16", "float16")
    p.add_argument("--cpu-dtypes", nargs="+", choices=dtypes, default=["float32"],
                   help="dtypes of the CPU rows (default float32; float16 shows the deferred "
                        "fp16 schedule: one extra GEMM, see megaloss/ops/chunk_driver.py)")
    p.add_argument("--cuda-dtypes", nargs="+", choices=dtypes, default=["bfloat16"],
                   help="dtypes of the CUDA rows (default bfloat16)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per case")
    p.add_argument("--csv", metavar="PATH", help="write all columns as CSV")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of peak memory vs tokens")
    p.add_argument("--same-process", action="store_true",
                   help="run every case in this process, not a fresh process each (a smoke "
                        "run: gpu_check.sh --dry-run; the memory figures then include what "
                        "earlier cases left allocated, and the allocator settings of the "
                        "workers do not apply)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker:
        print(json.dumps(_worker(json.loads(args.worker))))
        return 0
    require_positive(p, args, ("hidden", "vocab", "chunk_size", "repeats", "threads"))
    if any(n < 1 for n in args.sizes):
        p.error("--sizes must be >= 1")

    args.impls = list(dict.fromkeys(args.impls))  # order kept, duplicates dropped
    script = os.path.abspath(__file__)
    methods = list(BASE_IMPLS) + args.impls
    rows, impl_rows, failed = [], [], False
    if args.same_process:
        print(f"# every case in this process, {args.threads} threads", file=sys.stderr)
    else:
        print(f"# workers: fresh process per case, {args.threads} threads, "
              + " ".join(f"{k}={v}" for k, v in MALLOC_ENV.items()), file=sys.stderr)
    for cfg in _configs(args):
        for n in args.sizes:
            res: Dict[str, Any] = {"memory": {}}
            for mode, method in _jobs(cfg, methods):
                spec = {**cfg, "mode": mode, "method": method, "methods": methods, "tokens": n,
                        "hidden": args.hidden, "vocab": args.vocab,
                        "chunk_size": args.chunk_size, "repeats": args.repeats,
                        "budget": args.time_budget, "threads": args.threads, "seed": args.seed,
                        "compile_backend": args.compile_backend}
                t0 = time.perf_counter()
                out = (_in_this_process(spec) if args.same_process
                       else run_worker(script, spec, args.threads, args.timeout))
                if mode == "memory":
                    res["memory"][method] = out
                else:
                    res["timing"] = out
                status = out.get("error", "ok")
                failed |= "error" in out
                print(f"# {cfg['device']} {cfg['dtype']} N={n} {mode} {method}: {status} "
                      f"({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
            # A loss that could run here but failed (not one that is missing) fails the run.
            failed |= any(note.startswith("failed")
                          for note in res["timing"].get("notes", {}).values())
            rows.append(_row(cfg, args, n, res))
            impl_rows += _impl_rows(cfg, args, n, res)
            _write_csvs(args, rows, impl_rows)  # after every size: a killed run keeps its rows

    print(f"linear + cross-entropy fwd+bwd, H={args.hidden}, V={args.vocab}, "
          f"chunk={args.chunk_size}; time = median seconds; MiB = extra peak memory above "
          f"inputs, weight and their grads; ratios = megaloss / eager; "
          f"roofline = time(3 bare GEMMs) / time(megaloss)")
    print(format_table(rows, TABLE_COLUMNS))
    if args.impls or args.impl_csv:
        print("\nside by side (ratios against eager; roofline = time(3 bare GEMMs) / time; "
              "epilogue = what megaloss ran after each chunk's GEMM):")
        print(format_table(impl_rows, IMPL_TABLE_COLUMNS))
    _write_csvs(args, rows, impl_rows)
    if args.plot:
        _plot(rows, args.plot)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
