"""KTO, the unpaired preference loss (desirable / undesirable completions against a KL
baseline), on sequence log-probs, normalised over the *global* examples of an optimizer step.

Math (KTO, Ethayarajh et al. 2024, arXiv:2402.01306, Eq. 7; as TRL 1.16 computes it,
``trl/trainer/kto_trainer.py``, ``KTOTrainer._compute_loss``), per example ``b`` with the
log-ratio ``r = logp(y|x) - ref_logp(y|x)`` (sequence sums) and ``s``: sigmoid::

    z0 = max(0, mean over the step's KL rows of (logp(y'|x) - ref_logp(y'|x)))
         (y': a completion of another prompt, TRL's mismatched pairs; detached)

    loss_type          desirable                       undesirable          source
    ------------------ ------------------------------- -------------------- -------------------
    kto                lambda_D (1 - s(beta (r - z0))) lambda_U (1 - s(beta KTO, arXiv:2402.01306
                                                       (z0 - r)))
    apo_zero_unpaired  lambda_D (1 - s(beta r))        lambda_U s(beta r)   APO, arXiv:2408.06266

    loss = sum_b l_b / N_examples          (N_examples over every DP / SP rank and GAS step)

with ``lambda_D`` / ``lambda_U`` = ``desirable_weight`` / ``undesirable_weight``.

Normalisation: TRL takes each micro-batch's mean over its examples, and its KL baseline ``z0``
is the mean over the DP ranks of each rank's micro-batch mean (``gather_for_metrics``), so it
changes from micro-batch to micro-batch. megaloss weights each example by ``1 / N_examples``
of the whole step (:func:`~megaloss.losses.orpo.preference_weights` of a step begun on the
completions' labels: its ``pair_weights`` are the example weights), and
:func:`kto_kl_baseline` gives one ``z0`` for the step, the mean over all its KL rows (one
all-reduce, before the first backward: ``z0`` has no gradient, so the KL rows' forward passes
can all run first, under ``no_grad``). Any DP x GAS split then gives the single-device loss and
gradient. TRL's conventions: ``preference_weights(..., convention="micro_batch")`` and
``kto_kl_baseline(..., convention="micro_batch")`` (one ``z0`` per micro-batch).

Inputs: ``[B]`` floating tensors (summed completion log-probs under the policy and the
reference; any float dtype, the loss in theirs) and a ``[B]`` bool (or 0 / 1) ``desirable``.

Metrics (:func:`kto_metrics`, TRL's names): ``kl`` (the ``z0`` used, mean over the calls),
``rewards/chosen`` (``beta * r`` of the desirable examples, mean over the step's global ones),
``rewards/rejected`` (of the undesirable ones), ``rewards/margins`` (their difference; 0 when
either is missing, where TRL logs nothing), ``logps/chosen``, ``logps/rejected``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Union

import torch

from ..ops.options import check_finite_positive, resolve_options
from ..parallel.comm import all_reduce_sum_
from ..parallel.groups import GroupLike, group_size
from ._preference import (
    WEIGHT_CONVENTIONS,
    ExampleTerms,
    LossTypeOptions,
    MaybeTensor,
    PreferenceOutput,
    ScalarWeight,
    Tensor,
    check_scalar_weight,
    check_vector,
    ratio,
    reduce_metrics,
    unpaired_loss,
)

__all__ = ["KTOOptions", "KTOOutput", "KTO_LOSS_TYPES", "KTO_METRICS", "kto_loss",
           "kto_kl_baseline", "kto_metrics"]

KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")
KTO_METRICS = ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
               "logps/rejected")
_NUM_STATS = 8  # sums of r_D, count D, sums of r_U, count U, logp D, logp U, z0, calls


@dataclass(frozen=True)
class KTOOptions(LossTypeOptions, loss_types=KTO_LOSS_TYPES):
    """Options of :func:`kto_loss` (names and defaults of TRL 1.16's ``KTOConfig``,
    ``trl/trainer/kto_config.py``).

    Attributes:
        loss_type: ``"kto"`` or ``"apo_zero_unpaired"`` (module docstring).
        beta: the inverse temperature, finite ``> 0``.
        desirable_weight, undesirable_weight: ``lambda_D`` / ``lambda_U``, finite ``> 0`` (KTO
            recommends ``lambda_D n_D / (lambda_U n_U)`` in ``[1, 4/3]``).

    Raises:
        ValueError: an unknown ``loss_type``, or ``beta`` or a weight not finite ``> 0``.
    """

    loss_type: str = "kto"
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("desirable_weight", "undesirable_weight"):
            check_finite_positive(name, getattr(self, name))
            object.__setattr__(self, name, float(getattr(self, name)))


class KTOOutput(PreferenceOutput):
    """What :func:`kto_loss` returns with ``return_stats=True``: ``loss`` and ``stats`` (``[8]``
    local sums for :func:`kto_metrics`)."""

    __slots__ = ()


def kto_kl_baseline(kl_log_probs: Union[torch.Tensor, Sequence[torch.Tensor]],
                    ref_kl_log_probs: Union[torch.Tensor, Sequence[torch.Tensor]], *,
                    kl_lengths: Union[None, torch.Tensor, Sequence[torch.Tensor]] = None,
                    convention: str = "global", group: GroupLike = None) -> torch.Tensor:
    """KTO's KL baseline ``z0`` from the mismatched completions' sequence log-probs (detached
    float64; ONE all-reduce over ``group``, the ``dp x sp`` group: every rank must call it).

    Args:
        kl_log_probs, ref_kl_log_probs: ``[B_i]`` summed log-probs of the KL completions under
            the policy and the reference, one tensor per micro-batch of the step on this rank
            (or one tensor).
        kl_lengths: their token counts, same layout; rows with 0 tokens (padding) are not
            counted. ``None``: every row counts.
        convention: ``"global"``: ``max(0, mean over every KL row of the step on every rank)``,
            a 0-dim tensor. ``"micro_batch"`` (TRL): per micro-batch ``i``, ``max(0, mean over
            the ranks of each rank's mean of micro-batch i)``, a ``[G]`` tensor (every rank
            must pass the same number of micro-batches, each with a counted row).
        group: the ranks whose rows the mean covers.

    Raises:
        ValueError: mismatched lists or shapes, unknown ``convention``.
    """
    if convention not in WEIGHT_CONVENTIONS:
        raise ValueError(f"convention must be one of {WEIGHT_CONVENTIONS}, got {convention!r}")

    def listed(x, name):
        xs = [x] if isinstance(x, torch.Tensor) else list(x)
        if not xs:
            raise ValueError(f"{name} must be a tensor or a non-empty sequence of tensors")
        return xs

    pol = listed(kl_log_probs, "kl_log_probs")
    ref = listed(ref_kl_log_probs, "ref_kl_log_probs")
    lens = [None] * len(pol) if kl_lengths is None else listed(kl_lengths, "kl_lengths")
    if len(ref) != len(pol) or len(lens) != len(pol):
        raise ValueError("kl_log_probs, ref_kl_log_probs and kl_lengths must have as many "
                         f"micro-batches, got {len(pol)}, {len(ref)} and {len(lens)}")
    sums, counts = [], []
    for p, r, n in zip(pol, ref, lens):
        m = check_vector("kl_log_probs", p, None, "")
        check_vector("ref_kl_log_probs", r, m, "kl_log_probs")
        if n is None:
            valid = torch.ones(m, dtype=torch.float64, device=p.device)
        elif not isinstance(n, torch.Tensor) or n.shape != (m,):
            raise ValueError(f"kl_lengths must be [{m}] tensors, got {getattr(n, 'shape', n)}")
        else:
            valid = (n > 0).to(torch.float64)
        diff = (p.detach() - r.detach()).to(torch.float64)
        sums.append((diff * valid).sum())
        counts.append(valid.sum())
    sums, counts = torch.stack(sums), torch.stack(counts)
    if convention == "global":
        total = all_reduce_sum_(torch.stack([sums.sum(), counts.sum()]), group)
        return (total[0] / total[1].clamp(min=1.0)).clamp(min=0.0)
    rank_means = all_reduce_sum_(sums / counts, group)
    return (rank_means / group_size(group)).clamp(min=0.0)


def kto_loss(log_probs: Tensor, ref_log_probs: Tensor, desirable: Tensor, *,
             kl: ScalarWeight = None, sample_weights: MaybeTensor = None,
             loss_type: str = "kto", beta: float = 0.1, desirable_weight: float = 1.0,
             undesirable_weight: float = 1.0, return_stats: bool = False,
             options: Optional[KTOOptions] = None):
    """The KTO loss of a micro-batch of examples (module docstring for the math).

    Args:
        log_probs: ``[B]`` summed completion log-probs under the policy (differentiable).
        ref_log_probs: ``[B]`` under the reference (detached).
        desirable: ``[B]`` bool / 0-1 labels (True: a desirable completion, TRL's ``label``).
        kl: the baseline ``z0`` (:func:`kto_kl_baseline`; a float or a scalar tensor, clamped
            at 0, no gradient); ``None``: 0 (TRL's ``calculate_kl=False``). Unused by
            ``"apo_zero_unpaired"``.
        sample_weights: ``[B]`` (:attr:`~megaloss.losses.orpo.PreferenceWeights.pair_weights`);
            ``None``: the mean over this call's examples.
        loss_type, beta, desirable_weight, undesirable_weight: the fields of
            :class:`KTOOptions`.
        return_stats: return the loss with the local sums of :func:`kto_metrics` (a
            :class:`KTOOutput`).
        options: the four fields as one :class:`KTOOptions`.

    Returns:
        The weighted sum of the examples' losses (differentiable scalar), or its
        :class:`KTOOutput`.

    Raises:
        ValueError: ``ref_log_probs``, ``desirable``, ``kl`` or ``sample_weights`` of the wrong
            shape or type, naming it; an option out of range.
        TypeError: ``options`` together with option keywords, or not a :class:`KTOOptions`.
    """
    opts = resolve_options(KTOOptions, options, locals())
    return unpaired_loss(_kto_examples, KTOOutput, opts, log_probs,
                         sample_weights=sample_weights, return_stats=return_stats,
                         ref_log_probs=ref_log_probs, desirable=desirable, kl=kl)


def _kto_examples(opts: KTOOptions, log_probs: torch.Tensor, *, ref_log_probs: torch.Tensor,
                  desirable: torch.Tensor, kl: Union[None, float, torch.Tensor]) -> ExampleTerms:
    """KTO's per-example terms (:mod:`._preference`): the losses of the desirable and the
    undesirable examples against the baseline ``z0``, and the log-ratios (rewards / beta)."""
    n = log_probs.shape[0]
    check_vector("ref_log_probs", ref_log_probs, n, "log_probs")
    if not isinstance(desirable, torch.Tensor) or desirable.shape != (n,) \
            or desirable.is_floating_point() or desirable.is_complex():
        raise ValueError(f"desirable must be a [{n}] bool or integer 0 / 1 tensor, got "
                         f"{getattr(desirable, 'dtype', type(desirable).__name__)} "
                         f"{tuple(getattr(desirable, 'shape', ()))}")
    good = desirable != 0
    zero = torch.zeros((), dtype=log_probs.dtype, device=log_probs.device)
    z0 = check_scalar_weight("kl", kl, log_probs, zero).detach().clamp(min=0.0)
    r = log_probs - ref_log_probs
    if opts.loss_type == "kto":
        per = torch.where(good, opts.desirable_weight * (1 - torch.sigmoid(opts.beta * (r - z0))),
                          opts.undesirable_weight * (1 - torch.sigmoid(opts.beta * (z0 - r))))
    else:
        per = torch.where(good, opts.desirable_weight * (1 - torch.sigmoid(opts.beta * r)),
                          opts.undesirable_weight * torch.sigmoid(opts.beta * r))
    return ExampleTerms(per, r, log_probs, good, z0)


def kto_metrics(stats: Union[torch.Tensor, Sequence[torch.Tensor]], *,
                group: GroupLike = None) -> Dict[str, float]:
    """The step's metrics under TRL's names (:data:`KTO_METRICS`), means over the global
    desirable / undesirable examples (ONE all-reduce over ``group``, the ``dp x sp`` group;
    every rank must call it); 0.0 where there were none.

    Raises:
        ValueError: ``stats`` are not :attr:`KTOOutput.stats` tensors.
    """
    rc, nc, rr, nr, lc, lr, kl, calls = reduce_metrics(stats, _NUM_STATS, "KTOOutput", group)
    chosen, rejected = ratio(rc, nc), ratio(rr, nr)
    return {"kl": ratio(kl, calls), "rewards/chosen": chosen, "rewards/rejected": rejected,
            "rewards/margins": chosen - rejected if nc > 0 and nr > 0 else 0.0,
            "logps/chosen": ratio(lc, nc), "logps/rejected": ratio(lr, nr)}
