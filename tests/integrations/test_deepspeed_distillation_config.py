"""The ds_config "distillation" section (DistillationConfig) and CausalLMWithDistillation on one
process: options honoured or refused, the calibration's loss_reduction taken from the section,
and the wrapper's loss equal to the float64 reference (module teacher and top-k teacher)."""
import pytest
import torch

import megaloss
from megaloss.integrations.deepspeed import load_megaloss_config
from tests.helpers.distillation_reference import reference_distillation, teacher_topk


def test_section_selects_distillation_and_its_options():
    cfg = load_megaloss_config({"megaloss": {"distillation": {
        "kind": "jsd", "beta": 0.25, "temperature": 2, "alpha": 0.1, "loss_reduction": "square",
        "accum_dtype": "float64", "chunk_size": 64}}})
    opts = cfg.distillation.options(ignore_index=-1)
    assert opts == megaloss.DistillationOptions(
        kind="jsd", beta=0.25, temperature=2.0, alpha=0.1, reduction="sum", ignore_index=-1,
        accum_dtype=torch.float64, chunk_size=64)
    assert cfg.loss_reduction == "square"
    plain = load_megaloss_config({"megaloss": {"ce": {"loss_reduction": "sample"}}})
    assert plain.distillation is None and plain.loss_reduction == "sample"


@pytest.mark.parametrize("section, match", [
    ({"distillation": {"kind": "kl"}}, "megaloss.distillation.kind"),
    ({"distillation": {"beta": 2}}, "megaloss.distillation.beta"),
    ({"distillation": {"temperature_squared": "yes"}}, "temperature_squared"),
    ({"distillation": {"reduction": "mean"}}, "megaloss.distillation.reduction"),
    ({"distillation": {"loss_reduction": "mean"}}, "loss_reduction"),
    ({"distillation": {}, "ce": {"z_loss": 1e-4}}, "not both"),
])
def test_section_refuses(section, match):
    with pytest.raises(ValueError, match=match):
        load_megaloss_config({"megaloss": section})


def _llama(hidden, seed):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=29, hidden_size=hidden, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=8,
        tie_word_embeddings=False)).double()


@pytest.mark.slow  # imports transformers
def test_wrapper_matches_the_reference():
    from megaloss import causal_shift
    from megaloss.integrations.hf import CausalLMWithDistillation
    student, teacher = _llama(8, 0), _llama(12, 1)
    ids = torch.randint(0, 29, (2, 8), generator=torch.Generator().manual_seed(2))
    labels = causal_shift(ids)
    opts = megaloss.DistillationOptions(kind="reverse_kl", temperature=2.0, alpha=0.3)
    with torch.no_grad():
        t_hidden = teacher.model(input_ids=ids).last_hidden_state
    s_hidden = student.model(input_ids=ids).last_hidden_state
    ref = reference_distillation(s_hidden, student.lm_head.weight, labels, reduction="sum",
                                 teacher_hidden_states=t_hidden,
                                 teacher_weight=teacher.lm_head.weight, kind="reverse_kl",
                                 temperature=2.0, alpha=0.3)
    wrapper = CausalLMWithDistillation(student, teacher, options=opts.replace(reduction="sum"))
    assert not any(p is q for p in wrapper.parameters() for q in teacher.parameters())
    out = wrapper(ids, labels=ids)
    torch.testing.assert_close(out.loss, ref, rtol=1e-10, atol=1e-10)
    out.loss.backward()
    assert all(p.grad is None for p in teacher.parameters())
    ids_k, lp = teacher_topk(t_hidden, teacher.lm_head.weight, 5, 2.0)
    top = CausalLMWithDistillation(_llama(8, 0), None, options=opts.replace(reduction="sum"))
    got = top(ids, shift_labels=labels, teacher_topk_ids=ids_k, teacher_topk_log_probs=lp)
    want = reference_distillation(s_hidden, student.lm_head.weight, labels, reduction="sum",
                                  teacher_topk_ids=ids_k, teacher_topk_log_probs=lp,
                                  kind="reverse_kl", temperature=2.0, alpha=0.3)
    torch.testing.assert_close(got.loss, want, rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="one of them"):
        top(ids, labels=ids)
