"""Hugging Face ``transformers`` models as modules whose forward returns a megaloss loss (so
``engine.forward`` runs the loss: ZeRO-3 gathers the head's parameters there).

- :mod:`.causal_lm`: :class:`CausalLMWithLoss`, any ``*ForCausalLM`` with the chunked /
  vocab-parallel CE of its last hidden states, no logits; HF's label convention.
- :mod:`.causal_lm_log_probs`: :class:`CausalLMWithLogProbs`, the same with the per-token
  log-probs (and entropy) of the labels instead (policy-gradient and preference losses).
- :mod:`.distillation`: :class:`CausalLMWithDistillation`, a ``*ForCausalLM`` student with the
  chunked / vocab-parallel distillation loss towards a frozen teacher (module or stored top-k).
- :mod:`.head_config`: the logit transforms a model's config applies after its lm_head
  (Gemma 2's final soft-cap, honoured; Cohere's and Granite's logit scales, refused), read by
  both wrappers.
- :mod:`.embedding`: :class:`EmbeddingModelWithMNR`, a mean-pooled bi-encoder with the gathered
  MNR loss, its gradient-cached forward, and the per-step gradient-accumulation weights of that
  loss.
- :mod:`.trainer`: :class:`~.trainer.MegalossTrainer`, ``transformers.Trainer`` with the chunked
  CE and global loss calibration (imports ``transformers``; not re-exported here).
- :mod:`.sentence_transformers`: ``GatheredMultipleNegativesRankingLoss`` and its GradCache form
  for ``SentenceTransformerTrainer`` (imports ``sentence_transformers``; not re-exported).
- :mod:`.trl_policy`: :class:`MegalossGRPOMixin`, a loss hook for TRL's ``GRPOTrainer``:
  :func:`megaloss.policy_loss` normalised over the global batch (imports neither TRL nor
  ``transformers``).
- :mod:`.trl_dpo`: :class:`MegalossDPOMixin`, TRL's ``DPOTrainer`` with megaloss's chunked
  sequence log-probs and :func:`megaloss.dpo_loss` over the global pairs (imports neither TRL
  nor ``transformers``).
- :mod:`.ulysses`: :func:`~.ulysses.enable_ulysses_attention`, attention through DeepSpeed's
  ``UlyssesSPAttentionHF`` over a Topology's SP group.

Importing this package does not import ``transformers``.
"""
from .causal_lm import CausalLMWithLoss, LinearCrossEntropyHead, causal_shift
from .causal_lm_log_probs import CausalLMWithLogProbs, LinearLogProbsHead
from .distillation import CausalLMWithDistillation, LinearDistillationHead
from .embedding import (
    EmbeddingModelWithMNR,
    EmbeddingOutput,
    cached_mnr_forward,
    mean_pool,
    step_loss_weights,
)
from .trl_dpo import MegalossDPOMixin, dpo_options_from_dpo_args
from .trl_policy import MegalossGRPOMixin, policy_options_from_grpo_args

__all__ = ["CausalLMWithLoss", "LinearCrossEntropyHead", "causal_shift",
           "CausalLMWithLogProbs", "LinearLogProbsHead",
           "CausalLMWithDistillation", "LinearDistillationHead",
           "EmbeddingModelWithMNR", "EmbeddingOutput", "cached_mnr_forward", "mean_pool",
           "step_loss_weights", "MegalossGRPOMixin", "policy_options_from_grpo_args",
           "MegalossDPOMixin", "dpo_options_from_dpo_args"]
