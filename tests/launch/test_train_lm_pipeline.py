"""The LM job under DeepSpeed's pipeline engine from the README command:
``NUM_PROCS=4 bash launch/train_lm.sh --pipeline_parallel_size 2 --tie_word_embeddings``
(DP=1 x TP=2 x PP=2; the default ZeRO-2 config runs at ZeRO-1, the pipeline engine's limit, and
the job says so; the input embedding on the first stage tied to the lm_head on the last), a tiny
model for a few steps; summary.json records the layout, every rank's peak memory, and the loss
falls. (Exactness of the pipeline against one device:
tests/integrations/test_deepspeed_pipeline.py.)"""
import json
import subprocess

import pytest
from launch_helpers import REPO, script_env

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow]


@pytest.mark.timeout(400)
def test_lm_job_runs_with_pipeline_parallelism(tmp_path):
    out = tmp_path / "pp"
    env = script_env(NUM_PROCS="4")
    proc = subprocess.run(
        ["bash", str(REPO / "launch" / "train_lm.sh"), "--pipeline_parallel_size", "2",
         "--tie_word_embeddings",
         "--model_size", "tiny", "--seq_len", "32", "--vocab_size", "320", "--steps", "6",
         "--max_train_bytes", "200000", "--eval_blocks", "8", "--output_dir", str(out),
         "--cache_dir", str(tmp_path / "cache"), "--no_progress"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=380)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "asks for ZeRO-2, running at ZeRO-1" in log
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["dp"], summary["tp"], summary["pp"], summary["zero_stage"]) == (1, 2, 2, 1)
    assert len(summary["peak_memory_mib_per_rank"]) == 4
    assert summary["last_loss"] < summary["first_loss"]
