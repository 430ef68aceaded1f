"""The one chunk loop and autograd Function under every vocabulary-level loss (cross-entropy,
log-probabilities, distillation): ``hidden @ weight.T (+ bias)`` a chunk of tokens at a time,
each chunk's logits handed to the loss's :class:`~megaloss.ops.chunk_kernel.ChunkKernel`, so that
no ``[tokens, vocab]`` tensor outlives one chunk.

Two schedules, chosen here once for every loss:

- **Gradient in forward** (XTuner v1's chunked CE, ``xtuner/v1/loss/ce_loss.py``; Liger-Kernel's
  ``ops/fused_linear_cross_entropy.py``): for a loss reduced to a scalar with per-token
  coefficients known before it is formed (``reduction="sum"``), the kernel forms each chunk's
  logit gradient in the forward pass, the head's gradients are accumulated then and saved, and
  backward only multiplies them, in place, by the scalar ``grad_output`` (which carries
  DeepSpeed's 1/GAS and the loss scale, so it is never assumed to be 1). 3 GEMMs per chunk.
- **Recompute in backward** (Cut Cross-Entropy's, Wijmans et al. 2024, arXiv:2411.09009): when
  the upstream gradient is per token and only known in backward (``reduction="none"``, the
  log-probabilities under a policy loss), forward keeps the kernel's ``saved`` per-token results
  (e.g. the log-sum-exp) and backward recomputes each chunk's logits. 4 GEMMs, no collective in
  backward.

fp16 always takes the second schedule. Under fp16 loss scaling (DeepSpeed's ``fp16`` section,
initial scale 2^16) the upstream gradient is the loss scale ``S``; eager autograd forms the logit
gradient as ``S * coef * (p - onehot)``, inside fp16's range, while a gradient formed in forward
is ``coef * (p - onehot)`` with ``coef ~ 1/N`` (or a calibration weight ~2^-20): it underflows
to fp16 zeros before ``S`` exists. Deferring forms it at eager's magnitude for one extra GEMM
(measured in ``tools/bench_ce.py``). bf16 has fp32's exponent range and keeps the first schedule.

The weight and bias gradients accumulate across chunks in ``accum_dtype`` (fp32 for bf16 inputs
by default: half-precision accumulation made training diverge in Liger-Kernel), see
:mod:`megaloss.ops.chunk_gradients`.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch._compile import _disable_dynamo
from torch.autograd.function import once_differentiable

from .chunk_gradients import HeadGradients
from .chunk_kernel import ChunkKernel, stats_dtype

__all__ = ["chunked_head", "head_logits", "auto_chunk_size", "REDUCTIONS", "MIN_AUTO_CHUNK"]

REDUCTIONS = ("sum", "none")
# Below this many tokens a chunk's GEMM and epilogue calls stop amortising their overhead.
# CPU, N 4096, H 1024, V 32000, fp32, 2 idle cores, fwd+bwd against chunk 1024, two rounds:
# CE 1.20-1.36x at 128, 1.08-1.23x at 256, 0.98-1.04x at 512; log-probs + entropy 1.32-1.43x,
# 1.14-1.15x, 1.02-1.03x; for fp32 logits buffers of 16 / 31 / 63 / 125 MiB.
MIN_AUTO_CHUNK = 512


def auto_chunk_size(n_tokens: int, vocab_rows: int, hidden_size: int) -> int:
    """The default tokens per chunk: the power of two whose fp32 logits ``[C, vocab_rows]``
    are about as large as the hidden states ``[n_tokens, hidden_size]``, so the chunk buffer
    never outgrows the loss's own input, and the number of chunks (and of per-chunk
    collectives under tensor parallelism) stays about ``vocab_rows / hidden_size`` whatever
    ``n_tokens``: ``next_power_of_2(ceil(n_tokens / ceil(vocab_rows / hidden_size)))``, as
    Liger-Kernel's fused linear cross-entropy (``ops/fused_linear_cross_entropy.py``) and
    DeepSpeed's ``vocab_parallel_linear_cross_entropy`` (``deepspeed/sequence/
    linear_cross_entropy.py``) choose theirs, but at least :data:`MIN_AUTO_CHUNK`.

    Args:
        n_tokens: ``N`` (>= 0); vocab_rows: this rank's vocabulary rows; hidden_size: ``H``.
    """
    per_token = max(1, -(-int(vocab_rows) // max(1, int(hidden_size))))
    want = max(1, -(-int(n_tokens) // per_token))
    return max(MIN_AUTO_CHUNK, 1 << (want - 1).bit_length())


def head_logits(h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``h @ weight.T (+ bias)``, one GEMM (``addmm`` with a bias), into ``out`` when given."""
    if bias is None:
        return torch.mm(h, weight.t(), out=out)
    return torch.addmm(bias, h, weight.t(), out=out)


class _LogitsBuffer:
    """One ``[min(chunk_size, N), V]`` logits buffer that every chunk of a pass writes its GEMM
    into. A fresh ``[C, V]`` tensor per chunk costs more than the epilogue: the allocator hands
    large blocks back to the OS, so each chunk's first touch of 131 MB (C=1024, V=32000, fp32)
    page-faults inside the GEMM (measured 11-17% of the CE's time on CPU, ``tools/bench_ce.py``).
    Reuse is safe because a kernel returns only per-token results (never a view of the logits)
    and each chunk's gradient GEMMs read the buffer before the next chunk's GEMM overwrites it
    (in order on the CPU, on one stream on CUDA)."""

    def __init__(self, n_tokens: int, chunk_size: int, weight: torch.Tensor):
        self.buf = weight.new_empty(min(chunk_size, n_tokens), weight.shape[0])

    def logits(self, h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]
               ) -> torch.Tensor:
        return head_logits(h, weight, bias, out=self.buf[:h.shape[0]])


class _Plan:
    """What the Function needs besides tensors (kept out of autograd's argument list)."""

    def __init__(self, kernel: ChunkKernel, reduction: str, chunk_size: int,
                 accum_dtype: torch.dtype):
        self.kernel, self.reduction = kernel, reduction
        self.chunk_size, self.accum_dtype = chunk_size, accum_dtype


def _chunks(n_tokens: int, chunk_size: int):
    for start in range(0, n_tokens, chunk_size):
        yield slice(start, min(start + chunk_size, n_tokens))


def _forward_chunks(plan: _Plan, hidden: torch.Tensor, weight: torch.Tensor,
                    bias: Optional[torch.Tensor], coef: Optional[torch.Tensor],
                    need: Tuple[bool, bool, bool]):
    """Every chunk through the kernel: ``(results, grads)`` — the ``n_outputs`` per-token
    results ``[N]`` and the :class:`HeadGradients` (filled only when ``coef`` is given)."""
    kernel = plan.kernel
    grads = HeadGradients(hidden, weight, bias, plan.accum_dtype,
                          need if coef is not None else (False, False, False))
    parts: List[Tuple[torch.Tensor, ...]] = []
    buffer = _LogitsBuffer(hidden.shape[0], plan.chunk_size, grads.weight)
    for rows in _chunks(hidden.shape[0], plan.chunk_size):
        h = hidden[rows].to(grads.dtype)
        results, grad = kernel.forward(buffer.logits(h, grads.weight, grads.bias), rows,
                                       None if coef is None else coef[rows])
        parts.append(results)
        if grad is not None:
            grads.add(rows.start, rows.stop, h, grad)
        # Drop this chunk's other [C, V] buffers (an upcast copy, the soft-cap's tanh) before
        # the next chunk allocates its own (measured +123 MiB at C=1024, V=32000).
        del grad
    if not parts:  # no tokens: empty results of the stats dtype
        empty = hidden.new_zeros(0, dtype=stats_dtype(grads.dtype))
        return tuple(empty.clone() for _ in range(kernel.n_outputs)), grads
    return tuple(torch.cat(col) for col in zip(*parts)), grads


def _backward_chunks(plan: _Plan, hidden, weight, bias, saved: Sequence[torch.Tensor],
                     upstream: Sequence[Optional[torch.Tensor]], need):
    grads = HeadGradients(hidden, weight, bias, plan.accum_dtype, need)
    buffer = _LogitsBuffer(hidden.shape[0], plan.chunk_size, grads.weight)
    for rows in _chunks(hidden.shape[0], plan.chunk_size):
        h = hidden[rows].to(grads.dtype)
        grad = plan.kernel.backward(buffer.logits(h, grads.weight, grads.bias), rows,
                                    [s[rows] for s in saved],
                                    [None if u is None else u[rows] for u in upstream])
        grads.add(rows.start, rows.stop, h, grad)
        del grad
    return grads


def _gradient_in_forward(plan: _Plan, hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the head's gradients form in forward: a scalar loss (``reduction="sum"``) outside
    fp16, whose range cannot hold a gradient formed before the loss scale exists (module doc)."""
    return (plan.reduction == "sum"
            and torch.promote_types(hidden.dtype, weight.dtype) != torch.float16)


def _cast_like(grads: HeadGradients, weight, bias):
    d_w, d_b = grads.d_weight, grads.d_bias
    return (grads.d_hidden, None if d_w is None else d_w.to(weight.dtype),
            None if d_b is None else d_b.to(bias.dtype))


def _scaled_early_gradients(ctx, scale: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
    """The gradients formed in forward times the scalar ``grad_output``. The first backward
    scales the saved buffers in place, as Liger-Kernel's fused linear CE does: an out-of-place
    product would hold a second weight-sized tensor at the backward peak (N 4096, H 1024,
    V 32000, fp32, chunk 256: 282 -> 172 MiB above inputs, weight and grads), and once
    autograd frees the saved buffer it hands it to ``.grad`` without a copy. The product goes
    through ``.data``, so the saved tensors' version stays the one saved: a later backward
    through a retained graph (``retain_graph=True``, gradcheck) gets ``saved * (scale /
    first scale)``, out of place, and an in-place change made by anyone else in between (e.g.
    to a gradient ``torch.autograd.grad`` returned) still fails torch's version check."""
    saved = ctx.saved_tensors
    first = getattr(ctx, "first_scale", None)
    if first is None:
        ctx.first_scale = scale.detach().clone()
        for d in saved:
            if d is not None:
                d.data.mul_(scale.to(d.dtype))
        return tuple(saved)
    if not bool(torch.isfinite(first).all() and (first != 0).all()):
        raise RuntimeError(
            "a second backward through a retained graph of a chunked loss whose gradients "
            f"were formed in forward needs a finite, non-zero first grad_output (got {first}): "
            "the first backward scaled them in place; recompute the loss instead")
    ratio = scale / first
    return tuple(None if d is None else d * ratio.to(d.dtype) for d in saved)


class _ChunkedHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, coef, plan: _Plan):
        kernel = plan.kernel
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                bias is not None and ctx.needs_input_grad[2])
        ctx.plan, ctx.need = plan, need
        ctx.early = _gradient_in_forward(plan, hidden, weight)
        results, grads = _forward_chunks(plan, hidden, weight, bias,
                                         coef if ctx.early and any(need) else None, need)
        if ctx.early:
            ctx.save_for_backward(*_cast_like(grads, weight, bias))
        else:
            ctx.save_for_backward(hidden, weight, bias, coef,
                                  *(results[i] for i in kernel.saved))
        first = results[0] if coef is None else results[0] * coef.to(results[0].dtype)
        if plan.reduction == "sum":
            first = first.sum()
        rest = results[kernel.n_differentiable:]
        ctx.mark_non_differentiable(*rest)
        ctx.set_materialize_grads(False)  # an unused output costs no gradient work
        return (first, *results[1:kernel.n_differentiable], *rest)

    @staticmethod
    @once_differentiable  # the chunk loop writes into buffers (out=): no double backward
    def backward(ctx, *grad_outputs):
        plan, need = ctx.plan, ctx.need
        none = (None,) * 5
        upstream = list(grad_outputs[:plan.kernel.n_differentiable])
        if all(u is None for u in upstream):
            return none
        if ctx.early:
            return _scaled_early_gradients(ctx, upstream[0]) + (None, None)
        hidden, weight, bias, coef, *saved = ctx.saved_tensors
        sdt = stats_dtype(torch.promote_types(hidden.dtype, weight.dtype))
        upstream = [None if u is None else u.to(sdt) for u in upstream]
        if upstream[0] is not None and coef is not None:
            # The upstream gradient (per token, or a scalar carrying 1/GAS and the fp16 loss
            # scale) enters the logit gradient in the stats dtype, before any cast: formed at
            # the magnitude eager autograd forms it.
            upstream[0] = upstream[0] * coef.to(sdt)
        if upstream[0] is not None and upstream[0].dim() == 0:
            upstream[0] = upstream[0].expand(hidden.shape[0])
        grads = _backward_chunks(plan, hidden, weight, bias, saved, upstream, need)
        return (*_cast_like(grads, weight, bias), None, None)


def chunked_head(kernel: ChunkKernel, hidden: torch.Tensor, weight: torch.Tensor,
                 bias: Optional[torch.Tensor], *, coef: Optional[torch.Tensor] = None,
                 reduction: str = "none", chunk_size: Optional[int] = None,
                 accum_dtype: torch.dtype = torch.float32) -> Tuple[torch.Tensor, ...]:
    """Run ``kernel`` over ``hidden @ weight.T (+ bias)`` chunk by chunk, with autograd.

    Args:
        kernel: the loss's :class:`~megaloss.ops.chunk_kernel.ChunkKernel` (it holds the
            token-indexed inputs for these ``N`` tokens and its vocabulary slice).
        hidden: ``[N, H]`` float.
        weight: ``[V_local, H]``, the real vocab rows of this slice (padding sliced off).
        bias: ``[V_local]`` or ``None``.
        coef: ``[N]`` per-token coefficients of the first result (e.g. the reduction's weights;
            no gradient), or ``None``.
        reduction: ``"sum"``: the first output is ``sum(coef * result_0)`` (scalar; gradients
            formed in forward outside fp16; ``coef`` required); ``"none"``: per token,
            ``coef * result_0`` (or ``result_0``), gradients recomputed in backward.
        chunk_size: tokens per chunk; ``None``: :func:`auto_chunk_size`.
        accum_dtype: the weight / bias gradient accumulation dtype.

    Returns:
        The kernel's ``n_outputs`` results: the first ``n_differentiable`` with gradients into
        ``hidden``, ``weight`` and ``bias`` (the first reduced as above), the rest without.
        Stats dtype (fp32, fp64 for fp64 inputs).

    Raises:
        ValueError: ``reduction`` not one of ``REDUCTIONS``, or ``"sum"`` without ``coef``.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if reduction == "sum" and coef is None:
        raise ValueError("reduction='sum' needs the per-token coef")
    if chunk_size is None:
        chunk_size = auto_chunk_size(hidden.shape[0], weight.shape[0], hidden.shape[-1])
    plan = _Plan(kernel, reduction, chunk_size, accum_dtype)
    if torch.compiler.is_compiling() and not _gradient_in_forward(plan, hidden, weight):
        return _eager_apply(hidden, weight, bias, coef, plan)
    return _ChunkedHead.apply(hidden, weight, bias, coef, plan)


def _eager_apply(hidden, weight, bias, coef, plan: _Plan) -> Tuple[torch.Tensor, ...]:
    """:class:`_ChunkedHead` on the recompute schedule, run eagerly under ``torch.compile`` (a
    graph break). Traced, AOTAutograd's joint graph would share each chunk's forward logits
    with the backward's recomputation of them (its common-subexpression elimination, after
    Inductor's no-op removal) and save every chunk's ``[C, V]`` logits for backward: the full
    ``[N, V]`` logits the chunking exists to avoid (measured: memory growing with ``N``, 44.9
    against eager's 10.6 MiB at N 1024, V 8000, chunk 64). Wrapped by torch's own lazy
    ``torch.compiler.disable`` (``torch._compile._disable_dynamo``, which Dynamo sees as a call
    into torch it does not trace), so ``import megaloss`` does not import Dynamo."""
    return _ChunkedHead.apply(hidden, weight, bias, coef, plan)


_eager_apply = _disable_dynamo(_eager_apply)

