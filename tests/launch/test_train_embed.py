"""End to end: the embedding job (``launch.train_embed``) under ``deepspeed --num_gpus 2`` on
CPU, shrunk; its three runs are jobs of the launch several test files share (``shared_launch``
in shared_launches.py: process start-up costs more than these tiny jobs).

- The job (tiny encoder, four stdlib packages as user data, 24 steps of micro-batch 8 x GAS 2 x
  DP 2). Checks what a user sees: exit status 0, ``metrics.csv`` with one row per optimizer step,
  the ``csv_monitor`` files DeepSpeed writes from ``engine.monitor`` (MNR loss and in-batch
  accuracy, held-out MRR@10), the PNG plot, the summary, the measured engine multiplier (GAS x
  DP), and that training works: the global MNR loss falls.
- GradCache (``--mini_batch_size``) trains exactly as without it: two runs from the same seed, no
  dropout, micro-batch 6 x GAS 2 x DP 2, ZeRO-2 (the job's default config), one plain, one with
  ``--mini_batch_size 4`` (replays of 4 and 2 pairs). Every optimizer step's logged global loss,
  in-batch accuracy and gradient norm agree (rel 1e-4: fp32, summation order), so the optimizer
  steps between them did too.
"""
import csv
import json

import pytest

from launch.jobs.code_search import stdlib_root
from tests.helpers.launch_helpers import monitor_column

pytestmark = [pytest.mark.deepspeed, pytest.mark.distributed, pytest.mark.slow,
              pytest.mark.xdist_group("shared_launch")]

STEPS = 24


def _grad_cache_args(out, cache, *extra):
    return ["--train_data", str(stdlib_root() / "email"), "--eval_fraction", "0.2",
            "--max_eval", "32", "--max_train", "200", "--steps", "4", "--micro_batch_size", "6",
            "--gradient_accumulation_steps", "2", "--model_size", "tiny", "--vocab_size", "320",
            "--max_doc_len", "32", "--dropout", "0", "--warmup_steps", "1",
            "--output_dir", str(out), "--cache_dir", str(cache), "--no_progress", *extra]


def shared_launch_jobs(tmp_path) -> list:
    """The job, then the plain and the GradCache run (in the shared launch, shared_launches.py)."""
    data = [str(stdlib_root() / d) for d in ("email", "asyncio", "http", "importlib")]
    job = ["--train_data", *data, "--eval_fraction", "0.2", "--max_eval", "96",
           "--steps", str(STEPS), "--micro_batch_size", "8", "--gradient_accumulation_steps",
           "2", "--model_size", "tiny", "--vocab_size", "512", "--max_doc_len", "64",
           "--lr", "3e-3", "--warmup_steps", "2", "--output_dir", str(tmp_path / "out"),
           "--cache_dir", str(tmp_path / "cache"), "--no_progress"]
    return [
        {"job": "train_embed", "argv": job},
        {"job": "train_embed", "argv": _grad_cache_args(tmp_path / "plain", tmp_path / "cache")},
        {"job": "train_embed", "argv": _grad_cache_args(tmp_path / "cached", tmp_path / "cache",
                                                        "--mini_batch_size", "4")}]


@pytest.fixture(scope="module")
def runs(shared_launch):
    """Rank 0's output of the job and the folder holding the runs' output folders."""
    run = shared_launch["test_train_embed"]
    return run.outputs[0], run.tmp_path


@pytest.mark.timeout(900)
def test_train_embed_launcher(runs):
    stdout, tmp_path = runs
    out = tmp_path / "out"
    assert "before training: held-out MRR@10" in stdout

    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert 0 <= float(r["accuracy"]) <= 1 and float(r["loss"]) > 0
        assert float(r["grad_norm"]) > 0 and float(r["pairs_per_s"]) > 0
        assert float(r["lr"]) > 0 and float(r["peak_memory_mib"]) > 0
    loss = [float(r["loss"]) for r in rows]
    # micro-batch of 16 global pairs: log(16) = 2.77 at chance; it must fall clearly
    assert sum(loss[-4:]) / 4 < sum(loss[:4]) / 4 - 0.3, loss

    summary = json.loads((out / "summary.json").read_text())
    assert (summary["dp"], summary["gas"], summary["global_batch"]) == (2, 2, 32)
    assert summary["engine_loss_multiplier"] == 4  # GAS x DP, measured on the real engine
    assert summary["train_pairs"] > 300 and summary["eval_pairs"] == 96
    for key in ("eval_before", "eval_after"):
        assert 0 < summary[key]["mrr@10"] <= 1 and 0 <= summary[key]["recall@1"] <= 1
    assert (out / "loss_curve.png").stat().st_size > 0

    # engine.monitor -> csv_monitor: <output_dir>/monitor/<job_name>/<tag with / -> _>.csv
    monitor = out / "monitor" / "megaloss"
    assert monitor_column(monitor / "Train_megaloss_mnr_loss.csv") == pytest.approx(loss, rel=1e-6)
    assert monitor_column(monitor / "Train_megaloss_mnr_accuracy.csv") == pytest.approx(
        [float(r["accuracy"]) for r in rows], rel=1e-6)
    assert monitor_column(monitor / "Eval_megaloss_mrr@10.csv") == pytest.approx(
        [summary["eval_before"]["mrr@10"], summary["eval_after"]["mrr@10"]], rel=1e-6)


def _outputs(out):
    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    return rows, json.loads((out / "summary.json").read_text())


@pytest.mark.timeout(900)
def test_mini_batch_size_trains_like_plain(runs):
    plain, _ = _outputs(runs[1] / "plain")
    cached, summary = _outputs(runs[1] / "cached")
    assert summary["mnr"]["mini_batch_size"] == 4
    assert len(plain) == len(cached) == 4
    for a, b in zip(plain, cached):
        for key in ("loss", "accuracy", "grad_norm"):
            assert float(b[key]) == pytest.approx(float(a[key]), rel=1e-4), (a["step"], key)
