"""megaloss.policy_loss against TRL 1.16's own ``GRPOTrainer._compute_loss``
(``trl/trainer/grpo_trainer.py``), called on the same float64 tensors through a stand-in trainer
whose ``_get_per_token_logps_and_entropies`` returns them; and the global normalisation of a batch
split into micro-batches.

Rows without any completion token (TRL's ``mask_truncated_completions`` empties them): with
``count_empty_rows=True`` megaloss equals TRL, which counts them in its ``grpo`` row mean and
``dr_grpo`` ``B x max_completion_length``; with the default ``False`` it equals TRL on the rows
that hold a completion token.

Tolerances: float64 throughout, values and gradients within 1e-12 (relative, summation order
only); metrics within 1e-12.
"""
from types import SimpleNamespace

import pytest
import torch

from megaloss import (
    SINGLE_RANK,
    PolicyLossOptions,
    completion_labels,
    policy_calibrator,
    policy_loss,
    policy_loss_weights,
    policy_metrics,
)

B, T = 6, 7
TOL = 1e-12


def _batch(seed=0, lengths=(7, 3, 1, 5, 6, 2)):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths)
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    lp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = lp + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)  # ratios get clipped
    ref = lp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ent = torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    return lp, old, ref, ent, adv, mask


class _Accelerator:
    num_processes, sync_gradients = 1, True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x


def _trl_loss(opts, lp, old, ref, ent, adv, mask):
    """TRL's own _compute_loss on these tensors; returns (loss, metrics)."""
    from trl.trainer.grpo_trainer import GRPOTrainer
    args = SimpleNamespace(use_bias_correction_kl=False, delta=opts.delta, steps_per_generation=1)
    fake = SimpleNamespace(
        top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level=opts.importance_sampling_level, beta=opts.beta, args=args,
        loss_type=opts.loss_type, epsilon_low=opts.epsilon_low, epsilon_high=opts.epsilon_high,
        use_vllm=False, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, accelerator=_Accelerator(),
        max_completion_length=opts.max_completion_length,
        _entropy_bonus_enabled=opts.entropy_coef != 0, entropy_coef=opts.entropy_coef,
        use_adaptive_entropy=False, aux_loss_enabled=False,
        _metrics={"train": __import__("collections").defaultdict(list)},
        _get_per_token_logps_and_entropies=lambda *a, **k: (lp, ent, None))
    rows = mask.shape[0]
    inputs = {"prompt_ids": torch.zeros(rows, 1, dtype=torch.long),
              "prompt_mask": torch.ones(rows, 1, dtype=torch.long),
              "completion_ids": torch.zeros(rows, T, dtype=torch.long), "completion_mask": mask,
              "advantages": adv, "old_per_token_logps": old, "ref_per_token_logps": ref,
              "num_items_in_batch": mask.sum().double()}
    loss = GRPOTrainer._compute_loss(fake, None, inputs)
    return loss, {k: v[-1] for k, v in fake._metrics["train"].items()}


CASES = [
    dict(loss_type="grpo"),
    dict(loss_type="grpo", beta=0.04, entropy_coef=0.01),
    dict(loss_type="bnpo", epsilon_high=0.28),
    dict(loss_type="dapo", beta=0.1, delta=1.5, epsilon_high=0.28),
    dict(loss_type="dapo", importance_sampling_level="sequence", epsilon_low=3e-4,
         epsilon_high=4e-4),
    dict(loss_type="dr_grpo", max_completion_length=T, entropy_coef=-0.02),
    dict(loss_type="dr_grpo", max_completion_length=9, importance_sampling_level="sequence",
         beta=0.05),
    dict(loss_type="cispo", epsilon_high=1.2),
    dict(loss_type="cispo", epsilon_high=5.0, beta=0.02, entropy_coef=0.03),
    dict(loss_type="cispo", epsilon_high=5.0, delta=1.5),  # TRL ignores delta for cispo
]


@pytest.mark.slow  # importing TRL's trainer (transformers, datasets, accelerate) takes ~7 s
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_matches_trl_compute_loss(case):
    opts = PolicyLossOptions(**case)
    lp, old, ref, ent, adv, mask = _batch()
    ours_in = [lp.clone().requires_grad_(), ent.clone().requires_grad_()]
    trl_in = [lp.clone().requires_grad_(), ent.clone().requires_grad_()]
    out = policy_loss(ours_in[0], old, adv, mask, ref_log_probs=ref, entropy=ours_in[1],
                      options=opts, return_stats=True)
    ref_loss, ref_metrics = _trl_loss(opts, trl_in[0], old, ref, trl_in[1], adv, mask)
    value, expected = float(out.loss.detach()), float(ref_loss.detach())
    assert abs(value - expected) <= TOL * max(1.0, abs(expected))
    out.loss.backward()
    ref_loss.backward()
    for ours, theirs in zip(ours_in, trl_in):
        if theirs.grad is None:  # no entropy bonus: TRL's graph never reaches the entropy
            assert ours.grad is None or not ours.grad.any()
            continue
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=TOL, atol=TOL)
    metrics = policy_metrics(out.stats, opts, group=SINGLE_RANK)
    assert metrics, "some metric must be reported"
    for name, value in metrics.items():
        assert abs(value - ref_metrics[name]) <= TOL, (name, value, ref_metrics[name])


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo", "cispo"])
def test_micro_batches_sum_to_the_whole_batch(loss_type):
    """Split into 3 micro-batches (one of them all padding), calibrated over the step: the summed
    losses and gradients equal the single call on the whole batch, for every loss_type (TRL's
    per-micro-batch grpo / bnpo / dr_grpo would not)."""
    opts = PolicyLossOptions(loss_type=loss_type, beta=0.03, entropy_coef=0.02,
                             max_completion_length=T, epsilon_high=1.3 if loss_type == "cispo"
                             else 0.2)
    lp, old, ref, ent, adv, mask = _batch(1)
    whole = lp.clone().requires_grad_()
    ref_out = policy_loss(whole, old, adv, mask, ref_log_probs=ref, entropy=ent, options=opts,
                          return_stats=True)
    ref_out.loss.backward()

    split = lp.clone().requires_grad_()
    pad_lp = torch.zeros(2, T, dtype=torch.float64, requires_grad=True)
    pad = torch.zeros(2, T, dtype=torch.long)  # an all-padding micro-batch
    micro = [(split[:2], old[:2], adv[:2], mask[:2], ref[:2], ent[:2]),
             (pad_lp, old[:2], adv[:2], pad, ref[:2], ent[:2]),
             (split[2:], old[2:], adv[2:], mask[2:], ref[2:], ent[2:])]
    calib = policy_calibrator(opts, weight_dtype=torch.float64)
    step = calib.begin_step([completion_labels(m[3]) for m in micro])
    total, stats = 0.0, []
    for i, (p, o, a, m, r, e) in enumerate(micro):
        out = policy_loss(p, o, a, m, ref_log_probs=r, entropy=e,
                          weights=policy_loss_weights(step, i, opts), options=opts,
                          return_stats=True)
        step.loss_for_backward(out.loss).backward()
        total = total + float(out.loss.detach())
        stats.append(out.stats)
    assert not pad_lp.grad.any()
    assert abs(total - float(ref_out.loss.detach())) <= TOL
    assert abs(float(step.global_loss()) - float(ref_out.loss.detach())) <= TOL
    torch.testing.assert_close(split.grad, whole.grad, rtol=TOL, atol=TOL)
    assert policy_metrics(stats, opts, group=SINGLE_RANK) == pytest.approx(
        policy_metrics(ref_out.stats, opts, group=SINGLE_RANK), rel=TOL, abs=TOL)


# Half the rows fully masked (TRL's mask_truncated_completions), clipping and the KL active.
EMPTY_ROWS = (7, 0, 3, 0, 5, 0)
MASKED_CASES = [
    dict(loss_type="grpo", beta=0.04, entropy_coef=0.01),
    dict(loss_type="grpo", importance_sampling_level="sequence", epsilon_low=3e-4,
         epsilon_high=4e-4),
    dict(loss_type="dr_grpo", max_completion_length=9, beta=0.05),
    dict(loss_type="bnpo", epsilon_high=0.28, entropy_coef=0.02),
    dict(loss_type="dapo", beta=0.1, delta=1.5, epsilon_high=0.28),
]


def _assert_metrics(metrics, ref_metrics):
    """TRL's clip ratios are float32 means (``is_low_clipped.float()``): within 1e-7 of the
    float64 ones; every other metric within TOL."""
    for name, value in metrics.items():
        tol = 1e-7 if name.startswith("clip_ratio") else TOL
        assert abs(value - ref_metrics[name]) <= tol, (name, value, ref_metrics[name])


def _compare(opts, inputs, trl_inputs):
    """policy_loss on ``inputs`` against TRL's _compute_loss on ``trl_inputs``: values, gradients
    and metrics within TOL."""
    lp, old, ref, ent, adv, mask = inputs
    ours_in = [lp.clone().requires_grad_(), ent.clone().requires_grad_()]
    out = policy_loss(ours_in[0], old, adv, mask, ref_log_probs=ref, entropy=ours_in[1],
                      options=opts, return_stats=True)
    lp_t, old_t, ref_t, ent_t, adv_t, mask_t = trl_inputs
    trl_in = [lp_t.clone().requires_grad_(), ent_t.clone().requires_grad_()]
    ref_loss, ref_metrics = _trl_loss(opts, trl_in[0], old_t, ref_t, trl_in[1], adv_t, mask_t)
    value, expected = float(out.loss.detach()), float(ref_loss.detach())
    assert abs(value - expected) <= TOL * max(1.0, abs(expected)), (value, expected)
    out.loss.backward()
    ref_loss.backward()
    return ours_in, trl_in, policy_metrics(out.stats, opts, group=SINGLE_RANK), ref_metrics


@pytest.mark.slow  # importing TRL's trainer
@pytest.mark.parametrize("case", MASKED_CASES, ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_fully_masked_rows_match_trl_with_count_empty_rows(case):
    """TRL's grpo averages over all B rows and its dr_grpo divides by B x max_completion_length,
    empty rows included: count_empty_rows=True gives exactly TRL's loss, gradient and metrics
    (its default False gave 2.0 x TRL's grpo / dr_grpo policy term here: 3 rows of 6 empty)."""
    opts = PolicyLossOptions(**case, count_empty_rows=True)
    batch = _batch(2, EMPTY_ROWS)
    ours, theirs, metrics, ref_metrics = _compare(opts, batch, batch)
    torch.testing.assert_close(ours[0].grad, theirs[0].grad, rtol=TOL, atol=TOL)
    if opts.entropy_coef:
        torch.testing.assert_close(ours[1].grad, theirs[1].grad, rtol=TOL, atol=TOL)
    _assert_metrics(metrics, ref_metrics)


@pytest.mark.slow  # importing TRL's trainer
@pytest.mark.parametrize("case", MASKED_CASES, ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_fully_masked_rows_without_count_empty_rows(case):
    """The default count_empty_rows=False: rows without a completion token count nothing, the
    loss is TRL's on the rows that hold one (so grpo / dr_grpo differ from TRL on all rows by
    B / rows with a completion token, bnpo / dapo not at all)."""
    opts = PolicyLossOptions(**case)
    batch = _batch(2, EMPTY_ROWS)
    kept = batch[-1].any(-1)
    ours, theirs, metrics, ref_metrics = _compare(opts, batch, [x[kept] for x in batch])
    torch.testing.assert_close(ours[0].grad[kept], theirs[0].grad, rtol=TOL, atol=TOL)
    assert not ours[0].grad[~kept].any()
    _assert_metrics(metrics, ref_metrics)
    lp, old, ref, ent, adv, mask = batch

    def policy_term(count_empty_rows):  # without the entropy bonus, a token mean either way
        o = PolicyLossOptions(**{**case, "entropy_coef": 0.0}, count_empty_rows=count_empty_rows)
        return float(policy_loss(lp, old, adv, mask, ref_log_probs=ref, options=o))
    want = len(EMPTY_ROWS) / int(kept.sum()) if opts.loss_type in ("grpo", "dr_grpo") else 1.0
    assert policy_term(False) / policy_term(True) == pytest.approx(want, rel=1e-12)


@pytest.mark.slow  # importing TRL's trainer
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "bnpo", "dapo"])
def test_count_empty_rows_is_global_over_micro_batches(loss_type):
    """Fully masked rows split over 3 calibrated micro-batches (one all empty) with
    count_empty_rows=True: the summed loss and gradient are TRL's _compute_loss on the whole
    batch (one micro-batch, where TRL's normaliser is the global one)."""
    opts = PolicyLossOptions(loss_type=loss_type, beta=0.03, entropy_coef=0.02,
                             max_completion_length=T, count_empty_rows=True)
    lp, old, ref, ent, adv, mask = _batch(3, EMPTY_ROWS)
    mask = mask.clone()
    mask[2] = 0  # rows 1, 2 and 3: an all-empty micro-batch
    trl_lp = lp.clone().requires_grad_()
    trl_loss, _ = _trl_loss(opts, trl_lp, old, ref, ent, adv, mask)
    trl_loss.backward()
    split = lp.clone().requires_grad_()
    pieces = [slice(0, 1), slice(1, 4), slice(4, 6)]
    calib = policy_calibrator(opts, weight_dtype=torch.float64)
    step = calib.begin_step([completion_labels(mask[r]) for r in pieces])
    assert float(step.num_samples) == B
    total = 0.0
    for i, r in enumerate(pieces):
        out = policy_loss(split[r], old[r], adv[r], mask[r], ref_log_probs=ref[r], entropy=ent[r],
                          weights=policy_loss_weights(step, i, opts), options=opts)
        step.loss_for_backward(out).backward()
        total = total + float(out.detach())
    assert abs(total - float(trl_loss.detach())) <= TOL
    torch.testing.assert_close(split.grad, trl_lp.grad, rtol=TOL, atol=TOL)


def test_cispo_accepts_delta_and_other_types_bound_it():
    opts = PolicyLossOptions(loss_type="cispo", epsilon_high=5.0, delta=1.5)
    assert opts.delta == 1.5
    for loss_type in ("grpo", "bnpo", "dapo"):
        with pytest.raises(ValueError, match="delta must be"):
            PolicyLossOptions(loss_type=loss_type, epsilon_high=5.0, delta=1.5)
    with pytest.raises(ValueError, match="delta must be"):
        PolicyLossOptions(loss_type="cispo", epsilon_high=5.0, delta="1.5")
    with pytest.raises(TypeError, match="count_empty_rows must be a bool"):
        PolicyLossOptions(count_empty_rows=1)


def test_bad_inputs_name_the_argument():
    lp, old, ref, ent, adv, mask = _batch()
    with pytest.raises(ValueError, match="ref_log_probs is required"):
        policy_loss(lp, old, adv, mask, beta=0.1, return_stats=True)
    with pytest.raises(ValueError, match="entropy is required"):
        policy_loss(lp, old, adv, mask, entropy_coef=0.1, return_stats=True)
    with pytest.raises(ValueError, match="old_log_probs must have shape"):
        policy_loss(lp, old[:, :3], adv, mask, return_stats=True)
    with pytest.raises(ValueError, match="advantages must have shape"):
        policy_loss(lp, old, adv[:2], mask, return_stats=True)
    with pytest.raises(ValueError, match="max_completion_length"):
        policy_loss(lp, old, adv, mask, loss_type="dr_grpo", return_stats=True)
    with pytest.raises(ValueError, match="loss_type must be one of"):
        PolicyLossOptions(loss_type="ppo")
    with pytest.raises(TypeError, match="not both"):
        policy_loss(lp, old, adv, mask, options=PolicyLossOptions(), beta=0.5, return_stats=True)
    step = policy_calibrator(PolicyLossOptions(loss_type="grpo")).begin_step(
        [completion_labels(mask)])
    with pytest.raises(ValueError, match="count_empty_rows=True"):
        policy_loss_weights(step, 0, PolicyLossOptions(loss_type="grpo", count_empty_rows=True))
