"""The LM job with DeepSpeed-Ulysses sequence parallelism from the README command:
``NUM_PROCS=4 bash launch/train_lm.sh --sequence_parallel_size 2`` (DP=1 x SP=2 x TP=2 with the
default ZeRO-2 config), a tiny model for a few steps; summary.json records the layout and the loss
falls; the 12 held-out blocks make a full and a partial evaluation batch. (Exactness of SP against
one device: tests/integrations/test_deepspeed_sequence_parallel.py.)

The script's command (``DRY_RUN=1`` prints it: ``deepspeed --num_gpus 4 ... train_lm.py
--deepspeed_config configs/zero2.json ARGS``) is what runs: its job arguments are a job of the
4-process launch test_train_lm_pipeline.py shares (``shared_launch_4procs`` in
shared_launches.py)."""
import json

import pytest

from tests.helpers.launch_helpers import assert_launches, script_command

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow,
              pytest.mark.xdist_group("shared_launch_4procs")]


def _args(tmp_path) -> list:
    return ["--sequence_parallel_size", "2", "--model_size", "tiny", "--seq_len", "32",
            "--vocab_size", "320", "--steps", "6", "--max_train_bytes", "200000",
            "--eval_blocks", "12", "--output_dir", str(tmp_path / "sp"),
            "--cache_dir", str(tmp_path / "cache"), "--no_progress"]


def shared_launch_4procs_jobs(tmp_path) -> list:
    """``NUM_PROCS=4 bash launch/train_lm.sh ARGS``'s job: the arguments it gives train_lm.py."""
    return [{"job": "train_lm", "argv": script_command("train_lm.sh", *_args(tmp_path),
                                                       NUM_PROCS="4")[6:]}]


def test_script_launches_four_processes_with_the_zero2_config(tmp_path):
    cmd = script_command("train_lm.sh", *_args(tmp_path), NUM_PROCS="4")
    assert_launches(cmd, 4, "train_lm", "zero2", [*_args(tmp_path)])


@pytest.mark.timeout(900)
def test_lm_job_runs_with_sequence_parallelism(shared_launch_4procs):
    out = shared_launch_4procs["test_train_lm_sequence_parallel"].tmp_path / "sp"
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["dp"], summary["sp"], summary["tp"]) == (1, 2, 2)
    assert summary["last_loss"] < summary["first_loss"]
