#!/usr/bin/env python3
"""Benchmark: megaloss against DeepSpeed's own fused / vocab-parallel losses, side by side in one
run, per tensor-parallel size (CPU, fp32, spawned gloo ranks; TP 1 is one such rank).

DeepSpeed 0.19.8's native functions measured (read in the installed package):

* ``deepspeed/sequence/linear_cross_entropy.py``: ``vocab_parallel_linear_cross_entropy``
  (lm_head + CE fused, token chunks in forward, logits recomputed in vocab blocks in backward;
  its default chunk keeps an fp32 block about the size of ``hidden``, ``--ds-chunk-size`` sets
  it, megaloss's is ``--chunk-size`` tokens);
* ``deepspeed/sequence/vocab_parallel_ops.py``: ``vocab_parallel_logprobs``,
  ``vocab_parallel_entropy`` and ``vocab_parallel_kl_div`` on vocab-sharded *logits* (the head's
  ``hidden @ weight_shard.T`` is formed by the caller, so its ``[N, V / TP]`` logits and their
  gradient are part of the figure);
* ``deepspeed/runtime/chunked_cross_entropy.py``: ``install_chunked_causal_lm_loss(model)`` sets
  a Hugging Face model's ``loss_function`` to ``ChunkedCausalLMLoss``, a CE over the full logits
  the model produced (no TP). The tool calls that object directly on ``hidden @ weight.T`` (no
  model needed) with ``backend="torch"``: its ``"auto"`` backend is a Triton kernel on CUDA only.

Tasks (one row per method; inputs a function of ``--seed`` alone, identical on every rank:
``hidden [N, H]``, ``weight [V, H] * 0.02``, teacher ``[N, H]`` and ``[V, H] * 0.05``, labels,
per-token ``a, c`` uniform in [0.5, 1.5)); each runs forward + backward:

* ``ce``: mean CE. ``megaloss`` (``linear_cross_entropy``), ``deepspeed``
  (``vocab_parallel_linear_cross_entropy``), ``ds_autotp`` (``deepspeed/sequence/
  cross_entropy.py``'s ``vocab_parallel_cross_entropy`` on the head's vocab-sharded logits: the
  loss AutoTP installs with ``vocab_parallel_lm_head``), at TP 1 also ``eager`` (full logits,
  ``F.cross_entropy``) and ``ds_chunked_lm`` (``ChunkedCausalLMLoss``, torch backend);
* ``lp``: ``mean(a * log_probs + c * entropy)``: ``megaloss`` (``linear_log_probs(...,
  return_entropy=True)``) vs ``deepspeed`` (``vocab_parallel_logprobs`` +
  ``vocab_parallel_entropy`` on the logits);
* ``kd_fwd`` / ``kd_rev``: mean per-token ``KL(teacher || student)`` / ``KL(student ||
  teacher)``: ``megaloss`` (``linear_distillation_loss(kind="forward_kl" / "reverse_kl")``) vs
  ``deepspeed`` (``vocab_parallel_kl_div(student_logits, teacher_logits, reverse=...)``, teacher
  logits under ``no_grad``).

Under TP each rank holds rows ``[r V/TP, (r+1) V/TP)`` of both heads (``V`` must divide by every
TP) and the replicated inputs. DeepSpeed's logits ops leave the all-reduce of the hidden states'
gradient to the column-parallel head (Megatron's ``copy_to_tensor_model_parallel_region``); the
tool adds that identity-forward / all-reduce-backward step in front of ``hidden @ weight.T``.
megaloss and ``vocab_parallel_linear_cross_entropy`` do it themselves.

Measured (method of ``tools/_bench_common.py``): extra peak memory per rank (max over ranks)
above the inputs, weight shards and their preallocated ``.grad``, one fresh set of TP processes
per method running it once; time: the median over ``--repeats`` rounds (methods interleaved,
order rotated, a barrier before each run; the max over ranks) in another fresh set of processes,
every method warmed up first at a small token count. ``time_ratio`` / ``mem_ratio`` are the
task's megaloss figure over the row's. ``loss_err`` / ``grad_err``: max abs difference of the
loss and of its gradient wrt ``hidden`` (rank 0's, replicated) from a float64 full-logits
reference computed once in the parent.

    python3 tools/bench_deepspeed_native.py                     # N 4096, H 1024, V 32000, TP 1 2
    python3 tools/bench_deepspeed_native.py --sizes 256 --hidden 64 --vocab 1000 --tp 1 2 4
    python3 tools/bench_deepspeed_native.py --sizes 16384 --tp 2 4 --tasks ce   # CE only
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
    vocab_shard,
)

TASKS = ("ce", "lp", "kd_fwd", "kd_rev")
# (task, method, DeepSpeed function or megaloss's, TP 1 only)
CASES = (
    ("ce", "megaloss", "megaloss.linear_cross_entropy", False),
    ("ce", "deepspeed", "vocab_parallel_linear_cross_entropy", False),
    ("ce", "ds_autotp", "vocab_parallel_cross_entropy(head logits): AutoTP's installed loss",
     False),
    ("ce", "eager", "F.cross_entropy(full logits)", True),
    ("ce", "ds_chunked_lm", "ChunkedCausalLMLoss(backend='torch'; Triton: CUDA only)", True),
    ("lp", "megaloss", "megaloss.linear_log_probs(return_entropy=True)", False),
    ("lp", "deepspeed", "vocab_parallel_logprobs + vocab_parallel_entropy", False),
    ("kd_fwd", "megaloss", "megaloss.linear_distillation_loss(kind='forward_kl')", False),
    ("kd_fwd", "deepspeed", "vocab_parallel_kl_div(reverse=False)", False),
    ("kd_rev", "megaloss", "megaloss.linear_distillation_loss(kind='reverse_kl')", False),
    ("kd_rev", "deepspeed", "vocab_parallel_kl_div(reverse=True)", False),
)
COLUMNS = ["tp", "tokens", "hidden", "vocab", "task", "method", "time_s", "extra_MiB",
           "time_ratio", "mem_ratio", "loss_err", "grad_err", "function", "repeats", "error"]
TABLE_COLUMNS = ["tp", "task", "method", "time_s", "extra_MiB", "time_ratio", "mem_ratio",
                 "loss_err", "grad_err", "function"]


def _cases(tp: int, tasks=TASKS) -> List[str]:
    """``"task/method"`` keys of ``tasks`` run at ``tp``."""
    return [f"{t}/{m}" for t, m, _, tp1_only in CASES
            if t in tasks and (tp == 1 or not tp1_only)]


def _inputs(n: int, hidden: int, vocab: int, seed: int):
    """``h [N, H]``, ``w [V, H] * 0.02``, ``th [N, H]``, ``tw [V, H] * 0.05``, ``y [N]``,
    ``a, c [N]`` uniform in [0.5, 1.5), drawn in that order from one CPU generator."""
    import torch
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g).mul_(0.02)
    th = torch.randn(n, hidden, generator=g)
    tw = torch.randn(vocab, hidden, generator=g).mul_(0.05)
    y = torch.randint(0, vocab, (n,), generator=g)
    a = torch.rand(n, generator=g) + 0.5
    c = torch.rand(n, generator=g) + 0.5
    return h, w, th, tw, y, a, c


def _loss_fns(tp: int, vocab: int, chunk: int, ds_chunk=None) -> Dict[str, Any]:
    """``{"task/method": fn(h, w, th, tw, y, a, c) -> scalar loss}`` on this rank's shards."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from deepspeed.runtime.chunked_cross_entropy import ChunkedCausalLMLoss
    from deepspeed.sequence.cross_entropy import vocab_parallel_cross_entropy
    from deepspeed.sequence.linear_cross_entropy import vocab_parallel_linear_cross_entropy
    from deepspeed.sequence.vocab_parallel_ops import (
        vocab_parallel_entropy,
        vocab_parallel_kl_div,
        vocab_parallel_logprobs,
    )

    import megaloss

    rank = dist.get_rank() if tp > 1 else 0
    group = dist.group.WORLD if tp > 1 else None
    rows = vocab // tp
    start, stop = rank * rows, (rank + 1) * rows
    parallel = megaloss.VocabParallelOptions(vocab_size=vocab) if tp > 1 else None

    class _CopyToTP(torch.autograd.Function):
        """Identity forward, SUM all-reduce of the gradient backward (the column-parallel
        head's input step, Megatron-LM ``megatron/core/tensor_parallel/mappings.py``)."""

        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            g = g.contiguous()
            dist.all_reduce(g, group=group)
            return g

    def head(h, w):  # the vocab-parallel lm_head DeepSpeed's logits ops take the output of
        return F.linear(_CopyToTP.apply(h) if tp > 1 else h, w)

    def teacher_logits(th, tw):
        with torch.no_grad():
            return F.linear(th, tw)

    chunked = ChunkedCausalLMLoss(backend="torch")

    def ce_mega(h, w, th, tw, y, a, c):
        return megaloss.linear_cross_entropy(h, w, y, chunk_size=chunk,
                                             vocab_parallel_options=parallel)

    def ce_ds(h, w, th, tw, y, a, c):
        return vocab_parallel_linear_cross_entropy(h, w, y, tp_group=group,
                                                   vocab_start_index=start,
                                                   vocab_end_index=stop, chunk_size=ds_chunk)

    def ce_autotp(h, w, th, tw, y, a, c):  # on the logits of AutoTP's VocabParallelLinear
        return vocab_parallel_cross_entropy(head(h, w), y, tp_group=group,
                                            vocab_start_index=start, vocab_end_index=stop,
                                            global_vocab_size=vocab)

    def ce_eager(h, w, th, tw, y, a, c):
        return F.cross_entropy(F.linear(h, w), y)

    def ce_chunked(h, w, th, tw, y, a, c):
        return chunked(F.linear(h, w), y, vocab, shift_labels=y)

    def lp_mega(h, w, th, tw, y, a, c):
        out = megaloss.linear_log_probs(h, w, y, return_entropy=True, chunk_size=chunk,
                                        vocab_parallel_options=parallel)
        return (a * out.log_probs + c * out.entropy).mean()

    def lp_ds(h, w, th, tw, y, a, c):
        logits = head(h, w)
        lp = vocab_parallel_logprobs(logits, y, tp_group=group, vocab_start_index=start,
                                     vocab_end_index=stop, global_vocab_size=vocab)
        return (a * lp + c * vocab_parallel_entropy(logits, tp_group=group)).mean()

    def kd_mega(kind):
        def fn(h, w, th, tw, y, a, c):
            return megaloss.linear_distillation_loss(
                h, w, y, teacher_hidden_states=th, teacher_weight=tw, kind=kind,
                chunk_size=chunk, vocab_parallel_options=parallel)
        return fn

    def kd_ds(reverse):
        def fn(h, w, th, tw, y, a, c):
            return vocab_parallel_kl_div(head(h, w), teacher_logits(th, tw), reverse=reverse,
                                         tp_group=group).mean()
        return fn

    return {"ce/megaloss": ce_mega, "ce/deepspeed": ce_ds, "ce/ds_autotp": ce_autotp,
            "ce/eager": ce_eager,
            "ce/ds_chunked_lm": ce_chunked, "lp/megaloss": lp_mega, "lp/deepspeed": lp_ds,
            "kd_fwd/megaloss": kd_mega("forward_kl"), "kd_fwd/deepspeed": kd_ds(False),
            "kd_rev/megaloss": kd_mega("reverse_kl"), "kd_rev/deepspeed": kd_ds(True)}


def _shards(inputs, tp: int, rank: int):
    h, w, th, tw, y, a, c = inputs  # V divides by tp (main checks): the shards are exact
    return h, vocab_shard(w, tp, rank), th, vocab_shard(tw, tp, rank), y, a, c


def _rank(rank: int, tp: int, spec: Dict[str, Any]) -> Dict[str, Any]:
    """One TP rank (``megaloss.testing.run_distributed``, gloo initialised). ``mode="memory"``:
    one fwd+bwd of ``spec["case"]`` under the memory probe; ``"timing"``: interleaved rounds."""
    import deepspeed
    import torch
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)  # wraps the gloo group
    n, hidden, vocab, chunk = spec["tokens"], spec["hidden"], spec["vocab"], spec["chunk_size"]
    fns = _loss_fns(tp, vocab, chunk, spec.get("ds_chunk_size"))
    cases = [spec["case"]] if spec["mode"] == "memory" else list(spec["cases"])

    small = _shards(_inputs(min(n, 64), hidden, vocab, spec["seed"] + 1), tp, rank)
    small[0].requires_grad_(), small[1].requires_grad_()
    for k in cases:  # warm-up: lazily created state (thread pool, DeepSpeed's caches) first
        fns[k](*small).backward()
    del small
    inputs = _shards(_inputs(n, hidden, vocab, spec["seed"]), tp, rank)
    h, w = inputs[0].requires_grad_(), inputs[1].requires_grad_()
    h.grad, w.grad = torch.zeros_like(h), torch.zeros_like(w)
    gc.collect()
    dist.barrier()
    if spec["mode"] == "memory":
        probe = MemoryProbe("cpu")
        probe.start()
        loss = fns[cases[0]](*inputs)
        loss.backward()
        extra = probe.peak_above_baseline()
        out = {"extra_bytes": extra, "loss": float(loss.detach()), "mem_method": probe.method}
        if rank == 0:
            out["grad_h"] = h.grad.clone()
        return out
    times: Dict[str, List[float]] = {k: [] for k in cases}
    spent = 0.0
    for r in range(spec["repeats"]):
        for k in cases[r % len(cases):] + cases[:r % len(cases)]:
            h.grad = None
            w.grad = None
            dist.barrier()
            t0 = time.perf_counter()
            fns[k](*inputs).backward()
            times[k].append(time.perf_counter() - t0)
            spent += times[k][-1]
        if budget_spent(spent, spec["time_budget"]):  # agreed: every rank stops alike
            break
    return {"times": times}


def reference(n: int, hidden: int, vocab: int, seed: int, tasks=TASKS) -> Dict[str, Any]:
    """float64 full-logits losses and their gradients wrt ``hidden``, per task of ``tasks``."""
    import torch
    import torch.nn.functional as F
    h, w, th, tw, y, a, c = (t.double() if t.is_floating_point() else t
                             for t in _inputs(n, hidden, vocab, seed))
    h.requires_grad_()
    out = {}
    logq = F.log_softmax(h @ w.t(), -1)  # student
    logp = None
    if {"kd_fwd", "kd_rev"} & set(tasks):
        with torch.no_grad():
            logp = F.log_softmax(th @ tw.t(), -1)  # teacher
    del th, tw
    losses = {
        "ce": lambda: -logq.gather(-1, y[:, None]).mean(),
        "lp": lambda: (a * logq.gather(-1, y[:, None])[:, 0]
                       - c * (logq.exp() * logq).sum(-1)).mean(),
        "kd_fwd": lambda: (logp.exp() * (logp - logq)).sum(-1).mean(),
        "kd_rev": lambda: (logq.exp() * (logq - logp)).sum(-1).mean(),
    }
    for task, fn in losses.items():
        if task not in tasks:
            continue
        loss = fn()
        (g,) = torch.autograd.grad(loss, h, retain_graph=True)
        out[task] = (float(loss.detach()), g)
        del loss
    return out


def _tp_rows(args, tp: int, n: int, ref: Dict[str, Any]) -> List[Dict[str, Any]]:
    from megaloss.testing import run_distributed
    threads = max(1, args.cpus // tp)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    spec = {"tokens": n, "hidden": args.hidden, "vocab": args.vocab,
            "chunk_size": args.chunk_size, "ds_chunk_size": args.ds_chunk_size,
            "seed": args.seed, "repeats": args.repeats, "time_budget": args.time_budget}
    cases = _cases(tp, args.tasks)
    memory: Dict[str, Any] = {}
    for k in cases:
        try:
            memory[k] = run_distributed(_rank, tp, dict(spec, mode="memory", case=k),
                                        timeout=args.timeout, threads_per_rank=threads)
        except Exception as e:  # noqa: BLE001 - a failed case is a row with its error
            last = (str(e).strip().splitlines() or [""])[-1]
            memory[k] = [{"error": f"{type(e).__name__}: {last}"}]
    try:
        timing = run_distributed(_rank, tp, dict(spec, mode="timing", cases=cases),
                                 timeout=args.timeout, threads_per_rank=threads)
        times = {k: max(median(r["times"][k]) for r in timing) for k in cases}
        repeats = {k: len(timing[0]["times"][k]) for k in cases}
        time_error = ""
    except Exception as e:  # noqa: BLE001
        times, repeats = {k: math.nan for k in cases}, {k: 0 for k in cases}
        time_error = f"timing: {type(e).__name__}"
    functions = {f"{t}/{m}": f for t, m, f, _ in CASES}
    rows = []
    for k in cases:
        task, method = k.split("/")
        ranks = memory[k]
        err = ranks[0].get("error", "") or time_error
        extra = max((r.get("extra_bytes", math.nan) for r in ranks), default=math.nan)
        loss = ranks[0].get("loss", math.nan)
        ref_loss, ref_grad = ref[task]
        grad = ranks[0].get("grad_h")
        rows.append({"tp": tp, "tokens": n, "hidden": args.hidden, "vocab": args.vocab,
                     "task": task, "method": method, "time_s": times[k],
                     "extra_MiB": mib(extra), "_bytes": extra,
                     "loss_err": abs(loss - ref_loss),
                     "grad_err": float((grad.double() - ref_grad).abs().max())
                     if grad is not None else math.nan,
                     "function": functions[k], "repeats": repeats[k], "error": err})
    for r in rows:
        mega = next(m for m in rows if m["task"] == r["task"] and m["method"] == "megaloss")
        r["time_ratio"] = mega["time_s"] / r["time_s"] if r["time_s"] else math.nan
        r["mem_ratio"] = mega["_bytes"] / r["_bytes"] if r["_bytes"] else math.nan
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[4096],
                   help="token counts N (default 4096)")
    p.add_argument("--hidden", type=int, default=1024, help="hidden size H (default 1024)")
    p.add_argument("--vocab", type=int, default=32000,
                   help="vocabulary V, divisible by every TP (default 32000)")
    p.add_argument("--chunk-size", type=int, default=None,
                   help="megaloss chunk (default: megaloss's own, auto_chunk_size: fp32 logits "
                        "about the size of hidden, at least 512 tokens)")
    p.add_argument("--ds-chunk-size", type=int, default=None,
                   help="chunk_size of vocab_parallel_linear_cross_entropy (default: DeepSpeed's, "
                        "fp32 blocks about the size of hidden: ceil(N / ceil(V / TP / H)) tokens)")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="TP sizes (default 1 2)")
    p.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS),
                   help="tasks to run (default all)")
    p.add_argument("--repeats", type=int, default=2, help="timed rounds (default 2)")
    p.add_argument("--time-budget", type=float, default=120.0,
                   help="stop repeating once a rank's timed runs took this long (default 120 s)")
    p.add_argument("--cpus", type=int, default=os.cpu_count() or 1,
                   help="cores shared by the TP ranks: each gets max(1, cpus // TP) threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per set of ranks")
    p.add_argument("--no-cuda", action="store_true",
                   help="accepted for the tools' common CLI; this tool runs on CPU only")
    p.add_argument("--csv", metavar="PATH", help="write every column as CSV")
    args = p.parse_args(argv)
    require_positive(p, args, ("hidden", "vocab", "repeats", "cpus"))
    if args.chunk_size is not None and args.chunk_size < 1:
        p.error("--chunk-size must be >= 1")
    if args.ds_chunk_size is not None and args.ds_chunk_size < 1:
        p.error("--ds-chunk-size must be >= 1")
    if any(s < 1 for s in args.sizes) or any(t < 1 for t in args.tp):
        p.error("--sizes and --tp must be >= 1")
    if any(args.vocab % t for t in args.tp):
        p.error("--vocab must be divisible by every --tp (DeepSpeed's shards are exact)")
    os.environ.update(MALLOC_ENV)  # inherited by the spawned ranks
    rows: List[Dict[str, Any]] = []
    for n in args.sizes:
        t0 = time.perf_counter()
        ref = reference(n, args.hidden, args.vocab, args.seed, args.tasks)
        for tp in args.tp:
            rows += _tp_rows(args, tp, n, ref)
            print(f"# N={n} TP={tp}: done ({time.perf_counter() - t0:.1f} s)", file=sys.stderr,
                  flush=True)
        del ref
    import deepspeed
    print(f"megaloss vs DeepSpeed {deepspeed.__version__} native losses, fwd+bwd, CPU fp32, "
          f"H={args.hidden}, V={args.vocab}, chunk={args.chunk_size or 'megaloss default'} "
          f"(DeepSpeed's linear CE: "
          f"{args.ds_chunk_size or 'its default'}), {args.cpus} cores shared "
          f"by the TP ranks; extra_MiB = per-rank peak above inputs, weight shards and grads "
          f"(max over ranks); *_ratio = megaloss / this row; *_err = max abs diff from float64")
    for n in args.sizes:
        print(f"\nN={n}")
        print(format_table([r for r in rows if r["tokens"] == n], TABLE_COLUMNS))
    errors = [f"TP={r['tp']} {r['task']}/{r['method']}: {r['error']}" for r in rows
              if r["error"]]
    return finish(errors, args.csv, rows, COLUMNS)


if __name__ == "__main__":
    sys.exit(main())
