"""What ``group`` means, single process: ``None`` is the default group (one process without
torch.distributed), ``SINGLE_RANK`` is this rank alone, anything else is refused."""
import pickle

import pytest
import torch

from megaloss import SINGLE_RANK, Topology
from megaloss.parallel.groups import group_rank, group_ranks, group_size, resolve_group
from megaloss.parallel.mappings import all_reduce_sum_autograd, copy_to_region, gather_from_region


def test_none_without_torch_distributed_is_one_process():
    assert resolve_group(None) is SINGLE_RANK
    assert (group_size(None), group_rank(None), group_ranks(None)) == (1, 0, [0])


def test_single_rank_survives_pickling():
    assert pickle.loads(pickle.dumps(SINGLE_RANK)) is SINGLE_RANK


def test_bad_group_type_is_a_type_error_naming_group():
    with pytest.raises(TypeError, match="group must be"):
        group_size("world")


def test_trivial_group_collectives_are_identities():
    x = torch.randn(3, 2, requires_grad=True)
    for fn in (copy_to_region, gather_from_region, all_reduce_sum_autograd):
        assert fn(x, SINGLE_RANK) is x
        assert fn(x) is x  # None without torch.distributed


def test_topology_defaults():
    t = Topology()
    assert (t.dp_size, t.sp_size, t.tp_size, t.dp_sp_size) == (1, 1, 1, 1)
    assert t.dp_group is SINGLE_RANK and t.dp_sp_group is SINGLE_RANK
    assert Topology.default().dp_size == 1
    assert Topology.build(1).tp_size == 1
    with pytest.raises(ValueError, match="tensor_parallel_size=2, sequence_parallel_size=1 need"):
        Topology.build(2)
