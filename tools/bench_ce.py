#!/usr/bin/env python3
"""Benchmark: eager torch (``F.linear`` + ``F.cross_entropy``), torch's own chunked
``F.linear_cross_entropy`` and ``megaloss.linear_cross_entropy``.

For every token count N, on the same inputs (``hidden [N, H]``, ``weight [V, H]``, both requiring
grad, random labels; ``--ignore-every K`` sets every K-th label to -100), one forward+backward of
each loss is measured for

* extra peak memory: peak above the memory of inputs, weight and their (preallocated) ``.grad``
  buffers, one fresh process per loss and size running it once (method: ``tools/_bench_common.py``);
  on CUDA, where the allocator's peak statistic can be reset, the timing process measures it for
  each loss in turn instead, after one untimed run at the real size (one process per size: one
  start-up and one compile per size),
* time: in a third fresh process, ``--repeats`` rounds that each run every loss and the 3 bare
  GEMMs of the loss's shapes (``[N,H]x[H,V]``, ``[N,V]x[V,H]``, ``[V,N]x[N,H]``, 2*N*H*V FLOPs
  each), order rotated per round (fewer rounds once ``--time-budget`` seconds are spent). A
  time is the minimum over the rounds (load from other processes on a shared machine only ever
  adds time; the first round, at the real size, doubles as the warm-up) and every ratio
  (``time_ratio`` megaloss / eager, ``time_vs_*``, ``roofline`` GEMMs / loss) is a ratio of
  these minima,
* float64 error (CPU rows): the largest absolute difference of the loss (``loss_err``) and of the
  gradients wrt ``hidden`` and ``weight`` (``grad_err``, the larger of the two) from a float64
  reference (``F.linear`` + ``F.cross_entropy`` in float64, in blocks of tokens, in one more fresh
  process per size), taken in the memory process after its run.

fp32 on CPU always (unless ``--no-cpu``); bf16 on CUDA too when ``torch.cuda.is_available()``
(unless ``--no-cuda``). The eager baseline upcasts the logits to fp32 before the loss, as Hugging
Face's causal-LM loss does (a no-op in fp32). Every loss is warmed up once on ``min(N, chunk)``
tokens at the real H and V before any measurement (kernels compiled, autotuned, cached).

``--impls`` sets the implementations measured beside eager and megaloss, side by side in the same
processes and rounds, as extra columns and in a second table (one row per implementation, ratios
against eager and against torch's function; ``--impl-csv``):

* ``torch_lce`` / ``torch_lce_accurate`` (the default ``--impls``): torch's
  ``F.linear_cross_entropy`` (torch >= 2.13) with ``options=LinearCrossEntropyOptions()``
  (chunked; ``acc_policy`` and ``chunking_method`` "auto": on CPU fp32 and on CUDA "compact" with
  chunks of ``next_pow2(N / ceil(V / H)) / 2`` rows) and with
  ``LinearCrossEntropyOptions(acc_policy="accurate")``; the epilogue column shows the policy and
  chunk torch resolved;
* ``megaloss_torch`` / ``megaloss_triton``: megaloss with the epilogue forced
  (``CrossEntropyOptions(impl=...)``; plain ``megaloss`` is ``impl="auto"``: Triton on CUDA);
  ``megaloss_triton`` runs on CPU only under ``TRITON_INTERPRET=1`` (slowly);
* ``megaloss_compile``: megaloss with its torch chunk epilogue wrapped in
  ``torch.compile`` — the alternative to hand-written kernels;
* ``liger``: Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss``; ``cce``: Cut Cross-Entropy's
  ``linear_cross_entropy`` (Wijmans et al. 2024, arXiv:2411.09009) — CUDA only, and only when
  importable; otherwise their cells are empty and the note says why.

    python3 tools/bench_ce.py                        # H=1024, V=32000, N in {1024, 2048, 4096}
    python3 tools/bench_ce.py --sizes 2048 --csv ce.csv --plot ce.png
    python3 tools/bench_ce.py --no-cpu --sizes 8192 --hidden 4096 --vocab 151936 \
        --impls megaloss_torch megaloss_compile liger cce --impl-csv impls.csv
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_common import (  # noqa: E402
    MALLOC_ENV,
    MemoryProbe,
    add_process_arguments,
    answer_worker,
    format_table,
    mib,
    require_positive,
    run_in_this_process,
    run_worker,
    write_csv,
)

BASE_IMPLS = ("eager", "megaloss")
TORCH_IMPLS = ("torch_lce", "torch_lce_accurate")
EXTRA_IMPLS = TORCH_IMPLS + ("megaloss_torch", "megaloss_triton", "megaloss_compile", "liger",
                             "cce")

COLUMNS = ["device", "dtype", "tokens", "hidden", "vocab", "chunk_size", "threads",
           "eager_s", "megaloss_s", "time_ratio", "gemm3_s", "roofline", "eager_roofline",
           "eager_MiB", "megaloss_MiB", "mem_ratio", "repeats", "loss_eager", "loss_megaloss",
           "loss_abs_diff", "eager_loss_err", "eager_grad_err", "megaloss_loss_err",
           "megaloss_grad_err", "reduction", "ignore_every", "mem_method"]
TABLE_COLUMNS = ["device", "dtype", "tokens", "eager_s", "megaloss_s", "time_ratio", "gemm3_s",
                 "roofline", "eager_MiB", "megaloss_MiB", "mem_ratio", "loss_abs_diff"]
# Per extra implementation X: X_s, X_MiB, X_roofline, loss_X, X_loss_err, X_grad_err, X_note
# (appended to COLUMNS).
EXTRA_SUFFIXES = ("{}_s", "{}_MiB", "{}_roofline", "loss_{}", "{}_loss_err", "{}_grad_err",
                  "{}_note")
# The side-by-side table: one row per (device, dtype, tokens, implementation).
IMPL_COLUMNS = ["device", "dtype", "tokens", "hidden", "vocab", "impl", "epilogue", "time_s",
                "time_vs_eager", "time_vs_torch", "roofline", "extra_MiB", "mem_vs_eager",
                "mem_vs_torch", "loss", "loss_diff_vs_eager", "loss_err", "grad_err", "note"]
IMPL_TABLE_COLUMNS = ["device", "dtype", "tokens", "impl", "epilogue", "time_s", "time_vs_eager",
                      "time_vs_torch", "roofline", "extra_MiB", "mem_vs_eager", "mem_vs_torch",
                      "loss_err", "grad_err", "note"]


# worker (runs in a fresh process) ------------------------------------------------------------
def _loss_fns(methods: List[str], chunk: Optional[int], dev, compile_backend: str = "inductor",
              reduction: str = "mean") -> Tuple[Dict[str, Any], Dict[str, str]]:
    """``{method: fn(h, w, y) -> loss}`` for the methods that can run here, and ``{method: why
    not}`` for the others. ``chunk=None``: megaloss's own default chunk."""
    import torch.nn as nn
    import torch.nn.functional as F

    from megaloss import CrossEntropyOptions
    from megaloss.losses import linear_cross_entropy

    def forced(impl):
        opts = CrossEntropyOptions(chunk_size=chunk, impl=impl, reduction=reduction)
        return lambda h, w, y: linear_cross_entropy(h, w, y, options=opts)

    def torch_lce(**kwargs):
        if not hasattr(F, "linear_cross_entropy"):  # torch < 2.13
            raise ImportError("torch.nn.functional.linear_cross_entropy needs torch >= 2.13")
        opts = nn.LinearCrossEntropyOptions(**kwargs)
        return lambda h, w, y: F.linear_cross_entropy(h, w, y, reduction=reduction, options=opts)

    fns: Dict[str, Any] = {}
    notes: Dict[str, str] = {}
    for m in methods:
        if _cannot_run(m, dev.type):
            notes[m] = _cannot_run(m, dev.type)
            continue
        try:
            if m == "eager":
                fns[m] = lambda h, w, y: F.cross_entropy(F.linear(h, w).float(), y,
                                                         reduction=reduction)
            elif m == "megaloss":
                fns[m] = lambda h, w, y: linear_cross_entropy(h, w, y, chunk_size=chunk,
                                                              reduction=reduction)
            elif m == "torch_lce":
                fns[m] = torch_lce()
            elif m == "torch_lce_accurate":
                fns[m] = torch_lce(acc_policy="accurate")
            elif m == "megaloss_torch":
                fns[m] = forced("torch")
            elif m == "megaloss_triton":
                import triton  # noqa: F401  (a note, not a failure, when it is missing)
                fns[m] = forced("triton")
            elif m == "megaloss_compile":
                fns[m] = _compiled_megaloss(chunk, compile_backend, reduction)
            elif m == "liger":
                from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
                liger = LigerFusedLinearCrossEntropyLoss(reduction=reduction)
                fns[m] = lambda h, w, y, liger=liger: liger(w, h, y)  # Liger takes the weight first
            elif m == "cce":
                from cut_cross_entropy import linear_cross_entropy as cce
                fns[m] = lambda h, w, y: cce(h, w, y, reduction=reduction)
            else:
                notes[m] = "unknown implementation"
        except Exception as e:  # ImportError, or a broken install
            notes[m] = f"not importable: {type(e).__name__}: {e}"[:160]
    return fns, notes


def _torch_lce_plan(method: str, n: int, hidden: int, vocab: int, dev, dtype) -> str:
    """What torch's chunked path resolves its options to for these shapes: ``"<acc_policy>, chunk
    <rows>"`` (``LinearCrossEntropyOptions._adjust``, a private method: "" if it is gone)."""
    import torch.nn as nn
    try:
        opts = nn.LinearCrossEntropyOptions(
            **({"acc_policy": "accurate"} if method == "torch_lce_accurate" else {}))
        plan = opts._adjust(num_batches=n, in_features=hidden, num_classes=vocab, dtype=dtype,
                            device=dev)
        return f"{plan.acc_policy}, chunk {plan.batch_chunk_size}"
    except Exception:  # noqa: BLE001 - a label only
        return ""


def _cannot_run(method: str, device: str) -> str:
    """Why ``method`` cannot run on ``device`` whatever is installed ("" if it can)."""
    if device == "cuda":
        return ""
    if method in ("liger", "cce"):
        return "CUDA only"
    if method == "megaloss_triton" and os.environ.get("TRITON_INTERPRET") != "1":
        return "CUDA only (or CPU under TRITON_INTERPRET=1)"
    return ""


def _compiled_megaloss(chunk: Optional[int], backend: str, reduction: str = "mean"):
    """megaloss with ``torch.compile`` around its torch chunk epilogue (everything after the
    chunk's GEMM), swapped into the cross-entropy kernel only while this loss runs."""
    import torch

    from megaloss import CrossEntropyOptions
    from megaloss.losses import linear_cross_entropy
    from megaloss.ops import cross_entropy_chunk

    eager = cross_entropy_chunk.torch_epilogue
    compiled = torch.compile(eager, dynamic=False, backend=backend)
    opts = CrossEntropyOptions(chunk_size=chunk, impl="torch", reduction=reduction)

    def loss_fn(h, w, y):
        cross_entropy_chunk.torch_epilogue = compiled
        try:
            return linear_cross_entropy(h, w, y, options=opts)
        finally:
            cross_entropy_chunk.torch_epilogue = eager

    return loss_fn


def _inputs(spec: Dict[str, Any], dev, dtype):
    """``hidden [N, H]``, ``weight [V, H] * 0.02`` and ``labels [N]`` (every ``ignore_every``-th
    -100) from their own CPU generator: a function of ``spec`` alone (not of any warm-up), the
    same in every process of a size, and reproducible outside the tool."""
    import torch

    n, hidden, vocab = spec["tokens"], spec["hidden"], spec["vocab"]
    gen = torch.Generator().manual_seed(spec["seed"])
    h = torch.randn(n, hidden, generator=gen).to(dev, dtype)
    w = torch.randn(vocab, hidden, generator=gen).mul_(0.02).to(dev, dtype)
    y = torch.randint(0, vocab, (n,), generator=gen)
    if spec.get("ignore_every", 0):
        y[::spec["ignore_every"]] = -100
    return h, w, y.to(dev)


def _reference(spec: Dict[str, Any]) -> Dict[str, Any]:
    """The float64 loss and gradients of ``spec``'s inputs (``F.linear`` + ``F.cross_entropy``
    with ``spec["reduction"]``, in blocks of 1024 tokens so that the float64 logits stay small),
    saved to ``spec["reference"]`` for the memory processes to compare against."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(spec["threads"])
    h, w, y = _inputs(spec, torch.device("cpu"), torch.float64)
    h.requires_grad_()
    w.requires_grad_()
    loss = torch.zeros((), dtype=torch.float64)
    for start in range(0, h.shape[0], 1024):
        blk = slice(start, start + 1024)
        part = F.cross_entropy(F.linear(h[blk], w), y[blk], reduction="sum")
        part.backward()
        loss += part.detach()
    if spec["reduction"] == "mean":  # torch's mean: over the tokens not ignored
        count = int((y != -100).sum())
        scale = 1.0 / count if count else float("nan")
        loss, h.grad, w.grad = loss * scale, h.grad * scale, w.grad * scale
    torch.save({"loss": loss, "hidden": h.grad, "weight": w.grad}, spec["reference"])
    return {"loss": float(loss)}


def _errors(spec: Dict[str, Any], loss, h, w) -> Dict[str, float]:
    """Largest absolute differences of the loss and of ``h.grad`` / ``w.grad`` (the larger of
    the two) from the float64 reference that ``spec["reference"]`` names (``{}`` if none)."""
    import torch

    if not spec.get("reference") or not os.path.exists(spec["reference"]):
        return {}
    ref = torch.load(spec["reference"])
    grad_err = max(float((g.detach().cpu().double() - ref[k]).abs().max())
                   if g.numel() else 0.0
                   for g, k in ((h.grad, "hidden"), (w.grad, "weight")))
    return {"loss_err": abs(float(loss.detach().double()) - float(ref["loss"])),
            "grad_err": grad_err}


def _worker(spec: Dict[str, Any]) -> Dict[str, Any]:
    """``mode="memory"``: one fwd+bwd of ``spec["method"]`` under the memory probe, then its
    float64 error. ``mode="timing"``: warm runs of every method and the 3 bare GEMMs,
    interleaved; on CUDA first one fwd+bwd of each under the memory probe.
    ``mode="reference"``: :func:`_reference`."""
    import gc

    import torch

    from megaloss import CrossEntropyOptions
    from megaloss.ops.chunk_driver import auto_chunk_size
    from megaloss.ops.cross_entropy_chunk import epilogue_impl

    if spec["mode"] == "reference":
        return _reference(spec)
    torch.set_num_threads(spec["threads"])
    torch.manual_seed(spec["seed"])
    dev, dtype = torch.device(spec["device"]), getattr(torch, spec["dtype"])
    n, hidden, vocab, chunk = spec["tokens"], spec["hidden"], spec["vocab"], spec["chunk_size"]
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    methods = [spec["method"]] if spec["mode"] == "memory" else list(spec["methods"])
    fns, notes = _loss_fns(methods, chunk, dev, spec.get("compile_backend", "inductor"),
                           spec.get("reduction", "mean"))

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
    # pool, cuBLAS workspace, compiled and autotuned kernels) is in the baseline. torch's function
    # warms up on 2 tokens: its chunks number about 2 V / H whatever N (64 here), each reading
    # and updating [V, H] buffers, so 512 tokens would cost it a full-size run on the CPU; its
    # lazy state (the custom op, torch._dynamo) does not depend on the shape.
    n_warm = min(n, chunk or auto_chunk_size(n, vocab, hidden))
    hw = torch.randn(n_warm, hidden, device=dev, dtype=dtype, requires_grad=True)
    ww = (torch.randn(vocab, hidden, device=dev, dtype=dtype) * 0.02).requires_grad_()
    yw = torch.randint(0, vocab, (n_warm,), device=dev)
    for m in list(fns):
        k = min(2, n_warm) if m in TORCH_IMPLS else n_warm
        try:
            run(m, hw[:k].detach().requires_grad_(), ww, yw[:k])
        except Exception as e:  # e.g. megaloss_triton on CPU without the interpreter
            notes[m] = f"failed: {type(e).__name__}: {e}"[:160]
            del fns[m]
    if spec["mode"] == "timing":
        gemm3(hw, ww, yw)
    del hw, ww, yw
    sync()

    h, w, y = _inputs(spec, dev, dtype)
    h.requires_grad_()
    w.requires_grad_()
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
                "mem_method": probe.method, "baseline_slack": probe.baseline_slack,
                "loss_tensor": loss.detach()}

    if spec["mode"] == "memory":
        if spec["method"] not in fns:
            return {"note": notes.get(spec["method"], "not run")}
        out = measure_memory(spec["method"])
        loss = out.pop("loss_tensor")
        return {**out, **_errors(spec, loss, h, w)}  # h.grad, w.grad: this one run's

    memory: Dict[str, Dict[str, Any]] = {}
    if dev.type == "cuda":  # allocator statistics: one process measures every method in turn
        for m in list(fns):
            try:
                run(m, h, w, y)  # at the real N first: kernels autotuned on N are tuned now
                sync()
                gc.collect()
                memory[m] = measure_memory(m)
                del memory[m]["loss_tensor"]
            except Exception as e:
                notes[m] = f"failed: {type(e).__name__}: {e}"[:160]
                del fns[m]
            gc.collect()

    # Interleaved rounds (order rotated each round) so that all methods see the same machine
    # load; the driver takes the minimum of each method's rounds.
    order = list(fns) + ["gemm3"]
    timed = {**{m: (lambda m=m: run(m, h, w, y)) for m in fns}, "gemm3": lambda: gemm3(h, w, y)}
    times: Dict[str, List[float]] = {m: [] for m in order}
    spent = 0.0
    for r in range(spec["repeats"]):
        k = r % len(order)
        for m in order[k:] + order[:k]:
            sync()
            t0 = time.perf_counter()
            timed[m]()
            sync()
            dt = time.perf_counter() - t0
            times[m].append(dt)
            spent += dt
        if spent >= spec["budget"]:
            break
    plans = {m: _torch_lce_plan(m, n, hidden, vocab, dev, dtype) for m in fns if m in TORCH_IMPLS}
    return {"times": times, "memory": memory, "notes": notes, "epilogue": epilogue,
            "plans": plans, "chunk": chunk or auto_chunk_size(n, vocab, hidden)}


# driver ---------------------------------------------------------------------------------------
def _configs(args) -> List[Dict[str, str]]:
    configs = [] if args.no_cpu else [{"device": "cpu", "dtype": d} for d in args.cpu_dtypes]
    if not args.no_cuda:
        import torch  # only here: the driver stays small otherwise
        if torch.cuda.is_available():
            configs += [{"device": "cuda", "dtype": d} for d in args.cuda_dtypes]
    return configs


def _jobs(cfg: Dict[str, str], methods: List[str], error: bool) -> List[Tuple[str, str]]:
    """CPU: the float64 reference (when ``error``), a fresh process per method for its memory
    and float64 error, then one timing process for all. CUDA: the timing process measures the
    memory too (allocator statistics reset per method); no float64 error."""
    if cfg["device"] == "cuda":
        return [("timing", "all")]
    reference = [("reference", "float64")] if error else []
    memory = [("memory", m) for m in methods if not _cannot_run(m, cfg["device"])]
    return reference + memory + [("timing", "all")]


def _stats(res: Dict[str, Any], m: str) -> Dict[str, Any]:
    """What is known of method ``m``: time (minimum over the rounds), ratios of minima, memory,
    loss, float64 errors, note."""
    timing = res["timing"]
    times = timing.get("times", {})
    mem = res.get("memory", {}).get(m) or timing.get("memory", {}).get(m) or {}

    def paired(a, b):  # min time(a) / min time(b), over the same interleaved rounds
        return _fastest(times, a) / _fastest(times, b)

    note = timing.get("notes", {}).get(m) or mem.get("note") or mem.get("error") or ""
    if not note and "error" in timing:
        note = f"timing: {timing['error']}"
    return {"s": _fastest(times, m), "vs_eager": paired(m, "eager"),
            "vs_torch": paired(m, "torch_lce"), "roofline": paired("gemm3", m),
            "MiB": mib(mem["extra_bytes"]) if "extra_bytes" in mem else math.nan,
            "loss": mem.get("loss", math.nan), "loss_err": mem.get("loss_err", math.nan),
            "grad_err": mem.get("grad_err", math.nan), "note": note,
            "mem_method": mem.get("mem_method", ""), "repeats": len(times.get(m, []))}


def _fastest(times: Dict[str, List[float]], m: str) -> float:
    """The minimum of ``m``'s round times (NaN when it has none)."""
    return min(times.get(m) or [math.nan])


def _chunk(args, res: Dict[str, Any]) -> Any:
    """megaloss's chunk: ``--chunk-size``, else the default the timing process resolved."""
    return args.chunk_size or res["timing"].get("chunk", "")


def _row(cfg: Dict[str, str], args, n: int, res: Dict[str, Any]) -> Dict[str, Any]:
    e, m = _stats(res, "eager"), _stats(res, "megaloss")
    times = res["timing"].get("times", {})
    row = {
        **cfg, "tokens": n, "hidden": args.hidden, "vocab": args.vocab,
        "chunk_size": _chunk(args, res), "threads": args.threads,
        "eager_s": e["s"], "megaloss_s": m["s"],
        "time_ratio": m["vs_eager"],
        "gemm3_s": _fastest(times, "gemm3"), "roofline": m["roofline"],
        "eager_roofline": e["roofline"],
        "eager_MiB": e["MiB"], "megaloss_MiB": m["MiB"],
        "mem_ratio": m["MiB"] / e["MiB"] if e["MiB"] > 0 else math.nan,
        "repeats": m["repeats"],
        "loss_eager": e["loss"], "loss_megaloss": m["loss"],
        "loss_abs_diff": abs(e["loss"] - m["loss"]),
        "eager_loss_err": e["loss_err"], "eager_grad_err": e["grad_err"],
        "megaloss_loss_err": m["loss_err"], "megaloss_grad_err": m["grad_err"],
        "reduction": args.reduction, "ignore_every": args.ignore_every,
        "mem_method": m["mem_method"],
    }
    for x in args.impls:
        st = _stats(res, x)
        row.update({f"{x}_s": st["s"], f"{x}_MiB": st["MiB"], f"{x}_roofline": st["roofline"],
                    f"loss_{x}": st["loss"], f"{x}_loss_err": st["loss_err"],
                    f"{x}_grad_err": st["grad_err"], f"{x}_note": st["note"]})
    return row


def _impl_rows(cfg: Dict[str, str], args, n: int, res: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The side-by-side table: one row per implementation, ratios against eager and against
    torch's ``F.linear_cross_entropy`` with its default options (``torch_lce``)."""
    e, t = _stats(res, "eager"), _stats(res, "torch_lce")
    rows = []
    for x in list(BASE_IMPLS) + list(args.impls):
        st = _stats(res, x)
        epilogue = {"megaloss": res["timing"].get("epilogue", ""), "megaloss_torch": "torch",
                    "megaloss_triton": "triton", "megaloss_compile": "torch.compile",
                    **res["timing"].get("plans", {})}.get(x, "")
        rows.append({**cfg, "tokens": n, "hidden": args.hidden, "vocab": args.vocab, "impl": x,
                     "epilogue": epilogue, "time_s": st["s"], "time_vs_eager": st["vs_eager"],
                     "time_vs_torch": st["vs_torch"], "roofline": st["roofline"],
                     "extra_MiB": st["MiB"],
                     "mem_vs_eager": st["MiB"] / e["MiB"] if e["MiB"] > 0 else math.nan,
                     "mem_vs_torch": st["MiB"] / t["MiB"] if t["MiB"] > 0 else math.nan,
                     "loss": st["loss"], "loss_diff_vs_eager": abs(st["loss"] - e["loss"]),
                     "loss_err": st["loss_err"], "grad_err": st["grad_err"],
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
                 f"megaloss chunk={r0['chunk_size']}")
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
    p.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096],
                   help="token counts N (default: 1024 2048 4096)")
    p.add_argument("--hidden", type=int, default=1024, help="hidden size H (default 1024)")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary size V (default 32000)")
    p.add_argument("--chunk-size", type=int, default=None,
                   help="megaloss's chunk (default: megaloss's own, auto_chunk_size: 512 "
                        "tokens at the default shapes)")
    p.add_argument("--reduction", choices=("mean", "sum"), default="mean",
                   help="reduction of every loss (default mean)")
    p.add_argument("--ignore-every", type=int, default=0, metavar="K",
                   help="set every K-th label to -100 (ignored by every loss; default 0: none)")
    p.add_argument("--no-error", action="store_true",
                   help="skip the float64 reference (its own process per size: about twice "
                        "the 3 GEMMs' fp32 time) and the loss_err / grad_err columns")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed rounds per size, the minimum taken (default 3)")
    p.add_argument("--time-budget", type=float, default=60.0,
                   help="stop adding rounds for a size once its timed runs took this many "
                        "seconds (at least one round; default 60)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="torch threads per worker (default: all CPUs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-cuda", action="store_true", help="skip the CUDA rows")
    p.add_argument("--no-cpu", action="store_true", help="skip the CPU rows")
    p.add_argument("--impls", nargs="*", choices=EXTRA_IMPLS, default=list(TORCH_IMPLS),
                   metavar="IMPL",
                   help="implementations measured beside eager and megaloss: "
                        + ", ".join(EXTRA_IMPLS) + " (see above; default: "
                        + " ".join(TORCH_IMPLS) + "; none: eager and megaloss only)")
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
    p.add_argument("--csv", metavar="PATH", help="write all columns as CSV")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of peak memory vs tokens")
    add_process_arguments(p)  # gpu_check.sh --dry-run passes --same-process
    args = p.parse_args(argv)

    if answer_worker(args, _worker):
        return 0
    require_positive(p, args, ("hidden", "vocab", "repeats", "threads"))
    if args.chunk_size is not None and args.chunk_size < 1:
        p.error("--chunk-size must be >= 1")
    if args.ignore_every < 0:
        p.error("--ignore-every must be >= 0")
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
    tmp = tempfile.TemporaryDirectory(prefix="bench_ce_")
    for cfg in _configs(args):
        for n in args.sizes:
            res: Dict[str, Any] = {"memory": {}}
            reference = os.path.join(tmp.name, f"reference_{cfg['dtype']}_{n}.pt")
            for mode, method in _jobs(cfg, methods, error=not args.no_error):
                spec = {**cfg, "mode": mode, "method": method, "methods": methods, "tokens": n,
                        "hidden": args.hidden, "vocab": args.vocab,
                        "chunk_size": args.chunk_size, "repeats": args.repeats,
                        "budget": args.time_budget, "threads": args.threads, "seed": args.seed,
                        "compile_backend": args.compile_backend, "reduction": args.reduction,
                        "ignore_every": args.ignore_every,
                        "reference": "" if args.no_error else reference}
                t0 = time.perf_counter()
                out = (run_in_this_process(_worker, spec) if args.same_process
                       else run_worker(script, spec, args.threads, args.timeout))
                if mode == "memory":
                    res["memory"][method] = out
                elif mode == "timing":
                    res["timing"] = out
                status = out.get("error", "ok")
                failed |= "error" in out
                print(f"# {cfg['device']} {cfg['dtype']} N={n} {mode} {method}: {status} "
                      f"({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
            # A loss that could run here but failed (not one that is missing) fails the run.
            failed |= any(note.startswith("failed")
                          for note in res["timing"].get("notes", {}).values())
            if os.path.exists(reference):
                os.remove(reference)  # V x H float64: hundreds of MiB
            rows.append(_row(cfg, args, n, res))
            impl_rows += _impl_rows(cfg, args, n, res)
            _write_csvs(args, rows, impl_rows)  # after every size: a killed run keeps its rows
    tmp.cleanup()

    chunk = args.chunk_size or "megaloss's default"
    print(f"linear + cross-entropy fwd+bwd, H={args.hidden}, V={args.vocab}, "
          f"reduction={args.reduction}, ignore_every={args.ignore_every}, chunk={chunk}; "
          f"time = min seconds over the rounds; MiB = extra peak memory above inputs, weight "
          f"and their grads; ratios = megaloss / eager; roofline = time(3 bare GEMMs) / "
          f"time(megaloss)")
    print(format_table(rows, TABLE_COLUMNS))
    if args.impls or args.impl_csv:
        print("\nside by side (ratios against eager and against torch's F.linear_cross_entropy "
              "with its default options, torch_lce; roofline = time(3 bare GEMMs) / time; "
              "epilogue = what megaloss ran after each chunk's GEMM, or the acc_policy and "
              "chunk torch resolved; loss_err / grad_err = max abs difference from float64):")
        print(format_table(impl_rows, IMPL_TABLE_COLUMNS))
    _write_csvs(args, rows, impl_rows)
    if args.plot:
        _plot(rows, args.plot)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
