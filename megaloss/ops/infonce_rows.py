r"""Chunked InfoNCE rows, gradients computed in the forward pass (single device, no collectives).

For rows ``a [R, D]``, columns ``b [C, D]``, targets ``t [R]`` and temperature ``T``, with column
``j`` masked out of row ``i``'s softmax when ``row_ids[i] == col_ids[j]`` and ``j != t_i`` (only
the first ``len(col_ids)`` columns carry ids; duplicates are false negatives)::

    z_ij = (a_i . b_j) / T        (masked: -inf)
    loss = sum_i  logsumexp_j z_ij - z_{i, t_i}

and with ``p = softmax(z)``, ``G = p - onehot(t)`` (zero on masked columns), the gradients
(the usual softmax cross-entropy algebra, e.g. Liger's fused linear CE)::

    dloss/da = G b / T,   dloss/db = G^T a / T,
    dloss/dT = -(1/T) sum_ij G_ij z_ij = -(1/T) sum_i (sum_j p_ij log p_ij + lse_i - z_it)

Rows are processed ``chunk_size`` at a time, so beyond the inputs and their gradients only one
``[chunk, C]`` block (one more for a learnable ``T``) is alive,
instead of the several full ``[R, C]`` matrices autograd keeps for ``logsumexp`` / ``gather`` /
``matmul`` (the same trick as XTuner's and Liger's chunked linear cross-entropy). Backward only
multiplies the saved gradients by ``grad_output``, so DeepSpeed's 1/GAS and fp16 loss scaling are
honoured. Double backward is not supported. Scores and gradients accumulate in
``promote_types(dtype, float32)``, also under ``torch.autocast`` (disabled inside); gradients are
cast back to the input dtype.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

__all__ = ["infonce_rows"]


class _InfoNCERows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, temperature, targets, row_ids, col_ids, chunk_size, want_grad,
                want_ranks):
        # Under torch.autocast the block products would come out in the autocast dtype (and
        # the float32 gradient buffers refuse them): the forward computes in ``acc`` itself.
        with torch.autocast(a.device.type, enabled=False):
            return _InfoNCERows._forward(ctx, a, b, temperature, targets, row_ids, col_ids,
                                         chunk_size, want_grad, want_ranks)

    @staticmethod
    def _forward(ctx, a, b, temperature, targets, row_ids, col_ids, chunk_size, want_grad,
                 want_ranks):
        acc = torch.promote_types(a.dtype, torch.float32)
        t = temperature.to(acc) if isinstance(temperature, torch.Tensor) else temperature
        rows = a.shape[0]
        total = torch.zeros((), dtype=acc, device=a.device)
        above = torch.zeros(rows, dtype=torch.long, device=a.device)
        da = torch.zeros(a.shape, dtype=acc, device=a.device) if want_grad[0] else None
        db = torch.zeros(b.shape, dtype=acc, device=a.device) if want_grad[1] else None
        dt = torch.zeros((), dtype=acc, device=a.device) if want_grad[2] else None
        b_acc = b.to(acc)
        for lo in range(0, rows, chunk_size):
            hi = min(lo + chunk_size, rows)
            a_c = a[lo:hi].to(acc)
            z = (a_c @ b_acc.T).div_(t)                            # [c, C], the one big buffer
            if row_ids is not None:  # the mask of this block only: [c, len(col_ids)] bools
                n = col_ids.shape[0]
                same = row_ids[lo:hi, None] == col_ids[None, :]
                same &= torch.arange(n, device=a.device)[None, :] != targets[lo:hi, None]
                z[:, :n].masked_fill_(same, float("-inf"))
            tgt = z.gather(1, targets[lo:hi, None])
            if want_ranks:
                above[lo:hi] = (z > tgt).sum(1)
            # logsumexp by hand, in place, so no second [c, C] buffer: z <- exp(z - max)
            zmax = z.amax(dim=1, keepdim=True)
            z.sub_(zmax).exp_()
            sumexp = z.sum(dim=1, keepdim=True)
            lse = zmax + sumexp.log()
            total = total + (lse - tgt).sum()
            if da is None and db is None and dt is None:
                continue
            g = z.div_(sumexp)                                     # softmax p, in place
            if dt is not None:
                # sum_j p_ij z_ij = sum_j p log p + lse_i (masked p = 0): no -inf * 0 and no copy
                # of z kept; dloss/dT = -(1/T) sum_i (sum_j p_ij z_ij - z_it)
                dt -= (torch.special.xlogy(g, g).sum() + (lse - tgt).sum()) / t
            g.scatter_add_(1, targets[lo:hi, None], g.new_full((hi - lo, 1), -1.0))  # G = p - 1_t
            if da is not None:
                torch.matmul(g, b_acc, out=da[lo:hi])
                da[lo:hi].div_(t)
            if db is not None:
                db.addmm_(g.T, a_c / t)
        ctx.save_for_backward(*(x for x in (da, db, dt) if x is not None))
        ctx.has = tuple(x is not None for x in (da, db, dt))
        ctx.dtypes = (a.dtype, b.dtype, temperature.dtype if isinstance(temperature, torch.Tensor)
                      else None)
        ctx.mark_non_differentiable(above)
        return total, above

    @staticmethod
    def backward(ctx, grad_total, _grad_above):
        saved = iter(ctx.saved_tensors)
        grads = [next(saved) if h else None for h in ctx.has]
        out = [None if g is None else (g * grad_total).to(dt) for g, dt in zip(grads, ctx.dtypes)]
        return out[0], out[1], out[2], None, None, None, None, None, None


def infonce_rows(a: torch.Tensor, b: torch.Tensor, temperature: Union[float, torch.Tensor],
                 targets: torch.Tensor, *, row_ids: Optional[torch.Tensor] = None,
                 col_ids: Optional[torch.Tensor] = None, chunk_size: int = 1024,
                 ranks: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sum over rows of the InfoNCE loss of ``a [R, D]`` against ``b [C, D]`` (module docstring).

    Args:
        a: ``[R, D]`` float rows (queries); ``b``: ``[C, D]`` columns (documents), same dtype.
        temperature: ``T > 0``, float or 0-dim tensor (it gets a gradient if it requires one).
        targets: ``[R]`` long, the column of each row's positive.
        row_ids, col_ids: ``[R]`` and ``[N <= C]`` integer ids (both or neither): column ``j < N``
            leaves row ``i``'s softmax when the ids match and ``j`` is not the row's target.
        chunk_size: rows per block (memory ``chunk_size x C``).
        ranks: also count, per row, the unmasked columns scoring strictly above the target.

    Returns:
        ``(loss_sum, above)``: 0-dim ``promote_types(dtype, float32)`` sum of row losses (with
        gradient), and ``[R]`` long counts (zeros unless ``ranks``; no gradient).
    """
    t_grad = isinstance(temperature, torch.Tensor) and temperature.requires_grad
    grad_on = torch.is_grad_enabled()
    want = (grad_on and a.requires_grad, grad_on and b.requires_grad, grad_on and t_grad)
    t = temperature.reshape(()) if isinstance(temperature, torch.Tensor) else temperature
    if (row_ids is None) != (col_ids is None):
        raise ValueError("row_ids and col_ids must be given together")
    if int(chunk_size) < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return _InfoNCERows.apply(a, b, t, targets, row_ids, col_ids, int(chunk_size), want,
                              bool(ranks))
