"""The GRPO job's policy module (launch/jobs/policy_model.py, megaloss.CausalLMWithLogProbs with
the job's defaults) on a model that soft-caps its logits
(Gemma 2's ``final_logit_softcapping``): its per-token log-probs and entropies, and their
gradients, equal those of ``log_softmax(model(input_ids).logits / T)`` (the model's own logits,
float64, tolerance 1e-10); a config that scales the logits (Cohere's logit_scale) is
applied."""
import torch

from launch.jobs.policy_model import CausalLMLogProbs

V = 29


def _gemma2(cap, seed=0):
    from transformers import Gemma2Config, Gemma2ForCausalLM
    torch.manual_seed(seed)
    cfg = Gemma2Config(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                       query_pre_attn_scalar=8, max_position_embeddings=16, sliding_window=8,
                       initializer_range=0.5, final_logit_softcapping=cap,
                       attn_implementation="eager")
    return Gemma2ForCausalLM(cfg).double()


def test_log_probs_are_those_of_the_models_own_capped_logits():
    ids = torch.randint(0, V, (2, 10), generator=torch.Generator().manual_seed(5))
    labels = torch.full_like(ids, -100)
    labels[:, 3:-1] = ids[:, 4:]
    valid = labels != -100
    temperature = 0.7
    ref_model = _gemma2(2.0)
    logp = torch.log_softmax(ref_model(input_ids=ids).logits / temperature, -1)
    ref_lp = torch.where(valid, logp.gather(-1, labels.clamp_min(0)[..., None])[..., 0], 0.0)
    ref_ent = torch.where(valid, -(logp.exp() * logp).sum(-1), 0.0)
    (ref_lp.sum() + 0.5 * ref_ent.sum()).backward()

    module = CausalLMLogProbs(_gemma2(2.0), temperature=temperature)
    assert module.options.logit_softcapping == 2.0
    out = module(ids, shift_labels=labels)
    torch.testing.assert_close(out.log_probs.double(), ref_lp, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out.entropy.double(), ref_ent, rtol=1e-10, atol=1e-10)
    (out.log_probs.sum() + 0.5 * out.entropy.sum()).backward()
    want = dict(ref_model.named_parameters())
    for name, p in module.model.named_parameters():
        torch.testing.assert_close(p.grad, want[name].grad, rtol=1e-9, atol=1e-11, msg=name)


def test_a_logit_scale_is_applied():
    from transformers import CohereConfig, CohereForCausalLM
    torch.manual_seed(0)
    cohere = CohereForCausalLM(CohereConfig(
        vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
        logit_scale=0.25, attn_implementation="eager")).double()
    ids = torch.randint(0, V, (2, 10), generator=torch.Generator().manual_seed(5))
    labels = torch.full_like(ids, -100)
    labels[:, 3:-1] = ids[:, 4:]
    valid = labels != -100
    with torch.no_grad():
        logp = torch.log_softmax(cohere(input_ids=ids).logits, -1)  # logits * logit_scale
    want = torch.where(valid, logp.gather(-1, labels.clamp_min(0)[..., None])[..., 0], 0.0)
    module = CausalLMLogProbs(cohere, temperature=1.0)
    assert module.logit_transform.scale == 0.25
    out = module(ids, shift_labels=labels)
    torch.testing.assert_close(out.log_probs.double(), want, rtol=1e-10, atol=1e-10)
