"""The Triton chunk epilogue against the torch one, on CPU tensors under Triton's interpreter.

Run by ``tests/ops/test_triton_epilogue.py`` in a subprocess with ``TRITON_INTERPRET=1`` (the
variable must be set before triton is first imported, which the main pytest process has done
long before; and it must not leak into the processes other tests spawn). Directly:
``TRITON_INTERPRET=1 python3 -m pytest tests/ops/triton_interpreter_cases.py``.

``MAX_BLOCK`` is lowered so that rows span several blocks with a ragged last one, as at real
vocabulary sizes. Tolerances: losses and log-sum-exps agree to fp32 rounding (the kernels take
``exp(y - lse)`` where torch takes ``exp(y - max) / sum``; tanh is computed from ``exp``); the
bf16 gradient is the fp32 gradient cast once to bf16, where torch's is kept in fp32: within one
bf16 ulp (2^-7 relative), since the interpreter truncates fp32 -> bf16 where the GPU rounds to
nearest even (half an ulp; the CUDA tests check that).
"""
import itertools
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 from the start of the process (tests/ops/"
                "test_triton_epilogue.py runs this file so)", allow_module_level=True)
pytest.importorskip("triton")

from vocab_slices import slices_and_one_device  # noqa: E402  (tests/ops/)

import megaloss  # noqa: E402
from megaloss import CrossEntropyOptions  # noqa: E402
from megaloss.ops import triton_common  # noqa: E402
from megaloss.ops.cross_entropy_chunk import chunk_cross_entropy  # noqa: E402

assert triton_common.interpreted(), "triton was imported before TRITON_INTERPRET=1 was set"


@pytest.fixture(scope="module", autouse=True)
def small_blocks():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(triton_common, "MAX_BLOCK", 128)
        yield


def _chunk_inputs(dtype, seed=0, n=8, hidden=16, v_local=150, vocab_size=400, vocab_start=120):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g).to(dtype)
    w = (torch.randn(v_local, hidden, generator=g) * 0.7).to(dtype)
    labels = torch.randint(0, vocab_size, (n,), generator=g)
    # Targets on both edges of the slice, just outside it, and ignored ones.
    labels[:5] = torch.tensor([vocab_start, vocab_start + v_local - 1, vocab_start - 1,
                               vocab_start + v_local, -100])
    labels[6] = -100
    coef = torch.rand(n, generator=g) + 0.25
    coef[labels == -100] = 0.0
    return h, w, labels, coef


def _close(got, want, dtype, what):
    if dtype == torch.float32 or got.dtype == torch.float32 and want.dtype == torch.float32:
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-5, atol=1e-6, msg=what)
    else:  # triton's gradient: the fp32 value cast once to bf16 / fp16 (within one ulp)
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7 + 1e-5, atol=1e-7,
                                   msg=what)


OPTION_MATRIX = list(itertools.product([None, 3.0], [0.0, 0.1], [0.0, 1e-2]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cap,eps,z", OPTION_MATRIX,
                         ids=[f"cap{c}-ls{e}-z{z}" for c, e, z in OPTION_MATRIX])
def test_chunk_matches_torch_epilogue(dtype, cap, eps, z):
    h, w, labels, coef = _chunk_inputs(dtype)
    got, want = (chunk_cross_entropy(
        h, w, None, labels, coef,
        CrossEntropyOptions(impl=impl, logit_softcapping=cap, label_smoothing=eps, z_loss=z),
        vocab_size=400, vocab_start=120) for impl in ("triton", "torch"))
    assert got.grad_logits.dtype == dtype  # written over the logits, in their dtype
    _close(got.loss, want.loss, torch.float32, "loss")
    _close(got.lse, want.lse, torch.float32, "lse")
    _close(got.grad_logits, want.grad_logits, dtype, "grad_logits")
    ignored = labels == -100
    assert torch.all(got.loss[ignored] == 0) and torch.all(got.grad_logits[ignored] == 0)


def test_forward_only_and_given_lse_passes():
    """coef=None: statistics only (the deferred forward); lse given: the gradient pass only
    (the deferred backward), with a bias."""
    h, w, labels, coef = _chunk_inputs(torch.float32, seed=1)
    bias = torch.randn(w.shape[0])
    opts = CrossEntropyOptions(impl="triton", logit_softcapping=4.0, label_smoothing=0.05,
                               z_loss=1e-3)
    kw = dict(vocab_size=400, vocab_start=120)
    fwd = chunk_cross_entropy(h, w, bias, labels, None, opts, **kw)
    ref = chunk_cross_entropy(h, w, bias, labels, None, opts.replace(impl="torch"), **kw)
    assert fwd.grad_logits is None
    _close(fwd.loss, ref.loss, torch.float32, "loss")
    _close(fwd.lse, ref.lse, torch.float32, "lse")
    bwd = chunk_cross_entropy(h, w, bias, labels, coef, opts, lse=ref.lse, **kw)
    ref_bwd = chunk_cross_entropy(h, w, bias, labels, coef, opts.replace(impl="torch"),
                                  lse=ref.lse, **kw)
    assert torch.all(bwd.loss == 0)
    _close(bwd.grad_logits, ref_bwd.grad_logits, torch.float32, "grad_logits")


@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_vocab_parallel_slices_match_one_device(reduction):
    """Three slices of one vocabulary (the last one empty, as a padded tensor-parallel rank):
    every slice gets the one-device loss, the slices' weight gradients are its rows and their
    hidden gradients sum to its hidden gradient. ``none`` takes the deferred schedule (the
    gradient pass in backward, from the saved lse)."""
    n, hidden, vocab, chunk = 12, 8, 301, 8
    g = torch.Generator().manual_seed(3)
    h = torch.randn(n, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g) * 0.5
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[::6] = -100
    bounds = [(0, 150), (150, vocab), (vocab, vocab)]
    opts = CrossEntropyOptions(reduction=reduction, chunk_size=chunk, label_smoothing=0.1,
                               z_loss=1e-3, logit_softcapping=5.0)
    upstream = torch.rand(n, generator=g) + 0.5 if reduction == "none" else torch.tensor(0.7)
    slices, (ref_loss, ref_dh, ref_dw) = slices_and_one_device(
        h, w, labels, bounds, opts.replace(impl="triton"), upstream)
    for start, stop, loss, _dh, dw in slices:
        _close(loss, ref_loss, torch.float32, f"loss of slice {start}")
        _close(dw, ref_dw[start:stop], torch.float32, f"d_weight of slice {start}")
    _close(sum(dh for *_, dh, _ in slices), ref_dh, torch.float32, "sum of d_hidden")


@pytest.mark.parametrize("dtype,reduction", [(torch.float32, "mean"), (torch.bfloat16, "mean"),
                                             (torch.float16, "sum"), (torch.float32, "none")],
                         ids=["fp32-mean", "bf16-mean", "fp16-sum-deferred", "fp32-none"])
def test_public_api_triton_matches_torch(dtype, reduction):
    """megaloss.linear_cross_entropy_with_stats end to end (chunk loop, bias, loss weights,
    autograd) with the forced Triton epilogue against the torch one."""
    g = torch.Generator().manual_seed(4)
    n, hidden, vocab = 11, 8, 97
    h0 = torch.randn(n, hidden, generator=g).to(dtype)
    w0 = (torch.randn(vocab, hidden, generator=g) * 0.5).to(dtype)
    b0 = torch.randn(vocab, generator=g).to(dtype)
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[::4] = -100
    weights = torch.rand(n, generator=g) + 0.5
    upstream = torch.rand(n, generator=g) + 0.5 if reduction == "none" else torch.tensor(1.3)
    results = {}
    for impl in ("triton", "torch"):
        h, w, b = (t.clone().requires_grad_() for t in (h0, w0, b0))
        opts = CrossEntropyOptions(impl=impl, reduction=reduction, chunk_size=8,
                                   label_smoothing=0.1, z_loss=1e-3, logit_softcapping=6.0)
        out = megaloss.linear_cross_entropy_with_stats(h, w, labels, bias=b,
                                                       loss_weights=weights, options=opts)
        results[impl] = (out.loss.detach(), out.z_loss) + torch.autograd.grad(
            out.loss, [h, w, b], upstream)
    names = ("loss", "z_loss", "d_hidden", "d_weight", "d_bias")
    for name, got, want in zip(names, results["triton"], results["torch"]):
        if dtype == torch.float32 or name in ("loss", "z_loss"):
            _close(got, want, torch.float32, name)
        else:  # half-precision gradients: products of logit gradients that differ by 1/2 ulp
            scale = want.float().abs().max()
            torch.testing.assert_close(got.float(), want.float(), rtol=0,
                                       atol=float(scale) * 2 ** -6, msg=name)
