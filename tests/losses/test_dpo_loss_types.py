"""Every ``loss_type`` of megaloss.dpo_loss against TRL 1.16's own ``DPOTrainer._compute_loss``
(``trl/trainer/dpo_trainer.py``, called with a stand-in ``self`` and model that return the same
float64 tensors), on pairs with small and with large margins (the tails of the sigmoids, hinge's
clip and DiscoPOP's ``exp(-z)``); the global pair normalisation of a split batch; and the options
(``DPOOptions``, the ds_config ``"dpo"`` section) refusing bad values by name.

Tolerance: float64, values, gradients and metrics within 1e-12 (relative and absolute; the
formulas are TRL's, only the summation order differs). TRL's function runs under
``torch.set_default_dtype(torch.float64)``: its ``exo_pair`` builds
``torch.tensor(label_smoothing)`` in the default dtype, whose float32 ``log`` would differ by
~1e-8; and its ``rewards/accuracies`` is a float32 mean (``.float()``), compared as such.
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
from megaloss.integrations.deepspeed import load_megaloss_config
from megaloss.losses.dpo import DPO_LOSS_TYPES

P, T = 6, 7
TOL = 1e-12

# (loss_type, beta, label_smoothing, discopop_tau): each type at two betas, the smoothed ones
# at two label_smoothing values.
CASES = [
    ("sigmoid", 0.1, 0.0, 0.05), ("sigmoid", 1.0, 0.0, 0.05),
    ("hinge", 0.1, 0.0, 0.05), ("hinge", 0.5, 0.0, 0.05),
    ("ipo", 0.5, 0.0, 0.05), ("ipo", 2.0, 0.0, 0.05),
    ("exo_pair", 0.1, 2.0 ** -10, 0.05), ("exo_pair", 1.0, 0.25, 0.05),
    ("nca_pair", 0.1, 0.0, 0.05), ("nca_pair", 1.0, 0.0, 0.05),
    ("robust", 0.1, 0.125, 0.05), ("robust", 1.0, 0.0, 0.05), ("robust", 0.5, 0.375, 0.05),
    ("bco_pair", 0.1, 0.0, 0.05), ("bco_pair", 1.0, 0.0, 0.05),
    ("sppo_hard", 0.1, 0.0, 0.05), ("sppo_hard", 1.0, 0.0, 0.05),
    ("apo_zero", 0.1, 0.0, 0.05), ("apo_zero", 1.0, 0.0, 0.05),
    ("apo_down", 0.1, 0.0, 0.05), ("apo_down", 1.0, 0.0, 0.05),
    ("discopop", 0.1, 0.0, 0.05), ("discopop", 1.0, 0.0, 0.5),
    ("sigmoid_norm", 0.1, 0.0, 0.05), ("sigmoid_norm", 2.0, 0.0, 0.05),
    ("aot", 0.1, 0.0, 0.05), ("aot", 1.0, 0.2, 0.05),
    ("aot_unpaired", 0.1, 0.1, 0.05), ("aot_unpaired", 1.0, 0.0, 0.05),
]
SORTED = ("aot", "aot_unpaired")  # sorted over a call's pairs: defined per micro-batch


def test_every_loss_type_has_a_case():
    assert {c[0] for c in CASES} == set(DPO_LOSS_TYPES)


def _batch(seed, large):
    """Per-token log-probs ``[2P, T]`` (chosen rows, then rejected), sequence reference log-probs
    ``[2P]`` and the completion mask. ``large``: references spread so that the log-ratios reach
    +-60 (``|z|`` up to ~120 at beta 1), with pairs on both sides of hinge's ``z = 1``."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 2, 4, 1, 3, 5, 6, 2, 7, 3, 1, 4])
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    lp = -torch.rand(2 * P, T, generator=g, dtype=torch.float64) * 2
    seq = torch.where(mask != 0, lp, 0.0).sum(-1)
    if large:
        shift = torch.tensor([-60.0, 45.0, 0.5, -8.0, 30.0, 2.0,
                              50.0, -40.0, 0.2, 12.0, -30.0, 9.0], dtype=torch.float64)
        ref = seq - shift + torch.rand(2 * P, generator=g, dtype=torch.float64) * 0.1
    else:
        ref = -torch.rand(2 * P, generator=g, dtype=torch.float64) * 4
    return lp, ref, mask


def _trl(loss_type, beta, label_smoothing, discopop_tau, lp, ref, mask):
    from trl.trainer.dpo_trainer import DPOTrainer
    P = lp.shape[0] // 2  # noqa: N806 - the pairs of this call
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
        loss_types=[loss_type], loss_weights=[1.0], beta=beta, use_weighting=False,
        label_smoothing=label_smoothing, args=SimpleNamespace(discopop_tau=discopop_tau),
        _metrics={"train": collections.defaultdict(list)}, _total_train_tokens=0, _tp_size=1)
    inputs = {"input_ids": torch.zeros(2 * P, T + 1, dtype=torch.long),
              "attention_mask": torch.ones_like(unshifted), "completion_mask": unshifted,
              "ref_chosen_logps": ref[:P], "ref_rejected_logps": ref[P:]}
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        loss = DPOTrainer._compute_loss(fake, lambda **kw: outputs, inputs, False)
    finally:
        torch.set_default_dtype(default)
    return loss, {k: v[-1] for k, v in fake._metrics["train"].items()}


def _close(a, b):
    return abs(a - b) <= TOL + TOL * abs(b)


@pytest.mark.slow  # importing TRL's trainer (transformers, datasets, accelerate) takes ~7 s
@pytest.mark.parametrize("large", [False, True], ids=["small_margins", "large_margins"])
@pytest.mark.parametrize("loss_type,beta,label_smoothing,discopop_tau", CASES)
def test_matches_trl_compute_loss(loss_type, beta, label_smoothing, discopop_tau, large):
    opts = DPOOptions(loss_type=loss_type, beta=beta, label_smoothing=label_smoothing,
                      discopop_tau=discopop_tau)
    lp, ref, mask = _batch(3, large)
    ours, theirs = lp.clone().requires_grad_(), lp.clone().requires_grad_()
    seq = sequence_log_probs(ours, mask)
    n = mask.sum(-1)
    out = dpo_loss(seq[:P], seq[P:], ref[:P], ref[P:], chosen_lengths=n[:P],
                   rejected_lengths=n[P:], options=opts, return_stats=True)
    ref_loss, ref_metrics = _trl(loss_type, beta, label_smoothing, discopop_tau, theirs, ref,
                                 mask)
    assert torch.isfinite(ref_loss)
    assert _close(float(out.loss.detach()), float(ref_loss.detach())), (out.loss, ref_loss)
    out.loss.backward()
    ref_loss.backward()
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=TOL, atol=TOL)
    for name, value in dpo_metrics(out.stats, group=SINGLE_RANK).items():
        if name == "rewards/accuracies":  # TRL averages the 0/1 flags in float32 (.float())
            value = float(torch.tensor(value, dtype=torch.float32))
        assert _close(value, ref_metrics[name]), (name, value, ref_metrics[name])


def test_large_margins_reach_the_tails():
    """The large-margin batch does exercise the clipped / saturated regions."""
    lp, ref, mask = _batch(3, True)
    seq = torch.where(mask != 0, lp, 0.0).sum(-1)
    ratio = seq - ref
    z = 1.0 * (ratio[:P] - ratio[P:])
    assert (z > 40).any() and (z < -40).any() and ((z > -1) & (z < 1)).any()
    hinge = 0.5 * (ratio[:P] - ratio[P:])
    assert (hinge > 1).any() and (hinge < 1).any()  # hinge: clipped and active pairs


@pytest.mark.parametrize("loss_type,beta,label_smoothing,discopop_tau",
                         [c for c in CASES[1::2] if c[0] not in SORTED])
def test_micro_batches_sum_to_the_whole_batch(loss_type, beta, label_smoothing, discopop_tau):
    """Pairs split 2 / 0 (padding) / 4 over micro-batches, weighted by the step's global pair
    count: loss, gradient and metrics equal the single call on all pairs."""
    opts = DPOOptions(loss_type=loss_type, beta=beta, label_smoothing=label_smoothing,
                      discopop_tau=discopop_tau)
    lp, ref, mask = _batch(5, True)
    n = mask.sum(-1)
    whole = lp.clone().requires_grad_()
    seq = sequence_log_probs(whole, mask)
    expected = dpo_loss(seq[:P], seq[P:], ref[:P], ref[P:], chosen_lengths=n[:P],
                        rejected_lengths=n[P:], options=opts, return_stats=True)
    expected.loss.backward()

    split = lp.clone().requires_grad_()
    seq = sequence_log_probs(split, mask)
    pad = torch.zeros(2, dtype=torch.float64)
    parts = [(seq[:2], seq[P:P + 2], ref[:2], ref[P:P + 2], n[:2], n[P:P + 2], mask[:2]),
             (pad, pad, pad, pad, pad, pad, torch.zeros(2, T, dtype=torch.long)),
             (seq[2:P], seq[P + 2:], ref[2:P], ref[P + 2:], n[2:P], n[P + 2:], mask[2:P])]
    step = LossCalibrator(loss_reduction="sample", weight_dtype=torch.float64).begin_step(
        [completion_labels(p[-1]) for p in parts])
    total, stats = torch.zeros((), dtype=torch.float64), []
    for i, (c, r, rc, rr, nc, nr, _) in enumerate(parts):
        out = dpo_loss(c, r, rc, rr, chosen_lengths=nc, rejected_lengths=nr,
                       pair_weights=dpo_pair_weights(step, i), options=opts, return_stats=True)
        total = total + step.loss_for_backward(out.loss)
        stats.append(out.stats)
    total.backward()
    assert _close(float(step.global_loss()), float(expected.loss.detach()))
    torch.testing.assert_close(split.grad, whole.grad, rtol=TOL, atol=TOL)
    assert dpo_metrics(stats, group=SINGLE_RANK) == pytest.approx(
        dpo_metrics(expected.stats, group=SINGLE_RANK), rel=TOL, abs=TOL)


@pytest.mark.slow  # TRL's trainer import
@pytest.mark.parametrize("loss_type", SORTED)
def test_sorted_types_are_trls_loss_of_each_micro_batch(loss_type):
    """``aot`` / ``aot_unpaired`` sort over the pairs of one call, as TRL sorts over each
    process's micro-batch: split 2 / 4 and weighted by the step's pair count, each
    micro-batch's loss is TRL's loss of those pairs times their share of the step (values and
    gradients); a padding pair (weight 0) is left out of the sort; unequal weights over the
    counted pairs are refused."""
    opts = DPOOptions(loss_type=loss_type, beta=1.0, label_smoothing=0.1)
    lp, ref, mask = _batch(5, True)
    ours, theirs = lp.clone().requires_grad_(), lp.clone().requires_grad_()
    seq = sequence_log_probs(ours, mask)
    total, expected = 0.0, 0.0
    for part, share in ((slice(0, 2), 2 / P), (slice(2, P), (P - 2) / P)):
        rows = torch.cat([torch.arange(P)[part], P + torch.arange(P)[part]])
        k = rows.numel() // 2
        c, r = seq[:P][part], seq[P:][part]
        # a padding pair (weight 0) after the real ones: not in the sort
        pad = torch.zeros(1, dtype=torch.float64)
        out = dpo_loss(torch.cat([c, pad]), torch.cat([r, pad]),
                       torch.cat([ref[:P][part], pad]), torch.cat([ref[P:][part], pad]),
                       pair_weights=torch.cat([torch.full((k,), 1.0 / P, dtype=torch.float64),
                                               pad]), options=opts)
        total = total + out
        trl_loss, _ = _trl(loss_type, 1.0, 0.1, 0.05, theirs[rows], ref[rows], mask[rows])
        expected = expected + share * trl_loss
    assert _close(float(total.detach()), float(expected.detach())), (total, expected)
    total.backward()
    expected.backward()
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=TOL, atol=TOL)
    with pytest.raises(ValueError, match="pair_weights must be equal over the pairs that count"):
        dpo_loss(seq[:2], seq[P:P + 2], ref[:2], ref[P:P + 2], options=opts,
                 pair_weights=torch.tensor([0.1, 0.2], dtype=torch.float64))


def test_keywords_equal_options():
    x = torch.linspace(-3, 3, 4, dtype=torch.float64)
    y = torch.flip(x, [0])
    kw = dict(loss_type="robust", beta=0.3, label_smoothing=0.2)
    assert float(dpo_loss(x, y, y, x, **kw)) == float(
        dpo_loss(x, y, y, x, options=DPOOptions(**kw)))
    assert float(dpo_loss(x, y, y, x, loss_type="discopop", discopop_tau=0.2)) == float(
        dpo_loss(x, y, y, x, options=DPOOptions(loss_type="discopop", discopop_tau=0.2)))
    with pytest.raises(TypeError, match="label_smoothing"):
        dpo_loss(x, y, y, x, label_smoothing=0.1, options=DPOOptions())


@pytest.mark.parametrize("kwargs,match", [
    (dict(loss_type="sft"), "loss_type must be one of"),
    (dict(loss_type="exo_pair"), r"label_smoothing must be in \(0, 1\) for loss_type='exo_pair'"),
    (dict(loss_type="robust", label_smoothing=0.5),
     r"label_smoothing must be in \[0, 0.5\) for loss_type='robust'"),
    (dict(label_smoothing=-0.1), r"label_smoothing must be a float in \[0, 1\)"),
    (dict(label_smoothing=1.0), r"label_smoothing must be a float in \[0, 1\)"),
    (dict(label_smoothing=True), "label_smoothing must be a float"),
    (dict(label_smoothing="0.1"), "label_smoothing must be a float"),
    (dict(discopop_tau=0.0), "discopop_tau must be a finite number > 0"),
    (dict(discopop_tau=float("inf")), "discopop_tau must be a finite number > 0"),
    (dict(discopop_tau=float("nan")), "discopop_tau must be a finite number > 0"),
])
def test_bad_options_name_the_option(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DPOOptions(**kwargs)


def test_per_token_types_need_the_lengths():
    x = torch.zeros(3, dtype=torch.float64)
    for kind in ("ipo", "sigmoid_norm"):
        with pytest.raises(ValueError, match=f"chosen_lengths is required for loss_type='{kind}'"):
            dpo_loss(x, x, x, x, loss_type=kind)


def test_ds_config_section_accepts_the_new_options():
    for section in ({"loss_type": "exo_pair", "beta": 0.2, "label_smoothing": 1e-3},
                    {"loss_type": "robust", "label_smoothing": 0.1, "discopop_tau": 0.1},
                    {"loss_type": "discopop", "discopop_tau": 0.5}):
        ml = load_megaloss_config({"megaloss": {"dpo": section}})
        assert ml.dpo.options() == DPOOptions(**section)
    for kind in DPO_LOSS_TYPES:
        smoothing = 1e-3 if kind == "exo_pair" else 0.0
        ml = load_megaloss_config({"megaloss": {"dpo": {"loss_type": kind,
                                                        "label_smoothing": smoothing}}})
        assert ml.dpo.options().loss_type == kind


@pytest.mark.parametrize("section,match", [
    ({"loss_type": "exo_pair"}, r"megaloss\.dpo: label_smoothing must be in \(0, 1\)"),
    ({"loss_type": "robust", "label_smoothing": 0.5}, r"megaloss\.dpo: label_smoothing must be"),
    ({"label_smoothing": 1.0}, r"megaloss\.dpo\.label_smoothing: label_smoothing must be"),
    ({"discopop_tau": -1.0}, r"megaloss\.dpo\.discopop_tau: discopop_tau must be"),
    ({"loss_type": "sft"}, r"megaloss\.dpo\.loss_type: loss_type must be one of"),
])
def test_ds_config_refuses_bad_options_naming_them(section, match):
    with pytest.raises(ValueError, match=match):
        load_megaloss_config({"megaloss": {"dpo": section}})
