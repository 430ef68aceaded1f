"""The preference family of the calibrated step: a loss on sequence log-probs chosen by the type
of its options (:func:`megaloss.losses.sequence_preference_loss`): DPO / IPO and TRL's other
pairwise types, CPO / SimPO, ORPO, KTO (the math and its sources in those losses' modules:
arXiv:2305.18290, 2401.08417, 2405.14734, 2403.07691, 2402.01306), on a log-probs module
(:mod:`.log_probs`).

The calibration: ONE all-reduce on the chosen completions' labels (KTO: every row's), whose
counts give each pair ``1 / N_pairs`` and each NLL token ``1 / N_tokens`` of the whole step
(:func:`megaloss.losses.preference_weights`); for KTO with KL rows, their forward under
``no_grad`` before the first micro-batch and one more all-reduce (the step's ``z0``,
:func:`megaloss.losses.kto_kl_baseline`); per micro-batch the sequence log-probs (under sequence
parallelism the slices' sums added over the SP group: each pair or example counts once) and the
loss; the metrics (TRL's names) reduced at the boundary. The result equals one device's step on
the global batch for any DP x GAS x SP split.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ...calibration.calibrator import LossCalibrator, StepCalibration
from ...losses import preference_weights
from ...losses.dpo import dpo_metrics, sequence_log_probs
from ...losses.kto import kto_kl_baseline, kto_metrics
from ...losses.orpo import orpo_metrics
from ...losses.policy import completion_labels
from ...losses.preference import (
    PREFERENCE_LOSSES,
    PreferenceOptions,
    preference_loss_kind,
    sequence_preference_loss,
)
from ...losses.router_options import RouterLossOptions
from ...losses.simpo import cpo_metrics
from ...parallel.topology import Topology
from .checks import check_floating, check_same_shape, integer_tensor, rows_shape
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

__all__ = ["PreferenceStepLoss", "PREFERENCE_LOSSES", "KTO_KL_KEYS", "check_dpo_micro_batch",
           "check_preference_micro_batch"]

KTO_KL_KEYS = ("kl_input_ids", "kl_completion_mask", "ref_kl_log_probs")

_KEYS = {"dpo": ("input_ids", "completion_mask", "ref_chosen_log_probs",
                 "ref_rejected_log_probs"),
         "cpo": ("input_ids", "completion_mask"),
         "orpo": ("input_ids", "completion_mask"),
         "kto": ("input_ids", "completion_mask", "desirable", "ref_log_probs")}
_METRICS = {"dpo": dpo_metrics, "cpo": cpo_metrics, "orpo": orpo_metrics, "kto": kto_metrics}


def _paired_rows(where: str, shape: tuple) -> None:
    if shape[0] % 2:
        raise ValueError(f"{where}: input_ids must hold 2P rows (chosen, then rejected), got "
                         f"{shape[0]}")


def check_dpo_micro_batch(i: int, mb: Mapping[str, Any]) -> None:
    """What the DPO step reads from ``micro_batches[i]``: integer ``input_ids [2P, T]`` (chosen
    rows, then rejected); ``completion_mask`` of that shape; floating ``ref_chosen_log_probs``
    and ``ref_rejected_log_probs [P]``.

    Raises:
        ValueError / TypeError: naming the key and the expected shape or dtype.
    """
    where = f"micro_batches[{i}]"
    shape = rows_shape(i, mb)
    _paired_rows(where, shape)
    check_same_shape(f"{where}['completion_mask']", mb.get("completion_mask"), shape)
    for name in ("ref_chosen_log_probs", "ref_rejected_log_probs"):
        check_floating(f"{where}['{name}']", mb.get(name), [(shape[0] // 2,)])


def check_preference_micro_batch(i: int, mb: Mapping[str, Any], *, loss: str) -> None:
    """What the preference step reads from ``micro_batches[i]`` for ``loss`` (one of
    :data:`PREFERENCE_LOSSES`): ``"dpo"`` as :func:`check_dpo_micro_batch`; ``"cpo"`` /
    ``"orpo"``: integer ``input_ids [2P, T]`` (chosen rows, then rejected) and
    ``completion_mask`` of that shape; ``"kto"``: integer ``input_ids [B, T]`` (one example a
    row), ``completion_mask`` of that shape, integer or bool ``desirable [B]``, floating
    ``ref_log_probs [B]``, and either none or all of :data:`KTO_KL_KEYS` (``kl_input_ids
    [K, T']``, ``kl_completion_mask`` of its shape, floating ``ref_kl_log_probs [K]``).

    Raises:
        ValueError / TypeError: naming the key and the expected shape or dtype.
    """
    if loss == "dpo":
        check_dpo_micro_batch(i, mb)
        return
    where = f"micro_batches[{i}]"
    shape = rows_shape(i, mb)
    check_same_shape(f"{where}['completion_mask']", mb.get("completion_mask"), shape)
    if loss in ("cpo", "orpo"):
        _paired_rows(where, shape)
        return
    desirable = integer_tensor(f"{where}['desirable']", mb.get("desirable"))
    if tuple(desirable.shape) != shape[:1]:
        raise ValueError(f"{where}['desirable'] must have shape {shape[:1]}, got "
                         f"{tuple(desirable.shape)}")
    check_floating(f"{where}['ref_log_probs']", mb.get("ref_log_probs"), [shape[:1]])
    given = [k for k in KTO_KL_KEYS if mb.get(k) is not None]
    if given and len(given) != len(KTO_KL_KEYS):
        missing = [k for k in KTO_KL_KEYS if k not in given]
        raise ValueError(f"{where} has {', '.join(given)} but lacks {', '.join(missing)} (KTO's "
                         "KL rows need all three)")
    if given:
        kl_ids = integer_tensor(f"{where}['kl_input_ids']", mb["kl_input_ids"])
        if kl_ids.dim() != 2:
            raise ValueError(f"{where}['kl_input_ids'] must be [K, T], got "
                             f"{tuple(kl_ids.shape)}")
        kl_shape = tuple(kl_ids.shape)
        check_same_shape(f"{where}['kl_completion_mask']", mb["kl_completion_mask"], kl_shape,
                         of="kl_input_ids")
        check_floating(f"{where}['ref_kl_log_probs']", mb["ref_kl_log_probs"], [kl_shape[:1]])


class PreferenceStepLoss(StepLoss):
    """The preference loss of ``options``' type (module docstring). Micro-batches: DPO
    ``input_ids [2P, T]`` (the ``P`` chosen rows, then their ``P`` rejected rows),
    ``completion_mask``, ``ref_chosen_log_probs [P]``, ``ref_rejected_log_probs [P]``;
    CPO / SimPO / ORPO ``input_ids [2P, T]``, ``completion_mask``; KTO ``input_ids [B, T]``,
    ``completion_mask``, ``desirable [B]``, ``ref_log_probs [B]``, optionally the KL rows
    (:data:`KTO_KL_KEYS`). :meth:`result` is a :class:`PolicyStepMetrics`.

    Raises:
        TypeError: ``options`` of none of the preference options classes.
    """

    def __init__(self, options: PreferenceOptions,
                 router: Optional[RouterLossOptions] = None) -> None:
        self.kind = preference_loss_kind(options)
        self.options = options
        self.router = StepRouter(router)
        self.ignore_index = -100
        self.z0: Optional[torch.Tensor] = None

    def check(self, i: int, mb: Mapping[str, Any], topology: Topology) -> None:
        check_completion_keys(i, mb, _KEYS[self.kind])
        check_preference_micro_batch(i, mb, loss=self.kind)
        check_sp_attention_mask(i, mb, topology)
        self.router.check(i, mb, topology)

    def calibrate(self, calibrator: LossCalibrator,
                  micro_batches: Sequence[Mapping[str, Any]]) -> StepCalibration:
        self.ignore_index = ignore = calibrator.ignore_index
        calib = LossCalibrator(calibrator.topology, loss_reduction="sample",
                               engine_scale=calibrator.engine_scale, ignore_index=ignore,
                               weight_dtype=calibrator.weight_dtype)
        rows = [mb["completion_mask"] if self.kind == "kto"
                else mb["completion_mask"][: mb["input_ids"].shape[0] // 2]
                for mb in micro_batches]
        return calib.begin_step([completion_labels(m, ignore) for m in rows])

    def prepare(self, forward, step: StepCalibration,
                micro_batches: Sequence[Mapping[str, Any]]) -> None:
        """KTO's ``z0`` of the step (:func:`megaloss.losses.kto_kl_baseline`): the KL rows'
        sequence log-probs under the policy (``no_grad``, SP slices added over the SP group)
        against ``ref_kl_log_probs``; ``None`` without KL rows. And the router losses'
        ``"step"`` pre-pass (the KL rows are not trained: their routing does not count)."""
        self.router.prepare(step.topology, [
            router_prepass(forward, step.topology, mb, self.ignore_index)
            for mb in micro_batches] if self.router else [])
        if self.kind != "kto" or micro_batches[0].get("kl_input_ids") is None:
            return
        topology, ignore = step.topology, self.ignore_index
        pol, lengths = [], []
        with torch.no_grad():
            for full in micro_batches:
                rows = {"input_ids": full["kl_input_ids"],
                        "completion_mask": full["kl_completion_mask"]}
                mb, labels = sp_slices(topology, rows, completion_targets(rows, ignore), ignore)
                log_probs = log_probs_forward(forward, mb, labels).log_probs
                seq, n = sequence_log_probs(log_probs, mb["completion_mask"],
                                            sp_group=topology.sp_group, return_lengths=True)
                pol.append(seq)
                lengths.append(n)
        self.z0 = kto_kl_baseline(pol, [mb["ref_kl_log_probs"] for mb in micro_batches],
                                  kl_lengths=lengths, group=topology.dp_sp_group)

    def loss(self, forward, step: StepCalibration, i: int,
             mb: Mapping[str, Any]) -> Tuple[torch.Tensor, Any]:
        ignore, topology = self.ignore_index, step.topology
        mb, labels = sp_slices(topology, mb, completion_targets(mb, ignore), ignore)
        log_probs, _, router = log_probs_forward(forward, mb, labels, self.router, topology,
                                                 step.num_micro_batches)
        seq, lengths = sequence_log_probs(log_probs, mb["completion_mask"],
                                          sp_group=topology.sp_group, return_lengths=True)
        w = preference_weights(step, i, ignore_index=ignore)
        ref = (torch.cat([mb["ref_chosen_log_probs"], mb["ref_rejected_log_probs"]])
               if self.kind == "dpo" else mb.get("ref_log_probs"))
        out = sequence_preference_loss(seq, self.options, lengths=lengths, ref_log_probs=ref,
                                       desirable=mb.get("desirable"), kl=self.z0,
                                       weights=w.pair_weights, nll_weight=w.nll_weight,
                                       return_stats=True)
        if router is None:
            return out.loss, (out.stats, None)
        return out.loss + router.loss.to(out.loss.dtype), (out.stats, router_stats(router))

    def metrics(self, step: StepCalibration, stats: List[Any],
                topology: Topology) -> Dict[str, Any]:
        metrics = _METRICS[self.kind]([s for s, _ in stats], group=topology.dp_sp_group)
        return {**metrics, **self.router.metrics([r for _, r in stats], topology)}

    def result(self, outcome: StepOutcome) -> PolicyStepMetrics:
        return PolicyStepMetrics(**vars(outcome))
