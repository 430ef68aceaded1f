"""ORPO, CPO / SimPO and KTO (megaloss.losses.orpo / .simpo / .kto) against TRL 1.16's own
trainers, called with a stand-in ``self`` and model that return the same float64 tensors:

- ORPO: ``ORPOTrainer.get_batch_loss_metrics`` (``trl/experimental/orpo/orpo_trainer.py``), the
  whole loss including its NLL over the chosen prompt and completion, from logits;
- CPO / SimPO: ``CPOTrainer.get_batch_loss_metrics`` (``trl/experimental/cpo/cpo_trainer.py``)
  for every ``loss_type`` (``"simpo"`` is SimPO), with and without the NLL ``cpo_alpha``;
- KTO: ``KTOTrainer._compute_loss`` (``trl/trainer/kto_trainer.py``), ``"kto"`` (with its KL
  baseline from mismatched completions) and ``"apo_zero_unpaired"``.

Second references, Liger-Kernel's torch formulas (Liger is not installed; ported inline below,
each naming its file): ``HF_ORPO_Loss.odds_ratio_loss`` (``test/chunked_loss/test_orpo_loss.py``),
``HFCPOLoss.alignment_loss`` (``test/chunked_loss/test_cpo_loss.py``, also what
``test/chunked_loss/test_simpo_loss.py`` checks SimPO against) and ``HFKTOLoss.alignment_loss``
(``test/chunked_loss/test_kto_loss.py``).

Then the global normalisation: 2 DP ranks x 2 accumulation steps (uneven, one micro-batch
without pairs) sum to the single-process loss and gradient; and bad inputs raise ValueError
naming the argument.

Tolerance: float64, loss, gradients and metrics within 1e-12 (absolute, and relative for large
values; the formulas are the peers', only the summation order differs). TRL's ORPO casts the
log-probs to float32 (``.float()``); the stand-in passes a tensor subclass whose ``float()`` keeps
float64, so the comparison is of the formula, not of float32 rounding.
"""
import collections
import math
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from megaloss import SINGLE_RANK, LossCalibrator, completion_labels, sequence_log_probs
from megaloss.losses import ORPOOptions, orpo_loss, orpo_metrics, preference_weights

TOL = 1e-12
P, L, V = 5, 10, 6  # pairs, row length (prompt + completion + padding), vocabulary


def _close(a, b):
    return abs(a - b) <= TOL + TOL * abs(b)


def _max_err(a, b):
    return float((a - b).abs().max())


class _F64(torch.Tensor):
    """TRL's ORPO calls ``.float()`` on the log-probs; this keeps them float64."""

    def float(self):  # noqa: A003
        return self if self.is_floating_point() else super().float()


def _quiet_import(module):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return __import__(module, fromlist=["_"])


def _pairs(seed, scale=3.0, sharp=False):
    """TRL-style rows of ``P`` chosen then ``P`` rejected sequences: prompt, completion and
    padding of uneven lengths; ``[2P, L, V]`` float64 logits (``scale`` spreads them).
    ``sharp``: rows 0, 1 and ``P`` near-certain (their completion tokens' logits raised by 12:
    average log-probs above ``-ln 2``, ORPO's other ``log1mexp`` branch)."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, 4, (2 * P,), generator=g)
    completion = torch.tensor([1, 6, 3, 2, 5, 4, 1, 6, 2, 3])[: 2 * P]
    ids = torch.randint(0, V, (2 * P, L), generator=g)
    pos = torch.arange(L)[None]
    attention = (pos < (prompt + completion)[:, None]).long()
    is_completion = (pos >= prompt[:, None]) & (attention == 1)
    labels = torch.where(is_completion, ids, torch.full_like(ids, -100))
    logits = torch.randn(2 * P, L, V, generator=g, dtype=torch.float64) * scale
    if sharp:
        for row in (0, 1, P):
            for t in range(1, L):
                if labels[row, t] != -100:
                    logits[row, t - 1, ids[row, t]] += 12.0
    return ids, attention, labels, logits


def _token_log_probs(logits, ids, mask, trl=False):
    """Per-token log-probs of ``ids[:, 1:]`` (the next-token shift), 0 off ``mask[:, 1:]``.
    ``trl``: by TRL's ``selective_log_softmax`` (``trl/trainer/utils.py``, what its trainers
    use), so that near-certain tokens' log-probs (~1e-6, whose last bits differ between
    ``logsumexp`` and ``log_softmax``) are the same inputs on both sides."""
    target = torch.where(mask[:, 1:] != 0, ids[:, 1:], 0)
    if trl:
        selective = _quiet_import("trl.trainer.utils").selective_log_softmax
        lp = selective(logits[:, :-1], target)
    else:
        lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, target[..., None])[..., 0]
    return lp, (mask[:, 1:] != 0).long()


def _ours_sequences(logits, ids, attention, labels, trl=True):
    """Sequence log-probs and token counts, of the completions and of prompt + completion."""
    lp, mask = _token_log_probs(logits, ids, labels != -100, trl)
    seq, n = sequence_log_probs(lp, mask), mask.sum(-1)
    lp_all, mask_all = _token_log_probs(logits, ids, attention, trl)
    return seq, n, sequence_log_probs(lp_all, mask_all), mask_all.sum(-1)


def _trl_batch(ids, attention, labels):
    return {"chosen_input_ids": ids[:P], "chosen_attention_mask": attention[:P],
            "chosen_labels": labels[:P], "rejected_input_ids": ids[P:],
            "rejected_attention_mask": attention[P:], "rejected_labels": labels[P:]}


def _accelerator():
    return SimpleNamespace(device="cpu", gather=lambda x: x, gather_for_metrics=lambda x: x)


# --- ORPO ---------------------------------------------------------------------------------------

def _trl_orpo(beta, logits, ids, attention, labels):
    ORPOTrainer = _quiet_import("trl.experimental.orpo.orpo_trainer").ORPOTrainer
    fake = SimpleNamespace(beta=beta, is_encoder_decoder=False, padding_value=0,
                           accelerator=_accelerator(), aux_loss_enabled=False,
                           concatenated_inputs=ORPOTrainer.concatenated_inputs,
                           get_batch_logps=ORPOTrainer.get_batch_logps)
    fake.concatenated_forward = lambda model, batch: ORPOTrainer.concatenated_forward(
        fake, model, batch)
    fake.odds_ratio_loss = lambda c, r: ORPOTrainer.odds_ratio_loss(
        fake, c.as_subclass(_F64), r.as_subclass(_F64))
    model = lambda input_ids, **kw: SimpleNamespace(logits=logits)  # noqa: E731
    return ORPOTrainer.get_batch_loss_metrics(fake, model, _trl_batch(ids, attention, labels))


def _liger_orpo(beta, chosen_avg, rejected_avg, nll):
    """Liger-Kernel ``test/chunked_loss/test_orpo_loss.py``, ``HF_ORPO_Loss.odds_ratio_loss`` and
    ``get_batch_loss_metrics``: ``log1p(-exp(x))`` without TRL's branch."""
    log_odds = (chosen_avg - rejected_avg) - (
        torch.log1p(-torch.exp(chosen_avg)) - torch.log1p(-torch.exp(rejected_avg)))
    losses = beta * F.logsigmoid(log_odds)
    return nll - losses.mean()


@pytest.mark.slow  # importing TRL's trainers (transformers, datasets, accelerate) takes ~7 s
@pytest.mark.parametrize("beta,scale,sharp", [(0.1, 3.0, False), (1.0, 0.5, False),
                                              (0.25, 6.0, False), (0.1, 2.0, True),
                                              (1.0, 0.5, True)])
def test_orpo_matches_trl(beta, scale, sharp):
    ids, attention, labels, logits = _pairs(11, scale, sharp)
    ours_logits = logits.clone().requires_grad_()
    seq, n, seq_all, n_all = _ours_sequences(ours_logits, ids, attention, labels)
    out = orpo_loss(seq[:P], seq[P:], chosen_lengths=n[:P], rejected_lengths=n[P:],
                    nll_log_probs=seq_all[:P], nll_lengths=n_all[:P], beta=beta,
                    return_stats=True)
    trl_logits = logits.clone().requires_grad_()
    ref_loss, ref_metrics = _trl_orpo(beta, trl_logits, ids, attention, labels)
    assert torch.isfinite(ref_loss)
    err = abs(float(out.loss.detach()) - float(ref_loss.detach()))
    assert _close(float(out.loss.detach()), float(ref_loss.detach())), (out.loss, ref_loss)
    out.loss.backward()
    ref_loss.backward()
    err = max(err, _max_err(ours_logits.grad, trl_logits.grad))
    torch.testing.assert_close(ours_logits.grad, trl_logits.grad, rtol=TOL, atol=TOL)
    for name, value in orpo_metrics(out.stats, group=SINGLE_RANK).items():
        theirs = ref_metrics[name]
        if name == "rewards/accuracies":  # TRL's mean of float32 flags
            value = float(torch.tensor(value, dtype=torch.float32))
        assert _close(value, theirs), (name, value, theirs)
    print(f"ORPO vs TRL beta={beta} scale={scale} sharp={sharp}: max abs error {err:.3g}")


@pytest.mark.parametrize("beta,scale", [(0.1, 3.0), (2.0, 0.5)])
def test_orpo_matches_liger_formula(beta, scale):
    """Against Liger's torch reference, gradients w.r.t. the sequence log-probs; the NLL on the
    chosen completions (megaloss's default). Average log-probs below ``-ln 2`` only: above,
    Liger's ``log1p(-exp(a))`` cancels (~1e-11 off at ``a ~ -1e-5``), where TRL's branch and
    megaloss's use ``log(-expm1(a))``."""
    ids, attention, labels, logits = _pairs(12, scale)
    lp, mask = _token_log_probs(logits, ids, labels != -100)
    seq = sequence_log_probs(lp, mask).detach()
    n = mask.sum(-1)
    ours, theirs = seq.clone().requires_grad_(), seq.clone().requires_grad_()
    loss = orpo_loss(ours[:P], ours[P:], chosen_lengths=n[:P], rejected_lengths=n[P:],
                     options=ORPOOptions(beta=beta))
    nll = -theirs[:P].sum() / n[:P].sum()
    ref = _liger_orpo(beta, theirs[:P] / n[:P], theirs[P:] / n[P:], nll)
    assert _close(float(loss.detach()), float(ref.detach()))
    loss.backward()
    ref.backward()
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=TOL, atol=TOL)
    err = max(abs(float(loss.detach()) - float(ref.detach())), _max_err(ours.grad, theirs.grad))
    print(f"ORPO vs Liger beta={beta}: max abs error {err:.3g}")


def test_cases_reach_both_regions():
    """The ORPO cases with ``sharp`` have completions on both sides of ``log1mexp``'s branch at
    ``-ln 2``; the CPO hinge cases (large margins) have pairs clipped and active."""
    ids, attention, labels, logits = _pairs(11, 2.0, True)
    seq, n, _, _ = _ours_sequences(logits, ids, attention, labels, trl=False)
    avg = seq / n
    assert (avg > -math.log(2)).any() and (avg < -math.log(2)).any()
    ids, attention, labels, logits = _pairs(21, 4.0)  # test_cpo_matches_trl's large margins
    seq, n, _, _ = _ours_sequences(logits, ids, attention, labels, trl=False)
    for beta in (0.1, 0.5):
        z = beta * (seq[:P] - seq[P:])
        assert (z > 1).any() and (z < 1).any(), (beta, z)


def test_orpo_split_micro_batches_sum_to_the_whole_batch():
    """Pairs split 2 / 0 (padding) / 3 over micro-batches, weighted by the step's global pair
    and token counts: loss, gradient and metrics equal the single call on all pairs."""
    ids, attention, labels, logits = _pairs(13)
    lp, mask = _token_log_probs(logits, ids, labels != -100)
    seq = sequence_log_probs(lp, mask).detach()
    n = mask.sum(-1)
    whole = seq.clone().requires_grad_()
    expected = orpo_loss(whole[:P], whole[P:], chosen_lengths=n[:P], rejected_lengths=n[P:],
                         return_stats=True)
    expected.loss.backward()
    split = seq.clone().requires_grad_()
    pad, pad_n = torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.long)
    cuts = [(0, 2), None, (2, P)]
    step = LossCalibrator(loss_reduction="sample", weight_dtype=torch.float64).begin_step(
        [completion_labels(mask[:2]), torch.full((2, L - 1), -100), completion_labels(mask[2:P])])
    total, stats = torch.zeros((), dtype=torch.float64), []
    for i, c in enumerate(cuts):
        w = preference_weights(step, i)
        if c is None:
            args = (pad, pad, pad_n, pad_n)
        else:
            a, b = c
            args = (split[a:b], split[P + a:P + b], n[a:b], n[P + a:P + b])
        out = orpo_loss(args[0], args[1], chosen_lengths=args[2], rejected_lengths=args[3],
                        pair_weights=w.pair_weights, nll_weight=w.nll_weight, return_stats=True)
        total = total + step.loss_for_backward(out.loss)
        stats.append(out.stats)
    total.backward()
    assert _close(float(step.global_loss()), float(expected.loss.detach()))
    torch.testing.assert_close(split.grad, whole.grad, rtol=TOL, atol=TOL)
    assert orpo_metrics(stats, group=SINGLE_RANK) == pytest.approx(
        orpo_metrics(expected.stats, group=SINGLE_RANK), rel=TOL, abs=TOL)


def test_orpo_bad_inputs_name_the_argument():
    x = -torch.rand(3, dtype=torch.float64)
    n = torch.ones(3)
    with pytest.raises(ValueError, match="chosen_lengths is required"):
        orpo_loss(x, x, rejected_lengths=n)
    with pytest.raises(ValueError, match="rejected_log_probs must have shape"):
        orpo_loss(x, x[:2], chosen_lengths=n, rejected_lengths=n)
    with pytest.raises(ValueError, match="rejected_lengths must be a"):
        orpo_loss(x, x, chosen_lengths=n, rejected_lengths=n[:2])
    with pytest.raises(ValueError, match="chosen_log_probs must be a floating"):
        orpo_loss(n.long(), x, chosen_lengths=n, rejected_lengths=n)
    with pytest.raises(ValueError, match="pair_weights must be a"):
        orpo_loss(x, x, chosen_lengths=n, rejected_lengths=n, pair_weights=n[:1])
    with pytest.raises(ValueError, match="nll_weight must be a scalar"):
        orpo_loss(x, x, chosen_lengths=n, rejected_lengths=n, nll_weight=n)
    with pytest.raises(ValueError, match="nll_lengths needs nll_log_probs"):
        orpo_loss(x, x, chosen_lengths=n, rejected_lengths=n, nll_lengths=n)
    for beta in (0.0, -0.1, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="beta must be a finite number > 0"):
            ORPOOptions(beta=beta)
    with pytest.raises(ValueError, match="beta must be"):
        orpo_loss(x, x, chosen_lengths=n, rejected_lengths=n, beta=-1.0)
    with pytest.raises(ValueError, match="stats must be"):
        orpo_metrics(torch.zeros(3), group=SINGLE_RANK)
    assert math.isfinite(float(orpo_loss(x, x, chosen_lengths=n, rejected_lengths=n)))


# --- CPO / SimPO --------------------------------------------------------------------------------

# (loss_type, beta, label_smoothing, cpo_alpha, simpo_gamma)
CPO_CASES = [
    ("sigmoid", 0.1, 0.0, 1.0, 0.5), ("sigmoid", 1.0, 0.2, 0.0, 0.5),
    ("hinge", 0.1, 0.0, 1.0, 0.5), ("hinge", 0.5, 0.0, 0.5, 0.5),
    ("ipo", 0.5, 0.0, 1.0, 0.5), ("ipo", 2.0, 0.0, 0.0, 0.5),
    ("simpo", 2.0, 0.0, 0.0, 1.0), ("simpo", 0.1, 0.1, 0.0, 0.5), ("simpo", 2.5, 0.0, 0.3, 1.4),
]


def _trl_cpo(case, logits, ids, attention, labels):
    loss_type, beta, label_smoothing, cpo_alpha, simpo_gamma = case
    CPOTrainer = _quiet_import("trl.experimental.cpo.cpo_trainer").CPOTrainer
    fake = SimpleNamespace(beta=beta, loss_type=loss_type, label_smoothing=label_smoothing,
                           cpo_alpha=cpo_alpha, simpo_gamma=simpo_gamma, alpha=0.0,
                           is_encoder_decoder=False, pad_token_id=0, accelerator=_accelerator(),
                           aux_loss_enabled=False,
                           concatenated_inputs=CPOTrainer.concatenated_inputs,
                           get_batch_logps=CPOTrainer.get_batch_logps)
    fake.concatenated_forward = lambda model, batch: CPOTrainer.concatenated_forward(
        fake, model, batch)
    fake.cpo_loss = lambda c, r: CPOTrainer.cpo_loss(fake, c, r)
    model = lambda input_ids, **kw: SimpleNamespace(logits=logits)  # noqa: E731
    return CPOTrainer.get_batch_loss_metrics(fake, model, _trl_batch(ids, attention, labels))


def _liger_cpo(case, chosen, rejected, nll):
    """Liger-Kernel ``test/chunked_loss/test_cpo_loss.py``, ``HFCPOLoss.alignment_loss`` (its
    ``"sigmoid"`` and ``"simpo"``; ``test/chunked_loss/test_simpo_loss.py`` checks SimPO against
    it), plus ``alpha`` times the chosen NLL."""
    loss_type, beta, label_smoothing, alpha, simpo_gamma = case
    logits = chosen - rejected
    if loss_type == "simpo":
        logits = logits - (simpo_gamma / beta)
    losses = (-F.logsigmoid(beta * logits) * (1 - label_smoothing)
              - F.logsigmoid(-beta * logits) * label_smoothing)
    return losses.mean() + alpha * nll


@pytest.mark.slow  # importing TRL's trainers (transformers, datasets, accelerate) takes ~7 s
@pytest.mark.parametrize("scale", [0.5, 4.0], ids=["small_margins", "large_margins"])
@pytest.mark.parametrize("case", CPO_CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}-{c[3]}")
def test_cpo_matches_trl(case, scale):
    from megaloss.losses import CPOOptions, cpo_loss, cpo_metrics

    loss_type, beta, label_smoothing, cpo_alpha, simpo_gamma = case
    opts = CPOOptions(loss_type=loss_type, beta=beta, label_smoothing=label_smoothing,
                      cpo_alpha=cpo_alpha, simpo_gamma=simpo_gamma)
    ids, attention, labels, logits = _pairs(21, scale)
    ours_logits = logits.clone().requires_grad_()
    seq, n, _, _ = _ours_sequences(ours_logits, ids, attention, labels)
    out = cpo_loss(seq[:P], seq[P:], chosen_lengths=n[:P], rejected_lengths=n[P:], options=opts,
                   return_stats=True)
    trl_logits = logits.clone().requires_grad_()
    ref_loss, ref_metrics = _trl_cpo(case, trl_logits, ids, attention, labels)
    assert torch.isfinite(ref_loss)
    err = abs(float(out.loss.detach()) - float(ref_loss.detach()))
    assert _close(float(out.loss.detach()), float(ref_loss.detach())), (out.loss, ref_loss)
    out.loss.backward()
    ref_loss.backward()
    err = max(err, _max_err(ours_logits.grad, trl_logits.grad))
    torch.testing.assert_close(ours_logits.grad, trl_logits.grad, rtol=TOL, atol=TOL)
    for name, value in cpo_metrics(out.stats, group=SINGLE_RANK).items():
        theirs = ref_metrics[name]
        if name == "rewards/accuracies":  # TRL's mean of float32 flags
            value = float(torch.tensor(value, dtype=torch.float32))
        assert _close(value, theirs), (name, value, theirs)
    print(f"CPO vs TRL {case} scale={scale}: max abs error {err:.3g}")


@pytest.mark.parametrize("case", [c for c in CPO_CASES if c[0] in ("sigmoid", "simpo")],
                         ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}-{c[3]}")
def test_cpo_simpo_match_liger_formula(case):
    """Against Liger's torch reference, gradients w.r.t. the sequence log-probs; ``simpo``
    through :func:`simpo_loss` when it has no NLL."""
    from megaloss.losses import cpo_loss, simpo_loss

    loss_type, beta, label_smoothing, cpo_alpha, simpo_gamma = case
    ids, attention, labels, logits = _pairs(22, 3.0)
    lp, mask = _token_log_probs(logits, ids, labels != -100)
    seq = sequence_log_probs(lp, mask).detach()
    n = mask.sum(-1)
    ours, theirs = seq.clone().requires_grad_(), seq.clone().requires_grad_()
    kw = dict(chosen_lengths=n[:P], rejected_lengths=n[P:], beta=beta,
              label_smoothing=label_smoothing, cpo_alpha=cpo_alpha, simpo_gamma=simpo_gamma)
    if loss_type == "simpo":
        loss = simpo_loss(ours[:P], ours[P:], **kw)
        c, r = theirs[:P] / n[:P], theirs[P:] / n[P:]
    else:
        loss = cpo_loss(ours[:P], ours[P:], loss_type=loss_type, **kw)
        c, r = theirs[:P], theirs[P:]
    ref = _liger_cpo(case, c, r, -theirs[:P].sum() / n[:P].sum())
    assert _close(float(loss.detach()), float(ref.detach()))
    loss.backward()
    ref.backward()
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=TOL, atol=TOL)
    err = max(abs(float(loss.detach()) - float(ref.detach())), _max_err(ours.grad, theirs.grad))
    print(f"CPO/SimPO vs Liger {case}: max abs error {err:.3g}")


def test_cpo_bad_inputs_name_the_argument():
    from megaloss.losses import CPOOptions, cpo_loss, cpo_metrics, simpo_loss

    x = -torch.rand(3, dtype=torch.float64)
    n = torch.ones(3)
    with pytest.raises(ValueError, match="chosen_lengths is required"):
        cpo_loss(x, x, loss_type="ipo", rejected_lengths=n)
    with pytest.raises(ValueError, match="rejected_lengths is required"):
        simpo_loss(x, x, chosen_lengths=n)
    with pytest.raises(ValueError, match="chosen_lengths is required for the NLL"):
        cpo_loss(x, x)
    assert math.isfinite(float(cpo_loss(x, x, cpo_alpha=0.0)))
    with pytest.raises(ValueError, match="rejected_log_probs must have shape"):
        cpo_loss(x, x[:2], chosen_lengths=n)
    with pytest.raises(ValueError, match="chosen_lengths must be a"):
        cpo_loss(x, x, chosen_lengths=n[:1])
    with pytest.raises(ValueError, match="pair_weights must be a"):
        cpo_loss(x, x, chosen_lengths=n, pair_weights=n[:2])
    for kwargs, match in [(dict(loss_type="kto_pair"), "loss_type must be one of"),
                          (dict(beta=0.0), "beta must be a finite number > 0"),
                          (dict(beta=-1.0), "beta must be a finite number > 0"),
                          (dict(label_smoothing=0.6), "label_smoothing must be a float"),
                          (dict(loss_type="hinge", label_smoothing=0.1),
                           "label_smoothing must be 0 for loss_type='hinge'"),
                          (dict(cpo_alpha=-1.0), "cpo_alpha must be a float"),
                          (dict(cpo_alpha=float("inf")), "cpo_alpha must be finite"),
                          (dict(simpo_gamma=-0.5), "simpo_gamma must be a float")]:
        with pytest.raises(ValueError, match=match):
            CPOOptions(**kwargs)
    with pytest.raises(ValueError, match="beta must be"):
        simpo_loss(x, x, chosen_lengths=n, rejected_lengths=n, beta=-2.0)
    with pytest.raises(TypeError, match="beta"):
        cpo_loss(x, x, chosen_lengths=n, beta=0.5, options=CPOOptions())
    with pytest.raises(ValueError, match="stats must be"):
        cpo_metrics(torch.zeros(4), group=SINGLE_RANK)


# --- KTO ----------------------------------------------------------------------------------------

B, T = 8, 7


def _kto_batch(seed, large, labels=(1, 0, 1, 1, 0, 0, 1, 0)):
    """Per-token policy log-probs ``[B, T]`` of the completions (uneven lengths) and of the KL
    (mismatched) completions, sequence reference log-probs of both, the masks and labels."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 2, 4, 1, 3, 5, 6, 2])
    kl_lengths = torch.roll(lengths, 1)  # TRL cycles the completions by one within the batch
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    kl_mask = (torch.arange(T)[None] < kl_lengths[:, None]).long()
    lp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    kl_lp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    seq = torch.where(mask != 0, lp, 0.0).sum(-1)
    kl_seq = torch.where(kl_mask != 0, kl_lp, 0.0).sum(-1)
    if large:
        shift = torch.tensor([-60.0, 45.0, 0.5, -8.0, 30.0, 2.0, 50.0, -40.0], dtype=torch.float64)
        ref = seq - shift
        ref_kl = kl_seq - 3.0 + torch.rand(B, generator=g, dtype=torch.float64)  # z0 ~ 2.5
    else:
        ref = -torch.rand(B, generator=g, dtype=torch.float64) * 4
        ref_kl = kl_seq - torch.rand(B, generator=g, dtype=torch.float64) + 0.3
    return lp, kl_lp, ref, ref_kl, mask, kl_mask, torch.tensor(labels, dtype=torch.bool)


def _trl_kto(opts, lp, kl_lp, ref, ref_kl, mask, kl_mask, labels):
    KTOTrainer = _quiet_import("trl.trainer.kto_trainer").KTOTrainer
    prompt = torch.zeros(B, 1, dtype=torch.long)  # TRL's masks are on the unshifted ids
    ids, kl_ids = torch.zeros(B, T + 1, dtype=torch.long), torch.ones(B, T + 1, dtype=torch.long)

    def outputs(per_token):
        return SimpleNamespace(log_probs=per_token, entropy=torch.zeros(B, T),
                               mean_logits=torch.zeros(B, T))

    main = outputs(torch.where(mask != 0, lp, 0.0))
    kl_out = outputs(torch.where(kl_mask != 0, kl_lp, 0.0))
    model = lambda input_ids, **kw: kl_out if input_ids is kl_ids else main  # noqa: E731
    fake = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=_accelerator(), aux_loss_enabled=False,
        precompute_ref_logps=True, calculate_KL=opts.loss_type == "kto",
        loss_type=opts.loss_type, beta=opts.beta, desirable_weight=opts.desirable_weight,
        undesirable_weight=opts.undesirable_weight,
        _metrics={"train": collections.defaultdict(list)}, _total_train_tokens=0, _tp_size=1)
    fake._compute_kl_logps = lambda m, batch: KTOTrainer._compute_kl_logps(fake, m, batch)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
              "completion_mask": torch.cat([prompt, mask], 1), "label": labels.long(),
              "ref_logps": ref, "KL_input_ids": kl_ids, "KL_attention_mask": torch.ones_like(ids),
              "KL_completion_mask": torch.cat([prompt, kl_mask], 1), "ref_KL_logps": ref_kl}
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # TRL's empty / zero KL tensors use the default
    try:
        loss = KTOTrainer._compute_loss(fake, model, inputs, False)
    finally:
        torch.set_default_dtype(default)
    return loss, {k: v[-1] for k, v in fake._metrics["train"].items()}


KTO_CASES = [("kto", 0.1, 1.0, 1.0), ("kto", 1.0, 1.33, 1.0), ("kto", 0.5, 1.0, 2.0),
             ("apo_zero_unpaired", 0.1, 1.0, 1.0), ("apo_zero_unpaired", 1.0, 0.8, 1.5)]


@pytest.mark.slow  # importing TRL's trainer (transformers, datasets, accelerate) takes ~7 s
@pytest.mark.parametrize("labels", [(1, 0, 1, 1, 0, 0, 1, 0), (1,) * B],
                         ids=["mixed", "all_desirable"])
@pytest.mark.parametrize("large", [False, True], ids=["small_margins", "large_margins"])
@pytest.mark.parametrize("case", KTO_CASES, ids=lambda c: "-".join(map(str, c)))
def test_kto_matches_trl(case, large, labels):
    from megaloss.losses import KTOOptions, kto_kl_baseline, kto_loss, kto_metrics

    opts = KTOOptions(*case)
    lp, kl_lp, ref, ref_kl, mask, kl_mask, desirable = _kto_batch(31, large, labels)
    ours, theirs = lp.clone().requires_grad_(), lp.clone().requires_grad_()
    seq = sequence_log_probs(ours, mask)
    kl_seq = sequence_log_probs(kl_lp, kl_mask)
    z0 = kto_kl_baseline(kl_seq, ref_kl, group=SINGLE_RANK) if opts.loss_type == "kto" else None
    out = kto_loss(seq, ref, desirable, kl=z0, options=opts, return_stats=True)
    ref_loss, ref_metrics = _trl_kto(opts, theirs, kl_lp, ref, ref_kl, mask, kl_mask, desirable)
    assert torch.isfinite(ref_loss)
    err = abs(float(out.loss.detach()) - float(ref_loss.detach()))
    assert _close(float(out.loss.detach()), float(ref_loss.detach())), (out.loss, ref_loss)
    out.loss.backward()
    ref_loss.backward()
    err = max(err, _max_err(ours.grad, theirs.grad))
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=TOL, atol=TOL)
    for name, value in kto_metrics(out.stats, group=SINGLE_RANK).items():
        if name in ref_metrics:  # TRL logs no rejected / margin metrics without such examples
            assert _close(value, ref_metrics[name]), (name, value, ref_metrics[name])
    if opts.loss_type == "kto" and large:
        assert float(z0) > 1.0  # the baseline is exercised, not clamped to 0
    print(f"KTO vs TRL {case} large={large} labels={labels}: max abs error {err:.3g}")


def _liger_kto(beta, chosen, rejected, ref_chosen, ref_rejected, kl):
    """Liger-Kernel ``test/chunked_loss/test_kto_loss.py``, ``HFKTOLoss.alignment_loss``
    (``desirable_weight = undesirable_weight = 1``), the mean over the examples."""
    chosen_losses = 1 - torch.sigmoid(beta * ((chosen - ref_chosen) - kl))
    rejected_losses = 1 - torch.sigmoid(beta * (kl - (rejected - ref_rejected)))
    return torch.cat((chosen_losses, rejected_losses), 0).mean()


@pytest.mark.parametrize("beta,kl", [(0.1, 0.0), (0.5, 1.5), (2.0, 0.25)])
def test_kto_matches_liger_formula(beta, kl):
    from megaloss.losses import kto_loss

    lp, _, ref, _, mask, _, desirable = _kto_batch(32, False)
    seq = sequence_log_probs(lp, mask)
    ours, theirs = seq.clone().requires_grad_(), seq.clone().requires_grad_()
    loss = kto_loss(ours, ref, desirable, kl=kl, beta=beta)
    ref_loss = _liger_kto(beta, theirs[desirable], theirs[~desirable], ref[desirable],
                          ref[~desirable], torch.tensor(kl, dtype=torch.float64))
    assert _close(float(loss.detach()), float(ref_loss.detach()))
    loss.backward()
    ref_loss.backward()
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=TOL, atol=TOL)
    err = max(abs(float(loss.detach()) - float(ref_loss.detach())),
              _max_err(ours.grad, theirs.grad))
    print(f"KTO vs Liger beta={beta} kl={kl}: max abs error {err:.3g}")


def test_kto_bad_inputs_name_the_argument():
    from megaloss.losses import KTOOptions, kto_kl_baseline, kto_loss, kto_metrics

    x = -torch.rand(3, dtype=torch.float64)
    d = torch.tensor([True, False, True])
    with pytest.raises(ValueError, match="ref_log_probs must have shape"):
        kto_loss(x, x[:2], d)
    with pytest.raises(ValueError, match="desirable must be a"):
        kto_loss(x, x, d[:2])
    with pytest.raises(ValueError, match="desirable must be a"):
        kto_loss(x, x, d.double())
    with pytest.raises(ValueError, match="kl must be a scalar"):
        kto_loss(x, x, d, kl=x)
    with pytest.raises(ValueError, match="sample_weights must be a"):
        kto_loss(x, x, d, sample_weights=x[:1])
    for kwargs, match in [(dict(loss_type="bco"), "loss_type must be one of"),
                          (dict(beta=-0.1), "beta must be a finite number > 0"),
                          (dict(desirable_weight=0.0), "desirable_weight must be a finite"),
                          (dict(undesirable_weight=float("nan")), "undesirable_weight must be")]:
        with pytest.raises(ValueError, match=match):
            KTOOptions(**kwargs)
    with pytest.raises(ValueError, match="beta must be"):
        kto_loss(x, x, d, beta=0.0)
    with pytest.raises(ValueError, match="convention must be one of"):
        kto_kl_baseline(x, x, convention="rank")
    with pytest.raises(ValueError, match="ref_kl_log_probs must have shape"):
        kto_kl_baseline(x, x[:1], group=SINGLE_RANK)
    with pytest.raises(ValueError, match="as many micro-batches"):
        kto_kl_baseline([x, x], [x], group=SINGLE_RANK)
    with pytest.raises(ValueError, match="stats must be"):
        kto_metrics(torch.zeros(3), group=SINGLE_RANK)
    assert float(kto_kl_baseline(x, x + 1.0, group=SINGLE_RANK)) == 0.0  # clamped at 0


# --- global normalisation over DP ranks x accumulation steps -----------------------------------

N_PAIRS, T_MAX = 7, 6
# per rank, the step's micro-batches as slices of the global rows (None: a micro-batch of two
# padding rows, without pairs)
SPLITS = {"pairs": [[(0, 3), (3, 4)], [(4, 7), None]], "kto": [[(0, 3), (3, 5)], [(5, 9), None]]}


def _global_rows(n, seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T_MAX + 1, (n,), generator=g)
    per_token = -(torch.rand(n, generator=g, dtype=torch.float64) * 2.5 + 0.05)
    return per_token * lengths, lengths


def _labels(lengths):
    return completion_labels((torch.arange(T_MAX)[None] < lengths[:, None]).long())


def _pieces(rank, kind, *tensors):
    """This rank's micro-batches: per micro-batch, the slices of ``tensors`` (zeros for a
    padding micro-batch)."""
    out = []
    for cut in SPLITS[kind][rank]:
        if cut is None:
            out.append([torch.zeros(2, dtype=t.dtype) for t in tensors])
        else:
            out.append([t[cut[0]:cut[1]] for t in tensors])
    return out


def _backward(loss):
    if loss.requires_grad:  # a padding micro-batch's loss (0) reaches no leaf
        loss.backward()


def _preference_worker(rank, world_size):
    import torch.distributed as dist

    from megaloss.calibration.engine_scale import EngineScale
    from megaloss.losses import (
        CPOOptions,
        cpo_loss,
        cpo_metrics,
        kto_kl_baseline,
        kto_loss,
        kto_metrics,
    )

    # plain backward on each rank, the gradients summed below (c = 1 over the 2 ranks)
    summed = EngineScale("all_reduce_sum", 1.0, 1.0, 2, world_size, 1.0, (0, 1))

    def calibrator():
        return LossCalibrator(loss_reduction="sample", weight_dtype=torch.float64,
                              engine_scale=summed)

    errors = {}

    def check(name, single_loss, single_grad, leaf, step, metrics, single_metrics):
        grad = torch.zeros_like(leaf) if leaf.grad is None else leaf.grad.clone()
        dist.all_reduce(grad)  # each rank's gradient covers its own rows
        err = max(abs(float(step.global_loss()) - float(single_loss)),
                  _max_err(grad, single_grad))
        for key, value in metrics.items():
            err = max(err, abs(value - single_metrics[key]))
        errors[name] = err

    # ORPO and CPO / SimPO: pairs
    c, n_c = _global_rows(N_PAIRS, 41)
    r, n_r = _global_rows(N_PAIRS, 42)
    families = [("orpo", orpo_loss, orpo_metrics, {}),
                ("cpo_sigmoid", cpo_loss, cpo_metrics, dict(options=CPOOptions(beta=0.5))),
                ("cpo_ipo", cpo_loss, cpo_metrics,
                 dict(options=CPOOptions(loss_type="ipo", beta=0.5, cpo_alpha=0.7))),
                ("simpo", cpo_loss, cpo_metrics,
                 dict(options=CPOOptions(loss_type="simpo", beta=2.0, simpo_gamma=1.0,
                                         cpo_alpha=0.0)))]
    for name, fn, metrics_fn, kw in families:
        whole = c.clone().requires_grad_()
        single = fn(whole, r, chosen_lengths=n_c, rejected_lengths=n_r, return_stats=True, **kw)
        single.loss.backward()
        leaf = c.clone().requires_grad_()
        parts = _pieces(rank, "pairs", leaf, r, n_c, n_r)
        step = calibrator().begin_step([_labels(p[2]) for p in parts])
        stats = []
        for i, (pc, pr, pnc, pnr) in enumerate(parts):
            w = preference_weights(step, i)
            out = fn(pc, pr, chosen_lengths=pnc, rejected_lengths=pnr, pair_weights=w.pair_weights,
                     nll_weight=w.nll_weight, return_stats=True, **kw)
            _backward(step.loss_for_backward(out.loss))
            stats.append(out.stats)
        check(name, single.loss.detach(), whole.grad, leaf, step, metrics_fn(stats),
              metrics_fn(single.stats, group=SINGLE_RANK))

    # KTO: examples, with the step's KL baseline
    lp, n = _global_rows(9, 43)
    ref = lp + torch.linspace(-3.0, 4.0, 9, dtype=torch.float64)
    kl_lp, kl_n = _global_rows(9, 44)
    ref_kl = kl_lp - torch.linspace(0.5, 2.5, 9, dtype=torch.float64)
    good = torch.tensor([1, 0, 0, 1, 1, 0, 1, 0, 1], dtype=torch.bool)
    for loss_type in ("kto", "apo_zero_unpaired"):
        z0_single = kto_kl_baseline(kl_lp, ref_kl, kl_lengths=kl_n, group=SINGLE_RANK)
        whole = lp.clone().requires_grad_()
        single = kto_loss(whole, ref, good, kl=z0_single, loss_type=loss_type, beta=0.5,
                          desirable_weight=1.2, return_stats=True)
        single.loss.backward()
        leaf = lp.clone().requires_grad_()
        parts = _pieces(rank, "kto", leaf, ref, n, kl_lp, ref_kl, kl_n, good)
        z0 = kto_kl_baseline([p[3] for p in parts], [p[4] for p in parts],
                             kl_lengths=[p[5] for p in parts])
        step = calibrator().begin_step([_labels(p[2]) for p in parts])
        stats = []
        for i, p in enumerate(parts):
            out = kto_loss(p[0], p[1], p[6], kl=z0, loss_type=loss_type, beta=0.5,
                           desirable_weight=1.2, sample_weights=preference_weights(step, i)[0],
                           return_stats=True)
            _backward(step.loss_for_backward(out.loss))
            stats.append(out.stats)
        check(f"kto_{loss_type}", single.loss.detach(), whole.grad, leaf, step,
              kto_metrics(stats), kto_metrics(single.stats, group=SINGLE_RANK))
        errors[f"kto_{loss_type}_z0"] = abs(float(z0) - float(z0_single))
    return errors


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_two_ranks_two_accumulation_steps_sum_to_the_single_process_loss():
    """2 DP ranks x GAS 2, uneven micro-batches (3 / 1 and 3 / padding pairs; 3 / 2 and
    4 / padding KTO examples): the global loss, the gradient summed over the ranks, the metrics
    and KTO's KL baseline equal the single process's on all rows."""
    from megaloss.testing import run_distributed

    results = run_distributed(_preference_worker, 2, timeout=200)
    for errors in results:
        for name, err in errors.items():
            assert err <= TOL, (name, err)
    print("2 ranks x GAS 2, worst error per loss:",
          {k: max(e[k] for e in results) for k in results[0]})


def test_micro_batch_convention_is_the_mean_of_micro_batch_means():
    """``preference_weights(convention="micro_batch")`` (TRL's trainers): the step's loss is the
    mean over the micro-batches of each one's own (TRL) loss."""
    c, n_c = _global_rows(N_PAIRS, 45)
    r, n_r = _global_rows(N_PAIRS, 46)
    cuts = [(0, 2), (2, 7)]
    step = LossCalibrator(loss_reduction="sample", weight_dtype=torch.float64).begin_step(
        [_labels(n_c[a:b]) for a, b in cuts])
    total, expected = 0.0, 0.0
    for i, (a, b) in enumerate(cuts):
        w = preference_weights(step, i, convention="micro_batch")
        kw = dict(chosen_lengths=n_c[a:b], rejected_lengths=n_r[a:b])
        total += float(orpo_loss(c[a:b], r[a:b], pair_weights=w.pair_weights,
                                 nll_weight=w.nll_weight, **kw))
        expected += float(orpo_loss(c[a:b], r[a:b], **kw)) / len(cuts)
    assert _close(total, expected)
    with pytest.raises(ValueError, match="convention must be one of"):
        preference_weights(step, 0, convention="mean")
