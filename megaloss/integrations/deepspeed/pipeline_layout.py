"""The layout of a DeepSpeed pipeline run (:func:`build_pipeline_layout`): DeepSpeed's process
grid over ``pp x dp x tp`` and this rank's stage, with megaloss's :class:`Topology` of it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ...parallel.topology import Topology
from .compat import skip_cpu_shm_comm_build

__all__ = ["PipelineLayout", "build_pipeline_layout", "PIPELINE_ZERO_STAGES", "grid_topology"]

PIPELINE_ZERO_STAGES = (0, 1)  # what PipelineEngine.__init__ accepts (DeepSpeed 0.19.8)


@dataclass(frozen=True)
class PipelineLayout:
    """A ``pp x dp x tp`` layout: DeepSpeed's ``ProcessTopology`` (axes ``pipe``, ``data``,
    ``model``; the model (TP) axis innermost, so TP groups are neighbouring ranks, and the pipe
    axis outermost) and the megaloss :class:`~megaloss.Topology` of this rank over it (``dp``,
    ``tp`` and ``pp`` groups, the same ranks the pipeline engine's own grid uses).

    Build it with :func:`build_pipeline_layout`.
    """

    process_topology: Any
    topology: Topology

    @property
    def num_stages(self) -> int:
        return self.topology.pp_size

    @property
    def stage_id(self) -> int:
        return self.topology.pp_rank

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1


def _check_size(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def build_pipeline_layout(pipeline_parallel_size: int, tensor_parallel_size: int = 1
                          ) -> PipelineLayout:
    """The groups of a ``pp x dp x tp`` layout over the whole world (collective: every rank
    calls it; ``dp = world // (pp * tp)``), as DeepSpeed's ``PipelineParallelGrid`` builds them
    from ``PipeModelDataParallelTopology`` (``runtime/pipe/topology.py``).

    Build the model's stages with ``layout.topology.tp_group`` (the vocab-parallel head), then
    pass the layout to :func:`initialize_pipeline`.

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: a size < 1, or ``pp * tp`` does not divide the world size.
    """
    _check_size("pipeline_parallel_size", pipeline_parallel_size)
    _check_size("tensor_parallel_size", tensor_parallel_size)
    if not dist.is_initialized():
        raise RuntimeError("build_pipeline_layout needs torch.distributed to be initialised")
    world = dist.get_world_size()
    if world % (pipeline_parallel_size * tensor_parallel_size):
        raise ValueError(f"pipeline_parallel_size={pipeline_parallel_size} x "
                         f"tensor_parallel_size={tensor_parallel_size} does not divide the world "
                         f"size {world}")
    import deepspeed
    from deepspeed.runtime.pipe.topology import (
        PipelineParallelGrid,
        PipeModelDataParallelTopology,
    )

    skip_cpu_shm_comm_build()
    deepspeed.init_distributed()  # the grid asks deepspeed.comm; wraps the existing group
    topo = PipeModelDataParallelTopology(
        num_pp=pipeline_parallel_size, num_mp=tensor_parallel_size,
        num_dp=world // (pipeline_parallel_size * tensor_parallel_size))
    grid = PipelineParallelGrid(topology=topo)
    return PipelineLayout(topo, grid_topology(grid))


def grid_topology(grid: Any) -> Topology:
    # The grid's "model parallel" group is pipe x model (DeepSpeed's overflow checks); the
    # tensor-parallel group is its "slice parallel" group.
    return Topology(dp_group=grid.get_data_parallel_group(),
                    tp_group=grid.get_slice_parallel_group(),
                    pp_group=grid.get_pipe_parallel_group())
