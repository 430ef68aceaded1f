"""MegalossGRPOMixin on TRL 1.16's GRPOTrainer machinery, one process: a generation batch of
uneven completions is counted by the mixin's ``_generate_and_score_completions``, split into 2
micro-batches by TRL's own ``split_tensor_dict``, and the mixin's ``_compute_loss`` per
micro-batch sums to the single-device loss and gradient of the whole batch for every
``loss_type``; for ``dapo`` (global in TRL too) it also equals TRL's own ``_compute_loss`` summed
over the same micro-batches. On ONE micro-batch (where TRL's per-micro-batch normaliser is the
global one) with half the rows fully masked (TRL's ``mask_truncated_completions``), the mixin's
loss, gradient and metrics equal TRL's own ``_compute_loss`` for every ``loss_type`` (``grpo``,
``dr_grpo``, ``bnpo``, ``dapo``, ``cispo``, ``sapo``, ``luspo`` at both importance-sampling
levels, ``vespo``, with their GRPOConfig fields off their defaults); ``vespo`` and ``cispo``
(global in TRL too) also across the 2 micro-batches; ``megaloss_count_empty_rows = False``
equals TRL on the rows with a completion token. A plain ``GRPOConfig()`` and ``cispo`` with
``delta`` are accepted; a setting the mixin does not reproduce is refused when the trainer is
built. Tolerance: float64, 1e-12 (TRL's float32 clip-ratio means: 1e-7; SAPO's default
temperature 1.05, which TRL rounds to float32: 1e-7 relative).
"""
import collections
from types import SimpleNamespace

import pytest
import torch

from megaloss import PolicyLossOptions, policy_loss
from megaloss.integrations.hf import MegalossGRPOMixin
from megaloss.integrations.hf.trl_policy import policy_options_from_grpo_args

pytestmark = pytest.mark.slow  # importing TRL's trainer (transformers, datasets, ...) takes ~7 s

B, T, GAS = 6, 7, 2
TOL = 1e-12


class _Accelerator:
    num_processes, sync_gradients = 1, True

    def gather(self, x):
        return x

    def reduce(self, x, reduction="sum"):
        return x


def _args(loss_type, **kw):
    base = dict(loss_type=loss_type, epsilon=0.2, epsilon_high=0.28, delta=None, beta=0.04,
                entropy_coef=0.01, importance_sampling_level="token", max_completion_length=T,
                gradient_accumulation_steps=GAS, steps_per_generation=GAS,
                use_bias_correction_kl=False,
                # off TRL's defaults; exact in float32, so TRL's torch.where of Python floats
                # (torch's default dtype) does not round them
                sapo_temperature_pos=0.75, sapo_temperature_neg=1.25, vespo_k_pos=1.5,
                vespo_lambda_pos=2.5, vespo_k_neg=0.5, vespo_lambda_neg=4.0)
    base.update(kw)
    return SimpleNamespace(**base)


def _generation_batch(lengths=(7, 1, 2, 6, 0, 5)):  # a row without completion: uneven counts
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor(lengths)
    B = len(lengths)
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    lp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    return lp, {
        "prompt_ids": torch.zeros(B, 1, dtype=torch.long),
        "prompt_mask": torch.ones(B, 1, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask,
        "advantages": torch.randn(B, generator=g, dtype=torch.float64),
        "old_per_token_logps": lp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64),
        "ref_per_token_logps": lp + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64),
        "num_items_in_batch": mask.sum().double(),
        "_entropy": torch.rand(B, T, generator=g, dtype=torch.float64)}


def _trainer(cls, args, lp, ent, batch):
    """A stand-in trainer whose model outputs are rows of lp / ent matched by advantages."""
    rows = {float(a): i for i, a in enumerate(batch["advantages"])}
    trainer = cls.__new__(cls)
    trainer.__dict__.update(
        args=args, accelerator=_Accelerator(), model=SimpleNamespace(training=True),
        _metrics={"train": collections.defaultdict(list)}, aux_loss_enabled=False,
        loss_type=args.loss_type, epsilon_low=args.epsilon, epsilon_high=args.epsilon_high,
        beta=args.beta, importance_sampling_level=args.importance_sampling_level,
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, use_vllm=False,
        current_gradient_accumulation_steps=args.gradient_accumulation_steps,
        max_completion_length=args.max_completion_length,
        _entropy_bonus_enabled=args.entropy_coef != 0, entropy_coef=args.entropy_coef,
        use_adaptive_entropy=False)
    trainer._current = None

    def logps(model, *a, **k):
        idx = [rows[float(x)] for x in trainer._current["advantages"]]
        return lp[idx], ent[idx], None
    trainer._get_per_token_logps_and_entropies = logps
    return trainer


ALL_TYPES = ["grpo", "bnpo", "dapo", "dr_grpo", "cispo", "sapo", "luspo", "vespo"]
_OWN_FIELDS = {"sapo": ("sapo_temperature_pos", "sapo_temperature_neg"),
               "vespo": ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")}


@pytest.mark.parametrize("loss_type", ALL_TYPES)
def test_micro_batches_give_the_whole_batch_loss(loss_type):
    from trl.trainer.grpo_trainer import GRPOTrainer
    from trl.trainer.utils import split_tensor_dict

    args = _args(loss_type, epsilon_high=1.3 if loss_type == "cispo" else 0.28)
    lp0, batch = _generation_batch()
    ent0 = batch.pop("_entropy")

    class _Base:
        def _generate_and_score_completions(self, inputs):
            return dict(batch)

    class _Ours(MegalossGRPOMixin, _Base):
        pass

    def run(cls, compute):
        lp, ent = lp0.clone().requires_grad_(), ent0.clone().requires_grad_()
        trainer = _trainer(cls, args, lp, ent, batch)
        full = (_Ours._generate_and_score_completions(trainer, None) if cls is _Ours
                else dict(batch))
        total = 0
        for mb in split_tensor_dict(full, GAS):
            trainer._current = mb
            total = total + compute(trainer, None, mb)
        total.backward()
        return total.detach(), lp.grad, ent.grad, trainer._metrics["train"]

    loss, grad, ent_grad, metrics = run(_Ours, MegalossGRPOMixin._compute_loss)
    whole_lp, whole_ent = lp0.clone().requires_grad_(), ent0.clone().requires_grad_()
    opts = policy_options_from_grpo_args(args)
    own = {k: getattr(args, k) for k in _OWN_FIELDS.get(loss_type, ())}
    assert opts == PolicyLossOptions(loss_type=loss_type, epsilon_low=0.2,
                                     epsilon_high=args.epsilon_high, beta=0.04,
                                     entropy_coef=0.01, max_completion_length=T,
                                     count_empty_rows=True, **own)
    expected = policy_loss(whole_lp, batch["old_per_token_logps"], batch["advantages"],
                           batch["completion_mask"], ref_log_probs=batch["ref_per_token_logps"],
                           entropy=whole_ent, options=opts, return_stats=True)
    expected.loss.backward()
    assert abs(float(loss) - float(expected.loss.detach())) <= TOL
    torch.testing.assert_close(grad, whole_lp.grad, rtol=TOL, atol=TOL)
    torch.testing.assert_close(ent_grad, whole_ent.grad, rtol=TOL, atol=TOL)
    assert len(metrics["entropy"]) == GAS and "kl" in metrics
    if loss_type in ("dapo", "cispo", "vespo"):  # TRL divides these by the global token count
        # too (without the entropy bonus, which TRL takes per micro-batch)
        args.entropy_coef = 0.0
        ours, grad, *_ = run(_Ours, MegalossGRPOMixin._compute_loss)
        theirs, their_grad, *_ = run(type("T", (GRPOTrainer,), {}), GRPOTrainer._compute_loss)
        assert abs(float(ours) - float(theirs)) <= TOL
        torch.testing.assert_close(grad, their_grad, rtol=TOL, atol=TOL)


def test_unsupported_settings_are_refused():
    with pytest.raises(ValueError, match="steps_per_generation=4"):
        policy_options_from_grpo_args(_args("grpo", steps_per_generation=4))
    with pytest.raises(ValueError, match="supports"):
        policy_options_from_grpo_args(_args("ppo"))
    # a loss type's own fields, where megaloss cannot follow TRL (TRL divides by the temperature
    # and clamps lambda to >= 1e-4), are refused naming the field ...
    for loss_type, field, value in [("sapo", "sapo_temperature_pos", 0.0),
                                    ("sapo", "sapo_temperature_neg", -1.0),
                                    ("vespo", "vespo_k_pos", -1.0),
                                    ("vespo", "vespo_lambda_neg", 0.0)]:
        with pytest.raises(ValueError, match=field):
            policy_options_from_grpo_args(_args(loss_type, **{field: value}))
    # ... and only for that loss type, as TRL reads them only there
    assert policy_options_from_grpo_args(_args("grpo", sapo_temperature_pos=0.0,
                                               vespo_lambda_neg=0.0))
    with pytest.raises(ValueError, match="use_bias_correction_kl"):
        policy_options_from_grpo_args(_args("grpo", use_bias_correction_kl=True))
    # without the KL (beta = 0) TRL never reads it
    assert policy_options_from_grpo_args(_args("grpo", beta=0.0, use_bias_correction_kl=True))


# Half the rows fully masked, as TRL's mask_truncated_completions leaves truncated completions.
MASKED = (7, 0, 2, 0, 5, 0)


def _one_micro_batch(cls, compute, args, lengths):
    """``compute`` (a _compute_loss) on the whole generation batch as ONE micro-batch; returns
    (loss, log-prob grad, entropy grad, metrics)."""
    lp0, batch = _generation_batch(lengths)
    ent0 = batch.pop("_entropy")
    lp, ent = lp0.clone().requires_grad_(), ent0.clone().requires_grad_()
    ours = issubclass(cls, MegalossGRPOMixin)
    if ours:  # TRL's generation stands in: the mixin counts what it returns
        base = type("_Base", (), {"_generate_and_score_completions": lambda self, i: dict(batch)})
        cls = type("_Counted", (cls, base), {})
    trainer = _trainer(cls, args, lp, ent, batch)
    trainer._current = trainer._generate_and_score_completions(None) if ours else dict(batch)
    loss = compute(trainer, None, trainer._current)
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return float(loss.detach()), lp.grad, ent.grad, metrics


def _masked_args(loss_type, **kw):
    kw.setdefault("delta", 1.5 if loss_type in ("dapo", "luspo", "sapo") else None)
    kw.setdefault("epsilon_high", 1.3 if loss_type == "cispo" else 0.28)
    return _args(loss_type, gradient_accumulation_steps=1, steps_per_generation=1,
                 max_completion_length=9, **kw)


_METRICS = {"cispo": ("cispo_clip_ratio",), "sapo": (), "vespo": ("vespo/phi_seq_mean",)}
_CLIP = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


@pytest.mark.parametrize("loss_type,kw", [(t, {}) for t in ALL_TYPES] + [
    ("luspo", dict(importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4)),
    ("sapo", dict(importance_sampling_level="sequence"))],
    ids=ALL_TYPES + ["luspo-sequence", "sapo-sequence"])
def test_one_micro_batch_with_masked_rows_equals_trl(loss_type, kw):
    """TRL's grpo / sapo / luspo average over every row and its dr_grpo divides by B x
    max_completion_length: the mixin counts the masked rows too (before: the rows with a
    completion token, 2.0 x TRL's grpo / dr_grpo policy term here)."""
    from trl.trainer.grpo_trainer import GRPOTrainer
    args = _masked_args(loss_type, **kw)
    ours = _one_micro_batch(type("Ours", (MegalossGRPOMixin,), {}),
                            MegalossGRPOMixin._compute_loss, args, MASKED)
    theirs = _one_micro_batch(type("T", (GRPOTrainer,), {}), GRPOTrainer._compute_loss, args,
                              MASKED)
    assert abs(ours[0] - theirs[0]) <= TOL * max(1.0, abs(theirs[0])), (ours[0], theirs[0])
    torch.testing.assert_close(ours[1], theirs[1], rtol=TOL, atol=TOL)
    torch.testing.assert_close(ours[2], theirs[2], rtol=TOL, atol=TOL)
    names = ("kl", "entropy") + _METRICS.get(loss_type, _CLIP)
    assert set(names) <= set(ours[3]) and set(names) <= set(theirs[3])
    for name in names:
        # TRL's clip ratios are float32 means (is_low_clipped.float()), the others float64
        tol = 1e-7 if name.startswith(("clip_ratio", "cispo")) else TOL
        assert abs(ours[3][name] - theirs[3][name]) <= tol * max(1.0, abs(theirs[3][name])), name


def test_sapo_default_temperature_differs_from_trl_by_its_float32_rounding():
    """TRL's ``torch.where(advantages > 0, 1.0, 1.05)`` is in torch's default dtype: float32
    rounds 1.05 to 1.0499999523, megaloss keeps 1.05; under a float64 default dtype the two are
    equal to 1e-12."""
    from trl.trainer.grpo_trainer import GRPOTrainer
    args = _masked_args("sapo", sapo_temperature_pos=1.0, sapo_temperature_neg=1.05)
    ours = _one_micro_batch(type("Ours", (MegalossGRPOMixin,), {}),
                            MegalossGRPOMixin._compute_loss, args, MASKED)
    theirs = _one_micro_batch(type("T", (GRPOTrainer,), {}), GRPOTrainer._compute_loss, args,
                              MASKED)
    assert 0 < abs(ours[0] - theirs[0]) <= 1e-7 * abs(theirs[0]), (ours[0], theirs[0])
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-7, atol=0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        exact = _one_micro_batch(type("T", (GRPOTrainer,), {}), GRPOTrainer._compute_loss, args,
                                 MASKED)
    finally:
        torch.set_default_dtype(default)
    assert abs(ours[0] - exact[0]) <= TOL * max(1.0, abs(exact[0])), (ours[0], exact[0])
    torch.testing.assert_close(ours[1], exact[1], rtol=TOL, atol=TOL)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "bnpo", "dapo"])
def test_count_empty_rows_false_is_trl_on_the_rows_with_completions(loss_type):
    """``megaloss_count_empty_rows = False``: masked rows count nothing, the loss is TRL's on the
    generation batch without them."""
    from trl.trainer.grpo_trainer import GRPOTrainer
    args = _masked_args(loss_type)
    skip = type("Ours", (MegalossGRPOMixin,), {"megaloss_count_empty_rows": False})
    ours = _one_micro_batch(skip, MegalossGRPOMixin._compute_loss, args, MASKED)
    lp0, batch = _generation_batch(MASKED)  # TRL on the same batch's rows with a completion
    ent0 = batch.pop("_entropy")
    rows = batch["completion_mask"].any(-1)
    sub = {k: v[rows] if v.dim() else v for k, v in batch.items()}
    lp, ent = lp0[rows].clone().requires_grad_(), ent0[rows].clone().requires_grad_()
    trainer = _trainer(type("T", (GRPOTrainer,), {}), args, lp, ent, sub)
    trainer._current = sub
    theirs = float(GRPOTrainer._compute_loss(trainer, None, sub).detach())
    assert abs(ours[0] - theirs) <= TOL * max(1.0, abs(theirs)), (ours[0], theirs)
    counted = _one_micro_batch(type("Ours", (MegalossGRPOMixin,), {}),
                               MegalossGRPOMixin._compute_loss, args, MASKED)
    assert (abs(ours[0] - counted[0]) > 1e-6) == (loss_type in ("grpo", "dr_grpo"))


def _grpo_config(tmp_path, **kw):
    from trl import GRPOConfig
    # use_cpu: TRL's GRPOConfig defaults bf16=True, which transformers refuses without a GPU
    return GRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, **kw)


def test_plain_grpo_config_and_cispo_delta_are_accepted(tmp_path):
    """TRL 1.16's GRPOConfig() defaults use_bias_correction_kl=True, which TRL reads only when
    beta != 0 (default 0); cispo ignores delta in TRL."""
    plain = _grpo_config(tmp_path)
    assert plain.use_bias_correction_kl and plain.beta == 0.0  # the defaults this is about
    opts = policy_options_from_grpo_args(plain)
    assert (opts.loss_type, opts.beta, opts.count_empty_rows) == (plain.loss_type, 0.0, True)
    cispo = policy_options_from_grpo_args(_grpo_config(tmp_path, loss_type="cispo",
                                                       epsilon_high=5.0, delta=1.5))
    assert (cispo.loss_type, cispo.epsilon_high, cispo.delta) == ("cispo", 5.0, 1.5)
    with pytest.raises(ValueError, match="use_bias_correction_kl"):
        policy_options_from_grpo_args(_grpo_config(tmp_path, beta=0.04))
    # sapo / vespo take their own GRPOConfig fields (TRL's defaults here)
    sapo = policy_options_from_grpo_args(_grpo_config(tmp_path, loss_type="sapo"))
    assert (sapo.sapo_temperature_pos, sapo.sapo_temperature_neg) == (1.0, 1.05)
    vespo = policy_options_from_grpo_args(_grpo_config(tmp_path, loss_type="vespo",
                                                       vespo_k_neg=0.5))
    assert (vespo.vespo_k_pos, vespo.vespo_lambda_pos, vespo.vespo_k_neg,
            vespo.vespo_lambda_neg) == (2.0, 3.0, 0.5, 2.0)
    luspo = policy_options_from_grpo_args(_grpo_config(
        tmp_path, loss_type="luspo", importance_sampling_level="sequence"))
    assert (luspo.loss_type, luspo.importance_sampling_level) == ("luspo", "sequence")
    assert policy_options_from_grpo_args(
        _grpo_config(tmp_path, beta=0.04, use_bias_correction_kl=False)).beta == 0.04


def _tiny_grpo_parts():
    """A 1-layer Llama, a word-level tokenizer and a prompt dataset, all built offline."""
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    vocab = {"<pad>": 0, "<eos>": 1, "a": 2, "b": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>",
                                        eos_token="<eos>")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=4, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
        pad_token_id=0, eos_token_id=1))
    data = Dataset.from_dict({"prompt": ["a b"] * 8})
    return dict(model=model, processing_class=tokenizer, train_dataset=data,
                reward_funcs=lambda completions, **kw: [0.0] * len(completions))


def test_refused_when_the_trainer_is_built(tmp_path):
    """A setting the mixin does not reproduce fails in GRPOTrainer construction, before any
    generation (it used to fail at the first loss, after a generation batch); a plain config
    builds."""
    from trl import GRPOTrainer

    generated = []

    class _Spy(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            generated.append(1)
            return super()._generate_and_score_completions(inputs)

    class _Ours(MegalossGRPOMixin, _Spy):
        pass

    small = dict(per_device_train_batch_size=4, num_generations=4, max_completion_length=4)
    trainer = _Ours(args=_grpo_config(tmp_path, **small), **_tiny_grpo_parts())
    assert trainer._megaloss_options().count_empty_rows
    for bad, match in [(dict(top_entropy_quantile=0.5), "top_entropy_quantile"),
                       (dict(beta=0.04), "use_bias_correction_kl"),
                       (dict(loss_type="vespo", vespo_lambda_pos=0.0), "vespo_lambda_pos")]:
        with pytest.raises(ValueError, match=match):
            _Ours(args=_grpo_config(tmp_path, **small, **bad), **_tiny_grpo_parts())
    assert not generated
