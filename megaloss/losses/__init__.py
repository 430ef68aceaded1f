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
- :mod:`.multi_token`: DeepSeek-V3's multi-token prediction loss, every depth through the
  shared lm_head with the chunked (or vocab-parallel) CE, labels rolled inside packed samples,
  each depth calibrated by its own global count (imported from its module:
  ``from megaloss.losses.multi_token import multi_token_prediction_loss``).
- :mod:`.log_probs`: per-token log-probabilities (and entropy, log-sum-exp, greedy match) of
  the labels under the lm_head, chunked, on one device or vocab-parallel
  (:func:`linear_log_probs`, :class:`LinearLogProbs`, :class:`LogProbsOutput`).
- :mod:`.mnr`: gathered Multiple Negatives Ranking / InfoNCE with exact cross-rank gradients
  (:func:`mnr_loss`, :class:`MultipleNegativesRankingLoss`).
- :mod:`.policy`: policy-gradient losses (GRPO, BNPO / DAPO, Dr. GRPO, CISPO; PPO clipping, KL,
  entropy bonus, GSPO's sequence ratio) on per-token log-probs, normalised over the global
  batch by the calibrator (:func:`policy_loss`).
- :mod:`.policy_options`: :class:`PolicyLossOptions`, the options of :func:`policy_loss`.
- :mod:`.dpo`: preference losses (DPO sigmoid, IPO and TRL's other pairwise types) on sequence
  log-probs (:func:`dpo_loss`).
- :mod:`.orpo`: ORPO's odds-ratio loss plus NLL on sequence log-probs (:func:`orpo_loss`), and
  the step's pair / NLL-token weights the sequence-level preference losses share
  (:func:`preference_weights`).
- :mod:`.simpo`: CPO (sigmoid / hinge / IPO, plus NLL) and SimPO on sequence log-probs
  (:func:`cpo_loss`, :func:`simpo_loss`).
- :mod:`.kto`: KTO (desirable / undesirable examples against a KL baseline) on sequence
  log-probs (:func:`kto_loss`, :func:`kto_kl_baseline`).
- :mod:`.preference`: DPO, CPO / SimPO, ORPO and KTO behind one call, the loss chosen by its
  options' type (:func:`sequence_preference_loss`). The four losses are one base,
  ``_preference.py``: each supplies its per-pair (KTO: per-example) math, the driver does the
  weighting, the NLL term, the stats and the metrics.
- :mod:`.grad_cache`: GradCache, a contrastive loss over a batch embedded a mini-batch at a time
  (:func:`grad_cache_step`, :func:`split_rows`).

Each loss's options class is defined beside it (the vocabulary-level losses' in
:mod:`megaloss.ops`, whose kernels read them). ``__all__`` is what a user calls (the losses, their
modules, options and ``*Output`` types, and the step weights and metrics of each); the helpers
(metric names, loss-type tuples, :func:`~.vocab_parallel.vocab_shard_range`, ...) are imported
from their modules. Deprecated names are :mod:`megaloss._deprecated` (``import megaloss`` exposes
them).
"""
from ..ops.cross_entropy_options import CrossEntropyOptions
from ..ops.distillation_options import DistillationOptions
from ..ops.log_probs_options import LogProbsOptions
from . import grad_cache  # noqa: F401  (the module; the old function of that name is deprecated)
from .cross_entropy import CrossEntropyOutput, LinearCrossEntropyLoss, linear_cross_entropy
from .distillation import DistillationOutput, LinearDistillationLoss, linear_distillation_loss
from .dpo import DPOOptions, DPOOutput, dpo_loss, dpo_metrics, dpo_pair_weights, sequence_log_probs
from .grad_cache import GradCacheStep, grad_cache_step, split_rows
from .kto import KTOOptions, KTOOutput, kto_kl_baseline, kto_loss, kto_metrics
from .log_probs import LinearLogProbs, LogProbsOutput, linear_log_probs
from .mnr import MNROptions, MNROutput, MultipleNegativesRankingLoss, mnr_loss
from .orpo import ORPOOptions, ORPOOutput, orpo_loss, orpo_metrics, preference_weights
from .policy import (
    PolicyLossOutput,
    completion_labels,
    policy_calibrator,
    policy_loss,
    policy_loss_weights,
    policy_metrics,
)
from .policy_options import PolicyLossOptions
from .preference import sequence_preference_loss
from .simpo import CPOOptions, CPOOutput, cpo_loss, cpo_metrics, simpo_loss
from .vocab_parallel import VocabParallelOptions
from .vocab_parallel_embedding import VocabParallelEmbedding
from .vocab_parallel_head import VocabParallelLMHead

__all__ = [
    # cross-entropy (one device or vocab-parallel) and the vocab-parallel layout
    "linear_cross_entropy", "LinearCrossEntropyLoss", "CrossEntropyOutput", "CrossEntropyOptions",
    "VocabParallelOptions", "VocabParallelLMHead", "VocabParallelEmbedding",
    # per-token log-probabilities
    "linear_log_probs", "LinearLogProbs", "LogProbsOutput", "LogProbsOptions",
    # distillation
    "linear_distillation_loss", "LinearDistillationLoss", "DistillationOutput",
    "DistillationOptions",
    # contrastive
    "mnr_loss", "MultipleNegativesRankingLoss", "MNROutput", "MNROptions",
    "grad_cache_step", "GradCacheStep", "split_rows",
    # policy gradient
    "policy_loss", "PolicyLossOptions", "PolicyLossOutput", "policy_loss_weights",
    "policy_calibrator", "policy_metrics", "completion_labels",
    # preference
    "dpo_loss", "DPOOptions", "DPOOutput", "dpo_metrics", "dpo_pair_weights", "sequence_log_probs",
    "cpo_loss", "simpo_loss", "CPOOptions", "CPOOutput", "cpo_metrics",
    "orpo_loss", "ORPOOptions", "ORPOOutput", "orpo_metrics",
    "kto_loss", "KTOOptions", "KTOOutput", "kto_metrics", "kto_kl_baseline",
    "sequence_preference_loss", "preference_weights",
]
