"""A model's own z-loss over every position, ``coefficient * mean_t logsumexp(softcap(h_t W^T +
b)) ** 2``, chunked: the term Bamba adds to its cross-entropy
(``transformers/models/bamba/modeling_bamba.py``: ``z_loss_coefficient *
logits.logsumexp(-1).pow(2).mean()``, every position of the batch, padding and ignored labels
included), without the ``[tokens, vocab]`` logits; on one device or over an lm_head split across
tensor-parallel ranks (the layout of :mod:`megaloss.losses.vocab_parallel`).

Not :class:`~megaloss.CrossEntropyOptions`' ``z_loss``, which weights each *labelled* token as
the cross-entropy does (PaLM's, arXiv:2204.02311); this one is the unweighted mean over
positions that a model's forward defines. Kernel: :mod:`megaloss.ops.z_loss_kernel`; schedule:
recompute in backward (:mod:`megaloss.ops.chunk_driver`).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..ops.chunk_driver import chunked_head
from ..ops.validation import check_ce_tensors
from ..ops.z_loss_kernel import LogSumExpSquareKernel
from .vocab_parallel import VocabParallelOptions, check_vocab_parallel_options, vocab_layout

__all__ = ["linear_position_z_loss"]


def linear_position_z_loss(hidden_states: torch.Tensor, weight: torch.Tensor, *,
                           coefficient: float, bias: Optional[torch.Tensor] = None,
                           logit_softcapping: Optional[float] = None,
                           chunk_size: Optional[int] = None,
                           accum_dtype: torch.dtype = torch.float32,
                           vocab_parallel_options: Optional[VocabParallelOptions] = None
                           ) -> torch.Tensor:
    """``coefficient * mean over every position t of logsumexp(softcap(hidden_states[t] @
    weight.T + bias)) ** 2``, chunked over positions.

    Equal in value and gradients to ``coefficient * softcap(F.linear(hidden_states, weight,
    bias)).logsumexp(-1).pow(2).mean()``.

    Args:
        hidden_states: ``[..., H]`` float; every position counts. With
            ``vocab_parallel_options``: replicated over the TP group, or, with its
            ``sequence_parallel=True``, this rank's shard of the positions (the mean is then
            over the gathered positions).
        weight: ``[V, H]`` lm_head weight (this rank's shard ``[ceil(V / tp), H]`` with
            ``vocab_parallel_options``).
        coefficient: the z-loss coefficient (a number >= 0).
        bias: optional ``[V]`` (``[Vp]``).
        logit_softcapping: the soft-cap ``c`` of ``c * tanh(z / c)``, or ``None``.
        chunk_size: positions per chunk; ``None``: the chunk driver's default.
        accum_dtype: the weight / bias gradient accumulation dtype.
        vocab_parallel_options: a :class:`~megaloss.losses.vocab_parallel.VocabParallelOptions`;
            the result is that of the full vocabulary, identical on every TP rank (one MAX and
            one SUM all-reduce of ``[chunk]`` statistics per chunk in forward, none in
            backward).

    Returns:
        A scalar, fp32 (fp64 for fp64 inputs), differentiable into ``hidden_states``,
        ``weight`` and ``bias``; 0 without positions.

    Raises:
        ValueError: ``coefficient`` not a number >= 0; shape mismatches; NaN or inf in
            ``hidden_states``; values differing across TP ranks (every rank raises alike).
        TypeError: non-tensor or non-floating inputs; ``vocab_parallel_options`` of the wrong
            type.
    """
    if isinstance(coefficient, bool) or not isinstance(coefficient, (int, float)) or not (
            coefficient >= 0):
        raise ValueError(f"coefficient must be a number >= 0, got {coefficient!r}")
    check_vocab_parallel_options(vocab_parallel_options)
    positions = None
    if isinstance(hidden_states, torch.Tensor) and hidden_states.dim() >= 1:
        positions = torch.zeros(hidden_states.shape[:-1], dtype=torch.long,
                                device=hidden_states.device)

    def check(vocab_size: int) -> Optional[int]:
        check_ce_tensors(hidden_states, weight, positions, bias, None)
        return None

    layout = vocab_layout(vocab_parallel_options, weight, hidden_states, positions, check,
                          ignore_index=-100, what="position z-loss")
    hidden = layout.hidden(hidden_states.reshape(-1, hidden_states.shape[-1]))
    kernel = LogSumExpSquareKernel(logit_softcapping, layout.vocab_slice())
    squares, _ = chunked_head(kernel, hidden, layout.rows(weight), layout.rows(bias),
                              chunk_size=layout.chunk_size(chunk_size, hidden),
                              accum_dtype=accum_dtype)
    if squares.numel() == 0:
        return squares.sum()
    return squares.mean() * coefficient
