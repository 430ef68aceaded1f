"""megaloss: losses for large-scale training that are cheap in memory and exact under any
parallel layout, wired into DeepSpeed.

The package is a stack; each layer imports only the layers above it in this list:

- :mod:`megaloss.ops`: single-device math: the one chunk driver
  (:mod:`~megaloss.ops.chunk_driver`) and each vocabulary-level loss's chunk kernel, the
  InfoNCE rows, the options;
- :mod:`megaloss.parallel`: process groups (:class:`Topology`; ``group=None`` is torch's default
  group everywhere) and collectives;
- :mod:`megaloss.calibration`: global loss calibration and the engine-factor probes;
- :mod:`megaloss.losses`: the linear CE (:func:`linear_cross_entropy`, on one device or
  vocab-parallel), the per-token log-probabilities (:func:`linear_log_probs`), gathered MNR,
  GradCache, the policy-gradient losses (:func:`policy_loss`, normalised by the calibration),
  DPO / IPO (:func:`dpo_loss`) and the linear distillation loss
  (:func:`linear_distillation_loss`);
- :mod:`megaloss.integrations`: DeepSpeed (:mod:`~megaloss.integrations.deepspeed`) and Hugging
  Face (:mod:`~megaloss.integrations.hf`) adapters;
- :mod:`megaloss.cli`: the console scripts (``megaloss-check-layout``, ``megaloss-comm-model``).

Beside the stack: :mod:`megaloss.testing` (``run_distributed``: spawned gloo processes for tests),
:mod:`megaloss.configs` (the shipped ds_configs), and the deprecated names
(:mod:`megaloss._deprecated`, which ``import megaloss`` exposes with a warning).

Return values: a loss function returns its loss tensor; ``return_stats=True`` returns its
``*Output`` NamedTuple (``loss`` first, then detached parts and counts). Per-token quantities
(:func:`linear_log_probs`) come as their Output always.

``import megaloss`` imports torch and nothing optional: the integration names below
(``MegalossConfig``, ``CausalLMWithLoss``, ...) are loaded on first use.
"""
from importlib import import_module
from typing import Any

from . import _deprecated
from .calibration import (
    EngineScale,
    EngineScaleError,
    LossCalibrator,
    StepCalibration,
    compute_loss_weights,
    probe_ddp,
    probe_fsdp,
    probe_no_engine,
)
from .losses import (
    CrossEntropyOutput,
    DistillationOutput,
    DPOOptions,
    DPOOutput,
    GradCacheStep,
    LinearCrossEntropyLoss,
    LinearDistillationLoss,
    LinearLogProbs,
    LogProbsOutput,
    MNROptions,
    MNROutput,
    MultipleNegativesRankingLoss,
    PolicyLossOptions,
    PolicyLossOutput,
    PolicyLossWeights,
    VocabParallelEmbedding,
    VocabParallelLMHead,
    VocabParallelOptions,
    completion_labels,
    dpo_loss,
    dpo_metrics,
    dpo_pair_weights,
    grad_cache_step,
    linear_cross_entropy,
    linear_distillation_loss,
    linear_log_probs,
    mnr_loss,
    policy_calibrator,
    policy_loss,
    policy_loss_weights,
    policy_metrics,
    sequence_log_probs,
    split_rows,
)
from .ops import CrossEntropyOptions, DistillationOptions, LogProbsOptions
from .ops.labels import causal_shift
from .parallel import (
    SINGLE_RANK,
    Topology,
    init_dp_tp_mesh,
    init_parallel_mesh,
    mark_tensor_parallel,
)

# loaded on first use (they import deepspeed / transformers)
_LAZY = {
    "MegalossConfig": "megaloss.integrations.config",
    "load_megaloss_config": "megaloss.integrations.config",
    "CausalLMWithLoss": "megaloss.integrations.hf.causal_lm",
    "CausalLMWithLogProbs": "megaloss.integrations.hf.causal_lm_log_probs",
    "CausalLMWithDistillation": "megaloss.integrations.hf.distillation",
}

__all__ = [
    # process groups
    "Topology", "SINGLE_RANK", "init_parallel_mesh", "init_dp_tp_mesh", "mark_tensor_parallel",
    # cross-entropy (one device or vocab-parallel)
    "CrossEntropyOptions", "VocabParallelOptions", "linear_cross_entropy",
    "LinearCrossEntropyLoss", "CrossEntropyOutput", "VocabParallelLMHead",
    "VocabParallelEmbedding", "causal_shift",
    # per-token log-probabilities (policy / preference losses)
    "LogProbsOptions", "linear_log_probs", "LinearLogProbs", "LogProbsOutput",
    # distillation
    "DistillationOptions", "linear_distillation_loss", "LinearDistillationLoss",
    "DistillationOutput",
    # contrastive
    "MNROptions", "mnr_loss", "MNROutput", "MultipleNegativesRankingLoss",
    "grad_cache_step", "GradCacheStep", "split_rows",
    # policy gradient and preference
    "PolicyLossOptions", "PolicyLossOutput", "PolicyLossWeights", "policy_loss",
    "policy_loss_weights", "policy_calibrator", "policy_metrics", "completion_labels",
    "DPOOptions", "DPOOutput", "dpo_loss", "dpo_pair_weights", "dpo_metrics", "sequence_log_probs",
    # calibration
    "LossCalibrator", "StepCalibration", "compute_loss_weights", "EngineScale",
    "EngineScaleError", "probe_no_engine", "probe_ddp", "probe_fsdp",
    # integrations (loaded on first use)
    *_LAZY,
]
__version__ = "0.2.0"


def __getattr__(name: str) -> Any:  # PEP 562: integration and deprecated names on first use
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name in _deprecated.__all__:
        return getattr(_deprecated, name)
    if name in _deprecated.MOVED:
        return _deprecated.moved(name)
    raise AttributeError(f"module 'megaloss' has no attribute {name!r}")
