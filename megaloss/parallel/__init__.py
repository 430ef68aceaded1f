"""Process groups and collectives: the layer between single-device math (:mod:`megaloss.ops`)
and the losses (:mod:`megaloss.losses`).

- :mod:`.groups`: what ``group`` means (``None`` = torch's default group; :data:`SINGLE_RANK`).
- :mod:`.topology`: :class:`Topology`, the ``dp x sp x tp`` groups of one rank.
- :mod:`.megatron`: those groups from Megatron-core's (or apex's) ``parallel_state``.
- :mod:`.comm`: in-place collectives without autograd (statistics, counts), and the
  agreement of every rank on a rank-local input error.
- :mod:`.mappings`: autograd communication regions (copy-to, reduce-from, gather-from).
- :mod:`.param_tags`: tensor-parallel parameter tags read by DeepSpeed and Megatron.
- :mod:`.dtensor`: the vocabulary shard of a ``Shard(0)`` DTensor lm_head (torch's
  ``ColwiseParallel``): local rows, TP group, range.

``__all__`` is what a user calls to describe a layout (:class:`Topology`, the meshes,
:data:`SINGLE_RANK`, the tensor-parallel tag); the collectives and group helpers are imported
from their modules.
"""
from .groups import SINGLE_RANK
from .param_tags import mark_tensor_parallel
from .topology import Topology, init_dp_tp_mesh, init_parallel_mesh

__all__ = ["Topology", "init_parallel_mesh", "init_dp_tp_mesh", "SINGLE_RANK",
           "mark_tensor_parallel"]
