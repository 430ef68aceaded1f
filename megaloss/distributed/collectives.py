"""Autograd-aware collectives (the Megatron ``mappings.py`` set, plus an uneven all-gather).

Each function takes an explicit ``group``; ``None`` means "no group" (size 1) and every function
is then the identity, so single-process code paths need no special case. Callers that follow
torch.distributed's convention (``None`` = ``WORLD``) resolve that before calling.

============================  ==========================  ================================
function                      forward                     backward
============================  ==========================  ================================
``all_reduce_sum``            all-reduce SUM              all-reduce SUM
``copy_to_group``             identity                    all-reduce SUM
``reduce_from_group``         all-reduce SUM              identity
``gather_along_dim0``         all-gather (equal sizes)    reduce-scatter SUM (own slice)
``gather_along_dim0_uneven``  all-gather (any sizes)      reduce-scatter SUM (own slice)
============================  ==========================  ================================

Why backward is a SUM for the gathers: every rank's loss uses the gathered tensor, so the gradient
of the sum of all ranks' losses w.r.t. rank r's slice is the sum of every rank's gradient for that
slice. gloo rejects uneven all-gathers, so the uneven gather exchanges sizes, pads to the largest
and trims (padding never reaches the caller, so it needs no masking).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from .topology import group_size

__all__ = [
    "all_reduce_sum",
    "copy_to_group",
    "reduce_from_group",
    "gather_along_dim0",
    "gather_along_dim0_uneven",
    "all_gather_sizes",
    "all_gather_dim0",
    "all_reduce_max_",
    "all_reduce_sum_",
]


def _trivial(group: Optional[ProcessGroup]) -> bool:
    return group_size(group) == 1


# non-autograd helpers -------------------------------------------------------------------------
def all_reduce_sum_(tensor: torch.Tensor, group: Optional[ProcessGroup]) -> torch.Tensor:
    """In-place SUM all-reduce of a tensor the caller owns (no autograd); returns it."""
    if not _trivial(group):
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def all_reduce_max_(tensor: torch.Tensor, group: Optional[ProcessGroup]) -> torch.Tensor:
    """In-place MAX all-reduce of a tensor the caller owns (no autograd); returns it."""
    if not _trivial(group):
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor


def all_gather_sizes(n: int, group: Optional[ProcessGroup], device: torch.device) -> List[int]:
    """Every rank's ``n`` (e.g. its local batch size), in rank order. One small all-gather."""
    if _trivial(group):
        return [int(n)]
    return all_gather_dim0(torch.tensor([n], dtype=torch.long, device=device), group).tolist()


# torch 2.13 deprecates all_gather_into_tensor / reduce_scatter_tensor for the *_single names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_dim0(x: torch.Tensor, group: Optional[ProcessGroup]) -> torch.Tensor:
    """Concatenate every rank's ``x`` (same shape everywhere) along dim 0; no autograd."""
    if _trivial(group):
        return x
    world = dist.get_world_size(group)
    x = x.contiguous()
    out = torch.empty((world * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x, group=group)
    return out


def _reduce_scatter_dim0(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    world = dist.get_world_size(group)
    x = x.contiguous()
    out = torch.empty((x.shape[0] // world,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter_single(out, x, op=dist.ReduceOp.SUM, group=group)
    return out


# autograd Functions ---------------------------------------------------------------------------
class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _GatherDim0(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return all_gather_dim0(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _reduce_scatter_dim0(grad, ctx.group), None


class _GatherDim0Uneven(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup, sizes: Tuple[int, ...]) -> torch.Tensor:
        ctx.group, ctx.sizes = group, sizes
        ctx.rank = dist.get_rank(group)
        width = max(sizes)
        padded = x.new_zeros((width,) + tuple(x.shape[1:]))
        padded[: x.shape[0]] = x
        gathered = all_gather_dim0(padded, group)
        return torch.cat([gathered[r * width: r * width + n] for r, n in enumerate(sizes)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        sizes, width = ctx.sizes, max(ctx.sizes)
        padded = grad.new_zeros((width * len(sizes),) + tuple(grad.shape[1:]))
        offset = 0
        for r, n in enumerate(sizes):
            padded[r * width: r * width + n] = grad[offset: offset + n]
            offset += n
        out = _reduce_scatter_dim0(padded, ctx.group)
        return out[: sizes[ctx.rank]], None, None


# public API -----------------------------------------------------------------------------------
def all_reduce_sum(x: torch.Tensor, group: Optional[ProcessGroup]) -> torch.Tensor:
    """SUM all-reduce whose backward is also a SUM all-reduce.

    Used to make a loss value global on every rank: with the per-rank share ``l_r`` and
    ``L = sum_r l_r`` on every rank, each rank's backward gives ``world * dl_r``, which the
    engine's data-parallel *average* turns back into ``sum_r dl_r = dL`` (XTuner's calibration).
    """
    return x if _trivial(group) else _AllReduceSum.apply(x, group)


def copy_to_group(x: torch.Tensor, group: Optional[ProcessGroup]) -> torch.Tensor:
    """Identity forward, SUM all-reduce of the gradient backward (Megatron
    ``copy_to_tensor_model_parallel_region``): for an input replicated over ``group`` whose
    consumers each see a different shard of the weights."""
    return x if _trivial(group) else _CopyToGroup.apply(x, group)


def reduce_from_group(x: torch.Tensor, group: Optional[ProcessGroup]) -> torch.Tensor:
    """SUM all-reduce forward, identity backward (Megatron
    ``reduce_from_tensor_model_parallel_region``)."""
    return x if _trivial(group) else _ReduceFromGroup.apply(x, group)


def gather_along_dim0(x: torch.Tensor, group: Optional[ProcessGroup]) -> torch.Tensor:
    """Concatenate every rank's ``x`` along dim 0 (all ranks must pass the same shape); backward
    reduce-scatters the gradient (SUM). Megatron's sequence-parallel
    ``gather_from_sequence_parallel_region``."""
    return x if _trivial(group) else _GatherDim0.apply(x, group)


def gather_along_dim0_uneven(x: torch.Tensor, group: Optional[ProcessGroup],
                             sizes: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along dim 0 when ranks hold different sizes (0 included).

    Args:
        x: ``[n_r, ...]`` on rank r; trailing dims and dtype must agree across ranks.
        group: process group (``None``: identity).
        sizes: every rank's ``n_r`` if already known (saves one small all-gather).

    Returns:
        ``[sum_r n_r, ...]`` in rank order. Backward returns to each rank the SUM over ranks of the
        gradient of its own slice.
    """
    if _trivial(group):
        return x
    if sizes is None:
        sizes = all_gather_sizes(x.shape[0], group, x.device)
    return _GatherDim0Uneven.apply(x, group, tuple(int(s) for s in sizes))
