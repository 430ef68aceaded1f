r"""Per-token log-probabilities, entropy and log-sum-exp of one chunk of tokens against one slice
of the vocabulary, and the logit gradient for arbitrary per-token upstream gradients.

For token ``t`` with raw logits ``z = W h_t + b`` over the vocabulary ``[0, V)``, soft-cap ``c``
and temperature ``T``:

.. math::

    y_j &= c \tanh(z_j / c) / T \quad (y = z / T \text{ without soft-capping})\\
    \mathrm{lse} &= \log \textstyle\sum_{j<V} e^{y_j}, \qquad p_j = e^{y_j - \mathrm{lse}},
    \qquad \mu = \textstyle\sum_j p_j y_j\\
    \log p_{\text{label}} &= y_{\text{label}} - \mathrm{lse}, \qquad
    H = -\textstyle\sum_j p_j \log p_j = \mathrm{lse} - \mu

With upstream gradients ``a = dL/d log p_label`` and ``b = dL/dH`` of the token:

.. math::

    \partial L / \partial y_j = a\,([j = \text{label}] - p_j) - b\, p_j (y_j - \mu),
    \qquad \partial y_j / \partial z_j = (1 - \tanh^2(z_j / c)) / T.

Vocab-parallel (Megatron-core's ``tensor_parallel/cross_entropy.py`` combines the same kind of
statistics): this function sees only its slice ``[vocab_start, vocab_start + V_local)``; the
per-token max ``M`` is combined with ``reduce_max``, then ``[sum_j e^{y_j - M}, y_label,
sum_j e^{y_j - M} (y_j - M)]`` with one ``reduce_sum`` (the last row only with entropy). From
those, ``lse = M + log S`` and ``H = log S - (sum_j e^{y_j - M} (y_j - M)) / S`` (written
relative to ``M``, no cancellation between two large numbers). The gradient needs only ``lse``
and ``mu`` per token (saved by the forward), so it takes no collective.

``greedy_match`` is ``y_label == max_j y_j`` (a tie for the maximum counts as a match; it is the
label's own logit compared, so it is exact under any vocab split).

Statistics are kept in fp32 (fp64 for fp64 inputs). Two epilogues compute this, chosen by
``opts.impl`` as for the cross-entropy (:func:`megaloss.ops.cross_entropy_chunk.epilogue_impl`):
the torch one here (any device, the reference) and two fused Triton kernels in
:mod:`megaloss.ops.triton_log_probs` (CUDA, or CPU under Triton's interpreter); both finish with
:func:`results_from_stats`. :class:`megaloss.ops.log_probs_kernel.LogProbsKernel` is their
chunk kernel for the chunk driver.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch

from .chunk_kernel import Reduce, label_columns, no_reduce, softcap, softcap_chain_, stats_dtype
from .log_probs_options import LogProbsOptions

__all__ = ["LogProbsChunk", "chunk_log_probs", "chunk_log_probs_grad",
           "scaled_logits", "results_from_stats"]


class LogProbsChunk(NamedTuple):
    """The per-token results of one chunk, all ``[C]`` in the stats dtype except
    ``greedy_match`` (bool): ``entropy`` and ``mean_logit`` (``mu``, saved for the gradient)
    are ``None`` without ``return_entropy``. Ignored tokens: ``log_probs`` and ``entropy`` 0,
    ``greedy_match`` False; ``lse`` is computed for every token."""

    log_probs: torch.Tensor
    entropy: Optional[torch.Tensor]
    lse: torch.Tensor
    mean_logit: Optional[torch.Tensor]
    greedy_match: torch.Tensor


def scaled_logits(logits: torch.Tensor, opts: LogProbsOptions
                  ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(y, tanh)``: ``y = softcap(logits) / T`` in the stats dtype (the caller's buffer is
    reused when it already has that dtype and no soft-cap applies), and ``tanh(z / c)`` for the
    chain rule (``None`` without soft-capping)."""
    y, tanh = softcap(logits.to(stats_dtype(logits.dtype)), opts.logit_softcapping)
    if opts.temperature != 1.0:
        y = y.div_(opts.temperature)
    return y, tanh


def chunk_log_probs(logits: torch.Tensor, labels: torch.Tensor, opts: LogProbsOptions, *,
                    vocab_start: int = 0, reduce_max: Reduce = no_reduce,
                    reduce_sum: Reduce = no_reduce) -> LogProbsChunk:
    """The forward statistics of one chunk (torch ops; the math in the module docstring).

    Args:
        logits: ``[C, V_local]`` raw lm_head logits of this vocab slice (the caller's own buffer:
            it may be overwritten).
        labels: ``[C]`` int64 global ids or ``opts.ignore_index``.
        opts: ``temperature``, ``logit_softcapping``, ``return_entropy``, ``ignore_index``.
        vocab_start: global id of this slice's first row (0 without tensor parallelism).
        reduce_max / reduce_sum: in-place combiners across vocab slices.
    """
    n_rows, n_local = logits.shape
    y, _ = scaled_logits(logits, opts)
    valid, in_slice, idx = label_columns(labels, opts.ignore_index, vocab_start, n_local)
    if n_local > 0:  # a vocab-parallel rank may hold no real vocab rows
        row_max = y.amax(dim=1)
        target = y.gather(1, idx).squeeze(1) * in_slice
    else:
        row_max = y.new_full((n_rows,), float("-inf"))
        target = y.new_zeros(n_rows)
    row_max = reduce_max(row_max)
    shifted = y.sub_(row_max.unsqueeze(1))  # y - M <= 0
    if opts.return_entropy:  # sum_j e^{y_j - M} (y_j - M), one row-wise dot, no [C, V] temporary
        exp = torch.exp(shifted)
        sums = [exp.sum(dim=1), target,
                torch.bmm(exp.unsqueeze(1), shifted.unsqueeze(2)).view(n_rows)]
    else:
        exp = shifted.exp_()
        sums = [exp.sum(dim=1), target]
    del exp, shifted, y
    return results_from_stats(row_max, reduce_sum(torch.stack(sums)), valid, opts)


def results_from_stats(row_max: torch.Tensor, stats: torch.Tensor, valid: torch.Tensor,
                       opts: LogProbsOptions) -> LogProbsChunk:
    """The per-token results from the combined statistics (shared by both epilogues).

    Args:
        row_max: ``[C]`` global max ``M`` of each token's scaled logits.
        stats: ``[2 or 3, C]`` summed over the vocab slices: ``sum_j e^{y_j - M}``, the label's
            ``y``, and with entropy ``sum_j e^{y_j - M} (y_j - M)``.
        valid: ``[C]`` bool, the label is not ``ignore_index``.
    """
    log_sum = torch.log(stats[0])
    lse = row_max + log_sum
    log_probs = torch.where(valid, stats[1] - lse, 0.0)
    greedy = valid & (stats[1] == row_max)
    entropy = mean_logit = None
    if opts.return_entropy:
        weighted = stats[2] / stats[0]  # mu - M
        entropy = torch.where(valid, log_sum - weighted, 0.0)
        mean_logit = weighted + row_max
    return LogProbsChunk(log_probs, entropy, lse, mean_logit, greedy)


def chunk_log_probs_grad(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor,
                         mean_logit: Optional[torch.Tensor], grad_log_probs: torch.Tensor,
                         grad_entropy: Optional[torch.Tensor], opts: LogProbsOptions, *,
                         vocab_start: int = 0) -> torch.Tensor:
    """``dL/dz [C, V_local]`` (stats dtype) of one chunk from its recomputed raw ``logits``.

    Args:
        logits: ``[C, V_local]`` raw logits (the caller's buffer, may be overwritten).
        labels: ``[C]`` int64.
        lse / mean_logit: ``[C]`` saved by :func:`chunk_log_probs` (``mean_logit`` only with
            ``grad_entropy``).
        grad_log_probs: ``[C]`` upstream gradient of ``log_probs``, 0 at ignored tokens.
        grad_entropy: ``[C]`` upstream gradient of ``entropy`` (0 at ignored tokens) or None.
    """
    n_local = logits.shape[1]
    y, tanh = scaled_logits(logits, opts)
    _, in_slice, idx = label_columns(labels, opts.ignore_index, vocab_start, n_local)
    a = grad_log_probs.to(y.dtype)
    if grad_entropy is None:
        grad = y.sub_(lse.unsqueeze(1)).exp_().mul_(-a.unsqueeze(1))
    else:
        b = grad_entropy.to(y.dtype)
        probs = torch.sub(y, lse.unsqueeze(1)).exp_()  # one [C, V] temporary, not two
        # -p * (a + b (y - mu)), in place over y
        grad = y.sub_(mean_logit.unsqueeze(1)).mul_(b.unsqueeze(1)).add_(a.unsqueeze(1))
        grad.mul_(probs).neg_()
        del probs
    if n_local > 0:
        grad.scatter_add_(1, idx, (a * in_slice).unsqueeze(1))
    softcap_chain_(grad, tanh)
    if opts.temperature != 1.0:
        grad.div_(opts.temperature)
    return grad

