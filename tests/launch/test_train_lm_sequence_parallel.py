"""The LM job with DeepSpeed-Ulysses sequence parallelism from the README command:
``NUM_PROCS=4 bash launch/train_lm.sh --sequence_parallel_size 2`` (DP=1 x SP=2 x TP=2 with the
default ZeRO-2 config), a tiny model for a few steps; summary.json records the layout and the loss
falls; the 12 held-out blocks make a full and a partial evaluation batch. (Exactness of SP against
one device: tests/integrations/test_deepspeed_sequence_parallel.py.)"""
import json
import subprocess

import pytest
from launch_helpers import REPO, script_env

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow]


@pytest.mark.timeout(400)
def test_lm_job_runs_with_sequence_parallelism(tmp_path):
    out = tmp_path / "sp"
    env = script_env(NUM_PROCS="4")
    proc = subprocess.run(
        ["bash", str(REPO / "launch" / "train_lm.sh"), "--sequence_parallel_size", "2",
         "--model_size", "tiny", "--seq_len", "32", "--vocab_size", "320", "--steps", "6",
         "--max_train_bytes", "200000", "--eval_blocks", "12", "--output_dir", str(out),
         "--cache_dir", str(tmp_path / "cache"), "--no_progress"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=380)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["dp"], summary["sp"], summary["tp"]) == (1, 2, 2)
    assert summary["last_loss"] < summary["first_loss"]
