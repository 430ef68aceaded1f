"""What the ``launch/`` jobs write and print for their users: a per-step metrics CSV, a loss-curve
PNG, ``summary.json``, a before/after summary table, and a timed rank-0 log line.

These are host-side helpers for the end of a job (or a log line now and then), never for the hot
path. Call the writers on one rank (the jobs use global rank 0): they write files without any
collective. ``matplotlib`` (Agg backend, no display needed) and ``rich`` are dependencies of the
``hf`` extra and are imported inside the functions that use them, so importing this module is
cheap.
"""
from __future__ import annotations

import csv
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, Tuple, Union

__all__ = ["Curve", "write_metrics_csv", "write_summary_json", "plot_loss_curve",
           "print_summary_table", "rank0_logger"]

PathLike = Union[str, Path]


def write_metrics_csv(path: PathLike, rows: Sequence[Mapping[str, Any]]) -> None:
    """Write one CSV row per mapping, with the header taken from the first row's keys.

    Args:
        path: the ``.csv`` file; its parent directory is created.
        rows: e.g. one ``{"step": 1, "loss": 2.3, ...}`` per optimizer step; every row must have
            the first row's keys (no more). No file is written when ``rows`` is empty.

    Raises:
        ValueError: a row has a key the first row does not have (from ``csv.DictWriter``).
    """
    if not rows:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def write_summary_json(path: PathLike, summary: Mapping[str, Any]) -> None:
    """Write ``summary`` as indented JSON (parent directory created).

    Raises:
        TypeError: a value JSON cannot encode.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2), encoding="utf-8")


@dataclass(frozen=True)
class Curve:
    """One line of :func:`plot_loss_curve`: ``values[i]`` at optimizer step ``steps[i]``.

    ``fmt`` is matplotlib's format string (``"-"``, ``"o-"``); ``style`` extra keyword arguments
    of ``Axes.plot`` (``color``, ``alpha``, ``lw``).
    """

    label: str
    steps: Sequence[float]
    values: Sequence[float]
    fmt: str = "-"
    style: Mapping[str, Any] = field(default_factory=dict)


def plot_loss_curve(path: PathLike, curves: Sequence[Curve], *, title: str, ylabel: str,
                    xlabel: str = "optimizer step", secondary: Sequence[Curve] = (),
                    secondary_ylabel: Optional[str] = None, grid: bool = False) -> None:
    """Save a PNG (120 dpi, 7 x 4 in) of ``curves`` against the optimizer step.

    Args:
        path: the ``.png`` file; its parent directory is created.
        curves: lines on the left axis (e.g. train loss and held-out loss, in nats / token).
        title, ylabel, xlabel: axis texts.
        secondary: lines on a right-hand axis of their own (e.g. an accuracy in [0, 1]); with
            any, the legend is drawn for the whole figure so it lists both axes' lines.
        secondary_ylabel: label of the right-hand axis.
        grid: light grid on the left axis.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    for c in curves:
        ax.plot(list(c.steps), list(c.values), c.fmt, label=c.label, **dict(c.style))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if grid:
        ax.grid(alpha=0.3)
    if secondary:
        ax2 = ax.twinx()
        for c in secondary:
            ax2.plot(list(c.steps), list(c.values), c.fmt, label=c.label, **dict(c.style))
        if secondary_ylabel:
            ax2.set_ylabel(secondary_ylabel)
        fig.legend(loc="center right", bbox_to_anchor=(0.88, 0.5))
    else:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_summary_table(title: str, rows: Sequence[Tuple[str, ...]], caption: str = "", *,
                        columns: Sequence[str] = ("metric", "before", "after")) -> None:
    """Print a ``rich`` table to stdout: the first column left-aligned, the others (numbers,
    already formatted as strings) right-aligned, ``caption`` under it.

    Raises:
        ValueError: a row's length differs from ``columns``'.
    """
    from rich.console import Console
    from rich.table import Table

    for r in rows:
        if len(r) != len(columns):
            raise ValueError(f"rows: {r!r} has {len(r)} cells for {len(columns)} columns")
    table = Table(title=title, caption=caption or None)
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 else "right")
    for r in rows:
        table.add_row(*r)
    Console().print(table)


def rank0_logger(tag: str, rank: int, t_start: Optional[float] = None) -> Callable[[str], None]:
    """A ``log(msg)`` that prints ``[tag  12.3s] msg`` (seconds since ``t_start``, a
    ``time.perf_counter()`` value; default: now) and flushes, on ``rank == 0`` only; the other
    ranks' calls do nothing, so every rank may call it."""
    t0 = time.perf_counter() if t_start is None else t_start

    def log(msg: str) -> None:
        if rank == 0:
            print(f"[{tag} {time.perf_counter() - t0:6.1f}s] {msg}", flush=True)

    return log
