"""What the linear cross-entropy entry points return (a leaf module: the single-device and the
vocab-parallel paths both build it, and :mod:`.cross_entropy` dispatches between them)."""
from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["CrossEntropyOutput"]


class CrossEntropyOutput(NamedTuple):
    """What :func:`megaloss.linear_cross_entropy_with_stats` (and
    :meth:`megaloss.VocabParallelLMHead.forward_with_stats`) return.

    Attributes:
        loss: as :func:`megaloss.linear_cross_entropy` returns it (differentiable; fp32, fp64 for
            fp64 inputs; a scalar, or the shape of ``labels`` for ``reduction="none"``).
        z_loss: the z-loss part of ``loss``, same reduction and shape, no gradient (for logging).
        num_valid_tokens: int64 scalar, tokens whose label is not ``ignore_index``.
    """

    loss: torch.Tensor
    z_loss: torch.Tensor
    num_valid_tokens: torch.Tensor
