"""The default chunk (``chunk_size=None``): fp32 logits about the hidden states' size, at least
``MIN_AUTO_CHUNK`` tokens, and the same loss and gradients as an explicit chunk."""
import pytest
import torch

import megaloss
from megaloss.ops.chunk_driver import MIN_AUTO_CHUNK, auto_chunk_size


@pytest.mark.parametrize("n,v,h,expected", [
    (4096, 32000, 1024, MIN_AUTO_CHUNK),  # ceil(V / H) = 32: 128 tokens, under the floor
    (65536, 32000, 1024, 2048),
    (65536, 16000, 1024, 4096),    # TP 2's shard: half the rows, twice the tokens
    (65536, 128256, 4096, 2048),   # a Llama-3 head
    (100, 32000, 1024, MIN_AUTO_CHUNK),  # the floor
    (0, 10, 4, MIN_AUTO_CHUNK),
    (5000, 10, 64, 8192),          # a small vocabulary: one chunk
])
def test_auto_chunk_size(n, v, h, expected):
    c = auto_chunk_size(n, v, h)
    assert c == expected
    if c > MIN_AUTO_CHUNK:  # the logits block is at most ~2x the hidden states
        assert c * v <= 2 * n * h * 2


def test_the_default_is_the_auto_chunk_and_gives_the_explicit_result():
    assert megaloss.CrossEntropyOptions().chunk_size is None
    assert megaloss.LogProbsOptions().chunk_size is None
    assert megaloss.DistillationOptions().chunk_size is None
    g = torch.Generator().manual_seed(0)
    n, h, v = 1200, 8, 40  # auto: max(512, next_pow2(ceil(1200 / 5))) = 512 -> 3 chunks
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64)
    labels = torch.randint(0, v, (n,), generator=g)
    grads = []
    for chunk in (None, MIN_AUTO_CHUNK, n):
        x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = megaloss.linear_cross_entropy(x, w, labels, chunk_size=chunk)
        loss.backward()
        grads.append((loss.detach(), x.grad, w.grad))
    for a, b in zip(grads[0], grads[1]):  # the same chunks: bitwise
        assert torch.equal(a, b)
    for a, b in zip(grads[0], grads[2]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "auto"])
def test_a_bad_chunk_size_is_named(bad):
    with pytest.raises(ValueError, match="chunk_size must be None or an int >= 1"):
        megaloss.CrossEntropyOptions(chunk_size=bad)
