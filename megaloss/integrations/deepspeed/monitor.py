"""Metrics through DeepSpeed's monitor: ``engine.monitor.write_events`` writes on global rank 0
to whichever of the ds_config's ``csv_monitor`` / ``tensorboard`` / ``wandb`` / ``comet``
sections is enabled (DeepSpeed 0.19's ``monitor/monitor.py``).

**One x-axis.** DeepSpeed writes its own events (``Train/Samples/lr``, ...) at the engine's
global *sample* count (``engine.global_samples``), and W&B drops every later log whose step is
smaller than one already logged. So megaloss writes its events at the same sample count
(:func:`monitor_step`), never at optimizer steps: every series of every monitor shares one
monotone axis, and W&B keeps them all. The optimizer step itself is a series,
``Train/megaloss/optimizer_step``, for plotting against steps.

**Runs that continue.** :func:`continue_monitors` makes a resumed engine's monitors continue the
interrupted run's files instead of mixing with them: the ``csv_monitor`` files lose the rows
after the checkpoint and get no second header; TensorBoard discards the events after it
(``purge_step``). :func:`close_monitors` flushes them and ends the W&B run.
"""
from __future__ import annotations

import csv
import io
import os
from typing import Any, Mapping, Optional

__all__ = ["MONITOR_SECTIONS", "write_metrics", "monitor_step", "continue_monitors",
           "close_monitors"]

MONITOR_SECTIONS = ("csv_monitor", "tensorboard", "wandb", "comet")


def monitor_step(engine: Any) -> int:
    """The x-axis value of every monitor event: the engine's global sample count, the axis
    DeepSpeed writes its own ``Train/Samples/*`` events at (0 before the first step)."""
    return int(getattr(engine, "global_samples", 0) or 0)


def write_metrics(engine: Any, metrics: Mapping[str, float], step: Optional[int] = None,
                  prefix: str = "Train/megaloss/") -> None:
    """Send ``{name: value}`` to the engine's monitors as ``(prefix + name, value, step)``.

    Args:
        engine: a DeepSpeed engine.
        metrics: values; ``None`` values are skipped.
        step: the x value; default :func:`monitor_step` (the global sample count DeepSpeed's
            own events use). Pass another value only for monitors without W&B: W&B drops events
            whose step is below one it has seen.
        prefix: tag prefix (``Train/megaloss/``, ``Eval/megaloss/``).

    DeepSpeed's ``MonitorMaster`` writes on global rank 0 only and does nothing when no monitor
    section is enabled; every rank may call this.
    """
    monitor = getattr(engine, "monitor", None)
    if monitor is None or not getattr(monitor, "enabled", False):
        return
    x = monitor_step(engine) if step is None else int(step)
    events = [(prefix + k, float(v), x) for k, v in metrics.items() if v is not None]
    monitor.write_events(events)


def _truncate_csv(path: str, step: int) -> str:
    """Keep the header and the rows at x <= ``step`` of one csv_monitor file; return the header
    name DeepSpeed gave it."""
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))
    header = rows[0] if rows else []
    kept = [r for r in rows[1:] if r and r[0] != "step" and float(r[0]) <= step]
    buf = io.StringIO()
    w = csv.writer(buf)
    if header:
        w.writerow(header)
    w.writerows(kept)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", newline="", encoding="utf-8") as f:
        f.write(buf.getvalue())
    os.replace(tmp, path)
    return header[1] if len(header) > 1 else ""


def continue_monitors(engine: Any, step: Optional[int] = None) -> None:
    """After ``engine.load_checkpoint``: let the monitors continue the checkpointed run's files.

    - ``csv_monitor``: every ``*.csv`` in its folder keeps its header and the rows at x <= ``step``
      (rows an interrupted run wrote after its last checkpoint go), and DeepSpeed's monitor is
      told the files exist, so it appends without a second header.
    - ``tensorboard``: the writer is reopened with ``purge_step=step + 1``; TensorBoard then
      ignores the earlier events files' events after ``step``.
    - ``wandb``: a resumed job is a new W&B run (same project and group); nothing to do.

    Args:
        step: the x value of the checkpoint; default :func:`monitor_step` (the restored sample
            count).

    Only global rank 0 has monitors; a no-op elsewhere and for disabled sections.
    """
    master = getattr(engine, "monitor", None)
    if master is None:
        return
    step = monitor_step(engine) if step is None else int(step)
    csv_mon = getattr(master, "csv_monitor", None)
    log_dir = getattr(csv_mon, "log_dir", None)
    if csv_mon is not None and getattr(csv_mon, "enabled", False) and log_dir \
            and os.path.isdir(log_dir):
        for name in sorted(os.listdir(log_dir)):
            if name.endswith(".csv"):
                _truncate_csv(os.path.join(log_dir, name), step)
                if name[:-4] not in csv_mon.filenames:
                    csv_mon.filenames.append(name[:-4])
    tb = getattr(master, "tb_monitor", None)
    writer = getattr(tb, "summary_writer", None)
    if writer is not None:
        from torch.utils.tensorboard import SummaryWriter

        log_dir = writer.log_dir
        writer.close()
        tb.summary_writer = SummaryWriter(log_dir=log_dir, purge_step=step + 1)


def close_monitors(engine: Any) -> None:
    """Flush TensorBoard and finish the W&B run the engine's monitor started (rank 0; a no-op
    where nothing is open). Call it at the end of a job, so a later engine in the same process
    starts a run of its own."""
    master = getattr(engine, "monitor", None)
    tb = getattr(master, "tb_monitor", None)
    if getattr(tb, "summary_writer", None) is not None:
        tb.summary_writer.flush()
    if getattr(master, "wandb_monitor", None) is not None:
        import wandb

        if wandb.run is not None:
            wandb.finish()
