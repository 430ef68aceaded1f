"""A loss hook for TRL's ``DPOTrainer``: :class:`MegalossDPOMixin` computes the sequence
log-probs with megaloss's chunked head (:class:`megaloss.CausalLMWithLogProbs`, no
``[tokens, vocab]`` logits) and the loss with :func:`megaloss.dpo_loss`, each pair weighted by
``1 / N_pairs`` of the optimizer step's *global* batch (every process, every accumulation step).

Usage (the mixin goes first, so its methods come before TRL's)::

    from trl import DPOTrainer
    from megaloss.integrations.hf import MegalossDPOMixin

    class Trainer(MegalossDPOMixin, DPOTrainer):
        pass

    Trainer(model=model, ref_model=ref_model, args=DPOConfig(...), train_dataset=pairs,
            processing_class=tokenizer).train()

What it changes in TRL 1.16 (``trl/trainer/dpo_trainer.py``):

- ``__init__``: the ``DPOConfig`` is checked before TRL builds anything (a field the hook does
  not reproduce is a ValueError naming it); the lm_head of the policy and of the reference
  model becomes megaloss's
  :class:`~megaloss.integrations.hf.causal_lm_log_probs.LinearLogProbsHead` (the same weight
  Parameter; without labels it returns the logits, so the model's own forward and
  ``generate`` are unchanged), and their forward takes ``megaloss_log_probs=True`` to return
  :class:`megaloss.LogProbsOutput` (decoder + chunked log-probs and entropy of the labels) while
  the forward still runs through the DDP / DeepSpeed wrapper that reduces the gradients.
- ``get_batch_samples``: after the Trainer fetched the step's micro-batches, the pairs with a
  chosen completion token are counted over them and summed over the processes (one
  ``accelerator.reduce`` of one number), and the 0-dim count goes into every micro-batch.
- ``_compute_loss``: per micro-batch, the sequence log-probs (:func:`megaloss.sequence_log_probs`
  over the completion tokens, after the causal shift, as TRL's ``per_token_logps.sum(1)``) of
  the policy and (without ``precompute_ref_log_probs``) of the reference, then the sum over
  ``DPOConfig.loss_type`` of ``loss_weights[k] * dpo_loss(loss_type[k])`` with the pair
  weights ``1 / N_pairs`` (global), times the number of processes (DDP and DeepSpeed average
  the gradients over them); :attr:`loss_is_scaled_for_ga` is True, so the Trainer does not
  divide by the accumulation steps (and passes ``scale_wrt_gas=False`` to DeepSpeed). TRL
  takes the mean over each process's micro-batch and divides by the accumulation steps
  instead: the two agree when the pairs are the same number on every micro-batch of every
  process; with uneven pairs (the last step with ``even_batches=False``, padding rows) this is
  the single-device gradient of the step's pairs (TRL's own trainer, with uneven pairs over
  the processes, stops in its metrics' ``accelerator.gather`` of ``[P]`` tensors of different
  sizes; the mixin reduces fixed-size sums).
- ``compute_ref_log_probs`` (``precompute_ref_log_probs=True``): the reference sequence
  log-probs the same way.

In evaluation (no step count) the pairs of each batch are averaged, as TRL does. Metrics, under
TRL's names, in TRL's ``_metrics`` (so its ``log`` averages them): ``rewards/chosen``,
``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``, ``logps/chosen``,
``logps/rejected`` (:func:`megaloss.dpo_metrics`, means over the micro-batch's pairs of every
process), ``entropy`` (mean over the completion tokens), ``mean_token_accuracy`` (the chosen
completions' greedy matches), ``num_tokens``. Not logged: ``logits/chosen`` /
``logits/rejected`` (the mean logit needs the logits, which the chunked head never returns).

Refused (ValueError at construction, naming the field): ``loss_type`` ``sft`` (megaloss's
:func:`megaloss.linear_cross_entropy` is its loss); ``f_divergence_type`` other than
``reverse_kl``; ``ld_alpha`` (LD-DPO); ``use_weighting`` (WPO); ``router_aux_loss_coef`` with a
MoE model (the auxiliary loss); ``parallelism_config`` with tensor / context / sequence
parallelism (the pair count is per process); a model given by name (its lm_head must be
replaced before TRL prepares it), PEFT (``peft_config`` or a ``PeftModel``), vision-language
datasets. Everything else in ``DPOConfig`` (``beta``, ``label_smoothing``, ``discopop_tau``,
``loss_weights``, ``precompute_ref_log_probs``, ``sync_ref_model``, truncation, padding) TRL
applies as it does without the hook.

Tested (``tests/integrations/test_hf_trl_dpo.py``): one training step equals TRL's own
``DPOTrainer`` (loss, parameter update and metrics within 1e-5: TRL's log-probs are float32)
for every loss type, ``precompute_ref_log_probs`` and ``evaluate()``; 2 gloo processes with
uneven pairs per process give the single-process gradient of the step's pairs.
"""
from __future__ import annotations

import types
from typing import Any, Dict, Iterator, List

import torch

from ...losses.dpo import DPO_LOSS_TYPES, DPOOptions, dpo_loss, dpo_metrics, sequence_log_probs
from ...ops.log_probs_options import LogProbsOptions
from ...parallel.groups import SINGLE_RANK
from .causal_lm_log_probs import CausalLMWithLogProbs, LinearLogProbsHead

__all__ = ["MegalossDPOMixin", "dpo_options_from_dpo_args"]

_COUNT_KEY = "megaloss_num_pairs"
_NON_MODEL_KEYS = {"completion_mask", "ref_chosen_logps", "ref_rejected_logps", _COUNT_KEY}
_MODEL_KEYS = {"input_ids", "attention_mask", "position_ids"}
_INSTALLED = "_megaloss_dpo_forward"


def dpo_options_from_dpo_args(args: Any) -> List[tuple]:
    """``[(DPOOptions, weight), ...]``, one per ``args.loss_type``, from a TRL ``DPOConfig``
    (``loss_weights`` default 1 each).

    Raises:
        ValueError: a setting the hook does not reproduce (module docstring), naming the field;
            an option out of range (from :class:`~megaloss.DPOOptions`).
    """
    loss_types = args.loss_type
    loss_types = [loss_types] if isinstance(loss_types, str) else list(loss_types)
    bad = [t for t in loss_types if t not in DPO_LOSS_TYPES]
    if bad:
        raise ValueError(f"DPOConfig.loss_type={bad}: MegalossDPOMixin supports {DPO_LOSS_TYPES} "
                         "(sft is megaloss.linear_cross_entropy)")
    unsupported = {
        "f_divergence_type": getattr(args, "f_divergence_type", "reverse_kl") != "reverse_kl",
        "ld_alpha": getattr(args, "ld_alpha", None) is not None,
        "use_weighting": bool(getattr(args, "use_weighting", False)),
    }
    parallelism = getattr(args, "parallelism_config", None)
    for name in ("tp_size", "cp_size", "sp_size"):
        size = getattr(parallelism, name, 1) if parallelism is not None else 1
        unsupported[f"parallelism_config.{name}"] = isinstance(size, int) and size > 1
    refused = [k for k, v in unsupported.items() if v]
    if refused:
        raise ValueError(f"MegalossDPOMixin does not reproduce DPOConfig.{', '.join(refused)}; "
                         "unset them or use TRL's own loss")
    weights = getattr(args, "loss_weights", None) or [1.0] * len(loss_types)
    if len(weights) != len(loss_types):
        raise ValueError(f"DPOConfig.loss_weights has {len(weights)} entries for "
                         f"{len(loss_types)} loss types")
    return [(DPOOptions(loss_type=t, beta=args.beta, label_smoothing=args.label_smoothing,
                        discopop_tau=args.discopop_tau), float(w))
            for t, w in zip(loss_types, weights)]


def _install(model: torch.nn.Module) -> None:
    """Replace ``model``'s lm_head by megaloss's log-probs head and let its forward take
    ``megaloss_log_probs=True`` (module docstring); idempotent."""
    if getattr(model, _INSTALLED, False):
        return
    if isinstance(model.get_output_embeddings(), LinearLogProbsHead):
        raise ValueError("the model's lm_head is already a megaloss LinearLogProbsHead from "
                         "another wrapper: pass the plain *ForCausalLM")
    wrapper = CausalLMWithLogProbs(model, options=LogProbsOptions(return_entropy=True))
    inner = model.forward

    def forward(self, *args: Any, megaloss_log_probs: bool = False, **kwargs: Any):
        if not megaloss_log_probs:
            return inner(*args, **kwargs)
        if args:
            raise TypeError("megaloss_log_probs=True takes keyword arguments only")
        extra = set(kwargs) - _MODEL_KEYS - {"labels", "use_cache"}
        if extra:
            raise ValueError(f"MegalossDPOMixin's forward takes {sorted(_MODEL_KEYS)}, got "
                             f"{sorted(extra)} too")
        # the wrapper's forward, not its __call__: it is no submodule of the model, whose own
        # call (this forward) is the one DDP / DeepSpeed / ZeRO-3 see
        return wrapper.forward(kwargs["input_ids"], labels=kwargs["labels"],
                               attention_mask=kwargs.get("attention_mask"),
                               position_ids=kwargs.get("position_ids"))

    model.forward = types.MethodType(forward, model)
    setattr(model, _INSTALLED, True)


def _is_peft(model: Any) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def _refuse_model(model: Any, role: str) -> None:
    if isinstance(model, str):
        raise ValueError(f"MegalossDPOMixin needs the {role} as a model instance, not the name "
                         f"{model!r}: its lm_head is replaced before TRL prepares it (load it "
                         "with AutoModelForCausalLM.from_pretrained)")
    if model is not None and _is_peft(model):
        raise ValueError(f"MegalossDPOMixin does not support PEFT models ({role})")


class MegalossDPOMixin:
    """Put before ``trl.DPOTrainer`` in the bases (module docstring).

    Raises:
        ValueError: at construction, a ``DPOConfig`` setting or a model the hook does not
            reproduce (module docstring), naming it.
    """

    loss_is_scaled_for_ga = True  # _compute_loss weights the step's global pairs itself

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # DPOTrainer(model, ref_model, args, data_collator, train_dataset, ...)
        names = ("model", "ref_model", "args")
        given = {n: kwargs.get(n, args[i] if len(args) > i else None)
                 for i, n in enumerate(names)}
        if given["args"] is not None:
            dpo_options_from_dpo_args(given["args"])
        if kwargs.get("peft_config") is not None:
            raise ValueError("MegalossDPOMixin does not support peft_config (PEFT)")
        _refuse_model(given["model"], "model")
        _refuse_model(given["ref_model"], "ref_model")
        for model in (given["model"], given["ref_model"]):
            if model is not None:  # before TRL prepares them (DeepSpeed hooks the new head)
                _install(model)
        super().__init__(*args, **kwargs)
        dpo_options_from_dpo_args(self.args)  # refused now, not at the first loss
        if getattr(self, "aux_loss_enabled", False):
            raise ValueError("MegalossDPOMixin does not add the MoE auxiliary loss "
                             "(DPOConfig.router_aux_loss_coef / the model's router_aux_loss_coef "
                             "must be 0)")
        if getattr(self, "_is_vision_dataset", False):
            raise ValueError("MegalossDPOMixin does not support vision-language datasets")
        if _is_peft(self.model):
            raise ValueError("MegalossDPOMixin does not support PEFT models")
        if self.ref_model is not None:
            ref = self.accelerator.unwrap_model(self.ref_model)
            if not getattr(ref, _INSTALLED, False):
                # built by TRL from the policy's name and already prepared: under ZeRO-3 its
                # partitioned head would not be gathered by a module installed now
                plugin = getattr(self.args, "deepspeed_plugin", None)
                if plugin is not None and getattr(plugin, "zero_stage", 0) == 3:
                    raise ValueError("under DeepSpeed ZeRO-3 pass ref_model (a model instance) "
                                     "to MegalossDPOMixin, or set precompute_ref_log_probs")
                _install(ref)
        _install(self.accelerator.unwrap_model(self.model))

    # the step's pair count ----------------------------------------------------------------
    def get_batch_samples(self, epoch_iterator: Iterator, num_batches: int,
                          device: torch.device) -> tuple:
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        local = torch.zeros((), dtype=torch.float64)
        for b in batches:
            local += float(_chosen_valid(b["completion_mask"]).sum())
        total = self.accelerator.reduce(local.to(self.accelerator.device), reduction="sum")
        for b in batches:
            b[_COUNT_KEY] = total.reshape(()).detach().clone()
        return batches, num_items

    # log-probs -----------------------------------------------------------------------------
    def _megaloss_forward(self, model: Any, inputs: Dict[str, Any]):
        _install(self.accelerator.unwrap_model(model))
        model_kwargs = {k: v for k, v in inputs.items() if k not in _NON_MODEL_KEYS}
        extra = set(model_kwargs) - _MODEL_KEYS
        if extra:
            raise ValueError(f"MegalossDPOMixin: batch keys {sorted(extra)} are not supported "
                             "(text-only preference batches)")
        labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
        return model(**model_kwargs, labels=labels, megaloss_log_probs=True)

    def compute_ref_log_probs(self, model: Any, inputs: Dict[str, Any]):
        """The reference sequence log-probs ``(chosen [P], rejected [P])`` of a batch."""
        with torch.no_grad():
            out = self._megaloss_forward(model, inputs)
        return sequence_log_probs(out.log_probs, _shifted(inputs["completion_mask"])).chunk(2)

    def _ref_log_probs(self, inputs: Dict[str, Any]):
        if self.precompute_ref_logps:
            return inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]
        if self.ref_model is None:
            raise ValueError("MegalossDPOMixin needs a ref_model or precompute_ref_log_probs")
        return self.compute_ref_log_probs(self.ref_model, inputs)

    def _compute_loss(self, model: Any, inputs: Dict[str, Any], return_outputs: bool):
        mode = "train" if self.model.training else "eval"
        losses = dpo_options_from_dpo_args(self.args)
        mask = inputs["completion_mask"]
        shifted = _shifted(mask)
        out = self._megaloss_forward(model, inputs)
        seq = sequence_log_probs(out.log_probs, shifted)
        chosen, rejected = seq.chunk(2)
        ref_chosen, ref_rejected = self._ref_log_probs(inputs)
        ref_chosen = ref_chosen.to(device=seq.device, dtype=seq.dtype)
        ref_rejected = ref_rejected.to(device=seq.device, dtype=seq.dtype)
        lengths = mask.sum(-1)
        chosen_len, rejected_len = lengths.chunk(2)
        valid = _chosen_valid(mask).to(seq.dtype)
        count = inputs.get(_COUNT_KEY)
        if mode == "train" and count is not None:
            pairs = count.to(device=seq.device, dtype=torch.float64).clamp(min=1.0)
            weights = (valid.to(torch.float64) / pairs).to(seq.dtype)
            scale = self.accelerator.num_processes
        else:  # evaluation: the batch's pairs, as TRL
            weights = torch.full_like(valid, 1.0 / max(valid.shape[0], 1))
            scale = 1
        loss, stats = 0.0, None
        for opts, w in losses:
            res = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, chosen_lengths=chosen_len,
                           rejected_lengths=rejected_len, pair_weights=weights, options=opts,
                           return_stats=True)
            loss = loss + w * res.loss
            stats = res.stats if stats is None else stats
        self._megaloss_log(mode, stats, out, shifted, inputs)
        loss = loss * scale
        if return_outputs:
            with torch.no_grad():
                outputs = model(**{k: v for k, v in inputs.items() if k in _MODEL_KEYS})
            return loss, outputs
        return loss

    def _megaloss_log(self, mode: str, stats: torch.Tensor, out: Any, shifted: torch.Tensor,
                      inputs: Dict[str, Any]) -> None:
        acc = self.accelerator
        reduced = acc.reduce(stats.to(acc.device), reduction="sum")
        for name, value in dpo_metrics(reduced.cpu(), group=SINGLE_RANK).items():
            self._metrics[mode][name].append(value)
        m = shifted != 0
        chosen_m = m.chunk(2)[0]
        sums = torch.stack([
            (out.entropy.detach().to(torch.float64) * m).sum(), m.sum().to(torch.float64),
            (out.greedy_match.chunk(2)[0] & chosen_m).sum().to(torch.float64),
            chosen_m.sum().to(torch.float64),
            inputs["attention_mask"].sum().to(torch.float64)])
        ent, tokens, correct, chosen_tokens, attended = acc.reduce(
            sums.to(acc.device), reduction="sum").tolist()
        self._metrics[mode]["entropy"].append(ent / tokens if tokens > 0 else 0.0)
        if mode == "train":
            self._total_train_tokens += int(attended) // self._tp_size
        self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
        self._metrics[mode]["mean_token_accuracy"].append(
            correct / chosen_tokens if chosen_tokens > 0 else 0.0)


def _shifted(mask: torch.Tensor) -> torch.Tensor:
    """``completion_mask`` aligned with the shifted targets (position ``t`` predicts ``t+1``)."""
    return torch.cat([mask[:, 1:], torch.zeros_like(mask[:, :1])], dim=1)


def _chosen_valid(mask: torch.Tensor) -> torch.Tensor:
    """``[P]`` bool, the pairs whose chosen completion (the first half of the rows) has a
    token after the shift."""
    return _shifted(mask).chunk(2)[0].ne(0).any(-1)

