"""The per-token log-probabilities as a :class:`~megaloss.ops.chunk_kernel.ChunkKernel` of the
chunk driver: the torch epilogue of :mod:`megaloss.ops.log_probs_chunk` or the Triton one of
:mod:`megaloss.ops.triton_log_probs` per chunk (``impl``), on the recompute schedule (the
upstream gradients of a policy loss are per token and arbitrary, known only in backward)."""
from __future__ import annotations

from typing import Sequence

import torch

from .chunk_kernel import ChunkKernel, VocabSlice
from .epilogue_choice import epilogue_impl
from .log_probs_chunk import chunk_log_probs, chunk_log_probs_grad
from .log_probs_options import LogProbsOptions

__all__ = ["LogProbsKernel"]



class LogProbsKernel(ChunkKernel):
    """The log-probabilities as a chunk kernel: results ``(log_probs, entropy, lse, mean_logit,
    greedy_match)`` per token (entropy and ``mean_logit`` zeros without ``return_entropy``;
    ``greedy_match`` 0.0 / 1.0), the first two differentiable, ``lse`` and ``mean_logit`` saved
    for the gradient (recomputed in backward, no collective there).

    Args:
        labels: ``[N]`` int64 global ids or ``opts.ignore_index``.
        opts: the options (``impl`` picks the epilogue per chunk).
        vocab: this device's :class:`~megaloss.ops.chunk_kernel.VocabSlice`.
    """

    n_outputs, n_differentiable, saved = 5, 2, (2, 3)

    def __init__(self, labels: torch.Tensor, opts: LogProbsOptions, vocab: VocabSlice):
        self.labels, self.opts, self.vocab = labels, opts, vocab

    def _epilogues(self, logits: torch.Tensor):
        if epilogue_impl(self.opts.impl, logits) == "triton":
            from .triton_log_probs import triton_chunk_log_probs, triton_chunk_log_probs_grad
            return triton_chunk_log_probs, triton_chunk_log_probs_grad
        return chunk_log_probs, chunk_log_probs_grad

    def forward(self, logits, rows, coef):
        forward, _ = self._epilogues(logits)
        vocab = self.vocab
        out = forward(logits, self.labels[rows], self.opts, vocab_start=vocab.start,
                      reduce_max=vocab.reduce_max, reduce_sum=vocab.reduce_sum)
        zeros = torch.zeros_like(out.lse) if out.entropy is None else None
        return (out.log_probs, zeros if out.entropy is None else out.entropy, out.lse,
                zeros if out.mean_logit is None else out.mean_logit,
                out.greedy_match.to(out.lse.dtype)), None

    def backward(self, logits, rows, saved: Sequence[torch.Tensor], upstream):
        _, gradient = self._epilogues(logits)
        labels = self.labels[rows]
        lse, mean_logit = saved
        grad_lp, grad_ent = upstream
        if not self.opts.return_entropy:
            grad_ent = None
        valid = labels != self.opts.ignore_index
        # Ignored tokens get no gradient, whatever the upstream says there.
        grad_lp = (torch.zeros_like(lse) if grad_lp is None
                   else torch.where(valid, grad_lp, 0.0))
        if grad_ent is not None:
            grad_ent = torch.where(valid, grad_ent, 0.0)
        return gradient(logits, labels, lse, None if grad_ent is None else mean_logit, grad_lp,
                        grad_ent, self.opts, vocab_start=self.vocab.start)
