"""The losses, each a functional form and a module, built from :mod:`megaloss.ops` (math) and
:mod:`megaloss.parallel` (groups and collectives).

- :mod:`.cross_entropy`: chunked fused linear cross-entropy on one device.
- :mod:`.vocab_parallel`: the same with the lm_head split over the vocabulary across TP ranks.
- :mod:`.mnr`: gathered Multiple Negatives Ranking / InfoNCE with exact cross-rank gradients.
- :mod:`.grad_cache`: GradCache, a contrastive loss over a batch embedded a mini-batch at a time.
"""
from .cross_entropy import (CrossEntropyOutput, LinearCrossEntropyLoss, linear_cross_entropy,
                            linear_cross_entropy_with_stats)
from .grad_cache import GradCacheStep, grad_cache, split_rows
from .mnr import (SIMILARITIES, MNROutput, MultipleNegativesRankingLoss, mnr_loss,
                  mnr_loss_with_metrics)
from .vocab_parallel import (VocabParallelLMHead, vocab_parallel_linear_cross_entropy,
                             vocab_parallel_linear_cross_entropy_with_stats, vocab_shard_range)

__all__ = [
    "linear_cross_entropy", "linear_cross_entropy_with_stats", "LinearCrossEntropyLoss",
    "CrossEntropyOutput", "vocab_parallel_linear_cross_entropy",
    "vocab_parallel_linear_cross_entropy_with_stats", "VocabParallelLMHead", "vocab_shard_range",
    "mnr_loss", "mnr_loss_with_metrics", "MNROutput", "MultipleNegativesRankingLoss",
    "SIMILARITIES", "grad_cache", "GradCacheStep", "split_rows",
]
