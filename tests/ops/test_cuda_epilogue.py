"""The CUDA path (marked ``cuda``, skipped without a GPU; ``tools/gpu_check.sh`` runs them).

- the public loss with ``impl`` auto / torch / triton in fp32, bf16 and fp16 against a float64
  reference on the same GPU (fp32: 5e-5; half precision: error at most 2x eager torch's own error
  in that dtype plus 1e-3, as ``tests/losses/test_cross_entropy.py`` on CPU);
- the Triton epilogue against the torch one at a real vocabulary size (blocks of 4096): losses to
  fp32 rounding, the bf16 gradient within half a bf16 ulp of torch's fp32 gradient (the kernels
  round to nearest even once);
- its memory: no fp32 copy of the chunk's logits;
- the vocab-parallel path on one rank, and as three vocab slices in threads of one process.
"""
import pytest
import torch
from vocab_slices import slices_and_one_device

import megaloss
from megaloss import CrossEntropyOptions
from megaloss.ops.cross_entropy_chunk import chunk_cross_entropy, epilogue_impl
from tests.helpers.ce_reference import reference_linear_ce

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEV = "cuda"
OPTS = dict(label_smoothing=0.1, z_loss=1e-3, logit_softcapping=15.0)


def _needs_triton():
    pytest.importorskip("triton")


def _inputs(n, hidden, vocab, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g, dtype=torch.float64)
    w = torch.randn(vocab, hidden, generator=g, dtype=torch.float64) * (2.0 / hidden ** 0.5)
    b = torch.randn(vocab, generator=g, dtype=torch.float64) * 0.1
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[::7] = -100
    weights = torch.rand(n, generator=g, dtype=torch.float64) + 0.5
    return ([t.to(DEV, dtype) for t in (h, w, b)]
            + [labels.to(DEV), weights.to(DEV, torch.float32)])


def _loss_and_grads(fn, h, w, b, labels, weights, upstream):
    leaves = [t.detach().clone().requires_grad_() for t in (h, w, b)]
    loss = fn(*leaves, labels, weights)
    return [loss.detach()] + list(torch.autograd.grad(loss, leaves, upstream.to(loss.dtype)))


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("impl", ["auto", "torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
def test_public_loss_matches_float64_reference(dtype, impl, reduction):
    if impl == "triton":
        _needs_triton()
    n, hidden, vocab = 300, 64, 5000
    h, w, b, labels, weights = _inputs(n, hidden, vocab, dtype)
    upstream = (torch.rand(n, device=DEV) + 0.5) if reduction == "none" else \
        torch.tensor(1.7, device=DEV)
    module = megaloss.LinearCrossEntropyLoss(impl=impl, reduction=reduction, chunk_size=128,
                                             **OPTS)

    def ours(h, w, b, y, lw):
        return module(h, w, y, bias=b, loss_weights=lw)

    def ref(h, w, b, y, lw):
        return reference_linear_ce(h, w, y, bias=b, loss_weights=lw, reduction=reduction, **OPTS)

    want = _loss_and_grads(ref, *(t.double() for t in (h, w, b)), labels, weights.double(),
                           upstream.double())
    got = _loss_and_grads(ours, h, w, b, labels, weights, upstream)
    names = ("loss", "d_hidden", "d_weight", "d_bias")
    if dtype == torch.float32:
        for name, g_, r in zip(names, got, want):
            torch.testing.assert_close(g_.double(), r, rtol=5e-5, atol=5e-5, msg=name)
        return
    eager = _loss_and_grads(ref, h, w, b, labels, weights.to(dtype), upstream)
    for name, g_, e, r in zip(names, got, eager, want):
        if name != "loss":
            assert g_.dtype == dtype, name
        err_ours = (g_.double() - r).abs().max().item()
        err_eager = (e.double() - r).abs().max().item()
        assert err_ours <= 2 * err_eager + 1e-3, (name, err_ours, err_eager)


def test_auto_is_triton_on_cuda():
    _needs_triton()
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert epilogue_impl("auto", torch.zeros(2, 2, device=DEV, dtype=dtype)) == "triton"
    assert epilogue_impl("auto", torch.zeros(2, 2, device=DEV, dtype=torch.float64)) == "torch"


@pytest.mark.parametrize("cap,eps,z", [(None, 0.0, 0.0), (30.0, 0.1, 1e-4)])
def test_triton_epilogue_matches_torch_at_vocab_scale(cap, eps, z):
    _needs_triton()
    g = torch.Generator().manual_seed(1)
    c, hidden, v_local, vocab, start = 96, 256, 32000, 50000, 5000
    h = torch.randn(c, hidden, generator=g).to(DEV, torch.bfloat16)
    w = (torch.randn(v_local, hidden, generator=g) / 8).to(DEV, torch.bfloat16)
    labels = torch.randint(0, vocab, (c,), generator=g).to(DEV)
    labels[::5] = -100
    coef = (torch.rand(c, generator=g) + 0.5).to(DEV) * (labels != -100)
    opts = CrossEntropyOptions(logit_softcapping=cap, label_smoothing=eps, z_loss=z)
    got, want = (chunk_cross_entropy(h, w, None, labels, coef, opts.replace(impl=impl),
                                     vocab_size=vocab, vocab_start=start)
                 for impl in ("triton", "torch"))
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.lse, want.lse, rtol=1e-5, atol=1e-5)
    assert got.grad_logits.dtype == torch.bfloat16
    torch.testing.assert_close(got.grad_logits.float(), want.grad_logits,
                               rtol=2 ** -8 + 1e-5, atol=1e-9)


def test_triton_epilogue_holds_no_fp32_logits():
    _needs_triton()
    n, hidden, vocab, chunk = 4096, 1024, 32000, 1024
    h, w, _, labels, _ = _inputs(n, hidden, vocab, torch.bfloat16, seed=2)
    h.requires_grad_()
    w.requires_grad_()
    h.grad, w.grad = torch.zeros_like(h), torch.zeros_like(w)
    peaks = {}
    for impl in ("torch", "triton", "torch", "triton"):  # second round: warm allocator/kernels
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        megaloss.LinearCrossEntropyLoss(impl=impl, chunk_size=chunk)(h, w, labels).backward()
        torch.cuda.synchronize()
        peaks[impl] = torch.cuda.max_memory_allocated() - base
    fp32_chunk = chunk * vocab * 4
    assert peaks["triton"] + 0.75 * fp32_chunk <= peaks["torch"], peaks


def test_vocab_parallel_one_rank_matches_single_device():
    _needs_triton()
    h, w, b, labels, weights = _inputs(257, 64, 3001, torch.bfloat16, seed=3)
    opts = CrossEntropyOptions(impl="triton", chunk_size=64, **OPTS)
    outs = []
    for fn in (megaloss.linear_cross_entropy_with_stats,
               megaloss.vocab_parallel_linear_cross_entropy_with_stats):
        hl, wl = h.clone().requires_grad_(), w.clone().requires_grad_()
        out = fn(hl, wl, labels, loss_weights=weights, options=opts)
        outs.append([out.loss.detach()] + list(torch.autograd.grad(out.loss, [hl, wl])))
    for a, b_ in zip(*outs):
        torch.testing.assert_close(a, b_, rtol=0, atol=0)


@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_vocab_slices_in_threads_match_one_device(reduction):
    _needs_triton()
    n, hidden, vocab = 700, 64, 20011
    h, w, _, labels, _ = _inputs(n, hidden, vocab, torch.float32, seed=4)
    bounds = [(0, 10006), (10006, vocab), (vocab, vocab)]
    opts = CrossEntropyOptions(impl="triton", reduction=reduction, chunk_size=256, **OPTS)
    upstream = (torch.rand(n, device=DEV) + 0.5) if reduction == "none" else \
        torch.tensor(0.7, device=DEV)
    slices, (ref_loss, ref_dh, ref_dw) = slices_and_one_device(h, w, labels, bounds, opts,
                                                               upstream)
    for start, stop, loss, _dh, dw in slices:
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dw, ref_dw[start:stop], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sum(s[3] for s in slices), ref_dh, rtol=1e-5, atol=1e-6)
