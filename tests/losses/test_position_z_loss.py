"""megaloss.losses.position_z_loss.linear_position_z_loss (the kernel of
megaloss/ops/z_loss_kernel.py on the chunk driver): value and gradients against the float64
full-logits formula ``coefficient * softcap(F.linear(h, W, b)).logsumexp(-1).pow(2).mean()``
(Bamba's z-loss term, transformers/models/bamba/modeling_bamba.py), with and without a cap and
bias, chunks that do not divide the tokens, fp32 inputs to their rounding; bad input refused."""
import pytest
import torch
import torch.nn.functional as F

from megaloss.losses.position_z_loss import linear_position_z_loss


def _inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(3, 7, 5, generator=g, dtype=torch.float64) * 2
    w = torch.randn(11, 5, generator=g, dtype=torch.float64)
    b = torch.randn(11, generator=g, dtype=torch.float64)
    return [t.to(dtype).requires_grad_() for t in (h, w, b)]


@pytest.mark.parametrize("cap, bias, dtype, tol", [
    (None, False, torch.float64, 1e-13), (2.0, True, torch.float64, 1e-13),
    (3.0, True, torch.float32, 2e-5)])
def test_equals_the_full_logits_formula(cap, bias, dtype, tol):
    h, w, b = _inputs(dtype)
    b = b if bias else None
    got = linear_position_z_loss(h, w, bias=b, coefficient=0.3, logit_softcapping=cap,
                                 chunk_size=4)
    assert got.dtype == dtype
    got.backward()
    ref_inputs = [t.detach().double().requires_grad_() for t in (h, w, b) if t is not None]
    z = F.linear(*ref_inputs)
    if cap is not None:
        z = cap * torch.tanh(z / cap)
    ref = 0.3 * z.logsumexp(-1).pow(2).mean()
    ref.backward()
    torch.testing.assert_close(got.double(), ref, rtol=tol, atol=tol)
    for t, r in zip((x for x in (h, w, b) if x is not None), ref_inputs):
        torch.testing.assert_close(t.grad.double(), r.grad, rtol=tol, atol=tol)


def test_no_positions_give_zero_and_bad_input_is_refused():
    h, w, _ = _inputs(torch.float64)
    assert float(linear_position_z_loss(h[:, :0], w, coefficient=0.1)) == 0.0
    with pytest.raises(ValueError, match="coefficient must be a number >= 0"):
        linear_position_z_loss(h, w, coefficient=-1.0)
    with pytest.raises(ValueError, match="hidden size"):
        linear_position_z_loss(h, w[:, :4], coefficient=0.1)
