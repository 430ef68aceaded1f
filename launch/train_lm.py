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
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

from launch.jobs.arguments import (
    add_lm_job_arguments,
    check_job_arguments,
    job_parser,
    require_at_least,
)
from launch.jobs.checkpoints import LM_DATA_OPTIONS, DeepSpeedCheckpoints
from launch.jobs.lm_data import eval_batches, load_blocks
from launch.jobs.lm_job import LMJob
from launch.jobs.lm_pipeline import build_pipeline_job, gather_per_rank, pipeline_parallel_size
from launch.jobs.models import build_llama
from launch.jobs.runner import StopRequest, Table, run, run_job

REPO = Path(__file__).resolve().parent.parent


class DeepSpeedLM(LMJob):
    """The job for the runner (:mod:`launch.jobs.runner`): the Llama of ``args`` under
    DeepSpeed in the ds_config's layout (TP / SP / PP / AutoTP), megaloss's calibrated step."""

    tag, title = "lm", "megaloss LM job"

    def configure(self) -> dict:
        from megaloss.integrations.deepspeed import load_ds_config

        # Inputs first, on every rank (same files, same answers), then the run folder on rank 0
        # with its verdict shared: no rank fails alone.
        self.ds_config, self.ml = load_ds_config(self.args.deepspeed_config,
                                                 output_dir=str(self.out_dir))
        return self.ds_config

    def build(self) -> None:
        from megaloss import Topology
        from megaloss.integrations.config import ds_config_autotp_size

        args, ds_config, ml, log = self.args, self.ds_config, self.ml, self.run.log
        if args.sequence_parallel_size is not None:
            ml.sequence_parallel_size = args.sequence_parallel_size
            ds_config.setdefault("megaloss", {})["sequence_parallel_size"] = \
                args.sequence_parallel_size
        self.pp = pp = pipeline_parallel_size(args, ml, ds_config)
        # AutoTP ("tensor_parallel": {"autotp_size": N} in the ds_config): DeepSpeed builds the
        # groups and shards the model inside initialize, which returns the topology
        self.autotp = ds_config_autotp_size(ds_config) > 1
        topo = None if pp > 1 or self.autotp else Topology.build(
            ml.tensor_parallel_size, sequence_parallel_size=ml.sequence_parallel_size)
        self.micro = micro = ds_config.get("train_micro_batch_size_per_gpu", 1)
        self.gas = gas = ds_config.get("gradient_accumulation_steps", 1)
        self.tok, self.train_blocks, held_blocks, self.info, self.data_key = load_blocks(args, log)
        self.vocab = self.tok.get_vocab_size()
        if pp > 1:  # DeepSpeed's pipeline engine: the Llama in stages (launch/jobs/lm_pipeline.py)
            pipe = build_pipeline_job(args, ds_config, ml, self.vocab, str(self.out_dir), log)
            me, self.cfg, self.n_params = pipe.me, pipe.config, pipe.parameters
            self.step_fn, self.eval_fn, topo = pipe.train_step, pipe.evaluate, me.topology
        else:
            me, topo = self.build_engine(topo)
        self.me, self.engine, self.device = me, me.engine, me.engine.device
        self.dp, self.dp_rank, self.topo = topo.dp_size, topo.dp_rank, topo
        log(f"engine ready: DP={topo.dp_size} x SP={topo.sp_size} x TP={topo.tp_size} x PP={pp}, "
            f"ZeRO-{self.engine.zero_optimization_stage()}, micro-batch {micro} x GAS {gas} x DP "
            f"{topo.dp_size} = {micro * gas * topo.dp_size} x {args.seq_len} tokens/step, "
            f"{self.n_params / 1e6:.2f} M params, measured engine loss multiplier "
            f"{me.engine_scale.loss_multiplier:g} ({me.engine_scale.engine}), CE "
            f"{ml.ce.model_dump()}")
        self.held = eval_batches(held_blocks, micro, topo.dp_size, topo.dp_rank)
        self.checkpoints = DeepSpeedCheckpoints(me, self.tok, {"data_key": self.data_key},
                                                LM_DATA_OPTIONS)

    def build_engine(self, topo):
        """The Llama with the loss in its forward (or AutoTP's), the calibrated engine; with SP
        the attention all-to-all over the SP group. Returns ``(engine, topology)``."""
        from megaloss import CausalLMWithLoss
        from megaloss.integrations.deepspeed import evaluate, initialize, train_step
        from megaloss.integrations.hf.ulysses import enable_ulysses_attention

        args, ml, out = self.args, self.ml, str(self.out_dir)
        model, self.cfg = build_llama(args, self.vocab,
                                      "sdpa" if topo and topo.sp_size > 1 else None)
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
        if not self.autotp:
            self.restore_attention = enable_ulysses_attention(model, topo,
                                                              micro_batch_size=self.micro)
        # decoder + the full (unsharded) lm_head, whatever the TP size (a tied one is the
        # embedding)
        self.n_params = sum(p.numel() for p in model.base_model.parameters()) + (
            0 if self.cfg.tie_word_embeddings else self.vocab * self.cfg.hidden_size)
        if self.autotp:  # the *ForCausalLM itself: initialize wraps it for AutoTP's lm_head shard
            me = initialize(model, self.ds_config, output_dir=out)
            topo = me.topology
        else:
            wrapper = CausalLMWithLoss(model, options=ml.ce.options(), tp_group=topo.tp_group)
            me = initialize(wrapper, self.ds_config, topology=topo, output_dir=out)
        self.step_fn = lambda mbs: train_step(me, mbs)
        self.eval_fn = lambda batches, log=True: evaluate(me, batches, log=log)
        return me, topo

    def step(self, step: int) -> Dict[str, Any]:
        return self.step_fn(next(self.batches)).as_dict()

    def evaluate(self) -> Dict[str, Any]:
        # --eval_only writes nothing to the run's monitors
        return vars(self.eval_fn(self.held, log=not self.args.eval_only))

    def summary(self) -> Dict[str, Any]:
        topo, engine = self.topo, self.engine
        return {
            **self.run_summary(), "dp": topo.dp_size, "sp": topo.sp_size, "tp": topo.tp_size,
            "pp": self.pp, "autotp": self.autotp, "zero_stage": engine.zero_optimization_stage(),
            "activation_checkpointing": bool(self.args.activation_checkpointing),
            "vocab_size": self.vocab, "parameters": int(self.n_params),
            "engine_loss_multiplier": self.me.engine_scale.loss_multiplier,
            "ce": self.ml.ce.model_dump(),
            "model": f"Llama {self.cfg.num_hidden_layers}L x {self.cfg.hidden_size}", **self.info,
        }

    def gather_per_rank(self, value: Any) -> Any:
        return gather_per_rank(value)

    def local_parameters(self) -> int:
        return sum(p.numel() for p in self.engine.module.parameters())

    def plot_title(self, summary: Dict[str, Any]) -> str:
        return f"megaloss LM: {summary['model']} on {summary['data']}"

    def table(self, summary: Dict[str, Any]) -> Table:
        """The before/after table of held-out perplexity and losses, with the run's figures."""
        return self.lm_table(summary, "megaloss LM job", self.run_info(
            summary, f"layout DP={summary['dp']} x SP={summary.get('sp', 1)} x "
                     f"TP={summary['tp']} x PP={summary.get('pp', 1)}, "
                     f"ZeRO-{summary['zero_stage']}", "engine loss multiplier"))

    def close(self) -> None:
        self.restore_attention()

    @staticmethod
    def restore_attention() -> None:
        """Nothing to restore unless :meth:`build_engine` wrapped the attention (it replaces
        this)."""


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
    add_lm_job_arguments(p, steps=150, output_dir=os.path.join("runs", "lm"))
    args = p.parse_args(argv)
    require_at_least(p, args, ("steps", "pipeline_parallel_size"))
    return check_job_arguments(p, args)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    return run(DeepSpeedLM(parse_args(argv)), StopRequest)


if __name__ == "__main__":
    run_job(main)
