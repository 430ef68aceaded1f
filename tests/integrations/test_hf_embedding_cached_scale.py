"""cached_mnr_forward: the replays must take the scale the caller applies to ``out.loss``.

One process, float64, a tiny encoder, a caller that divides its loss by its accumulation window
(2): with the default ``backward=None`` (the replays inside the caller's backward) and with a
``backward`` that divides the replays alike, it gets the non-cached gradient of ``loss / 2``
(rtol 1e-10: summation order only); with a ``backward`` that leaves the replays at scale 1 it gets
a ValueError from its backward instead of a gradient that weights the mini-batches 2:1.
"""
import pytest
import torch

from megaloss.integrations.hf.embedding import EmbeddingModelWithMNR, cached_mnr_forward
from tests.helpers.tiny_encoder import TokenEncoder

V, H, T, ROWS, MINI, WINDOW = 11, 6, 4, 5, 2, 2


def _Encoder():
    return TokenEncoder(V, H)


def _setup():
    torch.manual_seed(0)
    model = EmbeddingModelWithMNR(_Encoder(), temperature=0.1).double()
    g = torch.Generator().manual_seed(3)
    q, d = (torch.randint(0, V, (ROWS, T), generator=g) for _ in range(2))
    batch = {"query_input_ids": q, "query_attention_mask": torch.ones_like(q),
             "document_input_ids": d, "document_attention_mask": torch.ones_like(d)}
    return model, batch


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("backward", ["default", "scaled"])
def test_replays_scaled_as_the_caller_equal_non_cached(backward):
    model, batch = _setup()
    (model(**batch).loss / WINDOW).backward()
    ref = _grads(model)
    model.zero_grad(set_to_none=True)
    out = cached_mnr_forward(model, batch, mini_batch_size=MINI,
                             backward=None if backward == "default"
                             else lambda t: (t / WINDOW).backward())
    (out.loss / WINDOW).backward()
    for name, g in _grads(model).items():
        torch.testing.assert_close(g, ref[name], rtol=1e-10, atol=1e-14, msg=name)


def test_replays_scaled_otherwise_raise():
    model, batch = _setup()
    out = cached_mnr_forward(model, batch, mini_batch_size=MINI,
                             backward=lambda t: t.backward())  # replays at scale 1
    with pytest.raises(ValueError, match="scale"):
        (out.loss / WINDOW).backward()
