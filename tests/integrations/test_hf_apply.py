"""``megaloss.integrations.hf.apply``: the model's own ``model(**batch)`` with megaloss's loss.

Against the unpatched model's own loss recomputed in float64 from its own logits (Hugging Face's
``ForCausalLMLoss`` casts the logits to fp32, which would hide everything below 1e-7): shift,
``-100`` ignored, token mean or ``sum / num_items_in_batch``, Gemma 2's soft-cap inside its own
forward. Tolerance 1e-12 (loss) and 1e-10 relative (gradients), float64, padded batches.
"""
import copy
import os
import pickle

import pytest
import torch

from megaloss import CrossEntropyOptions
from megaloss.integrations.hf import apply


def _config(kind):
    import transformers as tf
    common = dict(vocab_size=31, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    if kind == "llama":
        return tf.LlamaForCausalLM, tf.LlamaConfig(**common)
    if kind == "qwen2":
        return tf.Qwen2ForCausalLM, tf.Qwen2Config(**common, tie_word_embeddings=True)
    if kind == "gemma2":
        return tf.Gemma2ForCausalLM, tf.Gemma2Config(**common, head_dim=8,
                                                     final_logit_softcapping=2.0)
    raise ValueError(kind)


def _model(kind, seed=0):
    cls, cfg = _config(kind)
    torch.manual_seed(seed)
    return cls(cfg).double()


def _batch(seed=5):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 31, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[0, 6:] = 0  # right padding
    mask[2, 4:] = 0
    return ids, mask, ids.masked_fill(mask == 0, -100)


def _own_loss(model, ids, mask, labels, num_items_in_batch=None):
    logits = model(input_ids=ids, attention_mask=mask).logits  # the model's own transforms
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
        reduction="mean" if num_items_in_batch is None else "sum")
    return loss if num_items_in_batch is None else loss / num_items_in_batch


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma2"])
@pytest.mark.parametrize("num_items", [None, 17])
def test_apply_equals_the_models_own_loss_and_gradients(kind, num_items):
    ids, mask, labels = _batch()
    ref = _model(kind).train()
    model = apply(_model(kind)).train()
    extra = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    out = model(input_ids=ids, attention_mask=mask, labels=labels, **extra)
    assert type(out).__name__ == "CausalLMOutputWithPast" and out.logits is None
    expected = _own_loss(ref, ids, mask, labels, num_items)
    torch.testing.assert_close(out.loss, expected, rtol=1e-12, atol=1e-12)
    out.loss.backward()
    expected.backward()
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-10, atol=1e-13, msg=name)


@pytest.mark.slow
def test_apply_keeps_forward_generate_and_save_pretrained(tmp_path):
    ids, mask, labels = _batch()
    ref = _model("llama")
    model = apply(_model("llama"))
    assert apply(model) is model  # idempotent
    with pytest.raises(ValueError, match="already patched"):
        apply(model, options=CrossEntropyOptions(z_loss=1e-4))
    out = model(input_ids=ids, attention_mask=mask)  # without labels: bitwise the model's own
    assert torch.equal(out.logits, ref(input_ids=ids, attention_mask=mask).logits)
    gen = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids[:1, :5], **gen), ref.generate(ids[:1, :5], **gen))
    # eval mode (or skip_logits=False): the model's own logits and loss, as Liger's skip_logits
    model.eval()
    own = model(input_ids=ids, attention_mask=mask, labels=labels)
    assert own.logits is not None
    torch.testing.assert_close(own.loss, ref(input_ids=ids, attention_mask=mask,
                                             labels=labels).loss, rtol=0, atol=0)
    model.train()
    as_tuple = model(ids, mask, labels=labels, return_dict=False)  # positional and tuple
    assert isinstance(as_tuple, tuple) and as_tuple[0].dim() == 0  # the loss, no logits
    assert not any(isinstance(x, torch.Tensor) and x.dim() == 3 for x in as_tuple)
    assert model.state_dict().keys() == ref.state_dict().keys()
    model.save_pretrained(tmp_path)
    assert os.path.exists(tmp_path / "config.json")
    back = type(ref).from_pretrained(tmp_path, dtype=torch.float64)
    assert torch.equal(back(input_ids=ids).logits, ref(input_ids=ids).logits)
    clone = copy.deepcopy(model)  # the patch travels with a copy (TRL's reference model)
    torch.testing.assert_close(clone(input_ids=ids, attention_mask=mask, labels=labels).loss,
                               _own_loss(ref, ids, mask, labels), rtol=1e-12, atol=1e-12)
    assert pickle.loads(pickle.dumps(model)).forward.model is not model


def test_apply_keeps_a_router_loss_and_refuses_it_under_a_sum():
    """The model's own loss adds router_aux_loss_coef * aux_loss (the config outputs router
    logits); the patched forward adds it too (test_hf_router_loss.py compares every MoE class);
    under a sum the term has no exact place: refused, naming megaloss's calibrated one."""
    from transformers import MixtralConfig, MixtralForCausalLM
    cfg = MixtralConfig(vocab_size=31, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, num_local_experts=2,
                        num_experts_per_tok=1, output_router_logits=True,
                        router_aux_loss_coef=0.02)
    cfg._experts_implementation = "eager"
    torch.manual_seed(0)
    ref = MixtralForCausalLM(cfg).double()
    ids, mask, labels = _batch()
    model = apply(copy.deepcopy(ref), options=CrossEntropyOptions(
        accum_dtype=torch.float64)).train()
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    own = ref(input_ids=ids, attention_mask=mask)
    want = _own_loss(ref, ids, mask, labels) + (0.02 * own.aux_loss).double()
    torch.testing.assert_close(out.loss, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out.aux_loss, own.aux_loss, rtol=0, atol=0)
    summed = apply(copy.deepcopy(ref), options=CrossEntropyOptions(reduction="sum")).train()
    with pytest.raises(ValueError, match="router_loss="):
        summed(input_ids=ids, attention_mask=mask, labels=labels)
    assert summed(input_ids=ids, attention_mask=mask, labels=labels,
                  output_router_logits=False).loss is not None
