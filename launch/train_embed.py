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
from typing import Any, Dict, Optional, Sequence

import torch

from launch.jobs.arguments import (
    add_embedding_arguments,
    add_job_arguments,
    add_pair_data_arguments,
    add_run_arguments,
    check_job_arguments,
    job_parser,
    require_at_least,
)
from launch.jobs.checkpoints import DeepSpeedCheckpoints
from launch.jobs.embed_step import embed_step
from launch.jobs.models import build_encoder
from launch.jobs.pair_data import encode_pairs, load_pairs_cached, tokenizer_cached
from launch.jobs.reporting import Curve
from launch.jobs.retrieval import evaluate_engine
from launch.jobs.runner import Job, StopRequest, Table, run, run_job
from launch.jobs.summaries import retrieval_summary_rows
from launch.jobs.text_data import EOS, StepBatches

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


# the job ----------------------------------------------------------------------------------------
def figures(entry: Optional[Dict[str, Any]]) -> Optional[Dict[str, float]]:
    """An evaluation without the step it was recorded at."""
    return entry and {k: v for k, v in entry.items() if k != "step"}


class Embedding(Job):
    """The job for the runner (:mod:`launch.jobs.runner`): the encoder with gathered MNR in its
    forward under DeepSpeed, :func:`launch.jobs.embed_step.embed_step` each step, held-out
    retrieval before and after training."""

    tag, title = "embed", "code-search embedding"

    def configure(self) -> dict:
        from megaloss.integrations.deepspeed import load_ds_config

        self.ds_config, self.ml = load_ds_config(prepare_ds_config(self.args),
                                                 output_dir=str(self.out_dir))
        return self.ds_config

    def build(self) -> None:
        from transformers import get_cosine_with_min_lr_schedule_with_warmup

        from megaloss import Topology
        from megaloss.integrations.deepspeed import initialize
        from megaloss.integrations.hf import EmbeddingModelWithMNR

        args, ds_config, ml, log = self.args, self.ds_config, self.ml, self.run.log
        torch.manual_seed(args.seed)
        topo = Topology.build(1)
        self.group = group = topo.dp_group  # pure data parallel: the DP group is the world
        self.dp_size = dp_size = topo.dp_size
        self.dp_rank = topo.dp_rank
        self.micro = micro = int(ds_config["train_micro_batch_size_per_gpu"])
        self.gas = gas = int(ds_config["gradient_accumulation_steps"])
        train, held, self.data_key = load_pairs_cached(args)
        self.tok = tokenizer_cached([t for p in train for t in (p.query, p.document)],
                                    args.vocab_size, args.cache_dir, args.local_rank)
        pad_id = self.tok.token_to_id(EOS)  # any id works under the attention mask
        self.train_enc = encode_pairs(self.tok, train, args.max_query_len, args.max_doc_len)
        self.held_enc = encode_pairs(self.tok, held, args.max_query_len, args.max_doc_len)
        self.n_train, self.n_held = len(train), len(held)
        if len(train) < micro * gas * dp_size:
            raise SystemExit(f"{len(train)} training pairs cannot fill one global batch of "
                             f"{micro * gas * dp_size} (micro-batch {micro} x GAS {gas} x DP "
                             f"{dp_size}): give more data or a smaller --micro_batch_size")
        log(f"data: {len(train)} train / {len(held)} held-out pairs "
            f"({'stdlib' if args.train_data is None else 'user data'}), BPE vocab "
            f"{self.tok.get_vocab_size()}")

        self.encoder = build_encoder(args.model_size, self.tok.get_vocab_size(),
                                     max(args.max_query_len, args.max_doc_len), pad_id,
                                     args.dropout)
        model = EmbeddingModelWithMNR(self.encoder, options=ml.mnr.options(), group=group)
        self.n_params = n_params = sum(p.numel() for p in model.parameters())
        optimizer = lr_scheduler = None
        if "optimizer" not in ds_config:
            # A torch optimizer: DeepSpeed's FusedAdam / CPUAdam would JIT-compile ops on CPU.
            optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
            if "scheduler" not in ds_config:  # linear warm-up, cosine decay to 10 % of --lr
                lr_scheduler = get_cosine_with_min_lr_schedule_with_warmup(
                    optimizer, num_warmup_steps=args.warmup_steps, num_training_steps=args.steps,
                    min_lr_rate=0.1)
        me = initialize(model, ds_config, topology=topo, optimizer=optimizer,
                        lr_scheduler=lr_scheduler, output_dir=str(self.out_dir))
        self.me, self.engine = me, me.engine
        self.device = self.engine.device
        # The engine leaves c * (sum of all ranks' micro-batch gradients); the probe measured 1/c.
        self.multiplier = multiplier = me.engine_scale.loss_multiplier
        log(f"engine ready: DP={dp_size}, ZeRO-{self.engine.zero_optimization_stage()}, "
            f"micro-batch {micro} x GAS {gas} x DP {dp_size} = {micro * gas * dp_size} "
            f"pairs/step, {n_params / 1e6:.2f} M params, measured engine loss multiplier "
            f"{multiplier:g} ({me.engine_scale.engine}), MNR {ml.mnr.model_dump()}")
        self.checkpoints = DeepSpeedCheckpoints(
            me, self.tok, {"data_key": self.data_key, "vocab_size": args.vocab_size},
            "--train_data / --eval_data / --eval_fraction / --max_train / --max_eval / "
            "--vocab_size")

    def record(self) -> Dict[str, Any]:
        return {"name": "embed", "data_key": self.data_key, "vocab_size": self.args.vocab_size,
                "seed": self.args.seed}

    def begin(self, start: int) -> None:
        self.batches = StepBatches(self.train_enc, micro=self.micro, gas=self.gas,
                                   dp_size=self.dp_size, dp_rank=self.dp_rank,
                                   seed=self.args.seed).iter_from(start)

    def step(self, step: int) -> Dict[str, Any]:
        from megaloss.integrations.deepspeed import write_metrics
        from megaloss.integrations.step.metrics import peak_memory_mib

        engine, args = self.engine, self.args
        t0 = time.perf_counter()
        m = embed_step(self.me, next(self.batches), mini=self.ml.mnr.mini_batch_size)
        seconds = time.perf_counter() - t0
        row = {"step": m.step, "loss": m.metrics["mnr_loss"], "accuracy": m.metrics["accuracy"],
               "lr": m.lr, "grad_norm": float("nan") if m.grad_norm is None else m.grad_norm,
               "pairs_per_s": self.micro * self.gas * self.dp_size / seconds,
               "step_time_s": seconds, "peak_memory_mib": peak_memory_mib(engine.device),
               "samples": m.samples}
        if step % args.log_every == 0 or step == args.steps:
            events = {("mnr_" + k if k in ("loss", "accuracy") else k): v
                      for k, v in row.items() if k not in ("step", "samples")}
            events["optimizer_step"] = row["step"]
            write_metrics(engine, events)  # Train/megaloss/mnr_loss, ...
        return row

    def evaluate(self) -> Dict[str, Any]:
        return evaluate_engine(self.engine, self.held_enc, self.args.eval_batch_size, self.group)

    def on_eval(self, when: str, entry: Dict[str, Any]) -> None:
        from megaloss.integrations.deepspeed import write_metrics

        if when == "after":
            self.run.log(f"trained {self.run.last} steps in {self.run.seconds:.1f} s")
        write_metrics(self.engine, figures(entry), prefix="Eval/megaloss/")
        self.run.log(f"{when} training: held-out MRR@10 {entry['mrr@10']:.4f}, "
                     f"recall@1 {entry['recall@1']:.4f}")

    def progress(self, row: Dict[str, Any]) -> Dict[str, str]:
        return {"loss": f"{row['loss']:.3f}", "acc": f"{row['accuracy']:.2f}"}

    def summary(self) -> Dict[str, Any]:
        rows, args, ml = self.run.rows, self.args, self.ml
        first_row, last_row = (rows[0], rows[-1]) if rows else ({}, {})
        return {"eval_before": figures(self.run.evals[0]),
                "eval_after": figures(self.run.evals[-1]) if self.run.stopped is None else None,
                "first_loss": first_row.get("loss"), "last_loss": last_row.get("loss"),
                "first_accuracy": first_row.get("accuracy"),
                "last_accuracy": last_row.get("accuracy"),
                "train_pairs": self.n_train, "eval_pairs": self.n_held, "dp": self.dp_size,
                "micro_batch": self.micro, "gas": self.gas,
                "global_batch": self.micro * self.gas * self.dp_size,
                "parameters": self.n_params, "model": f"BERT {args.model_size} "
                f"({self.encoder.config.num_hidden_layers}L x {self.encoder.config.hidden_size})",
                "zero_stage": self.engine.zero_optimization_stage(),
                "engine_loss_multiplier": self.multiplier, "mnr": ml.mnr.model_dump(),
                "data": "stdlib" if args.train_data is None else "user data",
                "peak_memory_mib": max((r["peak_memory_mib"] for r in rows), default=0.0),
                "data_key": self.data_key}

    def plot(self, summary: Dict[str, Any]) -> Dict[str, Any]:
        """MNR loss and in-batch accuracy against the step."""
        rows = self.run.rows
        steps = [r["step"] for r in rows]
        b, a = summary["eval_before"], summary["eval_after"]
        title = (f"code-search embedding: MRR@10 {b['mrr@10']:.3f} -> {a['mrr@10']:.3f}" if a
                 else f"code-search embedding: MRR@10 {b['mrr@10']:.3f} (stopped at step "
                 f"{summary['steps']})")
        return {"curves": [Curve("MNR loss (global batch)", steps, [r["loss"] for r in rows],
                                 style={"lw": 1})],
                "secondary": [Curve("in-batch accuracy", steps, [r["accuracy"] for r in rows],
                                    style={"color": "tab:orange", "alpha": 0.6, "lw": 1})],
                "title": title, "ylabel": "loss", "secondary_ylabel": "in-batch top-1 accuracy"}

    def table(self, summary: Dict[str, Any]) -> Table:
        """The before/after table of held-out retrieval metrics and training figures."""
        rows = retrieval_summary_rows(summary, "train MNR loss (first/last step)")
        if summary["first_loss"] is not None:
            rows.append(("train in-batch accuracy", f"{summary['first_accuracy']:.4f}",
                         f"{summary['last_accuracy']:.4f}"))
        return Table("code-search embedding (gathered MNR)", rows, (
            f"{summary['train_pairs']} train / {summary['eval_pairs']} held-out pairs, "
            f"{summary['steps']} steps x {summary['global_batch']} pairs, "
            f"{summary['parameters'] / 1e6:.2f} M params, {summary['train_seconds']:.0f} s"))


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
    check_job_arguments(p, args)
    require_at_least(p, args, ("mini_batch_size", "steps", "vocab_size", "max_query_len",
                               "max_doc_len", "eval_batch_size", "log_every"))
    return args


def main(argv: Optional[Sequence[str]] = None) -> Dict:
    return run(Embedding(parse_args(argv)), StopRequest)


if __name__ == "__main__":
    run_job(main)
