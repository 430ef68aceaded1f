"""Smoke tests of the benchmark tools: each runs end to end at tiny sizes, and its CSV has the
expected rows with finite numbers and self-consistent content (eager and megaloss agree on the
loss; the vocab-parallel loss does not change with TP and the counted collective bytes are the
known ones)."""
from __future__ import annotations

import csv
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(ROOT, "tools")


def _run(script: str, *args: str, timeout: float = 240) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.join(TOOLS, script), *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _read_csv(path) -> list:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _finite(row: dict, keys) -> None:
    for k in keys:
        value = float(row[k])
        assert math.isfinite(value), f"{k} = {row[k]!r} is not finite"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_ce_tiny(tmp_path):
    out_csv, out_png = tmp_path / "ce.csv", tmp_path / "ce.png"
    stdout = _run("bench_ce.py", "--sizes", "96", "--hidden", "32", "--vocab", "300",
                  "--chunk-size", "32", "--repeats", "1", "--threads", "1", "--no-cuda",
                  "--csv", str(out_csv), "--plot", str(out_png))
    assert "megaloss_s" in stdout and "mem_ratio" in stdout
    rows = _read_csv(out_csv)
    assert [(r["device"], r["dtype"], r["tokens"]) for r in rows] == [("cpu", "float32", "96")]
    row = rows[0]
    _finite(row, ["eager_s", "megaloss_s", "time_ratio", "gemm3_s", "roofline", "eager_MiB",
                  "megaloss_MiB", "mem_ratio", "loss_eager", "loss_megaloss"])
    for k in ("eager_s", "megaloss_s", "gemm3_s"):
        assert float(row[k]) > 0
    for k in ("eager_MiB", "megaloss_MiB"):
        assert float(row[k]) >= 0
    # Same inputs, same loss (fp32, 96 tokens): a broken tool or loss shows here.
    assert abs(float(row["loss_eager"]) - float(row["loss_megaloss"])) < 1e-4
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_bench_vocab_parallel_tiny(tmp_path):
    out_csv = tmp_path / "vp.csv"
    hidden = 16
    stdout = _run("bench_vocab_parallel.py", "--tp", "1", "2", "--tokens", "64", "--hidden",
                  str(hidden), "--vocab", "101", "--chunk-size", "32", "--repeats", "1",
                  "--cpus", "1", "--csv", str(out_csv))
    assert "fwd_B_per_token" in stdout
    rows = _read_csv(out_csv)
    assert [r["tp"] for r in rows] == ["1", "2"]
    for r in rows:
        _finite(r, ["time_s", "extra_MiB", "extra_MiB_min", "mem_vs_tp1", "loss"])
        assert float(r["time_s"]) > 0 and float(r["extra_MiB"]) >= 0
        assert r["loss_same_on_all_ranks"] == "True" and r["comm_ok"] == "True"
    # V=101 is not divisible by 2: the padded row must not change the loss.
    assert abs(float(rows[0]["loss"]) - float(rows[1]["loss"])) < 1e-5
    # Known collectives: none at TP=1; 2 per chunk (MAX [C] + SUM [2, C], fp32) = 12 B/token in
    # forward and the d_hidden all-reduce (4H B/token) in backward at TP=2.
    assert float(rows[0]["fwd_B_per_token"]) == 0 and float(rows[0]["bwd_B_per_token"]) == 0
    assert float(rows[1]["fwd_B_per_token"]) == 12.0
    assert int(rows[1]["fwd_calls"]) == 2 * 2  # 64 tokens / chunk 32 = 2 chunks
    assert float(rows[1]["bwd_B_per_token"]) == 4.0 * hidden
