"""Collectives without autograd, on tensors the caller owns (statistics, counts, metadata).

Torch's naming: a trailing underscore means *in place* (``all_reduce_sum_`` overwrites its
argument and returns it). ``group`` follows :mod:`megaloss.parallel.groups` (``None`` is the
default group); over a trivial group every function returns its input untouched. The autograd
counterparts (gradients flow back across ranks) are in :mod:`megaloss.parallel.mappings`.
"""
from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist

from .groups import GroupLike, is_trivial, resolve_group

__all__ = ["all_reduce_sum_", "all_reduce_max_", "all_gather_dim0", "all_gather_sizes"]


def all_reduce_sum_(tensor: torch.Tensor, group: GroupLike = None) -> torch.Tensor:
    """In-place SUM all-reduce of ``tensor`` over ``group``; returns it.

    Args:
        tensor: any shape, any dtype the backend reduces (gloo: float, int); overwritten.
        group: see :mod:`megaloss.parallel.groups` (``None``: the default group).

    Raises:
        TypeError: ``group`` is not a group, None or SINGLE_RANK.
    """
    if not is_trivial(group):
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=resolve_group(group))
    return tensor


def all_reduce_max_(tensor: torch.Tensor, group: GroupLike = None) -> torch.Tensor:
    """In-place element-wise MAX all-reduce of ``tensor`` over ``group``; returns it (the same
    arguments and errors as :func:`all_reduce_sum_`)."""
    if not is_trivial(group):
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=resolve_group(group))
    return tensor


# torch 2.13 deprecates all_gather_into_tensor for the *_single name; older torch has only
# the former.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather_dim0(x: torch.Tensor, group: GroupLike = None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along dim 0, without autograd.

    Args:
        x: ``[n, ...]``, the same shape and dtype on every rank of ``group``.
        group: see :mod:`megaloss.parallel.groups`.

    Returns:
        ``[world * n, ...]`` in rank order (``x`` itself over a trivial group).

    Raises:
        TypeError: ``group`` is not a group, None or SINGLE_RANK.
    """
    if is_trivial(group):
        return x
    group = resolve_group(group)
    world = dist.get_world_size(group)
    x = x.contiguous()
    out = torch.empty((world * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x, group=group)
    return out


def backend_device(group: GroupLike = None) -> torch.device:
    """Where a small control tensor for ``group``'s collectives must live: the current CUDA
    device when the group's backend is NCCL, else the CPU (gloo; also a trivial group)."""
    if not is_trivial(group) and "nccl" in str(dist.get_backend(resolve_group(group))):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_CPU = torch.device("cpu")


def all_gather_sizes(n: int, group: GroupLike = None,
                     device: torch.device = _CPU) -> List[int]:
    """Every rank's integer ``n`` (e.g. its local batch size) in rank order: one all-gather of an
    int64 ``[1]`` tensor on ``device`` (the backend's device: CUDA for NCCL) and one host sync.

    Raises:
        TypeError: ``group`` is not a group, None or SINGLE_RANK.
    """
    if is_trivial(group):
        return [int(n)]
    return all_gather_dim0(torch.tensor([n], dtype=torch.long, device=device), group).tolist()
