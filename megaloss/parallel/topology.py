"""The one object that names a rank's process groups in a ``dp x sp x tp`` layout.

Who holds what (the terms of DeepSpeed and XTuner; torchtitan's ``ParallelDims`` plays this role):

- ``dp`` (data parallel): ranks holding different samples and the same model shard;
- ``sp`` (sequence parallel in the DeepSpeed-Ulysses / XTuner sense): ranks holding different
  pieces of the same samples;
- ``tp`` (tensor parallel): ranks holding the same tokens and different weight shards;
- ``pp`` (pipeline parallel, optional): ranks holding different stages (layers) of one model
  replica, the same samples; set by :mod:`megaloss.integrations.deepspeed.pipeline`;
- ``dp_sp``: the flattened ``dp x sp`` group, every rank holding different tokens. Token counts
  for loss calibration are all-reduced over it; TP replicas are not in it, so nothing is counted
  twice.

A dimension the layout does not use holds :data:`~megaloss.parallel.groups.SINGLE_RANK`. Build
a Topology with :meth:`Topology.from_device_mesh` (or :meth:`Topology.build`, which makes the
``("dp", "tp")`` DeviceMesh), :meth:`Topology.from_mpu` (a Megatron / DeepSpeed ``mpu``),
:meth:`Topology.from_megatron` (Megatron-core's or apex's initialised ``parallel_state``) or
:meth:`Topology.default` (everything data parallel over the default group).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from .groups import SINGLE_RANK, GroupLike, group_rank, group_size, resolve_group

__all__ = ["Topology", "init_parallel_mesh", "init_dp_tp_mesh"]

_MESH_DIMS = ("dp", "sp", "tp")


def init_parallel_mesh(tensor_parallel_size: int = 1, sequence_parallel_size: int = 1, *,
                       device_type: Optional[str] = None) -> Any:
    """A :class:`~torch.distributed.device_mesh.DeviceMesh` with dims ``("dp", "sp", "tp")``
    (``"sp"`` left out when it has size 1).

    Tensor parallelism is the innermost dim (ranks ``0..tp-1`` form the first TP group,
    Megatron-core's convention), so TP collectives stay on neighbouring ranks; sequence
    parallelism is next (with ``tp = 1`` the SP groups are runs of consecutive ranks, the groups
    DeepSpeed's Ulysses builds in ``runtime/sequence_parallel/parallel_state_sp.py``). Collective:
    every rank of the default group calls it. ``dp = world // (sp * tp)``.

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: a size < 1, or ``sp * tp`` does not divide the world size.
    """
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise RuntimeError("init_parallel_mesh needs torch.distributed to be initialised")
    for name, size in (("tensor_parallel_size", tensor_parallel_size),
                       ("sequence_parallel_size", sequence_parallel_size)):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{name} must be an int >= 1, got {size!r}")
    world = dist.get_world_size()
    model = tensor_parallel_size * sequence_parallel_size
    if world % model:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} x sequence_parallel_size="
                         f"{sequence_parallel_size} does not divide the world size {world}")
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if sequence_parallel_size == 1:
        return init_device_mesh(device_type, (world // tensor_parallel_size, tensor_parallel_size),
                                mesh_dim_names=("dp", "tp"))
    return init_device_mesh(device_type, (world // model, sequence_parallel_size,
                                          tensor_parallel_size), mesh_dim_names=("dp", "sp", "tp"))


def init_dp_tp_mesh(tensor_parallel_size: int, *, device_type: Optional[str] = None) -> Any:
    """:func:`init_parallel_mesh` without sequence parallelism: dims ``("dp", "tp")``.

    Raises:
        RuntimeError / ValueError: as :func:`init_parallel_mesh`.
    """
    return init_parallel_mesh(tensor_parallel_size, device_type=device_type)


@dataclass(frozen=True)
class Topology:
    """Process groups of one rank in a ``dp x sp x tp`` layout.

    Args:
        dp_group / sp_group / tp_group: the groups (see the module docstring). ``None`` is the
            default group, as everywhere in megaloss; a dimension the layout does not use is
            :data:`~megaloss.parallel.groups.SINGLE_RANK` (the default of each field).
        dp_sp_group: the flattened ``dp x sp`` group; defaults to ``dp_group`` when ``sp`` has
            size 1 and to ``sp_group`` when ``dp`` has size 1.
        mesh: the DeviceMesh the groups come from, if any (kept for the caller).
        pp_group: the pipeline-parallel group (the ranks holding the stages of one pipeline,
            DeepSpeed's ``PipelineParallelGrid.get_pipe_parallel_group()``); stages hold
            different layers of the same samples, so no token count is reduced over it.

    ``Topology()`` is one process; :meth:`default` is data parallel over the default group.

    Raises:
        ValueError: ``dp`` and ``sp`` both have size > 1 and ``dp_sp_group`` is not given.
        TypeError: a group that is not a ProcessGroup, None or SINGLE_RANK.
    """

    dp_group: GroupLike = SINGLE_RANK
    sp_group: GroupLike = SINGLE_RANK
    tp_group: GroupLike = SINGLE_RANK
    dp_sp_group: GroupLike = SINGLE_RANK
    mesh: Any = None
    pp_group: GroupLike = SINGLE_RANK

    def __post_init__(self) -> None:
        for name in ("dp_group", "sp_group", "tp_group", "dp_sp_group", "pp_group"):
            object.__setattr__(self, name, resolve_group(getattr(self, name)))
        if self.dp_sp_group is not SINGLE_RANK:
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
    def dp_sp_size(self) -> int:
        return group_size(self.dp_sp_group)

    @property
    def pp_size(self) -> int:
        return group_size(self.pp_group)

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline stage (0 without pipeline parallelism)."""
        return group_rank(self.pp_group)

    @property
    def dp_rank(self) -> int:
        return group_rank(self.dp_group)

    @property
    def sp_rank(self) -> int:
        return group_rank(self.sp_group)

    @property
    def tp_rank(self) -> int:
        return group_rank(self.tp_group)

    # constructors ------------------------------------------------------------------------------
    @classmethod
    def default(cls) -> "Topology":
        """Everything data parallel over the default group (one process without
        torch.distributed)."""
        if not dist.is_initialized():
            return cls()
        return cls(dp_group=None, dp_sp_group=None)

    @classmethod
    def build(cls, tensor_parallel_size: int = 1, *, sequence_parallel_size: int = 1,
              device_type: Optional[str] = None) -> "Topology":
        """``dp x sp x tp`` groups over the whole world from a DeviceMesh
        (:func:`init_parallel_mesh`); collective. Without torch.distributed: one process (both
        sizes must be 1).

        Raises:
            ValueError: see :func:`init_parallel_mesh`; a size > 1 without torch.distributed.
        """
        if not dist.is_initialized():
            if tensor_parallel_size != 1 or sequence_parallel_size != 1:
                raise ValueError(f"tensor_parallel_size={tensor_parallel_size}, "
                                 f"sequence_parallel_size={sequence_parallel_size} need "
                                 "torch.distributed to be initialised")
            return cls()
        return cls.from_device_mesh(init_parallel_mesh(
            tensor_parallel_size, sequence_parallel_size, device_type=device_type))

    @classmethod
    def from_device_mesh(cls, mesh: Any) -> "Topology":
        """From a :class:`~torch.distributed.device_mesh.DeviceMesh` whose dims are named among
        ``"dp"``, ``"sp"``, ``"tp"`` (missing dims are :data:`SINGLE_RANK`).

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
        dp_sp = SINGLE_RANK
        if "dp" in names and "sp" in names:
            # _flatten is the DeviceMesh way to get the group of a product of dims (torchtitan).
            dp_sp = mesh["dp", "sp"]._flatten("dp_sp").get_group()
        return cls(dp_group=groups.get("dp", SINGLE_RANK), sp_group=groups.get("sp", SINGLE_RANK),
                   tp_group=groups.get("tp", SINGLE_RANK), dp_sp_group=dp_sp, mesh=mesh)

    @classmethod
    def from_mpu(cls, mpu: Any) -> "Topology":
        """From a Megatron / DeepSpeed ``mpu`` (``get_data_parallel_group``,
        ``get_tensor_model_parallel_group`` or ``get_model_parallel_group``, optionally
        ``get_sequence_parallel_group`` and ``get_sequence_data_parallel_group``). A group the
        mpu reports as ``None`` is the default group, as torch.distributed reads it.

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
            tp = SINGLE_RANK
        sp = (mpu.get_sequence_parallel_group() if hasattr(mpu, "get_sequence_parallel_group")
              else SINGLE_RANK)
        dp_sp = (mpu.get_sequence_data_parallel_group()
                 if hasattr(mpu, "get_sequence_data_parallel_group") else SINGLE_RANK)
        return cls(dp_group=dp, sp_group=sp, tp_group=tp, dp_sp_group=dp_sp)

    @classmethod
    def from_megatron(cls, parallel_state: Any = None) -> "Topology":
        """From Megatron-core's initialised ``parallel_state`` (or NVIDIA apex's): TP, DP,
        context parallel as ``sp``, ``dp x cp`` as ``dp_sp``
        (:func:`megaloss.parallel.megatron.megatron_groups`, which has the pipeline group too);
        ``parallel_state=None`` imports the module.

        Raises:
            ImportError / TypeError / RuntimeError: see
                :func:`megaloss.parallel.megatron.megatron_groups`.
        """
        from .megatron import megatron_groups  # Megatron / apex only on request

        groups = megatron_groups(parallel_state)
        return cls(dp_group=groups["dp"], sp_group=groups["sp"], tp_group=groups["tp"],
                   dp_sp_group=groups["dp_sp"])

    def __repr__(self) -> str:
        pp = f", pp={self.pp_size}" if self.pp_size > 1 else ""
        return (f"Topology(dp={self.dp_size}, sp={self.sp_size}, tp={self.tp_size}, "
                f"dp_sp={self.dp_sp_size}{pp})")
