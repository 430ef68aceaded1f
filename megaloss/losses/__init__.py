"""The losses, each a functional form and a module, built from :mod:`megaloss.ops` (math) and
:mod:`megaloss.parallel` (groups and collectives).

- :mod:`.cross_entropy`: the linear cross-entropy entry points, :func:`linear_cross_entropy` and
  :func:`linear_cross_entropy_with_stats` (one device, or vocab-parallel with
  ``vocab_parallel_options``), and :class:`LinearCrossEntropyLoss`.
- :mod:`.vocab_parallel`: the vocab-parallel path (lm_head split over the vocabulary across TP
  ranks): :class:`VocabParallelOptions`, :class:`VocabParallelLMHead`, :func:`vocab_shard_range`.
- :mod:`.vocab_parallel_embedding`: :class:`VocabParallelEmbedding`, the input embedding split
  the same way, which can share the head's shard (tied embeddings under TP).
- :mod:`.distillation`: knowledge distillation through both lm_heads without logits
  (:func:`linear_distillation_loss`, :func:`linear_distillation_loss_with_stats`,
  :class:`LinearDistillationLoss`; one device or vocab-parallel; full or top-k teacher).
- :mod:`.ce_output`: :class:`CrossEntropyOutput`, what the ``*_with_stats`` forms return.
- :mod:`.log_probs`: per-token log-probabilities (and entropy, log-sum-exp, greedy match) of
  the labels under the lm_head, chunked, on one device or vocab-parallel
  (:func:`linear_log_probs`, :class:`LinearLogProbs`, :class:`LogProbsOutput`).
- :mod:`.mnr`: gathered Multiple Negatives Ranking / InfoNCE with exact cross-rank gradients
  (:func:`mnr_loss`, :func:`mnr_loss_with_stats`, :class:`MultipleNegativesRankingLoss`).
- :mod:`.policy`: policy-gradient losses (GRPO, BNPO / DAPO, Dr. GRPO, CISPO; PPO clipping, KL,
  entropy bonus, GSPO's sequence ratio) on per-token log-probs, normalised over the global
  batch by the calibrator (:func:`policy_loss`).
- :mod:`.dpo`: preference losses (DPO sigmoid, IPO) on sequence log-probs (:func:`dpo_loss`).
- :mod:`.grad_cache`: GradCache, a contrastive loss over a batch embedded a mini-batch at a time
  (:func:`grad_cache_step`, :func:`split_rows`).

Deprecated names (one release, with a DeprecationWarning): ``vocab_parallel_linear_cross_entropy``
and its ``_with_stats`` form, ``mnr_loss_with_metrics``.
"""
from . import grad_cache  # noqa: F401  (the module, no longer shadowed by a function)
from .ce_output import CrossEntropyOutput
from .cross_entropy import (
    LinearCrossEntropyLoss,
    linear_cross_entropy,
    linear_cross_entropy_with_stats,
)
from .distillation import (
    DistillationOutput,
    LinearDistillationLoss,
    linear_distillation_loss,
    linear_distillation_loss_with_stats,
)
from .dpo import (
    DPO_METRICS,
    DPOOptions,
    DPOOutput,
    dpo_loss,
    dpo_metrics,
    dpo_pair_weights,
    sequence_log_probs,
)
from .grad_cache import GradCacheStep, grad_cache_step, split_rows
from .log_probs import LinearLogProbs, LogProbsOutput, linear_log_probs
from .mnr import (
    SIMILARITIES,
    MNROptions,
    MNROutput,
    MultipleNegativesRankingLoss,
    mnr_loss,
    mnr_loss_with_metrics,  # noqa: F401 (deprecated name, kept one release)
    mnr_loss_with_stats,
)
from .policy import (
    POLICY_METRICS,
    PolicyLossOptions,
    PolicyLossOutput,
    PolicyLossWeights,
    completion_labels,
    policy_calibrator,
    policy_loss,
    policy_loss_reduction,
    policy_loss_weights,
    policy_metrics,
)
from .vocab_parallel import (
    VocabParallelLMHead,
    VocabParallelOptions,
    vocab_parallel_linear_cross_entropy,  # noqa: F401 (deprecated)
    vocab_parallel_linear_cross_entropy_with_stats,  # noqa: F401 (deprecated)
    vocab_shard_range,
)
from .vocab_parallel_embedding import VocabParallelEmbedding

__all__ = [
    "linear_cross_entropy", "linear_cross_entropy_with_stats", "LinearCrossEntropyLoss",
    "CrossEntropyOutput", "VocabParallelOptions", "VocabParallelLMHead", "vocab_shard_range",
    "VocabParallelEmbedding",
    "linear_distillation_loss", "linear_distillation_loss_with_stats", "LinearDistillationLoss",
    "DistillationOutput",
    "mnr_loss", "mnr_loss_with_stats", "MNROutput", "MNROptions", "MultipleNegativesRankingLoss",
    "SIMILARITIES", "grad_cache_step", "GradCacheStep", "split_rows",
    "policy_loss", "policy_loss_weights", "policy_loss_reduction", "policy_calibrator",
    "policy_metrics", "completion_labels", "PolicyLossOptions", "PolicyLossOutput",
    "PolicyLossWeights", "POLICY_METRICS", "dpo_loss", "dpo_pair_weights", "dpo_metrics",
    "sequence_log_probs", "DPOOptions", "DPOOutput", "DPO_METRICS",
    "linear_log_probs", "LinearLogProbs", "LogProbsOutput",
]
