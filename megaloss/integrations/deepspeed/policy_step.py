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
``tests/integrations/test_deepspeed_policy.py``), and DP x SP under DeepSpeed-Ulysses
(``tests/integrations/test_post_training_sp.py``).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

import torch

from ...calibration import LossCalibrator
from ...calibration.weights import split_for_sequence_parallel
from ...losses._preference import preference_weights
from ...losses.dpo import DPOOptions, dpo_metrics, sequence_log_probs
from ...losses.kto import kto_kl_baseline, kto_metrics
from ...losses.orpo import orpo_metrics
from ...losses.policy import (
    completion_labels,
    policy_calibrator,
    policy_loss,
    policy_loss_weights,
    policy_metrics,
)
from ...losses.policy_options import PolicyLossOptions
from ...losses.preference import (
    PreferenceOptions,
    preference_loss_kind,
    sequence_preference_loss,
)
from ...losses.simpo import cpo_metrics
from ...ops.labels import causal_shift
from .engine import MegalossEngine
from .monitor import write_metrics
from .step_checks import (
    agreed_checks,
    agreed_forward,
    check_count,
    check_policy_micro_batch,
    check_preference_micro_batch,
)
from .train_step import batch_to_device, peak_memory_mib, reduced_grad_norm

__all__ = ["PolicyStepMetrics", "policy_train_step", "dpo_train_step", "preference_train_step",
           "PreferenceOptions"]


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
                         keys: Sequence[str], check_one: Callable[[int, Mapping[str, Any]], None]
                         ) -> int:
    """The step's micro-batch checks, agreed on by every rank before its first collective
    (:mod:`.step_checks`: the same error everywhere, naming the failed ranks)."""
    gas = int(me.engine.gradient_accumulation_steps())
    sp = me.topology.sp_size

    def checks() -> None:
        check_count(micro_batches, gas)
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
                               partial(check_policy_micro_batch, beta=opts.beta))
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
    """One calibrated optimizer step of :func:`megaloss.dpo_loss`:
    :func:`preference_train_step` with DPO options only.

    Args:
        me: from :func:`~.engine.initialize` (its module follows this module's contract).
        micro_batches: ``gradient_accumulation_steps`` dicts with ``input_ids [2P, T]`` (the
            ``P`` chosen rows, then their ``P`` rejected rows: TRL's layout),
            ``completion_mask [2P, T]`` (aligned with the shifted targets),
            ``ref_chosen_log_probs [P]`` and ``ref_rejected_log_probs [P]`` (sequence sums
            under the reference, whole sequences); optional ``attention_mask``,
            ``position_ids``. Under sequence parallelism (``sp > 1``, the module's attention
            routed through :func:`megaloss.integrations.hf.ulysses.enable_ulysses_attention`)
            every SP rank of a DP rank passes the same *full* micro-batches, as for
            :func:`policy_train_step`: each forwards its contiguous slice of the tokens, the
            sequence log-probs and completion lengths are the slices' sums added over the SP
            group (``sequence_log_probs(..., sp_group=...)``: one autograd all-reduce per
            micro-batch), and each pair counts once (its weight on SP rank 0,
            :func:`megaloss.dpo_pair_weights`); a slice may hold no completion token. An
            ``attention_mask`` must then be all ones (right padding).
        options: default ``me.config.dpo.options()`` (the ds_config's
            ``"megaloss": {"dpo": {...}}``).
        log: write the loss and metrics through ``engine.monitor``.

    Returns:
        :class:`PolicyStepMetrics` (``metrics``: ``rewards/*``, ``logps/*``;
        ``num_tokens``: global chosen completion tokens; ``num_sequences``: global pairs with a
        chosen completion token).

    Raises:
        ValueError / TypeError: as :func:`policy_train_step`; an odd number of rows; reference
            log-probs not floating ``[P]`` (agreed on by every rank likewise); ``options`` not
            a ``DPOOptions`` (TypeError).
    """
    opts = me.config.dpo.options() if options is None else options
    if not isinstance(opts, DPOOptions):
        raise TypeError(f"options must be a DPOOptions, got {type(opts).__name__}")
    return preference_train_step(me, micro_batches, options=opts, log=log)


_PREFERENCE_KEYS = {"dpo": ("input_ids", "completion_mask", "ref_chosen_log_probs",
                            "ref_rejected_log_probs"),
                    "cpo": ("input_ids", "completion_mask"),
                    "orpo": ("input_ids", "completion_mask"),
                    "kto": ("input_ids", "completion_mask", "desirable", "ref_log_probs")}
_PREFERENCE_METRICS = {"dpo": dpo_metrics, "cpo": cpo_metrics, "orpo": orpo_metrics,
                       "kto": kto_metrics}


def _kto_baseline(me: MegalossEngine, mbs: Sequence[Mapping[str, Any]], ignore: int):
    """KTO's ``z0`` of the step (:func:`megaloss.losses.kto_kl_baseline`): the KL rows'
    sequence log-probs under the policy (``no_grad``, SP slices added over the SP group) against
    ``ref_kl_log_probs``; ``None`` when the micro-batches carry no KL rows."""
    if mbs[0].get("kl_input_ids") is None:
        return None
    pol, lengths = [], []
    with torch.no_grad():
        for full in mbs:
            rows = {"input_ids": full["kl_input_ids"],
                    "completion_mask": full["kl_completion_mask"]}
            mb, labels = _sp_slices(me, rows, _targets(rows, ignore))
            log_probs, _ = _forward(me, mb, labels)
            seq, n = sequence_log_probs(log_probs, mb["completion_mask"],
                                        sp_group=me.topology.sp_group, return_lengths=True)
            pol.append(seq)
            lengths.append(n)
    return kto_kl_baseline(pol, [mb["ref_kl_log_probs"] for mb in mbs], kl_lengths=lengths,
                           group=me.topology.dp_sp_group)


def preference_train_step(me: MegalossEngine, micro_batches: Sequence[Mapping[str, Any]], *,
                          options: Optional[PreferenceOptions] = None,
                          log: bool = True) -> PolicyStepMetrics:
    """One calibrated optimizer step of a preference loss on sequence log-probs, chosen by the
    type of ``options`` (:func:`megaloss.losses.sequence_preference_loss`):
    :class:`~megaloss.DPOOptions` -> :func:`megaloss.dpo_loss` (DPO, IPO and TRL's other pairwise
    types), :class:`~megaloss.losses.CPOOptions` -> :func:`megaloss.losses.cpo_loss` (CPO, and
    SimPO with ``loss_type="simpo"``),
    :class:`~megaloss.losses.ORPOOptions` -> :func:`megaloss.losses.orpo_loss`,
    :class:`~megaloss.losses.KTOOptions` -> :func:`megaloss.losses.kto_loss` (the math and its
    sources in those functions' modules: arXiv:2305.18290, 2401.08417, 2405.14734,
    2403.07691, 2402.01306).

    The step: the micro-batch checks agreed on by every rank; ONE all-reduce calibrating the
    step on the chosen completions' labels (KTO: every row's), whose counts give each pair
    ``1 / N_pairs`` and each NLL token ``1 / N_tokens`` of the whole step
    (:func:`megaloss.losses.preference_weights`); for KTO with KL rows, their forward under
    ``no_grad`` and one more all-reduce (the step's ``z0``,
    :func:`megaloss.losses.kto_kl_baseline`); per micro-batch forward, loss,
    ``engine.backward(step.loss_for_backward(loss))``,
    ``engine.step()``; the metrics (TRL's names) reduced and written through
    ``engine.monitor``. The result equals one device's step on the global batch for any
    DP x GAS x SP split (``tests/integrations/test_post_training_sp.py``).

    Args:
        me: from :func:`~.engine.initialize` (its module follows this module's contract).
        micro_batches: ``gradient_accumulation_steps`` dicts. DPO: as
            :func:`dpo_train_step`. CPO / SimPO / ORPO: ``input_ids [2P, T]`` (chosen rows,
            then rejected) and ``completion_mask [2P, T]`` (no reference; the NLL term is on
            the chosen completions' tokens). KTO: ``input_ids [B, T]`` (one example a row),
            ``completion_mask [B, T]``, ``desirable [B]`` (bool or 0 / 1), ``ref_log_probs
            [B]`` (the reference's sequence sums), and optionally the KL rows
            ``kl_input_ids [K, T']``, ``kl_completion_mask [K, T']`` (mismatched prompt /
            completion pairs, TRL's ``KL_completion``) with ``ref_kl_log_probs [K]``; without
            them ``z0 = 0`` (TRL's ``calculate_kl=False``). Optional ``attention_mask``,
            ``position_ids``; under sequence parallelism as :func:`dpo_train_step` (full
            micro-batches on every SP rank, slices forwarded, sequence sums added over the SP
            group, each pair or example counted once).
        options: one of the four options classes; default
            ``me.config.preference_options()``: the preference section the ds_config gives
            (``"megaloss": {"dpo" | "cpo" | "simpo" | "orpo" | "kto": {...}}``, at most one),
            DPO's defaults when it gives none.
        log: write the loss and metrics through ``engine.monitor``.

    Returns:
        :class:`PolicyStepMetrics`: ``metrics`` the loss's (:func:`megaloss.dpo_metrics`,
        ``cpo_metrics``, ``orpo_metrics``, ``kto_metrics``); ``num_sequences`` the global pairs
        with a chosen completion token (KTO: examples with a completion token);
        ``num_tokens`` their chosen (KTO: all) completion tokens.

    Raises:
        TypeError: ``options`` of none of the four classes; non-integer ids, non-floating
            reference log-probs (agreed on by every rank).
        ValueError: a wrong number of micro-batches, a missing key, an odd number of rows for
            a paired loss, shapes that do not match ``input_ids``, KTO's KL keys given in part,
            an ``attention_mask`` with zeros under sequence parallelism (agreed on by every
            rank: the same error everywhere, naming the failed ranks).
    """
    opts = me.config.preference_options() if options is None else options
    kind = preference_loss_kind(opts)
    gas = _check_micro_batches(me, micro_batches, _PREFERENCE_KEYS[kind],
                               partial(check_preference_micro_batch, loss=kind))
    t0 = time.perf_counter()
    engine = me.engine
    mbs = [batch_to_device(mb, engine.device) for mb in micro_batches]
    ignore = me.calibrator.ignore_index
    calib = LossCalibrator(me.topology, loss_reduction="sample", engine_scale=me.engine_scale,
                           ignore_index=ignore, weight_dtype=me.calibrator.weight_dtype)
    rows = [mb["completion_mask"] if kind == "kto"
            else mb["completion_mask"][: mb["input_ids"].shape[0] // 2] for mb in mbs]
    step = calib.begin_step([completion_labels(m, ignore) for m in rows])
    z0 = _kto_baseline(me, mbs, ignore) if kind == "kto" else None
    stats, own_norm = [], None
    for i, full in enumerate(mbs):
        mb, labels = _sp_slices(me, full, _targets(full, ignore))
        log_probs, _ = _forward(me, mb, labels)
        seq, lengths = sequence_log_probs(log_probs, mb["completion_mask"],
                                          sp_group=me.topology.sp_group, return_lengths=True)
        w = preference_weights(step, i, ignore_index=ignore)
        ref = (torch.cat([mb["ref_chosen_log_probs"], mb["ref_rejected_log_probs"]])
               if kind == "dpo" else mb.get("ref_log_probs"))
        out = sequence_preference_loss(seq, opts, lengths=lengths, ref_log_probs=ref,
                                       desirable=mb.get("desirable"), kl=z0,
                                       weights=w.pair_weights, nll_weight=w.nll_weight,
                                       return_stats=True)
        engine.backward(step.loss_for_backward(out.loss))
        stats.append(out.stats)
        if i == gas - 1 and engine.zero_optimization_stage() == 0:
            own_norm = reduced_grad_norm(engine.module, me.topology)
        engine.step()
    metrics = _PREFERENCE_METRICS[kind](stats, group=me.topology.dp_sp_group)
    return _finish(me, step, t0, own_norm, float(step.num_samples), metrics, log)
