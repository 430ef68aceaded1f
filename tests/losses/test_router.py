"""megaloss.losses.router against float64 references written from the papers' formulas (one-hot
counts, autograd through the softmax), against transformers' own load_balancing_loss_func, and
the pool property the calibrated step rests on: shares of a pool computed piece by piece (ranks,
micro-batches) add up to the pool's loss and gradient. Tolerances: 1e-12 relative in float64
(summation order only); 1e-6 against transformers' function (it accumulates in float32)."""
import pytest
import torch

from megaloss.losses.router import RouterLossOptions, router_loss, router_statistics

L, N, E, K = 3, 24, 6, 2


def _logits(seed=0, n=N, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, n, E, generator=g, dtype=dtype).requires_grad_(True)


def _mask(n=N, seed=1):
    g = torch.Generator().manual_seed(seed)
    m = (torch.rand(n, generator=g) > 0.25).to(torch.float64)
    m[0] = 1.0
    return m


def _reference(x, mask, seq, layers="per_layer"):
    """[aux, seq_aux, z] of one pool, float64, from the formulas (one-hot counts)."""
    p = torch.softmax(x, dim=-1)  # [L, N, E]
    sel = torch.nn.functional.one_hot(x.topk(K, dim=-1).indices, E).sum(-2).to(x.dtype)
    m = mask[None, :, None]
    n = mask.sum()
    if layers == "per_layer":
        aux = (E * ((sel * m).sum(1) / n) * ((p * m).sum(1) / n)).sum(-1).mean()
    else:
        f = (sel * m).sum((0, 1)) / (L * n)
        aux = E * (f * (p * m).sum((0, 1)) / (L * n)).sum()
    seq_terms = []
    for s in seq.unique():
        ms = m * (seq == s).to(x.dtype)[None, :, None]
        t = ms.sum()
        if t == 0:
            continue
        seq_terms.append((E / (K * t) * (sel * ms).sum(1) * (p * ms).sum(1) / t).sum(-1).mean())
    seq_aux = torch.stack(seq_terms).mean()
    z = (torch.logsumexp(x, -1) ** 2 * mask[None]).sum() / (L * n)
    return torch.stack([aux, seq_aux, z])


OPTS = RouterLossOptions(aux_loss=0.3, seq_aux_loss=0.2, z_loss=0.1)


@pytest.mark.parametrize("layers", ["per_layer", "concatenated"])
def test_terms_and_gradients_match_the_formulas(layers):
    x, mask = _logits(), _mask()
    seq = torch.arange(N) // 8
    opts = OPTS.replace(layers=layers)
    out = router_loss(x, K, options=opts, mask=mask, sequence_ids=seq)
    (gx,) = torch.autograd.grad(out.loss, x)
    ref = _reference(x, mask, seq, layers)
    coef = torch.tensor([0.3, 0.2, 0.1], dtype=torch.float64)
    (rx,) = torch.autograd.grad((ref * coef).sum(), x)
    got = torch.stack([out.aux_loss, out.seq_aux_loss, out.z_loss])
    torch.testing.assert_close(got, ref.detach(), rtol=1e-12, atol=0)
    torch.testing.assert_close(gx, rx, rtol=1e-10, atol=1e-14)
    assert float(out.statistics.num_tokens) == float(mask.sum())


@pytest.mark.slow  # imports transformers (about 3 s)
def test_concatenated_is_transformers_load_balancing_loss():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    x, mask = _logits(seed=3), _mask(seed=4)
    out = router_loss(list(x.unbind(0)), K, options=RouterLossOptions(aux_loss=1.0,
                      layers="concatenated"), mask=mask.reshape(2, N // 2))
    hf = load_balancing_loss_func(tuple(x.unbind(0)), E, K, mask.reshape(2, N // 2))
    (gx,) = torch.autograd.grad(out.loss, x)
    (hx,) = torch.autograd.grad(hf, x)
    torch.testing.assert_close(out.loss, hf.to(torch.float64), rtol=1e-6, atol=0)
    torch.testing.assert_close(gx, hx.to(torch.float64), rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("layers", ["per_layer", "concatenated"])
def test_shares_of_a_pool_add_up_to_the_pool(layers):
    """The step scope: micro-batches of [4, 4, 4] and [6, 2, 4] tokens (the Megatron-LM
    micro-batch split whose per-micro-batch normalisation changes the gradient) give the pool's
    loss and gradient exactly once the pool's counts are shared; per micro-batch they do not."""
    x, mask = _logits(seed=5, n=12), torch.ones(12, dtype=torch.float64)
    seq = torch.arange(12) // 6
    opts = OPTS.replace(layers=layers, seq_aux_loss=0.0)
    whole = router_loss(x, K, options=opts, mask=mask)
    (g_whole,) = torch.autograd.grad(whole.loss, x)
    stats = router_statistics(x, K, mask=mask, sequence_ids=seq)
    grads = {}
    for split in ([4, 4, 4], [6, 2, 4]):
        pieces = torch.split(torch.arange(12), split)
        shared = sum(router_loss(x[:, i], K, options=opts, mask=mask[i], statistics=stats).loss
                     for i in pieces)
        torch.testing.assert_close(shared, whole.loss, rtol=1e-12, atol=0)
        (g,) = torch.autograd.grad(shared, x)
        torch.testing.assert_close(g, g_whole, rtol=1e-10, atol=1e-15)
        own = sum(router_loss(x[:, i], K, options=opts, mask=mask[i], weight=1 / len(split)).loss
                  for i in pieces)
        (grads[tuple(split)],) = torch.autograd.grad(own, x)
    assert (grads[(4, 4, 4)] - grads[(6, 2, 4)]).abs().max() > 1e-3


def test_padding_and_empty_pool_give_zero_not_nan():
    x = _logits(seed=7)
    out = router_loss(x, K, options=OPTS, mask=torch.zeros(N))
    (gx,) = torch.autograd.grad(out.loss, x)
    assert float(out.loss.detach()) == 0.0 and torch.all(gx == 0)
    full = router_loss(x, K, options=OPTS.replace(seq_aux_loss=0.0),
                       mask=torch.cat([torch.ones(N - 4), torch.zeros(4)]))
    part = router_loss(x[:, :N - 4], K, options=OPTS.replace(seq_aux_loss=0.0))
    torch.testing.assert_close(full.loss, part.loss, rtol=1e-12, atol=0)


def test_fp32_logits_and_a_stacked_tensor():
    x = _logits(seed=9, dtype=torch.float32)
    out = router_loss(x, K, options=OPTS)
    ref = router_loss(x.detach().double().requires_grad_(True), K, options=OPTS)
    assert out.loss.dtype == torch.float32
    torch.testing.assert_close(out.loss.double(), ref.loss.detach(), rtol=1e-5, atol=0)


@pytest.mark.parametrize("call, match", [
    (lambda x: router_loss(x, 0, options=OPTS), "top_k"),
    (lambda x: router_loss(x, K, options={"aux_loss": 1}), "options"),
    (lambda x: router_loss(x[0], K, options=OPTS), "router_logits"),
    (lambda x: router_loss([x[0], x[1][:3]], K, options=OPTS), r"router_logits\[1\]"),
    (lambda x: router_loss(x, K, options=OPTS, mask=torch.ones(3)), "mask"),
    (lambda x: router_loss(x, K, options=OPTS, weight=-1.0), "weight"),
    (lambda x: RouterLossOptions(scope="batch"), "scope"),
    (lambda x: RouterLossOptions(aux_loss=-0.1), "aux_loss"),
])
def test_bad_input_names_the_argument(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call(_logits())
