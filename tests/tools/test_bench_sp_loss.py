"""tools/bench_sp_loss.py runs end to end at a tiny size, and its two losses (megaloss's chunked
CE and DeepSpeed's TiledFusedLogitsLoss, two independent implementations) agree."""
import csv
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def background_jobs(folder, env):
    """The tool's run, started with the session (tests/conftest.py)."""
    def bench():
        out = folder / "sp.csv"
        return out, subprocess.run(
            [sys.executable, str(REPO / "tools" / "bench_sp_loss.py"), "--seq", "1024", "--sp",
             "1", "2", "--hidden", "32", "--vocab", "500", "--chunk", "128", "--repeats", "1",
             "--threads", "1", "--csv", str(out)], env=env, capture_output=True, text=True,
            timeout=800)
    return {"bench": bench}


@pytest.mark.slow
@pytest.mark.timeout(1500)  # it waits for the background jobs before its own (nice 10)
@pytest.mark.background("bench")
def test_bench_sp_loss_runs_and_losses_agree(background):
    out, proc = background
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = list(csv.DictReader(out.open()))
    assert [int(r["tokens_per_rank"]) for r in rows] == [1024, 512]
    for r in rows:
        assert float(r["loss_abs_diff"]) < 1e-5, r
        assert float(r["megaloss_s"]) > 0 and float(r["tiled_s"]) > 0
