"""The chunked fused linear distillation autograd Function shared by the single-device and the
vocab-parallel losses: both lm_heads applied chunk by chunk, so neither model's ``[tokens,
vocab]`` logits outlive a chunk (Liger-Kernel's ``chunked_loss/fused_linear_distillation.py``
schedule, with megaloss's chunk kernel :mod:`megaloss.ops.distillation_chunk`).

Schedule as :mod:`megaloss.ops.chunked_linear_ce`: for ``reduction`` ``"mean"`` / ``"sum"`` the
student's gradients (hidden states, weight, bias) are formed chunk by chunk in forward and
backward multiplies them by the scalar ``grad_output``; ``reduction="none"`` and fp16 keep
nothing but the inputs and recompute both heads' logits in backward (the per-token upstream
gradient is only known there; fp16 cannot hold a gradient formed before the loss scale). The
teacher (hidden states, lm_head, or its top-k) is treated as a constant: it gets no gradient,
whatever its ``requires_grad``.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .chunk_gradients import HeadGradients
from .chunk_stats import Reduce, no_reduce
from .distillation_chunk import TopKTeacher, chunk_distillation
from .options import DistillationOptions

__all__ = ["Teacher", "chunked_linear_distillation"]


class Teacher:
    """The teacher of a distillation call, kept out of autograd's argument list: either
    ``hidden [N, Ht]`` with ``weight [V_local, Ht]`` (and ``bias``), whose product is formed a
    chunk at a time, or a top-k form ``ids [N, k]`` / ``log_probs [N, k]``."""

    def __init__(self, hidden: Optional[torch.Tensor] = None,
                 weight: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                 topk_ids: Optional[torch.Tensor] = None,
                 topk_log_probs: Optional[torch.Tensor] = None):
        self.hidden = None if hidden is None else hidden.detach()
        self.weight = None if weight is None else weight.detach()
        self.bias = None if bias is None else bias.detach()
        self.topk_ids = topk_ids
        self.topk_log_probs = None if topk_log_probs is None else topk_log_probs.detach()

    def chunk(self, start: int, stop: int):
        if self.topk_ids is not None:
            return TopKTeacher(self.topk_ids[start:stop], self.topk_log_probs[start:stop])
        with torch.no_grad():
            h = self.hidden[start:stop]
            dtype = torch.promote_types(h.dtype, self.weight.dtype)
            w = self.weight.to(dtype)
            h = h.to(dtype)
            if self.bias is None:
                return torch.mm(h, w.t())
            return torch.addmm(self.bias.to(dtype), h, w.t())


class _Plan:
    def __init__(self, opts: DistillationOptions, teacher: Teacher, vocab_size: int,
                 vocab_start: int, reduce_max: Reduce, reduce_sum: Reduce):
        self.opts, self.teacher, self.vocab_start = opts, teacher, vocab_start
        self.vocab_size = vocab_size
        self.reduce_max, self.reduce_sum = reduce_max, reduce_sum


def _run_chunks(plan: _Plan, hidden, weight, bias, labels, coef, need):
    """Loop over token chunks. Returns ``(per-token [4, N] stack of loss, divergence, ce,
    top1_match; d_hidden, d_weight, d_bias)``."""
    opts = plan.opts
    n_tokens = hidden.shape[0]
    grads = HeadGradients(hidden, weight, bias, opts.accum_dtype, need)
    rows = []
    for start in range(0, n_tokens, opts.chunk_size):
        stop = min(start + opts.chunk_size, n_tokens)
        h = hidden[start:stop].to(grads.dtype)
        res = chunk_distillation(
            h, grads.weight, grads.bias, plan.teacher.chunk(start, stop), labels[start:stop],
            None if coef is None else coef[start:stop], opts, vocab_size=plan.vocab_size,
            vocab_start=plan.vocab_start,
            reduce_max=plan.reduce_max, reduce_sum=plan.reduce_sum)
        rows.append(torch.stack([res.loss, res.divergence, res.ce, res.top1_match]))
        if res.grad_logits is not None:
            grads.add(start, stop, h, res.grad_logits)
        del res  # free this chunk's [C, V] buffers before the next chunk's
    sdt = torch.promote_types(grads.dtype, torch.float32)
    per_token = torch.cat(rows, dim=1) if rows else hidden.new_zeros(4, 0, dtype=sdt)
    return per_token, grads.d_hidden, grads.d_weight, grads.d_bias


class _ChunkedLinearDistillation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, token_weights, plan: _Plan):
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                bias is not None and ctx.needs_input_grad[2])
        opts = plan.opts
        valid = labels != opts.ignore_index
        w_tok = valid.to(torch.float64 if hidden.dtype == torch.float64 else torch.float32)
        if token_weights is not None:
            w_tok = w_tok * token_weights.to(w_tok.dtype)
        if opts.reduction == "mean":
            coef = w_tok / w_tok.sum().clamp_min(torch.finfo(w_tok.dtype).tiny)
        else:
            coef = w_tok
        ctx.plan, ctx.need = plan, need
        compute = torch.promote_types(hidden.dtype, weight.dtype)
        ctx.deferred = opts.reduction == "none" or compute == torch.float16
        if ctx.deferred:
            per_token, *_ = _run_chunks(plan, hidden, weight, bias, labels, None, need)
            ctx.save_for_backward(hidden, weight, bias, labels, coef)
        else:
            per_token, d_h, d_w, d_b = _run_chunks(plan, hidden, weight, bias, labels,
                                                   coef if any(need) else None, need)
            ctx.save_for_backward(d_h, None if d_w is None else d_w.to(weight.dtype),
                                  None if d_b is None else d_b.to(bias.dtype))
        weighted = per_token[:3] * coef.to(per_token.dtype)
        if opts.reduction == "none":
            out, parts = weighted[0], weighted[1:]
        else:
            out, parts = weighted[0].sum(), weighted[1:].sum(dim=1)
        match = per_token[3]
        ctx.mark_non_differentiable(parts, match)
        return out, parts, match

    @staticmethod
    def backward(ctx, grad_loss, grad_parts_unused, grad_match_unused):
        plan, need = ctx.plan, ctx.need
        if ctx.deferred:
            hidden, weight, bias, labels, coef = ctx.saved_tensors
            coef = grad_loss.to(coef.dtype) * coef
            _, d_h, d_w, d_b = _run_chunks(plan, hidden, weight, bias, labels, coef, need)
            return (d_h, None if d_w is None else d_w.to(weight.dtype),
                    None if d_b is None else d_b.to(bias.dtype), None, None, None)
        grads = tuple(None if d is None else d * grad_loss.to(d.dtype)
                      for d in ctx.saved_tensors)
        return grads + (None, None, None)


def chunked_linear_distillation(
    hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
    teacher: Teacher, labels: torch.Tensor, token_weights: Optional[torch.Tensor],
    opts: DistillationOptions, *, vocab_size: int, vocab_start: int = 0,
    reduce_max: Reduce = no_reduce, reduce_sum: Reduce = no_reduce,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validated-input core of the single-device and vocab-parallel distillation losses.

    Args:
        hidden: ``[N, H]`` student hidden states.
        weight / bias: ``[V_local, H]`` / ``[V_local]`` or ``None``: the real rows of this
            slice of the student's lm_head.
        teacher: a :class:`Teacher` over the same ``N`` tokens (its lm_head over the same rows).
        labels: ``[N]`` int64 global ids or ``opts.ignore_index``.
        token_weights: ``[N]`` float or ``None``.
        opts: the options.
        vocab_size: the real, global ``V``.
        vocab_start: this slice's first global id.
        reduce_max / reduce_sum: in-place combiners of the ``[stats, tokens]`` statistics
            across vocab slices.

    Returns:
        ``(loss, divergence, ce, top1_match)``: ``loss`` reduced as ``opts.reduction`` (the
        differentiable output); ``divergence`` and ``ce`` its two parts reduced the same way,
        weighted by the same per-token coefficients but without the factors ``soft_scale`` /
        ``alpha`` (no gradient); ``top1_match [N]`` 0/1 per token (0 at ignored tokens). fp32
        (fp64 for fp64 inputs).
    """
    plan = _Plan(opts, teacher, vocab_size, vocab_start, reduce_max, reduce_sum)
    loss, parts, match = _ChunkedLinearDistillation.apply(hidden, weight, bias, labels,
                                                          token_weights, plan)
    return loss, parts[0].detach(), parts[1].detach(), match.detach()
