"""Autograd collectives on real gloo processes against hand-computed sums."""
import pytest
import torch

from dist_harness import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def _uneven_gather(rank, world):
    import torch.distributed as dist

    from megaloss.distributed import gather_along_dim0_uneven
    sizes = [(r * 2) % 3 for r in range(world)]  # includes a rank with 0 rows
    x = torch.arange(sizes[rank] * 2, dtype=torch.float64).reshape(-1, 2) + 100 * rank
    x.requires_grad_(True)
    g = gather_along_dim0_uneven(x, dist.group.WORLD)
    # each rank weights the gathered rows differently; rank r's grad = sum over ranks of weights
    w = torch.arange(g.numel(), dtype=torch.float64).reshape(g.shape) * (rank + 1)
    (g * w).sum().backward()
    return g.detach(), x.grad


def _reduce_family(rank, world):
    import torch.distributed as dist

    from megaloss.distributed import all_reduce_sum, copy_to_group, gather_along_dim0
    group = dist.group.WORLD
    x = torch.full((2, 3), float(rank + 1), dtype=torch.float64, requires_grad=True)
    (all_reduce_sum(x, group) * (rank + 1)).sum().backward()
    g_allreduce = x.grad.clone()
    x.grad = None
    (copy_to_group(x, group) * (rank + 1)).sum().backward()
    g_copy = x.grad.clone()
    x.grad = None
    y = gather_along_dim0(x, group)
    (y * (rank + 1)).sum().backward()
    return g_allreduce, g_copy, x.grad.clone(), y.detach()


@pytest.mark.parametrize("world", [2, 3])
def test_uneven_gather_forward_and_backward(world):
    results = run_distributed(_uneven_gather, world)
    sizes = [(r * 2) % 3 for r in range(world)]
    expected = torch.cat([torch.arange(n * 2, dtype=torch.float64).reshape(-1, 2) + 100 * r
                          for r, n in enumerate(sizes)])
    total_weight = sum(r + 1 for r in range(world))
    offsets = [sum(sizes[:r]) for r in range(world)]
    for rank, (g, grad) in enumerate(results):
        torch.testing.assert_close(g, expected, rtol=0, atol=0)
        base = torch.arange(expected.numel(), dtype=torch.float64).reshape(expected.shape)
        want = base[offsets[rank]: offsets[rank] + sizes[rank]] * total_weight
        torch.testing.assert_close(grad, want, rtol=0, atol=0)


def test_sum_copy_and_gather_gradients():
    world = 2
    results = run_distributed(_reduce_family, world)
    total = sum(r + 1 for r in range(world))
    for rank, (g_ar, g_copy, g_gather, y) in enumerate(results):
        torch.testing.assert_close(g_ar, torch.full((2, 3), float(total), dtype=torch.float64))
        torch.testing.assert_close(g_copy, torch.full((2, 3), float(total), dtype=torch.float64))
        torch.testing.assert_close(g_gather, torch.full((2, 3), float(total), dtype=torch.float64))
        assert y.shape == (2 * world, 3)
