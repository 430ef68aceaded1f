"""Process groups and autograd-aware collectives (the layer between single-device math and losses)."""
from .collectives import (all_gather_dim0, all_gather_sizes, all_reduce_max_, all_reduce_sum, all_reduce_sum_,
                          copy_to_group, gather_along_dim0, gather_along_dim0_uneven,
                          reduce_from_group)
from .topology import Topology, group_rank, group_size

__all__ = [
    "Topology", "group_size", "group_rank", "all_reduce_sum", "copy_to_group",
    "reduce_from_group", "gather_along_dim0", "gather_along_dim0_uneven", "all_gather_sizes", "all_gather_dim0",
    "all_reduce_max_", "all_reduce_sum_",
]
