"""End to end: the job ``bash launch/train_embed_hf.sh`` runs (``deepspeed --num_gpus 2`` on CPU,
ZeRO-2 from ``configs/zero2_hf.json``; the script's command is checked with ``DRY_RUN=1``, and
the two runs are jobs of the Trainer jobs' shared launch, ``shared_launch_hf`` in
shared_launches.py), as the README runs it, shrunk: a tiny BERT, four stdlib packages as user
data (96 held-out pairs), 30 steps of 16 pairs per rank.

Checks what a user sees: exit status 0, ``summary.json`` with finite metrics, held-out MRR@10
rising, the logged MNR loss falling, ``metrics.csv`` and the plot. With ``--mini_batch_size``
(the cached / GradCache loss), the same checks, skipped until
``CachedGatheredMultipleNegativesRankingLoss`` exists in
``megaloss.integrations.hf.sentence_transformers``.
"""
import csv
import json
import math

import pytest

from launch.jobs.code_search import stdlib_root
from tests.helpers.launch_helpers import REPO, assert_launches, script_command

pytestmark = [pytest.mark.deepspeed, pytest.mark.distributed, pytest.mark.slow,
              pytest.mark.xdist_group("shared_launch_hf")]

STEPS = 30


def _args(tmp_path, out, *extra):
    data = [str(stdlib_root() / d) for d in ("email", "asyncio", "http", "importlib")]
    return ["--train_data", *data, "--eval_fraction", "0.2", "--max_eval", "96",
            "--steps", str(STEPS), "--batch_size", "16", "--model_size", "tiny",
            "--vocab_size", "512", "--max_seq_len", "64", "--lr", "3e-3", "--warmup_steps", "2",
            "--logging_steps", "1", "--eval_batch_size", "64", "--output_dir", str(out),
            "--cache_dir", str(tmp_path / "cache"), "--no_progress", *extra]


def _has_cached_loss() -> bool:
    try:
        from megaloss.integrations.hf import sentence_transformers as st
    except ImportError:
        return False
    return hasattr(st, "CachedGatheredMultipleNegativesRankingLoss")


def test_script_launches_the_job_with_the_hf_config():
    """What ``bash launch/train_embed_hf.sh ARGS`` runs (``DRY_RUN=1`` prints it): ``deepspeed
    --num_gpus 2`` on train_embed_hf.py with configs/zero2_hf.json, then ARGS. The launch below
    runs that command's job (its exec path, launch/multinode.sh, is the other scripts' too:
    test_multinode.py, test_train_lm_hf.py)."""
    cmd = script_command("train_embed_hf.sh", "--steps", "3")
    assert_launches(cmd, 2, "train_embed_hf", "zero2_hf", ["--steps", "3"])


def _names() -> list:
    return ["out"] + (["cached"] if _has_cached_loss() else [])


def shared_launch_hf_jobs(tmp_path) -> list:
    """The Trainer jobs' launch (``shared_launch_hf`` in shared_launches.py: start-up with
    transformers and sentence-transformers costs more than these tiny jobs): the job as the
    script runs it (``--deepspeed_config configs/zero2_hf.json``), then, where the cached loss
    exists, the same with ``--mini_batch_size 4``."""
    config = ["--deepspeed_config", str(REPO / "configs" / "zero2_hf.json")]
    return [{"job": "train_embed_hf", "argv": config + _args(tmp_path, tmp_path / name, *(
        ["--mini_batch_size", "4"] if name == "cached" else []))} for name in _names()]


@pytest.fixture(scope="module")
def runs(shared_launch_hf):
    """``{name: (output folder, rank 0's output)}`` of the runs."""
    run = shared_launch_hf["test_train_embed_hf"]
    return {name: (run.tmp_path / name, part) for name, part in zip(_names(), run.outputs)}


def check_run(out, stdout):
    assert "before training: held-out MRR@10" in stdout
    summary = json.loads((out / "summary.json").read_text())
    before, after = summary["eval_before"], summary["eval_after"]
    for m in (before, after):
        assert all(math.isfinite(v) and 0 <= v <= 1 for v in m.values()), m
    assert after["mrr@10"] > before["mrr@10"] + 0.02, (before, after)
    assert (summary["dp"], summary["micro_batch"], summary["global_batch"]) == (2, 16, 32)
    assert summary["steps"] == STEPS and summary["zero_stage"] == 2
    assert summary["eval_pairs"] == 96
    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))
    loss = [float(r["loss"]) for r in rows]
    assert all(math.isfinite(x) and x > 0 for x in loss)
    # 32 pairs in the global batch: ln 32 = 3.47 at chance; it must fall clearly
    assert sum(loss[-5:]) / 5 < sum(loss[:5]) / 5 - 0.3, loss
    assert (out / "loss_curve.png").stat().st_size > 0
    return summary


@pytest.mark.timeout(900)
def test_train_embed_hf(runs):
    summary = check_run(*runs["out"])
    assert summary["loss"] == "GatheredMultipleNegativesRankingLoss"
    assert summary["loss_config"]["symmetric"] and summary["loss_config"]["scale"] == 20.0


@pytest.mark.timeout(900)
def test_train_embed_hf_cached_loss(runs):
    if "cached" not in runs:
        pytest.skip("CachedGatheredMultipleNegativesRankingLoss not in megaloss yet")
    summary = check_run(*runs["cached"])
    assert summary["loss"] == "CachedGatheredMultipleNegativesRankingLoss"
    assert summary["mini_batch_size"] == 4
