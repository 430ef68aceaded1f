"""Calibrated optimizer steps of the policy-gradient (:func:`megaloss.policy_loss`) and
preference (:func:`megaloss.dpo_loss`) losses on a :class:`~.engine.MegalossEngine`.

The module's contract: ``engine(input_ids, shift_labels=labels, **inputs)`` returns an object
with ``log_probs`` (shape of ``labels`` or flattened; e.g. a
:class:`megaloss.LogProbsOutput` of :func:`megaloss.linear_log_probs` on the decoder's hidden
states) and, for the entropy bonus or metric, ``entropy`` (same shape, or ``None``). ``labels``
are the shifted targets, ``ignore_index`` off the completion.

One step over the ``G`` micro-batches (``G`` = the ds_config's ``gradient_accumulation_steps``):
their checks are agreed on by every rank (:mod:`.step_checks`: a failure flag all-gathered
over ``dp x sp`` and TP, so a bad micro-batch raises on all ranks, not on its own only), then
the completion masks of all of them are calibrated up front (ONE all-reduce over ``dp x sp``:
global tokens, sequences and the ``loss_type``'s denominator), then each micro-batch runs
forward, ``engine.backward(step.loss_for_backward(loss))`` (undoing the engine's measured
``1 / (G x DP)``) and ``engine.step()``; at the boundary the global loss and the metrics (TRL's
names) are reduced (two all-reduces) and written through ``engine.monitor`` like the CE series
(``Train/megaloss/<name>``). The result equals one device's step on the global batch for every
``loss_type``, ZeRO stage, DP x GAS and TP (tested in
``tests/integrations/test_deepspeed_policy.py``), and, for :func:`policy_train_step`, DP x SP
under DeepSpeed-Ulysses (``tests/integrations/test_post_training_sp.py``).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

import torch

from ...calibration import LossCalibrator
from ...calibration.weights import split_for_sequence_parallel
from ...losses.dpo import dpo_loss, dpo_metrics, dpo_pair_weights, sequence_log_probs
from ...losses.policy import (
    completion_labels,
    policy_calibrator,
    policy_loss,
    policy_loss_weights,
    policy_metrics,
)
from ...ops.labels import causal_shift
from ...ops.options import DPOOptions, PolicyLossOptions
from .engine import MegalossEngine
from .monitor import write_metrics
from .step_checks import (
    agreed_checks,
    agreed_forward,
    check_count,
    check_dpo_micro_batch,
    check_policy_micro_batch,
)
from .train_step import batch_to_device, peak_memory_mib, reduced_grad_norm

__all__ = ["PolicyStepMetrics", "policy_train_step", "dpo_train_step"]


@dataclass
class PolicyStepMetrics:
    """Metrics of one policy / preference optimizer step (identical on all ranks except
    ``peak_memory_mib``).

    ``loss``: the global loss (what one device computes on the whole global batch);
    ``num_tokens``: global completion tokens; ``num_sequences``: global sequences (policy) or
    pairs (DPO) with at least one completion token (every row, for a policy loss with
    ``count_empty_rows=True``); ``metrics``: TRL's names
    (:func:`megaloss.policy_metrics` / :func:`megaloss.dpo_metrics`), global over the step.
    """

    step: int
    loss: float
    num_tokens: float
    num_sequences: float
    lr: float
    grad_norm: Optional[float]
    peak_memory_mib: float
    step_time_s: float
    samples: int = 0
    metrics: Dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> Dict[str, Any]:
        """Flat ``{name: value}``: the fields, then the metrics by TRL's names."""
        d = asdict(self)
        d.update(d.pop("metrics"))
        return d


def _check_micro_batches(me: MegalossEngine, micro_batches: Sequence[Mapping[str, Any]],
                         keys: Sequence[str], check_one: Callable[[int, Mapping[str, Any]], None],
                         *, sequence_parallel: bool = False) -> int:
    """The step's micro-batch checks, agreed on by every rank before its first collective
    (:mod:`.step_checks`: the same error everywhere, naming the failed ranks).
    ``sequence_parallel``: whether the step supports ``sp > 1``."""
    gas = int(me.engine.gradient_accumulation_steps())
    sp = me.topology.sp_size

    def checks() -> None:
        check_count(micro_batches, gas)
        if sp != 1 and not sequence_parallel:
            raise ValueError("dpo_train_step does not support sequence parallelism "
                             f"(sp={sp}): its sequence log-probs would span SP ranks")
        for i, mb in enumerate(micro_batches):
            missing = [k for k in keys if mb.get(k) is None]
            if missing:
                raise ValueError(f"micro_batches[{i}] lacks {', '.join(missing)}")
            check_one(i, mb)
            mask = mb.get("attention_mask")
            if sp != 1 and mask is not None and not bool((mask != 0).all()):
                raise ValueError(
                    f"micro_batches[{i}]['attention_mask'] masks tokens, which sequence "
                    f"parallelism (sp={sp}) cannot honour: Ulysses attends causally over the "
                    "gathered sequence; right-pad the rows instead (padding after the "
                    "completion is never attended to by a completion token)")

    agreed_checks(checks, me.topology)
    return gas


def _targets(mb: Mapping[str, Any], ignore_index: int) -> torch.Tensor:
    mask = mb["completion_mask"]  # its shape checked up front (_check_micro_batches)
    shifted = causal_shift(mb["input_ids"], ignore_index)
    return torch.where(mask != 0, shifted, torch.full_like(shifted, ignore_index))


def _sp_slices(me: MegalossEngine, mb: Mapping[str, Any], labels: torch.Tensor
               ) -> Tuple[Dict[str, Any], torch.Tensor]:
    """This SP rank's view of a policy micro-batch: its contiguous slice of every ``[B, T]``
    tensor (cut and right-padded as the calibration cuts the labels:
    :func:`megaloss.calibration.split_for_sequence_parallel`; the mask, log-probs and ``[B, T]``
    advantages padded with 0, the labels with ``ignore_index``), the *global* ``position_ids``
    Ulysses needs (``arange`` when not given), no attention mask (all ones, checked: Ulysses
    attends causally over the gathered sequence); ``advantages [B]`` as given. With ``sp = 1``
    the micro-batch and labels as given."""
    topo = me.topology
    if topo.sp_size == 1:
        return dict(mb), labels
    sp, rank = topo.sp_size, topo.sp_rank
    ids = mb["input_ids"]
    out = {k: v for k, v in mb.items() if k != "attention_mask"}
    if mb.get("position_ids") is None:
        out["position_ids"] = torch.arange(ids.shape[-1], device=ids.device).expand_as(ids)
    for k in ("input_ids", "position_ids", "completion_mask", "old_log_probs", "ref_log_probs",
              "advantages"):
        v = out.get(k)
        if v is not None and v.dim() == 2:
            out[k] = split_for_sequence_parallel(v, rank, sp, 0)
    return out, split_for_sequence_parallel(labels, rank, sp, me.calibrator.ignore_index)


def _forward(me: MegalossEngine, mb: Mapping[str, Any], labels: torch.Tensor):
    inputs = {k: mb[k] for k in ("attention_mask", "position_ids") if mb.get(k) is not None}
    out = agreed_forward(me.topology, me.engine, mb["input_ids"], shift_labels=labels, **inputs)
    entropy = getattr(out, "entropy", None)
    return (out.log_probs.reshape(labels.shape),
            None if entropy is None else entropy.reshape(labels.shape))


def _finish(me: MegalossEngine, step, t0: float, own_norm, num_sequences: float,
            metrics: Dict[str, float], log: bool) -> PolicyStepMetrics:
    engine = me.engine
    loss = float(step.global_loss())
    grad_norm = engine.get_global_grad_norm()
    if grad_norm is None:
        grad_norm = own_norm
    out = PolicyStepMetrics(
        step=int(engine.global_steps), loss=loss, num_tokens=float(step.num_tokens),
        num_sequences=num_sequences, lr=float(engine.get_lr()[0]),
        grad_norm=None if grad_norm is None else float(grad_norm),
        peak_memory_mib=peak_memory_mib(engine.device), step_time_s=time.perf_counter() - t0,
        samples=int(getattr(engine, "global_samples", 0)), metrics=metrics)
    if log:
        d = out.as_dict()
        d["optimizer_step"] = d.pop("step")
        d.pop("samples")
        write_metrics(engine, d)
    return out


def policy_train_step(me: MegalossEngine, micro_batches: Sequence[Mapping[str, Any]], *,
                      options: Optional[PolicyLossOptions] = None,
                      log: bool = True) -> PolicyStepMetrics:
    """One calibrated optimizer step of :func:`megaloss.policy_loss`.

    Args:
        me: from :func:`~.engine.initialize` (its module follows this module's contract).
        micro_batches: ``gradient_accumulation_steps`` dicts with ``input_ids [B, T]``,
            ``completion_mask [B, T]`` (1 where the *next* token is a completion token, aligned
            with the shifted targets), ``advantages [B]`` or ``[B, T]``; optional
            ``old_log_probs [B, T]`` (default: the current log-probs, detached),
            ``ref_log_probs [B, T]`` (required when ``beta > 0``), ``attention_mask``,
            ``position_ids``. TP ranks of one DP rank pass the same batches; a rank may have
            no completion at all (an all-zero mask). Under sequence parallelism (``sp > 1``,
            the module's attention routed through
            :func:`megaloss.integrations.hf.ulysses.enable_ulysses_attention`) every SP rank of
            a DP rank passes the same *full* micro-batches; each forwards its contiguous slice
            of the tokens (:func:`megaloss.calibration.split_for_sequence_parallel`, global
            ``position_ids``), the sequence-level sums are added over the SP group
            (``policy_loss(..., sp_group=...)``) and each sequence counts once; an
            ``attention_mask`` must then be all ones (right padding).
        options: default ``me.config.policy.options()`` (the ds_config's
            ``"megaloss": {"policy": {...}}``); its ``count_empty_rows`` decides whether rows
            without a completion token count as sequences (the calibration's
            ``count_empty_samples``, via :func:`megaloss.policy_calibrator`).
        log: write the loss and metrics through ``engine.monitor``.

    Returns:
        :class:`PolicyStepMetrics` (``metrics``: ``kl``, ``entropy``, ``clip_ratio/*`` or
        ``cispo_clip_ratio``).

    Raises:
        ValueError: a wrong number of micro-batches, a missing key, a mask of another shape
            than ``input_ids``, ``advantages`` / ``old_log_probs`` / ``ref_log_probs`` of a
            wrong shape, no ``ref_log_probs`` with ``beta > 0``, an ``attention_mask`` with
            zeros under sequence parallelism; see
            :func:`megaloss.policy_loss`. The micro-batch checks are agreed on by every rank
            before the step's first collective (:mod:`.step_checks`): the same error on every
            rank, naming the failed ranks.
        TypeError: non-integer ``input_ids``, non-floating ``advantages`` or log-probs (agreed
            on likewise); ``options`` not a ``PolicyLossOptions``.
    """
    opts = me.config.policy.options() if options is None else options
    if not isinstance(opts, PolicyLossOptions):
        raise TypeError(f"options must be a PolicyLossOptions, got {type(opts).__name__}")
    gas = _check_micro_batches(me, micro_batches, ("input_ids", "completion_mask", "advantages"),
                               partial(check_policy_micro_batch, beta=opts.beta),
                               sequence_parallel=True)
    t0 = time.perf_counter()
    engine = me.engine
    mbs = [batch_to_device(mb, engine.device) for mb in micro_batches]
    ignore = me.calibrator.ignore_index
    calib = policy_calibrator(opts, me.topology, engine_scale=me.engine_scale,
                              weight_dtype=me.calibrator.weight_dtype)
    step = calib.begin_step([completion_labels(mb["completion_mask"], ignore) for mb in mbs])
    stats, has_entropy, own_norm = [], True, None
    for i, full in enumerate(mbs):
        mb, labels = _sp_slices(me, full, _targets(full, ignore))
        log_probs, entropy = _forward(me, mb, labels)
        has_entropy = has_entropy and entropy is not None
        out = policy_loss(log_probs, mb.get("old_log_probs"), mb["advantages"],
                          mb["completion_mask"], ref_log_probs=mb.get("ref_log_probs"),
                          entropy=entropy,
                          weights=policy_loss_weights(step, i, opts, ignore_index=ignore),
                          options=opts, return_stats=True, sp_group=me.topology.sp_group)
        engine.backward(step.loss_for_backward(out.loss))
        stats.append(out.stats)
        if i == gas - 1 and engine.zero_optimization_stage() == 0:
            own_norm = reduced_grad_norm(engine.module, me.topology)
        engine.step()
    metrics = policy_metrics(stats, opts, group=me.topology.dp_sp_group, has_entropy=has_entropy)
    return _finish(me, step, t0, own_norm, float(step.num_samples), metrics, log)


def dpo_train_step(me: MegalossEngine, micro_batches: Sequence[Mapping[str, Any]], *,
                   options: Optional[DPOOptions] = None, log: bool = True) -> PolicyStepMetrics:
    """One calibrated optimizer step of :func:`megaloss.dpo_loss`.

    Args:
        me: from :func:`~.engine.initialize` (its module follows this module's contract).
        micro_batches: ``gradient_accumulation_steps`` dicts with ``input_ids [2P, T]`` (the
            ``P`` chosen rows, then their ``P`` rejected rows: TRL's layout),
            ``completion_mask [2P, T]`` (aligned with the shifted targets),
            ``ref_chosen_log_probs [P]`` and ``ref_rejected_log_probs [P]`` (sequence sums
            under the reference); optional ``attention_mask``, ``position_ids``.
        options: default ``me.config.dpo.options()``.
        log: write the loss and metrics through ``engine.monitor``.

    Returns:
        :class:`PolicyStepMetrics` (``metrics``: ``rewards/*``, ``logps/*``;
        ``num_sequences``: global pairs).

    Raises:
        ValueError / TypeError: as :func:`policy_train_step`; an odd number of rows; reference
            log-probs not floating ``[P]`` (agreed on by every rank likewise); sequence
            parallelism (``sp > 1``: a pair's sequence log-probs would span SP ranks).
    """
    opts = me.config.dpo.options() if options is None else options
    if not isinstance(opts, DPOOptions):
        raise TypeError(f"options must be a DPOOptions, got {type(opts).__name__}")
    gas = _check_micro_batches(me, micro_batches, ("input_ids", "completion_mask",
                                                   "ref_chosen_log_probs",
                                                   "ref_rejected_log_probs"),
                               check_dpo_micro_batch)
    t0 = time.perf_counter()
    engine = me.engine
    mbs = [batch_to_device(mb, engine.device) for mb in micro_batches]
    ignore = me.calibrator.ignore_index
    calib = LossCalibrator(me.topology, loss_reduction="sample", engine_scale=me.engine_scale,
                           ignore_index=ignore, weight_dtype=me.calibrator.weight_dtype)
    chosen = [completion_labels(mb["completion_mask"][: mb["input_ids"].shape[0] // 2], ignore)
              for mb in mbs]
    step = calib.begin_step(chosen)
    stats, own_norm = [], None
    for i, mb in enumerate(mbs):
        labels = _targets(mb, ignore)
        log_probs, _ = _forward(me, mb, labels)
        mask = mb["completion_mask"]
        p = labels.shape[0] // 2
        seq = sequence_log_probs(log_probs, mask)
        lengths = (mask != 0).sum(-1)
        out = dpo_loss(seq[:p], seq[p:], mb["ref_chosen_log_probs"],
                       mb["ref_rejected_log_probs"], chosen_lengths=lengths[:p],
                       rejected_lengths=lengths[p:],
                       pair_weights=dpo_pair_weights(step, i, ignore_index=ignore), options=opts,
                       return_stats=True)
        engine.backward(step.loss_for_backward(out.loss))
        stats.append(out.stats)
        if i == gas - 1 and engine.zero_optimization_stage() == 0:
            own_norm = reduced_grad_norm(engine.module, me.topology)
        engine.step()
    metrics = dpo_metrics(stats, group=me.topology.dp_sp_group)
    return _finish(me, step, t0, own_norm, float(step.num_samples), metrics, log)
