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
"""
from .comm import all_gather_dim0, all_gather_sizes, all_reduce_max_, all_reduce_sum_
from .dtensor import DTensorVocabShard, dtensor_vocab_shard
from .groups import SINGLE_RANK, group_rank, group_ranks, group_size, resolve_group
from .mappings import (
    all_reduce_sum_autograd,
    copy_to_region,
    gather_from_region,
    reduce_from_region,
)
from .param_tags import is_tensor_parallel, mark_tensor_parallel
from .topology import Topology, init_dp_tp_mesh, init_parallel_mesh

__all__ = [
    "SINGLE_RANK", "resolve_group", "group_size", "group_rank", "group_ranks",
    "Topology", "init_dp_tp_mesh", "init_parallel_mesh",
    "all_reduce_sum_", "all_reduce_max_", "all_gather_dim0", "all_gather_sizes",
    "copy_to_region", "reduce_from_region", "all_reduce_sum_autograd", "gather_from_region",
    "mark_tensor_parallel", "is_tensor_parallel",
    "DTensorVocabShard", "dtensor_vocab_shard",
]
