"""``megaloss.CausalLMWithLogProbs`` against the model's own logits: float64 tiny Llama (random
init, untied and tied) and Gemma 2 (``final_logit_softcapping``), per-token log-probs and
entropies equal ``log_softmax(model(input_ids).logits / T)`` gathered (1e-12) and so do all
parameter gradients (1e-10); TP = 2 on two gloo processes equals the single-process result; a
config that scales its logits is refused naming the field; the model's own forward and
``generate`` still work on the replaced head, and on the CE and distillation wrappers' heads
(single process and, gathered, TP = 2)."""
import pytest
import torch

import megaloss
from megaloss import LogProbsOptions, causal_shift
from megaloss.integrations.hf import CausalLMWithLogProbs
from megaloss.testing import run_distributed

V = 29


def _llama(vocab=V, tie=False, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
                      tie_word_embeddings=tie, initializer_range=0.5)
    return LlamaForCausalLM(cfg).double()


def _gemma2(cap=2.0, seed=0):
    from transformers import Gemma2Config, Gemma2ForCausalLM
    torch.manual_seed(seed)
    cfg = Gemma2Config(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                       query_pre_attn_scalar=8, max_position_embeddings=16, sliding_window=8,
                       initializer_range=0.5, final_logit_softcapping=cap,
                       attn_implementation="eager")
    return Gemma2ForCausalLM(cfg).double()


def _batch(vocab=V, seed=3):
    ids = torch.randint(0, vocab, (2, 11), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    labels[0, :4] = -100  # Hugging Face labels, unshifted
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0  # right padding (no fully masked attention row), no target there
    labels[1, -2:] = -100
    return ids, labels, mask


def _reference(model, ids, labels, mask, temperature):
    """Per-token log-probs / entropies of the model's own logits (its forward soft-caps)."""
    shift = causal_shift(labels)
    valid = shift != -100
    logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits / temperature, -1)
    lp = torch.where(valid, logp.gather(-1, shift.clamp_min(0)[..., None])[..., 0], 0.0)
    ent = torch.where(valid, -(logp.exp() * logp).sum(-1), 0.0)
    return lp, ent


def _objective(lp, ent, valid):
    # per-token upstream gradients that differ per token
    w = torch.linspace(0.5, 1.5, lp.numel(), dtype=lp.dtype).view(lp.shape) * valid
    return (w * lp).sum() + 0.3 * (w.flip(-1) * ent).sum()


def _grads(module):
    return {n: p.grad for n, p in module.named_parameters() if p.grad is not None}


def _measured_errors(case, build, temperature):
    ids, labels, mask = _batch()
    valid = causal_shift(labels) != -100
    ref_model = build()
    ref_lp, ref_ent = _reference(ref_model, ids, labels, mask, temperature)
    _objective(ref_lp, ref_ent, valid).backward()
    ref_grads = _grads(ref_model)

    wrapper = CausalLMWithLogProbs(build(), options=LogProbsOptions(
        temperature=temperature, return_entropy=True, chunk_size=7))
    out = wrapper(ids, labels, attention_mask=mask)
    assert out.log_probs.dtype == torch.float64 and out.log_probs.shape == ids.shape
    torch.testing.assert_close(out.log_probs, ref_lp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.entropy, ref_ent, rtol=1e-12, atol=1e-12)
    _objective(out.log_probs, out.entropy, valid).backward()
    grads = {n.removeprefix("model."): g for n, g in _grads(wrapper).items()}
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-10, atol=1e-10, msg=name)
    err = max((out.log_probs - ref_lp).abs().max().item(),
              (out.entropy - ref_ent).abs().max().item())
    gerr = max(((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-300)).item()
               for n, g in ref_grads.items())
    print(f"{case}: max |log-prob / entropy error| {err:.2e}, max relative grad error {gerr:.2e}")
    return wrapper


@pytest.mark.parametrize("tie", [False, True])
def test_llama_log_probs_entropy_and_gradients_equal_the_models_own(tie):
    wrapper = _measured_errors(f"llama tie={tie}", lambda: _llama(tie=tie), temperature=0.7)
    if tie:
        assert wrapper.head.weight is wrapper.model.get_input_embeddings().weight
    assert wrapper.tied is tie


def test_gemma2_softcapped_log_probs_equal_the_models_own():
    wrapper = _measured_errors("gemma2 cap=2", lambda: _gemma2(2.0), temperature=0.7)
    assert wrapper.options.logit_softcapping == 2.0


def test_forward_options_shift_labels_and_temperature_switch():
    ids, labels, mask = _batch()
    wrapper = CausalLMWithLogProbs(_llama())
    assert isinstance(wrapper, megaloss.CausalLMWithLogProbs)
    a = wrapper(ids, labels)
    assert a.entropy is None  # LogProbsOptions' default
    b = wrapper(ids, shift_labels=causal_shift(labels), return_entropy=True)
    assert torch.equal(a.log_probs, b.log_probs) and b.entropy is not None
    wrapper.temperature = 0.5
    assert wrapper.options.temperature == 0.5
    ref_lp, _ = _reference(wrapper.model, ids, labels, torch.ones_like(ids), 0.5)
    torch.testing.assert_close(wrapper(ids, labels).log_probs, ref_lp, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="exactly one"):
        wrapper(ids, labels, shift_labels=labels)
    # without labels: the wrapped model's own forward (its logits)
    assert torch.equal(wrapper(ids).logits, wrapper.model(input_ids=ids).logits)
    with pytest.raises(ValueError, match="shape"):
        wrapper(ids, labels[:, :-1])
    with pytest.raises(TypeError, match="LogProbsOptions"):
        CausalLMWithLogProbs(_llama(), options=megaloss.CrossEntropyOptions())


def _wrappers():
    """Every loss wrapper that replaces the lm_head, by name, built on a model."""
    from megaloss import DistillationOptions
    from megaloss.integrations.hf import CausalLMWithDistillation, CausalLMWithLoss
    return {"log_probs": CausalLMWithLogProbs,
            "ce": CausalLMWithLoss,
            "distillation": lambda model, **kw: CausalLMWithDistillation(
                model, None, options=DistillationOptions(reduction="sum"), **kw)}


@pytest.mark.parametrize("wrapper_name", ["log_probs", "ce", "distillation"])
def test_the_models_own_forward_and_generate_still_work(wrapper_name):
    """Called without labels, each loss head is the nn.Linear it replaced: the wrapped model's
    own logits are bitwise those of before, and generate runs on them."""
    model = _llama()
    ids = torch.randint(0, V, (1, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        wrapper = _wrappers()[wrapper_name](model)
        torch.testing.assert_close(wrapper.model(input_ids=ids).logits, before, rtol=0, atol=0)
        out = wrapper.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                     max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 8)
    assert wrapper.model.config is model.config
    if wrapper_name == "log_probs":
        assert wrapper.config is model.config  # the HF model API reaches the wrapped model
        assert set(wrapper.state_dict()) == {"model." + k for k in _llama().state_dict()}


@pytest.mark.parametrize("field, value", [("logit_scale", 0.0625), ("logits_scaling", 4.0)])
def test_a_config_that_scales_the_logits_is_refused_naming_it(field, value):
    model = _llama()
    setattr(model.config, field, value)
    with pytest.raises(ValueError, match=f"{field}={value}"):
        CausalLMWithLogProbs(model)


def test_a_different_softcap_in_the_options_is_refused():
    with pytest.raises(ValueError, match="logit_softcapping"):
        CausalLMWithLogProbs(_gemma2(2.0), options=LogProbsOptions(logit_softcapping=3.0))


# --- TP = 2 ------------------------------------------------------------------------------------

TP_VOCAB = 37  # odd: the shards are padded (19 + 18 rows)


def _tp_run(tie, tp_group):
    ids, labels, mask = _batch(TP_VOCAB, seed=4)
    valid = causal_shift(labels) != -100
    model = _llama(TP_VOCAB, tie=tie, seed=1)
    wrapper = CausalLMWithLogProbs(model, options=LogProbsOptions(
        temperature=0.8, return_entropy=True, chunk_size=5), tp_group=tp_group)
    out = wrapper(ids, labels, attention_mask=mask)
    _objective(out.log_probs, out.entropy, valid).backward()
    head = wrapper.head
    grads = {n.removeprefix("model."): p.grad.clone() for n, p in wrapper.named_parameters()
             if "lm_head" not in n and "embed_tokens" not in n}
    if wrapper.tp_size > 1:
        start, stop = head.vocab_start, head.vocab_stop
        head_grad = head.weight.grad[: stop - start].clone()
        emb = wrapper.model.get_input_embeddings()
        emb_grad = None if tie else emb.weight.grad.clone()
    else:
        start, stop = 0, TP_VOCAB
        head_grad = head.weight.grad.clone()
        emb_grad = None if tie else wrapper.model.get_input_embeddings().weight.grad.clone()
    with torch.no_grad():
        logits = wrapper.model(input_ids=ids, attention_mask=mask).logits
        # the CE and distillation heads gather the same logits without labels (the
        # distillation wrapper refuses a tied lm_head under TP)
        others = {f"logits_{name}": make(_llama(TP_VOCAB, tie=tie, seed=1), tp_group=tp_group)
                  .model(input_ids=ids, attention_mask=mask).logits
                  for name, make in _wrappers().items()
                  if name == "ce" or (name == "distillation" and not tie)}
    return dict(log_probs=out.log_probs.detach(), entropy=out.entropy.detach(), grads=grads,
                head_grad=head_grad, rows=(start, stop), emb_grad=emb_grad, logits=logits,
                **others)


def _tp_worker(rank, world_size, tie):
    torch.set_num_threads(1)
    return _tp_run(tie, None)


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("tie", [False, True])
def test_tp2_equals_the_single_process_result(tie):
    ref = _tp_run(tie, megaloss.SINGLE_RANK)
    ranks = run_distributed(_tp_worker, 2, tie, timeout=240)
    worst = 0.0
    for r in ranks:
        for key in ("log_probs", "entropy", "logits", "logits_ce") + (
                () if tie else ("logits_distillation",)):
            torch.testing.assert_close(r[key], ref[key], rtol=1e-12, atol=1e-12, msg=key)
            worst = max(worst, (r[key] - ref[key]).abs().max().item())
        for name, g in ref["grads"].items():
            torch.testing.assert_close(r["grads"][name], g, rtol=1e-10, atol=1e-10, msg=name)
        start, stop = r["rows"]
        torch.testing.assert_close(r["head_grad"], ref["head_grad"][start:stop], rtol=1e-10,
                                   atol=1e-10)
        if not tie:
            torch.testing.assert_close(r["emb_grad"], ref["emb_grad"], rtol=1e-10, atol=1e-10)
    assert ranks[0]["rows"] == (0, 19) and ranks[1]["rows"] == (19, 37)
    print(f"tp2 tie={tie}: max |output error| {worst:.2e}")
