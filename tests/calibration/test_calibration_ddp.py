"""Calibration under torch DDP on real gloo processes: the toy case (with and without
compensation), a probe or calibrator refusing an engine that reduces over other ranks than the
calibration's dp x sp group, TP replicas not counted twice (DP=2 x TP=2), and gradients
equal to a float64 single-device reference for DP in {1, 2, 3} x SP in {1, 2} x GAS in {1, 2, 3}
(a covering set: every (DP, GAS) and (SP, GAS) pair; DP=3 x SP=2 would need 6 processes), with
uneven valid tokens, an all-ignored micro-batch, rows, cu_seqlens- and position_ids-packed samples,
and all three reductions. Everything is float64: tolerances are 1e-10 relative.
"""
import contextlib

import pytest
import torch

from megaloss.testing import run_distributed
from tests.helpers.calibration_cases import (
    TOY_EXPECTED,
    TinyLM,
    Toy,
    make_groups,
    make_step,
    make_tp_groups,
    reference,
    run_toy,
    train_step,
)

pytestmark = [pytest.mark.distributed]
REDUCTIONS = ("token", "sample", "square")


def _ddp_micro_step(ddp):
    def micro_step(inputs, finalize, is_last):
        # DDP accumulates locally under no_sync and averages at the last micro-batch.
        with contextlib.nullcontext() if is_last else ddp.no_sync():
            finalize(ddp(*inputs)).backward()
    return micro_step


def ddp_part(rank, world, layouts, toy, bad_probe=False, tp_layouts=()):
    """This rank's DDP results (a dict) for the toy case and ``layouts`` ``(dp, sp, gas)``.
    Also called inside the DeepSpeed test's processes, to share their start-up cost."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from megaloss import SINGLE_RANK, Topology
    from megaloss.calibration import EngineScale, EngineScaleError, LossCalibrator, probe_ddp
    from megaloss.calibration.engine_scale import measure_grad_scale
    out = {}
    if toy:
        topo = Topology.default()
        scale = probe_ddp(gas=2)  # DDP over the default group, as DDP(model) below
        out["toy_multiplier"] = scale.loss_multiplier
        for reduction in REDUCTIONS:
            model = Toy().double()
            calib = LossCalibrator(topo, loss_reduction=reduction, engine_scale=scale,
                                   weight_dtype=torch.float64)
            loss = run_toy(calib, rank, _ddp_micro_step(DDP(model)))
            out[("toy", reduction)] = (float(loss), float(model.theta.grad))
        # Without compensation (a factor of 1 over the world's ranks) DDP's average leaves the
        # token loss's gradient 2x too small (8/12 instead of 8/6): the check below can fail.
        model = Toy().double()
        calib = LossCalibrator(topo, engine_scale=EngineScale(
            "none", 1.0, 1.0, 2, world, 1.0, tuple(range(world))), weight_dtype=torch.float64)
        run_toy(calib, rank, _ddp_micro_step(DDP(model)))
        out["toy_uncompensated"] = float(model.theta.grad)
        # The engine reduces over 2 ranks, the probe is told "no group": the rank-distinct
        # coefficients must expose it (every rank ran the same coefficients before).
        def summed_over_world(coeffs):
            g = torch.full((4,), sum(coeffs), dtype=torch.float64)
            dist.all_reduce(g)
            return g / world
        try:
            measure_grad_scale(summed_over_world, group=SINGLE_RANK, gas=2, engine="fake-ddp")
            out["wrong_group_probe"] = "accepted"
        except EngineScaleError as err:
            out["wrong_group_probe"] = str(err)
        # A scale measured over one rank while the topology spreads the loss over the world.
        try:
            LossCalibrator(topo, engine_scale=EngineScale.identity())
            out["wrong_group_calibrator"] = "accepted"
        except ValueError as err:
            out["wrong_group_calibrator"] = str(err)
    for dp, sp, gas in layouts:
        topo = make_groups(dp, sp)
        scale = probe_ddp(gas=gas)  # DDP below runs over the default group = dp x sp
        out[("multiplier", dp, sp, gas)] = scale.loss_multiplier
        batches = make_step(dp, gas)
        for reduction in REDUCTIONS:
            model = TinyLM(torch.float64)
            calib = LossCalibrator(topo, loss_reduction=reduction, engine_scale=scale,
                                   weight_dtype=torch.float64)
            loss, ntok = train_step(_ddp_micro_step(DDP(model)), batches[rank // sp], calib,
                                    torch.float64)
            out[(dp, sp, gas, reduction)] = (loss, ntok, model.head.weight.grad.clone())
    for dp, tp, gas in tp_layouts:
        # TP replicas (here: the same replicated head) hold the same tokens: DDP and the
        # calibration run over the DP group only, and nothing may be counted twice.
        topo = make_tp_groups(dp, tp)
        scale = probe_ddp(gas=gas, process_group=topo.dp_group)
        batches = make_step(dp, gas)
        for reduction in REDUCTIONS:
            model = TinyLM(torch.float64)
            calib = LossCalibrator(topo, loss_reduction=reduction, engine_scale=scale,
                                   weight_dtype=torch.float64)
            ddp = DDP(model, process_group=topo.dp_group)
            loss, ntok = train_step(_ddp_micro_step(ddp), batches[rank // tp], calib,
                                    torch.float64)
            out[("tp", dp, tp, gas, reduction)] = (loss, ntok, model.head.weight.grad.clone())
    if bad_probe:
        # DDP reducing over the DP group only while the loss is spread over dp x sp: the SP
        # ranks' gradients are never summed; the calibrator must refuse that engine's scale.
        topo = make_groups(world // 2, 2)
        scale = probe_ddp(gas=2, process_group=topo.dp_group)
        try:
            LossCalibrator(topo, engine_scale=scale)
            out["bad_probe"] = "accepted"
        except ValueError as err:
            out["bad_probe"] = str(err)
        dist.barrier()
    return out


def _ddp_worker(rank, world, layouts, toy, bad_probe, tp_layouts):
    return ddp_part(rank, world, layouts, toy, bad_probe, tp_layouts)


def check_ddp(results, layouts, toy, world, tp_layouts=()):
    """Compare ``ddp_part``'s results of every rank with the float64 reference."""
    if toy:
        for rank in range(world):
            assert results[rank]["toy_multiplier"] == 2.0  # DDP averages over its 2 ranks
            assert results[rank]["toy_uncompensated"] == pytest.approx(8.0 / 12.0, rel=1e-12)
            assert "differs across ranks" in results[rank]["wrong_group_probe"]
            assert "topology's dp x sp group has" in results[rank]["wrong_group_calibrator"]
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
    for dp, tp, gas in tp_layouts:
        batches = make_step(dp, gas)
        want_tokens = sum(int((mb["labels"] != -100).sum()) for row in batches for mb in row)
        for reduction in REDUCTIONS:
            ref_loss, ref_grad = reference(batches, reduction)
            for rank in range(world):
                loss, ntok, grad = results[rank][("tp", dp, tp, gas, reduction)]
                where = f"dp={dp} tp={tp} gas={gas} {reduction} rank {rank}"
                torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-13, msg=where)
                torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-13, msg=where)
                assert float(ntok) == want_tokens, where


DDP_LAYOUTS = {2: [(2, 1, 1), (2, 1, 2), (2, 1, 3), (1, 2, 1), (1, 2, 2), (1, 2, 3)],
               3: [(3, 1, 1), (3, 1, 2), (3, 1, 3)],
               4: [(2, 2, 2), (2, 2, 3)]}


@pytest.mark.timeout(240)
def test_ddp_toy_and_world2_layouts():
    results = run_distributed(_ddp_worker, 2, DDP_LAYOUTS[2], True, False, (), timeout=200)
    check_ddp(results, DDP_LAYOUTS[2], True, 2)


@pytest.mark.timeout(240)
def test_ddp_world3_layouts():
    results = run_distributed(_ddp_worker, 3, DDP_LAYOUTS[3], False, False, (), timeout=200)
    check_ddp(results, DDP_LAYOUTS[3], False, 3)


@pytest.mark.timeout(240)
def test_ddp_dp2_x_sp2_dp2_x_tp2_and_probe_refuses_partial_reduction():
    world, tp_layouts = 4, [(2, 2, 2)]
    results = run_distributed(_ddp_worker, world, DDP_LAYOUTS[4], False, True, tp_layouts,
                              timeout=200)
    check_ddp(results, DDP_LAYOUTS[4], False, world, tp_layouts)
    for rank in range(world):
        assert "pass process_group=topology.dp_sp_group" in results[rank]["bad_probe"]
