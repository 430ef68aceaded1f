"""DP x TP process groups and the ``mpu`` object DeepSpeed reads them from.

DeepSpeed asks an ``mpu`` (Megatron's "model parallel unit") for its groups: ZeRO partitions and
averages gradients over ``get_data_parallel_group()`` only, and gradient clipping sums squared
norms over ``get_model_parallel_group()``, counting a parameter on every model-parallel rank only
if it carries ``tensor_model_parallel=True`` (read by
``deepspeed.runtime.utils.is_model_parallel_parameter`` in 0.19.8; replicated parameters are
counted on model-parallel rank 0 only). Without an mpu, ZeRO
would average over ``WORLD`` and mix different TP shards.

Layout: tensor parallelism is the innermost mesh dim (ranks ``0..tp-1`` form the first TP group),
Megatron's convention, so TP collectives stay on neighbouring ranks (one node, fast links).
"""
from __future__ import annotations

from typing import Any, List, Optional

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from .topology import Topology, group_rank, group_size

__all__ = ["init_dp_tp_mesh", "DeepSpeedMPU", "mark_tensor_parallel", "is_tensor_parallel"]


def init_dp_tp_mesh(tensor_parallel_size: int, *, device_type: Optional[str] = None) -> Any:
    """Build a 2-D :class:`~torch.distributed.device_mesh.DeviceMesh` with dims ``("dp", "tp")``.

    Collective: every rank of the default group must call it. ``dp = world // tp``.

    Args:
        tensor_parallel_size: TP degree (>= 1, divides the world size).
        device_type: mesh device type; default ``"cuda"`` when available, else ``"cpu"``.

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: ``tensor_parallel_size`` < 1 or does not divide the world size.
    """
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise RuntimeError("init_dp_tp_mesh needs torch.distributed to be initialised")
    if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be an int >= 1, got {tensor_parallel_size!r}")
    world = dist.get_world_size()
    if world % tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} does not divide the world "
                         f"size {world}")
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return init_device_mesh(device_type, (world // tensor_parallel_size, tensor_parallel_size),
                            mesh_dim_names=("dp", "tp"))


def mark_tensor_parallel(param: torch.nn.Parameter, partition_dim: int = 0) -> torch.nn.Parameter:
    """Tag a TP-sharded parameter the way DeepSpeed and Megatron expect.

    ``tensor_model_parallel=True`` makes DeepSpeed count the shard's gradient norm on every TP
    rank (a replicated parameter is counted on TP rank 0 only); ``partition_dim`` /
    ``partition_stride`` are Megatron's checkpoint-merging attributes. Returns ``param``.
    """
    if not isinstance(param, torch.nn.Parameter):
        raise TypeError(f"param must be an nn.Parameter, got {type(param).__name__}")
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = 1
    return param


def is_tensor_parallel(param: torch.Tensor) -> bool:
    """True when ``param`` is tagged as a TP shard (DeepSpeed's ``is_model_parallel_parameter``)."""
    return bool(getattr(param, "tensor_model_parallel", False) or getattr(param, "model_parallel",
                                                                          False))


def _ranks(group: ProcessGroup) -> List[int]:
    return dist.get_process_group_ranks(group)


class DeepSpeedMPU:
    """DeepSpeed/Megatron-compatible ``mpu`` over a DP x TP :class:`Topology`.

    Pass it as ``deepspeed.initialize(..., mpu=mpu)``. Model parallel = tensor parallel here (no
    pipeline). Sequence parallelism is not wired into DeepSpeed yet: a topology with ``sp > 1`` is
    refused rather than silently reduced over the wrong group.

    DeepSpeed hands the groups to ``torch.distributed`` calls where ``None`` means ``WORLD``, so
    when several processes run, both groups must be real process groups (a
    :meth:`from_device_mesh` mpu always has them, size-1 groups included).

    Raises:
        ValueError: ``sp > 1``, or a ``None`` group while more than one process runs.
    """

    def __init__(self, topology: Topology) -> None:
        if not isinstance(topology, Topology):
            raise TypeError(f"topology must be a Topology, got {type(topology).__name__}")
        if topology.sp_size != 1:
            raise ValueError(f"DeepSpeedMPU supports dp x tp only, got {topology!r}")
        multi = dist.is_initialized() and dist.get_world_size() > 1
        if multi and (topology.dp_group is None or topology.tp_group is None):
            raise ValueError("with several processes the topology needs real dp and tp groups "
                             "(None would mean WORLD to DeepSpeed); build it from a DeviceMesh")
        self.topology = topology

    @classmethod
    def from_device_mesh(cls, mesh: Any) -> "DeepSpeedMPU":
        """From a mesh with dims ``("dp", "tp")`` (see :func:`init_dp_tp_mesh`)."""
        return cls(Topology.from_device_mesh(mesh))

    # data parallel ------------------------------------------------------------------------------
    def get_data_parallel_group(self) -> Optional[ProcessGroup]:
        return self.topology.dp_group

    def get_data_parallel_world_size(self) -> int:
        return group_size(self.topology.dp_group)

    def get_data_parallel_rank(self) -> int:
        return group_rank(self.topology.dp_group)

    def get_data_parallel_group_ranks(self) -> List[int]:
        g = self.topology.dp_group
        return [dist.get_rank() if dist.is_initialized() else 0] if g is None else _ranks(g)

    # tensor (= model) parallel ------------------------------------------------------------------
    def get_tensor_model_parallel_group(self) -> Optional[ProcessGroup]:
        return self.topology.tp_group

    def get_tensor_model_parallel_world_size(self) -> int:
        return group_size(self.topology.tp_group)

    def get_tensor_model_parallel_rank(self) -> int:
        return group_rank(self.topology.tp_group)

    def get_tensor_model_parallel_src_rank(self) -> int:
        """Global rank of TP rank 0 in this rank's TP group (Megatron's broadcast source)."""
        g = self.topology.tp_group
        if g is None:
            return dist.get_rank() if dist.is_initialized() else 0
        return _ranks(g)[0]

    get_model_parallel_group = get_tensor_model_parallel_group
    get_model_parallel_world_size = get_tensor_model_parallel_world_size
    get_model_parallel_rank = get_tensor_model_parallel_rank
    get_model_parallel_src_rank = get_tensor_model_parallel_src_rank

    # no pipeline parallelism --------------------------------------------------------------------
    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1

    def get_pipeline_model_parallel_rank(self) -> int:
        return 0

    def __repr__(self) -> str:
        return f"DeepSpeedMPU({self.topology!r})"
