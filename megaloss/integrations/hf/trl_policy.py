"""A loss hook for TRL's ``GRPOTrainer``: :class:`MegalossGRPOMixin` replaces its loss by
:func:`megaloss.policy_loss`, normalised over the optimizer step's *global* batch for every
``loss_type``.

Usage (the mixin goes first, so its methods come before TRL's)::

    from trl import GRPOTrainer
    from megaloss.integrations.hf import MegalossGRPOMixin

    class Trainer(MegalossGRPOMixin, GRPOTrainer):
        pass

What it changes in TRL 1.16 (``trl/trainer/grpo_trainer.py``):

- ``__init__``: after TRL's own, the options are read from ``self.args`` and checked, so a
  setting the hook does not reproduce fails at construction, before any generation.
- ``_generate_and_score_completions``: after TRL's own, the generation batch's completion tokens
  and sequences are counted and summed over the processes (one ``accelerator.reduce`` of two
  numbers); TRL's ``split_tensor_dict`` hands these 0-dim tensors to every micro-batch whole, as
  it does ``num_items_in_batch``. A sequence is every row, as TRL counts them (its ``grpo``,
  ``sapo`` and ``luspo`` average over all rows, its ``dr_grpo`` divides by rows x
  ``max_completion_length``, also for rows ``mask_truncated_completions`` emptied); a subclass
  setting ``megaloss_count_empty_rows = False`` counts only rows with a completion token
  (:class:`~megaloss.PolicyLossOptions` ``count_empty_rows``).
- ``_compute_loss``: the per-token log-probs and entropies come from TRL's own
  ``_get_per_token_logps_and_entropies``; the loss is :func:`megaloss.policy_loss` with the
  weights of TRL's normaliser of each ``loss_type`` over that global batch:
  ``1 / (n_s N_sequences)`` (``grpo``, ``sapo``: each row's token mean, then the mean over
  rows), ``1 / N_tokens`` (``bnpo``, ``dapo``, ``cispo``, ``vespo``: the token mean),
  ``1 / N_sequences`` (``luspo``: each row's token sum, then the mean over rows) or
  ``1 / (N_sequences max_completion_length)`` (``dr_grpo``), times the number of processes
  (DDP and DeepSpeed average gradients over them; TRL's ``dapo`` / ``cispo`` / ``vespo`` scale
  the same way). TRL's own ``grpo`` / ``sapo`` / ``luspo`` / ``bnpo`` / ``dr_grpo`` normalise
  per micro-batch and process instead, so with uneven completion lengths their gradient depends
  on the split; these are the single-device gradient of the generation batch, and on one
  micro-batch on one process they equal TRL's loss, also with fully masked rows. Metrics:
  ``kl``, ``entropy``, ``clip_ratio/low_mean`` / ``high_mean`` / ``region_mean`` (PPO types,
  ``luspo`` included), ``cispo_clip_ratio`` or ``vespo/phi_seq_mean`` (none for ``sapo``, as
  TRL) per micro-batch, globally reduced, in TRL's ``_metrics``.

The options come from TRL's ``GRPOConfig`` (``loss_type``, ``epsilon``, ``epsilon_high``,
``delta``, ``beta``, ``entropy_coef``, ``importance_sampling_level``, ``max_completion_length``;
``sapo_temperature_pos`` / ``sapo_temperature_neg`` for ``sapo``, ``vespo_k_pos`` /
``vespo_lambda_pos`` / ``vespo_k_neg`` / ``vespo_lambda_neg`` for ``vespo``, read only for
their loss type, as TRL reads them). Every TRL 1.16 ``loss_type`` is mapped: ``grpo``,
``bnpo``, ``dapo``, ``dr_grpo``, ``cispo`` (MiniMax-M1, arXiv:2506.13585), ``sapo`` (SAPO,
arXiv:2511.20347), ``luspo`` (LUSPO, arXiv:2602.05261; TRL recommends
``importance_sampling_level="sequence"``, both levels are reproduced) and ``vespo`` (VESPO,
arXiv:2602.10693); the formulas are in :mod:`megaloss.losses.policy`.
Refused (ValueError at construction): ``steps_per_generation`` other than
``gradient_accumulation_steps`` (a generation batch must be one optimizer step for the counts to
be the step's), ``loss_type`` outside megaloss's, ``top_entropy_quantile < 1``,
``off_policy_mask_threshold``, vLLM importance-sampling correction, adaptive entropy,
``use_bias_correction_kl`` with ``beta > 0`` (TRL reads it only inside ``if self.beta != 0.0``,
so its default ``True`` is accepted at ``beta = 0``), MoE auxiliary loss: TRL features this hook
does not reproduce; also a ``sapo_temperature_*`` that is not a finite number ``> 0``, a
``vespo_k_*`` that is not finite ``>= 0`` or a ``vespo_lambda_*`` that is not finite ``> 0``
(ValueError naming the field, from :class:`~megaloss.PolicyLossOptions`: TRL divides by the
temperature, and clamps ``lambda`` to ``>= 1e-4`` where megaloss refuses ``lambda <= 0``).
For ``vespo`` the vLLM importance-sampling ratio TRL folds into the Gamma weight is refused
with the rest of the vLLM correction. ``delta`` is passed on and, as in TRL, ignored by
``cispo``, ``sapo`` and ``vespo``. One difference below float32 resolution: TRL picks SAPO's
temperature (and VESPO's ``k`` / ``lambda``) per token with ``torch.where`` of Python floats,
which rounds them to torch's default dtype (float32: ``1.05`` becomes ``1.0499999523``);
megaloss keeps them in the log-probs' dtype.

Tested on one process against TRL's own ``_compute_loss`` (also with fully masked rows, every
``loss_type``) and across split micro-batches (``tests/integrations/test_hf_trl_policy.py``);
on 2 processes, GRPOTrainer runs with generation under DDP and under DeepSpeed ZeRO-2 (the
``deepspeed`` launcher, CPU) log the loss and grad norm of TRL's own run for ``grpo`` and
``dapo`` (``tests/integrations/test_hf_trl_policy_distributed.py``).
"""
from __future__ import annotations

from typing import Any, Dict

import torch

from ...losses.policy import PolicyLossWeights, policy_loss, policy_metrics
from ...losses.policy_options import PolicyLossOptions
from ...parallel.groups import SINGLE_RANK

__all__ = ["MegalossGRPOMixin", "policy_options_from_grpo_args"]

_COUNT_KEYS = ("megaloss_num_tokens", "megaloss_num_sequences")
# The loss types the hook maps from a GRPOConfig: all of TRL 1.16's, each with the GRPOConfig
# fields only it reads (TRL's GRPOTrainer._compute_loss / get_gamma_weights).
_MIXIN_LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo", "cispo", "sapo", "luspo", "vespo")
_TYPE_FIELDS = {
    "sapo": ("sapo_temperature_pos", "sapo_temperature_neg"),
    "vespo": ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"),
}


def policy_options_from_grpo_args(args: Any, *, count_empty_rows: bool = True
                                  ) -> PolicyLossOptions:
    """:class:`~megaloss.PolicyLossOptions` from a TRL ``GRPOConfig`` (``epsilon`` is
    ``epsilon_low``; ``epsilon_high`` defaults to it, as in TRL; the ``sapo_*`` / ``vespo_*``
    fields only for ``loss_type="sapo"`` / ``"vespo"``).

    Args:
        args: a ``trl.GRPOConfig`` (or an object with its attributes).
        count_empty_rows: the options' ``count_empty_rows``; ``True`` (default) is TRL's row
            count (module docstring).

    Raises:
        ValueError: a setting the hook does not reproduce (module docstring), or an option out of
            range (naming the field, e.g. ``sapo_temperature_neg`` or ``vespo_lambda_pos``).
        TypeError: ``count_empty_rows`` not a bool (from :class:`~megaloss.PolicyLossOptions`).
    """
    if args.loss_type not in _MIXIN_LOSS_TYPES:
        raise ValueError(f"loss_type={args.loss_type!r}: MegalossGRPOMixin supports "
                         f"{_MIXIN_LOSS_TYPES}")
    unsupported = {
        "top_entropy_quantile": getattr(args, "top_entropy_quantile", 1.0) < 1.0,
        "off_policy_mask_threshold": getattr(args, "off_policy_mask_threshold", None) is not None,
        "vllm_importance_sampling_correction": bool(getattr(args, "use_vllm", False)) and bool(
            getattr(args, "vllm_importance_sampling_correction", False)),
        "use_adaptive_entropy": bool(getattr(args, "use_adaptive_entropy", False)),
        # TRL multiplies the KL by the ratio only inside `if self.beta != 0.0`.
        "use_bias_correction_kl": args.beta != 0 and bool(
            getattr(args, "use_bias_correction_kl", False)),
    }
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise ValueError(f"MegalossGRPOMixin does not reproduce {', '.join(bad)}; unset them or "
                         "use TRL's own loss")
    spg, gas = getattr(args, "steps_per_generation", None), args.gradient_accumulation_steps
    if spg is not None and spg != gas:
        raise ValueError(f"steps_per_generation={spg} must equal gradient_accumulation_steps="
                         f"{gas}: the completion counts are those of one generation batch, which "
                         "must be one optimizer step")
    eps_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    # A loss type's own GRPOConfig fields are read (and checked) only for it, as TRL reads them.
    own = {name: getattr(args, name) for name in _TYPE_FIELDS.get(args.loss_type, ())
           if hasattr(args, name)}
    return PolicyLossOptions(
        loss_type=args.loss_type, epsilon_low=args.epsilon, epsilon_high=eps_high,
        delta=getattr(args, "delta", None), beta=args.beta,
        entropy_coef=getattr(args, "entropy_coef", 0.0),
        importance_sampling_level=args.importance_sampling_level,
        max_completion_length=args.max_completion_length, count_empty_rows=count_empty_rows,
        **own)


def _mask(inputs: Dict[str, Any]) -> torch.Tensor:
    mask = inputs["completion_mask"]
    return mask if "tool_mask" not in inputs else mask * inputs["tool_mask"]


class MegalossGRPOMixin:
    """Put before ``trl.GRPOTrainer`` in the bases (module docstring).

    Attributes:
        megaloss_count_empty_rows: class attribute, the options' ``count_empty_rows``: ``True``
            (TRL's convention: every row is a sequence) or ``False`` (only rows with a
            completion token).

    Raises:
        ValueError: at construction, a ``GRPOConfig`` setting the hook does not reproduce
            (module docstring).
    """

    megaloss_count_empty_rows: bool = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # GRPOTrainer(model, reward_funcs, args, ...): refuse before TRL builds anything (its
        # reference model, vLLM), and again on the args TRL settled on (its default config).
        config = kwargs.get("args", args[2] if len(args) > 2 else None)
        if config is not None:
            policy_options_from_grpo_args(config, count_empty_rows=self.megaloss_count_empty_rows)
        super().__init__(*args, **kwargs)
        self._megaloss_options()  # refuse now rather than after the first generation

    def _megaloss_options(self) -> PolicyLossOptions:
        """The options of ``self.args`` (read at every loss: TRL's args may be edited)."""
        opts = policy_options_from_grpo_args(self.args,
                                             count_empty_rows=self.megaloss_count_empty_rows)
        if getattr(self, "aux_loss_enabled", False):
            raise ValueError("MegalossGRPOMixin does not add the MoE auxiliary loss")
        return opts

    def _generate_and_score_completions(self, inputs: Any) -> Dict[str, Any]:
        out = super()._generate_and_score_completions(inputs)
        valid = _mask(out) != 0
        rows = (torch.tensor(valid.shape[0], device=valid.device)
                if self.megaloss_count_empty_rows else valid.any(-1).sum())
        local = torch.stack([valid.sum(), rows]).to(torch.float64)
        total = self.accelerator.reduce(local, reduction="sum")
        for key, value in zip(_COUNT_KEYS, total):
            out[key] = value.reshape(())
        return out

    def _compute_loss(self, model: Any, inputs: Dict[str, Any]) -> torch.Tensor:
        opts = self._megaloss_options()
        # As TRL's _compute_loss: the completion's per-token log-probs and entropies.
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids = inputs["completion_ids"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, inputs["completion_mask"]], dim=1)
        extra = {k: inputs.get(k) for k in (
            "pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask",
            "spatial_shapes", "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids",
            "image_position_ids")}
        log_probs, entropy, _ = self._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, completion_ids.size(1), compute_entropy=True,
            compute_aux_loss=False, **extra)
        mask = _mask(inputs)
        valid = mask != 0
        n_tokens, n_seqs = (inputs[k].to(torch.float64).clamp(min=1.0) for k in _COUNT_KEYS)
        m = valid.to(torch.float64)
        # TRL's normaliser of each loss_type, over the generation batch (module docstring)
        if opts.loss_type in ("grpo", "sapo"):
            loss_w = m / (m.sum(-1, keepdim=True).clamp(min=1.0) * n_seqs)
        elif opts.loss_type == "dr_grpo":
            loss_w = m / (n_seqs * opts.max_completion_length)
        elif opts.loss_type == "luspo":
            loss_w = m / n_seqs
        else:  # bnpo, dapo, cispo, vespo
            loss_w = m / n_tokens
        dtype = log_probs.dtype
        weights = PolicyLossWeights(loss_w.to(dtype), (m / n_tokens).to(dtype))
        out = policy_loss(log_probs, inputs.get("old_per_token_logps"), inputs["advantages"],
                          mask, ref_log_probs=inputs.get("ref_per_token_logps"),
                          entropy=entropy, weights=weights, options=opts, return_stats=True)
        mode = "train" if self.model.training else "eval"
        stats = self.accelerator.reduce(out.stats, reduction="sum")
        for name, value in policy_metrics(stats, opts, group=SINGLE_RANK).items():
            self._metrics[mode][name].append(value)
        return out.loss * self.accelerator.num_processes
