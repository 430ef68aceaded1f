"""The embedding job with GradCache (``--mini_batch_size``) trains exactly as without it.

Two runs of ``launch.train_embed`` in one ``deepspeed --num_gpus 2`` launch, from the same seed,
no dropout, tiny encoder, micro-batch 6 x GAS 2 x DP 2, ZeRO-2 (the job's default config): one
plain, one with ``--mini_batch_size 4`` (replays of 4 and 2 pairs). Every optimizer step's
logged global loss, in-batch accuracy and gradient norm agree (rel 1e-4: fp32, summation order),
so the optimizer steps between them did too.
"""
import csv
import json

import pytest

from launch_helpers import run_jobs_in_one_launch

from launch.jobs.code_search import stdlib_root

pytestmark = [pytest.mark.deepspeed, pytest.mark.distributed, pytest.mark.slow]


def _args(out, cache, *extra):
    return ["--train_data", str(stdlib_root() / "email"), "--eval_fraction", "0.2",
            "--max_eval", "32", "--max_train", "200", "--steps", "4", "--micro_batch_size", "6",
            "--gradient_accumulation_steps", "2", "--model_size", "tiny", "--vocab_size", "320",
            "--max_doc_len", "32", "--dropout", "0", "--warmup_steps", "1",
            "--output_dir", str(out), "--cache_dir", str(cache), "--no_progress", *extra]


def _outputs(out):
    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    return rows, json.loads((out / "summary.json").read_text())


@pytest.mark.timeout(420)
def test_mini_batch_size_trains_like_plain(tmp_path):
    # both runs in one launch, one after the other in the same processes
    run_jobs_in_one_launch([
        {"job": "train_embed", "argv": _args(tmp_path / "plain", tmp_path / "cache")},
        {"job": "train_embed", "argv": _args(tmp_path / "cached", tmp_path / "cache",
                                             "--mini_batch_size", "4")}],
        tmp_path / "jobs.json", timeout=300)
    plain, _ = _outputs(tmp_path / "plain")
    cached, summary = _outputs(tmp_path / "cached")
    assert summary["mnr"]["mini_batch_size"] == 4
    assert len(plain) == len(cached) == 4
    for a, b in zip(plain, cached):
        for key in ("loss", "accuracy", "grad_norm"):
            assert float(b[key]) == pytest.approx(float(a[key]), rel=1e-4), (a["step"], key)
