"""Calibration under torch DDP on real gloo processes: issue 4's toy case, and gradients equal to
a float64 single-device reference for DP in {1, 2, 3} x SP in {1, 2} x GAS in {1, 2, 3}
(a covering set: every (DP, GAS) and (SP, GAS) pair; DP=3 x SP=2 would need 6 processes), with
uneven valid tokens, an all-ignored micro-batch, rows, cu_seqlens- and position_ids-packed samples,
and all three reductions. Everything is float64: tolerances are 1e-10 relative.
"""
import contextlib

import pytest
import torch

from dist_harness import run_distributed
from test_calibration_cases import (TOY_EXPECTED, TinyLM, Toy, make_groups, make_step,
                                    reference, run_toy, train_step)

pytestmark = [pytest.mark.distributed]
REDUCTIONS = ("token", "sample", "square")


def _ddp_micro_step(ddp):
    def micro_step(inputs, finalize, is_last):
        # DDP accumulates locally under no_sync and averages at the last micro-batch.
        with contextlib.nullcontext() if is_last else ddp.no_sync():
            finalize(ddp(*inputs)).backward()
    return micro_step


def _ddp_worker(rank, world, layouts, toy, bad_probe):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from megaloss.calibration import EngineScaleError, LossCalibrator, probe_ddp
    from megaloss.distributed import Topology
    out = {}
    if toy:
        topo = Topology.default()
        scale = probe_ddp(gas=2, group=topo.dp_sp_group)
        out["toy_multiplier"] = scale.loss_multiplier
        for reduction in REDUCTIONS:
            model = Toy().double()
            calib = LossCalibrator(topo, reduction=reduction, engine_scale=scale,
                                   weight_dtype=torch.float64)
            loss = run_toy(calib, rank, _ddp_micro_step(DDP(model)))
            out[("toy", reduction)] = (float(loss), float(model.theta.grad))
    for dp, sp, gas in layouts:
        topo = make_groups(dp, sp)
        scale = probe_ddp(gas=gas, group=topo.dp_sp_group)
        out[("multiplier", dp, sp, gas)] = scale.loss_multiplier
        batches = make_step(dp, gas)
        for reduction in REDUCTIONS:
            model = TinyLM(torch.float64)
            calib = LossCalibrator(topo, reduction=reduction, engine_scale=scale,
                                   weight_dtype=torch.float64)
            loss, ntok = train_step(_ddp_micro_step(DDP(model)), batches[rank // sp], calib,
                                    torch.float64)
            out[(dp, sp, gas, reduction)] = (loss, ntok, model.head.weight.grad.clone())
    if bad_probe:
        # DDP reducing over the DP group only while the loss is spread over dp x sp: the SP
        # ranks' gradients are never summed; the probe must refuse it.
        topo = make_groups(world // 2, 2)
        try:
            probe_ddp(gas=2, group=topo.dp_sp_group, process_group=topo.dp_group)
            out["bad_probe"] = "accepted"
        except EngineScaleError as err:
            out["bad_probe"] = str(err)
        dist.barrier()
    return out


def _check(results, layouts, toy, world):
    if toy:
        for rank in range(world):
            assert results[rank]["toy_multiplier"] == 2.0  # DDP averages over its 2 ranks
            for reduction, want in TOY_EXPECTED.items():
                loss, grad = results[rank][("toy", reduction)]
                assert loss == pytest.approx(want, rel=1e-12), (reduction, rank)
                assert grad == pytest.approx(want, rel=1e-12), (reduction, rank)
    for dp, sp, gas in layouts:
        batches = make_step(dp, gas)
        want_tokens = sum(int((mb["labels"] != -100).sum()) for row in batches for mb in row)
        for reduction in REDUCTIONS:
            ref_loss, ref_grad = reference(batches, reduction)
            for rank in range(world):
                assert results[rank][("multiplier", dp, sp, gas)] == dp * sp
                loss, ntok, grad = results[rank][(dp, sp, gas, reduction)]
                where = f"dp={dp} sp={sp} gas={gas} {reduction} rank {rank}"
                torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-13, msg=where)
                torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-13, msg=where)
                assert float(ntok) == want_tokens, where


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world, layouts, toy, bad_probe", [
    (2, [(2, 1, 1), (2, 1, 2), (2, 1, 3), (1, 2, 1), (1, 2, 2), (1, 2, 3)], True, False),
    (3, [(3, 1, 1), (3, 1, 2), (3, 1, 3)], False, False),
    (4, [(2, 2, 2), (2, 2, 3)], False, True),
], ids=["world2", "world3", "world4"])
def test_ddp_matches_single_device(world, layouts, toy, bad_probe):
    results = run_distributed(_ddp_worker, world, layouts, toy, bad_probe, timeout=200)
    _check(results, layouts, toy, world)
    if bad_probe:
        for rank in range(world):
            assert "does not reduce over the whole dp x sp group" in results[rank]["bad_probe"]
