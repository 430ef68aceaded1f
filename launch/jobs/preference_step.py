"""The preference job's step and held-out evaluation (``launch/train_dpo.py``): DPO, SimPO, ORPO,
CPO and KTO on sequence log-probs, each with megaloss's loss
(:func:`megaloss.losses.dpo_loss`, :func:`~megaloss.losses.simpo_loss` /
:func:`~megaloss.losses.cpo_loss`, :func:`~megaloss.losses.orpo_loss`,
:func:`~megaloss.losses.kto_loss`), on an engine whose module returns per-token log-probs
(:class:`launch.jobs.policy_model.CausalLMLogProbs`, no ``[tokens, vocab]`` logits).

One step over the ``G`` micro-batches of pairs (``G``: the ds_config's
``gradient_accumulation_steps``; a micro-batch is :func:`launch.jobs.preference_data.pair_batch`,
chosen rows then rejected rows):

1. a :class:`megaloss.LossCalibrator` with ``loss_reduction="sample"`` begins the step on the
   chosen completions' labels of every micro-batch (KTO: every row's, each row one example):
   ONE all-reduce over ``dp x sp`` gives the step's global pair and token counts;
2. the frozen reference's sequence log-probs (DPO, KTO) under ``no_grad``; for KTO also the KL
   baseline ``z0`` (:func:`megaloss.losses.kto_kl_baseline`) over the step's mismatched
   completions (prompt ``i`` with the chosen continuation of pair ``i - 1`` of its
   micro-batch, TRL's ``KTOTrainer`` pairing), one more all-reduce;
3. per micro-batch: forward, the loss with the step's global weights
   (:func:`megaloss.losses.preference_weights`: ``1 / N_pairs`` per pair and ``1 / N_tokens``
   per NLL token; DPO's :func:`~megaloss.losses.dpo_pair_weights`),
   ``engine.backward(step.loss_for_backward(loss))`` (undoing the engine's measured
   ``1 / (G x DP)``) and ``engine.step()``;

so the update is the one a single device makes on the whole global batch of pairs, for any DP x
GAS split. The metrics are the losses' own (TRL's names: ``rewards/accuracies``,
``rewards/margins``, ...), reduced over the step's global pairs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from megaloss import LossCalibrator
from megaloss.losses import (
    CPOOptions,
    DPOOptions,
    KTOOptions,
    ORPOOptions,
    cpo_loss,
    cpo_metrics,
    dpo_loss,
    dpo_metrics,
    dpo_pair_weights,
    kto_kl_baseline,
    kto_loss,
    kto_metrics,
    orpo_loss,
    orpo_metrics,
    preference_weights,
    sequence_log_probs,
)

from .preference_data import Pairs, completion_batch, pair_batch

__all__ = ["LOSSES", "NEEDS_REFERENCE", "DEFAULT_BETA", "PreferenceLoss", "preference_loss",
           "sequence_scores", "preference_step", "evaluate_pairs"]

LOSSES = ("dpo", "simpo", "orpo", "cpo", "kto")
NEEDS_REFERENCE = ("dpo", "kto")  # the others are reference-free
# beta when --beta is not given (DPO: the ds_config's megaloss.dpo section): TRL 1.16's config
# defaults, SimPO's from its paper's range (arXiv:2405.14734, beta 2.0-2.5)
DEFAULT_BETA = {"simpo": 2.0, "orpo": 0.1, "cpo": 0.1, "kto": 0.1}
IGNORE = -100


@dataclass(frozen=True)
class PreferenceLoss:
    """A loss of :data:`LOSSES` with its megaloss options (``DPOOptions``, ``CPOOptions``,
    ``ORPOOptions`` or ``KTOOptions``)."""

    name: str
    options: Any

    @property
    def beta(self) -> float:
        return self.options.beta

    @property
    def needs_reference(self) -> bool:
        return self.name in NEEDS_REFERENCE

    def describe(self) -> Dict[str, Any]:
        return {"loss": self.name, **vars(self.options)}


def preference_loss(name: str, dpo: DPOOptions, *, beta: Optional[float] = None,
                    simpo_gamma: float = 0.5, cpo_alpha: float = 1.0) -> PreferenceLoss:
    """The options of loss ``name``: DPO's from ``dpo`` (the ds_config's ``megaloss.dpo``) with
    ``beta`` overriding its beta when given; SimPO (``CPOOptions(loss_type="simpo")``, no NLL),
    CPO (sigmoid, NLL weight ``cpo_alpha``), ORPO and KTO with ``beta`` or
    :data:`DEFAULT_BETA`."""
    if name not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got {name!r}")
    if name == "dpo":
        fields = dict(vars(dpo))
        if beta is not None:
            fields["beta"] = beta
        return PreferenceLoss(name, DPOOptions(**fields))
    b = DEFAULT_BETA[name] if beta is None else beta
    if name == "simpo":
        return PreferenceLoss(name, CPOOptions(loss_type="simpo", beta=b, simpo_gamma=simpo_gamma,
                                               cpo_alpha=0.0))
    if name == "cpo":
        return PreferenceLoss(name, CPOOptions(loss_type="sigmoid", beta=b, cpo_alpha=cpo_alpha))
    if name == "orpo":
        return PreferenceLoss(name, ORPOOptions(beta=b))
    return PreferenceLoss(name, KTOOptions(beta=b))


_METRICS = {"dpo": dpo_metrics, "simpo": cpo_metrics, "cpo": cpo_metrics, "orpo": orpo_metrics,
            "kto": kto_metrics}


def sequence_scores(module, batch: Dict[str, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(sequence log-probs [R], completion token counts [R])`` of a batch's rows under
    ``module`` (the engine or a :class:`~launch.jobs.policy_model.CausalLMLogProbs`)."""
    labels = batch["shift_labels"]
    out = module(batch["input_ids"], shift_labels=labels)
    mask = labels != IGNORE
    return sequence_log_probs(out.log_probs.reshape(labels.shape), mask), mask.sum(-1)


def _loss(spec: PreferenceLoss, seq: torch.Tensor, ref: Optional[torch.Tensor],
          lengths: torch.Tensor, weights: Optional[torch.Tensor],
          nll_weight: Optional[torch.Tensor], kl: Optional[torch.Tensor]):
    """The loss's output (``loss``, ``stats``) on one micro-batch: rows ``[:P]`` chosen,
    ``[P:]`` rejected."""
    p = seq.shape[0] // 2
    c, r, n_c, n_r = seq[:p], seq[p:], lengths[:p], lengths[p:]
    if spec.name == "dpo":
        return dpo_loss(c, r, ref[:p], ref[p:], chosen_lengths=n_c, rejected_lengths=n_r,
                        pair_weights=weights, options=spec.options, return_stats=True)
    if spec.name in ("simpo", "cpo"):
        return cpo_loss(c, r, chosen_lengths=n_c, rejected_lengths=n_r, pair_weights=weights,
                        nll_weight=nll_weight, options=spec.options, return_stats=True)
    if spec.name == "orpo":
        return orpo_loss(c, r, chosen_lengths=n_c, rejected_lengths=n_r, pair_weights=weights,
                         nll_weight=nll_weight, options=spec.options, return_stats=True)
    desirable = torch.arange(seq.shape[0], device=seq.device) < p  # chosen rows: desirable
    return kto_loss(seq, ref, desirable, kl=kl, sample_weights=weights, options=spec.options,
                    return_stats=True)


def implicit_rewards(spec: PreferenceLoss, seq: torch.Tensor, ref: Optional[torch.Tensor],
                     lengths: torch.Tensor) -> torch.Tensor:
    """Each row's implicit reward, as the loss's ``rewards/chosen`` metric defines it: DPO and
    KTO ``beta (logp - ref_logp)``; SimPO and ORPO ``beta logp / n`` (length-normalised); CPO
    (sigmoid) ``beta logp``."""
    if spec.name in NEEDS_REFERENCE:
        return spec.beta * (seq - ref)
    if spec.name == "cpo":
        return spec.beta * seq
    return spec.beta * seq / lengths.clamp(min=1)


def _mismatched(pairs: Pairs) -> Dict[str, torch.Tensor]:
    """KTO's KL rows: each prompt with the chosen continuation of the previous pair."""
    return completion_batch(pairs.prompts, pairs.chosen.roll(1, 0))


def preference_step(me, micro_pairs: Sequence[Pairs], spec: PreferenceLoss,
                    reference=None) -> Dict[str, Any]:
    """One calibrated optimizer step of ``spec``'s loss over this rank's
    ``gradient_accumulation_steps`` micro-batches of pairs (module docstring). ``reference``:
    the frozen reference module (DPO, KTO).

    Returns:
        ``{"step", "loss" (global), "num_pairs", "num_tokens" (global chosen tokens), "lr",
        "kl" (KTO's z0, else absent), **the loss's metrics}``, identical on every rank.

    Raises:
        ValueError: the number of micro-batches differs from the engine's accumulation steps;
            a reference is missing for DPO / KTO.
    """
    engine = me.engine
    gas = int(engine.gradient_accumulation_steps())
    if len(micro_pairs) != gas:
        raise ValueError(f"micro_pairs must hold gradient_accumulation_steps={gas} entries, got "
                         f"{len(micro_pairs)}")
    if spec.needs_reference and reference is None:
        raise ValueError(f"loss {spec.name!r} needs the reference model")
    group = me.topology.dp_sp_group
    batches = [{k: v.to(engine.device) for k, v in pair_batch(p).items()} for p in micro_pairs]
    calib = LossCalibrator(me.topology, loss_reduction="sample", engine_scale=me.engine_scale,
                           ignore_index=IGNORE, weight_dtype=me.calibrator.weight_dtype)
    kto = spec.name == "kto"
    step = calib.begin_step([b["shift_labels"] if kto else b["shift_labels"][:len(p)]
                             for b, p in zip(batches, micro_pairs)])
    refs: List[Optional[torch.Tensor]] = [None] * gas
    kl = None
    if reference is not None:
        with torch.no_grad():
            refs = [sequence_scores(reference, b)[0] for b in batches]
            if kto:
                kl_rows = [{k: v.to(engine.device) for k, v in _mismatched(p).items()}
                           for p in micro_pairs]
                pol = [sequence_scores(engine.module, b) for b in kl_rows]
                ref_kl = [sequence_scores(reference, b)[0] for b in kl_rows]
                kl = kto_kl_baseline([x[0] for x in pol], ref_kl, kl_lengths=[x[1] for x in pol],
                                     group=group)
    stats = []
    for i, b in enumerate(batches):
        seq, lengths = sequence_scores(engine, b)
        if spec.name == "dpo":
            weights, nll_weight = dpo_pair_weights(step, i, ignore_index=IGNORE), None
        else:
            weights, nll_weight = preference_weights(step, i, ignore_index=IGNORE)
        out = _loss(spec, seq, refs[i], lengths, weights, nll_weight, kl)
        engine.backward(step.loss_for_backward(out.loss))
        stats.append(out.stats)
        engine.step()
    metrics = _METRICS[spec.name](stats, group=group)
    pairs = float(step.num_samples) / (2 if kto else 1)
    tokens = float(step.num_tokens) / (2 if kto else 1)
    out = {"step": int(engine.global_steps), "loss": float(step.global_loss()),
           "num_pairs": pairs, "num_tokens": tokens, "lr": float(engine.get_lr()[0])}
    if kl is not None:
        out["kl"] = float(kl)
    out.update({k: v for k, v in metrics.items() if k != "kl"})
    return out


def evaluate_pairs(module, reference, pairs: Pairs, micro: int, spec: PreferenceLoss,
                   num_pairs: int, group, device) -> Dict[str, float]:
    """Held-out figures over this rank's share ``pairs`` of ``num_pairs`` pairs (every rank must
    call it; one all-reduce): ``accuracy`` (the share of pairs whose length-normalised log-prob
    under the policy prefers chosen, the reference-free criterion), ``reward_accuracy`` and
    ``reward_margin`` (the loss's implicit reward, :func:`implicit_rewards`: chosen above
    rejected, and the mean difference), ``loss`` (the loss with the pairs' global weights; KTO's
    with ``z0 = 0``), ``logps_chosen`` / ``logps_rejected`` (mean per-token log-probs).

    ``reference=None``: the policy is its own reference (before preference training: the
    implicit rewards of DPO and KTO are then 0, their reward accuracy 0 and margin 0).
    """
    import torch.distributed as dist

    sums = torch.zeros(6, dtype=torch.float64, device=device)
    rows = 2 * num_pairs if spec.name == "kto" else num_pairs
    tokens = float(num_pairs * pairs.chosen.shape[1]) or 1.0
    with torch.no_grad():
        for start in range(0, len(pairs), micro):
            chunk = pairs.rows(start, start + micro)
            p = len(chunk)
            b = {k: v.to(device) for k, v in pair_batch(chunk).items()}
            seq, lengths = sequence_scores(module, b)
            ref = seq if reference is None else sequence_scores(reference, b)[0]
            n = 2 * p if spec.name == "kto" else p
            weights = torch.full((n,), 1.0 / rows, dtype=seq.dtype, device=device)
            nll_weight = torch.tensor(1.0 / tokens, dtype=seq.dtype, device=device)
            out = _loss(spec, seq, ref, lengths, weights,
                        None if spec.name == "dpo" else nll_weight, None)
            reward = implicit_rewards(spec, seq, ref, lengths).double()
            avg = (seq / lengths.clamp(min=1)).double()
            sums += torch.stack([
                out.loss.detach().double(), (avg[:p] > avg[p:]).double().sum(),
                (reward[:p] > reward[p:]).double().sum(), (reward[:p] - reward[p:]).sum(),
                avg[:p].sum(), avg[p:].sum()])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(sums, group=group)
    loss, acc, racc, margin, lc, lr = sums.tolist()
    n = float(num_pairs) or 1.0
    return {"loss": loss, "accuracy": acc / n, "reward_accuracy": racc / n,
            "reward_margin": margin / n, "logps_chosen": lc / n, "logps_rejected": lr / n}
