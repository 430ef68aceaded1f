"""The training progress of a megaloss-loop job: :func:`progress_bar` (tqdm on a terminal, else
:class:`LineProgress`, a line every few steps) and :class:`TrainLoop`, the optimizer-step
loop around the job's own step (progress, then :func:`~launch.jobs.signals.step_boundary`).
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, Optional

from .agreement import distributed_or_none
from .signals import StopRequest, step_boundary

__all__ = ["LineProgress", "progress_bar", "TrainLoop"]

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
    dist = distributed_or_none()
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
