"""Preference losses on sequence log-probs: DPO (sigmoid) and IPO, averaged over the *global*
pairs of an optimizer step.

Math (TRL 1.16, ``trl/trainer/dpo_trainer.py``, ``DPOTrainer._compute_loss``, with
``f_divergence_type="reverse_kl"``), per pair ``p`` of a chosen and a rejected completion::

    r_c = logp(chosen) - ref_logp(chosen)          (sequence log-prob sums)
    r_r = logp(rejected) - ref_logp(rejected)
    sigmoid: l_p = -logsigmoid(beta * (r_c - r_r))          (Rafailov et al. 2023, arXiv:2305.18290)
    ipo:     l_p = (r_c / n_c - r_r / n_r - 1 / (2 beta))**2  (Azar et al. 2023, arXiv:2310.12036,
             Eq. 17, on the per-token log-ratios as TRL and the IPO authors compute it; ``n``: the
             completion's token count, at least 1)

    loss = sum_p l_p / N_pairs          (N_pairs over every DP / SP rank and accumulation step)

TRL takes the mean over each process's micro-batch; megaloss weights each pair by
``1 / N_pairs`` of the whole step (:func:`dpo_pair_weights`, from the calibrator's sample count:
one all-reduce per step), so any DP x GAS split gives the single-device gradient. A pair counts
when its chosen completion has at least one token (a padding row counts nothing).

Metrics (:func:`dpo_metrics`, TRL's names, means over the step's global pairs):
``rewards/chosen`` (``beta * r_c``), ``rewards/rejected``, ``rewards/accuracies``
(``r_c > r_r``), ``rewards/margins``, ``logps/chosen``, ``logps/rejected``.
"""
from __future__ import annotations

from typing import Dict, NamedTuple, Optional, Sequence, Union

import torch
import torch.nn.functional as F

from ..calibration.calibrator import StepCalibration
from ..ops.options import DPOOptions, resolve_options
from ..parallel.comm import all_reduce_sum_
from ..parallel.groups import GroupLike

__all__ = ["DPOOptions", "DPOOutput", "dpo_loss", "dpo_pair_weights", "dpo_metrics",
           "sequence_log_probs", "DPO_METRICS"]

DPO_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
               "logps/chosen", "logps/rejected")
_NUM_STATS = len(DPO_METRICS) + 1  # the sums of the metrics, then the pair count


class DPOOutput(NamedTuple):
    """What :func:`dpo_loss` returns with ``return_stats=True``: ``loss`` (differentiable
    scalar, this call's share of the global loss) and ``stats`` (detached float64 ``[7]``
    local sums for :func:`dpo_metrics`)."""

    loss: torch.Tensor
    stats: torch.Tensor


def sequence_log_probs(log_probs: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """Each sequence's log-prob: ``[B, T]`` per-token log-probs summed over the completion
    tokens (``completion_mask != 0``) -> ``[B]`` (differentiable; positions off the mask, even
    non-finite ones, add nothing).

    Raises:
        ValueError: shapes differ or are not ``[B, T]``.
    """
    if not isinstance(log_probs, torch.Tensor) or log_probs.dim() != 2 \
            or not isinstance(completion_mask, torch.Tensor) \
            or completion_mask.shape != log_probs.shape:
        raise ValueError("log_probs and completion_mask must be [B, T] tensors of one shape, got "
                         f"{getattr(log_probs, 'shape', None)} and "
                         f"{getattr(completion_mask, 'shape', None)}")
    zero = torch.zeros((), dtype=log_probs.dtype, device=log_probs.device)
    return torch.where(completion_mask != 0, log_probs, zero).sum(-1)


def dpo_pair_weights(step: StepCalibration, i: int, *, ignore_index: int = -100) -> torch.Tensor:
    """``[P]`` weights ``1 / N_pairs`` (global) of micro-batch ``i``'s pairs, 0 for pairs without
    a chosen token (no collective).

    Args:
        step: a :class:`~megaloss.calibration.LossCalibrator` step begun on the *chosen*
            completions' labels, ``[P, T]`` per micro-batch (e.g.
            ``completion_labels(chosen_mask)``); its sample count is the global pair count.
        i: the micro-batch.
        ignore_index: the label of non-completion tokens.

    Raises:
        IndexError: ``i`` out of range.
    """
    labels = step.local_labels(i)
    valid = (labels != ignore_index).reshape(labels.shape[0], -1).any(-1).to(torch.float64)
    pairs = step.num_samples
    pairs = torch.where(pairs > 0, pairs, torch.ones_like(pairs))
    return (valid / pairs).to(step.weights(i).dtype)


def _vector(name: str, x: torch.Tensor, n: Optional[int]) -> int:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() != 1:
        raise TypeError(f"{name} must be a floating [P] torch.Tensor, got "
                        f"{getattr(x, 'shape', type(x).__name__)}")
    if n is not None and x.shape[0] != n:
        raise ValueError(f"{name} must have shape ({n},) (that of chosen_log_probs), got "
                         f"{tuple(x.shape)}")
    return x.shape[0]


def dpo_loss(
    chosen_log_probs: torch.Tensor,
    rejected_log_probs: torch.Tensor,
    ref_chosen_log_probs: torch.Tensor,
    ref_rejected_log_probs: torch.Tensor,
    *,
    chosen_lengths: Optional[torch.Tensor] = None,
    rejected_lengths: Optional[torch.Tensor] = None,
    pair_weights: Optional[torch.Tensor] = None,
    loss_type: str = "sigmoid",
    beta: float = 0.1,
    return_stats: bool = False,
    options: Optional[DPOOptions] = None,
):
    """The DPO / IPO loss of a micro-batch of pairs (module docstring for the math).

    Args:
        chosen_log_probs, rejected_log_probs: ``[P]`` sequence log-probs under the policy
            (differentiable; :func:`sequence_log_probs` of ``linear_log_probs`` output).
        ref_chosen_log_probs, ref_rejected_log_probs: ``[P]`` under the reference (detached).
        chosen_lengths, rejected_lengths: ``[P]`` completion token counts; required for
            ``loss_type="ipo"``, unused otherwise.
        pair_weights: ``[P]`` from :func:`dpo_pair_weights` (the step's global pair count);
            ``None``: the mean over this call's pairs.
        loss_type, beta: the fields of :class:`~megaloss.ops.options.DPOOptions`.
        return_stats: return a :class:`DPOOutput` (the loss and the local sums
            :func:`dpo_metrics` reads) instead of the loss alone.
        options: these fields as one :class:`DPOOptions` instead of the keywords.

    Returns:
        The loss (differentiable scalar), or with ``return_stats=True`` a :class:`DPOOutput`
        holding it.

    Raises:
        ValueError: shape mismatches; lengths missing for ``"ipo"``; an option out of range.
        TypeError: non-floating inputs; ``options`` of the wrong type or with option keywords.
    """
    opts = resolve_options(DPOOptions, options, dict(loss_type=loss_type, beta=beta))
    n = _vector("chosen_log_probs", chosen_log_probs, None)
    _vector("rejected_log_probs", rejected_log_probs, n)
    _vector("ref_chosen_log_probs", ref_chosen_log_probs, n)
    _vector("ref_rejected_log_probs", ref_rejected_log_probs, n)
    chosen_ratio = chosen_log_probs - ref_chosen_log_probs
    rejected_ratio = rejected_log_probs - ref_rejected_log_probs
    if opts.loss_type == "sigmoid":
        per_pair = -F.logsigmoid(opts.beta * (chosen_ratio - rejected_ratio))
    else:
        for name, x in (("chosen_lengths", chosen_lengths), ("rejected_lengths", rejected_lengths)):
            if x is None:
                raise ValueError(f"{name} is required for loss_type='ipo' (the log-ratios are "
                                 "per completion token)")
            if not isinstance(x, torch.Tensor) or x.shape != (n,):
                raise ValueError(f"{name} must be a [{n}] tensor, got {getattr(x, 'shape', x)}")
        delta = (chosen_ratio / chosen_lengths.to(chosen_ratio.dtype).clamp(min=1.0)
                 - rejected_ratio / rejected_lengths.to(chosen_ratio.dtype).clamp(min=1.0))
        per_pair = (delta - 1 / (2 * opts.beta)) ** 2
    if pair_weights is None:
        pair_weights = torch.full((n,), 1.0 / max(n, 1), dtype=per_pair.dtype,
                                  device=per_pair.device)
    elif not isinstance(pair_weights, torch.Tensor) or pair_weights.shape != (n,):
        raise ValueError(f"pair_weights must be a [{n}] tensor, got "
                         f"{getattr(pair_weights, 'shape', pair_weights)}")
    loss = (per_pair * pair_weights.to(per_pair.dtype)).sum()
    with torch.no_grad():
        counted = (pair_weights > 0).to(torch.float64)
        rc = opts.beta * chosen_ratio.detach().to(torch.float64)
        rr = opts.beta * rejected_ratio.detach().to(torch.float64)
        values = torch.stack([rc, rr, (rc > rr).to(torch.float64), rc - rr,
                              chosen_log_probs.detach().to(torch.float64),
                              rejected_log_probs.detach().to(torch.float64)])
        stats = torch.cat([(values * counted).sum(-1), counted.sum().reshape(1)])
    return DPOOutput(loss, stats) if return_stats else loss


def dpo_metrics(stats: Union[torch.Tensor, Sequence[torch.Tensor]], *,
                group: GroupLike = None) -> Dict[str, float]:
    """The step's metrics under TRL's names (:data:`DPO_METRICS`), means over the global pairs
    (ONE all-reduce over ``group``, the ``dp x sp`` group; every rank must call it); 0.0 when no
    rank had a pair.

    Raises:
        ValueError: ``stats`` are not :attr:`DPOOutput.stats` tensors.
    """
    if isinstance(stats, torch.Tensor):
        stats = [stats]
    stats = list(stats)
    if not stats or any(s.shape != (_NUM_STATS,) for s in stats):
        raise ValueError(f"stats must be one or more DPOOutput.stats tensors [{_NUM_STATS}]")
    total = all_reduce_sum_(torch.stack(stats).sum(0).to(torch.float64), group).tolist()
    pairs = total[-1]
    return {name: (total[k] / pairs if pairs > 0 else 0.0) for k, name in enumerate(DPO_METRICS)}
