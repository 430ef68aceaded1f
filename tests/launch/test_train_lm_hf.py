"""End to end: ``bash launch/train_lm_hf.sh`` (``deepspeed --num_gpus 2`` on CPU, ZeRO-2 from
``configs/zero2_hf.json``, ``MegalossTrainer``), as the README runs it, shrunk: a tiny Llama,
32-token blocks, 12 steps on 200 kB of the built-in stdlib text, with ``--report_to wandb`` under
``WANDB_MODE=offline``.

Checks what a user sees: exit status 0, ``summary.json`` with finite held-out CE / perplexity
that fall, the logged train loss falling, ``metrics.csv`` (global valid tokens per step = the
global batch's tokens: micro-batch 4 x GAS 2 x DP 2 x 32), the plot, and the offline W&B run in
``<output_dir>/wandb`` holding the Trainer's ``train/loss`` and the held-out ``eval/loss``.
"""
import csv
import json
import math
import subprocess
import sys

import pytest
from launch_helpers import REPO, script_env

pytestmark = [pytest.mark.deepspeed, pytest.mark.distributed, pytest.mark.slow]

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


@pytest.mark.timeout(400)
def test_train_lm_hf(tmp_path):
    pytest.importorskip("wandb")
    out = tmp_path / "out"
    env = script_env(NUM_PROCS="2", WANDB_MODE="offline", WANDB_SILENT="true")
    env.pop("WANDB_DIR", None)
    env.pop("WANDB_CACHE_DIR", None)
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg-cache")  # wandb-core's default log folder
    proc = subprocess.run(
        ["bash", str(REPO / "launch" / "train_lm_hf.sh"), "--steps", str(STEPS),
         "--model_size", "tiny", "--seq_len", "32", "--vocab_size", "320",
         "--max_train_bytes", "200000", "--eval_blocks", "16", "--eval_every", "6",
         "--lr", "1e-2", "--warmup_steps", "2", "--logging_steps", "1",
         "--report_to", "wandb", "--output_dir", str(out),
         "--cache_dir", str(tmp_path / "cache"), "--no_progress"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=380)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "Gradient accumulation steps mismatch" not in proc.stdout + proc.stderr

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
