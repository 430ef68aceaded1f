#!/usr/bin/env python3
"""Train a small Llama-style causal LM with megaloss's fused cross-entropy under DeepSpeed.

Run through the launcher (it passes ``--local_rank``) with the repository root on
``PYTHONPATH``, as ``launch/train_lm.sh`` does::

    PYTHONPATH=. deepspeed --num_gpus 2 launch/train_lm.py --deepspeed_config configs/zero2.json

or as one process from the repository root: ``python -m launch.train_lm``.

With no data arguments the job uses built-in real data: this interpreter's standard-library
source files (:mod:`launch.jobs.text_data`; whole files held out for evaluation). It trains a
byte-level BPE tokenizer on the training files (cached), builds a small Llama from a
``transformers`` ``LlamaConfig`` (random init, no download), and trains it with the loss computed
inside the module ``engine.forward`` runs: decoder hidden states -> vocab-parallel chunked CE over
the TP group (``megaloss.tensor_parallel_size`` in the ds_config; the default configs use TP=2,
ZeRO-2), no logits. Every optimizer step is globally calibrated (token mean over all micro-batches
and DP ranks, the engine's gradient scale measured at start-up).

Reports held-out perplexity before and after training, a progress bar and a summary table on
rank 0, metrics through ``engine.monitor`` (the ds_config's ``csv_monitor`` / ``tensorboard`` /
``wandb`` sections, all at DeepSpeed's global sample count), and writes ``metrics.csv``,
``loss_curve.png`` and ``summary.json`` to ``--output_dir`` (default ``runs/lm`` under the
current directory; a folder that holds a run is refused unless ``--resume`` or ``--overwrite``).

Checkpoints (``--save_every N``, ``--resume [latest|PATH]``, ``--eval_only``) go through
DeepSpeed's ``engine.save_checkpoint`` / ``load_checkpoint`` with the data position, RNG states,
tokenizer cache key and metrics so far, in every layout (under pipeline parallelism the
pipeline engine's, one file per pipeline layer: :mod:`launch.jobs.lm_pipeline`); SIGTERM /
SIGINT save at the next step boundary and write what ran. A resumed run continues bitwise as if
uninterrupted.
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from launch.jobs.arguments import (
    add_job_arguments,
    add_llama_arguments,
    add_lm_data_arguments,
    check_input_files,
    job_parser,
)
from launch.jobs.lm_data import eval_batches, load_blocks
from launch.jobs.lm_pipeline import build_pipeline_job, gather_per_rank, pipeline_parallel_size
from launch.jobs.models import build_llama
from launch.jobs.reporting import print_summary_table, rank0_logger
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
from launch.jobs.summaries import lm_summary_rows, write_lm_outputs
from launch.jobs.text_data import StepBatches

quiet_job_environment()

REPO = Path(__file__).resolve().parent.parent


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = job_parser(__doc__)
    p.add_argument("--deepspeed_config", type=str, default=str(REPO / "configs" / "zero2.json"),
                   help="ds_config JSON; its 'megaloss' section sets TP size and CE options")
    p.add_argument("--sequence_parallel_size", type=int, default=None,
                   help="DeepSpeed-Ulysses sequence parallelism: ranks sharing each sample's "
                        "tokens (overrides megaloss.sequence_parallel_size of the config); "
                        "NUM_PROCS must be a multiple of tp x sp")
    p.add_argument("--pipeline_parallel_size", type=int, default=None,
                   help="DeepSpeed pipeline stages (overrides megaloss.pipeline_parallel_size); "
                        "runs at ZeRO-1 when the config asks for more (the pipeline engine's "
                        "limit); NUM_PROCS must be a multiple of pp x tp")
    p.add_argument("--activation_checkpointing", action="store_true",
                   help="recompute activations in the backward instead of keeping them (less "
                        "memory, one more forward): every decoder layer (transformers' gradient "
                        "checkpointing), under PP every pipeline layer (activation checkpoint "
                        "interval 1); non-reentrant checkpoints in both")
    add_job_arguments(p, steps=150, output_dir=os.path.join("runs", "lm"))
    add_lm_data_arguments(p)
    add_llama_arguments(p)
    add_run_arguments(p)
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    if args.pipeline_parallel_size is not None and args.pipeline_parallel_size < 1:
        p.error("--pipeline_parallel_size must be >= 1")
    check_run_arguments(p, args)
    check_input_files(p, args)
    return args


def print_summary(summary: Dict[str, Any]) -> None:
    """The before/after table of held-out perplexity and losses, with the run's figures."""
    after = summary["eval_after"]
    stopped = summary.get("stopped")
    info = (f"{summary['steps']} steps in {summary['train_seconds']:.1f} s, "
            f"{summary['tokens_per_s']:.0f} tokens/s, layout DP={summary['dp']} x "
            f"SP={summary.get('sp', 1)} x TP={summary['tp']} x PP={summary.get('pp', 1)}, "
            f"ZeRO-{summary['zero_stage']}, "
            f"engine loss multiplier {summary['engine_loss_multiplier']:g}, peak memory "
            f"{summary['peak_memory_mib']:.0f} MiB/rank"
            + (f"; stopped by {stopped['signal']} at step {stopped['step']} (resume with "
               "--resume)" if stopped else ""))
    last = "after" if not (stopped and after) else f"step {after['step']}"
    rows = lm_summary_rows(summary, "train loss (first / last step)")
    print_summary_table("megaloss LM job", rows, info, columns=("metric", "before", last))


# main -------------------------------------------------------------------------------------------
def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    args = parse_args(argv)
    t_start = time.perf_counter()
    from megaloss import CausalLMWithLoss, Topology
    from megaloss.integrations.config import ds_config_autotp_size
    from megaloss.integrations.deepspeed import evaluate, initialize, load_ds_config, train_step
    from megaloss.integrations.hf.ulysses import enable_ulysses_attention

    rank, _ = start_process(args.local_rank, args.output_dir)
    out_dir = Path(args.output_dir)
    ckpt_dir = out_dir / CHECKPOINTS
    log = rank0_logger("lm", rank, t_start)

    # Inputs first, on every rank (same files, same answers), then the run folder on rank 0 with
    # its verdict shared: no rank fails alone.
    ds_config, ml = load_ds_config(args.deepspeed_config, output_dir=str(out_dir))
    resume_from = open_run(args, out_dir, ds_config)

    if args.sequence_parallel_size is not None:
        ml.sequence_parallel_size = args.sequence_parallel_size
        ds_config.setdefault("megaloss", {})["sequence_parallel_size"] = args.sequence_parallel_size
    pp = pipeline_parallel_size(args, ml, ds_config)
    # AutoTP ("tensor_parallel": {"autotp_size": N} in the ds_config): DeepSpeed builds the
    # groups and shards the model inside initialize, which returns the topology
    autotp = ds_config_autotp_size(ds_config) > 1
    topo = None if pp > 1 or autotp else Topology.build(ml.tensor_parallel_size,
                                              sequence_parallel_size=ml.sequence_parallel_size)
    micro = ds_config.get("train_micro_batch_size_per_gpu", 1)
    gas = ds_config.get("gradient_accumulation_steps", 1)

    tok, train_blocks, held_blocks, info, data_key = load_blocks(args, log)
    vocab = tok.get_vocab_size()

    restore_attention = lambda: None  # noqa: E731
    if pp > 1:  # DeepSpeed's pipeline engine: the Llama in stages (launch/jobs/lm_pipeline.py)
        pipe = build_pipeline_job(args, ds_config, ml, vocab, str(out_dir), log)
        me, cfg, n_params, topo = pipe.me, pipe.config, pipe.parameters, pipe.me.topology
        step_fn, eval_fn = pipe.train_step, pipe.evaluate
    else:
        model, cfg = build_llama(args, vocab, "sdpa" if topo and topo.sp_size > 1 else None)
        if args.activation_checkpointing:
            # non-reentrant, as under PP: the reentrant checkpoint needs its inputs to require
            # grad (torch.utils.checkpoint's documentation)
            if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x's name
                model.activation_checkpointing_enable(
                    activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": False})
        # With SP each rank runs the decoder on its slice of every sample; attention all-to-alls
        # heads over the SP group (DeepSpeed's UlyssesSPAttentionHF).
        # (process-global: restored when the job ends, for a caller that goes on in-process)
        if not autotp:
            restore_attention = enable_ulysses_attention(model, topo, micro_batch_size=micro)
        # decoder + the full (unsharded) lm_head, whatever the TP size (a tied one is the
        # embedding)
        n_params = sum(p.numel() for p in model.base_model.parameters()) + (
            0 if cfg.tie_word_embeddings else vocab * cfg.hidden_size)
        if autotp:  # the *ForCausalLM itself: initialize wraps it for AutoTP's lm_head shard
            me = initialize(model, ds_config, output_dir=str(out_dir))
            topo = me.topology
        else:
            wrapper = CausalLMWithLoss(model, options=ml.ce.options(), tp_group=topo.tp_group)
            me = initialize(wrapper, ds_config, topology=topo, output_dir=str(out_dir))
        step_fn = lambda mbs: train_step(me, mbs)  # noqa: E731
        eval_fn = lambda batches, log=True: evaluate(me, batches, log=log)  # noqa: E731
    engine = me.engine
    log(f"engine ready: DP={topo.dp_size} x SP={topo.sp_size} x TP={topo.tp_size} x PP={pp}, "
        f"ZeRO-{engine.zero_optimization_stage()}, micro-batch {micro} x GAS {gas} x DP "
        f"{topo.dp_size} = {micro * gas * topo.dp_size} x {args.seq_len} tokens/step, "
        f"{n_params / 1e6:.2f} M params, measured engine loss multiplier "
        f"{me.engine_scale.loss_multiplier:g} ({me.engine_scale.engine}), CE {ml.ce.model_dump()}")
    held = eval_batches(held_blocks, micro, topo.dp_size, topo.dp_rank)

    # what a resumed run needs besides the engine's own state
    job_state: Dict[str, Any] = {"rows": [], "evals": [], "train_seconds": 0.0, "saves": []}
    if resume_from is not None:
        resume_from = resume_job_state(
            me, resume_from, job_state, {"data_key": data_key},
            "--train_data / --eval_data / --eval_fraction / --max_train_bytes / --vocab_size",
            log)
    start = int(engine.global_steps)
    saves_before = len(job_state["saves"])  # the resumed run's record; summary: this run's

    if args.eval_only:
        log(f"evaluating checkpoint {resume_from} (step {start})")
        result = eval_fn(held, log=False)
        return report_checkpoint_eval(out_dir, rank, "megaloss LM job", resume_from, start,
                                      vars(result), [
                                          ("held-out perplexity", f"{result.perplexity:.1f}"),
                                          ("held-out CE (nats/token)", f"{result.loss:.4f}")])

    rows: List[Dict[str, Any]] = job_state["rows"]
    evals: List[Dict[str, Any]] = job_state["evals"]
    saves: List[Dict[str, Any]] = job_state["saves"]
    if not evals:
        evals.append({"step": 0, **vars(eval_fn(held))})
        log(f"before training: held-out CE {evals[0]['loss']:.4f}, perplexity "
            f"{evals[0]['perplexity']:.1f}")

    def save(step: int) -> None:
        job = {"name": "lm", "data_key": data_key, "seed": args.seed, "seq_len": args.seq_len,
               "steps_done": step, "rows": rows, "evals": evals, "saves": saves,
               "train_seconds": loop.seconds}
        save_run(me, ckpt_dir, step, job, tok, args.keep_checkpoints, saves, log)

    batches = StepBatches(train_blocks, micro=micro, gas=gas, dp_size=topo.dp_size,
                          dp_rank=topo.dp_rank, seed=args.seed).iter_from(start)
    stop = StopRequest().install()
    loop = TrainLoop(args, start, job_state["train_seconds"], stop, engine.device, save, log)
    for step in loop:
        m = step_fn(next(batches))
        rows.append(m.as_dict())
        if args.eval_every and step % args.eval_every == 0 and step != args.steps:
            evals.append({"step": m.step, **vars(eval_fn(held))})
        loop.show(loss=f"{m.loss:.3f}", ppl_eval=f"{evals[-1]['perplexity']:.0f}",
                  tok_s=f"{m.tokens_per_s:.0f}")
    stopped, train_seconds = loop.stopped, loop.seconds
    last = rows[-1]["step"] if rows else start
    if stopped is None and evals[-1]["step"] != last:
        evals.append({"step": last, **vars(eval_fn(held))})
        log(f"after training: held-out CE {evals[-1]['loss']:.4f}, perplexity "
            f"{evals[-1]['perplexity']:.1f}")

    tokens = sum(r["num_tokens"] for r in rows)
    summary = {
        "eval_before": evals[0], "eval_after": evals[-1] if len(evals) > 1 else None,
        "steps": last, "steps_requested": args.steps, "stopped": stopped,
        "resumed_from": resume_from and str(resume_from), "resumed_at_step": start,
        "first_loss": rows[0]["loss"] if rows else None,
        "last_loss": rows[-1]["loss"] if rows else None,
        "train_seconds": train_seconds, "tokens_per_s": tokens / max(train_seconds, 1e-9),
        "train_tokens_seen": tokens,
        "peak_memory_mib": max((r["peak_memory_mib"] for r in rows), default=0.0),
        "peak_memory_mib_per_rank": gather_per_rank(
            max((r["peak_memory_mib"] for r in rows), default=0.0)),
        "parameters_per_rank": gather_per_rank(sum(p.numel() for p in engine.module.parameters())),
        "dp": topo.dp_size, "sp": topo.sp_size, "tp": topo.tp_size, "pp": pp, "autotp": autotp,
        "zero_stage": engine.zero_optimization_stage(), "micro_batch": micro, "gas": gas,
        "activation_checkpointing": bool(args.activation_checkpointing),
        "seq_len": args.seq_len, "vocab_size": vocab, "parameters": int(n_params),
        "engine_loss_multiplier": me.engine_scale.loss_multiplier,
        "ce": ml.ce.model_dump(), "data": "stdlib" if not args.train_data else "user files",
        "model": f"Llama {cfg.num_hidden_layers}L x {cfg.hidden_size}",
        "checkpoints": checkpoint_stats(saves, since=saves_before), "data_key": data_key,
        "total_seconds": time.perf_counter() - t_start, **info,
    }
    finish_run(out_dir, rank, lambda: write_lm_outputs(
        out_dir, rows, evals, summary, f"megaloss LM: {summary['model']} on {summary['data']}"),
        lambda: print_summary(summary), log, engine=engine, stop=stop)
    restore_attention()
    return summary


if __name__ == "__main__":
    run_job(main)
