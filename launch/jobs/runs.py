"""What makes a launch job's run one a user can trust, around its training loop: one run per
output folder, failures that every rank reports with their cause, preemption that saves, and
the command-line options for checkpoints and resume both jobs share.

- :func:`add_run_arguments`: ``--save_every``, ``--resume [latest|PATH]``, ``--eval_only``,
  ``--overwrite``, ``--keep_checkpoints``.
- :func:`agreed`: run a piece of set-up (on global rank 0, or on every rank) and agree on
  failure: when it fails anywhere, every rank exits with the cause, so the launcher's last lines
  name it rather than another rank's ``Connection closed by peer``.
- :func:`prepare_output_dir` / :func:`resume_source`: refuse to mix a new run with the one
  already in ``--output_dir`` unless told to replace (``--overwrite``) or continue it
  (``--resume``).
- :class:`StopRequest`: SIGTERM / SIGINT ask for a stop at the next step boundary, agreed across
  ranks with one tiny all-reduce per step; a second SIGINT interrupts at once.

Single-process use (``torch.distributed`` not initialised) works too: nothing to agree with.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Any, Callable, List, Optional, TypeVar

import torch

__all__ = ["RUN_OUTPUTS", "CHECKPOINTS", "add_run_arguments", "check_run_arguments", "agreed",
           "prepare_output_dir", "resume_source", "open_run", "step_boundary", "save_run", "progress_bar",
           "StopRequest"]

T = TypeVar("T")

# What a job writes into --output_dir (the only names --overwrite removes).
RUN_OUTPUTS = ("metrics.csv", "summary.json", "loss_curve.png", "monitor", "wandb",
               "checkpoints")
CHECKPOINTS = "checkpoints"


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """The options of runs, checkpoints and resume, shared by both jobs."""
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


def _dist():
    import torch.distributed as dist

    return dist if dist.is_initialized() and dist.get_world_size() > 1 else None


def agreed(fn: Callable[[], T], *, everywhere: bool = False, what: str = "set-up") -> Optional[T]:
    """Run ``fn`` on global rank 0 (or on every rank with ``everywhere``) and agree on failure.

    Collective when ``torch.distributed`` is initialised with several ranks: every rank calls it
    (it replaces the barrier after rank-0-only work). When ``fn`` raises on some rank, the rank
    that failed re-raises its own error (with its traceback) and every other rank exits with a
    ``SystemExit`` naming the failing rank and the cause, so whatever lines the launcher shows
    last name the cause.

    Returns:
        ``fn()``'s result where it ran, None elsewhere.
    """
    d = _dist()
    rank = d.get_rank() if d else 0
    result, error, message = None, None, None
    if everywhere or rank == 0:
        try:
            result = fn()
        except SystemExit as e:  # a job's own error message
            error, message = e, str(e.code)
        except Exception as e:  # noqa: BLE001 - reported to every rank, then re-raised
            error, message = e, f"{type(e).__name__}: {e}"
    if d is None:
        if error is not None:
            raise error
        return result
    messages: List[Optional[str]] = [None] * d.get_world_size()
    d.all_gather_object(messages, message)
    failed = [(r, m) for r, m in enumerate(messages) if m is not None]
    if not failed:
        return result
    if error is not None:
        raise error
    r, m = failed[0]
    raise SystemExit(f"error on rank {r} ({what}): {m}")


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


class StopRequest:
    """SIGTERM / SIGINT: stop at the next step boundary, save, write what was measured, exit.

    :meth:`install` sets handlers that only record the signal (a second SIGINT raises
    ``KeyboardInterrupt`` at once, for a user who insists; repeated SIGTERMs, e.g. the
    ``deepspeed`` launcher forwarding the terminal's Ctrl-C, are ignored). :meth:`should_stop` is
    collective: one all-reduce (MAX) of a 1-element tensor per call over the world, so every rank
    stops after the same step even when only one of them was signalled (the ``deepspeed``
    launcher signals its ranks one after the other).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, log: Callable[[str], None] = lambda msg: None) -> None:
        self.received: Optional[str] = None
        self._old: dict = {}
        self._log = log

    def install(self) -> "StopRequest":
        for sig in self.SIGNALS:
            self._old[sig] = signal.signal(sig, self._handler)
        return self

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}

    def _handler(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.received is None:
            self.received = name
            print(f"[megaloss] {name}: stopping at the next step boundary (checkpoint, metrics, "
                  "summary); send SIGINT again to abort at once", file=sys.stderr, flush=True)
        elif signum == signal.SIGINT and self.received == "SIGINT":
            raise KeyboardInterrupt

    def should_stop(self, device: Any = "cpu") -> bool:
        """Whether any rank received a signal (collective)."""
        flag = torch.tensor([1.0 if self.received else 0.0], device=device)
        d = _dist()
        if d is not None:
            d.all_reduce(flag, op=d.ReduceOp.MAX)
        stop = bool(flag.item() > 0)
        if stop and self.received is None:
            self.received = "a signal on another rank"
        return stop


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
        return None if source is None else str(source)

    source = [agreed(run_folder, what=f"--output_dir {out_dir}")]
    dist = _dist()
    if dist is not None:
        dist.broadcast_object_list(source, src=0)
    return source[0]


def step_boundary(stop: "StopRequest", device: Any, step: int, args: argparse.Namespace,
                  save: Callable[[int], Any], log: Callable[[str], Any]) -> Optional[dict]:
    """What both jobs do after each optimizer step: agree across ranks whether SIGINT/SIGTERM
    arrived, save a checkpoint when stopping, every ``--save_every`` steps and after the last
    one. Returns ``{"signal", "step"}`` when the job must stop now, else ``None``."""
    stopped = ({"signal": stop.received, "step": step} if stop.should_stop(device) else None)
    if stopped or (args.save_every and (step % args.save_every == 0 or step == args.steps)):
        save(step)
    if stopped:
        log(f"stopped by {stopped['signal']} after step {step}; continue with --resume")
    return stopped


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
    dist = _dist()
    if dist is None or dist.get_rank() == 0:
        atomic_write(folder / "tokenizer.json", tokenizer.to_str())
        prune_checkpoints(ckpt_dir, keep)
    seconds = time.perf_counter() - t0
    saves.append({"step": step, "seconds": seconds,
                  "mib": checkpoint_bytes(folder) / 2**20, "path": str(folder)})
    log(f"saved {folder} ({saves[-1]['mib']:.1f} MiB) in {seconds:.2f} s")
    return folder


def progress_bar(args: argparse.Namespace, start: int) -> Any:
    """The training progress bar (tqdm) on global rank 0 unless ``--no_progress``, starting at
    ``start`` steps done (a resumed run); ``None`` elsewhere."""
    dist = _dist()
    if args.no_progress or (dist is not None and dist.get_rank() != 0):
        return None
    from tqdm import tqdm
    return tqdm(total=args.steps, initial=min(start, args.steps), desc="train", unit="step",
                dynamic_ncols=True)


def open_fresh_run(out_dir: Path, overwrite: bool) -> None:
    """One run per folder for a job without ``--resume`` (the Hugging Face trainer jobs; call on
    one rank, inside :func:`agreed`): a folder holding a run's outputs is refused unless
    ``overwrite``, which removes them (:func:`prepare_output_dir`)."""
    existing = [n for n in RUN_OUTPUTS if (out_dir / n).exists()]
    if existing and not overwrite:
        raise SystemExit(f"{out_dir} already holds a run ({', '.join(existing)}); pass "
                         "--overwrite to replace it, or another --output_dir")
    prepare_output_dir(out_dir, overwrite=overwrite, resuming=False)


def start_trainer_process(local_rank: int, report_to: str, out_dir: Path) -> tuple:
    """Process start-up of a job that hands its loop to a Hugging Face trainer under the
    ``deepspeed`` launcher (or plain ``python``: then one process).

    Quiet DeepSpeed and threads per process (``configure_launched_process``), keep that thread
    count from accelerate (which resets torch's threads when ``OMP_NUM_THREADS`` is unset), start
    DeepSpeed's comm before any model is built (under ZeRO-3 the trainers load models through
    ``zero.Init``), and point W&B at ``<out_dir>/wandb`` when ``report_to`` is not ``"none"``.

    Returns:
        ``(rank, world_size)``.
    """
    import deepspeed
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    from megaloss.integrations.deepspeed import configure_launched_process
    from megaloss.testing import free_port

    configure_launched_process()
    if not torch.cuda.is_available():
        os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    if "RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" not in os.environ:
        # plain `python launch/<job>.py`: one process (DeepSpeed would look for MPI)
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", str(free_port())))
    deepspeed.init_distributed()
    get_accelerator().set_device(local_rank)
    if report_to != "none":
        os.environ.setdefault("WANDB_DIR", str(out_dir.resolve()))  # <output_dir>/wandb
        os.environ.setdefault("WANDB_PROJECT", "megaloss")
    return dist.get_rank(), dist.get_world_size()
