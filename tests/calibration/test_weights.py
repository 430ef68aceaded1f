"""Checks of megaloss.calibration.weights (single-process, and sample counting under SP = 2 on
the shared gloo ranks) and the probe's decision logic."""
import math

import pytest
import torch

from megaloss import SINGLE_RANK
from megaloss.calibration import EngineScaleError, LossCalibrator
from megaloss.calibration.engine_scale import measure_grad_scale
from megaloss.calibration.weights import (
    compute_loss_weights,
    sample_ids_from_boundaries,
    split_for_sequence_parallel,
)

IGNORE = -100


def _weighted(lw, values):
    return sum(float((w.double() * v).sum()) for w, v in zip(lw.weights, values))


def test_definitions_by_hand():
    # two samples in one packed row: [a a a | b] with one ignored token in a; plus a row sample c
    labels = [torch.tensor([[1, IGNORE, 2, 3]]), torch.tensor([[4, 4]])]
    cu = [torch.tensor([0, 3, 4]), None]
    losses = [torch.tensor([[1.0, 100.0, 3.0, 5.0]]), torch.tensor([[2.0, 4.0]])]
    # n_a = 2 (1, 3), n_b = 1 (5), n_c = 2 (2, 4)
    cases = {"token": (1 + 3 + 5 + 2 + 4) / 5,
             "sample": ((1 + 3) / 2 + 5 + (2 + 4) / 2) / 3,
             "square": ((1 + 3) / math.sqrt(2) + 5 + (2 + 4) / math.sqrt(2))
             / (math.sqrt(2) + 1 + math.sqrt(2))}
    for reduction, want in cases.items():
        lw = compute_loss_weights(labels, reduction, cu_seqlens=cu, dtype=torch.float64)
        assert _weighted(lw, losses) == pytest.approx(want, rel=1e-12)
        assert float(lw.num_tokens) == 5 and float(lw.num_samples) == pytest.approx(3)
        assert float(lw.weights[0][0, 1]) == 0.0  # ignored token


def test_sample_reduction_is_packing_invariant():
    """Same samples, packed into one row (cu_seqlens or position_ids) or one row each: same
    loss for `sample` and `square`, and the same weight for every token."""
    g = torch.Generator().manual_seed(3)
    lengths = [3, 1, 5, 2]
    samples = [torch.randint(0, 9, (n,), generator=g) for n in lengths]
    samples[2][[0, 3]] = IGNORE
    values = [torch.rand(n, generator=g, dtype=torch.float64) for n in lengths]
    packed_labels = torch.cat(samples).reshape(1, -1)
    packed_values = torch.cat(values).reshape(1, -1)
    cu = torch.tensor([0, 3, 4, 9, 11])
    pos = torch.cat([torch.arange(n) for n in lengths]).reshape(1, -1)
    width = max(lengths)
    rows = torch.full((len(lengths), width), IGNORE)
    row_values = torch.zeros(len(lengths), width, dtype=torch.float64)
    for k, (y, v) in enumerate(zip(samples, values)):
        rows[k, :len(y)], row_values[k, :len(v)] = y, v
    for reduction in ("token", "sample", "square"):
        a = compute_loss_weights([packed_labels], reduction, cu_seqlens=[cu], dtype=torch.float64)
        b = compute_loss_weights([packed_labels], reduction, position_ids=[pos],
                                 dtype=torch.float64)
        c = compute_loss_weights([rows], reduction, dtype=torch.float64)
        # the same step split into 2 micro-batches of 2 samples each
        d = compute_loss_weights([rows[:2], rows[2:]], reduction, dtype=torch.float64)
        want = _weighted(c, [row_values])
        assert _weighted(a, [packed_values]) == pytest.approx(want, rel=1e-12)
        assert _weighted(b, [packed_values]) == pytest.approx(want, rel=1e-12)
        assert _weighted(d, [row_values[:2], row_values[2:]]) == pytest.approx(want, rel=1e-12)
        torch.testing.assert_close(a.weights[0], b.weights[0], rtol=0, atol=0)
        unpacked = torch.cat([c.weights[0][k, :n] for k, n in enumerate(lengths)])
        torch.testing.assert_close(a.weights[0].reshape(-1), unpacked, rtol=1e-15, atol=0)
    # and packing *does* matter when the samples are not marked: the test can fail
    e = compute_loss_weights([packed_labels], "sample", dtype=torch.float64)
    assert _weighted(e, [packed_values]) != pytest.approx(_weighted(c, [row_values]), rel=1e-6)


def test_no_valid_token_gives_zero_weights_not_nan():
    labels = [torch.full((2, 3), IGNORE), torch.full((1, 0), IGNORE, dtype=torch.long)]
    for reduction in ("token", "sample", "square"):
        lw = compute_loss_weights(labels, reduction)
        assert all(torch.equal(w, torch.zeros_like(w, dtype=torch.float32)) for w in lw.weights)
        assert float(lw.denominator) == 0 and float(lw.num_tokens) == 0
        step = LossCalibrator(loss_reduction=reduction).begin_step(labels)
        loss = step.loss_for_backward((step.weights(0) * torch.rand(2, 3)).sum())
        assert float(loss) == 0.0 and float(step.global_loss()) == 0.0


def test_count_empty_samples_by_hand():
    """count_empty_samples: samples whose tokens are all ignored count in num_samples and in
    the "sample" denominator, as rows, cu_seqlens or position_ids mark them; "token" and
    "square" unchanged."""
    rows = torch.tensor([[1, 2, IGNORE], [IGNORE, IGNORE, IGNORE], [3, IGNORE, IGNORE]])
    values = torch.tensor([[1.0, 3.0, 100.0], [100.0, 100.0, 100.0], [5.0, 100.0, 100.0]],
                          dtype=torch.float64)
    packed, packed_values = rows.reshape(1, -1), values.reshape(1, -1)
    marks = [dict(), dict(cu_seqlens=[torch.tensor([0, 3, 6, 9])]),
             dict(position_ids=[torch.arange(3).repeat(3).reshape(1, -1)])]
    want = {"token": (1 + 3 + 5) / 3, "sample": ((1 + 3) / 2 + 5) / 3,
            "square": ((1 + 3) / math.sqrt(2) + 5) / (math.sqrt(2) + 1)}
    for kwargs in marks:
        labels, vals = ([rows], [values]) if not kwargs else ([packed], [packed_values])
        for reduction, expected in want.items():
            lw = compute_loss_weights(labels, reduction, dtype=torch.float64,
                                      count_empty_samples=True, **kwargs)
            assert _weighted(lw, vals) == pytest.approx(expected, rel=1e-12), (kwargs, reduction)
            assert float(lw.num_samples) == 3 and float(lw.num_tokens) == 3
            plain = compute_loss_weights(labels, reduction, dtype=torch.float64, **kwargs)
            assert float(plain.num_samples) == pytest.approx(2)
    # a micro-batch of empty rows adds its rows; the calibrator passes the option on
    step = LossCalibrator(loss_reduction="sample", weight_dtype=torch.float64,
                          count_empty_samples=True).begin_step([rows, torch.full((2, 3), IGNORE)])
    assert float(step.num_samples) == 5 and step.count_empty_samples
    with pytest.raises(TypeError, match="count_empty_samples must be a bool"):
        LossCalibrator(count_empty_samples=1)


def _sp_count_worker(rank, world):
    """SP = world: every rank holds the full labels and counts its slice's tokens; the samples
    are counted once."""
    rows = torch.tensor([[1, 2, 3, 4], [IGNORE] * 4, [IGNORE, IGNORE, 5, IGNORE]])
    lw = compute_loss_weights([rows], "sample", group=None, sp_group=None,
                              dtype=torch.float64, count_empty_samples=True)
    return float(lw.num_samples), float(lw.denominator), lw.weights[0]


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_count_empty_samples_under_sequence_parallelism():
    from megaloss.testing import run_distributed
    results = run_distributed(_sp_count_worker, 2, timeout=100)
    pieces = torch.cat([w for _, _, w in results], -1)
    for num_samples, denominator, _ in results:
        assert num_samples == 3 and denominator == 3
    want = torch.tensor([[0.25, 0.25, 0.25, 0.25], [0, 0, 0, 0], [0, 0, 1, 0]],
                        dtype=torch.float64) / 3
    torch.testing.assert_close(pieces, want, rtol=1e-15, atol=0)


def test_sequence_parallel_slices_count_whole_samples():
    """Sum over SP slices (simulated: sp_group None but the slice function applied per rank)
    of the weights equals the unsplit weights, padding included."""
    labels = torch.tensor([[1, 2, IGNORE, 3, 4, 5, 6]])
    cu = torch.tensor([0, 2, 7])
    full = compute_loss_weights([labels], "sample", cu_seqlens=[cu], dtype=torch.float64)
    pieces = [split_for_sequence_parallel(full.weights[0], r, 2, 0.0) for r in range(2)]
    torch.testing.assert_close(torch.cat(pieces, -1)[..., :7], full.weights[0])
    assert pieces[1].shape == (1, 4) and float(pieces[1][0, -1]) == 0.0
    # the second sample (4 valid tokens: 3, 4, 5, 6) spans both slices and weighs 1/4 each
    torch.testing.assert_close(full.weights[0][0, 3:], torch.full((4,), 0.25 / 2,
                                                                  dtype=torch.float64))


def test_sample_ids():
    y = torch.zeros(2, 4, dtype=torch.long)
    assert sample_ids_from_boundaries(y).tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    pos = torch.tensor([[0, 1, 0, 1], [5, 6, 0, 1]])  # a row start always starts a sample
    assert sample_ids_from_boundaries(y, position_ids=pos).tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    cu = torch.tensor([0, 1, 1, 8])  # an empty sample is allowed
    assert sample_ids_from_boundaries(y, cu_seqlens=cu).tolist() == [0, 2, 2, 2, 2, 2, 2, 2]


@pytest.mark.parametrize("kwargs, err, match", [
    (dict(loss_reduction="mean"), ValueError, "loss_reduction"),
    (dict(labels=[]), ValueError, "at least one"),
    (dict(labels=[torch.zeros(3)]), TypeError, r"labels\[0\]"),
    (dict(cu_seqlens=[torch.tensor([0, 2])]), ValueError, "cu_seqlens"),
    (dict(cu_seqlens=[None, None]), ValueError, "one entry per micro-batch"),
    (dict(position_ids=[torch.zeros(2, 2)]), ValueError, "position_ids"),
    (dict(dtype=torch.long), TypeError, "dtype"),
    (dict(count_empty_samples=1), TypeError, "count_empty_samples"),
])
def test_bad_arguments(kwargs, err, match):
    args = dict(labels=[torch.zeros(1, 4, dtype=torch.long)], loss_reduction="token")
    args.update(kwargs)
    with pytest.raises(err, match=match):
        compute_loss_weights(args.pop("labels"), args.pop("loss_reduction"), **args)


def test_calibrator_arguments():
    with pytest.raises(ValueError, match="loss_reduction"):
        LossCalibrator(loss_reduction="avg")
    with pytest.raises(TypeError, match="engine_scale"):
        LossCalibrator(engine_scale=2.0)
    step = LossCalibrator().begin_step([torch.zeros(3, dtype=torch.long)])
    with pytest.raises(ValueError, match="scalar"):
        step.loss_for_backward(torch.zeros(3))
    with pytest.raises(IndexError):
        step.weights(1)


@pytest.mark.parametrize("factor, ok", [(1.0, True), (0.25, True), (3.0, True),
                                        (1 / 2.5, False), (-0.5, False), (math.nan, False)])
def test_probe_accepts_only_compensable_scales(factor, ok):
    def run(coeffs):
        return torch.full((4,), factor * sum(coeffs), dtype=torch.float64)

    if ok:
        scale = measure_grad_scale(run, group=SINGLE_RANK, gas=2, engine="fake")
        assert scale.gradient_factor == factor and scale.loss_multiplier == 1 / factor
    else:
        with pytest.raises(EngineScaleError, match="fake"):
            measure_grad_scale(run, group=SINGLE_RANK, gas=2, engine="fake")


def test_probe_rejects_uneven_elements():
    with pytest.raises(EngineScaleError, match="differs"):
        measure_grad_scale(lambda c: torch.tensor([sum(c), 2 * sum(c)]), group=SINGLE_RANK, gas=1,
                           engine="fake")
