"""The chunked fused linear cross-entropy autograd Function shared by the single-device and the
vocab-parallel losses.

Schedule (XTuner v1 / Liger FLCE): for ``reduction`` ``"mean"`` or ``"sum"`` the gradients of
``hidden_states``, ``weight`` and ``bias`` are computed chunk by chunk *in the forward pass* and
saved; backward only multiplies them by the scalar ``grad_output`` (which carries DeepSpeed's 1/GAS
and fp16 loss scaling, so it is never assumed to be 1). No ``[tokens, vocab]`` tensor outlives
one chunk. The weight/bias gradients accumulate across chunks in ``accum_dtype`` (fp32 by
default: half-precision accumulation made training diverge in Liger).

For ``reduction="none"`` the upstream gradient is per token and only known in backward, so the
forward keeps only the per-token log-sum-exp and backward recomputes the logits chunk by chunk
(Cut Cross-Entropy's schedule, Wijmans et al. 2024, arXiv:2411.09009: 4 GEMMs instead of 3, no
collective in backward).

fp16 takes the same deferred schedule for every reduction. Under fp16 loss scaling (DeepSpeed's
``fp16`` section, initial scale 2^16) the upstream gradient is the loss scale ``S``; eager
autograd forms the logit gradient as ``S * coef * (p - onehot)``, inside fp16's range, while a
gradient formed in forward is ``coef * (p - onehot)`` with ``coef ~ 1/N`` (or a calibration weight
~2^-20): it underflows to fp16 zeros before ``S`` exists, and ``S`` itself (65536) is inf in fp16.
Deferring forms it at eager's magnitude for one extra GEMM (measured in ``tools/bench_ce.py``).
bf16 has fp32's exponent range and keeps the 3-GEMM schedule.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .chunk_gradients import HeadGradients
from .cross_entropy_chunk import Reduce, chunk_cross_entropy, no_reduce
from .options import CrossEntropyOptions

__all__ = ["chunked_linear_cross_entropy"]


class _Plan:
    """Everything the chunk loop needs besides tensors (kept out of autograd's argument list)."""

    def __init__(self, opts: CrossEntropyOptions, vocab_size: int, vocab_start: int,
                 reduce_max: Reduce, reduce_sum: Reduce):
        self.opts, self.vocab_size, self.vocab_start = opts, vocab_size, vocab_start
        self.reduction, self.chunk_size = opts.reduction, opts.chunk_size
        self.accum_dtype = opts.accum_dtype
        self.reduce_max, self.reduce_sum = reduce_max, reduce_sum


def _run_chunks(plan: _Plan, hidden: torch.Tensor, weight: torch.Tensor,
                bias: Optional[torch.Tensor], labels: torch.Tensor, coef: Optional[torch.Tensor],
                lse: Optional[torch.Tensor], need: Tuple[bool, bool, bool]):
    """Loop over token chunks. Returns (loss [N], lse [N], d_hidden, d_weight, d_bias)."""
    n_tokens = hidden.shape[0]
    grads = HeadGradients(hidden, weight, bias, plan.accum_dtype, need)
    losses, lses = [], []
    for start in range(0, n_tokens, plan.chunk_size):
        stop = min(start + plan.chunk_size, n_tokens)
        h = hidden[start:stop].to(grads.dtype)
        res = chunk_cross_entropy(
            h, grads.weight, grads.bias, labels[start:stop],
            None if coef is None else coef[start:stop], plan.opts,
            vocab_size=plan.vocab_size, vocab_start=plan.vocab_start,
            lse=None if lse is None else lse[start:stop],
            reduce_max=plan.reduce_max, reduce_sum=plan.reduce_sum)
        losses.append(res.loss)
        lses.append(res.lse)
        if res.grad_logits is not None:
            grads.add(start, stop, h, res.grad_logits)
        # Drop this chunk's [C, V] buffers before the next chunk allocates its own; otherwise
        # two chunk working sets are alive at once (measured +123 MiB at C=1024, V=32000).
        del res
    sdt = torch.promote_types(grads.dtype, torch.float32)
    loss = torch.cat(losses) if losses else hidden.new_zeros(0, dtype=sdt)
    lse_all = torch.cat(lses) if lses else hidden.new_zeros(0, dtype=sdt)
    return loss, lse_all, grads.d_hidden, grads.d_weight, grads.d_bias


def _defer_gradients(plan: _Plan, hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the gradients wait for backward (recomputing the logits) instead of forming in
    forward: always for ``reduction="none"`` (the upstream gradient is per token), and for fp16,
    whose range cannot hold a gradient formed before the loss scale exists (see module doc)."""
    compute = torch.promote_types(hidden.dtype, weight.dtype)
    return plan.reduction == "none" or compute == torch.float16


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, token_weights, plan: _Plan):
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                bias is not None and ctx.needs_input_grad[2])
        valid = labels != plan.opts.ignore_index
        w_tok = valid.to(torch.float64 if hidden.dtype == torch.float64 else torch.float32)
        if token_weights is not None:
            w_tok = w_tok * token_weights.to(w_tok.dtype)
        ctx.plan, ctx.need = plan, need
        if plan.reduction == "mean":
            # Clamped so that "every label ignored" gives 0 (not 0/0); no host sync.
            coef = w_tok / w_tok.sum().clamp_min(torch.finfo(w_tok.dtype).tiny)
        else:
            coef = w_tok
        ctx.deferred = _defer_gradients(plan, hidden, weight)
        if ctx.deferred:
            loss, lse, *_ = _run_chunks(plan, hidden, weight, bias, labels, None, None, need)
            ctx.save_for_backward(hidden, weight, bias, labels, coef, lse)
        else:
            loss, lse, d_h, d_w, d_b = _run_chunks(plan, hidden, weight, bias, labels,
                                                   coef if any(need) else None, None, need)
            ctx.save_for_backward(d_h, None if d_w is None else d_w.to(weight.dtype),
                                  None if d_b is None else d_b.to(bias.dtype))
        z = plan.opts.z_loss * lse * lse * coef
        if plan.reduction == "none":
            out = loss * coef
        else:
            out, z = (loss * coef).sum(), z.sum()
        ctx.mark_non_differentiable(z)
        return out, z

    @staticmethod
    def backward(ctx, grad_loss, grad_z_unused):
        plan, need = ctx.plan, ctx.need
        if ctx.deferred:
            hidden, weight, bias, labels, coef, lse = ctx.saved_tensors
            # The upstream gradient (per token for "none"; a scalar carrying 1/GAS and the fp16
            # loss scale otherwise) enters the logit gradient in fp32, before any cast: the
            # gradient is formed at the magnitude eager autograd forms it.
            coef = grad_loss.to(coef.dtype) * coef
            _, _, d_h, d_w, d_b = _run_chunks(plan, hidden, weight, bias, labels, coef, lse, need)
            return (d_h, None if d_w is None else d_w.to(weight.dtype),
                    None if d_b is None else d_b.to(bias.dtype), None, None, None)
        # Out of place, unlike Liger's in-place scaling: that would save one gradient-sized copy
        # at the backward peak but break retain_graph / gradcheck (saved tensors modified).
        grads = tuple(None if d is None else d * grad_loss.to(d.dtype)
                      for d in ctx.saved_tensors)
        return grads + (None, None, None)


def chunked_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
    labels: torch.Tensor, token_weights: Optional[torch.Tensor], opts: CrossEntropyOptions, *,
    vocab_size: int, vocab_start: int = 0,
    reduce_max: Reduce = no_reduce, reduce_sum: Reduce = no_reduce,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Validated-input core shared by the single-device and vocab-parallel losses.

    Args:
        hidden: ``[N, H]`` float.
        weight: ``[V_local, H]``, the real vocab rows of this slice only (padding sliced off).
        bias: ``[V_local]`` or None.
        labels: ``[N]`` int64 global vocab ids or ``opts.ignore_index``.
        token_weights: ``[N]`` float or None.
        opts: the options (``reduction``, ``chunk_size``, ``accum_dtype`` included).
        vocab_size / vocab_start: the global ``V`` and this slice's first id.
        reduce_max / reduce_sum: in-place combiners of ``[tokens]`` statistics across vocab
            slices (identity on one device).

    Returns:
        ``(loss, z_loss)`` in fp32 (fp64 for fp64 inputs); ``z_loss`` is the z-loss part of
        ``loss`` (same reduction, no gradient), for logging.
    """
    plan = _Plan(opts, vocab_size, vocab_start, reduce_max, reduce_sum)
    loss, z = _ChunkedLinearCrossEntropy.apply(hidden, weight, bias, labels, token_weights, plan)
    return loss, z.detach()
