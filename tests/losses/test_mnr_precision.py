"""MNR in half precision and at the shape edges: bf16 cosine embeddings give the float64 loss of
the same (bf16-rounded) inputs to fp32 accuracy, as sentence-transformers' MNRL does; an empty
``negatives [B, 0, D]`` gets an empty gradient, as torch gives."""
import pytest
import torch
import torch.nn.functional as F

from megaloss import mnr_loss


def _reference(q, p, neg, temperature):
    """Float64, the obvious way: normalise, score against positives then negatives."""
    q, p = F.normalize(q.double(), dim=-1), F.normalize(p.double(), dim=-1)
    docs = torch.cat([p, F.normalize(neg.double(), dim=-1).reshape(-1, q.shape[1])])
    return F.cross_entropy(q @ docs.T / temperature, torch.arange(q.shape[0]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_cosine_loss_and_grads_at_fp32_accuracy(dtype):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(64, 32, generator=g).to(dtype).requires_grad_(True)
    p = (q.detach().float() + torch.randn(64, 32, generator=g)).to(dtype).requires_grad_(True)
    neg = torch.randn(64, 3, 32, generator=g).to(dtype).requires_grad_(True)
    loss = mnr_loss(q, p, neg, temperature=0.05)
    ref = _reference(q.detach(), p.detach(), neg.detach(), 0.05)
    # before the fix (normalising in bf16): 8e-3 .. 2e-2
    assert abs(float(loss.detach()) - float(ref)) <= 1e-5 * abs(float(ref))
    loss.backward()
    qd = q.detach().double().requires_grad_(True)
    _reference(qd, p.detach(), neg.detach(), 0.05).backward()
    assert q.grad.dtype == dtype
    torch.testing.assert_close(q.grad.double(), qd.grad, rtol=0.02, atol=2e-3)


def test_empty_negatives_get_an_empty_gradient():
    q = torch.randn(4, 8, requires_grad=True)
    p = torch.randn(4, 8, requires_grad=True)
    neg = torch.randn(4, 0, 8, requires_grad=True)
    mnr_loss(q, p, neg).backward()
    assert neg.grad is not None and neg.grad.shape == (4, 0, 8)
