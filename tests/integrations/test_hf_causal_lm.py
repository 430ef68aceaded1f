"""The Hugging Face causal-LM wrapper, single process: HF's label convention, loss and gradients
against Hugging Face's own (float64 and fp32), loss weights and z-loss, input errors."""
import pytest
import torch

from megaloss import CrossEntropyOptions, causal_shift
from megaloss.integrations.hf import CausalLMWithLoss


def _tiny_llama(vocab=29, tie=False, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
                      tie_word_embeddings=tie)
    return LlamaForCausalLM(cfg).double()


def test_causal_shift():
    y = torch.tensor([[1, 2, 3], [4, 5, 6]])
    assert causal_shift(y).tolist() == [[2, 3, -100], [5, 6, -100]]
    assert causal_shift(y, ignore_index=-1)[:, -1].tolist() == [-1, -1]
    with pytest.raises(TypeError, match="labels"):
        causal_shift(y.float())
    with pytest.raises(ValueError, match="sequence"):
        causal_shift(torch.tensor(3))


@pytest.mark.parametrize("tie", [False, True])
def test_wrapper_matches_hf_loss_and_gradients(tie):
    """sum-reduced fused CE / valid tokens == the float64 mean CE of HF's own logits (HF's
    ``loss`` upcasts to fp32, so it is recomputed here in fp64 with HF's shift); same gradients
    (chunked: 7 tokens per chunk over 2 x 11 tokens); tied embeddings stay tied."""
    ids = torch.randint(0, 29, (2, 11), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[0, :4] = -100
    ref_model = _tiny_llama(tie=tie)
    logits = ref_model(input_ids=ids).logits
    ref = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 29),
                                            labels[:, 1:].reshape(-1), ignore_index=-100)
    assert logits.dtype == torch.float64
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in ref_model.named_parameters()}

    model = _tiny_llama(tie=tie)
    wrapper = CausalLMWithLoss(model, options=CrossEntropyOptions(chunk_size=7, reduction="sum"))
    if tie:
        assert wrapper.head.weight is model.get_input_embeddings().weight
    out = wrapper(ids, labels)  # Hugging Face convention: unshifted labels
    assert int(out.num_valid_tokens) == int((causal_shift(labels) != -100).sum())
    loss = out.loss / out.num_valid_tokens
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    loss.backward()
    grads = {n.removeprefix("model."): p.grad for n, p in wrapper.named_parameters()}
    grads = {("lm_head.weight" if n == "lm_head.weight" else n): g for n, g in grads.items()}
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-10, atol=1e-12, msg=name)


def test_wrapper_loss_weights_and_z_loss():
    ids = torch.randint(0, 29, (2, 9), generator=torch.Generator().manual_seed(4))
    labels = causal_shift(ids)
    w = torch.rand(labels.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    wrapper = CausalLMWithLoss(_tiny_llama(), options=CrossEntropyOptions(
        z_loss=1e-2, chunk_size=5, reduction="sum"))
    out = wrapper(ids, shift_labels=labels, loss_weights=w)
    with torch.no_grad():
        h = wrapper.decoder(input_ids=ids).last_hidden_state
        logits = h @ wrapper.head.weight.T
        lse = torch.logsumexp(logits, -1)
        valid = labels != -100
        tgt = logits.gather(-1, labels.clamp_min(0)[..., None])[..., 0]
        per_token = (lse - tgt + 1e-2 * lse ** 2) * valid
        z = (1e-2 * lse ** 2 * valid * w).sum()
    torch.testing.assert_close(out.loss.detach(), (per_token * w).sum(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.z_loss, z, rtol=1e-12, atol=1e-12)


def test_wrapper_rejects_bad_inputs():
    with pytest.raises(TypeError, match="ForCausalLM"):
        CausalLMWithLoss(torch.nn.Linear(2, 2))
    wrapper = CausalLMWithLoss(_tiny_llama())
    ids = torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match="labels"):
        wrapper(ids, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="exactly one of labels"):
        wrapper(ids)
    with pytest.raises(ValueError, match="exactly one of labels"):
        wrapper(ids, ids, shift_labels=ids)
    with pytest.raises(TypeError, match="options"):
        CausalLMWithLoss(_tiny_llama(), options={"chunk_size": 4})


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.float64, 1e-6)])
def test_wrapper_with_hf_labels_equals_the_hf_models_own_loss(dtype, tol):
    """What a Hugging Face user copies: ``labels = input_ids`` (with -100 padding). The wrapper's
    mean loss equals the wrapped model's own ``model(input_ids, labels=labels).loss`` on the same
    batch (HF computes its loss in fp32, hence the tolerance), and its gradients too."""
    ids = torch.randint(0, 29, (3, 10), generator=torch.Generator().manual_seed(7))
    labels = ids.clone()
    labels[1, 6:] = -100
    ref_model = _tiny_llama(seed=1).to(dtype)
    ref = ref_model(input_ids=ids, labels=labels).loss
    ref.backward()
    wrapper = CausalLMWithLoss(_tiny_llama(seed=1).to(dtype),
                               options=CrossEntropyOptions(reduction="mean", chunk_size=4))
    out = wrapper(ids, labels)
    torch.testing.assert_close(out.loss.to(ref.dtype), ref, rtol=tol, atol=tol)
    # counted after the shift: one fewer per row, and the ignored tail of row 1
    assert int(out.num_valid_tokens) == int((labels[:, 1:] != -100).sum())
    out.loss.backward()
    for (name, p), (_, q) in zip(ref_model.named_parameters(), wrapper.model.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_tied_embedding_replacement_keeps_padding_idx_and_embed_scale_and_refuses_others():
    """The TP > 1 replacement of a tied input embedding (here on a one-rank head): an
    ``nn.Embedding``'s padding_idx and a scaled embedding's ``embed_scale`` are kept; an
    embedding module of unknown forward is refused."""
    from megaloss import VocabParallelLMHead
    from megaloss.integrations.hf.causal_lm import _tied_embedding

    head = VocabParallelLMHead(4, 9, tp_group=None)
    emb = _tied_embedding(torch.nn.Embedding(9, 4, padding_idx=2), head)
    assert emb.weight is head.weight and emb.padding_idx == 2 and emb.scale is None

    class Scaled(torch.nn.Embedding):
        def __init__(self):
            super().__init__(9, 4)
            self.register_buffer("embed_scale", torch.tensor(2.0))

        def forward(self, ids):
            return super().forward(ids) * self.embed_scale

    scaled = Scaled()
    scaled.weight = head.weight
    emb = _tied_embedding(scaled, head)
    ids = torch.tensor([[0, 8, 3]])
    torch.testing.assert_close(emb(ids), scaled(ids))

    class Other(torch.nn.Embedding):
        pass

    with pytest.raises(TypeError, match="nn.Embedding"):
        _tied_embedding(Other(9, 4), head)
