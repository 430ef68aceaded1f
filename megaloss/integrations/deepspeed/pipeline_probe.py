"""What a pipeline engine does to the last stage's per-micro-batch losses, measured once at
start-up on a tiny pipeline engine of the same ds_config and layout (:func:`probe_pipeline`,
the method of :mod:`megaloss.calibration.engine_scale`): :class:`PipelineScale`.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, List, Mapping

import torch
from torch import nn

from ...calibration import EngineScale, EngineScaleError
from ...calibration.deepspeed_scale import DROPPED_DS_KEYS
from ...calibration.engine_scale import measure_grad_scale, probe_coefficients, snap_scale
from ...parallel.comm import all_reduce_max_
from .compat import skip_cpu_shm_comm_build
from .pipeline_layout import PipelineLayout

__all__ = ["PipelineScale", "probe_pipeline"]


@dataclass(frozen=True)
class PipelineScale:
    """What a pipeline engine does to the last stage's per-micro-batch losses, measured.

    Attributes:
        gradient: the gradient factor (:class:`~megaloss.calibration.EngineScale`, over each
            stage's data-parallel group; the same on every stage).
        loss_log_multiplier: ``1 / f`` for the factor ``f`` that ``train_batch()``'s returned
            (and logged) loss applies to the sum of all data-parallel ranks' micro-batch losses
            (``1 / (gradient_accumulation_steps x dp)`` in DeepSpeed 0.19.8).
    """

    gradient: EngineScale
    loss_log_multiplier: float


class _ProbeStage(nn.Module):
    """``x -> x + sum(theta - theta.detach())``: the value passes unchanged, and every element
    of ``theta`` gets the gradient of the activation. The last stage's ``theta`` is used in the
    loss function only, as the real head is (outside the stage's forward)."""

    def __init__(self, last: bool):
        super().__init__()
        self.last = last
        self.theta = nn.Parameter(torch.zeros(4))

    def tap(self, x: torch.Tensor) -> torch.Tensor:
        return x + (self.theta - self.theta.detach()).sum()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.last else self.tap(x)


def probe_pipeline(config: Mapping[str, Any], layout: PipelineLayout) -> PipelineScale:
    """Gradient factor and logged-loss factor of DeepSpeed's pipeline engine for ``config`` over
    ``layout``, measured on a tiny ``PipelineModule`` (one probe stage per pipeline stage) through
    the real ``train_batch()``.

    Pipeline ``d`` (its data-parallel index) feeds the losses ``a_di * sum(theta)``, ``a_di``
    from :func:`~megaloss.calibration.engine_scale.probe_coefficients` of ``d``; every stage's
    ``theta`` is read after the step through the parameter update of ``torch.optim.SGD(lr=1)``
    from 0 (``theta = -g``: ``train_batch()`` steps the optimizer itself). Collective: every
    rank of the world calls it.

    Raises:
        EngineScaleError: either factor is not one uniform ``k`` or ``1/k`` on all ranks (see
            :func:`~megaloss.calibration.engine_scale.measure_grad_scale`).
    """
    import deepspeed
    from deepspeed.pipe import PipelineModule

    skip_cpu_shm_comm_build()
    cfg = {k: copy.deepcopy(v) for k, v in config.items() if k not in DROPPED_DS_KEYS}
    cfg["zero_allow_untested_optimizer"] = True
    cfg["gradient_clipping"] = 0.0  # DeepSpeed's default is 1.0; the update must be -g
    pp = layout.num_stages
    module = PipelineModule(layers=[_ProbeStage(k == pp - 1) for k in range(pp)],
                            topology=layout.process_topology, partition_method="uniform")
    stage = module.forward_funcs[-1]
    module.loss_fn = lambda out, a: (a * stage.tap(out)).sum()
    engine, *_ = deepspeed.initialize(
        model=module, optimizer=torch.optim.SGD(module.parameters(), lr=1.0), config=cfg)
    try:
        gas = int(engine.gradient_accumulation_steps())
        topo = layout.topology
        dp = topo.dp_size
        logged: List[float] = []

        def run(coeffs):
            data = [(torch.ones(1), torch.tensor([a], dtype=torch.float32)) for a in coeffs]
            logged.append(float(engine.train_batch(iter(data))))
            return -stage.theta.detach().clone()

        name = f"deepspeed-pipeline-zero{int(engine.zero_optimization_stage())}/train_batch"
        gradient = measure_grad_scale(run, group=topo.dp_group, gas=gas, engine=name,
                                      device=engine.device,
                                      coefficient_ids=(topo.dp_rank, range(dp)))
        total = sum(sum(probe_coefficients(d, gas)) for d in range(dp))
        f = logged[0] / total
        probe = torch.tensor([f, -f], dtype=torch.float64, device=engine.device)
        all_reduce_max_(probe, None)
        f_max, f_min = float(probe[0]), -float(probe[1])
        m = snap_scale(1.0 / f_max) if f_min > 0 and math.isfinite(f_max) else math.nan
        if math.isnan(m) or f_max - f_min > 1e-4 * f_max:
            raise EngineScaleError(f"{name}: the loss train_batch() returns is "
                                   f"[{f_min:.6g}, {f_max:.6g}] x the sum of the micro-batch "
                                   "losses, not one 1/k on all ranks")
        return PipelineScale(gradient, m)
    finally:
        if hasattr(engine, "destroy"):
            engine.destroy()
