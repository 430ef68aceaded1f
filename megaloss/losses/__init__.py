"""The losses, each a functional form and a module, built from :mod:`megaloss.ops` (math) and
:mod:`megaloss.parallel` (groups and collectives).

Return values (one rule for every loss): a loss function returns its loss tensor, like torch's
losses; ``return_stats=True`` returns its ``*Output`` NamedTuple, whose first field ``loss`` is
that tensor and whose other fields are detached parts and counts (what its ``*_metrics``
function reads). Functions that compute per-token quantities rather than a loss
(:func:`linear_log_probs`, :func:`sequence_log_probs`) return them always. Module forms take the
same ``options=`` (or the option fields as keywords), ``vocab_parallel_options=`` where the loss
has a vocab-parallel form, and ``forward(..., return_stats=False)``.

- :mod:`.cross_entropy`: the linear cross-entropy, :func:`linear_cross_entropy` (one device, or
  vocab-parallel with ``vocab_parallel_options``; class weights ``ce_weight``; token accuracy in
  :class:`CrossEntropyOutput`), and :class:`LinearCrossEntropyLoss`.
- :mod:`.vocab_parallel`: the layout every vocabulary-level loss shares (lm_head split over the
  vocabulary across TP ranks): :class:`VocabParallelOptions`, :func:`vocab_shard_range` and the
  one set-up of a call, :func:`~.vocab_parallel.vocab_layout`.
- :mod:`.vocab_parallel_head`: :class:`VocabParallelLMHead`, the lm_head shard as a module.
- :mod:`.vocab_parallel_embedding`: :class:`VocabParallelEmbedding`, the input embedding split
  the same way, which can share the head's shard (tied embeddings under TP).
- :mod:`.distillation`: knowledge distillation through both lm_heads without logits
  (:func:`linear_distillation_loss`, :class:`LinearDistillationLoss`; one device or
  vocab-parallel; full or top-k teacher).
- :mod:`.log_probs`: per-token log-probabilities (and entropy, log-sum-exp, greedy match) of
  the labels under the lm_head, chunked, on one device or vocab-parallel
  (:func:`linear_log_probs`, :class:`LinearLogProbs`, :class:`LogProbsOutput`).
- :mod:`.mnr`: gathered Multiple Negatives Ranking / InfoNCE with exact cross-rank gradients
  (:func:`mnr_loss`, :class:`MultipleNegativesRankingLoss`).
- :mod:`.policy`: policy-gradient losses (GRPO, BNPO / DAPO, Dr. GRPO, CISPO; PPO clipping, KL,
  entropy bonus, GSPO's sequence ratio) on per-token log-probs, normalised over the global
  batch by the calibrator (:func:`policy_loss`).
- :mod:`.dpo`: preference losses (DPO sigmoid, IPO) on sequence log-probs (:func:`dpo_loss`).
- :mod:`.orpo`: ORPO's odds-ratio loss plus NLL on sequence log-probs (:func:`orpo_loss`), and
  the step's pair / NLL-token weights the sequence-level preference losses share
  (:func:`preference_weights`).
- :mod:`.simpo`: CPO (sigmoid / hinge / IPO, plus NLL) and SimPO on sequence log-probs
  (:func:`cpo_loss`, :func:`simpo_loss`).
- :mod:`.kto`: KTO (desirable / undesirable examples against a KL baseline) on sequence
  log-probs (:func:`kto_loss`, :func:`kto_kl_baseline`).
- :mod:`.preference`: DPO, CPO / SimPO, ORPO and KTO behind one call, the loss chosen by its
  options' type (:func:`sequence_preference_loss`, :func:`preference_loss_kind`).
- :mod:`.grad_cache`: GradCache, a contrastive loss over a batch embedded a mini-batch at a time
  (:func:`grad_cache_step`, :func:`split_rows`).

Deprecated names are :mod:`megaloss._deprecated` (``import megaloss`` exposes them).
"""
from . import grad_cache  # noqa: F401  (the module; the old function of that name is deprecated)
from .cross_entropy import CrossEntropyOutput, LinearCrossEntropyLoss, linear_cross_entropy
from .distillation import DistillationOutput, LinearDistillationLoss, linear_distillation_loss
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
from .kto import (
    KTO_LOSS_TYPES,
    KTO_METRICS,
    KTOOptions,
    KTOOutput,
    kto_kl_baseline,
    kto_loss,
    kto_metrics,
)
from .log_probs import LinearLogProbs, LogProbsOutput, linear_log_probs
from .mnr import SIMILARITIES, MNROptions, MNROutput, MultipleNegativesRankingLoss, mnr_loss
from .orpo import (
    ORPO_METRICS,
    ORPOOptions,
    ORPOOutput,
    PreferenceWeights,
    orpo_loss,
    orpo_metrics,
    preference_weights,
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
from .preference import (
    PREFERENCE_LOSSES,
    PREFERENCE_OPTIONS,
    PreferenceOptions,
    preference_loss_kind,
    sequence_preference_loss,
)
from .simpo import (
    CPO_LOSS_TYPES,
    CPO_METRICS,
    CPOOptions,
    CPOOutput,
    cpo_loss,
    cpo_metrics,
    simpo_loss,
)
from .vocab_parallel import VocabParallelOptions, vocab_shard_range
from .vocab_parallel_embedding import VocabParallelEmbedding
from .vocab_parallel_head import VocabParallelLMHead

__all__ = [
    "linear_cross_entropy", "LinearCrossEntropyLoss", "CrossEntropyOutput",
    "VocabParallelOptions", "VocabParallelLMHead", "vocab_shard_range", "VocabParallelEmbedding",
    "linear_distillation_loss", "LinearDistillationLoss", "DistillationOutput",
    "mnr_loss", "MNROutput", "MNROptions", "MultipleNegativesRankingLoss",
    "SIMILARITIES", "grad_cache_step", "GradCacheStep", "split_rows",
    "policy_loss", "policy_loss_weights", "policy_loss_reduction", "policy_calibrator",
    "policy_metrics", "completion_labels", "PolicyLossOptions", "PolicyLossOutput",
    "PolicyLossWeights", "POLICY_METRICS", "dpo_loss", "dpo_pair_weights", "dpo_metrics",
    "sequence_log_probs", "DPOOptions", "DPOOutput", "DPO_METRICS",
    "linear_log_probs", "LinearLogProbs", "LogProbsOutput",
    "orpo_loss", "orpo_metrics", "ORPOOptions", "ORPOOutput", "ORPO_METRICS",
    "preference_weights", "PreferenceWeights",
    "cpo_loss", "simpo_loss", "cpo_metrics", "CPOOptions", "CPOOutput", "CPO_LOSS_TYPES",
    "CPO_METRICS",
    "kto_loss", "kto_kl_baseline", "kto_metrics", "KTOOptions", "KTOOutput", "KTO_LOSS_TYPES",
    "KTO_METRICS",
    "sequence_preference_loss", "preference_loss_kind", "PreferenceOptions",
    "PREFERENCE_OPTIONS", "PREFERENCE_LOSSES",
]
