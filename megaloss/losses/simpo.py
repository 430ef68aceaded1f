"""CPO and SimPO, reference-free preference losses on sequence log-probs (with CPO's NLL term on
the chosen completions), normalised over the *global* pairs and tokens of an optimizer step.

Math (TRL 1.16, ``trl/experimental/cpo/cpo_trainer.py``, ``CPOTrainer.cpo_loss``,
``concatenated_forward`` and ``get_batch_loss_metrics``), per pair ``p`` (``ls``: logsigmoid,
``eps``: ``label_smoothing``)::

    x_c = logp(chosen), x_r = logp(rejected)          (sequence sums: sigmoid, hinge)
    x_c = logp(chosen) / n_c, x_r = logp(rejected) / n_r    (per-token averages: ipo, simpo)
    d = x_c - x_r

    loss_type  l_p                                                  source
    ---------- ---------------------------------------------------- ----------------------------
    sigmoid    -(1 - eps) ls(beta d) - eps ls(-beta d)              CPO, Xu et al. 2024,
                                                                    arXiv:2401.08417, Eq. 3
    hinge      relu(1 - beta d)                                     SLiC, arXiv:2305.10425
    ipo        (d - 1 / (2 beta))**2                                IPO, arXiv:2310.12036, Eq. 17
    simpo      -(1 - eps) ls(beta d - gamma)                        SimPO, Meng et al. 2024,
                 - eps ls(-(beta d - gamma))                        arXiv:2405.14734, Eq. 6

    loss = sum_p l_p / N_pairs + cpo_alpha * sum_t nll_t / N_chosen_tokens

with ``gamma`` = ``simpo_gamma`` (SimPO's target margin; the SimPO repository's
``gamma_beta_ratio`` is ``simpo_gamma / beta``) and ``nll_t`` the chosen completions'
negative log-probs (TRL's ``nn.CrossEntropyLoss`` over the chosen labels). Pure SimPO is
``loss_type="simpo"`` with ``cpo_alpha=0`` (:func:`simpo_loss`); CPO-SimPO keeps the NLL. Not
here: TRL's AlphaPO reward shaping (``CPOConfig.alpha != 0``).

Normalisation: TRL takes each micro-batch's mean over its pairs and its chosen-token mean of the
NLL; megaloss weights each pair by ``1 / N_pairs`` and each chosen token by ``1 / N_tokens`` of
the whole step (:func:`~megaloss.losses.orpo.preference_weights` of a step begun on the chosen
completions' labels; one all-reduce per step), so any DP x GAS split gives the single-device
loss and gradient. ``preference_weights(..., convention="micro_batch")`` gives TRL's convention;
without weights a call is TRL's loss of that micro-batch.

Inputs: ``[P]`` floating tensors (summed completion log-probs under the policy, any float dtype;
the loss is in their dtype) and ``[P]`` token counts; no reference model.

Metrics (:func:`cpo_metrics`, TRL's names, means over the step's global pairs):
``rewards/chosen`` (``beta * x_c``), ``rewards/rejected``, ``rewards/accuracies``
(``x_c > x_r``), ``rewards/margins``, ``logps/chosen`` (``x_c``), ``logps/rejected``, and
``nll_loss`` (the global chosen-token mean; 0 when ``cpo_alpha = 0``, as TRL, which then does not
compute it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Union

import torch
import torch.nn.functional as F

from ..ops.options import (
    check_float,
    option_values,
    resolve_options,
)
from ..parallel.groups import GroupLike
from ._preference import (
    LossTypeOptions,
    MaybeTensor,
    NLLTerm,
    PairTerms,
    PreferenceOutput,
    ScalarWeight,
    Tensor,
    check_lengths,
    paired_loss,
    paired_metrics,
)

__all__ = ["CPOOptions", "CPOOutput", "CPO_LOSS_TYPES", "CPO_METRICS", "cpo_loss", "simpo_loss",
           "cpo_metrics"]

CPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo")
CPO_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
               "logps/chosen", "logps/rejected", "nll_loss")
_AVERAGED = ("ipo", "simpo")  # on the per-token average log-probs


@dataclass(frozen=True)
class CPOOptions(LossTypeOptions, loss_types=CPO_LOSS_TYPES):
    """Options of :func:`cpo_loss` / :func:`simpo_loss` (names and defaults of TRL 1.16's
    ``CPOConfig``, ``trl/experimental/cpo/cpo_config.py``).

    Attributes:
        loss_type: one of :data:`CPO_LOSS_TYPES` (module docstring).
        beta: the inverse temperature (the regularisation ``tau`` for ``"ipo"``), finite ``> 0``.
        label_smoothing: ``eps`` of ``"sigmoid"`` / ``"simpo"`` (conservative labels), in
            ``[0, 0.5]``; must be 0 for ``"hinge"`` / ``"ipo"`` (TRL ignores it there with a
            warning; megaloss refuses it).
        cpo_alpha: the weight of the NLL term, finite ``>= 0`` (0: no NLL).
        simpo_gamma: SimPO's target reward margin ``gamma``, finite ``>= 0``; read by
            ``"simpo"`` only.

    Raises:
        ValueError: an option out of range (``label_smoothing`` other than 0 for ``"hinge"`` /
            ``"ipo"`` too), naming it.
    """

    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    cpo_alpha: float = 1.0
    simpo_gamma: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        check_float("label_smoothing", self.label_smoothing, 0.0, 0.5)
        if self.loss_type in ("hinge", "ipo") and self.label_smoothing != 0:
            raise ValueError(f"label_smoothing must be 0 for loss_type={self.loss_type!r} (it "
                             f"has no label smoothing), got {self.label_smoothing!r}")
        check_float("cpo_alpha", self.cpo_alpha, 0.0, float("inf"))
        if not self.cpo_alpha < float("inf"):
            raise ValueError(f"cpo_alpha must be finite, got {self.cpo_alpha!r}")
        check_float("simpo_gamma", self.simpo_gamma, 0.0, float("inf"))
        if not self.simpo_gamma < float("inf"):
            raise ValueError(f"simpo_gamma must be finite, got {self.simpo_gamma!r}")
        for name in ("label_smoothing", "cpo_alpha", "simpo_gamma"):
            object.__setattr__(self, name, float(getattr(self, name)))


class CPOOutput(PreferenceOutput):
    """What :func:`cpo_loss` returns with ``return_stats=True``: ``loss`` and ``stats`` (``[9]``
    local sums for :func:`cpo_metrics`)."""

    __slots__ = ()


def _pair_loss(opts: CPOOptions, d: torch.Tensor) -> torch.Tensor:
    beta, kind, eps = opts.beta, opts.loss_type, opts.label_smoothing
    if kind == "hinge":
        return torch.relu(1 - beta * d)
    if kind == "ipo":
        return (d - 1 / (2 * beta)) ** 2
    z = beta * d - opts.simpo_gamma if kind == "simpo" else beta * d
    loss = -F.logsigmoid(z)
    return loss * (1 - eps) - F.logsigmoid(-z) * eps if eps else loss


def cpo_loss(chosen_log_probs: Tensor, rejected_log_probs: Tensor, *,
             chosen_lengths: MaybeTensor = None, rejected_lengths: MaybeTensor = None,
             pair_weights: MaybeTensor = None, nll_weight: ScalarWeight = None,
             loss_type: str = "sigmoid", beta: float = 0.1, label_smoothing: float = 0.0,
             cpo_alpha: float = 1.0, simpo_gamma: float = 0.5, return_stats: bool = False,
             options: Optional[CPOOptions] = None):
    """The CPO / SimPO loss of a micro-batch of pairs (module docstring for the math).

    Args:
        chosen_log_probs, rejected_log_probs: ``[P]`` summed completion log-probs under the
            policy (differentiable; :func:`~megaloss.losses.dpo.sequence_log_probs`).
        chosen_lengths, rejected_lengths: ``[P]`` completion token counts (counts below 1 count
            as 1 in the averages); required for ``"ipo"`` / ``"simpo"``, and ``chosen_lengths``
            for the NLL when ``cpo_alpha > 0`` and ``nll_weight`` is ``None``.
        pair_weights: ``[P]`` (:attr:`~megaloss.losses.orpo.PreferenceWeights.pair_weights`);
            ``None``: the mean over this call's pairs.
        nll_weight: the weight of each chosen token in the NLL
            (:attr:`~megaloss.losses.orpo.PreferenceWeights.nll_weight`); ``None``:
            ``1 / sum(chosen_lengths)`` of this call.
        loss_type, beta, label_smoothing, cpo_alpha, simpo_gamma: the fields of
            :class:`CPOOptions`.
        return_stats: return a :class:`CPOOutput`, the loss with the local sums
            :func:`cpo_metrics` reads.
        options: a :class:`CPOOptions` in place of its fields' keywords (not both).

    Returns:
        The loss (a differentiable scalar in the log-probs' dtype), or its :class:`CPOOutput`.

    Raises:
        ValueError: a log-prob, length or weight vector of the wrong shape or type, or lengths
            missing where the loss type or the NLL term needs them, naming it; an option out
            of range.
        TypeError: ``options`` not a :class:`CPOOptions`, or given with option keywords.
    """
    opts = resolve_options(CPOOptions, options, locals())
    return paired_loss(_cpo_pairs, CPOOutput, opts, chosen_log_probs, rejected_log_probs,
                       pair_weights=pair_weights, nll_weight=nll_weight,
                       return_stats=return_stats, chosen_lengths=chosen_lengths,
                       rejected_lengths=rejected_lengths)


def _cpo_pairs(opts: CPOOptions, chosen: torch.Tensor, rejected: torch.Tensor,
               weights: torch.Tensor, *, chosen_lengths: Optional[torch.Tensor],
               rejected_lengths: Optional[torch.Tensor]) -> PairTerms:
    """CPO's per-pair terms (:mod:`._preference`): the losses on the sequence sums or their
    per-token averages ``x``, which are also the rewards / beta and ``logps/*``, and the NLL of
    the chosen completions (weight ``cpo_alpha``)."""
    n, dtype = chosen.shape[0], chosen.dtype
    if opts.loss_type in _AVERAGED:
        why = f"loss_type={opts.loss_type!r} is on the per-token average log-probs"
        x_c = chosen / check_lengths("chosen_lengths", chosen_lengths, n, why, dtype)
        x_r = rejected / check_lengths("rejected_lengths", rejected_lengths, n, why, dtype)
    else:
        x_c, x_r = chosen, rejected
    lengths = None
    if chosen_lengths is not None:
        check_lengths("chosen_lengths", chosen_lengths, n, "", dtype)
        lengths = chosen_lengths.to(dtype)
    nll = NLLTerm(chosen, lengths, opts.cpo_alpha, "chosen_lengths is required for the NLL term "
                  "(cpo_alpha > 0) without nll_weight: it is a token mean")
    return PairTerms(_pair_loss(opts, x_c - x_r), x_c, x_r, x_c, x_r, nll=nll)


def simpo_loss(chosen_log_probs: Tensor, rejected_log_probs: Tensor, *,
               chosen_lengths: MaybeTensor = None, rejected_lengths: MaybeTensor = None,
               pair_weights: MaybeTensor = None, nll_weight: ScalarWeight = None,
               beta: float = 0.1, simpo_gamma: float = 0.5, label_smoothing: float = 0.0,
               cpo_alpha: float = 0.0, return_stats: bool = False):
    """SimPO (arXiv:2405.14734): :func:`cpo_loss` with ``loss_type="simpo"`` and, by default,
    no NLL term (``cpo_alpha=0``; > 0 is CPO-SimPO). Arguments and errors as :func:`cpo_loss`;
    ``chosen_lengths`` and ``rejected_lengths`` are required (the rewards are length-averaged).
    """
    opts = CPOOptions(loss_type="simpo", **option_values(CPOOptions, locals()))
    return cpo_loss(chosen_log_probs, rejected_log_probs, chosen_lengths=chosen_lengths,
                    rejected_lengths=rejected_lengths, pair_weights=pair_weights,
                    nll_weight=nll_weight, return_stats=return_stats, options=opts)


def cpo_metrics(stats: Union[torch.Tensor, Sequence[torch.Tensor]], *,
                group: GroupLike = None) -> Dict[str, float]:
    """The step's metrics under TRL's names (:data:`CPO_METRICS`): means over the global pairs,
    ``nll_loss`` the global chosen-token mean (ONE all-reduce over ``group``, the ``dp x sp``
    group; every rank must call it); 0.0 when no rank had a pair.

    Raises:
        ValueError: ``stats`` are not :attr:`CPOOutput.stats` tensors.
    """
    return paired_metrics(CPO_METRICS, stats, "CPOOutput", group)
