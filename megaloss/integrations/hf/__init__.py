"""Hugging Face ``transformers`` models as modules whose forward returns a megaloss loss (so
``engine.forward`` runs the loss: ZeRO-3 gathers the head's parameters there).

- :mod:`.apply`: :func:`apply`, one call: a ``*ForCausalLM``'s own ``model(**batch)``
  computes megaloss's CE from its hidden states (its usual output, no logits), for the Hugging
  Face Trainer, accelerate loops and TRL unchanged.
- :mod:`.causal_lm`: :class:`CausalLMWithLoss`, any ``*ForCausalLM`` with the chunked /
  vocab-parallel CE of its last hidden states, no logits; HF's label convention; otherwise the
  model it wraps (forward without labels, ``generate``); its output with labels is
  :class:`~.outputs.CausalLMLossOutput` (:mod:`.outputs`, a ``ModelOutput``-compatible
  dataclass).
- :mod:`.causal_lm_log_probs`: :class:`CausalLMWithLogProbs`, the same with the per-token
  log-probs (and entropy) of the labels instead (policy-gradient and preference losses).
- :mod:`.distillation`: :class:`CausalLMWithDistillation`, a ``*ForCausalLM`` student with the
  chunked / vocab-parallel distillation loss towards a frozen teacher (module or stored top-k).
- the engine-neutral pieces the wrappers share with the AutoTP wrapper live one level down:
  :mod:`megaloss.integrations.lm_head` (the lm_head a wrapper replaces, the loss heads' base)
  and :mod:`megaloss.integrations.head_config` (the logit transforms a model's config applies
  after its lm_head: Gemma 2's final soft-cap, honoured; Cohere's and Granite's logit scales,
  refused).
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
from .apply import apply
from .causal_lm import CausalLMWithLoss
from .causal_lm_log_probs import CausalLMWithLogProbs
from .distillation import CausalLMWithDistillation
from .embedding import EmbeddingModelWithMNR, cached_mnr_forward
from .trl_dpo import MegalossDPOMixin
from .trl_policy import MegalossGRPOMixin

__all__ = ["CausalLMWithLoss", "CausalLMWithLogProbs", "CausalLMWithDistillation",
           "EmbeddingModelWithMNR", "cached_mnr_forward", "MegalossGRPOMixin",
           "MegalossDPOMixin", "apply"]
