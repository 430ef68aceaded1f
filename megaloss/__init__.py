"""megaloss: losses for large-scale training that are cheap in memory and exact under any
parallel layout (chunked fused linear CE, vocab-parallel CE, global loss calibration, gathered
contrastive MNR), wired into DeepSpeed."""
from .distributed import Topology

__all__ = ["Topology"]
__version__ = "0.1.0"
