r"""The log-probabilities epilogue of :mod:`megaloss.ops.log_probs_chunk` as two fused Triton
kernels, the counterpart of :mod:`megaloss.ops.triton_epilogue` (the ``tanh`` and launch helpers
of :mod:`megaloss.ops.triton_common` shared).

1. ``_stats_kernel`` (forward, read only), one program per token row, online softmax over blocks
   of the row (Milakov & Gimelshein 2018, arXiv:1805.02867) extended by one running sum: the
   local max ``m`` of ``y = softcap(z) / T``, ``s = sum_j e^{y_j - m}``, the label's ``y`` (0
   outside this slice) and, with entropy, ``w = sum_j e^{y_j - m} (y_j - m)``. When the running
   max moves from ``m`` to ``m'``, ``s <- a s`` and ``w <- a (w + (m - m') s)`` with
   ``a = e^{m - m'}``.
2. Between the kernels, on ``[C]`` vectors in torch: the same rescaling to the global max
   ``M = reduce_max(m)``, one ``reduce_sum`` of ``[s, y_label, w]``, then
   :func:`megaloss.ops.log_probs_chunk.results_from_stats`, shared with the torch epilogue.
3. ``_grad_kernel`` (backward, read and write in place), one program per (row, block of
   columns): ``(a [j = label] - p_j (a + b (y_j - mu))) (1 - tanh^2) / T`` over the recomputed
   raw logits, stored in their dtype.

Imports ``triton``: :mod:`megaloss.ops.log_probs_chunk` imports this module only when the
Triton epilogue is selected.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .chunk_kernel import Reduce, no_reduce
from .log_probs_chunk import LogProbsChunk, results_from_stats
from .log_probs_options import LogProbsOptions
from .triton_common import block_size, device_guard, grad_block, load_logits, row_label, row_major

__all__ = ["triton_chunk_log_probs", "triton_chunk_log_probs_grad"]


@triton.jit
def _stats_kernel(logits_ptr, stride_row, labels_ptr, max_ptr, sumexp_ptr, target_ptr,
                  weighted_ptr, n_cols, vocab_start, ignore_index, cap, temperature,
                  HAS_CAP: tl.constexpr, HAS_ENT: tl.constexpr, BLOCK: tl.constexpr):
    row, local = row_label(labels_ptr, ignore_index, vocab_start)
    row_ptr = logits_ptr + row * stride_row
    target = tl.zeros([BLOCK], dtype=tl.float32)
    m = float("-inf")
    s = 0.0
    w = 0.0
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        y, _ = load_logits(row_ptr + cols, mask, cap, HAS_CAP)
        y = y / temperature
        target += tl.where(cols == local, y, 0.0)
        y = tl.where(mask, y, float("-inf"))
        m_new = tl.maximum(m, tl.max(y, axis=0))
        alpha = tl.exp(m - m_new)
        e = tl.exp(y - m_new)
        if HAS_ENT:
            # m - m_new is -inf on the first block, where s = w = 0: no -inf * 0.
            w = alpha * (w + tl.where(s > 0.0, m - m_new, 0.0) * s)
            w += tl.sum(e * tl.where(mask, y - m_new, 0.0), axis=0)  # masked: 0, not 0 * -inf
        s = s * alpha + tl.sum(e, axis=0)
        m = m_new
    tl.store(max_ptr + row, m)
    tl.store(sumexp_ptr + row, s)
    tl.store(target_ptr + row, tl.sum(target, axis=0))
    if HAS_ENT:
        tl.store(weighted_ptr + row, w)


@triton.jit
def _grad_kernel(logits_ptr, stride_row, labels_ptr, lse_ptr, mu_ptr, a_ptr, b_ptr, n_cols,
                 vocab_start, ignore_index, cap, temperature,
                 HAS_CAP: tl.constexpr, HAS_ENT: tl.constexpr, BLOCK: tl.constexpr):
    row, local = row_label(labels_ptr, ignore_index, vocab_start)
    cols, mask, ptrs = grad_block(logits_ptr, stride_row, row, n_cols, BLOCK)
    y, t = load_logits(ptrs, mask, cap, HAS_CAP)
    y = y / temperature
    p = tl.exp(y - tl.load(lse_ptr + row))
    a = tl.load(a_ptr + row)
    if HAS_ENT:
        mu = tl.load(mu_ptr + row)
        b = tl.load(b_ptr + row)
        g = -p * (a + b * (y - mu))
    else:
        g = -p * a
    g = tl.where(cols == local, g + a, g)
    if HAS_CAP:
        g = g * (1.0 - t * t)
    g = g / temperature
    tl.store(ptrs, g.to(logits_ptr.dtype.element_ty), mask=mask)


def triton_chunk_log_probs(logits: torch.Tensor, labels: torch.Tensor, opts: LogProbsOptions, *,
                           vocab_start: int = 0, reduce_max: Reduce = no_reduce,
                           reduce_sum: Reduce = no_reduce) -> LogProbsChunk:
    """:func:`megaloss.ops.log_probs_chunk.chunk_log_probs` (same arguments and results, in
    fp32) with the fused statistics kernel; ``logits`` (fp32 / bf16 / fp16) is only read."""
    logits, labels = row_major(logits), labels.contiguous()
    n_rows, n_cols = logits.shape
    cap, ent = opts.logit_softcapping, opts.return_entropy
    dev = logits.device
    with device_guard(logits):
        local_max = torch.full((n_rows,), float("-inf"), dtype=torch.float32, device=dev)
        packed = torch.zeros(3 if ent else 2, n_rows, dtype=torch.float32, device=dev)
        if n_rows > 0 and n_cols > 0:  # a vocab-parallel rank may hold no real vocab rows
            block = block_size(n_cols)
            _stats_kernel[(n_rows,)](
                logits, logits.stride(0), labels, local_max, packed[0], packed[1],
                packed[2] if ent else packed[1], n_cols, vocab_start, opts.ignore_index,
                1.0 if cap is None else cap, opts.temperature,
                HAS_CAP=cap is not None, HAS_ENT=ent, BLOCK=block,
                num_warps=8 if block >= 2048 else 4)
        row_max = reduce_max(local_max.clone())
        shift = local_max - row_max  # -inf for a slice without rows (its sums are 0)
        alpha = torch.exp(shift)
        if ent:
            shift = torch.where(packed[0] > 0, shift, 0.0)  # no -inf * 0 for an empty slice
            packed[2] = alpha * (packed[2] + shift * packed[0])
        packed[0].mul_(alpha)
        packed = reduce_sum(packed)
    return results_from_stats(row_max, packed, labels != opts.ignore_index, opts)


def triton_chunk_log_probs_grad(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor,
                                mean_logit: Optional[torch.Tensor], grad_log_probs: torch.Tensor,
                                grad_entropy: Optional[torch.Tensor], opts: LogProbsOptions, *,
                                vocab_start: int = 0) -> torch.Tensor:
    """:func:`megaloss.ops.log_probs_chunk.chunk_log_probs_grad` with the fused gradient kernel:
    the gradient is written over ``logits`` (same dtype) and returned."""
    logits = row_major(logits)
    n_rows, n_cols = logits.shape
    cap = opts.logit_softcapping
    ent = grad_entropy is not None
    f32 = torch.float32
    a = grad_log_probs.to(f32).contiguous()
    with device_guard(logits):
        if n_rows > 0 and n_cols > 0:
            block = min(block_size(n_cols), 2048)
            _grad_kernel[(n_rows, triton.cdiv(n_cols, block))](
                logits, logits.stride(0), labels.contiguous(), lse.to(f32).contiguous(),
                mean_logit.to(f32).contiguous() if ent else a,
                a, grad_entropy.to(f32).contiguous() if ent else a, n_cols, vocab_start,
                opts.ignore_index, 1.0 if cap is None else cap, opts.temperature,
                HAS_CAP=cap is not None, HAS_ENT=ent, BLOCK=block, num_warps=4)
    return logits
