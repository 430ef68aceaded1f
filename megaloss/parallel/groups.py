"""What ``group`` means in megaloss, written once.

Every public function and class that takes a process group follows torch.distributed:

- ``group=None`` is torch's **default process group** (``WORLD``) when torch.distributed is
  initialised, and a single process (nothing to communicate) when it is not;
- a ``ProcessGroup`` (from ``torch.distributed.new_group`` or a ``DeviceMesh``) is used as is;
- :data:`SINGLE_RANK` is "this rank alone": a dimension the layout does not parallelise (what a
  :class:`~megaloss.parallel.topology.Topology` holds for an absent ``dp``, ``sp`` or ``tp``).

A group of size 1 and :data:`SINGLE_RANK` are both *trivial*: collectives over them return
their input without communicating, so single-process code paths need no special case.
"""
from __future__ import annotations

from typing import List, Union

import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["SINGLE_RANK", "GroupLike", "resolve_group", "group_size", "group_rank",
           "group_ranks", "is_trivial"]


class _SingleRank:
    """Sentinel type of :data:`SINGLE_RANK`."""

    _instance = None

    def __new__(cls):  # one instance, so ``is SINGLE_RANK`` works after pickling too
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __reduce__(self):
        return (_SingleRank, ())

    def __repr__(self) -> str:
        return "SINGLE_RANK"


SINGLE_RANK = _SingleRank()
"""The group of this rank alone: size 1, rank 0, every collective the identity."""

GroupLike = Union[ProcessGroup, _SingleRank, None]


def resolve_group(group: GroupLike) -> Union[ProcessGroup, _SingleRank]:
    """``None`` -> the default group (or :data:`SINGLE_RANK` without torch.distributed); a
    ProcessGroup or :data:`SINGLE_RANK` unchanged.

    Raises:
        TypeError: anything else (a rank list, a DeviceMesh, a string), naming ``group``.
    """
    if group is None:
        return dist.group.WORLD if dist.is_available() and dist.is_initialized() else SINGLE_RANK
    if group is SINGLE_RANK or isinstance(group, ProcessGroup):
        return group
    raise TypeError(f"group must be a torch.distributed ProcessGroup, None (the default group) "
                    f"or megaloss.parallel.SINGLE_RANK, got {type(group).__name__}")


def group_size(group: GroupLike) -> int:
    """Number of ranks in ``group`` (see the module docstring for ``None``). Raises TypeError as
    :func:`resolve_group`."""
    group = resolve_group(group)
    return 1 if group is SINGLE_RANK else dist.get_world_size(group)


def group_rank(group: GroupLike) -> int:
    """This process's rank in ``group`` (0 for a trivial group). Raises TypeError as
    :func:`resolve_group`."""
    group = resolve_group(group)
    return 0 if group is SINGLE_RANK else dist.get_rank(group)


def group_ranks(group: GroupLike) -> List[int]:
    """Global ranks of ``group``'s members, in group-rank order (``[this rank]`` for
    :data:`SINGLE_RANK`). Raises TypeError as :func:`resolve_group`."""
    group = resolve_group(group)
    if group is SINGLE_RANK:
        return [dist.get_rank() if dist.is_available() and dist.is_initialized() else 0]
    return list(dist.get_process_group_ranks(group))


def is_trivial(group: GroupLike) -> bool:
    """True when ``group`` holds one rank: collectives over it are the identity. Raises TypeError
    as :func:`resolve_group`."""
    return group_size(group) == 1
