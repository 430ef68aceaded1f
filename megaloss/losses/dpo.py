"""Pairwise preference losses on sequence log-probs (DPO, IPO and the other
pairwise loss types of TRL 1.16), averaged over the *global* pairs of an optimizer step.

Math (TRL 1.16, ``trl/trainer/dpo_trainer.py``, ``DPOTrainer._compute_loss``, with
``f_divergence_type="reverse_kl"``), per pair ``p`` of a chosen and a rejected completion::

    r_c = logp(chosen) - ref_logp(chosen)          (sequence log-prob sums)
    r_r = logp(rejected) - ref_logp(rejected)
    z   = beta * (r_c - r_r)
    a_c = r_c / n_c,  a_r = r_r / n_r              (per-token log-ratios; ``n``: the completion's
                                                    token count, at least 1)
    loss = sum_p l_p / N_pairs          (N_pairs over every DP / SP rank and accumulation step)

with ``l_p`` by ``loss_type`` (``s``: sigmoid, ``ls``: logsigmoid, ``eps``:
``label_smoothing``, ``tau``: ``discopop_tau``; sources as TRL's DPO documentation cites
them)::

    loss_type     l_p                                             source
    ------------- ----------------------------------------------- -----------------------------
    sigmoid       -ls(z)                                          DPO, Rafailov et al. 2023,
                                                                  arXiv:2305.18290
    hinge         relu(1 - z)                                     RSO, Liu et al. 2023,
                                                                  arXiv:2309.06657 (the hinge
                                                                  of SLiC, arXiv:2305.10425)
    ipo           (a_c - a_r - 1 / (2 beta))**2                   IPO, Azar et al. 2023,
                                                                  arXiv:2310.12036, Eq. 17
    exo_pair      s(z) (ls(z) - log(1 - eps))                     EXO, Ji et al. 2024,
                    + s(-z) (ls(-z) - log(eps))                   arXiv:2402.00856, Eq. 16
    nca_pair      -ls(beta r_c) - ls(-beta r_c) / 2               NCA, Chen et al. 2024,
                    - ls(-beta r_r) / 2                           arXiv:2402.05369
    robust        (-(1 - eps) ls(z) + eps ls(-z)) / (1 - 2 eps)   Robust DPO, Chowdhury et al.
                                                                  2024, arXiv:2403.00409
    bco_pair      -ls(beta r_c) - ls(-beta r_r)                   BCO, Jung et al. 2024,
                                                                  arXiv:2404.04656
    sppo_hard     (r_c - 1 / (2 beta))**2                         SPPO, Wu et al. 2024,
                    + (r_r + 1 / (2 beta))**2                     arXiv:2405.00675 (hard
                                                                  probabilities 1 / 0)
    apo_zero      1 - s(beta r_c) + s(beta r_r)                   APO, D'Oosterlinck et al.
                                                                  2024, arXiv:2408.06266, Eq. 7
    apo_down      s(beta r_c) + 1 - s(z)                          APO, arXiv:2408.06266, Eq. 8
    discopop      -ls(z) (1 - s(z / tau)) + exp(-z) s(z / tau)    DiscoPOP, Lu et al. 2024,
                                                                  arXiv:2406.08414, Eq. 5
    sigmoid_norm  -ls(beta (a_c - a_r))                           length-normalised DPO, as
                                                                  SimPO, Meng et al. 2024,
                                                                  arXiv:2405.14734
    aot           -(1 - eps) ls(beta d) - eps ls(-beta d),        AOT, Melnyk et al. 2024,
                    d = sort(lc - lr)_p - sort(ref_lc - ref_lr)_p arXiv:2406.05882
    aot_unpaired  the same, d = sort(r_c)_p - sort(r_r)_p         AOT, arXiv:2406.05882

``ipo`` is on the per-token log-ratios as TRL and the IPO authors compute it. ``bco_pair`` is
TRL 1.16's: without BCO's reward shift ``delta`` (a running mean of the rewards), which TRL's
DPO leaves out too, so nothing is carried from step to step. ``aot`` / ``aot_unpaired``
(``lc``, ``lr``: the policy's sequence log-probs, ``ref_*`` the reference's; ``sort(x)_p``: the
``p``-th smallest) sort over the pairs of one call, as TRL sorts over each process's
micro-batch: their loss, unlike the other types', depends on how the step's pairs are split
into micro-batches (DP x GAS equals TRL's run of the same split, not one device's step on the
whole batch); their ``pair_weights`` must be equal over the pairs that count (a sorted margin
belongs to no one pair; TRL refuses per-pair weights for them likewise). Not here: ``sft`` (a
token-level NLL on the chosen completions: :func:`megaloss.linear_cross_entropy`).
``exp(-z)`` of ``discopop`` overflows for ``z < -709`` in float64 (``-88`` in float32), as TRL's.

TRL takes the mean over each process's micro-batch; megaloss weights each pair by
``1 / N_pairs`` of the whole step (:func:`dpo_pair_weights`, from the calibrator's sample count:
one all-reduce per step), so any DP x GAS split gives the single-device gradient. A pair counts
when its chosen completion has at least one token (a padding row counts nothing). Under
DeepSpeed-Ulysses sequence parallelism each SP rank holds a slice of the tokens:
``sequence_log_probs(..., sp_group=...)`` adds the slices' sums over the SP group (autograd
all-reduce) and :func:`dpo_pair_weights` weights each pair on SP rank 0 only, so DP x SP x GAS
gives the single-device loss and gradient too.

Metrics (:func:`dpo_metrics`, TRL's names, means over the step's global pairs):
``rewards/chosen`` (``beta * r_c``), ``rewards/rejected``, ``rewards/accuracies``
(``r_c > r_r``), ``rewards/margins``, ``logps/chosen``, ``logps/rejected``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from ..calibration.calibrator import StepCalibration
from ..ops.options import check_finite_positive, resolve_options
from ..parallel.groups import SINGLE_RANK, GroupLike, group_size
from ..parallel.mappings import all_reduce_sum_autograd
from ._preference import (
    LossTypeOptions,
    MaybeTensor,
    PairTerms,
    PreferenceOutput,
    Tensor,
    check_vector,
    paired_loss,
    paired_metrics,
    preference_weights,
)

__all__ = ["dpo_loss", "dpo_metrics", "dpo_pair_weights", "sequence_log_probs",
           "DPOOptions", "DPOOutput", "DPO_METRICS", "DPO_LOSS_TYPES"]

DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair",
                  "sppo_hard", "apo_zero", "apo_down", "discopop", "sigmoid_norm", "aot",
                  "aot_unpaired")


@dataclass(frozen=True)
class DPOOptions(LossTypeOptions, loss_types=DPO_LOSS_TYPES):
    """Options of :func:`megaloss.dpo_loss` (names and defaults of TRL 1.16's ``DPOConfig``,
    ``trl/trainer/dpo_config.py``).

    Attributes:
        loss_type: the pairwise loss of TRL 1.16's ``DPOTrainer._compute_loss``
            (``trl/trainer/dpo_trainer.py``), one of :data:`DPO_LOSS_TYPES`; the formulas and
            their sources are in the module docstring. ``"sigmoid"`` (DPO, arXiv:2305.18290),
            ``"hinge"`` (RSO / SLiC, arXiv:2309.06657, arXiv:2305.10425), ``"ipo"`` (IPO,
            arXiv:2310.12036), ``"exo_pair"`` (EXO, arXiv:2402.00856), ``"nca_pair"`` (NCA,
            arXiv:2402.05369), ``"robust"`` (Robust DPO, arXiv:2403.00409), ``"bco_pair"``
            (BCO, arXiv:2404.04656), ``"sppo_hard"`` (SPPO, arXiv:2405.00675), ``"apo_zero"`` /
            ``"apo_down"`` (APO, arXiv:2408.06266), ``"discopop"`` (DiscoPOP,
            arXiv:2406.08414), ``"sigmoid_norm"`` (length-normalised DPO, as SimPO,
            arXiv:2405.14734), ``"aot"`` / ``"aot_unpaired"`` (AOT, arXiv:2406.05882: on the
            log-ratios sorted over the call's pairs). ``"ipo"`` and ``"sigmoid_norm"`` divide
            each log-ratio by the completion's token count.
        beta: the inverse temperature (DPO) / regularisation ``tau`` (IPO), finite ``> 0``.
        label_smoothing: ``epsilon`` of ``"robust"`` (the label-flip probability, in
            ``[0, 0.5)``), of ``"exo_pair"`` (the target ``[1 - epsilon, epsilon]``, in
            ``(0, 1)``; EXO recommends 1e-3) and of ``"aot"`` / ``"aot_unpaired"`` (the
            conservative smoothing of the sorted margin); a float in ``[0, 1)``, read by no
            other type.
        discopop_tau: the temperature of ``"discopop"``'s log-ratio modulation, finite ``> 0``
            (DiscoPOP recommends the default 0.05); read by no other type.

    Raises:
        ValueError / TypeError: an option out of range or of the wrong type, naming it.
    """

    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    discopop_tau: float = 0.05

    def __post_init__(self) -> None:
        super().__post_init__()
        eps = self.label_smoothing
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0.0 <= eps < 1.0:
            raise ValueError(f"label_smoothing must be a float in [0, 1), got {eps!r}")
        if self.loss_type == "robust" and not eps < 0.5:
            raise ValueError("label_smoothing must be in [0, 0.5) for loss_type='robust' (the "
                             f"label-flip probability; it divides by 1 - 2 * it), got {eps!r}")
        if self.loss_type == "exo_pair" and not eps > 0.0:
            raise ValueError("label_smoothing must be in (0, 1) for loss_type='exo_pair' (its "
                             f"log is taken; EXO recommends 1e-3), got {eps!r}")
        check_finite_positive("discopop_tau", self.discopop_tau)
        for name in ("label_smoothing", "discopop_tau"):
            object.__setattr__(self, name, float(getattr(self, name)))


DPO_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
               "logps/chosen", "logps/rejected")


class DPOOutput(PreferenceOutput):
    """What :func:`dpo_loss` returns with ``return_stats=True``: ``loss`` and ``stats`` (``[7]``
    local sums for :func:`dpo_metrics`)."""

    __slots__ = ()


def sequence_log_probs(log_probs: torch.Tensor, completion_mask: torch.Tensor, *,
                       sp_group: GroupLike = SINGLE_RANK, return_lengths: bool = False):
    """Each sequence's log-prob: ``[B, T]`` per-token log-probs summed over the completion
    tokens (``completion_mask != 0``) -> ``[B]`` (differentiable, dtype of ``log_probs``;
    positions off the mask, even non-finite ones, add nothing).

    Args:
        log_probs: ``[B, T]`` floating per-token log-probs (e.g.
            ``megaloss.linear_log_probs(...).log_probs``).
        completion_mask: ``[B, T]`` bool or 0/1.
        sp_group: the sequence-parallel group (``Topology.sp_group``) when each of its ranks
            holds a contiguous slice of the same sequences' tokens: the slice sums (and
            lengths) are then added over the group by ONE autograd all-reduce
            (:func:`~megaloss.parallel.mappings.all_reduce_sum_autograd`, SUM forward and
            backward, as :func:`megaloss.policy_loss` does for its sequence-level sums), so
            every rank holds the whole sequences' values and the gradient of the sum of the
            ranks' losses reaches each slice. Every rank of the group must call it. Default: no SP.
        return_lengths: also return the ``[B]`` completion token counts (whole sequences under
            SP), in ``log_probs``' dtype.

    Returns:
        ``[B]`` sums, or ``(sums, lengths)`` with ``return_lengths=True``.

    Raises:
        ValueError: shapes differ or are not ``[B, T]``.
        TypeError: ``sp_group`` is not a group, None or SINGLE_RANK.
    """
    if not isinstance(log_probs, torch.Tensor) or log_probs.dim() != 2 \
            or not isinstance(completion_mask, torch.Tensor) \
            or completion_mask.shape != log_probs.shape:
        raise ValueError("log_probs and completion_mask must be [B, T] tensors of one shape, got "
                         f"{getattr(log_probs, 'shape', None)} and "
                         f"{getattr(completion_mask, 'shape', None)}")
    zero = torch.zeros((), dtype=log_probs.dtype, device=log_probs.device)
    valid = completion_mask != 0
    sums = torch.where(valid, log_probs, zero).sum(-1)
    lengths = valid.sum(-1).to(log_probs.dtype)
    if group_size(sp_group) > 1:
        sums, lengths = all_reduce_sum_autograd(torch.stack([sums, lengths]), sp_group).unbind(0)
        lengths = lengths.detach()
    return (sums, lengths) if return_lengths else sums


def dpo_pair_weights(step: StepCalibration, i: int, *, ignore_index: int = -100) -> torch.Tensor:
    """``[P]`` weights ``1 / N_pairs`` (global) of micro-batch ``i``'s pairs, 0 for pairs without
    a chosen token (no collective); under sequence parallelism nonzero on SP rank 0 only (each
    pair counted once: :func:`megaloss.losses._preference.preference_weights`).

    Args:
        step: a :class:`~megaloss.calibration.LossCalibrator` step begun on the *chosen*
            completions' labels, ``[P, T]`` per micro-batch (e.g.
            ``completion_labels(chosen_mask)``); its sample count is the global pair count.
        i: the micro-batch.
        ignore_index: the label of non-completion tokens.

    Raises:
        IndexError: ``i`` out of range.
    """
    return preference_weights(step, i, ignore_index=ignore_index).pair_weights


_PER_TOKEN_TYPES = ("ipo", "sigmoid_norm")  # on the length-normalised log-ratios
_SORTED_TYPES = ("aot", "aot_unpaired")  # on log-ratios sorted over the call's pairs


def _sorted_pair_losses(opts: DPOOptions, chosen: torch.Tensor, rejected: torch.Tensor,
                        ref_chosen: torch.Tensor, ref_rejected: torch.Tensor,
                        weights: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``aot`` / ``aot_unpaired``: the ``[k]`` losses of the margins sorted over the ``k`` pairs
    with ``weights > 0``, and those pairs' (common) weights (module docstring; TRL 1.16's
    ``DPOTrainer._compute_loss``)."""
    counted = weights > 0
    w = weights[counted]
    if w.numel() and not bool((w == w[0]).all()):
        raise ValueError(
            f"loss_type={opts.loss_type!r} sorts the log-ratios over the call's pairs, so "
            "pair_weights must be equal over the pairs that count (weight > 0), got weights "
            f"from {float(w.min())} to {float(w.max())}")
    c, r = chosen[counted], rejected[counted]
    rc, rr = ref_chosen[counted], ref_rejected[counted]
    if opts.loss_type == "aot":
        delta = torch.sort(c - r).values - torch.sort(rc - rr).values
    else:
        delta = torch.sort(c - rc).values - torch.sort(r - rr).values
    eps = opts.label_smoothing
    per = (-F.logsigmoid(opts.beta * delta) * (1 - eps)
           - F.logsigmoid(-opts.beta * delta) * eps)
    return per, w


def _pair_loss(opts: DPOOptions, chosen_ratio: torch.Tensor,
               rejected_ratio: torch.Tensor) -> torch.Tensor:
    """``[P]`` losses of the loss types on the sequence log-ratios (module docstring), each the
    expression of TRL 1.16's ``DPOTrainer._compute_loss`` in the inputs' dtype."""
    beta, kind = opts.beta, opts.loss_type
    z = beta * (chosen_ratio - rejected_ratio)
    if kind == "sigmoid":
        return -F.logsigmoid(z)
    if kind == "hinge":
        return torch.relu(1 - z)
    if kind == "exo_pair":
        eps = opts.label_smoothing
        return (torch.sigmoid(z) * (F.logsigmoid(z) - math.log1p(-eps))
                + torch.sigmoid(-z) * (F.logsigmoid(-z) - math.log(eps)))
    if kind == "robust":
        eps = opts.label_smoothing
        return (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)
    if kind == "discopop":
        modulation = torch.sigmoid(z / opts.discopop_tau)
        return -F.logsigmoid(z) * (1 - modulation) + torch.exp(-z) * modulation
    chosen, rejected = beta * chosen_ratio, beta * rejected_ratio
    if kind == "nca_pair":
        return (-F.logsigmoid(chosen) - 0.5 * F.logsigmoid(-chosen)
                - 0.5 * F.logsigmoid(-rejected))
    if kind == "bco_pair":
        return -F.logsigmoid(chosen) - F.logsigmoid(-rejected)
    if kind == "sppo_hard":
        return (chosen_ratio - 0.5 / beta) ** 2 + (rejected_ratio + 0.5 / beta) ** 2
    if kind == "apo_zero":
        return (1 - torch.sigmoid(chosen)) + torch.sigmoid(rejected)
    if kind == "apo_down":
        return torch.sigmoid(chosen) + (1 - torch.sigmoid(z))
    raise AssertionError(kind)  # DPOOptions admits only the types above


def dpo_loss(chosen_log_probs: Tensor, rejected_log_probs: Tensor, ref_chosen_log_probs: Tensor,
             ref_rejected_log_probs: Tensor, *, chosen_lengths: MaybeTensor = None,
             rejected_lengths: MaybeTensor = None, pair_weights: MaybeTensor = None,
             loss_type: str = "sigmoid", beta: float = 0.1, label_smoothing: float = 0.0,
             discopop_tau: float = 0.05, return_stats: bool = False,
             options: Optional[DPOOptions] = None):
    """The pairwise preference loss of a micro-batch of pairs (module docstring for the
    math of each ``loss_type``).

    Args:
        chosen_log_probs, rejected_log_probs: ``[P]`` sequence log-probs under the policy
            (differentiable; :func:`sequence_log_probs` of ``linear_log_probs`` output).
        ref_chosen_log_probs, ref_rejected_log_probs: ``[P]`` under the reference (detached).
        chosen_lengths, rejected_lengths: ``[P]`` completion token counts; required for
            ``loss_type="ipo"`` and ``"sigmoid_norm"``, unused otherwise.
        pair_weights: ``[P]`` from :func:`dpo_pair_weights` (the step's global pair count);
            ``None``: the mean over this call's pairs.
        loss_type, beta, label_smoothing, discopop_tau: the fields of
            :class:`~megaloss.DPOOptions`.
        return_stats: return a :class:`DPOOutput` (the loss and the local sums
            :func:`dpo_metrics` reads) instead of the loss alone.
        options: these fields as one :class:`DPOOptions` instead of the keywords.

    Returns:
        The loss (differentiable scalar), or with ``return_stats=True`` a :class:`DPOOutput`
        holding it.

    Raises:
        ValueError: shape mismatches; lengths missing for ``"ipo"`` / ``"sigmoid_norm"``;
            ``pair_weights`` not equal over the counted pairs for ``"aot"`` /
            ``"aot_unpaired"``; an option out of range.
        TypeError: non-floating inputs; ``options`` of the wrong type or with option keywords.
    """
    opts = resolve_options(DPOOptions, options, locals())
    return paired_loss(_dpo_pairs, DPOOutput, opts, chosen_log_probs, rejected_log_probs,
                       pair_weights=pair_weights, nll_weight=None, return_stats=return_stats,
                       not_floating=TypeError, ref_chosen_log_probs=ref_chosen_log_probs,
                       ref_rejected_log_probs=ref_rejected_log_probs,
                       chosen_lengths=chosen_lengths, rejected_lengths=rejected_lengths)


def _dpo_pairs(opts: DPOOptions, chosen: torch.Tensor, rejected: torch.Tensor,
               weights: torch.Tensor, *, ref_chosen_log_probs: torch.Tensor,
               ref_rejected_log_probs: torch.Tensor, chosen_lengths: Optional[torch.Tensor],
               rejected_lengths: Optional[torch.Tensor]) -> PairTerms:
    """DPO's per-pair terms (:mod:`._preference`): the loss type's losses, the log-ratios
    (rewards / beta) and the policy's log-probs."""
    n = chosen.shape[0]
    check_vector("ref_chosen_log_probs", ref_chosen_log_probs, n, "chosen_log_probs", TypeError)
    check_vector("ref_rejected_log_probs", ref_rejected_log_probs, n, "chosen_log_probs",
                 TypeError)
    chosen_ratio = chosen - ref_chosen_log_probs
    rejected_ratio = rejected - ref_rejected_log_probs
    loss_weights = None
    if opts.loss_type in _PER_TOKEN_TYPES:
        for name, x in (("chosen_lengths", chosen_lengths), ("rejected_lengths", rejected_lengths)):
            if x is None:
                raise ValueError(f"{name} is required for loss_type={opts.loss_type!r} (the "
                                 "log-ratios are per completion token)")
            if not isinstance(x, torch.Tensor) or x.shape != (n,):
                raise ValueError(f"{name} must be a [{n}] tensor, got {getattr(x, 'shape', x)}")
        delta = (chosen_ratio / chosen_lengths.to(chosen_ratio.dtype).clamp(min=1.0)
                 - rejected_ratio / rejected_lengths.to(chosen_ratio.dtype).clamp(min=1.0))
        if opts.loss_type == "ipo":
            losses = (delta - 1 / (2 * opts.beta)) ** 2
        else:
            losses = -F.logsigmoid(opts.beta * delta)
    elif opts.loss_type in _SORTED_TYPES:
        losses, loss_weights = _sorted_pair_losses(opts, chosen, rejected, ref_chosen_log_probs,
                                                   ref_rejected_log_probs, weights)
    else:
        losses = _pair_loss(opts, chosen_ratio, rejected_ratio)
    return PairTerms(losses, chosen_ratio, rejected_ratio, chosen, rejected,
                     loss_weights=loss_weights)


def dpo_metrics(stats: Union[torch.Tensor, Sequence[torch.Tensor]], *,
                group: GroupLike = None) -> Dict[str, float]:
    """The step's metrics under TRL's names (:data:`DPO_METRICS`), means over the global pairs
    (ONE all-reduce over ``group``, the ``dp x sp`` group; every rank must call it); 0.0 when no
    rank had a pair.

    Raises:
        ValueError: ``stats`` are not :attr:`DPOOutput.stats` tensors.
    """
    return paired_metrics(DPO_METRICS, stats, "DPOOutput", group)
