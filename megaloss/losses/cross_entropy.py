"""Chunked fused linear cross-entropy on one device: ``F.cross_entropy(F.linear(h, W, b), y)``
without ever holding the ``[tokens, vocab]`` logits.

Math (see :mod:`megaloss.ops.cross_entropy_chunk`): torch's cross-entropy with label smoothing,
plus the PaLM z-loss ``z_loss * logsumexp(logits)**2`` per valid token, on logits optionally
soft-capped as ``c * tanh(logits / c)`` (Gemma 2). Schedule (XTuner v1's chunked CE,
``xtuner/v1/loss/ce_loss.py``; Liger-Kernel's ``ops/fused_linear_cross_entropy.py``): see
:mod:`megaloss.ops.chunked_linear_ce`.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import nn

from ..ops.chunked_linear_ce import chunked_linear_cross_entropy
from ..ops.options import CrossEntropyOptions
from ..ops.validation import check_ce_tensors, check_label_range

__all__ = ["linear_cross_entropy", "linear_cross_entropy_with_stats", "LinearCrossEntropyLoss",
           "CrossEntropyOutput"]


class CrossEntropyOutput(NamedTuple):
    """What the ``*_with_stats`` entry points return.

    Attributes:
        loss: as :func:`linear_cross_entropy` returns it (differentiable; fp32, fp64 for fp64
            inputs; a scalar, or the shape of ``labels`` for ``reduction="none"``).
        z_loss: the z-loss part of ``loss``, same reduction and shape, no gradient (for logging).
        num_valid_tokens: int64 scalar, tokens whose label is not ``ignore_index``.
    """

    loss: torch.Tensor
    z_loss: torch.Tensor
    num_valid_tokens: torch.Tensor


def linear_cross_entropy_with_stats(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    loss_weights: Optional[torch.Tensor] = None,
    options: Optional[CrossEntropyOptions] = None,
) -> CrossEntropyOutput:
    """:func:`linear_cross_entropy` with its options as one
    :class:`~megaloss.ops.options.CrossEntropyOptions` (default options when ``None``), also
    returning the z-loss part and the valid-token count (:class:`CrossEntropyOutput`).

    Raises:
        ValueError / TypeError: as :func:`linear_cross_entropy`.
    """
    opts = CrossEntropyOptions() if options is None else options
    if not isinstance(opts, CrossEntropyOptions):
        raise TypeError(f"options must be a CrossEntropyOptions, got {type(opts).__name__}")
    check_ce_tensors(hidden_states, weight, labels, bias, loss_weights)
    vocab_size = weight.shape[0]
    check_label_range(labels, vocab_size, opts.ignore_index)
    shape = labels.shape
    flat_labels = labels.reshape(-1).long()
    loss, z = chunked_linear_cross_entropy(
        hidden_states.reshape(-1, hidden_states.shape[-1]), weight, bias, flat_labels,
        None if loss_weights is None else loss_weights.reshape(-1), opts, vocab_size=vocab_size)
    if opts.reduction == "none":
        loss, z = loss.view(shape), z.view(shape)
    return CrossEntropyOutput(loss, z, (flat_labels != opts.ignore_index).sum())


def linear_cross_entropy(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    loss_weights: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    logit_softcapping: Optional[float] = None,
    chunk_size: int = 1024,
    accum_dtype: torch.dtype = torch.float32,
    impl: str = "auto",
) -> torch.Tensor:
    """Cross-entropy of ``hidden_states @ weight.T + bias`` against ``labels``, chunked.

    Equal in value and gradients to
    ``F.cross_entropy(softcap(F.linear(hidden_states, weight, bias)), labels, ignore_index=...,
    label_smoothing=..., reduction=...)`` plus ``z_loss * logsumexp(logits)**2`` per valid token.

    Args:
        hidden_states: ``[..., H]`` float (fp32 / bf16 / fp16 / fp64), any strides.
        weight: ``[V, H]`` lm_head weight (may be tied to the input embedding, may be frozen);
            another floating dtype than ``hidden_states`` is promoted per chunk (autocast).
        labels: ``[...]`` integer class ids in ``[0, V)`` or ``ignore_index``, already shifted
            for causal LM (``labels[..., t]`` is the target of position ``t``).
        bias: optional ``[V]``.
        loss_weights: optional ``[...]`` float per-token weights (shape of ``labels``), e.g.
            from :class:`megaloss.LossCalibrator`.
        ignore_index, reduction, label_smoothing, z_loss, logit_softcapping, chunk_size,
            accum_dtype, impl: see :class:`~megaloss.ops.options.CrossEntropyOptions` (``impl``
            picks the chunk epilogue: the Triton kernels on CUDA, the torch one elsewhere).

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
    opts = CrossEntropyOptions(ignore_index=ignore_index, reduction=reduction,
                               label_smoothing=label_smoothing, z_loss=z_loss,
                               logit_softcapping=logit_softcapping, chunk_size=chunk_size,
                               accum_dtype=accum_dtype, impl=impl)
    return linear_cross_entropy_with_stats(hidden_states, weight, labels, bias=bias,
                                           loss_weights=loss_weights, options=opts).loss


class LinearCrossEntropyLoss(nn.Module):
    """Module form of :func:`linear_cross_entropy`.

    Args:
        options: a :class:`~megaloss.ops.options.CrossEntropyOptions`; or, instead, its fields
            as keyword arguments (``reduction="sum", z_loss=1e-4, ...``), validated here.

    ``forward(hidden_states [..., H], weight [V, H], labels [...], *, bias=None,
    loss_weights=None)`` returns the loss.

    Raises:
        ValueError / TypeError: bad options (at construction), bad tensors (in forward).
    """

    def __init__(self, options: Optional[CrossEntropyOptions] = None, **option_fields):
        super().__init__()
        if options is not None and option_fields:
            raise TypeError("pass either options or its fields as keyword arguments, not both")
        self.options = options if options is not None else CrossEntropyOptions(**option_fields)

    def forward(self, hidden_states: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                bias: Optional[torch.Tensor] = None,
                loss_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        return linear_cross_entropy_with_stats(hidden_states, weight, labels, bias=bias,
                                               loss_weights=loss_weights,
                                               options=self.options).loss

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.options.as_dict().items())
