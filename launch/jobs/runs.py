"""What makes a launch job's run one a user can trust, around its training loop: one run per
output folder, failures that every rank reports with their cause, preemption that saves, and
the command-line options for checkpoints and resume the megaloss-loop jobs share.

- :func:`add_run_arguments`: ``--save_every``, ``--resume [latest|PATH]``, ``--eval_only``,
  ``--overwrite``, ``--keep_checkpoints``.
- :func:`agreed`: run a piece of set-up (on global rank 0, or on every rank) and agree on
  failure: when it fails anywhere, every rank exits with the cause, so the launcher's last lines
  name it rather than another rank's ``Connection closed by peer``.
- :func:`prepare_output_dir` / :func:`resume_source`: refuse to mix a new run with the one
  already in ``--output_dir`` unless told to replace (``--overwrite``) or continue it
  (``--resume``).
- :class:`StopRequest`: SIGTERM / SIGINT / SIGUSR1 ask for a stop at the next step boundary,
  agreed across ranks with one tiny all-reduce per step; repeats of the request are merged, and
  only a SIGINT once the checkpoint is being saved (after a grace) aborts.
- :func:`start_process` / :func:`start_trainer_process`: a launched process's start-up;
  :func:`open_trainer_run`: a trainer job's ds_config and run folder.
- :func:`resume_job_state`, :func:`report_checkpoint_eval`, :func:`checkpoint_stats`,
  :func:`finish_run`: resume, ``--eval_only``'s report and the end-of-run tail every job shares.
- :func:`run_job`: a job's ``__main__``: exit status, its error printed once, and
  :func:`end_process` (process groups destroyed) on every exit path.

Single-process use (``torch.distributed`` not initialised) works too: nothing to agree with.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

import torch

from .peers import dead_peers, leave, peer_failure, record_peers

__all__ = ["RUN_OUTPUTS", "CHECKPOINTS", "add_run_arguments", "check_run_arguments", "agreed",
           "prepare_output_dir", "resume_source", "open_run", "open_fresh_run", "step_boundary",
           "save_run", "progress_bar", "StopRequest", "start_process", "start_trainer_process",
           "open_trainer_run", "resume_job_state", "report_checkpoint_eval", "checkpoint_stats",
           "finish_run", "TrainLoop", "quiet_job_environment", "AgreedExit", "LineProgress",
           "follow_branch", "end_process", "run_job", "dead_peers"]

T = TypeVar("T")

# What a job writes into --output_dir (the only names --overwrite removes).
RUN_OUTPUTS = ("metrics.csv", "summary.json", "loss_curve.png", "monitor", "wandb",
               "checkpoints")
CHECKPOINTS = "checkpoints"


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
    r, m = failed[0]
    if error is not None and r == rank:
        raise error
    # Reported by rank r (the first that failed): this rank exits with the same status and no
    # message of its own, so the cause is printed once and the ranks' lines never interleave.
    raise AgreedExit(f"error on rank {r} ({what}): {m}")


class AgreedExit(SystemExit):
    """The exit of a rank whose set-up failed on another rank (:func:`agreed`): status 1 and
    nothing printed (the failing rank prints the cause); ``message`` names the rank and cause."""

    def __init__(self, message: str) -> None:
        super().__init__(1)
        self.message = message


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
    """SIGTERM / SIGINT / SIGUSR1: stop at the next step boundary, save, write what was measured,
    exit.

    :meth:`install` sets handlers that only record the request. Schedulers deliver one request
    several times (SLURM's ``scancel`` and time limit signal every process of the job, then the
    ``deepspeed`` launcher forwards a SIGTERM to each rank; a terminal's Ctrl-C reaches launcher
    and ranks alike): every request until the checkpoint's save starts, and for ``grace``
    seconds after the first, is the same request. Only a SIGINT after that (the save has started
    and the grace is over: a user who insists) raises ``KeyboardInterrupt``.

    :meth:`should_stop` is collective: one all-reduce (MAX) of a 1-element tensor per call over
    the world, so every rank stops after the same step even when only one of them was signalled
    (the ``deepspeed`` launcher signals its ranks one after the other).

    Args:
        grace: seconds after the first request during which a repeated SIGINT is merged even
            once the save has started; default ``$MEGALOSS_STOP_GRACE`` or 10.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

    def __init__(self, log: Callable[[str], None] = lambda msg: None,
                 grace: Optional[float] = None) -> None:
        self.received: Optional[str] = None
        self.saving = False  # set by step_boundary when the stop's checkpoint starts
        self.grace = float(os.environ.get("MEGALOSS_STOP_GRACE", 10) if grace is None else grace)
        self._first: Optional[float] = None
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
        import time

        name = signal.Signals(signum).name
        if self.received is None:
            self.received, self._first = name, time.monotonic()
            print(f"[megaloss] {name}: stopping at the next step boundary (checkpoint, metrics, "
                  "summary); SIGINT again once the checkpoint is being saved aborts",
                  file=sys.stderr, flush=True)
        elif (signum == signal.SIGINT and self.saving
              and time.monotonic() - (self._first or 0.0) > self.grace):
            raise KeyboardInterrupt

    def should_stop(self, device: Any = "cpu") -> bool:
        """Whether any rank received a stop request (collective)."""
        flag = torch.tensor([1.0 if self.received else 0.0], device=device)
        d = _dist()
        if d is not None:
            d.all_reduce(flag, op=d.ReduceOp.MAX)
        stop = bool(flag.item() > 0)
        if stop and self.received is None:
            import time

            self.received, self._first = "a signal on another rank", time.monotonic()
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
        if source is not None and not args.eval_only:
            follow_branch(source, out_dir / CHECKPOINTS)
        return None if source is None else str(source)

    source = [agreed(run_folder, what=f"--output_dir {out_dir}")]
    dist = _dist()
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


def step_boundary(stop: "StopRequest", device: Any, step: int, args: argparse.Namespace,
                  save: Callable[[int], Any], log: Callable[[str], Any]) -> Optional[dict]:
    """What both jobs do after each optimizer step: agree across ranks whether SIGINT/SIGTERM
    arrived, save a checkpoint when stopping, every ``--save_every`` steps, and after the last
    one with ``--save_every`` or ``--resume`` (a resumed run's ``latest`` must name its own last
    step, not the checkpoint it started from or an abandoned branch's). Returns
    ``{"signal", "step"}`` when the job must stop now, else ``None``."""
    stopped = ({"signal": stop.received, "step": step} if stop.should_stop(device) else None)
    last = step == args.steps and (args.save_every or getattr(args, "resume", None) is not None)
    if stopped or last or (args.save_every and step % args.save_every == 0):
        if stopped:
            stop.saving = True
        save(step)
    if stopped:
        log(f"stopped by {stopped['signal']} after step {step}; continue with --resume")
        _note_stopped(stopped)
    return stopped


def _note_stopped(stopped: dict) -> None:
    """Leave ``$MEGALOSS_ERROR_FILE.stopped<r>`` once this rank has saved on a stop request:
    ``launch/multinode.sh`` then exits with status 75 however the request was delivered (the
    ``deepspeed`` launcher's own status depends on whether it was signalled itself)."""
    base = os.environ.get("MEGALOSS_ERROR_FILE")
    if base:
        try:
            Path(f"{base}.stopped{int(os.environ.get('RANK', 0)):05d}").write_text(
                f"{stopped['signal']} {stopped['step']}\n", encoding="utf-8")
        except OSError:
            pass


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


class LineProgress:
    """The progress of a job whose output is not a terminal (a file, a scheduler's log): one
    line ``train <k>/<total> steps <postfix> <seconds> s`` every ``every`` steps and at the
    last, instead of tqdm's ``\\r`` updates (which a file keeps as one endless line). The subset
    of tqdm's interface :class:`TrainLoop` uses."""

    def __init__(self, total: int, initial: int, every: int, stream: Any = None) -> None:
        import time

        self.total, self.n, self.every = total, initial, max(1, every)
        self.stream = stream if stream is not None else sys.stderr
        self._postfix: dict = {}
        self._t0 = time.perf_counter()

    def set_postfix(self, **postfix: Any) -> None:
        self._postfix = postfix

    def update(self, n: int = 1) -> None:
        import time

        self.n += n
        if self.n % self.every == 0 or self.n >= self.total:
            figures = " ".join(f"{k}={v}" for k, v in self._postfix.items())
            print(f"train {self.n}/{self.total} steps {figures} "
                  f"{time.perf_counter() - self._t0:.1f} s", file=self.stream, flush=True)

    def close(self) -> None:
        pass


def progress_bar(args: argparse.Namespace, start: int, stream: Any = None) -> Any:
    """The training progress on global rank 0 unless ``--no_progress``, starting at ``start``
    steps done (a resumed run): tqdm's bar on a terminal, else :class:`LineProgress` (a line
    every ``--steps / 20`` steps, at most every 50); ``None`` elsewhere. ``stream``: default
    ``sys.stderr``."""
    dist = _dist()
    if args.no_progress or (dist is not None and dist.get_rank() != 0):
        return None
    stream = sys.stderr if stream is None else stream
    if not (hasattr(stream, "isatty") and stream.isatty()):
        return LineProgress(args.steps, min(start, args.steps),
                            min(50, max(1, args.steps // 20)), stream)
    from tqdm import tqdm
    return tqdm(total=args.steps, initial=min(start, args.steps), desc="train", unit="step",
                dynamic_ncols=True, file=stream)


class TrainLoop:
    """The optimizer-step loop of a megaloss-loop job, around the job's own step::

        loop = TrainLoop(args, start, seconds_before, stop, device, save, log)
        for step in loop:
            ...                      # one optimizer step
            loop.show(loss=...)      # the progress bar's figures
        loop.stopped, loop.seconds   # {"signal", "step"} or None; training seconds in all

    Steps ``start + 1 .. args.steps``; after each: the progress bar (rank 0, unless
    ``--no_progress``), then :func:`step_boundary` (stop agreed across ranks, checkpoints), ending
    the loop when a signal arrived. ``seconds`` counts training time since the first start
    (``seconds_before`` from a resumed run's record), also while the loop runs (for ``save``).
    """

    def __init__(self, args: argparse.Namespace, start: int, seconds_before: float,
                 stop: "StopRequest", device: Any, save: Callable[[int], Any],
                 log: Callable[[str], Any]) -> None:
        self.args, self.start, self.stop, self.device = args, start, stop, device
        self.save, self.log = save, log
        self.stopped: Optional[dict] = None
        self._before, self._t0, self._t1 = seconds_before, None, None
        self._postfix: dict = {}

    @property
    def seconds(self) -> float:
        import time

        if self._t0 is None:
            return self._before
        return self._before + (self._t1 or time.perf_counter()) - self._t0

    def show(self, **postfix: str) -> None:
        self._postfix = postfix

    def __iter__(self):
        import time

        bar = progress_bar(self.args, self.start)
        self._t0 = time.perf_counter()
        try:
            for step in range(self.start + 1, self.args.steps + 1):
                yield step
                if bar is not None:
                    bar.set_postfix(**self._postfix)
                    bar.update(1)
                self.stopped = step_boundary(self.stop, self.device, step, self.args, self.save,
                                             self.log)
                if self.stopped:
                    break
        finally:
            self._t1 = time.perf_counter()
            if bar is not None:
                bar.close()


def open_fresh_run(out_dir: Path, overwrite: bool) -> None:
    """One run per folder for a job without ``--resume`` (the Hugging Face trainer jobs; call on
    one rank, inside :func:`agreed`): a folder holding a run's outputs is refused unless
    ``overwrite``, which removes them (:func:`prepare_output_dir`)."""
    existing = [n for n in RUN_OUTPUTS if (out_dir / n).exists()]
    if existing and not overwrite:
        raise SystemExit(f"{out_dir} already holds a run ({', '.join(existing)}); pass "
                         "--overwrite to replace it, or another --output_dir")
    prepare_output_dir(out_dir, overwrite=overwrite, resuming=False)


def quiet_job_environment() -> None:
    """What every job sets before its libraries start: no tokenizers thread pool (the jobs are
    launched as several processes), no Hub access or download bars (the models are built here),
    and no per-call FutureWarning of torch 2.13's deprecated ``all_gather_into_tensor`` (DeepSpeed's
    ZeRO and megaloss's gathers call it every step). Settings already in the environment win."""
    import warnings

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.*",
                            category=FutureWarning)
    _quiet_deepspeed_logger()


# DeepSpeed warnings that every run of these jobs prints and that say nothing about it: the CPU
# accelerator chosen when there is no GPU (the jobs run there by design); ZeRO around torch's
# AdamW, which the configs allow on purpose ("zero_allow_untested_optimizer"); the LR of a
# warm-up schedule read before its first step (the engine's start-up, not the job).
DEEPSPEED_NOISE = ("Setting accelerator to CPU",
                   "You are using ZeRO with an untested optimizer",
                   "get learning rate from scheduler before it has started")


class _DropMessages:
    def __init__(self, parts: Sequence[str]) -> None:
        self.parts = tuple(parts)

    def filter(self, record: Any) -> bool:
        message = record.getMessage()
        return not any(part in message for part in self.parts)


def _quiet_deepspeed_logger() -> None:
    """Drop :data:`DEEPSPEED_NOISE` from DeepSpeed's logger ("DeepSpeed"). Set before DeepSpeed is
    imported (the accelerator warning comes with the import): DeepSpeed's logger is then this
    one, filter included. Idempotent."""
    import logging

    logger = logging.getLogger("DeepSpeed")
    if not any(isinstance(f, _DropMessages) for f in logger.filters):
        logger.addFilter(_DropMessages(DEEPSPEED_NOISE))


# accelerate's "Gradient accumulation steps mismatch: GradientAccumulationPlugin has 1,
# DeepSpeed config has N. Using DeepSpeed's value." in every Trainer job with GAS > 1: the
# Trainer sets accelerate's own accumulation to 1 on purpose (transformers' trainer.py
# create_accelerator_and_postprocess: it accumulates itself) and DeepSpeed's engine takes the
# ds_config's value, which is what the jobs ask for (the MegalossTrainer measures the engine's
# scaling at its first micro-batch).
ACCELERATE_NOISE = ("Gradient accumulation steps mismatch: GradientAccumulationPlugin has 1,",)


def _quiet_accelerate_logger() -> None:
    import logging

    logger = logging.getLogger("accelerate.accelerator")
    if not any(isinstance(f, _DropMessages) for f in logger.filters):
        logger.addFilter(_DropMessages(ACCELERATE_NOISE))


def start_process(local_rank: int) -> Tuple[int, int]:
    """Process start-up of a job under the ``deepspeed`` launcher (or plain ``python``: then one
    process): quiet DeepSpeed, threads per process on CPU, no JIT build
    (``configure_launched_process``), DeepSpeed's comm, and this rank's device before the first
    object collective (NCCL needs it; a no-op on CPU).

    Returns:
        ``(rank, world_size)``.
    """
    import deepspeed
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    from megaloss.integrations.deepspeed import configure_launched_process, freeze_imported_objects
    from megaloss.testing import free_port

    configure_launched_process()
    if "RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" not in os.environ:
        # plain `python -m launch.<job>`: one process (DeepSpeed would look for MPI)
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", str(free_port())))
    deepspeed.init_distributed()
    get_accelerator().set_device(local_rank)
    if dist.get_world_size() > 1:
        record_peers(dist)  # which peer died, should a collective fail (run_job)
    freeze_imported_objects()  # the job's module-level imports are done (cheaper gc.collect)
    return dist.get_rank(), dist.get_world_size()


def start_trainer_process(local_rank: int, report_to: str, out_dir: Path) -> Tuple[int, int]:
    """:func:`start_process` for a job that hands its loop to a Hugging Face trainer: also keeps
    the thread count from accelerate (which resets torch's threads when ``OMP_NUM_THREADS`` is
    unset) and points W&B at ``<out_dir>/wandb`` when ``report_to`` is not ``"none"``. DeepSpeed's
    comm starts before any model is built (under ZeRO-3 the trainers load models through
    ``zero.Init``).

    Returns:
        ``(rank, world_size)``.
    """
    rank, world = start_process(local_rank)
    _quiet_accelerate_logger()
    if not torch.cuda.is_available():
        os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    if report_to != "none":
        os.environ.setdefault("WANDB_DIR", str(out_dir.resolve()))  # <output_dir>/wandb
        os.environ.setdefault("WANDB_PROJECT", "megaloss")
        from megaloss.integrations.deepspeed import keep_wandb_cache_in_run_dir

        keep_wandb_cache_in_run_dir()  # wandb-core's debug log too
    return rank, world


def open_trainer_run(args: argparse.Namespace, out_dir: Path) -> Tuple[dict, Any]:
    """The ds_config of a trainer job (``args.deepspeed_config``, its ``"megaloss"`` section
    validated) and its run folder, refused when it holds a run unless ``args.overwrite``
    (:func:`open_fresh_run`, decided on rank 0, every rank exits on refusal). Collective.

    Returns:
        ``(ds_config dict, MegalossConfig)``.
    """
    import json

    from megaloss.integrations.deepspeed import load_megaloss_config

    with open(args.deepspeed_config, encoding="utf-8") as f:
        ds_config = json.load(f)
    ml = load_megaloss_config(ds_config)
    agreed(lambda: open_fresh_run(out_dir, args.overwrite), what=f"--output_dir {out_dir}")
    return ds_config, ml


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


def finish_run(out_dir: Path, rank: int, write_outputs: Callable[[], Any],
               print_summary: Callable[[], Any], log: Callable[[str], Any], *,
               engine: Any = None, stop: Optional[StopRequest] = None) -> None:
    """The end of every job: the engine's monitors closed (``engine``: flushed before rank 0
    writes), ``write_outputs()`` and ``print_summary()`` on rank 0 with a log line naming the
    files, a barrier, then the signal handlers of ``stop`` restored (only now: a second signal
    must not cut the outputs' writing short). Collective."""
    import torch.distributed as dist

    if engine is not None:
        from megaloss.integrations.deepspeed import close_monitors
        close_monitors(engine)
    if rank == 0:
        write_outputs()
        print_summary()
        log(f"wrote {out_dir / 'metrics.csv'}, {out_dir / 'loss_curve.png'}, "
            f"{out_dir / 'summary.json'}")
    dist.barrier()
    if stop is not None:
        stop.restore()


def end_process() -> bool:
    """The last thing a launched job does, on every exit path (:func:`run_job`): flush the
    output and destroy ``torch.distributed``'s process groups. Left alive, their communication
    threads are torn down with the interpreter, in no set order; a C++ thread still joinable then
    ends the process in ``std::terminate`` ("terminate called without an active exception",
    SIGABRT: the rank exits -6 and the launcher 250) even after a finished run or a clean
    refusal. Returns whether there were process groups."""
    import torch.distributed as dist

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more to say
            pass
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a peer already gone: the process is ending anyway
            pass
        return True
    return False


def _report_error(message: str, show: bool = True) -> None:
    """Print a rank's error on its own line (``show``) and leave it in
    ``$MEGALOSS_ERROR_FILE.rank<r>`` (set by ``launch/multinode.sh``, which shows it again after
    the launcher's closing lines)."""
    if show:
        print(message, file=sys.stderr, flush=True)
    base = os.environ.get("MEGALOSS_ERROR_FILE")
    if base:
        try:
            Path(f"{base}.rank{int(os.environ.get('RANK', 0)):05d}").write_text(
                message + "\n", encoding="utf-8")
        except OSError:
            pass


def run_job(main: Callable[[], Any]) -> None:
    """A job's ``if __name__ == "__main__":``: ``main()``, then :func:`end_process` whatever
    happened, and the exit status:

    - 0 after a finished run (also one stopped by a signal, which saved);
    - 1 after a job's own error (a ``SystemExit`` message, printed once, on its own line, by the
      rank that found it; the ranks told of it by :func:`agreed` exit 1 silently);
    - 1 after an exception (its traceback, printed by the rank that raised it; when a peer rank
      is gone, a last line naming it, the cause of a failed collective: a rank on this node whose
      process is gone, found at once from its pid; in a world over several nodes, else, a rank
      whose heartbeat in the rendezvous store stopped, with its node and host, or global rank 0
      when that store, which lives in its process, does not answer; :mod:`launch.jobs.peers`).
      Finding a peer on another node costs at most ``peers.SILENCE_SECONDS`` (3 s) before the
      exit (about one ``peers.HEARTBEAT_SECONDS`` when every peer is alive), and global rank 0
      keeps the store up at most 5 s more (on every exit), until the other ranks have left;
    - 130 after an abort (``KeyboardInterrupt``: SIGINT while the stop's checkpoint was saved).
    """
    import traceback

    code: Any = 0
    try:
        main()
    except AgreedExit:
        code = 1
    except SystemExit as e:
        code = e.code
        if code is not None and not isinstance(code, int):
            _report_error(str(code))
            code = 1
    except KeyboardInterrupt:
        print("[megaloss] aborted (SIGINT)", file=sys.stderr, flush=True)
        code = 130
    except BaseException as e:  # noqa: BLE001 - reported, then the status says it failed
        traceback.print_exc()  # its last line is the cause, unless a peer died
        rank = int(os.environ.get("RANK", 0))
        gone = peer_failure(rank)
        if gone:  # the collective failed because a peer died: that is the cause
            first = (str(e).splitlines() or [""])[0]
            _report_error(f"{gone}; this rank stopped with {type(e).__name__}: {first}")
        else:
            _report_error(f"{type(e).__name__}: {e}", show=False)
        code = 1
    finally:
        # whatever the exit: the other nodes must not name this rank dead once it has left, and
        # global rank 0 keeps the rendezvous store up until they have marked it
        leave(int(os.environ.get("RANK", 0)))
        distributed = end_process()
    if code and distributed:
        # A failed rank's peers may already have closed their side: a communication thread of
        # this process can then still be joinable at interpreter teardown and end it in
        # std::terminate (-6) instead of its status (seen about once in three full-suite runs
        # of the bad-JSONL test). Everything is flushed: leave without the teardown.
        import logging

        logging.shutdown()
        os._exit(code if isinstance(code, int) else 1)
    sys.exit(code or 0)
