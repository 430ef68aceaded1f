"""The GRPO job as the README runs it (``bash launch/train_grpo.sh``), shrunk: the tiny Llama on
200 kB of the stdlib, a BPE of 1024 tokens, lists of 4 of 8 words, 20 SFT steps, then 20 GRPO
steps of two optimizer steps per rollout (so the old policy's log-probs and the PPO ratio act)
with the shipped config's KL to the SFT model. Checks what a user reads in summary.json and
metrics.csv, and that GRPO raised the held-out reward above the SFT model's. The task, reward and
advantages themselves: tests/launch/test_grpo_task.py.

The script's command (``DRY_RUN=1`` prints it: ``deepspeed --num_gpus 2 ... train_grpo.py
--deepspeed_config configs/grpo.json ARGS``) is what the test runs: its job arguments are a job
of the launch several test files share (``shared_launch`` in shared_launches.py)."""
import csv
import json

import pytest

from tests.helpers.launch_helpers import assert_launches, script_command

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow, pytest.mark.xdist_group("shared_launch")]

SFT_STEPS, STEPS = 20, 20


def _args(tmp_path) -> list:
    return ["--vocab_size", "1024", "--max_train_bytes", "200000", "--num_items", "8",
            "--list_length", "4", "--sft_steps", str(SFT_STEPS), "--steps", str(STEPS),
            "--num_iterations", "2", "--eval_prompts", "128", "--eval_every", "10",
            "--output_dir", str(tmp_path / "grpo"), "--cache_dir", str(tmp_path / "cache"),
            "--no_progress"]


def shared_launch_jobs(tmp_path) -> list:
    """``bash launch/train_grpo.sh ARGS``'s job: the arguments the script gives train_grpo.py."""
    cmd = script_command("train_grpo.sh", *_args(tmp_path))
    return [{"job": "train_grpo", "argv": cmd[6:]}]


def test_script_launches_the_job_with_the_grpo_config(tmp_path):
    cmd = script_command("train_grpo.sh", *_args(tmp_path))
    assert_launches(cmd, 2, "train_grpo", "grpo", [*_args(tmp_path)])


@pytest.mark.timeout(900)
def test_grpo_job_raises_the_held_out_reward(shared_launch):
    run = shared_launch["test_train_grpo"]
    out = run.tmp_path / "grpo"
    s = json.loads((out / "summary.json").read_text())
    assert (s["dp"], s["zero_stage"], s["sft_steps"], s["steps"]) == (2, 2, SFT_STEPS, STEPS)
    assert s["prompts_per_step"] * s["num_generations"] == 2 * 32 * 2  # DP x micro x GAS
    assert s["policy"]["loss_type"] == "grpo" and s["policy"]["beta"] > 0
    assert s["task"]["kind"] == "reverse" and len(s["task"]["items"]) == 8
    assert s["task"]["eval_prompts"] == 128
    assert [e["phase"] for e in s["evals"]] == ["init", "sft", "grpo", "grpo"]
    assert s["reward_before"] == s["eval_before"]["reward"]
    assert s["reward_after"] == s["eval_after"]["reward"]
    assert s["sft_last_loss"] < s["sft_first_loss"] - 1.0
    assert s["reward_before"] > s["eval_init"]["reward"]
    assert s["reward_after"] > s["reward_before"] + 0.03, s["evals"]
    assert s["train_reward_last"] > s["train_reward_first"], s
    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["phase"] for r in rows] == ["sft"] * SFT_STEPS + ["grpo"] * STEPS
    grpo = rows[SFT_STEPS:]
    # two optimizer steps per rollout
    assert int(grpo[-1]["optimizer_step"]) == SFT_STEPS + 2 * STEPS
    assert all(0 <= float(r["reward"]) <= 1 and float(r["kl"]) >= 0 for r in grpo)
    assert any(float(r["kl"]) > 0 for r in grpo)
    assert float(grpo[9]["eval_reward"]) == s["evals"][2]["reward"]
    assert (out / "loss_curve.png").stat().st_size > 0
    assert "after GRPO" in run.outputs[0]
