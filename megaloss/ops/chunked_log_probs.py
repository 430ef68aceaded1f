"""The chunk loop of the linear log-probabilities and its autograd Function.

Schedule: recompute in backward (Cut Cross-Entropy's, Wijmans et al. 2024, arXiv:2411.09009).
The upstream gradients of ``log_probs`` and ``entropy`` are per token and arbitrary (a policy
loss's ratio, clipping, KL terms), so unlike the mean/sum cross-entropy the logit gradient cannot
be formed in the forward pass. Forward keeps ``lse`` (and, with entropy, ``mu = sum p y``) per
token; backward recomputes each chunk's logits (one more GEMM: 4 instead of 3) and needs no
collective, since those two vectors are already global. No ``[tokens, vocab]`` tensor outlives
one chunk. The weight/bias gradients accumulate across chunks in ``accum_dtype``.

Forming the gradient in forward is only possible when the per-token coefficients are known
before the loss is built (a loss linear in ``log_probs`` with fixed weights, i.e. a weighted
cross-entropy): that is :func:`megaloss.linear_cross_entropy` with ``loss_weights`` and
``reduction="sum"``, measured side by side in ``tools/bench_log_probs.py``.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .chunk_gradients import HeadGradients, compute_operands
from .chunk_stats import Reduce, no_reduce
from .cross_entropy_chunk import epilogue_impl
from .log_probs_chunk import LogProbsChunk, chunk_log_probs, chunk_log_probs_grad
from .options import LogProbsOptions

__all__ = ["chunked_linear_log_probs"]


class _Plan:
    """Everything the chunk loop needs besides tensors (kept out of autograd's argument list)."""

    def __init__(self, opts: LogProbsOptions, vocab_start: int, reduce_max: Reduce,
                 reduce_sum: Reduce):
        self.opts, self.vocab_start = opts, vocab_start
        self.reduce_max, self.reduce_sum = reduce_max, reduce_sum


def _epilogues(opts: LogProbsOptions, logits: torch.Tensor):
    """The (forward, gradient) chunk functions ``opts.impl`` selects for these logits."""
    if epilogue_impl(opts.impl, logits) == "triton":
        from .triton_log_probs import triton_chunk_log_probs, triton_chunk_log_probs_grad
        return triton_chunk_log_probs, triton_chunk_log_probs_grad
    return chunk_log_probs, chunk_log_probs_grad


def _logits(h: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor]) -> torch.Tensor:
    return torch.mm(h, w.t()) if b is None else torch.addmm(b, h, w.t())


def _forward_chunks(plan: _Plan, hidden: torch.Tensor, weight: torch.Tensor,
                    bias: Optional[torch.Tensor], labels: torch.Tensor) -> LogProbsChunk:
    dtype, w, b = compute_operands(hidden, weight, bias)
    parts = []
    for start in range(0, hidden.shape[0], plan.opts.chunk_size):
        stop = min(start + plan.opts.chunk_size, hidden.shape[0])
        logits = _logits(hidden[start:stop].to(dtype), w, b)
        forward, _ = _epilogues(plan.opts, logits)
        parts.append(forward(logits, labels[start:stop], plan.opts, vocab_start=plan.vocab_start,
                             reduce_max=plan.reduce_max, reduce_sum=plan.reduce_sum))
        del logits  # one chunk's [C, V] alive at a time
    if not parts:  # no tokens: empty results of the right dtypes
        sdt = torch.promote_types(dtype, torch.float32)
        empty = hidden.new_zeros(0, dtype=sdt)
        ent = empty if plan.opts.return_entropy else None
        return LogProbsChunk(empty, ent, empty, ent, torch.zeros(0, dtype=torch.bool,
                                                                 device=hidden.device))
    return LogProbsChunk(*(None if p[0] is None else torch.cat(p) for p in zip(*parts)))


def _backward_chunks(plan: _Plan, hidden, weight, bias, labels, lse, mean_logit, grad_lp,
                     grad_ent, need: Tuple[bool, bool, bool]):
    grads = HeadGradients(hidden, weight, bias, plan.opts.accum_dtype, need)
    for start in range(0, hidden.shape[0], plan.opts.chunk_size):
        stop = min(start + plan.opts.chunk_size, hidden.shape[0])
        h = hidden[start:stop].to(grads.dtype)
        logits = _logits(h, grads.weight, grads.bias)
        _, gradient = _epilogues(plan.opts, logits)
        grad = gradient(logits, labels[start:stop], lse[start:stop],
                        None if grad_ent is None else mean_logit[start:stop],
                        grad_lp[start:stop], None if grad_ent is None else grad_ent[start:stop],
                        plan.opts, vocab_start=plan.vocab_start)
        del logits
        grads.add(start, stop, h, grad)
        del grad
    d_weight, d_bias = grads.d_weight, grads.d_bias
    return (grads.d_hidden, None if d_weight is None else d_weight.to(weight.dtype),
            None if d_bias is None else d_bias.to(bias.dtype))


class _LinearLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, plan: _Plan):
        out = _forward_chunks(plan, hidden, weight, bias, labels)
        ctx.plan = plan
        ctx.need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                    bias is not None and ctx.needs_input_grad[2])
        ctx.save_for_backward(hidden, weight, bias, labels, out.lse, out.mean_logit)
        ctx.set_materialize_grads(False)  # an unused output costs no gradient work
        entropy = out.entropy if out.entropy is not None else out.log_probs.new_zeros(0)
        ctx.mark_non_differentiable(out.lse, out.greedy_match)
        if out.entropy is None:
            ctx.mark_non_differentiable(entropy)
        return out.log_probs, entropy, out.lse, out.greedy_match

    @staticmethod
    def backward(ctx, grad_lp, grad_ent, _grad_lse, _grad_greedy):
        plan = ctx.plan
        hidden, weight, bias, labels, lse, mean_logit = ctx.saved_tensors
        if not plan.opts.return_entropy:
            grad_ent = None
        if grad_lp is None and grad_ent is None:
            return None, None, None, None, None
        valid = labels != plan.opts.ignore_index
        # Ignored tokens get no gradient, whatever the upstream says there.
        grad_lp = (torch.zeros_like(lse) if grad_lp is None
                   else torch.where(valid, grad_lp.to(lse.dtype), 0.0))
        if grad_ent is not None:
            grad_ent = torch.where(valid, grad_ent.to(lse.dtype), 0.0)
        d_h, d_w, d_b = _backward_chunks(plan, hidden, weight, bias, labels, lse, mean_logit,
                                         grad_lp, grad_ent, ctx.need)
        return d_h, d_w, d_b, None, None


def chunked_linear_log_probs(
    hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
    labels: torch.Tensor, opts: LogProbsOptions, *, vocab_start: int = 0,
    reduce_max: Reduce = no_reduce, reduce_sum: Reduce = no_reduce,
) -> LogProbsChunk:
    """Validated-input core of the single-device and vocab-parallel log-probabilities.

    Args:
        hidden: ``[N, H]`` float.
        weight: ``[V_local, H]``, the real vocab rows of this slice only (padding sliced off).
        bias: ``[V_local]`` or None.
        labels: ``[N]`` int64 global vocab ids or ``opts.ignore_index``.
        opts: the options.
        vocab_start: this slice's first global id.
        reduce_max / reduce_sum: in-place combiners of ``[tokens]`` statistics across vocab
            slices (identity on one device).

    Returns:
        :class:`~megaloss.ops.log_probs_chunk.LogProbsChunk` (``mean_logit`` is ``None``):
        ``log_probs`` and ``entropy`` differentiable, ``lse`` and ``greedy_match`` not.
    """
    plan = _Plan(opts, vocab_start, reduce_max, reduce_sum)
    log_probs, entropy, lse, greedy = _LinearLogProbs.apply(hidden, weight, bias, labels, plan)
    return LogProbsChunk(log_probs, entropy if opts.return_entropy else None, lse, None, greedy)
