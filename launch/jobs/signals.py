"""Stopping a run on a signal: :class:`StopRequest` (SIGTERM / SIGINT / SIGUSR1 ask for a stop at
the next step boundary, agreed across ranks with one tiny all-reduce per step; repeats of the
request are merged, and only a SIGINT once the checkpoint is being saved, after a grace,
aborts) and :func:`step_boundary` (after each optimizer step: the stop agreed, the
checkpoints saved).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from .agreement import distributed_or_none

__all__ = ["StopRequest", "step_boundary"]

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
        d = distributed_or_none()
        if d is not None:
            d.all_reduce(flag, op=d.ReduceOp.MAX)
        stop = bool(flag.item() > 0)
        if stop and self.received is None:
            import time

            self.received, self._first = "a signal on another rank", time.monotonic()
        return stop


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
