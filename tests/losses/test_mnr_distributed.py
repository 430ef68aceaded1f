"""MNR loss on real gloo processes: a tiny encoder wrapped in DDP, trained on a global batch split
unevenly over 1-4 ranks (one rank with B=0), must produce the single-process float64 loss, metrics
and parameter gradients of the whole global batch. Also: errors raised on every rank (no hang),
sub-groups, and the rank-0-only plain ``all_gather`` recipe that does NOT match.

Each world size is one spawned run that loops over its cases (spawning dominates the cost).
Tolerance: float64 everywhere; rtol 1e-9 / atol 1e-11 covers summation-order differences.
"""
import functools
import warnings

import pytest
import torch
from test_mnr import TOL, reference_metrics, reference_mnr
from torch import nn

from megaloss.losses.mnr import MultipleNegativesRankingLoss
from megaloss.testing import run_distributed

pytestmark = [pytest.mark.distributed]

F_IN, D = 5, 4


def case(sizes, k=0, similarity="cosine", symmetric=False, dup=False, local_loss=True,
         learnable=False, seed=0):
    return dict(sizes=sizes, k=k, similarity=similarity, symmetric=symmetric, dup=dup,
                local_loss=local_loss, learnable=learnable, seed=seed)


CASES = {
    2: [case([3, 3]),
        case([4, 1], k=2, similarity="dot", symmetric=True, learnable=True, seed=1),
        case([0, 4], k=2, symmetric=True, local_loss=False, seed=2),
        case([3, 3], k=2, dup=True, seed=3),
        case([2, 3], similarity="dot", symmetric=True, dup=True, local_loss=False, learnable=True,
             seed=4),
        case([4, 1], k=2, symmetric=True, dup=True, learnable=True, seed=5)],
    3: [case([2, 0, 3], k=2, symmetric=True, learnable=True, seed=6),
        case([1, 2, 1], similarity="dot", dup=True, local_loss=False, seed=7)],
    4: [case([1, 2, 0, 3], k=2, symmetric=True, dup=True, seed=8),
        case([2, 2, 2, 2], similarity="dot", learnable=True, seed=9)],
}


# model and data (identical on every rank and in the parent) ------------------------------------
class Tower(nn.Module):
    """Encoder + loss in one module, as a real training step would wrap it in DDP."""

    def __init__(self, c, group=None):
        super().__init__()
        torch.manual_seed(1234)
        self.encoder = nn.Sequential(nn.Linear(F_IN, D), nn.Tanh(), nn.Linear(D, D)).double()
        self.loss = MultipleNegativesRankingLoss(
            0.05 if c["similarity"] == "cosine" else 2.0, learnable_temperature=c["learnable"],
            similarity=c["similarity"], symmetric=c["symmetric"], local_loss=c["local_loss"],
            group=group).double()

    def embed(self, xq, xp, xn):
        b = xq.shape[0]
        emb = self.encoder(torch.cat([xq, xp] + ([xn.reshape(-1, F_IN)] if xn is not None else [])))
        neg = emb[2 * b:].reshape(b, -1, D) if xn is not None else None
        return emb[:b], emb[b:2 * b], neg

    def forward(self, xq, xp, xn, ids):
        return self.loss.forward_with_metrics(*self.embed(xq, xp, xn), ids)


def global_data(c):
    g = torch.Generator().manual_seed(100 + c["seed"])
    n = sum(c["sizes"])
    xq = torch.randn(n, F_IN, generator=g, dtype=torch.float64)
    xp = xq + 1.5 * torch.randn(n, F_IN, generator=g, dtype=torch.float64)
    xn = torch.randn(n, c["k"], F_IN, generator=g, dtype=torch.float64) if c["k"] else None
    ids = torch.randint(0, max(n // 2, 1), (n,), generator=g) if c["dup"] else None
    return xq, xp, xn, ids


def local_data(c, rank):
    sizes = c["sizes"]
    lo, hi = sum(sizes[:rank]), sum(sizes[:rank + 1])
    xq, xp, xn, ids = global_data(c)
    # a rank with no pairs passes negatives=None even when the others have K=2
    xn = None if xn is None or hi == lo else xn[lo:hi]
    return xq[lo:hi], xp[lo:hi], xn, None if ids is None else ids[lo:hi]


def reference(c):
    """Single process, float64, the concatenated global batch: loss, metrics, parameter grads."""
    tower = Tower(c)
    xq, xp, xn, ids = global_data(c)
    q, p, neg = tower.embed(xq, xp, xn)
    t = tower.loss.temperature
    loss = reference_mnr(q, p, neg, temperature=t, similarity=c["similarity"],
                         symmetric=c["symmetric"], ids=ids)
    loss.backward()
    with torch.no_grad():
        metrics = reference_metrics(q, p, neg, temperature=t, similarity=c["similarity"], ids=ids)
    return loss.item(), metrics, {k: v.grad for k, v in tower.named_parameters()}


def run_case(c, rank, group=None):
    """One training step of the DDP-wrapped tower on this rank's slice of the global batch
    (``group`` = the DP group: None is WORLD; without torch.distributed, a single process and no
    DDP)."""
    import torch.distributed as dist

    tower = Tower(c, group)
    model = (nn.parallel.DistributedDataParallel(tower, process_group=group)
             if dist.is_initialized() else tower)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FutureWarning)
        out = model(*local_data(c, rank))
        out.loss.backward()  # DDP averages the gradients over the group here
    deprecated = [str(w.message) for w in caught if "deprecated" in str(w.message)]
    assert not deprecated, deprecated  # no deprecated torch collective in the gather
    assert out.num_queries == sum(c["sizes"])
    grads = {k.removeprefix("module."): v.grad.tolist() for k, v in model.named_parameters()}
    return out.loss.item(), (out.accuracy.item(), out.mean_rank.item()), grads


def check_against_reference(c, results):
    ref_loss, (ref_acc, ref_rank), ref_grads = reference(c)
    for rank, (loss, (acc, mean_rank), grads) in enumerate(results):
        where = f"case {c}, rank {rank}"
        assert loss == pytest.approx(ref_loss, rel=1e-9), where
        assert acc == pytest.approx(ref_acc) and mean_rank == pytest.approx(ref_rank), where
        assert grads.keys() == ref_grads.keys(), where
        for name, g in grads.items():
            torch.testing.assert_close(torch.tensor(g, dtype=torch.float64), ref_grads[name],
                                       **TOL, msg=f"{where}, grad of {name}")


# extras run inside the spawned workers --------------------------------------------------------
def _expect_value_error(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def error_cases(rank, group):
    """Each mistake is made on one rank only; every rank must raise (a rank that did not would
    wait forever in the next collective and the harness would time out)."""
    from megaloss.losses.mnr import mnr_loss
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(3, D, generator=g, dtype=torch.float64)
    p = torch.randn(3, D, generator=g, dtype=torch.float64)
    nan_q = q.clone()
    nan_q[0, 0] = float("nan")
    ids = torch.arange(3)
    wide = torch.randn(3, D + 1, dtype=torch.float64)
    loss = functools.partial(mnr_loss, group=group)
    return {
        "d": _expect_value_error(lambda: loss(wide if rank == 1 else q, wide if rank == 1 else p)),
        "nan": _expect_value_error(lambda: loss(nan_q if rank == 1 else q, p)),
        "shape": _expect_value_error(lambda: loss(q, p[:2] if rank == 0 else p)),
        "grad": _expect_value_error(lambda: loss(q.clone().requires_grad_(rank == 0), p)),
        "ids": _expect_value_error(lambda: loss(q, p, duplicate_ids=ids if rank == 0 else None)),
    }


def rank0_only_recipe(rank, group):
    """The widely copied recipe: plain (gradient-free) ``all_gather``, own slice put back so it
    carries a gradient, loss on rank 0 only, value all-reduced. Returns its loss and gradients."""
    import torch.distributed as dist
    c = CASES[2][0]
    world = dist.get_world_size(group)
    model = nn.parallel.DistributedDataParallel(Tower(c, group), process_group=group)
    xq, xp, xn, _ = local_data(c, rank)
    q, p, _ = model.module.embed(xq, xp, xn)
    gq = [torch.empty_like(q) for _ in range(world)]
    gp = [torch.empty_like(p) for _ in range(world)]
    dist.all_gather(gq, q.detach(), group=group)
    dist.all_gather(gp, p.detach(), group=group)
    gq[rank], gp[rank] = q, p
    if rank == 0:
        loss = reference_mnr(torch.cat(gq), torch.cat(gp), temperature=0.05)
    else:
        loss = (q.sum() + p.sum()) * 0.0  # keeps DDP's hooks firing on every rank
    value = loss.detach().clone()
    dist.all_reduce(value, group=group)
    loss.backward()
    return value.item(), {k.removeprefix("module."): v.grad.tolist()
                          for k, v in model.named_parameters()}


SUBGROUP_CASE = case([2, 1, 3, 2], k=2, seed=11)


def subgroup_losses(rank, pairs):
    """Groups {0,1} and {2,3}: each gathers only over its own group."""
    from megaloss.losses.mnr import mnr_loss
    xq, xp, xn, _ = local_data(SUBGROUP_CASE, rank)
    q, p, neg = Tower(SUBGROUP_CASE).embed(xq, xp, xn)
    return (mnr_loss(q, p, neg, group=pairs[rank // 2]).item(),
            mnr_loss(q, p, neg, gather=False).item())


def _worker(rank, world):
    """One spawn of 4 ranks serves every group size: the size-2 and size-3 cases run on
    sub-groups {0,1} and {0,1,2} (the loss and DDP both get the group), size 4 on WORLD via
    ``group=None``. Spawning (importing torch in each process) dominates the cost."""
    import torch.distributed as dist
    assert world == 4
    # every rank creates every group, in the same order (torch.distributed requires it)
    groups = {2: dist.new_group([0, 1]), 3: dist.new_group([0, 1, 2]), 4: None}
    pairs = [groups[2], dist.new_group([2, 3])]
    out = {}
    for size in (2, 3, 4):
        if rank < size:
            out[size] = [run_case(c, rank, groups[size]) for c in CASES[size]]
    if rank < 2:
        out["errors"] = error_cases(rank, groups[2])
        out["recipe"] = rank0_only_recipe(rank, groups[2])
    out["subgroups"] = subgroup_losses(rank, pairs)
    return out


@pytest.fixture(scope="module")
def spawned():
    return run_distributed(_worker, 4)


def _check_size(per_rank, size):
    for i, c in enumerate(CASES[size]):
        check_against_reference(c, [per_rank[r][size][i] for r in range(size)])


# the tests -------------------------------------------------------------------------------------
def test_world_1_single_process_matches_reference():
    for c in CASES[2] + CASES[3] + CASES[4]:
        c = dict(c, sizes=[sum(c["sizes"])])
        check_against_reference(c, [run_case(c, 0)])


@pytest.mark.timeout(300)
def test_group_of_2_matches_reference(spawned):
    _check_size(spawned, 2)


@pytest.mark.timeout(300)
def test_group_of_3_with_empty_rank_matches_reference(spawned):
    _check_size(spawned, 3)


@pytest.mark.timeout(300)
def test_world_of_4_matches_reference(spawned):
    _check_size(spawned, 4)


@pytest.mark.timeout(300)
def test_errors_raise_on_every_rank(spawned):
    errors = [spawned[r]["errors"] for r in range(2)]
    for e in errors:
        assert "embedding size D differs" in e["d"]
        assert "query contains NaN or inf on rank(s) [1]" in e["nan"]
        assert "requires_grad" in e["grad"] and "duplicate_ids" in e["ids"]
    assert "positive must have" in errors[0]["shape"]
    assert "rank(s) [0]" in errors[1]["shape"]


@pytest.mark.timeout(300)
def test_rank0_only_plain_all_gather_recipe_does_not_match(spawned):
    # The recipe gets the loss VALUE right (it is all-reduced) but not the gradients: plain
    # all_gather returns tensors without autograd history, so only rank 0's own slice receives
    # any gradient, and DDP's average then divides even that by the world size.
    ref_loss, _, ref_grads = reference(CASES[2][0])
    for value, grads in (spawned[r]["recipe"] for r in range(2)):
        assert value == pytest.approx(ref_loss, rel=1e-9)
        for name, g in grads.items():
            g = torch.tensor(g, dtype=torch.float64)
            assert (g - ref_grads[name]).norm() > 0.1 * ref_grads[name].norm(), name


@pytest.mark.timeout(300)
def test_explicit_subgroups_gather_only_their_ranks(spawned):
    tower = Tower(SUBGROUP_CASE)
    xq, xp, xn, _ = global_data(SUBGROUP_CASE)
    with torch.no_grad():
        q, p, neg = tower.embed(xq, xp, xn)
    bounds = [0, 2, 3, 6, 8]
    for rank in range(4):
        sub, alone = spawned[rank]["subgroups"]
        lo, hi = bounds[2 * (rank // 2)], bounds[2 * (rank // 2) + 2]
        assert sub == pytest.approx(reference_mnr(q[lo:hi], p[lo:hi], neg[lo:hi]).item(),
                                    rel=1e-9), rank
        own = slice(bounds[rank], bounds[rank + 1])
        assert alone == pytest.approx(reference_mnr(q[own], p[own], neg[own]).item(), rel=1e-9)
