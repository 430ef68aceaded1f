"""Calibration under PyTorch FSDP2 (``fully_shard``) on real gloo processes, with the engine scale
measured by :func:`megaloss.calibration.probe_fsdp`.

A small float64 model (embedding -> linear -> tanh -> megaloss ``LinearCrossEntropyLoss`` head,
the embedding and the linear as FSDP units of their own, the head in the root unit) trains 2 SGD
steps of a global batch with uneven valid tokens per rank (an all-ignored row on the last rank's
last micro-batch); the loss of each step and every full parameter after the steps
(``DTensor.full_tensor()``) equal a float64 single-process reference on the whole global batch
(plain full logits, ``F.cross_entropy``; XTuner's token / sample / square definitions, each row
one sample) within 1e-12 relative (``max(1, |reference|)``). Layouts: FSDP world 2 and world 4
x GAS 1/2 x ``reshard_after_forward`` True/False x the three reductions; HSDP 2 x 2
(``replicate x shard``) x GAS 1/2 x the three reductions, also with
``set_requires_all_reduce(False)`` accumulation and ``set_gradient_divide_factor(2.0)``. A float32
reduction (``MixedPrecisionPolicy(reduce_dtype=float32)``) is within 1e-6.

Measured, not assumed: after ``set_gradient_divide_factor(1.0)`` on every unit the probe's
multiplier is 1 and training is exact, while the world size (what FSDP2 divides by by default)
as an assumed multiplier gives a gradient ``world`` times too large. A divide factor set on some
units only is refused (one multiplier cannot undo two factors).
"""
import math

import pytest
import torch
import torch.nn.functional as F

from megaloss.testing import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

V, H, T, B = 11, 4, 6, 2
LR = 0.5
STEPS = 2
IGNORE = -100
REDUCTIONS = ("token", "sample", "square")
TOL = 1e-12  # float64 end to end: the reductions' sums differ in order only
TOL_FP32_REDUCE = 1e-6  # gradients reduce-scattered in float32


class Net(torch.nn.Module):
    """``ids [B, T] -> tanh(proj(embed(ids)))`` and megaloss's linear cross-entropy head (the
    loss inside forward, so the head weight is the unsharded parameter)."""

    def __init__(self):
        super().__init__()
        from megaloss import LinearCrossEntropyLoss
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(V, H, dtype=torch.float64)
        self.proj = torch.nn.Linear(H, H, dtype=torch.float64)
        self.head = torch.nn.Linear(H, V, bias=False, dtype=torch.float64)
        self.loss = LinearCrossEntropyLoss(reduction="sum", accum_dtype=torch.float64)

    def hidden(self, ids):
        return torch.tanh(self.proj(self.embed(ids)))

    def forward(self, ids, labels, weights):
        return self.loss(self.hidden(ids), self.head.weight, labels, loss_weights=weights)


def make_batches(world, gas, step):
    """``batches[r][i] = (ids, labels)`` of rank r, micro-batch i: rank r has ~(1 - 0.6 r /
    world) of its tokens valid; the last micro-batch of the last rank has an all-ignored row."""
    g = torch.Generator().manual_seed(1000 * world + 10 * gas + step)
    out = []
    for r in range(world):
        row = []
        for i in range(gas):
            ids = torch.randint(0, V, (B, T), generator=g)
            labels = torch.randint(0, V, (B, T), generator=g)
            labels[torch.rand(B, T, generator=g) < 0.1 + 0.6 * r / world] = IGNORE
            labels[0, 0] = int(ids[0, 0])  # at least one valid token per micro-batch row 0
            if r == world - 1 and i == gas - 1:
                labels[1] = IGNORE
            row.append((ids, labels))
        out.append(row)
    return out


def reference_loss(net, batches, reduction):
    """The global batch's loss, XTuner's definitions, rows as samples, plain full logits."""
    num, den = 0.0, 0.0
    for row in batches:
        for ids, labels in row:
            logits = net.hidden(ids) @ net.head.weight.t()
            for b in range(ids.shape[0]):
                valid = labels[b] != IGNORE
                n = int(valid.sum())
                if n == 0:
                    continue
                u = {"token": 1.0, "sample": 1.0 / n, "square": 1.0 / math.sqrt(n)}[reduction]
                ce = F.cross_entropy(logits[b][valid], labels[b][valid], reduction="sum")
                num = num + u * ce
                den += u * n
    return num / den


def fsdp_units(net):
    from torch.distributed.fsdp import FSDPModule
    return [m for m in net.modules() if isinstance(m, FSDPModule)]


def shard(net, mesh, reshard, mp=None):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    kw = dict(mesh=mesh, reshard_after_forward=reshard,
              mp_policy=mp if mp is not None else MixedPrecisionPolicy())
    fully_shard(net.embed, **kw)
    fully_shard(net.proj, **kw)
    fully_shard(net, **kw)
    return net


def train(rank, world, mesh, *, gas, reduction, reshard=True, accumulation="no_sync", mp=None,
          divide_factor=None, scale=None):
    """2 calibrated SGD steps under FSDP2 on ``mesh``; returns the worst relative loss and
    parameter errors against the float64 reference, and the loss multiplier used."""
    from megaloss import LossCalibrator, Topology
    from megaloss.calibration import probe_fsdp
    net = shard(Net(), mesh, reshard, mp)
    if divide_factor is not None:
        for unit in fsdp_units(net):
            unit.set_gradient_divide_factor(divide_factor)
    if scale is None:
        scale = probe_fsdp(net, gas=gas, accumulation=accumulation)
    ref = Net()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    calib = LossCalibrator(Topology.default(), loss_reduction=reduction, engine_scale=scale,
                           weight_dtype=torch.float64)
    loss_err = 0.0
    for s in range(STEPS):
        batches = make_batches(world, gas, s)
        mine = batches[rank]
        step = calib.begin_step([labels for _, labels in mine])
        for i, (ids, _) in enumerate(mine):
            last = i == gas - 1
            if accumulation == "no_sync":
                net.set_requires_gradient_sync(last)
            elif accumulation == "reduce_scatter":
                net.set_requires_all_reduce(last)
            local = net(ids, step.local_labels(i), step.weights(i))
            step.loss_for_backward(local).backward()
        opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        want = reference_loss(ref, batches, reduction)
        want.backward()
        ref_opt.step()
        got = float(step.global_loss())
        want = float(want.detach())
        loss_err = max(loss_err, abs(got - want) / max(1.0, abs(want)))
    ref_params = dict(ref.named_parameters())
    param_err = 0.0
    for name, p in net.named_parameters():
        full, r = p.full_tensor().detach(), ref_params[name].detach()
        param_err = max(param_err, float((full - r).abs().max()) / max(1.0, float(r.abs().max())))
    moved = max(float((a - b).abs().max()) for a, b in zip(ref.parameters(), Net().parameters()))
    return dict(loss_err=loss_err, param_err=param_err, multiplier=scale.loss_multiplier,
                engine=scale.engine, group_size=scale.group_size, moved=moved)


def _error(fn):
    try:
        fn()
        return "no error"
    except Exception as e:  # noqa: BLE001 - the type and message are what is tested
        return f"{type(e).__name__}: {e}"


def _world2_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from megaloss.calibration import EngineScale, probe_fsdp
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for reshard in (True, False):
        for gas in (1, 2):
            for reduction in REDUCTIONS:
                out[("fsdp", world, reshard, gas, reduction)] = train(
                    rank, world, mesh, gas=gas, reduction=reduction, reshard=reshard)
    from torch.distributed.fsdp import MixedPrecisionPolicy
    out["fp32-reduce"] = train(rank, world, mesh, gas=2, reduction="token",
                               mp=MixedPrecisionPolicy(reduce_dtype=torch.float32))
    # set_gradient_divide_factor(1.0): FSDP2 sums; the probe measures it, the assumed world
    # size (FSDP2's default divisor) gives a gradient `world` times too large.
    out["divide1-probed"] = train(rank, world, mesh, gas=2, reduction="token", divide_factor=1.0)
    assumed = EngineScale("fsdp2-assumed", 1.0 / world, float(world), 2, world, 1.0 / world,
                          tuple(range(world)))
    out["divide1-assumed"] = train(rank, world, mesh, gas=2, reduction="token",
                                   divide_factor=1.0, scale=assumed)
    out["mesh-default"] = probe_fsdp(mesh).loss_multiplier
    out["mesh-sync-gas3"] = probe_fsdp(mesh, gas=3, accumulation="sync").loss_multiplier
    out["mesh-divide1-fp64"] = probe_fsdp(mesh, gas=2, reduce_dtype=torch.float64,
                                          gradient_divide_factor=1.0).loss_multiplier
    out["mesh-divide1-fp32-sum"] = probe_fsdp(
        mesh, reduce_dtype=torch.float32, gradient_divide_factor=1.0,
        force_sum_reduction_for_comms=True).loss_multiplier
    out["mesh-bf16"] = probe_fsdp(mesh, reduce_dtype=torch.bfloat16).engine
    partial = shard(Net(), mesh, True)
    partial.set_gradient_divide_factor(1.0)  # the root unit only: the others still average
    out["partial"] = _error(lambda: probe_fsdp(partial))
    out["bad-accumulation"] = _error(lambda: probe_fsdp(mesh, accumulation="every"))
    out["kw-with-module"] = _error(lambda: probe_fsdp(partial, gradient_divide_factor=2.0))
    out["no-fsdp"] = _error(lambda: probe_fsdp(torch.nn.Linear(2, 2)))
    out["not-a-mesh"] = _error(lambda: probe_fsdp("mesh"))
    return out


def _world4_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    mesh1 = init_device_mesh("cpu", (world,))
    mesh2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    out = {}
    for gas in (1, 2):
        for reduction in REDUCTIONS:
            out[("hsdp", world, gas == 1, gas, reduction)] = train(
                rank, world, mesh2, gas=gas, reduction=reduction, reshard=gas == 1)
    out["hsdp-reduce-scatter"] = train(rank, world, mesh2, gas=2, reduction="sample",
                                       accumulation="reduce_scatter")
    out["hsdp-divide2"] = train(rank, world, mesh2, gas=2, reduction="square", divide_factor=2.0)
    for reshard in (True, False):
        for gas in (1, 2):
            for reduction in REDUCTIONS:
                out[("fsdp", world, reshard, gas, reduction)] = train(
                    rank, world, mesh1, gas=gas, reduction=reduction, reshard=reshard)
    return out


def _check_exact(r, where, tol=TOL):
    assert r["moved"] > 1e-3, where  # the steps changed the parameters
    assert r["loss_err"] < tol, (where, r)
    assert r["param_err"] < tol, (where, r)


@pytest.fixture(scope="module")
def world2():
    return run_distributed(_world2_worker, 2, timeout=200)


@pytest.fixture(scope="module")
def world4():
    return run_distributed(_world4_worker, 4, timeout=200)


def test_fsdp_world2_equals_float64_reference(world2):
    for rank, res in enumerate(world2):
        for key, r in res.items():
            if isinstance(key, tuple):
                _check_exact(r, (key, rank))
                assert r["multiplier"] == 2.0 and r["group_size"] == 2, (key, r)
        r = res["fp32-reduce"]
        _check_exact(r, ("fp32-reduce", rank), TOL_FP32_REDUCE)
        assert r["multiplier"] == 2.0 and "reduce=float32" in r["engine"], r


def test_divide_factor_measured_not_assumed(world2):
    for res in world2:
        probed, assumed = res["divide1-probed"], res["divide1-assumed"]
        assert probed["multiplier"] == 1.0, probed
        _check_exact(probed, "divide1-probed")
        assert assumed["param_err"] > 1e-3, assumed  # the assumed world size is wrong
        assert res["mesh-default"] == 2.0
        assert res["mesh-sync-gas3"] == 2.0
        assert res["mesh-divide1-fp64"] == 1.0
        assert res["mesh-divide1-fp32-sum"] == 1.0
        assert "reduce=bfloat16" in res["mesh-bf16"]


def test_probe_fsdp_refusals(world2):
    for res in world2:
        assert res["partial"].startswith("EngineScaleError"), res["partial"]
        assert "reduce gradients differently" in res["partial"]
        assert res["bad-accumulation"].startswith("ValueError"), res["bad-accumulation"]
        assert res["kw-with-module"].startswith("ValueError"), res["kw-with-module"]
        assert res["no-fsdp"].startswith("ValueError"), res["no-fsdp"]
        assert res["not-a-mesh"].startswith("TypeError"), res["not-a-mesh"]


def test_hsdp_2x2_and_fsdp_world4_equal_float64_reference(world4):
    grid = {(reshard, gas, reduction) for reshard in (True, False) for gas in (1, 2)
            for reduction in REDUCTIONS}
    for rank, res in enumerate(world4):
        assert {k[2:] for k in res if isinstance(k, tuple) and k[0] == "fsdp"} == grid
        for key, r in res.items():
            _check_exact(r, (key, rank))
            want = 2.0 if key == "hsdp-divide2" else 4.0
            assert r["multiplier"] == want and r["group_size"] == 4, (key, r)
        assert res["hsdp-divide2"]["engine"].startswith("fsdp2-hsdp/"), res["hsdp-divide2"]
