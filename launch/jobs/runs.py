"""What makes a launch job's run one a user can trust, around its training loop: one run per
output folder, failures that every rank reports with their cause, preemption that saves, and
the command-line options for checkpoints and resume the megaloss-loop jobs share.

- :func:`add_run_arguments`: ``--save_every``, ``--resume [latest|PATH]``, ``--eval_only``,
  ``--overwrite``, ``--keep_checkpoints`` (from :mod:`launch.jobs.arguments`).
- :func:`agreed`: run a piece of set-up (on global rank 0, or on every rank) and agree on
  failure: when it fails anywhere, every rank exits with the cause, so the launcher's last lines
  name it rather than another rank's ``Connection closed by peer``.
- :func:`prepare_output_dir` / :func:`resume_source`: refuse to mix a new run with the one
  already in ``--output_dir`` unless told to replace (``--overwrite``) or continue it
  (``--resume``, offered only when it holds a checkpoint); a folder holding only what a run that
  crashed before its first checkpoint left (its monitor files) is started over, saying so.
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
from pathlib import Path
from typing import Any, Callable, Optional, Tuple

from .agreement import AgreedExit, agreed, distributed_or_none
from .arguments import add_run_arguments, check_run_arguments
from .checkpoints import (
    CHECKPOINTS,
    LEFTOVERS,
    RUN_OUTPUTS,
    checkpoint_stats,
    follow_branch,
    open_fresh_run,
    open_run,
    output_dir_refusal,
    prepare_output_dir,
    report_checkpoint_eval,
    resume_job_state,
    resume_source,
    save_run,
)
from .peers import dead_peers
from .processes import end_process, report_error, run_job, start_process, start_trainer_process
from .progress import LineProgress, TrainLoop, progress_bar
from .quiet_logs import (
    ACCELERATE_NOISE,
    DEEPSPEED_NOISE,
    DropMessages,
    quiet_accelerate_logger,
    quiet_deepspeed_logger,
    quiet_job_environment,
)
from .signals import StopRequest, step_boundary

# the names these had when they lived here
_dist = distributed_or_none
_DropMessages = DropMessages
_quiet_deepspeed_logger = quiet_deepspeed_logger
_quiet_accelerate_logger = quiet_accelerate_logger
_report_error = report_error

__all__ = ["RUN_OUTPUTS", "CHECKPOINTS", "LEFTOVERS", "add_run_arguments",
           "check_run_arguments", "agreed", "prepare_output_dir", "output_dir_refusal",
           "resume_source", "open_run", "open_fresh_run", "step_boundary", "save_run",
           "progress_bar", "StopRequest", "start_process", "start_trainer_process",
           "open_trainer_run", "resume_job_state", "report_checkpoint_eval", "checkpoint_stats",
           "finish_run", "TrainLoop", "quiet_job_environment", "AgreedExit", "LineProgress",
           "follow_branch", "end_process", "run_job", "dead_peers", "DEEPSPEED_NOISE",
           "ACCELERATE_NOISE"]


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


def finish_run(out_dir: Path, rank: int, write_outputs: Callable[[], Any],
               print_summary: Callable[[], Any], log: Callable[[str], Any], *,
               engine: Any = None, stop: Optional[StopRequest] = None) -> None:
    """The end of every job: the engine's monitors closed (``engine``: flushed before rank 0
    writes), ``write_outputs()`` and ``print_summary()`` on rank 0 with a log line naming the
    files, a barrier, then the signal handlers of ``stop`` restored (only now: a second signal
    must not cut the outputs' writing short). Collective."""
    import torch.distributed as dist

    if engine is not None:
        from megaloss.integrations.deepspeed.monitor import close_monitors
        close_monitors(engine)
    if rank == 0:
        write_outputs()
        print_summary()
        log(f"wrote {out_dir / 'metrics.csv'}, {out_dir / 'loss_curve.png'}, "
            f"{out_dir / 'summary.json'}")
    dist.barrier()
    if stop is not None:
        stop.restore()
