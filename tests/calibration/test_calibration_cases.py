"""Calibration with no engine (one process): the float64 single-device reference, the toy case
as four micro-batches, and the weights through megaloss's chunked CE."""
import pytest
import torch

from tests.helpers.calibration_cases import (
    IGNORE,
    TOY_EXPECTED,
    TinyLM,
    Toy,
    init_weight,
    make_step,
    plain_micro_step,
    reference,
    toy_batches,
    train_step,
)


@pytest.mark.parametrize("gas", [1, 2, 3])
@pytest.mark.parametrize("reduction", ["token", "sample", "square"])
def test_no_engine_matches_reference(gas, reduction):
    from megaloss.calibration import LossCalibrator
    from megaloss.calibration.engine_scale import probe_no_engine
    batches = make_step(1, gas)
    model = TinyLM(torch.float64)
    calib = LossCalibrator(loss_reduction=reduction, engine_scale=probe_no_engine(gas=gas),
                           weight_dtype=torch.float64)
    loss, ntok = train_step(plain_micro_step(model), batches[0], calib, torch.float64)
    ref_loss, ref_grad = reference(batches, reduction)
    torch.testing.assert_close(model.head.weight.grad, ref_grad, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-14)
    want_tokens = sum(int((mb["labels"] != IGNORE).sum()) for mb in batches[0])
    assert float(ntok) == want_tokens


def test_toy_case_single_process_as_four_micro_batches():
    """The toy step seen by one device: 4 micro-batches, no engine."""
    from megaloss.calibration import LossCalibrator
    coeffs = [a for row in toy_batches() for a in row]
    for reduction, want in TOY_EXPECTED.items():
        toy = Toy().double()
        calib = LossCalibrator(loss_reduction=reduction, weight_dtype=torch.float64)
        step = calib.begin_step([torch.zeros(len(a), dtype=torch.long) for a in coeffs])
        for i, a in enumerate(coeffs):
            step.loss_for_backward(toy(a.double(), step.weights(i))).backward()
        assert float(step.global_loss()) == pytest.approx(want, rel=1e-12)
        assert float(toy.theta.grad) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("reduction", ["token", "sample", "square"])
def test_weights_feed_linear_cross_entropy(reduction):
    """The calibrated weights through megaloss's chunked CE (reduction="sum", loss_weights=w)
    give the reference loss and gradient (one process, 3 micro-batches, float64)."""
    from megaloss import linear_cross_entropy
    from megaloss.calibration import LossCalibrator
    batches = make_step(1, 3)
    weight = init_weight().requires_grad_(True)
    step = LossCalibrator(loss_reduction=reduction, weight_dtype=torch.float64).begin_step(
        [mb["labels"] for mb in batches[0]], cu_seqlens=[mb["cu_seqlens"] for mb in batches[0]],
        position_ids=[mb["position_ids"] for mb in batches[0]])
    for i, mb in enumerate(batches[0]):
        local = linear_cross_entropy(mb["x"], weight, step.local_labels(i), reduction="sum",
                                     loss_weights=step.weights(i), chunk_size=3,
                                     accum_dtype=torch.float64)
        step.loss_for_backward(local).backward()
    ref_loss, ref_grad = reference(batches, reduction)
    torch.testing.assert_close(step.global_loss(), ref_loss, rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(weight.grad, ref_grad, rtol=1e-10, atol=1e-13)
