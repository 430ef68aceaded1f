"""GRPO rollouts: a group of completions per prompt sampled with the model's own
``generate``, their rewards, group-normalised advantages, and the micro-batches
:func:`megaloss.integrations.deepspeed.policy_train_step` takes (with the old and reference
per-token log-probs).

Advantages as GRPO defines them (Shao et al. 2024, arXiv:2402.03300, section 4.1.2; TRL 1.16,
``trl/trainer/grpo_trainer.py``): ``A_i = (r_i - mean(r_group)) / (std(r_group) + 1e-4)``,
one value for every token of completion ``i``; ``scale_rewards=False`` drops the division
(Dr. GRPO, Liu et al. 2025, arXiv:2503.20783).

Layout of a rollout row: ``input_ids = prompt + completion`` (``T = P + L`` tokens, every
prompt of the task has ``P`` tokens and every completion ``L``, so nothing is padded);
``completion_mask[t] = 1`` where the *next* token is a completion token (``t = P - 1 ..
T - 2``), aligned with the shifted targets.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

__all__ = ["rollout_generation_config", "generate_completions", "group_advantages", "Rollout",
           "make_rollout", "completion_log_probs"]


# The model's generation_config fields whose neutral value is None: transformers fills each None
# of a given GenerationConfig from model.generation_config (transformers 5.24,
# generation/utils.py, _prepare_generation_config), and any of these set there changes what is
# sampled: an eos_token_id ends a row where it is drawn (the rest padded), or, with
# min_new_tokens, gets the score -inf at every step (MinNewTokensLengthLogitsProcessor); the
# others add a processor that masks or reshapes the distribution (_get_logits_processor).
_UNSET_FIELDS = ("eos_token_id", "forced_bos_token_id", "forced_eos_token_id", "suppress_tokens",
                 "begin_suppress_tokens", "bad_words_ids", "sequence_bias",
                 "exponential_decay_length_penalty", "min_p", "top_h", "guidance_scale",
                 "watermarking_config")


def rollout_generation_config(model, length: int, *, temperature: float = 1.0,
                              greedy: bool = False):
    """The ``transformers.GenerationConfig`` of :func:`generate_completions`: exactly ``length``
    new tokens from ``softmax(logits / temperature)`` over the whole vocabulary (``top_k=0``,
    ``top_p=1``, no other processor), or greedy decoding; no end-of-sequence token. The policy
    loss scores the completions under that very distribution
    (:class:`launch.jobs.policy_model.CausalLMLogProbs` at ``temperature``), so it must be the
    one sampled: a truncated or masked sampler would make the training off-policy.

    Every field a processor reads is set to its neutral value here, since a ``None`` would be
    filled from ``model.generation_config`` (or transformers' defaults, e.g. ``top_k=50``).

    Raises:
        ValueError: ``length < 1``; ``temperature <= 0`` when sampling;
            ``model.generation_config`` sets a field with no neutral value to give
            (``eos_token_id``, ``suppress_tokens``, ...: :data:`_UNSET_FIELDS`) — build the
            model's config with ``bos/eos/pad_token_id=None``
            (:func:`launch.jobs.models.build_llama` does).
    """
    from transformers import GenerationConfig

    if not isinstance(length, int) or length < 1:
        raise ValueError(f"length must be an int >= 1, got {length!r}")
    if not greedy and not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    own = getattr(model, "generation_config", None)
    bad = {k: getattr(own, k, None) for k in _UNSET_FIELDS if getattr(own, k, None) is not None}
    if bad:
        raise ValueError(
            f"model.generation_config sets {bad}: transformers would apply it to every rollout "
            f"(an eos_token_id ends a row where it is drawn), so the completions would not be "
            f"drawn from the softmax(logits / temperature) the policy loss scores; set these to "
            f"None (build the model's config with bos/eos/pad_token_id=None)")
    neutral = dict(max_new_tokens=length, min_length=0, num_beams=1, repetition_penalty=1.0,
                   encoder_repetition_penalty=1.0, no_repeat_ngram_size=0,
                   encoder_no_repeat_ngram_size=0, remove_invalid_values=False,
                   renormalize_logits=False, eos_token_id=None, bos_token_id=None,
                   pad_token_id=0)
    if greedy:
        return GenerationConfig(do_sample=False, **neutral)
    return GenerationConfig(do_sample=True, temperature=float(temperature), top_k=0, top_p=1.0,
                            typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0, **neutral)


@torch.no_grad()
def generate_completions(model, prompts: torch.Tensor, length: int, *, num_generations: int = 1,
                         temperature: float = 1.0, greedy: bool = False) -> torch.Tensor:
    """``num_generations`` completions of exactly ``length`` tokens per prompt (rows of a
    prompt adjacent), int64 ``[n * num_generations, length]``, from ``model.generate`` under
    :func:`rollout_generation_config`: pure sampling from ``softmax(logits / temperature)``
    over the whole vocabulary (no top-k / top-p, no masked token), or greedy decoding. No
    end-of-sequence token stops a row early (the task's answers have a fixed length). Sampling
    draws from torch's global generator (seed it per rank and step). ``prompts`` may live
    anywhere (moved to ``model.device``); the completions come back on the CPU.

    Raises:
        ValueError: as :func:`rollout_generation_config`.
    """
    config = rollout_generation_config(model, length, temperature=temperature, greedy=greedy)
    ids = prompts.to(model.device).repeat_interleave(num_generations, dim=0)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                         generation_config=config)
    return out[:, prompts.shape[1]:].cpu()


def group_advantages(rewards: torch.Tensor, group_size: int, *, scale_rewards: bool = True,
                     eps: float = 1e-4) -> torch.Tensor:
    """float32 ``[n]``: each reward minus its group's mean (groups: ``group_size`` adjacent
    entries), divided by the group's standard deviation + ``eps`` when ``scale_rewards``.

    Raises:
        ValueError: ``rewards`` is not 1-D or its length is not a multiple of ``group_size``
            (>= 2).
    """
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 (a group's mean is the baseline), got "
                         f"{group_size}")
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a multiple of {group_size} entries, got "
                         f"shape {tuple(rewards.shape)}")
    r = rewards.float().view(-1, group_size)
    adv = r - r.mean(dim=1, keepdim=True)
    if scale_rewards:
        adv = adv / (r.std(dim=1, keepdim=True) + eps)
    return adv.reshape(-1)


@dataclass
class Rollout:
    """One rank's rollout of an optimizer step: ``input_ids [N, T]``, ``completion_mask [N, T]``
    (int64), ``advantages [N]``, ``rewards [N]``, and, once computed, ``old_log_probs`` /
    ``ref_log_probs [N, T]``."""

    input_ids: torch.Tensor
    completion_mask: torch.Tensor
    advantages: torch.Tensor
    rewards: torch.Tensor
    old_log_probs: Optional[torch.Tensor] = None
    ref_log_probs: Optional[torch.Tensor] = None

    def micro_batches(self, count: int) -> List[Dict[str, torch.Tensor]]:
        """The rows cut into ``count`` equal micro-batches (the dicts
        ``policy_train_step`` takes).

        Raises:
            ValueError: the row count is not a multiple of ``count``.
        """
        n = self.input_ids.shape[0]
        if n % count:
            raise ValueError(f"{n} rollout rows cannot be cut into {count} equal micro-batches")
        keys = ("input_ids", "completion_mask", "advantages", "old_log_probs", "ref_log_probs")
        parts = {k: getattr(self, k).chunk(count) for k in keys if getattr(self, k) is not None}
        return [{k: v[i] for k, v in parts.items()} for i in range(count)]


def make_rollout(prompts: torch.Tensor, completions: torch.Tensor, rewards: torch.Tensor,
                 group_size: int, *, scale_rewards: bool = True) -> Rollout:
    """The :class:`Rollout` of ``prompts [n, P]`` (one per group), their ``completions [n *
    group_size, L]`` and ``rewards [n * group_size]``."""
    ids = torch.cat([prompts.repeat_interleave(group_size, dim=0), completions], dim=1)
    mask = torch.zeros_like(ids)
    p = prompts.shape[1]
    mask[:, p - 1:ids.shape[1] - 1] = 1
    return Rollout(ids, mask, group_advantages(rewards, group_size, scale_rewards=scale_rewards),
                   rewards.float())


@torch.no_grad()
def completion_log_probs(module, rollout: Rollout, micro_batch_size: int,
                         device: torch.device | str = "cpu") -> torch.Tensor:
    """float32 ``[N, T]`` (on the CPU) per-token log-probs of the rollout's completion tokens
    (0 elsewhere) under ``module`` (a :class:`launch.jobs.policy_model.CausalLMLogProbs`, or the
    engine wrapping one; its weights on ``device``), ``micro_batch_size`` rows at a time: the
    old policy's or the reference's."""
    shifted = torch.full_like(rollout.input_ids, -100)
    shifted[:, :-1] = rollout.input_ids[:, 1:]
    labels = torch.where(rollout.completion_mask != 0, shifted, torch.full_like(shifted, -100))
    out = [module(ids.to(device), shift_labels=y.to(device)).log_probs.detach().float().cpu()
           for ids, y in zip(rollout.input_ids.split(micro_batch_size),
                             labels.split(micro_batch_size))]
    return torch.cat(out)
