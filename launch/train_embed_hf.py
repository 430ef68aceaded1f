#!/usr/bin/env python3
"""Train the code-search bi-encoder through sentence-transformers' ``SentenceTransformerTrainer``
with megaloss's gathered MNR loss, under DeepSpeed.

Run through the launcher (it passes ``--local_rank``) with the repository root on
``PYTHONPATH``, as ``launch/train_embed_hf.sh`` does::

    export PYTHONPATH=.
    deepspeed --num_gpus 2 launch/train_embed_hf.py            # configs/zero2_hf.json (ZeRO-2)
    deepspeed --num_gpus 2 launch/train_embed_hf.py --mini_batch_size 16   # GradCache variant

The same task as ``launch/train_embed.py`` (megaloss's own DeepSpeed loop), the Hugging Face way:

- data: the same (docstring -> function source) pairs from this interpreter's standard library
  and the same held-out files (:mod:`launch.jobs.code_search`, cached by
  :func:`launch.jobs.pair_data.load_pairs_cached`, so both jobs share the cache and the split);
  the same byte-level BPE (:mod:`launch.jobs.text_data`), here wrapped as a
  ``transformers.PreTrainedTokenizerFast``;
- model: a ``SentenceTransformer`` of a ``Transformer`` module (a small random-init BERT from a
  ``transformers.BertConfig``, :func:`launch.jobs.models.build_encoder`; no download) and mean
  ``Pooling``;
- loss: ``megaloss.integrations.hf.sentence_transformers.GatheredMultipleNegativesRankingLoss``
  (in-batch negatives from every data-parallel rank, exact cross-rank gradients); with
  ``--mini_batch_size N`` its cached (GradCache) variant
  ``CachedGatheredMultipleNegativesRankingLoss`` (imported only then). ``scale`` (``1 /
  temperature``), ``similarity_fct``, ``symmetric``, ``gather_across_devices`` and
  ``chunk_size`` come from the ds_config's
  ``"megaloss": {"mnr": ...}`` section;
- training: ``SentenceTransformerTrainer`` with ``TrainingArguments(deepspeed=<ds_config>,
  use_cpu=True on CPU)``; the ds_config's ``"auto"`` batch, clipping keys are filled by the
  Trainer, which also builds the optimizer (torch AdamW) and the LR schedule (linear warm-up,
  cosine decay to 10 % of ``--lr``).

It reports held-out MRR@10 and recall@1 (cosine, each query against all held-out documents)
before and after training on stdout and in ``<output_dir>/summary.json`` (default
``runs/embed_hf`` under the current directory; a folder that holds a run is refused unless
``--overwrite``), with ``metrics.csv`` (the Trainer's logged steps) and ``loss_curve.png``.
``--report_to wandb`` (with ``WANDB_MODE=offline`` without a network) logs the Trainer's metrics
to ``<output_dir>/wandb``. No checkpoints or resume here (use ``train_embed.py`` for those).

Sources: sentence-transformers 6.2 ``sentence_transformers/sentence_transformer/trainer.py``
(``SentenceTransformerTrainer``), transformers 5.24 ``integrations/deepspeed.py`` (``"auto"``
filling, optimizer/scheduler choice), this repository's
``megaloss/integrations/hf/sentence_transformers.py``.
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from typing import Any, Dict, List, Optional, Sequence

import torch

from launch.jobs.agreement import agreed
from launch.jobs.arguments import (
    add_embedding_arguments,
    add_job_arguments,
    add_pair_data_arguments,
    add_trainer_arguments,
    check_input_files,
    job_parser,
    require_at_least,
)
from launch.jobs.models import build_encoder
from launch.jobs.pair_data import load_pairs_cached, tokenizer_cached
from launch.jobs.reporting import Curve
from launch.jobs.retrieval import evaluate_sentence_transformer
from launch.jobs.runner import Table, TrainerJob, run_job, run_trainer
from launch.jobs.summaries import retrieval_summary_rows
from launch.jobs.text_data import EOS


# model -----------------------------------------------------------------------------------------
def build_sentence_transformer(tokenizer, args: argparse.Namespace):
    """A ``SentenceTransformer([Transformer, Pooling(mean)])`` around a random-init BERT
    (:func:`launch.jobs.models.build_encoder`: sizes from :data:`launch.jobs.models.BERT_SIZES`)
    and the job's BPE (a ``tokenizers.Tokenizer``, :data:`launch.jobs.text_data.EOS` as padding).
    sentence-transformers loads a ``Transformer`` module from a folder, so model and tokenizer go
    through a temporary one per process (same seed on every rank: the same weights; DeepSpeed
    broadcasts rank 0's anyway). Not collective."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    from transformers import PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Loading weights" bars of the tiny local model

    pad_id = tokenizer.token_to_id(EOS)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token=EOS,
                                     model_max_length=args.max_seq_len,
                                     model_input_names=["input_ids", "attention_mask"])
    torch.manual_seed(args.seed)
    encoder = build_encoder(args.model_size, tokenizer.get_vocab_size(), args.max_seq_len,
                            pad_id, args.dropout)
    folder = tempfile.mkdtemp(prefix="megaloss_embed_hf_")
    try:
        # Not encoder.save_pretrained: transformers 5 writes the weights on global rank 0 only.
        from safetensors.torch import save_file
        hf_tok.save_pretrained(folder)
        encoder.config.save_pretrained(folder)
        save_file({k: v.contiguous() for k, v in encoder.state_dict().items()},
                  os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        transformer = Transformer(folder, max_seq_length=args.max_seq_len,
                                  model_kwargs={"add_pooling_layer": False})
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    pooling = Pooling(encoder.config.hidden_size, "mean")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return SentenceTransformer(modules=[transformer, pooling], device=device)


def build_loss(model, mnr, mini_batch_size: Optional[int]):
    """megaloss's gathered MNR as a sentence-transformers loss, or its cached (GradCache)
    variant when ``mini_batch_size`` is given (imported only then). ``mnr`` is the ds_config's
    :class:`megaloss.integrations.config.MNRConfig`."""
    if not mnr.local_loss:
        raise SystemExit("megaloss.mnr.local_loss=false is not available with the "
                         "sentence-transformers loss (it scores this rank's rows, the same value "
                         "and gradients); remove the key")
    kwargs = dict(scale=1.0 / mnr.temperature, similarity_fct=mnr.similarity,
                  symmetric=mnr.symmetric, gather_across_devices=mnr.gather_across_ranks,
                  chunk_size=mnr.chunk_size)
    if mini_batch_size is None:
        from megaloss.integrations.hf.sentence_transformers import (
            GatheredMultipleNegativesRankingLoss,
        )
        return GatheredMultipleNegativesRankingLoss(model, **kwargs)
    try:
        from megaloss.integrations.hf.sentence_transformers import (
            CachedGatheredMultipleNegativesRankingLoss,
        )
    except ImportError as e:
        raise SystemExit("--mini_batch_size needs megaloss.integrations.hf.sentence_transformers."
                         f"CachedGatheredMultipleNegativesRankingLoss, not in this megaloss ({e})"
                         ) from None
    return CachedGatheredMultipleNegativesRankingLoss(model, mini_batch_size=mini_batch_size,
                                                      **kwargs)


# outputs ---------------------------------------------------------------------------------------
def train_rows(log_history: List[Dict[str, Any]]) -> List[Dict[str, float]]:
    """The Trainer's training log entries (``{"loss", "grad_norm", "learning_rate", "epoch",
    "step"}``; one per ``--logging_steps``) as metrics.csv rows."""
    rows = []
    for e in log_history:
        if "loss" in e:
            rows.append({"step": int(e["step"]), "loss": float(e["loss"]),
                         "grad_norm": float(e.get("grad_norm", float("nan"))),
                         "lr": float(e.get("learning_rate", float("nan"))),
                         "epoch": float(e.get("epoch", float("nan")))})
    return rows


# the job ---------------------------------------------------------------------------------------
def figures(entry: Dict[str, Any]) -> Dict[str, float]:
    """An evaluation without the step it was recorded at."""
    return {k: v for k, v in entry.items() if k != "step"}


class TrainerEmbedding(TrainerJob):
    """The job for the runner (:func:`launch.jobs.runner.run_trainer`): the bi-encoder with
    megaloss's gathered MNR in ``SentenceTransformerTrainer``, held-out retrieval before and
    after training."""

    tag = "embed_hf"
    hf_trainer: Any = None

    def build(self) -> None:
        args, world, log = self.args, self.world, self.run.log
        train, held, self.data_key = load_pairs_cached(args)
        tokenizer = tokenizer_cached([t for p in train for t in (p.query, p.document)],
                                     args.vocab_size, args.cache_dir, args.local_rank)
        micro, gas = args.batch_size, args.gradient_accumulation_steps
        if len(train) < micro * gas * world:
            raise SystemExit(f"{len(train)} training pairs cannot fill one global batch of "
                             f"{micro * gas * world}: give more data or a smaller --batch_size")
        log(f"data: {len(train)} train / {len(held)} held-out pairs "
            f"({'stdlib' if args.train_data is None else 'user data'}), BPE vocab "
            f"{tokenizer.get_vocab_size()}")
        self.train, self.held = train, held
        self.model = agreed(lambda: build_sentence_transformer(tokenizer, args), everywhere=True,
                            what="building the SentenceTransformer")
        self.n_params = sum(p.numel() for p in self.model.parameters())

    def evaluate(self) -> Dict[str, Any]:
        model = self.model if self.hf_trainer is None else self.hf_trainer.model
        return evaluate_sentence_transformer(model, [p.query for p in self.held],
                                             [p.document for p in self.held],
                                             self.args.eval_batch_size)

    def on_eval(self, when: str, entry: Dict[str, Any]) -> None:
        self.run.log(f"{when} training: held-out MRR@10 {entry['mrr@10']:.4f}, "
                     f"recall@1 {entry['recall@1']:.4f}")

    def trainer(self) -> Any:
        from datasets import Dataset
        from sentence_transformers import (
            SentenceTransformerTrainer,
            SentenceTransformerTrainingArguments,
        )

        args, out_dir, world = self.args, self.out_dir, self.world
        micro, gas = args.batch_size, args.gradient_accumulation_steps
        self.loss = loss = build_loss(self.model, self.ml.mnr, args.mini_batch_size)
        train_ds = Dataset.from_dict({"anchor": [p.query for p in self.train],
                                      "positive": [p.document for p in self.train]})
        targs = SentenceTransformerTrainingArguments(
            output_dir=str(out_dir), per_device_train_batch_size=micro,
            gradient_accumulation_steps=gas, max_steps=args.steps, learning_rate=args.lr,
            warmup_steps=args.warmup_steps, lr_scheduler_type="cosine_with_min_lr",
            lr_scheduler_kwargs={"min_lr_rate": 0.1}, weight_decay=0.01, max_grad_norm=1.0,
            logging_steps=args.logging_steps, logging_first_step=True, save_strategy="no",
            report_to=args.report_to, run_name=out_dir.name, seed=args.seed,
            use_cpu=not torch.cuda.is_available(), deepspeed=self.ds_config,
            dataloader_drop_last=True, dataloader_num_workers=0, disable_tqdm=args.no_progress)
        self.hf_trainer = SentenceTransformerTrainer(model=self.model, args=targs,
                                                     train_dataset=train_ds, loss=loss)
        self.run.log(
            f"training: DP={world}, ZeRO-"
            f"{self.ds_config.get('zero_optimization', {}).get('stage', 0)}, micro-batch "
            f"{micro} x GAS {gas} x DP {world} = {micro * gas * world} pairs/step, "
            f"{self.n_params / 1e6:.2f} M params, loss {type(loss).__name__}"
            f"({', '.join(f'{k}={v!r}' for k, v in loss.get_config_dict().items())})")
        return self.hf_trainer

    def after(self, trainer: Any) -> None:
        after = self.run.evals[-1]
        trainer.log({"eval_mrr@10": after["mrr@10"], "eval_recall@1": after["recall@1"]})
        if self.args.save_model:
            trainer.save_model(str(self.out_dir / "model"))  # collective under ZeRO-3

    def train_rows(self, trainer: Any) -> List[Dict[str, Any]]:
        return train_rows(trainer.state.log_history)

    def summary(self) -> Dict[str, Any]:
        args, evals = self.args, self.run.evals
        # the SentenceTransformer, trained (DeepSpeed's engine wraps it)
        config = self.hf_trainer.model[0].auto_model.config
        return {"eval_before": figures(evals[0]), "eval_after": figures(evals[-1]),
                "train_pairs": len(self.train), "eval_pairs": len(self.held),
                "global_batch": args.batch_size * args.gradient_accumulation_steps * self.world,
                "mini_batch_size": args.mini_batch_size, "loss": type(self.loss).__name__,
                "loss_config": self.loss.get_config_dict(), "parameters": self.n_params,
                "model": f"BERT {args.model_size} ({config.num_hidden_layers}"
                         f"L x {config.hidden_size}) + mean pooling",
                "data": "stdlib" if args.train_data is None else "user data",
                "data_key": self.data_key}

    def plot(self, summary: Dict[str, Any]) -> Dict[str, Any]:
        rows, b, a = self.run.rows, summary["eval_before"], summary["eval_after"]
        return {"curves": [Curve(f"{summary['loss']} (global batch)", [r["step"] for r in rows],
                                 [r["loss"] for r in rows], "o-", style={"lw": 1, "ms": 3})],
                "title": f"SentenceTransformerTrainer code search: MRR@10 {b['mrr@10']:.3f} -> "
                         f"{a['mrr@10']:.3f}", "ylabel": "loss"}

    def table(self, summary: Dict[str, Any]) -> Table:
        return Table("code-search embedding (SentenceTransformerTrainer)",
                     retrieval_summary_rows(summary, "train MNR loss (first / last log)"), (
            f"{summary['train_pairs']} train / {summary['eval_pairs']} held-out pairs, "
            f"{summary['steps']} steps x {summary['global_batch']} pairs (micro-batch "
            f"{summary['micro_batch']} x GAS {summary['gas']} x DP {summary['dp']}), ZeRO-"
            f"{summary['zero_stage']}, {summary['loss']}, {summary['parameters'] / 1e6:.2f} M "
            f"params, {summary['train_seconds']:.0f} s training"))


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = job_parser(__doc__)
    # train_embed.py: 200 steps; 150 keep the default run at a few minutes on 2 CPU cores
    add_job_arguments(p, steps=150, output_dir=os.path.join("runs", "embed_hf"))
    add_pair_data_arguments(p)
    add_embedding_arguments(p)
    p.add_argument("--max_seq_len", type=int, default=128,
                   help="tokens per text (queries and documents alike)")
    add_trainer_arguments(p, loss_section="mnr", batch_size=32, gradient_accumulation_steps=1,
                          unit="pairs")
    p.add_argument("--save_model", action="store_true",
                   help="save the trained SentenceTransformer to <output_dir>/model")
    args = p.parse_args(argv)
    require_at_least(p, args, ("steps", "batch_size", "gradient_accumulation_steps", "vocab_size",
                               "max_seq_len", "eval_batch_size", "logging_steps",
                               "mini_batch_size"))
    return check_input_files(p, args)


def main(argv: Optional[Sequence[str]] = None) -> Dict:
    return run_trainer(TrainerEmbedding(parse_args(argv)))


if __name__ == "__main__":
    run_job(main)
