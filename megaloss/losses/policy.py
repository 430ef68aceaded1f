"""Policy-gradient losses of the GRPO family (``grpo``, ``bnpo``, ``dapo``, ``dr_grpo``) and
CISPO on per-token log-probs, normalised over the *global* batch of an optimizer step.

Math, per completion token ``t`` of sequence ``s`` (TRL 1.16, ``trl/trainer/grpo_trainer.py``,
``GRPOTrainer._compute_loss``, reproduced term by term)::

    log_ratio  = logp_t - old_logp_t
    ratio      = exp(log_ratio)                       (importance_sampling_level="token")
               = exp(mean_{t in s} log_ratio)         ("sequence": GSPO, arXiv:2507.18071)
    PPO:   l_t = -min(min(ratio, delta) * A_s, clamp(ratio, 1 - eps_low, 1 + eps_high) * A_s)
    CISPO: l_t = -stopgrad(min(ratio, eps_high)) * A_s * logp_t
    KL:    l_t += beta * (exp(ref_t - logp_t) - (ref_t - logp_t) - 1)     (k3 estimator)

    loss = sum_t w_t * l_t  -  entropy_coef * sum_t h_t * H_t

with the loss weights ``w_t`` of the ``loss_type`` and the entropy weights ``h_t = 1 / N_tokens``,
both over the completion tokens of every micro-batch of every DP / SP rank of the step:

=========== ============================================== ===================================
loss_type   ``w_t``                                        megaloss calibration
=========== ============================================== ===================================
grpo        ``1 / (n_s * N_sequences)``                    ``loss_reduction="sample"``
bnpo, dapo  ``1 / N_tokens``                               ``loss_reduction="token"``
cispo       ``1 / N_tokens``                               ``loss_reduction="token"``
dr_grpo     ``1 / (N_sequences * max_completion_length)``  the step's global sequence count
=========== ============================================== ===================================

(``n_s``: completion tokens of sequence ``s``; a sequence is a row with at least one completion
token, so padding rows, all-padding micro-batches and ranks without completions count nothing.)
The weights come from one :class:`~megaloss.calibration.LossCalibrator` step (ONE all-reduce of
three numbers for the whole optimizer step), so ``sum over ranks and micro-batches of loss`` is
the loss one device computes on the whole global batch, and backwarding
``step.loss_for_backward(loss)`` through any engine gives that device's gradient.

What differs from TRL, and why: TRL normalises ``grpo``, ``bnpo`` and ``dr_grpo`` per micro-batch
and per process (then divides by the accumulation steps), so the gradient depends on how the
batch is split over ranks and accumulation steps whenever completion lengths differ; only its
``dapo`` / ``cispo`` use a global token count. megaloss normalises every ``loss_type`` over the
global batch, so one optimizer step equals the single-device step for every layout; on one
micro-batch on one process the two agree exactly. ``bnpo`` and ``dapo`` are therefore the same
loss here (both names kept, as TRL spells them). The entropy bonus is the global token mean of the
entropy (TRL: the micro-batch mean over the accumulation steps).

Metrics (TRL's names, :func:`policy_metrics`): ``kl`` and ``entropy`` are global token means,
``clip_ratio/low_mean``, ``clip_ratio/high_mean``, ``clip_ratio/region_mean`` (PPO types) and
``cispo_clip_ratio`` global means over tokens (over sequences with
``importance_sampling_level="sequence"``), over the whole step (TRL: per micro-batch).
"""
from __future__ import annotations

from typing import Dict, NamedTuple, Optional, Sequence, Union

import torch

from ..calibration.calibrator import LossCalibrator, StepCalibration
from ..calibration.engine_scale import EngineScale
from ..calibration.weights import compute_loss_weights
from ..ops.options import PolicyLossOptions, resolve_options
from ..parallel.comm import all_reduce_sum_
from ..parallel.groups import SINGLE_RANK, GroupLike
from ..parallel.topology import Topology

__all__ = ["PolicyLossOptions", "PolicyLossOutput", "PolicyLossWeights", "policy_loss",
           "policy_loss_weights", "policy_loss_reduction", "policy_calibrator",
           "completion_labels", "policy_metrics", "POLICY_METRICS"]

POLICY_METRICS = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean",
                  "clip_ratio/region_mean", "cispo_clip_ratio")
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


def policy_loss_reduction(loss_type: str) -> str:
    """The :class:`~megaloss.calibration.LossCalibrator` ``loss_reduction`` a ``loss_type``'s
    weights come from: ``"sample"`` for ``grpo``, ``"token"`` otherwise (``dr_grpo`` uses only
    the step's sequence count, which every reduction provides).

    Raises:
        ValueError: unknown ``loss_type``.
    """
    PolicyLossOptions(loss_type=loss_type, max_completion_length=1)  # validates the name
    return "sample" if loss_type == "grpo" else "token"


def policy_calibrator(options: PolicyLossOptions, topology: Optional[Topology] = None, *,
                      engine_scale: Optional[EngineScale] = None,
                      weight_dtype: torch.dtype = torch.float32) -> LossCalibrator:
    """The :class:`~megaloss.calibration.LossCalibrator` of a policy loss: its
    ``begin_step(completion_labels(mask) per micro-batch)`` is the one all-reduce of the step,
    and :func:`policy_loss_weights` reads the weights from the step.

    Raises:
        TypeError: ``options`` is not a :class:`PolicyLossOptions`; see
            :class:`~megaloss.calibration.LossCalibrator` for the rest.
    """
    if not isinstance(options, PolicyLossOptions):
        raise TypeError(f"options must be a PolicyLossOptions, got {type(options).__name__}")
    return LossCalibrator(topology, loss_reduction=policy_loss_reduction(options.loss_type),
                          engine_scale=engine_scale, weight_dtype=weight_dtype)


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
    entropy_w = (mask / tokens).to(dtype)
    if options.loss_type == "dr_grpo":
        seqs = torch.where(num_samples > 0, num_samples, torch.ones_like(num_samples))
        loss_w = (mask / (seqs * options.max_completion_length)).to(dtype)
    else:
        loss_w = step_weights.to(dtype)
    return PolicyLossWeights(loss_w, entropy_w)


def policy_loss_weights(step: StepCalibration, i: int, options: PolicyLossOptions, *,
                        ignore_index: int = -100) -> PolicyLossWeights:
    """The weights of micro-batch ``i`` of a calibrated step (no collective).

    Args:
        step: from ``policy_calibrator(options, ...).begin_step([completion_labels(m) for m in
            masks])`` (a :class:`~megaloss.calibration.LossCalibrator` whose
            ``loss_reduction`` is :func:`policy_loss_reduction` of the ``loss_type``).
        i: the micro-batch.
        options: the loss's :class:`PolicyLossOptions`.
        ignore_index: the label of non-completion tokens in the step's labels.

    Returns:
        :class:`PolicyLossWeights` shaped like ``step.local_labels(i)``, in the calibrator's
        weight dtype.

    Raises:
        ValueError: ``importance_sampling_level="sequence"`` with sequence parallelism (a
            sequence's mean log-ratio needs its whole completion on one rank).
        TypeError: ``options`` is not a :class:`PolicyLossOptions`.
        IndexError: ``i`` out of range.
    """
    if not isinstance(options, PolicyLossOptions):
        raise TypeError(f"options must be a PolicyLossOptions, got {type(options).__name__}")
    if options.importance_sampling_level == "sequence" and step._topology.sp_size > 1:
        raise ValueError("importance_sampling_level='sequence' is not supported with sequence "
                         "parallelism (sp > 1): the sequence's mean log-ratio spans SP ranks")
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
            fields of :class:`~megaloss.ops.options.PolicyLossOptions`, documented there.
        return_stats: return a :class:`PolicyLossOutput` (the loss and the local sums
            :func:`policy_metrics` reads) instead of the loss alone.
        options: these fields as one :class:`PolicyLossOptions` instead of the keywords.

    Returns:
        The loss ``sum w*l - entropy_coef * sum h*H`` (differentiable scalar), or with
        ``return_stats=True`` a :class:`PolicyLossOutput` holding it.

    Raises:
        ValueError: shape mismatches; ``ref_log_probs`` missing with ``beta > 0``; ``entropy``
            missing with ``entropy_coef != 0``; an option out of range.
        TypeError: non-floating log-probs / advantages; ``options`` of the wrong type or
            together with option keywords.
    """
    opts = resolve_options(PolicyLossOptions, options, dict(
        loss_type=loss_type, epsilon_low=epsilon_low, epsilon_high=epsilon_high, delta=delta,
        beta=beta, entropy_coef=entropy_coef, importance_sampling_level=importance_sampling_level,
        max_completion_length=max_completion_length))
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
    if weights is None:
        weights = _local_weights(valid, opts, log_probs.dtype)
    elif not isinstance(weights, PolicyLossWeights):
        raise TypeError(f"weights must be PolicyLossWeights, got {type(weights).__name__}")
    for name, w in zip(PolicyLossWeights._fields, weights):
        if not isinstance(w, torch.Tensor) or w.shape != shape:
            raise ValueError(f"weights.{name} must have shape {tuple(shape)}, got "
                             f"{getattr(w, 'shape', None)}")

    zero = torch.zeros((), dtype=log_probs.dtype, device=log_probs.device)
    log_ratio = torch.where(valid, log_probs - old_log_probs, zero)
    n_seq_tokens = valid.sum(-1, keepdim=True)
    if opts.importance_sampling_level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True) / n_seq_tokens.clamp(min=1)
    ratio = torch.exp(log_ratio)  # [B, T] or [B, 1]
    if opts.loss_type == "cispo":
        capped = torch.clamp(ratio, max=opts.epsilon_high).detach()
        per_token = -capped * advantages * log_probs
    else:
        clipped = torch.clamp(ratio, 1 - opts.epsilon_low, 1 + opts.epsilon_high)
        unclipped = ratio if opts.delta is None else torch.clamp(ratio, max=opts.delta)
        per_token = -torch.min(unclipped * advantages, clipped * advantages)
    kl = None
    if opts.beta > 0:
        d = torch.where(valid, ref_log_probs - log_probs, zero)
        kl = torch.exp(d) - d - 1
        per_token = per_token + opts.beta * kl
    per_token = torch.where(valid, per_token.expand(shape), zero)
    loss = (per_token * weights.loss_weights.to(per_token.dtype)).sum()
    if opts.entropy_coef != 0:
        h = torch.where(valid, entropy, zero)
        loss = loss - opts.entropy_coef * (h * weights.entropy_weights.to(h.dtype)).sum()
    stats = _stats(valid, ratio, advantages, kl, entropy, opts)
    return PolicyLossOutput(loss, stats) if return_stats else loss


def _local_weights(valid: torch.Tensor, opts: PolicyLossOptions,
                   dtype: torch.dtype) -> PolicyLossWeights:
    wdtype = torch.float64 if dtype == torch.float64 else torch.float32
    labels = completion_labels(valid)
    lw = compute_loss_weights([labels], policy_loss_reduction(opts.loss_type),
                              group=SINGLE_RANK, dtype=wdtype)
    return _weights(valid, lw.weights[0], lw.num_tokens, lw.num_samples, opts, wdtype)


@torch.no_grad()
def _stats(valid, ratio, advantages, kl, entropy, opts) -> torch.Tensor:
    f64 = torch.float64
    stats = torch.zeros(_NUM_STATS, dtype=f64, device=valid.device)
    mask = valid.to(f64)
    stats[_TOKENS] = mask.sum()
    if kl is not None:
        stats[_KL] = (kl.to(f64) * mask).sum()
    if entropy is not None:
        stats[_ENT] = torch.where(valid, entropy.detach().to(f64), 0.0).sum()
    ratio, adv = torch.broadcast_tensors(ratio.detach(), advantages.detach())
    # TRL's clip metrics: one value per sequence when ratio and advantages are per sequence
    # (GSPO), else per completion token.
    counted = valid.any(-1, keepdim=True) if ratio.shape[1] == 1 else valid
    stats[_CLIP_COUNT] = counted.sum()
    if opts.loss_type == "cispo":
        stats[_CISPO] = ((ratio > opts.epsilon_high) & (adv > 0) & counted).sum()
    else:
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
        "clip_ratio/high_mean", "clip_ratio/region_mean" (PPO types) | "cispo_clip_ratio"}``;
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
    else:
        out["clip_ratio/low_mean"] = mean(_LOW, _CLIP_COUNT)
        out["clip_ratio/high_mean"] = mean(_HIGH, _CLIP_COUNT)
        out["clip_ratio/region_mean"] = mean(_REGION, _CLIP_COUNT)
    return out

