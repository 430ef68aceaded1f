r"""Cross-entropy of one chunk of tokens against one slice of the vocabulary, with its gradient.

For token ``t`` with logits ``z_t = W h_t + b`` over the vocabulary ``[0, V)``:

.. math::

    y_j &= c \tanh(z_j / c) \quad\text{(logit soft-capping, Gemma 2; } y = z \text{ without it)}\\
    \mathrm{lse} &= \log \textstyle\sum_{j<V} e^{y_j}\\
    \ell_t &= \mathrm{lse} - (1-\varepsilon)\, y_{\text{target}} -
    \tfrac{\varepsilon}{V}\textstyle\sum_{j<V} y_j
              + \lambda_z\, \mathrm{lse}^2

which is ``F.cross_entropy(y, target, label_smoothing=eps)`` (torch's smoothing: a mix of the
one-hot and the uniform distribution over all V classes) plus the PaLM z-loss
``z_loss * lse**2``. With class weights ``w [V]`` (torch's ``weight=``, Liger-Kernel's
``ce_weight``) it is ``w_target ((1 - eps)(lse - y_target) + z_loss lse^2) + eps / V
sum_j w_j (lse - y_j)``, torch's weighted smoothed cross-entropy plus the z-loss weighted as the
token's class (the caller's ``"mean"`` divides by the sum of ``w_target``). Its gradient w.r.t.
the logits is

.. math::

    \partial \ell / \partial y_j = p_j (1 + 2\lambda_z \mathrm{lse}) - (1-\varepsilon)[j =
    \text{target}]
                                   - \varepsilon / V, \qquad p_j = e^{y_j - \mathrm{lse}}

times ``1 - tanh(z_j/c)^2`` under soft-capping (with class weights: ``p_j (w_t (1 - eps +
2 z lse) + eps W / V) - (1 - eps) w_t [j = t] - eps w_j / V``, ``W = sum_j w_j``). Ignored
tokens have loss 0 and gradient 0.

When the vocabulary is split over tensor-parallel ranks (Megatron-core's vocab-parallel CE), this
function sees only its slice ``[vocab_start, vocab_start + V_local)``; the per-token max and the
per-token sums (sum-exp, target logit, sum of logits) are combined across the slices by the
``reduce_max`` / ``reduce_sum`` callables the caller passes — two collectives on ``[tokens]``-sized
tensors, never logits. Label smoothing divides by the *global* ``V`` (Megatron's local-size version
makes losses differ between TP ranks). Statistics are kept in fp32 (fp64 for fp64 inputs).

Two epilogues (everything after the chunk's GEMM) compute this, chosen by ``opts.impl`` (see
:func:`epilogue_impl`): eager torch ops on an fp32 copy of the logits (:func:`torch_epilogue`,
here; any device, the reference), or two fused Triton kernels working in place on the logits
buffer (:mod:`megaloss.ops.triton_epilogue`; CUDA, or CPU under Triton's interpreter). Both take
the same steps: (1) soft-cap the logits, (2) this slice's row statistics, combined across slices,
(3) the loss from the statistics (:func:`megaloss.ops.chunk_stats.loss_from_stats`, shared),
(4) the logit gradient. The shared pieces live in the leaf :mod:`megaloss.ops.chunk_stats`;
this module imports :mod:`~megaloss.ops.triton_epilogue` only when it is selected, and that
module does not import this one.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from .chunk_driver import head_logits
from .chunk_kernel import (
    ChunkKernel,
    Reduce,
    VocabSlice,
    label_columns,
    no_reduce,
    softcap,
    softcap_chain_,
    stats_dtype,
)
from .chunk_stats import ChunkResult, ClassWeights, loss_from_stats
from .cross_entropy_options import CrossEntropyOptions
from .epilogue_choice import epilogue_impl

__all__ = ["ChunkResult", "CrossEntropyKernel", "chunk_cross_entropy", "torch_epilogue",
           "epilogue_impl", "stats_dtype", "Reduce", "no_reduce"]


class CrossEntropyKernel(ChunkKernel):
    """The cross-entropy as a chunk kernel: results ``(loss, lse, correct)`` per token, the
    loss differentiable; ``lse`` saved for the recompute schedule.

    Args:
        labels: ``[N]`` int64 global ids or ``opts.ignore_index``.
        opts: the options (``impl`` picks the epilogue per chunk).
        vocab: this device's :class:`~megaloss.ops.chunk_kernel.VocabSlice`.
        class_weight: optional ``[V]`` class weights (the whole vector; this slice's part is
            taken here), torch epilogue only.
    """

    n_outputs, n_differentiable, saved = 3, 1, (1,)

    def __init__(self, labels: torch.Tensor, opts: CrossEntropyOptions, vocab: VocabSlice,
                 class_weight: Optional[torch.Tensor] = None):
        self.labels, self.opts, self.vocab = labels, opts, vocab
        self.class_weight = class_weight

    def _weights(self, rows: slice, n_local: int, dtype: torch.dtype) -> Optional[ClassWeights]:
        w = self.class_weight
        if w is None:
            return None
        w = w.to(dtype)
        labels = self.labels[rows]
        valid = labels != self.opts.ignore_index
        of_label = torch.where(valid, w[labels.clamp(0, w.shape[0] - 1)], 0.0)
        start = self.vocab.start
        return ClassWeights(of_label, w[start:start + n_local], w.sum())

    def _epilogue(self, logits, rows, coef, lse) -> ChunkResult:
        weights = self._weights(rows, logits.shape[1], stats_dtype(logits.dtype))
        epilogue = torch_epilogue
        if weights is None and epilogue_impl(self.opts.impl, logits) == "triton":
            from .triton_epilogue import triton_chunk_epilogue as epilogue  # imports triton
        kwargs = {} if weights is None else {"class_weights": weights}
        return epilogue(logits, self.labels[rows], coef, self.opts, self.vocab, lse=lse, **kwargs)

    def forward(self, logits, rows, coef):
        res = self._epilogue(logits, rows, coef, None)
        return (res.loss, res.lse, res.correct), res.grad_logits

    def backward(self, logits, rows, saved: Sequence[torch.Tensor], upstream):
        return self._epilogue(logits, rows, upstream[0], saved[0]).grad_logits


def chunk_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    labels: torch.Tensor,
    coef: Optional[torch.Tensor],
    opts: CrossEntropyOptions,
    *,
    vocab_size: int,
    vocab_start: int = 0,
    lse: Optional[torch.Tensor] = None,
    reduce_max: Reduce = no_reduce,
    reduce_sum: Reduce = no_reduce,
) -> ChunkResult:
    """Loss, log-sum-exp and (optionally) logit gradient of one chunk, from its hidden states:
    the chunk's GEMM, then the epilogue ``opts.impl`` selects.

    Args:
        hidden: ``[C, H]`` chunk of hidden states, in the compute dtype.
        weight: ``[V_local, H]`` rows of the lm_head for this vocab slice (only real vocab rows,
            possibly 0 of them), same dtype as ``hidden``.
        bias: ``[V_local]`` or ``None``.
        labels: ``[C]`` int64 global vocab ids or ``opts.ignore_index``.
        coef: ``[C]`` gradient coefficient per token (the reduction's weight times the upstream
            gradient; must be 0 at ignored tokens), or ``None`` to skip the gradient.
        opts: see :class:`~megaloss.CrossEntropyOptions` (``reduction`` and
            ``chunk_size`` are the caller's business; ``impl`` picks the epilogue).
        vocab_size: the real, global ``V`` (label smoothing divides by it).
        vocab_start: global id of this slice's first row (0 without tensor parallelism).
        lse: ``[C]`` log-sum-exp from an earlier pass; when given, no reduction is needed and
            the loss is not recomputed (``loss`` is returned as zeros).
        reduce_max / reduce_sum: in-place combiners across vocab slices (identity on one device).

    Returns:
        :class:`ChunkResult`.

    Raises:
        ValueError: ``opts.impl="triton"`` where it cannot run (see :func:`epilogue_impl`).
    """
    kernel = CrossEntropyKernel(labels, opts, VocabSlice(vocab_size, vocab_start, reduce_max,
                                                         reduce_sum))
    return kernel._epilogue(head_logits(hidden, weight, bias), slice(None), coef, lse)


def torch_epilogue(logits: torch.Tensor, labels: torch.Tensor, coef: Optional[torch.Tensor],
                   opts: CrossEntropyOptions, vocab: VocabSlice, *,
                   lse: Optional[torch.Tensor] = None,
                   class_weights: Optional[ClassWeights] = None) -> ChunkResult:
    """The eager epilogue: :func:`chunk_cross_entropy` after its GEMM, on ``logits
    [C, V_local]`` (the caller's own buffer: worked on in place when already in the stats dtype)
    of the vocabulary slice ``vocab``. Returns a :class:`ChunkResult` in the stats dtype;
    ``class_weights`` (a chunk's :class:`~megaloss.ops.chunk_stats.ClassWeights`) weights the
    classes as the module doc."""
    sdt = stats_dtype(logits.dtype)
    n_local = logits.shape[1]
    logits, tanh = softcap(logits.to(sdt), opts.logit_softcapping)  # no copy for fp32/fp64
    cols = label_columns(labels, opts.ignore_index, vocab.start, n_local)

    correct = None
    if lse is None:
        row_max, stats, probs = _row_statistics(logits, cols, opts, vocab.reduce_max,
                                                vocab.reduce_sum, class_weights)
        loss, lse, correct = loss_from_stats(row_max, stats, labels, opts, vocab.vocab_size,
                                             class_weights)
        probs_scale: Optional[torch.Tensor] = 1.0 / stats[0]  # exp(y - max) / sum_exp = softmax
    else:  # second pass (deferred gradient): the softmax straight from the saved lse
        lse = lse.to(sdt)
        loss = torch.zeros_like(lse)
        probs = logits.sub_(lse.unsqueeze(1)).exp_()
        probs_scale = None

    if coef is None:
        return ChunkResult(loss, lse, None, correct)
    grad = _logit_gradient(probs, probs_scale, lse, coef.to(sdt), cols, tanh, opts,
                           vocab.vocab_size, class_weights)
    return ChunkResult(loss, lse, grad, correct)


def _row_statistics(logits: torch.Tensor, cols, opts: CrossEntropyOptions, reduce_max: Reduce,
                    reduce_sum: Reduce, class_weights: Optional[ClassWeights]
                    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 2: ``(row_max [C], stats [2|3, C], exp [C, V_local])``, combined across slices: the
    global max, then the stacked sums of :mod:`megaloss.ops.chunk_stats` (sum-exp relative to
    the global max, target logit, (weighted) sum of logits). ``logits`` is overwritten by
    ``exp``."""
    n_rows, n_local = logits.shape
    if n_local > 0:  # a vocab-parallel rank may hold no real vocab rows
        row_max = logits.amax(dim=1)
        target_logit = logits.gather(1, cols.index).squeeze(1) * cols.in_slice
    else:
        row_max = logits.new_full((n_rows,), float("-inf"))
        target_logit = logits.new_zeros(n_rows)
    row_max = reduce_max(row_max)
    sum_logits = None
    if opts.label_smoothing > 0:
        sum_logits = (logits.sum(dim=1) if class_weights is None
                      else torch.mv(logits, class_weights.local))
    exp = logits.sub_(row_max.unsqueeze(1)).exp_()
    stats = torch.stack([exp.sum(dim=1), target_logit]
                        + ([sum_logits] if sum_logits is not None else []))
    return row_max, reduce_sum(stats), exp


def _logit_gradient(probs: torch.Tensor, probs_scale: Optional[torch.Tensor], lse: torch.Tensor,
                    coef: torch.Tensor, cols, tanh: Optional[torch.Tensor],
                    opts: CrossEntropyOptions, vocab_size: int,
                    class_weights: Optional[ClassWeights]) -> torch.Tensor:
    """Step 4: ``coef * (p (1 + 2 z lse) - (1 - eps)[j = target] - eps / V)`` (class-weighted
    as the module doc), times ``1 - tanh^2`` under soft-capping; in place over ``probs``
    (``p = probs * probs_scale``)."""
    eps = opts.label_smoothing
    if class_weights is None:
        row_scale = coef * (1.0 + 2.0 * opts.z_loss * lse)
        target_coef = coef
    else:
        target_coef = coef * class_weights.of_label
        row_scale = (target_coef * (1.0 - eps + 2.0 * opts.z_loss * lse)
                     + coef * (eps * class_weights.total / vocab_size))
    if probs_scale is not None:
        row_scale = row_scale * probs_scale
    grad = probs.mul_(row_scale.unsqueeze(1))
    if grad.shape[1] > 0:
        grad.scatter_add_(1, cols.index,
                          (-(1.0 - eps) * target_coef * cols.in_slice).unsqueeze(1)
                          .to(grad.dtype))
    if eps > 0:
        smooth = (coef * (eps / vocab_size)).unsqueeze(1)
        if class_weights is None:
            grad.sub_(smooth)
        else:
            grad.sub_(smooth * class_weights.local.unsqueeze(0))
    return softcap_chain_(grad, tanh)
