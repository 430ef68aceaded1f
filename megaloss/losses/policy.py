"""Policy-gradient losses of the GRPO family (``grpo``, ``bnpo``, ``dapo``, ``dr_grpo``,
``luspo``), CISPO, SAPO and VESPO on per-token log-probs, normalised over the *global* batch of
an optimizer step.

Math, per completion token ``t`` of sequence ``s`` (TRL 1.16, ``trl/trainer/grpo_trainer.py``,
``GRPOTrainer._compute_loss``, reproduced term by term)::

    log_ratio  = logp_t - old_logp_t
    ratio      = exp(log_ratio)                       (importance_sampling_level="token")
               = exp(mean_{t in s} log_ratio)         ("sequence": GSPO, arXiv:2507.18071)
    PPO:   l_t = -min(min(ratio, delta) * A_s, clamp(ratio, 1 - eps_low, 1 + eps_high) * A_s)
           (grpo, bnpo, dapo, dr_grpo, luspo)
    CISPO: l_t = -stopgrad(min(ratio, eps_high)) * A_s * logp_t
           two-sided (cispo_two_sided, verl):
           l_t = -stopgrad(clamp(ratio, 1 - eps_low, 1 + eps_high)) * A_s * logp_t
    SAPO:  l_t = -sigmoid(tau_s * (ratio - 1)) * 4 / tau_s * A_s     (tau_s: sapo_temperature_pos
           if A_s > 0, else sapo_temperature_neg; arXiv:2511.20347)
    VESPO: l_t = -stopgrad(phi_s) * A_s * logp_t,  phi_s = exp(lambda + k log w_s - lambda w_s),
           log w_s = clamp(sum_{t in s} clamp(log_ratio_t, -20, 20), log 1e-8, 20), (k, lambda)
           by the sign of A_s (vespo_k_pos, vespo_lambda_pos if A_s >= 0; arXiv:2602.10693)
    KL:    l_t += beta * KL_t,  KL_t the kl_estimator of x = logp_t - ref_t:
           k1: x   k2: x^2 / 2   k3 (default): exp(-x) + x - 1   abs: |x|
           low_var_kl: clamp(k3 of clamp(x, -20, 20), -10, 10)
           "+" forms (k1+, k3+, low_var_kl+, abs+): that value, the gradient of k2

    loss = sum_t w_t * l_t  -  entropy_coef * sum_t h_t * H_t

with the loss weights ``w_t`` of the ``loss_type`` and the entropy weights ``h_t = 1 / N_tokens``,
both over the completion tokens of every micro-batch of every DP / SP rank of the step:

=============== ============================================== ===============================
loss_type       ``w_t``                                        megaloss calibration
=============== ============================================== ===============================
grpo, sapo      ``1 / (n_s * N_sequences)``                    ``loss_reduction="sample"``
bnpo, dapo      ``1 / N_tokens``                               ``loss_reduction="token"``
cispo, vespo    ``1 / N_tokens``                               ``loss_reduction="token"``
dr_grpo         ``1 / (N_sequences * max_completion_length)``  the step's global sequence count
luspo           ``1 / N_sequences``                            the step's global sequence count
=============== ============================================== ===============================

``loss_agg_mode`` (verl's ``agg_loss``, ``verl/trainer/ppo/core_algos.py``) replaces the
``loss_type``'s weights, and the entropy weights too (``h_t = w_t``: verl's actor aggregates
the policy term, the KL and the entropy with the one mode):

============================ ============================================ ====================
loss_agg_mode                ``w_t = h_t``                                megaloss calibration
============================ ============================================ ====================
``token-mean``               ``1 / N_tokens``                             ``"token"``
``seq-mean-token-sum``       ``1 / N_sequences``                          ``"token"``
``seq-mean-token-mean``      ``1 / (n_s * N_sequences)``                  ``"sample"``
``seq-mean-token-sum-norm``  ``1 / max_completion_length``                ``"token"``
============================ ============================================ ====================

verl computes each mode per micro-batch (its ``seq-mean-token-sum-norm`` divides the
micro-batch's token sum by ``loss_scale_factor``, by default the padded response length, and
its actor scales each micro-batch by ``1 / gradient_accumulation`` before the DP average);
megaloss's is verl's ``agg_loss`` on the whole global batch as one micro-batch, so it does not
depend on the split (``max_completion_length`` is verl's ``loss_scale_factor``; verl's
``seq-mean-token-mean`` adds ``1e-8`` to each ``n_s``, megaloss does not).

(``n_s``: completion tokens of sequence ``s``. ``N_sequences``: by default the rows with at
least one completion token, so padding rows, all-padding micro-batches and ranks without
completions count nothing; with ``count_empty_rows=True`` every row, as TRL counts them: its
``grpo``, ``sapo`` and ``luspo`` average over all ``B`` rows and its ``dr_grpo`` divides by ``B x
max_completion_length``, also where ``mask_truncated_completions`` emptied a row.)
The weights come from one :class:`~megaloss.calibration.LossCalibrator` step (ONE all-reduce of
three numbers for the whole optimizer step), so ``sum over ranks and micro-batches of loss`` is
the loss one device computes on the whole global batch, and backwarding
``step.loss_for_backward(loss)`` through any engine gives that device's gradient.

What differs from TRL, and why: TRL normalises ``grpo``, ``bnpo`` and ``dr_grpo`` per micro-batch
and per process (then divides by the accumulation steps), so the gradient depends on how the
batch is split over ranks and accumulation steps whenever completion lengths differ; only its
``dapo`` / ``cispo`` use a global token count. megaloss normalises every ``loss_type`` over the
global batch, so one optimizer step equals the single-device step for every layout; ``bnpo`` and
``dapo`` are therefore the same loss here (both names kept, as TRL spells them). On one
micro-batch on one process the two agree exactly with ``count_empty_rows=True`` (TRL's row
count), and with the default ``False`` whenever every row holds a completion token; rows
without one make the policy term of megaloss's ``grpo`` / ``dr_grpo`` larger by ``B / (rows
with a completion token)`` (``bnpo``, ``dapo``, ``cispo`` count tokens and are unaffected). The
entropy bonus is the global token mean of the entropy (TRL: the micro-batch mean over the
accumulation steps).

Metrics (TRL's names, :func:`policy_metrics`): ``kl`` and ``entropy`` are global token means,
``clip_ratio/low_mean``, ``clip_ratio/high_mean``, ``clip_ratio/region_mean`` (PPO types) and
``cispo_clip_ratio`` global means over tokens (over sequences with
``importance_sampling_level="sequence"``, ``N_sequences`` as above), over the whole step (TRL: per
micro-batch). With ``cispo_two_sided`` the ``cispo_clip_ratio`` is verl's ``pg_clipfrac`` (the
share of ratios outside the clamp, any advantage). ``vespo/phi_seq_mean``: the mean ``phi_s``
over sequences; ``sapo``: no clip metric (as TRL).
"""
from __future__ import annotations

import math
from typing import Dict, NamedTuple, Optional, Sequence, Union

import torch

from ..calibration.calibrator import LossCalibrator, StepCalibration
from ..calibration.engine_scale import EngineScale
from ..calibration.weights import compute_loss_weights
from ..ops.options import resolve_options
from ..parallel.comm import all_reduce_sum_
from ..parallel.groups import SINGLE_RANK, GroupLike, group_rank, group_size
from ..parallel.mappings import all_reduce_sum_autograd
from ..parallel.topology import Topology
from .policy_options import PolicyLossOptions

__all__ = ["PolicyLossOptions", "PolicyLossOutput", "PolicyLossWeights", "policy_loss",
           "policy_loss_weights", "policy_loss_reduction", "policy_calibrator",
           "completion_labels", "policy_metrics", "POLICY_METRICS"]

POLICY_METRICS = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean",
                  "clip_ratio/region_mean", "cispo_clip_ratio", "vespo/phi_seq_mean")
# Layout of PolicyLossOutput.stats (local float64 sums; one all-reduce turns them into metrics).
_KL, _ENT, _LOW, _HIGH, _REGION, _CISPO, _TOKENS, _CLIP_COUNT = range(8)
_NUM_STATS = 8


class PolicyLossWeights(NamedTuple):
    """Per-token weights of one micro-batch (shape of its completion mask, 0 off the completion):
    ``loss_weights`` (the ``loss_type``'s global normaliser) and ``entropy_weights``
    (``1 / N_tokens``, global)."""

    loss_weights: torch.Tensor
    entropy_weights: torch.Tensor


class PolicyLossOutput(NamedTuple):
    """What :func:`policy_loss` returns with ``return_stats=True``.

    Attributes:
        loss: differentiable scalar, this call's share of the global loss (a float64 loss for
            float64 log-probs, else float32).
        stats: detached float64 ``[8]`` local sums for :func:`policy_metrics` (add the stats of
            a step's micro-batches, then reduce once).
    """

    loss: torch.Tensor
    stats: torch.Tensor


def _normaliser(opts: PolicyLossOptions) -> str:
    """How the loss weights are made: ``"token"`` (``1 / N_tokens``), ``"sample"`` (``1 / (n_s
    N_sequences)``), ``"seq"`` (``1 / N_sequences``), ``"seq_const"`` (``1 / (N_sequences
    L)``), ``"const"`` (``1 / L``), ``L`` being ``max_completion_length``."""
    if opts.loss_agg_mode is not None:
        return _AGG_NORMALISER[opts.loss_agg_mode]
    return _TYPE_NORMALISER[opts.loss_type]


_AGG_NORMALISER = {"token-mean": "token", "seq-mean-token-sum": "seq",
                   "seq-mean-token-mean": "sample", "seq-mean-token-sum-norm": "const"}
_TYPE_NORMALISER = {"grpo": "sample", "sapo": "sample", "bnpo": "token", "dapo": "token",
                    "cispo": "token", "vespo": "token", "dr_grpo": "seq_const", "luspo": "seq"}


def policy_loss_reduction(loss_type: str, loss_agg_mode: Optional[str] = None) -> str:
    """The :class:`~megaloss.calibration.LossCalibrator` ``loss_reduction`` a ``loss_type``'s
    (or a ``loss_agg_mode``'s) weights come from: ``"sample"`` for ``grpo``, ``sapo`` and
    ``"seq-mean-token-mean"``, ``"token"`` otherwise (the others use only the step's token or
    sequence count, which every reduction provides).

    Raises:
        ValueError: unknown ``loss_type`` or ``loss_agg_mode``.
    """
    return _reduction(PolicyLossOptions(loss_type=loss_type, max_completion_length=1,
                                        loss_agg_mode=loss_agg_mode))  # validates the names


def _reduction(opts: PolicyLossOptions) -> str:
    """:func:`policy_loss_reduction` of options already validated."""
    return "sample" if _normaliser(opts) == "sample" else "token"


def policy_calibrator(options: PolicyLossOptions, topology: Optional[Topology] = None, *,
                      engine_scale: Optional[EngineScale] = None,
                      weight_dtype: torch.dtype = torch.float32) -> LossCalibrator:
    """The :class:`~megaloss.calibration.LossCalibrator` of a policy loss: its
    ``begin_step(completion_labels(mask) per micro-batch)`` is the one all-reduce of the step,
    and :func:`policy_loss_weights` reads the weights from the step (its ``count_empty_samples``
    is ``options.count_empty_rows``).

    Raises:
        TypeError: ``options`` is not a :class:`PolicyLossOptions`; see
            :class:`~megaloss.calibration.LossCalibrator` for the rest.
    """
    if not isinstance(options, PolicyLossOptions):
        raise TypeError(f"options must be a PolicyLossOptions, got {type(options).__name__}")
    return LossCalibrator(topology, loss_reduction=_reduction(options),
                          engine_scale=engine_scale, weight_dtype=weight_dtype,
                          count_empty_samples=options.count_empty_rows)


def completion_labels(completion_mask: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Integer labels the calibrator counts: 0 on completion tokens (``completion_mask != 0``),
    ``ignore_index`` elsewhere; shape of ``completion_mask``.

    Raises:
        TypeError: ``completion_mask`` is not a tensor.
    """
    if not isinstance(completion_mask, torch.Tensor):
        raise TypeError(f"completion_mask must be a torch.Tensor, got "
                        f"{type(completion_mask).__name__}")
    valid = completion_mask != 0
    return torch.where(valid, torch.zeros((), dtype=torch.long, device=valid.device),
                       torch.full((), ignore_index, dtype=torch.long, device=valid.device))


def _weights(valid: torch.Tensor, step_weights: torch.Tensor, num_tokens: torch.Tensor,
             num_samples: torch.Tensor, options: PolicyLossOptions,
             dtype: torch.dtype) -> PolicyLossWeights:
    mask = valid.to(torch.float64)
    tokens = torch.where(num_tokens > 0, num_tokens, torch.ones_like(num_tokens))
    seqs = torch.where(num_samples > 0, num_samples, torch.ones_like(num_samples))
    norm = _normaliser(options)
    if norm == "seq_const":
        loss_w = (mask / (seqs * options.max_completion_length)).to(dtype)
    elif norm == "seq":
        loss_w = (mask / seqs).to(dtype)
    elif norm == "const":
        loss_w = (mask / options.max_completion_length).to(dtype)
    else:
        loss_w = step_weights.to(dtype)
    # verl aggregates the entropy with the loss's own mode; TRL takes its global token mean.
    entropy_w = loss_w if options.loss_agg_mode is not None else (mask / tokens).to(dtype)
    return PolicyLossWeights(loss_w, entropy_w)


def policy_loss_weights(step: StepCalibration, i: int, options: PolicyLossOptions, *,
                        ignore_index: int = -100) -> PolicyLossWeights:
    """The weights of micro-batch ``i`` of a calibrated step (no collective).

    Args:
        step: from ``policy_calibrator(options, ...).begin_step([completion_labels(m) for m in
            masks])`` (a :class:`~megaloss.calibration.LossCalibrator` whose
            ``loss_reduction`` is :func:`policy_loss_reduction` of the ``loss_type`` and
            ``count_empty_samples`` is ``options.count_empty_rows``, as
            :func:`policy_calibrator` builds it).
        i: the micro-batch.
        options: the loss's :class:`PolicyLossOptions`.
        ignore_index: the label of non-completion tokens in the step's labels.

    Returns:
        :class:`PolicyLossWeights` shaped like ``step.local_labels(i)``, in the calibrator's
        weight dtype.

    Raises:
        ValueError: a step whose ``count_empty_samples`` is not ``options.count_empty_rows``.
        TypeError: ``options`` is not a :class:`PolicyLossOptions`.
        IndexError: ``i`` out of range.
    """
    if not isinstance(options, PolicyLossOptions):
        raise TypeError(f"options must be a PolicyLossOptions, got {type(options).__name__}")
    if step.count_empty_samples != options.count_empty_rows:
        raise ValueError(f"options.count_empty_rows={options.count_empty_rows} but the step was "
                         f"calibrated with count_empty_samples={step.count_empty_samples}: build "
                         "the calibrator with policy_calibrator(options)")
    w = step.weights(i)
    return _weights(step.local_labels(i) != ignore_index, w, step.num_tokens, step.num_samples,
                    options, w.dtype)


def _check(name: str, x: Optional[torch.Tensor], shape: torch.Size, *, required: bool,
           why: str = "") -> None:
    if x is None:
        if required:
            raise ValueError(f"{name} is required{why}")
        return
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"{name} must be a floating torch.Tensor, got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")
    if x.shape != shape:
        raise ValueError(f"{name} must have shape {tuple(shape)} (that of log_probs), got "
                         f"{tuple(x.shape)}")


def policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: Optional[torch.Tensor],
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    ref_log_probs: Optional[torch.Tensor] = None,
    entropy: Optional[torch.Tensor] = None,
    weights: Optional[PolicyLossWeights] = None,
    loss_type: str = "dapo",
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    delta: Optional[float] = None,
    beta: float = 0.0,
    entropy_coef: float = 0.0,
    importance_sampling_level: str = "token",
    max_completion_length: Optional[int] = None,
    return_stats: bool = False,
    options: Optional[PolicyLossOptions] = None,
    sp_group: GroupLike = SINGLE_RANK,
):
    """The clipped policy-gradient loss of one micro-batch (module docstring for the math).

    Args:
        log_probs: ``[B, T]`` float log-probs of the completion tokens under the policy being
            trained (differentiable; e.g. ``megaloss.linear_log_probs(...).log_probs``).
        old_log_probs: ``[B, T]`` log-probs under the policy that sampled (detached); ``None``:
            ``log_probs.detach()`` (one update per generation, TRL's shortcut).
        advantages: ``[B]`` (one per sequence) or ``[B, T]`` float.
        completion_mask: ``[B, T]`` bool or 0/1: the tokens that carry loss.
        ref_log_probs: ``[B, T]`` reference-policy log-probs; required when ``beta > 0``.
        entropy: ``[B, T]`` per-token entropy of the policy (differentiable for the bonus);
            required when ``entropy_coef != 0``, else optional (only the metric).
        weights: this micro-batch's :class:`PolicyLossWeights` from
            :func:`policy_loss_weights` (global normalisation over the step). ``None``: this
            call is the whole batch (weights from this call's mask alone, no collective).
        loss_type: this and ``epsilon_low``, ``epsilon_high``, ``delta``, ``beta``,
            ``entropy_coef``, ``importance_sampling_level``, ``max_completion_length`` are the
            fields of :class:`~megaloss.PolicyLossOptions`, documented there.
        return_stats: return a :class:`PolicyLossOutput` (the loss and the local sums
            :func:`policy_metrics` reads) instead of the loss alone.
        options: these fields as one :class:`PolicyLossOptions` instead of the keywords; the
            other fields (``count_empty_rows``, ``kl_estimator``, ``cispo_two_sided``,
            ``loss_agg_mode``, the ``sapo_*`` / ``vespo_*`` parameters) only through it.
        sp_group: the sequence-parallel group (``Topology.sp_group``) when each of its ranks
            holds a contiguous slice of the same sequences' tokens (every ``[B, T]`` input is
            this rank's slice; ``advantages [B]`` the same on every rank). The per-sequence
            sums (GSPO's summed log-ratio, VESPO's clamped one, the completion lengths) are
            then added over the group by ONE all-reduce of ``[B]`` vectors (its backward one
            more, so the gradient of the sum of the ranks' losses reaches every slice), and a
            sequence counts once in the per-sequence metrics. Default: no SP.

    Returns:
        The loss ``sum w*l - entropy_coef * sum h*H`` (differentiable scalar), or with
        ``return_stats=True`` a :class:`PolicyLossOutput` holding it.

    Raises:
        ValueError: shape mismatches; ``ref_log_probs`` missing with ``beta > 0``; ``entropy``
            missing with ``entropy_coef != 0``; an option out of range; ``sp_group`` of size
            > 1 without ``weights`` (the normalisation must be the step's global one).
        TypeError: non-floating log-probs / advantages; ``options`` of the wrong type or
            together with option keywords.
    """
    opts = resolve_options(PolicyLossOptions, options, locals())
    if not isinstance(log_probs, torch.Tensor) or not log_probs.is_floating_point() \
            or log_probs.dim() != 2:
        raise TypeError(f"log_probs must be a floating [B, T] torch.Tensor, got "
                        f"{getattr(log_probs, 'shape', type(log_probs).__name__)}")
    shape = log_probs.shape
    if old_log_probs is None:
        old_log_probs = log_probs.detach()
    _check("old_log_probs", old_log_probs, shape, required=True)
    _check("ref_log_probs", ref_log_probs, shape, required=opts.beta > 0,
           why=" when beta > 0 (the KL penalty)")
    _check("entropy", entropy, shape, required=opts.entropy_coef != 0,
           why=" when entropy_coef != 0 (the entropy bonus)")
    if not isinstance(completion_mask, torch.Tensor) or completion_mask.shape != shape:
        raise ValueError(f"completion_mask must be a tensor of shape {tuple(shape)}, got "
                         f"{getattr(completion_mask, 'shape', type(completion_mask).__name__)}")
    if not isinstance(advantages, torch.Tensor) or not advantages.is_floating_point():
        raise TypeError("advantages must be a floating torch.Tensor")
    if advantages.shape == shape[:1]:
        advantages = advantages.unsqueeze(1)
    elif advantages.shape != shape:
        raise ValueError(f"advantages must have shape {(shape[0],)} or {tuple(shape)}, got "
                         f"{tuple(advantages.shape)}")
    valid = completion_mask != 0
    sp = group_size(sp_group)
    if weights is None:
        if sp > 1:
            raise ValueError("policy_loss with sp_group of size > 1 needs weights from "
                             "policy_loss_weights (a calibrated step over dp x sp): weights "
                             "from this call's slice alone would not be the global ones")
        weights = _local_weights(valid, opts, log_probs.dtype)
    elif not isinstance(weights, PolicyLossWeights):
        raise TypeError(f"weights must be PolicyLossWeights, got {type(weights).__name__}")
    for name, w in zip(PolicyLossWeights._fields, weights):
        if not isinstance(w, torch.Tensor) or w.shape != shape:
            raise ValueError(f"weights.{name} must have shape {tuple(shape)}, got "
                             f"{getattr(w, 'shape', None)}")

    zero = torch.zeros((), dtype=log_probs.dtype, device=log_probs.device)
    token_log_ratio = torch.where(valid, log_probs - old_log_probs, zero)
    log_ratio = token_log_ratio
    per_seq = _sequence_sums(token_log_ratio, valid, opts, sp_group)
    if opts.importance_sampling_level == "sequence":
        log_ratio = per_seq["log_ratio"] / per_seq["tokens"].clamp(min=1)
    ratio = torch.exp(log_ratio)  # [B, T] or [B, 1]
    phi = None
    if opts.loss_type == "cispo" and opts.cispo_two_sided:
        # verl's compute_policy_loss_cispo: the log-ratio clamped to [-20, 20] first.
        ratio = torch.exp(torch.clamp(log_ratio, -20.0, 20.0))
        capped = torch.clamp(ratio, 1 - opts.epsilon_low, 1 + opts.epsilon_high).detach()
        per_token = -capped * advantages * log_probs
    elif opts.loss_type == "cispo":
        capped = torch.clamp(ratio, max=opts.epsilon_high).detach()
        per_token = -capped * advantages * log_probs
    elif opts.loss_type == "sapo":
        temp = _where(advantages > 0, opts.sapo_temperature_pos, opts.sapo_temperature_neg,
                      ratio)
        per_token = -torch.sigmoid(temp * (ratio - 1)) * 4 / temp * advantages
    elif opts.loss_type == "vespo":
        phi = _vespo_weights(per_seq["clamped_log_ratio"], advantages, opts)
        per_token = -phi * advantages * log_probs
    else:
        clipped = torch.clamp(ratio, 1 - opts.epsilon_low, 1 + opts.epsilon_high)
        unclipped = ratio if opts.delta is None else torch.clamp(ratio, max=opts.delta)
        per_token = -torch.min(unclipped * advantages, clipped * advantages)
    kl = None
    if opts.beta > 0:
        kl = _kl(torch.where(valid, log_probs - ref_log_probs, zero), opts.kl_estimator)
        per_token = per_token + opts.beta * kl
    per_token = torch.where(valid, per_token.expand(shape), zero)
    loss = (per_token * weights.loss_weights.to(per_token.dtype)).sum()
    if opts.entropy_coef != 0:
        h = torch.where(valid, entropy, zero)
        loss = loss - opts.entropy_coef * (h * weights.entropy_weights.to(h.dtype)).sum()
    # which rows a per-sequence metric counts: this call's rows, or under SP the rows with a
    # completion token on any SP rank, counted by SP rank 0 alone (each sequence once)
    # (a token-level ratio of a one-token slice is still counted per token)
    seq_rows = None
    if sp > 1 and opts.importance_sampling_level != "sequence" and opts.loss_type != "vespo":
        seq_rows = valid
    elif sp > 1:
        seq_rows = per_seq["tokens"] > 0
        if opts.count_empty_rows:
            seq_rows = torch.ones_like(seq_rows)
        if group_rank(sp_group) != 0:
            seq_rows = torch.zeros_like(seq_rows)
    stats = _stats(valid, ratio, advantages, kl, entropy, opts, phi, seq_rows)
    return PolicyLossOutput(loss, stats) if return_stats else loss


def _sequence_sums(token_log_ratio: torch.Tensor, valid: torch.Tensor, opts: PolicyLossOptions,
                   sp_group: GroupLike) -> Dict[str, torch.Tensor]:
    """The per-sequence ``[B, 1]`` sums a ``loss_type`` needs: ``log_ratio`` (GSPO's, with
    gradient), ``clamped_log_ratio`` (VESPO's, detached) and ``tokens`` (completion lengths),
    over the whole sequence: under SP (``sp_group`` of size > 1) this rank's slice sums added
    over the group in ONE autograd all-reduce
    (:func:`~megaloss.parallel.mappings.all_reduce_sum_autograd`: SUM forward and backward, so
    each slice's gradient collects every rank's loss)."""
    sequence = opts.importance_sampling_level == "sequence"
    vespo = opts.loss_type == "vespo"
    names, cols = ["tokens"], [valid.sum(-1).to(token_log_ratio.dtype)]
    if sequence:
        names.append("log_ratio")
        cols.append(token_log_ratio.sum(-1))
    if vespo:
        names.append("clamped_log_ratio")
        cols.append(torch.clamp(token_log_ratio.detach(), -20.0, 20.0).sum(-1))
    if group_size(sp_group) > 1 and (sequence or vespo):
        sums = all_reduce_sum_autograd(torch.stack(cols), sp_group)
        cols = list(sums.unbind(0))
    return {n: c.unsqueeze(-1) for n, c in zip(names, cols)}


def _where(cond: torch.Tensor, a: float, b: float, like: torch.Tensor) -> torch.Tensor:
    """``a`` where ``cond`` else ``b``, in ``like``'s dtype (Python floats given to torch.where
    would be rounded to torch's default dtype first)."""
    def full(v):
        return torch.full((), v, dtype=like.dtype, device=like.device)
    return torch.where(cond, full(a), full(b))


def _kl(x: torch.Tensor, estimator: str) -> torch.Tensor:
    """The per-token KL estimate of ``x = logp - ref`` (verl's ``kl_penalty`` /
    ``kl_penalty_forward``, ``verl/trainer/ppo/core_algos.py``; ``"k3"`` is TRL's, unclamped)."""
    base = estimator[:-1] if estimator.endswith("+") else estimator
    if base == "k1":
        value = x
    elif base == "abs":
        value = x.abs()
    elif base == "k2":
        value = 0.5 * x.square()
    elif base == "k3":
        d = -x
        value = torch.exp(d) - d - 1
    else:  # low_var_kl
        d = torch.clamp(-x, -20.0, 20.0)
        value = torch.clamp(torch.exp(d) - d - 1, -10.0, 10.0)
    if base == estimator:
        return value
    # straight-through: the value of the estimator, the gradient of k2 (unbiased gradient)
    grad_form = 0.5 * x.square()
    return grad_form - grad_form.detach() + value.detach()


@torch.no_grad()
def _vespo_weights(clamped_log_ratio: torch.Tensor, advantages: torch.Tensor,
                   opts: PolicyLossOptions) -> torch.Tensor:
    """VESPO's detached Gamma weight ``phi(w) = exp(lambda + k log w - lambda w)`` of the
    sequence ratio ``w = exp(sum_t clamp(log_ratio_t, -20, 20))`` (``log w`` clamped to
    ``[log 1e-8, 20]``), as TRL 1.16's ``GRPOTrainer.get_gamma_weights``; ``[B, 1]`` (or the
    advantages' ``[B, T]``). ``clamped_log_ratio``: the ``[B, 1]`` sum of the clamped token
    log-ratios over the whole sequence."""
    log_w = torch.clamp(clamped_log_ratio, math.log(1e-8), 20.0)
    nonneg = advantages >= 0
    k = _where(nonneg, opts.vespo_k_pos, opts.vespo_k_neg, log_w)
    lam = _where(nonneg, opts.vespo_lambda_pos, opts.vespo_lambda_neg, log_w).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def _local_weights(valid: torch.Tensor, opts: PolicyLossOptions,
                   dtype: torch.dtype) -> PolicyLossWeights:
    wdtype = torch.float64 if dtype == torch.float64 else torch.float32
    labels = completion_labels(valid)
    lw = compute_loss_weights([labels], _reduction(opts),
                              group=SINGLE_RANK, dtype=wdtype,
                              count_empty_samples=opts.count_empty_rows)
    return _weights(valid, lw.weights[0], lw.num_tokens, lw.num_samples, opts, wdtype)


@torch.no_grad()
def _stats(valid, ratio, advantages, kl, entropy, opts, phi=None, seq_rows=None) -> torch.Tensor:
    f64 = torch.float64
    stats = torch.zeros(_NUM_STATS, dtype=f64, device=valid.device)
    mask = valid.to(f64)
    stats[_TOKENS] = mask.sum()
    if kl is not None:
        stats[_KL] = (kl.to(f64) * mask).sum()
    if entropy is not None:
        stats[_ENT] = torch.where(valid, entropy.detach().to(f64), 0.0).sum()
    if phi is not None:  # vespo: the mean Gamma weight, one value per sequence (as TRL)
        ratio = phi
    ratio, adv = torch.broadcast_tensors(ratio.detach(), advantages.detach())
    # TRL's clip metrics: one value per sequence when ratio and advantages are per sequence
    # (GSPO; TRL counts every row there, as count_empty_rows does), else per completion token.
    if ratio.shape[1] != 1:
        counted = valid
    elif seq_rows is not None:  # under SP: decided over the whole sequence (policy_loss)
        counted = seq_rows
    elif opts.count_empty_rows:
        counted = torch.ones_like(valid[:, :1])
    else:
        counted = valid.any(-1, keepdim=True)
    stats[_CLIP_COUNT] = counted.sum()
    if opts.loss_type == "vespo":
        stats[_CISPO] = torch.where(counted, ratio.to(f64), 0.0).sum()
    elif opts.loss_type == "cispo" and opts.cispo_two_sided:  # verl's pg_clipfrac
        outside = (ratio < 1 - opts.epsilon_low) | (ratio > 1 + opts.epsilon_high)
        stats[_CISPO] = (outside & counted).sum()
    elif opts.loss_type == "cispo":
        stats[_CISPO] = ((ratio > opts.epsilon_high) & (adv > 0) & counted).sum()
    elif opts.loss_type != "sapo":
        low = (ratio < 1 - opts.epsilon_low) & (adv < 0) & counted
        high = (ratio > 1 + opts.epsilon_high) & (adv > 0) & counted
        stats[_LOW], stats[_HIGH], stats[_REGION] = low.sum(), high.sum(), (low | high).sum()
    return stats


def policy_metrics(stats: Union[torch.Tensor, Sequence[torch.Tensor]],
                   options: PolicyLossOptions, *, group: GroupLike = None,
                   has_entropy: bool = True) -> Dict[str, float]:
    """The step's metrics under TRL's names, reduced over ``group`` (ONE all-reduce; every rank
    of the group must call it, also without completions), identical on all its ranks.

    Args:
        stats: :attr:`PolicyLossOutput.stats` of this rank's micro-batches (one tensor or a
            list, summed here).
        options: the loss's options (which metrics exist).
        group: the ``dp x sp`` group (``Topology.dp_sp_group``); ``None``: torch's default
            group; :data:`~megaloss.parallel.SINGLE_RANK` for one process.
        has_entropy: whether the entropy was passed (the ``entropy`` metric).

    Returns:
        ``{"kl" (beta > 0), "entropy" (has_entropy), "clip_ratio/low_mean",
        "clip_ratio/high_mean", "clip_ratio/region_mean" (PPO types) | "cispo_clip_ratio" |
        "vespo/phi_seq_mean"}`` (none of the last for ``sapo``);
        0.0 for a mean over nothing.
    """
    if isinstance(stats, torch.Tensor):
        stats = [stats]
    stats = list(stats)
    if not stats or any(s.shape != (_NUM_STATS,) for s in stats):
        raise ValueError(f"stats must be one or more PolicyLossOutput.stats tensors "
                         f"[{_NUM_STATS}]")
    total = all_reduce_sum_(torch.stack(stats).sum(0).to(torch.float64), group).tolist()

    def mean(i: int, count: int) -> float:
        return total[i] / total[count] if total[count] > 0 else 0.0

    out: Dict[str, float] = {}
    if options.beta > 0:
        out["kl"] = mean(_KL, _TOKENS)
    if has_entropy:
        out["entropy"] = mean(_ENT, _TOKENS)
    if options.loss_type == "cispo":
        out["cispo_clip_ratio"] = mean(_CISPO, _CLIP_COUNT)
    elif options.loss_type == "vespo":
        out["vespo/phi_seq_mean"] = mean(_CISPO, _CLIP_COUNT)
    elif options.loss_type != "sapo":
        out["clip_ratio/low_mean"] = mean(_LOW, _CLIP_COUNT)
        out["clip_ratio/high_mean"] = mean(_HIGH, _CLIP_COUNT)
        out["clip_ratio/region_mean"] = mean(_REGION, _CLIP_COUNT)
    return out

