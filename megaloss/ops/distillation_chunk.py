r"""Distillation loss of one chunk of tokens against one slice of the vocabulary, with the
gradient w.r.t. the student's logits (the teacher gets none).

Notation, per token: student logits ``z`` (soft-capped to ``y``), ``s = y / T``, ``Q = softmax(s)``;
teacher either full logits (soft-capped, divided by ``T``: ``t``, ``P = softmax(t)``) or its top-k
token ids ``K`` and log-probs ``log P_k`` (then ``P`` lives on ``k + 1`` outcomes: the ``k``
tokens and the *tail*, everything else, with ``P_tail = 1 - sum_k P_k``, at least the smallest
normal number, and slots of log-prob ``-inf`` counted in the tail; the student is coarse-
grained the same way, ``Q_tail = sum_{j not in K} Q_j``, so every divergence is a proper one
between two distributions over the same ``k + 1`` outcomes, and equals the full-vocabulary one
when the top-k holds all the teacher's mass).

Divergences ``D(P, Q)`` over outcomes ``o`` (``kind``, see
:class:`~megaloss.DistillationOptions`): forward KL ``sum P (log P - log Q)``,
reverse KL ``sum Q (log Q - log P)``, and the generalised JSD of Liger-Kernel
(``src/liger_kernel/ops/jsd.py``) ``beta KL(P||M) + (1 - beta) KL(Q||M)``,
``M = beta P + (1 - beta) Q``. The gradient w.r.t. the student's scaled logits is, for token
``j`` in outcome ``o(j)``,

.. math::

    \partial D / \partial s_j = Q_j \,(g_{o(j)} - \textstyle\sum_o Q_o g_o),\qquad
    g_o = \partial D / \partial Q_o

with ``g = -P/Q`` (forward KL: ``Q_j - P_j`` on single tokens), ``log Q - log P + 1`` (reverse
KL) and ``(1 - beta)(log Q - log M)`` (JSD). The hard-label part is the cross-entropy of ``y``
(temperature 1), gradient ``softmax(y) - onehot``. The per-token loss is
``soft_scale * D + alpha * CE``; the logit gradient ``soft_scale / T * dD/ds + alpha * dCE/dy``,
times ``1 - tanh^2`` under soft-capping.

Tensor parallelism: the chunk sees its slice ``[vocab_start, vocab_start + V_local)`` of both
heads; three combines of ``[stats, tokens]`` tensors make every statistic global: (1) MAX of the
local maxima of ``s`` and ``t``; (2) SUM of the sum-exps (and the target logit, the top-1 match,
the top-k sums); (3) SUM of the divergence's per-token partial sums (``D`` and ``sum_o Q_o g_o``).
Statistics are fp32 (fp64 for fp64 inputs).

:class:`DistillationKernel` is the loss's :class:`~megaloss.ops.chunk_kernel.ChunkKernel`: the
chunk driver hands it the student's logits, it applies the teacher's lm_head to the same chunk
(Liger-Kernel's ``chunked_loss/fused_linear_distillation.py`` schedule: neither model's
``[tokens, vocab]`` logits outlive a chunk). The teacher is a constant: it gets no gradient,
whatever its ``requires_grad``. Its recompute schedule (``reduction="none"``, fp16) recomputes
both heads' logits in backward.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence, Tuple

import torch

from .chunk_driver import head_logits
from .chunk_kernel import (
    ChunkKernel,
    VocabSlice,
    label_columns,
    softcap,
    softcap_chain_,
    stats_dtype,
    where0,
)
from .distillation_options import DistillationOptions

__all__ = ["DistillationChunk", "DistillationKernel", "Teacher", "TopKTeacher",
           "distillation_epilogue"]


class TopKTeacher(NamedTuple):
    """A chunk's teacher as offline pipelines store it: ``ids [C, k]`` int64 global vocab ids
    (distinct per row among the used slots) and ``log_probs [C, k]`` float, the teacher's
    log-probabilities of those ids at the distillation temperature (``-inf``: an unused slot,
    whose id is ignored)."""

    ids: torch.Tensor
    log_probs: torch.Tensor


class DistillationChunk(NamedTuple):
    """Per token of the chunk, in the stats dtype: ``loss [C]`` (``soft_scale * D + alpha *
    CE``, 0 at ignored tokens), ``divergence [C]`` (``D`` alone), ``ce [C]`` (the student's
    cross-entropy at temperature 1, computed whatever ``alpha``), ``top1_match [C]`` (1 where
    the student's and the teacher's most likely tokens agree), and ``grad_logits [C, V_local]``
    (already times ``coef``; ``None`` when not asked for)."""

    loss: torch.Tensor
    divergence: torch.Tensor
    ce: torch.Tensor
    top1_match: torch.Tensor
    grad_logits: Optional[torch.Tensor]




def _terms(kind: str, beta: float, log_p: torch.Tensor, log_q: torch.Tensor
           ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Elementwise ``(d, g)``: the divergence's term per outcome (``D = sum d``) and
    ``g = dD/dQ`` up to a constant (``None`` for forward KL, whose gradient is formed directly).
    Zero-probability outcomes contribute 0 (``0 log 0 = 0``)."""
    p, q = log_p.exp(), log_q.exp()
    if kind == "forward_kl":
        return where0(p > 0, p * (log_p - log_q)), None
    if kind == "reverse_kl":
        g = log_q - log_p
        return where0(q > 0, q * g), where0(q > 0, g)
    log_m = torch.logaddexp(log_p + math.log(beta), log_q + math.log1p(-beta))
    d = beta * where0(p > 0, p * (log_p - log_m)) + (1 - beta) * where0(q > 0, q * (log_q - log_m))
    return d, where0(q > 0, (1 - beta) * (log_q - log_m))


def distillation_epilogue(z: torch.Tensor, teacher: "torch.Tensor | TopKTeacher",
                          labels: torch.Tensor, coef: Optional[torch.Tensor],
                          opts: DistillationOptions, vocab: VocabSlice) -> DistillationChunk:
    """Loss, metrics and (optionally) the student-logit gradient of one chunk.

    Args:
        z: ``[C, V_local]`` the student's raw logits over this slice (the caller's buffer).
        teacher: ``[C, V_local]`` the teacher's logits over the same slice (any float dtype),
            or a :class:`TopKTeacher` (global ids).
        labels: ``[C]`` int64 global ids or ``opts.ignore_index``.
        coef: ``[C]`` gradient coefficient per token (0 at ignored tokens), or ``None``.
        opts: :class:`~megaloss.DistillationOptions` (``reduction``, ``chunk_size``
            and ``accum_dtype`` are the caller's).
        vocab: this device's :class:`~megaloss.ops.chunk_kernel.VocabSlice`: the real, global
            ``V`` (a top-k of all ``V`` ids leaves no tail), the slice's first id and the
            in-place combiners across slices.

    Returns:
        :class:`DistillationChunk`.
    """
    sdt = stats_dtype(z.dtype)
    y, tanh = softcap(z.to(sdt), opts.logit_softcapping)
    del z  # the fp32 copy (or the soft-capped values) is what is kept
    valid, in_slice, target_idx = label_columns(labels, opts.ignore_index, vocab.start,
                                                y.shape[1])
    if isinstance(teacher, TopKTeacher):
        temp = opts.temperature
        s = y / temp if temp != 1.0 else y
        s_max_local = (s.amax(dim=1) if s.shape[1] > 0
                       else s.new_full((s.shape[0],), float("-inf")))
        return _topk_chunk(s, y, tanh, teacher, labels, valid, in_slice, target_idx, coef, opts,
                           vocab.start, vocab.vocab_size, s_max_local, vocab.reduce_max,
                           vocab.reduce_sum)
    t, _ = softcap(teacher.to(sdt), opts.teacher_logit_softcapping)
    del teacher
    return _full_chunk(y, tanh, t, valid, in_slice, target_idx, coef, opts, vocab.reduce_max,
                       vocab.reduce_sum)


class Teacher:
    """The teacher of a distillation call: either ``hidden [N, Ht]`` with ``weight [V_local,
    Ht]`` (and ``bias``), whose product is formed a chunk at a time, or a top-k form ``ids
    [N, k]`` / ``log_probs [N, k]``. Detached: the teacher gets no gradient."""

    def __init__(self, hidden: Optional[torch.Tensor] = None,
                 weight: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                 topk_ids: Optional[torch.Tensor] = None,
                 topk_log_probs: Optional[torch.Tensor] = None):
        self.hidden = None if hidden is None else hidden.detach()
        self.weight = None if weight is None else weight.detach()
        self.bias = None if bias is None else bias.detach()
        self.topk_ids = topk_ids
        self.topk_log_probs = None if topk_log_probs is None else topk_log_probs.detach()

    def chunk(self, rows: slice) -> "torch.Tensor | TopKTeacher":
        """The teacher of the tokens ``rows``: its logits ``[C, V_local]`` or its top-k."""
        if self.topk_ids is not None:
            return TopKTeacher(self.topk_ids[rows], self.topk_log_probs[rows])
        with torch.no_grad():
            h = self.hidden[rows]
            dtype = torch.promote_types(h.dtype, self.weight.dtype)
            return head_logits(h.to(dtype), self.weight.to(dtype),
                               None if self.bias is None else self.bias.to(dtype))


class DistillationKernel(ChunkKernel):
    """The distillation loss as a chunk kernel: results ``(loss, divergence, ce, top1_match)``
    per token, the loss differentiable; nothing saved (its recompute schedule reruns both
    heads).

    Args:
        teacher: the :class:`Teacher` of the same ``N`` tokens (its lm_head over the same
            vocabulary rows as the student's).
        labels: ``[N]`` int64 global ids or ``opts.ignore_index``.
        opts: the options.
        vocab: this device's :class:`~megaloss.ops.chunk_kernel.VocabSlice`.
    """

    n_outputs, n_differentiable, saved = 4, 1, ()

    def __init__(self, teacher: Teacher, labels: torch.Tensor, opts: DistillationOptions,
                 vocab: VocabSlice):
        self.teacher, self.labels, self.opts, self.vocab = teacher, labels, opts, vocab

    def forward(self, logits, rows, coef):
        res = distillation_epilogue(logits, self.teacher.chunk(rows), self.labels[rows], coef,
                                    self.opts, self.vocab)
        return (res.loss, res.divergence, res.ce, res.top1_match), res.grad_logits

    def backward(self, logits, rows, saved: Sequence[torch.Tensor], upstream):
        return self.forward(logits, rows, upstream[0])[1]


def _full_chunk(y, tanh, t, valid, in_slice, target_idx, coef, opts: DistillationOptions,
                reduce_max, reduce_sum) -> DistillationChunk:
    """The full-teacher form on ``y`` (student, soft-capped) and ``t`` (teacher, soft-capped),
    both ``[C, V_local]`` in the stats dtype and owned here: worked on in place, so that at most
    five ``[C, V_local]`` buffers are alive (``log Q``, ``log P``, ``Q``, ``P``, one term)."""
    sdt, temp, kind, beta = y.dtype, opts.temperature, opts.divergence, opts.beta
    n_rows, n_local = y.shape
    if n_local > 0:
        y_max_local = y.amax(dim=1)
        t_max_local, t_arg = t.max(dim=1)
        # Top-1 match: this slice holds a teacher maximum and the student is maximal there.
        y_at_t_arg = y.gather(1, t_arg.unsqueeze(1)).squeeze(1)
        target = y.gather(1, target_idx).squeeze(1) * in_slice
    else:  # a vocab-parallel rank may hold no real vocab rows
        y_max_local = t_max_local = y_at_t_arg = y.new_full((n_rows,), float("-inf"))
        target = y.new_zeros(n_rows)
    maxes = reduce_max(torch.stack([y_max_local, t_max_local]))          # round 1
    y_max, t_max = maxes[0], maxes[1]
    match = ((t_max_local == t_max) & (y_at_t_arg == y_max)).to(sdt)
    sums = [match, target]
    if temp != 1.0:  # the hard-label CE's own sum-exp, at temperature 1
        sums.append((y - y_max.unsqueeze(1)).exp_().sum(dim=1))
        y.div_(temp)
        t.div_(temp)
    s_max, t_max = y_max / temp, t_max / temp  # max(y / T) = max(y) / T: division is monotone
    q = (y - s_max.unsqueeze(1)).exp_()
    p = (t - t_max.unsqueeze(1)).exp_()
    sums = reduce_sum(torch.stack([q.sum(dim=1), p.sum(dim=1)] + sums))  # round 2
    lse_s = s_max + sums[0].log()
    log_q = y.sub_(lse_s.unsqueeze(1))
    log_p = t.sub_((t_max + sums[1].log()).unsqueeze(1))
    q.div_(sums[0].unsqueeze(1))
    p.div_(sums[1].unsqueeze(1))
    lse_y = lse_s if temp == 1.0 else y_max + sums[4].log()
    ce = lse_y - sums[3]
    top1 = where0(valid, sums[2].clamp(max=1.0))
    need_grad = coef is not None
    if kind == "forward_kl":
        divergence = reduce_sum(_row_dot(p, log_p - log_q).unsqueeze(0))[0]  # round 3
        grad_s = q.sub_(p) if need_grad else None                           # Q - P
    elif kind == "reverse_kl":
        g = log_q - log_p
        divergence = reduce_sum((q * g).sum(dim=1).unsqueeze(0))[0]         # round 3
        grad_s = g.sub_(divergence.unsqueeze(1)).mul_(q) if need_grad else None
    else:
        # log M, M = beta P + (1 - beta) Q (clamped: where both underflow the terms are 0)
        log_m = p.mul(beta).add_(q, alpha=1.0 - beta).clamp_min_(torch.finfo(sdt).tiny).log_()
        d_p = _row_dot(p, log_p - log_m)
        g = log_m.neg_().add_(log_q)                                        # log Q - log M
        parts = reduce_sum(torch.stack([d_p, (q * g).sum(dim=1)]))          # round 3
        divergence = beta * parts[0] + (1.0 - beta) * parts[1]
        grad_s = (g.mul_(1.0 - beta).sub_(((1.0 - beta) * parts[1]).unsqueeze(1)).mul_(q)
                  if need_grad else None)
    loss = _combine(divergence, ce, valid, opts)
    if not need_grad:
        return DistillationChunk(loss, where0(valid, divergence), where0(valid, ce), top1, None)

    def probs_y():  # softmax(y) = exp(T (log Q + lse_s) - lse_y), formed only when alpha > 0
        return (log_q + lse_s.unsqueeze(1)).mul_(temp).sub_(lse_y.unsqueeze(1)).exp_()

    grad = _logit_gradient(grad_s, probs_y, in_slice, target_idx, tanh, coef.to(sdt), temp,
                           opts)
    return DistillationChunk(loss, where0(valid, divergence), where0(valid, ce), top1, grad)


def _row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(a * b).sum(1)`` over ``b``'s buffer (a temporary the caller does not keep)."""
    return b.mul_(a).sum(dim=1)


def _ce_sums(y, s_max, in_slice, target_idx, temp, opts, sums):
    """Append the hard-label statistics to the round-2 stack: the target logit of ``y`` and,
    when ``T != 1``, the sum-exp of ``y`` itself (relative to ``T * max(s)``)."""
    n_local = y.shape[1]
    target = (y.gather(1, target_idx).squeeze(1) * in_slice if n_local > 0
              else torch.zeros_like(s_max))
    sums = sums + [target]
    exp_y = None
    if temp != 1.0:
        exp_y = (y - (temp * s_max).unsqueeze(1)).exp()
        sums.append(exp_y.sum(dim=1))
    return sums, exp_y


def _ce_value(y, s_max, sums, exp_y, temp, opts):
    """``(ce [C], softmax(y) [C, V_local] or None)`` from the combined round-2 stack (the
    softmax of ``y`` is returned only when it is not ``Q`` itself, i.e. ``T != 1``)."""
    if temp == 1.0:
        lse_y = s_max + sums[0].log()
        return lse_y - sums[3], None
    lse_y = temp * s_max + sums[4].log()
    return lse_y - sums[3], exp_y / sums[4].unsqueeze(1)


def _combine(divergence, ce, valid, opts):
    loss = opts.soft_scale * divergence
    if opts.alpha > 0:
        loss = loss + opts.alpha * ce
    return where0(valid, loss)


def _logit_gradient(grad_s, probs_y, in_slice, target_idx, tanh, coef, temp, opts):
    """``coef * (soft_scale / T * dD/ds + alpha * (softmax(y) - onehot))`` times the soft-cap
    chain rule, in place over ``grad_s``; ``probs_y()`` gives ``softmax(y)`` (called only when
    ``alpha > 0``)."""
    grad = grad_s.mul_((coef * (opts.soft_scale / temp)).unsqueeze(1))
    if opts.alpha > 0:
        grad.add_(probs_y().mul_((coef * opts.alpha).unsqueeze(1)))
        if grad.shape[1] > 0:
            grad.scatter_add_(1, target_idx, (-opts.alpha * coef * in_slice).unsqueeze(1)
                              .to(grad.dtype))
    return softcap_chain_(grad, tanh)


def _topk_chunk(s, y, tanh, teacher: TopKTeacher, labels, valid, in_slice, target_idx, coef,
                opts: DistillationOptions, vocab_start, vocab_size, s_max_local, reduce_max,
                reduce_sum):
    """The top-k teacher form (module docstring): outcomes are the ``k`` ids and the tail."""
    sdt = s.dtype
    temp, kind = opts.temperature, opts.divergence
    n_rows, n_local = s.shape
    ids, log_p_k = teacher.ids, teacher.log_probs.to(sdt)
    local = ids - vocab_start
    # Held on this slice; an unused slot (log-prob -inf) is no outcome of its own: its id, if
    # any, stays in the tail.
    held = (local >= 0) & (local < n_local) & torch.isfinite(log_p_k)
    idx = local.clamp(0, max(n_local - 1, 0))
    s_max = reduce_max(s_max_local.clone())                               # round 1
    exp_s = (s - s_max.unsqueeze(1)).exp()
    if n_local > 0:
        exp_k = where0(held, exp_s.gather(1, idx))
        in_k = torch.zeros_like(exp_s).scatter_add_(1, idx, held.to(sdt)) > 0
        tail = where0(~in_k, exp_s).sum(dim=1)
        s_k = s.gather(1, idx)
    else:
        exp_k = torch.zeros_like(log_p_k)
        in_k = torch.zeros_like(exp_s, dtype=torch.bool)
        tail = torch.zeros_like(s_max)
        s_k = torch.zeros_like(log_p_k)
    # Top-1 match: the teacher's top id is held here and the student's logit is maximal there.
    arg = log_p_k.argmax(dim=1, keepdim=True)
    match = (held.gather(1, arg).squeeze(1) & (s_k.gather(1, arg).squeeze(1) == s_max)).to(sdt)
    sums, ce_extra = _ce_sums(y, s_max, in_slice, target_idx, temp, opts,
                              [exp_k.sum(dim=1) + tail, tail, match])
    sums = reduce_sum(torch.stack(sums))                                  # round 2
    lse_s = s_max + sums[0].log()
    log_q_k = s_k - lse_s.unsqueeze(1)
    log_q_tail = (sums[1].log() - sums[0].log()).unsqueeze(1)
    # P_tail = 1 - sum_k P_k, as -expm1(logsumexp) for accuracy when it is small.
    lse_p = torch.logsumexp(log_p_k, dim=1, keepdim=True)
    # Clamped to the smallest normal number: a top-k that sums to 1 up to rounding keeps reverse
    # KL and the JSD finite (the exact value is infinite when the student's tail is not empty).
    # A tail without tokens (all V ids used) has no mass at all.
    p_tail = (-torch.expm1(lse_p.clamp(max=0.0))).clamp_min(torch.finfo(sdt).tiny)
    no_tail = torch.isfinite(log_p_k).sum(dim=1, keepdim=True) >= vocab_size
    p_tail = where0(~no_tail, p_tail)
    log_p_tail = p_tail.log()
    d_k, g_k = _terms(kind, opts.beta, log_p_k, log_q_k)
    d_tail, g_tail = _terms(kind, opts.beta, log_p_tail, log_q_tail)
    parts = [where0(held, d_k).sum(dim=1)]
    if g_k is not None:
        parts.append(where0(held, log_q_k.exp() * g_k).sum(dim=1))
    parts = reduce_sum(torch.stack(parts))                                # round 3
    divergence = parts[0] + d_tail.squeeze(1)
    ce, probs_y = _ce_value(y, s_max, sums, ce_extra, temp, opts)
    loss = _combine(divergence, ce, valid, opts)
    top1 = where0(valid, sums[2].clamp(max=1.0))
    if coef is None:
        return DistillationChunk(loss, where0(valid, divergence), where0(valid, ce), top1, None)
    q = exp_s / sums[0].unsqueeze(1)
    if g_k is None:  # forward KL: Q_j - P_j on the top-k, Q_j (1 - P_tail / Q_tail) in the tail
        grad_s = q.clone()
        if n_local > 0:
            grad_s.scatter_add_(1, idx, where0(held, -log_p_k.exp()))
        tail_ratio = p_tail / sums[1].clamp_min(torch.finfo(sdt).tiny).unsqueeze(1)
        grad_s.sub_(where0(~in_k, exp_s * tail_ratio))
    else:
        g_bar = (parts[1] + where0(log_q_tail.isfinite(), log_q_tail.exp() * g_tail).squeeze(1))
        g_full = torch.where(in_k, torch.zeros((), dtype=sdt, device=s.device), g_tail)
        if n_local > 0:
            g_full = g_full.scatter_add(1, idx, where0(held, g_k))
        grad_s = q.mul_(g_full - g_bar.unsqueeze(1))
    grad = _logit_gradient(
        grad_s, lambda: probs_y if probs_y is not None else (y - lse_s.unsqueeze(1)).exp(),
        in_slice, target_idx, tanh, coef.to(sdt), temp, opts)
    return DistillationChunk(loss, where0(valid, divergence), where0(valid, ce), top1, grad)
