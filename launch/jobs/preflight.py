"""A job's inputs checked once, before the launcher starts any rank (:func:`preflight`, run by
``python -m launch.jobs.check_args`` from ``launch/multinode.sh``): what a rank would otherwise
find tens of seconds later, on every rank at once.

- data (``--train_data`` / ``--eval_data``): every file exists, is not empty and is text (no NUL
  byte, valid UTF-8), and the training files split into train and held-out
  (:func:`launch.jobs.lm_data.split_files`) or, for the embedding jobs, give pairs;
- the ds_config: its ``"megaloss"`` section
  (:func:`megaloss.integrations.config.load_megaloss_config`, with "did you mean" for a
  misspelled key), DeepSpeed's own top-level keys (a near miss of one DeepSpeed
  reads is refused: DeepSpeed would ignore it), the layout against the world size
  (``NUM_PROCS`` x nodes) and DeepSpeed's batch arithmetic
  (``train_batch_size = micro-batch x gradient_accumulation_steps x data-parallel size``);
- ``--output_dir``: a folder holding another run is refused unless ``--resume`` /
  ``--overwrite`` / ``--eval_only`` says what to do with it (the rule the job applies on its
  rank 0 later, :mod:`launch.jobs.checkpoints`, or the job's own ``run_folder_refusal``), and a
  ``--resume`` with nothing to resume from is refused.

Each refusal is a :class:`Refusal` whose message names the argument, the value and the fix; the
caller prints it as one line (``train_lm.sh: error: ...``) and exits with status 2.
"""
from __future__ import annotations

import argparse
import json
import math
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional

__all__ = ["Refusal", "preflight", "check_text_file", "check_data", "check_ds_config",
           "check_ds_config_numbers", "check_output_dir", "LM_JOBS", "EMBEDDING_JOBS"]

LM_JOBS = ("train_lm", "train_lm_hf", "distill_lm", "train_grpo", "train_lm_fsdp", "train_dpo",
           "train_moe")
EMBEDDING_JOBS = ("train_embed", "train_embed_hf")
_SNIFF = 1 << 16  # bytes searched for a NUL byte (what `file` and git call binary)


class Refusal(Exception):
    """An input the job cannot run on; ``str()`` is the one-line message."""


def check_text_file(path: Path, what: str) -> str:
    """The text of a file, refused, naming it and why, when it is not UTF-8 text.

    Raises:
        Refusal: the file cannot be read, holds a NUL byte in its first 64 KiB (a binary), or is
            not valid UTF-8 (the byte offset of the first bad byte).
    """
    try:
        data = path.read_bytes()
    except OSError as e:
        raise Refusal(f"{what} {path}: cannot read it ({e.strerror})") from None
    nul = data.find(b"\0", 0, _SNIFF)
    if nul >= 0:
        raise Refusal(f"{what} {path} is not text (a NUL byte at offset {nul}: a binary file?); "
                      "give text files (.py, .txt, .md, .rst)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise Refusal(f"{what} {path} is not UTF-8 text (byte {data[e.start]:#04x} at offset "
                      f"{e.start}); convert it (iconv -t utf-8) or leave it out") from None
    return text


def _named_files(what: str, sources: Iterable[str], finder) -> List[Path]:
    try:
        return finder(list(sources))
    except (FileNotFoundError, ValueError) as e:
        raise Refusal(f"{what}: {e}") from None


def check_data(job: str, args: argparse.Namespace) -> None:
    """Every ``--train_data`` / ``--eval_data`` file is text; the LM jobs' files split into
    train and held-out; the embedding jobs' sources give training and held-out pairs.

    Raises:
        Refusal: naming the option, the file and the fix.
    """
    if job in LM_JOBS:
        from .lm_data import split_files
        from .text_data import check_texts, read_texts
        from .text_data import text_files as finder
    else:
        from .code_search import source_files as finder
    named = {}
    texts = {}  # resolved path -> text, each named file read once
    for name in ("train_data", "eval_data"):
        sources = getattr(args, name, None)
        if sources:
            named[name] = _named_files(f"--{name}", sources, finder)
            # a file found in a named folder may be empty (an __init__.py), as the jobs take it
            # (text_data.check_texts); a named one may not
            given = {Path(s).resolve() for s in sources if Path(s).is_file()}
            for f in named[name]:
                text = check_text_file(f, f"--{name}")
                if f.resolve() in given and not text.strip():
                    raise Refusal(f"--{name} file {f} is empty")
                texts[f.resolve()] = text
    if not named:
        return  # the built-in data
    if job in LM_JOBS:
        def read(files):  # the named files' texts as read above, others (the stdlib's) now
            return [texts[Path(f).resolve()] if Path(f).resolve() in texts
                    else read_texts([f])[0] for f in files]

        try:
            train, held = split_files(args)
            for files, what in ((train, "--train_data"),
                                (held, "--eval_data" if args.eval_data else "held-out")):
                check_texts(files, read(files), what)
        except SystemExit as e:
            raise Refusal(str(e)) from None
    elif job in EMBEDDING_JOBS:
        from .code_search import load_code_search

        try:
            train, held = load_code_search(args.train_data, args.eval_data,
                                           eval_fraction=args.eval_fraction,
                                           max_train=args.max_train, max_eval=args.max_eval)
        except SystemExit as e:
            raise Refusal(str(e)) from None
        except (ValueError, OSError) as e:  # a malformed JSON Lines record names its line
            options = " / ".join(f"--{name}" for name in named)
            raise Refusal(f"{options}: {e}") from None
        if not train:
            raise Refusal(f"--train_data {' '.join(args.train_data or ['(stdlib)'])}: no "
                          "training pairs (functions with a docstring of 3 words or more, or "
                          "JSON Lines of {\"query\", \"document\"})")
        if not held:
            raise Refusal("no held-out pairs: pass --eval_data, or a larger --eval_fraction "
                          f"than {args.eval_fraction}")


def _int(cfg: Dict[str, Any], key: str) -> Optional[int]:
    value = cfg.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# The ds_config numbers the jobs depend on: (dotted key, kind); "auto" is accepted where the
# Hugging Face Trainer fills it in from its arguments (the *_hf jobs)
_NUMBERS = (
    ("train_micro_batch_size_per_gpu", "positive int"),
    ("gradient_accumulation_steps", "positive int"),
    ("train_batch_size", "positive int"),
    ("steps_per_print", "positive int"),
    ("gradient_clipping", "number >= 0"),
    ("zero_optimization.stage", "ZeRO stage"),
    ("optimizer.params.lr", "number >= 0"),
    ("optimizer.params.weight_decay", "number >= 0"),
    ("scheduler.params.warmup_num_steps", "int >= 0"),
)


def _bad_number(value: Any, kind: str) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return True
    if kind.endswith("int") or kind in ("int >= 0", "ZeRO stage"):
        if not isinstance(value, int):
            return True
    if kind == "positive int":
        return value < 1
    if kind == "ZeRO stage":
        return value not in (0, 1, 2, 3)
    return not math.isfinite(value) or value < 0


def check_ds_config_numbers(cfg: Mapping[str, Any], where: str, job: str) -> None:
    """Every ds_config number the jobs depend on (:data:`_NUMBERS`) of the right type and sign:
    DeepSpeed itself would take ``"8"`` or ``-2`` into its arithmetic and fail with a traceback
    after the ranks start (or, for a negative clipping, silently not clip).

    Raises:
        Refusal: naming the key, the value and what it must be.
    """
    for key, kind in _NUMBERS:
        value: Any = cfg
        for part in key.split("."):
            value = value.get(part) if isinstance(value, Mapping) else None
        if value is None or (value == "auto" and job.endswith("_hf")):
            continue
        if _bad_number(value, kind):
            expected = "0, 1, 2 or 3" if kind == "ZeRO stage" else f"a {kind}"
            raise Refusal(f"{where}: {key} must be {expected}, got {json.dumps(value)}")


def check_ds_config(job: str, args: argparse.Namespace, world_size: Optional[int]) -> None:
    """The ds_config's ``"megaloss"`` section and top-level keys, the layout against
    ``world_size`` (None: unknown, not checked) and DeepSpeed's batch arithmetic.

    Raises:
        Refusal: naming ``--deepspeed_config``, the key and the fix.
    """
    path = getattr(args, "deepspeed_config", None)
    if not path:
        return
    from megaloss.integrations.config import ds_config_autotp_size, load_megaloss_config

    cfg = json.loads(Path(path).read_text(encoding="utf-8"))  # parse_args checked it is JSON
    where = f"--deepspeed_config {path}"
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a near miss of a DeepSpeed key: refused
        try:
            ml = load_megaloss_config(cfg)
        except (ValueError, TypeError, UserWarning) as e:
            raise Refusal(f"{where}: {e}") from None
    check_ds_config_numbers(cfg, where, job)
    if world_size is None:
        return
    autotp = ds_config_autotp_size(cfg)  # DeepSpeed AutoTP's TP (megaloss's is then 1)
    tp = autotp if autotp > 1 else ml.tensor_parallel_size
    tp_key = "tensor_parallel.autotp_size" if autotp > 1 else "tensor_parallel_size"
    sp = getattr(args, "sequence_parallel_size", None) or ml.sequence_parallel_size
    pp = getattr(args, "pipeline_parallel_size", None) or ml.pipeline_parallel_size
    model = tp * sp * pp
    if world_size % model:
        raise Refusal(
            f"{where}: {tp_key} {tp} x sequence_parallel_size {sp} x "
            f"pipeline_parallel_size {pp} = {model} ranks per model replica does not divide the "
            f"{world_size} processes; set NUM_PROCS to a multiple of {model}, or change the "
            "layout")
    dp = world_size // model
    micro, gas, total = (_int(cfg, k) for k in ("train_micro_batch_size_per_gpu",
                                                "gradient_accumulation_steps",
                                                "train_batch_size"))
    if job.endswith("_hf"):  # the Trainer fills "auto" from the job's --batch_size / GAS
        micro = micro if cfg.get("train_micro_batch_size_per_gpu") != "auto" else args.batch_size
        gas = gas if cfg.get("gradient_accumulation_steps") != "auto" else \
            args.gradient_accumulation_steps
    if total is None:
        return
    if micro is not None and gas is not None and total != micro * gas * dp:
        raise Refusal(
            f"{where}: train_batch_size {total} is not train_micro_batch_size_per_gpu {micro} x "
            f"gradient_accumulation_steps {gas} x data-parallel size {dp} (= {micro * gas * dp}: "
            f"{world_size} processes / {model} per replica); set it to {micro * gas * dp} or "
            "leave it out (DeepSpeed derives it)")
    for known, name in ((micro, "train_micro_batch_size_per_gpu"),
                        (gas, "gradient_accumulation_steps")):
        if known is not None and total % (known * dp):
            raise Refusal(
                f"{where}: train_batch_size {total} is not a multiple of {name} {known} x "
                f"data-parallel size {dp}; give a train_batch_size that is, or leave it out")


RunFolderRefusal = Callable[[argparse.Namespace, Path], Optional[str]]


def check_output_dir(args: argparse.Namespace,
                     run_folder_refusal: Optional[RunFolderRefusal] = None) -> None:
    """``--output_dir`` as the job will judge it on rank 0, without touching the folder: a job
    with ``--resume`` (:func:`launch.jobs.checkpoints.resume_source`, then
    :func:`~launch.jobs.checkpoints.output_dir_refusal`), one without
    (:func:`~launch.jobs.checkpoints.fresh_run_refusal`), or the job's own rule
    (``run_folder_refusal(args, out_dir)``: the distillation job's phase folders).

    Raises:
        Refusal: the folder holds a run the flags say nothing about; ``--resume`` names no
            checkpoint.
    """
    from .checkpoints import fresh_run_refusal, output_dir_refusal, resume_source

    if getattr(args, "output_dir", None) is None:
        return
    out_dir = Path(args.output_dir)
    if run_folder_refusal is not None:
        why = run_folder_refusal(args, out_dir)
    elif hasattr(args, "resume"):
        try:
            source = resume_source(args, out_dir)
        except SystemExit as e:
            raise Refusal(str(e.code)) from None
        why = output_dir_refusal(out_dir, overwrite=args.overwrite, resuming=source is not None,
                                 eval_only=args.eval_only)
    else:
        why = fresh_run_refusal(out_dir, getattr(args, "overwrite", False))
    if why is not None:
        raise Refusal(why)


def preflight(job: str, args: argparse.Namespace, world_size: Optional[int] = None, *,
              run_folder_refusal: Optional[RunFolderRefusal] = None) -> None:
    """Every check of this module, in the order a user would fix them.

    Args:
        job: the job's name (``"train_lm"``).
        args: the job's parsed arguments (its ``parse_args``).
        world_size: the processes the launcher will start (``NUM_PROCS`` x nodes), or None when
            the hostfile's slots decide it.
        run_folder_refusal: the job's own ``--output_dir`` rule, if it has one
            (:func:`check_output_dir`).

    Raises:
        Refusal: the first problem found.
    """
    check_data(job, args)
    check_ds_config(job, args, world_size)
    check_output_dir(args, run_folder_refusal)
