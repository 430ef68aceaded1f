r"""The chunk epilogue of :mod:`megaloss.ops.cross_entropy_chunk` as two fused Triton kernels.

Imports only the leaf :mod:`megaloss.ops.chunk_stats` (statistics, loss from statistics) and
the options, never :mod:`~megaloss.ops.cross_entropy_chunk`, which imports this module lazily
when the Triton epilogue is selected.

After a chunk's lm_head GEMM, the eager epilogue makes about ten passes over the ``[C, V_local]``
logits (cast to fp32, tanh, max, subtract, exp, sum, gather, scale, scatter, smoothing). Here the
same math (formulas in :mod:`megaloss.ops.cross_entropy_chunk`) takes two passes over the logits
buffer, in the compute dtype (bf16 / fp16 / fp32; arithmetic in fp32):

1. ``_stats_kernel`` (read only), one program per token row, online softmax over blocks of the
   row (Milakov & Gimelshein 2018, arXiv:1805.02867): the row's local max ``m``, the sum-exp
   relative to it ``s = sum_j exp(y_j - m)``, the target logit (0 when the target lies outside
   this slice ``[vocab_start, vocab_start + V_local)`` or is ignored) and, with label smoothing,
   the sum of the (soft-capped) logits ``y``.
2. Between the passes, on ``[C]`` vectors in torch: the global max ``M = reduce_max(m)``,
   ``s * exp(m - M)``, one ``reduce_sum`` of the stacked ``[sum-exp, target, (sum of logits)]``
   (the vocab-parallel combine; Megatron-core's ``tensor_parallel/cross_entropy.py`` exchanges the
   same statistics), then ``lse = M + log(sum-exp)`` and the loss
   (:func:`megaloss.ops.chunk_stats.loss_from_stats`, shared with the torch epilogue).
3. ``_grad_kernel`` (read, write in place), one program per (row, block of columns):
   ``coef * ((1 + 2 z lse) exp(y - lse) - (1 - eps)[j = target] - eps / V)``, times
   ``1 - tanh^2`` under soft-capping, stored over the logits it read. The raw logits stay in the
   buffer until then (pass 1 only reads), so soft-capping is recomputed from them in pass 2.

Ignored tokens have ``coef == 0`` (the caller's contract), hence gradient 0; their loss is set to
0 here. Liger-Kernel (``src/liger_kernel/ops/cross_entropy.py``) does the same in-place trick in
one kernel with two loops per row; the split here lets the vocab-parallel combine sit between the
passes.

``tanh`` (:func:`megaloss.ops.triton_common.tanh_f32`) is written with ``exp`` (a Taylor
polynomial near 0, where ``(1 - e) / (1 + e)`` loses digits), because libdevice's ``tanh`` is
not available under Triton's interpreter.

This module imports ``triton``: :mod:`megaloss.ops.cross_entropy_chunk` imports it only when
the Triton epilogue is selected (:mod:`megaloss.ops.epilogue_choice` asks
:func:`~megaloss.ops.triton_common.interpreted`). Triton's interpreter
(``TRITON_INTERPRET=1``, which runs the
kernels on CPU tensors, slowly) is chosen when triton is imported: triton's own library
(``tl.sum``, ``tl.zeros``, ...) is jitted then, so the variable must be set before the first
``import triton`` of the process (tests run the interpreted cases in a subprocess).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .chunk_kernel import VocabSlice
from .chunk_stats import ChunkResult, loss_from_stats
from .cross_entropy_options import CrossEntropyOptions
from .triton_common import block_size, device_guard, grad_block, load_logits, row_label, row_major

__all__ = ["triton_chunk_epilogue"]

@triton.jit
def _stats_kernel(logits_ptr, stride_row, labels_ptr, max_ptr, sumexp_ptr, target_ptr,
                  sumlogits_ptr, n_cols, vocab_start, ignore_index, cap,
                  HAS_CAP: tl.constexpr, HAS_SMOOTH: tl.constexpr, BLOCK: tl.constexpr):
    row, local = row_label(labels_ptr, ignore_index, vocab_start)
    row_ptr = logits_ptr + row * stride_row
    m = float("-inf")
    s = 0.0
    # Per-lane partial sums, reduced once after the loop: only max and sum-exp reduce per block.
    target = tl.zeros([BLOCK], dtype=tl.float32)
    sum_y = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        y, _ = load_logits(row_ptr + cols, mask, cap, HAS_CAP)
        target += tl.where(cols == local, y, 0.0)  # masked lanes hold y = 0
        if HAS_SMOOTH:
            sum_y += y
        y = tl.where(mask, y, float("-inf"))
        m_new = tl.maximum(m, tl.max(y, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(y - m_new), axis=0)
        m = m_new
    tl.store(max_ptr + row, m)
    tl.store(sumexp_ptr + row, s)
    tl.store(target_ptr + row, tl.sum(target, axis=0))
    if HAS_SMOOTH:
        tl.store(sumlogits_ptr + row, tl.sum(sum_y, axis=0))


@triton.jit
def _grad_kernel(logits_ptr, stride_row, labels_ptr, lse_ptr, coef_ptr, n_cols, vocab_start,
                 ignore_index, cap, two_z, eps_over_v, one_minus_eps,
                 HAS_CAP: tl.constexpr, BLOCK: tl.constexpr):
    row, local = row_label(labels_ptr, ignore_index, vocab_start)
    cols, mask, ptrs = grad_block(logits_ptr, stride_row, row, n_cols, BLOCK)
    y, t = load_logits(ptrs, mask, cap, HAS_CAP)
    coef = tl.load(coef_ptr + row)
    lse = tl.load(lse_ptr + row)
    g = tl.exp(y - lse) * (coef * (1.0 + two_z * lse)) - coef * eps_over_v
    g = tl.where(cols == local, g - coef * one_minus_eps, g)
    if HAS_CAP:
        g = g * (1.0 - t * t)
    tl.store(ptrs, g.to(logits_ptr.dtype.element_ty), mask=mask)


def triton_chunk_epilogue(logits: torch.Tensor, labels: torch.Tensor,
                          coef: Optional[torch.Tensor], opts: CrossEntropyOptions,
                          vocab: VocabSlice, *, lse: Optional[torch.Tensor] = None) -> ChunkResult:
    """Loss, log-sum-exp and (when ``coef`` is given) logit gradient of one chunk, from its
    logits; the contract of :func:`megaloss.ops.cross_entropy_chunk.chunk_cross_entropy` after
    its GEMM.

    Args:
        logits: ``[C, V_local]`` fp32 / bf16 / fp16, the caller's own buffer: with ``coef`` it
            is overwritten by the gradient (same dtype) and returned as ``grad_logits``.
        labels: ``[C]`` int64 global ids or ``opts.ignore_index``.
        coef: ``[C]`` gradient coefficient per token (0 at ignored tokens) or ``None``.
        opts, lse: as ``chunk_cross_entropy``.
        vocab: this device's :class:`~megaloss.ops.chunk_kernel.VocabSlice` (its size, first
            id and the combiners across slices).

    Returns:
        :class:`~megaloss.ops.chunk_stats.ChunkResult`: ``loss`` and ``lse`` in fp32,
        ``grad_logits`` is ``logits`` itself (or ``None``).
    """
    logits, labels = row_major(logits), labels.contiguous()
    n_rows, n_cols = logits.shape
    cap, eps = opts.logit_softcapping, opts.label_smoothing
    dev = logits.device
    with device_guard(logits):
        if lse is None:
            # Pass 1 (steps 1-2 on this slice): local max, and the sums relative to it.
            local_max = torch.full((n_rows,), float("-inf"), dtype=torch.float32, device=dev)
            # Rows of the one SUM all-reduce: sum-exp, target logit, (sum of logits).
            packed = torch.zeros(3 if eps > 0 else 2, n_rows, dtype=torch.float32, device=dev)
            if n_rows > 0 and n_cols > 0:  # a vocab-parallel rank may hold no real vocab rows
                block = block_size(n_cols)
                _stats_kernel[(n_rows,)](
                    logits, logits.stride(0), labels, local_max, packed[0], packed[1],
                    packed[2] if eps > 0 else packed[1], n_cols, vocab.start,
                    opts.ignore_index, 1.0 if cap is None else cap,
                    HAS_CAP=cap is not None, HAS_SMOOTH=eps > 0, BLOCK=block,
                    num_warps=8 if block >= 2048 else 4)
            # Combine across slices: the global max; each slice's sum-exp moved from its own
            # max to the global one (exp(-inf) = 0 for a slice with no rows); one SUM.
            row_max = vocab.reduce_max(local_max.clone())
            packed[0].mul_(torch.exp(local_max - row_max))
            packed = vocab.reduce_sum(packed)
            # Step 3: the loss from the statistics.
            loss, lse, correct = loss_from_stats(row_max, packed, labels, opts, vocab.vocab_size)
        else:
            lse = lse.to(torch.float32)
            loss = torch.zeros_like(lse)
            correct = None
        if coef is None:
            return ChunkResult(loss, lse, None, correct)
        if n_rows > 0 and n_cols > 0:  # pass 2 (step 4): the gradient, over the logits
            block = min(block_size(n_cols), 2048)
            _grad_kernel[(n_rows, triton.cdiv(n_cols, block))](
                logits, logits.stride(0), labels, lse.contiguous(),
                coef.to(torch.float32).contiguous(), n_cols, vocab.start, opts.ignore_index,
                1.0 if cap is None else cap, 2.0 * opts.z_loss, eps / vocab.vocab_size, 1.0 - eps,
                HAS_CAP=cap is not None, BLOCK=block, num_warps=4)
    return ChunkResult(loss, lse, logits, correct)
