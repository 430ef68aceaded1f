"""Collectives without autograd, on tensors the caller owns (statistics, counts, metadata).

Torch's naming: a trailing underscore means *in place* (``all_reduce_sum_`` overwrites its
argument and returns it). ``group`` follows :mod:`megaloss.parallel.groups` (``None`` is the
default group); over a trivial group every function returns its input untouched. The autograd
counterparts (gradients flow back across ranks) are in :mod:`megaloss.parallel.mappings`.

:func:`raise_on_every_rank` and :func:`raise_first_error` agree on the outcome of rank-local
input checks, so that a rank whose inputs are bad does not raise alone and leave the others
waiting in the next collective: every rank raises the same error.
"""
from __future__ import annotations

from typing import List, NoReturn, Optional, Sequence

import torch
import torch.distributed as dist

from .groups import GroupLike, is_trivial, resolve_group

__all__ = ["all_reduce_sum_", "all_reduce_max_", "all_gather_dim0", "all_gather_sizes",
           "raise_on_every_rank", "raise_first_error"]


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


def raise_on_every_rank(error: Optional[Exception], *groups: GroupLike,
                        device: Optional[torch.device] = None) -> None:
    """Agree on the outcome of rank-local input checks before the first collective that depends
    on them: every rank of ``groups`` calls it with the error its checks raised (or ``None``).

    Per non-trivial group in turn, one all-gather of an int64 ``[1]`` failure flag (and one
    host sync); where a rank of it failed, one ``all_gather_object`` of the errors, so every
    rank of the group carries the same one on to the next group. Groups that together span the
    ranks (``dp_sp_group`` then ``tp_group`` of a :class:`~megaloss.parallel.Topology`: the
    first spreads a failure along DP, the second along TP) bring every one of them to raise the
    same error: the type (``TypeError``, else ``ValueError``) and message of the failed rank of
    lowest global rank, ``(raised on rank(s) [...])`` appended (the failed global ranks). So no
    rank is left waiting in a collective for one that raised (gloo's "Connection closed by
    peer" seconds later; a hang under NCCL).

    Args:
        error: this rank's ``ValueError`` / ``TypeError``, or ``None``.
        groups: see :mod:`megaloss.parallel.groups`; when every one is trivial ``error`` is
            raised as it is.
        device: where the flag lives: the backend's device (:func:`backend_device` when
            ``None``).

    Raises:
        ValueError / TypeError: see above.
    """
    live = [g for g in groups if not is_trivial(g)]
    if not live:
        if error is not None:
            raise error
        return
    info = None if error is None else (isinstance(error, TypeError), str(error), [dist.get_rank()])
    for group in live:
        flag = torch.tensor([info is not None], dtype=torch.long,
                            device=backend_device(group) if device is None else device)
        if not bool(all_gather_dim0(flag, group).any()):
            continue
        infos = [e for e in _all_gather_objects(info, group) if e is not None]
        first = min(infos, key=lambda e: min(e[2]))
        info = (first[0], first[1], sorted({r for e in infos for r in e[2]}))
    if info is not None:
        raise (TypeError if info[0] else ValueError)(
            f"{info[1]} (raised on rank(s) {info[2]})") from error


def raise_first_error(error: Optional[Exception], failed: Sequence[int], group: GroupLike = None,
                      *, ranks: str = "") -> NoReturn:
    """Raise on every rank of ``group`` the error of its first failed rank: a collective that
    every rank calls with the same ``failed`` (its ranks in ``group``, e.g. from a flags
    all-gather of the caller's) and its own ``error`` (``None`` on the ranks that passed).

    One ``all_gather_object`` of the errors (on the error path only). Every rank raises the
    first failed rank's exception type (``TypeError``, else ``ValueError``) with its message and
    ``(raised on <ranks> rank(s) [...])`` appended (the failed ranks in ``group``), chained to
    its own error where it has one. Over a trivial group ``error`` is raised as it is.

    Raises:
        ValueError / TypeError: always.
    """
    if is_trivial(group) and error is not None:
        raise error  # one rank: its own error as it is
    failed = [int(r) for r in failed]
    mine = None if error is None else (isinstance(error, TypeError), str(error))
    first = _all_gather_objects(mine, group)[failed[0]]
    is_type_error, message = (False, "invalid inputs") if first is None else first
    where = f"{ranks} rank(s)" if ranks else "rank(s)"
    whose = "" if len(failed) == 1 else f"; the message is rank {failed[0]}'s"
    raise (TypeError if is_type_error else ValueError)(
        f"{message} (raised on {where} {failed}{whose})") from error


def _all_gather_objects(obj, group: GroupLike) -> list:
    """Every rank's picklable ``obj`` in rank order (``all_gather_object``; error paths only)."""
    group = resolve_group(group)
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
