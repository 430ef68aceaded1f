"""Smoke test of tools/bench_mnr.py: runs end to end at a tiny size on 2 ranks, and its numbers
are finite and self-consistent (one global batch gives one loss for local_loss on/off and for the
plain-autograd comparison). One spawn of 2 ranks keeps it cheap; exactness across world sizes is
tested in test_mnr_distributed.py."""
from __future__ import annotations

import csv
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench(tmp_path, *args):
    out = tmp_path / "mnr.csv"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_mnr.py"),
                           "--batches", "8", "--worlds", "2", "--dim", "16", "--csv",
                           str(out), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=240, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(out, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_mnr_tiny(tmp_path):
    rows = _bench(tmp_path, "--impl", "both")
    assert [(r["world"], r["impl"], r["local_loss"]) for r in rows] == [
        ("2", impl, local) for impl in ("megaloss", "naive") for local in ("True", "False")]
    for r in rows:
        assert float(r["time_ms"]) > 0 and float(r["peak_MiB"]) >= 0
        assert math.isfinite(float(r["loss"]))
    losses = [float(r["loss"]) for r in rows]  # one global batch: one loss (float32 sums)
    assert max(losses) - min(losses) <= 1e-4 * abs(losses[0]) + 1e-6
