"""The one runner of the ``launch/`` jobs: it owns what every job does around its training step,
and a job supplies only what differs (the shape of torchtitan's ``Trainer``, torchtitan
``torchtitan/train.py``: one trainer owns checkpointing, the loop, metrics and signals; a model
spec says what to build).

A job is a :class:`Job` subclass; the runner calls, in order:

- ``start_process()``: process start-up (DeepSpeed's by default; the FSDP job: ``torchrun``'s;
  importing this module has set the jobs' quiet environment,
  :func:`~launch.jobs.quiet_logs.quiet_job_environment`);
- ``configure()``: the ds_config (read, with the layout checks the job needs); the runner opens
  the run folder with it (:func:`~launch.jobs.checkpoints.open_run`: refused when it holds
  another run, kept with ``--resume``, its monitors off with ``--eval_only``);
- ``build()``: data, model and engine; sets ``device``, ``checkpoints`` (a
  :class:`~launch.jobs.checkpoints.DeepSpeedCheckpoints`, or the job's own with the same
  ``save`` / ``load``) and ``engine`` (whose monitors close at the end; None without);
- ``begin(start)``, then ``step(step)`` once per optimizer step: the metrics.csv row;
- ``evaluate()``: the held-out figures, before training, every ``eval_every`` steps, after
  training and for ``--eval_only``;
- ``summary()``, ``table(summary)``, ``plot(summary)``, ``csv_rows()``, ``eval_rows(result)``:
  what it adds to ``summary.json`` and shows, as data.

:func:`run` does the rest: the rank-0 logger, the resume of the job's state (``state()`` names
what a checkpoint keeps besides rows, evaluations, saves and training seconds; ``must_match``
what a resumed run may not change), ``--eval_only``'s report, the stop request (exit status 75
on a stop request, ``launch/_stop_status.sh``), the loop (:class:`~launch.jobs.progress.TrainLoop`:
progress bar, stop agreed across ranks, checkpoints through ``save``), the summary's shared keys
(:meth:`Run.shared_summary`) and :func:`~launch.jobs.runs.finish_run` (``metrics.csv``,
``summary.json``, ``loss_curve.png``, the one :func:`print_summary`).

Phases. A job whose phases share one engine and one step count (the preference and GRPO jobs:
SFT steps, then preference / GRPO steps, :mod:`launch.jobs.sft_phases`) is one run: its ``step``
picks the phase. A job whose phases each train another model (the distillation job: teacher,
student on CE, distilled student) runs each phase as a run of its own (:func:`train_run`), a
:class:`Job` whose folder is ``<output_dir>/<phase>``, with its own engine, checkpoints and
outputs, under the job's one stop request; a stopped phase ends the job.

Hugging Face Trainer jobs (:func:`run_trainer`, :class:`TrainerJob`): the Trainer owns the loop,
so they share the process start, the run folder (no resume), the evaluation before and after
training, the summary's timing keys and the outputs, not the loop, checkpoints or signals.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from .checkpoints import CHECKPOINTS, checkpoint_stats, open_run, report_checkpoint_eval
from .processes import run_job, start_process, start_trainer_process
from .progress import TrainLoop
from .quiet_logs import quiet_job_environment
from .reporting import (
    plot_loss_curve,
    print_summary_table,
    rank0_logger,
    write_metrics_csv,
    write_summary_json,
)
from .runs import finish_run, open_trainer_run
from .signals import StopRequest

# what a job's module needs besides: StopRequest (a job passes its module's name of it to
# run, which tests replace) and run_job (its __main__)
__all__ = ["Table", "Run", "Job", "TrainerJob", "run", "train_run", "run_trainer",
           "print_summary", "write_outputs", "StopRequest", "run_job"]

# Every job's process, from the import of its module on (the libraries start later, imported
# inside the functions that use them): no tokenizers threads, no Hub access, DeepSpeed's
# start-up noise dropped.
quiet_job_environment()


@dataclass
class Table:
    """A job's summary table: ``rows`` of formatted cells under ``columns``, ``info`` under it
    (:func:`print_summary` adds how a stopped run ended)."""

    title: str
    rows: Sequence[Tuple[str, ...]]
    info: str
    columns: Sequence[str] = ("metric", "before", "after")


def print_summary(table: Table, summary: Mapping[str, Any]) -> None:
    """``table`` on stdout (:func:`~launch.jobs.reporting.print_summary_table`), its info line
    followed by the step and signal that stopped the run when ``summary["stopped"]`` says so."""
    stopped = summary.get("stopped")
    info = table.info + (f"; stopped by {stopped['signal']} at step {stopped['step']} (resume "
                         "with --resume)" if stopped else "")
    print_summary_table(table.title, table.rows, info, columns=table.columns)


class Run:
    """One run as the runner keeps it; a job reads it as ``self.run``: ``rank``, ``log``,
    ``state`` (what a checkpoint saves: ``rows``, ``evals``, ``saves``, ``train_seconds``,
    ``steps_done`` and the job's own keys), ``resumed_from``, ``start`` (the step it resumed
    at), ``last`` (the last step done), ``stopped`` (``{"signal", "step"}`` or None) and
    ``seconds`` (training seconds, resumed runs' included)."""

    def __init__(self, rank: int, log: Callable[[str], None], t_start: float) -> None:
        self.rank, self.log, self.t_start = rank, log, t_start
        self.state: Dict[str, Any] = {"rows": [], "evals": [], "train_seconds": 0.0,
                                      "saves": [], "steps_done": 0}
        self.resumed_from: Optional[str] = None
        self.start = self.last = self.saves_before = 0
        self.stopped: Optional[dict] = None
        self.loop: Optional[TrainLoop] = None
        self.stop: Optional[StopRequest] = None

    @property
    def rows(self) -> List[Dict[str, Any]]:
        return self.state["rows"]

    @property
    def evals(self) -> List[Dict[str, Any]]:
        return self.state["evals"]

    @property
    def saves(self) -> List[Dict[str, Any]]:
        return self.state["saves"]

    @property
    def seconds(self) -> float:
        return self.loop.seconds if self.loop is not None else self.state["train_seconds"]

    def shared_summary(self, steps_requested: int) -> Dict[str, Any]:
        """The ``summary.json`` keys of every megaloss-loop run."""
        return {"steps": self.last, "steps_requested": steps_requested, "stopped": self.stopped,
                "resumed_from": self.resumed_from, "resumed_at_step": self.start,
                "train_seconds": self.seconds,
                "checkpoints": checkpoint_stats(self.saves, since=self.saves_before)}


class Job:
    """What a job supplies to the runner (module docstring); override what the job has.

    Attributes:
        tag: the log lines' tag (``[lm  1.2s] ...``).
        title: ``--eval_only``'s table title.
        eval_every: steps between held-out evaluations after a step (0: before and after
            training only; a job whose rows show the evaluation calls :meth:`evaluate_at`
            inside its ``step``).
        must_match: keys of :meth:`state` a resumed run must find unchanged, with the options
            that set them (named in the refusal).
        device, engine, checkpoints: set by :meth:`build`.
    """

    tag = "job"
    title = "megaloss job"
    eval_every = 0
    must_match: Mapping[str, str] = {}

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.run: Run = None  # type: ignore[assignment]  # set by the runner
        self.device: Any = "cpu"
        self.engine: Any = None
        self.checkpoints: Any = None

    # the run's shape
    @property
    def out_dir(self) -> Path:
        return Path(self.args.output_dir)

    @property
    def steps(self) -> int:
        """The steps asked for (``summary.json``'s ``steps_requested``)."""
        return self.args.steps

    @property
    def total_steps(self) -> int:
        """The loop's steps (a job of two phases: both)."""
        return self.steps

    @property
    def save_every(self) -> int:
        return self.args.save_every

    @property
    def folder_args(self) -> argparse.Namespace:
        """The options :func:`~launch.jobs.checkpoints.open_run` reads (``resume``,
        ``eval_only``, ``overwrite``)."""
        return self.args

    # what the job supplies
    def start_process(self) -> int:
        """Process start-up; returns the global rank."""
        return start_process(self.args.local_rank, self.args.output_dir)[0]

    def configure(self) -> dict:
        """The ds_config (the run folder is opened with it)."""
        return {}

    def build(self) -> None:
        raise NotImplementedError

    def state(self) -> Dict[str, Any]:
        """The job's own keys of what a checkpoint keeps, with a fresh run's values."""
        return {}

    def record(self) -> Dict[str, Any]:
        """What a checkpoint's record holds besides :attr:`Run.state` (name, data key, seed)."""
        return {}

    def begin(self, start: int) -> None:
        """Before the first step (``start``: the steps already done)."""

    def step(self, step: int) -> Dict[str, Any]:
        raise NotImplementedError

    def evaluate(self) -> Dict[str, Any]:
        raise NotImplementedError

    def eval_point(self, step: int) -> Dict[str, Any]:
        """Where an evaluation after ``step`` is recorded (keys of its ``evals`` entry)."""
        return {"step": step}

    def evaluate_at(self, **point: Any) -> Dict[str, Any]:
        """:meth:`evaluate`, recorded in the run's ``evals`` at ``point``; returns the entry."""
        entry = {**point, **self.evaluate()}
        self.run.evals.append(entry)
        return entry

    def on_eval(self, when: str, entry: Dict[str, Any]) -> None:
        """After the evaluation ``when`` (``"before"`` / ``"after"`` training): its log line."""

    def progress(self, row: Dict[str, Any]) -> Dict[str, str]:
        """The progress bar's figures after the step of ``row``."""
        return {}

    def eval_rows(self, result: Dict[str, Any]) -> List[Tuple[str, str]]:
        """``--eval_only``'s ``(metric, value)`` rows."""
        return [(k, f"{v:.4f}") for k, v in result.items()]

    def summary(self) -> Dict[str, Any]:
        """The job's ``summary.json`` keys (collective: every rank calls it); they win over
        the shared ones (:meth:`Run.shared_summary`)."""
        return {}

    def csv_rows(self) -> List[Dict[str, Any]]:
        return self.run.rows

    def plot(self, summary: Mapping[str, Any]) -> Dict[str, Any]:
        """:func:`~launch.jobs.reporting.plot_loss_curve`'s arguments but the path."""
        raise NotImplementedError

    def table(self, summary: Mapping[str, Any]) -> Table:
        raise NotImplementedError

    def close(self) -> None:
        """When the job ends (process-global state restored)."""


def write_outputs(job: Job, summary: Mapping[str, Any], out_dir: Optional[Path] = None) -> None:
    """``metrics.csv``, ``summary.json`` and ``loss_curve.png`` of ``job`` in ``out_dir``
    (default the job's). Call on one rank."""
    out_dir = job.out_dir if out_dir is None else out_dir
    write_metrics_csv(out_dir / "metrics.csv", job.csv_rows())
    write_summary_json(out_dir / "summary.json", summary)
    plot_loss_curve(out_dir / "loss_curve.png", **job.plot(summary))


def _start(job: Job, t_start: float) -> Run:
    rank = job.start_process()
    job.run = Run(rank, rank0_logger(job.tag, rank, t_start), t_start)
    return job.run


def _open_and_build(job: Job) -> None:
    """The run folder (its verdict agreed on every rank), the job built, its state resumed."""
    run = job.run
    resume_from = open_run(job.folder_args, job.out_dir, job.configure())
    job.build()
    fresh = job.state()
    run.state.update(fresh)
    if resume_from is not None:
        resume_from = job.checkpoints.load(resume_from, run.state, run.log)
        for key, flags in job.must_match.items():
            if run.state[key] != fresh[key]:
                raise SystemExit(f"checkpoint {resume_from} was trained with another {key} "
                                 f"({run.state[key]}): pass the same {flags}")
    run.resumed_from = resume_from
    run.start = run.last = int(run.state["steps_done"])
    run.saves_before = len(run.saves)
    job.begin(run.start)


def _save(job: Job, step: int) -> None:
    run = job.run
    record = {**job.record(), **run.state, "steps_done": step, "train_seconds": run.seconds}
    job.checkpoints.save(job.out_dir / CHECKPOINTS, step, record, job.args.keep_checkpoints,
                         run.saves, run.log)


def _train(job: Job, stop: Optional[StopRequest], stop_request: Callable[[], StopRequest]
           ) -> Dict[str, Any]:
    """The evaluation before training (unless a resumed run holds it), the loop, the
    evaluation after it (not when stopped, nor when the last step's is there); the summary."""
    run = job.run
    if not run.evals:
        job.on_eval("before", job.evaluate_at(**job.eval_point(0)))
    run.stop = stop if stop is not None else stop_request().install()
    loop_args = argparse.Namespace(steps=job.total_steps, no_progress=job.args.no_progress,
                                   save_every=job.save_every, resume=job.args.resume)
    run.loop = TrainLoop(loop_args, run.start, run.state["train_seconds"], run.stop,
                         job.device, lambda step: _save(job, step), run.log)
    for step in run.loop:
        row = job.step(step)
        run.rows.append(row)
        run.last = step
        if job.eval_every and step % job.eval_every == 0 and step != job.total_steps:
            job.evaluate_at(**job.eval_point(step))
        run.loop.show(**job.progress(row))
    run.stopped = run.loop.stopped
    point = job.eval_point(run.last)
    if run.stopped is None and any(run.evals[-1].get(k) != v for k, v in point.items()):
        job.on_eval("after", job.evaluate_at(**point))
    return {**run.shared_summary(job.steps), **job.summary()}


def run(job: Job, stop_request: Callable[[], StopRequest] = StopRequest) -> Dict[str, Any]:
    """Run ``job`` start to end (module docstring); collective. ``stop_request``: the class
    whose instance listens for stop signals (a job passes its module's name for it, which
    tests replace to stop a run at a chosen step).

    Returns:
        the summary (``summary.json``), or ``--eval_only``'s report.
    """
    run = _start(job, time.perf_counter())
    try:
        _open_and_build(job)
        if job.args.eval_only:
            run.log(f"evaluating checkpoint {run.resumed_from} (step {run.start})")
            result = job.evaluate()
            return report_checkpoint_eval(job.out_dir, run.rank, job.title, run.resumed_from,
                                          run.start, result, job.eval_rows(result))
        summary = _train(job, None, stop_request)
        summary["total_seconds"] = time.perf_counter() - run.t_start
        finish_run(job.out_dir, run.rank, lambda: write_outputs(job, summary),
                   lambda: print_summary(job.table(summary), summary), run.log,
                   engine=job.engine, stop=run.stop)
        return summary
    finally:
        job.close()


def train_run(job: Job, within: Run, stop: StopRequest) -> Dict[str, Any]:
    """``job`` as one phase of another job's run ``within`` (its rank, logger and clock): the
    phase's folder opened (``job.folder_args``), built, resumed and trained under ``stop``,
    its monitors closed and its outputs written (rank 0), no table. Collective.

    Returns:
        the phase's summary.
    """
    job.run = Run(within.rank, within.log, within.t_start)
    _open_and_build(job)
    summary = _train(job, stop, StopRequest)
    if job.engine is not None:
        from megaloss.integrations.deepspeed.monitor import close_monitors

        close_monitors(job.engine)
    if within.rank == 0:
        write_outputs(job, summary)
    return summary


class TrainerJob(Job):
    """A job whose loop is a Hugging Face Trainer's (:func:`run_trainer`): it supplies
    ``build()`` (data and model, after ``ds_config`` / ``ml`` are set), ``evaluate()``,
    ``trainer()`` (the Trainer, built after the evaluation before training), ``after(trainer)``
    (what follows the evaluation after training), ``train_rows(trainer)`` (metrics.csv's rows
    from the Trainer's logs) and the reports; ``world`` is the number of processes."""

    world = 1
    ds_config: Dict[str, Any] = {}
    ml: Any = None

    def start_process(self) -> int:
        rank, self.world = start_trainer_process(self.args.local_rank, self.args.report_to,
                                                 self.out_dir)
        return rank

    def trainer(self) -> Any:
        raise NotImplementedError

    def after(self, trainer: Any) -> None:
        """After the evaluation after training."""

    def train_rows(self, trainer: Any) -> List[Dict[str, Any]]:
        raise NotImplementedError


def run_trainer(job: TrainerJob) -> Dict[str, Any]:
    """Run a Hugging Face Trainer job: process start, the run folder (refused when it holds a
    run unless ``--overwrite``; no resume), the build, the evaluation before training, the
    Trainer's loop, the evaluation after it, the summary and the outputs. Collective.

    Returns:
        the summary (``summary.json``).
    """
    run = _start(job, time.perf_counter())
    job.ds_config, job.ml = open_trainer_run(job.args, job.out_dir)
    job.build()
    job.on_eval("before", job.evaluate_at(step=0))
    trainer = job.trainer()
    t_train = time.perf_counter()
    trainer.train()
    run.state["train_seconds"] = time.perf_counter() - t_train
    steps = run.last = trainer.state.global_step
    run.log(f"trained {steps} steps in {run.seconds:.1f} s")
    job.on_eval("after", job.evaluate_at(step=steps))
    job.after(trainer)
    rows = run.state["rows"] = job.train_rows(trainer)
    engine = trainer.model_wrapped
    summary = {"steps": steps, "first_loss": rows[0]["loss"] if rows else None,
               "last_loss": rows[-1]["loss"] if rows else None,
               "dp": job.world, "micro_batch": job.args.batch_size,
               "gas": job.args.gradient_accumulation_steps,
               "zero_stage": (engine.zero_optimization_stage()
                              if hasattr(engine, "zero_optimization_stage") else None),
               "deepspeed_config": job.args.deepspeed_config, **job.summary(),
               "train_seconds": run.seconds, "total_seconds": time.perf_counter() - run.t_start}
    finish_run(job.out_dir, run.rank, lambda: write_outputs(job, summary),
               lambda: print_summary(job.table(summary), summary), run.log)
    return summary
