"""Calibration under real DeepSpeed engines (CPU, gloo, ZeRO 0-3, ``engine.backward`` and direct
``loss.backward``): the start-up probe (which reads the reduction group from the engine it
builds), the toy case, and gradients equal to the float64 single-device reference for a covering
set of DP x SP x GAS layouts and all three reductions; an explicit ``group`` that disagrees with
the engine's is refused on every rank.

The engine's DP group is WORLD; for the SP layouts (dp=1, sp=2) it therefore reduces over the
``dp x sp`` group, as DeepSpeed does with its sequence-data-parallel group. The model is fp32:
gradients are compared with rtol 1e-5, atol 1e-6.
"""
import pytest
import torch

from megaloss.testing import run_distributed
from tests.helpers.calibration_cases import (
    TOY_EXPECTED,
    TinyLM,
    Toy,
    make_groups,
    make_step,
    reference,
    run_toy,
    train_step,
)

pytestmark = [pytest.mark.distributed, pytest.mark.deepspeed, pytest.mark.slow,
              pytest.mark.deepspeed_pool]  # shared ranks: see conftest.py
REDUCTIONS = ("token", "sample", "square")

# (stage, backward, toy) and (stage, backward, dp, sp, gas): pairwise-covering, small.
# Extra ds_config options that change how DeepSpeed reduces: the probe must follow them.
SUM_OP = {"gradient_allreduce_op": "sum"}
PREDIVIDE = {"prescale_gradients": True, "gradient_predivide_factor": 2.0}
TOY_PATHS = [(0, "engine", {}), (1, "loss", {}), (2, "engine", {}), (2, "loss", {}),
             (3, "engine", {}), (3, "loss", {}), (1, "engine", SUM_OP), (0, "engine", PREDIVIDE)]
LAYOUTS_2 = [(0, "engine", 2, 1, 3), (0, "engine", 1, 2, 1), (1, "loss", 2, 1, 1),
             (1, "engine", 1, 2, 2), (2, "engine", 2, 1, 2), (2, "loss", 1, 2, 3),
             (3, "loss", 2, 1, 3), (3, "engine", 1, 2, 2)]
LAYOUTS_3 = [(1, "engine", 3, 1, 2), (2, "loss", 3, 1, 3), (3, "engine", 3, 1, 1)]


def _config(stage, gas, extra=None):
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": gas,
            "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
            "steps_per_print": 10 ** 9, **(extra or {})}


def _engine(module, stage, gas, extra=None):
    import deepspeed
    engine, *_ = deepspeed.initialize(model=module, config=_config(stage, gas, extra),
                                      optimizer=torch.optim.SGD(module.parameters(), lr=0.0))
    return engine


def _ds_micro_step(engine, backward, param, sink):
    from deepspeed.utils import safe_get_full_grad

    def micro_step(inputs, finalize, is_last):
        loss = finalize(engine(*inputs))
        engine.backward(loss) if backward == "engine" else loss.backward()
        if is_last:  # the reduced gradient exists between the boundary backward and step()
            sink.append(safe_get_full_grad(param).detach().clone())
        engine.step()
    return micro_step


def _ds_worker(rank, world, toy_paths, layouts):
    out = {}
    # DeepSpeed's CPU comm backend JIT-builds an optional shared-memory all-reduce op; skip it
    # so no C++ build runs in the tests (gloo does the same work).
    from megaloss.integrations.deepspeed.compat import skip_cpu_shm_comm_build
    skip_cpu_shm_comm_build()

    from megaloss import SINGLE_RANK, Topology
    from megaloss.calibration import LossCalibrator
    from megaloss.integrations.deepspeed import probe_deepspeed
    for k, (stage, backward, extra) in enumerate(toy_paths):
        topo = Topology.default()
        # Without zero_allow_untested_optimizer: the probe must allow its SGD on its own copy.
        probe_cfg = {key: v for key, v in _config(stage, 2, extra).items()
                     if key != "zero_allow_untested_optimizer"}
        # As the README writes it: no group; the probe takes the engine's.
        scale = probe_deepspeed(probe_cfg, backward=backward)
        out[("toy_multiplier", k)] = scale.loss_multiplier
        engine = _engine(Toy(), stage, 2, extra)
        for reduction in REDUCTIONS:
            calib = LossCalibrator(topo, loss_reduction=reduction, engine_scale=scale)
            grads = []
            loss = run_toy(calib, rank, _ds_micro_step(engine, backward, engine.module.theta,
                                                       grads), dtype=torch.float32)
            out[("toy", k, reduction)] = (float(loss), float(grads[0].sum()))
        engine.destroy()
    for stage, backward, dp, sp, gas in layouts:
        topo = make_groups(dp, sp)
        # An explicit group is only checked against the engine's reduction group.
        scale = probe_deepspeed(_config(stage, gas), group=topo.dp_sp_group, backward=backward)
        out[("multiplier", stage, dp, sp, gas)] = scale.loss_multiplier
        batches = make_step(dp, gas)
        engine = _engine(TinyLM(torch.float32), stage, gas)
        for reduction in REDUCTIONS:
            calib = LossCalibrator(topo, loss_reduction=reduction, engine_scale=scale)
            grads = []
            loss, ntok = train_step(_ds_micro_step(engine, backward, engine.module.head.weight,
                                                   grads),
                                    batches[rank // sp], calib, torch.float32)
            out[(stage, dp, sp, gas, reduction)] = (loss, ntok, grads[0].double())
        engine.destroy()
    if world == 2:
        try:
            probe_deepspeed(_config(2, 2), group=SINGLE_RANK)
            out["wrong_group"] = "accepted"
        except ValueError as err:
            out["wrong_group"] = str(err)
    return out


def _check(results, world, toy_paths, layouts):
    for rank in range(world):
        if world == 2:
            assert "engine reduces gradients over [0, 1]" in results[rank]["wrong_group"]
        for k, (stage, backward, extra) in enumerate(toy_paths):
            # DeepSpeed divides by GAS and averages over DP: c = 1 / (2 * 2); with the "sum"
            # all-reduce op it only divides by GAS.
            want_multiplier = 2.0 if extra == SUM_OP else 4.0
            assert results[rank][("toy_multiplier", k)] == want_multiplier, (stage, extra)
            for reduction, want in TOY_EXPECTED.items():
                loss, grad = results[rank][("toy", k, reduction)]
                where = f"toy zero{stage} {backward}.backward {extra} {reduction} rank {rank}"
                assert loss == pytest.approx(want, rel=1e-6), where
                assert grad == pytest.approx(want, rel=1e-6), where
    for stage, backward, dp, sp, gas in layouts:
        batches = make_step(dp, gas)
        for reduction in REDUCTIONS:
            ref_loss, ref_grad = reference(batches, reduction)
            for rank in range(world):
                assert results[rank][("multiplier", stage, dp, sp, gas)] == dp * sp * gas
                loss, ntok, grad = results[rank][(stage, dp, sp, gas, reduction)]
                where = f"zero{stage} {backward}.backward dp={dp} sp={sp} gas={gas} {reduction}"
                torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6, msg=where)
                torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6, msg=where)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world, toy_paths, layouts", [
    (2, TOY_PATHS, LAYOUTS_2),
    (3, [], LAYOUTS_3),
], ids=["world2", "world3"])
def test_deepspeed_matches_single_device(world, toy_paths, layouts):
    results = run_distributed(_ds_worker, world, toy_paths, layouts, timeout=360)
    _check(results, world, toy_paths, layouts)
