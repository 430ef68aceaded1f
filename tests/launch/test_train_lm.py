"""End to end: ``deepspeed --num_gpus 2 launch/train_lm.py`` on CPU with the shipped ZeRO 0/1/2/3
configs (shrunk: tiny Llama, 32-token blocks, 6 steps, 200 kB of the built-in stdlib text).

Checks what a user sees: exit status 0, ``metrics.csv`` with one row per optimizer step and the
calibrated metrics, the ``csv_monitor`` files DeepSpeed writes from ``engine.monitor``, the PNG
plot, and that training works: held-out cross-entropy and the train loss both fall.
Layouts: ZeRO-0, ZeRO-1 and ZeRO-3 with DP=2 x TP=1 (ZeRO really partitions), ZeRO-2 with
DP=1 x TP=2 (the main job's layout: vocab-parallel CE, here with ``--tie_word_embeddings``: the
input embedding on the lm_head's vocab shard, and ``--activation_checkpointing``: transformers'
non-reentrant gradient checkpointing of every decoder layer). The four layouts are jobs of the
launch several test files share (``shared_launch`` in shared_launches.py: process start-up costs
more than these tiny jobs).
"""
import csv
import json
from pathlib import Path

import pytest

from tests.helpers.launch_helpers import REPO, monitor_column

pytestmark = [pytest.mark.deepspeed, pytest.mark.distributed, pytest.mark.slow,
              pytest.mark.xdist_group("shared_launch")]

STEPS = 6


LAYOUTS = [(0, 1), (1, 1), (2, 2), (3, 1)]  # (ZeRO stage, TP) on 2 processes


def _ds_config(stage: int, tp: int) -> dict:
    cfg = json.loads((REPO / "configs" / f"zero{stage}.json").read_text())
    cfg.update(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2)
    cfg.pop("scheduler")  # no warm-up: the loss must move within a few steps
    cfg["optimizer"]["params"]["lr"] = 1e-2
    cfg["megaloss"]["tensor_parallel_size"] = tp
    cfg["megaloss"]["ce"]["chunk_size"] = 48  # several chunks per micro-batch
    cfg["csv_monitor"]["job_name"] = "test"
    return cfg


def _job_args(ds_config, out, cache) -> list:
    return ["--deepspeed_config", str(ds_config), "--steps", str(STEPS), "--model_size", "tiny",
            "--seq_len", "32", "--vocab_size", "320", "--max_train_bytes", "200000",
            "--eval_blocks", "16", "--eval_every", "3", "--output_dir", str(out),
            "--cache_dir", str(cache), "--no_progress"]


def shared_launch_jobs(tmp_path) -> list:
    """The four layouts, in the shared launch (shared_launches.py); output in
    ``out-zero<stage>``."""
    jobs = []
    for stage, tp in LAYOUTS:
        ds_config = tmp_path / f"zero{stage}-tp{tp}.json"
        ds_config.write_text(json.dumps(_ds_config(stage, tp)))
        argv = _job_args(ds_config, tmp_path / f"out-zero{stage}", tmp_path / "cache")
        extra = ["--tie_word_embeddings", "--activation_checkpointing"] * (tp == 2)
        jobs.append({"job": "train_lm", "argv": argv + extra})
    return jobs


@pytest.mark.timeout(900)
@pytest.mark.parametrize("stage,tp", LAYOUTS, ids=lambda v: str(v))
def test_train_lm_under_deepspeed_launcher(shared_launch, stage, tp):
    _check_outputs(shared_launch["test_train_lm"].tmp_path / f"out-zero{stage}", stage, tp)


def _check_outputs(out: Path, stage: int, tp: int) -> None:
    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert float(r["num_tokens"]) > 0 and float(r["lr"]) == pytest.approx(1e-2)
        assert float(r["grad_norm"]) > 0 and float(r["tokens_per_s"]) > 0
        assert float(r["peak_memory_mib"]) > 0 and float(r["z_loss"]) > 0
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["dp"], summary["tp"], summary["zero_stage"]) == (2 // tp, tp, stage)
    assert summary["activation_checkpointing"] is (tp == 2)
    assert summary["engine_loss_multiplier"] == 2 * (2 // tp)  # GAS x DP, measured
    assert summary["eval_after"]["loss"] < summary["eval_before"]["loss"] - 0.05, summary
    assert float(rows[-1]["loss"]) < float(rows[0]["loss"]) - 0.05, (stage, rows)
    assert (out / "loss_curve.png").stat().st_size > 0

    # engine.monitor -> csv_monitor: <output_dir>/monitor/<job_name>/<tag with / -> _>.csv
    monitor = out / "monitor" / "test"
    logged = monitor_column(monitor / "Train_megaloss_loss.csv")
    assert logged == pytest.approx([float(r["loss"]) for r in rows], rel=1e-6)
    for tag in ("num_tokens", "z_loss", "lr", "grad_norm", "tokens_per_s", "peak_memory_mib"):
        assert (monitor / f"Train_megaloss_{tag}.csv").exists(), tag
    assert (monitor / "Eval_megaloss_perplexity.csv").exists()
