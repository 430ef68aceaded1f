"""The chunked fused linear cross-entropy ``F.cross_entropy(F.linear(h, W, b), y)`` without ever
holding the ``[tokens, vocab]`` logits: the one entry point (:func:`linear_cross_entropy`, and
:func:`linear_cross_entropy_with_stats` with the same signature), on one device or, given
``vocab_parallel_options``, over an lm_head split across tensor-parallel ranks (the math of that
path is :mod:`megaloss.losses.vocab_parallel`), and its module form.

Math (see :mod:`megaloss.ops.cross_entropy_chunk`): torch's cross-entropy with label smoothing,
plus the PaLM z-loss ``z_loss * logsumexp(logits)**2`` per valid token, on logits optionally
soft-capped as ``c * tanh(logits / c)`` (Gemma 2). Schedule (XTuner v1's chunked CE,
``xtuner/v1/loss/ce_loss.py``; Liger-Kernel's ``ops/fused_linear_cross_entropy.py``): see
:mod:`megaloss.ops.chunked_linear_ce`.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..ops.chunked_linear_ce import chunked_linear_cross_entropy
from ..ops.options import CrossEntropyOptions, resolve_options
from ..ops.validation import check_ce_tensors, check_label_range
from .ce_output import CrossEntropyOutput
from .vocab_parallel import (
    VocabParallelOptions,
    _check_vocab_parallel_options,
    sharded_linear_cross_entropy,
)

__all__ = ["linear_cross_entropy", "linear_cross_entropy_with_stats", "LinearCrossEntropyLoss",
           "CrossEntropyOutput", "VocabParallelOptions"]


def linear_cross_entropy_with_stats(
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
    options: Optional[CrossEntropyOptions] = None,
    vocab_parallel_options: Optional[VocabParallelOptions] = None,
) -> CrossEntropyOutput:
    """:func:`linear_cross_entropy` (same arguments, errors and loss), also returning the
    z-loss part and the valid-token count: a :class:`CrossEntropyOutput`."""
    opts = resolve_options(CrossEntropyOptions, options, dict(
        ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
        z_loss=z_loss, logit_softcapping=logit_softcapping, chunk_size=chunk_size,
        accum_dtype=accum_dtype, impl=impl))
    _check_vocab_parallel_options(vocab_parallel_options)
    if vocab_parallel_options is not None:
        return sharded_linear_cross_entropy(hidden_states, weight, labels, bias, loss_weights,
                                            opts, vocab_parallel_options)
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
    options: Optional[CrossEntropyOptions] = None,
    vocab_parallel_options: Optional[VocabParallelOptions] = None,
) -> torch.Tensor:
    """Cross-entropy of ``hidden_states @ weight.T + bias`` against ``labels``, chunked; on one
    device, or with the lm_head split over the vocabulary across tensor-parallel ranks.

    Equal in value and gradients to
    ``F.cross_entropy(softcap(F.linear(hidden_states, weight, bias)), labels, ignore_index=...,
    label_smoothing=..., reduction=...)`` plus ``z_loss * logsumexp(logits)**2`` per valid token.

    Args:
        hidden_states: ``[..., H]`` float (fp32 / bf16 / fp16 / fp64), any strides. With
            ``vocab_parallel_options``: replicated over the TP group, or, with its
            ``sequence_parallel=True``, this rank's shard of the tokens (every rank the same
            count).
        weight: ``[V, H]`` lm_head weight (may be tied to the input embedding, may be frozen);
            another floating dtype than ``hidden_states`` is promoted per chunk (autocast).
            With ``vocab_parallel_options``: this rank's shard ``[Vp, H]``, rows
            ``[r*Vp, (r+1)*Vp)`` of the lm_head padded to ``tp*Vp``, ``Vp = ceil(V / tp)``
            (padded rows get a zero gradient; see
            :func:`megaloss.losses.vocab_parallel.vocab_shard_range`).
        labels: ``[...]`` integer class ids in ``[0, V)`` or ``ignore_index``, already shifted
            for causal LM (``labels[..., t]`` is the target of position ``t``).
        bias: optional ``[V]`` (``[Vp]``, this rank's shard, with ``vocab_parallel_options``).
        loss_weights: optional ``[...]`` float per-token weights (shape of ``labels``), e.g.
            from :class:`megaloss.LossCalibrator`.
        ignore_index: label without loss or gradient; this and the keywords below are the
            fields of :class:`~megaloss.ops.options.CrossEntropyOptions`, documented there.
        reduction: ``"mean"``, ``"sum"`` or ``"none"`` (torch's meanings).
        label_smoothing, z_loss, logit_softcapping, chunk_size, accum_dtype: see
            :class:`~megaloss.ops.options.CrossEntropyOptions`.
        impl: the chunk epilogue: the Triton kernels on CUDA, the torch one elsewhere.
        options: these fields as one :class:`~megaloss.ops.options.CrossEntropyOptions`
            (e.g. from a ds_config, ``MegalossConfig.ce.options()``), instead of the keywords.
        vocab_parallel_options: a :class:`VocabParallelOptions` (TP group, real vocab size,
            Megatron's sequence parallelism): ``weight`` is then this rank's vocab shard and
            the loss is the one over the full vocabulary, identical on every TP rank (two
            all-reduces of ``[tokens]``-sized statistics per chunk, no logits gathered; see
            :mod:`megaloss.losses.vocab_parallel`). ``None``: one device, no collective.

    Returns:
        fp32 scalar (fp64 for fp64 inputs), or ``[...]`` for ``reduction="none"`` (with
        ``sequence_parallel=True``: ``[tp * N_local]``, the gathered tokens, rank 0's first).

    Raises:
        ValueError: a label outside ``[0, V)`` that is not ``ignore_index``; shape mismatches
            (``labels`` vs ``hidden_states[..., :-1]``, ``weight`` hidden size, ``bias``,
            ``loss_weights``); inputs on different devices; an option out of range. With
            ``vocab_parallel_options`` also: token count, hidden size, shard rows or vocab
            size differing across TP ranks, or ``weight`` without ``ceil(V / tp)`` rows,
            raised on every TP rank alike.
        TypeError: non-tensor inputs, non-floating hidden states/weight, non-integer labels;
            ``options`` together with option keywords not at their default (naming them);
            ``options`` / ``vocab_parallel_options`` of the wrong type.

    Gradients of ``hidden_states``, ``weight`` and ``bias`` are computed chunk by chunk in the
    forward pass (``"mean"``/``"sum"``) and scaled by ``grad_output`` in backward; with
    ``"none"`` backward recomputes the logits chunk by chunk and honours a per-token
    ``grad_output``. Inputs without ``requires_grad`` cost no gradient work.
    """
    return linear_cross_entropy_with_stats(
        hidden_states, weight, labels, bias=bias, loss_weights=loss_weights,
        ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
        z_loss=z_loss, logit_softcapping=logit_softcapping, chunk_size=chunk_size,
        accum_dtype=accum_dtype, impl=impl, options=options,
        vocab_parallel_options=vocab_parallel_options).loss


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
