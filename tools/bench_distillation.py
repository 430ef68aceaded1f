#!/usr/bin/env python3
"""Benchmark: ``megaloss.linear_distillation_loss`` (generalised JSD, beta 0.5) against the
full-logits reference and against Liger-Kernel's chunked JSD schedule written in torch; and the
vocab-parallel form's memory per tensor-parallel rank.

Single device, for every token count N, on the same inputs (student ``hidden [N, H]`` and
``weight [V, H]`` requiring grad, teacher ``hidden [N, H]`` and ``weight [V, H]`` frozen, random
labels), one forward+backward of

* ``full_logits``: both models' ``[N, V]`` logits, ``log_softmax`` and the JSD formula in eager
  torch (what a training loop without a fused loss does);
* ``liger_torch``: Liger-Kernel's schedule (``src/liger_kernel/chunked_loss/
  fused_linear_distillation.py``): per chunk of ``--chunk`` tokens both logits, the JSD of
  ``src/liger_kernel/chunked_loss/jsd_loss.py`` and the chunk's gradients by autograd (eager
  torch, no ``torch.compile``: what that code runs without Triton);
* ``megaloss``: ``linear_distillation_loss(kind="jsd", beta=0.5)``, same chunk size.

Measured (method of ``tools/_bench_common.py``): extra peak memory above inputs, weights and their
preallocated ``.grad`` buffers, one fresh process per method and size running it once; time: the
median of ``--repeats`` warm runs in another fresh process per size, methods interleaved per
round; ``mem_vs_full`` / ``time_vs_full`` are ratios to ``full_logits``. The losses are printed
against ``full_logits`` (same math, so they agree to rounding).

With ``--tp`` (e.g. ``1 2 4``): for each TP size, TP spawned gloo ranks each hold one
``[ceil(V/TP), H]`` shard of both heads and the replicated inputs and run one forward+backward of
the vocab-parallel loss at the largest N; reported is the extra peak memory per rank (max over
ranks) and its ratio to TP=1.

    python3 tools/bench_distillation.py                       # N 4096 16384, H 1024, V 32000
    python3 tools/bench_distillation.py --sizes 1024 2048 --hidden 256 --vocab 8000 --tp 1 2 4
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
    median,
    mib,
    run_worker,
    vocab_shard,
    write_csv,
)

METHODS = ("full_logits", "liger_torch", "megaloss")
BETA = 0.5
COLUMNS = ["tokens", "hidden", "vocab", "chunk_size", "method", "time_s", "time_vs_full",
           "extra_MiB", "mem_vs_full", "loss", "loss_diff_vs_full", "repeats", "mem_method"]
TP_COLUMNS = ["tp", "tokens", "hidden", "vocab", "rows_per_rank", "extra_MiB_per_rank",
              "mem_vs_tp1", "loss", "loss_same_on_all_ranks"]


def _jsd_liger(student_logits, teacher_logits, beta):
    """Liger-Kernel's ``LigerFusedLinearJSDFunction.distillation_loss_fn`` (chunked_loss/
    jsd_loss.py), with the mixture weighted ``beta * teacher + (1 - beta) * student`` as in
    its ``ops/jsd.py`` and megaloss (summed over the chunk's tokens)."""
    import torch.nn.functional as F
    s, t = F.log_softmax(student_logits, -1), F.log_softmax(teacher_logits, -1)
    log_m = (beta * t.exp() + (1 - beta) * s.exp()).log()
    teacher_kl = F.kl_div(log_m, t, reduction="sum", log_target=True)
    student_kl = F.kl_div(log_m, s, reduction="sum", log_target=True)
    return beta * teacher_kl + (1 - beta) * student_kl


def _loss_fns(chunk: int):
    import torch
    import torch.nn.functional as F

    from megaloss import linear_distillation_loss

    def full_logits(h, w, th, tw, y):
        loss = _jsd_liger(F.linear(h, w), F.linear(th, tw), BETA)
        return loss / (y != -100).sum()

    def liger_torch(h, w, th, tw, y):
        # Per chunk: logits, loss and the chunk's gradients by autograd; gradients accumulated.
        n = (y != -100).sum()
        gw = torch.zeros_like(w)
        gh = torch.empty_like(h)
        total = torch.zeros((), dtype=torch.float32)
        for start in range(0, h.shape[0], chunk):
            hc = h[start:start + chunk].detach().requires_grad_()
            wc = w.detach().requires_grad_()
            with torch.no_grad():
                t_logits = F.linear(th[start:start + chunk], tw)
            loss = _jsd_liger(F.linear(hc, wc), t_logits, BETA) / n
            g_h, g_w = torch.autograd.grad(loss, (hc, wc))
            gh[start:start + chunk] = g_h
            gw += g_w
            total += loss.detach()
        return _Precomputed.apply(h, w, total, gh, gw)

    def megaloss(h, w, th, tw, y):
        return linear_distillation_loss(h, w, y, teacher_hidden_states=th, teacher_weight=tw,
                                        kind="jsd", beta=BETA, chunk_size=chunk)

    class _Precomputed(torch.autograd.Function):
        """Hands gradients formed in forward to backward (Liger's schedule)."""

        @staticmethod
        def forward(ctx, h, w, loss, gh, gw):
            ctx.save_for_backward(gh, gw)
            return loss.clone()

        @staticmethod
        def backward(ctx, g):
            gh, gw = ctx.saved_tensors
            return gh * g, gw * g, None, None, None

    return {"full_logits": full_logits, "liger_torch": liger_torch, "megaloss": megaloss}


def _inputs(spec, n=None):
    import torch
    g = torch.Generator().manual_seed(spec["seed"])
    n = spec["tokens"] if n is None else n
    hidden, vocab = spec["hidden"], spec["vocab"]
    h = torch.randn(n, hidden, generator=g).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * 0.02).requires_grad_()
    th = torch.randn(n, hidden, generator=g)
    tw = torch.randn(vocab, hidden, generator=g) * 0.05
    y = torch.randint(0, vocab, (n,), generator=g)
    return h, w, th, tw, y


def _worker(spec: Dict[str, Any]) -> Dict[str, Any]:
    """``mode="memory"``: one fwd+bwd of ``spec["method"]`` under the memory probe;
    ``mode="timing"``: warm runs of every method, interleaved."""
    import gc

    import torch

    torch.set_num_threads(spec["threads"])
    fns = _loss_fns(spec["chunk_size"])
    methods = [spec["method"]] if spec["mode"] == "memory" else list(METHODS)
    small = _inputs(spec, min(spec["tokens"], spec["chunk_size"]))
    for m in methods:  # warm-up: lazily created state goes into the baseline
        fns[m](*small).backward()
    del small
    h, w, th, tw, y = _inputs(spec)
    h.grad, w.grad = torch.zeros_like(h), torch.zeros_like(w)
    gc.collect()
    if spec["mode"] == "memory":
        probe = MemoryProbe("cpu")
        probe.start()
        loss = fns[methods[0]](h, w, th, tw, y)
        loss.backward()
        return {"extra_bytes": probe.peak_above_baseline(), "loss": float(loss.detach()),
                "mem_method": probe.method}
    times: Dict[str, List[float]] = {m: [] for m in methods}
    losses: Dict[str, float] = {}
    spent = 0.0
    for r in range(max(1, spec["repeats"])):
        for m in methods[r % len(methods):] + methods[:r % len(methods)]:
            t0 = time.perf_counter()
            loss = fns[m](h, w, th, tw, y)
            loss.backward()
            times[m].append(time.perf_counter() - t0)
            losses[m] = float(loss.detach())
            spent += times[m][-1]
        if spent > spec["time_budget"]:
            break
    return {"times": times, "losses": losses}


def _tp_rank(rank: int, tp: int, spec: Dict[str, Any]) -> Dict[str, Any]:
    """One TP rank of the vocab-parallel loss (run by ``megaloss.testing.run_distributed``)."""
    import gc

    import torch

    from megaloss import VocabParallelOptions, linear_distillation_loss
    torch.set_num_threads(spec["threads"])
    vocab, chunk = spec["vocab"], spec["chunk_size"]
    parallel = VocabParallelOptions(vocab_size=vocab)

    def shard(full):
        return vocab_shard(full, tp, rank)

    def run(h, w, th, tw, y):
        return linear_distillation_loss(h, w, y, teacher_hidden_states=th, teacher_weight=tw,
                                        kind="jsd", beta=BETA, chunk_size=chunk,
                                        vocab_parallel_options=parallel)

    small = _inputs(spec, min(spec["tokens"], chunk))
    run(small[0], shard(small[1].detach()).requires_grad_(), small[2], shard(small[3]),
        small[4]).backward()
    h, w_full, th, tw_full, y = _inputs(spec)
    w, tw = shard(w_full.detach()).requires_grad_(), shard(tw_full)
    del w_full, tw_full
    h.grad, w.grad = torch.zeros_like(h), torch.zeros_like(w)
    gc.collect()
    probe = MemoryProbe("cpu")
    probe.start()
    loss = run(h, w, th, tw, y)
    loss.backward()
    return {"extra_bytes": probe.peak_above_baseline(), "loss": float(loss.detach())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--sizes", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--time-budget", type=float, default=120.0)
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2)))
    p.add_argument("--tp", type=int, nargs="*", default=[])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--csv")
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(_worker(json.loads(args.worker))))
        return 0
    script = os.path.abspath(__file__)
    rows: List[Dict[str, Any]] = []

    def _ratio(a: float, b: float) -> float:  # a tiny size can measure 0 extra bytes
        return a / b if b else math.nan

    for n in args.sizes:
        spec = dict(tokens=n, hidden=args.hidden, vocab=args.vocab, chunk_size=args.chunk,
                    threads=args.threads, seed=args.seed, repeats=args.repeats,
                    time_budget=args.time_budget)
        mem = {m: run_worker(script, dict(spec, mode="memory", method=m), args.threads,
                             args.timeout) for m in METHODS}
        timing = run_worker(script, dict(spec, mode="timing"), args.threads, args.timeout)
        full_t = median(timing.get("times", {}).get("full_logits", []))
        full_m = mem["full_logits"].get("extra_bytes", math.nan)
        full_loss = mem["full_logits"].get("loss", math.nan)
        for m in METHODS:
            t = median(timing.get("times", {}).get(m, []))
            b = mem[m].get("extra_bytes", math.nan)
            loss = mem[m].get("loss", math.nan)
            rows.append(dict(tokens=n, hidden=args.hidden, vocab=args.vocab,
                             chunk_size=args.chunk, method=m, time_s=t,
                             time_vs_full=_ratio(t, full_t), extra_MiB=mib(b),
                             mem_vs_full=_ratio(b, full_m), loss=loss,
                             loss_diff_vs_full=abs(loss - full_loss),
                             repeats=len(timing.get("times", {}).get(m, [])),
                             mem_method=mem[m].get("mem_method", mem[m].get("error", ""))))
    print(f"distillation loss (JSD beta={BETA}) fwd+bwd, fp32 CPU, {args.threads} threads; "
          "extra_MiB = peak RSS above inputs, weights and grads")
    print(format_table(rows, COLUMNS[:11]))
    if args.csv:
        write_csv(args.csv, rows, COLUMNS)
    if args.tp:
        from megaloss.testing import run_distributed
        os.environ.update(MALLOC_ENV)
        tp_rows = []
        spec = dict(tokens=max(args.sizes), hidden=args.hidden, vocab=args.vocab,
                    chunk_size=args.chunk, seed=args.seed)
        for tp in args.tp:
            threads = max(1, args.threads // tp)
            os.environ["OMP_NUM_THREADS"] = str(threads)
            res = run_distributed(_tp_rank, tp, dict(spec, threads=threads),
                                  timeout=args.timeout, threads_per_rank=threads)
            extra = max(r["extra_bytes"] for r in res)
            tp_rows.append(dict(tp=tp, tokens=spec["tokens"], hidden=args.hidden,
                                vocab=args.vocab, rows_per_rank=math.ceil(args.vocab / tp),
                                extra_MiB_per_rank=mib(extra), loss=res[0]["loss"],
                                loss_same_on_all_ranks=len({r["loss"] for r in res}) == 1,
                                _bytes=extra))
        for r in tp_rows:
            r["mem_vs_tp1"] = r.pop("_bytes") / (tp_rows[0]["extra_MiB_per_rank"] * 2**20)
        print("\nvocab-parallel, per rank (spawned gloo ranks, replicated input)")
        print(format_table(tp_rows, TP_COLUMNS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
