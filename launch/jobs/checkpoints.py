"""A run's output folder, checkpoints and resume: one run per ``--output_dir``
(:func:`prepare_output_dir`, :func:`open_fresh_run`, :func:`open_run`), where ``--resume``
loads from (:func:`resume_source`, :func:`follow_branch`), a checkpoint's save and load
(:func:`save_run`, :func:`resume_job_state`), ``--eval_only``'s report
(:func:`report_checkpoint_eval`) and ``summary.json``'s record (:func:`checkpoint_stats`).
"""
from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .agreement import agreed, distributed_or_none

__all__ = ["RUN_OUTPUTS", "CHECKPOINTS", "resume_source", "prepare_output_dir", "open_run",
           "open_fresh_run", "follow_branch", "save_run", "resume_job_state",
           "report_checkpoint_eval", "checkpoint_stats"]

# What a job writes into --output_dir (the only names --overwrite removes).
RUN_OUTPUTS = ("metrics.csv", "summary.json", "loss_curve.png", "monitor", "wandb",
               "checkpoints")
CHECKPOINTS = "checkpoints"

def _existing_outputs(out_dir: Path) -> List[str]:
    return [n for n in RUN_OUTPUTS if (out_dir / n).exists()]


def resume_source(args: argparse.Namespace, out_dir: Path) -> Optional[Path]:
    """Where ``--resume`` loads from: None (no ``--resume``, or ``latest`` with no checkpoint
    yet in a folder without a run), a folder of checkpoints, or one checkpoint folder.
    Call on one rank (inside :func:`agreed`).

    Raises:
        SystemExit: ``--resume PATH`` does not exist; ``--resume latest`` where the folder holds
            a run but no checkpoint.
    """
    from megaloss.integrations.deepspeed import resolve_checkpoint

    if args.resume is None:
        return None
    if args.resume == "latest":
        ckpts = out_dir / CHECKPOINTS
        if (ckpts / "latest").is_file():
            resolve_checkpoint(ckpts)  # raises when latest names a missing folder
            return ckpts
        if args.eval_only:
            raise SystemExit(f"--resume latest: no checkpoint in {ckpts} (no 'latest' file)")
        if _existing_outputs(out_dir):
            raise SystemExit(f"--resume latest: no checkpoint in {ckpts} (no 'latest' file), but "
                             f"{out_dir} holds a run saved without checkpoints; pass "
                             "--overwrite to replace it, or another --output_dir")
        return None  # nothing to continue yet: a fresh run that will checkpoint
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
    - otherwise: ``SystemExit`` naming what is there and the three ways out.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    existing = _existing_outputs(out_dir)
    if not existing or resuming or eval_only:
        return
    if overwrite:
        for name in existing:
            path = out_dir / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        return
    raise SystemExit(f"{out_dir} already holds a run ({', '.join(existing)}); pass --resume to "
                     "continue it from its latest checkpoint, --overwrite to replace it, or "
                     "another --output_dir")


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
            follow_branch(source, out_dir / CHECKPOINTS)
        return None if source is None else str(source)

    source = [agreed(run_folder, what=f"--output_dir {out_dir}")]
    dist = distributed_or_none()
    if dist is not None:
        dist.broadcast_object_list(source, src=0)
    return source[0]


def follow_branch(source: Path, ckpt_dir: Path) -> None:
    """A run resumed from one of ``ckpt_dir``'s checkpoints other than the one ``latest`` names
    (a branch: ``--resume .../step_100`` when ``latest`` is ``step_150``) continues from there:
    ``latest`` is pointed at ``source`` at once, so a later ``--resume`` or ``--eval_only``
    never takes the abandoned run's checkpoint for this run's. Checkpoint folders are left as
    they are (the branch's saves replace the abandoned run's of the same step). Call on one
    rank."""
    from megaloss.integrations.deepspeed import resolve_checkpoint
    from megaloss.integrations.deepspeed.checkpoint import latest_tag

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
             saves: List[dict], log: Callable[[str], Any]) -> Path:
    """One checkpoint of a job (collective): DeepSpeed's checkpoint with ``job`` as client state
    (:func:`megaloss.integrations.deepspeed.save_checkpoint`), the tokenizer beside it and the
    oldest checkpoints beyond ``keep`` pruned on rank 0; the save's step, seconds, MiB and path
    are appended to ``saves`` (the job's record) and logged. Returns the checkpoint folder."""
    import time

    from megaloss.integrations.deepspeed import save_checkpoint
    from megaloss.integrations.deepspeed.checkpoint import checkpoint_bytes, prune_checkpoints

    from .text_data import atomic_write

    t0 = time.perf_counter()
    folder = save_checkpoint(me, ckpt_dir, client_state={"job": job})
    dist = distributed_or_none()
    if dist is None or dist.get_rank() == 0:
        atomic_write(folder / "tokenizer.json", tokenizer.to_str())
        prune_checkpoints(ckpt_dir, keep)
    seconds = time.perf_counter() - t0
    saves.append({"step": step, "seconds": seconds,
                  "mib": checkpoint_bytes(folder) / 2**20, "path": str(folder)})
    log(f"saved {folder} ({saves[-1]['mib']:.1f} MiB) in {seconds:.2f} s")
    return folder


def open_fresh_run(out_dir: Path, overwrite: bool) -> None:
    """One run per folder for a job without ``--resume`` (the Hugging Face trainer jobs; call on
    one rank, inside :func:`agreed`): a folder holding a run's outputs is refused unless
    ``overwrite``, which removes them (:func:`prepare_output_dir`)."""
    existing = [n for n in RUN_OUTPUTS if (out_dir / n).exists()]
    if existing and not overwrite:
        raise SystemExit(f"{out_dir} already holds a run ({', '.join(existing)}); pass "
                         "--overwrite to replace it, or another --output_dir")
    prepare_output_dir(out_dir, overwrite=overwrite, resuming=False)


def resume_job_state(me: Any, resume_from: str, job_state: dict, expected: Dict[str, Any],
                     options: str, log: Callable[[str], Any]) -> str:
    """Load the checkpoint ``resume_from`` into the engine of ``me``
    (:func:`megaloss.integrations.deepspeed.load_checkpoint`) and the job's own record saved with
    it (client state ``"job"``) into ``job_state`` (its keys only). Collective.

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
    from megaloss.integrations.deepspeed.checkpoint import check_checkpoint_files

    def check():
        try:
            check_checkpoint_files(resume_from)
        except ValueError as e:
            raise SystemExit(f"--resume {resume_from}: {e}") from None

    agreed(check, what=f"--resume {resume_from}")  # damaged files: one message, every rank exits
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
    log(f"resumed from {path} at step {engine.global_steps} "
        f"({engine.global_samples} samples) in {time.perf_counter() - t0:.2f} s")
    return str(path)


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
