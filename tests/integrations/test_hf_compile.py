"""A Hugging Face model trained through ``CausalLMWithLoss`` under ``torch.compile``: the same
losses and gradients as the eager wrapper at every step of a short SGD run, on padded batches
whose ignored labels (prompt, padding, a whole chunk) change from step to step, compiled into one
graph (no graph break, no recompilation). Tiny Llama, float64, backend ``aot_eager``; tolerance
``1e-12`` relative and absolute (the same operations in the same order)."""
import pytest
import torch

from megaloss import CrossEntropyOptions
from megaloss.integrations.hf import CausalLMWithLoss
from tests.helpers.compile_checks import GRAPH_BREAKS, assert_graph_breaks, counted_compile

BREAKS_EARLY = GRAPH_BREAKS["gradient_in_forward"]  # reduction "mean" / "sum"
pytestmark = pytest.mark.slow  # compiling the decoder takes seconds

V, B, T, CHUNK = 53, 2, 12, 4  # 24 tokens, 6 chunks


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=T)
    return LlamaForCausalLM(cfg).double()


def _batch(step):
    """Right-padded rows; labels -100 on the padding and on a prompt whose length changes with
    the step (step 1: every target of the first chunk of row 0 ignored)."""
    gen = torch.Generator().manual_seed(10 + step)
    ids = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, T - 3 - step:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, :CHUNK + 1 + step] = -100
    return ids, mask, labels


def test_compiled_wrapper_trains_like_eager():
    options = CrossEntropyOptions(chunk_size=CHUNK, reduction="mean", z_loss=1e-3)
    eager = CausalLMWithLoss(_tiny_llama(), options=options)
    model = CausalLMWithLoss(_tiny_llama(), options=options)  # the same seeded weights
    compiled, counter = counted_compile(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (eager, model)]
    for step in range(3):
        ids, mask, labels = _batch(step)
        outs = []
        for m, opt in zip((eager, compiled), opts):
            opt.zero_grad()
            out = m(ids, labels, attention_mask=mask)
            out.loss.backward()
            outs.append((out, {n: p.grad.clone() for n, p in m.named_parameters()}))
            opt.step()
        (want, want_grads), (got, got_grads) = outs
        torch.testing.assert_close(got.loss, want.loss, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got.z_loss, want.z_loss, rtol=1e-12, atol=1e-12)
        assert int(got.num_valid_tokens) == int((labels[:, 1:] != -100).sum())
        names = [n.removeprefix("_orig_mod.") for n in got_grads]
        assert sorted(names) == sorted(want_grads)
        for name, g in got_grads.items():
            name = name.removeprefix("_orig_mod.")
            torch.testing.assert_close(g, want_grads[name], rtol=1e-12, atol=1e-12, msg=name)
    ids, mask, labels = _batch(0)
    assert_graph_breaks(counter, BREAKS_EARLY, lambda: model(ids, labels, attention_mask=mask),
                        what="CausalLMWithLoss")
