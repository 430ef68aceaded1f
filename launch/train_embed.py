#!/usr/bin/env python3
"""Train a small code-search embedding model with gathered MNR under DeepSpeed.

Run through the launcher (it passes ``--local_rank``) with the repository root on
``PYTHONPATH``, as ``launch/train_embed.sh`` does::

    export PYTHONPATH=.
    deepspeed --num_gpus 2 launch/train_embed.py                 # built-in ZeRO-2 config
    deepspeed --num_gpus 2 launch/train_embed.py --deepspeed_config configs/zero3.json \
        --micro_batch_size 32 --gradient_accumulation_steps 1
    deepspeed --num_gpus 2 launch/train_embed.py --micro_batch_size 512 --mini_batch_size 32

or as one process from the repository root: ``python -m launch.train_embed``.

With no data arguments the job uses built-in real data: (docstring -> function source) pairs
extracted from this interpreter's standard library, whole files held out for evaluation
(:mod:`launch.jobs.code_search`). It trains a byte-level BPE tokenizer on the training texts
(cached; :mod:`launch.jobs.pair_data`), a small BERT-style encoder from a ``transformers``
config (random init, no download), mean pooling, and the gathered MNR loss computed inside the
module ``engine.forward`` runs (``megaloss.integrations.hf.embedding``); every step's loss is the
query mean over the global batch, with the engine's gradient scale measured at start-up.
``--mini_batch_size`` (or ``"mini_batch_size"`` in the ``megaloss.mnr`` section) turns on
GradCache (``megaloss.integrations.hf.embedding.cached_mnr_forward``): the same loss and
gradients with the encoder's activations of one mini-batch at a time. It
reports held-out MRR@10 and recall@1 before and after training, a progress bar and a summary
table on rank 0, metrics through ``engine.monitor`` (so the ds_config's ``csv_monitor`` /
``tensorboard`` / ``wandb`` sections work; every event at DeepSpeed's global sample count), and
writes ``metrics.csv``, ``loss_curve.png`` and ``summary.json`` to ``--output_dir`` (default
``runs/embed`` under the current directory; a folder that holds a run is refused unless
``--resume`` or ``--overwrite``).

Checkpoints (``--save_every N``, ``--resume [latest|PATH]``, ``--eval_only``) go through
DeepSpeed's ``engine.save_checkpoint`` / ``load_checkpoint`` with the data position, every rank's
RNG states (dropout), the data cache key and the metrics so far; SIGTERM / SIGINT save at the
next step boundary and write what ran.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from launch.jobs.arguments import (
    add_embedding_arguments,
    add_job_arguments,
    add_pair_data_arguments,
    check_input_files,
    job_parser,
    require_at_least,
)
from launch.jobs.models import build_encoder
from launch.jobs.pair_data import encode_pairs, load_pairs_cached, tokenizer_cached
from launch.jobs.reporting import (
    Curve,
    plot_loss_curve,
    print_summary_table,
    rank0_logger,
    write_metrics_csv,
    write_summary_json,
)
from launch.jobs.retrieval import evaluate_engine
from launch.jobs.runs import (
    CHECKPOINTS,
    StopRequest,
    TrainLoop,
    add_run_arguments,
    check_run_arguments,
    checkpoint_stats,
    finish_run,
    open_run,
    quiet_job_environment,
    report_checkpoint_eval,
    resume_job_state,
    run_job,
    save_run,
    start_process,
)
from launch.jobs.summaries import retrieval_summary_rows
from launch.jobs.text_data import EOS, StepBatches

quiet_job_environment()


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = job_parser(__doc__)
    p.add_argument("--deepspeed_config", type=str, default=None,
                   help="ds_config JSON (its 'megaloss.mnr' section sets the loss); default: "
                        "a built-in ZeRO-2 config (micro-batch 32, GAS 1)")
    add_job_arguments(p, steps=200, output_dir=os.path.join("runs", "embed"))
    add_pair_data_arguments(p)
    add_embedding_arguments(p)
    g = p.add_argument_group("batches and logging")
    g.add_argument("--micro_batch_size", type=int, default=None,
                   help="pairs per rank per micro-batch (overrides the ds_config)")
    g.add_argument("--gradient_accumulation_steps", type=int, default=None,
                   help="overrides the ds_config")
    g.add_argument("--max_query_len", type=int, default=32)
    g.add_argument("--max_doc_len", type=int, default=128)
    g.add_argument("--log_every", type=int, default=1,
                   help="write monitor events every N steps (metrics.csv gets every step)")
    add_run_arguments(p)
    args = p.parse_args(argv)
    check_run_arguments(p, args)
    check_input_files(p, args)
    require_at_least(p, args, ("mini_batch_size", "steps", "vocab_size", "max_query_len",
                               "max_doc_len", "eval_batch_size", "log_every"))
    return args


# Used when --deepspeed_config is not given. Same conventions as configs/*.json (torch AdamW via
# the launcher, huge steps_per_print, csv_monitor on); ZeRO-2 like the LM job's default.
DEFAULT_DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 32,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 2},
    "zero_allow_untested_optimizer": True,
    "steps_per_print": 1000000000,
    "csv_monitor": {"enabled": True, "output_path": "", "job_name": "megaloss"},
    "megaloss": {"mnr": {"temperature": 0.05, "symmetric": True}},
}


def prepare_ds_config(args: argparse.Namespace) -> dict:
    """The ds_config dict: the file (or :data:`DEFAULT_DS_CONFIG`) with the command line's batch
    overrides. The embedding job is data parallel only: ``megaloss.tensor_parallel_size`` is set
    to 1 (the same JSON can drive the TP=2 LM job)."""
    if args.deepspeed_config:
        with open(args.deepspeed_config, encoding="utf-8") as f:
            config = json.load(f)
    else:
        config = json.loads(json.dumps(DEFAULT_DS_CONFIG))
    if args.micro_batch_size is not None:
        config["train_micro_batch_size_per_gpu"] = args.micro_batch_size
    if args.gradient_accumulation_steps is not None:
        config["gradient_accumulation_steps"] = args.gradient_accumulation_steps
    if args.mini_batch_size is not None:
        section = config.setdefault("megaloss", {})
        if isinstance(section, dict):
            section.setdefault("mnr", {})["mini_batch_size"] = args.mini_batch_size
    # Keep DeepSpeed's three batch keys consistent after the overrides.
    config.pop("train_batch_size", None)
    config.setdefault("train_micro_batch_size_per_gpu", 32)
    config.setdefault("gradient_accumulation_steps", 1)
    section = config.setdefault("megaloss", {})
    if isinstance(section, dict):
        section["tensor_parallel_size"] = 1
    return config


# reporting --------------------------------------------------------------------------------------
def write_outputs(out_dir: Path, rows: List[Dict[str, float]], summary: Dict) -> None:
    """``metrics.csv`` (one row per step), ``summary.json`` and ``loss_curve.png`` (MNR loss and
    in-batch accuracy) in ``out_dir``."""
    write_metrics_csv(out_dir / "metrics.csv", rows)
    write_summary_json(out_dir / "summary.json", summary)
    steps = [r["step"] for r in rows]
    b, a = summary["eval_before"], summary["eval_after"]
    title = (f"code-search embedding: MRR@10 {b['mrr@10']:.3f} -> {a['mrr@10']:.3f}" if a else
             f"code-search embedding: MRR@10 {b['mrr@10']:.3f} (stopped at step "
             f"{summary['steps']})")
    plot_loss_curve(
        out_dir / "loss_curve.png",
        [Curve("MNR loss (global batch)", steps, [r["loss"] for r in rows], style={"lw": 1})],
        secondary=[Curve("in-batch accuracy", steps, [r["accuracy"] for r in rows],
                         style={"color": "tab:orange", "alpha": 0.6, "lw": 1})],
        title=title, ylabel="loss", secondary_ylabel="in-batch top-1 accuracy")


def print_summary(summary: Dict) -> None:
    """The before/after table of held-out retrieval metrics and training figures."""
    rows = retrieval_summary_rows(summary, "train MNR loss (first/last step)")
    if summary["first_loss"] is not None:
        rows.append(("train in-batch accuracy", f"{summary['first_accuracy']:.4f}",
                     f"{summary['last_accuracy']:.4f}"))
    stopped = summary.get("stopped")
    extra = (f"{summary['train_pairs']} train / {summary['eval_pairs']} held-out pairs, "
             f"{summary['steps']} steps x {summary['global_batch']} pairs, "
             f"{summary['parameters'] / 1e6:.2f} M params, {summary['train_seconds']:.0f} s"
             + (f"; stopped by {stopped['signal']} at step {stopped['step']} (resume with "
                "--resume)" if stopped else ""))
    print_summary_table("code-search embedding (gathered MNR)", rows, extra)


# main -------------------------------------------------------------------------------------------
def main(argv: Optional[Sequence[str]] = None) -> Dict:
    args = parse_args(argv)
    t_start = time.perf_counter()
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    from megaloss import Topology
    from megaloss.integrations.deepspeed import initialize, load_ds_config, write_metrics
    from megaloss.integrations.grad_cache import inner_replay_backward
    from megaloss.integrations.hf import EmbeddingModelWithMNR, cached_mnr_forward
    from megaloss.integrations.hf.embedding import step_loss_weights
    from megaloss.integrations.step.metrics import peak_memory_mib

    rank, _ = start_process(args.local_rank, args.output_dir)
    torch.manual_seed(args.seed)
    out_dir = Path(args.output_dir)
    ckpt_dir = out_dir / CHECKPOINTS
    log = rank0_logger("embed", rank, t_start)

    ds_config, ml = load_ds_config(prepare_ds_config(args), output_dir=str(out_dir))
    resume_from = open_run(args, out_dir, ds_config)

    topo = Topology.build(1)
    group = topo.dp_group  # pure data parallel: the DP group is the world
    dp_size, dp_rank = topo.dp_size, topo.dp_rank
    micro = int(ds_config["train_micro_batch_size_per_gpu"])
    gas = int(ds_config["gradient_accumulation_steps"])

    train, held, data_key = load_pairs_cached(args)
    tokenizer = tokenizer_cached([t for p in train for t in (p.query, p.document)],
                                 args.vocab_size, args.cache_dir, args.local_rank)
    pad_id = tokenizer.token_to_id(EOS)  # any id works under the attention mask
    train_enc = encode_pairs(tokenizer, train, args.max_query_len, args.max_doc_len)
    held_enc = encode_pairs(tokenizer, held, args.max_query_len, args.max_doc_len)
    if len(train) < micro * gas * dp_size:
        raise SystemExit(f"{len(train)} training pairs cannot fill one global batch of "
                         f"{micro * gas * dp_size} (micro-batch {micro} x GAS {gas} x DP "
                         f"{dp_size}): give more data or a smaller --micro_batch_size")
    log(f"data: {len(train)} train / {len(held)} held-out pairs "
        f"({'stdlib' if args.train_data is None else 'user data'}), BPE vocab "
        f"{tokenizer.get_vocab_size()}")

    encoder = build_encoder(args.model_size, tokenizer.get_vocab_size(),
                            max(args.max_query_len, args.max_doc_len), pad_id, args.dropout)
    model = EmbeddingModelWithMNR(encoder, options=ml.mnr.options(), group=group)
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = lr_scheduler = None
    if "optimizer" not in ds_config:
        # A torch optimizer: DeepSpeed's FusedAdam / CPUAdam would JIT-compile ops on CPU.
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
        if "scheduler" not in ds_config:  # linear warm-up, cosine decay to 10 % of --lr
            lr_scheduler = get_cosine_with_min_lr_schedule_with_warmup(
                optimizer, num_warmup_steps=args.warmup_steps, num_training_steps=args.steps,
                min_lr_rate=0.1)
    me = initialize(model, ds_config, topology=topo, optimizer=optimizer,
                    lr_scheduler=lr_scheduler, output_dir=str(out_dir))
    engine = me.engine
    # The engine leaves c * (sum of all ranks' micro-batch gradients); the probe measured 1/c.
    multiplier = me.engine_scale.loss_multiplier
    log(f"engine ready: DP={dp_size}, ZeRO-{engine.zero_optimization_stage()}, micro-batch "
        f"{micro} x GAS {gas} x DP {dp_size} = {micro * gas * dp_size} pairs/step, "
        f"{n_params / 1e6:.2f} M params, measured engine loss multiplier {multiplier:g} "
        f"({me.engine_scale.engine}), MNR {ml.mnr.model_dump()}")

    # what a resumed run needs besides the engine's own state
    job_state: Dict = {"rows": [], "before": None, "train_seconds": 0.0, "saves": []}
    if resume_from is not None:
        resume_from = resume_job_state(
            me, resume_from, job_state, {"data_key": data_key, "vocab_size": args.vocab_size},
            "--train_data / --eval_data / --eval_fraction / --max_train / --max_eval / "
            "--vocab_size", log)
    start = int(engine.global_steps)
    saves_before = len(job_state["saves"])  # the resumed run's record; summary: this run's

    if args.eval_only:
        log(f"evaluating checkpoint {resume_from} (step {start})")
        result = evaluate_engine(engine, held_enc, args.eval_batch_size, group)
        return report_checkpoint_eval(out_dir, rank, "code-search embedding", resume_from, start,
                                      result, [(k, f"{v:.4f}") for k, v in result.items()])

    rows: List[Dict[str, float]] = job_state["rows"]
    saves: List[Dict] = job_state["saves"]
    before = job_state["before"]
    if before is None:
        before = evaluate_engine(engine, held_enc, args.eval_batch_size, group)
        write_metrics(engine, before, prefix="Eval/megaloss/")
        log(f"before training: held-out MRR@10 {before['mrr@10']:.4f}, "
            f"recall@1 {before['recall@1']:.4f}")

    def save(step: int) -> None:
        job = {"name": "embed", "data_key": data_key, "vocab_size": args.vocab_size,
               "seed": args.seed, "steps_done": step, "rows": rows, "before": before,
               "saves": saves,
               "train_seconds": loop.seconds}
        save_run(me, ckpt_dir, step, job, tokenizer, args.keep_checkpoints, saves, log)

    mini = ml.mnr.mini_batch_size
    batches = StepBatches(train_enc, micro=micro, gas=gas, dp_size=dp_size, dp_rank=dp_rank,
                          seed=args.seed).iter_from(start)
    stop = StopRequest().install()
    loop = TrainLoop(args, start, job_state["train_seconds"], stop, engine.device, save, log)
    for step in loop:
        t0 = time.perf_counter()
        # The step's micro-batches, known up front: their sizes give the GAS compensation
        # weights (one all-reduce); all ones when every micro-batch has the same global
        # size.
        micro_batches = next(batches)
        weights = step_loss_weights([len(b["query_input_ids"]) for b in micro_batches],
                                    group, loss_multiplier=multiplier, device=engine.device)
        # The step's global loss and accuracy, sum_m (n_m / N) (L_m, acc_m), and the
        # gradient norm (a device tensor under ZeRO-1/2) stay on the device until one read
        # per step.
        stats = torch.zeros(3, device=engine.device)
        for b, w in zip(micro_batches, weights):
            batch = {k: v.to(engine.device) for k, v in b.items()}
            if mini is None:
                out = engine(**batch, loss_weight=w)
            else:  # GradCache: the replays but the last run as accumulation passes
                out = cached_mnr_forward(engine, batch, mini_batch_size=mini,
                                         backward=inner_replay_backward(engine), loss_weight=w)
            engine.backward(out.loss)
            engine.step()
            share = w * (dp_size / multiplier)
            stats[:2] += share * torch.stack([out.value, out.accuracy]).float()
        norm = engine.get_global_grad_norm()
        stats[2] = float("nan") if norm is None else norm
        loss, accuracy, grad_norm = stats.tolist()  # the step's one host sync
        seconds = time.perf_counter() - t0
        row = {"step": int(engine.global_steps), "loss": loss, "accuracy": accuracy,
               "lr": float(engine.get_lr()[0]), "grad_norm": grad_norm,
               "pairs_per_s": micro * gas * dp_size / seconds, "step_time_s": seconds,
               "peak_memory_mib": peak_memory_mib(engine.device),
               "samples": int(engine.global_samples)}
        rows.append(row)
        if step % args.log_every == 0 or step == args.steps:
            events = {("mnr_" + k if k in ("loss", "accuracy") else k): v
                      for k, v in row.items() if k not in ("step", "samples")}
            events["optimizer_step"] = row["step"]
            write_metrics(engine, events)  # Train/megaloss/mnr_loss, ...
        loop.show(loss=f"{row['loss']:.3f}", acc=f"{row['accuracy']:.2f}")
    stopped, train_seconds = loop.stopped, loop.seconds
    last = rows[-1]["step"] if rows else start
    after = None
    if stopped is None:
        log(f"trained {last} steps in {train_seconds:.1f} s")
        after = evaluate_engine(engine, held_enc, args.eval_batch_size, group)
        write_metrics(engine, after, prefix="Eval/megaloss/")
        log(f"after training: held-out MRR@10 {after['mrr@10']:.4f}, "
            f"recall@1 {after['recall@1']:.4f}")

    first_row, last_row = (rows[0], rows[-1]) if rows else ({}, {})
    summary = {"eval_before": before, "eval_after": after, "steps": last,
               "steps_requested": args.steps, "stopped": stopped,
               "resumed_from": resume_from and str(resume_from), "resumed_at_step": start,
               "first_loss": first_row.get("loss"), "last_loss": last_row.get("loss"),
               "first_accuracy": first_row.get("accuracy"),
               "last_accuracy": last_row.get("accuracy"),
               "train_pairs": len(train), "eval_pairs": len(held), "dp": dp_size,
               "micro_batch": micro, "gas": gas, "global_batch": micro * gas * dp_size,
               "parameters": n_params, "model": f"BERT {args.model_size} "
               f"({encoder.config.num_hidden_layers}L x {encoder.config.hidden_size})",
               "zero_stage": engine.zero_optimization_stage(),
               "engine_loss_multiplier": multiplier, "mnr": ml.mnr.model_dump(),
               "data": "stdlib" if args.train_data is None else "user data",
               "peak_memory_mib": max((r["peak_memory_mib"] for r in rows), default=0.0),
               "checkpoints": checkpoint_stats(saves, since=saves_before),
               "data_key": data_key,
               "train_seconds": train_seconds, "total_seconds": time.perf_counter() - t_start}
    finish_run(out_dir, rank, lambda: write_outputs(out_dir, rows, summary),
               lambda: print_summary(summary), log, engine=engine, stop=stop)
    return summary


if __name__ == "__main__":
    run_job(main)
