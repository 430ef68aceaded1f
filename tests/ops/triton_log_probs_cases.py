"""The Triton log-probabilities epilogue against the torch one, on CPU tensors under Triton's
interpreter (run by ``tests/ops/test_triton_epilogue.py`` in its ``TRITON_INTERPRET=1``
subprocess, with ``triton_interpreter_cases.py``). Tiny: the interpreter runs each program in
Python.

Tolerances: fp32 results to fp32 rounding (the kernel's online rescaling sums in another order);
the bf16 logit gradient is the fp32 one cast once to bf16 (one ulp, the interpreter truncates);
bf16 parameter gradients are GEMMs of those (2^-6 of the largest entry).
"""
import itertools
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 from the start of the process (tests/ops/"
                "test_triton_epilogue.py runs this file so)", allow_module_level=True)
pytest.importorskip("triton")

from vocab_slices import Lockstep  # noqa: E402  (tests/ops/)

import megaloss  # noqa: E402
from megaloss import LogProbsOptions  # noqa: E402
from megaloss.ops import triton_common, triton_log_probs  # noqa: E402
from megaloss.ops.log_probs_chunk import chunk_log_probs, chunk_log_probs_grad  # noqa: E402

assert triton_common.interpreted(), "triton was imported before TRITON_INTERPRET=1 was set"


@pytest.fixture(scope="module", autouse=True)
def small_blocks():  # rows span several blocks, the last one ragged
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(triton_common, "MAX_BLOCK", 64)
        yield


def _close(got, want, what, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol, msg=what)


MATRIX = [(cap, t, ent) for (cap, t), ent in itertools.product([(None, 1.0), (3.0, 0.7)],
                                                                 [False, True])]


@pytest.mark.parametrize("cap,temperature,entropy", MATRIX,
                         ids=[f"cap{c}-T{t}-ent{e}" for c, t, e in MATRIX])
def test_chunk_matches_torch_epilogue(cap, temperature, entropy):
    g = torch.Generator().manual_seed(0)
    n, v_local, start = 6, 150, 120
    logits = torch.randn(n, v_local, generator=g) * 3
    labels = torch.tensor([start, start + v_local - 1, start - 1, start + v_local, -100, 130])
    opts = LogProbsOptions(logit_softcapping=cap, temperature=temperature,
                           return_entropy=entropy)
    got = triton_log_probs.triton_chunk_log_probs(logits.clone(), labels, opts,
                                                  vocab_start=start)
    want = chunk_log_probs(logits.clone(), labels, opts, vocab_start=start)
    for name in ("log_probs", "entropy", "lse", "mean_logit"):
        if getattr(want, name) is None:
            assert getattr(got, name) is None, name
        else:
            _close(getattr(got, name), getattr(want, name), name)
    assert torch.equal(got.greedy_match, want.greedy_match)
    a, b = torch.randn(n, generator=g), torch.randn(n, generator=g) if entropy else None
    a[4] = 0.0
    for dtype in (torch.float32, torch.bfloat16):
        z = logits.to(dtype)
        g_tr = triton_log_probs.triton_chunk_log_probs_grad(
            z.clone(), labels, want.lse, want.mean_logit, a, b, opts, vocab_start=start)
        g_ref = chunk_log_probs_grad(z.clone(), labels, want.lse, want.mean_logit, a, b, opts,
                                     vocab_start=start)
        assert g_tr.dtype == dtype  # written over the logits
        if dtype == torch.float32:
            _close(g_tr, g_ref, "grad_logits")
        else:
            _close(g_tr, g_ref, "grad_logits bf16", rtol=2 ** -7 + 1e-5, atol=1e-7)


def test_vocab_slices_combine_to_one_device():
    """Three slices (the last empty, a padded TP rank) in a lockstep group: every slice gets the
    one-device results."""
    g = torch.Generator().manual_seed(1)
    n, vocab = 5, 301
    logits = torch.randn(n, vocab, generator=g) * 2
    labels = torch.tensor([0, 150, 300, -100, 149])
    opts = LogProbsOptions(logit_softcapping=4.0, temperature=1.3, return_entropy=True)
    bounds = [(0, 150), (150, vocab), (vocab, vocab)]
    group = Lockstep(len(bounds))
    outs = group.run([
        lambda i=i, lo=lo, hi=hi: triton_log_probs.triton_chunk_log_probs(
            logits[:, lo:hi].clone(), labels, opts, vocab_start=lo,
            reduce_max=group.reducers(i)[0], reduce_sum=group.reducers(i)[1])
        for i, (lo, hi) in enumerate(bounds)])
    want = chunk_log_probs(logits.clone(), labels, opts)
    for i, got in enumerate(outs):
        for name in ("log_probs", "entropy", "lse", "mean_logit"):
            _close(getattr(got, name), getattr(want, name), f"{name} of slice {i}")
        assert torch.equal(got.greedy_match, want.greedy_match)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_public_api_triton_matches_torch(dtype):
    """megaloss.linear_log_probs end to end (chunk loop, bias, autograd, random upstream
    gradients of log_probs and entropy) with the forced Triton epilogue against the torch one."""
    g = torch.Generator().manual_seed(4)
    n, hidden, vocab = 9, 8, 97
    h0 = torch.randn(n, hidden, generator=g).to(dtype)
    w0 = (torch.randn(vocab, hidden, generator=g) * 0.5).to(dtype)
    b0 = torch.randn(vocab, generator=g).to(dtype)
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[::4] = -100
    a, c = torch.randn(n, generator=g), torch.randn(n, generator=g)
    results = {}
    for impl in ("triton", "torch"):
        h, w, b = (t.clone().requires_grad_() for t in (h0, w0, b0))
        out = megaloss.linear_log_probs(h, w, labels, bias=b, impl=impl, chunk_size=4,
                                        temperature=0.8, logit_softcapping=5.0,
                                        return_entropy=True)
        loss = (out.log_probs * a).sum() + (out.entropy * c).sum()
        results[impl] = (out.log_probs.detach(), out.entropy.detach(), out.lse,
                         *torch.autograd.grad(loss, [h, w, b]))
    names = ("log_probs", "entropy", "lse", "d_hidden", "d_weight", "d_bias")
    for name, got, want in zip(names, results["triton"], results["torch"]):
        if dtype == torch.float32 or name in ("log_probs", "entropy", "lse"):
            _close(got, want, name, rtol=1e-4 if dtype != torch.float32 else 1e-5)
        else:
            scale = float(want.float().abs().max())
            torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=scale * 2 ** -6,
                                       msg=name)
