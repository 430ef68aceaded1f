"""The one calibrated optimizer step: every engine and every loss family through the same loop.

One optimizer step over the ``G`` micro-batches of this rank (``G``: the gradient accumulation
steps) is, whatever the engine and the loss:

1. the micro-batches' checks (:meth:`StepLoss.check`), agreed on by every rank of the engine
   before the step's first collective (:func:`~.checks.agreed_checks`: the same error
   everywhere, never one rank left waiting in a collective);
2. the calibration (:meth:`StepLoss.calibrate`): the labels of all ``G`` micro-batches are known
   up front and turned into global per-token (or per-sequence) weights with ONE all-reduce over
   ``dp x sp`` (:meth:`megaloss.LossCalibrator.begin_step`);
3. an optional pre-pass without gradients (:meth:`StepLoss.prepare`: KTO's KL baseline);
4. per micro-batch: the module's forward through the loss (its own input checks agreed on before
   the backward, :func:`~.checks.agreed_forward`), the local weighted sum (:meth:`StepLoss.loss`),
   :meth:`~megaloss.calibration.StepCalibration.loss_for_backward` (times the engine's measured
   loss multiplier, so the engine's own ``1 / (G x DP)`` is undone), the engine's backward and
   micro-step;
5. at the boundary: the global loss and the family's metrics, reduced once
   (:meth:`StepLoss.metrics`), the engine's learning rate and gradient norm, written through the
   engine's monitors.

The result equals one device's step on the global batch for every layout the calibrator's
topology describes. What differs between engines is a small adapter, :class:`StepEngine`
(forward, backward, optimizer step, gradient norm, learning rate, monitors; the reduce group
and the measured loss multiplier are its calibrator's): DeepSpeed's is
:class:`megaloss.integrations.deepspeed.MegalossEngine`, FSDP2 / DDP's
:class:`megaloss.integrations.fsdp.FSDPStepEngine`. The Hugging Face Trainer owns its own loop
(backward, optimizer step): it uses the two halves of :class:`CalibratedStep` directly
(``CalibratedStep(...)`` in ``get_batch_samples``, :meth:`CalibratedStep.micro_batch_loss` in
``compute_loss``). What differs between losses is a :class:`StepLoss` (the families in this
package: :mod:`.lm`, :mod:`.policy`, :mod:`.preference`, :mod:`.mnr`).
"""
from __future__ import annotations

import contextlib
import time
from functools import partial
from typing import Any, Callable, ContextManager, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ...calibration.calibrator import LossCalibrator, StepCalibration
from ...parallel.topology import Topology
from .checks import agreed_checks, agreed_forward, check_count
from .metrics import StepOutcome, peak_memory_mib

__all__ = ["StepEngine", "StepLoss", "CalibratedStep", "run_step", "batch_to_device"]

Forward = Callable[..., Any]


def batch_to_device(mb: Mapping[str, Any], device: torch.device) -> Dict[str, Any]:
    """The micro-batch ``mb`` with its tensors moved to ``device`` (non-blocking)."""
    return {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v)
            for k, v in mb.items()}


class StepEngine:
    """What the step needs of an engine: the adapter each engine supplies.

    Attributes (set by the adapter):
        topology: the process groups (:class:`megaloss.Topology`); the checks are agreed on
            over its ``dp x sp`` and TP groups, the metrics reduced over ``dp x sp``.
        calibrator: the :class:`megaloss.LossCalibrator` over that topology, with the engine's
            measured gradient factor (its ``engine_scale``).
    """

    topology: Topology
    calibrator: LossCalibrator

    @property
    def device(self) -> torch.device:
        """Where the micro-batches go."""
        raise NotImplementedError(f"{type(self).__name__} (an engine adapter) must define "
                                  "device")

    def gradient_accumulation_steps(self) -> Optional[int]:
        """The number of micro-batches a step must hold (checked), or None (any)."""
        return None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's forward through its loss (``input_ids``, ``shift_labels=``,
        ``loss_weights=`` ...: the loss family's call)."""
        raise NotImplementedError(f"{type(self).__name__} (an engine adapter) must define "
                                  "forward")

    def micro_batch(self, last: bool) -> ContextManager:
        """Entered around a micro-batch's forward and backward: where an engine defers its
        gradient reduction to the step's last micro-batch (DDP's ``no_sync``, FSDP2's
        ``set_requires_gradient_sync``)."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's loss (already times the measured multiplier)."""
        loss.backward()

    def after_backward(self, last: bool) -> None:
        """After a micro-batch's backward: the engine's micro-step (DeepSpeed's
        ``engine.step()``, which steps the optimizer at the boundary), or the optimizer step
        after the ``last`` one."""

    def grad_norm(self) -> Optional[float]:
        """The step's global gradient norm (before clipping), or None when not computed."""
        return None

    def lr(self) -> float:
        """The learning rate the step used."""
        raise NotImplementedError(f"{type(self).__name__} (an engine adapter) must define "
                                  "lr")

    def step_count(self) -> int:
        """Optimizer steps done (after this step)."""
        raise NotImplementedError(f"{type(self).__name__} (an engine adapter) must define "
                                  "step_count")

    def samples(self) -> int:
        """The engine's global sample count (the monitors' x-axis), 0 when it keeps none."""
        return 0

    def log(self, metrics: Mapping[str, Any]) -> None:
        """Write one step's metrics to the engine's monitors (none by default)."""


class StepLoss:
    """What a loss family supplies to the step: its micro-batch checks, its calibration, its
    per-micro-batch loss and its metrics. Subclasses: :mod:`.lm` (a module that computes its
    own weighted CE or distillation loss; NLL of a log-probs module), :mod:`.policy`,
    :mod:`.preference`, :mod:`.mnr`."""

    def check(self, i: int, mb: Mapping[str, Any], topology: Topology) -> None:
        """Raise ``ValueError`` / ``TypeError`` for what the family cannot read in
        ``micro_batches[i]`` (run on every rank, then agreed on)."""

    def calibrate(self, calibrator: LossCalibrator,
                  micro_batches: Sequence[Mapping[str, Any]]) -> StepCalibration:
        """The step's calibration: one all-reduce (every rank calls it)."""
        raise NotImplementedError(f"{type(self).__name__} (a loss family) must define "
                                  "calibrate")

    def prepare(self, forward: Forward, step: StepCalibration,
                micro_batches: Sequence[Mapping[str, Any]]) -> None:
        """A pre-pass before the first micro-batch's forward (none by default)."""

    def loss(self, forward: Forward, step: StepCalibration, i: int,
             mb: Mapping[str, Any]) -> Tuple[torch.Tensor, Any]:
        """``(sum_t w_t l_t on this rank, differentiable; the micro-batch's detached stats)``."""
        raise NotImplementedError(f"{type(self).__name__} (a loss family) must define "
                                  "loss")

    def metrics(self, step: StepCalibration, stats: List[Any],
                topology: Topology) -> Dict[str, Any]:
        """The step's metrics from every micro-batch's stats, global over ``dp x sp``
        (collective: every rank calls it)."""
        return {}

    def result(self, outcome: StepOutcome) -> Any:
        """What the step returns (default: the :class:`StepOutcome`)."""
        return outcome


def _check_list(micro_batches: Any, allow_empty: bool) -> None:
    """``micro_batches`` is a list (or tuple) of dicts, non-empty unless ``allow_empty``."""
    if not isinstance(micro_batches, (list, tuple)):
        raise TypeError(f"micro_batches must be a list of dicts (one per micro-batch), got "
                        f"{type(micro_batches).__name__}")
    if not micro_batches and not allow_empty:
        raise ValueError("micro_batches is empty: a step needs at least one micro-batch")
    for i, mb in enumerate(micro_batches):
        if not isinstance(mb, Mapping):
            raise TypeError(f"micro_batches[{i}] must be a dict of tensors, got "
                            f"{type(mb).__name__}")


class CalibratedStep:
    """One optimizer step's micro-batches, checked and calibrated: ``CalibratedStep(...)``, then
    :meth:`micro_batch_loss` per micro-batch (the loss to backward), then :meth:`finish`.
    :func:`run_step` drives it for an engine adapter; a loop that owns its backward and
    optimizer step (the Hugging Face Trainer) calls the halves itself.

    Args:
        loss: the :class:`StepLoss` family.
        calibrator: the engine's :class:`megaloss.LossCalibrator` (its topology is where the
            checks are agreed on and the metrics reduced).
        micro_batches: this rank's micro-batches (a list of dicts of tensors).
        device: where to move them (default: where they are).
        gradient_accumulation_steps: the count the step must hold, or None.
        allow_empty: a step of no micro-batch on this rank is calibrated too (the Trainer's
            last window); otherwise refused.

    Raises:
        TypeError: ``loss`` is not a :class:`StepLoss`, ``calibrator`` not a
            :class:`megaloss.LossCalibrator`.
        ValueError / TypeError: on every rank of the engine alike, when ``micro_batches`` is
            not a list of dicts, is empty, or its count or a micro-batch fails a check on any
            rank (:func:`~.checks.agreed_checks`).
    """

    def __init__(self, loss: StepLoss, calibrator: LossCalibrator,
                 micro_batches: Sequence[Mapping[str, Any]], *,
                 device: Optional[torch.device] = None,
                 gradient_accumulation_steps: Optional[int] = None,
                 allow_empty: bool = False) -> None:
        if not isinstance(loss, StepLoss):
            raise TypeError(f"loss must be a megaloss.integrations.step.StepLoss (a loss "
                            f"family), got {type(loss).__name__}")
        if not isinstance(calibrator, LossCalibrator):
            raise TypeError(f"calibrator must be a megaloss.LossCalibrator, got "
                            f"{type(calibrator).__name__}")
        topology = calibrator.topology

        def checks() -> None:  # agreed on by every rank before the calibration's all-reduce
            _check_list(micro_batches, allow_empty)
            if gradient_accumulation_steps is not None:
                check_count(micro_batches, gradient_accumulation_steps)
            for i, mb in enumerate(micro_batches):
                loss.check(i, mb, topology)

        agreed_checks(checks, topology)
        self.loss = loss
        self.topology = topology
        self.micro_batches = [batch_to_device(mb, device) if device is not None else dict(mb)
                              for mb in micro_batches]
        self.calibration = loss.calibrate(calibrator, self.micro_batches)
        self.stats: List[Any] = []
        self._prepared = False

    def __len__(self) -> int:
        return len(self.micro_batches)

    def micro_batch_loss(self, i: int, forward: Forward, *,
                         micro_batch: Optional[Mapping[str, Any]] = None) -> torch.Tensor:
        """Micro-batch ``i``'s loss to backward: the family's local weighted sum through
        ``forward`` (the module's forward through its loss), times the engine's measured loss
        multiplier (:meth:`~megaloss.calibration.StepCalibration.loss_for_backward`). Its
        detached value and stats are kept for :meth:`finish`. ``micro_batch``: the micro-batch
        as the caller's loop prepared it (the Trainer's ``_prepare_inputs``), default the one
        given."""
        if not self._prepared:
            self.loss.prepare(forward, self.calibration, self.micro_batches)
            self._prepared = True
        mb = self.micro_batches[i] if micro_batch is None else micro_batch
        local, stats = self.loss.loss(forward, self.calibration, i, mb)
        self.stats.append(stats)
        return self.calibration.loss_for_backward(local)

    def finish(self) -> Tuple[float, Dict[str, Any]]:
        """``(global loss, the family's metrics)``: collectives every rank enters once."""
        loss = float(self.calibration.global_loss())
        return loss, self.loss.metrics(self.calibration, self.stats, self.topology)


def run_step(engine: StepEngine, loss: StepLoss, micro_batches: Sequence[Mapping[str, Any]], *,
             log: bool = True) -> Any:
    """One calibrated optimizer step of ``loss`` on ``engine`` over this rank's micro-batches
    (module docstring).

    Args:
        engine: the engine's adapter (:class:`StepEngine`).
        loss: the loss family (:class:`StepLoss`).
        micro_batches: this rank's micro-batches of the step (every rank of the engine calls
            it; TP ranks of one DP rank pass the same batches).
        log: write the metrics through the engine's monitors (:meth:`StepEngine.log`).

    Returns:
        ``loss.result(outcome)`` (the family's metrics type, :class:`StepOutcome` by default).

    Raises:
        TypeError: ``engine`` is not a :class:`StepEngine`.
        ValueError / TypeError: the checks of :class:`CalibratedStep` and of the loss's own
            forward, agreed on by every rank. A check of the loss's forward fails at micro-batch
            ``i``, after the backward of the ones before: their gradients are left in the
            parameters (and the engine's accumulation window open); zero them (the optimizer's
            ``zero_grad``) before training on.
    """
    if not isinstance(engine, StepEngine):
        raise TypeError(f"engine must be a megaloss.integrations.step.StepEngine (an engine's "
                        f"adapter, e.g. a MegalossEngine or an FSDPStepEngine), got "
                        f"{type(engine).__name__}")
    t0 = time.perf_counter()
    step = CalibratedStep(loss, engine.calibrator, micro_batches, device=engine.device,
                          gradient_accumulation_steps=engine.gradient_accumulation_steps())
    forward = partial(agreed_forward, engine.topology, engine.forward)
    for i in range(len(step)):
        last = i == len(step) - 1
        with engine.micro_batch(last):
            engine.backward(step.micro_batch_loss(i, forward))
        engine.after_backward(last)
    global_loss, metrics = step.finish()
    grad_norm = engine.grad_norm()
    outcome = StepOutcome(
        step=engine.step_count(), loss=global_loss, num_tokens=float(step.calibration.num_tokens),
        num_sequences=float(step.calibration.num_samples), lr=engine.lr(),
        grad_norm=None if grad_norm is None else float(grad_norm),
        peak_memory_mib=peak_memory_mib(engine.device), step_time_s=time.perf_counter() - t0,
        samples=engine.samples(), metrics=metrics)
    result = loss.result(outcome)
    if log:
        engine.log(result)
    return result
