"""The LM job under DeepSpeed's pipeline engine from the README command:
``NUM_PROCS=4 bash launch/train_lm.sh --pipeline_parallel_size 2 --tie_word_embeddings``
(DP=1 x TP=2 x PP=2; the default ZeRO-2 config runs at ZeRO-1, the pipeline engine's limit, and
the job says so; the input embedding on the first stage tied to the lm_head on the last), with
``--activation_checkpointing`` (every pipeline layer checkpointed, non-reentrant), a tiny model
for a few steps; summary.json records the layout, every rank's peak memory, and the loss falls.
(Checkpointing against the run without it: tests/integrations/
test_deepspeed_pipeline_checkpointing.py.) (Exactness of the pipeline against one device:
tests/integrations/test_deepspeed_pipeline.py.)

Checkpoints under the pipeline engine: the same job stopped after step 3 of 6 the way SIGTERM
stops it (the stop request injected at that step boundary: it saves ``step_3``), then
``--resume`` to step 6 (saving ``step_6``), gives the uninterrupted run's metrics of every step
and final evaluation bitwise; ``--eval_only --resume`` of ``step_6`` reproduces that evaluation.

The script's command (``DRY_RUN=1`` prints it; checked in test_train_lm_sequence_parallel.py) is
what runs: its job arguments are a job of the 4-process launch that file shares
(``shared_launch_4procs`` in shared_launches.py)."""
import csv
import json

import pytest

from tests.helpers.launch_helpers import script_command

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow,
              pytest.mark.xdist_group("shared_launch_4procs")]

# metrics that must match bitwise (the others are timings and memory)
EXACT = ("step", "loss", "z_loss", "num_tokens", "lr", "grad_norm", "samples", "engine_loss")


def _args(out, cache, *extra: str) -> list:
    """``NUM_PROCS=4 bash launch/train_lm.sh ARGS``'s job: the arguments it gives train_lm.py."""
    args = ["--pipeline_parallel_size", "2", "--tie_word_embeddings", "--model_size", "tiny",
            "--seq_len", "32", "--vocab_size", "320", "--steps", "6",
            "--max_train_bytes", "200000", "--eval_blocks", "8", "--activation_checkpointing",
            "--output_dir", str(out), "--cache_dir", str(cache), "--no_progress", *extra]
    return script_command("train_lm.sh", *args, NUM_PROCS="4")[6:]


def shared_launch_4procs_jobs(tmp_path) -> list:
    """The README command's run of 6 steps; the same stopped after step 3 (saving), resumed to
    step 6 (saving) and its last checkpoint evaluated."""
    cache, part = tmp_path / "cache", tmp_path / "pp-part"
    return [{"job": "train_lm", "argv": _args(tmp_path / "pp", cache)},
            {"job": "train_lm", "argv": _args(part, cache), "stop_after": 3},
            {"job": "train_lm", "argv": _args(part, cache, "--resume", "--save_every", "6")},
            {"job": "train_lm", "argv": _args(part, cache, "--resume", "--eval_only")}]


def _rows(out) -> list:
    with open(out / "metrics.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.timeout(900)
def test_lm_job_runs_with_pipeline_parallelism(shared_launch_4procs):
    run = shared_launch_4procs["test_train_lm_pipeline"]
    assert "asks for ZeRO-2, running at ZeRO-1" in run.outputs[0]
    summary = json.loads((run.tmp_path / "pp" / "summary.json").read_text())
    assert (summary["dp"], summary["tp"], summary["pp"], summary["zero_stage"]) == (1, 2, 2, 1)
    assert len(summary["peak_memory_mib_per_rank"]) == 4
    assert summary["activation_checkpointing"] is True
    assert summary["last_loss"] < summary["first_loss"]


@pytest.mark.timeout(900)
def test_pipeline_run_stopped_and_resumed_is_bitwise_identical(shared_launch_4procs):
    run = shared_launch_4procs["test_train_lm_pipeline"]
    full, part = run.tmp_path / "pp", run.tmp_path / "pp-part"
    # the stop request at step 3's boundary saved there
    assert "saved " in run.outputs[1] and "step_3" in run.outputs[1], run.outputs[1]
    assert "resumed from" in run.outputs[2] and "at step 3" in run.outputs[2], run.outputs[2]
    a, b = _rows(full), _rows(part)
    assert [int(r["step"]) for r in a] == list(range(1, 7))
    assert [[r[k] for k in EXACT] for r in a] == [[r[k] for k in EXACT] for r in b]
    want = json.loads((full / "summary.json").read_text())["eval_after"]
    summary = json.loads((part / "summary.json").read_text())
    assert (summary["resumed_at_step"], summary["steps"], summary["stopped"]) == (3, 6, None)
    assert summary["pp"] == 2 and summary["checkpoints"]["saves"] == 1
    assert summary["eval_after"] == want
    # --eval_only --resume (latest: step_6) evaluates the resumed run's checkpoint
    report = json.loads((part / "eval_step6.json").read_text())
    assert report["checkpoint"].endswith("step_6")
    assert {k: report["eval"][k] for k in want if k != "step"} == {
        k: v for k, v in want.items() if k != "step"}
