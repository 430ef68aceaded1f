#!/usr/bin/env python3
"""Train the LM job's small Llama through ``transformers.Trainer`` with megaloss's chunked
cross-entropy and global loss calibration (``MegalossTrainer``), under DeepSpeed.

Run through the launcher (it passes ``--local_rank``) with the repository root on
``PYTHONPATH``, as ``launch/train_lm_hf.sh`` does::

    export PYTHONPATH=.
    deepspeed --num_gpus 2 launch/train_lm_hf.py              # configs/zero2_hf.json (ZeRO-2)
    deepspeed --num_gpus 2 launch/train_lm_hf.py --report_to wandb   # WANDB_MODE=offline here

The same task as ``launch/train_lm.py`` (megaloss's own DeepSpeed loop), the Hugging Face way:

- data: the same standard-library text, held-out files, BPE tokenizer and token cache
  (:func:`launch.jobs.lm_data.load_data`, as ``train_lm.py``), cut into blocks of
  ``--seq_len`` tokens with ``shift_labels`` (already shifted targets, ``[N, seq_len]`` int64);
- model: :func:`launch.jobs.models.build_llama` (a ``transformers.LlamaForCausalLM`` from a
  ``LlamaConfig``, random init, no download), wrapped in ``megaloss.CausalLMWithLoss``;
- training: ``megaloss.integrations.hf.trainer.MegalossTrainer`` (a ``transformers.Trainer``):
  no ``[tokens, vocab]`` logits, each optimizer step's loss the global token mean over its
  micro-batches and all data-parallel ranks (``"megaloss": {"ce": ...}`` of the ds_config: chunk
  size, z-loss, ``loss_reduction``). ``TrainingArguments(deepspeed=<ds_config>, use_cpu=True on
  CPU)``; the ds_config's ``"auto"`` keys are filled by the Trainer, which builds the optimizer
  (torch AdamW, betas 0.9 / 0.95, as in ``configs/zero2.json``) and the LR schedule
  (``--lr_scheduler``; default linear warm-up over ``--warmup_steps``, then constant). Data
  parallel only (``megaloss.tensor_parallel_size`` must be 1; TP / SP layouts are
  ``train_lm.py``'s).

It reports the held-out cross-entropy (nats per token, z-loss excluded) and perplexity before
training, every ``--eval_every`` steps and after, on stdout and in ``<output_dir>/summary.json``
(default ``runs/lm_hf`` under the current directory; a folder that holds a run is refused unless
``--overwrite``), with ``metrics.csv`` (the Trainer's logged steps: global loss, ``ce_loss``,
``z_loss``, ``num_valid_tokens``, grad norm, lr) and ``loss_curve.png``. ``--report_to wandb``
sends the same logs (and the held-out ones) to W&B under ``<output_dir>/wandb``. No checkpoints
or resume here (use ``train_lm.py`` for those).

Sources: transformers 5.24 ``trainer.py`` and ``integrations/deepspeed.py``; this repository's
``megaloss/integrations/hf/trainer.py`` and ``megaloss/integrations/hf/causal_lm.py``.
"""
from __future__ import annotations

import argparse
import math
import os
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from launch.jobs.arguments import (
    add_job_arguments,
    add_llama_arguments,
    add_lm_data_arguments,
    add_trainer_arguments,
    check_input_files,
    job_parser,
    require_at_least,
)
from launch.jobs.lm_data import eval_batches, load_blocks
from launch.jobs.lm_job import LMReports
from launch.jobs.models import build_llama
from launch.jobs.runner import Table, TrainerJob, run_job, run_trainer


class Blocks(torch.utils.data.Dataset):
    """Rows of :func:`launch.jobs.text_data.lm_blocks`' output: ``{"input_ids": [T], "shift_labels":
    [T]}`` int64 each (``default_data_collator`` stacks them to ``[B, T]``)."""

    def __init__(self, blocks: Dict[str, torch.Tensor]) -> None:
        self.blocks = blocks

    def __len__(self) -> int:
        return int(self.blocks["input_ids"].shape[0])

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.blocks.items()}


@torch.no_grad()
def evaluate(model, batches: List[Dict[str, torch.Tensor]]) -> Dict[str, float]:
    """Held-out token-mean cross-entropy (nats, z-loss excluded) of ``model`` (a
    :class:`megaloss.CausalLMWithLoss` with ``reduction="sum"``) over this rank's ``batches``
    (:func:`launch.jobs.lm_data.eval_batches`: the same count on every rank), summed over ranks
    with one all-reduce; collective. Returns ``{"loss", "perplexity", "num_tokens"}``."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    for b in batches:
        out = model(b["input_ids"].to(device), shift_labels=b["shift_labels"].to(device))
        sums[0] += (out.loss - out.z_loss).double()
        sums[1] += out.num_valid_tokens.double()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sums)
    model.train(was_training)
    n = float(sums[1])
    loss = float(sums[0]) / n if n > 0 else 0.0
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "num_tokens": n}


def eval_callback(batches, evals: List[Dict[str, Any]], every: int, log):
    """A ``TrainerCallback`` that evaluates every ``every`` optimizer steps (not the last:
    ``main`` does that), appends ``{"step", "loss", "perplexity", "num_tokens"}`` to ``evals``
    and logs ``eval_loss`` / ``eval_perplexity`` through the Trainer (so ``report_to`` gets
    them). Set its ``trainer`` attribute before training."""
    from transformers import TrainerCallback

    class HeldOutEval(TrainerCallback):
        trainer = None

        def on_step_end(self, args, state, control, model=None, **kwargs):
            step = state.global_step
            if every and step % every == 0 and step < state.max_steps:
                r = evaluate(model, batches)
                evals.append({"step": step, **r})
                log(f"step {step}: held-out CE {r['loss']:.4f}, perplexity "
                    f"{r['perplexity']:.1f}")
                # Trainer.log's on_log clears control.should_log, which the Trainer reads after
                # on_step_end to log this step's training loss: keep it.
                should_log = control.should_log
                self.trainer.log({"eval_loss": r["loss"], "eval_perplexity": r["perplexity"]})
                control.should_log = should_log

    return HeldOutEval()


# outputs ---------------------------------------------------------------------------------------
def train_rows(log_history: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """metrics.csv rows: the Trainer's training logs (one per ``--logging_steps``)."""
    rows = []
    for e in log_history:
        if "loss" not in e:
            continue
        step = int(e["step"])
        rows.append({"step": step, "loss": float(e["loss"]),
                     "ce_loss": e.get("ce_loss", ""), "z_loss": e.get("z_loss", ""),
                     "num_valid_tokens": e.get("num_valid_tokens", ""),
                     "grad_norm": e.get("grad_norm", ""), "lr": e.get("learning_rate", ""),
                     "epoch": e.get("epoch", "")})
    return rows


# the job ---------------------------------------------------------------------------------------
class TrainerLM(LMReports, TrainerJob):
    """The job for the runner (:func:`launch.jobs.runner.run_trainer`): the Llama with
    megaloss's CE in ``MegalossTrainer``, held-out CE before, every ``--eval_every`` steps and
    after."""

    tag, train_label = "lm_hf", "train loss (first / last log)"
    hf_trainer: Any = None

    def build(self) -> None:
        from megaloss import CausalLMWithLoss

        args, ml, world, log = self.args, self.ml, self.world, self.run.log
        if ml.tensor_parallel_size != 1 or ml.sequence_parallel_size != 1:
            raise SystemExit(f"{args.deepspeed_config}: the Trainer job is data parallel only "
                             "(megaloss.tensor_parallel_size and sequence_parallel_size must be "
                             "1; launch/train_lm.py runs TP / SP)")
        self.tok, self.train_blocks, held_blocks, self.info, self.data_key = load_blocks(args, log)
        self.vocab = self.tok.get_vocab_size()
        micro, gas = args.batch_size, args.gradient_accumulation_steps
        if self.train_blocks["input_ids"].shape[0] < micro * gas * world:
            raise SystemExit(f"{self.train_blocks['input_ids'].shape[0]} training blocks cannot "
                             f"fill one global batch of {micro * gas * world}: give more text or "
                             "a smaller --batch_size / --seq_len")
        llama, self.cfg = build_llama(args, self.vocab)
        self.model = CausalLMWithLoss(llama, options=ml.ce.options())
        self.n_params = sum(p.numel() for p in llama.parameters())
        self.held = eval_batches(held_blocks, args.eval_batch_size, world, self.run.rank)

    def evaluate(self) -> Dict[str, Any]:
        return evaluate(self.model if self.hf_trainer is None else self.hf_trainer.model,
                        self.held)

    def trainer(self) -> Any:
        from transformers import TrainingArguments, default_data_collator

        from megaloss.integrations.hf.trainer import MegalossTrainer

        args, out_dir, world = self.args, self.out_dir, self.world
        micro, gas = args.batch_size, args.gradient_accumulation_steps
        targs = TrainingArguments(
            output_dir=str(out_dir), per_device_train_batch_size=micro,
            gradient_accumulation_steps=gas, max_steps=args.steps, learning_rate=args.lr,
            adam_beta1=0.9, adam_beta2=0.95, weight_decay=0.01, warmup_steps=args.warmup_steps,
            lr_scheduler_type=args.lr_scheduler,
            max_grad_norm=1.0, logging_steps=args.logging_steps, logging_first_step=True,
            save_strategy="no", report_to=args.report_to, run_name=out_dir.name, seed=args.seed,
            use_cpu=not torch.cuda.is_available(), deepspeed=self.ds_config,
            remove_unused_columns=False, dataloader_drop_last=True, dataloader_num_workers=0,
            disable_tqdm=args.no_progress)
        callback = eval_callback(self.held, self.run.evals, args.eval_every, self.run.log)
        trainer = MegalossTrainer(model=self.model, args=targs,
                                  train_dataset=Blocks(self.train_blocks),
                                  data_collator=default_data_collator, callbacks=[callback])
        callback.trainer = self.hf_trainer = trainer
        self.run.log(
            f"training: DP={world}, ZeRO-"
            f"{self.ds_config.get('zero_optimization', {}).get('stage', 0)}, micro-batch "
            f"{micro} x GAS {gas} x DP {world} = {micro * gas * world} x {args.seq_len} "
            f"tokens/step, {self.n_params / 1e6:.2f} M params, CE {self.ml.ce.model_dump()}")
        return trainer

    def after(self, trainer: Any) -> None:
        after = self.run.evals[-1]
        trainer.log({"eval_loss": after["loss"], "eval_perplexity": after["perplexity"]})

    def train_rows(self, trainer: Any) -> List[Dict[str, Any]]:
        return train_rows(trainer.state.log_history)

    def summary(self) -> Dict[str, Any]:
        args, evals = self.args, self.run.evals
        tokens = (self.run.last * args.batch_size * args.gradient_accumulation_steps
                  * self.world * args.seq_len)
        return {"eval_before": evals[0], "eval_after": evals[-1], "evals": evals,
                "tokens_per_s": tokens / max(self.run.seconds, 1e-9),
                "train_tokens_seen": tokens, "seq_len": args.seq_len, "vocab_size": self.vocab,
                "parameters": int(self.n_params), "ce": self.ml.ce.model_dump(),
                "report_to": args.report_to,
                "data": "stdlib" if not args.train_data else "user files",
                "model": f"Llama {self.cfg.num_hidden_layers}L x {self.cfg.hidden_size}",
                "data_key": self.data_key, **self.info}

    def plot_title(self, summary: Dict[str, Any]) -> str:
        return f"MegalossTrainer: {summary['model']} on {summary['data']}"

    def table(self, summary: Dict[str, Any]) -> Table:
        return self.lm_table(summary, "megaloss LM job (transformers.Trainer)", (
            f"{summary['steps']} steps in {summary['train_seconds']:.1f} s, "
            f"{summary['tokens_per_s']:.0f} tokens/s, micro-batch {summary['micro_batch']} x "
            f"GAS {summary['gas']} x DP {summary['dp']} x {summary['seq_len']} tokens, ZeRO-"
            f"{summary['zero_stage']}, {summary['parameters'] / 1e6:.2f} M params, "
            f"loss_reduction {summary['ce']['loss_reduction']}"))


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = job_parser(__doc__)
    add_job_arguments(p, steps=150, output_dir=os.path.join("runs", "lm_hf"))
    add_lm_data_arguments(p)
    add_llama_arguments(p)
    g = p.add_argument_group("optimization")
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--warmup_steps", type=int, default=10)
    g.add_argument("--lr_scheduler", type=str, default="constant_with_warmup",
                   help="the Trainer's lr_scheduler_type (the default: linear warm-up, then "
                        "constant, as train_lm.py's configs)")
    g.add_argument("--eval_batch_size", type=int, default=8)
    add_trainer_arguments(p, loss_section="ce", batch_size=4, gradient_accumulation_steps=2,
                          unit="blocks")
    args = p.parse_args(argv)
    require_at_least(p, args, ("steps", "batch_size", "gradient_accumulation_steps", "seq_len",
                               "eval_blocks", "eval_batch_size", "logging_steps"))
    require_at_least(p, args, ("eval_every",), minimum=0)
    return check_input_files(p, args)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    return run_trainer(TrainerLM(parse_args(argv)))


if __name__ == "__main__":
    run_job(main)
