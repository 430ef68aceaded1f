"""``linear_log_probs`` on CUDA (marked ``cuda``, skipped without a GPU; ``tools/gpu_check.sh``
runs them): ``impl`` torch / triton in fp32 and bf16 against a float64 full-logits reference on
the same GPU at a real vocabulary size (blocks of 4096), gradients of random per-token upstream
gradients of log_probs and entropy together.

Tolerances: fp32 5e-5 (relative to the largest entry for gradients); bf16 inputs are rounded to
bf16 for the reference too, so what remains is the bf16 GEMM output and bf16 logit gradient:
2e-2 on log_probs / entropy (logits ~ 10, one bf16 ulp 2^-8 relative), 2^-5 of the largest
gradient entry.
"""
import pytest
import torch

import megaloss
from tests.helpers.log_probs_reference import reference

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_cuda_log_probs_match_float64(dtype, impl):
    if impl == "triton":
        pytest.importorskip("triton")
    g = torch.Generator().manual_seed(0)
    n, hidden, vocab = 300, 64, 32000
    h = torch.randn(n, hidden, generator=g, dtype=torch.float64)
    w = torch.randn(vocab, hidden, generator=g, dtype=torch.float64) * (2.0 / hidden ** 0.5)
    b = torch.randn(vocab, generator=g, dtype=torch.float64) * 0.1
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[::7] = -100
    a, c = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g,
                                                                          dtype=torch.float64)
    leaves = [t.to("cuda", dtype).requires_grad_() for t in (h, w, b)]
    out = megaloss.linear_log_probs(*leaves[:2], labels.cuda(), bias=leaves[2], impl=impl,
                                    temperature=0.8, logit_softcapping=30.0, chunk_size=128,
                                    return_entropy=True)
    loss = (out.log_probs.double() * a.cuda()).sum() + (out.entropy.double() * c.cuda()).sum()
    grads = torch.autograd.grad(loss, leaves)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref = reference(*ref_leaves[:2], labels.cuda(), ref_leaves[2], temperature=0.8, cap=30.0)
    ref_grads = torch.autograd.grad((ref[0] * a.cuda()).sum() + (ref[1] * c.cuda()).sum(),
                                    ref_leaves)
    tol = 5e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.log_probs.double(), ref[0], rtol=0, atol=tol)
    torch.testing.assert_close(out.entropy.double(), ref[1], rtol=0, atol=tol)
    torch.testing.assert_close(out.lse.double(), ref[2], rtol=0, atol=tol)
    gtol = 5e-5 if dtype == torch.float32 else 2 ** -5
    for name, got, want in zip(("d_hidden", "d_weight", "d_bias"), grads, ref_grads):
        scale = float(want.abs().max())
        torch.testing.assert_close(got.double(), want, rtol=0, atol=gtol * scale, msg=name)
