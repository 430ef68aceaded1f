"""megaloss.linear_cross_entropy against the float64 eager reference (tests/ce_reference.py),
and against torch's own ``F.linear_cross_entropy`` (torch >= 2.13; its chunked path and its
reference path) as a second, independent reference.

Tolerances: fp64 inputs 1e-10 (same math, different summation order); fp32 inputs compared with
the fp64 reference at rtol/atol 2e-5/2e-5 (values of order 1-10, V <= 64); bf16: error vs fp64 at
most 2x eager torch's own bf16 error plus 1e-3.
"""
import itertools
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import megaloss
from tests.helpers.ce_reference import reference_linear_ce

OPTION_SETS = [
    dict(),
    dict(label_smoothing=0.1),
    dict(z_loss=1e-3),
    dict(logit_softcapping=3.0),
    dict(label_smoothing=0.2, z_loss=1e-2, logit_softcapping=5.0),
]


def make_inputs(n=37, h=16, v=50, dtype=torch.float64, seed=0, bias=False, weights=False,
                ignore_every=5, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g, dtype=torch.float64) * scale).to(dtype)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    if ignore_every:
        labels[::ignore_every] = -100
    b = torch.randn(v, generator=g, dtype=torch.float64).to(dtype) if bias else None
    w = torch.rand(n, generator=g, dtype=torch.float64).to(dtype) if weights else None
    return hidden, weight, labels, b, w


def loss_and_grads(fn, hidden, weight, labels, bias, loss_weights, grad_seed=1, **opts):
    leaves = [t.detach().clone().requires_grad_(True) for t in (hidden, weight)]
    b = None if bias is None else bias.detach().clone().requires_grad_(True)
    if b is not None:
        leaves.append(b)
    loss = fn(leaves[0], leaves[1], labels, bias=b, loss_weights=loss_weights, **opts)
    g = torch.Generator().manual_seed(grad_seed)
    grad_out = torch.rand(loss.shape, generator=g, dtype=torch.float64).to(loss.dtype) + 0.5
    grads = torch.autograd.grad(loss, leaves, grad_out)
    return loss.detach(), [x.detach() for x in grads]


def assert_matches_reference(hidden, weight, labels, bias, w, *, rtol, atol, **opts):
    loss, grads = loss_and_grads(megaloss.linear_cross_entropy, hidden, weight, labels, bias, w,
                                 **opts)
    opts.pop("chunk_size", None)
    opts.pop("accum_dtype", None)
    to64 = lambda t: None if t is None else t.double()  # noqa: E731
    ref, ref_grads = loss_and_grads(reference_linear_ce, to64(hidden), to64(weight), labels,
                                    to64(bias), to64(w), **opts)
    torch.testing.assert_close(loss.double(), ref, rtol=rtol, atol=atol)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("opts", OPTION_SETS)
@pytest.mark.parametrize("bias,weights", [(False, False), (True, True)])
def test_fp64_matches_reference(reduction, opts, bias, weights):
    hidden, weight, labels, b, w = make_inputs(bias=bias, weights=weights)
    assert_matches_reference(hidden, weight, labels, b, w, rtol=1e-10, atol=1e-10,
                             reduction=reduction, chunk_size=8, **opts)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("opts", [OPTION_SETS[0], OPTION_SETS[-1]])
def test_fp32_matches_fp64_reference(reduction, opts):
    hidden, weight, labels, b, w = make_inputs(dtype=torch.float32, bias=True, weights=True, v=64)
    assert_matches_reference(hidden, weight, labels, b, w, rtol=2e-5, atol=2e-5,
                             reduction=reduction, chunk_size=16, **opts)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 40), h=st.integers(1, 8), v=st.integers(1, 30),
       chunk=st.integers(1, 17), reduction=st.sampled_from(["mean", "sum", "none"]),
       smoothing=st.sampled_from([0.0, 0.3]), z=st.sampled_from([0.0, 1e-2]),
       cap=st.sampled_from([None, 2.0]), bias=st.booleans(), weights=st.booleans(),
       ignore_every=st.sampled_from([0, 1, 3]), seed=st.integers(0, 2 ** 16))
def test_property_random_cases(n, h, v, chunk, reduction, smoothing, z, cap, bias, weights,
                               ignore_every, seed):
    hidden, weight, labels, b, w = make_inputs(n, h, v, seed=seed, bias=bias, weights=weights,
                                               ignore_every=ignore_every)
    assert_matches_reference(hidden, weight, labels, b, w, rtol=1e-9, atol=1e-9,
                             reduction=reduction, chunk_size=chunk, label_smoothing=smoothing,
                             z_loss=z, logit_softcapping=cap)


def test_chunk_count_invariance():
    hidden, weight, labels, b, _ = make_inputs(n=64, dtype=torch.float32, bias=True)
    losses = [megaloss.linear_cross_entropy(hidden, weight, labels, bias=b, chunk_size=c)
              for c in (64, 32, 16, 8)]
    for loss in losses[1:]:
        torch.testing.assert_close(loss, losses[0], rtol=1e-6, atol=1e-6)


def test_bf16_error_no_worse_than_eager_bf16():
    hidden, weight, labels, _, _ = make_inputs(n=256, h=64, v=512, seed=3)
    ref, ref_grads = loss_and_grads(reference_linear_ce, hidden, weight, labels, None, None,
                                    reduction="mean")
    h16, w16 = hidden.bfloat16(), weight.bfloat16()
    eager, eager_grads = loss_and_grads(reference_linear_ce, h16, w16, labels, None, None,
                                        reduction="mean")
    ours, our_grads = loss_and_grads(megaloss.linear_cross_entropy, h16, w16, labels, None, None,
                                     reduction="mean", chunk_size=16)
    assert ours.dtype == torch.float32
    err = lambda a, b: (a.double() - b).abs().max().item()  # noqa: E731
    assert err(ours, ref) <= 2 * err(eager, ref) + 1e-3
    for o, e, r in zip(our_grads, eager_grads, ref_grads):
        assert o.dtype == torch.bfloat16
        assert err(o, r) <= 2 * err(e, r) + 1e-3


def test_weight_grad_accumulates_in_fp32_across_many_chunks():
    # 512 chunks of 1 token: bf16 accumulation would lose the small per-chunk contributions.
    hidden, weight, labels, _, _ = make_inputs(n=512, h=8, v=16, seed=4, ignore_every=0)
    _, ref_grads = loss_and_grads(reference_linear_ce, hidden, weight, labels, None, None,
                                  reduction="sum")
    h16, w16 = hidden.bfloat16(), weight.bfloat16()
    _, grads32 = loss_and_grads(megaloss.linear_cross_entropy, h16, w16, labels, None, None,
                                reduction="sum", chunk_size=1)
    _, grads16 = loss_and_grads(megaloss.linear_cross_entropy, h16, w16, labels, None, None,
                                reduction="sum", chunk_size=1, accum_dtype=torch.bfloat16)
    err32 = (grads32[1].double() - ref_grads[1]).abs().max()
    err16 = (grads16[1].double() - ref_grads[1]).abs().max()
    assert err32 < err16  # the option does something, and fp32 is the better one
    assert err32 <= 0.02 * ref_grads[1].abs().max()


def test_all_labels_ignored_gives_zero_loss_and_zero_grads():
    hidden, weight, _, _, _ = make_inputs()
    labels = torch.full((hidden.shape[0],), -100)
    for reduction in ("mean", "sum", "none"):
        loss, grads = loss_and_grads(megaloss.linear_cross_entropy, hidden, weight, labels, None,
                                     None, reduction=reduction)
        assert torch.isfinite(loss).all() and (loss == 0).all()
        assert all((g == 0).all() for g in grads)


def test_empty_input():
    hidden, weight = torch.randn(0, 4, dtype=torch.float64), torch.randn(7, 4, dtype=torch.float64)
    labels = torch.zeros(0, dtype=torch.long)
    loss, grads = loss_and_grads(megaloss.linear_cross_entropy, hidden, weight, labels, None, None)
    assert loss.item() == 0.0 and grads[1].abs().sum() == 0


def test_scalar_grad_output_is_honoured():
    hidden, weight, labels, _, _ = make_inputs()
    h = hidden.clone().requires_grad_(True)
    (megaloss.linear_cross_entropy(h, weight, labels) * 3.0).backward()
    h_ref = hidden.clone().requires_grad_(True)
    (reference_linear_ce(h_ref, weight, labels) * 3.0).backward()
    torch.testing.assert_close(h.grad, h_ref.grad, rtol=1e-10, atol=1e-12)


def test_multidim_and_non_contiguous_inputs():
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(8, 3, 6, generator=g, dtype=torch.float64).transpose(0, 1)  # [3, 8, 6]
    weight = torch.randn(6, 11, generator=g, dtype=torch.float64).t()  # [11, 6], non-contiguous
    labels = torch.randint(0, 11, (8, 3), generator=g).t()
    assert not hidden.is_contiguous() and not weight.is_contiguous()
    for reduction in ("mean", "none"):
        assert_matches_reference(hidden, weight, labels, None, None, rtol=1e-10, atol=1e-10,
                                 reduction=reduction, chunk_size=5)
    out = megaloss.linear_cross_entropy(hidden, weight, labels, reduction="none")
    assert out.shape == labels.shape


def test_tied_embeddings_accumulate_both_gradients():
    torch.manual_seed(0)
    emb = torch.nn.Embedding(20, 8).double()
    tokens = torch.randint(0, 20, (2, 9))
    labels = torch.randint(0, 20, (2, 9))

    def run(loss_fn):
        emb.zero_grad()
        hidden = torch.tanh(emb(tokens))
        loss_fn(hidden, emb.weight, labels).backward()
        return emb.weight.grad.clone()

    got = run(lambda h, w, y: megaloss.linear_cross_entropy(h, w, y, chunk_size=4))
    want = run(reference_linear_ce)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_frozen_weight_and_frozen_hidden():
    hidden, weight, labels, _, _ = make_inputs()
    h = hidden.clone().requires_grad_(True)
    w = weight.clone()  # frozen
    megaloss.linear_cross_entropy(h, w, labels).backward()
    h_ref = hidden.clone().requires_grad_(True)
    reference_linear_ce(h_ref, weight, labels).backward()
    torch.testing.assert_close(h.grad, h_ref.grad, rtol=1e-10, atol=1e-12)
    assert w.grad is None
    w2 = weight.clone().requires_grad_(True)
    megaloss.linear_cross_entropy(hidden, w2, labels).backward()  # frozen hidden states
    w_ref = weight.clone().requires_grad_(True)
    reference_linear_ce(hidden, w_ref, labels).backward()
    torch.testing.assert_close(w2.grad, w_ref.grad, rtol=1e-10, atol=1e-12)


def test_mixed_precision_hidden_bf16_weight_fp32():
    hidden, weight, labels, _, _ = make_inputs(dtype=torch.float32)
    h16 = hidden.bfloat16().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    loss = megaloss.linear_cross_entropy(h16, w, labels)
    loss.backward()
    assert h16.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    ref = reference_linear_ce(h16.detach().double(), weight.double(), labels)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-5)


def test_inputs_not_modified_in_place():
    hidden, weight, labels, b, w = make_inputs(bias=True, weights=True)
    copies = [t.clone() for t in (hidden, weight, labels, b, w)]
    megaloss.linear_cross_entropy(hidden, weight, labels, bias=b, loss_weights=w,
                                  logit_softcapping=2.0)
    for t, c in zip((hidden, weight, labels, b, w), copies):
        assert torch.equal(t, c)


def test_stats_report_z_loss_and_valid_tokens():
    hidden, weight, labels, _, _ = make_inputs()
    out = megaloss.linear_cross_entropy_with_stats(
        hidden, weight, labels, options=megaloss.CrossEntropyOptions(z_loss=1e-2))
    valid = labels != -100
    lse = torch.logsumexp(hidden @ weight.t(), dim=-1)
    torch.testing.assert_close(out.z_loss, 1e-2 * (lse[valid] ** 2).mean())
    assert out.num_valid_tokens.item() == int(valid.sum())
    assert not out.z_loss.requires_grad
    plain = megaloss.linear_cross_entropy_with_stats(hidden, weight, labels)
    assert plain.z_loss.item() == 0.0  # z-loss never added unless asked for


def test_huge_logits_stay_finite():
    hidden, weight, labels, _, _ = make_inputs(dtype=torch.float32, scale=300.0)  # logits ~1e4
    assert_matches_reference(hidden, weight, labels, None, None, rtol=1e-5, atol=1e-2,
                             reduction="mean", z_loss=1e-4)


def test_module_matches_function_and_shows_options():
    hidden, weight, labels, b, _ = make_inputs(bias=True)
    mod = megaloss.LinearCrossEntropyLoss(label_smoothing=0.1, chunk_size=4)
    torch.testing.assert_close(mod(hidden, weight, labels, bias=b),
                               megaloss.linear_cross_entropy(hidden, weight, labels, bias=b,
                                                             label_smoothing=0.1))
    assert "label_smoothing=0.1" in repr(mod)


BAD_OPTIONS = [
    (dict(reduction="avg"), ValueError, "reduction"),
    (dict(label_smoothing=1.5), ValueError, "label_smoothing"),
    (dict(z_loss=-1.0), ValueError, "z_loss"),
    (dict(logit_softcapping=0.0), ValueError, "logit_softcapping"),
    (dict(chunk_size=0), ValueError, "chunk_size"),
    (dict(accum_dtype=torch.int32), TypeError, "accum_dtype"),
]


@pytest.mark.parametrize("kwargs,exc,name", BAD_OPTIONS)
def test_bad_options_raise_naming_the_argument(kwargs, exc, name):
    hidden, weight, labels, _, _ = make_inputs()
    with pytest.raises(exc, match=name):
        megaloss.linear_cross_entropy(hidden, weight, labels, **kwargs)
    with pytest.raises(exc, match=name):
        megaloss.LinearCrossEntropyLoss(**kwargs)


def test_bad_tensors_raise_naming_the_argument():
    hidden, weight, labels, _, _ = make_inputs(v=10)
    cases = [
        (dict(labels=labels.clone().fill_(10)), ValueError, r"labels must be in \[0, 10\)"),
        (dict(labels=labels.clone().fill_(-3)), ValueError, "found -3"),
        (dict(labels=labels[:-1]), ValueError, "labels must have shape"),
        (dict(labels=labels.float()), TypeError, "labels must be an integer"),
        (dict(weight=weight[:, :-1]), ValueError, "hidden size"),
        (dict(hidden_states=hidden.long()), TypeError, "hidden_states"),
        (dict(bias=torch.zeros(3, dtype=torch.float64)), ValueError, "bias"),
        (dict(loss_weights=torch.ones(3, dtype=torch.float64)), ValueError, "loss_weights"),
        (dict(loss_weights=torch.ones(hidden.shape[0], dtype=torch.long)), TypeError,
         "loss_weights"),
    ]
    for override, exc, pattern in cases:
        args = dict(hidden_states=hidden, weight=weight, labels=labels)
        kw = {k: override.pop(k) for k in list(override) if k in ("bias", "loss_weights")}
        args.update(override)
        with pytest.raises(exc, match=pattern):
            megaloss.linear_cross_entropy(args["hidden_states"], args["weight"], args["labels"],
                                          **kw)


def test_device_mismatch_is_a_clear_error():
    hidden, weight, labels, _, _ = make_inputs()
    with pytest.raises(ValueError, match="one device"):
        megaloss.linear_cross_entropy(hidden, weight.to("meta"), labels)


@pytest.mark.parametrize("reduction,opts", list(itertools.product(["mean", "none"],
                                                                  [OPTION_SETS[-1]])))
def test_gradcheck_small(reduction, opts):
    hidden, weight, labels, b, w = make_inputs(n=5, h=3, v=4, bias=True, weights=True,
                                               ignore_every=3)
    h, W, bb = (t.clone().requires_grad_(True) for t in (hidden, weight, b))
    fn = lambda h, W, bb: megaloss.linear_cross_entropy(  # noqa: E731
        h, W, labels, bias=bb, loss_weights=w, reduction=reduction, chunk_size=2, **opts)
    assert torch.autograd.gradcheck(fn, (h, W, bb))


def _early_ce(hidden, weight, labels):
    # reduction="mean" forms the head's gradients in forward (fp32 / fp64): the saved buffers
    # that the first backward scales in place
    return megaloss.linear_cross_entropy(hidden, weight, labels, chunk_size=3)


def test_retained_graph_backwards_with_different_scales():
    """The first backward scales the gradients formed in forward in place; a second one through
    the retained graph gets its own scale, and the first's result is left as it was."""
    hidden, weight, labels, _, _ = make_inputs(n=7, h=5, v=6, ignore_every=3)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = _early_ce(h, w, labels)
    g1 = torch.autograd.grad(loss * 2.0, (h, w), retain_graph=True)
    kept = [g.clone() for g in g1]
    g2 = torch.autograd.grad(loss * -3.0, (h, w))
    h0, w0 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    base = torch.autograd.grad(_early_ce(h0, w0, labels), (h0, w0))
    for a, b, k, e in zip(g1, g2, kept, base):
        torch.testing.assert_close(a, k, rtol=0, atol=0)  # not mutated by the second backward
        torch.testing.assert_close(a, 2.0 * e, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(b, -3.0 * e, rtol=1e-12, atol=1e-15)


def test_retained_graph_after_a_zero_first_scale_is_refused():
    hidden, weight, labels, _, _ = make_inputs(n=4, h=3, v=5)
    w = weight.clone().requires_grad_()
    loss = _early_ce(hidden, w, labels)
    (loss * 0.0).backward(retain_graph=True)
    assert torch.count_nonzero(w.grad) == 0
    with pytest.raises(RuntimeError, match="non-zero first grad_output"):
        loss.backward()


def test_a_returned_gradient_changed_in_place_fails_the_second_backward():
    """The in-place scaling bypasses the version counter; anyone else's in-place change to the
    gradient (it is the saved buffer) is still caught by torch's check, never silently used."""
    hidden, weight, labels, _, _ = make_inputs(n=4, h=3, v=5)
    w = weight.clone().requires_grad_()
    loss = _early_ce(hidden, w, labels)
    (g,) = torch.autograd.grad(loss, (w,), retain_graph=True)
    g.zero_()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(loss, (w,))


# torch's F.linear_cross_entropy (torch >= 2.13) as a second reference ---------------------------
needs_torch_lce = pytest.mark.skipif(not hasattr(F, "linear_cross_entropy"),
                                     reason="F.linear_cross_entropy needs torch >= 2.13")


def torch_linear_ce(hidden, weight, labels, *, bias=None, loss_weights=None, ce_weight=None,
                    torch_options=None, **opts):
    """torch's ``F.linear_cross_entropy`` under megaloss's argument names; refuses to fall back
    from its chunked path silently (torch warns and runs its reference path instead)."""
    assert loss_weights is None, "torch's function has no per-token weights"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "options ignored": the chunked path was not taken
        return F.linear_cross_entropy(hidden, weight, labels, linear_bias=bias, weight=ce_weight,
                                      options=torch_options, **opts)


# torch's chunked path imports torch._dynamo on its first call (3-8 s on 2 cores): slow tier.
TORCH_PATHS = [pytest.param("chunked", marks=pytest.mark.slow),
               pytest.param("accurate", marks=pytest.mark.slow), "reference"]


def _torch_options(name):
    if name == "reference":
        return None
    nn = torch.nn
    if name == "chunked":  # torch's defaults (compact, aspect_ratio:2 chunks: 8 rows here)
        return nn.LinearCrossEntropyOptions()
    return nn.LinearCrossEntropyOptions(acc_policy="accurate", batch_chunk_size=5)


def assert_matches_torch(hidden, weight, labels, bias, *, torch_path, **opts):
    ours, our_grads = loss_and_grads(megaloss.linear_cross_entropy, hidden, weight, labels, bias,
                                     None, chunk_size=8, **opts)
    theirs, their_grads = loss_and_grads(torch_linear_ce, hidden, weight, labels, bias, None,
                                         torch_options=_torch_options(torch_path), **opts)
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-10)
    assert len(our_grads) == len(their_grads) == 2 + (bias is not None)
    for got, want in zip(our_grads, their_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@needs_torch_lce
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("torch_path", TORCH_PATHS)
@pytest.mark.parametrize("bias,ignore_index,class_weights",
                         [(False, -100, False), (True, 7, False), (True, -100, True)])
def test_fp64_matches_torch_linear_cross_entropy(reduction, torch_path, bias, ignore_index,
                                                 class_weights):
    """Loss and gradients (hidden, weight, bias) equal torch's function, its chunked path with
    default options, with ``acc_policy="accurate"`` in 5-row chunks, and its reference path."""
    hidden, weight, labels, b, _ = make_inputs(bias=bias, ignore_every=4)
    labels[labels == -100] = ignore_index  # every 4th label ignored, also a valid class id (7)
    assert (labels == ignore_index).sum() == 10
    opts = dict(reduction=reduction, ignore_index=ignore_index)
    if class_weights:
        opts["ce_weight"] = torch.rand(weight.shape[0], generator=torch.Generator().manual_seed(2),
                                       dtype=torch.float64) * 2
    assert_matches_torch(hidden, weight, labels, b, torch_path=torch_path, **opts)


@needs_torch_lce
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_fp64_label_smoothing_matches_torch_linear_cross_entropy(reduction):
    """label_smoothing: torch's chunked path does not take it (it warns and runs its reference
    path), so the comparison is with that path."""
    hidden, weight, labels, b, _ = make_inputs(bias=True)
    assert_matches_torch(hidden, weight, labels, b, torch_path="reference", reduction=reduction,
                         label_smoothing=0.2)
    with pytest.warns(UserWarning, match="options.*ignored"):
        F.linear_cross_entropy(hidden, weight, labels, label_smoothing=0.2,
                               options=torch.nn.LinearCrossEntropyOptions())
