"""megaloss.losses.preference: the options' type picks the loss, and the dispatch gives exactly
(bit for bit, loss, stats and gradient) the selected loss function called on the rows as the
preference step and the DPO job's evaluation split them (chosen rows, then rejected; KTO one
example a row)."""
import pytest
import torch

from megaloss.integrations.step import preference as step_checks
from megaloss.losses import (
    CPOOptions,
    DPOOptions,
    KTOOptions,
    ORPOOptions,
    cpo_loss,
    dpo_loss,
    kto_loss,
    orpo_loss,
    sequence_preference_loss,
)
from megaloss.losses.preference import PREFERENCE_LOSSES, preference_loss_kind

P = 4


def _rows(seed):
    g = torch.Generator().manual_seed(seed)
    seq = (-5.0 * torch.rand(2 * P, generator=g, dtype=torch.float64)).requires_grad_()
    ref = -5.0 * torch.rand(2 * P, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, 9, (2 * P,), generator=g)
    weights = torch.rand(2 * P, generator=g, dtype=torch.float64)
    return seq, ref, lengths, weights


def _direct(opts, seq, ref, lengths, weights, nll, desirable, kl):
    c, r = seq[:P], seq[P:]
    pair = dict(chosen_lengths=lengths[:P], rejected_lengths=lengths[P:],
                pair_weights=weights[:P], options=opts, return_stats=True)
    if isinstance(opts, DPOOptions):
        return dpo_loss(c, r, ref[:P], ref[P:], **pair)
    if isinstance(opts, CPOOptions):
        return cpo_loss(c, r, nll_weight=nll, **pair)
    if isinstance(opts, ORPOOptions):
        return orpo_loss(c, r, nll_weight=nll, **pair)
    return kto_loss(seq, ref, desirable, kl=kl, sample_weights=weights, options=opts,
                    return_stats=True)


CASES = [DPOOptions(beta=0.2), DPOOptions(loss_type="ipo", beta=0.3),
         CPOOptions(loss_type="sigmoid", beta=0.1), CPOOptions(loss_type="simpo", beta=2.0,
                                                               cpo_alpha=0.0),
         ORPOOptions(beta=0.1), KTOOptions(beta=0.1)]


@pytest.mark.parametrize("opts", CASES, ids=lambda o: f"{type(o).__name__}-"
                         f"{getattr(o, 'loss_type', '')}")
def test_dispatch_is_the_selected_loss_bit_for_bit(opts):
    seq, ref, lengths, weights = _rows(0)
    kto = isinstance(opts, KTOOptions)
    nll = torch.tensor(0.05, dtype=torch.float64)
    desirable = torch.arange(2 * P) < P
    kl = torch.tensor(0.3, dtype=torch.float64)
    want = _direct(opts, seq, ref, lengths, weights, nll, desirable, kl)
    (want_grad,) = torch.autograd.grad(want.loss, seq)
    got = sequence_preference_loss(seq, opts, lengths=lengths, ref_log_probs=ref,
                                   desirable=desirable, kl=kl,
                                   weights=weights if kto else weights[:P], nll_weight=nll,
                                   return_stats=True)
    (got_grad,) = torch.autograd.grad(got.loss, seq)
    assert type(got) is type(want)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert torch.equal(got_grad, want_grad)
    plain = sequence_preference_loss(seq, opts, lengths=lengths, ref_log_probs=ref,
                                     desirable=desirable, kl=kl,
                                     weights=weights if kto else weights[:P], nll_weight=nll)
    assert torch.equal(plain, want.loss)


def test_kind_names_are_one_source():
    assert PREFERENCE_LOSSES == ("dpo", "cpo", "orpo", "kto")
    assert step_checks.PREFERENCE_LOSSES is PREFERENCE_LOSSES
    kinds = [preference_loss_kind(o) for o in (DPOOptions(), CPOOptions(), ORPOOptions(),
                                               KTOOptions())]
    assert kinds == list(PREFERENCE_LOSSES)


def test_bad_arguments_raise():
    seq, ref, lengths, _ = _rows(1)
    with pytest.raises(TypeError, match="options must be a DPOOptions, CPOOptions, "
                                        "ORPOOptions or KTOOptions, got dict"):
        sequence_preference_loss(seq, {"beta": 0.1})
    with pytest.raises(TypeError, match="options must be"):
        preference_loss_kind(None)
    with pytest.raises(TypeError, match="log_probs must be a torch.Tensor"):
        sequence_preference_loss(seq.tolist(), ORPOOptions(), lengths=lengths)
    with pytest.raises(ValueError, match="1-D"):
        sequence_preference_loss(seq.reshape(2, P), ORPOOptions(), lengths=lengths)
    with pytest.raises(ValueError, match="2P rows"):
        sequence_preference_loss(seq[:-1], ORPOOptions(), lengths=lengths[:-1])
    with pytest.raises(ValueError, match="ref_log_probs is required for DPOOptions"):
        sequence_preference_loss(seq, DPOOptions())
    with pytest.raises(ValueError, match="ref_log_probs is required for KTOOptions"):
        sequence_preference_loss(seq, KTOOptions(), desirable=torch.ones(2 * P, dtype=bool))
    with pytest.raises(ValueError, match="desirable is required"):
        sequence_preference_loss(seq, KTOOptions(), ref_log_probs=ref)
