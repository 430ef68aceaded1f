r"""The contract between the chunk driver (:mod:`megaloss.ops.chunk_driver`) and a loss's chunk
kernel, and the logit math every kernel shares.

A vocabulary-level loss is a :class:`ChunkKernel`: given one chunk's raw lm_head logits
``z = h W^T + b`` (``[C, V_local]``, this device's vocabulary slice), it returns the chunk's
per-token results and, when asked, the loss's gradient w.r.t. those logits. It never sees the
hidden states, the weight or the other chunks; the driver owns the loop, the GEMMs, the
gradient accumulation and the autograd schedule, the kernel only the math between them:

1. row statistics of this slice (max, sums), combined across slices by the
   :class:`VocabSlice`'s ``reduce_max`` / ``reduce_sum`` (identity on one device; two all-reduces
   of ``[tokens]``-sized tensors under tensor parallelism, as Megatron-core's
   ``tensor_parallel/cross_entropy.py`` exchanges them);
2. the per-token terms from the combined statistics;
3. the logit gradient, ``coef``-weighted per token.

Shared here: soft-capping (Gemma 2's ``c * tanh(z / c)``, arXiv:2408.00118) and its chain rule,
the label's column inside a vocabulary slice, and the statistics dtype (fp32, fp64 for fp64).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Sequence, Tuple

import torch

__all__ = ["ChunkKernel", "VocabSlice", "Reduce", "no_reduce", "stats_dtype", "softcap",
           "softcap_chain_", "LabelColumns", "label_columns", "where0"]

Reduce = Callable[[torch.Tensor], torch.Tensor]


def no_reduce(t: torch.Tensor) -> torch.Tensor:
    """The combiner of a vocabulary held whole on one device: nothing to combine."""
    return t


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half/bf16/fp32 inputs, fp64 for fp64 inputs."""
    return torch.promote_types(dtype, torch.float32)


@dataclass(frozen=True)
class VocabSlice:
    """This device's part of the vocabulary: ids ``[start, start + V_local)`` of ``vocab_size``
    (``V_local`` is the logits' width, possibly 0), and the in-place combiners of per-token
    statistics across the slices (identity on one device)."""

    vocab_size: int
    start: int = 0
    reduce_max: Reduce = no_reduce
    reduce_sum: Reduce = no_reduce


def softcap(logits: torch.Tensor, cap: Optional[float]
            ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(c * tanh(z / c), tanh(z / c))``, or ``(z, None)`` without a cap. ``logits`` itself is
    returned (no copy) when there is no cap."""
    if cap is None:
        return logits, None
    tanh = torch.tanh(logits / cap)
    return tanh * cap, tanh


def softcap_chain_(grad: torch.Tensor, tanh: Optional[torch.Tensor]) -> torch.Tensor:
    """``grad * (1 - tanh^2)`` in place: the gradient w.r.t. the capped logits carried to the raw
    ones (nothing without a cap)."""
    if tanh is not None:
        grad.mul_(1.0 - tanh * tanh)
    return grad


class LabelColumns(NamedTuple):
    """Where each token's label sits in a vocabulary slice: ``valid [C]`` (not
    ``ignore_index``), ``in_slice [C]`` (valid and held by this slice) and ``index [C, 1]``
    (its column, clamped into the slice for a ``gather`` that ``in_slice`` then masks)."""

    valid: torch.Tensor
    in_slice: torch.Tensor
    index: torch.Tensor


def label_columns(labels: torch.Tensor, ignore_index: int, vocab_start: int,
                  n_local: int) -> LabelColumns:
    """The :class:`LabelColumns` of global ``labels [C]`` in the slice ``[vocab_start,
    vocab_start + n_local)``."""
    valid = labels != ignore_index
    local = labels - vocab_start
    in_slice = valid & (local >= 0) & (local < n_local)
    return LabelColumns(valid, in_slice, local.clamp(0, max(n_local - 1, 0)).unsqueeze(1))


def where0(cond: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x`` where ``cond`` else 0, also where ``x`` is nan/inf (``0 * log 0`` terms)."""
    return torch.where(cond, x, torch.zeros((), dtype=x.dtype, device=x.device))


class ChunkKernel:
    """One vocabulary-level loss, a chunk of tokens at a time (the driver's side of the contract
    is :func:`megaloss.ops.chunk_driver.chunked_head`).

    A kernel object holds the call's token-indexed inputs (labels, a teacher, ...) for all
    ``N`` tokens, its options and its :class:`VocabSlice`; the driver hands it one chunk at a
    time as ``rows`` (a ``slice`` of ``range(N)``) with that chunk's logits.

    Class attributes a subclass sets:

    - ``n_outputs``: the number of per-token results ``forward`` returns (``[C]`` each, in the
      stats dtype);
    - ``n_differentiable``: how many of the first results carry gradients (the loss for a
      reduced loss; ``log_probs`` and ``entropy`` for the log-probabilities);
    - ``saved``: indices of the results ``backward`` needs again (e.g. the log-sum-exp).
    """

    n_outputs: int = 1
    n_differentiable: int = 1
    saved: Tuple[int, ...] = ()

    def forward(self, logits: torch.Tensor, rows: slice, coef: Optional[torch.Tensor]
                ) -> Tuple[Tuple[torch.Tensor, ...], Optional[torch.Tensor]]:
        """``(results, grad_logits)`` of one chunk.

        Args:
            logits: ``[C, V_local]`` raw logits in the compute dtype (the driver's buffer: the
                kernel may overwrite it).
            rows: the chunk's tokens.
            coef: ``[C]`` the upstream gradient of the first result per token, known before
                the loss is formed (the gradient-in-forward schedule), or ``None``: no gradient.

        Returns:
            ``n_outputs`` tensors ``[C]`` in the stats dtype, and ``dL/dz [C, V_local]`` (any
            floating dtype) or ``None`` when ``coef`` is ``None``.
        """
        raise NotImplementedError

    def backward(self, logits: torch.Tensor, rows: slice, saved: Sequence[torch.Tensor],
                 upstream: Sequence[Optional[torch.Tensor]]) -> torch.Tensor:
        """``dL/dz [C, V_local]`` of one chunk from its recomputed logits (the recompute
        schedule).

        Args:
            logits: ``[C, V_local]`` raw logits (may be overwritten).
            rows: the chunk's tokens.
            saved: the chunk's slices of the results named by ``saved``, in that order.
            upstream: per differentiable result, its upstream gradient ``[C]`` in the stats
                dtype, or ``None`` when it received none.
        """
        raise NotImplementedError
