#!/usr/bin/env python3
"""Peak activation memory and time per rank of one training step of the gathered MNR bi-encoder,
with GradCache and without, side by side (CPU, gloo).

    python3 tools/bench_grad_cache.py                      # B/rank 32, 128, 512, 2 ranks: 2-3 min
    python3 tools/bench_grad_cache.py --batches 64 256 --mini-batch 16 --layers 2 --hidden 128
    python3 tools/bench_grad_cache.py --batches 2048 --impls cached     # plain: ~8.5 GiB/rank

GradCache: Gao, Zhang, Han, Callan, "Scaling Deep Contrastive Learning Batch Size under Memory
Limited Setup" (RepL4NLP 2021, arXiv:2101.06983), implemented in
:mod:`megaloss.losses.grad_cache`. The two implementations compared, on the same model, the same
inputs and the same collectives (every rank's documents are negatives, ``local_loss``):

* ``plain``: ``model(**batch).loss.backward()``, :class:`megaloss.integrations.hf.embedding.
  EmbeddingModelWithMNR` (mean-pooled shared encoder + gathered MNR): autograd keeps the encoder
  activations of all ``2 B`` sequences of the rank's batch until the backward.
* ``cached``: ``cached_mnr_forward(model, batch, mini_batch_size=m).loss.backward()``: embeds
  the batch ``m`` rows at a time without a graph, computes the loss and its gradient with respect
  to the embeddings once, then re-encodes each mini-batch with its graph and back-propagates
  that gradient. The encoder holds one mini-batch's activations at a time; what grows with
  ``B`` is the embeddings (``[B, H]`` per column, their gradients, the gathered ``[W B, H]``
  documents) and the score rows of the loss. It pays one extra encoder forward.

The encoder is a ``transformers.BertModel`` built from a config with random weights (nothing is
downloaded): ``--hidden`` 256, ``--layers`` 4, ``--heads`` 4, ``--ffn`` (default 4 x hidden),
``--vocab`` 1000 and ``--seq`` 32 by default (so the default run takes 2-3 minutes on 2 cores;
seq 64 measured 1.09 GiB per rank for the plain pass at B=128, so ~4.3 GiB at B=512), no
pooler, dropout 0 (both implementations then compute the same function: GradCache replays its
own dropout masks exactly, but they are not the plain pass's masks), float32. Inputs are a
function of ``B`` and the world size only: a generator seeded with ``B`` draws the global batch
(``W B`` query and document token ids ``[W B, T]``, ``T = --seq``, each row padded after a
uniform length in ``[T/2, T]``) and rank r takes rows ``[r B, (r+1) B)``. Weights come from
``torch.manual_seed(0)`` on every rank.

Measured, in ONE process group of ``--world`` spawned gloo ranks (1 thread each,
:func:`megaloss.testing.run_distributed`), after one untimed warm-up step of each
implementation at 4 rows per rank (thread pools, gloo buffers, and the parameters' ``.grad``
buffers, which then stay allocated: autograd accumulates into them), for every ``B`` and then
every implementation (``--impls`` order):

* memory: the rank's peak RSS during the step minus its RSS just before it
  (:class:`_bench_common.MemoryProbe`: ``VmHWM`` after ``echo 5 > /proc/self/clear_refs``;
  ``gc.collect()`` and ``malloc_trim(0)`` first, workers started with ``MALLOC_MMAP_THRESHOLD_=
  65536`` and ``MALLOC_ARENA_MAX=1`` so freed buffers go back to the OS). The baseline holds
  the model, its zeroed gradient buffers and the inputs, so the figure is the step's activation
  and working memory (a gradient formed in a temporary and then added counts). Max over ranks;
  the one process runs every case, each from a fresh baseline, as ``tools/bench_mnr.py`` does.
* time: wall-clock (``time ms``) and CPU time of the rank's process (``cpu ms``,
  ``time.process_time``, gloo's threads included) of the same step (and of ``--reps - 1`` more),
  median over reps, max over ranks. With more ranks than cores, or other load on the machine,
  the ranks share cores: wall times include the contention, CPU times much less so. Times are
  taken under the fixed malloc settings above (every large buffer a fresh mapping).
* the check, in the same run: after the first implementation's step each rank keeps a copy of
  its parameter gradients; after the second's, each rank computes, per parameter tensor,
  ``max|g_cached - g_plain| / max|g_plain|`` and the table prints the maximum over tensors and
  ranks (``grad_rel``), with the loss's relative difference (``loss_rel``). ``check`` is PASS
  when ``loss_rel <= 1e-5`` and ``grad_rel <= --grad-rtol`` (default 1e-4: the two sum the same
  float32 products in different orders). Exit status 1 if any check fails.

Columns: ``B/rank``, ``N`` (global batch), ``impl``, ``peak MiB/rank``, ``time ms``,
``cpu ms``, ``loss`` (the global MNR loss, same on every rank), and on the cached row ``mem x``,
``time x``, ``cpu x`` (cached / plain), ``loss_rel``, ``grad_rel`` and ``check``. ``--csv``
writes the same rows (full precision, plus ``peak_method``).
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
import time
from typing import Any, Dict, Iterator, List

import torch

_TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _TOOLS)
if os.path.dirname(_TOOLS) not in sys.path:  # megaloss from this checkout when not installed
    sys.path.insert(1, os.path.dirname(_TOOLS))
from _bench_common import MALLOC_ENV, MemoryProbe, format_table, mib, trim_memory, write_csv  # noqa: E402

IMPLS = ("plain", "cached")
LOSS_RTOL = 1e-5
WARMUP_ROWS = 4
COLUMNS = ["B_per_rank", "N", "impl", "peak_MiB", "time_ms", "cpu_ms", "loss", "mem_ratio",
           "time_ratio", "cpu_ratio", "loss_rel", "grad_rel", "check"]
HEADERS = {"B_per_rank": "B/rank", "peak_MiB": "peak MiB/rank", "time_ms": "time ms",
           "cpu_ms": "cpu ms", "mem_ratio": "mem x", "time_ratio": "time x", "cpu_ratio": "cpu x"}



def _build_model(args):
    from transformers import BertConfig, BertModel

    from megaloss.integrations.hf.embedding import EmbeddingModelWithMNR
    config = BertConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                        num_hidden_layers=args.layers, num_attention_heads=args.heads,
                        intermediate_size=args.ffn or 4 * args.hidden,
                        max_position_embeddings=max(512, args.seq),
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    encoder = BertModel(config, add_pooling_layer=False).float()
    model = EmbeddingModelWithMNR(encoder, temperature=args.temperature).train()
    return model, getattr(encoder.config, "_attn_implementation", "?")


def _inputs(b: int, world: int, rank: int, args) -> Dict[str, torch.Tensor]:
    """This rank's rows of the global batch of ``world * b`` pairs (a function of ``b``)."""
    gen = torch.Generator().manual_seed(b)
    n, t = world * b, args.seq
    batch = {}
    for side in ("query", "document"):
        ids = torch.randint(1, args.vocab, (n, t), generator=gen)
        lengths = torch.randint(max(1, t // 2), t + 1, (n, 1), generator=gen)
        mask = (torch.arange(t).unsqueeze(0) < lengths).long()
        own = slice(rank * b, rank * b + b)
        batch[f"{side}_input_ids"] = (ids * mask)[own].clone()
        batch[f"{side}_attention_mask"] = mask[own].clone()
    return batch


def _step(impl: str, model, batch, mini_batch: int) -> float:
    """One forward + backward; returns the (global) loss value."""
    from megaloss.integrations.hf.embedding import cached_mnr_forward
    if impl == "plain":
        out = model(**batch)
    else:
        out = cached_mnr_forward(model, batch, mini_batch_size=mini_batch)
    out.loss.backward()
    return float(out.value)


def _zero_grads(model) -> None:
    for p in model.parameters():
        if p.grad is None:  # a parameter the warm-up did not reach: preallocate it anyway
            p.grad = torch.zeros_like(p)
        else:
            p.grad.zero_()


def _grad_rel(cached: List[torch.Tensor], plain: List[torch.Tensor]) -> float:
    worst = 0.0
    for c, p in zip(cached, plain):
        scale = p.abs().max().item()
        diff = (c - p).abs().max().item()
        worst = max(worst, diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf))
    return worst


def _worker(rank: int, world: int, args) -> Dict[str, Any]:
    """One rank (gloo initialised, 1 thread, by :func:`megaloss.testing.run_distributed`)."""
    import torch.distributed as dist

    model, attn = _build_model(args)
    params = list(model.parameters())
    warm = _inputs(WARMUP_ROWS, world, rank, args)
    for impl in args.impls:  # lazily created state and the .grad buffers join the baseline
        _step(impl, model, warm, max(1, WARMUP_ROWS // 2))
    rows = []
    for b in args.batches:
        batch = _inputs(b, world, rank, args)
        results: Dict[str, Dict[str, Any]] = {}
        first_grads = None  # the first implementation's gradients, for the check
        for impl in args.impls:
            times, cpu, loss, peak, method = [], [], math.nan, 0, ""
            for rep in range(args.reps):
                _zero_grads(model)
                trim_memory()
                dist.barrier()
                if rep == 0:
                    probe = MemoryProbe("cpu")
                    probe.start()
                t0, c0 = time.perf_counter(), time.process_time()
                value = _step(impl, model, batch, args.mini_batch)
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
                if rep == 0:
                    peak, method, loss = probe.peak_above_baseline(), probe.method, value
                    if first_grads is None:
                        first_grads = (impl, [p.grad.clone() for p in params])
                    else:
                        grads = {first_grads[0]: first_grads[1], impl: [p.grad for p in params]}
                        results["grad_rel"] = _grad_rel(grads["cached"], grads["plain"])
            stats = torch.tensor([statistics.median(times), statistics.median(cpu), float(peak)],
                                 dtype=torch.float64)
            dist.all_reduce(stats, op=dist.ReduceOp.MAX)
            results[impl] = {"time_s": stats[0].item(), "cpu_s": stats[1].item(),
                             "peak_bytes": stats[2].item(),
                             "loss": loss, "method": method}
        first_grads = None
        if "grad_rel" in results:
            g = torch.tensor([results["grad_rel"]], dtype=torch.float64)
            dist.all_reduce(g, op=dist.ReduceOp.MAX)
            results["grad_rel"] = g.item()
        rows.append((b, results))
        del batch
    n_params = sum(p.numel() for p in params)
    return {"rows": rows, "attn": attn, "params": n_params}


@contextlib.contextmanager
def _environ(extra: Dict[str, str]) -> Iterator[None]:
    """``os.environ`` plus ``extra`` while the ranks are spawned (they inherit it at exec, when
    glibc reads its MALLOC_ settings), restored afterwards."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _table_rows(results: List, args) -> List[Dict[str, Any]]:
    rows = []
    for b, res in results:
        for impl in args.impls:
            r = res[impl]
            row = {"B_per_rank": b, "N": b * args.world, "impl": impl,
                   "peak_MiB": mib(r["peak_bytes"]), "time_ms": r["time_s"] * 1e3,
                   "cpu_ms": r["cpu_s"] * 1e3,
                   "loss": r["loss"], "peak_method": r["method"]}
            if impl == "cached" and "plain" in res:
                p = res["plain"]
                loss_rel = abs(r["loss"] - p["loss"]) / max(abs(p["loss"]), 1e-30)
                grad_rel = res.get("grad_rel", math.nan)
                ok = loss_rel <= LOSS_RTOL and grad_rel <= args.grad_rtol
                row.update(mem_ratio=r["peak_bytes"] / p["peak_bytes"]
                           if p["peak_bytes"] > 0 else math.nan,
                           time_ratio=r["time_s"] / p["time_s"],
                           cpu_ratio=r["cpu_s"] / p["cpu_s"], loss_rel=loss_rel,
                           grad_rel=grad_rel, check="PASS" if ok else "FAIL")
            rows.append(row)
    return rows


def _printable(row: Dict[str, Any]) -> Dict[str, Any]:
    fmt = {"peak_MiB": "{:.1f}", "time_ms": "{:.0f}", "cpu_ms": "{:.0f}", "loss": "{:.6f}",
           "mem_ratio": "{:.3f}", "time_ratio": "{:.2f}", "cpu_ratio": "{:.2f}",
           "loss_rel": "{:.1e}", "grad_rel": "{:.1e}"}
    out = {}
    for c in COLUMNS:
        v = row.get(c, "")
        out[HEADERS.get(c, c)] = fmt[c].format(v) if c in fmt and v != "" else v
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 128, 512],
                    help="per-rank batch sizes B (pairs per rank)")
    ap.add_argument("--world", type=int, default=2, help="gloo ranks (1 thread each)")
    ap.add_argument("--mini-batch", type=int, default=32, help="GradCache rows per encoder pass")
    ap.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS),
                    help="implementations, in the order they run at each B (the ratios and the "
                         "check need both)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=0, help="intermediate size (0: 4 x hidden)")
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--seq", type=int, default=32, help="tokens per query and per document")
    ap.add_argument("--temperature", type=float, default=0.05)
    ap.add_argument("--reps", type=int, default=1,
                    help="timed steps per case (the first also measures memory)")
    ap.add_argument("--grad-rtol", type=float, default=1e-4,
                    help="largest accepted max|g_cached - g_plain| / max|g_plain| per tensor")
    ap.add_argument("--csv", help="also write the table to this CSV file")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds for the whole run")
    args = ap.parse_args(argv)
    if min(args.batches) < 1 or args.mini_batch < 1 or args.world < 1 or args.reps < 1:
        ap.error("--batches, --mini-batch, --world and --reps must be >= 1")
    if args.hidden % args.heads:
        ap.error("--hidden must be divisible by --heads")
    args.impls = list(dict.fromkeys(args.impls))

    from megaloss.testing import run_distributed
    start = time.perf_counter()
    with _environ(MALLOC_ENV):
        out = run_distributed(_worker, args.world, args, timeout=args.timeout,
                              threads_per_rank=1)[0]
    rows = _table_rows(out["rows"], args)
    ffn = args.ffn or 4 * args.hidden
    print(f"gathered MNR bi-encoder, one fwd+bwd step: GradCache (mini-batch {args.mini_batch}, "
          f"Gao et al. 2021) vs plain autograd")
    print(f"encoder: random-init BertModel hidden {args.hidden}, {args.layers} layers, "
          f"{args.heads} heads, ffn {ffn}, vocab {args.vocab}, seq {args.seq} (query and "
          f"document), {out['params'] / 1e6:.2f} M params, attn {out['attn']}, dropout 0, "
          f"mean pooling; loss: cosine, T={args.temperature}, local_loss, documents of every "
          f"rank as negatives; float32")
    print(f"world {args.world} (spawn, gloo, 1 thread/rank) on {os.cpu_count()} cores, "
          f"torch {torch.__version__}; peak = peak RSS above the pre-step RSS (model, grads, "
          f"inputs), max over ranks; time (wall) and cpu (process CPU time): median of "
          f"{args.reps}, max over ranks\n")
    print(format_table([_printable(r) for r in rows], [HEADERS.get(c, c) for c in COLUMNS]))
    if any(r["peak_method"] != "VmHWM (reset via clear_refs)" for r in rows):
        print("note: the peak could not be reset here (no /proc/self/clear_refs): RSS deltas")
    checked = [r for r in rows if "check" in r]
    failed = [r for r in checked if r["check"] != "PASS"]
    if checked:
        print(f"\ncheck (cached vs plain: loss rel <= {LOSS_RTOL:g}, grad max rel <= "
              f"{args.grad_rtol:g}): {'FAIL' if failed else 'PASS'} at "
              f"{len(checked) - len(failed)}/{len(checked)} batch sizes")
    print(f"total {time.perf_counter() - start:.0f} s")
    if args.csv:
        write_csv(args.csv, rows, COLUMNS + ["peak_method"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
