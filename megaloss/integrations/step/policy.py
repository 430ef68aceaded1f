"""The policy-gradient family of the calibrated step: :func:`megaloss.policy_loss` (the GRPO
family, GSPO, CISPO; TRL's and verl's normalisers) on a log-probs module (:mod:`.log_probs`).

The calibration: the completion masks of all micro-batches, ONE all-reduce over ``dp x sp``
(global tokens, sequences and the ``loss_type``'s denominator,
:func:`megaloss.policy_calibrator`); per micro-batch the module's log-probs (and entropy) of the
completion tokens, :func:`megaloss.policy_loss` with the step's weights
(:func:`megaloss.policy_loss_weights`; under sequence parallelism the sequence-level sums added
over the SP group); the metrics (TRL's names, :func:`megaloss.policy_metrics`) reduced at the
boundary. The result equals one device's step on the global batch for every ``loss_type``.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ...calibration.calibrator import LossCalibrator, StepCalibration
from ...losses.policy import (
    completion_labels,
    policy_calibrator,
    policy_loss,
    policy_loss_weights,
    policy_metrics,
)
from ...losses.policy_options import PolicyLossOptions
from ...losses.router_options import RouterLossOptions
from ...parallel.topology import Topology
from .checks import check_floating, check_same_shape, rows_shape
from .log_probs import (
    check_completion_keys,
    check_sp_attention_mask,
    completion_targets,
    log_probs_forward,
    router_prepass,
    sp_slices,
)
from .loop import StepLoss
from .metrics import PolicyStepMetrics, StepOutcome
from .router import StepRouter, router_stats

__all__ = ["PolicyStepLoss", "check_policy_micro_batch"]

_KEYS = ("input_ids", "completion_mask", "advantages")


def check_policy_micro_batch(i: int, mb: Mapping[str, Any], *, beta: float) -> None:
    """What the policy step reads from ``micro_batches[i]``: integer ``input_ids [B, T]``;
    ``completion_mask`` of that shape; floating ``advantages [B]`` or ``[B, T]``; floating
    ``old_log_probs`` / ``ref_log_probs [B, T]`` where given, ``ref_log_probs`` required when
    ``beta > 0``.

    Raises:
        ValueError / TypeError: naming the key and the expected shape or dtype.
    """
    where = f"micro_batches[{i}]"
    shape = rows_shape(i, mb)
    check_same_shape(f"{where}['completion_mask']", mb.get("completion_mask"), shape)
    check_floating(f"{where}['advantages']", mb.get("advantages"), [shape[:1], shape])
    if beta > 0 and mb.get("ref_log_probs") is None:
        raise ValueError(f"{where} lacks ref_log_probs, required when beta > 0 (the KL penalty)")
    for name in ("old_log_probs", "ref_log_probs"):
        if mb.get(name) is not None:
            check_floating(f"{where}['{name}']", mb[name], [shape])


class PolicyStepLoss(StepLoss):
    """:func:`megaloss.policy_loss` under ``options`` (module docstring); micro-batches with
    ``input_ids``, ``completion_mask``, ``advantages`` and optionally ``old_log_probs``,
    ``ref_log_probs``, ``attention_mask``, ``position_ids``. :meth:`result` is a
    :class:`PolicyStepMetrics`."""

    def __init__(self, options: PolicyLossOptions,
                 router: Optional[RouterLossOptions] = None) -> None:
        if not isinstance(options, PolicyLossOptions):
            raise TypeError(f"options must be a PolicyLossOptions, got {type(options).__name__}")
        self.options = options
        self.router = StepRouter(router)
        self.ignore_index = -100

    def check(self, i: int, mb: Mapping[str, Any], topology: Topology) -> None:
        check_completion_keys(i, mb, _KEYS)
        check_policy_micro_batch(i, mb, beta=self.options.beta)
        check_sp_attention_mask(i, mb, topology)
        self.router.check(i, mb, topology)

    def prepare(self, forward, step: StepCalibration,
                micro_batches: Sequence[Mapping[str, Any]]) -> None:
        self.router.prepare(step.topology, [
            router_prepass(forward, step.topology, mb, self.ignore_index)
            for mb in micro_batches] if self.router else [])

    def calibrate(self, calibrator: LossCalibrator,
                  micro_batches: Sequence[Mapping[str, Any]]) -> StepCalibration:
        self.ignore_index = ignore = calibrator.ignore_index
        calib = policy_calibrator(self.options, calibrator.topology,
                                  engine_scale=calibrator.engine_scale,
                                  weight_dtype=calibrator.weight_dtype)
        return calib.begin_step([completion_labels(mb["completion_mask"], ignore)
                                 for mb in micro_batches])

    def loss(self, forward, step: StepCalibration, i: int,
             mb: Mapping[str, Any]) -> Tuple[torch.Tensor, Tuple[torch.Tensor, bool]]:
        ignore, topology = self.ignore_index, step.topology
        mb, labels = sp_slices(topology, mb, completion_targets(mb, ignore), ignore)
        log_probs, entropy, router = log_probs_forward(forward, mb, labels, self.router, topology,
                                                       step.num_micro_batches)
        out = policy_loss(log_probs, mb.get("old_log_probs"), mb["advantages"],
                          mb["completion_mask"], ref_log_probs=mb.get("ref_log_probs"),
                          entropy=entropy,
                          weights=policy_loss_weights(step, i, self.options, ignore_index=ignore),
                          options=self.options, return_stats=True, sp_group=topology.sp_group)
        if router is None:
            return out.loss, (out.stats, entropy is not None, None)
        return (out.loss + router.loss.to(out.loss.dtype),
                (out.stats, entropy is not None, router_stats(router)))

    def metrics(self, step: StepCalibration, stats: List[Tuple[torch.Tensor, bool, Any]],
                topology: Topology) -> Dict[str, Any]:
        metrics = policy_metrics([s for s, _, _ in stats], self.options,
                                 group=topology.dp_sp_group,
                                 has_entropy=all(e for _, e, _ in stats))
        return {**metrics, **self.router.metrics([r for _, _, r in stats], topology)}

    def result(self, outcome: StepOutcome) -> PolicyStepMetrics:
        return PolicyStepMetrics(**vars(outcome))
