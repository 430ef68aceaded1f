"""ORPO, the odds-ratio preference loss plus an NLL term on the chosen completions, on sequence
log-probs, normalised over the *global* pairs and tokens of an optimizer step.

Math (ORPO, Hong et al. 2024, arXiv:2403.07691, Eqs. 4-7; as TRL 1.16 computes it,
``trl/experimental/orpo/orpo_trainer.py``, ``ORPOTrainer.odds_ratio_loss`` and
``get_batch_loss_metrics``), per pair ``p``::

    a_c = logp(chosen) / n_c,  a_r = logp(rejected) / n_r      (length-averaged log-probs)
    log_odds = (a_c - a_r) - (log(1 - exp(a_c)) - log(1 - exp(a_r)))
    l_p = -beta * logsigmoid(log_odds)                          (beta: the paper's lambda)
    loss = sum_p l_p / N_pairs + sum_t nll_t / N_nll_tokens

``log(1 - exp(a))`` is TRL's ``log1mexp`` (``log1p(-exp(a))`` below ``-ln 2``,
``log(-expm1(a))`` above), finite for ``a < 0``; a completion of probability 1 (``a = 0``)
gives an infinite log-odds, as in TRL. The NLL term is the token mean of the chosen
completions' negative log-probs (``nll_log_probs`` defaults to ``chosen_log_probs`` and
``nll_lengths`` to ``chosen_lengths``, the paper's ``L_SFT`` on the response); TRL's ORPO takes
the NLL over the chosen *prompt and completion* (its ``concatenated_forward``): pass their
sequence log-probs and token counts as ``nll_log_probs`` / ``nll_lengths`` (and begin the step on
those labels) for TRL's convention.

Normalisation: TRL takes each micro-batch's mean over its pairs and its token mean of the NLL;
megaloss weights each pair by ``1 / N_pairs`` and each NLL token by ``1 / N_tokens`` of the whole
step (:func:`preference_weights`, from the calibrator's counts: one all-reduce per step), so any
DP x GAS split gives the single-device loss and gradient. ``preference_weights(...,
convention="micro_batch")`` gives TRL's per-micro-batch convention instead; without weights
(``pair_weights=None``, ``nll_weight=None``) a call is TRL's loss of that micro-batch.

Inputs: ``[P]`` floating tensors (any float dtype; the loss is in their dtype, the metrics in
float64), the policy's summed log-probs and integer token counts; ORPO needs no reference model.

Metrics (:func:`orpo_metrics`, TRL's names, means over the step's global pairs):
``rewards/chosen`` (``beta * a_c``), ``rewards/rejected``, ``rewards/accuracies``
(``a_c > a_r``), ``rewards/margins``, ``logps/chosen`` (``a_c``), ``logps/rejected``,
``log_odds_ratio`` (``logsigmoid(log_odds)``), ``log_odds_chosen`` (``log_odds``), and
``nll_loss`` (the global token mean; TRL's is the mean of micro-batch token means). TRL's
``logits/*`` need the logits, which megaloss never builds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Union

import torch
import torch.nn.functional as F

from ..ops.options import OptionsBase, check_finite_positive, resolve_options
from ..parallel.groups import GroupLike
from ._preference import (
    MaybeTensor,
    NLLTerm,
    PairTerms,
    PreferenceOutput,
    PreferenceWeights,
    ScalarWeight,
    Tensor,
    check_lengths,
    check_vector,
    paired_loss,
    paired_metrics,
    preference_weights,
)

__all__ = ["ORPOOptions", "ORPOOutput", "orpo_loss", "orpo_metrics", "ORPO_METRICS",
           "preference_weights", "PreferenceWeights", "log1mexp"]

ORPO_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                "logps/chosen", "logps/rejected", "log_odds_ratio", "log_odds_chosen",
                "nll_loss")


@dataclass(frozen=True)
class ORPOOptions(OptionsBase):
    """Options of :func:`orpo_loss` (name and default of TRL 1.16's ``ORPOConfig``,
    ``trl/experimental/orpo/orpo_config.py``).

    Attributes:
        beta: the weight of the odds-ratio term (the paper's ``lambda``), finite ``> 0``.

    Raises:
        ValueError: ``beta`` out of range, naming it.
    """

    beta: float = 0.1

    def __post_init__(self) -> None:
        check_finite_positive("beta", self.beta)
        object.__setattr__(self, "beta", float(self.beta))


class ORPOOutput(PreferenceOutput):
    """What :func:`orpo_loss` returns with ``return_stats=True``: ``loss`` and ``stats`` (``[11]``
    local sums for :func:`orpo_metrics`)."""

    __slots__ = ()


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x <= 0``, TRL's branch at ``-ln 2``
    (``trl/experimental/orpo/orpo_trainer.py``, ``log1mexp``; Maechler 2012, "Accurately
    computing log(1 - exp(-|a|))")."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)),
                       torch.log(-torch.expm1(x)))


def orpo_loss(chosen_log_probs: Tensor, rejected_log_probs: Tensor, *,
              chosen_lengths: MaybeTensor = None, rejected_lengths: MaybeTensor = None,
              nll_log_probs: MaybeTensor = None, nll_lengths: MaybeTensor = None,
              pair_weights: MaybeTensor = None, nll_weight: ScalarWeight = None,
              beta: float = 0.1, return_stats: bool = False,
              options: Optional[ORPOOptions] = None):
    """The ORPO loss of a micro-batch of pairs (module docstring for the math).

    Args:
        chosen_log_probs, rejected_log_probs: ``[P]`` summed completion log-probs under the
            policy (differentiable; :func:`~megaloss.losses.dpo.sequence_log_probs`).
        chosen_lengths, rejected_lengths: ``[P]`` completion token counts (required; counts
            below 1 count as 1).
        nll_log_probs, nll_lengths: ``[P]`` summed log-probs and token counts of the NLL term
            (default: the chosen completions; TRL: the chosen prompt and completion).
        pair_weights: ``[P]`` (:attr:`PreferenceWeights.pair_weights`); ``None``: the mean over
            this call's pairs.
        nll_weight: the weight of each NLL token (:attr:`PreferenceWeights.nll_weight`);
            ``None``: ``1 / sum(nll_lengths)`` of this call.
        beta: the field of :class:`ORPOOptions`.
        return_stats: also return the local sums :func:`orpo_metrics` reads, as an
            :class:`ORPOOutput`.
        options: an :class:`ORPOOptions` instead of ``beta=``.

    Returns:
        The loss, a differentiable scalar in the log-probs' dtype (an :class:`ORPOOutput`
        with ``return_stats=True``).

    Raises:
        ValueError: missing lengths, ``nll_lengths`` without ``nll_log_probs``, or a vector of
            the wrong shape or type, naming it; ``beta`` out of range.
        TypeError: ``options`` is no :class:`ORPOOptions`, or comes with ``beta=``.
    """
    opts = resolve_options(ORPOOptions, options, locals())
    return paired_loss(_orpo_pairs, ORPOOutput, opts, chosen_log_probs, rejected_log_probs,
                       pair_weights=pair_weights, nll_weight=nll_weight,
                       return_stats=return_stats, chosen_lengths=chosen_lengths,
                       rejected_lengths=rejected_lengths, nll_log_probs=nll_log_probs,
                       nll_lengths=nll_lengths)


def _orpo_pairs(opts: ORPOOptions, chosen: torch.Tensor, rejected: torch.Tensor,
                weights: torch.Tensor, *, chosen_lengths: Optional[torch.Tensor],
                rejected_lengths: Optional[torch.Tensor], nll_log_probs: Optional[torch.Tensor],
                nll_lengths: Optional[torch.Tensor]) -> PairTerms:
    """ORPO's per-pair terms (:mod:`._preference`): ``-beta * logsigmoid(log_odds)`` on the
    length-averaged log-probs ``a`` (also the rewards / beta and ``logps/*``), the log-odds
    metrics, and the NLL term (weight 1)."""
    n, dtype = chosen.shape[0], chosen.dtype
    why = "ORPO's odds are on the length-averaged log-probs"
    n_c = check_lengths("chosen_lengths", chosen_lengths, n, why, dtype)
    n_r = check_lengths("rejected_lengths", rejected_lengths, n, why, dtype)
    if nll_log_probs is None:
        if nll_lengths is not None:
            raise ValueError("nll_lengths needs nll_log_probs (the NLL defaults to the chosen "
                             "completions and their chosen_lengths)")
        nll_log_probs, nll_lengths = chosen, chosen_lengths
    check_vector("nll_log_probs", nll_log_probs, n, "chosen_log_probs")
    check_lengths("nll_lengths", nll_lengths, n, "the NLL is a token mean", dtype)
    # pairs of weight 0 (padding rows, whose log-prob 0 has infinite odds) get a finite
    # stand-in, so that neither their loss nor their (zero) gradient is NaN
    live = weights != 0
    stand_in = torch.full((), -1.0, dtype=dtype, device=chosen.device)
    a_c = torch.where(live, chosen / n_c, stand_in)
    a_r = torch.where(live, rejected / n_r, stand_in)
    log_odds = (a_c - a_r) - (log1mexp(a_c) - log1mexp(a_r))
    log_sig = F.logsigmoid(log_odds)
    # the token count itself (a padding row has none)
    nll = NLLTerm(nll_log_probs, nll_lengths.to(dtype), 1.0)
    return PairTerms(-opts.beta * log_sig, a_c, a_r, a_c, a_r, (log_sig, log_odds), nll)


def orpo_metrics(stats: Union[torch.Tensor, Sequence[torch.Tensor]], *,
                 group: GroupLike = None) -> Dict[str, float]:
    """The step's metrics under TRL's names (:data:`ORPO_METRICS`): means over the global pairs,
    ``nll_loss`` the global token mean (ONE all-reduce over ``group``, the ``dp x sp`` group;
    every rank must call it); 0.0 when no rank had a pair.

    Raises:
        ValueError: ``stats`` are not :attr:`ORPOOutput.stats` tensors.
    """
    return paired_metrics(ORPO_METRICS, stats, "ORPOOutput", group)
