"""Hugging Face ``transformers`` models as modules whose forward returns a megaloss loss (so
``engine.forward`` runs the loss: ZeRO-3 gathers the head's parameters there).

- :mod:`.causal_lm`: :class:`CausalLMWithLoss`, any ``*ForCausalLM`` with the chunked /
  vocab-parallel CE of its last hidden states, no logits; HF's label convention.
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
- :mod:`.ulysses`: :func:`~.ulysses.enable_ulysses_attention`, attention through DeepSpeed's
  ``UlyssesSPAttentionHF`` over a Topology's SP group.

Importing this package does not import ``transformers``.
"""
from .causal_lm import CausalLMWithLoss, LinearCrossEntropyHead, causal_shift
from .embedding import (
    EmbeddingModelWithMNR,
    EmbeddingOutput,
    cached_mnr_forward,
    mean_pool,
    step_loss_weights,
)
from .trl_policy import MegalossGRPOMixin, policy_options_from_grpo_args

__all__ = ["CausalLMWithLoss", "LinearCrossEntropyHead", "causal_shift",
           "EmbeddingModelWithMNR", "EmbeddingOutput", "cached_mnr_forward", "mean_pool",
           "step_loss_weights", "MegalossGRPOMixin", "policy_options_from_grpo_args"]
