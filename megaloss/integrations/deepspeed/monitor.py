"""Metrics through DeepSpeed's monitor: ``engine.monitor.write_events`` writes on global rank 0
to whichever of the ds_config's ``csv_monitor`` / ``tensorboard`` / ``wandb`` / ``comet``
sections is enabled (DeepSpeed 0.19's ``monitor/monitor.py``)."""
from __future__ import annotations

from typing import Any, Mapping

__all__ = ["MONITOR_SECTIONS", "write_metrics"]

MONITOR_SECTIONS = ("csv_monitor", "tensorboard", "wandb", "comet")


def write_metrics(engine: Any, metrics: Mapping[str, float], step: int,
                  prefix: str = "Train/megaloss/") -> None:
    """Send ``{name: value}`` to the engine's monitors as ``(prefix + name, value, step)``.

    DeepSpeed's ``MonitorMaster`` writes on global rank 0 only and does nothing when no monitor
    section is enabled; every rank may call this. ``None`` values are skipped.
    """
    monitor = getattr(engine, "monitor", None)
    if monitor is None or not getattr(monitor, "enabled", False):
        return
    events = [(prefix + k, float(v), int(step)) for k, v in metrics.items() if v is not None]
    monitor.write_events(events)
