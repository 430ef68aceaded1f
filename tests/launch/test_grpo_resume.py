"""The GRPO job's checkpoints and resume, end to end under ``deepspeed --num_gpus 2`` on CPU
(ZeRO-2, DP=2), shrunk: a run of 3 SFT + 4 GRPO steps (two optimizer steps per rollout, the KL
to the SFT model on) against the same run stopped after step k the way SIGTERM stops it (the stop
request injected at that step boundary, ``stop_after``), then continued with ``--resume``: once
in the SFT phase (k = 2), once in the GRPO phase (k = 5: the reference policy and the sampling
seeds must come back from the checkpoint). Every column of ``metrics.csv`` (losses, rewards, KL,
entropy, clip ratio, held-out rewards) and the final weights must be bitwise those of the
uninterrupted run. Also: ``--eval_only --resume`` reproduces its final evaluation and a rerun
into the folder is refused.

The jobs are a part of the launch several test files share (``shared_launch`` in
shared_launches.py), as tests/launch/test_train_grpo.py's."""
import csv
import json

import pytest
import torch

from tests.helpers.launch_helpers import REPO

pytestmark = [pytest.mark.deepspeed, pytest.mark.distributed, pytest.mark.slow,
              pytest.mark.xdist_group("shared_launch")]

SFT_STEPS, STEPS = 3, 4
TOTAL = SFT_STEPS + STEPS
STOPS = {"sft": 2, "grpo": SFT_STEPS + 2}  # the step the interrupted runs stop after


def _args(tmp_path, out: str, *extra: str) -> list:
    return ["--deepspeed_config", str(tmp_path / "grpo.json"), "--vocab_size", "512",
            "--max_train_bytes", "100000", "--num_items", "8", "--list_length", "4",
            "--num_generations", "4", "--sft_steps", str(SFT_STEPS), "--steps", str(STEPS),
            "--num_iterations", "2", "--eval_prompts", "32", "--eval_every", "2",
            "--output_dir", str(tmp_path / out), "--cache_dir", str(tmp_path / "cache"),
            "--no_progress", *extra]


def shared_launch_jobs(tmp_path) -> list:
    """The uninterrupted run, each interrupted run and its resume, ``--eval_only`` on the
    resumed GRPO-phase run, a rerun refused."""
    cfg = json.loads((REPO / "configs" / "grpo.json").read_text())
    cfg.update(train_micro_batch_size_per_gpu=8, gradient_accumulation_steps=2)
    (tmp_path / "grpo.json").write_text(json.dumps(cfg))
    jobs = [{"job": "train_grpo", "argv": _args(tmp_path, "full", "--save_every", str(TOTAL))}]
    for name, k in STOPS.items():
        jobs += [{"job": "train_grpo", "argv": _args(tmp_path, name), "stop_after": k},
                 {"job": "train_grpo", "argv": _args(tmp_path, name, "--resume")}]
    jobs += [{"job": "train_grpo", "argv": _args(tmp_path, "grpo", "--resume", "--eval_only")},
             {"job": "train_grpo", "argv": _args(tmp_path, "full"),
              "expect_exit": str(tmp_path / "refused.txt")}]
    return jobs


@pytest.fixture(scope="module")
def run(shared_launch):
    return shared_launch["test_grpo_resume"]


def _rows(out) -> list:
    with open(out / "metrics.csv") as f:
        return list(csv.DictReader(f))


def _weights(out):
    state = torch.load(out / "checkpoints" / f"step_{TOTAL}" / "mp_rank_00_model_states.pt",
                       weights_only=False)
    return state["module"]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("phase", sorted(STOPS))
def test_a_resumed_run_equals_the_uninterrupted_one(run, phase):
    full, part = run.tmp_path / "full", run.tmp_path / phase
    a, b = _rows(full), _rows(part)
    assert [(r["phase"], int(r["step"])) for r in a] == (
        [("sft", s) for s in range(1, SFT_STEPS + 1)] + [("grpo", s) for s in range(1, STEPS + 1)])
    assert any(float(r["kl"]) > 0 for r in a if r["phase"] == "grpo")
    assert a == b  # every column, every step, bitwise (as printed: repr of the floats)
    summary, resumed = (json.loads((p / "summary.json").read_text()) for p in (full, part))
    assert resumed["resumed_at_step"] == STOPS[phase] and resumed["stopped"] is None
    assert (resumed["sft_steps"], resumed["steps"]) == (SFT_STEPS, STEPS)
    assert resumed["evals"] == summary["evals"]
    assert resumed["checkpoints"]["last"] == str(part / "checkpoints" / f"step_{TOTAL}")
    wa, wb = _weights(full), _weights(part)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    stopped = f"stopped by SIGTERM after step {STOPS[phase]}; continue with --resume"
    assert stopped in run.stdout + run.stderr


@pytest.mark.timeout(900)
def test_eval_only_and_a_rerun_refused(run):
    report = json.loads((run.tmp_path / "grpo" / f"eval_step{TOTAL}.json").read_text())
    full = json.loads((run.tmp_path / "full" / "summary.json").read_text())
    assert report["step"] == TOTAL and report["eval"] == {
        k: full["eval_after"][k] for k in ("reward", "exact")}
    refused = (run.tmp_path / "refused.txt").read_text()
    assert "already holds a run" in refused and "--resume" in refused and "--overwrite" in refused
