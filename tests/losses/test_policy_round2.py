"""megaloss.policy_loss's verl and TRL options, each against its reference in float64:

* ``loss_agg_mode`` (verl's four ``agg_loss`` modes), ``kl_estimator`` (verl's ``kl_penalty``,
  straight-through ``"+"`` forms included) and ``cispo_two_sided`` (verl's
  ``compute_policy_loss_cispo``) against verl's own code, copied below from
  ``volcengine/verl``, ``verl/trainer/ppo/core_algos.py`` (verl is not a dependency);
* ``loss_type="sapo"``, ``"luspo"``, ``"vespo"`` against TRL 1.16's own
  ``GRPOTrainer._compute_loss`` (``trl/trainer/grpo_trainer.py``), called as in
  ``tests/losses/test_policy.py``;
* every new option over DP 2 x GAS 2 (gloo) against the single-process call on the whole batch.

Tolerances: values and gradients within 1e-12 (relative, summation order only), except where a
test says why (verl's ``seq-mean-token-mean`` adds 1e-8 to each sequence's token count).
"""
import collections
import math
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
from megaloss.calibration.engine_scale import EngineScale
from megaloss.testing import run_distributed

B, T = 6, 7
TOL = 1e-12


def _batch(seed=0, lengths=(7, 3, 1, 5, 6, 2), spread=0.4, rows=B):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths)
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    lp = -torch.rand(rows, T, generator=g, dtype=torch.float64) * 3
    old = lp + spread * torch.randn(rows, T, generator=g, dtype=torch.float64)
    ref = lp + 0.3 * torch.randn(rows, T, generator=g, dtype=torch.float64)
    ent = torch.rand(rows, T, generator=g, dtype=torch.float64) * 2
    adv = torch.randn(rows, generator=g, dtype=torch.float64)
    return lp, old, ref, ent, adv, mask


def _close(a, b, tol=TOL):
    a, b = float(a), float(b)
    return abs(a - b) <= tol * max(1.0, abs(b))


# --- verl's code (volcengine/verl, verl/trainer/ppo/core_algos.py), verbatim but for
# verl_F.masked_sum(x, m) written as (x * m).sum() -------------------------------------------

def verl_agg_loss(loss_mat, loss_mask, loss_agg_mode, dp_size=1, batch_num_tokens=None,
                  global_batch_size=None, loss_scale_factor=None):
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            batch_num_tokens = loss_mask.sum()
        loss = (loss_mat * loss_mask).sum() / batch_num_tokens * dp_size
    elif loss_agg_mode == "seq-mean-token-sum":
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)  # token-sum
        seq_mask = (torch.sum(loss_mask, dim=-1) > 0).float()  # exclude fully masked sequences
        if global_batch_size is None:
            global_batch_size = seq_mask.sum()
        loss = (seq_losses * seq_mask).sum() / global_batch_size * dp_size  # seq-mean
    elif loss_agg_mode == "seq-mean-token-mean":
        seq_mask = torch.sum(loss_mask, dim=-1)  # per-sequence token count
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (seq_mask + 1e-8)  # token-mean
        seq_mask = (seq_mask > 0).float()  # exclude fully masked sequences
        if global_batch_size is None:
            global_batch_size = seq_mask.sum()
        loss = (seq_losses * seq_mask).sum() / global_batch_size * dp_size  # seq-mean
    elif loss_agg_mode == "seq-mean-token-sum-norm":
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        if loss_scale_factor is None:
            loss_scale_factor = loss_mask.shape[-1]
        loss = torch.sum(seq_losses) / loss_scale_factor
    else:
        raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode}")
    return loss


def verl_kl_penalty_forward(logprob, ref_logprob, kl_penalty):
    if kl_penalty in ("kl", "k1"):
        return logprob - ref_logprob
    if kl_penalty == "abs":
        return (logprob - ref_logprob).abs()
    if kl_penalty in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    if kl_penalty in ("low_var_kl", "k3"):
        kl = ref_logprob - logprob
        kl = torch.clamp(kl, min=-20, max=20)
        ratio = torch.exp(kl)
        kld = (ratio - kl - 1).contiguous()
        return torch.clamp(kld, min=-10, max=10)
    raise NotImplementedError


def verl_kl_penalty(logprob, ref_logprob, kl_penalty):
    forward_score = verl_kl_penalty_forward(logprob, ref_logprob, kl_penalty)
    if not kl_penalty.endswith("+") or kl_penalty in ("mse", "k2"):
        return forward_score
    backward_score = 0.5 * (logprob - ref_logprob).square()
    return backward_score - backward_score.detach() + forward_score.detach()


def verl_kl_penalty_plus(logprob, ref_logprob, kl_penalty):
    """verl's kl_penalty for a "+" name: kl_penalty_forward gets the name with its "+" (and
    raises for it: verl/trainer/ppo/core_algos.py), so the base name is passed here."""
    forward_score = verl_kl_penalty_forward(logprob, ref_logprob, kl_penalty[:-1])
    backward_score = 0.5 * (logprob - ref_logprob).square()
    return backward_score - backward_score.detach() + forward_score.detach()


def verl_pg_losses_vanilla(old_log_prob, log_prob, advantages, clip_ratio_low, clip_ratio_high,
                           clip_ratio_c):
    """compute_policy_loss_vanilla's per-token pg_losses (before agg_loss)."""
    negative_approx_kl = log_prob - old_log_prob
    negative_approx_kl = torch.clamp(negative_approx_kl, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    return torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)


def verl_pg_losses_cispo(old_log_prob, log_prob, advantages, response_mask, clip_ratio_low,
                         clip_ratio_high):
    """compute_policy_loss_cispo's per-token pg_losses and pg_clipfrac."""
    negative_approx_kl = log_prob - old_log_prob
    negative_approx_kl = torch.clamp(negative_approx_kl, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    clipped_ratio = torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clipped_ratio_sg = clipped_ratio.detach()
    pg_losses = -clipped_ratio_sg * advantages * log_prob
    m = response_mask.to(ratio.dtype)
    pg_clipfrac = ((ratio != clipped_ratio).to(ratio.dtype) * m).sum() / m.sum()
    return pg_losses, pg_clipfrac


def verl_actor_loss(pg_losses, lp, ref, ent, mask, mode, kl_type, kl_coef, entropy_coeff,
                    loss_scale_factor=None):
    """verl's actor objective on one micro-batch, one process (verl/workers/actor/dp_actor.py
    update_policy): agg_loss of the policy term, minus entropy_coeff x agg_loss of the entropy,
    plus kl_loss_coef x agg_loss of kl_penalty, all with the one loss_agg_mode."""
    agg = dict(loss_mask=mask, loss_agg_mode=mode, loss_scale_factor=loss_scale_factor)
    loss = verl_agg_loss(pg_losses, **agg)
    if entropy_coeff != 0:
        loss = loss - verl_agg_loss(ent, **agg) * entropy_coeff
    if kl_coef != 0:
        kl = (verl_kl_penalty_plus if kl_type.endswith("+") else verl_kl_penalty)(lp, ref, kl_type)
        loss = loss + verl_agg_loss(kl, **agg) * kl_coef
    return loss


# --- 1. loss_agg_mode ------------------------------------------------------------------------

AGG_CASES = [
    ("token-mean", None), ("seq-mean-token-sum", None), ("seq-mean-token-mean", None),
    ("seq-mean-token-sum-norm", None), ("seq-mean-token-sum-norm", 9),
]


def _ours_and_verl_ppo(mode, scale, lengths, kl_type="k3", cispo=False, eps=(0.2, 0.28)):
    lp, old, ref, ent, adv, mask = _batch(4, lengths)
    L = scale if scale is not None else T  # verl's default: the padded response length
    opts = PolicyLossOptions(
        loss_type="cispo" if cispo else "dapo", epsilon_low=eps[0], epsilon_high=eps[1],
        delta=None if cispo else 3.0, beta=0.07, entropy_coef=0.02, loss_agg_mode=mode,
        max_completion_length=L, kl_estimator="low_var_kl" if kl_type == "k3" else kl_type,
        cispo_two_sided=cispo)
    ours = [lp.clone().requires_grad_(), ent.clone().requires_grad_()]
    out = policy_loss(ours[0], old, adv, mask, ref_log_probs=ref, entropy=ours[1], options=opts,
                      return_stats=True)
    out.loss.backward()
    theirs = [lp.clone().requires_grad_(), ent.clone().requires_grad_()]
    adv_t = adv[:, None].expand(B, T)  # verl's advantages are per token
    m = mask.to(torch.float64)
    if cispo:
        pg, clipfrac = verl_pg_losses_cispo(old, theirs[0], adv_t, mask, *eps)
    else:
        pg, clipfrac = verl_pg_losses_vanilla(old, theirs[0], adv_t, *eps, 3.0), None
    ref_loss = verl_actor_loss(pg, theirs[0], ref, theirs[1], m, mode, kl_type, 0.07, 0.02,
                               loss_scale_factor=scale)
    ref_loss.backward()
    return opts, out, ours, ref_loss, theirs, clipfrac


@pytest.mark.parametrize("lengths", [(7, 3, 1, 5, 6, 2), (7, 0, 3, 0, 5, 1)],
                         ids=["full-rows", "empty-rows"])
@pytest.mark.parametrize("mode,scale", AGG_CASES, ids=[f"{m}-{s}" for m, s in AGG_CASES])
def test_loss_agg_mode_matches_verl(mode, scale, lengths):
    """PPO with verl's dual clip (delta = clip_ratio_c = 3), the KL (verl's "k3" is megaloss's
    "low_var_kl") and the entropy bonus, aggregated by verl's agg_loss on one micro-batch."""
    _, out, ours, ref_loss, theirs, _ = _ours_and_verl_ppo(mode, scale, lengths)
    # verl's seq-mean-token-mean divides each sequence by n_s + 1e-8: relative 1e-8 / n_s.
    tol = 2e-8 if mode == "seq-mean-token-mean" else TOL
    assert _close(out.loss.detach(), ref_loss.detach(), tol)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad, rtol=tol, atol=tol)


def test_seq_mean_token_mean_is_verls_without_its_epsilon():
    """seq-mean-token-mean within 1e-12 of verl's formula with its 1e-8 removed."""
    lp, old, ref, ent, adv, mask = _batch(5, (7, 0, 3, 2, 5, 1))
    opts = PolicyLossOptions(loss_type="dapo", loss_agg_mode="seq-mean-token-mean")
    ours = lp.clone().requires_grad_()
    loss = policy_loss(ours, old, adv, mask, options=opts)
    loss.backward()
    theirs = lp.clone().requires_grad_()
    m = mask.to(torch.float64)
    pg = verl_pg_losses_vanilla(old, theirs, adv[:, None].expand(B, T), 0.2, 0.2, 1e30)
    n = m.sum(-1)
    want = ((pg * m).sum(-1)[n > 0] / n[n > 0]).mean()
    want.backward()
    assert _close(loss.detach(), want.detach())
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=TOL, atol=TOL)


def test_loss_agg_mode_default_keeps_the_loss_type():
    """loss_agg_mode=None is the loss_type's normalisation; each mode equals the loss_type that
    has its normalisation (token-mean = dapo, seq-mean-token-mean = grpo + the verl entropy)."""
    lp, old, ref, ent, adv, mask = _batch(6)
    for mode, loss_type in [("token-mean", "dapo"), ("seq-mean-token-mean", "grpo")]:
        a = policy_loss(lp, old, adv, mask, options=PolicyLossOptions(
            loss_type="dapo", loss_agg_mode=mode, beta=0.1), ref_log_probs=ref)
        b = policy_loss(lp, old, adv, mask, options=PolicyLossOptions(
            loss_type=loss_type, beta=0.1), ref_log_probs=ref)
        assert _close(a, b)
    a = policy_loss(lp, old, adv, mask, options=PolicyLossOptions(
        loss_type="dapo", loss_agg_mode="seq-mean-token-sum-norm", max_completion_length=9))
    b = policy_loss(lp, old, adv, mask, options=PolicyLossOptions(
        loss_type="dr_grpo", max_completion_length=9))
    assert _close(a, b * B)  # dr_grpo also divides by the sequence count


# --- 2. kl_estimator -------------------------------------------------------------------------

KL_CASES = ["k1", "k2", "k3", "low_var_kl", "abs", "k1+", "k3+", "low_var_kl+", "abs+"]


@pytest.mark.parametrize("far", [False, True], ids=["near", "far"])
@pytest.mark.parametrize("estimator", KL_CASES)
def test_kl_estimator_matches_verl_kl_penalty(estimator, far):
    """The KL term alone (ratio 1, no advantage) against verl's kl_penalty with token-mean;
    ``far``: log-ratios up to 30 in size, where verl's clamps act (megaloss's "k3" is TRL's
    unclamped k3, compared with the unclamped formula there)."""
    lp, _, ref, _, adv, mask = _batch(7)
    if far:
        ref = lp + torch.linspace(-30, 30, B * T, dtype=torch.float64).view(B, T)
    opts = PolicyLossOptions(loss_type="dapo", beta=0.3, kl_estimator=estimator)
    ours = lp.clone().requires_grad_()
    out = policy_loss(ours, None, torch.zeros_like(adv), mask, ref_log_probs=ref, options=opts,
                      return_stats=True)
    out.loss.backward()
    theirs = lp.clone().requires_grad_()
    verl_name = {"k3": "k3", "k3+": "k3+", "low_var_kl": "low_var_kl",
                 "low_var_kl+": "low_var_kl+"}.get(estimator, estimator)
    if estimator.startswith("k3"):  # TRL's k3, without verl's clamps
        d = ref - theirs
        kl = torch.exp(d) - d - 1
        if estimator.endswith("+"):
            back = 0.5 * (theirs - ref).square()
            kl = back - back.detach() + kl.detach()
    elif estimator.endswith("+"):
        kl = verl_kl_penalty_plus(theirs, ref, verl_name)
    else:
        kl = verl_kl_penalty(theirs, ref, verl_name)
    m = mask.to(torch.float64)
    want = 0.3 * verl_agg_loss(kl, m, "token-mean")
    want.backward()
    assert _close(out.loss.detach(), want.detach())
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=TOL, atol=TOL)
    kl_metric = policy_metrics(out.stats, opts, group=SINGLE_RANK)["kl"]
    assert _close(kl_metric, verl_agg_loss(kl.detach(), m, "token-mean"))


def test_plus_forms_have_the_k2_gradient_and_their_own_value():
    lp, _, ref, _, adv, mask = _batch(8)
    zero = torch.zeros_like(adv)
    grads, values = {}, {}
    for est in ("k2", "k1+", "k3+", "abs+", "k1", "k3"):
        x = lp.clone().requires_grad_()
        loss = policy_loss(x, None, zero, mask, ref_log_probs=ref,
                           options=PolicyLossOptions(beta=1.0, kl_estimator=est))
        loss.backward()
        grads[est], values[est] = x.grad, float(loss.detach())
    for est in ("k1+", "k3+", "abs+"):
        torch.testing.assert_close(grads[est], grads["k2"], rtol=TOL, atol=TOL)
    assert values["k1+"] == pytest.approx(values["k1"], rel=TOL)
    assert values["k3+"] == pytest.approx(values["k3"], rel=TOL)


# --- 3. cispo_two_sided ----------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("eps", [(0.2, 0.28), (0.5, 4.0), (1.0, 0.0)])
def test_cispo_two_sided_matches_verl(eps, mode):
    opts, out, ours, ref_loss, theirs, clipfrac = _ours_and_verl_ppo(
        mode, None, (7, 3, 1, 5, 6, 2), kl_type="k1", cispo=True, eps=eps)
    assert _close(out.loss.detach(), ref_loss.detach())
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad, rtol=TOL, atol=TOL)
    metrics = policy_metrics(out.stats, opts, group=SINGLE_RANK)
    assert _close(metrics["cispo_clip_ratio"], clipfrac)
    assert 0 < metrics["cispo_clip_ratio"] or eps == (0.5, 4.0)


def test_cispo_two_sided_differs_from_trls_cap():
    lp, old, ref, ent, adv, mask = _batch(9)
    one = policy_loss(lp, old, adv, mask, options=PolicyLossOptions(
        loss_type="cispo", epsilon_high=1.2))
    two = policy_loss(lp, old, adv, mask, options=PolicyLossOptions(
        loss_type="cispo", epsilon_low=0.2, epsilon_high=0.2, cispo_two_sided=True))
    assert abs(float(one) - float(two)) > 1e-6


# --- 4. TRL's sapo, luspo, vespo -------------------------------------------------------------

class _Accelerator:
    num_processes, sync_gradients = 1, True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x


def _trl_loss(opts, lp, old, ref, ent, adv, mask):
    """TRL's own _compute_loss on these tensors (under torch's float64 default dtype, so its
    ``torch.where(advantages > 0, temperature_pos, temperature_neg)`` keeps the temperatures in
    float64 instead of rounding them to float32); returns (loss, metrics)."""
    from trl.trainer.grpo_trainer import GRPOTrainer
    args = SimpleNamespace(
        use_bias_correction_kl=False, delta=opts.delta, steps_per_generation=1,
        sapo_temperature_pos=opts.sapo_temperature_pos,
        sapo_temperature_neg=opts.sapo_temperature_neg, vespo_k_pos=opts.vespo_k_pos,
        vespo_lambda_pos=opts.vespo_lambda_pos, vespo_k_neg=opts.vespo_k_neg,
        vespo_lambda_neg=opts.vespo_lambda_neg)
    fake = SimpleNamespace(
        top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level=opts.importance_sampling_level, beta=opts.beta, args=args,
        loss_type=opts.loss_type, epsilon_low=opts.epsilon_low, epsilon_high=opts.epsilon_high,
        use_vllm=False, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, accelerator=_Accelerator(),
        max_completion_length=opts.max_completion_length,
        _entropy_bonus_enabled=opts.entropy_coef != 0, entropy_coef=opts.entropy_coef,
        use_adaptive_entropy=False, aux_loss_enabled=False,
        _metrics={"train": collections.defaultdict(list)},
        get_gamma_weights=GRPOTrainer.get_gamma_weights,
        _get_per_token_logps_and_entropies=lambda *a, **k: (lp, ent, None))
    rows = mask.shape[0]
    inputs = {"prompt_ids": torch.zeros(rows, 1, dtype=torch.long),
              "prompt_mask": torch.ones(rows, 1, dtype=torch.long),
              "completion_ids": torch.zeros(rows, T, dtype=torch.long), "completion_mask": mask,
              "advantages": adv, "old_per_token_logps": old, "ref_per_token_logps": ref,
              "num_items_in_batch": mask.sum().double()}
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        loss = GRPOTrainer._compute_loss(fake, None, inputs)
    finally:
        torch.set_default_dtype(default)
    return loss, {k: v[-1] for k, v in fake._metrics["train"].items()}


TRL_CASES = [
    dict(loss_type="sapo"),
    dict(loss_type="sapo", sapo_temperature_pos=0.7, sapo_temperature_neg=1.6, beta=0.04,
         entropy_coef=0.01),
    dict(loss_type="sapo", importance_sampling_level="sequence", delta=1.5),
    dict(loss_type="luspo", importance_sampling_level="sequence", epsilon_low=3e-4,
         epsilon_high=4e-4),
    dict(loss_type="luspo", beta=0.05, delta=1.5, epsilon_high=0.28, entropy_coef=-0.02),
    dict(loss_type="vespo"),
    dict(loss_type="vespo", vespo_k_pos=1.5, vespo_lambda_pos=2.5, vespo_k_neg=0.5,
         vespo_lambda_neg=4.0, beta=0.03, entropy_coef=0.02),
]


@pytest.mark.slow  # importing TRL's trainer
@pytest.mark.parametrize("count_empty_rows", [True, False])
@pytest.mark.parametrize("spread", [0.4, 0.05])
@pytest.mark.parametrize("case", TRL_CASES, ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_trl_loss_types_match_trl_compute_loss(case, spread, count_empty_rows):
    """On rows that all hold a completion (then count_empty_rows changes nothing); ``spread``:
    the old / new log-prob gap (0.4 clips and gates hard, 0.05 keeps VESPO's weight near 1)."""
    opts = PolicyLossOptions(**case, count_empty_rows=count_empty_rows)
    lp, old, ref, ent, adv, mask = _batch(10, spread=spread)
    ours = [lp.clone().requires_grad_(), ent.clone().requires_grad_()]
    out = policy_loss(ours[0], old, adv, mask, ref_log_probs=ref, entropy=ours[1], options=opts,
                      return_stats=True)
    theirs = [lp.clone().requires_grad_(), ent.clone().requires_grad_()]
    ref_loss, ref_metrics = _trl_loss(opts, theirs[0], old, ref, theirs[1], adv, mask)
    assert _close(out.loss.detach(), ref_loss.detach()), (float(out.loss), float(ref_loss))
    out.loss.backward()
    ref_loss.backward()
    for a, b in zip(ours, theirs):
        if b.grad is None:
            assert a.grad is None or not a.grad.any()
            continue
        torch.testing.assert_close(a.grad, b.grad, rtol=TOL, atol=TOL)
    metrics = policy_metrics(out.stats, opts, group=SINGLE_RANK)
    trl_names = {"kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean",
                 "clip_ratio/region_mean", "cispo_clip_ratio", "vespo/phi_seq_mean"}
    assert set(metrics) == trl_names & set(ref_metrics)
    for name, value in metrics.items():
        tol = 1e-7 if name.startswith("clip_ratio") else TOL  # TRL's float32 clip means
        assert abs(value - ref_metrics[name]) <= tol * max(1.0, abs(value)), name


@pytest.mark.slow  # importing TRL's trainer
@pytest.mark.parametrize("case", TRL_CASES[::2], ids=lambda c: c["loss_type"])
def test_trl_loss_types_with_empty_rows_match_trl_with_count_empty_rows(case):
    """Half the rows without a completion token: count_empty_rows=True is TRL's row count."""
    opts = PolicyLossOptions(**case, count_empty_rows=True)
    lp, old, ref, ent, adv, mask = _batch(11, (7, 0, 3, 0, 5, 0))
    ours = lp.clone().requires_grad_()
    out = policy_loss(ours, old, adv, mask, ref_log_probs=ref, entropy=ent, options=opts,
                      return_stats=True)
    theirs = lp.clone().requires_grad_()
    ref_loss, ref_metrics = _trl_loss(opts, theirs, old, ref, ent, adv, mask)
    assert _close(out.loss.detach(), ref_loss.detach())
    out.loss.backward()
    ref_loss.backward()
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=TOL, atol=TOL)
    for name, value in policy_metrics(out.stats, opts, group=SINGLE_RANK).items():
        tol = 1e-7 if name.startswith("clip_ratio") else TOL
        assert abs(value - ref_metrics[name]) <= tol * max(1.0, abs(value)), name


def test_vespo_weight_is_detached_and_one_at_ratio_one():
    lp, old, ref, ent, adv, mask = _batch(12)
    x = lp.clone().requires_grad_()
    out = policy_loss(x, None, adv, mask, options=PolicyLossOptions(loss_type="vespo"),
                      return_stats=True)
    out.loss.backward()
    # phi(1) = 1: the gradient is the REINFORCE one, -A / N_tokens on every completion token
    want = torch.where(mask.bool(), -adv[:, None] / mask.sum(), 0.0).expand(B, T)
    torch.testing.assert_close(x.grad, want, rtol=TOL, atol=TOL)
    assert policy_metrics(out.stats, PolicyLossOptions(loss_type="vespo"),
                          group=SINGLE_RANK)["vespo/phi_seq_mean"] == pytest.approx(1.0, rel=TOL)


# --- validation ------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,match", [
    (dict(kl_estimator="k2+"), r"kl_estimator must be one of \('k1', 'k2', 'k3'"),
    (dict(kl_estimator="mse"), "kl_estimator must be one of"),
    (dict(loss_agg_mode="sample-mean"), r"loss_agg_mode must be None or one of \('token-mean'"),
    (dict(loss_agg_mode="seq-mean-token-sum-norm"), "needs max_completion_length"),
    (dict(cispo_two_sided=True), "cispo_two_sided=True needs loss_type='cispo'"),
    (dict(loss_type="cispo", cispo_two_sided=1), None),
    (dict(loss_type="sapo", sapo_temperature_pos=0.0), "sapo_temperature_pos must be a finite"),
    (dict(sapo_temperature_neg=math.inf), "sapo_temperature_neg must be a finite"),
    (dict(vespo_k_pos=-1.0), "vespo_k_pos must be a finite float >= 0"),
    (dict(vespo_k_neg=math.nan), "vespo_k_neg must be a finite float >= 0"),
    (dict(vespo_lambda_pos=0), "vespo_lambda_pos must be a finite number > 0"),
    (dict(vespo_lambda_neg=-2.0), "vespo_lambda_neg must be a finite number > 0"),
    (dict(loss_type="gpg"), r"loss_type must be one of \(.*'sapo', 'luspo', 'vespo'\)"),
    (dict(loss_type="luspo", epsilon_high=0.5, delta=1.2), "delta must be"),
])
def test_new_options_are_validated_naming_them(kwargs, match):
    if match is None:
        with pytest.raises(TypeError, match="cispo_two_sided must be a bool"):
            PolicyLossOptions(**kwargs)
        return
    with pytest.raises(ValueError, match=match):
        PolicyLossOptions(**kwargs)


def test_delta_is_ignored_by_sapo_and_vespo_and_dr_grpo_takes_an_agg_mode():
    for loss_type in ("sapo", "vespo"):
        assert PolicyLossOptions(loss_type=loss_type, delta=1.1).delta == 1.1
    opts = PolicyLossOptions(loss_type="dr_grpo", loss_agg_mode="token-mean")
    assert opts.max_completion_length is None


def test_ds_config_keys_reach_the_options():
    from megaloss.integrations.deepspeed import load_megaloss_config
    policy = {"loss_type": "cispo", "epsilon_low": 0.2, "epsilon_high": 0.28,
              "cispo_two_sided": True, "kl_estimator": "low_var_kl+", "beta": 0.01,
              "loss_agg_mode": "seq-mean-token-sum-norm", "max_completion_length": 128,
              "sapo_temperature_pos": 0.9, "sapo_temperature_neg": 1.1, "vespo_k_pos": 1.0,
              "vespo_lambda_pos": 2.0, "vespo_k_neg": 2.5, "vespo_lambda_neg": 1.5}
    ml = load_megaloss_config({"megaloss": {"policy": policy}})
    assert ml.policy.options() == PolicyLossOptions(**policy)
    for key, value, match in [("kl_estimator", "k4", "kl_estimator must be one of"),
                              ("loss_agg_mode", "seq-sum", "loss_agg_mode must be None or"),
                              ("cispo_two_sided", True, "needs loss_type='cispo'"),
                              ("vespo_lambda_neg", 0, "vespo_lambda_neg must be")]:
        with pytest.raises(ValueError, match=match):
            load_megaloss_config({"megaloss": {"policy": {key: value}}})


# --- DP 2 x GAS 2 against one process ---------------------------------------------------------

DIST_CASES = [
    dict(loss_type="dapo", loss_agg_mode="token-mean", beta=0.05, entropy_coef=0.02,
         kl_estimator="k1+"),
    dict(loss_type="dapo", loss_agg_mode="seq-mean-token-sum", beta=0.05, entropy_coef=0.02,
         kl_estimator="k2"),
    dict(loss_type="grpo", loss_agg_mode="seq-mean-token-mean", beta=0.05,
         kl_estimator="low_var_kl"),
    dict(loss_type="dapo", loss_agg_mode="seq-mean-token-sum-norm", max_completion_length=9,
         beta=0.05, entropy_coef=0.02, kl_estimator="abs+", delta=3.0),
    dict(loss_type="cispo", cispo_two_sided=True, epsilon_high=0.28, beta=0.05,
         kl_estimator="k3+"),
    dict(loss_type="sapo", beta=0.05, entropy_coef=0.02),
    dict(loss_type="sapo", count_empty_rows=True, importance_sampling_level="sequence"),
    dict(loss_type="luspo", importance_sampling_level="sequence", entropy_coef=0.02),
    dict(loss_type="luspo", count_empty_rows=True, beta=0.05, kl_estimator="low_var_kl+"),
    dict(loss_type="vespo", beta=0.05, entropy_coef=0.02),
    dict(loss_type="vespo", count_empty_rows=True),
]
DIST_ROWS = 8
DIST_LENGTHS = (7, 0, 3, 1, 5, 6, 0, 2)  # micro-batches of 2 rows: rank r gets 2r, 2r + 1


def _dist_batch():
    lp, old, ref, ent, adv, mask = _batch(13, DIST_LENGTHS, rows=DIST_ROWS)
    return lp, old, ref, ent, adv, mask


def _single(opts):
    lp, old, ref, ent, adv, mask = _dist_batch()
    x, h = lp.clone().requires_grad_(), ent.clone().requires_grad_()
    out = policy_loss(x, old, adv, mask, ref_log_probs=ref, entropy=h, options=opts,
                      return_stats=True)
    out.loss.backward()
    return (float(out.loss.detach()), x.grad, _grad(h),
            policy_metrics(out.stats, opts, group=SINGLE_RANK))


def _grad(t):
    return torch.zeros_like(t) if t.grad is None else t.grad


def _dist_worker(rank, world):
    import torch.distributed as dist
    results = []
    for case in DIST_CASES:
        opts = PolicyLossOptions(**case)
        lp, old, ref, ent, adv, mask = _dist_batch()
        x, h = lp.clone().requires_grad_(), ent.clone().requires_grad_()
        rows = [slice(2 * (2 * rank + i), 2 * (2 * rank + i) + 2) for i in range(2)]  # GAS 2
        # gradients summed over the ranks below (an all-reduce SUM): a factor of 1
        scale = EngineScale("all-reduce-sum", 1.0, 1.0, 2, world, 1.0, tuple(range(world)))
        calib = policy_calibrator(opts, engine_scale=scale, weight_dtype=torch.float64)
        step = calib.begin_step([completion_labels(mask[r]) for r in rows])
        total, stats = torch.zeros((), dtype=torch.float64), []
        for i, r in enumerate(rows):
            out = policy_loss(x[r], old[r], adv[r], mask[r], ref_log_probs=ref[r],
                              entropy=h[r], weights=policy_loss_weights(step, i, opts),
                              options=opts, return_stats=True)
            step.loss_for_backward(out.loss).backward()
            total = total + out.loss.detach()
            stats.append(out.stats)
        grads = [x.grad, _grad(h)]
        for t in [total] + grads:
            dist.all_reduce(t)
        results.append((float(total), *grads, policy_metrics(stats, opts)))
    return results


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_dp2_gas2_equals_single_process():
    ranks = run_distributed(_dist_worker, 2, timeout=220)
    for i, case in enumerate(DIST_CASES):
        want = _single(PolicyLossOptions(**case))
        for rank in ranks:
            loss, g_lp, g_ent, metrics = rank[i]
            assert _close(loss, want[0]), (case, loss, want[0])
            torch.testing.assert_close(g_lp, want[1], rtol=TOL, atol=TOL)
            torch.testing.assert_close(g_ent, want[2], rtol=TOL, atol=TOL)
            assert metrics.keys() == want[3].keys()
            for name in metrics:
                assert _close(metrics[name], want[3][name]), (case, name)
