"""megaloss: losses for large-scale training that are cheap in memory and exact under any
parallel layout (chunked fused linear CE, vocab-parallel CE, global loss calibration, gathered
contrastive MNR), wired into DeepSpeed."""
from .calibration import (EngineScale, EngineScaleError, LossCalibrator, StepCalibration,
                          compute_loss_weights, probe_ddp, probe_deepspeed, probe_no_engine)
from .contrastive import MNROutput, MultipleNegativesRankingLoss, mnr_loss, mnr_loss_with_metrics
from .distributed import Topology
from .linear_cross_entropy import (CrossEntropyOutput, LinearCrossEntropyLoss,
                                   linear_cross_entropy, linear_cross_entropy_with_stats)
from .vocab_parallel import (VocabParallelLMHead, vocab_parallel_linear_cross_entropy,
                             vocab_parallel_linear_cross_entropy_with_stats)

__all__ = [
    "Topology",
    "LossCalibrator", "StepCalibration", "EngineScale", "EngineScaleError", "compute_loss_weights",
    "probe_ddp", "probe_deepspeed", "probe_no_engine",
    "mnr_loss", "mnr_loss_with_metrics", "MNROutput", "MultipleNegativesRankingLoss",
    "CrossEntropyOutput", "LinearCrossEntropyLoss", "linear_cross_entropy",
    "linear_cross_entropy_with_stats",
    "VocabParallelLMHead", "vocab_parallel_linear_cross_entropy",
    "vocab_parallel_linear_cross_entropy_with_stats",
]
__version__ = "0.1.0"
