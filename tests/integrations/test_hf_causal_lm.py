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
    with pytest.raises(ValueError, match="need labels"):
        wrapper(ids, loss_weights=torch.ones(2, 5))
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


# --- the wrapper behaves as the model it wraps (forward without labels, generate, kwargs,
# dict-style output, Hugging Face's mean and num_items_in_batch) -----------------------------

def _batch():
    ids = torch.randint(0, 29, (3, 10), generator=torch.Generator().manual_seed(11))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # right padding, as a collator pads
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def _hf_loss_fp64(model, ids, mask, labels, num_items_in_batch=None):
    """The model's own loss (``transformers/loss/loss_utils.py`` ``ForCausalLMLoss``: shift,
    ``-100`` ignored, mean or ``sum / num_items_in_batch``) on its own float64 logits (HF
    upcasts the logits to fp32 first, which would hide the comparison below 1e-7)."""
    logits = model(input_ids=ids, attention_mask=mask).logits
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
        reduction="mean" if num_items_in_batch is None else "sum")
    return loss if num_items_in_batch is None else loss / num_items_in_batch


def test_wrapper_without_labels_is_the_models_own_forward_and_generate():
    ids, mask, _ = _batch()
    ref = _tiny_llama(seed=2)
    wrapper = CausalLMWithLoss(_tiny_llama(seed=2))
    out = wrapper(ids, attention_mask=mask)
    assert type(out).__name__ == "CausalLMOutputWithPast"
    assert torch.equal(out.logits, ref(input_ids=ids, attention_mask=mask).logits)
    emb = ref.get_input_embeddings()(ids)  # keyword arguments reach the model
    assert torch.equal(wrapper(inputs_embeds=emb, attention_mask=mask).logits,
                       ref(inputs_embeds=emb, attention_mask=mask).logits)
    gen = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(wrapper.generate(ids[:2, :4], **gen), ref.generate(ids[:2, :4], **gen))


def test_wrapper_default_is_hf_mean_with_num_items_in_batch_and_a_dict_output():
    ids, mask, labels = _batch()
    ref = _tiny_llama(seed=3)
    wrapper = CausalLMWithLoss(_tiny_llama(seed=3))
    assert wrapper.options.reduction == "mean"
    out = wrapper(input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(out["loss"], _hf_loss_fp64(ref, ids, mask, labels),
                               rtol=1e-12, atol=1e-12)
    assert out.logits is None and "logits" not in out
    assert out[0] is out.loss and out.to_tuple()[0] is out["loss"]
    assert int(out.num_valid_tokens) == int((labels[:, 1:] != -100).sum())
    n = torch.tensor(23)  # the Trainer's token count over the accumulation step
    out = wrapper(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=n)
    torch.testing.assert_close(out.loss, _hf_loss_fp64(ref, ids, mask, labels, n),
                               rtol=1e-12, atol=1e-12)
    # inputs_embeds instead of input_ids (the decoder takes the keyword)
    emb = ref.get_input_embeddings()(ids).detach()
    out = wrapper(inputs_embeds=emb, attention_mask=mask, labels=labels)
    torch.testing.assert_close(out.loss, _hf_loss_fp64(ref, ids, mask, labels),
                               rtol=1e-12, atol=1e-12)
    summed = CausalLMWithLoss(_tiny_llama(), options=CrossEntropyOptions(reduction="sum"))
    with pytest.raises(ValueError, match="num_items_in_batch"):
        summed(ids, labels, num_items_in_batch=n)


def test_wrapper_output_is_a_pytree_and_rebuilds_from_a_mapping():
    """FSDP2 / DDP hook the tensors of a module's output through torch's pytree; accelerate's
    fp32 conversion rebuilds a mapping output as ``type(out)({...})``."""
    import torch.utils._pytree as pytree

    from megaloss.integrations.hf.outputs import CausalLMLossOutput
    out = CausalLMLossOutput(loss=torch.tensor(2.0), z_loss=torch.tensor(0.5))
    leaves, spec = pytree.tree_flatten(out)
    assert len(leaves) == 2
    back = pytree.tree_unflatten([x * 2 for x in leaves], spec)
    assert isinstance(back, CausalLMLossOutput) and float(back.loss) == 4.0
    rebuilt = type(out)({k: v for k, v in out.items()})
    assert rebuilt.keys() == out.keys() and rebuilt.z_loss is out.z_loss and rebuilt.logits is None
