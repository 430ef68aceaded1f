"""DeepSpeed's adapter to the one calibrated step (:mod:`megaloss.integrations.step`):
:class:`DeepSpeedStepEngine`, which :class:`~.engine.MegalossEngine` is.

Per micro-batch ``engine(...)`` runs the module (its forward computes the loss: ZeRO-3 gathers the
lm_head there), ``engine.backward(loss x measured multiplier)`` and ``engine.step()`` (DeepSpeed
steps the optimizer at its accumulation boundary). The gradient norm is the engine's
(``get_global_grad_norm``); under ZeRO-0 with a torch optimizer, where DeepSpeed clips but keeps
no norm, megaloss computes it before the boundary's ``engine.step()``
(:func:`reduced_grad_norm`). Metrics go through ``engine.monitor`` at the engine's global sample
count (:func:`~.monitor.write_metrics`).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from ...parallel.comm import all_reduce_sum_
from ...parallel.param_tags import is_tensor_parallel
from ...parallel.topology import Topology
from ..step.loop import StepEngine
from .monitor import write_metrics

__all__ = ["DeepSpeedStepEngine", "reduced_grad_norm"]


def reduced_grad_norm(module: torch.nn.Module, topology: Topology) -> torch.Tensor:
    """L2 norm of the whole model's gradients (as DeepSpeed's clipping computes it): TP-sharded
    parameters counted on every TP rank, replicated ones on TP rank 0 only, SUM over TP. For
    ZeRO-0 with a plain torch optimizer, where DeepSpeed clips but does not keep the norm; call
    it after the boundary's backward (gradients already averaged over DP), before ``step()``."""
    first = next(module.parameters())
    total = torch.zeros((), dtype=torch.float64, device=first.device)
    for p in module.parameters():
        if p.grad is not None and (is_tensor_parallel(p) or topology.tp_rank == 0):
            total += p.grad.detach().to(torch.float64).pow(2).sum()
    return all_reduce_sum_(total, topology.tp_group).sqrt()


class DeepSpeedStepEngine(StepEngine):
    """The :class:`~megaloss.integrations.step.StepEngine` of a DeepSpeed engine (module
    docstring). Needs the attributes ``engine`` (the ``DeepSpeedEngine``), ``topology`` and
    ``calibrator``, which :class:`~.engine.MegalossEngine` holds."""

    engine: Any
    _own_grad_norm: Optional[torch.Tensor] = None

    @property
    def device(self) -> torch.device:
        return self.engine.device

    def gradient_accumulation_steps(self) -> int:
        return int(self.engine.gradient_accumulation_steps())

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def after_backward(self, last: bool) -> None:
        self._own_grad_norm = None
        if last and self.engine.zero_optimization_stage() == 0:
            self._own_grad_norm = reduced_grad_norm(self.engine.module, self.topology)
        self.engine.step()

    def grad_norm(self) -> Optional[float]:
        norm = self.engine.get_global_grad_norm()
        if norm is None:
            norm = self._own_grad_norm
        return None if norm is None else float(norm)

    def lr(self) -> float:
        return float(self.engine.get_lr()[0])

    def step_count(self) -> int:
        return int(self.engine.global_steps)

    def samples(self) -> int:
        return int(getattr(self.engine, "global_samples", 0))

    def log(self, metrics: Any) -> None:
        """The step's metrics (a ``StepMetrics`` / ``PolicyStepMetrics``) as
        ``Train/megaloss/<name>`` events, the optimizer step as ``optimizer_step``, at the
        engine's global sample count."""
        d = metrics.as_dict()
        d["optimizer_step"] = d.pop("step")
        d.pop("samples")
        write_metrics(self.engine, d)
