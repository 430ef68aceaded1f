"""The GRPO job's policy module: a Hugging Face ``*ForCausalLM`` whose forward returns the
per-token log-probabilities of given targets (:func:`megaloss.linear_log_probs` on the decoder's
last hidden states and the lm_head weight, no ``[tokens, vocab]`` logits), the contract of
:func:`megaloss.integrations.deepspeed.policy_train_step`; the same log-probs give the SFT
phase's negative log-likelihood.

The model keeps its own ``nn.Linear`` lm_head, so ``model.generate`` samples the rollouts from
the very weights being trained (the whole head on every rank: tensor parallelism and ZeRO-3,
which would shard it, are refused by the job).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

__all__ = ["CausalLMLogProbs"]


class CausalLMLogProbs(nn.Module):
    """Wrap a ``transformers`` ``*ForCausalLM`` (``model.base_model`` the decoder,
    ``model.get_output_embeddings()`` an ``nn.Linear``).

    Args:
        model: the causal LM; it stays usable as is (``model.generate``).
        return_entropy: also return the per-token entropy (TRL's ``entropy`` metric).
        temperature: the log-probs are those of ``softmax(logits / temperature)``: set it to the
            sampling temperature for the policy loss (TRL does the same), 1 for SFT. An
            attribute, so a job can switch it between phases.

    ``forward(input_ids [B, T], shift_labels [B, T], attention_mask=None, position_ids=None)``
    returns a :class:`megaloss.LogProbsOutput` of shape ``[B, T]`` (``log_probs`` fp32, 0 where
    ``shift_labels`` is ``-100``).

    Raises:
        TypeError: ``model`` has no base model or no ``nn.Linear`` output embedding.
    """

    def __init__(self, model: nn.Module, *, return_entropy: bool = True,
                 temperature: float = 1.0) -> None:
        super().__init__()
        base = getattr(model, "base_model", None)
        if base is None or base is model:
            raise TypeError(f"model must be a *ForCausalLM with a base model, got "
                            f"{type(model).__name__}")
        if not isinstance(model.get_output_embeddings(), nn.Linear):
            raise TypeError("model's output embedding must be an nn.Linear, got "
                            f"{type(model.get_output_embeddings()).__name__}")
        self.model = model
        self.return_entropy = return_entropy
        self.temperature = temperature

    def forward(self, input_ids: torch.Tensor, shift_labels: torch.Tensor, *,
                attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None):
        from megaloss import linear_log_probs

        hidden = self.model.base_model(input_ids=input_ids, attention_mask=attention_mask,
                                       position_ids=position_ids,
                                       use_cache=False).last_hidden_state
        head = self.model.get_output_embeddings()
        return linear_log_probs(hidden, head.weight, shift_labels, bias=head.bias,
                                temperature=self.temperature, return_entropy=self.return_entropy)
