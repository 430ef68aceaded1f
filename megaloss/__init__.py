"""megaloss: losses for large-scale training that are cheap in memory and exact under any
parallel layout, wired into DeepSpeed.

The public API, in the order of the stack (each layer imports only the ones above it):

- process groups: :class:`Topology`, the DeepSpeed ``mpu`` (:class:`DeepSpeedMPU`);
- losses: chunked fused linear CE (:func:`linear_cross_entropy`), its vocab-parallel form
  (:func:`vocab_parallel_linear_cross_entropy`, :class:`VocabParallelLMHead`), global loss
  calibration (:class:`LossCalibrator`, :func:`compute_loss_weights`, engine probes), the gathered
  contrastive MNR loss (:func:`mnr_loss`);
- integration: the ``"megaloss"`` ds_config section (:class:`MegalossConfig`) and the HF causal-LM
  wrapper (:class:`CausalLMWithLoss`); DeepSpeed engine hooks in :mod:`megaloss.deepspeed`.

Importing megaloss imports neither deepspeed nor transformers.
"""
from .distributed import Topology
from .distributed.mpu import DeepSpeedMPU, init_dp_tp_mesh, mark_tensor_parallel
from .linear_cross_entropy import (CrossEntropyOutput, LinearCrossEntropyLoss,
                                   linear_cross_entropy, linear_cross_entropy_with_stats)
from .vocab_parallel import (VocabParallelLMHead, vocab_parallel_linear_cross_entropy,
                             vocab_parallel_linear_cross_entropy_with_stats)
from .calibration import (EngineScale, EngineScaleError, LossCalibrator, StepCalibration,
                          compute_loss_weights, probe_ddp, probe_deepspeed, probe_no_engine)
from .contrastive import MNROutput, MultipleNegativesRankingLoss, mnr_loss, mnr_loss_with_metrics
from .integrations.config import CEConfig, MegalossConfig, MNRConfig, load_megaloss_config
from .integrations.hf import CausalLMWithLoss, causal_shift

__all__ = [
    # process groups
    "Topology", "DeepSpeedMPU", "init_dp_tp_mesh", "mark_tensor_parallel",
    # cross-entropy
    "linear_cross_entropy", "linear_cross_entropy_with_stats", "LinearCrossEntropyLoss",
    "CrossEntropyOutput", "vocab_parallel_linear_cross_entropy",
    "vocab_parallel_linear_cross_entropy_with_stats", "VocabParallelLMHead",
    # calibration
    "LossCalibrator", "StepCalibration", "compute_loss_weights", "EngineScale",
    "EngineScaleError", "probe_no_engine", "probe_ddp", "probe_deepspeed",
    # contrastive
    "mnr_loss", "mnr_loss_with_metrics", "MNROutput", "MultipleNegativesRankingLoss",
    # integration
    "MegalossConfig", "CEConfig", "MNRConfig", "load_megaloss_config", "CausalLMWithLoss",
    "causal_shift",
]
__version__ = "0.1.0"
