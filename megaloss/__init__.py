"""megaloss: losses for large-scale training that are cheap in memory and exact under any
parallel layout, wired into DeepSpeed.

The package is a stack; each layer imports only the layers above it in this list:

- :mod:`megaloss.ops`: single-device math (chunk kernels, autograd Functions, options);
- :mod:`megaloss.parallel`: process groups (:class:`Topology`; ``group=None`` is torch's default
  group everywhere) and collectives;
- :mod:`megaloss.losses`: the linear CE (one entry point, :func:`linear_cross_entropy`, on one
  device or vocab-parallel), the per-token log-probabilities (:func:`linear_log_probs`),
  gathered MNR, GradCache (functional + module), the policy-gradient losses
  (:func:`policy_loss`), DPO / IPO (:func:`dpo_loss`) and the linear distillation loss
  (:func:`linear_distillation_loss`);
- :mod:`megaloss.calibration`: global loss calibration and the engine-factor probes;
- :mod:`megaloss.integrations`: DeepSpeed (:mod:`~megaloss.integrations.deepspeed`) and Hugging
  Face (:mod:`~megaloss.integrations.hf`) adapters.

Beside the stack: :mod:`megaloss.testing` (``run_distributed``: spawned gloo processes for tests).

``import megaloss`` imports torch and nothing optional: the integration names below
(``MegalossConfig``, ``CausalLMWithLoss``, ``DeepSpeedMPU``, ``probe_deepspeed``, ...) are loaded
on first use.

Renamed (the old names keep working for one release and emit a ``DeprecationWarning``):
``vocab_parallel_linear_cross_entropy[_with_stats]`` -> ``linear_cross_entropy[_with_stats]
(..., vocab_parallel_options=VocabParallelOptions(...))``; ``mnr_loss_with_metrics`` ->
``mnr_loss_with_stats``; ``gather=`` -> ``gather_across_ranks=``; ``grad_cache`` ->
``grad_cache_step``.
"""
from importlib import import_module
from typing import Any

from .calibration import (
    EngineScale,
    EngineScaleError,
    LossCalibrator,
    StepCalibration,
    compute_loss_weights,
    probe_ddp,
    probe_no_engine,
)

# deprecated aliases (one release; they warn when called), kept out of __all__
from .losses import (  # noqa: F401
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
    linear_cross_entropy_with_stats,
    linear_distillation_loss,
    linear_distillation_loss_with_stats,
    linear_log_probs,
    mnr_loss,
    mnr_loss_with_metrics,
    mnr_loss_with_stats,
    policy_calibrator,
    policy_loss,
    policy_loss_weights,
    policy_metrics,
    sequence_log_probs,
    split_rows,
    vocab_parallel_linear_cross_entropy,
    vocab_parallel_linear_cross_entropy_with_stats,
)
from .losses.grad_cache import grad_cache  # noqa: F401
from .ops import CrossEntropyOptions, DistillationOptions, LogProbsOptions
from .ops.labels import causal_shift
from .parallel import SINGLE_RANK, Topology, init_dp_tp_mesh, mark_tensor_parallel

_LAZY = {
    "MegalossConfig": "megaloss.integrations.deepspeed.config",
    "CEConfig": "megaloss.integrations.deepspeed.config",
    "MNRConfig": "megaloss.integrations.deepspeed.config",
    "PolicyConfig": "megaloss.integrations.deepspeed.config",
    "DPOConfig": "megaloss.integrations.deepspeed.config",
    "DistillationConfig": "megaloss.integrations.deepspeed.config",
    "load_megaloss_config": "megaloss.integrations.deepspeed.config",
    "DeepSpeedMPU": "megaloss.integrations.deepspeed.mpu",
    "probe_deepspeed": "megaloss.integrations.deepspeed.probe",
    "CausalLMWithLoss": "megaloss.integrations.hf.causal_lm",
    "CausalLMWithDistillation": "megaloss.integrations.hf.distillation",
    "EmbeddingModelWithMNR": "megaloss.integrations.hf.embedding",
}

__all__ = [
    # process groups
    "Topology", "SINGLE_RANK", "init_dp_tp_mesh", "mark_tensor_parallel",
    # cross-entropy
    "CrossEntropyOptions", "VocabParallelOptions", "linear_cross_entropy",
    "linear_cross_entropy_with_stats", "LinearCrossEntropyLoss", "CrossEntropyOutput",
    "VocabParallelLMHead", "VocabParallelEmbedding", "causal_shift",
    # per-token log-probabilities (policy / preference losses)
    "LogProbsOptions", "linear_log_probs", "LinearLogProbs", "LogProbsOutput",
    "VocabParallelLMHead", "causal_shift",
    # distillation
    "DistillationOptions", "linear_distillation_loss", "linear_distillation_loss_with_stats",
    "LinearDistillationLoss", "DistillationOutput",
    # contrastive
    "MNROptions", "mnr_loss", "mnr_loss_with_stats", "MNROutput", "MultipleNegativesRankingLoss",
    "grad_cache_step", "GradCacheStep", "split_rows",
    # policy gradient and preference
    "PolicyLossOptions", "PolicyLossOutput", "PolicyLossWeights", "policy_loss",
    "policy_loss_weights", "policy_calibrator", "policy_metrics", "completion_labels",
    "DPOOptions", "DPOOutput", "dpo_loss", "dpo_pair_weights", "dpo_metrics", "sequence_log_probs",
    # calibration
    "LossCalibrator", "StepCalibration", "compute_loss_weights", "EngineScale",
    "EngineScaleError", "probe_no_engine", "probe_ddp",
    # integration (loaded on first use)
    *_LAZY,
]
__version__ = "0.2.0"


def __getattr__(name: str) -> Any:  # PEP 562: integration names load on first use
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'megaloss' has no attribute {name!r}")
