"""The GRPO job's sampler (launch/jobs/rollout.py ``generate_completions`` on
launch/jobs/models.py ``build_llama``) draws from the distribution the policy loss scores:
``softmax(logits / T)`` over the whole vocabulary, no top-k, no masked token. Checked on the
processed scores ``model.generate`` samples from (recorded with ``output_scores``) against the
float64 ``log_softmax`` of the model's own forward (float64 model; transformers casts each step's
logits to fp32, hence the tolerance 1e-6) and against the job's scorer
(:class:`launch.jobs.policy_model.CausalLMLogProbs` through ``completion_log_probs``, float32:
1e-6); and greedily on a model that puts all its mass on token 2 (an ordinary token of
the job's BPE, Llama's default ``eos_token_id``)."""
import copy
from argparse import Namespace

import pytest
import torch

from launch.jobs.models import build_llama
from launch.jobs.policy_model import CausalLMLogProbs
from launch.jobs.rollout import completion_log_probs, generate_completions, make_rollout

V = 64  # > transformers' default top_k of 50


def _llama(seed=0):
    args = Namespace(model_size="tiny", hidden_size=None, num_layers=None, num_heads=None,
                     seq_len=32, tie_word_embeddings=False, seed=seed)
    model, _ = build_llama(args, V)
    return model.double().eval()


def _record_generate(model):
    """``model.generate`` that also keeps what transformers sampled from (scores, logits)."""
    generate, record = model.generate, []

    def recording(*args, generation_config, **kwargs):
        cfg = copy.deepcopy(generation_config)
        cfg.output_scores = cfg.output_logits = cfg.return_dict_in_generate = True
        out = generate(*args, generation_config=cfg, **kwargs)
        record.append(out)
        return out.sequences

    model.generate = recording
    return record


def test_greedy_and_sampled_rollouts_emit_token_2_when_the_model_says_so():
    """Decoder layers silenced (o_proj, down_proj zero), every embedding 1 and only the lm_head
    row of token 2 non-zero: the logits are 32 for token 2 and 0 elsewhere at every position."""
    model = _llama()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.fill_(1.0)
        model.lm_head.weight.zero_()
        model.lm_head.weight[2] = 1.0
    prompts = torch.randint(3, V, (3, 4), generator=torch.Generator().manual_seed(1))
    greedy = generate_completions(model, prompts, 6, greedy=True)
    assert greedy.shape == (3, 6) and int((greedy == 2).sum()) == greedy.numel()
    torch.manual_seed(0)  # p(token 2) = 1 - 63 e^-32 per draw
    sampled = generate_completions(model, prompts, 6, num_generations=4, temperature=1.0)
    assert sampled.shape == (12, 6) and int((sampled == 2).sum()) == sampled.numel()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_sampled_distribution_is_the_scored_one(temperature):
    model = _llama(seed=3)
    record = _record_generate(model)
    prompts = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(2))
    torch.manual_seed(4)
    completions = generate_completions(model, prompts, 4, num_generations=2,
                                       temperature=temperature)
    (out,) = record
    seqs = out.sequences
    p = prompts.shape[1]
    for t, scores in enumerate(out.scores):
        with torch.no_grad():
            logits = model(input_ids=seqs[:, :p + t]).logits[:, -1]
        want = torch.log_softmax(logits.double() / temperature, -1)
        got = torch.log_softmax(scores.double(), -1)
        assert bool(torch.isfinite(got).all()), f"step {t}: masked or truncated tokens"
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=f"step {t}")
    # the job's scorer gives the sampled tokens the sampler's log-probs
    rollout = make_rollout(prompts, completions, torch.zeros(seqs.shape[0]), 2)
    scored = completion_log_probs(CausalLMLogProbs(model, temperature=temperature), rollout, 2)
    sampled = torch.stack([torch.log_softmax(s.double(), -1).gather(-1, completions[:, t, None])
                           [:, 0] for t, s in enumerate(out.scores)], 1)
    torch.testing.assert_close(scored[:, p - 1:-1].double(), sampled, rtol=1e-6, atol=1e-6)


def test_a_model_whose_generation_config_has_an_eos_token_is_refused():
    from transformers import LlamaConfig, LlamaForCausalLM
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16))
    assert model.generation_config.eos_token_id == 2  # LlamaConfig's default
    with pytest.raises(ValueError, match="eos_token_id"):
        generate_completions(model, torch.zeros(1, 3, dtype=torch.long), 2, greedy=True)
