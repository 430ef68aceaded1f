"""The multi-token prediction family of the calibrated step (DeepSeek-V3, arXiv:2412.19437,
sec. 2.2): a module whose forward computes the main next-token CE and ``D`` MTP depths through
the shared head (:func:`megaloss.losses.multi_token.multi_token_prediction_loss`), each depth
calibrated over the global batch by its own valid-token count.

The calibration: the micro-batches' shifted targets rolled per depth inside packed samples
(:func:`megaloss.losses.multi_token.mtp_labels`), every depth's weights from ONE all-reduce over
``dp x sp`` (:func:`megaloss.losses.multi_token.mtp_loss_weights`); the main loss's calibration
is the step's (its logged loss, token count, engine multiplier). The module's call::

    module(input_ids, shift_labels=main targets, loss_weights=[D + 1 weights, the main's first],
           mtp_labels=[D rolled targets], **inputs)

returns an object with ``loss`` (the weighted sum: main + ``scaling_factor / D`` x depths, plus
its router losses with ``router=``), ``z_loss`` and ``depth_losses [D]`` (each depth's share of
its global mean). The metrics: each depth's global CE (``mtp_loss_1`` ...), one all-reduce.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ...calibration.calibrator import LossCalibrator, StepCalibration
from ...losses.multi_token import MTPLossWeights, mtp_loss_weights
from ...losses.router_options import RouterLossOptions
from ...parallel.comm import all_reduce_sum_
from ...parallel.topology import Topology
from .lm import LanguageModelLoss, micro_batch_targets, model_inputs, sample_boundaries
from .metrics import StepMetrics, StepOutcome
from .router import router_stats

__all__ = ["MultiTokenPredictionStepLoss"]


class MultiTokenPredictionStepLoss(LanguageModelLoss):
    """``depth`` MTP depths (module docstring); the checks, router losses (``router=``) and
    held-out evaluation of :class:`~.lm.LanguageModelLoss`. :meth:`result` is a
    :class:`StepMetrics` whose ``mtp_losses`` are the depths' global CEs.

    Raises:
        ValueError: ``depth`` not an int >= 1.
    """

    def __init__(self, depth: int, router: Optional[RouterLossOptions] = None) -> None:
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth must be an int >= 1 (the MTP depths), got {depth!r}")
        super().__init__(router=router)
        self.depth = depth
        self.mtp: Optional[MTPLossWeights] = None

    def calibrate(self, calibrator: LossCalibrator,
                  micro_batches: Sequence[Mapping[str, Any]]) -> StepCalibration:
        topo, ignore = calibrator.topology, calibrator.ignore_index
        labels = [micro_batch_targets(mb, ignore) for mb in micro_batches]
        self.mtp = mtp_loss_weights(labels, self.depth, calibrator.loss_reduction,
                                    group=topo.dp_sp_group, sp_group=topo.sp_group,
                                    ignore_index=ignore, dtype=calibrator.weight_dtype,
                                    **sample_boundaries(micro_batches))
        local = [calibrator.sp_split(y, topo.sp_rank, topo.sp_size, ignore) for y in labels]
        return StepCalibration(self.mtp.depths[0], local, topo,
                               calibrator.engine_scale.loss_multiplier,
                               count_empty_samples=calibrator.count_empty_samples, labels=labels)

    def loss(self, forward, step: StepCalibration, i: int,
             mb: Mapping[str, Any]) -> Tuple[torch.Tensor, Any]:
        inputs = model_inputs(mb, step.topology)
        out = forward(inputs.pop("input_ids"), shift_labels=step.local_labels(i),
                      loss_weights=self.mtp.weights(i), mtp_labels=self.mtp.depth_labels(i),
                      **self.router.kwargs(step.topology, step.num_micro_batches), **inputs)
        depth_losses = getattr(out, "depth_losses", None)
        if depth_losses is None or depth_losses.numel() != self.depth:
            raise TypeError(f"the module's forward returned {type(out).__name__} without "
                            f"depth_losses of {self.depth} depths: it does not compute the "
                            f"multi-token prediction loss the step asks for")
        router = self.router.output(out)
        return out.loss, (depth_losses.detach().to(torch.float64).reshape(-1),
                          None if router is None else router_stats(router))

    def metrics(self, step: StepCalibration, stats: List[Any],
                topology: Topology) -> Dict[str, Any]:
        depths = stats[0][0].clone()
        for s, _ in stats[1:]:
            depths += s
        all_reduce_sum_(depths, topology.dp_sp_group)
        return {"z_loss": 0.0, "mtp_losses": [float(x) for x in depths],
                **self.router.metrics([r for _, r in stats], topology)}

    def result(self, outcome: StepOutcome) -> StepMetrics:
        metrics = super().result(outcome)
        metrics.mtp_losses = outcome.metrics["mtp_losses"]
        return metrics
