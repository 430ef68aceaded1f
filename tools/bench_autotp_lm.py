#!/usr/bin/env python3
"""Benchmark, end to end: LM training under DeepSpeed AutoTP with DeepSpeed's own loss against
megaloss's, side by side in one run (CPU, gloo ranks spawned here, one fresh set per method).

Both methods train the LM job's model (``launch/jobs/models.py``, ``build_llama``: a
``transformers.LlamaForCausalLM``, random init, seeded) under the LM job's AutoTP ds_config
(``configs/autotp2.json``: ``"tensor_parallel": {"autotp_size": 2, "vocab_parallel_lm_head":
true}``, ZeRO 2, AdamW, micro-batch 8, GAS 2; its ``autotp_size`` set to ``--tp``, its
``megaloss.ce.chunk_size`` dropped so that megaloss picks its default, its ``z_loss`` 0 so that
both train the same loss), on the same token ids
(uniform over the vocabulary, a function of ``--seed`` alone: speed and memory do not depend on
the text):

* ``deepspeed``: ``deepspeed.initialize`` on the plain model; each micro-batch is
  ``engine(input_ids=..., labels=...).loss``: the model forms the ``[B, T, V / TP]`` logits of
  AutoTP's ``VocabParallelLinear`` lm_head and the loss AutoTP installs on it
  (``deepspeed/sequence/cross_entropy.py``, ``configure_vocab_parallel_loss``) takes them;
* ``megaloss``: :func:`megaloss.integrations.deepspeed.initialize` / ``train_step`` (the LM
  job's path): the decoder's hidden states and megaloss's chunked vocab-parallel CE on the same
  shard, no logits.

Measured per method (max over the TP ranks): seconds per optimizer step (median over the steps
after ``--warmup``, a barrier before each); the process's peak RSS over the whole run
(``VmHWM``: imports, model, optimizer states and the steps, what a user's ``top`` shows); and
the peak of the training steps above the RSS after the engine was built (``step_MiB``: the
activations, logits and loss buffers; malloc settings of ``tools/_bench_common.py``). Each
step's loss is reported against the other method's: the same model, data and token-mean CE, so
they agree to fp32 rounding (``max_loss_diff``).

    python3 tools/bench_autotp_lm.py                                    # the LM job's sizes
    python3 tools/bench_autotp_lm.py --vocab 32000 --seq_len 512 --model_size base
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
from typing import Any, Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, ROOT)  # launch.jobs.models: the LM job's model
from _bench_common import (  # noqa: E402
    MALLOC_ENV,
    MemoryProbe,
    finish,
    format_table,
    median,
    peak_rss_bytes,
    require_positive,
    trim_memory,
)

CONFIG = os.path.join(ROOT, "configs", "autotp2.json")
METHODS = ("deepspeed", "megaloss")
COLUMNS = ["method", "tp", "model_size", "vocab", "seq_len", "micro_batch", "gas", "steps",
           "s_per_step", "peak_rss_MiB", "step_MiB", "time_ratio", "rss_ratio", "step_mem_ratio",
           "max_loss_diff", "first_loss", "last_loss", "error"]
TABLE_COLUMNS = ["method", "s_per_step", "peak_rss_MiB", "step_MiB", "time_ratio", "rss_ratio",
                 "step_mem_ratio", "max_loss_diff", "first_loss", "last_loss"]


def ds_config(tp: int) -> Dict[str, Any]:
    """The LM job's AutoTP ds_config at ``autotp_size = tp``, no monitors, megaloss's default
    chunk, no z-loss."""
    with open(CONFIG) as f:
        cfg = json.load(f)
    cfg["tensor_parallel"]["autotp_size"] = tp
    for monitor in ("csv_monitor", "wandb", "tensorboard"):
        cfg.pop(monitor, None)
    cfg["megaloss"]["ce"].pop("chunk_size", None)
    cfg["megaloss"]["ce"]["z_loss"] = 0.0  # DeepSpeed's loss has none: the same loss both ways
    return cfg


def _batches(spec: Dict[str, Any], cfg: Dict[str, Any]):
    """``steps x GAS`` micro-batches of ``input_ids [micro, seq_len]`` of the ds_config ``cfg``
    (the same on every rank: a TP group sees one batch)."""
    import torch
    g = torch.Generator().manual_seed(spec["seed"])
    micro, gas = cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]
    return [[torch.randint(0, spec["vocab"], (micro, spec["seq_len"]), generator=g)
             for _ in range(gas)] for _ in range(spec["steps"])]


def _rank(rank: int, world: int, spec: Dict[str, Any]) -> Dict[str, Any]:
    """One rank of ``spec["method"]``: build, train ``spec["steps"]`` steps, report."""
    import deepspeed
    import torch.distributed as dist

    from launch.jobs.models import build_llama
    from megaloss.integrations.deepspeed.compat import configure_launched_process

    configure_launched_process()
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    args = argparse.Namespace(model_size=spec["model_size"], hidden_size=None, num_layers=None,
                              num_heads=None, seq_len=spec["seq_len"], seed=spec["seed"],
                              tie_word_embeddings=False)
    model, _ = build_llama(args, spec["vocab"])
    cfg = ds_config(spec["tp"])
    batches = _batches(spec, cfg)
    if spec["method"] == "megaloss":
        from megaloss.integrations.deepspeed import initialize, train_step
        me = initialize(model, cfg)
        engine = me.engine

        def step(mbs):
            return float(train_step(me, [{"input_ids": ids, "labels": ids} for ids in mbs],
                                    log=False).loss)
    else:
        engine, *_ = deepspeed.initialize(model=model, config=cfg,
                                          model_parameters=model.parameters())

        def step(mbs):
            total = 0.0
            for ids in mbs:
                loss = engine(input_ids=ids, labels=ids, use_cache=False).loss
                engine.backward(loss)
                engine.step()
                total += float(loss.detach())
            return total / len(mbs)  # train_step's loss: the step's token mean (equal counts)

    del model
    trim_memory()
    build_peak = peak_rss_bytes()  # read before the probe resets the high-water mark
    probe = MemoryProbe("cpu")
    probe.start()
    losses, times = [], []
    for mbs in batches:
        dist.barrier()
        t0 = time.perf_counter()
        losses.append(step(mbs))
        times.append(time.perf_counter() - t0)
    out = {"losses": losses, "times": times[spec["warmup"]:],
           "step_bytes": probe.peak_above_baseline(),
           "peak_rss_bytes": max(build_peak, peak_rss_bytes())}
    engine.destroy()
    gc.collect()
    return out


def _method_row(args, method: str) -> Dict[str, Any]:
    from megaloss.testing import run_distributed
    threads = max(1, args.cpus // args.tp)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    spec = {"method": method, "tp": args.tp, "model_size": args.model_size,
            "vocab": args.vocab, "seq_len": args.seq_len, "steps": args.steps,
            "warmup": args.warmup, "seed": args.seed}
    cfg = ds_config(args.tp)
    row = {"method": method, "tp": args.tp, "model_size": args.model_size, "vocab": args.vocab,
           "seq_len": args.seq_len, "micro_batch": cfg["train_micro_batch_size_per_gpu"],
           "gas": cfg["gradient_accumulation_steps"], "steps": args.steps, "error": ""}
    try:
        ranks = run_distributed(_rank, args.tp, spec, timeout=args.timeout,
                                threads_per_rank=threads)
    except Exception as e:  # noqa: BLE001 - a failed method is a row with its error
        last = (str(e).strip().splitlines() or [""])[-1]
        return dict(row, error=f"{type(e).__name__}: {last}", s_per_step=math.nan,
                    peak_rss_MiB=math.nan, step_MiB=math.nan, _losses=[])
    per_step = [max(r["times"][i] for r in ranks) for i in range(len(ranks[0]["times"]))]
    return dict(row, s_per_step=median(per_step),
                peak_rss_MiB=max(r["peak_rss_bytes"] for r in ranks) / 2 ** 20,
                step_MiB=max(r["step_bytes"] for r in ranks) / 2 ** 20,
                _losses=ranks[0]["losses"], first_loss=ranks[0]["losses"][0],
                last_loss=ranks[0]["losses"][-1])


def main(argv=None) -> int:
    from launch.jobs.models import LLAMA_SIZES

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=2, help="autotp_size, one rank each (default 2)")
    p.add_argument("--model_size", choices=sorted(LLAMA_SIZES), default="small",
                   help="the LM job's model sizes (default small, the job's)")
    p.add_argument("--vocab", type=int, default=2048,
                   help="vocabulary V (default 2048, the job's BPE vocabulary)")
    p.add_argument("--seq_len", type=int, default=128, help="tokens per row (default 128)")
    p.add_argument("--steps", type=int, default=12, help="optimizer steps (default 12)")
    p.add_argument("--warmup", type=int, default=2,
                   help="first steps left out of the timing (default 2)")
    p.add_argument("--cpus", type=int, default=os.cpu_count() or 1,
                   help="cores shared by the ranks: each gets max(1, cpus // TP) threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per method")
    p.add_argument("--csv", metavar="PATH", help="write every column as CSV")
    args = p.parse_args(argv)
    require_positive(p, args, ("tp", "vocab", "seq_len", "steps", "cpus"))
    if not 0 <= args.warmup < args.steps:
        p.error("--warmup must be in [0, --steps)")
    if args.tp < 2:
        p.error("--tp must be >= 2 (AutoTP shards the model over TP ranks)")
    os.environ.update(MALLOC_ENV)  # inherited by the spawned ranks
    rows: List[Dict[str, Any]] = []
    for method in METHODS:
        t0 = time.perf_counter()
        rows.append(_method_row(args, method))
        print(f"# {method}: done ({time.perf_counter() - t0:.1f} s)", file=sys.stderr,
              flush=True)
    mega = next(r for r in rows if r["method"] == "megaloss")
    for r in rows:
        r["time_ratio"] = mega["s_per_step"] / r["s_per_step"]
        r["rss_ratio"] = mega["peak_rss_MiB"] / r["peak_rss_MiB"]
        r["step_mem_ratio"] = mega["step_MiB"] / r["step_MiB"] if r["step_MiB"] else math.nan
        pairs = list(zip(mega["_losses"], r["_losses"]))
        r["max_loss_diff"] = max((abs(a - b) for a, b in pairs), default=math.nan)
    import deepspeed
    print(f"LM training under DeepSpeed {deepspeed.__version__} AutoTP {args.tp}: DeepSpeed's "
          f"loss on the head's logits vs megaloss's; model {args.model_size}, V={args.vocab}, "
          f"seq {args.seq_len}, micro-batch {rows[0]['micro_batch']}, GAS {rows[0]['gas']}, "
          f"{args.steps} steps ({args.warmup} untimed), CPU fp32, {args.cpus} cores shared by "
          f"the ranks; per rank, max over ranks; *_ratio = megaloss / this row")
    print(format_table(rows, TABLE_COLUMNS))
    errors = [f"{r['method']}: {r['error']}" for r in rows if r["error"]]
    return finish(errors, args.csv, rows, COLUMNS)


if __name__ == "__main__":
    sys.exit(main())
