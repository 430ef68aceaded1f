"""The command-line option groups the jobs share, so one option has one name, default and help
in every job that takes it:

- :func:`add_job_arguments`: ``--steps``, ``--seed``, ``--output_dir``, ``--cache_dir``,
  ``--no_progress``, ``--local_rank`` (every job);
- :func:`add_text_arguments`, :func:`add_lm_data_arguments` / :func:`add_llama_arguments`
  (:func:`policy_llama_default`): the LM jobs' text, tokenizer, blocks and model size;
- :func:`add_pair_data_arguments` / :func:`add_embedding_arguments`: the embedding jobs' pairs,
  tokenizer, encoder size, GradCache mini-batch, learning rate and evaluation batch;
- :func:`add_trainer_arguments`: ``--deepspeed_config``, ``--logging_steps``, ``--report_to``,
  ``--overwrite`` (the jobs that hand their loop to a Hugging Face trainer);
- :func:`add_run_arguments` / :func:`check_run_arguments`: ``--save_every``, ``--resume``,
  ``--eval_only``, ``--overwrite``, ``--keep_checkpoints`` (the megaloss-loop jobs);
  :func:`add_lm_job_arguments`: an LM job's groups; :func:`check_job_arguments`: the checks
  every megaloss-loop job runs last;
- :func:`require_at_least`: ``p.error`` for a number below its minimum;
- :func:`check_input_files`: ``p.error`` naming a data source or ds_config that cannot be read.

``python -m launch.jobs.check_args`` runs a job's parser once, before the launcher starts any
rank (``launch/multinode.sh`` does).
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Iterable, Optional

from .models import BERT_SIZES, LLAMA_SIZES

REPO = Path(__file__).resolve().parents[2]  # configs/ lives at the repository root

__all__ = ["JobParser", "job_parser", "add_job_arguments", "add_text_arguments",
           "add_lm_data_arguments", "add_llama_arguments", "policy_llama_default",
           "add_pair_data_arguments", "add_embedding_arguments", "add_trainer_arguments",
           "add_run_arguments", "check_run_arguments", "add_lm_job_arguments",
           "check_job_arguments", "require_at_least", "check_input_files"]


class JobParser(argparse.ArgumentParser):
    """An argument parser whose ``error`` after parsing (a value a job refuses: ``--steps 0``)
    prints one line, ``<prog>: error: <message>``, without the usage block that a command line
    that does not parse gets. ``prog`` is ``MEGALOSS_PROG`` when set (``launch/multinode.sh``
    sets the shell script's name, ``train_lm.sh``)."""

    _parsing = False

    def parse_args(self, args=None, namespace=None):
        self._parsing = True
        try:
            return super().parse_args(args, namespace)
        finally:
            self._parsing = False

    def error(self, message: str):
        if self._parsing:
            super().error(message)  # usage, message, exit status 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def job_parser(doc: str) -> argparse.ArgumentParser:
    """A :class:`JobParser` described by the first paragraph of a job's docstring, defaults in
    ``--help``."""
    return JobParser(prog=os.environ.get("MEGALOSS_PROG") or None,
                     description=doc.split("\n\n")[0],
                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)


def add_job_arguments(p: argparse.ArgumentParser, *, steps: int, output_dir: str,
                      config: Optional[str] = None, config_help: str = "") -> None:
    """``--steps`` (default ``steps``), ``--seed``, ``--output_dir`` (default ``output_dir``,
    relative to the current directory), ``--cache_dir``, ``--no_progress``, ``--local_rank``;
    with ``config`` (a file of ``configs/``) first ``--deepspeed_config``, that file by default,
    ``config_help`` its help."""
    if config is not None:
        p.add_argument("--deepspeed_config", type=str, default=str(REPO / "configs" / config),
                       help=config_help)
    p.add_argument("--steps", type=int, default=steps, help="optimizer steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output_dir", type=str, default=output_dir,
                   help="the run's folder, relative to the current directory: metrics.csv, "
                        "summary.json, loss_curve.png (and the job's monitor/, wandb/, "
                        "checkpoints/)")
    p.add_argument("--cache_dir", type=str,
                   default=os.environ.get("MEGALOSS_CACHE",
                                          str(Path.home() / ".cache" / "megaloss")),
                   help="where tokenizers, token streams and extracted pairs are cached")
    p.add_argument("--no_progress", action="store_true", help="no progress bar")
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)),
                   help="set by the deepspeed launcher")


def add_text_arguments(p: argparse.ArgumentParser, title: str = "data",
                       eval_help: str = "held-out text files or directories; default: the "
                                        "stdlib's held-out files, or a crc32 split of "
                                        "--train_data files") -> argparse._ArgumentGroup:
    """The text of the jobs on the LM jobs' tokenized text (:func:`launch.jobs.lm_data.load_data`):
    sources, held-out split, size cap and BPE vocabulary, in a group named ``title``
    (returned); ``eval_help``: what ``--eval_data`` is for."""
    g = p.add_argument_group(title)
    g.add_argument("--train_data", nargs="*", default=None,
                   help="text files or directories (.py/.txt/.md/.rst); default: the stdlib")
    g.add_argument("--eval_data", nargs="*", default=None, help=eval_help)
    g.add_argument("--eval_fraction", type=float, default=0.05,
                   help="share of --train_data files held out when --eval_data is not given")
    g.add_argument("--max_train_bytes", type=int, default=2_500_000,
                   help="keep a strided subset of training files under this size (0: all)")
    g.add_argument("--vocab_size", type=int, default=2048, help="BPE vocabulary size")
    return g


def add_lm_data_arguments(p: argparse.ArgumentParser) -> None:
    """The LM jobs' text (:func:`add_text_arguments`), blocks and evaluation."""
    g = add_text_arguments(p)
    g.add_argument("--seq_len", type=int, default=128)
    g.add_argument("--eval_blocks", type=int, default=64,
                   help="held-out blocks of seq_len tokens evaluated (evenly spaced)")
    g.add_argument("--eval_every", type=int, default=50,
                   help="steps between held-out evaluations (0: only before and after)")


def add_llama_arguments(p: argparse.ArgumentParser, default_size: Optional[str] = "small"
                        ) -> None:
    """The LM jobs' model (:func:`launch.jobs.models.build_llama`), ``default_size`` unless
    ``--model_size`` says otherwise (None: :func:`policy_llama_default` picks it after
    parsing)."""
    g = p.add_argument_group("model")
    g.add_argument("--model_size", choices=sorted(LLAMA_SIZES), default=default_size)
    g.add_argument("--hidden_size", type=int, default=None, help="overrides --model_size")
    g.add_argument("--num_layers", type=int, default=None, help="overrides --model_size")
    g.add_argument("--num_heads", type=int, default=None, help="overrides --model_size")
    g.add_argument("--tie_word_embeddings", action="store_true",
                   help="tie the input embedding to the lm_head (Llama 3.2, Qwen2.5, Gemma); "
                        "under TP both use one vocab shard per rank; under PP the first and the "
                        "last stage hold it (DeepSpeed's TiedLayerSpec)")


def policy_llama_default(args: argparse.Namespace) -> None:
    """``--model_size`` not given (``add_llama_arguments(p, default_size=None)``): the
    preference and GRPO jobs' Llama, 2 layers x 64 wide (unless given) with the ``small``
    size's head layout; the named sizes learn slower on CPU."""
    if args.model_size is None:
        args.model_size = "small"  # its head layout; the width and depth below
        args.hidden_size = args.hidden_size or 64
        args.num_layers = args.num_layers or 2


def add_pair_data_arguments(p: argparse.ArgumentParser) -> None:
    """The embedding jobs' pairs (:mod:`launch.jobs.pair_data`) and tokenizer."""
    g = p.add_argument_group("data")
    g.add_argument("--train_data", nargs="+", default=None,
                   help=".py files, directories or .jsonl files of {query, document}; "
                        "default: the Python standard library")
    g.add_argument("--eval_data", nargs="+", default=None,
                   help="held-out sources; default: whole files held out from --train_data")
    g.add_argument("--eval_fraction", type=float, default=0.1)
    g.add_argument("--max_train", type=int, default=None, help="cap on training pairs")
    g.add_argument("--max_eval", type=int, default=None, help="cap on held-out pairs")
    g.add_argument("--vocab_size", type=int, default=4096)


def add_embedding_arguments(p: argparse.ArgumentParser) -> None:
    """The embedding jobs' encoder (:func:`launch.jobs.models.build_encoder`), GradCache
    mini-batch, learning rate and evaluation batch."""
    g = p.add_argument_group("model and training")
    g.add_argument("--model_size", choices=sorted(BERT_SIZES), default="small")
    g.add_argument("--dropout", type=float, default=0.1,
                   help="encoder dropout (the training set is small: it curbs memorisation)")
    g.add_argument("--mini_batch_size", type=int, default=None,
                   help="GradCache: encode and back-propagate this many pairs at a time (the "
                        "same loss and gradients over the whole global batch, activation "
                        "memory of one mini-batch; overrides megaloss.mnr.mini_batch_size of "
                        "a ds_config)")
    g.add_argument("--lr", type=float, default=2e-3)
    g.add_argument("--warmup_steps", type=int, default=20)
    g.add_argument("--eval_batch_size", type=int, default=128)


def add_trainer_arguments(p: argparse.ArgumentParser, loss_section: str, *, batch_size: int,
                          gradient_accumulation_steps: int, unit: str) -> None:
    """What the jobs on a Hugging Face trainer add: their ds_config (default
    ``configs/zero2_hf.json``, whose ``megaloss.<loss_section>`` sets the loss), the Trainer's
    batch (``--batch_size`` ``unit`` per rank per micro-batch, ``--gradient_accumulation_steps``;
    defaults as given), logging and one run per folder."""
    g = p.add_argument_group("trainer")
    g.add_argument("--batch_size", type=int, default=batch_size,
                   help=f"{unit} per rank per micro-batch (the Trainer's "
                        "per_device_train_batch_size)")
    g.add_argument("--gradient_accumulation_steps", type=int,
                   default=gradient_accumulation_steps)
    g.add_argument("--deepspeed_config", type=str, default=str(REPO / "configs" / "zero2_hf.json"),
                   help="ds_config JSON for the Trainer ('auto' keys are filled from the "
                        f"arguments); its 'megaloss.{loss_section}' section sets the loss")
    g.add_argument("--logging_steps", type=int, default=10,
                   help="the Trainer logs (and metrics.csv gets) every N steps, and step 1")
    g.add_argument("--report_to", type=str, default="none",
                   help="the Trainer's report_to: none, wandb, tensorboard, all")
    g.add_argument("--overwrite", action="store_true",
                   help="replace the run already in --output_dir")


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """The options of runs, checkpoints and resume of the megaloss-loop jobs."""
    g = p.add_argument_group("runs, checkpoints and resume")
    g.add_argument("--overwrite", action="store_true",
                   help="replace the run already in --output_dir (its metrics, plot, summary, "
                        "monitor, wandb and checkpoints folders); without it, or --resume, a "
                        "job refuses an --output_dir that holds a run")
    g.add_argument("--save_every", type=int, default=0, metavar="N",
                   help="save a checkpoint (DeepSpeed's engine.save_checkpoint) to "
                        "<output_dir>/checkpoints/step_<k> every N optimizer steps and after "
                        "the last (0: only when stopped by SIGTERM / SIGINT, which always save "
                        "at the next step boundary)")
    g.add_argument("--keep_checkpoints", type=int, default=0, metavar="K",
                   help="keep only the K newest checkpoints (0: keep all)")
    g.add_argument("--resume", nargs="?", const="latest", default=None, metavar="latest|PATH",
                   help="continue from a checkpoint: 'latest' (the default when the flag has no "
                        "value) is the newest in <output_dir>/checkpoints, and starts fresh when "
                        "there is none yet, so one command line serves a job that may be "
                        "requeued; PATH is a checkpoints folder or one checkpoint folder. "
                        "--steps is the total to reach")
    g.add_argument("--eval_only", action="store_true",
                   help="with --resume: evaluate the checkpoint, write eval_step<k>.json to "
                        "--output_dir and exit (no training, no monitors)")


def check_run_arguments(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``p.error`` for inconsistent run options."""
    if args.save_every < 0:
        p.error("--save_every must be >= 0")
    if args.keep_checkpoints < 0:
        p.error("--keep_checkpoints must be >= 0")
    if args.eval_only and args.resume is None:
        p.error("--eval_only needs --resume (which checkpoint to evaluate)")
    if args.overwrite and args.resume is not None:
        p.error("--overwrite and --resume exclude each other (replace the run, or continue it)")


def add_lm_job_arguments(p: argparse.ArgumentParser, *, steps: int, output_dir: str) -> None:
    """A megaloss-loop LM job's options after its own: :func:`add_job_arguments`,
    :func:`add_lm_data_arguments`, :func:`add_llama_arguments`, :func:`add_run_arguments`."""
    add_job_arguments(p, steps=steps, output_dir=output_dir)
    add_lm_data_arguments(p)
    add_llama_arguments(p)
    add_run_arguments(p)


def check_job_arguments(p: argparse.ArgumentParser, args: argparse.Namespace
                        ) -> argparse.Namespace:
    """The checks every megaloss-loop job runs last: :func:`check_run_arguments`, then
    :func:`check_input_files`. Returns ``args``."""
    check_run_arguments(p, args)
    return check_input_files(p, args)


def require_at_least(p: argparse.ArgumentParser, args: argparse.Namespace,
                     names: Iterable[str], minimum: int = 1) -> None:
    """``p.error("--name must be >= minimum")`` for the first of ``names`` below ``minimum``;
    an option left at ``None`` (not given) passes."""
    for name in names:
        value: Optional[int] = getattr(args, name)
        if value is not None and value < minimum:
            p.error(f"--{name} must be >= {minimum}")


def check_input_files(p: argparse.ArgumentParser, args: argparse.Namespace
                      ) -> argparse.Namespace:
    """``p.error`` naming the file for an input the job could not read: a ``--train_data`` /
    ``--eval_data`` source that does not exist, a ``--deepspeed_config`` that cannot be read, is
    not valid JSON (with the line and column) or is not a JSON object. Options a job lacks, or
    left at ``None``, pass. Returns ``args``."""
    for name in ("train_data", "eval_data"):
        for src in getattr(args, name, None) or ():
            if not Path(src).exists():
                p.error(f"--{name} {src}: no such file or directory")
    config = getattr(args, "deepspeed_config", None)
    if not config:
        return args
    try:
        text = Path(config).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        p.error(f"--deepspeed_config {config}: cannot read it ({getattr(e, 'strerror', e)})")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        p.error(f"--deepspeed_config {config}: not valid JSON: {e.msg} at line {e.lineno} "
                f"column {e.colno}")
    if not isinstance(value, dict):
        p.error(f"--deepspeed_config {config}: a ds_config is a JSON object, not "
                f"{type(value).__name__}")
    return args
