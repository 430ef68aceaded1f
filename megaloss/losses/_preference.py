"""The one base of the sequence-level preference losses (:mod:`.dpo`, :mod:`.simpo`,
:mod:`.orpo`, :mod:`.kto`): a loss supplies its per-pair math (per-example for KTO); the driver
here (input and weight checks, the weighted sum over the step's global pairs, the NLL term, the
``*Output.stats`` sums and their reduction to metrics) is written once. The pattern of
Liger-Kernel's ``src/liger_kernel/chunked_loss/fused_linear_preference.py`` (and
``fused_linear_unpaired_preference.py``), where each loss gives its ``preference_loss_fn``.

A paired loss (``2P`` rows: ``P`` chosen, ``P`` rejected completions) supplies

- ``pair_terms(opts, chosen_log_probs, rejected_log_probs, pair_weights, **inputs) ->
  PairTerms``: its ``[P]`` per-pair losses, the per-pair quantities its ``rewards/*`` (times
  ``beta``) and ``logps/*`` metrics report, its further per-pair metrics and its NLL term,
  checking the inputs only it reads (``inputs``: reference log-probs, lengths, ...);
- its options: a frozen dataclass on :class:`LossTypeOptions` (``loss_type`` and ``beta``
  checked there, the loss types a class keyword), or on
  :class:`~megaloss.ops.options.OptionsBase` with a ``beta`` (ORPO's);
- its ``*Output``: :class:`PreferenceOutput` (``loss``, ``stats``) under the loss's name, and
  its metric names;

and its public function is ``paired_loss(pair_terms, Output, resolve_options(...), chosen,
rejected, pair_weights=..., nll_weight=..., return_stats=..., **inputs)``, its metrics
``paired_metrics(names, stats, "Output", group)``. The unpaired KTO supplies
``example_terms(opts, log_probs, **inputs) -> ExampleTerms`` to :func:`unpaired_loss` instead.

Also here: the per-pair / per-example and NLL-token weights of a step
(:func:`preference_weights`), the checks of the losses' inputs, and the metric reduction.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from ..calibration.calibrator import StepCalibration
from ..ops.options import OptionsBase, check_choice, check_finite_positive
from ..parallel.comm import all_reduce_sum_
from ..parallel.groups import GroupLike

WEIGHT_CONVENTIONS = ("global", "micro_batch")

# the losses' argument types
Tensor = torch.Tensor
MaybeTensor = Optional[torch.Tensor]
ScalarWeight = Union[None, float, torch.Tensor]  # a float or a scalar tensor


class PreferenceWeights(NamedTuple):
    """The weights of one micro-batch (:func:`preference_weights`): ``pair_weights`` ``[P]``
    (one per pair, or per example for KTO) and ``nll_weight`` (a scalar tensor, the weight of
    each NLL token)."""

    pair_weights: torch.Tensor
    nll_weight: torch.Tensor


def preference_weights(step: StepCalibration, i: int, *, convention: str = "global",
                       ignore_index: int = -100) -> PreferenceWeights:
    """The row weights and the NLL token weight of micro-batch ``i`` (no collective).

    Args:
        step: a :class:`~megaloss.calibration.LossCalibrator` step (``loss_reduction="sample"``)
            begun on one ``[P, T]`` label tensor per micro-batch whose valid tokens are those the
            NLL term counts: the chosen completions (``completion_labels(chosen_mask)``; CPO's
            NLL, and KTO's rows), or the chosen prompt and completion (TRL's ORPO NLL). A row
            counts when it has a valid token.
        i: the micro-batch.
        convention: ``"global"`` (megaloss): ``pair_weights = 1 / N_pairs`` and ``nll_weight =
            1 / N_tokens`` of the whole step (every DP / SP rank and accumulation step), so any
            split gives the single-device loss and gradient. ``"micro_batch"`` (TRL's trainers
            under HF ``Trainer`` + DDP): each micro-batch's mean over its own pairs and tokens,
            averaged over the step's ``G x dp`` micro-batches (``1 / (P_i G dp)``,
            ``1 / (T_i G dp)``); needs ``sp = 1``.
        ignore_index: the label of tokens outside the NLL term.

    Under sequence parallelism (the step's topology has ``sp > 1``, the labels given to
    ``begin_step`` the whole sequences) a row counts when it has a valid token on *any* SP rank
    (read from :meth:`~megaloss.calibration.StepCalibration.full_labels`), and its weights are
    on SP rank 0 alone (``pair_weights`` and ``nll_weight`` 0 on the others): the losses take
    the pair terms and the NLL from sequence sums, which must then be the whole sequences'
    (``sequence_log_probs(..., sp_group=...)``), so each pair and each NLL token counts once and
    its gradient reaches every slice through that autograd all-reduce.

    Raises:
        ValueError: unknown ``convention``; ``"micro_batch"`` with sequence parallelism.
        IndexError: ``i`` out of range.
    """
    if convention not in WEIGHT_CONVENTIONS:
        raise ValueError(f"convention must be one of {WEIGHT_CONVENTIONS}, got {convention!r}")
    topology = step.topology
    full = step.full_labels(i)
    valid = full != ignore_index
    rows = valid.reshape(full.shape[0], -1).any(-1).to(torch.float64)
    counted = 1.0
    if topology.sp_size != 1 and topology.sp_rank != 0:
        rows, counted = torch.zeros_like(rows), 0.0
    if convention == "global":
        pairs, tokens = step.num_samples, step.num_tokens
    else:
        if topology.sp_size != 1:
            raise ValueError("convention='micro_batch' needs sp = 1 (a micro-batch's own mean "
                             "over an SP-split sequence would need a collective)")
        copies = float(step.num_micro_batches * topology.dp_size)
        pairs = rows.sum() * copies
        tokens = valid.sum().to(torch.float64) * copies  # sp = 1: the full labels are local
    one = torch.ones((), dtype=torch.float64, device=rows.device)
    pairs = torch.where(pairs > 0, pairs, one)
    tokens = torch.where(tokens > 0, tokens, one)
    dtype = step.weights(i).dtype
    return PreferenceWeights((rows / pairs).to(dtype), (counted / tokens).to(dtype))


@dataclass(frozen=True)
class LossTypeOptions(OptionsBase):
    """The two fields TRL's preference configs share, checked before a subclass's own:
    ``loss_type``, one of the subclass's ``loss_types`` (a class keyword: ``class
    KTOOptions(LossTypeOptions, loss_types=KTO_LOSS_TYPES)``; the subclass gives the default),
    and ``beta``, finite ``> 0`` (made a float).

    Raises:
        ValueError: an unknown ``loss_type`` or a ``beta`` out of range, naming it.
    """

    loss_type: str
    beta: float = 0.1
    loss_types = ()  # not a field: the subclass's choices

    def __init_subclass__(cls, loss_types: Sequence[str] = (), **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.loss_types = tuple(loss_types)

    def __post_init__(self) -> None:
        check_choice("loss_type", self.loss_type, self.loss_types)
        check_finite_positive("beta", self.beta)
        object.__setattr__(self, "beta", float(self.beta))


class PreferenceOutput(NamedTuple):
    """What a preference loss returns with ``return_stats=True`` (each loss's ``*Output`` is
    this under its own name): ``loss`` (differentiable scalar, this call's share of the global
    loss) and ``stats`` (detached float64 local sums for the loss's ``*_metrics``)."""

    loss: torch.Tensor
    stats: torch.Tensor


class NLLTerm(NamedTuple):
    """A paired loss's NLL term, ``coef * nll_weight * -sum(log_probs)``: the token mean of the
    NLL rows' negative log-probs (``nll_weight``'s default: ``1 / sum(lengths)``).

    Attributes:
        log_probs: ``[P]`` summed log-probs of the NLL rows.
        lengths: ``[P]`` their token counts (the inputs' dtype); ``None``: unknown, the call
            must then give ``nll_weight``.
        coef: the term's weight in the loss (CPO's ``cpo_alpha``, 1 for ORPO); 0: no term.
        missing_lengths: the error's message when ``lengths`` is ``None`` without
            ``nll_weight``.
    """

    log_probs: torch.Tensor
    lengths: Optional[torch.Tensor]
    coef: float
    missing_lengths: str = ""

    def totals(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """The stats after the per-pair sums: the NLL sum (0 without the term) and its tokens
        (0 when unknown), float64 ``[1]`` each."""
        zero = torch.zeros(1, dtype=torch.float64, device=self.log_probs.device)
        nll = -self.log_probs.sum().detach().to(torch.float64).reshape(1) if self.coef else zero
        tokens = zero if self.lengths is None else self.lengths.to(torch.float64).sum().reshape(1)
        return nll, tokens


class PairTerms(NamedTuple):
    """What a paired loss's per-pair function computes for a call's ``P`` pairs (``[P]``
    tensors in the inputs' dtype).

    Attributes:
        losses: ``l_p``, the per-pair losses the driver weights and sums.
        chosen, rejected: the per-pair quantities whose ``beta`` multiples are the rewards
            (``rewards/*``): DPO's log-ratios, CPO's (averaged) log-probs, ORPO's averages.
        chosen_logps, rejected_logps: what ``logps/*`` report.
        extra: further per-pair metrics, after the six every paired loss reports (ORPO's).
        nll: the NLL term, or ``None``.
        loss_weights: the weights of ``losses`` when they are not one per pair (AOT's sorted
            margins: ``[k]`` losses of the ``k`` counted pairs); ``None``: ``pair_weights``.
    """

    losses: torch.Tensor
    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_logps: torch.Tensor
    rejected_logps: torch.Tensor
    extra: Tuple[torch.Tensor, ...] = ()
    nll: Optional[NLLTerm] = None
    loss_weights: Optional[torch.Tensor] = None

    def metric_rows(self, beta: float) -> torch.Tensor:
        """float64 ``[7 + len(extra), P]``: ``rewards/chosen``, ``rewards/rejected``,
        ``rewards/accuracies``, ``rewards/margins``, ``logps/chosen``, ``logps/rejected``, the
        extra metrics, and 1 (the pair count)."""
        rc = beta * self.chosen.detach().to(torch.float64)
        rr = beta * self.rejected.detach().to(torch.float64)
        logps = [x.detach().to(torch.float64)
                 for x in (self.chosen_logps, self.rejected_logps, *self.extra)]
        return torch.stack([rc, rr, (rc > rr).to(torch.float64), rc - rr, *logps,
                            torch.ones_like(rc)])

    def totals(self) -> Tuple[torch.Tensor, ...]:
        return () if self.nll is None else self.nll.totals()


class ExampleTerms(NamedTuple):
    """What an unpaired loss's per-example function (KTO's) computes for a call's ``B`` examples
    (``[B]`` tensors in the inputs' dtype).

    Attributes:
        losses: the per-example losses the driver weights and sums.
        log_ratios: ``logp - ref_logp``, whose ``beta`` multiple is the reward.
        log_probs: the policy's log-probs (``logps/*``).
        desirable: ``[B]`` bool, the desirable examples (``chosen``).
        kl: the KL baseline used (a 0-dim tensor).
        loss_weights, nll: ``None`` (as :class:`PairTerms`'s: one loss per example, no NLL
            term), so that the driver reads both kinds of terms alike.
    """

    losses: torch.Tensor
    log_ratios: torch.Tensor
    log_probs: torch.Tensor
    desirable: torch.Tensor
    kl: torch.Tensor
    loss_weights: Optional[torch.Tensor] = None
    nll: Optional[NLLTerm] = None

    def metric_rows(self, beta: float) -> torch.Tensor:
        """float64 ``[6, B]``: the reward and the log-prob of the desirable and of the
        undesirable examples, with their counts."""
        good = self.desirable.to(torch.float64)
        bad = (~self.desirable).to(torch.float64)
        reward = beta * self.log_ratios.detach().to(torch.float64)
        log_probs = self.log_probs.detach().to(torch.float64)
        return torch.stack([reward * good, good, reward * bad, bad, log_probs * good,
                            log_probs * bad])

    def totals(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """``z0`` and 1 (this call), float64 ``[1]`` each."""
        kl = self.kl.detach().to(torch.float64).reshape(1)
        return kl, torch.ones_like(kl)


Terms = Union[PairTerms, ExampleTerms]


def paired_loss(pair_terms: Callable[..., PairTerms], output: Callable[..., Any], opts: Any,
                chosen_log_probs: Tensor, rejected_log_probs: Tensor, *, pair_weights: MaybeTensor,
                nll_weight: ScalarWeight, return_stats: bool, not_floating: type = ValueError,
                **inputs: Any):
    """A paired loss of one micro-batch: ``sum_p w_p l_p`` (plus its NLL term), or with
    ``return_stats`` its ``output(loss, stats)``.

    Args:
        pair_terms: the loss's per-pair function (module docstring).
        output: its ``*Output`` NamedTuple (``loss``, ``stats``).
        opts: its resolved options (``opts.beta`` scales the rewards).
        chosen_log_probs, rejected_log_probs: ``[P]`` floating.
        pair_weights: ``[P]`` (:attr:`PreferenceWeights.pair_weights`); ``None``: ``1 / P``.
        nll_weight: the weight of each NLL token; ``None``: ``1 / sum(lengths)`` of the call.
        return_stats: return ``output(loss, stats)``.
        not_floating: the error of a log-prob vector that is not a floating ``[P]`` tensor.
        inputs: passed on to ``pair_terms``.

    Raises:
        ValueError: the log-probs or ``pair_weights`` of the wrong shape, naming them
            (``not_floating`` for a non-floating log-prob vector); what ``pair_terms`` raises;
            a bad ``nll_weight``.
    """
    n = check_vector("chosen_log_probs", chosen_log_probs, None, "", not_floating)
    check_vector("rejected_log_probs", rejected_log_probs, n, "chosen_log_probs", not_floating)
    weights = check_weights("pair_weights", pair_weights, n, chosen_log_probs)
    terms = pair_terms(opts, chosen_log_probs, rejected_log_probs, weights, **inputs)
    weights = check_weights("pair_weights", pair_weights, n, terms.losses)  # the losses' dtype
    return _weighted_loss(terms, weights, nll_weight, opts.beta, return_stats, output)


def unpaired_loss(example_terms: Callable[..., ExampleTerms], output: Callable[..., Any],
                  opts: Any, log_probs: Tensor, *, sample_weights: MaybeTensor, return_stats: bool,
                  **inputs: Any):
    """An unpaired loss (KTO) of one micro-batch: ``sum_b w_b l_b``, or with ``return_stats``
    its ``output(loss, stats)``; the arguments as :func:`paired_loss`'s, ``sample_weights``
    ``[B]`` (``None``: ``1 / B``) in place of ``pair_weights``."""
    n = check_vector("log_probs", log_probs, None, "")
    terms = example_terms(opts, log_probs, **inputs)
    weights = check_weights("sample_weights", sample_weights, n, terms.losses)
    return _weighted_loss(terms, weights, None, opts.beta, return_stats, output)


def _weighted_loss(terms: Terms, weights: Tensor, nll_weight: ScalarWeight, beta: float,
                   return_stats: bool, output: Callable[..., Any]):
    """The weighted sum of ``terms.losses`` plus the NLL term; with ``return_stats``, the
    call's local stats: the metric rows summed over the rows of weight > 0, then the totals."""
    loss = (terms.losses * (weights if terms.loss_weights is None else terms.loss_weights)).sum()
    nll = terms.nll
    if nll is not None and nll.coef:
        default = None if nll.lengths is None else 1.0 / nll.lengths.sum().clamp(min=1.0)
        if nll_weight is None and default is None:
            raise ValueError(nll.missing_lengths)
        w_nll = check_scalar_weight("nll_weight", nll_weight, terms.losses, default)
        loss = loss + nll.coef * w_nll * -nll.log_probs.sum()
    if not return_stats:
        return loss
    with torch.no_grad():
        counted = (weights > 0).to(torch.float64)
        stats = torch.cat([(terms.metric_rows(beta) * counted).sum(-1), *terms.totals()])
    return output(loss, stats)


def check_vector(name: str, x: torch.Tensor, n: Optional[int], first: str,
                 not_floating: type = ValueError) -> int:
    """``x`` must be a floating ``[n]`` tensor (``n`` from the argument ``first``); else
    ``not_floating`` (a non-tensor, non-floating or not 1-D ``x``) or a ValueError (a length
    other than ``n``)."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() != 1:
        raise not_floating(f"{name} must be a floating [P] torch.Tensor, got "
                           f"{getattr(x, 'shape', type(x).__name__)}")
    if n is not None and x.shape[0] != n:
        raise ValueError(f"{name} must have shape ({n},) (that of {first}), got "
                         f"{tuple(x.shape)}")
    return x.shape[0]


def check_lengths(name: str, x: Optional[torch.Tensor], n: int, why: str,
                  dtype: torch.dtype) -> torch.Tensor:
    """``x``: ``[n]`` token counts, returned in ``dtype`` and at least 1 (a row without tokens
    has a zero log-prob sum, so its average is 0)."""
    if x is None:
        raise ValueError(f"{name} is required ({why})")
    if not isinstance(x, torch.Tensor) or x.shape != (n,):
        raise ValueError(f"{name} must be a [{n}] tensor, got {getattr(x, 'shape', x)}")
    return x.to(dtype).clamp(min=1.0)


def check_weights(name: str, w: Optional[torch.Tensor], n: int, like: torch.Tensor
                  ) -> torch.Tensor:
    """``[n]`` row weights, ``None``: the mean over this call's ``n`` rows."""
    if w is None:
        return torch.full((n,), 1.0 / max(n, 1), dtype=like.dtype, device=like.device)
    if not isinstance(w, torch.Tensor) or w.shape != (n,):
        raise ValueError(f"{name} must be a [{n}] tensor, got {getattr(w, 'shape', w)}")
    return w.to(like.dtype)


def check_scalar_weight(name: str, w: Union[None, float, torch.Tensor], like: torch.Tensor,
                        default: Optional[torch.Tensor]) -> torch.Tensor:
    """A scalar weight (float or one-element tensor), ``default`` when ``None``."""
    if w is None:
        return default
    if isinstance(w, torch.Tensor):
        if w.numel() != 1:
            raise ValueError(f"{name} must be a scalar, got a tensor of shape {tuple(w.shape)}")
        return w.reshape(()).to(like.dtype)
    if isinstance(w, bool) or not isinstance(w, (int, float)):
        raise ValueError(f"{name} must be a float or a scalar tensor, got {w!r}")
    return torch.tensor(float(w), dtype=like.dtype, device=like.device)


def reduce_metrics(stats: Union[torch.Tensor, Sequence[torch.Tensor]], size: int, output: str,
                   group: GroupLike) -> Tuple[float, ...]:
    """The sums of ``stats`` (one or more ``[size]`` tensors) over this call's list and ``group``
    (ONE all-reduce)."""
    if isinstance(stats, torch.Tensor):
        stats = [stats]
    stats = list(stats)
    if not stats or any(not isinstance(s, torch.Tensor) or s.shape != (size,) for s in stats):
        raise ValueError(f"stats must be one or more {output}.stats tensors [{size}]")
    return tuple(all_reduce_sum_(torch.stack(stats).sum(0).to(torch.float64), group).tolist())


def ratio(num: float, den: float) -> float:
    return num / den if den > 0 else 0.0


def means(names: Sequence[str], sums: Sequence[float], count: float) -> Dict[str, float]:
    return {name: ratio(s, count) for name, s in zip(names, sums)}


def paired_metrics(names: Sequence[str], stats: Union[torch.Tensor, Sequence[torch.Tensor]],
                   output: str, group: GroupLike) -> Dict[str, float]:
    """A paired loss's metrics ``names`` (its per-pair metrics, then ``"nll_loss"`` when it has
    an NLL term) from :attr:`output`.stats tensors: means over the global pairs, ``nll_loss``
    the global token mean (ONE all-reduce over ``group``); 0.0 when no rank had a pair."""
    has_nll = names[-1] == "nll_loss"
    pairs = len(names) - has_nll
    total = reduce_metrics(stats, pairs + 1 + 2 * has_nll, output, group)
    out = means(names[:pairs], total[:pairs], total[pairs])
    if has_nll:
        out["nll_loss"] = ratio(total[-2], total[-1])
    return out
