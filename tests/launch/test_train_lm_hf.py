"""End to end: ``bash launch/train_lm_hf.sh`` (``deepspeed --num_gpus 2`` on CPU, ZeRO-2 from
``configs/zero2_hf.json``, ``MegalossTrainer``), as the README runs it (the script's command is
checked with ``DRY_RUN=1``; its job is one of the Trainer jobs' shared launch,
``shared_launch_hf`` in shared_launches.py), shrunk: a tiny Llama, 32-token blocks, 12 steps on
200 kB of the built-in stdlib text, with ``--report_to wandb`` under ``WANDB_MODE=offline``.

Checks what a user sees: exit status 0, ``summary.json`` with finite held-out CE / perplexity
that fall, the logged train loss falling, ``metrics.csv`` (global valid tokens per step = the
global batch's tokens: micro-batch 4 x GAS 2 x DP 2 x 32), the plot, and the offline W&B run in
``<output_dir>/wandb`` holding the Trainer's ``train/loss`` and the held-out ``eval/loss``.
"""
import csv
import importlib.util
import json
import math
import subprocess
import sys

import pytest

from tests.helpers.launch_helpers import assert_launches, script_command

pytestmark = [pytest.mark.deepspeed, pytest.mark.distributed, pytest.mark.slow,
              pytest.mark.xdist_group("shared_launch_hf")]

STEPS = 12


def wandb_tags(run_dir):
    """The history tags of an offline W&B run (wandb's own reader)."""
    proc = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json",
                           str(run_dir)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tags = set()
    for line in proc.stdout.splitlines():
        record = json.loads(line)
        if record.get("type") == "history":
            tags.update(record["history"]["item"])
    return tags


def _args(tmp_path) -> list:
    return ["--steps", str(STEPS), "--model_size", "tiny", "--seq_len", "32",
            "--vocab_size", "320", "--max_train_bytes", "200000", "--eval_blocks", "16",
            "--eval_every", "6", "--lr", "1e-2", "--warmup_steps", "2", "--logging_steps", "1",
            "--report_to", "wandb", "--output_dir", str(tmp_path / "out"),
            "--cache_dir", str(tmp_path / "cache"), "--no_progress"]


def shared_launch_hf_jobs(tmp_path) -> list:
    """``NUM_PROCS=2 bash launch/train_lm_hf.sh ARGS``'s job (the arguments the script gives
    train_lm_hf.py), in the Trainer jobs' shared launch (shared_launches.py); W&B offline, its
    folders unset and its default cache folder (``XDG_CACHE_HOME``) in ``tmp_path``, for this
    job only (the job sets ``WANDB_DIR`` / ``WANDB_PROJECT`` where unset: restored after it)."""
    if importlib.util.find_spec("wandb") is None:
        return []
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": None,
           "WANDB_CACHE_DIR": None, "WANDB_PROJECT": None,
           "XDG_CACHE_HOME": str(tmp_path / "xdg-cache")}  # wandb-core's default log folder
    cmd = script_command("train_lm_hf.sh", *_args(tmp_path), NUM_PROCS="2")
    return [{"job": "train_lm_hf", "env": env, "argv": cmd[6:]}]


def test_script_launches_the_job_with_the_hf_config(tmp_path):
    cmd = script_command("train_lm_hf.sh", *_args(tmp_path), NUM_PROCS="2")
    assert_launches(cmd, 2, "train_lm_hf", "zero2_hf", [*_args(tmp_path)])


@pytest.mark.timeout(900)
def test_train_lm_hf(shared_launch_hf):
    pytest.importorskip("wandb")
    run = shared_launch_hf["test_train_lm_hf"]
    tmp_path, out = run.tmp_path, run.tmp_path / "out"
    assert "Gradient accumulation steps mismatch" not in run.outputs[0] + run.errors[0]

    summary = json.loads((out / "summary.json").read_text())
    before, after = summary["eval_before"], summary["eval_after"]
    for e in summary["evals"]:
        assert math.isfinite(e["loss"]) and math.isfinite(e["perplexity"]), e
    assert [e["step"] for e in summary["evals"]] == [0, 6, STEPS]
    assert after["loss"] < before["loss"] - 0.1, (before, after)
    assert after["perplexity"] < before["perplexity"]
    assert (summary["dp"], summary["micro_batch"], summary["gas"]) == (2, 4, 2)
    assert summary["steps"] == STEPS and summary["zero_stage"] == 2

    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))
    loss = [float(r["loss"]) for r in rows]
    assert all(math.isfinite(x) and x > 0 for x in loss)
    assert sum(loss[-3:]) / 3 < sum(loss[:3]) / 3 - 0.1, loss
    for r in rows:  # the calibrated step covers every token of the global batch
        assert float(r["num_valid_tokens"]) == 4 * 2 * 2 * 32
        assert float(r["ce_loss"]) + float(r["z_loss"]) == pytest.approx(float(r["loss"]),
                                                                          rel=1e-3)
    assert (out / "loss_curve.png").stat().st_size > 0

    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((out / "wandb").iterdir()) if (out / "wandb").exists() else out
    assert not (tmp_path / "xdg-cache" / "wandb").exists()  # nothing of W&B's in ~/.cache
    tags = wandb_tags(runs[0])
    assert {"train/loss", "train/ce_loss", "eval/loss", "eval/perplexity"} <= tags, tags
