#!/usr/bin/env python3
"""Benchmark: the lm_head + cross-entropy forward+backward under PyTorch's own parallel APIs on a
2-rank CPU mesh (gloo, fp32), megaloss against the plain torch way, side by side in one run.

Layouts (one ``torch.distributed.device_mesh.init_device_mesh("cpu", (2,))`` per set of ranks):

* ``fsdp2`` (data parallel, world 2): the lm_head weight ``[V, H]`` sharded by FSDP2's
  ``fully_shard`` (``torch/distributed/fsdp/_fully_shard/_fully_shard.py``; ``Shard(0)`` rows
  per rank, all-gathered in the unit's forward, its gradient reduce-scattered in backward);
  each rank computes the mean CE of its own ``N`` tokens.

  - ``megaloss``: megaloss's head module owning the weight,
    :class:`megaloss.integrations.hf.causal_lm.LinearCrossEntropyHead` (``megaloss/integrations/hf/
    causal_lm.py``; ``CrossEntropyOptions(chunk_size=--chunk-size)``), as the FSDP unit: the
    chunked CE runs inside the FSDP-managed forward, where the weight is unsharded (the layout
    ``tests/integrations/test_fsdp2_head.py`` checks against float64);
  - ``torch``: ``nn.Linear(H, V, bias=False)`` as the FSDP unit, ``F.cross_entropy`` on its
    full ``[N, V]`` logits.

* ``tp2`` (tensor parallel, TP 2): ``parallelize_module(lm_head, mesh, ColwiseParallel())``
  (``torch/distributed/tensor/parallel/style.py``) splits the weight over the vocabulary
  (``Shard(0)``); both ranks hold the same ``N`` tokens.

  - ``megaloss``: ``w, opts = VocabParallelOptions.from_dtensor(lm_head.weight)``
    (``megaloss/losses/vocab_parallel.py``, ``megaloss/parallel/dtensor.py``), then
    ``linear_cross_entropy(hidden, w, labels, vocab_parallel_options=opts)``: chunked,
    ``[chunk, V / 2]`` logits per rank;
  - ``torch``: ``ColwiseParallel(use_local_output=False)``, whose output is the DTensor logits
    ``[N, V]`` ``Shard(-1)``, and ``F.cross_entropy`` on them inside ``with loss_parallel():``
    (``torch/distributed/tensor/parallel/loss.py``), torch's vocab-parallel CE.

Inputs, a function of ``--seed`` alone (one CPU generator, in this order): ``hidden [2N, H]``,
``weight [V, H] * 0.02``, ``labels [2N]``. Under ``fsdp2`` rank ``r`` takes rows
``[r N, (r+1) N)``; under ``tp2`` both ranks take rows ``[0, N)``.

Measured (method of ``tools/_bench_common.py``): extra peak memory per rank (max over ranks)
above the inputs, the weight shard and the preallocated gradients (the hidden states' ``.grad``,
and the sharded weight's ``.grad`` DTensor left by a warm-up step at 64 tokens, into which the
measured step accumulates), one fresh set of 2 processes per method running it once. It counts
what the parallel API allocates inside the step: FSDP2's unsharded weight (``[V, H]``, kept from
forward to backward by the root unit) and its unsharded gradient before the reduce-scatter, the
same for both methods. Time: the median over ``--repeats`` rounds (both methods in the same
processes, order rotated, a barrier before each run; the max over ranks) in another fresh set of
processes, every method warmed up first. ``time_ratio`` / ``mem_ratio`` are megaloss's figure
over the row's, per layout. ``loss_err`` / ``grad_err``: max over ranks of the max abs difference
of the loss and of its gradient wrt the rank's ``hidden`` from a float64 full-logits reference
(the mean CE of the rank's rows) computed once in the parent. ``weight_rows`` (CSV): the rows of
the weight's local shard on each rank, outside the step (``V / 2`` each: the weight really is
sharded; a weight that is not a DTensor is an error).

    python3 tools/bench_fsdp.py                          # N 4096, H 1024, V 32000, fp32
    python3 tools/bench_fsdp.py --sizes 256 --hidden 64 --vocab 1000 --chunk-size 64
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
    budget_spent,
    finish,
    format_table,
    median,
    mib,
    require_positive,
)

WORLD = 2
LAYOUTS = ("fsdp2", "tp2")
# (layout, method, what runs)
CASES = (
    ("fsdp2", "megaloss", "fully_shard(LinearCrossEntropyHead): chunked CE in the FSDP forward"),
    ("fsdp2", "torch", "fully_shard(nn.Linear) + F.cross_entropy(full logits)"),
    ("tp2", "megaloss", "ColwiseParallel + VocabParallelOptions.from_dtensor"),
    ("tp2", "torch", "ColwiseParallel(use_local_output=False) + loss_parallel()"),
)
COLUMNS = ["layout", "world", "tokens", "hidden", "vocab", "method", "time_s", "extra_MiB",
           "time_ratio", "mem_ratio", "loss_err", "grad_err", "weight_rows", "function", "repeats",
           "error"]
TABLE_COLUMNS = ["layout", "method", "time_s", "extra_MiB", "time_ratio", "mem_ratio",
                 "loss_err", "grad_err", "function"]


def _cases(layout: str) -> List[str]:
    """``"layout/method"`` keys of ``layout``."""
    return [f"{lay}/{m}" for lay, m, _ in CASES if lay == layout]


def _inputs(n: int, hidden: int, vocab: int, seed: int):
    """``h [2N, H]``, ``w [V, H] * 0.02``, ``y [2N]``, drawn in that order from one CPU
    generator."""
    import torch
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(WORLD * n, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g).mul_(0.02)
    y = torch.randint(0, vocab, (WORLD * n,), generator=g)
    return h, w, y


def _rows(layout: str, rank: int, n: int) -> slice:
    """The rows of ``hidden`` / ``labels`` this rank computes the loss of."""
    return slice(rank * n, (rank + 1) * n) if layout == "fsdp2" else slice(0, n)


def _build(case: str, w, mesh, chunk):
    """``fn(h, y) -> scalar loss`` of ``case`` on a module holding ``w``'s rows as the layout
    shards them (the full ``w`` is not kept)."""
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        loss_parallel,
        parallelize_module,
    )

    import megaloss
    from megaloss import CrossEntropyOptions
    from megaloss.integrations.hf.causal_lm import LinearCrossEntropyHead

    layout, method = case.split("/")
    vocab, hidden = w.shape
    linear = nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        linear.weight.copy_(w)
    if layout == "fsdp2":
        if method == "megaloss":
            head = LinearCrossEntropyHead(linear, CrossEntropyOptions(chunk_size=chunk))
            fully_shard(head, mesh=mesh)

            def fn(h, y):
                return head(h, y).loss
        else:
            head = fully_shard(linear, mesh=mesh)

            def fn(h, y):
                return F.cross_entropy(head(h), y)
        return fn, head
    if method == "megaloss":
        head = parallelize_module(linear, mesh, ColwiseParallel())

        def fn(h, y):
            ws, opts = megaloss.VocabParallelOptions.from_dtensor(head.weight)
            return megaloss.linear_cross_entropy(h, ws, y, chunk_size=chunk,
                                                 vocab_parallel_options=opts)
        return fn, head
    head = parallelize_module(linear, mesh, ColwiseParallel(use_local_output=False))

    class _LossParallel:
        """The loss under ``loss_parallel()``; its ``backward`` runs there too (the context
        must cover the backward of the DTensor CE, torch's docs)."""

        def __init__(self, loss):
            self.loss = loss

        def backward(self):
            with loss_parallel():
                self.loss.backward()

        def detach(self):
            loss = self.loss.detach()
            return loss.full_tensor() if isinstance(loss, DTensor) else loss

    def fn(h, y):
        with loss_parallel():
            return _LossParallel(F.cross_entropy(head(h), y))
    return fn, head


def _rank(rank: int, world: int, spec: Dict[str, Any]) -> Dict[str, Any]:
    """One rank (``megaloss.testing.run_distributed``, gloo initialised). ``mode="memory"``:
    one fwd+bwd of ``spec["case"]`` under the memory probe; ``"timing"``: interleaved rounds."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    n, hidden, vocab, chunk = spec["tokens"], spec["hidden"], spec["vocab"], spec["chunk_size"]
    layout = spec["layout"]
    cases = [spec["case"]] if spec["mode"] == "memory" else list(spec["cases"])
    mesh = init_device_mesh("cpu", (world,))
    h, w, y = _inputs(n, hidden, vocab, spec["seed"])
    rows = _rows(layout, rank, n)
    h, y = h[rows].clone(), y[rows].clone()
    built = {k: _build(k, w, mesh, chunk) for k in cases}
    del w
    fns = {k: fn for k, (fn, _) in built.items()}
    modules = {k: m for k, (_, m) in built.items()}

    small_n = min(n, 64)  # warm-up: lazily created state, and the weights' .grad DTensors
    small_h = torch.randn(small_n, hidden, generator=torch.Generator().manual_seed(1))
    small_y = torch.randint(0, vocab, (small_n,), generator=torch.Generator().manual_seed(2))
    for k in cases:
        fns[k](small_h.clone().requires_grad_(), small_y).backward()
    del small_h, small_y
    h.requires_grad_()
    h.grad = torch.zeros_like(h)
    for m in modules.values():
        for p in m.parameters():
            if p.grad is not None:
                p.grad.zero_()
    gc.collect()
    dist.barrier()
    if spec["mode"] == "memory":
        probe = MemoryProbe("cpu")
        probe.start()
        loss = fns[cases[0]](h, y)
        loss.backward()
        extra = probe.peak_above_baseline()
        weight = next(modules[cases[0]].parameters())
        return {"extra_bytes": extra, "loss": float(loss.detach()), "mem_method": probe.method,
                "grad_h": h.grad.clone(), "weight_type": type(weight).__name__,
                "weight_local_rows": int(weight.to_local().shape[0])}
    times: Dict[str, List[float]] = {k: [] for k in cases}
    spent = 0.0
    for r in range(spec["repeats"]):
        for k in cases[r % len(cases):] + cases[:r % len(cases)]:
            h.grad = None
            modules[k].zero_grad(set_to_none=True)
            dist.barrier()
            t0 = time.perf_counter()
            fns[k](h, y).backward()
            times[k].append(time.perf_counter() - t0)
            spent += times[k][-1]
        if budget_spent(spent, spec["time_budget"]):  # agreed: every rank stops alike
            break
    return {"times": times}


def reference(n: int, hidden: int, vocab: int, seed: int) -> List[Any]:
    """float64 full-logits mean CE and its gradient wrt the hidden rows, per rank's rows of the
    ``fsdp2`` layout (rank 0's rows are also the ``tp2`` rows)."""
    import torch
    import torch.nn.functional as F
    h, w, y = _inputs(n, hidden, vocab, seed)
    h, w = h.double(), w.double()
    out = []
    for r in range(WORLD):
        rows = slice(r * n, (r + 1) * n)
        hr = h[rows].clone().requires_grad_()
        loss = F.cross_entropy(hr @ w.t(), y[rows])
        (g,) = torch.autograd.grad(loss, hr)
        out.append((float(loss.detach()), g))
        del loss, hr
    return out


def _layout_rows(args, layout: str, n: int, ref: List[Any]) -> List[Dict[str, Any]]:
    from megaloss.testing import run_distributed
    threads = max(1, args.cpus // WORLD)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    spec = {"layout": layout, "tokens": n, "hidden": args.hidden, "vocab": args.vocab,
            "chunk_size": args.chunk_size, "seed": args.seed, "repeats": args.repeats,
            "time_budget": args.time_budget}
    cases = _cases(layout)
    memory: Dict[str, Any] = {}
    for k in cases:
        try:
            memory[k] = run_distributed(_rank, WORLD, dict(spec, mode="memory", case=k),
                                        timeout=args.timeout, threads_per_rank=threads)
        except Exception as e:  # noqa: BLE001 - a failed case is a row with its error
            last = (str(e).strip().splitlines() or [""])[-1]
            memory[k] = [{"error": f"{type(e).__name__}: {last}"}]
    try:
        timing = run_distributed(_rank, WORLD, dict(spec, mode="timing", cases=cases),
                                 timeout=args.timeout, threads_per_rank=threads)
        times = {k: max(median(r["times"][k]) for r in timing) for k in cases}
        repeats = {k: min(len(r["times"][k]) for r in timing) for k in cases}
        time_error = ""
    except Exception as e:  # noqa: BLE001
        last = (str(e).strip().splitlines() or [""])[-1]
        times, repeats = {k: math.nan for k in cases}, {k: 0 for k in cases}
        time_error = f"timing: {type(e).__name__}: {last}"
    functions = {f"{lay}/{m}": f for lay, m, f in CASES}
    rows = []
    for k in cases:
        method = k.split("/")[1]
        ranks = memory[k]
        err = next((r["error"] for r in ranks if r.get("error")), "") or time_error
        if not err and any(r["weight_type"] != "DTensor" for r in ranks):
            err = f"the weight is a {ranks[0]['weight_type']}, not a sharded DTensor"
        extra = max((r.get("extra_bytes", math.nan) for r in ranks), default=math.nan)
        loss_err = grad_err = math.nan
        if not any(r.get("error") for r in ranks):
            refs = [ref[rank] if layout == "fsdp2" else ref[0] for rank in range(WORLD)]
            loss_err = max(abs(r["loss"] - rf[0]) for r, rf in zip(ranks, refs))
            grad_err = max(float((r["grad_h"].double() - rf[1]).abs().max())
                           for r, rf in zip(ranks, refs))
        rows.append({"layout": layout, "world": WORLD, "tokens": n, "hidden": args.hidden,
                     "vocab": args.vocab, "method": method, "time_s": times[k],
                     "extra_MiB": mib(extra), "_bytes": extra, "loss_err": loss_err,
                     "grad_err": grad_err,
                     "weight_rows": "/".join(str(r.get("weight_local_rows", "")) for r in ranks),
                     "function": functions[k], "repeats": repeats[k],
                     "error": err})
    mega = next(r for r in rows if r["method"] == "megaloss")
    for r in rows:
        r["time_ratio"] = mega["time_s"] / r["time_s"] if r["time_s"] else math.nan
        r["mem_ratio"] = mega["_bytes"] / r["_bytes"] if r["_bytes"] else math.nan
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[4096],
                   help="tokens N per rank (default 4096)")
    p.add_argument("--hidden", type=int, default=1024, help="hidden size H (default 1024)")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary V (default 32000)")
    p.add_argument("--chunk-size", type=int, default=None,
                   help="megaloss chunk (default: megaloss's own, auto_chunk_size)")
    p.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS),
                   help="which layouts (default both)")
    p.add_argument("--repeats", type=int, default=2, help="timed rounds (default 2)")
    p.add_argument("--time-budget", type=float, default=120.0,
                   help="stop repeating once a rank's timed runs took this long (default 120 s)")
    p.add_argument("--cpus", type=int, default=os.cpu_count() or 1,
                   help="cores shared by the 2 ranks: each gets max(1, cpus // 2) threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per set of ranks")
    p.add_argument("--no-cuda", action="store_true",
                   help="accepted for the tools' common CLI; this tool runs on CPU only")
    p.add_argument("--csv", metavar="PATH", help="write every column as CSV")
    args = p.parse_args(argv)
    require_positive(p, args, ("hidden", "vocab", "repeats", "cpus"))
    if args.chunk_size is not None and args.chunk_size < 1:
        p.error("--chunk-size must be >= 1")
    if any(s < 1 for s in args.sizes):
        p.error("--sizes must be >= 1")
    if args.vocab < WORLD:
        p.error(f"--vocab must be >= {WORLD} (one row per rank at least)")
    os.environ.update(MALLOC_ENV)  # inherited by the spawned ranks
    rows: List[Dict[str, Any]] = []
    for n in args.sizes:
        t0 = time.perf_counter()
        ref = reference(n, args.hidden, args.vocab, args.seed)
        for layout in args.layouts:
            rows += _layout_rows(args, layout, n, ref)
            print(f"# N={n} {layout}: done ({time.perf_counter() - t0:.1f} s)", file=sys.stderr,
                  flush=True)
        del ref
    import torch
    print(f"lm_head + CE fwd+bwd under torch {torch.__version__}'s FSDP2 / DTensor TP on "
          f"{WORLD} gloo ranks, CPU fp32, H={args.hidden}, V={args.vocab}, "
          f"chunk={args.chunk_size or 'megaloss default'}, {args.cpus} cores shared by the "
          f"ranks; extra_MiB = per-rank "
          f"peak above inputs, weight shard and grads (max over ranks); *_ratio = megaloss / "
          f"this row; *_err = max abs diff from float64 (max over ranks)")
    for n in args.sizes:
        print(f"\nN={n} tokens per rank")
        print(format_table([r for r in rows if r["tokens"] == n], TABLE_COLUMNS))
    errors = [f"N={r['tokens']} {r['layout']}/{r['method']}: {r['error']}" for r in rows
              if r["error"]]
    return finish(errors, args.csv, rows, COLUMNS)


if __name__ == "__main__":
    sys.exit(main())
