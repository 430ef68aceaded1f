"""The GRPO job's policy module: :class:`megaloss.CausalLMWithLogProbs` (a Hugging Face
``*ForCausalLM`` whose forward returns the per-token log-probabilities of given targets,
:func:`megaloss.linear_log_probs` on the decoder's last hidden states, no ``[tokens, vocab]``
logits; ``megaloss/integrations/hf/causal_lm_log_probs.py``) with the job's defaults: the
entropy returned (TRL's ``entropy`` metric) and the temperature as constructor argument. Its
forward, ``module(input_ids, shift_labels=..., attention_mask=None)``, is the contract of
:func:`megaloss.integrations.deepspeed.policy_train_step`; the same log-probs give the SFT
phase's negative log-likelihood.

The library's head replaces the model's ``lm_head`` on the same Parameter objects and returns
logits when called without labels, so ``model.generate`` samples the rollouts from the very
weights being trained (the whole head on every rank: the job refuses tensor parallelism and
ZeRO-3).
"""
from __future__ import annotations

from torch import nn

from megaloss import CausalLMWithLogProbs, LogProbsOptions

__all__ = ["CausalLMLogProbs"]


class CausalLMLogProbs(CausalLMWithLogProbs):
    """:class:`megaloss.CausalLMWithLogProbs` on one TP rank with the job's options.

    Args:
        model: the causal LM; ``model.generate`` keeps working on it.
        return_entropy: also return the per-token entropy (default on).
        temperature: the log-probs are those of ``softmax(logits / temperature)``: the sampling
            temperature for the policy loss (TRL does the same), 1 for SFT; the ``temperature``
            attribute switches it between phases.

    Raises:
        TypeError: ``model`` has no base model or no ``nn.Linear`` output embedding.
        ValueError: the model's config scales its logits (Cohere's ``logit_scale``, Granite's
            ``logits_scaling``), which :func:`megaloss.linear_log_probs` cannot reproduce.
    """

    def __init__(self, model: nn.Module, *, return_entropy: bool = True,
                 temperature: float = 1.0) -> None:
        super().__init__(model, options=LogProbsOptions(return_entropy=return_entropy,
                                                        temperature=temperature))
