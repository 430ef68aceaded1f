r"""The per-token statistics of one chunk of cross-entropy and the loss computed from them: the
leaf that both chunk epilogues (the torch one in :mod:`megaloss.ops.cross_entropy_chunk`, the
Triton one in :mod:`megaloss.ops.triton_epilogue`) import, so neither imports the other.

Per token ``t`` of a chunk, over this device's vocabulary slice, an epilogue produces its local
max ``m``; the slices' maxima are combined into the global ``M = reduce_max(m)``; then the stacked
sums

    ``stats = [sum_j exp(y_j - M), y_target, (sum_j y_j)]``

(the target logit is 0 on slices that do not hold the target; the sum of logits only with label
smoothing) are combined with one ``reduce_sum`` (Megatron-core's
``tensor_parallel/cross_entropy.py`` exchanges the same statistics), and :func:`loss_from_stats`
turns them into ``lse = M + log(sum-exp)`` and the loss (formula in
:mod:`megaloss.ops.cross_entropy_chunk`).
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Tuple

import torch

from .options import CrossEntropyOptions

__all__ = ["ChunkResult", "Reduce", "no_reduce", "stats_dtype", "loss_from_stats"]

Reduce = Callable[[torch.Tensor], torch.Tensor]


def no_reduce(t: torch.Tensor) -> torch.Tensor:
    """The combiner of a vocabulary held whole on one device: nothing to combine."""
    return t


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half/bf16/fp32 inputs, fp64 for fp64 inputs."""
    return torch.promote_types(dtype, torch.float32)


class ChunkResult(NamedTuple):
    """``loss [C]`` (0 at ignored tokens) and ``lse [C]`` in the stats dtype, ``grad_logits
    [C, V_local]`` (already multiplied by the per-token ``coef``; ``None`` when not asked for):
    in the stats dtype from the torch epilogue, in the logits' (compute) dtype from the Triton
    one, which writes it over the logits."""

    loss: torch.Tensor
    lse: torch.Tensor
    grad_logits: Optional[torch.Tensor]


def loss_from_stats(row_max: torch.Tensor, stats: torch.Tensor, labels: torch.Tensor,
                    opts: CrossEntropyOptions, vocab_size: int) -> Tuple[torch.Tensor,
                                                                         torch.Tensor]:
    """``(loss [C], lse [C])`` from the combined statistics of a chunk.

    Args:
        row_max: ``[C]`` global max of each token's (soft-capped) logits.
        stats: ``[2 or 3, C]`` summed over the vocabulary slices: sum-exp relative to
            ``row_max``, target logit, and (with ``opts.label_smoothing > 0``) sum of logits.
        labels: ``[C]`` global ids or ``opts.ignore_index`` (ignored tokens get loss 0).
        opts: ``label_smoothing``, ``z_loss`` and ``ignore_index`` are read.
        vocab_size: the global ``V`` (label smoothing divides by it).
    """
    eps = opts.label_smoothing
    lse = row_max + torch.log(stats[0])
    loss = lse - (1.0 - eps) * stats[1] + opts.z_loss * lse * lse
    if eps > 0:
        loss = loss - (eps / vocab_size) * stats[2]
    loss = torch.where(labels != opts.ignore_index, loss, torch.zeros_like(loss))
    return loss, lse
