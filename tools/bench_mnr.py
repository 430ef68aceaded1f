#!/usr/bin/env python3
"""Time and peak memory per rank of the gathered MNR loss (forward + backward), CPU / gloo.

    python tools/bench_mnr.py                      # default grid, ~1-2 min on 2 cores
    python tools/bench_mnr.py --batches 256 512 1024 2048 4096 --reps 3     # full grid, steadier

For each world size W, W fresh processes (spawn, gloo, 1 thread each) run one small untimed
warm-up, then for every global batch N and ``local_loss`` on/off ``--reps`` timed steps of
``mnr_loss(q, p, negatives)`` + ``backward`` on leaf embeddings ``[N/W, D]`` (float32; the encoder
is not part of the measurement). Time: the slowest rank, mean over reps, in ms. Memory: measured
during the first timed step.

Peak memory, measured (not modelled): peak RSS of the rank's process above its RSS just before
the step. Before the step the process returns freed memory to the OS (``malloc_trim``), resets the
kernel's high-water mark (``echo 5 > /proc/self/clear_refs``, Linux >= 4.0) and reads ``VmHWM``
afterwards. glibc's mmap threshold is pinned to 64 KiB (``MALLOC_MMAP_THRESHOLD_``) so every
tensor buffer is its own mapping, given back to the OS on free: RSS then follows the live tensor
bytes plus allocator slack. It includes gloo's communication buffers and everything autograd keeps;
it excludes the pre-existing inputs. The "rows x C MiB" column is the modelled size one unchunked
float32 score matrix would take (``local_loss``: ``B x C``, otherwise ``N x C``), for comparison;
the loss itself holds ``chunk_size x C`` scores at a time.
With W ranks sharing fewer cores than W, times include the contention (the table says how many
cores there were).
"""
from __future__ import annotations

import argparse
import csv
import itertools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_common import MemoryProbe, trim_memory  # noqa: E402  (one peak-memory method)

_MMAP_THRESHOLD = "65536"



def naive_mnr_loss(q, p, neg, *, local_loss, chunk_size, temperature=0.05):
    """For comparison: the plain-autograd formulation (sentence-transformers / open_clip style:
    full score matrix, ``F.cross_entropy``) with the same exact gather and scaling, K=0 only."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from megaloss.parallel.mappings import all_reduce_sum_autograd, gather_from_region
    assert neg is None, "the naive comparison supports K=0 only"
    group = None  # torch's default group (trivial at world size 1)
    q, p = F.normalize(q, dim=-1), F.normalize(p, dim=-1)
    world, rank, b = dist.get_world_size(), dist.get_rank(), q.shape[0]
    docs = gather_from_region(p, group, [b] * world)
    n = b * world
    if local_loss:
        rows, target = q, torch.arange(rank * b, rank * b + b)
    else:
        rows, target = gather_from_region(q, group, [b] * world), torch.arange(n)
    loss = F.cross_entropy(rows @ docs.T / temperature, target, reduction="sum") / n
    return all_reduce_sum_autograd(loss, group) if local_loss else loss


def _step(loss_fn, q, p, neg, local_loss, chunk_size):
    q.grad = p.grad = None
    if neg is not None:
        neg.grad = None
    loss = loss_fn(q, p, neg, local_loss=local_loss, chunk_size=chunk_size)
    loss.backward()
    return loss


def _worker(rank, world, args):
    """One rank (run by :func:`megaloss.testing.run_distributed`, gloo already initialised,
    1 thread); returns the rank's rows (every number already reduced over ranks)."""
    import torch.distributed as dist

    from megaloss.losses import mnr_loss
    impls = {"megaloss": mnr_loss, "naive": naive_mnr_loss}
    impls = impls if args.impl == "both" else {args.impl: impls[args.impl]}
    rows = []

    def inputs(n):
        """This rank's slice of one global batch (same for every world size: the loss column
        must then agree across rows with the same N)."""
        gen = torch.Generator().manual_seed(n)
        b = n // world
        q = torch.randn(n, args.dim, generator=gen)
        p = q + torch.randn(n, args.dim, generator=gen)
        neg = torch.randn(n, args.k, args.dim, generator=gen) if args.k else None
        own = slice(rank * b, rank * b + b)
        return (q[own].clone().requires_grad_(), p[own].clone().requires_grad_(),
                None if neg is None else neg[own].clone().requires_grad_())

    for fn in impls.values():  # warm-up once: gloo buffers, thread pools, first calls
        for local_loss in args.local:
            _step(fn, *inputs(min(args.batches)), local_loss, args.chunk_size)
    for n in args.batches:
        b = n // world
        q, p, neg = inputs(n)
        for (impl, fn), local_loss in itertools.product(impls.items(), args.local):
            elapsed, peak_kib, honest = 0.0, 0, True
            for rep in range(args.reps):
                trim_memory()
                dist.barrier()
                if rep == 0:  # the first timed step also measures the peak
                    q.grad = p.grad = None  # the step allocates its input gradients anew
                    if neg is not None:
                        neg.grad = None
                    trim_memory()
                    probe = MemoryProbe()
                    probe.start()
                t0 = time.perf_counter()
                loss = _step(fn, q, p, neg, local_loss, args.chunk_size)
                elapsed += time.perf_counter() - t0
                if rep == 0:
                    peak_kib = probe.peak_above_baseline() / 1024
                    honest = probe.method.startswith("VmHWM")
            stats = torch.tensor([elapsed / args.reps, float(peak_kib)], dtype=torch.float64)
            dist.all_reduce(stats, op=dist.ReduceOp.MAX)
            rows.append((impl, n, b, local_loss, stats[0].item(), stats[1].item(), honest,
                         loss.item()))
        del q, p, neg
    return rows


def run_world(world: int, args) -> list:
    from megaloss.testing import run_distributed
    return run_distributed(_worker, world, args, timeout=args.timeout, threads_per_rank=1)[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[256, 1024, 4096],
                    help="global batch sizes N (each divisible by every world size)")
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--k", type=int, default=0, help="hard negatives per query")
    ap.add_argument("--reps", type=int, default=1, help="timed steps per configuration")
    ap.add_argument("--chunk-size", type=int, default=1024,
                    help="mnr_loss chunk_size (rows scored per block)")
    ap.add_argument("--local", type=lambda s: s.lower() in ("1", "true", "on"), nargs="+",
                    default=[True, False], help="local_loss values to run (on/off)")
    ap.add_argument("--impl", choices=("megaloss", "naive", "both"), default="megaloss",
                    help="naive: plain autograd cross-entropy on the full score matrix, same "
                         "gather and scaling (K=0 only); both: each configuration with each")
    ap.add_argument("--csv", help="also write the table to this CSV file")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per world size")
    args = ap.parse_args(argv)
    for n in args.batches:
        for w in args.worlds:
            if n % w:
                ap.error(f"global batch {n} is not divisible by world size {w}")
    # inherited by the spawned workers; must be set before they start (read by glibc at startup)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = _MMAP_THRESHOLD

    if args.impl != "megaloss" and args.k:
        ap.error("--impl naive/both supports --k 0 only")
    print(f"mnr_loss fwd+bwd, cosine, D={args.dim}, K={args.k}, "
          f"chunk_size={args.chunk_size}, "
          f"float32, CPU gloo, "
          f"{os.cpu_count()} cores, 1 thread/rank, torch {torch.__version__}")
    print("peak = peak RSS above the pre-step RSS of the rank's process (VmHWM after "
          "clear_refs; max over ranks); rows x C = one unchunked score matrix, modelled\n")
    header = (f"{'impl':>8} {'world':>5} {'N':>5} {'B/rank':>6} {'local_loss':>10} {'time ms':>9} "
              f"{'peak MiB/rank':>13} {'rows x C MiB':>12} {'loss':>10}")
    print(header)
    print("-" * len(header))
    start = time.perf_counter()
    table = []
    for w in args.worlds:
        for impl, n, b, local, seconds, peak_kib, honest, loss in run_world(w, args):
            cols = n * (1 + args.k)
            score_mib = (b if local else n) * cols * 4 / 2 ** 20
            flag = "" if honest else " (RSS delta: clear_refs unavailable)"
            print(f"{impl:>8} {w:>5} {n:>5} {b:>6} {str(local):>10} {seconds * 1e3:>9.1f} "
                  f"{peak_kib / 1024:>13.1f} {score_mib:>12.1f} {loss:>10.6f}{flag}", flush=True)
            table.append(dict(impl=impl, world=w, N=n, B_per_rank=b, local_loss=local,
                              time_ms=round(seconds * 1e3, 3), peak_MiB=round(peak_kib / 1024, 3),
                              rows_x_C_MiB=round(score_mib, 3), loss=loss,
                              peak_method="VmHWM" if honest else "VmRSS"))
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(table[0]))
            writer.writeheader()
            writer.writerows(table)
    print(f"\ntotal {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
