r"""The per-token statistics of one chunk of cross-entropy and the loss computed from them: the
leaf that both chunk epilogues (the torch one in :mod:`megaloss.ops.cross_entropy_chunk`, the
Triton one in :mod:`megaloss.ops.triton_epilogue`) import, so neither imports the other.

Per token ``t`` of a chunk, over this device's vocabulary slice, an epilogue produces its local
max ``m``; the slices' maxima are combined into the global ``M = reduce_max(m)``; then the stacked
sums

    ``stats = [sum_j exp(y_j - M), y_target, (sum_j w_j y_j)]``

(the target logit is 0 on slices that do not hold the target; the last sum only with label
smoothing, ``w_j = 1`` without class weights) are combined with one ``reduce_sum``
(Megatron-core's ``tensor_parallel/cross_entropy.py`` exchanges the same statistics), and
:func:`loss_from_stats` turns them into ``lse = M + log(sum-exp)``, the loss (formula in
:mod:`megaloss.ops.cross_entropy_chunk`) and the greedy match ``y_target == M`` (a tie for the
maximum counts; exact under any vocabulary split, since the label's own logit is compared).
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch

from .cross_entropy_options import CrossEntropyOptions

__all__ = ["ChunkResult", "ClassWeights", "loss_from_stats"]


class ChunkResult(NamedTuple):
    """``loss [C]`` (0 at ignored tokens) and ``lse [C]`` in the stats dtype, ``grad_logits
    [C, V_local]`` (already multiplied by the per-token ``coef``; ``None`` when not asked for):
    in the stats dtype from the torch epilogue, in the logits' (compute) dtype from the Triton
    one, which writes it over the logits; ``correct [C]`` 1.0 where the label's logit is the
    maximum (0 at ignored tokens; ``None`` in the backward pass, which does not compute it)."""

    loss: torch.Tensor
    lse: torch.Tensor
    grad_logits: Optional[torch.Tensor]
    correct: Optional[torch.Tensor] = None


class ClassWeights(NamedTuple):
    """A chunk's view of the class weights ``w [V]`` (torch's ``F.cross_entropy(weight=...)``):
    ``of_label [C]`` the weight of each token's label (0 at ignored tokens), ``local
    [V_local]`` this slice's weights (stats dtype), ``total`` ``sum_j w_j`` over all ``V`` (a
    0-dim tensor of the stats dtype: no host sync per chunk, no graph break under
    ``torch.compile``)."""

    of_label: torch.Tensor
    local: torch.Tensor
    total: torch.Tensor


def loss_from_stats(row_max: torch.Tensor, stats: torch.Tensor, labels: torch.Tensor,
                    opts: CrossEntropyOptions, vocab_size: int,
                    class_weights: Optional[ClassWeights] = None
                    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss [C], lse [C], correct [C])`` from the combined statistics of a chunk.

    Args:
        row_max: ``[C]`` global max of each token's (soft-capped) logits.
        stats: ``[2 or 3, C]`` summed over the vocabulary slices: sum-exp relative to
            ``row_max``, target logit, and (with ``opts.label_smoothing > 0``) the
            (class-weighted) sum of logits.
        labels: ``[C]`` global ids or ``opts.ignore_index`` (ignored tokens get loss 0).
        opts: ``label_smoothing``, ``z_loss`` and ``ignore_index`` are read.
        vocab_size: the global ``V`` (label smoothing divides by it).
        class_weights: the chunk's :class:`ClassWeights`, or ``None`` (every class weight 1).
    """
    eps = opts.label_smoothing
    valid = labels != opts.ignore_index
    lse = row_max + torch.log(stats[0])
    if class_weights is None:
        loss = lse - (1.0 - eps) * stats[1] + opts.z_loss * lse * lse
        if eps > 0:
            loss = loss - (eps / vocab_size) * stats[2]
    else:
        w_y = class_weights.of_label
        loss = w_y * ((1.0 - eps) * (lse - stats[1]) + opts.z_loss * lse * lse)
        if eps > 0:
            loss = loss + (eps / vocab_size) * (class_weights.total * lse - stats[2])
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    correct = (valid & (stats[1] == row_max)).to(lse.dtype)
    return loss, lse, correct
