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
- :class:`StopRequest`: SIGTERM / SIGINT ask for a stop at the next step boundary, agreed across
  ranks with one tiny all-reduce per step; a second SIGINT interrupts at once.
- :func:`start_process` / :func:`start_trainer_process`: a launched process's start-up;
  :func:`open_trainer_run`: a trainer job's ds_config and run folder.
- :func:`resume_job_state`, :func:`report_checkpoint_eval`, :func:`checkpoint_stats`,
  :func:`finish_run`: resume, ``--eval_only``'s report and the end-of-run tail every job shares.

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

__all__ = ["RUN_OUTPUTS", "CHECKPOINTS", "add_run_arguments", "check_run_arguments", "agreed",
           "prepare_output_dir", "resume_source", "open_run", "open_fresh_run", "step_boundary",
           "save_run", "progress_bar", "StopRequest", "start_process", "start_trainer_process",
           "open_trainer_run", "resume_job_state", "report_checkpoint_eval", "checkpoint_stats",
           "finish_run", "TrainLoop", "quiet_job_environment"]

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

    from megaloss.integrations.deepspeed import configure_launched_process
    from megaloss.testing import free_port

    configure_launched_process()
    if "RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" not in os.environ:
        # plain `python -m launch.<job>`: one process (DeepSpeed would look for MPI)
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", str(free_port())))
    deepspeed.init_distributed()
    get_accelerator().set_device(local_rank)
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
    if not torch.cuda.is_available():
        os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    if report_to != "none":
        os.environ.setdefault("WANDB_DIR", str(out_dir.resolve()))  # <output_dir>/wandb
        os.environ.setdefault("WANDB_PROJECT", "megaloss")
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
                     options: str, log: Callable[[str], Any]) -> None:
    """Load the checkpoint ``resume_from`` into the engine of ``me``
    (:func:`megaloss.integrations.deepspeed.load_checkpoint`) and the job's own record saved with
    it (client state ``"job"``) into ``job_state`` (its keys only). Collective.

    Args:
        expected: client-state values this run must match (the data cache key, the vocabulary),
            by key.
        options: the command-line options that decide them, named in the error.

    Raises:
        SystemExit: the checkpoint was trained on other data or another tokenizer.
    """
    import time

    from megaloss.integrations.deepspeed import load_checkpoint

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


def report_checkpoint_eval(out_dir: Path, rank: int, title: str, resume_from: str, step: int,
                           result: Dict[str, float], rows: Sequence[Tuple[str, str]]) -> dict:
    """``--eval_only``'s report: ``<out_dir>/eval_step<step>.json`` (``{"checkpoint", "step",
    "eval": result}``) and a ``metric | value`` table of ``rows`` on rank 0, then a barrier.

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


def checkpoint_stats(saves: List[dict]) -> Optional[Dict[str, Any]]:
    """``summary.json``'s ``checkpoints``: how many saves, mean seconds and MiB per save, the
    last folder (``None`` without saves)."""
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
