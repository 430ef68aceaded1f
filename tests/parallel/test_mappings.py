"""Autograd regions and in-place collectives on real gloo processes against hand-computed sums.

One spawn of 3 ranks runs every case (spawning dominates the cost); each case's expected value is
written out from the definition, not from megaloss's code.
"""
import pytest
import torch

from megaloss.testing import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

WORLD = 3
SIZES = [(r * 2) % 3 for r in range(WORLD)]  # [0, 2, 1]: includes a rank with no rows


def _all_cases(rank, world):
    import torch.distributed as dist

    from megaloss.parallel import SINGLE_RANK
    from megaloss.parallel.comm import all_gather_sizes, all_reduce_max_, all_reduce_sum_
    from megaloss.parallel.mappings import (
        all_reduce_sum_autograd,
        copy_to_region,
        gather_from_region,
        reduce_from_region,
    )
    out = {}
    # uneven autograd gather over the default group (group=None)
    x = torch.arange(SIZES[rank] * 2, dtype=torch.float64).reshape(-1, 2) + 100 * rank
    x.requires_grad_(True)
    g = gather_from_region(x)
    w = torch.arange(g.numel(), dtype=torch.float64).reshape(g.shape) * (rank + 1)
    (g * w).sum().backward()
    out["gather"], out["gather_grad"] = g.detach(), x.grad.clone()
    # even sizes, explicit group
    y = torch.full((2, 3), float(rank + 1), dtype=torch.float64, requires_grad=True)
    (gather_from_region(y, dist.group.WORLD) * (rank + 1)).sum().backward()
    out["even_grad"] = y.grad.clone()
    for name, fn in (("allreduce", all_reduce_sum_autograd), ("copy", copy_to_region),
                     ("reduce", reduce_from_region)):
        y.grad = None
        v = fn(y, None)
        (v * (rank + 1)).sum().backward()
        out[name] = (v.detach().clone(), y.grad.clone())
    # the trivial group: identity, no communication
    z = torch.ones(2, requires_grad=True)
    out["single_is_identity"] = gather_from_region(z, SINGLE_RANK) is z
    out["sizes"] = all_gather_sizes(SIZES[rank])
    t = torch.tensor([float(rank), -float(rank)])
    out["sum_"] = all_reduce_sum_(t.clone()).tolist()
    out["max_"] = all_reduce_max_(t.clone()).tolist()
    return out


def test_regions_and_collectives_against_hand_sums():
    results = run_distributed(_all_cases, WORLD)
    expected = torch.cat([torch.arange(n * 2, dtype=torch.float64).reshape(-1, 2) + 100 * r
                          for r, n in enumerate(SIZES)])
    total_weight = sum(r + 1 for r in range(WORLD))  # every rank's multiplier, summed
    offsets = [sum(SIZES[:r]) for r in range(WORLD)]
    base = torch.arange(expected.numel(), dtype=torch.float64).reshape(expected.shape)
    for rank, out in enumerate(results):
        torch.testing.assert_close(out["gather"], expected, rtol=0, atol=0)
        want = base[offsets[rank]: offsets[rank] + SIZES[rank]] * total_weight
        torch.testing.assert_close(out["gather_grad"], want, rtol=0, atol=0)
        full = torch.full((2, 3), float(total_weight), dtype=torch.float64)
        torch.testing.assert_close(out["even_grad"], full)
        # all-reduce with all-reduce backward: value sum_r (r+1), grad sum_r (r+1)
        value, grad = out["allreduce"]
        torch.testing.assert_close(value, full)
        torch.testing.assert_close(grad, full)
        # copy-to: identity forward, summed gradient
        value, grad = out["copy"]
        torch.testing.assert_close(value, torch.full((2, 3), float(rank + 1), dtype=torch.float64))
        torch.testing.assert_close(grad, full)
        # reduce-from: summed forward, own gradient only
        value, grad = out["reduce"]
        torch.testing.assert_close(value, full)
        torch.testing.assert_close(grad, torch.full((2, 3), float(rank + 1), dtype=torch.float64))
        assert out["single_is_identity"]
        assert out["sizes"] == SIZES
        assert out["sum_"] == [sum(range(WORLD)), -sum(range(WORLD))]
        assert out["max_"] == [WORLD - 1, 0.0]
