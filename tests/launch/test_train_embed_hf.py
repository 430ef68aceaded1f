"""End to end: ``bash launch/train_embed_hf.sh`` (``deepspeed --num_gpus 2`` on CPU, ZeRO-2 from
``configs/zero2_hf.json``), as the README runs it, shrunk: a tiny BERT, four stdlib packages as
user data (96 held-out pairs), 30 steps of 16 pairs per rank.

Checks what a user sees: exit status 0, ``summary.json`` with finite metrics, held-out MRR@10
rising, the logged MNR loss falling, ``metrics.csv`` and the plot. With ``--mini_batch_size``
(the cached / GradCache loss), the same checks, skipped until
``CachedGatheredMultipleNegativesRankingLoss`` exists in
``megaloss.integrations.hf.sentence_transformers``.
"""
import csv
import json
import math
import subprocess

import pytest
from launch_helpers import REPO, script_env

from launch.jobs.code_search import stdlib_root

pytestmark = [pytest.mark.deepspeed, pytest.mark.distributed, pytest.mark.slow]

STEPS = 30


def run_job(tmp_path, out, *extra, timeout=170):
    data = [str(stdlib_root() / d) for d in ("email", "asyncio", "http", "importlib")]
    env = script_env(NUM_PROCS="2")
    cmd = ["bash", str(REPO / "launch" / "train_embed_hf.sh"),
           "--train_data", *data, "--eval_fraction", "0.2", "--max_eval", "96",
           "--steps", str(STEPS), "--batch_size", "16", "--model_size", "tiny",
           "--vocab_size", "512", "--max_seq_len", "64", "--lr", "3e-3", "--warmup_steps", "2",
           "--logging_steps", "1", "--eval_batch_size", "64", "--output_dir", str(out),
           "--cache_dir", str(tmp_path / "cache"), "--no_progress", *extra]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=timeout)


def check_run(out, proc):
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "before training: held-out MRR@10" in proc.stdout
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


@pytest.mark.timeout(400)
def test_train_embed_hf(tmp_path):
    out = tmp_path / "out"
    summary = check_run(out, run_job(tmp_path, out))
    assert summary["loss"] == "GatheredMultipleNegativesRankingLoss"
    assert summary["loss_config"]["symmetric"] and summary["loss_config"]["scale"] == 20.0


@pytest.mark.timeout(400)
def test_train_embed_hf_cached_loss(tmp_path):
    st = pytest.importorskip("megaloss.integrations.hf.sentence_transformers")
    if not hasattr(st, "CachedGatheredMultipleNegativesRankingLoss"):
        pytest.skip("CachedGatheredMultipleNegativesRankingLoss not in megaloss yet")
    out = tmp_path / "cached"
    summary = check_run(out, run_job(tmp_path, out, "--mini_batch_size", "4"))
    assert summary["loss"] == "CachedGatheredMultipleNegativesRankingLoss"
    assert summary["mini_batch_size"] == 4
