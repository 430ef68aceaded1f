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
``z_loss * lse**2``. Its gradient w.r.t. the logits is

.. math::

    \partial \ell / \partial y_j = p_j (1 + 2\lambda_z \mathrm{lse}) - (1-\varepsilon)[j =
    \text{target}]
                                   - \varepsilon / V, \qquad p_j = e^{y_j - \mathrm{lse}}

times ``1 - tanh(z_j/c)^2`` under soft-capping. Ignored tokens have loss 0 and gradient 0.

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

import functools
from typing import Optional, Tuple

import torch

from .chunk_stats import ChunkResult, Reduce, loss_from_stats, no_reduce, stats_dtype
from .options import CrossEntropyOptions

__all__ = ["ChunkResult", "chunk_cross_entropy", "torch_epilogue", "epilogue_impl",
           "stats_dtype", "Reduce", "no_reduce"]


_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.lru_cache(maxsize=None)
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # ImportError, or a broken install (missing driver libraries, ...)
        return False
    return True


def _interpreter_ready() -> bool:
    """Whether triton was imported under ``TRITON_INTERPRET=1`` (its interpreter runs kernels on
    CPU tensors). Imports triton: only asked when ``impl="triton"`` meets CPU tensors."""
    from .triton_epilogue import interpreted
    return interpreted()


def epilogue_impl(impl: str, logits: torch.Tensor) -> str:
    """Which epilogue (``"torch"`` or ``"triton"``) ``impl`` selects for this chunk's logits.

    ``"auto"``: Triton for CUDA tensors of fp32 / bf16 / fp16 when ``triton`` imports, torch
    otherwise (CPU tensors always take torch, interpreter or not).

    Raises:
        ValueError: ``impl="triton"`` that cannot run here: float64 logits, ``triton`` not
            installed, CPU tensors without ``TRITON_INTERPRET=1``, or another device type.
    """
    if impl == "torch":
        return "torch"
    if impl == "auto":
        ok = logits.is_cuda and logits.dtype in _TRITON_DTYPES and _triton_importable()
        return "triton" if ok else "torch"
    if impl != "triton":
        raise ValueError(f"impl must be one of ('auto', 'torch', 'triton'), got {impl!r}")
    if logits.dtype not in _TRITON_DTYPES:
        raise ValueError(f"impl='triton' computes in fp32 and takes fp32/bf16/fp16 inputs, got "
                         f"{logits.dtype}; use impl='auto' or 'torch'")
    if not _triton_importable():
        raise ValueError("impl='triton' needs the triton package (pip install triton); use "
                         "impl='auto' or 'torch'")
    if logits.device.type == "cpu":
        if not _interpreter_ready():
            raise ValueError("impl='triton' on CPU tensors runs only under Triton's interpreter: "
                             "set TRITON_INTERPRET=1 before triton is first imported (slow, for "
                             "tests); use impl='auto' or 'torch' on CPU")
    elif not logits.is_cuda:
        raise ValueError(f"impl='triton' runs on CUDA tensors, got device {logits.device}; use "
                         f"impl='auto' or 'torch'")
    return "triton"


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
    """Loss, log-sum-exp and (optionally) logit gradient of one chunk.

    Args:
        hidden: ``[C, H]`` chunk of hidden states, in the compute dtype.
        weight: ``[V_local, H]`` rows of the lm_head for this vocab slice (only real vocab rows,
            possibly 0 of them), same dtype as ``hidden``.
        bias: ``[V_local]`` or ``None``.
        labels: ``[C]`` int64 global vocab ids or ``opts.ignore_index``.
        coef: ``[C]`` gradient coefficient per token (the reduction's weight times the upstream
            gradient; must be 0 at ignored tokens), or ``None`` to skip the gradient.
        opts: see :class:`~megaloss.ops.options.CrossEntropyOptions` (``reduction`` and
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
    logits = torch.mm(hidden, weight.t()) if bias is None else torch.addmm(bias, hidden, weight.t())
    epilogue = torch_epilogue
    if epilogue_impl(opts.impl, logits) == "triton":
        from .triton_epilogue import triton_chunk_epilogue as epilogue  # imports triton
    return epilogue(logits, labels, coef, opts, vocab_size=vocab_size, vocab_start=vocab_start,
                    lse=lse, reduce_max=reduce_max, reduce_sum=reduce_sum)


def torch_epilogue(
    logits: torch.Tensor,
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
    """The eager epilogue: :func:`chunk_cross_entropy` after its GEMM, on ``logits
    [C, V_local]`` (the caller's own buffer: worked on in place when already in the stats dtype).
    Returns a :class:`ChunkResult` in the stats dtype."""
    sdt = stats_dtype(logits.dtype)
    n_local = logits.shape[1]
    logits, tanh = _softcap(logits.to(sdt), opts.logit_softcapping)  # no copy for fp32/fp64
    valid = labels != opts.ignore_index
    local_target = labels - vocab_start
    in_slice = valid & (local_target >= 0) & (local_target < n_local)
    gather_idx = local_target.clamp(0, max(n_local - 1, 0)).unsqueeze(1)

    if lse is None:
        row_max, stats, probs = _row_statistics(logits, in_slice, gather_idx, opts,
                                                reduce_max, reduce_sum)
        loss, lse = loss_from_stats(row_max, stats, labels, opts, vocab_size)
        probs_scale: Optional[torch.Tensor] = 1.0 / stats[0]  # exp(y - max) / sum_exp = softmax
    else:  # second pass (deferred gradient): the softmax straight from the saved lse
        lse = lse.to(sdt)
        loss = torch.zeros_like(lse)
        probs = logits.sub_(lse.unsqueeze(1)).exp_()
        probs_scale = None

    if coef is None:
        return ChunkResult(loss, lse, None)
    grad = _logit_gradient(probs, probs_scale, lse, coef.to(sdt), in_slice, gather_idx, tanh,
                           opts, vocab_size)
    return ChunkResult(loss, lse, grad)


def _softcap(logits: torch.Tensor, cap: Optional[float]
             ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Step 1: ``y = c * tanh(z / c)`` (Gemma 2), and ``tanh`` for the gradient's chain rule."""
    if cap is None:
        return logits, None
    tanh = torch.tanh(logits / cap)
    return tanh * cap, tanh


def _row_statistics(logits: torch.Tensor, in_slice: torch.Tensor, gather_idx: torch.Tensor,
                    opts: CrossEntropyOptions, reduce_max: Reduce, reduce_sum: Reduce
                    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 2: ``(row_max [C], stats [2|3, C], exp [C, V_local])``, combined across slices: the
    global max, then the stacked sums of :mod:`megaloss.ops.chunk_stats` (sum-exp relative to
    the global max, target logit, sum of logits). ``logits`` is overwritten by ``exp``."""
    n_rows, n_local = logits.shape
    if n_local > 0:  # a vocab-parallel rank may hold no real vocab rows
        row_max = logits.amax(dim=1)
        target_logit = logits.gather(1, gather_idx).squeeze(1) * in_slice
    else:
        row_max = logits.new_full((n_rows,), float("-inf"))
        target_logit = logits.new_zeros(n_rows)
    row_max = reduce_max(row_max)
    sum_logits = logits.sum(dim=1) if opts.label_smoothing > 0 else None
    exp = logits.sub_(row_max.unsqueeze(1)).exp_()
    stats = torch.stack([exp.sum(dim=1), target_logit]
                        + ([sum_logits] if sum_logits is not None else []))
    return row_max, reduce_sum(stats), exp


def _logit_gradient(probs: torch.Tensor, probs_scale: Optional[torch.Tensor], lse: torch.Tensor,
                    coef: torch.Tensor, in_slice: torch.Tensor, gather_idx: torch.Tensor,
                    tanh: Optional[torch.Tensor], opts: CrossEntropyOptions,
                    vocab_size: int) -> torch.Tensor:
    """Step 4: ``coef * (p (1 + 2 z lse) - (1 - eps)[j = target] - eps / V)``, times
    ``1 - tanh^2`` under soft-capping; in place over ``probs`` (``p = probs * probs_scale``)."""
    eps = opts.label_smoothing
    row_scale = coef * (1.0 + 2.0 * opts.z_loss * lse)
    if probs_scale is not None:
        row_scale = row_scale * probs_scale
    grad = probs.mul_(row_scale.unsqueeze(1))
    if grad.shape[1] > 0:
        grad.scatter_add_(1, gather_idx,
                          (-(1.0 - eps) * coef * in_slice).unsqueeze(1).to(grad.dtype))
    if eps > 0:
        grad.sub_((coef * (eps / vocab_size)).unsqueeze(1))
    if tanh is not None:
        grad.mul_(1.0 - tanh * tanh)
    return grad
