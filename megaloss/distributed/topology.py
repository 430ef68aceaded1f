"""Which process groups a loss reduces over: data (dp), sequence (sp) and tensor (tp) parallel.

A :class:`Topology` names the groups once so that no loss hard-wires ``WORLD``: under DeepSpeed
with tensor parallelism the data-parallel group is not the world. Inside a Topology a group of
``None`` means "size 1, nothing to communicate", so single-process code needs no special case.

Token-count all-reduces for loss calibration run over ``dp x sp`` (the ranks that hold *different*
tokens); TP ranks hold replicas of the same tokens and must not be counted twice.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["Topology", "group_size", "group_rank"]

_MESH_DIMS = ("dp", "sp", "tp")


def group_size(group: Optional[ProcessGroup]) -> int:
    """World size of ``group``; 1 for ``None`` (a Topology's "no group")."""
    if group is None or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: Optional[ProcessGroup]) -> int:
    """This process's rank in ``group``; 0 for ``None``."""
    if group is None or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


@dataclass(frozen=True)
class Topology:
    """Process groups of one rank in a dp x sp x tp layout.

    Args:
        dp_group: data-parallel group (ranks holding different samples, same model shard).
        sp_group: sequence-parallel group (ranks holding different pieces of the same samples).
        tp_group: tensor-parallel group (ranks holding the same tokens, different weight shards).
        dp_sp_group: the flattened ``dp x sp`` group: every rank holding different tokens.
            Defaults to ``dp_group`` when ``sp`` has size 1.

    ``None`` means a group of size 1. Build one with :meth:`from_device_mesh`, :meth:`from_mpu`
    or :meth:`default`.
    """

    dp_group: Optional[ProcessGroup] = None
    sp_group: Optional[ProcessGroup] = None
    tp_group: Optional[ProcessGroup] = None
    dp_sp_group: Optional[ProcessGroup] = None

    def __post_init__(self) -> None:
        if self.dp_sp_group is not None:
            return
        if group_size(self.sp_group) == 1:
            object.__setattr__(self, "dp_sp_group", self.dp_group)
        elif group_size(self.dp_group) == 1:
            object.__setattr__(self, "dp_sp_group", self.sp_group)
        else:
            raise ValueError("dp_sp_group is required when both dp and sp have size > 1")

    # sizes and ranks ---------------------------------------------------------------------------
    @property
    def dp_size(self) -> int:
        return group_size(self.dp_group)

    @property
    def sp_size(self) -> int:
        return group_size(self.sp_group)

    @property
    def tp_size(self) -> int:
        return group_size(self.tp_group)

    @property
    def dp_rank(self) -> int:
        return group_rank(self.dp_group)

    @property
    def sp_rank(self) -> int:
        return group_rank(self.sp_group)

    @property
    def tp_rank(self) -> int:
        return group_rank(self.tp_group)

    @property
    def dp_sp_size(self) -> int:
        return group_size(self.dp_sp_group)

    # constructors ------------------------------------------------------------------------------
    @classmethod
    def default(cls) -> "Topology":
        """Everything is data parallel (``WORLD``); a single process when torch.distributed is
        not initialised."""
        if not dist.is_initialized():
            return cls()
        world = dist.group.WORLD
        return cls(dp_group=world, dp_sp_group=world)

    @classmethod
    def from_device_mesh(cls, mesh: Any) -> "Topology":
        """From a :class:`torch.distributed.device_mesh.DeviceMesh` whose dims are named among
        ``"dp"``, ``"sp"``, ``"tp"`` (missing dims have size 1).

        Raises:
            ValueError: a mesh dim has another name, or the mesh has no dim names.
        """
        names = mesh.mesh_dim_names
        if not names:
            raise ValueError("mesh must have mesh_dim_names among ('dp', 'sp', 'tp')")
        unknown = [n for n in names if n not in _MESH_DIMS]
        if unknown:
            raise ValueError(f"mesh dim names must be among {_MESH_DIMS}, got {tuple(names)}")
        groups = {n: mesh[n].get_group() for n in names}
        dp_sp = None
        if "dp" in names and "sp" in names:
            # _flatten is the DeviceMesh way to get the group of a product of dims (torchtitan uses it).
            dp_sp = mesh["dp", "sp"]._flatten("dp_sp").get_group()
        return cls(dp_group=groups.get("dp"), sp_group=groups.get("sp"),
                   tp_group=groups.get("tp"), dp_sp_group=dp_sp)

    @classmethod
    def from_mpu(cls, mpu: Any) -> "Topology":
        """From a Megatron / DeepSpeed style ``mpu`` object (``get_data_parallel_group``,
        ``get_tensor_model_parallel_group`` or ``get_model_parallel_group``, optionally
        ``get_sequence_parallel_group`` and ``get_sequence_data_parallel_group``).

        Raises:
            TypeError: ``mpu`` has no ``get_data_parallel_group``.
        """
        if not hasattr(mpu, "get_data_parallel_group"):
            raise TypeError(f"mpu must provide get_data_parallel_group(), got {type(mpu).__name__}")
        dp = mpu.get_data_parallel_group()
        if hasattr(mpu, "get_tensor_model_parallel_group"):
            tp = mpu.get_tensor_model_parallel_group()
        elif hasattr(mpu, "get_model_parallel_group"):
            tp = mpu.get_model_parallel_group()
        else:
            tp = None
        sp = mpu.get_sequence_parallel_group() if hasattr(mpu, "get_sequence_parallel_group") else None
        dp_sp = (mpu.get_sequence_data_parallel_group()
                 if hasattr(mpu, "get_sequence_data_parallel_group") else None)
        return cls(dp_group=dp, sp_group=sp, tp_group=tp, dp_sp_group=dp_sp)

    def __repr__(self) -> str:
        return (f"Topology(dp={self.dp_size}, sp={self.sp_size}, tp={self.tp_size}, "
                f"dp_sp={self.dp_sp_size})")
