"""Autograd-aware communication "regions" (Megatron-core's ``tensor_parallel/mappings.py``).

=========================  ===========================  ==========================================
function                   forward                      backward
=========================  ===========================  ==========================================
``copy_to_region``         identity                     all-reduce SUM
``reduce_from_region``     all-reduce SUM               identity
``all_reduce_sum_autograd``  all-reduce SUM             all-reduce SUM (the two regions composed)
``gather_from_region``     all-gather along dim 0,      reduce-scatter SUM: each rank gets the sum
                           any per-rank sizes (0 too)   over ranks of its own slice's gradient
=========================  ===========================  ==========================================

Why these backwards. ``copy_to_region`` marks an input replicated over the group whose consumers
see different weight shards (Megatron's ``copy_to_tensor_model_parallel_region``): its gradient
is the sum of every rank's part. A gathered tensor feeds every rank's loss, so the gradient of
the sum of all ranks' losses w.r.t. rank r's slice is the sum of every rank's gradient for it.
``all_reduce_sum_autograd`` makes a per-rank share ``l_r`` into the global ``L = sum_r l_r`` on
every rank; each rank's backward then carries ``world x dl_r``, which a data-parallel engine's
*average* turns back into ``dL`` (XTuner v1's loss calibration,
``xtuner/v1/loss/base_loss_ctx.py``).

The gather runs on torch's functional collectives (``torch.distributed._functional_collectives``:
``all_gather_single_autograd``, whose backward is a reduce-scatter SUM). Those need equal sizes on
every rank (gloo rejects uneven ones), so every rank pads to the largest count and the real rows
are kept with one ``index_select`` (the padding gets a zero gradient and never reaches the
caller). ``group`` follows :mod:`megaloss.parallel.groups`: ``None`` is the default group; over a
trivial group every function is the identity.
"""
from __future__ import annotations

import warnings
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .comm import all_gather_sizes
from .groups import GroupLike, is_trivial, resolve_group

__all__ = ["copy_to_region", "reduce_from_region", "all_reduce_sum_autograd",
           "gather_from_region"]


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        out = x.contiguous().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_region(x: torch.Tensor, group: GroupLike = None) -> torch.Tensor:
    """Identity forward; SUM all-reduce of the gradient in backward (Megatron-core's
    ``copy_to_tensor_model_parallel_region``).

    Args:
        x: any shape and floating dtype, replicated over ``group``.
        group: see :mod:`megaloss.parallel.groups`.

    Raises:
        TypeError: ``group`` is not a group, None or SINGLE_RANK.
    """
    return x if is_trivial(group) else _CopyToRegion.apply(x, resolve_group(group))


def reduce_from_region(x: torch.Tensor, group: GroupLike = None) -> torch.Tensor:
    """SUM all-reduce forward; identity backward (Megatron-core's
    ``reduce_from_tensor_model_parallel_region``). Same arguments and errors as
    :func:`copy_to_region`; returns a new tensor (the input is not modified)."""
    return x if is_trivial(group) else _ReduceFromRegion.apply(x, resolve_group(group))


def all_reduce_sum_autograd(x: torch.Tensor, group: GroupLike = None) -> torch.Tensor:
    """SUM all-reduce forward and backward (see the module docstring for why): a per-rank share
    becomes the global value on every rank. Same arguments and errors as
    :func:`copy_to_region`."""
    return reduce_from_region(copy_to_region(x, group), group)


def _functional_all_gather():
    import torch.distributed._functional_collectives as fc

    fn = getattr(fc, "all_gather_single_autograd", None) or getattr(
        fc, "all_gather_tensor_autograd", None)
    if fn is None:
        raise RuntimeError("gather_from_region needs torch >= 2.6 (functional collectives with "
                           f"autograd); this is torch {torch.__version__}")

    def gather(x: torch.Tensor, group) -> torch.Tensor:
        with warnings.catch_warnings():
            # the older spelling warns on every call; it is only used where the newer is missing
            warnings.simplefilter("ignore", FutureWarning)
            out = fn(x, 0, group)
        return fc.wait_tensor(out)

    return gather


def gather_from_region(x: torch.Tensor, group: GroupLike = None,
                       sizes: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along dim 0, gradients flowing back to their owners.

    Args:
        x: ``[n_r, ...]`` on rank r; trailing dims and dtype must agree across ranks; ``n_r``
            may differ, 0 included.
        group: see :mod:`megaloss.parallel.groups`.
        sizes: every rank's ``n_r`` in rank order, if known (saves one small all-gather).

    Returns:
        ``[sum_r n_r, ...]`` in rank order (``x`` itself over a trivial group or when every rank
        has 0 rows).

    Raises:
        TypeError: ``group`` is not a group, None or SINGLE_RANK.
        RuntimeError: torch older than 2.6 (no autograd functional all-gather).
    """
    if is_trivial(group):
        return x
    group = resolve_group(group)
    if sizes is None:
        sizes = all_gather_sizes(x.shape[0], group, x.device)
    sizes = [int(s) for s in sizes]
    width = max(sizes)
    if width == 0:  # nothing anywhere: every rank returns here, none waits in a collective
        return x
    pad = width - x.shape[0]
    if pad:
        x = torch.cat([x, x.new_zeros((pad,) + tuple(x.shape[1:]))])
    gathered = _functional_all_gather()(x.contiguous(), group)
    if all(n == width for n in sizes):
        return gathered
    keep = torch.cat([torch.arange(r * width, r * width + n, device=x.device)
                      for r, n in enumerate(sizes)])
    return gathered.index_select(0, keep)
