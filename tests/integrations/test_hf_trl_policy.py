"""MegalossGRPOMixin on TRL 1.16's GRPOTrainer machinery, one process: a generation batch of
uneven completions is counted by the mixin's ``_generate_and_score_completions``, split into 2
micro-batches by TRL's own ``split_tensor_dict``, and the mixin's ``_compute_loss`` per
micro-batch sums to the single-device loss and gradient of the whole batch for every
``loss_type``; for ``dapo`` (global in TRL too) it also equals TRL's own ``_compute_loss`` summed
over the same micro-batches. Tolerance: float64, 1e-12.
"""
import collections
from types import SimpleNamespace

import pytest
import torch

from megaloss import PolicyLossOptions, policy_loss
from megaloss.integrations.hf import MegalossGRPOMixin, policy_options_from_grpo_args

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
                use_bias_correction_kl=False)
    base.update(kw)
    return SimpleNamespace(**base)


def _generation_batch():
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([7, 1, 2, 6, 0, 5])  # a row without completion: uneven counts
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
        current_gradient_accumulation_steps=GAS, max_completion_length=T,
        _entropy_bonus_enabled=args.entropy_coef != 0, entropy_coef=args.entropy_coef,
        use_adaptive_entropy=False)
    trainer._current = None

    def logps(model, *a, **k):
        idx = [rows[float(x)] for x in trainer._current["advantages"]]
        return lp[idx], ent[idx], None
    trainer._get_per_token_logps_and_entropies = logps
    return trainer


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo", "cispo"])
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
    assert opts == PolicyLossOptions(loss_type=loss_type, epsilon_low=0.2,
                                     epsilon_high=args.epsilon_high, beta=0.04,
                                     entropy_coef=0.01, max_completion_length=T)
    expected = policy_loss(whole_lp, batch["old_per_token_logps"], batch["advantages"],
                           batch["completion_mask"], ref_log_probs=batch["ref_per_token_logps"],
                           entropy=whole_ent, options=opts, return_stats=True)
    expected.loss.backward()
    assert abs(float(loss) - float(expected.loss.detach())) <= TOL
    torch.testing.assert_close(grad, whole_lp.grad, rtol=TOL, atol=TOL)
    torch.testing.assert_close(ent_grad, whole_ent.grad, rtol=TOL, atol=TOL)
    assert len(metrics["entropy"]) == GAS and "kl" in metrics
    if loss_type == "dapo":  # TRL's dapo divides by the global token count too (without the
        # entropy bonus, which TRL takes per micro-batch)
        args.entropy_coef = 0.0
        ours, *_ = run(_Ours, MegalossGRPOMixin._compute_loss)
        theirs, *_ = run(type("T", (GRPOTrainer,), {}), GRPOTrainer._compute_loss)
        assert abs(float(ours) - float(theirs)) <= TOL


def test_unsupported_settings_are_refused():
    with pytest.raises(ValueError, match="steps_per_generation=4"):
        policy_options_from_grpo_args(_args("grpo", steps_per_generation=4))
    with pytest.raises(ValueError, match="supports"):
        policy_options_from_grpo_args(_args("sapo"))
    with pytest.raises(ValueError, match="use_bias_correction_kl"):
        policy_options_from_grpo_args(_args("grpo", use_bias_correction_kl=True))
