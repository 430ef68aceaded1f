"""MegalossGRPOMixin in a real 2-process GRPOTrainer run with generation: 2 gloo processes
(``megaloss.testing.run_distributed``; accelerate's MULTI_CPU DDP, the CPU launch TRL 1.16
supports: its vLLM and DeepSpeed paths need an accelerator), a 1-layer Llama sampling its own
completions, a reward on the sampled text, 2 optimizer steps.

``class T(MegalossGRPOMixin, GRPOTrainer)`` trains both steps without error, and with the same
seed (the mixin draws no random numbers, so both runs sample the same completions as long as
their updates agree) its logged loss and grad norm of each step equal TRL's own
``GRPOTrainer``'s for ``grpo`` and ``dapo``: with one micro-batch per process and the same rows
on each, TRL's per-process normalisation is the global one too (``grpo``: the row mean;
``dapo``: the global token count). ``beta`` 0.04 against the initial model, so the second
step's loss is not 0 (the first's is, on-policy with group-normalised advantages, for
``grpo``). Tolerance: 1e-5 relative plus 1e-7 (float32 model; the loss is a sum of O(1)
terms that cancel to ~1e-3; measured 1.2e-8). ``bnpo``, which TRL normalises per process,
parts from TRL's run, as it should.
"""
import os
import sys
import warnings

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from megaloss.testing import run_distributed  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(600)]

TOL = 1e-5
ATOL = 1e-7  # the loss sums O(1) float32 terms that cancel to ~1e-3


def _reward(completions, **kwargs):
    """The number of ``a`` tokens in each sampled completion (varies within a group)."""
    return [float(str(c).split().count("a")) for c in completions]


def _save_model(out_dir):
    from test_hf_trl_policy import _tiny_grpo_parts
    _tiny_grpo_parts()["model"].save_pretrained(os.path.join(out_dir, "model"))


def _worker(rank, world, out_dir, loss_type, ours):
    from datasets import Dataset
    from test_hf_trl_policy import _tiny_grpo_parts
    from trl import GRPOConfig, GRPOTrainer

    from megaloss.integrations.hf import MegalossGRPOMixin

    parts = _tiny_grpo_parts()
    parts["reward_funcs"] = _reward
    parts.pop("model")  # by path (saved by the test), so TRL builds the reference from it
    path = os.path.join(out_dir, "model")
    parts["train_dataset"] = Dataset.from_dict({"prompt": ["a b", "b", "a", "b a b"] * 4})
    cls = type("T", (MegalossGRPOMixin, GRPOTrainer) if ours else (GRPOTrainer,), {})
    args = GRPOConfig(
        output_dir=os.path.join(out_dir, f"{loss_type}-{ours}-{rank}"), report_to="none",
        use_cpu=True, bf16=False, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=4, max_steps=2, learning_rate=0.5, optim="sgd",
        lr_scheduler_type="constant", weight_decay=0.0, logging_steps=1, save_strategy="no",
        disable_tqdm=True, seed=0, loss_type=loss_type, beta=0.04, use_bias_correction_kl=False,
        temperature=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = cls(model=path, args=args, **parts)
        trainer.train()
    return [log for log in trainer.state.log_history if "loss" in log]


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_two_process_grpo_run_equals_trl(tmp_path, loss_type):
    _save_model(str(tmp_path))
    ours = run_distributed(_worker, 2, str(tmp_path), loss_type, True, timeout=280)
    theirs = run_distributed(_worker, 2, str(tmp_path), loss_type, False, timeout=280)
    assert len(ours[0]) == len(theirs[0]) == 2  # 2 steps logged on every process
    for our_logs, their_logs in zip(ours, theirs):
        for mine, trl in zip(our_logs, their_logs):
            for name in ("loss", "grad_norm"):
                a, b = mine[name], trl[name]
                assert abs(a - b) <= TOL * abs(b) + ATOL, (name, mine, trl)
    assert all(abs(log["grad_norm"]) > 1e-2 for log in ours[0])  # the steps do train
    assert abs(ours[0][1]["loss"]) > 1e-4  # step 2: the KL to the reference is not 0


def test_two_process_bnpo_is_the_global_token_mean_not_trls():
    """``bnpo``: TRL divides by each process's own token count, the mixin by the global one,
    so with uneven completion lengths over the processes the two runs part (as the module
    docstring of ``megaloss.integrations.hf.trl_policy`` says); the check above is no
    tautology."""
    import tempfile
    with tempfile.TemporaryDirectory() as out:
        _save_model(out)
        ours = run_distributed(_worker, 2, out, "bnpo", True, timeout=280)
        theirs = run_distributed(_worker, 2, out, "bnpo", False, timeout=280)
    gap = abs(ours[0][0]["grad_norm"] - theirs[0][0]["grad_norm"])
    assert gap > 1e-3 * theirs[0][0]["grad_norm"], (ours, theirs)
