"""The Hugging Face loss wrappers on models whose forward transforms the lm_head's logits
(megaloss/integrations/head_config.py): Gemma 2's final soft-cap ``c * tanh(z / c)`` is
taken from each model's config (CausalLMWithLoss against ``model(input_ids, labels=...).loss``
and the float64 CE of the model's own logits; CausalLMWithDistillation against the float64
reference on the student's and the teacher's own logits, caps differing); a logit scale
(Falcon-H1's ``lm_head_multiplier``, Cohere's ``logit_scale``, Granite's and MiniCPM3's
``logits_scaling``) is applied, Bamba's z-loss term added, by the CE, log-probs, distillation
and vocab-parallel (TP 2) paths, each against the model's own loss, logits and gradients; a
forward that transforms its logits in a way megaloss does not know is refused by the probe;
an options cap that contradicts the model's is refused.

Tiny random float64 models built from their configs (no download). Tolerances: 1e-10 against
the float64 references (the chunked losses accumulate in float64 here), 2e-6 against the model's
own loss as transformers computes it (fp32: ``ForCausalLMLoss`` upcasts with ``.float()``);
1e-12 against the model's own loss with that upcast left out (:func:`_float64_loss`, set as the
model's ``loss_function``: its forward, transform and z-loss term untouched).
"""
import copy

import pytest
import torch
import torch.nn.functional as F

from megaloss import (
    CrossEntropyOptions,
    DistillationOptions,
    LogProbsOptions,
    causal_shift,
)
from megaloss.integrations.head_config import (
    LogitTransform,
    config_logit_transform,
    model_logit_transform,
)
from megaloss.integrations.hf import (
    CausalLMWithDistillation,
    CausalLMWithLogProbs,
    CausalLMWithLoss,
)
from megaloss.testing import run_distributed
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


def _float64_loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100,
                  shift_labels=None, **kwargs):
    """transformers' ``ForCausalLMLoss`` (``transformers/loss/loss_utils.py``) without its
    ``logits.float()`` upcast: the model's own loss in float64."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return F.cross_entropy(logits.reshape(-1, vocab_size), shift_labels.reshape(-1),
                           ignore_index=ignore_index)


_COMMON = dict(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
               num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
_MAMBA = dict(mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4, mamba_chunk_size=8)


def _config(name):
    """``(config class, model class, kwargs)`` of a tiny model whose forward transforms its
    logits: the scale (or z-loss coefficient) set well away from 1 (0)."""
    import transformers as T
    return {
        # lm_head(h) * model.lm_head_multiplier (0.039 in public configs)
        "falcon_h1": (T.FalconH1Config, T.FalconH1ForCausalLM, dict(
            lm_head_multiplier=0.039, mamba_d_ssm=16, mamba_n_heads=4, mamba_d_head=4,
            head_dim=8, **_MAMBA)),
        # loss + z_loss_coefficient * logits.logsumexp(-1).pow(2).mean(), every position
        "bamba": (T.BambaConfig, T.BambaForCausalLM, dict(
            z_loss_coefficient=0.05, mamba_n_heads=4, mamba_d_head=8, attn_layer_indices=[0],
            **_MAMBA)),
        "cohere": (T.CohereConfig, T.CohereForCausalLM, dict(logit_scale=0.25)),  # multiply
        "cohere2": (T.Cohere2Config, T.Cohere2ForCausalLM, dict(
            logit_scale=0.25, head_dim=8, sliding_window=8)),
        "granite": (T.GraniteConfig, T.GraniteForCausalLM, dict(logits_scaling=4.0)),  # divide
        "granitemoe": (T.GraniteMoeConfig, T.GraniteMoeForCausalLM, dict(
            logits_scaling=0.25, num_local_experts=2, num_experts_per_tok=1,
            experts_implementation="eager")),
        # hidden states / (hidden_size / dim_model_base) before the lm_head: 4x the logits
        "minicpm3": (T.MiniCPM3Config, T.MiniCPM3ForCausalLM, dict(
            num_key_value_heads=2, dim_model_base=64, q_lora_rank=16, kv_lora_rank=8,
            qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4)),
    }[name]


# the transform each model's forward applies (the test's own reading of its modeling file)
_EXPECTED = {"falcon_h1": LogitTransform(scale=0.039),
             "bamba": LogitTransform(z_loss_coefficient=0.05),
             "cohere": LogitTransform(scale=0.25), "cohere2": LogitTransform(scale=0.25),
             "granite": LogitTransform(scale=0.25), "granitemoe": LogitTransform(scale=4.0),
             "minicpm3": LogitTransform(scale=4.0)}
_SLOW = ("falcon_h1", "bamba")  # the torch reference of the Mamba-2 scan: ~0.2 s a forward
_NAMES = [pytest.param(n, marks=pytest.mark.slow) if n in _SLOW else n for n in _EXPECTED]


def _model(name, *, seed=0, tie=False, **extra):
    config_cls, model_cls, kwargs = _config(name)
    torch.manual_seed(seed)
    config = config_cls(**{**_COMMON, **kwargs, "tie_word_embeddings": tie, **extra})
    model = model_cls(config).double()
    model.loss_function = _float64_loss
    return model


def _padded_batch(seed=5):
    """Two rows, the first right-padded (attention_mask 0, labels -100) and with a prompt
    (labels -100)."""
    ids = torch.randint(3, V, (2, 12), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[0, -3:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[1, :4] = -100
    return ids, mask, labels


def _assert_grads_equal(got_model, want_model, rtol=1e-10, atol=1e-12):
    got = {n: p.grad for n, p in got_model.named_parameters()}
    want = {n: p.grad for n, p in want_model.named_parameters()}
    assert got.keys() == want.keys()
    for name, g in want.items():
        if g is None:
            assert got[name] is None or not got[name].any(), name
            continue
        torch.testing.assert_close(got[name], g, rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("name", _NAMES)
def test_ce_wrapper_equals_the_models_own_loss_and_gradients(name):
    """reduction="mean": the wrapper's loss and the gradients of every parameter equal those
    of ``model(input_ids, attention_mask, labels=labels).loss`` (its scale, its z-loss term
    over every position, padding included) on a padded batch."""
    ids, mask, labels = _padded_batch()
    ref = _model(name)
    model = copy.deepcopy(ref)
    own = ref(input_ids=ids, attention_mask=mask, labels=labels).loss
    own.backward()
    wrapper = CausalLMWithLoss(model, options=CrossEntropyOptions(
        reduction="mean", chunk_size=7, accum_dtype=torch.float64))
    assert wrapper.logit_transform == _EXPECTED[name]
    assert wrapper.head.logit_transform == _EXPECTED[name]
    out = wrapper(ids, labels, attention_mask=mask)
    torch.testing.assert_close(out.loss, own, rtol=1e-12, atol=1e-12)
    out.loss.backward()
    _assert_grads_equal(wrapper.model, ref)
    with torch.no_grad():  # without labels the head is the raw lm_head again: generate works
        torch.testing.assert_close(wrapper.model(input_ids=ids, attention_mask=mask).logits,
                                   ref(input_ids=ids, attention_mask=mask).logits)


@pytest.mark.slow
def test_bamba_z_loss_term_is_refused_where_its_normalisation_is_not_calibrated():
    with pytest.raises(ValueError, match=r'z_loss_coefficient=0.05 .*reduction="sum"'):
        CausalLMWithLoss(_model("bamba"), options=CrossEntropyOptions(reduction="sum"))
    wrapper = CausalLMWithLoss(_model("bamba"), options=CrossEntropyOptions(reduction="mean"))
    ids, mask, labels = _padded_batch()
    with pytest.raises(ValueError, match="z_loss_coefficient=0.05 .*loss_weights"):
        wrapper(ids, labels, loss_weights=torch.ones(ids.shape, dtype=torch.float64))
    # the term is reported in the output's z_loss part too
    out = wrapper(ids, labels, attention_mask=mask)
    assert float(out.z_loss) > 0


@pytest.mark.parametrize("name", ["cohere", "granite", "minicpm3",
                                  pytest.param("falcon_h1", marks=pytest.mark.slow)])
def test_log_probs_wrapper_equals_log_softmax_of_the_models_own_logits(name):
    ids, mask, labels = _padded_batch(6)
    ref = _model(name, tie=True)
    model = copy.deepcopy(ref)
    target = causal_shift(labels)
    temperature = 0.7
    logits = ref(input_ids=ids, attention_mask=mask).logits
    want = (logits / temperature).log_softmax(-1).gather(-1, target.clamp_min(0)[..., None])[
        ..., 0].masked_fill(target == -100, 0.0)
    weights = torch.rand(ids.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    (want * weights).sum().backward()
    wrapper = CausalLMWithLogProbs(model, options=LogProbsOptions(
        temperature=temperature, chunk_size=5, accum_dtype=torch.float64))
    got = wrapper(ids, labels, attention_mask=mask).log_probs
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    (got * weights).sum().backward()
    _assert_grads_equal(wrapper.model, ref)


def test_distillation_applies_the_students_and_the_teachers_own_scales():
    """Student Cohere (logits * 0.25), teacher GraniteMoE (logits / 0.25): the loss and the
    student's gradients equal the float64 reference on the two models' own logits."""
    ids, mask, labels = _padded_batch(7)
    target = causal_shift(labels)
    kw = dict(kind="jsd", beta=0.3, temperature=1.5, alpha=0.2)
    teacher = _model("granitemoe", seed=1).requires_grad_(False)
    ref_student = _model("cohere")
    student = copy.deepcopy(ref_student)
    with torch.no_grad():
        t_logits = teacher(input_ids=ids, attention_mask=mask).logits
    s_logits = ref_student(input_ids=ids, attention_mask=mask).logits
    eye = torch.eye(V, dtype=torch.float64)  # F.linear(logits, I) = logits
    ref = reference_distillation(s_logits, eye, target, teacher_hidden_states=t_logits,
                                 teacher_weight=eye, reduction="mean", **kw)
    ref.backward()
    wrapper = CausalLMWithDistillation(student, teacher, options=DistillationOptions(
        reduction="mean", chunk_size=5, accum_dtype=torch.float64, **kw))
    assert wrapper.logit_transform == LogitTransform(scale=0.25)
    assert wrapper.teacher_logit_transform == LogitTransform(scale=4.0)
    out = wrapper(ids, labels=labels, attention_mask=mask)
    torch.testing.assert_close(out.loss, ref, rtol=1e-12, atol=1e-12)
    out.loss.backward()
    _assert_grads_equal(wrapper.model, ref_student)


def _tp_worker(rank, world):
    """Every rank: the TP-2 wrapper's loss and gradients (decoder full, lm_head rows of its
    shard) against the model's own float64 loss, for a divided scale with a bias-free head
    (Granite) and the z-loss term (Bamba)."""
    import torch.distributed as dist

    from megaloss.losses.vocab_parallel import vocab_shard_range
    ids, mask, labels = _padded_batch(8)
    errors = {}
    for name in ("granite", "bamba"):
        ref = _model(name)
        model = copy.deepcopy(ref)
        own = ref(input_ids=ids, attention_mask=mask, labels=labels).loss
        own.backward()
        wrapper = CausalLMWithLoss(model, tp_group=dist.group.WORLD, options=CrossEntropyOptions(
            reduction="mean", chunk_size=5, accum_dtype=torch.float64))
        out = wrapper(ids, labels, attention_mask=mask)
        out.loss.backward()
        start, stop, _ = vocab_shard_range(V, world, rank)
        worst = {"loss": float((out.loss - own).abs())}
        want = dict(ref.named_parameters())
        for n, p in wrapper.model.named_parameters():
            g, w = p.grad, want[n].grad
            if n == "lm_head.weight":
                g, w = g[:stop - start], w[start:stop]
            worst[n] = float((g - w).abs().max() / w.abs().max().clamp_min(1e-30))
        errors[name] = worst
    return errors


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_vocab_parallel_tp2_applies_the_scale_and_the_z_loss():
    results = run_distributed(_tp_worker, 2, timeout=240)
    for rank, errors in enumerate(results):
        for name, worst in errors.items():
            bad = {k: v for k, v in worst.items() if not v <= 1e-10}
            assert not bad, (rank, name, bad)


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**_COMMON)).double()


def _patched_forward(model, change):
    forward = model.forward

    def patched(*args, **kwargs):
        out = forward(*args, **kwargs)
        out.logits = change(out.logits)
        return out
    model.forward = patched
    return model


def test_the_probe_refuses_a_forward_that_transforms_its_logits_unknown_to_megaloss():
    """A constant factor no config field names, and a mask (as Chameleon's image tokens): the
    wrapper would train another loss than the model's, so it refuses, naming the class, the
    difference and, for the factor, the ratio."""
    with pytest.raises(ValueError, match=r"LlamaForCausalLM's forward \(the model\) transforms "
                                         r"its lm_head logits.*they are 0.5 times those logits"):
        CausalLMWithLoss(_patched_forward(_llama(), lambda z: z * 0.5))

    def mask(z):
        z = z.clone()
        z[..., 7] = torch.finfo(z.dtype).min
        return z
    with pytest.raises(ValueError, match=r"LlamaForCausalLM's forward .* by up to 1.8e\+308"):
        CausalLMWithLogProbs(_patched_forward(_llama(), mask))
    with pytest.raises(ValueError, match=r"LlamaForCausalLM's forward \(the teacher\)"):
        CausalLMWithDistillation(_llama(), _patched_forward(_llama(), lambda z: z + 1.0))


def test_an_lm_head_with_its_own_forward_is_refused():
    """Dory's ``DoryLMHead``: an ``nn.Linear`` subclass whose forward multiplies by a learned
    per-token scale, exactly 1 at initialisation (the probe alone would pass it)."""
    class ScaledHead(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) * 1.0

    model = _llama()
    model.lm_head = ScaledHead(16, V, bias=False).double()
    with pytest.raises(ValueError, match="lm_head is a ScaledHead, an nn.Linear with its own "
                                         "forward"):
        CausalLMWithLoss(model)


def test_the_probe_restores_training_modes_and_is_skipped_on_meta_parameters():
    model = _model("cohere")
    model.train()
    model.model.layers[0].mlp.eval()
    modes = {n: m.training for n, m in model.named_modules()}
    assert model_logit_transform(model) == LogitTransform(scale=0.25)
    assert {n: m.training for n, m in model.named_modules()} == modes
    # not materialised: the declared transform alone, an unlisted scale field refused
    config_cls, model_cls, kwargs = _config("granite")
    with torch.device("meta"):
        meta = model_cls(config_cls(**{**_COMMON, **kwargs}))
    assert model_logit_transform(meta) == LogitTransform(scale=0.25)
    from transformers import LlamaConfig, LlamaForCausalLM
    with torch.device("meta"):
        llama = LlamaForCausalLM(LlamaConfig(**_COMMON, logits_scaling=4.0))
    assert config_logit_transform(llama) == LogitTransform(scale=0.25)  # Granite's direction
    with pytest.raises(ValueError, match="logits_scaling=4.0 .*not in megaloss's table.*not "
                                         "materialised .*meta device"):
        model_logit_transform(llama)


def test_a_stray_scale_field_the_forward_ignores_is_refused_naming_it():
    """Llama's forward reads no ``logit_scale``: the probe finds its logits unscaled, and the
    unlisted field is named in the refusal (MPT's ignored ``logit_scale`` is in the table)."""
    model = _llama()
    model.config.logit_scale = 0.0625
    with pytest.raises(ValueError, match=r"config's logit_scale=0.0625 \(model_type llama, not "
                                         r"in megaloss's table"):
        CausalLMWithLoss(model)


@pytest.mark.parametrize("name", ["cohere", pytest.param("bamba", marks=pytest.mark.slow)])
def test_autotp_wrapper_applies_the_transform(name):
    """AutoTPCausalLMWithLoss (probed at construction, on the unsharded model) against the
    model's own loss and gradients; its forward on one process, the unsharded lm_head standing
    for AutoTP's shard (no vocab-parallel options: the TP path is the test above's)."""
    from megaloss.integrations.autotp import AutoTPCausalLMWithLoss
    ids, mask, labels = _padded_batch(9)
    ref = _model(name)
    own = ref(input_ids=ids, attention_mask=mask, labels=labels).loss
    own.backward()
    wrapper = AutoTPCausalLMWithLoss(_model(name), options=CrossEntropyOptions(
        reduction="mean", chunk_size=5, accum_dtype=torch.float64))
    assert wrapper.logit_transform == _EXPECTED[name]
    wrapper.__dict__["_autotp_head"] = (wrapper.lm_head, None)
    out = wrapper(ids, labels, attention_mask=mask)
    torch.testing.assert_close(out.loss, own, rtol=1e-12, atol=1e-12)
    out.loss.backward()
    want = dict(ref.named_parameters())
    for n, p in wrapper.named_parameters():
        torch.testing.assert_close(p.grad, want[n].grad, rtol=1e-10, atol=1e-12, msg=n)


@pytest.mark.slow  # Inkling's first forward: several seconds
def test_inkling_divides_its_hidden_states_by_logits_mup_width_multiplier():
    """Inkling's forward divides the decoder's output by ``logits_mup_width_multiplier`` (24 by
    default) before its lm_head (transformers/models/inkling/modeling_inkling.py): read from
    the config of a meta model (the table alone), and verified by the probe on a real one."""
    from transformers import InklingForCausalLM, InklingTextConfig
    config = InklingTextConfig(vocab_size=V, hidden_size=16, intermediate_size=32,
                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                               head_dim=8, logits_mup_width_multiplier=8.0)
    with torch.device("meta"):
        assert model_logit_transform(InklingForCausalLM(config)) == LogitTransform(scale=0.125)
    torch.manual_seed(0)
    assert model_logit_transform(InklingForCausalLM(config)) == LogitTransform(scale=0.125)


def test_a_model_whose_own_loss_does_not_shift_labels_keeps_its_convention():
    """BartForCausalLM's own loss takes ``labels[t]`` as the target of position ``t``
    (``transformers/models/bart/modeling_bart.py``): the probe finds it and the wrapper's loss
    and gradients equal the model's own (float64), where HF's shifted convention would not."""
    from transformers import BartConfig, BartForCausalLM

    torch.manual_seed(0)
    model = BartForCausalLM(BartConfig(
        vocab_size=40, d_model=16, decoder_layers=1, decoder_attention_heads=2,
        decoder_ffn_dim=32, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32,
        max_position_embeddings=32, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0)).double()
    ref = copy.deepcopy(model)
    ids = torch.randint(3, 40, (2, 9))
    labels = ids.clone()
    labels[1, :3] = -100
    wrapper = CausalLMWithLoss(model, options=CrossEntropyOptions(reduction="mean"))
    assert wrapper.logit_transform.shifts_labels is False
    loss = wrapper(input_ids=ids, labels=labels).loss
    own = ref(input_ids=ids, labels=labels).loss
    torch.testing.assert_close(loss, own, rtol=1e-12, atol=1e-12)
    loss.backward()
    own.backward()
    got = dict(wrapper.model.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name].grad, p.grad, rtol=1e-10, atol=1e-12, msg=name)
    shifted = wrapper(input_ids=ids, shift_labels=causal_shift(labels)).loss  # HF's convention
    assert abs(float(shifted) - float(own)) > 1e-3
