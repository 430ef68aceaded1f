"""megaloss.dpo_loss against TRL 1.16's own ``DPOTrainer._compute_loss``
(``trl/trainer/dpo_trainer.py``) on the same float64 tensors (a stand-in model returns them), and
the global pair normalisation of a batch split into micro-batches.

Tolerance: float64, values, gradients and metrics within 1e-12 (summation order only).
"""
import collections
from types import SimpleNamespace

import pytest
import torch

from megaloss import (
    SINGLE_RANK,
    DPOOptions,
    LossCalibrator,
    completion_labels,
    dpo_loss,
    dpo_metrics,
    dpo_pair_weights,
    sequence_log_probs,
)

P, T = 4, 6
TOL = 1e-12


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([6, 2, 4, 1, 3, 5, 6, 2])  # chosen rows, then rejected rows
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    lp = -torch.rand(2 * P, T, generator=g, dtype=torch.float64) * 2
    ref = -torch.rand(2 * P, generator=g, dtype=torch.float64) * 4
    return lp, ref, mask


def _trl(opts, lp, ref, mask):
    from trl.trainer.dpo_trainer import DPOTrainer
    # TRL's completion_mask is on the unshifted ids: a prompt token (0) first, then ours.
    unshifted = torch.cat([torch.zeros(2 * P, 1, dtype=torch.long), mask], 1)
    masked = torch.where(mask != 0, lp, 0.0)
    outputs = SimpleNamespace(log_probs=masked, entropy=torch.zeros(2 * P, T),
                              mean_logits=torch.zeros(2 * P, T),
                              is_top1=torch.zeros(2 * P, T, dtype=torch.bool))
    acc = SimpleNamespace(device="cpu", gather=lambda x: x, gather_for_metrics=lambda x: x)
    fake = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=acc, aux_loss_enabled=False,
        ld_alpha=None, precompute_ref_logps=True, f_divergence_type="reverse_kl",
        loss_types=[opts.loss_type], loss_weights=[1.0], beta=opts.beta, use_weighting=False,
        _metrics={"train": collections.defaultdict(list)}, _total_train_tokens=0, _tp_size=1)
    inputs = {"input_ids": torch.zeros(2 * P, T + 1, dtype=torch.long),
              "attention_mask": torch.ones_like(unshifted), "completion_mask": unshifted,
              "ref_chosen_logps": ref[:P], "ref_rejected_logps": ref[P:]}
    loss = DPOTrainer._compute_loss(fake, lambda **kw: outputs, inputs, False)
    return loss, {k: v[-1] for k, v in fake._metrics["train"].items()}


@pytest.mark.slow  # importing TRL's trainer (transformers, datasets, accelerate) takes ~7 s
@pytest.mark.parametrize("loss_type,beta", [("sigmoid", 0.1), ("sigmoid", 2.0), ("ipo", 0.5)])
def test_matches_trl_compute_loss(loss_type, beta):
    opts = DPOOptions(loss_type=loss_type, beta=beta)
    lp, ref, mask = _batch()
    ours, theirs = lp.clone().requires_grad_(), lp.clone().requires_grad_()
    seq = sequence_log_probs(ours, mask)
    n = mask.sum(-1)
    out = dpo_loss(seq[:P], seq[P:], ref[:P], ref[P:], chosen_lengths=n[:P],
                   rejected_lengths=n[P:], options=opts, return_stats=True)
    ref_loss, ref_metrics = _trl(opts, theirs, ref, mask)
    assert abs(float(out.loss.detach()) - float(ref_loss.detach())) <= TOL
    out.loss.backward()
    ref_loss.backward()
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=TOL, atol=TOL)
    for name, value in dpo_metrics(out.stats, group=SINGLE_RANK).items():
        assert abs(value - ref_metrics[name]) <= TOL, (name, value, ref_metrics[name])


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_micro_batches_sum_to_the_whole_batch(loss_type):
    """Pairs split 1 / 0 (padding) / 3 over micro-batches, weighted by the step's global pair
    count: loss, gradient and metrics equal the single call on all pairs."""
    opts = DPOOptions(loss_type=loss_type, beta=0.3)
    lp, ref, mask = _batch(1)
    n = mask.sum(-1)
    whole = lp.clone().requires_grad_()
    seq = sequence_log_probs(whole, mask)
    expected = dpo_loss(seq[:P], seq[P:], ref[:P], ref[P:], chosen_lengths=n[:P],
                        rejected_lengths=n[P:], options=opts, return_stats=True)
    expected.loss.backward()

    split = lp.clone().requires_grad_()
    seq = sequence_log_probs(split, mask)
    pad = torch.zeros(2, dtype=torch.float64)
    parts = [(seq[:1], seq[P:P + 1], ref[:1], ref[P:P + 1], n[:1], n[P:P + 1], mask[:1]),
             (pad, pad, pad, pad, pad, pad, torch.zeros(2, T, dtype=torch.long)),
             (seq[1:P], seq[P + 1:], ref[1:P], ref[P + 1:], n[1:P], n[P + 1:], mask[1:P])]
    step = LossCalibrator(loss_reduction="sample", weight_dtype=torch.float64).begin_step(
        [completion_labels(p[-1]) for p in parts])
    total, stats = torch.zeros((), dtype=torch.float64), []
    for i, (c, r, rc, rr, nc, nr, _) in enumerate(parts):
        out = dpo_loss(c, r, rc, rr, chosen_lengths=nc, rejected_lengths=nr,
                       pair_weights=dpo_pair_weights(step, i), options=opts, return_stats=True)
        total = total + step.loss_for_backward(out.loss)
        stats.append(out.stats)
    total.backward()
    assert abs(float(step.global_loss()) - float(expected.loss.detach())) <= TOL
    torch.testing.assert_close(split.grad, whole.grad, rtol=TOL, atol=TOL)
    assert dpo_metrics(stats, group=SINGLE_RANK) == pytest.approx(
        dpo_metrics(expected.stats, group=SINGLE_RANK), rel=TOL, abs=TOL)


def test_bad_inputs_name_the_argument():
    x = torch.zeros(3, dtype=torch.float64)
    with pytest.raises(ValueError, match="chosen_lengths is required"):
        dpo_loss(x, x, x, x, loss_type="ipo", return_stats=True)
    with pytest.raises(ValueError, match="rejected_log_probs must have shape"):
        dpo_loss(x, x[:2], x, x, return_stats=True)
    with pytest.raises(ValueError, match="beta must be"):
        DPOOptions(beta=0.0)
    with pytest.raises(ValueError, match="loss_type must be one of"):
        DPOOptions(loss_type="sft")  # a token-level NLL: megaloss.linear_cross_entropy
