"""A run's output folder, checkpoints and resume: one run per ``--output_dir``
(:func:`prepare_output_dir`, :func:`open_fresh_run`, :func:`open_run`), where ``--resume``
loads from (:func:`resume_source`, :func:`follow_branch`), a checkpoint's save and load
(:func:`save_run`, :func:`resume_job_state`; both for a job of the runner:
:class:`DeepSpeedCheckpoints`), ``--eval_only``'s report (:func:`report_checkpoint_eval`) and
``summary.json``'s record (:func:`checkpoint_stats`).
"""
from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .agreement import agreed, distributed_or_none, rank0_decides

__all__ = ["RUN_OUTPUTS", "CHECKPOINTS", "LEFTOVERS", "resume_source", "prepare_output_dir",
           "output_dir_refusal", "fresh_run_refusal", "open_run", "open_fresh_run",
           "follow_branch", "save_run", "resume_job_state", "DeepSpeedCheckpoints",
           "LM_DATA_OPTIONS", "report_checkpoint_eval", "checkpoint_stats"]

# What a job writes into --output_dir (the only names --overwrite removes).
RUN_OUTPUTS = ("metrics.csv", "summary.json", "loss_curve.png", "monitor", "wandb",
               "checkpoints")
CHECKPOINTS = "checkpoints"
# What a run writes from its start, before any checkpoint or result: DeepSpeed's monitor files
# (from the engine's start-up) and wandb's folder. A folder holding only these, perhaps with an
# empty checkpoints folder, is what a run that crashed before its first checkpoint left: nothing
# to continue or keep, so a rerun starts over (saying so) rather than asking for --resume.
LEFTOVERS = ("monitor", "wandb")


def _existing_outputs(out_dir: Path) -> List[str]:
    return [n for n in RUN_OUTPUTS if (out_dir / n).exists()]


def _worth_keeping(out_dir: Path, existing: Sequence[str]) -> List[str]:
    """The names of ``existing`` that a rerun must not silently replace: results, and a
    checkpoints folder with anything in it (a checkpoint, or a save cut short)."""
    def empty(name: str) -> bool:
        path = out_dir / name
        return path.is_dir() and not any(path.iterdir())

    return [n for n in existing if n not in LEFTOVERS and not (n == CHECKPOINTS and empty(n))]


def _latest_checkpoint(out_dir: Path) -> Optional[str]:
    """The tag ``<out_dir>/checkpoints/latest`` names (DeepSpeed writes it once a save is
    complete), None without one."""
    try:
        tag = (out_dir / CHECKPOINTS / "latest").read_text(encoding="utf-8").strip()
    except OSError:  # none (or a folder of that name)
        return None
    return tag or None


def _shown(out_dir: Path, names: Sequence[str]) -> str:
    return ", ".join(n + "/" if (out_dir / n).is_dir() else n for n in names)


def output_dir_refusal(out_dir: Path, *, overwrite: bool, resuming: bool,
                       eval_only: bool = False) -> Optional[str]:
    """Why a run may not start in ``out_dir`` as asked (None: it may), without touching it:
    what :func:`prepare_output_dir` would refuse. The message names what the folder holds and
    only the flags that apply: ``--resume`` only when it holds a complete checkpoint
    (``checkpoints/latest``), ``--overwrite`` otherwise."""
    existing = _existing_outputs(out_dir) if out_dir.is_dir() else []
    if (overwrite or resuming or eval_only or not existing
            or not _worth_keeping(out_dir, existing)):
        return None
    tag = _latest_checkpoint(out_dir)
    if tag is not None:
        return (f"{out_dir} already holds a run ({', '.join(existing)}; its latest checkpoint "
                f"is {tag}); pass --resume to continue it from there, --overwrite to replace "
                "it, or another --output_dir")
    return (f"{out_dir} already holds a run ({', '.join(existing)}) but no checkpoint to "
            "continue it from; pass --overwrite to replace it, or another --output_dir")


def resume_source(args: argparse.Namespace, out_dir: Path) -> Optional[Path]:
    """Where ``--resume`` loads from: None (no ``--resume``, or ``latest`` with no checkpoint
    yet in a folder without a run), a folder of checkpoints, or one checkpoint folder.
    Call on one rank (inside :func:`agreed`).

    Raises:
        SystemExit: ``--resume PATH`` does not exist; ``--resume latest`` where the folder holds
            a run but no checkpoint.
    """
    from megaloss.integrations.deepspeed.checkpoint import resolve_checkpoint

    if args.resume is None:
        return None
    if args.resume == "latest":
        ckpts = out_dir / CHECKPOINTS
        if (ckpts / "latest").is_file():
            resolve_checkpoint(ckpts)  # raises when latest names a missing folder
            return ckpts
        if args.eval_only:
            raise SystemExit(f"--resume latest: no checkpoint in {ckpts} (no 'latest' file)")
        kept = _worth_keeping(out_dir, _existing_outputs(out_dir))
        if kept:
            raise SystemExit(f"--resume latest: no checkpoint in {ckpts} (no 'latest' file), but "
                             f"{out_dir} holds a run saved without checkpoints "
                             f"({_shown(out_dir, kept)}); pass --overwrite to replace it, or "
                             "another --output_dir")
        # nothing to continue yet (a crash before the first checkpoint at most left its monitor
        # files, which prepare_output_dir clears): a fresh run that will checkpoint
        return None
    path = Path(args.resume)
    try:
        resolve_checkpoint(path)
    except FileNotFoundError as e:
        raise SystemExit(f"--resume {args.resume}: {e}") from None
    return path


def prepare_output_dir(out_dir: Path, *, overwrite: bool, resuming: bool,
                       eval_only: bool = False) -> None:
    """Make sure a run never mixes with another in ``out_dir``. Call on one rank (inside
    :func:`agreed`), before any engine or monitor is built.

    - empty or new folder: created;
    - ``resuming`` or ``eval_only``: kept as it is (the resumed run continues its files);
    - ``overwrite``: the previous run's outputs (:data:`RUN_OUTPUTS`) are removed, nothing else;
    - only what a run that crashed before its first checkpoint leaves (:data:`LEFTOVERS`, an
      empty checkpoints folder): removed, with one line saying so (nothing there to continue);
    - otherwise: ``SystemExit`` naming what is there and the ways out that apply
      (:func:`output_dir_refusal`: ``--resume`` only when there is a checkpoint).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    existing = _existing_outputs(out_dir)
    if not existing or resuming or eval_only:
        return
    refusal = output_dir_refusal(out_dir, overwrite=overwrite, resuming=resuming)
    if refusal is not None:
        raise SystemExit(refusal)
    if not overwrite:
        print(f"[megaloss] {out_dir} holds no checkpoint from an earlier run (only "
              f"{_shown(out_dir, existing)}): starting over", flush=True)
    for name in existing:
        path = out_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def open_run(args: argparse.Namespace, out_dir: Path, ds_config: dict) -> Optional[str]:
    """The run folder's verdict, decided on rank 0 and shared (no rank fails alone): the
    checkpoint to resume from (``None`` for a fresh run), after refusing a folder that holds
    another run (see :func:`prepare_output_dir`). With ``--eval_only`` the ds_config's monitors
    are switched off first: evaluating a checkpoint must not touch the run's monitor files."""
    if args.eval_only:
        for key in ("csv_monitor", "tensorboard", "wandb", "comet"):
            if isinstance(ds_config.get(key), dict):
                ds_config[key]["enabled"] = False

    def run_folder():
        source = resume_source(args, out_dir)
        prepare_output_dir(out_dir, overwrite=args.overwrite, resuming=source is not None,
                           eval_only=args.eval_only)
        if source is not None and not args.eval_only:
            _check_files(source)  # before latest moves to it: a damaged branch leaves it as is
            follow_branch(source, out_dir / CHECKPOINTS)
        return None if source is None else str(source)

    return rank0_decides(run_folder, what=f"--output_dir {out_dir}")


def _check_files(source: Path) -> None:
    """``--resume``'s checkpoint files intact (:func:`megaloss.integrations.deepspeed.checkpoint.
    check_checkpoint_files`).

    Raises:
        SystemExit: naming ``--resume`` and the damaged file.
    """
    from megaloss.integrations.deepspeed.checkpoint import check_checkpoint_files

    try:
        check_checkpoint_files(source)
    except ValueError as e:
        raise SystemExit(f"--resume {source}: {e}") from None


def follow_branch(source: Path, ckpt_dir: Path) -> None:
    """A run resumed from one of ``ckpt_dir``'s checkpoints other than the one ``latest`` names
    (a branch: ``--resume .../step_100`` when ``latest`` is ``step_150``) continues from there:
    ``latest`` is pointed at ``source`` at once, so a later ``--resume`` or ``--eval_only``
    never takes the abandoned run's checkpoint for this run's. Checkpoint folders are left as
    they are (the branch's saves replace the abandoned run's of the same step). Call on one
    rank."""
    from megaloss.integrations.deepspeed.checkpoint import latest_tag, resolve_checkpoint

    load_dir, tag = resolve_checkpoint(source)
    if not ckpt_dir.is_dir() or load_dir.resolve() != ckpt_dir.resolve():
        return
    before = latest_tag(ckpt_dir)
    if before not in (None, tag):
        from .text_data import atomic_write

        atomic_write(ckpt_dir / "latest", tag)
        print(f"[megaloss] resuming from {ckpt_dir / tag}, not from latest ({before}): "
              f"{ckpt_dir / 'latest'} now names {tag}", flush=True)


def save_run(me: Any, ckpt_dir: Path, step: int, job: dict, tokenizer: Any, keep: int,
             saves: List[dict], log: Callable[[str], Any], *, tag: Optional[str] = None) -> Path:
    """One checkpoint of a job (collective): DeepSpeed's checkpoint with ``job`` as client state
    (:func:`megaloss.integrations.deepspeed.save_checkpoint`), the tokenizer beside it and the
    oldest checkpoints beyond ``keep`` pruned on rank 0; the save's step, seconds, MiB and path
    are appended to ``saves`` (the job's record) and logged. ``tag``: the checkpoint's folder
    name (default ``step_<engine.global_steps>``; a job whose step is not one optimizer step,
    the GRPO job's, names its own). Returns the checkpoint folder."""
    import time

    from megaloss.integrations.deepspeed import save_checkpoint
    from megaloss.integrations.deepspeed.checkpoint import checkpoint_bytes, prune_checkpoints

    from .text_data import atomic_write

    t0 = time.perf_counter()
    folder = save_checkpoint(me, ckpt_dir, tag=tag, client_state={"job": job})
    dist = distributed_or_none()
    if dist is None or dist.get_rank() == 0:
        atomic_write(folder / "tokenizer.json", tokenizer.to_str())
        prune_checkpoints(ckpt_dir, keep)
    seconds = time.perf_counter() - t0
    saves.append({"step": step, "seconds": seconds,
                  "mib": checkpoint_bytes(folder) / 2**20, "path": str(folder)})
    log(f"saved {folder} ({saves[-1]['mib']:.1f} MiB) in {seconds:.2f} s")
    return folder


def fresh_run_refusal(out_dir: Path, overwrite: bool) -> Optional[str]:
    """Why a job without ``--resume`` may not start in ``out_dir`` (None: it may), without
    touching it: the folder holds a run's outputs and ``overwrite`` is off."""
    existing = _existing_outputs(out_dir) if out_dir.is_dir() else []
    if _worth_keeping(out_dir, existing) and not overwrite:
        return (f"{out_dir} already holds a run ({', '.join(existing)}); pass --overwrite to "
                "replace it, or another --output_dir")
    return None


def open_fresh_run(out_dir: Path, overwrite: bool) -> None:
    """One run per folder for a job without ``--resume`` (the Hugging Face trainer jobs; call on
    one rank, inside :func:`agreed`): a folder holding a run's outputs is refused unless
    ``overwrite``, which removes them (:func:`prepare_output_dir`); one that holds only what a
    run that crashed at its start leaves (:data:`LEFTOVERS`) is started over, saying so."""
    refusal = fresh_run_refusal(out_dir, overwrite)
    if refusal is not None:
        raise SystemExit(refusal)
    prepare_output_dir(out_dir, overwrite=overwrite, resuming=False)


def resume_job_state(me: Any, resume_from: str, job_state: dict, expected: Dict[str, Any],
                     options: str, log: Callable[[str], Any]) -> str:
    """Load the checkpoint ``resume_from`` into the engine of ``me``
    (:func:`megaloss.integrations.deepspeed.load_checkpoint`) and the job's own record saved with
    it (client state ``"job"``) into ``job_state`` (its keys only; a ``"steps_done"`` key there is
    the step the log line names, else the engine's optimizer step). Collective.

    Args:
        expected: client-state values this run must match (the data cache key, the vocabulary),
            by key.
        options: the command-line options that decide them, named in the error.

    Raises:
        SystemExit: a file of the checkpoint is truncated or corrupted (checked on rank 0,
            :func:`~megaloss.integrations.deepspeed.checkpoint.check_checkpoint_files`); the
            checkpoint was trained on other data or another tokenizer.

    Returns:
        the checkpoint folder loaded (``.../checkpoints/step_<k>``), what ``--eval_only``
        reports.
    """
    import time

    from megaloss.integrations.deepspeed import load_checkpoint

    # damaged files: one message, every rank exits
    agreed(lambda: _check_files(Path(resume_from)), what=f"--resume {resume_from}")
    t0 = time.perf_counter()
    path, client = load_checkpoint(me, resume_from)
    saved = client.get("job", {})
    if any(saved.get(k) != v for k, v in expected.items()):
        raise SystemExit(
            f"checkpoint {path} was trained on other data or another tokenizer ("
            + ", ".join(f"{k} {saved.get(k)}" for k in expected) + "; these options give "
            + ", ".join(f"{k} {v}" for k, v in expected.items()) + f"): pass the same {options}")
    job_state.update({k: saved[k] for k in job_state if k in saved})
    engine = me.engine
    # a job whose step is not one optimizer step (the GRPO job's) keeps its own "steps_done"
    step = job_state.get("steps_done", engine.global_steps)
    optimizer = f", optimizer step {engine.global_steps}" if step != engine.global_steps else ""
    log(f"resumed from {path} at step {step} "
        f"({engine.global_samples} samples{optimizer}) in {time.perf_counter() - t0:.2f} s")
    return str(path)


class DeepSpeedCheckpoints:
    """The checkpoints of a DeepSpeed job of the runner (:mod:`launch.jobs.runner`):
    :func:`save_run` of ``me`` with ``tokenizer`` beside each checkpoint, folder ``step_<k>``
    after the job's step ``k``; :func:`resume_job_state` refusing a checkpoint whose record
    differs from ``expected`` (``options``: the command-line options that decide it)."""

    def __init__(self, me: Any, tokenizer: Any, expected: Dict[str, Any], options: str) -> None:
        self.me, self.tokenizer, self.expected, self.options = me, tokenizer, expected, options

    def save(self, ckpt_dir: Path, step: int, record: dict, keep: int, saves: List[dict],
             log: Callable[[str], Any]) -> Path:
        return save_run(self.me, ckpt_dir, step, record, self.tokenizer, keep, saves, log,
                        tag=f"step_{step}")

    def load(self, resume_from: str, state: dict, log: Callable[[str], Any]) -> str:
        return resume_job_state(self.me, resume_from, state, self.expected, self.options, log)


# The data options of the LM jobs' checkpoints (what their data cache key depends on).
LM_DATA_OPTIONS = ("--train_data / --eval_data / --eval_fraction / --max_train_bytes / "
                   "--vocab_size")


def report_checkpoint_eval(out_dir: Path, rank: int, title: str, resume_from: str, step: int,
                           result: Dict[str, float], rows: Sequence[Tuple[str, str]]) -> dict:
    """``--eval_only``'s report: ``<out_dir>/eval_step<step>.json`` (``{"checkpoint", "step",
    "eval": result}``, ``resume_from`` the checkpoint folder evaluated) and a ``metric | value``
    table of ``rows`` on rank 0, then a barrier.

    Returns:
        the report.
    """
    import torch.distributed as dist

    from .reporting import print_summary_table, write_summary_json

    report = {"checkpoint": str(resume_from), "step": step, "eval": result}
    if rank == 0:
        write_summary_json(out_dir / f"eval_step{step}.json", report)
        print_summary_table(f"{title}: checkpoint evaluation", rows,
                            f"step {step} of {resume_from}", columns=("metric", "value"))
    dist.barrier()
    return report


def checkpoint_stats(saves: List[dict], since: int = 0) -> Optional[Dict[str, Any]]:
    """``summary.json``'s ``checkpoints``: this run's saves (``saves[since:]``; the earlier ones
    are a resumed run's record): how many, mean seconds and MiB per save, the last folder
    (``None`` when this run saved none)."""
    saves = saves[since:]
    if not saves:
        return None
    return {"saves": len(saves), "seconds_per_save": sum(x["seconds"] for x in saves) / len(saves),
            "mib_per_save": sum(x["mib"] for x in saves) / len(saves),
            "last": saves[-1]["path"]}
