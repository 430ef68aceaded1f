"""The preference job's step and held-out evaluation (``launch/train_dpo.py``): DPO, SimPO, ORPO,
CPO and KTO on sequence log-probs, each with megaloss's loss
(:func:`megaloss.losses.dpo_loss`, :func:`~megaloss.losses.simpo_loss` /
:func:`~megaloss.losses.cpo_loss`, :func:`~megaloss.losses.orpo_loss`,
:func:`~megaloss.losses.kto_loss`), on an engine whose module returns per-token log-probs
(:class:`launch.jobs.policy_model.CausalLMLogProbs`, no ``[tokens, vocab]`` logits).

One step over the ``G`` micro-batches of pairs (``G``: the ds_config's
``gradient_accumulation_steps``; a micro-batch is :func:`launch.jobs.preference_data.pair_batch`,
chosen rows then rejected rows) is megaloss's own
:func:`megaloss.integrations.deepspeed.preference_train_step` (the loss chosen by the options'
type; its micro-batch checks agreed on by every rank, the step calibrated over the global pairs
and tokens, the gradient norm, the metrics written through ``engine.monitor``). This module
only builds its micro-batches: the completion masks, the frozen reference's sequence log-probs
(DPO, KTO) under ``no_grad`` and, for KTO, the mismatched completions of the KL baseline
(prompt ``i`` with the chosen continuation of pair ``i - 1`` of its micro-batch, TRL's
``KTOTrainer`` pairing) with their reference log-probs. The update is the one a single device
makes on the whole global batch of pairs, for any DP x GAS split. The metrics are the losses'
own (TRL's names: ``rewards/accuracies``, ``rewards/margins``, ...), reduced over the step's
global pairs.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

import torch

from megaloss.integrations.deepspeed import preference_train_step
from megaloss.losses import (
    CPOOptions,
    DPOOptions,
    KTOOptions,
    ORPOOptions,
    sequence_log_probs,
    sequence_preference_loss,
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


def preference_loss(name: str, section: Any = None, *, beta: Optional[float] = None,
                    simpo_gamma: Optional[float] = None,
                    cpo_alpha: Optional[float] = None) -> PreferenceLoss:
    """The options of loss ``name``: those of the ds_config's section of that name
    (``section``: ``MegalossConfig.<name>.options()``, e.g. ``"megaloss": {"orpo": {...}}``;
    DPO always has one, its defaults when the ds_config gives none), else SimPO
    (``CPOOptions(loss_type="simpo")``, no NLL), CPO (sigmoid, NLL weight 1), ORPO and KTO with
    :data:`DEFAULT_BETA`; ``beta``, ``simpo_gamma`` (SimPO) and ``cpo_alpha`` (CPO) override
    them when given."""
    if name not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got {name!r}")
    if section is None:
        b = DEFAULT_BETA.get(name, 0.1)
        section = {"dpo": DPOOptions(),
                   "simpo": CPOOptions(loss_type="simpo", beta=b, cpo_alpha=0.0),
                   "cpo": CPOOptions(loss_type="sigmoid", beta=b),
                   "orpo": ORPOOptions(beta=b), "kto": KTOOptions(beta=b)}[name]
    given = {"beta": beta}
    if name == "simpo":
        given["simpo_gamma"] = simpo_gamma
    if name == "cpo":
        given["cpo_alpha"] = cpo_alpha
    return PreferenceLoss(name, dataclasses.replace(
        section, **{k: v for k, v in given.items() if v is not None}))


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
    ``[P:]`` rejected (KTO: every row one example, the chosen ones desirable); the same
    dispatch as the training step's (:func:`megaloss.losses.sequence_preference_loss`)."""
    desirable = torch.arange(seq.shape[0], device=seq.device) < seq.shape[0] // 2
    return sequence_preference_loss(seq, spec.options, lengths=lengths, ref_log_probs=ref,
                                    desirable=desirable, kl=kl, weights=weights,
                                    nll_weight=nll_weight, return_stats=True)


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


def _micro_batch(spec: PreferenceLoss, pairs: Pairs, reference, device) -> Dict[str, Any]:
    """One micro-batch of :func:`~megaloss.integrations.deepspeed.preference_train_step` for
    ``spec``'s loss: ``input_ids``, ``completion_mask`` (chosen rows, then rejected); DPO the
    reference's ``ref_chosen_log_probs`` / ``ref_rejected_log_probs``; KTO every row one example
    (chosen rows desirable), ``ref_log_probs`` and the KL rows."""
    b = {k: v.to(device) for k, v in pair_batch(pairs).items()}
    mb: Dict[str, Any] = {"input_ids": b["input_ids"],
                          "completion_mask": (b["shift_labels"] != IGNORE).long()}
    if not spec.needs_reference:
        return mb
    p = len(pairs)
    with torch.no_grad():
        ref = sequence_scores(reference, b)[0]
        if spec.name == "dpo":
            mb.update(ref_chosen_log_probs=ref[:p], ref_rejected_log_probs=ref[p:])
            return mb
        kl = {k: v.to(device) for k, v in _mismatched(pairs).items()}
        mb.update(desirable=torch.arange(2 * p, device=device) < p, ref_log_probs=ref,
                  kl_input_ids=kl["input_ids"],
                  kl_completion_mask=(kl["shift_labels"] != IGNORE).long(),
                  ref_kl_log_probs=sequence_scores(reference, kl)[0])
    return mb


def preference_step(me, micro_pairs: Sequence[Pairs], spec: PreferenceLoss,
                    reference=None) -> Dict[str, Any]:
    """One calibrated optimizer step of ``spec``'s loss over this rank's
    ``gradient_accumulation_steps`` micro-batches of pairs: megaloss's
    :func:`~megaloss.integrations.deepspeed.preference_train_step` (module docstring).
    ``reference``: the frozen reference module (DPO, KTO).

    Returns:
        ``{"step", "loss" (global), "num_pairs", "num_tokens" (global chosen tokens), "lr",
        "grad_norm", "kl" (KTO's z0, else absent), **the loss's metrics}``, identical on every
        rank.

    Raises:
        ValueError: a reference is missing for DPO / KTO; see
            :func:`~megaloss.integrations.deepspeed.preference_train_step` (the number of
            micro-batches, their shapes).
    """
    if spec.needs_reference and reference is None:
        raise ValueError(f"loss {spec.name!r} needs the reference model")
    device = me.engine.device
    mbs = [_micro_batch(spec, p, reference, device) for p in micro_pairs]
    m = preference_train_step(me, mbs, options=spec.options)
    kto = spec.name == "kto"  # KTO's examples are the pairs' rows: two a pair
    return {"step": m.step, "loss": m.loss, "num_pairs": m.num_sequences / (2 if kto else 1),
            "num_tokens": m.num_tokens / (2 if kto else 1), "lr": m.lr,
            "grad_norm": m.grad_norm, **m.metrics}


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
