"""Chunked fused linear cross-entropy on one device: ``F.cross_entropy(F.linear(h, W, b), y)``
without ever holding the ``[tokens, vocab]`` logits.

Math (see :mod:`megaloss.ops.cross_entropy_chunk`): torch's cross-entropy with label smoothing,
plus the PaLM z-loss ``z_loss * logsumexp(logits)**2`` per valid token, on logits optionally
soft-capped as ``c * tanh(logits / c)`` (Gemma 2). Schedule (XTuner v1, Liger FLCE): see
:mod:`megaloss.chunked_linear_ce`.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import nn

from ._validation import check_ce_options, check_ce_tensors, check_label_range
from .chunked_linear_ce import chunked_linear_cross_entropy
from .ops.cross_entropy_chunk import CrossEntropyOptions

__all__ = ["linear_cross_entropy", "linear_cross_entropy_with_stats", "LinearCrossEntropyLoss",
           "CrossEntropyOutput"]


class CrossEntropyOutput(NamedTuple):
    """``loss``: as :func:`linear_cross_entropy` returns it (differentiable).
    ``z_loss``: the z-loss part of ``loss``, same reduction, no gradient (for logging).
    ``num_valid_tokens``: int64 scalar tensor, tokens whose label is not ``ignore_index``."""

    loss: torch.Tensor
    z_loss: torch.Tensor
    num_valid_tokens: torch.Tensor


def linear_cross_entropy_with_stats(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    logit_softcapping: Optional[float] = None,
    loss_weights: Optional[torch.Tensor] = None,
    chunk_size: int = 1024,
    accum_dtype: torch.dtype = torch.float32,
) -> CrossEntropyOutput:
    """:func:`linear_cross_entropy` that also returns the z-loss part and the valid-token count."""
    check_ce_options(reduction=reduction, label_smoothing=label_smoothing, z_loss=z_loss,
                     logit_softcapping=logit_softcapping, chunk_size=chunk_size,
                     accum_dtype=accum_dtype, ignore_index=ignore_index)
    check_ce_tensors(hidden_states, weight, labels, bias, loss_weights)
    vocab_size = weight.shape[0]
    check_label_range(labels, vocab_size, ignore_index)
    opts = CrossEntropyOptions(vocab_size=vocab_size, ignore_index=ignore_index,
                               label_smoothing=label_smoothing, z_loss=z_loss,
                               logit_softcapping=logit_softcapping)
    shape = labels.shape
    flat_labels = labels.reshape(-1).long()
    loss, z = chunked_linear_cross_entropy(
        hidden_states.reshape(-1, hidden_states.shape[-1]), weight, bias, flat_labels,
        None if loss_weights is None else loss_weights.reshape(-1), opts,
        reduction=reduction, chunk_size=chunk_size, accum_dtype=accum_dtype)
    if reduction == "none":
        loss, z = loss.view(shape), z.view(shape)
    return CrossEntropyOutput(loss, z, (flat_labels != ignore_index).sum())


def linear_cross_entropy(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    logit_softcapping: Optional[float] = None,
    loss_weights: Optional[torch.Tensor] = None,
    chunk_size: int = 1024,
    accum_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Cross-entropy of ``hidden_states @ weight.T + bias`` against ``labels``, chunked.

    Equal in value and gradients to
    ``F.cross_entropy(softcap(F.linear(hidden_states, weight, bias)), labels, ignore_index=...,
    label_smoothing=..., reduction=...)`` plus ``z_loss * logsumexp(logits)**2`` per valid token.

    Args:
        hidden_states: ``[..., H]`` float (fp32 / bf16 / fp16 / fp64), any strides.
        weight: ``[V, H]`` lm_head weight (may be tied to the input embedding, may be frozen).
        labels: ``[...]`` integer class ids in ``[0, V)`` or ``ignore_index``, already shifted
            for causal LM.
        bias: optional ``[V]``.
        ignore_index: label value that contributes neither loss nor gradient.
        reduction: ``"mean"`` over valid tokens (with ``loss_weights``: ``sum(w*l)/sum(w)`` over
            valid tokens; 0.0 when no token is valid), ``"sum"`` (of ``w*l``), or ``"none"``
            (per-token ``w*l`` with the shape of ``labels``, 0 at ignored positions).
        label_smoothing: torch's definition (uniform over all V classes), in ``[0, 1]``.
        z_loss: coefficient of the PaLM z-loss ``logsumexp(logits)**2`` (0 disables it).
        logit_softcapping: ``c`` in Gemma 2's ``c * tanh(logits / c)``; ``None`` disables it.
        loss_weights: optional ``[...]`` per-token weights (shape of ``labels``).
        chunk_size: tokens per chunk; the working set is ``chunk_size x V`` fp32 logits.
        accum_dtype: dtype of the weight/bias gradient accumulation across chunks.

    Returns:
        fp32 scalar (fp64 for fp64 inputs), or ``[...]`` for ``reduction="none"``.

    Raises:
        ValueError: a label outside ``[0, V)`` that is not ``ignore_index``; shape mismatches
            (``labels`` vs ``hidden_states[..., :-1]``, ``weight`` hidden size, ``bias``,
            ``loss_weights``); inputs on different devices; an option out of range.
        TypeError: non-tensor inputs, non-floating hidden states/weight, non-integer labels.

    Gradients of ``hidden_states``, ``weight`` and ``bias`` are computed chunk by chunk in the
    forward pass (``"mean"``/``"sum"``) and scaled by ``grad_output`` in backward; with
    ``"none"`` backward recomputes the logits chunk by chunk and honours a per-token
    ``grad_output``. Inputs without ``requires_grad`` cost no gradient work.
    """
    return linear_cross_entropy_with_stats(
        hidden_states, weight, labels, bias=bias, ignore_index=ignore_index, reduction=reduction,
        label_smoothing=label_smoothing, z_loss=z_loss, logit_softcapping=logit_softcapping,
        loss_weights=loss_weights, chunk_size=chunk_size, accum_dtype=accum_dtype).loss


class LinearCrossEntropyLoss(nn.Module):
    """Module form of :func:`linear_cross_entropy`; options are fixed at construction
    (validated there), tensors are passed to ``forward(hidden_states, weight, labels, *,
    bias=None, loss_weights=None)``."""

    def __init__(self, *, ignore_index: int = -100, reduction: str = "mean",
                 label_smoothing: float = 0.0, z_loss: float = 0.0,
                 logit_softcapping: Optional[float] = None, chunk_size: int = 1024,
                 accum_dtype: torch.dtype = torch.float32):
        super().__init__()
        check_ce_options(reduction=reduction, label_smoothing=label_smoothing, z_loss=z_loss,
                         logit_softcapping=logit_softcapping, chunk_size=chunk_size,
                         accum_dtype=accum_dtype, ignore_index=ignore_index)
        self.ignore_index, self.reduction = ignore_index, reduction
        self.label_smoothing, self.z_loss = label_smoothing, z_loss
        self.logit_softcapping, self.chunk_size = logit_softcapping, chunk_size
        self.accum_dtype = accum_dtype

    def options(self) -> dict:
        return dict(ignore_index=self.ignore_index, reduction=self.reduction,
                    label_smoothing=self.label_smoothing, z_loss=self.z_loss,
                    logit_softcapping=self.logit_softcapping, chunk_size=self.chunk_size,
                    accum_dtype=self.accum_dtype)

    def forward(self, hidden_states: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                bias: Optional[torch.Tensor] = None,
                loss_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        return linear_cross_entropy(hidden_states, weight, labels, bias=bias,
                                    loss_weights=loss_weights, **self.options())

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.options().items())
