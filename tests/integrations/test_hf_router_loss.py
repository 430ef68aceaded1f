"""The mixture-of-experts router term in the Hugging Face wrappers and ``apply``
(``megaloss/integrations/router_config.py``, ``hf/router_loss.py``): with router logits output
the loss is the model's own ``CE + router_aux_loss_coef * aux_loss``, ``aux_loss`` and
``router_logits`` are the model's, and what cannot carry the term is refused.

References: the model's own forward in float64 (tiny random-init models of
``tests/helpers/hf_zoo.py``, eager experts): its loss with ``loss_function`` replaced by the
float64 ``ForCausalLMLoss`` (``hf_zoo._loss64``: transformers' own upcasts the logits to
float32) plus its own ``router_aux_loss_coef * aux_loss``. Tolerance 1e-10 relative (float64
against float64; the aux loss is the model's own float32 function on both sides, bitwise the
same), for the loss, every parameter's gradient (the routers' included) and ``aux_loss``.
"""
import copy

import pytest
import torch
import torch.nn.functional as F

from megaloss import CrossEntropyOptions, DistillationOptions
from megaloss.integrations.hf import (
    CausalLMWithDistillation,
    CausalLMWithLogProbs,
    CausalLMWithLoss,
    apply,
)
from tests.helpers import hf_zoo

TOL = 1e-10

# every transformers 5.24 causal-LM / conditional-generation class whose forward adds a router
# load-balancing term and that hf_zoo builds tiny (Dbrx, Ernie-4.5-VL-MoE, GLM-4.5V-MoE,
# GLM-5-Next, Qwen3-Omni-MoE and Qwen4-Exp do not build here: see test_hf_model_zoo.py)
ROUTED = [
    "DeepseekV4ForCausalLM", "DogeForCausalLM", "Ernie4_5_MoeForCausalLM",
    "FlexOlmoForCausalLM", "FlintForCausalLM", "GptOssForCausalLM", "GraniteMoeForCausalLM",
    "GraniteMoeHybridForCausalLM", "GraniteMoeSWAForCausalLM", "GraniteMoeSharedForCausalLM",
    "JambaForCausalLM", "JetMoeForCausalLM", "LagunaForCausalLM", "LaraMiniForCausalLM",
    "MellumForCausalLM", "MiniMaxForCausalLM", "MiniMaxM2ForCausalLM",
    "MiniMaxM3SparseForConditionalGeneration", "MiniMaxM3VLForCausalLM", "MixtralForCausalLM",
    "OlmoeForCausalLM", "PhimoeForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
    "Qwen3NextForCausalLM", "Qwen3VLMoeForConditionalGeneration", "Qwen3_5MoeForCausalLM",
    "Qwen3_5MoeForConditionalGeneration",
]


def _close(a, b, tol=TOL):
    a, b = a.double(), b.double()
    return a.shape == b.shape and bool(((a - b).abs() <= tol * (1 + b.abs())).all())


def _coefficient(model):
    for owner in (model, model.config, model.config.get_text_config(decoder=True)):
        for name in ("router_aux_loss_coef", "aux_loss_coef"):
            value = vars(owner).get(name, getattr(owner, name, None))
            if isinstance(value, float):
                return value
    raise AssertionError("no coefficient")


def _own(ref, batch, labels, **kwargs):
    """The model's own float64 loss with its router term, checked to be CE + coef * aux."""
    ref.loss_function = hf_zoo._loss64
    out = ref(**batch, labels=labels, output_router_logits=True, use_cache=False, **kwargs)
    ce = hf_zoo._loss64(out.logits, labels, out.logits.shape[-1],
                        num_items_in_batch=kwargs.get("num_items_in_batch"))
    assert out.aux_loss is not None
    want = ce + (_coefficient(ref) * out.aux_loss).double()  # the model multiplies in fp32
    assert _close(out.loss, want)  # the reference includes the router term
    assert float(_coefficient(ref) * out.aux_loss.detach()) > 1e-4  # and it is not negligible
    return out


def _grads_equal(ref, model):
    got = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        a = torch.zeros_like(p) if p.grad is None else p.grad
        q = got[name]
        b = torch.zeros_like(q) if q.grad is None else q.grad
        assert _close(b, a), name


def _router_weights(model):
    return {n: p for n, p in model.named_parameters()
            if n.endswith(("gate.weight", "router.weight", "router.layer.weight"))}


@pytest.mark.slow
@pytest.mark.parametrize("name", ROUTED)
def test_wrapper_and_apply_add_the_models_own_router_loss(name):
    torch.set_num_threads(1)
    ref = hf_zoo.build(name, router_logits=False)
    batch, labels = hf_zoo.inputs(ref)
    wrapped, patched = copy.deepcopy(ref), copy.deepcopy(ref)
    own = _own(ref, batch, labels)
    own.loss.backward()

    wrapper = CausalLMWithLoss(wrapped, options=CrossEntropyOptions(accum_dtype=torch.float64))
    out = wrapper(**batch, labels=labels, output_router_logits=True)
    assert _close(out.loss, own.loss) and _close(out.aux_loss, own.aux_loss)
    assert len(out.router_logits) == len(own.router_logits)
    out.loss.backward()
    _grads_equal(ref, wrapper.model)

    apply(patched, options=CrossEntropyOptions(accum_dtype=torch.float64))
    res = patched(**batch, labels=labels, output_router_logits=True, skip_logits=True,
                  use_cache=False)
    assert type(res).__name__ == "MoeCausalLMOutputWithPast" and res.logits is None
    assert _close(res.loss, own.loss) and _close(res.aux_loss, own.aux_loss)
    res.loss.backward()
    _grads_equal(ref, patched)


def _qwen3_moe(cls=None, **config):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                         moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=8, num_experts=4, num_experts_per_tok=2,
                         router_aux_loss_coef=0.02, **config)
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    torch.manual_seed(0)
    return (cls or Qwen3MoeForCausalLM)(cfg).double().eval()


def _with_z_loss():
    """A Qwen3-MoE whose own loss adds a router z-loss too (a term megaloss does not know)."""
    from transformers import Qwen3MoeForCausalLM

    class ZLossQwen3Moe(Qwen3MoeForCausalLM):
        def forward(self, *args, labels=None, output_router_logits=None, **kwargs):
            out = super().forward(*args, labels=labels, output_router_logits=output_router_logits,
                                  **kwargs)
            if labels is not None and out.router_logits is not None:
                z = torch.cat(out.router_logits).logsumexp(-1).pow(2).mean()
                out.loss = out.loss + 1e-2 * z
            return out

    return _qwen3_moe(cls=ZLossQwen3Moe)


def _batch(vocab=64):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (2, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, :2] = -100
    return ids, mask, labels


def test_the_config_outputs_router_logits_and_the_call_overrides_it():
    ref = _qwen3_moe(output_router_logits=True)
    ids, mask, labels = _batch()
    wrapper = CausalLMWithLoss(copy.deepcopy(ref),
                               options=CrossEntropyOptions(accum_dtype=torch.float64))
    own = _own(ref, {"input_ids": ids, "attention_mask": mask}, labels)
    out = wrapper(ids, labels, attention_mask=mask)  # the config's output_router_logits
    assert _close(out.loss, own.loss) and _close(out.aux_loss, own.aux_loss)
    off = wrapper(ids, labels, attention_mask=mask, output_router_logits=False)
    assert off.aux_loss is None and off.router_logits is None
    assert _close(off.loss, own.loss - (0.02 * own.aux_loss).double())


def test_num_items_in_batch_adds_the_term_unscaled_as_the_model_does():
    ref = _qwen3_moe()
    ids, mask, labels = _batch()
    n = torch.tensor(40)
    own = _own(ref, {"input_ids": ids, "attention_mask": mask}, labels, num_items_in_batch=n)
    options = CrossEntropyOptions(accum_dtype=torch.float64)
    wrapper = CausalLMWithLoss(copy.deepcopy(ref), options=options)
    out = wrapper(ids, labels, attention_mask=mask, num_items_in_batch=n,
                  output_router_logits=True)
    assert _close(out.loss, own.loss)
    patched = apply(copy.deepcopy(ref), options=options).train()
    res = patched(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=n,
                  output_router_logits=True)
    assert _close(res.loss, own.loss)


def test_a_sum_or_token_weights_refuse_the_term_and_name_the_calibrated_one():
    ref = _qwen3_moe()
    ids, mask, labels = _batch()
    wrapper = CausalLMWithLoss(ref, options=CrossEntropyOptions(reduction="sum"))
    with pytest.raises(ValueError, match=r"calibrated router loss \(router_loss="):
        wrapper(ids, labels, attention_mask=mask, output_router_logits=True)
    plain = wrapper(ids, labels, attention_mask=mask, output_router_logits=False)
    assert plain.aux_loss is None
    mean = CausalLMWithLoss(_qwen3_moe())
    with pytest.raises(ValueError, match="loss_weights"):
        mean(ids, labels, attention_mask=mask, output_router_logits=True,
             loss_weights=torch.ones(ids.shape, dtype=torch.float64))
    zero = _qwen3_moe()
    zero.router_aux_loss_coef = 0.0  # what its forward multiplies by
    out = CausalLMWithLoss(zero, options=CrossEntropyOptions(reduction="sum"))(
        ids, labels, attention_mask=mask, output_router_logits=True)
    assert out.aux_loss is not None


def test_a_router_term_megaloss_does_not_know_is_refused_not_dropped():
    ids, mask, labels = _batch()
    wrapper = CausalLMWithLoss(_with_z_loss())  # router logits off in the config: built
    assert wrapper.router.refusal is not None and "0.02" in wrapper.router.refusal
    with pytest.raises(ValueError, match="cannot reproduce the model's router loss"):
        wrapper(ids, labels, attention_mask=mask, output_router_logits=True)
    wrapper(ids, labels, attention_mask=mask)  # without router logits: the model's own CE
    model = _with_z_loss()
    model.config.output_router_logits = True
    with pytest.raises(ValueError, match="output_router_logits=False"):
        apply(model)
    declared = _qwen3_moe(output_router_logits=True)
    declared.config.router_z_loss_coef = 1e-3
    with pytest.raises(ValueError, match="router z-loss"):
        CausalLMWithLoss(declared)


def test_distillation_adds_the_students_router_term():
    student = _qwen3_moe()
    teacher = _qwen3_moe()
    ids, mask, labels = _batch()
    options = DistillationOptions(accum_dtype=torch.float64)
    own = copy.deepcopy(student)(input_ids=ids, attention_mask=mask, output_router_logits=True)
    wrapper = CausalLMWithDistillation(copy.deepcopy(student), teacher, options=options)
    base = wrapper(ids, labels, attention_mask=mask)
    out = wrapper(ids, labels, attention_mask=mask, output_router_logits=True)
    assert type(out).__name__ == "MoeDistillationOutput"
    assert _close(out.aux_loss, own.aux_loss)
    assert _close(out.loss, base.loss + (0.02 * own.aux_loss).double())
    assert _close(out.divergence, base.divergence)
    with pytest.raises(ValueError, match="router_loss="):
        CausalLMWithDistillation(student, teacher, options=DistillationOptions(
            reduction="sum"))(ids, labels, attention_mask=mask, output_router_logits=True)


def test_log_probs_carry_the_models_aux_loss_and_its_gradient():
    ref = _qwen3_moe()
    ids, mask, labels = _batch()
    own = ref(input_ids=ids, attention_mask=mask, output_router_logits=True)
    own.aux_loss.backward()
    wrapper = CausalLMWithLogProbs(copy.deepcopy(ref))
    out = wrapper(ids, labels, attention_mask=mask, output_router_logits=True)
    assert type(out).__name__ == "MoeLogProbsOutput" and wrapper.router_aux_loss_coef == 0.02
    assert _close(out.aux_loss, own.aux_loss)
    plain = wrapper(ids, labels, attention_mask=mask)
    assert torch.equal(out.log_probs, plain.log_probs)
    logp = F.log_softmax(own.logits.double()[:, :-1], -1).gather(
        -1, labels[:, 1:].clamp(min=0)[..., None])[..., 0] * (labels[:, 1:] != -100)
    assert _close(out.log_probs[:, :-1], logp)
    out.aux_loss.backward()
    got = _router_weights(wrapper.model)
    assert got
    for name, p in _router_weights(ref).items():
        assert _close(got[name].grad, p.grad), name


@pytest.mark.slow  # imports TRL (seconds)
def test_trls_fused_call_gets_the_models_aux_loss():
    """TRL's ``model(..., fused_lm_head=True)`` (its SFTTrainer reads ``outputs.aux_loss``):
    the patched model's fused output carries the model's own ``aux_loss`` and its loss adds
    ``coef * aux_loss`` to the token mean, as TRL's own fused head does."""
    from trl.trainer.utils import add_fused_lm_head

    ref = _qwen3_moe(output_router_logits=True)
    ids, mask, labels = _batch()
    own = _own(ref, {"input_ids": ids, "attention_mask": mask}, labels)
    model = copy.deepcopy(ref)
    add_fused_lm_head(model, outputs=("log_probs",))
    apply(model, options=CrossEntropyOptions(accum_dtype=torch.float64))
    out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    assert _close(out.aux_loss, own.aux_loss)
    assert _close(out.loss, own.loss)
