"""The LM job under DeepSpeed's pipeline engine from the README command:
``NUM_PROCS=4 bash launch/train_lm.sh --pipeline_parallel_size 2 --tie_word_embeddings``
(DP=1 x TP=2 x PP=2; the default ZeRO-2 config runs at ZeRO-1, the pipeline engine's limit, and
the job says so; the input embedding on the first stage tied to the lm_head on the last), with
``--activation_checkpointing`` (every pipeline layer checkpointed, non-reentrant), a tiny model
for a few steps; summary.json records the layout, every rank's peak memory, and the loss falls.
(Checkpointing against the run without it: tests/integrations/
test_deepspeed_pipeline_checkpointing.py.) (Exactness of the pipeline against one device:
tests/integrations/test_deepspeed_pipeline.py.)

The script's command (``DRY_RUN=1`` prints it; checked in test_train_lm_sequence_parallel.py) is
what runs: its job arguments are a job of the 4-process launch that file shares
(``shared_launch_4procs`` in shared_launches.py)."""
import json

import pytest

from tests.helpers.launch_helpers import script_command

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow,
              pytest.mark.xdist_group("shared_launch_4procs")]


def shared_launch_4procs_jobs(tmp_path) -> list:
    """``NUM_PROCS=4 bash launch/train_lm.sh ARGS``'s job: the arguments it gives train_lm.py."""
    args = ["--pipeline_parallel_size", "2", "--tie_word_embeddings", "--model_size", "tiny",
            "--seq_len", "32", "--vocab_size", "320", "--steps", "6",
            "--max_train_bytes", "200000", "--eval_blocks", "8", "--activation_checkpointing",
            "--output_dir", str(tmp_path / "pp"), "--cache_dir", str(tmp_path / "cache"),
            "--no_progress"]
    return [{"job": "train_lm", "argv": script_command("train_lm.sh", *args, NUM_PROCS="4")[6:]}]


@pytest.mark.timeout(900)
def test_lm_job_runs_with_pipeline_parallelism(shared_launch_4procs):
    run = shared_launch_4procs["test_train_lm_pipeline"]
    assert "asks for ZeRO-2, running at ZeRO-1" in run.outputs[0]
    summary = json.loads((run.tmp_path / "pp" / "summary.json").read_text())
    assert (summary["dp"], summary["tp"], summary["pp"], summary["zero_stage"]) == (1, 2, 2, 1)
    assert len(summary["peak_memory_mib_per_rank"]) == 4
    assert summary["activation_checkpointing"] is True
    assert summary["last_loss"] < summary["first_loss"]
