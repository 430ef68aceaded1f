"""megaloss.linear_log_probs on one device against a float64 full-logits reference: values and
gradients (random per-token upstream gradients of log_probs and entropy together), temperature,
soft-capping, ignore_index, bias, chunking; the errors."""
import pytest
import torch

import megaloss
from megaloss import LinearLogProbs, LogProbsOptions, linear_log_probs
from tests.helpers.log_probs_reference import reference


def _inputs(n=37, h=16, v=50, dtype=torch.float32, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    hid = torch.randn(n, h, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(v, h, generator=g) * 0.5).to(dtype).requires_grad_()
    b = (torch.randn(v, generator=g) * 0.5).to(dtype).requires_grad_() if bias else None
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::5] = -100
    return hid, w, b, labels, g


# fp32 vs float64: statistics in fp32 over V=50; bf16: inputs rounded to bf16 are the reference's
# inputs too, so only the bf16 GEMM output rounding (2^-8 relative on logits ~ 4) remains.
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=6e-2, rtol=3e-2),
       torch.float64: dict(atol=1e-10, rtol=1e-10)}

CASES = [
    dict(),
    dict(temperature=0.7),
    dict(logit_softcapping=3.0),
    dict(temperature=1.3, logit_softcapping=2.5, bias=True),
    dict(bias=True, chunk_size=8),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_values_and_gradients_match_float64_full_logits(dtype):
    for case in CASES:
        case = dict(case)
        bias = case.pop("bias", False)
        hid, w, b, labels, g = _inputs(dtype=dtype, bias=bias)
        out = linear_log_probs(hid, w, labels, bias=b, return_entropy=True,
                               chunk_size=case.pop("chunk_size", 16), impl="torch", **case)
        hd, wd = hid.detach().double().requires_grad_(), w.detach().double().requires_grad_()
        bd = None if b is None else b.detach().double().requires_grad_()
        ref = reference(hd, wd, labels, bd, temperature=case.get("temperature", 1.0),
                        cap=case.get("logit_softcapping"))
        tol = TOL[dtype]
        assert out.log_probs.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        torch.testing.assert_close(out.log_probs.double(), ref[0], **tol)
        torch.testing.assert_close(out.entropy.double(), ref[1], **tol)
        torch.testing.assert_close(out.lse.double(), ref[2], **tol)
        if dtype != torch.bfloat16:  # near-ties may flip under bf16 rounding
            assert torch.equal(out.greedy_match, ref[3])
        assert not out.greedy_match[labels == -100].any()
        ignored = labels == -100
        assert (out.log_probs[ignored] == 0).all() and (out.entropy[ignored] == 0).all()
        # random per-token upstream gradients, nonzero at ignored tokens too (must be dropped)
        a = torch.randn(labels.shape, generator=g, dtype=torch.float64)
        c = torch.randn(labels.shape, generator=g, dtype=torch.float64)
        ((out.log_probs.double() * a).sum() + (out.entropy.double() * c).sum()).backward()
        ((ref[0] * a).sum() + (ref[1] * c).sum()).backward()
        gtol = dict(atol=tol["atol"] * 4, rtol=tol["rtol"] * 4) if dtype == torch.bfloat16 else tol
        torch.testing.assert_close(hid.grad.double(), hd.grad, **gtol)
        torch.testing.assert_close(w.grad.double(), wd.grad, **gtol)
        if b is not None:
            torch.testing.assert_close(b.grad.double(), bd.grad, **gtol)


def test_log_probs_only_and_entropy_only_gradients():
    hid, w, _, labels, g = _inputs(dtype=torch.float64)
    for use in ("log_probs", "entropy"):
        hid.grad = w.grad = None
        out = linear_log_probs(hid, w, labels, return_entropy=True, chunk_size=10)
        getattr(out, use).sum().backward()
        hd, wd = hid.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        lp, ent, _, _ = reference(hd, wd, labels)
        (lp if use == "log_probs" else ent).sum().backward()
        torch.testing.assert_close(hid.grad, hd.grad, atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(w.grad, wd.grad, atol=1e-10, rtol=1e-10)


def test_without_entropy_and_shapes_and_module():
    hid, w, _, labels, _ = _inputs(dtype=torch.float64)
    out = linear_log_probs(hid.view(37, 1, 16), w, labels.view(37, 1), temperature=0.5)
    assert out.entropy is None and out.log_probs.shape == (37, 1)
    assert out.lse.requires_grad is False and out.greedy_match.dtype == torch.bool
    ref = reference(hid, w, labels, temperature=0.5)
    torch.testing.assert_close(out.log_probs.view(-1), ref[0])
    module = LinearLogProbs(temperature=0.5, return_entropy=True)
    assert "temperature=0.5" in repr(module)
    out2 = module(hid, w, labels)
    torch.testing.assert_close(out2.log_probs, ref[0])
    torch.testing.assert_close(out2.entropy, ref[1])
    same = linear_log_probs(hid, w, labels, options=LogProbsOptions(temperature=0.5))
    torch.testing.assert_close(same.log_probs, ref[0])
    assert megaloss.losses.LogProbsOutput is megaloss.LogProbsOutput


def test_frozen_weight_and_no_tokens():
    hid, w, _, labels, _ = _inputs()
    w = w.detach()
    linear_log_probs(hid, w, labels).log_probs.sum().backward()
    assert hid.grad is not None and w.grad is None
    empty = linear_log_probs(hid[:0], w, labels[:0], return_entropy=True)
    assert empty.log_probs.shape == (0,) and empty.entropy.shape == (0,)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(temperature=0.0), ValueError, "temperature"),
    (dict(temperature=float("inf")), ValueError, "temperature"),
    (dict(logit_softcapping=-1.0), ValueError, "logit_softcapping"),
    (dict(return_entropy=1), TypeError, "return_entropy"),
    (dict(chunk_size=0), ValueError, "chunk_size"),
    (dict(impl="cuda"), ValueError, "impl"),
    (dict(ignore_index=1.5), TypeError, "ignore_index"),
    (dict(options=LogProbsOptions(), temperature=2.0), TypeError, "not both"),
    (dict(vocab_parallel_options=object()), TypeError, "vocab_parallel_options"),
])
def test_bad_options_raise(kwargs, error, match):
    hid, w, _, labels, _ = _inputs()
    with pytest.raises(error, match=match):
        linear_log_probs(hid, w, labels, **kwargs)


def test_bad_tensors_raise():
    hid, w, _, labels, _ = _inputs()
    with pytest.raises(ValueError, match="labels must be in"):
        linear_log_probs(hid, w, torch.full_like(labels, 50))
    with pytest.raises(ValueError, match="hidden size"):
        linear_log_probs(hid, w[:, :3], labels)
    with pytest.raises(TypeError, match="labels"):
        linear_log_probs(hid, w, labels.float())
    with pytest.raises(TypeError, match="LogProbsOptions"):
        LinearLogProbs(options=megaloss.CrossEntropyOptions())
