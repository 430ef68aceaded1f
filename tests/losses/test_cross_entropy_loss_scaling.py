"""Half-precision gradients under loss scaling (DeepSpeed's ``fp16`` section multiplies the loss by
a scale ``S``, 2^16 initially, and divides the gradients by ``S`` before the step).

The bar is eager torch in the same dtype (``F.linear`` + ``F.cross_entropy``): against the float64
gradients, megaloss's relative error must be at most 2x eager's (plus 1e-3 of slack for tiny
errors), and never inf/NaN where eager is finite, for loss scales 1 .. 2^24 and token weights
down to 2^-24 (the calibrator's weights are ~1 / global tokens).
"""
import pytest
import torch
import torch.nn.functional as F

import megaloss

N, H, V = 512, 64, 256


def _inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.5
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::7] = -100
    return hidden, weight, labels


def _grads(fn, hidden, weight, scale, dtype):
    h = hidden.detach().to(dtype).clone().requires_grad_(True)
    w = weight.detach().to(dtype).clone().requires_grad_(True)
    (fn(h, w) * scale).backward()
    return [t.grad.double() / scale for t in (h, w)]


def _rel(got, ref):
    return float((got - ref).norm() / ref.norm())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("reduction, token_weight", [("mean", None), ("sum", None),
                                                     ("sum", 2.0 ** -20), ("sum", 2.0 ** -24)])
@pytest.mark.parametrize("scale", [1.0, 2.0 ** 15, 2.0 ** 16, 2.0 ** 24])
def test_scaled_backward_matches_eager_accuracy(dtype, reduction, token_weight, scale):
    hidden, weight, labels = _inputs(dtype)
    lw = None if token_weight is None else torch.full((N,), token_weight, dtype=torch.float64)

    def eager(h, w):
        per = F.cross_entropy(F.linear(h, w).float(), labels, reduction="none")
        per = per if lw is None else per * lw.to(per.dtype)
        return per.sum() if reduction == "sum" else per.sum() / (labels != -100).sum()

    def mega(h, w):
        return megaloss.linear_cross_entropy(
            h, w, labels, reduction=reduction, chunk_size=256,
            loss_weights=None if lw is None else lw.to(torch.float32))

    ref = _grads(eager, hidden, weight, 1.0, torch.float64)
    got = _grads(mega, hidden, weight, scale, dtype)
    base = _grads(eager, hidden, weight, scale, dtype)
    for name, g, b, r in zip(("hidden_states", "weight"), got, base, ref):
        if not torch.isfinite(b).all():
            continue  # eager overflows too: the engine's dynamic loss scaler skips this step
        assert torch.isfinite(g).all(), f"{name}: inf/NaN where eager is finite"
        err, eager_err = _rel(g, r), _rel(b, r)
        assert err <= 2 * eager_err + 1e-3, f"{name}: error {err:.2e} vs eager {eager_err:.2e}"
