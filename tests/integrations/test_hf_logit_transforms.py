"""The Hugging Face loss wrappers on models whose forward transforms the lm_head's logits
(megaloss/integrations/hf/head_config.py): Gemma 2's final soft-cap ``c * tanh(z / c)`` is
taken from each model's config (CausalLMWithLoss against ``model(input_ids, labels=...).loss``
and the float64 CE of the model's own logits; CausalLMWithDistillation against the float64
reference on the student's and the teacher's own logits, caps differing); a logit scale the
losses cannot reproduce (Cohere's ``logit_scale``, Granite's ``logits_scaling``) and an options
cap that contradicts the model's are refused.

Tiny random float64 models built from their configs (no download). Tolerances: 1e-10 against
the float64 references (the chunked losses accumulate in float64 here), 2e-6 against the model's
own loss (transformers computes it in fp32).
"""
import pytest
import torch
import torch.nn.functional as F

from megaloss import CrossEntropyOptions, DistillationOptions, causal_shift
from megaloss.integrations.hf import CausalLMWithDistillation, CausalLMWithLoss
from tests.helpers.distillation_reference import reference_distillation

V = 29


def _gemma2(cap, *, hidden=16, seed=0, tie=True):
    """A one-layer Gemma 2 whose logits reach the cap: ``initializer_range=0.5`` makes them
    ``O(cap)``, where ``tanh`` is far from linear."""
    from transformers import Gemma2Config, Gemma2ForCausalLM
    torch.manual_seed(seed)
    cfg = Gemma2Config(vocab_size=V, hidden_size=hidden, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                       query_pre_attn_scalar=8, max_position_embeddings=16, sliding_window=8,
                       initializer_range=0.5, final_logit_softcapping=cap,
                       tie_word_embeddings=tie, attn_implementation="eager")
    return Gemma2ForCausalLM(cfg).double()


def _batch(seed=3):
    ids = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    labels[0, :4] = -100
    return ids, labels


def _grads(model):
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("tie", [True, False])
def test_ce_wrapper_equals_the_gemma2_models_own_loss(tie):
    ids, labels = _batch()
    ref_model = _gemma2(2.0, tie=tie)
    own = ref_model(input_ids=ids, labels=labels).loss  # Gemma2ForCausalLM's own (fp32) loss
    logits = ref_model(input_ids=ids).logits  # soft-capped by the model
    assert float(logits.detach().abs().max()) > 1.5  # the cap acts
    ref = F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1))
    ref.backward()

    model = _gemma2(2.0, tie=tie)
    wrapper = CausalLMWithLoss(model, options=CrossEntropyOptions(
        chunk_size=7, reduction="mean", accum_dtype=torch.float64))
    assert wrapper.options.logit_softcapping == 2.0
    out = wrapper(ids, labels)
    torch.testing.assert_close(out.loss.to(own.dtype), own, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(out.loss, ref, rtol=1e-10, atol=1e-10)
    out.loss.backward()
    got, want = _grads(wrapper.model), _grads(ref_model)
    assert got.keys() == want.keys()
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-9, atol=1e-11, msg=name)


def test_distillation_wrapper_uses_each_models_own_cap():
    """Student capped at 2, teacher (another size) at 3: the wrapper's loss and student
    gradients equal the float64 reference on the two models' own (capped) logits."""
    ids, labels = _batch(4)
    target = causal_shift(labels)
    kw = dict(kind="jsd", beta=0.3, temperature=1.5, alpha=0.2)
    teacher = _gemma2(3.0, hidden=24, seed=1).requires_grad_(False)
    ref_student = _gemma2(2.0, seed=0)
    with torch.no_grad():
        t_logits = teacher(input_ids=ids).logits
    s_logits = ref_student(input_ids=ids).logits
    eye = torch.eye(V, dtype=torch.float64)  # F.linear(logits, I) = logits: no cap in the reference
    ref = reference_distillation(s_logits, eye, target, teacher_hidden_states=t_logits,
                                 teacher_weight=eye, reduction="sum", **kw)
    ref.backward()

    wrapper = CausalLMWithDistillation(_gemma2(2.0, seed=0), teacher, options=DistillationOptions(
        reduction="sum", chunk_size=5, accum_dtype=torch.float64, **kw))
    assert (wrapper.options.logit_softcapping, wrapper.options.teacher_logit_softcapping) == (
        2.0, 3.0)
    out = wrapper(ids, labels=labels)
    torch.testing.assert_close(out.loss, ref, rtol=1e-10, atol=1e-10)
    out.loss.backward()
    got, want = _grads(wrapper.model), _grads(ref_student)
    assert got.keys() == want.keys()
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-9, atol=1e-11, msg=name)


def test_an_options_cap_that_contradicts_the_model_is_refused():
    with pytest.raises(ValueError, match="logit_softcapping=5.0 differs from the model's"):
        CausalLMWithLoss(_gemma2(2.0), options=CrossEntropyOptions(logit_softcapping=5.0))
    with pytest.raises(ValueError, match="teacher_logit_softcapping=2.0 differs from the "
                                         "teacher's"):
        CausalLMWithDistillation(_gemma2(2.0), _gemma2(3.0, seed=1), options=DistillationOptions(
            teacher_logit_softcapping=2.0))
    # the same value, or no cap in the model, is kept as given
    assert CausalLMWithLoss(_gemma2(2.0), options=CrossEntropyOptions(
        logit_softcapping=2.0)).options.logit_softcapping == 2.0
    assert CausalLMWithLoss(_gemma2(None), options=CrossEntropyOptions(
        logit_softcapping=4.0)).options.logit_softcapping == 4.0


def _cohere(scale):
    from transformers import CohereConfig, CohereForCausalLM
    return CohereForCausalLM(CohereConfig(
        vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
        logit_scale=scale))


def _granite(scaling):
    from transformers import GraniteConfig, GraniteForCausalLM
    return GraniteForCausalLM(GraniteConfig(
        vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
        logits_scaling=scaling))


def test_logit_scales_are_refused_by_every_wrapper():
    """Cohere multiplies its logits by ``logit_scale``, Granite divides them by
    ``logits_scaling``: the wrappers refuse rather than train unscaled logits (a scale of 1 is
    no transform and is accepted)."""
    with pytest.raises(ValueError, match=r"logit_scale=0.0625, a scale of the logits .*Cohere"):
        CausalLMWithLoss(_cohere(0.0625))
    with pytest.raises(ValueError, match=r"logits_scaling=8.0, a scale of the logits .*Granite"):
        CausalLMWithLoss(_granite(8.0))
    with pytest.raises(ValueError, match="student's config has logit_scale"):
        CausalLMWithDistillation(_cohere(0.0625))
    with pytest.raises(ValueError, match="teacher's config has logits_scaling"):
        CausalLMWithDistillation(_gemma2(None), _granite(8.0))
    assert CausalLMWithLoss(_cohere(1.0)).options.logit_softcapping is None
