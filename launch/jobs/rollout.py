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

__all__ = ["generate_completions", "group_advantages", "Rollout", "make_rollout",
           "completion_log_probs"]


@torch.no_grad()
def generate_completions(model, prompts: torch.Tensor, length: int, *, num_generations: int = 1,
                         temperature: float = 1.0, greedy: bool = False) -> torch.Tensor:
    """``num_generations`` completions of exactly ``length`` tokens per prompt (rows of a
    prompt adjacent), int64 ``[n * num_generations, length]``, from ``model.generate``: pure
    sampling at ``temperature`` (no top-k / top-p), or greedy decoding. No end-of-sequence
    token stops a row early (the task's answers have a fixed length). Sampling draws from
    torch's global generator (seed it per rank and step). ``prompts`` may live anywhere
    (moved to ``model.device``); the completions come back on the CPU.
    """
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=not greedy, max_new_tokens=length,
                              min_new_tokens=length, temperature=1.0 if greedy else temperature,
                              top_k=None, top_p=None, eos_token_id=None, bos_token_id=None,
                              pad_token_id=0)
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
