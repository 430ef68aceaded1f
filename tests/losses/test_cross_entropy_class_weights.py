"""The cross-entropy's class weights (``ce_weight``, torch's ``F.cross_entropy(weight=...)``) and
token accuracy (``num_correct_tokens``), single process, float64 against torch on the full logits
(tolerance 1e-12); across vocabulary slices through the chunk driver with slices run in lockstep
threads (as TP ranks), equal to one device to 1e-12."""
import pytest
import torch
import torch.nn.functional as F

import megaloss
from megaloss import CrossEntropyOptions
from megaloss.ops.chunk_driver import chunked_head
from megaloss.ops.chunk_kernel import VocabSlice
from megaloss.ops.cross_entropy_chunk import CrossEntropyKernel
from tests.ops.vocab_slices import Lockstep

TOL = dict(rtol=1e-12, atol=1e-12)


def _inputs(seed=0, n=23, h=5, v=17, bias=False):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(v, generator=g, dtype=torch.float64, requires_grad=True) if bias else None
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::5] = -100
    class_weight = torch.rand(v, generator=g, dtype=torch.float64) * 2
    return hidden, weight, b, labels, class_weight


def _grads(loss, tensors):
    return torch.autograd.grad(loss.sum(), [t for t in tensors if t is not None])


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.15])
@pytest.mark.parametrize("chunk_size", [4, 1024])
def test_class_weights_match_torch(reduction, label_smoothing, chunk_size):
    hidden, weight, bias, labels, cw = _inputs(bias=True)
    got = megaloss.linear_cross_entropy(hidden, weight, labels, bias=bias, ce_weight=cw,
                                        reduction=reduction, label_smoothing=label_smoothing,
                                        chunk_size=chunk_size)
    want = F.cross_entropy(F.linear(hidden, weight, bias), labels, weight=cw,
                           reduction=reduction, label_smoothing=label_smoothing)
    torch.testing.assert_close(got, want, **TOL)
    for a, b in zip(_grads(got, (hidden, weight, bias)), _grads(want, (hidden, weight, bias))):
        torch.testing.assert_close(a, b, **TOL)


def test_class_weights_with_token_weights_and_z_loss():
    """``mean`` divides by ``sum(w_token * w_class)``; the z-loss is weighted as its token's
    class (the formula of megaloss.ops.cross_entropy_chunk)."""
    hidden, weight, _, labels, cw = _inputs(seed=1)
    tok = torch.rand(labels.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    z = 1e-2
    out = megaloss.linear_cross_entropy(hidden, weight, labels, ce_weight=cw, loss_weights=tok,
                                        z_loss=z, label_smoothing=0.1, chunk_size=6,
                                        return_stats=True)
    logits = F.linear(hidden, weight)
    valid = labels != -100
    per_token = F.cross_entropy(logits, labels, weight=cw, reduction="none", label_smoothing=0.1)
    w_y = torch.where(valid, cw[labels.clamp(0)], 0.0)
    z_part = z * w_y * torch.logsumexp(logits, 1) ** 2
    denom = (tok * w_y).sum()
    want = (tok * (per_token + z_part)).sum() / denom
    torch.testing.assert_close(out.loss, want, **TOL)
    torch.testing.assert_close(out.z_loss, (tok * z_part).sum() / denom, **TOL)
    for a, b in zip(_grads(out.loss, (hidden, weight)), _grads(want, (hidden, weight))):
        torch.testing.assert_close(a, b, **TOL)


def test_unit_class_weights_are_the_plain_loss():
    hidden, weight, _, labels, _ = _inputs(seed=3)
    kw = dict(label_smoothing=0.1, z_loss=1e-3, reduction="sum", chunk_size=5)
    ones = torch.ones(weight.shape[0], dtype=torch.float64)
    torch.testing.assert_close(
        megaloss.linear_cross_entropy(hidden, weight, labels, ce_weight=ones, **kw),
        megaloss.linear_cross_entropy(hidden, weight, labels, **kw), **TOL)


@pytest.mark.parametrize("cap", [None, 3.0])
def test_token_accuracy_counts_argmax_hits(cap):
    hidden, weight, _, labels, _ = _inputs(seed=4, n=40, v=7)
    logits = F.linear(hidden, weight)
    # make a few labels the argmax (and one a tie for the max: counted, as greedy_match counts)
    labels[1:8] = logits[1:8].argmax(1)
    out = megaloss.linear_cross_entropy(hidden, weight, labels, logit_softcapping=cap,
                                        chunk_size=6, return_stats=True)
    valid = labels != -100
    hits = (logits.argmax(1) == labels) & valid
    assert int(out.num_correct_tokens) == int(hits.sum()) >= 7
    assert int(out.num_valid_tokens) == int(valid.sum())
    lp = megaloss.linear_log_probs(hidden, weight, labels, logit_softcapping=cap)
    assert int(out.num_correct_tokens) == int(lp.greedy_match.sum())


@pytest.mark.parametrize("bounds", [[(0, 6), (6, 12), (12, 17)], [(0, 17), (17, 17)]])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_class_weights_and_accuracy_across_vocab_slices(bounds, reduction):
    """Each slice takes its part of the class weights and the label's weight globally; loss,
    gradients and the correct count equal one device's (a slice may hold no row)."""
    hidden, weight, _, labels, cw = _inputs(seed=5)
    labels[2:6] = F.linear(hidden, weight)[2:6].argmax(1).detach()
    opts = CrossEntropyOptions(reduction=reduction, label_smoothing=0.1, z_loss=1e-3,
                               chunk_size=7)
    valid = (labels != -100).double()
    w_y = torch.where(labels != -100, cw[labels.clamp(0)], 0.0)
    coef = valid / (valid * w_y).sum() if reduction == "mean" else valid
    mode = "none" if reduction == "none" else "sum"
    upstream = torch.rand(labels.shape, dtype=torch.float64) if reduction == "none" else None

    def run(start, stop, reducers=None):
        hl = hidden.detach().clone().requires_grad_()
        wl = weight.detach()[start:stop].clone().requires_grad_()
        vocab = (VocabSlice(17, start) if reducers is None
                 else VocabSlice(17, start, *reducers))
        loss, _, correct = chunked_head(CrossEntropyKernel(labels, opts, vocab, cw), hl, wl, None,
                                        coef=coef, reduction=mode, chunk_size=opts.chunk_size)
        g = upstream if upstream is not None else torch.ones((), dtype=torch.float64)
        dh, dw = torch.autograd.grad(loss, [hl, wl], g)
        return loss.detach(), dh, dw, correct

    group = Lockstep(len(bounds))
    slices = group.run([lambda i=i, b=b: run(*b, group.reducers(i))
                        for i, b in enumerate(bounds)])
    whole = run(0, 17)
    for loss, _, _, correct in slices:
        torch.testing.assert_close(loss, whole[0], **TOL)
        assert torch.equal(correct, whole[3]) and int(correct.sum()) >= 4
    torch.testing.assert_close(sum(s[1] for s in slices), whole[1], **TOL)
    torch.testing.assert_close(torch.cat([s[2] for s in slices]), whole[2], **TOL)


def test_class_weight_errors_name_the_argument():
    hidden, weight, _, labels, cw = _inputs(seed=6)
    with pytest.raises(ValueError, match=r"ce_weight must have shape \[17\]"):
        megaloss.linear_cross_entropy(hidden, weight, labels, ce_weight=cw[:5])
    with pytest.raises(ValueError, match="finite weights >= 0"):
        megaloss.linear_cross_entropy(hidden, weight, labels, ce_weight=-cw)
    with pytest.raises(TypeError, match="ce_weight must be a floating"):
        megaloss.linear_cross_entropy(hidden, weight, labels, ce_weight=torch.ones(17).long())
    with pytest.raises(ValueError, match="impl='triton' does not take it"):
        megaloss.linear_cross_entropy(hidden, weight, labels, ce_weight=cw, impl="triton")


def test_module_holds_the_class_weights_as_a_buffer():
    hidden, weight, _, labels, cw = _inputs(seed=7)
    module = megaloss.LinearCrossEntropyLoss(ce_weight=cw, reduction="sum")
    assert "ce_weight" in dict(module.named_buffers())
    out = module(hidden, weight, labels, return_stats=True)
    torch.testing.assert_close(out.loss, F.cross_entropy(F.linear(hidden, weight), labels,
                                                         weight=cw, reduction="sum"), **TOL)
