r"""The square of each token's log-sum-exp as a :class:`~megaloss.ops.chunk_kernel.ChunkKernel`
of the chunk driver: the z-loss term of a model's own loss taken over every position, labels or
none (Bamba's ``z_loss_coefficient * logits.logsumexp(-1).pow(2).mean()``,
``transformers/models/bamba/modeling_bamba.py``; the z-loss of PaLM, arXiv:2204.02311, 5).

For token ``t`` with raw logits ``z = W h_t + b`` over the vocabulary and soft-cap ``c``:

.. math::

    y_j = c \tanh(z_j / c), \quad \mathrm{lse} = \log \textstyle\sum_j e^{y_j}, \quad
    r = \mathrm{lse}^2, \quad
    \partial r / \partial z_j = 2\,\mathrm{lse}\; p_j\, (1 - \tanh^2(z_j / c)),
    \quad p_j = e^{y_j - \mathrm{lse}}.

Vocab-parallel as the other kernels (Megatron-core's ``tensor_parallel/cross_entropy.py``): the
per-token max is combined with the slice's ``reduce_max``, the sum of ``e^{y_j - M}`` with its
``reduce_sum`` (two all-reduces of ``[C]`` per chunk in forward, none in backward: the gradient
needs only the saved ``lse``).

Results ``(lse ** 2, lse)``, the first differentiable, the second saved; on the recompute
schedule (the caller reduces the per-token squares itself). Memory: one chunk's ``[C, V_local]``
logits at a time (and the soft-cap's ``tanh`` of that chunk), ``[N]`` saved; never a
``[tokens, vocab]`` tensor.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .chunk_kernel import ChunkKernel, VocabSlice, softcap, softcap_chain_, stats_dtype

__all__ = ["LogSumExpSquareKernel"]


class LogSumExpSquareKernel(ChunkKernel):
    """Per token ``(logsumexp(softcap(z)) ** 2, logsumexp(softcap(z)))`` (module docstring).

    Args:
        logit_softcapping: the soft-cap ``c`` or ``None``.
        vocab: this device's :class:`~megaloss.ops.chunk_kernel.VocabSlice`.
    """

    n_outputs, n_differentiable, saved = 2, 1, (1,)

    def __init__(self, logit_softcapping: Optional[float], vocab: VocabSlice):
        self.cap, self.vocab = logit_softcapping, vocab

    def _lse(self, logits: torch.Tensor):
        """``(lse [C], M [C], e^{y - M} [C, V_local], tanh)`` of one chunk (the exponentials
        written over the capped logits)."""
        y, tanh = softcap(logits.to(stats_dtype(logits.dtype)), self.cap)
        if y.shape[1] > 0:
            row_max = y.amax(dim=1)
        else:  # a vocab-parallel rank may hold no real vocab rows
            row_max = y.new_full((y.shape[0],), float("-inf"))
        row_max = self.vocab.reduce_max(row_max)
        exp = y.sub_(row_max.unsqueeze(1)).exp_()
        lse = row_max + torch.log(self.vocab.reduce_sum(exp.sum(dim=1)))
        return lse, row_max, exp, tanh

    def forward(self, logits, rows, coef):
        lse, row_max, exp, tanh = self._lse(logits)
        if coef is None:
            return (lse * lse, lse), None
        # d(coef * lse^2)/dz = 2 coef lse p (1 - tanh^2), p = e^{y - M} e^{M - lse}
        factor = 2.0 * coef.to(lse.dtype) * lse * torch.exp(row_max - lse)
        grad = exp.mul_(factor.unsqueeze(1))
        return (lse * lse, lse), softcap_chain_(grad, tanh)

    def backward(self, logits, rows, saved: Sequence[torch.Tensor], upstream):
        (lse,) = saved
        (grad_square,) = upstream
        y, tanh = softcap(logits.to(stats_dtype(logits.dtype)), self.cap)
        if grad_square is None:
            return y.zero_()
        grad = y.sub_(lse.unsqueeze(1)).exp_().mul_((2.0 * grad_square * lse).unsqueeze(1))
        return softcap_chain_(grad, tanh)
