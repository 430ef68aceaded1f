r"""Cross-entropy of one chunk of tokens against one slice of the vocabulary, with its gradient.

For token ``t`` with logits ``z_t = W h_t + b`` over the vocabulary ``[0, V)``:

.. math::

    y_j &= c \tanh(z_j / c) \quad\text{(logit soft-capping, Gemma 2; } y = z \text{ without it)}\\
    \mathrm{lse} &= \log \textstyle\sum_{j<V} e^{y_j}\\
    \ell_t &= \mathrm{lse} - (1-\varepsilon)\, y_{\text{target}} - \tfrac{\varepsilon}{V}\textstyle\sum_{j<V} y_j
              + \lambda_z\, \mathrm{lse}^2

which is ``F.cross_entropy(y, target, label_smoothing=eps)`` (torch's smoothing: a mix of the
one-hot and the uniform distribution over all V classes) plus the PaLM z-loss
``z_loss * lse**2``. Its gradient w.r.t. the logits is

.. math::

    \partial \ell / \partial y_j = p_j (1 + 2\lambda_z \mathrm{lse}) - (1-\varepsilon)[j = \text{target}]
                                   - \varepsilon / V, \qquad p_j = e^{y_j - \mathrm{lse}}

times ``1 - tanh(z_j/c)^2`` under soft-capping. Ignored tokens have loss 0 and gradient 0.

When the vocabulary is split over tensor-parallel ranks (Megatron-core's vocab-parallel CE), this
function sees only its slice ``[vocab_start, vocab_start + V_local)``; the per-token max and the
per-token sums (sum-exp, target logit, sum of logits) are combined across the slices by the
``reduce_max`` / ``reduce_sum`` callables the caller passes — two collectives on ``[tokens]``-sized
tensors, never logits. Label smoothing divides by the *global* ``V`` (Megatron's local-size version
makes losses differ between TP ranks). Statistics are kept in fp32 (fp64 for fp64 inputs).

Two epilogues (everything after the chunk's GEMM) compute this, chosen by ``opts.impl`` (see
:func:`epilogue_impl`): eager torch ops on an fp32 copy of the logits (here; any device, the
reference), or two fused Triton kernels working in place on the logits buffer
(:mod:`megaloss.ops.triton_epilogue`; CUDA, or CPU under Triton's interpreter).
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Optional

import torch

from .options import CrossEntropyOptions

__all__ = ["ChunkResult", "chunk_cross_entropy", "epilogue_impl", "stats_dtype", "Reduce",
           "no_reduce"]

Reduce = Callable[[torch.Tensor], torch.Tensor]


def no_reduce(t: torch.Tensor) -> torch.Tensor:
    """The combiner of a vocabulary held whole on one device: nothing to combine."""
    return t


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half/bf16/fp32 inputs, fp64 for fp64 inputs."""
    return torch.promote_types(dtype, torch.float32)


class ChunkResult(NamedTuple):
    """``loss [C]`` (0 at ignored tokens) and ``lse [C]`` in the stats dtype, ``grad_logits
    [C, V_local]`` (already multiplied by the per-token ``coef``; ``None`` when not asked for):
    in the stats dtype from the torch epilogue, in the logits' (compute) dtype from the Triton
    one, which writes it over the logits."""

    loss: torch.Tensor
    lse: torch.Tensor
    grad_logits: Optional[torch.Tensor]


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
    if epilogue_impl(opts.impl, logits) == "triton":
        from .triton_epilogue import triton_chunk_epilogue  # imports triton: only when chosen
        return triton_chunk_epilogue(logits, labels, coef, opts, vocab_size=vocab_size,
                                     vocab_start=vocab_start, lse=lse, reduce_max=reduce_max,
                                     reduce_sum=reduce_sum)
    sdt = stats_dtype(hidden.dtype)
    n_local = weight.shape[0]
    logits = logits.to(sdt)  # no copy for fp32/fp64 inputs
    cap = opts.logit_softcapping
    tanh = None
    if cap is not None:
        tanh = torch.tanh(logits / cap)
        logits = tanh * cap

    valid = labels != opts.ignore_index
    local_target = labels - vocab_start
    in_slice = valid & (local_target >= 0) & (local_target < n_local)
    gather_idx = local_target.clamp(0, max(n_local - 1, 0)).unsqueeze(1)

    if lse is None:
        if n_local > 0:
            row_max = logits.amax(dim=1)
        else:
            row_max = logits.new_full((logits.shape[0],), float("-inf"))
        row_max = reduce_max(row_max)
        if n_local > 0:
            target_logit = logits.gather(1, gather_idx).squeeze(1) * in_slice
        else:
            target_logit = logits.new_zeros(logits.shape[0])
        sum_logits = logits.sum(dim=1) if opts.label_smoothing > 0 else None
        # In place from here: ``logits`` is our own buffer (matmul output or its fp32 copy).
        exp = logits.sub_(row_max.unsqueeze(1)).exp_()
        stats = torch.stack([exp.sum(dim=1), target_logit]
                            + ([sum_logits] if sum_logits is not None else []))
        stats = reduce_sum(stats)
        sum_exp, target_logit = stats[0], stats[1]
        lse = row_max + torch.log(sum_exp)
        loss = lse - (1.0 - opts.label_smoothing) * target_logit + opts.z_loss * lse * lse
        if sum_logits is not None:
            loss = loss - (opts.label_smoothing / vocab_size) * stats[2]
        loss = torch.where(valid, loss, torch.zeros_like(loss))
        # exp(y - max) / sum_exp = softmax
        probs_scale = 1.0 / sum_exp
        probs = exp
    else:
        lse = lse.to(sdt)
        loss = torch.zeros_like(lse)
        probs = logits.sub_(lse.unsqueeze(1)).exp_()
        probs_scale = None

    if coef is None:
        return ChunkResult(loss, lse, None)

    coef = coef.to(sdt)
    row_scale = coef * (1.0 + 2.0 * opts.z_loss * lse)
    if probs_scale is not None:
        row_scale = row_scale * probs_scale
    grad = probs.mul_(row_scale.unsqueeze(1))
    if n_local > 0:
        grad.scatter_add_(1, gather_idx,
                          (-(1.0 - opts.label_smoothing) * coef * in_slice).unsqueeze(1).to(sdt))
    if opts.label_smoothing > 0:
        grad.sub_((coef * (opts.label_smoothing / vocab_size)).unsqueeze(1))
    if tanh is not None:
        grad.mul_(1.0 - tanh * tanh)
    return ChunkResult(loss, lse, grad)
