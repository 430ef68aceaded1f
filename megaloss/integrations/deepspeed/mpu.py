"""The ``mpu`` object DeepSpeed reads a :class:`~megaloss.Topology`'s process groups from.

DeepSpeed asks an ``mpu`` (Megatron's "model parallel unit") for its groups: ZeRO partitions and
averages gradients over ``get_data_parallel_group()`` only, and gradient clipping sums squared
norms over ``get_model_parallel_group()``, counting a parameter on every model-parallel rank only
if it carries ``tensor_model_parallel=True`` (read by
``deepspeed.runtime.utils.is_model_parallel_parameter`` in 0.19.8; replicated parameters are
counted on model-parallel rank 0 only). Without an mpu, ZeRO
would average over ``WORLD`` and mix different TP shards.

The groups handed to DeepSpeed are always real ``ProcessGroup`` objects (a dimension the topology
does not use becomes a size-1 group from the mesh, or is refused): DeepSpeed passes them to
``torch.distributed`` calls, where ``None`` would mean the whole world.
"""
from __future__ import annotations

from typing import Any, List

import torch.distributed as dist
from torch.distributed import ProcessGroup

from ...parallel.groups import SINGLE_RANK, group_rank, group_ranks, group_size
from ...parallel.topology import Topology

__all__ = ["DeepSpeedMPU"]


class DeepSpeedMPU:
    """DeepSpeed/Megatron-compatible ``mpu`` over a DP x TP :class:`Topology`.

    Pass it as ``deepspeed.initialize(..., mpu=mpu)``. Model parallel = tensor parallel here (no
    pipeline). Sequence parallelism is not wired into DeepSpeed yet: a topology with ``sp > 1`` is
    refused rather than silently reduced over the wrong group.

    DeepSpeed hands the groups to ``torch.distributed`` calls where ``None`` means ``WORLD``, so
    when several processes run, both groups must be real process groups (a topology built from a
    DeviceMesh always has them, size-1 groups included).

    Args:
        topology: a :class:`~megaloss.Topology`. With ``sp > 1`` (DeepSpeed-Ulysses sequence
            parallelism) the mpu also answers ``get_sequence_parallel_*`` and
            ``get_sequence_data_parallel_*``: DeepSpeed then partitions and reduces gradients
            over the ``dp x sp`` group (``utils/groups.py``: it looks for these methods with
            ``hasattr``, so they exist only when ``sp > 1``).

    Raises:
        TypeError: ``topology`` is not a Topology.
        ValueError: a dp / tp (or, with ``sp > 1``, sp and dp x sp) dimension without a real
            group while more than one process runs.
    """

    def __init__(self, topology: Topology) -> None:
        if not isinstance(topology, Topology):
            raise TypeError(f"topology must be a Topology, got {type(topology).__name__}")
        multi = dist.is_initialized() and dist.get_world_size() > 1
        needed = [topology.dp_group, topology.tp_group]
        if topology.sp_size > 1:
            needed += [topology.sp_group, topology.dp_sp_group]
        if multi and any(g is SINGLE_RANK for g in needed):
            raise ValueError("with several processes the topology needs real dp and tp groups "
                             "(and sp, dp x sp with sequence parallelism; DeepSpeed would read a "
                             "missing group as WORLD); build it with Topology.build(...) or "
                             "from a DeviceMesh")
        self.topology = topology
        if topology.sp_size > 1:
            t = topology
            self.get_sequence_parallel_group = lambda: t.sp_group
            self.get_sequence_parallel_world_size = lambda: t.sp_size
            self.get_sequence_parallel_rank = lambda: t.sp_rank
            self.get_sequence_data_parallel_group = lambda: t.dp_sp_group
            self.get_sequence_data_parallel_world_size = lambda: t.dp_sp_size
            self.get_sequence_data_parallel_rank = lambda: group_rank(t.dp_sp_group)

    @classmethod
    def from_device_mesh(cls, mesh: Any) -> "DeepSpeedMPU":
        """From a mesh with dims ``("dp", "tp")``
        (:func:`megaloss.parallel.init_dp_tp_mesh`)."""
        return cls(Topology.from_device_mesh(mesh))

    def _group(self, group):
        return None if group is SINGLE_RANK else group

    # data parallel ------------------------------------------------------------------------------
    def get_data_parallel_group(self) -> ProcessGroup:
        # With sequence parallelism, DeepSpeed's ZeRO-3 reduces gradients over the group this
        # returns; its own Ulysses mpu (``parallel_state_sp.py``) answers None here, i.e. the
        # world = dp x sp. So the data-parallel *group* is dp x sp, while the data-parallel
        # *size* (batch-size arithmetic) stays dp, as DeepSpeed's config computes world / sp.
        if self.topology.sp_size > 1:
            return self._group(self.topology.dp_sp_group)
        return self._group(self.topology.dp_group)

    def get_data_parallel_world_size(self) -> int:
        return group_size(self.topology.dp_group)

    def get_data_parallel_rank(self) -> int:
        return group_rank(self.topology.dp_group)

    def get_data_parallel_group_ranks(self) -> List[int]:
        return group_ranks(self.topology.dp_group)

    # tensor (= model) parallel ------------------------------------------------------------------
    def get_tensor_model_parallel_group(self) -> ProcessGroup:
        return self._group(self.topology.tp_group)

    def get_tensor_model_parallel_world_size(self) -> int:
        return group_size(self.topology.tp_group)

    def get_tensor_model_parallel_rank(self) -> int:
        return group_rank(self.topology.tp_group)

    def get_tensor_model_parallel_src_rank(self) -> int:
        """Global rank of TP rank 0 in this rank's TP group (Megatron's broadcast source)."""
        return group_ranks(self.topology.tp_group)[0]

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
